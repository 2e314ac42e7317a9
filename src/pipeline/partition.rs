//! The partitioner: cuts the model's unit list into contiguous stages so that the slowest stage
//! is as fast as possible, with every stage's memory (weights, gradients, optimizer state and
//! the activations its schedule keeps in flight) under a per-device limit. Exact: dynamic
//! programming over (stage, last unit), `O(S·N²)` for `N` units, never an empty stage.

use crate::error::{Error, Result, config_error};
use crate::model::UnitCost;
use serde::Serialize;
use std::ops::Range;

/// What the partitioner knows about one unit, per micro-batch.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct UnitProfile {
    /// Forward seconds (or any consistent unit).
    pub forward: f64,
    /// Backward seconds (input and weight gradients).
    pub backward: f64,
    /// Parameters (elements).
    pub params: usize,
    /// Bytes of activations the forward keeps for the backward.
    pub activation_bytes: usize,
    /// Whether any parameter trains. A frozen unit runs forward only, keeps no activations and
    /// has no gradients or optimizer state.
    pub trainable: bool,
}

impl UnitProfile {
    /// Seconds per micro-batch: forward, plus backward when trainable.
    pub fn time(&self) -> f64 {
        self.forward + if self.trainable { self.backward } else { 0.0 }
    }

    /// From analytic costs: `samples` per micro-batch at `flops_per_second`.
    pub fn analytic(cost: &UnitCost, samples: usize, flops_per_second: f64, trainable: bool) -> Self {
        let n = samples as f64;
        UnitProfile {
            forward: cost.forward_flops * n / flops_per_second,
            backward: cost.backward_flops * n / flops_per_second,
            params: cost.params,
            activation_bytes: cost.activation_bytes * samples,
            trainable,
        }
    }
}

/// Measures each unit's forward and backward time on `dev` for one micro-batch `host` (the
/// median of `repeats` runs, after one warm-up): the costs the partitioner balances when the
/// analytic FLOP counts would mislead (attention's softmax, the embedding's gathers).
pub fn profile_units<D: crate::device::Device>(
    dev: &D,
    model: &mut crate::model::Model<D>,
    host: &crate::model::HostBatch,
    repeats: usize,
) -> Result<Vec<UnitProfile>> {
    use crate::model::Batch;
    let batch = Batch::upload(dev, model.spec(), host, true, 0)?;
    let costs = model.costs(dev, batch.seq);
    let n = model.units().len();
    let mut fwd = vec![Vec::new(); n];
    let mut bwd = vec![Vec::new(); n];
    let since = |t: std::time::Instant| -> Result<f64> {
        dev.synchronize()?;
        Ok(t.elapsed().as_secs_f64())
    };
    for rep in 0..=repeats.max(1) {
        let mut x = None;
        let mut saved = Vec::with_capacity(n);
        for (i, unit) in model.units().iter().enumerate() {
            let start = std::time::Instant::now();
            let (y, s) = unit.forward(dev, &batch, x.take(), true)?;
            let t = since(start)?;
            saved.push(s);
            x = Some(y);
            if rep > 0 {
                fwd[i].push(t);
            }
        }
        let logits = x.ok_or_else(|| Error::State { what: "profile".into(), message: "empty model".into() })?;
        let loss = model.loss(dev, &batch, &logits, Some(1.0))?;
        let mut dy =
            loss.dlogits.ok_or_else(|| Error::State { what: "profile".into(), message: "no gradient".into() })?;
        for (i, (unit, s)) in model.units_mut().iter_mut().zip(saved).enumerate().rev() {
            let start = std::time::Instant::now();
            let dx = unit.backward(dev, &batch, s, &dy, i > 0)?;
            let t = since(start)?;
            if rep > 0 {
                bwd[i].push(t);
            }
            match dx {
                Some(dx) => dy = dx,
                None => break,
            }
        }
    }
    model.zero_grad(dev)?;
    let median = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v.get(v.len() / 2).copied().unwrap_or(0.0)
    };
    Ok((0..n)
        .map(|i| UnitProfile {
            forward: median(&mut fwd[i]),
            backward: median(&mut bwd[i]),
            params: costs[i].params,
            activation_bytes: costs[i].activation_bytes * host.batch,
            trainable: model.units()[i].trainable(),
        })
        .collect())
}

/// Bytes per parameter: f32 weights, plus f32 gradients and AdamW's two f32 moments if the
/// parameter trains.
pub fn param_bytes(params: usize, trainable: bool) -> usize {
    params * if trainable { 16 } else { 4 }
}

/// Stage boundaries and what each stage costs.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Partition {
    /// Units of each stage, in order, covering all units.
    pub stages: Vec<Range<usize>>,
    /// Seconds per micro-batch of each stage.
    pub stage_time: Vec<f64>,
    /// Peak bytes of each stage (parameters and state, plus activations in flight).
    pub stage_memory: Vec<usize>,
}

impl Partition {
    /// The slowest stage's time per micro-batch.
    pub fn bottleneck(&self) -> f64 {
        self.stage_time.iter().copied().fold(0.0, f64::max)
    }
}

/// Splits `units` into `stages` contiguous, non-empty stages minimising the slowest stage's
/// time, where stage `s` holds `in_flight[s]` micro-batches of activations at its peak, and
/// every stage's memory stays within `memory_limit` bytes (when given).
///
/// Errors, before any work: more stages than units, no stage, or a limit no partition meets
/// (the message gives the smallest peak any partition reaches).
pub fn partition(
    units: &[UnitProfile],
    stages: usize,
    in_flight: &[usize],
    memory_limit: Option<usize>,
) -> Result<Partition> {
    let n = units.len();
    if stages == 0 {
        return Err(config_error("pipeline_len", "a pipeline needs at least one stage"));
    }
    if stages > n {
        return Err(config_error(
            "pipeline_len",
            format!("{stages} stages cannot be cut from {n} units: every stage needs at least one unit"),
        ));
    }
    if in_flight.len() != stages {
        return Err(config_error("pipeline", format!("{} in-flight counts for {stages} stages", in_flight.len())));
    }
    // Prefix sums: time, parameter bytes, activation bytes (trainable units only).
    let mut time = vec![0.0; n + 1];
    let mut params = vec![0usize; n + 1];
    let mut acts = vec![0usize; n + 1];
    for (i, u) in units.iter().enumerate() {
        time[i + 1] = time[i] + u.time();
        params[i + 1] = params[i] + param_bytes(u.params, u.trainable);
        acts[i + 1] = acts[i] + if u.trainable { u.activation_bytes } else { 0 };
    }
    let memory =
        |s: usize, r: &Range<usize>| params[r.end] - params[r.start] + in_flight[s] * (acts[r.end] - acts[r.start]);
    let stage_time = |r: &Range<usize>| time[r.end] - time[r.start];

    // best[s][j]: the smallest bottleneck of units 0..j in stages 0..=s; cut[s][j] the start of
    // stage s in that split.
    let limit = memory_limit.unwrap_or(usize::MAX);
    let mut best = vec![vec![f64::INFINITY; n + 1]; stages];
    let mut cut = vec![vec![0usize; n + 1]; stages];
    for (j, b) in best[0].iter_mut().enumerate().skip(1) {
        if memory(0, &(0..j)) <= limit {
            *b = stage_time(&(0..j));
        }
    }
    for s in 1..stages {
        for j in s + 1..=n {
            for i in s..j {
                let r = i..j;
                if best[s - 1][i].is_finite() && memory(s, &r) <= limit {
                    let b = best[s - 1][i].max(stage_time(&r));
                    // Ties go to the later cut, which leaves the earlier stages (that hold more
                    // micro-batches in flight) smaller.
                    if b <= best[s][j] {
                        best[s][j] = b;
                        cut[s][j] = i;
                    }
                }
            }
        }
    }
    if !best[stages - 1][n].is_finite() {
        let need = min_peak_memory(n, stages, &memory);
        return Err(Error::Config {
            field: "memory_limit".into(),
            message: format!(
                "no split of {n} units into {stages} stages fits in {limit} bytes per device; the best split needs {need} bytes"
            ),
        });
    }
    let mut bounds = vec![n];
    let mut j = n;
    for s in (1..stages).rev() {
        j = cut[s][j];
        bounds.push(j);
    }
    bounds.push(0);
    bounds.reverse();
    let ranges: Vec<Range<usize>> = bounds.windows(2).map(|w| w[0]..w[1]).collect();
    Ok(Partition {
        stage_time: ranges.iter().map(stage_time).collect(),
        stage_memory: ranges.iter().enumerate().map(|(s, r)| memory(s, r)).collect(),
        stages: ranges,
    })
}

/// The smallest peak memory over all splits (for the error message).
fn min_peak_memory(n: usize, stages: usize, memory: &dyn Fn(usize, &Range<usize>) -> usize) -> usize {
    let mut best = vec![vec![usize::MAX; n + 1]; stages];
    for (j, b) in best[0].iter_mut().enumerate().skip(1) {
        *b = memory(0, &(0..j));
    }
    for s in 1..stages {
        for j in s + 1..=n {
            for i in s..j {
                if best[s - 1][i] != usize::MAX {
                    best[s][j] = best[s][j].min(best[s - 1][i].max(memory(s, &(i..j))));
                }
            }
        }
    }
    best[stages - 1][n]
}

#[cfg(test)]
mod tests {
    use super::*;

    fn unit(t: f64) -> UnitProfile {
        UnitProfile { forward: t / 3.0, backward: 2.0 * t / 3.0, params: 10, activation_bytes: 100, trainable: true }
    }

    /// Every split by brute force: the smallest bottleneck among those within the limit.
    fn brute(units: &[UnitProfile], stages: usize, in_flight: &[usize], limit: usize) -> Option<f64> {
        let n = units.len();
        let mut best: Option<f64> = None;
        // Choose stages−1 cut points among 1..n.
        for mask in 0u32..(1 << (n - 1)) {
            if mask.count_ones() as usize != stages - 1 {
                continue;
            }
            let mut bounds = vec![0];
            bounds.extend((1..n).filter(|i| mask & (1 << (i - 1)) != 0));
            bounds.push(n);
            let mut worst = 0.0f64;
            let mut fits = true;
            for (s, w) in bounds.windows(2).enumerate() {
                let us = &units[w[0]..w[1]];
                let mem: usize = us.iter().map(|u| param_bytes(u.params, u.trainable)).sum::<usize>()
                    + in_flight[s] * us.iter().filter(|u| u.trainable).map(|u| u.activation_bytes).sum::<usize>();
                fits &= mem <= limit;
                worst = worst.max(us.iter().map(UnitProfile::time).sum());
            }
            if fits {
                best = Some(best.map_or(worst, |b| b.min(worst)));
            }
        }
        best
    }

    #[test]
    fn matches_brute_force_on_uneven_units_and_limits() {
        let mut rng = crate::rng::Rng::new(3);
        for trial in 0..200 {
            let n = 2 + trial % 9;
            let units: Vec<UnitProfile> = (0..n)
                .map(|_| UnitProfile {
                    forward: rng.uniform(),
                    backward: 2.0 * rng.uniform(),
                    params: rng.below(50) as usize,
                    activation_bytes: rng.below(400) as usize,
                    trainable: rng.below(4) != 0,
                })
                .collect();
            let stages = 1 + trial % n;
            let in_flight: Vec<usize> = (0..stages).map(|s| stages - s).collect();
            let limit = 300 + rng.below(3000) as usize;
            let want = brute(&units, stages, &in_flight, limit);
            match partition(&units, stages, &in_flight, Some(limit)) {
                Ok(p) => {
                    let want = want.unwrap_or_else(|| panic!("trial {trial}: brute force found no split"));
                    assert!((p.bottleneck() - want).abs() < 1e-9, "trial {trial}: {} vs {want}", p.bottleneck());
                    assert!(p.stages.iter().all(|r| !r.is_empty()));
                    assert!(p.stage_memory.iter().all(|&m| m <= limit));
                }
                Err(e) => assert_eq!(want, None, "trial {trial}: {e}"),
            }
        }
    }

    #[test]
    fn balances_equal_units_evenly() {
        let p = partition(&vec![unit(1.0); 12], 4, &[4, 3, 2, 1], None).unwrap();
        assert_eq!(p.stages, vec![0..3, 3..6, 6..9, 9..12]);
    }

    #[test]
    fn frozen_units_cost_forward_only_and_keep_no_activations() {
        let mut units = vec![unit(3.0); 4];
        units[0].trainable = false;
        units[1].trainable = false;
        // Times 1, 1, 3, 3 (frozen units run forward only): the best cut is after unit 2 (5 | 3).
        let p = partition(&units, 2, &[2, 1], None).unwrap();
        assert_eq!(p.stages, vec![0..3, 3..4]);
        assert_eq!(p.stage_memory[0], 2 * 40 + 160 + 2 * 100);
    }

    #[test]
    fn impossible_requests_are_refused_before_any_work() {
        let units = vec![unit(1.0); 3];
        let e = partition(&units, 4, &[1; 4], None).unwrap_err().to_string();
        assert!(e.contains("4 stages") && e.contains("3 units"), "{e}");
        let e = partition(&units, 3, &[1; 3], Some(100)).unwrap_err().to_string();
        assert!(e.contains("best split needs 260 bytes"), "{e}");
        assert!(partition(&units, 0, &[], None).is_err());
    }
}
