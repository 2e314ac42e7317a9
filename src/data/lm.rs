//! Character-level language-model data: Hamlet (or a user's text) as a token stream for a small GPT, and the cut
//! of a stream into fixed-length (input, next-token target) sequences.
//!
//! The vocabulary is character-level: every distinct Unicode scalar of the whole text, sorted by
//! code point, token id = rank. Characters rather than bytes because Hamlet is ASCII (the two
//! coincide) and a char vocabulary only holds the 66 symbols that occur, not 256. It is built
//! over the whole file, so the held-out part never meets an unknown character.

use std::collections::BTreeMap;
use std::path::Path;

use super::dataset::TEST_FILE_ID_BASE;
use super::files::{SetupGroup, dataset_error, read_text};
use crate::error::{Result, config_error, data_error};
use crate::model::HostBatch;

/// Hamlet, relative to the data directory.
pub const HAMLET_FILE: &str = "text/hamlet.txt";
/// Fraction of a corpus, taken from its end, held out from training.
pub const HELD_OUT_FRACTION: f64 = 0.1;

/// A character vocabulary: sorted distinct characters, token id = position.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CharVocab {
    chars: Vec<char>,
    ids: BTreeMap<char, u32>,
}

impl CharVocab {
    /// The characters present in `text`, sorted by code point. Errors if `text` is empty.
    pub fn from_text(text: &str) -> Result<Self> {
        let mut chars: Vec<char> = text.chars().collect();
        chars.sort_unstable();
        chars.dedup();
        if chars.is_empty() {
            return Err(data_error("character vocabulary", "text is empty; expected at least one character"));
        }
        let ids = chars.iter().enumerate().map(|(i, &c)| (c, i as u32)).collect();
        Ok(Self { chars, ids })
    }
    /// Number of tokens.
    pub fn len(&self) -> usize {
        self.chars.len()
    }
    /// Never true for a vocabulary built by [`CharVocab::from_text`].
    pub fn is_empty(&self) -> bool {
        self.chars.is_empty()
    }
    /// The characters, indexed by token id.
    pub fn chars(&self) -> &[char] {
        &self.chars
    }
    /// Token ids of `text`; a character outside the vocabulary is an error naming it.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        text.chars()
            .enumerate()
            .map(|(i, c)| {
                self.ids.get(&c).copied().ok_or_else(|| {
                    data_error("text", format!("character {c:?} at position {i} is not in the vocabulary"))
                })
            })
            .collect()
    }
    /// The text of `tokens`; an id `>= len()` is an error.
    pub fn decode(&self, tokens: &[u32]) -> Result<String> {
        tokens
            .iter()
            .map(|&t| {
                self.chars.get(t as usize).copied().ok_or_else(|| {
                    data_error("token ids", format!("id {t} is out of range; the vocabulary has {}", self.len()))
                })
            })
            .collect()
    }
}

/// A tokenized corpus cut into a training stream and a held-out stream (the end of the text).
#[derive(Clone, Debug, PartialEq)]
pub struct LmCorpus {
    /// The vocabulary, over the whole text.
    pub vocab: CharVocab,
    /// Token ids of the first part.
    pub train: Vec<u32>,
    /// Token ids of the last `held_out_fraction` of the characters.
    pub held_out: Vec<u32>,
}

impl LmCorpus {
    /// Tokenizes `text` and holds out its last `floor(chars · held_out_fraction)` characters.
    /// `held_out_fraction` must be in [0, 1).
    pub fn from_text(text: &str, held_out_fraction: f64) -> Result<Self> {
        if !(0.0..1.0).contains(&held_out_fraction) {
            return Err(config_error("held_out_fraction", format!("is {held_out_fraction}, expected [0, 1)")));
        }
        let vocab = CharVocab::from_text(text)?;
        let mut train = vocab.encode(text)?;
        let cut = train.len() - (train.len() as f64 * held_out_fraction) as usize;
        let held_out = train.split_off(cut);
        Ok(Self { vocab, train, held_out })
    }
    /// Tokenizes a training text and a held-out one, the vocabulary over both (so the
    /// held-out part meets no unknown character).
    pub fn from_parts(train: &str, held_out: &str) -> Result<Self> {
        let vocab = CharVocab::from_text(&[train, held_out].concat())?;
        Ok(Self { train: vocab.encode(train)?, held_out: vocab.encode(held_out)?, vocab })
    }
    /// Training sequences of `seq_len` ([`lm_sequences`], ids from 0).
    pub fn train_sequences(&self, seq_len: usize) -> Result<Vec<LmSequence>> {
        lm_sequences(&self.train, seq_len, 0)
    }
    /// Held-out sequences of `seq_len` (ids from [`TEST_FILE_ID_BASE`]).
    pub fn held_out_sequences(&self, seq_len: usize) -> Result<Vec<LmSequence>> {
        lm_sequences(&self.held_out, seq_len, TEST_FILE_ID_BASE)
    }
}

/// Hamlet ([`HAMLET_FILE`]) as a character-level corpus, the last [`HELD_OUT_FRACTION`] held out.
pub fn hamlet(data_dir: impl AsRef<Path>) -> Result<LmCorpus> {
    char_corpus_file(&data_dir.as_ref().join(HAMLET_FILE), HELD_OUT_FRACTION)
}

/// A UTF-8 text file as a character-level corpus ([`LmCorpus::from_text`]).
pub fn char_corpus_file(path: &Path, held_out_fraction: f64) -> Result<LmCorpus> {
    LmCorpus::from_text(&corpus_text(path, SetupGroup::Text)?, held_out_fraction)
}

/// A user's text (`dataset = "text_corpus"`) as a character-level corpus: held out, the
/// `held_out` file where given, else the last [`HELD_OUT_FRACTION`] of `train`. Gzip or bzip2
/// by name or by the first bytes.
pub fn user_corpus_files(train: &Path, held_out: Option<&Path>) -> Result<LmCorpus> {
    let text = corpus_text(train, SetupGroup::User)?;
    match held_out {
        Some(path) => LmCorpus::from_parts(&text, &corpus_text(path, SetupGroup::User)?),
        None => LmCorpus::from_text(&text, HELD_OUT_FRACTION),
    }
}

fn corpus_text(path: &Path, group: SetupGroup) -> Result<String> {
    let text = read_text(path, group)?;
    if text.is_empty() {
        return Err(dataset_error(path, None, "is empty; expected text"));
    }
    Ok(text)
}

/// One language-model training sequence.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LmSequence {
    /// Stable id: `id_base` + the sequence's index in its stream.
    pub id: u64,
    /// Tokens `start .. start + seq_len`.
    pub input: Vec<u32>,
    /// Tokens `start + 1 .. start + seq_len + 1` (the next token at each position).
    pub target: Vec<u32>,
}

/// Cuts `tokens` into non-overlapping sequences: sequence `k` reads tokens
/// `k·seq_len .. (k+1)·seq_len` and predicts the same window shifted by one, so
/// `(len − 1) / seq_len` sequences, the tail that does not fill one dropped. Ids are
/// `id_base + k`. Errors if `seq_len` is 0 or the stream is too short for one sequence.
pub fn lm_sequences(tokens: &[u32], seq_len: usize, id_base: u64) -> Result<Vec<LmSequence>> {
    if seq_len == 0 {
        return Err(config_error("seq_len", "is 0; expected at least 1"));
    }
    let n = tokens.len().saturating_sub(1) / seq_len;
    if n == 0 {
        return Err(data_error(
            "token stream",
            format!("has {} tokens, expected at least {} for one sequence of {seq_len}", tokens.len(), seq_len + 1),
        ));
    }
    Ok((0..n)
        .map(|k| {
            let s = k * seq_len;
            LmSequence {
                id: id_base + k as u64,
                input: tokens[s..s + seq_len].to_vec(),
                target: tokens[s + 1..s + seq_len + 1].to_vec(),
            }
        })
        .collect())
}

/// A GPT batch of equal-length sequences: `tokens` and `targets` `[B, T]`, no padding.
pub fn lm_batch(sequences: &[&LmSequence], sample_offset: u64) -> Result<HostBatch> {
    let Some(first) = sequences.first() else {
        return Err(data_error("language-model batch", "is empty; expected at least one sequence"));
    };
    let t = first.input.len();
    let mut tokens = Vec::with_capacity(sequences.len() * t);
    let mut targets = Vec::with_capacity(sequences.len() * t);
    for s in sequences {
        if s.input.len() != t || s.target.len() != t {
            return Err(data_error(
                "language-model batch",
                format!(
                    "sequence id {} has {} inputs and {} targets; expected {t} of each",
                    s.id,
                    s.input.len(),
                    s.target.len()
                ),
            ));
        }
        tokens.extend_from_slice(&s.input);
        targets.extend_from_slice(&s.target);
    }
    Ok(HostBatch {
        batch: sequences.len(),
        seq: t,
        tokens: Some(tokens),
        targets,
        sample_offset,
        sample_ids: sequences.iter().map(|s| s.id).collect(),
        ..Default::default()
    })
}
