//! Kernel tests: `kernels/elementwise.cu` against the cpu backend, and the comparison helpers the
//! tests of `norm`, `embedding`, `loss` and `optim` share with it ([`compare!`], [`check`]).

use crate::harness::{self, act, host, param, rand};
use pipetransformer::device::{Device, Precision};
use pipetransformer::ops::dropout::DropoutCoords;
use pipetransformer::ops::gelu::Activation;
use pipetransformer::ops::rows::RowCopy;

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

/// Both GELU forms, forward and backward, over the range where erf and the tanh floor matter,
/// and far out (an input of ±40 overflowed the tanh form's gradient to −∞).
#[test]
fn gelu_matches_cpu() {
    for precision in PRECISIONS {
        for n in SIZES {
            let mut x = rand(2, n, 6.0);
            for (xi, far) in x.iter_mut().zip([-40.0, 40.0, -1e4, 100.0]) {
                *xi = far;
            }
            let (x, dout) = (act_data(precision, x), act_data(precision, rand(3, n, 1.0)));
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
            // Contiguous, and rows with a stride (a token slice of longer sequences).
            let strided = DropoutCoords { seed: 9, offset: 40, row: 7, stride: 1000 };
            for (p, at) in [
                (0.0, DropoutCoords::contiguous(1, 0)),
                (0.1, DropoutCoords::contiguous(77, 5_000_000_000)),
                (0.5, DropoutCoords::contiguous(2024, 3)),
                (0.3, strided),
            ] {
                compare!(format!("dropout p={p} n={n} {at:?}"), precision, |dev| {
                    let (inp, dout) = (act(dev, &x), act(dev, &dout));
                    let (mut out, mut dinp) = (dev.alloc(n).unwrap(), dev.alloc(n).unwrap());
                    dev.dropout_forward(&mut out, &inp, p, at).unwrap();
                    dev.dropout_backward(&mut dinp, &dout, p, at).unwrap();
                    vec![("out", host(dev, &out)), ("dinp", host(dev, &dinp))]
                });
            }
        }
    }
}

/// Strided runs written, added and gathered, as TeraPipe's key/value arena uses them, also
/// between activations and an f32 sum.
#[test]
fn copy_rows_matches_cpu() {
    for precision in PRECISIONS {
        // Three samples of a 37-position arena of width 5; a slice at positions 11..20.
        let (batch, seq, width, start, len) = (3usize, 37usize, 5usize, 11usize, 9usize);
        let arena = act_data(precision, rand(21, batch * seq * width, 1.0));
        let slice = act_data(precision, rand(22, batch * len * width, 1.0));
        compare!(format!("copy_rows {precision:?}"), precision, |dev| {
            let src = act(dev, &slice);
            let mut written = act(dev, &arena);
            let write = RowCopy {
                rows: batch,
                len: len * width,
                dst_offset: start * width,
                dst_stride: seq * width,
                src_offset: 0,
                src_stride: len * width,
                accumulate: false,
            };
            dev.copy_rows(&mut written, &src, write).unwrap();
            let mut added = act(dev, &arena);
            dev.copy_rows(&mut added, &src, RowCopy { accumulate: true, ..write }).unwrap();
            let mut context = dev.alloc(batch * (start + len) * width).unwrap();
            let gather = RowCopy {
                rows: batch,
                len: (start + len) * width,
                dst_offset: 0,
                dst_stride: (start + len) * width,
                src_offset: 0,
                src_stride: seq * width,
                accumulate: false,
            };
            dev.copy_rows(&mut context, &added, gather).unwrap();
            // The slice added twice into an f32 sum, and that sum gathered back as activations
            // (the arena's gradient: bf16 pieces summed in f32 in bf16 mode).
            let mut sum = param(dev, &vec![0.5; batch * seq * width]);
            dev.copy_rows(&mut sum, &src, RowCopy { accumulate: true, ..write }).unwrap();
            dev.copy_rows(&mut sum, &src, RowCopy { accumulate: true, ..write }).unwrap();
            let mut read = dev.alloc(batch * (start + len) * width).unwrap();
            dev.copy_rows(&mut read, &sum, gather).unwrap();
            vec![
                ("written", host(dev, &written)),
                ("added", host(dev, &added)),
                ("context", host(dev, &context)),
                ("f32 sum", host(dev, &sum)),
                ("sum read back", host(dev, &read)),
            ]
        });
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
        dev.dropout_forward(&mut a4, &b4, 1.0, DropoutCoords::contiguous(0, 0)),
        dev.dropout_backward(&mut a4, &b4, f32::NAN, DropoutCoords::contiguous(0, 0)),
        dev.dropout_forward(&mut a4, &b5, 0.1, DropoutCoords::contiguous(0, 0)),
        dev.dropout_backward(&mut a4, &b5, 0.1, DropoutCoords::contiguous(0, 0)),
        dev.copy_rows(
            &mut a4,
            &b5,
            RowCopy { rows: 2, len: 2, dst_offset: 1, dst_stride: 2, src_offset: 0, src_stride: 2, accumulate: false },
        ),
        dev.copy_rows(
            &mut a4,
            &b4,
            RowCopy { rows: 2, len: 3, dst_offset: 0, dst_stride: 1, src_offset: 0, src_stride: 3, accumulate: true },
        ),
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
