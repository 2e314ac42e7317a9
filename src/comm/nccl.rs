//! NCCL for the `cuda` backend, through the library [`nccl_lib`](super::nccl_lib) opens: one
//! communicator per GPU, collectives queued on a stream of their own ordered after that GPU's
//! kernels (so they overlap the rest of the backward without a host wait). In one process
//! `ncclCommInitAll` makes the group; across the processes of a launched run
//! ([`process_groups`]) rank 0's 128-byte unique id reaches the others over the process
//! group's TCP links (or, for callers without one, the TCP [`rendezvous`]). NCCL waits for a
//! lost peer forever: [`Communicator::abort`] (`ncclCommAbort`) ends such a wait, which the
//! runtime's [watchdog](super::watchdog) does when the group's timeout passes. A group that
//! spans processes is made of nonblocking communicators (NCCL ≥ 2.14), so its init, too, ends
//! with an error when a peer does not join within the process group's timeout, instead of
//! waiting for it forever.

use super::Communicator;
use super::nccl_lib::{FLOAT32, IN_PROGRESS, InitConfig, NcclLib, SUM, nccl};
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
    /// How long a call NCCL answered with `ncclInProgress` may go on (nonblocking
    /// communicators only; a blocking one's calls return when done).
    settle_within: Option<Duration>,
}

// SAFETY: an NCCL communicator may be used from any thread as long as calls on it are not
// concurrent; every method takes `&self` but NCCL calls are serialised by the owning worker.
unsafe impl Send for NcclCommunicator {}
// SAFETY: see above.
unsafe impl Sync for NcclCommunicator {}

impl NcclCommunicator {
    /// Member `rank` of `size`, on `runtime`'s GPU and stream, joining the group `id` names
    /// within `timeout`.
    pub fn new(
        runtime: &crate::device::cuda::CudaRuntime,
        rank: usize,
        size: usize,
        id: [u8; ID_BYTES],
        timeout: Duration,
    ) -> Result<Self> {
        Ok(Self::ranks(&[runtime], rank, size, id, timeout)?.remove(0))
    }

    /// Members `first..first + runtimes.len()` of a group of `size` spanning processes, one per
    /// GPU of `runtimes` (rank `first + i` on `runtimes[i]`), all joining the group `id` names
    /// (`join`): an error, never a hang, when the others have not all joined within `timeout`.
    /// What can fail locally (binding a GPU, making a stream) is done before the group opens.
    pub fn ranks(
        runtimes: &[&crate::device::cuda::CudaRuntime],
        first: usize,
        size: usize,
        id: [u8; ID_BYTES],
        timeout: Duration,
    ) -> Result<Vec<Self>> {
        let lib = library()?;
        let streams = runtimes.iter().map(|rt| rt.bind().and_then(|()| rt.new_stream())).collect::<Result<Vec<_>>>()?;
        let comms = join(lib, runtimes.len(), first, size, id, timeout, |i| runtimes[i].bind())?;
        let settle_within = lib.nonblocking.map(|_| timeout);
        let made = comms.into_iter().zip(runtimes).zip(streams).enumerate();
        Ok(made
            .map(|(i, ((comm, rt), stream))| Self::wrap(lib, comm, rt, stream, first + i, size, settle_within))
            .collect())
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
        settle_within: Option<Duration>,
    ) -> Self {
        Self { lib, gate: AbortGate::new(), comm, compute: runtime.stream().clone(), stream, rank, size, settle_within }
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

    /// `code`, NCCL's answer to `what`, as a result: on a nonblocking communicator an
    /// `ncclInProgress` is waited out (the queueing goes on in the background, connecting to
    /// the peers on first use), ending early once the group is aborted.
    fn finish(&self, what: &str, code: i32) -> Result<()> {
        match self.settle_within {
            Some(within) if code == IN_PROGRESS => {
                settle(self.lib, &[self.comm], Instant::now() + within, what, || self.gate.live())?.ok_or_else(|| {
                    Error::Device {
                        what: format!("nccl: {what}"),
                        message: format!("still in progress after {within:?}: a peer has stalled or ended"),
                    }
                })
            }
            _ => self.lib.check(what, code),
        }
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
        Ok(made.map(|(rank, ((comm, rt), stream))| Self::wrap(lib, comm, rt, stream, rank, size, None)).collect())
    }
}

/// `code` with "in progress" read as success: a nonblocking call's work was queued, and what
/// becomes of it is [settled](settle) after the group's end.
fn as_queued(code: i32) -> i32 {
    if code == IN_PROGRESS { 0 } else { code }
}

/// How often a wait on nonblocking communicators asks NCCL how they are going.
const POLL: Duration = Duration::from_millis(1);

/// Makes members `first..first + count` of the `size` ranks of the group `id` names, inside
/// one NCCL group (`bind(i)` makes member `i`'s GPU current before its init is queued). With
/// NCCL ≥ 2.14 the communicators are nonblocking: the init returns at once and is
/// [settled](settle) until `timeout`, so a peer that died after the id was shared ends the
/// init with an error instead of a wait without end. An older NCCL's blocking init has no
/// such limit. Every communicator made is aborted if any part fails.
fn join(
    lib: &NcclLib,
    count: usize,
    first: usize,
    size: usize,
    id: [u8; ID_BYTES],
    timeout: Duration,
    bind: impl Fn(usize) -> Result<()>,
) -> Result<Vec<sys::ncclComm_t>> {
    let deadline = Instant::now() + timeout;
    let id = sys::ncclUniqueId { internal: id.map(|b| b as ::core::ffi::c_char) };
    let mut comms: Vec<sys::ncclComm_t> = vec![std::ptr::null_mut(); count];
    // SAFETY: opens a group that is closed below on every path.
    lib.check("group start", unsafe { (lib.group_start)() })?;
    let queued = comms.iter_mut().enumerate().try_for_each(|(i, comm)| {
        bind(i)?;
        let rank = (first + i) as i32;
        // SAFETY: NCCL writes the communicator; the id is the group's, the config outlives the call.
        let code = match lib.nonblocking {
            Some(nb) => unsafe {
                (nb.comm_init_rank_config)(comm, size as i32, id, rank, &mut InitConfig::nonblocking())
            },
            None => unsafe { (lib.comm_init_rank)(comm, size as i32, id, rank) },
        };
        lib.check("init", as_queued(code))
    });
    // SAFETY: closes the group opened above; blocking inits complete here, nonblocking ones
    // go on in the background.
    let code = unsafe { (lib.group_end)() };
    let closed = lib.check("group end", as_queued(code));
    let joined = queued.and(closed).and_then(|()| {
        settle(lib, &comms, deadline, "init", || Ok(()))?.ok_or_else(|| Error::Device {
            what: "nccl: init".into(),
            message: format!(
                "the group of {size} ranks was not complete after {timeout:?}: a peer process has ended or \
                 never started (its own error says why)"
            ),
        })
    });
    if let Err(e) = joined {
        for comm in comms.into_iter().filter(|c| !c.is_null()) {
            // SAFETY: a communicator NCCL created above; its peers may never come.
            let _ = unsafe { (lib.comm_abort)(comm) };
        }
        return Err(e);
    }
    Ok(comms)
}

/// Waits until the work NCCL queued on each of the nonblocking `comms` has ended, asking
/// every [`POLL`]: `Some(())` once all succeeded, `None` if some are still at work at
/// `deadline`; an error when NCCL reports one for `what`, or when `live` does (checked before
/// each question: an aborted communicator must not be asked). Blocking communicators (an NCCL
/// without nonblocking ones) have nothing to wait for.
fn settle(
    lib: &NcclLib,
    comms: &[sys::ncclComm_t],
    deadline: Instant,
    what: &str,
    live: impl Fn() -> Result<()>,
) -> Result<Option<()>> {
    let Some(nb) = lib.nonblocking else { return Ok(Some(())) };
    let mut pending: Vec<sys::ncclComm_t> = comms.to_vec();
    loop {
        live()?;
        let mut still = Vec::new();
        for &comm in &pending {
            let mut state = IN_PROGRESS;
            // SAFETY: a live communicator of ours (checked above); NCCL writes its state.
            lib.check(what, unsafe { (nb.get_async_error)(comm, &mut state) })?;
            match state {
                IN_PROGRESS => still.push(comm),
                state => lib.check(what, state)?,
            }
        }
        if still.is_empty() {
            return Ok(Some(()));
        }
        if Instant::now() >= deadline {
            return Ok(None);
        }
        pending = still;
        std::thread::sleep(POLL);
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
    // Every device a `cuda` one (so `D` is `GpuDevice`), or no NCCL.
    let Some(runtimes) = devices.iter().map(cuda_runtime).collect::<Option<Vec<_>>>() else { return Ok(None) };
    if r < 2 || !available() || runtimes.len() < k * r {
        return Ok(None);
    }
    let ordinals: Vec<usize> = runtimes.iter().map(|rt| rt.ordinal()).collect();
    if !one_gpu_per_rank(&ordinals, k, r) {
        return Ok(None);
    }
    let groups = (0..k)
        .map(|d| NcclCommunicator::group(&(0..r).map(|i| runtimes[i * k + d]).collect::<Vec<_>>()))
        .collect::<Result<Vec<_>>>()?;
    Ok(for_device(groups))
}

/// Whether each position's group of replicas (`ordinals[i·k + d]` for `i < r`) has its ranks on
/// GPUs of their own: NCCL refuses two ranks on one GPU, which devices sharing GPUs
/// ([`SHARE_GPUS`](crate::device::cuda::SHARE_GPUS)) would ask of it.
fn one_gpu_per_rank(ordinals: &[usize], k: usize, r: usize) -> bool {
    (0..k).all(|d| {
        let mut group: Vec<usize> = (0..r).map(|i| ordinals[i * k + d]).collect();
        group.sort_unstable();
        group.windows(2).all(|w| w[0] != w[1])
    })
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
    let runtimes: Option<Vec<&crate::device::cuda::CudaRuntime>> = devices.iter().take(r).map(cuda_runtime).collect();
    // A process whose device shares a GPU votes no: it cannot see whether another process's
    // rank sits on the same GPU, which NCCL would refuse.
    let runtimes =
        runtimes.filter(|rt| k == 1 && rt.len() == r && available() && !rt.iter().any(|rt| rt.borrows_gpu()));
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
    let members = NcclCommunicator::ranks(&runtimes, group.rank() * r, group.size() * r, id, group.timeout())?;
    Ok(for_device(vec![members]))
}

/// Whether every process of `group` `can`: a collective, made by every process at the same
/// point, so that all go on alike (one NCCL group over all, or none).
fn all_agree(group: &ProcessGroup, can: bool) -> Result<bool> {
    let mut votes = [f64::from(u8::from(can))];
    group.all_reduce_sum_f64(&mut votes)?;
    Ok(votes[0] == group.size() as f64)
}

/// The CUDA runtime under `d`, if `d` is a `cuda` device (not `cuda-emu`, not `cpu`).
fn cuda_runtime<D: crate::device::Device>(d: &D) -> Option<&crate::device::cuda::CudaRuntime> {
    (d as &dyn std::any::Any).downcast_ref::<GpuDevice>().and_then(crate::device::cuda::runtime_of)
}

/// Why replicas on `devices` cannot use NCCL, when they are real GPUs (`cuda`): the library did
/// not load (the places it was looked for), or devices share GPUs. `None` for other devices or
/// when NCCL can be used.
pub fn host_ring_reason<D: crate::device::Device>(devices: &[D]) -> Option<String> {
    let runtimes: Option<Vec<_>> = devices.iter().map(cuda_runtime).collect();
    let runtimes = runtimes.filter(|r| !r.is_empty())?;
    ring_reason(nccl().map(|_| ()), runtimes.iter().any(|rt| rt.borrows_gpu()))
}

/// [`host_ring_reason`] for real GPUs, given whether NCCL loaded and whether a device borrows
/// another's GPU.
fn ring_reason(loaded: std::result::Result<(), &str>, sharing: bool) -> Option<String> {
    match loaded {
        Err(why) => Some(not_loaded(why)),
        Ok(()) if sharing => Some(format!(
            "devices share GPUs ({}=1), and NCCL refuses two ranks on one GPU",
            crate::device::cuda::SHARE_GPUS
        )),
        Ok(()) => None,
    }
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
            let code = unsafe { (lib.all_reduce)(p, p, b.len(), FLOAT32, SUM, self.comm, stream) };
            // Inside a group a nonblocking call may say "in progress": the group's end settles it.
            lib.check("all-reduce", as_queued(code))
        });
        // An open group must be closed even when queueing failed, or every later NCCL call of
        // this thread joins the broken group.
        // SAFETY: closes the group opened above.
        let closed = self.finish("group end", unsafe { (lib.group_end)() });
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
        self.note(self.finish("broadcast", unsafe {
            (lib.broadcast)(p, p, buf.len(), FLOAT32, root as i32, self.comm, stream)
        }))?;
        self.complete(dev)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Two replicas of a two-stage pipeline on two GPUs have a GPU per rank when each stage's
    /// replicas sit on different GPUs; on one shared GPU (or with a stage's replicas placed on
    /// one GPU) they do not, and NCCL is not asked.
    #[test]
    fn nccl_only_where_every_rank_of_a_group_has_its_own_gpu() {
        assert!(one_gpu_per_rank(&[0, 1, 2, 3], 2, 2));
        assert!(one_gpu_per_rank(&[0, 0, 1, 1], 2, 2), "stages share a GPU, each group's ranks do not");
        assert!(!one_gpu_per_rank(&[0, 1, 0, 1], 2, 2), "replicas of a stage on one GPU");
        assert!(!one_gpu_per_rank(&[0, 0, 0, 0], 1, 4));
    }

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

    /// A stand-in NCCL 2.23.4 with nonblocking communicators whose behaviour a test sets:
    /// the code inits and group ends return, how many questions stay "in progress" (−1: for
    /// ever, a peer that never comes) and the state after them; it counts aborts and keeps what
    /// the last init's config said.
    const FAKE_NONBLOCKING: &str = r#"
        #include <stddef.h>
        typedef struct { char internal[128]; } id_t;
        typedef struct { size_t size; unsigned magic, version; int blocking, cga; } config_t;
        static int code = 7, polls = -1, final_state = 0, aborts = 0;
        static config_t seen;
        static char comms[64];
        void fake_behave(int c, int p, int f) { code = c; polls = p; final_state = f; aborts = 0; }
        int fake_aborts(void) { return aborts; }
        void fake_seen(config_t *c) { *c = seen; }
        int ncclGetVersion(int *v) { *v = 22304; return 0; }
        int ncclGetUniqueId(id_t *id) { return 0; }
        int ncclCommInitRank(void **c, int n, id_t id, int r) { return 5; }
        int ncclCommInitRankConfig(void **c, int n, id_t id, int r, config_t *cfg) {
            seen = *cfg; *c = &comms[r % 64]; return code;
        }
        int ncclCommGetAsyncError(void *c, int *state) {
            if (polls == 0) { *state = final_state; return 0; }
            if (polls > 0) polls--;
            *state = 7; return 0;
        }
        int ncclCommInitAll(void **c, int n, const int *d) { return 5; }
        int ncclCommDestroy(void *c) { return 0; }
        int ncclCommAbort(void *c) { aborts++; return 0; }
        int ncclGroupStart(void) { return 0; }
        int ncclGroupEnd(void) { return code; }
        int ncclAllReduce(const void *s, void *r, unsigned long n, int t, int o, void *c, void *st) { return 5; }
        int ncclBroadcast(const void *s, void *r, unsigned long n, int t, int root, void *c, void *st) { return 5; }
        const char *ncclGetErrorString(int c) { return c == 6 ? "remote process exited or there was a network error (fake)" : "other"; }
    "#;

    /// A group that spans processes joins within its timeout or fails: a peer that never comes
    /// ends the init with an error after the timeout (not a wait without end) and every
    /// communicator made is aborted; peers that come late are waited for; an error a peer
    /// causes is NCCL's own words; a collective's wait ends as soon as the group is aborted.
    #[test]
    fn a_spanning_group_joins_within_its_timeout_or_fails() {
        let home = crate::testing::Scratch::new("fake-nccl-nonblocking");
        let Some(path) = super::super::nccl_lib::build_fake(&home, "libnccl-nonblocking.so", FAKE_NONBLOCKING) else {
            return;
        };
        let lib = super::super::nccl_lib::load(std::slice::from_ref(&path)).unwrap();
        assert!(lib.nonblocking.is_some(), "2.23 with ncclCommInitRankConfig: nonblocking");
        // SAFETY: the fake's own C functions, under their C signatures.
        let fake = unsafe { libloading::Library::new(&path) }.unwrap();
        let behave = unsafe { fake.get::<unsafe extern "C" fn(i32, i32, i32)>(b"fake_behave") }.unwrap();
        let aborts = unsafe { fake.get::<unsafe extern "C" fn() -> i32>(b"fake_aborts") }.unwrap();
        let seen = unsafe { fake.get::<unsafe extern "C" fn(*mut InitConfig)>(b"fake_seen") }.unwrap();
        let bound = std::sync::Mutex::new(Vec::new());
        let bind = |i: usize| {
            bound.lock().unwrap().push(i);
            Ok(())
        };

        // A peer that never comes: an error after the timeout, both communicators aborted.
        unsafe { behave(IN_PROGRESS, -1, 0) };
        let started = Instant::now();
        let e = join(&lib, 2, 2, 4, [0; ID_BYTES], Duration::from_millis(300), bind).unwrap_err().to_string();
        let took = started.elapsed();
        assert!(took >= Duration::from_millis(300) && took < Duration::from_secs(10), "{took:?}");
        assert!(e.contains("nccl: init") && e.contains("group of 4 ranks was not complete after 300ms"), "{e}");
        assert_eq!(unsafe { aborts() }, 2);
        assert_eq!(*bound.lock().unwrap(), [0, 1], "each member's GPU bound before its init");
        // What NCCL was handed: a 2.14 config head asking for a nonblocking communicator.
        let mut config = InitConfig::nonblocking();
        unsafe { seen(&mut config) };
        let bytes = |c: &InitConfig| unsafe {
            std::slice::from_raw_parts((c as *const InitConfig).cast::<u8>(), std::mem::size_of::<InitConfig>())
                .to_vec()
        };
        assert_eq!(bytes(&config), bytes(&InitConfig::nonblocking()));
        assert_eq!(std::mem::size_of::<InitConfig>(), 24);
        assert_eq!(&bytes(&config)[..24], {
            let mut want = 24usize.to_ne_bytes().to_vec();
            want.extend(0xcafe_beefu32.to_ne_bytes());
            want.extend(21400u32.to_ne_bytes());
            want.extend(0i32.to_ne_bytes()); // blocking = 0
            want.extend(i32::MIN.to_ne_bytes());
            want
        });

        // Peers that come after a while: the communicators are made, none aborted.
        unsafe { behave(IN_PROGRESS, 5, 0) };
        let comms = join(&lib, 2, 0, 2, [0; ID_BYTES], Duration::from_secs(30), |_| Ok(())).unwrap();
        assert!(comms.iter().all(|c| !c.is_null()) && comms[0] != comms[1]);
        assert_eq!(unsafe { aborts() }, 0);

        // A peer's failure: NCCL's words for it, the communicators aborted.
        unsafe { behave(IN_PROGRESS, 2, 6) };
        let e = join(&lib, 1, 0, 2, [0; ID_BYTES], Duration::from_secs(30), |_| Ok(())).unwrap_err().to_string();
        assert!(e.contains("nccl: init") && e.contains("remote process exited") && e.contains("code 6"), "{e}");
        assert_eq!(unsafe { aborts() }, 1);

        // A GPU that cannot be bound: the error, and no init left queued.
        unsafe { behave(0, 0, 0) };
        let refuse = |i: usize| {
            if i == 1 { Err(Error::Device { what: "gpu 1".into(), message: "gone".into() }) } else { Ok(()) }
        };
        let e = join(&lib, 2, 0, 2, [0; ID_BYTES], Duration::from_secs(30), refuse).unwrap_err().to_string();
        assert!(e.contains("gpu 1"), "{e}");
        assert_eq!(unsafe { aborts() }, 1, "the one communicator made");

        // A collective's wait on a stalled peer ends as soon as the group is aborted, without
        // asking NCCL about the freed communicator again.
        unsafe { behave(IN_PROGRESS, -1, 0) };
        let gate = AbortGate::new();
        let started = Instant::now();
        std::thread::scope(|s| {
            s.spawn(|| {
                std::thread::sleep(Duration::from_millis(200));
                gate.abort(QUEUEING_GRACE, || {});
            });
            let waited = settle(&lib, &comms, Instant::now() + Duration::from_secs(60), "all-reduce", || gate.live());
            let e = waited.unwrap_err().to_string();
            assert!(e.contains("aborted"), "{e}");
        });
        assert!(started.elapsed() < Duration::from_secs(10), "{:?}", started.elapsed());
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
        // On real GPUs: a missing NCCL says so first; a loaded one is skipped only where
        // devices share GPUs, naming the variable that made them.
        assert_eq!(ring_reason(Err(&why), true), Some(note));
        assert_eq!(ring_reason(Ok(()), false), None);
        let shared = ring_reason(Ok(()), true).unwrap_or_default();
        assert!(shared.contains("PT_SHARE_GPUS=1") && shared.contains("two ranks on one GPU"), "{shared}");
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
