//! The schedule IR: per device, the ordered list of actions one pipelined training step runs
//! (forward and backward of a micro-batch through a stage, sends and receives of activations and
//! gradients, the start of a stage's gradient all-reduce, the optimizer step), its generators
//! (GPipe, 1F1B, interleaved 1F1B), and a validator that proves a schedule complete and
//! deadlock-free before it runs.
//!
//! Stages are *virtual*: with `v` chunks per device there are `S = K·v` stages and stage `s`
//! lives on device `s mod K` (Megatron's interleaving; `v = 1` is the plain pipeline).
//!
//! How schedules are generated: one list scheduler, three priority policies. The scheduler plays
//! the step in unit time (a forward costs 1, a backward 2); whenever a device is idle it starts
//! the ready task its policy ranks first, subject to the policy's cap on micro-batches in flight.
//! Each device's order of tasks in that play is its schedule, with the sends and receives its
//! tasks imply. Because the play itself completed, the orders are deadlock-free for *any* real
//! durations (sends are buffered; a receive waits for one tagged message), and any number of
//! micro-batches works, fewer than the stages or not a multiple of them included.

use crate::error::{Error, Result};
use serde::{Deserialize, Serialize};
use std::collections::{HashMap, HashSet};

/// One step of a device's schedule. `stage` is a virtual stage; sends and receives name the
/// stage that *produced* the tensor: `SendActivation { stage: s }` carries stage `s`'s output to
/// stage `s+1`, `SendGrad { stage: s }` carries the gradient of stage `s`'s input to stage `s−1`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
#[allow(missing_docs)] // the fields (`mb`, `stage`, `to`, `from`) are described above
pub enum Action {
    /// Run `stage` forward on micro-batch `mb`, keeping what its backward needs.
    Forward { mb: usize, stage: usize },
    /// Run `stage` backward on micro-batch `mb`, adding into its parameter gradients.
    Backward { mb: usize, stage: usize },
    /// Send `stage`'s output for `mb` to device `to` (buffered: never blocks).
    SendActivation { mb: usize, stage: usize, to: usize },
    /// Receive `stage`'s output for `mb` from device `from` (blocks until it arrives).
    RecvActivation { mb: usize, stage: usize, from: usize },
    /// Send the gradient of `stage`'s input for `mb` to device `to`.
    SendGrad { mb: usize, stage: usize, to: usize },
    /// Receive the gradient of `stage`'s input for `mb` from device `from`.
    RecvGrad { mb: usize, stage: usize, from: usize },
    /// `stage`'s gradients are final: start averaging them across replicas (overlaps the rest
    /// of the backward).
    AllReduce { stage: usize },
    /// Wait for this device's all-reduces, then update its parameters.
    OptimizerStep,
}

/// The schedule families.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum ScheduleKind {
    /// Fill-drain: every forward, then every backward (GPipe).
    Gpipe,
    /// One forward, one backward (PipeDream-Flush): at most `K − d` micro-batches in flight on
    /// device `d`.
    #[serde(alias = "1f1b")]
    OneFOneB,
    /// 1F1B over `v ≥ 2` model chunks per device (Megatron's interleaved schedule).
    Interleaved,
}

impl std::str::FromStr for ScheduleKind {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "gpipe" => Ok(ScheduleKind::Gpipe),
            "1f1b" | "one-f-one-b" => Ok(ScheduleKind::OneFOneB),
            "interleaved" => Ok(ScheduleKind::Interleaved),
            _ => Err(crate::error::config_error(
                "schedule",
                format!("unknown schedule `{s}`; expected gpipe, 1f1b or interleaved"),
            )),
        }
    }
}

impl std::fmt::Display for ScheduleKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            ScheduleKind::Gpipe => "gpipe",
            ScheduleKind::OneFOneB => "1f1b",
            ScheduleKind::Interleaved => "interleaved",
        })
    }
}

/// A complete schedule: `per_device[d]` is device `d`'s action list.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Schedule {
    /// The family it was generated as.
    pub kind: ScheduleKind,
    /// Devices in the pipeline (`K`).
    pub devices: usize,
    /// Virtual stages (`K·v`).
    pub stages: usize,
    /// Micro-batches per step (`M`).
    pub micro_batches: usize,
    /// Each device's actions, in order.
    pub per_device: Vec<Vec<Action>>,
}

/// The device that runs virtual stage `stage` of a `devices`-long pipeline.
pub fn stage_device(stage: usize, devices: usize) -> usize {
    stage % devices
}

impl Schedule {
    /// Generates `kind` for `devices` devices, `chunks` model chunks per device (1 unless
    /// interleaved, ≥ 2 if so) and `micro_batches` micro-batches, and validates it.
    pub fn generate(kind: ScheduleKind, devices: usize, chunks: usize, micro_batches: usize) -> Result<Schedule> {
        let bad = |field: &str, message: String| Err(crate::error::config_error(field, message));
        if devices == 0 {
            return bad("devices", "a pipeline needs at least one device".into());
        }
        if micro_batches == 0 {
            return bad("micro_batches", "a step needs at least one micro-batch; got 0".into());
        }
        match (kind, chunks) {
            (ScheduleKind::Interleaved, c) if c < 2 => {
                return bad("virtual_stages", format!("interleaved needs at least 2 chunks per device; got {c}"));
            }
            (ScheduleKind::Gpipe | ScheduleKind::OneFOneB, c) if c != 1 => {
                return bad("virtual_stages", format!("{kind} runs one chunk per device; got {c} (use interleaved)"));
            }
            _ => {}
        }
        let order = list_schedule(kind, devices, devices * chunks, micro_batches)?;
        let schedule = Schedule {
            kind,
            devices,
            stages: devices * chunks,
            micro_batches,
            per_device: order.iter().map(|tasks| with_communication(tasks, devices, devices * chunks)).collect(),
        };
        schedule.validate()?;
        Ok(schedule)
    }

    /// Chunks (virtual stages) per device.
    pub fn chunks(&self) -> usize {
        self.stages / self.devices
    }

    /// The idle fraction of a step with equal stage times (no communication) that the schedule
    /// implies: `(K−1)/(v·M + K−1)` (GPipe's convention: idle time over the whole step; 1F1B
    /// has GPipe's bubble, interleaving divides the fill/drain by `v`).
    pub fn bubble_formula(&self) -> f64 {
        let (k, m, v) = (self.devices as f64, self.micro_batches as f64, self.chunks() as f64);
        (k - 1.0) / (v * m + k - 1.0)
    }

    /// Per stage, the most micro-batches whose activations it holds at once (forwards run and
    /// not yet backwarded): what its activation memory scales with.
    pub fn peak_in_flight(&self) -> Vec<usize> {
        let mut peak = vec![0usize; self.stages];
        for list in &self.per_device {
            let mut live = vec![0usize; self.stages];
            for a in list {
                match *a {
                    Action::Forward { stage, .. } => {
                        live[stage] += 1;
                        peak[stage] = peak[stage].max(live[stage]);
                    }
                    Action::Backward { stage, .. } => live[stage] -= 1,
                    _ => {}
                }
            }
        }
        peak
    }

    /// Checks the schedule is complete and deadlock-free: every (micro-batch, stage) runs
    /// forward once and backward once on its device, forward before backward, each after the
    /// inputs it needs (from the same device or a receive); every send has exactly one matching
    /// receive; all-reduces follow their stage's last backward and the optimizer step ends every
    /// list; and executing the lists with buffered sends and blocking receives finishes. The
    /// error names the first offending action.
    pub fn validate(&self) -> Result<()> {
        let (k, s_count, m) = (self.devices, self.stages, self.micro_batches);
        let fail = |d: usize, i: usize, a: Option<&Action>, msg: String| Error::Schedule {
            device: d,
            position: i,
            action: a.map_or("(end of list)".into(), |a| format!("{a:?}")),
            message: msg,
        };
        if self.per_device.len() != k || s_count == 0 || s_count % k != 0 {
            return Err(fail(
                0,
                0,
                None,
                format!("{} action lists for {k} devices and {s_count} stages", self.per_device.len()),
            ));
        }
        // Messages sent, by (is_grad, mb, stage) → (from, to).
        let mut sent: HashMap<(bool, usize, usize), (usize, usize)> = HashMap::new();
        for (d, list) in self.per_device.iter().enumerate() {
            for (i, a) in list.iter().enumerate() {
                let key = match *a {
                    Action::SendActivation { mb, stage, to } => Some(((false, mb, stage), to)),
                    Action::SendGrad { mb, stage, to } => Some(((true, mb, stage), to)),
                    _ => None,
                };
                if let Some((key, to)) = key
                    && sent.insert(key, (d, to)).is_some()
                {
                    return Err(fail(d, i, Some(a), "sent twice".into()));
                }
            }
        }
        let mut received = HashSet::new();
        for (d, list) in self.per_device.iter().enumerate() {
            // What this device has done so far, to check each action's inputs.
            let mut forwarded = HashSet::new();
            let mut backwarded = HashSet::new();
            let mut have = HashSet::new(); // received (is_grad, mb, stage)
            let mut reduced = HashSet::new();
            for (i, a) in list.iter().enumerate() {
                let here = |stage: usize| stage < s_count && stage_device(stage, k) == d;
                let ok: std::result::Result<(), String> = match *a {
                    Action::Forward { mb, stage } => {
                        if !here(stage) || mb >= m {
                            Err(format!(
                                "stage {stage} (of {s_count}) / micro-batch {mb} (of {m}) does not run on device {d}"
                            ))
                        } else if !forwarded.insert((mb, stage)) {
                            Err("runs twice".into())
                        } else if stage > 0
                            && !forwarded.contains(&(mb, stage - 1))
                            && !have.contains(&(false, mb, stage - 1))
                        {
                            Err(format!("its input (stage {}'s output) has not been received", stage - 1))
                        } else {
                            Ok(())
                        }
                    }
                    Action::Backward { mb, stage } => {
                        if !here(stage) || mb >= m {
                            Err(format!("stage {stage} / micro-batch {mb} does not run on device {d}"))
                        } else if !forwarded.contains(&(mb, stage)) {
                            Err("runs before its forward".into())
                        } else if !backwarded.insert((mb, stage)) {
                            Err("runs twice".into())
                        } else if stage + 1 < s_count
                            && !backwarded.contains(&(mb, stage + 1))
                            && !have.contains(&(true, mb, stage + 1))
                        {
                            Err(format!("the gradient of its output (from stage {}) has not been received", stage + 1))
                        } else {
                            Ok(())
                        }
                    }
                    Action::SendActivation { mb, stage, to } => {
                        if !forwarded.contains(&(mb, stage)) {
                            Err("sends an activation not computed yet".into())
                        } else if stage + 1 >= s_count || stage_device(stage + 1, k) != to {
                            Err(format!("stage {} does not run on device {to}", stage + 1))
                        } else {
                            Ok(())
                        }
                    }
                    Action::SendGrad { mb, stage, to } => {
                        if !backwarded.contains(&(mb, stage)) {
                            Err("sends a gradient not computed yet".into())
                        } else if stage == 0 || stage_device(stage - 1, k) != to {
                            Err(format!("stage {} does not run on device {to}", stage.wrapping_sub(1)))
                        } else {
                            Ok(())
                        }
                    }
                    Action::RecvActivation { mb, stage, from } | Action::RecvGrad { mb, stage, from } => {
                        let key = (matches!(a, Action::RecvGrad { .. }), mb, stage);
                        match sent.get(&key) {
                            None => Err("no device sends this".into()),
                            Some(&(f, t)) if f != from || t != d => {
                                Err(format!("the matching send goes from device {f} to device {t}"))
                            }
                            _ if !received.insert(key) => Err("received twice".into()),
                            _ => {
                                have.insert(key);
                                Ok(())
                            }
                        }
                    }
                    Action::AllReduce { stage } => {
                        if !here(stage) {
                            Err(format!("stage {stage} does not run on device {d}"))
                        } else if (0..m).any(|mb| !backwarded.contains(&(mb, stage))) {
                            Err("starts before the stage's last backward".into())
                        } else if !reduced.insert(stage) {
                            Err("runs twice".into())
                        } else {
                            Ok(())
                        }
                    }
                    Action::OptimizerStep => {
                        if i + 1 != list.len() {
                            Err("is not the last action".into())
                        } else {
                            Ok(())
                        }
                    }
                };
                ok.map_err(|msg| fail(d, i, Some(a), msg))?;
            }
            // Completeness of this device's part.
            for stage in (0..s_count).filter(|&s| stage_device(s, k) == d) {
                for mb in 0..m {
                    if !forwarded.contains(&(mb, stage)) || !backwarded.contains(&(mb, stage)) {
                        return Err(fail(
                            d,
                            list.len(),
                            None,
                            format!("micro-batch {mb} never runs stage {stage} both ways"),
                        ));
                    }
                }
                if !reduced.contains(&stage) {
                    return Err(fail(d, list.len(), None, format!("no all-reduce of stage {stage}")));
                }
            }
            if list.last() != Some(&Action::OptimizerStep) {
                return Err(fail(d, list.len(), None, "the list does not end with the optimizer step".into()));
            }
        }
        if let Some((&(grad, mb, stage), &(from, to))) = sent.iter().find(|(key, _)| !received.contains(*key)) {
            let what = if grad { "gradient" } else { "activation" };
            return Err(fail(
                from,
                0,
                None,
                format!("the {what} of stage {stage}, micro-batch {mb}, sent to device {to}, is never received"),
            ));
        }
        self.check_deadlock_free()
    }

    /// Plays the lists with buffered sends and blocking receives; an error names each device's
    /// blocked action when no device can move.
    fn check_deadlock_free(&self) -> Result<()> {
        let mut pc = vec![0usize; self.devices];
        let mut delivered: HashSet<(bool, usize, usize)> = HashSet::new();
        loop {
            let mut moved = false;
            for (d, list) in self.per_device.iter().enumerate() {
                while let Some(a) = list.get(pc[d]) {
                    match *a {
                        Action::RecvActivation { mb, stage, .. } if !delivered.contains(&(false, mb, stage)) => break,
                        Action::RecvGrad { mb, stage, .. } if !delivered.contains(&(true, mb, stage)) => break,
                        Action::SendActivation { mb, stage, .. } => {
                            delivered.insert((false, mb, stage));
                        }
                        Action::SendGrad { mb, stage, .. } => {
                            delivered.insert((true, mb, stage));
                        }
                        _ => {}
                    }
                    pc[d] += 1;
                    moved = true;
                }
            }
            if pc.iter().zip(&self.per_device).all(|(&p, l)| p == l.len()) {
                return Ok(());
            }
            if !moved {
                let blocked: Vec<String> = pc
                    .iter()
                    .enumerate()
                    .filter_map(|(d, &p)| self.per_device[d].get(p).map(|a| format!("device {d} at #{p} {a:?}")))
                    .collect();
                let d = pc.iter().zip(&self.per_device).position(|(&p, l)| p < l.len()).unwrap_or(0);
                return Err(Error::Schedule {
                    device: d,
                    position: pc[d],
                    action: format!("{:?}", self.per_device[d][pc[d]]),
                    message: format!("deadlock: every device waits ({})", blocked.join("; ")),
                });
            }
        }
    }
}

/// A compute task of the list scheduler.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum Task {
    F(usize, usize),
    B(usize, usize),
}

/// Plays the step in unit time under `kind`'s policy; returns each device's compute tasks in
/// start order.
fn list_schedule(kind: ScheduleKind, k: usize, s_count: usize, m: usize) -> Result<Vec<Vec<Task>>> {
    let chunks = s_count / k;
    // Micro-batches a device may hold in flight (forwards started minus backwards started).
    let cap = |d: usize| -> usize {
        match kind {
            ScheduleKind::Gpipe => usize::MAX,
            ScheduleKind::OneFOneB => k - d,
            // Megatron's warm-up count plus the one forward of the first 1F1B pair.
            ScheduleKind::Interleaved => ((k - d - 1) * 2 + (chunks - 1) * k + 1).min(m * chunks),
        }
    };
    // Lower ranks first.
    let rank = |t: Task| -> (usize, usize, usize, usize) {
        let chunk = |s: usize| s / k;
        match (kind, t) {
            (ScheduleKind::Gpipe, Task::F(mb, s)) => (0, mb, s, 0),
            (ScheduleKind::Gpipe, Task::B(mb, s)) => (1, mb, s_count - s, 0),
            (ScheduleKind::OneFOneB, Task::B(mb, _)) => (0, mb, 0, 0),
            (ScheduleKind::OneFOneB, Task::F(mb, _)) => (1, mb, 0, 0),
            // Micro-batches in groups of K, chunk by chunk inside a group (Megatron's order).
            (ScheduleKind::Interleaved, Task::B(mb, s)) => (0, mb / k, chunks - 1 - chunk(s), mb % k),
            (ScheduleKind::Interleaved, Task::F(mb, s)) => (1, mb / k, chunk(s), mb % k),
        }
    };
    const FORWARD_TIME: u64 = 1;
    const BACKWARD_TIME: u64 = 2;
    let mut done: HashMap<Task, u64> = HashMap::new(); // finish times
    let mut busy_until = vec![0u64; k];
    let mut in_flight = vec![0usize; k];
    let mut order: Vec<Vec<Task>> = vec![Vec::new(); k];
    let total = 2 * m * s_count;
    let mut started = HashSet::new();
    // Raised when the caps stall the play (interleaving with a micro-batch count that is not a
    // multiple of K can need one more micro-batch in flight than Megatron's warm-up count).
    let mut slack = 0usize;
    let mut t = 0u64;
    while done.len() < total {
        let finished = |task: Task, done: &HashMap<Task, u64>| done.get(&task).is_some_and(|&f| f <= t);
        for d in 0..k {
            if busy_until[d] > t {
                continue;
            }
            let ready = (0..s_count)
                .filter(|&s| stage_device(s, k) == d)
                .flat_map(|s| (0..m).flat_map(move |mb| [Task::F(mb, s), Task::B(mb, s)]))
                .filter(|task| !started.contains(task))
                .filter(|&task| match task {
                    Task::F(mb, s) => {
                        in_flight[d] < cap(d).saturating_add(slack) && (s == 0 || finished(Task::F(mb, s - 1), &done))
                    }
                    Task::B(mb, s) => {
                        finished(Task::F(mb, s), &done) && (s + 1 == s_count || finished(Task::B(mb, s + 1), &done))
                    }
                })
                .min_by_key(|&task| rank(task));
            if let Some(task) = ready {
                let time = match task {
                    Task::F(..) => {
                        in_flight[d] += 1;
                        FORWARD_TIME
                    }
                    Task::B(..) => {
                        in_flight[d] -= 1;
                        BACKWARD_TIME
                    }
                };
                started.insert(task);
                busy_until[d] = t + time;
                done.insert(task, t + time);
                order[d].push(task);
            }
        }
        if busy_until.iter().all(|&b| b <= t) && done.len() < total {
            // Nothing running and nothing could start: the caps stalled the play.
            if slack >= m * s_count {
                return Err(Error::Schedule {
                    device: 0,
                    position: order[0].len(),
                    action: "(generator)".into(),
                    message: format!("{kind} cannot schedule {m} micro-batches over {s_count} stages on {k} devices"),
                });
            }
            slack += 1;
            continue;
        }
        t += 1;
    }
    Ok(order)
}

/// A device's actions: its compute tasks with the receives they wait for, the sends they feed,
/// each stage's all-reduce right after its last backward, and the optimizer step.
fn with_communication(tasks: &[Task], k: usize, s_count: usize) -> Vec<Action> {
    let mut out = Vec::with_capacity(tasks.len() * 3 + 4);
    let mut backwards_left: HashMap<usize, usize> = HashMap::new();
    for &t in tasks {
        if let Task::B(_, s) = t {
            *backwards_left.entry(s).or_default() += 1;
        }
    }
    for &t in tasks {
        match t {
            Task::F(mb, s) => {
                let d = stage_device(s, k);
                if s > 0 && stage_device(s - 1, k) != d {
                    out.push(Action::RecvActivation { mb, stage: s - 1, from: stage_device(s - 1, k) });
                }
                out.push(Action::Forward { mb, stage: s });
                if s + 1 < s_count && stage_device(s + 1, k) != d {
                    out.push(Action::SendActivation { mb, stage: s, to: stage_device(s + 1, k) });
                }
            }
            Task::B(mb, s) => {
                let d = stage_device(s, k);
                if s + 1 < s_count && stage_device(s + 1, k) != d {
                    out.push(Action::RecvGrad { mb, stage: s + 1, from: stage_device(s + 1, k) });
                }
                out.push(Action::Backward { mb, stage: s });
                if s > 0 && stage_device(s - 1, k) != d {
                    out.push(Action::SendGrad { mb, stage: s, to: stage_device(s - 1, k) });
                }
                let left = backwards_left.entry(s).or_default();
                *left -= 1;
                if *left == 0 {
                    out.push(Action::AllReduce { stage: s });
                }
            }
        }
    }
    out.push(Action::OptimizerStep);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    const KINDS: [(ScheduleKind, usize); 4] = [
        (ScheduleKind::Gpipe, 1),
        (ScheduleKind::OneFOneB, 1),
        (ScheduleKind::Interleaved, 2),
        (ScheduleKind::Interleaved, 3),
    ];

    #[test]
    fn every_kind_is_valid_for_any_micro_batch_count_including_fewer_than_stages() {
        for (kind, v) in KINDS {
            for k in 1..=5 {
                for m in [1, 2, 3, 5, 8] {
                    let s =
                        Schedule::generate(kind, k, v, m).unwrap_or_else(|e| panic!("{kind} K={k} v={v} M={m}: {e}"));
                    assert_eq!(s.per_device.len(), k);
                }
            }
        }
    }

    #[test]
    fn gpipe_runs_every_forward_before_any_backward() {
        let s = Schedule::generate(ScheduleKind::Gpipe, 3, 1, 4).unwrap();
        for list in &s.per_device {
            let last_f = list.iter().rposition(|a| matches!(a, Action::Forward { .. })).unwrap();
            let first_b = list.iter().position(|a| matches!(a, Action::Backward { .. })).unwrap();
            assert!(last_f < first_b);
        }
    }

    #[test]
    fn one_f_one_b_keeps_at_most_k_minus_d_micro_batches_in_flight() {
        let (k, m) = (4, 8);
        let s = Schedule::generate(ScheduleKind::OneFOneB, k, 1, m).unwrap();
        for (d, list) in s.per_device.iter().enumerate() {
            let mut in_flight = 0i64;
            let mut peak = 0;
            for a in list {
                match a {
                    Action::Forward { .. } => in_flight += 1,
                    Action::Backward { .. } => in_flight -= 1,
                    _ => {}
                }
                peak = peak.max(in_flight);
            }
            assert_eq!(peak as usize, k - d, "device {d}");
        }
        // The last stage alternates strictly: F B F B ...
        let last: Vec<_> = s.per_device[k - 1]
            .iter()
            .filter(|a| matches!(a, Action::Forward { .. } | Action::Backward { .. }))
            .map(|a| matches!(a, Action::Forward { .. }))
            .collect();
        assert!(last.chunks(2).all(|p| p == [true, false]));
    }

    #[test]
    fn peak_in_flight_follows_the_schedule_family() {
        assert_eq!(Schedule::generate(ScheduleKind::Gpipe, 3, 1, 5).unwrap().peak_in_flight(), vec![5, 5, 5]);
        assert_eq!(Schedule::generate(ScheduleKind::OneFOneB, 3, 1, 5).unwrap().peak_in_flight(), vec![3, 2, 1]);
        assert_eq!(Schedule::generate(ScheduleKind::OneFOneB, 3, 1, 2).unwrap().peak_in_flight(), vec![2, 2, 1]);
    }

    #[test]
    fn bubble_formula_matches_the_reference_table() {
        // pipelines.md §C.1 worked numbers, GPipe convention: p=4, m=8 → 0.273; p=48, m=2 → 0.959.
        let f = |k, m| Schedule::generate(ScheduleKind::OneFOneB, k, 1, m).unwrap().bubble_formula();
        assert!((f(4, 8) - 0.2727).abs() < 1e-3);
        assert!((f(8, 64) - 0.0986).abs() < 1e-3);
        let i = Schedule::generate(ScheduleKind::Interleaved, 4, 2, 8).unwrap().bubble_formula();
        assert!((i - 3.0 / 19.0).abs() < 1e-12);
    }

    #[test]
    fn validator_names_the_offending_action() {
        let mut s = Schedule::generate(ScheduleKind::OneFOneB, 2, 1, 2).unwrap();
        // Drop device 1's first receive: its forward now has no input.
        let i = s.per_device[1].iter().position(|a| matches!(a, Action::RecvActivation { .. })).unwrap();
        s.per_device[1].remove(i);
        let e = s.validate().unwrap_err().to_string();
        assert!(e.contains("device 1") && e.contains("Forward") && e.contains("not been received"), "{e}");

        // Swap device 0's backward before its forward.
        let mut s = Schedule::generate(ScheduleKind::Gpipe, 1, 1, 1).unwrap();
        s.per_device[0].swap(0, 1);
        let e = s.validate().unwrap_err().to_string();
        assert!(e.contains("Backward") && e.contains("before its forward"), "{e}");
    }

    #[test]
    fn validator_finds_a_deadlock() {
        // Device 1 waits for micro-batch 1 before micro-batch 0, while device 0 sends micro-batch 1
        // only after receiving micro-batch 0's gradient: a cycle.
        let mut s = Schedule::generate(ScheduleKind::OneFOneB, 2, 1, 2).unwrap();
        let list = &mut s.per_device[0];
        let send1 = list.iter().position(|a| *a == Action::SendActivation { mb: 1, stage: 0, to: 1 }).unwrap();
        let moved = list.remove(send1);
        let f1 = list.iter().position(|a| *a == Action::Forward { mb: 1, stage: 0 }).unwrap();
        let _ = f1;
        let recv0 = list.iter().position(|a| *a == Action::RecvGrad { mb: 0, stage: 1, from: 1 }).unwrap();
        list.insert(recv0 + 1, moved);
        let d1 = &mut s.per_device[1];
        let r0 = d1.iter().position(|a| *a == Action::RecvActivation { mb: 0, stage: 0, from: 0 }).unwrap();
        let r1 = d1.iter().position(|a| *a == Action::RecvActivation { mb: 1, stage: 0, from: 0 }).unwrap();
        d1.swap(r0, r1);
        let e = s.validate().unwrap_err().to_string();
        assert!(e.contains("device 1"), "{e}");
    }

    #[test]
    fn bad_counts_are_refused() {
        assert!(Schedule::generate(ScheduleKind::Gpipe, 2, 1, 0).unwrap_err().to_string().contains("micro-batch"));
        assert!(Schedule::generate(ScheduleKind::Interleaved, 2, 1, 2).is_err());
        assert!(Schedule::generate(ScheduleKind::OneFOneB, 2, 2, 2).is_err());
        assert!(Schedule::generate(ScheduleKind::OneFOneB, 0, 1, 2).is_err());
    }
}
