//! A watchdog for collectives that can wait forever: NCCL's wait on the GPU for a peer that is
//! gone, with no timeout of its own. While a step's collectives run, a thread waits for the
//! step to say it is done; if the group's timeout passes first with the step making no
//! progress, it runs the given way out (abort the communicators, hang up the process group), so
//! the waits end in errors instead of a hang — what PyTorch's NCCL watchdog does with
//! `ncclCommAbort`. A step that goes on, however long, is not stalled: the timeout runs from
//! the last action it finished (PyTorch's times each collective from its launch alike).

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Watches one stretch of work; [`stop`](Self::stop) it when the work is done.
pub struct Watchdog {
    done: Option<mpsc::Sender<()>>,
    thread: Option<JoinHandle<bool>>,
}

impl Watchdog {
    /// Runs `on_timeout` once `timeout` passes with `progress` (a count the work raises as it
    /// finishes each piece) unchanged, unless stopped before.
    pub fn start(timeout: Duration, progress: Arc<AtomicU64>, on_timeout: impl FnOnce() + Send + 'static) -> Self {
        let (done, wait) = mpsc::channel::<()>();
        // Looked at eight times a timeout: it fires within 9/8 of one after the last progress.
        let poll = (timeout / 8).max(Duration::from_millis(1));
        let thread = std::thread::spawn(move || {
            let (mut seen, mut since) = (progress.load(Ordering::Relaxed), Instant::now());
            loop {
                match wait.recv_timeout(poll) {
                    Err(mpsc::RecvTimeoutError::Timeout) => {
                        let now = progress.load(Ordering::Relaxed);
                        if now != seen {
                            (seen, since) = (now, Instant::now());
                        } else if since.elapsed() >= timeout {
                            on_timeout();
                            return true;
                        }
                    }
                    // Stopped (sent, or the sender dropped).
                    _ => return false,
                }
            }
        });
        Watchdog { done: Some(done), thread: Some(thread) }
    }

    /// Stops watching; whether the timeout had passed (and `on_timeout` ran).
    pub fn stop(mut self) -> bool {
        self.finish()
    }

    fn finish(&mut self) -> bool {
        if let Some(done) = self.done.take() {
            let _ = done.send(());
        }
        self.thread.take().is_some_and(|t| t.join().unwrap_or(true))
    }
}

impl Drop for Watchdog {
    fn drop(&mut self) {
        self.finish();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicBool;

    #[test]
    fn fires_after_the_timeout_and_not_when_stopped_before() {
        let (fired, progress) = (Arc::new(AtomicBool::new(false)), Arc::new(AtomicU64::new(0)));
        let f = fired.clone();
        let dog = Watchdog::start(Duration::from_secs(60), progress.clone(), move || f.store(true, Ordering::SeqCst));
        assert!(!dog.stop() && !fired.load(Ordering::SeqCst), "stopped in time");
        let f = fired.clone();
        let dog = Watchdog::start(Duration::from_millis(10), progress, move || f.store(true, Ordering::SeqCst));
        std::thread::sleep(Duration::from_millis(200));
        assert!(fired.load(Ordering::SeqCst), "fired while the work still ran");
        assert!(dog.stop());
    }

    /// Work that keeps finishing pieces runs past the timeout unharmed; once it stalls, the
    /// timeout runs from its last piece.
    #[test]
    fn work_that_makes_progress_outlasts_the_timeout() {
        let (fired, progress) = (Arc::new(AtomicBool::new(false)), Arc::new(AtomicU64::new(0)));
        let f = fired.clone();
        let timeout = Duration::from_millis(100);
        let dog = Watchdog::start(timeout, progress.clone(), move || f.store(true, Ordering::SeqCst));
        // Ten timeouts' worth of work, a piece every fifth of one.
        for _ in 0..50 {
            std::thread::sleep(timeout / 5);
            progress.fetch_add(1, Ordering::Relaxed);
        }
        assert!(!fired.load(Ordering::SeqCst), "fired on work that was making progress");
        std::thread::sleep(timeout * 3);
        assert!(fired.load(Ordering::SeqCst), "did not fire once the work stalled");
        assert!(dog.stop());
    }
}
