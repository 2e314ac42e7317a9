//! Pretrained weights in and out: Hugging Face safetensors checkpoints and `config.json`.
//!
//! | file | job |
//! |---|---|
//! | `safetensors.rs` | the file format: [`load_safetensors`] (memory-mapped, validated header), [`TensorFile`] (list, convert F32/F16/BF16/F64), [`write_safetensors`] |
//! | `load.rs` | [`load_into_model`]: file tensors → model parameters by name, with [`LoadOptions`] (prefixes to strip, names to ignore, parameters allowed missing) and a [`LoadReport`] |
//! | `hf_config.rs` | [`read_hf_config`]: `config.json` → [`crate::model::ModelConfig`], refusing unsupported architectures; [`hf_config_json`] for the way back |
//! | `export.rs` | [`export_model`]: a model → `model.safetensors` + `config.json`, written atomically |
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
//! let mut model = Model::new(&dev, &config, 42)?;
//! let file = load_safetensors(format!("{dir}/model.safetensors"))?;
//! let report = load_into_model(&mut model, &dev, &file, &LoadOptions::default())?;
//! println!("{report}"); // classifier.* missing (fresh head), pooler.* unexpected (mean pooling)
//! # Ok(())
//! # }
//! ```

pub mod export;
pub mod hf_config;
pub mod load;
pub mod safetensors;

pub use export::{CONFIG_FILE, ExportReport, WEIGHTS_FILE, export_model};
pub use hf_config::{OWN_GPT_MODEL_TYPE, hf_config_json, parse_hf_config, read_hf_config};
pub use load::{LoadOptions, LoadReport, load_into_model};
pub use safetensors::{Dtype, TensorFile, TensorInfo, TensorRef, load_safetensors, write_safetensors};
