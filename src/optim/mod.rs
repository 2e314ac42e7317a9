//! What happens between the model's backward pass and its next forward: the optimizers (AdamW,
//! SGD with momentum), the learning-rate schedule and global-norm gradient clipping, plus
//! [`train_step`], one whole step on one device. Everything is generic over
//! [`Device`](crate::device::Device) and works on the parameters that currently have a
//! gradient, so layers frozen mid-run (PipeTransformer) cost neither optimizer work nor
//! optimizer memory.
//!
//! A step, in order: [`clip_grad_norm`] (optional) → [`Optimizer::step`] with
//! [`LrSchedule::lr_at`] → zero the gradients.

pub mod clip;
pub mod lr_schedule;
pub mod optimizer;
pub mod step;

pub use clip::{clip_coefficient, clip_grad_norm, global_grad_norm, grad_sum_squares, scale_grads};
pub use lr_schedule::{Decay, LrSchedule};
pub use optimizer::{Optimizer, OptimizerConfig, OptimizerState, ParamState};
pub use step::{StepStats, train_step};
