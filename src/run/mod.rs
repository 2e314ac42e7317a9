//! Running a configured training job: the TOML configuration and its overrides, the data
//! sources, the job that builds and drives everything, its progress lines and its report.

pub mod config;
pub mod job;
pub mod launch;
pub mod predict;
pub mod progress;
pub mod report;
pub mod source;

pub use config::{DataSection, DatasetName, ModelSection, OutputSection, PipelineSection, RunConfig};
pub use job::{DataInfo, Job, Summary, build_model, prepare_data, unigram_loss};
pub use launch::{LaunchOptions, ProcessEnv, launch};
pub use predict::{ClassPrediction, Predictor, Sampling};
pub use progress::ProgressLines;
pub use source::{SampleSource, subset};

use crate::device::{AnyDevices, DeviceKind, Precision};

/// Opens the `count` devices of a run: GPUs as `kind` says, or `count` cpu devices that share
/// the machine's cores (`threads` in all; 0: every core), so the devices together use the
/// machine once.
pub fn open_devices(kind: DeviceKind, count: usize, threads: usize, precision: Precision) -> crate::Result<AnyDevices> {
    open_devices_at(kind, 0, count, threads, precision)
}

/// [`open_devices`] from device number `first` on (a launched process's own GPUs).
pub fn open_devices_at(
    kind: DeviceKind,
    first: usize,
    count: usize,
    threads: usize,
    precision: Precision,
) -> crate::Result<AnyDevices> {
    let cores = if threads == 0 { std::thread::available_parallelism().map_or(1, |n| n.get()) } else { threads };
    let per_device = (cores / count.max(1)).max(1);
    let mut cpus = Vec::new();
    let mut gpus = Vec::new();
    for i in first..first + count.max(1) {
        match crate::device::AnyDevice::open(kind, i, per_device, precision)? {
            crate::device::AnyDevice::Cpu(d) => cpus.push(d),
            crate::device::AnyDevice::Gpu(d) => gpus.push(d),
        }
    }
    Ok(if gpus.is_empty() { AnyDevices::Cpu(cpus) } else { AnyDevices::Gpu(gpus) })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// cpu devices share the threads they are given: two devices on two threads get one each,
    /// not a pool of two each (which would run four threads on two cores).
    #[test]
    fn cpu_devices_split_the_threads_instead_of_each_taking_all() {
        let threads = |count: usize, threads: usize| match open_devices(DeviceKind::Cpu, count, threads, Precision::F32)
        {
            Ok(AnyDevices::Cpu(d)) => {
                d.iter().map(|d| crate::device::Device::threads(d).unwrap_or(0)).collect::<Vec<_>>()
            }
            _ => panic!("cpu devices expected"),
        };
        assert_eq!(threads(2, 2), [1, 1]);
        assert_eq!(threads(2, 4), [2, 2]);
        assert_eq!(threads(1, 2), [2]);
        assert_eq!(threads(3, 2), [1, 1, 1], "never fewer than one");
    }
}
