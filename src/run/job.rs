//! A configured training job: builds the data source and the model a [`RunConfig`] names,
//! trains with checkpoints, logs metrics as JSON lines, and writes a summary and the exported
//! model. The `train` command of the binary is this plus a progress bar.

use super::config::{DataSection, DatasetName, RunConfig, named_as_written};
use super::metrics_log::MetricsLog;
use super::source::{SampleSource, subset};
use crate::comm::process_group::ProcessGroup;
use crate::data::{self, ImageSample, LmSequence, TextSample};
use crate::device::Device;
use crate::elastic::autodp::rebuild_communicators;
use crate::elastic::controller::{Slicer, Surroundings};
use crate::elastic::{CacheDtype, Elastic, FreezeName};
use crate::error::{Error, Result, config_error, internal};
use crate::files::{self, io_error};
use crate::model::{Family, HeadSpec, HostBatch, InputSpec, Model, ModelConfig, Spec};
use crate::pipeline::{
    AutoSliced, Pipeline, PipelineConfig, Plan, UnitProfile, samples_per_micro_batch, unit_profiles_per_sample,
};
use crate::terapipe::{SlicingPlan, SlicingProfile, StageLoad, TokenSlices};
use crate::text::{Encoded, EncodedItem, TextInput, TextTokenizer, encoded_batch};
use crate::train::{BatchSource, EvalMetrics, Event, RecordedPlan, Scored, Trainer};
use crate::weights::{self, LoadOptions, LoadReport};
use serde::Serialize;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

/// What the data turned out to be, for building the model and for the summary.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct DataInfo {
    /// Dataset name, as the config spells it.
    pub name: String,
    /// Classes (classifiers) or vocabulary size (language models).
    pub classes: usize,
    /// Training samples.
    pub train: usize,
    /// Evaluation samples.
    pub test: usize,
    /// What the run evaluates on: `test`, or `validation` (`data.validation_fraction`, carved
    /// off the training half; the test split is then unused).
    pub evaluated_on: String,
    /// Whether training samples are randomly augmented (`data.random_flip`,
    /// `data.random_crop`; AutoCache refuses such data unless told otherwise).
    pub augmented: bool,
    /// Class names by label (classifiers; empty for language models). They travel with the
    /// exported model.
    pub labels: Vec<String>,
    /// A character-level language model's vocabulary, by token id (empty otherwise).
    #[serde(skip)]
    pub chars: Vec<char>,
    /// Images: the largest raw pixel value, which the loader divides by (travels with the
    /// export, so raw rows given to `predict` are scaled the same).
    #[serde(skip)]
    pub pixel_max: Option<u32>,
    /// Images: their channels and side, which the model's `num_channels` and `image_size`
    /// must be (the same count of values in another shape would be read as other pixels).
    #[serde(skip)]
    pub image: Option<(usize, usize)>,
    /// Text: the tokenizer's file and the ids it can give, checked against the model's tables
    /// before training (an id past them would end the run at the first batch holding it).
    #[serde(skip)]
    pub tokenizer: Option<TokenizerIds>,
    /// A corpus: the held-out cross-entropy of the training part's character frequencies,
    /// computed when the data is read (the summary's baseline; the file is not read again).
    #[serde(skip)]
    pub unigram_loss: Option<f64>,
}

/// The ids a text run's tokenizer gives: every one below `vocab`, and `pad_type_id` as a
/// token type.
#[derive(Clone, Debug, PartialEq)]
pub struct TokenizerIds {
    /// The `tokenizer.json` read.
    pub file: String,
    /// The rows its ids need: the largest id, added tokens included, plus one.
    pub vocab: usize,
    /// The token type of padding.
    pub pad_type_id: u32,
}

impl TokenizerIds {
    /// Refuses a model whose token table (`vocab` rows) or token-type table (`types`) is
    /// smaller than what this tokenizer gives, naming `field` (the setting that gave the
    /// tokenizer or the table), `model` (what the table is) and what would fit (`expected`).
    fn fit(&self, field: &str, model: &str, vocab: usize, types: usize, expected: &str) -> Result<()> {
        let refuse =
            |what: String| Error::Config { field: field.into(), message: format!("{model}: {what}; {expected}") };
        if self.vocab > vocab {
            return Err(refuse(format!(
                "{} gives token ids up to {}, the model's table holds {vocab}",
                self.file,
                self.vocab - 1
            )));
        }
        if self.pad_type_id as usize >= types {
            return Err(refuse(format!(
                "{} pads with token type {}, the model's table holds {types}",
                self.file, self.pad_type_id
            )));
        }
        Ok(())
    }
}

/// What a model reads or a dataset holds: a model trains on one kind only.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum DataKind {
    /// Texts, each with a class.
    Texts,
    /// Images, each with a class.
    Images,
    /// Characters, each the next one's target (a language model's).
    Chars,
}

impl DataKind {
    /// What a dataset holds.
    pub(crate) fn of_data(info: &DataInfo) -> Self {
        match (info.chars.is_empty(), info.pixel_max.is_some()) {
            (false, _) => DataKind::Chars,
            (true, true) => DataKind::Images,
            (true, false) => DataKind::Texts,
        }
    }

    /// What a model of `config` reads: a BERT classifies texts, a ViT images, and a GPT
    /// predicts the next character.
    pub(crate) fn of_config(config: &ModelConfig) -> Self {
        match config {
            ModelConfig::Bert(_) => DataKind::Texts,
            ModelConfig::Vit(_) => DataKind::Images,
            ModelConfig::Gpt(_) => DataKind::Chars,
        }
    }

    /// The dataset `info`, as this kind of data.
    pub(crate) fn describe(self, info: &DataInfo) -> String {
        match self {
            DataKind::Chars => format!("character-level text ({} characters)", info.chars.len()),
            DataKind::Images => format!("image classification with {}", class_list(&info.labels)),
            DataKind::Texts => format!("text classification with {}", class_list(&info.labels)),
        }
    }
}

/// "10 classes (0, 1, …, 9)": the count, and the names (the first and last few of many).
pub(crate) fn class_list(labels: &[String]) -> String {
    let names = if labels.len() > 8 {
        [&labels[..3], &["…".to_string()], &labels[labels.len() - 2..]].concat().join(", ")
    } else {
        labels.join(", ")
    };
    let plural = if labels.len() == 1 { "" } else { "es" };
    format!("{} class{plural} ({names})", labels.len())
}

/// Loads the dataset of `config` and wraps it as a batch source whose training steps hold at
/// least `least_batch` samples (one per replica of every process; 1 where only evaluation
/// matters): an epoch's last batch that would be shorter joins the one before it.
pub fn prepare_data(config: &RunConfig, least_batch: usize) -> Result<(Box<dyn BatchSource>, DataInfo)> {
    let d = &config.data;
    let (seed, split_seed) = (config.train.seed, d.split_seed);
    let eval_bs = d.eval_batch_size.unwrap_or(d.batch_size);
    let dir = &d.dir;
    let info = |labels: &[String], train: usize, test: usize| DataInfo {
        name: d.dataset.key().into(),
        classes: labels.len(),
        train,
        test,
        evaluated_on: d.evaluated_on().into(),
        augmented: false,
        labels: labels.to_vec(),
        chars: Vec::new(),
        pixel_max: None,
        image: None,
        tokenizer: None,
        unigram_loss: None,
    };
    match d.dataset {
        DatasetName::RottenTomatoes | DatasetName::ReutersR8 | DatasetName::LabelledTexts => {
            let split = match d.dataset {
                DatasetName::RottenTomatoes => {
                    data::rotten_tomatoes(dir)?.split_stratified(d.test_fraction, split_seed)?
                }
                DatasetName::LabelledTexts => {
                    user_split(data::labelled_text_files(&train_file(d)?, d.test_file.as_deref())?, d)?
                }
                _ => data::reuters_r8(dir)?,
            };
            let split = hold_out_validation(split, d.validation_fraction, split_seed)?;
            let labels = split.train.class_names().to_vec();
            let tokenizer_path = tokenizer_dir(config)?.join(weights::TOKENIZER_FILE);
            let tokenizer = TextTokenizer::from_file(&tokenizer_path, d.max_len)?;
            let train = subset(split.train.samples().to_vec(), d.train_limit, split_seed);
            let test = subset(split.test.samples().to_vec(), d.test_limit, split_seed ^ 1);
            let (n_train, n_test) = (train.len(), test.len());
            // Each sample is tokenised once, here: the epochs' batches and every evaluation
            // only pad the ids (and a text the tokenizer rejects stops the run before it starts).
            let (train, test) = (encode_texts(&tokenizer, train)?, encode_texts(&tokenizer, test)?);
            let ids = TokenizerIds {
                file: tokenizer_path.display().to_string(),
                vocab: tokenizer.vocab_size(),
                pad_type_id: tokenizer.pad_type_id(),
            };
            // Batches only pad from here on: the tokenizer goes to the batch builder.
            let make = Box::new(move |s: &[&EncodedSample], offset: u64| {
                let items: Vec<EncodedItem> =
                    s.iter().map(|t| EncodedItem { id: t.id, encoded: &t.encoded, label: t.label }).collect();
                Ok(encoded_batch(&tokenizer, &items, offset)?.host)
            });
            let mut source = SampleSource::new(train, test, seed, d.batch_size, eval_bs, make)?
                .least_batch(least_batch)
                .ids(|t| t.id);
            if d.group_by_length {
                source = source.group_by_length(|t| Ok(t.encoded.ids.len()))?;
            }
            Ok((Box::new(source), DataInfo { tokenizer: Some(ids), ..info(&labels, n_train, n_test) }))
        }
        DatasetName::FashionMnist | DatasetName::Mnist5k | DatasetName::Digits | DatasetName::LabelledImages => {
            // What the raw values were divided by: a user's `pixel_max`, or their files' format.
            let mut user_scale = None;
            let split = match d.dataset {
                DatasetName::FashionMnist => data::fashion_mnist(dir)?,
                DatasetName::Mnist5k => data::mnist5k(dir)?.split_stratified(d.test_fraction, split_seed)?,
                DatasetName::LabelledImages => {
                    let (max, channels) = (d.user_pixel_max().unwrap_or(255), d.user_channels().unwrap_or(1));
                    let train = train_file(d)?;
                    if let Some(max) = d.pixel_max.filter(|_| d.user_folder()) {
                        return Err(config_error(
                            "data.pixel_max",
                            format!(
                                "is {max}, but data.train_file {} is a folder of image files, which their format \
                                 scales (8-bit PNG by 255, 16-bit by 65535, a PGM by its maximum): leave it out",
                                train.display()
                            ),
                        ));
                    }
                    if let Some(side) = d.resize_to.filter(|_| !d.user_folder()) {
                        return Err(config_error(
                            "data.resize_to",
                            format!(
                                "is {side}, but data.train_file {} is a file of pixel rows, each read at its own \
                                 size: resizing is for a folder of image files; leave it out",
                                train.display()
                            ),
                        ));
                    }
                    let (train, test, scale) =
                        data::labelled_image_files(&train, d.test_file.as_deref(), max, channels, d.resize_to)?;
                    user_scale = Some(scale);
                    user_split((train, test), d)?
                }
                _ => data::digits(dir)?.split_stratified(d.test_fraction, split_seed)?,
            };
            let split = hold_out_validation(split, d.validation_fraction, split_seed)?;
            let labels = split.train.class_names().to_vec();
            let image = split.train.samples().first().map(|s| (s.channels, s.width));
            if let (Some(padding), Some((_, side))) = (d.random_crop, image)
                && padding >= side
            {
                return Err(config_error(
                    "data.random_crop",
                    format!(
                        "is {padding}, but the images are {side}×{side}: a crop padded by the side or more can be \
                         padding alone; expected less than {side} (a tenth of the side is usual)"
                    ),
                ));
            }
            let train = subset(split.train.samples().to_vec(), d.train_limit, split_seed);
            let test = subset(split.test.samples().to_vec(), d.test_limit, split_seed ^ 1);
            let (n_train, n_test) = (train.len(), test.len());
            let make = Box::new(|s: &[&ImageSample], offset: u64| data::image_batch(s, offset));
            let mut source = SampleSource::new(train, test, seed, d.batch_size, eval_bs, make)?
                .least_batch(least_batch)
                .ids(|s| s.id);
            let augment = d.image_augment();
            if augment.is_on() {
                source = source.augment(Box::new(move |s: &ImageSample, epoch| augment.augmented(s, seed, epoch)));
            }
            let pixel_max = Some(match d.dataset {
                DatasetName::Digits => data::DIGITS_PIXEL_MAX,
                DatasetName::LabelledImages => user_scale.unwrap_or(255),
                _ => 255,
            });
            let augmented = augment.is_on();
            Ok((Box::new(source), DataInfo { pixel_max, image, augmented, ..info(&labels, n_train, n_test) }))
        }
        DatasetName::Hamlet | DatasetName::TextCorpus => {
            let (corpus, [file, held_out_file]) = corpus(d)?;
            // Too short a part for one sequence is a setting to lower, named as such.
            let part = |which: &str, file: &Path, tokens: usize, sequences: Result<Vec<data::LmSequence>>| {
                sequences.map_err(|_| Error::Config {
                    field: "data.max_len".into(),
                    message: format!(
                        "{} tokens per sequence, but the {which} of {} holds {tokens} characters; expected at \
                         most {} (one sequence needs its tokens and the next one)",
                        d.max_len,
                        file.display(),
                        tokens.saturating_sub(1)
                    ),
                })
            };
            let train = part("training part", &file, corpus.train.len(), corpus.train_sequences(d.max_len))?;
            let held_out = corpus.held_out_sequences(d.max_len);
            let test = part("held-out part", &held_out_file, corpus.held_out.len(), held_out)?;
            let train = subset(train, d.train_limit, split_seed);
            let test = subset(test, d.test_limit, split_seed ^ 1);
            let (n_train, n_test) = (train.len(), test.len());
            let make = Box::new(|s: &[&LmSequence], offset: u64| data::lm_batch(s, offset));
            let source = SampleSource::new(train, test, seed, d.batch_size, eval_bs, make)?
                .least_batch(least_batch)
                .ids(|s| s.id);
            let info = DataInfo {
                classes: corpus.vocab.len(),
                chars: corpus.vocab.chars().to_vec(),
                unigram_loss: Some(unigram_loss(&corpus.train, &corpus.held_out, corpus.vocab.len())),
                ..info(&[], n_train, n_test)
            };
            Ok((Box::new(source), info))
        }
    }
}

/// `data.train_file`, which the config's checks made sure a dataset of the user's files has.
/// A held-out `test_file` that is the training data itself (by another name too) is refused: it
/// would score the samples the model trained on as held out.
fn train_file(d: &DataSection) -> Result<PathBuf> {
    let train = d
        .train_file
        .clone()
        .ok_or_else(|| config_error("data.train_file", format!("is not set; {} reads it", d.dataset.key())))?;
    let same =
        |a: &Path, b: &Path| std::fs::canonicalize(a).ok().is_some_and(|a| std::fs::canonicalize(b).ok() == Some(a));
    if let Some(test) = d.test_file.as_deref().filter(|test| same(&train, test)) {
        return Err(config_error(
            "data.test_file",
            format!(
                "is {}, the training data itself (data.train_file = {}); expected held-out samples the model does not \
                 train on",
                test.display(),
                train.display()
            ),
        ));
    }
    Ok(train)
}

/// A user's labelled rows as a split: the held-out file's rows where given, else cut from the
/// training file by `data.split_seed` and `data.test_fraction`.
fn user_split<S: data::Sample>(
    (train, test): (data::Dataset<S>, Option<data::Dataset<S>>),
    d: &DataSection,
) -> Result<data::Split<S>> {
    match test {
        Some(test) => Ok(data::Split { train, test }),
        None => train.split_stratified_as("data.test_fraction", d.test_fraction, d.split_seed),
    }
}

/// The character-level corpus of a language-model dataset, and the files its training and
/// held-out parts come from (named where a setting does not fit them).
fn corpus(d: &DataSection) -> Result<(data::LmCorpus, [PathBuf; 2])> {
    match d.dataset {
        DatasetName::TextCorpus => {
            let file = train_file(d)?;
            let held_out = d.test_file.clone().unwrap_or_else(|| file.clone());
            Ok((data::user_corpus_files(&file, d.test_file.as_deref())?, [file, held_out]))
        }
        _ => {
            let file = d.dir.join(data::HAMLET_FILE);
            Ok((data::hamlet(&d.dir)?, [file.clone(), file]))
        }
    }
}

/// With `data.validation_fraction` > 0, the training half split again (stratified, its own
/// seed): the run trains on the rest and evaluates on the part carved off, so choices made by
/// looking at its accuracy never see the test split.
fn hold_out_validation<S: data::Sample>(split: data::Split<S>, fraction: f64, seed: u64) -> Result<data::Split<S>> {
    if fraction == 0.0 {
        return Ok(split);
    }
    split.train.split_stratified_as("data.validation_fraction", fraction, seed ^ 0x7661_6c69_6461_7465)
}

/// A text sample with its tokens: what a text run keeps of each sample.
struct EncodedSample {
    id: u64,
    label: u32,
    encoded: Encoded,
}

/// Tokenises `samples` (all at once: the tokenizer spreads them over the cores).
fn encode_texts(tokenizer: &TextTokenizer, samples: Vec<TextSample>) -> Result<Vec<EncodedSample>> {
    let inputs: Vec<TextInput> = samples.iter().map(|t| TextInput::Single(&t.text)).collect();
    let encoded = tokenizer.encode_batch(&inputs)?;
    Ok(samples.iter().zip(encoded).map(|(t, encoded)| EncodedSample { id: t.id, label: t.label, encoded }).collect())
}

/// Refuses a `model.pretrained` that is not a folder, naming the setting and how the configs'
/// folders are installed (a missing one otherwise surfaced as its first file's read error).
fn check_pretrained(dir: &std::path::Path) -> Result<()> {
    match dir.is_dir() {
        true => Ok(()),
        false => Err(config_error(
            "model.pretrained",
            format!(
                "{} is not a folder; expected a Hugging Face model folder (config.json, model.safetensors, \
                 tokenizer.json): `make setup` (scripts/setup.sh) installs the ones configs/ name",
                dir.display()
            ),
        )),
    }
}

/// The folder a text run's `tokenizer.json` is read from: `model.tokenizer`, else the
/// pretrained model's.
fn tokenizer_dir(config: &RunConfig) -> Result<&std::path::Path> {
    let m = &config.model;
    match (&m.tokenizer, &m.pretrained) {
        (Some(dir), _) if !dir.is_dir() => Err(config_error(
            "model.tokenizer",
            format!("{} is not a folder; expected a folder holding tokenizer.json", dir.display()),
        )),
        (Some(dir), _) if !dir.join(weights::TOKENIZER_FILE).is_file() => Err(config_error(
            "model.tokenizer",
            format!("{} holds no {}; expected a folder holding one", dir.display(), weights::TOKENIZER_FILE),
        )),
        (Some(dir), _) => Ok(dir),
        (None, Some(dir)) => check_pretrained(dir).map(|()| dir.as_path()),
        (None, None) => Err(config_error(
            "model.tokenizer",
            "a text dataset needs a tokenizer: model.pretrained (a Hugging Face model folder), or, for a model \
             built from model.config, model.tokenizer (a folder holding tokenizer.json, such as \
             weights/all-minilm-l6-v2)",
        )),
    }
}

/// Builds the model: a pretrained Hugging Face checkpoint with a new head sized for the data,
/// or an architecture from scratch (its label count or vocabulary set from the data), keeping
/// the values of the units `keep` names only (the others [hollow](Model::new_keeping)).
pub fn build_model<D: Device>(
    dev: &D,
    config: &RunConfig,
    info: &DataInfo,
    keep: &dyn Fn(usize) -> bool,
) -> Result<(Model<D>, ModelConfig, Option<LoadReport>)> {
    let m = &config.model;
    match (&m.pretrained, &m.config) {
        (Some(dir), _) => {
            check_pretrained(dir)?;
            let mut model_config = weights::read_hf_config(dir.join(weights::CONFIG_FILE), None)?;
            check_kind(&model_config, info)?;
            match &mut model_config {
                ModelConfig::Bert(c) => {
                    c.num_labels = info.classes;
                    if let Some(p) = m.pooling {
                        c.pooling = p;
                    }
                    if let Some(ids) = &info.tokenizer {
                        // (Named by the setting that gave the tokenizer.)
                        let field = if m.tokenizer.is_some() { "model.tokenizer" } else { "model.pretrained" };
                        let (model, expected) =
                            (dir.display().to_string(), "expected the tokenizer made for this model");
                        ids.fit(field, &model, c.vocab_size, c.type_vocab_size, expected)?;
                    }
                }
                ModelConfig::Vit(c) => c.num_labels = info.classes,
                ModelConfig::Gpt(_) => {}
            }
            if m.pooling.is_some() && !matches!(model_config, ModelConfig::Bert(_)) {
                return Err(config_error(
                    "model.pooling",
                    format!(
                        "chooses a BERT classifier's pooling; {} holds a {}, whose head has none to choose: leave it out",
                        dir.display(),
                        model_config.family()
                    ),
                ));
            }
            // Drawn only where the file has no weights (the new head), as a random build would.
            let (mut model, deferred) = Model::new_for_loading(dev, &model_config, m.seed, keep)?;
            let file = weights::load_safetensors(dir.join(weights::WEIGHTS_FILE))?;
            let report = weights::load_into_model(&mut model, dev, &file, &LoadOptions::default())?;
            deferred.draw(&mut model, dev, &report.missing)?;
            Ok((model, model_config, Some(report)))
        }
        (None, Some(c)) => {
            check_kind(c, info)?;
            if let Some(n) = m.num_labels_written.filter(|n| *n != info.classes) {
                return Err(Error::Config {
                    field: "model.config.num_labels".into(),
                    message: format!(
                        "is {n}, but {} has {} classes: set it to {} or leave it out (the data sets it)",
                        info.name, info.classes, info.classes
                    ),
                });
            }
            let mut model_config = c.clone();
            match &mut model_config {
                ModelConfig::Bert(c) => {
                    c.num_labels = info.classes;
                    if let Some(ids) = &info.tokenizer {
                        // (0: the tokenizer's, as the data gives a GPT its vocabulary.)
                        if c.vocab_size == 0 {
                            c.vocab_size = ids.vocab;
                        }
                        let what = format!("vocab_size {}, type_vocab_size {}", c.vocab_size, c.type_vocab_size);
                        let expected = format!(
                            "expected a vocab_size of at least {} (0 takes the tokenizer's) and a type_vocab_size above {}",
                            ids.vocab, ids.pad_type_id
                        );
                        ids.fit("model.config", &what, c.vocab_size, c.type_vocab_size, &expected)?;
                    }
                }
                ModelConfig::Vit(c) => c.num_labels = info.classes,
                ModelConfig::Gpt(c) => c.vocab_size = info.classes,
            }
            let model = Model::new_keeping(dev, &model_config, m.seed, keep)?;
            Ok((model, model_config, None))
        }
        (None, None) => Err(Error::Config { field: "model".into(), message: "set `pretrained` or `config`".into() }),
    }
}

/// A model of another kind than the dataset (a GPT on digits, a ViT on hamlet) is refused by
/// the dataset's name when the run is built, not by the first step's upload.
fn check_kind(model: &ModelConfig, info: &DataInfo) -> Result<()> {
    let (wants, data) = (DataKind::of_config(model), DataKind::of_data(info));
    if wants == data {
        return Ok(());
    }
    let reads = match wants {
        DataKind::Chars => "a character-level language model",
        DataKind::Images => "an image classifier",
        DataKind::Texts => "a text classifier",
    };
    Err(config_error(
        "data.dataset",
        format!(
            "{} is {}; the model (a {}) is {reads}: give a dataset of the model's kind, or a model of the \
             dataset's (model.config or model.pretrained)",
            info.name,
            data.describe(info),
            model.family()
        ),
    ))
}

/// A model whose attention heads are wider than the device's kernels run (the GPU's hold a
/// head's row in registers) is refused by its settings when the run is built, not by the
/// first forward's launch.
fn check_head_dim<D: Device>(config: &RunConfig, spec: &crate::model::Spec, dev: &D) -> Result<()> {
    let Some(most) = dev.max_head_dim().filter(|&most| spec.head_dim() > most) else { return Ok(()) };
    let field = if config.model.pretrained.is_some() { "model.pretrained" } else { "model.config" };
    Err(config_error(
        field,
        format!(
            "a hidden size of {} over {} head{} is {} channels a head; the attention kernels of {} run at most \
             {most}: give more heads or a smaller hidden size (cpu devices have no such bound)",
            spec.hidden,
            spec.heads,
            if spec.heads == 1 { "" } else { "s" },
            spec.head_dim(),
            dev.name()
        ),
    ))
}

/// An image model whose input does not fit the dataset's images is refused by its settings
/// when the run is built, not by the first step's upload; so is one whose channels and side
/// differ though the count of values agrees (3 channels of 8² read as 12 of 4²).
fn check_images(spec: &crate::model::Spec, info: &DataInfo) -> Result<()> {
    let (InputSpec::Image { channels, image_size, .. }, Some(image)) = (spec.input, info.image) else {
        return Ok(());
    };
    if image == (channels, image_size) {
        return Ok(());
    }
    Err(Error::Config {
        field: "model.config".into(),
        message: format!(
            "num_channels {channels} and image_size {image_size} ({channels} × {image_size}² values per image), but \
             the images of {} are {} of {}×{} ({} values): set the model's num_channels and image_size to the \
             dataset's",
            info.name,
            data::image_channels(image.0),
            image.1,
            image.1,
            image.0 * image.1 * image.1
        ),
    })
}

/// The settings that choose a run's training samples and their order, by the names a config
/// gives them: checkpoints record them (a resume over other data names the one that changed)
/// and exports (an evaluation on a split holding training samples is refused).
pub(crate) fn data_settings(config: &RunConfig) -> serde_json::Value {
    let d = &config.data;
    let mut settings = serde_json::json!({
        "data.dataset": d.dataset,
        "train.seed": config.train.seed,
        "data.split_seed": d.split_seed,
        "data.validation_fraction": d.validation_fraction,
        "data.train_limit": d.train_limit,
        "data.group_by_length": d.group_by_length,
    });
    let Some(map) = settings.as_object_mut() else { return settings };
    // (A dataset with a test set of its own reads no fraction.)
    if d.cut_by_seed() {
        map.insert("data.test_fraction".into(), d.test_fraction.into());
    }
    // A user's files by their bytes, as the tokenizer below: the row ids the samples'
    // fingerprint follows stay the same when a file is edited.
    for (key, file) in [(TRAIN_FILE, &d.train_file), (TEST_FILE, &d.test_file)] {
        if let Some(file) = file.as_ref().filter(|_| d.dataset.from_user_files()) {
            map.insert(key.into(), file_print(file).into());
        }
    }
    if let Some(max) = d.user_pixel_max() {
        map.insert(PIXEL_MAX.into(), max.into());
    }
    // (A checkpoint written before the key existed, of one channel, compares as unchanged: a
    // key missing on one side is.)
    if let Some(channels) = d.user_channels() {
        map.insert("data.channels".into(), channels.into());
    }
    if let Some(side) = d.resize_to {
        map.insert("data.resize_to".into(), side.into());
    }
    // Images' augmentation (a crop's padding 0 where none is drawn): a resume under another
    // names the change, which the samples' fingerprint does not follow.
    if d.dataset.is_image() {
        map.insert("data.random_flip".into(), d.random_flip.into());
        map.insert("data.random_crop".into(), d.random_crop.unwrap_or(0).into());
    }
    // What turns a text into ids, which the samples' fingerprint does not follow (a resume
    // under others names them), and a corpus's window length, which it does (a resume refused
    // names it).
    if d.dataset.is_text() || d.dataset.is_corpus() {
        map.insert(MAX_LEN.into(), d.max_len.into());
    }
    if d.dataset.is_text() {
        // The file's bytes, not its path: the same tokenizer under another path (a node's own
        // copy) is the same.
        let file = tokenizer_dir(config).ok().map(|dir| dir.join(weights::TOKENIZER_FILE));
        map.insert(TOKENIZER.into(), file.as_deref().and_then(hashed).into());
    }
    settings
}

/// The data settings that turn a text into ids ([`data_settings`]' keys), which an epoch's
/// order follows where its batches are grouped by length.
pub(crate) const MAX_LEN: &str = "data.max_len";
pub(crate) const TOKENIZER: &str = "model.tokenizer";

/// The user's files a dataset's samples come from ([`data_settings`]' keys), each as its name
/// and a hash of its bytes ([`file_print`]).
pub(crate) const TRAIN_FILE: &str = "data.train_file";
pub(crate) const TEST_FILE: &str = "data.test_file";
/// The scale of a user's images ([`data_settings`]' key): what a pixel is divided by.
pub(crate) const PIXEL_MAX: &str = "data.pixel_max";

/// A file as its name and a hash of its bytes (`reviews.tsv #…`), a folder of images as its name
/// and a hash of its files ([`folder_hash`]), or `None` where it cannot be read: the same file
/// under another folder is the same, an edited one is not.
fn hashed(file: &Path) -> Option<String> {
    let hash = match file.is_dir() {
        true => folder_hash(file)?,
        false => crate::rng::fnv1a(&std::fs::read(file).ok()?, crate::rng::FNV_OFFSET),
    };
    Some(format!("{} #{hash:016x}", file_name(file)))
}

/// The files of a folder of class subfolders, as the loader lists them, each by its path within
/// the folder and its bytes: a file renamed, moved to another class, added or edited changes it.
fn folder_hash(dir: &Path) -> Option<u64> {
    use crate::rng::fnv1a;
    let mut hash = crate::rng::FNV_OFFSET;
    for class in data::folder_entries(dir).ok()? {
        for file in data::folder_entries(&class).ok()? {
            let name = file.strip_prefix(dir).ok()?.to_string_lossy().into_owned();
            hash = fnv1a(&[name.as_bytes(), &[0]].concat(), hash);
            hash = fnv1a(&std::fs::read(&file).ok()?, hash);
        }
    }
    Some(hash)
}

fn file_name(file: &Path) -> String {
    file.file_name().map_or_else(|| file.display().to_string(), |n| n.to_string_lossy().into_owned())
}

/// A user's data file as [`hashed`], or by its name alone where unreadable (reading its
/// samples then says why).
fn file_print(file: &Path) -> String {
    hashed(file).unwrap_or_else(|| file_name(file))
}

/// Where a run of `config` keeps its checkpoint.
pub fn checkpoint_path(config: &RunConfig) -> PathBuf {
    config.output.dir.join(CHECKPOINT.0)
}

/// A run's log in its folder, and where a run that starts over sets an earlier run's aside.
pub(super) const LOG: (&str, &str) = ("metrics.jsonl", "metrics.previous.jsonl");

/// A run's checkpoint in its folder, and where a run that starts over sets an earlier run's
/// aside.
pub(super) const CHECKPOINT: (&str, &str) = ("checkpoint.ckpt", "checkpoint.previous.ckpt");

/// The run's other files in its folder, where a run that starts over sets an earlier run's
/// aside (all that would otherwise describe the earlier run beside the new log), and whether
/// each is a folder.
const SET_ASIDE: [(&str, &str, bool); 5] = [
    (CHECKPOINT.0, CHECKPOINT.1, false),
    ("summary.json", "summary.previous.json", false),
    ("report.html", "report.previous.html", false),
    (MODEL, "model.previous", true),
    (BEST, "best.previous", true),
];

/// The folders of a run's exports: its last weights, and its best evaluation's (`train.keep_best`).
const MODEL: &str = "model";
const BEST: &str = "best";

/// The files the run writes in its folder, each its own or set aside, and whether a folder.
fn written() -> impl Iterator<Item = (&'static str, bool)> {
    let log = [(LOG.0, LOG.1, false)];
    log.into_iter().chain(SET_ASIDE).flat_map(|(own, aside, folder)| [(own, folder), (aside, folder)])
}

/// A path in the run's folder `dir` that holds the other kind of thing than the run writes
/// there (a file named `model`, a folder named `summary.json`): said before training, not when
/// the first checkpoint or the export fails.
fn in_the_way(dir: &Path) -> Option<String> {
    written().find_map(|(name, folder)| {
        let path = dir.join(name);
        (path.exists() && path.is_dir() != folder).then(|| {
            let (is, wants) = if folder { ("a file", "its exported model's folder") } else { ("a folder", "a file") };
            format!("{} is {is}, where the run writes {wants}: move it out of the way", path.display())
        })
    })
}

/// Where a run that started over set an earlier run's checkpoint aside in `dir`: how to resume
/// that one instead (empty where there is none).
fn set_aside_note(dir: &Path) -> String {
    if !dir.join(CHECKPOINT.1).exists() {
        return String::new();
    }
    let pairs = std::iter::once((LOG.0, LOG.1)).chain(SET_ASIDE.iter().map(|&(own, aside, _)| (own, aside)));
    let names: Vec<String> =
        pairs.filter(|(_, aside)| dir.join(aside).exists()).map(|(own, aside)| format!("{aside} → {own}")).collect();
    format!(
        "; {} there is an earlier run's, set aside with its other files when a run started over in this folder: to \
         resume that run, move each back to its own name ({}), the log and model too, so it goes on under its own",
        CHECKPOINT.1,
        names.join(", ")
    )
}

/// Why a Chrome trace written to `trace` when the run ends would overwrite a file the run
/// needs: the run's config file (`config_file`), or one of the files it writes in its
/// `output.dir` (its checkpoint, log, summary, report, exported model, the earlier run's set
/// aside, its lock). (The cache's spill files have names of their own, unlinked at once: a
/// trace beside them is safe.) `None` when the path is free for it.
pub fn trace_in_the_way(config: &RunConfig, trace: &Path, config_file: &Path) -> Option<String> {
    // (Resolved through the folders that exist, `runs/x/../x/summary.json` being the
    // summary; the rest, not made yet, as written.)
    let resolved = |p: &Path| -> Option<std::path::PathBuf> {
        let p = std::path::absolute(p).ok()?;
        let known = p.ancestors().find_map(|a| Some((a, std::fs::canonicalize(a).ok()?)))?;
        let mut path = known.1;
        for part in p.strip_prefix(known.0).ok()?.components() {
            match part {
                std::path::Component::ParentDir => _ = path.pop(),
                std::path::Component::Normal(name) => path.push(name),
                _ => {}
            }
        }
        Some(path)
    };
    let at = resolved(trace)?;
    if resolved(config_file).is_some_and(|c| c == at) {
        return Some("is the run's config file (--config); name another file for the trace".into());
    }
    let dir = resolved(&config.output.dir)?;
    let name = at.strip_prefix(&dir).ok()?.components().next()?.as_os_str().to_str()?.to_string();
    // (Besides its files, the folder's lock and the export's staging folder, emptied by each
    // export.)
    let staging = [MODEL, BEST].map(crate::weights::export::staging_name);
    let taken = written().any(|(written, _)| written == name) || name == files::LOCK_FILE || staging.contains(&name);
    taken.then(|| {
        format!(
            "is where the run writes its own {name} (output.dir {}); name another file for the trace",
            config.output.dir.display()
        )
    })
}

/// Whether a run of `config` may start in its `output.dir`: one that neither resumes nor starts
/// over (`fresh`) is refused where a checkpoint is already there, before anything is built, so
/// an earlier run's files are not overwritten by mistake. In a launched run (`group`) rank 0,
/// which writes the files, decides and every process hears it at once: none goes on alone into
/// a collective the others have left. There, too, every process must have been given the
/// same settings (but for [`PER_NODE_SETTINGS`]): nodes launched with other `--set` flags would
/// otherwise train apart while their losses, all-reduced, looked as one; and every process
/// resuming must find the checkpoint (each reads its own `output.dir`).
///
/// Errors: an [`Error::Config`] on `output.dir` naming the checkpoint and the two ways on
/// (`--resume`, `--fresh`), a file where the folder goes, a file or folder where the run writes
/// the other kind (`in_the_way`), or no checkpoint to resume; on
/// ranks above 0 it says rank 0 refused; on the first setting that differs, naming the ranks and every setting that
/// differs; on `output.dir`, the ranks that find no checkpoint to resume; a collective's
/// failure.
pub fn check_start(config: &RunConfig, resume: bool, fresh: bool, group: Option<&ProcessGroup>) -> Result<()> {
    let (ckpt, dir) = (checkpoint_path(config), &config.output.dir);
    let rank = group.map_or(0, |g| g.rank());
    let why = if dir.exists() && !dir.is_dir() {
        Some(format!("{} is a file, not a folder: name a folder for the run's files", dir.display()))
    } else if let Some(why) = in_the_way(dir) {
        Some(why)
    } else if !resume && !fresh && ckpt.exists() {
        Some(format!(
            "{} already holds a checkpoint ({}): pass --resume to continue that run or --fresh to start over",
            dir.display(),
            ckpt.file_name().unwrap_or_default().to_string_lossy()
        ))
    } else if rank == 0 {
        // The process that writes the run's files: told now, not after the build.
        files::check_folder_writable(dir).err().map(|e| e.to_string())
    } else {
        None
    };
    let Some(group) = group else {
        if let Some(why) = why {
            return Err(config_error("output.dir", why));
        }
        if resume && !ckpt.exists() {
            // Said before the data and model are built, not after.
            return Err(config_error(
                "output.dir",
                format!("no checkpoint to resume from at {}{}", ckpt.display(), set_aside_note(dir)),
            ));
        }
        return Ok(());
    };
    // Each process's answers in one gather: rank 0's refusal, whether it resumes and finds
    // no checkpoint to, then its settings' fingerprints.
    const HEAD: usize = 3;
    let settings = shared_settings(config)?;
    let refused = u64::from(rank == 0 && why.is_some());
    let missing = u64::from(resume && !ckpt.exists());
    let head = [refused, u64::from(resume), missing];
    let mine: Vec<u64> = head.into_iter().chain(settings.iter().map(|(_, print)| *print)).collect();
    let all = group.all_gather_u64(&mine)?;
    if all[0][0] != 0 {
        let why = why.unwrap_or_else(|| "its output.dir is in the way".into());
        return Err(config_error(
            "output.dir",
            if rank == 0 { why } else { format!("rank 0 refused to start: {why}") },
        ));
    }
    let mut differing: Vec<(usize, Vec<&str>)> = Vec::new();
    for (r, theirs) in all.iter().enumerate().skip(1) {
        if theirs.len() != all[0].len() {
            return Err(config_error(
                "launch",
                format!(
                    "rank {r} runs another build of pipetransformer than rank 0: launch the same program on every node"
                ),
            ));
        }
        if theirs[1] != all[0][1] {
            let (zero, them) = if all[0][1] != 0 { ("resumes", "starts afresh") } else { ("starts afresh", "resumes") };
            return Err(config_error(
                "--resume",
                format!("rank 0 {zero} and rank {r} {them}: give every process of a launched run the same flags"),
            ));
        }
        let keys: Vec<&str> = settings
            .iter()
            .zip(&theirs[HEAD..])
            .zip(&all[0][HEAD..])
            .filter(|((_, a), b)| a != b)
            .map(|((s, _), _)| s.0.as_str())
            .collect();
        if !keys.is_empty() {
            differing.push((r, keys));
        }
    }
    if let Some((_, keys)) = differing.first() {
        let ranks: Vec<String> = differing.iter().map(|(r, keys)| format!("rank {r}: {}", keys.join(", "))).collect();
        let per_node = PER_NODE_SETTINGS.join(", ");
        return Err(config_error(
            keys[0],
            format!(
                "settings differ from rank 0's ({}): give every process of a launched run the same config and --set \
                 flags (only {per_node} may differ between nodes)",
                ranks.join("; ")
            ),
        ));
    }
    let missing: Vec<usize> = (0..all.len()).filter(|&r| all[r][2] != 0).collect();
    if !missing.is_empty() {
        return Err(config_error(
            "output.dir",
            format!(
                "rank(s) {missing:?} find no checkpoint to resume at {}: every process of a launched run reads \
                 it from its own output.dir, which must therefore be a folder all nodes share{}",
                ckpt.display(),
                set_aside_note(dir)
            ),
        ));
    }
    Ok(())
}

/// Settings each node of a launched run may give its own way: where its files are, its
/// threads and its console.
pub const PER_NODE_SETTINGS: [&str; 6] =
    ["model.pretrained", "data.dir", "output.dir", "output.threads", "output.progress_every", "elastic.cache_dir"];

/// Every setting of `config` the processes of a launched run must share (`section.key`, by
/// name), each with a fingerprint of its value.
fn shared_settings(config: &RunConfig) -> Result<Vec<(String, u64)>> {
    let value = serde_json::to_value(config).map_err(|e| internal("the run's settings", e.to_string()))?;
    let sections = value.as_object().into_iter().flatten();
    let keys = sections.flat_map(|(section, v)| {
        v.as_object().into_iter().flatten().map(move |(key, v)| (format!("{section}.{key}"), v))
    });
    keys.filter(|(key, _)| !PER_NODE_SETTINGS.contains(&key.as_str()))
        .map(|(key, v)| Ok((key, crate::rng::fnv1a(v.to_string().as_bytes(), crate::rng::FNV_OFFSET))))
        .collect()
}

/// The end of a run.
#[derive(Clone, Debug, Serialize)]
pub struct Summary {
    /// Dataset.
    pub data: DataInfo,
    /// Model family.
    pub family: Family,
    /// Parameters.
    pub parameters: usize,
    /// Optimizer steps taken in all (including before a resume).
    pub steps: u64,
    /// Wall-clock seconds of this process's run loop: its steps, evaluations and checkpoints
    /// (the per-epoch rates of steps alone are in `report.html` and the epoch events).
    pub seconds: f64,
    /// Samples this process trained on, per second of `seconds`.
    pub samples_per_second: f64,
    /// Final evaluation.
    pub eval: Option<EvalMetrics>,
    /// The best evaluation on `train.keep_best`, whose weights are in `output.dir/best/`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub best: Option<Scored>,
    /// Whether the run stopped before its planned length (`train.early_stopping_patience`).
    pub stopped_early: bool,
    /// Frozen Transformer layers at the end.
    pub frozen_layers: usize,
    /// The pipeline configuration at the end (`K`, `R`, `M`, schedule, chunks, memory limit,
    /// token slices), as the elastic transitions left it.
    pub final_plan: PipelineConfig,
    /// The devices the run held, as they name themselves (backend, index, precision; threads
    /// on cpu: e.g. `cpu:0 (F32, bf16 products (avx512), 1 thread)`), so a result says what computed it.
    pub devices: Vec<String>,
    /// For language models: the held-out loss of predicting each character by its training
    /// frequency alone (the unigram baseline the model must beat).
    pub unigram_baseline_loss: Option<f64>,
}

/// `train.freeze_embeddings` applied to the model before it is planned, so that the plan charges
/// the embedding its forward only (the trainer applies it too, for pipelines built elsewhere).
fn freeze_embeddings<D: Device>(config: &RunConfig, dev: &D, model: &mut Model<D>) -> Result<()> {
    if config.train.freeze_embeddings { model.freeze_prefix(dev, 1) } else { Ok(()) }
}

/// The first micro-batch `plan` cuts the first training batch into (what the planners
/// measure on).
fn first_micro_batch(first: &HostBatch, plan: &PipelineConfig) -> Result<HostBatch> {
    Ok(first.split(plan.replicas.saturating_mul(plan.micro_batches).clamp(1, first.batch))?.swap_remove(0))
}

/// The units' costs the planner balances, for one micro-batch of the first training batch
/// under `plan`: measured where AutoPipe balances on them (or when asked), else from FLOPs.
/// Returns them per sample and per micro-batch.
fn planning_profiles<D: Device>(
    config: &RunConfig,
    dev: &D,
    model: &mut Model<D>,
    first: &HostBatch,
    plan: &PipelineConfig,
) -> Result<(Vec<UnitProfile>, Vec<UnitProfile>)> {
    let micro = first_micro_batch(first, plan)?;
    let measure = config.pipeline.profile || config.elastic.auto_pipe;
    let per_sample = unit_profiles_per_sample(dev, model, &micro, measure)?;
    let micro_samples = samples_per_micro_batch(first.batch, plan.replicas, plan.micro_batches);
    let profiles = per_sample.iter().map(|p| p.scaled(micro_samples as f64)).collect();
    Ok((per_sample, profiles))
}

/// What `auto` slicing planned for the initial shape (none where it runs whole micro-batches
/// or the fewest equal slices), and the slicer of the shapes AutoPipe changes to.
type AutoSlicing = (Option<PlannedSlicing>, Slicer);

/// `auto`'s slicer of the shapes after the first, by [`Plan::auto_slicing`]'s rule in the
/// controller: on more than one stage TeraPipe's planner over `profile`'s measurement; on one
/// stage (and where nothing was measured: a run on one device, or without AutoPipe, that
/// began on one stage) whole micro-batches, which the rule's fallback cuts into equal slices
/// where they exceed the memory limit.
fn auto_slicer(profile: Option<SlicingProfile>) -> Slicer {
    Box::new(move |config, samples, units, stages| match (config.pipeline_len, &profile) {
        (1, _) | (_, None) => Ok(Vec::new()),
        (_, Some(profile)) => Ok(lengths(&profile.plan_stages(config, samples, units, stages)?.0)),
    })
}

/// TeraPipe's slicing for a pipeline, and the slowest of the stages it modelled.
#[derive(Clone, Debug)]
pub struct PlannedSlicing {
    /// The slicing.
    pub plan: SlicingPlan,
    /// The stage.
    pub stage: StageLoad,
    /// Each slice of a micro-batch as `(tokens, context, seconds)`: its forward and backward
    /// on that stage after the slices before it, with its transfers across the stage's
    /// boundary, as the latency model predicts (later slices attend to more context, which
    /// is why `auto` may make them shorter).
    pub slice_seconds: Vec<(usize, usize, f64)>,
}

/// Whether the model and the activation cache take the token slices `config` asks for: token
/// slicing needs a causal language model, and the cache holds whole sequences.
fn check_token_slices(config: &RunConfig, spec: &Spec) -> Result<()> {
    if config.pipeline.token_slices == TokenSlices::Off {
        return Ok(());
    }
    if !spec.causal || spec.head != HeadSpec::TiedLmHead {
        return Err(config_error(
            "pipeline.token_slices",
            format!(
                "token slicing needs a causal language model (GPT); this {} model attends in both directions or classifies whole sequences",
                spec.family
            ),
        ));
    }
    if config.elastic.cache {
        return Err(config_error(
            "pipeline.token_slices",
            "the frozen-activation cache (elastic.cache) does not take token slices; turn one off",
        ));
    }
    Ok(())
}

/// The token slices `config` asks for, for sequences like `first`'s ([`check_token_slices`]
/// first); `auto` measures the model's layer on `dev` and slices `plan`'s pipeline of units
/// costing `units` per micro-batch by [`Plan::auto_slicing`]'s rule (its planner's plan
/// returned beside the lengths where it runs one, and the measurement, to slice the shapes
/// AutoPipe changes to).
fn token_slices<D: Device>(
    config: &RunConfig,
    devices: &[D],
    model: &mut Model<D>,
    first: &HostBatch,
    plan: &PipelineConfig,
    units: &[UnitProfile],
) -> Result<(Vec<usize>, Option<AutoSlicing>)> {
    let request = &config.pipeline.token_slices;
    match request {
        TokenSlices::Off => return Ok((Vec::new(), None)),
        TokenSlices::Auto => {}
        _ => return Ok((request.lengths(first.seq)?, None)),
    }
    // The stages the pipeline will cut (its frozen prefix on the first, as `Pipeline::new`).
    let pinned = model.frozen_prefix();
    let dev = devices.first().ok_or_else(|| config_error("devices", "none opened"))?;
    let micro = first_micro_batch(first, plan)?;
    // One stage has no fill or drain for slices to shorten: `auto` keeps its micro-batches
    // whole, whatever noisy timings would predict, unless they exceed the memory limit where
    // equal slices do not (as for any shape AutoPipe changes to). AutoPipe may still run a
    // longer pipeline on the devices open (a resumed checkpoint's, and its trials of it): the
    // layer is measured for those.
    if plan.pipeline_len == 1 {
        let longer = config.elastic.auto_pipe && devices.len() > 1;
        let profile = if longer { Some(SlicingProfile::measure(dev, model, &micro)?) } else { None };
        let whole = |_: &PipelineConfig| Ok(Vec::new());
        let sliced = match Plan::auto_slicing(plan, units, pinned, None, first.seq, whole, Vec::clone)? {
            AutoSliced::Equal(lengths) => lengths,
            AutoSliced::Planned(_) | AutoSliced::Whole => Vec::new(),
        };
        return Ok((sliced, Some((None, auto_slicer(profile)))));
    }
    let profile = SlicingProfile::measure(dev, model, &micro)?;
    let slice =
        |c: &PipelineConfig| Plan::slice_cut(c, units, pinned, |s| profile.plan_stages(c, micro.batch, units, s));
    let (sliced, planned) = match Plan::auto_slicing(plan, units, pinned, None, first.seq, slice, |(p, _)| lengths(p))?
    {
        AutoSliced::Planned((planned, stage)) => {
            let latency = profile.latency(&stage, plan.pipeline_len, micro.batch)?;
            let mut context = 0;
            let mut slice_seconds = Vec::new();
            for &len in planned.micro_batches.first().map_or(&[][..], |m| &m.slices) {
                // (The planner's unit is one micro-batch: the model's batch dimension is 1.)
                slice_seconds.push((len, context, latency.slice_time(1, len, context)?));
                context += len;
            }
            (lengths(&planned), Some(PlannedSlicing { plan: planned, stage, slice_seconds }))
        }
        // (Main says which, and why.)
        AutoSliced::Whole => (Vec::new(), None),
        AutoSliced::Equal(lengths) => (lengths, None),
    };
    Ok((sliced, Some((planned, auto_slicer(Some(profile))))))
}

/// The token slices `planned` cuts every micro-batch into; none where it keeps them whole.
fn lengths(planned: &SlicingPlan) -> Vec<usize> {
    let lengths = planned.micro_batches.first().map(|m| m.slices.clone()).unwrap_or_default();
    if lengths.len() > 1 { lengths } else { Vec::new() }
}

/// Refuses what a pipeline whose stages are processes cannot run (`pipeline.across_processes`,
/// for `train` under `launch` and `plan` alike): AutoPipe, AutoDP, the cache, profiling and token
/// slices move units or measure within one process, and the settling test reads every layer.
pub fn check_across_processes(config: &RunConfig) -> Result<()> {
    let e = &config.elastic;
    let within_one_process = [
        (e.auto_pipe, "elastic.auto_pipe", "false"),
        (e.auto_dp, "elastic.auto_dp", "false"),
        (e.cache, "elastic.cache", "false"),
        (config.pipeline.profile, "pipeline.profile", "false"),
        (config.pipeline.token_slices != TokenSlices::Off, "pipeline.token_slices", "\"off\""),
    ];
    if e.freeze != FreezeName::Off && e.max_weight_change.is_some() {
        return Err(Error::Config {
            field: "elastic.max_weight_change".into(),
            message: "the settling test compares every layer's weights, which no process of a pipeline across \
                      processes holds: set it to none (--set elastic.max_weight_change=none)"
                .into(),
        });
    }
    match within_one_process.into_iter().find(|(on, _, _)| *on) {
        Some((_, key, off)) => Err(Error::Config {
            field: key.into(),
            message: format!("works within one process; a pipeline across processes needs it off (--set {key}={off})"),
        }),
        None => Ok(()),
    }
}

/// What a [resume](Job::resume) found: the plan the run goes on with, and the training
/// settings that changed since the checkpoint (`train.lr 0.001 → 0.01`), which it takes.
#[derive(Clone, Debug, PartialEq)]
pub struct Resumed {
    /// The plan.
    pub plan: ResumedPlan,
    /// The settings that changed.
    pub changed: Vec<String>,
}

impl std::fmt::Display for Resumed {
    /// A line for the plan unless it is the checkpoint's, and one for the changed settings
    /// where there are some; nothing else.
    fn fmt(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        if self.plan != ResumedPlan::Checkpoint {
            writeln!(f, "{}", self.plan)?;
        }
        if !self.changed.is_empty() {
            writeln!(f, "settings changed since the checkpoint, taken from here on: {}", self.changed.join(", "))?;
        }
        Ok(())
    }
}

/// The plan a [resumed](Job::resume) run goes on with.
#[derive(Clone, Debug, PartialEq)]
pub enum ResumedPlan {
    /// The checkpoint's, the shape this run's settings ask for.
    Checkpoint,
    /// The shape this run's settings ask for (`now`), which replaced the checkpoint's (`was`).
    Replanned {
        /// The checkpoint's plan.
        was: PipelineConfig,
        /// The plan in force.
        now: PipelineConfig,
    },
    /// The checkpoint's (`now`): with AutoPipe on, a resumed run goes on in the shape it
    /// stopped in, and this run's settings (`asked`) give only a fresh run's start.
    KeptByAutoPipe {
        /// The shape the settings ask a run to start in.
        asked: PipelineConfig,
        /// The plan in force.
        now: PipelineConfig,
    },
}

impl std::fmt::Display for ResumedPlan {
    /// Empty for [`ResumedPlan::Checkpoint`]; else a sentence on what became of the shape.
    fn fmt(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        match self {
            ResumedPlan::Checkpoint => Ok(()),
            ResumedPlan::Replanned { was, now } => write!(
                f,
                "the checkpoint's plan ({}) gives way to the one this run asks for ({})",
                shape_text(was, now),
                shape_text(now, was)
            ),
            ResumedPlan::KeptByAutoPipe { asked, now } => write!(
                f,
                "the checkpoint's plan ({}) stands: with AutoPipe on (elastic.auto_pipe), a resumed run goes on \
                 in the shape it stopped in; the one asked for ({}) is where a fresh run starts",
                shape_text(now, asked),
                shape_text(asked, now)
            ),
        }
    }
}

/// `c`'s pipelines in brief: `K R M` and the schedule, and each of its chunks, memory limit
/// and token slices that is set or that differs from `other`'s.
fn shape_text(c: &PipelineConfig, other: &PipelineConfig) -> String {
    let mut text = format!("K={} R={} M={} {}", c.pipeline_len, c.replicas, c.micro_batches, c.schedule);
    if c.chunks != 1 || c.chunks != other.chunks {
        text += &format!(", {} chunk(s) per device", c.chunks);
    }
    if c.memory_limit != other.memory_limit || c.memory_limit.is_some() {
        match c.memory_limit {
            Some(limit) => text += &format!(", memory limit {limit} B"),
            None => text += ", no memory limit",
        }
    }
    if c.token_slices != other.token_slices {
        text += &format!(", token slices {:?}", c.token_slices);
    }
    if c.recompute != other.recompute {
        text += &format!(", recompute {}", c.recompute);
    }
    text
}

/// A run: its config, data, trainer, elastic controller and output paths.
pub struct Job<D: Device> {
    /// The configuration the job was built from: the model, data, plan, trainer and the
    /// cache's folder were made from it, so a change made here afterwards does not reach
    /// them (the output folder's files would follow a new `output.dir`, the cache's would not).
    pub config: RunConfig,
    /// Batches.
    pub source: Box<dyn BatchSource>,
    /// What the data is.
    pub info: DataInfo,
    /// The model's configuration (exported next to the weights).
    pub model_config: ModelConfig,
    /// The pipeline (the only copy of the model), its schedule and position.
    pub trainer: Trainer<D>,
    /// PipeTransformer's controller (does nothing with the `[elastic]` section off).
    pub elastic: Elastic,
    /// What loading pretrained weights found, if any were loaded.
    pub load_report: Option<LoadReport>,
    /// TeraPipe's planned slicing, when the run asked for `token_slices = "auto"` (none after a
    /// [resume](Self::resume) that restored the checkpoint's plan).
    pub slicing: Option<PlannedSlicing>,
    /// What the replicas sum gradients over (NCCL, the host ring, or why not NCCL), to announce.
    pub communicator: String,
    /// Whether the state continues an earlier run's: a checkpoint's, or an earlier call of
    /// [`run`](Self::run) that failed.
    resumed: bool,
    /// The metrics log, from the first call of [`run`](Self::run) on: held in memory until a
    /// run that starts over has taken its first step, then the file.
    metrics: std::cell::RefCell<Option<MetricsLog>>,
    /// What the run that reached the end returned: a later call of [`run`](Self::run) returns
    /// it again and writes nothing.
    finished: Option<Summary>,
}

impl<D: Device> Job<D> {
    /// [`new`](Self::new) for one process of `group` (`pipetransformer launch`): this process
    /// runs its shard of every global batch and only rank 0 writes the run's files. AutoDP and
    /// the activation cache work within one process, so a launched run must switch them off.
    pub fn launched(devices: Vec<D>, config: RunConfig, group: ProcessGroup) -> Result<Self> {
        let mut job = Self::build(devices, config, None, group.size())?;
        job.join_process_group(group)?;
        Ok(job)
    }

    fn join_process_group(&mut self, group: ProcessGroup) -> Result<()> {
        let e = &self.config.elastic;
        for (on, key) in [(e.auto_dp, "elastic.auto_dp"), (e.cache, "elastic.cache")] {
            if on {
                return Err(Error::Config {
                    field: key.into(),
                    message: format!("works within one process; a launched run needs it off (--set {key}=false)"),
                });
            }
        }
        let pipeline = &mut self.trainer.pipeline;
        pipeline.set_process_group(Some(Arc::new(group)))?;
        // Every process asks at the same point: NCCL over every GPU of the run where all can.
        let comm = rebuild_communicators(pipeline)?;
        self.communicator = self.describe_communicator(comm);
        Ok(())
    }

    /// What the gradients are summed over, for the console, given what the replicas of this
    /// process sum over (`comm`, from [`rebuild_communicators`]).
    fn describe_communicator(&self, comm: String) -> String {
        let pipeline = &self.trainer.pipeline;
        let Some(size) = pipeline.process_group().filter(|_| pipeline.process_stage().is_none()).map(|g| g.size())
        else {
            return comm;
        };
        if pipeline.communicators_span_processes() {
            return format!("{comm} over the GPUs of {size} processes, gradients summed as the backward goes");
        }
        let within = (pipeline.replicas() > 1).then(|| format!("{comm} within each process, "));
        let when = match (pipeline.sums_during_backward(), pipeline.plan().config.pipeline_len > 1) {
            (true, true) => "stage by stage as the backward goes (in steps whose stages every process cut alike)",
            (true, false) => "as the backward goes",
            (false, _) => "after each step",
        };
        format!("{}a TCP ring across {size} processes, gradients summed {when}", within.unwrap_or_default())
    }

    /// Whether this process writes the run's files (not a launched run's ranks above 0).
    pub fn writes_files(&self) -> bool {
        let pipeline = &self.trainer.pipeline;
        pipeline.process_group().is_none_or(|g| g.rank() == 0) && pipeline.process_stage().is_none_or(|s| s == 0)
    }
}

impl<D: Device> Job<D> {
    /// Builds the whole run from `config` on `devices` (as many as
    /// [`PipelineSection::resolve`](super::config::PipelineSection::resolve) asks for): the
    /// data, the model (pretrained or new) on the first device, the units' costs, the plan,
    /// the pipeline with its communicators (NCCL between GPU replicas when installed), the
    /// trainer and the elastic controller. Every setting is checked before anything is
    /// written.
    pub fn new(devices: Vec<D>, config: RunConfig) -> Result<Self> {
        Self::build(devices, config, None, 1)
    }

    /// [`new`](Self::new) for one process of a launched run whose pipeline stages are its
    /// processes (`pipeline.across_processes`): its `K·R` processes are `R` replicas of a
    /// `K`-stage pipeline (`K` the process count unless `pipeline.pipeline_len` says), and
    /// this one trains stage `rank % K` of replica `rank / K` on `devices[0]`. Every process
    /// plans from the units' FLOPs, so all make the same plan.
    /// Each process builds only its own stages' weights (the other units
    /// [hollow](Model::new_keeping)), so a per-stage memory limit holds from the start.
    /// Freezing works (every process sees the same summed gradient norms, so all freeze the
    /// same layers at the same step), but not its settling test; AutoPipe, AutoDP and the
    /// cache (which move units within one process) and token slices must be off.
    pub fn across_processes(devices: Vec<D>, mut config: RunConfig, group: ProcessGroup) -> Result<Self> {
        check_across_processes(&config)?;
        // Unless given, one pipeline whose stages are all the processes.
        config.pipeline.pipeline_len.get_or_insert(group.size());
        Self::build(devices, config, Some(group), 1)
    }

    /// The run on `devices`, its pipeline's stages the processes of `group` when given, and
    /// its replicas' batches shared with `processes − 1` other processes. A setting the layers
    /// below refuse is named as the run config writes it.
    fn build(devices: Vec<D>, config: RunConfig, group: Option<ProcessGroup>, processes: usize) -> Result<Self> {
        let inline_model = config.model.config.is_some();
        Self::assemble(devices, config, group, processes).map_err(|e| named_as_written(e, inline_model))
    }

    fn assemble(devices: Vec<D>, config: RunConfig, group: Option<ProcessGroup>, processes: usize) -> Result<Self> {
        // (A config built in code, not parsed, is checked here as a parsed one is.)
        config.validate()?;
        let (plan, count) = config.pipeline.resolve()?;
        if devices.len() < count {
            return Err(config_error("devices", format!("the run needs {count} devices; {} given", devices.len())));
        }
        // The most replicas a step can have: one per device (AutoDP's ceiling) of every process,
        // or, with stages as processes, one per pipeline of them.
        let replicas = match &group {
            Some(g) => g.size() / plan.pipeline_len.max(1),
            None => count * processes,
        };
        let (source, info) = prepare_data(&config, replicas)?;
        let first = source.train_batch(0, 0)?;
        // Found now, not at the first step: only a training set shorter than the batch makes
        // a step's batch this short (the config checked the batch), and each replica of every
        // process needs a sample of it.
        let fed = plan.replicas.saturating_mul(processes);
        if group.is_none() && first.batch < fed {
            let each = format!("each of {fed} replica(s) needs one at least");
            let whole = first.batch < config.data.batch_size;
            let limit = if config.data.train_limit > 0 { " (data.train_limit)" } else { "" };
            return Err(match whole {
                true => config_error(
                    "pipeline.replicas",
                    format!("a step's batch holds {} sample(s), the whole training set{limit}; {each}", first.batch),
                ),
                // (Launched processes: the config checked the batch against one process's.)
                false => config_error(
                    "data.batch_size",
                    format!(
                        "{} sample(s) a step, shared by {processes} processes of {} replica(s); {each}",
                        first.batch, plan.replicas
                    ),
                ),
            });
        }
        // A stage process holds its own stages' weights only, from the start. Every process
        // plans alike from the units' FLOPs, which their shapes give: a first build keeps no
        // values and says which units are this process's.
        let own_units = match &group {
            None => None,
            Some(group) => {
                let (mut shapes, _, _) = build_model(&devices[0], &config, &info, &|_| false)?;
                check_images(shapes.spec(), &info)?;
                freeze_embeddings(&config, &devices[0], &mut shapes)?;
                let (_, profiles) = planning_profiles(&config, &devices[0], &mut shapes, &first, &plan)?;
                Some(Pipeline::units_of_process(&shapes, plan.clone(), &profiles, group.rank(), group.size())?)
            }
        };
        let keep = |u: usize| own_units.as_ref().is_none_or(|own| own[u]);
        let (mut model, model_config, load_report) = build_model(&devices[0], &config, &info, &keep)?;
        freeze_embeddings(&config, &devices[0], &mut model)?;
        let spec = model.spec().clone();
        check_images(&spec, &info)?;
        if let InputSpec::Tokens { max_positions, .. } = spec.input
            && config.data.max_len > max_positions
        {
            // Found now, not at the first batch long enough to overflow the table mid-run.
            return Err(config_error(
                "data.max_len",
                format!("{} tokens; the model's position table holds {max_positions}", config.data.max_len),
            ));
        }
        check_head_dim(&config, &spec, &devices[0])?;
        // (Token slices first: a model that is not causal is the reason to name before any
        // elastic setting beside them.)
        check_token_slices(&config, &spec)?;
        config.elastic.validate(spec.layers, info.augmented)?;
        let (per_sample, profiles) = planning_profiles(&config, &devices[0], &mut model, &first, &plan)?;
        let mut plan = plan;
        let planned;
        (plan.token_slices, planned) = token_slices(&config, &devices, &mut model, &first, &plan, &profiles)?;
        let mut devices = devices;
        devices.truncate(count);
        let (pipeline, communicator) = match group {
            None => {
                let mut pipeline = Pipeline::new(devices, model, config.train.optimizer, plan.clone(), &profiles)?;
                pipeline.lend_idle_threads(config.elastic.lends_threads(pipeline.devices()))?;
                let communicator = rebuild_communicators(&mut pipeline)?;
                (pipeline, communicator)
            }
            Some(group) => {
                let (rank, size) = (group.rank(), group.size());
                let device = devices.into_iter().next().ok_or_else(|| config_error("devices", "none opened"))?;
                let optimizer = config.train.optimizer;
                let pipeline =
                    Pipeline::across_processes(device, model, optimizer, plan.clone(), &profiles, Arc::new(group))?;
                let (k, replicas) = (plan.pipeline_len, size / plan.pipeline_len.max(1));
                let text = match replicas {
                    1 => format!("stages across {size} processes over a TCP ring (this one runs stage {rank})"),
                    _ => format!(
                        "{replicas} replicas × {k} stages across {size} processes over TCP rings (this one runs stage {} \
                         of replica {})",
                        rank % k,
                        rank / k
                    ),
                };
                (pipeline, text)
            }
        };
        let mut trainer = Trainer::new(pipeline, config.train.clone(), source.batches_per_epoch(), per_sample)?;
        let settings = data_settings(&config);
        // The samples' ids, and for a user's files their bytes: an edited file keeps its ids.
        // (Built-in datasets' fingerprints stay the ids', so older checkpoints resume.)
        let files: String =
            [TRAIN_FILE, TEST_FILE].iter().filter_map(|k| settings.get(*k)).map(|v| v.to_string()).collect();
        trainer.data_fingerprint = source.fingerprint().map(|ids| crate::rng::fnv1a(files.as_bytes(), ids));
        trainer.data_settings = Some(settings);
        if config.data.group_by_length {
            trainer.order_settings = vec![MAX_LEN.into(), TOKENIZER.into()];
        }
        // A batch larger than the training set holds the set.
        let batch = config.data.batch_size.min(first.batch);
        trainer.batch_size = Some(batch);
        trainer.model_config = serde_json::to_value(&model_config).ok();
        let positions = match spec.input {
            InputSpec::Image { image_size, patch, .. } => (image_size / patch).pow(2) + 1,
            InputSpec::Tokens { .. } => config.data.max_len,
        };
        let around = Surroundings {
            layers: spec.layers,
            devices: count,
            initial_replicas: plan.replicas,
            batch,
            positions,
            width: spec.hidden,
            activation_dtype: match trainer.pipeline.devices()[0].activation_dtype() {
                crate::DType::Bf16 => CacheDtype::Bf16,
                _ => CacheDtype::F32,
            },
        };
        let mut elastic = Elastic::new(config.elastic.clone(), around, &config.output.dir.join("cache"))?;
        elastic.ask_for(&plan);
        // `auto` slices each shape AutoPipe runs from the one measurement.
        let slicing = planned.and_then(|(planned, slicer)| {
            elastic.plan_token_slices_with(slicer, first.seq);
            planned
        });
        Ok(Self {
            config,
            source,
            info,
            model_config,
            trainer,
            elastic,
            load_report,
            slicing,
            communicator,
            resumed: false,
            metrics: std::cell::RefCell::new(None),
            finished: None,
        })
    }

    /// The checkpoint file of this run.
    pub fn checkpoint_path(&self) -> PathBuf {
        checkpoint_path(&self.config)
    }

    /// The metrics log (JSON lines) of this run.
    pub fn metrics_path(&self) -> PathBuf {
        self.config.output.dir.join(LOG.0)
    }

    /// A sentence on the devices beyond the plan's that AutoDP holds for later (the plan
    /// printed alone would leave them unexplained); `None` where there are none, or AutoDP is
    /// off (the config then warns that they stay idle).
    pub fn devices_waiting(&self) -> Option<String> {
        let pipeline = &self.trainer.pipeline;
        let c = &pipeline.plan().config;
        let waiting = pipeline.devices().len().checked_sub(c.pipeline_len * c.replicas).filter(|&n| n > 0)?;
        let elastic = &self.config.elastic;
        if !elastic.auto_dp {
            return None;
        }
        let what = if elastic.lends_threads(pipeline.devices()) {
            "lend their threads to the devices at work"
        } else if elastic.freed_devices == crate::elastic::FreedDevices::Threads {
            "become replicas (elastic.freed_devices = \"threads\" applies to cpu devices, whose threads they are)"
        } else {
            "become replicas"
        };
        Some(format!(
            "{waiting} more device(s) wait for AutoDP (elastic.auto_dp): when a freeze shortens the pipeline, they {what}"
        ))
    }

    /// The pipeline's devices as they name themselves.
    fn device_names(&self) -> Vec<String> {
        self.trainer.pipeline.devices().iter().map(|d| d.name()).collect()
    }

    /// Continues from this run's checkpoint: position, frozen prefix, plan, weights, optimizer
    /// state and the elastic controller's state (the activation cache is rebuilt). A run
    /// whose settings ask for another shape than the checkpoint's (`--devices 2
    /// --pipeline-len 2` after a run on one device) goes on in that shape, its weights and
    /// optimizer state moved as a re-plan moves them; with AutoPipe on, the shape is
    /// AutoPipe's and the checkpoint's stands. Returns which plan the run goes on with and the
    /// training settings that changed since the checkpoint (which the run takes).
    pub fn resume(&mut self) -> Result<Resumed> {
        let path = self.checkpoint_path();
        if !path.exists() {
            return Err(Error::Io {
                path: path.display().to_string(),
                source: std::io::Error::new(std::io::ErrorKind::NotFound, "no checkpoint to resume from"),
            });
        }
        // With AutoPipe, the shape is its choice, and the run goes on from it; stages as
        // processes take theirs from the launch, which must match the checkpoint's.
        let auto_pipe = self.config.elastic.auto_pipe;
        let fixed = auto_pipe || self.trainer.pipeline.process_stage().is_some();
        let slices = match self.config.pipeline.token_slices {
            TokenSlices::Auto => false,
            TokenSlices::Off => self.config.pipeline.token_slices_written,
            TokenSlices::Count(_) | TokenSlices::Lengths(_) => true,
        };
        let plan = if fixed { RecordedPlan::Restore } else { RecordedPlan::UnlessReshaped { slices } };
        let asked = self.trainer.pipeline.plan().config.clone();
        let restored = self.trainer.load_checkpoint_with(&path, plan)?;
        // Each process read its own output.dir's checkpoint: they must have read the same one.
        let step = self.trainer.position.step;
        let pipeline = &self.trainer.pipeline;
        // Every process of the launch (stage processes' own group is their column alone).
        if let Some(group) = pipeline.every_process() {
            let steps = group.all_gather_u64(&[step])?;
            if let Some(r) = (1..steps.len()).find(|&r| steps[r] != steps[0]) {
                return Err(config_error(
                    "output.dir",
                    format!(
                        "rank {r}'s checkpoint is of step {}, rank 0's of step {}: every process of a launched run \
                         must resume from the same checkpoint, in an output.dir all nodes share",
                        steps[r][0], steps[0][0]
                    ),
                ));
            }
        }
        let mut changed = restored.changed;
        changed.extend(self.elastic.restore(restored.controller)?);
        self.elastic.restore_tensors(restored.tensors);
        // The batch policy in force sets the global batch for the restored replicas (the one
        // the checkpoint recorded came from the policy it was taken under; a shape of the
        // run's own has its initial replicas, one batch a step).
        self.trainer.batches_per_step = self.elastic.batches_per_step(self.trainer.pipeline.plan().config.replicas);
        let now = self.trainer.pipeline.plan().config.clone();
        let resumed = match restored.reshaped_from {
            Some(was) => ResumedPlan::Replanned { was, now },
            // (AutoPipe tunes the micro-batch count itself, and `auto` slices were measured
            // afresh: those are no news.)
            None if auto_pipe
                && PipelineConfig {
                    micro_batches: now.micro_batches,
                    token_slices: if slices { asked.token_slices.clone() } else { now.token_slices.clone() },
                    ..asked.clone()
                } != now =>
            {
                ResumedPlan::KeptByAutoPipe { asked, now }
            }
            None => ResumedPlan::Checkpoint,
        };
        if !matches!(resumed, ResumedPlan::Replanned { .. }) {
            // The checkpoint's plan, token slices included, replaces the one planned here.
            self.slicing = None;
        }
        if self.trainer.pipeline.process_stage().is_none() {
            // (A collective in a launched run: every process resumes at the same point.)
            let comm = rebuild_communicators(&mut self.trainer.pipeline)?;
            self.communicator = self.describe_communicator(comm);
        }
        self.resumed = true;
        Ok(Resumed { plan: resumed, changed })
    }

    /// The elastic loop's start as [`run`](Self::run) takes it, for a plan that shows what the
    /// first step runs: a freeze table's first entry freezes layers (and AutoPipe reshapes)
    /// before it. Returns the lines of what changed (none when nothing did). Not for a run
    /// that goes on to [`run`](Self::run), which starts the loop itself.
    pub fn start_elastic(&mut self) -> Result<Vec<String>> {
        let mut lines = Vec::new();
        self.elastic.start(&mut self.trainer, &mut |e| lines.extend(super::progress::event_line(e)))?;
        Ok(lines)
    }

    /// Trains to the end, checkpointing every `output.checkpoint_every` steps and at the end,
    /// appending every event to the metrics log and passing it to `on_event`; then writes
    /// `summary.json`, `report.html` and the exported model to `output.dir/model/`.
    ///
    /// The output folder is [locked](files::lock_folder) while the run writes it: a second run
    /// given the same folder is refused. A run that starts over (not resumed) moves the earlier
    /// run's files aside (`metrics.jsonl` to `metrics.previous.jsonl`,
    /// `checkpoint.ckpt` to `checkpoint.previous.ckpt`, and its summary, report and exported
    /// model alike, replacing older ones there) once its first step is done, so the log, and
    /// the report drawn from it, hold this run's events alone, nothing in the folder describes
    /// the earlier run as this one's, a resume continues
    /// this run or none, and a run that fails or stops before its first step changes nothing
    /// (its lines are held until then). A call after one that failed goes on with its log (the
    /// trainer stands where the failure left it). A log that cannot be written ends the run at the
    /// next checkpoint, after the checkpoint and export are written; so does a
    /// [stop request](crate::train::request_stop), after the step under way, with
    /// [`Error::Interrupted`]. A run that ends so, or fails, after its first step still draws
    /// `report.html` from its log: the steps it took, up to a divergence say (where that
    /// report cannot be written, a failure's own error is the one returned, and a stop says
    /// so in its own). Once a run has reached its end, `run` returns its summary again and
    /// writes nothing.
    pub fn run(&mut self, on_event: &mut dyn FnMut(&Event)) -> Result<Summary> {
        if let Some(summary) = &self.finished {
            return Ok(summary.clone());
        }
        let out = self.config.output.dir.clone();
        let writes = self.writes_files();
        let _lock = match writes {
            true => {
                std::fs::create_dir_all(&out).map_err(|e| io_error(&out, e))?;
                Some(files::lock_folder(&out)?)
            }
            false => None,
        };
        let ran = self.train_and_write(on_event);
        // Ended early with this run's log open (its first step done): the report of its steps,
        // written while the folder is still locked.
        let logged = self.metrics.get_mut().as_ref().is_some_and(|log| !log.is_held());
        if let Err(ended) = &ran
            && writes
            && logged
        {
            let report = super::report::write_report(&self.metrics_path(), &out.join("report.html"), &self.config);
            // A stop stays a stop (its exit status, what a scheduler requeues on), saying what
            // it could not write; a failure's own error is the one to report.
            if let (Error::Interrupted { step, .. }, Err(e)) = (ended, report) {
                return Err(Error::Interrupted { step: *step, unwritten: Some(e.to_string()) });
            }
        }
        ran
    }

    /// [`run`](Self::run)'s work, in the locked folder.
    fn train_and_write(&mut self, on_event: &mut dyn FnMut(&Event)) -> Result<Summary> {
        let out = self.config.output.dir.clone();
        let metrics_path = self.metrics_path();
        let writes = self.writes_files();
        // A run that starts over moves the earlier run's log and checkpoint aside once its first
        // step is done, not before: one that fails or stops sooner loses nothing. (Left in
        // place after that, a `--resume` after this run died before its first checkpoint would
        // go on with the earlier run, under this run's log.) The log is the job's: a call after
        // one that failed goes on with it.
        if self.metrics.get_mut().is_none() {
            let log = match writes {
                false => MetricsLog::Sink,
                true if !self.resumed => {
                    let others: Vec<_> = SET_ASIDE.iter().map(|(from, to, _)| (out.join(from), out.join(to))).collect();
                    MetricsLog::starting_over(&metrics_path, out.join(LOG.1), &others)
                }
                true => MetricsLog::continued(&metrics_path).map_err(|e| io_error(&metrics_path, e))?,
            };
            *self.metrics.get_mut() = Some(log);
        }
        let every = self.config.output.checkpoint_every;
        let start = Instant::now();
        let (mut samples, mut last_eval) = (0usize, None);
        // The first failed write of the log, checked at each checkpoint.
        let write_error = std::cell::Cell::new(None);
        let record = |err: std::io::Error| {
            let first = write_error.take().unwrap_or(err);
            write_error.set(Some(first));
        };
        // The checkpoint and export being written while the next steps train.
        let mut writing: Option<files::Background> = None;
        {
            let mut log = |e: &Event| {
                match e {
                    Event::Step { samples: n, .. } => samples += n,
                    // (The latest evaluation, an epoch's or one inside it where the run stopped
                    // early there.)
                    Event::Epoch { eval, .. } | Event::Eval { eval, .. } => last_eval = Some(eval.clone()),
                    _ => {}
                }
                let written = match (serde_json::to_string(e), self.metrics.borrow_mut().as_mut()) {
                    (Ok(line), Some(log)) => log.write_line(format!("{line}\n").as_bytes()),
                    _ => Ok(()),
                };
                if let Err(err) = written {
                    record(err);
                }
                on_event(e);
            };
            log(&Event::Start {
                resumed: self.resumed,
                step: self.trainer.position.step,
                devices: self.device_names(),
                plan: self.trainer.pipeline.plan().config.clone(),
            });
            if !self.resumed {
                self.elastic.start(&mut self.trainer, &mut log)?;
            }
            // From here on the state is this run's: a later call continues it.
            self.resumed = true;
            while !self.trainer.done() {
                // Checkpoints at the multiples of `every`, counted from the run's first step
                // (a resumed run's too).
                let chunk = (every > 0).then(|| every - self.trainer.position.step % every);
                if self.metrics.borrow().as_ref().is_some_and(MetricsLog::is_held) {
                    // A run that starts over takes its first step alone, then sets the earlier
                    // run's files aside (a failure to do so ends it here), then goes on to the
                    // checkpoint's step.
                    let before = self.trainer.position.step;
                    self.trainer.fit(self.source.as_ref(), Some(1), &mut self.elastic, &mut log)?;
                    if self.trainer.position.step == before {
                        // Stopped before it (a signal): nothing of this run is kept.
                        return Err(Error::Interrupted { step: Some(before), unwritten: None });
                    }
                    // (A move that fails ends the run before it writes over anything; a log that
                    // cannot be written ends it at the checkpoint, as any failed write.)
                    if let Some(log) = self.metrics.borrow_mut().as_mut() {
                        log.set_aside().map_err(|e| io_error(&out, e))?;
                        if let Err(err) = log.open() {
                            record(err);
                        }
                    }
                } else {
                    self.trainer.fit(self.source.as_ref(), chunk, &mut self.elastic, &mut log)?;
                }
                // An evaluation that scored a new best (train.keep_best) ended the fit: its
                // weights to best/ before they train on. (Every process scored the same
                // evaluation, so all collect here.)
                if self.trainer.take_new_best().is_some() {
                    self.trainer.pipeline.collect_on_rank_zero()?;
                    if writes {
                        finish(&mut writing)?;
                        let (values, exporter) = (self.trainer.pipeline.parameter_tensors()?, self.exporter_to(BEST));
                        writing = Some(files::Background::spawn("best model", move || exporter.write(values))?);
                    }
                }
                // A checkpoint at its step, at the end, and when the run is asked to stop.
                let step = self.trainer.position.step;
                let due = (every > 0 && step.is_multiple_of(every)) || self.trainer.done() || self.trainer.stopping();
                if !due {
                    continue;
                }
                // A log that failed ends the run, once the weights it trained are written.
                let log_failed = write_error.take();
                // When the stages are processes, every stage's weights and optimizer state to
                // rank 0 (a collective: every process gets here) before it writes.
                self.trainer.pipeline.collect_on_rank_zero()?;
                if writes {
                    // One checkpoint and export on disk at a time: the last one is whole before
                    // this one starts (and its error, if any, ends the run here).
                    finish(&mut writing)?;
                    let taken = Instant::now();
                    let (state, tensors) = (self.elastic.state(), self.elastic.state_tensors());
                    let snapshot = self.trainer.snapshot(state, tensors)?;
                    if crate::debug::level() >= 1 {
                        eprintln!(
                            "checkpoint at step {}: snapshot {:.1} ms",
                            self.trainer.position.step,
                            taken.elapsed().as_secs_f64() * 1e3
                        );
                    }
                    let (path, exporter) = (self.checkpoint_path(), self.exporter());
                    writing = Some(files::Background::spawn("checkpoint", move || {
                        snapshot.save(&path)?;
                        exporter.write(snapshot.into_parameters())
                    })?);
                }
                if let Some(err) = log_failed {
                    finish(&mut writing)?;
                    return Err(io_error(&metrics_path, err));
                }
                // Asked to stop (a signal): the step's checkpoint is on its way; end once it is
                // whole (`run` then writes the report of the steps taken).
                if self.trainer.stopping() && !self.trainer.done() {
                    finish(&mut writing)?;
                    return Err(Error::Interrupted { step: Some(self.trainer.position.step), unwritten: None });
                }
            }
        }
        // The loop ends with a checkpoint and export of the final weights, when it ran at all.
        let exported = writing.is_some();
        finish(&mut writing)?;
        // (A run that starts over with no step to take is done here.)
        if let Some(log) = self.metrics.get_mut() {
            log.open().map_err(|e| io_error(&metrics_path, e))?;
        }
        let seconds = start.elapsed().as_secs_f64();
        if last_eval.is_none() {
            last_eval = Some(self.trainer.evaluate(self.source.as_ref())?);
        }
        let summary = Summary {
            data: self.info.clone(),
            family: self.trainer.pipeline.spec().family,
            parameters: self.trainer.pipeline.num_params(),
            steps: self.trainer.position.step,
            seconds,
            samples_per_second: samples as f64 / seconds.max(1e-9),
            eval: last_eval,
            best: self.trainer.selection.best,
            stopped_early: self.trainer.stopped_early(),
            frozen_layers: self.elastic.frozen_layers(),
            final_plan: self.trainer.pipeline.plan().config.clone(),
            devices: self.device_names(),
            unigram_baseline_loss: self.info.unigram_loss,
        };
        // (A resumed run with no step left has collected nothing yet.)
        self.trainer.pipeline.collect_on_rank_zero()?;
        // A resume with no step left trains nothing: the summary of the run that trained
        // (its time and rate) stays.
        let summary_path = out.join("summary.json");
        if writes && (samples > 0 || !summary_path.exists()) {
            let json = serde_json::to_vec_pretty(&summary).map_err(|e| internal("summary", e.to_string()))?;
            files::write_atomic(&summary_path, |w| w.write_all(&json))?;
        }
        if writes {
            if !exported {
                self.export()?;
            }
            super::report::write_report(&metrics_path, &out.join("report.html"), &self.config)?;
        }
        self.finished = Some(summary.clone());
        Ok(summary)
    }

    /// Writes the model as it stands to `output.dir/model/`, self-contained (weights, config
    /// with label names, tokenizer or vocabulary, preprocessing): at every checkpoint and at
    /// the end, so `predict` and `evaluate` can read a run that is still going.
    pub fn export(&self) -> Result<()> {
        self.exporter().write(self.trainer.pipeline.parameter_tensors()?)
    }

    /// What an export of the run's last weights writes besides them, owned (for a
    /// checkpoint's writing thread).
    fn exporter(&self) -> Exporter {
        self.exporter_to(MODEL)
    }

    /// What an export to `output.dir/folder/` writes besides the weights.
    fn exporter_to(&self, folder: &str) -> Exporter {
        Exporter {
            spec: self.trainer.pipeline.spec().clone(),
            config: self.model_config.clone(),
            labels: self.info.labels.clone(),
            tokenizer_dir: tokenizer_dir(&self.config).ok().map(Path::to_path_buf),
            chars: self.info.chars.clone(),
            max_seq_length: self.config.data.max_len,
            pixel_max: self.info.pixel_max,
            resize: self.config.data.resize_to.is_some(),
            // (Recorded once, when the run was built: the tokenizer's hash is not read again.)
            trained_on: self.trainer.data_settings.clone().unwrap_or_else(|| data_settings(&self.config)),
            dir: self.config.output.dir.join(folder),
        }
    }
}

/// An export's model description, labels, tokenizer and preprocessing, and its folder.
struct Exporter {
    spec: crate::model::Spec,
    config: ModelConfig,
    labels: Vec<String>,
    tokenizer_dir: Option<PathBuf>,
    chars: Vec<char>,
    max_seq_length: usize,
    pixel_max: Option<u32>,
    resize: bool,
    trained_on: serde_json::Value,
    dir: PathBuf,
}

impl Exporter {
    /// Writes the export of the parameters `values` (model names, model order).
    fn write(&self, values: Vec<weights::HostTensor>) -> Result<()> {
        let extras = weights::ExportExtras {
            labels: &self.labels,
            tokenizer_dir: self.tokenizer_dir.as_deref(),
            chars: &self.chars,
            max_seq_length: Some(self.max_seq_length),
            pixel_max: self.pixel_max,
            resize: self.resize,
            trained_on: Some(&self.trained_on),
        };
        weights::export_values(&self.spec, values, &self.config, &extras, &self.dir)?;
        Ok(())
    }
}

/// Waits for the checkpoint and export being written, if one is: its error, if any, is the
/// run's.
fn finish(writing: &mut Option<files::Background>) -> Result<()> {
    writing.take().map_or(Ok(()), files::Background::wait)
}

/// Cross-entropy (nats per token) of `held_out` under the add-one-smoothed unigram
/// distribution of `train`.
pub fn unigram_loss(train: &[u32], held_out: &[u32], vocab: usize) -> f64 {
    let mut counts = vec![1.0f64; vocab];
    for &t in train {
        if let Some(c) = counts.get_mut(t as usize) {
            *c += 1.0;
        }
    }
    let total: f64 = counts.iter().sum();
    let nll: f64 = held_out.iter().map(|&t| -(counts.get(t as usize).copied().unwrap_or(1.0) / total).ln()).sum();
    nll / held_out.len().max(1) as f64
}

#[cfg(test)]
mod tests {
    use super::hold_out_validation;
    use crate::data::{Dataset, TextSample};

    fn toy(n: usize) -> Dataset<TextSample> {
        let samples = (0..n).map(|i| TextSample { id: i as u64, text: format!("t{i}"), label: i as u32 % 2 }).collect();
        Dataset::new("toy", vec!["a".into(), "b".into()], samples).unwrap()
    }

    /// A trace is refused over the run's config and the files it writes in its folder, the
    /// lock and the export's staging folder among them; elsewhere it is free.
    #[test]
    fn a_trace_is_refused_where_the_run_writes() {
        let scratch = crate::files::Scratch::new("trace-in-the-way");
        let config = |sets: &[&str]| {
            let mut sets: Vec<String> = sets.iter().map(|s| s.to_string()).collect();
            sets.push(format!("output.dir={:?}", scratch.join("run").display().to_string()));
            let text = "[model]\npretrained = \"w\"\n[data]\ndataset = \"digits\"\nbatch_size = 8\n[train]\nepochs = 1\nlr = 1e-4\n";
            super::RunConfig::parse(text, "test", &sets).unwrap()
        };
        let file = scratch.join("run.toml");
        let refused = |c: &super::RunConfig, trace: &str| super::trace_in_the_way(c, &scratch.join(trace), &file);
        let plain = config(&[]);
        for own in ["run/.lock", "run/.model.staging/x.json", "run/model.previous", "run/metrics.previous.jsonl"] {
            assert!(refused(&plain, own).is_some_and(|w| w.contains("is where the run writes its own")), "{own}");
        }
        assert!(refused(&plain, "run.toml").is_some_and(|w| w.contains("config file")));
        // The cache's spill files have names of their own: a trace in its folder is free.
        let cached = config(&["elastic.cache=true"]);
        for free in ["run/cache/t.json", "elsewhere/t.json", "run/trace.json"] {
            assert_eq!(refused(&plain, free), None, "{free}");
            assert_eq!(refused(&cached, free), None, "{free}");
        }
    }

    /// A folder with a checkpoint is refused unless the run resumes or starts over; an empty
    /// one starts. (A launched run's ranks hearing rank 0 refuse: tests/cli.rs.)
    #[test]
    fn a_checkpoint_in_the_way_is_refused_unless_resuming_or_starting_over() {
        let scratch = crate::files::Scratch::new("check-start");
        let config = super::RunConfig::parse(
            "[model]\npretrained = \"w\"\n[data]\ndataset = \"digits\"\nbatch_size = 8\n[train]\nepochs = 1\nlr = 1e-4\n",
            "test",
            &[format!("output.dir={:?}", scratch.display().to_string())],
        )
        .unwrap();
        assert!(super::check_start(&config, false, false, None).is_ok(), "nothing there yet");
        std::fs::write(super::checkpoint_path(&config), b"an earlier run").unwrap();
        let e = super::check_start(&config, false, false, None).unwrap_err().to_string();
        assert!(e.contains("output.dir") && e.contains("already holds a checkpoint (checkpoint.ckpt)"), "{e}");
        assert!(e.contains("--resume") && e.contains("--fresh") && !e.contains("rank 0"), "{e}");
        assert!(
            super::check_start(&config, true, false, None).is_ok()
                && super::check_start(&config, false, true, None).is_ok()
        );
        // Resuming where no checkpoint is: said before anything is built.
        std::fs::remove_file(super::checkpoint_path(&config)).unwrap();
        let e = super::check_start(&config, true, false, None).unwrap_err().to_string();
        assert!(e.contains("output.dir") && e.contains("no checkpoint to resume from at"), "{e}");
        std::fs::write(super::checkpoint_path(&config), b"an earlier run").unwrap();
        // A file where the folder goes is named as such, resuming or not.
        let file = super::RunConfig {
            output: super::super::OutputSection { dir: super::checkpoint_path(&config), ..config.output.clone() },
            ..config.clone()
        };
        for (resume, fresh) in [(false, false), (true, false), (false, true)] {
            let e = super::check_start(&file, resume, fresh, None).unwrap_err().to_string();
            assert!(e.contains("output.dir") && e.contains("checkpoint.ckpt is a file, not a folder"), "{e}");
        }
        // A folder that cannot take files, or cannot be made (sysfs takes no new files, for
        // root too): said before anything is built. One yet to be made where it can be is
        // fine, and is not made by the check.
        let at = |dir: &str| super::RunConfig {
            output: super::super::OutputSection { dir: dir.into(), ..config.output.clone() },
            ..config.clone()
        };
        let e = super::check_start(&at("/sys/pt-run/deeper"), false, true, None).unwrap_err().to_string();
        assert!(e.contains("output.dir") && e.contains("cannot be made: /sys does not take new files"), "{e}");
        let e = super::check_start(&at("/sys"), false, true, None).unwrap_err().to_string();
        assert!(e.contains("output.dir") && e.contains("/sys: cannot write in it"), "{e}");
        let later = scratch.join("later/run");
        assert!(super::check_start(&at(later.to_str().unwrap()), false, false, None).is_ok());
        assert!(!scratch.join("later").exists() && std::fs::read_dir(&*scratch).unwrap().count() == 1);
    }

    /// In a launched run every process must be given the same settings but where its files
    /// are, must agree on resuming, and must each find the checkpoint it resumes; each
    /// refusal names the ranks and what differs, on every process.
    #[test]
    fn launched_processes_must_agree_on_settings_and_resuming() {
        let scratch = crate::files::Scratch::new("check-start-group");
        let config = |sets: &[&str]| {
            let mut sets: Vec<String> = sets.iter().map(|s| s.to_string()).collect();
            sets.push(format!("output.dir={:?}", scratch.display().to_string()));
            super::RunConfig::parse(
                "[model]\npretrained = \"w\"\n[data]\ndataset = \"digits\"\nbatch_size = 8\n[train]\nepochs = 1\nlr = 1e-4\n",
                "test",
                &sets,
            )
            .unwrap()
        };
        let group = crate::comm::process_group::tests::group(3, std::time::Duration::from_secs(20));
        let on_all = |configs: [&super::RunConfig; 3], resume: [bool; 3]| -> Vec<String> {
            std::thread::scope(|s| {
                let runs: Vec<_> = (0..3)
                    .map(|r| {
                        let (config, g) = (configs[r], &group[r]);
                        s.spawn(move || {
                            super::check_start(config, resume[r], false, Some(g)).err().map(|e| e.to_string())
                        })
                    })
                    .collect();
                runs.into_iter().map(|h| h.join().unwrap().unwrap_or_default()).collect()
            })
        };
        let same = config(&[]);
        // Where files are, and threads, are each node's own.
        let own = config(&["output.threads=1", "data.dir=\"elsewhere\""]);
        assert_eq!(on_all([&same, &own, &same], [false; 3]), ["", "", ""]);
        let apart = config(&["train.lr=0.5", "data.batch_size=4"]);
        let apart_too = config(&["train.lr=0.5"]);
        for e in on_all([&same, &apart, &apart_too], [false; 3]) {
            assert!(
                e.contains("train.lr") && e.contains("(rank 1: data.batch_size, train.lr; rank 2: train.lr)"),
                "{e}"
            );
        }
        for e in on_all([&same, &same, &same], [true, false, true]) {
            assert!(e.contains("--resume") && e.contains("rank 0 resumes and rank 1 starts afresh"), "{e}");
        }
        // No checkpoint anywhere: every rank resuming is named.
        for e in on_all([&same, &same, &same], [true; 3]) {
            assert!(
                e.contains("rank(s) [0, 1, 2] find no checkpoint to resume") && e.contains("all nodes share"),
                "{e}"
            );
        }
    }

    /// A pretrained folder that is not there is named by its setting, with the way to install it.
    #[test]
    fn a_missing_pretrained_folder_is_named_by_its_setting() {
        let config = super::RunConfig::parse(
            "[model]\npretrained = \"weights/pt-no-such-model\"\n[data]\ndataset = \"rotten_tomatoes\"\nbatch_size = 8\n\
             [train]\nepochs = 1\nlr = 1e-4\n[output]\ndir = \"runs/x\"\n",
            "test",
            &[],
        )
        .unwrap();
        let e = super::tokenizer_dir(&config).unwrap_err().to_string();
        assert!(e.contains("model.pretrained") && e.contains("pt-no-such-model is not a folder"), "{e}");
        assert!(e.contains("make setup"), "{e}");
    }

    /// The validation part comes out of the training half, stratified and seeded; the test
    /// half is untouched; a fraction that empties a half is refused naming the setting.
    #[test]
    fn validation_is_carved_from_the_training_half() {
        let split = toy(100).split_stratified(0.2, 3).unwrap();
        let test = split.test.clone();
        let held = hold_out_validation(split.clone(), 0.25, 3).unwrap();
        assert_eq!(held.test.class_counts(), vec![10, 10]);
        assert_eq!(held.train.class_counts(), vec![30, 30]);
        let ids = |d: &Dataset<TextSample>| d.samples().iter().map(|s| s.id).collect::<std::collections::BTreeSet<_>>();
        let train_ids = ids(&split.train);
        assert!(ids(&held.test).is_subset(&train_ids) && ids(&held.train).is_subset(&train_ids));
        assert!(ids(&held.test).is_disjoint(&ids(&held.train)) && ids(&held.test).is_disjoint(&ids(&test)));
        assert_eq!(hold_out_validation(split.clone(), 0.25, 3).unwrap(), held, "seeded");
        assert_eq!(hold_out_validation(split.clone(), 0.0, 3).unwrap(), split, "0: the split as it was");
        let err = hold_out_validation(toy(4).split_stratified(0.5, 1).unwrap(), 0.01, 1).unwrap_err().to_string();
        assert!(err.contains("data.validation_fraction"), "{err}");
    }
}
