//! Pipeline parallelism: what runs where and when.
//!
//! | module | defines |
//! |---|---|
//! | [`partition`] | `partition` (exact min-max split of the units under a memory limit), `UnitProfile`, `Partition` |
//! | [`schedule`] | the schedule IR (`Action`, `Schedule`), the GPipe / 1F1B / interleaved generators, the validator |

pub mod partition;
pub mod schedule;

pub use partition::{Partition, UnitProfile, partition};
pub use schedule::{Action, Schedule, ScheduleKind};
