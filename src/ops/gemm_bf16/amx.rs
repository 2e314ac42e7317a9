//! The AMX path: `tdpbf16ps` on tiles, for CPUs with AMX-TILE and AMX-BF16 (Intel Sapphire
//! Rapids and later). One `tdpbf16ps` multiplies a 16 × 32 bf16 tile of A by a 32 × 16 tile of B
//! into 16 × 16 f32 sums: 8192 multiply-adds, where a `vdpbf16ps` does 32.
//!
//! It shares the `vdpbf16ps` path's packing ([`super::avx512`]): B in panels of `NR` = 48
//! columns, pair-major, so a B tile (16 pairs × 16 columns) is 16 rows of 64 bytes `NR·4` bytes
//! apart; A in panels of [`MT`] = 16 rows, row-major pairs, so an A tile (16 rows × 16 pairs) is
//! 16 rows of 64 bytes `KC2·4` bytes apart. Both are zero-padded to whole tiles. The
//! micro-kernel keeps a 16 × 48 block of C in three tiles for all of k, then writes it once.
//!
//! **Written without AMX hardware.** The machines this was written on have none, so the kernel
//! runs in the tests on `Emulated` tiles, a model of the instructions as the Intel SDM
//! defines them (`tdpbf16ps`: even and odd products summed apart over the tile's 16 pairs,
//! then added to C; denormal inputs read as zero, denormal results flushed), against the same
//! reference and tolerance as the other paths. On [`Hardware`] tiles the instructions are
//! inline assembly, one line each. Before the first product on a CPU with AMX,
//! [`super::bf16_path`] runs the kernel on hardware tiles against the reference and uses the
//! `vdpbf16ps` path, with a warning, if it disagrees. (A fault that crashes instead, an
//! instruction the CPU refuses, ends the process there: `PT_BF16_KERNEL=avx512` steps around it.)

use super::MatRef;
use super::avx512::{
    KC, KC2, NR, Operand, SCRATCH_A, each_chunk, pack_pair_of_xs, pack_pairs_of_x, rows_per_task, transpose16,
    with_scratch,
};
use std::arch::x86_64::*;
use std::marker::PhantomData;
use std::sync::atomic::{AtomicBool, Ordering};

/// Rows of an A panel and of the micro-kernel's C block: a tile's 16 rows.
pub const MT: usize = 16;
/// Pairs of k per tile (16 × 4 bytes = a tile row of 64 bytes).
const PT: usize = 16;
/// C tiles across the micro-kernel's block: `NR` = 48 columns.
const CT: usize = NR / 16;
/// Rows of C per rayon task at most.
const MC_MAX: usize = 256;

const _: () = assert!(KC2.is_multiple_of(PT) && NR.is_multiple_of(16) && CT == 3);

/// The seven tiles the micro-kernel uses: C₀..C₂ (16 × 16 f32 sums), A (16 rows × 16 pairs of
/// bf16) and B₀..B₂ (16 pairs × 16 columns), every one 16 rows of 64 bytes. Loads and stores
/// take a row stride in bytes, as `tileloadd` does.
pub trait Tiles: Sized {
    /// Configures the tiles on this thread.
    ///
    /// # Safety
    /// On [`Hardware`]: the CPU has AMX-TILE and AMX-BF16, the OS has let this process use the
    /// tile data ([`Hardware::enable`]), and no other `Hardware` is alive on this thread (a
    /// drop releases the thread's tiles). Tile state lives in registers between the
    /// instructions, so nothing else on the thread may use AMX while one is alive.
    unsafe fn start() -> Self;
    /// C_j = 0.
    fn zero_c(&mut self, j: usize);
    /// C_j = the 16 × 16 f32 at `p`, rows `stride` bytes apart.
    ///
    /// # Safety
    /// `p` is valid for those reads.
    unsafe fn load_c(&mut self, j: usize, p: *const f32, stride: usize);
    /// A = the 16 rows of 16 pairs at `p`, rows `stride` bytes apart.
    ///
    /// # Safety
    /// As [`load_c`](Self::load_c).
    unsafe fn load_a(&mut self, p: *const u32, stride: usize);
    /// B_j = the 16 pairs of 16 columns at `p`, pairs `stride` bytes apart.
    ///
    /// # Safety
    /// As [`load_c`](Self::load_c).
    unsafe fn load_b(&mut self, j: usize, p: *const u32, stride: usize);
    /// C_j += A·B_j (`tdpbf16ps`).
    fn dot(&mut self, j: usize);
    /// Writes C_j to `p`, rows `stride` bytes apart.
    ///
    /// # Safety
    /// `p` is valid for those writes.
    unsafe fn store_c(&mut self, j: usize, p: *mut f32, stride: usize);
}

/// The CPU's tile registers: C_j in `tmm{j}`, A in `tmm3`, B_j in `tmm{4+j}`. Releases them
/// when dropped. Neither `Send` nor `Sync`: the tiles it configured are its thread's.
pub struct Hardware(PhantomData<*const ()>);

/// Whether [`Hardware::enable`] was granted.
static GRANTED: AtomicBool = AtomicBool::new(false);

/// `ldtilecfg`'s 64-byte operand, palette 1.
#[repr(C, align(64))]
struct TileConfig {
    palette: u8,
    start_row: u8,
    reserved0: [u8; 14],
    colsb: [u16; 8],
    reserved1: [u8; 16],
    rows: [u8; 8],
    reserved2: [u8; 8],
}

impl Hardware {
    /// Whether this CPU has AMX-TILE and AMX-BF16 (CPUID leaf 7: EDX bits 24 and 22).
    pub fn detected() -> bool {
        let edx = __cpuid_count(7, 0).edx;
        edx >> 24 & 1 == 1 && edx >> 22 & 1 == 1
    }

    /// Asks Linux for the tile data state (`arch_prctl(ARCH_REQ_XCOMP_PERM, XTILEDATA)`): a
    /// process that uses the tiles without it is killed. True where granted.
    pub fn enable() -> bool {
        #[cfg(target_os = "linux")]
        {
            const ARCH_REQ_XCOMP_PERM: libc::c_long = 0x1023;
            const XFEATURE_XTILEDATA: libc::c_long = 18;
            // SAFETY: a request with two integer arguments; it changes only whether this
            // process may use the tile state.
            let granted = unsafe { libc::syscall(libc::SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) } == 0;
            GRANTED.fetch_or(granted, Ordering::Relaxed);
            granted
        }
        #[cfg(not(target_os = "linux"))]
        false
    }
}

impl Tiles for Hardware {
    unsafe fn start() -> Self {
        assert!(GRANTED.load(Ordering::Relaxed), "AMX tiles used before the OS granted them");
        let config = TileConfig {
            palette: 1,
            start_row: 0,
            reserved0: [0; 14],
            colsb: [64; 8],
            reserved1: [0; 16],
            rows: [16; 8],
            reserved2: [0; 8],
        };
        // SAFETY: AMX is present and enabled (the caller); the operand is 64 valid bytes.
        unsafe { std::arch::asm!("ldtilecfg [{}]", in(reg) &config, options(nostack, readonly, preserves_flags)) };
        Hardware(PhantomData)
    }

    fn zero_c(&mut self, j: usize) {
        // SAFETY (all the tile instructions below): `self` exists only after `start`, so the
        // tiles are configured; the pointers' validity is the callers' contract.
        unsafe {
            match j {
                0 => std::arch::asm!("tilezero tmm0", options(nostack, nomem, preserves_flags)),
                1 => std::arch::asm!("tilezero tmm1", options(nostack, nomem, preserves_flags)),
                _ => std::arch::asm!("tilezero tmm2", options(nostack, nomem, preserves_flags)),
            }
        }
    }

    unsafe fn load_c(&mut self, j: usize, p: *const f32, stride: usize) {
        unsafe {
            match j {
                0 => {
                    std::arch::asm!("tileloadd tmm0, [{} + {}*1]", in(reg) p, in(reg) stride, options(nostack, readonly, preserves_flags))
                }
                1 => {
                    std::arch::asm!("tileloadd tmm1, [{} + {}*1]", in(reg) p, in(reg) stride, options(nostack, readonly, preserves_flags))
                }
                _ => {
                    std::arch::asm!("tileloadd tmm2, [{} + {}*1]", in(reg) p, in(reg) stride, options(nostack, readonly, preserves_flags))
                }
            }
        }
    }

    unsafe fn load_a(&mut self, p: *const u32, stride: usize) {
        unsafe {
            std::arch::asm!("tileloadd tmm3, [{} + {}*1]", in(reg) p, in(reg) stride, options(nostack, readonly, preserves_flags))
        }
    }

    unsafe fn load_b(&mut self, j: usize, p: *const u32, stride: usize) {
        unsafe {
            match j {
                0 => {
                    std::arch::asm!("tileloadd tmm4, [{} + {}*1]", in(reg) p, in(reg) stride, options(nostack, readonly, preserves_flags))
                }
                1 => {
                    std::arch::asm!("tileloadd tmm5, [{} + {}*1]", in(reg) p, in(reg) stride, options(nostack, readonly, preserves_flags))
                }
                _ => {
                    std::arch::asm!("tileloadd tmm6, [{} + {}*1]", in(reg) p, in(reg) stride, options(nostack, readonly, preserves_flags))
                }
            }
        }
    }

    fn dot(&mut self, j: usize) {
        unsafe {
            match j {
                0 => std::arch::asm!("tdpbf16ps tmm0, tmm3, tmm4", options(nostack, nomem, preserves_flags)),
                1 => std::arch::asm!("tdpbf16ps tmm1, tmm3, tmm5", options(nostack, nomem, preserves_flags)),
                _ => std::arch::asm!("tdpbf16ps tmm2, tmm3, tmm6", options(nostack, nomem, preserves_flags)),
            }
        }
    }

    unsafe fn store_c(&mut self, j: usize, p: *mut f32, stride: usize) {
        unsafe {
            match j {
                0 => {
                    std::arch::asm!("tilestored [{} + {}*1], tmm0", in(reg) p, in(reg) stride, options(nostack, preserves_flags))
                }
                1 => {
                    std::arch::asm!("tilestored [{} + {}*1], tmm1", in(reg) p, in(reg) stride, options(nostack, preserves_flags))
                }
                _ => {
                    std::arch::asm!("tilestored [{} + {}*1], tmm2", in(reg) p, in(reg) stride, options(nostack, preserves_flags))
                }
            }
        }
    }
}

impl Drop for Hardware {
    fn drop(&mut self) {
        // SAFETY: the tiles were configured by `start`; releasing returns them to the init state.
        unsafe { std::arch::asm!("tilerelease", options(nostack, nomem, preserves_flags)) };
    }
}

/// The tiles in memory, computing what the Intel SDM defines for each instruction. The kernel
/// runs on these in the tests, on every x86-64 CPU with AVX-512.
#[cfg(test)]
pub struct Emulated {
    c: [[[f32; 16]; 16]; CT],
    a: [[u32; PT]; 16],
    b: [[[u32; 16]; PT]; CT],
}

/// A bf16 (the high half of an f32) as f32, with a denormal read as zero (DAZ).
#[cfg(test)]
fn bf16_daz(bits: u32) -> f32 {
    daz(f32::from_bits(bits << 16))
}

/// `x` with a denormal read as zero, or flushed to zero (DAZ, FTZ: the same for one value).
#[cfg(test)]
fn daz(x: f32) -> f32 {
    if x.is_subnormal() { 0.0 } else { x }
}

/// 16 rows of `N` 32-bit values at `p`, rows `stride` bytes apart.
///
/// # Safety
/// `p` is valid for those reads.
#[cfg(test)]
unsafe fn read_rows<T: Copy, const N: usize>(p: *const T, stride: usize) -> [[T; N]; 16] {
    std::array::from_fn(|r| unsafe { p.byte_add(r * stride).cast::<[T; N]>().read_unaligned() })
}

#[cfg(test)]
impl Tiles for Emulated {
    unsafe fn start() -> Self {
        Emulated { c: [[[0.0; 16]; 16]; CT], a: [[0; PT]; 16], b: [[[0; 16]; PT]; CT] }
    }

    fn zero_c(&mut self, j: usize) {
        self.c[j] = [[0.0; 16]; 16];
    }

    unsafe fn load_c(&mut self, j: usize, p: *const f32, stride: usize) {
        self.c[j] = unsafe { read_rows(p, stride) };
    }

    unsafe fn load_a(&mut self, p: *const u32, stride: usize) {
        self.a = unsafe { read_rows(p, stride) };
    }

    unsafe fn load_b(&mut self, j: usize, p: *const u32, stride: usize) {
        self.b[j] = unsafe { read_rows(p, stride) };
    }

    fn dot(&mut self, j: usize) {
        for (c_row, a_row) in self.c[j].iter_mut().zip(&self.a) {
            for (col, c) in c_row.iter_mut().enumerate() {
                // Each step an FMA with denormals read as zero and flushed, as the SDM writes it.
                let (mut even, mut odd) = (0f32, 0f32);
                for (&a, b_row) in a_row.iter().zip(&self.b[j]) {
                    let b = b_row[col];
                    even = daz(bf16_daz(a & 0xffff).mul_add(bf16_daz(b & 0xffff), even));
                    odd = daz(bf16_daz(a >> 16).mul_add(bf16_daz(b >> 16), odd));
                }
                *c = daz(daz(*c) + daz(even + odd));
            }
        }
    }

    unsafe fn store_c(&mut self, j: usize, p: *mut f32, stride: usize) {
        for (r, row) in self.c[j].iter().enumerate() {
            unsafe { p.byte_add(r * stride).cast::<[f32; 16]>().write_unaligned(*row) };
        }
    }
}

/// Words of A (`m × k`) packed: `m/MT` panels of every k block, each `MT × KC2` pairs.
fn packed_a_len(m: usize, k: usize) -> usize {
    m.div_ceil(MT) * k.div_ceil(KC) * MT * KC2
}

/// Packs rows `ip·MT..` of A over k block `kb` into `out` (`MT × KC2` pairs, `[i][p]`), zero
/// past A's rows and from the block's last pair to the next whole tile.
///
/// # Safety
/// avx512f.
#[target_feature(enable = "avx512f")]
unsafe fn pack_a_block(op: &Operand, ip: usize, kb: usize, out: &mut [u32]) {
    assert_eq!(out.len(), MT * KC2);
    let (x0, k0) = (ip * MT, kb * KC);
    let kc = KC.min(op.k_len - k0);
    let padded = kc.div_ceil(2).next_multiple_of(PT);
    if op.x_stride == 1 && op.k_stride != 1 && op.x_len > 1 {
        // A's rows are contiguous (`dYᵀ` in a weight's gradient): pairs of 16 rows at a time,
        // transposed in registers to row-major.
        let mut pairs = [[0u32; 16]; PT];
        for p0 in (0..padded).step_by(PT) {
            for (q, dst) in pairs.iter_mut().enumerate() {
                let k = k0 + 2 * (p0 + q);
                if k < k0 + kc {
                    // SAFETY: avx512f (caller); the rows are contiguous.
                    unsafe { pack_pair_of_xs(op, x0, k, k0 + kc, dst) };
                } else {
                    *dst = [0; 16];
                }
            }
            let mut v = [_mm512_setzero_si512(); 16];
            for (v, row) in v.iter_mut().zip(&pairs) {
                // SAFETY: avx512f (caller); the load covers one 16-word row.
                *v = unsafe { _mm512_loadu_si512(row.as_ptr().cast()) };
            }
            for (i, t) in transpose16(v).iter().enumerate() {
                let at = i * KC2 + p0;
                assert!(at + 16 <= out.len());
                // SAFETY: writes out[at..at+16], asserted above.
                unsafe { _mm512_storeu_si512(out[at..].as_mut_ptr().cast(), *t) };
            }
        }
    } else {
        for (i, row) in out.chunks_mut(KC2).enumerate() {
            if x0 + i < op.x_len {
                // SAFETY: avx512f (caller); row x0+i exists, k0+kc ≤ k_len.
                unsafe { pack_pairs_of_x(op, x0 + i, k0, kc, row) };
                row[kc.div_ceil(2)..padded].fill(0);
            } else {
                row[..padded].fill(0);
            }
        }
    }
}

/// [`super::avx512::gemm_packed`] on tiles: the same contract, with B packed by
/// [`super::avx512::pack_b`] and `U` the tiles (for [`Hardware`], the caller holds
/// [`super::bf16_path`]`() == Amx`).
#[allow(clippy::too_many_arguments)]
pub fn gemm_packed<U: Tiles>(
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
    let Some((c, ldc, a_op)) = super::avx512::start_packed(c, ldc, a, packed_b, m, n, k, accumulate) else { return };
    let nkb = k.div_ceil(KC);
    let (a_block, b_block) = (MT * KC2, KC2 * NR);
    with_scratch(&SCRATCH_A, packed_a_len(m, k), |packed_a| {
        let pack_a = |(ip, panel): (usize, &mut [u32])| {
            for (kb, block) in panel.chunks_mut(a_block).enumerate() {
                // SAFETY: the caller's CPU has avx512f (AMX implies it here: `bf16_path`).
                unsafe { pack_a_block(&a_op, ip, kb, block) };
            }
        };
        each_chunk(packed_a, nkb * a_block, parallel, pack_a);

        let mc = rows_per_task(m, MT, MC_MAX, parallel);
        let packed_a = &*packed_a;
        let task = |(t, c_rows): (usize, &mut [f32])| {
            let row0 = t * mc;
            let rows = mc.min(m - row0);
            // SAFETY: the caller's contract for `U` (configured once per task: nothing inside
            // yields the thread to other rayon work).
            let mut tiles = unsafe { U::start() };
            let mut edge = [0f32; MT * NR];
            for j0 in (0..n).step_by(NR) {
                let cols = NR.min(n - j0);
                let panel_b = &packed_b[(j0 / NR) * nkb * b_block..][..nkb * b_block];
                for ir in (0..rows).step_by(MT) {
                    let r = MT.min(rows - ir);
                    let panel_a = &packed_a[((row0 + ir) / MT) * nkb * a_block..][..nkb * a_block];
                    let c_off = ir * ldc + j0;
                    assert!(c_off + (r - 1) * ldc + cols <= c_rows.len(), "matmul_bf16: C block exceeds its rows");
                    // A whole block goes to and from C directly; an edge through `edge`.
                    let whole = r == MT && cols == NR;
                    for j in 0..CT {
                        if whole && accumulate {
                            // SAFETY: 16 rows of 16 f32 from column j0+16j, inside C (asserted).
                            unsafe { tiles.load_c(j, c_rows[c_off + 16 * j..].as_ptr(), ldc * 4) };
                        } else {
                            tiles.zero_c(j);
                        }
                    }
                    for kb in 0..nkb {
                        let kc = KC.min(k - kb * KC);
                        let (ab, bb) = (&panel_a[kb * a_block..][..a_block], &panel_b[kb * b_block..][..b_block]);
                        for p0 in (0..kc.div_ceil(2)).step_by(PT) {
                            // SAFETY: the A tile is rows < MT, pairs p0..p0+16 ≤ KC2 of `ab`; B
                            // tile j pairs p0..p0+16, columns 16j..16j+16 < NR of `bb`: all inside
                            // the blocks, zero-padded by the packers.
                            unsafe { tiles.load_a(ab[p0..].as_ptr(), KC2 * 4) };
                            for j in 0..CT {
                                unsafe { tiles.load_b(j, bb[p0 * NR + 16 * j..].as_ptr(), NR * 4) };
                                tiles.dot(j);
                            }
                        }
                    }
                    if whole {
                        for j in 0..CT {
                            // SAFETY: as the loads above.
                            unsafe { tiles.store_c(j, c_rows[c_off + 16 * j..].as_mut_ptr(), ldc * 4) };
                        }
                        continue;
                    }
                    for j in 0..CT {
                        // SAFETY: `edge` holds MT rows of NR f32.
                        unsafe { tiles.store_c(j, edge[16 * j..].as_mut_ptr(), NR * 4) };
                    }
                    for (i, sums) in edge.chunks(NR).take(r).enumerate() {
                        let dst = &mut c_rows[c_off + i * ldc..][..cols];
                        if accumulate {
                            dst.iter_mut().zip(sums).for_each(|(d, s)| *d += s);
                        } else {
                            dst.copy_from_slice(&sums[..cols]);
                        }
                    }
                }
            }
        };
        each_chunk(c, mc * ldc, parallel, task);
    })
}
