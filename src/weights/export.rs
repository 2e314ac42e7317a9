//! Writing a model as a Hugging Face-style checkpoint directory: `model.safetensors` (f32, one
//! tensor per parameter under its Hugging Face name) and `config.json`.

use std::io::Write;
use std::path::{Path, PathBuf};

use super::hf_config::hf_config_json;
use super::safetensors::{TensorRef, write_safetensors};
use crate::device::Device;
use crate::error::{Error, Result, config_error};
use crate::files::write_atomic;
use crate::model::{HeadSpec, Model, ModelConfig};

/// File name of the weights inside an exported directory.
pub const WEIGHTS_FILE: &str = "model.safetensors";
/// File name of the configuration inside an exported directory.
pub const CONFIG_FILE: &str = "config.json";

/// What [`export_model`] wrote.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ExportReport {
    /// Path of the weights file.
    pub weights: PathBuf,
    /// Path of the configuration file.
    pub config: PathBuf,
    /// Tensors written.
    pub tensors: usize,
    /// Parameters deliberately not written (the tied `lm_head.weight`).
    pub skipped: Vec<String>,
}

/// Exports `model` (built from `config`) into `dir` (created if needed) as `model.safetensors`
/// and `config.json`, each written atomically: a temporary file in the same directory, flushed
/// and fsynced, then renamed over the target, so a reader (or a crash) never sees half a file.
///
/// Values are written as F32 (an f64 device's parameters are rounded). A tied LM head's
/// `lm_head.weight` is not written, as Hugging Face does for tied weights: it equals
/// `transformer.wte.weight`, and [`super::load_into_model`] restores it from there. Loading the
/// export back into a model of the same config gives bitwise-identical f32 parameters.
pub fn export_model<D: Device>(
    model: &Model<D>,
    dev: &D,
    config: &ModelConfig,
    dir: impl AsRef<Path>,
) -> Result<ExportReport> {
    let dir = dir.as_ref();
    if config.spec()? != *model.spec() {
        return Err(config_error("config", "does not describe the model being exported (its spec differs)"));
    }
    std::fs::create_dir_all(dir).map_err(|source| Error::Io { path: dir.display().to_string(), source })?;

    let tied = model.spec().head == HeadSpec::TiedLmHead;
    let mut skipped = Vec::new();
    let mut host = Vec::new();
    for p in model.params() {
        if tied && p.name == "lm_head.weight" {
            skipped.push(p.name.clone());
            continue;
        }
        host.push((p.name.as_str(), p.shape.as_slice(), dev.download(&p.value)?));
    }
    let tensors: Vec<TensorRef<'_>> =
        host.iter().map(|(name, shape, values)| TensorRef { name, shape, values }).collect();

    let weights = dir.join(WEIGHTS_FILE);
    write_atomic(&weights, |w| write_safetensors(w, &tensors))?;
    let json = hf_config_json(config)?;
    let config_path = dir.join(CONFIG_FILE);
    write_atomic(&config_path, |w| {
        serde_json::to_writer_pretty(&mut *w, &json).map_err(std::io::Error::other)?;
        w.write_all(b"\n")
    })?;
    Ok(ExportReport { weights, config: config_path, tensors: tensors.len(), skipped })
}
