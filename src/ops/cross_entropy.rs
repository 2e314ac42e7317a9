//! Softmax cross-entropy fused with its gradient (llm.c's fused classifier): one pass per row
//! computes the loss and writes `dlogits`, so probabilities are never stored.

use crate::error::{Result, check_len};
use crate::scalar::Float;

/// For each of `rows` rows of `vocab` logits: `losses[r] = −log softmax(logits[r])[targets[r]]`
/// (0 where `targets[r] == ignore_index`), and, when `dlogits` is given,
/// `dlogits[r] = (softmax(logits[r]) − onehot(targets[r]))·grad_scale` (a zero row where
/// ignored). Returns how many rows were not ignored. A target `≥ vocab` other than
/// `ignore_index` is an `Error::Data` naming the row, the label and the valid range.
///
/// `grad_scale` is chosen by the caller (`1/count` of the whole global batch), so a batch split
/// into micro-batches gets exactly the gradient of the unsplit batch.
#[allow(clippy::too_many_arguments)]
pub fn cross_entropy_forward_backward<T: Float>(
    losses: &mut [T],
    dlogits: Option<&mut [T]>,
    logits: &[T],
    targets: &[u32],
    rows: usize,
    vocab: usize,
    ignore_index: u32,
    grad_scale: f64,
) -> Result<usize> {
    todo!()
}
