//! The end of a pipelined step's backward where the workers cannot end it themselves (tied
//! copies, other processes): gradients summed across them, then the per-unit squared norms
//! (the freeze controller's signal, read off the sums the global norm needs anyway).

use super::{Pipeline, device_slot};
use crate::comm::process_group::ProcessGroup;
use crate::device::Device;
use crate::error::Result;
use crate::model::{Unit, is_tied_copy};
use crate::optim::grad_sum_squares;

impl<D: Device> Pipeline<D> {
    /// Sums every trainable gradient with the other processes of `group`, in one message: the
    /// replicas of this process already hold the same (in-process) sum, so replica 0's is
    /// sent and the group's sum is written to every replica.
    pub(super) fn all_reduce_across_processes(&mut self, group: &ProcessGroup) -> Result<()> {
        let mut flat = Vec::new();
        for (s, units) in self.stages[0].iter().enumerate() {
            let dev = self.device_at(0, s);
            for g in units.iter().flat_map(Unit::params).filter_map(|p| p.grad.as_ref()) {
                flat.extend(dev.download(g)?);
            }
        }
        group.all_reduce_sum_f32(&mut flat)?;
        let (devices, plan, across) = (&self.devices, &self.plan, self.stage_processes.is_some());
        for (r, replica) in self.stages.iter_mut().enumerate() {
            let mut at = 0;
            for (s, units) in replica.iter_mut().enumerate() {
                let dev = &devices[device_slot(plan.device(r, s), across)];
                for g in units.iter_mut().flat_map(Unit::params_mut).filter_map(|p| p.grad.as_mut()) {
                    let n = D::len(g);
                    dev.upload_into(g, &flat[at..at + n])?;
                    at += n;
                }
            }
        }
        Ok(())
    }

    /// Sums the gradients of the two tied copies (GPT's token embedding on the first stage,
    /// its LM-head copy on the last) into both, per replica, as `Model::sync_tied_grads` does.
    /// When the stages are processes, each adds the copies its stage holds (none: zeros) and
    /// the group sums those: `ga + gb` to the bit, as f32 addition commutes.
    pub(super) fn sync_tied_grads(&mut self) -> Result<()> {
        let Some([(ua, na), (ub, nb)]) = self.tied.clone() else { return Ok(()) };
        let (sa, sb) = (self.plan.stage_of(ua), self.plan.stage_of(ub));
        let held: Vec<(usize, &str)> =
            [(sa, na.as_str()), (sb, nb.as_str())].into_iter().filter(|(s, _)| self.runs_stage(*s)).collect();
        for r in 0..self.plan.config.replicas {
            let param = |s: usize, name: &str| self.stages[r][s].iter().flat_map(Unit::params).find(|p| p.name == name);
            let Some(len) = param(sa, &na).map(|p| p.numel()) else { continue };
            let (mut sum, mut found): (Option<Vec<f32>>, usize) = (None, 0);
            for &(s, name) in &held {
                let Some(g) = param(s, name).and_then(|p| p.grad.as_ref()) else { continue };
                found += 1;
                let g = self.device_at(r, s).download(g)?;
                // `ga += gb` in f32, as the one-device step's `residual_backward` does.
                sum = Some(match sum {
                    Some(a) => a.iter().zip(&g).map(|(a, b)| a + b).collect(),
                    None => g,
                });
            }
            let sum = match (&self.stage_processes, sum) {
                (None, Some(sum)) if found == 2 => sum,
                (None, _) => continue,
                (Some(p), sum) => {
                    let mut sum = sum.unwrap_or_else(|| vec![0.0; len]);
                    p.group.all_reduce_sum_f32(&mut sum)?;
                    sum
                }
            };
            let (devices, plan, across) = (&self.devices, &self.plan, self.stage_processes.is_some());
            for &(s, name) in &held {
                let dev = &devices[device_slot(plan.device(r, s), across)];
                if let Some(g) = self.stages[r][s]
                    .iter_mut()
                    .flat_map(Unit::params_mut)
                    .find(|p| p.name == name)
                    .and_then(|p| p.grad.as_mut())
                {
                    dev.upload_into(g, &sum)?;
                }
            }
        }
        Ok(())
    }

    /// `Σ ‖grad‖²` of each unit of replica 0 (replicas hold the same summed gradients), in
    /// model order; 0 for frozen units (and for other processes' stages). A tied weight is one
    /// parameter: counted in its first copy's unit only, as the one-device step counts it.
    pub(super) fn unit_grad_sq(&self) -> Result<Vec<f64>> {
        let mut out = Vec::new();
        for (s, units) in self.stages[0].iter().enumerate() {
            // When the stages are processes, the others' norms come from them.
            if !self.runs_stage(s) {
                out.extend(units.iter().map(|_| 0.0));
                continue;
            }
            let dev = self.device_at(0, s);
            let first = self.plan.partition.stages[s].start;
            for (i, u) in units.iter().enumerate() {
                let counted: Vec<_> =
                    u.params().into_iter().filter(|p| !is_tied_copy(self.tied.as_ref(), first + i, &p.name)).collect();
                out.push(grad_sum_squares(dev, &counted)?);
            }
        }
        Ok(out)
    }
}
