//! Activation memory of token slices, and which schedule's residency the planner bounds.
//!
//! A slice of `l` tokens after `c` tokens of context, for a micro-batch of `b` sequences, keeps
//! `b·(l·per_token + l·(c+l)·per_score)` bytes on a stage until its backward: per-token
//! activations, and the attention probabilities of `l` queries over `c + l` keys. Over a whole
//! sequence cut into slices `l_1..l_n` the score term sums to `L²/2 + Σ l_i²/2`: finer slicing
//! always needs less (this is what TeraPipe saves even without 1F1B).

use crate::error::{Result, config_error};
use std::fmt;

/// Bytes a stage keeps for one slice, and what it keeps regardless of slicing.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct MemoryModel {
    /// Activation bytes one token of one sample keeps on a stage until its backward, excluding
    /// attention probabilities.
    pub per_token_bytes: f64,
    /// Bytes per query·key attention-probability element of one sample on a stage.
    pub per_score_bytes: f64,
    /// Bytes that do not depend on the slicing: weights, gradients, optimizer state.
    pub fixed_bytes: usize,
    /// Bytes only a sliced plan keeps: the key/value arenas of the resident micro-batches
    /// (each slice attends to the keys and values of the slices before it). A plan of one
    /// slice per micro-batch does without them.
    pub sliced_bytes: usize,
    /// Bytes only an unsliced plan keeps: the keys and values its trained attention saves
    /// with the activations, which `per_token_bytes` leaves out (a sliced plan keeps them in
    /// the arenas of `sliced_bytes`, which hold as much and their gradients).
    pub unsliced_bytes: usize,
}

impl MemoryModel {
    /// Activation bytes of a slice of `len` tokens after `context` tokens, `batch` sequences.
    pub fn slice_bytes(&self, batch: usize, len: usize, context: usize) -> f64 {
        let (b, l, c) = (batch as f64, len as f64, context as f64);
        b * (l * self.per_token_bytes + l * (c + l) * self.per_score_bytes)
    }

    /// Checks that the per-element sizes are finite and non-negative, and that the unsliced
    /// plan's keys and values are no more than the arenas that hold them (the search charges
    /// every plan the arenas: a bound only then).
    pub fn validate(&self) -> Result<()> {
        if self.unsliced_bytes > self.sliced_bytes {
            return Err(config_error(
                "terapipe.memory.unsliced_bytes",
                format!(
                    "{} bytes of keys and values exceed the {} bytes of the arenas that hold them and their gradients",
                    self.unsliced_bytes, self.sliced_bytes
                ),
            ));
        }
        for (field, v) in [("per_token_bytes", self.per_token_bytes), ("per_score_bytes", self.per_score_bytes)] {
            if !v.is_finite() || v < 0.0 {
                return Err(config_error(
                    format!("terapipe.memory.{field}"),
                    format!("{v} is not a finite, non-negative byte count"),
                ));
            }
        }
        Ok(())
    }
}

/// Which pipeline schedule over slices the memory limit is checked for.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum SliceSchedule {
    /// GPipe over slices (TeraPipe's official code): every forward, then every backward, so
    /// every slice of every micro-batch is resident at once. Peak = fixed + `sliced_bytes` when
    /// sliced (else `unsliced_bytes`) + Σ over all slices.
    #[default]
    Gpipe,
    /// 1F1B over slices: stage `s` (0-based) forwards `K − s` micro-batches, every slice of
    /// each, before its first backward, and then each backward frees a slice as a forward adds
    /// one: at most `K` micro-batches resident (1F1B's bound, in its tokens, stage 0's), the
    /// slices only shortening the fill and drain. Peak = fixed + `sliced_bytes` when sliced
    /// (else `unsliced_bytes`) + Σ over the `K` largest micro-batches' slices.
    OneFOneB,
}

impl fmt::Display for SliceSchedule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            SliceSchedule::Gpipe => "GPipe over slices",
            SliceSchedule::OneFOneB => "1F1B over slices",
        })
    }
}

/// Bytes as a short human string (KiB/MiB/GiB, three decimals: limits are compared in them).
pub(crate) fn human_bytes(bytes: usize) -> String {
    crate::bytes::display(bytes, 3)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slice_bytes_sum_to_the_closed_form() {
        let m = MemoryModel { per_token_bytes: 3.0, per_score_bytes: 2.0, ..Default::default() };
        // Slices 16, 8, 40 of a 64-token sequence: Σ l(c+l) = L²/2 + Σ l²/2.
        let (mut c, mut total) = (0, 0.0);
        for l in [16, 8, 40] {
            total += m.slice_bytes(2, l, c);
            c += l;
        }
        let closed = 2.0 * (64.0 * 3.0 + 2.0 * (64.0 * 64.0 / 2.0 + (256.0 + 64.0 + 1600.0) / 2.0));
        assert_eq!(total, closed);
        assert!(MemoryModel { per_token_bytes: -1.0, ..m }.validate().is_err());
        assert!(MemoryModel { per_score_bytes: f64::NAN, ..m }.validate().is_err());
        assert!(MemoryModel { unsliced_bytes: 2, sliced_bytes: 1, ..m }.validate().is_err());
        assert!(MemoryModel { unsliced_bytes: 1, sliced_bytes: 2, ..m }.validate().is_ok());
        assert_eq!(human_bytes(1536), "1.500 KiB");
    }
}
