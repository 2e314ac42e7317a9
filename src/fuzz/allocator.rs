//! The global allocator a fuzzing binary installs so that
//! [`check_allocation`](super::check_allocation) sees every request (a library cannot install
//! one for its users):
//!
//! ```ignore
//! #[global_allocator]
//! static ALLOCATOR: pipetransformer::fuzz::CountingAllocator = pipetransformer::fuzz::CountingAllocator;
//! ```

use std::alloc::{GlobalAlloc, Layout, System};

use super::check_allocation;

/// The system allocator, with every request's size shown to the fuzzer first. It records
/// (never refuses) a request, so a huge one is reported after the parser returns. Blocks of
/// 1 GiB or more (`HUGE`) come from an anonymous `mmap` without swap reservation instead:
/// `malloc` refuses a request larger than memory, and the refusal would abort the whole run
/// in `handle_alloc_error` before the finding could be reported, while a lazily backed
/// mapping costs nothing until written (and a parser that trusted a length field fails on the
/// missing data long before it writes gigabytes).
pub struct CountingAllocator;

/// Requests from this size on are mapped, not `malloc`ed.
const HUGE: usize = 1 << 30;
/// Mappings start on a page, so they serve layouts aligned up to this.
const PAGE: usize = 4096;

#[cfg(target_os = "linux")]
mod huge {
    use std::ffi::{c_int, c_long, c_void};

    // libc is linked into every Rust binary on Linux; these are its declarations.
    unsafe extern "C" {
        fn mmap(addr: *mut c_void, len: usize, prot: c_int, flags: c_int, fd: c_int, offset: c_long) -> *mut c_void;
        fn munmap(addr: *mut c_void, len: usize) -> c_int;
    }
    const PROT_READ: c_int = 1;
    const PROT_WRITE: c_int = 2;
    const MAP_PRIVATE: c_int = 0x02;
    const MAP_ANONYMOUS: c_int = 0x20;
    const MAP_NORESERVE: c_int = 0x4000;

    /// A zeroed mapping of `len` bytes, or null.
    pub fn map(len: usize) -> *mut u8 {
        // SAFETY: a fresh anonymous private mapping; no existing memory is touched.
        let p = unsafe {
            mmap(std::ptr::null_mut(), len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0)
        };
        if p as isize == -1 { std::ptr::null_mut() } else { p.cast() }
    }

    /// Unmaps what [`map`] returned for the same `len`.
    ///
    /// # Safety
    /// `p` came from `map(len)` and is not used afterwards.
    pub unsafe fn unmap(p: *mut u8, len: usize) {
        // SAFETY: per the contract, `p..p + len` is exactly one live mapping of ours.
        unsafe { munmap(p.cast(), len) };
    }
}

fn mapped(layout: Layout) -> bool {
    cfg!(target_os = "linux") && layout.size() >= HUGE && layout.align() <= PAGE
}

// SAFETY: blocks are served by `System` or, for `mapped` layouts, by `huge::map`, and each is
// freed by the same one (the decision depends only on the layout, which `dealloc` and
// `realloc` receive unchanged); `check_allocation` only updates two thread-local cells and
// neither allocates nor panics.
unsafe impl GlobalAlloc for CountingAllocator {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        check_allocation(layout.size());
        #[cfg(target_os = "linux")]
        if mapped(layout) {
            return huge::map(layout.size());
        }
        unsafe { System.alloc(layout) }
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        check_allocation(layout.size());
        #[cfg(target_os = "linux")]
        if mapped(layout) {
            // Anonymous mappings are zero-filled.
            return huge::map(layout.size());
        }
        unsafe { System.alloc_zeroed(layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        check_allocation(new_size);
        // SAFETY: the caller guarantees `new_size`, rounded to `layout.align()`, fits isize.
        let new_layout = unsafe { Layout::from_size_align_unchecked(new_size, layout.align()) };
        if !mapped(layout) && !mapped(new_layout) {
            return unsafe { System.realloc(ptr, layout, new_size) };
        }
        // Across or within the mapped range: move by hand.
        let new = unsafe { self.alloc(new_layout) };
        if !new.is_null() {
            // SAFETY: both blocks are live and at least `min` bytes long; they do not overlap.
            unsafe {
                std::ptr::copy_nonoverlapping(ptr, new, layout.size().min(new_size));
                self.dealloc(ptr, layout);
            }
        }
        new
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        #[cfg(target_os = "linux")]
        if mapped(layout) {
            // SAFETY: `alloc` mapped exactly `layout.size()` bytes for this layout.
            return unsafe { huge::unmap(ptr, layout.size()) };
        }
        unsafe { System.dealloc(ptr, layout) }
    }
}
