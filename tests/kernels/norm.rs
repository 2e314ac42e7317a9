//! Kernel tests: `kernels/norm.cu` against the cpu backend.

use crate::elementwise::{PRECISIONS, act_data, compare};
use crate::harness::{self, act, host, param, rand};
use pipetransformer::device::Device;

/// `(rows, dim)`: a single element, dim 1, sizes below and past a warp and a block, and more
/// rows than the LayerNorm backward has blocks (several rows per block).
const SHAPES: [(usize, usize); 6] = [(1, 1), (7, 1), (13, 13), (5, 385), (1030, 33), (1, 1000)];

/// Forward (out, mean, rstd) and backward (dinp written; dweight and dbias, starting non-zero,
/// added into), on rows whose mean is far from zero.
#[test]
fn layernorm_matches_cpu() {
    for precision in PRECISIONS {
        for (s, &(rows, dim)) in SHAPES.iter().enumerate() {
            let seed = 10 * s as u64;
            let x: Vec<f32> = rand(seed, rows * dim, 2.0).into_iter().map(|v| v + 3.0).collect();
            let (x, dout) = (act_data(precision, x), act_data(precision, rand(seed + 1, rows * dim, 1.0)));
            let (w, b) = (rand(seed + 2, dim, 1.0), rand(seed + 3, dim, 1.0));
            let (dw0, db0) = (rand(seed + 4, dim, 1.0), rand(seed + 5, dim, 1.0));
            compare!(format!("layernorm {rows}x{dim}"), precision, |dev| {
                let (inp, dout, w, b) = (act(dev, &x), act(dev, &dout), param(dev, &w), param(dev, &b));
                let mut out = dev.alloc(rows * dim).unwrap();
                let (mut mean, mut rstd) = (dev.alloc_stats(rows).unwrap(), dev.alloc_stats(rows).unwrap());
                dev.layernorm_forward(&mut out, &mut mean, &mut rstd, &inp, &w, &b, rows, dim, 1e-5).unwrap();
                let mut dinp = dev.alloc(rows * dim).unwrap();
                let (mut dw, mut db) = (param(dev, &dw0), param(dev, &db0));
                dev.layernorm_backward(&mut dinp, &mut dw, &mut db, &dout, &inp, &w, &mean, &rstd, rows, dim).unwrap();
                vec![
                    ("out", host(dev, &out)),
                    ("mean", host(dev, &mean)),
                    ("rstd", host(dev, &rstd)),
                    ("dinp", host(dev, &dinp)),
                    ("dweight", host(dev, &dw)),
                    ("dbias", host(dev, &db)),
                ]
            });
        }
    }
}

/// Forward and backward; row 0 is entirely −∞ (fully masked), which gives zeros, not NaNs.
#[test]
fn softmax_matches_cpu() {
    for precision in PRECISIONS {
        for (s, &(rows, cols)) in SHAPES.iter().enumerate() {
            let seed = 100 + 10 * s as u64;
            let mut x = rand(seed, rows * cols, 8.0);
            if rows > 1 {
                x[..cols].fill(f32::NEG_INFINITY);
            }
            let (x, dout) = (act_data(precision, x), act_data(precision, rand(seed + 1, rows * cols, 1.0)));
            compare!(format!("softmax {rows}x{cols}"), precision, |dev| {
                let (inp, dout) = (act(dev, &x), act(dev, &dout));
                let (mut out, mut dinp) = (dev.alloc(rows * cols).unwrap(), dev.alloc(rows * cols).unwrap());
                dev.softmax_forward(&mut out, &inp, rows, cols).unwrap();
                dev.softmax_backward(&mut dinp, &out, &dout, rows, cols).unwrap();
                vec![("out", host(dev, &out)), ("dinp", host(dev, &dinp))]
            });
        }
    }
}

/// Bad calls, and the cpu's error message for each.
fn bad_calls<D: Device>(dev: &D) -> Vec<String> {
    let (rows, dim) = (3, 4);
    let (x, w) = (dev.alloc(rows * dim).unwrap(), dev.upload(&[1.0; 4]).unwrap());
    let (mut out, mut dinp) = (dev.alloc(rows * dim).unwrap(), dev.alloc(rows * dim).unwrap());
    let (mut mean, mut rstd) = (dev.alloc_stats(rows).unwrap(), dev.alloc_stats(rows - 1).unwrap());
    let (mut dw, mut db) = (dev.upload(&[0.0; 4]).unwrap(), dev.upload(&[0.0; 5]).unwrap());
    let results = [
        dev.layernorm_forward(&mut out, &mut mean, &mut rstd, &x, &w, &w, rows, dim, 1e-5),
        dev.layernorm_forward(&mut out, &mut mean, &mut rstd, &x, &w, &w, rows, dim + 1, 1e-5),
        dev.layernorm_backward(&mut dinp, &mut dw, &mut db, &x, &x, &w, &mean, &mean, rows, dim),
        dev.softmax_forward(&mut out, &x, rows, dim + 1),
        dev.softmax_backward(&mut dinp, &out, &x, rows + 1, dim),
    ];
    results.into_iter().map(|r| r.expect_err("a bad call must fail").to_string()).collect()
}

/// Wrong lengths fail with the cpu's errors.
#[test]
fn bad_calls_fail_as_on_cpu() {
    let want = bad_calls(&harness::cpu());
    for precision in PRECISIONS {
        for dev in harness::devices(precision) {
            assert_eq!(bad_calls(&dev), want, "{}", dev.name());
        }
    }
}
