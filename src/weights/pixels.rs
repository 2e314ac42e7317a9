//! A pretrained ViT's pixel preprocessing (its `preprocessor_config.json`: the rescale and the
//! per-channel normalisation Hugging Face's `ViTImageProcessor` applies) folded into its patch
//! embedding, so that the model takes this engine's pixels (raw values divided by the data's
//! maximum, in `[0, 1]`) and computes on them what the pretrained model computed on its
//! processor's output. Google's ViTs are trained on `(x/255 − 0.5) / 0.5`: fed `x/255` as it
//! is, their features would see other inputs, and fine-tuning would lose accuracy without a
//! word.
//!
//! The patch embedding is linear in the pixels, so with the processor's `p = (x·r − m_c) / s_c`
//! for a raw value `x` of channel `c`, and this engine's `q = x / M`:
//!
//! `W·p + b = Σ_c (W_c · M·r/s_c)·q + (b − Σ_c (m_c/s_c)·Σ W_c)`
//!
//! The model then takes `q` and exports as this engine's other ViTs do (`do_normalize` false,
//! `rescale_factor` 1/M), which `predict` and `ViTImageProcessor` read alike.

use super::read::{export_error, read_optional_json};
use crate::device::Device;
use crate::error::{Result, counted};
use crate::model::Model;
use serde_json::Value;
use std::path::Path;

/// What a `ViTImageProcessor` does to a raw value `x` of channel `c`: `(x·scale − mean[c]) /
/// std[c]`.
#[derive(Clone, Debug, PartialEq)]
pub struct PixelTransform {
    /// `rescale_factor` (1 when `do_rescale` is false).
    pub scale: f64,
    /// Per channel (0 when `do_normalize` is false).
    pub mean: Vec<f64>,
    /// Per channel (1 when `do_normalize` is false).
    pub std: Vec<f64>,
}

/// The patch embedding's parameters, by their Hugging Face names.
const WEIGHT: &str = "vit.embeddings.patch_embeddings.projection.weight";
const BIAS: &str = "vit.embeddings.patch_embeddings.projection.bias";

/// The transform of a `preprocessor_config.json` for a model of `channels` channels, with
/// `ViTImageProcessor`'s defaults for the keys it lacks (`rescale_factor` 1/255, mean and std
/// 0.5 per channel, rescaling and normalising on); `None` without the file (a folder that
/// describes no processor: its model is taken to read this engine's pixels).
pub fn read_pixel_transform(path: &Path, channels: usize) -> Result<Option<PixelTransform>> {
    read_optional_json(path)?.map(|json| pixel_transform_of(&json, path, channels)).transpose()
}

/// A processor's key, where it is set: one set to null is left to its default, as
/// `ViTImageProcessor` takes `None`.
pub(super) fn processor_key<'a>(json: &'a Value, key: &str) -> Option<&'a Value> {
    json.get(key).filter(|v| !v.is_null())
}

/// [`read_pixel_transform`] of the file `path` already read as `json`.
pub(super) fn pixel_transform_of(json: &Value, path: &Path, channels: usize) -> Result<PixelTransform> {
    let get = |key: &str| processor_key(json, key);
    let on = |key: &str| match get(key) {
        None => Ok(true),
        Some(v) => v.as_bool().ok_or_else(|| export_error(path, format!("`{key}` is {v}; expected true or false"))),
    };
    let positive = |v: f64| v.is_finite() && v > 0.0;
    let scale = match on("do_rescale")? {
        false => 1.0,
        true => match get("rescale_factor") {
            None => 1.0 / 255.0,
            Some(v) => v.as_f64().filter(|&f| positive(f)).ok_or_else(|| {
                export_error(path, format!("`rescale_factor` is {v}; expected a positive number, e.g. 1/255"))
            })?,
        },
    };
    // A number for every channel, or one list of one per channel.
    let per_channel = |key: &str, default: f64, ok: &dyn Fn(f64) -> bool| -> Result<Vec<f64>> {
        let values = match get(key) {
            None => vec![default; channels],
            Some(Value::Number(n)) => vec![n.as_f64().unwrap_or(f64::NAN); channels],
            Some(Value::Array(a)) => a.iter().map(|v| v.as_f64().unwrap_or(f64::NAN)).collect(),
            Some(v) => return Err(export_error(path, format!("`{key}` is {v}; expected a number per channel"))),
        };
        if values.len() != channels || !values.iter().all(|&v| ok(v)) {
            let shown = json.get(key).map_or_else(String::new, Value::to_string);
            return Err(export_error(
                path,
                format!(
                    "`{key}` is {shown}; expected {}, one per channel of the model",
                    counted(channels, "finite number")
                ),
            ));
        }
        Ok(values)
    };
    let (mean, std) = match on("do_normalize")? {
        false => (vec![0.0; channels], vec![1.0; channels]),
        true => (per_channel("image_mean", 0.5, &|v| v.is_finite())?, per_channel("image_std", 0.5, &positive)?),
    };
    Ok(PixelTransform { scale, mean, std })
}

impl PixelTransform {
    /// Whether the model, fed this engine's pixels of maximum `data_max`, already sees what
    /// the processor would give it (an export of this engine's, read back at its own scale).
    pub fn is_identity(&self, data_max: f64) -> bool {
        let close = |a: f64, b: f64| (a - b).abs() <= 1e-9 * b.abs().max(1.0);
        close(self.scale * data_max, 1.0) && self.mean.iter().all(|&m| m == 0.0) && self.std.iter().all(|&s| s == 1.0)
    }

    /// Folds the transform into `model`'s patch embedding (the module docs' formula) for
    /// pixels of maximum `data_max`. A stage process that does not hold the embedding (its
    /// values [hollow](crate::model::Param::hollow)) has nothing to fold.
    pub fn fold_into<D: Device>(&self, model: &mut Model<D>, dev: &D, data_max: f64) -> Result<()> {
        let mut params = model.params_mut();
        let find = |name: &str, params: &[&mut crate::model::Param<D>]| params.iter().position(|p| p.name == name);
        let (Some(w), Some(b)) = (find(WEIGHT, &params), find(BIAS, &params)) else {
            return Err(crate::error::internal(
                "pixel transform",
                "a ViT without its patch embedding's weight and bias",
            ));
        };
        if params[w].is_hollow() {
            return Ok(());
        }
        // (In f64, as the loader uploads: a wide device keeps every digit.)
        let mut weight = dev.download_f64(&params[w].value)?;
        let mut bias = dev.download_f64(&params[b].value)?;
        let channels = self.mean.len();
        let per_channel = weight.len() / bias.len().max(1) / channels.max(1);
        // `[dim, channels, patch, patch]`: each output row holds each channel's patch whole.
        for (row, b) in weight.chunks_exact_mut(channels * per_channel).zip(bias.iter_mut()) {
            for (c, plane) in row.chunks_exact_mut(per_channel).enumerate() {
                let (factor, offset) = (data_max * self.scale / self.std[c], self.mean[c] / self.std[c]);
                *b -= offset * plane.iter().sum::<f64>();
                plane.iter_mut().for_each(|v| *v *= factor);
            }
        }
        params[w].value = dev.upload_f64(&weight)?;
        params[b].value = dev.upload_f64(&bias)?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::CpuDevice;
    use crate::model::{HostBatch, ModelConfig, VitConfig, tiny::tiny_gray_vit};

    /// The folded model on this engine's pixels gives the logits the original gives on the
    /// processor's output (Google's ViT: `x/255`, mean and std 0.5; and a scale that differs
    /// from the data's), within f32 rounding (1e-4 relative to the larger of the logit and 1);
    /// a file's defaults and bad values are read as
    /// `ViTImageProcessor` reads them, or named.
    #[test]
    fn a_folded_model_on_raw_pixels_equals_the_original_on_processed_ones() {
        let dev = CpuDevice::<f32>::new(0, 1).unwrap();
        let ModelConfig::Vit(gray) = tiny_gray_vit() else { unreachable!() };
        let config = ModelConfig::Vit(VitConfig { num_channels: 3, ..gray });
        let raw = HostBatch::random(&config, 2, 0, 3); // pixels in [0, 1): x / 255 for x = 255·q
        let transforms = [
            PixelTransform { scale: 1.0 / 255.0, mean: vec![0.5; 3], std: vec![0.5; 3] },
            PixelTransform { scale: 1.0 / 16.0, mean: vec![0.485, 0.456, 0.406], std: vec![0.229, 0.224, 0.225] },
        ];
        for t in transforms {
            // (A bias of its own, not the initial zeros: the fold shifts it.)
            let biased = |m: &mut Model<CpuDevice<f32>>| {
                let bias = m.params_mut().into_iter().find(|p| p.name == BIAS).unwrap();
                let values: Vec<f32> = (0..bias.numel()).map(|i| 0.1 * i as f32 - 0.2).collect();
                bias.value = dev.upload(&values).unwrap();
            };
            let mut original = Model::new(&dev, &config, 1).unwrap();
            let mut folded = Model::new(&dev, &config, 1).unwrap();
            biased(&mut original);
            biased(&mut folded);
            t.fold_into(&mut folded, &dev, 255.0).unwrap();
            let mut processed = raw.clone();
            let pixels = processed.pixels.as_mut().unwrap();
            let plane = pixels.len() / raw.batch / 3;
            for (i, p) in pixels.iter_mut().enumerate() {
                let c = i / plane % 3;
                *p = ((f64::from(*p) * 255.0 * t.scale - t.mean[c]) / t.std[c]) as f32;
            }
            let logits = |m: &Model<CpuDevice<f32>>, h: &HostBatch| {
                let batch = crate::model::Batch::upload(&dev, m.spec(), h, false, 0).unwrap();
                dev.download(&m.forward(&dev, &batch).unwrap().0).unwrap()
            };
            let (want, got) = (logits(&original, &processed), logits(&folded, &raw));
            for (a, b) in want.iter().zip(&got) {
                assert!((a - b).abs() <= 1e-4 * a.abs().max(1.0), "{want:?} vs {got:?}");
            }
            assert_ne!(logits(&original, &raw), want, "the transform changes the inputs");
        }
        let dir = crate::files::Scratch::new("pixel-transform");
        let path = dir.join("preprocessor_config.json");
        assert_eq!(read_pixel_transform(&path, 3).unwrap(), None, "no file");
        std::fs::write(&path, "{}").unwrap();
        let defaults = read_pixel_transform(&path, 3).unwrap().unwrap();
        assert_eq!(defaults, PixelTransform { scale: 1.0 / 255.0, mean: vec![0.5; 3], std: vec![0.5; 3] });
        std::fs::write(&path, r#"{"do_normalize": null, "image_mean": null}"#).unwrap();
        assert_eq!(read_pixel_transform(&path, 3).unwrap().unwrap(), defaults, "null: the defaults");
        std::fs::write(&path, r#"{"do_normalize": false, "rescale_factor": 0.0625}"#).unwrap();
        let ours = read_pixel_transform(&path, 1).unwrap().unwrap();
        assert!(ours.is_identity(16.0) && !ours.is_identity(255.0) && !defaults.is_identity(255.0));
        for (text, named) in [
            (r#"{"image_std": [0.5, 0.0, 0.5]}"#, "`image_std` is [0.5,0.0,0.5]; expected 3 finite numbers"),
            (r#"{"image_mean": [0.5]}"#, "`image_mean` is [0.5]; expected 3"),
            (r#"{"rescale_factor": -1}"#, "`rescale_factor` is -1; expected a positive number"),
            (r#"{"do_normalize": "yes"}"#, "`do_normalize` is \"yes\"; expected true or false"),
        ] {
            std::fs::write(&path, text).unwrap();
            let e = read_pixel_transform(&path, 3).unwrap_err().to_string();
            assert!(e.contains(named) && e.contains("preprocessor_config.json"), "{e}");
        }
    }
}
