//! Kernel tests: `kernels/elementwise.cu` against the cpu backend, and the comparison helpers the
//! tests of `norm`, `embedding`, `loss` and `optim` share with it ([`compare!`], [`check`]).

use crate::harness::{self, act, host, param, rand};
use pipetransformer::device::{Device, Precision};
use pipetransformer::ops::gelu::Activation;

/// Both storage precisions; every test runs in each.
pub const PRECISIONS: [Precision; 2] = [Precision::F32, Precision::Bf16];

/// Element counts: one element, below a warp, past a block, past several blocks.
const SIZES: [usize; 4] = [1, 13, 385, 4099];

/// The named outputs of one run of an op, read back as f32.
pub type Outputs = Vec<(&'static str, Vec<f32>)>;

/// `data` as the device stores an activation in `precision`: rounded to bf16 in bf16 mode, so
/// that the cpu reference computes from the very values the kernel reads.
pub fn act_data(precision: Precision, data: Vec<f32>) -> Vec<f32> {
    match precision {
        Precision::F32 => data,
        Precision::Bf16 => data.into_iter().map(|x| half::bf16::from_f32(x).to_f32()).collect(),
    }
}

/// Checks every device run's outputs against the cpu's (`want`) within the precision's
/// tolerance, and the device runs against each other bit for bit: they run the kernels in
/// different thread orders, which must not change a single result.
pub fn check(what: &str, precision: Precision, want: &Outputs, runs: &[Outputs]) {
    let tol = harness::tol(precision);
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<u32>>();
    for run in runs {
        for ((name, got), (_, want)) in run.iter().zip(want) {
            harness::assert_close(&format!("{what} ({precision:?}): {name}"), got, want, tol);
        }
    }
    for run in runs.iter().skip(1) {
        for ((name, a), (_, b)) in run.iter().zip(&runs[0]) {
            assert!(bits(a) == bits(b), "{what} ({precision:?}): {name} depends on the thread order");
        }
    }
}

/// `compare!(what, precision, |dev| body)`: evaluates `body` (an [`Outputs`]) with `dev` bound to
/// the cpu reference and then to each device under test in `precision`, and [`check`]s them.
/// A macro because `body` is generic over the device type.
macro_rules! compare {
    ($what:expr, $precision:expr, |$dev:ident| $body:expr) => {{
        let want: $crate::elementwise::Outputs = {
            let $dev = &$crate::harness::cpu();
            $body
        };
        let runs: Vec<$crate::elementwise::Outputs> =
            $crate::harness::devices($precision).iter().map(|$dev| $body).collect();
        $crate::elementwise::check(&$what, $precision, &want, &runs);
    }};
}
pub(crate) use compare;

/// `fill` writes every element; `copy` between f32 and the activation type converts (the cast
/// kernels); `scale` multiplies buffers of either type.
#[test]
fn fill_copy_and_scale_match_cpu() {
    for precision in PRECISIONS {
        for n in SIZES {
            let data = act_data(precision, rand(1, n, 3.0));
            compare!(format!("fill/copy/scale n={n}"), precision, |dev| {
                let mut filled = dev.alloc(n).unwrap();
                dev.fill(&mut filled, 0.375).unwrap();
                // Activation → f32 (bf16 → f32 in bf16 mode), then scaled on both sides.
                let mut a = act(dev, &data);
                let mut f = param(dev, &vec![0.0; n]);
                dev.copy(&mut f, &a).unwrap();
                dev.scale(&mut a, -0.75).unwrap();
                dev.scale(&mut f, 1.5).unwrap();
                vec![("fill", host(dev, &filled)), ("scaled act", host(dev, &a)), ("copied f32", host(dev, &f))]
            });
        }
    }
}

/// Both GELU forms, forward and backward, over the range where erf and the tanh floor matter.
#[test]
fn gelu_matches_cpu() {
    for precision in PRECISIONS {
        for n in SIZES {
            let (x, dout) = (act_data(precision, rand(2, n, 6.0)), act_data(precision, rand(3, n, 1.0)));
            for kind in [Activation::GeluErf, Activation::GeluTanh] {
                compare!(format!("gelu {kind:?} n={n}"), precision, |dev| {
                    let (inp, dout) = (act(dev, &x), act(dev, &dout));
                    let (mut out, mut dinp) = (dev.alloc(n).unwrap(), dev.alloc(n).unwrap());
                    dev.gelu_forward(&mut out, &inp, kind).unwrap();
                    dev.gelu_backward(&mut dinp, &inp, &dout, kind).unwrap();
                    vec![("out", host(dev, &out)), ("dinp", host(dev, &dinp))]
                });
            }
        }
    }
}

/// tanh forward, and its backward from the saved output.
#[test]
fn tanh_matches_cpu() {
    for precision in PRECISIONS {
        for n in SIZES {
            let (x, dout) = (act_data(precision, rand(4, n, 3.0)), act_data(precision, rand(5, n, 1.0)));
            compare!(format!("tanh n={n}"), precision, |dev| {
                let (inp, dout) = (act(dev, &x), act(dev, &dout));
                let (mut out, mut dinp) = (dev.alloc(n).unwrap(), dev.alloc(n).unwrap());
                dev.tanh_forward(&mut out, &inp).unwrap();
                dev.tanh_backward(&mut dinp, &out, &dout).unwrap();
                vec![("out", host(dev, &out)), ("dinp", host(dev, &dinp))]
            });
        }
    }
}

/// `out = a + b`; the backward adds onto a gradient that already holds the skip path's.
#[test]
fn residual_matches_cpu() {
    for precision in PRECISIONS {
        for n in SIZES {
            let (a, b) = (act_data(precision, rand(6, n, 1.0)), act_data(precision, rand(7, n, 1.0)));
            compare!(format!("residual n={n}"), precision, |dev| {
                let (a_buf, b_buf) = (act(dev, &a), act(dev, &b));
                let mut out = dev.alloc(n).unwrap();
                dev.residual_forward(&mut out, &a_buf, &b_buf).unwrap();
                let mut dacc = act(dev, &a);
                dev.residual_backward(&mut dacc, &b_buf).unwrap();
                vec![("out", host(dev, &out)), ("dacc", host(dev, &dacc))]
            });
        }
    }
}

/// The same mask as the cpu's for the same (seed, offset), including offsets past 2³², in the
/// forward and the backward; p = 0 is a copy.
#[test]
fn dropout_matches_cpu() {
    for precision in PRECISIONS {
        for n in SIZES {
            let (x, dout) = (act_data(precision, rand(8, n, 1.0)), act_data(precision, rand(9, n, 1.0)));
            for (p, seed, offset) in [(0.0, 1, 0), (0.1, 77, 5_000_000_000), (0.5, 2024, 3)] {
                compare!(format!("dropout p={p} n={n}"), precision, |dev| {
                    let (inp, dout) = (act(dev, &x), act(dev, &dout));
                    let (mut out, mut dinp) = (dev.alloc(n).unwrap(), dev.alloc(n).unwrap());
                    dev.dropout_forward(&mut out, &inp, p, seed, offset).unwrap();
                    dev.dropout_backward(&mut dinp, &dout, p, seed, offset).unwrap();
                    vec![("out", host(dev, &out)), ("dinp", host(dev, &dinp))]
                });
            }
        }
    }
}

/// Bad calls, and the cpu's error message for each.
fn bad_calls<D: Device>(dev: &D) -> Vec<String> {
    let (mut a4, b4, b5) = (dev.alloc(4).unwrap(), dev.alloc(4).unwrap(), dev.alloc(5).unwrap());
    let results = [
        dev.copy(&mut a4, &b5),
        dev.gelu_forward(&mut a4, &b5, Activation::GeluErf),
        dev.gelu_backward(&mut a4, &b5, &b4, Activation::GeluTanh),
        dev.gelu_backward(&mut a4, &b4, &b5, Activation::GeluTanh),
        dev.tanh_forward(&mut a4, &b5),
        dev.tanh_backward(&mut a4, &b4, &b5),
        dev.residual_forward(&mut a4, &b4, &b5),
        dev.residual_backward(&mut a4, &b5),
        dev.dropout_forward(&mut a4, &b4, 1.0, 0, 0),
        dev.dropout_backward(&mut a4, &b4, f32::NAN, 0, 0),
        dev.dropout_forward(&mut a4, &b5, 0.1, 0, 0),
        dev.dropout_backward(&mut a4, &b5, 0.1, 0, 0),
    ];
    results.into_iter().map(|r| r.expect_err("a bad call must fail").to_string()).collect()
}

/// Wrong lengths and drop probabilities fail with the cpu's errors; in bf16 mode an f32 buffer
/// where an activation belongs is refused, not misread.
#[test]
fn bad_calls_fail_as_on_cpu() {
    let want = bad_calls(&harness::cpu());
    for precision in PRECISIONS {
        for dev in harness::devices(precision) {
            assert_eq!(bad_calls(&dev), want, "{}", dev.name());
            if precision == Precision::Bf16 {
                let (mut out, weights) = (dev.alloc(4).unwrap(), param(&dev, &[1.0; 4]));
                assert!(dev.gelu_forward(&mut out, &weights, Activation::GeluErf).is_err(), "f32 input accepted");
            }
        }
    }
}
