//! Multi-head scaled-dot-product attention with a key padding mask, a causal mask, attention
//! dropout, and keys/values that may start with a prefix computed earlier (TeraPipe's token
//! slices: queries for positions `c..c+l` attend to keys `0..c+l`).
//!
//! Layout: `q` is `[batch, q_len, heads·head_dim]`, `k` and `v` are
//! `[batch, kv_len, heads·head_dim]` with `kv_len = prefix + q_len`, heads interleaved in the
//! last dimension. Query `i` sits at absolute position `prefix + i`; under the causal mask it
//! sees keys `j ≤ prefix + i`.

use crate::error::{Result, check_len};
use crate::scalar::Float;

/// Dimensions and options of one attention call.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AttentionDims {
    /// Sequences in the batch.
    pub batch: usize,
    /// Query positions in this call.
    pub q_len: usize,
    /// Key/value positions: the prefix computed earlier plus `q_len`.
    pub kv_len: usize,
    /// Attention heads.
    pub heads: usize,
    /// Channels per head.
    pub head_dim: usize,
    /// Whether query `i` may only see keys `j ≤ prefix + i`.
    pub causal: bool,
    /// Drop probability applied to the attention probabilities (0 in eval).
    pub dropout: f32,
    /// Seed of the dropout mask; element `(b, h, i, j)` of the probabilities uses counter
    /// `dropout_offset + ((b·heads + h)·q_len + i)·kv_len + j`.
    pub dropout_seed: u64,
    /// Counter offset of the dropout mask (see `dropout_seed`).
    pub dropout_offset: u64,
}

impl AttentionDims {
    /// Keys before the first query: `kv_len − q_len`.
    pub fn prefix(&self) -> usize {
        self.kv_len - self.q_len
    }
}

/// Writes `out = dropout(softmax(q·kᵀ/√head_dim + mask))·v` and saves the undropped
/// probabilities `probs[batch, heads, q_len, kv_len]` for the backward. `key_mask[b, j] == 0`
/// hides key `j` of sequence `b`. A query that can see no key gets zero probabilities and a
/// zero output.
#[allow(clippy::too_many_arguments)]
pub fn attention_forward<T: Float>(
    out: &mut [T],
    probs: &mut [T],
    q: &[T],
    k: &[T],
    v: &[T],
    key_mask: Option<&[u32]>,
    d: &AttentionDims,
) -> Result<()> {
    todo!()
}

/// Writes `dq`, `dk` and `dv` (gradients for the whole key/value range, prefix included) from
/// `dout` and the saved `probs`.
#[allow(clippy::too_many_arguments)]
pub fn attention_backward<T: Float>(
    dq: &mut [T],
    dk: &mut [T],
    dv: &mut [T],
    dout: &[T],
    q: &[T],
    k: &[T],
    v: &[T],
    probs: &[T],
    key_mask: Option<&[u32]>,
    d: &AttentionDims,
) -> Result<()> {
    todo!()
}
