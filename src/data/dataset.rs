//! `Dataset<S>`: labelled samples with stable ids and class names, and the seeded stratified
//! train/test split.

use std::collections::HashSet;

use crate::error::{Result, config_error, data_error};
use crate::rng::Rng;

/// Ids of samples from a dataset's separate test file start here (train-file samples use their
/// row index), so that ids stay unique across the two splits of one dataset: the
/// frozen-activation cache keys on them.
pub const TEST_FILE_ID_BASE: u64 = 1 << 32;

/// What every sample carries.
pub trait Sample {
    /// Stable id, fixed across runs (derived from the sample's place in its source file).
    fn id(&self) -> u64;
    /// Class index, `< num_classes`.
    fn label(&self) -> u32;
}

/// A labelled dataset: samples in source-file order, each with a unique stable id.
#[derive(Clone, Debug, PartialEq)]
pub struct Dataset<S> {
    name: String,
    class_names: Vec<String>,
    samples: Vec<S>,
}

/// The two halves of a dataset.
#[derive(Clone, Debug, PartialEq)]
pub struct Split<S> {
    /// Training samples.
    pub train: Dataset<S>,
    /// Held-out samples.
    pub test: Dataset<S>,
}

impl<S: Sample> Dataset<S> {
    /// A dataset named `name` (used in messages) over `samples`. Errors ([`crate::Error::Data`])
    /// if it is empty, a label is `>= class_names.len()`, or two samples share an id.
    pub fn new(name: impl Into<String>, class_names: Vec<String>, samples: Vec<S>) -> Result<Self> {
        let name = name.into();
        let what = || format!("dataset {name}");
        if samples.is_empty() {
            return Err(data_error(what(), "has no samples; expected at least one"));
        }
        let mut ids = HashSet::with_capacity(samples.len());
        for (i, s) in samples.iter().enumerate() {
            if s.label() as usize >= class_names.len() {
                return Err(data_error(
                    what(),
                    format!("sample {i} (id {}) has label {}, expected < {}", s.id(), s.label(), class_names.len()),
                ));
            }
            if !ids.insert(s.id()) {
                return Err(data_error(what(), format!("sample {i} repeats id {}; ids must be unique", s.id())));
            }
        }
        Ok(Self { name, class_names, samples })
    }

    /// The name given at construction (e.g. `rotten-tomatoes/train`).
    pub fn name(&self) -> &str {
        &self.name
    }
    /// Number of samples.
    pub fn len(&self) -> usize {
        self.samples.len()
    }
    /// True when there are no samples (never, for a dataset built by [`Dataset::new`]).
    pub fn is_empty(&self) -> bool {
        self.samples.is_empty()
    }
    /// The sample at `index`, if in range.
    pub fn get(&self, index: usize) -> Option<&S> {
        self.samples.get(index)
    }
    /// All samples, in order.
    pub fn samples(&self) -> &[S] {
        &self.samples
    }
    /// Number of classes (labels are `0..num_classes`).
    pub fn num_classes(&self) -> usize {
        self.class_names.len()
    }
    /// Class names, indexed by label.
    pub fn class_names(&self) -> &[String] {
        &self.class_names
    }
    /// Samples per class, indexed by label.
    pub fn class_counts(&self) -> Vec<usize> {
        let mut counts = vec![0; self.num_classes()];
        for s in &self.samples {
            counts[s.label() as usize] += 1;
        }
        counts
    }

    /// Seeded stratified split: within each class, a `Rng::new(seed)` shuffle picks
    /// `round(count · test_fraction)` samples for the test half. Both halves keep source order
    /// (epochs shuffle them later), and the same seed always gives the same split.
    /// `test_fraction` must be in (0, 1) and leave both halves non-empty.
    pub fn split_stratified(self, test_fraction: f64, seed: u64) -> Result<Split<S>> {
        self.split_stratified_as("test_fraction", test_fraction, seed)
    }

    /// [`split_stratified`](Self::split_stratified), its errors naming `field` (the setting
    /// that asked for the fraction).
    pub fn split_stratified_as(self, field: &str, test_fraction: f64, seed: u64) -> Result<Split<S>> {
        if !(test_fraction > 0.0 && test_fraction < 1.0) {
            return Err(config_error(field, format!("is {test_fraction}, expected a value in (0, 1)")));
        }
        let mut by_class: Vec<Vec<usize>> = vec![Vec::new(); self.num_classes()];
        for (i, s) in self.samples.iter().enumerate() {
            by_class[s.label() as usize].push(i);
        }
        // One generator across classes in label order: the split depends only on the seed and
        // the file, not on hash-map or thread order.
        let mut rng = Rng::new(seed);
        let mut in_test = vec![false; self.samples.len()];
        for members in &mut by_class {
            rng.shuffle(members);
            let n_test = ((members.len() as f64 * test_fraction).round() as usize).min(members.len());
            for &i in &members[..n_test] {
                in_test[i] = true;
            }
        }
        let n_test = in_test.iter().filter(|&&t| t).count();
        if n_test == 0 || n_test == self.samples.len() {
            return Err(config_error(
                field,
                format!(
                    "{test_fraction} leaves an empty {} part of {} ({} samples; each of its {} classes gives its \
                     own count × {test_fraction}, rounded)",
                    if n_test == 0 { "held-out" } else { "training" },
                    self.name,
                    self.samples.len(),
                    by_class.len()
                ),
            ));
        }
        let (mut train, mut test) = (Vec::new(), Vec::with_capacity(n_test));
        for (s, t) in self.samples.into_iter().zip(in_test) {
            if t { test.push(s) } else { train.push(s) }
        }
        let names = &self.class_names;
        Ok(Split {
            train: Dataset { name: format!("{}/train", self.name), class_names: names.clone(), samples: train },
            test: Dataset { name: format!("{}/test", self.name), class_names: names.clone(), samples: test },
        })
    }
}

/// The distinct labels of a user's training file `path` as class names, sorted: as numbers
/// where every label is an integer (`2` before `10`), else as text. A class's index is its
/// label. One class is an error: there would be nothing to tell apart.
pub(crate) fn sorted_classes<'a>(path: &std::path::Path, labels: impl Iterator<Item = &'a str>) -> Result<Vec<String>> {
    let mut classes: Vec<String> =
        labels.collect::<std::collections::BTreeSet<_>>().into_iter().map(str::to_string).collect();
    if classes.iter().all(|c| c.parse::<u64>().is_ok()) {
        classes.sort_by_key(|c| c.parse::<u64>().unwrap_or(u64::MAX));
    }
    if let [only] = classes.as_slice() {
        return Err(super::files::dataset_error(
            path,
            None,
            format!("has one label, `{only}`, on every row; expected at least two classes to tell apart"),
        ));
    }
    Ok(classes)
}

/// Refuses a label that reads as a stray row rather than a class, where training would make a
/// class of it: on one row only, either the only label that is not an integer among integer
/// labels (a typo), or on the first row with a column's name (`label`, `class`: a header,
/// which a labelled file has none of). `rows` are (line, label).
pub(crate) fn refuse_stray_label<'a>(
    path: &std::path::Path,
    rows: impl Iterator<Item = (usize, &'a str)>,
) -> Result<()> {
    let mut seen: std::collections::BTreeMap<&str, (usize, usize)> = std::collections::BTreeMap::new();
    for (line, label) in rows {
        seen.entry(label).or_insert((0, line)).0 += 1;
    }
    let words: Vec<(&str, usize, usize)> =
        seen.iter().filter(|(l, _)| l.parse::<u64>().is_err()).map(|(l, &(n, line))| (*l, n, line)).collect();
    let first = seen.values().map(|&(_, line)| line).min();
    let why = match words.as_slice() {
        [(label, 1, line)] if seen.len() > 2 => {
            Some((*label, *line, "where every other row's label is an integer: a typo?".to_string()))
        }
        _ => words
            .iter()
            .find(|&&(l, n, line)| {
                let name = ["label", "labels", "class", "category", "target"].contains(&l.to_lowercase().as_str());
                n == 1 && Some(line) == first && name
            })
            .map(|&(l, _, line)| (l, line, "on the first row, a column's name: a header row?".to_string())),
    };
    match why {
        Some((label, line, why)) => Err(super::files::dataset_error(
            path,
            Some(line),
            format!(
                "has label `{label}`, on this row only, {why} A labelled file has one sample per row and no header"
            ),
        )),
        None => Ok(()),
    }
}

/// The class of `label` on `line` of a user's file `path`, among the `classes` of the
/// training file `train` ([`sorted_classes`]); a label it lacks is an error naming the line.
pub(crate) fn label_index(
    classes: &[String],
    label: &str,
    train: &std::path::Path,
    path: &std::path::Path,
    line: usize,
) -> Result<u32> {
    let index = classes.iter().position(|c| c == label).ok_or_else(|| {
        super::files::dataset_error(
            path,
            Some(line),
            format!(
                "label `{label}` does not occur in the training file {}; expected one of {}",
                train.display(),
                shown_classes(classes)
            ),
        )
    })?;
    Ok(index as u32)
}

/// Class names for a message: all of a few, the first 20 of many and how many in all.
pub(crate) fn shown_classes(classes: &[String]) -> String {
    const SHOWN: usize = 20;
    match classes.len() > SHOWN {
        true => format!("{}, … ({} in all)", classes[..SHOWN].join(", "), classes.len()),
        false => classes.join(", "),
    }
}
