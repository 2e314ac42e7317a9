//! Residual connections: `out = a + b`; the backward sends `dout` to both branches, which units
//! do by accumulating the branch's input gradient onto the skip path's.

use crate::error::{Result, check_len};
use crate::ops::simd::vectorized;
use crate::scalar::Float;
use rayon::prelude::*;

/// Elements per rayon task: memory-bound adds, so only big slices are worth splitting.
const CHUNK: usize = 16 * 1024;

/// `out[i] = a[i] + b[i]`.
pub fn residual_forward<T: Float>(out: &mut [T], a: &[T], b: &[T]) -> Result<()> {
    const OP: &str = "residual_forward";
    check_len(OP, "a", a.len(), out.len())?;
    check_len(OP, "b", b.len(), out.len())?;
    out.par_chunks_mut(CHUNK).zip(a.par_chunks(CHUNK).zip(b.par_chunks(CHUNK))).for_each(|(o, (a, b))| {
        vectorized(
            #[inline(always)]
            || {
                for ((o, &a), &b) in o.iter_mut().zip(a).zip(b) {
                    *o = a + b;
                }
            },
        )
    });
    Ok(())
}

/// `dacc[i] += dout[i]`: adds one branch's gradient onto the other's.
pub fn residual_backward<T: Float>(dacc: &mut [T], dout: &[T]) -> Result<()> {
    check_len("residual_backward", "dout", dout.len(), dacc.len())?;
    dacc.par_chunks_mut(CHUNK).zip(dout.par_chunks(CHUNK)).for_each(|(acc, d)| {
        vectorized(
            #[inline(always)]
            || {
                for (acc, &d) in acc.iter_mut().zip(d) {
                    *acc += d;
                }
            },
        )
    });
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Error;
    use crate::testing::{FD_STEP, Rng, assert_grad, dot, numeric_gradient};

    /// Both branches get `dout`: `residual_backward` onto a zeroed buffer gives ∂L/∂a, and onto
    /// that buffer again (the other branch) gives 2·dout, as the units use it.
    #[test]
    fn backward_matches_finite_differences() {
        let mut rng = Rng::new(51);
        let n = 39 * 5 + CHUNK; // more than one parallel chunk
        let (mut a, mut b, r) = (rng.vec(n, 1.0), rng.vec(n, 1.0), rng.vec(n, 1.0));
        let loss = |a: &[f64], b: &[f64]| {
            let mut out = vec![0.0; n];
            residual_forward(&mut out, a, b).unwrap();
            dot(&out, &r)
        };
        let mut da = vec![0.0; n];
        residual_backward(&mut da, &r).unwrap();
        let b_ = b.clone();
        assert_grad("da", &da, &numeric_gradient(&mut a, FD_STEP, |x| loss(x, &b_)));
        let a_ = a.clone();
        let mut db = vec![0.0; n];
        residual_backward(&mut db, &r).unwrap();
        assert_grad("db", &db, &numeric_gradient(&mut b, FD_STEP, |x| loss(&a_, x)));
        residual_backward(&mut da, &r).unwrap();
        let twice: Vec<f64> = r.iter().map(|x| 2.0 * x).collect();
        assert_eq!(da, twice, "accumulates");
    }

    #[test]
    fn forward_adds() {
        let mut rng = Rng::new(52);
        let n = 2 * CHUNK + 7;
        let (a, b) = (rng.vec(n, 1.0), rng.vec(n, 1.0));
        let mut out = vec![0.0; n];
        residual_forward(&mut out, &a, &b).unwrap();
        assert!(out.iter().zip(a.iter().zip(&b)).all(|(o, (a, b))| *o == a + b));
    }

    #[test]
    fn wrong_lengths_are_shape_errors() {
        let mut out = vec![0.0f32; 4];
        let e = residual_forward(&mut out, &[0.0; 4], &[0.0; 3]).unwrap_err();
        assert!(matches!(e, Error::Shape { arg: "b", .. }), "{e}");
        assert!(e.to_string().contains("`b` has 3 elements, expected 4"), "{e}");
        let e = residual_backward(&mut out, &[0.0; 5]).unwrap_err();
        assert!(e.to_string().contains("`dout` has 5 elements, expected 4"), "{e}");
    }
}
