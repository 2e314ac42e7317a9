//! Test helpers shared by unit tests, integration tests and benches: relative errors and the
//! central finite-difference gradient check every backward is proven with.

pub use crate::rng::Rng;
use crate::scalar::Float;

/// `‖a − b‖₂ / max(‖a‖₂, ‖b‖₂)`, 0 when both are zero. The per-tensor error every tolerance in
/// this crate is written against.
pub fn rel_err<T: Float>(a: &[T], b: &[f64]) -> f64 {
    assert_eq!(a.len(), b.len(), "rel_err: length mismatch");
    let (mut d, mut na, mut nb) = (0.0f64, 0.0f64, 0.0f64);
    for (x, &y) in a.iter().zip(b) {
        let x = x.to_f64();
        d += (x - y) * (x - y);
        na += x * x;
        nb += y * y;
    }
    let n = na.max(nb).sqrt();
    if n == 0.0 { 0.0 } else { d.sqrt() / n }
}

/// `Σ aᵢ·bᵢ` in f64: the scalar "loss" `L = Σ out ⊙ R` whose gradient w.r.t. `out` is `R`.
pub fn dot<T: Float>(a: &[T], b: &[f64]) -> f64 {
    a.iter().zip(b).map(|(x, y)| x.to_f64() * y).sum()
}

/// Central finite differences of the scalar function `f` at `x`, one coordinate at a time:
/// `(f(x + h·eᵢ) − f(x − h·eᵢ)) / 2h`. `x` is restored before returning.
pub fn numeric_gradient(x: &mut [f64], h: f64, mut f: impl FnMut(&[f64]) -> f64) -> Vec<f64> {
    (0..x.len())
        .map(|i| {
            let x0 = x[i];
            x[i] = x0 + h;
            let up = f(x);
            x[i] = x0 - h;
            let down = f(x);
            x[i] = x0;
            (up - down) / (2.0 * h)
        })
        .collect()
}

/// Finite-difference step used by the f64 gradient checks: the truncation error is O(h²·f''')
/// ≈ 1e-10 and the rounding error O(ε/h) ≈ 1e-11, both far under the 1e-6 tolerance.
pub const FD_STEP: f64 = 1e-5;

/// Tolerance on [`rel_err`] between analytic and finite-difference gradients in f64.
pub const GRAD_TOL: f64 = 1e-6;

/// Below this norm a gradient counts as exactly zero: some are zero by symmetry (the key
/// bias, since softmax ignores a constant added to a row), and then both sides hold only
/// rounding noise (~1e-17 analytic, ~1e-12 finite differences) whose ratio means nothing.
pub const ZERO_GRAD_NORM: f64 = 1e-9;

/// Asserts `rel_err(analytic, numeric) ≤ GRAD_TOL`, naming the tensor on failure; when both
/// gradients are below [`ZERO_GRAD_NORM`] they must agree to that absolute norm instead.
#[track_caller]
pub fn assert_grad(name: &str, analytic: &[f64], numeric: &[f64]) {
    let norm = |v: &[f64]| v.iter().map(|x| x * x).sum::<f64>().sqrt();
    if norm(analytic).max(norm(numeric)) < ZERO_GRAD_NORM {
        let diff: Vec<f64> = analytic.iter().zip(numeric).map(|(a, b)| a - b).collect();
        assert!(norm(&diff) < ZERO_GRAD_NORM, "{name}: zero gradient mismatch");
        return;
    }
    let e = rel_err(analytic, numeric);
    assert!(
        e <= GRAD_TOL,
        "{name}: analytic vs finite-difference gradient rel err {e:.3e} > {GRAD_TOL:.0e}\n analytic {:?}\n numeric  {:?}",
        &analytic[..analytic.len().min(8)],
        &numeric[..numeric.len().min(8)]
    );
}

/// A test's own temp folder, removed when the test passes (see [`crate::files::Scratch`]).
pub use crate::files::Scratch;
