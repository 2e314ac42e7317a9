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

/// Hidden sizes whose LayerNorm backward needs more than the default 48 KiB of shared memory per
/// block (2·dim floats of accumulators plus 512 static bytes): 6144 just over it, 8192 well over;
/// the launch opts in.
#[test]
fn layernorm_backward_past_48_kib_of_shared_memory() {
    for precision in PRECISIONS {
        for dim in [6144, 8192] {
            let rows = 3;
            let x = act_data(precision, rand(dim as u64, rows * dim, 2.0));
            let dout = act_data(precision, rand(dim as u64 + 1, rows * dim, 1.0));
            let w = rand(dim as u64 + 2, dim, 1.0);
            compare!(format!("layernorm backward {rows}x{dim}"), precision, |dev| {
                let (inp, dout, w) = (act(dev, &x), act(dev, &dout), param(dev, &w));
                let mut out = dev.alloc(rows * dim).unwrap();
                let (mut mean, mut rstd) = (dev.alloc_stats(rows).unwrap(), dev.alloc_stats(rows).unwrap());
                dev.layernorm_forward(&mut out, &mut mean, &mut rstd, &inp, &w, &w, rows, dim, 1e-5).unwrap();
                let mut dinp = dev.alloc(rows * dim).unwrap();
                let (mut dw, mut db) = (param(dev, &vec![0.0; dim]), param(dev, &vec![0.0; dim]));
                dev.layernorm_backward(&mut dinp, &mut dw, &mut db, &dout, &inp, &w, &mean, &rstd, rows, dim).unwrap();
                vec![("dinp", host(dev, &dinp)), ("dweight", host(dev, &dw)), ("dbias", host(dev, &db))]
            });
        }
    }
}

/// A NaN anywhere in a row makes the whole row NaN, also where `max` skips every entry (a row
/// of NaNs, or NaNs beside −∞): a diverged input must not come out as the zeros of a fully
/// masked row. The all-−∞ row stays zeros.
#[test]
fn softmax_rows_with_a_nan_are_nan() {
    let (nan, inf) = (f32::NAN, f32::INFINITY);
    let rows: [[f32; 3]; 5] = [[nan; 3], [nan, -inf, -inf], [1.0, nan, 2.0], [-inf; 3], [1.0, 2.0, 3.0]];
    let x: Vec<f32> = rows.concat();
    for precision in PRECISIONS {
        let mut outs = vec![("cpu".to_string(), softmax(&harness::cpu(), &x))];
        for (i, dev) in harness::devices(precision).iter().enumerate() {
            outs.push((format!("{precision:?} device {i}"), softmax(dev, &x)));
        }
        for (who, out) in outs {
            for (r, row) in out.chunks(3).enumerate() {
                match r {
                    0..=2 => assert!(row.iter().all(|v| v.is_nan()), "{who}: row {r} {row:?}"),
                    3 => assert_eq!(row, [0.0; 3], "{who}: row {r}"),
                    _ => assert!((row.iter().sum::<f32>() - 1.0).abs() < 1e-2, "{who}: row {r} {row:?}"),
                }
            }
        }
    }
}

fn softmax<D: Device>(dev: &D, x: &[f32]) -> Vec<f32> {
    let inp = act(dev, x);
    let mut out = dev.alloc(x.len()).unwrap();
    dev.softmax_forward(&mut out, &inp, x.len() / 3, 3).unwrap();
    host(dev, &out)
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
