//! `Optimizer`: AdamW or SGD with momentum over a model's parameters, with state allocated lazily
//! per trainable parameter and serialisable for checkpoints.
//!
//! PipeTransformer freezes layers while training runs, so the optimizer never assumes a fixed
//! parameter set: each [`Optimizer::step`] updates whatever parameters currently have a
//! gradient, state appears the first time a parameter is stepped, and
//! [`Optimizer::release_frozen`] / [`Optimizer::drop_state`] give the memory of frozen
//! parameters back.

use crate::device::Device;
use crate::error::{Error, Result, config_error};
use crate::model::Param;
use crate::ops::optim::{AdamWStep, SgdStep};
use serde::{Deserialize, Serialize};
use std::borrow::{Borrow, BorrowMut};
use std::collections::{BTreeMap, HashSet};

/// Which optimizer to run, with its hyper-parameters (the learning rate comes from the
/// schedule, per step). Serialised with a `kind` tag: `{"kind": "adamw", "weight_decay": 0.01}`;
/// omitted fields take PyTorch's defaults (except AdamW's weight decay: 0.01, as in PyTorch's
/// `AdamW`).
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind")]
pub enum OptimizerConfig {
    /// AdamW with decoupled weight decay.
    #[serde(rename = "adamw")]
    AdamW {
        /// First-moment decay, in [0, 1).
        #[serde(default = "default_beta1")]
        beta1: f64,
        /// Second-moment decay, in [0, 1).
        #[serde(default = "default_beta2")]
        beta2: f64,
        /// Denominator term, > 0.
        #[serde(default = "default_eps")]
        eps: f64,
        /// Decoupled weight decay, ≥ 0; applied only to parameters with `decay` set.
        #[serde(default = "default_adamw_weight_decay")]
        weight_decay: f64,
    },
    /// SGD with (optionally Nesterov) momentum, dampening 0.
    #[serde(rename = "sgd")]
    Sgd {
        /// Momentum factor in [0, 1) (0: plain SGD).
        #[serde(default = "default_momentum")]
        momentum: f64,
        /// L2 weight decay added to the gradient, ≥ 0; applied only to parameters with `decay`.
        #[serde(default)]
        weight_decay: f64,
        /// Nesterov momentum (needs momentum > 0).
        #[serde(default)]
        nesterov: bool,
    },
}

fn default_beta1() -> f64 {
    0.9
}
fn default_beta2() -> f64 {
    0.999
}
fn default_eps() -> f64 {
    1e-8
}
fn default_adamw_weight_decay() -> f64 {
    0.01
}
fn default_momentum() -> f64 {
    0.9
}

impl Default for OptimizerConfig {
    /// AdamW with its defaults.
    fn default() -> Self {
        Self::adamw()
    }
}

impl OptimizerConfig {
    /// AdamW with β1 0.9, β2 0.999, eps 1e-8, weight decay 0.01.
    pub fn adamw() -> Self {
        Self::AdamW {
            beta1: default_beta1(),
            beta2: default_beta2(),
            eps: default_eps(),
            weight_decay: default_adamw_weight_decay(),
        }
    }

    /// SGD with momentum 0.9, no weight decay, no Nesterov.
    pub fn sgd() -> Self {
        Self::Sgd { momentum: default_momentum(), weight_decay: 0.0, nesterov: false }
    }

    /// The serialised tag: `adamw` or `sgd`.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::AdamW { .. } => "adamw",
            Self::Sgd { .. } => "sgd",
        }
    }

    /// State tensors kept per trainable parameter, each the parameter's size: AdamW 2 (`m`, `v`),
    /// SGD 1 (momentum).
    pub fn state_buffers(&self) -> usize {
        match self {
            Self::AdamW { .. } => 2,
            Self::Sgd { .. } => 1,
        }
    }

    /// Checks every hyper-parameter's range; the error is an [`Error::Config`] naming the field
    /// as `optimizer.<field>`.
    pub fn validate(&self) -> Result<()> {
        match *self {
            Self::AdamW { beta1, beta2, eps, weight_decay } => {
                check_beta("optimizer.beta1", beta1)?;
                check_beta("optimizer.beta2", beta2)?;
                // (Taken as an f32 by the update: one that rounds to 0 there divides 0 by 0 for
                // an element whose gradient and moments are all 0.)
                if !(eps.is_finite() && eps as f32 > 0.0) {
                    return Err(config_error(
                        "optimizer.eps",
                        format!("must be finite and > 0 as an f32 (1.4e-45 at least), got {eps}"),
                    ));
                }
                check_non_negative("optimizer.weight_decay", weight_decay)
            }
            Self::Sgd { momentum, weight_decay, nesterov } => {
                // At 1 or above the velocity never decays: each step adds the whole history
                // of gradients again, and the steps grow without bound.
                if !(0.0..1.0).contains(&momentum) {
                    return Err(config_error("optimizer.momentum", format!("must be in [0, 1), got {momentum}")));
                }
                check_non_negative("optimizer.weight_decay", weight_decay)?;
                if nesterov && momentum == 0.0 {
                    return Err(config_error("optimizer.nesterov", "Nesterov momentum needs momentum > 0"));
                }
                Ok(())
            }
        }
    }
}

/// `beta` must lie in [0, 1): at 1 the moment never moves and the bias correction divides by 0.
fn check_beta(field: &str, beta: f64) -> Result<()> {
    if (0.0..1.0).contains(&beta) { Ok(()) } else { Err(config_error(field, format!("must be in [0, 1), got {beta}"))) }
}

/// Finite and ≥ 0 (NaN fails).
fn check_non_negative(field: &str, x: f64) -> Result<()> {
    if x.is_finite() && x >= 0.0 {
        Ok(())
    } else {
        Err(config_error(field, format!("must be finite and ≥ 0, got {x}")))
    }
}

/// The state buffers of one parameter, on the device.
enum Buffers<D: Device> {
    /// First and second moments.
    AdamW { m: D::Buf, v: D::Buf },
    /// The momentum buffer.
    Sgd { momentum: D::Buf },
}

/// One parameter's optimizer state.
struct Slot<D: Device> {
    /// Updates this parameter has received. Per parameter, as in PyTorch, so a parameter that
    /// starts training late gets its bias correction (AdamW) and first-step buffer init (SGD)
    /// from its own first update.
    step: u64,
    bufs: Buffers<D>,
}

impl<D: Device> Slot<D> {
    /// Elements per buffer.
    fn len(&self) -> usize {
        match &self.bufs {
            Buffers::AdamW { m, .. } => D::len(m),
            Buffers::Sgd { momentum } => D::len(momentum),
        }
    }
}

/// AdamW or SGD-momentum over a changing set of trainable parameters; state is keyed by
/// parameter name.
pub struct Optimizer<D: Device> {
    config: OptimizerConfig,
    step: u64,
    state: BTreeMap<String, Slot<D>>,
}

impl<D: Device> Optimizer<D> {
    /// An optimizer with no state yet; fails if `config` does not [validate](OptimizerConfig::validate).
    pub fn new(config: OptimizerConfig) -> Result<Self> {
        config.validate()?;
        Ok(Self { config, step: 0, state: BTreeMap::new() })
    }

    /// The hyper-parameters.
    pub fn config(&self) -> &OptimizerConfig {
        &self.config
    }

    /// Number of completed [`step`](Self::step) calls.
    pub fn step_count(&self) -> u64 {
        self.step
    }

    /// Whether `name` currently holds optimizer state.
    pub fn has_state(&self, name: &str) -> bool {
        self.state.contains_key(name)
    }

    /// Names holding state, sorted.
    pub fn state_names(&self) -> impl Iterator<Item = &str> {
        self.state.keys().map(String::as_str)
    }

    /// Device elements held as state, over all parameters (memory accounting).
    pub fn state_elems(&self) -> usize {
        self.state.values().map(|s| self.config.state_buffers() * s.len()).sum()
    }

    /// Releases the state of `name` (e.g. when it is frozen); returns whether it had any. If the
    /// parameter is trained again later it starts from fresh state, as a new PyTorch parameter
    /// would.
    pub fn drop_state(&mut self, name: &str) -> bool {
        self.state.remove(name).is_some()
    }

    /// Releases the state of every parameter in `params` that has no gradient (frozen); returns
    /// how many states were released.
    pub fn release_frozen<P: Borrow<Param<D>>>(&mut self, params: &[P]) -> usize {
        let mut released = 0;
        for p in params.iter().map(Borrow::borrow).filter(|p| !p.trainable()) {
            released += usize::from(self.drop_state(&p.name));
        }
        released
    }

    /// One update with learning rate `lr` of every parameter that has a gradient; frozen
    /// parameters (`grad: None`) are skipped and get no state. Weight decay applies only where
    /// `param.decay`. Counts one step even if nothing was trainable.
    ///
    /// Checks before touching anything: `lr` must be finite and ≥ 0, trainable names unique,
    /// and existing state the size of its parameter ([`Error::State`] otherwise).
    pub fn step<P: BorrowMut<Param<D>>>(&mut self, dev: &D, params: &mut [P], lr: f64) -> Result<()> {
        self.step_scaled(dev, params, lr, 1.0)
    }

    /// [`Optimizer::step`] on every gradient times `grad_scale` (global-norm clipping's
    /// coefficient, see [`crate::optim::clip_coefficient`]): the same update as scaling the
    /// gradients first, without a pass over them of its own. The gradients are left unscaled.
    pub fn step_scaled<P: BorrowMut<Param<D>>>(
        &mut self,
        dev: &D,
        params: &mut [P],
        lr: f64,
        grad_scale: f64,
    ) -> Result<()> {
        if !(lr.is_finite() && lr >= 0.0) {
            return Err(config_error("lr", format!("learning rate must be finite and ≥ 0, got {lr}")));
        }
        if !(grad_scale.is_finite() && grad_scale >= 0.0) {
            return Err(config_error("grad_scale", format!("must be finite and ≥ 0, got {grad_scale}")));
        }
        self.check_params(params.iter().map(Borrow::borrow))?;
        for p in params.iter_mut() {
            let Param { name, value, grad, decay, .. } = p.borrow_mut();
            let Some(grad) = grad.as_ref() else { continue };
            if !self.state.contains_key(name.as_str()) {
                let slot = self.fresh_slot(dev, D::len(value))?;
                self.state.insert(name.clone(), slot);
            }
            let slot = self.state.get_mut(name.as_str()).expect("state was inserted above");
            slot.step += 1;
            match (self.config, &mut slot.bufs) {
                (OptimizerConfig::AdamW { beta1, beta2, eps, weight_decay }, Buffers::AdamW { m, v }) => {
                    let weight_decay = if *decay { weight_decay } else { 0.0 };
                    let h = AdamWStep { lr, beta1, beta2, eps, weight_decay, step: slot.step, grad_scale };
                    dev.adamw_update(value, grad, m, v, &h)?;
                }
                (OptimizerConfig::Sgd { momentum, weight_decay, nesterov }, Buffers::Sgd { momentum: buf }) => {
                    let weight_decay = if *decay { weight_decay } else { 0.0 };
                    let h = SgdStep { lr, momentum, weight_decay, nesterov, grad_scale };
                    dev.sgd_update(value, grad, buf, slot.step == 1, &h)?;
                }
                // Slots are only ever built from `self.config`, which never changes.
                _ => unreachable!("optimizer state kind differs from its config"),
            }
        }
        self.step += 1;
        Ok(())
    }

    /// Zeroed state buffers for a parameter of `len` elements.
    fn fresh_slot(&self, dev: &D, len: usize) -> Result<Slot<D>> {
        let bufs = match self.config {
            OptimizerConfig::AdamW { .. } => Buffers::AdamW { m: dev.zeros(len)?, v: dev.zeros(len)? },
            OptimizerConfig::Sgd { .. } => Buffers::Sgd { momentum: dev.zeros(len)? },
        };
        Ok(Slot { step: 0, bufs })
    }

    /// Trainable names are unique and existing state matches each trainable parameter's size.
    fn check_params<'a>(&self, params: impl Iterator<Item = &'a Param<D>>) -> Result<()> {
        let mut seen = HashSet::new();
        for p in params.filter(|p| p.trainable()) {
            if !seen.insert(p.name.as_str()) {
                return Err(state_error(&p.name, "two trainable parameters share this name"));
            }
            let len = D::len(&p.value);
            if let Some(slot) = self.state.get(&p.name)
                && slot.len() != len
            {
                return Err(state_error(
                    &p.name,
                    format!("optimizer state has {} elements but the parameter has {len}", slot.len()),
                ));
            }
        }
        Ok(())
    }

    /// A host copy of the whole state (values rounded to f32, exact on f32 devices).
    pub fn state_dict(&self, dev: &D) -> Result<OptimizerState> {
        let params = self
            .state
            .iter()
            .map(|(name, slot)| {
                let buffers = match &slot.bufs {
                    Buffers::AdamW { m, v } => vec![dev.download(m)?, dev.download(v)?],
                    Buffers::Sgd { momentum } => vec![dev.download(momentum)?],
                };
                Ok(ParamState { name: name.clone(), len: slot.len(), step: slot.step, buffers })
            })
            .collect::<Result<_>>()?;
        Ok(OptimizerState { config: self.config, step: self.step, params })
    }

    /// Replaces the whole state with `state`. Every entry must name a parameter in `params`
    /// (trainable or not) with as many elements, the optimizer kind must match, and each entry
    /// must hold the kind's buffers; otherwise an [`Error::State`] names the parameter, and the
    /// optimizer is left unchanged. Hyper-parameters stay those of this optimizer's config (a
    /// resumed run may change them); `state.config` is only checked for its kind.
    pub fn load_state_dict<P: Borrow<Param<D>>>(
        &mut self,
        dev: &D,
        state: &OptimizerState,
        params: &[P],
    ) -> Result<()> {
        if state.config.kind() != self.config.kind() {
            return Err(Error::State {
                what: "optimizer".into(),
                message: format!("state is for `{}`, this optimizer is `{}`", state.config.kind(), self.config.kind()),
            });
        }
        let sizes: BTreeMap<&str, usize> =
            params.iter().map(|p| (p.borrow().name.as_str(), D::len(&p.borrow().value))).collect();
        let mut loaded = BTreeMap::new();
        for ps in &state.params {
            let Some(&len) = sizes.get(ps.name.as_str()) else {
                return Err(state_error(&ps.name, "the optimizer state names a parameter the model does not have"));
            };
            if ps.len != len {
                return Err(state_error(&ps.name, format!("state has {} elements, the parameter has {len}", ps.len)));
            }
            for (i, b) in ps.buffers.iter().enumerate() {
                if b.len() != len {
                    return Err(state_error(
                        &ps.name,
                        format!("state buffer {i} has {} elements, the parameter has {len}", b.len()),
                    ));
                }
            }
            let bufs = match (self.config, ps.buffers.as_slice()) {
                (OptimizerConfig::AdamW { .. }, [m, v]) => Buffers::AdamW { m: dev.upload(m)?, v: dev.upload(v)? },
                (OptimizerConfig::Sgd { .. }, [momentum]) => Buffers::Sgd { momentum: dev.upload(momentum)? },
                (config, bufs) => {
                    let (kind, expected) = (config.kind(), config.state_buffers());
                    return Err(state_error(
                        &ps.name,
                        format!("{kind} state needs {expected} buffers, got {}", bufs.len()),
                    ));
                }
            };
            if loaded.insert(ps.name.clone(), Slot { step: ps.step, bufs }).is_some() {
                return Err(state_error(&ps.name, "the optimizer state lists this parameter twice"));
            }
        }
        self.state = loaded;
        self.step = state.step;
        Ok(())
    }
}

/// An [`Error::State`] about parameter `name`.
fn state_error(name: &str, message: impl Into<String>) -> Error {
    Error::State { what: format!("optimizer state for parameter `{name}`"), message: message.into() }
}

/// The optimizer's state on the host, for checkpoints: what [`Optimizer::state_dict`] returns and
/// [`Optimizer::load_state_dict`] takes.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct OptimizerState {
    /// The config the state was produced under (its kind is checked on load).
    pub config: OptimizerConfig,
    /// Completed optimizer steps.
    pub step: u64,
    /// One entry per parameter holding state, sorted by name.
    pub params: Vec<ParamState>,
}

/// One parameter's optimizer state on the host.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ParamState {
    /// The parameter's name.
    pub name: String,
    /// Elements of the parameter (and of each buffer).
    pub len: usize,
    /// Updates this parameter has received (AdamW's bias-correction step).
    pub step: u64,
    /// The state tensors, flattened like the parameter: AdamW `[m, v]`, SGD `[momentum]`.
    /// Stored as f32: exact for f32 training (and JSON reads floats back bit for bit: the
    /// crate builds serde_json with `float_roundtrip`).
    pub buffers: Vec<Vec<f32>>,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::CpuDevice;
    use crate::testing::Rng;

    type Dev = CpuDevice<f64>;

    /// The fixed gradients of the hand-computed trajectories, one per step.
    const GRADS: [[f64; 2]; 3] = [[0.5, -1.0], [0.25, 2.0], [-0.75, 0.1]];

    /// Runs three steps at lr 0.1 on `names` (each starting at [1, −2], decay on for names not
    /// starting with `nodecay`) and returns each parameter's values after every step.
    fn trajectory(config: OptimizerConfig, names: &[&str]) -> Vec<Vec<[f64; 2]>> {
        let dev = Dev::new(0, 1).unwrap();
        let mut params: Vec<Param<Dev>> = names
            .iter()
            .map(|n| Param::new(&dev, *n, &[2], &[1.0, -2.0], !n.starts_with("nodecay")).unwrap())
            .collect();
        let mut opt = Optimizer::new(config).unwrap();
        let mut out = vec![Vec::new(); names.len()];
        for g in GRADS {
            for p in &mut params {
                p.grad = Some(dev.upload_f64(&g).unwrap());
            }
            opt.step(&dev, &mut params, 0.1).unwrap();
            for (traj, p) in out.iter_mut().zip(&params) {
                let v = dev.download_f64(&p.value).unwrap();
                traj.push([v[0], v[1]]);
            }
        }
        assert_eq!(opt.step_count(), 3);
        out
    }

    #[track_caller]
    fn assert_trajectory(got: &[[f64; 2]], want: [[f64; 2]; 3]) {
        for (step, (g, w)) in got.iter().zip(want).enumerate() {
            for i in 0..2 {
                assert!((g[i] - w[i]).abs() <= 1e-12, "step {} element {i}: got {}, expected {}", step + 1, g[i], w[i]);
            }
        }
    }

    // Expected values from a scalar Python loop, per element and step t = 1, 2, 3:
    //   p *= 1 − lr·wd;  m = β1·m + (1−β1)·g;  v = β2·v + (1−β2)·g²
    //   p −= lr·(m/(1−β1^t)) / (sqrt(v/(1−β2^t)) + eps)
    // with lr 0.1, β1 0.9, β2 0.999, eps 1e-8, p0 = [1, −2]. Step 1 by hand: m̂ = g, v̂ = g², so
    // p1 = 1·(1 − 0.01) − 0.1·0.5/(0.5 + 1e-8) = 0.890000002 for wd 0.1.
    #[test]
    fn adamw_matches_hand_computed_trajectory() {
        let config = OptimizerConfig::AdamW { beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.1 };
        let t = trajectory(config, &["w", "nodecay.bias"]);
        assert_trajectory(
            &t[0],
            [
                [0.890000002, -1.880000001],
                [0.7878820404574624, -1.897810353462075],
                [0.7882008996862033, -1.9099595859336627],
            ],
        );
        // `decay: false`: the same loop with wd = 0.
        assert_trajectory(
            &t[1],
            [
                [0.900000002, -1.900000001],
                [0.8067820404774624, -1.9366103534720749],
                [0.814979720110778, -1.9677376894782834],
            ],
        );
    }

    // Expected values from a scalar Python loop, per element and step t = 1, 2, 3:
    //   g' = g + wd·p;  buf = g' (t = 1) or μ·buf + g';  d = nesterov ? g' + μ·buf : buf;
    //   p −= lr·d,  with lr 0.1, μ 0.9, wd 0.1, p0 = [1, −2].
    // Step 1 by hand: g' = [0.6, −1.2], p1 = [1 − 0.06, −2 + 0.12] = [0.94, −1.88]; Nesterov:
    // d = 1.9·g' so p1 = [0.886, −1.772].
    #[test]
    fn sgd_momentum_matches_hand_computed_trajectory() {
        let t =
            trajectory(OptimizerConfig::Sgd { momentum: 0.9, weight_decay: 0.1, nesterov: false }, &["w", "nodecay"]);
        assert_trajectory(
            &t[0],
            [[0.94, -1.88], [0.8515999999999999, -1.9531999999999998], [0.8385239999999999, -2.0095479999999997]],
        );
        // No decay: buf after step 3 is 0.9·(0.9·g1 + g2) + g3 with g = the raw gradients:
        // p3 = p0 − 0.1·(g1 + (0.9·g1 + g2) + (0.81·g1 + 0.9·g2 + g3)).
        let want = |i: usize| {
            let [g1, g2, g3] = [GRADS[0][i], GRADS[1][i], GRADS[2][i]];
            [1.0, -2.0][i] - 0.1 * (g1 + (0.9 * g1 + g2) + (0.81 * g1 + 0.9 * g2 + g3))
        };
        assert!((t[1][2][0] - want(0)).abs() <= 1e-12 && (t[1][2][1] - want(1)).abs() <= 1e-12);
    }

    #[test]
    fn sgd_nesterov_matches_hand_computed_trajectory() {
        let t = trajectory(OptimizerConfig::Sgd { momentum: 0.9, weight_decay: 0.1, nesterov: true }, &["w"]);
        assert_trajectory(&t[0], [[0.886, -1.772], [0.773066, -2.021132], [0.8297111460000001, -2.0618972920000003]]);
    }

    #[test]
    fn plain_sgd_is_p_minus_lr_g() {
        let t = trajectory(OptimizerConfig::Sgd { momentum: 0.0, weight_decay: 0.0, nesterov: false }, &["w"]);
        // p0 − 0.1·g1, − 0.1·g2, − 0.1·g3.
        assert_trajectory(&t[0], [[0.95, -1.9], [0.925, -2.1], [1.0, -2.11]]);
    }

    #[test]
    fn frozen_params_are_untouched_and_hold_no_state() {
        let dev = Dev::new(0, 1).unwrap();
        let mut params = vec![
            Param::new(&dev, "trained", &[2], &[1.0, 2.0], true).unwrap(),
            Param::new(&dev, "frozen", &[3], &[3.0, 4.0, 5.0], true).unwrap(),
        ];
        params[1].set_trainable(&dev, false).unwrap();
        for p in &mut params {
            if let Some(g) = &mut p.grad {
                dev.fill(g, 1.0).unwrap();
            }
        }
        for config in [OptimizerConfig::adamw(), OptimizerConfig::sgd()] {
            let mut opt = Optimizer::new(config).unwrap();
            opt.step(&dev, &mut params, 0.1).unwrap();
            assert_eq!(dev.download_f64(&params[1].value).unwrap(), [3.0, 4.0, 5.0]);
            assert!(opt.has_state("trained") && !opt.has_state("frozen"));
            assert_eq!(opt.state_elems(), config.state_buffers() * 2);
        }
    }

    #[test]
    fn freezing_releases_state_and_a_late_start_gets_its_own_step_count() {
        let dev = Dev::new(0, 1).unwrap();
        let mut params = vec![
            Param::new(&dev, "a", &[2], &[1.0, 2.0], true).unwrap(),
            Param::new(&dev, "b", &[1], &[1.0], true).unwrap(),
        ];
        params[1].set_trainable(&dev, false).unwrap();
        let mut opt = Optimizer::new(OptimizerConfig::adamw()).unwrap();
        opt.step(&dev, &mut params, 0.1).unwrap();
        opt.step(&dev, &mut params, 0.1).unwrap();
        params[1].set_trainable(&dev, true).unwrap();
        opt.step(&dev, &mut params, 0.1).unwrap();
        let state = opt.state_dict(&dev).unwrap();
        let steps: Vec<(&str, u64)> = state.params.iter().map(|p| (p.name.as_str(), p.step)).collect();
        assert_eq!(steps, [("a", 3), ("b", 1)]);
        assert_eq!(state.step, 3);

        params[0].set_trainable(&dev, false).unwrap();
        assert_eq!(opt.release_frozen(&params), 1);
        assert!(!opt.has_state("a") && opt.has_state("b"));
        assert!(opt.drop_state("b") && !opt.drop_state("b"));
        assert_eq!(opt.state_elems(), 0);
    }

    /// Two f32 parameters with random gradients, one excluded from decay.
    fn f32_params(dev: &CpuDevice<f32>, rng: &mut Rng) -> Vec<Param<CpuDevice<f32>>> {
        let w: Vec<f32> = rng.vec(12, 1.0).iter().map(|&x| x as f32).collect();
        let b: Vec<f32> = rng.vec(3, 1.0).iter().map(|&x| x as f32).collect();
        vec![Param::new(dev, "w", &[3, 4], &w, true).unwrap(), Param::new(dev, "b", &[3], &b, false).unwrap()]
    }

    fn set_random_grads(dev: &CpuDevice<f32>, params: &mut [Param<CpuDevice<f32>>], rng: &mut Rng) {
        for p in params {
            p.grad = Some(dev.upload_f64(&rng.vec(p.numel(), 1.0)).unwrap());
        }
    }

    #[test]
    fn state_round_trip_through_json_continues_bitwise() {
        let dev = CpuDevice::<f32>::new(0, 1).unwrap();
        for config in
            [OptimizerConfig::adamw(), OptimizerConfig::Sgd { momentum: 0.9, weight_decay: 0.01, nesterov: true }]
        {
            let mut rng = Rng::new(42);
            let mut params = f32_params(&dev, &mut rng);
            let mut opt = Optimizer::new(config).unwrap();
            for _ in 0..3 {
                set_random_grads(&dev, &mut params, &mut rng);
                opt.step(&dev, &mut params, 1e-2).unwrap();
            }
            let json = serde_json::to_string(&opt.state_dict(&dev).unwrap()).unwrap();
            let state: OptimizerState = serde_json::from_str(&json).unwrap();
            let mut resumed = Optimizer::new(config).unwrap();
            resumed.load_state_dict(&dev, &state, &params).unwrap();
            assert_eq!(resumed.step_count(), 3);

            // A copy of the parameters for the resumed optimizer, then one more step on each.
            let mut copy: Vec<Param<CpuDevice<f32>>> = params
                .iter()
                .map(|p| Param::new(&dev, p.name.clone(), &p.shape, &dev.download(&p.value).unwrap(), p.decay).unwrap())
                .collect();
            set_random_grads(&dev, &mut params, &mut rng);
            for (c, p) in copy.iter_mut().zip(&params) {
                c.grad = Some(dev.upload(&dev.download(p.grad.as_ref().unwrap()).unwrap()).unwrap());
            }
            opt.step(&dev, &mut params, 1e-2).unwrap();
            resumed.step(&dev, &mut copy, 1e-2).unwrap();
            for (a, b) in params.iter().zip(&copy) {
                let bits = |p: &Param<CpuDevice<f32>>| {
                    dev.download(&p.value).unwrap().iter().map(|x| x.to_bits()).collect::<Vec<_>>()
                };
                assert_eq!(bits(a), bits(b), "{} after resuming {}", a.name, config.kind());
            }
            assert_eq!(opt.state_dict(&dev).unwrap(), resumed.state_dict(&dev).unwrap());
        }
    }

    /// The `what` and `message` of an `Error::State`, or a panic.
    fn state_err(r: Result<()>) -> String {
        match r {
            Err(Error::State { what, message }) => format!("{what}: {message}"),
            other => panic!("expected a state error, got {other:?}"),
        }
    }

    #[test]
    fn mismatched_state_is_rejected_naming_the_parameter() {
        let dev = CpuDevice::<f32>::new(0, 1).unwrap();
        let mut rng = Rng::new(1);
        let mut params = f32_params(&dev, &mut rng);
        set_random_grads(&dev, &mut params, &mut rng);
        let mut opt = Optimizer::new(OptimizerConfig::adamw()).unwrap();
        opt.step(&dev, &mut params, 1e-3).unwrap();
        let good = opt.state_dict(&dev).unwrap();
        let mut fresh = Optimizer::<CpuDevice<f32>>::new(OptimizerConfig::adamw()).unwrap();

        let mut unknown = good.clone();
        unknown.params[0].name = "ghost".into();
        let msg = state_err(fresh.load_state_dict(&dev, &unknown, &params));
        assert!(msg.contains("`ghost`"), "{msg}");

        let mut short = good.clone();
        let w = short.params.iter_mut().find(|p| p.name == "w").unwrap();
        w.len = 11;
        let msg = state_err(fresh.load_state_dict(&dev, &short, &params));
        assert!(msg.contains("`w`") && msg.contains("11") && msg.contains("12"), "{msg}");

        let mut short_buf = good.clone();
        short_buf.params.iter_mut().find(|p| p.name == "b").unwrap().buffers[1].pop();
        let msg = state_err(fresh.load_state_dict(&dev, &short_buf, &params));
        assert!(msg.contains("`b`") && msg.contains("2 elements") && msg.contains("3"), "{msg}");

        let mut sgd = Optimizer::<CpuDevice<f32>>::new(OptimizerConfig::sgd()).unwrap();
        let msg = state_err(sgd.load_state_dict(&dev, &good, &params));
        assert!(msg.contains("adamw") && msg.contains("sgd"), "{msg}");

        assert!(!fresh.has_state("w") && fresh.step_count() == 0, "failed loads change nothing");
        fresh.load_state_dict(&dev, &good, &params).unwrap();
        assert!(fresh.has_state("w") && fresh.step_count() == 1);

        // A parameter whose size changed under existing state.
        let mut resized = vec![Param::new(&dev, "w", &[5], &[0.0; 5], true).unwrap()];
        let msg = state_err(fresh.step(&dev, &mut resized, 1e-3));
        assert!(msg.contains("`w`") && msg.contains("12") && msg.contains('5'), "{msg}");
    }

    #[test]
    fn duplicate_names_and_bad_lr_are_rejected() {
        let dev = Dev::new(0, 1).unwrap();
        let mut params = vec![
            Param::new(&dev, "x", &[1], &[1.0], true).unwrap(),
            Param::new(&dev, "x", &[1], &[1.0], true).unwrap(),
        ];
        let mut opt = Optimizer::new(OptimizerConfig::adamw()).unwrap();
        assert!(state_err(opt.step(&dev, &mut params, 0.1)).contains("`x`"));
        for lr in [-1.0, f64::NAN, f64::INFINITY] {
            assert!(matches!(opt.step(&dev, &mut params[..1], lr), Err(Error::Config { .. })));
        }
        for scale in [-0.5, f64::NAN, f64::INFINITY] {
            assert!(matches!(opt.step_scaled(&dev, &mut params[..1], 0.1, scale), Err(Error::Config { .. })));
        }
        assert_eq!(opt.step_count(), 0);
    }

    #[test]
    fn config_validation_names_the_field() {
        let field_of = |c: OptimizerConfig| match Optimizer::<Dev>::new(c) {
            Err(Error::Config { field, .. }) => field,
            Err(e) => panic!("expected a config error, got {e}"),
            Ok(_) => panic!("{c:?} was accepted"),
        };
        let adamw = |beta1, beta2, eps, weight_decay| OptimizerConfig::AdamW { beta1, beta2, eps, weight_decay };
        assert_eq!(field_of(adamw(1.0, 0.999, 1e-8, 0.0)), "optimizer.beta1");
        assert_eq!(field_of(adamw(-0.1, 0.999, 1e-8, 0.0)), "optimizer.beta1");
        assert_eq!(field_of(adamw(0.9, f64::NAN, 1e-8, 0.0)), "optimizer.beta2");
        assert_eq!(field_of(adamw(0.9, 0.999, 0.0, 0.0)), "optimizer.eps");
        // (Positive, but 0 in the f32 the update takes it as: 0/0 for an untouched element.)
        assert_eq!(field_of(adamw(0.9, 0.999, 1e-50, 0.0)), "optimizer.eps");
        adamw(0.9, 0.999, 1e-44, 0.0).validate().unwrap();
        assert_eq!(field_of(adamw(0.9, 0.999, 1e-8, -0.01)), "optimizer.weight_decay");
        let sgd = |momentum, weight_decay, nesterov| OptimizerConfig::Sgd { momentum, weight_decay, nesterov };
        assert_eq!(field_of(sgd(-0.5, 0.0, false)), "optimizer.momentum");
        assert_eq!(field_of(sgd(1.0, 0.0, false)), "optimizer.momentum");
        assert_eq!(field_of(sgd(f64::NAN, 0.0, false)), "optimizer.momentum");
        assert_eq!(field_of(sgd(0.9, -1.0, false)), "optimizer.weight_decay");
        assert_eq!(field_of(sgd(0.0, 0.0, true)), "optimizer.nesterov");
        adamw(0.0, 0.0, 1e-8, 0.0).validate().unwrap();
        sgd(0.0, 0.0, false).validate().unwrap();
    }

    #[test]
    fn config_serde_uses_a_kind_tag_and_defaults() {
        let c: OptimizerConfig = serde_json::from_str(r#"{"kind": "adamw", "weight_decay": 0.1}"#).unwrap();
        assert_eq!(c, OptimizerConfig::AdamW { beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.1 });
        let c: OptimizerConfig = serde_json::from_str(r#"{"kind": "sgd"}"#).unwrap();
        assert_eq!(c, OptimizerConfig::sgd());
        assert_eq!(OptimizerConfig::default(), OptimizerConfig::adamw());
        for c in [OptimizerConfig::adamw(), OptimizerConfig::sgd()] {
            let back: OptimizerConfig = serde_json::from_str(&serde_json::to_string(&c).unwrap()).unwrap();
            assert_eq!(back, c);
        }
        assert!(serde_json::from_str::<OptimizerConfig>(r#"{"kind": "lamb"}"#).is_err());
    }
}
