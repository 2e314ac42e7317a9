//! The `cuda` backend's [`Runtime`]: cudarc's driver API on one GPU. Kernels are compiled by
//! NVRTC on first use ([`kernels::compile_ptx`], cached on disk), one module per kernel file,
//! loaded into the device's context; launches are `cuLaunchKernel` on the device's compute
//! stream with the argument array built by the shared launch code.
//!
//! Uploads run on a second stream, from pinned staging buffers, ordered by events: a copy waits
//! only for the work queued before it (its destination may be a recycled buffer that a queued
//! kernel still reads), later kernels wait for the copy, and the host returns at once. So the
//! next batch's ids and masks cross the bus while the current step computes.
//!
//! cudarc loads `libcuda` dynamically and panics when it is absent, so every entry point checks
//! [`available`] first and turns its absence into an error.

use crate::device::gpu::runtime::{LaunchLimits, needs_shared_opt_in};
use crate::device::gpu::{DevPtr, GpuDevice, LaunchConfig, Precision, Runtime};
use crate::device::kernels;
use crate::error::{Error, Result, counted};
use cudarc::driver::{CudaContext, CudaEvent, CudaFunction, CudaModule, CudaStream, PinnedHostSlice, result, sys};
use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::{Arc, Mutex};

fn driver_error(what: &str) -> impl Fn(result::DriverError) -> Error + '_ {
    move |e| Error::Device { what: format!("cuda: {what}"), message: e.to_string() }
}

/// Whether a CUDA driver is installed and sees at least one GPU.
pub fn available() -> bool {
    device_count() > 0
}

/// GPUs the driver sees (0 without a driver).
pub fn device_count() -> usize {
    // SAFETY: checks for the library without loading symbols from it.
    if !unsafe { sys::is_culib_present() } {
        return 0;
    }
    CudaContext::device_count().map(|n| n.max(0) as usize).unwrap_or(0)
}

/// The environment variable that lets a run have more `cuda` devices than the machine has
/// GPUs: with `PT_SHARE_GPUS=1` device `i` runs on GPU `i mod count`, on streams of its own, so
/// a pipeline's plan, schedule and measured bubble can be tried on one GPU. Nothing runs faster
/// for it, and NCCL (which refuses two ranks on one GPU) gives way to the host ring.
pub const SHARE_GPUS: &str = "PT_SHARE_GPUS";

/// The GPU that device `index` runs on when the driver sees `count` GPUs: its own, or with
/// `share` ([`SHARE_GPUS`]) the one it wraps around to.
fn gpu_for(index: usize, count: usize, share: bool) -> Result<usize> {
    match count {
        0 => Err(Error::Config { field: "device".into(), message: "the CUDA driver sees no GPU".into() }),
        _ if index < count => Ok(index),
        _ if share => Ok(index % count),
        _ => Err(Error::Config {
            field: "device".into(),
            message: format!(
                "cuda:{index} requested but the CUDA driver sees {}; {SHARE_GPUS}=1 runs several devices on one \
                 GPU, each on streams of its own (to try a plan, not for speed)",
                counted(count, "GPU")
            ),
        }),
    }
}

/// [`SHARE_GPUS`]'s value read: unset, empty or `0` is off, `1` on; anything else is refused
/// rather than taken for off.
fn sharing(value: Option<&str>) -> Result<bool> {
    match value {
        None | Some("" | "0") => Ok(false),
        Some("1") => Ok(true),
        Some(other) => Err(Error::Config {
            field: SHARE_GPUS.into(),
            message: format!("is `{other}`; expected 1 (several devices on one GPU) or 0"),
        }),
    }
}

/// Pinned staging buffers: those whose upload may still be running (with the event that marks
/// its end), and those free for reuse.
#[derive(Default)]
struct Staging {
    in_flight: Vec<(CudaEvent, PinnedHostSlice<u8>)>,
    free: Vec<PinnedHostSlice<u8>>,
}

/// One GPU: its context, the stream every kernel is queued on, the upload stream, and the
/// kernels loaded so far.
pub struct CudaRuntime {
    /// The device's index in the run (`cuda:<index>`): the GPU's ordinal, unless
    /// [`SHARE_GPUS`] put it on another device's GPU.
    index: usize,
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    copy_stream: Arc<CudaStream>,
    staging: Mutex<Staging>,
    arch: u32,
    /// What this GPU accepts in a launch (read from the driver).
    limits: LaunchLimits,
    modules: Mutex<HashMap<&'static str, Arc<CudaModule>>>,
    functions: Mutex<HashMap<String, CudaFunction>>,
}

impl CudaRuntime {
    /// GPU `ordinal`; an error (not a panic) when there is no driver or no such GPU.
    pub fn new(ordinal: usize) -> Result<Self> {
        // SAFETY: checks for the library without loading symbols from it.
        if !unsafe { sys::is_culib_present() } {
            return Err(Error::Config {
                field: "device".into(),
                message: "no CUDA driver (libcuda) on this machine; use --device cpu or --device cuda-emu".into(),
            });
        }
        let share = sharing(std::env::var(SHARE_GPUS).ok().as_deref())?;
        let gpu = gpu_for(ordinal, device_count(), share)?;
        let ctx = CudaContext::new(gpu).map_err(driver_error("context"))?;
        let (major, minor) = ctx.compute_capability().map_err(driver_error("compute capability"))?;
        let stream = ctx.new_stream().map_err(driver_error("stream"))?;
        let copy_stream = ctx.new_stream().map_err(driver_error("copy stream"))?;
        let limit = |a: sys::CUdevice_attribute| -> Result<u32> {
            Ok(ctx.attribute(a).map_err(driver_error("device limits"))? as u32)
        };
        use sys::CUdevice_attribute as A;
        let limits = LaunchLimits {
            max_threads: limit(A::CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_BLOCK)?,
            max_block: (
                limit(A::CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_X)?,
                limit(A::CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_Y)?,
                limit(A::CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_Z)?,
            ),
            max_grid: (
                limit(A::CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_X)?,
                limit(A::CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_Y)?,
                limit(A::CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_Z)?,
            ),
            max_shared_optin: limit(A::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)?,
        };
        Ok(Self {
            index: ordinal,
            limits,
            ctx,
            stream,
            copy_stream,
            staging: Mutex::new(Staging::default()),
            arch: (major * 10 + minor) as u32,
            modules: Mutex::new(HashMap::new()),
            functions: Mutex::new(HashMap::new()),
        })
    }

    /// The stream every op of this device is queued on (for libraries sharing it, e.g. cuBLAS
    /// in the benchmarks).
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// A new stream on this GPU (NCCL's collectives run on one of their own).
    pub fn new_stream(&self) -> Result<Arc<CudaStream>> {
        self.ctx.new_stream().map_err(driver_error("stream"))
    }

    /// The GPU's ordinal.
    pub fn ordinal(&self) -> usize {
        self.ctx.ordinal()
    }

    /// Whether [`SHARE_GPUS`] put this device on a GPU that is another index's own (device
    /// `i` past the GPU count, on GPU `i mod count`). Device `cuda:0` of a shared GPU is not.
    pub fn borrows_gpu(&self) -> bool {
        self.index != self.ctx.ordinal()
    }

    /// Makes this GPU's context current on the calling thread.
    pub fn bind(&self) -> Result<()> {
        self.ctx.bind_to_thread().map_err(driver_error("bind"))
    }

    /// The GPU's marketing name, e.g. `NVIDIA H100 80GB HBM3`.
    pub fn name_string(&self) -> String {
        self.ctx.name().unwrap_or_else(|_| "GPU".into())
    }

    /// The compute capability as `major·10 + minor`.
    pub fn arch(&self) -> u32 {
        self.arch
    }

    /// The loaded function `kernel`, compiling and loading its file's module on first use.
    fn function(&self, kernel: &str) -> Result<CudaFunction> {
        if let Some(f) = self.functions.lock().unwrap_or_else(|e| e.into_inner()).get(kernel) {
            return Ok(f.clone());
        }
        let file = kernels::file_of(kernel)?;
        let module = {
            let mut modules = self.modules.lock().unwrap_or_else(|e| e.into_inner());
            match modules.get(file) {
                Some(m) => m.clone(),
                None => {
                    let m = if kernels::load_ptx()? {
                        let ptx = kernels::compile_ptx(file, self.arch)?;
                        self.ctx
                            .load_module(cudarc::nvrtc::Ptx::from_src(ptx))
                            .map_err(driver_error("loading PTX (PT_KERNELS=ptx; the driver may be older than NVRTC)"))?
                    } else {
                        let cubin = kernels::compile_cubin(file, self.arch)?;
                        self.ctx
                            .load_module(cudarc::nvrtc::Ptx::from_binary(cubin))
                            .map_err(driver_error("loading the cubin"))?
                    };
                    modules.insert(file, m.clone());
                    m
                }
            }
        };
        let f = module.load_function(kernel).map_err(driver_error(kernel))?;
        self.functions.lock().unwrap_or_else(|e| e.into_inner()).insert(kernel.to_string(), f.clone());
        Ok(f)
    }
}

/// The CUDA runtime under `dev`, if `dev` is a `cuda` device (not `cuda-emu`).
pub fn runtime_of(dev: &GpuDevice) -> Option<&CudaRuntime> {
    dev.runtime().as_any().downcast_ref::<CudaRuntime>()
}

/// GPU `ordinal` as a [`GpuDevice`] computing in `precision`.
pub fn device(ordinal: usize, precision: Precision) -> Result<GpuDevice> {
    let rt = CudaRuntime::new(ordinal)?;
    if precision == Precision::Bf16 && rt.arch < 80 {
        return Err(Error::Device {
            what: format!("cuda:{ordinal}"),
            message: format!(
                "bf16 needs bf16 tensor cores (sm_80 or newer); this GPU is sm_{}: use --precision f32",
                rt.arch
            ),
        });
    }
    Ok(GpuDevice::new(Arc::new(rt), precision, false))
}

impl Runtime for CudaRuntime {
    fn name(&self) -> String {
        let name = self.ctx.name().unwrap_or_else(|_| "GPU".into());
        match self.ctx.ordinal() {
            gpu if gpu == self.index => format!("cuda:{gpu} ({name}, sm_{})", self.arch),
            gpu => format!("cuda:{} (on GPU {gpu}, shared, {name}, sm_{})", self.index, self.arch),
        }
    }
    fn alloc(&self, bytes: usize) -> Result<DevPtr> {
        self.ctx.bind_to_thread().map_err(driver_error("bind"))?;
        // SAFETY: the stream belongs to this context; the memory is freed through `free`.
        unsafe { result::malloc_async(self.stream.cu_stream(), bytes) }.map_err(driver_error("alloc"))
    }
    unsafe fn free(&self, ptr: DevPtr, _bytes: usize) {
        // SAFETY: the caller passes memory from `alloc`; freeing on the stream orders it after
        // every kernel already queued that reads it.
        let _ = self.ctx.bind_to_thread();
        let _ = unsafe { result::free_async(ptr, self.stream.cu_stream()) };
    }
    fn copy_to_device(&self, dst: DevPtr, src: &[u8]) -> Result<()> {
        self.ctx.bind_to_thread().map_err(driver_error("bind"))?;
        let mut staging = self.staging.lock().unwrap_or_else(|e| e.into_inner());
        // Staging buffers whose copy has finished are free again.
        let (done, running): (Vec<_>, Vec<_>) =
            std::mem::take(&mut staging.in_flight).into_iter().partition(|(event, _)| event.is_complete());
        staging.in_flight = running;
        staging.free.extend(done.into_iter().map(|(_, buf)| buf));
        let mut buf = match staging.free.iter().position(|b| b.len() >= src.len()) {
            Some(i) => staging.free.swap_remove(i),
            // SAFETY: the contents are written below before any copy reads them.
            None => unsafe { self.ctx.alloc_pinned::<u8>(src.len()) }.map_err(driver_error("pinned staging"))?,
        };
        buf.as_mut_slice().map_err(driver_error("staging"))?[..src.len()].copy_from_slice(src);
        self.copy_stream.join(&self.stream).map_err(driver_error("order the upload"))?;
        let staged = &buf.as_slice().map_err(driver_error("staging"))?[..src.len()];
        // SAFETY: `dst` holds at least `src.len()` bytes; `buf` outlives the copy (it is kept in
        // `in_flight` until the event recorded after the copy completes).
        unsafe { result::memcpy_htod_async(dst, staged, self.copy_stream.cu_stream()) }
            .map_err(driver_error("copy to device"))?;
        self.stream.join(&self.copy_stream).map_err(driver_error("order the kernels after the upload"))?;
        let event = self.copy_stream.record_event(None).map_err(driver_error("event"))?;
        staging.in_flight.push((event, buf));
        Ok(())
    }
    fn copy_to_host(&self, dst: &mut [u8], src: DevPtr) -> Result<()> {
        self.ctx.bind_to_thread().map_err(driver_error("bind"))?;
        self.stream.synchronize().map_err(driver_error("synchronize"))?;
        // SAFETY: `src` holds at least `dst.len()` bytes.
        unsafe { result::memcpy_dtoh_sync(dst, src) }.map_err(driver_error("copy to host"))
    }
    fn copy_on_device(&self, dst: DevPtr, src: DevPtr, bytes: usize) -> Result<()> {
        self.ctx.bind_to_thread().map_err(driver_error("bind"))?;
        // SAFETY: both hold at least `bytes` bytes; queued in order with the kernels.
        unsafe { result::memcpy_dtod_async(dst, src, bytes, self.stream.cu_stream()) }
            .map_err(driver_error("copy on device"))
    }
    fn launch(&self, kernel: &str, cfg: &LaunchConfig, params: &mut [*mut c_void]) -> Result<()> {
        self.limits.check(kernel, cfg)?;
        let f = self.function(kernel)?;
        self.ctx.bind_to_thread().map_err(driver_error("bind"))?;
        if cfg.shared_bytes > 0
            && needs_shared_opt_in(
                f.shared_size_bytes().map_err(driver_error("static shared size"))? as u32,
                cfg.shared_bytes,
            )
        {
            // Beyond 48 KiB, static and dynamic together, a kernel must opt in (LayerNorm's
            // backward from hidden size 6081).
            let attr = cudarc::driver::sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES;
            f.set_attribute(attr, cfg.shared_bytes as i32).map_err(driver_error("opt into more shared memory"))?;
        }
        // SAFETY: `params` matches the kernel's C signature (the shared launch code is the
        // contract, and the emulator runs the same argument arrays under AddressSanitizer).
        unsafe {
            result::launch_kernel(
                f.cu_function(),
                cfg.grid,
                cfg.block,
                cfg.shared_bytes,
                self.stream.cu_stream(),
                params,
            )
        }
        .map_err(driver_error(kernel))
    }
    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
    fn synchronize(&self) -> Result<()> {
        self.copy_stream.synchronize().map_err(driver_error("synchronize uploads"))?;
        self.stream.synchronize().map_err(driver_error("synchronize"))
    }
    fn marker(&self) -> Result<crate::device::Marker> {
        // Timing on (cudarc's default event disables it).
        let flags = cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT;
        let event = self.stream.record_event(Some(flags)).map_err(driver_error("record a timing event"))?;
        Ok(crate::device::Marker::Event(std::sync::Arc::new(event)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Devices past the GPU count are refused, naming the way to share, unless sharing is on;
    /// then they wrap around the GPUs in order.
    #[test]
    fn devices_past_the_gpus_share_them_only_when_asked() {
        assert_eq!(gpu_for(1, 2, false).unwrap(), 1);
        let refused = gpu_for(2, 2, false).unwrap_err().to_string();
        assert!(refused.contains("cuda:2") && refused.contains("2 GPUs") && refused.contains(SHARE_GPUS), "{refused}");
        assert_eq!((0..5).map(|i| gpu_for(i, 2, true).unwrap()).collect::<Vec<_>>(), [0, 1, 0, 1, 0]);
        assert!(gpu_for(0, 0, true).is_err(), "no GPU to share");
    }

    /// The variable is on only at `1`; a value that is neither on nor off is named back.
    #[test]
    fn sharing_is_on_at_1_and_refuses_other_words() {
        assert!(!sharing(None).unwrap() && !sharing(Some("")).unwrap() && !sharing(Some("0")).unwrap());
        assert!(sharing(Some("1")).unwrap());
        let refused = sharing(Some("yes")).unwrap_err().to_string();
        assert!(
            refused.contains("PT_SHARE_GPUS") && refused.contains("`yes`") && refused.contains("expected 1"),
            "{refused}"
        );
    }
}
