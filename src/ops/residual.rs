//! Residual connections: `out = a + b`; the backward sends `dout` to both branches, which units
//! do by accumulating the branch's input gradient onto the skip path's.

use crate::error::{Result, check_len};
use crate::scalar::Float;

/// `out[i] = a[i] + b[i]`.
pub fn residual_forward<T: Float>(out: &mut [T], a: &[T], b: &[T]) -> Result<()> {
    todo!()
}

/// `dacc[i] += dout[i]`: adds one branch's gradient onto the other's.
pub fn residual_backward<T: Float>(dacc: &mut [T], dout: &[T]) -> Result<()> {
    todo!()
}
