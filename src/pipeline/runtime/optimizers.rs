//! The optimizer, sharded: each (replica, pipeline position) steps the parameters it holds, and
//! the whole model's state can be gathered (checkpoints, re-plans) and handed back out.

use super::mailbox::Shared;
use super::{Copies, Pipeline, common_pool, device_slot, on_threads_each};
use crate::device::Device;
use crate::error::Result;
use crate::model::{Param, Unit};
use crate::optim::{Optimizer, OptimizerState, ParamState};
use crate::pipeline::schedule::Action;
use crate::pipeline::trace::Span;
use std::collections::HashMap;

impl<D: Device> Pipeline<D> {
    pub(super) fn fresh_optimizers(&self) -> Result<Vec<Vec<Optimizer<D>>>> {
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

    /// The optimizer state of the whole model on the host (replica 0's; replicas are equal).
    pub fn optimizer_state(&self) -> Result<OptimizerState> {
        self.check_shared("optimizer_state", true, false)?;
        let mut merged = OptimizerState { config: self.optimizer_config, step: 0, params: Vec::new() };
        for (d, opt) in self.optimizers[0].iter().enumerate() {
            let state = opt.state_dict(&self.devices[self.device_index(d)])?;
            merged.step = merged.step.max(state.step);
            merged.params.extend(state.params);
        }
        // Rank 0's collected copies of the other stages' (empty elsewhere and otherwise).
        if self.optimizer_copies == Copies::OnRankZero {
            merged.params.extend(self.collected.optimizer.iter().cloned());
        }
        merged.params.sort_by(|a, b| a.name.cmp(&b.name));
        Ok(merged)
    }

    /// Replaces every device's optimizer state with its parameters' part of `state` (a whole
    /// model's, as [`optimizer_state`](Self::optimizer_state) or a one-device optimizer gives):
    /// new replicas receive the moments of the replica they copy; a stage process keeps its
    /// own position's part only.
    pub fn load_optimizer_state(&mut self, state: &OptimizerState) -> Result<()> {
        self.optimizers = self.fresh_optimizers()?;
        let (k, own) = (self.plan.config.pipeline_len, self.process_stage());
        for (r, replica) in self.stages.iter_mut().enumerate() {
            // A stage process keeps its own position's state only.
            for d in (0..k).filter(|d| own.is_none_or(|o| o == *d)) {
                let params = Self::params_at(replica, k, d);
                let names: std::collections::HashSet<&str> = params.iter().map(|p| p.name.as_str()).collect();
                let subset = OptimizerState {
                    config: state.config,
                    step: state.step,
                    params: state.params.iter().filter(|p| names.contains(p.name.as_str())).cloned().collect(),
                };
                let dev = &self.devices[device_slot(r * k + d, self.stage_processes.is_some())];
                self.optimizers[r][d].load_state_dict(dev, &subset, &params)?;
            }
        }
        if own.is_some() {
            self.optimizer_copies = Copies::Stale;
            self.collected.optimizer.clear();
        }
        Ok(())
    }

    /// When the stages are processes: every process's copy of every stage's optimizer state
    /// becomes that stage's process's (each process steps only its own), so
    /// [`optimizer_state`](Self::optimizer_state) gives the whole model's on every process, as a
    /// checkpoint needs. A collective, like [`share_stages`](Self::share_stages); exact (the
    /// moments travel as f32, the per-parameter steps as f64). Does nothing otherwise, or when
    /// it is already shared since the last step.
    pub fn share_optimizer_state(&mut self) -> Result<()> {
        self.spread_optimizer_state(Copies::Everywhere)
    }

    /// Sends this process's optimizer state to where `to` says the copies go (every process,
    /// or rank 0 only: [`collect_on_rank_zero`](Self::collect_on_rank_zero)).
    pub(super) fn spread_optimizer_state(&mut self, to: Copies) -> Result<()> {
        if self.stage_processes.is_none() || self.optimizer_copies.reach(to) {
            return Ok(());
        }
        // Loading a state sizes it by its parameters' values: those must be there first.
        self.spread_stages(to)?;
        let Some(processes) = self.stage_processes.as_ref() else { return Ok(()) };
        let (k, own, dev) = (self.plan.config.pipeline_len, processes.rank(), &self.devices[0]);
        let buffers = self.optimizer_config.state_buffers();
        let own_state = self.optimizers[0][own].state_dict(dev)?;
        let mine: HashMap<&str, &ParamState> = own_state.params.iter().map(|p| (p.name.as_str(), p)).collect();
        // Every parameter, position by position: its name and length, the same on every process.
        let params: Vec<Vec<(String, usize)>> = (0..k)
            .map(|d| {
                self.stages[0]
                    .iter()
                    .enumerate()
                    .filter(|(s, _)| s % k == d)
                    .flat_map(|(_, units)| units.iter().flat_map(Unit::params).map(|p| (p.name.clone(), p.numel())))
                    .collect()
            })
            .collect();
        // Which parameters hold state, and their steps: from their owner, zeros elsewhere.
        let mut held: Vec<f64> = params
            .iter()
            .enumerate()
            .flat_map(|(d, ps)| ps.iter().map(move |(name, _)| (d, name)))
            .flat_map(|(d, name)| match mine.get(name.as_str()).filter(|_| d == own) {
                Some(p) => [1.0, p.step as f64],
                None => [0.0, 0.0],
            })
            .collect();
        processes.group.all_reduce_sum_f64(&mut held).inspect_err(|_| processes.group.hang_up())?;
        // The moments, position by position; this process's own part, and where each lies.
        let (mut flat, mut bounds, mut at) = (Vec::new(), Vec::with_capacity(k), 0);
        for (d, ps) in params.iter().enumerate() {
            let start = bounds.last().map_or(0, |b: &std::ops::Range<usize>| b.end);
            let mut size = 0;
            for (name, len) in ps {
                let holds = held[2 * at] != 0.0;
                at += 1;
                if !holds {
                    continue;
                }
                size += buffers * len;
                if let Some(p) = mine.get(name.as_str()).filter(|_| d == own) {
                    p.buffers.iter().for_each(|b| flat.extend_from_slice(b));
                }
            }
            bounds.push(start..start + size);
        }
        if !self.spread(&mut flat, &bounds, to)? {
            self.optimizer_copies = to;
            return Ok(());
        }
        let step = own_state.step;
        let (mut at, mut offset) = (0, 0);
        for (d, ps) in params.iter().enumerate() {
            let mut states = Vec::new();
            for (name, len) in ps {
                let (holds, param_step) = (held[2 * at] != 0.0, held[2 * at + 1] as u64);
                at += 1;
                if !holds {
                    continue;
                }
                let bufs = (0..buffers).map(|b| flat[offset + b * len..offset + (b + 1) * len].to_vec()).collect();
                offset += buffers * len;
                states.push(ParamState { name: name.clone(), len: *len, step: param_step, buffers: bufs });
            }
            if d != own {
                if to != Copies::Everywhere {
                    // Rank 0 keeps them on the host, for the checkpoint.
                    self.collected.optimizer.extend(states);
                    continue;
                }
                let state = OptimizerState { config: self.optimizer_config, step, params: states };
                let params = Self::params_at(&mut self.stages[0], k, d);
                self.optimizers[0][d].load_state_dict(dev, &state, &params)?;
            }
        }
        self.optimizer_copies = to;
        Ok(())
    }

    /// When the stages are processes: drops this process's copies of the other positions'
    /// optimizer state (position `own` is its own), which their owners change from now on.
    pub(super) fn forget_other_optimizer_state(&mut self, own: usize) -> Result<()> {
        for (d, opt) in self.optimizers[0].iter_mut().enumerate() {
            if d != own {
                *opt = Optimizer::new(self.optimizer_config)?;
            }
        }
        Ok(())
    }

    /// Drops the optimizer state of parameters that no longer train (a frozen prefix).
    pub(super) fn release_frozen_state(&mut self) {
        let (k, own) = (self.plan.config.pipeline_len, self.process_stage());
        for (replica, opts) in self.stages.iter_mut().zip(self.optimizers.iter_mut()) {
            // When the stages are processes, the other positions' units hold no gradients
            // here (they are not frozen) and their optimizers only a shared copy of the state.
            for (d, opt) in opts.iter_mut().enumerate().filter(|(d, _)| own.is_none_or(|o| o == *d)) {
                opt.release_frozen(&Self::params_at(replica, k, d));
            }
        }
    }

    /// Every device's optimizer on its parameters' gradients times `grad_scale` (clipping's
    /// coefficient), one thread per device (this process's own, when the stages are
    /// processes); each one's plan device and span. Devices that share a host pool step on
    /// its threads, as the step's workers do: each op then runs on the calling thread, where a
    /// thread of its own would hand every parameter's update to the pool and wait for it (a
    /// hand-off and a wake-up each way, 70 µs on the VMs of docs/PERF.md, a hundred a step).
    pub(super) fn optimizer_step(&mut self, lr: f64, grad_scale: f64, shared: &Shared) -> Result<Vec<(usize, Span)>> {
        let k = self.plan.config.pipeline_len;
        let own = self.process_stage();
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
                if own.is_none_or(|o| o == d) {
                    work.push((r * k + d, units, opt));
                }
            }
        }
        let pool = if own.is_none() { common_pool(devices) } else { None };
        let spans = on_threads_each(pool.map(|p| &**p), work, "optimizer", |(g, units, opt)| {
            let dev = &devices[device_slot(g, own.is_some())];
            let start = shared.now();
            let mut params: Vec<&mut Param<D>> =
                units.into_iter().flat_map(|u| u.iter_mut().flat_map(Unit::params_mut)).collect();
            opt.step_scaled(dev, &mut params, lr, grad_scale)?;
            dev.synchronize()?;
            Ok((g, Span { action: Action::OptimizerStep, start, end: shared.now() }))
        });
        spans.into_iter().collect()
    }
}
