//! f32 `matmul` (the `gemm` crate) against the bf16 kernel (`ops::gemm_bf16`) at the MiniLM
//! step's linear shapes: 2048 rows (batch 16 × sequence 128), hidden 384, MLP 1536, for each of
//! a linear layer's three products: forward `Y = X·Wᵀ`, `dX = dY·W`, `dW = dYᵀ·X` (the views the
//! linear layer passes, transposes included), on all cores as a one-device `cpu` run does them;
//! and at 224 rows on one thread, a micro-batch of the main job's pipeline (8 snippets of ~28
//! tokens on a one-thread stage), where the weight's packing weighs as much as the product;
//! so the forward and `dX` also run with the weight packed beforehand (`bf16-packed-weight`),
//! as a cpu device keeps it from one micro-batch to the next.
//! And the weight gradient accumulated into gradients out of cache (`dweight_cold_*`), over one
//! micro-batch and over a step's eight at once; and a micro-batch's forward with its packed
//! weight in L2 or out of it (`forward_*_rows133_*`); and what a hand-off to a pool costs
//! (`pool_hand_off_threads1`), which the products' figures leave out.
//! Throughput is in elements/s where one element is one FLOP: criterion's `Gelem/s` reads as
//! GFLOP/s.
//!
//! `cargo bench --bench gemm_bf16`

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use pipetransformer::ops::gemm_bf16::{Bf16Path, PackedB, bf16_path, matmul_bf16, matmul_bf16_packed};
use pipetransformer::ops::matmul::{MatRef, matmul};
use pipetransformer::rng::Rng;
use std::hint::black_box;
use std::time::{Duration, Instant};

/// Runs `f` `iters` times inside `pool` and returns the time taken: one hand-off to the pool
/// per sample, not per call. A hand-off to a sleeping pool thread and back costs 70 µs on the
/// VMs of docs/PERF.md, as much as a micro-batch's product; the engine's ops run on the
/// pool's threads already and pay none.
fn time_in<R>(pool: &rayon::ThreadPool, iters: u64, mut f: impl FnMut() -> R + Send) -> Duration {
    pool.install(|| {
        let start = Instant::now();
        for _ in 0..iters {
            black_box(f());
        }
        start.elapsed()
    })
}

fn random(n: usize, seed: u64) -> Vec<f32> {
    Rng::new(seed).vec(n, 1.0).iter().map(|&x| x as f32).collect()
}

fn bench_linear_products(c: &mut Criterion) {
    let all = rayon::ThreadPoolBuilder::new().build().unwrap();
    let one = rayon::ThreadPoolBuilder::new().num_threads(1).build().unwrap();
    eprintln!("bf16 path: {:?}, {} threads", bf16_path(), all.current_num_threads());
    for (rows, pool, (in_dim, out_dim)) in [
        (16 * 128, &all, (384, 384)),
        (16 * 128, &all, (384, 1536)),
        (16 * 128, &all, (1536, 384)),
        (224, &one, (384, 384)),
        (224, &one, (384, 1536)),
    ] {
        let threads = pool.current_num_threads();
        let x = random(rows * in_dim, 1);
        let w = random(out_dim * in_dim, 2);
        let dy = random(rows * out_dim, 3);
        let mut y = vec![0f32; rows * out_dim];
        let mut dx = vec![0f32; rows * in_dim];
        let mut dw = vec![0f32; out_dim * in_dim];
        let name = if rows == 2048 {
            format!("linear_{in_dim}x{out_dim}")
        } else {
            format!("linear_{in_dim}x{out_dim}_rows{rows}_threads{threads}")
        };
        let mut g = c.benchmark_group(name);
        g.sample_size(20);
        g.throughput(Throughput::Elements(2 * (rows * in_dim * out_dim) as u64));
        // (name, C, ldc, A, B, m, n, k, accumulate) of each product.
        type Product<'a> = (&'a str, MatRef<'a, f32>, MatRef<'a, f32>, usize, usize, usize, bool);
        let products: [Product; 3] = [
            ("forward", MatRef::rows(&x, in_dim), MatRef::rows(&w, in_dim).t(), rows, out_dim, in_dim, false),
            ("dinp", MatRef::rows(&dy, out_dim), MatRef::rows(&w, in_dim), rows, in_dim, out_dim, false),
            ("dweight", MatRef::rows(&dy, out_dim).t(), MatRef::rows(&x, in_dim), out_dim, in_dim, rows, true),
        ];
        for (name, a, b, m, n, k, acc) in products {
            let out: &mut [f32] = match name {
                "forward" => &mut y,
                "dinp" => &mut dx,
                _ => &mut dw,
            };
            g.bench_function(format!("{name}/f32"), |bench| {
                bench.iter_custom(|iters| time_in(pool, iters, || matmul(black_box(&mut *out), n, a, b, m, n, k, acc)))
            });
            g.bench_function(format!("{name}/bf16"), |bench| {
                bench.iter_custom(|iters| {
                    time_in(pool, iters, || matmul_bf16(black_box(&mut *out), n, a, b, m, n, k, acc))
                })
            });
            // The weight packed once, as a cpu device keeps it across a step's micro-batches.
            let mut packed = PackedB::default();
            if name != "dweight" && pool.install(|| packed.pack(b, k, n)) {
                g.bench_function(format!("{name}/bf16-packed-weight"), |bench| {
                    bench.iter_custom(|iters| {
                        time_in(pool, iters, || matmul_bf16_packed(black_box(&mut *out), n, a, &packed, m, n, k, acc))
                    })
                });
            }
        }
        g.finish();
    }
}

/// The weight gradient as a pipelined step accumulates it: `dW += dYᵀ·X` over a micro-batch of
/// 120 rows (the main job's 8 micro-batches of 4 snippets), into a `dW` that the rest of the
/// step has pushed out of this core's caches since the last micro-batch; and over the 960 rows
/// of all eight at once, what summing a step's micro-batches in one product would run. Twelve
/// MLP-sized gradients (384 × 1536, 28 MB together, past every L2) are visited in turn, so each
/// product reads and writes a `C` that is not in L2, as the step's layers do. One thread.
fn bench_cold_weight_gradient(c: &mut Criterion) {
    let one = rayon::ThreadPoolBuilder::new().num_threads(1).build().unwrap();
    let (in_dim, out_dim, layers) = (384, 1536, 12);
    let mut dws: Vec<Vec<f32>> = (0..layers).map(|l| random(out_dim * in_dim, 10 + l as u64)).collect();
    for rows in [120, 960] {
        let x = random(rows * in_dim, 1);
        let dy = random(rows * out_dim, 3);
        let mut g = c.benchmark_group(format!("dweight_cold_{in_dim}x{out_dim}_rows{rows}_threads1"));
        g.sample_size(20);
        g.throughput(Throughput::Elements(2 * (rows * in_dim * out_dim) as u64));
        let (a, b) = (MatRef::rows(&dy, out_dim).t(), MatRef::rows(&x, in_dim));
        let mut next = 0;
        for (name, bf16) in [("f32", false), ("bf16", true)] {
            g.bench_function(name, |bench| {
                bench.iter_custom(|iters| {
                    time_in(&one, iters, || {
                        let dw = &mut dws[next % layers];
                        next += 1;
                        if bf16 {
                            matmul_bf16(black_box(dw), in_dim, a, b, out_dim, in_dim, rows, true);
                        } else {
                            matmul(black_box(dw), in_dim, a, b, out_dim, in_dim, rows, true)
                        }
                    })
                })
            });
        }
        g.finish();
    }
}

/// A micro-batch's forward `Y = X·Wᵀ` (133 rows: the main job's 4 snippets of ~33 positions,
/// one thread) with its weight packed beforehand, as a cpu device keeps it: from L2 when the
/// same weight is used again at once (`hot`), and with twelve weights visited in turn (`cold`:
/// 3.5 MB of packed 384 × 384 weights, 14 MB of MLP ones, past a 2 MiB L2), as a stage's
/// layers use theirs once per micro-batch each.
fn bench_cold_weight_forward(c: &mut Criterion) {
    if bf16_path() == Bf16Path::Fallback {
        // Weights are packed only for the micro-kernels; the fallback rounds its operands anew.
        eprintln!("forward_*_rows133_threads1: skipped, this CPU's bf16 products take the fallback");
        return;
    }
    let one = rayon::ThreadPoolBuilder::new().num_threads(1).build().unwrap();
    let (rows, layers) = (133, 12);
    for (in_dim, out_dim) in [(384, 384), (384, 1536), (1536, 384)] {
        let xs: Vec<Vec<f32>> = (0..layers).map(|l| random(rows * in_dim, 100 + l as u64)).collect();
        let packs: Vec<PackedB> = (0..layers)
            .map(|l| {
                let w = random(out_dim * in_dim, 200 + l as u64);
                let mut p = PackedB::default();
                assert!(one.install(|| p.pack(MatRef::rows(&w, in_dim).t(), in_dim, out_dim)), "bf16 path packs");
                p
            })
            .collect();
        let mut y = vec![0f32; rows * out_dim];
        let mut g = c.benchmark_group(format!("forward_{in_dim}x{out_dim}_rows{rows}_threads1"));
        g.sample_size(20);
        g.throughput(Throughput::Elements(2 * (rows * in_dim * out_dim) as u64));
        for (name, visited) in [("hot", 1), ("cold", layers)] {
            let mut next = 0;
            g.bench_function(name, |bench| {
                bench.iter_custom(|iters| {
                    time_in(&one, iters, || {
                        let l = next % visited;
                        next += 1;
                        let x = MatRef::rows(&xs[l], in_dim);
                        matmul_bf16_packed(black_box(&mut y), out_dim, x, &packs[l], rows, out_dim, in_dim, false)
                    })
                })
            });
        }
        g.finish();
    }
}

/// What `time_in` keeps out of the figures above: handing one empty job to a one-thread pool
/// from outside it and waiting for it (a wake-up each way), per call.
fn bench_pool_hand_off(c: &mut Criterion) {
    let one = rayon::ThreadPoolBuilder::new().num_threads(1).build().unwrap();
    c.bench_function("pool_hand_off_threads1", |bench| bench.iter(|| one.install(|| black_box(0))));
}

criterion_group!(
    benches,
    bench_linear_products,
    bench_cold_weight_gradient,
    bench_cold_weight_forward,
    bench_pool_hand_off
);
criterion_main!(benches);
