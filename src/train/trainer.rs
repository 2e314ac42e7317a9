//! `Trainer`: the epoch loop over a [`BatchSource`], with evaluation, events for progress
//! reporting, and checkpoints that resume the exact trajectory.
//!
//! Determinism: batch `(epoch, index)` comes from the source as a pure function of the seed;
//! the dropout seed of step `s` is `hash(seed, s)`; parameters and optimizer state are saved
//! bit for bit. So N steps, save, load, N more steps reproduce 2N uninterrupted steps exactly.

use super::checkpoint::{self, Tensor};
use super::{LrSchedule, Optimizer, OptimizerConfig, OptimizerState, ParamState, train_step};
use crate::device::Device;
use crate::error::{Error, Result};
use crate::model::{Batch, HeadSpec, HostBatch, Model};
use crate::pipeline::partition::UnitProfile;
use crate::pipeline::trace::ChromeTrace;
use crate::pipeline::{Pipeline, PipelineConfig};
use crate::rng::hash_u64;
use serde::{Deserialize, Serialize};
use std::path::Path;

/// Where training batches come from: a pure function of `(epoch, index)` for a given seed.
pub trait BatchSource {
    /// Training batches per epoch.
    fn batches_per_epoch(&self) -> usize;
    /// Training batch `index` of `epoch`.
    fn train_batch(&self, epoch: u64, index: usize) -> Result<HostBatch>;
    /// Number of evaluation batches.
    fn eval_batches(&self) -> usize;
    /// Evaluation batch `index`.
    fn eval_batch(&self, index: usize) -> Result<HostBatch>;
}

/// Hyper-parameters of a run.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TrainConfig {
    /// Passes over the training data.
    pub epochs: u64,
    /// Stop after this many steps in all (0: no limit).
    #[serde(default)]
    pub max_steps: u64,
    /// Peak learning rate.
    pub lr: f64,
    /// Final learning rate.
    #[serde(default)]
    pub min_lr: f64,
    /// Fraction of the steps spent warming up linearly from 0.
    #[serde(default)]
    pub warmup_fraction: f64,
    /// Decay after warmup.
    #[serde(default = "default_decay")]
    pub decay: super::Decay,
    /// Optimizer and its hyper-parameters.
    #[serde(default)]
    pub optimizer: OptimizerConfig,
    /// Clip the global gradient norm to this (0: no clipping).
    #[serde(default)]
    pub max_grad_norm: f64,
    /// Seed of the data order and dropout.
    #[serde(default)]
    pub seed: u64,
}

fn default_decay() -> super::Decay {
    super::Decay::Linear
}

impl TrainConfig {
    /// Steps the run will take with `batches_per_epoch` batches per epoch.
    pub fn total_steps(&self, batches_per_epoch: usize) -> u64 {
        let all = self.epochs * batches_per_epoch as u64;
        if self.max_steps > 0 { all.min(self.max_steps) } else { all }
    }

    /// The learning-rate schedule over `total_steps`.
    pub fn schedule(&self, total_steps: u64) -> Result<LrSchedule> {
        if !(0.0..=1.0).contains(&self.warmup_fraction) {
            return Err(Error::Config {
                field: "train.warmup_fraction".into(),
                message: format!("must be in [0, 1], got {}", self.warmup_fraction),
            });
        }
        let schedule = LrSchedule {
            base_lr: self.lr,
            min_lr: self.min_lr,
            warmup_steps: (self.warmup_fraction * total_steps as f64).round() as u64,
            total_steps,
            decay: self.decay,
        };
        schedule.validate()?;
        Ok(schedule)
    }
}

/// Where a run stands: enough to resume it exactly.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Position {
    /// Optimizer steps taken.
    pub step: u64,
    /// Current epoch (0-based).
    pub epoch: u64,
    /// Next batch index within the epoch.
    pub batch: usize,
}

/// Metrics of one evaluation pass.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct EvalMetrics {
    /// Mean loss over the counted targets.
    pub loss: f64,
    /// Fraction of correct argmax predictions (classifiers; for a language model, next-token
    /// accuracy).
    pub accuracy: f64,
    /// `exp(loss)`: the language-model metric.
    pub perplexity: f64,
    /// Counted targets.
    pub count: usize,
}

/// A pipelined step's idle fraction, measured and predicted.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct Bubble {
    /// Measured: 1 − compute time / (devices × step time).
    pub measured: f64,
    /// The schedule's formula for equal stage times.
    pub formula: f64,
}

/// Something that happened during [`Trainer::fit`], for progress bars and metric logs.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(tag = "event", rename_all = "snake_case")]
pub enum Event {
    /// An optimizer step finished.
    Step {
        /// Steps taken so far.
        step: u64,
        /// Epoch of the step.
        epoch: u64,
        /// Mean training loss of the batch.
        loss: f64,
        /// Learning rate used.
        lr: f64,
        /// Gradient norm before clipping.
        grad_norm: f64,
        /// Samples in the batch.
        samples: usize,
        /// Pipelined steps: the measured bubble (idle fraction of the devices) and the
        /// schedule formula's for equal stages.
        #[serde(skip_serializing_if = "Option::is_none")]
        bubble: Option<Bubble>,
    },
    /// An epoch ended and was evaluated.
    Epoch {
        /// The epoch that ended.
        epoch: u64,
        /// Evaluation metrics.
        eval: EvalMetrics,
    },
}

/// The model, its optimizer and schedule, and the run's position.
pub struct Trainer<D: Device> {
    /// The model being trained.
    pub model: Model<D>,
    /// Its optimizer.
    pub optimizer: Optimizer<D>,
    /// Hyper-parameters.
    pub config: TrainConfig,
    /// Learning rate by step.
    pub schedule: LrSchedule,
    /// Where the run stands.
    pub position: Position,
    /// The pipeline the steps run on when the run spreads over devices; `model` and
    /// `optimizer` then mirror it (refreshed before every evaluation and at the end of `fit`).
    pipeline: Option<Pipeline<D>>,
    /// A Chrome trace of every pipelined step, when asked for.
    pub trace: Option<ChromeTrace>,
}

impl<D: Device> Trainer<D> {
    /// A trainer at step 0 for a source with `batches_per_epoch` batches per epoch.
    pub fn new(model: Model<D>, config: TrainConfig, batches_per_epoch: usize) -> Result<Self> {
        if batches_per_epoch == 0 {
            return Err(Error::Data { what: "training set".into(), message: "yields no batches".into() });
        }
        let schedule = config.schedule(config.total_steps(batches_per_epoch))?;
        let optimizer = Optimizer::new(config.optimizer)?;
        Ok(Self { model, optimizer, config, schedule, position: Position::default(), pipeline: None, trace: None })
    }

    /// Runs the following steps as `config` spreads them over `devices` (the trainer's model
    /// and optimizer state, on `dev`, are copied there), with `profiles` as the units' costs.
    pub fn enable_pipeline(
        &mut self,
        dev: &D,
        devices: Vec<D>,
        config: PipelineConfig,
        profiles: &[UnitProfile],
    ) -> Result<()> {
        let first = devices.first().ok_or_else(|| crate::error::config_error("devices", "a pipeline needs devices"))?;
        let model = self.model.replicate_to(dev, first)?;
        let mut pipeline = Pipeline::new(devices, model, self.config.optimizer, config, profiles)?;
        pipeline.load_optimizer_state(&self.optimizer.state_dict(dev)?)?;
        self.pipeline = Some(pipeline);
        Ok(())
    }

    /// The pipeline in use, if any.
    pub fn pipeline(&self) -> Option<&Pipeline<D>> {
        self.pipeline.as_ref()
    }

    /// The pipeline in use, to re-plan it or give it communicators.
    pub fn pipeline_mut(&mut self) -> Option<&mut Pipeline<D>> {
        self.pipeline.as_mut()
    }

    /// Copies the pipeline's weights and optimizer state back into `model` and `optimizer`.
    fn sync_from_pipeline(&mut self, dev: &D) -> Result<()> {
        if let Some(p) = &self.pipeline {
            self.model = p.gather(dev)?;
            self.optimizer.load_state_dict(dev, &p.optimizer_state()?, &self.model.params())?;
        }
        Ok(())
    }

    /// Whether the run has taken all its steps.
    pub fn done(&self) -> bool {
        self.position.step >= self.schedule.total_steps
    }

    /// Trains until the end of the run or until `stop_after` more steps (for checkpointing in
    /// between), evaluating at each epoch end. Reports through `on_event`.
    pub fn fit(
        &mut self,
        dev: &D,
        data: &dyn BatchSource,
        stop_after: Option<u64>,
        on_event: &mut dyn FnMut(&Event),
    ) -> Result<()> {
        let per_epoch = data.batches_per_epoch();
        let mut taken = 0;
        while !self.done() && stop_after.is_none_or(|n| taken < n) {
            let Position { step, epoch, batch: index } = self.position;
            let host = data.train_batch(epoch, index)?;
            let dropout_seed = hash_u64(self.config.seed, step);
            let lr = self.schedule.lr_at(step);
            let clip = (self.config.max_grad_norm > 0.0).then_some(self.config.max_grad_norm);
            let (stats, bubble) = match &mut self.pipeline {
                Some(p) => {
                    let s = p.step(&host, dropout_seed, lr, clip)?;
                    if let Some(t) = &mut self.trace {
                        t.push(step, &s.trace);
                    }
                    let bubble = Bubble { measured: s.trace.bubble(), formula: p.plan().schedule.bubble_formula() };
                    (super::StepStats { loss: s.loss, grad_norm: s.grad_norm, applied: s.applied }, Some(bubble))
                }
                None => {
                    let batch = Batch::upload(dev, self.model.spec(), &host, true, dropout_seed)?;
                    (train_step(dev, &mut self.model, &mut self.optimizer, &batch, lr, clip)?, None)
                }
            };
            if !stats.loss.is_finite() {
                return Err(Error::State {
                    what: "training".into(),
                    message: format!("loss became {} at step {step}; lower the learning rate", stats.loss),
                });
            }
            taken += 1;
            self.position.step += 1;
            self.position.batch += 1;
            on_event(&Event::Step {
                step: step + 1,
                epoch,
                loss: stats.loss,
                lr,
                grad_norm: stats.grad_norm,
                samples: host.batch,
                bubble,
            });
            if self.position.batch == per_epoch || self.done() {
                self.sync_from_pipeline(dev)?;
                let eval = self.evaluate(dev, data)?;
                on_event(&Event::Epoch { epoch, eval });
                if self.position.batch == per_epoch {
                    self.position.epoch += 1;
                    self.position.batch = 0;
                }
            }
        }
        // Callers checkpoint and export after `fit`: leave the mirror current.
        self.sync_from_pipeline(dev)
    }

    /// Loss, accuracy and perplexity over the source's evaluation batches (no dropout, nothing
    /// saved for a backward).
    pub fn evaluate(&self, dev: &D, data: &dyn BatchSource) -> Result<EvalMetrics> {
        let (mut loss_sum, mut count, mut correct) = (0.0, 0usize, 0usize);
        for i in 0..data.eval_batches() {
            let host = data.eval_batch(i)?;
            let batch = Batch::upload(dev, self.model.spec(), &host, false, 0)?;
            let (logits, _) = self.model.forward(dev, &batch)?;
            let out = self.model.loss(dev, &batch, &logits, None)?;
            loss_sum += out.loss_sum;
            count += out.count;
            let logits = dev.download(&logits)?;
            let classes = match self.model.spec().head {
                HeadSpec::Classifier { num_labels, .. } => num_labels,
                HeadSpec::TiedLmHead => logits.len() / host.targets.len().max(1),
            };
            for (row, &target) in logits.chunks(classes.max(1)).zip(&host.targets) {
                if target == crate::model::IGNORE_INDEX {
                    continue;
                }
                let best =
                    row.iter().enumerate().fold((0, f32::NEG_INFINITY), |b, (i, &v)| if v > b.1 { (i, v) } else { b });
                correct += (best.0 as u32 == target) as usize;
            }
        }
        let loss = if count == 0 { 0.0 } else { loss_sum / count as f64 };
        let accuracy = if count == 0 { 0.0 } else { correct as f64 / count as f64 };
        Ok(EvalMetrics { loss, accuracy, perplexity: loss.exp(), count })
    }

    /// Writes a checkpoint (parameters, optimizer state, position, config) atomically.
    pub fn save_checkpoint(&self, dev: &D, path: &Path) -> Result<()> {
        let mut tensors = Vec::new();
        for p in self.model.params() {
            tensors.push(Tensor { name: format!("param/{}", p.name), data: dev.download(&p.value)? });
        }
        let mut opt = self.optimizer.state_dict(dev)?;
        for ps in &mut opt.params {
            for (i, b) in std::mem::take(&mut ps.buffers).into_iter().enumerate() {
                tensors.push(Tensor { name: format!("opt/{}/{i}", ps.name), data: b });
            }
        }
        let meta = serde_json::json!({
            "format": 1,
            "position": self.position,
            "train": self.config,
            "frozen_prefix": self.model.frozen_prefix(),
            "optimizer": opt,
        });
        checkpoint::save(path, &meta, &tensors)
    }

    /// Restores a checkpoint written by [`Trainer::save_checkpoint`] for this model. The file's
    /// integrity and every parameter's name and size are checked before anything changes.
    pub fn load_checkpoint(&mut self, dev: &D, path: &Path) -> Result<()> {
        let bad = |m: String| Error::State { what: format!("checkpoint {}", path.display()), message: m };
        let (meta, tensors) = checkpoint::load(path)?;
        let position: Position =
            serde_json::from_value(meta["position"].clone()).map_err(|e| bad(format!("position: {e}")))?;
        let frozen: usize =
            serde_json::from_value(meta["frozen_prefix"].clone()).map_err(|e| bad(format!("frozen_prefix: {e}")))?;
        let mut opt: OptimizerState =
            serde_json::from_value(meta["optimizer"].clone()).map_err(|e| bad(format!("optimizer: {e}")))?;
        let mut by_name: std::collections::HashMap<String, Vec<f32>> =
            tensors.into_iter().map(|t| (t.name, t.data)).collect();
        // Check every parameter before touching any.
        for p in self.model.params() {
            match by_name.get(&format!("param/{}", p.name)) {
                Some(v) if v.len() == p.numel() => {}
                Some(v) => {
                    return Err(bad(format!("`{}` has {} values, the model expects {}", p.name, v.len(), p.numel())));
                }
                None => return Err(bad(format!("parameter `{}` is missing", p.name))),
            }
        }
        for ps in &mut opt.params {
            let ParamState { name, buffers, .. } = ps;
            for i in 0..self.config.optimizer.state_buffers() {
                let t = by_name
                    .remove(&format!("opt/{name}/{i}"))
                    .ok_or_else(|| bad(format!("optimizer buffer {i} of `{name}` is missing")))?;
                buffers.push(t);
            }
        }
        if frozen > self.model.units().len() {
            return Err(bad(format!("frozen prefix {frozen} exceeds the model's {} units", self.model.units().len())));
        }
        self.model.freeze_prefix(dev, frozen)?;
        self.optimizer.load_state_dict(dev, &opt, &self.model.params())?;
        for p in self.model.params_mut() {
            if let Some(values) = by_name.remove(&format!("param/{}", p.name)) {
                p.value = dev.upload(&values)?;
            }
        }
        self.position = position;
        Ok(())
    }
}
