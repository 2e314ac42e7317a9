//! Running a configured training job: the TOML configuration and its overrides, the data
//! sources, the job that builds and drives everything, its progress lines and its report.

pub mod config;
pub mod job;
pub mod predict;
pub mod progress;
pub mod report;
pub mod source;

pub use config::{DataSection, DatasetName, ModelSection, OutputSection, PipelineSection, RunConfig};
pub use job::{DataInfo, Job, Summary, build_model, prepare_data, unigram_loss};
pub use predict::{ClassPrediction, Predictor, Sampling};
pub use progress::ProgressLines;
pub use source::{SampleSource, subset};

use crate::device::{AnyDevices, DeviceKind, Precision};

/// Opens the `count` devices of a run: GPUs as `kind` says, or `count` cpu devices that share
/// the machine's cores (`threads` in all; 0: every core), so the devices together use the
/// machine once.
pub fn open_devices(kind: DeviceKind, count: usize, threads: usize, precision: Precision) -> crate::Result<AnyDevices> {
    let cores = if threads == 0 { std::thread::available_parallelism().map_or(1, |n| n.get()) } else { threads };
    let per_device = (cores / count.max(1)).max(1);
    AnyDevices::open(kind, count.max(1), per_device, precision)
}
