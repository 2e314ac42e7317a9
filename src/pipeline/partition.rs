//! The partitioner: cuts the model's unit list into contiguous stages so that the slowest stage
//! is as fast as possible, with every stage's memory (weights, gradients, optimizer state and
//! the activations its schedule keeps in flight) under a per-device limit. Exact: dynamic
//! programming over (stage, last unit), `O(S·N²)` for `N` units, never an empty stage.
//!
//! A *pinned* prefix (PipeTransformer's frozen layers, AutoPipe) always joins the first stage:
//! its cost counts there, but the other stages are cut from the active units only, and every
//! stage holds at least one active unit.
//!
//! A stage may *recompute* activations ([`Recompute`]): of each micro-batch in flight it keeps
//! the input of its first trained unit instead of what its first `r` trained units save, and
//! runs those units' forward again in that micro-batch's backward (Megatron's "block" method).
//! `r` is chosen stage by stage inside the same search, with the extra forward counted in the
//! stage's time.

pub use super::profile::UnitProfile;
use crate::error::{Error, Result, config_error, counted};
use serde::{Deserialize, Serialize};
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

/// Activation recomputation (`pipeline.recompute`; GPipe's re-materialisation): which of a
/// stage's trained units keep, of each micro-batch in flight, nothing but the input of the
/// first of them, and run their forward again in its backward to get back what they saved.
/// Always a run of the stage's trained units from the first ([`Partition::recomputed`]). Less
/// memory for more forward where a stage holds several micro-batches or token slices (one
/// holding a single whole micro-batch saves nothing: it keeps that micro-batch's input
/// besides); the gradients are the same to the bit (dropout's masks are counter-based, so the
/// second forward draws the first one's). The planner counts one micro-batch's activations of
/// the recomputed units per recomputing stage (under token slicing one slice's, the largest each
/// unit regains), and a device of an interleaved schedule sums its stages': a bound, as only
/// one backward runs at a time.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Recompute {
    /// No stage recomputes.
    #[default]
    Off,
    /// Every stage recomputes all its trained units.
    All,
    /// A stage recomputes only where its activations would not fit the memory limit, and
    /// then the fewest of its trained units that make them fit: the partitioner chooses stage
    /// by stage, pricing the forward it adds.
    Auto,
}

impl Recompute {
    /// Whether this policy recomputes at least the units `other` does, for the same stages
    /// and limit (`all` ⊇ `auto` ⊇ `off`).
    pub fn at_least(self, other: Recompute) -> bool {
        let rank = |r: Recompute| match r {
            Recompute::Off => 0,
            Recompute::Auto => 1,
            Recompute::All => 2,
        };
        rank(self) >= rank(other)
    }
}

impl std::str::FromStr for Recompute {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "off" => Ok(Recompute::Off),
            "all" => Ok(Recompute::All),
            "auto" => Ok(Recompute::Auto),
            _ => Err(config_error("recompute", format!("unknown recompute policy `{s}`; expected off, all or auto"))),
        }
    }
}

impl std::fmt::Display for Recompute {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Recompute::Off => "off",
            Recompute::All => "all",
            Recompute::Auto => "auto",
        })
    }
}

/// Stage boundaries and what each stage costs.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Partition {
    /// Units of each stage, in order, covering all units.
    pub stages: Vec<Range<usize>>,
    /// Seconds per micro-batch of each stage (with a recomputing stage's second forward).
    pub stage_time: Vec<f64>,
    /// Of those, the forward's (a stage of frozen units is all forward).
    pub stage_forward: Vec<f64>,
    /// Peak bytes of each stage (parameters and state, plus activations in flight).
    pub stage_memory: Vec<usize>,
    /// The units each stage runs forward again in its backwards ([`Recompute`]): its trained
    /// units from the first, all or some; empty where it keeps every activation.
    pub recomputed: Vec<Range<usize>>,
}

impl Partition {
    /// The costs of given stage boundaries (a plan restored from a checkpoint), each stage
    /// recomputing as `recompute` decides within `limit` (not held to it: see
    /// [`Plan::within_limit`](super::Plan::within_limit)). Errors when the ranges do not cover
    /// `units` in order with non-empty stages.
    pub fn of(
        units: &[UnitProfile],
        stages: Vec<Range<usize>>,
        in_flight: &[usize],
        recompute: Recompute,
        limit: Option<usize>,
    ) -> Result<Partition> {
        if !covers(&stages, units.len()) || in_flight.len() != stages.len() {
            return Err(config_error(
                "partition",
                format!("stages {stages:?} do not cover the model's {} units in order", units.len()),
            ));
        }
        let costs = StageCosts::new(units, in_flight, recompute);
        let limit = limit.unwrap_or(usize::MAX);
        Ok(costs.partition(stages.iter().enumerate().map(|(s, r)| costs.chosen(s, r, limit)).collect(), stages))
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

    /// The units stage `s` runs forward again once the units below `first_trainable` are
    /// frozen: a freeze since the plan was made leaves fewer to run (and their input is the
    /// first still trained one's). Empty where the stage recomputes nothing.
    pub fn recomputed_units(&self, s: usize, first_trainable: usize) -> Range<usize> {
        let r = self.recomputed.get(s).cloned().unwrap_or_default();
        r.start.max(first_trainable).min(r.end)..r.end
    }

    /// [`recomputed_units`](Self::recomputed_units) in words, as the plan's table numbers
    /// units: "units 0..3" (inclusive), "unit 5"; `None` where there are none.
    pub fn recomputed_text(&self, s: usize, first_trainable: usize) -> Option<String> {
        let r = self.recomputed_units(s, first_trainable);
        match r.len() {
            0 => None,
            1 => Some(format!("unit {}", r.start)),
            _ => Some(format!("units {}..{}", r.start, r.end - 1)),
        }
    }
}

/// One stage's cost per micro-batch as planned.
#[derive(Clone, Debug, PartialEq)]
struct StageCost {
    time: f64,
    forward: f64,
    memory: usize,
    recomputed: Range<usize>,
}

/// What any run of the units costs as a stage, in O(1) from prefix sums: plain, or
/// recomputing some of its activations, as a [`Recompute`] policy allows.
struct StageCosts<'a> {
    units: &'a [UnitProfile],
    in_flight: &'a [usize],
    recompute: Recompute,
    /// Prefix sums: time, forward time, the trained units' forward time, state bytes, bytes
    /// per micro-batch in flight, of those the ones a recomputing stage drops, and what it
    /// holds again while one backward runs.
    time: Vec<f64>,
    forward: Vec<f64>,
    trained_forward: Vec<f64>,
    state: Vec<usize>,
    acts: Vec<usize>,
    recomputable: Vec<usize>,
    regained: Vec<usize>,
    /// The first trained unit at or after each index (`N` where none is).
    next_trained: Vec<usize>,
}

impl<'a> StageCosts<'a> {
    fn new(units: &'a [UnitProfile], in_flight: &'a [usize], recompute: Recompute) -> Self {
        let n = units.len();
        let mut c = StageCosts {
            units,
            in_flight,
            recompute,
            time: vec![0.0; n + 1],
            forward: vec![0.0; n + 1],
            trained_forward: vec![0.0; n + 1],
            state: vec![0; n + 1],
            acts: vec![0; n + 1],
            recomputable: vec![0; n + 1],
            regained: vec![0; n + 1],
            next_trained: vec![n; n + 1],
        };
        for (i, u) in units.iter().enumerate() {
            c.time[i + 1] = c.time[i] + u.time();
            c.forward[i + 1] = c.forward[i] + u.forward;
            c.trained_forward[i + 1] = c.trained_forward[i] + if u.trainable { u.forward } else { 0.0 };
            c.state[i + 1] = c.state[i] + u.state_bytes();
            c.acts[i + 1] = c.acts[i] + u.in_flight_bytes();
            c.recomputable[i + 1] = c.recomputable[i] + u.recomputable_bytes();
            c.regained[i + 1] = c.regained[i] + u.regained_bytes();
        }
        for i in (0..n).rev() {
            c.next_trained[i] = if units[i].trainable { i } else { c.next_trained[i + 1] };
        }
        c
    }

    /// Stage `s` as the units `r`, keeping every micro-batch's activations.
    fn plain(&self, s: usize, r: &Range<usize>) -> StageCost {
        let acts = self.acts[r.end] - self.acts[r.start];
        StageCost {
            time: self.time[r.end] - self.time[r.start],
            forward: self.forward[r.end] - self.forward[r.start],
            memory: self.state[r.end] - self.state[r.start] + self.in_flight[s] * acts,
            recomputed: r.start..r.start,
        }
    }

    /// Stage `s` as the units `r`, recomputing each of them: a run from its first trained
    /// unit, shortest first. Empty where the stage trains nothing.
    fn recomputings<'b>(&'b self, s: usize, r: &'b Range<usize>) -> impl DoubleEndedIterator<Item = StageCost> + 'b {
        let first = self.next_trained[r.start];
        (first + 1..=r.end).map(move |end| self.recomputing(s, r, first..end))
    }

    /// Stage `s` as the units `r`, recomputing the units `again` (from its first trained one):
    /// each micro-batch in flight keeps their input and what the units after them save (and
    /// under token slicing their key/value arenas), and the backward that runs holds their
    /// activations again (of one micro-batch, or under token slicing of one slice); their
    /// forward runs twice.
    fn recomputing(&self, s: usize, r: &Range<usize>, again: Range<usize>) -> StageCost {
        let plain = self.plain(s, r);
        let acts = self.acts[r.end] - self.acts[r.start];
        let dropped = self.recomputable[again.end] - self.recomputable[again.start];
        let regained = self.regained[again.end] - self.regained[again.start];
        let kept = self.units[again.start].input_bytes + acts - dropped;
        StageCost {
            time: plain.time + self.trained_forward[again.end] - self.trained_forward[again.start],
            memory: self.state[r.end] - self.state[r.start] + self.in_flight[s] * kept + regained,
            recomputed: again,
            ..plain
        }
    }

    /// Stage `s` as the units `r` as the policy plans it for `limit` (which the cost may
    /// still exceed): `auto` recomputes only where the plain stage does not fit, and then the
    /// fewest units that fit (the least time), or where none does, the least memory.
    fn chosen(&self, s: usize, r: &Range<usize>, limit: usize) -> StageCost {
        let plain = self.plain(s, r);
        match self.recompute {
            Recompute::Off => plain,
            Recompute::All => self.recomputings(s, r).next_back().unwrap_or(plain),
            Recompute::Auto if plain.memory <= limit => plain,
            // Recomputing all its trained units keeps the least (not less than plain where the
            // stage holds a single whole micro-batch: it then stays plain).
            Recompute::Auto => match self.recomputings(s, r).next_back().filter(|c| c.memory < plain.memory) {
                Some(least) => self.fewest_within(s, r, limit.max(least.memory)),
                None => plain,
            },
        }
    }

    /// Stage `s` as the units `r`, recomputing the fewest trained units that bring it within
    /// `cap`, which recomputing all of them meets. A binary search: each unit more recomputed
    /// keeps its activations for one micro-batch (or slice) instead of for each in flight, so
    /// the memory falls (or stays) with every unit added where the stage holds at least one.
    fn fewest_within(&self, s: usize, r: &Range<usize>, cap: usize) -> StageCost {
        let first = self.next_trained[r.start];
        let (mut lo, mut hi) = (first + 1, r.end);
        while lo < hi {
            let mid = (lo + hi) / 2;
            match self.recomputing(s, r, first..mid).memory <= cap {
                true => hi = mid,
                false => lo = mid + 1,
            }
        }
        self.recomputing(s, r, first..lo)
    }

    /// [`chosen`](Self::chosen) where it fits `limit`.
    fn within(&self, s: usize, r: &Range<usize>, limit: usize) -> Option<StageCost> {
        Some(self.chosen(s, r, limit)).filter(|c| c.memory <= limit)
    }

    /// The least memory the policy lets stage `s` as the units `r` take: as planned for no
    /// room at all.
    fn least_memory(&self, s: usize, r: &Range<usize>) -> usize {
        self.chosen(s, r, 0).memory
    }

    /// The partition of `stages` at `costs`.
    fn partition(&self, costs: Vec<StageCost>, stages: Vec<Range<usize>>) -> Partition {
        Partition {
            stage_time: costs.iter().map(|c| c.time).collect(),
            stage_forward: costs.iter().map(|c| c.forward).collect(),
            stage_memory: costs.iter().map(|c| c.memory).collect(),
            recomputed: costs.iter().map(|c| c.recomputed.clone()).collect(),
            stages,
        }
    }
}

/// Every memory a stage of `units` could take under `recompute`, as any run of them (or as
/// `given`, stage `s` as `given[s]`) with the counts `in_flight`: the per-stage limits that
/// change a split or what its stages recompute ([`Plan`](super::Plan)'s search for an
/// interleaved schedule's devices).
pub(super) fn stage_memories(
    units: &[UnitProfile],
    in_flight: &[usize],
    recompute: Recompute,
    given: Option<&[Range<usize>]>,
) -> Vec<usize> {
    let costs = StageCosts::new(units, in_flight, recompute);
    let n = units.len();
    let runs = |s: usize| -> Vec<Range<usize>> {
        match given {
            Some(stages) => stages.get(s).cloned().into_iter().collect(),
            None => (0..n).flat_map(|i| (i + 1..=n).map(move |j| i..j)).collect(),
        }
    };
    let mut all = Vec::new();
    for s in 0..in_flight.len() {
        for r in runs(s) {
            all.push(costs.plain(s, &r).memory);
            match recompute {
                Recompute::Off => {}
                Recompute::All => all.extend(costs.recomputings(s, &r).next_back().map(|c| c.memory)),
                Recompute::Auto => all.extend(costs.recomputings(s, &r).map(|c| c.memory)),
            }
        }
    }
    all
}

/// Splits `units` into `stages` contiguous stages minimising the slowest stage's time, where
/// stage `s` holds `in_flight[s]` micro-batches of activations at its peak, every stage's
/// memory stays within `memory_limit` bytes (when given), each stage recomputing its
/// activations as `recompute` allows, the first `pinned` units belong to stage 0, and every
/// stage holds at least one unit after them.
///
/// Errors, before any work: more stages than units to cut, no stage, or a limit no partition
/// meets (the message gives the smallest peak any partition reaches).
pub fn partition(
    units: &[UnitProfile],
    stages: usize,
    in_flight: &[usize],
    memory_limit: Option<usize>,
    pinned: usize,
    recompute: Recompute,
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
    let costs = StageCosts::new(units, in_flight, recompute);

    // best[s][j]: the smallest bottleneck of units 0..j in stages 0..=s; cut[s][j] the start of
    // stage s in that split.
    let limit = memory_limit.unwrap_or(usize::MAX);
    let mut best = vec![vec![f64::INFINITY; n + 1]; stages];
    let mut cut = vec![vec![0usize; n + 1]; stages];
    for (j, b) in best[0].iter_mut().enumerate().skip(pinned + 1) {
        if let Some(c) = costs.within(0, &(0..j), limit) {
            *b = c.time;
        }
    }
    for s in 1..stages {
        for j in pinned + s + 1..=n {
            for i in pinned + s..j {
                if !best[s - 1][i].is_finite() {
                    continue;
                }
                if let Some(c) = costs.within(s, &(i..j), limit) {
                    let b = best[s - 1][i].max(c.time);
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
        let need = min_peak_memory(n, stages, pinned, &|s, r| costs.least_memory(s, r));
        return Err(Error::Config {
            field: "memory_limit".into(),
            message: format!(
                "no split of {} into {} fits in {limit} bytes per device; the best split needs {need} bytes",
                counted(n, "unit"),
                counted(stages, "stage")
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
    Ok(costs.partition(ranges.iter().enumerate().map(|(s, r)| costs.chosen(s, r, limit)).collect(), ranges))
}

/// The least memory any stage of a split of `units` takes at most, each stage `s` holding
/// `in_flight[s]` micro-batches and recomputing as `recompute` allows, the first `pinned`
/// units on the first stage, over every split or of the `given` stages: the smallest limit
/// [`partition`] meets with them.
pub(super) fn least_peak(
    units: &[UnitProfile],
    in_flight: &[usize],
    pinned: usize,
    recompute: Recompute,
    given: Option<&[Range<usize>]>,
) -> usize {
    let costs = StageCosts::new(units, in_flight, recompute);
    match given {
        Some(stages) => stages.iter().enumerate().map(|(s, r)| costs.least_memory(s, r)).max().unwrap_or(0),
        None => min_peak_memory(units.len(), in_flight.len(), pinned, &|s, r| costs.least_memory(s, r)),
    }
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

    /// Every split by brute force: the smallest bottleneck among those within the limit, each
    /// stage plain or recomputing as `policy` allows (written out here from the definition: a
    /// stage recomputing its trained units from the first up to some unit keeps, per
    /// micro-batch in flight, the first one's input, the later units' activations and the
    /// recomputed units' key/value arenas, plus one micro-batch's rest of the recomputed
    /// units' activations, and runs their forward twice).
    fn brute(
        units: &[UnitProfile],
        stages: usize,
        in_flight: &[usize],
        limit: usize,
        pinned: usize,
        policy: Recompute,
    ) -> Option<f64> {
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
                let state: usize = us.iter().map(|u| u.state_bytes()).sum();
                let acts: usize = us.iter().map(UnitProfile::in_flight_bytes).sum();
                let time: f64 = us.iter().map(UnitProfile::time).sum();
                let plain = (time, state + in_flight[s] * acts);
                let first = us.iter().position(|u| u.trainable).unwrap_or(us.len());
                let again: Vec<(f64, usize)> = (first + 1..=us.len())
                    .map(|end| {
                        let forward: f64 = us[first..end].iter().filter(|u| u.trainable).map(|u| u.forward).sum();
                        (time + forward, memory_of(us, in_flight[s], end - first))
                    })
                    .collect();
                let options = match policy {
                    Recompute::Off => vec![plain],
                    Recompute::All => vec![again.last().copied().unwrap_or(plain)],
                    Recompute::Auto => std::iter::once(plain).chain(again).collect(),
                };
                match options.into_iter().filter(|o| o.1 <= limit).map(|o| o.0).min_by(f64::total_cmp) {
                    Some(t) => worst = worst.max(t),
                    None => fits = false,
                }
            }
            if fits {
                best = Some(best.map_or(worst, |b| b.min(worst)));
            }
        }
        best
    }

    /// A stage of `us` holding `in_flight` micro-batches, recomputing its first `n` trained
    /// units (none: plain), by the definition in [`brute`].
    fn memory_of(us: &[UnitProfile], in_flight: usize, n: usize) -> usize {
        let state: usize = us.iter().map(|u| u.state_bytes()).sum();
        let acts: usize = us.iter().map(UnitProfile::in_flight_bytes).sum();
        let first = us.iter().position(|u| u.trainable).unwrap_or(us.len());
        if n == 0 {
            return state + in_flight * acts;
        }
        let dropped: usize = us[first..first + n].iter().map(recomputable).sum();
        let regained: usize =
            us[first..first + n].iter().map(|u| u.slice_regained_bytes.unwrap_or(recomputable(u))).sum();
        state + in_flight * (us[first].input_bytes + acts - dropped) + regained
    }

    /// All a unit keeps but a token slicing's key/value arena (its keys and values,
    /// `frozen_arena_bytes` once sliced, and a trained unit's gradients of them) and the
    /// logits' gradient: what a stage recomputing it keeps once.
    fn recomputable(u: &UnitProfile) -> usize {
        let kv = match u.frozen_arena_bytes {
            0 => 0,
            kv => kv + if u.trainable { u.kv_grad_bytes } else { 0 },
        };
        u.in_flight_bytes().saturating_sub(kv + if u.trainable { u.loss_grad_bytes } else { 0 })
    }

    #[test]
    fn matches_brute_force_on_uneven_units_and_limits() {
        let mut rng = crate::rng::Rng::new(3);
        for trial in 0..600 {
            let policy = [Recompute::Off, Recompute::All, Recompute::Auto][trial % 3];
            let n = 2 + (trial / 3) % 9;
            let units: Vec<UnitProfile> = (0..n)
                .map(|_| UnitProfile {
                    forward: rng.uniform(),
                    backward: 2.0 * rng.uniform(),
                    params: rng.below(50) as usize,
                    activation_bytes: rng.below(400) as usize,
                    trainable: rng.below(4) != 0,
                    weight_pack_bytes: rng.below(200) as usize,
                    // (A sliced attention's arena: what a frozen unit keeps, and what a trained
                    // one's recomputation cannot drop.)
                    frozen_arena_bytes: if rng.below(2) == 0 { rng.below(100) as usize } else { 0 },
                    kv_grad_bytes: rng.below(80) as usize,
                    loss_grad_bytes: if rng.below(4) == 0 { rng.below(120) as usize } else { 0 },
                    input_bytes: rng.below(150) as usize,
                    ..Default::default()
                })
                .collect();
            // (Under token slicing a backward regains one slice's activations: at most all.)
            let units: Vec<UnitProfile> = units
                .into_iter()
                .map(|u| match rng.below(2) {
                    0 => {
                        UnitProfile { slice_regained_bytes: Some(rng.below(recomputable(&u) as u64 + 1) as usize), ..u }
                    }
                    _ => u,
                })
                .collect();
            let pinned = if trial % 4 == 0 { rng.below(n as u64) as usize } else { 0 };
            let stages = 1 + trial % (n - pinned);
            let in_flight: Vec<usize> = (0..stages).map(|s| stages - s).collect();
            let limit = 300 + rng.below(3000) as usize;
            let want = brute(&units, stages, &in_flight, limit, pinned, policy);
            let what = format!("trial {trial}, recompute {policy}");
            match partition(&units, stages, &in_flight, Some(limit), pinned, policy) {
                Ok(p) => {
                    let want = want.unwrap_or_else(|| panic!("{what}: brute force found no split"));
                    assert!((p.bottleneck() - want).abs() < 1e-9, "{what}: {} vs {want}", p.bottleneck());
                    assert!(p.stages.iter().all(|r| !r.is_empty()));
                    assert!(p.stages[0].end > pinned, "{what}: stage 0 holds only pinned units");
                    assert!(p.stage_memory.iter().all(|&m| m <= limit));
                    // The costs of its own stages, recounted, are the ones it reports.
                    let again = Partition::of(&units, p.stages.clone(), &in_flight, policy, Some(limit)).unwrap();
                    assert_eq!(again, p, "{what}");
                    if policy == Recompute::Off {
                        assert!(p.recomputed.iter().all(Range::is_empty), "{what}");
                    }
                    // What each stage recomputes is a run of its units from its first trained one;
                    // under `auto`, no shorter run (nor none) fits the limit.
                    for (s, (r, again)) in p.stages.iter().zip(&p.recomputed).enumerate() {
                        let first = (r.start..r.end).find(|&u| units[u].trainable);
                        assert!(again.is_empty() || (Some(again.start) == first && again.end <= r.end), "{what}");
                        if policy == Recompute::Auto && !again.is_empty() {
                            let shorter = memory_of(&units[r.clone()], in_flight[s], again.len() - 1);
                            assert!(shorter > limit, "{what}, stage {s}: {again:?} where one unit fewer fits");
                        }
                    }
                }
                Err(e) => assert_eq!(want, None, "{what}: {e}"),
            }
        }
    }

    /// `auto` recomputes only the stage that would not fit, only as many of its units as it
    /// needs, and prices their second forward: four equal units at 1F1B's counts (2, 1) under
    /// limits that hold stage 0's state and one micro-batch but not two.
    #[test]
    fn auto_recomputes_only_the_units_that_need_it() {
        let units: Vec<UnitProfile> = (0..4).map(|_| UnitProfile { input_bytes: 10, ..unit(3.0) }).collect();
        // Plain 2 | 2: 2·160 + 2·200 = 720 B on stage 0, 520 B on stage 1. Recomputing unit 0,
        // stage 0 keeps per micro-batch its input and unit 1's activations (10 + 100 B) and
        // one micro-batch's of unit 0 (100 B): 640 B. Recomputing both, 2·10 + 200: 540 B.
        assert!(partition(&units, 2, &[2, 1], Some(650), 0, Recompute::Off).is_err());
        let p = partition(&units, 2, &[2, 1], Some(650), 0, Recompute::Auto).unwrap();
        assert_eq!(p.stages, vec![0..2, 2..4]);
        assert_eq!(p.recomputed, vec![0..1, 2..2]);
        assert_eq!(p.stage_memory, vec![2 * 160 + 2 * (10 + 100) + 100, 2 * 160 + 200]);
        assert_eq!(p.stage_time, vec![6.0 + 1.0, 6.0], "one more forward (1 of each unit's 3) of unit 0");
        assert_eq!(p.stage_forward, vec![2.0, 2.0]);
        let p = partition(&units, 2, &[2, 1], Some(600), 0, Recompute::Auto).unwrap();
        assert_eq!(p.recomputed, vec![0..2, 2..2]);
        assert_eq!(p.stage_memory, vec![2 * 160 + 2 * 10 + 200, 2 * 160 + 200]);
        assert_eq!(p.stage_time, vec![6.0 + 2.0, 6.0]);
        // `all` recomputes every trained unit; without a limit `auto` recomputes none.
        let all = partition(&units, 2, &[2, 1], Some(650), 0, Recompute::All).unwrap();
        assert_eq!(all.recomputed, vec![0..2, 2..4]);
        assert!(
            partition(&units, 2, &[2, 1], None, 0, Recompute::Auto).unwrap().recomputed.iter().all(Range::is_empty)
        );
        // A frozen unit is not recomputed: it keeps nothing anyway.
        let mut frozen = units.clone();
        frozen[0].trainable = false;
        frozen[1].trainable = false;
        assert_eq!(partition(&frozen, 2, &[2, 1], None, 2, Recompute::All).unwrap().recomputed, vec![2..3, 3..4]);
        let p = Partition::of(&frozen, vec![0..2, 2..4], &[2, 1], Recompute::All, None).unwrap();
        assert_eq!(p.recomputed, vec![0..0, 2..4]);
        // A freeze after the plan leaves fewer units to run again.
        assert_eq!(all.recomputed_units(0, 1), 1..2);
        assert!(all.recomputed_units(0, 2).is_empty());
        let texts: Vec<_> = [0, 1, 2].iter().map(|&f| all.recomputed_text(0, f)).collect();
        assert_eq!(texts, [Some("units 0..1".to_string()), Some("unit 1".to_string()), None]);
        // The refusal names the least any split needs, recomputing.
        let e = partition(&units, 2, &[2, 1], Some(500), 0, Recompute::Auto).unwrap_err().to_string();
        assert!(e.contains("best split needs 540 bytes"), "{e}");
    }

    #[test]
    fn balances_equal_units_evenly() {
        let p = partition(&vec![unit(1.0); 12], 4, &[4, 3, 2, 1], None, 0, Recompute::Off).unwrap();
        assert_eq!(p.stages, vec![0..3, 3..6, 6..9, 9..12]);
    }

    #[test]
    fn frozen_units_cost_forward_only_and_keep_no_activations() {
        let mut units = vec![unit(3.0); 4];
        units[0].trainable = false;
        units[1].trainable = false;
        // Times 1, 1, 3, 3 (frozen units run forward only): the best cut is after unit 2 (5 | 3).
        let p = partition(&units, 2, &[2, 1], None, 0, Recompute::Off).unwrap();
        assert_eq!(p.stages, vec![0..3, 3..4]);
        assert_eq!(p.stage_memory[0], 2 * 40 + 160 + 2 * 100);
    }

    #[test]
    fn impossible_requests_are_refused_before_any_work() {
        let units = vec![unit(1.0); 3];
        let e = partition(&units, 4, &[1; 4], None, 0, Recompute::Off).unwrap_err().to_string();
        assert!(e.contains("4 stages") && e.contains("3 units"), "{e}");
        let e = partition(&units, 3, &[1; 3], Some(100), 0, Recompute::Off).unwrap_err().to_string();
        assert!(e.contains("best split needs 260 bytes"), "{e}");
        assert!(partition(&units, 0, &[], None, 0, Recompute::Off).is_err());
        let e = partition(&units, 2, &[1; 2], None, 2, Recompute::Off).unwrap_err().to_string();
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
        let p = partition(&units, 2, &[2, 1], None, 4, Recompute::Off).unwrap();
        assert_eq!(p.stages, vec![0..5, 5..6]);
    }
}
