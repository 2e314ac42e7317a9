//! One device's part of a step: its action list run in order, with a communication thread
//! beside it that sums gradient buckets around the replicas' ring while the backward goes on.

use super::mailbox::{Shared, aborted, panicked};
use super::processes::StageProcesses;
use crate::comm::process_group::ProcessGroup;
use crate::comm::{Communicator, RingCommunicator};
use crate::device::Device;
use crate::error::{Error, Result, internal};
use crate::model::{Batch, HostBatch, KvArena, Saved, Spec, Unit, head_loss};
use crate::optim::grad_sum_squares;
use crate::pipeline::plan::Plan;
use crate::pipeline::schedule::{Action, MessageKey, Piece, ScheduleKind};
use crate::pipeline::trace::Span;
use std::collections::HashMap;
use std::sync::Arc;
use std::sync::mpsc;

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

/// What all workers of a step read.
pub(super) struct StepContext<'a> {
    pub spec: &'a Spec,
    pub plan: &'a Plan,
    /// Units below this are frozen: forward only, no dropout, nothing saved.
    pub first_trainable: usize,
    /// `1 / targets of the global batch`: every micro-batch's loss gradient is scaled by it.
    pub grad_scale: f64,
    pub dropout_seed: u64,
    /// Keep the input of the first trainable unit (the frozen prefix's output).
    pub capture: bool,
    pub fault: Option<Fault>,
    pub shared: &'a Shared,
    pub bucket_buffers: &'a BucketBuffers,
    /// The least gradient elements a bucket sent during a backward holds.
    pub bucket_elements: usize,
    /// Each replica-0 worker reads its units' squared gradient norms once its gradients are
    /// final (false when tied copies or other processes still add to them after the workers).
    pub unit_norms: bool,
    /// When the stages are processes: where messages for the other stages go.
    pub processes: Option<&'a StageProcesses>,
    /// Raised by each action a worker finishes: the step's progress, which the NCCL watchdog
    /// watches (a step that goes on is not stalled, however long it takes).
    pub progress: &'a std::sync::atomic::AtomicU64,
}

impl StepContext<'_> {
    /// Delivers a message to device `to`: into its inbox, or over the link to its process.
    fn send(&self, to: usize, key: MessageKey, data: Option<Vec<f32>>) -> Result<()> {
        match self.processes {
            Some(p) => p.send(to, key, data.as_deref()),
            None => {
                self.shared.put(to, key, data);
                Ok(())
            }
        }
    }
}

/// Spare host buffers for gradient buckets and the ring's chunks (see `Pipeline`). Balanced:
/// each step takes and gives back as many as it uses at once (a bucket per stage and replica,
/// a spare per ring member), and a re-plan empties it, since the sizes change. Between steps
/// it holds, per replica, a bucket of its gradients and a ring chunk (1/R of that), which the
/// memory model does not count.
#[derive(Default)]
pub(super) struct BucketBuffers(std::sync::Mutex<Vec<Vec<f32>>>);

impl BucketBuffers {
    /// An empty buffer of at least `min` elements' capacity: the smallest kept one that fits,
    /// else a new one of exactly `min`.
    fn take(&self, min: usize) -> Vec<f32> {
        let mut kept = self.0.lock().unwrap_or_else(|e| e.into_inner());
        let fit = kept.iter().enumerate().filter(|(_, v)| v.capacity() >= min).min_by_key(|(_, v)| v.capacity());
        let mut v = match fit.map(|(i, _)| i) {
            Some(i) => kept.swap_remove(i),
            None => Vec::with_capacity(min),
        };
        v.clear();
        v
    }
    fn give(&self, v: Vec<f32>) {
        if v.capacity() > 0 {
            self.0.lock().unwrap_or_else(|e| e.into_inner()).push(v);
        }
    }
    /// Drops every kept buffer.
    pub(super) fn clear(&self) {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).clear();
    }
}

/// What a worker returns.
pub(super) struct WorkerOutput {
    pub loss_sum: f64,
    pub spans: Vec<Span>,
    /// `(micro-batch, the frozen prefix's output)` when the step asked to capture it.
    pub captured: Vec<(usize, Vec<f32>)>,
    /// The most activation elements this device held at once for backwards to come: saved
    /// activations of the pieces in flight, plus the key/value arenas (and their gradients),
    /// plus what put-off weight gradients keep (zero bubble).
    pub peak_activations: usize,
    /// `(unit, Σ ‖grad‖²)` of this device's units, when the step asked the workers for them.
    pub unit_grad_sq: Vec<(usize, f64)>,
}

/// The stages one device runs in a step: `(stage, its units)`.
pub(super) type StageUnits<'a, D> = Vec<(usize, &'a mut Vec<Unit<D>>)>;

/// One device's part of a step.
pub(super) struct Worker<'a, D: Device> {
    pub ctx: &'a StepContext<'a>,
    pub dev: &'a D,
    pub global: usize,
    /// `(stage, units)` of the stages this device runs.
    pub stages: StageUnits<'a, D>,
    pub actions: &'a [Action],
    /// This replica's micro-batches, each as its token slices (one when unsliced).
    pub micro: &'a [Vec<HostBatch>],
    pub ring: Option<RingCommunicator>,
    /// The processes over which this worker's communication thread sums its gradients as each
    /// stage's backward ends: the replicas of its stage when the stages are processes, or every
    /// process (the group, or this pipeline position's ring of them) when each runs whole
    /// pipelines.
    pub column: Option<&'a ProcessGroup>,
    /// A caller-supplied communicator, used in place of the ring.
    pub communicator: Option<Arc<dyn Communicator<D>>>,
}

/// A gradient bucket on its way through the ring: `(stage, its units (local indices) whose
/// gradients it holds, flat gradients)`.
type Bucket = (usize, std::ops::Range<usize>, Vec<f32>);

/// The least gradient elements a bucket sent during a backward holds, unless set otherwise
/// (4 MiB of f32, about one MiniLM layer): a message per unit would cost a ring trip per few
/// thousand values.
pub(super) const BUCKET_ELEMENTS: usize = 1 << 20;

/// Where a worker's communication thread sums its buckets: around the in-process replicas'
/// ring, or over the other processes of its stage (its column).
enum GradientSum<'a> {
    Ring(RingCommunicator),
    Column(&'a ProcessGroup),
}

impl<D: Device> Worker<'_, D> {
    /// Runs the worker; an error or a panic is recorded for the whole step.
    pub fn run_guarded(self) -> Option<WorkerOutput> {
        let (shared, g) = (self.ctx.shared, self.global);
        match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.run())) {
            Ok(Ok(out)) => Some(out),
            Ok(Err(e)) => {
                shared.fail(g, e);
                None
            }
            Err(payload) => {
                shared.fail(g, panicked("worker", payload.as_ref()));
                None
            }
        }
    }

    fn run(mut self) -> Result<WorkerOutput> {
        let ring = self.ring.take();
        let column = self.column;
        std::thread::scope(|scope| {
            // The communication thread sums buckets around the ring (or the stage's other
            // processes) while the worker goes on.
            let (to_comm, from_worker) = mpsc::channel::<Bucket>();
            let (to_worker, from_comm) = mpsc::channel::<Result<Bucket>>();
            let sum = ring.map(GradientSum::Ring).or(column.map(GradientSum::Column));
            if let Some(sum) = sum {
                let (buffers, members) = (self.ctx.bucket_buffers, self.ctx.plan.config.replicas);
                scope.spawn(move || {
                    // A chunk's worth to send from (the ring keeps what it receives).
                    let mut spare = Vec::new();
                    for (stage, units, mut data) in from_worker {
                        let summed = match &sum {
                            GradientSum::Ring(ring) => {
                                let chunk = data.len().div_ceil(members);
                                if spare.capacity() < chunk {
                                    buffers.give(std::mem::replace(&mut spare, buffers.take(chunk)));
                                }
                                // In-process, a ring fails only when a member's worker has already failed.
                                ring.all_reduce_host_with(&mut data, &mut spare)
                                    .map_err(|e| aborted(format!("all-reduce: {e}")))
                            }
                            GradientSum::Column(column) => column.all_reduce_sum_f32(&mut data),
                        };
                        if to_worker.send(summed.map(|()| (stage, units, data))).is_err() {
                            break;
                        }
                    }
                    buffers.give(spare);
                });
            }
            let dev = self.dev;
            dev.enter(move || {
                // A zero-bubble schedule's backwards put the linear layers' weight gradients off
                // until its `BackwardWeights`; whatever happens, nothing stays put off after it.
                // (A panic skips the reset; the next step's start drops what was left.)
                let split = self.ctx.plan.schedule.kind == ScheduleKind::ZeroBubble;
                self.defer_weight_grads(split);
                let mut out = self.execute(&to_comm, &from_comm);
                let left = self.deferred_elements();
                if out.is_ok() && left > 0 {
                    out = Err(internal(
                        format!("device {}", self.global),
                        format!("{left} elements of put-off weight gradients were never added"),
                    ));
                }
                self.defer_weight_grads(false);
                drop(to_comm); // ends the communication thread
                out
            })
        })
    }

    fn deferred_elements(&self) -> usize {
        self.stages.iter().flat_map(|(_, units)| units.iter()).map(Unit::deferred_elements).sum()
    }

    fn defer_weight_grads(&mut self, on: bool) {
        for u in self.stages.iter_mut().flat_map(|(_, units)| units.iter_mut()) {
            u.defer_weight_grads(on);
        }
    }

    /// Zeroes the gradients of every unit this device holds.
    fn zero_grads(&mut self) -> Result<()> {
        for p in self.stages.iter_mut().flat_map(|(_, units)| units.iter_mut().flat_map(Unit::params_mut)) {
            p.zero_grad(self.dev)?;
        }
        Ok(())
    }

    /// Packs the weights of every trainable unit this device holds for the step's products
    /// (a no-op for those still current: [`Device::pack_weight`]). Frozen units are left to
    /// their first forward, which packs them once for good, or never runs where the cache
    /// holds their output.
    fn pack_weights(&self) -> Result<()> {
        let first_trainable = self.ctx.first_trainable;
        for (stage, units) in &self.stages {
            let start = self.ctx.plan.partition.stages[*stage].start;
            for (g, unit) in (start..).zip(units.iter()).filter(|(g, _)| *g >= first_trainable) {
                unit.pack_weights(self.dev, true, true, g > first_trainable)?;
            }
        }
        Ok(())
    }

    fn units(&mut self, stage: usize) -> Result<&mut Vec<Unit<D>>> {
        let global = self.global;
        self.stages
            .iter_mut()
            .find(|(s, _)| *s == stage)
            .map(|(_, u)| &mut **u)
            .ok_or_else(|| internal(format!("device {global}"), format!("does not hold stage {stage}")))
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
        let sliced = ctx.plan.config.slices() > 1;
        let split = ctx.plan.schedule.kind == ScheduleKind::ZeroBubble;
        let mut batches: HashMap<Piece, Batch<D>> = HashMap::new();
        let mut acts: HashMap<(Piece, usize), D::Buf> = HashMap::new();
        let mut dys: HashMap<(Piece, usize), Option<D::Buf>> = HashMap::new();
        let mut saved: HashMap<(Piece, usize), Vec<Saved<D>>> = HashMap::new();
        // The input of the first unit a stage recomputes, by (piece, stage): all it keeps of a
        // piece for its recomputed units until the piece's backward runs their forward again.
        let mut inputs: HashMap<(Piece, usize), D::Buf> = HashMap::new();
        // TeraPipe: each attention unit's keys and values of a micro-batch, by (mb, unit).
        let mut arenas: HashMap<(usize, usize), KvArena<D>> = HashMap::new();
        let mut pending = 0usize;
        let mut out = WorkerOutput {
            loss_sum: 0.0,
            spans: Vec::with_capacity(self.actions.len()),
            captured: Vec::new(),
            peak_activations: 0,
            unit_grad_sq: Vec::new(),
        };
        let mut zeroed = false;
        let mut saved_elements = 0usize;
        // The last stage's gradients of the logits, held from each piece's forward (where the
        // loss is taken) to the end of its backward.
        let mut loss_grads = 0usize;
        // Whether this device's gradients are summed with other replicas' (on a device
        // communicator, or by the communication thread), and the action that completes each
        // stage's gradients: its last backward, unless zero bubble puts weight gradients after it.
        let sums = ctx.plan.config.replicas > 1
            || self.column.is_some()
            || self.communicator.as_ref().is_some_and(|c| c.size() > 1);
        // (With a column this device is its process's only one: nothing to sum on a device
        // communicator, and the column must get every bucket.)
        let comm = self.communicator.clone().filter(|_| self.column.is_none());
        let completes: HashMap<usize, usize> = if split {
            HashMap::new()
        } else {
            let backwards = self.actions.iter().enumerate().filter_map(|(i, a)| match a {
                Action::Backward { stage, .. } => Some((*stage, i)),
                _ => None,
            });
            backwards.collect()
        };
        // This device's share of the gradient norm (replica 0's devices give it), unit by unit,
        // in the backward that completes its gradients, right after each unit's own: while they
        // are in cache, and on the last stage while it would wait for the first. Summed
        // gradients are final only later (at `OptimizerStep`); those norms come at the end.
        let early_norms = ctx.unit_norms && me < ctx.plan.config.pipeline_len && !sums;
        let mut normed = std::collections::HashSet::new();
        // Actions are timed by device markers (CUDA events on a GPU), placed on the step's host
        // time line at this worker's origin once the device has reached them, below.
        let (origin, origin_host) = (dev.marker()?, ctx.shared.now());
        let mut marks = Vec::with_capacity(self.actions.len());
        for (i, &action) in self.actions.iter().enumerate() {
            if let Some(f) = ctx.fault.filter(|f| f.device == me && f.action == i) {
                if f.panic {
                    panic!("injected fault at action #{i} {action:?}");
                }
                return Err(internal("fault", format!("injected at action #{i} {action:?}")));
            }
            // Gradients are zeroed here rather than before the step: on every device at once,
            // and where its first wait would leave the device idle anyway (stage 0 waits for its
            // first gradient, later stages for their first activation). The weights the step's
            // products will read are packed there too, instead of in its first forward and
            // backward, which the other stages wait for.
            if !zeroed && !matches!(action, Action::Forward { .. } | Action::SendActivation { .. }) {
                self.zero_grads()?;
                self.pack_weights()?;
                zeroed = true;
            }
            let start = dev.marker()?;
            match action {
                Action::Forward { piece, stage } => {
                    let host = &self.micro[piece.mb][piece.slice];
                    if let std::collections::hash_map::Entry::Vacant(e) = batches.entry(piece) {
                        e.insert(Batch::upload(dev, ctx.spec, host, true, ctx.dropout_seed)?);
                    }
                    let first = ctx.plan.partition.stages[stage].start;
                    // Stage 0 starts from the batch's cached hidden states when it has them.
                    let (mut x, skip) = match (stage, &host.hidden) {
                        (0, Some(h)) => (Some(dev.upload_activations(&h.data)?), h.depth),
                        (0, None) => (None, 0),
                        _ => (Some(take(&mut acts, (piece, stage - 1), "activation")?), 0),
                    };
                    let batch = &batches[&piece];
                    let again = ctx.plan.partition.recomputed_units(stage, ctx.first_trainable);
                    let units = self.units(stage)?;
                    let mut kept = Vec::with_capacity(units.len());
                    for (i, unit) in units.iter().enumerate() {
                        let g = first + i;
                        if g < skip {
                            kept.push(Saved::None);
                            continue;
                        }
                        if ctx.capture && g == ctx.first_trainable && g > 0 {
                            let h = x.as_ref().ok_or_else(|| internal("capture", "no hidden states"))?;
                            out.captured.push((piece.mb, dev.download(h)?));
                        }
                        // (The embeddings read the batch, which stays: nothing to keep.)
                        if let Some(h) = x.as_ref().filter(|_| g == again.start && !again.is_empty()) {
                            let mut copy = dev.alloc(D::len(h))?;
                            dev.copy(&mut copy, h)?;
                            saved_elements += D::len(&copy);
                            inputs.insert((piece, stage), copy);
                        }
                        let arena = match unit {
                            Unit::Attention(_) if sliced => Some(match arenas.entry((piece.mb, g)) {
                                std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
                                std::collections::hash_map::Entry::Vacant(e) => {
                                    e.insert(KvArena::new(dev, batch.batch, batch.whole_seq, ctx.spec.hidden)?)
                                }
                            }),
                            _ => None,
                        };
                        let (y, s) = unit.forward(dev, batch, x.take(), g >= ctx.first_trainable, arena)?;
                        // A recomputed unit drops what the forward saved; the backward makes it again.
                        kept.push(if again.contains(&g) { Saved::None } else { s });
                        x = Some(y);
                    }
                    let y = x.ok_or_else(|| internal(format!("stage {stage}"), "has no units"))?;
                    saved_elements += kept.iter().map(Saved::elements).sum::<usize>();
                    saved.insert((piece, stage), kept);
                    if stage + 1 == s_count {
                        let head = units.last().ok_or_else(|| internal("pipeline", "empty last stage"))?;
                        let loss = head_loss(dev, ctx.spec, head, batch, &y, Some(ctx.grad_scale))?;
                        out.loss_sum += loss.loss_sum;
                        loss_grads += loss.dlogits.as_ref().map_or(0, D::len);
                        dys.insert((piece, stage), loss.dlogits);
                    } else {
                        acts.insert((piece, stage), y);
                    }
                }
                Action::Backward { piece, stage } => {
                    let first = ctx.plan.partition.stages[stage].start;
                    let dy = take(&mut dys, (piece, stage), "gradient")?;
                    let loss_grad = if stage + 1 == s_count { dy.as_ref().map_or(0, D::len) } else { 0 };
                    let mut kept = take(&mut saved, (piece, stage), "saved activations")?;
                    saved_elements -= kept.iter().map(Saved::elements).sum::<usize>();
                    let batch = &batches[&piece];
                    // (Units frozen since the plan was made have nothing to run again.)
                    let again = ctx.plan.partition.recomputed_units(stage, ctx.first_trainable);
                    if !again.is_empty() {
                        let input = inputs.remove(&(piece, stage));
                        saved_elements -= input.as_ref().map_or(0, D::len);
                        let run = again.start - first..again.end - first;
                        let units = &self.units(stage)?[run.clone()];
                        let regained = forward_again(dev, batch, units, (piece.mb, again.start), input, &mut arenas)?;
                        kept.splice(run, regained);
                        // Its peak: what the other pieces keep, this one's activations again, and
                        // the arenas of token slicing, with the gradients this backward is about
                        // to make in its micro-batch's trained ones.
                        let held = kept.iter().map(Saved::elements).sum::<usize>();
                        let trained = first.max(ctx.first_trainable)..ctx.plan.partition.stages[stage].end;
                        let arena = arena_elements(&arenas, Some((piece.mb, trained)));
                        let deferred = if split { self.deferred_elements() } else { 0 };
                        let peak = saved_elements + held + arena + deferred + loss_grads;
                        out.peak_activations = out.peak_activations.max(peak);
                    }
                    let completing = completes.get(&stage) == Some(&i);
                    let sending = completing && sums;
                    let units = self.units(stage)?;
                    // As `Model::backward`: stop at the frozen boundary; the unit just above it
                    // is not asked for its input gradient.
                    let mut cur = dy;
                    // The stage's last backward: each unit's gradients are final once its own
                    // backward is done, and go to be summed (from `u` up to `sent`, in buckets)
                    // while the units below run theirs.
                    let mut sent = units.len();
                    for u in (0..units.len()).rev() {
                        let s = kept.pop().ok_or_else(|| internal("pipeline", "a unit saved nothing"))?;
                        let Some(y) = cur.take() else { break };
                        let g = first + u;
                        if g < ctx.first_trainable {
                            break;
                        }
                        cur = units[u].backward(
                            dev,
                            batch,
                            s,
                            y,
                            g > ctx.first_trainable,
                            arenas.get_mut(&(piece.mb, g)),
                        )?;
                        if completing && early_norms {
                            out.unit_grad_sq.push((g, grad_sum_squares(dev, &units[u].params())?));
                            normed.insert(g);
                        }
                        if sending && grad_elements(&units[u..sent]) >= ctx.bucket_elements {
                            pending +=
                                start_sum(dev, comm.as_ref(), ctx.bucket_buffers, to_comm, stage, units, u..sent)?;
                            sent = u;
                        }
                    }
                    if sending {
                        // The rest (frozen units below hold no gradients).
                        pending += start_sum(dev, comm.as_ref(), ctx.bucket_buffers, to_comm, stage, units, 0..sent)?;
                    }
                    // Slice 0 runs its backward last: the micro-batch's arenas on this stage are done.
                    if piece.slice == 0 {
                        arenas.retain(|&(mb, g), _| mb != piece.mb || !ctx.plan.partition.stages[stage].contains(&g));
                    }
                    loss_grads -= loss_grad;
                    if stage > 0 {
                        dys.insert((piece, stage - 1), cur);
                    }
                }
                Action::BackwardWeights { stage, .. } => {
                    // The stage's oldest put-off weight gradients: the validator keeps these in
                    // the order of the stage's backwards, which is how each layer queued them.
                    for unit in self.units(stage)? {
                        unit.backward_weights(dev)?;
                    }
                }
                Action::SendActivation { piece, stage, to } => {
                    let y = take(&mut acts, (piece, stage), "activation")?;
                    let (key, _) = message(&action)?;
                    ctx.send(replica_base + to, key, Some(dev.download(&y)?))?;
                }
                Action::RecvActivation { piece, stage, .. } => {
                    let (key, _) = message(&action)?;
                    let data = ctx.shared.take(me, key)?.ok_or_else(|| {
                        internal("pipeline", format!("empty activation of stage {stage}, piece {piece}"))
                    })?;
                    acts.insert((piece, stage), dev.upload_activations(&data)?);
                }
                Action::SendGrad { piece, stage, to } => {
                    let g = take(&mut dys, (piece, stage - 1), "gradient")?;
                    let (key, _) = message(&action)?;
                    ctx.send(replica_base + to, key, g.map(|g| dev.download(&g)).transpose()?)?;
                }
                Action::RecvGrad { piece, stage, .. } => {
                    let (key, _) = message(&action)?;
                    let data = ctx.shared.take(me, key)?;
                    dys.insert((piece, stage - 1), data.map(|d| dev.upload_activations(&d)).transpose()?);
                }
                Action::AllReduce { stage } => {
                    // Unless its last backward (before this) started them already: zero bubble's
                    // weight gradients come after it.
                    if sums && !completes.contains_key(&stage) {
                        let units = self.units(stage)?;
                        let all = 0..units.len();
                        pending += start_sum(dev, comm.as_ref(), ctx.bucket_buffers, to_comm, stage, units, all)?;
                    }
                }
                Action::OptimizerStep => {
                    // A device communicator's sums (NCCL: on its own stream) are needed from here.
                    if let Some(comm) = &self.communicator {
                        comm.complete(dev)?;
                    }
                    // Wait for this device's buckets; the update itself follows the global norm.
                    for _ in 0..pending {
                        let (stage, units, data) = recv_bucket(from_comm, ctx.shared)?;
                        let mut at = 0;
                        for g in self.units(stage)?[units]
                            .iter_mut()
                            .flat_map(Unit::params_mut)
                            .filter_map(|p| p.grad.as_mut())
                        {
                            let n = D::len(g);
                            dev.upload_into(g, &data[at..at + n])?;
                            at += n;
                        }
                        ctx.bucket_buffers.give(data);
                    }
                    pending = 0;
                }
            }
            if action.is_compute() {
                let arena = arena_elements(&arenas, None);
                let deferred = if split { self.deferred_elements() } else { 0 };
                out.peak_activations = out.peak_activations.max(saved_elements + arena + deferred + loss_grads);
            }
            marks.push((action, start, dev.marker()?));
            ctx.progress.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
        if !zeroed {
            self.zero_grads()?;
        }
        if ctx.unit_norms && me < ctx.plan.config.pipeline_len {
            for (stage, units) in &self.stages {
                let first = ctx.plan.partition.stages[*stage].start;
                for (i, u) in units.iter().enumerate().filter(|(i, _)| !normed.contains(&(first + i))) {
                    out.unit_grad_sq.push((first + i, grad_sum_squares(dev, &u.params())?));
                }
            }
        }
        for (action, start, end) in marks {
            let (start, end) = (origin_host + origin.seconds_to(&start)?, origin_host + origin.seconds_to(&end)?);
            out.spans.push(Span { action, start, end });
        }
        Ok(out)
    }
}

/// What `units` (trained, in order) save in a forward of `batch` from `input` (`None`: the
/// batch itself, for the embeddings), run again for a stage that recomputes them: the same
/// values as the first forward, dropout's masks included (they are drawn from the batch's
/// coordinates, not from a running generator). `(mb, first)`: the micro-batch and the first
/// unit's index, by which `arenas` holds a token slice's keys and values; its attention reads
/// its context there and writes its own keys and values there again, the same as before. The
/// last unit's output is not needed ([`Unit::saved_again`]).
fn forward_again<D: Device>(
    dev: &D,
    batch: &Batch<D>,
    units: &[Unit<D>],
    (mb, first): (usize, usize),
    input: Option<D::Buf>,
    arenas: &mut HashMap<(usize, usize), KvArena<D>>,
) -> Result<Vec<Saved<D>>> {
    let Some((last, before)) = units.split_last() else { return Ok(Vec::new()) };
    let mut x = input;
    let mut saved = Vec::with_capacity(units.len());
    for (i, unit) in before.iter().enumerate() {
        let (y, s) = unit.forward(dev, batch, x.take(), true, arenas.get_mut(&(mb, first + i)))?;
        saved.push(s);
        x = Some(y);
    }
    saved.push(last.saved_again(dev, batch, x, true, arenas.get_mut(&(mb, first + before.len())))?);
    Ok(saved)
}

/// The elements token slicing's key/value `arenas` (by micro-batch and unit) hold, counting
/// the gradients a backward of micro-batch `mb` is about to make in the arenas of `units`.
fn arena_elements<D: Device>(
    arenas: &HashMap<(usize, usize), KvArena<D>>,
    backward: Option<(usize, std::ops::Range<usize>)>,
) -> usize {
    let in_backward = |mb: usize, g: usize| backward.as_ref().is_some_and(|(m, units)| *m == mb && units.contains(&g));
    let elements = |(&(mb, g), a): (&(usize, usize), &KvArena<D>)| match in_backward(mb, g) {
        true => a.elements_in_backward(),
        false => a.elements(),
    };
    arenas.iter().map(elements).sum()
}

/// The gradient elements `units` hold.
fn grad_elements<D: Device>(units: &[Unit<D>]) -> usize {
    units.iter().flat_map(Unit::params).filter_map(|p| p.grad.as_ref()).map(|g| D::len(g)).sum()
}

/// Starts summing the gradients of `units[range]` (of `stage`) with the other replicas': on a
/// device communicator (NCCL queues it on a stream of its own, ordered after the gradients, so
/// it overlaps the compute after it without a thread of ours), or as one bucket, in model
/// order, sent to the communication thread. Returns the buckets sent to the thread (none when
/// the units hold no gradients).
fn start_sum<D: Device>(
    dev: &D,
    comm: Option<&Arc<dyn Communicator<D>>>,
    buffers: &BucketBuffers,
    to_comm: &mpsc::Sender<Bucket>,
    stage: usize,
    units: &mut [Unit<D>],
    range: std::ops::Range<usize>,
) -> Result<usize> {
    if let Some(comm) = comm {
        let mut grads: Vec<&mut D::Buf> =
            units[range].iter_mut().flat_map(Unit::params_mut).filter_map(|p| p.grad.as_mut()).collect();
        if !grads.is_empty() {
            comm.all_reduce_sum(dev, &mut grads)?;
        }
        return Ok(0);
    }
    let elements = grad_elements(&units[range.clone()]);
    if elements == 0 {
        return Ok(0);
    }
    let mut flat = buffers.take(elements);
    for g in units[range.clone()].iter().flat_map(Unit::params).filter_map(|p| p.grad.as_ref()) {
        dev.download_extend(g, &mut flat)?;
    }
    to_comm.send((stage, range, flat)).map_err(|_| internal("all-reduce", "the communication thread has stopped"))?;
    Ok(1)
}

/// A send's or receive's message key and peer.
fn message(action: &Action) -> Result<(MessageKey, usize)> {
    action.message().ok_or_else(|| internal("pipeline", format!("{action:?} carries no message")))
}

/// Receives a reduced bucket, giving up when the step aborts.
fn recv_bucket(from_comm: &mpsc::Receiver<Result<Bucket>>, shared: &Shared) -> Result<Bucket> {
    loop {
        match from_comm.recv_timeout(std::time::Duration::from_millis(20)) {
            Ok(reduced) => return reduced,
            Err(mpsc::RecvTimeoutError::Timeout) if !shared.aborted() => continue,
            Err(_) => return Err(aborted("all-reduce: the ring stopped".into())),
        }
    }
}

/// Removes `key` from a worker's table; its absence means the schedule and the runtime disagree.
fn take<K: std::hash::Hash + Eq + std::fmt::Debug + Copy, V>(map: &mut HashMap<K, V>, key: K, what: &str) -> Result<V> {
    map.remove(&key)
        .ok_or_else(|| Error::Internal { what: "pipeline".into(), message: format!("no {what} for {key:?}") })
}

#[cfg(test)]
mod tests {
    use super::BucketBuffers;

    /// The smallest kept buffer that fits, else a new one of the size asked; a re-plan's clear
    /// drops them all.
    #[test]
    fn bucket_buffers_hand_out_the_smallest_that_fits() {
        let kept = BucketBuffers::default();
        for cap in [100, 10, 50] {
            kept.give(Vec::with_capacity(cap));
        }
        assert_eq!(kept.take(20).capacity(), 50);
        assert_eq!(kept.take(200).capacity(), 200, "none fits: a new one");
        assert_eq!(kept.take(0).capacity(), 10);
        kept.clear();
        assert_eq!(kept.take(5).capacity(), 5, "cleared: a new one");
    }
}
