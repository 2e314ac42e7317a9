//! The library's typed error. Every message names what was wrong and what was expected.

/// Everything the library can report to a caller.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A buffer handed to an op has the wrong number of elements.
    #[error("{op}: `{arg}` has {got} elements, expected {expected}")]
    Shape {
        /// The op that checked.
        op: &'static str,
        /// The argument's name.
        arg: &'static str,
        /// Elements expected from the other arguments' dimensions.
        expected: usize,
        /// Elements actually passed.
        got: usize,
    },
    /// A configuration field, a command-line flag or an environment variable holds a value the
    /// engine cannot use.
    #[error("{} `{field}`: {message}", setting_kind(field))]
    Config {
        /// Dotted field name, e.g. `bert.num_attention_heads`, a flag with its dashes, e.g.
        /// `--device`, or an environment variable in its capitals, e.g. `RANK`.
        field: String,
        /// What was wrong and what was expected.
        message: String,
    },
    /// Input data (token ids, labels, images) is out of range for the model.
    #[error("{what}: {message}")]
    Data {
        /// Which input, e.g. `token ids`.
        what: String,
        /// What was wrong and what was expected.
        message: String,
    },
    /// A pipeline schedule is incomplete or would deadlock: the first offending action.
    #[error("schedule: device {device}, action #{position} {action}: {message}")]
    Schedule {
        /// The device whose list holds the action.
        device: usize,
        /// Its position in that list.
        position: usize,
        /// The action, printed.
        action: String,
        /// What is wrong with it.
        message: String,
    },
    /// A serialized state (optimizer, checkpoint, cache file) is corrupt or does not match the
    /// model it is loaded into.
    #[error("state `{what}`: {message}")]
    State {
        /// Which piece of state.
        what: String,
        /// What was wrong and what was expected.
        message: String,
    },
    /// A backend failed: the CUDA driver, NVRTC or ptxas, the kernel emulator, a communicator.
    #[error("{what}: {message}")]
    Device {
        /// The backend and what it was doing, e.g. `nvrtc: kernels/norm.cu for sm_90`.
        what: String,
        /// The backend's own message.
        message: String,
    },
    /// Training was asked to stop (a signal's stop request) before its end, and the checkpoint
    /// of the step it stopped at is written. The process exits with [`INTERRUPTED_EXIT_CODE`].
    #[error("{}", interrupted_message(*.step, .unwritten.as_deref()))]
    Interrupted {
        /// The last step taken; `None` for a launcher, whose processes each name it.
        step: Option<u64>,
        /// Why the report of the steps taken could not be written, where it could not (the stop
        /// stays a stop: its checkpoint is what a resume needs).
        unwritten: Option<String>,
    },
    /// Training diverged: the loss stopped being a finite number.
    #[error("training diverged: the loss became {loss} at step {step}; lower the learning rate")]
    Diverged {
        /// The optimizer step whose loss was not finite, counted as the command's output counts
        /// them (`train` from 1, `overfit` from 0).
        step: u64,
        /// The loss.
        loss: f64,
    },
    /// One device of a pipelined step failed; the step was abandoned and no weight changed.
    #[error("pipeline device {device}: {source}")]
    Pipeline {
        /// Global index of the device that failed first.
        device: usize,
        /// Its error.
        source: Box<Error>,
    },
    /// The engine broke one of its own invariants (a backward without its forward, a schedule
    /// the runtime cannot follow): a bug, never a user's mistake.
    #[error("internal error in {what}: {message}")]
    Internal {
        /// Where.
        what: String,
        /// What went wrong.
        message: String,
    },
    /// A dataset file is missing or malformed. `line` is the 1-based line (text formats) where
    /// the bad record starts, when there is one.
    #[error("{file}{}: {message}", line.map(|n| format!(": line {n}")).unwrap_or_default())]
    Dataset {
        /// The file, as the loader was given it (e.g. `data/text/hamlet.txt`).
        file: String,
        /// 1-based line of the bad record, if the problem is in one record.
        line: Option<usize>,
        /// What was wrong and what was expected (for a missing file: how to fetch it).
        message: String,
    },
    /// A weights file (safetensors) is malformed, or does not fit the model it is loaded into.
    #[error("{file}{}: {message}", tensor_label(.tensor))]
    Weights {
        /// The file involved.
        file: String,
        /// The tensor to blame, when one is (`None` for a broken header, say).
        tensor: Option<String>,
        /// What was wrong and what was expected.
        message: String,
    },
    /// A tokenizer file that could be read but not used (malformed JSON, no padding token), or
    /// a tokenizer that failed on an input.
    #[error("tokenizer {file}: {message}")]
    Tokenizer {
        /// The tokenizer file, e.g. `weights/all-minilm-l6-v2/tokenizer.json`.
        file: String,
        /// What was wrong and what was expected.
        message: String,
    },
    /// An operating-system I/O error, with the path involved.
    #[error("{path}: {source}")]
    Io {
        /// File or directory involved.
        path: String,
        /// The underlying error.
        source: std::io::Error,
    },
}

/// `Result` with the library's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// The exit status of a run that stopped on a signal's request with its checkpoint written
/// (the shell's 128 + SIGINT), so that a launcher or a job script tells it from a failure.
pub const INTERRUPTED_EXIT_CODE: u8 = 130;

fn interrupted_message(step: Option<u64>, unwritten: Option<&str>) -> String {
    let report = unwritten.map(|e| format!(" (its report.html could not be written: {e})")).unwrap_or_default();
    let stopped = match step {
        Some(step) => {
            format!("interrupted at step {step}: its checkpoint is written, and `train --resume` continues from it")
        }
        None => "interrupted: every process stopped after the same step with its checkpoint written (their lines say \
                 which), and `train --resume` under the same launch continues from it"
            .into(),
    };
    stopped + &report
}

/// Checks that `arg` of `op` holds exactly `expected` elements.
#[inline]
pub fn check_len(op: &'static str, arg: &'static str, got: usize, expected: usize) -> Result<()> {
    if got == expected { Ok(()) } else { Err(Error::Shape { op, arg, expected, got }) }
}

fn tensor_label(tensor: &Option<String>) -> String {
    tensor.as_ref().map_or(String::new(), |t| format!(": tensor `{t}`"))
}

/// What kind of setting [`Error::Config`]'s `field` names, by how it is written: a flag with its
/// dashes, an environment variable in capitals (config keys are lower case), else a config field.
fn setting_kind(field: &str) -> &'static str {
    if field.starts_with("--") {
        "flag"
    } else if !field.is_empty() && field.bytes().all(|b| b.is_ascii_uppercase() || b.is_ascii_digit() || b == b'_') {
        "environment variable"
    } else {
        "config field"
    }
}

/// `n` and `noun`, the noun plural unless `n` is 1, for messages: "1 replica", "2 replicas",
/// "8 micro-batches".
pub fn counted(n: usize, noun: &str) -> String {
    let plural = match n == 1 {
        true => "",
        false if noun.ends_with(['s', 'x']) || noun.ends_with("ch") || noun.ends_with("sh") => "es",
        false => "s",
    };
    format!("{n} {noun}{plural}")
}

/// Shorthand for an [`Error::Config`].
pub fn config_error(field: impl Into<String>, message: impl Into<String>) -> Error {
    Error::Config { field: field.into(), message: message.into() }
}

/// Shorthand for an [`Error::Internal`].
pub fn internal(what: impl Into<String>, message: impl Into<String>) -> Error {
    Error::Internal { what: what.into(), message: message.into() }
}

/// Shorthand for an [`Error::Data`].
pub fn data_error(what: impl Into<String>, message: impl Into<String>) -> Error {
    Error::Data { what: what.into(), message: message.into() }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The message names a setting as the user wrote it: a flag, an environment variable or a
    /// config field.
    #[test]
    fn a_refused_setting_is_named_by_its_kind() {
        assert!(config_error("--device", "x").to_string().starts_with("flag `--device`: "));
        assert!(config_error("RANK", "x").to_string().starts_with("environment variable `RANK`: "));
        assert!(config_error("PT_SHARE_GPUS", "x").to_string().starts_with("environment variable `PT_SHARE_GPUS`: "));
        assert!(config_error("pipeline.chunks", "x").to_string().starts_with("config field `pipeline.chunks`: "));
        assert!(config_error("vit.num_labels", "x").to_string().starts_with("config field "));
    }
}
