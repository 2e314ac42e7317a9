//! A group of processes training one model together (`pipetransformer launch`): each holds its
//! own pipeline and runs its shard of every global batch; after the backward they sum their
//! gradients and losses here, so every process applies the same update.
//!
//! The collective is a star over the connections the [`rendezvous`](super::rendezvous) left
//! open: members send their values to rank 0, which adds them in rank order (in f64) and sends
//! the sum back. Adding in a fixed order makes every process's result bitwise the same.
//! Gradients travel as f32 bytes, converted and added a chunk at a time as they arrive (rank 0
//! reads every member's message in full before it answers, so no member is ever blocked
//! writing while rank 0 writes to it). Every
//! read has the group's timeout, and a peer that dies closes its socket, so a dead process ends
//! the others with an error naming it instead of a hang: rank 0 sees the member's end of file,
//! fails, and its own exit closes every member's connection in turn.

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
    links: Mutex<Links>,
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
        let (_, links) = gather(addr, rank, size, secret, Some(b"process group"), timeout)?;
        for s in links.streams() {
            s.set_read_timeout(Some(timeout)).map_err(|e| group_error(e.to_string()))?;
            s.set_write_timeout(Some(timeout)).map_err(|e| group_error(e.to_string()))?;
            s.set_nodelay(true).map_err(|e| group_error(e.to_string()))?;
        }
        Ok(ProcessGroup { rank, size, links: Mutex::new(links) })
    }

    /// This process's rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Processes in the group.
    pub fn size(&self) -> usize {
        self.size
    }

    /// Every process's `values` become the element-wise sum over the group, added in rank order
    /// in f64 and rounded once to f32. The values travel as f32 bytes and rank 0 adds them a
    /// chunk at a time as they arrive, so neither side widens the whole buffer.
    pub fn all_reduce_sum_f32(&self, values: &mut [f32]) -> Result<()> {
        self.collective(|links| match links {
            Links::Hub(members) => {
                let mut bytes = vec![0u8; CHUNK.min(values.len()) * 4];
                let mut sum = vec![0f64; CHUNK.min(values.len())];
                for (i, peer) in members.iter_mut().enumerate() {
                    read_count(peer, values.len()).map_err(|e| peer_error(i + 1, e))?;
                }
                for chunk in values.chunks_mut(CHUNK) {
                    let (sum, bytes) = (&mut sum[..chunk.len()], &mut bytes[..chunk.len() * 4]);
                    for (s, &v) in sum.iter_mut().zip(chunk.iter()) {
                        *s = f64::from(v);
                    }
                    for (i, peer) in members.iter_mut().enumerate() {
                        peer.read_exact(bytes).map_err(|e| peer_error(i + 1, closed(&e)))?;
                        for (s, b) in sum.iter_mut().zip(bytes.chunks_exact(4)) {
                            *s += f64::from(f32::from_le_bytes([b[0], b[1], b[2], b[3]]));
                        }
                    }
                    for (v, &s) in chunk.iter_mut().zip(sum.iter()) {
                        *v = s as f32;
                    }
                }
                // Every member has sent everything: none is blocked writing, so the sums can go.
                for (i, peer) in members.iter_mut().enumerate() {
                    write_f32(peer, values).map_err(|e| peer_error(i + 1, closed(&e)))?;
                }
                Ok(())
            }
            Links::Spoke(hub) => {
                write_f32(hub, values).map_err(|e| peer_error(0, closed(&e)))?;
                read_count(hub, values.len()).map_err(|e| peer_error(0, e))?;
                let mut bytes = vec![0u8; CHUNK.min(values.len()) * 4];
                for chunk in values.chunks_mut(CHUNK) {
                    let bytes = &mut bytes[..chunk.len() * 4];
                    hub.read_exact(bytes).map_err(|e| peer_error(0, closed(&e)))?;
                    for (v, b) in chunk.iter_mut().zip(bytes.chunks_exact(4)) {
                        *v = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
                    }
                }
                Ok(())
            }
        })
    }

    /// Every process's `values` become the element-wise sum over the group, in rank order.
    pub fn all_reduce_sum_f64(&self, values: &mut [f64]) -> Result<()> {
        self.collective(|links| Self::exchange(links, values))
    }

    /// Runs one collective over the links; on failure hangs up on everyone.
    fn collective(&self, f: impl FnOnce(&mut Links) -> Result<()>) -> Result<()> {
        let mut links = self.links.lock().unwrap_or_else(|e| e.into_inner());
        let result = f(&mut links);
        if result.is_err() {
            // The group is broken: hang up on everyone now, so each peer fails at once with
            // "closed its connection" instead of waiting out its timeout.
            for s in links.streams() {
                let _ = s.shutdown(std::net::Shutdown::Both);
            }
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

/// Values per chunk of an f32 all-reduce: 4 MiB of them on the wire, 8 MiB of f64 sums at rank 0.
const CHUNK: usize = 1 << 20;

/// `[count: u64 LE][values as f32 LE]`, converted a chunk at a time.
fn write_f32(stream: &mut TcpStream, values: &[f32]) -> std::io::Result<()> {
    stream.write_all(&(values.len() as u64).to_le_bytes())?;
    let mut bytes = vec![0u8; CHUNK.min(values.len()) * 4];
    for chunk in values.chunks(CHUNK) {
        let bytes = &mut bytes[..chunk.len() * 4];
        for (b, v) in bytes.chunks_exact_mut(4).zip(chunk) {
            b.copy_from_slice(&v.to_le_bytes());
        }
        stream.write_all(bytes)?;
    }
    Ok(())
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

fn closed(e: &std::io::Error) -> String {
    match e.kind() {
        std::io::ErrorKind::UnexpectedEof
        | std::io::ErrorKind::ConnectionReset
        | std::io::ErrorKind::BrokenPipe
        | std::io::ErrorKind::ConnectionAborted => "closed its connection (the process ended or was killed)".into(),
        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => "did not answer within the timeout".into(),
        _ => e.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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

    #[test]
    fn every_process_gets_the_same_sum_in_rank_order() {
        let g = group(3, Duration::from_secs(10));
        let got: Vec<(Vec<f32>, Vec<f64>)> = std::thread::scope(|s| {
            let handles: Vec<_> = g
                .iter()
                .map(|m| {
                    s.spawn(move || {
                        let r = m.rank() as f32;
                        let mut a = vec![r, 1e-8 * r, 1.0 + r];
                        m.all_reduce_sum_f32(&mut a).unwrap();
                        let mut b = vec![0.1 * f64::from(r)];
                        m.all_reduce_sum_f64(&mut b).unwrap();
                        (a, b)
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for (a, b) in &got {
            assert_eq!(a, &got[0].0, "bitwise the same everywhere");
            assert_eq!(a, &vec![3.0, 3e-8, 6.0]);
            assert_eq!(b, &vec![0.1 * 0.0 + 0.1 * 1.0 + 0.1 * 2.0]);
        }
    }

    /// A buffer of several chunks (and a partial one) is summed in every chunk, in rank order.
    #[test]
    fn long_buffers_are_summed_chunk_by_chunk() {
        let n = 2 * CHUNK + 3;
        let g = group(3, Duration::from_secs(20));
        let value = |r: usize, i: usize| (i % 1000) as f32 * 1e-3 + r as f32 * 1e-7;
        let got: Vec<Vec<f32>> = std::thread::scope(|s| {
            let handles: Vec<_> = g
                .iter()
                .map(|m| {
                    s.spawn(move || {
                        let mut a: Vec<f32> = (0..n).map(|i| value(m.rank(), i)).collect();
                        m.all_reduce_sum_f32(&mut a).unwrap();
                        a
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for i in [0, 1, CHUNK - 1, CHUNK, 2 * CHUNK, n - 1] {
            let want = (0..3).map(|r| f64::from(value(r, i))).sum::<f64>() as f32;
            assert_eq!(got[0][i], want, "element {i}");
        }
        assert!(got.iter().all(|a| a == &got[0]), "bitwise the same everywhere");
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
        // Rank 1 learns it at once from rank 0 hanging up, well before the 10 s timeout.
        assert!(errors[1].contains("rank 0") && errors[1].contains("closed its connection"), "{}", errors[1]);
        assert!(started.elapsed() < Duration::from_secs(9), "nobody waited for the timeout");
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
