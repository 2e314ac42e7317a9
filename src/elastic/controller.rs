//! `Elastic`: the PipeTransformer loop as a [`Controller`] of the trainer. Between steps it
//! feeds the freeze controller each step's per-layer gradient norms, serves and fills the
//! activation cache, times micro-batch candidates; at each interval's end it applies the
//! freeze rule, and when the frozen count grows it makes one *transition* without restarting
//! anything: freeze the prefix, choose the pipeline's new shape (AutoPipe), hand freed devices
//! to new replicas (AutoDP), decide whether the cache pays (AutoCache), and log what changed
//! and how long it took.

use super::autodp::{batches_per_step, rebuild_communicators, replicas_for};
use super::autopipe::{
    Candidate, Shapes, Timing, Tuner, agree, choose_shape, micro_batch_candidates, pick, schedule_for,
};
use super::cache::{ActivationCache, CacheDtype};
use super::freeze::FreezeController;
use super::{BatchPolicy, ElasticConfig, FreezeInterval, FreezeName};
use crate::device::Device;
use crate::error::{Result, config_error};
use crate::model::{Hidden, HostBatch};
use crate::pipeline::{AutoSliced, PipelineStep, Plan, UnitProfile};
use crate::train::checkpoint::Tensor;
use crate::train::{Controller, Event, Prepared, Trainer, Transition};
use serde::{Deserialize, Serialize};
use std::time::Instant;

/// Plans TeraPipe's token slices for a pipeline shape, with micro-batches of so many sequences
/// over units costing so much each (for such a micro-batch; the frozen ones marked), cut into
/// those stages: a run's `auto` slicing, from its one measurement (none: the micro-batches run
/// whole).
pub type Slicer = Box<
    dyn Fn(&crate::pipeline::PipelineConfig, usize, &[UnitProfile], &[std::ops::Range<usize>]) -> Result<Vec<usize>>
        + Send,
>;

/// `slicer`'s token slices for `config`'s shape, with micro-batches of `samples` sequences
/// of `seq` tokens over units costing `units`: on `stages` when given, or on the stages a plan
/// of it cuts, the first `pinned` units on the first ([`Plan::slice_cut`]), by the rule that
/// slices a run's first plan ([`Plan::auto_slicing`]: the fewest equal slices where nothing the
/// slicer plans fits the memory limit); whole micro-batches where nothing fits (the plan's own
/// check then decides).
fn sliced_by(
    slicer: &Slicer,
    seq: usize,
    config: &crate::pipeline::PipelineConfig,
    samples: usize,
    units: &[UnitProfile],
    pinned: usize,
    stages: Option<&[std::ops::Range<usize>]>,
) -> Vec<usize> {
    let slice = |c: &crate::pipeline::PipelineConfig| match stages {
        Some(given) => slicer(c, samples, units, given),
        None => Plan::slice_cut(c, units, pinned, |cut| slicer(c, samples, units, cut)),
    };
    let shape = (config.pipeline_len, config.micro_batches);
    match Plan::auto_slicing(config, units, pinned, stages, seq, slice, Vec::clone) {
        Ok(AutoSliced::Planned(lengths)) => lengths,
        Ok(AutoSliced::Whole) => Vec::new(),
        Ok(AutoSliced::Equal(lengths)) => {
            if crate::debug::level() >= 1 {
                eprintln!(
                    "terapipe: K={} M={}: no planned slicing fits; {lengths:?}, the fewest equal",
                    shape.0, shape.1
                );
            }
            lengths
        }
        Err(e) => {
            if crate::debug::level() >= 1 {
                eprintln!("terapipe: no slicing for K={} M={}: {e}", shape.0, shape.1);
            }
            Vec::new()
        }
    }
}

/// A pipeline's shape: its plan's config and stages (a transition's before).
type Shape = (crate::pipeline::PipelineConfig, Vec<std::ops::Range<usize>>);

/// Sequences in each of `m` micro-batches of a replica of `trainer`'s pipeline in force, for
/// steps of `batch`-sample source batches.
fn micro_samples<D: Device>(trainer: &Trainer<D>, batch: usize, m: usize) -> usize {
    let replicas = trainer.pipeline.plan().config.replicas;
    crate::pipeline::samples_per_micro_batch(batch * trainer.batches_per_step, replicas, m)
}

/// The shape `trainer`'s pipeline runs in now.
fn shape<D: Device>(trainer: &Trainer<D>) -> Shape {
    let plan = trainer.pipeline.plan();
    (plan.config.clone(), plan.partition.stages.clone())
}

/// Units frozen with `layers` Transformer layers frozen: the embedding and two per layer.
pub fn frozen_units(layers: usize) -> usize {
    if layers == 0 { 0 } else { 1 + 2 * layers }
}

/// Each layer's squared gradient norm from the units' (attention `1 + 2ℓ`, MLP `2 + 2ℓ`).
pub fn layer_grad_sq(unit_grad_sq: &[f64], layers: usize) -> Vec<f64> {
    (0..layers)
        .map(|l| unit_grad_sq.get(1 + 2 * l).unwrap_or(&0.0) + unit_grad_sq.get(2 + 2 * l).unwrap_or(&0.0))
        .collect()
}

/// `‖now − before‖ / ‖before‖` per layer.
pub fn relative_changes(before: &[Vec<f32>], now: &[Vec<f32>]) -> Vec<f64> {
    before
        .iter()
        .zip(now)
        .map(|(b, n)| {
            if b.len() != n.len() {
                return f64::INFINITY; // not the same layer: never counts as settled
            }
            let (mut diff, mut norm) = (0.0f64, 0.0f64);
            for (&b, &n) in b.iter().zip(n) {
                diff += (f64::from(n) - f64::from(b)).powi(2);
                norm += f64::from(b).powi(2);
            }
            if norm > 0.0 {
                (diff / norm).sqrt()
            } else if diff > 0.0 {
                f64::INFINITY
            } else {
                0.0
            }
        })
        .collect()
}

/// What a checkpoint keeps of the controller.
#[derive(Serialize, Deserialize)]
struct State {
    freeze: FreezeController,
    frozen_layers: usize,
    tuned: std::collections::BTreeMap<String, usize>,
    cache_on: bool,
    /// The micro-batch counts being timed, and the count in force before they were.
    #[serde(default)]
    tuning: Option<(Timing, usize)>,
    /// When the rule runs and the settling test's bound (absent in checkpoints from before
    /// they were recorded).
    #[serde(default)]
    interval: Option<(FreezeInterval, Option<f64>)>,
    /// A trial of pipeline lengths under way (absent in checkpoints from before trials).
    #[serde(default)]
    shape_trial: Option<ShapeTrial>,
    /// The `[elastic]` settings the run had (absent in checkpoints from before they were
    /// recorded): a resume names those it changes.
    #[serde(default)]
    config: Option<serde_json::Value>,
    /// The token slices of the count timing began from (absent before they were recorded).
    #[serde(default)]
    tuning_slices: Vec<usize>,
    /// The replicas the run started with under AutoDP (`R₀`, which `scale-lr` measures `R`
    /// against), whatever a resume's flags ask a fresh run to start with.
    #[serde(default)]
    initial_replicas: Option<usize>,
    /// What the run asked of its pipeline (absent before it was recorded: what this run asks).
    #[serde(default)]
    asked: Option<Asked>,
}

/// AutoPipe's trial of two pipeline lengths after a freeze: the one it chose runs first and
/// its micro-batch counts are timed; then the length that was in force, timed the same way;
/// the faster is kept.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
enum ShapeTrial {
    /// The chosen shape is being timed; this one, the length that was in force, comes next.
    Next(crate::pipeline::PipelineConfig),
    /// The chosen shape was timed (at its best micro-batch count, with its rate in
    /// positions/s); the other is being timed.
    Timed(crate::pipeline::PipelineConfig, f64),
}

/// The run's shape around it, fixed when the controller is made.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Surroundings {
    /// Transformer layers of the model.
    pub layers: usize,
    /// Devices the run may use.
    pub devices: usize,
    /// Replicas at the start (`R₀`).
    pub initial_replicas: usize,
    /// Samples per source batch.
    pub batch: usize,
    /// Hidden-state positions of the longest sample.
    pub positions: usize,
    /// Elements per position.
    pub width: usize,
    /// How the devices hold activations, as the cache stores them unless told otherwise:
    /// [`CacheDtype::Bf16`] on a bf16 GPU, [`CacheDtype::F32`] elsewhere.
    pub activation_dtype: CacheDtype,
}

/// The PipeTransformer controller.
pub struct Elastic {
    config: ElasticConfig,
    around: Surroundings,
    freeze: FreezeController,
    frozen_layers: usize,
    cache: Option<ActivationCache>,
    cache_on: bool,
    tuner: Tuner,
    /// The next step warms the new shape up and is not timed.
    warming: bool,
    /// The micro-batch count in force when tuning began (what the tuned one replaces), and
    /// its token slices.
    tuning_from: usize,
    tuning_slices: Vec<usize>,
    /// AutoPipe's trial of pipeline lengths, while one is under way.
    shape_trial: Option<ShapeTrial>,
    /// With a settling test: each layer's weights when the interval began (checkpointed by
    /// [`state_tensors`](Self::state_tensors); `None` when unknown, and then the interval
    /// under way freezes nothing more).
    reference: Option<Vec<Vec<f32>>>,
    /// The run's `auto` token slicing, planned afresh for each shape and micro-batch count,
    /// and the length in tokens of the sequences it cuts.
    slicer: Option<(Slicer, usize)>,
    /// What the run asked of its pipeline: the schedule, chunks and token slices that every
    /// shape of more than one stage runs (one stage runs 1F1B, whole), so a pipeline that
    /// AutoPipe shortens to one stage and lengthens again runs as asked.
    asked: Option<Asked>,
}

/// The schedule, chunks per device and token slices a run asks of its pipeline.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
struct Asked {
    schedule: crate::pipeline::ScheduleKind,
    chunks: usize,
    token_slices: Vec<usize>,
}

impl Asked {
    fn of(plan: &crate::pipeline::PipelineConfig) -> Self {
        Asked { schedule: plan.schedule, chunks: plan.chunks, token_slices: plan.token_slices.clone() }
    }
}

impl Elastic {
    /// A controller for `config`; `cache_dir` is where the cache spills unless the config
    /// names a directory. The cache's directory is created and checked now. The switches are
    /// not checked against each other here ([`ElasticConfig::validate`] does, as a run's job
    /// calls it: a test may time AutoPipe's counts without a freeze rule). Call
    /// [`start`](Self::start) before the first step.
    pub fn new(config: ElasticConfig, around: Surroundings, cache_dir: &std::path::Path) -> Result<Self> {
        let freeze = FreezeController::new(config.rule(), config.alpha, around.layers)?;
        let cache = if config.cache {
            let dir = config.cache_dir.clone().unwrap_or_else(|| cache_dir.to_path_buf());
            let dtype = config.cache_dtype.unwrap_or(around.activation_dtype);
            let batch_bytes = around
                .batch
                .saturating_mul(around.positions)
                .saturating_mul(around.width)
                .saturating_mul(dtype.bytes());
            Some(ActivationCache::new(around.width, dtype, config.cache_bytes, batch_bytes, &dir)?)
        } else {
            None
        };
        if around.devices == 0 {
            return Err(config_error("devices", "must be at least 1"));
        }
        Ok(Self {
            config,
            around,
            freeze,
            frozen_layers: 0,
            cache,
            cache_on: false,
            tuner: Tuner::default(),
            warming: false,
            tuning_from: 0,
            tuning_slices: Vec::new(),
            shape_trial: None,
            reference: None,
            slicer: None,
            asked: None,
        })
    }

    /// Plans the token slices of each shape and micro-batch count the run changes to with
    /// `slicer` (a run with `token_slices = "auto"`) for sequences of `seq` tokens; without
    /// one, a shape of more than one stage runs the slices the run began with (a given list is
    /// the user's), and one of one stage none.
    pub fn plan_token_slices_with(&mut self, slicer: Slicer, seq: usize) {
        self.slicer = Some((slicer, seq));
    }

    /// The plan the run asks for ([`start`](Self::start) takes the plan in force instead): what a
    /// checkpoint from before the asked plan was recorded resumes with.
    pub fn ask_for(&mut self, plan: &crate::pipeline::PipelineConfig) {
        self.asked = Some(Asked::of(plan));
    }

    /// The token slices `config`'s shape runs with micro-batches of `samples` sequences over
    /// units costing `units`, cut into `stages`: the slicer's plan ([`sliced_by`]), or
    /// `config`'s.
    fn token_slices(
        &self,
        config: &crate::pipeline::PipelineConfig,
        samples: usize,
        units: &[UnitProfile],
        stages: &[std::ops::Range<usize>],
    ) -> Vec<usize> {
        match &self.slicer {
            Some((slicer, seq)) => sliced_by(slicer, *seq, config, samples, units, 0, Some(stages)),
            None => config.token_slices.clone(),
        }
    }

    /// The token slices a shape AutoPipe adopts runs: the slicer's plan for the stages a plan
    /// of it cuts, the first `pinned` units on the first, as a run's first plan is sliced
    /// ([`sliced_by`]), except that a given list is dropped on one stage: it has no fill or
    /// drain for them to shorten, and they would only add each slice's overhead (`auto`
    /// decides for one stage as for any).
    fn adopted_slices(
        &self,
        config: &crate::pipeline::PipelineConfig,
        samples: usize,
        units: &[UnitProfile],
        pinned: usize,
    ) -> Vec<usize> {
        match &self.slicer {
            // (Where no stages can be cut, a plan of the shape fails alike, and says why.)
            Some((slicer, seq)) => sliced_by(slicer, *seq, config, samples, units, pinned, None),
            None if config.pipeline_len == 1 => Vec::new(),
            None => config.token_slices.clone(),
        }
    }

    /// `config` at `m` micro-batches of `samples` sequences each over units costing `units`,
    /// cut into `stages`, sliced as [`token_slices`](Self::token_slices) says.
    fn with_micro_batches(
        &self,
        config: &crate::pipeline::PipelineConfig,
        m: usize,
        samples: usize,
        units: &[UnitProfile],
        stages: &[std::ops::Range<usize>],
    ) -> crate::pipeline::PipelineConfig {
        let config = crate::pipeline::PipelineConfig { micro_batches: m, ..config.clone() };
        crate::pipeline::PipelineConfig { token_slices: self.token_slices(&config, samples, units, stages), ..config }
    }

    /// Frozen Transformer layers now.
    pub fn frozen_layers(&self) -> usize {
        self.frozen_layers
    }

    /// Whether batches are read from the cache.
    pub fn cache_on(&self) -> bool {
        self.cache_on
    }

    /// Before the first step: applies a freeze table's first entry, and with AutoPipe times
    /// the initial plan's micro-batch counts (the configured one first) as after a transition.
    pub fn start<D: Device>(&mut self, trainer: &mut Trainer<D>, on_event: &mut dyn FnMut(&Event)) -> Result<()> {
        self.asked = Some(Asked::of(&trainer.pipeline.plan().config));
        self.reference = self.layer_weights(trainer)?;
        let first = self.freeze.initial();
        self.freeze.frozen = first;
        if first > self.frozen_layers {
            self.transition(trainer, first, "the freeze table's first interval".into(), on_event)?;
        } else if self.config.auto_pipe {
            let c = trainer.pipeline.plan().config.clone();
            let per_replica = micro_samples(trainer, self.around.batch, 1);
            // Fewer micro-batches hold more samples each: only counts within the memory limit
            // (with their slices) are timed.
            let fits = |m: usize| {
                let samples = per_replica.div_ceil(m);
                let units = trainer.profiles_for(samples, 0);
                let stages = &trainer.pipeline.plan().partition.stages;
                let slices = self.with_micro_batches(&c, m, samples, &units, stages).token_slices;
                trainer.pipeline.fits_micro_batches(m, slices, &units)
            };
            let mut candidates = vec![c.micro_batches];
            candidates.extend(
                micro_batch_candidates(c.pipeline_len, per_replica)
                    .into_iter()
                    .filter(|&m| m != c.micro_batches && fits(m)),
            );
            let key = Tuner::key(c.pipeline_len, c.replicas, 0, false, per_replica, c.schedule);
            let m = self.tuner.start(key, candidates);
            if m != c.micro_batches {
                self.set_micro_batches(trainer, m)?;
            }
            self.warming = self.tuner.running();
            (self.tuning_from, self.tuning_slices) = (c.micro_batches, c.token_slices);
        }
        Ok(())
    }

    /// When the freeze rule runs, and the settling test's bound.
    fn interval(&self) -> (FreezeInterval, Option<f64>) {
        (self.config.freeze_interval, self.config.max_weight_change)
    }

    /// The controller's state for a checkpoint.
    pub fn state(&self) -> serde_json::Value {
        let state = State {
            freeze: self.freeze.clone(),
            frozen_layers: self.frozen_layers,
            tuned: self.tuner.best.clone(),
            cache_on: self.cache_on,
            tuning: self.tuner.timing().map(|t| (t.clone(), self.tuning_from)),
            interval: Some(self.interval()),
            shape_trial: self.shape_trial.clone(),
            config: serde_json::to_value(&self.config).ok(),
            tuning_slices: self.tuning_slices.clone(),
            // (Read only by AutoDP's replica count and `scale-lr`.)
            initial_replicas: self.config.auto_dp.then_some(self.around.initial_replicas),
            asked: self.asked.clone(),
        };
        serde_json::to_value(state).unwrap_or_default()
    }

    /// What a checkpoint keeps besides [`state`](Self::state): the settling test's reference
    /// weights (one tensor per layer), so a resumed run measures the interval under way from
    /// its start, as the run that was not stopped does.
    pub fn state_tensors(&self) -> Vec<Tensor> {
        self.reference
            .iter()
            .flatten()
            .enumerate()
            .map(|(l, w)| Tensor { name: format!("settling/{l}"), data: w.clone() })
            .collect()
    }

    /// Restores [`state_tensors`](Self::state_tensors); without one per layer (a checkpoint
    /// from before the settling test, or from a run without it) the interval under way freezes
    /// nothing more.
    pub fn restore_tensors(&mut self, tensors: Vec<Tensor>) {
        let layers: Vec<Vec<f32>> = (0..self.around.layers)
            .map_while(|l| tensors.iter().find(|t| t.name == format!("settling/{l}")).map(|t| t.data.clone()))
            .collect();
        self.reference = (self.settling_test() && layers.len() == self.around.layers).then_some(layers);
    }

    /// Restores what [`state`](Self::state) saved (the trainer restores the plan and weights).
    /// The cache starts empty: a resumed run rebuilds it. A checkpoint of another freeze rule
    /// or interval is refused; the other `[elastic]` settings that changed since are taken from
    /// here on, and returned as `elastic.batch_policy "constant" → "scale-lr"`.
    pub fn restore(&mut self, value: serde_json::Value) -> Result<Vec<String>> {
        if value.is_null() {
            return Ok(Vec::new());
        }
        let s: State = serde_json::from_value(value).map_err(|e| crate::Error::State {
            what: "checkpoint: elastic controller".into(),
            message: e.to_string(),
        })?;
        let mut changes = self.freeze.rule_changes(&s.freeze);
        // (The interval matters where a rule freezes, now or then.)
        let freezing = self.config.freeze != FreezeName::Off || !changes.is_empty();
        let interval_change = s.interval.filter(|&(i, tau)| freezing && (i, tau) != self.interval()).map(|then| {
            let say = |(i, tau): (FreezeInterval, Option<f64>)| {
                let tau = tau.map_or("none".to_string(), |t| t.to_string());
                format!("freeze_interval {} and max_weight_change {tau}", serde_json::json!(i))
            };
            format!("elastic.{} then, {} now", say(then), say(self.interval()))
        });
        changes.extend(interval_change);
        if !changes.is_empty() {
            return Err(crate::Error::Config {
                field: "elastic".into(),
                message: format!(
                    "the checkpoint was taken under another freeze rule ({}); resume with the settings the run \
                     began with, or start over with --fresh",
                    changes.join("; ")
                ),
            });
        }
        // (Checked before anything changes; a run without AutoPipe drops the timing unread.)
        if let Some((timing, _)) = s.tuning.as_ref().filter(|_| self.config.auto_pipe) {
            timing
                .check()
                .map_err(|message| crate::Error::State { what: "checkpoint: elastic controller".into(), message })?;
        }
        (self.freeze, self.frozen_layers, self.tuner.best) = (s.freeze, s.frozen_layers, s.tuned);
        // Timing goes on from the restored plan's count; its first step, on a pipeline just
        // built, warms up untimed as after a transition.
        let tuning = s.tuning.filter(|_| self.config.auto_pipe);
        self.warming = tuning.is_some();
        if let Some((timing, from)) = tuning {
            self.tuner.resume_timing(timing);
            (self.tuning_from, self.tuning_slices) = (from, s.tuning_slices);
        }
        self.around.initial_replicas = s.initial_replicas.unwrap_or(self.around.initial_replicas);
        // (A checkpoint from before it was recorded: the plan this run asks for.)
        self.asked = s.asked.or(self.asked.take());
        self.shape_trial = s.shape_trial.filter(|_| self.config.auto_pipe && self.config.time_pipeline_len);
        self.cache_on = s.cache_on && self.cache.is_some();
        if let Some(c) = &mut self.cache {
            c.clear();
        }
        // (The rule's own settings were checked above: a change there is refused.)
        let rule = ["freeze", "alpha", "table", "freeze_interval", "max_weight_change"];
        let now = serde_json::to_value(&self.config).unwrap_or_default();
        let changed =
            s.config.map_or_else(Vec::new, |then| crate::train::trainer::changed_settings("elastic", &then, &now));
        // What AutoDP does with freed devices is done at a transition: the checkpoint's plan,
        // with any replicas AutoDP made, goes on until the next one.
        let at_transition = ["auto_dp", "freed_devices"];
        Ok(changed
            .into_iter()
            .filter(|c| !rule.iter().any(|key| c.starts_with(&format!("elastic.{key} "))))
            .map(|c| match at_transition.iter().any(|key| c.starts_with(&format!("elastic.{key} "))) {
                true => {
                    format!("{c} (at the next transition: the checkpoint's plan and its replicas go on until then)")
                }
                false => c,
            })
            .collect())
    }

    /// Source batches a step takes with `replicas` replicas under the batch policy in force
    /// (a resumed run's, which may not be the checkpoint's; one without AutoDP, which alone
    /// adds replicas).
    pub fn batches_per_step(&self, replicas: usize) -> usize {
        match self.config.auto_dp {
            true => batches_per_step(self.config.batch_policy, replicas, self.around.initial_replicas),
            false => 1,
        }
    }

    /// Whether reading a batch from the cache is cheaper than running the frozen prefix on it:
    /// the measured read of one batch on the host and the upload of a replica's share of it to
    /// a device, against the units' measured forward times for a replica's share (the replicas
    /// in force run theirs at once; the host reads for them all).
    fn cache_pays<D: Device>(&self, trainer: &Trainer<D>, units: usize) -> Result<(bool, String)> {
        let Some(cache) = &self.cache else { return Ok((false, String::new())) };
        let a = self.around;
        let share = a.batch.div_ceil(trainer.pipeline.plan().config.replicas.max(1));
        let forward: f64 = trainer.profiles.iter().take(units).map(|p| p.forward).sum::<f64>() * share as f64;
        let read = cache.measure_read(a.batch * a.positions * a.width);
        let upload = upload_seconds(&trainer.pipeline.devices()[0], share * a.positions * a.width)?;
        // (Microseconds where milliseconds would round to 0.00: a small model's read.)
        let time = |t: f64| if t < 1e-4 { format!("{:.1} µs", t * 1e6) } else { format!("{:.2} ms", t * 1e3) };
        let why = format!(
            "cache read {} + upload {} vs frozen forward {} per batch",
            time(read),
            time(upload),
            time(forward)
        );
        Ok((read + upload < forward, why))
    }

    fn transition<D: Device>(
        &mut self,
        trainer: &mut Trainer<D>,
        layers: usize,
        reason: String,
        on_event: &mut dyn FnMut(&Event),
    ) -> Result<()> {
        let started = Instant::now();
        let (before, _) = shape(trainer);
        let logged = self.logged_shape(trainer);
        let layers_before = self.frozen_layers;
        let units = frozen_units(layers);
        trainer.pipeline.freeze_prefix(units)?;
        self.frozen_layers = layers;
        let mut reason = reason;
        // (The `M` before is the one in force, which may be a candidate being timed.)
        if self.tuner.running() {
            reason += &format!(
                "; M={} ran, a micro-batch count AutoPipe was timing (the M shown is the count kept)",
                before.micro_batches
            );
        }
        if self.config.auto_pipe {
            let (pays, why) = self.cache_pays(trainer, units)?;
            self.cache_on = self.cache.is_some() && units > 0 && pays;
            let base = self.asked_of(&before);
            // A freeze while a trial's first length runs prices against the length the trial
            // left (the longest allowed: K only shrinks) and times against it, as if the
            // trial had not begun.
            let incumbent = match &self.shape_trial {
                Some(ShapeTrial::Next(other)) => other.pipeline_len.max(before.pipeline_len),
                _ => before.pipeline_len,
            };
            let cached = if self.cache_on { units } else { 0 };
            let mut candidates = self.shape_candidates(trainer, &base, incumbent, cached);
            // The cache pins the frozen units to the first stage, where its hidden states
            // enter; where no shape holds them all there, they run forward-only, spread over
            // the stages like any unit, rather than end the run.
            let mut unpinned = false;
            if cached > 0 && candidates.is_err() {
                candidates = self.shape_candidates(trainer, &base, incumbent, 0);
                (self.cache_on, unpinned) = (false, candidates.is_ok());
            }
            let candidates = candidates?;
            // (A cache switched off stays off: more frozen units only make it pay more and
            // weigh more on the first stage.)
            if let Some(c) = self.cache.as_mut().filter(|_| !self.cache_on) {
                c.clear();
            }
            if self.cache.is_some() {
                let state = if self.cache_on { "on" } else { "off" };
                let memory = if unpinned { ", as no shape fits the frozen units on the first stage" } else { "" };
                reason = format!("{reason}; {why}: cache {state}{memory}");
            }
            let policy = self.config.batch_policy;
            let lend = self.config.lends_threads(trainer.pipeline.devices());
            let shared = trainer.pipeline.shared_pool().is_some();
            let chosen = pick(&candidates).ok_or_else(|| config_error("devices", "no pipeline shape fits"))?;
            let chosen = agree(trainer.pipeline.process_group(), chosen, &candidates)?.config.clone();
            // The price of a shorter pipeline on cpu devices rests on ideal thread scaling:
            // time it against the length in force (each at its best M) before keeping it. Not
            // across processes (each would time its own), nor where the two shapes' replicas
            // would run different recipes (`scale-lr`: the batch and learning rate follow R).
            let guessed = lend || shared;
            let timed_against = candidates
                .iter()
                .find(|c| c.config.pipeline_len == incumbent)
                .filter(|_| self.config.time_pipeline_len && guessed && trainer.pipeline.process_group().is_none())
                .filter(|c| c.config.pipeline_len != chosen.pipeline_len)
                .filter(|c| policy == BatchPolicy::Constant || c.config.replicas == chosen.replicas)
                .map(|c| c.config.clone());
            reason += &self.adopt_shape(trainer, chosen, &before, timed_against.is_some())?;
            self.shape_trial = timed_against.map(ShapeTrial::Next);
        }
        self.emit(trainer, reason, (layers_before, layers), logged, started, on_event);
        Ok(())
    }

    /// The shapes a transition chooses among ([`choose_shape`]) for the run's frozen prefix,
    /// its first `cached` units read from the cache and so pinned to the first stage: each
    /// `K` up to `incumbent` with the replicas, batch and micro-batches in force for it, and
    /// the run's token slicing.
    fn shape_candidates<D: Device>(
        &self,
        trainer: &Trainer<D>,
        base: &crate::pipeline::PipelineConfig,
        incumbent: usize,
        cached: usize,
    ) -> Result<Vec<Candidate>> {
        let units = frozen_units(self.frozen_layers);
        let a = self.around;
        let (policy, auto_dp) = (self.config.batch_policy, self.config.auto_dp);
        // Freed cpu devices lend their threads: the replicas stay as they began, and the
        // `K·R` devices at work share every device's threads.
        let lend = self.config.lends_threads(trainer.pipeline.devices());
        let global = |r: usize| a.batch * batches_per_step(policy, r, a.initial_replicas);
        let replicas = |k: usize| replicas_for(k, a.devices, a.initial_replicas, auto_dp && !lend, global);
        let pipeline = &trainer.pipeline;
        // Devices that share a pool compute at their share of it, lent threads or not.
        let shared = pipeline.shared_pool().is_some();
        let speed = |k: usize| if lend || shared { pipeline.lent_speed(k * replicas(k)) } else { 1.0 };
        let tuned = &self.tuner.best;
        let micro = |k: usize, per_replica: usize| {
            let key = Tuner::key(k, replicas(k), units, cached > 0, per_replica, schedule_for(k, base.schedule));
            tuned.get(&key).copied().unwrap_or((2 * k).min(per_replica))
        };
        let names = crate::pipeline::runtime::unit_names(trainer.pipeline.units());
        let profiles = |samples: usize| trainer.profiles_for(samples, cached);
        // The slices each shape would run, for its price.
        let slices = |c: &crate::pipeline::PipelineConfig, samples: usize, units: &[UnitProfile], pinned: usize| {
            self.adopted_slices(c, samples, units, pinned)
        };
        let shapes = Shapes {
            global: &global,
            replicas: &replicas,
            speed: &speed,
            micro: &micro,
            profiles: &profiles,
            slices: &slices,
        };
        choose_shape(base, incumbent, a.devices, cached, &shapes, &names)
    }

    /// `shape` with the schedule, chunks and token slices the run asked for: what a candidate
    /// of more than one stage runs, whatever a shape of one stage in force dropped.
    fn asked_of(&self, shape: &crate::pipeline::PipelineConfig) -> crate::pipeline::PipelineConfig {
        match &self.asked {
            Some(a) => crate::pipeline::PipelineConfig {
                schedule: a.schedule,
                chunks: a.chunks,
                token_slices: a.token_slices.clone(),
                ..shape.clone()
            },
            None => shape.clone(),
        }
    }

    /// The shape the last transition logged: the one in force, but for the micro-batch count
    /// (and its token slices) while AutoPipe times counts, where the steps take the candidates
    /// in turn and only the timing's start and end are logged, so the log reads as one chain.
    fn logged_shape<D: Device>(&self, trainer: &Trainer<D>) -> Shape {
        let (mut config, stages) = shape(trainer);
        if self.tuner.running() {
            (config.micro_batches, config.token_slices) = (self.tuning_from, self.tuning_slices.clone());
        }
        (config, stages)
    }

    /// Runs the pipeline in `chosen`'s shape from the next step: freed cpu devices lend their
    /// threads (where configured), the plan is rebuilt on the units' costs at the micro-batch
    /// count tuned before for this shape or the first that fits, the other counts are queued
    /// for timing, and the replicas' communicators are rebuilt when `K` or `R` changed from
    /// `before`. Returns what the transition's log line adds.
    fn adopt_shape<D: Device>(
        &mut self,
        trainer: &mut Trainer<D>,
        chosen: crate::pipeline::PipelineConfig,
        before: &crate::pipeline::PipelineConfig,
        measure: bool,
    ) -> Result<String> {
        let units = frozen_units(self.frozen_layers);
        let cached = if self.cache_on { units } else { 0 };
        let a = self.around;
        let lend = self.config.lends_threads(trainer.pipeline.devices());
        trainer.pipeline.lend_idle_threads(lend)?;
        let (k, r) = (chosen.pipeline_len, chosen.replicas);
        let mut reason = String::new();
        let per_step = batches_per_step(self.config.batch_policy, r, a.initial_replicas);
        let per_replica = (a.batch * per_step).div_ceil(r);
        let key = Tuner::key(k, r, units, cached > 0, per_replica, chosen.schedule);
        // Each count's config, sliced, and its units' costs.
        let with = |m: usize| {
            let config = crate::pipeline::PipelineConfig { micro_batches: m, ..chosen.clone() };
            let samples = per_replica.div_ceil(m);
            let units = trainer.profiles_for(samples, cached);
            let token_slices = self.adopted_slices(&config, samples, &units, cached);
            (crate::pipeline::PipelineConfig { token_slices, ..config }, units)
        };
        let names = crate::pipeline::runtime::unit_names(trainer.pipeline.units());
        // The count tuned before for this shape, or the first candidate that fits memory
        // (the shape fits at the count it was priced with, one of them), is planned; the
        // others are timed on its stages, so only those that fit there. A shape on trial
        // (`measure`) is timed even when its count is known.
        // (Each count's slicing and costs made once here: `auto`'s slicing is a search.)
        let candidates: Vec<_> = micro_batch_candidates(k, per_replica).into_iter().map(with).collect();
        let m = match self.tuner.best.get(&key).filter(|_| !measure) {
            Some(&m) => m,
            None => candidates
                .iter()
                .find(|(c, units)| Plan::new(c.clone(), units, names.clone(), a.devices, cached).is_ok())
                .map_or(chosen.micro_batches, |(c, _)| c.micro_batches),
        };
        let (planned, units) =
            candidates.iter().find(|(c, _)| c.micro_batches == m).cloned().unwrap_or_else(|| with(m));
        let slices = planned.token_slices.clone();
        trainer.pipeline.replan(planned, &units, cached)?;
        let fits = |(c, units): &(crate::pipeline::PipelineConfig, Vec<UnitProfile>)| {
            trainer.pipeline.fits_micro_batches(c.micro_batches, c.token_slices.clone(), units)
        };
        let others = candidates.iter().filter(|c| c.0.micro_batches != m && fits(c)).map(|c| c.0.micro_batches);
        let timed = std::iter::once(m).chain(others).collect();
        if measure {
            self.tuner.time(key, timed);
        } else {
            self.tuner.start(key, timed);
        }
        // A new shape drops the replicas' communicators (they group devices by position):
        // build them again whenever K or R changed, so NCCL stays NCCL.
        if (k, r) != (before.pipeline_len, before.replicas) {
            let comm = rebuild_communicators(&mut trainer.pipeline)?;
            reason += &format!("; replicas sum gradients over: {comm}");
        }
        let used = k * r;
        if lend && used < before.pipeline_len * before.replicas {
            let at_work = &trainer.pipeline.devices()[..used];
            let threads: Vec<String> = at_work.iter().filter_map(|d| d.threads()).map(|n| n.to_string()).collect();
            reason = format!("{reason}; freed cpu devices lend their threads: {} per device", threads.join(", "));
        }
        trainer.batches_per_step = per_step;
        self.warming = self.tuner.running();
        (self.tuning_from, self.tuning_slices) = (m, slices);
        Ok(reason)
    }

    /// At the end of timing a shape's micro-batch counts (`rate`: the winner's positions per
    /// second), goes on with AutoPipe's trial of pipeline lengths, if one is under way: times
    /// the other length next, or, both timed, keeps the faster. Returns the transition's
    /// reason when the shape changes or the trial ends.
    fn go_on_with_shape_trial<D: Device>(&mut self, trainer: &mut Trainer<D>, rate: f64) -> Result<Option<String>> {
        let Some(trial) = self.shape_trial.take() else { return Ok(None) };
        let now = trainer.pipeline.plan().config.clone();
        match trial {
            ShapeTrial::Next(other) => {
                let mut reason = format!(
                    "AutoPipe times K={} against K={} ({rate:.0} positions/s at M={})",
                    other.pipeline_len, now.pipeline_len, now.micro_batches
                );
                reason += &self.adopt_shape(trainer, other, &now, true)?;
                self.shape_trial = Some(ShapeTrial::Timed(now, rate));
                Ok(Some(reason))
            }
            ShapeTrial::Timed(first, first_rate) => {
                let first_wins = first_rate > rate;
                let (kept, over) = if first_wins { (&first, &now) } else { (&now, &first) };
                let mut reason = format!(
                    "pipeline lengths timed (positions/s): K={}: {first_rate:.0}, K={}: {rate:.0}; K={} kept over K={}",
                    first.pipeline_len, now.pipeline_len, kept.pipeline_len, over.pipeline_len
                );
                if first_wins {
                    reason += &self.adopt_shape(trainer, first, &now, false)?;
                }
                Ok(Some(reason))
            }
        }
    }

    /// Runs `m` micro-batches per replica on the stages in force, planned on the batch the
    /// candidates were checked against memory with, not a step's (an epoch's last batch may
    /// hold a remainder more).
    fn set_micro_batches<D: Device>(&self, trainer: &mut Trainer<D>, m: usize) -> Result<()> {
        let cached = if self.cache_on { frozen_units(self.frozen_layers) } else { 0 };
        let samples = micro_samples(trainer, self.around.batch, m);
        let profiles = trainer.profiles_for(samples, cached);
        let plan = trainer.pipeline.plan();
        let slices = self.with_micro_batches(&plan.config, m, samples, &profiles, &plan.partition.stages).token_slices;
        trainer.pipeline.set_micro_batches(m, slices, &profiles)
    }

    /// At the run's end, ends AutoPipe's timing of micro-batch counts and its trial of
    /// pipeline lengths where either is under way, so the run ends (and its summary and
    /// checkpoint record) a shape that was chosen, not one on trial: the length the trial
    /// timed first (the one AutoPipe chose) and, on it, the fastest count timed so far.
    fn settle_at_end<D: Device>(&mut self, trainer: &mut Trainer<D>, on_event: &mut dyn FnMut(&Event)) -> Result<()> {
        let (started, (before, _), logged) = (Instant::now(), shape(trainer), self.logged_shape(trainer));
        let timing = self.tuner.cut_short();
        let reason = match (self.shape_trial.take(), timing) {
            (None, None) => return Ok(()),
            (Some(ShapeTrial::Timed(first, rate)), _) => {
                let mut reason = format!(
                    "the run ended during AutoPipe's trial of pipeline lengths: K={} ({rate:.0} positions/s) kept, \
                     K={} not timed to the end",
                    first.pipeline_len, before.pipeline_len
                );
                reason += &self.adopt_shape(trainer, first, &before, false)?;
                // (Its count is known from its timing: nothing is left to time.)
                self.tuner.cut_short();
                reason
            }
            (trial, timing) => {
                let mut reason = String::from("the run ended during AutoPipe's timing");
                if let Some((m, timed)) = timing {
                    let rates: Vec<String> = timed.iter().map(|(m, r)| format!("M={m}: {r:.0}")).collect();
                    let rates = if rates.is_empty() { "none timed".into() } else { rates.join(", ") };
                    reason += &format!(" of micro-batch counts (positions/s: {rates}): M={m} kept");
                    if m != before.micro_batches {
                        self.set_micro_batches(trainer, m)?;
                    }
                }
                if let Some(ShapeTrial::Next(other)) = trial {
                    reason += &format!(
                        "; K={} kept, K={} (in force before the trial) not timed",
                        before.pipeline_len, other.pipeline_len
                    );
                }
                reason
            }
        };
        self.warming = false;
        let layers = (self.frozen_layers, self.frozen_layers);
        self.emit(trainer, reason, layers, logged, started, on_event);
        Ok(())
    }

    fn emit<D: Device>(
        &self,
        trainer: &mut Trainer<D>,
        reason: String,
        frozen_layers: (usize, usize),
        (before, stages_before): Shape,
        started: Instant,
        on_event: &mut dyn FnMut(&Event),
    ) {
        let plan = trainer.pipeline.plan();
        let after = plan.config.clone();
        let mut reason = reason;
        let why = if after.pipeline_len == 1 { " (one stage)" } else { "" };
        if (before.schedule, before.chunks) != (after.schedule, after.chunks) {
            let name = |c: &crate::pipeline::PipelineConfig| match c.chunks {
                1 => c.schedule.to_string(),
                v => format!("{} ({v} chunks)", c.schedule),
            };
            reason += &format!("; schedule {} → {}{why}", name(&before), name(&after));
        }
        if before.token_slices != after.token_slices {
            let list = |s: &[usize]| match s.is_empty() {
                true => "none".to_string(),
                false => s.iter().map(usize::to_string).collect::<Vec<_>>().join(","),
            };
            // (One stage runs whole, but for `auto`'s equal slices where whole ones exceed the
            // limit; a caller's own slicer may slice one stage as it likes.)
            let limited = after.memory_limit.is_some() && self.slicer.is_some();
            let why = match (after.pipeline_len, after.token_slices.is_empty()) {
                (1, false) if limited => " (one stage within the memory limit: the fewest equal slices that fit)",
                (1, false) => "",
                _ => why,
            };
            reason += &format!("; token slices {} → {}{why}", list(&before.token_slices), list(&after.token_slices));
        }
        let frozen = trainer.pipeline.frozen_prefix();
        let recomputed: Vec<String> = (0..plan.stages())
            .filter_map(|s| plan.partition.recomputed_text(s, frozen).map(|t| format!("stage {s} {t}")))
            .collect();
        if !recomputed.is_empty() {
            reason += &format!("; activations recomputed by {}", recomputed.join(", "));
        }
        let t = Transition {
            step: trainer.position.step,
            epoch: trainer.position.epoch,
            reason,
            frozen_layers,
            frozen_units: trainer.pipeline.frozen_prefix(),
            pipeline_len: (before.pipeline_len, after.pipeline_len),
            replicas: (before.replicas, after.replicas),
            micro_batches: (before.micro_batches, after.micro_batches),
            stages_before,
            stages: plan.partition.stages.clone(),
            batches_per_step: trainer.batches_per_step,
            cache: self.cache_on,
            seconds: started.elapsed().as_secs_f64(),
        };
        if let Some(trace) = &mut trainer.trace {
            let name = format!(
                "transition: {} frozen layers, K={} R={} M={}",
                t.frozen_layers.1, after.pipeline_len, after.replicas, after.micro_batches
            );
            trace.push_between(&name, t.seconds, serde_json::json!({ "reason": t.reason, "stages": t.stages }));
        }
        on_event(&Event::Transition(t));
    }

    /// Applies the freeze rule at an interval's end, the run's last step included: a run
    /// resumed under more epochs or steps then freezes where one run of that length would
    /// have (skipped there, the interval's count, norm sums and freeze were lost, and the
    /// resumed run froze an interval late).
    fn end_interval<D: Device>(&mut self, trainer: &mut Trainer<D>, on_event: &mut dyn FnMut(&Event)) -> Result<()> {
        if self.config.freeze == FreezeName::Off {
            return Ok(());
        }
        let norms = self.freeze.norms();
        // The settling test: each layer's relative weight change over the interval.
        let now = self.layer_weights(trainer)?;
        let changes = match (&self.reference, &now) {
            (Some(before), Some(now)) => Some(relative_changes(before, now)),
            _ => None,
        };
        self.reference = now;
        let cap = self.config.max_weight_change.map(|tau| match &changes {
            Some(c) => super::freeze::settled(self.frozen_layers, c, tau),
            None => self.frozen_layers,
        });
        let next = self.freeze.end_interval(cap);
        let shown = |v: &[f64]| v.iter().map(|n| format!("{n:.3}")).collect::<Vec<_>>().join(", ");
        if crate::debug::level() >= 1 {
            eprintln!(
                "freeze interval {}: gradient norms [{}], weight changes [{}], {} → {} frozen",
                self.freeze.intervals,
                shown(&norms),
                changes.as_deref().map_or_else(|| "not measured".into(), shown),
                self.frozen_layers,
                next
            );
        }
        if next > self.frozen_layers {
            let settled = match (&changes, self.config.max_weight_change) {
                (Some(c), Some(tau)) => format!("; weight change per layer [{}], at most {tau} to freeze", shown(c)),
                _ => String::new(),
            };
            let reason = format!(
                "{:?} rule after interval {}: layer gradient norms [{}]{settled}",
                self.config.freeze,
                self.freeze.intervals,
                shown(&norms)
            );
            self.transition(trainer, next, reason, on_event)?;
        }
        Ok(())
    }

    /// Whether the freeze rule runs under a settling test (`elastic.max_weight_change`).
    fn settling_test(&self) -> bool {
        self.config.max_weight_change.is_some() && self.config.freeze != FreezeName::Off
    }

    /// Each Transformer layer's weights (its attention and MLP units), when a settling test
    /// runs.
    fn layer_weights<D: Device>(&self, trainer: &Trainer<D>) -> Result<Option<Vec<Vec<f32>>>> {
        if !self.settling_test() {
            return Ok(None);
        }
        let units = trainer.pipeline.unit_values(1..1 + 2 * self.around.layers)?;
        Ok(Some(units.chunks(2).map(|pair| pair.concat()).collect()))
    }

    /// Hidden-state positions of a batch.
    fn positions<D: Device>(trainer: &Trainer<D>, host: &HostBatch) -> usize {
        match trainer.pipeline.spec().input {
            crate::model::InputSpec::Image { image_size, patch, .. } => (image_size / patch).pow(2) + 1,
            crate::model::InputSpec::Tokens { .. } => host.seq,
        }
    }
}

/// Seconds to upload `values` hidden-state values to `device` as the cache's entries reach a
/// first stage (the median of 3, after one untimed).
fn upload_seconds<D: Device>(device: &D, values: usize) -> Result<f64> {
    let data = vec![0.5f32; values];
    let mut times = Vec::with_capacity(3);
    for timed in [false, true, true, true] {
        let start = Instant::now();
        let buf = device.upload_activations(&data)?;
        device.synchronize()?;
        drop(buf);
        if timed {
            times.push(start.elapsed().as_secs_f64());
        }
    }
    times.sort_by(f64::total_cmp);
    Ok(times[1])
}

impl<D: Device> Controller<D> for Elastic {
    fn before_step(&mut self, trainer: &Trainer<D>, host: &mut HostBatch) -> Result<Prepared> {
        let units = frozen_units(self.frozen_layers);
        let Some(cache) = self.cache.as_mut().filter(|_| self.cache_on && units > 0) else {
            return Ok(Prepared::default());
        };
        let positions = Self::positions(trainer, host);
        let Some(cached) = cache.get(host, positions, units)? else {
            cache.record(0, host.batch);
            return Ok(Prepared { capture_frozen_output: false, cache_hits: Some(0) });
        };
        // In the run's last epoch no sample comes back: nothing new is stored.
        let left = trainer.lr_schedule.total_steps - trainer.batches_done();
        let fill = left > (trainer.batches_per_epoch() - trainer.position.batch) as u64;
        // Mostly new samples: the pipeline runs the frozen units on every replica's first
        // stage, overlapped with the rest, and returns their output for the cache (the few
        // held samples run too: no hits).
        if 2 * cached.held() < host.batch {
            cache.record(0, host.batch);
            return Ok(Prepared { capture_frozen_output: fill, cache_hits: Some(0) });
        }
        let hits = cached.held();
        cache.record(hits, host.batch - hits);
        // Mostly held: the samples the cache lacks, or holds at a depth a boundary that moved
        // mid-epoch left behind, catch up (forward only, spread over the replicas) and are
        // written back; the pipeline starts at the first trainable unit.
        let width = self.around.width;
        let per = positions * width;
        let mut data = cached.data;
        let mut behind: Vec<Option<usize>> = cached.depths.iter().copied().filter(|d| *d != Some(units)).collect();
        behind.sort_unstable();
        behind.dedup();
        for depth in behind {
            let idx: Vec<usize> = (0..host.batch).filter(|&i| cached.depths[i] == depth).collect();
            let mut sub = host.select(&idx)?;
            sub.hidden = depth.map(|depth| Hidden {
                depth,
                width,
                data: idx.iter().flat_map(|&i| data[i * per..(i + 1) * per].iter().copied()).collect(),
            });
            let advanced = trainer.pipeline.advance(&sub, units)?;
            for (k, &i) in idx.iter().enumerate() {
                data[i * per..(i + 1) * per].copy_from_slice(&advanced.data[k * per..(k + 1) * per]);
            }
            if fill {
                cache.put(&sub, &advanced)?;
            }
        }
        host.hidden = Some(Hidden { depth: units, width, data });
        Ok(Prepared { capture_frozen_output: false, cache_hits: Some(hits) })
    }

    fn after_step(
        &mut self,
        trainer: &mut Trainer<D>,
        host: &HostBatch,
        step: &PipelineStep,
        on_event: &mut dyn FnMut(&Event),
    ) -> Result<()> {
        if let (Some(cache), Some(h)) = (&mut self.cache, &step.frozen_output) {
            cache.put(host, h)?;
        }
        // A step the optimizer skipped (a gradient norm not finite) trained nothing and its
        // norms are no signal: an inf would reach the checkpoint as `null`, a NaN win Eq. 1.
        if self.config.freeze != FreezeName::Off && step.applied {
            self.freeze.observe(&layer_grad_sq(&step.unit_grad_sq, self.around.layers));
        }
        // (An epoch's short last batch may run fewer micro-batches than the count on trial:
        // another schedule's rate, not timed.)
        let whole = trainer.pipeline.runs_all_micro_batches(host.batch);
        if self.warming {
            self.warming = false;
        } else if self.tuner.running() && step.trace.makespan > 0.0 && whole {
            let config = trainer.pipeline.plan().config.clone();
            // (What the timing's end logs as before: the count it began from; another count
            // keeps the stages.)
            let logged = self.logged_shape(trainer);
            if let Some((next, timed)) =
                self.tuner.record(config.micro_batches, (host.batch * host.seq.max(1)) as f64 / step.trace.makespan)
            {
                let started = Instant::now();
                if next != config.micro_batches {
                    self.set_micro_batches(trainer, next)?;
                }
                if let Some(timed) = timed {
                    let rates: Vec<String> = timed.iter().map(|(m, r)| format!("M={m}: {r:.0}")).collect();
                    let reason = format!("micro-batches timed (positions/s): {}", rates.join(", "));
                    let layers = (self.frozen_layers, self.frozen_layers);
                    self.emit(trainer, reason, layers, logged, started, on_event);
                    let best = timed.iter().map(|&(_, r)| r).fold(0.0, f64::max);
                    let (started, before) = (Instant::now(), shape(trainer));
                    if let Some(reason) = self.go_on_with_shape_trial(trainer, best)? {
                        self.emit(trainer, reason, layers, before, started, on_event);
                    }
                }
            }
        }
        if let FreezeInterval::Steps(n) = self.config.freeze_interval
            && trainer.position.step.is_multiple_of(n)
        {
            self.end_interval(trainer, on_event)?;
        }
        Ok(())
    }

    fn after_epoch(
        &mut self,
        trainer: &mut Trainer<D>,
        epoch: u64,
        whole: bool,
        on_event: &mut dyn FnMut(&Event),
    ) -> Result<()> {
        if let Some(cache) = &mut self.cache {
            let stats = cache.take_stats();
            on_event(&Event::Cache {
                epoch,
                hits: stats.hits,
                misses: stats.misses,
                entries: cache.entries(),
                memory_bytes: cache.memory_bytes(),
                disk_bytes: cache.disk_bytes(),
            });
        }
        // An interval of an epoch ends with the epoch, not where `max_steps` stops the run
        // inside one: a run resumed from there goes on with the same interval, as a run that
        // had not stopped.
        if whole && self.config.freeze_interval == FreezeInterval::Epoch {
            self.end_interval(trainer, on_event)?;
        }
        Ok(())
    }

    /// The run's end comes after its last step's freeze (an epoch's interval ends after the
    /// epoch's evaluation) and after an evaluation that stops it early: a shape that either
    /// left on trial is settled here.
    fn after_run(&mut self, trainer: &mut Trainer<D>, on_event: &mut dyn FnMut(&Event)) -> Result<()> {
        self.settle_at_end(trainer, on_event)
    }
}
