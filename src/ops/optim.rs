//! Optimizer kernels: the whole AdamW and SGD-momentum updates in one pass per tensor, plus the
//! sum of squares (global-norm clipping) and in-place scaling.
//!
//! AdamW computes in the element type, with the CUDA kernel's formula (`kernels/optim.cu`) and
//! PyTorch's arithmetic: an f32 update in f32, so the backends agree, and f64 (the gradient
//! checks) in f64. It was f64 for every type once, one rounding from the exact update; that
//! made it bound by f64 square roots and divisions, not memory (1.7× the f32 update's time
//! over MiniLM's 23 M parameters on an Intel Xeon: docs/PERF.md), for differences far below
//! a weight's own f32 rounding. SGD and scaling stay in f64: they are bound by memory.
//!
//! Work is split into fixed chunks of [`CHUNK`] elements run in parallel on the caller's rayon
//! pool; element-wise updates do not depend on the split at all, and the one reduction
//! ([`sum_squares`]) combines chunk sums in chunk order, so every result is bitwise the same for
//! any thread count.

use crate::error::{Result, check_len, config_error};
use crate::ops::simd::vectorized;
use crate::scalar::Float;
use rayon::prelude::*;

/// Elements per parallel task. Fixed (not derived from the thread count) so that the chunk sums
/// of [`sum_squares`] — and hence its rounding — never depend on the pool size.
pub const CHUNK: usize = 1 << 14;

/// Hyper-parameters of one AdamW update of one tensor.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdamWStep {
    /// Learning rate for this step.
    pub lr: f64,
    /// First-moment decay.
    pub beta1: f64,
    /// Second-moment decay.
    pub beta2: f64,
    /// Denominator term.
    pub eps: f64,
    /// Decoupled weight decay (0 for tensors excluded from decay).
    pub weight_decay: f64,
    /// 1-based step number, for bias correction.
    pub step: u64,
    /// Factor on every gradient before it enters the moments: global-norm clipping's
    /// coefficient, applied here instead of in a pass of its own (1 when not clipping).
    pub grad_scale: f64,
}

/// AdamW (Loshchilov & Hutter), PyTorch's formulation, on the gradient `g = grad_scale·grad`:
/// `m ← β1·m + (1−β1)·g`; `v ← β2·v + (1−β2)·g²`;
/// `p ← p − lr·wd·p − lr·(m/(1−β1ᵗ)) / (sqrt(v/(1−β2ᵗ)) + eps)`.
///
/// The bias corrections are computed once per call in f64, grouped as PyTorch groups them
/// (`step_size = lr/(1−β1ᵗ)`, `denom = sqrt(v)/sqrt(1−β2ᵗ) + eps`), then rounded to `T`, in
/// which every element's update runs. The decay is `p − (lr·wd)·p`, which keeps lr·wd's digits
/// (`1 − lr·wd` rounded to f32 would lose most of them). `h.step` must be ≥ 1.
pub fn adamw_update<T: Float>(param: &mut [T], grad: &[T], m: &mut [T], v: &mut [T], h: &AdamWStep) -> Result<()> {
    const OP: &str = "adamw_update";
    check_len(OP, "grad", grad.len(), param.len())?;
    check_len(OP, "m", m.len(), param.len())?;
    check_len(OP, "v", v.len(), param.len())?;
    if h.step == 0 {
        // 1 − β⁰ = 0 would divide by zero: the caller forgot to count the step.
        return Err(config_error("adamw.step", "AdamW steps are 1-based; got 0"));
    }
    // `powf` rather than `powi`: the step is a u64 and must not be truncated to i32.
    let t = h.step as f64;
    let step_size = T::from_f64(h.lr / (1.0 - h.beta1.powf(t)));
    let bc2_sqrt = T::from_f64((1.0 - h.beta2.powf(t)).sqrt());
    let lr_wd = T::from_f64(h.lr * h.weight_decay);
    let (b1, one_minus_b1) = (T::from_f64(h.beta1), T::from_f64(1.0 - h.beta1));
    let (b2, one_minus_b2) = (T::from_f64(h.beta2), T::from_f64(1.0 - h.beta2));
    let (eps, scale) = (T::from_f64(h.eps), T::from_f64(h.grad_scale));

    param
        .par_chunks_mut(CHUNK)
        .zip(grad.par_chunks(CHUNK))
        .zip(m.par_chunks_mut(CHUNK))
        .zip(v.par_chunks_mut(CHUNK))
        .for_each(|(((p, g), m), v)| {
            // One pass over the four arrays, vectorised for the CPU.
            vectorized(
                #[inline(always)]
                || {
                    for (((p, &g), m), v) in p.iter_mut().zip(g).zip(m.iter_mut()).zip(v.iter_mut()) {
                        let g = g * scale;
                        let mi = b1 * *m + one_minus_b1 * g;
                        let vi = b2 * *v + one_minus_b2 * g * g;
                        *m = mi;
                        *v = vi;
                        *p = *p - lr_wd * *p - step_size * mi / (vi.sqrt() / bc2_sqrt + eps);
                    }
                },
            )
        });
    Ok(())
}

/// Hyper-parameters of one SGD update of one tensor.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SgdStep {
    /// Learning rate for this step.
    pub lr: f64,
    /// Momentum factor (0 disables momentum).
    pub momentum: f64,
    /// L2 weight decay added to the gradient (0 for tensors excluded from decay).
    pub weight_decay: f64,
    /// Nesterov momentum.
    pub nesterov: bool,
    /// Factor on every gradient before the weight decay is added: global-norm clipping's
    /// coefficient (1 when not clipping).
    pub grad_scale: f64,
}

/// SGD with momentum, PyTorch's formulation (dampening 0): `g ← grad_scale·grad + wd·p`;
/// `buf ← momentum·buf + g` (`buf ← g` when `first`); `d = nesterov ? g + momentum·buf : buf`;
/// `p ← p − lr·d`.
///
/// With `momentum = 0` this is plain SGD (`buf` just holds the last gradient).
pub fn sgd_update<T: Float>(
    param: &mut [T],
    grad: &[T],
    momentum_buf: &mut [T],
    first: bool,
    h: &SgdStep,
) -> Result<()> {
    const OP: &str = "sgd_update";
    check_len(OP, "grad", grad.len(), param.len())?;
    check_len(OP, "momentum_buf", momentum_buf.len(), param.len())?;
    let SgdStep { lr, momentum, weight_decay, nesterov, grad_scale } = *h;

    param.par_chunks_mut(CHUNK).zip(grad.par_chunks(CHUNK)).zip(momentum_buf.par_chunks_mut(CHUNK)).for_each(
        |((p, g), buf)| {
            for ((p, &g), buf) in p.iter_mut().zip(g).zip(buf.iter_mut()) {
                let pi = p.to_f64();
                let g = g.to_f64() * grad_scale + weight_decay * pi;
                // On the first step the buffer's contents are ignored, so it may be uninitialised.
                let b = if first { g } else { momentum * buf.to_f64() + g };
                let d = if nesterov { g + momentum * b } else { b };
                *buf = T::from_f64(b);
                *p = T::from_f64(pi - lr * d);
            }
        },
    );
    Ok(())
}

/// `Σ x²` accumulated in f64 in a fixed order (bitwise reproducible for any thread count).
///
/// Each [`CHUNK`] is summed on its own with eight interleaved accumulators (so the loop can
/// vectorise while its order stays fixed); the chunk sums are then added in chunk order.
pub fn sum_squares<T: Float>(x: &[T]) -> f64 {
    let chunk_sums: Vec<f64> = x
        .par_chunks(CHUNK)
        .map(|c| {
            vectorized(
                #[inline(always)]
                || chunk_sum_squares(c),
            )
        })
        .collect();
    chunk_sums.iter().sum()
}

/// The sum of squares of one chunk, in a fixed order: lane `l` sums elements `l`, `l + 8`, …,
/// so a vector of eight f64 lanes computes exactly these sums.
#[inline(always)]
fn chunk_sum_squares<T: Float>(x: &[T]) -> f64 {
    const LANES: usize = 8;
    let mut acc = [0.0f64; LANES];
    let mut blocks = x.chunks_exact(LANES);
    for block in &mut blocks {
        for (a, &v) in acc.iter_mut().zip(block) {
            let v = v.to_f64();
            *a += v * v;
        }
    }
    for (a, &v) in acc.iter_mut().zip(blocks.remainder()) {
        let v = v.to_f64();
        *a += v * v;
    }
    // Pairwise combination of the lanes, always in the same order.
    ((acc[0] + acc[4]) + (acc[2] + acc[6])) + ((acc[1] + acc[5]) + (acc[3] + acc[7]))
}

/// `x[i] *= s` (the product is taken in f64 and rounded once).
pub fn scale_inplace<T: Float>(x: &mut [T], s: f64) {
    x.par_chunks_mut(CHUNK).for_each(|c| {
        vectorized(
            #[inline(always)]
            || {
                for v in c {
                    *v = T::from_f64(v.to_f64() * s);
                }
            },
        )
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Error;
    use crate::testing::Rng;

    fn adamw_step(step: u64) -> AdamWStep {
        AdamWStep { lr: 1e-3, beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.01, step, grad_scale: 1.0 }
    }

    fn pool(threads: usize) -> rayon::ThreadPool {
        rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap()
    }

    #[test]
    fn sum_squares_is_bitwise_equal_for_any_thread_count() {
        let mut rng = Rng::new(3);
        let x64 = rng.vec(100_000, 10.0);
        let x32: Vec<f32> = x64.iter().map(|&v| v as f32).collect();
        let (one, two) = (pool(1), pool(2));
        assert_eq!(one.install(|| sum_squares(&x64)).to_bits(), two.install(|| sum_squares(&x64)).to_bits());
        assert_eq!(one.install(|| sum_squares(&x32)).to_bits(), two.install(|| sum_squares(&x32)).to_bits());
        // And it is the sum of squares (up to f64 rounding of 1e5 terms).
        let naive: f64 = x64.iter().map(|v| v * v).sum();
        assert!((sum_squares(&x64) - naive).abs() <= 1e-12 * naive);
    }

    #[test]
    fn sum_squares_of_small_and_empty_inputs() {
        assert_eq!(sum_squares::<f64>(&[]), 0.0);
        assert_eq!(sum_squares(&[3.0f32, 4.0]), 25.0);
        // Remainder lanes (11 = 8 + 3) are included.
        assert_eq!(sum_squares(&[1.0f64; 11]), 11.0);
    }

    #[test]
    fn updates_are_bitwise_equal_for_any_thread_count() {
        // Three chunks and a partial one, so the split matters if anything does.
        let n = 3 * CHUNK + 17;
        let mut rng = Rng::new(5);
        let p0: Vec<f32> = rng.vec(n, 1.0).iter().map(|&v| v as f32).collect();
        let g: Vec<f32> = rng.vec(n, 1.0).iter().map(|&v| v as f32).collect();
        let run = |threads: usize| {
            pool(threads).install(|| {
                let (mut p, mut m, mut v, mut b) = (p0.clone(), vec![0.0f32; n], vec![0.0f32; n], vec![0.0f32; n]);
                adamw_update(&mut p, &g, &mut m, &mut v, &adamw_step(1)).unwrap();
                adamw_update(&mut p, &g, &mut m, &mut v, &adamw_step(2)).unwrap();
                let h = SgdStep { lr: 0.1, momentum: 0.9, weight_decay: 0.01, nesterov: true, grad_scale: 1.0 };
                sgd_update(&mut p, &g, &mut b, true, &h).unwrap();
                sgd_update(&mut p, &g, &mut b, false, &h).unwrap();
                scale_inplace(&mut p, 0.5);
                p.iter().chain(&m).chain(&v).chain(&b).map(|x| x.to_bits()).collect::<Vec<_>>()
            })
        };
        assert_eq!(run(1), run(2));
    }

    /// An f32 update runs in f32 (the CUDA kernel's arithmetic); over a few steps it stays within
    /// f32 rounding of the f64 update, in the weights and in both moments.
    #[test]
    fn f32_adamw_follows_the_f64_update() {
        let mut rng = Rng::new(9);
        let p0 = rng.vec(1000, 1.0);
        let (mut p64, mut m64, mut v64) = (p0.clone(), vec![0.0; 1000], vec![0.0; 1000]);
        let mut p32: Vec<f32> = p0.iter().map(|&v| v as f32).collect();
        let (mut m32, mut v32) = (vec![0.0f32; 1000], vec![0.0f32; 1000]);
        for step in 1..=3 {
            let g = rng.vec(1000, 1.0);
            let g32: Vec<f32> = g.iter().map(|&v| v as f32).collect();
            adamw_update(&mut p64, &g, &mut m64, &mut v64, &adamw_step(step)).unwrap();
            adamw_update(&mut p32, &g32, &mut m32, &mut v32, &adamw_step(step)).unwrap();
        }
        assert!(crate::testing::rel_err(&p32, &p64) < 1e-6);
        assert!(crate::testing::rel_err(&m32, &m64) < 1e-6);
        assert!(crate::testing::rel_err(&v32, &v64) < 1e-6);
        // And the updates themselves (≈ lr per step) agree, not only weights of size ~1.
        let moved32: Vec<f32> = p32.iter().zip(&p0).map(|(&a, &b)| (f64::from(a) - b) as f32).collect();
        let moved64: Vec<f64> = p64.iter().zip(&p0).map(|(&a, &b)| a - b).collect();
        assert!(crate::testing::rel_err(&moved32, &moved64) < 1e-3);
    }

    /// Clipping's coefficient inside the update is the update on gradients scaled beforehand
    /// (f64: the same product, so the same bits), and it is not ignored.
    #[test]
    fn grad_scale_is_the_update_on_scaled_gradients() {
        let mut rng = Rng::new(11);
        let (p0, g) = (rng.vec(1000, 1.0), rng.vec(1000, 1.0));
        let scaled: Vec<f64> = g.iter().map(|v| v * 0.37).collect();
        let adamw = |g: &[f64], grad_scale: f64| {
            let (mut p, mut m, mut v) = (p0.clone(), vec![0.1; 1000], vec![0.2; 1000]);
            adamw_update(&mut p, g, &mut m, &mut v, &AdamWStep { grad_scale, ..adamw_step(3) }).unwrap();
            [p, m, v]
        };
        assert_eq!(adamw(&g, 0.37), adamw(&scaled, 1.0));
        assert_ne!(adamw(&g, 0.37), adamw(&g, 1.0));
        let sgd = |g: &[f64], grad_scale: f64| {
            let (mut p, mut b) = (p0.clone(), vec![0.1; 1000]);
            let h = SgdStep { lr: 0.1, momentum: 0.9, weight_decay: 0.01, nesterov: true, grad_scale };
            sgd_update(&mut p, g, &mut b, false, &h).unwrap();
            [p, b]
        };
        assert_eq!(sgd(&g, 0.37), sgd(&scaled, 1.0));
        assert_ne!(sgd(&g, 0.37), sgd(&g, 1.0));
    }

    #[test]
    fn scale_multiplies_every_element() {
        let mut x = vec![1.0f64, -2.0, 0.5];
        scale_inplace(&mut x, 0.25);
        assert_eq!(x, [0.25, -0.5, 0.125]);
    }

    #[test]
    fn wrong_lengths_and_step_zero_are_errors() {
        let (mut p, g, mut m, mut v) = (vec![0.0f64; 4], vec![0.0f64; 4], vec![0.0f64; 4], vec![0.0f64; 3]);
        let e = adamw_update(&mut p, &g, &mut m, &mut v, &adamw_step(1));
        assert!(matches!(e, Err(Error::Shape { op: "adamw_update", arg: "v", expected: 4, got: 3 })));
        let e = adamw_update(&mut p, &g[..2], &mut m, &mut v[..], &adamw_step(1));
        assert!(matches!(e, Err(Error::Shape { arg: "grad", .. })));
        let mut v = vec![0.0f64; 4];
        assert!(matches!(adamw_update(&mut p, &g, &mut m, &mut v, &adamw_step(0)), Err(Error::Config { .. })));
        let h = SgdStep { lr: 0.1, momentum: 0.9, weight_decay: 0.0, nesterov: false, grad_scale: 1.0 };
        let e = sgd_update(&mut p, &g, &mut m[..1], true, &h);
        assert!(matches!(e, Err(Error::Shape { op: "sgd_update", arg: "momentum_buf", expected: 4, got: 1 })));
    }
}
