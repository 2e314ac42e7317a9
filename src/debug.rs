//! Debug output by environment variable level, as tinygrad does: `PT_DEBUG=1` prints where each
//! training step's time goes (batch, cache, pipeline, bookkeeping) to stderr; `PT_DEBUG=2` also
//! times every op a cpu device runs ([`timed`]) and prints the totals per op at each evaluation
//! (the steps since the last one, then the evaluation) and after each `bench-step` precision; 0
//! or unset prints nothing and times nothing.

use std::collections::BTreeMap;
use std::sync::{Mutex, OnceLock};
use std::time::Instant;

/// The level `PT_DEBUG` asks for (0 when unset or empty; a value that is not a level is
/// ignored, with a warning the first time it is read).
pub fn level() -> u8 {
    static LEVEL: OnceLock<u8> = OnceLock::new();
    *LEVEL.get_or_init(|| {
        let value = std::env::var("PT_DEBUG").unwrap_or_default();
        value.trim().parse().unwrap_or_else(|_| {
            if !value.is_empty() {
                eprintln!("warning: PT_DEBUG={value} ignored; expected a level, 0, 1 or 2");
            }
            0
        })
    })
}

/// Calls and seconds per op name, summed over every device and thread of the process.
static OP_TIMES: Mutex<BTreeMap<&'static str, (u64, f64)>> = Mutex::new(BTreeMap::new());

/// Runs `f`, adding its wall time to `op`'s total at level 2 and above. Devices running at once
/// each add their own time, so the totals are device-seconds, not the run's clock.
pub fn timed<R>(op: &'static str, f: impl FnOnce() -> R) -> R {
    if level() < 2 {
        return f();
    }
    let start = Instant::now();
    let out = f();
    let seconds = start.elapsed().as_secs_f64();
    let mut times = OP_TIMES.lock().unwrap_or_else(|e| e.into_inner());
    let entry = times.entry(op).or_default();
    *entry = (entry.0 + 1, entry.1 + seconds);
    out
}

/// The totals since the last call, most time first, and starts counting afresh.
pub fn take_op_times() -> Vec<(&'static str, u64, f64)> {
    let taken = std::mem::take(&mut *OP_TIMES.lock().unwrap_or_else(|e| e.into_inner()));
    let mut rows: Vec<_> = taken.into_iter().map(|(op, (calls, seconds))| (op, calls, seconds)).collect();
    rows.sort_by(|a, b| b.2.total_cmp(&a.2).then(a.0.cmp(b.0)));
    rows
}

/// Prints [`take_op_times`] under `title` to stderr at level 2 and above, per op: calls,
/// device-seconds, milliseconds per call and share of the total.
pub fn print_op_times(title: &str) {
    if level() < 2 {
        return;
    }
    let rows = take_op_times();
    let total: f64 = rows.iter().map(|r| r.2).sum();
    eprintln!("op times, {title} (device-seconds, summed over devices):");
    for (op, calls, seconds) in rows {
        let share = if total > 0.0 { 100.0 * seconds / total } else { 0.0 };
        eprintln!(
            "  {op:<32} {calls:>8} calls {seconds:>9.3} s {:>9.3} ms/call {share:>5.1} %",
            1e3 * seconds / calls.max(1) as f64
        );
    }
    eprintln!("  {:<32} {:>14} {total:>9.3} s", "total", "");
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The table sums calls and seconds per op, sorts by time, and empties when taken.
    #[test]
    fn op_times_add_up_per_op_and_start_afresh() {
        // The level is read once per process: the table is driven directly here.
        take_op_times();
        for (op, s) in [("a", 0.5), ("b", 2.0), ("a", 1.0)] {
            let mut times = OP_TIMES.lock().unwrap();
            let e = times.entry(op).or_default();
            *e = (e.0 + 1, e.1 + s);
        }
        assert_eq!(take_op_times(), vec![("b", 1, 2.0), ("a", 2, 1.5)]);
        assert!(take_op_times().is_empty());
    }
}
