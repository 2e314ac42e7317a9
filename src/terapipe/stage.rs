//! What one pipeline stage runs and holds, in the terms of the one Transformer layer a
//! [`SlicingProfile`](super::SlicingProfile) measures: the planner's latency and memory models
//! of a stage follow from it. TeraPipe's DP models identical stages; a real pipeline's differ
//! (the first holds the embeddings and PipeTransformer's frozen layers, which run forward only;
//! the last the final norm and the head, which for a large vocabulary costs several layers),
//! so the stage modelled is the pipeline's slowest, as the partitioner cuts the units.

use crate::error::{Result, config_error};
use crate::pipeline::{PipelineConfig, Plan, UnitProfile};

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
    /// Trained layers, whose activations stay for the backward (an attention or MLP unit
    /// alone is half a layer).
    pub trained_layers: f64,
    /// Attention units that train: keys, values and their gradients' sums in the arena.
    pub trained_attention: usize,
    /// Frozen attention units: keys and values only (they run no backward).
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
            trained_layers: layers as f64,
            trained_attention: layers,
            frozen_attention: 0,
            state_bytes: 0,
            end_bytes_per_token: 0.0,
        }
    }

    /// The slowest stage of `pipeline` (its `K`, `v` and schedule) cut by the partitioner from
    /// `units` (their costs for one micro-batch of `samples` sequences of `seq` tokens; the
    /// leading frozen ones pinned to the first stage, as AutoPipe plans), whose roles are
    /// `roles`; times relative to `reference`, the measured layer's attention unit (the MLP
    /// after it completes the layer). The cut is the partitioner's on time alone: the memory
    /// limit is the slicing planner's to meet.
    pub fn slowest(
        pipeline: &PipelineConfig,
        units: &[UnitProfile],
        roles: &[UnitRole],
        reference: usize,
        seq: usize,
        samples: usize,
    ) -> Result<StageLoad> {
        if units.len() != roles.len() || reference + 1 >= units.len() {
            return Err(config_error(
                "pipeline.token_slices",
                format!("{} unit costs given for a model of {} units", units.len(), roles.len()),
            ));
        }
        let config = PipelineConfig { token_slices: Vec::new(), memory_limit: None, ..pipeline.clone() };
        let devices = config.pipeline_len.saturating_mul(config.replicas);
        let pinned = units.iter().take_while(|u| !u.trainable).count();
        let plan = Plan::new(config, units, Vec::new(), devices, pinned)?;
        let times = &plan.partition.stage_time;
        let slowest = (0..times.len()).max_by(|&a, &b| times[a].total_cmp(&times[b])).unwrap_or(0);
        let stage = plan.partition.stages[slowest].clone();
        // The measured layer as it trains (whatever it is now).
        let layer: f64 = units[reference..reference + 2].iter().map(|u| u.forward + u.backward).sum();
        let layer = if layer > 0.0 { layer } else { 1.0 };
        let mut load = StageLoad::of_layers(0);
        for (u, role) in units[stage.clone()].iter().zip(&roles[stage]) {
            load.state_bytes += u.state_bytes();
            match role {
                UnitRole::End => {
                    load.end_time += u.time() / layer;
                    if u.trainable {
                        load.end_bytes_per_token += u.activation_bytes as f64 / (seq * samples).max(1) as f64;
                    }
                }
                UnitRole::Attention | UnitRole::Mlp => {
                    load.layer_time += u.time() / layer;
                    load.trained_layers += if u.trainable { 0.5 } else { 0.0 };
                }
            }
            match (role, u.trainable) {
                (UnitRole::Attention, true) => load.trained_attention += 1,
                (UnitRole::Attention, false) => load.frozen_attention += 1,
                _ => {}
            }
        }
        Ok(load)
    }
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

    /// A head as slow as one and a half layers: the partitioner's best cut over two stages is
    /// 7 | 8 (embedding and a layer and a half | the last MLP and the head), and the stage
    /// modelled is the second, half a layer and the head, not TeraPipe's one whole layer.
    #[test]
    fn the_slowest_stage_is_the_partitions_and_counts_its_head() {
        let units = units(&[1.0, 2.0, 2.0, 2.0, 2.0, 6.0], 0);
        let two = PipelineConfig { pipeline_len: 2, ..Default::default() };
        let load = StageLoad::slowest(&two, &units, &ROLES, 1, 4, 1).unwrap();
        let want = StageLoad {
            layer_time: 0.5,
            end_time: 1.5,
            trained_layers: 0.5,
            trained_attention: 0,
            frozen_attention: 0,
            state_bytes: 2 * 160,
            end_bytes_per_token: 25.0,
        };
        assert_eq!(load, want);
    }

    /// The frozen first layer (pinned to the first stage with the embedding) counts its forward
    /// only, keeps no activations and holds keys and values without their gradients; its
    /// weights hold no gradients or moments.
    #[test]
    fn frozen_layers_count_their_forward_only() {
        let units = units(&[1.0, 2.0, 2.0, 2.0, 2.0, 6.0], 3);
        let one = PipelineConfig::default();
        let load = StageLoad::slowest(&one, &units, &ROLES, 1, 4, 2).unwrap();
        let want = StageLoad {
            layer_time: (2.0 * 2.0 / 3.0 + 4.0) / 4.0,
            end_time: (1.0 / 3.0 + 6.0) / 4.0,
            trained_layers: 1.0,
            trained_attention: 1,
            frozen_attention: 1,
            state_bytes: 3 * 40 + 3 * 160,
            end_bytes_per_token: 100.0 / 8.0,
        };
        assert_eq!(load, want);
        assert_eq!(load.to_string(), "1.33 layers (1 frozen, forward only), ends 1.58 of a layer");
        // A costs list that is not the model's is refused, not misread.
        let e = StageLoad::slowest(&one, &units[..5], &ROLES, 1, 4, 2).unwrap_err().to_string();
        assert!(e.contains("5 unit costs given for a model of 6 units"), "{e}");
    }
}
