//! Sequence pooling for classification: the first token (`[CLS]`, ViT's class token) and the
//! masked mean over tokens (sentence-transformers' pooling for all-MiniLM-L6-v2).

use crate::error::{Result, check_len};
use crate::scalar::Float;

/// `out[b, :] = inp[b, 0, :]`, `inp` as `[batch, seq, dim]`.
pub fn first_token_pool_forward<T: Float>(
    out: &mut [T],
    inp: &[T],
    batch: usize,
    seq: usize,
    dim: usize,
) -> Result<()> {
    todo!()
}

/// Writes `dinp`: `dout[b]` at token 0, zeros elsewhere.
pub fn first_token_pool_backward<T: Float>(
    dinp: &mut [T],
    dout: &[T],
    batch: usize,
    seq: usize,
    dim: usize,
) -> Result<()> {
    todo!()
}

/// `out[b, :] = Σ_t m[b,t]·inp[b, t, :] / max(Σ_t m[b,t], 1)`, `m = mask ≠ 0` (all ones when
/// `mask` is `None`). A row whose mask is all zero pools to zeros.
pub fn mean_pool_forward<T: Float>(
    out: &mut [T],
    inp: &[T],
    mask: Option<&[u32]>,
    batch: usize,
    seq: usize,
    dim: usize,
) -> Result<()> {
    todo!()
}

/// Writes `dinp[b, t, :] = m[b,t]·dout[b, :] / max(Σ_t m[b,t], 1)`.
pub fn mean_pool_backward<T: Float>(
    dinp: &mut [T],
    dout: &[T],
    mask: Option<&[u32]>,
    batch: usize,
    seq: usize,
    dim: usize,
) -> Result<()> {
    todo!()
}
