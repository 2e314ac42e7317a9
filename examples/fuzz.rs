//! Fuzzes the parsers a user's file reaches (see `pipetransformer::fuzz`):
//!
//! ```text
//! cargo run --release --example fuzz -- <target|all> [--inputs N] [--seed S] [--out DIR]
//!     [--hang-limit SECONDS] [--allocation-cap-mib MIB] [--budget SECONDS]
//! cargo run --release --example fuzz -- <target> --replay FILE
//! ```
//!
//! Prints one row per target (inputs, accepted, corpus, findings, seconds, inputs/s), writes
//! each finding's input to `DIR/<target>-<kind>-seed<S>-<n>.bin` with its message beside it in
//! `.txt` (runs of other seeds keep theirs), and exits with status 1 if there was any finding.
//! `--replay` runs one saved input without catching its panic, for a backtrace; it checks
//! neither time nor allocations, so a hang or an allocation finding shows there only as the
//! parser's result.
//!
//! The global allocator (`fuzz::CountingAllocator`) forwards to the system allocator and
//! reports each request's size to `fuzz::check_allocation`, which is how the allocation cap is
//! enforced.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::Parser;
use pipetransformer::fuzz::{self, Options, Report};

#[global_allocator]
static ALLOCATOR: fuzz::CountingAllocator = fuzz::CountingAllocator;

#[derive(Parser)]
#[command(about = "Structure-aware mutation fuzzing of pipetransformer's file parsers")]
struct Args {
    /// A target (safetensors, checkpoint, idx, csv, tsv, tokenizer, config, hf_config, image,
    /// rendezvous, user_text, compressed, export) or `all`.
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
    let names: Vec<&str> = if args.target == "all" { fuzz::targets() } else { vec![args.target.as_str()] };
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
            save_findings(&report, &args.out, args.seed)?;
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

fn save_findings(report: &Report, out: &std::path::Path, seed: u64) -> Result<(), String> {
    std::fs::create_dir_all(out).map_err(|e| format!("{}: {e}", out.display()))?;
    println!("  {} inputs failed; distinct findings:", report.failed);
    for (i, f) in report.findings.iter().enumerate() {
        let stem = out.join(format!("{}-{}-seed{seed}-{i}", f.target, f.kind));
        let bin = stem.with_extension("bin");
        std::fs::write(&bin, &f.input).map_err(|e| format!("{}: {e}", bin.display()))?;
        let txt = stem.with_extension("txt");
        std::fs::write(&txt, format!("{}\n", f.message)).map_err(|e| format!("{}: {e}", txt.display()))?;
        println!("  {} {}: {} ({})", f.target, f.kind, f.message, bin.display());
    }
    Ok(())
}
