//! A configured training job: builds the data source and the model a [`RunConfig`] names,
//! trains with checkpoints, logs metrics as JSON lines, and writes a summary and the exported
//! model. The `train` command of the binary is this plus a progress bar.

use super::config::{DatasetName, RunConfig};
use super::source::{SampleSource, subset};
use crate::data::{self, ImageSample, LmSequence, TextSample};
use crate::device::Device;
use crate::error::{Error, Result};
use crate::model::{Family, Model, ModelConfig};
use crate::text::{TextInput, TextItem, TextTokenizer, text_batch};
use crate::train::{BatchSource, EvalMetrics, Event, Trainer};
use crate::weights::{self, LoadOptions, LoadReport};
use serde::Serialize;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Instant;

/// What the data turned out to be, for building the model and for the summary.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct DataInfo {
    /// Dataset name.
    pub name: String,
    /// Classes (classifiers) or vocabulary size (language models).
    pub classes: usize,
    /// Training samples.
    pub train: usize,
    /// Evaluation samples.
    pub test: usize,
}

/// Loads the dataset of `config` and wraps it as a batch source.
pub fn prepare_data(config: &RunConfig) -> Result<(Box<dyn BatchSource + Send + Sync>, DataInfo)> {
    let d = &config.data;
    let seed = config.train.seed;
    let eval_bs = d.eval_batch_size.unwrap_or(d.batch_size);
    let dir = &d.dir;
    let info =
        |name: &str, classes: usize, train: usize, test: usize| DataInfo { name: name.into(), classes, train, test };
    match d.dataset {
        DatasetName::RottenTomatoes | DatasetName::ReutersR8 => {
            let split = match d.dataset {
                DatasetName::RottenTomatoes => data::rotten_tomatoes(dir)?.split_stratified(d.test_fraction, seed)?,
                _ => data::reuters_r8(dir)?,
            };
            let classes = split.train.num_classes();
            let name = split.train.name().to_string();
            let tokenizer_path = tokenizer_path(config)?;
            let tokenizer = TextTokenizer::from_file(&tokenizer_path, d.max_len)?;
            let train = subset(split.train.samples().to_vec(), d.train_limit, seed);
            let test = subset(split.test.samples().to_vec(), d.test_limit, seed ^ 1);
            let (n_train, n_test) = (train.len(), test.len());
            let make = Box::new(move |s: &[&TextSample], offset: u64| {
                let items: Vec<TextItem> = s
                    .iter()
                    .map(|t| TextItem { id: t.id, input: TextInput::Single(&t.text), label: t.label })
                    .collect();
                Ok(text_batch(&tokenizer, &items, offset)?.host)
            });
            let source = SampleSource::new(train, test, seed, d.batch_size, eval_bs, make)?;
            Ok((Box::new(source), info(&name, classes, n_train, n_test)))
        }
        DatasetName::FashionMnist | DatasetName::Mnist5k | DatasetName::Digits => {
            let split = match d.dataset {
                DatasetName::FashionMnist => data::fashion_mnist(dir)?,
                DatasetName::Mnist5k => data::mnist5k(dir)?.split_stratified(d.test_fraction, seed)?,
                _ => data::digits(dir)?.split_stratified(d.test_fraction, seed)?,
            };
            let classes = split.train.num_classes();
            let name = split.train.name().to_string();
            let train = subset(split.train.samples().to_vec(), d.train_limit, seed);
            let test = subset(split.test.samples().to_vec(), d.test_limit, seed ^ 1);
            let (n_train, n_test) = (train.len(), test.len());
            let make = Box::new(|s: &[&ImageSample], offset: u64| data::image_batch(s, offset));
            let source = SampleSource::new(train, test, seed, d.batch_size, eval_bs, make)?;
            Ok((Box::new(source), info(&name, classes, n_train, n_test)))
        }
        DatasetName::Hamlet => {
            let corpus = data::hamlet(dir)?;
            let train = subset(corpus.train_sequences(d.max_len)?, d.train_limit, seed);
            let test = subset(corpus.held_out_sequences(d.max_len)?, d.test_limit, seed ^ 1);
            let (n_train, n_test) = (train.len(), test.len());
            let make = Box::new(|s: &[&LmSequence], offset: u64| data::lm_batch(s, offset));
            let source = SampleSource::new(train, test, seed, d.batch_size, eval_bs, make)?;
            Ok((Box::new(source), info("hamlet", corpus.vocab.len(), n_train, n_test)))
        }
    }
}

/// The tokenizer file of a text run: `tokenizer.json` in the pretrained model's directory.
fn tokenizer_path(config: &RunConfig) -> Result<PathBuf> {
    match &config.model.pretrained {
        Some(dir) => Ok(dir.join("tokenizer.json")),
        None => Err(Error::Config {
            field: "model.pretrained".into(),
            message: "text datasets need a pretrained model directory holding tokenizer.json".into(),
        }),
    }
}

/// Builds the model: a pretrained Hugging Face checkpoint with a new head sized for the data,
/// or an architecture from scratch (its label count or vocabulary set from the data).
pub fn build_model<D: Device>(
    dev: &D,
    config: &RunConfig,
    info: &DataInfo,
) -> Result<(Model<D>, ModelConfig, Option<LoadReport>)> {
    let m = &config.model;
    match (&m.pretrained, &m.config) {
        (Some(dir), _) => {
            let mut model_config = weights::read_hf_config(dir.join(weights::CONFIG_FILE), None)?;
            match &mut model_config {
                ModelConfig::Bert(c) => {
                    c.num_labels = info.classes;
                    if let Some(p) = m.pooling {
                        c.pooling = p;
                    }
                }
                ModelConfig::Vit(c) => c.num_labels = info.classes,
                ModelConfig::Gpt(_) => {}
            }
            let mut model = Model::new(dev, &model_config, m.seed)?;
            let file = weights::load_safetensors(dir.join(weights::WEIGHTS_FILE))?;
            let report = weights::load_into_model(&mut model, dev, &file, &LoadOptions::default())?;
            Ok((model, model_config, Some(report)))
        }
        (None, Some(c)) => {
            let mut model_config = c.clone();
            match &mut model_config {
                ModelConfig::Bert(c) => c.num_labels = info.classes,
                ModelConfig::Vit(c) => c.num_labels = info.classes,
                ModelConfig::Gpt(c) => c.vocab_size = info.classes,
            }
            let model = Model::new(dev, &model_config, m.seed)?;
            Ok((model, model_config, None))
        }
        (None, None) => Err(Error::Config { field: "model".into(), message: "set `pretrained` or `config`".into() }),
    }
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
    /// Wall-clock seconds of this process's training.
    pub seconds: f64,
    /// Training samples per second in this process.
    pub samples_per_second: f64,
    /// Final evaluation.
    pub eval: Option<EvalMetrics>,
    /// For language models: the held-out loss of predicting each character by its training
    /// frequency alone (the unigram baseline the model must beat).
    pub unigram_baseline_loss: Option<f64>,
}

/// A run: its config, data, trainer and output paths.
pub struct Job<D: Device> {
    /// The configuration.
    pub config: RunConfig,
    /// Batches.
    pub source: Box<dyn BatchSource + Send + Sync>,
    /// What the data is.
    pub info: DataInfo,
    /// The model's configuration (exported next to the weights).
    pub model_config: ModelConfig,
    /// Model, optimizer and position.
    pub trainer: Trainer<D>,
    /// What loading pretrained weights found, if any were loaded.
    pub load_report: Option<LoadReport>,
}

impl<D: Device> Job<D> {
    /// Loads data and builds the model and trainer for `config`.
    pub fn new(dev: &D, config: RunConfig) -> Result<Self> {
        let (source, info) = prepare_data(&config)?;
        let (model, model_config, load_report) = build_model(dev, &config, &info)?;
        let trainer = Trainer::new(model, config.train.clone(), source.batches_per_epoch())?;
        Ok(Self { config, source, info, model_config, trainer, load_report })
    }

    /// The checkpoint file of this run.
    pub fn checkpoint_path(&self) -> PathBuf {
        self.config.output.dir.join("checkpoint.ckpt")
    }

    /// The metrics log (JSON lines) of this run.
    pub fn metrics_path(&self) -> PathBuf {
        self.config.output.dir.join("metrics.jsonl")
    }

    /// Continues from this run's checkpoint.
    pub fn resume(&mut self, dev: &D) -> Result<()> {
        let path = self.checkpoint_path();
        if !path.exists() {
            return Err(Error::Io {
                path: path.display().to_string(),
                source: std::io::Error::new(std::io::ErrorKind::NotFound, "no checkpoint to resume from"),
            });
        }
        self.trainer.load_checkpoint(dev, &path)
    }

    /// Trains to the end, checkpointing every `output.checkpoint_every` steps and at the end,
    /// appending every event to the metrics log and passing it to `on_event`; then writes
    /// `summary.json` and exports the model to `output.dir/model/`.
    pub fn run(&mut self, dev: &D, on_event: &mut dyn FnMut(&Event)) -> Result<Summary> {
        let out = self.config.output.dir.clone();
        std::fs::create_dir_all(&out).map_err(|e| io_error(&out, e))?;
        let metrics_path = self.metrics_path();
        let mut metrics = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&metrics_path)
            .map_err(|e| io_error(&metrics_path, e))?;
        let every = self.config.output.checkpoint_every;
        let start = Instant::now();
        let (mut samples, mut last_eval, mut write_error) = (0usize, None, None);
        while !self.trainer.done() {
            let chunk = (every > 0).then_some(every);
            self.trainer.fit(dev, self.source.as_ref(), chunk, &mut |e| {
                match e {
                    Event::Step { samples: n, .. } => samples += n,
                    Event::Epoch { eval, .. } => last_eval = Some(*eval),
                }
                if let Ok(line) = serde_json::to_string(e)
                    && let Err(err) = writeln!(metrics, "{line}")
                {
                    write_error.get_or_insert(err);
                }
                on_event(e);
            })?;
            if let Some(err) = write_error.take() {
                return Err(io_error(&metrics_path, err));
            }
            self.trainer.save_checkpoint(dev, &self.checkpoint_path())?;
        }
        let seconds = start.elapsed().as_secs_f64();
        if last_eval.is_none() {
            last_eval = Some(self.trainer.evaluate(dev, self.source.as_ref())?);
        }
        let summary = Summary {
            data: self.info.clone(),
            family: self.trainer.model.spec().family,
            parameters: self.trainer.model.num_params(),
            steps: self.trainer.position.step,
            seconds,
            samples_per_second: samples as f64 / seconds.max(1e-9),
            eval: last_eval,
            unigram_baseline_loss: self.unigram_baseline()?,
        };
        let json = serde_json::to_vec_pretty(&summary)
            .map_err(|e| Error::State { what: "summary".into(), message: e.to_string() })?;
        weights::write_atomic(&out.join("summary.json"), |w| w.write_all(&json))?;
        weights::export_model(&self.trainer.model, dev, &self.model_config, out.join("model"))?;
        Ok(summary)
    }

    /// Held-out cross-entropy of the training set's character frequencies (language models).
    fn unigram_baseline(&self) -> Result<Option<f64>> {
        if self.config.data.dataset != DatasetName::Hamlet {
            return Ok(None);
        }
        let corpus = data::hamlet(&self.config.data.dir)?;
        Ok(Some(unigram_loss(&corpus.train, &corpus.held_out, corpus.vocab.len())))
    }
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

fn io_error(path: &Path, source: std::io::Error) -> Error {
    Error::Io { path: path.display().to_string(), source }
}
