//! One optimisation step on one device: zero the gradients, forward + loss + backward, the
//! global norm, the update (clipped by scaling the gradients inside it).

use super::{Optimizer, clip_coefficient, global_grad_norm};
use crate::device::Device;
use crate::error::Result;
use crate::model::{Batch, Model};

/// What one step measured.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct StepStats {
    /// Mean loss over the batch's counted targets.
    pub loss: f64,
    /// Global gradient norm before clipping.
    pub grad_norm: f64,
    /// Whether the update was applied (skipped when the gradient norm is not finite).
    pub applied: bool,
}

/// Runs one training step. With `max_grad_norm`, the update is clipped to that global norm:
/// its coefficient scales the gradients inside the optimizer, which leaves them unscaled. A
/// non-finite gradient norm skips the update (the weights stay as they were) and is reported
/// in [`StepStats::applied`].
pub fn train_step<D: Device>(
    dev: &D,
    model: &mut Model<D>,
    optimizer: &mut Optimizer<D>,
    batch: &Batch<D>,
    lr: f64,
    max_grad_norm: Option<f64>,
) -> Result<StepStats> {
    if let Some(max) = max_grad_norm {
        clip_coefficient(0.0, max)?;
    }
    model.zero_grad(dev)?;
    let loss = model.forward_backward(dev, batch)?;
    // A tied weight counts once: both copies hold its summed gradient.
    let grad_norm = global_grad_norm(dev, &model.distinct_params())?;
    let mut params = model.params_mut();
    // Clipping's coefficient goes into the update (no pass over the gradients of its own).
    let coef = match max_grad_norm {
        Some(max) => clip_coefficient(grad_norm, max)?,
        None => None,
    };
    let applied = grad_norm.is_finite();
    if applied {
        optimizer.step_scaled(dev, &mut params, lr, coef.unwrap_or(1.0))?;
    }
    Ok(StepStats { loss, grad_norm, applied })
}
