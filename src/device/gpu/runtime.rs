//! The raw layer under [`GpuDevice`](super::GpuDevice): device memory and kernel launches.
//! Two implementations share every line of launch code above them: [`cuda`](crate::device::cuda)
//! (cudarc's driver API, kernels compiled by NVRTC) and [`emu`](crate::device::emu) (the same
//! `kernels/*.cu` compiled for the host, DESIGN.md §3).

use crate::error::{Error, Result};
use std::ffi::c_void;

/// A device address: a CUDA `CUdeviceptr`, or a host pointer on the emulator.
pub type DevPtr = u64;

/// Grid, block and dynamic shared memory of one launch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LaunchConfig {
    /// Blocks in x, y, z.
    pub grid: (u32, u32, u32),
    /// Threads per block in x, y, z.
    pub block: (u32, u32, u32),
    /// Bytes of dynamic shared memory per block.
    pub shared_bytes: u32,
}

impl LaunchConfig {
    /// A 1-D launch of `blocks` blocks of `threads` threads.
    pub fn linear(blocks: u32, threads: u32) -> Self {
        Self { grid: (blocks, 1, 1), block: (threads, 1, 1), shared_bytes: 0 }
    }
    /// Enough blocks of `threads` threads to give every one of `n` elements its own thread
    /// (at least one block, so a launch over zero elements is still well formed).
    pub fn for_elems(n: usize, threads: u32) -> Self {
        Self::linear(n.div_ceil(threads as usize).max(1) as u32, threads)
    }
    /// The same launch with `bytes` of dynamic shared memory.
    pub fn with_shared(mut self, bytes: usize) -> Self {
        self.shared_bytes = bytes as u32;
        self
    }
}

/// One kernel argument, passed by value exactly as the kernel's C signature declares it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Arg {
    /// A device pointer (`T*` / `const T*`).
    Ptr(DevPtr),
    /// `int`.
    I32(i32),
    /// `unsigned int`.
    U32(u32),
    /// `unsigned long long`.
    U64(u64),
    /// `float`.
    F32(f32),
}

/// Dynamic shared memory a launch gets without asking: more needs the kernel's opt-in
/// (`cuFuncSetAttribute(MAX_DYNAMIC_SHARED_SIZE_BYTES)`), up to the GPU's limit.
pub const DEFAULT_SHARED_BYTES: u32 = 48 * 1024;

/// Whether a launch with `dynamic_bytes` of shared memory must opt in first, for a kernel whose
/// `__shared__` arrays take `static_bytes`: the default per-block limit counts both (LayerNorm's
/// backward at hidden size 6144 takes exactly 48 KiB dynamic, plus 512 bytes static).
pub fn needs_shared_opt_in(static_bytes: u32, dynamic_bytes: u32) -> bool {
    static_bytes + dynamic_bytes > DEFAULT_SHARED_BYTES
}

/// What a GPU accepts in one launch (`cuLaunchKernel` refuses the rest).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LaunchLimits {
    /// Threads per block (1024 on every GPU since sm_20).
    pub max_threads: u32,
    /// Block extents in x, y, z.
    pub max_block: (u32, u32, u32),
    /// Grid extents in x, y, z.
    pub max_grid: (u32, u32, u32),
    /// Dynamic shared memory per block after the opt-in (A100: 163 KiB, H100: 227 KiB).
    pub max_shared_optin: u32,
}

impl LaunchLimits {
    /// An A100's (sm_80), the smallest of the GPUs the kernels are checked for: what the
    /// emulator enforces, so a launch it accepts runs on every target GPU.
    pub const SM80: LaunchLimits = LaunchLimits {
        max_threads: 1024,
        max_block: (1024, 1024, 64),
        max_grid: (i32::MAX as u32, 65535, 65535),
        max_shared_optin: 166_912,
    };

    /// `Ok` when a GPU with these limits accepts `cfg` for `kernel`; else what it would refuse.
    pub fn check(&self, kernel: &str, cfg: &LaunchConfig) -> Result<()> {
        let (g, b) = (cfg.grid, cfg.block);
        let threads = u64::from(b.0) * u64::from(b.1) * u64::from(b.2);
        let refuse = |message: String| Err(Error::Device { what: format!("launch of {kernel}"), message });
        if threads == 0 || g.0 == 0 || g.1 == 0 || g.2 == 0 {
            return refuse(format!("empty launch: grid {g:?}, block {b:?}"));
        }
        if threads > u64::from(self.max_threads)
            || b.0 > self.max_block.0
            || b.1 > self.max_block.1
            || b.2 > self.max_block.2
        {
            return refuse(format!(
                "block {b:?} has {threads} threads; a GPU takes at most {} (and {:?})",
                self.max_threads, self.max_block
            ));
        }
        if g.0 > self.max_grid.0 || g.1 > self.max_grid.1 || g.2 > self.max_grid.2 {
            return refuse(format!("grid {g:?} exceeds {:?}", self.max_grid));
        }
        if cfg.shared_bytes > self.max_shared_optin {
            return refuse(format!(
                "{} bytes of dynamic shared memory; this GPU allows at most {} per block",
                cfg.shared_bytes, self.max_shared_optin
            ));
        }
        Ok(())
    }
}

/// Memory and launches of one device. Object safe so that a [`GpuDevice`](super::GpuDevice) is
/// one type whatever runs its kernels.
pub trait Runtime: Send + Sync + 'static {
    /// E.g. `cuda:0 (NVIDIA H100)` or `cuda-emu:0`.
    fn name(&self) -> String;
    /// `bytes` of device memory (contents unspecified).
    fn alloc(&self, bytes: usize) -> Result<DevPtr>;
    /// Returns memory from [`alloc`](Self::alloc).
    ///
    /// # Safety
    /// `ptr` came from this runtime's `alloc(bytes)` and is not used afterwards.
    unsafe fn free(&self, ptr: DevPtr, bytes: usize);
    /// Host → device.
    fn copy_to_device(&self, dst: DevPtr, src: &[u8]) -> Result<()>;
    /// Device → host (waits for queued work).
    fn copy_to_host(&self, dst: &mut [u8], src: DevPtr) -> Result<()>;
    /// Device → device, `bytes` bytes.
    fn copy_on_device(&self, dst: DevPtr, src: DevPtr, bytes: usize) -> Result<()>;
    /// Launches `kernel` with `params[i]` pointing at the i-th argument's value (the
    /// `cuLaunchKernel` convention, which the emulator follows too).
    fn launch(&self, kernel: &str, cfg: &LaunchConfig, params: &mut [*mut c_void]) -> Result<()>;
    /// Waits until queued work is done.
    fn synchronize(&self) -> Result<()>;
    /// A point in this runtime's queue ([`Marker`](crate::device::Marker)): the host clock where
    /// launches run before returning (the emulator), a CUDA event on a GPU.
    fn marker(&self) -> Result<crate::device::Marker> {
        Ok(crate::device::Marker::Host(std::time::Instant::now()))
    }
    /// The runtime as `Any`, so code that needs one backend's specifics (NCCL wants the CUDA
    /// stream) can ask for it.
    fn as_any(&self) -> &dyn std::any::Any;
}

/// Storage for argument values whose addresses go into the `params` array of a launch.
#[repr(C)]
#[derive(Clone, Copy)]
pub(crate) union ArgValue {
    u64: u64,
    i32: i32,
    u32: u32,
    f32: f32,
}

/// Launches `kernel` on `rt` with typed arguments.
pub(crate) fn launch(rt: &dyn Runtime, kernel: &str, cfg: &LaunchConfig, args: &[Arg]) -> Result<()> {
    let mut values: Vec<ArgValue> = args
        .iter()
        .map(|a| match *a {
            Arg::Ptr(p) | Arg::U64(p) => ArgValue { u64: p },
            Arg::I32(x) => ArgValue { i32: x },
            Arg::U32(x) => ArgValue { u32: x },
            Arg::F32(x) => ArgValue { f32: x },
        })
        .collect();
    let mut params: Vec<*mut c_void> = values.iter_mut().map(|v| v as *mut ArgValue as *mut c_void).collect();
    rt.launch(kernel, cfg, &mut params)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_opt_in_counts_static_shared_memory() {
        assert!(!needs_shared_opt_in(0, DEFAULT_SHARED_BYTES));
        assert!(needs_shared_opt_in(512, DEFAULT_SHARED_BYTES), "LayerNorm's backward at dim 6144");
        assert!(!needs_shared_opt_in(2048, 0));
    }

    #[test]
    fn launches_a_gpu_would_refuse_are_refused_by_name() {
        let l = LaunchLimits::SM80;
        let ok = LaunchConfig { grid: (70_000, 2, 1), block: (256, 4, 1), shared_bytes: 100 * 1024 };
        assert!(l.check("k", &ok).is_ok(), "over 48 KiB is fine: the launch opts in");
        for (cfg, says) in [
            (LaunchConfig { block: (1025, 1, 1), ..ok }, "1025 threads"),
            (LaunchConfig { block: (32, 32, 2), ..ok }, "2048 threads"),
            (LaunchConfig { block: (1, 1, 65), ..ok }, "threads"),
            (LaunchConfig { grid: (1, 65_536, 1), ..ok }, "grid"),
            (LaunchConfig { grid: (0, 1, 1), ..ok }, "empty launch"),
            (LaunchConfig { shared_bytes: 166_913, ..ok }, "166913 bytes of dynamic shared memory"),
        ] {
            let e = l.check("layernorm_backward", &cfg).unwrap_err().to_string();
            assert!(e.contains("layernorm_backward") && e.contains(says), "{e}");
        }
    }

    #[test]
    fn the_emulator_refuses_what_an_a100_would() {
        let emu = crate::device::emu::EmuRuntime::new(0, 0, 1).unwrap();
        let cfg = LaunchConfig { grid: (1, 1, 1), block: (2048, 1, 1), shared_bytes: 0 };
        let e = emu.launch("emu_test_wmma", &cfg, &mut []).unwrap_err().to_string();
        assert!(e.contains("2048 threads"), "{e}");
    }
}
