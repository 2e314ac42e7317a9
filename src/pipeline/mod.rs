//! Pipeline parallelism: what runs where and when.
//!
//! | module | defines |
//! |---|---|
//! | [`partition`] | `partition` (exact min-max split of the units under a memory limit), `UnitProfile`, `Partition` |
//! | [`plan`] | `PipelineConfig` (K, R, M, schedule, chunks, memory limit), `Plan` (checked, printable) |
//! | [`trace`] | `StepTrace` (per-action times, measured bubble), `ChromeTrace` (Perfetto/chrome://tracing JSON) |
//! | [`runtime`] | `Pipeline` (a model spread over devices: `step`, `replan`, `gather`), `Fault`, `PipelineStep` |
//! | [`schedule`] | the schedule IR (`Action`, `Schedule`), the GPipe / 1F1B / interleaved generators, the validator |

pub mod partition;
pub mod plan;
pub mod runtime;
pub mod schedule;
pub mod trace;

pub use partition::{Partition, UnitProfile, partition};
pub use plan::{PipelineConfig, Plan};
pub use runtime::{Fault, Pipeline, PipelineStep};
pub use schedule::{Action, Schedule, ScheduleKind};
