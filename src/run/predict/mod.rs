//! A trained model on new inputs: the class probabilities of texts (BERT) and images (ViT),
//! and text generated from a prompt (GPT), from an exported model folder (a run's `model/`).
//! Inputs are checked one by one, so a caller reading a stream can report a bad input and go
//! on with the rest.

use super::config::RunConfig;
use super::data_setup::{DataKind, class_list, prepare_data};
use super::fingerprint::{MAX_LEN, PIXEL_MAX, TEST_FILE, TOKENIZER, TRAIN_FILE, data_settings};
use super::output_dir::{CHECKPOINT, LOG};
use crate::data::{StoredImage, read_idx_images};
use crate::device::Device;
use crate::error::{Error, Result, config_error, counted, data_error};
use crate::model::{Batch, Family, HeadSpec, HostBatch, IGNORE_INDEX, InputSpec, Model};
use crate::rng::Rng;
use crate::text::{EncodedItem, TextInput, TextTokenizer, encoded_batch};
use crate::train::metrics::{Confusion, argmax, correct};
use crate::train::{EvalMetrics, checkpoint};
use crate::weights::{self, LoadOptions};
use serde::Serialize;
use std::collections::HashMap;
use std::path::Path;

mod evaluate;
mod stream;
#[cfg(test)]
mod tests;

pub use evaluate::LabelledRows;
pub use stream::{OutputFormat, PredictOptions, predict_stream};

/// One input's class probabilities.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ClassPrediction {
    /// The most probable class's name.
    pub label: String,
    /// Its probability.
    pub probability: f64,
    /// Every class's probability, by name, in label order.
    pub probabilities: Vec<(String, f64)>,
    /// Set when the input did not fit the model as given (a text cut to the run's `max_len`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub warning: Option<String>,
}

/// Images of a labelled folder read at a time (on every core), rounded up to whole batches:
/// what `evaluate --file FOLDER` holds at most (256 colour images of 224 × 224 are 154 MB).
pub const FOLDER_READ: usize = 256;

/// A prompt's continuation.
#[derive(Clone, Debug, PartialEq)]
pub struct Generation {
    /// The characters drawn after the prompt.
    pub text: String,
    /// Set when the prompt did not fit the model's window as given (its start left unread).
    pub warning: Option<String>,
}

/// How a generated continuation is drawn. The default is `predict`'s: 200 characters at
/// temperature 0.8 from every character, seed 0.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Sampling {
    /// Tokens to generate.
    pub max_new_tokens: usize,
    /// Softmax temperature; 0 takes the most probable token every time.
    pub temperature: f64,
    /// Draw from the `k` most probable tokens only (0: all).
    pub top_k: usize,
    /// Seed of the draws.
    pub seed: u64,
}

impl Default for Sampling {
    fn default() -> Self {
        Sampling { max_new_tokens: 200, temperature: 0.8, top_k: 0, seed: 0 }
    }
}

impl Sampling {
    /// Refuses settings no generation can use (named by `predict`'s flags): a temperature
    /// that is negative or not finite, no characters to generate.
    pub fn check(&self) -> Result<()> {
        if !(self.temperature.is_finite() && self.temperature >= 0.0) {
            return Err(config_error(
                "--temperature",
                format!(
                    "is {}; expected a finite number ≥ 0 (0: always the most probable character)",
                    self.temperature
                ),
            ));
        }
        if self.max_new_tokens == 0 {
            return Err(config_error("--max-new-tokens", "is 0; expected at least 1 character to generate"));
        }
        Ok(())
    }

    /// Refuses, for a model that generates, sampling flags greedy decoding would ignore: it
    /// draws nothing, so a top-k or a seed given with `--temperature 0` has no effect, and a
    /// user who set one expected sampling.
    fn check_greedy(&self) -> Result<()> {
        let d = Sampling::default();
        let unused = [("--top-k", self.top_k as u64, d.top_k as u64), ("--seed", self.seed, d.seed)];
        if let Some((flag, value, _)) = unused.into_iter().find(|&(_, v, d)| v != d && self.temperature == 0.0) {
            return Err(config_error(
                flag,
                format!(
                    "{flag} {value} has no effect at --temperature 0, which always takes the most probable \
                     character: leave {flag} out, or give a temperature above 0 to sample"
                ),
            ));
        }
        Ok(())
    }

    /// The flags (with their values) that differ from the defaults, which only a GPT reads.
    fn changed_flags(&self) -> Vec<String> {
        let d = Sampling::default();
        let mut flags = Vec::new();
        if self.max_new_tokens != d.max_new_tokens {
            flags.push(format!("--max-new-tokens {}", self.max_new_tokens));
        }
        if self.temperature != d.temperature {
            flags.push(format!("--temperature {}", self.temperature));
        }
        if self.top_k != d.top_k {
            flags.push(format!("--top-k {}", self.top_k));
        }
        if self.seed != d.seed {
            flags.push(format!("--seed {}", self.seed));
        }
        flags
    }
}

/// What a model reads.
enum Reader {
    /// A WordPiece tokenizer cutting where the run cut (its `max_len`, at most the model's positions).
    Text(Box<TextTokenizer>),
    /// `channels × size × size` pixels in `[0, 1]`; raw CSV values are divided by `max_value`;
    /// image files of another size resized to the model's where `resize` (as its run resized).
    Image { size: usize, channels: usize, max_value: f32, resize: bool },
    /// A character vocabulary.
    Chars { chars: Vec<char>, ids: HashMap<char, u32> },
}

/// An exported model loaded on a device, ready for inputs.
pub struct Predictor<D: Device> {
    dev: D,
    model: Model<D>,
    labels: Vec<String>,
    reader: Reader,
    /// The settings that chose the samples the model trained on, where its export says.
    trained_on: Option<serde_json::Value>,
}

impl<D: Device> Predictor<D> {
    /// Whatever a user points at, loaded onto `dev`: a run's checkpoint file (see
    /// [`load_checkpoint`](Self::load_checkpoint)), a run's output folder (its `model/`), or an
    /// export folder (see [`load`](Self::load)).
    pub fn open(dev: D, path: &Path) -> Result<Self> {
        const EXPECTED: &str = "expected an exported model folder (a run's `model/`), a run's output folder, or a run's \
                                checkpoint.ckpt";
        let refuse = |message: String| weights::read::export_error(path, message);
        if !path.exists() {
            return Err(refuse(format!("does not exist; {EXPECTED}")));
        }
        if path.is_file() {
            // A file of an export (its weights, its config.json) is not the export: say which
            // folder is.
            let folder = path.parent().filter(|d| d.join(weights::CONFIG_FILE).is_file());
            if let (Some(folder), false) = (folder, path.extension().is_some_and(|e| e == "ckpt")) {
                return Err(refuse(format!(
                    "is a file of the exported model in {}: pass that folder",
                    folder.display()
                )));
            }
            return Self::load_checkpoint(dev, path);
        }
        // (A run's `model/` that lost its config is read as the export it is, and said so.)
        let run_export = path.join("model");
        if run_export.join("config.json").exists() || (run_export.is_dir() && !path.join("config.json").exists()) {
            return Self::load(dev, &run_export);
        }
        // A run's folder before its first checkpoint, or whose export was taken away: it has
        // nothing to load (a checkpoint's weights need the export's config beside them).
        let run = [CHECKPOINT.0, LOG.0].iter().find(|f| path.join(f).is_file());
        if let Some(file) = run.filter(|_| !path.join("config.json").exists()) {
            return Err(refuse(format!(
                "is a run's folder (it holds {file}) without its exported model, model/, which the run writes with \
                 each checkpoint and which its checkpoint's weights need beside them: not written yet, or removed; \
                 expected an exported model folder"
            )));
        }
        Self::load(dev, path)
    }

    /// Loads the export in `dir` (config, weights, labels, tokenizer or vocabulary) onto
    /// `dev`. A folder that is not an export of ours, or is incomplete, is an error naming the
    /// file and what was expected.
    pub fn load(dev: D, dir: &Path) -> Result<Self> {
        Self::load_from(dev, dir, |model, dev, export| {
            let file = weights::load_safetensors(&export.weights)?;
            let report = weights::load_into_model(model, dev, &file, &LoadOptions::default())?;
            let (lack, extra) = (&report.missing, &report.unexpected);
            if !lack.is_empty() && lack.iter().all(|name| name.starts_with("classifier.")) {
                // (A Hugging Face encoder, MiniLM's say, as `make setup` installs it.)
                return Err(config_error(
                    "--model",
                    format!(
                        "{0}: a pretrained model without a classifier head (the weights lack {1}): fine-tune it \
                         first (`train` with model.pretrained = \"{0}\"), then give that run's folder",
                        dir.display(),
                        lack.join(", ")
                    ),
                ));
            }
            if !lack.is_empty() || !extra.is_empty() {
                let said = if lack.is_empty() { "hold" } else { "lack" };
                let which = if lack.is_empty() { extra } else { lack };
                return Err(config_error(
                    "--model",
                    format!(
                        "{}: the weights {said} {} that config.json does not describe (damaged, or not an \
                         export of this engine)",
                        dir.display(),
                        which.join(", ")
                    ),
                ));
            }
            Ok(())
        })
    }

    /// The export in `dir` but its weights, which `fill` puts into the model it built.
    fn load_from(
        dev: D,
        dir: &Path,
        fill: impl FnOnce(&mut Model<D>, &D, &weights::ExportedModel) -> Result<()>,
    ) -> Result<Self> {
        let export = weights::read_export(dir)?;
        // Every weight comes from the export or the checkpoint (both fills check it): nothing
        // is drawn first only to be overwritten.
        let (mut model, _) = Model::new_for_loading(&dev, &export.config, 0, &|_| true)?;
        fill(&mut model, &dev, &export)?;
        if let Some(t) = &export.normalization {
            // (A model exported elsewhere: its processor's normalisation goes into its patch
            // embedding, which then takes the pixels read here, raw values × its scale.)
            t.fold_into(&mut model, &dev, 1.0 / t.scale)?;
        }
        let spec = model.spec().clone();
        let reader = match (spec.family, spec.input) {
            (Family::Gpt, _) => {
                if export.chars.is_empty() {
                    return Err(config_error(
                        "--model",
                        format!("{}: a GPT export needs vocab.json (its characters); none found", dir.display()),
                    ));
                }
                let ids = export.chars.iter().enumerate().map(|(i, &c)| (c, i as u32)).collect();
                Reader::Chars { chars: export.chars, ids }
            }
            (_, InputSpec::Image { image_size, channels, .. }) => {
                // `read_export` refuses an image model's export without its scale: never guessed.
                let scale = export.pixel_scale.ok_or_else(|| Error::Internal {
                    what: "predict".into(),
                    message: format!("{}: an image model's export read without its pixel scale", dir.display()),
                })?;
                Reader::Image { size: image_size, channels, max_value: (1.0 / scale) as f32, resize: export.resize }
            }
            (_, InputSpec::Tokens { max_positions, .. }) => {
                let path = export.tokenizer.ok_or_else(|| {
                    config_error(
                        "--model",
                        format!("{}: a text model's export needs tokenizer.json; none found", dir.display()),
                    )
                })?;
                // Cut where the run cut (`data.max_len`, exported as `max_seq_length`), so an
                // export scores a long text as `evaluate --config` does.
                let max_len = export.max_seq_length.map_or(max_positions, |n| n.min(max_positions));
                Reader::Text(Box::new(TextTokenizer::from_file(path, max_len)?))
            }
        };
        let mut labels = export.labels;
        if let HeadSpec::Classifier { num_labels, .. } = spec.head {
            // An export without names (older runs) gets its label indices as names.
            if labels.is_empty() {
                labels = (0..num_labels).map(|i| i.to_string()).collect();
            }
        }
        if let HeadSpec::Classifier { num_labels, .. } = spec.head
            && labels.len() != num_labels
        {
            return Err(config_error(
                "--model",
                format!("{}: {} label names for a {num_labels}-class head", dir.display(), labels.len()),
            ));
        }
        Ok(Predictor { dev, model, labels, reader, trained_on: export.trained_on })
    }

    /// A run's checkpoint (`checkpoint.ckpt`) on `dev`: its parameters, with the config,
    /// labels and tokenizer of the export in the same run directory (`model/`, written with
    /// every checkpoint; `model.previous/` for the `checkpoint.previous.ckpt` set aside with
    /// it). Every parameter must be in the checkpoint with its size.
    pub fn load_checkpoint(dev: D, path: &Path) -> Result<Self> {
        let export = super::output_dir::export_beside(path);
        let (_, tensors) = checkpoint::load(path)?;
        let values: HashMap<&str, &Vec<f32>> =
            tensors.iter().filter_map(|t| t.name.strip_prefix(checkpoint::PARAM).map(|n| (n, &t.data))).collect();
        // The export's config, labels and reader, and the checkpoint's weights (the export's
        // are not copied onto the device first).
        Self::load_from(dev, &export, |model, dev, _| {
            for p in model.params_mut() {
                let Some(v) = values.get(p.name.as_str()).filter(|v| v.len() == p.numel()) else {
                    return Err(config_error(
                        "--model",
                        format!(
                            "{}: no parameter `{}` of {} values (not a checkpoint of this model)",
                            path.display(),
                            p.name,
                            p.numel()
                        ),
                    ));
                };
                p.value = dev.upload(v)?;
            }
            Ok(())
        })
    }

    /// The model in words, e.g. "a character-level GPT (65 characters)".
    fn describe(&self) -> String {
        match &self.reader {
            Reader::Chars { chars, .. } => format!("a character-level GPT ({} characters)", chars.len()),
            Reader::Image { .. } => format!("a ViT image classifier with {}", class_list(&self.labels)),
            Reader::Text(_) => format!("a BERT text classifier with {}", class_list(&self.labels)),
        }
    }

    /// The model's family.
    pub fn family(&self) -> Family {
        self.model.spec().family
    }

    /// Class names, by label (empty for a language model).
    pub fn labels(&self) -> &[String] {
        &self.labels
    }

    /// Class probabilities of `texts`, one batch. An empty text is an error; a text longer
    /// than the positions is cut, with a warning.
    pub fn classify_texts(&self, texts: &[&str]) -> Result<Vec<ClassPrediction>> {
        let Reader::Text(tokenizer) = &self.reader else {
            return Err(config_error("input", format!("this {:?} model does not read text", self.family())));
        };
        let inputs: Vec<TextInput> = texts.iter().map(|t| TextInput::Single(t)).collect();
        let encodings = tokenizer.encode_batch(&inputs)?;
        if encodings.iter().any(|e| e.text_tokens == 0) {
            return Err(data_error("input", EMPTY_TEXT));
        }
        let items: Vec<EncodedItem> =
            encodings.iter().enumerate().map(|(i, encoded)| EncodedItem { id: i as u64, encoded, label: 0 }).collect();
        let batch = encoded_batch(tokenizer, &items, 0)?;
        let mut out = self.classify(&batch.host)?;
        for (p, &cut) in out.iter_mut().zip(&batch.truncated) {
            if cut {
                p.warning = Some(format!("cut to its first {} tokens", tokenizer.max_len()));
            }
        }
        Ok(out)
    }

    /// Class probabilities of images (`channels × size × size` values in `[0, 1]` each).
    pub fn classify_images(&self, images: &[Vec<f32>]) -> Result<Vec<ClassPrediction>> {
        let Reader::Image { size, channels, .. } = self.reader else {
            return Err(config_error("input", format!("this {:?} model does not read images", self.family())));
        };
        let n = channels * size * size;
        if let Some(i) = images.iter().position(|im| im.len() != n) {
            return Err(data_error(
                "input",
                format!("image {} has {} values; expected {channels}×{size}×{size} = {n}", i + 1, images[i].len()),
            ));
        }
        let host = HostBatch {
            batch: images.len(),
            pixels: Some(images.concat()),
            targets: vec![0; images.len()],
            ..Default::default()
        };
        self.classify(&host)
    }

    /// The images one input names: an image file (PNG, JPEG or PGM), an IDX file (every image in
    /// it), a CSV file (every row: raw pixel values, no label; gzip-compressed or not), or a
    /// CSV row of raw pixel values. Files are told apart by their first bytes, not their names.
    /// Each image comes with a name for the output: the input, `file#i` for the `i`-th image
    /// (from 0) of an IDX file, `file:line` for a CSV file's row; a CSV row that is no image
    /// (a header, another count of values, a value out of range) fails alone, its error beside
    /// its name. (`predict` reads a folder as its files, each an input of its own:
    /// [`folder_inputs`].)
    pub fn read_images(&self, input: &str) -> Result<Vec<(String, Result<Vec<f32>>)>> {
        let Reader::Image { size, channels, max_value, .. } = self.reader else {
            return Err(config_error("input", format!("this {:?} model does not read images", self.family())));
        };
        let n = channels * size * size;
        let path = Path::new(input);
        if path.is_dir() {
            let link = std::fs::symlink_metadata(path).is_ok_and(|m| m.is_symlink());
            let why = match (link, crate::data::files_under(path)?.is_empty()) {
                (true, _) => "a link to a folder, not followed from the folder given; name it as an input itself",
                (false, true) => "a folder with no files; expected image (PNG, JPEG, PGM), IDX or CSV files in it",
                (false, false) => "a folder: its files are inputs of their own (`folder_inputs`)",
            };
            return Err(data_error("input", format!("`{input}` is {why}")));
        }
        if path.is_file() {
            return match input_file_kind(path)? {
                InputFile::Image => Ok(vec![(
                    input.to_string(),
                    Ok(self.fitted(input, crate::data::read_image_file_as_stored(path)?)?),
                )]),
                // (IDX images are 8-bit.)
                InputFile::Idx => read_idx_images(path)?
                    .into_iter()
                    .enumerate()
                    .map(|(i, pixels)| {
                        let image = StoredImage::of_scaled(pixels, 255, false);
                        Ok((format!("{input}#{i}"), Ok(self.fitted(input, image)?)))
                    })
                    .collect(),
                InputFile::Csv => {
                    let text = crate::data::read_user_text(path)?;
                    let bad = |line: usize, message: String| Error::Dataset {
                        file: input.to_string(),
                        line: Some(line),
                        message,
                    };
                    let mut images = Vec::new();
                    for (line, row) in text.lines().enumerate().map(|(i, l)| (i + 1, l)) {
                        if row.trim().is_empty() {
                            continue;
                        }
                        // A header names its columns: a first row with no number in it.
                        let header = images.is_empty() && !row.split(',').any(|v| v.trim().parse::<f32>().is_ok());
                        let count = row.split(',').count();
                        let labelled = if count == n + 1 {
                            " (pixels then a label? `predict` reads pixels alone; `evaluate --file` scores labelled rows)"
                        } else {
                            ""
                        };
                        let pixels = match count {
                            _ if header => Err(format!(
                                "reads as a header row (`{}` is no number); expected rows of pixel values alone",
                                row.split(',').next().unwrap_or_default().trim()
                            )),
                            _ if count != n => Err(format!(
                                "a CSV row of {count} values; expected {channels}×{size}×{size} = {n} pixels{labelled}"
                            )),
                            _ => pixel_row(row, max_value),
                        };
                        images.push((format!("{input}:{line}"), pixels.map_err(|e| bad(line, e))));
                    }
                    if images.is_empty() {
                        return Err(Error::Dataset {
                            file: input.to_string(),
                            line: None,
                            message: "has no rows; expected CSV rows of raw pixel values".into(),
                        });
                    }
                    Ok(images)
                }
            };
        }
        if input.trim().is_empty() {
            return Err(data_error(
                "input",
                format!(
                    "an empty input; expected a CSV row of {n} pixels, or an image (PNG, JPEG, PGM), IDX or CSV file"
                ),
            ));
        }
        // A CSV row of raw values; one that is not, but reads as a file's name (a folder in it,
        // or an extension of letters), is a file that is not there.
        let values = pixel_row(input, max_value).map_err(|e| {
            let extension = path.extension().and_then(|e| e.to_str()).unwrap_or_default();
            let named = input.contains('/')
                || extension.starts_with(|c: char| c.is_ascii_alphabetic())
                    && extension.chars().all(|c| c.is_ascii_alphanumeric());
            match named {
                true => data_error(
                    "input",
                    format!(
                        "`{input}`: no such file; expected an image (PNG, JPEG, PGM), IDX or CSV file, or a CSV row of pixels"
                    ),
                ),
                false => data_error("input", format!("{e} (nor is the input an image or CSV file)")),
            }
        })?;
        if values.len() != n {
            return Err(data_error(
                "input",
                format!("a CSV row of {} values; expected {channels}×{size}×{size} = {n} pixels", values.len()),
            ));
        }
        Ok(vec![(input.to_string(), Ok(values))])
    }

    /// An image file's pixels as the model takes them: resized to its size where its run
    /// resized its images (as the run resized them: by their depth), and then of its size and
    /// channels, or an error naming `input`.
    fn fitted(&self, input: &str, image: StoredImage) -> Result<Vec<f32>> {
        let Reader::Image { size, channels, resize, .. } = self.reader else {
            return Err(config_error("input", format!("this {:?} model does not read images", self.family())));
        };
        let (w, h, c) = image.shape;
        // (A grayscale image for a colour model reads as RGB, as the run's image folders do.)
        let Some(image) = image.with_channels(channels) else {
            return Err(size_error(input, (w, h, c), size, channels));
        };
        if resize {
            return Ok(image.resized(size));
        }
        check_size(input, w, h, channels, size, channels)?;
        Ok(image.into_pixels().3)
    }

    /// The model's outputs on the host; an error when one is not finite (a NaN would read
    /// as class 0 with `null` probabilities, or draw the last token every time).
    fn outputs(&self, logits: &D::Buf) -> Result<Vec<f32>> {
        let logits = self.dev.download(logits)?;
        if logits.iter().any(|v| !v.is_finite()) {
            return Err(data_error(
                "model",
                "produced outputs that are not finite (NaN or inf): its weights are damaged or diverged",
            ));
        }
        Ok(logits)
    }

    /// The model's forward on a batch and the softmax of each row.
    fn classify(&self, host: &HostBatch) -> Result<Vec<ClassPrediction>> {
        let batch = Batch::upload(&self.dev, self.model.spec(), host, false, 0)?;
        let (logits, _) = self.model.forward(&self.dev, &batch)?;
        let logits = self.outputs(&logits)?;
        let classes = self.labels.len().max(1);
        Ok(logits
            .chunks(classes)
            .map(|row| {
                let p = softmax(row, 1.0);
                let best = p.iter().enumerate().fold(0, |b, (i, &v)| if v > p[b] { i } else { b });
                ClassPrediction {
                    label: self.labels[best].clone(),
                    probability: p[best],
                    probabilities: self.labels.iter().cloned().zip(p).collect(),
                    warning: None,
                }
            })
            .collect())
    }

    /// `prompt` continued by `sampling.max_new_tokens` characters. Each step runs the model on
    /// the last characters that fit its window (no cache: the models this engine trains are
    /// small): the run's `data.max_len` where the export records it (positions past it never
    /// trained), else the position table. A prompt longer than the window is read from its
    /// end, with a warning. A character outside the vocabulary is an error naming it.
    pub fn generate(&self, prompt: &str, sampling: &Sampling) -> Result<Generation> {
        self.generate_each(prompt, sampling, &mut |_| Ok(()))
    }

    /// [`Predictor::generate`], handing each character to `each` as it is drawn (for a reader
    /// watching a long continuation come), after the prompt was checked: an error of the
    /// prompt comes before any character. An error of `each` stops the generation.
    pub fn generate_each(
        &self,
        prompt: &str,
        sampling: &Sampling,
        each: &mut dyn FnMut(char) -> Result<()>,
    ) -> Result<Generation> {
        let Reader::Chars { chars, ids } = &self.reader else {
            return Err(config_error("input", format!("this {:?} model does not generate text", self.family())));
        };
        sampling.check()?;
        sampling.check_greedy()?;
        let mut tokens: Vec<u32> = prompt
            .chars()
            .enumerate()
            .map(|(i, c)| {
                ids.get(&c).copied().ok_or_else(|| {
                    data_error("prompt", format!("character {c:?} at position {i} is not in the model's vocabulary"))
                })
            })
            .collect::<Result<_>>()?;
        if tokens.is_empty() {
            return Err(data_error("prompt", "is empty; expected at least one character"));
        }
        let positions = match self.model.spec().input {
            InputSpec::Tokens { max_positions, .. } => max_positions,
            InputSpec::Image { .. } => {
                return Err(Error::Internal { what: "generate".into(), message: "image model".into() });
            }
        };
        let trained = self.trained_on.as_ref().and_then(|t| t.get(MAX_LEN)).and_then(|n| n.as_u64());
        let positions = trained.map_or(positions, |n| (n as usize).clamp(1, positions));
        let warning = (tokens.len() > positions).then(|| {
            format!(
                "read from its last {positions} characters, the model's window: the first {} left unread",
                tokens.len() - positions
            )
        });
        let vocab = chars.len();
        let mut rng = Rng::new(sampling.seed);
        let mut out = String::new();
        for _ in 0..sampling.max_new_tokens {
            let window = &tokens[tokens.len().saturating_sub(positions)..];
            let host = HostBatch {
                batch: 1,
                seq: window.len(),
                tokens: Some(window.to_vec()),
                targets: vec![IGNORE_INDEX; window.len()],
                ..Default::default()
            };
            let batch = Batch::upload(&self.dev, self.model.spec(), &host, false, 0)?;
            let (logits, _) = self.model.forward(&self.dev, &batch)?;
            let logits = self.outputs(&logits)?;
            let last = &logits[logits.len() - vocab..];
            let next = draw(last, sampling, &mut rng);
            tokens.push(next as u32);
            out.push(chars[next]);
            each(chars[next])?;
        }
        Ok(Generation { text: out, warning })
    }
}

/// What a file named as an input holds, by its first bytes (after gzip's, for a compressed
/// file), not by its name.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum InputFile {
    /// A PNG, JPEG or PGM image.
    Image,
    /// Text starting as a number does: CSV rows of raw pixel values.
    Csv,
    /// IDX images (`00 00 08` then the dimension count; the reader checks the rest).
    Idx,
}

/// What a text the tokenizer reads nothing of is told.
const EMPTY_TEXT: &str = "an empty text (no token the tokenizer reads: spaces, control or zero-width characters at most); \
                          expected some words";

fn input_file_kind(path: &Path) -> Result<InputFile> {
    // Enough for the magic numbers, and for a CSV header's first comma.
    let head = crate::data::user_head(path, 256)?;
    let bad = |message: String| crate::data::dataset_error(path, None, message);
    const EXPECTED: &str = "expected an image (PNG, JPEG, PGM), IDX or CSV file";
    Ok(match head.first() {
        None => return Err(bad(format!("is empty; {EXPECTED}"))),
        _ if crate::data::ImageFormat::of(&head).is_some() => InputFile::Image,
        _ if crate::data::opens_idx(&head) => InputFile::Idx,
        // (A byte-order mark, as spreadsheets write, before the first value; a first line of
        // text with commas, a header say, is named by the rows' reader.)
        Some(b)
            if b.is_ascii_digit()
                || b"+-. \t\r\n".contains(b)
                || head.starts_with("\u{feff}".as_bytes())
                || head.split(|&b| b == b'\n').next().is_some_and(|l| {
                    l.contains(&b',') && l.iter().all(|b| b.is_ascii_graphic() || b" \t\r".contains(b))
                }) =>
        {
            InputFile::Csv
        }
        _ => {
            let first = &head[..head.len().min(4)];
            let bytes: Vec<String> = first.iter().map(|b| format!("{b:02x}")).collect();
            let text = match first.iter().all(|b| b.is_ascii_graphic() || *b == b' ') {
                true => format!(" (`{}`)", first.escape_ascii()),
                false => String::new(),
            };
            return Err(bad(format!("starts with bytes {}{text}; {EXPECTED}", bytes.join(" "))));
        }
    })
}

/// The inputs a folder given to `predict` stands for: every file in it and its subfolders, in
/// name order, leaving out names starting with `.` (a link to a folder inside it is listed,
/// not followed, and fails as an input). A folder with no file, or one that cannot be listed,
/// stands for itself, and fails as an input saying so. (A name that is not UTF-8 is given
/// lossily, and fails as not found.)
pub fn folder_inputs(folder: &str) -> Vec<Result<String>> {
    match crate::data::files_under(Path::new(folder)) {
        Ok(files) if !files.is_empty() => files.iter().map(|f| Ok(f.to_string_lossy().into_owned())).collect(),
        _ => vec![Ok(folder.to_string())],
    }
}

/// The pixels of a CSV row of raw values, each in `0..=max_value`, divided by `max_value`;
/// the error says which value is not a pixel.
fn pixel_row(row: &str, max_value: f32) -> std::result::Result<Vec<f32>, String> {
    row.split(',')
        .enumerate()
        .map(|(i, v)| {
            v.trim()
                .parse::<f32>()
                .ok()
                .filter(|x| x.is_finite() && *x >= 0.0 && *x <= max_value)
                .map(|x| x / max_value)
                .ok_or_else(|| format!("value {} `{}` is not a pixel in 0..={max_value}", i + 1, v.trim()))
        })
        .collect()
}

/// The error for a batch size of 0, wherever it comes from.
fn batch_size_error() -> Error {
    config_error("--batch-size", "is 0; expected at least 1 input per forward pass")
}

fn check_size(input: &str, w: usize, h: usize, c: usize, size: usize, channels: usize) -> Result<()> {
    match (w, h, c) == (size, size, channels) {
        true => Ok(()),
        false => Err(size_error(input, (w, h, c), size, channels)),
    }
}

fn size_error(input: &str, (w, h, c): (usize, usize, usize), size: usize, channels: usize) -> Error {
    data_error(
        "input",
        format!(
            "{input}: a {w}×{h} image with {}; the model takes {size}×{size} with {channels}",
            counted(c, "channel")
        ),
    )
}

/// Probabilities of `logits / temperature` (computed in f64).
fn softmax(logits: &[f32], temperature: f64) -> Vec<f64> {
    // The largest logit is subtracted before dividing: at a tiny temperature the quotients
    // overflow to ±inf, and inf − inf would make every probability NaN.
    let max = logits.iter().map(|&v| v as f64).fold(f64::NEG_INFINITY, f64::max);
    let e: Vec<f64> = logits.iter().map(|&v| ((v as f64 - max) / temperature).exp()).collect();
    let sum: f64 = e.iter().sum();
    e.iter().map(|v| v / sum).collect()
}

/// A token drawn from `logits` as `sampling` says (greedy at temperature 0).
fn draw(logits: &[f32], sampling: &Sampling, rng: &mut Rng) -> usize {
    if sampling.temperature == 0.0 {
        return argmax(logits);
    }
    let p = softmax(logits, sampling.temperature);
    let mut order: Vec<usize> = (0..p.len()).collect();
    order.sort_by(|&a, &b| p[b].total_cmp(&p[a]));
    if sampling.top_k > 0 {
        order.truncate(sampling.top_k);
    }
    let total: f64 = order.iter().map(|&i| p[i]).sum();
    let mut u = rng.uniform() * total;
    for &i in &order {
        u -= p[i];
        if u <= 0.0 {
            return i;
        }
    }
    order.last().copied().unwrap_or_else(|| argmax(logits))
}
