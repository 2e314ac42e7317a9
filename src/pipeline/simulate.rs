//! The cluster simulator: plays a schedule's action lists, the same IR the runtime executes,
//! against a cost model (seconds per stage for a forward, a backward and put-off weight
//! gradients, and a link that delays every message) and returns the step's time line, its
//! makespan and its bubble — what a plan would cost on devices and links we do not have.
//!
//! The rules are the runtime's: each device runs its list in order; a compute action takes its
//! stage's time (a token slice its share of its micro-batch's: by tokens, or as TeraPipe's
//! latency model measured it); a send never blocks its device and
//! its message arrives `latency + bytes / bandwidth` later (links carry any number of messages
//! at once: a pipeline sends one per compute action, so they overlap only on a link slower than
//! the compute); a receive waits for its message; all-reduce starts and the optimizer step cost
//! nothing (the measured bubble leaves the step's tail out too). A receive whose message never
//! comes is a deadlock, reported as an error.

use super::partition::UnitProfile;
use super::plan::Plan;
use super::schedule::{Action, MessageKey, Schedule, ScheduleKind};
use super::trace::{Span, StepTrace};
use crate::error::{Error, Result, config_error};
use std::collections::HashMap;

/// The share of a backward that zero bubble puts off as weight gradients: a linear layer's
/// `dW = doutᵀ·inp` costs the FLOPs of its `dx = dout·W`, and the schedule generator plays
/// the two halves so (`F = B = W`, [`ScheduleKind::fill`]). Profiles time a backward whole.
pub const WEIGHT_SHARE: f64 = 0.5;

/// What a message between two stages costs.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Link {
    /// Seconds from a send to the first byte's arrival.
    pub latency: f64,
    /// Bytes per second (positive; infinite for a free link).
    pub bandwidth: f64,
    /// Bytes of each message: one piece's activation, or the gradient of one.
    pub message_bytes: f64,
}

impl Link {
    /// Messages arrive as they are sent.
    pub const INSTANT: Link = Link { latency: 0.0, bandwidth: f64::INFINITY, message_bytes: 0.0 };

    /// Seconds from a message's send to its arrival.
    pub fn message_time(&self) -> f64 {
        self.latency + self.message_bytes / self.bandwidth
    }
}

/// Seconds per micro-batch of each virtual stage, and the link between stages.
#[derive(Clone, Debug, PartialEq)]
pub struct CostModel {
    /// Per stage, a micro-batch's forward.
    pub forward: Vec<f64>,
    /// Per stage, a micro-batch's backward (under zero bubble its input-gradient part only).
    pub backward: Vec<f64>,
    /// Per stage, a micro-batch's put-off weight gradients (zero unless backwards are split).
    pub weights: Vec<f64>,
    /// Every message's cost.
    pub link: Link,
    /// Each token slice's share of its micro-batch's time ([`Plan::slice_shares`]: as TeraPipe's
    /// latency model measured it where it did, else by its share of the tokens; empty: `n`
    /// equal slices).
    pub slice_shares: Vec<f64>,
}

impl CostModel {
    /// The costs of `plan`'s stages from the profiles it was planned with: a stage's forward is
    /// the sum of its units' forwards, its backward the sum of its trainable units' backwards
    /// (a frozen unit runs forward only); under zero bubble [`WEIGHT_SHARE`] of it is put off.
    pub fn from_profiles(plan: &Plan, units: &[UnitProfile], link: Link) -> Result<CostModel> {
        let covered = plan.partition.stages.last().map_or(0, |r| r.end);
        if units.len() != covered {
            return Err(config_error(
                "profiles",
                format!("{} unit profiles for a plan of {covered} units", units.len()),
            ));
        }
        let per_stage = |cost: fn(&UnitProfile) -> f64| -> Vec<f64> {
            plan.partition.stages.iter().map(|r| units[r.clone()].iter().map(cost).sum()).collect()
        };
        let forward = per_stage(|u| u.forward);
        let backward = per_stage(|u| if u.trainable { u.backward } else { 0.0 });
        Ok(Self::split(plan, forward, backward, link))
    }

    /// The costs of `plan`'s stages from its partition alone (what a printed plan knows): each
    /// stage's forward, and the rest of its time as the backward.
    pub fn from_stage_times(plan: &Plan, link: Link) -> CostModel {
        let p = &plan.partition;
        let backward = p.stage_time.iter().zip(&p.stage_forward).map(|(t, f)| t - f).collect();
        Self::split(plan, p.stage_forward.clone(), backward, link)
    }

    /// Whole backwards, split into input and weight gradients where the plan's schedule runs
    /// them apart; token slices by their shares of the time.
    fn split(plan: &Plan, forward: Vec<f64>, backward: Vec<f64>, link: Link) -> CostModel {
        let share = if plan.schedule.kind == ScheduleKind::ZeroBubble { WEIGHT_SHARE } else { 0.0 };
        let weights = backward.iter().map(|b| b * share).collect();
        let backward = backward.iter().map(|b| b * (1.0 - share)).collect();
        CostModel { forward, backward, weights, link, slice_shares: plan.slice_shares() }
    }

    /// Seconds of compute action `action` (a piece is one of `slices` of its micro-batch, its
    /// share from `slice_shares`, else equal); `None` for an action that is not compute.
    fn compute_time(&self, action: &Action, slices: f64) -> Option<f64> {
        let (times, stage, piece) = match *action {
            Action::Forward { stage, piece } => (&self.forward, stage, piece),
            Action::Backward { stage, piece } => (&self.backward, stage, piece),
            Action::BackwardWeights { stage, piece } => (&self.weights, stage, piece),
            _ => return None,
        };
        let share = self.slice_shares.get(piece.slice).copied().unwrap_or(1.0 / slices);
        times.get(stage).map(|t| t * share)
    }
}

/// A simulated step.
#[derive(Clone, Debug, PartialEq)]
pub struct Simulation {
    /// Each device's compute spans (forwards, backwards, put-off weight gradients) in list
    /// order, and the step's makespan: the runtime's trace, as the cost model would measure it.
    pub trace: StepTrace,
    /// Per device, seconds spent computing.
    pub busy: Vec<f64>,
}

impl Simulation {
    /// Seconds from the step's start to its last compute's end (no tail: the optimizer costs
    /// nothing here).
    pub fn makespan(&self) -> f64 {
        self.trace.makespan
    }

    /// The idle fraction of `K · makespan`, by the measured bubble's own definition
    /// ([`StepTrace::bubble`]): `1 − Σ busy / (K · end of the pipelined part)`, transfers and
    /// waits counting as idle.
    pub fn bubble(&self) -> f64 {
        self.trace.bubble()
    }
}

/// Plays `schedule` against `costs`. Errors when the cost model has not one entry per stage or
/// an action names a stage it lacks, and on a deadlock (a receive whose message never comes):
/// the error names each blocked device's action.
pub fn simulate(schedule: &Schedule, costs: &CostModel) -> Result<Simulation> {
    let stages = [&costs.forward, &costs.backward, &costs.weights].map(|v| v.len());
    if stages.iter().any(|&n| n != schedule.stages) {
        return Err(config_error(
            "cost model",
            format!("stage costs {stages:?} for a schedule of {} stages", schedule.stages),
        ));
    }
    let lists = &schedule.per_device;
    let slices = schedule.slices.max(1) as f64;
    let transfer = costs.link.message_time();
    let mut next = vec![0usize; lists.len()];
    let mut clock = vec![0.0f64; lists.len()];
    let mut spans: Vec<Vec<Span>> = vec![Vec::new(); lists.len()];
    let mut arrival: HashMap<MessageKey, f64> = HashMap::new();
    // Each sweep runs every device until it waits; a sweep in which none moves is a deadlock.
    while next.iter().zip(lists).any(|(&i, list)| i < list.len()) {
        let mut moved = false;
        for (d, list) in lists.iter().enumerate() {
            while let Some(action) = list.get(next[d]) {
                match (action, action.message()) {
                    (Action::RecvActivation { .. } | Action::RecvGrad { .. }, Some((key, _))) => {
                        let Some(&at) = arrival.get(&key) else { break };
                        clock[d] = clock[d].max(at);
                    }
                    (_, Some((key, _))) => {
                        arrival.insert(key, clock[d] + transfer);
                    }
                    _ if action.is_compute() => {
                        let seconds = costs
                            .compute_time(action, slices)
                            .ok_or_else(|| schedule_error(d, next[d], action, "its stage has no cost".into()))?;
                        spans[d].push(Span { action: *action, start: clock[d], end: clock[d] + seconds });
                        clock[d] += seconds;
                    }
                    _ => {}
                }
                next[d] += 1;
                moved = true;
            }
        }
        if !moved {
            return Err(deadlock(schedule, &next));
        }
    }
    let busy = spans.iter().map(|s| s.iter().map(|s| s.end - s.start).sum()).collect();
    let makespan = spans.iter().flatten().map(|s| s.end).fold(0.0, f64::max);
    Ok(Simulation { trace: StepTrace { per_device: spans, makespan }, busy })
}

fn schedule_error(device: usize, position: usize, action: &Action, message: String) -> Error {
    Error::Schedule { device, position, action: format!("{action:?}"), message }
}

/// The error for lists stuck at `next`: the first blocked device's receive, and every one's.
fn deadlock(schedule: &Schedule, next: &[usize]) -> Error {
    let blocked: Vec<(usize, usize, &Action)> =
        next.iter().enumerate().filter_map(|(d, &i)| schedule.per_device[d].get(i).map(|a| (d, i, a))).collect();
    let all: Vec<String> = blocked.iter().map(|(d, i, a)| format!("device {d} at #{i} {a:?}")).collect();
    let message =
        format!("deadlock: every unfinished device waits for a message no device will send ({})", all.join("; "));
    match blocked.first() {
        Some(&(d, i, a)) => schedule_error(d, i, a, message),
        None => schedule_error(0, 0, &Action::OptimizerStep, message),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pipeline::{Piece, PipelineConfig};

    /// Every stage costs `f`, `b` and `w` per micro-batch.
    fn uniform(stages: usize, f: f64, b: f64, w: f64, link: Link) -> CostModel {
        CostModel {
            forward: vec![f; stages],
            backward: vec![b; stages],
            weights: vec![w; stages],
            link,
            slice_shares: Vec::new(),
        }
    }

    fn run(kind: ScheduleKind, k: usize, v: usize, m: usize, costs: &CostModel) -> Simulation {
        let s = Schedule::generate(kind, k, v, m, 1).unwrap();
        simulate(&s, costs).unwrap()
    }

    /// A unit with forward `f` and backward `2f`.
    fn unit(f: f64, trainable: bool) -> UnitProfile {
        UnitProfile {
            forward: f,
            backward: 2.0 * f,
            params: 10,
            activation_bytes: 100,
            trainable,
            ..Default::default()
        }
    }

    fn names(n: usize) -> Vec<String> {
        (0..n).map(|i| format!("u{i}")).collect()
    }

    fn plan(kind: ScheduleKind, k: usize, m: usize, slices: usize, units: &[UnitProfile]) -> Plan {
        let token_slices = if slices > 1 { vec![8; slices] } else { Vec::new() };
        let config =
            PipelineConfig { pipeline_len: k, micro_batches: m, schedule: kind, token_slices, ..Default::default() };
        Plan::new(config, units, names(units.len()), k, 0).unwrap()
    }

    /// F = 1, B = 2, free links: the first micro-batch takes `3K` down and back, and the other
    /// `M − 1` follow it at the pace of a stage's `3`. Wrong compute times, or receives that do
    /// not wait, change the makespan or the busy time.
    #[test]
    fn gpipe_and_one_f_one_b_take_3m_plus_3_k_minus_1() {
        for kind in [ScheduleKind::Gpipe, ScheduleKind::OneFOneB] {
            for (k, m) in [(1, 1), (2, 1), (2, 4), (3, 2), (4, 3), (4, 8), (5, 7)] {
                let sim = run(kind, k, 1, m, &uniform(k, 1.0, 2.0, 0.0, Link::INSTANT));
                let want = 3.0 * m as f64 + 3.0 * (k as f64 - 1.0);
                assert_eq!(sim.makespan(), want, "{kind} K={k} M={m}");
                assert!(sim.busy.iter().all(|&b| b == 3.0 * m as f64), "{kind} K={k} M={m}: {:?}", sim.busy);
                assert_eq!(sim.trace.per_device.iter().map(Vec::len).sum::<usize>(), 2 * k * m);
            }
        }
    }

    /// Zero bubble with F = B = W = 1 fills and drains in `K − 1` (schedule.rs's own test).
    /// Interleaving `v` chunks of F = 1, B = 2 fills and drains in `3(K−1)` chunk times, the
    /// formula's `(K−1)/(v·M + K−1)`, in the two small cases below; for K = 2, v = 2, M = 4 the
    /// generator's order (Megatron's warm-up plus one forward) takes one more, 28, hand-traced:
    /// device 1 runs F0.1 F1.1 F0.3 B0.3 F1.3 B1.3 B0.1 B1.1 before F2.1, so micro-batch 2
    /// reaches device 0's chunk 1 at 15, and the last backward B3.0 runs 26–28.
    #[test]
    fn zero_bubble_and_interleaved_shrink_the_fill_and_drain() {
        for (k, m) in [(2, 2), (2, 8), (3, 5), (4, 4), (4, 8)] {
            let sim = run(ScheduleKind::ZeroBubble, k, 1, m, &uniform(k, 1.0, 1.0, 1.0, Link::INSTANT));
            assert_eq!(sim.makespan(), (3 * m + k - 1) as f64, "zb-h1 K={k} M={m}");
            assert!(sim.busy.iter().all(|&b| b == 3.0 * m as f64), "zb-h1 K={k} M={m}: {:?}", sim.busy);
        }
        for (k, v, m, want) in [(2, 2, 2, 15.0), (3, 2, 3, 24.0), (2, 2, 4, 28.0)] {
            let sim = run(ScheduleKind::Interleaved, k, v, m, &uniform(k * v, 1.0, 2.0, 0.0, Link::INSTANT));
            assert_eq!(sim.makespan(), want, "interleaved K={k} v={v} M={m}");
        }
    }

    /// Equal stages, free links: the simulated bubble is the formula, by the plan and by the
    /// schedule.
    #[test]
    fn equal_stages_idle_as_the_formula_says() {
        for kind in [ScheduleKind::Gpipe, ScheduleKind::OneFOneB] {
            for (k, m) in [(2, 1), (2, 6), (3, 4), (4, 8), (5, 3)] {
                let p = plan(kind, k, m, 1, &vec![unit(1.5e-3, true); 2 * k]);
                let sim = simulate(
                    &p.schedule,
                    &CostModel::from_profiles(&p, &vec![unit(1.5e-3, true); 2 * k], Link::INSTANT).unwrap(),
                )
                .unwrap();
                assert!((sim.bubble() - p.schedule.bubble_formula()).abs() < 1e-12, "{kind} K={k} M={m}");
                assert!((sim.bubble() - p.predicted_bubble()).abs() < 1e-12, "{kind} K={k} M={m}");
            }
        }
    }

    /// Uneven stages: a micro-batch fills the pipeline at each stage's own speed, so GPipe takes
    /// `ΣF + ΣB + (M−1)·(max F + max B)` (a flow shop of identical jobs, forwards then
    /// backwards). `predicted_bubble` charges the fill and drain at the slowest stage's speed,
    /// `(M + K − 1)·max t`: exact only for equal stages, here `K·max t − Σ t` too long. A
    /// frozen unit adds its forward and no backward.
    #[test]
    fn uneven_stages_fill_at_each_stages_own_speed() {
        // Stages [frozen 1 + 1], [2], [1]: F = 2, 2, 1; B = 2, 4, 2; t = 4, 6, 3.
        let units = [unit(1.0, false), unit(1.0, true), unit(2.0, true), unit(1.0, true)];
        for m in [1, 3, 8] {
            let config = PipelineConfig {
                pipeline_len: 3,
                micro_batches: m,
                schedule: ScheduleKind::Gpipe,
                ..Default::default()
            };
            let p = Plan::with_stages(config, &units, names(4), 3, vec![0..2, 2..3, 3..4]).unwrap();
            assert_eq!(p.partition.stage_time, [4.0, 6.0, 3.0]);
            let sim = simulate(&p.schedule, &CostModel::from_profiles(&p, &units, Link::INSTANT).unwrap()).unwrap();
            let m = m as f64;
            assert_eq!(sim.makespan(), 5.0 + 8.0 + (m - 1.0) * (2.0 + 4.0), "M={m}");
            assert_eq!(sim.busy, [4.0 * m, 6.0 * m, 3.0 * m]);
            let predicted_step = (m + 2.0) * 6.0;
            let predicted = 1.0 - 13.0 * m / (3.0 * predicted_step);
            assert!((p.predicted_bubble() - predicted).abs() < 1e-12);
            assert!((predicted_step - sim.makespan() - (3.0 * 6.0 - 13.0)).abs() < 1e-12, "M={m}");
            assert!(sim.bubble() < p.predicted_bubble());
        }
    }

    /// Interleaved chunks of uneven times: a device's micro-batch takes its chunks' sum, not
    /// `v` times the slowest chunk, so the prediction is `M·max W + (K−1)·max t` (device 0's
    /// chunks 6 + 2, device 1's 2 + 2): nearer the simulated step than charging every chunk
    /// at the slowest, and no shorter.
    #[test]
    fn interleaved_chunks_are_charged_their_own_times() {
        let units = [unit(2.0, true), unit(2.0 / 3.0, true), unit(2.0 / 3.0, true), unit(2.0 / 3.0, true)];
        let config = PipelineConfig {
            pipeline_len: 2,
            micro_batches: 4,
            chunks: 2,
            schedule: ScheduleKind::Interleaved,
            ..Default::default()
        };
        let p = Plan::with_stages(config, &units, names(4), 2, vec![0..1, 1..2, 2..3, 3..4]).unwrap();
        let sim = simulate(&p.schedule, &CostModel::from_profiles(&p, &units, Link::INSTANT).unwrap()).unwrap();
        let (step, every_chunk_slowest) = (4.0 * 8.0 + 6.0, (4.0 * 2.0 + 1.0) * 6.0);
        let busy = 4.0 * 12.0;
        assert!((p.predicted_bubble() - (1.0 - busy / (2.0 * step))).abs() < 1e-9, "{}", p.predicted_bubble());
        assert!(sim.makespan() <= step + 1e-9 && step < every_chunk_slowest, "simulated {}", sim.makespan());
        assert!((step - sim.makespan()).abs() < (every_chunk_slowest - sim.makespan()).abs());
    }

    /// GPipe with equal stages and a link of `c = latency + bytes/bandwidth` per message: each
    /// of the `K − 1` activations and `K − 1` gradients on the first micro-batch's way down and
    /// back arrives `c` late, and the later micro-batches follow it back-to-back (a stage's
    /// next input arrives `F` after its previous one, as it finishes it), so the step grows by
    /// exactly `2(K−1)·c` whatever `M`.
    #[test]
    fn each_message_on_the_critical_path_adds_its_link_time() {
        let link = Link { latency: 0.25, bandwidth: 4e6, message_bytes: 1e6 };
        assert_eq!(link.message_time(), 0.5);
        for (k, m) in [(2, 1), (3, 1), (4, 1), (4, 3), (5, 6)] {
            let free = run(ScheduleKind::Gpipe, k, 1, m, &uniform(k, 1.0, 2.0, 0.0, Link::INSTANT));
            let linked = run(ScheduleKind::Gpipe, k, 1, m, &uniform(k, 1.0, 2.0, 0.0, link));
            assert_eq!(linked.makespan() - free.makespan(), 2.0 * (k as f64 - 1.0) * 0.5, "K={k} M={m}");
            assert_eq!(linked.busy, free.busy);
        }
    }

    /// A receive whose send was removed never completes: an error naming it, not a hang.
    #[test]
    fn a_receive_whose_send_is_gone_is_a_deadlock() {
        let mut s = Schedule::generate(ScheduleKind::OneFOneB, 3, 1, 4, 1).unwrap();
        let send = Action::SendActivation { piece: Piece::whole(2), stage: 1, to: 2 };
        s.per_device[1].retain(|a| *a != send);
        let e = simulate(&s, &uniform(3, 1.0, 2.0, 0.0, Link::INSTANT)).unwrap_err().to_string();
        assert!(e.contains("deadlock") && e.contains("device 2") && e.contains("RecvActivation"), "{e}");
        let e = simulate(&s, &uniform(2, 1.0, 2.0, 0.0, Link::INSTANT)).unwrap_err().to_string();
        assert!(e.contains("3 stages"), "{e}");
    }

    /// `n` equal slices: each piece takes `t/n`, so GPipe (TeraPipe's order) and 1F1B over
    /// slices fill and drain in `(K−1)·t/n` and take `(M·n + K − 1)·t/n`, as
    /// `predicted_bubble` says, for every K, M and n tried; 1F1B holding no more than `K − d`
    /// micro-batches' pieces on device `d` (its memory bound). (It once held `max(K − d, n)`
    /// pieces: device 0 then ran a micro-batch's backwards before the next one's forwards, and
    /// K = 2, M = 2, n = 2 took 6 slice times, not 5.)
    #[test]
    fn token_slices_shrink_the_fill_and_drain() {
        for k in 2..=4 {
            let units = vec![unit(1.0, true); k];
            for (m, n) in (1..=6).flat_map(|m| (1..=5).map(move |n| (m, n))) {
                for kind in [ScheduleKind::Gpipe, ScheduleKind::OneFOneB] {
                    let p = plan(kind, k, m, n, &units);
                    let costs = CostModel::from_profiles(&p, &units, Link::INSTANT).unwrap();
                    let sim = simulate(&p.schedule, &costs).unwrap();
                    let want = (m * n + k - 1) as f64 * 3.0 / n as f64;
                    let case = format!("{kind} K={k} M={m} n={n}");
                    assert!((sim.makespan() - want).abs() < 1e-12, "{case}: {}", sim.makespan());
                    assert!((sim.bubble() - p.predicted_bubble()).abs() < 1e-12, "{case}");
                    if kind == ScheduleKind::OneFOneB {
                        let peak = p.schedule.peak_in_flight();
                        assert!((0..k).all(|d| peak[d] <= (k - d).min(m) * n), "{case}: {peak:?}");
                    }
                }
            }
        }
    }

    /// Slices of unequal length take their share of the tokens' time. GPipe, K = 2, M = 1,
    /// F = 1 and B = 2 per stage, slices of 24 and 8 tokens (shares 3/4, 1/4), traced by hand:
    /// device 0 F0 0–0.75, F1 0.75–1; device 1 F0 0.75–1.5, F1 1.5–1.75, B1 1.75–2.25, B0
    /// 2.25–3.75; device 0 B1 2.25–2.75, B0 3.75–5.25. Equal slices of 16: 4.5.
    #[test]
    fn unequal_slices_take_their_share() {
        let units = vec![unit(1.0, true); 2];
        for (lengths, want) in [(vec![24, 8], 5.25), (vec![16, 16], 4.5)] {
            let config = PipelineConfig { pipeline_len: 2, token_slices: lengths.clone(), ..Default::default() };
            let p = Plan::new(config, &units, names(2), 2, 0).unwrap();
            for costs in [
                CostModel::from_profiles(&p, &units, Link::INSTANT).unwrap(),
                CostModel::from_stage_times(&p, Link::INSTANT),
            ] {
                let sim = simulate(&p.schedule, &costs).unwrap();
                assert!((sim.makespan() - want).abs() < 1e-12, "{lengths:?}: {}", sim.makespan());
                // The printed prediction knows the largest slice's share (it assumed 1/n).
                assert!((sim.bubble() - p.predicted_bubble()).abs() < 1e-12, "{lengths:?}");
                assert!((p.predicted_bubble() - p.bubble_formula()).abs() < 1e-12, "{lengths:?}");
            }
        }
    }

    /// Slices at their measured shares of the time: the second of two 16-token slices costs
    /// 0.75 of the whole micro-batch (its context), the first 0.5. 1F1B, K = 2, M = 1, F = 1
    /// and B = 2 per stage, traced by hand: forwards 0–0.5 and 0.5–1.25 on device 0, 0.5–1
    /// and 1.25–2 on device 1; backwards last slice first, 2–3.5 and 3.5–4.5 on device 1,
    /// 3.5–5 and 5–6 on device 0. By their tokens (the shares unset, or not one per slice):
    /// 4.5.
    #[test]
    fn measured_slice_times_take_their_measured_share() {
        let units = vec![unit(1.0, true); 2];
        let config = PipelineConfig { pipeline_len: 2, token_slices: vec![16, 16], ..Default::default() };
        let mut p = Plan::new(config, &units, names(2), 2, 0).unwrap();
        for (shares, want, measured) in [(vec![0.5, 0.75], 6.0, true), (vec![0.5], 4.5, false), (vec![], 4.5, false)] {
            p.slice_time_shares = shares.clone();
            assert_eq!(p.slice_times_measured(), measured);
            for costs in [
                CostModel::from_profiles(&p, &units, Link::INSTANT).unwrap(),
                CostModel::from_stage_times(&p, Link::INSTANT),
            ] {
                let sim = simulate(&p.schedule, &costs).unwrap();
                assert!((sim.makespan() - want).abs() < 1e-12, "{shares:?}: {}", sim.makespan());
                assert!((sim.bubble() - p.predicted_bubble()).abs() < 1e-12, "{shares:?}");
                assert!((p.predicted_bubble() - p.bubble_formula()).abs() < 1e-12, "{shares:?}");
            }
        }
        // Busy 2 × 1.25 × 3 of 2 × 6; the printed plan says the shares are measured.
        let note = "(token slices at their measured shares of a micro-batch's time: 1.25× it together)";
        assert!(!p.to_string().contains("measured shares"), "{p}");
        p.slice_time_shares = vec![0.5, 0.75];
        assert!((p.predicted_bubble() - 0.375).abs() < 1e-12, "{}", p.predicted_bubble());
        assert!(
            p.to_string().contains(&format!("predicted bubble 37.5% (formula for equal stages 37.5%) {note}")),
            "{p}"
        );
        assert!(p.to_string().contains("simulated: step 6000.000 ms, bubble 37.5%; unsliced, step 6000.000 ms"));
        // GPipe over three stages and two micro-batches: the same agreement.
        let units = vec![unit(1.0, true); 3];
        let config = PipelineConfig {
            pipeline_len: 3,
            micro_batches: 2,
            schedule: ScheduleKind::Gpipe,
            token_slices: vec![16, 16, 16],
            ..Default::default()
        };
        let mut p = Plan::new(config, &units, names(3), 3, 0).unwrap();
        p.slice_time_shares = vec![0.4, 0.5, 0.6];
        let sim = simulate(&p.schedule, &CostModel::from_stage_times(&p, Link::INSTANT)).unwrap();
        assert!((sim.bubble() - p.predicted_bubble()).abs() < 1e-12, "{} {}", sim.bubble(), p.predicted_bubble());
        assert!((p.predicted_bubble() - p.bubble_formula()).abs() < 1e-12);
    }

    /// A plan's own stage times give the costs the profiles give, a frozen prefix included
    /// (frozen units run forward only: their stage is mostly forward, not the 1 : 2 a trained
    /// one is).
    #[test]
    fn stage_times_split_as_the_profiles_do() {
        let mut units = vec![unit(1.0, false); 4];
        units.extend(vec![unit(1.0, true); 3]);
        let config = PipelineConfig { pipeline_len: 2, micro_batches: 8, ..Default::default() };
        let p = Plan::new(config, &units, names(units.len()), 2, 4).unwrap();
        let (a, b) = (
            CostModel::from_profiles(&p, &units, Link::INSTANT).unwrap(),
            CostModel::from_stage_times(&p, Link::INSTANT),
        );
        let close = |x: &[f64], y: &[f64]| x.iter().zip(y).all(|(x, y)| (x - y).abs() < 1e-12);
        assert!(close(&a.forward, &b.forward) && close(&a.backward, &b.backward), "{a:?} {b:?}");
        assert!(a.forward[0] > 2.0 * a.backward[0], "stage 0 is mostly forward: {a:?}");
    }

    /// The printed plan adds the simulated step (from the stage times) after the prediction;
    /// zero bubble puts half of each backward off.
    #[test]
    fn a_printed_plan_shows_the_simulated_step() {
        let units = vec![unit(1e-3, true); 6];
        let text = plan(ScheduleKind::OneFOneB, 3, 4, 1, &units).to_string();
        assert!(
            text.contains("predicted bubble 33.3%") && text.contains("\nsimulated: step 36.000 ms, bubble 33.3%\n"),
            "{text}"
        );
        let zb = plan(ScheduleKind::ZeroBubble, 3, 4, 1, &units);
        let costs = CostModel::from_profiles(&zb, &units, Link::INSTANT).unwrap();
        let from_times = CostModel::from_stage_times(&zb, Link::INSTANT);
        for (a, b) in [(&costs.forward, &from_times.forward), (&costs.backward, &from_times.backward)] {
            assert!(a.iter().zip(b).all(|(a, b)| (a - 2e-3).abs() < 1e-15 && (b - 2e-3).abs() < 1e-15), "{a:?} {b:?}");
        }
        assert_eq!(costs.weights, costs.backward);
        assert!(zb.to_string().contains("simulated: step 28.000 ms"), "{zb}");
        assert!(
            CostModel::from_profiles(&zb, &units[..5], Link::INSTANT)
                .unwrap_err()
                .to_string()
                .contains("5 unit profiles")
        );
    }
}
