//! Every fuzz target for a few thousand inputs (the long runs are `examples/fuzz.rs`): no
//! panics, hangs or over-cap allocations; the seeds are accepted (else the corpus could not
//! grow and the run would test nothing) and mutations reach the parsers' errors.

use std::alloc::{GlobalAlloc, Layout, System};

use pipetransformer::fuzz;

/// The system allocator, showing each request's size to the fuzzer's allocation cap.
struct Counting;

// SAFETY: forwards every call to `System` unchanged; `check_allocation` neither allocates nor
// panics.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        fuzz::check_allocation(layout.size());
        unsafe { System.alloc(layout) }
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        fuzz::check_allocation(layout.size());
        unsafe { System.alloc_zeroed(layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        fuzz::check_allocation(new_size);
        unsafe { System.realloc(ptr, layout, new_size) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

/// Inputs per target: each target runs 20–400 k inputs/s in this profile, so even the
/// slowest takes well under a second and the whole file a few seconds on 2 cores.
const INPUTS: u64 = 10_000;

fn smoke(target: &str) {
    let report = fuzz::run(target, INPUTS, 42, fuzz::DEFAULT_HANG_LIMIT).unwrap_or_else(|e| panic!("{e}"));
    for f in &report.findings {
        eprintln!("{} {}: {} (input {:?})", f.target, f.kind, f.message, String::from_utf8_lossy(&f.input));
    }
    assert!(report.findings.is_empty(), "{target}: {} findings, listed above", report.findings.len());
    assert_eq!(report.inputs, INPUTS, "{target}: stopped early");
    assert!(report.accepted >= report.seeds as u64 && report.seeds > 0, "{target}: {report:?}");
    assert!(report.rejected > 0, "{target}: no mutation reached an error: {report:?}");
    assert!(report.corpus > report.seeds, "{target}: the corpus did not grow: {report:?}");
    assert!(report.allocation_checked, "{target}: the allocation cap was not enforced");
}

#[test]
fn every_target_is_covered() {
    let names = fuzz::targets();
    for name in
        ["safetensors", "checkpoint", "idx", "csv", "tsv", "tokenizer", "config", "hf_config", "image", "rendezvous"]
    {
        assert!(names.contains(&name), "{name} is not a fuzz target");
    }
    assert_eq!(names.len(), 10, "a new target needs its own smoke test below: {names:?}");
}

#[test]
fn safetensors() {
    smoke("safetensors");
}

#[test]
fn checkpoint() {
    smoke("checkpoint");
}

#[test]
fn idx() {
    smoke("idx");
}

#[test]
fn csv() {
    smoke("csv");
}

#[test]
fn tsv() {
    smoke("tsv");
}

#[test]
fn tokenizer() {
    smoke("tokenizer");
}

#[test]
fn config() {
    smoke("config");
}

#[test]
fn hf_config() {
    smoke("hf_config");
}

#[test]
fn image() {
    smoke("image");
}

#[test]
fn rendezvous() {
    smoke("rendezvous");
}
