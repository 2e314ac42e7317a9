//! Inverted dropout with a counter-based mask: element `i` is kept iff
//! `hash_u64(seed, offset + i)` falls above `p·2⁶⁴`, and kept values are scaled by `1/(1−p)`.
//! Nothing is stored: the backward (and a CUDA kernel, and a micro-batch of the same samples)
//! recomputes the same mask from `(seed, offset + i)`.

use crate::error::{Result, check_len, config_error};
use crate::rng::hash_u64;
use crate::scalar::Float;
use rayon::prelude::*;

/// Whether element `counter` survives dropout with drop probability `p` (0 ≤ p < 1).
#[inline(always)]
pub fn dropout_keep(seed: u64, counter: u64, p: f32) -> bool {
    let threshold = (p as f64 * 18_446_744_073_709_551_616.0) as u64; // p·2⁶⁴, saturating
    hash_u64(seed, counter) >= threshold
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

/// `dst[i] = keep(offset + i) ? src[i]/(1−p) : 0`: the forward and the backward are the same map.
fn apply<T: Float>(dst: &mut [T], src: &[T], p: f32, seed: u64, offset: u64) {
    if p == 0.0 {
        // Keeps every element at scale 1: skip the hashing.
        dst.par_chunks_mut(CHUNK).zip(src.par_chunks(CHUNK)).for_each(|(d, s)| d.copy_from_slice(s));
        return;
    }
    let scale = T::from_f64(1.0 / (1.0 - p as f64));
    dst.par_chunks_mut(CHUNK).zip(src.par_chunks(CHUNK)).enumerate().for_each(|(c, (dst, src))| {
        let first = offset.wrapping_add((c * CHUNK) as u64);
        for (i, (d, &x)) in dst.iter_mut().zip(src).enumerate() {
            *d = if dropout_keep(seed, first.wrapping_add(i as u64), p) { x * scale } else { T::ZERO };
        }
    });
}

/// `out[i] = keep(i) ? inp[i]/(1−p) : 0`. `p = 0` is the identity (a copy).
pub fn dropout_forward<T: Float>(out: &mut [T], inp: &[T], p: f32, seed: u64, offset: u64) -> Result<()> {
    check_p(p)?;
    check_len("dropout_forward", "out", out.len(), inp.len())?;
    apply(out, inp, p, seed, offset);
    Ok(())
}

/// Writes `dinp[i] = keep(i) ? dout[i]/(1−p) : 0`, the same mask as the forward.
pub fn dropout_backward<T: Float>(dinp: &mut [T], dout: &[T], p: f32, seed: u64, offset: u64) -> Result<()> {
    check_p(p)?;
    check_len("dropout_backward", "dout", dout.len(), dinp.len())?;
    apply(dinp, dout, p, seed, offset);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::Error;
    use crate::testing::{FD_STEP, Rng, assert_grad, dot, numeric_gradient};

    fn forward(x: &[f64], p: f32, seed: u64, offset: u64) -> Vec<f64> {
        let mut out = vec![0.0; x.len()];
        dropout_forward(&mut out, x, p, seed, offset).unwrap();
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
        dropout_backward(&mut dinp, &r, p, seed, offset).unwrap();
        let numeric = numeric_gradient(&mut x, FD_STEP, |x| dot(&forward(x, p, seed, offset), &r));
        assert_grad("dropout dinp", &dinp, &numeric);
    }

    #[test]
    fn forward_and_backward_use_the_same_mask() {
        let n = 3 * CHUNK + 5;
        let ones = vec![1.0f32; n];
        let mut out = vec![0.0f32; n];
        let mut dinp = vec![0.0f32; n];
        dropout_forward(&mut out, &ones, 0.25, 7, 3).unwrap();
        dropout_backward(&mut dinp, &ones, 0.25, 7, 3).unwrap();
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
            dropout_forward(&mut out, &ones, p, 2024, 0).unwrap();
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
        dropout_forward(&mut whole, &x, 0.1, 77, base).unwrap();
        let mut parts = vec![0.0f32; n];
        let (first, second) = parts.split_at_mut(n1);
        dropout_forward(first, &x[..n1], 0.1, 77, base).unwrap();
        dropout_forward(second, &x[n1..], 0.1, 77, base + n1 as u64).unwrap();
        assert!(whole.iter().zip(&parts).all(|(a, b)| a.to_bits() == b.to_bits()));

        let mut dwhole = vec![0.0f32; n];
        dropout_backward(&mut dwhole, &x, 0.1, 77, base).unwrap();
        let mut dparts = vec![0.0f32; n];
        let (first, second) = dparts.split_at_mut(n1);
        dropout_backward(first, &x[..n1], 0.1, 77, base).unwrap();
        dropout_backward(second, &x[n1..], 0.1, 77, base + n1 as u64).unwrap();
        assert!(dwhole.iter().zip(&dparts).all(|(a, b)| a.to_bits() == b.to_bits()));
    }

    #[test]
    fn zero_p_is_a_copy() {
        let mut rng = Rng::new(1);
        let x = rng.vec(CHUNK + 3, 1.0);
        assert_eq!(forward(&x, 0.0, 5, 0), x);
        let mut dinp = vec![0.0; x.len()];
        dropout_backward(&mut dinp, &x, 0.0, 5, 0).unwrap();
        assert_eq!(dinp, x);
    }

    #[test]
    fn invalid_p_is_a_config_error() {
        let x = [1.0f64; 4];
        let mut out = [0.0f64; 4];
        for p in [1.0f32, 1.5, -0.1, f32::NAN] {
            let err = dropout_forward(&mut out, &x, p, 0, 0).unwrap_err();
            assert!(matches!(&err, Error::Config { field, .. } if field == "dropout"), "{err}");
            let msg = err.to_string();
            assert!(msg.contains(&p.to_string()) && msg.contains("0 <= p < 1"), "{msg}");
            assert!(dropout_backward(&mut out, &x, p, 0, 0).is_err());
        }
    }

    #[test]
    fn wrong_lengths_are_shape_errors() {
        let mut out = [0.0f64; 3];
        let err = dropout_forward(&mut out, &[0.0; 4], 0.1, 0, 0).unwrap_err();
        assert!(matches!(err, Error::Shape { arg: "out", got: 3, expected: 4, .. }), "{err}");
        assert!(err.to_string().contains("`out`"), "{err}");
        let err = dropout_backward(&mut out, &[0.0; 2], 0.1, 0, 0).unwrap_err();
        assert!(matches!(err, Error::Shape { arg: "dout", .. }), "{err}");
        assert!(err.to_string().contains("`dout`"), "{err}");
    }
}
