//! Inverted dropout with a counter-based mask: element `i` is kept iff `hash_u64(seed, counter(i))`
//! is at least `p·2⁶⁴`, and kept values are scaled by `1/(1−p)`. Nothing is stored: the backward
//! (and a CUDA kernel, and a micro-batch or a token slice of the same samples) recomputes the same
//! mask from the element's coordinates ([`DropoutCoords`]).

use crate::error::{Result, check_len, config_error};
use crate::ops::simd::vectorized;
use crate::rng::hash_u64;
use crate::scalar::Float;
use rayon::prelude::*;

/// Whether element `counter` survives dropout with drop probability `p` (0 ≤ p < 1).
#[inline(always)]
pub fn dropout_keep(seed: u64, counter: u64, p: f32) -> bool {
    kept(seed, counter, keep_threshold(p))
}

/// `p·2⁶⁴`, saturating: the hash of a kept element is at least this. Every backend takes it
/// from here (the GPU kernels receive it as an argument), once per call, outside the loops.
#[inline(always)]
pub fn keep_threshold(p: f32) -> u64 {
    (p as f64 * 18_446_744_073_709_551_616.0) as u64
}

/// [`dropout_keep`] with its [`keep_threshold`] taken beforehand.
#[inline(always)]
pub fn kept(seed: u64, counter: u64, threshold: u64) -> bool {
    hash_u64(seed, counter) >= threshold
}

/// Where a tensor's elements sit in the mask's counter space: the tensor is rows of `row`
/// elements, and element `i` draws counter `offset + ⌊i/row⌋·stride + i mod row`. A whole batch is
/// one run (`row = stride`, or [`contiguous`](Self::contiguous)); a token slice of a batch is one
/// row per sample whose counters skip the positions outside the slice, so the slice draws exactly
/// the whole sequence's mask (TeraPipe's sliced step equals the unsliced one with dropout on).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DropoutCoords {
    /// Seed of the mask (the step's seed mixed with the dropout site).
    pub seed: u64,
    /// Counter of element 0.
    pub offset: u64,
    /// Elements per row (consecutive counters). 64 bits: a whole tensor is one row, and one of
    /// more than 2³² elements must not draw its first elements' counters again.
    pub row: u64,
    /// Counter distance between the starts of consecutive rows.
    pub stride: u64,
}

impl DropoutCoords {
    /// Element `i` draws counter `offset + i`.
    pub fn contiguous(seed: u64, offset: u64) -> Self {
        DropoutCoords { seed, offset, row: u64::MAX, stride: 0 }
    }

    /// The counter of element `i`.
    #[inline(always)]
    pub fn counter(&self, i: usize) -> u64 {
        let (r, i) = (self.row, i as u64);
        self.offset.wrapping_add((i / r).wrapping_mul(self.stride)).wrapping_add(i % r)
    }
}

/// Elements per rayon task. Each chunk knows its first element's index, so the mask does not
/// depend on how chunks are spread over threads.
const CHUNK: usize = 4096;

/// Rejects drop probabilities outside `[0, 1)` (including NaN): `p = 1` would scale by `1/0`.
pub(crate) fn check_p(p: f32) -> Result<()> {
    if (0.0..1.0).contains(&p) {
        Ok(())
    } else {
        Err(config_error("dropout", format!("drop probability {p} is out of range; expected 0 <= p < 1")))
    }
}

/// `dst[i] = keep(counter(i)) ? src[i]/(1−p) : 0`: the forward and the backward are the same map.
fn apply<T: Float>(dst: &mut [T], src: &[T], p: f32, at: DropoutCoords) {
    if p == 0.0 {
        // Keeps every element at scale 1: skip the hashing.
        dst.par_chunks_mut(CHUNK).zip(src.par_chunks(CHUNK)).for_each(|(d, s)| d.copy_from_slice(s));
        return;
    }
    let scale = T::from_f64(1.0 / (1.0 - p as f64));
    let threshold = keep_threshold(p);
    let row = usize::try_from(at.row).unwrap_or(usize::MAX);
    dst.par_chunks_mut(CHUNK).zip(src.par_chunks(CHUNK)).enumerate().for_each(|(c, (mut dst, mut src))| {
        // Row by row: the counter advances by one along a row (a run the hash vectorises over)
        // and jumps by the stride between rows.
        let mut i = c * CHUNK;
        while !dst.is_empty() {
            let len = (row - i % row).min(dst.len());
            let first = at.counter(i);
            let (d, rest) = std::mem::take(&mut dst).split_at_mut(len);
            let (s, rest_src) = src.split_at(len);
            vectorized(
                #[inline(always)]
                || mask_run(d, s, at.seed, first, threshold, scale),
            );
            (dst, src, i) = (rest, rest_src, i + len);
        }
    });
}

/// One row of [`apply`]: counters `first..`. The mask's parameters come in by value: captured
/// by reference, LLVM must assume each store to `d` may change them, reloads them for every
/// element and, where 64-bit vector multiplies are dear (AVX2), leaves the loop scalar (3.6×
/// slower there: docs/PERF.md).
#[inline(always)]
fn mask_run<T: Float>(d: &mut [T], s: &[T], seed: u64, first: u64, threshold: u64, scale: T) {
    for (e, (d, &x)) in d.iter_mut().zip(s).enumerate() {
        *d = if kept(seed, first.wrapping_add(e as u64), threshold) { x * scale } else { T::ZERO };
    }
}

/// `out[i] = keep(i) ? inp[i]/(1−p) : 0`. `p = 0` is the identity (a copy).
pub fn dropout_forward<T: Float>(out: &mut [T], inp: &[T], p: f32, at: DropoutCoords) -> Result<()> {
    check_p(p)?;
    check_len("dropout_forward", "out", out.len(), inp.len())?;
    apply(out, inp, p, at);
    Ok(())
}

/// Writes `dinp[i] = keep(i) ? dout[i]/(1−p) : 0`, the same mask as the forward.
pub fn dropout_backward<T: Float>(dinp: &mut [T], dout: &[T], p: f32, at: DropoutCoords) -> Result<()> {
    check_p(p)?;
    check_len("dropout_backward", "dout", dout.len(), dinp.len())?;
    apply(dinp, dout, p, at);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::Error;
    use crate::testing::{FD_STEP, Rng, assert_grad, dot, numeric_gradient};

    fn forward(x: &[f64], p: f32, seed: u64, offset: u64) -> Vec<f64> {
        let mut out = vec![0.0; x.len()];
        dropout_forward(&mut out, x, p, DropoutCoords::contiguous(seed, offset)).unwrap();
        out
    }

    #[test]
    fn backward_matches_finite_differences() {
        let n = 3 * 13 * 15;
        let mut rng = Rng::new(21);
        let mut x = rng.vec(n, 2.0);
        let r = rng.vec(n, 1.0);
        let (p, seed, offset) = (0.3, 99, 12345);
        let mut dinp = vec![0.0; n];
        dropout_backward(&mut dinp, &r, p, DropoutCoords::contiguous(seed, offset)).unwrap();
        let numeric = numeric_gradient(&mut x, FD_STEP, |x| dot(&forward(x, p, seed, offset), &r));
        assert_grad("dropout dinp", &dinp, &numeric);
    }

    #[test]
    fn forward_and_backward_use_the_same_mask() {
        let n = 3 * CHUNK + 5;
        let ones = vec![1.0f32; n];
        let mut out = vec![0.0f32; n];
        let mut dinp = vec![0.0f32; n];
        dropout_forward(&mut out, &ones, 0.25, DropoutCoords::contiguous(7, 3)).unwrap();
        dropout_backward(&mut dinp, &ones, 0.25, DropoutCoords::contiguous(7, 3)).unwrap();
        assert!(out.iter().zip(&dinp).all(|(a, b)| a.to_bits() == b.to_bits()));
        // Kept values are scaled by 1/(1−p); dropped ones are exactly zero.
        assert!(out.iter().all(|&v| v == 0.0 || (v - 1.0 / 0.75).abs() < 1e-6));
        for (i, &v) in out.iter().enumerate() {
            assert_eq!(v != 0.0, dropout_keep(7, 3 + i as u64, 0.25), "element {i}");
        }
    }

    #[test]
    fn kept_fraction_is_one_minus_p() {
        let n = 100_000;
        let ones = vec![1.0f32; n];
        let mut out = vec![0.0f32; n];
        for p in [0.1f32, 0.5, 0.9] {
            dropout_forward(&mut out, &ones, p, DropoutCoords::contiguous(2024, 0)).unwrap();
            let kept = out.iter().filter(|&&v| v != 0.0).count() as f64 / n as f64;
            let want = 1.0 - p as f64;
            assert!((kept - want).abs() <= 0.01 * want, "p = {p}: kept fraction {kept}, expected {want}");
        }
    }

    #[test]
    fn mask_depends_on_seed_and_offset_only() {
        let n = 2 * CHUNK + 11;
        let x = vec![1.0f64; n];
        let a = forward(&x, 0.5, 1, 0);
        assert_eq!(a, forward(&x, 0.5, 1, 0), "same seed and offset must give the same mask");
        let b = forward(&x, 0.5, 2, 0);
        let differing = a.iter().zip(&b).filter(|(a, b)| a != b).count();
        assert!(differing > n / 4, "a different seed changed only {differing} of {n} elements");
        let c = forward(&x, 0.5, 1, 1);
        assert_ne!(a, c, "a different offset must shift the mask");
    }

    #[test]
    fn split_calls_reproduce_one_call() {
        // How micro-batches reproduce the full batch: the second part starts at offset n1.
        let (n, n1, base) = (10_007, 4_321, 1_000_003);
        let mut rng = Rng::new(9);
        let x: Vec<f32> = rng.vec(n, 1.0).iter().map(|&v| v as f32).collect();
        let mut whole = vec![0.0f32; n];
        dropout_forward(&mut whole, &x, 0.1, DropoutCoords::contiguous(77, base)).unwrap();
        let mut parts = vec![0.0f32; n];
        let (first, second) = parts.split_at_mut(n1);
        dropout_forward(first, &x[..n1], 0.1, DropoutCoords::contiguous(77, base)).unwrap();
        dropout_forward(second, &x[n1..], 0.1, DropoutCoords::contiguous(77, base + n1 as u64)).unwrap();
        assert!(whole.iter().zip(&parts).all(|(a, b)| a.to_bits() == b.to_bits()));

        let mut dwhole = vec![0.0f32; n];
        dropout_backward(&mut dwhole, &x, 0.1, DropoutCoords::contiguous(77, base)).unwrap();
        let mut dparts = vec![0.0f32; n];
        let (first, second) = dparts.split_at_mut(n1);
        dropout_backward(first, &x[..n1], 0.1, DropoutCoords::contiguous(77, base)).unwrap();
        dropout_backward(second, &x[n1..], 0.1, DropoutCoords::contiguous(77, base + n1 as u64)).unwrap();
        assert!(dwhole.iter().zip(&dparts).all(|(a, b)| a.to_bits() == b.to_bits()));
    }

    #[test]
    fn zero_p_is_a_copy() {
        let mut rng = Rng::new(1);
        let x = rng.vec(CHUNK + 3, 1.0);
        assert_eq!(forward(&x, 0.0, 5, 0), x);
        let mut dinp = vec![0.0; x.len()];
        dropout_backward(&mut dinp, &x, 0.0, DropoutCoords::contiguous(5, 0)).unwrap();
        assert_eq!(dinp, x);
    }

    #[test]
    fn invalid_p_is_a_config_error() {
        let x = [1.0f64; 4];
        let mut out = [0.0f64; 4];
        for p in [1.0f32, 1.5, -0.1, f32::NAN] {
            let err = dropout_forward(&mut out, &x, p, DropoutCoords::contiguous(0, 0)).unwrap_err();
            assert!(matches!(&err, Error::Config { field, .. } if field == "dropout"), "{err}");
            let msg = err.to_string();
            assert!(msg.contains(&p.to_string()) && msg.contains("0 <= p < 1"), "{msg}");
            assert!(dropout_backward(&mut out, &x, p, DropoutCoords::contiguous(0, 0)).is_err());
        }
    }

    #[test]
    fn wrong_lengths_are_shape_errors() {
        let mut out = [0.0f64; 3];
        let err = dropout_forward(&mut out, &[0.0; 4], 0.1, DropoutCoords::contiguous(0, 0)).unwrap_err();
        assert!(matches!(err, Error::Shape { arg: "out", got: 3, expected: 4, .. }), "{err}");
        assert!(err.to_string().contains("`out`"), "{err}");
        let err = dropout_backward(&mut out, &[0.0; 2], 0.1, DropoutCoords::contiguous(0, 0)).unwrap_err();
        assert!(matches!(err, Error::Shape { arg: "dout", .. }), "{err}");
        assert!(err.to_string().contains("`dout`"), "{err}");
    }

    /// A token slice of a batch, as rows with a stride, draws the whole batch's mask.
    #[test]
    fn a_strided_slice_draws_the_whole_tensors_mask() {
        let (batch, seq, width, start, len) = (3usize, 11usize, 5usize, 4usize, 6usize);
        let whole_in: Vec<f32> = (0..batch * seq * width).map(|i| 1.0 + i as f32).collect();
        let mut whole = vec![0.0f32; whole_in.len()];
        dropout_forward(&mut whole, &whole_in, 0.4, DropoutCoords::contiguous(5, 1000)).unwrap();
        // The slice's rows: positions start..start+len of every sample.
        let pick = |v: &[f32]| -> Vec<f32> {
            (0..batch).flat_map(|b| v[(b * seq + start) * width..(b * seq + start + len) * width].to_vec()).collect()
        };
        let at = DropoutCoords {
            seed: 5,
            offset: 1000 + (start * width) as u64,
            row: (len * width) as u64,
            stride: (seq * width) as u64,
        };
        let mut sliced = vec![0.0f32; batch * len * width];
        dropout_forward(&mut sliced, &pick(&whole_in), 0.4, at).unwrap();
        assert_eq!(sliced, pick(&whole));
        assert!(sliced.contains(&0.0) && sliced.iter().any(|&v| v != 0.0));
        // A row no longer than a chunk and one longer than several: the chunked walk agrees with
        // `counter`.
        for row in [7u64, (3 * CHUNK + 1) as u64] {
            let at = DropoutCoords { seed: 1, offset: 3, row, stride: 100_000 };
            let ones = vec![1.0f32; 4 * CHUNK + 9];
            let mut out = vec![0.0f32; ones.len()];
            dropout_forward(&mut out, &ones, 0.5, at).unwrap();
            for (i, &v) in out.iter().enumerate() {
                assert_eq!(v != 0.0, dropout_keep(1, at.counter(i), 0.5), "row {row}, element {i}");
            }
        }
    }

    /// A whole tensor is one row: past 2³² elements the counters go on, where a 32-bit row
    /// length started them again and repeated the first elements' mask.
    #[test]
    fn a_whole_tensor_never_repeats_its_counters() {
        let at = DropoutCoords::contiguous(3, 10);
        for i in [0usize, 1 << 31, (1 << 32) - 1, 1 << 32, (1 << 32) + 5, 1 << 40] {
            assert_eq!(at.counter(i), 10 + i as u64, "element {i}");
        }
    }
}
