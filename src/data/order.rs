//! Seeded per-epoch sample order: the permutation of epoch `e` depends only on (seed, e, len),
//! so a run that stops mid-epoch resumes on exactly the batches it would have seen.

use crate::error::{Result, config_error};
use crate::rng::{Rng, mix64};

/// Mixed into the epoch before it meets the seed, so that epoch 0 is not the raw seed and
/// nearby (seed, epoch) pairs give unrelated generators.
const EPOCH_SALT: u64 = 0xD1B5_4A32_D192_ED03;

/// Batches per window that [`BatchOrder::grouped_by_length`] sorts by length: wide enough
/// that a window's batches are nearly uniform in length, narrow enough that the epoch stays
/// well mixed (the mega-batch of Hugging Face's `group_by_length`).
pub const LENGTH_GROUP_BATCHES: usize = 50;

/// The shuffling rule of one dataset: `len` samples, one seed for the whole run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BatchOrder {
    len: usize,
    seed: u64,
}

impl BatchOrder {
    /// Orders over `len` samples drawn from `seed`.
    pub fn new(len: usize, seed: u64) -> Self {
        Self { len, seed }
    }
    /// The seed the orders are drawn from.
    pub fn seed(&self) -> u64 {
        self.seed
    }
    /// Samples per epoch.
    pub fn len(&self) -> usize {
        self.len
    }
    /// True when there are no samples.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// The permutation of `0..len` for `epoch`: a Fisher–Yates shuffle by
    /// `Rng::new(seed ^ mix64(epoch + salt))`.
    pub fn permutation(&self, epoch: u64) -> Vec<usize> {
        let mut perm: Vec<usize> = (0..self.len).collect();
        Rng::new(self.seed ^ mix64(epoch.wrapping_add(EPOCH_SALT))).shuffle(&mut perm);
        perm
    }
    /// The permutation of `epoch` regrouped so that each batch holds samples of similar
    /// length (`lengths[i]`: sample `i`'s tokens), which cuts the padding a batch of random
    /// lengths carries (Rotten Tomatoes: about half its tokens). The shuffled order is cut
    /// into windows of `LENGTH_GROUP_BATCHES` batches, each window is sorted by length
    /// (stable, so ties keep the shuffled order) and cut into batches, and the full batches
    /// are shuffled across the epoch by the same epoch's generator; the short remainder, if
    /// any, stays last, so [`EpochOrder::next_batch`] and resuming work as before.
    pub fn grouped_by_length(&self, epoch: u64, lengths: &[usize], batch_size: usize) -> Result<Vec<usize>> {
        if lengths.len() != self.len || batch_size == 0 {
            return Err(config_error(
                "length grouping",
                format!(
                    "has {} lengths for {} samples and batch size {batch_size}; expected one length per sample and a batch size of at least 1",
                    lengths.len(),
                    self.len
                ),
            ));
        }
        let mut rng = Rng::new(self.seed ^ mix64(epoch.wrapping_add(EPOCH_SALT)));
        let mut perm: Vec<usize> = (0..self.len).collect();
        rng.shuffle(&mut perm);
        for window in perm.chunks_mut(batch_size.saturating_mul(LENGTH_GROUP_BATCHES)) {
            window.sort_by_key(|&i| lengths[i]);
        }
        let full = self.len / batch_size * batch_size;
        let mut batches: Vec<&[usize]> = perm[..full].chunks(batch_size).collect();
        rng.shuffle(&mut batches);
        let mut grouped: Vec<usize> = batches.concat();
        grouped.extend_from_slice(&perm[full..]);
        Ok(grouped)
    }
    /// Epoch `epoch` from its start.
    pub fn epoch(&self, epoch: u64) -> EpochOrder {
        EpochOrder { epoch, perm: self.permutation(epoch), position: 0 }
    }
    /// Epoch `epoch` resumed at `position` (samples already consumed, `<= len`), e.g. from
    /// [`EpochOrder::position`] saved in a checkpoint.
    pub fn resume(&self, epoch: u64, position: usize) -> Result<EpochOrder> {
        if position > self.len {
            return Err(config_error(
                "position",
                format!("is {position}, expected at most the epoch length {}", self.len),
            ));
        }
        Ok(EpochOrder { epoch, perm: self.permutation(epoch), position })
    }
}

/// One epoch's order and how far it has been consumed. Iterating yields sample indices.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EpochOrder {
    epoch: u64,
    perm: Vec<usize>,
    position: usize,
}

impl EpochOrder {
    /// The epoch number.
    pub fn epoch(&self) -> u64 {
        self.epoch
    }
    /// Samples consumed so far (save it to resume with [`BatchOrder::resume`]).
    pub fn position(&self) -> usize {
        self.position
    }
    /// Samples left in the epoch.
    pub fn remaining(&self) -> usize {
        self.perm.len() - self.position
    }
    /// The whole permutation, including consumed samples.
    pub fn permutation(&self) -> &[usize] {
        &self.perm
    }
    /// The next `batch_size` indices, advancing the position. At the end of the epoch a
    /// shorter final batch is returned unless `drop_last`; `None` once nothing (or, with
    /// `drop_last`, less than a full batch) is left, or when `batch_size` is 0.
    pub fn next_batch(&mut self, batch_size: usize, drop_last: bool) -> Option<&[usize]> {
        let left = self.remaining();
        if batch_size == 0 || left == 0 || (drop_last && left < batch_size) {
            return None;
        }
        let start = self.position;
        self.position += batch_size.min(left);
        Some(&self.perm[start..self.position])
    }
}

impl Iterator for EpochOrder {
    type Item = usize;

    fn next(&mut self) -> Option<usize> {
        let i = *self.perm.get(self.position)?;
        self.position += 1;
        Some(i)
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        (self.remaining(), Some(self.remaining()))
    }
}

impl ExactSizeIterator for EpochOrder {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn permutation_is_deterministic_and_differs_by_epoch_and_seed() {
        let order = BatchOrder::new(100, 7);
        let p0 = order.permutation(0);
        assert_eq!(p0, BatchOrder::new(100, 7).permutation(0));
        let mut sorted = p0.clone();
        sorted.sort_unstable();
        assert_eq!(sorted, (0..100).collect::<Vec<_>>());
        assert_ne!(p0, order.permutation(1));
        assert_ne!(p0, BatchOrder::new(100, 8).permutation(0));
        assert_ne!(p0, sorted, "a 100-element shuffle left everything in place");
    }

    #[test]
    fn resume_mid_epoch_gives_the_remaining_batches() {
        let order = BatchOrder::new(23, 3);
        let mut full = order.epoch(5);
        let mut batches = Vec::new();
        while let Some(b) = full.next_batch(4, false) {
            batches.push(b.to_vec());
        }
        assert_eq!(batches.len(), 6);
        assert_eq!(batches[5].len(), 3);
        let mut resumed = order.resume(5, 8).unwrap();
        assert_eq!(resumed.next_batch(4, false).unwrap(), batches[2].as_slice());
        assert_eq!(resumed.position(), 12);
        let rest: Vec<usize> = resumed.collect();
        assert_eq!(rest, batches[3..].concat());
        assert!(order.resume(5, 24).is_err());
    }

    #[test]
    fn drop_last_and_zero_batch() {
        let mut e = BatchOrder::new(10, 1).epoch(0);
        assert!(e.next_batch(0, false).is_none());
        assert_eq!(e.next_batch(4, true).map(<[usize]>::len), Some(4));
        assert_eq!(e.next_batch(4, true).map(<[usize]>::len), Some(4));
        assert!(e.next_batch(4, true).is_none());
        assert_eq!(e.next_batch(4, false).map(<[usize]>::len), Some(2));
        assert!(e.next_batch(4, false).is_none());
        assert!(BatchOrder::new(0, 1).epoch(0).next().is_none());
    }

    #[test]
    fn length_grouping_is_a_seeded_permutation_with_uniform_batches() {
        let lengths: Vec<usize> = (0..1000).map(|i| (i * 7919) % 61 + 3).collect();
        let order = BatchOrder::new(1000, 11);
        let g = order.grouped_by_length(2, &lengths, 32).unwrap();
        assert_eq!(g, order.grouped_by_length(2, &lengths, 32).unwrap());
        assert_ne!(g, order.grouped_by_length(3, &lengths, 32).unwrap());
        let mut sorted = g.clone();
        sorted.sort_unstable();
        assert_eq!(sorted, (0..1000).collect::<Vec<_>>());
        // Padded tokens (each batch padded to its longest) against the random order's.
        let padded = |perm: &[usize]| -> usize {
            perm.chunks(32).map(|b| b.len() * b.iter().map(|&i| lengths[i]).max().unwrap()).sum()
        };
        let real: usize = lengths.iter().sum();
        assert!(padded(&g) < real + real / 10, "grouped: {} padded tokens for {real}", padded(&g));
        assert!(padded(&order.permutation(2)) > real * 3 / 2);
        // Batches are shuffled: lengths do not rise through the epoch window by window.
        let firsts: Vec<usize> = g.chunks(32).take(31).map(|b| lengths[b[0]]).collect();
        assert!(firsts.windows(2).any(|w| w[0] > w[1]) && firsts.windows(2).any(|w| w[0] < w[1]));
        // The 1000 mod 32 = 8 leftover samples are the last batch: the longest of the last
        // window (here all of the longest length, 63), in order of length.
        let tail: Vec<usize> = g[992..].iter().map(|&i| lengths[i]).collect();
        assert_eq!(tail, [63; 8]);
        assert!(order.grouped_by_length(2, &lengths[1..], 32).is_err());
        assert!(order.grouped_by_length(2, &lengths, 0).is_err());
    }
}
