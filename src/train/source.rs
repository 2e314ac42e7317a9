//! `BatchSource`: where training and evaluation batches come from.

use crate::error::Result;
use crate::model::HostBatch;

/// Where batches come from: a pure function of `(epoch, index)` for a given seed, so a resumed
/// run sees the batches an uninterrupted one would.
pub trait BatchSource: Send + Sync {
    /// Training batches per epoch.
    fn batches_per_epoch(&self) -> usize;
    /// Training batch `index` of `epoch`.
    fn train_batch(&self, epoch: u64, index: usize) -> Result<HostBatch>;
    /// Number of evaluation batches.
    fn eval_batches(&self) -> usize;
    /// Evaluation batch `index`.
    fn eval_batch(&self, index: usize) -> Result<HostBatch>;
    /// What the training batches are made of (the training samples' ids in split order, and
    /// what orders them): a checkpoint records it, and a resume refuses a source whose
    /// fingerprint differs, since its saved position would name other samples. `None`: not
    /// known, not checked.
    fn fingerprint(&self) -> Option<u64> {
        None
    }
}
