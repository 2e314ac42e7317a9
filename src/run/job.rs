//! A configured training job: from the data and the model a [`RunConfig`] names
//! ([`prepare_data`], [`build_model`]) it builds the plan, pipeline, trainer and elastic
//! controller, trains with checkpoints, logs metrics as JSON lines, and writes a summary and the
//! exported model into the run's folder ([`check_start`](super::check_start) says what it may
//! find there). The `train` command of the binary is this plus a progress bar.

use super::config::{RunConfig, named_as_written};
use super::data_setup::{DataInfo, prepare_data, tokenizer_dir};
use super::fingerprint::{MAX_LEN, TEST_FILE, TOKENIZER, TRAIN_FILE, data_settings};
use super::metrics_log::MetricsLog;
use super::model_setup::{build_model, check_head_dim, check_images};
use super::output_dir::{BEST, LOG, MODEL, checkpoint_path, set_aside_pairs};
use super::planning::{
    PlannedSlicing, auto_unplanned, check_token_slices, planning_profiles, price_given, token_slices,
};
use crate::comm::process_group::ProcessGroup;
use crate::device::Device;
use crate::elastic::autodp::rebuild_communicators;
use crate::elastic::controller::Surroundings;
use crate::elastic::{CacheDtype, Elastic, FreezeName};
use crate::error::{Error, Result, config_error, counted, internal};
use crate::files::{self, io_error};
use crate::model::{Family, InputSpec, Model, ModelConfig};
use crate::pipeline::{Pipeline, PipelineConfig, Plan, samples_per_micro_batch};
use crate::terapipe::TokenSlices;
use crate::train::{BatchSource, EvalMetrics, Event, RecordedPlan, Scored, Trainer};
use crate::weights::{self, LoadReport};
use serde::Serialize;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

/// The end of a run.
#[derive(Clone, Debug, Serialize)]
pub struct Summary {
    /// Dataset.
    pub data: DataInfo,
    /// Model family.
    pub family: Family,
    /// Parameters.
    pub parameters: usize,
    /// Optimizer steps taken in all (including before a resume).
    pub steps: u64,
    /// Wall-clock seconds of this process's run loop: its steps, evaluations and checkpoints
    /// (the per-epoch rates of steps alone are in `report.html` and the epoch events).
    pub seconds: f64,
    /// Samples this process trained on, per second of `seconds`.
    pub samples_per_second: f64,
    /// Final evaluation.
    pub eval: Option<EvalMetrics>,
    /// The best evaluation on `train.keep_best`, whose weights are in `output.dir/best/`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub best: Option<Scored>,
    /// Whether the run stopped before its planned length (`train.early_stopping_patience`).
    pub stopped_early: bool,
    /// Frozen Transformer layers at the end.
    pub frozen_layers: usize,
    /// The pipeline configuration at the end (`K`, `R`, `M`, schedule, chunks, memory limit,
    /// token slices), as the elastic transitions left it.
    pub final_plan: PipelineConfig,
    /// The devices the run held, as they name themselves (backend, index, precision; threads
    /// on cpu: e.g. `cpu:0 (F32, bf16 products (avx512), 1 thread)`), so a result says what computed it.
    pub devices: Vec<String>,
    /// For language models: the held-out loss of predicting each character by its training
    /// frequency alone (the unigram baseline the model must beat).
    pub unigram_baseline_loss: Option<f64>,
}

/// `train.freeze_embeddings` applied to the model before it is planned, so that the plan charges
/// the embedding its forward only (the trainer applies it too, for pipelines built elsewhere).
fn freeze_embeddings<D: Device>(config: &RunConfig, dev: &D, model: &mut Model<D>) -> Result<()> {
    if config.train.freeze_embeddings { model.freeze_prefix(dev, 1) } else { Ok(()) }
}

/// Refuses what a pipeline whose stages are processes cannot run (`pipeline.across_processes`,
/// for `train` under `launch` and `plan` alike): AutoPipe, AutoDP, the cache, profiling and token
/// slices move units or measure within one process, and the settling test reads every layer.
pub fn check_across_processes(config: &RunConfig) -> Result<()> {
    let e = &config.elastic;
    let within_one_process = [
        (e.auto_pipe, "elastic.auto_pipe", "false"),
        (e.auto_dp, "elastic.auto_dp", "false"),
        (e.cache, "elastic.cache", "false"),
        (config.pipeline.profile, "pipeline.profile", "false"),
        (config.pipeline.token_slices != TokenSlices::Off, "pipeline.token_slices", "\"off\""),
    ];
    if e.freeze != FreezeName::Off && e.max_weight_change.is_some() {
        return Err(Error::Config {
            field: "elastic.max_weight_change".into(),
            message: "the settling test compares every layer's weights, which no process of a pipeline across \
                      processes holds: set it to none (--set elastic.max_weight_change=none)"
                .into(),
        });
    }
    match within_one_process.into_iter().find(|(on, _, _)| *on) {
        Some((_, key, off)) => Err(Error::Config {
            field: key.into(),
            message: format!("works within one process; a pipeline across processes needs it off (--set {key}={off})"),
        }),
        None => Ok(()),
    }
}

/// What a [resume](Job::resume) found: the plan the run goes on with, and the training
/// settings that changed since the checkpoint (`train.lr 0.001 → 0.01`), which it takes.
#[derive(Clone, Debug, PartialEq)]
pub struct Resumed {
    /// The plan.
    pub plan: ResumedPlan,
    /// The settings that changed.
    pub changed: Vec<String>,
}

impl std::fmt::Display for Resumed {
    /// A line for the plan unless it is the checkpoint's, and one for the changed settings
    /// where there are some; nothing else.
    fn fmt(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        if self.plan != ResumedPlan::Checkpoint {
            writeln!(f, "{}", self.plan)?;
        }
        if !self.changed.is_empty() {
            writeln!(f, "settings changed since the checkpoint, taken from here on: {}", self.changed.join(", "))?;
        }
        Ok(())
    }
}

/// The plan a [resumed](Job::resume) run goes on with.
#[derive(Clone, Debug, PartialEq)]
pub enum ResumedPlan {
    /// The checkpoint's, the shape this run's settings ask for.
    Checkpoint,
    /// The shape this run's settings ask for (`now`), which replaced the checkpoint's (`was`).
    Replanned {
        /// The checkpoint's plan.
        was: PipelineConfig,
        /// The plan in force.
        now: PipelineConfig,
    },
    /// The checkpoint's (`now`): with AutoPipe on, a resumed run goes on in the shape it
    /// stopped in, and this run's settings (`asked`) give only a fresh run's start.
    KeptByAutoPipe {
        /// The shape the settings ask a run to start in.
        asked: PipelineConfig,
        /// The plan in force.
        now: PipelineConfig,
    },
}

impl std::fmt::Display for ResumedPlan {
    /// Empty for [`ResumedPlan::Checkpoint`]; else a sentence on what became of the shape.
    fn fmt(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        match self {
            ResumedPlan::Checkpoint => Ok(()),
            ResumedPlan::Replanned { was, now } => write!(
                f,
                "the checkpoint's plan ({}) gives way to the one this run asks for ({})",
                shape_text(was, now),
                shape_text(now, was)
            ),
            ResumedPlan::KeptByAutoPipe { asked, now } => write!(
                f,
                "the checkpoint's plan ({}) stands: with AutoPipe on (elastic.auto_pipe), a resumed run goes on \
                 in the shape it stopped in; the one asked for ({}) is where a fresh run starts",
                shape_text(now, asked),
                shape_text(asked, now)
            ),
        }
    }
}

/// `c`'s pipelines in brief: `K R M` and the schedule, and each of its chunks, memory limit
/// and token slices that is set or that differs from `other`'s.
fn shape_text(c: &PipelineConfig, other: &PipelineConfig) -> String {
    let mut text = format!("K={} R={} M={} {}", c.pipeline_len, c.replicas, c.micro_batches, c.schedule);
    if c.chunks != 1 || c.chunks != other.chunks {
        text += &format!(", {} per device", counted(c.chunks, "chunk"));
    }
    if c.memory_limit != other.memory_limit || c.memory_limit.is_some() {
        match c.memory_limit {
            Some(limit) => text += &format!(", memory limit {limit} B"),
            None => text += ", no memory limit",
        }
    }
    if c.token_slices != other.token_slices {
        match c.token_slices.as_slice() {
            [] | [_] => text += ", no token slices",
            lengths => text += &format!(", token slices {}", TokenSlices::Lengths(lengths.to_vec())),
        }
    }
    if c.recompute != other.recompute {
        text += &format!(", recompute {}", c.recompute);
    }
    text
}

/// A run: its config, data, trainer, elastic controller and output paths.
pub struct Job<D: Device> {
    /// The configuration the job was built from: the model, data, plan, trainer and the
    /// cache's folder were made from it, so a change made here afterwards does not reach
    /// them (the output folder's files would follow a new `output.dir`, the cache's would not).
    pub config: RunConfig,
    /// Batches.
    pub source: Box<dyn BatchSource>,
    /// What the data is.
    pub info: DataInfo,
    /// The model's configuration (exported next to the weights).
    pub model_config: ModelConfig,
    /// The pipeline (the only copy of the model), its schedule and position.
    pub trainer: Trainer<D>,
    /// PipeTransformer's controller (does nothing with the `[elastic]` section off).
    pub elastic: Elastic,
    /// What loading pretrained weights found, if any were loaded.
    pub load_report: Option<LoadReport>,
    /// TeraPipe's planned slicing, when the run asked for `token_slices = "auto"` (none after a
    /// [resume](Self::resume) that restored the checkpoint's plan), or the run's own slicing
    /// once [priced](Self::price_given_slices).
    pub slicing: Option<PlannedSlicing>,
    /// What the replicas sum gradients over (NCCL, the host ring, or why not NCCL), to announce.
    pub communicator: String,
    /// Whether the state continues an earlier run's: a checkpoint's, or an earlier call of
    /// [`run`](Self::run) that failed.
    resumed: bool,
    /// The metrics log, from the first call of [`run`](Self::run) on: held in memory until a
    /// run that starts over has taken its first step, then the file.
    metrics: std::cell::RefCell<Option<MetricsLog>>,
    /// What the run that reached the end returned: a later call of [`run`](Self::run) returns
    /// it again and writes nothing.
    finished: Option<Summary>,
    /// The output folder's lock, taken by [`resume`](Self::resume) before it reads the
    /// checkpoint and held on by [`run`](Self::run).
    lock: Option<std::fs::File>,
}

impl<D: Device> Job<D> {
    /// [`new`](Self::new) for one process of `group` (`pipetransformer launch`): this process
    /// runs its shard of every global batch and only rank 0 writes the run's files. AutoDP and
    /// the activation cache work within one process, so a launched run must switch them off.
    pub fn launched(devices: Vec<D>, config: RunConfig, group: ProcessGroup) -> Result<Self> {
        let mut job = Self::build(devices, config, None, group.size())?;
        job.join_process_group(group)?;
        Ok(job)
    }

    fn join_process_group(&mut self, group: ProcessGroup) -> Result<()> {
        let e = &self.config.elastic;
        for (on, key) in [(e.auto_dp, "elastic.auto_dp"), (e.cache, "elastic.cache")] {
            if on {
                return Err(Error::Config {
                    field: key.into(),
                    message: format!("works within one process; a launched run needs it off (--set {key}=false)"),
                });
            }
        }
        let pipeline = &mut self.trainer.pipeline;
        pipeline.set_process_group(Some(Arc::new(group)))?;
        // Every process asks at the same point: NCCL over every GPU of the run where all can.
        let comm = rebuild_communicators(pipeline)?;
        self.communicator = self.describe_communicator(comm);
        Ok(())
    }

    /// What the gradients are summed over, for the console, given what the replicas of this
    /// process sum over (`comm`, from [`rebuild_communicators`]).
    fn describe_communicator(&self, comm: String) -> String {
        let pipeline = &self.trainer.pipeline;
        let Some(size) = pipeline.process_group().filter(|_| pipeline.process_stage().is_none()).map(|g| g.size())
        else {
            return comm;
        };
        if pipeline.communicators_span_processes() {
            return format!("{comm} over the GPUs of {size} processes, gradients summed as the backward goes");
        }
        let within = (pipeline.replicas() > 1).then(|| format!("{comm} within each process, "));
        let when = match (pipeline.sums_during_backward(), pipeline.plan().config.pipeline_len > 1) {
            (true, true) => "stage by stage as the backward goes (in steps whose stages every process cut alike)",
            (true, false) => "as the backward goes",
            (false, _) => "after each step",
        };
        format!("{}a TCP ring across {size} processes, gradients summed {when}", within.unwrap_or_default())
    }

    /// Whether this process writes the run's files (not a launched run's ranks above 0).
    pub fn writes_files(&self) -> bool {
        let pipeline = &self.trainer.pipeline;
        pipeline.process_group().is_none_or(|g| g.rank() == 0) && pipeline.process_stage().is_none_or(|s| s == 0)
    }
}

impl<D: Device> Job<D> {
    /// Builds the whole run from `config` on `devices` (as many as
    /// [`PipelineSection::resolve`](super::config::PipelineSection::resolve) asks for): the
    /// data, the model (pretrained or new) on the first device, the units' costs, the plan,
    /// the pipeline with its communicators (NCCL between GPU replicas when installed), the
    /// trainer and the elastic controller. Every setting is checked before anything is
    /// written.
    pub fn new(devices: Vec<D>, config: RunConfig) -> Result<Self> {
        Self::build(devices, config, None, 1)
    }

    /// [`new`](Self::new) for one process of a launched run whose pipeline stages are its
    /// processes (`pipeline.across_processes`): its `K·R` processes are `R` replicas of a
    /// `K`-stage pipeline (`K` the process count unless `pipeline.pipeline_len` says), and
    /// this one trains stage `rank % K` of replica `rank / K` on `devices[0]`. Every process
    /// plans from the units' FLOPs, so all make the same plan.
    /// Each process builds only its own stages' weights (the other units
    /// [hollow](Model::new_keeping)), so a per-stage memory limit holds from the start.
    /// Freezing works (every process sees the same summed gradient norms, so all freeze the
    /// same layers at the same step), but not its settling test; AutoPipe, AutoDP and the
    /// cache (which move units within one process) and token slices must be off.
    pub fn across_processes(devices: Vec<D>, mut config: RunConfig, group: ProcessGroup) -> Result<Self> {
        check_across_processes(&config)?;
        // Unless given, one pipeline whose stages are all the processes.
        config.pipeline.pipeline_len.get_or_insert(group.size());
        Self::build(devices, config, Some(group), 1)
    }

    /// The run on `devices`, its pipeline's stages the processes of `group` when given, and
    /// its replicas' batches shared with `processes − 1` other processes. A setting the layers
    /// below refuse is named as the run config writes it.
    fn build(devices: Vec<D>, config: RunConfig, group: Option<ProcessGroup>, processes: usize) -> Result<Self> {
        let inline_model = config.model.config.is_some();
        let (k_unset, devices_set) = (config.pipeline.pipeline_len.is_none(), config.pipeline.devices.is_some());
        Self::assemble(devices, config, group, processes).map_err(|e| match named_as_written(e, inline_model) {
            // (A length not written is the devices over the replicas: said, with the flag.)
            Error::Config { field, message } if field == "pipeline.pipeline_len" && k_unset && devices_set => {
                let message = format!(
                    "{message} (pipeline.pipeline_len is not set, so it is pipeline.devices over the replicas: \
                     give --pipeline-len, at most the active units, or fewer --devices)"
                );
                Error::Config { field, message }
            }
            e => e,
        })
    }

    fn assemble(devices: Vec<D>, config: RunConfig, group: Option<ProcessGroup>, processes: usize) -> Result<Self> {
        // (A config built in code, not parsed, is checked here as a parsed one is.)
        config.validate()?;
        let (plan, count) = config.pipeline.resolve()?;
        if devices.len() < count {
            return Err(config_error("devices", format!("the run needs {count} devices; {} given", devices.len())));
        }
        // The most replicas a step can have: one per device (AutoDP's ceiling) of every process,
        // or, with stages as processes, one per pipeline of them.
        let replicas = match &group {
            Some(g) => g.size() / plan.pipeline_len.max(1),
            None => count * processes,
        };
        let (source, info) = prepare_data(&config, replicas)?;
        let first = source.train_batch(0, 0)?;
        // Found now, not at the first step: only a training set shorter than the batch makes
        // a step's batch this short (the config checked the batch), and each replica of every
        // process needs a sample of it.
        let fed = plan.replicas.saturating_mul(processes);
        if group.is_none() && first.batch < fed {
            let each = match fed {
                1 => "the replica needs one at least".to_string(),
                _ => format!("each of {fed} replicas needs one at least"),
            };
            let whole = first.batch < config.data.batch_size;
            let limit = if config.data.train_limit > 0 { " (data.train_limit)" } else { "" };
            return Err(match whole {
                true => config_error(
                    "pipeline.replicas",
                    format!(
                        "a step's batch holds {}, the whole training set{limit}; {each}",
                        counted(first.batch, "sample")
                    ),
                ),
                // (Launched processes: the config checked the batch against one process's.)
                false => config_error(
                    "data.batch_size",
                    format!(
                        "{} a step, shared by {processes} processes of {}; {each}",
                        counted(first.batch, "sample"),
                        counted(plan.replicas, "replica")
                    ),
                ),
            });
        }
        // A stage process holds its own stages' weights only, from the start. Every process
        // plans alike from the units' FLOPs, which their shapes give: a first build keeps no
        // values and says which units are this process's.
        let own_units = match &group {
            None => None,
            Some(group) => {
                let (mut shapes, _, _) = build_model(&devices[0], &config, &info, &|_| false)?;
                check_images(shapes.spec(), &info)?;
                freeze_embeddings(&config, &devices[0], &mut shapes)?;
                let (_, profiles) = planning_profiles(&config, &devices[0], &mut shapes, &first, &plan)?;
                Some(Pipeline::units_of_process(&shapes, plan.clone(), &profiles, group.rank(), group.size())?)
            }
        };
        if let (None, Some(model)) = (&group, &config.model.config) {
            super::model_setup::check_host_memory(&devices[0], model)?;
        }
        let keep = |u: usize| own_units.as_ref().is_none_or(|own| own[u]);
        let (mut model, model_config, load_report) = build_model(&devices[0], &config, &info, &keep)?;
        freeze_embeddings(&config, &devices[0], &mut model)?;
        let spec = model.spec().clone();
        check_images(&spec, &info)?;
        if let InputSpec::Tokens { max_positions, .. } = spec.input
            && config.data.max_len > max_positions
        {
            // Found now, not at the first batch long enough to overflow the table mid-run.
            return Err(config_error(
                "data.max_len",
                format!("{} tokens; the model's position table holds {max_positions}", config.data.max_len),
            ));
        }
        check_head_dim(&config, &spec, &devices[0])?;
        // (Token slices first: a model that is not causal is the reason to name before any
        // elastic setting beside them.)
        check_token_slices(&config, &spec)?;
        config.elastic.validate(spec.layers, info.augmented)?;
        let (per_sample, profiles) = planning_profiles(&config, &devices[0], &mut model, &first, &plan)?;
        let mut plan = plan;
        let planned;
        (plan.token_slices, planned) = token_slices(&config, &devices, &mut model, &first, &plan, &profiles)?;
        let mut devices = devices;
        devices.truncate(count);
        let (pipeline, communicator) = match group {
            None => {
                let mut pipeline = Pipeline::new(devices, model, config.train.optimizer, plan.clone(), &profiles)?;
                pipeline.lend_idle_threads(config.elastic.lends_threads(pipeline.devices()))?;
                let communicator = rebuild_communicators(&mut pipeline)?;
                (pipeline, communicator)
            }
            Some(group) => {
                let (rank, size) = (group.rank(), group.size());
                let device = devices.into_iter().next().ok_or_else(|| config_error("devices", "none opened"))?;
                let optimizer = config.train.optimizer;
                let pipeline =
                    Pipeline::across_processes(device, model, optimizer, plan.clone(), &profiles, Arc::new(group))?;
                let (k, replicas) = (plan.pipeline_len, size / plan.pipeline_len.max(1));
                let text = match replicas {
                    1 => format!("stages across {size} processes over a TCP ring (this one runs stage {rank})"),
                    _ => format!(
                        "{replicas} replicas × {k} stages across {size} processes over TCP rings (this one runs stage {} \
                         of replica {})",
                        rank % k,
                        rank / k
                    ),
                };
                (pipeline, text)
            }
        };
        let mut trainer = Trainer::new(pipeline, config.train.clone(), source.batches_per_epoch(), per_sample)?;
        let settings = data_settings(&config);
        // The samples' ids, and for a user's files their bytes: an edited file keeps its ids.
        // (Built-in datasets' fingerprints stay the ids', so older checkpoints resume.)
        let files: String =
            [TRAIN_FILE, TEST_FILE].iter().filter_map(|k| settings.get(*k)).map(|v| v.to_string()).collect();
        trainer.data_fingerprint = source.fingerprint().map(|ids| crate::rng::fnv1a(files.as_bytes(), ids));
        trainer.data_settings = Some(settings);
        if config.data.group_by_length {
            trainer.order_settings = vec![MAX_LEN.into(), TOKENIZER.into()];
        }
        // A batch larger than the training set holds the set.
        let batch = config.data.batch_size.min(first.batch);
        trainer.batch_size = Some(batch);
        trainer.model_config = serde_json::to_value(&model_config).ok();
        let positions = match spec.input {
            InputSpec::Image { image_size, patch, .. } => (image_size / patch).pow(2) + 1,
            InputSpec::Tokens { .. } => config.data.max_len,
        };
        let around = Surroundings {
            layers: spec.layers,
            devices: count,
            initial_replicas: plan.replicas,
            batch,
            positions,
            width: spec.hidden,
            activation_dtype: match trainer.pipeline.devices()[0].activation_dtype() {
                crate::DType::Bf16 => CacheDtype::Bf16,
                _ => CacheDtype::F32,
            },
        };
        let mut elastic = Elastic::new(config.elastic.clone(), around, &config.output.dir.join("cache"))?;
        elastic.ask_for(&plan);
        // `auto` slices each shape AutoPipe runs from the one measurement.
        let slicing = planned.and_then(|(planned, slicer)| {
            elastic.plan_token_slices_with(slicer, first.seq);
            planned
        });
        Ok(Self {
            config,
            source,
            info,
            model_config,
            trainer,
            elastic,
            load_report,
            slicing,
            communicator,
            resumed: false,
            metrics: std::cell::RefCell::new(None),
            finished: None,
            lock: None,
        })
    }

    /// The checkpoint file of this run.
    pub fn checkpoint_path(&self) -> PathBuf {
        checkpoint_path(&self.config)
    }

    /// The metrics log (JSON lines) of this run.
    pub fn metrics_path(&self) -> PathBuf {
        self.config.output.dir.join(LOG.0)
    }

    /// The lines on TeraPipe's `auto` slicing: what its planner planned, or what runs instead
    /// and why; on the run's own slicing once [priced](Self::price_given_slices); `None` where
    /// slices were neither, or (`planned_here` false) a resume kept its checkpoint's slices.
    pub fn slicing_report(&self, planned_here: bool) -> Option<String> {
        let in_force = &self.trainer.pipeline.plan().config;
        match &self.slicing {
            Some(slicing) => Some(slicing.describe(in_force)),
            None if planned_here && self.config.pipeline.token_slices == TokenSlices::Auto => {
                Some(auto_unplanned(in_force))
            }
            None => None,
        }
    }

    /// Prices the run's own token slices (`--token-slices N` or a list): measures the model's
    /// layer on the first device as `auto` does, for the [slicing report](Self::slicing_report)
    /// to set their predicted step beside what `auto` would run, and the
    /// [printed plan](Self::printed_plan) to split the stages' time by the slices' measured
    /// shares. What `plan` shows, after [the elastic start](Self::start_elastic), for the plan
    /// the first step runs; a run does not spend the measurement (as long as `auto`'s, on a
    /// large model many seconds). Nothing for `off`, `auto` (planned with the run) or a plan
    /// whose slices the elastic start turned off.
    pub fn price_given_slices(&mut self) -> Result<()> {
        let given = matches!(self.config.pipeline.token_slices, TokenSlices::Count(_) | TokenSlices::Lengths(_));
        let pipeline = &self.trainer.pipeline;
        let plan = pipeline.plan();
        if !given || plan.config.token_slices.len() < 2 {
            return Ok(());
        }
        let dev = &pipeline.devices()[0];
        // The layer is measured trained, as `auto` measures it when the run is built (a copy:
        // the elastic start may have frozen the pipeline's); the stages are charged as they
        // run, frozen layers their forward only.
        let mut model = pipeline.gather(dev)?;
        model.freeze_prefix(dev, usize::from(self.config.train.freeze_embeddings))?;
        let first = self.source.train_batch(0, 0)?;
        let samples = samples_per_micro_batch(first.batch, plan.config.replicas, plan.config.micro_batches);
        let units = self.trainer.profiles_for(samples, 0);
        let pinned = pipeline.frozen_prefix();
        self.slicing = Some(price_given(dev, &mut model, &first, plan, &units, pinned)?);
        Ok(())
    }

    /// The plan in force as `plan` and a run's start print it: its token slices at their
    /// measured shares of a micro-batch's time where TeraPipe's latency model priced them
    /// (`auto`'s, or the run's own [priced](Self::price_given_slices)), else at their shares of
    /// the tokens.
    pub fn printed_plan(&self) -> Plan {
        let mut plan = self.trainer.pipeline.plan().clone();
        if let Some(slicing) = self.slicing.as_ref().filter(|s| s.lengths() == plan.config.token_slices) {
            plan.slice_time_shares = slicing.time_shares();
        }
        plan
    }

    /// A sentence on the devices beyond the plan's that AutoDP holds for later (the plan
    /// printed alone would leave them unexplained); `None` where there are none, or AutoDP is
    /// off (the config then warns that they stay idle).
    pub fn devices_waiting(&self) -> Option<String> {
        let pipeline = &self.trainer.pipeline;
        let c = &pipeline.plan().config;
        let waiting = pipeline.devices().len().checked_sub(c.pipeline_len * c.replicas).filter(|&n| n > 0)?;
        let elastic = &self.config.elastic;
        if !elastic.auto_dp {
            return None;
        }
        let what = if elastic.lends_threads(pipeline.devices()) {
            "lend their threads to the devices at work"
        } else if elastic.freed_devices == crate::elastic::FreedDevices::Threads {
            "become replicas (elastic.freed_devices = \"threads\" applies to cpu devices, whose threads they are)"
        } else {
            "become replicas"
        };
        Some(format!(
            "{} wait for AutoDP (elastic.auto_dp): when a freeze shortens the pipeline, they {what}",
            counted(waiting, "more device")
        ))
    }

    /// The pipeline's devices as they name themselves.
    fn device_names(&self) -> Vec<String> {
        self.trainer.pipeline.devices().iter().map(|d| d.name()).collect()
    }

    /// Takes the output folder's [lock](files::lock_folder) (making the folder) where this
    /// process writes the run's files and does not hold it yet.
    fn lock_output(&mut self) -> Result<()> {
        if self.writes_files() && self.lock.is_none() {
            let out = &self.config.output.dir;
            std::fs::create_dir_all(out).map_err(|e| io_error(out, e))?;
            self.lock = Some(files::lock_folder(out)?);
        }
        Ok(())
    }

    /// Continues from this run's checkpoint: position, frozen prefix, plan, weights, optimizer
    /// state and the elastic controller's state (the activation cache is rebuilt). A run
    /// whose settings ask for another shape than the checkpoint's (`--devices 2
    /// --pipeline-len 2` after a run on one device) goes on in that shape, its weights and
    /// optimizer state moved as a re-plan moves them; with AutoPipe on, the shape is
    /// AutoPipe's and the checkpoint's stands. Returns which plan the run goes on with and the
    /// training settings that changed since the checkpoint (which the run takes). The output
    /// folder is [locked](files::lock_folder) first, and stays so through [`run`](Self::run):
    /// another run writing there is refused before its checkpoint is read.
    pub fn resume(&mut self) -> Result<Resumed> {
        let path = self.checkpoint_path();
        // The folder is locked before its checkpoint is read: a run still writing there (the
        // one a scheduler's requeue replaces, checkpointing its stop) is waited for by name,
        // not read half way, its newer checkpoint then overwritten from an older one.
        self.lock_output()?;
        if !path.exists() {
            return Err(Error::Io {
                path: path.display().to_string(),
                source: std::io::Error::new(std::io::ErrorKind::NotFound, "no checkpoint to resume from"),
            });
        }
        // With AutoPipe, the shape is its choice, and the run goes on from it; stages as
        // processes take theirs from the launch, which must match the checkpoint's.
        let auto_pipe = self.config.elastic.auto_pipe;
        let fixed = auto_pipe || self.trainer.pipeline.process_stage().is_some();
        let slices = match self.config.pipeline.token_slices {
            TokenSlices::Auto => false,
            TokenSlices::Off => self.config.pipeline.token_slices_written,
            TokenSlices::Count(_) | TokenSlices::Lengths(_) => true,
        };
        let plan = if fixed { RecordedPlan::Restore } else { RecordedPlan::UnlessReshaped { slices } };
        let asked = self.trainer.pipeline.plan().config.clone();
        let restored = self.trainer.load_checkpoint_with(&path, plan)?;
        // Each process read its own output.dir's checkpoint: they must have read the same one.
        let step = self.trainer.position.step;
        let pipeline = &self.trainer.pipeline;
        // Every process of the launch (stage processes' own group is their column alone).
        if let Some(group) = pipeline.every_process() {
            let steps = group.all_gather_u64(&[step])?;
            if let Some(r) = (1..steps.len()).find(|&r| steps[r] != steps[0]) {
                return Err(config_error(
                    "output.dir",
                    format!(
                        "rank {r}'s checkpoint is of step {}, rank 0's of step {}: every process of a launched run \
                         must resume from the same checkpoint, in an output.dir all nodes share",
                        steps[r][0], steps[0][0]
                    ),
                ));
            }
        }
        let mut changed = restored.changed;
        changed.extend(self.elastic.restore(restored.controller)?);
        self.elastic.restore_tensors(restored.tensors);
        // The batch policy in force sets the global batch for the restored replicas (the one
        // the checkpoint recorded came from the policy it was taken under; a shape of the
        // run's own has its initial replicas, one batch a step).
        self.trainer.batches_per_step = self.elastic.batches_per_step(self.trainer.pipeline.plan().config.replicas);
        let now = self.trainer.pipeline.plan().config.clone();
        let resumed = match restored.reshaped_from {
            Some(was) => ResumedPlan::Replanned { was, now },
            // (AutoPipe tunes the micro-batch count itself, and `auto` slices were measured
            // afresh: those are no news.)
            None if auto_pipe
                && PipelineConfig {
                    micro_batches: now.micro_batches,
                    token_slices: if slices { asked.token_slices.clone() } else { now.token_slices.clone() },
                    ..asked.clone()
                } != now =>
            {
                ResumedPlan::KeptByAutoPipe { asked, now }
            }
            None => ResumedPlan::Checkpoint,
        };
        if !matches!(resumed, ResumedPlan::Replanned { .. }) {
            // The checkpoint's plan, token slices included, replaces the one planned here.
            self.slicing = None;
        }
        if self.trainer.pipeline.process_stage().is_none() {
            // (A collective in a launched run: every process resumes at the same point.)
            let comm = rebuild_communicators(&mut self.trainer.pipeline)?;
            self.communicator = self.describe_communicator(comm);
        }
        self.resumed = true;
        Ok(Resumed { plan: resumed, changed })
    }

    /// The elastic loop's start as [`run`](Self::run) takes it, for a plan that shows what the
    /// first step runs: a freeze table's first entry freezes layers (and AutoPipe reshapes)
    /// before it. Returns the lines of what changed (none when nothing did). Not for a run
    /// that goes on to [`run`](Self::run), which starts the loop itself.
    pub fn start_elastic(&mut self) -> Result<Vec<String>> {
        let mut lines = Vec::new();
        self.elastic.start(&mut self.trainer, &mut |e| lines.extend(super::progress::event_line(e)))?;
        Ok(lines)
    }

    /// Trains to the end, checkpointing every `output.checkpoint_every` steps and at the end,
    /// appending every event to the metrics log and passing it to `on_event`; then writes
    /// `summary.json`, `report.html` and the exported model to `output.dir/model/`.
    ///
    /// The output folder is [locked](files::lock_folder) while the run writes it: a second run
    /// given the same folder is refused. A run that starts over (not resumed) moves the earlier
    /// run's files aside (`metrics.jsonl` to `metrics.previous.jsonl`,
    /// `checkpoint.ckpt` to `checkpoint.previous.ckpt`, and its summary, report and exported
    /// model alike, replacing older ones there) once its first step is done, so the log, and
    /// the report drawn from it, hold this run's events alone, nothing in the folder describes
    /// the earlier run as this one's, a resume continues
    /// this run or none, and a run that fails or stops before its first step changes nothing
    /// (its lines are held until then). A call after one that failed goes on with its log (the
    /// trainer stands where the failure left it). A log that cannot be written ends the run at the
    /// next checkpoint, after the checkpoint and export are written; so does a
    /// [stop request](crate::train::request_stop), after the step under way, with
    /// [`Error::Interrupted`]. A run that ends so, or fails, after its first step still draws
    /// `report.html` from its log: the steps it took, up to a divergence say (where that
    /// report cannot be written, a failure's own error is the one returned, and a stop says
    /// so in its own). Once a run has reached its end, `run` returns its summary again and
    /// writes nothing.
    pub fn run(&mut self, on_event: &mut dyn FnMut(&Event)) -> Result<Summary> {
        if let Some(summary) = &self.finished {
            return Ok(summary.clone());
        }
        let out = self.config.output.dir.clone();
        let writes = self.writes_files();
        self.lock_output()?;
        let _lock = self.lock.take();
        let ran = self.train_and_write(on_event);
        // Ended early with this run's log open (its first step done): the report of its steps,
        // written while the folder is still locked.
        let logged = self.metrics.get_mut().as_ref().is_some_and(|log| !log.is_held());
        if let Err(ended) = &ran
            && writes
            && logged
        {
            let report = super::report::write_report(&self.metrics_path(), &out.join("report.html"), &self.config);
            // A stop stays a stop (its exit status, what a scheduler requeues on), saying what
            // it could not write; a failure's own error is the one to report.
            if let (Error::Interrupted { step, .. }, Err(e)) = (ended, report) {
                return Err(Error::Interrupted { step: *step, unwritten: Some(e.to_string()) });
            }
        }
        ran
    }

    /// [`run`](Self::run)'s work, in the locked folder.
    fn train_and_write(&mut self, on_event: &mut dyn FnMut(&Event)) -> Result<Summary> {
        let out = self.config.output.dir.clone();
        let metrics_path = self.metrics_path();
        let writes = self.writes_files();
        // A run that starts over moves the earlier run's log and checkpoint aside once its first
        // step is done, not before: one that fails or stops sooner loses nothing. (Left in
        // place after that, a `--resume` after this run died before its first checkpoint would
        // go on with the earlier run, under this run's log.) The log is the job's: a call after
        // one that failed goes on with it.
        if self.metrics.get_mut().is_none() {
            let log = match writes {
                false => MetricsLog::Sink,
                true if !self.resumed => {
                    MetricsLog::starting_over(&metrics_path, out.join(LOG.1), &set_aside_pairs(&out))
                }
                true => MetricsLog::continued(&metrics_path).map_err(|e| io_error(&metrics_path, e))?,
            };
            *self.metrics.get_mut() = Some(log);
        }
        let every = self.config.output.checkpoint_every;
        let start = Instant::now();
        let (mut samples, mut last_eval) = (0usize, None);
        // The first failed write of the log, checked at each checkpoint.
        let write_error = std::cell::Cell::new(None);
        let record = |err: std::io::Error| {
            let first = write_error.take().unwrap_or(err);
            write_error.set(Some(first));
        };
        // The checkpoint and export being written while the next steps train.
        let mut writing: Option<files::Background> = None;
        {
            let mut log = |e: &Event| {
                match e {
                    Event::Step { samples: n, .. } => samples += n,
                    // (The latest evaluation, an epoch's or one inside it where the run stopped
                    // early there.)
                    Event::Epoch { eval, .. } | Event::Eval { eval, .. } => last_eval = Some(eval.clone()),
                    _ => {}
                }
                let written = match (serde_json::to_string(e), self.metrics.borrow_mut().as_mut()) {
                    (Ok(line), Some(log)) => log.write_line(format!("{line}\n").as_bytes()),
                    _ => Ok(()),
                };
                if let Err(err) = written {
                    record(err);
                }
                on_event(e);
            };
            log(&Event::Start {
                resumed: self.resumed,
                step: self.trainer.position.step,
                devices: self.device_names(),
                plan: self.trainer.pipeline.plan().config.clone(),
            });
            if !self.resumed {
                self.elastic.start(&mut self.trainer, &mut log)?;
            }
            // From here on the state is this run's: a later call continues it.
            self.resumed = true;
            while !self.trainer.done() {
                // Checkpoints at the multiples of `every`, counted from the run's first step
                // (a resumed run's too).
                let chunk = (every > 0).then(|| every - self.trainer.position.step % every);
                if self.metrics.borrow().as_ref().is_some_and(MetricsLog::is_held) {
                    // A run that starts over takes its first step alone, then sets the earlier
                    // run's files aside (a failure to do so ends it here), then goes on to the
                    // checkpoint's step.
                    let before = self.trainer.position.step;
                    self.trainer.fit(self.source.as_ref(), Some(1), &mut self.elastic, &mut log)?;
                    if self.trainer.position.step == before {
                        // Stopped before it (a signal): nothing of this run is kept.
                        return Err(Error::Interrupted { step: Some(before), unwritten: None });
                    }
                    // (A move that fails ends the run before it writes over anything; a log that
                    // cannot be written ends it at the checkpoint, as any failed write.)
                    if let Some(log) = self.metrics.borrow_mut().as_mut() {
                        log.set_aside().map_err(|e| io_error(&out, e))?;
                        if let Err(err) = log.open() {
                            record(err);
                        }
                    }
                } else {
                    self.trainer.fit(self.source.as_ref(), chunk, &mut self.elastic, &mut log)?;
                }
                // An evaluation that scored a new best (train.keep_best) ended the fit: its
                // weights to best/ before they train on. (Every process scored the same
                // evaluation, so all collect here.)
                if self.trainer.take_new_best().is_some() {
                    self.trainer.pipeline.collect_on_rank_zero()?;
                    if writes {
                        finish(&mut writing)?;
                        let (values, exporter) = (self.trainer.pipeline.parameter_tensors()?, self.exporter_to(BEST));
                        writing = Some(files::Background::spawn("best model", move || exporter.write(values))?);
                    }
                }
                // A checkpoint at its step, at the end, and when the run is asked to stop.
                let step = self.trainer.position.step;
                let due = (every > 0 && step.is_multiple_of(every)) || self.trainer.done() || self.trainer.stopping();
                if !due {
                    continue;
                }
                // A log that failed ends the run, once the weights it trained are written.
                let log_failed = write_error.take();
                // When the stages are processes, every stage's weights and optimizer state to
                // rank 0 (a collective: every process gets here) before it writes.
                self.trainer.pipeline.collect_on_rank_zero()?;
                if writes {
                    // One checkpoint and export on disk at a time: the last one is whole before
                    // this one starts (and its error, if any, ends the run here).
                    finish(&mut writing)?;
                    let taken = Instant::now();
                    let (state, tensors) = (self.elastic.state(), self.elastic.state_tensors());
                    let snapshot = self.trainer.snapshot(state, tensors)?;
                    if crate::debug::level() >= 1 {
                        eprintln!(
                            "checkpoint at step {}: snapshot {:.1} ms",
                            self.trainer.position.step,
                            taken.elapsed().as_secs_f64() * 1e3
                        );
                    }
                    let (path, exporter) = (self.checkpoint_path(), self.exporter());
                    writing = Some(files::Background::spawn("checkpoint", move || {
                        snapshot.save(&path)?;
                        exporter.write(snapshot.into_parameters())
                    })?);
                }
                if let Some(err) = log_failed {
                    finish(&mut writing)?;
                    return Err(io_error(&metrics_path, err));
                }
                // Asked to stop (a signal): the step's checkpoint is on its way; end once it is
                // whole (`run` then writes the report of the steps taken).
                if self.trainer.stopping() && !self.trainer.done() {
                    finish(&mut writing)?;
                    return Err(Error::Interrupted { step: Some(self.trainer.position.step), unwritten: None });
                }
            }
        }
        // The loop ends with a checkpoint and export of the final weights, when it ran at all.
        let exported = writing.is_some();
        finish(&mut writing)?;
        // (A run that starts over with no step to take is done here.)
        if let Some(log) = self.metrics.get_mut() {
            log.open().map_err(|e| io_error(&metrics_path, e))?;
        }
        let seconds = start.elapsed().as_secs_f64();
        if last_eval.is_none() {
            last_eval = Some(self.trainer.evaluate(self.source.as_ref())?);
        }
        let summary = Summary {
            data: self.info.clone(),
            family: self.trainer.pipeline.spec().family,
            parameters: self.trainer.pipeline.num_params(),
            steps: self.trainer.position.step,
            seconds,
            samples_per_second: samples as f64 / seconds.max(1e-9),
            eval: last_eval,
            best: self.trainer.selection.best,
            stopped_early: self.trainer.stopped_early(),
            frozen_layers: self.elastic.frozen_layers(),
            final_plan: self.trainer.pipeline.plan().config.clone(),
            devices: self.device_names(),
            unigram_baseline_loss: self.info.unigram_loss,
        };
        // (A resumed run with no step left has collected nothing yet.)
        self.trainer.pipeline.collect_on_rank_zero()?;
        // A resume with no step left trains nothing: the summary of the run that trained
        // (its time and rate) stays.
        let summary_path = out.join("summary.json");
        if writes && (samples > 0 || !summary_path.exists()) {
            let json = serde_json::to_vec_pretty(&summary).map_err(|e| internal("summary", e.to_string()))?;
            files::write_atomic(&summary_path, |w| w.write_all(&json))?;
        }
        if writes {
            if !exported {
                self.export()?;
            }
            super::report::write_report(&metrics_path, &out.join("report.html"), &self.config)?;
        }
        self.finished = Some(summary.clone());
        Ok(summary)
    }

    /// Writes the model as it stands to `output.dir/model/`, self-contained (weights, config
    /// with label names, tokenizer or vocabulary, preprocessing): at every checkpoint and at
    /// the end, so `predict` and `evaluate` can read a run that is still going.
    pub fn export(&self) -> Result<()> {
        self.exporter().write(self.trainer.pipeline.parameter_tensors()?)
    }

    /// What an export of the run's last weights writes besides them, owned (for a
    /// checkpoint's writing thread).
    fn exporter(&self) -> Exporter {
        self.exporter_to(MODEL)
    }

    /// What an export to `output.dir/folder/` writes besides the weights.
    fn exporter_to(&self, folder: &str) -> Exporter {
        Exporter {
            spec: self.trainer.pipeline.spec().clone(),
            config: self.model_config.clone(),
            labels: self.info.labels.clone(),
            tokenizer_dir: tokenizer_dir(&self.config).ok().map(Path::to_path_buf),
            chars: self.info.chars.clone(),
            max_seq_length: self.config.data.max_len,
            pixel_max: self.info.pixel_max,
            resize: self.config.data.resize_to.is_some(),
            // (Recorded once, when the run was built: the tokenizer's hash is not read again.)
            trained_on: self.trainer.data_settings.clone().unwrap_or_else(|| data_settings(&self.config)),
            dir: self.config.output.dir.join(folder),
        }
    }
}

/// An export's model description, labels, tokenizer and preprocessing, and its folder.
struct Exporter {
    spec: crate::model::Spec,
    config: ModelConfig,
    labels: Vec<String>,
    tokenizer_dir: Option<PathBuf>,
    chars: Vec<char>,
    max_seq_length: usize,
    pixel_max: Option<u32>,
    resize: bool,
    trained_on: serde_json::Value,
    dir: PathBuf,
}

impl Exporter {
    /// Writes the export of the parameters `values` (model names, model order).
    fn write(&self, values: Vec<weights::HostTensor>) -> Result<()> {
        let extras = weights::ExportExtras {
            labels: &self.labels,
            tokenizer_dir: self.tokenizer_dir.as_deref(),
            chars: &self.chars,
            max_seq_length: Some(self.max_seq_length),
            pixel_max: self.pixel_max,
            resize: self.resize,
            trained_on: Some(&self.trained_on),
        };
        weights::export_values(&self.spec, values, &self.config, &extras, &self.dir)?;
        Ok(())
    }
}

/// Waits for the checkpoint and export being written, if one is: its error, if any, is the
/// run's.
fn finish(writing: &mut Option<files::Background>) -> Result<()> {
    writing.take().map_or(Ok(()), files::Background::wait)
}
