//! `TrainConfig`: the hyper-parameters of a run (the `[train]` section of a run config).

use super::selection::KeepBest;
use crate::error::{Error, Result};
use crate::optim::{Decay, LrSchedule, OptimizerConfig};
use serde::{Deserialize, Serialize};

/// Hyper-parameters of a run.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TrainConfig {
    /// Passes over the training data.
    pub epochs: u64,
    /// Stop after this many of the source's batches in all (0: no limit).
    #[serde(default)]
    pub max_steps: u64,
    /// Peak learning rate.
    pub lr: f64,
    /// Final learning rate.
    #[serde(default)]
    pub min_lr: f64,
    /// Fraction of the run spent warming up linearly from 0.
    #[serde(default)]
    pub warmup_fraction: f64,
    /// Decay after warmup.
    #[serde(default = "default_decay")]
    pub decay: Decay,
    /// Optimizer and its hyper-parameters.
    #[serde(default)]
    pub optimizer: OptimizerConfig,
    /// Clip the global gradient norm to this (0: no clipping).
    #[serde(default)]
    pub max_grad_norm: f64,
    /// Seed of the data order and dropout.
    #[serde(default)]
    pub seed: u64,
    /// Also evaluate every this many optimizer steps inside an epoch (0: only at each epoch's
    /// end): a finer time-to-accuracy, each evaluation's time counted in the run's clock.
    #[serde(default)]
    pub eval_every: u64,
    /// Keep the model's first unit, its input embedding (the token, position and type tables
    /// and their LayerNorm; a ViT's patch projection, class token and position table), frozen
    /// from the first step: no gradient,
    /// no optimizer state and, as in every frozen unit, no dropout on its output. Fine-tuning
    /// pretrained weights, it saves the embedding table's share of each step (half of MiniLM's
    /// parameters) at no measured cost in accuracy (docs/RESULTS.md). The freeze rule
    /// (`[elastic]`) counts the layers above it. With tied embeddings (GPT) the LM head's copy
    /// stays fixed too.
    #[serde(default)]
    pub freeze_embeddings: bool,
    /// Keep the weights of the evaluation that scored best on this metric (`loss`, `accuracy`
    /// or `macro_f1`; `off` by default): a run writes them to `output.dir/best/` as they come,
    /// an export like `model/` (which holds the last weights).
    #[serde(default)]
    pub keep_best: KeepBest,
    /// Stop once this many evaluations in a row have not beaten the best on `keep_best` by
    /// more than `early_stopping_min_delta` (0: never). Evaluations come at each epoch's end
    /// and every `eval_every` steps.
    #[serde(default)]
    pub early_stopping_patience: u64,
    /// The least gain over the best score that restarts the patience (the metric's units:
    /// 0.001 is a tenth of a point of accuracy).
    #[serde(default)]
    pub early_stopping_min_delta: f64,
}

fn default_decay() -> Decay {
    Decay::Linear
}

impl TrainConfig {
    /// `epochs` at a peak learning rate `lr`, everything else as a `[train]` section that
    /// sets only those two reads: no step limit, warmup, clipping or floor on the rate, linear
    /// decay, AdamW's defaults, seed 0. Change the rest with struct update syntax.
    pub fn new(epochs: u64, lr: f64) -> Self {
        TrainConfig {
            epochs,
            max_steps: 0,
            lr,
            min_lr: 0.0,
            warmup_fraction: 0.0,
            decay: default_decay(),
            optimizer: OptimizerConfig::default(),
            max_grad_norm: 0.0,
            seed: 0,
            eval_every: 0,
            freeze_embeddings: false,
            keep_best: KeepBest::Off,
            early_stopping_patience: 0,
            early_stopping_min_delta: 0.0,
        }
    }

    /// The source batches the run will take with `batches_per_epoch` batches per epoch: the
    /// clock of the learning-rate schedule, whatever the number of batches one optimizer step
    /// takes.
    pub fn total_batches(&self, batches_per_epoch: usize) -> u64 {
        // Saturating: `epochs` comes from a config file, and a product past u64::MAX batches
        // means the same as u64::MAX (a run that never ends on its own).
        let all = self.epochs.saturating_mul(batches_per_epoch as u64);
        if self.max_steps > 0 { all.min(self.max_steps) } else { all }
    }

    /// The learning-rate schedule over `total` source batches.
    pub fn lr_schedule(&self, total: u64) -> Result<LrSchedule> {
        if !(0.0..=1.0).contains(&self.warmup_fraction) {
            return Err(Error::Config {
                field: "train.warmup_fraction".into(),
                message: format!("must be in [0, 1], got {}", self.warmup_fraction),
            });
        }
        let schedule = LrSchedule {
            base_lr: self.lr,
            min_lr: self.min_lr,
            warmup_steps: (self.warmup_fraction * total as f64).round() as u64,
            total_steps: total,
            decay: self.decay,
        };
        schedule.validate()?;
        Ok(schedule)
    }

    /// Checks the settings no run can use, named as the config names them, before any data
    /// or weights are loaded.
    pub fn validate(&self) -> Result<()> {
        if !(self.max_grad_norm.is_finite() && self.max_grad_norm >= 0.0) {
            return Err(Error::Config {
                field: "train.max_grad_norm".into(),
                message: format!("{}: expected a norm, finite and at least 0 (0: no clipping)", self.max_grad_norm),
            });
        }
        if !(self.early_stopping_min_delta.is_finite() && self.early_stopping_min_delta >= 0.0) {
            return Err(Error::Config {
                field: "train.early_stopping_min_delta".into(),
                message: format!(
                    "{}: expected a gain in the metric's units, finite and at least 0",
                    self.early_stopping_min_delta
                ),
            });
        }
        if self.early_stopping_patience > 0 && self.keep_best == KeepBest::Off {
            return Err(Error::Config {
                field: "train.early_stopping_patience".into(),
                message: format!(
                    "{} evaluations without a better score, but train.keep_best is off: name the metric to watch \
                     (keep_best = \"loss\", \"accuracy\" or \"macro_f1\")",
                    self.early_stopping_patience
                ),
            });
        }
        // Named as a config file writes them.
        let named = |e: Error| match e {
            Error::Config { field, message } => Error::Config {
                field: match field.as_str() {
                    "lr_schedule.base_lr" => "train.lr".into(),
                    "lr_schedule.min_lr" => "train.min_lr".into(),
                    _ => field.replacen("optimizer.", "train.optimizer.", 1),
                },
                message: message.replace("base_lr", "train.lr"),
            },
            e => e,
        };
        self.lr_schedule(1).map_err(named)?;
        self.optimizer.validate().map_err(named)
    }

    /// The global-norm clip, if any.
    pub fn clip(&self) -> Option<f64> {
        (self.max_grad_norm > 0.0).then_some(self.max_grad_norm)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `new` is what a `[train]` section of only `epochs` and `lr` reads as, default for default.
    #[test]
    fn new_is_the_section_with_only_epochs_and_lr() {
        let read: TrainConfig = toml::from_str("epochs = 2\nlr = 1e-3\n").unwrap();
        assert_eq!(TrainConfig::new(2, 1e-3), read);
        assert!(TrainConfig::new(2, 1e-3).validate().is_ok());
    }
}
