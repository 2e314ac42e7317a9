//! TeraPipe's latency model measured on a device (pipelines.md A.4): one Transformer layer (the
//! model's first attention unit and the MLP unit after it) runs a slice of `l` tokens after `c`
//! tokens of context, forward and backward, through the same key/value arena the pipeline
//! uses; a stage's time is that times its layers. The no-context table covers every length on
//! the token grid; the context term is fitted to a handful of `(l, c)` points; the transfer of
//! a slice's activation and gradient across a stage boundary is timed as a download and an
//! upload of each.

use super::latency::{CommModel, LatencyGrid, LatencyModel, Sample};
use super::memory::{MemoryModel, SliceSchedule};
use super::planner::{MicroBatchSlicing, PlannerConfig, SlicingPlan, peak_memory_bytes, plan};
use super::stage::{StageLoad, UnitRole, trained_layer_time};
use crate::device::Device;
use crate::error::{Error, Result, config_error};
use crate::model::{Batch, HostBatch, KvArena, Model, Saved, Unit};
use crate::pipeline::partition::param_bytes;
use crate::pipeline::{PipelineConfig, ScheduleKind, UnitProfile};
use crate::rng::Rng;
use std::ops::Range;
use std::time::Instant;

/// Timed rounds over every point (after a warm-up round). Each point keeps its least time:
/// what else runs on the machine only ever adds time. The rounds go over all the points in
/// turn rather than repeating one point at a time, so that a slow stretch of the machine,
/// which lasts longer than a point's few runs, costs each point one round at most (five runs
/// of one point in a row, or a median of three, left tables that dipped and rose by 50 % over
/// neighbouring lengths, and the planner's choice changed from run to run).
const ROUNDS: usize = 5;

/// The token grid for sequences of `seq` tokens: the smallest step dividing `seq` that leaves
/// at most 32 grid units (the planner's work grows as the fourth power of the units).
pub fn grid_step(seq: usize) -> usize {
    (1..=seq).find(|d| seq.is_multiple_of(*d) && seq / d <= 32).unwrap_or(seq.max(1))
}

/// Why a `seq`-token sequence on a grid of `step` has too few grid points to measure `what`:
/// the sequence is short, or its divisors leave only a coarse grid (a prime above 32 is one
/// grid unit of its own length).
fn coarse_grid(seq: usize, step: usize, what: &str) -> crate::error::Error {
    let why = match step {
        1 => format!("a {seq}-token sequence is too short to measure {what}"),
        _ => format!(
            "the planner's token grid needs a step dividing the {seq}-token sequence into at most 32 parts, and the \
             smallest, {step}, leaves {} (too few to measure {what}); a length with small factors (such as {}) plans",
            seq / step,
            seq.next_multiple_of(8)
        ),
    };
    config_error("pipeline.token_slices", format!("{why}{GIVE_THE_SLICES}"))
}

/// What a slicing `auto` cannot plan is told to do instead.
pub const GIVE_THE_SLICES: &str = "; or give the slices (a count or lengths)";

/// One Transformer layer of a model (its first attention unit and the MLP unit after it) set
/// up to run a slice of `len` tokens after `context` tokens of a micro-batch, through a
/// key/value arena as the pipeline's workers use it.
struct LayerProbe<D: Device> {
    attention: usize,
    prefix: Option<Batch<D>>,
    slice: Batch<D>,
    context: usize,
    whole: usize,
    input: Vec<f32>,
}

impl<D: Device> LayerProbe<D> {
    fn new(dev: &D, model: &Model<D>, micro: &HostBatch, len: usize, context: usize) -> Result<Self> {
        let attention = probed_attention(model)?;
        let whole = micro.seq;
        let window = micro.token_slices(&if context + len < whole {
            vec![context + len, whole - context - len]
        } else {
            vec![whole]
        })?;
        let parts = window[0].token_slices(&if context > 0 { vec![context, len] } else { vec![len] })?;
        let upload = |h: &HostBatch| Batch::upload(dev, model.spec(), h, true, 1);
        let (prefix, slice) = match parts.as_slice() {
            [p, s] => (Some(upload(p)?), upload(s)?),
            [s] => (None, upload(s)?),
            _ => return Err(config_error("pipeline.token_slices", "profiling cut a window into more than two parts")),
        };
        let mut rng = Rng::new(7);
        let input = (0..micro.batch * len * model.spec().hidden).map(|_| rng.uniform() as f32 - 0.5).collect();
        Ok(Self { attention, prefix, slice, context, whole, input })
    }

    /// A fresh arena holding the context's keys and values, its gradient allocated (a run
    /// zeroes it once per micro-batch, not once per slice); none for the whole sequence,
    /// which a run takes without one.
    fn arena(&self, dev: &D, model: &Model<D>) -> Result<Option<KvArena<D>>> {
        if self.prefix.is_none() && self.slice.seq == self.whole {
            return Ok(None);
        }
        let (b, width) = (self.slice.batch, model.spec().hidden);
        let mut arena = KvArena::new(dev, b, self.whole, width)?;
        if let Some(prefix) = &self.prefix {
            let h = dev.upload_activations(&vec![0.1; b * self.context * width])?;
            model.units()[self.attention].forward(dev, prefix, Some(h), false, Some(&mut arena))?;
        }
        arena.zero_grad(dev)?;
        Ok(Some(arena))
    }

    /// The slice's forward through the layer from its input `x`: its output and what each
    /// unit saved.
    fn forward(
        &self,
        dev: &D,
        model: &Model<D>,
        x: D::Buf,
        arena: Option<&mut KvArena<D>>,
    ) -> Result<(D::Buf, Saved<D>, Saved<D>)> {
        let units = model.units();
        let (y, attention) = units[self.attention].forward(dev, &self.slice, Some(x), true, arena)?;
        let (out, mlp) = units[self.attention + 1].forward(dev, &self.slice, Some(y), true, None)?;
        Ok((out, attention, mlp))
    }

    /// Seconds of one run of the slice's forward and backward, its input and output gradient
    /// already on the device (the pipeline's transfers are timed apart, [`transfer_seconds`]).
    fn seconds(&self, dev: &D, model: &mut Model<D>) -> Result<f64> {
        let mut arena = self.arena(dev, model)?;
        let x = dev.upload_activations(&self.input)?;
        let dy = dev.upload_activations(&self.input)?;
        dev.synchronize()?;
        let start = Instant::now();
        let (_, attention, mlp) = self.forward(dev, model, x, arena.as_mut())?;
        let units = model.units_mut();
        let dmid = units[self.attention + 1].backward(dev, &self.slice, mlp, dy, true, None)?;
        let dmid = dmid.ok_or_else(|| config_error("pipeline.token_slices", "the MLP returned no input gradient"))?;
        units[self.attention].backward(dev, &self.slice, attention, dmid, true, arena.as_mut())?;
        dev.synchronize()?;
        Ok(start.elapsed().as_secs_f64())
    }

    /// Activation elements the slice's forward keeps for its backward: the attention unit's
    /// and the MLP's.
    fn saved_elements(&self, dev: &D, model: &Model<D>) -> Result<(usize, usize)> {
        let mut arena = self.arena(dev, model)?;
        let x = dev.upload_activations(&self.input)?;
        let (_, attention, mlp) = self.forward(dev, model, x, arena.as_mut())?;
        Ok((attention.elements(), mlp.elements()))
    }
}

/// Seconds of one slice (forward and backward) through one layer of `model` for `micro`'s
/// sequences, at each `(length, context)` of `points`: the least of [`ROUNDS`] rounds over
/// all of them, after a warm-up round.
fn layer_seconds<D: Device>(
    dev: &D,
    model: &mut Model<D>,
    micro: &HostBatch,
    points: &[(usize, usize)],
) -> Result<Vec<f64>> {
    let probes = points
        .iter()
        .map(|&(len, context)| LayerProbe::new(dev, model, micro, len, context))
        .collect::<Result<Vec<_>>>()?;
    let mut least = vec![f64::INFINITY; probes.len()];
    for round in 0..=ROUNDS {
        for (probe, least) in probes.iter().zip(&mut least) {
            let seconds = probe.seconds(dev, model)?;
            if round > 0 {
                *least = least.min(seconds);
            }
        }
    }
    Ok(least)
}

/// Seconds to move `tokens` positions of activations across a stage boundary and their gradient
/// back (a download and an upload each, as the runtime's mailboxes do).
fn transfer_seconds<D: Device>(dev: &D, tokens: usize, width: usize) -> Result<f64> {
    let buf = dev.upload_activations(&vec![0.5; tokens * width])?;
    let mut times = Vec::with_capacity(ROUNDS);
    for _ in 0..ROUNDS {
        let start = Instant::now();
        let host = dev.download(&buf)?;
        let back = dev.upload_activations(&host)?;
        dev.synchronize()?;
        times.push(2.0 * start.elapsed().as_secs_f64());
        drop(back);
    }
    Ok(times.into_iter().fold(f64::INFINITY, f64::min))
}

/// What TeraPipe's planner needs of a model on a device, measured once on one Transformer
/// layer for micro-batches of `samples` sequences: the latency and memory models of any stage
/// of any pipeline shape follow from it ([`latency`](Self::latency), [`memory`](Self::memory)),
/// so an elastic transition that changes `K`, `M` or the frozen layers plans its slicing afresh
/// without measuring again ([`plan`](Self::plan)). A stage is a [`StageLoad`]: one of the
/// pipeline's, from the units' costs ([`stages`](Self::stages)), or `⌈L/K⌉` trained layers
/// ([`uniform_stage`](Self::uniform_stage)); its time and activations scale with the
/// micro-batch's sequences.
#[derive(Clone, Debug)]
pub struct SlicingProfile {
    grid: LatencyGrid,
    /// One layer's slice times at the measured micro-batch.
    layer: Vec<Sample>,
    /// A slice's transfer across a stage boundary, at the measured micro-batch.
    comm: CommModel,
    /// Sequences in the measured micro-batch.
    samples: usize,
    /// Transformer layers of the model.
    layers: usize,
    /// Each unit's role.
    roles: Vec<UnitRole>,
    memory: LayerMemory,
}

/// The memory a stage holds, per layer and at its ends, for the measured micro-batch
/// ([`measure_memory`] assembles it for a pipeline).
#[derive(Clone, Copy, Debug)]
struct LayerMemory {
    /// One layer's activation bytes per token, its attention's and its MLP's, and per
    /// attention score.
    attention_per_token: f64,
    mlp_per_token: f64,
    per_score: f64,
    /// One layer's parameter bytes (weights, gradients, optimizer state, packs).
    layer_params: usize,
    /// The units before the first layer and after the last: parameter bytes and activation
    /// bytes per token.
    head: (usize, f64),
    tail: (usize, f64),
    /// One layer's keys and values for one micro-batch, and their gradients' sums.
    kv: f64,
    kv_grad: f64,
}

impl SlicingProfile {
    /// Measures one layer of `model` on `dev` for micro-batches like `micro`: its slice times
    /// over the token grid, a transfer's time, and its memory.
    pub fn measure<D: Device>(dev: &D, model: &mut Model<D>, micro: &HostBatch) -> Result<SlicingProfile> {
        let (grid, layer) = layer_samples(dev, model, micro)?;
        let comm = measure_comm(dev, model, micro, grid)?;
        let memory = LayerMemory::measure(dev, model, micro)?;
        let roles = model.units().iter().map(role).collect();
        Ok(SlicingProfile { grid, layer, comm, samples: micro.batch, layers: model.spec().layers, roles, memory })
    }

    /// The pipeline's stages `stages` (unit ranges) over the model's units costing `units`
    /// for a micro-batch of `samples` sequences ([`StageLoad::of`]; times relative to one
    /// trained layer's at those costs, [`trained_layer_time`]).
    pub fn stages(&self, units: &[UnitProfile], stages: &[Range<usize>], samples: usize) -> Result<Vec<StageLoad>> {
        if units.len() != self.roles.len() || !crate::pipeline::partition::covers(stages, units.len()) {
            return Err(config_error(
                "pipeline.token_slices",
                format!(
                    "stages {stages:?} over {} unit costs do not cover the model's {} units",
                    units.len(),
                    self.roles.len()
                ),
            ));
        }
        let layer = trained_layer_time(units, &self.roles);
        if layer <= 0.0 {
            return Err(config_error(
                "pipeline.token_slices",
                "no layer of the model has a timed forward and backward among the unit costs to measure stages by",
            ));
        }
        Ok(stages
            .iter()
            .map(|r| StageLoad::of(units, r.clone(), &self.roles, layer, self.grid.max_len, samples))
            .collect())
    }

    /// The stage of a `stages`-long pipeline as TeraPipe models one: the layers of the largest
    /// stage, `⌈L/K⌉` (12 layers on 8 stages: 2, not 1.5), all trained, and the larger end's
    /// memory (both ends' on one stage), not its time.
    pub fn uniform_stage(&self, stages: usize) -> StageLoad {
        self.memory.uniform(self.layers, stages, self.samples)
    }

    /// The latency model of `stage` in a `stages`-long pipeline for micro-batches of
    /// `samples` sequences (the planner's batch unit is the whole micro-batch).
    pub fn latency(&self, stage: &StageLoad, stages: usize, samples: usize) -> Result<LatencyModel> {
        let share = samples as f64 / self.samples.max(1) as f64;
        let comm = CommModel { seconds_per_token: self.comm.seconds_per_token * share, ..self.comm };
        stage_latency(self.grid, &self.layer, comm, stage, share, stages)
    }

    /// The memory model of `stage` under `pipeline`'s schedule and micro-batches of `samples`
    /// sequences ([`measure_memory`]), as the first stage, which holds the most micro-batches.
    pub fn memory(&self, stage: &StageLoad, pipeline: &PipelineConfig, samples: usize) -> MemoryModel {
        self.stage_memory(stage, 0, pipeline, samples)
    }

    /// [`memory`](Self::memory) of `stage` as stage `index` of the pipeline, which under 1F1B
    /// holds `min(M, K − index)` micro-batches.
    fn stage_memory(&self, stage: &StageLoad, index: usize, pipeline: &PipelineConfig, samples: usize) -> MemoryModel {
        self.memory.stage(stage, index, pipeline, samples, samples as f64 / self.samples.max(1) as f64)
    }

    /// [`plan`](Self::plan) for the stages `stages` (unit ranges) over units costing `units`
    /// ([`stages`](Self::stages)), and the slowest of them.
    pub fn plan_stages(
        &self,
        pipeline: &PipelineConfig,
        samples: usize,
        units: &[UnitProfile],
        stages: &[Range<usize>],
    ) -> Result<(SlicingPlan, StageLoad)> {
        let loads = self.stages(units, stages, samples)?;
        let plan = self.plan(pipeline, samples, &loads)?;
        let slowest = StageLoad::slowest(&loads).cloned().unwrap_or(StageLoad::of_layers(0));
        Ok((plan, slowest))
    }

    /// The memory models of a pipeline of stages `stages` (in order), one each: the planner
    /// holds the limit on every one. The stages differ in kind (the first keeps the embeddings'
    /// weights, the last the head's logits per token: the most of each kind together would be
    /// no stage's), and under 1F1B in the micro-batches they hold.
    pub fn pipeline_memory(&self, stages: &[StageLoad], pipeline: &PipelineConfig, samples: usize) -> Vec<MemoryModel> {
        stages.iter().enumerate().map(|(i, s)| self.stage_memory(s, i, pipeline, samples)).collect()
    }

    /// TeraPipe's slicing for `pipeline`'s micro-batches of `samples` sequences each, over
    /// stages `stages` ([`shared_slicing`]): the [`latency`](Self::latency) of the slowest and
    /// the [`pipeline_memory`](Self::pipeline_memory).
    pub fn plan(&self, pipeline: &PipelineConfig, samples: usize, stages: &[StageLoad]) -> Result<SlicingPlan> {
        let slowest = StageLoad::slowest(stages)
            .ok_or_else(|| config_error("pipeline.token_slices", "a pipeline of no stages"))?;
        let latency = self.latency(slowest, pipeline.pipeline_len, samples)?;
        let memory = self.pipeline_memory(stages, pipeline, samples);
        shared_slicing(&latency, &memory, self.grid.max_len, samples, pipeline)
    }

    /// A given slicing (`lengths`, each micro-batch's; empty: whole sequences) of `pipeline`'s
    /// micro-batches of `samples` sequences over stages `stages`, priced as
    /// [`plan`](Self::plan) prices its own: the slowest stage's latency, every stage's
    /// memory. Slices off the latency grid are priced between its points.
    pub fn price(
        &self,
        pipeline: &PipelineConfig,
        samples: usize,
        stages: &[StageLoad],
        lengths: &[usize],
    ) -> Result<SlicingPlan> {
        let seq = self.grid.max_len;
        let slices = if lengths.is_empty() { vec![seq] } else { lengths.to_vec() };
        if slices.iter().sum::<usize>() != seq {
            return Err(config_error(
                "pipeline.token_slices",
                format!("slices {slices:?} do not cover the {seq} tokens measured"),
            ));
        }
        let slowest = StageLoad::slowest(stages)
            .ok_or_else(|| config_error("pipeline.token_slices", "a pipeline of no stages"))?;
        let latency = self.latency(slowest, pipeline.pipeline_len, samples)?;
        let config = shared_config(&self.pipeline_memory(stages, pipeline, samples), seq, pipeline)?;
        let mut micro_batches = vec![MicroBatchSlicing { samples: 1, slices }; config.batch];
        let (predicted_step_seconds, max_slice_seconds) =
            super::planner::predict_step_and_largest_slice(&latency, config.stages, &micro_batches)?;
        let peak_memory_bytes = peak_memory_bytes(&config, &micro_batches);
        for m in &mut micro_batches {
            m.samples *= samples; // planner units (micro-batches) to sequences
        }
        Ok(SlicingPlan {
            micro_batches,
            predicted_step_seconds,
            max_slice_seconds,
            peak_memory_bytes,
            stats: Default::default(),
        })
    }
}

/// A unit's role in the slicing models.
fn role<D: Device>(unit: &Unit<D>) -> UnitRole {
    match unit {
        Unit::Attention(_) => UnitRole::Attention,
        Unit::Mlp(_) => UnitRole::Mlp,
        _ => UnitRole::End,
    }
}

/// The attention unit the profile measures (the model's first; the MLP after it completes the
/// layer).
fn probed_attention<D: Device>(model: &Model<D>) -> Result<usize> {
    model
        .units()
        .iter()
        .position(|u| matches!(u, Unit::Attention(_)))
        .ok_or_else(|| config_error("pipeline.token_slices", "the model has no attention layer to profile"))
}

/// A slice's transfer across a stage boundary for `micro`'s sequences, fitted to the grid's
/// shortest slice and the whole sequence ([`transfer_seconds`]).
fn measure_comm<D: Device>(dev: &D, model: &Model<D>, micro: &HostBatch, grid: LatencyGrid) -> Result<CommModel> {
    let width = model.spec().hidden;
    let points = [grid.step, grid.max_len].map(|len| transfer_seconds(dev, micro.batch * len, width).map(|t| (len, t)));
    CommModel::fit(&points.into_iter().collect::<Result<Vec<_>>>()?)
}

/// The layers of the largest of `stages` stages of a model of `layers` (12 layers on 8
/// stages: 2, not 1.5): the slowest stage, and the one holding the most.
fn stage_layers(layers: usize, stages: usize) -> usize {
    layers.div_ceil(stages.max(1))
}

/// `stage` of a `stages`-long pipeline from one layer's slice times (`layer`) measured at a
/// micro-batch `share` times smaller than the planned one's: its layers' times at each point,
/// plus its other units' per token (a share of the whole sequence's time without context);
/// `comm` a slice's transfer at the planned micro-batch (none on one stage).
fn stage_latency(
    grid: LatencyGrid,
    layer: &[Sample],
    comm: CommModel,
    stage: &StageLoad,
    share: f64,
    stages: usize,
) -> Result<LatencyModel> {
    let whole = layer.iter().find(|s| s.len == grid.max_len && s.context == 0).map_or(0.0, |s| s.seconds);
    let per_token = stage.end_time * whole / grid.max_len.max(1) as f64;
    let compute: Vec<Sample> = layer
        .iter()
        .map(|s| Sample { seconds: (s.seconds * stage.layer_time + per_token * s.len as f64) * share, ..*s })
        .collect();
    if crate::debug::level() >= 2 {
        let row = |s: &Sample| format!("{}@{} {:.1}", s.len, s.context, s.seconds * 1e6);
        eprintln!(
            "terapipe latency, one stage ({stage}), µs (length@context time): {}",
            compute.iter().map(row).collect::<Vec<_>>().join(", ")
        );
    }
    LatencyModel::from_samples(grid, &compute, if stages > 1 { comm } else { CommModel::NONE })
}

/// One layer's slice times for `micro`'s sequences over the token grid: the no-context table at
/// every grid length, and the context term's points (lengths short and long at contexts
/// across the sequence).
fn layer_samples<D: Device>(dev: &D, model: &mut Model<D>, micro: &HostBatch) -> Result<(LatencyGrid, Vec<Sample>)> {
    let seq = micro.seq;
    let step = grid_step(seq);
    let on_grid = |x: usize| (x / step).max(1) * step;
    let mut points: Vec<(usize, usize)> = (step..=seq).step_by(step).map(|len| (len, 0)).collect();
    let mut with_context = Vec::new();
    for context in [seq / 4, seq / 2, 3 * seq / 4].map(on_grid) {
        for len in [step, on_grid(seq / 4), on_grid(seq / 2)] {
            if context + len <= seq && !with_context.contains(&(len, context)) {
                with_context.push((len, context));
            }
        }
    }
    // Short sequences leave few such points: take more grid pairs until the fit's four
    // coefficients are determined (six points), or say that none can be.
    let grid: Vec<usize> = (step..seq).step_by(step).collect();
    for (&len, &context) in grid.iter().flat_map(|l| grid.iter().map(move |c| (l, c))) {
        if with_context.len() >= 6 {
            break;
        }
        if len + context <= seq && !with_context.contains(&(len, context)) {
            with_context.push((len, context));
        }
    }
    if with_context.len() < 4 {
        return Err(coarse_grid(seq, step, "the context term"));
    }
    points.extend(with_context);
    let seconds = layer_seconds(dev, model, micro, &points)?;
    let samples =
        points.into_iter().zip(seconds).map(|((len, context), seconds)| Sample { batch: 1, len, context, seconds });
    Ok((LatencyGrid { step, max_len: seq, max_batch: 1 }, samples.collect()))
}

/// The latency model of one stage of a `stages`-long pipeline of `model` on `dev`, for
/// micro-batches like `micro` (the planner's batch unit is the whole micro-batch).
pub fn measure_latency<D: Device>(
    dev: &D,
    model: &mut Model<D>,
    micro: &HostBatch,
    stages: usize,
) -> Result<LatencyModel> {
    let (grid, layer) = layer_samples(dev, model, micro)?;
    let comm = if stages > 1 { measure_comm(dev, model, micro, grid)? } else { CommModel::NONE };
    let stage = StageLoad::of_layers(stage_layers(model.spec().layers, stages));
    stage_latency(grid, &layer, comm, &stage, 1.0, stages)
}

/// Bytes a stage of a `pipeline`'s plan keeps for micro-batches like `micro`, as the planner
/// models them ([`MemoryModel`], its "sample" being one whole micro-batch), for TeraPipe's
/// stage ([`SlicingProfile::uniform_stage`]: `⌈L/K⌉` trained layers and the larger end).
///
/// - Activations: the elements one layer's forward keeps for a slice, measured at two points
///   (`l` tokens with no context and after `l` tokens of context: the difference is the
///   attention probabilities' `l·c` term), times the stage's trained layers.
/// - The units before the first layer (embeddings) and after the last (final norm, head):
///   their activations per token (analytic costs) and their parameters.
/// - Fixed: the stage's parameter bytes (weights, and for trained units gradients and AdamW
///   moments: `param_bytes`; the device's packs of the weights).
/// - Sliced only (`sliced_bytes`): the key/value arenas (keys, values and, for a trained
///   layer, their gradients' f32 sums for the whole sequence) of the micro-batches resident at
///   once: all `M` under GPipe, at most `min(M, K)` under 1F1B.
/// - Unsliced only (`unsliced_bytes`): the keys and values a trained layer saves with its
///   activations when the sequence runs whole, for the same micro-batches.
pub fn measure_memory<D: Device>(
    dev: &D,
    model: &Model<D>,
    micro: &HostBatch,
    pipeline: &PipelineConfig,
) -> Result<MemoryModel> {
    let memory = LayerMemory::measure(dev, model, micro)?;
    let stage = memory.uniform(model.spec().layers, pipeline.pipeline_len, micro.batch);
    Ok(memory.stage(&stage, 0, pipeline, micro.batch, 1.0))
}

impl LayerMemory {
    /// One layer's memory for micro-batches like `micro` ([`measure_memory`]).
    fn measure<D: Device>(dev: &D, model: &Model<D>, micro: &HostBatch) -> Result<LayerMemory> {
        let (b, seq, step) = (micro.batch, micro.seq, grid_step(micro.seq));
        if seq < 2 * step {
            return Err(coarse_grid(seq, step, "a slice's memory"));
        }
        let bytes = dev.activation_dtype().bytes() as f64;
        let elements = |context| LayerProbe::new(dev, model, micro, step, context)?.saved_elements(dev, model);
        let ((alone, mlp), (after, _)) = (elements(0)?, elements(step)?);
        // Per micro-batch, the planner's batch unit (`plan_slices`).
        let l = step as f64;
        let per_score = (after as f64 - alone as f64) / (l * l);
        let attention_per_token = alone as f64 / l - l * per_score;
        let costs = model.costs(dev, seq);
        let is_layer = |u: &Unit<D>| matches!(u, Unit::Attention(_) | Unit::Mlp(_));
        let units = model.units();
        let first = units.iter().position(is_layer).unwrap_or(units.len());
        let last = units.iter().rposition(is_layer).map_or(units.len(), |i| i + 1);
        let params = |range: std::ops::Range<usize>| -> usize {
            range.map(|i| param_bytes(costs[i].params, units[i].trainable()) + costs[i].weight_pack_bytes).sum()
        };
        // The ends' activations are per token (the analytic costs, for the micro-batch's
        // sequences).
        let end = |range: std::ops::Range<usize>| -> (usize, f64) {
            let tokens = range.clone().map(|i| costs[i].activation_bytes as f64 * b as f64 / seq as f64).sum();
            (params(range), tokens)
        };
        // Keys and values in the activations' dtype, their gradients' sums in f32 (or wider).
        let act = dev.activation_dtype().bytes();
        let kv = 2 * act * b * seq * model.spec().hidden;
        let kv_grad = 2 * crate::model::kv_arena::grad_elem_bytes(act) * b * seq * model.spec().hidden;
        Ok(LayerMemory {
            attention_per_token: attention_per_token * bytes,
            mlp_per_token: mlp as f64 / l * bytes,
            per_score: per_score * bytes,
            layer_params: params(first..last) / model.spec().layers.max(1),
            head: end(0..first),
            tail: end(last..units.len()),
            kv: kv as f64,
            kv_grad: kv_grad as f64,
        })
    }

    /// TeraPipe's stage of a `stages`-long pipeline of a model of `layers`, measured on
    /// micro-batches of `samples` sequences: `⌈L/K⌉` trained layers, and of the ends (the
    /// first stage's embeddings, the last's final norm and head) the larger weights and the
    /// larger activations per token, which no one stage need hold together (both on one
    /// stage): a bound, for [`measure_memory`] and [`SlicingProfile::uniform_stage`], which
    /// know no stages.
    fn uniform(&self, layers: usize, stages: usize, samples: usize) -> StageLoad {
        let k = stages.max(1);
        let layers = stage_layers(layers, k);
        let (ends, end_tokens) = match k {
            1 => (self.head.0 + self.tail.0, self.head.1 + self.tail.1),
            _ => (self.head.0.max(self.tail.0), self.head.1.max(self.tail.1)),
        };
        StageLoad {
            state_bytes: layers * self.layer_params + ends,
            end_bytes_per_token: end_tokens / samples.max(1) as f64,
            ..StageLoad::of_layers(layers)
        }
    }

    /// `stage` as stage `index` under `pipeline`'s schedule, for micro-batches of `samples`
    /// sequences, `share` times the measured one's.
    fn stage(
        &self,
        stage: &StageLoad,
        index: usize,
        pipeline: &PipelineConfig,
        samples: usize,
        share: f64,
    ) -> MemoryModel {
        let (m, k) = (pipeline.micro_batches, pipeline.pipeline_len);
        // The micro-batches the planner counts resident (the first stage's), and this stage's:
        // under 1F1B stage `s` holds `min(M, K − s)`, so its activations count that share (for
        // micro-batches that share one slicing, as the runtime's do).
        let (counted, resident) = match pipeline.schedule {
            ScheduleKind::Gpipe | ScheduleKind::Interleaved => (m, m),
            ScheduleKind::OneFOneB => (m.min(k), m.min(k.saturating_sub(index).max(1))),
            // Put-off weight gradients keep more in flight on later stages: stage 0's on each.
            ScheduleKind::ZeroBubble => (m.min(k), m.min(k)),
        };
        let held = resident as f64 / counted.max(1) as f64;
        let arenas =
            stage.trained_attention as f64 * (self.kv + self.kv_grad) + stage.frozen_attention as f64 * self.kv;
        // Unsliced, a trained attention saves its keys and values with its activations (the
        // per-token bytes, measured on a slice, have them in the arena); a frozen one saves
        // nothing.
        let saved_kv = stage.trained_attention as f64 * self.kv;
        MemoryModel {
            per_token_bytes: ((self.attention_per_token * stage.trained_attention as f64
                + self.mlp_per_token * stage.trained_mlp as f64)
                * share
                + stage.end_bytes_per_token * samples as f64)
                * held,
            per_score_bytes: self.per_score * stage.trained_attention as f64 * share * held,
            fixed_bytes: stage.state_bytes,
            sliced_bytes: (resident as f64 * arenas * share).round() as usize,
            unsliced_bytes: (resident as f64 * saved_kv * share).round() as usize,
        }
    }
}

/// TeraPipe's slicing for `pipeline`'s micro-batches, each like `micro`, whose units cost
/// `units` (for such a micro-batch) and run as the stages `stages` (unit ranges;
/// [`Plan::time_cut`](crate::pipeline::Plan::time_cut) cuts them as a plan would): the
/// layer's latency and memory measured on `dev` ([`SlicingProfile::measure`]), the stages'
/// loads ([`SlicingProfile::stages`]), then the planner's exact search over one slicing shared by the `M` micro-batches
/// ([`PlannerConfig::shared`]: the runtime cuts every micro-batch alike), under
/// `pipeline.memory_limit` for its schedule. The profile comes back beside it, to plan other
/// shapes from.
pub fn plan_slices<D: Device>(
    dev: &D,
    model: &mut Model<D>,
    micro: &HostBatch,
    pipeline: &PipelineConfig,
    units: &[UnitProfile],
    stages: &[Range<usize>],
) -> Result<(SlicingPlan, SlicingProfile)> {
    let profile = SlicingProfile::measure(dev, model, micro)?;
    let (plan, _) = profile.plan_stages(pipeline, micro.batch, units, stages)?;
    Ok((plan, profile))
}

/// [`plan_slices`] from the measured models: the best slicing `pipeline`'s micro-batches (of
/// `samples` sequences of `seq` tokens each; one planner unit) can share.
pub fn shared_slicing(
    latency: &LatencyModel,
    memory: &[MemoryModel],
    seq: usize,
    samples: usize,
    pipeline: &PipelineConfig,
) -> Result<SlicingPlan> {
    let config = shared_config(memory, seq, pipeline)?;
    // The limit is the pipeline's: name it as the user set it.
    let planned = plan(latency, &config).map_err(|e| match e {
        Error::Config { field, message } if field == "terapipe.memory_limit" => {
            Error::Config { field: "pipeline.memory_limit".into(), message }
        }
        e => e,
    })?;
    let mut planned = even_if_near(latency, &config, planned)?;
    for m in &mut planned.micro_batches {
        m.samples *= samples; // planner units (micro-batches) to sequences
    }
    Ok(planned)
}

/// The planner's settings for `pipeline`'s micro-batches of one shared slicing of `seq`-token
/// sequences, held to its memory limit under its schedule.
fn shared_config(memory: &[MemoryModel], seq: usize, pipeline: &PipelineConfig) -> Result<PlannerConfig> {
    let schedule = match pipeline.schedule {
        ScheduleKind::Gpipe => SliceSchedule::Gpipe,
        ScheduleKind::OneFOneB => SliceSchedule::OneFOneB,
        ScheduleKind::Interleaved | ScheduleKind::ZeroBubble => {
            return Err(config_error(
                "pipeline.token_slices",
                format!("the {} schedule does not take token slices; use gpipe or 1f1b", pipeline.schedule),
            ));
        }
    };
    let (k, m) = (pipeline.pipeline_len, pipeline.micro_batches.max(1));
    Ok(PlannerConfig {
        memory: memory.to_vec(),
        memory_limit: pipeline.memory_limit,
        schedule,
        shared: true,
        ..PlannerConfig::new(k, seq, m)
    })
}

/// How much slower than the planner's optimum (as predicted) an even slicing may be and still
/// be chosen in its place. The prediction rests on measured times, which move by more than
/// this between two measurements on a busy machine; over such a table the optimum is flat,
/// and which of several near-equal uneven slicings won changed from run to run (and with it
/// the step's arithmetic). An even slicing within this margin keeps `auto` steady.
pub const EVEN_WITHIN: f64 = 0.03;

/// `best`, or in its place the fewest equal slices (on the grid; the longer first, as
/// [`uniform`](super::uniform) cuts), no more than `best` has, predicted within
/// [`EVEN_WITHIN`] of it and within the memory limit. For micro-batches that share one
/// slicing.
fn even_if_near(latency: &LatencyModel, config: &PlannerConfig, best: SlicingPlan) -> Result<SlicingPlan> {
    let step = latency.grid().step;
    let most = best.micro_batches.first().map_or(1, |m| m.slices.len());
    for n in 1..=most {
        let slices: Vec<usize> = super::uniform(config.seq_len / step, n).iter().map(|u| u * step).collect();
        let micro_batches = vec![MicroBatchSlicing { samples: 1, slices }; config.batch];
        if best.micro_batches.iter().all(|m| m == &micro_batches[0]) {
            return Ok(best); // the optimum is even already
        }
        let peak = peak_memory_bytes(config, &micro_batches);
        if config.memory_limit.is_some_and(|limit| peak > limit) {
            continue;
        }
        let (predicted, max_slice_seconds) =
            super::planner::predict_step_and_largest_slice(latency, config.stages, &micro_batches)?;
        if crate::debug::level() >= 2 {
            eprintln!(
                "terapipe: {n} equal slices predicted {:.3} ms against the optimum's {:.3} ms",
                predicted * 1e3,
                best.predicted_step_seconds * 1e3
            );
        }
        if predicted <= best.predicted_step_seconds * (1.0 + EVEN_WITHIN) {
            return Ok(SlicingPlan {
                micro_batches,
                predicted_step_seconds: predicted,
                max_slice_seconds,
                peak_memory_bytes: peak,
                stats: best.stats,
            });
        }
    }
    Ok(best)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A probe times a slice as a run takes it: the whole sequence without an arena (a run
    /// without slices has none), a slice with its arena's gradient already zeroed (a run zeroes
    /// it once per micro-batch, so charging it to every slice would price many slices high).
    #[test]
    fn a_probe_times_a_slice_as_a_run_takes_it() {
        use crate::model::Kv;
        let dev = crate::device::CpuDevice::<f32>::new(0, 1).unwrap();
        let config = crate::model::tiny::tiny_gpt(0.0);
        let model = Model::new(&dev, &config, 1).unwrap();
        let micro = HostBatch::random(&config, 2, 8, 3);
        let whole = LayerProbe::new(&dev, &model, &micro, 8, 0).unwrap();
        assert!(whole.arena(&dev, &model).unwrap().is_none(), "the whole sequence");
        for (len, context) in [(4, 0), (4, 4), (2, 6)] {
            let probe = LayerProbe::new(&dev, &model, &micro, len, context).unwrap();
            let arena = probe.arena(&dev, &model).unwrap().expect("a slice's arena");
            assert!(arena.grad(&dev, Kv::Keys, 0, 1).is_ok(), "{len} after {context}: its gradient zeroed first");
        }
    }

    /// A slicing given by hand is priced as the planner prices its own: the planner's plan,
    /// given back, costs what the planner predicted, step, largest slice and peak memory
    /// (the same stage's latency and every stage's memory, at the same micro-batch); whole
    /// sequences cost `K` times the whole sequence's time; slices that do not cover the
    /// sequence are refused by name.
    #[test]
    fn a_given_slicing_is_priced_as_the_planner_prices_its_own() {
        use crate::pipeline::{PipelineConfig, ScheduleKind};
        let dev = crate::device::CpuDevice::<f32>::new(0, 1).unwrap();
        let config = crate::model::tiny::tiny_gpt(0.0);
        let mut model = Model::new(&dev, &config, 1).unwrap();
        let micro = HostBatch::random(&config, 2, 8, 3);
        let profile = SlicingProfile::measure(&dev, &mut model, &micro).unwrap();
        for (schedule, m) in [(ScheduleKind::Gpipe, 2), (ScheduleKind::OneFOneB, 3)] {
            let pipeline = PipelineConfig { pipeline_len: 2, micro_batches: m, schedule, ..Default::default() };
            let stages = vec![profile.uniform_stage(2); 2];
            let planned = profile.plan(&pipeline, 2, &stages).unwrap();
            let priced = profile.price(&pipeline, 2, &stages, &planned.micro_batches[0].slices).unwrap();
            assert_eq!(priced.micro_batches, planned.micro_batches, "{schedule}");
            let close = |a: f64, b: f64| (a - b).abs() <= 1e-12 * b.abs();
            assert!(close(priced.predicted_step_seconds, planned.predicted_step_seconds), "{priced} / {planned}");
            assert!(close(priced.max_slice_seconds, planned.max_slice_seconds), "{priced} / {planned}");
            assert_eq!(priced.peak_memory_bytes, planned.peak_memory_bytes, "{schedule}");
            let whole = profile.price(&pipeline, 2, &stages, &[]).unwrap();
            let t = profile.latency(&stages[0], 2, 2).unwrap().slice_time(1, 8, 0).unwrap();
            assert!(close(whole.predicted_step_seconds, (m + 1) as f64 * t), "{whole}");
            assert_eq!(whole.micro_batches, vec![MicroBatchSlicing { samples: 2, slices: vec![8] }; m]);
        }
        let pipeline = PipelineConfig { pipeline_len: 2, ..Default::default() };
        let e = profile.price(&pipeline, 2, &[profile.uniform_stage(2)], &[3, 3]).unwrap_err().to_string();
        assert!(e.contains("pipeline.token_slices") && e.contains("do not cover the 8 tokens"), "{e}");
    }

    /// A stage's memory model counts the micro-batches that stage holds: every one under
    /// GPipe; under 1F1B stage `s` holds `min(M, K − s)` while the planner counts stage 0's
    /// `min(M, K)` resident on each, so the model carries the share (arenas and saved keys
    /// and values count the stage's own); zero bubble's later stages hold as many as stage 0.
    #[test]
    fn a_stages_memory_counts_the_micro_batches_it_holds() {
        use crate::pipeline::{PipelineConfig, ScheduleKind};
        let layer = LayerMemory {
            attention_per_token: 3.0,
            mlp_per_token: 5.0,
            per_score: 7.0,
            layer_params: 0,
            head: (0, 0.0),
            tail: (0, 0.0),
            kv: 11.0,
            kv_grad: 13.0,
        };
        let stage = StageLoad { end_bytes_per_token: 2.0, ..StageLoad::of_layers(1) };
        for (k, m) in (1..=5).flat_map(|k| (1..=7).map(move |m| (k, m))) {
            for schedule in [ScheduleKind::Gpipe, ScheduleKind::OneFOneB, ScheduleKind::ZeroBubble] {
                let pipeline = PipelineConfig { pipeline_len: k, micro_batches: m, schedule, ..Default::default() };
                let counted = if schedule == ScheduleKind::Gpipe { m } else { m.min(k) };
                for s in 0..k {
                    let holds = match schedule {
                        ScheduleKind::OneFOneB => m.min(k - s),
                        _ => counted,
                    };
                    let got = layer.stage(&stage, s, &pipeline, 1, 1.0);
                    let what = format!("{schedule} K={k} M={m} stage {s}");
                    let close = |a: f64, b: f64| (a - b).abs() <= 1e-12 * b.abs().max(1.0);
                    assert!(close(got.per_token_bytes * counted as f64, (3.0 + 5.0 + 2.0) * holds as f64), "{what}");
                    assert!(close(got.per_score_bytes * counted as f64, 7.0 * holds as f64), "{what}");
                    assert_eq!((got.sliced_bytes, got.unsliced_bytes), (24 * holds, 11 * holds), "{what}");
                }
            }
        }
    }

    /// A stage's latency is the measured layer's slice times times its layers, plus its ends
    /// per token (their share of the whole sequence's time, with no context term), on a table
    /// the model reproduces exactly (non-decreasing, its context term of the fitted form).
    #[test]
    fn a_stage_adds_its_ends_per_token() {
        let grid = LatencyGrid { step: 1, max_len: 8, max_batch: 1 };
        let t = |l: usize, c: usize| {
            let (l, c) = (l as f64, c as f64);
            1.0 + l + if c > 0.0 { 0.5 + 0.1 * l + 0.2 * c + 0.01 * l * c } else { 0.0 }
        };
        let points = (1..=8).map(|l| (l, 0)).chain([(1, 1), (2, 3), (1, 6), (4, 2), (3, 5), (2, 2), (5, 1)]);
        let layer: Vec<Sample> =
            points.map(|(len, context)| Sample { batch: 1, len, context, seconds: t(len, context) }).collect();
        let stage = StageLoad { layer_time: 1.5, end_time: 2.0, ..StageLoad::of_layers(1) };
        let model = stage_latency(grid, &layer, CommModel::NONE, &stage, 0.5, 1).unwrap();
        for (l, c) in [(1, 0), (8, 0), (3, 4), (1, 7), (6, 2)] {
            let want = 0.5 * (1.5 * t(l, c) + 2.0 * t(8, 0) * l as f64 / 8.0);
            let got = model.slice_time(1, l, c).unwrap();
            assert!((got - want).abs() <= 1e-9 * want, "{l}@{c}: {got} vs {want}");
        }
    }
}
