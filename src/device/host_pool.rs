//! The threads cpu devices compute on. The cpu devices of one run share one pool, because they
//! share the host's cores: a pipeline runs each device's worker on a thread of its own in the
//! pool ([`HostPool::run_each`]), and a worker that waits for a message lends its thread to
//! the other workers' ops ([`lend_thread`]). So the bubble one stage leaves is filled with
//! another stage's work, and two stages on two cores step about as fast as one device on both
//! (docs/PERF.md). A device opened on its own has a pool of its own.
//!
//! Sharing changes which thread computes a piece of an op, never the result: every op splits
//! its work the same way whichever thread takes a piece (the tests compare runs bitwise).

use crate::error::Result;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

/// A rayon pool and who is inside it.
pub struct HostPool {
    pool: rayon::ThreadPool,
    /// Whether a thread runs a whole step inside the pool ([`enter`](Self::enter) or
    /// [`run_each`](Self::run_each)).
    entered: AtomicBool,
    /// More threads than the machine has cores.
    oversubscribed: bool,
    /// Whether several devices compute on it ([`shared`](Self::shared)).
    shared: bool,
}

impl HostPool {
    /// A pool of `threads` threads (at least one), named `{name}-worker{i}`, for one device.
    pub(crate) fn new(name: &str, threads: usize) -> Result<Arc<Self>> {
        Self::build(name, threads, false)
    }

    /// A pool of `threads` threads for several devices to share ([`crate::device::CpuDevice::sharing`]).
    pub fn shared(name: &str, threads: usize) -> Result<Arc<Self>> {
        Self::build(name, threads, true)
    }

    fn build(name: &str, threads: usize, shared: bool) -> Result<Arc<Self>> {
        let prefix = name.to_string();
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads.max(1))
            .thread_name(move |i| format!("{prefix}-worker{i}"))
            .build()
            .map_err(|e| crate::error::config_error("threads", format!("cannot start {threads} threads: {e}")))?;
        let oversubscribed =
            std::thread::available_parallelism().is_ok_and(|cores| pool.current_num_threads() > cores.get());
        Ok(Arc::new(HostPool { pool, entered: AtomicBool::new(false), oversubscribed, shared }))
    }

    /// Its thread count.
    pub fn threads(&self) -> usize {
        self.pool.current_num_threads()
    }

    /// Whether it has more threads than the machine has cores. Its waiting workers then sleep
    /// instead of lending their thread: a spinning one would take a core from a thread at work.
    pub fn oversubscribed(&self) -> bool {
        self.oversubscribed
    }

    /// Whether several devices compute on it.
    pub fn is_shared(&self) -> bool {
        self.shared
    }

    /// Runs one op's `f` on the pool (on the calling thread when it is one of the pool's).
    pub fn install<R: Send>(&self, f: impl FnOnce() -> R + Send) -> R {
        self.pool.install(f)
    }

    /// Runs `f`, a thread's worth of ops, inside the pool, so that each op runs on the calling
    /// thread instead of being handed to the pool and waited for. One thread at a time: a
    /// second one would queue behind the first's whole step, or be run by a pool thread that
    /// waits inside an op of the first, on top of it (a deadlock where the first waits for the
    /// second); it runs outside instead, handing each op to the pool.
    ///
    /// A shared pool runs `f` as it is: other devices' ops are queued on it too, and a pool
    /// thread waiting inside one of them could pick up this whole step and wait in it for that
    /// device. Steps there take the pool's threads by [`run_each`](Self::run_each) instead.
    pub fn enter<R: Send>(&self, f: impl FnOnce() -> R + Send) -> R {
        if self.shared {
            return f();
        }
        match self.hold() {
            Some(_held) => self.pool.install(f),
            None => f(),
        }
    }

    /// Runs `work(i)` for every `i < n` at once, each on a thread of its own in this pool, and
    /// returns the results in order; the pool's other threads take pieces of their ops. `None`,
    /// running nothing, where the pool has fewer than `n` threads or a thread is inside it.
    ///
    /// A `work` may wait for another (a pipeline's message) by blocking: a thread holds pieces
    /// of an op only while it is inside that op, so a blocked one holds nothing another needs.
    /// Waiting by [`lend_thread`] instead puts the thread to work meanwhile.
    pub fn run_each<R: Send>(&self, n: usize, work: impl Fn(usize) -> R + Sync) -> Option<Vec<R>> {
        if n > self.threads() {
            return None;
        }
        let _held = self.hold()?;
        // A broadcast runs its closure once on each thread of the pool, and only there: no
        // thread can pick up another's `work` while it waits.
        let out: Vec<Option<R>> = self.pool.broadcast(|ctx| (ctx.index() < n).then(|| work(ctx.index())));
        Some(out.into_iter().flatten().collect())
    }

    /// Marks the pool entered; `None` where a thread already is. (The guard is made only when
    /// the mark is this caller's: dropping it clears the mark.)
    fn hold(&self) -> Option<Held<'_>> {
        (!self.entered.swap(true, Ordering::Acquire)).then(|| Held(&self.entered))
    }
}

/// Lets the next thread in when the step ends, also by a panic.
struct Held<'a>(&'a AtomicBool);

impl Drop for Held<'_> {
    fn drop(&mut self) {
        self.0.store(false, Ordering::Release);
    }
}

/// Runs one pending piece of work of the pool the calling thread belongs to (a waiting worker
/// of [`HostPool::run_each`] lends itself so), or, where there is none, gives the core away
/// for a moment.
pub fn lend_thread() {
    if !matches!(rayon::yield_now(), Some(rayon::Yield::Executed)) {
        std::thread::yield_now();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rayon::prelude::*;
    use std::sync::Mutex;
    use std::sync::atomic::AtomicUsize;

    /// Each index runs once, on a thread of its own, and the results come back in order.
    #[test]
    fn run_each_gives_every_index_a_thread_of_its_own() {
        let pool = HostPool::new("t", 3).unwrap();
        let out = pool.run_each(2, |i| (i, rayon::current_thread_index())).unwrap();
        assert_eq!(out.iter().map(|(i, _)| *i).collect::<Vec<_>>(), [0, 1]);
        let threads: Vec<_> = out.iter().map(|(_, t)| t.expect("on a pool thread")).collect();
        assert_ne!(threads[0], threads[1]);
        assert!(pool.run_each(4, |i| i).is_none(), "four workers need four threads");
    }

    /// One thread at a time runs inside: of three entering at once (all inside `f` together,
    /// held there by a barrier), one runs on a pool thread and two outside, however many
    /// threads the pool has free.
    #[test]
    fn one_thread_at_a_time_enters() {
        let pool = HostPool::new("t", 3).unwrap();
        let barrier = std::sync::Barrier::new(3);
        let inside = AtomicUsize::new(0);
        std::thread::scope(|s| {
            for _ in 0..3 {
                s.spawn(|| {
                    pool.enter(|| {
                        if rayon::current_thread_index().is_some() {
                            inside.fetch_add(1, Ordering::Relaxed);
                        }
                        barrier.wait();
                    })
                });
            }
        });
        assert_eq!(inside.into_inner(), 1);
    }

    /// While a thread is inside the pool, `run_each` declines (its caller then runs the
    /// workers on threads of their own) instead of queueing behind it.
    #[test]
    fn run_each_declines_while_a_thread_is_inside() {
        let pool = HostPool::new("t", 2).unwrap();
        let inside = pool.enter(|| pool.run_each(1, |i| i));
        assert!(inside.is_none());
        assert_eq!(pool.run_each(1, |i| i + 1), Some(vec![1]), "and runs once the thread has left");
    }

    /// A worker that waits by lending its thread runs pieces of the other worker's op: the
    /// wait fills with work instead of idling. Worker 1 splits 64 pieces of 2 ms; worker 0
    /// waits for its signal. Without the lending, every piece would run on worker 1's thread.
    #[test]
    fn a_waiting_worker_runs_pieces_of_the_others_op() {
        let pool = HostPool::new("t", 2).unwrap();
        let done = AtomicBool::new(false);
        let pieces_by = Mutex::new(vec![0usize; 2]);
        pool.run_each(2, |i| {
            if i == 0 {
                while !done.load(Ordering::Acquire) {
                    lend_thread();
                }
            } else {
                (0..64).into_par_iter().with_max_len(1).for_each(|_| {
                    std::thread::sleep(std::time::Duration::from_millis(2));
                    let t = rayon::current_thread_index().unwrap_or(0);
                    pieces_by.lock().unwrap()[t] += 1;
                });
                done.store(true, Ordering::Release);
            }
        })
        .unwrap();
        let by = pieces_by.into_inner().unwrap();
        assert_eq!(by.iter().sum::<usize>(), 64);
        assert!(by.iter().all(|&n| n > 0), "pieces per thread {by:?}: the waiting thread helped");
    }
}
