//! A request to stop training between steps, as a signal handler makes one (Ctrl-C, a job
//! scheduler's SIGTERM before it kills): [`Trainer::fit`](super::Trainer::fit) ends after the
//! step under way, and the run writes its checkpoint before it ends, so `--resume` loses
//! nothing. One flag for the process; the processes of a launched run vote with theirs in
//! every step's sums, so that all stop after the same step (the one after the request's).

use std::sync::atomic::{AtomicBool, Ordering};

static REQUESTED: AtomicBool = AtomicBool::new(false);

/// Asks every trainer of this process to stop after its current step. One atomic store, so a
/// signal handler may call it.
pub fn request_stop() {
    REQUESTED.store(true, Ordering::Relaxed);
}

/// Whether a stop was asked for.
pub fn stop_requested() -> bool {
    REQUESTED.load(Ordering::Relaxed)
}

/// Withdraws a stop request: a program that goes on after a run stopped (a library's caller
/// that trains again in the same process) clears it before the next, which would otherwise
/// stop before its first step.
pub fn clear_stop() {
    REQUESTED.store(false, Ordering::Relaxed);
}
