//! Linear layer with optional bias, weight in PyTorch layout `[out_dim, in_dim]`:
//! `out[r, o] = Σ_i inp[r, i]·weight[o, i] + bias[o]`. Also the tied LM head (weight = the token
//! embedding table, no bias) and the classifier head.

use crate::error::{Result, check_len};
use crate::scalar::Float;

/// `out[rows, out_dim] = inp[rows, in_dim] · weightᵀ + bias`.
#[allow(clippy::too_many_arguments)]
pub fn linear_forward<T: Float>(
    out: &mut [T],
    inp: &[T],
    weight: &[T],
    bias: Option<&[T]>,
    rows: usize,
    in_dim: usize,
    out_dim: usize,
) -> Result<()> {
    todo!()
}

/// Writes `dinp = dout · weight` (if asked), adds `dweight += doutᵀ · inp` and
/// `dbias += Σ_rows dout` (if present).
#[allow(clippy::too_many_arguments)]
pub fn linear_backward<T: Float>(
    dinp: Option<&mut [T]>,
    dweight: Option<&mut [T]>,
    dbias: Option<&mut [T]>,
    dout: &[T],
    inp: &[T],
    weight: &[T],
    rows: usize,
    in_dim: usize,
    out_dim: usize,
) -> Result<()> {
    todo!()
}
