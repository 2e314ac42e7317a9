//! Writing a model as a self-contained Hugging Face-style directory: `model.safetensors` (f32,
//! in the layout of the Hugging Face class that loads it, see `layout.rs`), `config.json`
//! (with the class names), and the companion files of its family (tokenizer, image
//! preprocessor, sentence-transformers modules; see `companions.rs`).

use std::path::{Path, PathBuf};

use super::companions::{ExportExtras, write_companions, write_json};
use super::hf_config::hf_config_json;
use super::layout::{HostTensor, bert_export_name, to_gpt2};
use super::safetensors::{TensorRef, write_safetensors};
use crate::device::Device;
use crate::error::{Result, config_error};
use crate::files::{io_error, write_atomic_uncached};
use crate::model::{Family, HeadSpec, Model, ModelConfig, Spec};

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
    /// The companion files written (tokenizer, preprocessor, sentence-transformers modules).
    pub companions: Vec<PathBuf>,
}

/// Exports `model` (built from `config`) as the folder `dir`, replacing whatever was there:
/// every file is written atomically (a temporary file, flushed and fsynced, then renamed) into
/// `.NAME.staging` beside it, which then trades places with `dir` in one step
/// ([`swap_in`](crate::files::swap_in)), so a reader (or a crash) never sees half a file, and
/// `dir` always holds one whole export.
///
/// - `model.safetensors`: values as F32 (an f64 device's parameters are rounded), named and
///   laid out as the Hugging Face class that loads the model expects: BERT under `bert.` with
///   `classifier.*` at the top (`BertForSequenceClassification`), ViT as is
///   (`ViTForImageClassification`), GPT in GPT-2's fused, transposed layout (`GPT2LMHeadModel`)
///   without the tied `lm_head.weight` (it equals `transformer.wte.weight`).
/// - `config.json`: the config, `architectures`, and `id2label`/`label2id` from
///   `extras.labels`.
/// - the companion files `extras` allows (see [`ExportExtras`]).
///
/// [`super::load_into_model`] reads the export back into a model of the same config with
/// bitwise-identical f32 parameters, and [`super::read_export`] reads the rest.
///
/// Errors: a config that does not describe the model, class names or characters that do not
/// match the config, a BERT tokenizer directory without `tokenizer.json`, I/O.
pub fn export_model<D: Device>(
    model: &Model<D>,
    dev: &D,
    config: &ModelConfig,
    extras: &ExportExtras<'_>,
    dir: impl AsRef<Path>,
) -> Result<ExportReport> {
    let mut values = Vec::new();
    for p in model.params() {
        values.push(HostTensor { name: p.name.clone(), shape: p.shape.clone(), values: dev.download(&p.value)? });
    }
    export_values(model.spec(), values, config, extras, dir)
}

/// [`export_model`] from the parameters' host values (under the model's names, in model
/// order) of a model with `spec`: what a pipeline hands over without a copy of the model on
/// any device (whose stages may be other processes').
pub fn export_values(
    spec: &Spec,
    values: Vec<HostTensor>,
    config: &ModelConfig,
    extras: &ExportExtras<'_>,
    dir: impl AsRef<Path>,
) -> Result<ExportReport> {
    let dir = dir.as_ref();
    if config.spec()? != *spec {
        return Err(config_error("config", "does not describe the model being exported (its spec differs)"));
    }
    // Checked (labels against num_labels) before anything is written.
    let mut json = hf_config_json(config, extras.labels)?;
    if let (Some(trained_on), Some(object)) = (extras.trained_on, json.as_object_mut()) {
        object.insert(super::companions::TRAINED_ON_KEY.into(), trained_on.clone());
    }
    let (host, skipped) = hf_tensors(spec, values)?;
    let tensors: Vec<TensorRef<'_>> =
        host.iter().map(|t| TensorRef { name: &t.name, shape: &t.shape, values: &t.values }).collect();
    // The whole folder is written beside `dir` and swapped in: no file of an earlier export
    // (a tokenizer a model from scratch does not have) stays behind to be read with this one.
    let Some(name) = dir.file_name().map(|n| n.to_string_lossy().into_owned()) else {
        return Err(config_error("export", format!("{}: expected a folder's path ending in its name", dir.display())));
    };
    if dir.exists() && !dir.is_dir() {
        return Err(config_error("export", format!("{} is a file; expected the export's folder there", dir.display())));
    }
    let staging = dir.with_file_name(staging_name(&name));
    if staging.exists() {
        std::fs::remove_dir_all(&staging).map_err(|e| io_error(&staging, e))?;
    }
    std::fs::create_dir_all(&staging).map_err(|e| io_error(&staging, e))?;
    write_atomic_uncached(&staging.join(WEIGHTS_FILE), |w| write_safetensors(w, &tensors))?;
    write_json(&staging.join(CONFIG_FILE), &json)?;
    let companions = write_companions(config, extras, &staging)?;
    crate::files::swap_in(&staging, dir)?;
    // The earlier export, now under the staging name: a reader may still hold its files open
    // (on NFS that keeps the folder from going), which must not end the run.
    let _ = std::fs::remove_dir_all(&staging);
    let companions = companions.iter().filter_map(|p| p.strip_prefix(&staging).ok()).map(|p| dir.join(p)).collect();
    Ok(ExportReport {
        weights: dir.join(WEIGHTS_FILE),
        config: dir.join(CONFIG_FILE),
        tensors: tensors.len(),
        skipped,
        companions,
    })
}

/// The folder beside an export's folder `name` where the next export is written before the
/// two trade places (removed, with whatever it holds, before each export).
pub fn staging_name(name: &str) -> String {
    format!(".{name}.staging")
}

/// The parameters of a model with `spec`, under the names and in the layout of the Hugging
/// Face class that loads the family; the names of parameters left out (the tied LM head).
fn hf_tensors(spec: &Spec, values: Vec<HostTensor>) -> Result<(Vec<HostTensor>, Vec<String>)> {
    let tied = spec.head == HeadSpec::TiedLmHead;
    let family = spec.family;
    let mut skipped = Vec::new();
    let mut host = Vec::new();
    for HostTensor { name, shape, values } in values {
        // (A caller's tensor whose values disagree with its shape is named, before a layout
        // change reads it by the shape.)
        if shape.iter().try_fold(1usize, |n, &d| n.checked_mul(d)) != Some(values.len()) {
            return Err(config_error(
                "export",
                format!("tensor {name} has {} values for its shape {shape:?}; expected their product", values.len()),
            ));
        }
        if tied && name == "lm_head.weight" {
            skipped.push(name);
            continue;
        }
        let name = match family {
            Family::Bert => bert_export_name(&name),
            Family::Vit | Family::Gpt => name,
        };
        host.push(HostTensor { name, shape, values });
    }
    let host = if family == Family::Gpt { to_gpt2(host)? } else { host };
    Ok((host, skipped))
}
