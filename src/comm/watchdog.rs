//! A watchdog for collectives that can wait forever: NCCL's wait on the GPU for a peer that is
//! gone, with no timeout of its own. While a step's collectives run, a thread waits for the
//! step to say it is done; if the group's timeout passes first, it runs the given way out
//! (abort the communicators, hang up the process group), so the waits end in errors instead of
//! a hang — what PyTorch's NCCL watchdog does with `ncclCommAbort`.

use std::sync::mpsc;
use std::thread::JoinHandle;
use std::time::Duration;

/// Watches one stretch of work; [`stop`](Self::stop) it when the work is done.
pub struct Watchdog {
    done: Option<mpsc::Sender<()>>,
    thread: Option<JoinHandle<bool>>,
}

impl Watchdog {
    /// Runs `on_timeout` once `timeout` passes, unless stopped before.
    pub fn start(timeout: Duration, on_timeout: impl FnOnce() + Send + 'static) -> Self {
        let (done, wait) = mpsc::channel::<()>();
        let thread = std::thread::spawn(move || match wait.recv_timeout(timeout) {
            Err(mpsc::RecvTimeoutError::Timeout) => {
                on_timeout();
                true
            }
            // Stopped (sent, or the sender dropped).
            _ => false,
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
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};

    #[test]
    fn fires_after_the_timeout_and_not_when_stopped_before() {
        let fired = Arc::new(AtomicBool::new(false));
        let f = fired.clone();
        let dog = Watchdog::start(Duration::from_secs(60), move || f.store(true, Ordering::SeqCst));
        assert!(!dog.stop() && !fired.load(Ordering::SeqCst), "stopped in time");
        let f = fired.clone();
        let dog = Watchdog::start(Duration::from_millis(10), move || f.store(true, Ordering::SeqCst));
        std::thread::sleep(Duration::from_millis(200));
        assert!(fired.load(Ordering::SeqCst), "fired while the work still ran");
        assert!(dog.stop());
    }
}
