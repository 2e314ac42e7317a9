//! Structure-aware mutation fuzzing of every parser a user's file reaches, on stable Rust
//! (cargo-fuzz needs nightly, which we cannot install).
//!
//! A run starts a corpus from a target's seeds (small valid files built in code), then for
//! each input takes a corpus entry, stacks a few seeded [`mutate`] mutations on it, applies the
//! target's fix-up (recomputing a hash, a length or a CRC that a mutation almost always breaks
//! first, so the mutation reaches the structure behind it), writes it where the real parser
//! reads it and calls the parser. An input the parser accepts joins the corpus (up to
//! [`CORPUS_CAP`] entries), so later mutations start from deeper valid structure.
//!
//! What counts as a bug ([`Finding`]): a panic (caught per input, the panic hook silenced
//! meanwhile), an input taking longer than the hang limit, and one allocation above the
//! allocation cap. The library cannot install a global allocator, so allocation checking is
//! live only in a binary whose `#[global_allocator]` calls [`check_allocation`]
//! ([`CountingAllocator`], as `examples/fuzz.rs` and the smoke tests install). A rejected input — the parser's `Err` — is the expected outcome.
//!
//! ```no_run
//! let report = pipetransformer::fuzz::run("checkpoint", 10_000, 1, std::time::Duration::from_secs(2)).unwrap();
//! assert!(report.findings.is_empty(), "{:?}", report.findings);
//! ```

mod allocator;
pub mod mutate;
mod targets;

pub use allocator::CountingAllocator;

use std::cell::{Cell, RefCell};
use std::collections::{HashMap, HashSet};
use std::panic::{AssertUnwindSafe, PanicHookInfo};
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use crate::files::Scratch;
use crate::rng::{FNV_OFFSET, Rng, fnv1a};

/// Inputs never grow past this (mutations stop short of it): parsers see files of realistic
/// structure, and every input is small enough for the allocation cap to apply.
pub const MAX_INPUT_LEN: usize = 64 << 10;
/// Largest corpus; once full, an accepted input replaces a random non-seed entry now and then.
pub const CORPUS_CAP: usize = 256;
/// Default time one input may take before it is reported as a hang.
pub const DEFAULT_HANG_LIMIT: Duration = Duration::from_secs(2);
/// Default cap on any single allocation while an input (at most [`MAX_INPUT_LEN`] bytes) is
/// parsed: no honest parse of a 64 KiB file needs a 256 MiB block, and a parser that asks for
/// one trusted a length field.
pub const DEFAULT_ALLOCATION_CAP: usize = 256 << 20;
/// Examples kept per distinct finding (same panic location, or same kind of hang/allocation).
const EXAMPLES_PER_SIGNATURE: usize = 3;

/// The fuzz targets [`run`] knows, in the order `all` runs them.
pub fn targets() -> Vec<&'static str> {
    targets::TARGETS.iter().map(|t| t.name).collect()
}

/// What went wrong with one input.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum FindingKind {
    /// The parser panicked.
    Panic,
    /// The input took longer than the hang limit.
    Hang,
    /// One allocation exceeded the allocation cap.
    Allocation,
}

impl std::fmt::Display for FindingKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            FindingKind::Panic => "panic",
            FindingKind::Hang => "hang",
            FindingKind::Allocation => "allocation",
        })
    }
}

/// One bug: the target, what happened, the input that did it and a message (the panic and its
/// location, the time taken, the size asked for).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Finding {
    /// The target's name.
    pub target: String,
    /// What happened.
    pub kind: FindingKind,
    /// The input, as the target received it (replay it with [`replay`]).
    pub input: Vec<u8>,
    /// What happened, in words.
    pub message: String,
}

/// The outcome of one run of one target.
#[derive(Clone, Debug, PartialEq)]
pub struct Report {
    /// The target's name.
    pub target: String,
    /// Inputs run (seeds included).
    pub inputs: u64,
    /// Seeds the corpus started from (run first, unmutated).
    pub seeds: usize,
    /// Inputs the parser accepted (returned `Ok`).
    pub accepted: u64,
    /// Of the seeds, those the parser accepted: all of them, or the seeds test nothing.
    pub seeds_accepted: usize,
    /// Inputs the parser refused with an error (the expected outcome for a broken file).
    pub rejected: u64,
    /// Inputs that produced a finding (duplicates of a finding included).
    pub failed: u64,
    /// Corpus size at the end.
    pub corpus: usize,
    /// Distinct findings, a few example inputs each.
    pub findings: Vec<Finding>,
    /// Wall-clock seconds.
    pub seconds: f64,
    /// The slowest input's seconds.
    pub slowest: f64,
    /// Whether allocations were observed, i.e. the binary's allocator calls
    /// [`check_allocation`] and the cap was enforced.
    pub allocation_checked: bool,
}

impl Report {
    /// Inputs per second.
    pub fn inputs_per_second(&self) -> f64 {
        if self.seconds > 0.0 { self.inputs as f64 / self.seconds } else { 0.0 }
    }
}

/// How a run goes.
#[derive(Clone, Debug)]
pub struct Options {
    /// Inputs to run, seeds included.
    pub inputs: u64,
    /// Seed of every random choice: the same seed replays the same inputs.
    pub seed: u64,
    /// One input taking longer than this is a [`FindingKind::Hang`].
    pub hang_limit: Duration,
    /// Stop early after this much wall-clock time.
    pub budget: Option<Duration>,
    /// Largest single allocation allowed while one input is parsed.
    pub allocation_cap: usize,
}

impl Default for Options {
    fn default() -> Self {
        Self {
            inputs: 1_000_000,
            seed: 0,
            hang_limit: DEFAULT_HANG_LIMIT,
            budget: None,
            allocation_cap: DEFAULT_ALLOCATION_CAP,
        }
    }
}

/// Fuzzes `target` with `inputs` inputs from `seed`; an input taking longer than `time_limit`
/// is a hang. Errors (a `String`) only for an unknown target or a harness that cannot start
/// (no scratch folder, seeds that cannot be built); bugs found are in [`Report::findings`].
pub fn run(target: &str, inputs: u64, seed: u64, time_limit: Duration) -> Result<Report, String> {
    run_with(target, &Options { inputs, seed, hang_limit: time_limit, ..Options::default() })
}

fn find(target: &str) -> Result<&'static targets::Target, String> {
    targets::TARGETS
        .iter()
        .find(|t| t.name == target)
        .ok_or_else(|| format!("unknown fuzz target `{target}`; expected one of: {}", targets().join(", ")))
}

/// [`run`] with every option.
pub fn run_with(target: &str, options: &Options) -> Result<Report, String> {
    run_target(find(target)?, options)
}

fn run_target(t: &targets::Target, options: &Options) -> Result<Report, String> {
    let target = t.name;
    let scratch = scratch(target)?;
    let seeds = (t.seeds)(&scratch).map_err(|e| format!("fuzz target {target}: cannot build its seeds: {e}"))?;
    let mut corpus = Corpus::new(seeds);
    let _quiet = QuietPanics::install();
    let watchdog = Watchdog::start(target, options.hang_limit);
    let mut rng = Rng::new(options.seed);
    let mut report = Report {
        target: target.to_string(),
        inputs: 0,
        seeds: corpus.seeds,
        accepted: 0,
        seeds_accepted: 0,
        rejected: 0,
        failed: 0,
        corpus: 0,
        findings: Vec::new(),
        seconds: 0.0,
        slowest: 0.0,
        allocation_checked: false,
    };
    let mut examples: HashMap<String, usize> = HashMap::new();
    let start = Instant::now();
    for i in 0..options.inputs {
        if options.budget.is_some_and(|b| start.elapsed() >= b) {
            break;
        }
        // The seeds go first, unmutated: the report counts those accepted.
        let input = match corpus.entries.get(i as usize).filter(|_| (i as usize) < corpus.seeds) {
            Some(seed) => seed.clone(),
            None => {
                let mut data = corpus.entries[rng.below(corpus.entries.len() as u64) as usize].clone();
                mutate::mutate(&mut data, &mut rng, &corpus.entries, MAX_INPUT_LEN);
                if let Some(fix_up) = t.fix_up {
                    fix_up(&mut data, &mut rng);
                }
                data
            }
        };
        let outcome = execute(t, &input, &scratch, &watchdog);
        report.inputs += 1;
        report.slowest = report.slowest.max(outcome.elapsed.as_secs_f64());
        report.allocation_checked |= outcome.largest_allocation > 0;

        match &outcome.result {
            Ok(Ok(())) => {
                report.accepted += 1;
                report.seeds_accepted += usize::from((i as usize) < corpus.seeds);
            }
            Ok(Err(_)) => report.rejected += 1,
            Err(_) => {}
        }
        let problems = problems(&outcome, &input, options);
        if problems.is_empty() {
            if matches!(outcome.result, Ok(Ok(()))) {
                corpus.add(input, &mut rng);
            }
            continue;
        }
        report.failed += 1;
        for (kind, signature, message) in problems {
            let seen = examples.entry(format!("{kind} {signature}")).or_insert(0);
            if *seen < EXAMPLES_PER_SIGNATURE {
                *seen += 1;
                report.findings.push(Finding { target: target.to_string(), kind, input: input.clone(), message });
            }
        }
    }
    drop(watchdog);
    report.seconds = start.elapsed().as_secs_f64();
    report.corpus = corpus.entries.len();
    Ok(report)
}

/// What was wrong with one input, as (kind, signature, message); the signature groups
/// repeats of one bug (a panic's location; one group per kind otherwise).
fn problems(outcome: &Outcome, input: &[u8], options: &Options) -> Vec<(FindingKind, String, String)> {
    let mut found = Vec::new();
    if let Err(panic) = &outcome.result {
        found.push((FindingKind::Panic, panic.location.clone(), panic.message.clone()));
    }
    if outcome.largest_allocation > options.allocation_cap {
        let message = format!(
            "one allocation of {} bytes while parsing a {}-byte input (cap {} bytes){}",
            outcome.largest_allocation,
            input.len(),
            options.allocation_cap,
            outcome_note(&outcome.result)
        );
        found.push((FindingKind::Allocation, "allocation".into(), message));
    }
    if outcome.elapsed > options.hang_limit {
        let message = format!(
            "took {:.2} s (limit {:.2} s) on a {}-byte input{}",
            outcome.elapsed.as_secs_f64(),
            options.hang_limit.as_secs_f64(),
            input.len(),
            outcome_note(&outcome.result)
        );
        found.push((FindingKind::Hang, "hang".into(), message));
    }
    found
}

fn outcome_note(result: &Result<crate::Result<()>, Panicked>) -> String {
    match result {
        Ok(Ok(())) => "; the parser accepted it".into(),
        Ok(Err(e)) => format!("; the parser then refused it: {e}"),
        Err(p) => format!("; then {}", p.message),
    }
}

/// Runs one input through `target` once, in this thread, without catching a panic or
/// silencing the hook: for reproducing a finding with `RUST_BACKTRACE=1` or a debugger.
pub fn replay(target: &str, input: &[u8]) -> Result<crate::Result<()>, String> {
    let t = find(target)?;
    let scratch = scratch(target)?;
    Ok((t.run)(input, &scratch))
}

// ---- the corpus -----------------------------------------------------------------------------

struct Corpus {
    entries: Vec<Vec<u8>>,
    /// The first `seeds` entries are the seeds, never replaced.
    seeds: usize,
    /// Hashes of every input ever added, so a re-found input does not crowd the corpus.
    seen: HashSet<u64>,
}

impl Corpus {
    fn new(seeds: Vec<Vec<u8>>) -> Self {
        let seen = seeds.iter().map(|s| fnv1a(s, FNV_OFFSET)).collect();
        Self { seeds: seeds.len(), entries: seeds, seen }
    }

    fn add(&mut self, input: Vec<u8>, rng: &mut Rng) {
        if !self.seen.insert(fnv1a(&input, FNV_OFFSET)) {
            return;
        }
        if self.entries.len() < CORPUS_CAP {
            self.entries.push(input);
        } else if self.entries.len() > self.seeds && rng.below(8) == 0 {
            // Full: keep moving, so the corpus does not freeze on the first 256 finds.
            let k = self.seeds + rng.below((self.entries.len() - self.seeds) as u64) as usize;
            self.entries[k] = input;
        }
    }
}

// ---- one input ------------------------------------------------------------------------------

/// A caught panic: where, and the hook's message.
struct Panicked {
    location: String,
    message: String,
}

struct Outcome {
    result: Result<crate::Result<()>, Panicked>,
    elapsed: Duration,
    largest_allocation: usize,
}

fn execute(t: &targets::Target, input: &[u8], scratch: &Path, watchdog: &Watchdog) -> Outcome {
    watchdog.begin(input);
    LARGEST_ALLOCATION.with(|l| l.set(0));
    CATCHING.with(|c| c.set(true));
    WATCHING_ALLOCATIONS.with(|w| w.set(true));
    let start = Instant::now();
    let result = std::panic::catch_unwind(AssertUnwindSafe(|| (t.run)(input, scratch)));
    let elapsed = start.elapsed();
    WATCHING_ALLOCATIONS.with(|w| w.set(false));
    CATCHING.with(|c| c.set(false));
    watchdog.end();
    let largest_allocation = LARGEST_ALLOCATION.with(Cell::get);
    let result = result.map_err(|payload| {
        LAST_PANIC.with(|p| p.borrow_mut().take()).unwrap_or_else(|| Panicked {
            location: "unknown location".into(),
            message: payload
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| payload.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "a panic without a message".into()),
        })
    });
    Outcome { result, elapsed, largest_allocation }
}

// ---- the allocation cap ---------------------------------------------------------------------

thread_local! {
    /// Set while this thread parses an input.
    static WATCHING_ALLOCATIONS: Cell<bool> = const { Cell::new(false) };
    /// The largest single allocation since the current input started.
    static LARGEST_ALLOCATION: Cell<usize> = const { Cell::new(0) };
}

/// The allocation-cap hook: a fuzzing binary's `#[global_allocator]` calls this with the size
/// of every `alloc`, `alloc_zeroed` and `realloc` (the new size), before forwarding to the
/// real allocator. It only notes the largest request of the input being parsed on this
/// thread; [`run`] compares it with the cap after the parser returns. It never allocates and
/// never panics, as code inside an allocator must not.
///
/// ```ignore
/// struct Counting;
/// unsafe impl std::alloc::GlobalAlloc for Counting {
///     unsafe fn alloc(&self, layout: std::alloc::Layout) -> *mut u8 {
///         pipetransformer::fuzz::check_allocation(layout.size());
///         unsafe { std::alloc::System.alloc(layout) }
///     }
///     // … dealloc, alloc_zeroed, realloc likewise
/// }
/// ```
#[inline]
pub fn check_allocation(bytes: usize) {
    // `try_with`: during thread teardown the slots may be gone; a lost sample is harmless.
    let _ = WATCHING_ALLOCATIONS.try_with(|w| {
        if w.get() {
            let _ = LARGEST_ALLOCATION.try_with(|l| l.set(l.get().max(bytes)));
        }
    });
}

// ---- silencing panics -----------------------------------------------------------------------

type Hook = Box<dyn Fn(&PanicHookInfo<'_>) + Sync + Send + 'static>;

thread_local! {
    /// Set while this thread runs an input under `catch_unwind`.
    static CATCHING: Cell<bool> = const { Cell::new(false) };
    /// The hook's record of the last caught panic on this thread.
    static LAST_PANIC: RefCell<Option<Panicked>> = const { RefCell::new(None) };
}

/// Runs using this hook, and the hook that was installed before the first of them.
static QUIET: Mutex<(usize, Option<Arc<Hook>>)> = Mutex::new((0, None));

fn quiet_state() -> MutexGuard<'static, (usize, Option<Arc<Hook>>)> {
    QUIET.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// While alive, a panic on a thread that is running a fuzz input is recorded instead of
/// printed (a million inputs would otherwise print a million backtraces); panics elsewhere
/// go to the previous hook. Runs on several threads share one installation; the last to end
/// puts the previous hook back.
struct QuietPanics;

impl QuietPanics {
    fn install() -> Self {
        let mut state = quiet_state();
        if state.0 == 0 {
            let previous: Arc<Hook> = Arc::new(std::panic::take_hook());
            state.1 = Some(previous.clone());
            std::panic::set_hook(Box::new(move |info| {
                if CATCHING.try_with(Cell::get).unwrap_or(false) {
                    let location = info.location().map_or("unknown location".into(), |l| l.to_string());
                    let message =
                        format!("panicked at {location}: {}", info.payload_as_str().unwrap_or("(no message)"));
                    let _ = LAST_PANIC.try_with(|p| *p.borrow_mut() = Some(Panicked { location, message }));
                } else {
                    previous(info);
                }
            }));
        }
        state.0 += 1;
        QuietPanics
    }
}

impl Drop for QuietPanics {
    fn drop(&mut self) {
        let mut state = quiet_state();
        state.0 -= 1;
        // `set_hook` panics on a panicking thread; leaving ours then only keeps it silent for
        // fuzzing threads, which is harmless.
        if state.0 == 0
            && !std::thread::panicking()
            && let Some(previous) = state.1.take()
        {
            drop(std::panic::take_hook());
            std::panic::set_hook(Box::new(move |info| previous(info)));
        }
    }
}

// ---- the watchdog ---------------------------------------------------------------------------

/// The input in flight, for the watchdog.
struct InFlight {
    started: Option<Instant>,
    input: Vec<u8>,
    reported: bool,
}

/// A hang that never ends produces no finding (the harness cannot stop the parser), so a
/// watchdog thread saves the input of one running far past the hang limit to a file and says
/// where, once per input.
struct Watchdog {
    state: Arc<Mutex<InFlight>>,
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Watchdog {
    fn start(target: &str, hang_limit: Duration) -> Self {
        let state = Arc::new(Mutex::new(InFlight { started: None, input: Vec::new(), reported: false }));
        let stop = Arc::new(AtomicBool::new(false));
        let stuck_after = hang_limit.saturating_mul(5).max(Duration::from_secs(10));
        let path = std::env::temp_dir().join(format!("pipetransformer-fuzz-stuck-{target}-{}.bin", std::process::id()));
        let (s, halt, target) = (state.clone(), stop.clone(), target.to_string());
        let thread = std::thread::Builder::new()
            .name(format!("fuzz-watchdog-{target}"))
            .spawn(move || {
                while !halt.load(Ordering::Relaxed) {
                    std::thread::park_timeout(Duration::from_millis(200));
                    let mut f = s.lock().unwrap_or_else(|p| p.into_inner());
                    if f.started.is_some_and(|t| t.elapsed() > stuck_after) && !f.reported {
                        f.reported = true;
                        let saved = std::fs::write(&path, &f.input).map_or_else(
                            |e| format!("could not save it to {}: {e}", path.display()),
                            |()| format!("its bytes are in {}", path.display()),
                        );
                        eprintln!(
                            "fuzz {target}: one input has run for more than {} s and may never end; {saved}",
                            stuck_after.as_secs()
                        );
                    }
                }
            })
            .ok();
        Self { state, stop, thread }
    }

    fn begin(&self, input: &[u8]) {
        let mut f = self.state.lock().unwrap_or_else(|p| p.into_inner());
        f.input.clear();
        f.input.extend_from_slice(input);
        f.reported = false;
        f.started = Some(Instant::now());
    }

    fn end(&self) {
        self.state.lock().unwrap_or_else(|p| p.into_inner()).started = None;
    }
}

impl Drop for Watchdog {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(thread) = self.thread.take() {
            thread.thread().unpark();
            let _ = thread.join();
        }
    }
}

// ---- scratch files --------------------------------------------------------------------------

/// A folder of its own for a run's files, on tmpfs where there is one (a million small
/// writes), removed when the run ends.
fn scratch(target: &str) -> Result<Scratch, String> {
    let shm = Path::new("/dev/shm");
    let base = if shm.is_dir() { shm.to_path_buf() } else { std::env::temp_dir() };
    Scratch::create_in(&base, &format!("fuzz-{target}")).map_err(|e| format!("cannot create the scratch folder: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fuzz_unknown_target_names_the_valid_ones() {
        let e = run("nope", 10, 0, DEFAULT_HANG_LIMIT).unwrap_err();
        assert!(e.contains("unknown fuzz target `nope`"), "{e}");
        for name in targets() {
            assert!(e.contains(name), "{name} missing from: {e}");
        }
        assert!(replay("nope", b"").is_err());
    }

    #[test]
    fn fuzz_runs_are_deterministic_per_seed() {
        let a = run("csv", 300, 7, DEFAULT_HANG_LIMIT).unwrap();
        let b = run("csv", 300, 7, DEFAULT_HANG_LIMIT).unwrap();
        assert_eq!((a.inputs, a.accepted, a.rejected, a.corpus), (b.inputs, b.accepted, b.rejected, b.corpus));
        assert!(a.accepted >= 2 && a.rejected > 0, "{a:?}");
    }

    /// A target whose seeds misbehave: `boom` panics, `slow` outlasts a 30 ms hang limit,
    /// `big` asks the (simulated) allocator for more than the cap; anything else is refused.
    static MISBEHAVING: targets::Target = targets::Target {
        name: "misbehaving",
        seeds: |_| Ok(vec![b"ok".to_vec(), b"boom".to_vec(), b"slow".to_vec(), b"big".to_vec()]),
        fix_up: None,
        run: |input, _| match input {
            b"ok" => Ok(()),
            b"boom" => panic!("boom at {}", input.len()),
            b"slow" => {
                std::thread::sleep(Duration::from_millis(600));
                Ok(())
            }
            // What a binary's counting allocator reports for `vec![0u8; cap + 1]`.
            b"big" => {
                check_allocation(DEFAULT_ALLOCATION_CAP + 1);
                Ok(())
            }
            _ => Err(crate::error::data_error("input", "refused")),
        },
    };

    /// Panics, hangs and over-cap allocations become findings holding the input, the panic
    /// hook stays quiet meanwhile, and refused inputs are counted, not reported.
    #[test]
    fn fuzz_panics_hangs_and_allocations_are_findings() {
        // (A limit far from both the slow input's time and a refusal's, however busy the machine.)
        let options = Options { inputs: 40, hang_limit: Duration::from_millis(300), ..Options::default() };
        let report = run_target(&MISBEHAVING, &options).unwrap();
        let found = |kind| report.findings.iter().find(|f| f.kind == kind).unwrap_or_else(|| panic!("no {kind}"));
        let panic = found(FindingKind::Panic);
        assert_eq!(panic.input, b"boom");
        assert!(panic.message.contains("boom at 4") && panic.message.contains("fuzz.rs"), "{}", panic.message);
        assert_eq!(found(FindingKind::Hang).input, b"slow");
        let big = found(FindingKind::Allocation);
        assert_eq!(big.input, b"big");
        assert!(
            big.message.contains(&format!("one allocation of {} bytes", DEFAULT_ALLOCATION_CAP + 1)),
            "{}",
            big.message
        );
        assert_eq!((report.findings.len(), report.failed, report.seeds), (3, 3, 4));
        assert_eq!(report.seeds_accepted, 3, "every seed but the panic");
        assert_eq!(report.accepted + report.rejected + 1, 40, "every input but the panic is accepted or refused");
        assert!(report.allocation_checked);
    }
}
