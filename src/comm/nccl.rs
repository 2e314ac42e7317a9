//! NCCL for the `cuda` backend, through the library [`nccl_lib`](super::nccl_lib) opens: one
//! communicator per GPU, collectives queued on a stream of their own ordered after that GPU's
//! kernels (so they overlap the rest of the backward without a host wait). In one process
//! `ncclCommInitAll` makes the group; across the processes of a launched run
//! ([`process_groups`]) rank 0's 128-byte unique id reaches the others over the process
//! group's TCP links (or, for callers without one, the TCP [`rendezvous`]). NCCL waits for a
//! lost peer forever: [`Communicator::abort`] (`ncclCommAbort`) ends such a wait, which the
//! runtime's [watchdog](super::watchdog) does when the group's timeout passes.

use super::Communicator;
use super::nccl_lib::{FLOAT32, NcclLib, SUM, nccl};
use super::process_group::ProcessGroup;
use crate::device::GpuDevice;
use crate::device::gpu::Elem;
use crate::error::{Error, Result};
use cudarc::driver::CudaStream;
use cudarc::nccl::sys;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// Bytes of an NCCL unique id.
pub const ID_BYTES: usize = 128;

/// The opened library, or an error saying where it was looked for.
fn library() -> Result<&'static NcclLib> {
    nccl().map_err(|why| Error::Device { what: "nccl".into(), message: why.to_string() })
}

/// Whether the NCCL library can be loaded.
pub fn available() -> bool {
    nccl().is_ok()
}

/// A fresh unique id (rank 0 makes it; every member needs the same one).
pub fn unique_id() -> Result<[u8; ID_BYTES]> {
    let lib = library()?;
    let mut id = sys::ncclUniqueId { internal: [0; ID_BYTES] };
    // SAFETY: NCCL writes the 128-byte id.
    lib.check("unique id", unsafe { (lib.get_unique_id)(&mut id) })?;
    Ok(id.internal.map(|c| c as u8))
}

/// Hands rank 0's unique id `id` to the other `size − 1` members over the authenticated TCP
/// [`rendezvous`](super::rendezvous) at `addr`; returns the id every member should use.
pub fn rendezvous(
    addr: &str,
    rank: usize,
    size: usize,
    secret: &super::rendezvous::Secret,
    id: Option<[u8; ID_BYTES]>,
    timeout: Duration,
) -> Result<[u8; ID_BYTES]> {
    let got = super::rendezvous::meet(addr, rank, size, secret, id.as_ref().map(|i| &i[..]), timeout)?;
    got.try_into().map_err(|v: Vec<u8>| Error::Device {
        what: "nccl rendezvous".into(),
        message: format!("received {} bytes; an NCCL id has {ID_BYTES}", v.len()),
    })
}

const LIVE: u8 = 0;
const FAILED: u8 = 1;
const ABORTED: u8 = 2;

/// How long an abort waits for a collective that is still queueing its calls: queueing takes
/// microseconds, unless it hangs inside NCCL on a peer that is gone, which is what aborting
/// ends.
const QUEUEING_GRACE: Duration = Duration::from_secs(2);

/// A communicator's state, and the one way past it to NCCL. A collective checks that the group
/// is not aborted and queues its calls while it holds `queueing`; [`abort`](Self::abort) marks
/// the group aborted at once (no later collective starts), waits for a collective still
/// queueing to leave, and only then releases the communicator. Without the wait, a collective
/// that had passed the check could call NCCL with the handle `ncclCommAbort` had just freed
/// (the watchdog aborts from its own thread).
struct AbortGate {
    /// [`LIVE`], [`FAILED`] (a collective failed: the peers may be gone, so dropping aborts
    /// the communicator, as `ncclCommDestroy` would wait for them) or [`ABORTED`] (already:
    /// dropping releases nothing more).
    state: AtomicU8,
    queueing: Mutex<()>,
}

impl AbortGate {
    fn new() -> Self {
        AbortGate { state: LIVE.into(), queueing: Mutex::new(()) }
    }

    /// Leave to queue NCCL calls, held until the guard drops; an error once aborted.
    fn enter(&self) -> Result<MutexGuard<'_, ()>> {
        let guard = self.queueing.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        self.live()?;
        Ok(guard)
    }

    /// An error once the group is aborted: `ncclCommAbort` freed the communicator.
    fn live(&self) -> Result<()> {
        if self.state.load(Ordering::SeqCst) == ABORTED {
            return Err(Error::Device {
                what: "nccl".into(),
                message: "the group was aborted (a peer failed or stalled); no collective runs on it".into(),
            });
        }
        Ok(())
    }

    /// Remembers a failed collective (unless aborted already).
    fn fail(&self) {
        let _ = self.state.compare_exchange(LIVE, FAILED, Ordering::SeqCst, Ordering::SeqCst);
    }

    /// Marks the group aborted and, the first time, runs `release` once no collective is
    /// queueing, or after `grace` if one hangs inside NCCL (the release is what frees it).
    fn abort(&self, grace: Duration, release: impl FnOnce()) {
        if self.state.swap(ABORTED, Ordering::SeqCst) == ABORTED {
            return;
        }
        let until = Instant::now() + grace;
        let _quiet = loop {
            match self.queueing.try_lock() {
                Ok(guard) => break Some(guard),
                Err(std::sync::TryLockError::Poisoned(p)) => break Some(p.into_inner()),
                Err(std::sync::TryLockError::WouldBlock) if Instant::now() < until => {
                    std::thread::sleep(Duration::from_millis(1))
                }
                Err(std::sync::TryLockError::WouldBlock) => break None,
            }
        };
        release();
    }
}

/// One GPU's member of an NCCL group.
pub struct NcclCommunicator {
    lib: &'static NcclLib,
    /// Its state, and the collectives' way to NCCL past an abort.
    gate: AbortGate,
    comm: sys::ncclComm_t,
    /// The GPU's compute stream, whose kernels produce the gradients and later read the sums.
    compute: Arc<CudaStream>,
    /// The collectives' own stream: ordered after the gradients by an event, and waited for
    /// only when the sums are needed ([`Communicator::complete`]), so the rest of the
    /// backward overlaps the all-reduce, as the host ring's thread does.
    stream: Arc<CudaStream>,
    rank: usize,
    size: usize,
}

// SAFETY: an NCCL communicator may be used from any thread as long as calls on it are not
// concurrent; every method takes `&self` but NCCL calls are serialised by the owning worker.
unsafe impl Send for NcclCommunicator {}
// SAFETY: see above.
unsafe impl Sync for NcclCommunicator {}

impl NcclCommunicator {
    /// Member `rank` of `size`, on `runtime`'s GPU and stream, joining the group `id` names.
    pub fn new(
        runtime: &crate::device::cuda::CudaRuntime,
        rank: usize,
        size: usize,
        id: [u8; ID_BYTES],
    ) -> Result<Self> {
        Ok(Self::ranks(&[runtime], rank, size, id)?.remove(0))
    }

    /// Members `first..first + runtimes.len()` of a group of `size` spanning processes, one per
    /// GPU of `runtimes` (rank `first + i` on `runtimes[i]`), all joining the group `id` names:
    /// one `ncclCommInitRank` per GPU inside one NCCL group. What can fail locally (binding a
    /// GPU, making a stream) is done before the group opens, so an init is never left waiting
    /// for a rank of this process that was not queued; every communicator made is aborted if
    /// the group fails.
    pub fn ranks(
        runtimes: &[&crate::device::cuda::CudaRuntime],
        first: usize,
        size: usize,
        id: [u8; ID_BYTES],
    ) -> Result<Vec<Self>> {
        let lib = library()?;
        let streams = runtimes.iter().map(|rt| rt.bind().and_then(|()| rt.new_stream())).collect::<Result<Vec<_>>>()?;
        let id = sys::ncclUniqueId { internal: id.map(|b| b as ::core::ffi::c_char) };
        let mut comms: Vec<sys::ncclComm_t> = vec![std::ptr::null_mut(); runtimes.len()];
        // SAFETY: opens a group that is closed below on every path.
        lib.check("group start", unsafe { (lib.group_start)() })?;
        let queued = runtimes.iter().zip(&mut comms).enumerate().try_for_each(|(i, (rt, comm))| {
            rt.bind()?;
            // SAFETY: NCCL writes the communicator on success; the id is the group's.
            lib.check("init", unsafe { (lib.comm_init_rank)(comm, size as i32, id, (first + i) as i32) })
        });
        // SAFETY: closes the group opened above; the inits complete here.
        let closed = lib.check("group end", unsafe { (lib.group_end)() });
        if let Err(e) = queued.and(closed) {
            for comm in comms.into_iter().filter(|c| !c.is_null()) {
                // SAFETY: a communicator NCCL created above; its peers may never come.
                let _ = unsafe { (lib.comm_abort)(comm) };
            }
            return Err(e);
        }
        let made = comms.into_iter().zip(runtimes).zip(streams).enumerate();
        Ok(made.map(|(i, ((comm, rt), stream))| Self::wrap(lib, comm, rt, stream, first + i, size)).collect())
    }

    /// Member `rank` of `size` around an initialised `comm` on `runtime`'s GPU: collectives on
    /// `stream`, ordered after the compute stream's work.
    fn wrap(
        lib: &'static NcclLib,
        comm: sys::ncclComm_t,
        runtime: &crate::device::cuda::CudaRuntime,
        stream: Arc<CudaStream>,
        rank: usize,
        size: usize,
    ) -> Self {
        Self { lib, gate: AbortGate::new(), comm, compute: runtime.stream().clone(), stream, rank, size }
    }
}

impl NcclCommunicator {
    /// Passes `result` on, remembering a failure (see [`AbortGate`]).
    fn note(&self, result: Result<()>) -> Result<()> {
        if result.is_err() {
            self.gate.fail();
        }
        result
    }

    /// One communicator per GPU of one process, all in one group (`ncclCommInitAll`): rank `i`
    /// is `runtimes[i]`'s GPU, collectives queue on its stream.
    pub fn group(runtimes: &[&crate::device::cuda::CudaRuntime]) -> Result<Vec<Self>> {
        let lib = library()?;
        let streams = runtimes.iter().map(|rt| rt.new_stream()).collect::<Result<Vec<_>>>()?;
        let ordinals: Vec<i32> = runtimes.iter().map(|r| r.ordinal() as i32).collect();
        let mut comms: Vec<sys::ncclComm_t> = vec![std::ptr::null_mut(); runtimes.len()];
        // SAFETY: NCCL writes one communicator per listed device into `comms`.
        lib.check("init all", unsafe {
            (lib.comm_init_all)(comms.as_mut_ptr(), ordinals.len() as i32, ordinals.as_ptr())
        })?;
        let size = runtimes.len();
        let made = comms.into_iter().zip(runtimes).zip(streams).enumerate();
        Ok(made.map(|(rank, ((comm, rt), stream))| Self::wrap(lib, comm, rt, stream, rank, size)).collect())
    }
}

/// The communicator groups of a pipeline with `k` positions and `r` replicas over `devices`
/// (replica `i` owns `devices[i·k..(i+1)·k]`): one NCCL group per position, when every device is
/// a `cuda` device and NCCL is installed; `None` otherwise (the pipeline then uses its host
/// ring). Generic so that callers holding any device type can ask.
#[allow(clippy::type_complexity)]
pub fn pipeline_groups<D: crate::device::Device>(
    devices: &[D],
    k: usize,
    r: usize,
) -> Result<Option<Vec<Vec<std::sync::Arc<dyn Communicator<D>>>>>> {
    // `D` is `GpuDevice` exactly when every element downcasts to one.
    let gpus: Option<Vec<&GpuDevice>> =
        devices.iter().map(|d| (d as &dyn std::any::Any).downcast_ref::<GpuDevice>()).collect();
    let Some(gpus) = gpus else { return Ok(None) };
    if r < 2 || !available() || gpus.len() < k * r {
        return Ok(None);
    }
    let runtimes: Option<Vec<&crate::device::cuda::CudaRuntime>> =
        gpus.iter().map(|g| crate::device::cuda::runtime_of(g)).collect();
    let Some(runtimes) = runtimes else { return Ok(None) };
    let groups = (0..k)
        .map(|d| NcclCommunicator::group(&(0..r).map(|i| runtimes[i * k + d]).collect::<Vec<_>>()))
        .collect::<Result<Vec<_>>>()?;
    Ok(for_device(groups))
}

/// NCCL groups as the caller's `D`'s communicators (`D` is `GpuDevice` whenever NCCL groups
/// were made at all).
#[allow(clippy::type_complexity)]
fn for_device<D: crate::device::Device>(
    groups: Vec<Vec<NcclCommunicator>>,
) -> Option<Vec<Vec<std::sync::Arc<dyn Communicator<D>>>>> {
    let groups: Vec<Vec<std::sync::Arc<dyn Communicator<GpuDevice>>>> = groups
        .into_iter()
        .map(|g| g.into_iter().map(|c| std::sync::Arc::new(c) as std::sync::Arc<dyn Communicator<GpuDevice>>).collect())
        .collect();
    let boxed: Box<dyn std::any::Any> = Box::new(groups);
    boxed.downcast::<Vec<Vec<std::sync::Arc<dyn Communicator<D>>>>>().ok().map(|b| *b)
}

/// Communicators spanning the processes of `group` (a launched run, one whole pipeline per
/// process): one NCCL group over the `R` replicas of every process, process `p`'s replica `r`
/// ranked `p·R + r`, so each bucket of gradients is summed over every GPU of the run in one
/// collective, on the GPUs. Rank 0's unique id reaches the others over the group's existing
/// TCP links. `None` (the process group's host ring then sums) unless every process has
/// `cuda` devices, NCCL and pipelines of one stage (`k = 1`): the processes agree first, a
/// collective every one of them makes at the same point.
#[allow(clippy::type_complexity)]
pub fn process_groups<D: crate::device::Device>(
    devices: &[D],
    k: usize,
    r: usize,
    group: &ProcessGroup,
) -> Result<Option<Vec<Vec<std::sync::Arc<dyn Communicator<D>>>>>> {
    let runtimes: Option<Vec<&crate::device::cuda::CudaRuntime>> = devices
        .iter()
        .take(r)
        .map(|d| (d as &dyn std::any::Any).downcast_ref::<GpuDevice>().and_then(crate::device::cuda::runtime_of))
        .collect();
    let runtimes = runtimes.filter(|rt| k == 1 && rt.len() == r && available());
    let everyone = all_agree(group, runtimes.is_some())?;
    let Some(runtimes) = runtimes.filter(|_| everyone) else { return Ok(None) };
    // Bytes as f64 (exact), rank 0's and zeros elsewhere: the sum is rank 0's id everywhere.
    let mut shared = [0f64; ID_BYTES];
    if group.rank() == 0 {
        for (v, b) in shared.iter_mut().zip(unique_id()?) {
            *v = f64::from(b);
        }
    }
    group.all_reduce_sum_f64(&mut shared)?;
    let id = shared.map(|v| v as u8);
    let members = NcclCommunicator::ranks(&runtimes, group.rank() * r, group.size() * r, id)?;
    Ok(for_device(vec![members]))
}

/// Whether every process of `group` `can`: a collective, made by every process at the same
/// point, so that all go on alike (one NCCL group over all, or none).
fn all_agree(group: &ProcessGroup, can: bool) -> Result<bool> {
    let mut votes = [f64::from(u8::from(can))];
    group.all_reduce_sum_f64(&mut votes)?;
    Ok(votes[0] == group.size() as f64)
}

/// Why replicas on `devices` cannot use NCCL, when they are real GPUs (`cuda`) and the library
/// did not load: the places it was looked for. `None` for other devices or when NCCL loaded.
pub fn host_ring_reason<D: crate::device::Device>(devices: &[D]) -> Option<String> {
    let real_gpu = |d: &D| {
        (d as &dyn std::any::Any)
            .downcast_ref::<GpuDevice>()
            .is_some_and(|g| crate::device::cuda::runtime_of(g).is_some())
    };
    if devices.is_empty() || !devices.iter().all(real_gpu) {
        return None;
    }
    nccl().err().map(not_loaded)
}

/// The console's words for NCCL failing to load with `why`.
fn not_loaded(why: &str) -> String {
    format!("NCCL not loaded: {why}; install it with scripts/setup.sh nccl or set PT_NCCL_LIB")
}

impl Drop for NcclCommunicator {
    fn drop(&mut self) {
        let release = match self.gate.state.load(Ordering::SeqCst) {
            LIVE => self.lib.comm_destroy,
            FAILED => self.lib.comm_abort,
            _ => return,
        };
        // SAFETY: the communicator is ours and no collective is in flight once it is dropped.
        let _ = unsafe { release(self.comm) };
    }
}

fn stream_error(what: &str, e: cudarc::driver::DriverError) -> Error {
    Error::Device { what: format!("nccl: {what}"), message: e.to_string() }
}

fn check_f32(buf: &crate::device::GpuBuf) -> Result<()> {
    crate::device::gpu::check_elem("nccl", "buffer", buf, Elem::F32)
}

impl Communicator<GpuDevice> for NcclCommunicator {
    fn rank(&self) -> usize {
        self.rank
    }
    fn size(&self) -> usize {
        self.size
    }
    fn name(&self) -> String {
        format!("NCCL {} ({})", self.lib.version_string(), self.lib.path.display())
    }
    fn all_reduce_sum(&self, _dev: &GpuDevice, bufs: &mut [&mut crate::device::GpuBuf]) -> Result<()> {
        let _queueing = self.gate.enter()?;
        for b in bufs.iter() {
            check_f32(b)?;
        }
        let lib = self.lib;
        let stream = self.stream.cu_stream() as sys::cudaStream_t;
        // The sums start once the kernels that wrote the gradients are done.
        self.note(self.stream.join(&self.compute).map_err(|e| stream_error("order the all-reduce", e)))?;
        // SAFETY: opens a group that is closed below on every path.
        lib.check("group start", unsafe { (lib.group_start)() })?;
        let queued = bufs.iter().try_for_each(|b| {
            let p = b.ptr() as *mut ::core::ffi::c_void;
            // SAFETY: in-place sum over `len` f32 elements of device memory this GPU owns.
            lib.check("all-reduce", unsafe { (lib.all_reduce)(p, p, b.len(), FLOAT32, SUM, self.comm, stream) })
        });
        // An open group must be closed even when queueing failed, or every later NCCL call of
        // this thread joins the broken group.
        // SAFETY: closes the group opened above.
        let closed = lib.check("group end", unsafe { (lib.group_end)() });
        self.note(queued.and(closed))
    }
    fn complete(&self, _dev: &GpuDevice) -> Result<()> {
        // Stream order only: no NCCL call, so no need to enter the gate.
        self.gate.live()?;
        self.note(self.compute.join(&self.stream).map_err(|e| stream_error("wait for the all-reduce", e)))
    }
    fn abort(&self) {
        // The gate makes this the communicator's only release, and makes it after any
        // collective between its check and its NCCL call has made that call.
        self.gate.abort(QUEUEING_GRACE, || {
            // SAFETY: NCCL allows aborting a communicator from another thread while a
            // collective of it waits inside NCCL.
            let _ = unsafe { (self.lib.comm_abort)(self.comm) };
        });
    }
    fn broadcast(&self, dev: &GpuDevice, buf: &mut crate::device::GpuBuf, root: usize) -> Result<()> {
        let _queueing = self.gate.enter()?;
        check_f32(buf)?;
        let p = buf.ptr() as *mut ::core::ffi::c_void;
        let lib = self.lib;
        let stream = self.stream.cu_stream() as sys::cudaStream_t;
        self.note(self.stream.join(&self.compute).map_err(|e| stream_error("order the broadcast", e)))?;
        // SAFETY: in-place broadcast of `len` f32 elements.
        self.note(
            lib.check("broadcast", unsafe {
                (lib.broadcast)(p, p, buf.len(), FLOAT32, root as i32, self.comm, stream)
            }),
        )?;
        self.complete(dev)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An abort waits for a collective that is queueing its calls (it passed the check, and
    /// its call must not meet a freed communicator), releases once it has left, and refuses
    /// every later one; a collective hung inside NCCL past the grace is released under it.
    #[test]
    fn an_abort_releases_only_after_a_queueing_collective_has_left() {
        use std::sync::atomic::AtomicBool;
        for (hold, grace, waits) in [
            (Duration::from_millis(300), Duration::from_secs(10), true),
            (Duration::from_secs(3), Duration::from_millis(100), false),
        ] {
            let gate = AbortGate::new();
            let (left, released) = (AtomicBool::new(false), AtomicBool::new(false));
            let entered = std::sync::Barrier::new(2);
            std::thread::scope(|s| {
                s.spawn(|| {
                    let _queueing = gate.enter().unwrap();
                    entered.wait();
                    std::thread::sleep(hold);
                    left.store(true, Ordering::SeqCst);
                });
                entered.wait();
                let started = Instant::now();
                gate.abort(grace, || {
                    assert_eq!(left.load(Ordering::SeqCst), waits, "released after the collective left: {waits}");
                    released.store(true, Ordering::SeqCst);
                });
                assert!(released.load(Ordering::SeqCst));
                assert!(started.elapsed() < hold.min(grace) + Duration::from_secs(1), "{:?}", started.elapsed());
            });
            let e = gate.enter().expect_err("aborted").to_string();
            assert!(e.contains("aborted"), "{e}");
            // A second abort releases nothing more.
            gate.abort(grace, || panic!("released twice"));
        }
    }

    #[test]
    fn the_nccl_id_travels_through_the_rendezvous() {
        let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let (addr, secret) = (format!("127.0.0.1:{port}"), super::super::rendezvous::Secret::new("k").unwrap());
        let id = [7u8; ID_BYTES];
        std::thread::scope(|s| {
            let h = s.spawn(|| rendezvous(&addr, 0, 2, &secret, Some(id), Duration::from_secs(20)));
            assert_eq!(rendezvous(&addr, 1, 2, &secret, None, Duration::from_secs(20)).unwrap(), id);
            assert_eq!(h.join().unwrap().unwrap(), id);
        });
    }

    #[test]
    fn only_cuda_devices_get_nccl_groups() {
        let cpus: Vec<crate::device::CpuDevice<f32>> =
            (0..4).map(|i| crate::device::CpuDevice::new(i, 1).unwrap()).collect();
        assert!(pipeline_groups(&cpus, 2, 2).unwrap().is_none());
        let emus: Vec<GpuDevice> =
            (0..2).map(|i| crate::device::emu::device(i, crate::device::Precision::F32, 0).unwrap()).collect();
        assert!(pipeline_groups(&emus, 1, 2).unwrap().is_none());
        // Only real GPUs announce why NCCL is not in use.
        assert!(host_ring_reason(&cpus).is_none() && host_ring_reason(&emus).is_none());
        let home = std::path::Path::new("/nonexistent");
        let why = super::super::nccl_lib::load(&super::super::nccl_lib::candidates(None, home)[..1]).err().unwrap();
        let note = not_loaded(&why);
        assert!(
            note.contains("/nonexistent/nccl/lib/libnccl.so.2") && note.contains("scripts/setup.sh nccl"),
            "{note}"
        );
    }

    /// Spanning groups are a collective decision: where one process cannot use NCCL, none
    /// does, and every process hears so (none is left in an NCCL init the others skip); cpu
    /// devices and emulated GPUs never can.
    #[test]
    fn processes_use_nccl_only_when_all_can() {
        use super::super::process_group::ProcessGroup;
        let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let (addr, secret) = (format!("127.0.0.1:{port}"), super::super::rendezvous::Secret::new("k").unwrap());
        std::thread::scope(|s| {
            let members: Vec<_> = (0..2)
                .map(|rank| {
                    let (addr, secret) = (&addr, &secret);
                    s.spawn(move || {
                        let g = ProcessGroup::join(addr, rank, 2, secret, Duration::from_secs(20)).unwrap();
                        let split = all_agree(&g, rank == 0).unwrap();
                        let both = all_agree(&g, true).unwrap();
                        let cpus = [crate::device::CpuDevice::<f32>::new(rank, 1).unwrap()];
                        let emus = [crate::device::emu::device(rank, crate::device::Precision::F32, 0).unwrap()];
                        let none = match rank {
                            0 => process_groups(&cpus, 1, 1, &g).unwrap().is_none(),
                            _ => process_groups(&emus, 1, 1, &g).unwrap().is_none(),
                        };
                        (split, both, none)
                    })
                })
                .collect();
            for m in members {
                assert_eq!(m.join().unwrap(), (false, true, true));
            }
        });
    }

    #[test]
    fn without_libnccl_the_error_says_so() {
        if !available() {
            assert!(unique_id().unwrap_err().to_string().contains("libnccl not found"));
            assert!(NcclCommunicator::group(&[]).err().map(|e| e.to_string()).unwrap_or_default().contains("libnccl"));
        }
    }
}
