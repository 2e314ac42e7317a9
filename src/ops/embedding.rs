//! Embedding lookup (token, position, token-type tables) and its scatter-add backward.

use crate::error::{Result, check_len};
use crate::scalar::Float;

/// `out[n, :] (=|+=) table[ids[n], :]` for each of the `ids.len()` rows; `table` has `dim`
/// columns and `table.len() / dim` rows. Adds onto `out` when `accumulate` (word + position +
/// type embeddings sum into one buffer). An id past the table is an `Error::Data` naming it.
pub fn embedding_forward<T: Float>(
    out: &mut [T],
    ids: &[u32],
    table: &[T],
    dim: usize,
    accumulate: bool,
) -> Result<()> {
    todo!()
}

/// `dtable[ids[n], :] += dout[n, :]`. Deterministic: each table row sums its contributions in
/// the order of `n`, whatever the thread count (no float atomics decide the result).
pub fn embedding_backward<T: Float>(dtable: &mut [T], ids: &[u32], dout: &[T], dim: usize) -> Result<()> {
    todo!()
}
