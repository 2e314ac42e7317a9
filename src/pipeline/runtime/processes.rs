//! A pipeline whose stages are processes (`Pipeline::across_processes`): the `K·R` processes
//! of a [`ProcessGroup`] form `R` rows of `K`, and process `r·K + s` runs stage `s` of replica
//! `r`. Each row is a group of its own (split off the whole), whose ring links carry the
//! row's activations to the next process and gradients back to the previous one (a link
//! carries both directions; the ring's closing link serves an interleaved schedule's wrap),
//! as framed messages that a receiving thread per link drops into the local device's inbox,
//! where the worker waits for them as it waits for a local device's. Each column (one stage's
//! replicas) is another group, over which that stage's gradients are summed.
//!
//! A message is `[kind: u8][gradient: u8][micro-batch: u32][slice: u32][stage: u32][count:
//! u64][values]`, the values as they lie in memory (the group's members share the byte order).
//! After its worker is done, a process sends `END` on each link it sent messages on, and a step
//! is over for a link's reader when that arrives (links the schedule leaves idle are neither
//! read nor ended). A process whose step fails hangs up every link, so its
//! neighbours' readers fail at once (naming it) and their steps end with that error instead of
//! waiting out the group's timeout.

use super::mailbox::{Shared, Tag};
use super::{EvalOutput, Pipeline};
use crate::comm::process_group::ProcessGroup;
use crate::device::Device;
use crate::error::{Error, Result, config_error};
use crate::model::HostBatch;
use crate::pipeline::plan::Plan;
use crate::pipeline::schedule::{Action, MessageKey, Piece};
use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::Arc;

/// What a message carries.
const DATA: u8 = 0;
/// A gradient known to be zero (nothing follows the header's count of 0).
const ZERO: u8 = 1;
/// The sender's step is over on this link.
const END: u8 = 2;

/// Bytes of a message's header.
const HEADER: usize = 1 + 1 + 4 + 4 + 4 + 8;

/// This process's place in a pipeline of processes and its links to its neighbours.
pub(super) struct StageProcesses {
    /// This process's row: the `K` processes of its replica, ranked by stage.
    pub group: Arc<ProcessGroup>,
    /// Every process of the run (the row itself when there is one replica).
    pub all: Arc<ProcessGroup>,
    /// To the next rank (activations out, gradients in).
    next: TcpStream,
    /// From the previous rank (activations in, gradients out).
    prev: TcpStream,
}

impl StageProcesses {
    /// Process `rank` of the row `group` (split off `all`) running stage `rank`.
    pub fn new(group: Arc<ProcessGroup>, all: Arc<ProcessGroup>) -> Result<Self> {
        let (next, prev) = group
            .ring_links()?
            .ok_or_else(|| config_error("processes", "a pipeline across processes needs at least 2 stages"))?;
        Ok(StageProcesses { group, all, next, prev })
    }

    /// Hangs up every link of this process (its row's, and the whole group's), so no peer
    /// waits for it: a process whose step failed calls it.
    pub fn hang_up(&self) {
        self.group.hang_up();
        self.all.hang_up();
    }

    /// This process's stage (and its device's index in the plan).
    pub fn rank(&self) -> usize {
        self.group.rank()
    }

    /// The two links, each with the rank at its other end: to the next rank, from the previous.
    fn links(&self) -> [(&TcpStream, usize); 2] {
        let (me, size) = (self.rank(), self.group.size());
        [(&self.next, (me + 1) % size), (&self.prev, (me + size - 1) % size)]
    }

    /// Sends `data` for device `to`, which must be a neighbour's: on the link to the next rank
    /// when `to` is that rank, else on the other (the rule [`traffic`](Self::traffic) follows).
    pub fn send(&self, to: usize, key: Tag, data: Option<&[f32]>) -> Result<()> {
        let Some((link, _)) = self.links().into_iter().find(|(_, peer)| *peer == to) else {
            return Err(config_error(
                "processes",
                format!("stage {} cannot send to stage {to}: only neighbouring stages are linked", self.rank()),
            ));
        };
        let kind = if data.is_some() { DATA } else { ZERO };
        let values = data.unwrap_or(&[]);
        write_message(link, kind, key, values).map_err(|e| self.peer_error(to, &e))
    }

    /// Tells the neighbours this process sent messages to under `plan` that its step is over.
    pub fn end(&self, plan: &Plan) -> Result<()> {
        let key = MessageKey { gradient: false, piece: Piece::whole(0), stage: 0 };
        for ((link, peer), (sends, _)) in self.links().into_iter().zip(self.traffic(plan)) {
            if sends {
                write_message(link, END, key, &[]).map_err(|e| self.peer_error(peer, &e))?;
            }
        }
        Ok(())
    }

    /// The links this step's messages come in on, with the rank at the other end of each: a
    /// reader waits on those only (an idle link's reader would wait out the group's timeout
    /// on a long step), and each peer ends exactly the links it sends on ([`end`](Self::end)).
    pub fn incoming(&self, plan: &Plan) -> Vec<(&TcpStream, usize)> {
        let traffic = self.traffic(plan);
        self.links().into_iter().zip(traffic).filter(|(_, (_, arrives))| *arrives).map(|(link, _)| link).collect()
    }

    /// Per link (to the next rank, from the previous one): whether this process sends on it,
    /// and whether messages for it arrive on it, under `plan`'s schedule. A message from `a` to
    /// `b` goes on `a`'s link to the next rank when `b` is that rank, else on its other link,
    /// which is `b`'s other link.
    fn traffic(&self, plan: &Plan) -> [(bool, bool); 2] {
        let (me, size) = (self.rank(), self.group.size());
        let mut t = [(false, false); 2];
        for (from, actions) in plan.schedule.per_device.iter().enumerate() {
            for a in actions {
                let (Action::SendActivation { to, .. } | Action::SendGrad { to, .. }) = *a else { continue };
                let forward = to == (from + 1) % size; // on the sender's link to the next rank
                if from == me {
                    t[usize::from(!forward)].0 = true;
                }
                if to == me {
                    t[usize::from(forward)].1 = true;
                }
            }
        }
        t
    }

    /// Reads `link` (to process `peer`) into `shared`'s inbox of this process's device until
    /// the peer's `END`; a failed read fails the step, naming the peer.
    pub fn receive(&self, mut link: &TcpStream, peer: usize, shared: &Shared) {
        loop {
            match read_message(&mut link) {
                Ok(None) => return,
                Ok(Some((key, data))) => shared.put(self.rank(), key, data),
                Err(e) => {
                    if !shared.aborted() {
                        shared.fail(peer, self.peer_error(peer, &e));
                    }
                    return;
                }
            }
        }
    }

    /// Reads the next message from the previous rank, which must be the hidden states `key`
    /// names (an evaluation's: the processes of a row take their batches in the same order).
    fn receive_hidden(&self, key: MessageKey) -> Result<Vec<f32>> {
        let peer = (self.rank() + self.group.size() - 1) % self.group.size();
        match read_message(&mut &self.prev).map_err(|e| self.peer_error(peer, &e))? {
            Some((got, Some(data))) if got == key => Ok(data),
            got => Err(Error::Device {
                what: "pipeline across processes".into(),
                message: format!(
                    "rank {} sent {:?} where hidden states {key:?} were due",
                    self.group.outer_rank(peer),
                    got.map(|(k, _)| k)
                ),
            }),
        }
    }

    /// An error on the link to stage `peer`, naming its process by its rank in the run.
    fn peer_error(&self, peer: usize, e: &std::io::Error) -> Error {
        let (why, rank) = (crate::comm::process_group::closed(e), self.group.outer_rank(peer));
        Error::Device { what: "pipeline across processes".into(), message: format!("rank {rank}: {why}") }
    }
}

impl<D: Device> Pipeline<D> {
    /// [`evaluate_all`](Pipeline::evaluate_all) when the stages are processes `p`: the row's
    /// processes all take the same batches from `next`, and each runs its own stages on every
    /// one (no dropout, nothing saved), the hidden states passing to the next process over
    /// the row's links; the last stage's process calls `each`. A process moves on to the next
    /// batch as soon as it has sent this one's, so the row works as a pipeline. Nobody needs
    /// another stage's weights.
    pub(super) fn evaluate_across(
        &self,
        p: &StageProcesses,
        next: &mut (dyn FnMut() -> Option<Result<HostBatch>> + Send),
        each: &mut dyn FnMut(&HostBatch, EvalOutput) -> Result<()>,
    ) -> Result<()> {
        let (k, own, end) = (self.plan.config.pipeline_len, p.rank(), self.unit_count());
        let last = self.stages[0].len() - 1;
        let key = |index: usize, stage: usize| MessageKey { gradient: false, piece: Piece::whole(index), stage };
        let mut index = 0;
        while let Some(host) = next() {
            let host = host?;
            if let Some(hidden) = &host.hidden {
                self.check_hidden(&host, hidden, self.frozen_prefix())?;
            }
            for s in (own..=last).step_by(k) {
                let x = match s {
                    0 => host.hidden.as_ref().map(|h| h.data.clone()),
                    _ => Some(p.receive_hidden(key(index, s - 1))?),
                };
                let (h, dev, batch) = self.stage_forward(0, s, &host, x, end)?;
                match s == last {
                    true => each(&host, self.eval_output(0, dev, &batch, &h)?)?,
                    false => p.send((s + 1) % k, key(index, s), Some(&dev.download(&h)?))?,
                }
            }
            index += 1;
        }
        Ok(())
    }
}

/// Checks that every process of `group` made the same `plan` for the same `units` (names and
/// parameter shapes): processes that read different configs or data would otherwise wait for
/// messages that never come, or receive activations of the wrong size. A collective.
pub(super) fn agree<D: crate::device::Device>(
    group: &ProcessGroup,
    plan: &Plan,
    units: &[crate::model::Unit<D>],
) -> Result<()> {
    let shapes: Vec<_> = units.iter().flat_map(crate::model::Unit::params).map(|p| (&p.name, &p.shape)).collect();
    if let Some(r) = first_disagreeing(group, plan_print(plan, shapes))? {
        group.hang_up();
        return Err(config_error(
            "processes",
            format!(
                "rank {r} planned a different model or pipeline than rank 0: do all processes read the same config, weights and data?"
            ),
        ));
    }
    Ok(())
}

/// A fingerprint of `plan` (its configuration and stages) and of `more`, to compare across
/// processes with [`first_disagreeing`].
pub(super) fn plan_print(plan: &Plan, more: impl std::hash::Hash) -> u64 {
    use std::hash::{Hash, Hasher};
    let mut h = std::hash::DefaultHasher::new();
    format!("{:?}", plan.config).hash(&mut h);
    plan.partition.stages.hash(&mut h);
    more.hash(&mut h);
    h.finish()
}

/// The first rank whose `print` differs from rank 0's, the same answer on every process: a
/// collective over `group`.
pub(super) fn first_disagreeing(group: &ProcessGroup, print: u64) -> Result<Option<usize>> {
    let all = group.all_gather_u64(&[print])?;
    Ok((1..all.len()).find(|&r| all[r] != all[0]))
}

fn write_message(mut link: &TcpStream, kind: u8, key: MessageKey, values: &[f32]) -> std::io::Result<()> {
    let mut head = Vec::with_capacity(HEADER);
    head.extend([kind, u8::from(key.gradient)]);
    for n in [key.piece.mb, key.piece.slice, key.stage] {
        head.extend((n as u32).to_le_bytes());
    }
    head.extend((values.len() as u64).to_le_bytes());
    link.write_all(&head)?;
    link.write_all(bytemuck::cast_slice(values))
}

/// One message: `None` at `END`, else its key and values (`None` for a zero gradient).
pub(crate) fn read_message(link: &mut impl Read) -> std::io::Result<Option<(MessageKey, Option<Vec<f32>>)>> {
    let mut head = [0u8; HEADER];
    link.read_exact(&mut head)?;
    let bad = |why: String| std::io::Error::new(std::io::ErrorKind::InvalidData, why);
    let u32_at = |i: usize| u32::from_le_bytes([head[i], head[i + 1], head[i + 2], head[i + 3]]) as usize;
    let key =
        MessageKey { gradient: head[1] != 0, piece: Piece { mb: u32_at(2), slice: u32_at(6) }, stage: u32_at(10) };
    let count = u64::from_le_bytes(head[14..22].try_into().map_err(|_| bad("header".into()))?);
    match head[0] {
        END => Ok(None),
        ZERO if count == 0 => Ok(Some((key, None))),
        DATA => {
            // The peer proved it knows the run's secret when the ring opened, so this is the
            // size of a real activation; still refuse what no model here could send, and grow
            // the buffer (doubling, from 1 Mi values, to exactly `count`) as the values arrive,
            // so a header that lies costs at most about twice the bytes that follow it.
            if count > 1 << 32 {
                return Err(bad(format!("a message of {count} values")));
            }
            let count = count as usize;
            let mut values: Vec<f32> = Vec::new();
            while values.len() < count {
                let at = values.len();
                let next = (2 * at).max(1 << 20).min(count);
                values.reserve_exact(next - at);
                values.resize(next, 0.0);
                link.read_exact(bytemuck::cast_slice_mut(&mut values[at..]))?;
            }
            Ok(Some((key, Some(values))))
        }
        kind => Err(bad(format!("a message of kind {kind} with {count} values"))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_read_back_as_written_and_bad_ones_are_refused() {
        let key = MessageKey { gradient: true, piece: Piece { mb: 3, slice: 1 }, stage: 2 };
        let (a, b) = {
            let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            let a = TcpStream::connect(l.local_addr().unwrap()).unwrap();
            (a, l.accept().unwrap().0)
        };
        write_message(&a, DATA, key, &[1.5, -0.0, f32::MAX]).unwrap();
        write_message(&a, ZERO, key, &[]).unwrap();
        write_message(&a, END, key, &[]).unwrap();
        let mut r = &b;
        let (k, v) = read_message(&mut r).unwrap().unwrap();
        assert_eq!(k, key);
        assert_eq!(
            v.unwrap().iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
            [1.5f32, -0.0, f32::MAX].map(f32::to_bits)
        );
        assert_eq!(read_message(&mut r).unwrap().unwrap(), (key, None));
        assert!(read_message(&mut r).unwrap().is_none());
        let mut junk = [7u8; HEADER];
        assert!(read_message(&mut &junk[..]).is_err(), "kind 7");
        junk[0] = ZERO;
        assert!(read_message(&mut &junk[..]).is_err(), "a zero gradient with values");
        assert!(read_message(&mut &junk[..5]).is_err(), "cut short");
    }
}
