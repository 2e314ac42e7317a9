//! AutoPipe (PipeTransformer §3.2): after a freeze, the frozen units are charged their forward
//! only, or nothing when the cache feeds them (then they are pinned to the first stage, where
//! cached hidden states enter and are captured; without the cache they spread over the stages
//! like any other forward work — pinning them would load the first stage with all of it), the
//! units are re-partitioned on their measured costs, and the pipeline length `K`
//! becomes the smallest that fits memory and runs within a few percent of the best predicted
//! throughput — any `K`, not only halves. The number of micro-batches `M` for that `K` is then
//! chosen by timing the candidates on the real devices, one training step each ([`Tuner`]), and
//! remembered per (`K`, `R`, frozen prefix, batch). Where the price of a shorter pipeline rests
//! on a guess (cpu devices sharing a pool or lending their threads: the planner takes their
//! speed with more threads to be ideal, and two 1-thread stages on a 2-core CPU beat one
//! 2-thread device), the controller times the chosen `K` against the one in force, each at its
//! best `M`, and keeps the faster (`elastic.time_pipeline_len`).

use crate::comm::process_group::ProcessGroup;
use crate::error::{Result, config_error};
use crate::pipeline::{PipelineConfig, Plan, ScheduleKind, UnitProfile};
use std::collections::BTreeMap;

/// Shapes whose predicted throughput is within this fraction of the best count as balanced;
/// the shortest of them wins (fewer transfers, more replicas for AutoDP).
pub const BALANCED: f64 = 0.05;

/// A candidate shape and what the planner predicts for it.
#[derive(Clone, Debug, PartialEq)]
pub struct Candidate {
    /// The plan's settings.
    pub config: PipelineConfig,
    /// Predicted seconds per step: `(M·v + K − 1)` slots of the slowest stage.
    pub step_time: f64,
    /// Predicted samples per second.
    pub throughput: f64,
}

/// The micro-batch counts worth timing for `K` with `per_replica` samples per replica: `K`,
/// `2K`, `4K` (the paper enumerates `K..6K`; more micro-batches than samples is impossible).
pub fn micro_batch_candidates(k: usize, per_replica: usize) -> Vec<usize> {
    let mut c: Vec<usize> = [k, 2 * k, 4 * k].into_iter().map(|m| m.min(per_replica.max(1))).collect();
    c.dedup();
    c
}

/// The token slices a shape runs with micro-batches of so many samples over units of those
/// costs, so many of them pinned to the first stage (TeraPipe; none: whole).
pub type ShapeSlices<'a> = dyn Fn(&PipelineConfig, usize, &[UnitProfile], usize) -> Vec<usize> + 'a;

/// What the planner knows of the run, as functions of the pipeline length `K` (or of the
/// replicas `R`, or of samples per micro-batch).
pub struct Shapes<'a> {
    /// Samples per step with `R` replicas.
    pub global: &'a dyn Fn(usize) -> usize,
    /// Replicas of a `K`-stage pipeline.
    pub replicas: &'a dyn Fn(usize) -> usize,
    /// Each device's speed relative to the profiles' at `K` (> 1 where idle cpu devices lend
    /// it their threads).
    pub speed: &'a dyn Fn(usize) -> f64,
    /// Micro-batches for `K` with a replica's samples.
    pub micro: &'a dyn Fn(usize, usize) -> usize,
    /// The units' costs for a micro-batch of that many samples.
    pub profiles: &'a dyn Fn(usize) -> Vec<UnitProfile>,
    /// The token slices a shape runs with micro-batches of that many samples over units of
    /// those costs, so many pinned to the first stage (TeraPipe).
    pub slices: &'a ShapeSlices<'a>,
}

/// The shape for a model whose first `pinned` units must join the first stage (the cached
/// prefix; frozen units are known from the profiles): for each `K` from 1 to `max_len`, the
/// replicas, micro-batches and costs `shapes` gives, planned on the units' costs, every one
/// that fits memory. [`pick`] chooses among them.
pub fn choose_shape(
    base: &PipelineConfig,
    max_len: usize,
    devices: usize,
    pinned: usize,
    shapes: &Shapes,
    names: &[String],
) -> Result<Vec<Candidate>> {
    let mut out = Vec::new();
    let mut last_err = None;
    for k in 1..=max_len.max(1) {
        let r = (shapes.replicas)(k).max(1);
        if r * k > devices {
            continue;
        }
        let global = (shapes.global)(r);
        let per_replica = global.div_ceil(r);
        let m = (shapes.micro)(k, per_replica).clamp(1, per_replica.max(1));
        let chunks = if k == 1 { 1 } else { base.chunks };
        let schedule = schedule_for(k, base.schedule);
        let config =
            PipelineConfig { pipeline_len: k, replicas: r, micro_batches: m, chunks, schedule, ..base.clone() };
        let samples = per_replica.div_ceil(m);
        let units = (shapes.profiles)(samples);
        let config = PipelineConfig { token_slices: (shapes.slices)(&config, samples, &units, pinned), ..config };
        // Token slices fill and drain the pipeline in their largest's time (TeraPipe), not a
        // whole micro-batch's.
        let whole: usize = config.token_slices.iter().sum();
        let largest = config.token_slices.iter().max().map_or(1.0, |&l| l as f64 / whole.max(1) as f64);
        match Plan::new(config.clone(), &units, names.to_vec(), devices, pinned) {
            Ok(plan) => {
                let slots = (m * chunks) as f64 + schedule.fill() * (k - 1) as f64 * largest;
                let step_time = slots * plan.partition.bottleneck() / (shapes.speed)(k);
                let throughput = if step_time > 0.0 { global as f64 / step_time } else { f64::INFINITY };
                out.push(Candidate { config, step_time, throughput });
            }
            Err(e) => last_err = Some(e),
        }
    }
    match (out.is_empty(), last_err) {
        (true, Some(e)) => Err(e),
        _ => Ok(out),
    }
}

/// The schedule a `k`-stage candidate runs: the run's own, or 1F1B on one stage, where every
/// schedule is the same order and zero bubble's split would only cost.
pub fn schedule_for(k: usize, base: ScheduleKind) -> ScheduleKind {
    if k == 1 { ScheduleKind::OneFOneB } else { base }
}

/// The chosen candidate: the shortest pipeline within [`BALANCED`] of the best throughput.
pub fn pick(candidates: &[Candidate]) -> Option<&Candidate> {
    let best = candidates.iter().map(|c| c.throughput).fold(0.0, f64::max);
    candidates.iter().filter(|c| c.throughput >= best * (1.0 - BALANCED)).min_by_key(|c| c.config.pipeline_len)
}

/// The candidate every process of a launched run takes: rank 0's [`pick`]. Each process times
/// its own steps and may prefer another shape, and one that changed `K` alone would meet the
/// others' next collective with another. Every process calls this at the same transition (the
/// freeze rule decides on the summed gradients); without a process group, `chosen` itself.
pub fn agree<'a>(
    group: Option<&ProcessGroup>,
    chosen: &'a Candidate,
    candidates: &'a [Candidate],
) -> Result<&'a Candidate> {
    let Some(group) = group else { return Ok(chosen) };
    let mut k = [if group.rank() == 0 { chosen.config.pipeline_len as f64 } else { 0.0 }];
    group.all_reduce_sum_f64(&mut k)?;
    let k = k[0] as usize;
    // `choose_shape` prices one candidate per `K`.
    candidates.iter().find(|c| c.config.pipeline_len == k).ok_or_else(|| {
        config_error(
            "elastic.auto_pipe",
            format!("rank 0 chose a pipeline of {k} stages, which does not fit this process's devices"),
        )
    })
}

/// Rate measured for each micro-batch count timed, in positions (samples × padded sequence
/// length) per second: batches differ in length, and a step's work follows its positions.
pub type Rates = Vec<(usize, f64)>;

/// Training steps timed per candidate; the median rate counts. The candidates take turns
/// (round robin), so a machine that slows down for a while, or a run of long batches, falls on
/// all of them alike instead of on whichever was being timed.
pub const ROUNDS: usize = 3;

/// A shape's micro-batch counts being timed (its key, the candidates, the rates measured for
/// each so far, the index of the one in force): kept in a checkpoint, so a resumed run goes on
/// timing where it stopped instead of keeping whichever count was in force.
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Timing {
    key: String,
    candidates: Vec<usize>,
    rates: Vec<Vec<f64>>,
    at: usize,
}

impl Timing {
    /// Whether a checkpoint's timing is one [`Tuner::record`] can go on with: candidates of at
    /// least one micro-batch, a list of rates for each, and the one in force among them (a file
    /// of another build, or edited, may hold any numbers).
    pub fn check(&self) -> std::result::Result<(), String> {
        let Timing { candidates, rates, at, .. } = self;
        if candidates.is_empty()
            || candidates.contains(&0)
            || rates.len() != candidates.len()
            || *at >= candidates.len()
        {
            return Err(format!(
                "AutoPipe's timing of micro-batch counts holds candidates {candidates:?}, {} lists of rates and the \
                 one in force at {at}; expected counts of at least 1, a list of rates for each, and an index among them",
                rates.len()
            ));
        }
        Ok(())
    }
}

/// Times micro-batch counts, [`ROUNDS`] training steps each in turn, and remembers the winner
/// per shape.
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Tuner {
    /// The best `M` found per shape key (see [`Tuner::key`]).
    pub best: BTreeMap<String, usize>,
    #[serde(skip)]
    running: Option<Timing>,
}

impl Tuner {
    /// The key of a shape: the same pipeline over the same units on the same batch, under the
    /// same schedule (zero bubble's shorter fill and drain favour fewer micro-batches).
    pub fn key(k: usize, r: usize, frozen: usize, cached: bool, per_replica: usize, schedule: ScheduleKind) -> String {
        format!("K={k} R={r} frozen={frozen} cached={cached} batch={per_replica} schedule={schedule}")
    }

    /// Starts timing `candidates` for `key` unless it is known; returns the `M` to run now.
    pub fn start(&mut self, key: String, candidates: Vec<usize>) -> usize {
        if let Some(&m) = self.best.get(&key) {
            self.running = None;
            return m;
        }
        if candidates.len() > 1 {
            return self.time(key, candidates);
        }
        let first = candidates.first().copied().unwrap_or(1);
        self.best.insert(key, first);
        self.running = None;
        first
    }

    /// Times `candidates` for `key` even when its winner is known or there is only one (a
    /// trial of pipeline lengths needs each one's rate); returns the `M` to run now.
    pub fn time(&mut self, key: String, candidates: Vec<usize>) -> usize {
        self.best.remove(&key);
        let Some(&first) = candidates.first() else {
            self.running = None;
            return 1;
        };
        let rates = vec![Vec::new(); candidates.len()];
        self.running = Some(Timing { key, candidates, rates, at: 0 });
        first
    }

    /// Whether a step is being timed.
    pub fn running(&self) -> bool {
        self.running.is_some()
    }

    /// The timing under way, for a checkpoint.
    pub fn timing(&self) -> Option<&Timing> {
        self.running.as_ref()
    }

    /// Goes on with a checkpoint's [`timing`](Self::timing).
    pub fn resume_timing(&mut self, timing: Timing) {
        self.running = Some(timing);
    }

    /// Records a timed step of the candidate in force (`m`, `positions_per_second`). Returns
    /// the `M` to run next: the next candidate in turn, or the winner once every candidate has
    /// [`ROUNDS`] steps (with the per-candidate median rates); `None` when nothing is being
    /// tuned.
    pub fn record(&mut self, m: usize, positions_per_second: f64) -> Option<(usize, Option<Rates>)> {
        let Timing { key, candidates, rates, at } = self.running.as_mut()?;
        // A step of another M (none is expected) times nothing: the turn stays.
        let Some(i) = candidates.iter().position(|&c| c == m) else { return Some((candidates[*at], None)) };
        rates[i].push(positions_per_second);
        if rates.iter().any(|r| r.len() < ROUNDS) {
            *at = (i + 1) % candidates.len();
            return Some((candidates[*at], None));
        }
        let timed = medians(candidates, rates);
        let winner = fastest(&timed).unwrap_or(m);
        self.best.insert(std::mem::take(key), winner);
        self.running = None;
        Some((winner, Some(timed)))
    }

    /// Ends the timing under way before every candidate had its rounds (the run is over):
    /// returns the count with the best median of the steps timed (the first candidate, the one
    /// planned, where none was timed) and the medians of those timed. Nothing is remembered
    /// for the shape: a rate of fewer rounds is not a result. `None` when no timing is under
    /// way.
    pub fn cut_short(&mut self) -> Option<(usize, Rates)> {
        let Timing { candidates, rates, .. } = self.running.take()?;
        let timed: Rates = medians(&candidates, &rates).into_iter().filter(|(_, r)| r.is_finite()).collect();
        Some((fastest(&timed).or(candidates.first().copied()).unwrap_or(1), timed))
    }
}

/// Each candidate's median rate (NaN where none was measured).
fn medians(candidates: &[usize], rates: &[Vec<f64>]) -> Rates {
    let median = |r: &[f64]| {
        let mut r = r.to_vec();
        r.sort_by(f64::total_cmp);
        r.get(r.len() / 2).copied().unwrap_or(f64::NAN)
    };
    candidates.iter().zip(rates).map(|(&c, r)| (c, median(r))).collect()
}

/// The count of the highest rate.
fn fastest(timed: &Rates) -> Option<usize> {
    timed.iter().copied().max_by(|a, b| a.1.total_cmp(&b.1)).map(|w| w.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn units(n: usize, frozen: usize) -> impl Fn(usize) -> Vec<UnitProfile> {
        move |samples| {
            (0..n)
                .map(|i| UnitProfile {
                    forward: samples as f64,
                    backward: 2.0 * samples as f64,
                    params: 10,
                    activation_bytes: 100 * samples,
                    trainable: i >= frozen,
                    ..Default::default()
                })
                .collect()
        }
    }

    fn names(n: usize) -> Vec<String> {
        (0..n).map(|i| format!("u{i}")).collect()
    }

    /// Micro-batches run whole.
    fn whole(_: &PipelineConfig, _: usize, _: &[UnitProfile], _: usize) -> Vec<usize> {
        Vec::new()
    }

    /// One replica of 32 samples a step at the profiles' speed, micro-batches whole.
    fn one_replica<'a>(
        micro: &'a dyn Fn(usize, usize) -> usize,
        profiles: &'a dyn Fn(usize) -> Vec<UnitProfile>,
    ) -> Shapes<'a> {
        Shapes { global: &|_| 32, replicas: &|_| 1, speed: &|_| 1.0, micro, profiles, slices: &whole }
    }

    /// A pipeline over token slices fills and drains in the largest slice's time: `K − 1`
    /// slots of a quarter micro-batch each with four equal slices, of a half with 3 and 1
    /// (the larger counts), and the slices are what the plan runs.
    #[test]
    fn token_slices_shorten_the_priced_fill() {
        let base = PipelineConfig { pipeline_len: 2, micro_batches: 2, ..Default::default() };
        let (micro, profiles) = (|_, _| 2, units(8, 0));
        let step = |slices: &ShapeSlices<'_>| {
            let shapes = Shapes {
                global: &|_| 4,
                replicas: &|_| 1,
                speed: &|_| 1.0,
                micro: &micro,
                profiles: &profiles,
                slices,
            };
            let c = choose_shape(&base, 2, 2, 0, &shapes, &names(8)).unwrap();
            let two = c.iter().find(|c| c.config.pipeline_len == 2).unwrap();
            (two.step_time, two.config.token_slices.clone())
        };
        // Two stages of 4 units × 2 samples × 3 s = 24 s per micro-batch; 2 micro-batches.
        assert_eq!(step(&whole), (3.0 * 24.0, vec![]));
        assert_eq!(step(&|_, _, _, _| vec![8; 4]), (2.25 * 24.0, vec![8; 4]));
        assert_eq!(step(&|_, _, _, _| vec![24, 8]), (2.75 * 24.0, vec![24, 8]));
    }

    #[test]
    fn with_free_devices_as_replicas_the_shortest_pipeline_wins() {
        let base = PipelineConfig { pipeline_len: 4, micro_batches: 8, ..Default::default() };
        // 4 devices, 10 units of which 6 frozen: K=1 with 4 replicas has no bubble.
        let (replicas, micro, profiles) = (|k: usize| 4 / k, |k: usize, _| 2 * k, units(10, 6));
        let shapes = Shapes {
            global: &|_| 32,
            replicas: &replicas,
            speed: &|_| 1.0,
            micro: &micro,
            profiles: &profiles,
            slices: &whole,
        };
        let c = choose_shape(&base, 4, 4, 6, &shapes, &names(10)).unwrap();
        assert_eq!(c.len(), 4);
        let p = pick(&c).unwrap();
        assert_eq!((p.config.pipeline_len, p.config.replicas), (1, 4));
    }

    #[test]
    fn without_autodp_a_balanced_pipeline_is_kept() {
        let base = PipelineConfig { pipeline_len: 2, micro_batches: 8, ..Default::default() };
        // One replica whatever K: halving K halves the devices at work, so K = 2 stays.
        let (micro, profiles) = (|_, _| 8, units(8, 0));
        let shapes = one_replica(&micro, &profiles);
        let c = choose_shape(&base, 2, 2, 0, &shapes, &names(8)).unwrap();
        assert_eq!(pick(&c).unwrap().config.pipeline_len, 2);
        // A memory limit that only the two-stage split meets: one stage would hold 8 units'
        // state (8 × 160 B) and one micro-batch's activations (8 × 400 B) = 4480 B; two hold at
        // most 4 × 160 + 2 × 4 × 400 = 3840 B.
        let tight = PipelineConfig { memory_limit: Some(4000), ..base };
        let c = choose_shape(&tight, 2, 2, 0, &shapes, &names(8)).unwrap();
        assert_eq!(c.iter().map(|c| c.config.pipeline_len).collect::<Vec<_>>(), vec![2]);
    }

    /// Idle cpu devices lending their threads: one stage on a device with both threads is
    /// predicted as fast as two replicas would be (no bubble), so it beats the two-stage
    /// pipeline that would win on one thread per device.
    #[test]
    fn a_device_with_lent_threads_is_planned_at_their_speed() {
        let base = PipelineConfig { pipeline_len: 2, micro_batches: 8, ..Default::default() };
        let (micro, profiles) = (|k: usize, _| 2 * k, units(8, 0));
        let shape = |speed: &dyn Fn(usize) -> f64| {
            let shapes =
                Shapes { global: &|_| 32, replicas: &|_| 1, speed, micro: &micro, profiles: &profiles, slices: &whole };
            let c = choose_shape(&base, 2, 2, 0, &shapes, &names(8)).unwrap();
            let p = pick(&c).unwrap();
            (p.config.pipeline_len, p.config.replicas, p.step_time)
        };
        // K = 1: 2 micro-batches of 16 samples through 8 units of 3 s per sample, at twice
        // the speed: 384 s; K = 2: 5 slots of 4 units × 8 samples × 3 s = 480 s.
        assert_eq!(shape(&|k| 2.0 / k as f64), (1, 1, 384.0));
        assert_eq!(shape(&|_| 1.0), (2, 1, 480.0), "on one thread each the pipeline wins");
    }

    #[test]
    fn uncached_frozen_units_spread_over_the_stages() {
        // 10 units, 9 frozen (forward 1 per sample), 1 active (forward 1 + backward 2), one
        // replica. Spread, two stages of 6 and 6 beat one stage of 12 by (8 × 12)/(9 × 6) =
        // 1.8×. Pinned (what the cache needs), the first stage holds all nine frozen units and
        // the active one: 9 slots of 12 lose to one stage's 8 slots of 12.
        let base = PipelineConfig { pipeline_len: 2, micro_batches: 8, ..Default::default() };
        let shape = |pinned| {
            let (micro, profiles) = (|_, _| 8, units(10, 9));
            let shapes = one_replica(&micro, &profiles);
            let c = choose_shape(&base, 2, 2, pinned, &shapes, &names(10)).unwrap();
            let p = pick(&c).unwrap();
            (p.config.pipeline_len, p.step_time)
        };
        assert_eq!(shape(0), (2, 9.0 * 6.0 * 4.0));
        assert_eq!(shape(9), (1, 8.0 * 12.0 * 4.0));
    }
    #[test]
    fn the_tuner_times_the_candidates_in_turn_and_remembers_the_winner() {
        assert_eq!(micro_batch_candidates(2, 32), vec![2, 4, 8]);
        assert_eq!(micro_batch_candidates(2, 3), vec![2, 3]);
        assert_eq!(micro_batch_candidates(1, 1), vec![1]);
        let mut t = Tuner::default();
        let key = Tuner::key(2, 1, 5, true, 32, ScheduleKind::OneFOneB);
        assert_eq!(t.start(key.clone(), vec![2, 4, 8]), 2);
        assert_eq!(ROUNDS, 3);
        // Round robin: 2, 4, 8, 2, 4, 8, 2, 4, 8. The median ignores one bad step (M = 4's
        // second, a slow moment or a run of long batches), where a mean would crown M = 8.
        let rates = [(2, [12.0, 1.0, 10.0]), (4, [30.0, 2.0, 28.0]), (8, [20.0, 24.0, 25.0])];
        for round in 0..3 {
            for (i, (m, r)) in rates.iter().enumerate() {
                let got = t.record(*m, r[round]);
                if round == 2 && i == 2 {
                    assert_eq!(got, Some((4, Some(vec![(2, 10.0), (4, 28.0), (8, 24.0)]))));
                } else {
                    assert_eq!(got, Some((rates[(i + 1) % 3].0, None)), "round {round}, after M = {m}");
                }
            }
        }
        assert!(!t.running());
        assert_eq!(t.record(4, 1.0), None);
        assert_eq!(t.start(key, vec![2, 4, 8]), 4, "known: no timing");
        assert!(!t.running());
        // The same shape under another schedule is timed afresh.
        let zb = Tuner::key(2, 1, 5, true, 32, ScheduleKind::ZeroBubble);
        assert_eq!(t.start(zb, vec![2, 4, 8]), 2);
        assert!(t.running());
        assert_eq!(schedule_for(1, ScheduleKind::ZeroBubble), ScheduleKind::OneFOneB);
        assert_eq!(schedule_for(2, ScheduleKind::ZeroBubble), ScheduleKind::ZeroBubble);
    }

    /// A trial of pipeline lengths needs each one's rate: `time` measures a shape whose
    /// winner is known, and one with a single candidate, which `start` would not.
    #[test]
    fn timing_a_shape_on_trial_measures_even_a_known_or_single_count() {
        let mut t = Tuner::default();
        let key = Tuner::key(1, 1, 3, false, 4, ScheduleKind::OneFOneB);
        assert_eq!(t.start(key.clone(), vec![4]), 4);
        assert!(!t.running(), "one candidate: nothing to choose");
        assert_eq!(t.time(key.clone(), vec![4]), 4);
        for round in 0..ROUNDS {
            let got = t.record(4, 10.0 + round as f64);
            assert_eq!(got, Some((4, (round + 1 == ROUNDS).then(|| vec![(4, 11.0)]))));
        }
        assert_eq!(t.best.get(&key), Some(&4));
        assert_eq!(t.time(key, vec![2, 4]), 2, "known, timed again from the first");
        assert!(t.running());
        assert_eq!(t.time(Tuner::key(2, 1, 3, false, 4, ScheduleKind::OneFOneB), Vec::new()), 1);
        assert!(!t.running(), "nothing to time");
    }

    /// A timing the run's end cuts short keeps the best count timed so far (the planned first
    /// candidate where none was), and remembers nothing for the shape.
    #[test]
    fn a_timing_cut_short_keeps_the_best_so_far_and_remembers_nothing() {
        let mut t = Tuner::default();
        assert_eq!(t.cut_short(), None, "nothing under way");
        let key = Tuner::key(2, 1, 0, false, 32, ScheduleKind::OneFOneB);
        t.start(key.clone(), vec![2, 4, 8]);
        assert_eq!(t.cut_short(), Some((2, Vec::new())), "none timed: the planned count");
        assert!(!t.running());
        t.start(key.clone(), vec![2, 4, 8]);
        for (m, rate) in [(2, 10.0), (4, 30.0), (8, 20.0), (2, 12.0)] {
            t.record(m, rate);
        }
        assert_eq!(t.cut_short(), Some((4, vec![(2, 12.0), (4, 30.0), (8, 20.0)])));
        assert!(!t.running() && !t.best.contains_key(&key));
    }
}
