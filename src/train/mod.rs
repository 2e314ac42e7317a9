//! A training run over a pipeline: the epoch loop, evaluation, events, checkpoints, and the
//! [`Controller`] hook through which the elastic layer steers between steps.
//!
//! | module | defines |
//! |---|---|
//! | [`config`] | `TrainConfig` (epochs, learning rate and its schedule's shape, optimizer, clipping, seed) |
//! | [`source`] | `BatchSource` (training batch `(epoch, index)`, evaluation batches) |
//! | [`event`] | `Event` (step, epoch, transition, cache), `EvalMetrics`, `Bubble`, `Transition` |
//! | [`metrics`] | `Confusion` (accuracy, per-class precision/recall/F1, macro F1), `argmax` |
//! | [`trainer`] | `Trainer` (fit, evaluate, checkpoints), `Position`, `Controller` and what it `Prepared` a step for |
//! | [`checkpoint`] | the checkpoint file: named tensors + JSON header, hashed, written atomically |
//! | [`selection`] | `KeepBest` (the metric a run keeps its best weights by), `Selection` (the best evaluation, early stopping's patience) |
//! | [`stop`] | `request_stop` (a signal's request to end after the step under way), `stop_requested`, `clear_stop` |

pub mod checkpoint;
pub mod config;
pub mod event;
pub mod metrics;
pub mod selection;
pub mod source;
pub mod stop;
pub mod trainer;

pub use config::TrainConfig;
pub use event::{Bubble, EvalMetrics, Event, Transition};
pub use metrics::{ClassScores, Confusion};
pub use selection::{KeepBest, Scored, Selection};
pub use source::BatchSource;
pub use stop::{clear_stop, request_stop, stop_requested};
pub use trainer::{Controller, Position, Prepared, RecordedPlan, Restored, Snapshot, Trainer};
