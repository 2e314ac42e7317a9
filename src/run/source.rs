//! `SampleSource`: any dataset as a [`BatchSource`] — training samples in a seeded order per
//! epoch, evaluation samples in file order, and a function that turns samples into a
//! [`HostBatch`] (images, token sequences, tokenised text).

use crate::data::BatchOrder;
use crate::error::{Result, data_error};
use crate::model::HostBatch;
use crate::rng::{Rng, hash_u64};
use crate::train::BatchSource;

/// Builds a batch from samples and the position of the first one in its epoch.
pub type MakeBatch<S> = Box<dyn Fn(&[&S], u64) -> Result<HostBatch> + Send + Sync>;

/// A training sample as an epoch sees it (random augmentation), from the sample and the epoch.
pub type Augment<S> = Box<dyn Fn(&S, u64) -> S + Send + Sync>;

/// Training and evaluation samples plus their batch builder.
pub struct SampleSource<S> {
    train: Vec<S>,
    test: Vec<S>,
    order: BatchOrder,
    /// The current epoch's permutation, so a step does not reshuffle the whole training set.
    epoch_perm: std::sync::Mutex<Option<(u64, std::sync::Arc<Vec<usize>>)>>,
    batch_size: usize,
    eval_batch_size: usize,
    make_batch: MakeBatch<S>,
    /// What training samples pass through before batching ([`augment`](Self::augment)).
    augment: Option<Augment<S>>,
    /// Token counts of the training samples when batches are grouped by length.
    train_lengths: Option<Vec<usize>>,
    /// The order evaluation batches take the test samples in (file order, or by length).
    eval_order: Vec<usize>,
    /// The fewest samples a training step can be split into ([`least_batch`](Self::least_batch)).
    least_batch: usize,
    /// The training samples' ids and the order's seed, hashed, when the ids are known
    /// ([`ids`](Self::ids)): with the grouping, the [fingerprint](BatchSource::fingerprint).
    ids_hash: Option<u64>,
}

impl<S> SampleSource<S> {
    /// A source over `train` (shuffled per epoch by `seed`) and `test`. Errors if either is
    /// empty or a batch size is 0.
    pub fn new(
        train: Vec<S>,
        test: Vec<S>,
        seed: u64,
        batch_size: usize,
        eval_batch_size: usize,
        make_batch: MakeBatch<S>,
    ) -> Result<Self> {
        if train.is_empty() || test.is_empty() {
            return Err(data_error("dataset", "the training or test set is empty"));
        }
        if batch_size == 0 || eval_batch_size == 0 {
            return Err(data_error("batch size", "must be at least 1"));
        }
        let order = BatchOrder::new(train.len(), seed);
        let eval_order = (0..test.len()).collect();
        Ok(Self {
            train,
            test,
            order,
            epoch_perm: Default::default(),
            batch_size,
            eval_batch_size,
            make_batch,
            augment: None,
            train_lengths: None,
            eval_order,
            least_batch: 1,
            ids_hash: None,
        })
    }

    /// Gives the training samples' stable ids (`id` of each, in order), so the source has a
    /// [fingerprint](BatchSource::fingerprint): the ids, the order's seed and whether batches
    /// group by length.
    pub fn ids(mut self, id: impl Fn(&S) -> u64) -> Self {
        self.ids_hash = Some(self.train.iter().fold(self.order.seed(), |h, s| hash_u64(h, id(s))));
        self
    }

    /// Training samples pass through `augment` (with their epoch) before each batch is made;
    /// evaluation samples never do.
    pub fn augment(mut self, augment: Augment<S>) -> Self {
        self.augment = Some(augment);
        self
    }

    /// Steps need at least `least` samples (one per replica of every process): an epoch's
    /// last batch that would be shorter joins the one before it, so every sample is still
    /// seen once per epoch and no step is left that the replicas cannot share.
    pub fn least_batch(mut self, least: usize) -> Self {
        self.least_batch = least.max(1);
        self
    }

    /// Batches of similar length, given each sample's length: training batches by
    /// [`BatchOrder::grouped_by_length`], evaluation batches in order of length, longest first
    /// (the metrics do not depend on the order, the padding does; and each batch then fits in
    /// the buffers the one before it freed).
    pub fn group_by_length(mut self, length: impl Fn(&S) -> Result<usize>) -> Result<Self> {
        self.train_lengths = Some(self.train.iter().map(&length).collect::<Result<_>>()?);
        let test_lengths: Vec<usize> = self.test.iter().map(&length).collect::<Result<_>>()?;
        self.eval_order.sort_by_key(|&i| std::cmp::Reverse(test_lengths[i]));
        *self.epoch_perm.get_mut().unwrap_or_else(|e| e.into_inner()) = None;
        Ok(self)
    }

    /// The permutation of `epoch`, computed once per epoch.
    fn permutation(&self, epoch: u64) -> Result<std::sync::Arc<Vec<usize>>> {
        let mut cached = self.epoch_perm.lock().unwrap_or_else(|e| e.into_inner());
        match &*cached {
            Some((e, perm)) if *e == epoch => Ok(perm.clone()),
            _ => {
                let perm = match &self.train_lengths {
                    Some(lengths) => self.order.grouped_by_length(epoch, lengths, self.batch_size)?,
                    None => self.order.permutation(epoch),
                };
                let perm = std::sync::Arc::new(perm);
                *cached = Some((epoch, perm.clone()));
                Ok(perm)
            }
        }
    }

    /// Training samples.
    pub fn train_len(&self) -> usize {
        self.train.len()
    }

    /// Evaluation samples.
    pub fn test_len(&self) -> usize {
        self.test.len()
    }
}

/// Keeps a seeded random `limit` of `samples` (all when `limit` is 0 or larger), in their
/// original order: a quick run sees a fair slice, not the file's first rows.
pub fn subset<S>(samples: Vec<S>, limit: usize, seed: u64) -> Vec<S> {
    if limit == 0 || limit >= samples.len() {
        return samples;
    }
    let mut pick: Vec<usize> = (0..samples.len()).collect();
    Rng::new(seed).shuffle(&mut pick);
    let mut keep = vec![false; samples.len()];
    for &i in &pick[..limit] {
        keep[i] = true;
    }
    samples.into_iter().zip(keep).filter_map(|(s, k)| k.then_some(s)).collect()
}

impl<S: Send + Sync> BatchSource for SampleSource<S> {
    fn batches_per_epoch(&self) -> usize {
        let (len, size) = (self.train.len(), self.batch_size);
        let batches = len.div_ceil(size);
        match batches > 1 && len - (batches - 1) * size < self.least_batch {
            true => batches - 1,
            false => batches,
        }
    }

    fn train_batch(&self, epoch: u64, index: usize) -> Result<HostBatch> {
        let perm = self.permutation(epoch)?;
        let (start, batches) = (index * self.batch_size, self.batches_per_epoch());
        let end = match index + 1 == batches {
            true => perm.len(),
            false => (start + self.batch_size).min(perm.len()),
        };
        if index >= batches || start >= end {
            return Err(data_error("training batch", format!("index {index} is past the end of the epoch")));
        }
        let samples: Vec<&S> = perm[start..end].iter().map(|&i| &self.train[i]).collect();
        match &self.augment {
            Some(augment) => {
                let views: Vec<S> = samples.iter().map(|s| augment(s, epoch)).collect();
                (self.make_batch)(&views.iter().collect::<Vec<_>>(), start as u64)
            }
            None => (self.make_batch)(&samples, start as u64),
        }
    }

    fn eval_batches(&self) -> usize {
        self.test.len().div_ceil(self.eval_batch_size)
    }

    fn fingerprint(&self) -> Option<u64> {
        self.ids_hash.map(|h| hash_u64(h, u64::from(self.train_lengths.is_some())))
    }

    fn eval_batch(&self, index: usize) -> Result<HostBatch> {
        let start = index * self.eval_batch_size;
        let end = (start + self.eval_batch_size).min(self.test.len());
        if start >= end {
            return Err(data_error("evaluation batch", format!("index {index} is past the end")));
        }
        let samples: Vec<&S> = self.eval_order[start..end].iter().map(|&i| &self.test[i]).collect();
        (self.make_batch)(&samples, start as u64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn source() -> SampleSource<u32> {
        let make: MakeBatch<u32> = Box::new(|s, offset| {
            Ok(HostBatch {
                batch: s.len(),
                targets: s.iter().map(|&&x| x).collect(),
                sample_offset: offset,
                ..Default::default()
            })
        });
        SampleSource::new((0..10).collect(), vec![100, 101, 102], 7, 4, 2, make).unwrap()
    }

    #[test]
    fn an_epoch_covers_every_sample_once_in_the_seeded_order() {
        let s = source();
        assert_eq!(s.batches_per_epoch(), 3);
        for epoch in [0, 1, 0] {
            let seen: Vec<u32> = (0..3).flat_map(|i| s.train_batch(epoch, i).unwrap().targets).collect();
            let want: Vec<u32> = BatchOrder::new(10, 7).permutation(epoch).iter().map(|&i| i as u32).collect();
            assert_eq!(seen, want, "epoch {epoch}");
        }
        assert!(s.train_batch(0, 3).is_err());
        assert_eq!(s.eval_batches(), 2);
        assert_eq!(s.eval_batch(1).unwrap().targets, vec![102]);
        assert!(
            SampleSource::new(Vec::<u32>::new(), vec![1], 0, 1, 1, Box::new(|_, _| Ok(HostBatch::default()))).is_err()
        );
    }

    /// 10 samples in batches of 4 leave 2 for the last batch: kept when steps need at most 2
    /// samples, joined to the batch before when they need 3 (every sample still once).
    #[test]
    fn a_last_batch_too_short_for_the_replicas_joins_the_one_before() {
        for (least, sizes) in [(2, vec![4, 4, 2]), (3, vec![4, 6]), (1, vec![4, 4, 2])] {
            let s = source().least_batch(least);
            assert_eq!(s.batches_per_epoch(), sizes.len(), "least {least}");
            let batches: Vec<HostBatch> = (0..sizes.len()).map(|i| s.train_batch(1, i).unwrap()).collect();
            assert_eq!(batches.iter().map(|b| b.batch).collect::<Vec<_>>(), sizes, "least {least}");
            let seen: Vec<u32> = batches.into_iter().flat_map(|b| b.targets).collect();
            let want: Vec<u32> = BatchOrder::new(10, 7).permutation(1).iter().map(|&i| i as u32).collect();
            assert_eq!(seen, want, "least {least}");
            assert!(s.train_batch(1, sizes.len()).is_err());
        }
    }

    /// Training samples reach the batch through the augmentation, with their epoch; evaluation
    /// samples as they are.
    #[test]
    fn augmentation_sees_training_samples_and_their_epoch_only() {
        let s = source().augment(Box::new(|&x, epoch| x * 1000 + epoch as u32));
        let plain = source();
        for epoch in [0, 3] {
            let seen = s.train_batch(epoch, 1).unwrap().targets;
            let want: Vec<u32> =
                plain.train_batch(epoch, 1).unwrap().targets.iter().map(|x| x * 1000 + epoch as u32).collect();
            assert_eq!(seen, want, "epoch {epoch}");
        }
        assert_eq!(s.eval_batch(0).unwrap().targets, plain.eval_batch(0).unwrap().targets);
    }

    #[test]
    fn the_fingerprint_follows_the_ids_the_seed_and_the_grouping() {
        let fp = |s: SampleSource<u32>| s.ids(|&x| u64::from(x)).fingerprint().unwrap();
        let make =
            |train: Vec<u32>, seed| SampleSource::new(train, vec![100], seed, 4, 2, source().make_batch).unwrap();
        let base = fp(source());
        assert_eq!(base, fp(make((0..10).collect(), 7)), "the same samples and seed");
        assert_ne!(base, fp(make((0..10).collect(), 8)), "another seed");
        assert_ne!(base, fp(make((1..11).collect(), 7)), "other samples");
        assert_ne!(base, fp(source().group_by_length(|&x| Ok(x as usize)).unwrap()), "grouped by length");
        assert_eq!(source().fingerprint(), None, "no ids given");
    }

    #[test]
    fn grouped_by_length_batches_are_uniform_and_evaluation_runs_longest_first() {
        // A sample's "length" is its value mod 7; batches of 4 over 40 samples.
        let s = SampleSource::new((0..40).collect(), vec![13, 7, 22, 1, 5], 3, 4, 2, source().make_batch)
            .unwrap()
            .group_by_length(|&x| Ok(x as usize % 7))
            .unwrap();
        let batches: Vec<Vec<u32>> = (0..10).map(|i| s.train_batch(1, i).unwrap().targets).collect();
        let mut all: Vec<u32> = batches.concat();
        all.sort_unstable();
        assert_eq!(all, (0..40).collect::<Vec<_>>());
        let spread: u32 = batches
            .iter()
            .map(|b| b.iter().map(|x| x % 7).max().unwrap() - b.iter().map(|x| x % 7).min().unwrap())
            .sum();
        assert!(spread <= 10, "batches mix lengths: {batches:?}");
        let eval: Vec<u32> = (0..3).flat_map(|i| s.eval_batch(i).unwrap().targets).collect();
        // Lengths 6, 5, 1, 1, 0 (ties in the test split's order).
        assert_eq!(eval, vec![13, 5, 22, 1, 7]);
        assert!(
            SampleSource::new(vec![1u32], vec![1], 0, 1, 1, source().make_batch)
                .unwrap()
                .group_by_length(|_| Err(data_error("text", "bad")))
                .is_err()
        );
    }
}
