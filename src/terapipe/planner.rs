//! The slicing planner (reference notes, pipelines.md A.2–A.3): choose micro-batch sizes
//! `b_1..b_m` (Σ = B) and, per micro-batch, token slices `l_1..l_n` (Σ = L, on the grid) that
//! minimise
//!
//! ```text
//! T = Σ over every slice of t(b, l, c)  +  (K − 1) · max t(b, l, c)
//! ```
//!
//! the step time of a `K`-stage pipeline of homogeneous stages (the sum is one stage's work, the
//! second term fill and drain).
//!
//! **Search.** The `max` couples the slices, so TeraPipe fixes a cap `t_max` and solves a 1-D
//! DP for the least summed time with every slice under the cap, then scores the result with its
//! *actual* largest slice. The caps worth trying are the distinct slice times. Every candidate's
//! plan is real, and the optimum is found at the candidate equal to its own largest slice, so the
//! minimum over candidates is exact. What makes it fast is pruning, and every rule here is exact:
//!
//! - a first plan comes free (equal slices of every length, micro-batches of 1 or of B), then
//!   the uncapped solve gives `S_min`, the least summed time at all;
//! - a plan whose largest slice is `t'` costs at least `max(S_min, t') + (K − 1)·t'` (this
//!   contains the paper's `K·t' > best` stop), and caps below the bottleneck (the least possible
//!   largest slice) admit no plan: the candidates are the slice times between the two;
//! - [`Search::BranchAndBound`] (default) bisects the sorted candidates: the least summed time
//!   `S*(t)` only falls as the cap grows, so once `S*` is known at the top of a range, every plan
//!   with its largest slice in `[t_lo, t_hi]` costs at least `max(S*(t_hi), t_lo) + (K − 1)·t_lo`,
//!   and the range is dropped when that exceeds the best plan so far (ties are kept). Measured
//!   here: tens of DP solves where the scan needs thousands (the bench prints both).
//!   [`Search::Scan`] is the paper's ascending scan with the `K·t_max > best` stop, in blocks of
//!   64 candidates evaluated in parallel: the reference the tests hold the default to.
//!
//! Both searches evaluate a set of candidates that does not depend on threads: each level (B&B)
//! or block (scan) is evaluated in parallel against the best plan as of its start, and merged in
//! candidate order, so `parallel: false` returns exactly the same plan.
//!
//! **Ties** are broken by a total order: the smaller objective, then the smaller largest slice,
//! then fewer slices, then the micro-batches (sorted by size, then slice lengths: their order
//! does not change the cost) compared lexicographically. Inside one cap the DP keeps, among equal
//! summed times, the fewest slices and then the smallest first slice; that makes the order exact
//! when objectives are equal as numbers (a test builds such ties from powers of two). With
//! objectives equal only up to rounding, which plan wins can depend on how sums were rounded,
//! and under a memory limit the constrained DP keeps one plan per (time, memory) pair without
//! looking further, so there the tie-break is deterministic but not guaranteed to be this order.
//!
//! **Approximation (off by default).** `epsilon > 0` merges candidates within `epsilon` of the
//! first of a cluster into one, evaluated at the cluster's largest value: the plan costs at most
//! `(K − 1)·epsilon` more than the optimum.
//!
//! **Memory.** See [`SliceSchedule`].
//!
//! - *GPipe over slices*: every slice is resident, and the bytes are
//!   `fixed + Σ b·(L·per_token + per_score·(L² + Σ l²)/2)`, affine in `Σ b·Σ l²`, so the limit is a
//!   budget on that integer (sliced plans also pay the key/value arenas, `sliced_bytes`; the
//!   unsliced plan, which keeps none but saves its keys and values with its activations,
//!   `unsliced_bytes`, is weighed apart where micro-batches share one slicing).
//! - *1F1B over slices*: stage 0 holds `K` micro-batches, every slice of each: the same budget
//!   over the resident sequences (`min(K, M)` where `M` micro-batches share one slicing; every
//!   sequence, a bound, where each micro-batch has its own; a later stage, which holds fewer,
//!   carries its share in its memory model). The DP first ignores it (its plan is kept when it fits); otherwise it
//!   keeps, per start position, the Pareto frontier of (time, `Σ l²`) of the suffixes, pruned by a
//!   Lagrangian bound (the budget priced at the multiplier that maximises the dual, found by
//!   bisection with plain DPs), and combines micro-batch sizes as Pareto sums. Exact. Cost,
//!   measured on the bench's GPT-3-like model with a limit half-way between the finest slicing's
//!   need and the free plan's: B = 1, L = 2048: ~0.1 s; L = 8192: 2–12 s; B = 2–4, L = 2048:
//!   0.2–8 s. Combining many micro-batches is the part with no polynomial bound (Pareto sums of
//!   frontiers with thousands of points); past a work limit per solve the planner retries in a
//!   narrower range and, if a single candidate still exceeds it, returns an error (B = 8, K = 8,
//!   L = 2048 does, after about a minute); shared slicing, what the runtime plans, has one.
//!   The finest grid slicing needs the least memory of any sliced plan, so when it does not
//!   fit on every stage the error says so at once, with the bytes the least plan needs (the
//!   finest slicing's, or the unsliced plan's where it shares one slicing and keeps no arena).
//!
//! **Stages.** Every stage runs the one slicing, and each has its own memory model
//! ([`PlannerConfig::memory`]): the DP's budget is the tightest stage's (each stage's bytes grow
//! with the same `Σ b·Σ l²`), and a plan's peak the largest stage's.
//!
//! **Joint batch × token (A.3).** Each micro-batch gets its own slicing (without a GPipe limit,
//! micro-batches of one size share the best one); `g[B'] = min_b g[B' − b] + f[b]`.
//!
//! **Shared slicing** ([`PlannerConfig::shared`], what the pipeline runtime runs): `M`
//! micro-batches that all take one slicing. Their step is `M·Σ t + (K − 1)·max t`, which is `M`
//! times one sequence's objective with the lag `(K − 1)/M`, and each resident copy (`M` under
//! GPipe, `min(K, M)` under 1F1B) its share of the budget on `Σ l²`: the same exact search on one sequence's tables, every `K − 1` above
//! (the bounds, the scan's `K·t` stop) read as that lag. (Under a GPipe limit
//! the per-micro-batch optimum may trade memory between micro-batches, and the best slicing
//! they can share is not one of its slicings.)

use super::dp::{Constraint, Eval, Outcome, Problem, Table};
use super::latency::LatencyModel;
use super::memory::{MemoryModel, SliceSchedule, human_bytes};
use crate::error::{Result, config_error, internal};
use rayon::prelude::*;
use std::fmt;

/// How the candidate caps are searched. Both are exact (with `epsilon = 0`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Search {
    /// Bisection over the sorted candidates with the `S*` lower bound (module docs).
    #[default]
    BranchAndBound,
    /// The paper's ascending scan with the `K·t_max > best` stop, blocks of 64 in parallel.
    Scan,
}

/// What to plan for.
#[derive(Clone, Debug, PartialEq)]
pub struct PlannerConfig {
    /// Pipeline stages `K` (at least 1).
    pub stages: usize,
    /// Tokens per sequence `L`: a multiple of the latency model's grid step.
    pub seq_len: usize,
    /// Sequences per step `B`, to split into micro-batches.
    pub batch: usize,
    /// Memory models, one per pipeline stage (or any set whose every member must fit):
    /// activation bytes per slice, and what is resident regardless. Every stage runs the one
    /// slicing, and each must fit the limit (stages differ: the first holds the embeddings,
    /// the last the head's logits); the peak reported is the largest. The planner counts the
    /// schedule's resident sequences on each ([`SliceSchedule`]: stage 0's under 1F1B); a stage
    /// that holds fewer carries its share in its model, as
    /// [`SlicingProfile::pipeline_memory`](super::SlicingProfile::pipeline_memory)'s do (for
    /// micro-batches that share one slicing). None: nothing is kept, and no limit can be
    /// checked.
    pub memory: Vec<MemoryModel>,
    /// Bytes of one device, if memory is to be checked.
    pub memory_limit: Option<usize>,
    /// The schedule whose residency the memory limit and the reported peak refer to.
    pub schedule: SliceSchedule,
    /// Candidate caps within `epsilon` seconds of each other are merged (0: exact).
    pub epsilon: f64,
    /// The search over candidate caps.
    pub search: Search,
    /// Evaluate candidates (and build tables) on the rayon pool. Same result either way.
    pub parallel: bool,
    /// The `batch` is that many micro-batches of one sequence that all run one slicing (as the
    /// pipeline runtime cuts them): the best such slicing, not the best per micro-batch.
    pub shared: bool,
}

impl PlannerConfig {
    /// `K` stages, `L` tokens, `B` sequences; no memory model or limit, GPipe, exact,
    /// branch-and-bound, parallel.
    pub fn new(stages: usize, seq_len: usize, batch: usize) -> PlannerConfig {
        PlannerConfig {
            stages,
            seq_len,
            batch,
            memory: Vec::new(),
            memory_limit: None,
            schedule: SliceSchedule::Gpipe,
            epsilon: 0.0,
            search: Search::BranchAndBound,
            parallel: true,
            shared: false,
        }
    }
}

/// One micro-batch of a plan: how many sequences, and its token slices in order.
#[derive(Clone, Debug, Default, PartialEq, Eq, PartialOrd, Ord)]
pub struct MicroBatchSlicing {
    /// Sequences in the micro-batch.
    pub samples: usize,
    /// Slice lengths in tokens, first slice first (they sum to the sequence length).
    pub slices: Vec<usize>,
}

/// How much searching a plan took.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SearchStats {
    /// Distinct candidate caps left after the bounds that need no DP.
    pub candidates: usize,
    /// DP solves (one per evaluated cap, including the uncapped first one).
    pub evaluated: usize,
}

/// The planner's answer.
#[derive(Clone, Debug, PartialEq)]
pub struct SlicingPlan {
    /// Micro-batches, sorted by size then slices (their order does not change the cost).
    pub micro_batches: Vec<MicroBatchSlicing>,
    /// The objective `Σ t + (K − 1)·max t`: predicted seconds per step.
    pub predicted_step_seconds: f64,
    /// The largest slice time.
    pub max_slice_seconds: f64,
    /// Predicted peak bytes per device under the configured schedule (0 without a memory
    /// model): fixed (and, sliced, the key/value arenas) + GPipe, every slice; 1F1B, every
    /// slice of the `K` largest micro-batches.
    pub peak_memory_bytes: usize,
    /// Search effort.
    pub stats: SearchStats,
}

impl SlicingPlan {
    /// Slices over all micro-batches.
    pub fn slice_count(&self) -> usize {
        self.micro_batches.iter().map(|m| m.slices.len()).sum()
    }
}

/// `8×256` for runs of equal slices, comma-separated.
fn runs(slices: &[usize]) -> String {
    let mut out = Vec::new();
    let mut i = 0;
    while i < slices.len() {
        let n = slices[i..].iter().take_while(|&&l| l == slices[i]).count();
        out.push(if n > 1 { format!("{n}×{}", slices[i]) } else { slices[i].to_string() });
        i += n;
    }
    out.join(", ")
}

impl fmt::Display for SlicingPlan {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut groups = Vec::new();
        let mut i = 0;
        let mbs = &self.micro_batches;
        while i < mbs.len() {
            let n = mbs[i..].iter().take_while(|m| *m == &mbs[i]).count();
            let one = format!("{} seq: {} tokens", mbs[i].samples, runs(&mbs[i].slices));
            groups.push(if n > 1 { format!("{n} × ({one})") } else { format!("({one})") });
            i += n;
        }
        let sliced = match self.micro_batches.iter().all(|m| m.slices.len() == 1) {
            true => "unsliced".to_string(),
            false => format!("{} slices", self.slice_count()),
        };
        write!(
            f,
            "{}; {sliced}; predicted step {:.3} ms, largest slice {:.3} ms (its forward and backward on one \
             stage), peak memory {} per device",
            groups.join(" + "),
            self.predicted_step_seconds * 1e3,
            self.max_slice_seconds * 1e3,
            human_bytes(self.peak_memory_bytes)
        )
    }
}

/// The objective of a given slicing (to compare with a plan, or score a hand-made one):
/// `Σ t + (K − 1)·max t` over every slice of every micro-batch, a slice off the latency
/// model's grid priced between its neighbours on it
/// ([`LatencyModel::slice_time_interpolated`]).
pub fn predict_step_seconds(latency: &LatencyModel, stages: usize, micro_batches: &[MicroBatchSlicing]) -> Result<f64> {
    predict_step_and_largest_slice(latency, stages, micro_batches).map(|(step, _)| step)
}

/// [`predict_step_seconds`] and the largest slice's time, as a [`SlicingPlan`] reports them.
pub fn predict_step_and_largest_slice(
    latency: &LatencyModel,
    stages: usize,
    micro_batches: &[MicroBatchSlicing],
) -> Result<(f64, f64)> {
    if stages == 0 {
        return Err(config_error("terapipe.stages", "a pipeline needs at least one stage"));
    }
    let Some(first) = micro_batches.first() else {
        return Err(config_error("terapipe.micro_batches", "a plan needs at least one micro-batch"));
    };
    let len: usize = first.slices.iter().sum();
    let (mut sum, mut max) = (0.0, 0.0f64);
    for m in micro_batches {
        if m.slices.iter().sum::<usize>() != len || m.slices.is_empty() {
            return Err(config_error(
                "terapipe.micro_batches",
                format!("micro-batch slices {:?} do not cover the {len} tokens of the first", m.slices),
            ));
        }
        let mut context = 0;
        for &l in &m.slices {
            let t = latency.slice_time_interpolated(m.samples, l, context)?;
            sum += t;
            max = max.max(t);
            context += l;
        }
    }
    Ok((sum + (stages - 1) as f64 * max, max))
}

/// Plans the slicing of a batch for `config` under `latency`.
pub fn plan(latency: &LatencyModel, config: &PlannerConfig) -> Result<SlicingPlan> {
    let grid = latency.grid();
    let (k, len, batch) = (config.stages, config.seq_len, config.batch);
    if k == 0 {
        return Err(config_error("terapipe.stages", "a pipeline needs at least one stage"));
    }
    if len == 0 || !len.is_multiple_of(grid.step) || len > grid.max_len {
        return Err(config_error(
            "terapipe.seq_len",
            format!(
                "{len} tokens: expected a positive multiple of the latency grid step {} up to {}",
                grid.step, grid.max_len
            ),
        ));
    }
    if batch == 0 || (batch > grid.max_batch && !config.shared) {
        return Err(config_error(
            "terapipe.batch",
            format!("{batch} sequences: expected 1..={} (the latency model's range)", grid.max_batch),
        ));
    }
    if !config.epsilon.is_finite() || config.epsilon < 0.0 {
        return Err(config_error(
            "terapipe.epsilon",
            format!("{}: expected a finite, non-negative gap", config.epsilon),
        ));
    }
    for m in &config.memory {
        m.validate()?;
    }
    if config.memory_limit.is_some() && config.memory.is_empty() {
        return Err(config_error("terapipe.memory", "a memory limit needs a memory model of the stages to check"));
    }
    let units = len / grid.step;
    // Under a limit, micro-batches sharing one slicing weigh the unsliced plan apart (it keeps
    // no key/value arena, only its keys and values), which stands alone where no sliced one
    // fits. (Planned per micro-batch, every plan is charged the arenas: a bound.)
    let apart = config.memory.iter().any(|m| m.sliced_bytes > m.unsliced_bytes);
    let unsliced = match config.memory_limit.is_some() && apart {
        true => unsliced_plan(latency, config)?,
        false => None,
    };
    let constraint = match memory_constraint(config, grid.step, units) {
        Ok(c) => c,
        Err(e) => return unsliced.ok_or(e),
    };
    // Shared: one sequence's problem. Its objective is the step over `M` copies divided by
    // `M` (`Σ t + (K − 1)/M · max t`), and each resident copy has its share of the budget.
    let (copies, lag) = if config.shared { (batch, (k - 1) as f64 / batch as f64) } else { (1, (k - 1) as f64) };
    let constraint = match constraint {
        Constraint::Squares { budget } if config.shared => {
            Constraint::Squares { budget: budget / resident_sequences(config) as u64 }
        }
        c => c,
    };
    let sizes = batch / copies;

    let build = |b: usize| Table::build(latency, b, units, config.parallel);
    let tables: Vec<Table> = (1..=sizes).map(build).collect::<Result<_>>()?;
    let problem = Problem { tables, lag, batch: sizes, units, constraint, parallel: config.parallel };

    // A plan without search, then the uncapped solve: the least summed time at all, and the
    // better of the two plans to prune with.
    let seed = problem.seed();
    let top = problem.evaluate_uncapped(seed.as_ref().map_or(f64::INFINITY, |s| s.step));
    let s_min = top.min_sigma;
    let first = match (seed, top.best) {
        (Some(a), Some(b)) => {
            if b.cmp(&a).is_lt() {
                b
            } else {
                a
            }
        }
        (a, b) => a.or(b).ok_or_else(|| internal("terapipe planner", "no plan although the memory checks passed"))?,
    };
    let lb = |s: f64, low: f64| s.max(low) + lag * low;
    let bottleneck = problem.tables.iter().map(|t| t.bottleneck).fold(f64::INFINITY, f64::min);
    let mut caps: Vec<f64> = problem
        .tables
        .iter()
        .flat_map(|t| t.times().iter().copied())
        .filter(|&t| t >= bottleneck && lb(s_min, t) <= first.step)
        .collect();
    if config.parallel {
        caps.par_sort_unstable_by(f64::total_cmp);
    } else {
        caps.sort_unstable_by(f64::total_cmp);
    }
    caps.dedup();
    let (caps, lows) = thin(&caps, config.epsilon);
    let mut search =
        SearchState { problem: &problem, caps: &caps, lows: &lows, best: first, evaluated: 1, overflow: false };
    match config.search {
        Search::BranchAndBound => search.branch_and_bound(s_min),
        Search::Scan => search.scan(),
    }
    if search.overflow {
        return Err(config_error(
            "terapipe.memory_limit",
            format!(
                "exact planning under a memory limit with a batch of {batch} sequences exceeds its work limit \
                 (combining the micro-batches' memory/time trade-offs); plan one slicing the micro-batches \
                 share (PlannerConfig::shared), a smaller batch (terapipe.batch), or no limit"
            ),
        ));
    }
    let best = search.best;
    let stats = SearchStats { candidates: caps.len(), evaluated: search.evaluated };
    let mut planned = finish(best, config, grid.step, stats);
    if copies > 1 {
        planned.micro_batches = planned.micro_batches.iter().cycle().take(copies).cloned().collect();
        planned.predicted_step_seconds = predict_step_seconds(latency, k, &planned.micro_batches)?;
        planned.peak_memory_bytes = peak_memory_bytes(config, &planned.micro_batches);
    }
    Ok(match unsliced {
        Some(whole) if whole.predicted_step_seconds <= planned.predicted_step_seconds => whole,
        _ => planned,
    })
}

/// Sequences whose every slice a stage holds at once under `config`'s schedule: every one
/// under GPipe (every forward, then every backward); under 1F1B over slices, `K` micro-batches'
/// (stage `s` forwards `K − s` micro-batches, every slice of each, before its first backward):
/// `min(K, M)` sequences where `M` micro-batches of one sequence share one slicing. Planned per
/// micro-batch (not shared), the micro-batches' sizes are the search's own, and every sequence
/// is counted: a bound the schedule keeps within, not the least.
fn resident_sequences(config: &PlannerConfig) -> usize {
    match (config.schedule, config.shared) {
        (SliceSchedule::OneFOneB, true) => config.batch.min(config.stages),
        _ => config.batch,
    }
}

/// The constraint the DP enforces over the resident sequences ([`resident_sequences`]), after
/// checking that some slicing meets the limit at all: the tightest stage's.
fn memory_constraint(config: &PlannerConfig, step: usize, units: usize) -> Result<Constraint> {
    let Some(limit) = config.memory_limit else {
        return Ok(Constraint::Free);
    };
    let resident = resident_sequences(config) as f64;
    // Finest slicing: the least Σ l² there is, and memory is linear in the sequences. Every
    // stage must fit; the one that needs the most says what the limit must be.
    // (The unsliced plan, which keeps no arena, is weighed apart: [`unsliced_plan`].)
    let finest = |m: &MemoryModel| {
        (m.fixed_bytes + m.sliced_bytes) as f64
            + resident * (0..units).map(|j| m.slice_bytes(1, step, j * step)).sum::<f64>()
    };
    let need = config.memory.iter().map(finest).fold(0.0, f64::max).ceil() as usize;
    if need > limit {
        // Where the micro-batches share one slicing, whole sequences may need less.
        let (need, what) = match config.shared.then(|| peak_memory_bytes(config, &whole_sequences(config))) {
            Some(unsliced) if unsliced < need => (unsliced, "unsliced"),
            _ => (need, "finest slicing"),
        };
        return Err(config_error(
            "terapipe.memory_limit",
            format!(
                "no slicing meets the memory limit: needs at least {need} bytes ({}; {what}, {}), limit {limit} ({})",
                human_bytes(need),
                config.schedule,
                human_bytes(limit)
            ),
        ));
    }
    let budgets = config.memory.iter().filter_map(|m| match stage_constraint(config, m, limit, step, units) {
        Constraint::Squares { budget } => Some(budget),
        Constraint::Free => None,
    });
    Ok(budgets.min().map_or(Constraint::Free, |budget| Constraint::Squares { budget }))
}

/// [`memory_constraint`] for one stage of memory `m`, whose finest slicing fits `limit`.
fn stage_constraint(config: &PlannerConfig, m: &MemoryModel, limit: usize, step: usize, units: usize) -> Constraint {
    let resident = resident_sequences(config);
    let (limit_f, fixed) = (limit as f64, (m.fixed_bytes + m.sliced_bytes) as f64);
    if m.per_score_bytes == 0.0 {
        return Constraint::Free;
    }
    let (b, l, n) = (resident as f64, (units * step) as f64, units as u64);
    let room = limit_f - fixed - b * l * m.per_token_bytes - b * m.per_score_bytes * l * l / 2.0;
    let squares = room * 2.0 / (m.per_score_bytes * (step * step) as f64);
    // Rounding must not refuse the finest slicing `memory_constraint` accepted.
    let most = resident as u64 * n * n;
    let budget = if squares >= most as f64 { most } else { (squares.floor() as u64).max(resident as u64 * n) };
    Constraint::Squares { budget }
}

/// Merges candidates within `epsilon` of a cluster's first into the cluster's largest; returns
/// the caps to evaluate and, for each, the smallest largest-slice time it stands for.
fn thin(caps: &[f64], epsilon: f64) -> (Vec<f64>, Vec<f64>) {
    if epsilon == 0.0 {
        return (caps.to_vec(), caps.to_vec());
    }
    let (mut keep, mut lows) = (Vec::new(), Vec::new());
    let mut i = 0;
    while i < caps.len() {
        let j = i + caps[i..].partition_point(|&c| c <= caps[i] + epsilon);
        keep.push(caps[j - 1]);
        lows.push(caps[i]);
        i = j;
    }
    (keep, lows)
}

struct SearchState<'a> {
    problem: &'a Problem,
    caps: &'a [f64],
    lows: &'a [f64],
    best: Outcome,
    evaluated: usize,
    overflow: bool,
}

impl SearchState<'_> {
    /// Solves at each `(candidate, floor)`: `floor` is the lowest largest slice a plan that
    /// matters there can have.
    fn evaluate_all(&mut self, at: &[(usize, f64)]) -> Vec<Eval> {
        self.evaluated += at.len();
        let bound = self.best.step;
        let eval = |&(i, floor): &(usize, f64)| self.problem.evaluate(self.caps[i], bound, floor);
        if self.problem.parallel { at.par_iter().map(eval).collect() } else { at.iter().map(eval).collect() }
    }

    fn consider(&mut self, e: &Eval) {
        if let Some(o) = &e.best
            && o.cmp(&self.best).is_lt()
        {
            self.best = o.clone();
        }
    }

    /// Lower bound on any plan whose largest slice is at least `low`, when no plan under a cap
    /// at least that large sums to less than `s`.
    fn bound(&self, s: f64, low: f64) -> f64 {
        s.max(low) + self.problem.lag * low
    }

    /// Level-synchronous bisection: every open range `[lo, hi)` knows `S*` at a cap above it;
    /// trim it to the candidates whose bound can still beat the best, evaluate its midpoint,
    /// split. The best only improves between levels, so the set of evaluations is fixed.
    fn branch_and_bound(&mut self, s_top: f64) {
        let mut open = vec![(0usize, self.caps.len(), s_top)];
        loop {
            let best = self.best.step;
            let work: Vec<(usize, usize, f64)> = open
                .iter()
                .filter(|r| r.2.is_finite())
                .map(|&(lo, hi, s)| (lo, lo + self.lows[lo..hi].partition_point(|&t| self.bound(s, t) <= best), s))
                .filter(|r| r.1 > r.0)
                .collect();
            if work.is_empty() {
                return;
            }
            let mids: Vec<usize> = work.iter().map(|&(lo, hi, _)| lo + (hi - lo - 1) / 2).collect();
            // What the solve at a midpoint must cover: its own candidate, and the bound for the
            // candidates below it in its range, whose plans have slices of at least `lows[lo]`.
            let at: Vec<(usize, f64)> = work.iter().zip(&mids).map(|(r, &mid)| (mid, self.lows[r.0])).collect();
            let evals = self.evaluate_all(&at);
            for e in &evals {
                self.consider(e);
            }
            let mut next = Vec::new();
            for ((&(lo, hi, s), &mid), e) in work.iter().zip(&mids).zip(&evals) {
                if !e.overflow {
                    next.extend([(lo, mid, e.min_sigma), (mid + 1, hi, s)]);
                } else if hi - lo > 1 {
                    // A solve over a wide range gave up (its pruning floor is low): the midpoint
                    // goes back, with the bound the solve still gave, to be solved in a narrower
                    // range, where the floor is higher and the pruning tighter.
                    next.extend([(lo, mid + 1, e.min_sigma), (mid + 1, hi, s)]);
                } else {
                    self.overflow = true;
                    return;
                }
            }
            open = next;
        }
    }

    /// The paper's search: ascending caps, stop at the first with `K·t > best` (every plan
    /// whose largest slice is `t` costs at least `t + lag·t`: `K·t` unless the slicing is
    /// shared, whose lag is `(K − 1)/M`).
    fn scan(&mut self) {
        const BLOCK: usize = 64;
        let k = 1.0 + self.problem.lag;
        for start in (0..self.caps.len()).step_by(BLOCK) {
            let block: Vec<usize> = (start..(start + BLOCK).min(self.caps.len())).collect();
            if k * self.lows[block[0]] > self.best.step {
                return;
            }
            // Plans whose largest slice is below a candidate's cluster were covered before it.
            let at: Vec<(usize, f64)> = block.iter().map(|&i| (i, self.lows[i])).collect();
            let evals = self.evaluate_all(&at);
            if evals.iter().any(|e| e.overflow) {
                self.overflow = true;
                return;
            }
            for (&i, e) in block.iter().zip(&evals) {
                if k * self.lows[i] > self.best.step {
                    return;
                }
                self.consider(e);
            }
        }
    }
}

/// The plan in tokens, with its peak memory under the configured schedule.
fn finish(best: Outcome, config: &PlannerConfig, step: usize, stats: SearchStats) -> SlicingPlan {
    let micro_batches: Vec<MicroBatchSlicing> = best
        .micro
        .iter()
        .map(|(b, lens)| MicroBatchSlicing { samples: *b, slices: lens.iter().map(|&u| u as usize * step).collect() })
        .collect();
    SlicingPlan {
        peak_memory_bytes: peak_memory_bytes(config, &micro_batches),
        micro_batches,
        predicted_step_seconds: best.step,
        max_slice_seconds: best.max,
        stats,
    }
}

/// Predicted peak bytes per device of `micro_batches` under `config`'s memory models and
/// schedule (what [`SlicingPlan::peak_memory_bytes`] reports): the largest stage's.
pub fn peak_memory_bytes(config: &PlannerConfig, micro_batches: &[MicroBatchSlicing]) -> usize {
    config.memory.iter().map(|m| stage_peak_bytes(config, m, micro_batches)).max().unwrap_or(0)
}

/// [`peak_memory_bytes`] of one stage of memory `memory`.
fn stage_peak_bytes(config: &PlannerConfig, memory: &MemoryModel, micro_batches: &[MicroBatchSlicing]) -> usize {
    // Bytes of each slice, per micro-batch.
    let bytes: Vec<Vec<f64>> = micro_batches
        .iter()
        .map(|m| {
            let mut c = 0;
            m.slices
                .iter()
                .map(|&l| {
                    let b = memory.slice_bytes(m.samples, l, c);
                    c += l;
                    b
                })
                .collect()
        })
        .collect();
    let mut per_micro_batch: Vec<f64> = bytes.iter().map(|m| m.iter().sum()).collect();
    let activations: f64 = match config.schedule {
        SliceSchedule::Gpipe => per_micro_batch.iter().sum(),
        // `K` micro-batches resident at once, every slice of each: at most the K largest.
        SliceSchedule::OneFOneB => {
            per_micro_batch.sort_by(|a, b| b.total_cmp(a));
            per_micro_batch.iter().take(config.stages).sum()
        }
    };
    // Any sliced micro-batch: the arenas (which bound an unsliced one's keys and values too).
    let keys_and_values = match micro_batches.iter().any(|m| m.slices.len() > 1) {
        true => memory.sliced_bytes,
        false => memory.unsliced_bytes,
    };
    ((memory.fixed_bytes + keys_and_values) as f64 + activations).ceil() as usize
}

/// `config`'s micro-batches (one sequence each, the planner's unit), unsliced.
fn whole_sequences(config: &PlannerConfig) -> Vec<MicroBatchSlicing> {
    vec![MicroBatchSlicing { samples: 1, slices: vec![config.seq_len] }; config.batch]
}

/// Micro-batches that share one slicing, unsliced (no key/value arena), when that fits the
/// limit: the DP charges every plan the arena, which only a sliced one keeps.
fn unsliced_plan(latency: &LatencyModel, config: &PlannerConfig) -> Result<Option<SlicingPlan>> {
    let whole = whole_sequences(config);
    let peak = peak_memory_bytes(config, &whole);
    if !config.shared || config.memory_limit.is_some_and(|limit| peak > limit) {
        return Ok(None);
    }
    Ok(Some(SlicingPlan {
        predicted_step_seconds: predict_step_seconds(latency, config.stages, &whole)?,
        max_slice_seconds: latency.slice_time(1, config.seq_len, 0)?,
        peak_memory_bytes: peak,
        micro_batches: whole,
        stats: SearchStats::default(),
    }))
}
