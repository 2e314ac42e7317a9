//! Predictions for a stream of inputs, as the `predict` command writes them: inputs batched,
//! images read ahead on every core, each input's answer (or its error) in order, as JSON lines
//! or a table.

use super::*;

/// How predictions are written.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OutputFormat {
    /// One JSON object per input and line: `{"input", "label", "probability",
    /// "probabilities"}`, `{"input", "generated"}`, or `{"input", "error"}`.
    JsonLines,
    /// Aligned columns for a person at a terminal.
    Table,
}

/// What [`predict_stream`] does with its inputs.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PredictOptions {
    /// Inputs per forward pass (texts and images): at least 1.
    pub batch_size: usize,
    /// How a GPT continues a prompt; [`Sampling::default`] for any other model.
    pub sampling: Sampling,
    /// How each result is written.
    pub format: OutputFormat,
}

/// One input's result, as written.
pub(super) enum Outcome {
    Class(ClassPrediction),
    Generated(Generation),
    Failed(String),
}

impl PredictOptions {
    /// Refuses, once and before any input, what no input could use: a batch size of 0,
    /// sampling no generation can use, and (for a model that does not generate) sampling
    /// flags other than the defaults, which it would ignore.
    pub fn check<D: Device>(&self, predictor: &Predictor<D>) -> Result<()> {
        if self.batch_size == 0 {
            return Err(batch_size_error());
        }
        if let Reader::Chars { chars, .. } = &predictor.reader {
            self.sampling.check()?;
            self.sampling.check_greedy()?;
            let k = self.sampling.top_k;
            if k >= chars.len() {
                return Err(config_error(
                    "--top-k",
                    format!(
                        "--top-k {k} keeps every one of the model's {} characters, as 0 does: give a smaller k, \
                         or leave --top-k out",
                        chars.len()
                    ),
                ));
            }
            return Ok(());
        }
        let flags = self.sampling.changed_flags();
        if !flags.is_empty() {
            let (them, apply) = if flags.len() == 1 { ("it", "applies") } else { ("them", "apply") };
            let listed = match flags.split_last() {
                Some((last, rest)) if !rest.is_empty() => format!("{} and {last}", rest.join(", ")),
                _ => flags.join(""),
            };
            // Named by the first flag given (`--temperature`), as a flag.
            let field = flags[0].split(' ').next().unwrap_or("--temperature").to_string();
            return Err(config_error(
                field,
                format!(
                    "{} only {apply} to text generation (a GPT); the model is {}, which generates nothing: \
                     leave {them} out",
                    listed,
                    predictor.describe()
                ),
            ));
        }
        Ok(())
    }
}

/// Runs `predictor` on every input of `inputs` (texts, image paths or CSV rows, prompts, as
/// the model reads) in batches, writing one result per input, in order, to `out` as it goes
/// (a table starts with its header). The options are checked first ([`PredictOptions::check`]):
/// a bad one is an error before any input is read. An input that fails (an empty line, an
/// unreadable image, an unknown character, a line that is not text: an [`Error::Dataset`]
/// naming its line) gets an error result and the rest go on; another error reading the inputs
/// stops the run. Returns (results written, failed): one result
/// per image of a file that holds several.
pub fn predict_stream<D: Device>(
    predictor: &Predictor<D>,
    inputs: impl Iterator<Item = Result<String>>,
    options: &PredictOptions,
    out: &mut dyn std::io::Write,
) -> Result<(usize, usize)> {
    options.check(predictor)?;
    let generates = matches!(predictor.reader, Reader::Chars { .. });
    // A prompt is continued alone (nothing batches), and as soon as it is read: someone typing
    // prompts gets each one's continuation before typing the next.
    let size = if generates { 1 } else { options.batch_size };
    if options.format == OutputFormat::Table {
        write_table_header(out, generates)
            .and_then(|()| out.flush())
            .map_err(|e| Error::Io { path: "writing the predictions".into(), source: e })?;
    }
    let (mut total, mut failed) = (0, 0);
    let mut pending: Vec<(String, Option<Vec<f32>>)> = Vec::new();
    // A folder given to an image model is its files, each an input of its own, read as the
    // batches reach them: a folder of many images is never held whole.
    let image = matches!(predictor.reader, Reader::Image { .. });
    let mut inputs = inputs.flat_map(|input| match input {
        Ok(name) if image && Path::new(&name).is_dir() => folder_inputs(&name),
        other => vec![other],
    });
    // Each input comes with its entries for the batch: (name, pixels for images), or the error
    // that fails it alone. Images are read ahead, as many inputs at a time as there are cores (up
    // to 8: each may be an IDX file of many images), on every core.
    type Entry = (String, Result<Option<Vec<f32>>>);
    let entries_of = |name: &String| -> Result<Vec<Entry>> {
        match image {
            true => Ok(predictor.read_images(name)?.into_iter().map(|(name, px)| (name, px.map(Some))).collect()),
            false => Ok(vec![(name.clone(), Ok(None))]),
        }
    };
    // (No more than a batch: a batch's inputs are all it waits for, and someone typing, at
    // batch size 1, gets each line's answer before the next line.)
    let ahead = if image { std::thread::available_parallelism().map_or(1, |n| n.get()).min(8).min(size) } else { 1 };
    let mut read = std::collections::VecDeque::new();
    let mut inputs = std::iter::from_fn(move || {
        if read.is_empty() {
            let mut taken = Vec::new();
            // (Not past an input that failed: it may end the stream.)
            while taken.len() < ahead
                && let Some(input) = inputs.next()
            {
                let failed = input.is_err();
                taken.push(input);
                if failed {
                    break;
                }
            }
            // (Every read is `Ok`, its own error inside: one input that fails ends no read.)
            let done = crate::data::read_each(&taken, |input| Ok(input.as_ref().map_or(Ok(Vec::new()), entries_of)));
            read.extend(
                taken
                    .into_iter()
                    .zip(done)
                    .map(|(input, done)| input.map(|name| (name, done.and_then(|entries| entries)))),
            );
        }
        read.pop_front()
    })
    .peekable();
    while inputs.peek().is_some() {
        // Fill a batch: (name, pixels for images) per entry; failures are written in order.
        let mut results: Vec<(String, Outcome)> = Vec::new();
        pending.clear();
        let mut order = Vec::new(); // per result: Some(index into pending) or None (failed)
        // An input that cannot be read ends the stream, after the batch read before it.
        let mut unreadable = None;
        while pending.len() < size {
            let Some(input) = inputs.next() else { break };
            let (input, entries) = match input {
                Ok(input) => input,
                // A line that is not text fails alone (its error names it); the rest go on.
                Err(Error::Dataset { file, line: Some(line), message }) => {
                    // (Its bytes may be an image's, given as the list: said where the model reads images.)
                    let image = if image {
                        " (if the list is an image file, give it as an argument itself, without --file)"
                    } else {
                        ""
                    };
                    order.push(None);
                    results.push((format!("{file}:{line}"), Outcome::Failed(format!("{message}{image}"))));
                    continue;
                }
                Err(e) => {
                    unreadable = Some(e);
                    break;
                }
            };
            // An input that fails is one failed entry; so is a CSV row that is no image.
            for (name, pixels) in entries.unwrap_or_else(|e| vec![(input, Err(e))]) {
                match pixels {
                    Ok(pixels) => {
                        order.push(Some(pending.len()));
                        pending.push((name, pixels));
                    }
                    Err(e) => {
                        order.push(None);
                        results.push((name, Outcome::Failed(e.to_string())));
                    }
                }
            }
        }
        // One input may be many images (an IDX file): the model still sees `size` at a time.
        // (A prompt is continued as it is written.)
        let mut done: Vec<Outcome> = match generates {
            true => Vec::new(),
            false => pending.chunks(size).flat_map(|chunk| predictor.run_batch(chunk)).collect(),
        };
        let mut failures = results.into_iter();
        for slot in order {
            let (name, outcome) = match slot {
                Some(i) if generates => {
                    total += 1;
                    failed += write_generation(predictor, out, options, &pending[i].0)? as usize;
                    continue;
                }
                Some(i) => (pending[i].0.clone(), std::mem::replace(&mut done[i], Outcome::Failed(String::new()))),
                None => failures.next().ok_or_else(|| Error::Internal {
                    what: "predict".into(),
                    message: "a failed input went missing".into(),
                })?,
            };
            total += 1;
            failed += matches!(outcome, Outcome::Failed(_)) as usize;
            write_outcome(out, options.format, generates, &name, &outcome)
                .map_err(|e| Error::Io { path: "writing the predictions".into(), source: e })?;
        }
        out.flush().map_err(|e| Error::Io { path: "writing the predictions".into(), source: e })?;
        if let Some(e) = unreadable {
            return Err(e);
        }
    }
    Ok((total, failed))
}

impl<D: Device> Predictor<D> {
    /// One batch's classifications, in order (a prompt is continued by [`write_generation`]).
    /// A batch that fails as a whole is retried input by input, so one bad input fails alone.
    fn run_batch(&self, batch: &[(String, Option<Vec<f32>>)]) -> Vec<Outcome> {
        debug_assert!(!matches!(self.reader, Reader::Chars { .. }), "a prompt is continued by write_generation");
        let classes = |r: Result<Vec<ClassPrediction>>| -> Option<Vec<Outcome>> {
            r.ok().map(|v| v.into_iter().map(Outcome::Class).collect())
        };
        let whole = match self.reader {
            Reader::Chars { .. } => None,
            Reader::Image { .. } => classes(
                self.classify_images(&batch.iter().map(|b| b.1.clone().unwrap_or_default()).collect::<Vec<_>>()),
            ),
            Reader::Text(_) => classes(self.classify_texts(&batch.iter().map(|b| b.0.as_str()).collect::<Vec<_>>())),
        };
        if let Some(all) = whole.filter(|v| v.len() == batch.len()) {
            return all;
        }
        batch
            .iter()
            .map(|(input, pixels)| {
                let one = match (&self.reader, pixels) {
                    (Reader::Image { .. }, Some(px)) => self.classify_images(std::slice::from_ref(px)),
                    _ => self.classify_texts(&[input.as_str()]),
                };
                match one {
                    Ok(mut v) if v.len() == 1 => Outcome::Class(v.remove(0)),
                    Ok(_) => Outcome::Failed("no prediction came back".into()),
                    Err(e) => Outcome::Failed(e.to_string()),
                }
            })
            .collect()
    }
}

/// Continues `prompt` and writes it: in a table each character as it is drawn (a long
/// continuation is read while it grows), as a JSON line once whole. A prompt that fails after
/// some characters were drawn keeps them in a table, its error on the line under them (a JSON
/// line holds only the error). Returns whether the prompt failed; an error writing stops the
/// run.
fn write_generation<D: Device>(
    predictor: &Predictor<D>,
    out: &mut dyn std::io::Write,
    options: &PredictOptions,
    prompt: &str,
) -> Result<bool> {
    let io = |e| Error::Io { path: "writing the predictions".into(), source: e };
    let result = match options.format {
        OutputFormat::JsonLines => predictor.generate(prompt, &options.sampling),
        OutputFormat::Table => {
            // The prompt is written with the first character drawn: a prompt refused before
            // any gets the error row instead.
            let (mut started, mut unwritten) = (false, None);
            let result = predictor.generate_each(prompt, &options.sampling, &mut |c| {
                let written = match started {
                    true => write!(out, "{c}"),
                    false => write!(out, "{prompt}{c}"),
                };
                started = true;
                written.and_then(|()| out.flush()).map_err(|e| {
                    unwritten = Some(io(e));
                    Error::Internal { what: "predict".into(), message: "the predictions could not be written".into() }
                })
            });
            if let Some(e) = unwritten {
                return Err(e);
            }
            if started {
                // The rest of the row, as `write_outcome` ends it.
                let end = match &result {
                    Ok(g) => writeln!(out, "\n{}{GENERATION_RULE}", warning_line(g)),
                    Err(e) => writeln!(out, "\n  error: {e}\n{GENERATION_RULE}"),
                };
                end.map_err(io)?;
                return Ok(result.is_err());
            }
            result
        }
    };
    let outcome = result.map_or_else(|e| Outcome::Failed(e.to_string()), Outcome::Generated);
    write_outcome(out, options.format, true, prompt, &outcome).map_err(io)?;
    Ok(matches!(outcome, Outcome::Failed(_)))
}

/// A generation's warning on a line of its own in a table (empty without one).
fn warning_line(g: &Generation) -> String {
    g.warning.as_ref().map(|w| format!("  ({w})\n")).unwrap_or_default()
}

/// Width of a table's input column.
pub(super) const INPUT_COLUMN: usize = 48;

/// The line under each generation in a table: generated text holds line breaks of its own,
/// so without it one generation runs into the next.
pub(super) const GENERATION_RULE: &str = "────────────────────────────────────────────────";

/// A table's header: the columns of a classifier's rows, or what a generated row holds.
fn write_table_header(out: &mut dyn std::io::Write, generates: bool) -> std::io::Result<()> {
    if generates {
        writeln!(out, "prompt, then the generated text; a rule under each")?;
        writeln!(out, "{GENERATION_RULE}")
    } else {
        writeln!(out, "{:<INPUT_COLUMN$}  {:<16} {:>11}", "input", "label", "probability")
    }
}

pub(super) fn write_outcome(
    out: &mut dyn std::io::Write,
    format: OutputFormat,
    generates: bool,
    input: &str,
    outcome: &Outcome,
) -> std::io::Result<()> {
    match format {
        OutputFormat::JsonLines => {
            // (Written from structs: the input first, the probabilities in label order, where a
            // JSON object's keys would come out sorted.)
            let line = match outcome {
                Outcome::Class(p) => serde_json::to_string(&ClassLine {
                    input,
                    label: &p.label,
                    probability: p.probability,
                    probabilities: InLabelOrder(&p.probabilities),
                    warning: p.warning.as_deref(),
                }),
                Outcome::Generated(g) => {
                    serde_json::to_string(&GeneratedLine { input, generated: &g.text, warning: g.warning.as_deref() })
                }
                Outcome::Failed(error) => serde_json::to_string(&FailedLine { input, error }),
            };
            writeln!(out, "{}", line.map_err(std::io::Error::other)?)
        }
        OutputFormat::Table => {
            let shown = padded(&shorten(input, INPUT_COLUMN), INPUT_COLUMN);
            match outcome {
                Outcome::Class(p) => {
                    let warning = p.warning.as_ref().map(|w| format!("  ({w})")).unwrap_or_default();
                    let label = padded(&p.label, 16);
                    writeln!(out, "{shown}  {label} {:>10.2}%{warning}", 100.0 * p.probability)
                }
                Outcome::Generated(g) => writeln!(out, "{input}{}\n{}{GENERATION_RULE}", g.text, warning_line(g)),
                Outcome::Failed(e) if generates => writeln!(out, "{input}  error: {e}\n{GENERATION_RULE}"),
                Outcome::Failed(e) => writeln!(out, "{shown}  error: {e}"),
            }
        }
    }
}

/// A classification's JSON line.
#[derive(Serialize)]
struct ClassLine<'a> {
    input: &'a str,
    label: &'a str,
    probability: f64,
    probabilities: InLabelOrder<'a>,
    #[serde(skip_serializing_if = "Option::is_none")]
    warning: Option<&'a str>,
}

/// A generation's JSON line.
#[derive(Serialize)]
struct GeneratedLine<'a> {
    input: &'a str,
    generated: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    warning: Option<&'a str>,
}

/// A failed input's JSON line.
#[derive(Serialize)]
struct FailedLine<'a> {
    input: &'a str,
    error: &'a str,
}

/// Class probabilities as a JSON object whose keys keep the labels' order.
struct InLabelOrder<'a>(&'a [(String, f64)]);

impl Serialize for InLabelOrder<'_> {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> std::result::Result<S::Ok, S::Error> {
        serializer.collect_map(self.0.iter().map(|(name, p)| (name, p)))
    }
}

/// The first `n` columns of `s` on one line, as a terminal shows them (a CJK character takes
/// two), with `…` when cut.
pub(super) fn shorten(s: &str, n: usize) -> String {
    use unicode_width::UnicodeWidthChar;
    let one_line: String = s.chars().map(|c| if c.is_control() { ' ' } else { c }).collect();
    if unicode_width::UnicodeWidthStr::width(one_line.as_str()) <= n {
        return one_line;
    }
    let mut width = 0;
    let kept = one_line.chars().take_while(|c| {
        width += c.width().unwrap_or(0);
        width < n
    });
    kept.chain(['…']).collect()
}

/// `s` and the spaces that fill it to `n` columns as a terminal shows them (a CJK character
/// takes two): what `{:<n}`, which counts characters, misaligns.
pub(super) fn padded(s: &str, n: usize) -> String {
    let width = unicode_width::UnicodeWidthStr::width(s);
    format!("{s}{}", " ".repeat(n.saturating_sub(width)))
}
