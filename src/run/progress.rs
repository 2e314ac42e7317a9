//! A run's console lines. Steps, for output that is not a terminal (a CI log, `nohup`, a file):
//! one line every `every` seconds with the step, epoch, loss, learning rate, throughput and the
//! time left, so a reader can tell the run is alive (on a terminal the binary shows a bar
//! instead). Every other event (evaluations, transitions, the cache's epochs): one line each,
//! on a terminal or not.

use crate::train::Event;
use std::time::Duration;

/// Decides when to print a progress line and writes it. Time is passed in (seconds since the
/// run started in this process), so the schedule is testable without waiting.
#[derive(Clone, Debug)]
pub struct ProgressLines {
    every: f64,
    total_steps: u64,
    first_step: Option<(u64, f64)>,
    last_print: f64,
    samples: usize,
}

impl ProgressLines {
    /// Lines every `every` seconds (0: every step) of a run of `total_steps` steps.
    pub fn new(every: f64, total_steps: u64) -> Self {
        ProgressLines { every: every.max(0.0), total_steps, first_step: None, last_print: 0.0, samples: 0 }
    }

    /// A step finished at `now` seconds, `(steps, source batches)` taken so far: the line to
    /// print, if one is due. The run's length counts source batches, which are the steps
    /// unless AutoDP's `scale-lr` takes several a step; then both are shown.
    pub fn step(
        &mut self,
        now: f64,
        (step, batches): (u64, u64),
        epoch: u64,
        loss: f64,
        lr: f64,
        samples: usize,
    ) -> Option<String> {
        self.samples += samples;
        // Rates count from the first step this process saw (a resumed run's earlier steps took
        // no time here); the work left is counted in batches.
        let (batches0, t0) = *self.first_step.get_or_insert((batches.saturating_sub(1), 0.0));
        if now - self.last_print < self.every && batches < self.total_steps {
            return None;
        }
        self.last_print = now;
        let elapsed = (now - t0).max(1e-9);
        let rate = self.samples as f64 / elapsed;
        let done = batches.saturating_sub(batches0);
        let left = self.total_steps.saturating_sub(batches);
        let eta = if done == 0 { "?".into() } else { clock(elapsed / done as f64 * left as f64) };
        let percent = 100.0 * batches as f64 / self.total_steps.max(1) as f64;
        let at = if batches == step {
            format!("step {step}/{}", self.total_steps)
        } else {
            format!("step {step}, batch {batches}/{}", self.total_steps)
        };
        Some(format!(
            "{at} ({percent:.0}%), epoch {epoch}: loss {loss:.4}, lr {lr:.2e}, {rate:.1} samples/s, elapsed {}, ETA {eta}",
            clock(now)
        ))
    }
}

/// The console's line for a run's event other than a step (steps go to the bar or to
/// [`ProgressLines`]): an epoch's or a mid-epoch evaluation, a new best one, an early stop, a
/// transition, the cache's epoch.
pub fn event_line(event: &Event) -> Option<String> {
    match event {
        Event::Epoch { epoch, eval, .. } => Some(format!("epoch {epoch}: eval {eval}")),
        Event::Eval { step, epoch, eval, .. } => Some(format!("step {step} (epoch {epoch}): eval {eval}")),
        Event::Best { step, metric, value, .. } => {
            Some(format!("step {step}: best {} so far, {}: kept in best/", metric.name(), metric.show(*value)))
        }
        Event::EarlyStop { step, evaluations, best } => Some(format!(
            "early stop at step {step}: {evaluations} evaluations without a better {} than {} (step {}) \
             (train.early_stopping_patience)",
            best.metric.name(),
            best.metric.show(best.value),
            best.step
        )),
        Event::Transition(t) => Some(t.to_string()),
        Event::Cache { epoch, hits, misses, entries, memory_bytes, disk_bytes } => Some(format!(
            "epoch {epoch}: cache {hits} hits / {misses} misses, {entries} samples, {} in memory, {} on disk",
            crate::bytes::display(*memory_bytes, 1),
            crate::bytes::display(*disk_bytes, 1)
        )),
        Event::Start { .. } | Event::Step { .. } => None,
    }
}

/// `h:mm:ss`.
fn clock(seconds: f64) -> String {
    // A run that never ends on its own (`epochs` near u64::MAX) has an ETA past any Duration.
    let s = Duration::try_from_secs_f64(seconds.max(0.0)).unwrap_or(Duration::MAX).as_secs();
    format!("{}:{:02}:{:02}", s / 3600, s / 60 % 60, s % 60)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_come_every_interval_and_at_the_end_with_rate_and_eta() {
        let mut p = ProgressLines::new(10.0, 100);
        // Steps of 2 s and 8 samples: the first line at 10 s (step 5), the next at 20 s.
        let lines: Vec<(u64, String)> = (1..=100)
            .filter_map(|step| p.step(2.0 * step as f64, (step, step), step / 50, 0.5, 1e-3, 8).map(|l| (step, l)))
            .collect();
        let steps: Vec<u64> = lines.iter().map(|l| l.0).collect();
        assert_eq!(steps[..3], [5, 10, 15]);
        assert_eq!(*steps.last().unwrap_or(&0), 100, "the last step always prints");
        assert_eq!(steps.len(), 20);
        // At step 5 (10 s): 40 samples in 10 s, 95 steps left at 2 s each.
        let first = &lines[0].1;
        assert!(first.starts_with("step 5/100 (5%), epoch 0: loss 0.5000, lr 1.00e-3"), "{first}");
        assert!(first.contains("4.0 samples/s") && first.contains("elapsed 0:00:10, ETA 0:03:10"), "{first}");
        // Every step when the interval is 0.
        let mut every = ProgressLines::new(0.0, 3);
        assert!((1..=3).all(|s| every.step(s as f64, (s, s), 0, 1.0, 1.0, 1).is_some()));
    }

    #[test]
    fn a_resumed_run_counts_its_rate_from_its_first_step_here() {
        let mut p = ProgressLines::new(5.0, 1000);
        assert!(p.step(1.0, (901, 901), 9, 0.1, 1e-4, 4).is_none());
        let line = p.step(5.0, (905, 905), 9, 0.1, 1e-4, 4).unwrap_or_default();
        // 5 steps (900 → 905) in 5 s, 95 left; 8 samples in 5 s.
        assert!(line.contains("ETA 0:01:35") && line.contains("1.6 samples/s"), "{line}");
    }

    /// Under AutoDP's `scale-lr` a step takes two batches: the run's length, its percentage
    /// and its time left count batches, and the line names both.
    #[test]
    fn steps_of_several_batches_count_the_run_in_batches() {
        let mut p = ProgressLines::new(0.0, 100);
        assert!(p.step(1.0, (1, 1), 0, 0.5, 1e-3, 8).is_some());
        // Step 10 after 19 batches at 10 s (counted from the first step's start): 81 left.
        let line = p.step(10.0, (10, 19), 0, 0.5, 1e-3, 16).unwrap_or_default();
        assert!(line.starts_with("step 10, batch 19/100 (19%)") && line.contains("ETA 0:00:42"), "{line}");
        // The last batch always prints.
        let mut p = ProgressLines::new(1e9, 100);
        assert!(p.step(1.0, (49, 98), 0, 0.5, 1e-3, 8).is_none());
        assert!(p.step(2.0, (50, 100), 0, 0.5, 1e-3, 8).is_some());
    }

    /// Each event other than a step has its line; a step and a start have none (the bar and
    /// [`ProgressLines`] show steps).
    #[test]
    fn events_read_as_the_console_prints_them() {
        use crate::train::{EvalMetrics, Transition};
        let eval =
            EvalMetrics { loss: 0.25, accuracy: 0.8125, count: 16, perplexity: None, macro_f1: None, confusion: None };
        let line = |e: Event| event_line(&e).unwrap_or_default();
        assert_eq!(
            line(Event::Epoch { epoch: 1, eval: eval.clone(), samples: 8, train_seconds: 1.0, eval_seconds: 0.5 }),
            "epoch 1: eval loss 0.2500, accuracy 81.25%"
        );
        assert_eq!(
            line(Event::Eval { step: 40, epoch: 0, eval, eval_seconds: 0.5 }),
            "step 40 (epoch 0): eval loss 0.2500, accuracy 81.25%"
        );
        let t = Transition {
            step: 268,
            epoch: 0,
            reason: "eq1".into(),
            frozen_layers: (0, 2),
            frozen_units: 5,
            pipeline_len: (2, 1),
            replicas: (1, 2),
            micro_batches: (8, 4),
            stages_before: vec![0..7, 7..14],
            stages: vec![5..9, 9..14],
            batches_per_step: 1,
            cache: true,
            seconds: 0.0484,
        };
        assert_eq!(
            line(Event::Transition(t.clone())),
            "transition at step 268: 0 → 2 frozen layers, K 2 → 1, R 1 → 2, M 8 → 4, stages [0..7, 7..14] → [5..9, 9..14], cache on, 48 ms (eq1)"
        );
        let kept = Transition { stages_before: t.stages.clone(), ..t };
        assert!(line(Event::Transition(kept)).contains(", stages [5..9, 9..14], cache on"));
        let cache = Event::Cache { epoch: 1, hits: 30, misses: 2, entries: 32, memory_bytes: 3 << 19, disk_bytes: 0 };
        assert_eq!(line(cache), "epoch 1: cache 30 hits / 2 misses, 32 samples, 1.5 MiB in memory, 0 B on disk");
        assert_eq!(
            event_line(&Event::Start { resumed: false, step: 0, devices: vec![], plan: Default::default() }),
            None
        );
    }

    #[test]
    fn a_run_that_never_ends_prints_an_eta_instead_of_panicking() {
        let mut p = ProgressLines::new(0.0, u64::MAX);
        let line = p.step(2.0, (1, 1), 0, 0.1, 1e-4, 4).unwrap_or_default();
        assert!(line.contains(&format!("ETA {}:", u64::MAX / 3600)), "{line}");
    }
}
