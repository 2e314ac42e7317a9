//! `Trainer`: the epoch loop over a [`BatchSource`] on a [`Pipeline`] (one device is a pipeline
//! of one stage and one replica), with evaluation, events, checkpoints that resume the exact
//! trajectory, and a [`Controller`] hook between steps that the elastic layer plugs into.
//!
//! Determinism: batch `(epoch, index)` comes from the source as a pure function of the seed;
//! the dropout seed of step `s` is `hash(seed, s)`; parameters, optimizer state and the plan
//! are saved bit for bit. So N steps, save, load, N more steps reproduce 2N uninterrupted steps
//! exactly.

use super::checkpoint::{self, PARAM, Tensor};
use super::config::TrainConfig;
use super::event::{Bubble, EvalMetrics, Event};
use super::metrics::{Confusion, correct};
use super::selection::{Scored, Selection, Verdict};
use super::source::BatchSource;
use crate::comm::process_group::ProcessGroup;
use crate::device::Device;
use crate::error::{Error, Result, counted, internal};
use crate::model::{HeadSpec, HostBatch, IGNORE_INDEX};
use crate::optim::{LrSchedule, OptimizerState, ParamState};
use crate::pipeline::trace::ChromeTrace;
use crate::pipeline::{Pipeline, PipelineConfig, PipelineStep, StepOptions, UnitProfile, samples_per_micro_batch};
use crate::rng::hash_u64;
use crate::weights::HostTensor;
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::path::Path;
use std::time::Instant;

/// Where a run stands: enough to resume it exactly.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Position {
    /// Optimizer steps taken.
    pub step: u64,
    /// Current epoch (0-based).
    pub epoch: u64,
    /// Next source batch within the epoch.
    pub batch: usize,
}

/// What [`Controller::before_step`] prepared a step for.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Prepared {
    /// Whether the step captures the frozen prefix's output (for the cache to keep).
    pub capture_frozen_output: bool,
    /// Where the batch was looked up in a cache of the frozen prefix's output: how many of its
    /// samples the cache served (the rest ran through the frozen layers). Logged with the step.
    pub cache_hits: Option<usize>,
}

/// What steers a run between steps: the elastic PipeTransformer controller, or nothing (`()`).
pub trait Controller<D: Device> {
    /// Called with each training batch before its step. May attach cached hidden states to
    /// `host`; says whether the step should capture the frozen prefix's output, and what the
    /// cache served.
    fn before_step(&mut self, _trainer: &Trainer<D>, _host: &mut HostBatch) -> Result<Prepared> {
        Ok(Prepared::default())
    }
    /// Called after each step with what it reported.
    fn after_step(
        &mut self,
        _trainer: &mut Trainer<D>,
        _host: &HostBatch,
        _step: &PipelineStep,
        _on_event: &mut dyn FnMut(&Event),
    ) -> Result<()> {
        Ok(())
    }
    /// Called at the end of each epoch, after its evaluation. `whole`: the epoch ran all its
    /// batches (not a run's last step, `max_steps`, ending it sooner; a resumed run goes on
    /// with the same epoch).
    fn after_epoch(
        &mut self,
        _trainer: &mut Trainer<D>,
        _epoch: u64,
        _whole: bool,
        _on_event: &mut dyn FnMut(&Event),
    ) -> Result<()> {
        Ok(())
    }
    /// Called once, by the [`fit`](Trainer::fit) whose steps end the run (its planned length,
    /// or early stopping: [`done`](Trainer::done)), after its last step's evaluation and, where
    /// the run ends with an epoch (or `max_steps`), after `after_epoch`: what was left under way
    /// ends here, so the run's summary and checkpoint record its end.
    fn after_run(&mut self, _trainer: &mut Trainer<D>, _on_event: &mut dyn FnMut(&Event)) -> Result<()> {
        Ok(())
    }
}

impl<D: Device> Controller<D> for () {}

/// The pipeline, its learning-rate schedule and the run's position.
pub struct Trainer<D: Device> {
    /// The model, spread over its devices with its optimizer state: the only copy.
    pub pipeline: Pipeline<D>,
    /// Hyper-parameters, as given to [`new`](Self::new), which fixed the learning-rate
    /// schedule, the run's length, the optimizer and the frozen embedding from them: changed
    /// afterwards, only the clipping, the seed, `eval_every` and the model selection take effect.
    pub config: TrainConfig,
    /// Learning rate by source batch; its `total_steps` is the run's length.
    pub lr_schedule: LrSchedule,
    /// Where the run stands (set by a checkpoint's load; [`fit`](Self::fit) refuses a batch
    /// past its epoch).
    pub position: Position,
    /// Source batches one optimizer step takes; the learning rate is scaled by the batches a
    /// step actually takes (the linear scaling rule of AutoDP's `scale-lr` policy).
    pub batches_per_step: usize,
    /// Each unit's measured (or modelled) costs for one sample: what re-plans balance.
    pub profiles: Vec<UnitProfile>,
    /// A Chrome trace of every step, when asked for.
    pub trace: Option<ChromeTrace>,
    /// The batch source's [fingerprint](BatchSource::fingerprint): checkpoints record it, and
    /// loading one taken over other training data is refused.
    pub data_fingerprint: Option<u64>,
    /// The settings the fingerprint follows, by the names a config gives them
    /// (`{"train.seed": 0, …}`), when the caller says: checkpoints record them, so a resume
    /// refused for other data names the setting that changed.
    pub data_settings: Option<serde_json::Value>,
    /// Keys of [`data_settings`](Self::data_settings) that the order of an epoch's batches
    /// follows beyond the samples' fingerprint (the token counts, where batches are grouped by
    /// length): a resume within an epoch under other values is refused.
    pub order_settings: Vec<String>,
    /// Samples per source batch (`data.batch_size`, or the training set where that is
    /// shorter), when the caller says: checkpoints record it, a resume under another is refused
    /// (the same count of batches per epoch would name other samples), and a plan restored from
    /// a checkpoint is costed for it.
    pub batch_size: Option<usize>,
    /// The model's configuration as its caller describes it (a run: its `ModelConfig`, the
    /// head sized for the data): checkpoints record it, and a resume under another (another
    /// pooling, activation or size) is refused by the field that differs.
    pub model_config: Option<serde_json::Value>,
    batches_per_epoch: usize,
    /// Samples and seconds of this epoch's steps in this process (for its throughput).
    epoch_work: (usize, f64),
    /// Whether [`fit`](Self::fit) ended on a [stop request](super::request_stop) that every
    /// process of the run agreed on.
    stopping: bool,
    /// The best evaluation on `config.keep_best` and the evaluations since a better one
    /// (saved in checkpoints).
    pub selection: Selection,
    /// Whether the last evaluation scored a new best (`selection.best`), its weights still the
    /// pipeline's: [`fit`](Self::fit) returns after it for the caller to keep them
    /// ([`take_new_best`](Self::take_new_best)).
    new_best: bool,
}

/// A checkpoint's contents taken from the pipeline between two steps ([`Trainer::snapshot`]):
/// its own copy, so it can be written while the pipeline trains on.
pub struct Snapshot {
    meta: serde_json::Value,
    tensors: Vec<Tensor>,
    /// The parameters' shapes, in the order of their `param/…` tensors.
    shapes: Vec<Vec<usize>>,
}

impl Snapshot {
    /// Writes the checkpoint to `path` atomically ([`checkpoint::save`]).
    pub fn save(&self, path: &Path) -> Result<()> {
        checkpoint::save(path, &self.meta, &self.tensors)
    }

    /// The parameters under the model's names with their shapes, in model order: what an
    /// export of the same moment writes.
    pub fn into_parameters(self) -> Vec<HostTensor> {
        let params = self.tensors.into_iter().filter_map(|t| Some((t.name.strip_prefix(PARAM)?.to_string(), t.data)));
        params.zip(self.shapes).map(|((name, values), shape)| HostTensor { name, shape, values }).collect()
    }
}

/// The name prefix of a controller's tensors in a checkpoint.
const CONTROLLER: &str = "controller/";

impl<D: Device> Trainer<D> {
    /// A trainer at step 0 for a source with `batches_per_epoch` batches per epoch; `profiles`
    /// are the units' costs per sample
    /// ([`unit_profiles_per_sample`](crate::pipeline::unit_profiles_per_sample)).
    pub fn new(
        mut pipeline: Pipeline<D>,
        config: TrainConfig,
        batches_per_epoch: usize,
        profiles: Vec<UnitProfile>,
    ) -> Result<Self> {
        if batches_per_epoch == 0 {
            return Err(Error::Data { what: "training set".into(), message: "yields no batches".into() });
        }
        config.validate()?;
        let lr_schedule = config.lr_schedule(config.total_batches(batches_per_epoch))?;
        if config.freeze_embeddings && pipeline.frozen_prefix() == 0 {
            pipeline.freeze_prefix(1)?;
        }
        Ok(Self {
            pipeline,
            config,
            lr_schedule,
            position: Position::default(),
            batches_per_step: 1,
            profiles,
            trace: None,
            data_fingerprint: None,
            data_settings: None,
            order_settings: Vec::new(),
            model_config: None,
            batch_size: None,
            batches_per_epoch,
            epoch_work: (0, 0.0),
            stopping: false,
            selection: Selection::default(),
            new_best: false,
        })
    }

    /// Source batches per epoch.
    pub fn batches_per_epoch(&self) -> usize {
        self.batches_per_epoch
    }

    /// Source batches taken so far: the learning-rate schedule's clock.
    pub fn batches_done(&self) -> u64 {
        self.position.epoch * self.batches_per_epoch as u64 + self.position.batch as u64
    }

    /// Whether the run has taken all its batches, or stopped early
    /// ([`stopped_early`](Self::stopped_early)).
    pub fn done(&self) -> bool {
        self.batches_done() >= self.lr_schedule.total_steps || self.stopped_early()
    }

    /// Whether `train.early_stopping_patience` evaluations in a row have not beaten the best:
    /// the run is over, before its planned length. (A resume with a larger patience goes on.)
    pub fn stopped_early(&self) -> bool {
        self.selection.exhausted(self.config.early_stopping_patience)
    }

    /// The evaluation that scored a new best since the last call, if one did: the pipeline
    /// holds its weights until the next [`fit`](Self::fit).
    pub fn take_new_best(&mut self) -> Option<Scored> {
        std::mem::take(&mut self.new_best).then_some(self.selection.best).flatten()
    }

    /// Whether the last [`fit`](Self::fit) ended on a [stop request](super::request_stop) (the
    /// run's processes agree on it): the run should write its checkpoint and end.
    pub fn stopping(&self) -> bool {
        self.stopping
    }

    /// The units' profiles for a micro-batch of `samples`, with frozen units charged their
    /// forward only and units below `cached` nothing (their output comes from a cache).
    pub fn profiles_for(&self, samples: usize, cached: usize) -> Vec<UnitProfile> {
        let frozen = self.pipeline.frozen_prefix();
        self.profiles
            .iter()
            .enumerate()
            .map(|(i, p)| {
                let mut p = p.scaled(samples as f64);
                p.trainable = i >= frozen && p.trainable;
                if i < cached {
                    p.forward = 0.0;
                }
                p
            })
            .collect()
    }

    /// Trains until the end of the run or until `stop_after` more steps (for checkpointing in
    /// between), evaluating at each epoch end (and every `eval_every` steps when set).
    /// `controller` steers between steps; events go to `on_event`. With `train.keep_best`, it
    /// also returns after an evaluation that scored a new best, so the caller can keep those
    /// weights ([`take_new_best`](Self::take_new_best)) before they train on; with
    /// `train.early_stopping_patience`, the run is [done](Self::done) once that many
    /// evaluations in a row have not beaten the best.
    pub fn fit(
        &mut self,
        data: &dyn BatchSource,
        stop_after: Option<u64>,
        controller: &mut dyn Controller<D>,
        on_event: &mut dyn FnMut(&Event),
    ) -> Result<()> {
        let per_epoch = self.batches_per_epoch;
        if self.position.batch >= per_epoch {
            return Err(Error::State {
                what: "trainer position".into(),
                message: format!(
                    "batch {} of epoch {}: an epoch of this data has {per_epoch} batches (0 to {})",
                    self.position.batch,
                    self.position.epoch,
                    per_epoch.saturating_sub(1)
                ),
            });
        }
        let (mut taken, done_before) = (0, self.done());
        // A run of one process decides alone, at once; a launched run's processes at their
        // next step's sums.
        let alone = self.pipeline.every_process().is_none();
        self.stopping = alone && super::stop_requested();
        let mut scored_best = false;
        while !self.done() && stop_after.is_none_or(|n| taken < n) && !self.stopping && !scored_best {
            let started = Instant::now();
            let Position { step, epoch, batch: index } = self.position;
            let left = (self.lr_schedule.total_steps - self.batches_done()) as usize;
            let take = self.batches_per_step.max(1).min(per_epoch - index).min(left);
            let parts = (index..index + take).map(|i| data.train_batch(epoch, i)).collect::<Result<Vec<_>>>()?;
            let mut host = HostBatch::concat(&parts)?;
            let fetched = started.elapsed().as_secs_f64();
            let prepared_for = controller.before_step(self, &mut host)?;
            let prepared = started.elapsed().as_secs_f64();
            let lr = self.lr_schedule.lr_at(self.batches_done()) * take as f64;
            let options = StepOptions {
                dropout_seed: hash_u64(self.config.seed, step),
                lr,
                max_grad_norm: self.config.clip(),
                capture_frozen_output: prepared_for.capture_frozen_output,
                stop_requested: super::stop_requested(),
            };
            let report = self.pipeline.step_with(&host, &options)?;
            if !report.loss.is_finite() {
                // (Counted from 1, as the progress lines and metrics.jsonl count steps.)
                return Err(Error::Diverged { step: step + 1, loss: report.loss });
            }
            // Asked in this process or, in a launched run, in any: every process learns it
            // from the step's own sums, so all stop after this same step (each on its own
            // would stop at a step of its own, and its checkpoint would not be one state). The
            // vote was cast as the step began: a request during it stops a launched run after
            // the next one, and a run of one process, which asks its flag again, after this.
            self.stopping = report.stop_requested || (alone && super::stop_requested());
            if let Some(t) = &mut self.trace {
                t.push(step, &report.trace);
            }
            let bubble = (self.pipeline.plan().config.pipeline_len > 1).then(|| Bubble {
                measured: report.trace.bubble(),
                formula: self.pipeline.plan().bubble_formula(),
                tail_seconds: report.trace.tail(),
            });
            taken += 1;
            self.position.step += 1;
            self.position.batch += take;
            let stepped = started.elapsed().as_secs_f64();
            controller.after_step(self, &host, &report, on_event)?;
            let seconds = started.elapsed().as_secs_f64();
            if crate::debug::level() >= 1 {
                // (Elements the workers counted, at the activations' width: the stages' own
                // count of what they kept for backwards, to set beside the plan's memory.)
                let bytes = self.pipeline.devices().first().map_or(4, |d| d.activation_dtype().bytes());
                let kept: Vec<String> = report
                    .peak_activations
                    .iter()
                    .map(|&e| format!("{:.2}", (e * bytes) as f64 / (1 << 20) as f64))
                    .collect();
                eprintln!(
                    "step {step}: batch {:.1} ms, before {:.1} ms, pipeline {:.1} ms (makespan {:.1}), after {:.1} ms; \
                     activations kept at most {} MiB per device",
                    fetched * 1e3,
                    (prepared - fetched) * 1e3,
                    (stepped - prepared) * 1e3,
                    report.trace.makespan * 1e3,
                    (seconds - stepped) * 1e3,
                    kept.join(", ")
                );
            }
            self.epoch_work = (self.epoch_work.0 + host.batch, self.epoch_work.1 + seconds);
            on_event(&Event::Step {
                step: step + 1,
                batches: self.batches_done(),
                epoch,
                loss: report.loss,
                lr,
                grad_norm: report.grad_norm,
                samples: host.batch,
                seconds,
                bubble,
                cache_hits: prepared_for.cache_hits,
            });
            let epoch_end = self.position.batch == per_epoch || self.done();
            let every = self.config.eval_every;
            if !epoch_end && every > 0 && self.position.step.is_multiple_of(every) {
                let t = Instant::now();
                let eval = self.evaluate(data)?;
                let eval_seconds = t.elapsed().as_secs_f64();
                on_event(&Event::Eval { step: self.position.step, epoch, eval: eval.clone(), eval_seconds });
                scored_best = self.select(epoch, &eval, on_event);
            }
            if epoch_end {
                let t = Instant::now();
                let eval = self.evaluate(data)?;
                let eval_seconds = t.elapsed().as_secs_f64();
                let (samples, train_seconds) = std::mem::take(&mut self.epoch_work);
                on_event(&Event::Epoch { epoch, eval: eval.clone(), samples, train_seconds, eval_seconds });
                scored_best = self.select(epoch, &eval, on_event);
                let whole = self.position.batch == per_epoch;
                controller.after_epoch(self, epoch, whole, on_event)?;
                if whole {
                    self.position.epoch += 1;
                    self.position.batch = 0;
                }
            }
        }
        if self.done() && !done_before {
            controller.after_run(self, on_event)?;
        }
        Ok(())
    }

    /// Scores an evaluation of the weights after `epoch`'s latest step for the run's
    /// selection: a new best is announced (and held for [`take_new_best`](Self::take_new_best)),
    /// as is the early stop the evaluation brings. Returns whether it was a new best.
    fn select(&mut self, epoch: u64, eval: &EvalMetrics, on_event: &mut dyn FnMut(&Event)) -> bool {
        let (metric, step) = (self.config.keep_best, self.position.step);
        let verdict = self.selection.observe(metric, self.config.early_stopping_min_delta, step, eval);
        let best = verdict == Verdict::Best;
        if let (true, Some(scored)) = (best, self.selection.best) {
            self.new_best = true;
            on_event(&Event::Best { step, epoch, metric, value: scored.value });
        }
        if let (true, Some(best)) = (self.stopped_early(), self.selection.best) {
            on_event(&Event::EarlyStop { step, evaluations: self.selection.stale, best });
        }
        best
    }

    /// Loss and accuracy, with a classifier's confusion matrix and macro F1 or a language
    /// model's perplexity, over the source's evaluation batches (no dropout, nothing
    /// saved for a backward). Each replica takes every `R`-th batch, in parallel, its stages
    /// pipelined over consecutive batches; the sums are added in batch order, so the result
    /// does not depend on `R` or `K`. When the stages are processes, each row of them (a
    /// replica) takes every `R`-th batch through its stages' processes, and the processes
    /// exchange their batches' sums: the same result, to the bit, on every process.
    pub fn evaluate(&self, data: &dyn BatchSource) -> Result<EvalMetrics> {
        // At PT_DEBUG=2, the ops' times of the steps since the last evaluation, then its own.
        let Position { step, epoch, .. } = self.position;
        crate::debug::print_op_times(&format!("epoch {epoch}'s steps to step {step}"));
        let out = self.evaluate_batches(data);
        crate::debug::print_op_times(&format!("epoch {epoch}'s evaluation at step {step}"));
        if out.is_err() {
            // The other processes wait for this one's sums: end their wait now.
            self.pipeline.hang_up_processes();
        }
        out
    }

    fn evaluate_batches(&self, data: &dyn BatchSource) -> Result<EvalMetrics> {
        let n = data.eval_batches();
        let r_count = self.pipeline.replicas();
        let pipeline = &self.pipeline;
        let (me, procs) = pipeline.evaluation_share();
        let classes = match pipeline.spec().head {
            HeadSpec::Classifier { num_labels, .. } => Some(num_labels),
            HeadSpec::TiedLmHead => None,
        };
        // This process's batches, shared out over its replicas.
        let mine: Vec<usize> = (me..n).step_by(procs).collect();
        let per_replica: Vec<Result<Vec<EvalRow>>> = std::thread::scope(|scope| {
            let handles: Vec<_> = (0..r_count)
                .map(|r| {
                    let mine = &mine;
                    scope.spawn(move || {
                        let mut batches = mine.iter().copied().skip(r).step_by(r_count);
                        let mut order = batches.clone();
                        let mut rows = Vec::new();
                        pipeline.evaluate_all(
                            r,
                            &mut || batches.next().map(|i| data.eval_batch(i)),
                            &mut |host, out| {
                                let width = classes.unwrap_or(out.logits.len() / host.targets.len().max(1));
                                let right = correct(&out.logits, &host.targets, width, IGNORE_INDEX);
                                let confusion = classes.map(|c| {
                                    let mut m = Confusion::new(c);
                                    m.add_logits(&out.logits, &host.targets, IGNORE_INDEX);
                                    m
                                });
                                let index = order.next().ok_or_else(|| internal("evaluation", "a batch too many"))?;
                                rows.push(EvalRow {
                                    index,
                                    loss_sum: out.loss_sum,
                                    count: out.count,
                                    right,
                                    confusion,
                                });
                                Ok(())
                            },
                        )?;
                        Ok(rows)
                    })
                })
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().unwrap_or_else(|_| Err(internal("evaluation", "a thread panicked"))))
                .collect()
        });
        let mut rows = Vec::with_capacity(n);
        for r in per_replica {
            rows.extend(r?);
        }
        if let Some(group) = pipeline.all_processes() {
            rows = EvalRow::exchange(group, rows, n, classes)?;
        }
        rows.sort_by_key(|row| row.index);
        let (mut loss_sum, mut count, mut right) = (0.0, 0usize, 0usize);
        let mut confusion = classes.map(Confusion::new);
        for row in rows {
            (loss_sum, count, right) = (loss_sum + row.loss_sum, count + row.count, right + row.right);
            if let (Some(all), Some(m)) = (confusion.as_mut(), row.confusion) {
                all.merge(&m);
            }
        }
        let loss = if count == 0 { 0.0 } else { loss_sum / count as f64 };
        let accuracy = if count == 0 { 0.0 } else { right as f64 / count as f64 };
        Ok(EvalMetrics {
            loss,
            accuracy,
            count,
            perplexity: classes.is_none().then(|| loss.exp()),
            macro_f1: confusion.as_ref().map(Confusion::macro_f1),
            confusion,
        })
    }

    /// The precision the pipeline's devices compute in (one for all: they are opened alike).
    fn precision(&self) -> Option<crate::device::Precision> {
        self.pipeline.devices().first().map(Device::precision)
    }

    /// Writes a checkpoint atomically: parameters, optimizer state, position, plan, frozen
    /// prefix, and `extra` (the controller's state, as JSON).
    pub fn save_checkpoint(&self, path: &Path, extra: serde_json::Value) -> Result<()> {
        self.save_checkpoint_with(path, extra, Vec::new())
    }

    /// [`save_checkpoint`](Self::save_checkpoint) with the controller's own tensors besides its
    /// JSON state (stored as `controller/…`; [`load_checkpoint_with`](Self::load_checkpoint_with)
    /// gives them back).
    pub fn save_checkpoint_with(&self, path: &Path, extra: serde_json::Value, controller: Vec<Tensor>) -> Result<()> {
        self.snapshot(extra, controller)?.save(path)
    }

    /// What [`save_checkpoint_with`](Self::save_checkpoint_with) writes, taken now; the write
    /// itself ([`Snapshot::save`]) may then run on another thread while training goes on.
    pub fn snapshot(&self, extra: serde_json::Value, controller: Vec<Tensor>) -> Result<Snapshot> {
        let mut tensors: Vec<Tensor> =
            controller.into_iter().map(|t| Tensor { name: format!("{CONTROLLER}{}", t.name), data: t.data }).collect();
        let mut shapes = Vec::new();
        for HostTensor { name, shape, values } in self.pipeline.parameter_tensors()? {
            tensors.push(Tensor { name: format!("{PARAM}{name}"), data: values });
            shapes.push(shape);
        }
        let mut opt = self.pipeline.optimizer_state()?;
        for ps in &mut opt.params {
            for (i, b) in std::mem::take(&mut ps.buffers).into_iter().enumerate() {
                tensors.push(Tensor { name: format!("opt/{}/{i}", ps.name), data: b });
            }
        }
        let plan = self.pipeline.plan();
        let meta = serde_json::json!({
            "format": 2,
            "position": self.position,
            "train": self.config,
            "frozen_prefix": self.pipeline.frozen_prefix(),
            "precision": self.precision(),
            "plan": { "config": plan.config, "stages": plan.partition.stages },
            "batches_per_step": self.batches_per_step,
            "batches_per_epoch": self.batches_per_epoch,
            "data_fingerprint": self.data_fingerprint,
            "data_settings": self.data_settings,
            "batch_size": self.batch_size,
            "model": self.model_config,
            "optimizer": opt,
            "selection": self.selection,
            "controller": extra,
        });
        Ok(Snapshot { meta, tensors, shapes })
    }

    /// Restores a checkpoint written by [`Trainer::save_checkpoint`] for this model: the frozen
    /// prefix and the plan first (so the weights land where they were), then the weights and
    /// the optimizer state. The file's integrity and every parameter's name and size are
    /// checked before anything changes. Returns the controller's state.
    pub fn load_checkpoint(&mut self, path: &Path) -> Result<serde_json::Value> {
        Ok(self.load_checkpoint_with(path, RecordedPlan::Restore)?.controller)
    }

    /// [`load_checkpoint`](Self::load_checkpoint), also returning the controller's tensors that
    /// [`save_checkpoint_with`](Self::save_checkpoint_with) stored; `plan` says whether the
    /// checkpoint's plan replaces the one in force.
    pub fn load_checkpoint_with(&mut self, path: &Path, plan: RecordedPlan) -> Result<Restored> {
        let bad = |m: String| Error::State { what: format!("checkpoint {}", path.display()), message: m };
        // A checkpoint of another run: what differs, and the remedy every such refusal shares.
        let changed =
            |m: String| bad(format!("{m}; resume with the settings the run began with, or start over with --fresh"));
        let (meta, tensors) = checkpoint::load(path)?;
        let field = |name: &str| meta.get(name).cloned().unwrap_or(serde_json::Value::Null);
        let position: Position =
            serde_json::from_value(field("position")).map_err(|e| bad(format!("position: {e}")))?;
        // What changed in the model since, if anything, leaving out the keys `skip` names.
        let model_change = |skip: &[&str]| -> Option<String> {
            let (then, now) = (field("model"), self.model_config.clone()?);
            let (then, now) = (then.as_object()?, now.as_object()?);
            // (The family first: another architecture differs in most keys.)
            let key = ["family".to_string()]
                .iter()
                .chain(then.keys())
                .chain(now.keys())
                .filter(|k| !skip.contains(&k.as_str()))
                .find(|k| then.get(*k) != now.get(*k))?
                .clone();
            // (An f32 setting as written: 0.1, not the f64 0.10000000149011612 it widens to.)
            let show = |v: Option<&serde_json::Value>| match v {
                None => "unset".to_string(),
                Some(v) => match v.as_f64().filter(|x| v.is_f64() && (*x as f32) as f64 == *x) {
                    Some(x) => (x as f32).to_string(),
                    None => v.to_string(),
                },
            };
            // (The data may set these sizes: the classes, a character vocabulary, the token
            // table a tokenizer fills.)
            let what = match key.as_str() {
                "num_labels" | "vocab_size" => {
                    "the model (model.*), or the data that sizes it (its classes or characters, or model.tokenizer's \
                     ids),"
                }
                _ => "the model (model.*)",
            };
            Some(format!(
                "taken with the model's `{key}` = {}, this run's is {}: {what} changed since",
                show(then.get(&key)),
                show(now.get(&key))
            ))
        };
        // Another model first, the data's checks below would blame the data for it; but not
        // by the sizes the data sets (classes, a vocabulary), which those checks name better.
        if let Some(change) = model_change(&["num_labels", "vocab_size"]) {
            return Err(changed(change));
        }
        // The data's settings the checkpoint and this run both record, where they differ
        // (`data.max_len = 32, this run's is 16`): named by the refusals below they explain.
        let (saved_settings, ours) = (field("data_settings"), self.data_settings.clone().unwrap_or_default());
        let differ: Vec<String> = match (saved_settings.as_object(), ours.as_object()) {
            (Some(saved), Some(ours)) => saved
                .iter()
                .filter(|&(k, v)| ours.get(k).is_some_and(|now| now != v))
                .map(|(k, v)| format!("{k} = {v}, this run's is {}", ours[k]))
                .collect(),
            _ => Vec::new(),
        };
        // The position counts batches of the run's epochs: with another batch size or
        // training set, it would name other samples (or none).
        let per_epoch = self.batches_per_epoch;
        let saved_per_epoch = field("batches_per_epoch").as_u64();
        if saved_per_epoch.is_some_and(|n| n != per_epoch as u64) || position.batch >= per_epoch {
            let then = saved_per_epoch.map_or_else(|| "other".to_string(), |n| n.to_string());
            let why = match differ.is_empty() {
                true => "data.batch_size, data.train_limit or the dataset changed since, or the device count (an \
                         epoch's last batch holds a sample per device at least, or joins the one before)"
                    .to_string(),
                false => format!("the checkpoint's {}", differ.join("; the checkpoint's ")),
            };
            return Err(changed(format!("taken with {then} batches per epoch, this run has {per_epoch}: {why}")));
        }
        // A checkpoint past this run's end (a smaller `train.max_steps` or `train.epochs`) would
        // end the run at once, having trained nothing.
        let done = position.epoch.saturating_mul(per_epoch as u64).saturating_add(position.batch as u64);
        let total = self.lr_schedule.total_steps;
        if done > total {
            let by_steps = self.config.max_steps > 0 && self.config.max_steps == total;
            let (key, value) =
                if by_steps { ("max_steps", self.config.max_steps) } else { ("epochs", self.config.epochs) };
            return Err(Error::Config {
                field: format!("train.{key}"),
                message: format!(
                    "is {value}, a run of {total} batches, and the checkpoint is {done} batches in (step {}): nothing \
                     would be left to train; give a larger train.{key} to train on from there, or start over with \
                     --fresh",
                    position.step
                ),
            });
        }
        // Within an epoch, the order of the rest of its batches may follow settings the
        // samples' fingerprint does not (their token counts, where batches are grouped by
        // length): under others, some samples would be repeated and others skipped.
        if position.batch > 0
            && let Some(key) = self.order_settings.iter().find(|k| {
                let (then, now) = (saved_settings.get(k.as_str()), ours.get(k.as_str()));
                then.is_some() && now.is_some() && then != now
            })
        {
            return Err(Error::Config {
                field: key.clone(),
                message: format!(
                    "was {} when the checkpoint was taken within an epoch (at its batch {}), and is {} now: the \
                     epoch's remaining batches are ordered by what it gives (the samples' token counts, grouped by \
                     length), so some samples would be repeated and others skipped; resume with the checkpoint's",
                    saved_settings[key.as_str()],
                    position.batch,
                    ours[key.as_str()]
                ),
            });
        }
        let saved_batch = field("batch_size").as_u64();
        // (An epoch of one batch holds the whole training set whatever the batch size: the
        // checkpoints of earlier versions recorded `data.batch_size` there, not the set.)
        if let (Some(then), Some(now)) = (saved_batch, self.batch_size)
            && then != now as u64
            && per_epoch > 1
        {
            return Err(changed(format!(
                "taken with batches of {then} samples, this run's are of {now} (data.batch_size, or the training \
                 set where that is shorter): the same {per_epoch} batches per epoch would skip some samples and \
                 repeat others"
            )));
        }
        // Same count, other samples or order (train.seed, the split's fractions or limits,
        // data.group_by_length): the rest of the epoch would repeat some samples and skip
        // others, and a changed split would train on what was held out.
        let saved_data = field("data_fingerprint").as_u64();
        if let (Some(then), Some(now)) = (saved_data, self.data_fingerprint)
            && then != now
        {
            let named: Vec<&str> = ours.as_object().map_or(Vec::new(), |o| o.keys().map(String::as_str).collect());
            return Err(changed(match (differ.is_empty(), named.is_empty()) {
                (false, _) => format!("taken over other training data: with {}", differ.join("; with ")),
                (true, false) => format!(
                    "taken over other training data (fingerprint {then:016x}, this run's {now:016x}): one of {} \
                     changed since",
                    named.join(", ")
                ),
                (true, true) => format!(
                    "taken over other training data (fingerprint {then:016x}, this run's {now:016x}): the data or \
                     its order changed since"
                ),
            }));
        }
        if let Some(change) = model_change(&[]) {
            return Err(changed(change));
        }
        let frozen: usize =
            serde_json::from_value(field("frozen_prefix")).map_err(|e| bad(format!("frozen_prefix: {e}")))?;
        // `train.freeze_embeddings` changed: a run that keeps the embedding frozen has no state
        // for the one its checkpoint's run trained; the other way round, the checkpoint would
        // keep it frozen against this run's config.
        let embedding =
            |then: &str, now: &str| changed(format!("its run {then}, which this run {now} (train.freeze_embeddings)"));
        if self.config.freeze_embeddings && frozen == 0 {
            return Err(embedding("trained the embedding", "keeps frozen"));
        }
        if !self.config.freeze_embeddings && frozen == 1 {
            return Err(embedding("kept the embedding frozen", "trains"));
        }
        let mut opt: OptimizerState =
            serde_json::from_value(field("optimizer")).map_err(|e| bad(format!("optimizer: {e}")))?;
        let (then, now) = (opt.config.kind(), self.config.optimizer.kind());
        if then != now {
            return Err(changed(format!(
                "taken with the {then} optimizer, this run's train.optimizer is {now}: its state would not fit"
            )));
        }
        #[derive(Deserialize)]
        struct SavedPlan {
            config: PipelineConfig,
            stages: Vec<std::ops::Range<usize>>,
        }
        // Format 1 (before plans were saved) resumes on the plan in force.
        let recorded: Option<SavedPlan> = match field("plan") {
            serde_json::Value::Null => None,
            v => Some(serde_json::from_value(v).map_err(|e| bad(format!("plan: {e}")))?),
        };
        let batches_per_step = field("batches_per_step").as_u64().unwrap_or(1).max(1) as usize;
        let mut by_name: HashMap<String, Vec<f32>> = tensors.into_iter().map(|t| (t.name, t.data)).collect();
        // Check every parameter before touching any (by its shape: a stage process holds the
        // other stages' without values).
        let mut values = HashMap::new();
        let expected: Vec<(String, usize)> =
            self.pipeline.units().flat_map(|u| u.params()).map(|p| (p.name.clone(), p.numel())).collect();
        for (name, numel) in expected {
            match by_name.remove(&format!("{PARAM}{name}")) {
                Some(v) if v.len() == numel => {
                    values.insert(name, v);
                }
                Some(v) => {
                    return Err(bad(format!("`{name}` has {} values, the model expects {numel}", v.len())));
                }
                None => return Err(bad(format!("parameter `{name}` is missing"))),
            }
        }
        // What the checkpoint holds beyond this model's parameters is a model it was not taken
        // of (a pooler this model lacks): refused, not dropped.
        if let Some(extra) = by_name.keys().filter_map(|k| k.strip_prefix(PARAM)).min() {
            return Err(changed(format!(
                "holds parameter `{extra}`, which this model lacks: the model (model.*) changed since"
            )));
        }
        // (Each buffer checked against its parameter here, as the optimizers will on loading:
        // refused there, the frozen prefix below would already have changed.)
        for ps in &mut opt.params {
            let ParamState { name, buffers, len, .. } = ps;
            let numel = values
                .get(name.as_str())
                .map(Vec::len)
                .ok_or_else(|| bad(format!("optimizer state for `{name}`, a parameter the model lacks")))?;
            for i in 0..self.config.optimizer.state_buffers() {
                let t = by_name
                    .remove(&format!("opt/{name}/{i}"))
                    .ok_or_else(|| bad(format!("optimizer buffer {i} of `{name}` is missing")))?;
                if t.len() != numel || *len != numel {
                    return Err(bad(format!(
                        "optimizer buffer {i} of `{name}` has {} values, the parameter {numel}",
                        t.len()
                    )));
                }
                buffers.push(t);
            }
        }
        let units = self.pipeline.unit_count();
        if frozen > units || frozen < self.pipeline.frozen_prefix() {
            return Err(bad(format!("frozen prefix {frozen} does not fit the model's {units} units")));
        }
        let in_force = self.pipeline.plan();
        let reshaped = |r: &PipelineConfig, slices: bool| {
            !r.same_shape(&in_force.config) || (slices && r.token_slices != in_force.config.token_slices)
        };
        // A recorded plan this run refuses: by the setting it needs, or as the file's fault.
        let plan_refused = |r: &PipelineConfig, e: Error| {
            let shape = format!("K={} R={} M={}", r.pipeline_len, r.replicas, r.micro_batches);
            match e {
                // More devices than this run has: a setting of the run's, by its config key.
                Error::Config { field, message } if field == "devices" => {
                    changed(format!("its plan ({shape}) cannot run here: {message} (pipeline.devices)"))
                }
                e => bad(format!("plan: {e}")),
            }
        };
        // Recomputation moves nothing between devices or processes: the run's own setting
        // holds over the checkpoint's (one taken before the setting existed reads as off)
        // where the recorded plan can carry it (not zb-h1) and, under a
        // memory limit, it recomputes no less (restored stages are not judged against the
        // limit again). Otherwise the two differ in shape.
        let recompute = in_force.config.recompute;
        let limited = in_force.config.memory_limit.is_some();
        let takes_own =
            |r: &SavedPlan| r.config.allows_recompute() && (!limited || recompute.at_least(r.config.recompute));
        let recompute_changed = recorded
            .as_ref()
            .filter(|r| takes_own(r) && r.config.recompute != recompute)
            .map(|r| format!("pipeline.recompute {} → {recompute}", r.config.recompute));
        let recorded = recorded.map(|r| match takes_own(&r) {
            true => SavedPlan { config: PipelineConfig { recompute, ..r.config }, ..r },
            false => r,
        });
        // The plan to restore is checked before the frozen prefix changes (a freeze lets go of
        // optimizer state: a load refused by its checks must leave the run as it was), and
        // adopted after (its stages costed with the prefix frozen).
        let mut replan = None;
        let reshaped_from = match recorded {
            Some(r) if matches!(plan, RecordedPlan::UnlessReshaped { slices } if reshaped(&r.config, slices)) => {
                Some(r.config)
            }
            Some(r) if self.pipeline.process_stage().is_some() && !r.config.same_shape(&in_force.config) => {
                let shape = |c: &PipelineConfig| {
                    format!("{} × {}", counted(c.pipeline_len, "stage"), counted(c.replicas, "replica"))
                };
                return Err(changed(format!(
                    "taken on {} across processes, and this launch makes {}: launch as the run began \
                     (--pipeline-len, the process count)",
                    shape(&r.config),
                    shape(&in_force.config)
                )));
            }
            Some(r) if r.config != in_force.config || r.stages != in_force.partition.stages => {
                // Costed for its micro-batches' samples (one each where the batch size is not
                // known), the frozen units at their forward (the controller restored next may
                // read them from its cache: the stages are the recorded ones either way).
                let batch =
                    self.batch_size.map_or(r.config.replicas * r.config.micro_batches, |b| b * batches_per_step);
                // (A count of 0, from a damaged file, is refused by the re-plan below.)
                let samples = samples_per_micro_batch(batch, r.config.replicas, r.config.micro_batches).max(1);
                self.pipeline
                    .check_stages(&r.config, &self.profiles_for(samples, 0), &r.stages)
                    .map_err(|e| plan_refused(&r.config, e))?;
                replan = Some((r, samples));
                None
            }
            _ => None,
        };
        self.pipeline.freeze_prefix(frozen)?;
        if let Some((r, samples)) = replan {
            let profiles = self.profiles_for(samples, 0);
            let config = r.config.clone();
            self.pipeline.replan_to_stages(r.config, &profiles, r.stages).map_err(|e| plan_refused(&config, e))?;
        }
        // (A checkpoint of a version before model selection, or whose run kept its best by
        // another metric, starts the selection afresh.)
        let selection: Option<Selection> = serde_json::from_value(field("selection")).ok();
        self.pipeline.load_parameters(&values)?;
        self.pipeline.load_optimizer_state(&opt)?;
        self.position = position;
        self.selection = Selection::restored(selection, self.config.keep_best);
        self.new_best = false;
        // A shape of the caller's own takes a batch a step, as a fresh run of it does (only
        // a controller, `scale-lr`, takes more, and it chose the checkpoint's shape).
        self.batches_per_step = if reshaped_from.is_some() { 1 } else { batches_per_step };
        let mut controller: Vec<Tensor> = by_name
            .into_iter()
            .filter_map(|(name, data)| name.strip_prefix(CONTROLLER).map(|n| Tensor { name: n.to_string(), data }))
            .collect();
        controller.sort_by(|a, b| a.name.cmp(&b.name));
        let mut changed = match serde_json::to_value(&self.config) {
            Ok(now) => changed_settings("train", &field("train"), &now),
            Err(_) => Vec::new(),
        };
        // The data's settings that left its samples as they were (its fingerprint agreed
        // above), such as how texts become ids: named, taken from here on.
        if let Some(now) = &self.data_settings {
            changed.extend(changed_settings("", &field("data_settings"), now));
        }
        // (Where the plan in force was kept over the checkpoint's, its own shape is the news.)
        changed.extend(recompute_changed.filter(|_| reshaped_from.is_none()));
        // The products' precision (master weights and optimizer state are f32 in either).
        let (then, now) = (field("precision"), serde_json::json!(self.precision()));
        if !then.is_null() && then != now {
            changed.push(format!("output.precision {then} → {now}"));
        }
        Ok(Restored { controller: field("controller"), tensors: controller, reshaped_from, changed })
    }
}

/// The settings of `now` whose values differ from `then`'s, as `prefix.key then → now`, a
/// table's by its own keys (`train.optimizer.beta1 0.9 → 0.5`; keys named in full without a
/// prefix). A key one side lacks (a setting a later version added) is not a change.
pub fn changed_settings(prefix: &str, then: &serde_json::Value, now: &serde_json::Value) -> Vec<String> {
    let (Some(then), Some(now)) = (then.as_object(), now.as_object()) else { return Vec::new() };
    let mut changed = Vec::new();
    for (key, value) in now {
        let Some(was) = then.get(key).filter(|was| *was != value) else { continue };
        let name = if prefix.is_empty() { key.clone() } else { format!("{prefix}.{key}") };
        match (was.is_object() && value.is_object(), was.get("kind") == value.get("kind")) {
            // The same kind of table: its settings one by one.
            (true, true) => changed.extend(changed_settings(&name, was, value)),
            _ => changed.push(format!("{name} {was} → {value}")),
        }
    }
    changed
}

/// What a checkpoint's load does with the plan the checkpoint recorded.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RecordedPlan {
    /// It replaces the plan in force, so the run goes on where it was (a controller that
    /// chose the shape goes on from its choice).
    Restore,
    /// It replaces the plan in force unless that one has another shape (pipeline length,
    /// replicas, micro-batches, schedule, chunks, memory limit, and the token slices where
    /// `slices`: where they were asked for as such, not measured afresh by `auto`): a run
    /// resumed in a shape of its own keeps it, the weights and optimizer state loaded into it,
    /// a batch a step.
    UnlessReshaped {
        /// Whether the token slices count as shape.
        slices: bool,
    },
}

/// What [`Trainer::load_checkpoint_with`] gives back besides the state it restored.
pub struct Restored {
    /// The controller's JSON state.
    pub controller: serde_json::Value,
    /// The controller's tensors.
    pub tensors: Vec<Tensor>,
    /// The checkpoint's plan, where the plan in force was kept over it
    /// ([`RecordedPlan::UnlessReshaped`]).
    pub reshaped_from: Option<PipelineConfig>,
    /// The training settings that differ from the checkpoint's run, which the resumed run
    /// takes (`train.lr 0.001 → 0.01`; a longer run's schedule, for one, moves its
    /// learning rate).
    pub changed: Vec<String>,
}

/// One evaluation batch's sums.
struct EvalRow {
    index: usize,
    loss_sum: f64,
    count: usize,
    right: usize,
    confusion: Option<Confusion>,
}

impl EvalRow {
    /// Every process's `rows` (of the batches it evaluated) to every process, in one f64 sum:
    /// a line of (loss, count, correct) per batch that only its evaluator fills, and the
    /// confusion counts summed (integers, exact in any order). Exact: every other entry adds
    /// zero, and the counts are far below 2⁵³. The confusion comes back on the first row.
    fn exchange(group: &ProcessGroup, rows: Vec<EvalRow>, n: usize, classes: Option<usize>) -> Result<Vec<EvalRow>> {
        let c = classes.unwrap_or(0);
        let mut table = vec![0.0; 3 * n + c * c];
        let (lines, counts) = table.split_at_mut(3 * n);
        for row in &rows {
            lines[3 * row.index..3 * row.index + 3].copy_from_slice(&[
                row.loss_sum,
                row.count as f64,
                row.right as f64,
            ]);
            for (slot, &k) in counts.iter_mut().zip(row.confusion.iter().flat_map(|m| m.counts.iter().flatten())) {
                *slot += k as f64;
            }
        }
        group.all_reduce_sum_f64(&mut table)?;
        let (lines, counts) = table.split_at(3 * n);
        let mut confusion = classes.map(|c| Confusion {
            counts: counts.chunks_exact(c).map(|r| r.iter().map(|&k| k as usize).collect()).collect(),
        });
        Ok(lines
            .chunks_exact(3)
            .enumerate()
            .map(|(index, line)| EvalRow {
                index,
                loss_sum: line[0],
                count: line[1] as usize,
                right: line[2] as usize,
                confusion: confusion.take(),
            })
            .collect())
    }
}
