//! How the workers of one step talk: one inbox per device for activations and gradients, an
//! abort flag every wait watches, and the record of who failed first.

use crate::error::{Error, Result};
use crate::pipeline::schedule::MessageKey;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Condvar, Mutex};
use std::time::Instant;

/// A message's name: [`MessageKey`], the one the schedule and its validator use.
pub(super) type Tag = MessageKey;

/// One device's inbox.
#[derive(Default)]
struct Mailbox {
    slots: Mutex<HashMap<Tag, Option<Vec<f32>>>>,
    arrived: Condvar,
}

/// What every worker of a step shares: inboxes, the abort flag and the errors.
pub(super) struct Shared {
    mailboxes: Vec<Mailbox>,
    abort: AtomicBool,
    /// Every failure, in order, with its device and whether it is only a consequence of
    /// another's (a worker woken by the abort, a ring whose peer is gone).
    errors: Mutex<Vec<(usize, Error, bool)>>,
    start: Instant,
    /// Whether a wait lends its thread to the host pool the workers run on
    /// ([`crate::device::HostPool::run_each`]) instead of sleeping.
    lend_waits: AtomicBool,
}

/// What a worker reports when it stops because the step was aborted elsewhere.
const ABORTED: &str = "step aborted";

/// The error of a worker that stopped because another failed.
pub(super) fn aborted(detail: String) -> Error {
    Error::Internal { what: ABORTED.into(), message: detail }
}

/// The error of a thread that panicked.
pub(super) fn panicked(what: &str, payload: &(dyn std::any::Any + Send)) -> Error {
    let msg = payload
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_default();
    Error::Internal { what: what.into(), message: format!("panicked: {msg}") }
}

impl Shared {
    pub fn new(devices: usize) -> Self {
        Shared {
            mailboxes: (0..devices).map(|_| Mailbox::default()).collect(),
            abort: AtomicBool::new(false),
            errors: Mutex::new(Vec::new()),
            start: Instant::now(),
            lend_waits: AtomicBool::new(false),
        }
    }

    /// Seconds since the step started.
    pub fn now(&self) -> f64 {
        self.start.elapsed().as_secs_f64()
    }

    pub fn aborted(&self) -> bool {
        self.abort.load(Ordering::Acquire)
    }

    /// Whether waits lend their thread to the workers' pool (set before the workers start).
    pub fn lend_waits(&self, on: bool) {
        self.lend_waits.store(on, Ordering::Release);
    }

    /// Delivers `data` (`None`: a gradient that is known to be zero) to `device`'s inbox.
    pub fn put(&self, device: usize, tag: Tag, data: Option<Vec<f32>>) {
        let mb = &self.mailboxes[device];
        mb.slots.lock().unwrap_or_else(|e| e.into_inner()).insert(tag, data);
        mb.arrived.notify_all();
    }

    /// Waits for `tag` in `device`'s inbox, or for the abort flag.
    pub fn take(&self, device: usize, tag: Tag) -> Result<Option<Vec<f32>>> {
        let mb = &self.mailboxes[device];
        let mut slots = mb.slots.lock().unwrap_or_else(|e| e.into_inner());
        loop {
            if let Some(data) = slots.remove(&tag) {
                return Ok(data);
            }
            if self.aborted() {
                return Err(aborted(format!("device {device} stopped waiting for {tag:?}")));
            }
            if self.lend_waits.load(Ordering::Acquire) {
                // Another worker's op may have a piece waiting for this thread: run it, or
                // give the core away for a moment, then look again. (Sleeping would leave the
                // piece to a thread that is busy with its own stage.)
                drop(slots);
                crate::device::host_pool::lend_thread();
                slots = mb.slots.lock().unwrap_or_else(|e| e.into_inner());
                continue;
            }
            slots = mb.arrived.wait(slots).unwrap_or_else(|e| e.into_inner());
        }
    }

    /// Records `e` (from device `device`) and wakes everyone.
    pub fn fail(&self, device: usize, e: Error) {
        let secondary = matches!(&e, Error::Internal { what, .. } if what == ABORTED);
        self.errors.lock().unwrap_or_else(|e| e.into_inner()).push((device, e, secondary));
        self.abort.store(true, Ordering::Release);
        for mb in &self.mailboxes {
            // Taking the lock orders the flag before the wake-up of a worker about to wait.
            let _guard = mb.slots.lock().unwrap_or_else(|e| e.into_inner());
            mb.arrived.notify_all();
        }
    }

    /// The error that caused the abort: the first that is not a consequence of another.
    pub fn take_error(&self) -> Option<Error> {
        let mut errors = std::mem::take(&mut *self.errors.lock().unwrap_or_else(|e| e.into_inner()));
        let root = errors.iter().position(|(_, _, secondary)| !secondary).unwrap_or(0);
        (!errors.is_empty()).then(|| {
            let (device, e, _) = errors.swap_remove(root);
            Error::Pipeline { device, source: Box::new(e) }
        })
    }
}

/// The next message of `inbox` (`None` once its sender is gone). A thread that `lend`s runs
/// other threads' pending op pieces while it waits.
pub(super) fn receive<T>(inbox: &std::sync::mpsc::Receiver<T>, lend: bool) -> Option<T> {
    if !lend {
        return inbox.recv().ok();
    }
    loop {
        match inbox.try_recv() {
            Ok(v) => return Some(v),
            Err(std::sync::mpsc::TryRecvError::Empty) => crate::device::host_pool::lend_thread(),
            Err(std::sync::mpsc::TryRecvError::Disconnected) => return None,
        }
    }
}

/// Sends `v` on `feed`, lending the thread while the channel is full, as [`receive`]; false
/// when the receiver is gone.
pub(super) fn send<T>(feed: &std::sync::mpsc::SyncSender<T>, mut v: T, lend: bool) -> bool {
    if !lend {
        return feed.send(v).is_ok();
    }
    loop {
        match feed.try_send(v) {
            Ok(()) => return true,
            Err(std::sync::mpsc::TrySendError::Full(back)) => {
                v = back;
                crate::device::host_pool::lend_thread();
            }
            Err(std::sync::mpsc::TrySendError::Disconnected(_)) => return false,
        }
    }
}
