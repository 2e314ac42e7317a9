//! Row-wise softmax over the last dimension (max-subtracted), and its backward
//! `dinp = out ⊙ (dout − Σ out⊙dout)`.

use crate::error::{Result, check_len};
use crate::scalar::Float;
use rayon::prelude::*;

/// Rows per rayon task: about this many elements, so short rows are batched instead of paying a
/// task each.
const TASK_ELEMS: usize = 4096;

/// How many rows of `cols` elements one rayon task takes at least.
fn rows_per_task(cols: usize) -> usize {
    (TASK_ELEMS / cols.max(1)).max(1)
}

/// Softmax of one row. Subtracting the row max keeps every `exp` in (0, 1], so nothing
/// overflows; the sum is sequential, so the result does not depend on the thread count. A row
/// with no finite maximum gets zeros when it is all `−∞` (everything masked), and NaNs when it
/// holds a NaN (which `max` skips), as any row with a NaN does: a diverged input must not come
/// out as a clean zero row.
#[inline]
fn softmax_row<T: Float>(out: &mut [T], inp: &[T]) {
    let max = inp.iter().fold(T::from_f64(f64::NEG_INFINITY), |m, &x| m.max(x));
    if max.to_f64() == f64::NEG_INFINITY {
        let nan = inp.iter().any(|x| x.to_f64().is_nan());
        out.fill(if nan { T::from_f64(f64::NAN) } else { T::ZERO });
        return;
    }
    let mut sum = T::ZERO;
    for (o, &x) in out.iter_mut().zip(inp) {
        let e = (x - max).exp();
        *o = e;
        sum += e;
    }
    let inv = T::ONE / sum;
    for o in out.iter_mut() {
        *o *= inv;
    }
}

/// Softmax of each of `rows` rows of `cols` elements.
pub fn softmax_forward<T: Float>(out: &mut [T], inp: &[T], rows: usize, cols: usize) -> Result<()> {
    check_len("softmax_forward", "inp", inp.len(), rows * cols)?;
    check_len("softmax_forward", "out", out.len(), rows * cols)?;
    if cols == 0 {
        return Ok(()); // nothing to write, and chunks of 0 elements are not allowed
    }
    out.par_chunks_mut(cols)
        .zip(inp.par_chunks(cols))
        .with_min_len(rows_per_task(cols))
        .for_each(|(out, inp)| softmax_row(out, inp));
    Ok(())
}

/// Writes `dinp` from the forward's `out` and the upstream `dout`.
pub fn softmax_backward<T: Float>(dinp: &mut [T], out: &[T], dout: &[T], rows: usize, cols: usize) -> Result<()> {
    check_len("softmax_backward", "out", out.len(), rows * cols)?;
    check_len("softmax_backward", "dout", dout.len(), rows * cols)?;
    check_len("softmax_backward", "dinp", dinp.len(), rows * cols)?;
    if cols == 0 {
        return Ok(());
    }
    dinp.par_chunks_mut(cols)
        .zip(out.par_chunks(cols))
        .zip(dout.par_chunks(cols))
        .with_min_len(rows_per_task(cols))
        .for_each(|((dinp, out), dout)| {
            // ∂L/∂xᵢ = Σⱼ yⱼ(δᵢⱼ − yᵢ)·gⱼ = yᵢ·(gᵢ − Σⱼ yⱼgⱼ).
            let mut dot = T::ZERO;
            for (&y, &g) in out.iter().zip(dout) {
                dot += y * g;
            }
            for ((d, &y), &g) in dinp.iter_mut().zip(out).zip(dout) {
                *d = y * (g - dot);
            }
        });
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::Error;
    use crate::testing::{FD_STEP, Rng, assert_grad, dot, numeric_gradient, rel_err};

    fn forward(x: &[f64], rows: usize, cols: usize) -> Vec<f64> {
        let mut out = vec![0.0; x.len()];
        softmax_forward(&mut out, x, rows, cols).unwrap();
        out
    }

    #[test]
    fn backward_matches_finite_differences() {
        for cols in [7, 15] {
            let rows = 3 * 13;
            let mut rng = Rng::new(cols as u64);
            let mut x = rng.vec(rows * cols, 3.0);
            let r = rng.vec(rows * cols, 1.0);
            let out = forward(&x, rows, cols);
            let mut dinp = vec![0.0; rows * cols];
            softmax_backward(&mut dinp, &out, &r, rows, cols).unwrap();
            let numeric = numeric_gradient(&mut x, FD_STEP, |x| dot(&forward(x, rows, cols), &r));
            assert_grad("softmax dinp", &dinp, &numeric);
        }
    }

    #[test]
    fn forward_matches_reference_and_rows_sum_to_one() {
        let (rows, cols) = (39, 15);
        let mut rng = Rng::new(3);
        let mut x = rng.vec(rows * cols, 5.0);
        x[0] = 700.0; // would overflow exp without the max subtraction
        let out = forward(&x, rows, cols);
        let mut want = vec![0.0; rows * cols];
        for (w, x) in want.chunks_mut(cols).zip(x.chunks(cols)) {
            let m = x.iter().cloned().fold(f64::MIN, f64::max);
            let z: f64 = x.iter().map(|v| (v - m).exp()).sum();
            for (w, v) in w.iter_mut().zip(x) {
                *w = (v - m).exp() / z;
            }
        }
        assert!(rel_err(&out, &want) < 1e-14);
        for row in out.chunks(cols) {
            assert!((row.iter().sum::<f64>() - 1.0).abs() < 1e-12);
        }
    }

    #[test]
    fn fully_masked_row_is_zero() {
        let x = [f64::NEG_INFINITY; 4];
        assert_eq!(forward(&x, 1, 4), vec![0.0; 4]);
    }

    #[test]
    fn f32_matches_f64() {
        let (rows, cols) = (300, 129);
        let mut rng = Rng::new(8);
        let x32: Vec<f32> = rng.vec(rows * cols, 8.0).iter().map(|&v| v as f32).collect();
        let x64: Vec<f64> = x32.iter().map(|&v| v as f64).collect();
        let mut out32 = vec![0.0f32; rows * cols];
        softmax_forward(&mut out32, &x32, rows, cols).unwrap();
        let e = rel_err(&out32, &forward(&x64, rows, cols));
        assert!(e < 1e-5, "softmax f32 vs f64 rel err {e:.2e}");
    }

    #[test]
    fn one_and_two_threads_are_bitwise_equal() {
        let (rows, cols) = (257, 333);
        let mut rng = Rng::new(4);
        let x: Vec<f32> = rng.vec(rows * cols, 6.0).iter().map(|&v| v as f32).collect();
        let g: Vec<f32> = rng.vec(rows * cols, 1.0).iter().map(|&v| v as f32).collect();
        let run = |threads: usize| {
            let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
            pool.install(|| {
                let mut out = vec![0.0f32; rows * cols];
                softmax_forward(&mut out, &x, rows, cols).unwrap();
                let mut dinp = vec![0.0f32; rows * cols];
                softmax_backward(&mut dinp, &out, &g, rows, cols).unwrap();
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                (bits(&out), bits(&dinp))
            })
        };
        assert!(run(1) == run(2), "softmax differs between 1 and 2 threads");
    }

    #[test]
    fn wrong_lengths_are_shape_errors() {
        let mut out = [0.0f64; 6];
        let err = softmax_forward(&mut out, &[0.0; 5], 2, 3).unwrap_err();
        assert!(matches!(err, Error::Shape { arg: "inp", got: 5, expected: 6, .. }), "{err}");
        assert!(err.to_string().contains("`inp`"), "{err}");
        let err = softmax_forward(&mut out[..4], &[0.0; 6], 2, 3).unwrap_err();
        assert!(matches!(err, Error::Shape { arg: "out", .. }), "{err}");

        let mut dinp = [0.0f64; 6];
        let err = softmax_backward(&mut dinp, &[0.0; 6], &[0.0; 7], 2, 3).unwrap_err();
        assert!(matches!(err, Error::Shape { arg: "dout", .. }), "{err}");
        assert!(err.to_string().contains("`dout`"), "{err}");
        let err = softmax_backward(&mut dinp, &[0.0; 3], &[0.0; 6], 2, 3).unwrap_err();
        assert!(matches!(err, Error::Shape { arg: "out", .. }), "{err}");
        let err = softmax_backward(&mut dinp[..5], &[0.0; 6], &[0.0; 6], 2, 3).unwrap_err();
        assert!(matches!(err, Error::Shape { arg: "dinp", .. }), "{err}");
    }
}
