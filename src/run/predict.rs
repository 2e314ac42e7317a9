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
use crate::error::{Error, Result, config_error, data_error};
use crate::model::{Batch, Family, HeadSpec, HostBatch, IGNORE_INDEX, InputSpec, Model};
use crate::rng::Rng;
use crate::text::{EncodedItem, TextInput, TextTokenizer, encoded_batch};
use crate::train::metrics::{Confusion, argmax, correct};
use crate::train::{EvalMetrics, checkpoint};
use crate::weights::{self, LoadOptions};
use serde::Serialize;
use std::collections::HashMap;
use std::path::Path;

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

/// The batches of a file of labelled rows, or of a folder of class subfolders
/// ([`Predictor::labelled_rows`]).
pub struct LabelledRows<'a> {
    /// The rows, `batch_size` a batch: a file's parsed whole; a folder's images read as they
    /// are scored, [`FOLDER_READ`] at a time, so a folder of any size fits in memory. The
    /// first bad file ends them with its error.
    pub batches: Box<dyn Iterator<Item = Result<HostBatch>> + 'a>,
    /// Texts cut to the run's `data.max_len` (as training cut them).
    pub cut: usize,
}

impl std::fmt::Debug for LabelledRows<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LabelledRows").field("cut", &self.cut).finish_non_exhaustive()
    }
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

/// Where `config`'s evaluation split of the dataset a model trained on (`trained_on`: its
/// run's [`data_settings`]) may hold samples it trained on: the setting that differs and the
/// sentence to refuse with. A split cut by a seed and a fraction (Rotten Tomatoes, digits,
/// MNIST-5k) overlaps under another seed or fraction; a validation part is carved from the
/// training half by the seed, so one carved otherwise overlaps on every dataset; a dataset's own
/// test files (Reuters R8, Fashion-MNIST, Hamlet) never do. Another dataset: `None` (its
/// classes are checked apart).
pub(crate) fn split_overlap(trained_on: &serde_json::Value, config: &RunConfig) -> Option<(String, String)> {
    let (then, now) = (trained_on.as_object()?, data_settings(config));
    let null = serde_json::Value::Null;
    let was = |k: &str| then.get(k).unwrap_or(&null);
    let is = |k: &str| now.get(k).unwrap_or(&null);
    // Another dataset: whether they share samples is not known.
    if was("data.dataset") != is("data.dataset") {
        return None;
    }
    // The user's files. Another file is other data; the same file edited since (its name,
    // another hash) still holds most of the rows the model trained on, and a split cut from it
    // by the seed is not the run's. A run that held out a file of its own trained on all of
    // the training file, so a split cut from that file holds samples it trained on.
    if was(TRAIN_FILE) != is(TRAIN_FILE) {
        let name = |v: &serde_json::Value| v.as_str().map(|s| s.split(" #").next().unwrap_or(s).to_string());
        if !(config.data.cut_by_seed() && name(was(TRAIN_FILE)) == name(is(TRAIN_FILE))) {
            return None;
        }
        let message = format!(
            "is {} here, {} in the model's run: the file was edited since, and a test split cut from it by the seed \
             may hold samples the model trained on; score a held-out file instead (data.test_file, or evaluate --file)",
            is(TRAIN_FILE),
            was(TRAIN_FILE)
        );
        return Some((TRAIN_FILE.into(), message));
    }
    if !was(TEST_FILE).is_null() && config.data.cut_by_seed() {
        let message = format!(
            "is not set, but the model's run held out data.test_file = {} and trained on all of data.train_file: a \
             split cut from it by the seed holds samples the model trained on; give data.test_file",
            was(TEST_FILE)
        );
        return Some((TEST_FILE.into(), message));
    }
    let mut keys: Vec<&str> = Vec::new();
    if config.data.cut_by_seed() {
        keys.extend(["data.split_seed", "data.test_fraction"].into_iter().filter(|k| was(k) != is(k)));
    }
    if config.data.validation_fraction > 0.0 {
        for k in ["data.split_seed", "data.validation_fraction"] {
            if was(k) != is(k) && !keys.contains(&k) {
                keys.push(k);
            }
        }
    }
    let first = *keys.first()?;
    let said: Vec<String> = keys.iter().map(|k| format!("{k} = {} (here {})", was(k), is(k))).collect();
    Some((
        first.to_string(),
        format!(
            "the model was trained under {}: this split would hold samples it trained on; evaluate under its run's \
             settings",
            said.join(", ")
        ),
    ))
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
        let run_export = path.join("model");
        if run_export.join("config.json").exists() {
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
            if !lack.is_empty() || !extra.is_empty() {
                let said = if lack.is_empty() { "hold" } else { "lack" };
                let which = if lack.is_empty() { extra } else { lack };
                return Err(config_error(
                    "model",
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
        let spec = model.spec().clone();
        let reader = match (spec.family, spec.input) {
            (Family::Gpt, _) => {
                if export.chars.is_empty() {
                    return Err(config_error(
                        "model",
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
                        "model",
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
                "model",
                format!("{}: {} label names for a {num_labels}-class head", dir.display(), labels.len()),
            ));
        }
        Ok(Predictor { dev, model, labels, reader, trained_on: export.trained_on })
    }

    /// Loss and accuracy over `batches` (labelled), with a classifier's confusion matrix and
    /// macro F1 or a language model's perplexity: [`crate::train::Trainer::evaluate`]'s
    /// metrics, for a model outside a run. No target to score (no batch, or every target
    /// ignored) is an error.
    pub fn evaluate(&self, batches: impl Iterator<Item = Result<HostBatch>>) -> Result<EvalMetrics> {
        let classes = match self.model.spec().head {
            HeadSpec::Classifier { num_labels, .. } => Some(num_labels),
            HeadSpec::TiedLmHead => None,
        };
        let (mut loss_sum, mut count, mut right) = (0.0, 0, 0);
        let mut confusion = classes.map(Confusion::new);
        for host in batches {
            let host = host?;
            let batch = Batch::upload(&self.dev, self.model.spec(), &host, false, 0)?;
            let (logits, _) = self.model.forward(&self.dev, &batch)?;
            let loss = self.model.loss(&self.dev, &batch, &logits, None)?;
            (loss_sum, count) = (loss_sum + loss.loss_sum, count + loss.count);
            let logits = self.outputs(&logits)?;
            let width = classes.unwrap_or(logits.len() / host.targets.len().max(1)).max(1);
            right += correct(&logits, &host.targets, width, IGNORE_INDEX);
            if let Some(m) = confusion.as_mut() {
                m.add_logits(&logits, &host.targets, IGNORE_INDEX);
            }
        }
        if count == 0 {
            // As a forward of no input is refused: metrics of nothing would read as 0 %.
            return Err(data_error("evaluation", "has no labelled target to score; expected at least one"));
        }
        let loss = loss_sum / count as f64;
        Ok(EvalMetrics {
            loss,
            accuracy: right as f64 / count as f64,
            count,
            perplexity: classes.is_none().then(|| loss.exp()),
            macro_f1: confusion.as_ref().map(Confusion::macro_f1),
            confusion,
        })
    }

    /// Labelled rows of a file (gzip-compressed or not; `-`: standard input) as batches of
    /// `batch_size` (at least 1): `label<TAB>text` for a text model, CSV rows of raw pixels
    /// then the label for an image model. A label is a class name or index. A bad row is an
    /// error naming its line. Texts longer than the run's `data.max_len` are cut there, as
    /// training cut them, and counted.
    pub fn labelled_rows(&self, path: &Path, batch_size: usize) -> Result<LabelledRows<'_>> {
        if batch_size == 0 {
            return Err(batch_size_error());
        }
        if path.is_dir() {
            return self.labelled_folder(path, batch_size);
        }
        let text = crate::data::read_user_text(path)?;
        let bad = |line: usize, message: String| crate::data::dataset_error(path, Some(line), message);
        let label_of = |line: usize, field: &str| -> Result<u32> {
            let field = field.trim();
            self.labels
                .iter()
                .position(|l| l == field)
                .or_else(|| field.parse::<usize>().ok().filter(|&i| i < self.labels.len()))
                .map(|i| i as u32)
                .ok_or_else(|| {
                    let names = self.labels.join(", ");
                    let last = self.labels.len().saturating_sub(1);
                    bad(
                        line,
                        format!("label `{field}` is not one of the model's classes ({names}), nor an index 0..={last}"),
                    )
                })
        };
        let rows: Vec<(usize, &str)> =
            text.lines().enumerate().map(|(i, l)| (i + 1, l)).filter(|(_, l)| !l.trim().is_empty()).collect();
        if rows.is_empty() {
            return Err(bad(1, "has no rows; expected labelled inputs".into()));
        }
        let size = batch_size;
        let (mut batches, mut cut) = (Vec::new(), 0);
        match &self.reader {
            Reader::Text(tokenizer) => {
                let mut parsed = Vec::with_capacity(rows.len());
                for &(line, row) in &rows {
                    let (label, text) =
                        row.split_once('\t').ok_or_else(|| bad(line, "expected `label<TAB>text`".into()))?;
                    parsed.push((line, label_of(line, label)?, text));
                }
                for (i, chunk) in parsed.chunks(size).enumerate() {
                    let inputs: Vec<TextInput> = chunk.iter().map(|&(_, _, text)| TextInput::Single(text)).collect();
                    let encodings = tokenizer.encode_batch(&inputs)?;
                    if let Some(j) = encodings.iter().position(|e| e.text_tokens == 0) {
                        return Err(bad(chunk[j].0, EMPTY_TEXT.into()));
                    }
                    let items: Vec<EncodedItem> = chunk
                        .iter()
                        .zip(&encodings)
                        .enumerate()
                        .map(|(j, (&(_, label, _), encoded))| EncodedItem { id: (i * size + j) as u64, encoded, label })
                        .collect();
                    batches.push(encoded_batch(tokenizer, &items, (i * size) as u64)?.host);
                    cut += encodings.iter().filter(|e| e.truncated).count();
                }
            }
            &Reader::Image { size: side, channels, max_value, .. } => {
                let n = channels * side * side;
                let mut images = Vec::with_capacity(rows.len());
                for &(line, row) in &rows {
                    // Counted first: a row of pixels alone must not lend its last pixel as a label.
                    let fields = row.split(',').count();
                    if fields != n + 1 {
                        return Err(bad(
                            line,
                            format!(
                                "a CSV row of {fields} values; expected {channels}×{side}×{side} = {n} pixels then a \
                                 label ({} values)",
                                n + 1
                            ),
                        ));
                    }
                    let (pixels, label) = row.rsplit_once(',').unwrap_or((row, ""));
                    let label = label_of(line, label)?;
                    let image = pixel_row(pixels, max_value).map_err(|e| bad(line, e))?;
                    images.push((image, label));
                }
                batches = image_batches(&images, size);
            }
            Reader::Chars { .. } => {
                return Err(config_error(
                    "--file",
                    "a language model is evaluated on a configured text (--config), not labelled rows",
                ));
            }
        }
        Ok(LabelledRows { batches: Box::new(batches.into_iter().map(Ok)), cut })
    }

    /// A folder of class subfolders (the layout a run trains on) as labelled batches of
    /// `batch_size`: each subfolder's name one of the model's classes (by name, not index, as a
    /// run's held-out folder), each of its files an image of the model's size and channels (or
    /// resized to it, where the model's run resized), read and scaled as `predict` reads such a
    /// file. Names starting with `.` are left out. The subfolders' names are checked here;
    /// the images as the batches are taken.
    fn labelled_folder(&self, dir: &Path, batch_size: usize) -> Result<LabelledRows<'_>> {
        let Reader::Image { .. } = self.reader else {
            let expected = match self.reader {
                Reader::Text(_) => "a file of `label<TAB>text` rows",
                _ => "a language model is evaluated on a configured text (--config)",
            };
            return Err(crate::data::dataset_error(dir, None, format!("is a folder; expected {expected}")));
        };
        let mut files = Vec::new();
        for (name, folder) in crate::data::class_folders(dir)? {
            let label = self.labels.iter().position(|l| *l == name).ok_or_else(|| {
                let classes = self.labels.join(", ");
                let message = format!("names class `{name}`, which is not one of the model's classes ({classes})");
                crate::data::dataset_error(&folder, None, message)
            })? as u32;
            files.extend(crate::data::class_files(&name, &folder)?.into_iter().map(|file| (file, label)));
        }
        // Whole batches of at least FOLDER_READ images, read and fitted on every core; the
        // first bad file in order is the error, and the last item.
        let per_read = batch_size * FOLDER_READ.div_ceil(batch_size);
        let (mut at, mut ready) = (0, std::collections::VecDeque::new());
        let batches = std::iter::from_fn(move || {
            if ready.is_empty() && at < files.len() {
                let part = &files[at..files.len().min(at + per_read)];
                at += part.len();
                let images = crate::data::read_each(part, |(file, label)| {
                    let image = crate::data::read_image_file_as_stored(file)?;
                    Ok((self.fitted(&file.display().to_string(), image)?, *label))
                });
                match images.into_iter().collect::<Result<Vec<_>>>() {
                    Ok(images) => ready.extend(image_batches(&images, batch_size)),
                    Err(e) => {
                        at = files.len();
                        return Some(Err(e));
                    }
                }
            }
            ready.pop_front().map(Ok)
        });
        Ok(LabelledRows { batches: Box::new(batches), cut: 0 })
    }

    /// The settings that turn `config`'s texts into ids (`data.max_len`, `model.tokenizer`)
    /// where they differ from those of the model's run, as `key is now here, then in the
    /// model's run`: an evaluation under them scores other inputs than the run's own did. Empty
    /// where the export does not say.
    pub fn unlike_its_run(&self, config: &RunConfig) -> Vec<String> {
        let (Some(then), now) = (self.trained_on.as_ref(), data_settings(config)) else { return Vec::new() };
        [MAX_LEN, TOKENIZER]
            .into_iter()
            .filter_map(|key| match (then.get(key), now.get(key)) {
                (Some(was), Some(is)) if was != is => Some(format!("{key} is {is} here, {was} in the model's run")),
                _ => None,
            })
            .collect()
    }

    /// Refuses an evaluation split that may hold samples the model trained on
    /// ([`split_overlap`]).
    fn check_split(&self, config: &RunConfig) -> Result<()> {
        match self.trained_on.as_ref().and_then(|then| split_overlap(then, config)) {
            Some((key, message)) => Err(config_error(key, message)),
            None => self.check_pixel_scale(config),
        }
    }

    /// Refuses to score a user's images at another scale than the model's run read them at
    /// (`data.pixel_max`): every pixel would be off by the same factor, and the scores with it.
    fn check_pixel_scale(&self, config: &RunConfig) -> Result<()> {
        let then = self.trained_on.as_ref().and_then(|t| t.get(PIXEL_MAX)).filter(|v| !v.is_null());
        match (then, config.data.user_pixel_max()) {
            (Some(then), Some(now)) if *then != now => Err(config_error(
                PIXEL_MAX,
                format!(
                    "is {now} here, {then} in the model's run: its images would be scaled otherwise than it trained \
                     on them; set data.pixel_max = {then}"
                ),
            )),
            _ => Ok(()),
        }
    }

    /// The metrics on the evaluation split of the dataset `config` names (its test split, or
    /// with `data.validation_fraction` the validation part its runs evaluate on; with the
    /// config's limits), after checking that the data's classes (or characters) are the
    /// model's.
    pub fn evaluate_dataset(&self, config: &RunConfig) -> Result<EvalMetrics> {
        self.check_split(config)?;
        let (source, info) = prepare_data(config, 1)?;
        let data_kind = DataKind::of_data(&info);
        let model_kind = match self.reader {
            Reader::Chars { .. } => DataKind::Chars,
            Reader::Image { .. } => DataKind::Images,
            Reader::Text(_) => DataKind::Texts,
        };
        let matches = match &self.reader {
            Reader::Chars { chars, .. } => *chars == info.chars,
            _ => self.labels == info.labels,
        };
        if model_kind != data_kind || !matches {
            let dataset = config.data.dataset.key();
            let what = if model_kind != data_kind {
                "expected a dataset of the model's kind"
            } else if model_kind == DataKind::Chars {
                "expected the characters the model was trained on, by the same ids"
            } else {
                "expected the classes the model was trained on, in the same order"
            };
            return Err(config_error(
                "data.dataset",
                format!(
                    "the model is {}; this config's dataset {dataset} is {}: {what}",
                    self.describe(),
                    data_kind.describe(&info),
                ),
            ));
        }
        // As a run refuses it: by the setting, not at the first sample long enough. (Once the
        // data is of the model's kind: a dataset of images has no length to refuse.)
        if let InputSpec::Tokens { max_positions, .. } = self.model.spec().input
            && config.data.max_len > max_positions
        {
            return Err(config_error(
                "data.max_len",
                format!("{} tokens; the model's position table holds {max_positions}", config.data.max_len),
            ));
        }
        // Images of another size (MNIST's 28² for a model of digits' 8²) are refused by the
        // dataset's name, not by the first batch's upload. (The first batch, read for it, is
        // the evaluation's first.)
        let batches = source.eval_batches();
        let first = (batches > 0).then(|| source.eval_batch(0)).transpose()?;
        if let Reader::Image { size, channels, .. } = self.reader
            && let Some((their_channels, side)) = info.image
            && (their_channels, side) != (channels, size)
        {
            return Err(config_error(
                "data.dataset",
                format!(
                    "the model reads images of {} of {size}×{size}; the images of {} are {} of {side}×{side}: \
                     expected a dataset of the model's image size and channels",
                    crate::data::image_channels(channels),
                    config.data.dataset.key(),
                    crate::data::image_channels(their_channels),
                ),
            ));
        }
        // Pixels divided by another scale than the model's run divided them by (a folder's
        // images of another depth; data.pixel_max is checked before the data is read).
        if let Reader::Image { max_value, .. } = self.reader
            && let Some(scale) = info.pixel_max
            && (max_value - scale as f32).abs() > 0.5
        {
            let (field, expected) = match config.data.user_folder() {
                true => ("data.train_file", "images stored at the model's depth"),
                false => ("data.dataset", "a dataset of the model's scale"),
            };
            return Err(config_error(
                field,
                format!(
                    "holds pixels divided by {scale}, but the model's run divided its by {max_value}: they would be \
                     read otherwise than it trained on; expected {expected}"
                ),
            ));
        }
        self.evaluate(first.map(Ok).into_iter().chain((1..batches).map(|i| source.eval_batch(i))))
    }

    /// A run's checkpoint (`checkpoint.ckpt`) on `dev`: its parameters, with the config,
    /// labels and tokenizer of the export in the same run directory (`model/`, written with
    /// every checkpoint). Every parameter must be in the checkpoint with its size.
    pub fn load_checkpoint(dev: D, path: &Path) -> Result<Self> {
        let run = path.parent().unwrap_or(Path::new("."));
        let (_, tensors) = checkpoint::load(path)?;
        let values: HashMap<&str, &Vec<f32>> =
            tensors.iter().filter_map(|t| t.name.strip_prefix(checkpoint::PARAM).map(|n| (n, &t.data))).collect();
        // The export's config, labels and reader, and the checkpoint's weights (the export's
        // are not copied onto the device first).
        Self::load_from(dev, &run.join("model"), |model, dev, _| {
            for p in model.params_mut() {
                let Some(v) = values.get(p.name.as_str()).filter(|v| v.len() == p.numel()) else {
                    return Err(config_error(
                        "model",
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
    /// (from 0) of an IDX file, `file:line` for a CSV file's row. (`predict` reads a folder as
    /// its files, each an input of its own: [`folder_inputs`].)
    pub fn read_images(&self, input: &str) -> Result<Vec<(String, Vec<f32>)>> {
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
                InputFile::Image => {
                    Ok(vec![(input.to_string(), self.fitted(input, crate::data::read_image_file_as_stored(path)?)?)])
                }
                // (IDX images are 8-bit.)
                InputFile::Idx => read_idx_images(path)?
                    .into_iter()
                    .enumerate()
                    .map(|(i, pixels)| {
                        let image = StoredImage::of_scaled(pixels, 255, false);
                        Ok((format!("{input}#{i}"), self.fitted(input, image)?))
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
                        if line == 1 && row.split(',').any(|v| v.trim().parse::<f32>().is_err()) {
                            let first = row.split(',').find(|v| v.trim().parse::<f32>().is_err()).unwrap_or_default();
                            return Err(bad(
                                line,
                                format!(
                                    "reads as a header row (`{}` is no number); expected rows of pixel values alone",
                                    first.trim()
                                ),
                            ));
                        }
                        let count = row.split(',').count();
                        if count != n {
                            let labelled = if count == n + 1 {
                                " (pixels then a label? `predict` reads pixels alone; `evaluate --file` scores \
                                 labelled rows)"
                            } else {
                                ""
                            };
                            return Err(bad(
                                line,
                                format!(
                                    "a CSV row of {count} values; expected {channels}×{size}×{size} = {n} pixels{labelled}"
                                ),
                            ));
                        }
                        images.push((format!("{input}:{line}"), pixel_row(row, max_value).map_err(|e| bad(line, e))?));
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
        Ok(vec![(input.to_string(), values)])
    }

    /// An image file's pixels as the model takes them: resized to its size where its run
    /// resized its images (as the run resized them: by their depth), and then of its size and
    /// channels, or an error naming `input`.
    fn fitted(&self, input: &str, image: StoredImage) -> Result<Vec<f32>> {
        let Reader::Image { size, channels, resize, .. } = self.reader else {
            return Err(config_error("input", format!("this {:?} model does not read images", self.family())));
        };
        let (w, h, c) = image.shape;
        if resize && c == channels {
            return Ok(image.resized(size));
        }
        check_size(input, w, h, c, size, channels)?;
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
        _ if head.starts_with(&[0, 0, 8]) => InputFile::Idx,
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

/// Labelled images as batches of `size`.
fn image_batches(images: &[(Vec<f32>, u32)], size: usize) -> Vec<HostBatch> {
    let batch = |chunk: &[(Vec<f32>, u32)]| HostBatch {
        batch: chunk.len(),
        pixels: Some(chunk.iter().flat_map(|c| c.0.iter().copied()).collect()),
        targets: chunk.iter().map(|c| c.1).collect(),
        ..Default::default()
    };
    images.chunks(size).map(batch).collect()
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
    if (w, h, c) == (size, size, channels) {
        return Ok(());
    }
    Err(data_error(
        "input",
        format!("{input}: a {w}×{h} image with {c} channel(s); the model takes {size}×{size} with {channels}"),
    ))
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

#[cfg(test)]
mod tests {
    use super::*;

    /// A split overlaps the training samples where the dataset's split is cut by the seed and a
    /// fraction that differ, or where a validation part is carved otherwise; never on another
    /// dataset, nor on the test files of a dataset that has its own.
    #[test]
    fn a_split_overlaps_the_training_samples_only_where_it_can() {
        let config = |dataset: &str, sets: &[&str]| {
            let text = format!(
                "[model]\npretrained = \"w\"\n[data]\ndataset = \"{dataset}\"\nbatch_size = 8\n[train]\nepochs = 1\n\
                 lr = 1e-4\n[output]\ndir = \"r\"\n"
            );
            RunConfig::parse(&text, "t", &sets.iter().map(|s| s.to_string()).collect::<Vec<_>>()).unwrap()
        };
        let overlap = |dataset: &str, trained: &[&str], now: &[&str]| {
            split_overlap(&data_settings(&config(dataset, trained)), &config(dataset, now)).map(|(key, _)| key)
        };
        assert_eq!(overlap("digits", &[], &[]), None);
        assert_eq!(overlap("digits", &[], &["data.split_seed=5"]).as_deref(), Some("data.split_seed"));
        assert_eq!(overlap("digits", &[], &["data.test_fraction=0.3"]).as_deref(), Some("data.test_fraction"));
        assert_eq!(overlap("digits", &[], &["train.seed=3", "data.test_limit=10"]), None, "order and limit only");
        let carved = ["data.validation_fraction=0.2"];
        assert_eq!(overlap("digits", &[], &carved).as_deref(), Some("data.validation_fraction"));
        assert_eq!(overlap("digits", &carved, &carved), None, "the run's own validation part");
        assert_eq!(overlap("digits", &carved, &[]), None, "the test split it never saw");
        // Fashion-MNIST's test split is its own file: another seed scores the same test set...
        assert_eq!(overlap("fashion_mnist", &[], &["data.split_seed=5"]), None);
        // ...and carves another validation part from the training half.
        let other = ["data.validation_fraction=0.2", "data.split_seed=5"];
        assert_eq!(overlap("fashion_mnist", &carved, &other).as_deref(), Some("data.split_seed"));
        let (_, message) =
            split_overlap(&data_settings(&config("digits", &[])), &config("digits", &["data.split_seed=5"])).unwrap();
        assert!(message.contains("data.split_seed = 0 (here 5)") && message.contains("samples it trained on"));
        // Another dataset is the class check's to refuse.
        assert_eq!(
            split_overlap(&data_settings(&config("digits", &[])), &config("mnist5k", &["data.split_seed=5"])),
            None
        );
        // A user's labelled texts: cut by the seed from the same file (by its bytes) overlap
        // under another seed; another file's, or a held-out file, is not known to.
        let dir = crate::testing::Scratch::new("overlap-user-files");
        let (a, b) = (dir.join("a.tsv"), dir.join("b.tsv"));
        std::fs::write(&a, "x\tone\n").unwrap();
        std::fs::write(&b, "x\ttwo\n").unwrap();
        let (a, b) = (format!("data.train_file=\"{}\"", a.display()), format!("data.train_file=\"{}\"", b.display()));
        let seed = "data.split_seed=5";
        assert_eq!(overlap("labelled_texts", &[&a], &[&a, seed]).as_deref(), Some("data.split_seed"));
        assert_eq!(overlap("labelled_texts", &[&a], &[&b, seed]), None);
        // The same file edited since: a split cut from it is not the run's.
        let trained = data_settings(&config("labelled_texts", &[&a]));
        std::fs::write(dir.join("a.tsv"), "x\tone\ny\ttwo\n").unwrap();
        let edited = split_overlap(&trained, &config("labelled_texts", &[&a]));
        assert!(
            edited.as_ref().is_some_and(|(key, m)| key == "data.train_file" && m.contains("edited since")),
            "{edited:?}"
        );
        // A run that held out a file trained on all of the training file.
        let held_out = "data.test_file=\"t.tsv\"";
        let cut =
            split_overlap(&data_settings(&config("labelled_texts", &[&a, held_out])), &config("labelled_texts", &[&a]));
        assert!(
            cut.as_ref().is_some_and(|(key, m)| key == "data.test_file" && m.contains("trained on all of")),
            "{cut:?}"
        );
        assert_eq!(
            overlap("labelled_texts", &[&a, "data.test_file=\"t.tsv\""], &[&a, "data.test_file=\"t.tsv\"", seed]),
            None
        );
    }

    /// An export whose config.json describes less than its weights hold (one layer of two)
    /// is refused, naming the tensors, instead of answering with a model that is not the one
    /// trained.
    #[test]
    fn an_export_whose_weights_and_config_disagree_is_refused() {
        let dev = crate::device::CpuDevice::<f32>::new(0, 1).unwrap();
        let config = crate::model::tiny::tiny_gpt(0.0);
        let model = Model::new(&dev, &config, 1).unwrap();
        let scratch = crate::files::Scratch::new("predict-disagree");
        let dir = scratch.join("export");
        let chars: Vec<char> = "abcdefghijklmnopq".chars().collect();
        let extras = weights::ExportExtras { chars: &chars, ..Default::default() };
        weights::export_model(&model, &dev, &config, &extras, &dir).unwrap();
        assert!(Predictor::load(crate::device::CpuDevice::<f32>::new(0, 1).unwrap(), &dir).is_ok());
        let path = dir.join("config.json");
        let mut json: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        json["n_layer"] = 1.into();
        std::fs::write(&path, json.to_string()).unwrap();
        let err = Predictor::load(dev, &dir).err().unwrap().to_string();
        assert!(err.contains("the weights hold") && err.contains("transformer.h.1."), "{err}");
    }

    /// `open` takes an export folder or a run's folder with the export in `model/`; a folder
    /// with neither is refused by the export's missing file.
    #[test]
    fn a_model_opens_from_its_export_or_its_runs_folder() {
        let dev = || crate::device::CpuDevice::<f32>::new(0, 1).unwrap();
        let config = crate::model::ModelConfig::Gpt(crate::model::GptConfig::without_dropout(4, 8, 8, 1, 2));
        let scratch = crate::files::Scratch::new("predict-open");
        let chars: Vec<char> = "abcd".chars().collect();
        let extras = weights::ExportExtras { chars: &chars, ..Default::default() };
        let export = scratch.join("model");
        weights::export_model(&Model::new(&dev(), &config, 1).unwrap(), &dev(), &config, &extras, &export).unwrap();
        for path in [&export, &scratch.to_path_buf()] {
            assert!(Predictor::open(dev(), path).is_ok(), "{}", path.display());
        }
        let err = Predictor::open(dev(), &scratch.join("elsewhere")).err().unwrap().to_string();
        assert!(
            err.contains("elsewhere") && err.contains("does not exist") && err.contains("checkpoint.ckpt"),
            "{err}"
        );
        // A file inside the export: pointed to its folder.
        let err = Predictor::open(dev(), &export.join(weights::WEIGHTS_FILE)).err().unwrap().to_string();
        assert!(err.contains("is a file of the exported model in") && err.contains("pass that folder"), "{err}");
        // A folder that holds neither an export nor a run's: the export's missing file.
        std::fs::create_dir(scratch.join("empty")).unwrap();
        let err = Predictor::open(dev(), &scratch.join("empty")).err().unwrap().to_string();
        assert!(err.contains("config.json"), "{err}");
    }

    /// An input that is neither a file nor a row of pixels: a name that reads as a file's is
    /// said to be missing; anything else is named by its first value that is not a pixel.
    #[test]
    fn a_missing_image_file_is_called_missing() {
        let (_scratch, p) = tiny_vit_predictor("predict-missing");
        for input in ["/tmp/pt-no-such-dir/7.png", "seven.png", "rows.csv.gz"] {
            let e = p.read_images(input).unwrap_err().to_string();
            assert!(e.contains(&format!("`{input}`: no such file")), "{input}: {e}");
        }
        for input in ["1,2,x", "1.5e3", "0.5,0.25"] {
            let e = p.read_images(input).unwrap_err().to_string();
            assert!(!e.contains("no such file"), "{input}: {e}");
        }
    }

    /// A PGM file's bytes: a `side × side` 8-bit image, its pixels drawn from `seed`.
    fn pgm(side: usize, seed: usize) -> Vec<u8> {
        let pixels = (0..side * side).map(|i| ((i * 7 + seed * 31) % 251) as u8);
        format!("P5\n{side} {side}\n255\n").into_bytes().into_iter().chain(pixels).collect()
    }

    /// A folder given to `predict` is every file under it, subfolders walked, in name order,
    /// names starting with `.` left out: an image the model takes is answered as the same file
    /// alone is, and a file that is no image, or an image of another size, fails alone, named
    /// by its path. A folder with no file is an error.
    #[test]
    fn a_folder_is_every_image_under_it_each_failing_alone() {
        let (scratch, p) = tiny_vit_predictor("predict-folder");
        let dir = scratch.join("images");
        std::fs::create_dir_all(dir.join("sub")).unwrap();
        for (name, bytes) in [
            ("a.pgm", pgm(4, 1)),
            ("sub/b.pgm", pgm(4, 2)),
            ("c.txt", b"hello".to_vec()),
            ("d.pgm", pgm(5, 3)),
            (".e.pgm", pgm(4, 4)),
        ] {
            std::fs::write(dir.join(name), bytes).unwrap();
        }
        let json = options(2, Sampling::default(), OutputFormat::JsonLines);
        let (r, out) = run(&p, &[dir.to_str().unwrap()], &json);
        assert_eq!(r.unwrap(), (4, 2), "{out}");
        let lines: Vec<serde_json::Value> = out.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
        let inputs: Vec<&str> = lines.iter().map(|l| l["input"].as_str().unwrap()).collect();
        let named = |f: &str| dir.join(f).display().to_string();
        assert_eq!(inputs, [named("a.pgm"), named("c.txt"), named("d.pgm"), named("sub/b.pgm")]);
        assert!(lines[0]["label"].is_string() && lines[3]["label"].is_string(), "{out}");
        assert!(lines[1]["error"].as_str().unwrap().contains("starts with bytes"), "{out}");
        assert!(lines[2]["error"].as_str().unwrap().contains("a 5×5 image with 1 channel(s)"), "{out}");
        let (_, alone) = run(&p, &[&named("a.pgm")], &json);
        let alone: serde_json::Value = serde_json::from_str(alone.trim()).unwrap();
        assert_eq!(alone["probabilities"], lines[0]["probabilities"]);

        std::fs::create_dir(scratch.join("empty")).unwrap();
        let e = p.read_images(scratch.join("empty").to_str().unwrap()).unwrap_err().to_string();
        assert!(e.contains("is a folder with no files"), "{e}");
        // A link to a folder inside the folder is named, not followed (a link back up would
        // never end); the folder's other files are answered.
        std::os::unix::fs::symlink(&dir, dir.join("sub/up")).unwrap();
        let (r, out) = run(&p, &[dir.to_str().unwrap()], &json);
        assert_eq!(r.unwrap(), (5, 3), "{out}");
        let up = out.lines().find(|l| l.contains("sub/up")).unwrap_or_default();
        assert!(up.contains("a link to a folder, not followed"), "{out}");
    }

    /// Images are read ahead of the batches, several inputs at a time on every core, and still
    /// answered in the inputs' order: a folder of 30 files, every fourth no image, in batches
    /// of 3 (so the reads run past a batch's end), each good file answered as it is alone, each
    /// bad one failing in its place; an input that cannot be read at all ends the stream after
    /// the answers before it, and the inputs after it are not answered.
    #[test]
    fn images_read_ahead_are_answered_in_order() {
        let (scratch, p) = tiny_vit_predictor("predict-read-ahead");
        let dir = scratch.join("many");
        std::fs::create_dir_all(&dir).unwrap();
        for i in 0..30 {
            let bytes = if i % 4 == 3 { b"no image".to_vec() } else { pgm(4, i) };
            std::fs::write(dir.join(format!("{i:02}.pgm")), bytes).unwrap();
        }
        let json = options(3, Sampling::default(), OutputFormat::JsonLines);
        let inputs = vec![
            Ok(dir.display().to_string()),
            Err(Error::Io { path: "stdin".into(), source: std::io::Error::other("gone") }),
            Ok(dir.join("00.pgm").display().to_string()),
        ];
        let mut out = Vec::new();
        let r = predict_stream(&p, inputs.into_iter(), &json, &mut out);
        assert!(r.is_err_and(|e| e.to_string().contains("gone")));
        let out = String::from_utf8(out).unwrap();
        let lines: Vec<serde_json::Value> = out.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
        assert_eq!(lines.len(), 30, "{out}");
        for (i, line) in lines.iter().enumerate() {
            let file = dir.join(format!("{i:02}.pgm")).display().to_string();
            assert_eq!(line["input"], file.as_str());
            if i % 4 == 3 {
                assert!(line["error"].as_str().unwrap().contains("starts with bytes"), "{line}");
            } else {
                let (_, alone) = run(&p, &[&file], &json);
                let alone: serde_json::Value = serde_json::from_str(alone.trim()).unwrap();
                assert_eq!(alone["probabilities"], line["probabilities"], "{file}");
            }
        }
    }

    /// `evaluate --file` reads a folder of class subfolders, each named by a class of the model,
    /// as the labelled images of those classes (each scaled as `predict` scales
    /// the file); a subfolder that names no class, a file that is no image or one of another
    /// size is an error naming its path, as is a folder for a model that reads no images.
    #[test]
    fn a_folder_of_class_subfolders_is_scored_by_its_names() {
        let (scratch, p) = tiny_vit_predictor("predict-labelled-folder");
        let dir = scratch.join("held-out");
        for (i, class) in ["a", "a", "b"].iter().enumerate() {
            std::fs::create_dir_all(dir.join(class)).unwrap();
            std::fs::write(dir.join(class).join(format!("{i}.pgm")), pgm(4, i)).unwrap();
        }
        let read_all = |dir: &Path| p.labelled_rows(dir, 2)?.batches.collect::<Result<Vec<HostBatch>>>();
        let read = read_all(&dir).unwrap();
        let targets: Vec<u32> = read.iter().flat_map(|b| b.targets.clone()).collect();
        // Folders in name order: `a`, `b`.
        assert_eq!(targets, [0, 0, 1]);
        assert_eq!(read.iter().map(|b| b.batch).collect::<Vec<_>>(), [2, 1]);
        let alone = p.read_images(dir.join("a/0.pgm").to_str().unwrap()).unwrap();
        let first = read[0].pixels.as_ref().unwrap();
        assert_eq!(alone[0].1[..], first[..16]);
        // A class's index is no class name (as for a run's held-out folder).
        std::fs::create_dir(dir.join("1")).unwrap();
        std::fs::write(dir.join("1/9.pgm"), pgm(4, 9)).unwrap();
        let e = p.labelled_rows(&dir, 2).unwrap_err().to_string();
        assert!(e.contains("names class `1`, which is not one of the model's classes (a, b)"), "{e}");
        std::fs::remove_dir_all(dir.join("1")).unwrap();

        std::fs::create_dir(dir.join("c")).unwrap();
        std::fs::write(dir.join("c/9.pgm"), pgm(4, 9)).unwrap();
        let e = p.labelled_rows(&dir, 2).unwrap_err().to_string();
        assert!(e.contains("names class `c`, which is not one of the model's classes (a, b)"), "{e}");
        std::fs::remove_dir_all(dir.join("c")).unwrap();
        std::fs::write(dir.join("b/big.pgm"), pgm(5, 0)).unwrap();
        let e = read_all(&dir).unwrap_err().to_string();
        assert!(e.contains("big.pgm") && e.contains("a 5×5 image"), "{e}");
        std::fs::write(dir.join("b/big.pgm"), "not an image").unwrap();
        let e = read_all(&dir).unwrap_err().to_string();
        assert!(e.contains("big.pgm") && e.contains("not a PNG, JPEG or PGM"), "{e}");

        let (_gpt_dir, gpt) = tiny_gpt_predictor("predict-labelled-folder-gpt", "abc ");
        let e = gpt.labelled_rows(&dir, 2).err().unwrap().to_string();
        assert!(e.contains("is a folder; expected") && e.contains("--config"), "{e}");
    }

    /// A labelled folder is read as it is scored, `FOLDER_READ` images (in whole batches) at a
    /// time: its first batches come before a bad file further on is read, which then ends them
    /// with its error; the batches are those of a folder read at once.
    #[test]
    fn a_labelled_folder_is_read_as_it_is_scored() {
        let (scratch, p) = tiny_vit_predictor("predict-labelled-folder-lazy");
        let dir = scratch.join("held-out");
        let n = FOLDER_READ + 40;
        for class in ["a", "b"] {
            std::fs::create_dir_all(dir.join(class)).unwrap();
        }
        for i in 0..n {
            let class = if i < n / 2 { "a" } else { "b" };
            std::fs::write(dir.join(class).join(format!("{i:03}.pgm")), pgm(4, i % 7)).unwrap();
        }
        let batch = 3;
        let all: Vec<HostBatch> = p.labelled_rows(&dir, batch).unwrap().batches.map(Result::unwrap).collect();
        assert_eq!(all.iter().map(|b| b.batch).sum::<usize>(), n);
        assert!(all[..all.len() - 1].iter().all(|b| b.batch == batch));
        let targets: Vec<u32> = all.iter().flat_map(|b| b.targets.clone()).collect();
        assert_eq!(targets, (0..n).map(|i| u32::from(i >= n / 2)).collect::<Vec<_>>());
        let file = |i: usize| dir.join(if i < n / 2 { "a" } else { "b" }).join(format!("{i:03}.pgm"));
        for (i, b) in all.iter().enumerate().step_by(17) {
            let alone = p.read_images(file(batch * i).to_str().unwrap()).unwrap();
            assert_eq!(alone[0].1[..], b.pixels.as_ref().unwrap()[..16], "batch {i}");
        }
        // A bad file past the first read: the batches of that read come, then its error.
        let bad = n - 5;
        std::fs::write(file(bad), "not an image").unwrap();
        let mut batches = p.labelled_rows(&dir, batch).unwrap().batches;
        let first_read = FOLDER_READ.div_ceil(batch);
        for b in all.iter().take(first_read) {
            assert_eq!(&batches.next().unwrap().unwrap(), b);
        }
        let e = batches.next().unwrap().unwrap_err().to_string();
        assert!(e.contains(&format!("{bad:03}.pgm")) && e.contains("not a PNG, JPEG or PGM"), "{e}");
        assert!(batches.next().is_none(), "nothing after the error");
    }

    /// Nothing to score is an error, as a forward of no input is, not metrics of 0 %.
    #[test]
    fn an_evaluation_of_nothing_is_an_error() {
        let (_scratch, p) = tiny_gpt_predictor("predict-empty-eval", "abcd");
        let err = p.evaluate(std::iter::empty()).unwrap_err().to_string();
        assert!(err.contains("no labelled target to score"), "{err}");
        let ignored = HostBatch {
            batch: 1,
            seq: 2,
            tokens: Some(vec![1, 2]),
            targets: vec![IGNORE_INDEX; 2],
            ..Default::default()
        };
        assert!(p.evaluate(std::iter::once(Ok(ignored))).is_err());
        let scored =
            HostBatch { batch: 1, seq: 2, tokens: Some(vec![1, 2]), targets: vec![2, 3], ..Default::default() };
        assert_eq!(p.evaluate(std::iter::once(Ok(scored))).unwrap().count, 2);
    }

    /// A tiny character GPT's export, loaded (`vocab` its characters).
    fn tiny_gpt_predictor(
        name: &str,
        vocab: &str,
    ) -> (crate::files::Scratch, Predictor<crate::device::CpuDevice<f32>>) {
        let dev = crate::device::CpuDevice::<f32>::new(0, 1).unwrap();
        let chars: Vec<char> = vocab.chars().collect();
        let config = crate::model::ModelConfig::Gpt(crate::model::GptConfig::without_dropout(chars.len(), 8, 8, 1, 2));
        let scratch = crate::files::Scratch::new(name);
        let extras = weights::ExportExtras { chars: &chars, ..Default::default() };
        weights::export_model(&Model::new(&dev, &config, 1).unwrap(), &dev, &config, &extras, &scratch).unwrap();
        let predictor = Predictor::load(dev, &scratch).unwrap();
        (scratch, predictor)
    }

    /// A text the tokenizer reads nothing of (a zero-width space, control characters) is an
    /// empty text, for `predict` and for `evaluate --file` (by its line), not scored as
    /// `[CLS] [SEP]`; an unknown word is still a word (`[UNK]`).
    #[test]
    fn a_text_the_tokenizer_reads_nothing_of_is_empty() {
        let dev = crate::device::CpuDevice::<f32>::new(0, 1).unwrap();
        let config = crate::model::tiny::tiny_bert(crate::model::Pooling::Cls, 0.0);
        let scratch = crate::files::Scratch::new("predict-empty-text");
        let tokenizer = scratch.join("tokenizer");
        std::fs::create_dir_all(&tokenizer).unwrap();
        std::fs::write(tokenizer.join("tokenizer.json"), crate::text::tokenizer::tests::TINY_JSON).unwrap();
        let labels: Vec<String> = ["a", "b", "c"].map(String::from).into();
        let extras = weights::ExportExtras { labels: &labels, tokenizer_dir: Some(&tokenizer), ..Default::default() };
        let model = scratch.join("model");
        weights::export_model(&Model::new(&dev, &config, 1).unwrap(), &dev, &config, &extras, &model).unwrap();
        let p = Predictor::load(dev, &model).unwrap();
        for nothing in ["\u{200b}", "\u{0}\u{1}", " \t "] {
            let e = p.classify_texts(&["zzz", nothing]).unwrap_err().to_string();
            assert!(e.contains("an empty text (no token the tokenizer reads"), "{nothing:?}: {e}");
        }
        assert_eq!(p.classify_texts(&["zzz"]).unwrap().len(), 1);
        let rows = scratch.join("rows.tsv");
        std::fs::write(&rows, "a\tzzz\nb\t\u{200b}\n").unwrap();
        let e = p.labelled_rows(&rows, 8).unwrap_err().to_string();
        assert!(e.contains("line 2: an empty text"), "{e}");
        // A text past the 9 positions is cut there, and counted.
        std::fs::write(&rows, format!("a\tzzz\nb\t{}\n", ["zzz"; 20].join(" "))).unwrap();
        let read = p.labelled_rows(&rows, 1).unwrap();
        assert_eq!((read.batches.count(), read.cut), (2, 1));
    }

    /// A prompt longer than the window is read from its end, with a warning; the window is the
    /// run's `data.max_len` where the export records it (positions past it never trained),
    /// else the position table (8 here).
    #[test]
    fn a_prompt_past_the_window_is_read_from_its_end_and_said_so() {
        let greedy = Sampling { max_new_tokens: 3, temperature: 0.0, ..Sampling::default() };
        let (_dir, gpt) = tiny_gpt_predictor("predict-window", "ab");
        let whole = gpt.generate("abbab", &greedy).unwrap();
        assert_eq!(whole.warning, None);
        let long = gpt.generate("aabbabaabab", &greedy).unwrap();
        let said = long.warning.as_deref().unwrap_or_default();
        assert!(said.contains("its last 8 characters") && said.contains("the first 3 left unread"), "{said}");
        // Trained on windows of 4: the last 4 characters are what the model reads.
        let dev = crate::device::CpuDevice::<f32>::new(0, 1).unwrap();
        let config = crate::model::ModelConfig::Gpt(crate::model::GptConfig::without_dropout(2, 8, 8, 1, 2));
        let scratch = crate::files::Scratch::new("predict-window-trained");
        let trained_on = serde_json::json!({ MAX_LEN: 4 });
        let chars = ['a', 'b'];
        let extras = weights::ExportExtras { chars: &chars, trained_on: Some(&trained_on), ..Default::default() };
        weights::export_model(&Model::new(&dev, &config, 1).unwrap(), &dev, &config, &extras, &scratch).unwrap();
        let gpt = Predictor::load(dev, &scratch).unwrap();
        let long = gpt.generate("aabbab", &greedy).unwrap();
        assert!(long.warning.as_deref().is_some_and(|w| w.contains("its last 4 characters")), "{long:?}");
        assert_eq!(long.text, gpt.generate("bbab", &greedy).unwrap().text);
    }

    /// A classification's JSON line lists the probabilities in label order, as the model's
    /// labels are (not sorted by name).
    #[test]
    fn probabilities_come_in_label_order() {
        let p = ClassPrediction {
            label: "zebra".into(),
            probability: 0.75,
            probabilities: vec![("zebra".into(), 0.75), ("ant".into(), 0.25)],
            warning: None,
        };
        let mut out = Vec::new();
        write_outcome(&mut out, OutputFormat::JsonLines, false, "x", &Outcome::Class(p)).unwrap();
        let line = String::from_utf8(out).unwrap();
        assert!(
            line.starts_with(r#"{"input":"x","#) && line.contains(r#""probabilities":{"zebra":0.75,"ant":0.25}"#),
            "{line}"
        );
        let v: serde_json::Value = serde_json::from_str(&line).unwrap();
        assert_eq!((v["input"].as_str(), v["label"].as_str()), (Some("x"), Some("zebra")));
    }

    /// A tiny 4×4 ViT's export (pixels 0..=16, classes `a`, `b`), loaded.
    fn tiny_vit_predictor(name: &str) -> (crate::files::Scratch, Predictor<crate::device::CpuDevice<f32>>) {
        let dev = crate::device::CpuDevice::<f32>::new(0, 1).unwrap();
        let config = crate::model::tiny::tiny_gray_vit();
        let scratch = crate::files::Scratch::new(name);
        let labels = ["a".to_string(), "b".to_string()];
        let extras = weights::ExportExtras { labels: &labels, pixel_max: Some(16), ..Default::default() };
        weights::export_model(&Model::new(&dev, &config, 1).unwrap(), &dev, &config, &extras, &scratch).unwrap();
        let predictor = Predictor::load(dev, &scratch).unwrap();
        (scratch, predictor)
    }

    fn options(batch_size: usize, sampling: Sampling, format: OutputFormat) -> PredictOptions {
        PredictOptions { batch_size, sampling, format }
    }

    fn run(
        predictor: &Predictor<crate::device::CpuDevice<f32>>,
        inputs: &[&str],
        options: &PredictOptions,
    ) -> (Result<(usize, usize)>, String) {
        let mut out = Vec::new();
        let r = predict_stream(predictor, inputs.iter().map(|s| Ok(s.to_string())), options, &mut out);
        (r, String::from_utf8(out).unwrap())
    }

    /// Options no input could use are refused once, before any input is read or any line
    /// written: a bad temperature (not an error per prompt), a batch size of 0, and sampling
    /// flags for a model that does not generate.
    #[test]
    fn bad_options_are_refused_once_before_any_input() {
        let (_gpt_dir, gpt) = tiny_gpt_predictor("predict-options-gpt", "abc ");
        let json = OutputFormat::JsonLines;
        let bad = Sampling { temperature: -1.0, max_new_tokens: 2, ..Sampling::default() };
        let (r, out) = run(&gpt, &["ab", "ba", "c"], &options(4, bad, json));
        let e = r.unwrap_err().to_string();
        assert!(e.contains("--temperature") && e.contains("is -1") && out.is_empty(), "{e} / {out}");
        for t in [f64::NAN, f64::INFINITY] {
            let (r, _) = run(&gpt, &["ab"], &options(1, Sampling { temperature: t, ..bad }, json));
            assert!(r.unwrap_err().to_string().contains("--temperature"));
        }
        let none = Sampling { max_new_tokens: 0, ..Sampling::default() };
        let (r, _) = run(&gpt, &["ab"], &options(1, none, json));
        assert!(r.unwrap_err().to_string().contains("--max-new-tokens"));
        // Greedy decoding with a top-k or a seed, which it would ignore.
        for (flag, greedy) in [
            (
                "--top-k 3 has no effect at --temperature 0",
                Sampling { temperature: 0.0, top_k: 3, ..Sampling::default() },
            ),
            (
                "--seed 7 has no effect at --temperature 0",
                Sampling { temperature: 0.0, seed: 7, ..Sampling::default() },
            ),
        ] {
            let (r, out) = run(&gpt, &["ab"], &options(1, greedy, json));
            let e = r.unwrap_err().to_string();
            assert!(e.contains(flag) && out.is_empty(), "{e} / {out}");
            let sampled = Sampling { temperature: 0.5, max_new_tokens: 2, ..greedy };
            assert!(run(&gpt, &["ab"], &options(1, sampled, json)).0.is_ok());
        }
        let good = Sampling { max_new_tokens: 2, temperature: 0.0, ..Sampling::default() };
        let (r, out) = run(&gpt, &["ab", "ba"], &options(1, good, json));
        assert_eq!((r.unwrap(), out.lines().count()), ((2, 0), 2), "{out}");
        let (r, out) = run(&gpt, &["ab"], &options(0, good, json));
        assert!(r.unwrap_err().to_string().contains("--batch-size") && out.is_empty());

        let (vit_dir, vit) = tiny_vit_predictor("predict-options-vit");
        let row = ["0"; 16].join(",");
        let (r, out) = run(&vit, &[&row], &options(0, Sampling::default(), json));
        assert!(r.unwrap_err().to_string().contains("--batch-size") && out.is_empty());
        let greedy = Sampling { temperature: 0.0, seed: 5, ..Sampling::default() };
        let e = run(&vit, &[&row], &options(8, greedy, json)).0.unwrap_err().to_string();
        assert!(e.contains("only apply to text generation") && !e.contains("most probable"), "{e}");
        let gpt_only = Sampling { temperature: 0.5, top_k: 3, ..Sampling::default() };
        let (r, out) = run(&vit, &[&row], &options(8, gpt_only, json));
        let e = r.unwrap_err().to_string();
        assert!(out.is_empty(), "{out}");
        assert!(
            e.contains("--temperature 0.5 and --top-k 3 only apply to text generation")
                && e.contains("a ViT image classifier with 2 classes (a, b)"),
            "{e}"
        );
        let (r, out) = run(&vit, &[&row], &options(8, Sampling::default(), json));
        assert_eq!((r.unwrap(), out.lines().count()), ((1, 0), 1), "{out}");
        // Labelled rows in batches of 0 are refused too, not read one by one.
        let rows = vit_dir.join("rows.csv");
        std::fs::write(&rows, format!("{row},a\n")).unwrap();
        assert!(vit.labelled_rows(&rows, 0).unwrap_err().to_string().contains("--batch-size"));
        assert_eq!(vit.labelled_rows(&rows, 1).unwrap().batches.count(), 1);
    }

    /// A table starts with a header naming its columns, above the rows it heads.
    #[test]
    fn a_table_has_a_header_row() {
        let (_vit_dir, vit) = tiny_vit_predictor("predict-table");
        let row = ["16"; 16].join(",");
        let (r, out) = run(&vit, &[&row, "1,2"], &options(8, Sampling::default(), OutputFormat::Table));
        assert_eq!(r.unwrap(), (2, 1));
        let lines: Vec<&str> = out.lines().collect();
        assert_eq!(lines.len(), 3, "{out}");
        let header: Vec<&str> = lines[0].split_whitespace().collect();
        assert_eq!(header, ["input", "label", "probability"], "{out}");
        // The probability ends where its header does.
        assert_eq!(lines[1].find('%').map(|i| i + 1), Some(lines[0].len()), "{out}");
        assert!(lines[2].contains("error:"), "{out}");
        let (_gpt_dir, gpt) = tiny_gpt_predictor("predict-table-gpt", "abc ");
        let sampling = Sampling { max_new_tokens: 3, temperature: 0.0, ..Sampling::default() };
        let (r, out) = run(&gpt, &["ab", "z", "ba"], &options(1, sampling, OutputFormat::Table));
        assert_eq!(r.unwrap(), (3, 1));
        // Each generation, or prompt that failed, ends at a rule (a text may break lines): the
        // header's, then one under each.
        let blocks: Vec<&str> = out.split(&format!("{GENERATION_RULE}\n")).collect();
        assert_eq!(blocks.len(), 5, "{out}");
        assert_eq!(blocks[0], "prompt, then the generated text; a rule under each\n", "{out}");
        assert!(blocks[1].starts_with("ab") && blocks[1].len() > "ab\n".len(), "{out}");
        assert!(blocks[2].starts_with("z  error:"), "{out}");
        assert!(blocks[3].starts_with("ba") && blocks[4].is_empty(), "{out}");
        // JSON lines have no header.
        let (_, out) = run(&vit, &[&row], &options(8, Sampling::default(), OutputFormat::JsonLines));
        assert!(out.starts_with('{'), "{out}");
    }

    /// The table's columns are counted as a terminal shows them: a wide (CJK) character takes
    /// two, so a row of them pads to the same column, and one cut ends within its width.
    #[test]
    fn table_columns_are_counted_in_terminal_widths() {
        use unicode_width::UnicodeWidthStr;
        assert_eq!(padded("映画", 6), "映画  ");
        assert_eq!(padded("film", 6), "film  ");
        let long = "映".repeat(40);
        let cut = shorten(&long, INPUT_COLUMN);
        assert!(cut.ends_with('…') && cut.width() <= INPUT_COLUMN && cut.width() >= INPUT_COLUMN - 1, "{cut}");
        assert_eq!(shorten("a\tb", 8), "a b");
        let (_vit_dir, vit) = tiny_vit_predictor("predict-table-wide");
        let row = ["16"; 16].join(",");
        let (_, out) = run(&vit, &[&row, "映画", "1,2"], &options(8, Sampling::default(), OutputFormat::Table));
        let errors: Vec<usize> = out.lines().filter_map(|l| l.find("error:").map(|i| l[..i].width())).collect();
        assert_eq!(errors, [INPUT_COLUMN + 2, INPUT_COLUMN + 2], "{out}");
    }

    #[test]
    fn sampling_keeps_to_the_top_k_and_is_greedy_at_temperature_zero() {
        let logits = [0.0f32, 3.0, 1.0, 2.9];
        let s = Sampling { max_new_tokens: 1, temperature: 0.0, top_k: 0, seed: 1 };
        assert_eq!(draw(&logits, &s, &mut Rng::new(1)), 1);
        let top2 = Sampling { temperature: 1.0, top_k: 2, ..s };
        let mut rng = Rng::new(3);
        let drawn: Vec<usize> = (0..200).map(|_| draw(&logits, &top2, &mut rng)).collect();
        assert!(drawn.iter().all(|&i| i == 1 || i == 3), "only the two most probable");
        assert!(drawn.contains(&1) && drawn.contains(&3), "both drawn");
        let p = softmax(&logits, 1.0);
        assert!((p.iter().sum::<f64>() - 1.0).abs() < 1e-12 && p[1] > p[3] && p[3] > p[2]);
        // A temperature so small that logit / T overflows: all the mass on the largest logit.
        assert_eq!(softmax(&logits, 1e-310), [0.0, 1.0, 0.0, 0.0]);
        assert_eq!(draw(&logits, &Sampling { temperature: 1e-310, ..top2 }, &mut rng), 1);
    }
}

/// How predictions are written.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OutputFormat {
    /// One JSON object per input and line: `{"input", "label", "probability",
    /// "probabilities"}`, `{"input", "generated"}`, or `{"input", "error"}`.
    JsonLines,
    /// Aligned columns for a person at a terminal.
    Table,
}

/// What [`predict_stream`] does with its inputs.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PredictOptions {
    /// Inputs per forward pass (texts and images): at least 1.
    pub batch_size: usize,
    /// How a GPT continues a prompt; [`Sampling::default`] for any other model.
    pub sampling: Sampling,
    /// How each result is written.
    pub format: OutputFormat,
}

/// One input's result, as written.
enum Outcome {
    Class(ClassPrediction),
    Generated(Generation),
    Failed(String),
}

impl PredictOptions {
    /// Refuses, once and before any input, what no input could use: a batch size of 0,
    /// sampling no generation can use, and (for a model that does not generate) sampling
    /// flags other than the defaults, which it would ignore.
    pub fn check<D: Device>(&self, predictor: &Predictor<D>) -> Result<()> {
        if self.batch_size == 0 {
            return Err(batch_size_error());
        }
        if let Reader::Chars { .. } = predictor.reader {
            return self.sampling.check().and_then(|()| self.sampling.check_greedy());
        }
        let flags = self.sampling.changed_flags();
        if !flags.is_empty() {
            let (them, apply) = if flags.len() == 1 { ("it", "applies") } else { ("them", "apply") };
            let listed = match flags.split_last() {
                Some((last, rest)) if !rest.is_empty() => format!("{} and {last}", rest.join(", ")),
                _ => flags.join(""),
            };
            // Named by the first flag given (`--temperature`), as a flag.
            let field = flags[0].split(' ').next().unwrap_or("--temperature").to_string();
            return Err(config_error(
                field,
                format!(
                    "{} only {apply} to text generation (a GPT); the model is {}, which generates nothing: \
                     leave {them} out",
                    listed,
                    predictor.describe()
                ),
            ));
        }
        Ok(())
    }
}

/// Runs `predictor` on every input of `inputs` (texts, image paths or CSV rows, prompts, as
/// the model reads) in batches, writing one result per input, in order, to `out` as it goes
/// (a table starts with its header). The options are checked first ([`PredictOptions::check`]):
/// a bad one is an error before any input is read. An input that fails (an empty line, an
/// unreadable image, an unknown character, a line that is not text: an [`Error::Dataset`]
/// naming its line) gets an error result and the rest go on; another error reading the inputs
/// stops the run. Returns (results written, failed): one result
/// per image of a file that holds several.
pub fn predict_stream<D: Device>(
    predictor: &Predictor<D>,
    inputs: impl Iterator<Item = Result<String>>,
    options: &PredictOptions,
    out: &mut dyn std::io::Write,
) -> Result<(usize, usize)> {
    options.check(predictor)?;
    let size = options.batch_size;
    let generates = matches!(predictor.reader, Reader::Chars { .. });
    if options.format == OutputFormat::Table {
        write_table_header(out, generates)
            .and_then(|()| out.flush())
            .map_err(|e| Error::Io { path: "output".into(), source: e })?;
    }
    let (mut total, mut failed) = (0, 0);
    let mut pending: Vec<(String, Option<Vec<f32>>)> = Vec::new();
    // A folder given to an image model is its files, each an input of its own, read as the
    // batches reach them: a folder of many images is never held whole.
    let image = matches!(predictor.reader, Reader::Image { .. });
    let mut inputs = inputs.flat_map(|input| match input {
        Ok(name) if image && Path::new(&name).is_dir() => folder_inputs(&name),
        other => vec![other],
    });
    // Images are read ahead, as many inputs at a time as there are cores (up to 8: each may be
    // an IDX file of many images), on every core; each input comes with its images.
    let ahead = if image { std::thread::available_parallelism().map_or(1, |n| n.get()).min(8) } else { 1 };
    let mut read = std::collections::VecDeque::new();
    let mut inputs = std::iter::from_fn(move || {
        if read.is_empty() {
            let mut taken = Vec::new();
            // (Not past an input that failed: it may end the stream.)
            while taken.len() < ahead
                && let Some(input) = inputs.next()
            {
                let failed = input.is_err();
                taken.push(input);
                if failed {
                    break;
                }
            }
            let images = crate::data::read_each(&taken, |input| {
                Ok(input.as_ref().ok().filter(|_| image).map(|name| predictor.read_images(name)))
            });
            read.extend(taken.into_iter().zip(images).map(|(input, images)| (input, images.ok().flatten())));
        }
        read.pop_front()
    })
    .peekable();
    while inputs.peek().is_some() {
        // Fill a batch: (name, pixels for images) per input; failures are written in order.
        let mut results: Vec<(String, Outcome)> = Vec::new();
        pending.clear();
        let mut order = Vec::new(); // per result: Some(index into pending) or None (failed)
        // An input that cannot be read ends the stream, after the batch read before it.
        let mut unreadable = None;
        while pending.len() < size {
            let Some((input, images)) = inputs.next() else { break };
            let input = match input {
                Ok(input) => input,
                // A line that is not text fails alone (its error names it); the rest go on.
                Err(Error::Dataset { file, line: Some(line), message }) => {
                    let image = match predictor.reader {
                        Reader::Image { .. } => " (an image file goes as an argument itself, without --file)",
                        _ => "",
                    };
                    order.push(None);
                    results.push((format!("{file}:{line}"), Outcome::Failed(format!("{message}{image}"))));
                    continue;
                }
                Err(e) => {
                    unreadable = Some(e);
                    break;
                }
            };
            match predictor.reader {
                Reader::Image { .. } => match images.unwrap_or_else(|| predictor.read_images(&input)) {
                    Ok(images) => {
                        for (name, px) in images {
                            order.push(Some(pending.len()));
                            pending.push((name, Some(px)));
                        }
                    }
                    Err(e) => {
                        order.push(None);
                        results.push((input, Outcome::Failed(e.to_string())));
                    }
                },
                _ => {
                    order.push(Some(pending.len()));
                    pending.push((input, None));
                }
            }
        }
        // One input may be many images (an IDX file): the model still sees `size` at a time.
        let mut done: Vec<Outcome> =
            pending.chunks(size).flat_map(|chunk| predictor.run_batch(chunk, &options.sampling)).collect();
        let mut failures = results.into_iter();
        for slot in order {
            let (name, outcome) = match slot {
                Some(i) => (pending[i].0.clone(), std::mem::replace(&mut done[i], Outcome::Failed(String::new()))),
                None => failures.next().ok_or_else(|| Error::Internal {
                    what: "predict".into(),
                    message: "a failed input went missing".into(),
                })?,
            };
            total += 1;
            failed += matches!(outcome, Outcome::Failed(_)) as usize;
            write_outcome(out, options.format, generates, &name, &outcome)
                .map_err(|e| Error::Io { path: "output".into(), source: e })?;
        }
        out.flush().map_err(|e| Error::Io { path: "output".into(), source: e })?;
        if let Some(e) = unreadable {
            return Err(e);
        }
    }
    Ok((total, failed))
}

impl<D: Device> Predictor<D> {
    /// One batch's outcomes, in order. A batch that fails as a whole is retried input by input,
    /// so one bad input fails alone.
    fn run_batch(&self, batch: &[(String, Option<Vec<f32>>)], sampling: &Sampling) -> Vec<Outcome> {
        let classes = |r: Result<Vec<ClassPrediction>>| -> Option<Vec<Outcome>> {
            r.ok().map(|v| v.into_iter().map(Outcome::Class).collect())
        };
        let whole = match self.reader {
            Reader::Chars { .. } => None,
            Reader::Image { .. } => classes(
                self.classify_images(&batch.iter().map(|b| b.1.clone().unwrap_or_default()).collect::<Vec<_>>()),
            ),
            Reader::Text(_) => classes(self.classify_texts(&batch.iter().map(|b| b.0.as_str()).collect::<Vec<_>>())),
        };
        if let Some(all) = whole.filter(|v| v.len() == batch.len()) {
            return all;
        }
        batch
            .iter()
            .map(|(input, pixels)| {
                let one = match (&self.reader, pixels) {
                    (Reader::Chars { .. }, _) => {
                        return self
                            .generate(input, sampling)
                            .map_or_else(|e| Outcome::Failed(e.to_string()), Outcome::Generated);
                    }
                    (Reader::Image { .. }, Some(px)) => self.classify_images(std::slice::from_ref(px)),
                    _ => self.classify_texts(&[input.as_str()]),
                };
                match one {
                    Ok(mut v) if v.len() == 1 => Outcome::Class(v.remove(0)),
                    Ok(_) => Outcome::Failed("no prediction came back".into()),
                    Err(e) => Outcome::Failed(e.to_string()),
                }
            })
            .collect()
    }
}

/// Width of a table's input column.
const INPUT_COLUMN: usize = 48;

/// The line under each generation in a table: generated text holds line breaks of its own,
/// so without it one generation runs into the next.
const GENERATION_RULE: &str = "────────────────────────────────────────────────";

/// A table's header: the columns of a classifier's rows, or what a generated row holds.
fn write_table_header(out: &mut dyn std::io::Write, generates: bool) -> std::io::Result<()> {
    if generates {
        writeln!(out, "prompt, then the generated text; a rule under each")?;
        writeln!(out, "{GENERATION_RULE}")
    } else {
        writeln!(out, "{:<INPUT_COLUMN$}  {:<16} {:>11}", "input", "label", "probability")
    }
}

fn write_outcome(
    out: &mut dyn std::io::Write,
    format: OutputFormat,
    generates: bool,
    input: &str,
    outcome: &Outcome,
) -> std::io::Result<()> {
    match format {
        OutputFormat::JsonLines => {
            // (Written from structs: the input first, the probabilities in label order, where a
            // JSON object's keys would come out sorted.)
            let line = match outcome {
                Outcome::Class(p) => serde_json::to_string(&ClassLine {
                    input,
                    label: &p.label,
                    probability: p.probability,
                    probabilities: InLabelOrder(&p.probabilities),
                    warning: p.warning.as_deref(),
                }),
                Outcome::Generated(g) => {
                    serde_json::to_string(&GeneratedLine { input, generated: &g.text, warning: g.warning.as_deref() })
                }
                Outcome::Failed(error) => serde_json::to_string(&FailedLine { input, error }),
            };
            writeln!(out, "{}", line.map_err(std::io::Error::other)?)
        }
        OutputFormat::Table => {
            let shown = padded(&shorten(input, INPUT_COLUMN), INPUT_COLUMN);
            match outcome {
                Outcome::Class(p) => {
                    let warning = p.warning.as_ref().map(|w| format!("  ({w})")).unwrap_or_default();
                    let label = padded(&p.label, 16);
                    writeln!(out, "{shown}  {label} {:>10.2}%{warning}", 100.0 * p.probability)
                }
                Outcome::Generated(g) => {
                    let warning = g.warning.as_ref().map(|w| format!("  ({w})\n")).unwrap_or_default();
                    writeln!(out, "{input}{}\n{warning}{GENERATION_RULE}", g.text)
                }
                Outcome::Failed(e) if generates => writeln!(out, "{input}  error: {e}\n{GENERATION_RULE}"),
                Outcome::Failed(e) => writeln!(out, "{shown}  error: {e}"),
            }
        }
    }
}

/// A classification's JSON line.
#[derive(Serialize)]
struct ClassLine<'a> {
    input: &'a str,
    label: &'a str,
    probability: f64,
    probabilities: InLabelOrder<'a>,
    #[serde(skip_serializing_if = "Option::is_none")]
    warning: Option<&'a str>,
}

/// A generation's JSON line.
#[derive(Serialize)]
struct GeneratedLine<'a> {
    input: &'a str,
    generated: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    warning: Option<&'a str>,
}

/// A failed input's JSON line.
#[derive(Serialize)]
struct FailedLine<'a> {
    input: &'a str,
    error: &'a str,
}

/// Class probabilities as a JSON object whose keys keep the labels' order.
struct InLabelOrder<'a>(&'a [(String, f64)]);

impl Serialize for InLabelOrder<'_> {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> std::result::Result<S::Ok, S::Error> {
        serializer.collect_map(self.0.iter().map(|(name, p)| (name, p)))
    }
}

/// The first `n` columns of `s` on one line, as a terminal shows them (a CJK character takes
/// two), with `…` when cut.
fn shorten(s: &str, n: usize) -> String {
    use unicode_width::UnicodeWidthChar;
    let one_line: String = s.chars().map(|c| if c.is_control() { ' ' } else { c }).collect();
    if unicode_width::UnicodeWidthStr::width(one_line.as_str()) <= n {
        return one_line;
    }
    let mut width = 0;
    let kept = one_line.chars().take_while(|c| {
        width += c.width().unwrap_or(0);
        width < n
    });
    kept.chain(['…']).collect()
}

/// `s` and the spaces that fill it to `n` columns as a terminal shows them (a CJK character
/// takes two): what `{:<n}`, which counts characters, misaligns.
fn padded(s: &str, n: usize) -> String {
    let width = unicode_width::UnicodeWidthStr::width(s);
    format!("{s}{}", " ".repeat(n.saturating_sub(width)))
}
