//! Kernel tests: `kernels/matmul.cu` against the cpu backend.

use crate::harness::{act, assert_close, cpu, devices, host, param, tol};
use pipetransformer::Error;
use pipetransformer::device::{Device, Precision};

/// `(rows, in_dim, out_dim)`: an empty product (out = bias; dinp = 0) and an empty output, single
/// elements, sizes below one tile, one past a tile edge, and K spanning several 32- or 64-deep
/// stages with a ragged last one. The last three have the line strides that take the bf16
/// kernel's 16-byte loads (multiples of 8 elements, or of 4 for the f32 weight and the output)
/// over several tiles and stages, with ragged tile edges in every dimension. The two with many
/// rows and a small weight have their weight gradient split over rows (2 and 3 slices, the last
/// one short).
const SHAPES: [(usize, usize, usize); 12] = [
    (4, 0, 3),
    (4, 3, 0),
    (1, 1, 1),
    (13, 17, 33),
    (70, 385, 13),
    (65, 33, 70),
    (3, 129, 1),
    (136, 200, 72),
    (100, 132, 84),
    (203, 96, 40),
    (600, 24, 40),
    (1000, 72, 20),
];

const PRECISIONS: [Precision; 2] = [Precision::F32, Precision::Bf16];

/// [`crate::harness::rand`] rounded to bf16-representable values: in bf16 mode the kernels then
/// see exactly the reference's inputs, and the comparison measures their arithmetic and output
/// rounding rather than the quantisation of the inputs (which one cancelling sum can blow up).
fn rand(seed: u64, n: usize, scale: f32) -> Vec<f32> {
    crate::harness::rand(seed, n, scale).into_iter().map(|x| half::bf16::from_f32(x).to_f32()).collect()
}

fn bits(x: &[f32]) -> Vec<u32> {
    x.iter().map(|x| x.to_bits()).collect()
}

/// `out = inp·weightᵀ (+ bias)` on the cpu and on each device, with and without a bias.
#[test]
fn linear_forward_matches_cpu() {
    let cpu = cpu();
    for precision in PRECISIONS {
        for (s, &(rows, in_dim, out_dim)) in SHAPES.iter().enumerate() {
            let seed = 100 + 10 * s as u64;
            let (inp, weight, bias) =
                (rand(seed, rows * in_dim, 1.0), rand(seed + 1, out_dim * in_dim, 1.0), rand(seed + 2, out_dim, 1.0));
            for with_bias in [true, false] {
                let what = format!("{precision:?} {rows}x{in_dim}x{out_dim} bias {with_bias}");
                let want = {
                    let b = param(&cpu, &bias);
                    let mut out = cpu.alloc(rows * out_dim).unwrap();
                    let (i, w) = (act(&cpu, &inp), param(&cpu, &weight));
                    cpu.linear_forward(&mut out, &i, &w, with_bias.then_some(&b), rows, in_dim, out_dim).unwrap();
                    host(&cpu, &out)
                };
                for dev in devices(precision) {
                    let b = param(&dev, &bias);
                    let mut out = dev.alloc(rows * out_dim).unwrap();
                    let (i, w) = (act(&dev, &inp), param(&dev, &weight));
                    dev.linear_forward(&mut out, &i, &w, with_bias.then_some(&b), rows, in_dim, out_dim).unwrap();
                    assert_close(&format!("{what}: out on {}", dev.name()), &host(&dev, &out), &want, tol(precision));
                }
            }
        }
    }
}

/// dinp is written, dweight and dbias (starting non-zero) are added into; every output alone
/// or all together; the parameter gradients are bitwise identical across thread orders.
#[test]
fn linear_backward_matches_cpu() {
    let cpu = cpu();
    for precision in PRECISIONS {
        for (s, &(rows, in_dim, out_dim)) in SHAPES.iter().enumerate() {
            let seed = 200 + 10 * s as u64;
            let (dout, inp, weight) = (
                rand(seed, rows * out_dim, 1.0),
                rand(seed + 1, rows * in_dim, 1.0),
                rand(seed + 2, out_dim * in_dim, 1.0),
            );
            let (dweight0, dbias0) = (rand(seed + 3, out_dim * in_dim, 1.0), rand(seed + 4, out_dim, 1.0));
            let what = format!("{precision:?} {rows}x{in_dim}x{out_dim}");

            // The three gradients of one call, on `dev`, as selected by `which` (dinp, dweight, dbias).
            fn run<D: Device>(
                dev: &D,
                which: [bool; 3],
                t: [&[f32]; 5],
                (rows, in_dim, out_dim): (usize, usize, usize),
            ) -> [Option<Vec<f32>>; 3] {
                let [dout, inp, weight, dweight0, dbias0] = t;
                let (dout, inp, weight) = (act(dev, dout), act(dev, inp), param(dev, weight));
                let mut dinp = which[0].then(|| dev.alloc(rows * in_dim).unwrap());
                let mut dweight = which[1].then(|| param(dev, dweight0));
                let mut dbias = which[2].then(|| param(dev, dbias0));
                dev.linear_backward(
                    dinp.as_mut(),
                    dweight.as_mut(),
                    dbias.as_mut(),
                    &dout,
                    &inp,
                    &weight,
                    rows,
                    in_dim,
                    out_dim,
                )
                .unwrap();
                [dinp, dweight, dbias].map(|b| b.map(|b| host(dev, &b)))
            }
            let tensors = [&dout[..], &inp, &weight, &dweight0, &dbias0];
            let shape = (rows, in_dim, out_dim);
            let want = run(&cpu, [true; 3], tensors, shape);
            let names = ["dinp", "dweight", "dbias"];
            for which in [[true; 3], [true, false, false], [false, true, false], [false, false, true]] {
                let got: Vec<_> = devices(precision).iter().map(|dev| run(dev, which, tensors, shape)).collect();
                for (g, name) in names.iter().enumerate() {
                    for got in &got {
                        match (&got[g], &want[g]) {
                            (Some(got), Some(want)) => {
                                assert_close(&format!("{what}: {name}"), got, want, tol(precision))
                            }
                            (None, _) => assert!(!which[g]),
                            (Some(_), None) => unreachable!(),
                        }
                    }
                    for pair in got.windows(2) {
                        let (a, b) = (pair[0][g].as_deref().map(bits), pair[1][g].as_deref().map(bits));
                        assert_eq!(a, b, "{what}: {name} differs between thread orders");
                    }
                }
            }
        }
    }
}

/// Wrong lengths are shape errors naming the argument, and a buffer of the wrong element type
/// is a configuration error naming it, before anything is launched.
#[test]
fn linear_rejects_bad_buffers() {
    let (rows, in_dim, out_dim) = (3, 4, 5);
    for dev in devices(Precision::Bf16) {
        let (inp, w) = (act(&dev, &[0.5; 12]), param(&dev, &[0.5; 20]));
        let mut out = dev.alloc(rows * out_dim).unwrap();
        let short_bias = param(&dev, &[0.0; 4]);
        let e = dev.linear_forward(&mut out, &inp, &w, Some(&short_bias), rows, in_dim, out_dim).unwrap_err();
        assert!(matches!(e, Error::Shape { arg: "bias", .. }), "{e}");
        let f32_inp = param(&dev, &[0.5; 12]);
        let e = dev.linear_forward(&mut out, &f32_inp, &w, None, rows, in_dim, out_dim).unwrap_err();
        assert!(matches!(&e, Error::Config { field, .. } if field == "linear_forward.inp"), "{e}");
        let mut dw = param(&dev, &[0.0; 19]);
        let e = dev.linear_backward(None, Some(&mut dw), None, &out, &inp, &w, rows, in_dim, out_dim).unwrap_err();
        assert!(matches!(e, Error::Shape { arg: "dweight", .. }), "{e}");
        let mut dw_act = dev.alloc(20).unwrap();
        let e = dev.linear_backward(None, Some(&mut dw_act), None, &out, &inp, &w, rows, in_dim, out_dim).unwrap_err();
        assert!(matches!(&e, Error::Config { field, .. } if field == "linear_backward.dweight"), "{e}");
    }
}
