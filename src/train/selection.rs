//! Model selection by evaluation: which of a run's evaluations scored best on the metric the
//! run keeps its best weights by (`train.keep_best`), and early stopping once
//! `train.early_stopping_patience` evaluations in a row have not beaten that best by more than
//! `train.early_stopping_min_delta`. The state is a few numbers, saved in every checkpoint, so
//! a resumed run compares against the best of the evaluations before it.

use super::event::EvalMetrics;
use serde::{Deserialize, Serialize};

/// The metric a run keeps its best weights by.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum KeepBest {
    /// No selection: the run keeps its last weights alone.
    #[default]
    Off,
    /// The evaluation's mean loss, lower is better (a language model's perplexity follows it).
    Loss,
    /// The fraction of correct predictions, higher is better.
    Accuracy,
    /// A classifier's unweighted mean of its classes' F1, higher is better.
    MacroF1,
}

impl KeepBest {
    /// The name a config file and the logs give it.
    pub fn name(self) -> &'static str {
        match self {
            KeepBest::Off => "off",
            KeepBest::Loss => "loss",
            KeepBest::Accuracy => "accuracy",
            KeepBest::MacroF1 => "macro_f1",
        }
    }

    /// The evaluation's score on this metric (`None` where it is off, or the evaluation lacks
    /// the metric: a language model's macro F1).
    pub fn score(self, eval: &EvalMetrics) -> Option<f64> {
        match self {
            KeepBest::Off => None,
            KeepBest::Loss => Some(eval.loss),
            KeepBest::Accuracy => Some(eval.accuracy),
            KeepBest::MacroF1 => eval.macro_f1,
        }
    }

    /// A score as the logs show it: `83.12%` of accuracy, `0.4312` of loss or macro F1.
    pub fn show(self, value: f64) -> String {
        match self {
            KeepBest::Accuracy => format!("{:.2}%", 100.0 * value),
            _ => format!("{value:.4}"),
        }
    }

    /// How much `score` beats `best` by (positive: better), whichever way the metric points.
    fn gain(self, score: f64, best: f64) -> f64 {
        match self {
            KeepBest::Loss => best - score,
            _ => score - best,
        }
    }
}

/// The best evaluation so far: when it was and what it scored.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct Scored {
    /// Optimizer steps taken when it was evaluated.
    pub step: u64,
    /// The metric.
    pub metric: KeepBest,
    /// Its score on the metric.
    pub value: f64,
}

/// What one evaluation means for the selection.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Verdict {
    /// Not scored (selection off, or the metric is not the evaluation's).
    Unscored,
    /// The best so far: its weights are the ones to keep.
    Best,
    /// Not better than the best, or better by no more than the minimum improvement.
    NotBetter,
}

/// The selection's state: the best evaluation and how many have not beaten it since.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Selection {
    /// The best evaluation so far.
    pub best: Option<Scored>,
    /// Evaluations in a row since one beat the best by more than the minimum improvement.
    pub stale: u64,
}

impl Selection {
    /// Scores `eval`, taken after `step` steps, by `metric`: it is the best when it beats the
    /// best so far at all (a score that is not a number never does), and it resets the count
    /// of stale evaluations only when it beats it by more than `min_delta` (the first one
    /// scored always does).
    pub fn observe(&mut self, metric: KeepBest, min_delta: f64, step: u64, eval: &EvalMetrics) -> Verdict {
        let Some(value) = metric.score(eval) else { return Verdict::Unscored };
        let gain = match self.best {
            _ if value.is_nan() => None,
            Some(best) if best.metric == metric => Some(metric.gain(value, best.value)),
            _ => Some(f64::INFINITY),
        };
        if gain.is_some_and(|g| g > min_delta) {
            self.stale = 0;
        } else {
            self.stale += 1;
        }
        match gain {
            Some(g) if g > 0.0 => {
                self.best = Some(Scored { step, metric, value });
                Verdict::Best
            }
            _ => Verdict::NotBetter,
        }
    }

    /// Whether `patience` evaluations in a row (0: never) have passed without a better one.
    pub fn exhausted(&self, patience: u64) -> bool {
        patience > 0 && self.stale >= patience
    }

    /// The state a checkpoint recorded, for a run that keeps its best by `metric`: kept where
    /// the checkpoint's best was scored on the same metric; otherwise a fresh start (the
    /// settings that changed are named by the resume).
    pub fn restored(saved: Option<Selection>, metric: KeepBest) -> Selection {
        match saved {
            Some(s) if s.best.is_some_and(|b| b.metric == metric) => s,
            _ => Selection::default(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn eval(loss: f64, accuracy: f64, macro_f1: Option<f64>) -> EvalMetrics {
        EvalMetrics { loss, accuracy, count: 10, perplexity: None, macro_f1, confusion: None }
    }

    /// Each metric points its own way; a tie is not better; the first score is the best.
    #[test]
    fn the_best_is_the_highest_accuracy_or_the_lowest_loss() {
        let evals = [eval(0.9, 0.6, Some(0.5)), eval(0.7, 0.6, Some(0.55)), eval(0.8, 0.7, Some(0.55))];
        let verdicts = |metric: KeepBest| {
            let mut s = Selection::default();
            let v: Vec<Verdict> = evals.iter().enumerate().map(|(i, e)| s.observe(metric, 0.0, i as u64, e)).collect();
            (v, s.best.map(|b| (b.step, b.value)))
        };
        use Verdict::*;
        assert_eq!(verdicts(KeepBest::Loss), (vec![Best, Best, NotBetter], Some((1, 0.7))));
        assert_eq!(verdicts(KeepBest::Accuracy), (vec![Best, NotBetter, Best], Some((2, 0.7))));
        assert_eq!(verdicts(KeepBest::MacroF1), (vec![Best, Best, NotBetter], Some((1, 0.55))));
        assert_eq!(verdicts(KeepBest::Off), (vec![Unscored; 3], None));
        // A language model has no macro F1: nothing scored, nothing kept.
        let mut s = Selection::default();
        assert_eq!(s.observe(KeepBest::MacroF1, 0.0, 1, &eval(1.0, 0.5, None)), Unscored);
        assert_eq!(s, Selection::default());
    }

    /// A small gain keeps the better weights but does not reset the patience; a larger one does.
    #[test]
    fn patience_counts_evaluations_without_a_gain_beyond_the_minimum() {
        let mut s = Selection::default();
        let accuracies = [0.50, 0.505, 0.509, 0.52, 0.52, 0.40];
        let mut seen = Vec::new();
        for (step, a) in accuracies.into_iter().enumerate() {
            let v = s.observe(KeepBest::Accuracy, 0.01, step as u64, &eval(1.0, a, None));
            seen.push((v, s.stale, s.exhausted(2), s.exhausted(0)));
        }
        use Verdict::*;
        assert_eq!(
            seen,
            vec![
                (Best, 0, false, false),
                (Best, 1, false, false),
                (Best, 2, true, false),
                // 0.52 beats the best (0.509) by 0.011 > 0.01: patience restarts.
                (Best, 0, false, false),
                (NotBetter, 1, false, false),
                (NotBetter, 2, true, false),
            ]
        );
        assert_eq!(s.best, Some(Scored { step: 3, metric: KeepBest::Accuracy, value: 0.52 }));
    }

    /// A loss that is not a number is never the best and counts against the patience.
    #[test]
    fn a_score_that_is_not_a_number_is_never_the_best() {
        let mut s = Selection::default();
        assert_eq!(s.observe(KeepBest::Loss, 0.0, 1, &eval(f64::NAN, 0.5, None)), Verdict::NotBetter);
        assert_eq!((s.best, s.stale), (None, 1));
        assert_eq!(s.observe(KeepBest::Loss, 0.0, 2, &eval(2.0, 0.5, None)), Verdict::Best);
        assert_eq!(s.observe(KeepBest::Loss, 0.0, 3, &eval(f64::NAN, 0.5, None)), Verdict::NotBetter);
        assert_eq!((s.best.map(|b| b.step), s.stale), (Some(2), 1));
    }

    /// A checkpoint's state carries over for the same metric only.
    #[test]
    fn a_resume_keeps_the_best_of_the_same_metric() {
        let mut s = Selection::default();
        s.observe(KeepBest::Accuracy, 0.0, 5, &eval(1.0, 0.8, None));
        s.observe(KeepBest::Accuracy, 0.0, 6, &eval(1.0, 0.7, None));
        assert_eq!(Selection::restored(Some(s.clone()), KeepBest::Accuracy), s);
        assert_eq!(Selection::restored(Some(s), KeepBest::Loss), Selection::default());
        assert_eq!(Selection::restored(None, KeepBest::Loss), Selection::default());
    }
}
