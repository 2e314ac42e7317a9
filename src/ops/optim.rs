//! Optimizer kernels: the whole AdamW and SGD-momentum updates in one pass per tensor, plus the
//! sum of squares (global-norm clipping) and in-place scaling.

use crate::error::{Result, check_len};
use crate::scalar::Float;

/// Hyper-parameters of one AdamW update of one tensor.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdamWStep {
    /// Learning rate for this step.
    pub lr: f64,
    /// First-moment decay.
    pub beta1: f64,
    /// Second-moment decay.
    pub beta2: f64,
    /// Denominator term.
    pub eps: f64,
    /// Decoupled weight decay (0 for tensors excluded from decay).
    pub weight_decay: f64,
    /// 1-based step number, for bias correction.
    pub step: u64,
}

/// AdamW (Loshchilov & Hutter), PyTorch's formulation:
/// `p ← p·(1 − lr·wd)`; `m ← β1·m + (1−β1)·g`; `v ← β2·v + (1−β2)·g²`;
/// `p ← p − lr·(m/(1−β1ᵗ)) / (sqrt(v/(1−β2ᵗ)) + eps)`.
pub fn adamw_update<T: Float>(param: &mut [T], grad: &[T], m: &mut [T], v: &mut [T], h: &AdamWStep) -> Result<()> {
    todo!()
}

/// Hyper-parameters of one SGD update of one tensor.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SgdStep {
    /// Learning rate for this step.
    pub lr: f64,
    /// Momentum factor (0 disables momentum).
    pub momentum: f64,
    /// L2 weight decay added to the gradient (0 for tensors excluded from decay).
    pub weight_decay: f64,
    /// Nesterov momentum.
    pub nesterov: bool,
}

/// SGD with momentum, PyTorch's formulation (dampening 0): `g ← g + wd·p`;
/// `buf ← momentum·buf + g` (`buf ← g` when `first`); `d = nesterov ? g + momentum·buf : buf`;
/// `p ← p − lr·d`.
pub fn sgd_update<T: Float>(
    param: &mut [T],
    grad: &[T],
    momentum_buf: &mut [T],
    first: bool,
    h: &SgdStep,
) -> Result<()> {
    todo!()
}

/// `Σ x²` accumulated in f64 in a fixed order (bitwise reproducible for any thread count).
pub fn sum_squares<T: Float>(x: &[T]) -> f64 {
    todo!()
}

/// `x[i] *= s`.
pub fn scale_inplace<T: Float>(x: &mut [T], s: f64) {
    todo!()
}
