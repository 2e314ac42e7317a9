//! What a run's planners read: the units' costs the partitioner balances (measured, or from
//! FLOPs), and TeraPipe's token slicing for each pipeline shape (the `--token-slices` list as
//! given, or `auto`'s plan over a measured slice-latency profile).

use super::config::RunConfig;
use crate::device::Device;
use crate::elastic::controller::Slicer;
use crate::error::{Result, config_error};
use crate::model::{HeadSpec, HostBatch, Model, Spec};
use crate::pipeline::{
    AutoSliced, PipelineConfig, Plan, Recompute, UnitProfile, samples_per_micro_batch, unit_profiles_per_sample,
};
use crate::terapipe::{SlicingPlan, SlicingProfile, StageLoad, TokenSlices};

/// The first micro-batch `plan` cuts the first training batch into (what the planners
/// measure on).
fn first_micro_batch(first: &HostBatch, plan: &PipelineConfig) -> Result<HostBatch> {
    Ok(first.split(plan.replicas.saturating_mul(plan.micro_batches).clamp(1, first.batch))?.swap_remove(0))
}

/// The units' costs the planner balances, for one micro-batch of the first training batch
/// under `plan`: measured where AutoPipe balances on them (or when asked), else from FLOPs.
/// Returns them per sample and per micro-batch.
pub(super) fn planning_profiles<D: Device>(
    config: &RunConfig,
    dev: &D,
    model: &mut Model<D>,
    first: &HostBatch,
    plan: &PipelineConfig,
) -> Result<(Vec<UnitProfile>, Vec<UnitProfile>)> {
    let micro = first_micro_batch(first, plan)?;
    let measure = config.pipeline.profile || config.elastic.auto_pipe;
    let per_sample = unit_profiles_per_sample(dev, model, &micro, measure)?;
    let micro_samples = samples_per_micro_batch(first.batch, plan.replicas, plan.micro_batches);
    let profiles = per_sample.iter().map(|p| p.scaled(micro_samples as f64)).collect();
    Ok((per_sample, profiles))
}

/// What `auto` slicing planned for the initial shape (none where it runs whole micro-batches
/// or the fewest equal slices), and the slicer of the shapes AutoPipe changes to.
type AutoSlicing = (Option<PlannedSlicing>, Slicer);

/// `auto`'s slicer of the shapes after the first, by [`Plan::auto_slicing`]'s rule in the
/// controller: on more than one stage TeraPipe's planner over `profile`'s measurement; on one
/// stage (and where nothing was measured: a run on one device, or without AutoPipe, that
/// began on one stage) whole micro-batches, which the rule's fallback cuts into equal slices
/// where they exceed the memory limit.
fn auto_slicer(profile: Option<SlicingProfile>) -> Slicer {
    Box::new(move |config, samples, units, stages| match (config.pipeline_len, &profile) {
        (1, _) | (_, None) => Ok(Vec::new()),
        (_, Some(profile)) => Ok(lengths(&profile.plan_stages(config, samples, units, stages)?.0)),
    })
}

/// TeraPipe's slicing for a pipeline, and the slowest of the stages it modelled.
#[derive(Clone, Debug)]
pub struct PlannedSlicing {
    /// The slicing.
    pub plan: SlicingPlan,
    /// The stage.
    pub stage: StageLoad,
    /// Each slice of a micro-batch as `(tokens, context, seconds)`: its forward and backward
    /// on that stage after the slices before it, with its transfers across the stage's
    /// boundary, as the latency model predicts (later slices attend to more context, which
    /// is why `auto` may make them shorter).
    pub slice_seconds: Vec<(usize, usize, f64)>,
}

impl PlannedSlicing {
    /// What `auto` planned, and how to keep it while the plan in force runs it (`in_force`:
    /// an elastic start that left one stage turned it off): the latencies it rests on are
    /// measured afresh by every run, and a plan near others in time can give way to one of
    /// them.
    pub fn describe(&self, in_force: &PipelineConfig) -> String {
        let mut out = format!(
            "token slices (planned from this machine's layer latency, for the slowest stage: {}): {}\n",
            self.stage, self.plan
        );
        let times: Vec<String> = self
            .slice_seconds
            .iter()
            .map(|(len, context, seconds)| format!("{len} after {context}: {:.3} ms", seconds * 1e3))
            .collect();
        if times.len() > 1 {
            out += &format!(
                "  each slice's time on that stage (as the largest slice's), tokens after context: {}\n",
                times.join("; ")
            );
        }
        if in_force.recompute != Recompute::Off {
            out += "  (its peak as if every activation were kept: with recomputation the slicing is planned for time, \
                    and the stages meet the memory limit by recomputing, as the table above shows)\n";
        }
        let planned = self.plan.micro_batches.first().map(|m| &m.slices);
        if let Some(lengths) = planned.filter(|l| l.len() > 1 && l.as_slice() == in_force.token_slices) {
            let list = lengths.iter().map(usize::to_string).collect::<Vec<_>>();
            out += &format!("  (--token-slices {} keeps this slicing in later runs)\n", list.join(","));
        }
        out
    }
}

/// What `auto` slicing runs where its planner's slicing does not: whole micro-batches (one
/// stage, or whole ones fit the memory limit recomputing where no slicing does), or the
/// fewest equal slices that fit (one stage's too, where whole micro-batches exceed the limit).
/// Either way each shape AutoPipe changes to is sliced afresh, by the same rule.
pub(super) fn auto_unplanned(plan: &PipelineConfig) -> String {
    let recomputing = if plan.recompute == Recompute::Off { "" } else { ", recomputing where the stages need it" };
    match (plan.token_slices.len(), plan.pipeline_len) {
        (0, 1) => "token slices: none (`auto` on one stage: it has no fill or drain for slices to shorten)\n".into(),
        (0, _) => "token slices: none (`auto`: no slicing fits the memory limit, and whole micro-batches do, \
                   recomputing; a shape AutoPipe changes to is sliced afresh)\n"
            .into(),
        (n, 1) => format!(
            "token slices: {n} of equal length, {:?} (`auto` on one stage: whole micro-batches exceed the memory limit; \
             these are the fewest equal slices that fit{recomputing})\n",
            plan.token_slices
        ),
        (n, _) => {
            // (`auto` recomputes the fewest units that fit; every unit may fit more.)
            let all = match plan.recompute {
                Recompute::Auto => " as `auto` recomputes (`--recompute all` may let one fit)",
                _ => "",
            };
            format!(
                "token slices: {n} of equal length, {:?} (`auto`: none of its slicings fits the memory limit{all}; \
                 these are the fewest equal ones that do{recomputing}; a shape AutoPipe changes to is sliced afresh)\n",
                plan.token_slices
            )
        }
    }
}

/// Whether the model and the activation cache take the token slices `config` asks for: token
/// slicing needs a causal language model, and the cache holds whole sequences.
pub(super) fn check_token_slices(config: &RunConfig, spec: &Spec) -> Result<()> {
    if config.pipeline.token_slices == TokenSlices::Off {
        return Ok(());
    }
    if !spec.causal || spec.head != HeadSpec::TiedLmHead {
        return Err(config_error(
            "pipeline.token_slices",
            format!(
                "token slicing needs a causal language model (GPT); this {} model attends in both directions or classifies whole sequences",
                spec.family
            ),
        ));
    }
    if config.elastic.cache {
        return Err(config_error(
            "pipeline.token_slices",
            "the frozen-activation cache (elastic.cache) does not take token slices; turn one off",
        ));
    }
    Ok(())
}

/// The token slices `config` asks for, for sequences like `first`'s ([`check_token_slices`]
/// first); `auto` measures the model's layer on `dev` and slices `plan`'s pipeline of units
/// costing `units` per micro-batch by [`Plan::auto_slicing`]'s rule (its planner's plan
/// returned beside the lengths where it runs one, and the measurement, to slice the shapes
/// AutoPipe changes to).
pub(super) fn token_slices<D: Device>(
    config: &RunConfig,
    devices: &[D],
    model: &mut Model<D>,
    first: &HostBatch,
    plan: &PipelineConfig,
    units: &[UnitProfile],
) -> Result<(Vec<usize>, Option<AutoSlicing>)> {
    let request = &config.pipeline.token_slices;
    match request {
        TokenSlices::Off => return Ok((Vec::new(), None)),
        TokenSlices::Auto => {}
        _ => return Ok((request.lengths(first.seq)?, None)),
    }
    // The stages the pipeline will cut (its frozen prefix on the first, as `Pipeline::new`).
    let pinned = model.frozen_prefix();
    let dev = devices.first().ok_or_else(|| config_error("devices", "none opened"))?;
    let micro = first_micro_batch(first, plan)?;
    // One stage has no fill or drain for slices to shorten: `auto` keeps its micro-batches
    // whole, whatever noisy timings would predict, unless they exceed the memory limit where
    // equal slices do not (as for any shape AutoPipe changes to). AutoPipe may still run a
    // longer pipeline on the devices open (a resumed checkpoint's, and its trials of it): the
    // layer is measured for those.
    if plan.pipeline_len == 1 {
        let longer = config.elastic.auto_pipe && devices.len() > 1;
        let profile = if longer { Some(SlicingProfile::measure(dev, model, &micro)?) } else { None };
        let whole = |_: &PipelineConfig| Ok(Vec::new());
        let sliced = match Plan::auto_slicing(plan, units, pinned, None, first.seq, whole, Vec::clone)? {
            AutoSliced::Equal(lengths) => lengths,
            AutoSliced::Planned(_) | AutoSliced::Whole => Vec::new(),
        };
        return Ok((sliced, Some((None, auto_slicer(profile)))));
    }
    let profile = SlicingProfile::measure(dev, model, &micro)?;
    let slice =
        |c: &PipelineConfig| Plan::slice_cut(c, units, pinned, |s| profile.plan_stages(c, micro.batch, units, s));
    let (sliced, planned) = match Plan::auto_slicing(plan, units, pinned, None, first.seq, slice, |(p, _)| lengths(p))?
    {
        AutoSliced::Planned((planned, stage)) => {
            let latency = profile.latency(&stage, plan.pipeline_len, micro.batch)?;
            let mut context = 0;
            let mut slice_seconds = Vec::new();
            for &len in planned.micro_batches.first().map_or(&[][..], |m| &m.slices) {
                // (The planner's unit is one micro-batch: the model's batch dimension is 1.)
                slice_seconds.push((len, context, latency.slice_time(1, len, context)?));
                context += len;
            }
            (lengths(&planned), Some(PlannedSlicing { plan: planned, stage, slice_seconds }))
        }
        // (Main says which, and why.)
        AutoSliced::Whole => (Vec::new(), None),
        AutoSliced::Equal(lengths) => (lengths, None),
    };
    Ok((sliced, Some((planned, auto_slicer(Some(profile))))))
}

/// The token slices `planned` cuts every micro-batch into; none where it keeps them whole.
fn lengths(planned: &SlicingPlan) -> Vec<usize> {
    let lengths = planned.micro_batches.first().map(|m| m.slices.clone()).unwrap_or_default();
    if lengths.len() > 1 { lengths } else { Vec::new() }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Where none of `auto`'s slicings fits, the equal slices run instead are named, and
    /// under `--recompute auto`, which recomputes the fewest units, so is the other choice.
    #[test]
    fn equal_slices_in_place_of_autos_name_the_recomputation_that_may_fit_more() {
        let plan = |recompute| PipelineConfig {
            pipeline_len: 2,
            token_slices: vec![43, 43, 42],
            recompute,
            ..PipelineConfig::default()
        };
        let off = auto_unplanned(&plan(Recompute::Off));
        assert!(off.starts_with("token slices: 3 of equal length, [43, 43, 42] (`auto`: none"), "{off}");
        assert!(!off.contains("--recompute all"), "{off}");
        let auto = auto_unplanned(&plan(Recompute::Auto));
        assert!(
            auto.contains("fits the memory limit as `auto` recomputes (`--recompute all` may let one fit)"),
            "{auto}"
        );
        assert!(!auto_unplanned(&plan(Recompute::All)).contains("--recompute all"));
    }
}
