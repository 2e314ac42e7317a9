//! Observability: when each action of a step started and ended on each device, the measured
//! bubble next to the formula's, and the Chrome trace format (JSON; opens in Perfetto and
//! chrome://tracing) with one row per device.

use super::schedule::Action;
use serde::Serialize;
use std::path::Path;

/// One timed action.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct Span {
    /// The action.
    pub action: Action,
    /// Seconds from the start of the step.
    pub start: f64,
    /// Seconds from the start of the step.
    pub end: f64,
}

/// Every device's spans in one step.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct StepTrace {
    /// `per_device[g]`: global device `g`'s spans, in order.
    pub per_device: Vec<Vec<Span>>,
    /// Seconds from the first action's start to the last action's end.
    pub makespan: f64,
}

impl StepTrace {
    /// When the pipelined part of the step ended: the last forward, backward or transfer on
    /// any device. After it come the step's tail (gradient norms, tied gradients, the
    /// optimizers with clipping's coefficient).
    pub fn pipeline_end(&self) -> f64 {
        self.per_device
            .iter()
            .flatten()
            .filter(|s| !matches!(s.action, Action::OptimizerStep))
            .map(|s| s.end)
            .fold(0.0, f64::max)
    }

    /// The measured bubble, the one quantity every report uses: the fraction of the pipelined
    /// part of the step (up to [`pipeline_end`](Self::pipeline_end)) that the devices spent not
    /// computing a forward, a backward or put-off weight gradients, averaged over devices. Comparable with
    /// [`Schedule::bubble_formula`](super::Schedule::bubble_formula), which counts transfers as
    /// idle too and knows nothing of the tail ([`tail`](Self::tail), reported beside it).
    /// Devices without spans ran in another process (a pipeline across processes, where each
    /// process times its own) and are left out.
    pub fn bubble(&self) -> f64 {
        let end = self.pipeline_end();
        let timed = self.per_device.iter().filter(|spans| !spans.is_empty()).count();
        if end <= 0.0 || timed == 0 {
            return 0.0;
        }
        let busy: f64 =
            self.per_device.iter().flatten().filter(|s| s.action.is_compute()).map(|s| s.end - s.start).sum();
        1.0 - busy / (end * timed as f64)
    }

    /// Seconds of the step after its pipelined part: gradient norms, tied gradients and the
    /// optimizers, which every schedule pays alike.
    pub fn tail(&self) -> f64 {
        (self.makespan - self.pipeline_end()).max(0.0)
    }

    /// Mean seconds per action that is not compute (sends, receives, all-reduce starts): the
    /// runtime's own overhead per action when transfers are cheap.
    pub fn mean_overhead(&self) -> f64 {
        let spans: Vec<f64> = self
            .per_device
            .iter()
            .flatten()
            .filter(|s| {
                matches!(s.action, Action::SendActivation { .. } | Action::SendGrad { .. } | Action::AllReduce { .. })
            })
            .map(|s| s.end - s.start)
            .collect();
        if spans.is_empty() { 0.0 } else { spans.iter().sum::<f64>() / spans.len() as f64 }
    }

    /// The trace as Chrome trace events (complete events, microseconds), with `offset` seconds
    /// added (to place several steps on one time line).
    pub fn chrome_events(&self, offset: f64, step: u64) -> Vec<serde_json::Value> {
        let mut events = Vec::new();
        for (g, spans) in self.per_device.iter().enumerate() {
            for s in spans {
                let (name, cat) = label(&s.action);
                events.push(serde_json::json!({
                    "name": name, "cat": cat, "ph": "X", "pid": 0, "tid": g,
                    "ts": (offset + s.start) * 1e6, "dur": (s.end - s.start) * 1e6,
                    "args": { "step": step, "action": s.action },
                }));
            }
        }
        events
    }
}

fn label(a: &Action) -> (String, &'static str) {
    match *a {
        Action::Forward { piece, stage } => (format!("F mb{piece} s{stage}"), "forward"),
        Action::Backward { piece, stage } => (format!("B mb{piece} s{stage}"), "backward"),
        Action::BackwardWeights { piece, stage } => (format!("W mb{piece} s{stage}"), "backward"),
        Action::SendActivation { piece, stage, to } => (format!("send act mb{piece} s{stage}→dev{to}"), "comm"),
        Action::RecvActivation { piece, stage, from } => (format!("recv act mb{piece} s{stage}←dev{from}"), "comm"),
        Action::SendGrad { piece, stage, to } => (format!("send grad mb{piece} s{stage}→dev{to}"), "comm"),
        Action::RecvGrad { piece, stage, from } => (format!("recv grad mb{piece} s{stage}←dev{from}"), "comm"),
        Action::AllReduce { stage } => (format!("all-reduce s{stage}"), "comm"),
        Action::OptimizerStep => ("optimizer".into(), "optimizer"),
    }
}

/// Collects steps into one Chrome trace file.
#[derive(Default)]
pub struct ChromeTrace {
    events: Vec<serde_json::Value>,
    clock: f64,
    devices: usize,
}

impl ChromeTrace {
    /// Appends a step after the previous ones.
    pub fn push(&mut self, step: u64, trace: &StepTrace) {
        self.events.extend(trace.chrome_events(self.clock, step));
        self.clock += trace.makespan;
        self.devices = self.devices.max(trace.per_device.len());
    }

    /// Appends a span on a row of its own (`elastic`) for something between steps that took
    /// `seconds`: an elastic transition, named by what it changed.
    pub fn push_between(&mut self, name: &str, seconds: f64, args: serde_json::Value) {
        self.events.push(serde_json::json!({
            "name": name, "cat": "transition", "ph": "X", "pid": 0, "tid": "elastic",
            "ts": self.clock * 1e6, "dur": seconds * 1e6, "args": args,
        }));
        self.clock += seconds;
    }

    /// Writes the trace (atomically) as `{"traceEvents": [...]}`, rows named `device N`.
    pub fn write(&self, path: &Path) -> crate::error::Result<()> {
        let mut events: Vec<serde_json::Value> = (0..self.devices)
            .map(|g| serde_json::json!({"name": "thread_name", "ph": "M", "pid": 0, "tid": g, "args": {"name": format!("device {g}")}}))
            .collect();
        events.extend(self.events.iter().cloned());
        let doc = serde_json::json!({ "traceEvents": events, "displayTimeUnit": "ms" });
        crate::files::write_atomic(path, |w| serde_json::to_writer(w, &doc).map_err(std::io::Error::other))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bubble_counts_idle_time_over_all_devices() {
        let f = |start, end| Span {
            action: Action::Forward { piece: crate::pipeline::Piece::whole(0), stage: 0 },
            start,
            end,
        };
        let t = StepTrace { per_device: vec![vec![f(0.0, 1.0)], vec![f(1.0, 2.0)]], makespan: 2.0 };
        assert!((t.bubble() - 0.5).abs() < 1e-12);
        // An optimizer span after the pipelined part is the tail, not bubble.
        let mut with_tail = t.clone();
        let end = with_tail.pipeline_end();
        for spans in &mut with_tail.per_device {
            spans.push(Span { action: Action::OptimizerStep, start: end, end: end + 1.0 });
        }
        with_tail.makespan = end + 1.0;
        assert_eq!(with_tail.bubble(), t.bubble());
        assert!((with_tail.tail() - 1.0).abs() < 1e-12 && t.tail() == 0.0);
        // A device another process ran (no spans here) is not idle time of this one's.
        let here = StepTrace { per_device: vec![vec![f(0.0, 1.0), f(1.5, 2.0)], vec![]], makespan: 2.0 };
        assert!((here.bubble() - 0.25).abs() < 1e-12, "{}", here.bubble());
        let json = t.chrome_events(0.0, 3);
        assert_eq!(json.len(), 2);
        assert_eq!(json[1]["tid"], 1);
        assert_eq!(json[1]["ts"], 1e6);
    }
}
