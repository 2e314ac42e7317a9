//! Where the units live: placing them by a plan, moving them when the plan changes (AutoPipe
//! shortens the pipeline, AutoDP adds replicas), freezing a prefix, and reading the weights
//! back (evaluation, checkpoints, export).

use super::{Pipeline, device_slot, unit_names};
use crate::device::Device;
use crate::error::{Result, config_error};
use crate::model::{Model, ModelParts, Replicate, Unit};
use crate::pipeline::partition::UnitProfile;
use crate::pipeline::plan::{PipelineConfig, Plan};
use std::collections::HashMap;

impl<D: Device> Pipeline<D> {
    /// Puts units (each on the device it is on now) where the plan wants them: replica 0's
    /// copy moves only if its owner changes, the other replicas are copies of replica 0.
    pub(super) fn place(&mut self, owned: Vec<(Unit<D>, usize)>) -> Result<()> {
        // Buckets of the old shape would not fit the new one.
        self.bucket_buffers.clear();
        let (r_count, s_count) = (self.plan.config.replicas, self.plan.stages());
        let mut stages: Vec<Vec<Vec<Unit<D>>>> =
            (0..r_count).map(|_| (0..s_count).map(|_| Vec::new()).collect()).collect();
        for (g, (unit, at)) in owned.into_iter().enumerate() {
            let s = self.plan.stage_of(g);
            let home = self.device_index(self.plan.device(0, s));
            let unit = if at == home { unit } else { unit.replicate(&self.devices[at], &self.devices[home])? };
            for (r, replica) in stages.iter_mut().enumerate().skip(1) {
                replica[s].push(unit.replicate(&self.devices[home], self.device_at(r, s))?);
            }
            stages[0][s].push(unit);
        }
        self.stages = stages;
        Ok(())
    }

    /// Tears the plan down and starts `config`'s in the same process, with the first `pinned`
    /// units on the first stage (a frozen prefix whose output is cached: cached hidden states
    /// enter, and are captured, there): weights and optimizer state move to the devices that
    /// now own them, new replicas copy replica 0's (freed buffers return to each device's pool
    /// and are reused). The new plan is checked first; if it is refused, the old one stays.
    pub fn replan(&mut self, config: PipelineConfig, profiles: &[UnitProfile], pinned: usize) -> Result<()> {
        self.refuse_across_processes("replan")?;
        let names = unit_names(self.stages[0].iter().flatten());
        let plan = Plan::new(config, profiles, names, self.devices.len(), pinned)?;
        self.adopt(plan)
    }

    /// [`replan`](Self::replan) to given stage boundaries (a plan a checkpoint recorded).
    pub fn replan_to_stages(
        &mut self,
        config: PipelineConfig,
        profiles: &[UnitProfile],
        stages: Vec<std::ops::Range<usize>>,
    ) -> Result<()> {
        let plan = self.plan_of_stages(config, profiles, stages)?;
        self.adopt(plan)
    }

    /// Whether [`replan_to_stages`](Self::replan_to_stages) would take these stages, changing
    /// nothing: for a caller that must change other state first (a checkpoint's frozen prefix)
    /// and may not leave it changed when the plan is refused.
    pub fn check_stages(
        &self,
        config: &PipelineConfig,
        profiles: &[UnitProfile],
        stages: &[std::ops::Range<usize>],
    ) -> Result<()> {
        self.plan_of_stages(config.clone(), profiles, stages.to_vec()).map(drop)
    }

    fn plan_of_stages(
        &self,
        config: PipelineConfig,
        profiles: &[UnitProfile],
        stages: Vec<std::ops::Range<usize>>,
    ) -> Result<Plan> {
        self.refuse_across_processes("replan")?;
        let names = unit_names(self.stages[0].iter().flatten());
        // A recorded plan ran already: it is restored as it was, not judged again against the
        // memory limit (which later re-plans keep to).
        Plan::with_stages(config, profiles, names, self.devices.len(), stages)
    }

    /// Runs `m` micro-batches per replica, each cut into `token_slices` (none: whole), from the
    /// next step: a new schedule over the same stages, so nothing moves (how AutoPipe times its
    /// candidates cheaply).
    pub fn set_micro_batches(&mut self, m: usize, token_slices: Vec<usize>, profiles: &[UnitProfile]) -> Result<()> {
        self.refuse_across_processes("set_micro_batches")?;
        let config = PipelineConfig { micro_batches: m, token_slices, ..self.plan.config.clone() };
        let stages = self.plan.partition.stages.clone();
        self.plan = Plan::with_stages(config, profiles, self.plan.unit_names.clone(), self.devices.len(), stages)?
            .within_limit()?;
        Ok(())
    }

    /// Whether `m` micro-batches per replica, each cut into `token_slices`, fit the memory
    /// limit on the stages in force.
    pub fn fits_micro_batches(&self, m: usize, token_slices: Vec<usize>, profiles: &[UnitProfile]) -> bool {
        let config = PipelineConfig { micro_batches: m, token_slices, ..self.plan.config.clone() };
        let stages = self.plan.partition.stages.clone();
        Plan::with_stages(config, profiles, self.plan.unit_names.clone(), self.devices.len(), stages)
            .and_then(Plan::within_limit)
            .is_ok()
    }

    /// A pipeline across processes keeps the plan every process started with: changing it on
    /// some would leave the others' schedules waiting for messages that never come.
    fn refuse_across_processes(&self, what: &str) -> Result<()> {
        if self.stage_processes.is_some() {
            return Err(config_error(
                "processes",
                format!(
                    "{what}: a pipeline across processes keeps the plan it started with (AutoPipe and AutoDP re-plan within one process)"
                ),
            ));
        }
        Ok(())
    }

    fn adopt(&mut self, plan: Plan) -> Result<()> {
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
        self.share_threads()?;
        self.load_optimizer_state(&state)
    }

    /// With `on`, cpu devices the plan leaves idle lend their threads to the ones it uses, from
    /// now on and after every re-plan; without, each device computes with its own count. cpu
    /// devices share one host's cores, so a device with the idle ones' threads does the work of
    /// the replicas they could have been without repeating the optimizer step or summing
    /// gradients. Other backends have no threads to lend: nothing changes.
    pub fn lend_idle_threads(&mut self, on: bool) -> Result<()> {
        self.lend_threads = on;
        self.share_threads()
    }

    /// How fast each of the first `used` devices computes with the idle devices' threads lent
    /// to it, relative to the units' profiles: all threads (every device's own, or the pool
    /// they share) over `used`, over the threads the profiles were measured on (the first
    /// device's own, or the whole shared pool). 1 for devices without threads.
    pub fn lent_speed(&self, used: usize) -> f64 {
        let total = match (self.shared_pool(), self.own_thread_counts()) {
            (Some(pool), _) => pool.threads(),
            (None, Some(own)) => own.iter().sum(),
            (None, None) => return 1.0,
        };
        if used == 0 { 1.0 } else { total as f64 / used as f64 / self.profiled_threads as f64 }
    }

    /// The pool the devices share, where there are several and they share one: each then
    /// computes at its share of the pool whether or not freed devices lend their threads.
    pub fn shared_pool(&self) -> Option<&std::sync::Arc<crate::device::HostPool>> {
        super::common_pool(&self.devices).filter(|_| self.devices.len() > 1)
    }

    /// Every device's own thread count; `None` unless all are cpu devices.
    fn own_thread_counts(&self) -> Option<Vec<usize>> {
        self.own_threads.iter().copied().collect()
    }

    /// Sets every cpu device's thread count: its own, or, lending, the used devices (the first
    /// `R·K`) an even share of all the threads (the first ones one more while they do not
    /// divide).
    fn share_threads(&mut self) -> Result<()> {
        let Some(own) = self.own_thread_counts() else { return Ok(()) };
        let used = (self.plan.config.replicas * self.plan.config.pipeline_len).min(own.len());
        let total: usize = own.iter().sum();
        let lent = self.lend_threads && used < own.len();
        for (i, dev) in self.devices.iter_mut().enumerate() {
            let n = if lent && i < used { total / used + usize::from(i < total % used) } else { own[i] };
            dev.set_threads(n)?;
        }
        Ok(())
    }

    /// Number of leading frozen units.
    pub fn frozen_prefix(&self) -> usize {
        if self.stage_processes.is_some() {
            return self.frozen_units;
        }
        self.stages[0].iter().flatten().take_while(|u| !u.trainable()).count()
    }

    /// Freezes units `0..n` on every replica (no gradients, no optimizer state, forward only
    /// without dropout), as `Model::freeze_prefix` does: a tied weight follows its first copy.
    /// The frozen prefix never shrinks: `n` below the current one is an error. The plan is
    /// unchanged; [`replan`](Self::replan) moves the prefix out of the balance.
    pub fn freeze_prefix(&mut self, n: usize) -> Result<()> {
        let units = self.stages[0].iter().map(Vec::len).sum::<usize>();
        let now = self.frozen_prefix();
        if n > units || n < now {
            return Err(config_error(
                "freeze",
                format!("cannot freeze {n} units: the model has {units} and {now} are frozen already"),
            ));
        }
        let tied = self.tied.clone();
        let (devices, plan, across) = (&self.devices, &self.plan, self.stage_processes.is_some());
        for (r, replica) in self.stages.iter_mut().enumerate() {
            let mut g = 0;
            for (s, stage) in replica.iter_mut().enumerate() {
                let dev = &devices[device_slot(plan.device(r, s), across)];
                for u in stage.iter_mut() {
                    if g < n {
                        u.set_trainable(dev, false)?;
                    }
                    if let Some([(ua, _), (ub, nb)]) = &tied
                        && g == *ub
                        && *ua < n
                        && let Some(p) = u.params_mut().into_iter().find(|p| p.name == *nb)
                    {
                        p.set_trainable(dev, false)?;
                    }
                    g += 1;
                }
            }
        }
        self.release_frozen_state();
        if let Some(own) = self.process_stage() {
            // The other positions' owners just released their frozen state: this process's
            // shared copies of it (and rank 0's collection) are stale until shared again.
            self.forget_other_optimizer_state(own)?;
            self.collected.optimizer.clear();
            self.optimizer_copies = super::Copies::Stale;
        }
        // As one process counts it: a unit whose only parameter is the tied copy of a frozen
        // one is frozen too (GPT's LM head just above the prefix).
        let tied_head = self.tied.as_ref().is_some_and(|[(ua, _), (ub, nb)]| {
            *ua < n
                && *ub == n
                && self.stages[0].iter().flatten().nth(n).is_some_and(|u| u.params().iter().all(|p| p.name == *nb))
        });
        self.frozen_units = n + usize::from(tied_head);
        Ok(())
    }

    /// A copy of replica 0's units on `to` as one model (export, tests). When the stages are
    /// processes, the other stages' copies come without gradient buffers (they look frozen):
    /// the weights are the model's, its trainability is this process's view.
    pub fn gather(&self, to: &D) -> Result<Model<D>> {
        self.check_shared("gather", false, true)?;
        let mut units = Vec::new();
        for (s, stage) in self.stages[0].iter().enumerate() {
            let at = self.device_at(0, s);
            for u in stage {
                units.push(u.replicate(at, to)?);
            }
        }
        Model::from_parts(ModelParts { spec: self.spec.clone(), units, tied: self.tied.clone() })
    }

    /// Every parameter of replica `replica` as host values, in model order (tests compare runs
    /// with it).
    pub fn parameters(&self, replica: usize) -> Result<Vec<(String, Vec<f64>)>> {
        self.check_replica("parameters", replica)?;
        self.check_shared("parameters", false, false)?;
        let mut out = Vec::new();
        for (s, stage) in self.stages[replica].iter().enumerate() {
            let dev = self.device_at(replica, s);
            for p in stage.iter().flat_map(Unit::params) {
                let values = match self.collected_value(s, p)? {
                    Some(v) => v.iter().copied().map(f64::from).collect(),
                    None => dev.download_f64(&p.value)?,
                };
                out.push((p.name.clone(), values));
            }
        }
        Ok(out)
    }

    /// Rank 0's host copy of `p` of stage `s`, where a collection brought another's stage there
    /// (an error if it is missing: the device's copy is empty).
    fn collected_value(&self, s: usize, p: &crate::model::Param<D>) -> Result<Option<&Vec<f32>>> {
        if self.runs_stage(s) || self.stage_copies != super::Copies::OnRankZero {
            return Ok(None);
        }
        let missing = || crate::error::internal("collection", format!("no collected copy of `{}`", p.name));
        self.collected.weights.get(&p.name).map(Some).ok_or_else(missing)
    }

    /// The parameters of each unit in `units` (replica 0's), one vector per unit in model order:
    /// what the freeze rule's settling test compares from one interval to the next.
    pub fn unit_values(&self, units: std::ops::Range<usize>) -> Result<Vec<Vec<f32>>> {
        self.check_shared("unit_values", false, true)?;
        let mut out = Vec::with_capacity(units.len());
        let mut g = 0;
        for (s, stage) in self.stages[0].iter().enumerate() {
            let dev = self.device_at(0, s);
            for u in stage {
                if units.contains(&g) {
                    let mut v = Vec::new();
                    for p in u.params() {
                        dev.download_extend(&p.value, &mut v)?;
                    }
                    out.push(v);
                }
                g += 1;
            }
        }
        Ok(out)
    }

    /// Every parameter's name and f32 values (replica 0's), in model order: what a checkpoint
    /// stores.
    pub fn parameter_values(&self) -> Result<Vec<(String, Vec<f32>)>> {
        Ok(self.parameter_tensors()?.into_iter().map(|t| (t.name, t.values)).collect())
    }

    /// Every parameter's name, shape and f32 values (replica 0's), in model order, on the
    /// host: what an export writes, without a copy of the model on any device.
    pub fn parameter_tensors(&self) -> Result<Vec<crate::weights::HostTensor>> {
        self.check_shared("parameter_tensors", false, false)?;
        let mut out = Vec::new();
        for (s, stage) in self.stages[0].iter().enumerate() {
            let dev = self.device_at(0, s);
            for p in stage.iter().flat_map(Unit::params) {
                let values = match self.collected_value(s, p)? {
                    Some(v) => v.clone(),
                    None => dev.download(&p.value)?,
                };
                out.push(crate::weights::HostTensor { name: p.name.clone(), shape: p.shape.clone(), values });
            }
        }
        Ok(out)
    }

    /// Sets every replica's parameters from `values` (by name); a stage process sets its own
    /// stages' only. Every parameter must be present with its size; this is checked before
    /// anything changes.
    pub fn load_parameters(&mut self, values: &HashMap<String, Vec<f32>>) -> Result<()> {
        for p in self.stages[0].iter().flatten().flat_map(Unit::params) {
            match values.get(&p.name) {
                Some(v) if v.len() == p.numel() => {}
                Some(v) => {
                    return Err(config_error(
                        "parameters",
                        format!("`{}` has {} values, the model expects {}", p.name, v.len(), p.numel()),
                    ));
                }
                None => return Err(config_error("parameters", format!("`{}` is missing", p.name))),
            }
        }
        let (devices, plan, across) = (&self.devices, &self.plan, self.stage_processes.is_some());
        let own = self.process_stage();
        for (r, replica) in self.stages.iter_mut().enumerate() {
            // A stage process sets its own stages' only: it holds no other.
            for (s, stage) in
                replica.iter_mut().enumerate().filter(|(s, _)| own.is_none_or(|o| s % plan.config.pipeline_len == o))
            {
                let dev = &devices[device_slot(plan.device(r, s), across)];
                for p in stage.iter_mut().flat_map(Unit::params_mut) {
                    if let Some(v) = values.get(&p.name) {
                        p.value = dev.upload(v)?;
                    }
                }
            }
        }
        if across {
            // Shared copies of the other stages are out of date now.
            self.drop_other_stages()?;
            self.stage_copies = super::Copies::Stale;
            self.collected.weights.clear();
        }
        Ok(())
    }
}
