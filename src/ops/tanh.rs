//! Element-wise tanh (BERT's pooler activation); the backward uses the saved output.

use crate::error::{Result, check_len};
use crate::scalar::Float;

/// `out[i] = tanh(inp[i])`.
pub fn tanh_forward<T: Float>(out: &mut [T], inp: &[T]) -> Result<()> {
    todo!()
}

/// Writes `dinp[i] = (1 − out[i]²)·dout[i]`.
pub fn tanh_backward<T: Float>(dinp: &mut [T], out: &[T], dout: &[T]) -> Result<()> {
    todo!()
}
