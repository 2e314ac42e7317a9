//! AutoDP (PipeTransformer §3.3): devices freed by a shorter pipeline become new data-parallel
//! replicas in the same process. A new replica receives the frozen and active weights and the
//! optimizer state of the active parameters from replica 0 (`Pipeline::replan` copies them);
//! replicas on GPUs sum gradients over NCCL groups rebuilt for the new shape
//! ([`rebuild_communicators`], which a launched run also calls to span its processes' GPUs).
//! Data needs no
//! re-sharding beyond the step's contiguous split: the activation cache is keyed by sample id,
//! so a sample's entry never moves when `R` changes.
//!
//! The global batch is a policy, not an accident (the released code multiplies it by `R`):
//! `constant` keeps the optimisation trajectory of the run without AutoDP; `scale-lr` lets each
//! replica keep its batch, so one step takes `R/R₀` of the source's batches at `R/R₀` times the
//! learning rate (the linear scaling rule), with the schedule's clock still counted in source
//! batches so the run's length does not change.

use crate::comm::nccl::{host_ring_reason, pipeline_groups, process_groups};
use crate::device::Device;
use crate::error::Result;
use crate::pipeline::Pipeline;
use serde::{Deserialize, Serialize};

/// How the global batch follows the replica count.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum BatchPolicy {
    /// The global batch stays the configured one; replicas split it.
    #[default]
    Constant,
    /// Each replica keeps its share of the initial batch: the global batch and the learning
    /// rate grow by `R/R₀`, in whole source batches (`⌊R/R₀⌋`: from `R₀` = 2 to `R` = 3
    /// a step still takes one batch, each replica a third of it).
    ScaleLr,
}

/// What AutoDP makes of the devices a shorter pipeline frees, where they are cpu devices (GPUs
/// always become replicas).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum FreedDevices {
    /// New data-parallel replicas (the paper).
    #[default]
    Replicas,
    /// Threads lent to the devices still at work: cpu devices share one host's cores, and a
    /// replica there computes nothing a thread would not, while it repeats the optimizer step
    /// and adds a gradient sum (docs/PERF.md measures the two).
    Threads,
}

impl std::str::FromStr for FreedDevices {
    type Err = crate::Error;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "replicas" => Ok(Self::Replicas),
            "threads" => Ok(Self::Threads),
            _ => Err(crate::error::config_error(
                "elastic.freed_devices",
                format!("`{s}` is not one of replicas, threads"),
            )),
        }
    }
}

/// Whether the freed devices of `devices` become threads under `freed`: cpu devices (those
/// with a thread count) only.
pub fn lends_threads<D: Device>(freed: FreedDevices, devices: &[D]) -> bool {
    freed == FreedDevices::Threads && devices.iter().all(|d| d.threads().is_some())
}

/// Replicas for a pipeline of `k` devices: with AutoDP, every whole pipeline the devices hold
/// whose replica gets a sample of the step's batch (`global(r)` samples with `r` replicas: a
/// training set shorter than the devices caps them); else the initial count.
pub fn replicas_for(k: usize, devices: usize, initial: usize, auto_dp: bool, global: impl Fn(usize) -> usize) -> usize {
    let most = (devices / k.max(1)).max(1);
    match auto_dp {
        true => (1..=most).rev().find(|&r| global(r) >= r).unwrap_or(1),
        false => initial,
    }
}

/// Source batches per step under `policy` with `r` replicas where the run began with `r0`.
pub fn batches_per_step(policy: BatchPolicy, r: usize, r0: usize) -> usize {
    match policy {
        BatchPolicy::Constant => 1,
        BatchPolicy::ScaleLr => (r / r0.max(1)).max(1),
    }
}

/// Gives the pipeline NCCL groups for its new shape when its devices are GPUs and NCCL is
/// installed (the host ring otherwise). Returns what the replicas now sum gradients over, for
/// the console, with the reason when GPUs fall back to the host ring.
///
/// In a process of a launched run (one whole pipeline per process) this is a collective: the
/// groups may span every process's GPUs ([`process_groups`]), and the processes agree on it.
pub fn rebuild_communicators<D: Device>(pipeline: &mut Pipeline<D>) -> Result<String> {
    let (k, r) = (pipeline.plan().config.pipeline_len, pipeline.plan().config.replicas);
    let spanning = match (pipeline.process_group(), pipeline.process_stage()) {
        (Some(group), None) => process_groups(pipeline.devices(), k, r, group)?,
        _ => None,
    };
    if spanning.is_some() {
        pipeline.set_communicators(spanning)?;
        return Ok(pipeline.communicator());
    }
    let groups = pipeline_groups(pipeline.devices(), k, r)?;
    let nccl = groups.is_some();
    pipeline.set_communicators(groups)?;
    let name = pipeline.communicator();
    Ok(match host_ring_reason(pipeline.devices()) {
        Some(why) if r > 1 && !nccl => format!("{name} ({why})"),
        _ => name,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn freed_devices_become_replicas_and_the_policy_sets_the_batch() {
        let plenty = |_| 64;
        assert_eq!(replicas_for(2, 4, 2, true, plenty), 2);
        assert_eq!(replicas_for(1, 4, 2, true, plenty), 4);
        assert_eq!(replicas_for(3, 4, 1, true, plenty), 1);
        assert_eq!(replicas_for(1, 4, 1, false, plenty), 1);
        // A batch of 3 samples feeds 3 of 4 replicas; under `scale-lr` from 2 replicas a
        // batch of 2 feeds 2 (3 would share one batch) or 4 (two batches).
        assert_eq!(replicas_for(1, 4, 1, true, |_| 3), 3);
        assert_eq!(replicas_for(1, 3, 2, true, |r| 2 * batches_per_step(BatchPolicy::ScaleLr, r, 2)), 2);
        assert_eq!(replicas_for(1, 4, 2, true, |r| 2 * batches_per_step(BatchPolicy::ScaleLr, r, 2)), 4);
        assert_eq!(batches_per_step(BatchPolicy::Constant, 4, 1), 1);
        assert_eq!(batches_per_step(BatchPolicy::ScaleLr, 4, 2), 2);
        assert_eq!(batches_per_step(BatchPolicy::ScaleLr, 3, 2), 1);
    }
}
