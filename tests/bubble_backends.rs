//! The measured bubble means the same on every backend: a two-stage pipeline of the same model
//! and schedule, timed by device markers on emulated CUDA devices (events on a GPU) and by the
//! host clock on `cpu` devices, idles the same fraction of its step.
//!
//! A binary of its own, so no other test shares the cores while it times.
//!
//! The tolerance is 3 points (the first of up to three tries that meets it). The model is
//! large enough that each action takes milliseconds on a cpu device: with 8 positions and
//! hidden size 64 (an earlier version), the actions were so short that thread wake-ups between
//! the devices added 1–8 points to the cpu side's bubble, and the tolerance had to be 10.
//! With 16 positions and hidden size 128, on the 2-core VM this was written on, 14 pairs
//! differed by 0.6–2.6 points (cpu 21.8–24.1 %, cuda-emu 21.0–21.9 %; the formula says 20 %).
//! A timing that charged device work to the wrong action (what host timing does to queued GPU
//! kernels) puts the bubble near 0 or near 100 %, far outside these bounds.

use pipetransformer::device::{CpuDevice, Device, Precision};
use pipetransformer::model::{GptConfig, HostBatch, Model, ModelConfig};
use pipetransformer::optim::OptimizerConfig;
use pipetransformer::pipeline::partition::UnitProfile;
use pipetransformer::pipeline::{Pipeline, PipelineConfig, ScheduleKind};
use pipetransformer::rng::Rng;

/// Four identical GEMM-heavy blocks, a tiny vocabulary: both backends see the same balance,
/// and each action is long enough that thread wake-ups are a small part of it.
fn config() -> GptConfig {
    GptConfig::without_dropout(8, 16, 128, 4, 2)
}

fn batch(c: &GptConfig, seed: u64) -> HostBatch {
    let (b, t) = (16, c.n_positions);
    let mut rng = Rng::new(seed);
    let tokens: Vec<u32> = (0..b * t).map(|_| rng.below(c.vocab_size as u64) as u32).collect();
    let targets: Vec<u32> = (0..b * t).map(|_| rng.below(c.vocab_size as u64) as u32).collect();
    HostBatch { batch: b, seq: t, tokens: Some(tokens), targets, ..Default::default() }
}

/// The median bubble of `steps` steps after one warm-up, on a plan cut by FLOPs (the same
/// stages on both backends).
fn median_bubble<D: Device>(devices: Vec<D>, schedule: ScheduleKind, steps: u64) -> f64 {
    let c = config();
    let model = Model::new(&devices[0], &ModelConfig::Gpt(c.clone()), 7).unwrap();
    let profiles: Vec<UnitProfile> = model
        .costs(&devices[0], c.n_positions)
        .iter()
        .zip(model.units())
        .map(|(cost, u)| UnitProfile::analytic(cost, 4, 1e9, u.trainable()))
        .collect();
    let plan = PipelineConfig { pipeline_len: 2, micro_batches: 4, schedule, ..Default::default() };
    let mut p = Pipeline::new(devices, model, OptimizerConfig::adamw(), plan, &profiles).unwrap();
    let mut bubbles: Vec<f64> =
        (0..=steps).map(|s| p.step(&batch(&c, s), s + 1, 1e-3, Some(1.0)).unwrap().trace.bubble()).skip(1).collect();
    bubbles.sort_by(f64::total_cmp);
    bubbles[bubbles.len() / 2]
}

#[test]
fn emulated_event_timing_and_cpu_host_timing_give_the_same_bubble() {
    for schedule in [ScheduleKind::Gpipe, ScheduleKind::OneFOneB] {
        // Up to five tries: a neighbour on the VM can spoil a measurement (the host-timed
        // bubble here swings between 21 and 25 % from run to run of the same binary); a timing
        // bug spoils all five.
        let mut tries = Vec::new();
        for _ in 0..5 {
            let cpu = median_bubble((0..2).map(|i| CpuDevice::<f32>::new(i, 1).unwrap()).collect(), schedule, 41);
            let emus = (0..2).map(|i| pipetransformer::device::emu::device(i, Precision::F32, 1 + i as u64).unwrap());
            let emu = median_bubble(emus.collect(), schedule, 7);
            eprintln!("{schedule}: cpu {:.1} %, cuda-emu {:.1} % (formula 20 %)", 100.0 * cpu, 100.0 * emu);
            tries.push((cpu, emu));
            let inside = |b: f64| (0.10..0.40).contains(&b);
            if (cpu - emu).abs() <= 0.03 && inside(cpu) && inside(emu) {
                break;
            }
            assert!(tries.len() < 5, "{schedule}: (cpu, cuda-emu) bubbles {tries:?}; the formula says 0.20");
        }
    }
}
