//! The runtime: executes a [`Plan`] on a set of devices. One worker thread per device runs its
//! action list; activations and gradients move between stages through per-device mailboxes
//! (device → host → device: the buffers of a `cpu` device are host memory already); replicas sum
//! their gradients by a ring all-reduce that a communication thread beside each worker runs as
//! soon as a stage's last backward is done, overlapping the rest of the backward. After every
//! worker has finished, the step ends as a one-device step does: tied gradients summed, the
//! global norm clipped, each device's optimizer applied.
//!
//! A pipelined step is the same training step as on one device: every micro-batch keeps its
//! samples' global positions (dropout masks), the loss gradient is scaled by the global batch's
//! target count, and parameter gradients accumulate over micro-batches.
//!
//! Failure: a worker that returns an error or panics records its error, raises the abort flag
//! and wakes every waiting worker, which stop; the step returns the first worker's error and no
//! optimizer has run (gradients are zeroed by the next step). Never a hang: every wait watches
//! the abort flag.

use super::partition::UnitProfile;
use super::plan::{PipelineConfig, Plan};
use super::schedule::Action;
use super::trace::{Span, StepTrace};
use crate::comm::{Communicator, RingCommunicator, ring_group};
use crate::device::Device;
use crate::error::{Error, Result};
use crate::model::{Batch, HostBatch, Model, ModelParts, Param, Replicate, Saved, Spec, Unit, head_loss};
use crate::train::{Optimizer, OptimizerConfig, OptimizerState};
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Condvar, Mutex};
use std::time::Instant;

/// A fault injected into one action of one device (tests of failure handling).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Fault {
    /// Global device index.
    pub device: usize,
    /// Position in that device's action list.
    pub action: usize,
    /// Panic instead of returning an error.
    pub panic: bool,
}

/// What one pipelined step reports.
#[derive(Clone, Debug, PartialEq)]
pub struct PipelineStep {
    /// Mean loss over the global batch's targets.
    pub loss: f64,
    /// Global gradient norm before clipping.
    pub grad_norm: f64,
    /// Whether the optimizer ran (false when the norm was not finite).
    pub applied: bool,
    /// When each action ran.
    pub trace: StepTrace,
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
}

/// Unit names for plans (`embeddings#0`, `attention#1`, ...).
pub fn unit_names<'a, D: Device>(units: impl IntoIterator<Item = &'a Unit<D>>) -> Vec<String> {
    units.into_iter().enumerate().map(|(i, u)| format!("{}#{i}", u.kind_name())).collect()
}

impl<D: Device> Pipeline<D> {
    /// Spreads `model` (whose buffers live on `devices[0]`) over `devices` as `config` asks,
    /// with per-unit costs `profiles` for the partitioner.
    pub fn new(
        devices: Vec<D>,
        model: Model<D>,
        optimizer: OptimizerConfig,
        config: PipelineConfig,
        profiles: &[UnitProfile],
    ) -> Result<Self> {
        let ModelParts { spec, units, tied } = model.into_parts();
        let plan = Plan::new(config, profiles, unit_names(&units), devices.len())?;
        let owned: Vec<(Unit<D>, usize)> = units.into_iter().map(|u| (u, 0)).collect();
        let mut p = Pipeline {
            devices,
            spec,
            tied,
            plan,
            stages: Vec::new(),
            optimizers: Vec::new(),
            optimizer_config: optimizer,
            fault: None,
            communicators: None,
        };
        p.place(owned)?;
        p.optimizers = p.fresh_optimizers()?;
        Ok(p)
    }

    /// The plan in force.
    pub fn plan(&self) -> &Plan {
        &self.plan
    }

    /// The devices.
    pub fn devices(&self) -> &[D] {
        &self.devices
    }

    /// Sums replicas' gradients with these communicators from now on: `communicators[d][r]` is
    /// replica `r`'s member of the group of pipeline position `d` (for example NCCL over the
    /// GPUs at that position). `None` goes back to the in-process host ring. The layout must
    /// match the plan; a re-plan that changes `K` or `R` drops them.
    pub fn set_communicators(&mut self, communicators: Option<Vec<Vec<Arc<dyn Communicator<D>>>>>) -> Result<()> {
        if let Some(c) = &communicators {
            let (k, r) = (self.plan.config.pipeline_len, self.plan.config.replicas);
            let ok = c.len() == k
                && c.iter().all(|g| g.len() == r && g.iter().enumerate().all(|(i, m)| m.rank() == i && m.size() == r));
            if !ok {
                return Err(crate::error::config_error(
                    "communicators",
                    format!("expected {k} groups (one per pipeline position) of {r} members ranked 0..{r}"),
                ));
            }
        }
        self.communicators = communicators;
        Ok(())
    }

    /// Injects (or clears) a fault for the next steps.
    pub fn set_fault(&mut self, fault: Option<Fault>) {
        self.fault = fault;
    }

    /// Puts units (each on the device it is on now) where the plan wants them: replica 0's
    /// copy moves only if its owner changes, the other replicas are copies of replica 0.
    fn place(&mut self, owned: Vec<(Unit<D>, usize)>) -> Result<()> {
        let (r_count, s_count) = (self.plan.config.replicas, self.plan.stages());
        let mut stages: Vec<Vec<Vec<Unit<D>>>> =
            (0..r_count).map(|_| (0..s_count).map(|_| Vec::new()).collect()).collect();
        for (g, (unit, at)) in owned.into_iter().enumerate() {
            let s = self.plan.stage_of(g);
            let home = self.plan.device(0, s);
            let unit = if at == home { unit } else { unit.replicate(&self.devices[at], &self.devices[home])? };
            for (r, replica) in stages.iter_mut().enumerate().skip(1) {
                replica[s].push(unit.replicate(&self.devices[home], &self.devices[self.plan.device(r, s)])?);
            }
            stages[0][s].push(unit);
        }
        self.stages = stages;
        Ok(())
    }

    fn fresh_optimizers(&self) -> Result<Vec<Vec<Optimizer<D>>>> {
        (0..self.plan.config.replicas)
            .map(|_| (0..self.plan.config.pipeline_len).map(|_| Optimizer::new(self.optimizer_config)).collect())
            .collect()
    }

    /// Replica `r`'s parameters at pipeline position `d`, in model order.
    fn params_at(stages: &mut [Vec<Unit<D>>], k: usize, d: usize) -> Vec<&mut Param<D>> {
        stages
            .iter_mut()
            .enumerate()
            .filter(|(s, _)| s % k == d)
            .flat_map(|(_, us)| us.iter_mut().flat_map(Unit::params_mut))
            .collect()
    }

    /// Tears the plan down and starts `config`'s in the same process: weights and optimizer
    /// state move to the devices that now own them (freed buffers return to each device's pool
    /// and are reused). The new plan is checked first; if it is refused, the old one stays.
    pub fn replan(&mut self, config: PipelineConfig, profiles: &[UnitProfile]) -> Result<()> {
        let plan = Plan::new(config, profiles, unit_names(self.stages[0].iter().flatten()), self.devices.len())?;
        let state = self.optimizer_state()?;
        let old = std::mem::replace(&mut self.plan, plan);
        let mut stages = std::mem::take(&mut self.stages);
        let owned: Vec<(Unit<D>, usize)> = stages
            .swap_remove(0)
            .into_iter()
            .enumerate()
            .flat_map(|(s, units)| {
                let at = old.device(0, s);
                units.into_iter().map(move |u| (u, at))
            })
            .collect();
        drop(stages);
        if (old.config.pipeline_len, old.config.replicas) != (self.plan.config.pipeline_len, self.plan.config.replicas)
        {
            self.communicators = None;
        }
        self.place(owned)?;
        self.load_optimizer_state(&state)
    }

    /// The optimizer state of the whole model on the host (replica 0's; replicas are equal).
    pub fn optimizer_state(&self) -> Result<OptimizerState> {
        let mut merged = OptimizerState { config: self.optimizer_config, step: 0, params: Vec::new() };
        for (d, opt) in self.optimizers[0].iter().enumerate() {
            let state = opt.state_dict(&self.devices[d])?;
            merged.step = merged.step.max(state.step);
            merged.params.extend(state.params);
        }
        merged.params.sort_by(|a, b| a.name.cmp(&b.name));
        Ok(merged)
    }

    /// Replaces every device's optimizer state with its parameters' part of `state` (a whole
    /// model's, as [`optimizer_state`](Self::optimizer_state) or a one-device optimizer gives).
    pub fn load_optimizer_state(&mut self, state: &OptimizerState) -> Result<()> {
        self.optimizers = self.fresh_optimizers()?;
        let k = self.plan.config.pipeline_len;
        for (r, replica) in self.stages.iter_mut().enumerate() {
            for d in 0..k {
                let params = Self::params_at(replica, k, d);
                let names: std::collections::HashSet<&str> = params.iter().map(|p| p.name.as_str()).collect();
                let subset = OptimizerState {
                    config: state.config,
                    step: state.step,
                    params: state.params.iter().filter(|p| names.contains(p.name.as_str())).cloned().collect(),
                };
                self.optimizers[r][d].load_state_dict(&self.devices[r * k + d], &subset, &params)?;
            }
        }
        Ok(())
    }

    /// A copy of replica 0's units on `to` as one model (for evaluation, checkpoints, export).
    pub fn gather(&self, to: &D) -> Result<Model<D>> {
        let mut units = Vec::new();
        for (s, stage) in self.stages[0].iter().enumerate() {
            let at = &self.devices[self.plan.device(0, s)];
            for u in stage {
                units.push(u.replicate(at, to)?);
            }
        }
        Ok(Model::from_parts(ModelParts { spec: self.spec.clone(), units, tied: self.tied.clone() }))
    }

    /// Every parameter of replica `replica` as host values, in model order (tests compare runs
    /// with it).
    pub fn parameters(&self, replica: usize) -> Result<Vec<(String, Vec<f64>)>> {
        let mut out = Vec::new();
        for (s, stage) in self.stages[replica].iter().enumerate() {
            let dev = &self.devices[self.plan.device(replica, s)];
            for p in stage.iter().flat_map(Unit::params) {
                out.push((p.name.clone(), dev.download_f64(&p.value)?));
            }
        }
        Ok(out)
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
        let PipelineConfig { pipeline_len: k, replicas: r_count, micro_batches: m, .. } = self.plan.config;
        if host.batch < m * r_count {
            return Err(crate::error::config_error(
                "micro_batches",
                format!("a batch of {} samples cannot feed {r_count} replica(s) × {m} micro-batches", host.batch),
            ));
        }
        if let Some(max) = max_grad_norm
            && !(max.is_finite() && max > 0.0)
        {
            return Err(crate::error::config_error("max_grad_norm", format!("must be finite and > 0, got {max}")));
        }
        let micro: Vec<Vec<HostBatch>> =
            host.split(r_count)?.iter().map(|shard| shard.split(m)).collect::<Result<_>>()?;
        let count = host.target_count();
        let grad_scale = if count == 0 { 0.0 } else { 1.0 / count as f64 };
        for (r, replica) in self.stages.iter_mut().enumerate() {
            for (s, units) in replica.iter_mut().enumerate() {
                let dev = &self.devices[self.plan.device(r, s)];
                for p in units.iter_mut().flat_map(Unit::params_mut) {
                    p.zero_grad(dev)?;
                }
            }
        }
        let first_trainable = self.stages[0].iter().flatten().take_while(|u| !u.trainable()).count();
        let shared = Shared::new(self.devices.len());
        let ctx = StepContext {
            spec: &self.spec,
            plan: &self.plan,
            first_trainable,
            grad_scale,
            dropout_seed,
            fault: self.fault,
            shared: &shared,
        };

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
        let outputs: Vec<Option<WorkerOutput>> = std::thread::scope(|scope| {
            let handles: Vec<_> = jobs
                .into_iter()
                .enumerate()
                .map(|(g, stages)| {
                    let (r, d) = (g / k, g % k);
                    let worker = Worker {
                        ctx: &ctx,
                        dev: &devices[g],
                        global: g,
                        stages,
                        actions: &plan.schedule.per_device[d],
                        micro: &micro[r],
                        ring: rings[d][r].take(),
                        communicator: communicators.as_ref().map(|c| c[d][r].clone()),
                    };
                    scope.spawn(move || worker.run_guarded())
                })
                .collect();
            handles.into_iter().map(|h| h.join().ok().flatten()).collect()
        });
        if let Some(e) = shared.take_error() {
            return Err(e);
        }
        let outputs: Vec<WorkerOutput> = outputs.into_iter().collect::<Option<_>>().ok_or_else(|| Error::State {
            what: "pipeline".into(),
            message: "a worker ended without a result".into(),
        })?;
        let loss_sum: f64 = outputs.iter().map(|o| o.loss_sum).sum();
        let mut trace = StepTrace { per_device: outputs.into_iter().map(|o| o.spans).collect(), makespan: 0.0 };

        // The end of a one-device step: tied copies, global norm, clipping, optimizers.
        self.sync_tied_grads()?;
        let grad_norm = self.grad_norm()?;
        if let Some(max) = max_grad_norm {
            let coef = max / (grad_norm + 1e-6);
            if grad_norm.is_finite() && coef < 1.0 {
                for (r, replica) in self.stages.iter_mut().enumerate() {
                    for (s, units) in replica.iter_mut().enumerate() {
                        let dev = &self.devices[self.plan.device(r, s)];
                        for g in units.iter_mut().flat_map(Unit::params_mut).filter_map(|p| p.grad.as_mut()) {
                            dev.scale(g, coef)?;
                        }
                    }
                }
            }
        }
        let applied = grad_norm.is_finite();
        if applied {
            for (g, span) in self.optimizer_step(lr, &shared)?.into_iter().enumerate() {
                trace.per_device[g].push(span);
            }
        }
        trace.makespan = trace.per_device.iter().flatten().map(|s| s.end).fold(0.0, f64::max);
        Ok(PipelineStep { loss: loss_sum * grad_scale, grad_norm, applied, trace })
    }

    /// Every device's optimizer on its parameters, one thread per device; their spans.
    fn optimizer_step(&mut self, lr: f64, shared: &Shared) -> Result<Vec<Span>> {
        let k = self.plan.config.pipeline_len;
        let devices = &self.devices;
        // Per (replica, position): its global device, the units of its stages, its optimizer.
        type Work<'a, D> = (usize, Vec<&'a mut Vec<Unit<D>>>, &'a mut Optimizer<D>);
        let mut work: Vec<Work<D>> = Vec::new();
        for (r, (replica, opts)) in self.stages.iter_mut().zip(self.optimizers.iter_mut()).enumerate() {
            let mut per_d: Vec<Vec<&mut Vec<Unit<D>>>> = (0..k).map(|_| Vec::new()).collect();
            for (s, units) in replica.iter_mut().enumerate() {
                per_d[s % k].push(units);
            }
            for (d, (units, opt)) in per_d.into_iter().zip(opts.iter_mut()).enumerate() {
                work.push((r * k + d, units, opt));
            }
        }
        let spans: Vec<Result<Span>> = std::thread::scope(|scope| {
            let handles: Vec<_> = work
                .into_iter()
                .map(|(g, units, opt)| {
                    scope.spawn(move || {
                        let start = shared.now();
                        let mut params: Vec<&mut Param<D>> =
                            units.into_iter().flat_map(|u| u.iter_mut().flat_map(Unit::params_mut)).collect();
                        opt.step(&devices[g], &mut params, lr)?;
                        devices[g].synchronize()?;
                        Ok(Span { action: Action::OptimizerStep, start, end: shared.now() })
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap_or_else(|_| Err(panicked("optimizer")))).collect()
        });
        spans.into_iter().collect()
    }

    /// Sums the gradients of the two tied copies (GPT's token embedding on the first stage,
    /// its LM-head copy on the last) into both, per replica, as [`Model::sync_tied_grads`] does.
    fn sync_tied_grads(&mut self) -> Result<()> {
        let Some([(ua, na), (ub, nb)]) = self.tied.clone() else { return Ok(()) };
        let (sa, sb) = (self.plan.stage_of(ua), self.plan.stage_of(ub));
        for r in 0..self.plan.config.replicas {
            let (da, db) = (&self.devices[self.plan.device(r, sa)], &self.devices[self.plan.device(r, sb)]);
            let grad = |s: usize, name: &str| {
                self.stages[r][s].iter().flat_map(Unit::params).find(|p| p.name == name).and_then(|p| p.grad.as_ref())
            };
            let (Some(ga), Some(gb)) = (grad(sa, &na), grad(sb, &nb)) else { continue };
            // `ga += gb` in f32, as the one-device step's `residual_backward` does.
            let sum: Vec<f32> = da.download(ga)?.iter().zip(db.download(gb)?).map(|(a, b)| a + b).collect();
            for (s, name, dev) in [(sa, &na, da), (sb, &nb, db)] {
                if let Some(g) = self.stages[r][s]
                    .iter_mut()
                    .flat_map(Unit::params_mut)
                    .find(|p| p.name == *name)
                    .and_then(|p| p.grad.as_mut())
                {
                    *g = dev.upload(&sum)?;
                }
            }
        }
        Ok(())
    }

    /// `sqrt(Σ ‖grad‖²)` over replica 0's parameters in model order (the one-device order).
    fn grad_norm(&self) -> Result<f64> {
        let mut total = 0.0;
        for (s, units) in self.stages[0].iter().enumerate() {
            let dev = &self.devices[self.plan.device(0, s)];
            for g in units.iter().flat_map(Unit::params).filter_map(|p| p.grad.as_ref()) {
                total += dev.sum_squares(g)?;
            }
        }
        Ok(f64::sqrt(total))
    }
}

fn panicked(what: &str) -> Error {
    Error::State { what: what.into(), message: "a thread panicked".into() }
}

/// The stages one device runs in a step: `(stage, its units)`.
type StageUnits<'a, D> = Vec<(usize, &'a mut Vec<Unit<D>>)>;

/// A message between stages: `(is_gradient, micro-batch, producing stage)`.
type Tag = (bool, usize, usize);

/// One device's inbox.
#[derive(Default)]
struct Mailbox {
    slots: Mutex<HashMap<Tag, Option<Vec<f32>>>>,
    arrived: Condvar,
}

/// What every worker of a step shares: inboxes, the abort flag and the errors.
struct Shared {
    mailboxes: Vec<Mailbox>,
    abort: AtomicBool,
    /// Every failure, in order, with whether it is only a consequence of another's (a worker
    /// woken by the abort, a ring whose peer is gone).
    errors: Mutex<Vec<(Error, bool)>>,
    start: Instant,
}

/// What a worker reports when it stops because the step was aborted elsewhere.
const ABORTED: &str = "step aborted";

fn aborted(detail: String) -> Error {
    Error::State { what: ABORTED.into(), message: detail }
}

impl Shared {
    fn new(devices: usize) -> Self {
        Shared {
            mailboxes: (0..devices).map(|_| Mailbox::default()).collect(),
            abort: AtomicBool::new(false),
            errors: Mutex::new(Vec::new()),
            start: Instant::now(),
        }
    }

    fn now(&self) -> f64 {
        self.start.elapsed().as_secs_f64()
    }

    fn aborted(&self) -> bool {
        self.abort.load(Ordering::Acquire)
    }

    fn put(&self, device: usize, tag: Tag, data: Option<Vec<f32>>) {
        let mb = &self.mailboxes[device];
        mb.slots.lock().unwrap_or_else(|e| e.into_inner()).insert(tag, data);
        mb.arrived.notify_all();
    }

    /// Waits for `tag` in `device`'s inbox, or for the abort flag.
    fn take(&self, device: usize, tag: Tag) -> Result<Option<Vec<f32>>> {
        let mb = &self.mailboxes[device];
        let mut slots = mb.slots.lock().unwrap_or_else(|e| e.into_inner());
        loop {
            if let Some(data) = slots.remove(&tag) {
                return Ok(data);
            }
            if self.aborted() {
                return Err(aborted(format!("device {device} stopped waiting for {tag:?}")));
            }
            slots = mb.arrived.wait(slots).unwrap_or_else(|e| e.into_inner());
        }
    }

    /// Records `e` (from device `device`) and wakes everyone.
    fn fail(&self, device: usize, e: Error) {
        let secondary = matches!(&e, Error::State { what, .. } if what == ABORTED);
        let e = Error::State { what: format!("pipeline device {device}"), message: e.to_string() };
        self.errors.lock().unwrap_or_else(|e| e.into_inner()).push((e, secondary));
        self.abort.store(true, Ordering::Release);
        for mb in &self.mailboxes {
            // Taking the lock orders the flag before the wake-up of a worker about to wait.
            let _guard = mb.slots.lock().unwrap_or_else(|e| e.into_inner());
            mb.arrived.notify_all();
        }
    }

    /// The error that caused the abort: the first that is not a consequence of another.
    fn take_error(&self) -> Option<Error> {
        let mut errors = std::mem::take(&mut *self.errors.lock().unwrap_or_else(|e| e.into_inner()));
        let root = errors.iter().position(|(_, secondary)| !secondary).unwrap_or(0);
        (!errors.is_empty()).then(|| errors.swap_remove(root).0)
    }
}

/// What all workers of a step read.
struct StepContext<'a> {
    spec: &'a Spec,
    plan: &'a Plan,
    first_trainable: usize,
    grad_scale: f64,
    dropout_seed: u64,
    fault: Option<Fault>,
    shared: &'a Shared,
}

/// What a worker returns.
struct WorkerOutput {
    loss_sum: f64,
    spans: Vec<Span>,
}

/// One device's part of a step.
struct Worker<'a, D: Device> {
    ctx: &'a StepContext<'a>,
    dev: &'a D,
    global: usize,
    /// `(stage, units)` of the stages this device runs.
    stages: StageUnits<'a, D>,
    actions: &'a [Action],
    micro: &'a [HostBatch],
    ring: Option<RingCommunicator>,
    /// A caller-supplied communicator, used in place of the ring.
    communicator: Option<Arc<dyn Communicator<D>>>,
}

/// A gradient bucket on its way through the ring: `(stage, flat gradients)`.
type Bucket = (usize, Vec<f32>);

impl<D: Device> Worker<'_, D> {
    /// Runs the worker; an error or a panic is recorded for the whole step.
    fn run_guarded(self) -> Option<WorkerOutput> {
        let (shared, g) = (self.ctx.shared, self.global);
        match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.run())) {
            Ok(Ok(out)) => Some(out),
            Ok(Err(e)) => {
                shared.fail(g, e);
                None
            }
            Err(panic) => {
                let msg = panic
                    .downcast_ref::<&str>()
                    .map(|s| s.to_string())
                    .or_else(|| panic.downcast_ref::<String>().cloned())
                    .unwrap_or_default();
                shared.fail(g, Error::State { what: "worker".into(), message: format!("panicked: {msg}") });
                None
            }
        }
    }

    fn run(mut self) -> Result<WorkerOutput> {
        let ring = self.ring.take();
        std::thread::scope(|scope| {
            // The communication thread sums buckets around the ring while the worker goes on.
            let (to_comm, from_worker) = mpsc::channel::<Bucket>();
            let (to_worker, from_comm) = mpsc::channel::<Result<Bucket>>();
            if let Some(ring) = ring {
                scope.spawn(move || {
                    for (stage, mut data) in from_worker {
                        let reduced = ring.all_reduce_host(&mut data).map(|()| (stage, data));
                        if to_worker.send(reduced).is_err() {
                            return;
                        }
                    }
                });
            }
            let out = self.execute(&to_comm, &from_comm);
            drop(to_comm); // ends the communication thread
            out
        })
    }

    fn units(&mut self, stage: usize) -> Result<&mut Vec<Unit<D>>> {
        let global = self.global;
        self.stages.iter_mut().find(|(s, _)| *s == stage).map(|(_, u)| &mut **u).ok_or_else(|| Error::State {
            what: format!("device {global}"),
            message: format!("does not hold stage {stage}"),
        })
    }

    fn execute(
        &mut self,
        to_comm: &mpsc::Sender<Bucket>,
        from_comm: &mpsc::Receiver<Result<Bucket>>,
    ) -> Result<WorkerOutput> {
        let ctx = self.ctx;
        let (dev, me) = (self.dev, self.global);
        let replica_base = me - me % ctx.plan.config.pipeline_len;
        let s_count = ctx.plan.stages();
        let mut batches: HashMap<usize, Batch<D>> = HashMap::new();
        let mut acts: HashMap<(usize, usize), D::Buf> = HashMap::new();
        let mut dys: HashMap<(usize, usize), Option<D::Buf>> = HashMap::new();
        let mut saved: HashMap<(usize, usize), Vec<Saved<D>>> = HashMap::new();
        let mut pending = 0usize;
        let mut out = WorkerOutput { loss_sum: 0.0, spans: Vec::with_capacity(self.actions.len()) };
        for (i, &action) in self.actions.iter().enumerate() {
            if let Some(f) = ctx.fault.filter(|f| f.device == me && f.action == i) {
                if f.panic {
                    panic!("injected fault at action #{i} {action:?}");
                }
                return Err(Error::State {
                    what: "fault".into(),
                    message: format!("injected at action #{i} {action:?}"),
                });
            }
            let start = ctx.shared.now();
            match action {
                Action::Forward { mb, stage } => {
                    if let std::collections::hash_map::Entry::Vacant(e) = batches.entry(mb) {
                        e.insert(Batch::upload(dev, ctx.spec, &self.micro[mb], true, ctx.dropout_seed)?);
                    }
                    let first = ctx.plan.partition.stages[stage].start;
                    let mut x = if stage == 0 { None } else { Some(take(&mut acts, (mb, stage - 1), "activation")?) };
                    let batch = &batches[&mb];
                    let units = self.units(stage)?;
                    let mut kept = Vec::with_capacity(units.len());
                    for (i, unit) in units.iter().enumerate() {
                        let (y, s) = unit.forward(dev, batch, x.take(), first + i >= ctx.first_trainable)?;
                        kept.push(s);
                        x = Some(y);
                    }
                    let y = x.ok_or_else(|| Error::State {
                        what: format!("stage {stage}"),
                        message: "has no units".into(),
                    })?;
                    saved.insert((mb, stage), kept);
                    if stage + 1 == s_count {
                        let head = units.last().ok_or_else(|| Error::State {
                            what: "pipeline".into(),
                            message: "empty last stage".into(),
                        })?;
                        let loss = head_loss(dev, ctx.spec, head, batch, &y, Some(ctx.grad_scale))?;
                        out.loss_sum += loss.loss_sum;
                        dys.insert((mb, stage), loss.dlogits);
                    } else {
                        acts.insert((mb, stage), y);
                    }
                }
                Action::Backward { mb, stage } => {
                    let first = ctx.plan.partition.stages[stage].start;
                    let dy = take(&mut dys, (mb, stage), "gradient")?;
                    let kept = take(&mut saved, (mb, stage), "saved activations")?;
                    let batch = &batches[&mb];
                    let units = self.units(stage)?;
                    // As `Model::backward`: stop at the frozen boundary; the unit just above it
                    // is not asked for its input gradient.
                    let mut cur = dy;
                    for (i, (unit, s)) in units.iter_mut().zip(kept).enumerate().rev() {
                        let Some(y) = cur.take() else { break };
                        if first + i < ctx.first_trainable {
                            break;
                        }
                        cur = unit.backward(dev, batch, s, &y, first + i > ctx.first_trainable)?;
                    }
                    if stage > 0 {
                        dys.insert((mb, stage - 1), cur);
                    }
                }
                Action::SendActivation { mb, stage, to } => {
                    let y = take(&mut acts, (mb, stage), "activation")?;
                    ctx.shared.put(replica_base + to, (false, mb, stage), Some(dev.download(&y)?));
                }
                Action::RecvActivation { mb, stage, .. } => {
                    let data = ctx.shared.take(me, (false, mb, stage))?.ok_or_else(|| Error::State {
                        what: "pipeline".into(),
                        message: format!("empty activation of stage {stage}, micro-batch {mb}"),
                    })?;
                    acts.insert((mb, stage), dev.upload(&data)?);
                }
                Action::SendGrad { mb, stage, to } => {
                    let g = take(&mut dys, (mb, stage - 1), "gradient")?;
                    ctx.shared.put(replica_base + to, (true, mb, stage), g.map(|g| dev.download(&g)).transpose()?);
                }
                Action::RecvGrad { mb, stage, .. } => {
                    let data = ctx.shared.take(me, (true, mb, stage))?;
                    dys.insert((mb, stage - 1), data.map(|d| dev.upload(&d)).transpose()?);
                }
                Action::AllReduce { stage } if self.communicator.is_some() => {
                    // A device communicator (NCCL queues on the GPU's stream, so it overlaps
                    // the compute after it without a thread of ours).
                    let comm = self.communicator.clone().expect("checked by the guard");
                    let mut grads: Vec<&mut D::Buf> = self
                        .units(stage)?
                        .iter_mut()
                        .flat_map(Unit::params_mut)
                        .filter_map(|p| p.grad.as_mut())
                        .collect();
                    comm.all_reduce_sum(dev, &mut grads)?;
                }
                Action::AllReduce { stage } => {
                    if ctx.plan.config.replicas > 1 {
                        let mut flat = Vec::new();
                        for g in self.units(stage)?.iter().flat_map(Unit::params).filter_map(|p| p.grad.as_ref()) {
                            flat.extend(dev.download(g)?);
                        }
                        to_comm.send((stage, flat)).map_err(|_| Error::State {
                            what: "all-reduce".into(),
                            message: "the communication thread has stopped".into(),
                        })?;
                        pending += 1;
                    }
                }
                Action::OptimizerStep => {
                    // Wait for this device's buckets; the update itself follows the global norm.
                    for _ in 0..pending {
                        let (stage, data) = recv_bucket(from_comm, ctx.shared)?;
                        let mut at = 0;
                        for g in
                            self.units(stage)?.iter_mut().flat_map(Unit::params_mut).filter_map(|p| p.grad.as_mut())
                        {
                            let n = D::len(g);
                            *g = dev.upload(&data[at..at + n])?;
                            at += n;
                        }
                    }
                    pending = 0;
                }
            }
            out.spans.push(Span { action, start, end: ctx.shared.now() });
        }
        Ok(out)
    }
}

/// Receives a reduced bucket, giving up when the step aborts.
fn recv_bucket(from_comm: &mpsc::Receiver<Result<Bucket>>, shared: &Shared) -> Result<Bucket> {
    loop {
        match from_comm.recv_timeout(std::time::Duration::from_millis(20)) {
            // In-process, a ring fails only when a member's worker has already failed.
            Ok(reduced) => return reduced.map_err(|e| aborted(format!("all-reduce: {e}"))),
            Err(mpsc::RecvTimeoutError::Timeout) if !shared.aborted() => continue,
            Err(_) => return Err(aborted("all-reduce: the ring stopped".into())),
        }
    }
}

/// Removes `key` from a worker's table; its absence means the schedule and the runtime disagree.
fn take<K: std::hash::Hash + Eq + std::fmt::Debug + Copy, V>(map: &mut HashMap<K, V>, key: K, what: &str) -> Result<V> {
    map.remove(&key).ok_or_else(|| Error::State { what: "pipeline".into(), message: format!("no {what} for {key:?}") })
}
