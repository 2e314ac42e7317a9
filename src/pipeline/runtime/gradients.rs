//! The end of a pipelined step's backward where the workers cannot end it themselves (tied
//! copies, other processes): gradients summed across them, then the per-unit squared norms
//! (the freeze controller's signal, read off the sums the global norm needs anyway).

use super::Pipeline;
use crate::comm::process_group::ProcessGroup;
use crate::device::Device;
use crate::error::Result;
use crate::model::Unit;
use crate::optim::grad_sum_squares;

impl<D: Device> Pipeline<D> {
    /// Sums every trainable gradient with the other processes of `group`, in one message: the
    /// replicas of this process already hold the same (in-process) sum, so replica 0's is
    /// sent and the group's sum is written to every replica.
    pub(super) fn all_reduce_across_processes(&mut self, group: &ProcessGroup) -> Result<()> {
        let mut flat = Vec::new();
        for (s, units) in self.stages[0].iter().enumerate() {
            let dev = &self.devices[self.plan.device(0, s)];
            for g in units.iter().flat_map(Unit::params).filter_map(|p| p.grad.as_ref()) {
                flat.extend(dev.download(g)?);
            }
        }
        group.all_reduce_sum_f32(&mut flat)?;
        for (r, replica) in self.stages.iter_mut().enumerate() {
            let mut at = 0;
            for (s, units) in replica.iter_mut().enumerate() {
                let dev = &self.devices[self.plan.device(r, s)];
                for g in units.iter_mut().flat_map(Unit::params_mut).filter_map(|p| p.grad.as_mut()) {
                    let n = D::len(g);
                    *g = dev.upload(&flat[at..at + n])?;
                    at += n;
                }
            }
        }
        Ok(())
    }

    /// Sums the gradients of the two tied copies (GPT's token embedding on the first stage,
    /// its LM-head copy on the last) into both, per replica, as `Model::sync_tied_grads` does.
    pub(super) fn sync_tied_grads(&mut self) -> Result<()> {
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

    /// `Σ ‖grad‖²` of each unit of replica 0 (replicas hold the same summed gradients), in
    /// model order; 0 for frozen units.
    pub(super) fn unit_grad_sq(&self) -> Result<Vec<f64>> {
        let mut out = Vec::new();
        for (s, units) in self.stages[0].iter().enumerate() {
            let dev = &self.devices[self.plan.device(0, s)];
            for u in units {
                out.push(grad_sum_squares(dev, &u.params())?);
            }
        }
        Ok(out)
    }
}
