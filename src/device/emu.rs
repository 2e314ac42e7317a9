//! The `cuda-emu` backend's [`Runtime`]: `kernels/*.cu` compiled for the host by `build.rs`
//! (with `kernels/emu/cuda_emu.h`, which emulates our CUDA subset: fibers for the threads of a
//! block, barriers, warp collectives, shared memory, atomics, wmma, bf16) into a shared library
//! loaded here. "Device memory" is host memory from `posix_memalign`, so the AddressSanitizer
//! build of the library (loaded instead when `PT_EMU_LIBRARY` names it) sees every
//! out-of-bounds access.
//!
//! A launch goes through the same [`GpuDevice`] code as on a real GPU. What a machine without
//! one leaves untested: the device compiler, and the races the emulator cannot show (see
//! `cuda_emu.h`: a fiber runs until a barrier or a warp collective, so a plain `+=` by many
//! threads loses no update).

use crate::device::gpu::{DevPtr, GpuDevice, LaunchConfig, Precision, Runtime};
use crate::error::{Error, Result};
use std::ffi::{CStr, CString, c_char, c_void};
use std::sync::{Arc, OnceLock};

/// The emulated kernels library built by `build.rs`.
pub const LIBRARY: &str = env!("PT_EMU_LIB");
/// The same library built with `-fsanitize=address` (load it with libasan preloaded).
pub const LIBRARY_ASAN: &str = env!("PT_EMU_LIB_ASAN");

type LaunchFn = unsafe extern "C" fn(
    *const c_char,
    u32,
    u32,
    u32,
    u32,
    u32,
    u32,
    u32,
    u64,
    u32,
    *mut *mut c_void,
    *mut c_char,
    usize,
) -> i32;
type CountFn = unsafe extern "C" fn() -> usize;
type NameFn = unsafe extern "C" fn(usize) -> *const c_char;

/// The loaded library and its entry points (loaded once per process).
struct Library {
    _lib: libloading::Library,
    launch: LaunchFn,
    count: CountFn,
    name: NameFn,
}

fn library() -> Result<&'static Library> {
    static LIB: OnceLock<std::result::Result<Library, String>> = OnceLock::new();
    LIB.get_or_init(|| {
        // `PT_EMU_LIBRARY`, not `PT_EMU_LIB`: cargo sets the latter (the build-time path) in the
        // environment of every test it runs.
        // (Empty is unset: `dlopen("")` would load the program itself.)
        let path =
            std::env::var("PT_EMU_LIBRARY").ok().filter(|p| !p.is_empty()).unwrap_or_else(|| LIBRARY.to_string());
        // SAFETY: the library is ours (built by build.rs); its initialisers only register kernels.
        unsafe {
            let lib = libloading::Library::new(&path).map_err(|e| format!("cannot load {path}: {e}"))?;
            let sym = |name: &[u8]| -> std::result::Result<*const c_void, String> {
                lib.get::<*const c_void>(name)
                    .map(|s| *s)
                    .map_err(|e| format!("{path}: missing `{}`: {e}", String::from_utf8_lossy(name)))
            };
            Ok(Library {
                launch: std::mem::transmute::<*const c_void, LaunchFn>(sym(b"pt_emu_launch")?),
                count: std::mem::transmute::<*const c_void, CountFn>(sym(b"pt_emu_kernel_count")?),
                name: std::mem::transmute::<*const c_void, NameFn>(sym(b"pt_emu_kernel_name")?),
                _lib: lib,
            })
        }
    })
    .as_ref()
    .map_err(|e| Error::Device { what: "cuda-emu".into(), message: e.clone() })
}

/// Names of every kernel in the emulated library, in registration order.
pub fn kernel_names() -> Result<Vec<String>> {
    let lib = library()?;
    // SAFETY: the library returns static NUL-terminated names for indices below its count.
    Ok((0..unsafe { (lib.count)() })
        .map(|i| unsafe { CStr::from_ptr((lib.name)(i)) }.to_string_lossy().into_owned())
        .collect())
}

/// Runs kernels on the host. `seed` shuffles the order in which a launch's blocks run and in
/// which the threads of a block resume after every barrier, so a missing barrier, or a block
/// that reads what another writes, shows up as a wrong answer for some seed (seed 0: block
/// order, threads first come first served).
pub struct EmuRuntime {
    index: usize,
    seed: u64,
    /// OS threads that share one launch's blocks (at least one).
    threads: u32,
    lib: &'static Library,
}

impl EmuRuntime {
    /// Emulated device `index` whose block and thread order is drawn from `seed`; `threads`
    /// OS threads share one launch's blocks (0: one). Each device keeps its own count.
    pub fn new(index: usize, seed: u64, threads: usize) -> Result<Self> {
        let threads = threads.clamp(1, u32::MAX as usize) as u32;
        Ok(Self { index, seed, threads, lib: library()? })
    }
}

/// An emulated device: [`EmuRuntime`] under a [`GpuDevice`], with fresh buffers NaN-poisoned.
pub fn device(index: usize, precision: Precision, seed: u64) -> Result<GpuDevice> {
    Ok(GpuDevice::new(Arc::new(EmuRuntime::new(index, seed, 1)?), precision, true))
}

impl Runtime for EmuRuntime {
    fn name(&self) -> String {
        format!(
            "cuda-emu:{} (seed {}, {})",
            self.index,
            self.seed,
            crate::error::counted(self.threads as usize, "thread")
        )
    }
    fn alloc(&self, bytes: usize) -> Result<DevPtr> {
        // 256-byte aligned like `cudaMalloc` (wmma loads need 32), and exactly `bytes` long, so
        // AddressSanitizer's redzone starts right after the last element.
        let mut p: *mut c_void = std::ptr::null_mut();
        // SAFETY: `p` is written on success; the alignment is a power of two and a multiple of
        // the pointer size.
        let rc = unsafe { posix_memalign(&mut p, 256, bytes.max(1)) };
        if rc != 0 || p.is_null() {
            return Err(Error::Device {
                what: "cuda-emu".into(),
                message: format!("out of memory allocating {bytes} bytes"),
            });
        }
        Ok(p as DevPtr)
    }
    unsafe fn free(&self, ptr: DevPtr, _bytes: usize) {
        // SAFETY: the caller guarantees `ptr` came from `alloc`.
        unsafe { libc_free(ptr as *mut c_void) }
    }
    fn copy_to_device(&self, dst: DevPtr, src: &[u8]) -> Result<()> {
        // SAFETY: `dst` is an allocation of at least `src.len()` bytes (checked by the caller).
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), dst as *mut u8, src.len()) };
        Ok(())
    }
    fn copy_to_host(&self, dst: &mut [u8], src: DevPtr) -> Result<()> {
        // SAFETY: as above.
        unsafe { std::ptr::copy_nonoverlapping(src as *const u8, dst.as_mut_ptr(), dst.len()) };
        Ok(())
    }
    fn copy_on_device(&self, dst: DevPtr, src: DevPtr, bytes: usize) -> Result<()> {
        // SAFETY: both are allocations of at least `bytes` bytes; `copy` allows overlap.
        unsafe { std::ptr::copy(src as *const u8, dst as *mut u8, bytes) };
        Ok(())
    }
    fn launch(&self, kernel: &str, cfg: &LaunchConfig, params: &mut [*mut c_void]) -> Result<()> {
        // Refuse what an A100 would, so a launch that passes here runs on every target GPU.
        super::gpu::runtime::LaunchLimits::SM80.check(kernel, cfg)?;
        let name = CString::new(kernel)
            .map_err(|_| Error::Device { what: kernel.into(), message: "bad kernel name".into() })?;
        let mut err = vec![0 as c_char; 512];
        let (g, b) = (cfg.grid, cfg.block);
        // SAFETY: `params` points at live argument values laid out as the kernel declares them
        // (the launch code in `device::gpu::ops` is the contract, shared with the cuda backend).
        let rc = unsafe {
            (self.lib.launch)(
                name.as_ptr(),
                g.0,
                g.1,
                g.2,
                b.0,
                b.1,
                b.2,
                cfg.shared_bytes,
                self.seed,
                self.threads,
                params.as_mut_ptr(),
                err.as_mut_ptr(),
                err.len(),
            )
        };
        if rc == 0 {
            Ok(())
        } else {
            // SAFETY: the library NUL-terminates its message within `err`.
            let msg = unsafe { CStr::from_ptr(err.as_ptr()) }.to_string_lossy().into_owned();
            Err(Error::Device { what: format!("cuda-emu launch of `{kernel}`"), message: msg })
        }
    }
    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
    fn synchronize(&self) -> Result<()> {
        Ok(())
    }
}

unsafe extern "C" {
    fn posix_memalign(out: *mut *mut c_void, align: usize, size: usize) -> i32;
    #[link_name = "free"]
    fn libc_free(p: *mut c_void);
}
