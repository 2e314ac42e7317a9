//! What a run reports as it goes: one event per step, per evaluation, per new best evaluation,
//! per elastic transition and per epoch of the activation cache, and one when it stops early.
//! The binary's progress bar, `metrics.jsonl` and `report.html` all read the same events.

use super::metrics::Confusion;
use super::selection::{KeepBest, Scored};
use serde::Serialize;
use std::fmt;
use std::ops::Range;

/// Metrics of one evaluation pass: what fits the task. Every model has a loss and an accuracy
/// (a language model's is next-token accuracy); a classifier adds its confusion matrix and
/// macro F1, a language model its perplexity.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct EvalMetrics {
    /// Mean loss over the counted targets.
    pub loss: f64,
    /// Fraction of correct argmax predictions.
    pub accuracy: f64,
    /// Counted targets.
    pub count: usize,
    /// `exp(loss)` (language models).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub perplexity: Option<f64>,
    /// The unweighted mean of the classes' F1 (classifiers).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub macro_f1: Option<f64>,
    /// `[true][predicted]` counts (classifiers).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub confusion: Option<Confusion>,
}

impl fmt::Display for EvalMetrics {
    /// `loss 0.4512, accuracy 81.25%, macro F1 0.8100` or `loss 1.5020, perplexity 4.491`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "loss {:.4}, accuracy {:.2}%", self.loss, 100.0 * self.accuracy)?;
        if let Some(f1) = self.macro_f1 {
            write!(f, ", macro F1 {f1:.4}")?;
        }
        if let Some(p) = self.perplexity {
            write!(f, ", perplexity {p:.3}")?;
        }
        Ok(())
    }
}

/// A pipelined step's idle fraction, measured and predicted.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct Bubble {
    /// Measured: the idle fraction of the pipelined part of the step
    /// ([`StepTrace::bubble`](crate::pipeline::trace::StepTrace::bubble)).
    pub measured: f64,
    /// The schedule's formula for equal stages.
    pub formula: f64,
    /// Seconds after the pipelined part (tied gradients, clipping, optimizers), apart.
    pub tail_seconds: f64,
}

/// An elastic transition (PipeTransformer): what changed and what it cost.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Transition {
    /// Optimizer steps taken when it happened.
    pub step: u64,
    /// The epoch it happened in (at an epoch's end: that epoch).
    pub epoch: u64,
    /// Why: the freeze rule's decision, or a resume.
    pub reason: String,
    /// Frozen Transformer layers, before → after.
    pub frozen_layers: (usize, usize),
    /// Frozen units after it: the embedding and two per frozen layer (the embedding alone
    /// where `train.freeze_embeddings` froze it before any layer).
    pub frozen_units: usize,
    /// Pipeline length `K`, before → after.
    pub pipeline_len: (usize, usize),
    /// Replicas `R`, before → after.
    pub replicas: (usize, usize),
    /// Micro-batches `M`, before → after.
    pub micro_batches: (usize, usize),
    /// The partition before: units of each stage.
    pub stages_before: Vec<Range<usize>>,
    /// The new partition: units of each stage.
    pub stages: Vec<Range<usize>>,
    /// Source batches per optimizer step after (the `scale-lr` policy grows it with `R`).
    pub batches_per_step: usize,
    /// Whether the frozen prefix's output is read from the cache from now on.
    pub cache: bool,
    /// Wall-clock seconds the transition took (freezing, re-planning, moving weights and
    /// optimizer state, switching `M`). The steps that time `M`'s candidates train, so they
    /// count as steps, not here.
    pub seconds: f64,
}

impl fmt::Display for Transition {
    /// `transition at step 40: 0 → 1 frozen layers, K 2 → 1, R 1 → 2, M 8 → 4, stages [0..5,
    /// 5..9] → [1..9], cache on, 48 ms (reason)` (the stages once where they stayed).
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let ((l0, l1), (k0, k1), (r0, r1), (m0, m1)) =
            (self.frozen_layers, self.pipeline_len, self.replicas, self.micro_batches);
        let stages = match self.stages_before == self.stages {
            true => format!("{:?}", self.stages),
            false => format!("{:?} → {:?}", self.stages_before, self.stages),
        };
        write!(
            f,
            "transition at step {}: {l0} → {l1} frozen layers, K {k0} → {k1}, R {r0} → {r1}, M {m0} → {m1}, stages \
             {stages}, cache {}, {:.0} ms ({})",
            self.step,
            if self.cache { "on" } else { "off" },
            self.seconds * 1e3,
            self.reason
        )
    }
}

/// Something that happened during a run, for progress bars and metric logs.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(tag = "event", rename_all = "snake_case")]
pub enum Event {
    /// A run started or resumed in this process.
    Start {
        /// Whether it continues from a checkpoint.
        resumed: bool,
        /// Optimizer steps already taken.
        step: u64,
        /// The devices it runs on, as they name themselves (backend, index, precision; threads
        /// on cpu): a run resumed elsewhere, or in another precision, says so in its log.
        devices: Vec<String>,
        /// The plan it starts in (a resumed run: the checkpoint's, or its own where it
        /// reshaped): the report's first shape, whatever a later command's flags ask.
        plan: crate::pipeline::PipelineConfig,
    },
    /// An optimizer step finished.
    Step {
        /// Steps taken so far.
        step: u64,
        /// Source batches taken so far: the learning-rate schedule's clock, ahead of `step`
        /// when AutoDP's `scale-lr` takes several batches a step.
        #[serde(default)]
        batches: u64,
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
        /// Wall-clock seconds of the step (batch preparation included).
        seconds: f64,
        /// Pipelined steps: the measured bubble (idle fraction of the devices) and the
        /// schedule formula's for equal stages.
        #[serde(skip_serializing_if = "Option::is_none")]
        bubble: Option<Bubble>,
        /// Where the batch was looked up in the cache of the frozen layers' output (AutoCache,
        /// once layers are frozen): how many of its samples the cache served; the others ran
        /// through the frozen layers.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        cache_hits: Option<usize>,
    },
    /// An epoch ended and was evaluated.
    Epoch {
        /// The epoch that ended.
        epoch: u64,
        /// Evaluation metrics.
        eval: EvalMetrics,
        /// Training samples this process stepped on in the epoch.
        samples: usize,
        /// Wall-clock seconds of those steps (evaluation excluded).
        train_seconds: f64,
        /// Wall-clock seconds of the evaluation.
        eval_seconds: f64,
    },
    /// An evaluation inside an epoch (`train.eval_every`); the epoch's end gives [`Event::Epoch`].
    Eval {
        /// Optimizer steps taken.
        step: u64,
        /// The epoch under way.
        epoch: u64,
        /// Evaluation metrics.
        eval: EvalMetrics,
        /// Wall-clock seconds of the evaluation.
        eval_seconds: f64,
    },
    /// An evaluation scored the best so far on `train.keep_best`: its weights are the run's
    /// best (written to `output.dir/best/`).
    Best {
        /// Optimizer steps taken.
        step: u64,
        /// The epoch of the evaluation.
        epoch: u64,
        /// The metric (`loss`, `accuracy`, `macro_f1`).
        metric: KeepBest,
        /// Its score.
        value: f64,
    },
    /// `train.early_stopping_patience` evaluations in a row did not beat the best: the run
    /// ends here, before its planned length.
    EarlyStop {
        /// Optimizer steps taken.
        step: u64,
        /// Evaluations in a row without a better score.
        evaluations: u64,
        /// The best evaluation.
        best: Scored,
    },
    /// The elastic controller changed the run's shape.
    Transition(Transition),
    /// The activation cache over one epoch.
    Cache {
        /// The epoch.
        epoch: u64,
        /// Samples whose frozen prefix output came from the cache.
        hits: usize,
        /// Samples it did not hold (their frozen prefix ran, and its output was stored).
        misses: usize,
        /// Samples held.
        entries: usize,
        /// Bytes in host memory.
        memory_bytes: usize,
        /// Bytes in the spill file.
        disk_bytes: usize,
    },
}
