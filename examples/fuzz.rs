//! Fuzzes the parsers a user's file reaches (see `pipetransformer::fuzz`):
//!
//! ```text
//! cargo run --release --example fuzz -- <target|all> [--inputs N] [--seed S] [--out DIR]
//! cargo run --release --example fuzz -- <target> --replay FILE
//! ```
//!
//! Prints one row per target (inputs, accepted, corpus, findings, seconds, inputs/s), writes
//! each finding's input to `DIR/<target>-<kind>-<n>.bin` with its message beside it in `.txt`,
//! and exits with status 1 if there was any finding. `--replay` runs one saved input without
//! catching its panic, for a backtrace.
//!
//! The global allocator below forwards to the system allocator and reports each request's
//! size to `fuzz::check_allocation`, which is how the allocation cap is enforced.

use std::alloc::{GlobalAlloc, Layout, System};
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::Parser;
use pipetransformer::fuzz::{self, Options, Report};

/// The system allocator, with every request's size shown to the fuzzer first. It records
/// (never refuses) a request, so a huge one is reported after the parser returns. Blocks of
/// [`HUGE`] bytes or more come from an anonymous `mmap` without swap reservation instead:
/// `malloc` refuses a request larger than memory, and the refusal would abort the whole run
/// in `handle_alloc_error` before the finding could be reported, while a lazily backed
/// mapping costs nothing until written (and a parser that trusted a length field fails on the
/// missing data long before it writes gigabytes).
struct Counting;

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
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        fuzz::check_allocation(layout.size());
        #[cfg(target_os = "linux")]
        if mapped(layout) {
            return huge::map(layout.size());
        }
        unsafe { System.alloc(layout) }
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        fuzz::check_allocation(layout.size());
        #[cfg(target_os = "linux")]
        if mapped(layout) {
            // Anonymous mappings are zero-filled.
            return huge::map(layout.size());
        }
        unsafe { System.alloc_zeroed(layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        fuzz::check_allocation(new_size);
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

#[global_allocator]
static ALLOCATOR: Counting = Counting;

#[derive(Parser)]
#[command(about = "Structure-aware mutation fuzzing of pipetransformer's file parsers")]
struct Args {
    /// A target (safetensors, checkpoint, idx, csv, tsv, tokenizer, config, hf_config, image,
    /// rendezvous) or `all`.
    target: String,
    /// Inputs per target, seeds included.
    #[arg(long, default_value_t = 1_000_000)]
    inputs: u64,
    /// Seed of every mutation: the same seed replays the same inputs.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Where finding inputs are written.
    #[arg(long, default_value = "target/fuzz-findings")]
    out: PathBuf,
    /// Seconds one input may take before it counts as a hang.
    #[arg(long, default_value_t = 2.0)]
    hang_limit: f64,
    /// Largest single allocation (MiB) allowed while one input is parsed.
    #[arg(long, default_value_t = 256)]
    allocation_cap_mib: usize,
    /// Stop each target after this many seconds.
    #[arg(long)]
    budget: Option<f64>,
    /// Run this one saved input through the target, without catching a panic.
    #[arg(long)]
    replay: Option<PathBuf>,
}

fn main() -> ExitCode {
    let args = Args::parse();
    match run(&args) {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(message) => {
            eprintln!("fuzz: {message}");
            ExitCode::from(2)
        }
    }
}

/// Ok(true) when nothing was found.
fn run(args: &Args) -> Result<bool, String> {
    let seconds = |what: &str, s: f64| {
        Duration::try_from_secs_f64(s)
            .map_err(|e| format!("--{what} {s}: expected a non-negative number of seconds ({e})"))
    };
    if let Some(file) = &args.replay {
        let input = std::fs::read(file).map_err(|e| format!("{}: {e}", file.display()))?;
        let result = fuzz::replay(&args.target, &input)?;
        match result {
            Ok(()) => println!("{}: accepted", args.target),
            Err(e) => println!("{}: refused: {e}", args.target),
        }
        return Ok(true);
    }
    let names: Vec<&str> = if args.target == "all" { fuzz::targets().to_vec() } else { vec![args.target.as_str()] };
    let options = Options {
        inputs: args.inputs,
        seed: args.seed,
        hang_limit: seconds("hang-limit", args.hang_limit)?,
        budget: args.budget.map(|b| seconds("budget", b)).transpose()?,
        allocation_cap: args.allocation_cap_mib.saturating_mul(1 << 20),
    };
    println!(
        "{:<12} {:>9} {:>9} {:>9} {:>7} {:>9} {:>9} {:>9}  slowest",
        "target", "inputs", "accepted", "rejected", "corpus", "findings", "seconds", "inputs/s"
    );
    let mut clean = true;
    for name in names {
        let report = fuzz::run_with(name, &options)?;
        print_row(&report);
        if !report.allocation_checked {
            eprintln!("fuzz {name}: no allocation was observed; the allocation cap was not enforced");
        }
        if !report.findings.is_empty() {
            clean = false;
            save_findings(&report, &args.out)?;
        }
    }
    Ok(clean)
}

fn print_row(r: &Report) {
    println!(
        "{:<12} {:>9} {:>9} {:>9} {:>7} {:>9} {:>9.1} {:>9.0}  {:.3} s",
        r.target,
        r.inputs,
        r.accepted,
        r.rejected,
        r.corpus,
        r.findings.len(),
        r.seconds,
        r.inputs_per_second(),
        r.slowest
    );
}

fn save_findings(report: &Report, out: &std::path::Path) -> Result<(), String> {
    std::fs::create_dir_all(out).map_err(|e| format!("{}: {e}", out.display()))?;
    println!("  {} inputs failed; distinct findings:", report.failed);
    for (i, f) in report.findings.iter().enumerate() {
        let stem = out.join(format!("{}-{}-{i}", f.target, f.kind));
        let bin = stem.with_extension("bin");
        std::fs::write(&bin, &f.input).map_err(|e| format!("{}: {e}", bin.display()))?;
        let txt = stem.with_extension("txt");
        std::fs::write(&txt, format!("{}\n", f.message)).map_err(|e| format!("{}: {e}", txt.display()))?;
        println!("  {} {}: {} ({})", f.target, f.kind, f.message, bin.display());
    }
    Ok(())
}
