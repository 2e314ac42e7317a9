//! Row-wise softmax over the last dimension (max-subtracted), and its backward
//! `dinp = out ⊙ (dout − Σ out⊙dout)`.

use crate::error::{Result, check_len};
use crate::scalar::Float;

/// Softmax of each of `rows` rows of `cols` elements.
pub fn softmax_forward<T: Float>(out: &mut [T], inp: &[T], rows: usize, cols: usize) -> Result<()> {
    todo!()
}

/// Writes `dinp` from the forward's `out` and the upstream `dout`.
pub fn softmax_backward<T: Float>(dinp: &mut [T], out: &[T], dout: &[T], rows: usize, cols: usize) -> Result<()> {
    todo!()
}
