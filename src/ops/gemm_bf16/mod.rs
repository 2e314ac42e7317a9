//! bf16 matrix products on the CPU: `C[m×n] (+)= A[m×k]·B[k×n]` with A and B f32 views
//! ([`MatRef`], strided or transposed) whose values are rounded to bf16 (round to nearest even,
//! exactly as `half::bf16::from_f32`), products accumulated in f32. This is what `--precision
//! bf16` means on the `cpu` backend: the operands of the products lose their low 16 mantissa
//! bits, everything else (activations in memory, master weights, gradients, optimizer state)
//! stays f32, as on the GPU backends.
//!
//! Why a kernel of our own: the `gemm` crate has no bf16 × bf16 → f32 path, and on CPUs with
//! `avx512_bf16` one `vdpbf16ps` does 32 multiply-adds (16 lanes × a pair of k) where an f32
//! FMA does 16, at half the bytes per operand: twice the f32 peak on AMD's cores. Intel's issue
//! it on one port where FMAs go to two, so there it only matches f32 (and the packing makes it
//! slower: [`bf16_is_faster`]); Intel's fast path is AMX (below).
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
//! operands to bf16 in a vectorised pass, into copies of the same orientation, and calls
//! [`matmul`] on them: the same rounding of the inputs, accumulation in the element type (f32,
//! or f64 for f64 operands) in another order. [`matmul_bf16_reference`] is the triple loop in
//! f64 over the rounded inputs that both are tested against.
//!
//! On CPUs with AMX (`amx` below) the same packing feeds `tdpbf16ps` on tiles instead: written
//! without AMX hardware, tested on an emulation of the tile instructions, and checked against
//! the reference on the CPU before its first use (see that module).
//!
//! `PT_BF16_KERNEL=amx|avx512|fallback` caps the path (like `PT_VECTOR`), for comparing speeds.

use crate::ops::matmul::{MatRef, check_c, matmul, matmul_with};
use crate::ops::simd::vectorized;
use crate::scalar::Float;
use gemm::Parallelism;
use half::bf16;
use rayon::prelude::*;
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

/// The code that computes [`matmul_bf16`] on this CPU, slowest first.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Bf16Path {
    /// Round to bf16, widen, f32 [`matmul`].
    Fallback,
    /// The `vdpbf16ps` micro-kernel (`avx512_bf16` + `avx512f`).
    Avx512Bf16,
    /// `tdpbf16ps` on AMX tiles (AMX-TILE + AMX-BF16, and the above for packing).
    Amx,
}

impl Bf16Path {
    /// Its `PT_BF16_KERNEL` name.
    pub fn name(self) -> &'static str {
        match self {
            Bf16Path::Fallback => "fallback",
            Bf16Path::Avx512Bf16 => "avx512",
            Bf16Path::Amx => "amx",
        }
    }

    /// A `PT_BF16_KERNEL` value, in either case and around spaces.
    fn parse(name: &str) -> Option<Bf16Path> {
        let name = name.trim().to_ascii_lowercase();
        [Bf16Path::Fallback, Bf16Path::Avx512Bf16, Bf16Path::Amx].into_iter().find(|p| p.name() == name)
    }
}

/// Which path [`matmul_bf16`] takes for f32 operands on this CPU: the fastest it has, capped by
/// `PT_BF16_KERNEL`; chosen at the first call (which prints why, where that is not the fastest
/// the CPU names).
pub fn bf16_path() -> Bf16Path {
    static PATH: std::sync::OnceLock<Bf16Path> = std::sync::OnceLock::new();
    *PATH.get_or_init(|| {
        let (path, note) = choose_path(std::env::var("PT_BF16_KERNEL").ok().as_deref());
        if let Some(note) = note {
            eprintln!("{note}");
        }
        path
    })
}

/// The path for this CPU under a `PT_BF16_KERNEL` value, and what to tell the user about it.
fn choose_path(cap: Option<&str>) -> (Bf16Path, Option<String>) {
    let mut notes = Vec::new();
    let cap = match cap.map(|name| (name, Bf16Path::parse(name))) {
        None => Bf16Path::Amx,
        Some((_, Some(cap))) => cap,
        Some((name, None)) => {
            notes.push(format!("warning: PT_BF16_KERNEL={name} ignored; expected amx, avx512 or fallback"));
            Bf16Path::Amx
        }
    };
    let mut path = Bf16Path::Fallback;
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx512f") && std::arch::is_x86_feature_detected!("avx512bf16") {
        path = Bf16Path::Avx512Bf16;
        if cap == Bf16Path::Amx && amx::Hardware::detected() {
            if !amx::Hardware::enable() {
                notes.push("note: this CPU has AMX, but the OS did not grant this process the tile state; bf16 products use vdpbf16ps".into());
            } else if let Some(wrong) = amx_disagreement() {
                notes.push(format!("warning: the AMX bf16 kernel disagrees with the reference on this CPU ({wrong}); bf16 products use vdpbf16ps"));
            } else {
                path = Bf16Path::Amx;
            }
        }
    }
    (path.min(cap), (!notes.is_empty()).then(|| notes.join("\n")))
}

/// Whether bf16 products on this CPU are faster than f32 ones, which is what `--precision auto`
/// asks: on AMX tiles always; through `vdpbf16ps` only on AMD's cores, where it does twice the
/// multiply-adds of an f32 FMA per cycle. Intel's cores issue it on one port where two take
/// FMAs, so it gives the f32 rate, and the packing comes on top: a MiniLM step 918 ms in bf16
/// against 612–640 ms in f32 on a Xeon with AMX held back (`PT_BF16_KERNEL=avx512`,
/// docs/PERF.md). Decided by the CPU and `PT_BF16_KERNEL` (which caps the path), never by a
/// timing: the same machine and environment give `auto` the same arithmetic every run.
pub fn bf16_is_faster() -> bool {
    bf16_faster_on(bf16_path(), cpu_is_amd())
}

/// [`bf16_is_faster`] for a path on a CPU of AMD or not.
fn bf16_faster_on(path: Bf16Path, amd: bool) -> bool {
    match path {
        Bf16Path::Amx => true,
        Bf16Path::Avx512Bf16 => amd,
        Bf16Path::Fallback => false,
    }
}

/// Whether the CPU's vendor string (CPUID leaf 0) is AMD's.
fn cpu_is_amd() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        let id = std::arch::x86_64::__cpuid(0);
        let vendor: Vec<u8> = [id.ebx, id.edx, id.ecx].iter().flat_map(|r| r.to_le_bytes()).collect();
        vendor == b"AuthenticAMD"
    }
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// The AMX kernel on this CPU's tiles against the f64 reference, at shapes with edges in every
/// dimension (rows and columns past a tile, k past a block and odd) and without (C's tiles then
/// read from and written to C), both A layouts, writing C and adding to it: the first
/// disagreement beyond f32 rounding, described. The kernel was written on machines without
/// AMX (see `amx`): this keeps a wrong result there from reaching a training run. Serial: a
/// parallel product could steal, on this thread, work that asks for the path being chosen.
#[cfg(target_arch = "x86_64")]
fn amx_disagreement() -> Option<String> {
    let mut state = 0x2545_f491u32;
    let mut values = |len: usize| -> Vec<f32> {
        (0..len)
            .map(|_| {
                state = state.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
                (state >> 8) as f32 / (1 << 23) as f32 - 1.0
            })
            .collect()
    };
    for (m, n, k) in [(37, 53, 301), (32, 96, 300)] {
        let (av, bv, c0) = (values(m * k), values(k * n), values(m * n));
        let b = MatRef::rows(&bv, n);
        for a in [MatRef::rows(&av, k), MatRef::rows(&av, m).t()] {
            for accumulate in [false, true] {
                let mut c = c0.clone();
                avx512::gemm(amx::gemm_packed::<amx::Hardware>, &mut c, n, a, b, m, n, k, accumulate, false);
                if let Some(wrong) = reference_mismatch(&c, n, accumulate.then_some(&c0[..]), a, b, m, n, k) {
                    return Some(format!("{m}×{n}×{k}, accumulate {accumulate}: {wrong}"));
                }
            }
        }
    }
    None
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
    if let Some(kernel) = packed_kernel(bf16_path())
        && let (Some(c32), Some(a32), Some(b32)) = (as_f32_mut(c), as_f32(a.data), as_f32(b.data))
    {
        let a = MatRef { data: a32, row_stride: a.row_stride, col_stride: a.col_stride };
        let b = MatRef { data: b32, row_stride: b.row_stride, col_stride: b.col_stride };
        avx512::gemm(kernel, c32, c_row_stride, a, b, m, n, k, accumulate, parallel);
        return bf16_path();
    }
    fallback(c, c_row_stride, a, b, m, n, k, accumulate, parallel);
    Bf16Path::Fallback
}

/// The kernel that multiplies packed operands on `path`, where it has one.
#[cfg(target_arch = "x86_64")]
fn packed_kernel(path: Bf16Path) -> Option<avx512::PackedKernel> {
    match path {
        Bf16Path::Amx => Some(amx::gemm_packed::<amx::Hardware>),
        Bf16Path::Avx512Bf16 => Some(avx512::gemm_packed),
        Bf16Path::Fallback => None,
    }
}

/// The B operand of bf16 products packed once for the micro-kernels (both pack B alike), for products
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
        if bf16_path() != Bf16Path::Fallback
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

    /// The bytes [`pack`](Self::pack) holds for a `k × n` B of f32 on this CPU: the packed
    /// pairs, padded to whole panels and k blocks, and the slack that aligns them; none where
    /// nothing is packed.
    pub fn bytes(k: usize, n: usize) -> usize {
        #[cfg(target_arch = "x86_64")]
        if bf16_path() != Bf16Path::Fallback {
            return (avx512::packed_b_len(k, n) + 16) * std::mem::size_of::<u32>();
        }
        let _ = (k, n);
        0
    }

    /// The bytes it holds now.
    pub fn held_bytes(&self) -> usize {
        self.words.len() * std::mem::size_of::<u32>()
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
    check_c("matmul_bf16", c.len(), c_row_stride, m, n);
    check_operand("A", &a, m, k);
    let (Some(c32), Some(a32)) = (as_f32_mut(c), as_f32(a.data)) else {
        panic!("matmul_bf16_packed: packed products take f32 operands");
    };
    let a = MatRef { data: a32, row_stride: a.row_stride, col_stride: a.col_stride };
    let parallel = parallel(m * n * k);
    #[cfg(target_arch = "x86_64")]
    {
        let words = &b.words[b.start..b.start + avx512::packed_b_len(k, n)];
        let kernel = packed_kernel(bf16_path()).expect("a PackedB is packed only on a micro-kernel's path");
        kernel(c32, c_row_stride, a, words, m, n, k, accumulate, parallel);
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (c32, a, parallel);
        unreachable!("a PackedB is packed only on the micro-kernel's path");
    }
}

/// The portable path: rounds A and B to bf16 (f64 operands through f32) into copies of the
/// same orientation (a transposed view stays transposed, so each copy reads and writes whole
/// lines) and calls [`matmul`] on them, which accumulates in the element type. The rounding is a
/// vectorised pass over the operands, on the pool when they are large: this path serves CPUs
/// without `avx512_bf16` or AMX, where a bf16 step should cost an f32 step and the copies, not more.
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
    fallback(c, c_row_stride, a, b, m, n, k, accumulate, parallel(m * n * k));
}

/// [`matmul_bf16_fallback`] on checked views, on the pool only where `parallel`.
#[allow(clippy::too_many_arguments)]
fn fallback<T: Float>(
    c: &mut [T],
    c_row_stride: usize,
    a: MatRef<T>,
    b: MatRef<T>,
    m: usize,
    n: usize,
    k: usize,
    accumulate: bool,
    parallel: bool,
) {
    let (mut ar, mut br) = (Vec::new(), Vec::new());
    let a = rounded_copy(a, m, k, &mut ar, parallel);
    let b = rounded_copy(b, k, n, &mut br, parallel);
    let par = if parallel { Parallelism::Rayon(rayon::current_num_threads()) } else { Parallelism::None };
    matmul_with(c, c_row_stride, a, b, m, n, k, accumulate, par);
}

/// `x` rounded to the nearest bf16 and widened back: bit for bit `half::bf16::from_f32(x).to_f32()`
/// (ties to even, carries into the exponent and to infinity, subnormals kept, a NaN made quiet),
/// written without branches so that a loop of it vectorises. Adding `0x7fff` plus the kept
/// part's last bit carries into the kept half exactly when the dropped half is above a tie, or
/// a tie with an odd kept half.
#[inline(always)]
pub fn round_to_bf16(x: f32) -> f32 {
    let bits = x.to_bits();
    let high = bits >> 16;
    let rounded = bits.wrapping_add(0x7fff + (high & 1)) >> 16;
    let nan = bits & 0x7fff_ffff > 0x7f80_0000;
    let kept = if nan { high | 0x40 } else { rounded };
    f32::from_bits(kept << 16)
}

/// The `rows × cols` operand `view` with each value rounded to bf16 ([`round_to_bf16`]; f64
/// through f32), copied into `out`: row-major when the view's rows are contiguous lines,
/// column-major when its columns are (a transposed matrix), gathered row-major otherwise.
/// Returns the copy's view. Large copies go to the pool where `parallel`.
fn rounded_copy<'o, T: Float>(
    view: MatRef<T>,
    rows: usize,
    cols: usize,
    out: &'o mut Vec<T>,
    parallel: bool,
) -> MatRef<'o, T> {
    let round = |x: T| T::from_f64(round_to_bf16(x.to_f64() as f32) as f64);
    // Zeroed pages from the allocator: the writers below fault them in, not a memset first.
    *out = vec![T::ZERO; rows * cols];
    // Lines of `len` contiguous elements, `stride` apart in the source; the copy's strides.
    let (len, stride, copy_strides) = if view.col_stride == 1 {
        (cols, view.row_stride, (cols, 1))
    } else if view.row_stride == 1 {
        (rows, view.col_stride, (1, rows))
    } else {
        for (i, dst) in out.chunks_mut(cols.max(1)).enumerate() {
            for (j, d) in dst.iter_mut().enumerate() {
                *d = round(view.data[i * view.row_stride + j * view.col_stride]);
            }
        }
        return MatRef::rows(out, cols);
    };
    if len == 0 {
        return MatRef { data: out, row_stride: copy_strides.0, col_stride: copy_strides.1 };
    }
    // Tasks of whole lines, about 16 K values each (a line is a layer's width, or a
    // micro-batch's rows, as few as a token slice's).
    let per_task = (16_384 / len).max(1);
    let src = view.data;
    let round_lines = |(t, dst): (usize, &mut [T])| {
        vectorized(
            #[inline(always)]
            || {
                for (l, dst) in dst.chunks_mut(len).enumerate() {
                    let start = (t * per_task + l) * stride;
                    dst.iter_mut().zip(&src[start..start + len]).for_each(|(d, &s)| *d = round(s));
                }
            },
        )
    };
    if parallel && out.len() >= PARALLEL_MIN_WORK {
        out.par_chunks_mut(per_task * len).enumerate().for_each(round_lines);
    } else {
        out.chunks_mut(per_task * len).enumerate().for_each(round_lines);
    }
    MatRef { data: out, row_stride: copy_strides.0, col_stride: copy_strides.1 }
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

/// Where `got` (C after `C (+)= A·B`, row stride `ldc`; `c0`, C before, when accumulating)
/// is farther from [`matmul_bf16_reference`] than f32 sums can be: the first such element,
/// described. The products of two bf16 are exact in f32, so the only error is the f32
/// rounding of the running sums: at most one rounding per term, per k block and for adding C₀,
/// i.e. `|error| ≤ (k + k/KC + 3)·u·(|C₀| + Σ_p |a_ip||b_pj|)` with u = 2⁻²⁴ (the standard bound
/// for recursive summation in any order, KC = 256 the largest k block of any path here), plus
/// the smallest normal f32 for a flushed denormal. Not covered: a subnormal bf16 operand
/// times a large one, which `vdpbf16ps` and AMX read as zero (DAZ) and the reference and the
/// fallback keep (e.g. 1e−39 · 1e30 gives 1e−9 there and 0 here). Operands that small
/// (below 1.2e−38) do not occur in training, whose weights and activations are far larger,
/// so the tests draw none.
#[allow(clippy::too_many_arguments)]
pub fn reference_mismatch(
    got: &[f32],
    ldc: usize,
    c0: Option<&[f32]>,
    a: MatRef<f32>,
    b: MatRef<f32>,
    m: usize,
    n: usize,
    k: usize,
) -> Option<String> {
    const U: f64 = 1.0 / (1u64 << 24) as f64;
    let want = matmul_bf16_reference(a, b, m, n, k);
    let r = |x: f32| bf16::from_f32(x).to_f64().abs();
    let terms = (k + k / 256 + 3) as f64;
    for i in 0..m {
        for j in 0..n {
            let base = c0.map_or(0.0, |c0| c0[i * ldc + j] as f64);
            let mag: f64 = base.abs()
                + (0..k)
                    .map(|p| {
                        r(a.data[i * a.row_stride + p * a.col_stride]) * r(b.data[p * b.row_stride + j * b.col_stride])
                    })
                    .sum::<f64>();
            let (g, w, bound) = (got[i * ldc + j] as f64, base + want[i * n + j], terms * U * mag + 1e-37);
            if (g - w).abs() > bound || g.is_nan() != w.is_nan() {
                return Some(format!("C[{i},{j}] = {g}, want {w} (bound {bound:e})"));
            }
        }
    }
    None
}

/// The bounds every path relies on (see [`matmul_bf16`]).
fn check_views<T>(c_len: usize, ldc: usize, a: &MatRef<T>, b: &MatRef<T>, m: usize, n: usize, k: usize) {
    check_c("matmul_bf16", c_len, ldc, m, n);
    check_operand("A", a, m, k);
    check_operand("B", b, k, n);
}

/// A `rows × cols` operand view stays inside its buffer.
fn check_operand<T>(name: &str, v: &MatRef<T>, rows: usize, cols: usize) {
    assert!(v.fits(rows, cols), "matmul_bf16: {name} view exceeds its buffer");
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
mod amx;
#[cfg(target_arch = "x86_64")]
mod avx512;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::Rng;

    fn f32s(rng: &mut Rng, n: usize) -> Vec<f32> {
        rng.vec(n, 1.0).into_iter().map(|x| x as f32).collect()
    }

    /// Checks `got` (C after the product, C₀ before it) against the f64 reference of the rounded
    /// operands, element by element, within f32 rounding ([`reference_mismatch`]).
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
        if let Some(wrong) = reference_mismatch(got, ldc, accumulate.then_some(c0), a, b, m, n, k) {
            panic!("{what}: {wrong}");
        }
        for i in 0..m {
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

    /// Values where rounding to bf16 can go wrong: signed zeros, infinities, NaNs of both signs
    /// and payloads, the largest finite values (which carry to infinity), subnormals, ties
    /// with an even and an odd kept half, just past a tie; then 100 000 random bit patterns.
    fn rounding_cases() -> Vec<f32> {
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
        values
    }

    /// The rounding the packers use is `half`'s, bit for bit: ties to even, carries into the
    /// exponent and to infinity, subnormals kept (not flushed), NaNs quiet.
    #[test]
    fn vector_rounding_equals_half() {
        let mut values = rounding_cases();
        values.resize(values.len().next_multiple_of(16), 0.0);
        for chunk in values.chunks(16) {
            let x: [f32; 16] = chunk.try_into().unwrap();
            let Some(got) = avx512::probe::round16(x) else { return };
            for (g, v) in got.iter().zip(&x) {
                assert_eq!(*g, bf16::from_f32(*v).to_bits() as u32, "{v:e} ({:#010x})", v.to_bits());
            }
        }
    }

    /// The fallback's branch-free rounding is `half`'s, bit for bit: on the cases above, and
    /// on every kept half (all 65 536) with each dropped half a rounding can turn on (zero,
    /// one, just below, at and just above a tie, all ones).
    #[test]
    fn scalar_rounding_equals_half() {
        let boundaries = (0..=0xffffu32)
            .flat_map(|high| [0, 1, 0x7fff, 0x8000, 0x8001, 0xffff].map(|low| f32::from_bits(high << 16 | low)));
        for v in rounding_cases().into_iter().chain(boundaries) {
            let want = bf16::from_f32(v).to_f32().to_bits();
            assert_eq!(round_to_bf16(v).to_bits(), want, "{v:e} ({:#010x})", v.to_bits());
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

    /// A product `C (+)= A·B` as the layout tests call it: `(c, ldc, a, b, m, n, k, accumulate,
    /// parallel)`.
    type Product<'p> = &'p dyn Fn(&mut [f32], usize, MatRef<f32>, MatRef<f32>, usize, usize, usize, bool, bool);

    /// `product` at every shape with every transpose combination of A and B, accumulating and
    /// not, serial and parallel, on a random C with padded rows, checked against the reference;
    /// `before` runs before each layout.
    fn check_every_layout(
        seed: u64,
        shapes: &[(usize, usize, usize)],
        before: &dyn Fn(),
        product: Product,
        what: &str,
    ) {
        let mut rng = Rng::new(seed);
        for &(m, n, k) in shapes {
            for (ta, tb) in [(false, false), (true, false), (false, true), (true, true)] {
                before();
                let (av, bv) = (f32s(&mut rng, m * k), f32s(&mut rng, k * n));
                let a = if ta { MatRef::rows(&av, m).t() } else { MatRef::rows(&av, k) };
                let b = if tb { MatRef::rows(&bv, k).t() } else { MatRef::rows(&bv, n) };
                for (accumulate, parallel) in [(false, false), (true, true), (true, false), (false, true)] {
                    let ldc = n + 3;
                    let c0 = f32s(&mut rng, m * ldc);
                    let mut c = c0.clone();
                    product(&mut c, ldc, a, b, m, n, k, accumulate, parallel);
                    let case = format!("{what} {m}x{n}x{k} ta {ta} tb {tb} acc {accumulate} par {parallel}");
                    check(&case, &c, &c0, ldc, a, b, m, n, k, accumulate);
                }
            }
        }
    }

    /// Both paths against the reference: sizes around and past the blocks (MR = 8, NR = 48,
    /// KC = 256), 1 and odd, every transpose combination, accumulate on and off, a strided C,
    /// serial and parallel.
    #[test]
    fn matches_reference_all_layouts() {
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
        let pool = rayon::ThreadPoolBuilder::new().num_threads(2).build().unwrap();
        let kernel: Product = &|c, ldc, a, b, m, n, k, accumulate, parallel| {
            let path = pool.install(|| matmul_bf16_with(c, ldc, a, b, m, n, k, accumulate, parallel));
            assert_eq!(path, bf16_path());
        };
        check_every_layout(1, &shapes, &|| {}, kernel, "kernel");
        let fallback: Product = &|c, ldc, a, b, m, n, k, accumulate, parallel| {
            pool.install(|| super::fallback(c, ldc, a, b, m, n, k, accumulate, parallel))
        };
        check_every_layout(1, &shapes, &|| {}, fallback, "fallback");
    }

    /// The fallback is the f32 product of operands rounded by `half`, to the bit, at sizes whose
    /// rounding goes to the pool in tasks of many lines (lines of 32 values, and of 300 to
    /// 400) as well as one: rows and columns of the copies where they belong whichever way
    /// round the operands are. Then, against the reference: a column slice of a wider matrix
    /// rounded on the pool, and products with nothing to sum (k = 0).
    #[test]
    fn fallback_is_the_product_of_rounded_operands() {
        fn view(v: &[f32], rows: usize, cols: usize, t: bool) -> MatRef<'_, f32> {
            if t { MatRef::rows(v, rows).t() } else { MatRef::rows(v, cols) }
        }
        let mut rng = Rng::new(5);
        let pool = rayon::ThreadPoolBuilder::new().num_threads(2).build().unwrap();
        for &(m, n, k) in &[(4000, 40, 32), (300, 384, 400), (3, 2, 1)] {
            for (ta, tb) in [(false, false), (true, false), (false, true), (true, true)] {
                let (av, bv) = (f32s(&mut rng, m * k), f32s(&mut rng, k * n));
                let round = |v: &[f32]| v.iter().map(|&x| bf16::from_f32(x).to_f32()).collect::<Vec<f32>>();
                let (ar, br) = (round(&av), round(&bv));
                let mut want = vec![0f32; m * n];
                pool.install(|| matmul(&mut want, n, view(&ar, m, k, ta), view(&br, k, n, tb), m, n, k, false));
                let mut got = vec![1f32; m * n];
                let (a, b) = (view(&av, m, k, ta), view(&bv, k, n, tb));
                pool.install(|| matmul_bf16_fallback(&mut got, n, a, b, m, n, k, false));
                let same = got.iter().zip(&want).all(|(x, y)| x.to_bits() == y.to_bits());
                assert!(same, "{m}x{n}x{k} ta {ta} tb {tb}: not the product of the rounded operands");
            }
        }
        let (m, n, k) = (300, 384, 400);
        let (av, bv) = (f32s(&mut rng, m * k), f32s(&mut rng, k * (n + 5)));
        let (a, b) = (MatRef::rows(&av, k), MatRef::strided(&bv, n + 5));
        for accumulate in [false, true] {
            let c0 = f32s(&mut rng, m * n);
            let mut c = c0.clone();
            pool.install(|| matmul_bf16_fallback(&mut c, n, a, b, m, n, k, accumulate));
            check(&format!("strided B, accumulate {accumulate}"), &c, &c0, n, a, b, m, n, k, accumulate);
        }
        for accumulate in [false, true] {
            let mut c = vec![3f32; 6];
            matmul_bf16_fallback(&mut c, 3, MatRef::rows(&[], 0), MatRef::rows(&[], 3), 2, 3, 0, accumulate);
            assert_eq!(c, vec![if accumulate { 3.0 } else { 0.0 }; 6], "k = 0, accumulate {accumulate}");
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
                for (accumulate, fallback) in [(false, false), (true, false), (false, true), (true, true)] {
                    let c0 = f32s(&mut rng, m * n);
                    let mut c = c0.clone();
                    if fallback {
                        matmul_bf16_fallback(&mut c, n, a, b, m, n, k, accumulate);
                    } else {
                        matmul_bf16(&mut c, n, a, b, m, n, k, accumulate);
                    }
                    let (rs, cs) = (b.row_stride, b.col_stride);
                    let case = format!("{m}x{n}x{k} b strides {rs} {cs}, fallback {fallback}");
                    check(&case, &c, &c0, n, a, b, m, n, k, accumulate);
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
        // f64 operands take the fallback, rounded through f32 alike.
        let (a, b) = (vec![1.0 + 1.0 / 1024.0; 4], vec![1.0f64; 4]);
        let mut c = vec![0f64; 1];
        matmul_bf16(&mut c, 1, MatRef::rows(&a, 4), MatRef::rows(&b, 1), 1, 1, 4, false);
        assert_eq!(c[0], 4.0);
    }

    /// The AMX kernel on emulated tiles against the reference: shapes around and past its
    /// blocks (16-row tiles, 48-column panels, whole blocks read from and written to C directly,
    /// k past a block and odd, so pairs past the end must be zero), every transpose combination
    /// (a transposed A takes the register-transposing packer, a single row the scalar one),
    /// accumulate on and off, a strided C, serial and parallel, and general strides. All on one
    /// pool whose threads' scratch holds NaN operands before each layout: a packer that left
    /// stale pairs past k's end in A or B would show (0·NaN is NaN). (On a CPU without avx512f
    /// there is no AMX, and the packers' vector code cannot run: nothing to test.)
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn amx_kernel_on_emulated_tiles_matches_reference() {
        if !std::arch::is_x86_feature_detected!("avx512f") {
            return; // the packers' vector code
        }
        let kernel: avx512::PackedKernel = amx::gemm_packed::<amx::Emulated>;
        let pool = rayon::ThreadPoolBuilder::new().num_threads(2).build().unwrap();
        // Fills every pool thread's scratch past what the products below use: A panels of 80
        // rows and B panels of 144 columns, k to 768 (three blocks).
        let poison = || {
            let (m, n, k) = (80, 144, 768);
            let nans = vec![f32::NAN; k * n.max(m)];
            pool.broadcast(|_| {
                let mut c = vec![0f32; m * n];
                avx512::gemm(kernel, &mut c, n, MatRef::rows(&nans, k), MatRef::rows(&nans, n), m, n, k, false, false)
            });
        };
        let mut rng = Rng::new(6);
        poison();
        let (m, n, k) = (19, 53, 70);
        let av = f32s(&mut rng, m * (2 * k + 3));
        let a = MatRef { data: &av[..], row_stride: 2 * k + 3, col_stride: 2 };
        let bv = f32s(&mut rng, k * (n + 5) * 2);
        let b = MatRef { data: &bv[..], row_stride: 2 * n + 1, col_stride: 2 };
        let c0 = f32s(&mut rng, m * n);
        let mut c = c0.clone();
        pool.install(|| avx512::gemm(kernel, &mut c, n, a, b, m, n, k, true, false));
        check("amx general strides", &c, &c0, n, a, b, m, n, k, true);

        let shapes = [
            (1, 5, 3),
            (7, 1, 2),
            (16, 48, 32),
            (17, 49, 33),
            (32, 96, 520),
            (13, 17, 255),
            (40, 97, 300),
            (65, 130, 513),
        ];
        let product: Product = &|c, ldc, a, b, m, n, k, accumulate, parallel| {
            pool.install(|| avx512::gemm(kernel, c, ldc, a, b, m, n, k, accumulate, parallel))
        };
        check_every_layout(5, &shapes, &poison, product, "amx");
    }

    /// The emulated `tdpbf16ps` is the Intel SDM's: even and odd products summed apart over the
    /// tile's pairs and then added to C (so 2²⁴ + 1 − 2²⁴ + 1 gives 2, where one running sum
    /// gives 1), a denormal input read as zero, a denormal sum flushed.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn emulated_tiles_compute_what_the_sdm_defines() {
        use amx::Tiles;
        let bits = |x: f32| (bf16::from_f32(x).to_bits()) as u32;
        let pair = |even: f32, odd: f32| bits(even) | bits(odd) << 16;
        let mut a = [[0u32; 16]; 16];
        let mut b = [[0u32; 16]; 16];
        // Row 0 × column 0: pairs (2¹²·2¹², 1·1) and (−2¹²·2¹², 1·1).
        (a[0][0], b[0][0]) = (pair(4096.0, 1.0), pair(4096.0, 1.0));
        (a[0][1], b[1][0]) = (pair(-4096.0, 1.0), pair(4096.0, 1.0));
        // Row 1 × column 1: a denormal bf16 (1e-39) times 2¹⁰⁰ would be 1.3e-9; read as zero.
        (a[1][0], b[0][1]) = (pair(1e-39, 0.0), pair(2f32.powi(100), 0.0));
        // Row 2 × column 2: 2⁻⁷⁰·2⁻⁷⁰ = 2⁻¹⁴⁰, a denormal sum: flushed.
        (a[2][0], b[0][2]) = (pair(2f32.powi(-70), 0.0), pair(2f32.powi(-70), 0.0));
        let mut tiles = unsafe { amx::Emulated::start() };
        tiles.zero_c(0);
        // SAFETY: each array is 16 rows of 64 bytes.
        unsafe {
            tiles.load_a(a.as_ptr().cast(), 64);
            tiles.load_b(0, b.as_ptr().cast(), 64);
        }
        tiles.dot(0);
        let mut c = [[7f32; 16]; 16];
        unsafe { tiles.store_c(0, c.as_mut_ptr().cast(), 64) };
        assert_eq!(c[0][0], 2.0, "even and odd sums apart");
        assert_eq!(c[1][1], 0.0, "a denormal input reads as zero");
        assert_eq!(c[2][2].to_bits(), 0, "a denormal sum is flushed");
        assert_eq!(c[3][3], 0.0, "every element is written");
    }

    /// `auto` takes bf16 on AMX everywhere and on `vdpbf16ps` only on AMD; never on the
    /// fallback, which rounds and then multiplies in f32.
    #[test]
    fn bf16_is_chosen_where_it_is_faster() {
        for amd in [false, true] {
            assert!(bf16_faster_on(Bf16Path::Amx, amd));
            assert_eq!(bf16_faster_on(Bf16Path::Avx512Bf16, amd), amd);
            assert!(!bf16_faster_on(Bf16Path::Fallback, amd));
        }
        let vendor = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
        if vendor.contains("vendor_id") {
            assert_eq!(cpu_is_amd(), vendor.contains("AuthenticAMD"));
        }
    }

    /// `PT_BF16_KERNEL` caps the path, never raises it; an unknown value is ignored with a
    /// warning naming what was expected.
    #[test]
    fn pt_bf16_kernel_caps_the_path() {
        let (detected, _) = choose_path(None);
        assert_eq!(choose_path(Some("fallback")).0, Bf16Path::Fallback);
        assert_eq!(choose_path(Some("avx512")).0, detected.min(Bf16Path::Avx512Bf16));
        assert_eq!(choose_path(Some("amx")).0, detected);
        assert_eq!(choose_path(Some(" Fallback")).0, Bf16Path::Fallback, "in either case");
        let (path, note) = choose_path(Some("tiles"));
        assert_eq!(path, detected);
        assert!(
            note.is_some_and(|n| n.contains("PT_BF16_KERNEL=tiles") && n.contains("expected amx, avx512 or fallback"))
        );
    }

    /// On a CPU with `avx512_bf16` the f32 products take a kernel: AMX tiles where the CPU has
    /// them and the OS grants them (and the kernel agrees with the reference there), else
    /// `vdpbf16ps`; f64 operands always take the fallback (the kernels are f32 only).
    #[test]
    fn kernel_runs_where_the_cpu_has_it() {
        #[cfg(target_arch = "x86_64")]
        if std::arch::is_x86_feature_detected!("avx512bf16") && std::arch::is_x86_feature_detected!("avx512f") {
            let want =
                if amx::Hardware::detected() && amx::Hardware::enable() { Bf16Path::Amx } else { Bf16Path::Avx512Bf16 };
            if std::env::var_os("PT_BF16_KERNEL").is_none() {
                assert_eq!(bf16_path(), want);
            }
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
