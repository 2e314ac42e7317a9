//! Text to batches: WordPiece tokenisation for BERT classifiers ([`TextTokenizer`],
//! [`text_batch`]) and next-token windows over a token stream for language models
//! ([`stream_batch`], [`stream_batches`]).
//!
//! Tokenisation uses Hugging Face's `tokenizers` crate on the model's own `tokenizer.json`
//! (pure Rust, no network), so ids match what the checkpoint was trained with. The file's
//! baked-in padding and truncation are replaced by ours: batches are padded to their longest
//! sample, not to a fixed length, so short batches cost short sequences.

pub mod batch;
pub mod lm;
pub mod tokenizer;

pub use batch::{EncodedItem, TextBatch, TextItem, encoded_batch, text_batch};
pub use lm::{stream_batch, stream_batches};
pub use tokenizer::{Encoded, TextInput, TextTokenizer};
