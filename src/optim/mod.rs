//! What happens between the model's backward pass and its next forward: the optimizers (AdamW,
//! SGD with momentum), the learning-rate schedule and global-norm gradient clipping, plus
//! [`train_step`], one whole step on one device. Everything is generic over
//! [`Device`](crate::device::Device) and works on the parameters that currently have a
//! gradient, so layers frozen mid-run (PipeTransformer) cost neither optimizer work nor
//! optimizer memory.
//!
//! A step, in order: the global norm ([`global_grad_norm`]) → [`Optimizer::step_scaled`] with
//! [`LrSchedule::lr_at`] and clipping's coefficient ([`clip_coefficient`]), which scales the
//! gradients inside the update instead of in a pass of their own → zero the gradients.
//! [`clip_grad_norm`] scales them in place, as `torch.nn.utils.clip_grad_norm_` does.

pub mod clip;
pub mod lr_schedule;
pub mod optimizer;
pub mod step;

pub use clip::{clip_coefficient, clip_grad_norm, global_grad_norm, grad_sum_squares, scale_grads};
pub use lr_schedule::{Decay, LrSchedule};
pub use optimizer::{Optimizer, OptimizerConfig, OptimizerState, ParamState};
pub use step::{StepStats, train_step};
