//! The pipeline runtime on `cpu` devices (one thread each; run on a machine with at least as
//! many cores as devices):
//!
//! 1. measured bubble against the schedule's formula, GPipe and 1F1B, with stages balanced by
//!    measured unit times, and the measured step against the cluster simulator's (the plan's
//!    schedule played against the same unit profiles, free links);
//! 2. the runtime's own cost per action (sends and all-reduce starts of small tensors);
//! 3. the in-process ring all-reduce against a plain memory copy of the same bytes;
//! 4. the process group's TCP ring (what `pipetransformer launch` sums gradients with; here its
//!    members are threads talking over loopback, the same sockets separate processes use) against
//!    the in-process ring, and the time for a group to meet at the rendezvous.
//!
//! `cargo bench --bench pipeline` prints a markdown report (docs/PERF.md records it);
//! `cargo bench --bench pipeline -- process-group` (or `bubble`, `all-reduce`) runs one section.

use pipetransformer::comm::ring_group;
use pipetransformer::device::CpuDevice;
use pipetransformer::model::{GptConfig, Model, ModelConfig};
use pipetransformer::optim::OptimizerConfig;
use pipetransformer::pipeline::{CostModel, Link, profile_units, simulate};
use pipetransformer::pipeline::{Pipeline, PipelineConfig, ScheduleKind};
use std::sync::Barrier;
use std::time::Instant;

fn main() {
    if !pipetransformer::bench::under_cargo_bench() {
        println!("benchmarks run under `cargo bench`");
        return;
    }
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let k = cores.clamp(1, 4);
    println!("# pipeline runtime on {cores} cores: {k} cpu devices of 1 thread\n");
    // Cargo passes `--bench`; any other argument names the sections to run.
    let wanted: Vec<String> = std::env::args().skip(1).filter(|a| !a.starts_with("--")).collect();
    let run = |name: &str| wanted.is_empty() || wanted.iter().any(|w| w == name);
    if run("bubble") {
        bubble(k);
    }
    if run("all-reduce") {
        all_reduce();
    }
    if run("process-group") {
        process_group();
    }
}

/// The TCP ring of `pipetransformer launch` against the in-process ring, same members and bytes.
fn process_group() {
    use pipetransformer::comm::process_group::ProcessGroup;
    use pipetransformer::comm::rendezvous::Secret;
    println!("\n## process group (TCP ring over loopback) vs the in-process ring\n");
    println!("| members | MiB per member | meet ms | TCP ring ms | GB/s | in-process ring ms | GB/s |");
    println!("|---|---|---|---|---|---|---|");
    for members in [2, 4] {
        let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let (addr, secret) = (format!("127.0.0.1:{port}"), Secret::random().unwrap());
        let t = Instant::now();
        let group: Vec<ProcessGroup> = std::thread::scope(|s| {
            let hs: Vec<_> = (0..members)
                .map(|r| {
                    let (addr, secret) = (&addr, &secret);
                    s.spawn(move || {
                        ProcessGroup::join(addr, r, members, secret, std::time::Duration::from_secs(30)).unwrap()
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        let meet = t.elapsed().as_secs_f64();
        let ring = ring_group(members);
        for mib in [1usize, 16, 86] {
            let n = mib * (1 << 20) / 4;
            // Each member's time from when all are ready (spawned, data allocated): a member
            // that started early would otherwise count its wait for the others.
            let median = |f: &(dyn Fn(usize, &Barrier) -> f64 + Sync)| {
                let mut times: Vec<f64> = (0..5)
                    .map(|_| {
                        let ready = Barrier::new(members);
                        std::thread::scope(|s| {
                            let ready = &ready;
                            let hs: Vec<_> = (0..members).map(|m| s.spawn(move || f(m, ready))).collect();
                            hs.into_iter().map(|h| h.join().unwrap()).fold(0.0, f64::max)
                        })
                    })
                    .collect();
                times.sort_by(f64::total_cmp);
                times[times.len() / 2]
            };
            let tcp = median(&|m, ready| {
                let mut data = vec![1.0f32; n];
                ready.wait();
                let t = Instant::now();
                group[m].all_reduce_sum_f32(&mut data).unwrap();
                t.elapsed().as_secs_f64()
            });
            let in_process = median(&|m, ready| {
                let mut data = vec![1.0f32; n];
                ready.wait();
                let t = Instant::now();
                ring[m].all_reduce_host(&mut data).unwrap();
                t.elapsed().as_secs_f64()
            });
            let bytes = (n * 4) as f64;
            println!(
                "| {members} | {mib} | {:.1} | {:.1} | {:.2} | {:.1} | {:.2} |",
                meet * 1e3,
                tcp * 1e3,
                bytes / tcp / 1e9,
                in_process * 1e3,
                bytes / in_process / 1e9
            );
        }
    }
}

/// A GPT of identical blocks: embedding and head are small next to a block, so a balanced
/// split exists.
fn model_config() -> ModelConfig {
    ModelConfig::Gpt(GptConfig::without_dropout(64, 64, 256, 4 * 2, 4))
}

fn bubble(k: usize) {
    let config = model_config();
    println!("## bubble: measured vs formula (idle fraction of the step, GPipe convention)\n");
    println!(
        "| schedule | K | M | step ms | pipelined part ms | simulated ms | measured bubble | simulated | formula | difference | mean non-compute action µs |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|---|");
    for schedule in [ScheduleKind::Gpipe, ScheduleKind::OneFOneB] {
        for m in [2 * k, 4 * k] {
            let devices: Vec<CpuDevice<f32>> = (0..k).map(|i| CpuDevice::new(i, 1).unwrap()).collect();
            let mut model = Model::new(&devices[0], &config, 1).unwrap();
            let micro = 4;
            let host = pipetransformer::model::HostBatch::random(&config, micro * m, 64, 2);
            let profiles = profile_units(&devices[0], &mut model, &host.split(m).unwrap()[0], 3).unwrap();
            let plan = PipelineConfig { pipeline_len: k, micro_batches: m, schedule, ..Default::default() };
            let mut p = Pipeline::new(devices, model, OptimizerConfig::adamw(), plan, &profiles).unwrap();
            p.step(&host, 1, 1e-4, None).unwrap(); // warm-up: buffer pools
            let mut runs: Vec<(f64, f64, f64, f64)> = (0..5)
                .map(|i| {
                    let t = Instant::now();
                    let s = p.step(&host, 2 + i, 1e-4, None).unwrap();
                    let trace = &s.trace;
                    (t.elapsed().as_secs_f64(), trace.pipeline_end(), trace.bubble(), trace.mean_overhead())
                })
                .collect();
            runs.sort_by(|a, b| a.0.total_cmp(&b.0));
            let (secs, pipelined, measured, overhead) = runs[runs.len() / 2];
            let formula = p.plan().schedule.bubble_formula();
            // The simulator's step: what the profiles the plan was cut from predict, before
            // the runtime's own costs (transfers, the step's tail).
            let costs = CostModel::from_profiles(p.plan(), &profiles, Link::INSTANT).unwrap();
            let simulated = simulate(&p.plan().schedule, &costs).unwrap();
            println!(
                "| {schedule} | {k} | {m} | {:.1} | {:.1} | {:.1} | {:.1}% | {:.1}% | {:.1}% | {:+.1} pp | {:.1} |",
                secs * 1e3,
                pipelined * 1e3,
                simulated.makespan() * 1e3,
                100.0 * measured,
                100.0 * simulated.bubble(),
                100.0 * formula,
                100.0 * (measured - formula),
                overhead * 1e6
            );
        }
    }
    println!();
}

fn all_reduce() {
    println!("## ring all-reduce (in-process) vs a memory copy of the same bytes\n");
    println!("| members | MiB per member | all-reduce ms | algorithm GB/s | memcpy GB/s |");
    println!("|---|---|---|---|---|");
    for members in [2, 3, 4] {
        for mib in [1usize, 16, 64] {
            let n = mib * (1 << 20) / 4;
            let ring = ring_group(members);
            let mut times: Vec<f64> = (0..5)
                .map(|_| {
                    let ready = Barrier::new(members);
                    std::thread::scope(|s| {
                        let ready = &ready;
                        let hs: Vec<_> = ring
                            .iter()
                            .map(|m| {
                                s.spawn(move || {
                                    let mut data = vec![1.0f32; n];
                                    ready.wait();
                                    let t = Instant::now();
                                    m.all_reduce_host(&mut data).unwrap();
                                    t.elapsed().as_secs_f64()
                                })
                            })
                            .collect();
                        hs.into_iter().map(|h| h.join().unwrap()).fold(0.0, f64::max)
                    })
                })
                .collect();
            times.sort_by(f64::total_cmp);
            let secs = times[times.len() / 2];
            let src = vec![1.0f32; n];
            let mut dst = vec![0.0f32; n];
            let mut copies: Vec<f64> = (0..5)
                .map(|_| {
                    let t = Instant::now();
                    dst.copy_from_slice(std::hint::black_box(&src));
                    std::hint::black_box(&dst);
                    t.elapsed().as_secs_f64()
                })
                .collect();
            copies.sort_by(f64::total_cmp);
            let bytes = (n * 4) as f64;
            // Algorithm bandwidth: the bytes each member contributes over the time to sum them.
            println!(
                "| {members} | {mib} | {:.2} | {:.2} | {:.2} |",
                secs * 1e3,
                bytes / secs / 1e9,
                bytes / copies[copies.len() / 2] / 1e9
            );
        }
    }
}
