//! The `vdpbf16ps` path, and the packing the AMX path shares. Every function with
//! `#[target_feature]` is `unsafe` to call only because of the CPU features; callers hold
//! [`bf16_path`](super::bf16_path)`() != Fallback` (avx512f and avx512bf16). Memory accesses are bounded by asserts on the packed blocks' lengths and by
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
pub(super) const KC: usize = 256;
/// Pairs of k per block.
pub(super) const KC2: usize = KC / 2;
/// Rows of C per rayon task at most (its A panels, `MC × KC/2` pairs = 128 KiB, in L2).
const MC_MAX: usize = 256;
/// Columns of C per inner block (the B panels of one k block, `KC/2 × NC` pairs = 192 KiB, in L2).
const NC: usize = 8 * NR;

/// One operand as the packers see it: `x` indexes the panel dimension (A's rows, B's
/// columns), `k` the reduction; element `(x, k)` is `data[x·x_stride + k·k_stride]`.
#[derive(Clone, Copy)]
pub(super) struct Operand<'a> {
    pub data: &'a [f32],
    pub x_stride: usize,
    pub k_stride: usize,
    pub x_len: usize,
    pub k_len: usize,
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
    pub(super) static SCRATCH_A: Cell<Vec<u32>> = const { Cell::new(Vec::new()) };
    static SCRATCH_B: Cell<Vec<u32>> = const { Cell::new(Vec::new()) };
}

/// Runs `f` on a 64-byte-aligned slice of `len` words of `scratch` (a zmm load that straddles
/// two cache lines costs two), then puts the buffer back.
pub(super) fn with_scratch<R>(
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
    each_chunk(out, nkb * b_block, parallel, pack);
}

/// A kernel over a packed B: [`gemm_packed`] or [`super::amx::gemm_packed`].
pub type PackedKernel = fn(&mut [f32], usize, MatRef<f32>, &[u32], usize, usize, usize, bool, bool);

/// See [`matmul_bf16`](super::matmul_bf16): packs B into this thread's scratch and runs
/// `kernel`; the views were checked by the caller.
#[allow(clippy::too_many_arguments)]
pub fn gemm(
    kernel: PackedKernel,
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
        return kernel(c, ldc, a, &[], m, n, k, accumulate, parallel);
    }
    with_scratch(&SCRATCH_B, packed_b_len(k, n), |packed_b| {
        // SAFETY: the caller checked this CPU has avx512f + avx512bf16.
        unsafe { pack_b(b, k, n, packed_b, parallel) };
        kernel(c, ldc, a, packed_b, m, n, k, accumulate, parallel)
    })
}

/// What both kernels' `gemm_packed` start from: C (`m × n`, row stride `ldc`) cut to its
/// extent, with a row stride that chunks it by rows (a single row's is never used to step), and
/// A as an [`Operand`], after checking that `packed_b` is B packed for `k × n`; `None` where
/// nothing is left to multiply: an empty C, or k = 0 (C zeroed unless accumulating).
#[allow(clippy::too_many_arguments)]
pub(super) fn start_packed<'a, 'c>(
    c: &'c mut [f32],
    ldc: usize,
    a: MatRef<'a, f32>,
    packed_b: &[u32],
    m: usize,
    n: usize,
    k: usize,
    accumulate: bool,
) -> Option<(&'c mut [f32], usize, Operand<'a>)> {
    if m == 0 || n == 0 {
        return None;
    }
    let ldc = if m == 1 { n } else { ldc };
    let c = &mut c[..(m - 1) * ldc + n];
    if k == 0 {
        if !accumulate {
            (0..m).for_each(|r| c[r * ldc..r * ldc + n].fill(0.0));
        }
        return None;
    }
    assert_eq!(packed_b.len(), packed_b_len(k, n), "matmul_bf16: packed B of another shape");
    Some((c, ldc, Operand { data: a.data, x_stride: a.row_stride, k_stride: a.col_stride, x_len: m, k_len: k }))
}

/// [`gemm`] with B already packed by [`pack_b`] (`packed_b`: its [`packed_b_len`]`(k, n)` words).
/// Safe to call only as `gemm` is: the caller holds [`bf16_path`](super::bf16_path)`() !=
/// Fallback` and checked A's and C's views (the module's contract, above).
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
    let Some((c, ldc, a_op)) = start_packed(c, ldc, a, packed_b, m, n, k, accumulate) else { return };
    let layout = if a.col_stride != 1 && a.row_stride == 1 && m > 1 { ALayout::PairRows } else { ALayout::RowPairs };

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
        each_chunk(packed_a, nkb * a_block, parallel, pack_a);

        // Phase 2: multiply, a block of rows of C per task.
        let mc = rows_per_task(m, MR, MC_MAX, parallel);
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
                                    ALayout::RowPairs => micro_kernel::<KC2, 1>(kc2, ab, bb, cp, ldc, r, cols, add_c),
                                    ALayout::PairRows => micro_kernel::<1, MR>(kc2, ab, bb, cp, ldc, r, cols, add_c),
                                }
                            }
                        }
                    }
                }
            }
        };
        each_chunk(c, mc * ldc, parallel, task);
    })
}

/// `f((i, chunk))` for every `len`-long chunk of `data` (the last may be shorter), as tasks on
/// the current rayon pool when `parallel`.
pub(super) fn each_chunk<T: Send>(
    data: &mut [T],
    len: usize,
    parallel: bool,
    f: impl Fn((usize, &mut [T])) + Sync + Send,
) {
    if parallel {
        data.par_chunks_mut(len).enumerate().for_each(f);
    } else {
        data.chunks_mut(len).enumerate().for_each(f);
    }
}

/// Rows of C per task for `m` rows: enough tasks to balance the threads (4 each), a multiple of
/// the kernel's `block` rows, at most `most`.
pub(super) fn rows_per_task(m: usize, block: usize, most: usize, parallel: bool) -> usize {
    let threads = if parallel { rayon::current_num_threads() } else { 1 };
    m.div_ceil(4 * threads).next_multiple_of(block).clamp(block, most)
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
    let hi = if nk > 16 { unsafe { _mm512_maskz_loadu_ps(lanes(nk - 16), p.add(16)) } } else { _mm512_setzero_ps() };
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
pub(super) unsafe fn pack_pair_of_xs(op: &Operand, x0: usize, k: usize, k_end: usize, dst: &mut [u32]) {
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
pub(super) unsafe fn pack_pairs_of_x(op: &Operand, x: usize, k0: usize, kc: usize, dst: &mut [u32]) {
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

/// Packs columns `jp·NR..` of B over k block `kb` into `out` (`KC2·NR` pairs, `[p][j]`). Pairs
/// from the block's last up to the next multiple of 16 are zero: the AMX kernel reads 16 pairs
/// at a time ([`super::amx`]).
///
/// # Safety
/// avx512f.
#[target_feature(enable = "avx512f")]
unsafe fn pack_b_block(op: &Operand, jp: usize, kb: usize, out: &mut [u32]) {
    assert_eq!(out.len(), KC2 * NR);
    let (x0, k0) = (jp * NR, kb * KC);
    let kc = KC.min(op.k_len - k0);
    let kc2 = kc.div_ceil(2);
    out[kc2 * NR..kc2.next_multiple_of(16) * NR].fill(0);
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
pub(super) fn transpose16(r: [__m512i; 16]) -> [__m512i; 16] {
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
