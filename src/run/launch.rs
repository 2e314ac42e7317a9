//! `pipetransformer launch`: one training process per device, on one node or several, with
//! `torchrun`'s conventions. The launcher starts `--nproc-per-node` copies of this program,
//! each told who it is through the environment torchrun sets (`RANK`, `LOCAL_RANK`,
//! `WORLD_SIZE`, `LOCAL_WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT`) plus the run's secret
//! (`PT_RDZV_TOKEN`); each process finds the others at the rendezvous, trains its shard of
//! every global batch ([`ProcessGroup`]), and only rank 0 writes the run's files. The launcher
//! watches its children: the first to fail ends the launch with its rank and status, and the
//! rest are stopped if they have not ended by themselves within [`GRACE`]. (Their TCP
//! collectives fail as soon as a peer's connection closes; an NCCL collective waits until the
//! step's watchdog aborts it, at the group's timeout.) A launcher that is killed takes its
//! children with it: the kernel kills each when the launcher ends. The children's
//! output passes through the launcher, each line led by its process's rank (`[rank 1] …`).
//!
//! A signal to the launcher (Ctrl-C, a scheduler's SIGTERM) is passed on to every process as
//! SIGTERM, a request to stop: the processes agree on it and end after the same step with
//! their checkpoint written, each exiting with [`INTERRUPTED_EXIT_CODE`], and the launch ends
//! with [`Error::Interrupted`]. A second signal kills them at once.

use crate::comm::process_group::{COLLECTIVE_TIMEOUT, ProcessGroup};
use crate::comm::rendezvous::{MAX_GROUP, Secret};
use crate::error::{Error, INTERRUPTED_EXIT_CODE, Result, config_error};
use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::process::ExitStatusExt;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// How long the launcher lets the other processes end on their own after one failed.
pub const GRACE: Duration = Duration::from_secs(20);

/// The longest `PT_COLLECTIVE_TIMEOUT` taken: a week, far beyond any collective, and far from
/// where adding it to the clock could overflow.
const MAX_COLLECTIVE_TIMEOUT: Duration = Duration::from_secs(7 * 24 * 3600);

/// The shortest `PT_COLLECTIVE_TIMEOUT` taken: a second. Shorter, the rendezvous itself (a
/// connection, a handshake) times out before anything is tried.
const MIN_COLLECTIVE_TIMEOUT: Duration = Duration::from_secs(1);

/// Where rank 0 listens when `--rdzv` is not given: loopback, one node.
pub const LOOPBACK_RDZV: &str = "127.0.0.1:29500";

/// What `launch` was asked. Its `Debug` leaves the secret out.
#[derive(Clone)]
pub struct LaunchOptions {
    /// Processes on this node (one per device).
    pub nproc_per_node: usize,
    /// Nodes in the run.
    pub nnodes: usize,
    /// This node's index.
    pub node_rank: usize,
    /// Where rank 0 listens: `HOST:PORT`; `None`, [`LOOPBACK_RDZV`], which reaches this
    /// machine alone, so a run over several nodes must name it.
    pub rdzv: Option<String>,
    /// The run's secret (`--rdzv-token` or `PT_RDZV_TOKEN`); a random one on a single node.
    pub token: Option<String>,
    /// How long the others may take to end after one failed ([`GRACE`] by default).
    pub grace: Duration,
}

impl std::fmt::Debug for LaunchOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LaunchOptions")
            .field("nproc_per_node", &self.nproc_per_node)
            .field("nnodes", &self.nnodes)
            .field("node_rank", &self.node_rank)
            .field("rdzv", &self.rdzv)
            .field("token", &self.token.as_ref().map(|_| "(given, not shown)"))
            .field("grace", &self.grace)
            .finish()
    }
}

impl LaunchOptions {
    fn validate(&self) -> Result<()> {
        for (flag, value) in [("--nproc-per-node", self.nproc_per_node), ("--nnodes", self.nnodes)] {
            if value == 0 {
                return Err(config_error(flag, "is 0; expected at least 1"));
            }
        }
        if self.node_rank >= self.nnodes {
            return Err(config_error(
                "--node-rank",
                format!("is {}; expected below --nnodes {}", self.node_rank, self.nnodes),
            ));
        }
        self.world()?;
        if self.nnodes > 1 && self.rdzv.is_none() {
            return Err(config_error(
                "--rdzv",
                format!(
                    "a run over {} nodes needs the address of node 0, HOST:PORT, on every node (the default, \
                     {LOOPBACK_RDZV}, reaches this machine alone: give it to run every node here)",
                    self.nnodes
                ),
            ));
        }
        split_addr(self.rdzv(), "--rdzv")?;
        if self.nnodes > 1 && self.token.is_none() {
            return Err(config_error(
                "--rdzv-token",
                "a run over several nodes needs a shared secret: pass --rdzv-token or set PT_RDZV_TOKEN on every node",
            ));
        }
        Ok(())
    }

    /// Where rank 0 listens.
    fn rdzv(&self) -> &str {
        self.rdzv.as_deref().unwrap_or(LOOPBACK_RDZV)
    }

    /// Processes in the run: `--nproc-per-node` × `--nnodes`, at most [`MAX_GROUP`].
    fn world(&self) -> Result<usize> {
        let (n, nodes) = (self.nproc_per_node, self.nnodes);
        self.nproc_per_node.checked_mul(self.nnodes).filter(|w| *w <= MAX_GROUP).ok_or_else(|| {
            config_error(
                "--nproc-per-node × --nnodes",
                format!("{n} × {nodes} processes; expected at most {MAX_GROUP} in all"),
            )
        })
    }
}

/// `addr` (from `what`: a flag or variables) as a host and a port other than 0: rank 0 listens
/// on it and the others connect to it, so the OS must not pick it.
fn split_addr<'a>(addr: &'a str, what: &str) -> Result<(&'a str, u16)> {
    let bad = || {
        config_error(what, format!("`{addr}`; expected HOST:PORT with a port from 1 to 65535, e.g. 127.0.0.1:29500"))
    };
    let (host, port) = addr.rsplit_once(':').ok_or_else(bad)?;
    let port = port.parse().ok().filter(|p| *p != 0).ok_or_else(bad)?;
    if host.is_empty() {
        return Err(bad());
    }
    Ok((host, port))
}

/// Starts the node's processes running `program args` and waits for them. `Ok` when every
/// one succeeded; else the first failure, by rank, with its exit status.
pub fn launch(options: &LaunchOptions, program: &std::path::Path, args: &[String]) -> Result<()> {
    options.validate()?;
    let secret = match &options.token {
        Some(t) => Secret::new(t.clone())?,
        None => Secret::random()?,
    };
    let (host, port) = split_addr(options.rdzv(), "--rdzv")?;
    // Rank 0, on the first node, listens there: a port another program holds is said now, not
    // after the other ranks have waited on that program. (Bound and let go at once; a host
    // that is not this machine's is left to rank 0 to report.)
    if options.node_rank == 0
        && let Err(e) = std::net::TcpListener::bind((host, port))
        && e.kind() == std::io::ErrorKind::AddrInUse
    {
        return Err(config_error(
            "--rdzv",
            format!(
                "{host}:{port}, where rank 0 listens, is in use by another program ({e}): pass --rdzv {host}:PORT with a free port"
            ),
        ));
    }
    let world = options.world()?;
    let launcher = std::process::id();
    let mut children: Vec<(usize, Child)> = Vec::new();
    let mut relays = Vec::new();
    for local in 0..options.nproc_per_node {
        // No overflow: below `world`, as node_rank < nnodes.
        let rank = options.node_rank * options.nproc_per_node + local;
        let mut command = Command::new(program);
        #[cfg(target_os = "linux")]
        {
            use std::os::unix::process::CommandExt;
            // SAFETY: the closure runs in the child between fork and exec, where only
            // async-signal-safe calls are sound; `die_with_parent` makes two system calls and
            // neither allocates nor takes a lock.
            unsafe { command.pre_exec(move || die_with_parent(launcher)) };
            // A process group of its own: the terminal's Ctrl-C reaches the launcher alone,
            // which passes it on once (each child would otherwise take it twice).
            command.process_group(0);
        }
        let child = command
            .args(args)
            .env("RANK", rank.to_string())
            .env("LOCAL_RANK", local.to_string())
            .env("WORLD_SIZE", world.to_string())
            .env("LOCAL_WORLD_SIZE", options.nproc_per_node.to_string())
            .env("MASTER_ADDR", host)
            .env("MASTER_PORT", port.to_string())
            .env("PT_RDZV_TOKEN", secret.expose())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn();
        match child {
            Ok(mut c) => {
                relays
                    .extend(c.stdout.take().map(|out| relay_thread(rank, out, || Box::new(std::io::stdout().lock()))));
                relays
                    .extend(c.stderr.take().map(|err| relay_thread(rank, err, || Box::new(std::io::stderr().lock()))));
                children.push((rank, c));
            }
            Err(e) => {
                let started = match children.len() {
                    0 => String::new(),
                    n => format!("; the {n} started before it were stopped"),
                };
                stop(&mut children);
                return Err(Error::Device {
                    what: format!("launch: rank {rank}"),
                    message: format!("cannot start {}: {e}{started}", program.display()),
                });
            }
        }
    }
    pass_signals_on();
    let watched = watch(children, options.grace, &|| SIGNALS.load(Ordering::Relaxed));
    // Every child has ended, so its pipes are at their end: the last lines go out before the
    // launcher's own verdict. (Unless a process the child started holds them open: that
    // one's lines are not waited for beyond a second.)
    let deadline = Instant::now() + Duration::from_secs(1);
    while relays.iter().any(|r| !r.is_finished()) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(5));
    }
    watched
}

type Sink = Box<dyn Write>;

fn relay_thread(rank: usize, from: impl Read + Send + 'static, to: fn() -> Sink) -> JoinHandle<()> {
    std::thread::spawn(move || relay(rank, BufReader::new(from), to))
}

/// Copies one stream of a child to `to` line by line, each line led by the child's rank and
/// written whole under `to`'s lock, so that the lines of several processes can be told apart
/// and none is cut into another's. A last line without its newline gets one. When the
/// launcher's own output is gone (a closed pipe) the child's is still read and dropped, so the
/// child never blocks on a full pipe.
fn relay(rank: usize, mut from: impl BufRead, mut to: impl FnMut() -> Sink) {
    let prefix = format!("[rank {rank}] ");
    let mut line = Vec::new();
    loop {
        line.clear();
        match from.read_until(b'\n', &mut line) {
            Ok(0) | Err(_) => return,
            Ok(_) => {}
        }
        if !line.ends_with(b"\n") {
            line.push(b'\n');
        }
        let mut sink = to();
        let _ = sink.write_all(prefix.as_bytes()).and_then(|()| sink.write_all(&line)).and_then(|()| sink.flush());
    }
}

/// In a child, between fork and exec: asks the kernel to kill it (SIGKILL) when the launcher
/// ends, so that killing the launcher alone does not leave its children training. (Not
/// SIGTERM: a launched process takes that as a request to stop after a step, and its console
/// went with the launcher.) A launcher
/// that ended before the request was made cannot send it any more: the child's parent is then
/// another process, and the child does not start. (The kernel sends it when the thread that
/// spawned the child ends: `launch` spawns from the thread that then watches the children.)
/// Async-signal-safe: only `prctl` and `getppid`, and errors built from errno, which allocate
/// nothing.
#[cfg(target_os = "linux")]
fn die_with_parent(launcher: u32) -> std::io::Result<()> {
    // SAFETY: plain system calls on this process, with integer arguments.
    if unsafe { libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: as above.
    if i64::from(unsafe { libc::getppid() }) != i64::from(launcher) {
        return Err(std::io::Error::from_raw_os_error(libc::ESRCH));
    }
    Ok(())
}

/// Signals the launcher has taken (SIGINT, SIGTERM, SIGHUP), counted by its handler.
static SIGNALS: AtomicUsize = AtomicUsize::new(0);

/// Counts the launcher's signals in [`SIGNALS`] instead of letting them end it: [`watch`]
/// passes them on to the children.
fn pass_signals_on() {
    extern "C" fn on_signal(_: libc::c_int) {
        SIGNALS.fetch_add(1, Ordering::Relaxed); // one atomic add: async-signal-safe
    }
    catch_signals(&[libc::SIGINT, libc::SIGTERM, libc::SIGHUP], on_signal, false);
}

/// Runs `handler` on each of `signals` instead of their default action; `once`: only the
/// first of each, the next ending the process as by default. `SA_RESTART`: a read or accept
/// under way goes on rather than failing with EINTR. The handler must be async-signal-safe
/// (an atomic store, say).
pub fn catch_signals(signals: &[libc::c_int], handler: extern "C" fn(libc::c_int), once: bool) {
    // SAFETY: a zeroed sigaction is valid; the caller's handler is async-signal-safe.
    unsafe {
        let mut action: libc::sigaction = std::mem::zeroed();
        action.sa_sigaction = handler as libc::sighandler_t;
        action.sa_flags = if once { libc::SA_RESETHAND | libc::SA_RESTART } else { libc::SA_RESTART };
        libc::sigemptyset(&mut action.sa_mask);
        for &signal in signals {
            libc::sigaction(signal, &action, std::ptr::null_mut());
        }
    }
}

/// Waits for every child; after the first failure, gives the rest `grace` to end, then
/// kills them. `signals` counts the signals the launcher has taken: at the first, each child
/// is sent SIGTERM (a request to stop after its step); at the second, each is killed. A child
/// that ends with [`INTERRUPTED_EXIT_CODE`] stopped on such a request; one that the signal
/// itself ended (before it took requests: at the rendezvous, or building) failed, and says so.
fn watch(mut children: Vec<(usize, Child)>, grace: Duration, signals: &dyn Fn() -> usize) -> Result<()> {
    let mut failure: Option<(usize, String, Instant)> = None;
    // Those still running `grace` after the failure, killed then.
    let mut killed = Vec::new();
    // Signals passed on so far, and the ranks that stopped on a request.
    let (mut passed_on, mut interrupted) = (0, Vec::new());
    while !children.is_empty() {
        let taken = signals();
        if taken > passed_on {
            if passed_on == 0 {
                eprintln!(
                    "launch: stopping: every rank ends after the step under way with its checkpoint written (a second \
                     signal ends them at once)"
                );
                for (_, child) in &children {
                    // SAFETY: a signal to a child this launcher started and has not reaped.
                    unsafe { libc::kill(child.id() as libc::pid_t, libc::SIGTERM) };
                }
            }
            if taken >= 2 {
                let ranks: Vec<usize> = children.iter().map(|(rank, _)| *rank).collect();
                stop(&mut children);
                return Err(Error::Device {
                    what: "launch".into(),
                    message: format!(
                        "a second signal: ranks {ranks:?} were killed (each keeps the last checkpoint it wrote)"
                    ),
                });
            }
            passed_on = taken;
        }
        let mut ended = Vec::new();
        children.retain_mut(|(rank, child)| match child.try_wait() {
            Ok(None) => true,
            Ok(Some(status)) => {
                ended.push((*rank, Ok(status)));
                false
            }
            Err(e) => {
                ended.push((*rank, Err(format!("cannot be watched: {e}"))));
                false
            }
        });
        ended.retain(|(rank, status)| {
            let stopped = status.as_ref().is_ok_and(|s| s.code() == Some(i32::from(INTERRUPTED_EXIT_CODE)));
            if stopped {
                interrupted.push(*rank);
            }
            !stopped
        });
        if failure.is_none() {
            failure = first_failure(&ended).map(|(rank, why)| (rank, why, Instant::now()));
        }
        if let Some((_, _, at)) = &failure
            && at.elapsed() > grace
        {
            killed.extend(children.iter().map(|(rank, _)| *rank));
            stop(&mut children);
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let Some((rank, status, _)) = failure else {
        return match interrupted.is_empty() {
            true => Ok(()),
            false => Err(Error::Interrupted { step: None, unwritten: None }),
        };
    };
    // A process ended by a signal printed nothing of its own: say where the signal may have
    // come from.
    let outside = ["SIGKILL", "SIGTERM", "SIGINT", "SIGHUP"].iter().any(|s| status.contains(&format!("({s})")));
    let cause = match outside {
        true if passed_on > 0 && !status.contains("(SIGKILL)") => {
            "the signal passed on ended it before it took stop requests (at the rendezvous, or building): it wrote \
             no checkpoint"
                .into()
        }
        true => "a signal from outside the run: a kill, or the kernel's out-of-memory killer (`dmesg` tells)".into(),
        false => format!("see rank {rank}'s error above"),
    };
    let rest = match killed.is_empty() {
        true => String::new(),
        false => format!("; ranks {killed:?} had not ended {grace:?} after it and were killed"),
    };
    Err(Error::Device { what: format!("launch: rank {rank}"), message: format!("{status} ({cause}){rest}") })
}

/// Of the children seen to have ended in one look (rank and status, in rank order), the
/// failure to report: one killed by a signal before any other, since the others' errors are
/// most likely about it (a process fails as soon as a peer's connection closes); else the first.
fn first_failure(ended: &[(usize, std::result::Result<ExitStatus, String>)]) -> Option<(usize, String)> {
    ended
        .iter()
        .filter_map(|(rank, status)| match status {
            Ok(s) if s.success() => None,
            Ok(s) => Some((*rank, s.to_string(), s.signal().is_some())),
            Err(why) => Some((*rank, why.clone(), false)),
        })
        .min_by_key(|&(_, _, killed)| !killed) // the first of the least
        .map(|(rank, why, _)| (rank, why))
}

fn stop(children: &mut Vec<(usize, Child)>) {
    for (_, c) in children.iter_mut() {
        let _ = c.kill();
        let _ = c.wait();
    }
    children.clear();
}

/// Who this process is in a launched run, read from the environment the launcher (or
/// torchrun, or a cluster's own launcher) sets.
#[derive(Clone, Debug)]
pub struct ProcessEnv {
    /// Global rank.
    pub rank: usize,
    /// Processes in the run.
    pub world: usize,
    /// Processes on this node.
    pub local_world: usize,
    /// Rank on this node.
    local_rank: usize,
    /// Rank 0's rendezvous address.
    pub addr: String,
    secret: Secret,
}

impl ProcessEnv {
    /// The launch this process belongs to; `None` when `WORLD_SIZE` is unset or 1 (a run on
    /// its own). Bad values are errors naming the variable.
    pub fn from_env() -> Result<Option<Self>> {
        Self::from_vars(|k| std::env::var(k).ok())
    }

    /// [`from_env`](Self::from_env) over any source of variables.
    pub fn from_vars(var: impl Fn(&str) -> Option<String>) -> Result<Option<Self>> {
        let number = |k: &str| -> Result<Option<usize>> {
            var(k)
                .map(|v| v.parse().map_err(|_| config_error(k, format!("`{v}`; expected a whole number"))))
                .transpose()
        };
        let world = number("WORLD_SIZE")?.unwrap_or(1);
        if world == 0 {
            return Err(config_error("WORLD_SIZE", "is 0; expected at least 1 process"));
        }
        if world == 1 {
            // (One process: its rank, where set, can only be 0.)
            if let Some(rank) = number("RANK")?.filter(|&r| r != 0) {
                return Err(config_error("RANK", format!("is {rank}; expected below WORLD_SIZE 1")));
            }
            return Ok(None);
        }
        if world > MAX_GROUP {
            return Err(config_error("WORLD_SIZE", format!("is {world}; expected at most {MAX_GROUP}")));
        }
        let need = |k: &str| var(k).ok_or_else(|| config_error(k, "is not set; `pipetransformer launch` sets it"));
        let rank = number("RANK")?.ok_or_else(|| config_error("RANK", "is not set"))?;
        if rank >= world {
            return Err(config_error("RANK", format!("is {rank}; expected below WORLD_SIZE {world}")));
        }
        let local_world = number("LOCAL_WORLD_SIZE")?.unwrap_or(world).max(1);
        if local_world > world {
            return Err(config_error(
                "LOCAL_WORLD_SIZE",
                format!("is {local_world}; expected at most WORLD_SIZE {world}"),
            ));
        }
        let local_rank = number("LOCAL_RANK")?.unwrap_or(rank % local_world);
        if local_rank >= local_world {
            return Err(config_error(
                "LOCAL_RANK",
                format!("is {local_rank}; expected below LOCAL_WORLD_SIZE {local_world}"),
            ));
        }
        let port = need("MASTER_PORT")?;
        if !port.parse::<u16>().is_ok_and(|p| p != 0) {
            return Err(config_error("MASTER_PORT", format!("is `{port}`; expected a port from 1 to 65535")));
        }
        let addr = format!("{}:{port}", need("MASTER_ADDR")?);
        split_addr(&addr, "MASTER_ADDR")?;
        let secret = Secret::new(need("PT_RDZV_TOKEN")?)?;
        Ok(Some(ProcessEnv { rank, world, local_world, local_rank, addr, secret }))
    }

    /// Rank on this node (which of the node's devices are this process's).
    pub fn local_rank(&self) -> usize {
        self.local_rank
    }

    /// This process's share of its node for a run of `devices` devices per process: the first
    /// of the node's devices it opens, and the cpu threads its devices may use in all
    /// (`threads`, or when that is 0 the node's `cores` split evenly over its processes, so
    /// that processes of cpu devices do not oversubscribe the cores).
    pub fn node_share(&self, devices: usize, threads: usize, cores: usize) -> (usize, usize) {
        let threads = if threads == 0 { (cores / self.local_world).max(1) } else { threads };
        // Saturating: a count of devices that large names no device, and opening it says so.
        (self.local_rank.saturating_mul(devices), threads)
    }

    /// A warning where `threads` set for each process (0: the cores split, one each at least)
    /// give the node's processes together more threads than its `cores`: their pools'
    /// spinning workers then contend for the cores.
    pub fn oversubscribes(&self, threads: usize, cores: usize) -> Option<String> {
        let n = self.local_world;
        if threads == 0 {
            return (n > cores).then(|| {
                format!(
                    "this node's {n} processes are more than its {}: each runs one thread, {n} in all, and they \
                     contend for the cores (launch at most {cores} a node)",
                    crate::error::counted(cores, "core")
                )
            });
        }
        let total = threads.saturating_mul(self.local_world);
        (total > cores).then(|| {
            format!(
                "output.threads = {threads} in each of this node's {} processes is {total} threads on {cores} cores: \
                 they contend for them (0 splits the cores among the processes)",
                self.local_world
            )
        })
    }

    /// Where this process writes a file the user named `path` for the whole run (`--trace`):
    /// rank 0 at `path`, rank r beside it as `STEM.rank{r}.EXT`, so none overwrites another's.
    pub fn own_file(&self, path: &std::path::Path) -> std::path::PathBuf {
        rank_file(path, self.rank)
    }

    /// Meets the other processes; collectives then wait `PT_COLLECTIVE_TIMEOUT` seconds (default
    /// [`COLLECTIVE_TIMEOUT`]) for a peer.
    pub fn join(&self) -> Result<ProcessGroup> {
        let timeout = collective_timeout(std::env::var("PT_COLLECTIVE_TIMEOUT").ok().as_deref())?;
        ProcessGroup::join(&self.addr, self.rank, self.world, &self.secret, timeout)
    }
}

/// [`ProcessEnv::own_file`] for `rank`.
fn rank_file(path: &std::path::Path, rank: usize) -> std::path::PathBuf {
    if rank == 0 {
        return path.to_path_buf();
    }
    let stem = path.file_stem().unwrap_or_default().to_string_lossy();
    let ext = path.extension().map(|e| format!(".{}", e.to_string_lossy())).unwrap_or_default();
    path.with_file_name(format!("{stem}.rank{rank}{ext}"))
}

/// `PT_COLLECTIVE_TIMEOUT`'s value (seconds, more than 0 and at most [`MAX_COLLECTIVE_TIMEOUT`]),
/// or [`COLLECTIVE_TIMEOUT`] unset.
fn collective_timeout(value: Option<&str>) -> Result<Duration> {
    let Some(v) = value else { return Ok(COLLECTIVE_TIMEOUT) };
    // Not finite, negative or too large for a Duration: an error from try_from, not a panic.
    v.parse::<f64>()
        .ok()
        .and_then(|s| Duration::try_from_secs_f64(s).ok())
        .filter(|d| *d >= MIN_COLLECTIVE_TIMEOUT && *d <= MAX_COLLECTIVE_TIMEOUT)
        .ok_or_else(|| {
            config_error(
                "PT_COLLECTIVE_TIMEOUT",
                format!(
                    "`{v}`; expected seconds, at least {} and at most {} (a week)",
                    MIN_COLLECTIVE_TIMEOUT.as_secs(),
                    MAX_COLLECTIVE_TIMEOUT.as_secs()
                ),
            )
        })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;
    use std::sync::{Arc, Mutex};

    #[test]
    fn each_rank_writes_its_own_file_beside_rank_zeros() {
        assert_eq!(rank_file(Path::new("out/trace.json"), 0), Path::new("out/trace.json"));
        assert_eq!(rank_file(Path::new("out/trace.json"), 3), Path::new("out/trace.rank3.json"));
        assert_eq!(rank_file(Path::new("trace"), 1), Path::new("trace.rank1"));
        assert_eq!(rank_file(Path::new("a.b/t.tar.gz"), 2), Path::new("a.b/t.tar.rank2.gz"));
    }

    /// A sink the test reads back, or one whose reader is gone.
    struct Shared(Arc<Mutex<Vec<u8>>>, bool);

    impl Write for Shared {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            if self.1 {
                return Err(std::io::ErrorKind::BrokenPipe.into());
            }
            self.0.lock().unwrap().extend_from_slice(buf);
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn a_childs_lines_are_relayed_whole_and_led_by_its_rank() {
        let out = Arc::new(Mutex::new(Vec::new()));
        let child = b"step 1/4\n\xffraw bytes\n\nno newline at the end";
        let mut from = std::io::Cursor::new(&child[..]);
        relay(3, &mut from, || Box::new(Shared(out.clone(), false)));
        let want = b"[rank 3] step 1/4\n[rank 3] \xffraw bytes\n[rank 3] \n[rank 3] no newline at the end\n";
        assert_eq!(String::from_utf8_lossy(&out.lock().unwrap()), String::from_utf8_lossy(want));
        // A launcher that cannot write any more still reads the child's output to its end.
        let mut from = std::io::Cursor::new(&child[..]);
        relay(0, &mut from, || Box::new(Shared(out.clone(), true)));
        assert_eq!(from.position(), child.len() as u64);
    }

    #[test]
    fn the_environment_is_read_strictly() {
        let vars = |pairs: &'static [(&'static str, &'static str)]| {
            move |k: &str| pairs.iter().find(|(n, _)| *n == k).map(|(_, v)| v.to_string())
        };
        assert!(ProcessEnv::from_vars(vars(&[])).unwrap().is_none());
        assert!(ProcessEnv::from_vars(vars(&[("WORLD_SIZE", "1")])).unwrap().is_none());
        assert!(ProcessEnv::from_vars(vars(&[("WORLD_SIZE", "1"), ("RANK", "0")])).unwrap().is_none());
        let e = ProcessEnv::from_vars(vars(&[("WORLD_SIZE", "1"), ("RANK", "5")])).unwrap_err().to_string();
        assert!(e.contains("RANK") && e.contains("is 5; expected below WORLD_SIZE 1"), "{e}");
        const FULL: &[(&str, &str)] = &[
            ("WORLD_SIZE", "4"),
            ("RANK", "3"),
            ("LOCAL_WORLD_SIZE", "2"),
            ("LOCAL_RANK", "1"),
            ("MASTER_ADDR", "127.0.0.1"),
            ("MASTER_PORT", "29500"),
            ("PT_RDZV_TOKEN", "k"),
        ];
        let e = ProcessEnv::from_vars(vars(FULL)).unwrap().unwrap();
        assert_eq!((e.rank, e.world, e.local_world, e.addr.as_str()), (3, 4, 2, "127.0.0.1:29500"));
        // Local rank 1 of 2 on a 16-core node, 2 devices per process: devices 2 and 3, half
        // the cores; a thread count the run set is kept.
        assert_eq!(e.node_share(2, 0, 16), (2, 8));
        assert_eq!(e.node_share(2, 3, 16), (2, 3));
        assert_eq!(e.node_share(1, 0, 1), (1, 1), "at least one thread");
        // Threads set per process beyond the node's cores are warned about; the split is not.
        let warned = e.oversubscribes(2, 2).unwrap_or_default();
        assert!(warned.contains("output.threads = 2 in each of this node's 2 processes is 4 threads on 2 cores"));
        assert_eq!((e.oversubscribes(0, 2), e.oversubscribes(1, 2)), (None, None));
        let warned = e.oversubscribes(0, 1).unwrap_or_default();
        assert!(warned.contains("this node's 2 processes are more than its 1 core:"), "{warned}");
        for (k, v, says) in [
            ("WORLD_SIZE", "four", "whole number"),
            ("WORLD_SIZE", "0", "is 0; expected at least 1 process"),
            ("RANK", "4", "below WORLD_SIZE"),
            ("MASTER_PORT", "x", "environment variable `MASTER_PORT`: is `x`; expected a port from 1 to 65535"),
            ("MASTER_PORT", "0", "a port from 1 to 65535"),
            ("MASTER_PORT", "99999", "environment variable `MASTER_PORT`: is `99999`"),
            ("PT_RDZV_TOKEN", "", "PT_RDZV_TOKEN"),
            ("WORLD_SIZE", "100000", "is 100000; expected at most 65536"),
            ("LOCAL_WORLD_SIZE", "5", "is 5; expected at most WORLD_SIZE 4"),
            ("LOCAL_RANK", "2", "is 2; expected below LOCAL_WORLD_SIZE 2"),
            ("LOCAL_RANK", "18446744073709551615", "LOCAL_RANK"),
        ] {
            let changed: Vec<(&str, String)> =
                FULL.iter().map(|&(n, w)| (n, if n == k { v.to_string() } else { w.to_string() })).collect();
            let e = ProcessEnv::from_vars(|q| changed.iter().find(|(n, _)| *n == q).map(|(_, v)| v.clone()));
            let e = e.unwrap_err().to_string();
            assert!(e.contains(k) && e.contains(says), "{k}={v}: {e}");
        }
        assert_eq!(collective_timeout(None).unwrap(), COLLECTIVE_TIMEOUT);
        assert_eq!(collective_timeout(Some("2.5")).unwrap(), Duration::from_millis(2500));
        for bad in ["0", "-1", "inf", "NaN", "soon", "1e-12", "0.000001", "0.5", "1e19", "1e20", "604801"] {
            let e = collective_timeout(Some(bad)).unwrap_err().to_string();
            assert!(e.contains("PT_COLLECTIVE_TIMEOUT") && e.contains(bad), "{e}");
        }
    }

    /// `nproc` processes on one node, a loopback rendezvous at a port free now (the launcher
    /// refuses one that another program holds), no token.
    fn one_node(nproc: usize, grace: Duration) -> LaunchOptions {
        let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let rdzv = Some(format!("127.0.0.1:{port}"));
        LaunchOptions { nproc_per_node: nproc, nnodes: 1, node_rank: 0, rdzv, token: None, grace }
    }

    #[test]
    fn the_secret_is_not_in_the_options_debug_output() {
        let options = LaunchOptions { token: Some("s3cret".into()), ..one_node(2, GRACE) };
        let shown = format!("{options:?}");
        assert!(
            !shown.contains("s3cret") && shown.contains("not shown") && shown.contains("nproc_per_node: 2"),
            "{shown}"
        );
    }

    #[test]
    fn bad_launch_options_are_refused_before_anything_starts() {
        let ok = one_node(2, GRACE);
        assert!(ok.validate().is_ok());
        let token = LaunchOptions { token: Some("k".into()), ..ok.clone() };
        let remote = LaunchOptions { rdzv: Some("10.0.0.1:29500".into()), ..token.clone() };
        for (bad, says) in [
            (LaunchOptions { nproc_per_node: 0, ..ok.clone() }, "at least 1"),
            (LaunchOptions { nnodes: 2, node_rank: 2, ..ok.clone() }, "--node-rank"),
            (LaunchOptions { rdzv: Some("nowhere".into()), ..ok.clone() }, "HOST:PORT"),
            (LaunchOptions { nnodes: 2, rdzv: Some("10.0.0.1:29500".into()), ..ok.clone() }, "--rdzv-token"),
            (LaunchOptions { nnodes: 2, rdzv: None, ..token.clone() }, "reaches this machine alone"),
            (LaunchOptions { rdzv: Some("127.0.0.1:0".into()), ..ok.clone() }, "--rdzv"),
            (LaunchOptions { nproc_per_node: usize::MAX, nnodes: 2, ..remote.clone() }, "--nproc-per-node × --nnodes"),
            (LaunchOptions { nproc_per_node: 1 << 9, nnodes: 1 << 8, ..remote.clone() }, "at most 65536"),
        ] {
            let e = launch(&bad, std::path::Path::new("/bin/true"), &[]).unwrap_err().to_string();
            assert!(e.contains(says), "{e}");
        }
        // A port another program listens on: refused before any process starts.
        let held = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let taken = LaunchOptions { rdzv: Some(held.local_addr().unwrap().to_string()), ..ok.clone() };
        let e = launch(&taken, std::path::Path::new("/bin/true"), &[]).unwrap_err().to_string();
        assert!(e.contains("where rank 0 listens, is in use by another program"), "{e}");
    }

    /// Of the processes seen ending in one look, one killed by a signal is the failure named
    /// (the others most likely failed because it died), whatever its rank; else the first.
    #[test]
    fn a_killed_process_is_named_before_those_that_failed_with_it() {
        let (exit, killed) =
            (|code: i32| Ok(ExitStatus::from_raw(code << 8)), |sig: i32| Ok(ExitStatus::from_raw(sig)));
        assert_eq!(first_failure(&[(0, exit(1)), (3, killed(9))]).map(|f| f.0), Some(3));
        assert_eq!(first_failure(&[(0, exit(0)), (1, exit(2)), (2, exit(1))]).map(|f| f.0), Some(1));
        assert_eq!(first_failure(&[(0, exit(0)), (1, Err("cannot be watched".into()))]).map(|f| f.0), Some(1));
        assert_eq!(first_failure(&[(0, exit(0)), (1, exit(0))]), None);
        let (_, why) = first_failure(&[(2, killed(15))]).unwrap();
        assert!(why.contains("signal"), "{why}");
    }

    #[test]
    fn the_first_failing_process_ends_the_launch_with_its_rank() {
        let opts = one_node(3, Duration::from_secs(1));
        // Each child is a shell that fails when it is rank 1 and otherwise sleeps: the launch
        // must not wait for the sleepers' 60 s beyond its grace.
        let script = "if [ \"$RANK\" = 1 ]; then exit 3; fi; sleep 60".to_string();
        let started = Instant::now();
        let e = launch(&opts, std::path::Path::new("/bin/sh"), &["-c".into(), script]).unwrap_err().to_string();
        assert!(e.contains("rank 1") && e.contains("3") && e.contains("see rank 1's error above"), "{e}");
        assert!(e.contains("ranks [0, 2] had not ended 1s after it and were killed"), "{e}");
        // A process killed from outside printed nothing: the verdict says where to look.
        let script = "if [ \"$RANK\" = 1 ]; then kill -9 $$; fi; sleep 60".to_string();
        let e = launch(&opts, std::path::Path::new("/bin/sh"), &["-c".into(), script]).unwrap_err().to_string();
        assert!(e.contains("rank 1: signal: 9 (SIGKILL) (a signal from outside the run"), "{e}");
        assert!(started.elapsed() < Duration::from_secs(30), "the sleepers were stopped: {:?}", started.elapsed());
        assert!(
            launch(&opts, std::path::Path::new("/bin/sh"), &["-c".into(), "test -n \"$PT_RDZV_TOKEN\"".into()]).is_ok()
        );
        // A program that cannot start is named with its rank.
        let e = launch(&opts, std::path::Path::new("/nonexistent/pipetransformer"), &[]).unwrap_err().to_string();
        assert!(e.contains("launch: rank 0") && e.contains("cannot start /nonexistent/pipetransformer"), "{e}");
    }

    /// Children of the shell scripts given, ranked in order.
    fn shells(scripts: &[&str]) -> Vec<(usize, Child)> {
        let spawn = |s: &&str| Command::new("/bin/sh").args(["-c", s]).spawn().unwrap();
        scripts.iter().map(spawn).enumerate().collect()
    }

    /// The launcher's first signal reaches every child as SIGTERM; children that stop on it
    /// (exit 130, or end by the signal before they could take it) make the launch
    /// interrupted, not failed; a second signal kills those that go on.
    #[test]
    fn the_launchers_signals_stop_its_children() {
        let signals_after = |at: Instant, first: f64, second: f64| {
            move || [first, second].iter().filter(|&&t| at.elapsed().as_secs_f64() > t).count()
        };
        // Both stop on the request (exit 130).
        let stops = "trap 'kill $!; exit 130' TERM; sleep 60 & wait";
        let started = Instant::now();
        let e = watch(shells(&[stops, stops]), GRACE, &signals_after(started, 0.2, 1e9)).unwrap_err();
        assert!(matches!(e, Error::Interrupted { step: None, .. }), "{e}");
        assert!(started.elapsed() < Duration::from_secs(30), "{:?}", started.elapsed());
        // One that the request ended (it took none yet) wrote no checkpoint: a failure, said so.
        let e = watch(shells(&[stops, "sleep 60"]), GRACE, &signals_after(Instant::now(), 0.2, 1e9)).unwrap_err();
        let e = e.to_string();
        assert!(e.contains("launch: rank 1: signal: 15 (SIGTERM)") && e.contains("it wrote no checkpoint"), "{e}");
        // Without a signal to the launcher, a child's 130 is still a stop, not a failure.
        let e = watch(shells(&["exit 130", "exit 0"]), GRACE, &|| 0).unwrap_err();
        assert!(matches!(e, Error::Interrupted { step: None, .. }), "{e}");
        // A child that fails on the request is a failure, named.
        let fails = "trap 'kill $!; exit 3' TERM; sleep 60 & wait";
        let e = watch(shells(&[stops, fails]), GRACE, &signals_after(Instant::now(), 0.2, 1e9)).unwrap_err();
        assert!(e.to_string().contains("launch: rank 1: exit status: 3"), "{e}");
        // One that takes no notice is killed at the second signal.
        let deaf = "trap '' TERM; exec sleep 60";
        let started = Instant::now();
        let e = watch(shells(&[deaf]), GRACE, &signals_after(started, 0.1, 0.4)).unwrap_err().to_string();
        assert!(e.contains("a second signal: ranks [0] were killed"), "{e}");
        assert!(started.elapsed() < Duration::from_secs(30), "{:?}", started.elapsed());
    }
}
