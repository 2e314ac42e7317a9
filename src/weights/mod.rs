//! Pretrained weights in and out: Hugging Face safetensors checkpoints and `config.json`, and
//! exports that `transformers`, sentence-transformers and our own `predict` load.
//!
//! | file | job |
//! |---|---|
//! | `safetensors.rs` | the file format: [`load_safetensors`] (memory-mapped, validated header), [`TensorFile`] (list, convert F32/F16/BF16/F64), [`write_safetensors`] |
//! | `load.rs` | [`load_into_model`]: file tensors → model parameters by name, with [`LoadOptions`] (prefixes to strip, names to ignore, parameters allowed missing) and a [`LoadReport`]; GPT-2's fused `Conv1D` layout read into our GPT |
//! | `hf_config.rs` | [`read_hf_config`]: `config.json` → [`crate::model::ModelConfig`], refusing unsupported architectures; [`hf_config_json`] for the way back (with `id2label`/`label2id`), [`hf_architecture`] (the class that loads an export) |
//! | `layout.rs` | tensor names and layouts of an export: BERT under `bert.` + `classifier.*` (`BertForSequenceClassification`), ViT as is, GPT as GPT-2 (`c_attn` fused, `Conv1D` transposed) |
//! | `export.rs` | [`export_model`]: a model → `model.safetensors` + `config.json` + companions, all written atomically |
//! | `companions.rs` | [`ExportExtras`] (class names, tokenizer directory, characters, …) and the companion files: the BERT tokenizer and sentence-transformers modules, a character GPT's `vocab.json` + `tokenizer.json`, a ViT's `preprocessor_config.json` |
//! | `pixels.rs` | [`PixelTransform`]: a pretrained ViT's `preprocessor_config.json` (rescale, per-channel normalisation) folded into its patch embedding, so it takes this engine's pixels |
//! | `read.rs` | [`read_export`]: an export directory → [`ExportedModel`] (config, weights path, class names, tokenizer, characters, pixel scale), each file checked with errors that name it |
//!
//! What an export loads as in Python (checked by `scripts/check_export.py`, run from
//! `tests/export_python.rs`):
//!
//! | model | loads whole in | not mapped |
//! |---|---|---|
//! | BERT, `[CLS]` pooler | `BertForSequenceClassification` (same logits); `SentenceTransformer(dir)` gives the `[CLS]` hidden state | sentence-transformers cannot apply the pooler's dense + tanh |
//! | BERT, mean or plain `[CLS]` pooling | `BertModel` (encoder); `SentenceTransformer(dir)` gives our pooled vector exactly | no `transformers` class classifies a mean/plain-`[CLS]` pool: logits = `classifier(pooled)` by hand |
//! | ViT | `ViTForImageClassification` + `ViTImageProcessor` | — |
//! | GPT | `GPT2LMHeadModel` (+ the character tokenizer) | — |
//!
//! Typical use, fine-tuning all-MiniLM-L6-v2:
//!
//! ```no_run
//! use pipetransformer::device::CpuDevice;
//! use pipetransformer::model::{Model, ModelConfig, Pooling};
//! use pipetransformer::weights::{LoadOptions, load_into_model, load_safetensors, read_hf_config};
//!
//! # fn main() -> pipetransformer::Result<()> {
//! let dir = "weights/all-minilm-l6-v2";
//! let mut config = read_hf_config(format!("{dir}/config.json"), None)?;
//! if let ModelConfig::Bert(c) = &mut config {
//!     c.num_labels = 8;
//!     c.pooling = Pooling::Mean;
//! }
//! let dev = CpuDevice::<f32>::new(0, 0)?;
//! // Random weights only where the file has none (drawn after the load, as `Model::new` would).
//! let (mut model, fresh) = Model::new_for_loading(&dev, &config, 42, &|_| true)?;
//! let file = load_safetensors(format!("{dir}/model.safetensors"))?;
//! let report = load_into_model(&mut model, &dev, &file, &LoadOptions::default())?;
//! fresh.draw(&mut model, &dev, &report.missing)?;
//! println!("{report}"); // classifier.* missing (fresh head), pooler.* unexpected (mean pooling)
//! # Ok(())
//! # }
//! ```
//!
//! Reading a run's export back (what `predict` does):
//!
//! ```no_run
//! use pipetransformer::device::CpuDevice;
//! use pipetransformer::model::Model;
//! use pipetransformer::weights::{LoadOptions, load_into_model, load_safetensors, read_export};
//!
//! # fn main() -> pipetransformer::Result<()> {
//! let export = read_export("runs/minilm-rt/model")?; // config, class names, tokenizer, …
//! let dev = CpuDevice::<f32>::new(0, 0)?;
//! // Nothing drawn at random: every weight comes from the file (strict: else an error).
//! let (mut model, _) = Model::new_for_loading(&dev, &export.config, 0, &|_| true)?;
//! load_into_model(&mut model, &dev, &load_safetensors(&export.weights)?, &LoadOptions::strict())?;
//! println!("classes: {:?}, tokenizer: {:?}", export.labels, export.tokenizer);
//! # Ok(())
//! # }
//! ```

pub mod companions;
pub mod export;
pub mod hf_config;
mod layout;
pub mod load;
pub mod pixels;
pub mod read;
pub mod safetensors;

pub use companions::{ExportExtras, PREPROCESSOR_FILE, TOKENIZER_FILE, VOCAB_FILE};
pub use export::{CONFIG_FILE, ExportReport, WEIGHTS_FILE, export_model, export_values};
pub use hf_config::{OWN_GPT_MODEL_TYPE, hf_architecture, hf_config_json, parse_hf_config, read_hf_config};
pub use layout::HostTensor;
pub use load::{LoadOptions, LoadReport, load_into_model};
pub use pixels::{PixelTransform, read_pixel_transform};
pub use read::{ExportedModel, read_export};
pub use safetensors::{Dtype, TensorFile, TensorInfo, TensorRef, load_safetensors, write_safetensors};
