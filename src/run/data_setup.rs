//! The data a run reads: the dataset its config names, split (a validation part carved off the
//! training half where asked), tokenised once, and wrapped as the trainer's batch source; and
//! what the data turned out to be ([`DataInfo`]), which the model is built for and the summary
//! reports. Also where a text run's tokenizer is read from (`model.tokenizer`, else the
//! pretrained folder, whose absence is said by its setting before anything is read).

use super::config::{DataSection, DatasetName, RunConfig};
use super::source::{SampleSource, subset};
use crate::data::{self, ImageSample, LmSequence, TextSample};
use crate::error::{Error, Result, config_error, counted};
use crate::model::ModelConfig;
use crate::text::{Encoded, EncodedItem, TextInput, TextTokenizer, encoded_batch};
use crate::train::BatchSource;
use crate::weights;
use serde::Serialize;
use std::path::{Path, PathBuf};

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
    pub(super) fn fit(&self, field: &str, model: &str, vocab: usize, types: usize, expected: &str) -> Result<()> {
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

/// A model of another kind than the dataset (a GPT on digits, a ViT on hamlet) is refused by
/// the dataset's name when the run is built, not by the first step's upload.
pub(super) fn check_kind(model: &ModelConfig, info: &DataInfo) -> Result<()> {
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

/// Refuses a `model.pretrained` that is not a folder, naming the setting and how the configs'
/// folders are installed (a missing one otherwise surfaced as its first file's read error).
pub(super) fn check_pretrained(dir: &std::path::Path) -> Result<()> {
    match dir.is_dir() {
        true => Ok(()),
        false => Err(config_error(
            "model.pretrained",
            format!(
                "{} is not a folder; expected a Hugging Face model folder (config.json, model.safetensors, \
                 tokenizer.json): `make setup` (scripts/setup.sh) installs the ones configs/ name",
                from_cwd(dir)
            ),
        )),
    }
}

/// `path` as a message shows it: a relative one with the working directory it is read from
/// (a config's paths are the working directory's, not the config file's).
fn from_cwd(path: &Path) -> String {
    match std::env::current_dir() {
        Ok(cwd) if path.is_relative() => format!("{} (from the working directory {})", path.display(), cwd.display()),
        _ => path.display().to_string(),
    }
}

/// The folder a text run's `tokenizer.json` is read from: `model.tokenizer`, else the
/// pretrained model's.
pub(super) fn tokenizer_dir(config: &RunConfig) -> Result<&std::path::Path> {
    let m = &config.model;
    match (&m.tokenizer, &m.pretrained) {
        (Some(dir), _) if !dir.is_dir() => Err(config_error(
            "model.tokenizer",
            format!("{} is not a folder; expected a folder holding tokenizer.json", from_cwd(dir)),
        )),
        (Some(dir), _) if !dir.join(weights::TOKENIZER_FILE).is_file() => Err(config_error(
            "model.tokenizer",
            format!("{} holds no {}; expected a folder holding one", dir.display(), weights::TOKENIZER_FILE),
        )),
        (Some(dir), _) => Ok(dir),
        (None, Some(dir)) => {
            check_pretrained(dir)?;
            match dir.join(weights::TOKENIZER_FILE).is_file() {
                true => Ok(dir),
                false => Err(config_error(
                    "model.pretrained",
                    format!(
                        "{} holds no {}; expected the model's tokenizer beside its weights, or model.tokenizer \
                         naming a folder that holds it",
                        dir.display(),
                        weights::TOKENIZER_FILE
                    ),
                )),
            }
        }
        (None, None) => Err(config_error(
            "model.tokenizer",
            "a text dataset needs a tokenizer: model.pretrained (a Hugging Face model folder), or, for a model \
             built from model.config, model.tokenizer (a folder holding tokenizer.json, such as \
             weights/all-minilm-l6-v2)",
        )),
    }
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
            // A pretrained folder of another kind (a ViT's, which has no tokenizer) is refused
            // by its kind, not by the tokenizer file it lacks.
            if let Some(dir) = &config.model.pretrained
                && let Ok(model) = weights::read_hf_config(dir.join(weights::CONFIG_FILE), None)
            {
                check_kind(&model, &info(&labels, 0, 0))?;
            }
            let tokenizer_path = tokenizer_dir(config)?.join(weights::TOKENIZER_FILE);
            // (Its length is this run's `data.max_len`: the refusal names that setting.)
            let tokenizer = TextTokenizer::from_file(&tokenizer_path, d.max_len).map_err(|e| match e {
                Error::Config { field, message } if field == "max_len" => {
                    Error::Config { field: "data.max_len".into(), message }
                }
                e => e,
            })?;
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
            // Too short a part for one sequence is a setting to lower, named as such; one too
            // short for any sequence (under 2 characters: a token and the next one) is the file.
            // (The file is the setting that named it: Hamlet's is `data.dir`'s; a held-out part
            // cut from the training file, the training file's, which a held-out file can spare.)
            let named = |file: &Path| match d.dataset {
                DatasetName::Hamlet => ("data.dir", ""),
                _ if d.test_file.as_deref() == Some(file) => ("data.test_file", ""),
                _ if d.test_file.is_none() && held_out_file == file => {
                    ("data.train_file", ", or a held-out file of its own (data.test_file)")
                }
                _ => ("data.train_file", ""),
            };
            let part = |which: &str, file: &Path, tokens: usize, sequences: Result<Vec<data::LmSequence>>| {
                sequences.map_err(|_| match (tokens, named(file)) {
                    (0 | 1, (field, or)) => Error::Config {
                        field: field.into(),
                        message: format!(
                            "the {which} of {} holds {}; a sequence needs at least 2 (a token and the next \
                             one): use a longer file{or}",
                            file.display(),
                            counted(tokens, "character")
                        ),
                    },
                    (_, _) => Error::Config {
                        field: "data.max_len".into(),
                        message: format!(
                            "{} tokens per sequence, but the {which} of {} holds {tokens} characters; expected at \
                         most {} (one sequence needs its tokens and the next one)",
                            d.max_len,
                            file.display(),
                            tokens.saturating_sub(1)
                        ),
                    },
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
pub(super) fn hold_out_validation<S: data::Sample>(
    split: data::Split<S>,
    fraction: f64,
    seed: u64,
) -> Result<data::Split<S>> {
    if fraction == 0.0 {
        return Ok(split);
    }
    split.train.split_stratified_as("data.validation_fraction", fraction, seed ^ 0x7661_6c69_6461_7465)
}

/// A text sample with its tokens: what a text run keeps of each sample.
pub(super) struct EncodedSample {
    id: u64,
    label: u32,
    encoded: Encoded,
}

/// Tokenises `samples` (all at once: the tokenizer spreads them over the cores).
pub(super) fn encode_texts(tokenizer: &TextTokenizer, samples: Vec<TextSample>) -> Result<Vec<EncodedSample>> {
    let inputs: Vec<TextInput> = samples.iter().map(|t| TextInput::Single(&t.text)).collect();
    let encoded = tokenizer.encode_batch(&inputs)?;
    Ok(samples.iter().zip(encoded).map(|(t, encoded)| EncodedSample { id: t.id, label: t.label, encoded }).collect())
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
        assert!(e.contains("model.pretrained") && e.contains("pt-no-such-model (from the working directory "), "{e}");
        assert!(e.contains(") is not a folder"), "{e}");
        assert!(e.contains("make setup"), "{e}");
    }
}
