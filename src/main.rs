//! The `pipetransformer` command line.

use anyhow::{Context, Result, bail};
use clap::{Parser, Subcommand, ValueEnum};
use pipetransformer::bench;
use pipetransformer::device::{AnyDevice, AnyDevices, CpuDevice, Device, DeviceKind, Precision};
use pipetransformer::model::{Batch, BertConfig, GptConfig, Model, ModelConfig, Pooling, VitConfig};
use pipetransformer::pipeline::{PipelineConfig, ScheduleKind};
use pipetransformer::train::{LrSchedule, Optimizer, OptimizerConfig, train_step};
use std::path::{Path, PathBuf};
use std::time::Instant;

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

/// Where a command runs (`--device`, `--precision`).
#[derive(clap::Args, Clone, Copy)]
struct DeviceArgs {
    /// Backend: auto (cuda when a GPU is present, else cpu), cpu, cuda, or cuda-emu (the CUDA
    /// kernels emulated on the host: slow, for checking).
    #[arg(long, default_value = "auto", value_parser = parse_device)]
    device: DeviceKind,
    /// Storage precision on the GPU backends: f32, or bf16 activations with f32 master weights.
    #[arg(long, value_enum, default_value = "f32")]
    precision: PrecisionArg,
}

/// How a step is spread over devices (`train`, `plan`); unset flags keep the run config's
/// `[pipeline]` values.
#[derive(clap::Args, Clone, Default)]
struct PipelineArgs {
    /// Devices to use (default: replicas × pipeline length). Without GPUs, N cpu devices.
    #[arg(long)]
    devices: Option<usize>,
    /// Devices per pipeline (K).
    #[arg(long)]
    pipeline_len: Option<usize>,
    /// Micro-batches per replica per step (M).
    #[arg(long)]
    micro_batches: Option<usize>,
    /// Data-parallel replicas of the pipeline (R).
    #[arg(long)]
    replicas: Option<usize>,
    /// Schedule: gpipe, 1f1b or interleaved.
    #[arg(long, value_parser = parse_schedule)]
    schedule: Option<ScheduleKind>,
    /// Model chunks per device for the interleaved schedule (default 2 for it).
    #[arg(long)]
    chunks: Option<usize>,
    /// Partition by each unit's measured forward and backward time on the device instead of
    /// its FLOP count.
    #[arg(long)]
    profile: bool,
}

fn parse_schedule(s: &str) -> std::result::Result<ScheduleKind, String> {
    s.parse().map_err(|e: pipetransformer::Error| e.to_string())
}

impl PipelineArgs {
    /// The run config's pipeline with these flags applied.
    fn apply(&self, mut p: PipelineConfig) -> PipelineConfig {
        p.pipeline_len = self.pipeline_len.unwrap_or(p.pipeline_len);
        p.micro_batches = self.micro_batches.unwrap_or(p.micro_batches);
        p.replicas = self.replicas.unwrap_or(p.replicas);
        p.schedule = self.schedule.unwrap_or(p.schedule);
        p.chunks = match (self.chunks, p.schedule) {
            (Some(c), _) => c,
            (None, ScheduleKind::Interleaved) if p.chunks < 2 => 2,
            (None, _) => p.chunks,
        };
        p
    }
}

#[derive(Clone, Copy, ValueEnum)]
enum PrecisionArg {
    F32,
    Bf16,
}

fn parse_device(s: &str) -> std::result::Result<DeviceKind, String> {
    s.parse().map_err(|e: pipetransformer::Error| e.to_string())
}

impl DeviceArgs {
    fn precision(self) -> Precision {
        match self.precision {
            PrecisionArg::F32 => Precision::F32,
            PrecisionArg::Bf16 => Precision::Bf16,
        }
    }
    fn open(self, threads: usize) -> Result<AnyDevice> {
        Ok(AnyDevice::open(self.device, 0, threads, self.precision())?)
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
    /// a progress bar, evaluate each epoch, checkpoint, and write metrics.jsonl, summary.json and
    /// the exported model (safetensors + config.json) to the run's output directory.
    Train {
        /// Run configuration (TOML; see configs/).
        #[arg(long, default_value = "configs/minilm-rt.toml")]
        config: PathBuf,
        /// Override a configuration value, e.g. `--set train.lr=3e-5` (repeatable).
        #[arg(long = "set", value_name = "KEY=VALUE")]
        set: Vec<String>,
        /// Continue from the checkpoint in the run's output directory.
        #[arg(long, conflicts_with = "fresh")]
        resume: bool,
        /// Start over even if the output directory holds a checkpoint (it is replaced at the
        /// first save, not before).
        #[arg(long)]
        fresh: bool,
        #[command(flatten)]
        device: DeviceArgs,
        #[command(flatten)]
        pipeline: PipelineArgs,
        /// Write a Chrome trace of the pipelined steps (open in Perfetto or chrome://tracing).
        #[arg(long)]
        trace: Option<PathBuf>,
    },
    /// Print how a run would be spread over devices: the partition with each stage's time and
    /// memory, the schedule, and its predicted bubble. Nothing is trained.
    Plan {
        /// Run configuration (TOML; see configs/).
        #[arg(long)]
        config: PathBuf,
        /// Override a configuration value (repeatable).
        #[arg(long = "set", value_name = "KEY=VALUE")]
        set: Vec<String>,
        #[command(flatten)]
        pipeline: PipelineArgs,
    },
    /// Train a small randomly initialised model on one fixed random batch until it memorises it
    /// (forward, backward and AdamW working together); prints the loss curve.
    Overfit {
        /// Model family.
        #[arg(long, value_enum, default_value = "gpt")]
        model: Family,
        /// Optimizer steps.
        #[arg(long, default_value_t = 200)]
        steps: u64,
        /// Peak learning rate (linear warmup over the first 10% of steps, cosine decay after).
        #[arg(long, default_value_t = 3e-3)]
        lr: f64,
        /// Seed of the weights and the batch.
        #[arg(long, default_value_t = 0)]
        seed: u64,
        /// CPU threads (0: all cores).
        #[arg(long, default_value_t = 0)]
        threads: usize,
        #[command(flatten)]
        device: DeviceArgs,
    },
    /// Time training steps (forward, backward, AdamW) of the MiniLM-shaped encoder — 6 layers,
    /// hidden 384, 12 heads, MLP 1536 — in f32 on the CPU, and compare the achieved rate with
    /// the machine's large-GEMM rate measured in the same run.
    BenchStep {
        /// Timed steps.
        #[arg(long, default_value_t = 5)]
        steps: usize,
        /// Untimed steps first (buffer pool warm-up).
        #[arg(long, default_value_t = 1)]
        warmup: usize,
        /// Sequences per batch.
        #[arg(long, default_value_t = 16)]
        batch: usize,
        /// Tokens per sequence.
        #[arg(long, default_value_t = 128)]
        seq: usize,
        /// CPU threads (0: all cores).
        #[arg(long, default_value_t = 0)]
        threads: usize,
        #[command(flatten)]
        device: DeviceArgs,
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

fn main() -> Result<()> {
    match Cli::parse().command {
        Command::Train { config, set, resume, fresh, device, pipeline, trace } => {
            train(&config, &set, resume, fresh, device, &pipeline, trace.as_deref())
        }
        Command::Plan { config, set, pipeline } => plan(&config, &set, &pipeline),
        Command::Overfit { model, steps, lr, seed, threads, device } => {
            if steps == 0 {
                bail!("--steps must be at least 1");
            }
            on_device!(device.open(threads)?, overfit(model, steps, lr, seed))
        }
        Command::BenchStep { steps, warmup, batch, seq, threads, device } => {
            if steps == 0 || batch == 0 || seq == 0 {
                bail!("--steps, --batch and --seq must each be at least 1");
            }
            on_device!(device.open(threads)?, bench_step(steps, warmup, batch, seq))
        }
        Command::Kernels { update } => kernels(update.as_deref()),
    }
}

/// Small configurations for `overfit`, without dropout so memorisation is exact.
fn small_config(family: Family) -> (ModelConfig, usize, usize) {
    match family {
        Family::Bert => (
            ModelConfig::Bert(BertConfig {
                vocab_size: 100,
                hidden_size: 64,
                num_hidden_layers: 2,
                num_attention_heads: 4,
                intermediate_size: 256,
                hidden_act: "gelu".into(),
                max_position_embeddings: 64,
                type_vocab_size: 2,
                layer_norm_eps: 1e-12,
                hidden_dropout_prob: 0.0,
                attention_probs_dropout_prob: 0.0,
                num_labels: 4,
                pooling: Pooling::ClsPooler,
            }),
            16,
            32,
        ),
        Family::Gpt => (ModelConfig::Gpt(GptConfig::without_dropout(64, 64, 64, 2, 4)), 4, 32),
        Family::Vit => (
            ModelConfig::Vit(VitConfig {
                image_size: 8,
                patch_size: 4,
                num_channels: 1,
                hidden_size: 64,
                num_hidden_layers: 2,
                num_attention_heads: 4,
                intermediate_size: 256,
                hidden_act: "gelu".into(),
                layer_norm_eps: 1e-12,
                hidden_dropout_prob: 0.0,
                attention_probs_dropout_prob: 0.0,
                num_labels: 10,
            }),
            32,
            0,
        ),
    }
}

fn overfit<D: Device>(dev: &D, family: Family, steps: u64, lr: f64, seed: u64) -> Result<()> {
    let (config, batch, seq) = small_config(family);
    let mut model = Model::new(dev, &config, seed)?;
    let host = bench::random_batch(&config, batch, seq, seed + 1);
    let batch = Batch::upload(dev, model.spec(), &host, true, seed)?;
    let mut optimizer =
        Optimizer::new(OptimizerConfig::AdamW { beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.0 })?;
    let schedule = LrSchedule {
        base_lr: lr,
        min_lr: lr / 10.0,
        warmup_steps: steps / 10,
        total_steps: steps,
        decay: pipetransformer::train::Decay::Cosine,
    };
    schedule.validate().context("learning-rate schedule")?;
    println!(
        "overfit: {:?} with {} parameters on {} — one batch of {} samples",
        model.spec().family,
        model.num_params(),
        dev.name(),
        batch.batch
    );
    let start = Instant::now();
    let mut last = f64::NAN;
    for step in 0..steps {
        let stats = train_step(dev, &mut model, &mut optimizer, &batch, schedule.lr_at(step), Some(1.0))?;
        last = stats.loss;
        if step % 20 == 0 || step + 1 == steps {
            println!("step {step:4}  loss {:.5}  grad-norm {:.3}", stats.loss, stats.grad_norm);
        }
    }
    println!("final loss {last:.5} after {steps} steps in {:.1} s", start.elapsed().as_secs_f64());
    Ok(())
}

fn bench_step<D: Device>(dev: &D, steps: usize, warmup: usize, batch: usize, seq: usize) -> Result<()> {
    let config = bench::minilm_shaped();
    let mut model = Model::new(dev, &config, 0)?;
    let host = bench::random_batch(&config, batch, seq, 1);
    let batch_dev = Batch::upload(dev, model.spec(), &host, true, 2)?;
    let mut optimizer = Optimizer::new(OptimizerConfig::adamw())?;
    let flops = bench::step_flops(&model, dev, batch, seq);
    for _ in 0..warmup {
        train_step(dev, &mut model, &mut optimizer, &batch_dev, 1e-4, Some(1.0))?;
    }
    let mut times = Vec::with_capacity(steps);
    for _ in 0..steps {
        let t = Instant::now();
        train_step(dev, &mut model, &mut optimizer, &batch_dev, 1e-4, Some(1.0))?;
        dev.synchronize()?;
        times.push(t.elapsed().as_secs_f64());
    }
    times.sort_by(f64::total_cmp);
    let median = times[times.len() / 2];
    let rate = flops / median / 1e9;
    println!(
        "MiniLM-shaped training step (6 layers, hidden 384, 12 heads, MLP 1536, seq {seq}, batch {batch}, f32, AdamW)"
    );
    println!("  device          {}", dev.name());
    println!("  FLOP per step   {flops:.4e}");
    println!(
        "  step time       {:.1} ms (median of {steps}; min {:.1}, max {:.1})",
        median * 1e3,
        times[0] * 1e3,
        times[times.len() - 1] * 1e3
    );
    println!("  achieved        {rate:.1} GFLOP/s");
    // The roofline of the CPU backend is its own large GEMM, measured now on the same threads.
    if let Some(threads) = cpu_threads(dev) {
        let gemm = bench::gemm_gflops(threads, 2048, 3)?;
        println!("  f32 GEMM 2048³  {gemm:.1} GFLOP/s ({threads} threads)");
        println!("  step / GEMM     {:.1}%", 100.0 * rate / gemm);
    }
    Ok(())
}

/// The thread count of a `cpu` device (None for the GPU backends).
fn cpu_threads<D: Device>(dev: &D) -> Option<usize> {
    (dev as &dyn std::any::Any).downcast_ref::<CpuDevice<f32>>().map(CpuDevice::threads)
}

fn kernels(update: Option<&Path>) -> Result<()> {
    use pipetransformer::device::kernels;
    let table = kernels::resource_table()?;
    match update {
        None => print!("{table}"),
        Some(path) => {
            let doc = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
            let fresh = kernels::with_table(&doc, &table)?;
            pipetransformer::weights::write_atomic(path, |w| std::io::Write::write_all(w, fresh.as_bytes()))?;
            println!("updated the ptxas table in {}", path.display());
        }
    }
    Ok(())
}

fn train(
    config_path: &Path,
    overrides: &[String],
    resume: bool,
    fresh: bool,
    device: DeviceArgs,
    pipeline: &PipelineArgs,
    trace: Option<&Path>,
) -> Result<()> {
    let mut config = pipetransformer::run::RunConfig::load(config_path, overrides)
        .with_context(|| format!("reading {}", config_path.display()))?;
    config.pipeline = pipeline.apply(config.pipeline);
    let threads = config.output.threads;
    let p = config.pipeline;
    let count = pipeline.devices.unwrap_or(p.replicas * p.pipeline_len);
    if p.is_single() && count <= 1 {
        let run = TrainRun { config_path, resume, fresh, profile: pipeline.profile, trace };
        return on_device!(device.open(threads)?, train_on(Vec::new(), config, &run));
    }
    // The trainer's own device (data, evaluation, checkpoints) plus the pipeline's; CPU
    // threads are shared out so the devices together use the machine once.
    let cores = if threads == 0 { std::thread::available_parallelism().map_or(1, |n| n.get()) } else { threads };
    let per_device = (cores / count.max(1)).max(1);
    let run = TrainRun { config_path, resume, fresh, profile: pipeline.profile, trace };
    let precision = device.precision();
    let main = device.open(threads)?;
    match (main, AnyDevices::open(device.device, count, per_device, precision)?) {
        (AnyDevice::Cpu(dev), AnyDevices::Cpu(devs)) => train_on(&dev, devs, config, &run),
        (AnyDevice::Gpu(dev), AnyDevices::Gpu(devs)) => train_on(&dev, devs, config, &run),
        _ => bail!("the trainer's device and the pipeline's devices resolved to different backends"),
    }
}

/// What `train` was asked besides the run config.
struct TrainRun<'a> {
    config_path: &'a Path,
    resume: bool,
    fresh: bool,
    profile: bool,
    trace: Option<&'a Path>,
}

/// The units' costs for the partitioner: measured on `dev` for one micro-batch, or FLOPs at a
/// nominal 100 GFLOP/s (only their ratios matter).
fn unit_profiles<D: Device>(
    dev: &D,
    model: &mut pipetransformer::model::Model<D>,
    source: &dyn pipetransformer::train::BatchSource,
    pipeline: &PipelineConfig,
    measure: bool,
) -> Result<Vec<pipetransformer::pipeline::UnitProfile>> {
    let parts = (pipeline.replicas * pipeline.micro_batches).max(1);
    let first = source.train_batch(0, 0)?;
    let micro = first.split(parts.min(first.batch.max(1)))?.swap_remove(0);
    if measure {
        return Ok(pipetransformer::pipeline::partition::profile_units(dev, model, &micro, 3)?);
    }
    // Hidden-state positions: the tokens, or the patches plus the class token.
    let seq = match model.spec().input {
        pipetransformer::model::InputSpec::Image { image_size, patch, .. } => (image_size / patch).pow(2) + 1,
        pipetransformer::model::InputSpec::Tokens { .. } => micro.seq,
    };
    Ok(model
        .costs(dev, seq)
        .iter()
        .zip(model.units())
        .map(|(c, u)| pipetransformer::pipeline::UnitProfile::analytic(c, micro.batch, 1e11, u.trainable()))
        .collect())
}

fn plan(config_path: &Path, overrides: &[String], args: &PipelineArgs) -> Result<()> {
    let mut config = pipetransformer::run::RunConfig::load(config_path, overrides)
        .with_context(|| format!("reading {}", config_path.display()))?;
    let devices = args.devices.unwrap_or(config.pipeline.replicas * config.pipeline.pipeline_len);
    let mut p = args.apply(config.pipeline);
    if args.pipeline_len.is_none() && args.devices.is_some() {
        // `--devices N` alone: one pipeline over all of them.
        p.pipeline_len = (devices / p.replicas.max(1)).max(1);
    }
    config.pipeline = p;
    let dev = CpuDevice::<f32>::new(0, config.output.threads)?;
    let mut job = pipetransformer::run::Job::new(&dev, config).context("preparing the run")?;
    let profiles = unit_profiles(&dev, &mut job.trainer.model, job.source.as_ref(), &p, args.profile)?;
    let names = pipetransformer::pipeline::runtime::unit_names(job.trainer.model.units());
    let plan = pipetransformer::pipeline::Plan::new(p, &profiles, names, devices)?;
    println!(
        "costs: {}",
        if args.profile { "measured on this machine's CPU, one micro-batch" } else { "FLOPs at a nominal 100 GFLOP/s" }
    );
    print!("{plan}");
    Ok(())
}

fn train_on<D: Device>(
    dev: &D,
    pipeline_devices: Vec<D>,
    config: pipetransformer::run::RunConfig,
    run: &TrainRun,
) -> Result<()> {
    use indicatif::{ProgressBar, ProgressStyle};
    use pipetransformer::run::Job;
    use pipetransformer::train::Event;

    let TrainRun { config_path, resume, fresh, .. } = *run;
    println!("pipetransformer train: {} on {}", config_path.display(), dev.name());
    let pipeline = config.pipeline;
    let mut job = Job::new(dev, config).context("preparing the run")?;
    let ckpt = job.checkpoint_path();
    if resume {
        job.resume(dev).with_context(|| format!("resuming from {}", ckpt.display()))?;
        println!(
            "resumed at step {} (epoch {}, batch {})",
            job.trainer.position.step, job.trainer.position.epoch, job.trainer.position.batch
        );
    } else if ckpt.exists() && !fresh {
        bail!(
            "{} already holds a checkpoint: pass --resume to continue that run or --fresh to start over",
            ckpt.display()
        );
    }
    if !pipeline_devices.is_empty() {
        let profiles = unit_profiles(dev, &mut job.trainer.model, job.source.as_ref(), &pipeline, run.profile)?;
        let names: Vec<String> = pipeline_devices.iter().map(Device::name).collect();
        job.trainer.enable_pipeline(dev, pipeline_devices, pipeline, &profiles).context("planning the pipeline")?;
        if let Some(p) = job.trainer.pipeline_mut() {
            println!("devices: {}", names.join(", "));
            print!("{}", p.plan());
            // Replicas on GPUs sum their gradients over NCCL when it is installed.
            let (k, r) = (p.plan().config.pipeline_len, p.plan().config.replicas);
            if let Some(groups) = pipetransformer::comm::nccl::pipeline_groups(p.devices(), k, r)? {
                p.set_communicators(Some(groups))?;
                println!("replicas sum gradients over NCCL");
            }
        }
    }
    if run.trace.is_some() {
        job.trainer.trace = Some(Default::default());
    }
    let info = &job.info;
    println!(
        "data: {} — {} training / {} evaluation samples, {} {}",
        info.name,
        info.train,
        info.test,
        info.classes,
        if job.trainer.model.spec().head == pipetransformer::model::HeadSpec::TiedLmHead {
            "tokens"
        } else {
            "classes"
        }
    );
    println!("model: {:?}, {} parameters", job.trainer.model.spec().family, job.trainer.model.num_params());
    if let Some(report) = &job.load_report {
        println!("{report}");
    }
    let total = job.trainer.schedule.total_steps;
    let bar = ProgressBar::new(total);
    bar.set_style(
        ProgressStyle::with_template("{bar:30} {pos}/{len} steps  {msg}  [{elapsed_precise} < {eta_precise}]")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    bar.set_position(job.trainer.position.step);
    let started = Instant::now();
    let mut samples = 0usize;
    let summary = job.run(dev, &mut |e| match e {
        Event::Step { step, loss, lr, samples: n, bubble, .. } => {
            samples += n;
            let rate = samples as f64 / started.elapsed().as_secs_f64().max(1e-9);
            bar.set_position(*step);
            let bubble = bubble
                .map(|b| format!("  bubble {:.1}% (formula {:.1}%)", 100.0 * b.measured, 100.0 * b.formula))
                .unwrap_or_default();
            bar.set_message(format!("loss {loss:.4}  lr {lr:.2e}  {rate:.1} samples/s{bubble}"));
        }
        Event::Epoch { epoch, eval } => {
            let line = format!(
                "epoch {epoch}: eval loss {:.4}  accuracy {:.2}%  perplexity {:.3}",
                eval.loss,
                100.0 * eval.accuracy,
                eval.perplexity
            );
            // A hidden bar (output not a terminal) swallows println: print directly then.
            if bar.is_hidden() { println!("{line}") } else { bar.println(line) }
        }
    })?;
    bar.finish_and_clear();
    println!("done: {} steps in {:.1} s ({:.1} samples/s)", summary.steps, summary.seconds, summary.samples_per_second);
    if let Some(eval) = summary.eval {
        println!(
            "final eval: loss {:.4}, accuracy {:.2}%, perplexity {:.3}",
            eval.loss,
            100.0 * eval.accuracy,
            eval.perplexity
        );
    }
    if let Some(u) = summary.unigram_baseline_loss {
        println!("unigram baseline held-out loss: {u:.4}");
    }
    println!("wrote {}/{{metrics.jsonl, summary.json, checkpoint.ckpt, model/}}", job.config.output.dir.display());
    if let (Some(path), Some(trace)) = (run.trace, &job.trainer.trace) {
        trace.write(path).with_context(|| format!("writing {}", path.display()))?;
        println!("wrote the Chrome trace {}", path.display());
    }
    Ok(())
}
