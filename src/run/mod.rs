//! Running a configured training job: the TOML configuration and its overrides, the data
//! sources, the job that builds and drives everything, its progress lines and its report.

pub mod config;
mod data_setup;
mod duplicate_key;
mod fingerprint;
pub mod job;
pub mod launch;
mod metrics_log;
mod model_setup;
mod output_dir;
pub mod overfit;
mod planning;
pub mod predict;
pub mod progress;
pub mod report;
pub mod source;

pub use config::{DataSection, DatasetName, ModelSection, OutputSection, PipelineSection, RunConfig};
pub use data_setup::{DataInfo, TokenizerIds, prepare_data, unigram_loss};
pub use job::{Job, Resumed, ResumedPlan, Summary, check_across_processes};
pub use launch::{LaunchOptions, ProcessEnv, launch};
pub use model_setup::build_model;
pub use output_dir::{PER_NODE_SETTINGS, check_start, checkpoint_path, start_over_note, trace_in_the_way};
pub use planning::{PlannedSlicing, SlicingOrigin};
pub use predict::{ClassPrediction, Generation, LabelledRows, Predictor, Sampling};
pub use progress::ProgressLines;
pub use source::{Augment, SampleSource, subset};

use crate::device::{AnyDevice, AnyDevices, CpuDevice, DeviceKind, HostPool, Precision};

/// Opens the `count` devices of a run: GPUs as `kind` says, or `count` cpu devices that share
/// the machine's cores (`threads` in all; 0, or more than the cores: every core), so the
/// devices together use the machine once. The cpu devices compute on one pool of those threads (at least one per
/// device), each reckoned by the planner at its even share ([`crate::device::HostPool`]).
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
    let cores = crate::device::usable_threads(threads);
    let count = count.max(1);
    let per_device = (cores / count).max(1);
    let indices = first..first + count;
    if kind.resolve() == DeviceKind::Cpu {
        let pool = HostPool::shared("cpu", cores.max(count))?;
        return indices
            .map(|i| CpuDevice::sharing(i, pool.clone(), per_device, precision))
            .collect::<crate::Result<_>>()
            .map(AnyDevices::Cpu);
    }
    let mut gpus = Vec::new();
    for i in indices {
        match open_device(kind, i, per_device, precision)? {
            AnyDevice::Gpu(d) => gpus.push(d),
            AnyDevice::Cpu(_) => {
                return Err(crate::error::internal("devices", format!("{kind:?} opened a cpu device")));
            }
        }
    }
    Ok(AnyDevices::Gpu(gpus))
}

/// [`AnyDevice::open`] for the command line: a backend that cannot open is named as the flag
/// that chose it (`--device`).
pub fn open_device(kind: DeviceKind, index: usize, threads: usize, precision: Precision) -> crate::Result<AnyDevice> {
    AnyDevice::open(kind, index, threads, precision).map_err(|e| match e {
        crate::Error::Config { field, message } if field == "device" => {
            crate::Error::Config { field: "--device".into(), message }
        }
        e => e,
    })
}

/// Has the C allocator keep the large buffers a training process frees and reuse them, instead
/// of handing each back to the kernel and taking fresh zeroed pages for the next: glibc serves
/// any request over 32 MiB by its own `mmap` and unmaps it when freed, so every checkpoint's
/// snapshot (the weights and optimizer state, 270 MB for MiniLM) faulted its pages in anew.
/// The price is a process that keeps its peak heap after a free. A no-op off glibc.
pub fn keep_freed_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        // SAFETY: `mallopt` only changes the allocator's tunables; called before the threads.
        unsafe {
            libc::mallopt(libc::M_MMAP_THRESHOLD, 1 << 30);
            libc::mallopt(libc::M_TRIM_THRESHOLD, i32::MAX);
        }
    }
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
        // Never more threads than cores: the pool's workers spin while they wait.
        let cores = crate::device::usable_threads(0);
        assert_eq!(threads(2, 2), [1, 1]);
        assert_eq!(threads(2, 4), vec![(cores.min(4) / 2).max(1); 2]);
        assert_eq!(threads(1, 1000), [cores]);
        assert_eq!(threads(1, 2), [cores.min(2)]);
        assert_eq!(threads(3, 2), [1, 1, 1], "never fewer than one");
    }
}
