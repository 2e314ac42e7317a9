//! A plan: which units each stage holds, how many devices and replicas, how many micro-batches,
//! and the schedule — a pure function of the units' costs and the devices, printable
//! (`pipetransformer plan`) and checked before any work starts.

use super::partition::{Partition, Recompute, UnitProfile, least_peak, partition, stage_memories};
use super::schedule::{Schedule, ScheduleKind};
use super::simulate::{CostModel, Link, Simulation, simulate};
use crate::error::{Error, Result, config_error, counted};
use serde::{Deserialize, Serialize};
use std::fmt;

/// What a user asks for (`--pipeline-len`, `--replicas`, `--micro-batches`, `--schedule`,
/// `--token-slices`, `--recompute`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct PipelineConfig {
    /// Devices per pipeline (`K`).
    pub pipeline_len: usize,
    /// Data-parallel replicas of the pipeline (`R`).
    pub replicas: usize,
    /// Micro-batches per replica per step (`M`).
    pub micro_batches: usize,
    /// Schedule family.
    pub schedule: ScheduleKind,
    /// Model chunks per device (`v`; ≥ 2 for the interleaved schedule, 1 otherwise).
    pub chunks: usize,
    /// Bytes each device may hold (weights, gradients, optimizer state, activations in flight).
    pub memory_limit: Option<usize>,
    /// TeraPipe: the token slices every sequence is cut into, as lengths (empty: unsliced).
    pub token_slices: Vec<usize>,
    /// Which stages, and which of their units, recompute their activations in their
    /// backwards.
    pub recompute: Recompute,
}

impl PipelineConfig {
    /// Whether this is plain one-device training.
    pub fn is_single(&self) -> bool {
        self.pipeline_len * self.replicas * self.micro_batches == 1 && self.token_slices.len() <= 1
    }

    /// Token slices per micro-batch (1 when unsliced).
    pub fn slices(&self) -> usize {
        self.token_slices.len().max(1)
    }

    /// Whether this pipeline's stages may recompute their activations: a schedule that does
    /// not put weight gradients off (zb-h1 keeps those activations).
    pub fn allows_recompute(&self) -> bool {
        self.schedule != ScheduleKind::ZeroBubble
    }

    /// The pipeline TeraPipe's `auto` slicing is first planned for
    /// ([`Plan::recomputing_slicing`]): this one, but where its stages may recompute, without
    /// the memory limit, which the partition then meets by recomputing (the slicer's memory
    /// model keeps every activation, so it would refuse what recomputation fits).
    pub fn for_slicing(&self) -> PipelineConfig {
        match self.recompute {
            Recompute::Off => self.clone(),
            _ => PipelineConfig { memory_limit: None, ..self.clone() },
        }
    }

    /// Whether `other` asks for the same pipelines: all but the token slices, which `auto`
    /// measures afresh in every run.
    pub fn same_shape(&self, other: &PipelineConfig) -> bool {
        *self == PipelineConfig { token_slices: self.token_slices.clone(), ..other.clone() }
    }
}

impl Default for PipelineConfig {
    fn default() -> Self {
        Self {
            pipeline_len: 1,
            replicas: 1,
            micro_batches: 1,
            schedule: ScheduleKind::OneFOneB,
            chunks: 1,
            memory_limit: None,
            token_slices: Vec::new(),
            recompute: Recompute::Off,
        }
    }
}

/// A checked plan.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Plan {
    /// What was asked for.
    pub config: PipelineConfig,
    /// Units per virtual stage (`K·v` stages), with their times and memory.
    pub partition: Partition,
    /// Every device's actions.
    pub schedule: Schedule,
    /// Unit names, for printing.
    pub unit_names: Vec<String>,
    /// Each token slice's time as a share of its whole micro-batch's on one stage, where
    /// TeraPipe's latency model measured it (later slices attend to more context; short ones
    /// run below the products' rate, so the shares may add up to more than 1); one per slice
    /// of `config.token_slices`, else unused: each slice then takes its share of the tokens.
    /// What the printed bubble and simulation split a stage's time by
    /// ([`slice_shares`](Self::slice_shares)).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub slice_time_shares: Vec<f64>,
}

impl Plan {
    /// Plans `config` for units costing `units` on `devices` available devices, with the first
    /// `pinned` units (a frozen prefix) on the first stage. Every bad request is an error here,
    /// before any work: `K` or `R` or `M` of 0, `R·K` above the devices, more stages than
    /// units, a memory limit no split meets.
    pub fn new(
        config: PipelineConfig,
        units: &[UnitProfile],
        unit_names: Vec<String>,
        devices: usize,
        pinned: usize,
    ) -> Result<Plan> {
        check_names(units, &unit_names)?;
        let schedule = Self::check(&config, units.len().saturating_sub(pinned), devices)?;
        // Token slices change what a micro-batch keeps (TeraPipe): the partition's memory
        // counts the sliced activations and the key/value arenas.
        let units: Vec<UnitProfile> = units.iter().map(|u| u.sliced(&config.token_slices)).collect();
        let partition = partition_per_device(&units, &schedule, config.memory_limit, pinned, config.recompute)
            .map_err(|e| recompute_hint(e, &config, &units, &schedule, pinned))?;
        Ok(Plan { config, partition, schedule, unit_names, slice_time_shares: Vec::new() })
    }

    /// The stages [`new`](Self::new) cuts `units` into for `config`'s pipeline on their time
    /// alone (unsliced, without the memory limit), the first `pinned` on the first stage: the
    /// stages TeraPipe's slicing is planned for before the slices are known.
    pub fn time_cut(
        config: &PipelineConfig,
        units: &[UnitProfile],
        pinned: usize,
    ) -> Result<Vec<std::ops::Range<usize>>> {
        Self::whole_cut(&PipelineConfig { memory_limit: None, ..config.clone() }, units, pinned)
    }

    /// The stages [`new`](Self::new) cuts `units` into for `config`'s pipeline of whole
    /// sequences (unsliced) under its memory limit, the first `pinned` on the first stage:
    /// where no token slicing fits the [`time_cut`](Self::time_cut), the stages the limit
    /// forces, on which the sequences fit whole at least.
    pub fn whole_cut(
        config: &PipelineConfig,
        units: &[UnitProfile],
        pinned: usize,
    ) -> Result<Vec<std::ops::Range<usize>>> {
        let config = PipelineConfig { token_slices: Vec::new(), ..config.clone() };
        let devices = config.pipeline_len.saturating_mul(config.replicas);
        Ok(Plan::new(config, units, Vec::new(), devices, pinned)?.partition.stages)
    }

    /// What `slice` (TeraPipe's slicing of a pipeline cut into the stages it is given) gives
    /// for `config`'s pipeline, the first `pinned` units on the first stage: for the stages
    /// cut on time alone ([`time_cut`](Self::time_cut)); where it refuses those under a memory
    /// limit, for the stages the limit forces on whole sequences
    /// ([`whole_cut`](Self::whole_cut)), on which the sequences fit whole at least. Where both
    /// fail, the first refusal stands, with what whole sequences need where no split fits
    /// them. The one rule for a run's first plan and for each shape an elastic run changes to.
    pub fn slice_cut<T>(
        config: &PipelineConfig,
        units: &[UnitProfile],
        pinned: usize,
        slice: impl Fn(&[std::ops::Range<usize>]) -> Result<T>,
    ) -> Result<T> {
        let stages = Self::time_cut(config, units, pinned)?;
        match slice(&stages) {
            Err(refused) if config.memory_limit.is_some() => match Self::whole_cut(config, units, pinned) {
                Ok(forced) if forced != stages => {
                    if crate::debug::level() >= 1 {
                        eprintln!("token slicing: {refused}; planned for the stages the limit forces, {forced:?}");
                    }
                    slice(&forced).map_err(|_| refused)
                }
                Ok(_) => Err(refused),
                // Both refusals: whole sequences may plan under a lower limit than any slicing of
                // the stages cut for time.
                Err(whole) => {
                    let message = |e: Error| match e {
                        Error::Config { message, .. } => message,
                        e => e.to_string(),
                    };
                    Err(config_error(
                        "memory_limit",
                        format!(
                            "on the stages cut for time, {}; on stages cut for memory, whole sequences: {}",
                            message(refused),
                            message(whole)
                        ),
                    ))
                }
            },
            sliced => sliced,
        }
    }

    /// TeraPipe's slicing (`slice`, for a pipeline config) of `config`'s pipeline, where its
    /// stages may recompute under a memory limit: planned for time first
    /// ([`PipelineConfig::for_slicing`]), kept where a plan of the slices it gives (`lengths`)
    /// meets the limit by recomputing, on the given `stages` or as cut afresh with the first
    /// `pinned` units on the first; otherwise as for a run that does not recompute, the slicer
    /// held to the limit; where that refuses too, whole micro-batches (`None`) if they fit
    /// recomputing (a slice's arenas are kept, not recomputed, so slicing can need more), else
    /// a refusal naming the least limit that plans, whole or over the slices planned for time
    /// (which can need less: a slice's backward regains only its own activations). A slicing
    /// the slicer holds to the limit is kept only where a plan of it fits: the slicer's memory
    /// model and the partition's can part. Where the stages do not recompute, the slicer's
    /// slicing under the limit, held to the same test: an `auto` run's fallback to equal slices
    /// ([`auto_slicing`](Self::auto_slicing)) then sees the refusal (a one-stage pipeline's
    /// slicer keeps whole micro-batches without looking at the limit).
    pub fn recomputing_slicing<T>(
        config: &PipelineConfig,
        units: &[UnitProfile],
        pinned: usize,
        stages: Option<&[std::ops::Range<usize>]>,
        slice: impl Fn(&PipelineConfig) -> Result<T>,
        lengths: impl Fn(&T) -> Vec<usize>,
    ) -> Result<Option<T>> {
        if config.memory_limit.is_none() {
            return slice(config).map(Some);
        }
        let plan = |token_slices: Vec<usize>| Self::of_slices(config, token_slices, units, pinned, stages);
        if config.recompute == Recompute::Off {
            let held = slice(config)?;
            return plan(lengths(&held)).map(|_| Some(held));
        }
        let timed = slice(&config.for_slicing()).ok();
        let timed_lengths = timed.as_ref().map(&lengths);
        if let Some(timed) = timed.filter(|t| plan(lengths(t)).is_ok()) {
            return Ok(Some(timed));
        }
        let refused = match slice(config) {
            Ok(held) => match plan(lengths(&held)) {
                Ok(_) => return Ok(Some(held)),
                Err(e) => e,
            },
            Err(refused) => refused,
        };
        let whole = match plan(Vec::new()) {
            Ok(_) => {
                if crate::debug::level() >= 1 {
                    eprintln!("token slicing: {refused}; whole micro-batches fit, recomputing");
                }
                return Ok(None);
            }
            Err(whole) => whole,
        };
        // Refused: named by the least limit that plans, whole micro-batches or the slicing
        // planned for time (each recomputing; the slicer's own count keeps every activation).
        let least = |token_slices: Vec<usize>| {
            Self::least_limit(&PipelineConfig { token_slices, ..config.clone() }, units, pinned, stages)
        };
        match timed_lengths.and_then(|l| Some((least(l.clone())?, l))).zip(least(Vec::new())) {
            Some(((sliced, lengths), whole)) if sliced < whole => Err(config_error(
                "memory_limit",
                format!(
                    "no plan fits in {} bytes per device, recomputing: the token slices planned for time, \
                     {lengths:?}, need {sliced} bytes, whole micro-batches {whole} bytes",
                    config.memory_limit.unwrap_or(0)
                ),
            )),
            _ => Err(whole),
        }
    }

    /// TeraPipe's `auto` slicing of `config`'s pipeline of `seq`-token sequences, on the given
    /// `stages` or as cut afresh with the first `pinned` units on the first:
    /// [`recomputing_slicing`](Self::recomputing_slicing)'s, and where nothing it plans meets
    /// the memory limit (the slicer plans for time, or holds every activation to the limit),
    /// the fewest equal slices that do ([`fewest_equal_slices`](Self::fewest_equal_slices)).
    /// A run's first plan and every shape AutoPipe changes to are sliced by this one rule.
    #[allow(clippy::too_many_arguments)]
    pub fn auto_slicing<T>(
        config: &PipelineConfig,
        units: &[UnitProfile],
        pinned: usize,
        stages: Option<&[std::ops::Range<usize>]>,
        seq: usize,
        slice: impl Fn(&PipelineConfig) -> Result<T>,
        lengths: impl Fn(&T) -> Vec<usize>,
    ) -> Result<AutoSliced<T>> {
        match Self::recomputing_slicing(config, units, pinned, stages, slice, lengths) {
            Ok(Some(planned)) => Ok(AutoSliced::Planned(planned)),
            Ok(None) => Ok(AutoSliced::Whole),
            Err(Error::Config { field, message }) if field.ends_with("memory_limit") => {
                match Self::fewest_equal_slices(config, units, pinned, stages, seq) {
                    Some(n) => Ok(AutoSliced::Equal(uniform_slices(seq, n))),
                    None => Err(Error::Config { field, message }),
                }
            }
            Err(e) => Err(e),
        }
    }

    /// Where no slicing [`recomputing_slicing`](Self::recomputing_slicing) plans meets
    /// `config`'s memory limit (the slicer plans for time, or holds every activation to the
    /// limit): the fewest equal slices of `seq`-token sequences whose plan fits (on the given
    /// `stages`, or as cut afresh with the first `pinned` units on the first), recomputing as
    /// `config` asks (each slice's backward regains only its own activations, so more can fit
    /// where fewer do not); `None` where none does. Counts 2 to 8 are tried in turn, then 16,
    /// 32 and so on, doubling, and `seq` itself (a token a slice, the most there are); a fit
    /// among those is narrowed down to the fewest since the last count that did not fit
    /// (halving: memory falls as the count grows).
    pub fn fewest_equal_slices(
        config: &PipelineConfig,
        units: &[UnitProfile],
        pinned: usize,
        stages: Option<&[std::ops::Range<usize>]>,
        seq: usize,
    ) -> Option<usize> {
        let fits = |n: usize| Self::of_slices(config, uniform_slices(seq, n), units, pinned, stages).is_ok();
        let doubling = std::iter::successors(Some(16usize), |n| n.checked_mul(2)).take_while(|&n| n < seq);
        let counts: Vec<usize> = (2..=8).filter(|&n| n < seq).chain(doubling).chain((seq > 1).then_some(seq)).collect();
        let at = counts.iter().position(|&n| fits(n))?;
        // Fewest in (the last that did not fit, the first that did].
        let (mut lo, mut hi) = (if at == 0 { 1 } else { counts[at - 1] }, counts[at]);
        while hi - lo > 1 {
            let mid = (lo + hi) / 2;
            if fits(mid) { hi = mid } else { lo = mid }
        }
        Some(hi)
    }

    /// A plan of `config`'s pipeline over `token_slices`, held to its memory limit: on the
    /// given `stages`, or cut afresh with the first `pinned` units on the first.
    fn of_slices(
        config: &PipelineConfig,
        token_slices: Vec<usize>,
        units: &[UnitProfile],
        pinned: usize,
        stages: Option<&[std::ops::Range<usize>]>,
    ) -> Result<Plan> {
        let sliced = PipelineConfig { token_slices, ..config.clone() };
        let (names, devices) = (vec![String::new(); units.len()], config.pipeline_len.saturating_mul(config.replicas));
        match stages {
            Some(s) => Self::with_stages(sliced, units, names, devices, s.to_vec()).and_then(Self::within_limit),
            None => Self::new(sliced, units, names, devices, pinned),
        }
    }

    /// The least memory limit under which `config`'s pipeline plans (on the given `stages`, or
    /// as cut afresh with the first `pinned` units on the first), recomputing as it asks:
    /// `None` for an interleaved schedule's devices, which hold several stages.
    fn least_limit(
        config: &PipelineConfig,
        units: &[UnitProfile],
        pinned: usize,
        stages: Option<&[std::ops::Range<usize>]>,
    ) -> Option<usize> {
        let devices = config.pipeline_len.saturating_mul(config.replicas);
        let schedule = Self::check(config, units.len().saturating_sub(pinned), devices).ok()?;
        let units: Vec<UnitProfile> = units.iter().map(|u| u.sliced(&config.token_slices)).collect();
        least_on_devices(&units, &schedule, pinned, config.recompute, stages)
    }

    /// A plan with given stage boundaries (as a checkpoint recorded them, or the plan in force
    /// with another `M`), not held to the memory limit: see [`within_limit`](Self::within_limit).
    pub fn with_stages(
        config: PipelineConfig,
        units: &[UnitProfile],
        unit_names: Vec<String>,
        devices: usize,
        stages: Vec<std::ops::Range<usize>>,
    ) -> Result<Plan> {
        check_names(units, &unit_names)?;
        let schedule = Self::check(&config, units.len(), devices)?;
        if stages.len() != schedule.stages {
            return Err(config_error(
                "partition",
                format!("{} stages recorded for a plan of {}", stages.len(), schedule.stages),
            ));
        }
        let units: Vec<UnitProfile> = units.iter().map(|u| u.sliced(&config.token_slices)).collect();
        let partition = partition_of_stages(&units, stages, &schedule, config.memory_limit, config.recompute)?;
        Ok(Plan { config, partition, schedule, unit_names, slice_time_shares: Vec::new() })
    }

    /// This plan, when every device's peak is within the memory limit (a plan [`new`](Self::new)
    /// made always is; one [`with_stages`](Self::with_stages) made may not be).
    pub fn within_limit(self) -> Result<Plan> {
        let need = self.partition.device_peak(self.config.pipeline_len);
        if let Some(limit) = self.config.memory_limit.filter(|&limit| need > limit) {
            return Err(config_error(
                "memory_limit",
                format!(
                    "stages {:?} with {} need {need} bytes on a device; the limit is {limit}",
                    self.partition.stages,
                    counted(self.config.micro_batches, "micro-batch")
                ),
            ));
        }
        Ok(self)
    }

    /// The same stages with `m` micro-batches (a short batch at an epoch's end): a new
    /// schedule; stage costs as they were.
    pub fn with_micro_batches(&self, m: usize) -> Result<Plan> {
        let config = PipelineConfig { micro_batches: m, ..self.config.clone() };
        let schedule = Schedule::generate(config.schedule, config.pipeline_len, config.chunks, m, config.slices())?;
        Ok(Plan { config, schedule, ..self.clone() })
    }

    /// The schedule of `config`, after checking it against `units` to cut and `devices`.
    fn check(config: &PipelineConfig, units: usize, devices: usize) -> Result<Schedule> {
        let PipelineConfig { pipeline_len: k, replicas: r, micro_batches: m, .. } = *config;
        if k == 0 {
            return Err(config_error("pipeline_len", "must be at least 1"));
        }
        if r == 0 {
            return Err(config_error("replicas", "must be at least 1"));
        }
        if m == 0 {
            return Err(config_error("micro_batches", "must be at least 1"));
        }
        // Zero bubble's put-off weight gradients keep the linear layers' inputs, the very
        // activations a recomputing stage would drop.
        if config.recompute != Recompute::Off && !config.allows_recompute() {
            return Err(config_error(
                "recompute",
                format!(
                    "recompute = \"{}\" with the zb-h1 schedule: its put-off weight gradients keep the \
                     activations recomputation would drop; use gpipe, 1f1b or interleaved, or set recompute = \"off\"",
                    config.recompute
                ),
            ));
        }
        // Checked: sizes from a user's flags may be absurd, and are refused, not wrapped.
        let need = r.checked_mul(k);
        if need.is_none_or(|n| n > devices) {
            let need = need.map_or_else(|| "more".to_string(), |n| n.to_string());
            return Err(config_error(
                "devices",
                format!(
                    "{} × {} need {need} devices; {devices} available",
                    counted(r, "replica"),
                    counted(k, "pipeline stage")
                ),
            ));
        }
        let stages = k.saturating_mul(config.chunks);
        if stages > units {
            // (Named by the setting that multiplies the stages, where there is one.)
            return Err(config_error(
                if config.chunks > 1 && k <= units { "chunks" } else { "pipeline_len" },
                format!(
                    "{} × {} of stages cannot be cut from the model's {units} active units",
                    counted(k, "device"),
                    counted(config.chunks, "chunk"),
                ),
            ));
        }
        Schedule::generate(config.schedule, k, config.chunks, m, config.slices())
    }

    /// Virtual stages.
    pub fn stages(&self) -> usize {
        self.partition.stages.len()
    }

    /// The global device index of `replica`'s `stage`: replica `r` owns devices `r·K..(r+1)·K`.
    pub fn device(&self, replica: usize, stage: usize) -> usize {
        replica * self.config.pipeline_len + super::schedule::stage_device(stage, self.config.pipeline_len)
    }

    /// The stage holding unit `unit`.
    pub fn stage_of(&self, unit: usize) -> usize {
        self.partition.stages.iter().position(|r| r.contains(&unit)).unwrap_or(0)
    }

    /// The bubble the schedule implies with these stage times: the step is `M·s·max W + f·max
    /// t`, where `W` is a device's time per micro-batch (its stages' sum: `v` chunks under the
    /// interleaved schedule), `s` the token slices' shares of it together (1 unless measured:
    /// [`slice_shares`](Self::slice_shares)) and `f` the fill and drain of
    /// [`Plan::bubble_formula`] (`(K−1)/n` for `n` equal token slices by their tokens; the
    /// largest slice's share for others), so equal stages give that formula; uneven ones add
    /// the imbalance (each device idles `max W − its W` per micro-batch).
    pub fn predicted_bubble(&self) -> f64 {
        let k = self.config.pipeline_len;
        let max = self.partition.bottleneck();
        if max == 0.0 {
            return self.bubble_formula();
        }
        let m = self.config.micro_batches as f64 * self.shares_together();
        let work: Vec<f64> = (0..k)
            .map(|d| {
                let on_device = (0..self.stages()).filter(|&s| super::schedule::stage_device(s, k) == d);
                on_device.map(|s| self.partition.stage_time[s]).sum::<f64>()
            })
            .collect();
        // Token slices split each micro-batch's time by their shares: the fill and drain
        // shrink to the largest slice's time.
        let step = m * work.iter().copied().fold(0.0, f64::max) + self.fill_slots() * max;
        1.0 - m * work.iter().sum::<f64>() / (k as f64 * step)
    }

    /// [`Schedule::bubble_formula`] with token slices of any lengths: `f / (v·M·s + f)` where the
    /// fill and drain `f` is `(K−1)` times the largest slice's share of the micro-batch's time
    /// (`1/n` for `n` equal slices by their tokens; a third of that under zero bubble) and `s`
    /// the slices' shares together (1 by their tokens).
    pub fn bubble_formula(&self) -> f64 {
        let fill = self.fill_slots();
        fill / (self.config.micro_batches as f64 * self.config.chunks as f64 * self.shares_together() + fill)
    }

    /// The token slices' shares of a micro-batch's time together: 1 by their tokens (or whole),
    /// more where slicing costs time as measured.
    fn shares_together(&self) -> f64 {
        let shares = self.slice_shares();
        if shares.is_empty() { 1.0 } else { shares.iter().sum() }
    }

    /// Each token slice's share of its micro-batch's time on a stage: as measured where
    /// [`slice_time_shares`](Self::slice_time_shares) has one per slice, else its share of the
    /// tokens; empty for whole micro-batches.
    pub fn slice_shares(&self) -> Vec<f64> {
        let lengths = &self.config.token_slices;
        let tokens: usize = lengths.iter().sum();
        match lengths.len() {
            n if n < 2 || tokens == 0 => Vec::new(),
            _ if self.slice_times_measured() => self.slice_time_shares.clone(),
            _ => lengths.iter().map(|&l| l as f64 / tokens as f64).collect(),
        }
    }

    /// Whether the token slices' shares of the time are measured ones.
    pub fn slice_times_measured(&self) -> bool {
        self.config.token_slices.len() > 1 && self.slice_time_shares.len() == self.config.token_slices.len()
    }

    /// The same stages running whole micro-batches: what slicing is measured against.
    pub fn unsliced(&self) -> Result<Plan> {
        let config = PipelineConfig { token_slices: Vec::new(), ..self.config.clone() };
        let schedule =
            Schedule::generate(config.schedule, config.pipeline_len, config.chunks, config.micro_batches, 1)?;
        Ok(Plan { config, schedule, slice_time_shares: Vec::new(), ..self.clone() })
    }

    /// The fill and drain in micro-batch times: `K − 1` of the largest slice (its share of the
    /// micro-batch's time, [`slice_shares`](Self::slice_shares)), scaled by the schedule's fill.
    fn fill_slots(&self) -> f64 {
        let share = self.slice_shares().into_iter().reduce(f64::max).unwrap_or(1.0);
        self.schedule.kind.fill() * (self.config.pipeline_len as f64 - 1.0) * share
    }

    /// One replica's step as the cluster simulator plays it from the stage times alone, with
    /// free links (what a printed plan knows; [`CostModel::from_stage_times`]).
    pub fn simulate(&self) -> Result<Simulation> {
        simulate(&self.schedule, &CostModel::from_stage_times(self, Link::INSTANT))
    }
}

/// Refuses unit names (a model's units) of another count than the costs (`units`) the plan
/// cuts: a caller's profiles of another model would place units out of order. (No names: a
/// plan of costs alone.)
fn check_names(units: &[UnitProfile], unit_names: &[String]) -> Result<()> {
    match unit_names.is_empty() || unit_names.len() == units.len() {
        true => Ok(()),
        false => Err(config_error(
            "profiles",
            format!("{} unit profiles for a model of {} units; expected one per unit", units.len(), unit_names.len()),
        )),
    }
}

/// What TeraPipe's `auto` gives a pipeline shape ([`Plan::auto_slicing`]).
#[derive(Clone, Debug, PartialEq)]
pub enum AutoSliced<T> {
    /// The slicer's plan.
    Planned(T),
    /// Whole micro-batches: no slicing fits the memory limit, and they do, recomputing.
    Whole,
    /// The fewest equal slices that fit, where nothing the slicer plans does.
    Equal(Vec<usize>),
}

/// `n` near-equal token-slice lengths adding up to `seq` (the first `seq mod n` one longer):
/// what `--token-slices N` asks for.
pub fn uniform_slices(seq: usize, n: usize) -> Vec<usize> {
    (0..n).map(|i| seq / n + usize::from(i < seq % n)).collect()
}

/// [`partition`] within `limit` bytes per device. With one stage per device that is the
/// stages' limit. A device of an interleaved schedule holds `v` stages, which the split's
/// dynamic programme, cutting contiguous stages, cannot sum: it runs again under each smaller
/// per-stage limit, and the best-balanced split that fits every device wins. A search, not a
/// proof: a split fitting only with uneven stage limits can be missed (the error says so),
/// but no plan it returns overfills a device.
fn partition_per_device(
    units: &[UnitProfile],
    schedule: &Schedule,
    limit: Option<usize>,
    pinned: usize,
    recompute: Recompute,
) -> Result<Partition> {
    let (stages, in_flight) = (schedule.stages, in_flight(schedule));
    let first = partition(units, stages, &in_flight, limit, pinned, recompute)?;
    let Some(limit) = limit else { return Ok(first) };
    let need = first.device_peak(schedule.devices);
    if need <= limit {
        return Ok(first);
    }
    // Each per-stage limit that changes the split is a stage's bytes for some run of units.
    // Tried from the largest down: the split's bottleneck can only grow as the limit shrinks,
    // so the first that fits every device is the best-balanced one, and once none fits the
    // stages, no smaller limit does.
    // A split found under one cap is found again under any cap its largest stage still
    // meets (each of its stages costs the same there, a lower cap only takes options away, and
    // the search takes the latest of tied cuts alike): the next cap worth a try is below it.
    let mut found = None;
    let (mut below, mut tightest) = (usize::MAX, need);
    for cap in per_stage_caps(units, &in_flight, limit, recompute, None) {
        if cap >= below {
            continue;
        }
        match partition(units, stages, &in_flight, Some(cap), pinned, recompute) {
            // Its stages' recomputation chosen again against the devices' limit: the cap
            // that found the split may recompute stages the devices do not need to.
            Ok(p) if p.device_peak(schedule.devices) <= limit => {
                found = Some(partition_of_stages(units, p.stages, schedule, Some(limit), recompute)?);
                break;
            }
            Ok(p) => {
                below = p.stage_memory.iter().copied().max().unwrap_or(0);
                tightest = tightest.min(p.device_peak(schedule.devices));
            }
            Err(_) => break,
        }
    }
    found.ok_or_else(|| {
        config_error(
            "memory_limit",
            format!(
                "found no split of {} units into {stages} stages, {} per device, within {limit} bytes per device \
                 (the tightest split it found needs {tightest} bytes on a device): raise the limit or use fewer chunks",
                units.len(),
                stages / schedule.devices.max(1)
            ),
        )
    })
}

/// The costs of `stages` under `schedule`, each recomputing as `recompute` decides within
/// `limit` bytes per device: `auto` recomputes a stage that does not fit alone, and where a
/// device of an interleaved schedule, which sums its stages, is still overfilled, recomputes
/// as under the largest smaller per-stage limit that fits every device. Not held to the limit
/// (see [`Plan::within_limit`]).
fn partition_of_stages(
    units: &[UnitProfile],
    stages: Vec<std::ops::Range<usize>>,
    schedule: &Schedule,
    limit: Option<usize>,
    recompute: Recompute,
) -> Result<Partition> {
    let in_flight = in_flight(schedule);
    let of = |cap| Partition::of(units, stages.clone(), &in_flight, recompute, cap);
    let partition = of(limit)?;
    let overfilled = limit.filter(|&l| partition.device_peak(schedule.devices) > l);
    if let Some(limit) = overfilled.filter(|_| recompute == Recompute::Auto) {
        for cap in per_stage_caps(units, &in_flight, limit, recompute, Some(&stages)) {
            let p = of(Some(cap))?;
            if p.device_peak(schedule.devices) <= limit {
                return Ok(p);
            }
        }
    }
    Ok(partition)
}

/// The per-stage limits below `limit` that change a split or a stage's recomputation (of the
/// `given` stages only, when given): every memory such a stage could take
/// ([`stage_memories`]), largest first.
fn per_stage_caps(
    units: &[UnitProfile],
    in_flight: &[usize],
    limit: usize,
    recompute: Recompute,
    given: Option<&[std::ops::Range<usize>]>,
) -> Vec<usize> {
    let memories = stage_memories(units, in_flight, recompute, given);
    let mut caps: Vec<usize> = memories.into_iter().filter(|&b| b < limit).collect();
    caps.sort_unstable_by(|a, b| b.cmp(a));
    caps.dedup();
    caps
}

/// A memory limit's refusal `e` of a pipeline that keeps its activations, with what
/// recomputing them would need where that is less (a device per stage; not zb-h1, which
/// cannot recompute).
fn recompute_hint(
    e: Error,
    config: &PipelineConfig,
    units: &[UnitProfile],
    schedule: &Schedule,
    pinned: usize,
) -> Error {
    let (Error::Config { field, message }, Some(limit)) = (&e, config.memory_limit) else { return e };
    if config.recompute != Recompute::Off || !config.allows_recompute() {
        return e;
    }
    let least = |recompute| least_on_devices(units, schedule, pinned, recompute, None);
    let (Some(kept), Some(recomputing)) = (least(Recompute::Off), least(Recompute::Auto)) else { return e };
    let hint = match recomputing {
        n if n >= kept => return e,
        n if n <= limit => "; recomputing activations fits (--recompute auto, pipeline.recompute)".to_string(),
        n => format!("; recomputing activations (--recompute auto, pipeline.recompute) needs {n} bytes"),
    };
    Error::Config { field: field.clone(), message: format!("{message}{hint}") }
}

/// The least memory limit a partition of `units` (sliced as the plan runs them) meets on
/// `schedule`'s devices, recomputing as `recompute` allows, on the `given` stages or any:
/// `None` for an interleaved schedule's devices, which hold several stages each.
fn least_on_devices(
    units: &[UnitProfile],
    schedule: &Schedule,
    pinned: usize,
    recompute: Recompute,
    given: Option<&[std::ops::Range<usize>]>,
) -> Option<usize> {
    (schedule.stages == schedule.devices).then(|| least_peak(units, &in_flight(schedule), pinned, recompute, given))
}

/// Per stage, the micro-batches' worth of activations in flight at the peak: pieces, counted
/// as the fraction of a micro-batch a token slice is (a slice keeps about `1/n` of its
/// micro-batch's activations). It is also the count of micro-batches whose key/value arenas
/// the stage holds at once ([`UnitProfile::in_flight_bytes`] counts them per micro-batch): no
/// schedule opens a micro-batch its pieces do not fill (tested in `schedule`). So it bounds the
/// pieces' activations too, whatever the slices' lengths: they belong to that many
/// micro-batches.
fn in_flight(schedule: &Schedule) -> Vec<usize> {
    schedule.peak_in_flight().iter().map(|p| p.div_ceil(schedule.slices)).collect()
}

impl fmt::Display for Plan {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let c = &self.config;
        writeln!(
            f,
            "plan: {} × {}, {} per replica, schedule {}{}",
            counted(c.replicas, "replica"),
            counted(c.pipeline_len, "device"),
            counted(c.micro_batches, "micro-batch"),
            c.schedule,
            if c.chunks > 1 { format!(" ({} chunks per device)", c.chunks) } else { String::new() }
        )?;
        writeln!(f, "| stage | device | units | time per micro-batch | memory |")?;
        writeln!(f, "|---|---|---|---|---|")?;
        for (s, r) in self.partition.stages.iter().enumerate() {
            let names = &self.unit_names[r.clone()];
            let units = if names.len() > 3 {
                format!("{}..{} ({} units: {} … {})", r.start, r.end - 1, names.len(), names[0], names[names.len() - 1])
            } else {
                format!("{}..{} ({})", r.start, r.end - 1, names.join(", "))
            };
            writeln!(
                f,
                "| {s} | {} | {units} | {:.3} ms | {:.1} MiB{} |",
                self.device(0, s),
                self.partition.stage_time[s] * 1e3,
                self.partition.stage_memory[s] as f64 / (1 << 20) as f64,
                self.partition.recomputed_text(s, 0).map(|t| format!(", recomputes {t}")).unwrap_or_default()
            )?;
        }
        if c.chunks > 1 {
            let mib: Vec<String> = self
                .partition
                .device_memory(c.pipeline_len)
                .iter()
                .map(|&b| format!("{:.1}", b as f64 / (1 << 20) as f64))
                .collect();
            writeln!(f, "memory per device (its {} stages): {} MiB", c.chunks, mib.join(", "))?;
        }
        // Interleaving runs micro-batches in groups of K: a last group of fewer waits for its
        // own chunks to come round, which neither formula counts (the simulation does).
        let partial_group = c.chunks > 1 && !c.micro_batches.is_multiple_of(c.pipeline_len);
        let measured = match self.slice_times_measured() {
            true => format!(
                " (token slices at their measured shares of a micro-batch's time: {:.2}× it together)",
                self.shares_together()
            ),
            false => String::new(),
        };
        writeln!(
            f,
            "bottleneck {:.3} ms per micro-batch; predicted bubble {:.1}% (formula for equal stages {:.1}%){measured}{}",
            self.partition.bottleneck() * 1e3,
            100.0 * self.predicted_bubble(),
            100.0 * self.bubble_formula(),
            if partial_group {
                format!(
                    "; both leave out the wait of the last group of {}, {} not being a multiple of \
                     K = {}",
                    counted(c.micro_batches % c.pipeline_len, "micro-batch"),
                    c.micro_batches,
                    c.pipeline_len
                )
            } else {
                String::new()
            }
        )?;
        // Measured slices can cost more together than the whole micro-batch: their bubble is
        // then no measure of the step, which is set beside the unsliced one.
        let unsliced = match self.slice_times_measured() {
            true => self.unsliced().and_then(|p| p.simulate()).ok().map(|s| s.makespan()),
            false => None,
        };
        match self.simulate() {
            Ok(sim) => writeln!(
                f,
                "simulated: step {:.3} ms, bubble {:.1}%{}",
                sim.makespan() * 1e3,
                100.0 * sim.bubble(),
                unsliced.map(|t| format!("; unsliced, step {:.3} ms", t * 1e3)).unwrap_or_default()
            )?,
            Err(e) => writeln!(f, "simulated: {e}")?,
        }
        // `F3.1`: micro-batch 3's forward on stage 1; `F3/0.1`: its first token slice's, where
        // the sequences are sliced.
        let sliced = self.config.token_slices.len() > 1;
        let label = |p: &super::Piece| if sliced { format!("{}/{}", p.mb, p.slice) } else { p.to_string() };
        for (d, list) in self.schedule.per_device.iter().enumerate() {
            let compact: Vec<String> = list
                .iter()
                .filter_map(|a| match a {
                    super::Action::Forward { piece, stage } => Some(format!("F{}.{stage}", label(piece))),
                    super::Action::Backward { piece, stage } => Some(format!("B{}.{stage}", label(piece))),
                    super::Action::BackwardWeights { piece, stage } => Some(format!("W{}.{stage}", label(piece))),
                    _ => None,
                })
                .collect();
            writeln!(f, "device {d}: {}", compact.join(" "))?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn units(n: usize) -> Vec<UnitProfile> {
        vec![
            UnitProfile {
                forward: 1.0,
                backward: 2.0,
                params: 100,
                activation_bytes: 1000,
                trainable: true,
                ..Default::default()
            };
            n
        ]
    }

    fn names(n: usize) -> Vec<String> {
        (0..n).map(|i| format!("u{i}")).collect()
    }

    #[test]
    fn bad_requests_fail_before_any_work_with_the_field_named() {
        let cfg = |k, r, m| PipelineConfig { pipeline_len: k, replicas: r, micro_batches: m, ..Default::default() };
        let err = |c: PipelineConfig, devices| Plan::new(c, &units(6), names(6), devices, 0).unwrap_err().to_string();
        assert!(err(cfg(7, 1, 2), 8).contains("6 active units"));
        assert!(err(cfg(2, 3, 2), 4).contains("need 6 devices; 4 available"));
        assert!(err(cfg(2, 1, 0), 4).contains("micro_batches"));
        assert!(err(cfg(0, 1, 1), 4).contains("pipeline_len"));
        let tight = PipelineConfig { memory_limit: Some(1000), ..cfg(2, 1, 2) };
        assert!(err(tight, 2).contains("memory_limit"));
        // Given stages are held to the limit too: 3 units' state (3 × 1600 B) and 2 of their
        // micro-batches in flight (2 × 3000 B) on the first stage is 10800 B.
        let given = |limit| {
            let config = PipelineConfig { memory_limit: Some(limit), ..cfg(2, 1, 2) };
            Plan::with_stages(config, &units(6), names(6), 2, vec![0..3, 3..6])
                .and_then(Plan::within_limit)
                .map(|p| p.partition.stage_memory)
        };
        assert_eq!(given(10800).unwrap()[0], 10800);
        let e = given(10799).unwrap_err().to_string();
        assert!(e.contains("memory_limit") && e.contains("need 10800 bytes") && e.contains("2 micro-batch"), "{e}");
    }

    /// A device of an interleaved schedule holds all its chunks' stages: the limit holds for
    /// their sum, not for each stage alone.
    #[test]
    fn an_interleaved_plan_keeps_each_device_within_the_limit() {
        let config = |limit| PipelineConfig {
            pipeline_len: 2,
            micro_batches: 4,
            chunks: 2,
            schedule: crate::pipeline::ScheduleKind::Interleaved,
            memory_limit: limit,
            ..Default::default()
        };
        let plan = |limit| Plan::new(config(limit), &units(8), names(8), 2, 0);
        let free = plan(None).unwrap();
        // The unlimited split holds 11200 bytes in its largest stage but 18400 on device 0:
        // a limit per stage would have passed it at 11200.
        let stage = *free.partition.stage_memory.iter().max().unwrap();
        let device = free.partition.device_peak(2);
        assert_eq!((stage, device), (11200, 18400));
        for limit in (stage..=device).step_by(100) {
            match plan(Some(limit)) {
                Ok(p) => assert!(p.partition.device_peak(2) <= limit, "{limit}: {:?}", p.partition),
                Err(e) => assert!(e.to_string().contains("bytes per device"), "{limit}: {e}"),
            }
        }
        // Below the unlimited split's peak, another split that fits is found (a brute force
        // over the 35 splits gives 14000 bytes as the least any reaches).
        let tighter = plan(Some(16000)).unwrap();
        assert!(tighter.partition.stages != free.partition.stages && tighter.partition.device_peak(2) <= 16000);
        // Below that least, the refusal names the tightest split the search met (it balances
        // time first, so not the 14000-byte one), a limit that plans, not the unlimited
        // split's peak.
        let e = plan(Some(13999)).unwrap_err().to_string();
        assert!(e.contains("the tightest split it found needs 15000 bytes on a device"), "{e}");
        assert!(plan(Some(15000)).is_ok());
        assert_eq!(plan(Some(device)).unwrap().partition, free.partition);
        // Given stages are held to the devices' sums too.
        let given = Plan::with_stages(config(Some(device - 1)), &units(8), names(8), 2, free.partition.stages.clone())
            .and_then(Plan::within_limit);
        assert!(given.unwrap_err().to_string().contains(&format!("need {device} bytes")));
    }

    /// The per-device search of an interleaved schedule counts recomputing stages too, and a
    /// plan of the stages it found (a resumed run's) recomputes the same ones; a sliced
    /// pipeline recomputes, zb-h1 does not.
    #[test]
    fn recomputation_fits_interleaved_devices_and_given_stages() {
        let config = |recompute| PipelineConfig {
            pipeline_len: 2,
            micro_batches: 4,
            chunks: 2,
            schedule: crate::pipeline::ScheduleKind::Interleaved,
            memory_limit: Some(12000),
            recompute,
            ..Default::default()
        };
        let units: Vec<UnitProfile> = units(8).into_iter().map(|u| UnitProfile { input_bytes: 100, ..u }).collect();
        let e = Plan::new(config(Recompute::Off), &units, names(8), 2, 0).unwrap_err().to_string();
        assert!(e.contains("within 12000 bytes per device"), "{e}");
        let p = Plan::new(config(Recompute::Auto), &units, names(8), 2, 0).unwrap();
        assert!(p.partition.device_peak(2) <= 12000, "{:?}", p.partition);
        assert!(p.partition.recomputed.iter().any(|r| !r.is_empty()), "{:?}", p.partition);
        assert!(p.partition.recomputed.iter().any(|r| r.is_empty()), "{:?}", p.partition);
        let given = Plan::with_stages(config(Recompute::Auto), &units, names(8), 2, p.partition.stages.clone());
        assert_eq!(given.and_then(Plan::within_limit).unwrap().partition, p.partition);
        // Over token slices too; not with zb-h1. TeraPipe's slicer plans a recomputing
        // pipeline without the limit, which the recomputation meets.
        let gpipe = |recompute, token_slices| PipelineConfig {
            chunks: 1,
            schedule: crate::pipeline::ScheduleKind::Gpipe,
            token_slices,
            ..config(recompute)
        };
        let sliced = Plan::new(gpipe(Recompute::All, vec![4, 3]), &units, names(8), 2, 0).unwrap();
        assert!(sliced.partition.recomputed.iter().all(|r| !r.is_empty()), "{:?}", sliced.partition);
        assert_eq!(gpipe(Recompute::Auto, vec![]).for_slicing().memory_limit, None);
        assert_eq!(gpipe(Recompute::Off, vec![]).for_slicing().memory_limit, Some(12000));
        let zb =
            PipelineConfig { schedule: crate::pipeline::ScheduleKind::ZeroBubble, ..gpipe(Recompute::All, vec![]) };
        let e = Plan::new(zb, &units, names(8), 2, 0).unwrap_err().to_string();
        assert!(e.contains("recompute") && e.contains("zb-h1"), "{e}");
    }

    /// Where stages recompute under a memory limit, TeraPipe's slicing is planned for time and
    /// kept where its plan fits recomputing; else planned under the limit as without
    /// recomputation; else whole micro-batches where they fit recomputing; else the refusal
    /// names the least limit that plans, whole or over those slices. Four equal units, 2
    /// stages × 2 units, GPipe, `M = 2`: unsliced a stage takes 3200 B of state plus 2 × 2000 B of activations,
    /// 5400 B recomputing both units (2 × 100 B of input + 2000 B); over slices [2, 2] the
    /// arenas add 400 B of key/value gradients a unit and are kept: 8800 B, 6600 B recomputing
    /// (of which 800 B regained: one slice's activations, half a micro-batch's).
    #[test]
    fn recomputing_slicing_plans_for_time_then_falls_back() {
        use std::cell::RefCell;
        let units: Vec<UnitProfile> = units(4)
            .into_iter()
            .map(|u| UnitProfile { kv_bytes: 200, kv_grad_bytes: 400, input_bytes: 100, ..u })
            .collect();
        let config = |recompute, limit| PipelineConfig {
            pipeline_len: 2,
            micro_batches: 2,
            schedule: crate::pipeline::ScheduleKind::Gpipe,
            memory_limit: Some(limit),
            recompute,
            ..Default::default()
        };
        // A slicer that plans [2, 2] without a limit and refuses under one, noting the limits
        // it was asked for.
        let asked = RefCell::new(Vec::new());
        let slicer = |c: &PipelineConfig| {
            asked.borrow_mut().push(c.memory_limit);
            match c.memory_limit {
                None => Ok(vec![2, 2]),
                Some(_) => Err(config_error("memory_limit", "no slicing meets the memory limit")),
            }
        };
        let given = [0..2, 2..4];
        for stages in [None, Some(&given[..])] {
            let run = |recompute, limit| {
                asked.borrow_mut().clear();
                let got = Plan::recomputing_slicing(&config(recompute, limit), &units, 0, stages, slicer, Vec::clone);
                (got.map_err(|e| e.to_string()), asked.borrow().clone())
            };
            assert_eq!(run(Recompute::Auto, 6600), (Ok(Some(vec![2, 2])), vec![None]), "{stages:?}");
            let whole = run(Recompute::Auto, 6599);
            assert_eq!(whole, (Ok(None), vec![None, Some(6599)]), "{stages:?}");
            let (refused, _) = run(Recompute::Auto, 5399);
            assert!(refused.as_ref().is_err_and(|e| e.contains("5400 bytes")), "{stages:?}: {refused:?}");
            let (off, asked) = run(Recompute::Off, 6600);
            assert!(off.is_err_and(|e| e.contains("no slicing")) && asked == [Some(6600)], "{stages:?}");
            // A slicer whose own memory model passes [2, 2] under the limit is not taken at its
            // word: the plan of its slices must fit (here whole micro-batches do).
            let lax = |_: &PipelineConfig| Ok(vec![2, 2]);
            let got = Plan::recomputing_slicing(&config(Recompute::Auto, 6599), &units, 0, stages, lax, Vec::clone);
            assert_eq!(got.map_err(|e| e.to_string()), Ok(None), "{stages:?}");
        }
        // Without arenas (no attention), a slice regains half a micro-batch's activations:
        // sliced, the stages need 4400 B recomputing, less than whole micro-batches' 5400 B,
        // and a refusal names the lesser.
        let units = &units[..].iter().map(|u| UnitProfile { kv_bytes: 0, kv_grad_bytes: 0, ..*u }).collect::<Vec<_>>();
        for stages in [None, Some(&given[..])] {
            let run = |limit| {
                Plan::recomputing_slicing(&config(Recompute::Auto, limit), units, 0, stages, slicer, Vec::clone)
            };
            assert_eq!(run(4400).map_err(|e| e.to_string()), Ok(Some(vec![2, 2])), "{stages:?}");
            let e = run(4399).unwrap_err().to_string();
            let want = "the token slices planned for time, [2, 2], need 4400 bytes, whole micro-batches 5400 bytes";
            assert!(e.contains(want), "{stages:?}: {e}");
        }
        // More slices regain less each: the fewest equal ones that fit are 4, and a plan of them
        // does fit where one of 3 does not.
        assert_eq!(Plan::fewest_equal_slices(&config(Recompute::Auto, 4399), units, 0, None, 4), Some(4));
        assert_eq!(Plan::fewest_equal_slices(&config(Recompute::Auto, 4400), units, 0, None, 4), Some(2));
        assert_eq!(Plan::fewest_equal_slices(&config(Recompute::Auto, 3000), units, 0, None, 4), None);
        let with = |token_slices: Vec<usize>| {
            let c = PipelineConfig { token_slices, ..config(Recompute::Auto, 4399) };
            Plan::new(c, units, vec![String::new(); 4], 2, 0)
        };
        assert!(with(vec![1, 1, 1, 1]).is_ok() && with(vec![2, 1, 1]).is_err());
        // `auto` runs them where nothing its slicer plans fits, on given stages too (as each
        // shape AutoPipe changes to is sliced), and is refused where they do not fit either.
        let refused = |e: Error| match e {
            Error::Config { field, .. } => field,
            e => e.to_string(),
        };
        for stages in [None, Some(&given[..])] {
            let auto = |limit| {
                Plan::auto_slicing(&config(Recompute::Auto, limit), units, 0, stages, 4, slicer, Vec::clone)
                    .map_err(refused)
            };
            assert_eq!(auto(4400), Ok(AutoSliced::Planned(vec![2, 2])), "{stages:?}");
            assert_eq!(auto(4399), Ok(AutoSliced::Equal(vec![1, 1, 1, 1])), "{stages:?}");
            assert_eq!(Plan::fewest_equal_slices(&config(Recompute::Auto, 4399), units, 0, stages, 4), Some(4));
            assert_eq!(auto(3000), Err("memory_limit".into()), "{stages:?}");
        }
        let units: Vec<UnitProfile> =
            units.iter().map(|u| UnitProfile { kv_bytes: 200, kv_grad_bytes: 400, ..*u }).collect();
        let whole = Plan::auto_slicing(&config(Recompute::Auto, 6599), &units, 0, None, 4, slicer, Vec::clone);
        assert_eq!(whole.map_err(refused), Ok(AutoSliced::Whole));
    }

    /// Without recomputation a slicing is kept only where a plan of it fits the memory limit,
    /// as with it: a one-stage pipeline's slicer keeps micro-batches whole without looking at
    /// the limit, and where they exceed it `auto` runs the fewest equal slices that fit (token
    /// slices shrink the attention scores a micro-batch keeps). Four units on one stage, GPipe,
    /// `M = 2`: 4 × 1600 B of state and 2 × 4 × 1000 B of activations whole (14400 B), of which
    /// 800 B a unit are scores; over [2, 2] they keep 12/16 of those (12800 B), over four
    /// slices of one token 10/16 (12000 B).
    #[test]
    fn without_recomputation_a_slicing_is_kept_only_where_its_plan_fits() {
        let units: Vec<UnitProfile> = units(4).into_iter().map(|u| UnitProfile { score_bytes: 800, ..u }).collect();
        let config = |pipeline_len, limit| PipelineConfig {
            pipeline_len,
            micro_batches: 2,
            schedule: crate::pipeline::ScheduleKind::Gpipe,
            memory_limit: Some(limit),
            ..Default::default()
        };
        let refused = |e: Error| match e {
            Error::Config { field, .. } => field,
            e => e.to_string(),
        };
        let whole = |_: &PipelineConfig| Ok(Vec::new());
        let auto =
            |limit| Plan::auto_slicing(&config(1, limit), &units, 0, None, 4, whole, Vec::clone).map_err(refused);
        assert_eq!(auto(14400), Ok(AutoSliced::Planned(vec![])));
        assert_eq!(auto(14399), Ok(AutoSliced::Equal(vec![2, 2])));
        assert_eq!(auto(12000), Ok(AutoSliced::Equal(vec![1, 1, 1, 1])));
        assert!(auto(11999).is_err_and(|field| field.ends_with("memory_limit")));
        // On two stages a slicer whose own memory model passes [2, 2] is held to the plan's.
        let lax = |_: &PipelineConfig| Ok(vec![2, 2]);
        let kept = |limit| Plan::recomputing_slicing(&config(2, limit), &units, 0, None, lax, Vec::clone);
        let fits =
            Plan::new(PipelineConfig { token_slices: vec![2, 2], ..config(2, usize::MAX) }, &units, names(4), 2, 0)
                .unwrap()
                .partition
                .device_peak(2);
        assert_eq!(kept(fits).map_err(refused), Ok(Some(vec![2, 2])));
        assert!(kept(fits - 1).map_err(refused).is_err_and(|field| field.ends_with("memory_limit")));
    }

    /// The fewest equal slices are searched up to a token a slice: between the powers of two
    /// and past 64. Recomputing, a slice's backward holds its own tokens' activations again,
    /// so with slices of at most one token (48 of 48, 100 of 100) the stages need the least.
    #[test]
    fn the_fewest_equal_slices_are_searched_up_to_a_token_a_slice() {
        let units: Vec<UnitProfile> = units(4).into_iter().map(|u| UnitProfile { input_bytes: 100, ..u }).collect();
        let config = |limit| PipelineConfig {
            pipeline_len: 2,
            micro_batches: 2,
            schedule: crate::pipeline::ScheduleKind::Gpipe,
            memory_limit: Some(limit),
            recompute: Recompute::All,
            ..Default::default()
        };
        let peak = |seq: usize, n: usize| {
            let sliced = PipelineConfig { token_slices: uniform_slices(seq, n), ..config(usize::MAX) };
            Plan::new(sliced, &units, names(4), 2, 0).unwrap().partition.device_peak(2)
        };
        for seq in [48, 100] {
            assert!(peak(seq, seq - 1) > peak(seq, seq), "{seq}");
            assert_eq!(Plan::fewest_equal_slices(&config(peak(seq, seq)), &units, 0, None, seq), Some(seq));
            assert_eq!(Plan::fewest_equal_slices(&config(peak(seq, seq) - 1), &units, 0, None, seq), None);
        }
        // (Fewer where fewer fit: 24 slices of 48 are all of 2 tokens, as any count up to 47 has some.)
        assert_eq!(Plan::fewest_equal_slices(&config(peak(48, 24)), &units, 0, None, 48), Some(24));
    }

    /// TeraPipe's slicing is planned for the stages cut on time; where the slicer refuses those
    /// under a memory limit, for the stages the limit forces on whole sequences; where both
    /// fail, or there is no limit, the first refusal stands (with what whole sequences need,
    /// where no split fits them).
    #[test]
    fn slicing_falls_back_to_the_cut_a_memory_limit_forces() {
        use std::ops::Range;
        let config =
            |limit| PipelineConfig { pipeline_len: 2, micro_batches: 2, memory_limit: limit, ..Default::default() };
        // Stage 0 of the time cut holds 3 × 1600 B of state and two micro-batches of 3000 B:
        // 10800 B; the forced cut, 7200 B and 10400 B.
        let (time, forced) = (vec![0..3, 3..6], vec![0..2, 2..6]);
        let refused = |stages: &[Range<usize>]| config_error("token_slices", format!("{stages:?} refused"));
        let picky = |stages: &[Range<usize>]| match stages == forced.as_slice() {
            true => Ok(stages.to_vec()),
            false => Err(refused(stages)),
        };
        assert_eq!(Plan::slice_cut(&config(Some(10400)), &units(6), 0, picky).unwrap(), forced);
        let e = Plan::slice_cut(&config(None), &units(6), 0, picky).unwrap_err().to_string();
        assert!(e.contains("[0..3, 3..6] refused"), "{e}");
        let none = |stages: &[Range<usize>]| -> Result<()> { Err(refused(stages)) };
        let e = Plan::slice_cut(&config(Some(10400)), &units(6), 0, none).unwrap_err().to_string();
        assert!(e.contains("[0..3, 3..6] refused"), "{e}");
        let any = |stages: &[Range<usize>]| Ok(stages.to_vec());
        assert_eq!(Plan::slice_cut(&config(Some(10400)), &units(6), 0, any).unwrap(), time);
        // Below what whole sequences need on any split, the refusal names that too.
        let e = Plan::slice_cut(&config(Some(10399)), &units(6), 0, none).unwrap_err().to_string();
        assert!(
            e.contains("on the stages cut for time, [0..3, 3..6] refused; on stages cut for memory, whole sequences: "),
            "{e}"
        );
        assert!(e.contains("the best split needs 10400 bytes"), "{e}");
    }

    #[test]
    fn prints_the_partition_schedule_and_bubble() {
        let p = Plan::new(
            PipelineConfig { pipeline_len: 3, micro_batches: 4, ..Default::default() },
            &units(6),
            names(6),
            3,
            0,
        )
        .unwrap();
        let text = p.to_string();
        assert!(text.contains("| 2 | 2 | 4..5 (u4, u5)"), "{text}");
        assert!(text.contains("predicted bubble 33.3%"), "{text}");
        assert!(text.contains("device 2: F0.2 B0.2"), "{text}");
        assert_eq!(p.device(1, 2), 5);
        // Equal stages: the prediction is the formula; zero bubble's is a third of the fill.
        let zb = |m| {
            let config = PipelineConfig {
                pipeline_len: 3,
                micro_batches: m,
                schedule: crate::pipeline::ScheduleKind::ZeroBubble,
                ..Default::default()
            };
            Plan::new(config, &units(6), names(6), 3, 0).unwrap()
        };
        for m in [1, 4, 9] {
            let p = zb(m);
            assert!((p.predicted_bubble() - p.schedule.bubble_formula()).abs() < 1e-12, "M={m}");
        }
        assert!((zb(4).predicted_bubble() - 2.0 / 14.0).abs() < 1e-12);
    }
}
