//! Text to token ids: `TextTokenizer` wraps a Hugging Face `tokenizer.json` (WordPiece for
//! BERT) through the pure-Rust `tokenizers` crate, and builds classification batches padded to
//! the longest sequence of each batch.
//!
//! MiniLM's `tokenizer.json` bakes in padding to 128 and truncation at 128; both are replaced
//! here: no padding by the tokenizer (we pad per batch, which for ~20-token review snippets is
//! several times less work than 128), truncation at the run's `max_len`.

use crate::data::TextSample;
use crate::error::{Error, Result};
use crate::model::HostBatch;
use std::path::Path;
use tokenizers::{Tokenizer, TruncationDirection, TruncationParams, TruncationStrategy};

/// A tokenizer with our padding and truncation settings.
pub struct TextTokenizer {
    inner: Tokenizer,
    pad_id: u32,
    max_len: usize,
}

fn tokenizer_error(file: &str, message: impl std::fmt::Display) -> Error {
    Error::Data { what: file.to_string(), message: format!("tokenizer: {message}") }
}

impl TextTokenizer {
    /// Loads `tokenizer.json`; sequences (special tokens included) are truncated to `max_len`.
    pub fn from_file(path: &Path, max_len: usize) -> Result<Self> {
        let file = path.display().to_string();
        if !path.exists() {
            return Err(Error::Io {
                path: file,
                source: std::io::Error::new(
                    std::io::ErrorKind::NotFound,
                    "tokenizer not found: run scripts/setup.sh weights",
                ),
            });
        }
        if max_len < 2 {
            return Err(Error::Config {
                field: "data.max_len".into(),
                message: format!("must be at least 2, got {max_len}"),
            });
        }
        let mut inner = Tokenizer::from_file(path).map_err(|e| tokenizer_error(&file, e))?;
        let pad_id = inner.token_to_id("[PAD]").or_else(|| inner.get_padding().map(|p| p.pad_id)).unwrap_or(0);
        inner.with_padding(None);
        inner
            .with_truncation(Some(TruncationParams {
                max_length: max_len,
                strategy: TruncationStrategy::LongestFirst,
                stride: 0,
                direction: TruncationDirection::Right,
            }))
            .map_err(|e| tokenizer_error(&file, e))?;
        Ok(Self { inner, pad_id, max_len })
    }

    /// The padding token's id.
    pub fn pad_id(&self) -> u32 {
        self.pad_id
    }

    /// The longest sequence produced, special tokens included.
    pub fn max_len(&self) -> usize {
        self.max_len
    }

    /// Token ids and token types of one text (with `[CLS]`/`[SEP]`), or of a pair when
    /// `second` is given (types 0 then 1).
    pub fn encode(&self, text: &str, second: Option<&str>) -> Result<(Vec<u32>, Vec<u32>)> {
        let enc = match second {
            Some(b) => self.inner.encode((text, b), true),
            None => self.inner.encode(text, true),
        }
        .map_err(|e| tokenizer_error("text", e))?;
        Ok((enc.get_ids().to_vec(), enc.get_type_ids().to_vec()))
    }

    /// A classifier batch: each text tokenised, padded with `[PAD]` to the longest in the
    /// batch, attention mask 1 on real tokens, targets the labels.
    pub fn classification_batch(&self, samples: &[&TextSample], sample_offset: u64) -> Result<HostBatch> {
        let encoded: Vec<(Vec<u32>, Vec<u32>)> =
            samples.iter().map(|s| self.encode(&s.text, None)).collect::<Result<_>>()?;
        let seq = encoded.iter().map(|(ids, _)| ids.len()).max().unwrap_or(0).max(1);
        let b = samples.len();
        let (mut tokens, mut types, mut mask) = (vec![self.pad_id; b * seq], vec![0; b * seq], vec![0; b * seq]);
        for (i, (ids, tt)) in encoded.iter().enumerate() {
            tokens[i * seq..i * seq + ids.len()].copy_from_slice(ids);
            types[i * seq..i * seq + tt.len()].copy_from_slice(tt);
            mask[i * seq..i * seq + ids.len()].fill(1);
        }
        Ok(HostBatch {
            batch: b,
            seq,
            tokens: Some(tokens),
            token_types: Some(types),
            attention_mask: Some(mask),
            targets: samples.iter().map(|s| s.label).collect(),
            sample_offset,
            ..Default::default()
        })
    }
}
