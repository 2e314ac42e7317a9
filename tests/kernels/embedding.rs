//! Kernel tests: `kernels/embedding.cu` against the cpu backend.

use crate::elementwise::{PRECISIONS, act_data, compare};
use crate::harness::{self, act, host, param, rand};
use pipetransformer::device::Device;
use pipetransformer::ops::patch::PatchDims;

/// Embedding dims: 1, below a warp, past a block.
const DIMS: [usize; 3] = [1, 13, 385];

/// `(batch, seq)` of the sequence ops: one token, odd lengths.
const SEQS: [(usize, usize); 3] = [(1, 1), (3, 13), (2, 5)];

/// `n` ids below `rows` with many repeats (a table row read by several positions), from a seed.
fn ids(seed: u64, n: usize, rows: usize) -> Vec<u32> {
    rand(seed, n, 1.0).into_iter().map(|v| ((v + 1.0) * 0.5 * rows as f32) as u32 % rows as u32).collect()
}

/// Lookup (written, then added onto), and the backward into a table gradient that starts
/// non-zero; the ids repeat and leave some rows untouched.
#[test]
fn embedding_matches_cpu() {
    for precision in PRECISIONS {
        for dim in DIMS {
            for n in [1, 13, 40] {
                let rows = 11;
                let token_ids = ids(dim as u64 + n as u64, n, rows);
                let (table, dtable0) = (rand(1, rows * dim, 1.0), rand(2, rows * dim, 1.0));
                let dout = act_data(precision, rand(3, n * dim, 1.0));
                compare!(format!("embedding n={n} dim={dim}"), precision, |dev| {
                    let (table, ids, dout) = (param(dev, &table), dev.upload_ids(&token_ids).unwrap(), act(dev, &dout));
                    let (mut out, mut summed) = (dev.alloc(n * dim).unwrap(), dev.alloc(n * dim).unwrap());
                    dev.embedding_forward(&mut out, &ids, &table, dim, false).unwrap();
                    dev.copy(&mut summed, &out).unwrap();
                    dev.embedding_forward(&mut summed, &ids, &table, dim, true).unwrap();
                    let mut dtable = param(dev, &dtable0);
                    dev.embedding_backward(&mut dtable, &ids, &dout, dim).unwrap();
                    vec![("out", host(dev, &out)), ("accumulated", host(dev, &summed)), ("dtable", host(dev, &dtable))]
                });
            }
        }
    }
}

/// im2col and its adjoint: several channels and patches, a non-square image, one patch.
#[test]
fn patches_match_cpu() {
    let shapes = [(2, 3, 12, 12, 4), (1, 1, 8, 12, 2), (3, 2, 5, 5, 5)];
    for precision in PRECISIONS {
        for (batch, channels, height, width, patch) in shapes {
            let d = PatchDims { batch, channels, height, width, patch };
            let n = batch * d.num_patches() * d.patch_len();
            let img = rand(4, batch * channels * height * width, 1.0);
            let dout = act_data(precision, rand(5, n, 1.0));
            compare!(format!("patches {d:?}"), precision, |dev| {
                let (img, dout) = (param(dev, &img), act(dev, &dout));
                let mut out = dev.alloc(n).unwrap();
                dev.patch_forward(&mut out, &img, d).unwrap();
                let mut dimg = param(dev, &vec![0.0; img_len(d)]);
                dev.patch_backward(&mut dimg, &dout, d).unwrap();
                vec![("out", host(dev, &out)), ("dimg", host(dev, &dimg))]
            });
        }
    }
}

fn img_len(d: PatchDims) -> usize {
    d.batch * d.channels * d.height * d.width
}

/// ViT's class token: forward, and the backward into a token gradient that starts non-zero,
/// with and without the input gradient.
#[test]
fn prepend_token_matches_cpu() {
    for precision in PRECISIONS {
        for (batch, seq) in SEQS {
            for dim in DIMS {
                let (token, dtoken0) = (rand(6, dim, 1.0), rand(7, dim, 1.0));
                let inp = act_data(precision, rand(8, batch * seq * dim, 1.0));
                let dout = act_data(precision, rand(9, batch * (seq + 1) * dim, 1.0));
                for with_dinp in [true, false] {
                    compare!(format!("prepend_token {batch}x{seq}x{dim} dinp {with_dinp}"), precision, |dev| {
                        let (token, inp, dout) = (param(dev, &token), act(dev, &inp), act(dev, &dout));
                        let mut out = dev.alloc(batch * (seq + 1) * dim).unwrap();
                        dev.prepend_token_forward(&mut out, &token, &inp, batch, seq, dim).unwrap();
                        let mut dtoken = param(dev, &dtoken0);
                        let mut dinp = with_dinp.then(|| dev.alloc(batch * seq * dim).unwrap());
                        dev.prepend_token_backward(&mut dtoken, dinp.as_mut(), &dout, batch, seq, dim).unwrap();
                        let mut outputs = vec![("out", host(dev, &out)), ("dtoken", host(dev, &dtoken))];
                        outputs.extend(dinp.map(|d| ("dinp", host(dev, &d))));
                        outputs
                    });
                }
            }
        }
    }
}

/// `[CLS]` pooling: the backward writes zeros past the first token.
#[test]
fn first_token_pool_matches_cpu() {
    for precision in PRECISIONS {
        for (batch, seq) in SEQS {
            for dim in DIMS {
                let inp = act_data(precision, rand(10, batch * seq * dim, 1.0));
                let dout = act_data(precision, rand(11, batch * dim, 1.0));
                compare!(format!("first_token_pool {batch}x{seq}x{dim}"), precision, |dev| {
                    let (inp, dout) = (act(dev, &inp), act(dev, &dout));
                    let (mut out, mut dinp) = (dev.alloc(batch * dim).unwrap(), dev.alloc(batch * seq * dim).unwrap());
                    dev.first_token_pool_forward(&mut out, &inp, batch, seq, dim).unwrap();
                    dev.first_token_pool_backward(&mut dinp, &dout, batch, seq, dim).unwrap();
                    vec![("out", host(dev, &out)), ("dinp", host(dev, &dinp))]
                });
            }
        }
    }
}

/// Masked mean pooling without a mask, with padding, and with a sequence that is all padding
/// (it pools to zeros and gets no gradient).
#[test]
fn mean_pool_matches_cpu() {
    for precision in PRECISIONS {
        for (batch, seq) in SEQS {
            for dim in DIMS {
                // Sequence b keeps its first seq − 7b tokens: the last sequence of a batch of
                // two or more has none.
                let mask: Vec<u32> = (0..batch * seq).map(|i| (i % seq + 7 * (i / seq) < seq) as u32).collect();
                let inp = act_data(precision, rand(12, batch * seq * dim, 1.0));
                let dout = act_data(precision, rand(13, batch * dim, 1.0));
                for masked in [false, true] {
                    compare!(format!("mean_pool {batch}x{seq}x{dim} masked {masked}"), precision, |dev| {
                        let (inp, dout, mask) = (act(dev, &inp), act(dev, &dout), dev.upload_ids(&mask).unwrap());
                        let mask = masked.then_some(&mask);
                        let (mut out, mut dinp) =
                            (dev.alloc(batch * dim).unwrap(), dev.alloc(batch * seq * dim).unwrap());
                        dev.mean_pool_forward(&mut out, &inp, mask, batch, seq, dim).unwrap();
                        dev.mean_pool_backward(&mut dinp, &dout, mask, batch, seq, dim).unwrap();
                        vec![("out", host(dev, &out)), ("dinp", host(dev, &dinp))]
                    });
                }
            }
        }
    }
}

/// Bad calls, and the cpu's error message for each.
fn bad_calls<D: Device>(dev: &D) -> Vec<String> {
    let (table, ids) = (dev.upload(&[0.0; 12]).unwrap(), dev.upload_ids(&[0, 2, 3, 1]).unwrap());
    let mut dtable = dev.upload(&[0.0; 12]).unwrap();
    let (mut out, x) = (dev.alloc(16).unwrap(), dev.alloc(16).unwrap());
    let mut short = dev.alloc(15).unwrap();
    let d = PatchDims { batch: 1, channels: 1, height: 4, width: 6, patch: 4 };
    let results = [
        dev.embedding_forward(&mut out, &ids, &table, 4, false),
        dev.embedding_forward(&mut short, &ids, &table, 3, false),
        dev.embedding_forward(&mut out, &ids, &table, 5, true),
        dev.embedding_backward(&mut dtable, &ids, &x, 4),
        dev.patch_forward(&mut out, &table, d),
        dev.patch_backward(&mut dtable, &x, PatchDims { width: 4, ..d }),
        dev.prepend_token_forward(&mut out, &table, &x, 1, 3, 4),
        dev.prepend_token_backward(&mut dtable, Some(&mut short), &out, 1, 3, 4),
        dev.first_token_pool_forward(&mut short, &x, 2, 2, 4),
        dev.mean_pool_forward(&mut short, &x, Some(&ids), 2, 2, 4),
        dev.mean_pool_backward(&mut out, &x, Some(&ids), 2, 2, 4),
    ];
    results.into_iter().map(|r| r.expect_err("a bad call must fail").to_string()).collect()
}

/// Out-of-range ids, ragged patches and wrong lengths fail with the cpu's errors.
#[test]
fn bad_calls_fail_as_on_cpu() {
    let want = bad_calls(&harness::cpu());
    for precision in PRECISIONS {
        for dev in harness::devices(precision) {
            assert_eq!(bad_calls(&dev), want, "{}", dev.name());
        }
    }
}
