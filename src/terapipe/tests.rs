//! The planner against brute force: every composition of the sequence's grid units, every split
//! of the batch, every memory rule, on small cases; plus the closed forms, the search variants
//! and the error paths.

use super::*;
use crate::rng::{Rng, hash_u64};

const STEP: usize = 8;

fn grid(units: usize, max_batch: usize) -> LatencyGrid {
    LatencyGrid { step: STEP, max_len: units * STEP, max_batch }
}

fn unit_hash(seed: u64, b: usize, l: usize, c: usize) -> f64 {
    (hash_u64(seed, ((b as u64 * 1_000_003) + l as u64) * 1_000_003 + c as u64) >> 11) as f64 / (1u64 << 53) as f64
}

/// Unstructured: every (b, l, c) an independent draw (not monotone in anything).
fn random_latency(seed: u64, units: usize, max_batch: usize) -> LatencyModel {
    LatencyModel::from_fn(grid(units, max_batch), move |b, l, c| 0.1 + unit_hash(seed, b, l, c)).unwrap()
}

/// TeraPipe's shape: `α + β·b·l + γ·b·l·c` plus a little noise, coefficients drawn per seed.
fn structured_latency(seed: u64, units: usize, max_batch: usize) -> LatencyModel {
    let mut r = Rng::new(seed);
    let (alpha, beta, gamma, noise) = (r.uniform() * 2.0, r.uniform() * 0.05, r.uniform() * 1e-3, 0.01);
    LatencyModel::from_fn(grid(units, max_batch), move |b, l, c| {
        let (b, l, c) = (b as f64, l as f64, c as f64);
        alpha + beta * b * l + gamma * b * l * c + noise * unit_hash(seed, b as usize, l as usize, c as usize)
    })
    .unwrap()
}

/// Every composition of `n` (the slice lengths of one sequence, in units).
fn compositions(n: usize) -> Vec<Vec<usize>> {
    (0..1u32 << (n - 1))
        .map(|cuts| {
            let (mut out, mut len) = (Vec::new(), 1);
            for i in 0..n - 1 {
                if cuts >> i & 1 == 1 {
                    out.push(len);
                    len = 1;
                } else {
                    len += 1;
                }
            }
            out.push(len);
            out
        })
        .collect()
}

/// Every split of `b` into non-increasing parts (the micro-batch order does not matter).
fn partitions(b: usize, most: usize) -> Vec<Vec<usize>> {
    if b == 0 {
        return vec![vec![]];
    }
    (1..=most.min(b))
        .flat_map(|first| {
            partitions(b - first, first).into_iter().map(move |mut rest| {
                rest.insert(0, first);
                rest
            })
        })
        .collect()
}

/// (summed time, largest time, activation bytes per sample) of each slicing of one micro-batch
/// of `b` sequences that the memory rule admits, reduced to the non-dominated ones (the
/// objective and the GPipe limit only grow with each).
fn options(lat: &LatencyModel, b: usize, n: usize, config: &PlannerConfig) -> Vec<(f64, f64, f64)> {
    let memory = one_stage_memory(config);
    let mut all = Vec::new();
    for comp in compositions(n) {
        let (mut c, mut sum, mut max, mut bytes) = (0, 0.0, 0.0f64, 0.0);
        for &k in &comp {
            let (l, ctx) = (k * STEP, c * STEP);
            let t = lat.slice_time(b, l, ctx).unwrap();
            sum += t;
            max = max.max(t);
            bytes += memory.slice_bytes(1, l, ctx);
            c += k;
        }
        all.push((sum, max, bytes));
    }
    let dominated = |a: &(f64, f64, f64), o: &(f64, f64, f64)| o.0 <= a.0 && o.1 <= a.1 && o.2 <= a.2 && o != a;
    let mut kept: Vec<(f64, f64, f64)> = all.iter().filter(|a| !all.iter().any(|o| dominated(a, o))).copied().collect();
    kept.sort_by(|a, b| a.partial_cmp(b).unwrap());
    kept.dedup();
    kept
}

/// The one stage's memory model these enumerations take (none: nothing kept).
fn one_stage_memory(config: &PlannerConfig) -> MemoryModel {
    assert!(config.memory.len() <= 1, "the enumeration of split batches takes one stage's memory");
    config.memory.first().copied().unwrap_or_default()
}

/// The optimum by enumeration: every batch split, every (non-dominated) slicing of each
/// micro-batch. `None` when nothing meets the memory limit.
fn brute_force(lat: &LatencyModel, config: &PlannerConfig) -> Option<f64> {
    let n = config.seq_len / STEP;
    let per_size: Vec<Vec<(f64, f64, f64)>> = (1..=config.batch).map(|b| options(lat, b, n, config)).collect();
    let mut best: Option<f64> = None;
    for split in partitions(config.batch, config.batch) {
        let mut stack = vec![(0usize, 0.0f64, 0.0f64, 0.0f64)];
        while let Some((depth, sum, max, bytes)) = stack.pop() {
            if depth == split.len() {
                // Every sequence resident: GPipe's peak, and 1F1B's bound per micro-batch.
                if let Some(limit) = config.memory_limit
                    && one_stage_memory(config).fixed_bytes as f64 + bytes > limit as f64
                {
                    continue;
                }
                let t = sum + (config.stages - 1) as f64 * max;
                best = Some(best.map_or(t, |b| b.min(t)));
                continue;
            }
            let b = split[depth];
            for &(s, m, by) in &per_size[b - 1] {
                stack.push((depth + 1, sum + s, max.max(m), bytes + b as f64 * by));
            }
        }
    }
    best
}

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() <= 1e-12 * a.abs().max(b.abs())
}

/// Plans with every search variant, checks the variants agree (serial == parallel exactly) and
/// that the plan is well-formed and scores what it claims; returns the default plan.
fn plan_checked(lat: &LatencyModel, config: &PlannerConfig) -> SlicingPlan {
    let p = plan(lat, config).unwrap();
    let serial = plan(lat, &PlannerConfig { parallel: false, ..config.clone() }).unwrap();
    assert_eq!(p, serial, "parallel and serial branch-and-bound differ");
    let scan = plan(lat, &PlannerConfig { search: Search::Scan, ..config.clone() }).unwrap();
    let scan_serial = plan(lat, &PlannerConfig { search: Search::Scan, parallel: false, ..config.clone() }).unwrap();
    assert_eq!(scan, scan_serial, "parallel and serial scan differ");
    assert!(close(p.predicted_step_seconds, scan.predicted_step_seconds), "{p} vs scan {scan}");
    assert_eq!(p.micro_batches.iter().map(|m| m.samples).sum::<usize>(), config.batch);
    for m in &p.micro_batches {
        assert_eq!(m.slices.iter().sum::<usize>(), config.seq_len, "{p}");
        assert!(m.slices.iter().all(|&l| l > 0 && l % STEP == 0));
    }
    let again = predict_step_seconds(lat, config.stages, &p.micro_batches).unwrap();
    assert!(close(again, p.predicted_step_seconds), "plan scores {again}, claims {}", p.predicted_step_seconds);
    if let Some(limit) = config.memory_limit {
        assert!(p.peak_memory_bytes <= limit, "peak {} over limit {limit}: {p}", p.peak_memory_bytes);
    }
    p
}

#[test]
fn token_only_matches_brute_force() {
    for seed in 0..3 {
        for units in [1, 2, 5, 8, 12] {
            for k in [1, 2, 4, 8] {
                for (name, lat) in
                    [("random", random_latency(seed, units, 1)), ("structured", structured_latency(seed, units, 1))]
                {
                    let config = PlannerConfig::new(k, units * STEP, 1);
                    let p = plan_checked(&lat, &config);
                    let want = brute_force(&lat, &config).unwrap();
                    assert!(
                        close(p.predicted_step_seconds, want),
                        "{name} seed {seed} N {units} K {k}: DP {} brute {want}: {p}",
                        p.predicted_step_seconds
                    );
                }
            }
        }
    }
}

#[test]
fn joint_batch_and_tokens_match_brute_force() {
    for seed in 0..2 {
        for (units, batch) in [(3, 4), (6, 2), (6, 3), (8, 4), (10, 2)] {
            for k in [1, 2, 4, 8] {
                for (name, lat) in [
                    ("random", random_latency(seed + 10, units, batch)),
                    ("structured", structured_latency(seed + 10, units, batch)),
                ] {
                    let config = PlannerConfig::new(k, units * STEP, batch);
                    let p = plan_checked(&lat, &config);
                    let want = brute_force(&lat, &config).unwrap();
                    assert!(
                        close(p.predicted_step_seconds, want),
                        "{name} seed {seed} N {units} B {batch} K {k}: DP {} brute {want}: {p}",
                        p.predicted_step_seconds
                    );
                }
            }
        }
    }
}

#[test]
fn uniform_slices_give_the_gpipe_formula() {
    // t ∝ b·l: slicing is free, so every unit its own slice and every sequence its own
    // micro-batch: M = B·N equal units, (M + K − 1)·τ.
    // τ a power of two: every sum is exact, so equal objectives are equal floats and the
    // tie-break (smaller largest slice) decides for K = 1.
    let (units, batch, tau) = (16, 3, 1.0 / 1024.0);
    let lat = LatencyModel::from_fn(grid(units, batch), move |b, l, _| tau * (b * l / STEP) as f64).unwrap();
    for k in [1, 2, 4, 8] {
        let p = plan_checked(&lat, &PlannerConfig::new(k, units * STEP, batch));
        let want = (batch * units + k - 1) as f64 * tau;
        assert!(close(p.predicted_step_seconds, want), "K {k}: {p}");
        assert_eq!(p.micro_batches, vec![MicroBatchSlicing { samples: 1, slices: vec![STEP; units] }; batch]);
    }
    // A constant slice time: one slice, K·τ.
    let lat = LatencyModel::from_fn(grid(units, 1), move |_, _, _| tau).unwrap();
    let p = plan_checked(&lat, &PlannerConfig::new(4, units * STEP, 1));
    assert_eq!(p.micro_batches[0].slices, vec![units * STEP]);
    assert!(close(p.predicted_step_seconds, 4.0 * tau));
}

/// A latency where slicing costs a lot per slice, so without a limit the best plan is one
/// slice; and activations with a large attention-score term, so one slice needs the most memory.
fn memory_case(units: usize, batch: usize) -> (LatencyModel, MemoryModel) {
    let lat =
        LatencyModel::from_fn(grid(units, batch), |b, l, c| 1.0 + 1e-3 * (b * l) as f64 + 1e-6 * (b * l * c) as f64)
            .unwrap();
    (lat, MemoryModel { per_token_bytes: 100.0, per_score_bytes: 10.0, fixed_bytes: 1_000_000, ..Default::default() })
}

#[test]
fn gpipe_memory_limit_is_exact_and_changes_the_answer() {
    let (units, batch) = (8, 2);
    let (lat, memory) = memory_case(units, batch);
    let free =
        plan_checked(&lat, &PlannerConfig { memory: vec![memory], ..PlannerConfig::new(4, units * STEP, batch) });
    assert_eq!(free.slice_count(), 1, "{free}");
    let whole = free.peak_memory_bytes;
    let finest = memory.fixed_bytes as f64
        + batch as f64 * (0..units).map(|j| memory.slice_bytes(1, STEP, j * STEP)).sum::<f64>();
    for frac in [0.05, 0.3, 0.6, 0.9] {
        let limit = (finest + frac * (whole as f64 - finest)) as usize;
        let config = PlannerConfig {
            memory: vec![memory],
            memory_limit: Some(limit),
            ..PlannerConfig::new(4, units * STEP, batch)
        };
        let p = plan_checked(&lat, &config);
        let want = brute_force(&lat, &config).unwrap();
        assert!(close(p.predicted_step_seconds, want), "limit {limit}: DP {p}, brute {want}");
        assert!(p.predicted_step_seconds > free.predicted_step_seconds && p.slice_count() > 1, "{p}");
    }
    // Random latencies and several limits, against brute force (the constrained DPs prune with
    // bounds, and a bound that disagrees with the Pareto filter loses plans only in some cases).
    for seed in 0..4 {
        for (units, batch, k) in [(6, 1, 2), (6, 3, 4), (8, 2, 8), (5, 3, 1), (6, 4, 8), (7, 4, 2)] {
            let lat = if seed % 2 == 0 {
                structured_latency(seed + 20, units, batch)
            } else {
                random_latency(seed + 20, units, batch)
            };
            let mem =
                MemoryModel { per_token_bytes: 50.0, per_score_bytes: 3.0, fixed_bytes: 4096, ..Default::default() };
            let finest = mem.fixed_bytes as f64
                + batch as f64 * (0..units).map(|j| mem.slice_bytes(1, STEP, j * STEP)).sum::<f64>();
            let most = mem.fixed_bytes as f64 + batch as f64 * mem.slice_bytes(1, units * STEP, 0);
            for frac in [0.02, 0.1, 0.2, 0.35, 0.5, 0.8] {
                let limit = (finest + frac * (most - finest)) as usize;
                let config = PlannerConfig {
                    memory: vec![mem],
                    memory_limit: Some(limit),
                    ..PlannerConfig::new(k, units * STEP, batch)
                };
                let p = plan_checked(&lat, &config);
                let want = brute_force(&lat, &config).unwrap();
                assert!(close(p.predicted_step_seconds, want), "seed {seed} limit {limit}: DP {p}, brute {want}");
            }
        }
    }
}

/// Under 1F1B over slices a stage holds `K` micro-batches, every slice of each: micro-batches
/// sharing one slicing count `min(K, M)` copies against the limit (a limit GPipe's `M` copies
/// cannot meet is met, and the reported peak is those copies'); planned per micro-batch, every
/// sequence is counted, as the enumeration counts them.
#[test]
fn one_f_one_b_holds_k_micro_batches() {
    let (units, m, k) = (8, 4, 2);
    let (lat, memory) = memory_case(units, 1);
    let finest = |copies: usize| {
        memory.fixed_bytes as f64
            + copies as f64 * (0..units).map(|j| memory.slice_bytes(1, STEP, j * STEP)).sum::<f64>()
    };
    let limit = ((finest(k) + finest(m)) / 2.0) as usize;
    let shared = |schedule| PlannerConfig {
        memory: vec![memory],
        memory_limit: Some(limit),
        schedule,
        shared: true,
        ..PlannerConfig::new(k, units * STEP, m)
    };
    let e = plan(&lat, &shared(SliceSchedule::Gpipe)).unwrap_err().to_string();
    assert!(e.contains("no slicing meets the memory limit") && e.contains("GPipe"), "{e}");
    let config = shared(SliceSchedule::OneFOneB);
    let p = plan_checked(&lat, &config);
    assert!(close(p.predicted_step_seconds, shared_brute_force(&lat, &config).unwrap()), "{p}");
    let one: Vec<f64> = {
        let mut c = 0;
        p.micro_batches[0].slices.iter().map(|&l| (memory.slice_bytes(1, l, c), c += l).0).collect()
    };
    let want = (memory.fixed_bytes as f64 + k as f64 * one.iter().sum::<f64>()).ceil() as usize;
    assert_eq!(p.peak_memory_bytes, want, "{p}");
    for seed in 0..3 {
        for (units, batch, k) in [(6, 1, 2), (6, 3, 4), (8, 2, 3), (7, 2, 8)] {
            let lat = structured_latency(seed + 30, units, batch);
            let mem =
                MemoryModel { per_token_bytes: 50.0, per_score_bytes: 3.0, fixed_bytes: 4096, ..Default::default() };
            let most = mem.fixed_bytes as f64 + batch as f64 * mem.slice_bytes(1, units * STEP, 0);
            for frac in [0.3, 0.6, 1.0] {
                let limit = (most * frac) as usize;
                let config = PlannerConfig {
                    memory: vec![mem],
                    memory_limit: Some(limit),
                    schedule: SliceSchedule::OneFOneB,
                    ..PlannerConfig::new(k, units * STEP, batch)
                };
                match (plan(&lat, &config), brute_force(&lat, &config)) {
                    (Ok(_), Some(want)) => {
                        let p = plan_checked(&lat, &config);
                        assert!(close(p.predicted_step_seconds, want), "seed {seed} limit {limit}: {p}, brute {want}");
                    }
                    (Err(e), None) => assert!(e.to_string().contains("no slicing meets the memory limit"), "{e}"),
                    (got, want) => panic!("planner {got:?}, brute force {want:?}"),
                }
            }
        }
    }
}

/// The key/value arenas only a sliced plan keeps (`sliced_bytes`) are not charged to the
/// unsliced one, which keeps its keys and values with its activations instead
/// (`unsliced_bytes`): under a limit that fits it alone, it is the plan (the arenas once made
/// that limit refuse every plan), and its reported peak counts its keys and values, not the
/// arenas.
#[test]
fn an_unsliced_plan_keeps_its_keys_and_values_but_no_arena() {
    let (units, m) = (8, 2);
    let (lat, memory) = memory_case(units, 1);
    let memory = MemoryModel { sliced_bytes: 80_000, unsliced_bytes: 20_000, ..memory };
    let whole = (memory.fixed_bytes + memory.unsliced_bytes) as f64 + m as f64 * memory.slice_bytes(1, units * STEP, 0);
    for schedule in [SliceSchedule::Gpipe, SliceSchedule::OneFOneB] {
        let config = |limit: usize| PlannerConfig {
            memory: vec![memory],
            memory_limit: Some(limit),
            schedule,
            shared: true,
            ..PlannerConfig::new(2, units * STEP, m)
        };
        let p = plan(&lat, &config(whole.ceil() as usize)).unwrap();
        assert!(p.micro_batches.iter().all(|mb| mb.slices == [units * STEP]), "{schedule}: {p}");
        assert_eq!(p.peak_memory_bytes, whole.ceil() as usize, "{schedule}: {p}");
        let e = plan(&lat, &config(whole.ceil() as usize - 1)).unwrap_err().to_string();
        assert!(e.contains("no slicing meets the memory limit"), "{schedule}: {e}");
        // Sliced plans pay the arenas in their peak.
        let sliced = vec![MicroBatchSlicing { samples: 1, slices: vec![STEP; units] }; m];
        let finest = memory.fixed_bytes as f64
            + memory.sliced_bytes as f64
            + m as f64 * (0..units).map(|j| memory.slice_bytes(1, STEP, j * STEP)).sum::<f64>();
        assert_eq!(peak_memory_bytes(&config(usize::MAX), &sliced), finest.ceil() as usize, "{schedule}");
    }
}

#[test]
fn memory_limits_nothing_meets_are_refused() {
    let (units, batch) = (8, 2);
    let (lat, memory) = memory_case(units, batch);
    let finest = memory.fixed_bytes as f64
        + batch as f64 * (0..units).map(|j| memory.slice_bytes(1, STEP, j * STEP)).sum::<f64>();
    let config = PlannerConfig {
        memory: vec![memory],
        memory_limit: Some(finest as usize - 1),
        ..PlannerConfig::new(4, units * STEP, batch)
    };
    let e = plan(&lat, &config).unwrap_err().to_string();
    let needs = format!("needs at least {} bytes (", finest.ceil());
    assert!(
        e.contains("no slicing meets the memory limit") && e.contains(&needs) && e.contains("; finest slicing"),
        "{e}"
    );
    assert!(e.contains(&format!("limit {}", finest as usize - 1)), "{e}");
    // Exactly the finest slicing's bytes is enough.
    let ok = PlannerConfig { memory_limit: Some(finest.ceil() as usize), ..config.clone() };
    let p = plan_checked(&lat, &ok);
    assert!(p.micro_batches.iter().all(|m| m.slices == vec![STEP; units]), "{p}");
    let one = PlannerConfig { schedule: SliceSchedule::OneFOneB, memory_limit: Some(1_000_000), ..config };
    let e = plan(&lat, &one).unwrap_err().to_string();
    assert!(e.contains("no slicing meets the memory limit") && e.contains("1F1B"), "{e}");
}

#[test]
fn realistic_sizes_agree_across_searches() {
    // 512 tokens = 64 units, two sequences, a TeraPipe-like latency.
    let units = 64;
    let lat = LatencyModel::from_fn(grid(units, 2), |b, l, c| {
        let n = (b * l) as f64;
        5e-4 + 2e-6 * n + 1e-9 * n * c as f64 + 5e-5 + 1e-9 * n
    })
    .unwrap();
    for k in [2, 8, 48] {
        for batch in [1, 2] {
            let config = PlannerConfig::new(k, units * STEP, batch);
            let p = plan_checked(&lat, &config);
            let scan = plan(&lat, &PlannerConfig { search: Search::Scan, ..config.clone() }).unwrap();
            assert_eq!(p.micro_batches, scan.micro_batches, "K {k} B {batch}");
            // ε-merging stays within (K − 1)·ε.
            let eps = 2e-5;
            let approx = plan(&lat, &PlannerConfig { epsilon: eps, ..config.clone() }).unwrap();
            assert!(approx.predicted_step_seconds >= p.predicted_step_seconds);
            assert!(approx.predicted_step_seconds <= p.predicted_step_seconds + (k - 1) as f64 * eps + 1e-15);
            assert!(approx.stats.candidates <= p.stats.candidates);
            let again = predict_step_seconds(&lat, k, &approx.micro_batches).unwrap();
            assert!(close(again, approx.predicted_step_seconds));
        }
    }
}

#[test]
fn bad_input_is_refused_with_the_field() {
    let lat = random_latency(1, 8, 2);
    let ok = PlannerConfig::new(2, 64, 2);
    let cases = [
        (PlannerConfig { seq_len: 0, ..ok.clone() }, "terapipe.seq_len"),
        (PlannerConfig { seq_len: 60, ..ok.clone() }, "terapipe.seq_len"),
        (PlannerConfig { seq_len: 72, ..ok.clone() }, "terapipe.seq_len"),
        (PlannerConfig { stages: 0, ..ok.clone() }, "terapipe.stages"),
        (PlannerConfig { batch: 0, ..ok.clone() }, "terapipe.batch"),
        (PlannerConfig { batch: 3, ..ok.clone() }, "terapipe.batch"),
        (PlannerConfig { epsilon: -1.0, ..ok.clone() }, "terapipe.epsilon"),
        (PlannerConfig { epsilon: f64::NAN, ..ok.clone() }, "terapipe.epsilon"),
        (
            PlannerConfig { memory: vec![MemoryModel { per_token_bytes: -1.0, ..Default::default() }], ..ok.clone() },
            "terapipe.memory.per_token_bytes",
        ),
    ];
    for (config, field) in cases {
        let e = plan(&lat, &config).unwrap_err().to_string();
        assert!(e.contains(field), "{config:?}: {e}");
    }
    let negative = LatencyModel::from_fn(grid(8, 1), |_, l, c| if c == 16 { -1.0 } else { l as f64 }).unwrap();
    let e = plan(&negative, &PlannerConfig::new(2, 64, 1)).unwrap_err().to_string();
    assert!(e.contains("context 16") && e.contains("non-negative"), "{e}");
    assert!(predict_step_seconds(&lat, 0, &[]).is_err());
    let mb = |s: usize, slices: Vec<usize>| MicroBatchSlicing { samples: s, slices };
    assert!(predict_step_seconds(&lat, 2, &[]).is_err());
    assert!(predict_step_seconds(&lat, 2, &[mb(1, vec![32, 32]), mb(1, vec![32])]).is_err());
    assert!(predict_step_seconds(&lat, 2, &[mb(1, vec![60, 12])]).is_err());
    // Off the grid, priced (a model given as a function at the slices' own lengths).
    let (a, b) = (0.1 + unit_hash(1, 1, 30, 0), 0.1 + unit_hash(1, 1, 34, 30));
    assert_eq!(predict_step_seconds(&lat, 2, &[mb(1, vec![30, 34])]).unwrap(), a + b + a.max(b));
}

#[test]
fn display_is_compact() {
    let p = SlicingPlan {
        micro_batches: vec![
            MicroBatchSlicing { samples: 2, slices: vec![512, 256, 256, 256, 128, 128, 512] },
            MicroBatchSlicing { samples: 2, slices: vec![512, 256, 256, 256, 128, 128, 512] },
            MicroBatchSlicing { samples: 4, slices: vec![2048] },
        ],
        predicted_step_seconds: 0.0506,
        max_slice_seconds: 0.00105,
        peak_memory_bytes: 3 << 30,
        stats: SearchStats::default(),
    };
    assert_eq!(
        p.to_string(),
        "2 × (2 seq: 512, 3×256, 2×128, 512 tokens) + (4 seq: 2048 tokens); 15 slices; predicted step 50.600 ms, \
         largest slice 1.050 ms (its forward and backward on one stage), peak memory 3.000 GiB per device"
    );
}

#[test]
fn ties_prefer_fewer_slices_then_the_lexicographically_smaller() {
    // Powers of two: sums are exact, ties are real. Units: t(1) = τ, t(2) = 2τ, except the last
    // unit alone costs 2τ; longer slices cost 1 s. With K = 2 the optimum is 6τ, by [2, 2] and by
    // [1, 1, 2]: fewer slices wins.
    let tau = 1.0 / 8.0;
    let lat = LatencyModel::from_fn(grid(4, 1), move |_, l, c| match (l / STEP, c / STEP) {
        (1, 3) => 2.0 * tau,
        (1, _) => tau,
        (2, _) => 2.0 * tau,
        _ => 1.0,
    })
    .unwrap();
    let p = plan_checked(&lat, &PlannerConfig::new(2, 32, 1));
    assert_eq!((p.micro_batches[0].slices.clone(), p.predicted_step_seconds), (vec![16, 16], 6.0 * tau));
    // [1, 2] and [2, 1] tie in everything: the lexicographically smaller wins.
    let lat = LatencyModel::from_fn(grid(3, 1), move |_, l, c| match (l / STEP, c / STEP) {
        (1, 0) | (1, 2) => tau,
        (2, 0) | (2, 1) => 2.0 * tau,
        _ => 1.0,
    })
    .unwrap();
    let p = plan_checked(&lat, &PlannerConfig::new(2, 24, 1));
    assert_eq!(p.micro_batches[0].slices, vec![8, 16], "{p}");
}

/// A length whose only divisors leave too coarse a grid (37 is prime: one grid unit) is
/// refused with that reason and a length that plans, not as "too short"; 36 measures.
#[test]
fn a_length_without_a_fine_grid_says_so() {
    use crate::model::{Model, ModelConfig, config::GptConfig};
    let dev = crate::device::CpuDevice::<f32>::new(0, 1).unwrap();
    let ModelConfig::Gpt(small) = crate::model::tiny::tiny_gpt(0.0) else { unreachable!() };
    let config = ModelConfig::Gpt(GptConfig { n_positions: 40, ..small });
    let mut model = Model::new(&dev, &config, 1).unwrap();
    let batch = |seq: usize| {
        let s = crate::data::LmSequence { id: 0, input: vec![1; seq], target: vec![2; seq] };
        crate::data::lm_batch(&[&s], 0).unwrap()
    };
    let err = measure_latency(&dev, &mut model, &batch(37), 1).unwrap_err().to_string();
    assert!(err.contains("the smallest, 37, leaves 1") && err.contains("such as 40"), "{err}");
    assert!(measure_latency(&dev, &mut model, &batch(36), 1).is_ok());
}

/// The optimum over slicings that all `M` micro-batches share, by enumeration: `M·Σ t +
/// (K − 1)·max t` over one sequence's admitted slicings, the GPipe limit counting `M` copies.
fn shared_brute_force(lat: &LatencyModel, config: &PlannerConfig) -> Option<f64> {
    let (n, m) = (config.seq_len / STEP, config.batch as f64);
    // Resident at once: every copy under GPipe, K of them under 1F1B.
    let resident = match config.schedule {
        SliceSchedule::Gpipe => m,
        SliceSchedule::OneFOneB => m.min(config.stages as f64),
    };
    // Every stage's memory within the limit.
    let fits = |slices: &[usize]| {
        config.memory_limit.is_none_or(|limit| {
            config.memory.iter().all(|mem| {
                let mut c = 0;
                let bytes: f64 = slices.iter().map(|&k| (mem.slice_bytes(1, k * STEP, c * STEP), c += k).0).sum();
                mem.fixed_bytes as f64 + resident * bytes <= limit as f64
            })
        })
    };
    compositions(n)
        .into_iter()
        .filter(|comp| fits(comp))
        .map(|comp| {
            let mut c = 0;
            let times: Vec<f64> =
                comp.iter().map(|&k| (lat.slice_time(1, k * STEP, c * STEP).unwrap(), c += k).0).collect();
            let max = times.iter().copied().fold(0.0, f64::max);
            m * times.iter().sum::<f64>() + (config.stages - 1) as f64 * max
        })
        .min_by(f64::total_cmp)
}

/// Micro-batches that share one slicing (what the runtime runs): the planner's shared mode
/// against enumeration, with and without limits under both schedules. Under a GPipe limit the
/// per-micro-batch optimum can trade memory between micro-batches; the best shared slicing is
/// then none of its slicings (a review's case: 3 units, M = 2, K = 1).
#[test]
fn a_shared_slicing_matches_brute_force() {
    // Time per (length, context) in units; two copies cost twice one.
    let t = |l: usize, c: usize| match (l / STEP, c / STEP) {
        (1, 0) => 0.5,
        (2, 1) => 5.0,
        _ => 1.0,
    };
    let lat = LatencyModel::from_fn(grid(3, 2), move |b, l, c| b as f64 * t(l, c)).unwrap();
    let memory = MemoryModel { per_token_bytes: 0.0, per_score_bytes: 1.0, fixed_bytes: 0, ..Default::default() };
    // Σ over the two micro-batches of (L² + Σ l²)/2 bytes at most (2·24² + 64·12)/2.
    let config = PlannerConfig { memory: vec![memory], memory_limit: Some(960), ..PlannerConfig::new(1, 3 * STEP, 2) };
    let each = plan_checked(&lat, &config);
    assert_eq!(each.predicted_step_seconds, 3.5, "one whole, one in three: {each}");
    let shared = plan_checked(&lat, &PlannerConfig { shared: true, ..config.clone() });
    assert_eq!(shared.predicted_step_seconds, 4.0, "{shared}");
    assert!(shared.micro_batches.iter().all(|m| m.slices == [16, 8]), "{shared}");
    // What the runtime is given (`plan_slices` after measuring): the shared plan, in sequences.
    let pipeline = crate::pipeline::PipelineConfig {
        pipeline_len: 1,
        micro_batches: 2,
        schedule: crate::pipeline::ScheduleKind::Gpipe,
        memory_limit: Some(960),
        ..Default::default()
    };
    let run = shared_slicing(&lat, &[memory], 3 * STEP, 5, &pipeline).unwrap();
    assert_eq!(run.predicted_step_seconds, 4.0, "{run}");
    assert!(run.micro_batches.iter().all(|m| m.slices == [16, 8] && m.samples == 5), "{run}");
    for seed in 0..3 {
        for (units, m, k) in [(5, 2, 2), (6, 3, 4), (7, 4, 1), (8, 2, 8), (4, 5, 3)] {
            let lat = if seed % 2 == 0 {
                structured_latency(seed + 40, units, 1)
            } else {
                random_latency(seed + 40, units, 1)
            };
            let mem =
                MemoryModel { per_token_bytes: 50.0, per_score_bytes: 3.0, fixed_bytes: 4096, ..Default::default() };
            // Odd seeds: a second stage that keeps more per token and less in weights.
            let other =
                MemoryModel { per_token_bytes: 120.0, per_score_bytes: 1.0, fixed_bytes: 1024, ..Default::default() };
            let stages = if seed % 2 == 1 { vec![mem, other] } else { vec![mem] };
            let peak = |mem: &MemoryModel, slices: usize| {
                let l = units * STEP / slices;
                mem.fixed_bytes as f64 + m as f64 * (0..slices).map(|j| mem.slice_bytes(1, l, j * l)).sum::<f64>()
            };
            let finest = stages.iter().map(|s| peak(s, units)).fold(0.0, f64::max);
            let most = stages.iter().map(|s| peak(s, 1)).fold(0.0, f64::max);
            for schedule in [SliceSchedule::Gpipe, SliceSchedule::OneFOneB] {
                for limit in [None, Some(finest + 0.1 * (most - finest)), Some(finest + 0.5 * (most - finest))] {
                    let config = PlannerConfig {
                        memory: stages.clone(),
                        memory_limit: limit.map(|l| l as usize),
                        schedule,
                        shared: true,
                        ..PlannerConfig::new(k, units * STEP, m)
                    };
                    match (plan(&lat, &config), shared_brute_force(&lat, &config)) {
                        (Ok(_), Some(want)) => {
                            let p = plan_checked(&lat, &config);
                            assert!(p.micro_batches.windows(2).all(|w| w[0] == w[1]), "{p}");
                            assert!(
                                close(p.predicted_step_seconds, want),
                                "seed {seed} N {units} M {m} K {k} {schedule} {limit:?}: {p}, brute {want}"
                            );
                        }
                        (Err(e), None) => assert!(e.to_string().contains("no slicing meets"), "{e}"),
                        (got, want) => panic!("planner {got:?}, brute force {want:?}"),
                    }
                }
            }
        }
    }
}

/// Every stage runs the one slicing and each is held to the limit on its own: a stage that
/// keeps the embeddings' weights and one that keeps the head's logits per token can both fit
/// where a model with the most of each kind together (no stage's) does not. The reported peak
/// is the larger stage's.
#[test]
fn every_stage_is_held_to_the_limit_not_the_most_of_each_kind() {
    let units = 3;
    // A slice's fixed cost makes the whole sequence the plan without a limit.
    let lat = LatencyModel::from_fn(grid(units, 1), |b, l, c| 20.0 + (b * l) as f64 * (1.0 + 0.01 * c as f64)).unwrap();
    let weights = MemoryModel { per_token_bytes: 0.0, per_score_bytes: 1.0, fixed_bytes: 1000, ..Default::default() };
    let logits = MemoryModel { per_token_bytes: 20.0, per_score_bytes: 1.0, fixed_bytes: 0, ..Default::default() };
    let merged = MemoryModel { fixed_bytes: 1000, ..logits };
    let finest = |mem: &MemoryModel| {
        mem.fixed_bytes as f64 + (0..units).map(|j| mem.slice_bytes(1, STEP, j * STEP)).sum::<f64>()
    };
    let limit = finest(&weights).max(finest(&logits)).ceil() as usize;
    assert!(finest(&merged) > limit as f64);
    let config = |memory| PlannerConfig { memory, memory_limit: Some(limit), ..PlannerConfig::new(2, units * STEP, 1) };
    let free = plan_checked(&lat, &PlannerConfig { memory_limit: None, ..config(vec![weights, logits]) });
    assert_eq!(free.micro_batches[0].slices, [units * STEP], "{free}");
    let p = plan_checked(&lat, &config(vec![weights, logits]));
    let peak_of = |mem| peak_memory_bytes(&config(vec![mem]), &p.micro_batches);
    assert_eq!(p.peak_memory_bytes, peak_of(weights).max(peak_of(logits)), "{p}");
    assert!(p.peak_memory_bytes <= limit, "{p}");
    let e = plan(&lat, &config(vec![merged])).unwrap_err().to_string();
    assert!(e.contains("no slicing meets the memory limit"), "{e}");
    // A limit with no stage to hold it to is refused, not passed.
    let e = plan(&lat, &config(Vec::new())).unwrap_err().to_string();
    assert!(e.contains("terapipe.memory") && e.contains("a memory limit needs a memory model"), "{e}");
    // Refused, the need named is the stage that needs the most's, whichever fails first.
    let low = finest(&weights).min(finest(&logits)) as usize - 1;
    let tight = PlannerConfig { memory_limit: Some(low), ..config(vec![logits, weights]) };
    let e = plan(&lat, &tight).unwrap_err().to_string();
    assert!(e.contains(&format!("needs at least {limit} bytes (")) && e.contains("finest slicing"), "{e}");
    // Shared, whole sequences (no arenas) can need less than the finest slicing (with them).
    let arenas = MemoryModel { sliced_bytes: 5000, ..weights };
    let shared = PlannerConfig { memory: vec![arenas], memory_limit: Some(1000), shared: true, ..tight };
    let whole = peak_memory_bytes(&shared, &[MicroBatchSlicing { samples: 1, slices: vec![units * STEP] }]);
    let e = plan(&lat, &shared).unwrap_err().to_string();
    assert!(e.contains(&format!("needs at least {whole} bytes (")) && e.contains("unsliced"), "{e}");
}

/// `auto` takes the fewest equal slices predicted within [`EVEN_WITHIN`] of the optimum (and
/// within the memory limit) in place of an uneven optimum: on 3 grid units, `[8, 16]` is the
/// optimum and `[16, 8]` the even cut in two, `δ` slower.
#[test]
fn auto_takes_equal_slices_near_the_optimum() {
    use crate::pipeline::{PipelineConfig, ScheduleKind};
    use crate::terapipe::profile::EVEN_WITHIN;
    let latency = |whole: f64, delta: f64| {
        let t = move |l: usize, c: usize| match (l / STEP, c / STEP) {
            (3, 0) => whole,
            (1, 0) | (2, 1) => 1.0,
            (2, 0) => 1.0 + delta,
            (1, 2) => 1.0,
            _ => 10.0,
        };
        LatencyModel::from_fn(grid(3, 1), move |_, l, c| t(l, c)).unwrap()
    };
    let memory = MemoryModel { per_token_bytes: 0.0, per_score_bytes: 1.0, fixed_bytes: 0, ..Default::default() };
    let pipeline = |limit| PipelineConfig {
        pipeline_len: 1,
        micro_batches: 1,
        schedule: ScheduleKind::Gpipe,
        memory_limit: limit,
        ..Default::default()
    };
    // `[16, 8]` takes 2 + δ against the optimum's 2: 0.9 of the margin slower, or twice it.
    let (near, far) = (0.9 * 2.0 * EVEN_WITHIN, 2.0 * 2.0 * EVEN_WITHIN);
    for (whole, delta, limit, want) in [
        (10.0, near, None, vec![16, 8]),
        (10.0, far, None, vec![8, 16]),
        (2.0, near, None, vec![24]),
        // The whole sequence needs (24² + 24²)/2 = 576 bytes, either cut in two 448.
        (2.0, near, Some(500), vec![16, 8]),
    ] {
        let lat = latency(whole, delta);
        let exact = plan(&lat, &PlannerConfig { shared: true, ..PlannerConfig::new(1, 3 * STEP, 1) }).unwrap();
        assert_eq!(exact.micro_batches[0].slices, [8, 16], "the optimum: {exact}");
        let got = shared_slicing(&lat, &[memory], 3 * STEP, 4, &pipeline(limit)).unwrap();
        assert_eq!(got.micro_batches[0].slices, want, "whole {whole}, δ {delta}, limit {limit:?}: {got}");
        assert_eq!(got.micro_batches[0].samples, 4);
        let predicted = predict_step_seconds(&lat, 1, &[MicroBatchSlicing { samples: 1, slices: want.clone() }]);
        assert_eq!(got.predicted_step_seconds, predicted.unwrap(), "{got}");
        let most = want.iter().scan(0, |c, &l| Some(lat.slice_time(1, l, std::mem::replace(c, *c + l)).unwrap()));
        assert_eq!(got.max_slice_seconds, most.fold(0.0, f64::max), "{got}");
    }
}
