//! The partitioner: cuts the model's unit list into contiguous stages so that the slowest stage
//! is as fast as possible, with every stage's memory (weights, gradients, optimizer state and
//! the activations its schedule keeps in flight) under a per-device limit. Exact: dynamic
//! programming over (stage, last unit), `O(S·N²)` for `N` units, never an empty stage.
//!
//! A *pinned* prefix (PipeTransformer's frozen layers, AutoPipe) always joins the first stage:
//! its cost counts there, but the other stages are cut from the active units only, and every
//! stage holds at least one active unit.

pub use super::profile::UnitProfile;
use crate::error::{Error, Result, config_error};
use serde::Serialize;
use std::ops::Range;

/// Bytes per parameter: f32 weights, plus f32 gradients and AdamW's two f32 moments if the
/// parameter trains.
pub fn param_bytes(params: usize, trainable: bool) -> usize {
    params * if trainable { 16 } else { 4 }
}

/// Whether `stages` cut `units` units into non-empty runs, in order, covering them all.
pub fn covers(stages: &[Range<usize>], units: usize) -> bool {
    stages.first().is_some_and(|r| r.start == 0)
        && stages.last().is_some_and(|r| r.end == units)
        && stages.windows(2).all(|w| w[0].end == w[1].start)
        && stages.iter().all(|r| !r.is_empty())
}

/// Stage boundaries and what each stage costs.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Partition {
    /// Units of each stage, in order, covering all units.
    pub stages: Vec<Range<usize>>,
    /// Seconds per micro-batch of each stage.
    pub stage_time: Vec<f64>,
    /// Of those, the forward's (a stage of frozen units is all forward).
    pub stage_forward: Vec<f64>,
    /// Peak bytes of each stage (parameters and state, plus activations in flight).
    pub stage_memory: Vec<usize>,
}

impl Partition {
    /// The costs of given stage boundaries (a plan restored from a checkpoint). Errors when
    /// the ranges do not cover `units` in order with non-empty stages.
    pub fn of(units: &[UnitProfile], stages: Vec<Range<usize>>, in_flight: &[usize]) -> Result<Partition> {
        if !covers(&stages, units.len()) || in_flight.len() != stages.len() {
            return Err(config_error(
                "partition",
                format!("stages {stages:?} do not cover the model's {} units in order", units.len()),
            ));
        }
        let time = |r: &Range<usize>| units[r.clone()].iter().map(UnitProfile::time).sum();
        let forward = |r: &Range<usize>| units[r.clone()].iter().map(|u| u.forward).sum();
        let memory = |s: usize, r: &Range<usize>| {
            let us = &units[r.clone()];
            us.iter().map(|u| u.state_bytes()).sum::<usize>()
                + in_flight[s] * us.iter().map(UnitProfile::in_flight_bytes).sum::<usize>()
        };
        Ok(Partition {
            stage_time: stages.iter().map(time).collect(),
            stage_forward: stages.iter().map(forward).collect(),
            stage_memory: stages.iter().enumerate().map(|(s, r)| memory(s, r)).collect(),
            stages,
        })
    }

    /// The slowest stage's time per micro-batch.
    pub fn bottleneck(&self) -> f64 {
        self.stage_time.iter().copied().fold(0.0, f64::max)
    }

    /// Each of `k` devices' bytes: a device holds its virtual stages (`s mod k`) at once.
    pub fn device_memory(&self, k: usize) -> Vec<usize> {
        let mut per_device = vec![0usize; k.max(1)];
        for (s, &bytes) in self.stage_memory.iter().enumerate() {
            per_device[super::schedule::stage_device(s, k.max(1))] += bytes;
        }
        per_device
    }

    /// The largest of [`device_memory`](Self::device_memory).
    pub fn device_peak(&self, k: usize) -> usize {
        self.device_memory(k).into_iter().max().unwrap_or(0)
    }
}

/// Splits `units` into `stages` contiguous stages minimising the slowest stage's time, where
/// stage `s` holds `in_flight[s]` micro-batches of activations at its peak, every stage's
/// memory stays within `memory_limit` bytes (when given), the first `pinned` units belong to
/// stage 0, and every stage holds at least one unit after them.
///
/// Errors, before any work: more stages than units to cut, no stage, or a limit no partition
/// meets (the message gives the smallest peak any partition reaches).
pub fn partition(
    units: &[UnitProfile],
    stages: usize,
    in_flight: &[usize],
    memory_limit: Option<usize>,
    pinned: usize,
) -> Result<Partition> {
    let n = units.len();
    if stages == 0 {
        return Err(config_error("pipeline_len", "a pipeline needs at least one stage"));
    }
    if pinned >= n || stages > n - pinned {
        let active = n.saturating_sub(pinned);
        let pinned_note = if pinned > 0 { format!(" after the {pinned} frozen ones") } else { String::new() };
        return Err(config_error(
            "pipeline_len",
            format!(
                "{stages} stages cannot be cut from {active} units{pinned_note}: every stage needs at least one unit"
            ),
        ));
    }
    if in_flight.len() != stages {
        return Err(config_error("pipeline", format!("{} in-flight counts for {stages} stages", in_flight.len())));
    }
    // Prefix sums: time, parameter bytes, bytes per micro-batch in flight.
    let mut time = vec![0.0; n + 1];
    let mut params = vec![0usize; n + 1];
    let mut acts = vec![0usize; n + 1];
    for (i, u) in units.iter().enumerate() {
        time[i + 1] = time[i] + u.time();
        params[i + 1] = params[i] + u.state_bytes();
        acts[i + 1] = acts[i] + u.in_flight_bytes();
    }
    let memory =
        |s: usize, r: &Range<usize>| params[r.end] - params[r.start] + in_flight[s] * (acts[r.end] - acts[r.start]);
    let stage_time = |r: &Range<usize>| time[r.end] - time[r.start];

    // best[s][j]: the smallest bottleneck of units 0..j in stages 0..=s; cut[s][j] the start of
    // stage s in that split.
    let limit = memory_limit.unwrap_or(usize::MAX);
    let mut best = vec![vec![f64::INFINITY; n + 1]; stages];
    let mut cut = vec![vec![0usize; n + 1]; stages];
    for (j, b) in best[0].iter_mut().enumerate().skip(pinned + 1) {
        if memory(0, &(0..j)) <= limit {
            *b = stage_time(&(0..j));
        }
    }
    for s in 1..stages {
        for j in pinned + s + 1..=n {
            for i in pinned + s..j {
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
        let need = min_peak_memory(n, stages, pinned, &memory);
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
        stage_forward: ranges.iter().map(|r| units[r.clone()].iter().map(|u| u.forward).sum()).collect(),
        stage_memory: ranges.iter().enumerate().map(|(s, r)| memory(s, r)).collect(),
        stages: ranges,
    })
}

/// The smallest peak memory over all splits (for the error message).
fn min_peak_memory(n: usize, stages: usize, pinned: usize, memory: &dyn Fn(usize, &Range<usize>) -> usize) -> usize {
    let mut best = vec![vec![usize::MAX; n + 1]; stages];
    for (j, b) in best[0].iter_mut().enumerate().skip(pinned + 1) {
        *b = memory(0, &(0..j));
    }
    for s in 1..stages {
        for j in pinned + s + 1..=n {
            for i in pinned + s..j {
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
        UnitProfile {
            forward: t / 3.0,
            backward: 2.0 * t / 3.0,
            params: 10,
            activation_bytes: 100,
            trainable: true,
            ..Default::default()
        }
    }

    /// Every split by brute force: the smallest bottleneck among those within the limit.
    fn brute(units: &[UnitProfile], stages: usize, in_flight: &[usize], limit: usize, pinned: usize) -> Option<f64> {
        let n = units.len();
        let mut best: Option<f64> = None;
        // Choose stages−1 cut points among pinned+1..n.
        for mask in 0u32..(1 << (n - 1)) {
            if mask.count_ones() as usize != stages - 1 || (1..=pinned).any(|i| mask & (1 << (i - 1)) != 0) {
                continue;
            }
            let mut bounds = vec![0];
            bounds.extend((1..n).filter(|i| mask & (1 << (i - 1)) != 0));
            bounds.push(n);
            let mut worst = 0.0f64;
            let mut fits = true;
            for (s, w) in bounds.windows(2).enumerate() {
                let us = &units[w[0]..w[1]];
                let mem: usize = us.iter().map(|u| u.state_bytes()).sum::<usize>()
                    + in_flight[s] * us.iter().map(UnitProfile::in_flight_bytes).sum::<usize>();
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
                    weight_pack_bytes: rng.below(200) as usize,
                    // (Counted for frozen units only: a sliced frozen attention's arena.)
                    frozen_arena_bytes: rng.below(100) as usize,
                    ..Default::default()
                })
                .collect();
            let pinned = if trial % 3 == 0 { rng.below(n as u64) as usize } else { 0 };
            let stages = 1 + trial % (n - pinned);
            let in_flight: Vec<usize> = (0..stages).map(|s| stages - s).collect();
            let limit = 300 + rng.below(3000) as usize;
            let want = brute(&units, stages, &in_flight, limit, pinned);
            match partition(&units, stages, &in_flight, Some(limit), pinned) {
                Ok(p) => {
                    let want = want.unwrap_or_else(|| panic!("trial {trial}: brute force found no split"));
                    assert!((p.bottleneck() - want).abs() < 1e-9, "trial {trial}: {} vs {want}", p.bottleneck());
                    assert!(p.stages.iter().all(|r| !r.is_empty()));
                    assert!(p.stages[0].end > pinned, "trial {trial}: stage 0 holds only pinned units");
                    assert!(p.stage_memory.iter().all(|&m| m <= limit));
                }
                Err(e) => assert_eq!(want, None, "trial {trial}: {e}"),
            }
        }
    }

    #[test]
    fn balances_equal_units_evenly() {
        let p = partition(&vec![unit(1.0); 12], 4, &[4, 3, 2, 1], None, 0).unwrap();
        assert_eq!(p.stages, vec![0..3, 3..6, 6..9, 9..12]);
    }

    #[test]
    fn frozen_units_cost_forward_only_and_keep_no_activations() {
        let mut units = vec![unit(3.0); 4];
        units[0].trainable = false;
        units[1].trainable = false;
        // Times 1, 1, 3, 3 (frozen units run forward only): the best cut is after unit 2 (5 | 3).
        let p = partition(&units, 2, &[2, 1], None, 0).unwrap();
        assert_eq!(p.stages, vec![0..3, 3..4]);
        assert_eq!(p.stage_memory[0], 2 * 40 + 160 + 2 * 100);
    }

    #[test]
    fn impossible_requests_are_refused_before_any_work() {
        let units = vec![unit(1.0); 3];
        let e = partition(&units, 4, &[1; 4], None, 0).unwrap_err().to_string();
        assert!(e.contains("4 stages") && e.contains("3 units"), "{e}");
        let e = partition(&units, 3, &[1; 3], Some(100), 0).unwrap_err().to_string();
        assert!(e.contains("best split needs 260 bytes"), "{e}");
        assert!(partition(&units, 0, &[], None, 0).is_err());
        let e = partition(&units, 2, &[1; 2], None, 2).unwrap_err().to_string();
        assert!(e.contains("1 units after the 2 frozen ones"), "{e}");
    }

    #[test]
    fn a_pinned_prefix_joins_the_first_stage() {
        // Six equal units with the first four pinned (frozen, forward only: 1/3 each): two
        // stages get 4×1/3 + 1 | 1, not the 3 | 3 split of an unpinned list.
        let mut units = vec![unit(3.0); 6];
        for u in &mut units[..4] {
            u.trainable = false;
        }
        let p = partition(&units, 2, &[2, 1], None, 4).unwrap();
        assert_eq!(p.stages, vec![0..5, 5..6]);
    }
}
