//! TeraPipe's latency model measured on a device (pipelines.md A.4): one Transformer layer (the
//! model's first attention unit and the MLP unit after it) runs a slice of `l` tokens after `c`
//! tokens of context, forward and backward, through the same key/value arena the pipeline
//! uses; a stage's time is that times its layers. The no-context table covers every length on
//! the token grid; the context term is fitted to a handful of `(l, c)` points; the transfer of
//! a slice's activation and gradient across a stage boundary is timed as a download and an
//! upload of each.

use super::latency::{CommModel, LatencyGrid, LatencyModel, Sample};
use super::planner::{PlannerConfig, SlicingPlan, plan};
use crate::device::Device;
use crate::error::{Result, config_error};
use crate::model::{Batch, HostBatch, KvArena, Model, Unit};
use crate::rng::Rng;
use std::time::Instant;

/// Timed runs per point (the median is kept).
const REPEATS: usize = 3;

/// The token grid for sequences of `seq` tokens: the smallest step dividing `seq` that leaves
/// at most 32 grid units (the planner's work grows as the fourth power of the units).
pub fn grid_step(seq: usize) -> usize {
    (1..=seq).find(|d| seq.is_multiple_of(*d) && seq / d <= 32).unwrap_or(seq.max(1))
}

/// Seconds of one slice (forward and backward) of `len` tokens after `context` through one
/// layer of `model` for `micro`'s sequences (median of [`REPEATS`]).
fn layer_seconds<D: Device>(
    dev: &D,
    model: &mut Model<D>,
    micro: &HostBatch,
    len: usize,
    context: usize,
) -> Result<f64> {
    let attention = model
        .units()
        .iter()
        .position(|u| matches!(u, Unit::Attention(_)))
        .ok_or_else(|| config_error("token_slices", "the model has no attention layer to profile"))?;
    let width = model.spec().hidden;
    let (b, whole) = (micro.batch, micro.seq);
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
        _ => return Err(config_error("token_slices", "profiling cut a window into more than two parts")),
    };
    let mut rng = Rng::new(7);
    let x: Vec<f32> = (0..b * len * width).map(|_| rng.uniform() as f32 - 0.5).collect();
    let mut times = Vec::with_capacity(REPEATS);
    for _ in 0..=REPEATS {
        let mut arena = KvArena::new(dev, b, whole, width)?;
        let units = model.units_mut();
        if let Some(prefix) = &prefix {
            let h = dev.upload(&vec![0.1; b * context * width])?;
            units[attention].forward(dev, prefix, Some(h), false, Some(&mut arena))?;
        }
        let (xin, dy) = (dev.upload(&x)?, dev.upload(&x)?);
        dev.synchronize()?;
        let start = Instant::now();
        let (y, saved_attention) = units[attention].forward(dev, &slice, Some(xin), true, Some(&mut arena))?;
        let (_, saved_mlp) = units[attention + 1].forward(dev, &slice, Some(y), true, None)?;
        let dmid = units[attention + 1].backward(dev, &slice, saved_mlp, &dy, true, None)?;
        let dmid = dmid.ok_or_else(|| config_error("token_slices", "the MLP returned no input gradient"))?;
        units[attention].backward(dev, &slice, saved_attention, &dmid, true, Some(&mut arena))?;
        dev.synchronize()?;
        times.push(start.elapsed().as_secs_f64());
    }
    times.remove(0); // the warm-up run
    times.sort_by(f64::total_cmp);
    Ok(times[times.len() / 2])
}

/// Seconds to move `tokens` positions of activations across a stage boundary and their gradient
/// back (a download and an upload each, as the runtime's mailboxes do).
fn transfer_seconds<D: Device>(dev: &D, tokens: usize, width: usize) -> Result<f64> {
    let buf = dev.upload(&vec![0.5; tokens * width])?;
    let mut times = Vec::with_capacity(REPEATS);
    for _ in 0..REPEATS {
        let start = Instant::now();
        let host = dev.download(&buf)?;
        let back = dev.upload(&host)?;
        dev.synchronize()?;
        times.push(2.0 * start.elapsed().as_secs_f64());
        drop(back);
    }
    times.sort_by(f64::total_cmp);
    Ok(times[times.len() / 2])
}

/// The latency model of one stage of a `stages`-long pipeline of `model` on `dev`, for
/// micro-batches like `micro` (the planner's batch unit is the whole micro-batch).
pub fn measure_latency<D: Device>(
    dev: &D,
    model: &mut Model<D>,
    micro: &HostBatch,
    stages: usize,
) -> Result<LatencyModel> {
    let seq = micro.seq;
    let step = grid_step(seq);
    let per_stage = model.spec().layers as f64 / stages.max(1) as f64;
    // The no-context table at every grid length; the context term from lengths short and
    // long at contexts across the sequence.
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
        return Err(config_error(
            "token_slices",
            format!(
                "a {seq}-token sequence is too short to measure the context term; give the slices (a count or lengths)"
            ),
        ));
    }
    points.extend(with_context);
    let samples = points
        .into_iter()
        .map(|(len, context)| {
            let seconds = per_stage * layer_seconds(dev, model, micro, len, context)?;
            Ok(Sample { batch: 1, len, context, seconds })
        })
        .collect::<Result<Vec<_>>>()?;
    let comm = if stages > 1 {
        let width = model.spec().hidden;
        let points = [step, seq].map(|len| transfer_seconds(dev, micro.batch * len, width).map(|t| (len, t)));
        CommModel::fit(&points.into_iter().collect::<Result<Vec<_>>>()?)?
    } else {
        CommModel::NONE
    };
    LatencyModel::from_samples(LatencyGrid { step, max_len: seq, max_batch: 1 }, &samples, comm)
}

/// TeraPipe's slicing for micro-batches like `micro` through `stages` stages: the latency
/// model measured on `dev`, then the planner's exact search.
pub fn plan_slices<D: Device>(dev: &D, model: &mut Model<D>, micro: &HostBatch, stages: usize) -> Result<SlicingPlan> {
    let latency = measure_latency(dev, model, micro, stages)?;
    plan(&latency, &PlannerConfig::new(stages, micro.seq, 1))
}
