//! Pipeline parallelism: what runs where and when.
//!
//! | module | defines |
//! |---|---|
//! | [`schedule`] | the schedule IR (`Action`, `Schedule`), the GPipe / 1F1B / interleaved generators, the validator |

pub mod schedule;

pub use schedule::{Action, Schedule, ScheduleKind};
