//! LayerNorm over the last dimension: `out = (x − mean)·rstd·weight + bias`, with
//! `rstd = 1/sqrt(var + eps)` (biased variance, as PyTorch). Saves `mean` and `rstd` per row
//! for the backward.

use crate::error::{Result, check_len};
use crate::scalar::Float;

/// Normalises each of `rows` rows of `dim` elements; writes `out`, `mean[rows]`, `rstd[rows]`.
#[allow(clippy::too_many_arguments)]
pub fn layernorm_forward<T: Float>(
    out: &mut [T],
    mean: &mut [T],
    rstd: &mut [T],
    inp: &[T],
    weight: &[T],
    bias: &[T],
    rows: usize,
    dim: usize,
    eps: f64,
) -> Result<()> {
    todo!()
}

/// Writes `dinp`; adds into `dweight` and `dbias`.
#[allow(clippy::too_many_arguments)]
pub fn layernorm_backward<T: Float>(
    dinp: &mut [T],
    dweight: &mut [T],
    dbias: &mut [T],
    dout: &[T],
    inp: &[T],
    weight: &[T],
    mean: &[T],
    rstd: &[T],
    rows: usize,
    dim: usize,
) -> Result<()> {
    todo!()
}
