//! Element-wise tanh (BERT's pooler activation); the backward uses the saved output.

use crate::error::{Result, check_len};
use crate::scalar::Float;
use rayon::prelude::*;

/// Elements per rayon task (tanh is cheap; the pooler input is only `[batch, hidden]`).
const CHUNK: usize = 8 * 1024;

/// `out[i] = tanh(inp[i])`.
pub fn tanh_forward<T: Float>(out: &mut [T], inp: &[T]) -> Result<()> {
    check_len("tanh_forward", "inp", inp.len(), out.len())?;
    out.par_chunks_mut(CHUNK).zip(inp.par_chunks(CHUNK)).for_each(|(o, x)| {
        for (o, &x) in o.iter_mut().zip(x) {
            *o = x.tanh();
        }
    });
    Ok(())
}

/// Writes `dinp[i] = (1 − out[i]²)·dout[i]`.
pub fn tanh_backward<T: Float>(dinp: &mut [T], out: &[T], dout: &[T]) -> Result<()> {
    const OP: &str = "tanh_backward";
    check_len(OP, "out", out.len(), dinp.len())?;
    check_len(OP, "dout", dout.len(), dinp.len())?;
    dinp.par_chunks_mut(CHUNK).zip(out.par_chunks(CHUNK).zip(dout.par_chunks(CHUNK))).for_each(|(di, (y, d))| {
        for ((di, &y), &d) in di.iter_mut().zip(y).zip(d) {
            *di = (T::ONE - y * y) * d;
        }
    });
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Error;
    use crate::testing::{FD_STEP, Rng, assert_grad, dot, numeric_gradient, rel_err};

    #[test]
    fn forward_matches_std() {
        let mut rng = Rng::new(61);
        let x = rng.vec(39 * 7, 4.0);
        let mut out = vec![0.0; x.len()];
        tanh_forward(&mut out, &x).unwrap();
        let want: Vec<f64> = x.iter().map(|v| v.tanh()).collect();
        assert!(rel_err(&out, &want) < 1e-15);
    }

    #[test]
    fn backward_matches_finite_differences() {
        let mut rng = Rng::new(62);
        let n = 39 * 7;
        let (mut x, r) = (rng.vec(n, 3.0), rng.vec(n, 1.0));
        let mut out = vec![0.0; n];
        tanh_forward(&mut out, &x).unwrap();
        let mut dx = vec![7.0; n];
        tanh_backward(&mut dx, &out, &r).unwrap();
        let numeric = numeric_gradient(&mut x, FD_STEP, |x| {
            let mut out = vec![0.0; n];
            tanh_forward(&mut out, x).unwrap();
            dot(&out, &r)
        });
        assert_grad("dinp", &dx, &numeric);
    }

    #[test]
    fn wrong_lengths_are_shape_errors() {
        let mut out = vec![0.0f64; 4];
        let e = tanh_forward(&mut out, &[0.0; 5]).unwrap_err();
        assert!(matches!(e, Error::Shape { arg: "inp", .. }), "{e}");
        assert!(e.to_string().contains("`inp` has 5 elements, expected 4"), "{e}");
        let e = tanh_backward(&mut out, &[0.0; 4], &[0.0; 3]).unwrap_err();
        assert!(e.to_string().contains("`dout`"), "{e}");
    }
}
