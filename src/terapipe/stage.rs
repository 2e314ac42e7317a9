//! What one pipeline stage runs and holds, in the terms of the one Transformer layer a
//! [`SlicingProfile`](super::SlicingProfile) measures: the planner's latency and memory models
//! of a stage follow from it. TeraPipe's DP models identical stages; a real pipeline's differ:
//! the first holds the embeddings, the last the final norm and the head (for a large vocabulary
//! several layers' time), and PipeTransformer's frozen layers run forward only and keep nothing
//! for a backward but their keys and values. So the stages modelled are the pipeline's own, as
//! the partitioner cuts the units: the slowest one's time, and what each one holds.

use crate::pipeline::UnitProfile;
use std::ops::Range;

/// A model unit as the slicing models see it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum UnitRole {
    /// Self-attention: its time has a context term; it keeps keys and values in the arena.
    Attention,
    /// The MLP after it.
    Mlp,
    /// Embeddings, final norm, head: their time and activations are per token.
    End,
}

/// One stage of a pipeline in units of the measured layer.
#[derive(Clone, Debug, PartialEq)]
pub struct StageLoad {
    /// Time of the stage's Transformer layers, in trained layers (a frozen layer counts its
    /// forward only): the factor on the measured layer's slice times.
    pub layer_time: f64,
    /// Time of its other units, in the measured layer's time over the whole unsliced sequence:
    /// they cost per token, with no context term.
    pub end_time: f64,
    /// Attention units that train: their activations (attention probabilities among them),
    /// and keys, values and their gradients' sums in the arena.
    pub trained_attention: usize,
    /// MLP units that train: their activations.
    pub trained_mlp: usize,
    /// Frozen attention units: keys and values only (they keep nothing for a backward).
    pub frozen_attention: usize,
    /// Bytes held whatever the micro-batches: weights, gradients and optimizer state of the
    /// trained units, the device's packs.
    pub state_bytes: usize,
    /// Activation bytes the other units keep, per token of one sequence.
    pub end_bytes_per_token: f64,
}

impl StageLoad {
    /// `layers` trained Transformer layers and nothing else.
    pub fn of_layers(layers: usize) -> StageLoad {
        StageLoad {
            layer_time: layers as f64,
            end_time: 0.0,
            trained_attention: layers,
            trained_mlp: layers,
            frozen_attention: 0,
            state_bytes: 0,
            end_bytes_per_token: 0.0,
        }
    }

    /// The stage of `units[stage]`, the units costing `units` for one micro-batch of `samples`
    /// sequences of `seq` tokens, in the roles `roles`, with times relative to `layer`, one
    /// trained layer's forward and backward at the same costs.
    pub fn of(
        units: &[UnitProfile],
        stage: Range<usize>,
        roles: &[UnitRole],
        layer: f64,
        seq: usize,
        samples: usize,
    ) -> StageLoad {
        let layer = if layer > 0.0 { layer } else { 1.0 };
        let mut load = StageLoad::of_layers(0);
        for (u, role) in units[stage.clone()].iter().zip(&roles[stage]) {
            load.state_bytes += u.state_bytes();
            match role {
                UnitRole::End => load.end_time += u.time() / layer,
                _ => load.layer_time += u.time() / layer,
            }
            match (role, u.trainable) {
                (UnitRole::End, true) => {
                    load.end_bytes_per_token += u.activation_bytes as f64 / (seq * samples).max(1) as f64
                }
                (UnitRole::Attention, true) => load.trained_attention += 1,
                (UnitRole::Attention, false) => load.frozen_attention += 1,
                (UnitRole::Mlp, true) => load.trained_mlp += 1,
                _ => {}
            }
        }
        load
    }

    /// The slowest of `stages` (by [`time`](Self::time)).
    pub fn slowest(stages: &[StageLoad]) -> Option<&StageLoad> {
        stages.iter().max_by(|a, b| a.time().total_cmp(&b.time()))
    }

    /// Time over the whole unsliced sequence, in trained layers' (the reference `of` was
    /// given): what ranks stages.
    pub fn time(&self) -> f64 {
        self.layer_time + self.end_time
    }
}

/// One trained layer's forward and backward at `units`' costs, for a model whose units have
/// `roles`: the median over its layers (an attention unit and the MLP after it) whose forward
/// and backward were both timed; 0 where none were. (The first trainable unit above frozen ones
/// runs no input gradient, a unit frozen when timed has no backward time, and one the cache
/// feeds no forward time: the median passes over them.)
pub fn trained_layer_time(units: &[UnitProfile], roles: &[UnitRole]) -> f64 {
    let mut times: Vec<f64> = (0..units.len().min(roles.len()).saturating_sub(1))
        .filter(|&i| roles[i] == UnitRole::Attention && roles[i + 1] == UnitRole::Mlp)
        .filter(|&i| units[i..i + 2].iter().all(|u| u.forward > 0.0 && u.backward > 0.0))
        .map(|i| units[i].forward + units[i].backward + units[i + 1].forward + units[i + 1].backward)
        .collect();
    times.sort_by(f64::total_cmp);
    times.get(times.len() / 2).copied().unwrap_or(0.0)
}

impl std::fmt::Display for StageLoad {
    /// `2.00 layers` / `1.39 layers (1 frozen, forward only), ends 0.04 of a layer`.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:.2} layers", self.layer_time)?;
        if self.frozen_attention > 0 {
            write!(f, " ({} frozen, forward only)", self.frozen_attention)?;
        }
        if self.end_time > 0.0 {
            write!(f, ", ends {:.2} of a layer", self.end_time)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pipeline::{PipelineConfig, Plan};
    use UnitRole::{Attention, End, Mlp};

    /// Units of `time` (a third forward, two thirds backward), 10 parameters and 100
    /// activation bytes each; the first `frozen` run forward only.
    fn units(times: &[f64], frozen: usize) -> Vec<UnitProfile> {
        let unit = |(i, &t): (usize, &f64)| UnitProfile {
            forward: t / 3.0,
            backward: 2.0 * t / 3.0,
            params: 10,
            activation_bytes: 100,
            trainable: i >= frozen,
            ..Default::default()
        };
        times.iter().enumerate().map(unit).collect()
    }

    const ROLES: [UnitRole; 6] = [End, Attention, Mlp, Attention, Mlp, End];

    /// A stage of the last MLP and a head as slow as one and a half layers: half a layer's
    /// time and the head's, one trained MLP's activations and no attention's, the head's per
    /// token, both units' weights (the stage the partitioner cuts for two stages: 7 | 8).
    #[test]
    fn a_stage_counts_its_units_by_role() {
        let units = units(&[1.0, 2.0, 2.0, 2.0, 2.0, 6.0], 0);
        let load = StageLoad::of(&units, 4..6, &ROLES, 4.0, 4, 1);
        let want = StageLoad {
            layer_time: 0.5,
            end_time: 1.5,
            trained_attention: 0,
            trained_mlp: 1,
            frozen_attention: 0,
            state_bytes: 2 * 160,
            end_bytes_per_token: 25.0,
        };
        assert_eq!(load, want);
        let two = PipelineConfig { pipeline_len: 2, ..Default::default() };
        assert_eq!(Plan::time_cut(&two, &units, 0).unwrap(), vec![0..4, 4..6]);
    }

    /// A frozen first layer counts its forward only, keeps no activations and holds keys and
    /// values without their gradients; its weights hold no gradients or moments. The reference
    /// layer is a trained one's: the median over layers whose backward was timed.
    #[test]
    fn frozen_layers_count_their_forward_only() {
        let mut units = units(&[1.0, 2.0, 2.0, 2.0, 2.0, 6.0], 3);
        let layer = trained_layer_time(&units, &ROLES);
        assert_eq!(layer, 4.0);
        let load = StageLoad::of(&units, 0..6, &ROLES, layer, 4, 2);
        let want = StageLoad {
            layer_time: (2.0 * 2.0 / 3.0 + 4.0) / 4.0,
            end_time: (1.0 / 3.0 + 6.0) / 4.0,
            trained_attention: 1,
            trained_mlp: 1,
            frozen_attention: 1,
            state_bytes: 3 * 40 + 3 * 160,
            end_bytes_per_token: 100.0 / 8.0,
        };
        assert_eq!(load, want);
        assert_eq!(load.to_string(), "1.33 layers (1 frozen, forward only), ends 1.58 of a layer");
        // A layer timed frozen (no backward) or without its input gradient (less) is passed over.
        units[1].backward = 0.0;
        units[3].backward *= 0.5;
        units.extend(self::units(&[2.0, 2.0, 2.0, 2.0], 0));
        let roles = [&ROLES[..], &[Attention, Mlp, Attention, Mlp]].concat();
        assert_eq!(trained_layer_time(&units, &roles), 4.0);
        // Layers the cache feeds (no forward) too; and with none left, nothing to measure by.
        units[6].forward = 0.0;
        units[8].forward = 0.0;
        assert_eq!(trained_layer_time(&units, &roles), (2.0 + 2.0) / 3.0 + 2.0);
        units[3].forward = 0.0;
        assert_eq!(trained_layer_time(&units[..5], &ROLES[..5]), 0.0);
    }
}
