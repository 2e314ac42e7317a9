//! LayerNorm over the last dimension: `out = (x − mean)·rstd·weight + bias`, with
//! `rstd = 1/sqrt(var + eps)` (biased variance, as PyTorch). Saves `mean` and `rstd` per row
//! for the backward.

use crate::error::{Result, check_len};
use crate::ops::simd::vectorized;
use crate::scalar::Float;
use rayon::prelude::*;

/// Independent f64 accumulators per row reduction: fixed-order lanes the compiler can vectorise
/// (a single running sum is a serial dependency chain).
const LANES: usize = 8;
/// Rows per partial-sum block in the backward. Fixed, not derived from the thread count, so the
/// `dweight`/`dbias` summation order (rows within a block, then blocks in order) never changes.
const BLOCK_ROWS: usize = 32;
/// Columns one task reduces when combining the block partials.
const REDUCE_COLS: usize = 64;

/// Normalises each of `rows` rows of `dim` elements; writes `out`, `mean[rows]`, `rstd[rows]`.
#[allow(clippy::too_many_arguments)]
pub fn layernorm_forward<T: Float>(
    out: &mut [T],
    mean: &mut [T],
    rstd: &mut [T],
    inp: &[T],
    weight: &[T],
    bias: &[T],
    rows: usize,
    dim: usize,
    eps: f64,
) -> Result<()> {
    check_forward_lens([out.len(), mean.len(), rstd.len(), inp.len(), weight.len(), bias.len()], rows, dim)?;
    if dim == 0 {
        return Ok(());
    }
    let inv_dim = 1.0 / dim as f64;
    out.par_chunks_mut(dim)
        .zip(inp.par_chunks(dim))
        .zip(mean.par_iter_mut().zip(rstd.par_iter_mut()))
        .with_min_len(rows_per_task(dim))
        .for_each(|((o, x), (mean, rstd))| {
            vectorized(
                #[inline(always)]
                || (*mean, *rstd) = row_forward(o, x, weight, bias, inv_dim, eps),
            )
        });
    Ok(())
}

/// Writes `dinp`; adds into `dweight` and `dbias`.
#[allow(clippy::too_many_arguments)]
pub fn layernorm_backward<T: Float>(
    dinp: &mut [T],
    dweight: &mut [T],
    dbias: &mut [T],
    dout: &[T],
    inp: &[T],
    weight: &[T],
    mean: &[T],
    rstd: &[T],
    rows: usize,
    dim: usize,
) -> Result<()> {
    check_backward_lens(
        [dinp.len(), dweight.len(), dbias.len(), dout.len(), inp.len(), weight.len(), mean.len(), rstd.len()],
        rows,
        dim,
    )?;
    if dim == 0 || rows == 0 {
        return Ok(());
    }
    let inv_dim = 1.0 / dim as f64;
    let block = BLOCK_ROWS * dim;
    // partial[k] = [Σ dout⊙x̂ | Σ dout] over the rows of block k.
    let mut partial = vec![T::ZERO; rows.div_ceil(BLOCK_ROWS) * 2 * dim];
    dinp.par_chunks_mut(block).zip(partial.par_chunks_mut(2 * dim)).enumerate().for_each(|(k, (dinp, part))| {
        let (pw, pb) = part.split_at_mut(dim);
        let first = k * BLOCK_ROWS;
        let rows = first..first + dinp.len() / dim;
        let (x, d) = (&inp[rows.start * dim..rows.end * dim], &dout[rows.start * dim..rows.end * dim]);
        let stats = (&mean[rows.clone()], &rstd[rows]);
        vectorized(
            #[inline(always)]
            || block_backward(dinp, pw, pb, x, d, weight, stats, inv_dim),
        )
    });
    // Combine the block partials in block order, parallel over columns.
    dweight.par_chunks_mut(REDUCE_COLS).zip(dbias.par_chunks_mut(REDUCE_COLS)).enumerate().for_each(|(c, (dw, db))| {
        let c0 = c * REDUCE_COLS;
        let mut aw = [T::ZERO; REDUCE_COLS];
        let mut ab = [T::ZERO; REDUCE_COLS];
        let (aw, ab) = (&mut aw[..dw.len()], &mut ab[..dw.len()]);
        vectorized(
            #[inline(always)]
            || {
                for part in partial.chunks_exact(2 * dim) {
                    let (pw, pb) = (&part[c0..c0 + aw.len()], &part[dim + c0..dim + c0 + ab.len()]);
                    for ((a, &p), (b, &q)) in aw.iter_mut().zip(pw).zip(ab.iter_mut().zip(pb)) {
                        *a += p;
                        *b += q;
                    }
                }
                for ((w, &a), (b, &q)) in dw.iter_mut().zip(aw.iter()).zip(db.iter_mut().zip(ab.iter())) {
                    *w += a;
                    *b += q;
                }
            },
        )
    });
    Ok(())
}

/// One row's forward into `o`; returns its `(mean, rstd)`. Two passes in f64: the variance of
/// a row with a large mean loses nothing to cancellation, and f32 rows cost no more than the
/// conversions.
#[inline(always)]
fn row_forward<T: Float>(o: &mut [T], x: &[T], weight: &[T], bias: &[T], inv_dim: f64, eps: f64) -> (T, T) {
    let m = lane_sum(x) * inv_dim;
    let var = lane_sum_sq_dev(x, m) * inv_dim;
    let (m, s) = (T::from_f64(m), T::from_f64(1.0 / (var + eps).sqrt()));
    for (((o, &x), &w), &b) in o.iter_mut().zip(x).zip(weight).zip(bias) {
        *o = (x - m) * s * w + b;
    }
    (m, s)
}

/// One block's rows of the backward: writes their `dinp` rows and adds their parameter
/// gradients into the block's partial sums `pw` (`Σ dout⊙x̂`) and `pb` (`Σ dout`). `x`, `d` and
/// `stats` (`mean`, `rstd`) are the block's rows.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn block_backward<T: Float>(
    dinp: &mut [T],
    pw: &mut [T],
    pb: &mut [T],
    x: &[T],
    d: &[T],
    weight: &[T],
    (mean, rstd): (&[T], &[T]),
    inv_dim: f64,
) {
    let dim = weight.len();
    let rows = dinp.chunks_exact_mut(dim).zip(x.chunks_exact(dim).zip(d.chunks_exact(dim)));
    for ((di, (x, d)), (&m, &s)) in rows.zip(mean.iter().zip(rstd)) {
        // With g = w⊙dout and x̂ = (x − mean)·rstd:
        // dinp = rstd·(g − mean(g) − x̂·mean(g⊙x̂)).
        let (sum_g, sum_gxc) = lane_sums_backward(weight, d, x, m.to_f64());
        let mean_g = T::from_f64(sum_g * inv_dim);
        let mean_gxhat = T::from_f64(sum_gxc * s.to_f64() * inv_dim);
        let cols = di.iter_mut().zip(pw.iter_mut().zip(pb.iter_mut())).zip(x.iter().zip(d).zip(weight));
        for ((di, (pw, pb)), ((&x, &d), &w)) in cols {
            let xhat = (x - m) * s;
            *di = s * (w * d - mean_g - xhat * mean_gxhat);
            *pw += d * xhat;
            *pb += d;
        }
    }
}

/// `Σ x`, in f64, summed in [`LANES`] fixed interleaved lanes.
#[inline(always)]
fn lane_sum<T: Float>(x: &[T]) -> f64 {
    let mut acc = [0.0f64; LANES];
    let chunks = x.chunks_exact(LANES);
    let tail = chunks.remainder();
    for c in chunks {
        for l in 0..LANES {
            acc[l] += c[l].to_f64();
        }
    }
    tail.iter().fold(acc.iter().sum::<f64>(), |s, &t| s + t.to_f64())
}

/// `Σ (x − m)²`, in f64, in [`LANES`] fixed interleaved lanes.
#[inline(always)]
fn lane_sum_sq_dev<T: Float>(x: &[T], m: f64) -> f64 {
    let mut acc = [0.0f64; LANES];
    let chunks = x.chunks_exact(LANES);
    let tail = chunks.remainder();
    for c in chunks {
        for l in 0..LANES {
            let d = c[l].to_f64() - m;
            acc[l] += d * d;
        }
    }
    let sq = |s: f64, t: &T| {
        let d = t.to_f64() - m;
        s + d * d
    };
    tail.iter().fold(acc.iter().sum::<f64>(), sq)
}

/// `(Σ w⊙d, Σ w⊙d⊙(x − m))` in f64, in [`LANES`] fixed interleaved lanes.
#[inline(always)]
fn lane_sums_backward<T: Float>(w: &[T], d: &[T], x: &[T], m: f64) -> (f64, f64) {
    let (mut a1, mut a2) = ([0.0f64; LANES], [0.0f64; LANES]);
    let (wc, dc, xc) = (w.chunks_exact(LANES), d.chunks_exact(LANES), x.chunks_exact(LANES));
    let (wt, dt, xt) = (wc.remainder(), dc.remainder(), xc.remainder());
    for ((w, d), x) in wc.zip(dc).zip(xc) {
        for l in 0..LANES {
            let g = w[l].to_f64() * d[l].to_f64();
            a1[l] += g;
            a2[l] += g * (x[l].to_f64() - m);
        }
    }
    let (mut s1, mut s2) = (a1.iter().sum::<f64>(), a2.iter().sum::<f64>());
    for ((w, d), x) in wt.iter().zip(dt).zip(xt) {
        let g = w.to_f64() * d.to_f64();
        s1 += g;
        s2 += g * (x.to_f64() - m);
    }
    (s1, s2)
}

/// Rows per rayon task so that each task touches at least ~16k elements.
fn rows_per_task(dim: usize) -> usize {
    (16 * 1024 / dim.max(1)).max(1)
}

/// The forward's length checks, shared by every backend: lengths of
/// `[out, mean, rstd, inp, weight, bias]`.
pub(crate) fn check_forward_lens(lens: [usize; 6], rows: usize, dim: usize) -> Result<()> {
    const OP: &str = "layernorm_forward";
    let want = [rows * dim, rows, rows, rows * dim, dim, dim];
    for ((arg, got), want) in ["out", "mean", "rstd", "inp", "weight", "bias"].into_iter().zip(lens).zip(want) {
        check_len(OP, arg, got, want)?;
    }
    Ok(())
}

/// The backward's length checks, shared by every backend: lengths of
/// `[dinp, dweight, dbias, dout, inp, weight, mean, rstd]`.
pub(crate) fn check_backward_lens(lens: [usize; 8], rows: usize, dim: usize) -> Result<()> {
    const OP: &str = "layernorm_backward";
    let want = [rows * dim, dim, dim, rows * dim, rows * dim, dim, rows, rows];
    let args = ["dinp", "dweight", "dbias", "dout", "inp", "weight", "mean", "rstd"];
    for ((arg, got), want) in args.into_iter().zip(lens).zip(want) {
        check_len(OP, arg, got, want)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Error;
    use crate::testing::{FD_STEP, Rng, assert_grad, dot, numeric_gradient, rel_err};

    const EPS: f64 = 1e-5;

    /// Textbook two-pass LayerNorm in f64: (out, mean, rstd).
    fn reference(x: &[f64], w: &[f64], b: &[f64], rows: usize, dim: usize) -> (Vec<f64>, Vec<f64>, Vec<f64>) {
        let (mut out, mut mean, mut rstd) = (vec![0.0; rows * dim], vec![0.0; rows], vec![0.0; rows]);
        for r in 0..rows {
            let row = &x[r * dim..(r + 1) * dim];
            let m = row.iter().sum::<f64>() / dim as f64;
            let v = row.iter().map(|x| (x - m) * (x - m)).sum::<f64>() / dim as f64;
            let s = 1.0 / (v + EPS).sqrt();
            for i in 0..dim {
                out[r * dim + i] = (row[i] - m) * s * w[i] + b[i];
            }
            (mean[r], rstd[r]) = (m, s);
        }
        (out, mean, rstd)
    }

    #[test]
    fn forward_matches_reference() {
        let mut rng = Rng::new(41);
        for &(rows, dim) in &[(39, 7), (5, 1), (3, 384), (17, 15)] {
            let x: Vec<f64> = rng.vec(rows * dim, 2.0).iter().map(|v| v + 0.5).collect();
            let (w, b) = (rng.vec(dim, 1.0), rng.vec(dim, 1.0));
            let (mut out, mut mean, mut rstd) = (vec![0.0; rows * dim], vec![0.0; rows], vec![0.0; rows]);
            layernorm_forward(&mut out, &mut mean, &mut rstd, &x, &w, &b, rows, dim, EPS).unwrap();
            let (wo, wm, ws) = reference(&x, &w, &b, rows, dim);
            assert!(rel_err(&out, &wo) < 1e-13, "out {rows}x{dim}");
            assert!(rel_err(&mean, &wm) < 1e-13, "mean {rows}x{dim}");
            assert!(rel_err(&rstd, &ws) < 1e-13, "rstd {rows}x{dim}");
        }
    }

    /// f32 within 1e-5 of f64 on the same inputs, including rows with a mean far from zero
    /// (where a one-pass E[x²] − E[x]² variance would cancel catastrophically).
    #[test]
    fn forward_f32_matches_f64() {
        let mut rng = Rng::new(42);
        let (rows, dim) = (39, 384);
        let x: Vec<f32> =
            (0..rows).flat_map(|r| rng.vec(dim, 1.0).into_iter().map(move |v| (v + r as f64) as f32)).collect();
        let (w, b): (Vec<f32>, Vec<f32>) = (
            rng.vec(dim, 1.0).into_iter().map(|v| v as f32).collect(),
            rng.vec(dim, 1.0).into_iter().map(|v| v as f32).collect(),
        );
        let to64 = |v: &[f32]| v.iter().map(|&x| x as f64).collect::<Vec<f64>>();
        let (mut o32, mut m32, mut s32) = (vec![0.0f32; rows * dim], vec![0.0f32; rows], vec![0.0f32; rows]);
        layernorm_forward(&mut o32, &mut m32, &mut s32, &x, &w, &b, rows, dim, EPS).unwrap();
        let (mut o64, mut m64, mut s64) = (vec![0.0; rows * dim], vec![0.0; rows], vec![0.0; rows]);
        layernorm_forward(&mut o64, &mut m64, &mut s64, &to64(&x), &to64(&w), &to64(&b), rows, dim, EPS).unwrap();
        assert!(rel_err(&o32, &o64) <= 1e-5, "out {}", rel_err(&o32, &o64));
        assert!(rel_err(&m32, &m64) <= 1e-5);
        assert!(rel_err(&s32, &s64) <= 1e-5);
    }

    /// Finite differences of `L = Σ out ⊙ R` for the input, weight and bias.
    #[test]
    fn backward_matches_finite_differences() {
        let mut rng = Rng::new(43);
        for &(rows, dim) in &[(39, 7), (13, 15)] {
            let mut x = rng.vec(rows * dim, 1.5);
            let mut w = rng.vec(dim, 1.0);
            let mut b = rng.vec(dim, 1.0);
            let r = rng.vec(rows * dim, 1.0);
            let (mut out, mut mean, mut rstd) = (vec![0.0; rows * dim], vec![0.0; rows], vec![0.0; rows]);
            layernorm_forward(&mut out, &mut mean, &mut rstd, &x, &w, &b, rows, dim, EPS).unwrap();
            let (w0, b0) = (0.5, -2.0);
            let (mut dx, mut dw, mut db) = (vec![4.0; rows * dim], vec![w0; dim], vec![b0; dim]);
            layernorm_backward(&mut dx, &mut dw, &mut db, &r, &x, &w, &mean, &rstd, rows, dim).unwrap();
            let dw: Vec<f64> = dw.iter().map(|v| v - w0).collect();
            let db: Vec<f64> = db.iter().map(|v| v - b0).collect();
            let loss = |x: &[f64], w: &[f64], b: &[f64]| {
                let (mut out, mut mean, mut rstd) = (vec![0.0; rows * dim], vec![0.0; rows], vec![0.0; rows]);
                layernorm_forward(&mut out, &mut mean, &mut rstd, x, w, b, rows, dim, EPS).unwrap();
                dot(&out, &r)
            };
            let (w_, b_) = (w.clone(), b.clone());
            assert_grad("dinp", &dx, &numeric_gradient(&mut x, FD_STEP, |v| loss(v, &w_, &b_)));
            let (x_, b_) = (x.clone(), b.clone());
            assert_grad("dweight", &dw, &numeric_gradient(&mut w, FD_STEP, |v| loss(&x_, v, &b_)));
            let (x_, w_) = (x.clone(), w.clone());
            assert_grad("dbias", &db, &numeric_gradient(&mut b, FD_STEP, |v| loss(&x_, &w_, v)));
        }
    }

    #[test]
    fn backward_accumulates_parameter_gradients() {
        let mut rng = Rng::new(44);
        let (rows, dim) = (71, 5);
        let (x, w, b, dout) =
            (rng.vec(rows * dim, 1.0), rng.vec(dim, 1.0), rng.vec(dim, 1.0), rng.vec(rows * dim, 1.0));
        let (mut out, mut mean, mut rstd) = (vec![0.0; rows * dim], vec![0.0; rows], vec![0.0; rows]);
        layernorm_forward(&mut out, &mut mean, &mut rstd, &x, &w, &b, rows, dim, EPS).unwrap();
        let (mut dx, mut dw, mut db) = (vec![0.0; rows * dim], vec![1.0; dim], vec![1.0; dim]);
        layernorm_backward(&mut dx, &mut dw, &mut db, &dout, &x, &w, &mean, &rstd, rows, dim).unwrap();
        let (dw1, db1, dx1) = (dw.clone(), db.clone(), dx.clone());
        layernorm_backward(&mut dx, &mut dw, &mut db, &dout, &x, &w, &mean, &rstd, rows, dim).unwrap();
        let twice = |v: &[f64]| v.iter().map(|x| 1.0 + 2.0 * (x - 1.0)).collect::<Vec<f64>>();
        assert!(rel_err(&dw, &twice(&dw1)) < 1e-14);
        assert!(rel_err(&db, &twice(&db1)) < 1e-14);
        assert_eq!(dx, dx1, "dinp is written, not accumulated");
    }

    /// Bitwise-identical gradients on 1 and 2 threads.
    #[test]
    fn backward_is_deterministic_across_thread_counts() {
        let mut rng = Rng::new(45);
        let (rows, dim) = (517, 96);
        let to32 = |v: Vec<f64>| v.into_iter().map(|x| x as f32).collect::<Vec<f32>>();
        let (x, w, b, dout) = (
            to32(rng.vec(rows * dim, 1.0)),
            to32(rng.vec(dim, 1.0)),
            to32(rng.vec(dim, 1.0)),
            to32(rng.vec(rows * dim, 1.0)),
        );
        let run = |threads: usize| {
            let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
            pool.install(|| {
                let (mut out, mut mean, mut rstd) = (vec![0.0f32; rows * dim], vec![0.0f32; rows], vec![0.0f32; rows]);
                layernorm_forward(&mut out, &mut mean, &mut rstd, &x, &w, &b, rows, dim, EPS).unwrap();
                let (mut dx, mut dw, mut db) = (vec![0.0f32; rows * dim], vec![0.5f32; dim], vec![0.5f32; dim]);
                layernorm_backward(&mut dx, &mut dw, &mut db, &dout, &x, &w, &mean, &rstd, rows, dim).unwrap();
                [out, dx, dw, db].map(|v| v.iter().map(|x| x.to_bits()).collect::<Vec<u32>>())
            })
        };
        assert_eq!(run(1), run(2));
    }

    #[test]
    fn wrong_lengths_are_shape_errors() {
        let (rows, dim) = (3, 4);
        let x = vec![0.0f64; rows * dim];
        let (mut out, mut mean, mut rstd) = (vec![0.0; rows * dim], vec![0.0; rows], vec![0.0; rows - 1]);
        let e =
            layernorm_forward(&mut out, &mut mean, &mut rstd, &x, &[1.0; 4], &[0.0; 4], rows, dim, EPS).unwrap_err();
        assert!(matches!(e, Error::Shape { arg: "rstd", .. }), "{e}");
        assert!(e.to_string().contains("`rstd` has 2 elements, expected 3"), "{e}");
        let (mut dx, mut dw, mut db) = (vec![0.0; rows * dim], vec![0.0; dim], vec![0.0; dim + 1]);
        let e = layernorm_backward(&mut dx, &mut dw, &mut db, &x, &x, &[1.0; 4], &mean, &mean, rows, dim).unwrap_err();
        assert!(e.to_string().contains("`dbias`"), "{e}");
    }
}
