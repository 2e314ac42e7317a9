//! The schedule IR: per device, the ordered list of actions one pipelined training step runs
//! (forward and backward of a piece through a stage, sends and receives of activations and
//! gradients, the start of a stage's gradient all-reduce, the optimizer step), its generators
//! (GPipe, 1F1B, interleaved 1F1B, zero-bubble ZB-H1), and a validator that proves a schedule
//! complete and deadlock-free before it runs.
//!
//! A *piece* is one token slice of one micro-batch (TeraPipe; a micro-batch whose sequences are
//! not sliced is one piece). On a stage, slice `j` of a micro-batch runs forward after slice
//! `j−1` (it attends to the keys and values they left in the stage's arena) and backward after
//! slice `j+1` (whose backward adds into the gradients of slice `j`'s keys and values). GPipe over
//! pieces is TeraPipe's own order; 1F1B over pieces starts a piece's backward as soon as it can,
//! so stage `d` holds at most `K − d` micro-batches' pieces (every slice of each) instead of all
//! of them.
//!
//! Stages are *virtual*: with `v` chunks per device there are `S = K·v` stages and stage `s`
//! lives on device `s mod K` (Megatron's interleaving; `v = 1` is the plain pipeline).
//!
//! Zero bubble (Qi et al., 2024, schedule ZB-H1) splits a backward in two: `B`, the gradient of
//! the stage's input, which the stage below waits for, and `W`, the gradients of its weights,
//! which nobody waits for. `W` runs where the device would otherwise idle, so the pipeline's
//! fill and drain shrink from `(K−1)(F+B+W)` to `(K−1)(F+B−W)` while a device still holds at
//! most 1F1B's `K − d` pieces' activations; the pieces whose `W` is still due keep their
//! linear layers' inputs and output gradients (about as much again), and forwards wait while
//! `K + 1` of them are due.
//!
//! How schedules are generated: one list scheduler, four priority policies. The scheduler plays
//! the step in unit time (a forward costs 1, a backward 2, or 1 for `B` and 1 for `W` when split);
//! whenever a device is idle it starts the ready task its policy ranks first, subject to the
//! policy's cap on micro-batches in flight.
//! Each device's order of tasks in that play is its schedule, with the sends and receives its
//! tasks imply. Because the play itself completed, the orders are deadlock-free for *any* real
//! durations (sends are buffered; a receive waits for one tagged message), and any number of
//! micro-batches works, fewer than the stages or not a multiple of them included.

use crate::error::{Error, Result};
use serde::{Deserialize, Serialize};
use std::collections::{HashMap, HashSet};

/// One unit of pipelined work: token slice `slice` of micro-batch `mb` (slice 0 when the
/// sequences are not sliced).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct Piece {
    /// Micro-batch.
    pub mb: usize,
    /// Token slice of it.
    pub slice: usize,
}

impl Piece {
    /// Micro-batch `mb`, unsliced.
    pub fn whole(mb: usize) -> Self {
        Piece { mb, slice: 0 }
    }
}

impl std::fmt::Display for Piece {
    /// `3` for an unsliced micro-batch, `3/1` for its slice 1.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.slice == 0 { write!(f, "{}", self.mb) } else { write!(f, "{}/{}", self.mb, self.slice) }
    }
}

/// What names a message between stages, for the schedule, the validator and the mailboxes alike:
/// an activation (or the gradient of one), of one piece, produced by one stage.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct MessageKey {
    /// A gradient going back (else an activation going forward).
    pub gradient: bool,
    /// Whose.
    pub piece: Piece,
    /// The stage that produced it (see [`Action`]).
    pub stage: usize,
}

/// One step of a device's schedule. `stage` is a virtual stage; sends and receives name the
/// stage that *produced* the tensor: `SendActivation { stage: s }` carries stage `s`'s output to
/// stage `s+1`, `SendGrad { stage: s }` carries the gradient of stage `s`'s input to stage `s−1`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
#[allow(missing_docs)] // the fields (`piece`, `stage`, `to`, `from`) are described above
pub enum Action {
    /// Run `stage` forward on `piece`, keeping what its backward needs.
    Forward { piece: Piece, stage: usize },
    /// Run `stage` backward on `piece`, adding into its parameter gradients (under
    /// [`ScheduleKind::ZeroBubble`] only the input's gradient and the cheap ones: the linear
    /// layers' weight gradients wait for [`Action::BackwardWeights`]).
    Backward { piece: Piece, stage: usize },
    /// Add `piece`'s weight gradients of `stage`'s linear layers, put off by its backward
    /// (zero-bubble schedules only; a stage's in the order of its backwards).
    BackwardWeights { piece: Piece, stage: usize },
    /// Send `stage`'s output for `piece` to device `to` (buffered: never blocks).
    SendActivation { piece: Piece, stage: usize, to: usize },
    /// Receive `stage`'s output for `piece` from device `from` (blocks until it arrives).
    RecvActivation { piece: Piece, stage: usize, from: usize },
    /// Send the gradient of `stage`'s input for `piece` to device `to`.
    SendGrad { piece: Piece, stage: usize, to: usize },
    /// Receive the gradient of `stage`'s input for `piece` from device `from`.
    RecvGrad { piece: Piece, stage: usize, from: usize },
    /// `stage`'s gradients are final: start averaging them across replicas (overlaps the rest
    /// of the backward).
    AllReduce { stage: usize },
    /// Wait for this device's all-reduces, then update its parameters.
    OptimizerStep,
}

impl Action {
    /// Whether the action computes (a forward, a backward, or put-off weight gradients) rather
    /// than moves data or waits.
    pub fn is_compute(&self) -> bool {
        matches!(self, Action::Forward { .. } | Action::Backward { .. } | Action::BackwardWeights { .. })
    }

    /// A send's or a receive's message and the device at the other end.
    pub fn message(&self) -> Option<(MessageKey, usize)> {
        let key = |gradient, piece, stage| MessageKey { gradient, piece, stage };
        match *self {
            Action::SendActivation { piece, stage, to } => Some((key(false, piece, stage), to)),
            Action::RecvActivation { piece, stage, from } => Some((key(false, piece, stage), from)),
            Action::SendGrad { piece, stage, to } => Some((key(true, piece, stage), to)),
            Action::RecvGrad { piece, stage, from } => Some((key(true, piece, stage), from)),
            _ => None,
        }
    }
}

/// The schedule families.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum ScheduleKind {
    /// Fill-drain: every forward, then every backward (GPipe).
    Gpipe,
    /// One forward, one backward (PipeDream-Flush): at most `K − d` micro-batches in flight on
    /// device `d`.
    #[serde(rename = "1f1b", alias = "one-f-one-b")]
    OneFOneB,
    /// 1F1B over `v ≥ 2` model chunks per device (Megatron's interleaved schedule).
    Interleaved,
    /// 1F1B with each backward split into the input's gradient and the weights' (ZB-H1): the
    /// weights' run where the device would wait, with 1F1B's activations in flight (one chunk
    /// per device; no token slices).
    #[serde(rename = "zb-h1", alias = "zero-bubble")]
    ZeroBubble,
}

impl ScheduleKind {
    /// The fill and drain at each stage boundary, in micro-batch times of a stage: 1, or a third
    /// for zero bubble (`F + B − W` of `F + B + W` with the three equal).
    pub fn fill(self) -> f64 {
        if self == ScheduleKind::ZeroBubble { 1.0 / 3.0 } else { 1.0 }
    }
}

impl std::str::FromStr for ScheduleKind {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "gpipe" => Ok(ScheduleKind::Gpipe),
            "1f1b" | "one-f-one-b" => Ok(ScheduleKind::OneFOneB),
            "interleaved" => Ok(ScheduleKind::Interleaved),
            "zb-h1" | "zero-bubble" => Ok(ScheduleKind::ZeroBubble),
            _ => Err(crate::error::config_error(
                "schedule",
                format!("unknown schedule `{s}`; expected gpipe, 1f1b, interleaved or zb-h1"),
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
            ScheduleKind::ZeroBubble => "zb-h1",
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
    /// Token slices per micro-batch (1: unsliced).
    pub slices: usize,
    /// Each device's actions, in order.
    pub per_device: Vec<Vec<Action>>,
}

/// The device that runs virtual stage `stage` of a `devices`-long pipeline.
pub fn stage_device(stage: usize, devices: usize) -> usize {
    stage % devices
}

impl Schedule {
    /// Generates `kind` for `devices` devices, `chunks` model chunks per device (1 unless
    /// interleaved, ≥ 2 if so), `micro_batches` micro-batches of `slices` token slices each, and
    /// validates it.
    pub fn generate(
        kind: ScheduleKind,
        devices: usize,
        chunks: usize,
        micro_batches: usize,
        slices: usize,
    ) -> Result<Schedule> {
        let bad = |field: &str, message: String| Err(crate::error::config_error(field, message));
        if devices == 0 {
            return bad("devices", "a pipeline needs at least one device".into());
        }
        if micro_batches == 0 {
            return bad("micro_batches", "a step needs at least one micro-batch; got 0".into());
        }
        if slices == 0 {
            return bad("pipeline.token_slices", "a micro-batch is at least one slice; got 0".into());
        }
        if slices > 1 && matches!(kind, ScheduleKind::Interleaved | ScheduleKind::ZeroBubble) {
            return bad(
                "pipeline.token_slices",
                format!("the {kind} schedule does not run token slices; use gpipe or 1f1b"),
            );
        }
        match (kind, chunks) {
            (ScheduleKind::Interleaved, c) if c < 2 => {
                return bad("chunks", format!("interleaved needs at least 2 chunks per device; got {c}"));
            }
            (ScheduleKind::Gpipe | ScheduleKind::OneFOneB | ScheduleKind::ZeroBubble, c) if c != 1 => {
                return bad("chunks", format!("{kind} runs one chunk per device; got {c} (use interleaved)"));
            }
            _ => {}
        }
        let order = list_schedule(kind, devices, devices * chunks, micro_batches, slices)?;
        let schedule = Schedule {
            kind,
            devices,
            stages: devices * chunks,
            micro_batches,
            slices,
            per_device: order.iter().map(|tasks| with_communication(tasks, devices, devices * chunks)).collect(),
        };
        schedule.validate()?;
        Ok(schedule)
    }

    /// Chunks (virtual stages) per device.
    pub fn chunks(&self) -> usize {
        self.stages / self.devices
    }

    /// The pieces of a step, micro-batch by micro-batch, slice by slice.
    pub fn pieces(&self) -> impl Iterator<Item = Piece> + '_ {
        (0..self.micro_batches).flat_map(move |mb| (0..self.slices).map(move |slice| Piece { mb, slice }))
    }

    /// The idle fraction of a step with equal stage times (no communication) that the schedule
    /// implies: `(K−1)/(v·M·n + K−1)` for `n` equal slices (GPipe's convention: idle time over the
    /// whole step; 1F1B has GPipe's bubble, interleaving divides the fill/drain by `v`). Zero
    /// bubble with `F = B = W` idles `(K−1)·(F+B−W)` of `M·n·(F+B+W)`: `(K−1)/(3·M·n + K−1)`.
    pub fn bubble_formula(&self) -> f64 {
        let (fill, v) = (self.kind.fill() * (self.devices as f64 - 1.0), self.chunks() as f64);
        let units = (self.micro_batches * self.slices) as f64;
        fill / (v * units + fill)
    }

    /// Per stage, the most pieces it holds memory for at once: forwards run and not yet
    /// backwarded (their activations), and under zero bubble also backwards whose weight
    /// gradients are still due (their linear layers' inputs and output gradients, counted here as
    /// whole activations, which they about equal). What its activation memory scales with.
    pub fn peak_in_flight(&self) -> Vec<usize> {
        let split = self.kind == ScheduleKind::ZeroBubble;
        let mut peak = vec![0usize; self.stages];
        for list in &self.per_device {
            let mut live = vec![0usize; self.stages];
            for a in list {
                match *a {
                    Action::Forward { stage, .. } => {
                        live[stage] += 1;
                        peak[stage] = peak[stage].max(live[stage]);
                    }
                    Action::Backward { stage, .. } if !split => live[stage] -= 1,
                    Action::BackwardWeights { stage, .. } => live[stage] -= 1,
                    _ => {}
                }
            }
        }
        peak
    }

    /// Checks the schedule is complete and deadlock-free: every (piece, stage) runs forward once
    /// and backward once on its device, forward before backward, each after the inputs it needs
    /// (from the same device or a receive) and, for a token slice, after the previous slice's
    /// forward and the next slice's backward on that stage; every send has exactly one matching
    /// receive; all-reduces follow their stage's last backward and the optimizer step ends every
    /// list; and executing the lists with buffered sends and blocking receives finishes. Under
    /// zero bubble, every backward's weight gradients follow it on its device, a stage's in the
    /// order of its backwards (each linear layer keeps its put-off work in that order), and the
    /// all-reduce follows the last of them. The error names the first offending action.
    pub fn validate(&self) -> Result<()> {
        let (k, s_count, m, n) = (self.devices, self.stages, self.micro_batches, self.slices);
        let split = self.kind == ScheduleKind::ZeroBubble;
        let fail = |d: usize, i: usize, a: Option<&Action>, msg: String| Error::Schedule {
            device: d,
            position: i,
            action: a.map_or("(end of list)".into(), |a| format!("{a:?}")),
            message: msg,
        };
        if self.per_device.len() != k || s_count == 0 || s_count % k != 0 || n == 0 {
            return Err(fail(
                0,
                0,
                None,
                format!("{} action lists for {k} devices, {s_count} stages and {n} slices", self.per_device.len()),
            ));
        }
        // Messages sent: key → (from, to).
        let mut sent: HashMap<MessageKey, (usize, usize)> = HashMap::new();
        for (d, list) in self.per_device.iter().enumerate() {
            for (i, a) in list.iter().enumerate() {
                if let (Action::SendActivation { .. } | Action::SendGrad { .. }, Some((key, to))) = (a, a.message())
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
            // Zero bubble: per stage, the pieces backwarded and not yet through their weights.
            let mut weights_due: HashMap<usize, std::collections::VecDeque<Piece>> = HashMap::new();
            let mut weighted = HashSet::new();
            let mut have = HashSet::new(); // keys received
            let mut reduced = HashSet::new();
            let key = |gradient, piece, stage| MessageKey { gradient, piece, stage };
            for (i, a) in list.iter().enumerate() {
                let here = |stage: usize| stage < s_count && stage_device(stage, k) == d;
                let exists = |p: Piece| p.mb < m && p.slice < n;
                let ok: std::result::Result<(), String> = match *a {
                    Action::Forward { piece, stage } => {
                        let earlier = Piece { slice: piece.slice.wrapping_sub(1), ..piece };
                        if !here(stage) || !exists(piece) {
                            Err(format!(
                                "stage {stage} (of {s_count}) / piece {piece} (of {m} × {n}) does not run on device {d}"
                            ))
                        } else if !forwarded.insert((piece, stage)) {
                            Err("runs twice".into())
                        } else if stage > 0
                            && !forwarded.contains(&(piece, stage - 1))
                            && !have.contains(&key(false, piece, stage - 1))
                        {
                            Err(format!("its input (stage {}'s output) has not been received", stage - 1))
                        } else if piece.slice > 0 && !forwarded.contains(&(earlier, stage)) {
                            Err(format!(
                                "runs before slice {}'s forward, whose keys and values it reads",
                                earlier.slice
                            ))
                        } else {
                            Ok(())
                        }
                    }
                    Action::Backward { piece, stage } => {
                        let later = Piece { slice: piece.slice + 1, ..piece };
                        if !here(stage) || !exists(piece) {
                            Err(format!("stage {stage} / piece {piece} does not run on device {d}"))
                        } else if !forwarded.contains(&(piece, stage)) {
                            Err("runs before its forward".into())
                        } else if !backwarded.insert((piece, stage)) {
                            Err("runs twice".into())
                        } else if stage + 1 < s_count
                            && !backwarded.contains(&(piece, stage + 1))
                            && !have.contains(&key(true, piece, stage + 1))
                        {
                            Err(format!("the gradient of its output (from stage {}) has not been received", stage + 1))
                        } else if later.slice < n && !backwarded.contains(&(later, stage)) {
                            Err(format!(
                                "runs before slice {}'s backward, which adds into its keys' and values' gradients",
                                later.slice
                            ))
                        } else {
                            if split {
                                weights_due.entry(stage).or_default().push_back(piece);
                            }
                            Ok(())
                        }
                    }
                    Action::BackwardWeights { piece, stage } => {
                        let due = weights_due.entry(stage).or_default();
                        if !split {
                            Err(format!("{} does not split backwards", self.kind))
                        } else if !here(stage) || !exists(piece) {
                            Err(format!("stage {stage} / piece {piece} does not run on device {d}"))
                        } else if !backwarded.contains(&(piece, stage)) {
                            Err("runs before its backward".into())
                        } else if due.front() != Some(&piece) {
                            Err(match due.front() {
                                Some(first) => format!("runs before piece {first}'s, whose backward ran first"),
                                None => "runs twice".into(),
                            })
                        } else {
                            due.pop_front();
                            weighted.insert((piece, stage));
                            Ok(())
                        }
                    }
                    Action::SendActivation { piece, stage, to } => {
                        if !forwarded.contains(&(piece, stage)) {
                            Err("sends an activation not computed yet".into())
                        } else if stage + 1 >= s_count || stage_device(stage + 1, k) != to {
                            Err(format!("stage {} does not run on device {to}", stage + 1))
                        } else {
                            Ok(())
                        }
                    }
                    Action::SendGrad { piece, stage, to } => {
                        if !backwarded.contains(&(piece, stage)) {
                            Err("sends a gradient not computed yet".into())
                        } else if stage == 0 || stage_device(stage - 1, k) != to {
                            Err(format!("stage {} does not run on device {to}", stage.wrapping_sub(1)))
                        } else {
                            Ok(())
                        }
                    }
                    Action::RecvActivation { from, .. } | Action::RecvGrad { from, .. } => {
                        let (key, _) = a.message().ok_or_else(|| fail(d, i, Some(a), "not a message".into()))?;
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
                        } else if self.pieces().any(|p| !backwarded.contains(&(p, stage))) {
                            Err("starts before the stage's last backward".into())
                        } else if split && self.pieces().any(|p| !weighted.contains(&(p, stage))) {
                            Err("starts before the stage's last weight gradients".into())
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
                for piece in self.pieces() {
                    if !forwarded.contains(&(piece, stage)) || !backwarded.contains(&(piece, stage)) {
                        return Err(fail(
                            d,
                            list.len(),
                            None,
                            format!("piece {piece} never runs stage {stage} both ways"),
                        ));
                    }
                    if split && !weighted.contains(&(piece, stage)) {
                        return Err(fail(
                            d,
                            list.len(),
                            None,
                            format!("piece {piece} never adds stage {stage}'s weight gradients"),
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
        if let Some((key, &(from, to))) = sent.iter().find(|(key, _)| !received.contains(*key)) {
            let what = if key.gradient { "gradient" } else { "activation" };
            return Err(fail(
                from,
                0,
                None,
                format!(
                    "the {what} of stage {}, piece {}, sent to device {to}, is never received",
                    key.stage, key.piece
                ),
            ));
        }
        self.check_deadlock_free()
    }

    /// Plays the lists with buffered sends and blocking receives; an error names each device's
    /// blocked action when no device can move.
    fn check_deadlock_free(&self) -> Result<()> {
        let mut pc = vec![0usize; self.devices];
        let mut delivered: HashSet<MessageKey> = HashSet::new();
        loop {
            let mut moved = false;
            for (d, list) in self.per_device.iter().enumerate() {
                while let Some(a) = list.get(pc[d]) {
                    match (a, a.message()) {
                        (Action::RecvActivation { .. } | Action::RecvGrad { .. }, Some((key, _)))
                            if !delivered.contains(&key) =>
                        {
                            break;
                        }
                        (Action::SendActivation { .. } | Action::SendGrad { .. }, Some((key, _))) => {
                            delivered.insert(key);
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
    F(Piece, usize),
    B(Piece, usize),
    /// The weight gradients a zero-bubble backward put off.
    W(Piece, usize),
}

/// Plays the step in unit time under `kind`'s policy; returns each device's compute tasks in
/// start order.
fn list_schedule(kind: ScheduleKind, k: usize, s_count: usize, m: usize, n: usize) -> Result<Vec<Vec<Task>>> {
    let chunks = s_count / k;
    // Pieces a device may hold in flight (forwards started minus backwards started). 1F1B over
    // slices holds 1F1B's `K − d` micro-batches, each all `n` of its slices: a micro-batch's
    // last slice must be forwarded before its backwards start, and the next micro-batches'
    // forwards must keep the stages below busy meanwhile (with fewer, each micro-batch paid
    // the whole fill and drain).
    let split = kind == ScheduleKind::ZeroBubble;
    let cap = |d: usize| -> usize {
        match kind {
            ScheduleKind::Gpipe => usize::MAX,
            // Zero bubble holds 1F1B's activations.
            ScheduleKind::OneFOneB | ScheduleKind::ZeroBubble => (k - d) * n,
            // Megatron's warm-up count plus the one forward of the first 1F1B pair.
            ScheduleKind::Interleaved => ((k - d - 1) * 2 + (chunks - 1) * k + 1).min(m * chunks),
        }
    };
    // Zero bubble: a forward waits while `K + 1` backwards' weight gradients are due on its
    // device (each keeps its linear layers' inputs and output gradients): room for every stage
    // to run its next forward and backward first and leave its weight gradients for the drain,
    // which shortens the fill and drain to `(K−1)·(F+B−W)`. (Zero bubble runs no token slices.)
    let weights_cap = |_: usize| -> usize { if split { k + 1 } else { usize::MAX } };
    // Lower ranks first. Backwards of one micro-batch go last slice first.
    let rank = |t: Task| -> (usize, usize, usize, usize) {
        let chunk = |s: usize| s / k;
        match (kind, t) {
            (ScheduleKind::Gpipe, Task::F(p, s)) => (0, p.mb, p.slice, s),
            (ScheduleKind::Gpipe, Task::B(p, s)) => (1, p.mb, n - p.slice, s_count - s),
            (ScheduleKind::OneFOneB | ScheduleKind::ZeroBubble, Task::B(p, _)) => (0, p.mb, n - p.slice, 0),
            (ScheduleKind::OneFOneB | ScheduleKind::ZeroBubble, Task::F(p, _)) => (1, p.mb, p.slice, 0),
            // Weight gradients only when nothing else can run, in the order of the backwards.
            (_, Task::W(p, _)) => (2, p.mb, n - p.slice, 0),
            // Micro-batches in groups of K, chunk by chunk inside a group (Megatron's order).
            (ScheduleKind::Interleaved, Task::B(p, s)) => (0, p.mb / k, chunks - 1 - chunk(s), p.mb % k),
            (ScheduleKind::Interleaved, Task::F(p, s)) => (1, p.mb / k, chunk(s), p.mb % k),
        }
    };
    const FORWARD_TIME: u64 = 1;
    // A whole backward costs two forwards; split, each half costs one.
    let backward_time: u64 = if split { 1 } else { 2 };
    const WEIGHTS_TIME: u64 = 1;
    let pieces: Vec<Piece> = (0..m).flat_map(|mb| (0..n).map(move |slice| Piece { mb, slice })).collect();
    let mut done: HashMap<Task, u64> = HashMap::new(); // finish times
    let mut busy_until = vec![0u64; k];
    let mut in_flight = vec![0usize; k];
    let mut weights_due = vec![0usize; k];
    let mut order: Vec<Vec<Task>> = vec![Vec::new(); k];
    let total = if split { 3 } else { 2 } * pieces.len() * s_count;
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
                .flat_map(|s| pieces.iter().flat_map(move |&p| [Task::F(p, s), Task::B(p, s), Task::W(p, s)]))
                .filter(|task| split || !matches!(task, Task::W(..)))
                .filter(|task| !started.contains(task))
                .filter(|&task| match task {
                    Task::F(p, s) => {
                        let earlier = Piece { slice: p.slice.wrapping_sub(1), ..p };
                        in_flight[d] < cap(d).saturating_add(slack)
                            && weights_due[d] < weights_cap(d).saturating_add(slack)
                            && (s == 0 || finished(Task::F(p, s - 1), &done))
                            && (p.slice == 0 || finished(Task::F(earlier, s), &done))
                    }
                    Task::B(p, s) => {
                        let later = Piece { slice: p.slice + 1, ..p };
                        finished(Task::F(p, s), &done)
                            && (s + 1 == s_count || finished(Task::B(p, s + 1), &done))
                            && (later.slice == n || finished(Task::B(later, s), &done))
                    }
                    Task::W(p, s) => finished(Task::B(p, s), &done),
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
                        if split {
                            weights_due[d] += 1;
                        }
                        backward_time
                    }
                    Task::W(..) => {
                        weights_due[d] -= 1;
                        WEIGHTS_TIME
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
            if slack >= pieces.len() * s_count {
                return Err(Error::Schedule {
                    device: 0,
                    position: order[0].len(),
                    action: "(generator)".into(),
                    message: format!(
                        "{kind} cannot schedule {m} micro-batches of {n} slices over {s_count} stages on {k} devices"
                    ),
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
    // A stage's gradients are final after its last backward, or its last weight gradients
    // when the backwards are split.
    let split = tasks.iter().any(|t| matches!(t, Task::W(..)));
    let completes = |t: &Task| matches!((t, split), (Task::B(..), false) | (Task::W(..), true));
    let mut backwards_left: HashMap<usize, usize> = HashMap::new();
    for t in tasks.iter().filter(|t| completes(t)) {
        if let Task::B(_, s) | Task::W(_, s) = *t {
            *backwards_left.entry(s).or_default() += 1;
        }
    }
    for &t in tasks {
        match t {
            Task::F(piece, s) => {
                let d = stage_device(s, k);
                if s > 0 && stage_device(s - 1, k) != d {
                    out.push(Action::RecvActivation { piece, stage: s - 1, from: stage_device(s - 1, k) });
                }
                out.push(Action::Forward { piece, stage: s });
                if s + 1 < s_count && stage_device(s + 1, k) != d {
                    out.push(Action::SendActivation { piece, stage: s, to: stage_device(s + 1, k) });
                }
            }
            Task::B(piece, s) => {
                let d = stage_device(s, k);
                if s + 1 < s_count && stage_device(s + 1, k) != d {
                    out.push(Action::RecvGrad { piece, stage: s + 1, from: stage_device(s + 1, k) });
                }
                out.push(Action::Backward { piece, stage: s });
                if s > 0 && stage_device(s - 1, k) != d {
                    out.push(Action::SendGrad { piece, stage: s, to: stage_device(s - 1, k) });
                }
            }
            Task::W(piece, s) => out.push(Action::BackwardWeights { piece, stage: s }),
        }
        if let (true, Task::B(_, s) | Task::W(_, s)) = (completes(&t), t) {
            let left = backwards_left.entry(s).or_default();
            *left -= 1;
            if *left == 0 {
                out.push(Action::AllReduce { stage: s });
            }
        }
    }
    out.push(Action::OptimizerStep);
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pipeline::simulate::{CostModel, Link, simulate};

    const KINDS: [(ScheduleKind, usize); 5] = [
        (ScheduleKind::Gpipe, 1),
        (ScheduleKind::OneFOneB, 1),
        (ScheduleKind::Interleaved, 2),
        (ScheduleKind::Interleaved, 3),
        (ScheduleKind::ZeroBubble, 1),
    ];

    /// The time the lists take when every forward, backward and put-off weight gradient of
    /// every stage lasts `f`, `b` and `w`, with instant messages.
    fn makespan(s: &Schedule, f: f64, b: f64, w: f64) -> f64 {
        let costs = |t| vec![t; s.stages];
        let model = CostModel {
            forward: costs(f),
            backward: costs(b),
            weights: costs(w),
            link: Link::INSTANT,
            slice_shares: Vec::new(),
        };
        simulate(s, &model).unwrap().makespan()
    }

    /// ZB-H1: each backward's weight gradients follow it, a stage's in the order of its
    /// backwards, with 1F1B's activations in flight; with `F = B = W` the fill and drain take
    /// `(K−1)·(F+B−W)` instead of 1F1B's `(K−1)·(F+B+W)`, as the formula says.
    #[test]
    fn zero_bubble_fills_the_pipeline_with_weight_gradients() {
        for (k, m) in [(2, 8), (4, 8), (4, 3), (3, 1)] {
            let zb = Schedule::generate(ScheduleKind::ZeroBubble, k, 1, m, 1).unwrap();
            let one = Schedule::generate(ScheduleKind::OneFOneB, k, 1, m, 1).unwrap();
            // Held until the weight gradients: 1F1B's pieces, and the weight gradients' wait.
            let (held, whole) = (zb.peak_in_flight(), one.peak_in_flight());
            assert!(held.iter().zip(&whole).all(|(h, w)| h >= w && *h <= m), "K={k} M={m}: {held:?}");
            for list in &zb.per_device {
                let b = list.iter().filter(|a| matches!(a, Action::Backward { .. })).count();
                let w = list.iter().filter(|a| matches!(a, Action::BackwardWeights { .. })).count();
                assert_eq!((b, w), (m, m), "K={k} M={m}");
            }
            let split = makespan(&zb, 1.0, 1.0, 1.0);
            let whole = makespan(&one, 1.0, 2.0, 0.0);
            let (k, m) = (k as f64, m as f64);
            assert_eq!(whole, 3.0 * m + 3.0 * (k - 1.0), "1F1B K={k} M={m}");
            if m >= k {
                assert_eq!(split, 3.0 * m + (k - 1.0), "zb-h1 K={k} M={m}");
            }
            assert!(split < whole || k == 1.0, "K={k} M={m}: {split} vs {whole}");
        }
        let f = Schedule::generate(ScheduleKind::ZeroBubble, 4, 1, 8, 1).unwrap().bubble_formula();
        assert!(
            (f - 3.0 / 27.0).abs() < 1e-12,
            "pipelines.md §C.1: (p−1)/(3m) = 0.125 idle per busy, 3/27 of the time"
        );
        assert!(Schedule::generate(ScheduleKind::ZeroBubble, 2, 1, 2, 2).unwrap_err().to_string().contains("slices"));
        assert!(Schedule::generate(ScheduleKind::ZeroBubble, 2, 2, 2, 1).is_err(), "one chunk per device");
    }

    /// Put-off weight gradients must follow their backward, in its order, before the
    /// all-reduce, and only where the schedule splits backwards.
    #[test]
    fn validator_checks_the_weight_gradients() {
        let w = |mb| Action::BackwardWeights { piece: Piece::whole(mb), stage: 0 };
        let zb = Schedule::generate(ScheduleKind::ZeroBubble, 1, 1, 2, 1).unwrap();
        let at = |s: &Schedule, a: Action| s.per_device[0].iter().position(|x| *x == a).unwrap();
        let mut s = zb.clone();
        let w0 = at(&s, w(0));
        let w0 = s.per_device[0].remove(w0);
        let w1 = at(&s, w(1));
        s.per_device[0].insert(w1 + 1, w0);
        let e = s.validate().unwrap_err().to_string();
        assert!(e.contains("before piece 0's"), "{e}");
        let mut s = zb.clone();
        let w1 = at(&s, w(1));
        s.per_device[0].remove(w1);
        let e = s.validate().unwrap_err().to_string();
        assert!(e.contains("before the stage's last weight gradients"), "{e}");
        let mut s = zb.clone();
        let b0 = at(&s, Action::Backward { piece: Piece::whole(0), stage: 0 });
        s.per_device[0].insert(b0, w(0));
        let e = s.validate().unwrap_err().to_string();
        assert!(e.contains("before its backward"), "{e}");
        let mut s = Schedule::generate(ScheduleKind::OneFOneB, 1, 1, 1, 1).unwrap();
        s.per_device[0].insert(2, w(0));
        let e = s.validate().unwrap_err().to_string();
        assert!(e.contains("1f1b does not split backwards"), "{e}");
    }

    #[test]
    fn every_kind_is_valid_for_any_micro_batch_count_including_fewer_than_stages() {
        for (kind, v) in KINDS {
            for k in 1..=5 {
                for m in [1, 2, 3, 5, 8] {
                    let s = Schedule::generate(kind, k, v, m, 1)
                        .unwrap_or_else(|e| panic!("{kind} K={k} v={v} M={m}: {e}"));
                    assert_eq!(s.per_device.len(), k);
                }
            }
        }
    }

    #[test]
    fn gpipe_runs_every_forward_before_any_backward() {
        let s = Schedule::generate(ScheduleKind::Gpipe, 3, 1, 4, 1).unwrap();
        for list in &s.per_device {
            let last_f = list.iter().rposition(|a| matches!(a, Action::Forward { .. })).unwrap();
            let first_b = list.iter().position(|a| matches!(a, Action::Backward { .. })).unwrap();
            assert!(last_f < first_b);
        }
    }

    #[test]
    fn one_f_one_b_keeps_at_most_k_minus_d_micro_batches_in_flight() {
        let (k, m) = (4, 8);
        let s = Schedule::generate(ScheduleKind::OneFOneB, k, 1, m, 1).unwrap();
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
        assert_eq!(Schedule::generate(ScheduleKind::Gpipe, 3, 1, 5, 1).unwrap().peak_in_flight(), vec![5, 5, 5]);
        assert_eq!(Schedule::generate(ScheduleKind::OneFOneB, 3, 1, 5, 1).unwrap().peak_in_flight(), vec![3, 2, 1]);
        assert_eq!(Schedule::generate(ScheduleKind::OneFOneB, 3, 1, 2, 1).unwrap().peak_in_flight(), vec![2, 2, 1]);
    }

    #[test]
    fn bubble_formula_matches_the_reference_table() {
        // pipelines.md §C.1 worked numbers, GPipe convention: p=4, m=8 → 0.273; p=48, m=2 → 0.959.
        let f = |k, m| Schedule::generate(ScheduleKind::OneFOneB, k, 1, m, 1).unwrap().bubble_formula();
        assert!((f(4, 8) - 0.2727).abs() < 1e-3);
        assert!((f(8, 64) - 0.0986).abs() < 1e-3);
        let i = Schedule::generate(ScheduleKind::Interleaved, 4, 2, 8, 1).unwrap().bubble_formula();
        assert!((i - 3.0 / 19.0).abs() < 1e-12);
    }

    #[test]
    fn validator_names_the_offending_action() {
        let mut s = Schedule::generate(ScheduleKind::OneFOneB, 2, 1, 2, 1).unwrap();
        // Drop device 1's first receive: its forward now has no input.
        let i = s.per_device[1].iter().position(|a| matches!(a, Action::RecvActivation { .. })).unwrap();
        s.per_device[1].remove(i);
        let e = s.validate().unwrap_err().to_string();
        assert!(e.contains("device 1") && e.contains("Forward") && e.contains("not been received"), "{e}");

        // Swap device 0's backward before its forward.
        let mut s = Schedule::generate(ScheduleKind::Gpipe, 1, 1, 1, 1).unwrap();
        s.per_device[0].swap(0, 1);
        let e = s.validate().unwrap_err().to_string();
        assert!(e.contains("Backward") && e.contains("before its forward"), "{e}");
    }

    #[test]
    fn validator_finds_a_deadlock() {
        // Device 1 waits for micro-batch 1 before micro-batch 0, while device 0 sends micro-batch 1
        // only after receiving micro-batch 0's gradient: a cycle.
        let mut s = Schedule::generate(ScheduleKind::OneFOneB, 2, 1, 2, 1).unwrap();
        let list = &mut s.per_device[0];
        let send1 =
            list.iter().position(|a| *a == Action::SendActivation { piece: Piece::whole(1), stage: 0, to: 1 }).unwrap();
        let moved = list.remove(send1);
        let f1 = list.iter().position(|a| *a == Action::Forward { piece: Piece::whole(1), stage: 0 }).unwrap();
        let _ = f1;
        let recv0 =
            list.iter().position(|a| *a == Action::RecvGrad { piece: Piece::whole(0), stage: 1, from: 1 }).unwrap();
        list.insert(recv0 + 1, moved);
        let d1 = &mut s.per_device[1];
        let r0 =
            d1.iter().position(|a| *a == Action::RecvActivation { piece: Piece::whole(0), stage: 0, from: 0 }).unwrap();
        let r1 =
            d1.iter().position(|a| *a == Action::RecvActivation { piece: Piece::whole(1), stage: 0, from: 0 }).unwrap();
        d1.swap(r0, r1);
        let e = s.validate().unwrap_err().to_string();
        assert!(e.contains("device 1"), "{e}");
    }

    #[test]
    fn token_slices_run_in_order_under_gpipe_and_1f1b() {
        for kind in [ScheduleKind::Gpipe, ScheduleKind::OneFOneB] {
            for k in 1..=4 {
                for m in 1..=3 {
                    for n in [1, 2, 3, 5] {
                        let s = Schedule::generate(kind, k, 1, m, n)
                            .unwrap_or_else(|e| panic!("{kind} K={k} M={m} n={n}: {e}"));
                        let peak = s.peak_in_flight();
                        for (d, &p) in peak.iter().enumerate() {
                            match kind {
                                // TeraPipe's order holds every piece.
                                ScheduleKind::Gpipe => assert_eq!(p, m * n, "K={k} M={m} n={n} device {d}"),
                                // 1F1B over slices: at most 1F1B's warm-up in micro-batches, every
                                // slice of each; at least one micro-batch's slices.
                                _ => {
                                    assert!((n..=(k - d).min(m) * n).contains(&p), "K={k} M={m} n={n} device {d}: {p}")
                                }
                            }
                        }
                    }
                }
            }
        }
        // With many micro-batches of few slices, 1F1B keeps far fewer pieces than GPipe.
        let one = Schedule::generate(ScheduleKind::OneFOneB, 4, 1, 8, 2).unwrap();
        assert_eq!(one.peak_in_flight()[0], 8);
        assert!((one.bubble_formula() - 3.0 / 19.0).abs() < 1e-12);
        assert!(Schedule::generate(ScheduleKind::Interleaved, 2, 2, 2, 2).unwrap_err().to_string().contains("slices"));
    }

    /// The partition counts a stage's key/value arenas (TeraPipe) by its pieces in flight:
    /// `⌈pieces / n⌉` micro-batches' worth of activations, a trained unit's arena among them
    /// and a frozen one's beside them (`UnitProfile::sliced`). That holds only while the stage
    /// never has more micro-batches open (first slice forwarded, slice 0 not yet backwarded:
    /// the arena's lifetime in the runtime) than that. 1F1B over slices caps pieces, not
    /// micro-batches, so it could start the next micro-batch's first slice while the oldest
    /// still holds its arena; its order prefers the oldest's backwards, and this checks that it
    /// never does.
    #[test]
    fn a_stage_opens_no_more_micro_batches_than_its_pieces_fill() {
        for kind in [ScheduleKind::Gpipe, ScheduleKind::OneFOneB] {
            for (k, m, n) in (1..=5).flat_map(|k| (1..=8).flat_map(move |m| (1..=6).map(move |n| (k, m, n)))) {
                let s = Schedule::generate(kind, k, 1, m, n).unwrap();
                let peak = s.peak_in_flight();
                for (d, list) in s.per_device.iter().enumerate() {
                    let (mut open, mut most) = (0usize, 0usize);
                    for a in list {
                        match *a {
                            Action::Forward { piece, .. } if piece.slice == 0 => {
                                open += 1;
                                most = most.max(open);
                            }
                            Action::Backward { piece, .. } if piece.slice == 0 => open -= 1,
                            _ => {}
                        }
                    }
                    assert_eq!(most, peak[d].div_ceil(n), "{kind} K={k} M={m} n={n} device {d}");
                }
            }
        }
    }

    #[test]
    fn validator_enforces_the_slice_order() {
        // One device, one micro-batch of two slices: forwards 0, 1, then backwards 1, 0.
        let mut s = Schedule::generate(ScheduleKind::Gpipe, 1, 1, 1, 2).unwrap();
        let list = &s.per_device[0];
        let f = |slice| Action::Forward { piece: Piece { mb: 0, slice }, stage: 0 };
        let b = |slice| Action::Backward { piece: Piece { mb: 0, slice }, stage: 0 };
        assert_eq!(&list[..4], &[f(0), f(1), b(1), b(0)]);
        s.per_device[0].swap(0, 1);
        let e = s.validate().unwrap_err().to_string();
        assert!(e.contains("before slice 0's forward"), "{e}");
        s.per_device[0].swap(0, 1);
        s.per_device[0].swap(2, 3);
        let e = s.validate().unwrap_err().to_string();
        assert!(e.contains("before slice 1's backward"), "{e}");
    }

    #[test]
    fn bad_counts_are_refused() {
        assert!(Schedule::generate(ScheduleKind::Gpipe, 2, 1, 2, 0).unwrap_err().to_string().contains("slice"));
        assert!(Schedule::generate(ScheduleKind::Gpipe, 2, 1, 0, 1).unwrap_err().to_string().contains("micro-batch"));
        assert!(Schedule::generate(ScheduleKind::Interleaved, 2, 1, 2, 1).is_err());
        assert!(Schedule::generate(ScheduleKind::OneFOneB, 2, 2, 2, 1).is_err());
        assert!(Schedule::generate(ScheduleKind::OneFOneB, 0, 1, 2, 1).is_err());
    }
}
