//! Direct links between the members of a process group, opened right after the rendezvous
//! ([`super::rendezvous`]): the ring a [`ProcessGroup`](super::process_group::ProcessGroup)
//! sums gradients over, where every member sends to the next rank and receives from the one
//! before, instead of every byte passing through rank 0.
//!
//! How a ring opens: each member listens on the address it reached rank 0 from (on a port the
//! OS picks) and sends that address to rank 0 over its rendezvous link; rank 0 answers each
//! with the address of the rank after it. A member then connects to its next rank while it
//! admits the one before. Both ends of a link prove they know the run's secret, each with an
//! HMAC over a nonce the other chose, so the listener is the same closed door as the
//! rendezvous: a stranger who finds the port is refused with a logged reason and never holds
//! up the run, and the listener closes once the expected member is in.

use super::rendezvous::{Links, MAC, NONCE, Secret, first_byte, frame, random_bytes, rdzv_error, read_frame};
use crate::error::Result;
use std::io::Write;
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::time::{Duration, Instant};

/// A member's two links in the ring.
pub struct RingLinks {
    /// To rank `(rank + 1) % size`: this member only writes to it.
    pub next: TcpStream,
    /// From rank `(rank + size − 1) % size`: this member only reads from it.
    pub prev: TcpStream,
}

/// How long one handshake message may take (the rendezvous's own bound).
const MESSAGE_TIMEOUT: Duration = super::rendezvous::MESSAGE_TIMEOUT;

/// Opens this member's ring over the rendezvous links `star` (rank 0's `Hub`, a member's
/// `Spoke`), within `timeout`. None for a group of one.
pub fn open_ring(
    star: &mut Links,
    rank: usize,
    size: usize,
    secret: &Secret,
    timeout: Duration,
) -> Result<Option<RingLinks>> {
    if size < 2 {
        return Ok(None);
    }
    let deadline = Instant::now() + timeout;
    let ip = match star {
        Links::Hub(members) => members.first().map(TcpStream::local_addr),
        Links::Spoke(hub) => Some(hub.local_addr()),
    }
    .ok_or_else(|| rdzv_error("ring", "no rendezvous link to learn this member's address from"))?
    .map_err(|e| rdzv_error("ring", e.to_string()))?
    .ip();
    let listener = TcpListener::bind((ip, 0)).map_err(|e| rdzv_error(&format!("ring: bind {ip}"), e.to_string()))?;
    let mine = listener.local_addr().map_err(|e| rdzv_error("ring", e.to_string()))?;
    let next_addr = exchange_addresses(star, mine, size, timeout)?;
    let (next_rank, prev_rank) = ((rank + 1) % size, (rank + size - 1) % size);
    let (next, prev) = std::thread::scope(|s| {
        let admitted = s.spawn(|| admit_prev(&listener, rank, prev_rank, size, secret, deadline));
        let next = connect_next(next_addr, rank, next_rank, size, secret, deadline);
        (next, admitted.join().unwrap_or_else(|_| Err(rdzv_error("ring", "the admitting thread panicked"))))
    });
    Ok(Some(RingLinks { next: next?, prev: prev? }))
}

/// Every member's listening address to rank 0, and back to each the address of the rank after
/// it. Returns this member's next rank's address.
fn exchange_addresses(star: &mut Links, mine: SocketAddr, size: usize, timeout: Duration) -> Result<SocketAddr> {
    let io = |who: usize| move |e: std::io::Error| rdzv_error(&format!("ring: rank {who}"), e.to_string());
    match star {
        Links::Hub(members) => {
            let mut addrs = vec![mine];
            for (i, m) in members.iter_mut().enumerate() {
                m.set_read_timeout(Some(timeout)).map_err(io(i + 1))?;
                let body = read_frame(m).map_err(|e| rdzv_error(&format!("ring: rank {}", i + 1), e))?;
                addrs.push(parse_address(&body).map_err(|e| rdzv_error(&format!("ring: rank {}", i + 1), e))?);
            }
            for (i, m) in members.iter_mut().enumerate() {
                let next = addrs[(i + 2) % size].to_string();
                m.write_all(&frame(&[next.as_bytes()])).map_err(io(i + 1))?;
            }
            Ok(addrs[1])
        }
        Links::Spoke(hub) => {
            hub.write_all(&frame(&[mine.to_string().as_bytes()])).map_err(io(0))?;
            hub.set_read_timeout(Some(timeout)).map_err(io(0))?;
            let body = read_frame(hub).map_err(|e| rdzv_error("ring: rank 0", e))?;
            parse_address(&body).map_err(|e| rdzv_error("ring: rank 0", e))
        }
    }
}

/// An address message's body: `IP:PORT` in text, nothing else.
pub fn parse_address(body: &[u8]) -> std::result::Result<SocketAddr, String> {
    std::str::from_utf8(body)
        .ok()
        .and_then(|s| s.parse::<SocketAddr>().ok())
        .ok_or_else(|| format!("an address message of {} bytes that is not IP:PORT", body.len()))
}

/// A ring hello's body: the sender's rank, its nonce and its MAC over ours.
pub fn parse_peer_hello(body: &[u8]) -> std::result::Result<(u32, [u8; NONCE], [u8; MAC]), String> {
    if body.len() != 4 + NONCE + MAC {
        return Err(format!("a ring hello of {} bytes; expected {}", body.len(), 4 + NONCE + MAC));
    }
    let rank = u32::from_le_bytes([body[0], body[1], body[2], body[3]]);
    let nonce = body[4..4 + NONCE].try_into().map_err(|_| "nonce")?;
    let mac = body[4 + NONCE..].try_into().map_err(|_| "mac")?;
    Ok((rank, nonce, mac))
}

/// What the hello's MAC covers: who says it, to whom, in which group, against whose nonce.
fn hello_parts<'a>(nonce: &'a [u8], from: &'a [u8; 4], to: &'a [u8; 4], size: &'a [u8; 4]) -> [&'a [u8]; 5] {
    [b"ring hello", nonce, from, to, size]
}

/// Waits on `listener` for rank `prev` and admits it; refuses (and logs) anyone else.
fn admit_prev(
    listener: &TcpListener,
    rank: usize,
    prev: usize,
    size: usize,
    secret: &Secret,
    deadline: Instant,
) -> Result<TcpStream> {
    listener.set_nonblocking(true).map_err(|e| rdzv_error("ring listener", e.to_string()))?;
    loop {
        let (mut peer, from) = match listener.accept() {
            Ok(p) => p,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                if Instant::now() >= deadline {
                    return Err(rdzv_error("ring", format!("rank {prev} did not connect to rank {rank} in time")));
                }
                std::thread::sleep(Duration::from_millis(5));
                continue;
            }
            Err(e) => return Err(rdzv_error("ring: accept", e.to_string())),
        };
        match challenge(&mut peer, rank, prev, size, secret) {
            Ok(()) => return Ok(peer),
            Err(why) => eprintln!("ring of rank {rank}: refused a connection from {from}: {why}"),
        }
    }
}

/// The admitting side's handshake: our nonce out, the hello in and checked, our MAC back.
fn challenge(
    peer: &mut TcpStream,
    rank: usize,
    prev: usize,
    size: usize,
    secret: &Secret,
) -> std::result::Result<(), String> {
    let io = |e: std::io::Error| e.to_string();
    peer.set_nonblocking(false).map_err(io)?;
    peer.set_read_timeout(Some(MESSAGE_TIMEOUT)).map_err(io)?;
    peer.set_write_timeout(Some(MESSAGE_TIMEOUT)).map_err(io)?;
    let ours = random_bytes::<NONCE>().map_err(|e| e.to_string())?;
    peer.write_all(&frame(&[&ours])).map_err(io)?;
    let (from, theirs, mac) = parse_peer_hello(&read_frame(peer)?)?;
    let (f, t, z) = (from.to_le_bytes(), (rank as u32).to_le_bytes(), (size as u32).to_le_bytes());
    if !secret.verify(&hello_parts(&ours, &f, &t, &z), &mac) {
        return Err("wrong secret (the MAC does not verify)".into());
    }
    if from as usize != prev {
        return Err(format!("rank {from} knocked; expected rank {prev}"));
    }
    peer.write_all(&frame(&[&secret.mac(&[b"ring welcome", &theirs, &ours])])).map_err(io)
}

/// Connects to the next rank at `addr` (retrying until `deadline`) and proves who we are.
fn connect_next(
    addr: SocketAddr,
    rank: usize,
    next: usize,
    size: usize,
    secret: &Secret,
    deadline: Instant,
) -> Result<TcpStream> {
    let mut last = String::from("never tried");
    while Instant::now() < deadline {
        match TcpStream::connect_timeout(&addr, Duration::from_millis(500)) {
            Ok(mut s) => match hello(&mut s, rank, next, size, secret, deadline) {
                Ok(()) => return Ok(s),
                Err(Refused::Fatal(why)) => return Err(rdzv_error(&format!("ring: rank {next} at {addr}"), why)),
                // Not answered in time: the member may be busy refusing a stranger; again.
                Err(Refused::Retry(why)) => last = why,
            },
            Err(e) => last = e.to_string(),
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    Err(rdzv_error("ring", format!("could not connect to rank {next} at {addr} in time ({last})")))
}

/// Why a ring handshake failed: worth another try (nothing in time), or not (refused, or
/// not a challenge).
enum Refused {
    Retry(String),
    Fatal(String),
}

/// The connecting side's handshake: the challenge in, our hello out, the welcome checked.
fn hello(
    s: &mut TcpStream,
    rank: usize,
    next: usize,
    size: usize,
    secret: &Secret,
    deadline: Instant,
) -> std::result::Result<(), Refused> {
    let retry = |e: std::io::Error| Refused::Retry(e.to_string());
    first_byte(s, deadline).map_err(Refused::Retry)?;
    let theirs = read_frame(s).map_err(Refused::Fatal)?;
    if theirs.len() != NONCE {
        return Err(Refused::Fatal(format!("a challenge of {} bytes; expected {NONCE}", theirs.len())));
    }
    let ours = random_bytes::<NONCE>().map_err(|e| Refused::Fatal(e.to_string()))?;
    let (f, t, z) = ((rank as u32).to_le_bytes(), (next as u32).to_le_bytes(), (size as u32).to_le_bytes());
    let mac = secret.mac(&hello_parts(&theirs, &f, &t, &z));
    s.write_all(&frame(&[&f, &ours, &mac])).map_err(retry)?;
    let welcome = read_frame(s)
        .map_err(|e| Refused::Fatal(format!("the peer closed the connection ({e}): a wrong secret or rank?")))?;
    if !secret.verify(&[b"ring welcome", &ours, &theirs], &welcome) {
        return Err(Refused::Fatal("the peer at this address does not know the run's secret".into()));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::super::rendezvous::gather;
    use super::*;
    use std::io::Read;
    use std::net::IpAddr;

    fn loopback() -> IpAddr {
        IpAddr::from([127, 0, 0, 1])
    }

    fn members(size: usize, secret: &Secret) -> Vec<(Links, Option<RingLinks>)> {
        let port = TcpListener::bind((loopback(), 0)).unwrap().local_addr().unwrap().port();
        let addr = format!("127.0.0.1:{port}");
        std::thread::scope(|s| {
            let handles: Vec<_> = (0..size)
                .map(|r| {
                    let addr = &addr;
                    s.spawn(move || {
                        let t = Duration::from_secs(20);
                        let (_, mut star) = gather(addr, r, size, secret, Some(b"p"), t).unwrap();
                        let ring = open_ring(&mut star, r, size, secret, t).unwrap();
                        (star, ring)
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        })
    }

    /// Every member's next link reaches the next rank: a byte written by rank r is read by
    /// rank r + 1 from its prev link.
    #[test]
    fn each_member_is_linked_to_the_next_rank() {
        for size in [2, 3, 4] {
            let secret = Secret::new("ring").unwrap();
            let mut m = members(size, &secret);
            for (r, (_, ring)) in m.iter_mut().enumerate() {
                ring.as_mut().unwrap().next.write_all(&[r as u8]).unwrap();
            }
            for (r, (_, ring)) in m.iter_mut().enumerate() {
                let mut b = [0u8];
                ring.as_mut().unwrap().prev.read_exact(&mut b).unwrap();
                assert_eq!(b[0] as usize, (r + size - 1) % size, "size {size}, rank {r}");
            }
        }
    }

    /// A stranger at a member's ring port, without the secret or claiming another rank, is
    /// refused and the real member still gets in.
    #[test]
    fn strangers_at_the_ring_port_are_refused() {
        let secret = Secret::new("ring-key").unwrap();
        let listener = TcpListener::bind((loopback(), 0)).unwrap();
        let addr = listener.local_addr().unwrap();
        let deadline = Instant::now() + Duration::from_secs(20);
        std::thread::scope(|s| {
            let admitted = s.spawn(|| admit_prev(&listener, 1, 0, 2, &secret, deadline));
            let wrong = Secret::new("other").unwrap();
            assert!(connect_next(addr, 0, 1, 2, &wrong, deadline).is_err(), "a wrong secret");
            assert!(connect_next(addr, 1, 1, 2, &secret, deadline).is_err(), "the wrong rank");
            let mut junk = TcpStream::connect(addr).unwrap();
            junk.write_all(&u32::MAX.to_le_bytes()).unwrap();
            let mut sink = Vec::new();
            let _ = junk.read_to_end(&mut sink); // refused: the member hangs up
            let real = connect_next(addr, 0, 1, 2, &secret, deadline).unwrap();
            let peer = admitted.join().unwrap().unwrap();
            assert_eq!(peer.peer_addr().unwrap(), real.local_addr().unwrap());
        });
    }

    /// A member held up behind silent strangers at its next rank's port gets no challenge in
    /// time, and tries again instead of failing the run.
    #[test]
    fn a_member_held_up_by_silent_strangers_still_links() {
        let secret = Secret::new("ring-patience").unwrap();
        let listener = TcpListener::bind((loopback(), 0)).unwrap();
        let addr = listener.local_addr().unwrap();
        let deadline = Instant::now() + Duration::from_secs(30);
        std::thread::scope(|s| {
            let silent: Vec<TcpStream> = (0..2).map(|_| TcpStream::connect(addr).unwrap()).collect();
            let admitted = s.spawn(|| admit_prev(&listener, 1, 0, 2, &secret, deadline));
            let real = connect_next(addr, 0, 1, 2, &secret, deadline).unwrap();
            assert_eq!(admitted.join().unwrap().unwrap().peer_addr().unwrap(), real.local_addr().unwrap());
            drop(silent);
        });
    }

    #[test]
    fn malformed_ring_messages_are_refused() {
        assert!(parse_address(b"127.0.0.1:80").is_ok());
        assert!(parse_address(b"not an address").unwrap_err().contains("IP:PORT"));
        assert!(parse_address(&[0xff, 0xfe]).is_err());
        assert!(parse_peer_hello(&[0; 3]).unwrap_err().contains("expected 68"));
        let (rank, nonce, mac) = parse_peer_hello(&[[2, 0, 0, 0].as_slice(), &[5; NONCE], &[6; MAC]].concat()).unwrap();
        assert_eq!((rank, nonce, mac), (2, [5; NONCE], [6; MAC]));
    }
}
