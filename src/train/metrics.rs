//! Classification metrics from a confusion matrix: accuracy, per-class precision, recall and
//! F1, and their macro average. A language model is scored by its loss and perplexity instead
//! (`EvalMetrics`); these are what fits a classifier.

use serde::Serialize;

/// Index of the largest value (the first of equal ones; 0 for an empty row).
pub fn argmax(row: &[f32]) -> usize {
    row.iter().enumerate().fold((0, f32::NEG_INFINITY), |b, (i, &v)| if v > b.1 { (i, v) } else { b }).0
}

/// Correct argmax predictions among the rows (`classes` wide) whose target is not `ignore`.
pub fn correct(logits: &[f32], targets: &[u32], classes: usize, ignore: u32) -> usize {
    logits.chunks(classes.max(1)).zip(targets).filter(|&(row, &t)| t != ignore && argmax(row) as u32 == t).count()
}

/// Counts of (true label, predicted label) pairs.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Confusion {
    /// `counts[t][p]`: samples of class `t` predicted as `p`.
    pub counts: Vec<Vec<usize>>,
}

/// One class's scores.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct ClassScores {
    /// Of the samples predicted as this class, the fraction that are (0 when none was).
    pub precision: f64,
    /// Of the samples of this class, the fraction predicted as it (0 when there are none).
    pub recall: f64,
    /// Harmonic mean of precision and recall (0 when both are).
    pub f1: f64,
    /// Samples of this class.
    pub support: usize,
}

impl Confusion {
    /// An empty matrix over `classes` labels.
    pub fn new(classes: usize) -> Self {
        Confusion { counts: vec![vec![0; classes]; classes] }
    }

    /// Labels.
    pub fn classes(&self) -> usize {
        self.counts.len()
    }

    /// Counts one sample. Labels outside the matrix are not counted (the caller checks them).
    pub fn add(&mut self, truth: usize, predicted: usize) {
        if let Some(c) = self.counts.get_mut(truth).and_then(|row| row.get_mut(predicted)) {
            *c += 1;
        }
    }

    /// Counts every row of `logits` (`classes` wide) against its target, skipping `ignore`.
    pub fn add_logits(&mut self, logits: &[f32], targets: &[u32], ignore: u32) {
        for (row, &t) in logits.chunks(self.classes().max(1)).zip(targets) {
            if t != ignore {
                self.add(t as usize, argmax(row));
            }
        }
    }

    /// Adds another matrix of the same size.
    pub fn merge(&mut self, other: &Confusion) {
        for (a, b) in self.counts.iter_mut().zip(&other.counts) {
            for (x, y) in a.iter_mut().zip(b) {
                *x += y;
            }
        }
    }

    /// Samples counted.
    pub fn total(&self) -> usize {
        self.counts.iter().flatten().sum()
    }

    /// Fraction on the diagonal (0 when empty).
    pub fn accuracy(&self) -> f64 {
        let right: usize = (0..self.classes()).map(|i| self.counts[i][i]).sum();
        ratio(right, self.total())
    }

    /// Precision, recall, F1 and support of each class.
    pub fn per_class(&self) -> Vec<ClassScores> {
        (0..self.classes())
            .map(|c| {
                let right = self.counts[c][c];
                let support: usize = self.counts[c].iter().sum();
                let predicted: usize = self.counts.iter().map(|row| row[c]).sum();
                let (precision, recall) = (ratio(right, predicted), ratio(right, support));
                let f1 = if precision + recall > 0.0 { 2.0 * precision * recall / (precision + recall) } else { 0.0 };
                ClassScores { precision, recall, f1, support }
            })
            .collect()
    }

    /// The unweighted mean of the F1 of the classes that occur, as truth or as prediction
    /// (every such class counts the same, however rare; scikit-learn's default label set).
    pub fn macro_f1(&self) -> f64 {
        let occurs =
            |c: usize| self.counts[c].iter().sum::<usize>() + self.counts.iter().map(|r| r[c]).sum::<usize>() > 0;
        let f1: Vec<f64> = self.per_class().iter().enumerate().filter(|&(c, _)| occurs(c)).map(|(_, s)| s.f1).collect();
        f1.iter().sum::<f64>() / f1.len().max(1) as f64
    }
}

impl Confusion {
    /// Per-class precision, recall, F1 and support, then the matrix (rows: true class,
    /// columns: predicted), as markdown tables with the classes' `names`.
    pub fn report(&self, names: &[String]) -> String {
        // (A `|` in a class's name would open a column of its own: escaped, as markdown reads it.)
        let name = |i: usize| names.get(i).map_or_else(|| i.to_string(), |n| n.replace('|', "\\|"));
        let mut out = String::from("| class | precision | recall | F1 | support |\n|---|---|---|---|---|\n");
        for (i, s) in self.per_class().iter().enumerate() {
            out += &format!("| {} | {:.4} | {:.4} | {:.4} | {} |\n", name(i), s.precision, s.recall, s.f1, s.support);
        }
        out += &format!("| macro average | | | {:.4} | {} |\n\n", self.macro_f1(), self.total());
        out += "| true \\ predicted |";
        for i in 0..self.classes() {
            out += &format!(" {} |", name(i));
        }
        out += &format!("\n|---|{}\n", "---|".repeat(self.classes()));
        for (i, row) in self.counts.iter().enumerate() {
            out += &format!("| {} |", name(i));
            for c in row {
                out += &format!(" {c} |");
            }
            out += "\n";
        }
        out
    }
}

fn ratio(a: usize, b: usize) -> f64 {
    if b == 0 { 0.0 } else { a as f64 / b as f64 }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A 3-class case worked by hand: truth 0,0,0,1,1,2 predicted 0,0,1,1,2,2.
    #[test]
    fn scores_match_a_case_worked_by_hand() {
        let mut m = Confusion::new(3);
        for (t, p) in [(0, 0), (0, 0), (0, 1), (1, 1), (1, 2), (2, 2)] {
            m.add(t, p);
        }
        assert_eq!(m.counts, vec![vec![2, 1, 0], vec![0, 1, 1], vec![0, 0, 1]]);
        assert_eq!(m.accuracy(), 4.0 / 6.0);
        let s = m.per_class();
        // Class 0: precision 2/2, recall 2/3; class 1: 1/2, 1/2; class 2: 1/2, 1/1.
        let f1 = |p: f64, r: f64| 2.0 * p * r / (p + r);
        let want = [(1.0, 2.0 / 3.0, 3), (0.5, 0.5, 2), (0.5, 1.0, 1)];
        for (c, (p, r, n)) in want.into_iter().enumerate() {
            assert_eq!((s[c].precision, s[c].recall, s[c].support), (p, r, n), "class {c}");
            assert!((s[c].f1 - f1(p, r)).abs() < 1e-15);
        }
        assert!((m.macro_f1() - (f1(1.0, 2.0 / 3.0) + 0.5 + f1(0.5, 1.0)) / 3.0).abs() < 1e-15);
    }

    #[test]
    fn logits_are_counted_by_argmax_and_ignored_targets_skipped() {
        let mut m = Confusion::new(2);
        m.add_logits(&[0.1, 0.9, 2.0, -1.0, 0.5, 0.5], &[1, 1, 7], 7);
        assert_eq!(m.counts, vec![vec![0, 0], vec![1, 1]]);
        let mut other = Confusion::new(2);
        other.add(0, 0);
        m.merge(&other);
        assert_eq!(m.total(), 3);
        let report = m.report(&["no".into(), "yes".into()]);
        assert!(report.contains("| yes | 1.0000 | 0.5000 | 0.6667 | 2 |"), "{report}");
        assert!(report.contains("| no | 1 | 0 |") && report.contains("| yes | 1 | 1 |"), "{report}");
        // A `|` in a class's name stays in its cell: every row has the header's columns.
        let piped = m.report(&["a|b".into(), "yes".into()]);
        assert!(piped.contains("| a\\|b | 1 | 0 |"), "{piped}");
        for table in piped.split("\n\n") {
            let cells = |l: &str| l.replace("\\|", "").matches('|').count();
            let header = cells(table.lines().next().unwrap());
            assert!(table.lines().all(|l| cells(l) == header), "{table}");
        }
        // Classes that never occur do not pull the macro average down.
        let mut sparse = Confusion::new(5);
        sparse.add(1, 1);
        sparse.add(3, 3);
        assert_eq!(sparse.macro_f1(), 1.0);
        // An empty class scores 0, not NaN.
        assert_eq!(Confusion::new(2).per_class()[0].f1, 0.0);
        assert_eq!(argmax(&[1.0, 3.0, 3.0]), 1);
    }
}
