//! TeraPipe on `cpu` devices (one thread each; run on a machine with at least as many cores as
//! devices): a GPT step with fewer micro-batches than devices (M < K, where an unsliced pipeline
//! idles most), unsliced 1F1B against token-sliced GPipe (TeraPipe's order) and 1F1B over
//! slices, with uniform slices and the planner's choice (`auto`, from this machine's measured
//! layer latency): step time against the planner's prediction, measured bubble against the
//! formula, and the most activation memory a device held. Two shapes: hamlet's (128 tokens) and a long-sequence one (1024 tokens).
//!
//! `cargo bench --bench terapipe` prints a markdown report (docs/PERF.md records it).

use pipetransformer::device::CpuDevice;
use pipetransformer::model::{GptConfig, Model, ModelConfig};
use pipetransformer::optim::OptimizerConfig;
use pipetransformer::pipeline::{Pipeline, PipelineConfig, ScheduleKind, unit_profiles};
use pipetransformer::terapipe::{
    MicroBatchSlicing, PlannerConfig, measure_latency, plan, predict_step_seconds, uniform,
};
use std::time::Instant;

/// `(name, config, batch, seq)`.
fn shapes() -> Vec<(&'static str, ModelConfig, usize, usize)> {
    let gpt = |positions, embd, layers, heads| {
        let mut c = GptConfig::without_dropout(66, positions, embd, layers, heads);
        (c.resid_pdrop, c.embd_pdrop, c.attn_pdrop) = (0.1, 0.1, 0.1);
        ModelConfig::Gpt(c)
    };
    vec![
        ("hamlet (128 tokens, batch 16)", gpt(128, 128, 4, 4), 16, 128),
        ("long (1024 tokens, batch 2)", gpt(1024, 128, 4, 4), 2, 1024),
    ]
}

fn main() {
    if !pipetransformer::bench::under_cargo_bench() {
        println!("benchmarks run under `cargo bench`");
        return;
    }
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let k = cores.clamp(2, 4);
    println!("# TeraPipe on {cores} cores: {k} cpu devices of 1 thread, 1 micro-batch\n");
    for (name, config, batch, seq) in shapes() {
        println!("## {name}\n");
        println!(
            "| schedule | slices | step ms | predicted step ms | measured bubble | formula | peak activations MiB |"
        );
        println!("|---|---|---|---|---|---|---|");
        // The planner's choice from this machine's layer latency (0 slices below: `auto`).
        let (latency, chosen) = {
            let dev = CpuDevice::<f32>::new(0, 1).unwrap();
            let mut model = Model::new(&dev, &config, 1).unwrap();
            let host = pipetransformer::model::HostBatch::random(&config, batch, seq, 2);
            let latency = measure_latency(&dev, &mut model, &host, k).unwrap();
            let planned = plan(&latency, &PlannerConfig::new(k, seq, 1)).unwrap();
            (latency, planned.micro_batches[0].slices.clone())
        };
        let runs = [
            (ScheduleKind::Gpipe, 0),
            (ScheduleKind::OneFOneB, 0),
            (ScheduleKind::OneFOneB, 1),
            (ScheduleKind::Gpipe, 4),
            (ScheduleKind::OneFOneB, 4),
            (ScheduleKind::Gpipe, 8),
            (ScheduleKind::OneFOneB, 8),
            (ScheduleKind::OneFOneB, 16),
        ];
        for (schedule, n) in runs {
            let devices: Vec<CpuDevice<f32>> = (0..k).map(|i| CpuDevice::new(i, 1).unwrap()).collect();
            let mut model = Model::new(&devices[0], &config, 1).unwrap();
            let host = pipetransformer::model::HostBatch::random(&config, batch, seq, 2);
            // Stages cut by FLOPs, the same for every row (measured times would move the cuts,
            // and with them each device's memory, from row to row).
            let profiles = unit_profiles(&devices[0], &mut model, &host, false).unwrap();
            let lengths = if n == 0 { chosen.clone() } else { uniform(seq, n) };
            let predicted =
                predict_step_seconds(&latency, k, &[MicroBatchSlicing { samples: 1, slices: lengths.clone() }])
                    .unwrap();
            let token_slices = if lengths.len() > 1 { lengths.clone() } else { Vec::new() };
            let plan =
                PipelineConfig { pipeline_len: k, micro_batches: 1, schedule, token_slices, ..Default::default() };
            let mut p = Pipeline::new(devices, model, OptimizerConfig::adamw(), plan, &profiles).unwrap();
            p.step(&host, 1, 1e-4, None).unwrap(); // warm-up: buffer pools
            let mut runs: Vec<(f64, f64, usize)> = (0..3)
                .map(|i| {
                    let t = Instant::now();
                    let s = p.step(&host, 2 + i, 1e-4, None).unwrap();
                    let trace = &s.trace;
                    (t.elapsed().as_secs_f64(), trace.bubble(), s.peak_activations.iter().copied().max().unwrap_or(0))
                })
                .collect();
            runs.sort_by(|a, b| a.0.total_cmp(&b.0));
            let (secs, measured, peak) = runs[runs.len() / 2];
            let name = if n == 0 { format!("auto: {lengths:?}") } else { n.to_string() };
            println!(
                "| {schedule} | {name} | {:.1} | {:.1} | {:.1}% | {:.1}% | {:.1} |",
                secs * 1e3,
                predicted * 1e3,
                100.0 * measured,
                100.0 * p.plan().schedule.bubble_formula(),
                (peak * 4) as f64 / (1 << 20) as f64
            );
        }
        println!();
    }
}
