//! Sequence pooling for classification: the first token (`[CLS]`, ViT's class token) and the
//! masked mean over tokens (sentence-transformers' pooling for all-MiniLM-L6-v2).

use crate::error::{Result, check_len};
use crate::scalar::Float;
use rayon::prelude::*;

/// Sequences per rayon task: about this many input elements, so tiny sequences are batched.
const TASK_ELEMS: usize = 4096;

/// How many sequences of `elems` elements one rayon task takes at least.
fn seqs_per_task(elems: usize) -> usize {
    (TASK_ELEMS / elems.max(1)).max(1)
}

/// `1 / max(Σ_t m[t], 1)` for one sequence's mask (`None`: every token is real). Computed the
/// same way by the forward and the backward so the two stay exact transposes.
#[inline]
fn mean_scale<T: Float>(mask: Option<&[u32]>, seq: usize) -> T {
    let count = match mask {
        Some(m) => m.iter().filter(|&&v| v != 0).count(),
        None => seq,
    };
    T::ONE / T::from_f64(count.max(1) as f64)
}

/// `out[b, :] = inp[b, 0, :]`, `inp` as `[batch, seq, dim]`.
pub fn first_token_pool_forward<T: Float>(
    out: &mut [T],
    inp: &[T],
    batch: usize,
    seq: usize,
    dim: usize,
) -> Result<()> {
    // A sequence needs a first token: with `seq = 0` the expected length asks for one.
    let seq = seq.max(1);
    check_len("first_token_pool_forward", "inp", inp.len(), batch * seq * dim)?;
    check_len("first_token_pool_forward", "out", out.len(), batch * dim)?;
    if batch * dim == 0 {
        return Ok(());
    }
    out.par_chunks_mut(dim)
        .zip(inp.par_chunks(seq * dim))
        .with_min_len(seqs_per_task(dim))
        .for_each(|(out, inp)| out.copy_from_slice(&inp[..dim]));
    Ok(())
}

/// Writes `dinp`: `dout[b]` at token 0, zeros elsewhere.
pub fn first_token_pool_backward<T: Float>(
    dinp: &mut [T],
    dout: &[T],
    batch: usize,
    seq: usize,
    dim: usize,
) -> Result<()> {
    let seq = seq.max(1);
    check_len("first_token_pool_backward", "dinp", dinp.len(), batch * seq * dim)?;
    check_len("first_token_pool_backward", "dout", dout.len(), batch * dim)?;
    if batch * dim == 0 {
        return Ok(());
    }
    dinp.par_chunks_mut(seq * dim).zip(dout.par_chunks(dim)).with_min_len(seqs_per_task(seq * dim)).for_each(
        |(dinp, dout)| {
            let (first, rest) = dinp.split_at_mut(dim);
            first.copy_from_slice(dout);
            rest.fill(T::ZERO);
        },
    );
    Ok(())
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
    check_len("mean_pool_forward", "inp", inp.len(), batch * seq * dim)?;
    check_len("mean_pool_forward", "out", out.len(), batch * dim)?;
    if let Some(m) = mask {
        check_len("mean_pool_forward", "mask", m.len(), batch * seq)?;
    }
    if dim == 0 {
        return Ok(());
    }
    out.par_chunks_mut(dim).enumerate().with_min_len(seqs_per_task(seq * dim)).for_each(|(b, out)| {
        let inp = &inp[b * seq * dim..(b + 1) * seq * dim];
        let mask = mask.map(|m| &m[b * seq..(b + 1) * seq]);
        // Sum the real tokens in order (deterministic), then scale once.
        out.fill(T::ZERO);
        for (t, token) in inp.chunks_exact(dim).enumerate() {
            if mask.is_none_or(|m| m[t] != 0) {
                for (o, &x) in out.iter_mut().zip(token) {
                    *o += x;
                }
            }
        }
        let scale = mean_scale::<T>(mask, seq);
        for o in out.iter_mut() {
            *o *= scale;
        }
    });
    Ok(())
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
    check_len("mean_pool_backward", "dinp", dinp.len(), batch * seq * dim)?;
    check_len("mean_pool_backward", "dout", dout.len(), batch * dim)?;
    if let Some(m) = mask {
        check_len("mean_pool_backward", "mask", m.len(), batch * seq)?;
    }
    if seq * dim == 0 {
        return Ok(());
    }
    dinp.par_chunks_mut(seq * dim)
        .zip(dout.par_chunks(dim))
        .enumerate()
        .with_min_len(seqs_per_task(seq * dim))
        .for_each(|(b, (dinp, dout))| {
            let mask = mask.map(|m| &m[b * seq..(b + 1) * seq]);
            let scale = mean_scale::<T>(mask, seq);
            for (t, token) in dinp.chunks_exact_mut(dim).enumerate() {
                if mask.is_none_or(|m| m[t] != 0) {
                    for (d, &g) in token.iter_mut().zip(dout) {
                        *d = g * scale;
                    }
                } else {
                    token.fill(T::ZERO);
                }
            }
        });
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_sequence_of_zero_tokens_pools_as_one() {
        let (mut out, mut dinp) = (vec![0.0; 4], vec![9.0; 4]);
        first_token_pool_forward(&mut out, &[1.0, 2.0, 3.0, 4.0], 2, 0, 2).unwrap();
        assert_eq!(out, [1.0, 2.0, 3.0, 4.0]);
        first_token_pool_backward(&mut dinp, &[5.0, 6.0, 7.0, 8.0], 2, 0, 2).unwrap();
        assert_eq!(dinp, [5.0, 6.0, 7.0, 8.0]);
    }
    use crate::error::Error;
    use crate::testing::{FD_STEP, Rng, assert_grad, dot, numeric_gradient, rel_err};

    const B: usize = 3;
    const S: usize = 13;
    const D: usize = 5;

    /// A padding mask with a partial row, a fully-masked row and a full row (nonzero values other
    /// than 1 count as real tokens).
    fn mask() -> Vec<u32> {
        let mut m = vec![0u32; B * S];
        m[..9].fill(1);
        m[2 * S..].fill(7);
        m
    }

    fn mean(x: &[f64], mask: Option<&[u32]>) -> Vec<f64> {
        let mut out = vec![0.0; B * D];
        mean_pool_forward(&mut out, x, mask, B, S, D).unwrap();
        out
    }

    #[test]
    fn mean_backward_matches_finite_differences() {
        let m = mask();
        for mask in [Some(&m[..]), None] {
            let mut rng = Rng::new(2);
            let mut x = rng.vec(B * S * D, 1.0);
            let r = rng.vec(B * D, 1.0);
            let mut dinp = vec![0.0; B * S * D];
            mean_pool_backward(&mut dinp, &r, mask, B, S, D).unwrap();
            let numeric = numeric_gradient(&mut x, FD_STEP, |x| dot(&mean(x, mask), &r));
            assert_grad("mean pool dinp", &dinp, &numeric);
        }
    }

    #[test]
    fn first_token_backward_matches_finite_differences() {
        let mut rng = Rng::new(3);
        let mut x = rng.vec(B * S * D, 1.0);
        let r = rng.vec(B * D, 1.0);
        let mut dinp = vec![1.0; B * S * D]; // stale values must be overwritten
        first_token_pool_backward(&mut dinp, &r, B, S, D).unwrap();
        let numeric = numeric_gradient(&mut x, FD_STEP, |x| {
            let mut out = vec![0.0; B * D];
            first_token_pool_forward(&mut out, x, B, S, D).unwrap();
            dot(&out, &r)
        });
        assert_grad("first token pool dinp", &dinp, &numeric);
    }

    #[test]
    fn forwards_match_reference() {
        let m = mask();
        let mut rng = Rng::new(4);
        let x = rng.vec(B * S * D, 1.0);
        let mut want = vec![0.0; B * D];
        for b in 0..B {
            let real: Vec<usize> = (0..S).filter(|&t| m[b * S + t] != 0).collect();
            for c in 0..D {
                let sum: f64 = real.iter().map(|&t| x[(b * S + t) * D + c]).sum();
                want[b * D + c] = if real.is_empty() { 0.0 } else { sum / real.len() as f64 };
            }
        }
        let got = mean(&x, Some(&m));
        assert!(rel_err(&got, &want) < 1e-14);
        assert_eq!(&got[D..2 * D], &[0.0; D], "a fully-masked row pools to zeros");

        let all = mean(&x, None);
        let ones = vec![1u32; B * S];
        assert!(rel_err(&all, &mean(&x, Some(&ones))) < 1e-15, "no mask is an all-ones mask");

        let mut first = vec![0.0; B * D];
        first_token_pool_forward(&mut first, &x, B, S, D).unwrap();
        for b in 0..B {
            assert_eq!(&first[b * D..(b + 1) * D], &x[b * S * D..b * S * D + D]);
        }
    }

    #[test]
    fn wrong_lengths_are_shape_errors() {
        let x = vec![0.0f64; B * S * D];
        let mut out = vec![0.0f64; B * D];
        let err = mean_pool_forward(&mut out, &x, Some(&[1; 5]), B, S, D).unwrap_err();
        assert!(matches!(err, Error::Shape { arg: "mask", got: 5, expected: 39, .. }), "{err}");
        assert!(err.to_string().contains("`mask`"), "{err}");
        let err = mean_pool_forward(&mut out, &x[1..], None, B, S, D).unwrap_err();
        assert!(matches!(err, Error::Shape { arg: "inp", .. }), "{err}");
        let err = mean_pool_forward(&mut out[1..], &x, None, B, S, D).unwrap_err();
        assert!(matches!(err, Error::Shape { arg: "out", .. }), "{err}");

        let mut dinp = vec![0.0f64; B * S * D];
        let err = mean_pool_backward(&mut dinp, &out[1..], None, B, S, D).unwrap_err();
        assert!(matches!(err, Error::Shape { arg: "dout", .. }), "{err}");
        let err = mean_pool_backward(&mut dinp[1..], &out, None, B, S, D).unwrap_err();
        assert!(matches!(err, Error::Shape { arg: "dinp", .. }), "{err}");
        let err = mean_pool_backward(&mut dinp, &out, Some(&[1; 40]), B, S, D).unwrap_err();
        assert!(matches!(err, Error::Shape { arg: "mask", .. }), "{err}");

        let err = first_token_pool_forward(&mut out, &x[1..], B, S, D).unwrap_err();
        assert!(matches!(err, Error::Shape { arg: "inp", .. }), "{err}");
        let err = first_token_pool_forward(&mut out, &[], B, 0, D).unwrap_err();
        assert!(matches!(err, Error::Shape { arg: "inp", .. }), "no first token to pool: {err}");
        let err = first_token_pool_backward(&mut dinp, &out[1..], B, S, D).unwrap_err();
        assert!(matches!(err, Error::Shape { arg: "dout", .. }), "{err}");
        assert!(err.to_string().contains("`dout`"), "{err}");
    }
}
