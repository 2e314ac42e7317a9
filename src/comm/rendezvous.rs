//! The TCP rendezvous where the members of a multi-process group meet: rank 0 listens and
//! hands every other member the same payload (NCCL's unique id, for one). It is a network
//! service, so it admits only members that prove they know the run's secret, and no stranger
//! can crash or stall it:
//!
//! - rank 0 binds where the caller says (the launcher's default is loopback);
//! - every message is a frame `[length: u32 LE][body]` of at most [`MAX_FRAME`] bytes, and the
//!   whole of it must arrive within [`MESSAGE_TIMEOUT`] (and before the meeting's deadline), not
//!   just each byte: oversized, malformed or slow messages close that connection with a logged
//!   reason and rank 0 goes on waiting for real members;
//! - rank 0 runs the handshakes of up to [`MAX_HANDSHAKES`] connections at once, so strangers
//!   who connect and stall do not keep a member behind them waiting;
//! - admission is a challenge and response: rank 0 sends a fresh random nonce, a member
//!   answers with HMAC-SHA256(secret, nonce ‖ rank ‖ size); rank 0's reply carries its own MAC
//!   over the nonce and the payload, so members know they reached the real rank 0. The secret
//!   never crosses the wire and is never logged;
//! - the whole meeting has a deadline: members that are missing by then make every waiting
//!   process fail with an error that says who is missing, never hang. Once everyone is in,
//!   the listener closes and later connections are refused by the OS.

use crate::error::{Error, Result};
use hmac::{Hmac, Mac};
use sha2::Sha256;
use std::cell::RefCell;
use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::mpsc;
use std::time::{Duration, Instant};

/// Largest frame either side accepts, in bytes (a hello is 44, a payload at most 4 KiB).
pub const MAX_FRAME: usize = 4096 + 64;
/// How long one message may take to arrive once a connection is open.
pub const MESSAGE_TIMEOUT: Duration = Duration::from_secs(2);
/// Handshakes a listener runs at once. A stranger who connects and stalls holds one for at
/// most [`MESSAGE_TIMEOUT`]; only this many stalling together can keep a member waiting.
pub const MAX_HANDSHAKES: usize = 64;
/// Most processes a group may hold: far beyond any real run, and small enough that a group's
/// size and ranks always fit the `u32`s of the handshakes.
pub const MAX_GROUP: usize = 1 << 16;
/// First bytes of every frame body: the protocol and its version.
const MAGIC: &[u8; 8] = b"PTRDZV01";

type HmacSha256 = Hmac<Sha256>;

/// The run's shared secret, from `--rdzv-token` or `PT_RDZV_TOKEN`. `Debug` prints no bytes.
#[derive(Clone)]
pub struct Secret(Vec<u8>);

impl Secret {
    /// A secret of these bytes; refused when empty (a rendezvous without one admits anyone).
    pub fn new(bytes: impl Into<Vec<u8>>) -> Result<Self> {
        let bytes = bytes.into();
        if bytes.is_empty() {
            return Err(rdzv_error("secret", "is empty; pass --rdzv-token or set PT_RDZV_TOKEN"));
        }
        Ok(Secret(bytes))
    }

    /// A fresh random secret (the launcher's for one node), as 64 hex digits.
    pub fn random() -> Result<Self> {
        Ok(Secret(hex(&random_bytes::<32>()?).into_bytes()))
    }

    /// The secret's text, to hand to child processes through the environment.
    pub fn expose(&self) -> String {
        String::from_utf8_lossy(&self.0).into_owned()
    }

    pub(super) fn mac(&self, parts: &[&[u8]]) -> [u8; MAC] {
        // HMAC takes keys of any length.
        let mut m = <HmacSha256 as Mac>::new_from_slice(&self.0).expect("HMAC accepts any key length");
        for p in parts {
            m.update(p);
        }
        m.finalize().into_bytes().into()
    }

    pub(super) fn verify(&self, parts: &[&[u8]], tag: &[u8]) -> bool {
        let mut m = <HmacSha256 as Mac>::new_from_slice(&self.0).expect("HMAC accepts any key length");
        for p in parts {
            m.update(p);
        }
        m.verify_slice(tag).is_ok() // constant time
    }
}

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Secret(<{} bytes, not shown>)", self.0.len())
    }
}

pub(super) fn rdzv_error(what: &str, message: impl Into<String>) -> Error {
    Error::Device { what: format!("rendezvous: {what}"), message: message.into() }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

pub(super) fn random_bytes<const N: usize>() -> Result<[u8; N]> {
    let mut out = [0u8; N];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut out))
        .map_err(|e| rdzv_error("random nonce", format!("cannot read /dev/urandom: {e}")))?;
    Ok(out)
}

/// Writes one frame.
fn send(stream: &mut TcpStream, body: &[u8]) -> std::io::Result<()> {
    let mut frame = Vec::with_capacity(4 + body.len());
    frame.extend_from_slice(&(body.len() as u32).to_le_bytes());
    frame.extend_from_slice(body);
    stream.write_all(&frame)
}

/// Reads one frame of at most [`MAX_FRAME`] bytes that starts with the protocol's magic; returns the body
/// after the magic. On a socket, its read timeout bounds each read. Nothing is allocated
/// before the length is checked, so a stranger cannot make a peer reserve gigabytes.
pub fn read_frame(stream: &mut impl Read) -> std::result::Result<Vec<u8>, String> {
    let mut len = [0u8; 4];
    stream.read_exact(&mut len).map_err(|e| format!("no frame length: {e}"))?;
    let len = u32::from_le_bytes(len) as usize;
    if !(MAGIC.len()..=MAX_FRAME).contains(&len) {
        return Err(format!("a frame of {len} bytes; expected {}..={MAX_FRAME}", MAGIC.len()));
    }
    let mut body = vec![0u8; len];
    stream.read_exact(&mut body).map_err(|e| format!("frame cut short: {e}"))?;
    if &body[..MAGIC.len()] != MAGIC {
        return Err("not a pipetransformer rendezvous message (bad magic)".into());
    }
    body.drain(..MAGIC.len());
    Ok(body)
}

/// [`read_frame`] from a socket, giving up once `until` has passed: the whole message must have
/// arrived by then, however slowly its bytes come.
pub(super) fn read_frame_by(stream: &TcpStream, until: Instant) -> std::result::Result<Vec<u8>, String> {
    read_frame(&mut Until { stream, until })
}

/// When the next message must have arrived: [`MESSAGE_TIMEOUT`] from now, and never past
/// `deadline`.
pub(super) fn message_deadline(deadline: Instant) -> Instant {
    Instant::now().checked_add(MESSAGE_TIMEOUT).map_or(deadline, |t| t.min(deadline))
}

/// A socket read against a deadline for a whole message. A socket's read timeout bounds each
/// `read` alone, and `read_exact` reads again after every byte, so a stranger sending a byte
/// a second would never meet it: every read here gets only the time left.
struct Until<'a> {
    stream: &'a TcpStream,
    until: Instant,
}

impl Read for Until<'_> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let late = || {
            std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                format!("the whole message did not arrive in time (at most {MESSAGE_TIMEOUT:?} per message)"),
            )
        };
        let left = self.until.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(late());
        }
        self.stream.set_read_timeout(Some(left))?;
        let mut stream = self.stream; // `&TcpStream` reads
        match stream.read(buf) {
            Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => Err(late()),
            other => other,
        }
    }
}

/// Accepts connections on `listener` and runs `handshake` on each in a thread of its own (at
/// most [`MAX_HANDSHAKES`] at once), so that a stranger who stalls holds up nobody else. Each
/// connection whose handshake succeeds goes to `take`, which says whether everyone expected
/// is in (`Ok(true)`: done) or refuses it; refusals are logged under `who`. Between
/// connections `keep_waiting` says whether to go on (the caller's deadline, its peers). On
/// return, handshakes still running are cut short.
pub(super) fn admit_concurrently<T: Send>(
    listener: &TcpListener,
    who: &str,
    handshake: impl Fn(&mut TcpStream) -> std::result::Result<T, String> + Sync,
    mut take: impl FnMut(TcpStream, T) -> std::result::Result<bool, String>,
    mut keep_waiting: impl FnMut() -> Result<()>,
) -> Result<()> {
    listener.set_nonblocking(true).map_err(|e| rdzv_error("listener", format!("{e} ({who})")))?;
    std::thread::scope(|s| {
        let (done, outcomes) = mpsc::channel::<Outcome<T>>();
        // A handle to each handshake under way, to cut it short when the waiting ends.
        let mut running: Vec<(usize, TcpStream)> = Vec::new();
        let mut next_id = 0;
        let mut last_accept_error = None;
        let result = loop {
            if let Ok((id, from, peer, outcome)) = outcomes.try_recv() {
                running.retain(|(i, _)| *i != id);
                match outcome.and_then(|t| take(peer, t)) {
                    Ok(true) => break Ok(()),
                    Ok(false) => {}
                    Err(why) => eprintln!("{who}: refused a connection from {from}: {why}"),
                }
                continue;
            }
            if let Err(e) = keep_waiting() {
                break Err(e);
            }
            if running.len() < MAX_HANDSHAKES {
                match listener.accept() {
                    Ok((peer, from)) => {
                        match start_handshake(s, peer, (next_id, from), &handshake, &done) {
                            Ok(handle) => running.push((next_id, handle)),
                            Err(e) => eprintln!("{who}: refused a connection from {from}: {e}"),
                        }
                        next_id += 1;
                        continue;
                    }
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
                    Err(e) if listener_broken(&e) => break Err(rdzv_error("accept", format!("{e} ({who})"))),
                    // One connection's trouble, or a passing one (a full file table): the
                    // deadline still bounds the wait. Said once while it repeats.
                    Err(e) => {
                        let text = e.to_string();
                        if last_accept_error.as_ref() != Some(&text) {
                            eprintln!("{who}: accepting a connection failed ({text}); still waiting");
                            last_accept_error = Some(text);
                        }
                    }
                }
            }
            std::thread::sleep(Duration::from_millis(5));
        };
        for (_, peer) in &running {
            let _ = peer.shutdown(Shutdown::Both); // its thread's read ends at once
        }
        result
    })
}

/// Whether an `accept` error means the listener itself is unusable. Linux's `accept` also
/// reports a pending connection's network errors (`EPROTO`, `ENETDOWN`, `EHOSTUNREACH`, …) and
/// a full file table (`EMFILE`, `ENFILE`), which its manual says to retry like `EAGAIN`: a
/// stranger's reset connection must not end the rendezvous.
fn listener_broken(e: &std::io::Error) -> bool {
    matches!(e.raw_os_error(), Some(libc::EBADF | libc::EINVAL | libc::ENOTSOCK | libc::EOPNOTSUPP | libc::EFAULT))
}

/// What a handshake thread hands back: its id, the peer's address, the connection and how
/// the handshake went.
type Outcome<T> = (usize, SocketAddr, TcpStream, std::result::Result<T, String>);

/// Runs `handshake` on `peer` (handshake `id`, from `from`) in a thread of `scope`, which
/// sends the outcome to `done`; returns a handle to the connection, to cut the handshake short.
/// An error (and the connection dropped) when it cannot get a thread.
fn start_handshake<'scope, T: Send + 'scope>(
    scope: &'scope std::thread::Scope<'scope, '_>,
    mut peer: TcpStream,
    (id, from): (usize, SocketAddr),
    handshake: &'scope (impl Fn(&mut TcpStream) -> std::result::Result<T, String> + Sync),
    done: &mpsc::Sender<Outcome<T>>,
) -> std::io::Result<TcpStream> {
    let handle = peer.try_clone()?;
    let done = done.clone();
    std::thread::Builder::new().spawn_scoped(scope, move || {
        let outcome = handshake(&mut peer);
        let _ = done.send((id, from, peer, outcome)); // nobody listens once the waiting ended
    })?;
    Ok(handle)
}

/// A frame as [`read_frame`] reads it: `[length: u32 LE][MAGIC][parts...]`.
pub fn frame(parts: &[&[u8]]) -> Vec<u8> {
    let body = with_magic(parts);
    let mut out = (body.len() as u32).to_le_bytes().to_vec();
    out.extend_from_slice(&body);
    out
}

/// Rank 0's challenge as a member reads it: exactly [`NONCE`] bytes.
pub fn read_challenge(stream: &mut impl Read) -> std::result::Result<Vec<u8>, String> {
    let nonce = read_frame(stream)?;
    if nonce.len() != NONCE {
        return Err(format!("a challenge of {} bytes; expected {NONCE}", nonce.len()));
    }
    Ok(nonce)
}

/// Rank 0's welcome as a member reads it: a [`MAC`] tag, then the payload.
pub fn read_welcome(stream: &mut impl Read) -> std::result::Result<(Vec<u8>, Vec<u8>), String> {
    let mut welcome = read_frame(stream)?;
    if welcome.len() < MAC {
        return Err(format!("a welcome of {} bytes; expected at least {MAC}", welcome.len()));
    }
    let payload = welcome.split_off(MAC);
    Ok((welcome, payload))
}

/// Bytes of the nonce rank 0 sends.
pub const NONCE: usize = 32;
/// Bytes of an HMAC-SHA256 tag.
pub const MAC: usize = 32;

fn with_magic(parts: &[&[u8]]) -> Vec<u8> {
    let mut body = MAGIC.to_vec();
    for p in parts {
        body.extend_from_slice(p);
    }
    body
}

/// A member's answer to the challenge: its rank, the group size and its MAC.
pub fn parse_hello(body: &[u8]) -> std::result::Result<(u32, u32, [u8; MAC]), String> {
    if body.len() != 8 + MAC {
        return Err(format!("a hello of {} bytes; expected {}", body.len(), 8 + MAC));
    }
    let rank = u32::from_le_bytes(body[0..4].try_into().map_err(|_| "rank")?);
    let size = u32::from_le_bytes(body[4..8].try_into().map_err(|_| "size")?);
    let mac = body[8..].try_into().map_err(|_| "mac")?;
    Ok((rank, size, mac))
}

/// Meets the other `size − 1` members at `addr`: rank 0 binds it and sends `payload` (at most
/// 4 KiB) to every member that proves it knows `secret`; the others connect (retrying until the
/// deadline) and return what rank 0 sent. Everyone returns the same bytes, or an error once
/// `timeout` has passed (naming the ranks still missing, on rank 0).
pub fn meet(
    addr: &str,
    rank: usize,
    size: usize,
    secret: &Secret,
    payload: Option<&[u8]>,
    timeout: Duration,
) -> Result<Vec<u8>> {
    Ok(gather(addr, rank, size, secret, payload, timeout)?.0)
}

/// The connections a meeting leaves open: rank 0 holds one to each member (index `rank − 1`),
/// a member holds its one to rank 0. A [`ProcessGroup`](super::process_group::ProcessGroup)
/// runs its collectives over them.
pub enum Links {
    /// Rank 0's connections to ranks `1..size`, in rank order.
    Hub(Vec<TcpStream>),
    /// A member's connection to rank 0.
    Spoke(TcpStream),
}

impl Links {
    /// Every open connection: rank 0's to each member, or a member's one.
    pub fn streams(&self) -> Vec<&TcpStream> {
        match self {
            Links::Hub(s) => s.iter().collect(),
            Links::Spoke(s) => vec![s],
        }
    }
}

/// [`meet`], keeping the admitted connections open.
pub fn gather(
    addr: &str,
    rank: usize,
    size: usize,
    secret: &Secret,
    payload: Option<&[u8]>,
    timeout: Duration,
) -> Result<(Vec<u8>, Links)> {
    if size == 0 || rank >= size {
        return Err(rdzv_error("rank", format!("{rank} of {size}; expected a rank below a group size of at least 1")));
    }
    if size > MAX_GROUP {
        return Err(rdzv_error("group size", format!("{size} processes; at most {MAX_GROUP}")));
    }
    let deadline = deadline_after(timeout)?;
    if rank == 0 {
        let payload = payload.ok_or_else(|| rdzv_error("payload", "rank 0 needs the bytes to hand out"))?;
        if payload.len() > 4096 {
            return Err(rdzv_error("payload", format!("{} bytes; at most 4096", payload.len())));
        }
        let links = host(addr, size, secret, payload, deadline, timeout)?;
        Ok((payload.to_vec(), Links::Hub(links)))
    } else {
        let (payload, stream) = join(addr, rank, size, secret, deadline, timeout)?;
        Ok((payload, Links::Spoke(stream)))
    }
}

/// The instant `timeout` from now; an error, not a panic, for a timeout too long to add.
pub(super) fn deadline_after(timeout: Duration) -> Result<Instant> {
    Instant::now().checked_add(timeout).ok_or_else(|| {
        rdzv_error("timeout", format!("{timeout:?} is too long for the clock to count; expected at most a week"))
    })
}

fn host(
    addr: &str,
    size: usize,
    secret: &Secret,
    payload: &[u8],
    deadline: Instant,
    timeout: Duration,
) -> Result<Vec<TcpStream>> {
    let listener = TcpListener::bind(addr).map_err(|e| rdzv_error(&format!("bind {addr}"), e.to_string()))?;
    // Filled in as members are admitted, and read for the ranks still missing.
    let links: RefCell<Vec<Option<TcpStream>>> = RefCell::new((0..size).map(|_| None).collect());
    let missing = || -> Vec<usize> { (1..size).filter(|&r| links.borrow()[r].is_none()).collect() };
    // A member that proved the secret but counts the run another size: the nodes were
    // launched with other --nnodes or --nproc-per-node, and waiting on cannot mend that.
    let launched_apart: RefCell<Option<String>> = RefCell::new(None);
    let mut said = Instant::now();
    if size > 1 {
        // A stranger's connection costs at most a message timeout of one handshake thread, and
        // never the run.
        admit_concurrently(
            &listener,
            &format!("rendezvous at {addr}"),
            |peer| admit(peer, size, secret, deadline),
            |mut peer, (rank, claimed, nonce)| {
                if claimed != size {
                    let why = format!(
                        "a process counts the run as {claimed} processes (its rank {rank}), this one as {size}: launch \
                         every node with the same --nnodes and --nproc-per-node"
                    );
                    launched_apart.replace(Some(why.clone()));
                    return Err(why);
                }
                if links.borrow()[rank].is_some() {
                    return Err(format!("rank {rank} has already joined"));
                }
                let tag = secret.mac(&[b"welcome", &nonce, payload]);
                send(&mut peer, &with_magic(&[&tag, payload])).map_err(|e| e.to_string())?;
                links.borrow_mut()[rank] = Some(peer);
                Ok(missing().is_empty())
            },
            || {
                if let Some(why) = launched_apart.take() {
                    return Err(rdzv_error(&format!("at {addr}"), why));
                }
                let now = Instant::now();
                if now >= deadline {
                    let why = format!("ranks {:?} did not join within {timeout:?}", missing());
                    return Err(rdzv_error(&format!("at {addr}"), why));
                }
                // A long wait says what it waits for (a node not started yet, a wrong address).
                if now.duration_since(said) >= WAITING_NOTE {
                    said = now;
                    let (gone, left) = (missing(), deadline.duration_since(now).as_secs());
                    eprintln!(
                        "rendezvous at {addr}: waiting for ranks {gone:?} ({} of {size} in; giving up in {left} s)",
                        size - gone.len()
                    );
                }
                Ok(())
            },
        )?;
    }
    Ok(links.into_inner().into_iter().skip(1).flatten().collect())
}

/// How often a rendezvous still waiting says so.
const WAITING_NOTE: Duration = Duration::from_secs(30);

/// One connection's handshake on rank 0, up to the welcome: returns the rank it proved, the
/// size of run it counts, and the nonce the welcome's MAC covers.
fn admit(
    peer: &mut TcpStream,
    size: usize,
    secret: &Secret,
    deadline: Instant,
) -> std::result::Result<(usize, usize, [u8; NONCE]), String> {
    let io = |e: std::io::Error| e.to_string();
    peer.set_nonblocking(false).map_err(io)?;
    peer.set_write_timeout(Some(MESSAGE_TIMEOUT)).map_err(io)?;
    let nonce = random_bytes::<NONCE>().map_err(|e| e.to_string())?;
    send(peer, &with_magic(&[&nonce])).map_err(io)?;
    let (rank, claimed, mac) = parse_hello(&read_frame_by(peer, message_deadline(deadline))?)?;
    let (r, s) = (rank.to_le_bytes(), claimed.to_le_bytes());
    if !secret.verify(&[b"hello", &nonce, &r, &s], &mac) {
        return Err("wrong secret (the MAC does not verify)".into());
    }
    let (rank, claimed) = (rank as usize, claimed as usize);
    // (Another size is the caller's to judge: the member proved the secret.)
    if rank == 0 || rank >= size.max(claimed) {
        return Err(format!("claims rank {rank} of {claimed}; this group has ranks 1..{size} to admit"));
    }
    Ok((rank, claimed, nonce))
}

fn join(
    addr: &str,
    rank: usize,
    size: usize,
    secret: &Secret,
    deadline: Instant,
    timeout: Duration,
) -> Result<(Vec<u8>, TcpStream)> {
    // Every address the name has, in turn (`localhost` may be ::1 and 127.0.0.1, and rank 0
    // listens on the first it could bind).
    let targets: Vec<SocketAddr> =
        addr.to_socket_addrs().map_err(|e| rdzv_error(&format!("resolve {addr}"), e.to_string()))?.collect();
    if targets.is_empty() {
        return Err(rdzv_error(&format!("resolve {addr}"), "no address"));
    }
    join_any(&targets, addr, rank, size, secret, deadline, timeout, REFUSED_GRACE)
}

/// How long a member refused at one address goes on trying the others, where nothing answers
/// yet, before the refusal is final: the ranks of a run start together, so its rank 0 is up by
/// then, and a wrong secret must not wait out the whole timeout.
const REFUSED_GRACE: Duration = Duration::from_secs(10);

/// [`join`] at the first of `targets` (the addresses `addr` names) where rank 0 answers. An
/// address whose peer refuses us is not tried again, and the next one is: another service (or
/// another run's rank 0) may hold `::1` at the port where ours bound 127.0.0.1. The refusal is
/// final once every address has refused, or `grace` after the first refusal while the others
/// still do not answer; every error names each address's refusal.
#[allow(clippy::too_many_arguments)]
fn join_any(
    targets: &[SocketAddr],
    addr: &str,
    rank: usize,
    size: usize,
    secret: &Secret,
    deadline: Instant,
    timeout: Duration,
    grace: Duration,
) -> Result<(Vec<u8>, TcpStream)> {
    let mut last = String::from("never tried");
    let mut refused: Vec<Option<String>> = vec![None; targets.len()];
    let mut first_refusal: Option<Instant> = None;
    let refusals = |refused: &[Option<String>]| -> String {
        match refused {
            [only] => only.clone().unwrap_or_default(),
            all => targets
                .iter()
                .zip(all)
                .filter_map(|(t, w)| w.as_ref().map(|w| format!("{t}: {w}")))
                .collect::<Vec<_>>()
                .join("; "),
        }
    };
    for (i, target) in targets.iter().enumerate().cycle() {
        if Instant::now() >= deadline {
            break;
        }
        if first_refusal.is_some_and(|at| at.elapsed() >= grace) {
            let why = format!("{} (no rank 0 answered elsewhere within {grace:?}: {last})", refusals(&refused));
            return Err(rdzv_error(&format!("at {addr}"), why));
        }
        if refused[i].is_some() {
            continue;
        }
        match TcpStream::connect_timeout(target, Duration::from_millis(500)) {
            Ok(mut s) => match handshake(&mut s, rank, size, secret, deadline) {
                Ok(payload) => return Ok((payload, s)),
                // Refused here (or an impostor): a wrong secret will not get better at this
                // address, and every address refusing is final.
                Err(Handshake::Refused(why)) => {
                    refused[i] = Some(why);
                    first_refusal.get_or_insert_with(Instant::now);
                    if refused.iter().all(Option::is_some) {
                        return Err(rdzv_error(&format!("at {addr}"), refusals(&refused)));
                    }
                    continue;
                }
                // No challenge in time: rank 0 may be busy with a crowd of strangers; again.
                Err(Handshake::Unanswered(why)) => last = why,
            },
            Err(e) => last = e.to_string(),
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let refused_too =
        if first_refusal.is_some() { format!("; refused at {}", refusals(&refused)) } else { String::new() };
    Err(rdzv_error(
        &format!("at {addr}"),
        format!("could not connect to rank 0 within {timeout:?} ({last}){refused_too}"),
    ))
}

/// Why a member's handshake failed: worth another try, or not.
enum Handshake {
    /// Nothing came in time (rank 0 runs at most MAX_HANDSHAKES handshakes at once, and may be
    /// busy with as many strangers).
    Unanswered(String),
    /// Rank 0 turned us away, sent something that is not a challenge, or is not who it says.
    Refused(String),
}

/// Waits (at most `MESSAGE_TIMEOUT`, and not past `deadline`) for the first byte of the other
/// side's first message: none in time, or a hang-up before it, is worth another try.
pub(super) fn first_byte(s: &TcpStream, deadline: Instant) -> std::result::Result<(), String> {
    let wait = MESSAGE_TIMEOUT.min(deadline.saturating_duration_since(Instant::now())).max(Duration::from_millis(1));
    let io = |e: std::io::Error| e.to_string();
    s.set_read_timeout(Some(wait)).map_err(io)?;
    s.set_write_timeout(Some(wait)).map_err(io)?;
    match s.peek(&mut [0u8]) {
        Ok(0) => Err("the connection closed before any message".into()),
        Ok(_) => Ok(()),
        Err(e) => Err(io(e)),
    }
}

fn handshake(
    s: &mut TcpStream,
    rank: usize,
    size: usize,
    secret: &Secret,
    deadline: Instant,
) -> std::result::Result<Vec<u8>, Handshake> {
    let again = |e: std::io::Error| Handshake::Unanswered(e.to_string());
    first_byte(s, deadline).map_err(Handshake::Unanswered)?;
    let nonce =
        read_challenge(&mut Until { stream: s, until: message_deadline(deadline) }).map_err(Handshake::Refused)?;
    // `gather` caps the group at MAX_GROUP: both fit a u32.
    let (r, z) = ((rank as u32).to_le_bytes(), (size as u32).to_le_bytes());
    let mac = secret.mac(&[b"hello", &nonce, &r, &z]);
    send(s, &with_magic(&[&r, &z, &mac])).map_err(again)?;
    let (tag, payload) = read_welcome(&mut Until { stream: s, until: message_deadline(deadline) })
        .map_err(|e| Handshake::Refused(format!("rank 0 closed the connection ({e}): a wrong secret or rank?")))?;
    if !secret.verify(&[b"welcome", &nonce, &payload], &tag) {
        return Err(Handshake::Refused("the peer at this address does not know the run's secret".into()));
    }
    Ok(payload)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn free_addr() -> String {
        let port = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        format!("127.0.0.1:{port}")
    }

    /// Only errors of the listener itself end the rendezvous; a connection's own (reset,
    /// aborted, a network error `accept` passes on) and a full file table wait on.
    #[test]
    fn only_a_broken_listener_ends_the_accepting() {
        use std::io::{Error, ErrorKind};
        for errno in [libc::EMFILE, libc::ENFILE, libc::EPROTO, libc::ENETDOWN, libc::ECONNABORTED, libc::EINTR] {
            assert!(!listener_broken(&Error::from_raw_os_error(errno)), "errno {errno}");
        }
        assert!(!listener_broken(&Error::from(ErrorKind::ConnectionReset)));
        for errno in [libc::EBADF, libc::EINVAL, libc::ENOTSOCK] {
            assert!(listener_broken(&Error::from_raw_os_error(errno)), "errno {errno}");
        }
    }

    #[test]
    fn every_member_gets_rank_zeros_payload() {
        let (addr, secret) = (free_addr(), Secret::new("s3cret").unwrap());
        let got: Vec<Vec<u8>> = std::thread::scope(|s| {
            let handles: Vec<_> = (0..4)
                .map(|rank| {
                    let (addr, secret) = (&addr, &secret);
                    s.spawn(move || {
                        let payload = (rank == 0).then_some(&[7u8; 128][..]);
                        meet(addr, rank, 4, secret, payload, Duration::from_secs(20)).unwrap()
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        assert!(got.iter().all(|g| g == &[7u8; 128]));
    }

    #[test]
    fn strangers_are_refused_and_do_not_stop_the_members() {
        let (addr, secret) = (free_addr(), Secret::new("k3y-A9").unwrap());
        std::thread::scope(|s| {
            let host = s.spawn(|| meet(&addr, 0, 2, &secret, Some(b"id"), Duration::from_secs(20)));
            // A member with the wrong secret is refused, and told so.
            let wrong = Secret::new("k3y-B7").unwrap();
            let e = loop {
                match meet(&addr, 1, 2, &wrong, None, Duration::from_secs(5)) {
                    Err(e) if e.to_string().contains("could not connect") => continue,
                    other => break other.unwrap_err().to_string(),
                }
            };
            assert!(e.contains("closed the connection"), "{e}");
            assert!(!e.contains("k3y-"), "the secret never shows: {e}");
            // Garbage, an oversized frame and a silent connection are each dropped.
            for junk in [&b"GET / HTTP/1.1\r\n\r\n"[..], &u32::MAX.to_le_bytes()[..], &[]] {
                let mut c = TcpStream::connect(&addr).unwrap();
                c.write_all(junk).unwrap();
                let mut sink = Vec::new();
                c.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
                let _ = c.read_to_end(&mut sink); // rank 0 hangs up
            }
            // (A right hello with a claimed size that does not match ends the rendezvous:
            // `a_member_counting_another_size_ends_the_wait`.) The real member still gets in.
            assert_eq!(meet(&addr, 1, 2, &secret, None, Duration::from_secs(10)).unwrap(), b"id");
            host.join().unwrap().unwrap();
        });
    }

    /// A member tries every address the rendezvous name resolves to, not only the first
    /// (`localhost` as ::1 where rank 0 could bind only 127.0.0.1).
    #[test]
    fn a_member_tries_every_address_of_the_name() {
        let (addr, secret) = (free_addr(), Secret::new("k3y-A9").unwrap());
        let nobody: SocketAddr = free_addr().parse().unwrap();
        std::thread::scope(|s| {
            let host = s.spawn(|| meet(&addr, 0, 2, &secret, Some(b"id"), Duration::from_secs(20)));
            let targets = [nobody, addr.parse().unwrap()];
            let timeout = Duration::from_secs(10);
            let (payload, _) =
                join_any(&targets, "both", 1, 2, &secret, Instant::now() + timeout, timeout, REFUSED_GRACE).unwrap();
            assert_eq!(payload, b"id");
            host.join().unwrap().unwrap();
        });
    }

    /// A stranger at the first address the name gives (here: a rendezvous of another run, with
    /// another secret) refuses us; the member goes on to the next address, where its rank 0 is.
    #[test]
    fn a_refusal_at_one_address_moves_on_to_the_next() {
        let (ours, theirs) = (Secret::new("ours-1").unwrap(), Secret::new("theirs-2").unwrap());
        let (addr, other) = (free_addr(), free_addr());
        std::thread::scope(|s| {
            // The other run's rank 0 waits for a member that never comes; it ends at its timeout.
            let stranger = s.spawn(|| meet(&other, 0, 2, &theirs, Some(b"no"), Duration::from_secs(3)));
            let host = s.spawn(|| meet(&addr, 0, 2, &ours, Some(b"id"), Duration::from_secs(20)));
            std::thread::sleep(Duration::from_millis(100));
            let targets = [other.parse().unwrap(), addr.parse().unwrap()];
            let timeout = Duration::from_secs(10);
            let (payload, _) =
                join_any(&targets, "both", 1, 2, &ours, Instant::now() + timeout, timeout, REFUSED_GRACE).unwrap();
            assert_eq!(payload, b"id");
            host.join().unwrap().unwrap();
            assert!(stranger.join().unwrap().is_err());
        });
        // Refused at every address: final at once, each address named with its reason.
        let garbage = || {
            let listener = TcpListener::bind("127.0.0.1:0").unwrap();
            let at = listener.local_addr().unwrap();
            std::thread::spawn(move || {
                for mut c in listener.incoming().flatten() {
                    let _ = c.write_all(b"HTTP/1.1 400 Bad Request\r\n\r\n");
                }
            });
            at
        };
        let targets = [garbage(), garbage()];
        let (timeout, started) = (Duration::from_secs(20), Instant::now());
        let e =
            join_any(&targets, "both", 1, 2, &ours, started + timeout, timeout, REFUSED_GRACE).unwrap_err().to_string();
        assert!(e.contains(&targets[0].to_string()) && e.contains(&targets[1].to_string()), "{e}");
        assert!(started.elapsed() < Duration::from_secs(5), "failed after {:?}", started.elapsed());
        // Refused at one address while nobody listens at the other: final after the grace, not
        // the deadline, and the error says why it was refused.
        let nobody: SocketAddr = free_addr().parse().unwrap();
        let (targets, started) = ([garbage(), nobody], Instant::now());
        let grace = Duration::from_millis(500);
        let e = join_any(&targets, "both", 1, 2, &ours, started + timeout, timeout, grace).unwrap_err().to_string();
        assert!(e.contains(&targets[0].to_string()) && e.contains("frame") && e.contains("within 500ms"), "{e}");
        assert!(started.elapsed() < Duration::from_secs(5), "failed after {:?}", started.elapsed());
    }

    /// Something that is not a rank 0 on the port (here: one that answers with garbage) is a
    /// final refusal at once, not something to wait out until the deadline.
    #[test]
    fn a_wrong_service_at_the_address_fails_at_once() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        std::thread::spawn(move || {
            for mut c in listener.incoming().flatten() {
                let _ = c.write_all(b"HTTP/1.1 400 Bad Request\r\n\r\n");
            }
        });
        let started = Instant::now();
        let e = meet(&addr, 1, 2, &Secret::new("s").unwrap(), None, Duration::from_secs(20)).unwrap_err().to_string();
        assert!(e.contains("frame"), "{e}");
        assert!(started.elapsed() < Duration::from_secs(5), "failed after {:?}", started.elapsed());
    }

    #[test]
    fn a_missing_member_is_a_timeout_naming_it_and_a_missing_host_too() {
        let (addr, secret) = (free_addr(), Secret::new("x").unwrap());
        let e = meet(&addr, 0, 3, &secret, Some(b"id"), Duration::from_millis(300)).unwrap_err().to_string();
        assert!(e.contains("ranks [1, 2] did not join"), "{e}");
        let e = meet(&free_addr(), 1, 2, &secret, None, Duration::from_millis(300)).unwrap_err().to_string();
        assert!(e.contains("could not connect to rank 0"), "{e}");
    }

    /// A member that proves the secret but counts the run another size (nodes launched with
    /// other --nnodes) ends rank 0's wait at once, saying so, instead of at the timeout.
    #[test]
    fn a_member_counting_another_size_ends_the_wait() {
        let (addr, secret) = (free_addr(), Secret::new("x").unwrap());
        let started = Instant::now();
        let host = std::thread::scope(|s| {
            let host = s.spawn(|| meet(&addr, 0, 2, &secret, Some(b"id"), Duration::from_secs(20)));
            let _ = meet(&addr, 1, 3, &secret, None, Duration::from_secs(3));
            host.join().unwrap()
        });
        let e = host.unwrap_err().to_string();
        assert!(
            e.contains("counts the run as 3 processes (its rank 1), this one as 2") && e.contains("--nnodes"),
            "{e}"
        );
        assert!(started.elapsed() < Duration::from_secs(10), "ended after {:?}", started.elapsed());
    }

    /// Connects to `addr` (retrying while nobody listens yet), announces the largest frame and
    /// then sends one byte of it every 300 ms until `stop` (at most 12 s): each read sees a
    /// byte well within its socket timeout, so only a deadline for the whole message ends it.
    fn trickle(addr: &str, stop: &std::sync::atomic::AtomicBool) {
        let mut c = loop {
            match TcpStream::connect(addr) {
                Ok(c) => break c,
                Err(_) => std::thread::sleep(Duration::from_millis(10)),
            }
        };
        let _ = c.write_all(&(MAX_FRAME as u32).to_le_bytes());
        let started = Instant::now();
        while !stop.load(std::sync::atomic::Ordering::Relaxed) && started.elapsed() < Duration::from_secs(12) {
            if c.write_all(b"P").is_err() {
                break; // refused at last
            }
            std::thread::sleep(Duration::from_millis(300));
        }
    }

    /// A stranger who sends a frame a byte at a time neither holds rank 0 past a message
    /// timeout nor keeps the real member out: both end well within the meeting's deadline.
    #[test]
    fn a_stranger_who_sends_slowly_does_not_keep_a_member_out() {
        let (addr, secret) = (free_addr(), Secret::new("slow").unwrap());
        let stop = std::sync::atomic::AtomicBool::new(false);
        let started = Instant::now();
        std::thread::scope(|s| {
            let host = s.spawn(|| meet(&addr, 0, 2, &secret, Some(b"id"), Duration::from_secs(8)));
            s.spawn(|| trickle(&addr, &stop));
            std::thread::sleep(Duration::from_millis(200)); // the stranger is first in line
            let member = meet(&addr, 1, 2, &secret, None, Duration::from_secs(8));
            let host = host.join().unwrap();
            stop.store(true, std::sync::atomic::Ordering::Relaxed);
            assert_eq!(member.unwrap(), b"id");
            host.unwrap();
            assert!(started.elapsed() < Duration::from_secs(4), "took {:?}", started.elapsed());
        });
    }

    /// Many strangers who connect and say nothing are challenged side by side: the member
    /// behind them is answered at once, not after a message timeout for each.
    #[test]
    fn a_crowd_of_silent_strangers_does_not_hold_a_member_up() {
        let (addr, secret) = (free_addr(), Secret::new("crowd").unwrap());
        std::thread::scope(|s| {
            let host = s.spawn(|| meet(&addr, 0, 2, &secret, Some(b"id"), Duration::from_secs(10)));
            let silent: Vec<TcpStream> = (0..16)
                .map(|_| {
                    loop {
                        if let Ok(c) = TcpStream::connect(&addr) {
                            break c;
                        }
                        std::thread::sleep(Duration::from_millis(10));
                    }
                })
                .collect();
            let started = Instant::now();
            assert_eq!(meet(&addr, 1, 2, &secret, None, Duration::from_secs(10)).unwrap(), b"id");
            host.join().unwrap().unwrap();
            assert!(started.elapsed() < MESSAGE_TIMEOUT, "the member waited {:?}", started.elapsed());
            drop(silent);
        });
    }

    /// A frame whose bytes keep coming, each within the socket's timeout, is cut off at its
    /// deadline with an error that says so.
    #[test]
    fn a_frame_must_arrive_whole_by_its_deadline() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let stop = std::sync::atomic::AtomicBool::new(false);
        std::thread::scope(|s| {
            s.spawn(|| trickle(&addr, &stop));
            let (peer, _) = listener.accept().unwrap();
            let started = Instant::now();
            let e = read_frame_by(&peer, started + Duration::from_secs(1)).unwrap_err();
            stop.store(true, std::sync::atomic::Ordering::Relaxed);
            assert!(e.contains("did not arrive in time"), "{e}");
            assert!(started.elapsed() < Duration::from_millis(1500), "gave up after {:?}", started.elapsed());
        });
    }

    #[test]
    fn bad_requests_and_secrets_are_refused_before_any_network() {
        assert!(Secret::new("").unwrap_err().to_string().contains("PT_RDZV_TOKEN"));
        let s = Secret::random().unwrap();
        assert_eq!(s.expose().len(), 64);
        assert!(!format!("{s:?}").contains(&s.expose()), "Debug hides the secret");
        assert!(meet("127.0.0.1:1", 2, 2, &s, None, Duration::ZERO).is_err());
        assert!(meet("127.0.0.1:1", 0, 2, &s, None, Duration::ZERO).unwrap_err().to_string().contains("payload"));
        // A timeout too long to add to the clock, and a group too large, are errors, not panics.
        let e = meet("127.0.0.1:1", 1, 2, &s, None, Duration::MAX).unwrap_err().to_string();
        assert!(e.contains("timeout") && e.contains("too long"), "{e}");
        let e = meet("127.0.0.1:1", 1, MAX_GROUP + 1, &s, None, Duration::ZERO).unwrap_err().to_string();
        assert!(e.contains("at most 65536"), "{e}");
        assert!(parse_hello(&[0; 5]).is_err());
        assert_eq!(
            parse_hello(&[1, 0, 0, 0, 2, 0, 0, 0].iter().chain(&[9; 32]).copied().collect::<Vec<_>>()).unwrap().0,
            1
        );
    }
}
