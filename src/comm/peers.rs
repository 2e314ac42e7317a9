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
//!
//! A member that dies or fails while the rings open must not leave the others waiting for
//! their deadline: while its links open, a member watches its rendezvous links (rank 0 all of
//! them, the others their link to rank 0), and then every member reports to rank 0, which
//! watches the members it still waits for and answers all with the verdict. Rank 0 sees a dead
//! member's link end, or its report of failure, and calls the opening off; the others see
//! that on their link to it and stop at once.

use super::rendezvous::{
    Links, MAC, MAX_GROUP, NONCE, Secret, admit_concurrently, deadline_after, first_byte, frame, message_deadline,
    random_bytes, rdzv_error, read_frame, read_frame_by,
};
use crate::error::Result;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

/// A member's two links in its ring, with the ranks at their other ends.
pub struct RingLinks {
    /// To the next member: this member only writes to it.
    pub next: TcpStream,
    /// From the member before: this member only reads from it.
    pub prev: TcpStream,
    /// The next member's rank in the group the ring was opened over.
    pub next_rank: usize,
    /// The rank of the member before.
    pub prev_rank: usize,
}

/// How long one handshake message may take (the rendezvous's own bound).
const MESSAGE_TIMEOUT: Duration = super::rendezvous::MESSAGE_TIMEOUT;

/// Opens this member's ring over the rendezvous links `star` (rank 0's `Hub`, a member's
/// `Spoke`), within `timeout`: the ranks `0..size` in order. None for a group of one.
pub fn open_ring(
    star: &mut Links,
    rank: usize,
    size: usize,
    secret: &Secret,
    timeout: Duration,
) -> Result<Option<RingLinks>> {
    open_rings(star, rank, &[(0..size).collect()], b"group", secret, timeout)
}

/// Opens several rings at once over the rendezvous links `star`: `rings` (the same on every
/// member) lists each ring's members by rank, in ring order, and holds every rank of the group
/// once. This member joins the ring it is in; `label` names the set, and a handshake proves
/// it as it proves the secret, so links of one set can never be taken for another's. None for
/// a member alone in its ring. Every member of the group calls it at the same point.
pub fn open_rings(
    star: &mut Links,
    rank: usize,
    rings: &[Vec<usize>],
    label: &[u8],
    secret: &Secret,
    timeout: Duration,
) -> Result<Option<RingLinks>> {
    let size: usize = rings.iter().map(Vec::len).sum();
    if size > MAX_GROUP {
        return Err(rdzv_error("ring", format!("a group of {size} processes; at most {MAX_GROUP}")));
    }
    let mut seen = vec![false; size];
    for &m in rings.iter().flatten() {
        if m >= size || std::mem::replace(&mut seen[m], true) {
            return Err(rdzv_error("ring", format!("{rings:?} do not hold each of the ranks 0..{size} once")));
        }
    }
    // Every rank's neighbours in its ring, and its ring's length.
    let mut next_of = vec![0; size];
    let mut prev_of = vec![0; size];
    let mut len_of = vec![0; size];
    for ring in rings {
        for (i, &m) in ring.iter().enumerate() {
            next_of[m] = ring[(i + 1) % ring.len()];
            prev_of[m] = ring[(i + ring.len() - 1) % ring.len()];
            len_of[m] = ring.len();
        }
    }
    if size < 2 {
        return Ok(None);
    }
    let deadline = deadline_after(timeout)?;
    // The address this member was reached on at the rendezvous. Rank 0's is the one its
    // ring's previous member reached it on, which that member can reach again (another
    // member, on rank 0's own node, may have come in by loopback).
    let ip = match star {
        Links::Hub(members) => members.get(prev_of[0].saturating_sub(1)).map(TcpStream::local_addr),
        Links::Spoke(hub) => Some(hub.local_addr()),
    }
    .ok_or_else(|| rdzv_error("ring", "no rendezvous link to learn this member's address from"))?
    .map_err(|e| rdzv_error("ring", e.to_string()))?
    .ip();
    let listener = TcpListener::bind((ip, 0)).map_err(|e| rdzv_error(&format!("ring: bind {ip}"), e.to_string()))?;
    let mine = listener.local_addr().map_err(|e| rdzv_error("ring", e.to_string()))?;
    // Every member takes part in the exchange, a member alone in its ring too.
    let next_addr = exchange_addresses(star, mine, &next_of, timeout)?;
    let (next_rank, prev_rank) = (next_of[rank], prev_of[rank]);
    let gone = Mutex::new(None);
    let me = Member { rank, ring_len: len_of[rank], label, secret, stop: &gone };
    let linked = if len_of[rank] < 2 {
        Ok(None)
    } else {
        let done = AtomicBool::new(false);
        let (next, prev) = std::thread::scope(|s| {
            // While the links open, a member that dies (or rank 0 calling the opening off)
            // must end the wait at once, not at the deadline.
            let watcher = s.spawn(|| watch(star, &done, &gone));
            let admitted = s.spawn(|| admit_prev(&listener, &me, prev_rank, deadline));
            let next = connect_next(next_addr, &me, next_rank, deadline);
            if next.is_err() {
                me.stop_with(Stop::Failed(rank)); // no use admitting the member before
            }
            let prev = admitted.join().unwrap_or_else(|_| Err(rdzv_error("ring", "the admitting thread panicked")));
            done.store(true, Ordering::Release);
            let _ = watcher.join();
            (next, prev)
        });
        next.and_then(|next| Ok(Some(RingLinks { next, prev: prev?, next_rank, prev_rank })))
    };
    // Nobody goes on before every ring is open: a member that failed or died fails them all.
    let verdict = agree_opened(star, linked.is_ok(), deadline);
    let links = linked?;
    verdict?;
    Ok(links)
}

/// What a member reports to rank 0 once its ring links are open (or not), and what rank 0
/// answers every member.
const OPENED: u8 = 1;
const FAILED: u8 = 0;

/// Why a member stops waiting for its ring links before the deadline.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Stop {
    /// A peer's rendezvous link ended: that process is gone.
    Died(usize),
    /// That member reported it could not link up (or, this member's own rank: it could not).
    Failed(usize),
    /// Rank 0 answered before this member reported: another member failed.
    CalledOff,
}

/// Until `done`, looks at the rendezvous links every few milliseconds for a reason to stop
/// waiting: the end of a peer's stream (a process that died), a member's report that it
/// failed (rank 0's links), or any answer from rank 0 (a member's link: rank 0 called the
/// opening off). Records it in `stop`.
fn watch(star: &Links, done: &AtomicBool, stop: &Mutex<Option<Stop>>) {
    let streams: Vec<(usize, &TcpStream)> = match star {
        Links::Hub(members) => members.iter().enumerate().map(|(i, m)| (i + 1, m)).collect(),
        Links::Spoke(hub) => vec![(0, hub)],
    };
    let spoke = matches!(star, Links::Spoke(_));
    let set = |blocking: bool| streams.iter().all(|(_, s)| s.set_nonblocking(!blocking).is_ok());
    if set(false) {
        while !done.load(Ordering::Acquire) {
            let mut byte = [0u8];
            let seen = streams.iter().find_map(|&(r, s)| match s.peek(&mut byte) {
                Ok(0) => Some(Stop::Died(r)),
                Ok(_) if spoke => Some(Stop::CalledOff),
                Ok(_) if byte[0] == FAILED => Some(Stop::Failed(r)),
                Ok(_) => None,
                Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::Interrupted) => None,
                Err(_) => Some(Stop::Died(r)),
            });
            if let Some(why) = seen {
                *stop.lock().unwrap_or_else(|e| e.into_inner()) = Some(why);
                break;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }
    // Blocking again whatever happened: the barrier after reads these links.
    set(true);
}

/// The barrier after the rings open: every member tells rank 0 whether its links opened, and
/// rank 0, watching all of them at once (a member that died ends the wait), answers each with
/// the verdict. An error when any member failed or died.
fn agree_opened(star: &mut Links, opened: bool, deadline: Instant) -> Result<()> {
    let fail = |m: String| rdzv_error("ring", m);
    match star {
        Links::Hub(members) => {
            let mut verdict = if opened { Ok(()) } else { Err(fail("rank 0 could not open its ring links".into())) };
            let mut pending: Vec<usize> = (0..members.len()).collect();
            while verdict.is_ok() && !pending.is_empty() {
                let mut still = Vec::new();
                for i in pending {
                    let m = &mut members[i];
                    let _ = m.set_nonblocking(true);
                    let seen = m.peek(&mut [0u8]);
                    let _ = m.set_nonblocking(false);
                    match seen {
                        Ok(0) => {
                            verdict = Err(fail(format!("rank {} closed its connection while the rings opened", i + 1)))
                        }
                        Ok(_) => {
                            let mut b = [0u8];
                            let read = m.read_exact(&mut b);
                            if read.is_err() || b[0] != OPENED {
                                verdict = Err(fail(format!("rank {} could not open its ring links", i + 1)));
                            }
                        }
                        Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => still.push(i),
                        Err(e) => verdict = Err(fail(format!("rank {}: {e}", i + 1))),
                    }
                }
                pending = still;
                if verdict.is_ok() && !pending.is_empty() {
                    if Instant::now() >= deadline {
                        verdict = Err(fail(format!("rank {} did not open its ring links in time", pending[0] + 1)));
                    }
                    std::thread::sleep(Duration::from_millis(5));
                }
            }
            let answer = if verdict.is_ok() { OPENED } else { FAILED };
            for m in members.iter_mut() {
                let _ = m.write_all(&[answer]);
            }
            verdict
        }
        Links::Spoke(hub) => {
            let _ = hub.write_all(&[if opened { OPENED } else { FAILED }]);
            let mut b = [0u8];
            match hub.read_exact(&mut b) {
                Ok(()) if b[0] == OPENED => Ok(()),
                Ok(()) => Err(fail("another member could not open its ring links (rank 0's error names it)".into())),
                Err(e) => Err(fail(format!("rank 0: {}", super::process_group::closed(&e)))),
            }
        }
    }
}

/// Who this member is in a ring being opened: what its handshakes prove; and whether it should
/// stop waiting (what [`watch`] saw, or its own failure to link up).
struct Member<'a> {
    rank: usize,
    ring_len: usize,
    label: &'a [u8],
    secret: &'a Secret,
    stop: &'a Mutex<Option<Stop>>,
}

impl Member<'_> {
    fn stop_with(&self, why: Stop) {
        self.stop.lock().unwrap_or_else(|e| e.into_inner()).get_or_insert(why);
    }

    /// An error when there is no use waiting for the deadline any more.
    fn check_peers(&self) -> Result<()> {
        let why = match *self.stop.lock().unwrap_or_else(|e| e.into_inner()) {
            None => return Ok(()),
            Some(Stop::Died(r)) => format!("rank {r} closed its connection (the process ended or was killed)"),
            Some(Stop::Failed(r)) if r == self.rank => "this member could not link up".into(),
            Some(Stop::Failed(r)) => format!("rank {r} could not open its ring links"),
            Some(Stop::CalledOff) => {
                "rank 0 called the opening off: another member failed (rank 0's error names it)".into()
            }
        };
        Err(rdzv_error("ring", why))
    }
}

/// Every member's listening address to rank 0, and back to each the address of its next
/// member (`next_of[rank]`). Returns this member's next member's address.
fn exchange_addresses(star: &mut Links, mine: SocketAddr, next_of: &[usize], timeout: Duration) -> Result<SocketAddr> {
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
                let next = addrs[next_of[i + 1]].to_string();
                m.write_all(&frame(&[next.as_bytes()])).map_err(io(i + 1))?;
            }
            Ok(addrs[next_of[0]])
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

/// What the hello's MAC covers: who says it, to whom, in which ring (its length and the set's
/// label), against whose nonce.
fn hello_parts<'a>(
    nonce: &'a [u8],
    from: &'a [u8; 4],
    to: &'a [u8; 4],
    len: &'a [u8; 4],
    label: &'a [u8],
) -> [&'a [u8]; 6] {
    [b"ring hello", nonce, from, to, len, label]
}

/// Waits on `listener` for rank `prev` and admits it; refuses (and logs) anyone else. The
/// handshakes run side by side, so strangers who stall do not keep `prev` waiting.
fn admit_prev(listener: &TcpListener, me: &Member, prev: usize, deadline: Instant) -> Result<TcpStream> {
    let rank = me.rank;
    let mut admitted = None;
    admit_concurrently(
        listener,
        &format!("ring of rank {rank}"),
        |peer| challenge(peer, me, prev, deadline),
        |peer, ()| {
            admitted = Some(peer);
            Ok(true) // the one member this listener waits for
        },
        || {
            me.check_peers()?;
            match Instant::now() >= deadline {
                false => Ok(()),
                true => Err(rdzv_error("ring", format!("rank {prev} did not connect to rank {rank} in time"))),
            }
        },
    )?;
    admitted.ok_or_else(|| rdzv_error("ring", format!("rank {prev} did not connect to rank {rank}")))
}

/// The admitting side's handshake: our nonce out, the hello in and checked, our MAC back.
fn challenge(peer: &mut TcpStream, me: &Member, prev: usize, deadline: Instant) -> std::result::Result<(), String> {
    let io = |e: std::io::Error| e.to_string();
    peer.set_nonblocking(false).map_err(io)?;
    peer.set_write_timeout(Some(MESSAGE_TIMEOUT)).map_err(io)?;
    let ours = random_bytes::<NONCE>().map_err(|e| e.to_string())?;
    peer.write_all(&frame(&[&ours])).map_err(io)?;
    let (from, theirs, mac) = parse_peer_hello(&read_frame_by(peer, message_deadline(deadline))?)?;
    // `open_rings` caps the group at MAX_GROUP: ranks and lengths fit a u32.
    let (f, t, z) = (from.to_le_bytes(), (me.rank as u32).to_le_bytes(), (me.ring_len as u32).to_le_bytes());
    if !me.secret.verify(&hello_parts(&ours, &f, &t, &z, me.label), &mac) {
        return Err("wrong secret or ring (the MAC does not verify)".into());
    }
    if from as usize != prev {
        return Err(format!("rank {from} knocked; expected rank {prev}"));
    }
    peer.write_all(&frame(&[&me.secret.mac(&[b"ring welcome", &theirs, &ours])])).map_err(io)
}

/// Connects to the next member, rank `next` at `addr` (retrying until `deadline`), and proves
/// who we are.
fn connect_next(addr: SocketAddr, me: &Member, next: usize, deadline: Instant) -> Result<TcpStream> {
    let mut last = String::from("never tried");
    while Instant::now() < deadline {
        me.check_peers()?;
        match TcpStream::connect_timeout(&addr, Duration::from_millis(500)) {
            Ok(mut s) => match hello(&mut s, me, next, deadline) {
                Ok(()) => return Ok(s),
                Err(Refused::Fatal(why)) => return Err(rdzv_error(&format!("ring: rank {next} at {addr}"), why)),
                // Not answered in time: the member may be busy with a crowd of strangers; again.
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
fn hello(s: &mut TcpStream, me: &Member, next: usize, deadline: Instant) -> std::result::Result<(), Refused> {
    let retry = |e: std::io::Error| Refused::Retry(e.to_string());
    first_byte(s, deadline).map_err(Refused::Retry)?;
    let theirs = read_frame_by(s, message_deadline(deadline)).map_err(Refused::Fatal)?;
    if theirs.len() != NONCE {
        return Err(Refused::Fatal(format!("a challenge of {} bytes; expected {NONCE}", theirs.len())));
    }
    let ours = random_bytes::<NONCE>().map_err(|e| Refused::Fatal(e.to_string()))?;
    // `open_rings` caps the group at MAX_GROUP: ranks and lengths fit a u32.
    let (f, t, z) = ((me.rank as u32).to_le_bytes(), (next as u32).to_le_bytes(), (me.ring_len as u32).to_le_bytes());
    let mac = me.secret.mac(&hello_parts(&theirs, &f, &t, &z, me.label));
    s.write_all(&frame(&[&f, &ours, &mac])).map_err(retry)?;
    let welcome = read_frame_by(s, message_deadline(deadline))
        .map_err(|e| Refused::Fatal(format!("the peer closed the connection ({e}): a wrong secret or rank?")))?;
    if !me.secret.verify(&[b"ring welcome", &ours, &theirs], &welcome) {
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

    /// Rank `rank` of a ring of two.
    fn member<'a>(rank: usize, secret: &'a Secret) -> Member<'a> {
        static GO_ON: Mutex<Option<Stop>> = Mutex::new(None);
        Member { rank, ring_len: 2, label: b"group", secret, stop: &GO_ON }
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
            let admitted = s.spawn(|| admit_prev(&listener, &member(1, &secret), 0, deadline));
            let wrong = Secret::new("other").unwrap();
            assert!(connect_next(addr, &member(0, &wrong), 1, deadline).is_err(), "a wrong secret");
            assert!(connect_next(addr, &member(1, &secret), 1, deadline).is_err(), "the wrong rank");
            let other_ring = Member { label: b"another set of rings", ..member(0, &secret) };
            assert!(connect_next(addr, &other_ring, 1, deadline).is_err(), "a ring of another set");
            let mut junk = TcpStream::connect(addr).unwrap();
            junk.write_all(&u32::MAX.to_le_bytes()).unwrap();
            let mut sink = Vec::new();
            let _ = junk.read_to_end(&mut sink); // refused: the member hangs up
            let real = connect_next(addr, &member(0, &secret), 1, deadline).unwrap();
            let peer = admitted.join().unwrap().unwrap();
            assert_eq!(peer.peer_addr().unwrap(), real.local_addr().unwrap());
        });
    }

    /// A stranger at the ring port who sends a hello a byte at a time (each byte well within
    /// the socket's timeout) neither holds the member past a message timeout nor keeps the
    /// real member before it out.
    #[test]
    fn a_stranger_who_sends_slowly_does_not_keep_the_ring_member_out() {
        let secret = Secret::new("ring-slow").unwrap();
        let listener = TcpListener::bind((loopback(), 0)).unwrap();
        let addr = listener.local_addr().unwrap();
        let deadline = Instant::now() + Duration::from_secs(8);
        let stop = AtomicBool::new(false);
        let started = Instant::now();
        std::thread::scope(|s| {
            s.spawn(|| {
                let mut c = TcpStream::connect(addr).unwrap();
                let _ = c.write_all(&(4 + NONCE as u32 + MAC as u32 + 8).to_le_bytes());
                while !stop.load(Ordering::Relaxed) && started.elapsed() < Duration::from_secs(12) {
                    if c.write_all(b"P").is_err() {
                        break;
                    }
                    std::thread::sleep(Duration::from_millis(300));
                }
            });
            std::thread::sleep(Duration::from_millis(200)); // the stranger is first in line
            let admitted = s.spawn(|| admit_prev(&listener, &member(1, &secret), 0, deadline));
            let real = connect_next(addr, &member(0, &secret), 1, deadline);
            let admitted = admitted.join().unwrap();
            stop.store(true, Ordering::Relaxed);
            assert_eq!(admitted.unwrap().peer_addr().unwrap(), real.unwrap().local_addr().unwrap());
            assert!(started.elapsed() < Duration::from_secs(4), "took {:?}", started.elapsed());
        });
    }

    /// Many silent strangers at the ring port are challenged side by side: the member behind
    /// them links at once, not after a message timeout for each.
    #[test]
    fn a_crowd_of_silent_strangers_does_not_hold_the_ring_member_up() {
        let secret = Secret::new("ring-crowd").unwrap();
        let listener = TcpListener::bind((loopback(), 0)).unwrap();
        let addr = listener.local_addr().unwrap();
        let deadline = Instant::now() + Duration::from_secs(10);
        std::thread::scope(|s| {
            let silent: Vec<TcpStream> = (0..16).map(|_| TcpStream::connect(addr).unwrap()).collect();
            let started = Instant::now();
            let admitted = s.spawn(|| admit_prev(&listener, &member(1, &secret), 0, deadline));
            let real = connect_next(addr, &member(0, &secret), 1, deadline).unwrap();
            assert_eq!(admitted.join().unwrap().unwrap().peer_addr().unwrap(), real.local_addr().unwrap());
            assert!(started.elapsed() < MESSAGE_TIMEOUT, "the member waited {:?}", started.elapsed());
            drop(silent);
        });
    }

    /// A timeout too long to add to the clock is an error on every member, not a panic.
    #[test]
    fn a_timeout_too_long_for_the_clock_is_an_error() {
        let secret = Secret::new("ring-forever").unwrap();
        let port = TcpListener::bind((loopback(), 0)).unwrap().local_addr().unwrap().port();
        let addr = format!("127.0.0.1:{port}");
        let errors: Vec<String> = std::thread::scope(|s| {
            let handles: Vec<_> = (0..2)
                .map(|r| {
                    let (addr, secret) = (&addr, &secret);
                    s.spawn(move || {
                        let (_, mut star) = gather(addr, r, 2, secret, Some(b"p"), Duration::from_secs(20)).unwrap();
                        open_ring(&mut star, r, 2, secret, Duration::MAX).err().map(|e| e.to_string())
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap().unwrap_or_default()).collect()
        });
        for e in errors {
            assert!(e.contains("timeout") && e.contains("too long"), "{e}");
        }
    }

    /// A member that dies after the address exchange, before it links up, ends every other
    /// member's opening at once (rank 0 sees its link end and calls the opening off), not at
    /// the 20 s deadline, whether it is rank 0's ring partner or another's; rank 0 names it.
    #[test]
    fn a_member_that_dies_while_the_rings_open_fails_them_all_at_once() {
        for rings in [[vec![0, 2], vec![1, 3]], [vec![0, 3], vec![1, 2]]] {
            let secret = Secret::new("ring-death").unwrap();
            let port = TcpListener::bind((loopback(), 0)).unwrap().local_addr().unwrap().port();
            let addr = format!("127.0.0.1:{port}");
            let t = Duration::from_secs(20);
            let started = Instant::now();
            let errors: Vec<Option<String>> = std::thread::scope(|s| {
                let handles: Vec<_> = (0..4)
                    .map(|r| {
                        let (addr, secret, rings) = (&addr, &secret, &rings);
                        s.spawn(move || {
                            let (_, mut star) = gather(addr, r, 4, secret, Some(b"p"), t).unwrap();
                            if r == 3 {
                                // Hands its address over, then dies before it links up.
                                let listener = TcpListener::bind((loopback(), 0)).unwrap();
                                let mut next_of = [0; 4];
                                for ring in rings {
                                    for (i, &m) in ring.iter().enumerate() {
                                        next_of[m] = ring[(i + 1) % ring.len()];
                                    }
                                }
                                exchange_addresses(&mut star, listener.local_addr().unwrap(), &next_of, t).unwrap();
                                return None;
                            }
                            Some(open_rings(&mut star, r, rings, b"columns", secret, t).err().map(|e| e.to_string()))
                        })
                    })
                    .collect();
                handles.into_iter().map(|h| h.join().unwrap().flatten()).collect()
            });
            assert!(
                started.elapsed() < Duration::from_secs(10),
                "{rings:?}: ended {:?} after the start",
                started.elapsed()
            );
            assert!(errors[0].as_deref().is_some_and(|e| e.contains("rank 3")), "{rings:?}: {:?}", errors[0]);
            for r in [1, 2] {
                assert!(errors[r].is_some(), "{rings:?}: rank {r} fails too");
            }
        }
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
