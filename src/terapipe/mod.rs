//! TeraPipe (Li et al., ICML 2021): for causal language models, cut each sequence into token
//! slices that flow through a `K`-stage pipeline one after another; slice `j` attends to the
//! keys and values of slices `< j` held on the same stage, and the backward runs last slice
//! first. This module holds what a user asks for, the latency model and its measurement on a
//! device, and the slicing planner. The sliced execution lives in the layers below: dropout
//! masks by global coordinates (`ops::dropout::DropoutCoords`), the key/value arena
//! (`model::kv_arena`), attention over a slice's context (`model::block`),
//! `HostBatch::token_slices`, and the schedules over (micro-batch, slice) pieces
//! (`pipeline::schedule`, `pipeline::runtime`).
//!
//! | module | reference (pipelines.md) | defines |
//! |---|---|---|
//! | [`slices`] | — | `TokenSlices` (`--token-slices off|auto|N|l1,l2,...`) and the lengths it means |
//! | [`latency`] | A.4 | `LatencyModel` (`t0` table + fitted context term `Δ` + `comm`), `Sample`, `CommModel`, `ContextFit`, `LatencyGrid` |
//! | [`profile`] | A.4, A.5 | `SlicingProfile` (one layer measured on a device: the latency and memory models of any stage of any pipeline shape, and its slicing), `measure_latency`, `measure_memory`, `plan_slices` (measure, then the planner, for a pipeline plan) |
//! | [`stage`] | — | `StageLoad` (what a pipeline stage runs and holds, in a trained layer's terms: its layers, frozen ones forward only, and its embeddings or head) |
//! | [`memory`] | A.5, A.9 | `MemoryModel` (activation bytes of a slice), `SliceSchedule` (GPipe / 1F1B over slices) |
//! | [`planner`] | A.2, A.3 | `plan` (the `t_max` DP with exact pruning, joint batch × token, memory limits), `PlannerConfig`, `SlicingPlan`, `predict_step_seconds` |

mod dp;
pub mod latency;
pub mod memory;
pub mod planner;
pub mod profile;
pub mod slices;
pub mod stage;
#[cfg(test)]
mod tests;

pub use latency::{CommModel, ContextFit, LatencyGrid, LatencyModel, Sample};
pub use memory::{MemoryModel, SliceSchedule};
pub use planner::{
    MicroBatchSlicing, PlannerConfig, Search, SearchStats, SlicingPlan, peak_memory_bytes, plan, predict_step_seconds,
};
pub use profile::{SlicingProfile, measure_latency, measure_memory, plan_slices, shared_slicing};
pub use slices::{TokenSlices, uniform};
pub use stage::{StageLoad, UnitRole};
