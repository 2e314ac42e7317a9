//! Pipeline parallelism: what runs where and when.
//!
//! | module | defines |
//! |---|---|
//! | [`profile`] | `UnitProfile` (a unit's time and memory per micro-batch), `profile_units` (measured), `unit_profiles` (measured or from FLOPs; `unit_profiles_per_sample`, what a `Trainer` keeps) |
//! | [`partition`](mod@partition) | `partition` (exact min-max split of the units under a memory limit, a frozen prefix pinned to stage 0, each stage recomputing the activations of a run of its units where `Recompute` says), `Partition` |
//! | [`plan`] | `PipelineConfig` (K, R, M, schedule, chunks, memory limit, token slices, recompute), `Plan` (checked, printable) |
//! | [`schedule`] | the schedule IR (`Action`, `Schedule`), the GPipe / 1F1B / interleaved / zero-bubble generators, the validator |
//! | [`simulate`](mod@simulate) | the cluster simulator: `simulate` (a schedule played against a `CostModel` of stage times and a `Link`) → `Simulation` (time line, makespan, bubble) |
//! | [`runtime`] | `Pipeline` (a model spread over devices: `step`, `evaluate`, and, written in `runtime/placement.rs`, `replan`, `freeze_prefix`, `gather`, `parameter_tensors` for an export), `Fault`, `PipelineStep` |
//! | [`trace`] | `StepTrace` (per-action times, measured bubble), `ChromeTrace` (Perfetto/chrome://tracing JSON) |

pub mod partition;
pub mod plan;
pub mod profile;
pub mod runtime;
pub mod schedule;
pub mod simulate;
pub mod trace;

pub use partition::{Partition, Recompute, partition};
pub use plan::{AutoSliced, PipelineConfig, Plan};
pub use profile::{UnitProfile, profile_units, samples_per_micro_batch, unit_profiles, unit_profiles_per_sample};
pub use runtime::{EvalOutput, Fault, Pipeline, PipelineStep, StepOptions};
pub use schedule::{Action, MessageKey, Piece, Schedule, ScheduleKind};
pub use simulate::{CostModel, Link, Simulation, simulate};
