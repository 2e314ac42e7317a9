//! TeraPipe (Li et al., ICML 2021): for causal language models, cut each sequence into token
//! slices that flow through a `K`-stage pipeline one after another; slice `j` attends to the
//! keys and values of slices `< j` held on the same stage, and the backward runs last slice
//! first. This module is the *planner*: which slices (and micro-batches) to cut, from a latency
//! model. The sliced execution (attention over a K/V prefix, the per-slice dK/dV accumulation)
//! lives in [`model`](crate::model) and the slice schedules in [`pipeline`](crate::pipeline).
//!
//! | module | reference (pipelines.md) | defines |
//! |---|---|---|
//! | [`latency`] | A.4 | `LatencyModel` (`t0` table + fitted context term `Δ` + `comm`), `Sample`, `CommModel`, `ContextFit`, `LatencyGrid` |
//! | [`memory`] | A.5, A.9 | `MemoryModel` (activation bytes of a slice), `SliceSchedule` (GPipe / 1F1B over slices) |
//! | [`planner`] | A.2, A.3 | `plan` (the `t_max` DP with exact pruning, joint batch × token, memory limits), `PlannerConfig`, `SlicingPlan`, `predict_step_seconds` |

mod dp;
pub mod latency;
pub mod memory;
pub mod planner;
#[cfg(test)]
mod tests;

pub use latency::{CommModel, ContextFit, LatencyGrid, LatencyModel, Sample};
pub use memory::{MemoryModel, SliceSchedule};
pub use planner::{MicroBatchSlicing, PlannerConfig, Search, SearchStats, SlicingPlan, plan, predict_step_seconds};
