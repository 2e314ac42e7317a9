//! The element-wise kernels' vector units: [`vectorized`] runs a loop compiled for the widest x86
//! vector extension this CPU has (AVX-512, else AVX2 + FMA, else the x86-64 baseline), chosen
//! once at run time; [`exp`] is an `exp` such a loop can vectorise.
//!
//! Why: the crate is built for the x86-64 baseline so that one binary runs on every CPU, and LLVM
//! vectorises a loop only for the features of the function it sits in, so without this every GELU,
//! dropout mask and AdamW update runs four lanes wide (or one, where it calls libm). `vectorized`
//! takes the loop as a closure and calls it from a copy compiled with the wider features; the
//! closure is inlined there and vectorised for them (the `pulp` crate's trick, which the `gemm`
//! crate uses for its packing).
//!
//! The level never changes a result: the loops it wraps are element-wise IEEE arithmetic, which
//! is exact per lane whatever the vector width; Rust never fuses `a·b + c` into an FMA on its own;
//! and LLVM does not reorder a floating-point reduction, so sums stay sequential. Every level
//! gives the same bits (`tests/vector_levels.rs` checks it). `PT_VECTOR=baseline|avx2|avx512`
//! caps the level, for comparing speeds.

use crate::scalar::{DType, Float};
use std::sync::atomic::{AtomicU8, Ordering};

/// A vector extension the element-wise loops can be compiled for, narrowest first.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum VectorLevel {
    /// The x86-64 baseline (SSE2), or any other architecture.
    Baseline = 1,
    /// AVX2 with FMA (Haswell, Zen 1 and later).
    Avx2 = 2,
    /// AVX-512 F, DQ, BW and VL (Skylake-SP, Ice Lake, Sapphire Rapids, Zen 4 and later).
    Avx512 = 3,
}

impl VectorLevel {
    /// The widest level this CPU supports.
    pub fn detect() -> VectorLevel {
        #[cfg(target_arch = "x86_64")]
        {
            use std::arch::is_x86_feature_detected as has;
            // The AVX-512 copy is compiled with AVX2 and FMA too (a VM may hide those while
            // exposing AVX-512): all must be there.
            let avx2 = has!("avx2") && has!("fma");
            if avx2 && has!("avx512f") && has!("avx512dq") && has!("avx512bw") && has!("avx512vl") {
                return VectorLevel::Avx512;
            }
            if avx2 {
                return VectorLevel::Avx2;
            }
        }
        VectorLevel::Baseline
    }

    /// Parses `baseline`, `avx2` or `avx512` (the `PT_VECTOR` values), in either case and
    /// around spaces (`AVX512` as a CPU's flags list it).
    pub fn parse(name: &str) -> Option<VectorLevel> {
        match name.trim().to_ascii_lowercase().as_str() {
            "baseline" => Some(VectorLevel::Baseline),
            "avx2" => Some(VectorLevel::Avx2),
            "avx512" => Some(VectorLevel::Avx512),
            _ => None,
        }
    }

    fn from_u8(v: u8) -> VectorLevel {
        match v {
            3 => VectorLevel::Avx512,
            2 => VectorLevel::Avx2,
            _ => VectorLevel::Baseline,
        }
    }
}

/// The level in use; 0 until first asked for.
static LEVEL: AtomicU8 = AtomicU8::new(0);

/// The level [`vectorized`] compiles for: the CPU's widest, capped by `PT_VECTOR` when set and
/// by [`cap_vector_level`].
pub fn vector_level() -> VectorLevel {
    match LEVEL.load(Ordering::Relaxed) {
        0 => {
            let (level, warning) = level_under(VectorLevel::detect(), std::env::var("PT_VECTOR").ok().as_deref());
            if let Some(warning) = warning {
                eprintln!("{warning}");
            }
            LEVEL.store(level as u8, Ordering::Relaxed);
            level
        }
        v => VectorLevel::from_u8(v),
    }
}

/// `detected` capped by a `PT_VECTOR` value. An unknown value changes nothing (the variable
/// only trades speed, never results) and comes back as a warning naming what was expected.
fn level_under(detected: VectorLevel, pt_vector: Option<&str>) -> (VectorLevel, Option<String>) {
    match pt_vector.map(|name| (name, VectorLevel::parse(name))) {
        None => (detected, None),
        Some((_, Some(cap))) => (detected.min(cap), None),
        Some((name, None)) => {
            (detected, Some(format!("warning: PT_VECTOR={name} ignored; expected baseline, avx2 or avx512")))
        }
    }
}

/// Caps the level for the rest of the process (at most what the CPU has) and returns the level
/// now in use. For tests and benchmarks that compare levels; results do not depend on it.
pub fn cap_vector_level(cap: VectorLevel) -> VectorLevel {
    let level = VectorLevel::detect().min(cap);
    LEVEL.store(level as u8, Ordering::Relaxed);
    level
}

/// Runs `f`, compiled for [`vector_level`]. Pass the closure as `#[inline(always)] || …`: `f`
/// is vectorised only once it is inlined into the copy with the features, and LLVM compiles a
/// closure of any size apart unless told (measured: attention's softmax and GELU's backward
/// then ran at the baseline's speed). `f` should be the inner loops over one slice chunk, not a
/// rayon dispatch: a closure run on another thread is compiled on its own, without the features.
#[inline(always)]
pub fn vectorized<R>(f: impl FnOnce() -> R) -> R {
    #[cfg(target_arch = "x86_64")]
    {
        #[target_feature(enable = "avx512f,avx512dq,avx512bw,avx512vl,avx2,fma")]
        fn avx512<R>(f: impl FnOnce() -> R) -> R {
            f()
        }
        #[target_feature(enable = "avx2,fma")]
        fn avx2<R>(f: impl FnOnce() -> R) -> R {
            f()
        }
        match vector_level() {
            // SAFETY: `vector_level` never exceeds what `VectorLevel::detect` found on this CPU.
            VectorLevel::Avx512 => return unsafe { avx512(f) },
            // SAFETY: as above.
            VectorLevel::Avx2 => return unsafe { avx2(f) },
            VectorLevel::Baseline => {}
        }
    }
    f()
}

/// `eˣ` for the vectorised loops: [`exp_f32`] in f32, libm's `exp` in f64 (where the gradient
/// checks need every digit). `T::DTYPE` is a constant, so the branch is resolved at compile time
/// and the f32 conversions fold away.
#[inline(always)]
pub fn exp<T: Float>(x: T) -> T {
    if T::DTYPE == DType::F32 { T::from_f64(f64::from(exp_f32(x.to_f64() as f32))) } else { x.exp() }
}

/// `eˣ` in f32 from arithmetic alone (Cephes' `expf`): `x = n·ln2 + r`, |r| ≤ ln2/2, `eʳ` by a
/// degree-6 polynomial, times `2ⁿ` built from the exponent bits (in two halves, so `n = 128` and
/// the subnormal results are reached). Within 2 ulp of the exact `eˣ` over the whole range
/// (tested against f64); `+∞` above 88.7228, 0 below −103.9721 (under half the smallest
/// subnormal), NaN for NaN. No libm call and no branch, so loops over it vectorise.
#[inline(always)]
pub fn exp_f32(x: f32) -> f32 {
    const HI: f32 = 88.722_84; // ln(f32::MAX)
    const LO: f32 = -103.972_08; // ln(2⁻¹⁵⁰)
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    // ln 2 split so that n·LN2_HI is exact for |n| < 2⁹.
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    // 1.5·2²³: adding it rounds to an integer in the low mantissa bits (round to nearest even).
    const ROUND: f32 = 12_582_912.0;
    // `clamp` keeps a NaN a NaN (and compiles to two selects).
    let xc = x.clamp(LO, HI);
    let t = xc * LOG2E + ROUND;
    let n = t - ROUND;
    let r = xc - n * LN2_HI - n * LN2_LO;
    let mut p = 1.987_569_1e-4_f32;
    p = p * r + 1.398_199_9e-3;
    p = p * r + 8.333_452e-3;
    p = p * r + 4.166_579_6e-2;
    p = p * r + 0.166_666_65;
    p = p * r + 0.5;
    let y = p * r * r + r + 1.0;
    // n ∈ [−150, 128]: 2ⁿ = 2^⌊n/2⌋ · 2^(n−⌊n/2⌋), both normal.
    let ni = (t.to_bits() as i32).wrapping_sub(ROUND.to_bits() as i32);
    let half = ni >> 1;
    let s1 = f32::from_bits(((half + 127) as u32) << 23);
    let s2 = f32::from_bits(((ni - half + 127) as u32) << 23);
    let e = y * s1 * s2;
    if x > HI {
        f32::INFINITY
    } else if x < LO {
        0.0
    } else {
        e
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Distance in units of the last place between `got` and the exact `want`, in f32's grid.
    fn ulps(got: f32, want: f64) -> f64 {
        let w = want as f32;
        if got == w {
            return 0.0;
        }
        let ulp = (f64::from(f32::from_bits(w.abs().to_bits() + 1)) - f64::from(w.abs())).abs();
        (f64::from(got) - want).abs() / ulp
    }

    #[test]
    fn exp_f32_is_within_two_ulp_over_its_whole_range() {
        let mut worst = (0.0f64, 0.0f32);
        // Every 1/4096 across the normal range, and the subnormal tail.
        let mut x = -103.0f32;
        while x < 88.72 {
            let u = ulps(exp_f32(x), f64::from(x).exp());
            if u > worst.0 {
                worst = (u, x);
            }
            x += 1.0 / 4096.0;
        }
        assert!(worst.0 <= 2.0, "exp_f32 is {} ulp off at x = {}", worst.0, worst.1);
    }

    #[test]
    fn exp_f32_edges() {
        assert_eq!(exp_f32(0.0), 1.0);
        assert_eq!(exp_f32(89.0), f32::INFINITY);
        assert_eq!(exp_f32(f32::INFINITY), f32::INFINITY);
        assert_eq!(exp_f32(-104.0), 0.0);
        assert_eq!(exp_f32(f32::NEG_INFINITY), 0.0);
        assert!(exp_f32(f32::NAN).is_nan());
        // The largest finite result and a subnormal one.
        assert!(exp_f32(88.72).is_finite() && exp_f32(88.72) > 3.3e38);
        let sub = exp_f32(-100.0);
        assert!(sub > 0.0 && sub < f32::MIN_POSITIVE);
        // Subnormals are spaced 2⁻¹⁴⁹ apart: within one of them.
        assert!((f64::from(sub) - (-100f64).exp()).abs() <= 2f64.powi(-149));
    }

    #[test]
    fn exp_is_libm_in_f64() {
        for x in [-3.5f64, 0.1, 2.0, 40.0] {
            assert_eq!(exp(x), x.exp());
        }
        assert_eq!(exp(1.5f32), exp_f32(1.5));
    }

    #[test]
    fn pt_vector_caps_the_level_and_a_bad_value_is_named() {
        use VectorLevel::*;
        assert_eq!(level_under(Avx512, None), (Avx512, None));
        assert_eq!(level_under(Avx512, Some("avx2")), (Avx2, None));
        assert_eq!(level_under(Avx2, Some("avx512")), (Avx2, None), "a cap never raises the level");
        assert_eq!(level_under(Avx2, Some("baseline")), (Baseline, None));
        assert_eq!(level_under(Avx512, Some(" AVX2")), (Avx2, None), "in either case");
        let (level, warning) = level_under(Avx512, Some("AVX-512"));
        assert_eq!(level, Avx512);
        let warning = warning.expect("a bad value warns");
        assert!(
            warning.contains("PT_VECTOR=AVX-512") && warning.contains("expected baseline, avx2 or avx512"),
            "{warning}"
        );
    }

    #[test]
    fn vectorized_runs_the_closure() {
        let mut v = vec![0.0f32; 1000];
        vectorized(
            #[inline(always)]
            || v.iter_mut().enumerate().for_each(|(i, x)| *x = exp_f32(i as f32 / 100.0)),
        );
        assert_eq!(v[0], 1.0);
        assert_eq!(v[999], exp_f32(9.99));
    }
}
