//! Every fuzz target for a few thousand inputs (the long runs are `examples/fuzz.rs`): no
//! panics, hangs or over-cap allocations; the seeds are accepted (else the corpus could not
//! grow and the run would test nothing) and mutations reach the parsers' errors.

use pipetransformer::fuzz;

/// Every request's size shown to the fuzzer's allocation cap; a request larger than memory
/// is mapped lazily, so that it becomes a finding rather than an abort.
#[global_allocator]
static ALLOCATOR: fuzz::CountingAllocator = fuzz::CountingAllocator;

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
    assert!(report.seeds > 0 && report.seeds_accepted == report.seeds, "{target}: a seed refused: {report:?}");
    assert!(report.rejected > 0, "{target}: no mutation reached an error: {report:?}");
    assert!(report.corpus > report.seeds, "{target}: the corpus did not grow: {report:?}");
    assert!(report.allocation_checked, "{target}: the allocation cap was not enforced");
}

#[test]
fn every_target_is_covered() {
    let names = fuzz::targets();
    let smoked = [
        "safetensors",
        "checkpoint",
        "idx",
        "csv",
        "tsv",
        "tokenizer",
        "config",
        "hf_config",
        "image",
        "rendezvous",
        "user_text",
        "compressed",
        "export",
        "labelled_images",
    ];
    for name in smoked {
        assert!(names.contains(&name), "{name} is not a fuzz target");
    }
    assert_eq!(names.len(), smoked.len(), "a new target needs its own smoke test below: {names:?}");
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

#[test]
fn user_text() {
    smoke("user_text");
}

#[test]
fn compressed() {
    smoke("compressed");
}

#[test]
fn export() {
    smoke("export");
}

#[test]
fn labelled_images() {
    smoke("labelled_images");
}
