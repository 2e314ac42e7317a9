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
//!
//! An embedding table's gradient reaches only the rows a batch names; a row no gradient has
//! reached yet has gradient and moments at +0, so its AdamW update is its weight decay alone.
//! [`LiveRows`] names the rows that may be non-zero, and [`adamw_update_live`] and
//! [`sum_squares_live`] skip the others: the same bits, a fraction of the memory traffic.

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
    adamw_update_live(param, grad, m, v, h, None).map(|_| ())
}

/// [`adamw_update`] where `live` (if given) holds every row in which the gradient or either
/// moment may be non-zero: the other rows take only their weight decay, the same bits as the
/// full update gives them, reading and writing the parameter alone (an embedding table's
/// untouched rows: 8 bytes an element moved instead of 28). Without `live`, the full update.
/// Returns whether the moments are still +0 outside `live`: not where the clipping
/// coefficient is not finite (the full update then makes NaNs of them, and runs).
pub fn adamw_update_live<T: Float>(
    param: &mut [T],
    grad: &[T],
    m: &mut [T],
    v: &mut [T],
    h: &AdamWStep,
    live: Option<&LiveRows>,
) -> Result<bool> {
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

    // One pass over the four arrays, vectorised for the CPU.
    let update = |p: &mut [T], g: &[T], m: &mut [T], v: &mut [T]| {
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
    };
    // A non-finite clipping coefficient makes NaNs of the zero rows' moments in the full
    // formula, and eps of zero of their steps (0/0): those updates take it.
    let finite = scale.to_f64().is_finite();
    match live.filter(|_| finite && eps > T::ZERO) {
        None => param
            .par_chunks_mut(CHUNK)
            .zip(grad.par_chunks(CHUNK))
            .zip(m.par_chunks_mut(CHUNK))
            .zip(v.par_chunks_mut(CHUNK))
            .for_each(|(((p, g), m), v)| update(p, g, m, v)),
        Some(live) => {
            // A row whose gradient and moments are +0 keeps its moments at +0 (β·0 + (1−β)·0),
            // and its step is `0/(0 + eps) = 0`: `p − lr·wd·p − 0`, the same bits as the full
            // formula, from the parameter alone.
            let rows = if live.row_len > 0 { live.row_len } else { CHUNK };
            let per_task = CHUNK.div_ceil(rows).max(1) * rows;
            param
                .par_chunks_mut(per_task)
                .zip(grad.par_chunks(per_task))
                .zip(m.par_chunks_mut(per_task))
                .zip(v.par_chunks_mut(per_task))
                .enumerate()
                .for_each(|(t, (((p, g), m), v))| {
                    let first_row = t * per_task / rows;
                    let rows_here =
                        p.chunks_mut(rows).zip(g.chunks(rows)).zip(m.chunks_mut(rows)).zip(v.chunks_mut(rows));
                    for (r, (((p, g), m), v)) in rows_here.enumerate() {
                        if live.contains(first_row + r) {
                            update(p, g, m, v);
                        } else {
                            vectorized(
                                #[inline(always)]
                                || p.iter_mut().for_each(|p| *p = *p - lr_wd * *p),
                            )
                        }
                    }
                });
        }
    }
    Ok(finite)
}

/// Rows of a `row_len`-wide tensor (an embedding table's gradient, or its moments) that may
/// hold non-zeros: every row outside the set is +0 throughout. A batch reaches a few hundred
/// of an embedding table's tens of thousands of rows, so the ops that know this skip the rest.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct LiveRows {
    /// Elements per row (0 while no row is live: the whole tensor is +0).
    row_len: usize,
    /// Bit `r` set: row `r` may hold non-zeros.
    bits: Vec<u64>,
}

impl LiveRows {
    /// No live row: the whole tensor is +0.
    pub fn none() -> Self {
        Self::default()
    }

    /// Elements per row (0 while no row is live).
    pub fn row_len(&self) -> usize {
        self.row_len
    }

    /// The rows of `data` (`row_len` elements each) holding anything but +0 (a −0 or a NaN
    /// counts): the record of a tensor that came without one, as a checkpoint's moments do.
    /// None with `row_len` 0 (no row width to record).
    pub fn reached<T: Float>(data: &[T], row_len: usize) -> Self {
        let mut live = Self::none();
        if row_len > 0 {
            let rows = data.chunks(row_len).enumerate();
            live.add(rows.filter(|(_, row)| row.iter().any(|x| x.to_f64().to_bits() != 0)).map(|(r, _)| r), row_len);
        }
        live
    }

    /// Whether row `r` may hold non-zeros.
    pub fn contains(&self, r: usize) -> bool {
        self.bits.get(r / 64).is_some_and(|w| w >> (r % 64) & 1 == 1)
    }

    /// Marks `rows` of `row_len` elements live. Returns false, changing nothing, if live rows
    /// of another width are already held (the set describes one layout).
    pub fn add(&mut self, rows: impl IntoIterator<Item = usize>, row_len: usize) -> bool {
        if self.row_len != row_len && self.any() {
            return false;
        }
        self.row_len = row_len;
        for r in rows {
            if self.bits.len() <= r / 64 {
                self.bits.resize(r / 64 + 1, 0);
            }
            self.bits[r / 64] |= 1 << (r % 64);
        }
        true
    }

    /// The union with `other`; None where both hold live rows of different widths.
    pub fn union(&self, other: &LiveRows) -> Option<LiveRows> {
        // Word by word, from the longer of the two.
        let (long, short) = if other.bits.len() > self.bits.len() { (other, self) } else { (self, other) };
        if long.any() && short.any() && long.row_len != short.row_len {
            return None;
        }
        let mut out = long.clone();
        if !long.any() {
            out.row_len = short.row_len;
        }
        out.bits.iter_mut().zip(&short.bits).for_each(|(o, w)| *o |= w);
        Some(out)
    }

    /// Whether any row is live.
    fn any(&self) -> bool {
        self.bits.iter().any(|&w| w != 0)
    }

    /// Live rows, in order.
    pub fn rows(&self) -> impl Iterator<Item = usize> + '_ {
        self.bits
            .iter()
            .enumerate()
            .flat_map(|(i, &w)| (0..64).filter(move |b| w >> b & 1 == 1).map(move |b| i * 64 + b))
    }

    /// Whether any element of `start..end` lies in a live row.
    fn touches(&self, start: usize, end: usize) -> bool {
        if self.row_len == 0 || start >= end {
            return false;
        }
        (start / self.row_len..=(end - 1) / self.row_len).any(|r| self.contains(r))
    }
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
    sum_squares_live(x, None)
}

/// [`sum_squares`] where `live` (if given) holds every row that may be non-zero: a chunk of
/// other rows only is not read. Its sum would be +0, and adding +0 changes no sum, so the
/// result is the same bits.
pub fn sum_squares_live<T: Float>(x: &[T], live: Option<&LiveRows>) -> f64 {
    let chunk_sums: Vec<f64> = x
        .par_chunks(CHUNK)
        .enumerate()
        .map(|(i, c)| {
            if live.is_some_and(|l| !l.touches(i * CHUNK, i * CHUNK + c.len())) {
                return 0.0;
            }
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

    /// With the rows outside a live set +0 in the gradient and both moments, the live-row AdamW
    /// and sum of squares give the full ones' bits: over three steps whose gradients reach
    /// different rows (the moments' live rows growing as an embedding's do), rows wider and
    /// narrower than a chunk, on 1 and 2 threads; a non-finite clipping coefficient (whose full
    /// update makes NaNs of the zero rows' moments too) and zero eps included.
    #[test]
    fn live_rows_give_the_full_updates_bits() {
        let mut rng = Rng::new(21);
        for (rows, row_len) in [(300, 130), (7, 3 * CHUNK + 5)] {
            let n = rows * row_len;
            let p0: Vec<f32> = rng.vec(n, 1.0).iter().map(|&x| x as f32).collect();
            for (grad_scale, eps) in [(0.37, 1e-8), (f64::INFINITY, 1e-8), (1.0, 0.0)] {
                let run = |threads: usize, live_aware: bool| {
                    pool(threads).install(|| {
                        let (mut p, mut m, mut v) = (p0.clone(), vec![0f32; n], vec![0f32; n]);
                        let mut moments = LiveRows::none();
                        let mut out = Vec::new();
                        for step in 1..=3 {
                            // Each step's gradient reaches a few rows, some of them again.
                            let touched: Vec<usize> = (0..3).map(|i| (i * 37 + step as usize * 11) % rows).collect();
                            let mut g = vec![0f32; n];
                            for &r in &touched {
                                for (j, x) in g[r * row_len..(r + 1) * row_len].iter_mut().enumerate() {
                                    *x = ((j + step as usize) % 7) as f32 - 3.0;
                                }
                            }
                            let mut grad_live = LiveRows::none();
                            assert!(grad_live.add(touched.iter().copied(), row_len));
                            let live = grad_live.union(&moments).unwrap();
                            let h = AdamWStep { grad_scale, eps, ..adamw_step(step) };
                            let norm = if live_aware {
                                adamw_update_live(&mut p, &g, &mut m, &mut v, &h, Some(&live)).unwrap();
                                sum_squares_live(&g, Some(&grad_live))
                            } else {
                                adamw_update(&mut p, &g, &mut m, &mut v, &h).unwrap();
                                sum_squares(&g)
                            };
                            moments = live;
                            out.push(norm.to_bits());
                        }
                        out.extend(p.iter().chain(&m).chain(&v).map(|x| u64::from(x.to_bits())));
                        out
                    })
                };
                let full = run(1, false);
                let case = format!("{rows} rows of {row_len}, grad_scale {grad_scale}, eps {eps}");
                assert!(full == run(1, true), "{case}: live rows on one thread");
                assert!(full == run(2, true), "{case}: live rows on two threads");
            }
        }
    }

    /// The live-row sum of squares does skip: a non-zero outside the set (which the callers'
    /// bookkeeping rules out) is not read, and inside it is.
    #[test]
    fn sum_squares_reads_only_live_rows() {
        let (rows, row_len) = (4 * CHUNK / 100, 100);
        let mut x = vec![0f32; rows * row_len];
        x[3 * CHUNK] = 2.0;
        let mut live = LiveRows::none();
        assert!(live.add([0], row_len));
        assert_eq!(sum_squares_live(&x, Some(&live)), 0.0);
        assert!(live.add([3 * CHUNK / row_len], row_len));
        assert_eq!(sum_squares_live(&x, Some(&live)), 4.0);
        assert_eq!(sum_squares_live(&x, Some(&LiveRows::none())), 0.0);
        assert_eq!(sum_squares_live(&x, None), 4.0);
    }

    /// A set holds one row width: rows of another are refused while it holds any, and a union
    /// of two widths is unknown; an empty set takes any width.
    #[test]
    fn live_rows_hold_one_width() {
        let mut a = LiveRows::none();
        assert!(a.add([1, 70], 8));
        assert!(!a.add([2], 16));
        assert_eq!(a.rows().collect::<Vec<_>>(), [1, 70]);
        let mut b = LiveRows::none();
        assert!(b.add([2], 16));
        assert!(a.union(&b).is_none());
        let u = a.union(&LiveRows::none()).unwrap();
        assert_eq!((u.row_len, u.rows().collect::<Vec<_>>()), (8, vec![1, 70]));
        assert_eq!(LiveRows::none().union(&a).unwrap(), u);
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
