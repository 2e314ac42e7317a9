//! Linear layer with optional bias, weight in PyTorch layout `[out_dim, in_dim]`:
//! `out[r, o] = Σ_i inp[r, i]·weight[o, i] + bias[o]`. Also the tied LM head (weight = the token
//! embedding table, no bias) and the classifier head.
//!
//! The `*_in` variants take the arithmetic of the three matrix products ([`Products`]: the
//! element type, or bf16 operands with f32 accumulation); the bias and everything else stay in
//! the element type. With bf16 products they also take the weight already packed as the
//! products' B operand ([`PackedB`]: `Wᵀ` for the forward, `W` for the input gradient), which
//! a device keeps from one micro-batch to the next while the weight does not change.

use crate::error::{Result, check_len};
use crate::ops::gemm_bf16::{PackedB, Products, matmul_bf16_packed, matmul_in};
use crate::ops::matmul::MatRef;
use crate::ops::simd::vectorized;
use crate::scalar::Float;
use rayon::prelude::*;

/// Columns of `dbias` one task reduces: a few SIMD vectors, kept in a stack accumulator.
const BIAS_COLS: usize = 32;

/// `out[rows, out_dim] = inp[rows, in_dim] · weightᵀ + bias`.
#[allow(clippy::too_many_arguments)]
pub fn linear_forward<T: Float>(
    out: &mut [T],
    inp: &[T],
    weight: &[T],
    bias: Option<&[T]>,
    rows: usize,
    in_dim: usize,
    out_dim: usize,
) -> Result<()> {
    linear_forward_in(Products::Native, out, inp, weight, None, bias, rows, in_dim, out_dim)
}

/// [`linear_forward`] with the product in the arithmetic `products` names; `packed_wt`, if
/// given, is this `weight`'s transpose packed for bf16 products (the same result to the bit,
/// without packing it again).
#[allow(clippy::too_many_arguments)]
pub fn linear_forward_in<T: Float>(
    products: Products,
    out: &mut [T],
    inp: &[T],
    weight: &[T],
    packed_wt: Option<&PackedB>,
    bias: Option<&[T]>,
    rows: usize,
    in_dim: usize,
    out_dim: usize,
) -> Result<()> {
    const OP: &str = "linear_forward";
    check_len(OP, "out", out.len(), rows * out_dim)?;
    check_len(OP, "inp", inp.len(), rows * in_dim)?;
    check_len(OP, "weight", weight.len(), out_dim * in_dim)?;
    if let Some(bias) = bias {
        check_len(OP, "bias", bias.len(), out_dim)?;
    }
    if out_dim == 0 {
        return Ok(());
    }
    // With a bias, start every output row at the bias and let gemm accumulate onto it: one pass
    // over `out` instead of two.
    if let Some(bias) = bias {
        out.par_chunks_mut(out_dim).with_min_len(rows_per_task(out_dim)).for_each(|row| row.copy_from_slice(bias));
    }
    debug_assert!(packed_wt.is_none() || products == Products::Bf16, "a packed weight is for bf16 products");
    let a = MatRef::rows(inp, in_dim);
    match packed_wt {
        Some(wt) => matmul_bf16_packed(out, out_dim, a, wt, rows, out_dim, in_dim, bias.is_some()),
        None => {
            let b = MatRef::rows(weight, in_dim).t();
            matmul_in(products, out, out_dim, a, b, rows, out_dim, in_dim, bias.is_some());
        }
    }
    Ok(())
}

/// Writes `dinp = dout · weight` (if asked), adds `dweight += doutᵀ · inp` and
/// `dbias += Σ_rows dout` (if present).
#[allow(clippy::too_many_arguments)]
pub fn linear_backward<T: Float>(
    dinp: Option<&mut [T]>,
    dweight: Option<&mut [T]>,
    dbias: Option<&mut [T]>,
    dout: &[T],
    inp: &[T],
    weight: &[T],
    rows: usize,
    in_dim: usize,
    out_dim: usize,
) -> Result<()> {
    linear_backward_in(Products::Native, dinp, dweight, dbias, dout, inp, weight, None, rows, in_dim, out_dim)
}

/// [`linear_backward`] with the two products in the arithmetic `products` names; `packed_w`,
/// if given, is this `weight` packed for bf16 products (for `dinp`; the same result to the bit).
#[allow(clippy::too_many_arguments)]
pub fn linear_backward_in<T: Float>(
    products: Products,
    dinp: Option<&mut [T]>,
    dweight: Option<&mut [T]>,
    dbias: Option<&mut [T]>,
    dout: &[T],
    inp: &[T],
    weight: &[T],
    packed_w: Option<&PackedB>,
    rows: usize,
    in_dim: usize,
    out_dim: usize,
) -> Result<()> {
    const OP: &str = "linear_backward";
    check_len(OP, "dout", dout.len(), rows * out_dim)?;
    check_len(OP, "inp", inp.len(), rows * in_dim)?;
    check_len(OP, "weight", weight.len(), out_dim * in_dim)?;
    if let Some(dinp) = &dinp {
        check_len(OP, "dinp", dinp.len(), rows * in_dim)?;
    }
    if let Some(dweight) = &dweight {
        check_len(OP, "dweight", dweight.len(), out_dim * in_dim)?;
    }
    if let Some(dbias) = &dbias {
        check_len(OP, "dbias", dbias.len(), out_dim)?;
    }
    debug_assert!(packed_w.is_none() || products == Products::Bf16, "a packed weight is for bf16 products");
    let dout_m = MatRef::rows(dout, out_dim);
    if let Some(dinp) = dinp {
        // dinp[rows, in_dim] = dout[rows, out_dim] · weight[out_dim, in_dim]
        match packed_w {
            Some(w) => matmul_bf16_packed(dinp, in_dim, dout_m, w, rows, in_dim, out_dim, false),
            None => {
                matmul_in(products, dinp, in_dim, dout_m, MatRef::rows(weight, in_dim), rows, in_dim, out_dim, false)
            }
        }
    }
    if let Some(dweight) = dweight {
        // dweight[out_dim, in_dim] += doutᵀ[out_dim, rows] · inp[rows, in_dim]
        matmul_in(products, dweight, in_dim, dout_m.t(), MatRef::rows(inp, in_dim), out_dim, in_dim, rows, true);
    }
    if let Some(dbias) = dbias {
        bias_backward(dbias, dout, rows, out_dim);
    }
    Ok(())
}

/// `dbias += Σ_rows dout`. Parallel over column blocks, each summing the rows in order into a
/// stack accumulator: the result depends on neither the thread count nor the scheduling.
fn bias_backward<T: Float>(dbias: &mut [T], dout: &[T], rows: usize, out_dim: usize) {
    dbias.par_chunks_mut(BIAS_COLS).enumerate().for_each(|(blk, db)| {
        let c0 = blk * BIAS_COLS;
        let mut acc = [T::ZERO; BIAS_COLS];
        let acc = &mut acc[..db.len()];
        vectorized(
            #[inline(always)]
            || {
                for r in 0..rows {
                    let src = &dout[r * out_dim + c0..r * out_dim + c0 + acc.len()];
                    for (a, &d) in acc.iter_mut().zip(src) {
                        *a += d;
                    }
                }
                for (b, &a) in db.iter_mut().zip(acc.iter()) {
                    *b += a;
                }
            },
        )
    });
}

/// Rows per rayon task so that each task copies at least ~16k elements (spawning costs more).
fn rows_per_task(cols: usize) -> usize {
    (16 * 1024 / cols.max(1)).max(1)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Error;
    use crate::testing::{FD_STEP, Rng, assert_grad, dot, numeric_gradient, rel_err};

    /// The obvious triple loop in f64, with an optional bias.
    fn reference(inp: &[f64], w: &[f64], b: Option<&[f64]>, rows: usize, ind: usize, outd: usize) -> Vec<f64> {
        let mut out = vec![0.0; rows * outd];
        for r in 0..rows {
            for o in 0..outd {
                let mut s = b.map_or(0.0, |b| b[o]);
                for i in 0..ind {
                    s += inp[r * ind + i] * w[o * ind + i];
                }
                out[r * outd + o] = s;
            }
        }
        out
    }

    #[test]
    fn forward_matches_reference() {
        let mut rng = Rng::new(11);
        for &(rows, ind, outd) in &[(39, 7, 5), (1, 1, 1), (70, 65, 129)] {
            let inp = rng.vec(rows * ind, 1.0);
            let w = rng.vec(outd * ind, 1.0);
            let b = rng.vec(outd, 1.0);
            for bias in [Some(&b[..]), None] {
                let mut out = vec![7.0; rows * outd];
                linear_forward(&mut out, &inp, &w, bias, rows, ind, outd).unwrap();
                let want = reference(&inp, &w, bias, rows, ind, outd);
                assert!(rel_err(&out, &want) < 1e-13, "{rows}x{ind}x{outd} bias {}", bias.is_some());
            }
        }
    }

    /// f32 forward within 1e-5 of f64 on the same (f32-representable) inputs.
    #[test]
    fn forward_f32_matches_f64() {
        let mut rng = Rng::new(12);
        let (rows, ind, outd) = (67, 96, 33);
        let to32 = |v: Vec<f64>| v.into_iter().map(|x| x as f32).collect::<Vec<f32>>();
        let (inp, w, b) = (to32(rng.vec(rows * ind, 1.0)), to32(rng.vec(outd * ind, 1.0)), to32(rng.vec(outd, 1.0)));
        let to64 = |v: &[f32]| v.iter().map(|&x| x as f64).collect::<Vec<f64>>();
        let mut out32 = vec![0.0f32; rows * outd];
        linear_forward(&mut out32, &inp, &w, Some(&b), rows, ind, outd).unwrap();
        let mut out64 = vec![0.0f64; rows * outd];
        linear_forward(&mut out64, &to64(&inp), &to64(&w), Some(&to64(&b)), rows, ind, outd).unwrap();
        assert!(rel_err(&out32, &out64) <= 1e-5);
    }

    /// Finite differences of `L = Σ out ⊙ R` for the input, weight and bias.
    #[test]
    fn backward_matches_finite_differences() {
        let mut rng = Rng::new(13);
        let (rows, ind, outd) = (39, 7, 5);
        let mut inp = rng.vec(rows * ind, 1.0);
        let mut w = rng.vec(outd * ind, 1.0);
        let mut b = rng.vec(outd, 1.0);
        let r = rng.vec(rows * outd, 1.0);

        let mut dinp = vec![9.0; rows * ind];
        let (dw0, db0) = (0.25, -0.5);
        let mut dw = vec![dw0; outd * ind];
        let mut db = vec![db0; outd];
        linear_backward(Some(&mut dinp), Some(&mut dw), Some(&mut db), &r, &inp, &w, rows, ind, outd).unwrap();
        let dw: Vec<f64> = dw.iter().map(|x| x - dw0).collect();
        let db: Vec<f64> = db.iter().map(|x| x - db0).collect();

        let loss = |inp: &[f64], w: &[f64], b: &[f64]| {
            let mut out = vec![0.0; rows * outd];
            linear_forward(&mut out, inp, w, Some(b), rows, ind, outd).unwrap();
            dot(&out, &r)
        };
        let (w_, b_) = (w.clone(), b.clone());
        assert_grad("dinp", &dinp, &numeric_gradient(&mut inp, FD_STEP, |x| loss(x, &w_, &b_)));
        let (i_, b_) = (inp.clone(), b.clone());
        assert_grad("dweight", &dw, &numeric_gradient(&mut w, FD_STEP, |x| loss(&i_, x, &b_)));
        let (i_, w_) = (inp.clone(), w.clone());
        assert_grad("dbias", &db, &numeric_gradient(&mut b, FD_STEP, |x| loss(&i_, &w_, x)));
    }

    /// Parameter gradients add into what is there: two calls give twice the delta.
    #[test]
    fn backward_accumulates_parameter_gradients() {
        let mut rng = Rng::new(14);
        let (rows, ind, outd) = (39, 15, 7);
        let (inp, w, dout) = (rng.vec(rows * ind, 1.0), rng.vec(outd * ind, 1.0), rng.vec(rows * outd, 1.0));
        let mut dw = vec![1.0; outd * ind];
        let mut db = vec![1.0; outd];
        linear_backward(None, Some(&mut dw), Some(&mut db), &dout, &inp, &w, rows, ind, outd).unwrap();
        let (dw1, db1) = (dw.clone(), db.clone());
        linear_backward(None, Some(&mut dw), Some(&mut db), &dout, &inp, &w, rows, ind, outd).unwrap();
        let want_dw: Vec<f64> = dw1.iter().map(|x| 1.0 + 2.0 * (x - 1.0)).collect();
        let want_db: Vec<f64> = db1.iter().map(|x| 1.0 + 2.0 * (x - 1.0)).collect();
        assert!(rel_err(&dw, &want_dw) < 1e-14);
        assert!(rel_err(&db, &want_db) < 1e-14);
    }

    /// Bitwise-identical gradients on 1 and 2 threads, at sizes where gemm goes parallel.
    #[test]
    fn backward_is_deterministic_across_thread_counts() {
        let mut rng = Rng::new(15);
        let (rows, ind, outd) = (257, 96, 131);
        let to32 = |v: Vec<f64>| v.into_iter().map(|x| x as f32).collect::<Vec<f32>>();
        let (inp, w, dout) =
            (to32(rng.vec(rows * ind, 1.0)), to32(rng.vec(outd * ind, 1.0)), to32(rng.vec(rows * outd, 1.0)));
        let run = |threads: usize| {
            let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
            pool.install(|| {
                let mut dinp = vec![0.0f32; rows * ind];
                let mut dw = vec![0.5f32; outd * ind];
                let mut db = vec![0.5f32; outd];
                linear_backward(Some(&mut dinp), Some(&mut dw), Some(&mut db), &dout, &inp, &w, rows, ind, outd)
                    .unwrap();
                (dinp, dw, db)
            })
        };
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<u32>>();
        let (a, b) = (run(1), run(2));
        assert_eq!(bits(&a.0), bits(&b.0), "dinp");
        assert_eq!(bits(&a.1), bits(&b.1), "dweight");
        assert_eq!(bits(&a.2), bits(&b.2), "dbias");
    }

    #[test]
    fn wrong_lengths_are_shape_errors() {
        let (rows, ind, outd) = (3, 4, 5);
        let inp = vec![0.0f64; rows * ind];
        let w = vec![0.0; outd * ind];
        let mut out = vec![0.0; rows * outd];
        let e = linear_forward(&mut out, &inp, &w, Some(&[0.0; 4]), rows, ind, outd).unwrap_err();
        assert!(matches!(e, Error::Shape { arg: "bias", .. }), "{e}");
        assert!(e.to_string().contains("`bias`"), "{e}");
        let e = linear_forward(&mut out, &inp[1..], &w, None, rows, ind, outd).unwrap_err();
        assert!(e.to_string().contains("`inp` has 11 elements, expected 12"), "{e}");
        let mut dw = vec![0.0; outd * ind - 1];
        let e = linear_backward(None, Some(&mut dw), None, &out, &inp, &w, rows, ind, outd).unwrap_err();
        assert!(matches!(e, Error::Shape { arg: "dweight", .. }), "{e}");
        assert!(e.to_string().contains("`dweight`"), "{e}");
    }
}
