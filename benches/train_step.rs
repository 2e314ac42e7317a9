//! One full training step (forward, backward, AdamW) of the MiniLM-shaped encoder: 6 layers,
//! hidden 384, 12 heads, MLP 1536, sequence 128, batch 16, f32, all cores. Throughput in
//! elements/s where one element is one FLOP (criterion's `Gelem/s` reads as GFLOP/s). The
//! `bench-step` CLI report prints the same number next to the machine's GEMM rate.

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use pipetransformer::bench;
use pipetransformer::device::CpuDevice;
use pipetransformer::model::{Batch, HostBatch, Model};
use pipetransformer::optim::{Optimizer, OptimizerConfig, train_step};

fn bench_step(c: &mut Criterion) {
    let dev = CpuDevice::<f32>::new(0, 0).unwrap();
    let config = bench::minilm_shaped();
    let mut model = Model::new(&dev, &config, 0).unwrap();
    let batch = Batch::upload(&dev, model.spec(), &HostBatch::random(&config, 16, 128, 1), true, 2).unwrap();
    let mut opt = Optimizer::new(OptimizerConfig::adamw()).unwrap();
    let flops = bench::step_flops(&model, &dev, 16, 128);
    let mut g = c.benchmark_group("minilm_train_step");
    g.sample_size(10);
    g.throughput(Throughput::Elements(flops as u64));
    g.bench_function("b16_t128_f32", |b| {
        b.iter(|| train_step(&dev, &mut model, &mut opt, &batch, 1e-4, Some(1.0)).unwrap())
    });
    g.finish();
}

criterion_group!(benches, bench_step);
criterion_main!(benches);
