//! Training machinery that sits between the model's backward pass and its next forward: the
//! optimizers (AdamW, SGD with momentum), the learning-rate schedule and global-norm gradient
//! clipping. Everything is generic over [`Device`](crate::device::Device) and works on the
//! parameters that currently have a gradient, so layers frozen mid-run (PipeTransformer) cost
//! neither optimizer work nor optimizer memory.
//!
//! A step, in order: [`clip_grad_norm`] (optional) → [`Optimizer::step`] with
//! [`LrSchedule::lr_at`]`(optimizer.step_count())` → zero the gradients.

pub mod checkpoint;
pub mod clip;
pub mod optimizer;
pub mod schedule;
pub mod step;
pub mod trainer;

pub use clip::{clip_grad_norm, global_grad_norm};
pub use optimizer::{Optimizer, OptimizerConfig, OptimizerState, ParamState};
pub use schedule::{Decay, LrSchedule};
pub use step::{StepStats, train_step};
pub use trainer::{BatchSource, Bubble, EvalMetrics, Event, Position, TrainConfig, Trainer};
