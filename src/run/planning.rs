//! What a run's planners read: the units' costs the partitioner balances (measured, or from
//! FLOPs), and TeraPipe's token slicing for each pipeline shape (the `--token-slices` list as
//! given, or `auto`'s plan over a measured slice-latency profile).

use super::config::RunConfig;
use crate::device::Device;
use crate::elastic::controller::Slicer;
use crate::error::{Error, Result, config_error};
use crate::model::{HeadSpec, HostBatch, Model, Spec};
use crate::pipeline::{
    AutoSliced, PipelineConfig, Plan, Recompute, UnitProfile, samples_per_micro_batch, unit_profiles_per_sample,
};
use crate::terapipe::profile::{GIVE_THE_SLICES, grid_step};
use crate::terapipe::{LatencyModel, SlicingPlan, SlicingProfile, StageLoad, TokenSlices, uniform};

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
    /// The whole micro-batch's time on that stage, unsliced, as the latency model predicts.
    pub whole_seconds: f64,
    /// Whose slicing it is.
    pub origin: SlicingOrigin,
}

/// Whose slicing a [`PlannedSlicing`] is.
#[derive(Clone, Debug)]
pub enum SlicingOrigin {
    /// `auto`'s planner's.
    Auto,
    /// The run's own (`--token-slices N` or a list), priced as `auto` prices its plans:
    /// beside it, `auto`'s choice in its place.
    Given {
        /// What `auto` runs instead: its planner's slicing, or whole micro-batches or equal
        /// slices priced on the same stages; or why it would refuse.
        auto: std::result::Result<SlicingPlan, String>,
    },
}

impl PlannedSlicing {
    /// `plan` on `stage`, each slice timed by `latency`, the stage's latency model.
    fn timed(plan: SlicingPlan, stage: StageLoad, latency: &LatencyModel, origin: SlicingOrigin) -> Result<Self> {
        let mut context = 0;
        let mut slice_seconds = Vec::new();
        for &len in plan.micro_batches.first().map_or(&[][..], |m| &m.slices) {
            // (The planner's unit is one micro-batch: the model's batch dimension is 1.)
            slice_seconds.push((len, context, latency.slice_time_interpolated(1, len, context)?));
            context += len;
        }
        let whole_seconds = latency.slice_time_interpolated(1, context, 0)?;
        Ok(PlannedSlicing { plan, stage, slice_seconds, whole_seconds, origin })
    }

    /// The slices' lengths (one micro-batch's).
    pub fn lengths(&self) -> Vec<usize> {
        self.slice_seconds.iter().map(|&(len, _, _)| len).collect()
    }

    /// Each slice's share of the whole micro-batch's time ([`Plan::slice_time_shares`]).
    pub fn time_shares(&self) -> Vec<f64> {
        self.slice_seconds.iter().map(|&(_, _, t)| t / self.whole_seconds.max(f64::MIN_POSITIVE)).collect()
    }

    /// What the slicing is and what it costs, and for `auto`'s, how to keep it while the plan
    /// in force runs it (`in_force`: an elastic start that left one stage turned it off): the
    /// latencies it rests on are measured afresh by every run, and a plan near others in time
    /// can give way to one of them.
    pub fn describe(&self, in_force: &PipelineConfig) -> String {
        let whose = match self.origin {
            SlicingOrigin::Auto => "planned from this machine's layer latency",
            SlicingOrigin::Given { .. } => "as given, priced from this machine's layer latency",
        };
        let mut out = format!("token slices ({whose}, for the slowest stage: {}): {}\n", self.stage, self.plan);
        let times: Vec<String> = self
            .slice_seconds
            .iter()
            .map(|(len, context, seconds)| format!("{len} after {context}: {:.3} ms", seconds * 1e3))
            .collect();
        if times.len() > 1 {
            // (A list given by hand may run to a token a slice; `auto`'s is printed whole.)
            let times = match self.origin {
                SlicingOrigin::Auto => times.join("; "),
                SlicingOrigin::Given { .. } => elided(&times),
            };
            out += &format!(
                "  each slice's time on that stage (as the largest slice's), tokens after context: {times}\n  the \
                 whole sequence's time on that stage, unsliced: {:.3} ms\n",
                self.whole_seconds * 1e3
            );
        }
        if in_force.recompute != Recompute::Off {
            let planned = match self.origin {
                SlicingOrigin::Auto => "with recomputation the slicing is planned for time, and ",
                SlicingOrigin::Given { .. } => "",
            };
            out += &format!(
                "  (its peak as if every activation were kept: {planned}the stages meet the memory limit by \
                 recomputing, as the table above shows)\n"
            );
        }
        match &self.origin {
            SlicingOrigin::Auto => {
                let planned = self.plan.micro_batches.first().map(|m| &m.slices);
                if let Some(lengths) = planned.filter(|l| l.len() > 1 && l.as_slice() == in_force.token_slices) {
                    let list = TokenSlices::Lengths(lengths.clone());
                    out += &format!("  (--token-slices {list} keeps this slicing in later runs)\n");
                }
            }
            SlicingOrigin::Given { auto: Err(why) } => {
                out += &format!("  (`--token-slices auto` would refuse this pipeline: {why})\n");
            }
            SlicingOrigin::Given { auto: Ok(auto) } => {
                let (given, theirs) = (self.plan.predicted_step_seconds, auto.predicted_step_seconds);
                let theirs_lengths = auto.micro_batches.first().map(|m| m.slices.clone()).unwrap_or_default();
                let tokens = theirs_lengths.iter().sum();
                // (The planner's optimum is no slower than any slicing on its grid: `auto` gave
                // it up for steadier equal slices.)
                let step = grid_step(tokens);
                let even: Vec<usize> = uniform(tokens / step, theirs_lengths.len()).iter().map(|u| u * step).collect();
                let within = theirs <= given * (1.0 + crate::terapipe::profile::EVEN_WITHIN);
                let steadier = match theirs_lengths.len() > 1 && theirs_lengths == even && within {
                    true => format!(
                        " (`auto` runs the fewest equal slices predicted within {:.0}% of its optimum, to stay steady \
                         over timings that move between runs)",
                        100.0 * crate::terapipe::profile::EVEN_WITHIN
                    ),
                    false => String::new(),
                };
                out += &match theirs_lengths == self.lengths() {
                    true => "  (`--token-slices auto` plans these same slices)\n".to_string(),
                    false if theirs < given => format!(
                        "  `--token-slices auto` would run {auto}: {:.1}% less time a step than these\n",
                        100.0 * (1.0 - theirs / given)
                    ),
                    false => format!(
                        "  `--token-slices auto` would run {auto}: {:.1}% more time a step than these{steadier}\n",
                        100.0 * (theirs / given - 1.0)
                    ),
                };
            }
        }
        out
    }
}

/// Items past the first eight shown as the first six, `…` and the last two.
fn elided(items: &[String]) -> String {
    match items.len() {
        0..=8 => items.join("; "),
        n => format!("{}; …; {}", items[..6].join("; "), items[n - 2..].join("; ")),
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
            "token slices: {n} of equal length, {} (`auto` on one stage: whole micro-batches exceed the memory limit; \
             these are the fewest equal slices that fit{recomputing})\n",
            TokenSlices::Lengths(plan.token_slices.clone())
        ),
        (n, _) => {
            // (`auto` recomputes the fewest units that fit; every unit may fit more.)
            let all = match plan.recompute {
                Recompute::Auto => " as `auto` recomputes (`--recompute all` may let one fit)",
                _ => "",
            };
            format!(
                "token slices: {n} of equal length, {} (`auto`: none of its slicings fits the memory limit{all}; \
                 these are the fewest equal ones that do{recomputing}; a shape AutoPipe changes to is sliced afresh)\n",
                TokenSlices::Lengths(plan.token_slices.clone())
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
        return Ok((one_stage_auto(plan, units, pinned, first.seq)?, Some((None, auto_slicer(profile)))));
    }
    let profile = SlicingProfile::measure(dev, model, &micro)?;
    let (sliced, planned) = match auto_choice(plan, units, pinned, first.seq, &profile, micro.batch)? {
        AutoSliced::Planned((planned, stage)) => {
            let latency = profile.latency(&stage, plan.pipeline_len, micro.batch)?;
            (lengths(&planned), Some(PlannedSlicing::timed(planned, stage, &latency, SlicingOrigin::Auto)?))
        }
        // (Main says which, and why.)
        AutoSliced::Whole => (Vec::new(), None),
        AutoSliced::Equal(lengths) => (lengths, None),
    };
    Ok((sliced, Some((planned, auto_slicer(Some(profile))))))
}

/// `auto`'s slicing of a one-stage pipeline ([`Plan::auto_slicing`]'s rule): whole
/// micro-batches (none), unless they exceed the memory limit where equal slices do not.
fn one_stage_auto(plan: &PipelineConfig, units: &[UnitProfile], pinned: usize, seq: usize) -> Result<Vec<usize>> {
    let whole = |_: &PipelineConfig| Ok(Vec::new());
    Ok(match Plan::auto_slicing(plan, units, pinned, None, seq, whole, Vec::clone)? {
        AutoSliced::Equal(lengths) => lengths,
        AutoSliced::Planned(_) | AutoSliced::Whole => Vec::new(),
    })
}

/// `auto`'s slicing of `plan`'s pipeline of more than one stage ([`Plan::auto_slicing`]'s
/// rule): TeraPipe's planner over `profile` for micro-batches of `samples` sequences of `seq`
/// tokens, with the slowest stage it modelled.
fn auto_choice(
    plan: &PipelineConfig,
    units: &[UnitProfile],
    pinned: usize,
    seq: usize,
    profile: &SlicingProfile,
    samples: usize,
) -> Result<AutoSliced<(SlicingPlan, StageLoad)>> {
    let slice = |c: &PipelineConfig| Plan::slice_cut(c, units, pinned, |s| profile.plan_stages(c, samples, units, s));
    Plan::auto_slicing(plan, units, pinned, None, seq, slice, |(p, _)| lengths(p))
}

/// `plan`'s token slices, given by the run (`--token-slices N` or a list), priced on the layer
/// of `model` measured on `dev` for micro-batches of `first` as `auto` prices its own, over the
/// plan's stages (units costing `units` per micro-batch, the first `pinned` on the first
/// stage), beside what `auto` would run in their place: its planner's slicing where it plans
/// one, else whole micro-batches or its equal slices priced on the same stages.
pub(super) fn price_given<D: Device>(
    dev: &D,
    model: &mut Model<D>,
    first: &HostBatch,
    plan: &Plan,
    units: &[UnitProfile],
    pinned: usize,
) -> Result<PlannedSlicing> {
    let config = &plan.config;
    let micro = first_micro_batch(first, config)?;
    // (The advice to give the slices is `auto`'s, not for slices given.)
    let profile = SlicingProfile::measure(dev, model, &micro).map_err(|e| match e {
        Error::Config { field, message } => {
            let message = message.strip_suffix(GIVE_THE_SLICES).map_or(message.clone(), str::to_string);
            Error::Config { field, message }
        }
        e => e,
    })?;
    let loads = profile.stages(units, &plan.partition.stages, micro.batch)?;
    let price = |lengths: &[usize]| profile.price(config, micro.batch, &loads, lengths);
    let given = price(&config.token_slices)?;
    let unsliced = PipelineConfig { token_slices: Vec::new(), ..config.clone() };
    let auto = match config.pipeline_len {
        1 => one_stage_auto(&unsliced, units, pinned, first.seq).and_then(|lengths| price(&lengths)),
        _ => auto_choice(&unsliced, units, pinned, first.seq, &profile, micro.batch).and_then(|choice| match choice {
            AutoSliced::Planned((planned, _)) => Ok(planned),
            AutoSliced::Whole => price(&[]),
            AutoSliced::Equal(lengths) => price(&lengths),
        }),
    };
    // (Where `auto` refuses, the slices given may still plan: the comparison says why.)
    let auto = auto.map_err(|e| match e {
        Error::Config { field, message } => format!("{field}: {message}"),
        e => e.to_string(),
    });
    let stage = StageLoad::slowest(&loads).cloned().unwrap_or(StageLoad::of_layers(0));
    let latency = profile.latency(&stage, config.pipeline_len, micro.batch)?;
    PlannedSlicing::timed(given, stage, &latency, SlicingOrigin::Given { auto })
}

/// The token slices `planned` cuts every micro-batch into; none where it keeps them whole.
fn lengths(planned: &SlicingPlan) -> Vec<usize> {
    let lengths = planned.micro_batches.first().map(|m| m.slices.clone()).unwrap_or_default();
    if lengths.len() > 1 { lengths } else { Vec::new() }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A slicing of the run's own says what it costs beside `auto`'s choice: less time, more
    /// (with why, where `auto` took equal slices near its optimum), the same slices, or
    /// `auto`'s refusal; its slices' shares of the whole micro-batch's time are their times
    /// over the whole's.
    #[test]
    fn a_given_slicing_is_set_beside_autos_choice() {
        use crate::terapipe::MicroBatchSlicing;
        let sliced = |slices: Vec<usize>, step: f64| SlicingPlan {
            micro_batches: vec![MicroBatchSlicing { samples: 4, slices }],
            predicted_step_seconds: step,
            max_slice_seconds: step / 4.0,
            peak_memory_bytes: 1 << 20,
            stats: Default::default(),
        };
        let given = |auto| PlannedSlicing {
            plan: sliced(vec![64, 64], 0.1),
            stage: StageLoad::of_layers(2),
            slice_seconds: vec![(64, 0, 0.03), (64, 64, 0.05)],
            whole_seconds: 0.04,
            origin: SlicingOrigin::Given { auto },
        };
        let in_force = PipelineConfig { pipeline_len: 2, token_slices: vec![64, 64], ..PipelineConfig::default() };
        let shares = given(Err(String::new())).time_shares();
        assert!((shares[0] - 0.75).abs() < 1e-12 && (shares[1] - 1.25).abs() < 1e-12, "{shares:?}");
        let text = given(Ok(sliced(vec![48, 40, 40], 0.08))).describe(&in_force);
        assert!(text.starts_with("token slices (as given, priced from this machine's layer latency"), "{text}");
        assert!(
            text.contains("64 after 64: 50.000 ms\n  the whole sequence's time on that stage, unsliced: 40.000 ms\n")
        );
        assert!(text.contains("`--token-slices auto` would run (4 seq: 48, 2×40 tokens)"), "{text}");
        assert!(text.contains(": 20.0% less time a step than these\n"), "{text}");
        assert!(!text.contains("keeps this slicing"), "{text}");
        // On the 4-token grid of 128 tokens, 44, 44, 40 are `auto`'s equal slices: within the
        // margin it takes them in place of its optimum; beyond it, or uneven, that is no reason.
        let text = given(Ok(sliced(vec![44, 44, 40], 0.102))).describe(&in_force);
        assert!(text.contains("2.0% more time a step than these (`auto` runs the fewest equal slices"), "{text}");
        for auto in [sliced(vec![44, 44, 40], 0.11), sliced(vec![48, 40, 40], 0.102)] {
            let text = given(Ok(auto)).describe(&in_force);
            assert!(text.contains("% more time a step than these\n"), "{text}");
        }
        let text = given(Ok(sliced(vec![64, 64], 0.1))).describe(&in_force);
        assert!(
            text.contains("(`--token-slices auto` plans these same slices)") && !text.contains("would run"),
            "{text}"
        );
        let text = given(Err("pipeline.memory_limit: too small".into())).describe(&in_force);
        assert!(text.contains("(`--token-slices auto` would refuse this pipeline: pipeline.memory_limit: too small)"));
    }

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
        assert!(off.starts_with("token slices: 3 of equal length, 43,43,42 (`auto`: none"), "{off}");
        assert!(!off.contains("--recompute all"), "{off}");
        let auto = auto_unplanned(&plan(Recompute::Auto));
        assert!(
            auto.contains("fits the memory limit as `auto` recomputes (`--recompute all` may let one fit)"),
            "{auto}"
        );
        assert!(!auto_unplanned(&plan(Recompute::All)).contains("--recompute all"));
    }
}
