//! The raw layer under [`GpuDevice`](super::GpuDevice): device memory and kernel launches.
//! Two implementations share every line of launch code above them: [`cuda`](crate::device::cuda)
//! (cudarc's driver API, kernels compiled by NVRTC) and [`emu`](crate::device::emu) (the same
//! `kernels/*.cu` compiled for the host, DESIGN.md §3).

use crate::error::Result;
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
