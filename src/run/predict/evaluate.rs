//! Scoring a trained model on labelled data: a file of labelled rows or a folder of class
//! subfolders (read as it is scored), or a run config's evaluation split, refused where that
//! split may hold samples the model trained on.

use super::*;

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
        let text = crate::data::read_user_text(path).map_err(|e| self.not_rows(path, e))?;
        let bad = |line: usize, message: String| crate::data::dataset_error(path, Some(line), message);
        let label_of = |line: usize, field: &str| -> Result<u32> {
            let field = field.trim();
            class_of(&self.labels, field).ok_or_else(|| {
                let names = self.labels.join(", ");
                let last = self.labels.len().saturating_sub(1);
                let message = match indices_are_read(&self.labels) {
                    true => {
                        format!("label `{field}` is not one of the model's classes ({names}), nor an index 0..={last}")
                    }
                    false => format!(
                        "label `{field}` is not one of the model's classes ({names}): where classes are named by \
                         numbers, a label is read as a name, not an index"
                    ),
                };
                bad(line, message)
            })
        };
        let rows: Vec<(usize, &str)> =
            text.lines().enumerate().map(|(i, l)| (i + 1, l)).filter(|(_, l)| !l.trim().is_empty()).collect();
        if rows.is_empty() {
            return Err(crate::data::dataset_error(path, None, "has no rows; expected labelled inputs"));
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

    /// `e`, the error reading `path` as text, said as what `path` is where it is an image or
    /// IDX file: a file of labelled rows is what `--file` takes (an image carries no label).
    fn not_rows(&self, path: &Path, e: Error) -> Error {
        let head = match path == Path::new("-") {
            true => return e,
            false => crate::data::user_head(path, 8).unwrap_or_default(),
        };
        let what = match crate::data::ImageFormat::of(&head) {
            Some(format) => format!("a {} image", format.name()),
            None if crate::data::opens_idx(&head) => "IDX images".into(),
            None => return e,
        };
        let expected = match self.reader {
            Reader::Image { .. } => {
                "CSV rows of pixels each ending in its label, or a folder of class subfolders of images"
            }
            _ => "a file of `label<TAB>text` rows",
        };
        crate::data::dataset_error(path, None, format!("is {what}, with no label to score; expected {expected}"))
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

/// The class a labelled row's `field` names among `labels`: a class name, or else an index
/// where [`indices_are_read`].
pub(super) fn class_of(labels: &[String], field: &str) -> Option<u32> {
    let by_index = || field.parse::<usize>().ok().filter(|&i| i < labels.len() && indices_are_read(labels));
    labels.iter().position(|l| l == field).or_else(by_index).map(|i| i as u32)
}

/// Whether a label may be a class's index: not where a class is named by a whole number other
/// than its index (classes `3` and `5`, or `-1` and `1`: is `0` the class named `3`, or one the
/// model lacks?). Names that are their indices (digits' `0` to `9`) mean the same either way.
pub(super) fn indices_are_read(labels: &[String]) -> bool {
    labels.iter().enumerate().all(|(i, l)| l.parse::<i64>().map_or(true, |n| usize::try_from(n) == Ok(i)))
}
