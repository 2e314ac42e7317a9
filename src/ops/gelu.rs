//! GELU, in its exact erf form (BERT's `gelu`) and its tanh approximation (GPT-2's `gelu_new`).

use crate::error::{Error, Result, check_len, config_error};
use crate::ops::simd::{exp, vectorized};
use crate::scalar::{DType, Float};
use rayon::prelude::*;

/// Which GELU formula a model uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum Activation {
    /// `x·Φ(x) = x/2·(1 + erf(x/√2))`.
    #[serde(rename = "gelu")]
    GeluErf,
    /// `x/2·(1 + tanh(√(2/π)·(x + 0.044715·x³)))`.
    #[serde(rename = "gelu_tanh")]
    GeluTanh,
}

impl Activation {
    /// Parses a Hugging Face `hidden_act` name: `gelu` → erf form; `gelu_new`,
    /// `gelu_pytorch_tanh`, `gelu_tanh` → tanh form. Anything else is an `Error::Config` naming
    /// `field` and listing the accepted names.
    pub fn parse(name: &str, field: &str) -> Result<Self, Error> {
        match name {
            "gelu" => Ok(Self::GeluErf),
            "gelu_new" | "gelu_pytorch_tanh" | "gelu_tanh" => Ok(Self::GeluTanh),
            other => Err(config_error(
                field,
                format!("unknown activation `{other}`; expected one of gelu, gelu_new, gelu_pytorch_tanh, gelu_tanh"),
            )),
        }
    }
}

/// Elements per rayon task: large enough to amortise the task overhead, small enough that a
/// MiniLM-sized activation (~6M elements) splits into many more tasks than threads.
const CHUNK: usize = 4096;

/// `1/√2`, the scale inside the erf form.
const FRAC_1_SQRT_2: f64 = std::f64::consts::FRAC_1_SQRT_2;
/// `1/√(2π)`, the normal density's normaliser (φ(0)).
const FRAC_1_SQRT_2PI: f64 = 0.398_942_280_401_432_7;
/// `√(2/π)`, the scale inside the tanh approximation.
const SQRT_2_OVER_PI: f64 = 0.797_884_560_802_865_4;
/// The cubic coefficient of the tanh approximation.
const TANH_CUBIC: f64 = 0.044_715;

/// `erf(x)` from arithmetic alone: Eigen's rational minimax approximation `x·P(x²)/Q(x²)` on
/// `[−4, 4]` (erf is ±1 in f32 beyond), 6.5e-8 from erf in exact arithmetic and under 4e-7 (a
/// few ulp of 1) once evaluated in f32. Unlike a libm call it inlines, so the GELU loops
/// vectorise; the input is clamped by comparisons, not `max`, so a NaN still comes out as NaN.
#[inline(always)]
fn erf_rational<T: Float>(x: T) -> T {
    const P: [f64; 7] = [
        -1.609_603_332_624_15e-2,
        -2.954_599_808_540_25e-3,
        -7.349_906_303_268_55e-4,
        -5.692_506_394_623_46e-5,
        -2.101_024_020_825_08e-6,
        2.770_681_424_959_02e-8,
        -2.726_142_258_013_06e-10,
    ];
    const Q: [f64; 5] = [
        -1.426_473_905_141_89e-2,
        -7.373_329_167_204_68e-3,
        -1.682_826_974_382_03e-3,
        -2.133_740_552_789_05e-4,
        -1.456_607_184_649_96e-5,
    ];
    let four = T::from_f64(4.0);
    let x = if x > four {
        four
    } else if x < -four {
        -four
    } else {
        x
    };
    let x2 = x * x;
    let mut p = T::from_f64(P[6]);
    for &c in P[..6].iter().rev() {
        p = p * x2 + T::from_f64(c);
    }
    let mut q = T::from_f64(Q[4]);
    for &c in Q[..4].iter().rev() {
        q = q * x2 + T::from_f64(c);
    }
    x * p / q
}

/// The erf the kernels use: the vectorisable [`erf_rational`] in f32 (several times faster than
/// libm's `erff`, the forward's only transcendental), libm's `erf` in f64, where the gradient
/// checks need every digit. `T::DTYPE` is a constant, so the branch is resolved at compile time.
#[inline(always)]
fn erf<T: Float>(x: T) -> T {
    if T::DTYPE == DType::F32 { erf_rational(x) } else { x.erf() }
}

/// `x·Φ(x) = x/2·(1 + erf(x/√2))`.
#[inline(always)]
fn gelu_erf<T: Float>(x: T) -> T {
    let half = T::from_f64(0.5);
    half * x * (T::ONE + erf(x * T::from_f64(FRAC_1_SQRT_2)))
}

/// `d/dx x·Φ(x) = Φ(x) + x·φ(x)`, `φ(x) = e^{−x²/2}/√(2π)`.
#[inline(always)]
fn gelu_erf_grad<T: Float>(x: T) -> T {
    let half = T::from_f64(0.5);
    let cdf = half * (T::ONE + erf(x * T::from_f64(FRAC_1_SQRT_2)));
    let pdf = T::from_f64(FRAC_1_SQRT_2PI) * exp(-half * x * x);
    cdf + x * pdf
}

/// `e = exp(−2u)`, `u = √(2/π)·(x + 0.044715·x³)`, and `du/dx`, shared by the tanh form's
/// forward and backward. They use `(1 + tanh u)/2 = σ(2u) = 1/(1 + e)`: one `exp` is several
/// times cheaper than libm's `tanh`, and `1 − σ = e·σ` needs no cancelling subtraction.
/// `2u` is floored at −80 so `e` stays finite (`e·σ²` would be ∞·0 otherwise); there
/// `σ < 1e−34`, so the output is unchanged.
#[inline(always)]
fn tanh_form_parts<T: Float>(x: T) -> (T, T) {
    let x2 = x * x;
    let two_u = T::from_f64(2.0 * SQRT_2_OVER_PI) * (x + T::from_f64(TANH_CUBIC) * x2 * x);
    let e = exp(-two_u.max(T::from_f64(-80.0)));
    let du = T::from_f64(SQRT_2_OVER_PI) * (T::ONE + T::from_f64(3.0 * TANH_CUBIC) * x2);
    (e, du)
}

/// `x/2·(1 + tanh(u)) = x·σ(2u) = x/(1 + e^{−2u})`.
#[inline(always)]
fn gelu_tanh<T: Float>(x: T) -> T {
    let (e, _) = tanh_form_parts(x);
    x / (T::ONE + e)
}

/// The exact derivative of [`gelu_tanh`] (not of the erf form it approximates):
/// `σ + x·σ(1 − σ)·2u' = σ + 2x·u'·(e·σ)·σ`, `σ = σ(2u) = 1/(1 + e)`. `e·σ = 1 − σ` is formed
/// first: it is at most 1, where `2x·u'·e` alone overflows f32 from about `x = −31` (−∞, or NaN
/// times a zero gradient, where the answer is −0).
#[inline(always)]
fn gelu_tanh_grad<T: Float>(x: T) -> T {
    let (e, du) = tanh_form_parts(x);
    let s = T::ONE / (T::ONE + e);
    let es = e * s;
    s + T::from_f64(2.0) * x * du * es * s
}

/// `out[i] = f(inp[i])` in parallel chunks. `f` is a generic parameter, so each GELU form gets
/// its own branch-free inner loop, vectorised for the CPU ([`vectorized`]).
fn map<T: Float>(out: &mut [T], inp: &[T], f: impl Fn(T) -> T + Sync) {
    out.par_chunks_mut(CHUNK).zip(inp.par_chunks(CHUNK)).for_each(|(out, inp)| {
        vectorized(
            #[inline(always)]
            || {
                for (o, &x) in out.iter_mut().zip(inp) {
                    *o = f(x);
                }
            },
        )
    });
}

/// `dinp[i] = f'(inp[i])·dout[i]` in parallel chunks.
fn map_grad<T: Float>(dinp: &mut [T], inp: &[T], dout: &[T], grad: impl Fn(T) -> T + Sync) {
    dinp.par_chunks_mut(CHUNK).zip(inp.par_chunks(CHUNK)).zip(dout.par_chunks(CHUNK)).for_each(
        |((dinp, inp), dout)| {
            vectorized(
                #[inline(always)]
                || {
                    for ((d, &x), &g) in dinp.iter_mut().zip(inp).zip(dout) {
                        *d = grad(x) * g;
                    }
                },
            )
        },
    );
}

/// `out[i] = gelu(inp[i])`.
pub fn gelu_forward<T: Float>(out: &mut [T], inp: &[T], kind: Activation) -> Result<()> {
    check_len("gelu_forward", "out", out.len(), inp.len())?;
    match kind {
        Activation::GeluErf => map(out, inp, gelu_erf),
        Activation::GeluTanh => map(out, inp, gelu_tanh),
    }
    Ok(())
}

/// Writes `dinp[i] = gelu'(inp[i])·dout[i]`.
pub fn gelu_backward<T: Float>(dinp: &mut [T], inp: &[T], dout: &[T], kind: Activation) -> Result<()> {
    check_len("gelu_backward", "inp", inp.len(), dinp.len())?;
    check_len("gelu_backward", "dout", dout.len(), dinp.len())?;
    match kind {
        Activation::GeluErf => map_grad(dinp, inp, dout, gelu_erf_grad),
        Activation::GeluTanh => map_grad(dinp, inp, dout, gelu_tanh_grad),
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{FD_STEP, Rng, assert_grad, dot, numeric_gradient, rel_err};

    const KINDS: [Activation; 2] = [Activation::GeluErf, Activation::GeluTanh];

    /// f64 forward, for the finite differences.
    fn forward(x: &[f64], kind: Activation) -> Vec<f64> {
        let mut out = vec![0.0; x.len()];
        gelu_forward(&mut out, x, kind).unwrap();
        out
    }

    #[test]
    fn backward_matches_finite_differences() {
        for kind in KINDS {
            let mut rng = Rng::new(11);
            let n = 3 * 13 * 7;
            let mut x = rng.vec(n, 4.0);
            let r = rng.vec(n, 1.0);
            let mut dinp = vec![0.0; n];
            gelu_backward(&mut dinp, &x, &r, kind).unwrap();
            let numeric = numeric_gradient(&mut x, FD_STEP, |x| dot(&forward(x, kind), &r));
            assert_grad(&format!("gelu {kind:?} dinp"), &dinp, &numeric);
        }
    }

    /// Far out on both sides the f32 gradient is finite: −0 and 1 within rounding (the tanh
    /// form's `2x·u'·e` alone overflowed to −∞ from about x = −31, NaN with a zero gradient).
    #[test]
    fn f32_gradients_stay_finite_far_out() {
        let x = [-1e4f32, -100.0, -40.0, -31.0, 31.0, 40.0, 1e4];
        for kind in KINDS {
            for g in [1.0f32, 0.0] {
                let mut dinp = vec![0.0f32; x.len()];
                gelu_backward(&mut dinp, &x, &[g; 7], kind).unwrap();
                for (&xi, &d) in x.iter().zip(&dinp) {
                    let want = if xi > 0.0 { g } else { 0.0 };
                    assert!((d - want).abs() <= 1e-6, "gelu {kind:?} at {xi}, gradient {g}: {d}");
                }
            }
        }
    }

    #[test]
    fn forward_matches_known_values() {
        // Reference values from the closed forms evaluated in high precision.
        let erf = forward(&[0.0, 1.0, -1.0, 3.0], Activation::GeluErf);
        let want_erf = [0.0, 0.841_344_746_068_542_9, -0.158_655_253_931_457_05, 2.995_950_305_905_11];
        for (got, want) in erf.iter().zip(want_erf) {
            assert!((got - want).abs() < 1e-14, "gelu erf: {got} vs {want}");
        }
        let tanh = forward(&[0.0, 1.0], Activation::GeluTanh);
        assert_eq!(tanh[0], 0.0);
        assert!((tanh[1] - 0.841_191_990_608_276_8).abs() < 1e-14, "gelu tanh(1) = {}", tanh[1]);
    }

    #[test]
    fn f32_matches_f64() {
        // Several chunks, so the parallel split is exercised too.
        let mut rng = Rng::new(5);
        let n = 3 * CHUNK + 17;
        let x32: Vec<f32> = rng.vec(n, 6.0).iter().map(|&v| v as f32).collect();
        let x64: Vec<f64> = x32.iter().map(|&v| v as f64).collect();
        let dout32: Vec<f32> = rng.vec(n, 1.0).iter().map(|&v| v as f32).collect();
        let dout64: Vec<f64> = dout32.iter().map(|&v| v as f64).collect();
        for kind in KINDS {
            let mut out32 = vec![0.0f32; n];
            gelu_forward(&mut out32, &x32, kind).unwrap();
            let e = rel_err(&out32, &forward(&x64, kind));
            assert!(e < 1e-5, "gelu {kind:?} f32 vs f64 forward rel err {e:.2e}");

            let mut d32 = vec![0.0f32; n];
            let mut d64 = vec![0.0f64; n];
            gelu_backward(&mut d32, &x32, &dout32, kind).unwrap();
            gelu_backward(&mut d64, &x64, &dout64, kind).unwrap();
            let e = rel_err(&d32, &d64);
            assert!(e < 1e-5, "gelu {kind:?} f32 vs f64 backward rel err {e:.2e}");
        }
    }

    #[test]
    fn rational_erf_is_accurate_in_f32() {
        // Sweep past the ±4 clamp; compare with libm's f64 erf.
        let mut worst = 0.0f64;
        for i in -60_000..=60_000 {
            let x = i as f32 * 1e-4;
            let err = (erf_rational(x) as f64 - libm::erf(x as f64)).abs();
            worst = worst.max(err);
        }
        assert!(worst < 4e-7, "f32 erf max abs error {worst:.2e}");
        assert!(erf::<f32>(f32::NAN).is_nan(), "NaN must propagate");
        assert_eq!(erf(0.5f64), libm::erf(0.5), "f64 uses libm");
    }

    #[test]
    fn tanh_form_approximates_erf_form() {
        let x: Vec<f64> = (-60..=60).map(|i| i as f64 * 0.1).collect();
        let (a, b) = (forward(&x, Activation::GeluErf), forward(&x, Activation::GeluTanh));
        for ((a, b), x) in a.iter().zip(&b).zip(&x) {
            assert!((a - b).abs() < 1e-3, "gelu at {x}: erf {a} vs tanh {b}");
        }
    }

    #[test]
    fn wrong_lengths_are_shape_errors() {
        let x = [0.0f64; 5];
        let mut short = [0.0f64; 4];
        let err = gelu_forward(&mut short, &x, Activation::GeluErf).unwrap_err();
        assert!(matches!(err, Error::Shape { arg: "out", got: 4, expected: 5, .. }), "{err}");
        assert!(err.to_string().contains("`out`"), "{err}");

        let mut dinp = [0.0f64; 5];
        let err = gelu_backward(&mut dinp, &x, &[0.0; 3], Activation::GeluTanh).unwrap_err();
        assert!(matches!(err, Error::Shape { arg: "dout", .. }), "{err}");
        assert!(err.to_string().contains("`dout`"), "{err}");
        let err = gelu_backward(&mut dinp, &[0.0; 6], &x, Activation::GeluTanh).unwrap_err();
        assert!(matches!(err, Error::Shape { arg: "inp", .. }), "{err}");
    }

    #[test]
    fn parse_accepts_hf_names_and_rejects_others() {
        assert_eq!(Activation::parse("gelu", "f").unwrap(), Activation::GeluErf);
        for name in ["gelu_new", "gelu_pytorch_tanh", "gelu_tanh"] {
            assert_eq!(Activation::parse(name, "f").unwrap(), Activation::GeluTanh);
        }
        let err = Activation::parse("relu", "bert.hidden_act").unwrap_err();
        assert!(matches!(&err, Error::Config { field, .. } if field == "bert.hidden_act"), "{err}");
        let msg = err.to_string();
        for needle in ["bert.hidden_act", "relu", "gelu", "gelu_new", "gelu_pytorch_tanh", "gelu_tanh"] {
            assert!(msg.contains(needle), "message `{msg}` lacks `{needle}`");
        }
    }
}
