//! Kernel tests: `kernels/optim.cu` against the cpu backend.

use crate::elementwise::{PRECISIONS, act_data, compare};
use crate::harness::{self, act, host, param, rand};
use pipetransformer::device::Device;
use pipetransformer::ops::optim::{AdamWStep, SgdStep};

/// Tensor sizes: one element, below a warp, past a block, past many blocks of the sums.
const SIZES: [usize; 4] = [1, 13, 4099, 300_001];

/// Two AdamW steps (the second one's bias corrections differ) with and without weight decay,
/// on moments that start non-zero, the first with clipping's gradient scale.
#[test]
fn adamw_matches_cpu() {
    for precision in PRECISIONS {
        for n in SIZES {
            let (p0, g, m0) = (rand(1, n, 1.0), rand(2, n, 0.1), rand(3, n, 0.01));
            let v0: Vec<f32> = rand(4, n, 1e-3).into_iter().map(f32::abs).collect();
            for weight_decay in [0.0, 0.01] {
                compare!(format!("adamw n={n} wd={weight_decay}"), precision, |dev| {
                    let (mut p, g, mut m, mut v) = (param(dev, &p0), param(dev, &g), param(dev, &m0), param(dev, &v0));
                    for (step, grad_scale) in [(1, 0.37), (2, 1.0)] {
                        let h =
                            AdamWStep { lr: 1e-3, beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay, step, grad_scale };
                        dev.adamw_update(&mut p, &g, &mut m, &mut v, &h).unwrap();
                    }
                    vec![("param", host(dev, &p)), ("m", host(dev, &m)), ("v", host(dev, &v))]
                });
            }
        }
    }
}

/// SGD: a first step (whose momentum buffer is never read: it holds NaN here) with clipping's
/// gradient scale, then a second, plain and Nesterov, with and without momentum.
#[test]
fn sgd_matches_cpu() {
    for precision in PRECISIONS {
        for n in SIZES {
            let (p0, g) = (rand(5, n, 1.0), rand(6, n, 0.1));
            for (momentum, nesterov) in [(0.0, false), (0.9, false), (0.9, true)] {
                compare!(format!("sgd n={n} momentum={momentum} nesterov={nesterov}"), precision, |dev| {
                    let (mut p, g, mut buf) = (param(dev, &p0), param(dev, &g), param(dev, &vec![f32::NAN; n]));
                    let h = SgdStep { lr: 0.1, momentum, weight_decay: 1e-4, nesterov, grad_scale: 1.0 };
                    dev.sgd_update(&mut p, &g, &mut buf, true, &SgdStep { grad_scale: 0.37, ..h }).unwrap();
                    dev.sgd_update(&mut p, &g, &mut buf, false, &h).unwrap();
                    vec![("param", host(dev, &p)), ("momentum_buf", host(dev, &buf))]
                });
            }
        }
    }
}

/// `[Σ x, Σ x², Σ a, Σ a²]` of an f32 buffer `x` and an activation buffer `a`.
fn sums<D: Device>(dev: &D, x: &[f32], a: &[f32]) -> [f64; 4] {
    let (x, a) = (param(dev, x), act(dev, a));
    [dev.sum(&x), dev.sum_squares(&x), dev.sum(&a), dev.sum_squares(&a)].map(|s| s.unwrap())
}

/// Σ x and Σ x² of f32 buffers and of activation buffers (bf16 in bf16 mode), including empty
/// ones: close to the cpu's f64 sums, and the same f64 bits in every thread order.
#[test]
fn sums_match_cpu() {
    for precision in PRECISIONS {
        for n in [0].into_iter().chain(SIZES) {
            let (x, a) = (rand(7, n, 1.0), act_data(precision, rand(8, n, 1.0)));
            let want = sums(&harness::cpu(), &x, &a);
            let runs: Vec<[f64; 4]> = harness::devices(precision).iter().map(|dev| sums(dev, &x, &a)).collect();
            for run in &runs {
                for (k, (got, want)) in run.iter().zip(want).enumerate() {
                    let err = if want == 0.0 { got.abs() } else { (got - want).abs() / want.abs() };
                    assert!(err <= harness::tol(precision), "sum {k} of n={n} ({precision:?}): {got} vs {want}");
                }
            }
            let bits = |s: &[f64; 4]| s.map(f64::to_bits);
            assert!(runs.windows(2).all(|w| bits(&w[0]) == bits(&w[1])), "sums of n={n} depend on the thread order");
        }
    }
}

/// Bad calls, and the cpu's error message for each.
fn bad_calls<D: Device>(dev: &D) -> Vec<String> {
    let (mut p, g, short) =
        (dev.upload(&[0.0; 4]).unwrap(), dev.upload(&[0.0; 4]).unwrap(), dev.upload(&[0.0; 3]).unwrap());
    let (mut m, mut v, mut short_m) =
        (dev.upload(&[0.0; 4]).unwrap(), dev.upload(&[0.0; 4]).unwrap(), dev.upload(&[0.0; 3]).unwrap());
    let h = AdamWStep { lr: 1e-3, beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.0, step: 1, grad_scale: 1.0 };
    let sgd = SgdStep { lr: 0.1, momentum: 0.9, weight_decay: 0.0, nesterov: false, grad_scale: 1.0 };
    let results = [
        dev.adamw_update(&mut p, &short, &mut m, &mut v, &h),
        dev.adamw_update(&mut p, &g, &mut short_m, &mut v, &h),
        dev.adamw_update(&mut p, &g, &mut m, &mut v, &AdamWStep { step: 0, ..h }),
        dev.sgd_update(&mut p, &g, &mut short_m, false, &sgd),
    ];
    results.into_iter().map(|r| r.expect_err("a bad call must fail").to_string()).collect()
}

/// Wrong lengths and a zero AdamW step fail with the cpu's errors.
#[test]
fn bad_calls_fail_as_on_cpu() {
    let want = bad_calls(&harness::cpu());
    for precision in PRECISIONS {
        for dev in harness::devices(precision) {
            assert_eq!(bad_calls(&dev), want, "{}", dev.name());
        }
    }
}
