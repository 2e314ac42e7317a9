//! A run's configuration: one TOML file (`configs/*.toml`) plus `--set key=value` overrides.
//! Every section denies unknown keys, so a typo is an error naming the key, never a silently
//! ignored setting.

use crate::device::PrecisionChoice;
use crate::elastic::ElasticConfig;
use crate::error::{Error, Result, config_error, counted};
use crate::model::{ModelConfig, Pooling};
use crate::pipeline::{PipelineConfig, Recompute, ScheduleKind};
use crate::terapipe::TokenSlices;
use crate::train::{KeepBest, TrainConfig};
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

/// Which model to train.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelSection {
    /// A directory with a Hugging Face `config.json` and `model.safetensors` to start from.
    #[serde(default)]
    pub pretrained: Option<PathBuf>,
    /// An architecture to build from scratch (used when `pretrained` is absent).
    #[serde(default)]
    pub config: Option<ModelConfig>,
    /// A folder holding the `tokenizer.json` a text run reads its texts with (default:
    /// `pretrained`'s): a BERT built from `config` needs one (its `vocab_size`, 0 or left out,
    /// then taken from it).
    #[serde(default)]
    pub tokenizer: Option<PathBuf>,
    /// Pooling of a pretrained BERT's classification head.
    #[serde(default)]
    pub pooling: Option<Pooling>,
    /// Seed of the initialisation of new weights.
    #[serde(default)]
    pub seed: u64,
    /// The label count `config` was written with (`num_labels` in the file or a `--set`),
    /// which the dataset's classes must match; `None` where the data is left to set it.
    #[serde(skip)]
    pub num_labels_written: Option<usize>,
}

/// The datasets a run can train on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DatasetName {
    /// Rotten Tomatoes review snippets: fresh vs rotten.
    RottenTomatoes,
    /// Reuters R8 topics.
    ReutersR8,
    /// Fashion-MNIST 28×28.
    FashionMnist,
    /// MNIST, 5000-image subset.
    Mnist5k,
    /// scikit-learn's 8×8 digits.
    Digits,
    /// hamlet.txt as a character-level language-modelling corpus.
    Hamlet,
    /// A user's labelled texts: `label<TAB>text` rows in `data.train_file` (and
    /// `data.test_file`).
    LabelledTexts,
    /// A user's UTF-8 text in `data.train_file` (and `data.test_file`) as a character-level
    /// language-modelling corpus.
    TextCorpus,
    /// A user's labelled images: CSV rows of square single-channel pixels then the label in
    /// `data.train_file` (and `data.test_file`).
    LabelledImages,
}

impl DatasetName {
    /// The name as a config spells it (`dataset = "digits"`).
    pub fn key(self) -> &'static str {
        match self {
            DatasetName::RottenTomatoes => "rotten_tomatoes",
            DatasetName::ReutersR8 => "reuters_r8",
            DatasetName::FashionMnist => "fashion_mnist",
            DatasetName::Mnist5k => "mnist5k",
            DatasetName::Digits => "digits",
            DatasetName::Hamlet => "hamlet",
            DatasetName::LabelledTexts => "labelled_texts",
            DatasetName::TextCorpus => "text_corpus",
            DatasetName::LabelledImages => "labelled_images",
        }
    }

    /// Whether its samples come from the user's files (`data.train_file`, `data.test_file`)
    /// rather than from what `scripts/setup.sh` installs under `data.dir`.
    pub fn from_user_files(self) -> bool {
        matches!(self, DatasetName::LabelledTexts | DatasetName::TextCorpus | DatasetName::LabelledImages)
    }

    /// Whether it is a character-level corpus for a language model.
    pub fn is_corpus(self) -> bool {
        matches!(self, DatasetName::Hamlet | DatasetName::TextCorpus)
    }

    /// Whether its test split is cut from the samples by `data.split_seed` and
    /// `data.test_fraction` (the others come with a test set of their own): for labelled
    /// texts, where no `data.test_file` is given ([`DataSection::cut_by_seed`]).
    pub fn cut_by_seed(self) -> bool {
        matches!(
            self,
            DatasetName::RottenTomatoes
                | DatasetName::Mnist5k
                | DatasetName::Digits
                | DatasetName::LabelledTexts
                | DatasetName::LabelledImages
        )
    }

    /// Whether its samples are texts (read with a tokenizer).
    pub fn is_text(self) -> bool {
        matches!(self, DatasetName::RottenTomatoes | DatasetName::ReutersR8 | DatasetName::LabelledTexts)
    }

    /// Whether its samples are images.
    pub fn is_image(self) -> bool {
        matches!(
            self,
            DatasetName::FashionMnist | DatasetName::Mnist5k | DatasetName::Digits | DatasetName::LabelledImages
        )
    }
}

/// What to train on and how to batch it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DataSection {
    /// The dataset.
    pub dataset: DatasetName,
    /// Directory the setup step installed the data into.
    #[serde(default = "default_data_dir")]
    pub dir: PathBuf,
    /// Samples per training batch.
    pub batch_size: usize,
    /// Samples per evaluation batch (default: `batch_size`).
    #[serde(default)]
    pub eval_batch_size: Option<usize>,
    /// Longest token sequence (text); tokens per sequence (language model).
    #[serde(default = "default_max_len")]
    pub max_len: usize,
    /// Fraction held out for testing where the dataset has no split of its own.
    #[serde(default = "default_test_fraction")]
    pub test_fraction: f64,
    /// Seed of which samples are held out (the test split, the validation carve and the
    /// `train_limit`/`test_limit` subsets); `train.seed` orders the batches and draws dropout.
    /// Its own setting, so that runs of other `train.seed`s are scored on the same test set and
    /// `evaluate` with another `train.seed` never tests on training samples.
    #[serde(default)]
    pub split_seed: u64,
    /// Carve this stratified fraction off the training half and evaluate on it instead of the
    /// test split (0: evaluate on the test split). Recipe choices made on it never see the
    /// test split, which is then left for the final number.
    #[serde(default)]
    pub validation_fraction: f64,
    /// Use at most this many training samples (0: all), e.g. for quick runs.
    #[serde(default)]
    pub train_limit: usize,
    /// Use at most this many test samples (0: all).
    #[serde(default)]
    pub test_limit: usize,
    /// Text: batch samples of similar token count together (training batches grouped in
    /// shuffled windows, evaluation in length order, longest first), so batches carry little padding.
    #[serde(default)]
    pub group_by_length: bool,
    /// `labelled_texts`, `labelled_images` and `text_corpus`: the file the samples come from
    /// (`label<TAB>text` rows; CSV rows of pixels then the label; a UTF-8 text), gzip or bzip2
    /// or plain; for `labelled_images` also a folder of class subfolders of PNG, JPEG or PGM images.
    #[serde(default)]
    pub train_file: Option<PathBuf>,
    /// A held-out file of the same format to evaluate on (default: cut from `train_file`, by
    /// `split_seed` and `test_fraction` for labelled rows, its last tenth for a corpus).
    #[serde(default)]
    pub test_file: Option<PathBuf>,
    /// `labelled_images` from CSV rows: the largest raw pixel value, which pixels are divided by
    /// (default 255; the export carries it, so `predict` scales raw rows the same). Refused
    /// beside a folder of image files, which their format scales.
    #[serde(default)]
    pub pixel_max: Option<u32>,
    /// `labelled_images`: colour channels per pixel (default 1). A row holds the channels one
    /// after another, each a whole `side × side` plane (`[C, H, W]`, the model's layout and the
    /// one `evaluate --file` reads), then the label.
    #[serde(default)]
    pub channels: Option<usize>,
    /// `labelled_images` from a folder: every image resized to `resize_to × resize_to` (the
    /// model's `image_size`) by Pillow's bilinear filter, as torchvision's `Resize((n, n))` and
    /// Hugging Face's `ViTImageProcessor` resize a PIL image (antialiased; the aspect ratio not
    /// kept; 8-bit images to the level as Pillow up to 12 does, deeper ones in floating point:
    /// `data::resize_image`), so images of any size and shape can be read. The export says so,
    /// and `predict` and `evaluate --file` resize image files alike. Without it every image must
    /// be square and of one size.
    #[serde(default)]
    pub resize_to: Option<usize>,
    /// Images: mirror each training image left to right with probability one half, drawn
    /// anew each epoch (torchvision's `RandomHorizontalFlip`). Not for digits or letters,
    /// whose mirror images are other shapes.
    #[serde(default)]
    pub random_flip: bool,
    /// Images: pad each training image with this many zero pixels on every side and crop it
    /// back to its size at a random offset, drawn anew each epoch (torchvision's
    /// `RandomCrop(size, padding=n)`).
    #[serde(default)]
    pub random_crop: Option<usize>,
}

impl DataSection {
    /// A user's images' scale, what their raw pixels are divided by: `pixel_max`, else 255
    /// (8-bit images); `None` for other datasets, which scale their own, and for a folder of
    /// image files, which their format scales.
    pub fn user_pixel_max(&self) -> Option<u32> {
        (self.dataset == DatasetName::LabelledImages && !self.user_folder()).then(|| self.pixel_max.unwrap_or(255))
    }

    /// Whether a user's images are a folder of class subfolders (`train_file` names a folder),
    /// which their files' format scales, not `pixel_max`.
    pub fn user_folder(&self) -> bool {
        self.dataset == DatasetName::LabelledImages && self.train_file.as_deref().is_some_and(Path::is_dir)
    }

    /// A user's images' channels: `channels`, else 1; `None` for other datasets, which know
    /// their own.
    pub fn user_channels(&self) -> Option<usize> {
        (self.dataset == DatasetName::LabelledImages).then(|| self.channels.unwrap_or(1))
    }

    /// The random augmentation of training images (`random_flip`, `random_crop`).
    pub fn image_augment(&self) -> crate::data::ImageAugment {
        crate::data::ImageAugment { flip: self.random_flip, crop_padding: self.random_crop.unwrap_or(0) }
    }

    /// Whether the test split is cut from the training samples by `split_seed` and
    /// `test_fraction` (a dataset's own test files, or a `test_file`, are not).
    pub fn cut_by_seed(&self) -> bool {
        self.dataset.cut_by_seed() && self.test_file.is_none()
    }

    /// What a run evaluates on: `"validation"` with a `validation_fraction`, else `"test"`.
    pub fn evaluated_on(&self) -> &'static str {
        if self.validation_fraction > 0.0 { "validation" } else { "test" }
    }
}

impl DataSection {
    /// A dataset of the user's files needs `train_file`; the built-in ones read none.
    fn check_files(&self) -> Result<()> {
        let key = self.dataset.key();
        let files = [("data.train_file", &self.train_file), ("data.test_file", &self.test_file)];
        if let Some(max) = self.pixel_max {
            if self.dataset != DatasetName::LabelledImages {
                return Err(config_error(
                    "data.pixel_max",
                    format!("is {max}, but applies to dataset = \"labelled_images\"; {key} scales its own pixels"),
                ));
            }
            if max == 0 {
                return Err(config_error("data.pixel_max", "is 0; expected the largest raw pixel value, at least 1"));
            }
        }
        if let Some(channels) = self.channels {
            if self.dataset != DatasetName::LabelledImages {
                return Err(config_error(
                    "data.channels",
                    format!("is {channels}, but applies to dataset = \"labelled_images\"; {key} knows its own"),
                ));
            }
            if channels == 0 {
                return Err(config_error("data.channels", "is 0; expected the colour channels per pixel, at least 1"));
            }
        }
        let augment = [("data.random_flip", self.random_flip), ("data.random_crop", self.random_crop.is_some())];
        if let Some((field, _)) = augment.iter().find(|(_, set)| *set).filter(|_| !self.dataset.is_image()) {
            return Err(config_error(
                *field,
                format!("is set, but {key} is no dataset of images; random augmentation is for images"),
            ));
        }
        if self.random_crop == Some(0) {
            return Err(config_error(
                "data.random_crop",
                "is 0; expected the zero pixels padded on each side before the crop, at least 1 (or leave it out)",
            ));
        }
        if let Some(side) = self.resize_to {
            if self.dataset != DatasetName::LabelledImages {
                return Err(config_error(
                    "data.resize_to",
                    format!(
                        "is {side}, but applies to dataset = \"labelled_images\" from a folder of images; {key} has \
                         images of one size"
                    ),
                ));
            }
            if !(1..=MAX_RESIZE).contains(&side) {
                return Err(config_error(
                    "data.resize_to",
                    format!("is {side}; expected the model's image_size, from 1 to {MAX_RESIZE}"),
                ));
            }
        }
        if !self.dataset.from_user_files() {
            if let Some((field, Some(path))) = files.iter().find(|(_, f)| f.is_some()) {
                return Err(config_error(
                    *field,
                    format!(
                        "is {}, but {key} is a dataset scripts/setup.sh installs under data.dir: a file of your own \
                         is read by dataset = \"labelled_texts\" (label<TAB>text rows), \"labelled_images\" (CSV \
                         pixels then the label, or a folder of class subfolders of images) or \"text_corpus\" (a \
                         text)",
                        path.display()
                    ),
                ));
            }
            return Ok(());
        }
        let what = match self.dataset {
            DatasetName::LabelledTexts => "a file of label<TAB>text rows",
            DatasetName::LabelledImages => {
                "a CSV file of pixel rows, each ending with its label, or a folder of class subfolders of PNG, JPEG or \
                 PGM images"
            }
            _ => "a UTF-8 text file",
        };
        if self.train_file.is_none() {
            return Err(config_error("data.train_file", format!("is not set; {key} reads its samples from {what}")));
        }
        for (field, path) in files {
            // Read more than once: for its fingerprint, its samples, and again on a resume.
            if path.as_deref().is_some_and(|p| p == Path::new("-")) {
                return Err(config_error(
                    field,
                    format!("is `-`, standard input, which a run reads more than once; expected {what}"),
                ));
            }
        }
        Ok(())
    }
}

/// The largest `data.resize_to`: past any ViT's input (224 to 518 for the usual ones), and a
/// folder of such images is already gigabytes in memory.
const MAX_RESIZE: usize = 2048;

fn default_data_dir() -> PathBuf {
    PathBuf::from("data")
}
fn default_max_len() -> usize {
    128
}
fn default_test_fraction() -> f64 {
    0.2
}

/// Where the run writes and what it runs on.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OutputSection {
    /// Directory for metrics, checkpoints, the exported model and the summary.
    pub dir: PathBuf,
    /// Write a checkpoint at every multiple of this many steps, counted from the run's first
    /// (a resumed run's too; 0: only at the end).
    #[serde(default)]
    pub checkpoint_every: u64,
    /// CPU threads (0: all cores).
    #[serde(default)]
    pub threads: usize,
    /// The arithmetic of the products: `f32` (the default), `bf16`, or `auto` (bf16 where the
    /// hardware's bf16 products are faster than its f32 ones, else f32); `--precision` overrides it. Read where the
    /// devices are opened: the `train` command, or a library caller resolving it
    /// ([`PrecisionChoice::resolve`]) for [`open_devices`](crate::run::open_devices).
    #[serde(default)]
    pub precision: PrecisionChoice,
    /// Seconds between progress lines when the output is not a terminal (a log file, CI,
    /// `nohup`); on a terminal a progress bar shows instead.
    #[serde(default = "default_progress_every")]
    pub progress_every: f64,
}

fn default_progress_every() -> f64 {
    30.0
}

/// A whole run.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RunConfig {
    /// The model.
    pub model: ModelSection,
    /// The data.
    pub data: DataSection,
    /// Optimisation.
    pub train: TrainConfig,
    /// Outputs.
    pub output: OutputSection,
    /// How a step is spread over devices (one device unless set).
    #[serde(default)]
    pub pipeline: PipelineSection,
    /// PipeTransformer: freezing, AutoPipe, AutoDP, AutoCache (all off unless set).
    #[serde(default)]
    pub elastic: ElasticConfig,
    /// Settings given that the others leave without effect, each a sentence to warn with
    /// ([`ElasticConfig::inert_settings`]); filled by [`RunConfig::parse`], not a setting.
    #[serde(skip)]
    pub warnings: Vec<String>,
}

/// The most devices, or threads, one process opens.
const MOST_PER_PROCESS: usize = crate::device::MOST_THREADS;

/// The `[pipeline]` section: the devices a run may use and the initial plan on them.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct PipelineSection {
    /// Devices the run may use (`--devices`): the initial plan's `R·K`, plus any AutoDP may
    /// turn into replicas later. Default: `R·K`.
    pub devices: Option<usize>,
    /// Devices per pipeline (`K`). Default: all the devices over the replicas.
    pub pipeline_len: Option<usize>,
    /// Data-parallel replicas of the pipeline (`R`).
    pub replicas: usize,
    /// Micro-batches per replica per step (`M`).
    pub micro_batches: usize,
    /// Schedule family.
    pub schedule: ScheduleKind,
    /// Model chunks per device (default 2 for the interleaved schedule, else 1).
    pub chunks: Option<usize>,
    /// Bytes each device may hold (weights, gradients, optimizer state, activations in flight):
    /// a count, or text with a unit (`"8GiB"`).
    #[serde(deserialize_with = "crate::bytes::deserialize_option")]
    pub memory_limit: Option<usize>,
    /// Partition by each unit's measured time on the device instead of its FLOPs.
    pub profile: bool,
    /// TeraPipe's token slices (`"auto"`, a count, or lengths such as `"32,32,64"`; causal
    /// language models only).
    pub token_slices: TokenSlices,
    /// Whether `token_slices` was written (in the file or on the command line): a resume
    /// keeps its checkpoint's slicing unless the run asks for one of its own (`off`, a count
    /// or lengths; `auto` measures afresh, which the checkpoint's replaces).
    #[serde(skip)]
    pub token_slices_written: bool,
    /// Activation recomputation (`"off"`, `"all"`, `"auto"`: only the stages whose
    /// activations would not fit `memory_limit`, and there the fewest units that make them
    /// fit); not with the zb-h1 schedule. `token_slices = "auto"` then plans its slicing for
    /// time where recomputation meets the limit ([`crate::pipeline::Plan::recomputing_slicing`]).
    pub recompute: Recompute,
    /// One stage per process of a launched run (`--across-processes`): the processes, each
    /// opening one device, make rows of `pipeline_len` stages, each row a replica
    /// (`replicas` stays 1).
    pub across_processes: bool,
}

impl Default for PipelineSection {
    fn default() -> Self {
        Self {
            devices: None,
            pipeline_len: None,
            replicas: 1,
            micro_batches: 1,
            schedule: ScheduleKind::OneFOneB,
            chunks: None,
            memory_limit: None,
            profile: false,
            token_slices: TokenSlices::Off,
            token_slices_written: false,
            recompute: Recompute::Off,
            across_processes: false,
        }
    }
}

impl PipelineSection {
    /// The initial plan's settings and the devices the run may use. `--devices N` means the
    /// same for every command: `N` devices, one pipeline of `N/R` unless `K` is given. With
    /// `across_processes`, the one device each stage's process opens.
    pub fn resolve(&self) -> Result<(PipelineConfig, usize)> {
        let r = self.replicas;
        for (field, value) in [
            ("pipeline.replicas", Some(r)),
            ("pipeline.micro_batches", Some(self.micro_batches)),
            ("pipeline.pipeline_len", self.pipeline_len),
            ("pipeline.devices", self.devices),
            ("pipeline.chunks", self.chunks),
        ] {
            if value == Some(0) {
                return Err(config_error(field, "must be at least 1"));
            }
        }
        let k = match (self.pipeline_len, self.devices) {
            (Some(k), _) => k,
            (None, Some(n)) => (n / r).max(1),
            (None, None) => 1,
        };
        // What this process opens: one device per stage-process, else every device of the run.
        let devices = if self.across_processes {
            if r != 1 || self.devices.is_some_and(|d| d != 1) {
                return Err(config_error(
                    "pipeline.across_processes",
                    format!(
                        "runs one stage per process on one device each, and more processes than stages make \
                         the replicas: set --devices 1 and --replicas 1 (now {}, {})",
                        counted(self.devices.unwrap_or(r * k), "device"),
                        counted(r, "replica")
                    ),
                ));
            }
            1
        } else {
            let needed = k.checked_mul(r).ok_or_else(|| {
                config_error(
                    "pipeline.replicas",
                    format!("{r} replicas × {k} pipeline stages is more devices than can exist"),
                )
            })?;
            let devices = self.devices.unwrap_or(needed);
            if devices > MOST_PER_PROCESS {
                return Err(config_error(
                    "pipeline.devices",
                    format!("{devices} devices in one process; at most {MOST_PER_PROCESS} (launch more processes)"),
                ));
            }
            if devices < needed {
                return Err(config_error(
                    "pipeline.devices",
                    format!(
                        "{} × {} need {needed} devices; {devices} available",
                        counted(r, "replica"),
                        counted(k, "pipeline stage")
                    ),
                ));
            }
            devices
        };
        let chunks = self.chunks.unwrap_or(if self.schedule == ScheduleKind::Interleaved { 2 } else { 1 });
        let config = PipelineConfig {
            pipeline_len: k,
            replicas: r,
            micro_batches: self.micro_batches,
            schedule: self.schedule,
            chunks,
            memory_limit: self.memory_limit,
            token_slices: Vec::new(),
            recompute: self.recompute,
        };
        Ok((config, devices))
    }
}

/// The `[pipeline]` keys the layers below name bare (`devices` is `pipeline.devices`).
pub const PIPELINE_FIELDS: [&str; 7] =
    ["chunks", "micro_batches", "pipeline_len", "replicas", "devices", "memory_limit", "recompute"];

/// `e` with its field named as a run config writes it, where a layer below named it by its own
/// struct: the pipeline's settings are `[pipeline]` keys, and a model described in the config
/// (`inline_model`; not one read from a pretrained folder's `config.json`) is `model.config`.
pub(super) fn named_as_written(e: Error, inline_model: bool) -> Error {
    let Error::Config { field, message } = e else { return e };
    let field = match field.as_str() {
        f if PIPELINE_FIELDS.contains(&f) => format!("pipeline.{field}"),
        "terapipe.memory_limit" => "pipeline.memory_limit".into(),
        "max_grad_norm" => "train.max_grad_norm".into(),
        named => match named.split_once('.') {
            Some(("bert" | "vit" | "gpt", key)) if inline_model => format!("model.config.{key}"),
            _ => field,
        },
    };
    Error::Config { field, message }
}

fn set_error(message: impl Into<String>) -> Error {
    config_error("--set", message)
}

/// Why no setting took `key`: most often a typo, but an optimizer setting of another kind
/// than the table's (`--set train.optimizer.kind="sgd"` over an AdamW table leaves AdamW's
/// `beta1` behind) is named as such, with the way to switch kinds.
/// `kind_written`: whether the table names its kind (else it took the default's, AdamW, and the
/// user means the other kind).
fn unknown_because(key: &str, config: &RunConfig, kind_written: bool) -> String {
    let kind_keys = |kind: &str| -> Option<(String, toml::Table)> {
        let table: toml::Table = [("kind".to_string(), toml::Value::from(kind))].into_iter().collect();
        let read: crate::optim::OptimizerConfig = toml::Value::Table(table).try_into().ok()?;
        match toml::Value::try_from(read).ok()? {
            toml::Value::Table(t) => Some((kind.to_string(), t)),
            _ => None,
        }
    };
    let kind = match toml::Value::try_from(config.train.optimizer) {
        Ok(toml::Value::Table(t)) => t.get("kind").and_then(|k| k.as_str().map(String::from)),
        _ => None,
    };
    let owner = key
        .strip_prefix("train.optimizer.")
        .and_then(|name| ["adamw", "sgd"].into_iter().filter_map(kind_keys).find(|(_, keys)| keys.contains_key(name)));
    match (owner, kind) {
        (Some((other, _)), Some(kind)) if other != kind => format!(
            "a setting of kind \"{other}\", and this table's kind is \"{kind}\"{}; to switch kinds give the whole \
             table: --set 'train.optimizer={{ kind = \"{}\" }}' with the settings it takes",
            if kind_written { "" } else { " (the default, none being written)" },
            if kind_written { &kind } else { &other }
        ),
        _ => "no setting has that name".into(),
    }
}

/// A config's TOML syntax error as the parser words it, and for a key or section written twice
/// (which it names at the second) the line of the first: the two are to be merged.
fn syntax_error(text: &str, e: &toml::de::Error) -> String {
    let said = e.to_string();
    let Some(span) = e.span().filter(|_| e.message() == "duplicate key") else { return said };
    match super::duplicate_key::first_written(text, span.start) {
        Some((first, Some(header))) => {
            format!("{said}`{header}` was first written at line {first}: write each section once, with all its keys\n")
        }
        Some((first, None)) => {
            let key = text.get(span).unwrap_or_default();
            format!("{said}`{key}` was first written at line {first}: keep one of the two\n")
        }
        None => said,
    }
}

impl RunConfig {
    /// Reads `path` and applies `overrides` (`section.key=value`, value in TOML syntax, or a
    /// bare string). An unknown key — in the file or an override — is an error naming it.
    pub fn load(path: &Path, overrides: &[String]) -> Result<Self> {
        let text = std::fs::read_to_string(path).map_err(|e| crate::files::io_error(path, e))?;
        Self::parse(&text, &path.display().to_string(), overrides)
    }

    /// [`RunConfig::load`] from a string; `origin` names it in errors.
    pub fn parse(text: &str, origin: &str, overrides: &[String]) -> Result<Self> {
        let file: toml::Table = text
            .parse()
            .map_err(|e: toml::de::Error| Error::Data { what: origin.into(), message: syntax_error(text, &e) })?;
        let convert = |t: &toml::Table| -> std::result::Result<RunConfig, String> {
            let optimizer = t.get("train").and_then(|t| t.get("optimizer"));
            let kind_written = optimizer.is_some_and(|o| o.get("kind").is_some());
            let mut t = t.clone();
            default_optimizer_kind(&mut t);
            let config: RunConfig =
                toml::Value::Table(t.clone()).try_into().map_err(|e: toml::de::Error| e.to_string())?;
            match config.unknown_key(&t) {
                Some(key) => Err(format!("unknown key `{key}`: {}", unknown_because(&key, &config, kind_written))),
                None => Ok(config),
            }
        };
        let mut table = file.clone();
        for o in overrides {
            apply_override(&mut table, o)?;
        }
        let config = convert(&table).map_err(|e| {
            // A converted table carries no positions: name the first override that breaks a
            // file that converts on its own, else the key in the file (serde's `in `key``), else
            // the file.
            let e = in_words(e.trim_end());
            let (message, key) = match e.rsplit_once("\nin `") {
                Some((message, key)) => (message, key.strip_suffix('`')),
                None => (e.as_str(), None),
            };
            if convert(&file).is_ok() {
                let mut t = file.clone();
                for o in overrides {
                    if apply_override(&mut t, o).is_ok() && convert(&t).is_err() {
                        let (key, value) = o.split_once('=').map_or((o.as_str(), ""), |(k, v)| (k.trim(), v.trim()));
                        let message = match value == "none" && message.starts_with("missing field") {
                            // (Unset by a bare `none`: the setting has no default to fall back on.)
                            true => format!("`none` unsets {key}, which has no default: give it a value"),
                            false => name_the_choices(message, &t, key, &convert),
                        };
                        return Error::Config { field: format!("--set {key}"), message };
                    }
                }
            }
            // (A type error inside the model's table is reported for the table as a whole.)
            let inner = key.filter(|&k| k == "model.config").and_then(|_| model_config_field(&table));
            let (message, key) = match &inner {
                Some((key, message)) => (message.as_str(), Some(key.as_str())),
                None => (message, key),
            };
            match key {
                Some(key) => {
                    let message = name_the_choices(message, &table, key, &convert);
                    Error::Config { field: key.into(), message: format!("{message} (in {origin})") }
                }
                None => Error::Data { what: origin.into(), message: message.into() },
            }
        })?;
        config.validate()?;
        let written = table.get("model").and_then(|m| m.get("config")).and_then(|c| c.get("num_labels"));
        let num_labels_written = written.and_then(toml::Value::as_integer).and_then(|n| usize::try_from(n).ok());
        let token_slices_written = table.get("pipeline").and_then(|p| p.get("token_slices")).is_some();
        let config = RunConfig {
            model: ModelSection { num_labels_written, ..config.model },
            pipeline: PipelineSection { token_slices_written, ..config.pipeline },
            ..config
        };
        let mut warnings = inert_warnings(&config, convert(&file).ok().as_ref(), &file, &table);
        if let (Some(dir), Some(c)) = (&config.model.pretrained, &config.model.config) {
            warnings.push(format!(
                "model.config (a {}) is set, but model.pretrained ({}) gives the architecture: model.config has no \
                 effect",
                c.family(),
                dir.display()
            ));
        }
        let dataset = config.data.dataset;
        if let Some(dir) = config.model.tokenizer.as_ref().filter(|_| !dataset.is_text()) {
            warnings.push(format!(
                "model.tokenizer ({}) is set, but {} is not a dataset of texts: model.tokenizer has no effect",
                dir.display(),
                dataset.key()
            ));
        }
        // As for the elastic settings: a fraction typed on the command line, or one the file's
        // own dataset leaves unread (not one a `--set` of the dataset made inert).
        let data = |t: &toml::Table| t.get("data").and_then(toml::Value::as_table).cloned().unwrap_or_default();
        let (in_file, merged) = (data(&file), data(&table));
        let typed = merged.get("test_fraction").is_some_and(|v| in_file.get("test_fraction") != Some(v));
        let file_dataset = in_file.get("dataset").cloned().and_then(|d| d.try_into::<DatasetName>().ok());
        // (The file's own dataset cuts no split where it has its own test set, or the file
        // gives a held-out file of the user's.)
        let file_cuts = file_dataset.is_some_and(|d| d.cut_by_seed())
            && !(in_file.contains_key("test_file") && file_dataset.is_some_and(DatasetName::from_user_files));
        let unread_in_file = in_file.contains_key("test_fraction") && file_dataset.is_some() && !file_cuts;
        if !config.data.cut_by_seed() && (typed || unread_in_file) {
            let own = match config.data.test_file.as_ref().filter(|_| dataset.from_user_files()) {
                Some(file) => format!("data.test_file ({}) is the held-out set", file.display()),
                None => format!("{} has its own held-out set", dataset.key()),
            };
            warnings.push(format!(
                "data.test_fraction = {} has no effect: {own} (--set data.test_fraction=none leaves it out)",
                config.data.test_fraction,
            ));
        }
        if config.train.freeze_embeddings && config.model.pretrained.is_none() {
            warnings.push(
                "train.freeze_embeddings keeps the embedding at its random initialisation: model.pretrained is not set"
                    .into(),
            );
        }
        if config.train.decay == crate::optim::Decay::Constant && config.train.min_lr != 0.0 {
            warnings.push(format!(
                "train.min_lr = {} has no effect: train.decay = \"constant\" stays at train.lr",
                config.train.min_lr
            ));
        }
        if config.train.early_stopping_patience == 0 && config.train.early_stopping_min_delta != 0.0 {
            warnings.push(format!(
                "train.early_stopping_min_delta = {} has no effect: train.early_stopping_patience is 0 (no early \
                 stopping)",
                config.train.early_stopping_min_delta
            ));
        }
        if dataset.is_image() && merged.contains_key("max_len") {
            warnings.push(format!(
                "data.max_len = {} has no effect: {} is a dataset of images, whose length is the model's patches",
                config.data.max_len,
                dataset.key()
            ));
        }
        if config.pipeline.recompute == crate::pipeline::Recompute::Auto && config.pipeline.memory_limit.is_none() {
            warnings.push(
                "pipeline.recompute = \"auto\" recomputes only where pipeline.memory_limit needs it, and none is set: \
                 it has no effect (\"all\" recomputes every stage)"
                    .into(),
            );
        }
        let e = &config.elastic;
        if e.freeze != crate::elastic::FreezeName::Off
            && let crate::elastic::FreezeInterval::Steps(n) = e.freeze_interval
            && let steps = config.train.max_steps
            && steps > 0
            && n >= steps
        {
            // (A table's first entry freezes before the first step, whatever the interval.)
            let table_first = e.table.first().filter(|&&f| f > 0 && e.freeze == crate::elastic::FreezeName::Table);
            let so = match (n > steps, table_first) {
                (true, Some(_)) => "the rule never runs: only the table's first entry, frozen from the start, applies",
                (true, None) => "the freeze rule never runs",
                (false, Some(_)) => "the rule runs only after the last step: only the table's first entry applies",
                (false, None) => "the freeze rule runs only after the last step: no step trains with a layer frozen",
            };
            warnings.push(format!(
                "elastic.freeze_interval = {n} steps is {} the run (train.max_steps = {steps}): {so}",
                if n > steps { "longer than" } else { "as long as" }
            ));
        }
        warnings.extend(config.idle_resources());
        warnings.extend(config.slices_without_stages());
        Ok(RunConfig { warnings, ..config })
    }

    /// Token slices on a pipeline of one stage without recomputation, to warn of: TeraPipe
    /// overlaps one stage's slice with the next stage's, and a single stage has none to overlap
    /// with, so the slices only make each product smaller (AutoPipe never lengthens a
    /// pipeline). With recomputation they do something: a slice's activations are rebuilt one
    /// slice at a time, so fewer are held at once.
    fn slices_without_stages(&self) -> Option<String> {
        // (Only a GPT's sequences are cut, and the runs of another refuse slices anyway.)
        if !matches!(self.model.config, Some(ModelConfig::Gpt(_))) {
            return None;
        }
        let p = &self.pipeline;
        let slices = match &p.token_slices {
            TokenSlices::Count(n) => *n,
            TokenSlices::Lengths(lengths) => lengths.len(),
            TokenSlices::Off | TokenSlices::Auto => 1,
        };
        let (plan, _) = p.resolve().ok()?;
        let alone = plan.pipeline_len == 1 && !p.across_processes && p.recompute == Recompute::Off;
        (slices > 1 && alone).then(|| {
            format!(
                "pipeline.token_slices = \"{}\" on a pipeline of one stage: TeraPipe overlaps a stage's slice with \
                 the next stage's, and one stage has none, so the slices only make each product smaller (slower \
                 steps, no less memory without pipeline.recompute); set pipeline.pipeline_len to 2 or more, or \
                 leave the slices out",
                p.token_slices
            )
        })
    }

    /// Devices or threads the run asks for and cannot use, each a sentence to warn with:
    /// devices beyond the initial plan's that AutoDP, off, never puts to work, and more
    /// threads than the machine has cores (only as many as the cores are used).
    fn idle_resources(&self) -> Vec<String> {
        let mut warnings = Vec::new();
        if let Ok((plan, devices)) = self.pipeline.resolve() {
            let used = plan.replicas * plan.pipeline_len;
            if devices > used && !self.elastic.auto_dp && !self.pipeline.across_processes {
                warnings.push(format!(
                    "pipeline.devices = {devices}, but the plan uses {used} ({} × {}) and elastic.auto_dp is off: \
                     {} idle",
                    counted(plan.replicas, "replica"),
                    counted(plan.pipeline_len, "stage"),
                    match devices - used {
                        1 => "1 device stays".to_string(),
                        n => format!("{n} devices stay"),
                    }
                ));
            }
        }
        let threads = self.output.threads;
        warnings.extend(crate::device::threads_beyond_cores(&format!("output.threads = {threads}"), threads));
        warnings
    }

    /// A key of `given` (the table this config was read from) that no setting took. The
    /// sections deny unknown keys themselves; the model's architecture and the optimizer cannot
    /// (their types also read Hugging Face files, and are tagged enums), so their tables are
    /// compared with what they read back as: a misspelt key there would silently keep its
    /// default.
    fn unknown_key(&self, given: &toml::Table) -> Option<String> {
        let read_back = |v: Option<toml::Value>| match v {
            Some(toml::Value::Table(t)) => t,
            _ => toml::Table::new(),
        };
        let sections = [
            ("model", "config", read_back(self.model.config.as_ref().and_then(|c| toml::Value::try_from(c).ok()))),
            ("train", "optimizer", read_back(toml::Value::try_from(self.train.optimizer).ok())),
        ];
        sections.into_iter().find_map(|(section, key, known)| {
            let table = given.get(section)?.get(key)?.as_table()?;
            table.keys().find(|k| !known.contains_key(*k)).map(|k| format!("{section}.{key}.{k}"))
        })
    }

    /// `train.keep_best` picks weights by their evaluation: on a classifier's test split that
    /// would make the test score the selection's own, and optimistic, so it needs a
    /// validation split (a corpus's held-out text is its only one); and it needs the metric.
    fn check_selection(&self) -> Result<()> {
        let (keep, corpus) = (self.train.keep_best, self.data.dataset.is_corpus());
        if keep != KeepBest::Off && self.data.evaluated_on() == "test" && !corpus {
            return Err(Error::Config {
                field: "train.keep_best".into(),
                message: format!(
                    "{}: picks the weights of the best evaluation, and this run evaluates on the test split, whose \
                     score would then be the selection's own (and optimistic): carve a validation split out of the \
                     training samples with data.validation_fraction (0.1, say)",
                    keep.name()
                ),
            });
        }
        if keep == KeepBest::MacroF1 && corpus {
            return Err(Error::Config {
                field: "train.keep_best".into(),
                message: format!(
                    "macro_f1 is a classifier's metric; {} trains a language model: keep its best by loss or accuracy",
                    self.data.dataset.key()
                ),
            });
        }
        Ok(())
    }

    /// Checks every setting no run can use, naming it as a config writes it: what parsing a
    /// config does, and what [`Job`](super::Job) does with a config built in code.
    pub fn validate(&self) -> Result<()> {
        if self.model.pretrained.is_none() && self.model.config.is_none() {
            return Err(Error::Config {
                field: "model".into(),
                message: "set `pretrained` (a Hugging Face model directory) or `config` (an architecture)".into(),
            });
        }
        if let (Some(_), Some(c)) = (self.model.pooling, &self.model.config)
            && self.model.pretrained.is_none()
        {
            let own = match c {
                crate::model::ModelConfig::Bert(_) => "set it in the architecture: model.config.pooling",
                _ => "its head has none to choose: leave it out",
            };
            return Err(config_error(
                "model.pooling",
                format!(
                    "chooses a pretrained BERT's pooling; this run builds a {} from model.config: {own}",
                    c.family()
                ),
            ));
        }
        // Every image is read resized before the model is built: a size the model does not
        // take is named now, not after the whole folder was resized to it.
        if let (Some(side), Some(crate::model::ModelConfig::Vit(c))) = (self.data.resize_to, &self.model.config)
            && side != c.image_size
        {
            return Err(config_error(
                "data.resize_to",
                format!("is {side}, but model.config.image_size is {}: expected the model's image size", c.image_size),
            ));
        }
        if self.data.batch_size == 0 {
            return Err(Error::Config { field: "data.batch_size".into(), message: "must be at least 1".into() });
        }
        if self.data.max_len == 0 {
            return Err(Error::Config { field: "data.max_len".into(), message: "must be at least 1 token".into() });
        }
        if !(0.0 < self.data.test_fraction && self.data.test_fraction < 1.0) {
            return Err(Error::Config {
                field: "data.test_fraction".into(),
                message: format!("must be in (0, 1), got {}", self.data.test_fraction),
            });
        }
        if !(0.0..1.0).contains(&self.data.validation_fraction) {
            return Err(Error::Config {
                field: "data.validation_fraction".into(),
                message: format!(
                    "must be in [0, 1) (0: evaluate on the test split), got {}",
                    self.data.validation_fraction
                ),
            });
        }
        if self.data.validation_fraction > 0.0 && self.data.dataset.is_corpus() {
            return Err(Error::Config {
                field: "data.validation_fraction".into(),
                message: format!(
                    "applies to classification datasets; {}'s held-out text is its own",
                    self.data.dataset.key()
                ),
            });
        }
        self.check_selection()?;
        self.data.check_files()?;
        if self.data.group_by_length && !self.data.dataset.is_text() {
            return Err(Error::Config {
                field: "data.group_by_length".into(),
                message: format!(
                    "applies to text datasets (rotten_tomatoes, reuters_r8, labelled_texts), whose samples differ in length; {:?} has one length",
                    self.data.dataset
                ),
            });
        }
        if self.output.dir.as_os_str().is_empty() {
            return Err(Error::Config {
                field: "output.dir".into(),
                message: "is empty: name the folder the run writes its metrics, checkpoint and model to \
                          (e.g. \"runs/my-run\")"
                    .into(),
            });
        }
        if self.output.threads > MOST_PER_PROCESS {
            return Err(Error::Config {
                field: "output.threads".into(),
                message: format!("{}: at most {MOST_PER_PROCESS} (0: all cores)", self.output.threads),
            });
        }
        if self.data.eval_batch_size == Some(0) {
            return Err(Error::Config { field: "data.eval_batch_size".into(), message: "must be at least 1".into() });
        }
        if self.train.epochs == 0 {
            return Err(Error::Config {
                field: "train.epochs".into(),
                message: "must be at least 1 (train.max_steps ends a run sooner)".into(),
            });
        }
        self.train.validate()?;
        if !self.output.progress_every.is_finite() || self.output.progress_every < 0.0 {
            return Err(Error::Config {
                field: "output.progress_every".into(),
                message: format!("{}: expected seconds, finite and at least 0", self.output.progress_every),
            });
        }
        self.pipeline.resolve()?;
        // A micro-batch holds at least one sample, on every replica (each takes its share of
        // the batch); more of them than samples would only schedule empty work (and a
        // schedule's size grows with its square).
        let (m, r) = (self.pipeline.micro_batches, self.pipeline.replicas.max(1));
        if m.saturating_mul(r) > self.data.batch_size {
            let (field, per) = match r {
                1 => ("pipeline.micro_batches", String::new()),
                _ => ("pipeline.replicas", format!(" on each of {r} replicas")),
            };
            return Err(Error::Config {
                field: field.into(),
                message: format!(
                    "{}{per} of a batch of {} (data.batch_size): at most one per sample",
                    counted(m, "micro-batch"),
                    counted(self.data.batch_size, "sample")
                ),
            });
        }
        Ok(())
    }
}

/// Warnings for `[elastic]` settings that do nothing in `config` (read from `table`, the file
/// `file` with the command line's settings): a setting the command line wrote, or one the file
/// wrote that its own switches already leave unread. A file's setting that a command-line
/// switch turns off is not named: the ablations switch modules off over a config that sets
/// their options (`file_config`: the file alone, where it reads on its own).
fn inert_warnings(
    config: &RunConfig,
    file_config: Option<&RunConfig>,
    file: &toml::Table,
    table: &toml::Table,
) -> Vec<String> {
    let elastic = |t: &toml::Table| t.get("elastic").and_then(toml::Value::as_table).cloned().unwrap_or_default();
    let (in_file, now) = (elastic(file), elastic(table));
    let typed = |key: &str| now.get(key).is_some_and(|v| in_file.get(key) != Some(v));
    let mut warnings: Vec<String> = config.elastic.inert_settings(&typed).into_iter().map(|(_, w)| w).collect();
    let from_file = |key: &str| in_file.contains_key(key) && !typed(key);
    let unread_in_file: Vec<&str> =
        file_config.map_or(Vec::new(), |f| f.elastic.inert_settings(&from_file).into_iter().map(|(k, _)| k).collect());
    warnings.extend(
        config
            .elastic
            .inert_settings(&from_file)
            .into_iter()
            .filter(|(k, _)| unread_in_file.contains(k))
            .map(|(_, w)| w),
    );
    warnings
}

/// An optimizer table without its `kind` (`--set train.optimizer.beta1=0.5` over a config
/// that leaves the optimizer at its default) is of the default's kind, AdamW: its settings go
/// to it, and another kind's are named as such.
fn default_optimizer_kind(table: &mut toml::Table) {
    let optimizer = table.get_mut("train").and_then(|t| t.get_mut("optimizer")).and_then(toml::Value::as_table_mut);
    if let Some(optimizer) = optimizer.filter(|o| !o.contains_key("kind"))
        && let Ok(toml::Value::Table(default)) = toml::Value::try_from(crate::optim::OptimizerConfig::default())
        && let Some(kind) = default.get("kind")
    {
        optimizer.insert("kind".into(), kind.clone());
    }
}

/// serde's message for a setting of choices given a value that is not a string (`true`, `3`)
/// names neither the choices nor the quotes: the choices, as serde names them for a string
/// that is none of them, with `key` set to one in `table`.
/// The field of `model.config` a type error is in, and the error: serde reports it for the
/// table as a whole (the family's tag buffers the table and loses the path), so the table is
/// read again as its family's own struct. `None` where that finds no field to name.
fn model_config_field(table: &toml::Table) -> Option<(String, String)> {
    use crate::model::{BertConfig, GptConfig, VitConfig};
    let mut fields = table.get("model")?.get("config")?.as_table()?.clone();
    let family = fields.remove("family")?;
    let value = toml::Value::Table(fields);
    let e = match family.as_str()? {
        "bert" => value.try_into::<BertConfig>().err(),
        "gpt" => value.try_into::<GptConfig>().err(),
        "vit" => value.try_into::<VitConfig>().err(),
        _ => None,
    }?
    .to_string();
    let e = in_words(e.trim_end());
    let (message, key) = e.rsplit_once("\nin `")?;
    Some((format!("model.config.{}", key.strip_suffix('`')?), message.to_string()))
}

/// Serde's message with the Rust types it names said as a config's reader knows them: `usize`
/// as a whole number, `f64` as a number, a struct as a table.
fn in_words(message: &str) -> String {
    let mut out = message.to_string();
    for (rust, words) in [
        ("expected usize", "expected a whole number, 0 or more"),
        ("expected u64", "expected a whole number, 0 or more"),
        ("expected u32", "expected a whole number, 0 or more"),
        ("expected u16", "expected a whole number, 0 or more"),
        ("expected u8", "expected a whole number, 0 or more"),
        ("expected i64", "expected a whole number"),
        ("expected f64", "expected a number"),
        ("expected f32", "expected a number"),
    ] {
        out = out.replace(rust, words);
    }
    match out.find("expected struct ") {
        Some(at) => {
            let end = out[at + 16..].find(|c: char| !c.is_alphanumeric()).map_or(out.len(), |n| at + 16 + n);
            out.replace_range(at..end, "expected a table");
            out
        }
        None => out,
    }
}

fn name_the_choices(
    message: &str,
    table: &toml::Table,
    key: &str,
    convert: &dyn Fn(&toml::Table) -> std::result::Result<RunConfig, String>,
) -> String {
    if message != "invalid type: unit variant, expected string only" {
        return message.into();
    }
    let mut t = table.clone();
    let probe = apply_override(&mut t, &format!("{key}=\"?\"")).ok().and_then(|()| convert(&t).err());
    // Only serde's refusal of that string names the choices (`key` may be a table's, as in
    // `--set pipeline={schedule=true}`, whose probe is refused otherwise).
    let choices = probe.as_deref().and_then(|e| e.strip_prefix("unknown variant `?`, expected "));
    match choices.map(|c| c.lines().next().unwrap_or(c)) {
        Some(choices) => format!("expected a string, {choices}"),
        None => message.into(),
    }
}

/// Sets `a.b.c = value` in `table`. The key's sections must exist in the schema; the value is
/// parsed as TOML (`3`, `1e-4`, `true`, `"text"`, `[1, 2]`) and otherwise taken as a string;
/// a bare `none` removes the key, so an optional setting goes back to unset (its default).
fn apply_override(table: &mut toml::Table, assignment: &str) -> Result<()> {
    let (key, value) = assignment
        .split_once('=')
        .ok_or_else(|| set_error(format!("`{assignment}`: expected key=value, e.g. train.lr=3e-5")))?;
    let key = key.trim();
    let parts: Vec<&str> = key.split('.').collect();
    if parts.iter().any(|p| p.is_empty()) {
        return Err(set_error(format!("`{assignment}`: `{key}` is not a dotted key")));
    }
    let value: toml::Value = match format!("v = {}", value.trim()).parse::<toml::Table>() {
        Ok(mut t) => t.remove("v").unwrap_or_else(|| toml::Value::String(value.trim().into())),
        // A whole number TOML cannot hold would otherwise read as text, and be refused as the
        // wrong type.
        Err(_) if is_too_large_integer(value.trim()) => {
            return Err(set_error(format!(
                "`{assignment}`: {} is beyond a TOML integer's range ({} to {})",
                value.trim(),
                i64::MIN,
                i64::MAX
            )));
        }
        Err(_) if is_too_large_float(value.trim()) => {
            return Err(set_error(format!(
                "`{assignment}`: {} is beyond a 64-bit float's range (magnitudes up to about 1.8e308)",
                value.trim()
            )));
        }
        Err(_) => toml::Value::String(value.trim().into()),
    };
    let mut node = table;
    for part in &parts[..parts.len() - 1] {
        node = node
            .entry(part.to_string())
            .or_insert_with(|| toml::Value::Table(Default::default()))
            .as_table_mut()
            .ok_or_else(|| set_error(format!("`{key}`: `{part}` is a value, not a section")))?;
    }
    let last = parts[parts.len() - 1].to_string();
    match value {
        toml::Value::String(v) if v == "none" && !value_is_quoted(assignment) => drop(node.remove(&last)),
        value => drop(node.insert(last, value)),
    }
    Ok(())
}

/// Whether `text` is a number written in digits (`1e999`, not `inf`) too large for a 64-bit float.
fn is_too_large_float(text: &str) -> bool {
    let digits = text.chars().all(|c| c.is_ascii_digit() || "+-._eE".contains(c));
    digits && text.replace('_', "").parse::<f64>().is_ok_and(f64::is_infinite)
}

/// Whether `text` is a whole number (a sign before, `_` between digits) too large for TOML's
/// 64-bit integers.
fn is_too_large_integer(text: &str) -> bool {
    let digits = text.strip_prefix(['+', '-']).unwrap_or(text).replace('_', "");
    let whole = !digits.is_empty() && digits.chars().all(|c| c.is_ascii_digit()) && !digits.starts_with('0');
    whole && digits.parse::<i64>().is_err()
}

/// Whether the value of `key=value` is written in quotes (`"none"` is the text, `none` unset).
fn value_is_quoted(assignment: &str) -> bool {
    assignment.split_once('=').is_some_and(|(_, v)| v.trim().starts_with(['"', '\'']))
}

#[cfg(test)]
mod tests {
    use super::*;

    const BASE: &str = r#"
[model]
pretrained = "weights/all-minilm-l6-v2"
pooling = "mean"
[data]
dataset = "rotten_tomatoes"
batch_size = 32
[train]
epochs = 1
lr = 5e-5
[output]
dir = "runs/x"
"#;

    #[test]
    fn parses_and_applies_overrides() {
        let c = RunConfig::parse(
            BASE,
            "base",
            &["train.lr=1e-4".into(), "data.max_len=64".into(), "output.dir=runs/y".into()],
        )
        .unwrap();
        assert_eq!(c.train.lr, 1e-4);
        assert_eq!(c.data.max_len, 64);
        assert_eq!(c.output.dir, PathBuf::from("runs/y"));
        assert_eq!(c.data.dataset, DatasetName::RottenTomatoes);
        for name in ["rotten_tomatoes", "reuters_r8", "fashion_mnist", "mnist5k", "digits", "hamlet"] {
            let c = RunConfig::parse(BASE, "base", &[format!("data.dataset=\"{name}\"")]).unwrap();
            assert_eq!(c.data.dataset.key(), name);
        }
    }

    /// A setting its switch leaves unread is named for a warning (a cache size with the cache
    /// off, α under a table, freed devices without AutoDP) when the command line wrote it, or
    /// when the file wrote it beside its own switch turned off; a file's setting that a
    /// command-line switch turns off is not (the ablations do that), nor a default, a switch
    /// given as off, or a setting that is read. The shipped configs warn of nothing, alone or
    /// under the ablation rows' switches.
    #[test]
    fn settings_left_without_effect_are_named() {
        let warned = |file: &str, sets: &[&str]| {
            let sets: Vec<String> = sets.iter().map(|s| s.to_string()).collect();
            RunConfig::parse(file, "base", &sets).unwrap().warnings
        };
        assert!(warned(BASE, &[]).is_empty());
        assert!(warned(BASE, &["elastic.cache=false", "elastic.auto_dp=false", "elastic.freeze=\"off\""]).is_empty());
        let w = warned(
            BASE,
            &["elastic.cache_bytes=1000", "elastic.freed_devices=\"threads\"", "elastic.time_pipeline_len=false"],
        );
        assert_eq!(w.len(), 3, "{w:?}");
        assert!(w[0].contains("elastic.time_pipeline_len") && w[0].contains("elastic.auto_pipe is off"), "{w:?}");
        assert!(w[1].contains("elastic.freed_devices") && w[1].contains("elastic.auto_dp is off"), "{w:?}");
        assert!(w[2].contains("elastic.cache_bytes") && w[2].contains("elastic.cache is off"), "{w:?}");
        let on = ["elastic.freeze=\"eq1\"", "elastic.auto_pipe=true", "elastic.cache=true", "elastic.cache_bytes=1000"];
        assert!(warned(BASE, &on).is_empty(), "{:?}", warned(BASE, &on));
        let table = warned(BASE, &["elastic.freeze=\"table\"", "elastic.table=[0, 1]", "elastic.alpha=0.2"]);
        assert_eq!(table.len(), 1, "{table:?}");
        assert!(table[0].starts_with("elastic.alpha is set, but elastic.freeze is table"), "{table:?}");
        // An embedding kept frozen: with pretrained weights, nothing to say; at its random
        // initialisation (a model trained from scratch), named.
        assert!(warned(BASE, &["train.freeze_embeddings=true"]).is_empty());
        let scratch = concat!(env!("CARGO_MANIFEST_DIR"), "/configs/vit-digits.toml");
        let frozen = RunConfig::load(Path::new(scratch), &["train.freeze_embeddings=true".into()]).unwrap().warnings;
        assert!(frozen.len() == 1 && frozen[0].contains("model.pretrained is not set"), "{frozen:?}");
        // The file itself sets a cache size beside the cache off: named without a flag.
        let file = format!("{BASE}[elastic]\ncache = false\ncache_bytes = 1000\nalpha = 0.2\n");
        assert_eq!(warned(&file, &[]).len(), 2, "{:?}", warned(&file, &[]));
        // A flag switching the cache on makes the file's size read: nothing to name about it.
        let cached = warned(&file, &["elastic.freeze=\"eq1\"", "elastic.auto_pipe=true", "elastic.cache=true"]);
        assert!(cached.is_empty(), "{cached:?}");
        let main_job = concat!(env!("CARGO_MANIFEST_DIR"), "/configs/minilm-rt.toml");
        let ablations: [&[&str]; 4] = [
            &["elastic.freeze=\"off\"", "elastic.auto_pipe=false", "elastic.auto_dp=false", "elastic.cache=false"],
            &["elastic.auto_pipe=false", "elastic.auto_dp=false", "elastic.cache=false"],
            &["elastic.auto_dp=false", "elastic.cache=false"],
            &["elastic.freeze=\"table\"", "elastic.table=[0, 1]"],
        ];
        for sets in ablations {
            let sets: Vec<String> = sets.iter().map(|s| s.to_string()).collect();
            let w = RunConfig::load(Path::new(main_job), &sets).unwrap().warnings;
            assert!(w.is_empty(), "{sets:?}: {w:?}");
        }
        for path in std::fs::read_dir(concat!(env!("CARGO_MANIFEST_DIR"), "/configs")).unwrap() {
            let path = path.unwrap().path();
            let config = RunConfig::load(&path, &[]).unwrap();
            assert!(config.warnings.is_empty(), "{}: {:?}", path.display(), config.warnings);
        }
    }

    /// Devices that no replica or stage ever uses, and more threads than cores, are named; the
    /// devices AutoDP will put to work, and threads up to the cores, are not.
    #[test]
    fn devices_and_threads_left_idle_are_named() {
        let warned = |sets: &[&str]| {
            let sets: Vec<String> = sets.iter().map(|s| s.to_string()).collect();
            RunConfig::parse(BASE, "base", &sets).unwrap().warnings
        };
        let idle = warned(&["pipeline.devices=4", "pipeline.pipeline_len=2"]);
        assert!(idle.len() == 1 && idle[0].contains("2 devices stay idle"), "{idle:?}");
        assert!(warned(&["pipeline.devices=4", "pipeline.pipeline_len=2", "pipeline.replicas=2"]).is_empty());
        let autodp =
            ["pipeline.devices=4", "pipeline.pipeline_len=2", "elastic.freeze=\"eq1\"", "elastic.auto_dp=true"];
        assert!(warned(&autodp).is_empty(), "{:?}", warned(&autodp));
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        assert!(warned(&[&format!("output.threads={cores}")]).is_empty());
        let over = warned(&[&format!("output.threads={}", cores + 1)]);
        assert!(over.len() == 1 && over[0].contains(&format!("this machine has {cores} cores")), "{over:?}");
    }

    /// Token slices on a GPT's pipeline of one stage are warned of (a stage's slices have no
    /// other stage to overlap with); on two stages, with recomputation (slices then hold less
    /// at once), as `auto`, or as one slice, they are not.
    #[test]
    fn token_slices_on_one_stage_are_warned_of() {
        let gpt = BASE
            .replace(
                "pretrained = \"weights/all-minilm-l6-v2\"",
                "config = { family = \"gpt\", vocab_size = 0, n_positions = 16, n_embd = 8, n_layer = 2, n_head = 2 }",
            )
            .replace("pooling = \"mean\"\n", "");
        let warned = |sets: &[&str]| {
            let sets: Vec<String> = sets.iter().map(|s| s.to_string()).collect();
            RunConfig::parse(&gpt, "gpt.toml", &sets).unwrap().warnings
        };
        for slices in ["2", "8,8"] {
            let one = warned(&[&format!("pipeline.token_slices=\"{slices}\"")]);
            let said = format!("pipeline.token_slices = \"{slices}\" on a pipeline of one stage");
            assert!(one.len() == 1 && one[0].starts_with(&said), "{one:?}");
            let two = [&format!("pipeline.token_slices=\"{slices}\"")[..], "pipeline.pipeline_len=2"];
            assert!(warned(&two).is_empty(), "{:?}", warned(&two));
            let recomputed = [&format!("pipeline.token_slices=\"{slices}\"")[..], "pipeline.recompute=\"all\""];
            assert!(warned(&recomputed).is_empty(), "{:?}", warned(&recomputed));
        }
        // (A BERT's run refuses slices of itself, warning or not.)
        let bert = RunConfig::parse(BASE, "base", &["pipeline.token_slices=\"2\"".into()]).unwrap().warnings;
        assert!(!bert.iter().any(|w| w.contains("token_slices")), "{bert:?}");
        for quiet in ["auto", "1", "off"] {
            let sets = [format!("pipeline.token_slices=\"{quiet}\"")];
            assert!(warned(&[&sets[0]]).is_empty(), "{quiet}: {:?}", warned(&[&sets[0]]));
        }
    }

    /// The layers below name a setting by their own struct's field; a run names it by the key
    /// its config writes, and an inline model's settings (not a pretrained folder's) are
    /// `model.config`'s.
    #[test]
    fn settings_refused_below_are_named_as_the_config_writes_them() {
        let named = |field: &str, inline: bool| match named_as_written(config_error(field, "m"), inline) {
            Error::Config { field, message } => {
                assert_eq!(message, "m");
                field
            }
            e => panic!("{e}"),
        };
        assert_eq!(named("chunks", false), "pipeline.chunks");
        assert_eq!(named("memory_limit", true), "pipeline.memory_limit");
        assert_eq!(named("terapipe.memory_limit", true), "pipeline.memory_limit");
        assert_eq!(named("vit.hidden_dropout_prob", true), "model.config.hidden_dropout_prob");
        assert_eq!(named("bert.hidden_act", false), "bert.hidden_act");
        assert_eq!(named("elastic.alpha", true), "elastic.alpha");
        let data = named_as_written(Error::Data { what: "chunks".into(), message: "m".into() }, true);
        assert!(matches!(data, Error::Data { what, .. } if what == "chunks"));
        // A flag is called one, a key a config field.
        assert_eq!(config_error("--set", "m").to_string(), "flag `--set`: m");
        assert_eq!(config_error("data.max_len", "m").to_string(), "config field `data.max_len`: m");
    }

    #[test]
    fn unknown_keys_are_errors_naming_the_key() {
        let err = RunConfig::parse(BASE, "base", &["train.learning_rate=1e-4".into()]).unwrap_err().to_string();
        assert!(err.contains("learning_rate"), "{err}");
        let err = RunConfig::parse(&BASE.replace("batch_size", "batchsize"), "file.toml", &[]).unwrap_err().to_string();
        assert!(err.contains("batchsize") && err.contains("file.toml"), "{err}");
        // A precision that is not one of the three names the key and the choices.
        let err = RunConfig::parse(BASE, "base", &["output.precision=fp16".into()]).unwrap_err().to_string();
        assert!(err.contains("--set output.precision") && err.contains("`f32`, `bf16`, `auto`"), "{err}");
        // AutoPipe's trial is a switch: anything but true or false names the key.
        let err = RunConfig::parse(BASE, "base", &["elastic.time_pipeline_len=3".into()]).unwrap_err().to_string();
        assert!(err.contains("--set elastic.time_pipeline_len") && err.contains("bool"), "{err}");
        // So is the frozen embedding, from a flag or from the file.
        let err = RunConfig::parse(BASE, "base", &["train.freeze_embeddings=maybe".into()]).unwrap_err().to_string();
        assert!(err.contains("--set train.freeze_embeddings") && err.contains("boolean"), "{err}");
        let file = BASE.replace("[train]\n", "[train]\nfreeze_embeddings = 1\n");
        let err = RunConfig::parse(&file, "file.toml", &[]).unwrap_err().to_string();
        assert!(err.contains("freeze_embeddings") && err.contains("file.toml"), "{err}");
        // A value of the wrong type in the file names its key, with the file.
        let file = BASE.replace("batch_size = 32", "batch_size = \"many\"");
        let err = RunConfig::parse(&file, "file.toml", &[]).unwrap_err().to_string();
        assert!(
            err.starts_with("config field `data.batch_size`: invalid type") && err.ends_with("(in file.toml)"),
            "{err}"
        );
        // (A table given whole keeps serde's message: the choices belong to a key inside it.)
        let err = RunConfig::parse(BASE, "base", &["pipeline={schedule=true}".into()]).unwrap_err().to_string();
        assert!(err.contains("--set pipeline") && !err.contains("struct"), "{err}");
        // A setting of choices given no string is refused with the choices' names.
        let file = format!("{BASE}[pipeline]\nschedule = true\n");
        let err = RunConfig::parse(&file, "file.toml", &[]).unwrap_err().to_string();
        let want = "config field `pipeline.schedule`: expected a string, one of `gpipe`, `1f1b`";
        assert!(err.starts_with(want) && err.ends_with("(in file.toml)"), "{err}");
        // Byte counts take units in the file and in --set alike.
        let c = RunConfig::parse(
            BASE,
            "base",
            &["pipeline.memory_limit=\"2GiB\"".into(), "elastic.cache_bytes=64MiB".into()],
        )
        .unwrap();
        assert_eq!((c.pipeline.memory_limit, c.elastic.cache_bytes), (Some(2 << 30), 64 << 20));
        // A value of the wrong type names its key, not the file.
        let err = RunConfig::parse(BASE, "base", &["train.lr=1e-4".into(), "train.eval_every=-1".into()])
            .unwrap_err()
            .to_string();
        assert!(err.contains("--set train.eval_every") && err.contains("expected a whole number, 0 or more"), "{err}");
        let err = RunConfig::parse(BASE, "base", &["data=1".into()]).unwrap_err().to_string();
        assert!(err.contains("expected a table") && !err.contains("DataSection"), "{err}");
        // An optimizer setting over the default optimizer goes to it (AdamW).
        let c = RunConfig::parse(BASE, "base", &["train.optimizer.beta1=0.5".into()]).unwrap();
        let crate::optim::OptimizerConfig::AdamW { beta1, beta2, .. } = c.train.optimizer else { panic!("not AdamW") };
        assert_eq!((beta1, beta2), (0.5, 0.999));
        let err = RunConfig::parse(BASE, "base", &["train.optimizer.momentum=0.5".into()]).unwrap_err().to_string();
        assert!(err.contains("a setting of kind \"sgd\"") && err.contains("{ kind = \"sgd\" }"), "{err}");
        // A final rate under a constant rate is named as having no effect.
        let c =
            RunConfig::parse(BASE, "base", &["train.decay=\"constant\"".into(), "train.min_lr=1e-5".into()]).unwrap();
        assert!(c.warnings.iter().any(|w| w.starts_with("train.min_lr = 0.00001 has no effect")), "{:?}", c.warnings);
        let c = RunConfig::parse(BASE, "f", &["train.early_stopping_min_delta=0.01".into()]).unwrap();
        assert!(c.warnings.iter().any(|w| w.starts_with("train.early_stopping_min_delta = 0.01 has no effect")));
        let images = BASE.replace("rotten_tomatoes", "digits");
        let c = RunConfig::parse(&images, "f", &["data.max_len=32".into()]).unwrap();
        assert!(
            c.warnings.iter().any(|w| w.starts_with("data.max_len = 32 has no effect: digits is")),
            "{:?}",
            c.warnings
        );
        let unset = RunConfig::parse(&images, "f", &[]).unwrap();
        assert!(!unset.warnings.iter().any(|w| w.contains("max_len")), "{:?}", unset.warnings);
        // A test fraction where the dataset has its own held-out set is named, and left out of
        // the settings a run records of its data; where the fraction cuts the split, neither.
        let fraction = |dataset: &str| {
            let sets = [format!("data.dataset=\"{dataset}\""), "data.test_fraction=0.3".into()];
            let c = RunConfig::parse(BASE, "base", &sets).unwrap();
            let warned = c.warnings.iter().any(|w| w.starts_with("data.test_fraction = 0.3 has no effect"));
            (warned, crate::run::fingerprint::data_settings(&c).get("data.test_fraction").is_some())
        };
        assert_eq!(fraction("hamlet"), (true, false));
        assert_eq!(fraction("fashion_mnist"), (true, false));
        assert_eq!(fraction("digits"), (false, true));
        // A file's fraction made inert by a `--set` of the dataset is not named; one its own
        // dataset leaves unread is.
        let file = BASE.replace("batch_size = 32", "batch_size = 32\ntest_fraction = 0.25");
        let warned = |file: &str, sets: &[String]| {
            let c = RunConfig::parse(file, "f", sets).unwrap();
            c.warnings.iter().any(|w| w.starts_with("data.test_fraction = 0.25 has no effect"))
        };
        assert!(!warned(&file, &["data.dataset=\"hamlet\"".into()]));
        assert!(warned(&file.replace("rotten_tomatoes", "hamlet"), &[]));
        // Recomputing `auto` without a memory limit, and a freeze rule that cannot run before
        // the run's end, are named; with a limit, or a shorter interval, they are not.
        let warned = |sets: &[&str], start: &str| {
            let sets: Vec<String> = sets.iter().map(|s| s.to_string()).collect();
            RunConfig::parse(BASE, "base", &sets).unwrap().warnings.iter().any(|w| w.starts_with(start))
        };
        let auto = "pipeline.recompute = \"auto\" recomputes only where pipeline.memory_limit needs it";
        assert!(warned(&["pipeline.recompute=\"auto\""], auto));
        assert!(!warned(&["pipeline.recompute=\"auto\"", "pipeline.memory_limit=\"1GiB\""], auto));
        let freeze = ["elastic.freeze=\"eq1\"", "train.max_steps=12"];
        let long = "elastic.freeze_interval = 12 steps is as long as the run (train.max_steps = 12): the freeze rule \
                    runs only after the last step";
        assert!(warned(&[&freeze[..], &["elastic.freeze_interval=12"]].concat(), long));
        let longer = "elastic.freeze_interval = 13 steps is longer than the run (train.max_steps = 12): the freeze \
                      rule never runs";
        assert!(warned(&[&freeze[..], &["elastic.freeze_interval=13"]].concat(), longer));
        assert!(!warned(&[&freeze[..], &["elastic.freeze_interval=11"]].concat(), "elastic.freeze_interval"));
        let table =
            ["elastic.freeze=\"table\"", "elastic.table=[1, 2]", "train.max_steps=4", "elastic.freeze_interval=4"];
        assert!(warned(
            &table,
            "elastic.freeze_interval = 4 steps is as long as the run (train.max_steps = 4): the rule \
                                runs only after the last step: only the table's first entry applies"
        ));
        // A whole number beyond TOML's integers is named as such, not as text of the wrong
        // type (so is a float beyond f64's, where `inf`, which TOML reads, is left to the
        // setting's check); a bare `none` on a setting without a default says so.
        let err =
            RunConfig::parse(BASE, "base", &["train.epochs=18446744073709551615".into()]).unwrap_err().to_string();
        assert!(err.contains("18446744073709551615 is beyond a TOML integer's range"), "{err}");
        let err = RunConfig::parse(BASE, "base", &["train.lr=1e999".into()]).unwrap_err().to_string();
        assert!(err.contains("1e999 is beyond a 64-bit float's range"), "{err}");
        let err = RunConfig::parse(BASE, "base", &["train.lr=inf".into()]).unwrap_err().to_string();
        assert!(!err.contains("beyond") && err.contains("train.lr"), "{err}");
        let err = RunConfig::parse(BASE, "base", &["train.epochs=007".into()]).unwrap_err().to_string();
        assert!(!err.contains("beyond") && err.contains("--set train.epochs"), "{err}");
        let err = RunConfig::parse(BASE, "base", &["data.batch_size=none".into()]).unwrap_err().to_string();
        assert!(
            err.contains("--set data.batch_size") && err.contains("which has no default: give it a value"),
            "{err}"
        );
        // A bare `none` unsets an optional setting that the file set.
        let mut table: toml::Table = "[pipeline]\nmemory_limit = 5\n".parse().unwrap();
        apply_override(&mut table, "pipeline.memory_limit=none").unwrap();
        assert!(table["pipeline"].as_table().unwrap().get("memory_limit").is_none());
        apply_override(&mut table, "pipeline.memory_limit=\"none\"").unwrap();
        assert_eq!(table["pipeline"]["memory_limit"].as_str(), Some("none"), "quoted, it is text");
        let err = RunConfig::parse(BASE, "base", &["nokey".into()]).unwrap_err().to_string();
        assert!(err.contains("expected key=value"), "{err}");
        let err = RunConfig::parse(BASE, "base", &["data.dataset=imagenet".into()]).unwrap_err().to_string();
        assert!(err.contains("imagenet"), "{err}");
        let err =
            RunConfig::parse(&BASE.replace("rotten_tomatoes", "digits"), "f", &["data.group_by_length=true".into()])
                .unwrap_err()
                .to_string();
        assert!(err.contains("data.group_by_length") && err.contains("text datasets"), "{err}");
        assert!(RunConfig::parse(BASE, "f", &["data.group_by_length=true".into()]).unwrap().data.group_by_length);
        let err = RunConfig::parse(BASE, "base", &["data.batch_size=0".into()]).unwrap_err().to_string();
        assert!(err.contains("data.batch_size"), "{err}");
        for bad in ["1.0", "-0.1"] {
            let err = RunConfig::parse(BASE, "base", &[format!("data.validation_fraction={bad}")]).unwrap_err();
            assert!(
                err.to_string().contains("data.validation_fraction") && err.to_string().contains("[0, 1)"),
                "{err}"
            );
        }
        let err =
            RunConfig::parse(&BASE.replace("rotten_tomatoes", "hamlet"), "f", &["data.validation_fraction=0.1".into()])
                .unwrap_err()
                .to_string();
        assert!(err.contains("data.validation_fraction") && err.contains("hamlet"), "{err}");
    }

    /// Model selection: a metric by name, chosen on a validation split (a corpus's held-out
    /// text), patience only with a metric to watch, a minimum gain that is a gain.
    #[test]
    fn keeping_the_best_needs_a_validation_split_and_a_metric() {
        let parse = |base: &str, sets: &[&str]| {
            RunConfig::parse(base, "f", &sets.iter().map(|s| s.to_string()).collect::<Vec<_>>())
                .map_err(|e| e.to_string())
        };
        let val = "data.validation_fraction=0.1";
        let kept = parse(BASE, &[val, "train.keep_best=\"macro_f1\"", "train.early_stopping_patience=3"]).unwrap();
        assert_eq!((kept.train.keep_best, kept.train.early_stopping_patience), (KeepBest::MacroF1, 3));
        let err = parse(BASE, &[val, "train.keep_best=\"f1\""]).unwrap_err();
        assert!(err.contains("train.keep_best") && err.contains("macro_f1"), "{err}");
        let err = parse(BASE, &["train.keep_best=\"accuracy\""]).unwrap_err();
        assert!(err.contains("train.keep_best") && err.contains("data.validation_fraction"), "{err}");
        let err = parse(BASE, &[val, "train.early_stopping_patience=2"]).unwrap_err();
        assert!(err.contains("train.early_stopping_patience") && err.contains("keep_best is off"), "{err}");
        for bad in ["-0.01", "nan"] {
            let err = parse(BASE, &[val, "train.keep_best=\"loss\"", &format!("train.early_stopping_min_delta={bad}")])
                .unwrap_err();
            assert!(err.contains("train.early_stopping_min_delta") && err.contains("at least 0"), "{err}");
        }
        // A corpus evaluates on its held-out text: loss or accuracy, not a classifier's F1.
        let hamlet = BASE.replace("rotten_tomatoes", "hamlet");
        assert!(parse(&hamlet, &["train.keep_best=\"loss\""]).is_ok());
        let err = parse(&hamlet, &["train.keep_best=\"macro_f1\""]).unwrap_err();
        assert!(err.contains("train.keep_best") && err.contains("hamlet"), "{err}");
    }

    /// A dataset of the user's files needs `data.train_file` (not standard input, which a run
    /// reads more than once); a built-in dataset refuses one, naming the datasets that read it;
    /// a `test_file` leaves `test_fraction` without effect, named so.
    #[test]
    fn a_users_files_are_set_for_the_datasets_that_read_them() {
        let parse =
            |sets: &[&str]| RunConfig::parse(BASE, "f", &sets.iter().map(|s| s.to_string()).collect::<Vec<_>>());
        let err = |sets: &[&str]| parse(sets).unwrap_err().to_string();
        for dataset in ["labelled_texts", "text_corpus"] {
            let e = err(&[&format!("data.dataset=\"{dataset}\"")]);
            assert!(e.starts_with("config field `data.train_file`: is not set;") && e.contains(dataset), "{e}");
        }
        let e = err(&["data.train_file=\"mine.tsv\""]);
        assert!(
            e.contains("data.train_file`: is mine.tsv, but rotten_tomatoes is a dataset scripts/setup.sh installs"),
            "{e}"
        );
        assert!(e.contains("dataset = \"labelled_texts\""), "{e}");
        let e = err(&["data.dataset=\"labelled_texts\"", "data.train_file=\"a.tsv\"", "data.test_file=\"-\""]);
        assert!(e.contains("data.test_file`: is `-`, standard input"), "{e}");
        let e = err(&["data.dataset=\"text_corpus\"", "data.train_file=\"a.txt\"", "data.validation_fraction=0.1"]);
        assert!(e.contains("data.validation_fraction") && e.contains("text_corpus's held-out text"), "{e}");

        let texts = ["data.dataset=\"labelled_texts\"", "data.train_file=\"a.tsv\"", "data.test_fraction=0.3"];
        let c = parse(&texts).unwrap();
        assert!(c.data.cut_by_seed() && c.warnings.is_empty(), "{:?}", c.warnings);
        // `data.pixel_max` belongs to the user's images.
        let e = err(&["data.pixel_max=16"]);
        assert!(e.contains("data.pixel_max`: is 16, but applies to dataset = \"labelled_images\""), "{e}");
        let images = ["data.dataset=\"labelled_images\"", "data.train_file=\"a.csv\""];
        assert_eq!(parse(&[&images[..], &["data.pixel_max=16"]].concat()).unwrap().data.pixel_max, Some(16));
        let e = err(&[&images[..], &["data.pixel_max=0"]].concat());
        assert!(e.contains("data.pixel_max`: is 0"), "{e}");
        // ...and so does `data.channels`.
        let e = err(&["data.channels=3"]);
        assert!(e.contains("data.channels`: is 3, but applies to dataset = \"labelled_images\""), "{e}");
        let c = parse(&images).unwrap();
        assert_eq!((c.data.user_channels(), c.data.user_pixel_max()), (Some(1), Some(255)));
        assert_eq!(parse(&[&images[..], &["data.channels=3"]].concat()).unwrap().data.user_channels(), Some(3));
        // Augmentation is for images.
        let e = err(&["data.random_flip=true"]);
        assert!(e.contains("data.random_flip`: is set, but rotten_tomatoes is no dataset of images"), "{e}");
        let e = err(&[&images[..], &["data.random_crop=0"]].concat());
        assert!(e.contains("data.random_crop`: is 0"), "{e}");
        let c = parse(&[&images[..], &["data.random_crop=2", "data.random_flip=true"]].concat()).unwrap();
        assert_eq!(c.data.image_augment(), crate::data::ImageAugment { flip: true, crop_padding: 2 });
        // ...and so does `data.resize_to`.
        let e = err(&["data.resize_to=8"]);
        assert!(e.contains("data.resize_to`: is 8, but applies to dataset = \"labelled_images\""), "{e}");
        assert_eq!(parse(&[&images[..], &["data.resize_to=8"]].concat()).unwrap().data.resize_to, Some(8));
        for side in ["0", "100000"] {
            let e = err(&[&images[..], &[&format!("data.resize_to={side}")]].concat());
            assert!(e.contains(&format!("data.resize_to`: is {side}; expected the model's image_size")), "{e}");
        }
        let e = err(&[&images[..], &["data.channels=0"]].concat());
        assert!(e.contains("data.channels`: is 0; expected the colour channels per pixel"), "{e}");
        // ...also where both are written in the file.
        let file = BASE.replace(
            "dataset = \"rotten_tomatoes\"",
            "dataset = \"labelled_texts\"\ntrain_file = \"a.tsv\"\ntest_file = \"b.tsv\"\ntest_fraction = 0.3",
        );
        let c = RunConfig::parse(&file, "f", &[]).unwrap();
        assert!(c.warnings.iter().any(|w| w.starts_with("data.test_fraction = 0.3 has no effect: data.test_file")));
        let c = parse(&[&texts[..], &["data.test_file=\"b.tsv\""]].concat()).unwrap();
        assert!(!c.data.cut_by_seed());
        assert_eq!(
            c.warnings,
            ["data.test_fraction = 0.3 has no effect: data.test_file (b.tsv) is the held-out set \
                                 (--set data.test_fraction=none leaves it out)"]
        );
    }

    /// Sizes a config file can make overflow are errors (they panicked in debug builds and
    /// wrapped in release): epochs × batches in the schedule (found by fuzzing, src/fuzz;
    /// TOML integers stop at i64::MAX) and, found beside it, replicas × pipeline stages.
    #[test]
    fn overflowing_sizes_are_errors_not_panics() {
        let huge = ["pipeline.replicas=4294967296".into(), "pipeline.pipeline_len=4294967296".into()];
        let err = RunConfig::parse(BASE, "base", &huge).unwrap_err().to_string();
        assert!(err.contains("pipeline.replicas") && err.contains("more devices than can exist"), "{err}");
        let c = RunConfig::parse(BASE, "base", &["train.epochs=9223372036854775807".into()]).unwrap();
        assert_eq!(c.train.total_batches(1000), u64::MAX);
        c.train.lr_schedule(c.train.total_batches(1000)).unwrap();
    }

    /// Settings no run can use are refused by the key a config writes, before any data or
    /// weights are loaded: each of these reached a hang, a panic, a run that trained nothing,
    /// or clipping silently off.
    #[test]
    fn unusable_settings_are_refused_by_their_key() {
        for (set, key, says) in [
            ("pipeline.micro_batches=33", "pipeline.micro_batches", "at most one per sample"),
            ("pipeline.replicas=33", "pipeline.replicas", "1 micro-batch on each of 33 replicas"),
            ("train.epochs=0", "train.epochs", "at least 1"),
            ("train.max_grad_norm=-1.0", "train.max_grad_norm", "finite and at least 0"),
            ("train.max_grad_norm=nan", "train.max_grad_norm", "finite and at least 0"),
            ("train.max_grad_norm=inf", "train.max_grad_norm", "finite and at least 0"),
            ("train.lr=nan", "train.lr", "finite"),
            ("train.min_lr=1.0", "train.min_lr", "train.lr = 0.00005"),
            ("data.eval_batch_size=0", "data.eval_batch_size", "at least 1"),
            ("output.threads=1000000", "output.threads", "at most 4096"),
            ("pipeline.devices=1000000", "pipeline.devices", "at most 4096"),
            ("data.max_len=0", "data.max_len", "at least 1 token"),
            ("output.dir=\"\"", "output.dir", "is empty"),
        ] {
            let overrides: Vec<String> = [set.to_string()]
                .into_iter()
                .chain((set == "train.epochs=0").then(|| "train.max_steps=5".into()))
                .collect();
            let err = RunConfig::parse(BASE, "base", &overrides).unwrap_err();
            let Error::Config { field, message } = &err else { panic!("{set}: {err}") };
            assert!(field == key && message.contains(says), "{set}: {err}");
        }
        // Switching the optimizer's kind key by key leaves the other kind's settings behind:
        // named as such, with the way to switch.
        let switched =
            ["train.optimizer={ kind = \"adamw\", beta1 = 0.9 }".into(), "train.optimizer.kind=\"sgd\"".into()];
        let err = RunConfig::parse(BASE, "base", &switched).unwrap_err().to_string();
        assert!(
            err.contains("a setting of kind \"adamw\"") && err.contains("train.optimizer={ kind = \"sgd\" }"),
            "{err}"
        );
        let optimizer =
            "train.optimizer={ kind = \"adamw\", beta1 = 1.0, beta2 = 0.999, eps = 1e-8, weight_decay = 0.0 }";
        let err = RunConfig::parse(BASE, "base", &[optimizer.into()]).unwrap_err().to_string();
        assert!(err.contains("train.optimizer.beta1"), "{err}");
        // A section or key written twice names where it was first written.
        for (text, first) in [
            ("[data]\nbatch_size = 3\n[train]\nlr = 1e-3\n\n[ data ] # again\neval_batch_size = 4\n", 1),
            ("[data]\nbatch_size = 3\n[train]\nlr = 1e-3\nepochs = 2\nlr = 2e-3\n", 4),
        ] {
            let err = RunConfig::parse(text, "f.toml", &[]).unwrap_err().to_string();
            assert!(err.contains("duplicate key") && err.contains(&format!("first written at line {first}")), "{err}");
        }
        // A file that is not TOML is named with the parser's line and column, not as a field.
        let err = RunConfig::parse("[data\nbatch_size = 3\n", "f.toml", &[]).unwrap_err();
        let Error::Data { what, message } = &err else { panic!("{err}") };
        assert!(what == "f.toml" && message.contains("line 1"), "{err}");
        // A bad value in the file names its key (a converted table has no line to point at).
        let err = RunConfig::parse(&BASE.replace("batch_size = 32", "batch_size = -32"), "f.toml", &[]).unwrap_err();
        assert!(err.to_string().contains("data.batch_size"), "{err}");
        assert!(RunConfig::parse(BASE, "base", &["pipeline.micro_batches=32".into()]).is_ok());
        // A misspelt key inside the model's architecture or the optimizer is refused by its
        // path, not dropped for the default.
        let gpt = BASE.replace(
            "pretrained = \"weights/all-minilm-l6-v2\"",
            "config = { family = \"gpt\", vocab_size = 0, n_positions = 16, n_embd = 8, n_layer = 1, n_head = 2 }",
        );
        // A pooling beside an architecture that has none to choose is refused, not dropped.
        let err = RunConfig::parse(&gpt, "gpt.toml", &[]).unwrap_err().to_string();
        assert!(err.contains("model.pooling") && err.contains("builds a GPT"), "{err}");
        let gpt = gpt.replace("pooling = \"mean\"\n", "");
        assert!(RunConfig::parse(&gpt, "gpt.toml", &[]).is_ok());
        for (text, set, key) in [
            (gpt.replace("n_head = 2", "n_head = 2, embd_dropout = 0.1"), None, "model.config.embd_dropout"),
            (
                BASE.to_string(),
                Some("train.optimizer={ kind = \"adamw\", weight_deacy = 0.1 }"),
                "train.optimizer.weight_deacy",
            ),
        ] {
            let overrides: Vec<String> = set.into_iter().map(String::from).collect();
            let err = RunConfig::parse(&text, "f.toml", &overrides).unwrap_err().to_string();
            assert!(err.contains(&format!("unknown key `{key}`")), "{err}");
        }
        // A value of the wrong type inside it is named by its key too, not by the table.
        let wrong = gpt.replace("n_embd = 8", "n_embd = \"8\"");
        let err = RunConfig::parse(&wrong, "f.toml", &[]).unwrap_err().to_string();
        assert!(err.starts_with("config field `model.config.n_embd`: invalid type: string \"8\""), "{err}");
    }
}
