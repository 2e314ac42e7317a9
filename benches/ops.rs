//! Op microbenchmarks on the `cpu` backend (f32, all cores), at MiniLM-step shapes: batch 16,
//! sequence 128, hidden 384, 12 heads, MLP 1536. Throughput is reported in elements/s where
//! one element is one FLOP, so criterion's `Gelem/s` reads as GFLOP/s (memory-bound ops count
//! bytes instead: `GB/s`).

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use pipetransformer::device::{CpuDevice, Device};
use pipetransformer::ops::attention::AttentionDims;
use pipetransformer::rng::Rng;
use std::hint::black_box;

const B: usize = 16;
const T: usize = 128;
const C: usize = 384;
const H: usize = 12;
const F: usize = 1536;

fn random(dev: &CpuDevice<f32>, n: usize, seed: u64) -> <CpuDevice<f32> as Device>::Buf {
    let v: Vec<f32> = Rng::new(seed).vec(n, 1.0).iter().map(|&x| x as f32).collect();
    dev.upload(&v).unwrap()
}

fn bench_linear(c: &mut Criterion) {
    let dev = CpuDevice::<f32>::new(0, 0).unwrap();
    let rows = B * T;
    let mut g = c.benchmark_group("linear_384x1536");
    g.sample_size(10);
    let flops = 2.0 * (rows * C * F) as f64;
    let inp = random(&dev, rows * C, 1);
    let w = random(&dev, F * C, 2);
    let bias = random(&dev, F, 3);
    let mut out = dev.alloc(rows * F).unwrap();
    g.throughput(Throughput::Elements(flops as u64));
    g.bench_function("forward", |b| {
        b.iter(|| dev.linear_forward(&mut out, &inp, &w, Some(&bias), rows, C, F).unwrap());
    });
    let mut dinp = dev.alloc(rows * C).unwrap();
    let mut dw = dev.zeros(F * C).unwrap();
    let mut db = dev.zeros(F).unwrap();
    g.throughput(Throughput::Elements(2 * flops as u64));
    g.bench_function("backward", |b| {
        b.iter(|| {
            dev.linear_backward(Some(&mut dinp), Some(&mut dw), Some(&mut db), &out, &inp, &w, rows, C, F).unwrap()
        });
    });
    g.finish();
}

/// Attention's input projections: three `C → C` products (what the model runs) against one
/// `C → 3C` product (what a fused q/k/v weight would run), forward and backward: an upper
/// bound on what fusing them would buy (a fused output must still be split into q, k and v, and
/// their gradients joined, for attention, which reads them apart).
fn bench_qkv(c: &mut Criterion) {
    let dev = CpuDevice::<f32>::new(0, 0).unwrap();
    let rows = B * T;
    let mut g = c.benchmark_group("qkv_2048x384");
    g.sample_size(10);
    let flops = 2.0 * (rows * C * 3 * C) as f64;
    let inp = random(&dev, rows * C, 1);
    let w = random(&dev, 3 * C * C, 2);
    let ws = [random(&dev, C * C, 3), random(&dev, C * C, 4), random(&dev, C * C, 5)];
    let bias = random(&dev, 3 * C, 6);
    let biases = [random(&dev, C, 7), random(&dev, C, 8), random(&dev, C, 9)];
    // Also the backward's output gradients: random, whichever benches a filter runs.
    let mut out = random(&dev, rows * 3 * C, 10);
    let mut outs = [random(&dev, rows * C, 11), random(&dev, rows * C, 12), random(&dev, rows * C, 13)];
    g.throughput(Throughput::Elements(flops as u64));
    g.bench_function("forward/three", |b| {
        b.iter(|| {
            for ((o, w), bias) in outs.iter_mut().zip(&ws).zip(&biases) {
                dev.linear_forward(o, &inp, w, Some(bias), rows, C, C).unwrap();
            }
        });
    });
    g.bench_function("forward/one", |b| {
        b.iter(|| dev.linear_forward(&mut out, &inp, &w, Some(&bias), rows, C, 3 * C).unwrap());
    });
    let mut dinp = dev.alloc(rows * C).unwrap();
    let mut dinp_part = dev.alloc(rows * C).unwrap();
    let mut dw = dev.zeros(3 * C * C).unwrap();
    let mut dws = [dev.zeros(C * C).unwrap(), dev.zeros(C * C).unwrap(), dev.zeros(C * C).unwrap()];
    let mut db = dev.zeros(3 * C).unwrap();
    let mut dbs = [dev.zeros(C).unwrap(), dev.zeros(C).unwrap(), dev.zeros(C).unwrap()];
    g.throughput(Throughput::Elements(2 * flops as u64));
    g.bench_function("backward/three", |b| {
        b.iter(|| {
            for (i, (((dout, w), dw), db)) in outs.iter().zip(&ws).zip(dws.iter_mut()).zip(dbs.iter_mut()).enumerate() {
                let target = if i == 0 { &mut dinp } else { &mut dinp_part };
                dev.linear_backward(Some(target), Some(dw), Some(db), dout, &inp, w, rows, C, C).unwrap();
                if i > 0 {
                    dev.residual_backward(&mut dinp, &dinp_part).unwrap();
                }
            }
        });
    });
    g.bench_function("backward/one", |b| {
        b.iter(|| {
            dev.linear_backward(Some(&mut dinp), Some(&mut dw), Some(&mut db), &out, &inp, &w, rows, C, 3 * C).unwrap()
        });
    });
    g.finish();
}

fn bench_attention(c: &mut Criterion) {
    let dev = CpuDevice::<f32>::new(0, 0).unwrap();
    let n = B * T * C;
    let (q, k, v) = (random(&dev, n, 1), random(&dev, n, 2), random(&dev, n, 3));
    let mut out = dev.alloc(n).unwrap();
    let mut probs = dev.alloc(B * H * T * T).unwrap();
    let d = AttentionDims {
        batch: B,
        q_len: T,
        kv_len: T,
        heads: H,
        head_dim: C / H,
        causal: false,
        dropout: 0.1,
        dropout_seed: 1,
        dropout_offset: 0,
        mask_seq: T,
    };
    let flops = 4.0 * (B * T * T * C) as f64;
    let mut g = c.benchmark_group("attention_b16_t128_h12x32");
    g.sample_size(10);
    g.throughput(Throughput::Elements(flops as u64));
    g.bench_function("forward", |b| {
        b.iter(|| dev.attention_forward(&mut out, &mut probs, &q, &k, &v, None, &d).unwrap())
    });
    let (mut dq, mut dk, mut dv) = (dev.alloc(n).unwrap(), dev.alloc(n).unwrap(), dev.alloc(n).unwrap());
    g.throughput(Throughput::Elements(2 * flops as u64));
    g.bench_function("backward", |b| {
        b.iter(|| dev.attention_backward(&mut dq, &mut dk, &mut dv, &out, &q, &k, &v, &out, &probs, None, &d).unwrap())
    });
    g.finish();
}

fn bench_layernorm(c: &mut Criterion) {
    let dev = CpuDevice::<f32>::new(0, 0).unwrap();
    let rows = B * T;
    let inp = random(&dev, rows * C, 1);
    let (w, bias) = (random(&dev, C, 2), random(&dev, C, 3));
    let mut out = dev.alloc(rows * C).unwrap();
    let (mut mean, mut rstd) = (dev.alloc(rows).unwrap(), dev.alloc(rows).unwrap());
    let mut g = c.benchmark_group("layernorm_2048x384");
    // Bytes: forward reads x, writes y; backward reads x, dy, writes dx.
    g.throughput(Throughput::Bytes((2 * rows * C * 4) as u64));
    g.bench_function("forward", |b| {
        b.iter(|| dev.layernorm_forward(&mut out, &mut mean, &mut rstd, &inp, &w, &bias, rows, C, 1e-12).unwrap())
    });
    let mut dinp = dev.alloc(rows * C).unwrap();
    let (mut dw, mut db) = (dev.zeros(C).unwrap(), dev.zeros(C).unwrap());
    g.throughput(Throughput::Bytes((3 * rows * C * 4) as u64));
    g.bench_function("backward", |b| {
        b.iter(|| {
            dev.layernorm_backward(&mut dinp, &mut dw, &mut db, &out, &inp, &w, &mean, &rstd, rows, C).unwrap();
            black_box(&dinp);
        })
    });
    g.finish();
}

fn bench_matmul(c: &mut Criterion) {
    let n = 1024;
    let mut g = c.benchmark_group("matmul_f32");
    g.sample_size(10);
    g.throughput(Throughput::Elements(2 * (n * n * n) as u64));
    let mut rng = Rng::new(0);
    let a: Vec<f32> = rng.vec(n * n, 1.0).iter().map(|&x| x as f32).collect();
    let bm: Vec<f32> = rng.vec(n * n, 1.0).iter().map(|&x| x as f32).collect();
    let mut out = vec![0f32; n * n];
    use pipetransformer::ops::matmul::{MatRef, matmul};
    g.bench_function("1024^3", |b| {
        b.iter(|| matmul(&mut out, n, MatRef::rows(&a, n), MatRef::rows(&bm, n), n, n, n, false))
    });
    g.finish();
}

/// The element-wise ops between the products: GELU on the MLP's hidden activations, dropout on
/// the hidden stream, AdamW over one encoder layer's parameters. Memory-bound unless their
/// arithmetic (erf, exp, the mask's hash, AdamW's sqrt and division) is scalar; bytes moved are
/// the throughput.
fn bench_elementwise(c: &mut Criterion) {
    use pipetransformer::ops::dropout::DropoutCoords;
    use pipetransformer::ops::gelu::Activation;
    use pipetransformer::ops::optim::AdamWStep;
    let dev = CpuDevice::<f32>::new(0, 0).unwrap();
    let mut g = c.benchmark_group("elementwise");
    let n = B * T * F;
    let (x, dy) = (random(&dev, n, 1), random(&dev, n, 2));
    let mut y = dev.alloc(n).unwrap();
    g.throughput(Throughput::Bytes((2 * n * 4) as u64));
    for (name, kind) in [("gelu_erf_2048x1536", Activation::GeluErf), ("gelu_tanh_2048x1536", Activation::GeluTanh)] {
        g.bench_function(format!("{name}/forward"), |b| b.iter(|| dev.gelu_forward(&mut y, &x, kind).unwrap()));
    }
    g.throughput(Throughput::Bytes((3 * n * 4) as u64));
    for (name, kind) in [("gelu_erf_2048x1536", Activation::GeluErf), ("gelu_tanh_2048x1536", Activation::GeluTanh)] {
        g.bench_function(format!("{name}/backward"), |b| b.iter(|| dev.gelu_backward(&mut y, &x, &dy, kind).unwrap()));
    }
    let n = B * T * C;
    let (x, mut y) = (random(&dev, n, 3), dev.alloc(n).unwrap());
    g.throughput(Throughput::Bytes((2 * n * 4) as u64));
    g.bench_function("dropout_2048x384/forward", |b| {
        b.iter(|| dev.dropout_forward(&mut y, &x, 0.1, DropoutCoords::contiguous(5, 0)).unwrap())
    });
    // One encoder layer: 4·C² + 2·C·F weights and their biases and norms, ≈ 1.78 M.
    let n = 4 * C * C + 2 * C * F + 9 * C + F;
    let (mut p, grad) = (random(&dev, n, 4), random(&dev, n, 5));
    let (mut m, mut v) = (dev.zeros(n).unwrap(), dev.zeros(n).unwrap());
    let h = AdamWStep { lr: 1e-4, beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.01, step: 3, grad_scale: 1.0 };
    // Reads p, g, m, v; writes p, m, v.
    g.throughput(Throughput::Bytes((7 * n * 4) as u64));
    g.bench_function("adamw_one_layer/update", |b| {
        b.iter(|| dev.adamw_update(&mut p, &grad, &mut m, &mut v, &h).unwrap())
    });
    // The whole MiniLM (≈ 23 M values, 0.6 GB a step read and written): past every cache, as
    // in a training step, where the one layer above may stay in a large L3.
    let n = 13 * n;
    let (mut p, grad) = (random(&dev, n, 4), random(&dev, n, 5));
    let (mut m, mut v) = (dev.zeros(n).unwrap(), dev.zeros(n).unwrap());
    g.throughput(Throughput::Bytes((7 * n * 4) as u64));
    g.bench_function("adamw_minilm_23m/update", |b| {
        b.iter(|| dev.adamw_update(&mut p, &grad, &mut m, &mut v, &h).unwrap())
    });
    // What a sparse embedding gradient (only the rows a batch touches) would take off a step
    // on one device: zeroing the dense table gradient and reading it for the clipping norm.
    // (AdamW still visits every row: its moments decay where the gradient is zero. Replicas
    // would also sum fewer values, and per-unit norms read it once more.)
    let n = 30522 * C;
    let mut table_grad = random(&dev, n, 6);
    g.throughput(Throughput::Bytes((2 * n * 4) as u64));
    g.bench_function("embedding_grad_30522x384/zero_and_norm", |b| {
        b.iter(|| {
            dev.fill(&mut table_grad, 0.0).unwrap();
            black_box(dev.sum_squares(&table_grad).unwrap())
        })
    });
    g.finish();
}

criterion_group!(benches, bench_matmul, bench_linear, bench_qkv, bench_attention, bench_layernorm, bench_elementwise);
criterion_main!(benches);
