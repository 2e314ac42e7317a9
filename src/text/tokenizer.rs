//! `TextTokenizer`: a `tokenizer.json` loaded with the `tokenizers` crate, with our truncation
//! (to `max_len`, special tokens kept) and without padding.

use std::path::Path;

use tokenizers::processors::PostProcessorWrapper;
use tokenizers::{
    EncodeInput, Encoding, PostProcessor, Tokenizer, TruncationDirection, TruncationParams, TruncationStrategy,
};

use crate::error::{Error, Result, config_error};

/// One input to a sequence classifier: a single text, or a pair (e.g. question and passage,
/// premise and hypothesis) that the tokenizer joins as `[CLS] a [SEP] b [SEP]`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TextInput<'a> {
    /// One segment; every token gets type id 0.
    Single(&'a str),
    /// Two segments; the first gets type id 0, the second type id 1.
    Pair(&'a str, &'a str),
}

impl<'a> From<TextInput<'a>> for EncodeInput<'a> {
    fn from(input: TextInput<'a>) -> Self {
        match input {
            TextInput::Single(a) => EncodeInput::Single(a.into()),
            TextInput::Pair(a, b) => EncodeInput::Dual(a.into(), b.into()),
        }
    }
}

/// One tokenised input, unpadded: special tokens included, at most `max_len` ids.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Encoded {
    /// Token ids, e.g. `[101, 7592, 2088, 102]` for "hello world" with MiniLM.
    pub ids: Vec<u32>,
    /// Token-type (segment) ids, one per id.
    pub type_ids: Vec<u32>,
    /// Whether tokens were dropped to fit `max_len`.
    pub truncated: bool,
    /// How many of the ids are the text's, not special tokens the template adds: 0 for a
    /// text the tokenizer reads nothing of (spaces, control or zero-width characters).
    pub text_tokens: usize,
}

/// A Hugging Face `tokenizer.json` (normaliser, pre-tokeniser, WordPiece/BPE model and the
/// `[CLS] … [SEP]` template) with the file's padding switched off and truncation set to
/// `max_len`. Batches are padded later, to their longest sample ([`text_batch`](super::text_batch)).
#[derive(Clone, Debug)]
pub struct TextTokenizer {
    inner: Tokenizer,
    file: String,
    max_len: usize,
    pad_id: u32,
    pad_type_id: u32,
}

impl TextTokenizer {
    /// Loads `path` (a `tokenizer.json`) and truncates every encoding to `max_len` ids,
    /// special tokens included.
    ///
    /// Errors: [`Error::Io`] when the file cannot be read, [`Error::Tokenizer`] when it is not
    /// a tokenizer the crate can load or has no padding token, [`Error::Config`] when
    /// `max_len` leaves no room for text beside a pair's special tokens.
    pub fn from_file(path: impl AsRef<Path>, max_len: usize) -> Result<Self> {
        let path = path.as_ref();
        let file = path.display().to_string();
        // Read it ourselves rather than through `Tokenizer::from_file`: a missing file then
        // keeps its `io::ErrorKind`, and only a bad file becomes a tokenizer error.
        let bytes = std::fs::read(path).map_err(|source| Error::Io { path: file.clone(), source })?;
        // Check the JSON syntax first: tokenizers 0.22 panics (`expect("Helper")` in its
        // decoder deserializer) instead of erroring on a syntax error inside `"decoder"`.
        serde_json::from_slice::<serde::de::IgnoredAny>(&bytes)
            .map_err(|e| tokenizer_error(&file, format!("is not valid JSON: {e}")))?;
        let inner = Tokenizer::from_bytes(&bytes)
            .map_err(|e| tokenizer_error(&file, format!("is not a tokenizers JSON file: {e}")))?;
        Self::from_tokenizer(inner, file, max_len)
    }

    /// Wraps an already-built tokenizer; `file` names it in errors.
    fn from_tokenizer(mut inner: Tokenizer, file: String, max_len: usize) -> Result<Self> {
        if let Some(processor) = inner.get_post_processor() {
            check_post_processor(processor, &file)?;
        }
        // The file's padding names the pad token the model was trained with; a file without
        // padding settings falls back to BERT's `[PAD]`.
        let (pad_id, pad_type_id) = match (inner.get_padding(), inner.token_to_id("[PAD]")) {
            (Some(p), _) => (p.pad_id, p.pad_type_id),
            (None, Some(id)) => (id, 0),
            (None, None) => {
                return Err(tokenizer_error(&file, "has no padding settings and no `[PAD]` token; cannot pad batches"));
            }
        };
        // Truncation budgets exclude special tokens, and the crate subtracts them from
        // `max_length` unchecked: fewer than a pair's specials would underflow. Require at
        // least one text token beside them (a file's single template may add more than its
        // pair template, so take the larger count).
        let specials = inner.get_post_processor().map_or(0, |p| p.added_tokens(true).max(p.added_tokens(false)));
        if max_len <= specials {
            return Err(config_error(
                "max_len",
                format!("is {max_len}; it must exceed the {specials} special tokens that a text pair gets"),
            ));
        }
        // `max_length` counts the special tokens, which the crate adds after truncating the
        // text, so `[CLS] … [SEP]` survive. Longest-first trims the longer segment of a pair
        // first (what BERT fine-tuning does); stride 0 because we never use the overflow.
        let truncation = TruncationParams {
            max_length: max_len,
            strategy: TruncationStrategy::LongestFirst,
            stride: 0,
            direction: TruncationDirection::Right,
        };
        inner.with_truncation(Some(truncation)).map_err(|e| tokenizer_error(&file, e.to_string()))?;
        // MiniLM's file pads every encoding to 128; we pad per batch instead.
        inner.with_padding(None);
        Ok(Self { inner, file, max_len, pad_id, pad_type_id })
    }

    /// Encodes one text: `[CLS] text [SEP]`, type ids all 0.
    pub fn encode(&self, text: &str) -> Result<Encoded> {
        self.encode_input(TextInput::Single(text))
    }

    /// Encodes a pair: `[CLS] first [SEP] second [SEP]`, type ids 0 up to the first `[SEP]`,
    /// 1 after it.
    pub fn encode_pair(&self, first: &str, second: &str) -> Result<Encoded> {
        self.encode_input(TextInput::Pair(first, second))
    }

    /// Encodes one input of either kind.
    pub fn encode_input(&self, input: TextInput<'_>) -> Result<Encoded> {
        // `encode_fast` skips the character offsets, which classification never reads.
        let enc = self.inner.encode_fast(input, true).map_err(|e| tokenizer_error(&self.file, e.to_string()))?;
        self.encoded(enc)
    }

    /// Encodes many inputs, in order. The crate may spread them over rayon's global pool;
    /// results are collected by index, so ids do not depend on thread count or timing.
    pub fn encode_batch(&self, inputs: &[TextInput<'_>]) -> Result<Vec<Encoded>> {
        let encodings = self
            .inner
            .encode_batch_fast(inputs.to_vec(), true)
            .map_err(|e| tokenizer_error(&self.file, e.to_string()))?;
        encodings.into_iter().map(|e| self.encoded(e)).collect()
    }

    /// Our view of a crate encoding (truncation leaves the dropped tokens in `overflowing`),
    /// checked against `max_len`: the crate's truncation trusts the post-processor's count of
    /// the tokens it adds, and the model's position table ends at `max_len`.
    fn encoded(&self, enc: Encoding) -> Result<Encoded> {
        if enc.len() > self.max_len {
            return Err(tokenizer_error(
                &self.file,
                format!(
                    "produced {} ids, more than max_len = {}: its post_processor adds tokens that truncation did not \
                     leave room for",
                    enc.len(),
                    self.max_len
                ),
            ));
        }
        Ok(Encoded {
            truncated: !enc.get_overflowing().is_empty(),
            text_tokens: enc.get_special_tokens_mask().iter().filter(|&&special| special == 0).count(),
            ids: enc.get_ids().to_vec(),
            type_ids: enc.get_type_ids().to_vec(),
        })
    }

    /// Longest encoding, special tokens included.
    pub fn max_len(&self) -> usize {
        self.max_len
    }

    /// Id used for padding positions (`[PAD]` = 0 for MiniLM), from the file.
    pub fn pad_id(&self) -> u32 {
        self.pad_id
    }

    /// Token-type id of padding positions, from the file (0 when it sets none).
    pub fn pad_type_id(&self) -> u32 {
        self.pad_type_id
    }

    /// The rows a model's embedding table needs for every id this tokenizer gives: its largest
    /// id, added tokens included, plus one (30522 for MiniLM). Not the count of tokens, which
    /// is smaller when ids have gaps.
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab(true).values().max().map_or(0, |&id| id as usize + 1)
    }

    /// Id of a token string such as `[CLS]`, if the vocabulary has it.
    pub fn token_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// The file this tokenizer was loaded from.
    pub fn file(&self) -> &str {
        &self.file
    }
}

/// Checks what the crate checks only when a template is built in code, not when one is read
/// from a file, for every `TemplateProcessing` post-processor (alone or inside a `Sequence`):
/// each special token a template uses is defined in its `special_tokens` (else the first
/// encoding panics, "no entry found for key"), and the single template holds sequence A
/// once and B never, the pair template A and B once each (B in a single template indexes
/// past the one encoding and panics; a repeated sequence escapes truncation).
fn check_post_processor(processor: &PostProcessorWrapper, file: &str) -> Result<()> {
    // Through the serialised form: the crate keeps the template pieces private.
    let json = serde_json::to_value(processor)
        .map_err(|e| tokenizer_error(file, format!("cannot inspect its post_processor: {e}")))?;
    check_templates(&json, file)
}

fn check_templates(processor: &serde_json::Value, file: &str) -> Result<()> {
    match processor.get("type").and_then(serde_json::Value::as_str) {
        Some("TemplateProcessing") => {
            let defined = processor.get("special_tokens").and_then(serde_json::Value::as_object);
            for (which, want_b) in [("single", 0), ("pair", 1)] {
                let pieces: Vec<_> =
                    processor.get(which).and_then(serde_json::Value::as_array).into_iter().flatten().collect();
                let count = |seq: &str| {
                    pieces
                        .iter()
                        .filter(|p| p.pointer("/Sequence/id").and_then(serde_json::Value::as_str) == Some(seq))
                        .count()
                };
                let (a, b) = (count("A"), count("B"));
                if (a, b) != (1, want_b) {
                    return Err(tokenizer_error(
                        file,
                        format!(
                            "post_processor: the `{which}` template holds sequence A {a} times and B {b} times; \
                             expected A once{}",
                            if want_b == 1 { " and B once" } else { " and no B" }
                        ),
                    ));
                }
                for piece in pieces {
                    let Some(id) = piece.pointer("/SpecialToken/id").and_then(serde_json::Value::as_str) else {
                        continue;
                    };
                    if !defined.is_some_and(|d| d.contains_key(id)) {
                        return Err(tokenizer_error(
                            file,
                            format!(
                                "post_processor: the `{which}` template uses special token `{id}`, which its \
                                 `special_tokens` does not define"
                            ),
                        ));
                    }
                }
            }
            Ok(())
        }
        Some("Sequence") => {
            let mut inner = processor.get("processors").and_then(serde_json::Value::as_array).into_iter().flatten();
            inner.try_for_each(|p| check_templates(p, file))
        }
        _ => Ok(()),
    }
}

fn tokenizer_error(file: &str, message: impl Into<String>) -> Error {
    Error::Tokenizer { file: file.to_string(), message: message.into() }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// A 20-token WordPiece tokenizer (tests/fixtures/make_tiny_tokenizer.py) that, like
    /// MiniLM's, bakes in padding (Fixed 16) and truncation (6).
    pub(crate) const TINY_JSON: &str = include_str!("../../tests/fixtures/tiny_tokenizer.json");
    pub(crate) const CLS: u32 = 2;
    pub(crate) const SEP: u32 = 3;

    /// The tiny tokenizer after `edit` on its JSON.
    fn tiny_edited(max_len: usize, edit: impl FnOnce(&mut serde_json::Value)) -> Result<TextTokenizer> {
        let mut json: serde_json::Value = serde_json::from_str(TINY_JSON).unwrap();
        edit(&mut json);
        let inner = Tokenizer::from_bytes(serde_json::to_vec(&json).unwrap()).unwrap();
        TextTokenizer::from_tokenizer(inner, "tiny_tokenizer.json".into(), max_len)
    }

    pub(crate) fn tiny(max_len: usize) -> TextTokenizer {
        tiny_edited(max_len, |_| {}).unwrap()
    }

    #[test]
    fn single_text_matches_python_and_ignores_baked_in_padding_and_truncation() {
        // Ids from the Python `tokenizers` package on the same file. 10 ids: longer than the
        // file's truncation (6), shorter than its padding (16).
        let e = tiny(32).encode("The cats sat on a mat.").unwrap();
        assert_eq!(e.ids, [CLS, 6, 7, 11, 8, 9, 12, 10, 13, SEP]);
        assert_eq!(e.type_ids, [0; 10]);
        assert!(!e.truncated);
        // Unknown words map to [UNK] (1); punctuation splits; case is folded.
        assert_eq!(tiny(32).encode("Hello, big red dog!").unwrap().ids, [CLS, 4, 14, 18, 19, 15, 1, SEP]);
    }

    #[test]
    fn pair_has_segment_type_ids() {
        let e = tiny(32).encode_pair("the cat sat", "hello world").unwrap();
        assert_eq!(e.ids, [CLS, 6, 7, 8, SEP, 4, 5, SEP]);
        assert_eq!(e.type_ids, [0, 0, 0, 0, 0, 1, 1, 1]);
        assert_eq!(tiny(32).encode_input(TextInput::Pair("the cat sat", "hello world")).unwrap(), e);
    }

    #[test]
    fn truncation_keeps_cls_and_sep() {
        let e = tiny(5).encode("the cat sat on a mat").unwrap();
        assert_eq!(e.ids, [CLS, 6, 7, 8, SEP]);
        assert!(e.truncated);
        // Exactly max_len: nothing dropped.
        let e = tiny(5).encode("the cat sat").unwrap();
        assert_eq!(e.ids.len(), 5);
        assert!(!e.truncated);
    }

    #[test]
    fn pair_truncation_trims_the_longer_segment_first() {
        // 2 + 5 text tokens, 3 specials, max 8: only 5 text tokens fit; the second (longer)
        // segment loses two.
        let e = tiny(8).encode_pair("hello world", "the cat sat on a").unwrap();
        assert_eq!(e.ids, [CLS, 4, 5, SEP, 6, 7, 8, SEP]);
        assert_eq!(e.type_ids, [0, 0, 0, 0, 1, 1, 1, 1]);
        assert!(e.truncated);
    }

    #[test]
    fn max_len_must_leave_room_for_text() {
        // A pair has 3 special tokens; 3 would leave none for text (and fewer would underflow
        // inside the crate).
        for max_len in [0, 1, 3] {
            match tiny_edited(max_len, |_| {}) {
                Err(Error::Config { field, message }) => {
                    assert_eq!(field, "max_len");
                    assert!(message.contains("3 special tokens"), "{message}");
                }
                other => panic!("max_len {max_len}: expected a config error, got {other:?}"),
            }
        }
        let e = tiny(4).encode_pair("hello world", "the cat").unwrap();
        assert_eq!(e.ids.len(), 4);
        assert_eq!((e.ids[0], e.ids[3]), (CLS, SEP));
    }

    #[test]
    fn pad_id_comes_from_the_file() {
        let t = tiny(8);
        assert_eq!((t.pad_id(), t.pad_type_id(), t.max_len(), t.vocab_size()), (0, 0, 8, 20));
        assert_eq!((t.token_id("[CLS]"), t.token_id("[SEP]"), t.token_id("zebra")), (Some(CLS), Some(SEP), None));
        // The file's padding settings win over the `[PAD]` token...
        let t = tiny_edited(8, |j| j["padding"]["pad_id"] = 19.into()).unwrap();
        assert_eq!(t.pad_id(), 19);
        // ...which is the fallback when the file sets no padding...
        let t = tiny_edited(8, |j| j["padding"] = serde_json::Value::Null).unwrap();
        assert_eq!(t.pad_id(), 0);
        // ...and with neither there is nothing to pad with.
        let no_pad = |j: &mut serde_json::Value| {
            j["padding"] = serde_json::Value::Null;
            j["added_tokens"].as_array_mut().unwrap().remove(0);
            j["model"]["vocab"].as_object_mut().unwrap().remove("[PAD]");
        };
        match tiny_edited(8, no_pad) {
            Err(Error::Tokenizer { file, message }) => {
                assert_eq!(file, "tiny_tokenizer.json");
                assert!(message.contains("[PAD]"), "{message}");
            }
            other => panic!("expected a tokenizer error, got {other:?}"),
        }
    }

    fn tokenizer_error_message(result: Result<TextTokenizer>) -> String {
        match result {
            Err(Error::Tokenizer { message, .. }) => message,
            other => panic!("expected a tokenizer error, got {other:?}"),
        }
    }

    /// Found by fuzzing (src/fuzz): tokenizers 0.22 panics ("Helper") instead of erroring on
    /// a JSON syntax error inside `"decoder"`; we check the syntax before handing it over.
    #[test]
    fn a_syntax_error_inside_the_decoder_is_an_error_not_a_panic() {
        let dir = crate::files::Scratch::new("tokenizer");
        let path = dir.join("bad-decoder.json");
        std::fs::write(&path, TINY_JSON.replace("\"decoder\": null", "\"decoder\": nul")).unwrap();
        let message = tokenizer_error_message(TextTokenizer::from_file(&path, 8));
        assert!(message.contains("is not valid JSON") && message.contains("line 142"), "{message}");
    }

    /// Found by fuzzing: templates read from a file are not validated by the crate. A special
    /// token missing from `special_tokens` panicked on the first encoding; sequence B in the
    /// single template panicked (index out of bounds); a repeated sequence, or a single
    /// template with more special tokens than the pair template, escaped truncation and gave
    /// encodings longer than `max_len`.
    #[test]
    fn post_processor_templates_are_checked_when_loaded() {
        let template =
            |which: &str, j: &mut serde_json::Value| j["post_processor"][which].as_array_mut().unwrap().clone();
        let message = tokenizer_error_message(tiny_edited(8, |j| {
            j["post_processor"]["pair"][4]["SpecialToken"]["id"] = "[SkP]".into();
        }));
        assert!(message.contains("the `pair` template uses special token `[SkP]`"), "{message}");

        let message = tokenizer_error_message(tiny_edited(8, |j| {
            let mut single = template("single", j);
            single.push(serde_json::json!({"Sequence": {"id": "B", "type_id": 1}}));
            j["post_processor"]["single"] = single.into();
        }));
        assert!(message.contains("`single` template holds sequence A 1 times and B 1 times"), "{message}");

        let message = tokenizer_error_message(tiny_edited(8, |j| {
            let mut pair = template("pair", j);
            let again = pair[2..5].to_vec();
            pair.extend(again);
            j["post_processor"]["pair"] = pair.into();
        }));
        assert!(message.contains("`pair` template holds sequence A 1 times and B 2 times"), "{message}");

        // Five special tokens around a single text, three around a pair: max_len 4 leaves
        // no room (the crate's `4 - 5` wrapped and switched truncation off).
        let five_cls = |j: &mut serde_json::Value| {
            let mut single = template("single", j);
            for _ in 0..3 {
                single.insert(0, single[0].clone());
            }
            j["post_processor"]["single"] = single.into();
        };
        match tiny_edited(4, five_cls) {
            Err(Error::Config { field, message }) => {
                assert_eq!(field, "max_len");
                assert!(message.contains("5 special tokens"), "{message}");
            }
            other => panic!("expected a config error, got {other:?}"),
        }
        let t = tiny_edited(6, five_cls).unwrap();
        assert_eq!(t.encode("the cat sat on a mat").unwrap().ids, [CLS, CLS, CLS, CLS, 6, SEP]);
    }

    #[test]
    fn batch_encoding_equals_one_by_one() {
        let t = tiny(6);
        let inputs = [
            TextInput::Single("hello world"),
            TextInput::Pair("the cat", "sat on a mat"),
            TextInput::Single("the cat sat on a mat"),
            TextInput::Single(""),
        ];
        let batch = t.encode_batch(&inputs).unwrap();
        let one_by_one: Vec<Encoded> = inputs.iter().map(|&i| t.encode_input(i).unwrap()).collect();
        assert_eq!(batch, one_by_one);
        assert_eq!(batch[3].ids, [CLS, SEP]);
        assert!(t.encode_batch(&[]).unwrap().is_empty());
    }
}
