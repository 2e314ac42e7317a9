//! Text classification datasets, as raw text (a tokenizer module turns them into batches):
//! Rotten Tomatoes review snippets (binary sentiment), Reuters R8 (8-way topic), and a user's
//! own labelled texts.

use std::collections::{BTreeSet, HashSet};
use std::path::Path;

use super::csv::CsvRecords;
use super::dataset::{Dataset, Sample, Split, TEST_FILE_ID_BASE, label_index, refuse_stray_label, sorted_classes};
use super::files::{SetupGroup, dataset_error, numbered_lines, read_text};
use crate::error::Result;

/// Rotten Tomatoes corpus, relative to the data directory.
pub const ROTTEN_TOMATOES_FILE: &str = "text/rotten_tomatoes_corpus_full.csv.bz2";
/// Reuters R8 training file, relative to the data directory.
pub const REUTERS_R8_TRAIN_FILE: &str = "text/reuters-r8-train.tab";
/// Reuters R8 test file, relative to the data directory.
pub const REUTERS_R8_TEST_FILE: &str = "text/reuters-r8-test.tab";

/// One labelled text.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TextSample {
    /// Stable id (see each loader for how it is derived).
    pub id: u64,
    /// The raw text, as in the file.
    pub text: String,
    /// Class index.
    pub label: u32,
}

impl Sample for TextSample {
    fn id(&self) -> u64 {
        self.id
    }
    fn label(&self) -> u32 {
        self.label
    }
}

/// Rotten Tomatoes from `data_dir` ([`ROTTEN_TOMATOES_FILE`]); see [`rotten_tomatoes_file`].
pub fn rotten_tomatoes(data_dir: impl AsRef<Path>) -> Result<Dataset<TextSample>> {
    rotten_tomatoes_file(&data_dir.as_ref().join(ROTTEN_TOMATOES_FILE))
}

/// Rotten Tomatoes review snippets from a CSV file (bzip2 if the name ends in `.bz2`) with
/// header `category,text,movie_name,has_plot_and_reviews`. Labels: `rotten` = 0, `fresh` = 1;
/// `plot` rows (plot summaries, not reviews) are dropped. Texts are deduplicated, keeping the
/// first occurrence. A sample's id is its record's 0-based index among all data records of the
/// file (header excluded, `plot` rows counted), so ids are stable but not contiguous.
pub fn rotten_tomatoes_file(path: &Path) -> Result<Dataset<TextSample>> {
    let text = read_text(path, SetupGroup::Text)?;
    let mut records = CsvRecords::new(path, &text);
    let Some(header) = records.next().transpose()? else {
        return Err(dataset_error(path, None, "is empty; expected a header `category,text,...` and reviews"));
    };
    let column = |name: &str| {
        header.fields.iter().position(|f| f == name).ok_or_else(|| {
            dataset_error(
                path,
                Some(header.line),
                format!("header has no `{name}` column; expected `category,text,...`"),
            )
        })
    };
    let (cat_col, text_col) = (column("category")?, column("text")?);
    let width = header.fields.len();

    let mut seen = HashSet::new();
    let mut samples = Vec::new();
    for (index, record) in records.enumerate() {
        let record = record?;
        if record.fields.len() != width {
            return Err(dataset_error(
                path,
                Some(record.line),
                format!("has {} fields, expected {width} (as in the header)", record.fields.len()),
            ));
        }
        let label = match record.fields[cat_col].as_str() {
            "rotten" => 0,
            "fresh" => 1,
            "plot" => continue,
            other => {
                return Err(dataset_error(
                    path,
                    Some(record.line),
                    format!("category `{other}` is not one of fresh, rotten, plot"),
                ));
            }
        };
        let body = &record.fields[text_col];
        if seen.contains(body) {
            continue;
        }
        seen.insert(body.clone());
        samples.push(TextSample { id: index as u64, text: body.clone(), label });
    }
    if samples.is_empty() {
        return Err(dataset_error(path, None, "holds no fresh or rotten reviews; expected at least one"));
    }
    Dataset::new("rotten-tomatoes", vec!["rotten".into(), "fresh".into()], samples)
}

/// Reuters R8 from `data_dir` ([`REUTERS_R8_TRAIN_FILE`], [`REUTERS_R8_TEST_FILE`]).
pub fn reuters_r8(data_dir: impl AsRef<Path>) -> Result<Split<TextSample>> {
    let dir = data_dir.as_ref();
    orange_tab_files("reuters-r8", &dir.join(REUTERS_R8_TRAIN_FILE), &dir.join(REUTERS_R8_TEST_FILE))
}

/// A text classification dataset in Orange's `.tab` format, one train and one test file: three
/// header rows (names, types, roles), then one `Category<TAB>Text` row per document (the
/// columns are found by name in the first row; blank lines are skipped). Class names are the
/// sorted distinct train categories; every test category must be among them. Rows are kept
/// as they are (R8 repeats some texts). Ids: the 0-based row index for the train file,
/// [`TEST_FILE_ID_BASE`] + row index for the test file.
pub fn orange_tab_files(name: &str, train: &Path, test: &Path) -> Result<Split<TextSample>> {
    let train_rows = read_orange_tab(train)?;
    let test_rows = read_orange_tab(test)?;
    let classes: Vec<String> =
        train_rows.iter().map(|r| r.category.clone()).collect::<BTreeSet<_>>().into_iter().collect();
    let to_samples = |rows: Vec<TabRow>, path: &Path, id_base: u64| -> Result<Vec<TextSample>> {
        rows.into_iter()
            .enumerate()
            .map(|(i, r)| {
                let label = classes.binary_search(&r.category).map_err(|_| {
                    dataset_error(
                        path,
                        Some(r.line),
                        format!(
                            "category `{}` does not occur in the train file; expected one of {classes:?}",
                            r.category
                        ),
                    )
                })?;
                Ok(TextSample { id: id_base + i as u64, text: r.text, label: label as u32 })
            })
            .collect()
    };
    let train_samples = to_samples(train_rows, train, 0)?;
    let test_samples = to_samples(test_rows, test, TEST_FILE_ID_BASE)?;
    Ok(Split {
        train: Dataset::new(format!("{name}/train"), classes.clone(), train_samples)?,
        test: Dataset::new(format!("{name}/test"), classes, test_samples)?,
    })
}

struct TabRow {
    line: usize,
    category: String,
    text: String,
}

fn read_orange_tab(path: &Path) -> Result<Vec<TabRow>> {
    const HEADER_ROWS: usize = 3;
    let text = read_text(path, SetupGroup::Text)?;
    let mut lines = numbered_lines(&text);
    let Some((_, names)) = lines.next() else {
        return Err(dataset_error(path, None, "is empty; expected 3 header rows (`Category<TAB>Text`, types, roles)"));
    };
    let names: Vec<&str> = names.split('\t').collect();
    let column = |name: &str| {
        names.iter().position(|&n| n == name).ok_or_else(|| {
            dataset_error(path, Some(1), format!("header has no `{name}` column; expected `Category<TAB>Text`"))
        })
    };
    let (cat_col, text_col) = (column("Category")?, column("Text")?);
    for _ in 1..HEADER_ROWS {
        if lines.next().is_none() {
            return Err(dataset_error(path, None, "ends inside the header; expected 3 header rows"));
        }
    }
    let mut rows = Vec::new();
    for (line, row) in lines {
        if row.is_empty() {
            continue;
        }
        let fields: Vec<&str> = row.split('\t').collect();
        if fields.len() != names.len() {
            return Err(dataset_error(
                path,
                Some(line),
                format!("has {} tab-separated fields, expected {} (as in the header)", fields.len(), names.len()),
            ));
        }
        if fields[cat_col].is_empty() {
            return Err(dataset_error(path, Some(line), "has an empty Category; expected a class name"));
        }
        rows.push(TabRow { line, category: fields[cat_col].to_string(), text: fields[text_col].to_string() });
    }
    if rows.is_empty() {
        return Err(dataset_error(path, None, "has no documents after its 3 header rows; expected at least one"));
    }
    Ok(rows)
}

/// A user's labelled texts (`dataset = "labelled_texts"`): one `label<TAB>text` row per line,
/// the format `evaluate --file` reads, gzip or bzip2 by name or by the first bytes; blank
/// lines are skipped. The classes are the training file's distinct labels, sorted (as
/// numbers where every label is an integer, so `2` comes before `10`); every label of the
/// held-out file, when there is one, must be among them. Ids: the 0-based row index, from
/// [`TEST_FILE_ID_BASE`] in the held-out file. Without a held-out file the caller cuts one
/// ([`Dataset::split_stratified`]).
pub fn labelled_text_files(
    train: &Path,
    test: Option<&Path>,
) -> Result<(Dataset<TextSample>, Option<Dataset<TextSample>>)> {
    let train_rows = read_labelled_texts(train)?;
    refuse_stray_label(train, train_rows.iter().map(|r| (r.line, r.category.as_str())))?;
    let classes = sorted_classes(train, train_rows.iter().map(|r| r.category.as_str()))?;
    let to_samples = |rows: Vec<TabRow>, path: &Path, id_base: u64| -> Result<Vec<TextSample>> {
        rows.into_iter()
            .enumerate()
            .map(|(i, r)| {
                let label = label_index(&classes, &r.category, train, path, r.line)?;
                Ok(TextSample { id: id_base + i as u64, text: r.text, label })
            })
            .collect()
    };
    let held_out = match test {
        Some(path) => {
            let samples = to_samples(read_labelled_texts(path)?, path, TEST_FILE_ID_BASE)?;
            Some(Dataset::new("labelled_texts/test", classes.clone(), samples)?)
        }
        None => None,
    };
    let samples = to_samples(train_rows, train, 0)?;
    Ok((Dataset::new("labelled_texts", classes, samples)?, held_out))
}

/// The `label<TAB>text` rows of a user's file: a row without a tab, an empty label or an
/// empty text is an error naming its line.
fn read_labelled_texts(path: &Path) -> Result<Vec<TabRow>> {
    let text = read_text(path, SetupGroup::User)?;
    let mut rows = Vec::new();
    for (line, row) in numbered_lines(&text) {
        if row.trim().is_empty() {
            continue;
        }
        let Some((label, body)) = row.split_once('\t') else {
            return Err(dataset_error(path, Some(line), "has no tab; expected `label<TAB>text`"));
        };
        let (label, body) = (label.trim(), body.trim());
        if label.is_empty() {
            return Err(dataset_error(path, Some(line), "has an empty label; expected `label<TAB>text`"));
        }
        if body.is_empty() {
            return Err(dataset_error(path, Some(line), "has an empty text; expected `label<TAB>text`"));
        }
        rows.push(TabRow { line, category: label.to_string(), text: body.to_string() });
    }
    if rows.is_empty() {
        return Err(dataset_error(path, None, "has no rows; expected `label<TAB>text` lines"));
    }
    Ok(rows)
}
