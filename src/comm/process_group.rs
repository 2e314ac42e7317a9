//! A group of processes training one model together (`pipetransformer launch`): each holds its
//! own pipeline and runs its shard of every global batch; after the backward they sum their
//! gradients and losses here, so every process applies the same update.
//!
//! Gradients are summed over a ring ([`peers`](super::peers)): reduce-scatter, then all-gather,
//! each member sending one segment to the next rank while it reads another from the rank
//! before, so every link carries `2(P−1)/P` of the buffer each way whatever the group's size.
//! Partial sums travel as f32, as NCCL's do; each segment's sum runs in a fixed order and ends
//! copied to everyone, so every process holds bitwise the same result. The f64 sums (losses,
//! norms, evaluation tallies: small) go over the rendezvous links instead, a star where rank 0
//! adds them in rank order (in a group split off another, which has no star, every member's
//! values go round the ring and each adds them in rank order). Every read and write has the group's timeout, and a peer that dies closes its
//! sockets, so a dead process ends the others with an error naming it instead of a hang: its
//! neighbours see the end of file, fail, and hang up on theirs in turn.

use super::peers::{RingLinks, open_ring, open_rings};
use super::rendezvous::{Links, Secret, gather};
use crate::error::{Error, Result};
use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::Mutex;
use std::time::Duration;

/// Default time a collective waits for its peers (`PT_COLLECTIVE_TIMEOUT` seconds overrides).
pub const COLLECTIVE_TIMEOUT: Duration = Duration::from_secs(300);

/// This process's membership: its rank, the group's size, its connections.
pub struct ProcessGroup {
    rank: usize,
    size: usize,
    /// Each member's rank in the group this one was split from (itself when joined), to name
    /// peers the way the user numbered the processes.
    ranks: Vec<usize>,
    links: Mutex<Connections>,
    /// Handles on the same links, for [`hang_up`](Self::hang_up) from another thread (a
    /// watchdog's) while a collective holds `links` blocked on a stalled peer.
    hang_up: Vec<TcpStream>,
    /// What opening more rings needs ([`split`](Self::split)).
    secret: Secret,
    timeout: Duration,
}

/// The rendezvous links (the star: a joined group's; a split-off group has none) and the ring.
struct Connections {
    star: Option<Links>,
    ring: Option<RingLinks>,
}

impl Connections {
    fn streams(&self) -> Vec<&TcpStream> {
        let mut all = self.star.as_ref().map(Links::streams).unwrap_or_default();
        all.extend(self.ring.iter().flat_map(|r| [&r.next, &r.prev]));
        all
    }

    /// Sets the group's timeout on every link, and sends small messages at once; returns a
    /// second handle on each, to hang up with.
    fn configure(&self, timeout: Duration) -> Result<Vec<TcpStream>> {
        let mut handles = Vec::new();
        for s in self.streams() {
            s.set_read_timeout(Some(timeout)).map_err(|e| group_error(e.to_string()))?;
            s.set_write_timeout(Some(timeout)).map_err(|e| group_error(e.to_string()))?;
            s.set_nodelay(true).map_err(|e| group_error(e.to_string()))?;
            handles.push(s.try_clone().map_err(|e| group_error(e.to_string()))?);
        }
        Ok(handles)
    }
}

impl std::fmt::Debug for ProcessGroup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ProcessGroup {{ rank: {}, size: {} }}", self.rank, self.size)
    }
}

fn group_error(message: impl Into<String>) -> Error {
    Error::Device { what: "process group".into(), message: message.into() }
}

impl ProcessGroup {
    /// Joins the group of `size` processes meeting at `addr` as `rank` (see
    /// [`rendezvous::meet`](super::rendezvous::meet)); collectives then wait at most `timeout`
    /// for a peer.
    pub fn join(addr: &str, rank: usize, size: usize, secret: &Secret, timeout: Duration) -> Result<Self> {
        let (_, mut star) = gather(addr, rank, size, secret, Some(b"process group"), timeout)?;
        let ring = open_ring(&mut star, rank, size, secret, timeout)?;
        let links = Connections { star: Some(star), ring };
        let hang_up = links.configure(timeout)?;
        let (ranks, secret) = ((0..size).collect(), secret.clone());
        Ok(ProcessGroup { rank, size, ranks, links: Mutex::new(links), hang_up, secret, timeout })
    }

    /// Cuts the group into smaller ones, each with its own ring: `parts` (the same on every
    /// process) lists each part's members by rank here, in the order that becomes their rank
    /// there, and holds every rank once. Returns the part this process is in. A collective
    /// over this group (every member calls it at the same point); `label` tells one cut's
    /// rings from another's. Peers in the part are still named by their rank here. Only a
    /// joined group can be cut (its rendezvous links carry the addresses).
    pub fn split(&self, parts: &[Vec<usize>], label: &str) -> Result<ProcessGroup> {
        // Refused alike on every process (they pass the same parts), before any link opens.
        if parts.iter().map(Vec::len).sum::<usize>() != self.size {
            return Err(group_error(format!("{parts:?} do not hold each of the ranks 0..{} once", self.size)));
        }
        let mine = parts
            .iter()
            .find(|p| p.contains(&self.rank))
            .ok_or_else(|| group_error(format!("rank {} is in none of the parts {parts:?}", self.rank)))?;
        let ring = self.collective(|links| {
            let star = links.star.as_mut().ok_or_else(|| group_error("only a joined group can be split"))?;
            open_rings(star, self.rank, parts, label.as_bytes(), &self.secret, self.timeout)
        })?;
        let links = Connections { star: None, ring };
        let hang_up = links.configure(self.timeout)?;
        Ok(ProcessGroup {
            rank: mine.iter().position(|&m| m == self.rank).unwrap_or(0),
            size: mine.len(),
            ranks: mine.iter().map(|&m| self.ranks[m]).collect(),
            links: Mutex::new(links),
            hang_up,
            secret: self.secret.clone(),
            timeout: self.timeout,
        })
    }

    /// Member `rank`'s rank in the group this one was split from (its own rank in a joined group).
    pub fn outer_rank(&self, rank: usize) -> usize {
        self.ranks.get(rank).copied().unwrap_or(rank)
    }

    /// This process's rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// How long a collective waits for a peer.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// Processes in the group.
    pub fn size(&self) -> usize {
        self.size
    }

    /// Every process's `values` become the element-wise sum over the group, over the ring (see
    /// the module's notes): bitwise the same on every process.
    pub fn all_reduce_sum_f32(&self, values: &mut [f32]) -> Result<()> {
        self.collective(|links| match links.ring.as_mut() {
            Some(ring) => ring_all_reduce(ring, self.rank, self.size, values),
            None => Ok(()),
        })
    }

    /// Every process's `values[bounds[p]]` becomes process `p`'s: an all-gather over the ring,
    /// each process sending what it owns round once. `bounds` (one range per rank, disjoint,
    /// any of them empty) must be the same on every process; the values travel as they are, so the copies are
    /// exact.
    pub fn all_gather_f32(&self, values: &mut [f32], bounds: &[std::ops::Range<usize>]) -> Result<()> {
        check_bounds(self.size, values.len(), bounds)?;
        let n = self.size;
        self.collective(|links| match links.ring.as_mut() {
            Some(ring) => ring_pass(ring, self.rank, n, values, |k| bounds[k].clone(), 0, Land::Copy),
            None => Ok(()),
        })
    }

    /// Rank 0's `values[bounds[p]]` become process `p`'s `segment`, over the rendezvous links
    /// (a joined group's): what one process needs of everyone's, as a checkpoint does, without
    /// every process receiving everything. Every process passes its own segment (rank 0's
    /// lands in its range too); rank 0 also passes `values` and every rank's range (`bounds`,
    /// disjoint, any of them empty), which the others leave `None`. Exact, like
    /// [`all_gather_f32`](Self::all_gather_f32).
    pub fn gather_f32(&self, segment: &[f32], into: Option<(&mut [f32], &[std::ops::Range<usize>])>) -> Result<()> {
        if let Some((values, bounds)) = &into {
            check_bounds(self.size, values.len(), bounds)?;
            if bounds[self.rank].len() != segment.len() {
                return Err(group_error(format!(
                    "rank {} gathers a segment of {} values into a range of {}",
                    self.rank,
                    segment.len(),
                    bounds[self.rank].len()
                )));
            }
        }
        self.collective(|links| match (links.star.as_mut(), into) {
            (Some(Links::Hub(members)), Some((values, bounds))) => {
                values[bounds[0].clone()].copy_from_slice(segment);
                // Every member's range as its own slice, so that all are read at once: one
                // read after another would leave a late member's write waiting on rank 0 for
                // as long as the others' take, which for a large model on a slow link could
                // pass the group's timeout.
                let mut order: Vec<usize> = (1..self.size).collect();
                // As `check_bounds` orders them: an empty range before one that starts there.
                order.sort_by_key(|&r| (bounds[r].start, bounds[r].end));
                let mut slices: Vec<Option<&mut [f32]>> = (0..self.size).map(|_| None).collect();
                let (mut rest, mut at) = (&mut values[..], 0);
                for r in order {
                    let (_, tail) = std::mem::take(&mut rest).split_at_mut(bounds[r].start - at);
                    let (mine, tail) = tail.split_at_mut(bounds[r].len());
                    (rest, at, slices[r]) = (tail, bounds[r].end, Some(mine));
                }
                std::thread::scope(|s| {
                    let reads: Vec<_> = members
                        .iter_mut()
                        .zip(slices.into_iter().skip(1))
                        .enumerate()
                        .map(|(i, (m, into))| {
                            s.spawn(move || {
                                let into = into.unwrap_or_default();
                                read_segment(m, into.len(), into, Land::Copy).map_err(|e| peer_error(i + 1, e))
                            })
                        })
                        .collect();
                    let results: Vec<Result<()>> = reads
                        .into_iter()
                        .map(|h| h.join().unwrap_or_else(|_| Err(group_error("a reading thread panicked"))))
                        .collect();
                    results.into_iter().collect::<Result<()>>()
                })
            }
            (Some(Links::Spoke(hub)), None) => write_segment(hub, segment.len(), segment).map_err(|e| peer_error(0, e)),
            (None, _) => Err(group_error("only a joined group gathers to rank 0 (a split-off one has no links to it)")),
            (Some(_), _) => Err(group_error("rank 0, and only rank 0, passes the buffer a gather fills")),
        })
    }

    /// Handles on this process's two ring links, `(to the next rank, from the previous one)`,
    /// for point-to-point messages between collectives (a pipeline whose stages are processes
    /// sends activations forward on the first and gradients back on the second; TCP carries
    /// both directions). None in a group of one.
    pub fn ring_links(&self) -> Result<Option<(TcpStream, TcpStream)>> {
        let links = self.links.lock().unwrap_or_else(|e| e.into_inner());
        let Some(ring) = &links.ring else { return Ok(None) };
        let clone = |s: &TcpStream| s.try_clone().map_err(|e| group_error(e.to_string()));
        Ok(Some((clone(&ring.next)?, clone(&ring.prev)?)))
    }

    /// Hangs up every link of this process: the others' reads fail at once, so a process that
    /// gives up (a failed pipeline step) ends its peers' waits instead of leaving them to time
    /// out, and a collective of this process's blocked on a stalled peer fails at once.
    pub fn hang_up(&self) {
        for s in &self.hang_up {
            let _ = s.shutdown(std::net::Shutdown::Both);
        }
    }

    /// Every process's `values`, by rank, on every process: exact (each value travels as two
    /// 32-bit halves in slots of its own, summed over the group). The lists may differ in
    /// length between processes.
    pub fn all_gather_u64(&self, values: &[u64]) -> Result<Vec<Vec<u64>>> {
        let (rank, n) = (self.rank, self.size);
        let mut lens = vec![0.0; n];
        lens[rank] = values.len() as f64;
        self.all_reduce_sum_f64(&mut lens)?;
        let lens: Vec<usize> = lens.iter().map(|&l| l as usize).collect();
        let width = lens.iter().copied().max().unwrap_or(0);
        let mut all = vec![0.0; 2 * width * n];
        for (i, v) in values.iter().enumerate() {
            let at = 2 * (rank * width + i);
            (all[at], all[at + 1]) = (f64::from((v >> 32) as u32), f64::from(*v as u32));
        }
        self.all_reduce_sum_f64(&mut all)?;
        let value = |r: usize, i: usize| {
            let at = 2 * (r * width + i);
            ((all[at] as u64) << 32) | all[at + 1] as u64
        };
        Ok(lens.iter().enumerate().map(|(r, &len)| (0..len).map(|i| value(r, i)).collect()).collect())
    }

    /// Every process's `values` become the element-wise sum over the group, in rank order:
    /// over the star, or (a split-off group) every member's values gathered round the ring and
    /// added by each alike.
    pub fn all_reduce_sum_f64(&self, values: &mut [f64]) -> Result<()> {
        let (rank, n) = (self.rank, self.size);
        self.collective(|links| match (&mut links.star, &mut links.ring) {
            (Some(star), _) => Self::exchange(star, values),
            (None, Some(ring)) => {
                let len = values.len();
                let mut all = vec![0.0f64; n * len];
                all[rank * len..(rank + 1) * len].copy_from_slice(values);
                // Copied as bits (two f32 words per value), so the sums are every member's own.
                let words: &mut [f32] = bytemuck::cast_slice_mut(&mut all);
                ring_pass(ring, rank, n, words, |k| 2 * k * len..2 * (k + 1) * len, 0, Land::Copy)?;
                for (i, v) in values.iter_mut().enumerate() {
                    *v = (1..n).fold(all[i], |sum, k| sum + all[k * len + i]);
                }
                Ok(())
            }
            (None, None) => Ok(()),
        })
    }

    /// Runs one collective over the links; on failure hangs up on everyone.
    fn collective<T>(&self, f: impl FnOnce(&mut Connections) -> Result<T>) -> Result<T> {
        let mut links = self.links.lock().unwrap_or_else(|e| e.into_inner());
        let result = f(&mut links);
        if result.is_err() {
            // The group is broken: hang up on everyone now, so each peer fails at once with
            // "closed its connection" instead of waiting out its timeout.
            self.hang_up();
        }
        result
    }

    /// The star for f64: members send `values` to rank 0, which adds them in rank order and
    /// returns the sum to everyone.
    fn exchange(links: &mut Links, values: &mut [f64]) -> Result<()> {
        match links {
            Links::Hub(members) => {
                let mut sum = values.to_vec();
                for (i, peer) in members.iter_mut().enumerate() {
                    let theirs = receive(peer, values.len()).map_err(|e| peer_error(i + 1, e))?;
                    for (s, t) in sum.iter_mut().zip(theirs) {
                        *s += t;
                    }
                }
                let bytes = encode(&sum);
                for (i, peer) in members.iter_mut().enumerate() {
                    peer.write_all(&bytes).map_err(|e| peer_error(i + 1, closed(&e)))?;
                }
                values.copy_from_slice(&sum);
            }
            Links::Spoke(hub) => {
                hub.write_all(&encode(values)).map_err(|e| peer_error(0, closed(&e)))?;
                let sum = receive(hub, values.len()).map_err(|e| peer_error(0, e))?;
                values.copy_from_slice(&sum);
            }
        }
        Ok(())
    }
}

/// Refuses ranges for a gather that are not one per member, disjoint and within `len` values.
fn check_bounds(size: usize, len: usize, bounds: &[std::ops::Range<usize>]) -> Result<()> {
    let mut sorted: Vec<&std::ops::Range<usize>> = bounds.iter().collect();
    sorted.sort_by_key(|b| (b.start, b.end));
    let overlap = sorted.windows(2).any(|w| w[0].end > w[1].start);
    if bounds.len() != size || overlap || bounds.iter().any(|b| b.end > len || b.start > b.end) {
        return Err(group_error(format!(
            "a gather over {size} processes of {len} values was given the ranges {bounds:?}"
        )));
    }
    Ok(())
}

/// The values of segment `k` when `len` values are cut into `n`: the first `len % n` segments
/// one longer than the rest.
fn segment(len: usize, n: usize, k: usize) -> std::ops::Range<usize> {
    let (base, extra) = (len / n, len % n);
    let start = k * base + k.min(extra);
    start..start + base + usize::from(k < extra)
}

/// The ring all-reduce of `values` for member `rank` of `n` (n ≥ 2). Reduce-scatter: at step
/// `t` a member sends segment `rank − t` and adds the previous rank's segment `rank − t − 1`
/// into its own, so after `n − 1` steps it holds the whole sum of segment `rank + 1`.
/// All-gather: the finished segments go round once more, copied instead of added.
fn ring_all_reduce(ring: &mut RingLinks, rank: usize, n: usize, values: &mut [f32]) -> Result<()> {
    let len = values.len();
    ring_pass(ring, rank, n, values, |k| segment(len, n, k), 0, Land::Add)?;
    ring_pass(ring, rank, n, values, |k| segment(len, n, k), 1, Land::Copy)
}

/// One trip round the ring in `n − 1` steps: at step `t` member `rank` sends part
/// `rank + shift − t` of `values` (parts as `part` cuts them) and lands the previous rank's
/// part `rank + shift − t − 1`. With `shift` 0 each member starts from its own part (a
/// reduce-scatter when adding, an all-gather when copying); with 1, from the part a
/// reduce-scatter finished there.
fn ring_pass(
    ring: &mut RingLinks,
    rank: usize,
    n: usize,
    values: &mut [f32],
    part: impl Fn(usize) -> std::ops::Range<usize>,
    shift: usize,
    land: Land,
) -> Result<()> {
    let total = values.len();
    for t in 0..n - 1 {
        let (out, into) = ((rank + shift + n - t) % n, (rank + shift + 2 * n - t - 1) % n);
        swap(ring, total, values, part(out), part(into), land)?;
    }
    Ok(())
}

/// What a received segment does to the values already there.
#[derive(Clone, Copy)]
enum Land {
    Add,
    Copy,
}

/// Values read and added at a time (256 KiB: the sum runs in cache while the next ones arrive).
const CHUNK: usize = 1 << 16;

/// Sends `values[out]` to the next rank while the previous rank's segment lands in
/// `values[into]` (a different segment), both messages headed by the buffer's length and the
/// segment's, which must agree. The side that fails first hangs up the other's link, so
/// neither outlives it, and its error is the one returned: it names the peer that is gone,
/// where the other's is a consequence.
fn swap(
    ring: &mut RingLinks,
    total: usize,
    values: &mut [f32],
    out: std::ops::Range<usize>,
    into: std::ops::Range<usize>,
    land: Land,
) -> Result<()> {
    use std::sync::atomic::{AtomicU8, Ordering};
    const NONE: u8 = 0;
    const SEND: u8 = 1;
    const READ: u8 = 2;
    let (next, prev) = (ring.next_rank, ring.prev_rank);
    let link = |s: &TcpStream, peer| s.try_clone().map_err(|e| peer_error(peer, e.to_string()));
    let (next_link, prev_link) = (link(&ring.next, next)?, link(&ring.prev, prev)?);
    let first = AtomicU8::new(NONE);
    let failed = |side: u8, other: &TcpStream| {
        if first.compare_exchange(NONE, side, Ordering::AcqRel, Ordering::Acquire).is_ok() {
            let _ = other.shutdown(std::net::Shutdown::Both);
        }
    };
    // Two disjoint segments of one buffer (either may be empty): one read by the sender, one
    // written by the reader.
    let (sent_part, landing) = if out.end <= into.start {
        let (low, high) = values.split_at_mut(into.start);
        (&low[out], &mut high[..into.len()])
    } else {
        let (low, high) = values.split_at_mut(out.start);
        (&high[..out.len()], &mut low[into])
    };
    let RingLinks { next: to, prev: from, .. } = ring;
    std::thread::scope(|s| {
        let sent = s.spawn(|| write_segment(to, total, sent_part).inspect_err(|_| failed(SEND, &prev_link)));
        let got = read_segment(from, total, landing, land).inspect_err(|_| failed(READ, &next_link));
        let sent = sent.join().unwrap_or_else(|_| Err("the sending thread panicked".into()));
        match (sent, got, first.load(Ordering::Acquire)) {
            (Err(e), _, SEND) | (Err(e), Ok(()), _) => Err(peer_error(next, e)),
            (_, Err(e), _) => Err(peer_error(prev, e)),
            (Ok(()), Ok(()), _) => Ok(()),
        }
    })
}

/// `[total: u64 LE][count: u64 LE][values]`, the values as they lie in memory: no conversion
/// pass, since the members of a group share the byte order (every target this builds for is
/// little-endian).
fn write_segment(stream: &mut TcpStream, total: usize, values: &[f32]) -> std::result::Result<(), String> {
    let head = [(total as u64).to_le_bytes(), (values.len() as u64).to_le_bytes()].concat();
    stream.write_all(&head).map_err(|e| closed(&e))?;
    stream.write_all(bytemuck::cast_slice(values)).map_err(|e| closed(&e))
}

/// Reads a [`write_segment`] message into `into` (added to it or copied over it), refusing one
/// whose lengths are not ours before reading its values: the processes would be training
/// different models.
fn read_segment(stream: &mut TcpStream, total: usize, into: &mut [f32], land: Land) -> std::result::Result<(), String> {
    let mut head = [0u8; 16];
    stream.read_exact(&mut head).map_err(|e| closed(&e))?;
    let their_total = u64::from_le_bytes(head[..8].try_into().map_err(|_| "header")?);
    let count = u64::from_le_bytes(head[8..].try_into().map_err(|_| "header")?);
    if (their_total, count) != (total as u64, into.len() as u64) {
        return Err(format!(
            "sent {count} of {their_total} values, expected {} of {total} (do the processes train the same model?)",
            into.len()
        ));
    }
    match land {
        Land::Copy => stream.read_exact(bytemuck::cast_slice_mut(into)).map_err(|e| closed(&e)),
        Land::Add => {
            let mut theirs = vec![0f32; CHUNK.min(into.len())];
            for chunk in into.chunks_mut(CHUNK) {
                let theirs = &mut theirs[..chunk.len()];
                stream.read_exact(bytemuck::cast_slice_mut(theirs)).map_err(|e| closed(&e))?;
                for (v, x) in chunk.iter_mut().zip(theirs.iter()) {
                    *v += *x;
                }
            }
            Ok(())
        }
    }
}

/// Reads a message's count and refuses one that is not `count` (see [`receive`]).
fn read_count(stream: &mut TcpStream, count: usize) -> std::result::Result<(), String> {
    let mut head = [0u8; 8];
    stream.read_exact(&mut head).map_err(|e| closed(&e))?;
    let got = u64::from_le_bytes(head);
    if got != count as u64 {
        return Err(format!("sent {got} values, expected {count} (do the processes train the same model?)"));
    }
    Ok(())
}

fn peer_error(rank: usize, why: String) -> Error {
    group_error(format!("rank {rank}: {why}"))
}

/// `[count: u64 LE][values as f64 LE]`.
fn encode(values: &[f64]) -> Vec<u8> {
    let mut out = Vec::with_capacity(8 + values.len() * 8);
    out.extend_from_slice(&(values.len() as u64).to_le_bytes());
    for &v in values {
        out.extend_from_slice(&v.to_le_bytes());
    }
    out
}

/// Reads one message of exactly `count` values; a different count means the processes
/// disagree on the model (or a stranger is talking), and is refused before reading on.
fn receive(stream: &mut TcpStream, count: usize) -> std::result::Result<Vec<f64>, String> {
    read_count(stream, count)?;
    let mut bytes = vec![0u8; count * 8];
    stream.read_exact(&mut bytes).map_err(|e| closed(&e))?;
    Ok(bytes.chunks_exact(8).map(|b| f64::from_le_bytes([b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7]])).collect())
}

/// What an I/O error on a link to a peer means, in words: it is gone, or silent.
pub(crate) fn closed(e: &std::io::Error) -> String {
    match e.kind() {
        std::io::ErrorKind::UnexpectedEof
        | std::io::ErrorKind::ConnectionReset
        | std::io::ErrorKind::BrokenPipe
        | std::io::ErrorKind::ConnectionAborted => "closed its connection (the process ended or was killed)".into(),
        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => format!(
            "did not answer within the collective timeout (PT_COLLECTIVE_TIMEOUT seconds, default {})",
            COLLECTIVE_TIMEOUT.as_secs()
        ),
        _ => e.to_string(),
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// `size` members of one group on loopback, joined at once (each on its own thread).
    pub(crate) fn group(size: usize, timeout: Duration) -> Vec<ProcessGroup> {
        let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let (addr, secret) = (format!("127.0.0.1:{port}"), Secret::new("t").unwrap());
        std::thread::scope(|s| {
            let handles: Vec<_> = (0..size)
                .map(|r| {
                    let (addr, secret) = (&addr, &secret);
                    s.spawn(move || ProcessGroup::join(addr, r, size, secret, timeout).unwrap())
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        })
    }

    /// Runs `f` on every member at once; returns what each returned, in rank order.
    fn on_all<T: Send>(g: &[ProcessGroup], f: impl Fn(&ProcessGroup) -> T + Sync) -> Vec<T> {
        std::thread::scope(|s| {
            let handles: Vec<_> = g.iter().map(|m| s.spawn(|| f(m))).collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        })
    }

    /// The ring's sum of element `i`, as the ring adds it: in f32, starting at the rank whose
    /// number is the element's segment and going round.
    fn ring_order_sum(value: impl Fn(usize, usize) -> f32, len: usize, n: usize, i: usize) -> f32 {
        let k = (0..n).find(|&k| segment(len, n, k).contains(&i)).unwrap();
        (1..n).fold(value(k, i), |sum, step| sum + value((k + step) % n, i))
    }

    /// Segments of every length (empty ones when there are fewer values than members, and
    /// buffers of several socket buffers' length), summed in the ring's order to the bit, bitwise the same on
    /// every member; the f64 sums of the star in rank order.
    #[test]
    fn every_process_gets_the_same_sum_in_the_rings_order() {
        let value = |r: usize, i: usize| (i % 1000) as f32 * 1e-3 + r as f32 * 1e-7 + (i % 7) as f32 * 0.1;
        let long = 16 * CHUNK + 3; // several chunks per segment, and longer than a socket's buffers
        for (n, lens) in [(2, vec![0, 1, 5, long]), (3, vec![2, 7, 2 * CHUNK + 1]), (4, vec![3, 4, 1000, long])] {
            let g = group(n, Duration::from_secs(20));
            for &len in &lens {
                let got = on_all(&g, |m| {
                    let mut a: Vec<f32> = (0..len).map(|i| value(m.rank(), i)).collect();
                    m.all_reduce_sum_f32(&mut a).unwrap();
                    a
                });
                assert!(got.iter().all(|a| a == &got[0]), "{n} members, {len} values: bitwise the same everywhere");
                let probes = [0, 1, len / 2, CHUNK.saturating_sub(1), CHUNK, 2 * CHUNK, len.saturating_sub(1)];
                for i in probes.into_iter().filter(|&i| i < len) {
                    assert_eq!(got[0][i], ring_order_sum(value, len, n, i), "{n} members, {len} values, element {i}");
                }
            }
            let f64s = on_all(&g, |m| {
                let mut b = vec![0.1 * m.rank() as f64, 1.0];
                m.all_reduce_sum_f64(&mut b).unwrap();
                b
            });
            let want = (0..n).fold(0.0, |s, r| s + 0.1 * r as f64);
            assert!(f64s.iter().all(|b| b == &vec![want, n as f64]), "{f64s:?}");
        }
    }

    /// Every process gets every process's list, exact to the last bit of each u64, whatever
    /// the lists' lengths.
    #[test]
    fn every_process_gathers_every_list_exactly() {
        let g = group(3, Duration::from_secs(20));
        let list = |r: usize| -> Vec<u64> { (0..r + 1).map(|i| u64::MAX - (r * 7 + i) as u64).collect() };
        let got = on_all(&g, |m| m.all_gather_u64(&list(m.rank())).unwrap());
        let want: Vec<Vec<u64>> = (0..3).map(list).collect();
        assert!(got.iter().all(|all| all == &want), "{got:?}");
    }

    /// Six processes cut into rows of three and columns of two, as a pipeline of three stages
    /// with two replicas is: each part sums only its own members' values (f32 in the ring's
    /// order, f64 in rank order), bitwise alike on every member, and the parts' rings run at
    /// the same time without crossing.
    #[test]
    fn a_split_group_sums_within_each_part() {
        let g = group(6, Duration::from_secs(20));
        let rows: Vec<Vec<usize>> = (0..2).map(|r| (3 * r..3 * r + 3).collect()).collect();
        let columns: Vec<Vec<usize>> = (0..3).map(|s| vec![s, s + 3]).collect();
        let value = |world: usize, i: usize| (i % 13) as f32 * 0.37 + world as f32 * 1e-3;
        let len = 2 * CHUNK + 5;
        let got = on_all(&g, |m| {
            let row = m.split(&rows, "rows").unwrap();
            let column = m.split(&columns, "columns").unwrap();
            let world = m.rank();
            assert_eq!((row.rank(), row.size(), row.outer_rank(row.rank())), (world % 3, 3, world));
            assert_eq!((column.rank(), column.size()), (world / 3, 2));
            let mut a: Vec<f32> = (0..len).map(|i| value(world, i)).collect();
            row.all_reduce_sum_f32(&mut a).unwrap();
            let mut b: Vec<f32> = (0..len).map(|i| value(world, i)).collect();
            column.all_reduce_sum_f32(&mut b).unwrap();
            let mut c = vec![0.1 * world as f64, 1.0, f64::from(value(world, 1))];
            row.all_reduce_sum_f64(&mut c).unwrap();
            (a, b, c)
        });
        for (world, (a, b, c)) in got.iter().enumerate() {
            let (r, s) = (world / 3, world % 3);
            for i in [0, 1, CHUNK, len - 1] {
                let in_row = |k: usize, i: usize| value(3 * r + k, i);
                assert_eq!(a[i], ring_order_sum(in_row, len, 3, i), "rank {world}, element {i}: its row's sum");
                assert_eq!(b[i], value(s, i) + value(s + 3, i), "rank {world}, element {i}: its column's sum");
            }
            let want = (1..3).fold(0.1 * (3 * r) as f64, |sum, k| sum + 0.1 * (3 * r + k) as f64);
            assert_eq!(c[..2], [want, 3.0], "rank {world}: f64 in rank order");
            assert_eq!(a, &got[3 * r].0, "bitwise alike along the row");
            assert_eq!(c, &got[3 * r].2);
        }
        // Every rank once, or it is refused before any link opens.
        for bad in [vec![vec![0, 1], vec![1, 2, 3, 4, 5]], vec![vec![0, 1, 2]]] {
            let err = g[0].split(&bad, "bad").unwrap_err().to_string();
            assert!(err.contains("once"), "{err}");
        }
    }

    /// In a part, a dead peer is named by its rank in the whole group.
    #[test]
    fn a_dead_peer_in_a_part_is_named_by_its_rank_in_the_group() {
        let g = group(4, Duration::from_secs(10));
        let columns = [vec![0, 2], vec![1, 3]];
        let mut parts = on_all(&g, |m| m.split(&columns, "columns").unwrap());
        drop(parts.remove(3)); // rank 3, rank 1's only peer in its column, ends
        let err = parts[1].all_reduce_sum_f32(&mut [1.0; 8]).unwrap_err().to_string();
        assert!(err.contains("rank 3") && err.contains("closed its connection"), "{err}");
    }

    #[test]
    fn a_dead_peer_is_an_error_naming_it_not_a_hang() {
        let started = std::time::Instant::now();
        let mut g = group(3, Duration::from_secs(10));
        drop(g.pop()); // rank 2 ends
        let errors: Vec<String> = std::thread::scope(|s| {
            let handles: Vec<_> =
                g.iter().map(|m| s.spawn(move || m.all_reduce_sum_f32(&mut [1.0]).unwrap_err().to_string())).collect();
            let errors: Vec<String> = handles.into_iter().map(|h| h.join().unwrap()).collect();
            errors
        });
        assert!(errors[0].contains("rank 2") && errors[0].contains("closed its connection"), "{}", errors[0]);
        // Rank 1 learns it at once, well before the 10 s timeout: from writing to rank 2, or
        // from rank 0 hanging up.
        assert!(errors[1].contains("rank 2") || errors[1].contains("rank 0"), "{}", errors[1]);
        assert!(errors[1].contains("closed its connection"), "{}", errors[1]);
        assert!(started.elapsed() < Duration::from_secs(9), "nobody waited for the timeout");
    }

    /// Each rank's range reaches every rank exactly, empty ranges included (a position that
    /// owns nothing, first or last); overlapping ranges are refused before any byte moves.
    #[test]
    fn all_gather_copies_every_owners_range_even_empty_ones() {
        let g = group(3, Duration::from_secs(20));
        for bounds in [vec![0..0, 0..0, 0..5], vec![0..2, 2..2, 2..7], vec![0..4, 4..9, 9..9]] {
            let len = bounds.iter().map(|b| b.end).max().unwrap();
            let got = on_all(&g, |m| {
                let mut v = vec![f32::NAN; len];
                for i in bounds[m.rank()].clone() {
                    v[i] = (100 * m.rank() + i) as f32;
                }
                m.all_gather_f32(&mut v, &bounds).unwrap();
                v
            });
            let want: Vec<f32> =
                (0..len).map(|i| (100 * bounds.iter().position(|b| b.contains(&i)).unwrap() + i) as f32).collect();
            assert!(got.iter().all(|v| v == &want), "{bounds:?}: {got:?}");
        }
        let err = g[0].all_gather_f32(&mut [0.0; 4], &[0..2, 1..3, 3..4]).unwrap_err().to_string();
        assert!(err.contains("ranges"), "{err}");
    }

    /// A gather fills rank 0's buffer with every rank's segment, empty ones included, and
    /// nobody else receives anything; a segment of the wrong length is refused.
    #[test]
    fn a_gather_fills_rank_zeros_buffer_only() {
        let g = group(3, Duration::from_secs(20));
        // Ranges out of rank order, and empty ones where another starts (rank 0's too).
        for bounds in [[0..2, 2..2, 2..7], [3..7, 0..0, 0..3], [0..0, 0..7, 0..0]] {
            let got = on_all(&g, |m| {
                let segment: Vec<f32> = bounds[m.rank()].clone().map(|i| (100 * m.rank() + i) as f32).collect();
                let mut all = vec![f32::NAN; 7];
                let into = (m.rank() == 0).then_some((&mut all[..], &bounds[..]));
                m.gather_f32(&segment, into).unwrap();
                all
            });
            let want: Vec<f32> =
                (0..7).map(|i| (100 * bounds.iter().position(|b| b.contains(&i)).unwrap() + i) as f32).collect();
            assert_eq!(got[0], want, "{bounds:?}");
            assert!(got[1..].iter().all(|v| v.iter().all(|x| x.is_nan())), "the others receive nothing");
        }
        let bounds = [0..2, 2..2, 2..7];
        let err = g[0].gather_f32(&[1.0], Some((&mut [0.0; 7], &bounds))).unwrap_err().to_string();
        assert!(err.contains("segment of 1"), "{err}");
    }

    /// A hang-up from another thread (the NCCL watchdog's) ends a collective blocked on a
    /// stalled peer at once, not at the group's timeout: it does not wait for the links the
    /// collective holds.
    #[test]
    fn a_hang_up_ends_a_collective_waiting_on_a_stalled_peer() {
        let timeout = Duration::from_secs(20);
        let g = group(2, timeout);
        let started = std::time::Instant::now();
        // Rank 1 is alive but never joins the collective.
        let err = std::thread::scope(|s| {
            let waiting = s.spawn(|| g[0].all_reduce_sum_f32(&mut [1.0; 4]).unwrap_err().to_string());
            std::thread::sleep(Duration::from_millis(200));
            g[0].hang_up();
            waiting.join().unwrap()
        });
        assert!(started.elapsed() < timeout / 2, "the collective waited {:?}: {err}", started.elapsed());
    }

    /// Rank 0 listens for its ring on the address its ring's previous member reached it on,
    /// not the first member's: on rank 0's own node that one may have come in by loopback,
    /// which the last rank, on another node, could not reach. (Here 127.0.0.2 stands for the
    /// address the other nodes use.)
    #[test]
    fn rank_zero_listens_where_its_ring_neighbour_reached_it() {
        let port = std::net::TcpListener::bind("0.0.0.0:0").unwrap().local_addr().unwrap().port();
        let secret = Secret::new("t").unwrap();
        let timeout = Duration::from_secs(20);
        let g: Vec<ProcessGroup> = std::thread::scope(|s| {
            let handles: Vec<_> = ["0.0.0.0", "127.0.0.1", "127.0.0.2"]
                .into_iter()
                .enumerate()
                .map(|(r, host)| {
                    let (addr, secret) = (format!("{host}:{port}"), &secret);
                    s.spawn(move || ProcessGroup::join(&addr, r, 3, secret, timeout).unwrap())
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        let (to_rank_zero, _) = g[2].ring_links().unwrap().unwrap();
        assert_eq!(to_rank_zero.peer_addr().unwrap().ip().to_string(), "127.0.0.2");
    }

    #[test]
    fn disagreeing_lengths_are_refused() {
        let g = group(2, Duration::from_secs(10));
        let errors: Vec<bool> = std::thread::scope(|s| {
            let a = s.spawn(|| g[0].all_reduce_sum_f32(&mut [1.0, 2.0]).is_err());
            let b = s.spawn(|| g[1].all_reduce_sum_f32(&mut [1.0]).is_err());
            vec![a.join().unwrap(), b.join().unwrap()]
        });
        assert!(errors[0], "rank 0 sees a message of the wrong length");
    }
}
