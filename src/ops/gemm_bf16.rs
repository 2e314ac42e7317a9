//! bf16 matrix products on the CPU: `C[m×n] (+)= A[m×k]·B[k×n]` with A and B f32 views
//! ([`MatRef`], strided or transposed) whose values are rounded to bf16 (round to nearest even,
//! exactly as `half::bf16::from_f32`), products accumulated in f32. This is what `--precision
//! bf16` means on the `cpu` backend: the operands of the products lose their low 16 mantissa
//! bits, everything else (activations in memory, master weights, gradients, optimizer state)
//! stays f32, as on the GPU backends.
//!
//! Why a kernel of our own: the `gemm` crate has no bf16 × bf16 → f32 path, and on CPUs with
//! `avx512_bf16` one `vdpbf16ps` does 32 multiply-adds (16 lanes × a pair of k) where an f32
//! FMA does 16: twice the f32 peak, half the bytes per operand.
//!
//! How (`avx512` below, chosen at run time):
//! 1. **Pack** A and B into bf16 pairs: one `u32` holds two consecutive k of one row of A (or one
//!    column of B), the low half the even k, the layout `vdpbf16ps` multiplies lane by lane. B
//!    goes into panels of `NR` columns, pair-major (`[p][j]`: one 64-byte load gives 16 columns'
//!    pairs); A into panels of `MR` rows, either row-major (`[i][p]`, when A's k is contiguous) or
//!    pair-major (`[p][i]`, when A's rows are contiguous, e.g. `dYᵀ`), both with compile-time
//!    strides so the micro-kernel addresses them with constant displacements. Packing is
//!    vectorised for the three layouts the linear layer produces (k contiguous, rows contiguous,
//!    and a transposed B through a 16×16 register transpose); any other stride goes through a
//!    scalar path. Panels are zero-padded past the matrix edges and past an odd k.
//! 2. **Micro-kernel**: an `MR × NR` block of f32 accumulators in zmm registers; per pair of k,
//!    `NR/16` vector loads of B and `MR` broadcasts of A feed `MR·NR/16` `vdpbf16ps`.
//! 3. **Blocking**: k in blocks of `KC` (a B micro-panel, `KC/2 × NR` pairs, stays in L1 while
//!    the A panels of a row block stream from L2), rows of C in blocks handed to rayon tasks. Each
//!    C element's sum runs in the same order whatever the thread count: results are bitwise
//!    reproducible across thread counts.
//!
//! Elsewhere (no `avx512_bf16`, another architecture, f64 operands) [`matmul_bf16`] rounds the
//! operands to bf16, widens them back and calls the f32 [`matmul`]: the same rounding of the
//! inputs, f32 accumulation in another order. [`matmul_bf16_reference`] is the triple loop in f64
//! over the rounded inputs that both are tested against.
//!
//! Not here: AMX tiles (`tdpbf16ps`). This machine has no AMX, so such a kernel could not be run
//! or tested where it was written; CPUs with AMX and `avx512_bf16` take the `vdpbf16ps` path.

use crate::ops::matmul::{MatRef, matmul};
use crate::scalar::Float;
use half::bf16;
use std::any::TypeId;

/// The arithmetic of the CPU backend's matrix products.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Products {
    /// In the element type itself (f32 or f64), through [`matmul`].
    #[default]
    Native,
    /// Operands rounded to bf16, f32 accumulation, through [`matmul_bf16`].
    Bf16,
}

/// The code that computes [`matmul_bf16`] on this CPU.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Bf16Path {
    /// The `vdpbf16ps` micro-kernel (`avx512_bf16` + `avx512f`).
    Avx512Bf16,
    /// Round to bf16, widen, f32 [`matmul`].
    Fallback,
}

/// Which path [`matmul_bf16`] takes for f32 operands on this CPU (detected at run time).
pub fn bf16_path() -> Bf16Path {
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx512f") && std::arch::is_x86_feature_detected!("avx512bf16") {
            return Bf16Path::Avx512Bf16;
        }
    }
    Bf16Path::Fallback
}

/// Below this many multiply-adds a product runs on the calling thread: spawning costs more.
/// (The same threshold as [`matmul`].)
const PARALLEL_MIN_WORK: usize = 48 * 48 * 48;

/// Whether `work` multiply-adds (or packed elements) go to the current rayon pool.
fn parallel(work: usize) -> bool {
    work >= PARALLEL_MIN_WORK && rayon::current_num_threads() > 1
}

/// `C = A·B` (or `C += A·B`) in the arithmetic `products` names: the single switch between f32
/// and bf16 products for the ops that multiply matrices.
#[allow(clippy::too_many_arguments)]
pub fn matmul_in<T: Float>(
    products: Products,
    c: &mut [T],
    c_row_stride: usize,
    a: MatRef<T>,
    b: MatRef<T>,
    m: usize,
    n: usize,
    k: usize,
    accumulate: bool,
) {
    match products {
        Products::Native => matmul(c, c_row_stride, a, b, m, n, k, accumulate),
        Products::Bf16 => {
            matmul_bf16(c, c_row_stride, a, b, m, n, k, accumulate);
        }
    }
}

/// `C[m×n] = A[m×k]·B[k×n]` (or `C +=` when `accumulate`) with A and B rounded to bf16 and f32
/// accumulation; `C` row-major with row stride `c_row_stride`. Runs on the current rayon pool
/// when the product is large enough. Returns the path that computed it.
///
/// Panics if a view reaches past its slice or C's rows overlap (`c_row_stride < n`): callers size
/// buffers from checked shapes, so that is an internal bug, and the checks are what keep the
/// `unsafe` code below sound.
#[allow(clippy::too_many_arguments)]
pub fn matmul_bf16<T: Float>(
    c: &mut [T],
    c_row_stride: usize,
    a: MatRef<T>,
    b: MatRef<T>,
    m: usize,
    n: usize,
    k: usize,
    accumulate: bool,
) -> Bf16Path {
    matmul_bf16_with(c, c_row_stride, a, b, m, n, k, accumulate, parallel(m * n * k))
}

/// [`matmul_bf16`] with the parallelism chosen by the caller (`false` inside a parallel loop).
#[allow(clippy::too_many_arguments)]
pub fn matmul_bf16_with<T: Float>(
    c: &mut [T],
    c_row_stride: usize,
    a: MatRef<T>,
    b: MatRef<T>,
    m: usize,
    n: usize,
    k: usize,
    accumulate: bool,
    parallel: bool,
) -> Bf16Path {
    check_views(c.len(), c_row_stride, &a, &b, m, n, k);
    #[cfg(target_arch = "x86_64")]
    if bf16_path() == Bf16Path::Avx512Bf16
        && let (Some(c32), Some(a32), Some(b32)) = (as_f32_mut(c), as_f32(a.data), as_f32(b.data))
    {
        let a = MatRef { data: a32, row_stride: a.row_stride, col_stride: a.col_stride };
        let b = MatRef { data: b32, row_stride: b.row_stride, col_stride: b.col_stride };
        avx512::gemm(c32, c_row_stride, a, b, m, n, k, accumulate, parallel);
        return Bf16Path::Avx512Bf16;
    }
    matmul_bf16_fallback(c, c_row_stride, a, b, m, n, k, accumulate);
    Bf16Path::Fallback
}

/// The B operand of bf16 products packed once for the `vdpbf16ps` micro-kernel, for products
/// that share it: a linear layer's weight is B in the forward (`Wᵀ`) and in the input gradient
/// (`W`) of every micro-batch of a step, and packing it (rounding, pairing, a transpose) costs as
/// much as the product itself at a micro-batch's few hundred rows. Keeps its allocation across
/// [`pack`](Self::pack)s.
#[derive(Default)]
pub struct PackedB {
    words: Vec<u32>,
    /// Where the 64-byte-aligned panels start in `words`.
    start: usize,
    k: usize,
    n: usize,
}

impl PackedB {
    /// Packs `b` (`k × n`) into this buffer, replacing what it held. Returns false, packing
    /// nothing, where [`bf16_path`] is not the micro-kernel or `T` is not f32 (only that path
    /// reads packed operands).
    pub fn pack<T: Float>(&mut self, b: MatRef<T>, k: usize, n: usize) -> bool {
        #[cfg(target_arch = "x86_64")]
        if bf16_path() == Bf16Path::Avx512Bf16
            && let Some(data) = as_f32(b.data)
        {
            let b = MatRef { data, row_stride: b.row_stride, col_stride: b.col_stride };
            check_operand("B", &b, k, n);
            let len = avx512::packed_b_len(k, n);
            self.words.resize(len + 16, 0);
            self.start = avx512::aligned_start(&self.words);
            if len > 0 {
                let out = &mut self.words[self.start..self.start + len];
                // SAFETY: bf16_path() checked avx512f; `out` is packed_b_len(k, n) words.
                unsafe { avx512::pack_b(b, k, n, out, parallel(k * n)) };
            }
            (self.k, self.n) = (k, n);
            return true;
        }
        let _ = (b, k, n);
        false
    }

    /// Whether this holds a packed `k × n` B.
    pub fn holds(&self, k: usize, n: usize) -> bool {
        !self.words.is_empty() && (self.k, self.n) == (k, n)
    }
}

/// [`matmul_bf16`] with B packed beforehand (`b`, a `k × n` [`PackedB`]): the same result to the
/// bit. Panics if `b` holds another shape or the element type is not f32 (a `PackedB` exists only
/// for f32 operands on the micro-kernel's path): callers pack from the shapes they multiply.
#[allow(clippy::too_many_arguments)]
pub fn matmul_bf16_packed<T: Float>(
    c: &mut [T],
    c_row_stride: usize,
    a: MatRef<T>,
    b: &PackedB,
    m: usize,
    n: usize,
    k: usize,
    accumulate: bool,
) {
    assert!(b.holds(k, n), "matmul_bf16_packed: B packed as {}×{}, used as {k}×{n}", b.k, b.n);
    check_c(c.len(), c_row_stride, m, n);
    check_operand("A", &a, m, k);
    let (Some(c32), Some(a32)) = (as_f32_mut(c), as_f32(a.data)) else {
        panic!("matmul_bf16_packed: packed products take f32 operands");
    };
    let a = MatRef { data: a32, row_stride: a.row_stride, col_stride: a.col_stride };
    let parallel = parallel(m * n * k);
    #[cfg(target_arch = "x86_64")]
    {
        let words = &b.words[b.start..b.start + avx512::packed_b_len(k, n)];
        avx512::gemm_packed(c32, c_row_stride, a, words, m, n, k, accumulate, parallel);
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (c32, a, parallel);
        unreachable!("a PackedB is packed only on the micro-kernel's path");
    }
}

/// The portable path: rounds A and B to bf16 (f64 operands through f32), widens them back into
/// contiguous copies and calls the f32/f64 [`matmul`]. Allocates the copies on every call: it
/// serves CPUs without `avx512_bf16`, where speed is not the point of bf16.
#[allow(clippy::too_many_arguments)]
pub fn matmul_bf16_fallback<T: Float>(
    c: &mut [T],
    c_row_stride: usize,
    a: MatRef<T>,
    b: MatRef<T>,
    m: usize,
    n: usize,
    k: usize,
    accumulate: bool,
) {
    check_views(c.len(), c_row_stride, &a, &b, m, n, k);
    let round = |x: T| T::from_f64(bf16::from_f32(x.to_f64() as f32).to_f64());
    let mut ar = Vec::with_capacity(m * k);
    for i in 0..m {
        ar.extend((0..k).map(|p| round(a.data[i * a.row_stride + p * a.col_stride])));
    }
    let mut br = Vec::with_capacity(k * n);
    for p in 0..k {
        br.extend((0..n).map(|j| round(b.data[p * b.row_stride + j * b.col_stride])));
    }
    matmul(c, c_row_stride, MatRef::rows(&ar, k), MatRef::rows(&br, n), m, n, k, accumulate);
}

/// The triple loop in f64 over the bf16-rounded operands: what [`matmul_bf16`] computes, up to
/// the f32 rounding of its sums.
pub fn matmul_bf16_reference(a: MatRef<f32>, b: MatRef<f32>, m: usize, n: usize, k: usize) -> Vec<f64> {
    let r = |x: f32| bf16::from_f32(x).to_f64();
    let mut c = vec![0.0; m * n];
    for i in 0..m {
        for j in 0..n {
            c[i * n + j] = (0..k)
                .map(|p| {
                    r(a.data[i * a.row_stride + p * a.col_stride]) * r(b.data[p * b.row_stride + j * b.col_stride])
                })
                .sum();
        }
    }
    c
}

/// The bounds every path relies on (see [`matmul_bf16`]).
fn check_views<T>(c_len: usize, ldc: usize, a: &MatRef<T>, b: &MatRef<T>, m: usize, n: usize, k: usize) {
    check_c(c_len, ldc, m, n);
    check_operand("A", a, m, k);
    check_operand("B", b, k, n);
}

/// C (`m × n`, row stride `ldc`) fits its buffer and its rows do not overlap.
fn check_c(c_len: usize, ldc: usize, m: usize, n: usize) {
    let c_extent = if m == 0 || n == 0 { 0 } else { (m - 1) * ldc + n };
    assert!(c_extent <= c_len, "matmul_bf16: C view exceeds its buffer");
    assert!(m <= 1 || ldc >= n, "matmul_bf16: C rows overlap (row stride {ldc} < {n} columns)");
}

/// A `rows × cols` operand view stays inside its buffer.
fn check_operand<T>(name: &str, v: &MatRef<T>, rows: usize, cols: usize) {
    assert!(v.extent(rows, cols) <= v.data.len(), "matmul_bf16: {name} view exceeds its buffer");
}

/// `s` as `&[f32]` when `T` is f32.
fn as_f32<T: 'static>(s: &[T]) -> Option<&[f32]> {
    (TypeId::of::<T>() == TypeId::of::<f32>()).then(|| {
        // SAFETY: `T` is `f32` (same type id), so the pointer, length and lifetime describe the
        // same f32 slice.
        unsafe { std::slice::from_raw_parts(s.as_ptr().cast::<f32>(), s.len()) }
    })
}

/// `s` as `&mut [f32]` when `T` is f32.
fn as_f32_mut<T: 'static>(s: &mut [T]) -> Option<&mut [f32]> {
    if TypeId::of::<T>() == TypeId::of::<f32>() {
        // SAFETY: `T` is `f32` (same type id); the exclusive borrow of `s` moves into the result.
        Some(unsafe { std::slice::from_raw_parts_mut(s.as_mut_ptr().cast::<f32>(), s.len()) })
    } else {
        None
    }
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    //! The `vdpbf16ps` path. Every function with `#[target_feature]` is `unsafe` to call only
    //! because of the CPU features; callers hold [`bf16_path`](super::bf16_path)`() ==
    //! Avx512Bf16`. Memory accesses are bounded by asserts on the packed blocks' lengths and by
    //! the view checks of [`check_views`](super::check_views).

    use super::MatRef;
    use rayon::prelude::*;
    use std::arch::x86_64::*;
    use std::cell::Cell;

    /// Rows of the micro-kernel's C block (A broadcasts per pair of k).
    pub const MR: usize = 8;
    /// zmm vectors across the micro-kernel's C block: `MR·NV` accumulators (24 of the 32 zmm
    /// registers), `NV` B loads and one broadcast in flight.
    const NV: usize = 3;
    /// Columns of the micro-kernel's C block.
    pub const NR: usize = 16 * NV;
    /// k per block: a B micro-panel (`KC/2 × NR` pairs = 24 KiB) stays in L1. A multiple of 32
    /// (the packers convert 32 k at a time).
    pub const KC: usize = 256;
    /// Pairs of k per block.
    const KC2: usize = KC / 2;
    /// Rows of C per rayon task at most (its A panels, `MC × KC/2` pairs = 128 KiB, in L2).
    const MC_MAX: usize = 256;
    /// Columns of C per inner block (the B panels of one k block, `KC/2 × NC` pairs = 192 KiB, in L2).
    const NC: usize = 8 * NR;

    /// One operand as the packers see it: `x` indexes the panel dimension (A's rows, B's
    /// columns), `k` the reduction; element `(x, k)` is `data[x·x_stride + k·k_stride]`.
    #[derive(Clone, Copy)]
    struct Operand<'a> {
        data: &'a [f32],
        x_stride: usize,
        k_stride: usize,
        x_len: usize,
        k_len: usize,
    }

    impl Operand<'_> {
        fn get(&self, x: usize, k: usize) -> f32 {
            self.data[x * self.x_stride + k * self.k_stride]
        }
        /// Pointer to element `(x, k)`. Only for in-range indices (asserted in debug builds; the
        /// view checks bound every in-range element).
        fn ptr(&self, x: usize, k: usize) -> *const f32 {
            debug_assert!(x < self.x_len && k < self.k_len);
            self.data[x * self.x_stride + k * self.k_stride..].as_ptr()
        }
    }

    /// How an A block is laid out: which of the micro-kernel's two instantiations reads it.
    #[derive(Clone, Copy, PartialEq, Eq)]
    enum ALayout {
        /// `[i][p]`, rows `KC2` pairs apart: A's k is contiguous (or nothing is).
        RowPairs,
        /// `[p][i]`, pairs `MR` rows apart: A's rows are contiguous (a transposed view).
        PairRows,
    }

    thread_local! {
        /// Scratch for the packed A operand, and for B when the caller did not pack it: one of
        /// each per thread, reused so that a product does not go back to the kernel for pages
        /// every call. A nested call on the same thread (rayon work stealing) finds one taken and
        /// allocates its own.
        static SCRATCH_A: Cell<Vec<u32>> = const { Cell::new(Vec::new()) };
        static SCRATCH_B: Cell<Vec<u32>> = const { Cell::new(Vec::new()) };
    }

    /// Runs `f` on a 64-byte-aligned slice of `len` words of `scratch` (a zmm load that straddles
    /// two cache lines costs two), then puts the buffer back.
    fn with_scratch<R>(
        scratch: &'static std::thread::LocalKey<Cell<Vec<u32>>>,
        len: usize,
        f: impl FnOnce(&mut [u32]) -> R,
    ) -> R {
        let mut buf = scratch.with(Cell::take);
        if buf.len() < len + 16 {
            buf.resize(len + 16, 0);
        }
        let skip = aligned_start(&buf);
        let r = f(&mut buf[skip..skip + len]);
        scratch.with(|s| {
            // Keep the larger buffer if a nested call left one behind.
            let other = s.take();
            s.set(if other.len() > buf.len() { other } else { buf });
        });
        r
    }

    /// The first index of `words` on a 64-byte boundary (at most 15).
    pub fn aligned_start(words: &[u32]) -> usize {
        words.as_ptr().align_offset(64).min(15)
    }

    /// Words of B (`k × n`) packed: `n/NR` panels of every k block.
    pub fn packed_b_len(k: usize, n: usize) -> usize {
        n.div_ceil(NR) * k.div_ceil(KC) * KC2 * NR
    }

    /// Packs B (`k × n`, `k, n > 0`) into `out` ([`packed_b_len`] words): each column panel holds
    /// all of k, one block of KC after another.
    ///
    /// # Safety
    /// avx512f (the packers' vector code).
    pub unsafe fn pack_b(b: MatRef<f32>, k: usize, n: usize, out: &mut [u32], parallel: bool) {
        assert_eq!(out.len(), packed_b_len(k, n));
        let b_op = Operand { data: b.data, x_stride: b.col_stride, k_stride: b.row_stride, x_len: n, k_len: k };
        let (nkb, b_block) = (k.div_ceil(KC), KC2 * NR);
        let pack = |(jp, panel): (usize, &mut [u32])| {
            for (kb, block) in panel.chunks_mut(b_block).enumerate() {
                // SAFETY: the caller holds avx512f.
                unsafe { pack_b_block(&b_op, jp, kb, block) };
            }
        };
        if parallel {
            out.par_chunks_mut(nkb * b_block).enumerate().for_each(pack);
        } else {
            out.chunks_mut(nkb * b_block).enumerate().for_each(pack);
        }
    }

    /// See [`matmul_bf16`](super::matmul_bf16); the views were checked by the caller.
    #[allow(clippy::too_many_arguments)]
    pub fn gemm(
        c: &mut [f32],
        ldc: usize,
        a: MatRef<f32>,
        b: MatRef<f32>,
        m: usize,
        n: usize,
        k: usize,
        accumulate: bool,
        parallel: bool,
    ) {
        if m == 0 || n == 0 || k == 0 {
            return gemm_packed(c, ldc, a, &[], m, n, k, accumulate, parallel);
        }
        with_scratch(&SCRATCH_B, packed_b_len(k, n), |packed_b| {
            // SAFETY: the caller checked this CPU has avx512f + avx512bf16.
            unsafe { pack_b(b, k, n, packed_b, parallel) };
            gemm_packed(c, ldc, a, packed_b, m, n, k, accumulate, parallel)
        })
    }

    /// [`gemm`] with B already packed by [`pack_b`] (`packed_b`: its [`packed_b_len`]`(k, n)` words).
    /// Safe to call only as `gemm` is: the caller holds [`bf16_path`](super::bf16_path)`() ==
    /// Avx512Bf16` and checked A's and C's views (the module's contract, above).
    #[allow(clippy::too_many_arguments)]
    pub fn gemm_packed(
        c: &mut [f32],
        ldc: usize,
        a: MatRef<f32>,
        packed_b: &[u32],
        m: usize,
        n: usize,
        k: usize,
        accumulate: bool,
        parallel: bool,
    ) {
        if m == 0 || n == 0 {
            return;
        }
        // A single row's stride is never used to step: make it one that chunks C by rows.
        let ldc = if m == 1 { n } else { ldc };
        let c = &mut c[..(m - 1) * ldc + n];
        if k == 0 {
            if !accumulate {
                (0..m).for_each(|r| c[r * ldc..r * ldc + n].fill(0.0));
            }
            return;
        }
        assert_eq!(packed_b.len(), packed_b_len(k, n), "matmul_bf16: packed B of another shape");
        let a_op = Operand { data: a.data, x_stride: a.row_stride, k_stride: a.col_stride, x_len: m, k_len: k };
        let layout =
            if a.col_stride != 1 && a.row_stride == 1 && m > 1 { ALayout::PairRows } else { ALayout::RowPairs };

        let nkb = k.div_ceil(KC);
        let (a_block, b_block) = (MR * KC2, KC2 * NR);
        let a_len = m.div_ceil(MR) * nkb * a_block;
        with_scratch(&SCRATCH_A, a_len, |packed_a| {
            // Phase 1: pack A. Each panel holds all of k, one block of KC after another.
            let pack_a = |(ip, panel): (usize, &mut [u32])| {
                for (kb, block) in panel.chunks_mut(a_block).enumerate() {
                    // SAFETY: the caller checked this CPU has avx512f + avx512bf16.
                    unsafe { pack_a_block(&a_op, ip, kb, layout, block) };
                }
            };
            if parallel {
                packed_a.par_chunks_mut(nkb * a_block).enumerate().for_each(pack_a);
            } else {
                packed_a.chunks_mut(nkb * a_block).enumerate().for_each(pack_a);
            }

            // Phase 2: multiply, a block of rows of C per task.
            let threads = if parallel { rayon::current_num_threads() } else { 1 };
            // Enough tasks to balance the threads (4 each), no smaller than needed.
            let mc = m.div_ceil(4 * threads).next_multiple_of(MR).clamp(MR, MC_MAX);
            let packed_a = &*packed_a;
            let task = |(t, c_rows): (usize, &mut [f32])| {
                let row0 = t * mc;
                let rows = mc.min(m - row0);
                assert!((rows - 1) * ldc + n <= c_rows.len(), "matmul_bf16: C block exceeds its rows");
                for j0 in (0..n).step_by(NC) {
                    let cols_blk = NC.min(n - j0);
                    for kb in 0..nkb {
                        let kc2 = (KC.min(k - kb * KC)).div_ceil(2);
                        let add_c = accumulate || kb > 0;
                        for jr in (0..cols_blk).step_by(NR) {
                            let jp = (j0 + jr) / NR;
                            let bb = &packed_b[(jp * nkb + kb) * b_block..][..b_block];
                            let cols = NR.min(n - j0 - jr);
                            for ir in (0..rows).step_by(MR) {
                                let ip = (row0 + ir) / MR;
                                let ab = &packed_a[(ip * nkb + kb) * a_block..][..a_block];
                                let r = MR.min(rows - ir);
                                // The micro-kernel writes rows ir..ir+r, columns j0+jr..+cols of this block.
                                let c_off = ir * ldc + j0 + jr;
                                assert!(c_off + (r - 1) * ldc + cols <= c_rows.len());
                                let cp = c_rows[c_off..].as_mut_ptr();
                                // SAFETY: avx512f + avx512bf16 are present (caller); `ab` and `bb`
                                // hold a whole packed block (MR·KC2 and KC2·NR pairs) and the kernel
                                // reads pairs < kc2 ≤ KC2 of them; it writes r ≤ MR rows of `cols` ≤ NR
                                // elements `ldc` apart from `cp`, inside `c_rows` by the assert above.
                                unsafe {
                                    match layout {
                                        ALayout::RowPairs => {
                                            micro_kernel::<KC2, 1>(kc2, ab, bb, cp, ldc, r, cols, add_c)
                                        }
                                        ALayout::PairRows => {
                                            micro_kernel::<1, MR>(kc2, ab, bb, cp, ldc, r, cols, add_c)
                                        }
                                    }
                                }
                            }
                        }
                    }
                }
            };
            if parallel {
                c.par_chunks_mut(mc * ldc).enumerate().for_each(task);
            } else {
                c.chunks_mut(mc * ldc).enumerate().for_each(task);
            }
        })
    }

    /// `C[r × cols] (+)= A-block · B-block` over `kc2` pairs of k. A pair `p` of row `i` of A is at
    /// `a[i·AIS + p·APS]`; B's pair `p` of column `j` at `b[p·NR + j]`.
    ///
    /// # Safety
    /// The CPU has avx512f and avx512bf16; `a` and `b` hold every pair named above for `i < MR`,
    /// `j < NR`, `p < kc2`; `c` is valid for `r ≤ MR` rows of `cols ≤ NR` f32 `ldc` apart.
    #[allow(clippy::too_many_arguments)]
    #[target_feature(enable = "avx512f,avx512bf16")]
    unsafe fn micro_kernel<const AIS: usize, const APS: usize>(
        kc2: usize,
        a: &[u32],
        b: &[u32],
        c: *mut f32,
        ldc: usize,
        r: usize,
        cols: usize,
        add_c: bool,
    ) {
        debug_assert!((MR - 1) * AIS + (kc2 - 1) * APS < a.len() && kc2 * NR <= b.len());
        let (a, b) = (a.as_ptr(), b.as_ptr());
        let mut acc = [[_mm512_setzero_ps(); NV]; MR];
        for p in 0..kc2 {
            // SAFETY (both loops): pairs p < kc2 of rows/columns < MR/NR, in bounds by the contract.
            let bp = unsafe { b.add(p * NR) };
            let mut bv = [_mm512_setzero_si512(); NV];
            for (v, bv) in bv.iter_mut().enumerate() {
                *bv = unsafe { _mm512_loadu_si512(bp.add(16 * v).cast()) };
            }
            for (i, acc) in acc.iter_mut().enumerate() {
                let pair = unsafe { *a.add(i * AIS + p * APS) };
                let av = bh(_mm512_set1_epi32(pair as i32));
                for (acc, &bv) in acc.iter_mut().zip(&bv) {
                    *acc = _mm512_dpbf16_ps(*acc, av, bh(bv));
                }
            }
        }
        for (i, acc) in acc.iter().enumerate().take(r) {
            for (v, &acc) in acc.iter().enumerate() {
                let j = 16 * v;
                if j >= cols {
                    break;
                }
                let mask: __mmask16 = if cols - j >= 16 { 0xffff } else { (1u16 << (cols - j)) - 1 };
                // SAFETY: row i < r, columns j.. j+popcount(mask) ≤ cols: inside C by the contract;
                // masked-off lanes are neither read nor written.
                unsafe {
                    let cp = c.add(i * ldc + j);
                    let sum = if add_c { _mm512_add_ps(acc, _mm512_maskz_loadu_ps(mask, cp)) } else { acc };
                    _mm512_mask_storeu_ps(cp, mask, sum);
                }
            }
        }
    }

    /// Reinterprets 32 packed bf16 as the intrinsic's operand type (same 64 bytes).
    #[inline(always)]
    fn bh(x: __m512i) -> __m512bh {
        // SAFETY: both are plain 512-bit vectors; every bit pattern is valid for each.
        unsafe { std::mem::transmute::<__m512i, __m512bh>(x) }
    }

    /// Each lane's f32 rounded to bf16 (nearest even; NaN stays a quiet NaN, as
    /// `half::bf16::from_f32`), in the lane's low 16 bits. Not `vcvtneps2bf16`: that one flushes
    /// subnormal inputs to zero, which `half` does not.
    #[inline]
    #[target_feature(enable = "avx512f")]
    fn round_bf16(x: __m512) -> __m512i {
        let bits = _mm512_castps_si512(x);
        let high = _mm512_srli_epi32::<16>(bits);
        let lsb = _mm512_and_si512(high, _mm512_set1_epi32(1));
        let rounded = _mm512_srli_epi32::<16>(_mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))));
        let nan = _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(x, x);
        _mm512_mask_blend_epi32(nan, rounded, _mm512_or_si512(high, _mm512_set1_epi32(0x40)))
    }

    /// `lo | hi << 16` of two rounded vectors: 16 pairs, one per lane.
    #[inline]
    #[target_feature(enable = "avx512f")]
    fn pair_lanes(lo: __m512, hi: __m512) -> __m512i {
        _mm512_or_si512(round_bf16(lo), _mm512_slli_epi32::<16>(round_bf16(hi)))
    }

    /// The first `n ≤ 16` lanes.
    fn lanes(n: usize) -> __mmask16 {
        if n >= 16 { 0xffff } else { (1u16 << n) - 1 }
    }

    /// 16 pairs from `nk ≤ 32` contiguous f32 at `p` (missing ones are zero).
    ///
    /// # Safety
    /// avx512f; `p` is valid for `nk` reads.
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn pairs_contiguous(p: *const f32, nk: usize) -> __m512i {
        // SAFETY: masked loads touch only the first nk elements.
        let lo = unsafe { _mm512_maskz_loadu_ps(lanes(nk), p) };
        let hi =
            if nk > 16 { unsafe { _mm512_maskz_loadu_ps(lanes(nk - 16), p.add(16)) } } else { _mm512_setzero_ps() };
        let (lo, hi) = (round_bf16(lo), round_bf16(hi));
        // Truncate each lane to its low 16 bits: 32 bf16 in k order = 16 pairs, even k low.
        let lo16 = _mm512_cvtepi32_epi16(lo);
        let hi16 = _mm512_cvtepi32_epi16(hi);
        _mm512_inserti64x4::<1>(_mm512_castsi256_si512(lo16), hi16)
    }

    /// One pair (`k`, `k+1`) of `dst.len()` consecutive x from `x0` (x contiguous), zero past
    /// `x_len` and past k's end, into `dst`.
    ///
    /// # Safety
    /// avx512f; `op.x_stride == 1`.
    #[target_feature(enable = "avx512f")]
    unsafe fn pack_pair_of_xs(op: &Operand, x0: usize, k: usize, k_end: usize, dst: &mut [u32]) {
        let valid = op.x_len.saturating_sub(x0);
        for xs in (0..dst.len()).step_by(16) {
            let nload = valid.saturating_sub(xs).min(16);
            let (mut lo, mut hi) = (_mm512_setzero_ps(), _mm512_setzero_ps());
            if nload > 0 {
                // SAFETY: elements (x0+xs .. +nload, k) and (…, k+1) exist (x < x_len, k < k_end
                // ≤ k_len) and are contiguous; masked loads read only those.
                unsafe {
                    lo = _mm512_maskz_loadu_ps(lanes(nload), op.ptr(x0 + xs, k));
                    if k + 1 < k_end {
                        hi = _mm512_maskz_loadu_ps(lanes(nload), op.ptr(x0 + xs, k + 1));
                    }
                }
            }
            let nstore = (dst.len() - xs).min(16);
            // SAFETY: writes lanes < nstore of dst[xs..].
            unsafe { _mm512_mask_storeu_epi32(dst[xs..].as_mut_ptr().cast(), lanes(nstore), pair_lanes(lo, hi)) };
        }
    }

    /// The pairs of one x over `k0..k0+kc` into `dst` (≥ ceil(kc/2) rounded up to 16 long when k
    /// is contiguous).
    ///
    /// # Safety
    /// avx512f; `x < op.x_len`, `k0 + kc ≤ op.k_len`.
    #[target_feature(enable = "avx512f")]
    unsafe fn pack_pairs_of_x(op: &Operand, x: usize, k0: usize, kc: usize, dst: &mut [u32]) {
        if op.k_stride == 1 {
            for c in (0..kc).step_by(32) {
                assert!(c / 2 + 16 <= dst.len());
                // SAFETY: kc - c contiguous elements from (x, k0+c) exist; the store writes
                // dst[c/2..c/2+16], asserted above.
                unsafe {
                    let v = pairs_contiguous(op.ptr(x, k0 + c), (kc - c).min(32));
                    _mm512_storeu_si512(dst[c / 2..].as_mut_ptr().cast(), v);
                }
            }
        } else {
            for (p, d) in dst.iter_mut().enumerate().take(kc.div_ceil(2)) {
                let lo = bf16_bits(op.get(x, k0 + 2 * p));
                let hi = if 2 * p + 1 < kc { bf16_bits(op.get(x, k0 + 2 * p + 1)) } else { 0 };
                *d = lo | hi << 16;
            }
        }
    }

    fn bf16_bits(x: f32) -> u32 {
        half::bf16::from_f32(x).to_bits() as u32
    }

    /// Packs rows `ip·MR..` of A over k block `kb` into `out` (`MR·KC2` pairs) in `layout`.
    ///
    /// # Safety
    /// avx512f.
    #[target_feature(enable = "avx512f")]
    unsafe fn pack_a_block(op: &Operand, ip: usize, kb: usize, layout: ALayout, out: &mut [u32]) {
        assert_eq!(out.len(), MR * KC2);
        let (x0, k0) = (ip * MR, kb * KC);
        let kc = KC.min(op.k_len - k0);
        let kc2 = kc.div_ceil(2);
        match layout {
            ALayout::RowPairs => {
                for (i, row) in out.chunks_mut(KC2).enumerate() {
                    if x0 + i < op.x_len {
                        // SAFETY: avx512f (caller); row x0+i exists, k0+kc ≤ k_len.
                        unsafe { pack_pairs_of_x(op, x0 + i, k0, kc, row) };
                    } else {
                        row[..kc2].fill(0);
                    }
                }
            }
            ALayout::PairRows => {
                for (p, dst) in out.chunks_mut(MR).take(kc2).enumerate() {
                    // SAFETY: avx512f (caller); PairRows is chosen only when A's rows are contiguous.
                    unsafe { pack_pair_of_xs(op, x0, k0 + 2 * p, k0 + kc, dst) };
                }
            }
        }
    }

    /// Packs columns `jp·NR..` of B over k block `kb` into `out` (`KC2·NR` pairs, `[p][j]`).
    ///
    /// # Safety
    /// avx512f.
    #[target_feature(enable = "avx512f")]
    unsafe fn pack_b_block(op: &Operand, jp: usize, kb: usize, out: &mut [u32]) {
        assert_eq!(out.len(), KC2 * NR);
        let (x0, k0) = (jp * NR, kb * KC);
        let kc = KC.min(op.k_len - k0);
        let kc2 = kc.div_ceil(2);
        if op.x_stride == 1 && op.x_len > 1 {
            for (p, dst) in out.chunks_mut(NR).take(kc2).enumerate() {
                // SAFETY: avx512f (caller); B's columns are contiguous.
                unsafe { pack_pair_of_xs(op, x0, k0 + 2 * p, k0 + kc, dst) };
            }
        } else if op.k_stride == 1 {
            // Each column's k is contiguous (a transposed weight): 16 columns × 16 pairs at a
            // time, transposed in registers to pair-major.
            for xg in (0..NR).step_by(16) {
                for c in (0..kc).step_by(32) {
                    let mut rows = [_mm512_setzero_si512(); 16];
                    for (q, row) in rows.iter_mut().enumerate() {
                        let x = x0 + xg + q;
                        if x < op.x_len {
                            // SAFETY: column x exists and holds kc - c contiguous k from k0+c.
                            *row = unsafe { pairs_contiguous(op.ptr(x, k0 + c), (kc - c).min(32)) };
                        }
                    }
                    let t = transpose16(rows);
                    for (q, t) in t.iter().enumerate().take(kc2 - c / 2) {
                        let at = (c / 2 + q) * NR + xg;
                        assert!(at + 16 <= out.len());
                        // SAFETY: writes out[at..at+16], asserted above.
                        unsafe { _mm512_storeu_si512(out[at..].as_mut_ptr().cast(), *t) };
                    }
                }
            }
        } else {
            for (p, dst) in out.chunks_mut(NR).take(kc2).enumerate() {
                for (j, d) in dst.iter_mut().enumerate() {
                    let x = x0 + j;
                    let k = k0 + 2 * p;
                    *d = if x < op.x_len {
                        let hi = if 2 * p + 1 < kc { bf16_bits(op.get(x, k + 1)) } else { 0 };
                        bf16_bits(op.get(x, k)) | hi << 16
                    } else {
                        0
                    };
                }
            }
        }
    }

    /// Transposes a 16×16 matrix of 32-bit lanes (`r[row]` lane `col` → `out[col]` lane `row`).
    #[target_feature(enable = "avx512f")]
    fn transpose16(r: [__m512i; 16]) -> [__m512i; 16] {
        // Stage 1 and 2 (within 128-bit lanes): u[4g + c], lane L = rows 4g..4g+4 of column 4L+c.
        let mut t = [_mm512_setzero_si512(); 16];
        for j in 0..8 {
            t[2 * j] = _mm512_unpacklo_epi32(r[2 * j], r[2 * j + 1]);
            t[2 * j + 1] = _mm512_unpackhi_epi32(r[2 * j], r[2 * j + 1]);
        }
        let mut u = [_mm512_setzero_si512(); 16];
        for g in 0..4 {
            let (t0, t1, t2, t3) = (t[4 * g], t[4 * g + 1], t[4 * g + 2], t[4 * g + 3]);
            u[4 * g] = _mm512_unpacklo_epi64(t0, t2);
            u[4 * g + 1] = _mm512_unpackhi_epi64(t0, t2);
            u[4 * g + 2] = _mm512_unpacklo_epi64(t1, t3);
            u[4 * g + 3] = _mm512_unpackhi_epi64(t1, t3);
        }
        // Stages 3 and 4 (across 128-bit lanes): out[4L + c] = lane L of u[c], u[4+c], u[8+c], u[12+c].
        let mut out = [_mm512_setzero_si512(); 16];
        for c in 0..4 {
            let v_lo = _mm512_shuffle_i32x4::<0x44>(u[c], u[4 + c]);
            let v_hi = _mm512_shuffle_i32x4::<0xee>(u[c], u[4 + c]);
            let w_lo = _mm512_shuffle_i32x4::<0x44>(u[8 + c], u[12 + c]);
            let w_hi = _mm512_shuffle_i32x4::<0xee>(u[8 + c], u[12 + c]);
            out[c] = _mm512_shuffle_i32x4::<0x88>(v_lo, w_lo);
            out[4 + c] = _mm512_shuffle_i32x4::<0xdd>(v_lo, w_lo);
            out[8 + c] = _mm512_shuffle_i32x4::<0x88>(v_hi, w_hi);
            out[12 + c] = _mm512_shuffle_i32x4::<0xdd>(v_hi, w_hi);
        }
        out
    }

    #[cfg(test)]
    pub(super) mod probe {
        //! Entry points for the tests of the packing helpers.
        use super::*;

        /// `round_bf16` on 16 values, or None without avx512f.
        pub fn round16(x: [f32; 16]) -> Option<[u32; 16]> {
            if !std::arch::is_x86_feature_detected!("avx512f") {
                return None;
            }
            // SAFETY: avx512f is present; the loads and stores cover the two 16-lane arrays.
            unsafe {
                let v = round_bf16(_mm512_loadu_ps(x.as_ptr()));
                let mut out = [0u32; 16];
                _mm512_storeu_si512(out.as_mut_ptr().cast(), v);
                Some(out)
            }
        }

        /// `transpose16` on a 16×16 array, or None without avx512f.
        pub fn transpose(x: [[u32; 16]; 16]) -> Option<[[u32; 16]; 16]> {
            if !std::arch::is_x86_feature_detected!("avx512f") {
                return None;
            }
            // SAFETY: avx512f is present; each load/store covers one 16-lane row.
            unsafe {
                let mut r = [_mm512_setzero_si512(); 16];
                for (v, row) in r.iter_mut().zip(&x) {
                    *v = _mm512_loadu_si512(row.as_ptr().cast());
                }
                let t = transpose16(r);
                let mut out = [[0u32; 16]; 16];
                for (row, v) in out.iter_mut().zip(&t) {
                    _mm512_storeu_si512(row.as_mut_ptr().cast(), *v);
                }
                Some(out)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::Rng;

    /// Unit roundoff of f32.
    const U: f64 = 1.0 / (1u64 << 24) as f64;

    fn f32s(rng: &mut Rng, n: usize) -> Vec<f32> {
        rng.vec(n, 1.0).into_iter().map(|x| x as f32).collect()
    }

    /// Checks `got` (C after the product, C₀ before it) against the f64 reference of the rounded
    /// operands, element by element. Tolerance: the products of two bf16 are exact in f32, so the
    /// only error is the f32 rounding of the running sums: at most one rounding per term, per k
    /// block and for adding C₀, i.e. `|error| ≤ (k + k/KC + 3)·u·(|C₀| + Σ_p |a_ip||b_pj|)`
    /// with u = 2⁻²⁴ (the standard bound for recursive summation in any order, KC = 256 the
    /// largest k block of any path here).
    #[allow(clippy::too_many_arguments)]
    fn check(
        what: &str,
        got: &[f32],
        c0: &[f32],
        ldc: usize,
        a: MatRef<f32>,
        b: MatRef<f32>,
        m: usize,
        n: usize,
        k: usize,
        accumulate: bool,
    ) {
        let want = matmul_bf16_reference(a, b, m, n, k);
        let r = |x: f32| bf16::from_f32(x).to_f64().abs();
        let terms = (k + k / 256 + 3) as f64;
        for i in 0..m {
            for j in 0..n {
                let base = if accumulate { c0[i * ldc + j] as f64 } else { 0.0 };
                let mag: f64 = base.abs()
                    + (0..k)
                        .map(|p| {
                            r(a.data[i * a.row_stride + p * a.col_stride])
                                * r(b.data[p * b.row_stride + j * b.col_stride])
                        })
                        .sum::<f64>();
                let (g, w) = (got[i * ldc + j] as f64, base + want[i * n + j]);
                assert!(
                    (g - w).abs() <= terms * U * mag + 1e-37,
                    "{what}: C[{i},{j}] = {g}, want {w} (bound {})",
                    terms * U * mag
                );
            }
            // Padding between rows of a strided C is never touched.
            for j in n..ldc.min(c0.len().saturating_sub(i * ldc)) {
                assert_eq!(
                    got[i * ldc + j].to_bits(),
                    c0[i * ldc + j].to_bits(),
                    "{what}: C padding [{i},{j}] written"
                );
            }
        }
    }

    /// The rounding the packers use is `half`'s, bit for bit: ties to even, carries into the
    /// exponent and to infinity, subnormals kept (not flushed), NaNs quiet.
    #[test]
    fn vector_rounding_equals_half() {
        let mut rng = Rng::new(7);
        let mut values: Vec<f32> = vec![
            0.0,
            -0.0,
            1.0,
            -1.0,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::NAN,
            -f32::NAN,
            f32::MAX,
            f32::MIN,
            f32::MIN_POSITIVE,
            1e-40,
            -1e-41,
            f32::from_bits(1),
            f32::from_bits(0x7f80_0001),
            f32::from_bits(0xffc0_1234),
            f32::from_bits(0x3f80_8000),
            f32::from_bits(0x3f81_8000),
            f32::from_bits(0x3f80_8001),
            f32::from_bits(0x7f7f_ffff),
            f32::from_bits(0x007f_ffff),
            f32::from_bits(0x0000_8000),
            f32::from_bits(0x0001_8000),
        ];
        values.extend((0..100_000).map(|_| f32::from_bits(rng.next_u64() as u32)));
        values.resize(values.len().next_multiple_of(16), 0.0);
        for chunk in values.chunks(16) {
            let x: [f32; 16] = chunk.try_into().unwrap();
            let Some(got) = avx512::probe::round16(x) else { return };
            for (g, v) in got.iter().zip(&x) {
                assert_eq!(*g, bf16::from_f32(*v).to_bits() as u32, "{v:e} ({:#010x})", v.to_bits());
            }
        }
    }

    /// B packed once ([`PackedB`]) gives the same bits as packed inside each product, for a
    /// linear layer's two uses of its weight (`Wᵀ`, a transposed view, and `W`, rows), at
    /// shapes with edges (n not a multiple of NR, odd k, k past one KC block) and one packed B
    /// reused by products of different row counts, with and without accumulation.
    #[test]
    fn packed_b_gives_the_same_bits() {
        let mut rng = Rng::new(11);
        for &(n, k) in &[(48, 64), (50, 33), (97, 300), (384, 384), (7, 1)] {
            let w = f32s(&mut rng, n * k); // [n, k]: B = Wᵀ (k × n)
            let wt = MatRef::rows(&w, k).t();
            let w2 = f32s(&mut rng, k * n); // [k, n]: B = W (k × n)
            let wp = MatRef::rows(&w2, n);
            for (what, b) in [("Wᵀ", wt), ("W", wp)] {
                let mut packed = PackedB::default();
                if !packed.pack(b, k, n) {
                    assert_eq!(bf16_path(), Bf16Path::Fallback, "only the fallback packs nothing");
                    return;
                }
                assert!(packed.holds(k, n) && !packed.holds(n, k + 1));
                for &(m, accumulate) in &[(1, false), (8, true), (37, false), (112, true)] {
                    let a = f32s(&mut rng, m * k);
                    let c0 = f32s(&mut rng, m * n);
                    let (mut want, mut got) = (c0.clone(), c0.clone());
                    matmul_bf16(&mut want, n, MatRef::rows(&a, k), b, m, n, k, accumulate);
                    matmul_bf16_packed(&mut got, n, MatRef::rows(&a, k), &packed, m, n, k, accumulate);
                    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                    assert_eq!(bits(&got), bits(&want), "{what} n={n} k={k} m={m}");
                }
            }
        }
    }

    /// A `PackedB` reused for another B's shape is refused, not read out of bounds.
    #[test]
    #[should_panic(expected = "packed as")]
    fn packed_b_of_another_shape_is_refused() {
        let w = vec![1.0f32; 64 * 32];
        let mut packed = PackedB::default();
        if !packed.pack(MatRef::rows(&w, 32), 64, 32) {
            panic!("packed as nothing: the fallback path");
        }
        let mut c = vec![0.0f32; 4 * 64];
        matmul_bf16_packed(&mut c, 64, MatRef::rows(&w[..4 * 32], 32), &packed, 4, 64, 32, false);
    }

    #[test]
    fn register_transpose_is_a_transpose() {
        let mut x = [[0u32; 16]; 16];
        for (r, row) in x.iter_mut().enumerate() {
            for (c, v) in row.iter_mut().enumerate() {
                *v = (r * 100 + c) as u32;
            }
        }
        let Some(t) = avx512::probe::transpose(x) else { return };
        for r in 0..16 {
            for c in 0..16 {
                assert_eq!(t[c][r], x[r][c], "[{r}][{c}]");
            }
        }
    }

    /// Both paths against the reference: sizes around and past the blocks (MR = 8, NR = 48,
    /// KC = 256), 1 and odd, every transpose combination, accumulate on and off, a strided C,
    /// serial and parallel.
    #[test]
    fn matches_reference_all_layouts() {
        let mut rng = Rng::new(1);
        let shapes = [
            (1, 1, 1),
            (1, 5, 3),
            (7, 1, 2),
            (3, 5, 7),
            (8, 48, 32),
            (9, 49, 33),
            (13, 17, 255),
            (17, 50, 257),
            (40, 97, 300),
            (65, 130, 513),
        ];
        for &(m, n, k) in &shapes {
            for (ta, tb) in [(false, false), (true, false), (false, true), (true, true)] {
                let (av, bv) = (f32s(&mut rng, m * k), f32s(&mut rng, k * n));
                let a = if ta { MatRef::rows(&av, m).t() } else { MatRef::rows(&av, k) };
                let b = if tb { MatRef::rows(&bv, k).t() } else { MatRef::rows(&bv, n) };
                for accumulate in [false, true] {
                    for parallel in [false, true] {
                        let ldc = n + 3;
                        let c0 = f32s(&mut rng, m * ldc);
                        let what = format!("{m}x{n}x{k} ta {ta} tb {tb} acc {accumulate} par {parallel}");
                        let mut c = c0.clone();
                        let pool = rayon::ThreadPoolBuilder::new().num_threads(2).build().unwrap();
                        let path = pool.install(|| matmul_bf16_with(&mut c, ldc, a, b, m, n, k, accumulate, parallel));
                        assert_eq!(path, bf16_path());
                        check(&format!("kernel {what}"), &c, &c0, ldc, a, b, m, n, k, accumulate);
                        let mut cf = c0.clone();
                        matmul_bf16_fallback(&mut cf, ldc, a, b, m, n, k, accumulate);
                        check(&format!("fallback {what}"), &cf, &c0, ldc, a, b, m, n, k, accumulate);
                    }
                }
            }
        }
    }

    /// Views that are neither row- nor column-contiguous (the packers' scalar paths), and column
    /// slices of wider matrices (row stride > columns).
    #[test]
    fn matches_reference_general_strides() {
        let mut rng = Rng::new(2);
        for &(m, n, k) in &[(5, 7, 9), (19, 53, 70), (33, 100, 260)] {
            // A: every other element of a row twice as long, rows 3 apart in a wider buffer.
            let av = f32s(&mut rng, m * (2 * k + 3));
            let a = MatRef { data: &av[..], row_stride: 2 * k + 3, col_stride: 2 };
            let bv = f32s(&mut rng, k * (n + 5) * 2);
            for b in [
                MatRef { data: &bv[..], row_stride: 1, col_stride: 2 * k },
                MatRef::strided(&bv, n + 5),
                MatRef { data: &bv[..], row_stride: 2 * n + 1, col_stride: 2 },
            ] {
                for accumulate in [false, true] {
                    let c0 = f32s(&mut rng, m * n);
                    let mut c = c0.clone();
                    matmul_bf16(&mut c, n, a, b, m, n, k, accumulate);
                    check(
                        &format!("{m}x{n}x{k} b strides {} {}", b.row_stride, b.col_stride),
                        &c,
                        &c0,
                        n,
                        a,
                        b,
                        m,
                        n,
                        k,
                        accumulate,
                    );
                }
            }
        }
    }

    /// Operands already in bf16 with small integer values multiply exactly (every partial sum
    /// is an integer below 2²⁴): then the kernel, the fallback and f32 `matmul` agree bit for bit.
    #[test]
    fn exact_products_agree_bitwise() {
        let mut rng = Rng::new(3);
        let (m, n, k) = (70, 100, 600);
        let ints = |rng: &mut Rng, len| (0..len).map(|_| rng.below(33) as f32 - 16.0).collect::<Vec<f32>>();
        let (av, bv) = (ints(&mut rng, m * k), ints(&mut rng, k * n));
        let (a, b) = (MatRef::rows(&av, k), MatRef::rows(&bv, n));
        let mut want = vec![0f32; m * n];
        matmul(&mut want, n, a, b, m, n, k, false);
        let mut got = vec![1f32; m * n];
        matmul_bf16(&mut got, n, a, b, m, n, k, false);
        let mut fb = vec![1f32; m * n];
        matmul_bf16_fallback(&mut fb, n, a, b, m, n, k, false);
        assert!(got.iter().zip(&want).all(|(x, y)| x.to_bits() == y.to_bits()), "kernel differs from f32 matmul");
        assert!(fb.iter().zip(&want).all(|(x, y)| x.to_bits() == y.to_bits()), "fallback differs from f32 matmul");
    }

    /// The operands really are rounded: a value that bf16 cannot hold (1 + 2⁻¹⁰) contributes as 1.
    #[test]
    fn operands_are_rounded_to_bf16() {
        let a = vec![1.0 + 1.0 / 1024.0; 4];
        let b = vec![1.0f32; 4];
        let mut c = vec![0f32; 1];
        matmul_bf16(&mut c, 1, MatRef::rows(&a, 4), MatRef::rows(&b, 1), 1, 1, 4, false);
        assert_eq!(c[0], 4.0);
        let mut c = vec![0f32; 1];
        matmul_bf16_fallback(&mut c, 1, MatRef::rows(&a, 4), MatRef::rows(&b, 1), 1, 1, 4, false);
        assert_eq!(c[0], 4.0);
    }

    /// On a CPU with `avx512_bf16` the f32 products take the kernel; f64 operands always take
    /// the fallback (the kernel is f32 only).
    #[test]
    fn kernel_runs_where_the_cpu_has_it() {
        #[cfg(target_arch = "x86_64")]
        if std::arch::is_x86_feature_detected!("avx512bf16") && std::arch::is_x86_feature_detected!("avx512f") {
            assert_eq!(bf16_path(), Bf16Path::Avx512Bf16);
        }
        let (a, b) = (vec![1.5f32; 6], vec![2.0f32; 6]);
        let mut c = vec![0f32; 4];
        assert_eq!(matmul_bf16(&mut c, 2, MatRef::rows(&a, 3), MatRef::rows(&b, 2), 2, 2, 3, false), bf16_path());
        assert_eq!(c, vec![9.0; 4]);
        let (a, b) = (vec![1.5f64; 6], vec![2.0f64; 6]);
        let mut c = vec![0f64; 4];
        assert_eq!(
            matmul_bf16(&mut c, 2, MatRef::rows(&a, 3), MatRef::rows(&b, 2), 2, 2, 3, false),
            Bf16Path::Fallback
        );
        assert_eq!(c, vec![9.0; 4]);
    }

    /// Bitwise-identical results on 1 and 2 threads at a size that goes parallel, and k = 0.
    #[test]
    fn deterministic_across_thread_counts() {
        let mut rng = Rng::new(4);
        let (m, n, k) = (300, 200, 520);
        let (av, bv) = (f32s(&mut rng, m * k), f32s(&mut rng, n * k));
        let run = |threads: usize| {
            let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
            let mut c = vec![0f32; m * n];
            pool.install(|| matmul_bf16(&mut c, n, MatRef::rows(&av, k), MatRef::rows(&bv, k).t(), m, n, k, false));
            c.iter().map(|x| x.to_bits()).collect::<Vec<u32>>()
        };
        assert_eq!(run(1), run(2));
        let mut c = vec![5f32; 6];
        matmul_bf16(&mut c, 3, MatRef::rows(&[0f32; 0], 0), MatRef::rows(&[0f32; 0], 3), 2, 3, 0, false);
        assert_eq!(c, vec![0.0; 6]);
    }
}
