//! The runtime: executes a [`Plan`] on a set of devices. One worker thread per device runs its
//! action list (`worker`); activations and gradients move between stages through per-device
//! inboxes (`mailbox`; device → host → device: the buffers of a `cpu` device are host memory
//! already); replicas sum their gradients by a ring all-reduce that a communication thread
//! beside each worker runs as soon as a stage's last backward is done, overlapping the rest of
//! the backward. Each worker zeroes its gradients where it would first wait anyway, and reads
//! its units' gradient norms once they are final. After every worker has finished, the step
//! ends as a one-device step does: tied gradients summed (`gradients`), the global norm, each
//! device's optimizer applied with clipping's coefficient (`optimizers`). Units are placed,
//! moved, frozen and read back by `placement`.
//!
//! A pipelined step is the same training step as on one device: every micro-batch keeps its
//! samples' global positions (dropout masks), the loss gradient is scaled by the global batch's
//! target count, and parameter gradients accumulate over micro-batches.
//!
//! Failure: a worker that returns an error or panics records its error, raises the abort flag
//! and wakes every waiting worker, which stop; the step returns the first worker's error and no
//! optimizer has run (gradients are zeroed by the next step). Never a hang: every wait watches
//! the abort flag.

mod gradients;
mod mailbox;
mod optimizers;
mod placement;
pub(crate) mod processes;
mod worker;

pub use worker::Fault;

use super::partition::UnitProfile;
use super::plan::{PipelineConfig, Plan};
use super::trace::StepTrace;
use crate::comm::process_group::ProcessGroup;
use crate::comm::watchdog::Watchdog;
use crate::comm::{Communicator, RingCommunicator, ring_group};
use crate::device::{Device, HostPool};
use crate::error::{Error, Result, config_error, counted, data_error, internal};
use crate::model::{Batch, Hidden, HostBatch, Model, ModelParts, Spec, Unit, head_loss};
use crate::optim::{Optimizer, OptimizerConfig};
use mailbox::Shared;
use processes::StageProcesses;
use std::sync::{Arc, Mutex};
use worker::{BucketBuffers, StageUnits, StepContext, Worker, WorkerOutput};

/// What one pipelined step reports.
#[derive(Clone, Debug, PartialEq)]
pub struct PipelineStep {
    /// Mean loss over the global batch's targets.
    pub loss: f64,
    /// Global gradient norm before clipping.
    pub grad_norm: f64,
    /// Whether the optimizer ran (false when the norm was not finite).
    pub applied: bool,
    /// `Σ ‖grad‖²` of each unit, in model order, after the replicas' sum and before clipping
    /// (0 for frozen units): the freeze controller's signal, at no extra pass.
    pub unit_grad_sq: Vec<f64>,
    /// The frozen prefix's output for the whole batch (the input of the first trainable unit,
    /// in sample order), when the step was asked to capture it.
    pub frozen_output: Option<Hidden>,
    /// When each action ran.
    pub trace: StepTrace,
    /// Whether any process of the run asked to stop after this step (with one process, its
    /// own [`StepOptions::stop_requested`]), agreed in the step's own sums.
    pub stop_requested: bool,
    /// Per device (replica-major), the most activation elements it held at once for the
    /// backward: saved activations of the pieces in flight plus TeraPipe's key/value arenas and
    /// the last stage's gradients of the logits (held from the loss to the backward), and
    /// under zero bubble the inputs and output gradients of put-off weight gradients.
    pub peak_activations: Vec<usize>,
    /// Whether the workers ran on the threads of the pool their devices share, each wait
    /// lending its thread to the others' ops ([`crate::device::HostPool::run_each`]).
    pub pooled: bool,
}

/// How to run one step besides its batch.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct StepOptions {
    /// Seed of the step's dropout masks (each sample's mask also depends on its position).
    pub dropout_seed: u64,
    /// Learning rate.
    pub lr: f64,
    /// Clip the global gradient norm to this.
    pub max_grad_norm: Option<f64>,
    /// Return the frozen prefix's output ([`PipelineStep::frozen_output`]).
    pub capture_frozen_output: bool,
    /// This process asks the run to stop after this step: its vote rides on the step's loss
    /// sum across processes, so every process learns the outcome at no extra collective.
    pub stop_requested: bool,
}

/// The loss and logits of one evaluation batch.
#[derive(Clone, Debug, PartialEq)]
pub struct EvalOutput {
    /// Sum of per-row losses over the rows that count.
    pub loss_sum: f64,
    /// Rows that count.
    pub count: usize,
    /// Logits, row-major.
    pub logits: Vec<f32>,
}

/// A model spread over devices by a plan, with its optimizers.
pub struct Pipeline<D: Device> {
    devices: Vec<D>,
    spec: Spec,
    tied: Option<[(usize, String); 2]>,
    plan: Plan,
    /// `stages[r][s]`: replica `r`'s units of stage `s`, on device `plan.device(r, s)`.
    stages: Vec<Vec<Vec<Unit<D>>>>,
    /// `optimizers[r][d]`: the optimizer of replica `r`'s pipeline position `d`.
    optimizers: Vec<Vec<Optimizer<D>>>,
    optimizer_config: OptimizerConfig,
    fault: Option<Fault>,
    /// `communicators[d][r]`: how replica `r` at pipeline position `d` sums its gradients with
    /// the other replicas at `d`, when the caller supplied communicators (NCCL for GPUs); `None`
    /// means the in-process host ring, run by a thread beside each worker.
    communicators: Option<Vec<Vec<Arc<dyn Communicator<D>>>>>,
    /// The processes this pipeline trains with (`pipetransformer launch`): each runs its shard
    /// of every global batch, and they sum gradients (as the backward goes, where one worker
    /// runs here; else after it) and losses. When the stages are processes too, the other
    /// replicas of this process's stage (its column).
    process_group: Option<Arc<ProcessGroup>>,
    /// With a process group and one whole pipeline of several stages in each process: a ring
    /// over the processes per pipeline position, split off the group, so that each position's
    /// worker sums its gradients as its backward ends without sharing connections with the
    /// others ([`set_process_group`](Self::set_process_group)).
    stage_columns: Vec<Arc<ProcessGroup>>,
    /// When the stages are processes ([`across_processes`](Self::across_processes)): this
    /// process runs one stage (its rank in its row) on its one device, where every stage's
    /// units are kept, the other stages' hollow (without weights) but after a share.
    stage_processes: Option<StageProcesses>,
    /// When the stages are processes: where copies of the other stages' weights (and
    /// optimizer state) are current since the last step, alike on every process.
    stage_copies: Copies,
    optimizer_copies: Copies,
    /// On rank 0 after [`collect_on_rank_zero`](Self::collect_on_rank_zero): the other
    /// stages' weights and optimizer state, on the host (its device keeps its own stage only).
    collected: Collected,
    /// When the stages are processes: the frozen prefix, which the units cannot tell (the
    /// other stages' units hold no gradient buffers here, so they all look frozen).
    frozen_units: usize,
    /// Host buffers the in-process ring's gradient buckets travel in, kept from step to step:
    /// a fresh one of tens of megabytes would come from the kernel as new pages every step.
    bucket_buffers: BucketBuffers,
    /// The least gradient elements a bucket sent to be summed during a backward holds.
    bucket_elements: usize,
    /// The actions the workers have finished, over every step: what the watchdog of
    /// communicators spanning the processes watches for a stall.
    progress: Arc<std::sync::atomic::AtomicU64>,
    /// Each device's own thread count (cpu devices; `None` elsewhere), and whether devices the
    /// plan leaves idle lend theirs to those at work ([`lend_idle_threads`](Self::lend_idle_threads)).
    own_threads: Vec<Option<usize>>,
    lend_threads: bool,
    /// The threads device 0's ops ran on when the units' profiles were measured: its own, or
    /// all of the pool the devices share.
    profiled_threads: usize,
}

/// When the stages are processes, where copies of the other stages' weights (or optimizer
/// state) are current: nowhere (a step has run since they were sent), in rank 0's host memory
/// (rank 0 writes the run's files: [`Pipeline::collect_on_rank_zero`]), or on every process's
/// device ([`Pipeline::share_stages`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Copies {
    Stale,
    OnRankZero,
    Everywhere,
}

impl Copies {
    /// Whether copies that stand here already are where `to` asks for them.
    fn reach(self, to: Copies) -> bool {
        self == Copies::Everywhere || self == to
    }
}

/// The other stages' weights (by name) and optimizer state that rank 0 collected for a
/// checkpoint or an export.
#[derive(Default)]
struct Collected {
    weights: std::collections::HashMap<String, Vec<f32>>,
    optimizer: Vec<crate::optim::ParamState>,
}

/// The pool every one of `devices` computes on, where they share one (a run's cpu devices).
fn common_pool<D: Device>(devices: &[D]) -> Option<&Arc<HostPool>> {
    let first = devices.first()?.host_pool()?;
    devices.iter().all(|d| d.host_pool().is_some_and(|p| Arc::ptr_eq(p, first))).then_some(first)
}

/// Runs `work` on each of `items` at once, each on a thread of its own, and returns the results
/// in order: on `pool`'s threads where one is given and takes them ([`HostPool::run_each`]:
/// each op then runs on its calling thread instead of being handed to the pool and waited
/// for), else on scoped threads. A panic is `what`'s error on either path.
fn on_threads_each<T: Send, R: Send>(
    pool: Option<&HostPool>,
    items: Vec<T>,
    what: &str,
    work: impl Fn(T) -> Result<R> + Sync,
) -> Vec<Result<R>> {
    // `run_each` hands out indices: each index takes its item out of its slot, once.
    let slots: Vec<Mutex<Option<T>>> = items.into_iter().map(|t| Mutex::new(Some(t))).collect();
    let run = |i: usize| {
        let item = slots[i].lock().unwrap_or_else(|e| e.into_inner()).take();
        let item = item.ok_or_else(|| internal(what, format!("thread {i} ran twice")))?;
        std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| work(item)))
            .unwrap_or_else(|p| Err(mailbox::panicked(what, p.as_ref())))
    };
    if let Some(out) = pool.and_then(|p| p.run_each(slots.len(), run)) {
        return out;
    }
    std::thread::scope(|scope| {
        let handles: Vec<_> = (0..slots.len()).map(|i| scope.spawn(move || run(i))).collect();
        handles.into_iter().map(|h| h.join().unwrap_or_else(|p| Err(mailbox::panicked(what, p.as_ref())))).collect()
    })
}

/// [`Pipeline::device_index`] for callers that hold part of the pipeline mutably.
fn device_slot(g: usize, across_processes: bool) -> usize {
    if across_processes { 0 } else { g }
}

/// Unit names for plans (`embeddings#0`, `attention#1`, ...).
pub fn unit_names<'a, D: Device>(units: impl IntoIterator<Item = &'a Unit<D>>) -> Vec<String> {
    units.into_iter().enumerate().map(|(i, u)| format!("{}#{i}", u.kind_name())).collect()
}

impl<D: Device> Pipeline<D> {
    /// Spreads `model` (whose buffers live on `devices[0]`) over `devices` as `config` asks,
    /// with per-unit costs `profiles` for the partitioner and the model's frozen prefix pinned
    /// to the first stage.
    pub fn new(
        devices: Vec<D>,
        model: Model<D>,
        optimizer: OptimizerConfig,
        config: PipelineConfig,
        profiles: &[UnitProfile],
    ) -> Result<Self> {
        let pinned = model.frozen_prefix();
        let ModelParts { spec, units, tied } = model.into_parts();
        let plan = Plan::new(config, profiles, unit_names(&units), devices.len(), pinned)?;
        Self::assemble(devices, ModelParts { spec, units, tied }, plan, optimizer, None)
    }

    /// The pipeline of `plan` over `devices`, its units (all on `devices[0]`) placed where the
    /// plan says, each position with a fresh optimizer.
    fn assemble(
        devices: Vec<D>,
        parts: ModelParts<D>,
        plan: Plan,
        optimizer: OptimizerConfig,
        stage_processes: Option<StageProcesses>,
    ) -> Result<Self> {
        let ModelParts { spec, units, tied } = parts;
        let frozen_units = units.iter().take_while(|u| !u.trainable()).count();
        let owned: Vec<(Unit<D>, usize)> = units.into_iter().map(|u| (u, 0)).collect();
        let own_threads = devices.iter().map(Device::threads).collect();
        let profiled_threads = devices.first().and_then(|d| d.host_pool()).map_or(1, |p| p.threads());
        // A stage process holds its own stages only (`across_processes` drops the rest).
        let copies = if stage_processes.is_some() { Copies::Stale } else { Copies::Everywhere };
        let mut p = Pipeline {
            own_threads,
            lend_threads: false,
            profiled_threads,
            devices,
            spec,
            tied,
            plan,
            stages: Vec::new(),
            optimizers: Vec::new(),
            optimizer_config: optimizer,
            fault: None,
            communicators: None,
            process_group: None,
            stage_columns: Vec::new(),
            stage_copies: copies,
            optimizer_copies: copies,
            collected: Collected::default(),
            frozen_units,
            stage_processes,
            bucket_buffers: BucketBuffers::default(),
            bucket_elements: worker::BUCKET_ELEMENTS,
            progress: Arc::default(),
        };
        p.place(owned)?;
        if let Some(own) = p.process_stage() {
            // Other processes train the other stages: their units here need no gradients.
            let (k, dev) = (p.plan.config.pipeline_len, &p.devices[0]);
            for (_, units) in p.stages[0].iter_mut().enumerate().filter(|(s, _)| s % k != own) {
                for param in units.iter_mut().flat_map(Unit::params_mut) {
                    param.set_trainable(dev, false)?;
                }
            }
        }
        p.optimizers = p.fresh_optimizers()?;
        Ok(p)
    }

    /// A pipeline whose stages are the processes of `group` (`pipetransformer launch`, one
    /// process per device): the group's `K·R` processes make `R` replicas of a `K`-stage
    /// pipeline (`K = config.pipeline_len`), process `r·K + s` training stage `s` of replica
    /// `r` on its one `device` and its shard of every global batch (shard `r` of `R`, cut as
    /// the replicas of one process cut it). Activations and gradients cross between a row's
    /// neighbouring processes over its own ring; a stage's gradients are summed over its
    /// column's. Every process must build the same plan from the same `profiles` (checked: a
    /// fingerprint of the plan and the parameters' shapes is compared across the group). A
    /// process holds weights, gradients and optimizer state for its own stage only: the other
    /// stages' units keep their shapes, [hollow](crate::model::Param::hollow) (a `model` built
    /// whole has their values dropped here; one built by [`Model::new_keeping`] for
    /// [`units_of_process`](Self::units_of_process) never had them).
    /// Evaluation runs through the row's processes as a forward pipeline; for a checkpoint or
    /// an export, [`collect_on_rank_zero`](Self::collect_on_rank_zero) brings every stage's
    /// weights and optimizer state to rank 0 alone ([`share_stages`](Self::share_stages) to
    /// every process), until the next step drops them again.
    /// `config.replicas` is 1 (the replicas are processes); no re-planning, and no activation
    /// cache.
    pub fn across_processes(
        device: D,
        model: Model<D>,
        optimizer: OptimizerConfig,
        config: PipelineConfig,
        profiles: &[UnitProfile],
        group: Arc<ProcessGroup>,
    ) -> Result<Self> {
        let (k, size) = (config.pipeline_len, group.size());
        let plan = Self::plan_across_processes(&model, config, profiles, size)?;
        let parts = model.into_parts();
        processes::agree(&group, &plan, &parts.units)?;
        let (rows, columns) = (size / k, (0..k).map(|s| (s..size).step_by(k).collect()).collect::<Vec<Vec<usize>>>());
        let (row, column) = if rows == 1 {
            (group.clone(), None)
        } else {
            let row: Vec<Vec<usize>> = (0..rows).map(|r| (r * k..(r + 1) * k).collect()).collect();
            let split = |parts: &[Vec<usize>], label| group.split(parts, label).inspect_err(|_| group.hang_up());
            (Arc::new(split(&row, "pipeline rows")?), Some(Arc::new(split(&columns, "replica columns")?)))
        };
        let processes = StageProcesses::new(row, group)?;
        let mut pipeline = Self::assemble(vec![device], parts, plan, optimizer, Some(processes))?;
        pipeline.process_group = column;
        // From the start, this process holds its own stages' weights only.
        pipeline.drop_other_stages()?;
        Ok(pipeline)
    }

    /// Which of `model`'s units process `rank` of a group of `size` would run in
    /// [`across_processes`](Self::across_processes) with the same arguments: a stage process
    /// builds its model [keeping](Model::new_keeping) only those units' values. Every process
    /// plans from the same `profiles`, so `model` may be all [hollow](crate::model::Param::hollow).
    pub fn units_of_process(
        model: &Model<D>,
        config: PipelineConfig,
        profiles: &[UnitProfile],
        rank: usize,
        size: usize,
    ) -> Result<Vec<bool>> {
        let k = config.pipeline_len;
        let plan = Self::plan_across_processes(model, config, profiles, size)?;
        Ok((0..model.units().len()).map(|u| plan.stage_of(u) % k == rank % k).collect())
    }

    /// The plan every process of a pipeline across `size` processes makes alike.
    fn plan_across_processes(
        model: &Model<D>,
        config: PipelineConfig,
        profiles: &[UnitProfile],
        size: usize,
    ) -> Result<Plan> {
        let k = config.pipeline_len;
        if config.replicas != 1 || k < 2 || !size.is_multiple_of(k) {
            return Err(config_error(
                "pipeline_len",
                format!(
                    "a pipeline across processes cuts the {size} processes into rows of pipeline_len stages, each \
                     row a replica: pipeline_len must be at least 2 and divide {size} (the process count), and \
                     replicas be 1; now {} and {}",
                    counted(config.pipeline_len, "stage"),
                    counted(config.replicas, "replica")
                ),
            ));
        }
        Plan::new(config, profiles, unit_names(model.units()), k, model.frozen_prefix())
    }

    /// The index in `devices` of the plan's device `g`: itself, or this process's one device
    /// when the stages are processes.
    fn device_index(&self, g: usize) -> usize {
        device_slot(g, self.stage_processes.is_some())
    }

    /// The device of replica `r`'s stage `s`.
    fn device_at(&self, r: usize, s: usize) -> &D {
        &self.devices[self.device_index(self.plan.device(r, s))]
    }

    /// Refuses a replica index the pipeline does not have, naming `what` was asked of it.
    fn check_replica(&self, what: &str, replica: usize) -> Result<()> {
        match replica < self.stages.len() {
            true => Ok(()),
            false => Err(crate::error::config_error(
                "replica",
                format!(
                    "{what} on replica {replica}; the pipeline has {} (0 to {})",
                    self.stages.len(),
                    self.stages.len().saturating_sub(1)
                ),
            )),
        }
    }

    /// Refuses to read every stage's weights (or, with `optimizer`, optimizer state) where
    /// this process's copies of the other stages' may be out of date: the stages are processes
    /// and they have trained since they last shared. Reads `on_device` need them on this
    /// process's device; the others take rank 0's host copies too.
    fn check_shared(&self, what: &str, optimizer: bool, on_device: bool) -> Result<()> {
        let holds = |c| self.holds(c, on_device);
        if self.stage_processes.is_some() && !(holds(self.stage_copies) && (!optimizer || holds(self.optimizer_copies)))
        {
            let call = if optimizer { "share_stages and share_optimizer_state" } else { "share_stages" };
            return Err(config_error(
                "processes",
                format!("{what} reads every stage, and other processes train them: call {call} on every process first"),
            ));
        }
        Ok(())
    }

    /// Whether this process holds current copies where `copies` says they are (`on_device`:
    /// on its device; rank 0's collected copies are on the host).
    fn holds(&self, copies: Copies, on_device: bool) -> bool {
        match copies {
            Copies::Everywhere => true,
            Copies::OnRankZero => !on_device && self.all_processes().is_none_or(|g| g.rank() == 0),
            Copies::Stale => false,
        }
    }

    /// The stage this process runs, when the stages are processes (its pipeline position:
    /// under an interleaved plan, every stage `s` with `s % K` equal to it).
    pub fn process_stage(&self) -> Option<usize> {
        self.stage_processes.as_ref().map(StageProcesses::rank)
    }

    /// Every process of the run, when the stages are processes (every row, every replica).
    pub fn all_processes(&self) -> Option<&ProcessGroup> {
        self.stage_processes.as_ref().map(|p| &*p.all)
    }

    /// Every process of a launched run, however its processes divide the work (stages,
    /// replicas or both); `None` for a run of one process.
    pub fn every_process(&self) -> Option<&ProcessGroup> {
        self.all_processes().or(self.process_group())
    }

    /// Hangs up every link to another process (the stages' and the replicas'), so that none
    /// waits for this one: its peers fail at once, naming it.
    pub fn hang_up_processes(&self) {
        if let Some(p) = &self.stage_processes {
            p.hang_up();
        }
        for g in self.process_group.iter().chain(&self.stage_columns) {
            g.hang_up();
        }
    }

    /// Whether this process computes stage `s`'s gradients (always, unless the stages are
    /// processes and `s` is another's).
    fn runs_stage(&self, s: usize) -> bool {
        self.process_stage().is_none_or(|own| own == s % self.plan.config.pipeline_len)
    }

    /// When the stages are processes: every process's copy of every stage's weights becomes
    /// that stage's process's (an all-gather over the row, exact), so
    /// [`parameters`](Self::parameters), [`gather`](Self::gather) and the like see the trained
    /// model. A collective: every process of the group calls it at the same point. Does
    /// nothing otherwise, or when nothing has trained since the last share (every process
    /// knows that alike).
    pub fn share_stages(&mut self) -> Result<()> {
        self.spread_stages(Copies::Everywhere)
    }

    /// When the stages are processes: every stage's weights and optimizer state to the host
    /// memory of rank 0 of the run only (which writes the checkpoint and the exported model:
    /// [`parameter_values`](Self::parameter_values) and
    /// [`optimizer_state`](Self::optimizer_state) read them there): the processes of rank 0's
    /// row send their stages' over their links to rank 0, the other rows (which hold the
    /// same) nothing. No device ever holds more than its stage. A collective, like
    /// [`share_stages`](Self::share_stages); does nothing otherwise.
    pub fn collect_on_rank_zero(&mut self) -> Result<()> {
        let out = self.spread_stages(Copies::OnRankZero).and_then(|()| self.spread_optimizer_state(Copies::OnRankZero));
        out.inspect_err(|_| self.hang_up_processes())
    }

    /// Sends this process's stage's weights to where `to` says the copies go; see
    /// [`share_stages`](Self::share_stages) and [`collect_on_rank_zero`](Self::collect_on_rank_zero).
    fn spread_stages(&mut self, to: Copies) -> Result<()> {
        let Some(processes) = self.stage_processes.as_ref() else { return Ok(()) };
        if self.stage_copies.reach(to) {
            return Ok(());
        }
        let (dev, k, own) = (&self.devices[0], self.plan.config.pipeline_len, processes.rank());
        // Process by process (an interleaved plan gives each several stages), stage by stage.
        let order: Vec<usize> = (0..k).flat_map(|d| (d..self.stages[0].len()).step_by(k)).collect();
        let mut bounds = Vec::with_capacity(k);
        let mut mine = Vec::new();
        for d in 0..k {
            let start = bounds.last().map_or(0, |b: &std::ops::Range<usize>| b.end);
            let params =
                order.iter().filter(|&&s| s % k == d).flat_map(|&s| self.stages[0][s].iter().flat_map(Unit::params));
            let mut len = 0;
            for p in params {
                len += p.numel();
                if d == own {
                    dev.download_extend(&p.value, &mut mine)?;
                }
            }
            bounds.push(start..start + len);
        }
        let receives = self.spread(&mut mine, &bounds, to)?;
        if receives {
            let mut at = 0;
            for s in order {
                for p in self.stages[0][s].iter_mut().flat_map(Unit::params_mut) {
                    let n = p.numel();
                    // This process's own stages are already current (and may not be f32).
                    if s % k != own {
                        let values = &mine[at..at + n];
                        match to {
                            Copies::Everywhere => p.value = dev.upload(values)?,
                            // Rank 0 keeps them on the host: its device holds its stage only.
                            _ => drop(self.collected.weights.insert(p.name.clone(), values.to_vec())),
                        }
                    }
                    at += n;
                }
            }
        }
        self.stage_copies = to;
        Ok(())
    }

    /// When the stages are processes: `values` holds this process's part of a buffer cut by
    /// position as `bounds` says; afterwards, on every process (`to` everywhere: an all-gather
    /// over the row) or on rank 0 only (a gather over its links, in which the other rows'
    /// processes send nothing), it holds the whole buffer. Returns whether this one received
    /// it. On failure, hangs up on everyone.
    fn spread(&self, values: &mut Vec<f32>, bounds: &[std::ops::Range<usize>], to: Copies) -> Result<bool> {
        let Some(p) = &self.stage_processes else { return Ok(false) };
        let own = bounds[p.rank()].clone();
        let whole = |mine: &[f32]| {
            let mut all = vec![0.0; bounds.last().map_or(0, |b| b.end)];
            all[own.clone()].copy_from_slice(mine);
            all
        };
        let result = match to {
            Copies::Everywhere => {
                *values = whole(values);
                p.group.all_gather_f32(values, bounds).map(|()| true)
            }
            _ => {
                // Rank 0's row sends; the other rows hold the same and send nothing.
                let (rank, k) = (p.all.rank(), bounds.len());
                let segment = if rank < k { std::mem::take(values) } else { Vec::new() };
                let world: Vec<std::ops::Range<usize>> =
                    (0..p.all.size()).map(|w| if w < k { bounds[w].clone() } else { 0..0 }).collect();
                if rank == 0 {
                    *values = whole(&segment);
                    p.all.gather_f32(&segment, Some((values, &world))).map(|()| true)
                } else {
                    p.all.gather_f32(&segment, None).map(|()| false)
                }
            }
        };
        result.inspect_err(|_| self.hang_up_processes())
    }

    /// When the stages are processes: drops this process's copies of the other stages'
    /// weights, which its next step leaves out of date (until the next
    /// [`share_stages`](Self::share_stages)), so that while it trains a process holds only
    /// its own stage's weights, gradients and optimizer state.
    fn drop_other_stages(&mut self) -> Result<()> {
        let Some(own) = self.process_stage() else { return Ok(()) };
        let (dev, k) = (&self.devices[0], self.plan.config.pipeline_len);
        let others = self.stages[0].iter_mut().enumerate().filter(|(s, _)| s % k != own);
        others.flat_map(|(_, units)| units.iter_mut()).try_for_each(|u| u.hollow(dev))
    }

    /// The plan in force.
    pub fn plan(&self) -> &Plan {
        &self.plan
    }

    /// Whether a step on a batch of `samples` runs the plan's micro-batch count on every
    /// process: a shard shorter than `M × R` (an epoch's short last batch) runs fewer (see
    /// [`step_with`](Self::step_with)). The same answer on every process.
    pub fn runs_all_micro_batches(&self, samples: usize) -> bool {
        let processes = self.process_group().map_or(1, |g| g.size()).max(1);
        let config = &self.plan.config;
        samples / processes >= config.micro_batches.saturating_mul(config.replicas)
    }

    /// The devices (the plan uses the first `R·K`).
    pub fn devices(&self) -> &[D] {
        &self.devices
    }

    /// The model's validated spec.
    pub fn spec(&self) -> &Spec {
        &self.spec
    }

    /// Units in the model.
    pub fn unit_count(&self) -> usize {
        self.stages[0].iter().map(Vec::len).sum()
    }

    /// Replica 0's units, in model order.
    pub fn units(&self) -> impl Iterator<Item = &Unit<D>> {
        self.stages[0].iter().flatten()
    }

    /// Total parameter elements (a tied weight counted once).
    pub fn num_params(&self) -> usize {
        let all: usize = self.units().flat_map(Unit::params).map(|p| p.numel()).sum();
        let tied = self
            .tied
            .as_ref()
            .map_or(0, |t| self.units().flat_map(Unit::params).find(|p| p.name == t[1].1).map_or(0, |p| p.numel()));
        all - tied
    }

    /// The optimizer's configuration.
    pub fn optimizer_config(&self) -> OptimizerConfig {
        self.optimizer_config
    }

    /// Sums replicas' gradients with these communicators from now on: `communicators[d][r]` is
    /// replica `r`'s member of the group of pipeline position `d` (for example NCCL over the
    /// GPUs at that position). `None` goes back to the in-process host ring. The layout must
    /// match the plan; a re-plan that changes `K` or `R` drops them.
    ///
    /// A process of a [process group](Self::set_process_group) whose pipelines have one stage
    /// may pass groups that span the processes instead (NCCL over every GPU of the run):
    /// `P·R` members, process `p`'s replica `r` ranked `p·R + r`. The workers then sum every
    /// replica of every process on them as the backward goes, and nothing is summed over the
    /// process group's host ring after the step. Every process must pass such groups at the
    /// same point, or none.
    pub fn set_communicators(&mut self, communicators: Option<Vec<Vec<Arc<dyn Communicator<D>>>>>) -> Result<()> {
        if let Some(c) = &communicators {
            let (k, r) = (self.plan.config.pipeline_len, self.plan.config.replicas);
            let (first, size) = match (&self.process_group, &self.stage_processes) {
                (Some(g), None) if c.iter().flatten().any(|m| m.size() != r) => (g.rank() * r, g.size() * r),
                _ => (0, r),
            };
            let ok = c.len() == k
                && c.iter().all(|g| {
                    g.len() == r && g.iter().enumerate().all(|(i, m)| m.rank() == first + i && m.size() == size)
                });
            if !ok {
                return Err(config_error(
                    "communicators",
                    format!(
                        "expected {k} groups (one per pipeline position) of {r} members ranked {first}..{} of {size}",
                        first + r
                    ),
                ));
            }
            if size > r && k > 1 {
                return Err(config_error(
                    "communicators",
                    "groups spanning processes need one stage per process (pipeline_len = 1): processes may cut \
                     their stages differently",
                ));
            }
        }
        self.communicators = communicators;
        Ok(())
    }

    /// With communicators spanning the processes, a watchdog for one step: NCCL has no
    /// timeout of its own, so past the group's it aborts them and hangs up, and a lost peer
    /// ends the step with an error instead of a hang.
    fn spanning_watchdog(&self, group: &Arc<ProcessGroup>) -> Option<Watchdog> {
        if !self.communicators_span_processes() {
            return None;
        }
        let comms: Vec<Arc<dyn Communicator<D>>> = self.communicators.iter().flatten().flatten().cloned().collect();
        let group = group.clone();
        Some(Watchdog::start(group.timeout(), self.progress.clone(), move || {
            comms.iter().for_each(|c| c.abort());
            group.hang_up();
        }))
    }

    /// Aborts communicators that span the processes (their collectives may wait for a peer
    /// that is gone); does nothing to in-process ones.
    fn abort_spanning_communicators(&self) {
        if self.communicators_span_processes() {
            self.communicators.iter().flatten().flatten().for_each(|c| c.abort());
        }
    }

    /// Whether the communicators span the processes of the process group (see
    /// [`set_communicators`](Self::set_communicators)).
    pub fn communicators_span_processes(&self) -> bool {
        let r = self.plan.config.replicas;
        self.process_group.is_some()
            && self.communicators.as_ref().is_some_and(|c| c.iter().flatten().any(|m| m.size() > r))
    }

    /// What the replicas sum their gradients over, for the console: `none (one replica)`, the
    /// supplied communicators' name (e.g. NCCL), or the in-process `host ring`.
    pub fn communicator(&self) -> String {
        let spanning = self.communicators_span_processes();
        match &self.communicators {
            _ if self.plan.config.replicas < 2 && !spanning => "none (one replica)".into(),
            Some(groups) => groups.first().and_then(|g| g.first()).map_or_else(|| "none".into(), |c| c.name()),
            None => "host ring".into(),
        }
    }

    /// Trains as one process of `group` from now on (`None`: alone): each step runs this
    /// process's shard of the global batch (shard `rank` of `size`, cut as
    /// [`HostBatch::split`] cuts, so every sample keeps its dropout mask) and sums gradients and
    /// loss with the other processes before clipping and the optimizer. The activation cache
    /// is not available then (a process captures only its shard).
    ///
    /// With one whole pipeline of K > 1 stages on every process, this opens a ring over the
    /// processes for each pipeline position (a collective: every process sets its group at the
    /// same point), so that the stages' workers can sum their gradients as each backward ends
    /// ([`sums_during_backward`](Self::sums_during_backward)).
    pub fn set_process_group(&mut self, group: Option<Arc<ProcessGroup>>) -> Result<()> {
        if self.stage_processes.is_some() {
            return Err(config_error(
                "processes",
                "a pipeline whose stages are processes takes its replicas from its own group",
            ));
        }
        if self.communicators_span_processes() {
            // They span the group being left.
            self.communicators = None;
        }
        let PipelineConfig { pipeline_len: k, replicas: r, .. } = self.plan.config;
        self.stage_columns = Vec::new();
        if let Some(g) = &group
            && processes::first_disagreeing(g, (k as u64) << 32 | r as u64)?.is_none()
            && k > 1
            && r == 1
        {
            let everyone: Vec<usize> = (0..g.size()).collect();
            self.stage_columns = (0..k)
                .map(|d| g.split(std::slice::from_ref(&everyone), &format!("position {d} gradients")).map(Arc::new))
                .collect::<Result<_>>()?;
        }
        self.process_group = group;
        Ok(())
    }

    /// Whether the other processes' gradients are summed by the workers as each stage's
    /// backward ends (else after the step, all at once): when the stages are processes, or
    /// this process runs one worker, or one pipeline with a ring per position (above), or the
    /// communicators span the processes ([`set_communicators`](Self::set_communicators)). In the
    /// last case each step first checks that every process cut the same stages (processes
    /// that time their units may not): where one did not, that step sums after it.
    pub fn sums_during_backward(&self) -> bool {
        let PipelineConfig { pipeline_len: k, replicas: r, .. } = self.plan.config;
        self.process_group.is_some()
            && (self.stage_processes.is_some()
                || r * k == 1
                || (r == 1 && self.stage_columns.len() >= k)
                || self.communicators_span_processes())
    }

    /// [`sums_during_backward`](Self::sums_during_backward) for the step about to run: with a
    /// ring per position, only where every process has the same plan, frozen prefix and
    /// buckets (a collective, at every step of every process alike: the rings exist on all
    /// or none). Each position's buckets then match across the processes.
    fn sums_this_step_during_backward(&self) -> Result<bool> {
        let Some(group) = self.process_group.as_deref().filter(|_| !self.stage_columns.is_empty()) else {
            return Ok(self.sums_during_backward());
        };
        let print = processes::plan_print(&self.plan, (self.frozen_prefix(), self.bucket_elements));
        Ok(processes::first_disagreeing(group, print)?.is_none() && self.sums_during_backward())
    }

    /// The actions (a micro-batch's forward on a stage, a message sent, ...) the workers have
    /// finished, over every step: the progress the watchdog of communicators spanning the
    /// processes reads, so that a long step that goes on is not taken for a stalled one.
    pub fn actions_finished(&self) -> u64 {
        self.progress.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// The process group this pipeline sums gradients with, if it trains with other
    /// processes: when the stages are processes, the other replicas of this one's stage (its
    /// column; `None` with one row).
    pub fn process_group(&self) -> Option<&ProcessGroup> {
        self.process_group.as_deref()
    }

    /// Sets the least gradient elements a bucket holds when a stage's last backward sends its
    /// units' gradients to be summed (across replicas or processes) as it goes, from the top
    /// unit down (PyTorch DDP's `bucket_cap_mb`; default 2²⁰, about one MiniLM layer). Smaller
    /// starts the sums earlier, in more messages. Does not change what is summed; across
    /// processes every process must set the same (the buckets are the collectives' calls).
    pub fn set_bucket_elements(&mut self, elements: usize) {
        self.bucket_elements = elements.max(1);
    }

    /// Injects (or clears) a fault for the next steps.
    pub fn set_fault(&mut self, fault: Option<Fault>) {
        self.fault = fault;
    }

    /// One training step on the global batch `host`: each replica takes its contiguous shard,
    /// cut into the plan's micro-batches; dropout masks come from `dropout_seed` and each
    /// sample's global position. With `max_grad_norm`, gradients are clipped to that global
    /// norm; a non-finite norm skips the update.
    pub fn step(
        &mut self,
        host: &HostBatch,
        dropout_seed: u64,
        lr: f64,
        max_grad_norm: Option<f64>,
    ) -> Result<PipelineStep> {
        self.step_with(
            host,
            &StepOptions { dropout_seed, lr, max_grad_norm, capture_frozen_output: false, stop_requested: false },
        )
    }

    /// [`step`](Self::step) with every option. A batch that carries [`Hidden`] states starts at
    /// their unit, which must not be above the first trainable one. A batch too short for the
    /// plan's micro-batches (an epoch's last) runs with fewer, on the same stages.
    pub fn step_with(&mut self, host: &HostBatch, options: &StepOptions) -> Result<PipelineStep> {
        let across = self.stage_processes.is_some();
        if options.capture_frozen_output && (across || self.process_group.is_some()) {
            return Err(config_error("cache", "a multi-process run cannot fill the activation cache"));
        }
        if let Some(own) = self.process_stage() {
            // The other stages' copies go out of date; their optimizer state (shared for a
            // checkpoint) is not kept on this device.
            if self.holds(self.optimizer_copies, true) {
                self.forget_other_optimizer_state(own)?;
            }
            if self.holds(self.stage_copies, true) {
                self.drop_other_stages()?;
            }
            (self.stage_copies, self.optimizer_copies) = (Copies::Stale, Copies::Stale);
            self.collected = Collected::default();
        }
        let out = match self.process_group.clone() {
            None => self.step_shard(host, host.target_count(), options),
            // Checked on the global batch, alike on every process (none goes on into a
            // collective that another has left).
            Some(group) if host.batch < group.size() * self.plan.config.replicas => Err(config_error(
                "processes",
                format!(
                    "a batch of {} cannot feed {} of {}",
                    counted(host.batch, "sample"),
                    counted(group.size(), "process"),
                    counted(self.plan.config.replicas, "replica")
                ),
            )),
            Some(group) => {
                let watchdog = self.spanning_watchdog(&group);
                let shard = host.split(group.size()).map(|mut s| s.swap_remove(group.rank()));
                let out = shard.and_then(|shard| self.step_shard(&shard, host.target_count(), options));
                match watchdog.map(Watchdog::stop) {
                    Some(true) => Err(Error::Device {
                        what: "process group".into(),
                        message: format!(
                            "the step made no progress for {:?} (PT_COLLECTIVE_TIMEOUT), its collectives \
                             waiting: a peer process is gone or stalled; its NCCL communicators were aborted",
                            group.timeout()
                        ),
                    }),
                    _ => out,
                }
            }
        };
        if out.is_err() && (across || !self.stage_columns.is_empty() || self.communicators_span_processes()) {
            // The others must not wait for this process (a stage's message, a ring's sum):
            // they fail at once, naming it. (NCCL's waits end at their own watchdog's timeout.)
            self.abort_spanning_communicators();
            self.hang_up_processes();
        }
        out
    }

    /// A step on `host` (this process's shard of a global batch of `count` targets).
    fn step_shard(&mut self, host: &HostBatch, count: usize, options: &StepOptions) -> Result<PipelineStep> {
        let PipelineConfig { replicas: r_count, micro_batches: m, .. } = self.plan.config;
        if host.batch < r_count {
            return Err(config_error(
                "pipeline.replicas",
                format!(
                    "a batch of {} cannot feed {r_count} replicas, each of which needs one at least (the \
                     training set, or an epoch's last batch, is that short)",
                    counted(host.batch, "sample")
                ),
            ));
        }
        if host.batch < m * r_count {
            let short = self.plan.with_micro_batches(host.batch / r_count)?;
            let plan = std::mem::replace(&mut self.plan, short);
            let out = self.step_shard(host, count, options);
            self.plan = plan;
            return out;
        }
        let k = self.plan.config.pipeline_len;
        if let Some(max) = options.max_grad_norm {
            crate::optim::clip_coefficient(0.0, max)?;
        }
        let first_trainable = self.frozen_prefix();
        if let Some(h) = &host.hidden {
            self.check_hidden(host, h, first_trainable)?;
        }
        let slicing = &self.plan.config.token_slices;
        if slicing.len() > 1 && options.capture_frozen_output {
            // The run's config refuses the two together; a library caller may still ask.
            return Err(config_error(
                "pipeline.token_slices",
                "the frozen-activation cache (elastic.cache) does not take token slices; turn one off",
            ));
        }
        // Per replica, per micro-batch, its token slices (the micro-batch itself when unsliced).
        let micro: Vec<Vec<Vec<HostBatch>>> = host
            .split(r_count)?
            .iter()
            .map(|shard| {
                shard
                    .split(m)?
                    .into_iter()
                    .map(|mb| if slicing.len() > 1 { mb.token_slices(slicing) } else { Ok(vec![mb]) })
                    .collect::<Result<Vec<_>>>()
            })
            .collect::<Result<_>>()?;
        let grad_scale = if count == 0 { 0.0 } else { 1.0 / count as f64 };
        // Tied copies and other processes add to the gradients after the workers are done.
        let unit_norms = self.tied.is_none() && self.process_group.is_none();
        // Communicators spanning the processes sum them on the workers' device communicators;
        // otherwise the workers may sum over the process group's rings (or nothing does until
        // the step ends).
        let spanning = self.communicators_span_processes();
        let workers_sum_processes = !spanning && self.sums_this_step_during_backward()?;
        let shared = Shared::new(self.plan.config.pipeline_len * self.plan.config.replicas);
        let ctx = StepContext {
            spec: &self.spec,
            plan: &self.plan,
            first_trainable,
            grad_scale,
            dropout_seed: options.dropout_seed,
            capture: options.capture_frozen_output,
            fault: self.fault,
            shared: &shared,
            bucket_buffers: &self.bucket_buffers,
            bucket_elements: self.bucket_elements,
            unit_norms,
            processes: self.stage_processes.as_ref(),
            progress: &self.progress,
        };
        // Where each pipeline position's worker sums over the processes as its backward goes:
        // its own ring, or the group (the stages' column, or everyone's with one worker here).
        let (stage_columns, group) = (&self.stage_columns, self.process_group.as_deref());
        let column = |d: usize| workers_sum_processes.then(|| stage_columns.get(d).map(|c| &**c).or(group)).flatten();

        // Hand each worker its device's stages (disjoint borrows of `self.stages`).
        let mut jobs: Vec<StageUnits<D>> = (0..r_count * k).map(|_| Vec::new()).collect();
        for (r, replica) in self.stages.iter_mut().enumerate() {
            for (s, units) in replica.iter_mut().enumerate() {
                jobs[r * k + s % k].push((s, units));
            }
        }
        let mut rings: Vec<Vec<Option<RingCommunicator>>> = (0..k)
            .map(|_| {
                if r_count > 1 && self.communicators.is_none() {
                    ring_group(r_count).into_iter().map(Some).collect()
                } else {
                    (0..r_count).map(|_| None).collect()
                }
            })
            .collect();
        let communicators = &self.communicators;
        let devices = &self.devices;
        let plan = &self.plan;
        let processes = self.stage_processes.as_ref();
        // With stages as processes, this process runs its own device's worker only.
        let local = |g: usize| processes.is_none_or(|p| p.rank() == g);
        let workers: Vec<Mutex<Option<Worker<D>>>> = jobs
            .into_iter()
            .enumerate()
            .filter(|(g, _)| local(*g))
            .map(|(g, stages)| {
                let (r, d) = (g / k, g % k);
                Mutex::new(Some(Worker {
                    ctx: &ctx,
                    dev: &devices[device_slot(g, processes.is_some())],
                    global: g,
                    stages,
                    actions: &plan.schedule.per_device[d],
                    micro: &micro[r],
                    ring: rings[d][r].take(),
                    column: column(d),
                    communicator: communicators.as_ref().map(|c| c[d][r].clone()),
                }))
            })
            .collect();
        let run = |w: &Mutex<Option<Worker<D>>>| {
            let worker = w.lock().unwrap_or_else(|e| e.into_inner()).take();
            worker.and_then(Worker::run_guarded)
        };
        // Devices that share a host pool run the workers on its threads, and a worker's wait
        // for a message lends its thread to the others' ops instead of idling (unless the pool
        // has more threads than the cores, where a spinning waiter would slow a busy one).
        let pool = if processes.is_none() { common_pool(devices) } else { None };
        let pooled = pool.and_then(|pool| {
            shared.lend_waits(!pool.oversubscribed());
            let outputs = pool.run_each(workers.len(), |i| run(&workers[i]));
            shared.lend_waits(false);
            outputs
        });
        let pooled_step = pooled.is_some();
        let outputs: Vec<Option<WorkerOutput>> = pooled.unwrap_or_else(|| {
            std::thread::scope(|scope| {
                let handles: Vec<_> = workers.iter().map(|w| scope.spawn(move || run(w))).collect();
                let Some(p) = processes else {
                    return handles.into_iter().map(|h| h.join().ok().flatten()).collect();
                };
                // A reader per link drops the neighbours' messages into this device's inbox.
                let shared = &shared;
                let readers: Vec<_> = p
                    .incoming(plan)
                    .into_iter()
                    .map(|(link, peer)| scope.spawn(move || p.receive(link, peer, shared)))
                    .collect();
                let outputs: Vec<Option<WorkerOutput>> = handles.into_iter().map(|h| h.join().ok().flatten()).collect();
                match outputs.iter().all(Option::is_some) && !shared.aborted() {
                    true => {
                        if let Err(e) = p.end(plan) {
                            shared.fail(p.rank(), e);
                            p.group.hang_up();
                        }
                    }
                    // Hanging up ends the readers (and the neighbours' waits) at once.
                    false => p.group.hang_up(),
                }
                for r in readers {
                    let _ = r.join();
                }
                outputs
            })
        });
        if let Some(e) = shared.take_error() {
            return Err(e);
        }
        let outputs: Vec<WorkerOutput> = outputs
            .into_iter()
            .collect::<Option<_>>()
            .ok_or_else(|| internal("pipeline", "a worker ended without a result"))?;
        let mut loss_sum: f64 = outputs.iter().map(|o| o.loss_sum).sum();
        // This process's outputs are for its device only: index them by the plan's device.
        let output_device = |i: usize| self.stage_processes.as_ref().map_or(i, StageProcesses::rank);
        let frozen_output = if options.capture_frozen_output && first_trainable > 0 {
            Some(self.assemble_capture(&outputs, m, first_trainable)?)
        } else {
            None
        };
        let mut unit_grad_sq = vec![0.0; self.plan.partition.stages.last().map_or(0, |s| s.end)];
        for (u, sq) in outputs.iter().flat_map(|o| &o.unit_grad_sq) {
            unit_grad_sq[*u] = *sq;
        }
        // Per plan device: what this process ran (all of them, unless the stages are processes).
        let devices = self.plan.config.pipeline_len * self.plan.config.replicas;
        let mut peak_activations = vec![0; devices];
        let mut per_device = vec![Vec::new(); devices];
        for (i, o) in outputs.into_iter().enumerate() {
            peak_activations[output_device(i)] = o.peak_activations;
            per_device[output_device(i)] = o.spans;
        }
        let mut trace = StepTrace { per_device, makespan: 0.0 };

        // Stop votes are summed with the loss: over the replicas' processes, then over the
        // stages', so every process of a grid counts every vote.
        let mut stop_votes = f64::from(u8::from(options.stop_requested));
        if let Some(group) = self.process_group.clone() {
            let mut sum = [loss_sum, stop_votes];
            group.all_reduce_sum_f64(&mut sum)?;
            (loss_sum, stop_votes) = (sum[0], sum[1]);
            if !workers_sum_processes && !spanning {
                self.all_reduce_across_processes(&group)?;
            }
        }
        // The end of a one-device step: tied copies, global norm, optimizers (which apply
        // clipping's coefficient as they read the gradients).
        if !unit_norms {
            self.sync_tied_grads()?;
            unit_grad_sq = self.unit_grad_sq()?;
        }
        if let Some(p) = &self.stage_processes {
            // Each process holds its stage's loss and norms (zeros elsewhere): add them up.
            let mut sums: Vec<f64> = [loss_sum, stop_votes].into_iter().chain(unit_grad_sq.iter().copied()).collect();
            p.group.all_reduce_sum_f64(&mut sums)?;
            (loss_sum, stop_votes) = (sums[0], sums[1]);
            unit_grad_sq = sums.split_off(2);
        }
        let grad_norm = unit_grad_sq.iter().sum::<f64>().sqrt();
        let coef = match options.max_grad_norm {
            Some(max) => crate::optim::clip_coefficient(grad_norm, max)?,
            None => None,
        };
        let applied = grad_norm.is_finite();
        if applied {
            for (g, span) in self.optimizer_step(options.lr, coef.unwrap_or(1.0), &shared)? {
                trace.per_device[g].push(span);
            }
        }
        trace.makespan = trace.per_device.iter().flatten().map(|s| s.end).fold(0.0, f64::max);
        Ok(PipelineStep {
            loss: loss_sum * grad_scale,
            grad_norm,
            applied,
            unit_grad_sq,
            frozen_output,
            trace,
            stop_requested: stop_votes > 0.0,
            peak_activations,
            pooled: pooled_step,
        })
    }

    fn check_hidden(&self, host: &HostBatch, h: &Hidden, first_trainable: usize) -> Result<()> {
        if h.depth > first_trainable {
            return Err(data_error(
                "hidden states",
                format!("enter unit {} but unit {first_trainable} trains and must run", h.depth),
            ));
        }
        if h.depth > 0 && self.plan.stage_of(h.depth - 1) != 0 {
            return Err(data_error("hidden states", format!("enter unit {}, which is past the first stage", h.depth)));
        }
        let want = host.batch * self.positions(host) * h.width;
        if h.width != self.spec.hidden || h.data.len() != want {
            return Err(data_error(
                "hidden states",
                format!(
                    "have {} values of width {}, expected {want} of width {}",
                    h.data.len(),
                    h.width,
                    self.spec.hidden
                ),
            ));
        }
        Ok(())
    }

    /// Hidden-state positions per sample of `host`: its tokens, or the patches and class token.
    fn positions(&self, host: &HostBatch) -> usize {
        match self.spec.input {
            crate::model::InputSpec::Image { image_size, patch, .. } => (image_size / patch).pow(2) + 1,
            crate::model::InputSpec::Tokens { .. } => host.seq,
        }
    }

    /// The captured micro-batches of every replica, joined in sample order: from the device
    /// of the stage where the first trainable unit `depth` is (the first stage after a
    /// re-plan; a later one when a prefix was frozen past a boundary without one).
    fn assemble_capture(&self, outputs: &[WorkerOutput], m: usize, depth: usize) -> Result<Hidden> {
        let stage = self.plan.stage_of(depth);
        let mut data = Vec::new();
        for r in 0..self.plan.config.replicas {
            let mut parts: Vec<&(usize, Vec<f32>)> = outputs[self.plan.device(r, stage)].captured.iter().collect();
            parts.sort_by_key(|(mb, _)| *mb);
            if parts.len() != m {
                return Err(internal("capture", format!("replica {r} captured {} of {m} micro-batches", parts.len())));
            }
            for (_, v) in parts {
                data.extend_from_slice(v);
            }
        }
        Ok(Hidden { depth, width: self.spec.hidden, data })
    }

    /// The plan's replicas (each can evaluate on its own, in parallel with the others).
    pub fn replicas(&self) -> usize {
        self.plan.config.replicas
    }

    /// This process's share of an evaluation's batches, `(index, count)`: every `count`-th
    /// batch from `index`. Stage processes share them out by rows (replicas that are
    /// processes); a process alone, or one that holds a whole pipeline, takes them all.
    pub fn evaluation_share(&self) -> (usize, usize) {
        match (&self.stage_processes, &self.process_group) {
            (Some(_), Some(column)) => (column.rank(), column.size()),
            _ => (0, 1),
        }
    }

    /// Runs `host` forward through replica `replica`'s stages, one after another (no dropout,
    /// nothing saved), and returns its loss and logits.
    pub fn evaluate(&self, replica: usize, host: &HostBatch) -> Result<EvalOutput> {
        self.check_replica("evaluate", replica)?;
        self.check_shared("evaluate", false, true)?;
        if let Some(h) = &host.hidden {
            self.check_hidden(host, h, self.frozen_prefix())?;
        }
        let (logits, dev, batch) = self.forward_units(replica, host, self.unit_count())?;
        self.eval_output(replica, dev, &batch, &logits)
    }

    /// Evaluates every batch `next` yields on replica `replica` as a forward-only pipeline:
    /// one thread per stage (a thread of the devices' host pool where they share one),
    /// stage `s` on a batch while stage `s + 1` works on the one before, so a K-stage replica
    /// keeps its K devices busy instead of taking turns. Calls `each` (from the last stage's
    /// thread) with every batch and its output, in order; stops at the first error of either,
    /// and of several, returns the first stage's. When
    /// the stages are processes, every process of a row calls it with the same batches, and
    /// only the last stage's calls `each` (a collective of the row, on its own stages' weights).
    pub fn evaluate_all(
        &self,
        replica: usize,
        next: &mut (dyn FnMut() -> Option<Result<HostBatch>> + Send),
        each: &mut (dyn FnMut(&HostBatch, EvalOutput) -> Result<()> + Send),
    ) -> Result<()> {
        self.check_replica("evaluate_all", replica)?;
        if let Some(p) = &self.stage_processes {
            return self.evaluate_across(p, next, each);
        }
        self.check_shared("evaluate_all", false, true)?;
        let end = self.unit_count();
        let last = self.stages[replica].len() - 1;
        // What travels between stages: the batch and the hidden states leaving a stage.
        type Handoff = Result<(HostBatch, Option<Vec<f32>>)>;
        // Channel `s` feeds stage `s`: the feeder sends on the first, stage `s` on channel `s + 1`.
        let (feeds, inboxes): (Vec<_>, Vec<_>) =
            (0..=last).map(|_| std::sync::mpsc::sync_channel::<Handoff>(1)).unzip();
        let mut feeds = feeds.into_iter();
        let feed = feeds.next().ok_or_else(|| internal("evaluate", "a replica without stages"))?;
        let links = inboxes.into_iter().zip(feeds.map(Some).chain([None]));
        // Devices that share a host pool run the stages on its threads, as a training step's
        // workers do: each op then runs on the calling thread instead of being handed to the
        // pool and waited for, and a stage waiting for its neighbour lends its thread to the
        // other's ops (unless the pool has more threads than the cores).
        let pool = common_pool(&self.devices).filter(|p| p.threads() > last);
        let lend = pool.is_some_and(|p| !p.oversubscribed());
        let each = Mutex::new(each);
        let stage = |(s, (inbox, feed)): (usize, (_, Option<_>))| -> Result<()> {
            while let Some(handoff) = mailbox::receive(&inbox, lend) {
                let (host, x) = handoff?;
                let (h, dev, batch) = self.stage_forward(replica, s, &host, x, end)?;
                match &feed {
                    Some(feed) => {
                        let h = dev.download(&h)?;
                        if !mailbox::send(feed, Ok((host, Some(h))), lend) {
                            return Ok(()); // the next stage stopped: it reports why
                        }
                    }
                    None => {
                        let out = self.eval_output(replica, dev, &batch, &h)?;
                        (*each.lock().unwrap_or_else(|e| e.into_inner()))(&host, out)?;
                    }
                }
            }
            Ok(())
        };
        std::thread::scope(|scope| {
            scope.spawn(move || {
                while let Some(host) = next() {
                    let host = host.and_then(|h| {
                        if let Some(hidden) = &h.hidden {
                            self.check_hidden(&h, hidden, self.frozen_prefix())?;
                        }
                        let x = h.hidden.as_ref().map(|hidden| hidden.data.clone());
                        Ok((h, x))
                    });
                    let failed = host.is_err();
                    if feed.send(host).is_err() || failed {
                        return;
                    }
                }
            });
            // A stage that fails drops its links: the one before stops at its next send, the
            // one after at its next receive; the first error in stage order is the answer.
            let results = on_threads_each(pool.map(|p| &**p), links.enumerate().collect(), "evaluate", stage);
            results.into_iter().collect::<Result<Vec<()>>>().map(|_| ())
        })
    }

    /// The loss and logits of the head's output `logits` on `batch`.
    fn eval_output(&self, replica: usize, dev: &D, batch: &Batch<D>, logits: &D::Buf) -> Result<EvalOutput> {
        let head = self.stages[replica].last().and_then(|s| s.last()).ok_or_else(|| internal("pipeline", "no head"))?;
        let loss = head_loss(dev, &self.spec, head, batch, logits, None)?;
        Ok(EvalOutput { loss_sum: loss.loss_sum, count: loss.count, logits: dev.download(logits)? })
    }

    /// Runs the frozen units `d..to` forward only, deterministically, on `host` (from its hidden
    /// states entering unit `d`, or from its inputs when it has none): what the activation cache
    /// does for samples it lacks or holds at a depth a moved boundary left behind. The samples
    /// are shared out over the replicas, which run in parallel. `to` must not pass the first
    /// trainable unit.
    pub fn advance(&self, host: &HostBatch, to: usize) -> Result<Hidden> {
        self.check_shared("advance", false, true)?;
        let frozen = self.frozen_prefix();
        let from = host.hidden.as_ref().map_or(0, |h| h.depth);
        if let Some(h) = &host.hidden {
            self.check_hidden(host, h, frozen)?;
        }
        if to < from || to > frozen || to == 0 {
            return Err(data_error(
                "hidden states",
                format!("cannot go from unit {from} to unit {to} (the frozen units end at {frozen})"),
            ));
        }
        let parts = host.split(self.replicas().min(host.batch))?;
        let outs: Vec<Result<Vec<f32>>> = std::thread::scope(|scope| {
            let handles: Vec<_> = parts
                .iter()
                .enumerate()
                .map(|(r, part)| {
                    scope.spawn(move || {
                        let (x, dev, _) = self.forward_units(r, part, to)?;
                        dev.download(&x)
                    })
                })
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().unwrap_or_else(|p| Err(mailbox::panicked("advance", p.as_ref()))))
                .collect()
        });
        let mut data = Vec::new();
        for out in outs {
            data.extend(out?);
        }
        Ok(Hidden { depth: to, width: self.spec.hidden, data })
    }

    /// Runs units from the batch's hidden depth (or 0) up to `end` through replica `replica`'s
    /// stages, forward only; returns the output, the device it is on and the batch there.
    fn forward_units(&self, replica: usize, host: &HostBatch, end: usize) -> Result<(D::Buf, &D, Batch<D>)> {
        let mut x = host.hidden.as_ref().map(|h| h.data.clone());
        for s in 0..self.stages[replica].len() {
            let (h, dev, batch) = self.stage_forward(replica, s, host, x.take(), end)?;
            if self.plan.partition.stages[s].end >= end {
                return Ok((h, dev, batch));
            }
            x = Some(dev.download(&h)?);
        }
        Err(internal("pipeline", format!("no stage ends at unit {end}")))
    }

    /// Runs stage `s` of replica `replica` forward on `host` (no dropout, nothing saved), from
    /// `x`, the hidden states entering the stage (`None` at the model's input), through its
    /// units below `end` that `host`'s cached hidden states do not already cover.
    fn stage_forward(
        &self,
        replica: usize,
        s: usize,
        host: &HostBatch,
        x: Option<Vec<f32>>,
        end: usize,
    ) -> Result<(D::Buf, &D, Batch<D>)> {
        let skip = host.hidden.as_ref().map_or(0, |h| h.depth);
        let first = self.plan.partition.stages[s].start;
        let dev = self.device_at(replica, s);
        let batch = Batch::upload(dev, &self.spec, host, false, 0)?;
        let mut h = x.map(|v| dev.upload_activations(&v)).transpose()?;
        for (i, unit) in self.stages[replica][s].iter().enumerate() {
            if (skip..end).contains(&(first + i)) {
                h = Some(unit.forward(dev, &batch, h.take(), false, None)?.0);
            }
        }
        let h = h.ok_or_else(|| internal(format!("stage {s}"), "produced nothing"))?;
        Ok((h, dev, batch))
    }
}
