//! The files an export carries beside the weights and `config.json`, so that the folder is
//! self-contained for the Python ecosystem and for our own `predict`:
//!
//! | family | files | read by |
//! |---|---|---|
//! | BERT | the pretrained model's `tokenizer.json` (+ `vocab.txt`, `tokenizer_config.json`, `special_tokens_map.json` when present) | `AutoTokenizer`, our `TextTokenizer` |
//! | BERT with a tokenizer | `modules.json`, `sentence_bert_config.json`, `1_Pooling/config.json` | `SentenceTransformer(dir)` |
//! | GPT with a character vocabulary | `vocab.json` (`{"c": id}`), `tokenizer.json` (WordLevel over single characters), `tokenizer_config.json` | our `predict`; `AutoTokenizer` / `PreTrainedTokenizerFast` |
//! | ViT | `preprocessor_config.json` | `ViTImageProcessor` |

use std::io::Write;
use std::path::{Path, PathBuf};

use serde_json::{Value, json};

use crate::error::{Error, Result, config_error};
use crate::files::write_atomic;
use crate::model::{BertConfig, GptConfig, ModelConfig, Pooling, VitConfig};

/// A GPT's character vocabulary, for our `predict` (`{"<char>": id}`).
pub const VOCAB_FILE: &str = "vocab.json";
/// A Hugging Face `tokenizers` file.
pub const TOKENIZER_FILE: &str = "tokenizer.json";
/// `ViTImageProcessor`'s configuration.
pub const PREPROCESSOR_FILE: &str = "preprocessor_config.json";
/// sentence-transformers' settings, `max_seq_length` among them (BERT with a tokenizer).
pub const SENTENCE_CONFIG_FILE: &str = "sentence_bert_config.json";
/// sentence-transformers' module list.
pub const MODULES_FILE: &str = "modules.json";
/// Tokenizer files copied from a pretrained BERT's directory when present (`tokenizer.json`
/// is required and copied first).
const OPTIONAL_TOKENIZER_FILES: [&str; 3] = ["vocab.txt", "tokenizer_config.json", "special_tokens_map.json"];
/// The pixel value our image loaders map to 1.0 unless told otherwise (8-bit images).
const DEFAULT_PIXEL_MAX: u32 = 255;

/// What an export needs besides the model: the data it was trained on and where its tokenizer
/// came from. `ExportExtras::default()` exports the weights and configs alone.
#[derive(Clone, Copy, Debug, Default)]
pub struct ExportExtras<'a> {
    /// Class names by label (classifiers): written as `id2label`/`label2id`. Empty, or one
    /// name per class.
    pub labels: &'a [String],
    /// A BERT's pretrained directory, holding the `tokenizer.json` it was trained with (and
    /// possibly `vocab.txt`, `tokenizer_config.json`, `special_tokens_map.json`); ignored for
    /// other families.
    pub tokenizer_dir: Option<&'a Path>,
    /// A character-level GPT's vocabulary by token id (empty otherwise): `vocab_size` distinct
    /// characters.
    pub chars: &'a [char],
    /// The longest input the run trained on (tokens): sentence-transformers' `max_seq_length`,
    /// capped at the model's positions; `None` means the model's positions.
    pub max_seq_length: Option<usize>,
    /// The raw pixel value the image data maps to 1.0 (pixels were `value / pixel_max`): 255
    /// for 8-bit images (the default), 16 for scikit-learn's digits.
    pub pixel_max: Option<u32>,
    /// Whether the images were resized to the model's `image_size` (PIL's bilinear filter), so
    /// that images of other sizes are resized alike.
    pub resize: bool,
    /// The settings that chose the samples the model trained on (dataset, split seed,
    /// fractions), written into `config.json` as [`TRAINED_ON_KEY`], so an evaluation on a split
    /// that holds some of them can be refused.
    pub trained_on: Option<&'a serde_json::Value>,
}

/// The key of [`ExportExtras::trained_on`] in `config.json` (Hugging Face keeps unknown keys as
/// attributes of the config).
pub const TRAINED_ON_KEY: &str = "pipetransformer_trained_on";

/// Writes `value` as pretty JSON to `path`, atomically.
pub(crate) fn write_json(path: &Path, value: &Value) -> Result<()> {
    write_atomic(path, |w| {
        serde_json::to_writer_pretty(&mut *w, value).map_err(std::io::Error::other)?;
        w.write_all(b"\n")
    })
}

/// Writes the companion files of `config`'s family into `dir`; returns their paths.
pub(crate) fn write_companions(config: &ModelConfig, extras: &ExportExtras<'_>, dir: &Path) -> Result<Vec<PathBuf>> {
    match config {
        ModelConfig::Bert(c) => bert_files(c, extras, dir),
        ModelConfig::Gpt(c) => gpt_files(c, extras.chars, dir),
        ModelConfig::Vit(c) => vit_files(c, extras.pixel_max, extras.resize, dir),
    }
}

/// BERT: the tokenizer files, then (with a tokenizer, which sentence-transformers cannot load
/// a model without) the sentence-transformers layout.
fn bert_files(c: &BertConfig, extras: &ExportExtras<'_>, dir: &Path) -> Result<Vec<PathBuf>> {
    let Some(source) = extras.tokenizer_dir else { return Ok(Vec::new()) };
    let mut written = copy_tokenizer(source, dir)?;
    let max_seq = extras.max_seq_length.map_or(c.max_position_embeddings, |n| n.min(c.max_position_embeddings));
    written.extend(sentence_transformers_files(c.hidden_size, c.pooling, max_seq, dir)?);
    Ok(written)
}

/// Copies `tokenizer.json` (required) and the optional tokenizer files from `source`.
fn copy_tokenizer(source: &Path, dir: &Path) -> Result<Vec<PathBuf>> {
    let required = source.join(TOKENIZER_FILE);
    if !required.is_file() {
        return Err(Error::Io {
            path: required.display().to_string(),
            source: std::io::Error::new(
                std::io::ErrorKind::NotFound,
                "the pretrained model's tokenizer is needed for the export, expected a tokenizers JSON file here",
            ),
        });
    }
    let mut written = vec![copy_file(&required, &dir.join(TOKENIZER_FILE))?];
    for name in OPTIONAL_TOKENIZER_FILES {
        let from = source.join(name);
        if from.is_file() {
            written.push(copy_file(&from, &dir.join(name))?);
        }
    }
    Ok(written)
}

fn copy_file(from: &Path, to: &Path) -> Result<PathBuf> {
    let bytes = std::fs::read(from).map_err(|source| crate::files::io_error(from, source))?;
    write_atomic(to, |w| w.write_all(&bytes))?;
    Ok(to.to_path_buf())
}

/// `modules.json` (a Transformer at the root, a Pooling module in `1_Pooling`),
/// `sentence_bert_config.json` and `1_Pooling/config.json`.
///
/// sentence-transformers pools the encoder's last hidden states: our mean pooling and our
/// plain `[CLS]` pooling map onto its `mean_tokens` and `cls_token` modes exactly. Our
/// `[CLS]` pooler (`tanh(dense(h[CLS]))`, what BERT's classifier reads) has no Pooling mode:
/// it gets `cls_token`, so `SentenceTransformer(dir).encode` gives the `[CLS]` hidden state,
/// not the pooler's output.
fn sentence_transformers_files(hidden: usize, pooling: Pooling, max_seq: usize, dir: &Path) -> Result<Vec<PathBuf>> {
    let modules = json!([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
    ]);
    let mean = pooling == Pooling::Mean;
    let pooling_config = json!({
        "word_embedding_dimension": hidden,
        "pooling_mode_cls_token": !mean,
        "pooling_mode_mean_tokens": mean,
        "pooling_mode_max_tokens": false,
        "pooling_mode_mean_sqrt_len_tokens": false,
        "pooling_mode_weightedmean_tokens": false,
        "pooling_mode_lasttoken": false,
        "include_prompt": true,
    });
    let pooling_dir = dir.join("1_Pooling");
    std::fs::create_dir_all(&pooling_dir).map_err(|source| crate::files::io_error(&pooling_dir, source))?;
    let files = [
        (dir.join(MODULES_FILE), modules),
        (dir.join(SENTENCE_CONFIG_FILE), json!({"max_seq_length": max_seq, "do_lower_case": false})),
        (pooling_dir.join("config.json"), pooling_config),
    ];
    files
        .into_iter()
        .map(|(path, value)| {
            write_json(&path, &value)?;
            Ok(path)
        })
        .collect()
}

/// GPT with a character vocabulary: `vocab.json`, a `tokenizer.json` that splits text into
/// single characters and looks each up in that vocabulary, and a `tokenizer_config.json` so
/// that `AutoTokenizer.from_pretrained(dir)` loads it without altering decoded text.
fn gpt_files(c: &GptConfig, chars: &[char], dir: &Path) -> Result<Vec<PathBuf>> {
    if chars.is_empty() {
        return Ok(Vec::new());
    }
    let vocab = char_vocab(chars, c.vocab_size)?;
    let tokenizer = char_tokenizer_json(vocab.clone());
    let tokenizer_config = json!({
        "tokenizer_class": "PreTrainedTokenizerFast",
        // Otherwise decode() may drop the space before punctuation: every character matters here.
        "clean_up_tokenization_spaces": false,
        "model_max_length": c.n_positions,
    });
    let files = [
        (dir.join(VOCAB_FILE), vocab),
        (dir.join(TOKENIZER_FILE), tokenizer),
        (dir.join("tokenizer_config.json"), tokenizer_config),
    ];
    files
        .into_iter()
        .map(|(path, value)| {
            write_json(&path, &value)?;
            Ok(path)
        })
        .collect()
}

/// `{"<char>": id}` for `chars` (id = index), which must be `vocab_size` distinct characters.
pub(crate) fn char_vocab(chars: &[char], vocab_size: usize) -> Result<Value> {
    if chars.len() != vocab_size {
        return Err(config_error(
            "chars",
            format!("{} characters for a model with vocab_size = {vocab_size}; expected one per token id", chars.len()),
        ));
    }
    let mut vocab = serde_json::Map::new();
    for (id, ch) in chars.iter().enumerate() {
        if vocab.insert(ch.to_string(), id.into()).is_some() {
            return Err(config_error("chars", format!("character {ch:?} appears twice; expected distinct characters")));
        }
    }
    Ok(Value::Object(vocab))
}

/// A `tokenizers` JSON file: every character its own piece (a `Split` on the regex `[\s\S]`,
/// which unlike `.` also matches newlines, in every regex engine the library builds with),
/// looked up in `vocab` by a WordLevel model; decoding fuses the pieces without spaces. A
/// character outside the vocabulary is an error there (the unknown token is not in the
/// vocabulary), as it is for our model.
pub(crate) fn char_tokenizer_json(vocab: Value) -> Value {
    json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": [],
        "normalizer": null,
        "pre_tokenizer": {"type": "Split", "pattern": {"Regex": "[\\s\\S]"}, "behavior": "Isolated", "invert": false},
        "post_processor": null,
        "decoder": {"type": "Fuse"},
        "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "<unk>"},
    })
}

/// `preprocessor_config.json` describing what the model was fed: the image as is, or where
/// `resize`, resized to `size` (the model's `image_size`) by PIL's bilinear filter (`resample`
/// 2); `value / pixel_max` (so pixels lie in [0, 1]), no normalisation (mean 0, std 1 per
/// channel), and conversion to RGB for a 3-channel model only (a grayscale image then reads
/// as its plane three times, as the run's image folders and `predict` read it; a 1-channel
/// model takes grayscale).
fn vit_files(c: &VitConfig, pixel_max: Option<u32>, resize: bool, dir: &Path) -> Result<Vec<PathBuf>> {
    let max = pixel_max.unwrap_or(DEFAULT_PIXEL_MAX);
    if max == 0 {
        return Err(config_error("pixel_max", "is 0; expected the raw pixel value that maps to 1.0 (e.g. 255)"));
    }
    let config = json!({
        "image_processor_type": "ViTImageProcessor",
        "do_resize": resize,
        "size": {"height": c.image_size, "width": c.image_size},
        "resample": 2,
        "do_rescale": true,
        "rescale_factor": 1.0 / max as f64,
        "do_normalize": false,
        "image_mean": vec![0.0; c.num_channels],
        "image_std": vec![1.0; c.num_channels],
        "do_convert_rgb": c.num_channels == 3,
    });
    let path = dir.join(PREPROCESSOR_FILE);
    write_json(&path, &config)?;
    Ok(vec![path])
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The character tokenizer encodes with exactly our ids (newlines and spaces included)
    /// and decodes back to the text, in the same `tokenizers` library Python uses.
    #[test]
    fn char_tokenizer_matches_our_ids() {
        let chars: Vec<char> = ['\n', ' ', '!', 'a', 'b', 'é'].into();
        let vocab = char_vocab(&chars, chars.len()).unwrap();
        let json = char_tokenizer_json(vocab).to_string();
        let tok = tokenizers::Tokenizer::from_bytes(json.as_bytes()).unwrap();
        let text = "ab a!\n\né b";
        let ids = tok.encode(text, false).unwrap().get_ids().to_vec();
        let ours: Vec<u32> = text.chars().map(|c| chars.iter().position(|&x| x == c).unwrap() as u32).collect();
        assert_eq!(ids, ours);
        assert_eq!(tok.decode(&ids, false).unwrap(), text);
        assert!(tok.encode("z", false).is_err(), "an unknown character must not pass silently");
    }

    #[test]
    fn char_vocab_must_fit_the_model() {
        let e = char_vocab(&['a', 'b'], 3).unwrap_err().to_string();
        assert!(e.contains("2 characters for a model with vocab_size = 3"), "{e}");
        let e = char_vocab(&['a', 'a'], 2).unwrap_err().to_string();
        assert!(e.contains("'a' appears twice"), "{e}");
    }
}
