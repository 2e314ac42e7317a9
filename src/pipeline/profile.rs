//! What the partitioner balances: each unit's time and memory per micro-batch, measured on a
//! device ([`profile_units`]) or modelled from FLOP counts ([`unit_profiles`]).

use crate::device::Device;
use crate::error::{Result, internal};
use crate::model::{Batch, HostBatch, InputSpec, Model, UnitCost};
use serde::{Deserialize, Serialize};

/// What the partitioner knows about one unit, per micro-batch.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct UnitProfile {
    /// Forward seconds (or any consistent unit).
    pub forward: f64,
    /// Backward seconds (input and weight gradients).
    pub backward: f64,
    /// Parameters (elements).
    pub params: usize,
    /// Bytes of activations the forward keeps for the backward.
    pub activation_bytes: usize,
    /// Of those, the attention probabilities (what token slicing shrinks; [`UnitCost`]).
    #[serde(default)]
    pub score_bytes: usize,
    /// The key/value arena's gradients under token slicing ([`UnitCost`]).
    #[serde(default)]
    pub kv_grad_bytes: usize,
    /// The keys and values a sliced attention unit keeps in its arena ([`UnitCost`]).
    #[serde(default)]
    pub kv_bytes: usize,
    /// What a frozen unit keeps per micro-batch in flight: nothing whole, its arena's keys and
    /// values under token slicing (set by [`sliced`](Self::sliced); a trained unit's are among
    /// its activations).
    #[serde(default)]
    pub frozen_arena_bytes: usize,
    /// The hidden states the unit reads ([`UnitCost::input_bytes`]): what a stage that
    /// recomputes keeps of each micro-batch in flight when this is the first unit it
    /// recomputes.
    #[serde(default)]
    pub input_bytes: usize,
    /// Of the activations, the logits' gradient the last stage holds per micro-batch in
    /// flight, recomputing or not ([`UnitCost::loss_grad_bytes`]).
    #[serde(default)]
    pub loss_grad_bytes: usize,
    /// Under token slicing (set by [`sliced`](Self::sliced)), what a stage recomputing this
    /// unit gets back for one slice's backward at a time: the most any slice regains of
    /// [`recomputable_bytes`](Self::recomputable_bytes). `None` for whole sequences, whose
    /// backward regains all of it.
    #[serde(default)]
    pub slice_regained_bytes: Option<usize>,
    /// Whether any parameter trains. A frozen unit runs forward only, keeps no activations and
    /// has no gradients or optimizer state.
    pub trainable: bool,
    /// Bytes the device keeps beside the linear layers' weights for its products, whatever the
    /// micro-batch ([`UnitCost::weight_pack_bytes`]).
    #[serde(default)]
    pub weight_pack_bytes: usize,
}

impl UnitProfile {
    /// Bytes held whatever the micro-batches: the weights (training: with their gradients and
    /// AdamW's moments) and the device's packs of them.
    pub fn state_bytes(&self) -> usize {
        super::partition::param_bytes(self.params, self.trainable) + self.weight_pack_bytes
    }

    /// Bytes kept per micro-batch in flight: a trained unit's activations, a frozen one's
    /// arena.
    pub fn in_flight_bytes(&self) -> usize {
        if self.trainable { self.activation_bytes } else { self.frozen_arena_bytes }
    }

    /// Of [`in_flight_bytes`](Self::in_flight_bytes), what a stage recomputing this unit
    /// keeps for one micro-batch at a time instead of for each in flight: all but the
    /// key/value arena of token slicing (its keys and values, and a trained unit's gradients
    /// of them), which later slices read and the backward fills whatever runs again, and the
    /// logits' gradient, which the loss gives in the forward.
    pub fn recomputable_bytes(&self) -> usize {
        let arena = match self.frozen_arena_bytes {
            0 => 0,
            kv => kv + if self.trainable { self.kv_grad_bytes } else { 0 },
        };
        let loss_grad = if self.trainable { self.loss_grad_bytes } else { 0 };
        self.in_flight_bytes().saturating_sub(arena + loss_grad)
    }

    /// What a stage recomputing this unit holds again while one backward runs: a whole
    /// micro-batch's [`recomputable_bytes`](Self::recomputable_bytes), or under token slicing
    /// one slice's, the largest.
    pub fn regained_bytes(&self) -> usize {
        self.slice_regained_bytes.unwrap_or_else(|| self.recomputable_bytes())
    }

    /// Seconds per micro-batch: forward, plus backward when trainable.
    pub fn time(&self) -> f64 {
        self.forward + if self.trainable { self.backward } else { 0.0 }
    }

    /// From analytic costs: `samples` per micro-batch at `flops_per_second`.
    pub fn analytic(cost: &UnitCost, samples: usize, flops_per_second: f64, trainable: bool) -> Self {
        let n = samples as f64;
        UnitProfile {
            forward: cost.forward_flops * n / flops_per_second,
            backward: cost.backward_flops * n / flops_per_second,
            params: cost.params,
            activation_bytes: cost.activation_bytes * samples,
            score_bytes: cost.score_bytes * samples,
            kv_grad_bytes: cost.kv_grad_bytes * samples,
            kv_bytes: cost.kv_bytes * samples,
            frozen_arena_bytes: 0,
            input_bytes: cost.input_bytes * samples,
            loss_grad_bytes: cost.loss_grad_bytes * samples,
            slice_regained_bytes: None,
            trainable,
            weight_pack_bytes: cost.weight_pack_bytes,
        }
    }

    /// The same unit for a micro-batch `factor` times as large (time and activations scale
    /// with the samples).
    pub fn scaled(&self, factor: f64) -> Self {
        UnitProfile {
            forward: self.forward * factor,
            backward: self.backward * factor,
            activation_bytes: (self.activation_bytes as f64 * factor).round() as usize,
            score_bytes: (self.score_bytes as f64 * factor).round() as usize,
            kv_grad_bytes: (self.kv_grad_bytes as f64 * factor).round() as usize,
            kv_bytes: (self.kv_bytes as f64 * factor).round() as usize,
            frozen_arena_bytes: (self.frozen_arena_bytes as f64 * factor).round() as usize,
            input_bytes: (self.input_bytes as f64 * factor).round() as usize,
            loss_grad_bytes: (self.loss_grad_bytes as f64 * factor).round() as usize,
            slice_regained_bytes: self.slice_regained_bytes.map(|b| (b as f64 * factor).ceil() as usize),
            ..*self
        }
    }

    /// The same unit when each sequence runs as token slices of `lengths` (TeraPipe): the
    /// attention probabilities shrink to `Σ l·(c + l) / L²` of the whole sequence's, and the
    /// key/value arena adds the keys' and values' gradients; a frozen unit keeps its arena's
    /// keys and values for the later slices. What recomputation regains per slice is the rest
    /// of its activations by the slice's share of the tokens, `l / L`, and its scores by
    /// `l·(c + l) / L²`, rounded up (a bound).
    pub fn sliced(&self, lengths: &[usize]) -> Self {
        let whole: usize = lengths.iter().sum();
        if lengths.len() < 2 || whole == 0 {
            return *self;
        }
        // (What scales with the slice's tokens; a frozen unit regains nothing, by the cap below.)
        let by_tokens = (self.activation_bytes - self.score_bytes).saturating_sub(self.kv_bytes + self.loss_grad_bytes);
        let (mut context, mut kept, mut most_regained) = (0, 0.0, 0.0f64);
        for &l in lengths {
            let seen = (l * (context + l)) as f64;
            kept += seen;
            let regained =
                by_tokens as f64 * l as f64 / whole as f64 + self.score_bytes as f64 * seen / (whole * whole) as f64;
            most_regained = most_regained.max(regained);
            context += l;
        }
        let scores = (self.score_bytes as f64 * kept / (whole * whole) as f64).round() as usize;
        let sliced = UnitProfile {
            activation_bytes: self.activation_bytes - self.score_bytes + scores + self.kv_grad_bytes,
            score_bytes: scores,
            frozen_arena_bytes: self.kv_bytes,
            ..*self
        };
        // (No slice regains more than all of them together, whatever the rounding; a frozen unit
        // none.)
        UnitProfile {
            slice_regained_bytes: Some((most_regained.ceil() as usize).min(sliced.recomputable_bytes())),
            ..sliced
        }
    }
}

/// Samples in each of `micro_batches` micro-batches of a replica, for steps of `batch` samples
/// shared by `replicas` (the last micro-batch may hold fewer; counts of 0 read as 1).
pub fn samples_per_micro_batch(batch: usize, replicas: usize, micro_batches: usize) -> usize {
    batch.div_ceil(replicas.max(1)).div_ceil(micro_batches.max(1))
}

/// [`unit_profiles`] per sample of `micro`: the costs a trainer keeps, and scales to each
/// plan's micro-batch as the plan changes.
pub fn unit_profiles_per_sample<D: Device>(
    dev: &D,
    model: &mut Model<D>,
    micro: &HostBatch,
    measure: bool,
) -> Result<Vec<UnitProfile>> {
    let per_micro_batch = unit_profiles(dev, model, micro, measure)?;
    Ok(per_micro_batch.iter().map(|p| p.scaled(1.0 / micro.batch.max(1) as f64)).collect())
}

/// The units' costs for one micro-batch `micro`: measured on `dev` (the median of three runs),
/// or their FLOPs at a nominal 100 GFLOP/s (only the ratios matter to the partitioner).
///
/// Every unit after the frozen prefix counts as trainable, parameters or not: its backward
/// runs for the gradient of its input (a tied LM head whose only weight, the embedding's,
/// froze with it, still costs its backward and keeps its activations).
pub fn unit_profiles<D: Device>(
    dev: &D,
    model: &mut Model<D>,
    micro: &HostBatch,
    measure: bool,
) -> Result<Vec<UnitProfile>> {
    if measure {
        return profile_units(dev, model, micro, 3);
    }
    // Hidden-state positions: the tokens, or the patches plus the class token.
    let seq = match model.spec().input {
        InputSpec::Image { image_size, patch, .. } => (image_size / patch).pow(2) + 1,
        InputSpec::Tokens { .. } => micro.seq,
    };
    let trains = model.frozen_prefix();
    Ok(model
        .costs(dev, seq)
        .iter()
        .enumerate()
        .map(|(i, c)| UnitProfile::analytic(c, micro.batch, 1e11, i >= trains))
        .collect())
}

/// Measures each unit's forward and backward time on `dev` for one micro-batch `host` (the
/// median of `repeats` runs, after one warm-up): the costs the partitioner balances when the
/// analytic FLOP counts would mislead (attention's softmax, the embedding's gathers).
pub fn profile_units<D: Device>(
    dev: &D,
    model: &mut Model<D>,
    host: &HostBatch,
    repeats: usize,
) -> Result<Vec<UnitProfile>> {
    let batch = Batch::upload(dev, model.spec(), host, true, 0)?;
    let costs = model.costs(dev, batch.seq);
    let n = model.units().len();
    let mut fwd = vec![Vec::new(); n];
    let mut bwd = vec![Vec::new(); n];
    let since = |t: std::time::Instant| -> Result<f64> {
        dev.synchronize()?;
        Ok(t.elapsed().as_secs_f64())
    };
    // As a step runs them: frozen units forward only, saving nothing; the first trainable
    // unit not asked for its input gradient.
    let trains = model.frozen_prefix();
    for rep in 0..=repeats.max(1) {
        let mut x = None;
        let mut saved = Vec::with_capacity(n);
        for (i, unit) in model.units().iter().enumerate() {
            let start = std::time::Instant::now();
            let (y, s) = unit.forward(dev, &batch, x.take(), i >= trains, None)?;
            let t = since(start)?;
            saved.push(s);
            x = Some(y);
            if rep > 0 {
                fwd[i].push(t);
            }
        }
        let logits = x.ok_or_else(|| internal("profile", "empty model"))?;
        let loss = model.loss(dev, &batch, &logits, Some(1.0))?;
        let mut dy = loss.dlogits.ok_or_else(|| internal("profile", "no gradient"))?;
        for (i, (unit, s)) in model.units_mut().iter_mut().zip(saved).enumerate().rev().take(n - trains) {
            let start = std::time::Instant::now();
            let dx = unit.backward(dev, &batch, s, dy, i > trains, None)?;
            let t = since(start)?;
            if rep > 0 {
                bwd[i].push(t);
            }
            match dx {
                Some(dx) => dy = dx,
                None => break,
            }
        }
    }
    model.zero_grad(dev)?;
    let median = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v.get(v.len() / 2).copied().unwrap_or(0.0)
    };
    Ok((0..n)
        .map(|i| UnitProfile {
            forward: median(&mut fwd[i]),
            backward: median(&mut bwd[i]),
            ..UnitProfile::analytic(&costs[i], host.batch, 1.0, i >= trains)
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A GPT whose embedding froze: its tied head holds no trainable weight, yet runs its
    /// backward and keeps its activations.
    #[test]
    fn units_after_the_frozen_prefix_count_as_trainable() {
        let dev = crate::device::CpuDevice::<f32>::new(0, 1).unwrap();
        let config = crate::model::tiny::tiny_gpt(0.0);
        let mut model = Model::new(&dev, &config, 1).unwrap();
        model.freeze_prefix(&dev, 1).unwrap();
        assert!(!model.units().last().unwrap().trainable(), "the head's only weight is the frozen tied copy");
        let micro = crate::model::HostBatch {
            batch: 2,
            seq: 7,
            tokens: Some((0..14).map(|t| t % 5).collect()),
            targets: (1..15).map(|t| t % 5).collect(),
            ..Default::default()
        };
        for measure in [false, true] {
            let flags: Vec<bool> =
                unit_profiles(&dev, &mut model, &micro, measure).unwrap().iter().map(|p| p.trainable).collect();
            assert!(!flags[0] && flags[1..].iter().all(|&t| t), "{flags:?}");
        }
    }

    /// Under token slicing a block's arena adds the keys' and values' gradients, summed in f32
    /// whatever the activations' dtype: at bf16 (2 bytes) they take twice the keys and values.
    #[test]
    fn a_sliced_unit_counts_the_arena_gradients_in_f32() {
        let dev = crate::device::CpuDevice::<f32>::new(0, 1).unwrap();
        let model = Model::new(&dev, &crate::model::tiny::tiny_gpt(0.0), 1).unwrap();
        let block = &model.units()[1];
        for elem in [2, 4] {
            let cost = block.cost(&dev, 8, elem);
            assert!(cost.score_bytes > 0);
            let whole = UnitProfile::analytic(&cost, 3, 1e9, true);
            let sliced = whole.sliced(&[4, 4]);
            // Slices of 4 keep 4·4 + 4·8 of the 8·8 scores; 3 samples' keys and values, 8 ×
            // hidden each, have f32 gradients.
            let scores = (whole.score_bytes as f64 * 48.0 / 64.0).round() as usize;
            let grads = 3 * 2 * 8 * model.spec().hidden * 4;
            assert_eq!(sliced.activation_bytes, whole.activation_bytes - whole.score_bytes + scores + grads, "{elem}");
        }
    }

    /// A recomputing stage's backward regains a whole micro-batch's activations, or one slice's
    /// under token slicing: the largest, here the last of [2, 6], whose 6 of 8 tokens see all
    /// 8 of context (6·8 of the 8·8 scores), against the first's 2 tokens and 2·2 scores.
    #[test]
    fn a_slice_regains_its_share_of_the_activations() {
        let dev = crate::device::CpuDevice::<f32>::new(0, 1).unwrap();
        let model = Model::new(&dev, &crate::model::tiny::tiny_gpt(0.0), 1).unwrap();
        let whole = UnitProfile::analytic(&model.units()[1].cost(&dev, 8, 4), 3, 1e9, true);
        assert_eq!(whole.regained_bytes(), whole.recomputable_bytes());
        for lengths in [[2, 6], [6, 2]] {
            let sliced = whole.sliced(&lengths);
            let by_tokens = (whole.activation_bytes - whole.score_bytes - whole.kv_bytes) as f64;
            let slice = |l: usize, context: usize| {
                by_tokens * l as f64 / 8.0 + whole.score_bytes as f64 * (l * (context + l)) as f64 / 64.0
            };
            let most = slice(lengths[0], 0).max(slice(lengths[1], lengths[0])).ceil() as usize;
            assert_eq!(sliced.regained_bytes(), most, "{lengths:?}");
            assert!(most < sliced.recomputable_bytes(), "{lengths:?}");
        }
        // The whole-micro-batch profile, scaled, keeps its meaning; a frozen unit regains nothing.
        assert_eq!(whole.scaled(2.0).slice_regained_bytes, None);
        let frozen = UnitProfile { trainable: false, ..whole }.sliced(&[4, 4]);
        assert_eq!(frozen.regained_bytes(), 0);
    }
}
