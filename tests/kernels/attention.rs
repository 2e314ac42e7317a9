//! Kernel tests: `kernels/attention.cu` against the cpu backend.

use crate::harness::{act, assert_close, cpu, devices, host, tol};
use pipetransformer::Error;
use pipetransformer::device::{Device, Precision};
use pipetransformer::ops::attention::AttentionDims;

const PRECISIONS: [Precision; 2] = [Precision::F32, Precision::Bf16];

/// [`crate::harness::rand`] rounded to bf16-representable values: in bf16 mode the kernels then
/// see exactly the reference's inputs, and the comparison measures their arithmetic and output
/// rounding rather than the quantisation of the inputs (which one cancelling sum can blow up).
fn rand(seed: u64, n: usize, scale: f32) -> Vec<f32> {
    crate::harness::rand(seed, n, scale).into_iter().map(|x| half::bf16::from_f32(x).to_f32()).collect()
}

fn dims(batch: usize, q_len: usize, kv_len: usize, heads: usize, head_dim: usize, causal: bool) -> AttentionDims {
    AttentionDims {
        batch,
        q_len,
        kv_len,
        heads,
        head_dim,
        causal,
        dropout: 0.0,
        dropout_seed: 0x5EED,
        dropout_offset: 1000,
        // Wider than the keys, as in a token slice: the kernels must place the mask by it.
        mask_seq: kv_len + 2,
    }
}

/// A key mask that hides keys 1 and kv_len−1 of sequence 0, every key of sequence 1 (its
/// queries see nothing), and the first 5 keys of sequence 2 (with a causal prefix of 4, its
/// first query sees nothing either).
fn mask(d: &AttentionDims) -> Vec<u32> {
    let kv = d.kv_len;
    let mut m = vec![1u32; d.batch * kv];
    for (b, row) in m.chunks_mut(kv).enumerate() {
        match b % 3 {
            0 => {
                row[1.min(kv - 1)] = 0;
                row[kv - 1] = 0;
            }
            1 => row.fill(0),
            _ => row[..5.min(kv)].fill(0),
        }
    }
    m
}

/// What one device computes: `[out, saved, dq, dk, dv]` as f32.
fn run<D: Device>(dev: &D, d: &AttentionDims, mask: Option<&[u32]>, seed: u64) -> [Vec<f32>; 5] {
    let c = d.heads * d.head_dim;
    let (nq, nk) = (d.batch * d.q_len * c, d.batch * d.kv_len * c);
    let (q, k, v) =
        (act(dev, &rand(seed, nq, 2.0)), act(dev, &rand(seed + 1, nk, 2.0)), act(dev, &rand(seed + 2, nk, 2.0)));
    let dout = act(dev, &rand(seed + 3, nq, 1.0));
    let mask = mask.map(|m| dev.upload_ids(m).unwrap());
    let mut out = dev.alloc(nq).unwrap();
    let mut saved = dev.alloc_stats(dev.attention_saved_len(d)).unwrap();
    dev.attention_forward(&mut out, &mut saved, &q, &k, &v, mask.as_ref(), d).unwrap();
    let (mut dq, mut dk, mut dv) = (dev.alloc(nq).unwrap(), dev.alloc(nk).unwrap(), dev.alloc(nk).unwrap());
    dev.attention_backward(&mut dq, &mut dk, &mut dv, &dout, &q, &k, &v, &out, &saved, mask.as_ref(), d).unwrap();
    [&out, &saved, &dq, &dk, &dv].map(|b| host(dev, b))
}

fn bits(x: &[f32]) -> Vec<u32> {
    x.iter().map(|x| x.to_bits()).collect()
}

/// Runs `d` with and without the mask on the cpu and every device: out, dq, dk, dv within
/// tolerance (the saved state differs by design: probabilities vs log-sum-exps), and every
/// output bitwise identical across thread orders.
fn check(d: &AttentionDims, seed: u64) {
    let cpu = cpu();
    let m = mask(d);
    for mask in [None, Some(&m[..])] {
        let want = run(&cpu, d, mask, seed);
        for precision in PRECISIONS {
            let what = format!("{precision:?} {d:?} mask {}", mask.is_some());
            let got: Vec<_> = devices(precision).iter().map(|dev| run(dev, d, mask, seed)).collect();
            for got in &got {
                for (i, name) in [(0, "out"), (2, "dq"), (3, "dk"), (4, "dv")] {
                    assert_close(&format!("{what}: {name}"), &got[i], &want[i], tol(precision));
                }
            }
            // Sequence 1 sees no key under the mask: its saved log-sum-exps are the +∞ sentinel.
            if mask.is_some() && d.batch > 1 {
                let rows = d.heads * d.q_len;
                assert!(got.iter().all(|g| g[1][rows..2 * rows].iter().all(|&x| x == f32::INFINITY)), "{what}: lse");
            }
            for pair in got.windows(2) {
                for (i, name) in ["out", "lse", "dq", "dk", "dv"].iter().enumerate() {
                    assert_eq!(bits(&pair[0][i]), bits(&pair[1][i]), "{what}: {name} differs between thread orders");
                }
            }
        }
    }
}

#[test]
fn attention_single_position() {
    check(&dims(1, 1, 1, 1, 5, false), 1);
    check(&dims(3, 1, 1, 3, 32, true), 2);
}

/// One new token over a cached prefix of 4 keys (TeraPipe's last slice), with dropout.
#[test]
fn attention_one_query_over_prefix() {
    check(&AttentionDims { dropout: 0.2, ..dims(3, 1, 5, 3, 32, true) }, 3);
}

#[test]
fn attention_odd_shapes() {
    for causal in [false, true] {
        check(&dims(3, 13, 13, 3, 5, causal), 4);
        check(&dims(1, 13, 17, 3, 64, causal), 5);
    }
}

#[test]
fn attention_dropout() {
    for causal in [false, true] {
        check(&AttentionDims { dropout: 0.2, ..dims(3, 13, 17, 3, 5, causal) }, 6);
        check(&AttentionDims { dropout: 0.2, ..dims(3, 13, 17, 1, 32, causal) }, 7);
    }
}

/// Several tiles of queries and keys: 32-row tiles up to head_dim 64, 16-row tiles above
/// (head_dim 96 is not a multiple of the warp, 128 is the largest supported).
#[test]
fn attention_several_tiles() {
    check(&AttentionDims { dropout: 0.2, ..dims(3, 40, 44, 1, 32, true) }, 8);
    check(&dims(3, 37, 37, 1, 96, false), 9);
    check(&AttentionDims { dropout: 0.2, ..dims(3, 35, 39, 2, 128, true) }, 10);
}

/// A query whose scores are all NaN (a NaN in its row of q) gets a NaN output on every device,
/// not the zeros of a query that sees no key; the other queries are untouched.
#[test]
fn attention_a_nan_query_gives_nan_not_zeros() {
    let d = dims(1, 4, 4, 1, 8, false);
    let mut q = rand(1, 32, 1.0);
    q[8] = f32::NAN; // query 1
    let (k, v) = (rand(2, 32, 1.0), rand(3, 32, 1.0));
    fn forward<D: Device>(dev: &D, q: &[f32], k: &[f32], v: &[f32], d: &AttentionDims) -> Vec<f32> {
        let mut out = dev.alloc(q.len()).unwrap();
        let mut saved = dev.alloc_stats(dev.attention_saved_len(d)).unwrap();
        dev.attention_forward(&mut out, &mut saved, &act(dev, q), &act(dev, k), &act(dev, v), None, d).unwrap();
        host(dev, &out)
    }
    let mut runs = vec![("cpu".to_string(), forward(&cpu(), &q, &k, &v, &d))];
    for precision in PRECISIONS {
        for (i, dev) in devices(precision).iter().enumerate() {
            runs.push((format!("{precision:?} device {i}"), forward(dev, &q, &k, &v, &d)));
        }
    }
    for (who, out) in runs {
        for (i, row) in out.chunks(8).enumerate() {
            assert_eq!(row.iter().all(|x| x.is_nan()), i == 1, "{who}: query {i} {row:?}");
            assert!(i == 1 || row.iter().all(|x| x.is_finite()), "{who}: query {i} {row:?}");
        }
    }
}

/// The cpu backend's configuration errors, plus head dimensions past the kernels' limit.
#[test]
fn attention_rejects_bad_dims() {
    for dev in devices(Precision::F32) {
        let field = |d: AttentionDims| {
            let c = d.heads * d.head_dim;
            let (q, kv) = (dev.alloc(d.batch * d.q_len * c).unwrap(), dev.alloc(d.batch * d.kv_len * c).unwrap());
            let mut out = dev.alloc(d.batch * d.q_len * c).unwrap();
            let mut saved = dev.alloc_stats(d.batch * d.heads * d.q_len).unwrap();
            match dev.attention_forward(&mut out, &mut saved, &q, &kv, &kv, None, &d) {
                Err(Error::Config { field, .. }) => field,
                other => panic!("expected a config error, got {other:?}"),
            }
        };
        assert_eq!(field(dims(2, 5, 4, 2, 3, true)), "attention.kv_len");
        assert_eq!(field(dims(2, 5, 5, 2, 0, true)), "attention.head_dim");
        assert_eq!(field(dims(1, 2, 2, 1, 129, true)), "attention.head_dim");
        assert_eq!(field(AttentionDims { dropout: 1.0, ..dims(2, 5, 5, 2, 3, true) }), "attention.dropout");
    }
}
