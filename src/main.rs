//! The `pipetransformer` command line.

use anyhow::{Context, Result, bail};
use clap::{Parser, Subcommand, ValueEnum};
use pipetransformer::bench;
use pipetransformer::device::{AnyDevice, AnyDevices, Device, DeviceKind, Precision, PrecisionChoice};
use pipetransformer::elastic::{FreedDevices, FreezeInterval, FreezeName};
use pipetransformer::model::HeadSpec;
use pipetransformer::pipeline::{Recompute, ScheduleKind};
use pipetransformer::run::overfit::overfit;
use pipetransformer::run::predict::{OutputFormat, PredictOptions, predict_stream};
use pipetransformer::run::progress::event_line;
use pipetransformer::run::{Job, Predictor, ProgressLines, RunConfig, Sampling};
use pipetransformer::terapipe::TokenSlices;
use pipetransformer::train::Event;
use std::path::{Path, PathBuf};
use std::time::Instant;

/// A line on standard output that a closed pipe or a full disk does not end: a training run
/// goes on (its record is `metrics.jsonl`, its checkpoints and `report.html`), where
/// `println!` would panic mid-run.
macro_rules! console {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        let _ = writeln!(std::io::stdout(), $($arg)*);
    }};
}

/// [`console!`] without the line's end (text that ends its own lines).
macro_rules! console_text {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        let _ = write!(std::io::stdout(), $($arg)*);
    }};
}

/// A line on standard output for a report (`plan`, `bench-step`, `kernels`): a failed write (a
/// full disk) ends the command with an error naming it. (A closed pipe ends it quietly: these
/// commands take SIGPIPE's default.)
macro_rules! out {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        writeln!(std::io::stdout(), $($arg)*).context("writing standard output")?
    }};
}

/// [`out!`] without the line's end.
macro_rules! out_text {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        write!(std::io::stdout(), $($arg)*).context("writing standard output")?
    }};
}

#[derive(Parser)]
#[command(
    name = "pipetransformer",
    version,
    about = "Train Transformers with hand-written forward and backward passes"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Clone, Copy, ValueEnum)]
enum Family {
    Bert,
    Gpt,
    Vit,
}

impl From<Family> for pipetransformer::model::Family {
    fn from(f: Family) -> Self {
        match f {
            Family::Bert => Self::Bert,
            Family::Gpt => Self::Gpt,
            Family::Vit => Self::Vit,
        }
    }
}

/// Where a command runs (`--device`, `--precision`).
#[derive(clap::Args, Clone, Copy)]
struct DeviceArgs {
    /// Backend: auto (cuda when the driver sees a GPU for each device the command uses, else cpu),
    /// cpu, cuda, or cuda-emu (the CUDA kernels emulated on the host: slow, for checking).
    #[arg(long, default_value = "auto", value_parser = parse_from_str::<DeviceKind>)]
    device: DeviceKind,
    /// f32 (the default; for `train`, the config's `output.precision`),
    /// bf16, or auto (bf16 where the hardware's bf16 products are the faster: a CPU with AMX, an
    /// AMD CPU with avx512_bf16, a GPU of compute capability 8.0 or later; else f32). bf16 means on the GPU backends bf16
    /// activations with f32 master weights; on cpu bf16 operands in the linear layers' products
    /// (f32 accumulation), f32 everything else. `bench-step` on cpu without it times both.
    #[arg(long, value_enum)]
    precision: Option<PrecisionArg>,
}

/// Where `predict` and `evaluate` run a model (`--device`, `--precision`): one device.
#[derive(clap::Args, Clone, Copy)]
struct ModelDeviceArgs {
    /// Backend: auto (cuda when the driver sees a GPU, else cpu), cpu, cuda, or cuda-emu (the
    /// CUDA kernels emulated on the host: slow, for checking).
    #[arg(long, default_value = "auto", value_parser = parse_from_str::<DeviceKind>)]
    device: DeviceKind,
    /// f32 (the default; for `evaluate --config`, the config's `output.precision`), bf16, or
    /// auto (bf16 where the hardware's bf16 products are the faster: a CPU with AMX, an AMD
    /// CPU with avx512_bf16, a GPU of compute capability 8.0 or later; else f32). bf16 means on
    /// the GPU backends bf16 activations with f32 master weights; on cpu bf16 operands in the
    /// linear layers' products (f32 accumulation), f32 everything else.
    #[arg(long, value_enum)]
    precision: Option<PrecisionArg>,
}

impl From<ModelDeviceArgs> for DeviceArgs {
    fn from(d: ModelDeviceArgs) -> Self {
        DeviceArgs { device: d.device, precision: d.precision }
    }
}

/// How a step is spread over devices (`train`, `plan`); each flag overrides the run config's
/// `[pipeline]` key of the same name.
#[derive(clap::Args, Clone, Default)]
struct PipelineArgs {
    /// Devices the run may use (GPUs; without them, N cpu devices sharing the cores): the
    /// initial plan's replicas × pipeline length, plus any that AutoDP turns into replicas.
    #[arg(long, value_parser = setting::<usize>)]
    devices: Option<usize>,
    /// Devices per pipeline (K); default: the config's pipeline.pipeline_len, else all the
    /// devices over the replicas (with
    /// --across-processes under `launch`: all the processes, one pipeline).
    #[arg(long, value_parser = setting::<usize>)]
    pipeline_len: Option<usize>,
    /// Micro-batches per replica per step (M).
    #[arg(long, value_parser = setting::<usize>)]
    micro_batches: Option<usize>,
    /// Data-parallel replicas of the pipeline (R).
    #[arg(long, value_parser = setting::<usize>)]
    replicas: Option<usize>,
    /// Pipeline schedule: gpipe, 1f1b, interleaved or zb-h1 (1F1B with each backward's weight gradients put off to where the device would wait: a shorter fill and drain, the same result to the bit on cpu and cuda-emu).
    #[arg(long, value_parser = parse_from_str::<ScheduleKind>)]
    schedule: Option<ScheduleKind>,
    /// Model chunks per device for the interleaved schedule (default 2 for it).
    #[arg(long, value_parser = setting::<usize>)]
    chunks: Option<usize>,
    /// Partition by each unit's measured forward and backward time on the device instead of
    /// its FLOP count (always on with AutoPipe). Sets `pipeline.profile = true` (the flag
    /// cannot unset it).
    #[arg(long)]
    profile: bool,
    /// TeraPipe (causal language models): cut every sequence into token slices that flow
    /// through the pipeline one after another: `auto` (the planner's choice from the layer's
    /// slice latency measured on the device; under --memory-limit, where none of its slicings
    /// fits, the fewest equal slices that do), a number of near-equal slices, or lengths such
    /// as `32,32,64` (which `plan` prices on the same measurement, beside `auto`'s choice).
    #[arg(long, value_parser = parse_from_str::<TokenSlices>)]
    token_slices: Option<TokenSlices>,
    /// Bytes each device may hold (weights, gradients, optimizer state, activations in flight),
    /// e.g. `8GiB`, `512MiB` or a byte count: the partition and TeraPipe's planner respect it.
    #[arg(long, value_parser = setting_bytes)]
    memory_limit: Option<usize>,
    /// Activation recomputation: `off`; `all` (every stage keeps of each micro-batch in flight
    /// only its first trained unit's input, and runs its forward again in the backward: a
    /// third more compute, the same gradients to the bit, and less memory where a stage holds
    /// several micro-batches or token slices; one holding a single whole micro-batch saves
    /// nothing); `auto` (only the
    /// stages whose activations would not fit --memory-limit, and of those only the fewest
    /// trained units from the first that make them fit, chosen with the partition).
    /// Over token slices too (each slice's forward runs again in its backward; with
    /// `--token-slices auto` the slicing is planned for time and recomputation meets the
    /// limit). Not with zb-h1 (whose put-off weight gradients keep those activations).
    #[arg(long, value_parser = parse_from_str::<Recompute>)]
    recompute: Option<Recompute>,
    /// Under `launch`: pipelines whose stages are the processes, one device each. The
    /// processes make rows of --pipeline-len stages, each row a replica: process p runs stage
    /// p % K of replica p / K (the process count a multiple of K; without --pipeline-len, K is the
    /// process count); each builds and holds its own
    /// stage's weights only, so --memory-limit applies per stage. Without it, every process
    /// holds a whole pipeline and trains its share of each batch. Sets
    /// `pipeline.across_processes = true` (the flag cannot unset it).
    #[arg(long)]
    across_processes: bool,
}

/// PipeTransformer (`train`, `plan`); each flag overrides the run config's `[elastic]` key of
/// the same name.
#[derive(clap::Args, Clone, Default)]
struct ElasticArgs {
    /// Freeze rule: eq1 (the paper's Eq. 1), alpha (the α bound alone, as the released code),
    /// table (`elastic.table`), or off.
    #[arg(long, value_parser = parse_from_str::<FreezeName>)]
    freeze: Option<FreezeName>,
    /// α of Eq. 1 and of the α bound, in (0, 1).
    #[arg(long)]
    alpha: Option<f64>,
    /// When the freeze rule runs: `epoch`, or every N steps.
    #[arg(long, value_parser = parse_from_str::<FreezeInterval>)]
    freeze_interval: Option<FreezeInterval>,
    /// Freeze a layer only once it has settled: its weights moved by at most this fraction of
    /// their norm over the last interval (e.g. 0.05), and every layer below it too.
    #[arg(long)]
    max_weight_change: Option<f64>,
    /// Re-partition the active layers onto a shorter pipeline after a freeze (`--auto-pipe`
    /// or `--auto-pipe false`).
    #[arg(long, num_args = 0..=1, default_missing_value = "true")]
    auto_pipe: Option<bool>,
    /// Put devices freed by a shorter pipeline (--auto-pipe) to work: as data-parallel replicas, or (cpu
    /// devices with `--freed-devices threads`) as threads of the devices still at work.
    #[arg(long, num_args = 0..=1, default_missing_value = "true")]
    auto_dp: Option<bool>,
    /// What AutoDP makes of freed cpu devices: replicas (the paper), or threads lent to the
    /// devices still in the pipeline (cpu devices share one host's cores: a replica there
    /// computes nothing a thread would not, and repeats the optimizer step). GPUs always
    /// become replicas; without AutoDP freed devices stay idle.
    #[arg(long, value_parser = parse_from_str::<FreedDevices>)]
    freed_devices: Option<FreedDevices>,
    /// Cache the frozen layers' output per sample so later epochs skip them (on only where
    /// reading is measured to be cheaper than the forward; needs --auto-pipe, which takes the
    /// frozen layers out of the pipeline for the cache to stand in for). Frozen layers run without dropout,
    /// deterministically, so a cached value is exactly what the forward would give (in the
    /// activations' dtype, unless `elastic.cache_dtype` says bf16).
    #[arg(long, num_args = 0..=1, default_missing_value = "true")]
    cache: Option<bool>,
    /// Host memory the cache may hold before it spills to disk, e.g. `4GiB` or a byte count.
    #[arg(long, value_parser = setting_bytes)]
    cache_bytes: Option<usize>,
    /// Directory of the cache's spill file (default: the run's output directory, `cache/`).
    #[arg(long)]
    cache_dir: Option<PathBuf>,
}

/// `section.key=value` overrides for the flags that were given.
fn overrides(pipeline: &PipelineArgs, elastic: &ElasticArgs) -> Vec<String> {
    let mut out = Vec::new();
    let mut set = |key: &str, value: Option<String>| {
        if let Some(v) = value {
            out.push(format!("{key}={v}"));
        }
    };
    // Enums and strings as TOML values, through their serde names.
    let json = |v: Option<serde_json::Value>| v.map(|v| v.to_string());
    set("pipeline.devices", pipeline.devices.map(|v| v.to_string()));
    set("pipeline.pipeline_len", pipeline.pipeline_len.map(|v| v.to_string()));
    set("pipeline.micro_batches", pipeline.micro_batches.map(|v| v.to_string()));
    set("pipeline.replicas", pipeline.replicas.map(|v| v.to_string()));
    set("pipeline.schedule", json(pipeline.schedule.and_then(|k| serde_json::to_value(k).ok())));
    set("pipeline.chunks", pipeline.chunks.map(|v| v.to_string()));
    set("pipeline.profile", pipeline.profile.then(|| "true".into()));
    set("pipeline.memory_limit", pipeline.memory_limit.map(|v| v.to_string()));
    set("pipeline.recompute", json(pipeline.recompute.and_then(|r| serde_json::to_value(r).ok())));
    set("pipeline.across_processes", pipeline.across_processes.then(|| "true".into()));
    set("pipeline.token_slices", json(pipeline.token_slices.as_ref().and_then(|t| serde_json::to_value(t).ok())));
    set("elastic.freeze", json(elastic.freeze.and_then(|f| serde_json::to_value(f).ok())));
    // (TOML spells the float's specials in lowercase: `nan`, `inf`; Rust's `NaN` is a string.)
    let float = |v: f64| if v.is_finite() { format!("{v:?}") } else { format!("{v}").to_lowercase() };
    set("elastic.alpha", elastic.alpha.map(float));
    set("elastic.freeze_interval", json(elastic.freeze_interval.and_then(|f| serde_json::to_value(f).ok())));
    set("elastic.max_weight_change", elastic.max_weight_change.map(float));
    set("elastic.auto_pipe", elastic.auto_pipe.map(|v| v.to_string()));
    set("elastic.auto_dp", elastic.auto_dp.map(|v| v.to_string()));
    set("elastic.freed_devices", json(elastic.freed_devices.and_then(|f| serde_json::to_value(f).ok())));
    set("elastic.cache", elastic.cache.map(|v| v.to_string()));
    set("elastic.cache_bytes", elastic.cache_bytes.map(|v| v.to_string()));
    set("elastic.cache_dir", json(elastic.cache_dir.as_ref().map(|v| v.display().to_string().into())));
    out
}

#[derive(Clone, Copy, ValueEnum)]
enum PrecisionArg {
    F32,
    Bf16,
    Auto,
}

/// A count that must be at least 1 (steps, inputs per forward pass), refused by clap as a
/// usage error otherwise; at most what a [`setting`] holds.
fn at_least_one<T>(s: &str) -> std::result::Result<T, String>
where
    T: std::str::FromStr + Copy + TryInto<i64> + Default + PartialEq,
{
    match setting::<T>(s)? {
        n if n == T::default() => Err("must be at least 1".into()),
        n => Ok(n),
    }
}

/// A `--threads` count: a whole number up to the most one process opens (a typo of a million
/// is an error, not a million threads), as for `output.threads`.
fn thread_count(s: &str) -> std::result::Result<usize, String> {
    use pipetransformer::device::MOST_THREADS;
    match setting::<usize>(s)? {
        n if n > MOST_THREADS => Err(format!("{n} threads; expected at most {MOST_THREADS} (0: all cores)")),
        n => Ok(n),
    }
}

/// Warns of a `--threads` beyond the machine's cores, as the config does of `output.threads`:
/// only the cores are used.
fn warn_beyond_cores(threads: usize) {
    if let Some(w) = pipetransformer::device::threads_beyond_cores(&format!("--threads {threads}"), threads) {
        eprintln!("warning: {w}");
    }
}

/// A whole number for a flag that sets a config key (`--devices` is `pipeline.devices`): at
/// most a TOML integer's largest, which the config holds, so that a larger one is refused
/// naming the flag rather than the `--set` it becomes.
fn setting<T: std::str::FromStr + Copy + TryInto<i64>>(s: &str) -> std::result::Result<T, String> {
    let n: T = s.trim().parse().map_err(|_| format!("`{s}` is not a whole number"))?;
    within_a_setting(s, n)
}

/// [`setting`] for a byte count (`8GiB`, `512MiB`, `1000000`; [`pipetransformer::bytes::parse`]).
fn setting_bytes(s: &str) -> std::result::Result<usize, String> {
    within_a_setting(s, pipetransformer::bytes::parse(s)?)
}

fn within_a_setting<T: Copy + TryInto<i64>>(s: &str, n: T) -> std::result::Result<T, String> {
    match n.try_into() {
        Ok(_) => Ok(n),
        Err(_) => Err(format!("`{s}` is beyond what a setting holds (at most {})", i64::MAX)),
    }
}

/// A flag's value through its type's parser. clap names the flag; a config key the flag sets
/// (`pipeline.token_slices`) stays named, a bare parser name (`device`) does not.
fn parse_from_str<T: std::str::FromStr<Err = pipetransformer::Error>>(s: &str) -> std::result::Result<T, String> {
    s.parse().map_err(|e: pipetransformer::Error| match e {
        pipetransformer::Error::Config { field, message } if !field.contains('.') => message,
        other => other.to_string(),
    })
}

/// A number, finite and ≥ 0, or an error saying `s` is not `a` (a learning rate, ...).
fn non_negative(s: &str, a: &str) -> std::result::Result<f64, String> {
    match s.parse::<f64>() {
        Ok(v) if v.is_finite() && v >= 0.0 => Ok(v),
        _ => Err(format!("`{s}` is not {a}: expected a number, finite and ≥ 0")),
    }
}

/// Seconds between two things.
fn parse_seconds(s: &str) -> std::result::Result<f64, String> {
    non_negative(s, "a number of seconds")
}

fn parse_lr(s: &str) -> std::result::Result<f64, String> {
    non_negative(s, "a learning rate")
}

impl DeviceArgs {
    /// The precision of device `index`: `--precision`, else `default` (a run config's
    /// `output.precision`; f32 without one), `auto` resolved for the device.
    fn precision(self, default: PrecisionChoice, index: usize) -> Result<Precision> {
        let choice = match self.precision {
            None => default,
            Some(PrecisionArg::F32) => PrecisionChoice::F32,
            Some(PrecisionArg::Bf16) => PrecisionChoice::Bf16,
            Some(PrecisionArg::Auto) => PrecisionChoice::Auto,
        };
        Ok(choice.resolve(self.device, index)?)
    }
    /// Device 0, in `--precision` (f32 without it), on `threads` (`--threads`) CPU threads.
    fn open(self, threads: usize) -> Result<AnyDevice> {
        warn_beyond_cores(threads);
        Ok(pipetransformer::run::open_device(self.device, 0, threads, self.precision(PrecisionChoice::F32, 0)?)?)
    }
}

/// Runs the generic function `$f::<D>(&dev, args...)` on whichever device `$any` holds.
macro_rules! on_device {
    ($any:expr, $f:ident($($arg:expr),*)) => {
        match $any {
            AnyDevice::Cpu(dev) => $f(&dev, $($arg),*),
            AnyDevice::Gpu(dev) => $f(&dev, $($arg),*),
        }
    };
}

#[derive(Subcommand)]
enum Command {
    /// Train as a run configuration says: load the data and the (pretrained) model, train with
    /// a progress bar, evaluate each epoch, checkpoint, and write metrics.jsonl, summary.json,
    /// report.html and the exported model (safetensors + config.json) to the run's output
    /// directory. One run writes a directory at a time: a second is refused while the first goes
    /// on. Ctrl-C or SIGTERM stops after the step under way, its checkpoint and report written
    /// (`--resume` goes on).
    // (A negative number is a flag's value, refused by its own check, not an unknown flag.)
    #[command(allow_negative_numbers = true)]
    Train {
        /// Run configuration (TOML; see configs/).
        #[arg(long, default_value = DEFAULT_CONFIG)]
        config: PathBuf,
        /// Override a configuration value, e.g. `--set train.lr=3e-5` (repeatable).
        #[arg(long = "set", value_name = "KEY=VALUE")]
        set: Vec<String>,
        /// Continue from the checkpoint in the run's output directory.
        #[arg(long, conflicts_with = "fresh")]
        resume: bool,
        /// Start over even if the output directory holds a checkpoint (or an earlier run's
        /// summary or exported model without one: refused otherwise). Once the first step is
        /// done (not before: a run that fails or stops sooner changes nothing), the earlier
        /// run's files move aside: checkpoint.ckpt to checkpoint.previous.ckpt, metrics.jsonl to
        /// metrics.previous.jsonl, and summary.json, report.html, model/ and best/ alike.
        #[arg(long)]
        fresh: bool,
        #[command(flatten)]
        device: DeviceArgs,
        #[command(flatten)]
        pipeline: PipelineArgs,
        #[command(flatten)]
        elastic: ElasticArgs,
        /// Write a Chrome trace of the steps and elastic transitions (open in Perfetto or
        /// chrome://tracing). In a launched run rank r > 0 writes its own beside it
        /// (`NAME.rank{r}.EXT`). The run's config file and the files it writes in its
        /// output.dir are refused.
        #[arg(long)]
        trace: Option<PathBuf>,
        /// Seconds between progress lines when the output is not a terminal (CI, a log file;
        /// `output.progress_every`, default 30); a terminal shows a progress bar.
        #[arg(long, value_parser = parse_seconds)]
        progress_every: Option<f64>,
        /// CPU threads of the run's cpu devices, shared by them (`output.threads`; 0: all
        /// cores); on `cuda-emu` devices, the OS threads that run a launch's blocks, shared by
        /// the devices likewise.
        #[arg(long, value_parser = thread_count)]
        threads: Option<usize>,
    },
    /// Run a trained model on new inputs: texts (BERT), images (ViT: PNG, JPEG or PGM files, IDX
    /// files, CSV files of raw pixel rows without labels (gzip-compressed or not), one such
    /// row given as the input itself, or a folder of such files), or prompts to continue (GPT). Writes one JSON object
    /// per input and line (a table with a header on a terminal); an input that fails gets an
    /// error line and the rest go on (the exit status is then 1).
    #[command(allow_negative_numbers = true)]
    Predict {
        /// An exported model folder (a run's `model/`, or `best/`), a run's output folder, or a run's
        /// `checkpoint.ckpt` (with the `model/` folder beside it; a `checkpoint.previous.ckpt`
        /// with the `model.previous/` set aside with it).
        #[arg(long)]
        model: PathBuf,
        /// Inputs; without them (and without --file) lines are read from standard input.
        #[arg(conflicts_with = "file")]
        inputs: Vec<String>,
        /// Read inputs from this file, one per line (`-`: standard input; gzip-compressed or
        /// not).
        #[arg(long)]
        file: Option<PathBuf>,
        /// Inputs per forward pass (at least 1; a GPT continues one prompt at a time).
        #[arg(long, default_value_t = 32, value_parser = at_least_one::<usize>)]
        batch_size: usize,
        /// json (one object per line) or table; default: table on a terminal, else json.
        #[arg(long, value_enum)]
        format: Option<FormatArg>,
        /// GPT: characters to generate (at least 1).
        #[arg(long, default_value_t = Sampling::default().max_new_tokens)]
        max_new_tokens: usize,
        /// GPT: softmax temperature, finite and ≥ 0 (0: always the most probable character).
        #[arg(long, default_value_t = Sampling::default().temperature)]
        temperature: f64,
        /// GPT: draw from the k most probable characters only (0: all; needs a temperature above 0).
        #[arg(long, default_value_t = Sampling::default().top_k)]
        top_k: usize,
        /// GPT: seed of the draws (needs a temperature above 0).
        #[arg(long, default_value_t = Sampling::default().seed)]
        seed: u64,
        /// CPU threads (0: all cores; never more than the cores).
        #[arg(long, default_value_t = 0, value_parser = thread_count)]
        threads: usize,
        #[command(flatten)]
        device: ModelDeviceArgs,
    },
    /// Score a trained model: on the evaluation split of a run config's dataset (`--config`), or on
    /// a file of labelled rows (`--file`: `label<TAB>text` for BERT, CSV pixels then the label
    /// for ViT, or for ViT a folder of class subfolders of images). Prints accuracy and, for a classifier, per-class precision/recall/F1 and the
    /// confusion matrix; for a language model, loss and perplexity.
    #[command(allow_negative_numbers = true)]
    Evaluate {
        /// An exported model folder (a run's `model/`, or `best/`), a run's output folder, or a run's
        /// `checkpoint.ckpt` (with the `model/` folder beside it; a `checkpoint.previous.ckpt`
        /// with the `model.previous/` set aside with it).
        #[arg(long)]
        model: PathBuf,
        /// A run configuration whose dataset's evaluation split to score on (its test split,
        /// or its validation split when `data.validation_fraction` > 0), in its
        /// `output.precision` unless `--precision` is given. A split that would hold samples the
        /// model trained on (another `data.split_seed` or fraction than its run's) is refused.
        #[arg(long, conflicts_with = "file")]
        config: Option<PathBuf>,
        /// Override a value of `--config` (repeatable).
        #[arg(long = "set", value_name = "KEY=VALUE", conflicts_with = "file")]
        set: Vec<String>,
        /// A file of labelled rows to score on (`-`: standard input; gzip-compressed or not),
        /// or for an image model a folder of class subfolders (each named by a class) holding
        /// PNG, JPEG or PGM images.
        #[arg(long)]
        file: Option<PathBuf>,
        /// Inputs per forward pass (at least 1): rows of `--file` (default 64), or the
        /// dataset's evaluation batches (default: the config's `data.eval_batch_size`, else
        /// its `data.batch_size`).
        #[arg(long, value_parser = at_least_one::<usize>)]
        batch_size: Option<usize>,
        /// CPU threads (0: all cores; never more than the cores). Default: the `--config`'s
        /// `output.threads`, else all cores.
        #[arg(long, value_parser = thread_count)]
        threads: Option<usize>,
        #[command(flatten)]
        device: ModelDeviceArgs,
    },
    /// Print how a run would be spread over devices: the partition with each stage's time and
    /// memory, the schedule, and its predicted bubble. Nothing is trained.
    #[command(allow_negative_numbers = true)]
    Plan {
        /// Run configuration (TOML; see configs/).
        #[arg(long)]
        config: PathBuf,
        /// Override a configuration value (repeatable).
        #[arg(long = "set", value_name = "KEY=VALUE")]
        set: Vec<String>,
        #[command(flatten)]
        pipeline: PipelineArgs,
        #[command(flatten)]
        elastic: ElasticArgs,
    },
    /// Train a small randomly initialised model on one fixed random batch until it memorises it
    /// (forward, backward and AdamW working together); prints the loss curve.
    #[command(allow_negative_numbers = true)]
    Overfit {
        /// Model family.
        #[arg(long, value_enum, default_value = "gpt")]
        model: Family,
        /// Optimizer steps.
        #[arg(long, default_value_t = 200, value_parser = at_least_one::<u64>)]
        steps: u64,
        /// Peak learning rate (linear warmup over the first 10% of steps, cosine decay after).
        #[arg(long, default_value_t = 3e-3, value_parser = parse_lr)]
        lr: f64,
        /// Seed of the weights and the batch.
        #[arg(long, default_value_t = 0)]
        seed: u64,
        /// CPU threads (0: all cores; never more than the cores).
        #[arg(long, default_value_t = 0, value_parser = thread_count)]
        threads: usize,
        #[command(flatten)]
        device: DeviceArgs,
    },
    /// Time training steps (forward, backward, AdamW) of the MiniLM-shaped encoder — 6 layers,
    /// hidden 384, 12 heads, MLP 1536 — on --device at --precision, and compare the achieved
    /// rate with the machine's large-GEMM rate in the step's precision, measured in the same
    /// run (on a GPU: the MFU against its datasheet peak). On cpu without --precision it times f32 and bf16; on cpu
    /// and cuda it also times PyTorch's f32 and bf16-autocast steps on the same device when
    /// PT_PYTHON (default python3; `none` skips them) has torch.
    #[command(allow_negative_numbers = true)]
    BenchStep {
        /// Timed steps.
        #[arg(long, default_value_t = 5, value_parser = at_least_one::<usize>)]
        steps: usize,
        /// Untimed steps first (buffer pool warm-up).
        #[arg(long, default_value_t = 1)]
        warmup: usize,
        /// Sequences per batch.
        #[arg(long, default_value_t = 16, value_parser = at_least_one::<usize>)]
        batch: usize,
        /// Tokens per sequence.
        #[arg(long, default_value_t = 128, value_parser = at_least_one::<usize>)]
        seq: usize,
        /// CPU threads (0: all cores; never more than the cores).
        #[arg(long, default_value_t = 0, value_parser = thread_count)]
        threads: usize,
        /// The Python whose PyTorch times the same step for comparison on cpu or cuda (skipped,
        /// with a note, when it has no torch); `none` skips it. Default: `PT_PYTHON`, else python3.
        #[arg(long)]
        python: Option<String>,
        #[command(flatten)]
        device: DeviceArgs,
    },
    /// Run a command (e.g. `train ...`) as several processes that train one model together,
    /// one per device, with torchrun's conventions: each gets RANK, LOCAL_RANK, WORLD_SIZE,
    /// LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT and the run's secret PT_RDZV_TOKEN, trains
    /// its shard of every global batch and sums gradients with the others; rank 0 writes the
    /// files. The first process to fail ends the launch with its rank. A collective waits
    /// PT_COLLECTIVE_TIMEOUT seconds (default 300) for a peer, and the rendezvous as long.
    // (A negative count is refused as the flag's value, not taken for the command to run.)
    #[command(allow_negative_numbers = true)]
    Launch {
        /// Processes on this node (one per GPU, or cpu processes sharing the cores).
        #[arg(long, default_value_t = 1)]
        nproc_per_node: usize,
        /// Nodes taking part (each runs `launch` with its --node-rank).
        #[arg(long, default_value_t = 1)]
        nnodes: usize,
        /// This node's index, 0..nnodes.
        #[arg(long, default_value_t = 0)]
        node_rank: usize,
        /// Where rank 0 listens and the others connect: HOST:PORT. Default 127.0.0.1:29500,
        /// this machine alone: a run over several nodes names node 0's address.
        #[arg(long)]
        rdzv: Option<String>,
        /// The run's shared secret (never printed); default PT_RDZV_TOKEN, else a random one
        /// (single node only). Prefer PT_RDZV_TOKEN: other users of a node can read a flag's
        /// value in its process list. A process that knows it but counts the run another size
        /// (another launch on the same address) ends the rendezvous: give each run its own.
        #[arg(long)]
        rdzv_token: Option<String>,
        /// The command each process runs: `-- train --config ...` (only `train` joins a
        /// launched run).
        #[arg(last = true, required = true)]
        command: Vec<String>,
    },
    /// Compile every CUDA kernel with NVRTC for sm_80 and sm_90 and print what `ptxas -v`
    /// reports (registers, shared memory, stack, spills); fails if any kernel spills.
    Kernels {
        /// Rewrite the generated table in this markdown file (docs/KERNELS.md) instead of
        /// printing it.
        #[arg(long)]
        update: Option<PathBuf>,
    },
}

fn main() -> std::process::ExitCode {
    match run() {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            // (Lossy: a path that is not UTF-8 is the user's to give, not a panic here.)
            let flags: Vec<String> = std::env::args_os().skip(1).map(|a| a.to_string_lossy().into_owned()).collect();
            eprint!("{}{}", error_report(&e), flag_note(&e, &flags));
            match e.chain().any(|c| matches!(c.downcast_ref(), Some(pipetransformer::Error::Interrupted { .. }))) {
                true => std::process::ExitCode::from(pipetransformer::error::INTERRUPTED_EXIT_CODE),
                false => std::process::ExitCode::FAILURE,
            }
        }
    }
}

/// `Error: ` and the error, then each cause on a line of its own, as anyhow prints them, but
/// without a cause the line above already quotes (the library's errors print their source's
/// words beside the path or field they name) and without a backtrace, even under
/// `RUST_BACKTRACE=1`: what reaches here is a user's mistake or the machine's, and its words
/// say what to change.
fn error_report(e: &anyhow::Error) -> String {
    let messages: Vec<String> = e.chain().map(|c| c.to_string()).collect();
    let mut report = format!("Error: {}\n", messages[0]);
    // A cause is left out where the message before it (printed or not) already quotes it.
    let causes: Vec<&String> = messages.windows(2).filter(|w| !w[0].contains(w[1].as_str())).map(|w| &w[1]).collect();
    if !causes.is_empty() {
        report += "\nCaused by:\n";
        for (i, c) in causes.iter().enumerate() {
            report += &match causes.len() {
                1 => format!("    {c}\n"),
                _ => format!("    {i}: {c}\n"),
            };
        }
    }
    report
}

/// Where the setting an error names (`pipeline.memory_limit`) came from a flag the user typed
/// (`--memory-limit`, among `args`): a line that says so, as the library names settings by
/// their config keys. Empty otherwise.
fn flag_note(e: &anyhow::Error, args: &[String]) -> String {
    let field = e.chain().find_map(|c| match c.downcast_ref() {
        Some(pipetransformer::Error::Config { field, .. }) if !field.starts_with("--") => Some(field.clone()),
        _ => None,
    });
    // The typed flags set `pipeline.*` and `elastic.*` settings only (`overrides`): elsewhere a
    // key's name can be another flag's (`model.config` is not `--config`'s file).
    // (A bare pipeline field from a layer below, `devices`, is `pipeline.devices`.)
    let bare = |f: &str| pipetransformer::run::config::PIPELINE_FIELDS.contains(&f);
    let field = field.map(|f| if bare(&f) { format!("pipeline.{f}") } else { f });
    let Some(field) = field.filter(|f| f.starts_with("pipeline.") || f.starts_with("elastic.")) else {
        return String::new();
    };
    let key = field.rsplit_once('.').map_or(field.as_str(), |(_, key)| key);
    let flag = format!("--{}", key.replace('_', "-"));
    let typed = args.iter().any(|a| *a == flag || a.starts_with(&format!("{flag}=")));
    match typed {
        true => format!("(`{field}` is the setting {flag} gives)\n"),
        false => String::new(),
    }
}

fn run() -> Result<()> {
    pipetransformer::run::keep_freed_memory();
    let command = Cli::parse().command;
    if !matches!(command, Command::Train { .. } | Command::Launch { .. }) {
        // A report piped into `head` ends quietly when the pipe closes, as any Unix tool's
        // does (Rust ignores SIGPIPE, and `println!` then panics). Training and its launcher
        // keep ignoring it: they write checkpoints and speak to their peers over sockets.
        // SAFETY: restoring a signal's default disposition, before any thread is started.
        unsafe { libc::signal(libc::SIGPIPE, libc::SIG_DFL) };
    }
    match command {
        Command::Train {
            config,
            mut set,
            resume,
            fresh,
            device,
            pipeline,
            elastic,
            trace,
            progress_every,
            threads,
        } => {
            set.extend(train_settings(&pipeline, &elastic, progress_every, threads));
            let config_file = config;
            let process = pipetransformer::run::ProcessEnv::from_env()?;
            // (A launched run's warnings once on each node, from its first process: every
            // process reads the same config, and a node's cores are its own.)
            let config = read_config(&config_file, &set)?;
            if process.as_ref().is_none_or(|p| p.local_rank() == 0) {
                for w in &config.warnings {
                    eprintln!("warning: {w}");
                }
            }
            let (_, count) = config.pipeline.resolve()?;
            // A launched process takes its share of the node: its own GPUs, its cores.
            let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
            let (first, threads) = match &process {
                Some(p) => p.node_share(count, config.output.threads, cores),
                None => (0, config.output.threads),
            };
            if let Some(w) = process.as_ref().and_then(|p| p.oversubscribes(config.output.threads, cores)) {
                eprintln!("warning: {w}");
            }
            // Resolved for the whole node, so that every process of a launched run picks the
            // same backend.
            let (asked, gpus) = (device.device, pipetransformer::device::cuda::device_count());
            let needed = process.as_ref().map_or(count, |p| p.local_world.saturating_mul(count));
            let device = DeviceArgs { device: asked.resolve_for(needed), ..device };
            if asked == DeviceKind::Auto && device.device == DeviceKind::Cpu && gpus > 0 {
                eprintln!(
                    "--device auto: the run needs {needed} GPUs and the driver sees {gpus}; running on cpu \
                     (--device cuda --devices {gpus} --pipeline-len 1 runs on the GPUs as replicas)"
                );
            }
            let run = TrainRun { resume, fresh, trace: trace.as_deref(), config_file: &config_file, process };
            let precision = device.precision(config.output.precision, first)?;
            match pipetransformer::run::open_devices_at(device.device, first, count, threads, precision)? {
                AnyDevices::Cpu(devs) => train(devs, config, &run),
                AnyDevices::Gpu(devs) => train(devs, config, &run),
            }
        }
        Command::Predict {
            model,
            inputs,
            file,
            batch_size,
            format,
            max_new_tokens,
            temperature,
            top_k,
            seed,
            threads,
            device,
        } => {
            let sampling = Sampling { max_new_tokens, temperature, top_k, seed };
            // Before anything loads: a usage error, once.
            if let Err(e) = sampling.check() {
                use clap::CommandFactory;
                // (With `predict`'s usage line, as clap's own refusals of its flags give.)
                let mut cli = Cli::command();
                cli.build();
                let kind = clap::error::ErrorKind::ValueValidation;
                match cli.find_subcommand_mut("predict") {
                    Some(predict) => predict.error(kind, e).exit(),
                    None => cli.error(kind, e).exit(),
                }
            }
            let device = DeviceArgs::from(device);
            let request = PredictRequest { model, inputs, file, batch_size, format, sampling };
            match device.open(threads)? {
                AnyDevice::Cpu(dev) => predict(dev, request),
                AnyDevice::Gpu(dev) => predict(dev, request),
            }
        }
        Command::Evaluate { model, config, mut set, file, batch_size, threads, device } => {
            let device = DeviceArgs::from(device);
            let data = match (config, file) {
                (Some(config), _) => {
                    set.extend(batch_size.map(|n| format!("data.eval_batch_size={n}")));
                    // The flag goes through the config, so its warning names the count used.
                    set.extend(threads.map(|n| format!("output.threads={n}")));
                    EvalData::Dataset(Box::new(load_config(&config, &set)?))
                }
                (None, Some(file)) => EvalData::Rows(file, batch_size.unwrap_or(64)),
                (None, None) => bail!("give --config (a dataset's test split) or --file (labelled rows)"),
            };
            let threads = match &data {
                EvalData::Dataset(config) => config.output.threads,
                EvalData::Rows(..) => threads.inspect(|&n| warn_beyond_cores(n)).unwrap_or(0),
            };
            // With a run's config, in the precision that run computed in: its own metrics.
            let default = match &data {
                EvalData::Dataset(config) => config.output.precision,
                EvalData::Rows(..) => PrecisionChoice::F32,
            };
            let precision = device.precision(default, 0)?;
            match pipetransformer::run::open_device(device.device, 0, threads, precision)? {
                AnyDevice::Cpu(dev) => evaluate(dev, &model, &data),
                AnyDevice::Gpu(dev) => evaluate(dev, &model, &data),
            }
        }
        Command::Plan { config, mut set, pipeline, elastic } => {
            set.extend(overrides(&pipeline, &elastic));
            plan(load_config(&config, &set)?)
        }
        Command::Overfit { model, steps, lr, seed, threads, device } => {
            on_device!(device.open(threads)?, overfit(model.into(), steps, lr, seed, |line| console!("{line}")))?;
            Ok(())
        }
        Command::BenchStep { steps, warmup, batch, seq, threads, python, device } => {
            let positions = match bench::minilm_shaped() {
                pipetransformer::model::ModelConfig::Bert(c) => c.max_position_embeddings,
                _ => usize::MAX,
            };
            if seq > positions {
                bail!("--seq {seq}: the MiniLM-shaped model holds {positions} positions");
            }
            // Every activation is batch × seq × 384 floats: past this the machine, not the
            // engine, is what gets measured (or what fails).
            const MOST_TOKENS: usize = 1 << 20;
            if batch.checked_mul(seq).is_none_or(|t| t > MOST_TOKENS) {
                bail!("--batch {batch} × --seq {seq}: at most {MOST_TOKENS} tokens a step");
            }
            // A Python the user named must run (else the comparison they asked for is missing
            // from a report that looks whole); the default, python3, may be absent: skipped.
            let named = match (python, std::env::var("PT_PYTHON").ok()) {
                (Some(p), _) => Some(("--python", p)),
                (None, Some(p)) => Some(("PT_PYTHON", p)),
                (None, None) => None,
            };
            if let Some((setting, python)) = named.as_ref().filter(|(_, p)| p != "none")
                && let Err(e) = std::process::Command::new(python).arg("--version").output()
            {
                bail!("{setting} {python}: cannot run it ({e}); name a Python, or none to skip the PyTorch comparison");
            }
            let python = named.map_or_else(|| "python3".into(), |(_, p)| p);
            // On cpu without --precision: f32, then bf16.
            let first = device.open(threads)?;
            let precision = device.precision(PrecisionChoice::F32, 0)?;
            let bf16 = (matches!(first, AnyDevice::Cpu(_)) && device.precision.is_none())
                .then_some((Precision::Bf16, || {
                    pipetransformer::run::open_device(device.device, 0, threads, Precision::Bf16)
                }));
            let bench = bench::StepBench { steps, warmup, batch, seq, python, threads };
            let report = bench::bench_step(first, precision, bf16, device.device.resolve(), bench)?;
            out_text!("{report}");
            if let Some((bench::TorchStep::Failed(_), _)) = report.torch {
                bail!("the PyTorch comparison failed (the last line above); our timings stand");
            }
            Ok(())
        }
        Command::Launch { nproc_per_node, nnodes, node_rank, rdzv, rdzv_token, command } => {
            // Only `train` joins a launched run; any other command would run once per process.
            let first = command.first().map(String::as_str).unwrap_or_default();
            if first != "train" {
                let why = match <Cli as clap::CommandFactory>::command().find_subcommand(first) {
                    Some(_) => "which runs on its own: start it without launch",
                    None => "which is not a command of this program",
                };
                bail!(
                    "launch runs `train` in each process (`launch ... -- train --config ...`); got `{}`, {why}",
                    command.join(" ")
                );
            }
            // The command's flags and its run config are checked once, here, before any rank
            // starts: a mistake in them is said once, not by every rank.
            let program_name = std::iter::once("pipetransformer".to_string());
            let train = Cli::try_parse_from(program_name.chain(command.iter().cloned())).unwrap_or_else(|e| e.exit());
            if let Command::Train { config, mut set, pipeline, elastic, progress_every, threads, .. } = train.command {
                set.extend(train_settings(&pipeline, &elastic, progress_every, threads));
                read_config(&config, &set)?;
            }
            let token = rdzv_token.or_else(|| std::env::var("PT_RDZV_TOKEN").ok());
            let grace = pipetransformer::run::launch::GRACE;
            let options = pipetransformer::run::LaunchOptions { nproc_per_node, nnodes, node_rank, rdzv, token, grace };
            let program = std::env::current_exe().context("finding this program to launch it")?;
            Ok(pipetransformer::run::launch(&options, &program, &command)?)
        }
        Command::Kernels { update } => kernels(update.as_deref()),
    }
}

fn kernels(update: Option<&Path>) -> Result<()> {
    use pipetransformer::device::kernels;
    // The document to update is read, and its markers checked, before the kernels compile.
    let doc = update
        .map(|path| -> Result<String> {
            let doc = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
            kernels::with_table(&doc, "").with_context(|| format!("updating {}", path.display()))?;
            Ok(doc)
        })
        .transpose()?;
    let table = kernels::resource_table()?;
    match update.zip(doc) {
        None => out_text!("{table}"),
        Some((path, doc)) => {
            let fresh = kernels::with_table(&doc, &table).with_context(|| format!("updating {}", path.display()))?;
            pipetransformer::files::write_atomic(path, |w| std::io::Write::write_all(w, fresh.as_bytes()))?;
            out!("updated the ptxas table in {}", path.display());
        }
    }
    Ok(())
}

/// The run config `train` reads without `--config`: the main job's.
const DEFAULT_CONFIG: &str = "configs/minilm-rt.toml";

/// The `--set` settings `train`'s own flags stand for.
fn train_settings(
    pipeline: &PipelineArgs,
    elastic: &ElasticArgs,
    progress_every: Option<f64>,
    threads: Option<usize>,
) -> Vec<String> {
    let mut set = overrides(pipeline, elastic);
    set.extend(progress_every.map(|s| format!("output.progress_every={s:?}")));
    set.extend(threads.map(|n| format!("output.threads={n}")));
    set
}

/// [`read_config`], its warnings written to standard error.
fn load_config(path: &Path, overrides: &[String]) -> Result<RunConfig> {
    let config = read_config(path, overrides)?;
    for w in &config.warnings {
        eprintln!("warning: {w}");
    }
    Ok(config)
}

/// The run config at `path` with `overrides` applied, checked; its warnings kept in it.
fn read_config(path: &Path, overrides: &[String]) -> Result<RunConfig> {
    if path == Path::new(DEFAULT_CONFIG) && !path.exists() {
        let cwd = std::env::current_dir().map_or_else(|_| "?".into(), |d| d.display().to_string());
        bail!(
            "{DEFAULT_CONFIG} (the run config `train` reads without --config) is not under the working directory \
             {cwd}: run from the project's folder, or pass --config"
        );
    }
    let config = RunConfig::load(path, overrides).with_context(|| match overrides.is_empty() {
        true => format!("the run config {}", path.display()),
        false => format!("the run config {} with the command line's settings (--set and flags)", path.display()),
    })?;
    Ok(config)
}

/// Ctrl-C (SIGINT) or a scheduler's SIGTERM asks the run to stop after the step under way and
/// write its checkpoint (`train::request_stop`); a second signal ends a process of its own at
/// once (the handler resets itself). A launched run's processes agree on it, so that one asked
/// stops them all after the same step; they take every signal as that request (a scheduler
/// that signals the whole job reaches them twice, itself and through the launcher) and leave
/// ending them at once to the launcher, which kills them at its own second signal.
fn stop_on_signals(launched: bool) {
    extern "C" fn on_signal(_: libc::c_int) {
        pipetransformer::train::request_stop(); // one atomic store: async-signal-safe
    }
    pipetransformer::run::launch::catch_signals(&[libc::SIGINT, libc::SIGTERM], on_signal, !launched);
}

/// What `train` was asked besides the run config.
struct TrainRun<'a> {
    resume: bool,
    fresh: bool,
    trace: Option<&'a Path>,
    /// The run config's file (`--config`).
    config_file: &'a Path,
    /// Who this process is in a launched run.
    process: Option<pipetransformer::run::ProcessEnv>,
}

/// Output format of `predict`.
#[derive(Clone, Copy, ValueEnum)]
enum FormatArg {
    Json,
    Table,
}

/// What `predict` was asked.
struct PredictRequest {
    model: PathBuf,
    inputs: Vec<String>,
    file: Option<PathBuf>,
    batch_size: usize,
    format: Option<FormatArg>,
    sampling: Sampling,
}

/// [`Predictor::open`] with the path named in its error (a checkpoint, a model's folder, or
/// a file that is neither, which the error goes on to say).
fn load_predictor<D: Device>(dev: D, path: &Path) -> Result<Predictor<D>> {
    Predictor::open(dev, path).with_context(|| format!("loading the model from {}", path.display()))
}

/// What `evaluate` scores on.
enum EvalData {
    Dataset(Box<RunConfig>),
    Rows(PathBuf, usize),
}

fn evaluate<D: Device>(dev: D, model: &Path, data: &EvalData) -> Result<()> {
    // On stderr: stdout is the metrics alone.
    let split = match data {
        EvalData::Dataset(c) => format!(", the {} split", c.data.evaluated_on()),
        EvalData::Rows(..) => String::new(),
    };
    eprintln!("evaluating {} on {}{split}", model.display(), dev.name());
    let predictor = load_predictor(dev, model)?;
    let metrics = match data {
        EvalData::Dataset(config) => {
            let metrics = predictor.evaluate_dataset(config).context("evaluating on the dataset")?;
            for unlike in predictor.unlike_its_run(config) {
                eprintln!("note: {unlike}: the inputs scored are not those the run's evaluations scored");
            }
            metrics
        }
        EvalData::Rows(path, batch_size) => {
            let rows = predictor.labelled_rows(path, *batch_size)?;
            if rows.cut > 0 {
                eprintln!("note: {} texts were cut to the run's data.max_len, as training cut them", rows.cut);
            }
            predictor.evaluate(rows.batches)?
        }
    };
    let mut report = format!("{} targets: {metrics}\n\n", metrics.count);
    if let Some(confusion) = &metrics.confusion {
        report += &confusion.report(predictor.labels());
    }
    write_stdout(&report)
}

/// Writes to standard output; a reader that went away (`| head`) is not an error.
fn write_stdout(text: &str) -> Result<()> {
    use std::io::Write;
    match std::io::stdout().lock().write_all(text.as_bytes()) {
        Err(e) if e.kind() != std::io::ErrorKind::BrokenPipe => {
            Err(anyhow::Error::new(e).context("writing standard output"))
        }
        _ => Ok(()),
    }
}

fn predict<D: Device>(dev: D, request: PredictRequest) -> Result<()> {
    use std::io::IsTerminal;
    let predictor = load_predictor(dev, &request.model)?;
    let stdout = std::io::stdout();
    let format = match request.format {
        Some(FormatArg::Json) => OutputFormat::JsonLines,
        Some(FormatArg::Table) => OutputFormat::Table,
        None if stdout.is_terminal() => OutputFormat::Table,
        None => OutputFormat::JsonLines,
    };
    let stdin_name = Path::new("-");
    let from_stdin =
        request.file.as_deref() == Some(stdin_name) || (request.file.is_none() && request.inputs.is_empty());
    // Someone typing at a terminal wants each line's answer at once.
    let batch_size = if from_stdin && std::io::stdin().is_terminal() { 1 } else { request.batch_size };
    let options = PredictOptions { batch_size, sampling: request.sampling, format };
    // Lines as they come (a terminal's at once), decompressed; one that is not UTF-8 fails alone.
    let lines: Box<dyn Iterator<Item = pipetransformer::Result<String>>> = match &request.file {
        _ if from_stdin => Box::new(pipetransformer::data::user_lines(stdin_name)?),
        Some(path) => Box::new(pipetransformer::data::user_lines(path)?),
        None => Box::new(request.inputs.into_iter().map(Ok)),
    };
    let (total, failed) = match predict_stream(&predictor, lines, &options, &mut stdout.lock()) {
        // The reader went away (`| head`): stop quietly.
        Err(pipetransformer::Error::Io { source, .. }) if source.kind() == std::io::ErrorKind::BrokenPipe => {
            return Ok(());
        }
        r => r?,
    };
    if failed > 0 {
        eprintln!("{failed} of {total} results failed (their lines say why)");
        std::process::exit(1);
    }
    if total == 0 {
        // Nothing to do is not a failure (an empty file through a pipe), but it is said.
        let source = match &request.file {
            _ if from_stdin => "standard input".to_string(),
            Some(path) => path.display().to_string(),
            None => "the arguments".into(),
        };
        eprintln!("no inputs: {source} held none (give one per line, in --file, or as arguments)");
    }
    Ok(())
}

fn plan(mut config: RunConfig) -> Result<()> {
    // Stages as processes are planned as one process would run them, on a device per stage:
    // the partition and the schedule are the same.
    if std::mem::take(&mut config.pipeline.across_processes) {
        // (Refused here as `train` refuses it under `launch`.)
        pipetransformer::run::check_across_processes(&config)?;
        if config.pipeline.pipeline_len.is_none() {
            bail!(
                "plan --across-processes needs the stage count, --pipeline-len (a launch takes the process count: \
                 one stage per process)"
            );
        }
        // (Each process opens one device; here the stages take one each.)
        config.pipeline.devices = None;
        out!(
            "stages as processes: planned on a device per stage in this process; a launch runs each stage in a \
             process of its own"
        );
    }
    let (_, count) = config.pipeline.resolve()?;
    let measured = config.pipeline.profile || config.elastic.auto_pipe;
    // Profiled in the precision the run would train in.
    let precision = config.output.precision.resolve(DeviceKind::Cpu, 0)?;
    let devices = match pipetransformer::run::open_devices(DeviceKind::Cpu, count, config.output.threads, precision)? {
        AnyDevices::Cpu(d) => d,
        AnyDevices::Gpu(_) => bail!("plan runs on cpu devices"),
    };
    // (Checked as `train` checks it, the cache too: its folder is made and removed again.)
    let mut job = Job::new(devices, config).context("preparing the run")?;
    out!(
        "costs: {}",
        if measured { "measured on this machine's CPU, one micro-batch" } else { "FLOPs at a nominal 100 GFLOP/s" }
    );
    // What the first step runs: a freeze table's first entry freezes before it.
    for line in job.start_elastic().context("the elastic loop's start")? {
        out!("before the first step: {line}");
    }
    // A slicing of the run's own that the first step runs is priced as `auto`'s are, to
    // compare with it (where the layer cannot be measured, the plan stands without).
    let priced = job.price_given_slices();
    out_text!("{}", job.printed_plan());
    if let Some(line) = job.devices_waiting() {
        out!("{line}");
    }
    if let Err(e) = priced {
        out!("token slices as given: not priced on this machine ({e})");
    }
    if let Some(lines) = job.slicing_report(true) {
        out_text!("{lines}");
        if job.slicing.is_some() && !measured {
            out!(
                "  (the slicing's times are measured on this machine; the plan's stage times above are FLOPs at the \
                 nominal rate, which its bubble and simulation split by the slices' measured shares: compare each \
                 with its own kind)"
            );
        }
    }
    Ok(())
}

fn train<D: Device>(devices: Vec<D>, config: RunConfig, run: &TrainRun) -> Result<()> {
    use indicatif::{ProgressBar, ProgressStyle};

    let names: Vec<String> = devices.iter().map(Device::name).collect();
    console!("pipetransformer train: {} on {}", config.output.dir.display(), names.join(", "));
    if let Some(path) = run.trace {
        if let Some(why) = pipetransformer::run::trace_in_the_way(&config, path, run.config_file) {
            bail!("--trace {}: {why}", path.display());
        }
        // Written when the run ends: a path that cannot take it is refused before it starts.
        // Its folder is made as the run's output folder is (`--trace runs/trace.json` on a
        // fresh checkout).
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty() && !d.exists()) {
            std::fs::create_dir_all(dir).with_context(|| format!("--trace: creating {}", dir.display()))?;
        }
        pipetransformer::files::check_writable(path).context("--trace")?;
    }
    let group = match &run.process {
        Some(p) => {
            Some(p.join().with_context(|| format!("joining the launched run at {} as rank {}", p.addr, p.rank))?)
        }
        None => None,
    };
    pipetransformer::run::check_start(&config, run.resume, run.fresh, group.as_ref())?;
    // (Said by the process that writes the files.)
    if !run.resume
        && group.as_ref().is_none_or(|g| g.rank() == 0)
        && let Some(note) = pipetransformer::run::start_over_note(&config)
    {
        console!("note: {note}");
    }
    let ckpt = pipetransformer::run::checkpoint_path(&config);
    let mut job = match group {
        Some(group) if config.pipeline.across_processes => {
            Job::across_processes(devices, config, group).context("preparing the run")?
        }
        None if config.pipeline.across_processes => {
            bail!("pipeline.across_processes runs one stage per process: start the run with `pipetransformer launch`")
        }
        Some(group) => Job::launched(devices, config, group).context("preparing the run")?,
        None => Job::new(devices, config).context("preparing the run")?,
    };
    // A resumed run that keeps its checkpoint's plan keeps its token slices too.
    let mut planned_here = true;
    if run.resume {
        let resumed = job.resume().with_context(|| format!("resuming from {}", ckpt.display()))?;
        let p = job.trainer.position;
        console!("resumed at step {} (epoch {}, batch {})", p.step, p.epoch, p.batch);
        console_text!("{resumed}");
        planned_here = matches!(resumed.plan, pipetransformer::run::ResumedPlan::Replanned { .. });
        let slices = &job.trainer.pipeline.plan().config.token_slices;
        if !slices.is_empty() && !planned_here {
            console!("token slices (the checkpoint's): {}", TokenSlices::Lengths(slices.clone()));
        }
    }
    console_text!("{}", job.printed_plan());
    if let Some(line) = job.devices_waiting() {
        console!("{line}");
    }
    console!("communicator: {}", job.communicator);
    console_text!("{}", job.slicing_report(planned_here).unwrap_or_default());
    if run.trace.is_some() {
        job.trainer.trace = Some(Default::default());
    }
    let info = &job.info;
    let lm = job.trainer.pipeline.spec().head == HeadSpec::TiedLmHead;
    let labels = match lm {
        true => format!("a vocabulary of {} characters", info.classes),
        false => format!("{} classes", info.classes),
    };
    console!("data: {} — {} training / {} {} samples, {labels}", info.name, info.train, info.test, info.evaluated_on);
    if info.train < job.config.data.batch_size {
        eprintln!(
            "warning: data.batch_size = {} is more than the {} training samples: every step takes them all",
            job.config.data.batch_size, info.train
        );
    }
    console!(
        "model: {:?}, {} parameters{}",
        job.trainer.pipeline.spec().family,
        job.trainer.pipeline.num_params(),
        if job.config.train.freeze_embeddings { ", the embedding frozen (train.freeze_embeddings)" } else { "" }
    );
    if let Some(report) = &job.load_report {
        console!("{report}");
    }
    let total = job.trainer.lr_schedule.total_steps;
    // On stdout, with the other lines: `train … > log` keeps them all, and the bar hides (its
    // lines print directly, every `--progress-every` seconds) when stdout is not a terminal.
    let bar = ProgressBar::with_draw_target(Some(total), indicatif::ProgressDrawTarget::stdout());
    bar.set_style(
        ProgressStyle::with_template("{bar:30} {pos}/{len} batches  {msg}  [{elapsed_precise} < {eta_precise}]")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    bar.set_position(job.trainer.batches_done());
    let per_epoch = job.trainer.batches_per_epoch() as u64;
    // A hidden bar (output not a terminal) swallows println: print directly then.
    let say = |bar: &ProgressBar, line: String| if bar.is_hidden() { console!("{line}") } else { bar.println(line) };
    let started = Instant::now();
    let mut samples = 0usize;
    let mut started_at = 0u64;
    let mut lines = ProgressLines::new(job.config.output.progress_every, total);
    stop_on_signals(run.process.is_some());
    // (A resume with no step left writes the summary only where there is none.)
    let had_summary = job.config.output.dir.join("summary.json").exists();
    let summary = job.run(&mut |e| match e {
        Event::Step { step, batches, epoch, loss, lr, samples: n, bubble, .. } => {
            if bar.is_hidden() {
                let now = started.elapsed().as_secs_f64();
                if let Some(line) = lines.step(now, (*step, *batches), *epoch, *loss, *lr, *n) {
                    console!("{line}");
                }
                return;
            }
            samples += n;
            let rate = samples as f64 / started.elapsed().as_secs_f64().max(1e-9);
            // The bar counts source batches, as the schedule does (more than one a step under
            // AutoDP's `scale-lr`).
            bar.set_position(*batches);
            let bubble = bubble
                .map(|b| {
                    format!(
                        "  bubble {:.1}% (formula {:.1}%), tail {:.0} ms",
                        100.0 * b.measured,
                        100.0 * b.formula,
                        1e3 * b.tail_seconds
                    )
                })
                .unwrap_or_default();
            bar.set_message(format!("step {step}  loss {loss:.4}  lr {lr:.2e}  {rate:.1} samples/s{bubble}"));
        }
        Event::Start { step, .. } => started_at = *step,
        other => {
            if let Event::Epoch { epoch, .. } = other {
                // (A run that ends within an epoch, `train.max_steps`, ends at its length.)
                bar.set_position(((epoch + 1) * per_epoch).min(total));
            }
            if let Some(line) = event_line(other) {
                say(&bar, line);
            }
        }
    })?;
    bar.finish_and_clear();
    // A resumed run's clock and rate cover the steps this process took, not the run's total.
    let this_process = match summary.steps - started_at {
        n if started_at > 0 => format!(" ({n} of them since step {started_at}, in"),
        _ => " (in".into(),
    };
    console!(
        "done: {} step{}{this_process} {:.1} s, {:.1} samples/s)",
        summary.steps,
        if summary.steps == 1 { "" } else { "s" },
        summary.seconds,
        summary.samples_per_second
    );
    if let Some(eval) = &summary.eval {
        console!("final eval: {eval}");
    }
    if let Some(best) = &summary.best {
        let why = if summary.stopped_early { ", stopped early (train.early_stopping_patience)" } else { "" };
        console!("best {}: {} at step {}{why}", best.metric.name(), best.metric.show(best.value), best.step);
    }
    if let Some(u) = summary.unigram_baseline_loss {
        console!("unigram baseline held-out loss: {u:.4}");
    }
    if job.writes_files() {
        // (A resume with no step left keeps the checkpoint of the steps it follows, and their
        // summary where there is one: a stopped run wrote none.)
        let stepped = started_at == 0 || summary.steps > started_at;
        let files: Vec<&str> = [
            ("metrics.jsonl", true),
            ("summary.json", stepped || !had_summary),
            ("report.html", true),
            ("checkpoint.ckpt", stepped),
            ("model/", true),
            ("best/", summary.best.is_some()),
        ]
        .into_iter()
        .filter_map(|(file, written)| written.then_some(file))
        .collect();
        console!("wrote {}/{{{}}}", job.config.output.dir.display(), files.join(", "));
    }
    if let (Some(path), Some(trace)) = (run.trace, &job.trainer.trace) {
        // Each process of a launched run traces its own devices: rank 0 at the path asked for,
        // rank r beside it, so none overwrites another's.
        let path = run.process.as_ref().map_or_else(|| path.to_path_buf(), |p| p.own_file(path));
        let path = path.as_path();
        trace.write(path).with_context(|| format!("writing {}", path.display()))?;
        console!("wrote the Chrome trace {}", path.display());
    }
    Ok(())
}
