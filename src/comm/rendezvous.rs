//! The TCP rendezvous where the members of a multi-process group meet: rank 0 listens and
//! hands every other member the same payload (NCCL's unique id, for one). It is a network
//! service, so it admits only members that prove they know the run's secret, and no stranger
//! can crash or stall it:
//!
//! - rank 0 binds where the caller says (the launcher's default is loopback);
//! - every message is a frame `[length: u32 LE][body]` of at most [`MAX_FRAME`] bytes, read
//!   under a per-message timeout ([`MESSAGE_TIMEOUT`]): oversized, malformed or slow messages
//!   close that connection with a logged reason and rank 0 goes on waiting for real members;
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
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

/// Largest frame either side accepts, in bytes (a hello is 44, a payload at most 4 KiB).
pub const MAX_FRAME: usize = 4096 + 64;
/// How long one message may take to arrive once a connection is open.
pub const MESSAGE_TIMEOUT: Duration = Duration::from_secs(2);
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
    let deadline = Instant::now() + timeout;
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

fn host(
    addr: &str,
    size: usize,
    secret: &Secret,
    payload: &[u8],
    deadline: Instant,
    timeout: Duration,
) -> Result<Vec<TcpStream>> {
    let listener = TcpListener::bind(addr).map_err(|e| rdzv_error(&format!("bind {addr}"), e.to_string()))?;
    listener.set_nonblocking(true).map_err(|e| rdzv_error("listener", e.to_string()))?;
    let mut admitted = vec![false; size];
    admitted[0] = true;
    let mut links: Vec<Option<TcpStream>> = (0..size).map(|_| None).collect();
    while admitted.iter().any(|a| !a) {
        let (mut peer, from) = match listener.accept() {
            Ok(p) => p,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                if Instant::now() >= deadline {
                    let missing: Vec<usize> = (0..size).filter(|&r| !admitted[r]).collect();
                    return Err(rdzv_error(
                        &format!("at {addr}"),
                        format!("ranks {missing:?} did not join within {timeout:?}"),
                    ));
                }
                std::thread::sleep(Duration::from_millis(20));
                continue;
            }
            Err(e) => return Err(rdzv_error("accept", e.to_string())),
        };
        // A stranger's connection costs at most two message timeouts, and never the run.
        match admit(&mut peer, size, secret, payload, &admitted) {
            Ok(r) => {
                admitted[r] = true;
                links[r] = Some(peer);
            }
            Err(why) => eprintln!("rendezvous at {addr}: refused a connection from {from}: {why}"),
        }
    }
    Ok(links.into_iter().skip(1).flatten().collect())
}

/// One connection's handshake on rank 0; returns the admitted rank.
fn admit(
    peer: &mut TcpStream,
    size: usize,
    secret: &Secret,
    payload: &[u8],
    admitted: &[bool],
) -> std::result::Result<usize, String> {
    let io = |e: std::io::Error| e.to_string();
    peer.set_nonblocking(false).map_err(io)?;
    peer.set_read_timeout(Some(MESSAGE_TIMEOUT)).map_err(io)?;
    peer.set_write_timeout(Some(MESSAGE_TIMEOUT)).map_err(io)?;
    let nonce = random_bytes::<NONCE>().map_err(|e| e.to_string())?;
    send(peer, &with_magic(&[&nonce])).map_err(io)?;
    let (rank, claimed, mac) = parse_hello(&read_frame(peer)?)?;
    let (r, s) = (rank.to_le_bytes(), claimed.to_le_bytes());
    if !secret.verify(&[b"hello", &nonce, &r, &s], &mac) {
        return Err("wrong secret (the MAC does not verify)".into());
    }
    let rank = rank as usize;
    if claimed as usize != size || rank == 0 || rank >= size {
        return Err(format!("claims rank {rank} of {claimed}; this group has ranks 1..{size} to admit"));
    }
    if admitted[rank] {
        return Err(format!("rank {rank} has already joined"));
    }
    let tag = secret.mac(&[b"welcome", &nonce, payload]);
    send(peer, &with_magic(&[&tag, payload])).map_err(io)?;
    Ok(rank)
}

fn join(
    addr: &str,
    rank: usize,
    size: usize,
    secret: &Secret,
    deadline: Instant,
    timeout: Duration,
) -> Result<(Vec<u8>, TcpStream)> {
    let target = addr
        .to_socket_addrs()
        .map_err(|e| rdzv_error(&format!("resolve {addr}"), e.to_string()))?
        .next()
        .ok_or_else(|| rdzv_error(&format!("resolve {addr}"), "no address"))?;
    let mut last = String::from("never tried");
    while Instant::now() < deadline {
        match TcpStream::connect_timeout(&target, Duration::from_millis(500)) {
            Ok(mut s) => match handshake(&mut s, rank, size, secret, deadline) {
                Ok(payload) => return Ok((payload, s)),
                // Rank 0 refused us (or is an impostor): a wrong secret will not get better.
                Err(Handshake::Refused(why)) => return Err(rdzv_error(&format!("at {addr}"), why)),
                // No challenge in time: rank 0 may be busy turning a stranger away; again.
                Err(Handshake::Unanswered(why)) => last = why,
            },
            Err(e) => last = e.to_string(),
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    Err(rdzv_error(&format!("at {addr}"), format!("could not connect to rank 0 within {timeout:?} ({last})")))
}

/// Why a member's handshake failed: worth another try, or not.
enum Handshake {
    /// Nothing came in time (rank 0 admits one connection at a time, and may be busy turning
    /// a stranger away).
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
    let nonce = read_challenge(s).map_err(Handshake::Refused)?;
    let (r, z) = ((rank as u32).to_le_bytes(), (size as u32).to_le_bytes());
    let mac = secret.mac(&[b"hello", &nonce, &r, &z]);
    send(s, &with_magic(&[&r, &z, &mac])).map_err(again)?;
    let (tag, payload) = read_welcome(s)
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
            // A right hello with a claimed size that does not match is refused as well.
            let e = meet(&addr, 1, 3, &secret, None, Duration::from_secs(5)).unwrap_err().to_string();
            assert!(e.contains("closed the connection"), "{e}");
            // The real member still gets in.
            assert_eq!(meet(&addr, 1, 2, &secret, None, Duration::from_secs(10)).unwrap(), b"id");
            host.join().unwrap().unwrap();
        });
    }

    /// Strangers who connect and say nothing hold rank 0 for a message timeout each; a member
    /// who arrives behind them gets no challenge in time, and tries again instead of failing.
    #[test]
    fn a_member_held_up_by_silent_strangers_still_gets_in() {
        let (addr, secret) = (free_addr(), Secret::new("patience").unwrap());
        std::thread::scope(|s| {
            let host = s.spawn(|| meet(&addr, 0, 2, &secret, Some(b"id"), Duration::from_secs(30)));
            let silent: Vec<TcpStream> = (0..2)
                .map(|_| {
                    loop {
                        if let Ok(c) = TcpStream::connect(&addr) {
                            break c;
                        }
                        std::thread::sleep(Duration::from_millis(10));
                    }
                })
                .collect();
            assert_eq!(meet(&addr, 1, 2, &secret, None, Duration::from_secs(30)).unwrap(), b"id");
            drop(silent);
            host.join().unwrap().unwrap();
        });
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

    #[test]
    fn bad_requests_and_secrets_are_refused_before_any_network() {
        assert!(Secret::new("").unwrap_err().to_string().contains("PT_RDZV_TOKEN"));
        let s = Secret::random().unwrap();
        assert_eq!(s.expose().len(), 64);
        assert!(!format!("{s:?}").contains(&s.expose()), "Debug hides the secret");
        assert!(meet("127.0.0.1:1", 2, 2, &s, None, Duration::ZERO).is_err());
        assert!(meet("127.0.0.1:1", 0, 2, &s, None, Duration::ZERO).unwrap_err().to_string().contains("payload"));
        assert!(parse_hello(&[0; 5]).is_err());
        assert_eq!(
            parse_hello(&[1, 0, 0, 0, 2, 0, 0, 0].iter().chain(&[9; 32]).copied().collect::<Vec<_>>()).unwrap().0,
            1
        );
    }
}
