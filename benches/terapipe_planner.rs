//! TeraPipe slicing planner: planning time for GPT-3-like settings (pipelines.md A.7), a
//! TeraPipe-shaped latency (`t0 = 0.5 ms + 2 µs·b·l`, `Δ = 1 ns·b·l·c`, `comm = 50 µs + 1 ns·b·l`),
//! grid 8 tokens. The requirement: L = 2048, K = 48 plans in under one second.
//!
//! `cargo bench --bench terapipe_planner -- --quick` also prints each plan, its search effort
//! and one timed run of each case (stderr), and the paper's ascending scan next to the default
//! branch-and-bound.

use criterion::{Criterion, criterion_group, criterion_main};
use pipetransformer::terapipe::{LatencyGrid, LatencyModel, MemoryModel, PlannerConfig, Search, SliceSchedule, plan};
use std::hint::black_box;
use std::time::Instant;

const STEP: usize = 8;

fn latency(max_len: usize, max_batch: usize) -> LatencyModel {
    LatencyModel::from_fn(LatencyGrid { step: STEP, max_len, max_batch }, |b, l, c| {
        let n = (b * l) as f64;
        0.5e-3 + 2e-6 * n + 1e-9 * n * c as f64 + 50e-6 + 1e-9 * n
    })
    .expect("a valid grid")
}

/// bf16 activations of a GPT-3-13B-like stage (h = 5120, 40 heads, one layer per stage):
/// ~34·h bytes per token, 40 heads × 2 bytes per score (probabilities kept for the backward).
fn memory() -> MemoryModel {
    MemoryModel { per_token_bytes: 34.0 * 5120.0, per_score_bytes: 80.0, fixed_bytes: 4 << 30, ..Default::default() }
}

struct Case {
    name: String,
    latency: LatencyModel,
    config: PlannerConfig,
}

fn cases() -> Vec<Case> {
    let mut out = Vec::new();
    for (len, batch) in [(2048, 1), (8192, 1), (2048, 8), (8192, 8)] {
        let lat = latency(len, batch);
        for k in [8, 48] {
            let config = PlannerConfig { memory: vec![memory()], ..PlannerConfig::new(k, len, batch) };
            out.push(Case { name: format!("L{len}_K{k}_B{batch}"), latency: lat.clone(), config });
        }
    }
    // Memory limits that bind: GPipe half-way between the finest slicing's need and the free
    // plan's; 1F1B, over micro-batches that share one slicing (what the runtime plans), the
    // tightest of a few fractions of the free plan's peak that some slicing meets.
    let m = memory();
    for (len, k, batch) in [(2048, 48, 1), (2048, 8, 2), (8192, 48, 1)] {
        let lat = latency(len, batch);
        let free = PlannerConfig { memory: vec![m], ..PlannerConfig::new(k, len, batch) };
        let peak = plan(&lat, &free).expect("plan").peak_memory_bytes;
        let finest = m.fixed_bytes as f64
            + batch as f64 * (0..len / STEP).map(|j| m.slice_bytes(1, STEP, j * STEP)).sum::<f64>();
        let limit = (finest + 0.5 * (peak as f64 - finest)) as usize;
        let config = PlannerConfig { memory_limit: Some(limit), ..free };
        out.push(Case { name: format!("L{len}_K{k}_B{batch}_gpipe_limit"), latency: lat, config });
    }
    for (len, k, batch) in [(2048, 48, 1), (2048, 8, 8), (8192, 48, 1)] {
        let lat = latency(len, batch);
        let free = PlannerConfig {
            memory: vec![m],
            schedule: SliceSchedule::OneFOneB,
            shared: true,
            ..PlannerConfig::new(k, len, batch)
        };
        let peak = plan(&lat, &free).expect("plan").peak_memory_bytes;
        let config = [0.5, 0.7, 0.9, 1.5, 3.0, 8.0, 64.0]
            .iter()
            .map(|f| {
                let limit = m.fixed_bytes + ((peak - m.fixed_bytes) as f64 * f) as usize;
                PlannerConfig { memory_limit: Some(limit), ..free.clone() }
            })
            .find(|c| plan(&lat, c).is_ok())
            .expect("a limit some slicing meets");
        out.push(Case { name: format!("L{len}_K{k}_B{batch}_1f1b_limit"), latency: lat, config });
    }
    out
}

fn report(cases: &[Case]) {
    eprintln!("| case | search | ms (one run) | candidates | DP solves | plan |");
    eprintln!("|---|---|---|---|---|---|");
    for c in cases {
        let mut searches = vec![Search::BranchAndBound];
        // The scan takes seconds beyond this (16 s for L = 2048, K = 8, B = 8 here).
        if c.config.seq_len <= 2048 && c.config.batch == 1 && c.config.memory_limit.is_none() {
            searches.push(Search::Scan);
        }
        for search in searches {
            let config = PlannerConfig { search, ..c.config.clone() };
            let t = Instant::now();
            let p = plan(&c.latency, &config).expect("plan");
            let ms = t.elapsed().as_secs_f64() * 1e3;
            eprintln!("| {} | {search:?} | {ms:.1} | {} | {} | {p} |", c.name, p.stats.candidates, p.stats.evaluated);
        }
    }
}

fn bench_plan(c: &mut Criterion) {
    let cases = cases();
    // Timed once each, seconds in all (criterion runs each case once in the test suite).
    if pipetransformer::bench::under_cargo_bench() {
        report(&cases);
    }
    let mut g = c.benchmark_group("terapipe_plan");
    g.sample_size(10);
    for case in &cases {
        g.bench_function(&case.name, |b| b.iter(|| plan(black_box(&case.latency), black_box(&case.config)).unwrap()));
    }
    g.finish();
}

criterion_group!(benches, bench_plan);
criterion_main!(benches);
