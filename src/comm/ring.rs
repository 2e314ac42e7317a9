//! The in-process ring all-reduce: `n` members in a ring, each with a channel to its right
//! neighbour. The data is cut into `n` chunks; `n−1` reduce-scatter steps leave member `i` with
//! the full sum of chunk `i+1`, then `n−1` all-gather steps pass the summed chunks around. Each
//! member sends and receives `2·(n−1)/n` of the data: bandwidth-optimal, and the same algorithm
//! NCCL runs between GPUs.
//!
//! The sum of chunk `c` is accumulated in the fixed ring order starting after member `c`, so
//! results are bitwise reproducible (though not in plain left-to-right order).

use super::Communicator;
use crate::device::Device;
use crate::error::{Error, Result};
use std::sync::Mutex;
use std::sync::mpsc::{Receiver, Sender, channel};
use std::time::Duration;

/// How long a member waits for its neighbour before giving up: a member that died (its thread
/// returned an error) must not hang the others forever.
const PEER_TIMEOUT: Duration = Duration::from_secs(600);

/// One member of an in-process ring.
pub struct RingCommunicator {
    rank: usize,
    size: usize,
    to_right: Sender<Vec<f32>>,
    from_left: Mutex<Receiver<Vec<f32>>>,
}

/// A ring of `n` members; hand member `i` to the thread of replica `i`.
pub fn ring_group(n: usize) -> Vec<RingCommunicator> {
    let (senders, receivers): (Vec<_>, Vec<_>) = (0..n).map(|_| channel::<Vec<f32>>()).unzip();
    // Member i sends into channel (i+1) mod n, which member i+1 receives from.
    let mut receivers: Vec<Option<Receiver<Vec<f32>>>> = receivers.into_iter().map(Some).collect();
    (0..n)
        .map(|i| RingCommunicator {
            rank: i,
            size: n,
            to_right: senders[(i + 1) % n].clone(),
            from_left: Mutex::new(receivers[i].take().expect("each receiver is taken once")),
        })
        .collect()
}

impl RingCommunicator {
    /// Chunk `c` of `len` elements cut into `size` near-equal pieces.
    fn chunk(&self, len: usize, c: usize) -> std::ops::Range<usize> {
        let (base, extra) = (len / self.size, len % self.size);
        let start = c * base + c.min(extra);
        start..start + base + usize::from(c < extra)
    }

    fn recv(&self) -> Result<Vec<f32>> {
        let left = self.from_left.lock().unwrap_or_else(|e| e.into_inner());
        left.recv_timeout(PEER_TIMEOUT).map_err(|e| Error::Device {
            what: format!("ring all-reduce member {}", self.rank),
            message: format!("no data from member {}: {e}", (self.rank + self.size - 1) % self.size),
        })
    }

    fn send(&self, data: Vec<f32>) -> Result<()> {
        self.to_right.send(data).map_err(|_| Error::Device {
            what: format!("ring all-reduce member {}", self.rank),
            message: format!("member {} has gone", (self.rank + 1) % self.size),
        })
    }

    /// `data ← Σ over members` on host memory (every member passes the same length).
    pub fn all_reduce_host(&self, data: &mut [f32]) -> Result<()> {
        self.all_reduce_host_with(data, &mut Vec::new())
    }

    /// [`all_reduce_host`](Self::all_reduce_host) sending from `spare`'s allocation: chunks
    /// travel around the ring in the buffers they were sent in, and each member ends holding
    /// one it received, so a caller that keeps `spare` from call to call allocates nothing
    /// while its chunks are no longer than the spare (a fresh buffer of tens of megabytes comes
    /// from the kernel as new pages, every time). After an error the spare may be empty.
    pub fn all_reduce_host_with(&self, data: &mut [f32], spare: &mut Vec<f32>) -> Result<()> {
        let (n, r) = (self.size, self.rank);
        if n == 1 {
            return Ok(());
        }
        // Sends `values` in the spare buffer; returns what the left neighbour sent.
        let pass = |values: &[f32], spare: &mut Vec<f32>| -> Result<Vec<f32>> {
            let mut out = std::mem::take(spare);
            out.clear();
            out.extend_from_slice(values);
            self.send(out)?;
            self.recv()
        };
        // Reduce-scatter: at step s, send chunk (r − s) and add the received chunk (r − s − 1).
        for s in 0..n - 1 {
            let got = pass(&data[self.chunk(data.len(), (r + n - s) % n)], spare)?;
            let recv = self.chunk(data.len(), (r + 2 * n - s - 1) % n);
            for (d, g) in data[recv].iter_mut().zip(&got) {
                *d += g;
            }
            *spare = got;
        }
        // All-gather: member r now owns the full sum of chunk (r + 1); pass the sums around.
        for s in 0..n - 1 {
            let got = pass(&data[self.chunk(data.len(), (r + 1 + n - s) % n)], spare)?;
            let recv = self.chunk(data.len(), (r + 2 * n - s) % n);
            data[recv].copy_from_slice(&got);
            *spare = got;
        }
        Ok(())
    }
}

impl<D: Device> Communicator<D> for RingCommunicator {
    fn rank(&self) -> usize {
        self.rank
    }
    fn size(&self) -> usize {
        self.size
    }
    fn name(&self) -> String {
        "host ring".into()
    }
    fn all_reduce_sum(&self, dev: &D, bufs: &mut [&mut D::Buf]) -> Result<()> {
        // One flat bucket: one ring pass however many tensors it holds.
        let mut flat = Vec::with_capacity(bufs.iter().map(|b| D::len(b)).sum());
        for b in bufs.iter() {
            dev.download_extend(b, &mut flat)?;
        }
        self.all_reduce_host(&mut flat)?;
        let mut at = 0;
        for b in bufs.iter_mut() {
            let n = D::len(b);
            dev.upload_into(b, &flat[at..at + n])?;
            at += n;
        }
        Ok(())
    }
    fn broadcast(&self, dev: &D, buf: &mut D::Buf, root: usize) -> Result<()> {
        // Around the ring from the root: each member forwards what it received, except the last.
        if self.size == 1 {
            return Ok(());
        }
        let data = if self.rank == root { dev.download(buf)? } else { self.recv()? };
        if (self.rank + 1) % self.size != root {
            self.send(data.clone())?;
        }
        if self.rank != root {
            *buf = dev.upload(&data)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::CpuDevice;

    #[test]
    fn all_reduce_sums_every_length_for_every_group_size() {
        for n in 1..=5 {
            for len in [0, 1, 3, 7, 64, 1001] {
                let members = ring_group(n);
                let inputs: Vec<Vec<f32>> =
                    (0..n).map(|r| (0..len).map(|i| (r * 1000 + i) as f32 * 0.5).collect()).collect();
                let want: Vec<f32> = (0..len).map(|i| (0..n).map(|r| inputs[r][i]).sum()).collect();
                let outs: Vec<Vec<f32>> = std::thread::scope(|s| {
                    let handles: Vec<_> = members
                        .iter()
                        .zip(inputs.clone())
                        .map(|(m, mut data)| {
                            s.spawn(move || {
                                m.all_reduce_host(&mut data).unwrap();
                                data
                            })
                        })
                        .collect();
                    handles.into_iter().map(|h| h.join().unwrap()).collect()
                });
                for out in outs {
                    assert_eq!(out, want, "n={n} len={len}");
                }
            }
        }
    }

    /// One spare buffer per member kept across calls of growing and shrinking lengths: the
    /// same sums as fresh buffers, and the spare ends holding a chunk's allocation to reuse.
    #[test]
    fn a_kept_spare_buffer_carries_from_call_to_call() {
        let input = |r: usize, len: usize| -> Vec<f32> { (0..len).map(|i| (r * 1000 + i) as f32 * 0.25).collect() };
        for n in 2..=4 {
            let members = ring_group(n);
            let lens = [1001, 7, 0, 64, 3000, 5];
            let outs: Vec<Vec<Vec<f32>>> = std::thread::scope(|s| {
                let handles: Vec<_> = members
                    .iter()
                    .enumerate()
                    .map(|(r, m)| {
                        s.spawn(move || {
                            let mut spare = Vec::new();
                            let mut outs = Vec::new();
                            for len in lens {
                                let mut data = input(r, len);
                                m.all_reduce_host_with(&mut data, &mut spare).unwrap();
                                assert!(len < n || spare.capacity() >= len / n, "n={n} len={len}: the spare is kept");
                                outs.push(data);
                            }
                            outs
                        })
                    })
                    .collect();
                handles.into_iter().map(|h| h.join().unwrap()).collect()
            });
            for (k, len) in lens.into_iter().enumerate() {
                let want: Vec<f32> = (0..len).map(|i| (0..n).map(|r| input(r, len)[i]).sum()).collect();
                for out in &outs {
                    assert_eq!(out[k], want, "n={n} len={len}");
                }
            }
        }
    }

    #[test]
    fn device_buffers_and_broadcast() {
        let members = ring_group(3);
        let results: Vec<(Vec<f32>, Vec<f32>)> = std::thread::scope(|s| {
            let handles: Vec<_> = members
                .iter()
                .map(|m| {
                    s.spawn(move || {
                        let dev = CpuDevice::<f32>::new(0, 1).unwrap();
                        let r = Communicator::<CpuDevice<f32>>::rank(m) as f32;
                        let (mut a, mut b) = (dev.upload(&[r, 1.0]).unwrap(), dev.upload(&[10.0 * r]).unwrap());
                        m.all_reduce_sum(&dev, &mut [&mut a, &mut b]).unwrap();
                        let mut c = dev.upload(&[r, r]).unwrap();
                        m.broadcast(&dev, &mut c, 2).unwrap();
                        let mut sum = dev.download(&a).unwrap();
                        sum.extend(dev.download(&b).unwrap());
                        (sum, dev.download(&c).unwrap())
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for (sum, bcast) in results {
            assert_eq!(sum, vec![3.0, 3.0, 30.0]);
            assert_eq!(bcast, vec![2.0, 2.0]);
        }
    }

    #[test]
    fn a_missing_member_is_an_error_not_a_hang() {
        let mut members = ring_group(2);
        drop(members.pop());
        let e = members[0].all_reduce_host(&mut [1.0, 2.0]).unwrap_err().to_string();
        assert!(e.contains("gone") || e.contains("no data"), "{e}");
    }
}
