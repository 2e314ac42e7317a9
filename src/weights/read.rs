//! Reading an exported model directory back: the config, the class names, the tokenizer and
//! the character vocabulary, each checked against the config, so that a `predict` can rebuild
//! the model ([`crate::model::Model::new_for_loading`] + [`super::load_into_model`]) and decode
//! its output.

use std::path::{Path, PathBuf};

use serde_json::{Map, Value};

use super::companions::{PREPROCESSOR_FILE, SENTENCE_CONFIG_FILE, TOKENIZER_FILE, VOCAB_FILE};
use super::export::{CONFIG_FILE, WEIGHTS_FILE};
use super::hf_config::{num_labels, parse_hf_config};
use super::safetensors::load_safetensors;
use crate::error::{Error, Result};
use crate::model::ModelConfig;

/// An exported model directory, read and checked by [`read_export`].
#[derive(Clone, Debug, PartialEq)]
pub struct ExportedModel {
    /// The directory.
    pub dir: PathBuf,
    /// The model's configuration (`config.json`).
    pub config: ModelConfig,
    /// The weights file (`model.safetensors`; its header has been checked): load it with
    /// [`super::load_safetensors`] and [`super::load_into_model`].
    pub weights: PathBuf,
    /// Class names by label (`id2label`); empty for a language model, or a classifier
    /// exported without names.
    pub labels: Vec<String>,
    /// The `tokenizer.json` beside the model, if there is one (a BERT's WordPiece tokenizer,
    /// a character GPT's character tokenizer).
    pub tokenizer: Option<PathBuf>,
    /// A character-level GPT's vocabulary by token id (`vocab.json`); empty otherwise.
    pub chars: Vec<char>,
    /// What raw pixel values are multiplied by before the model sees them (ViT:
    /// `preprocessor_config.json`'s `rescale_factor`, e.g. 1/255 or 1/16): always set for a
    /// ViT (an export without that file is refused), `None` for the other families.
    pub pixel_scale: Option<f64>,
    /// Whether images of another size are resized to the model's `image_size` by PIL's
    /// bilinear filter (ViT: `preprocessor_config.json`'s `do_resize`), as the run resized its
    /// images (`data.resize_to`).
    pub resize: bool,
    /// A ViT's per-channel normalisation (`preprocessor_config.json`'s `do_normalize`,
    /// `image_mean`, `image_std`, read as `ViTImageProcessor` reads them), where it is not the
    /// identity; its `scale` is [`pixel_scale`](Self::pixel_scale). This engine's exports have
    /// none (a pretrained model's is folded into its weights as it trains): a model exported
    /// elsewhere may.
    pub normalization: Option<super::PixelTransform>,
    /// The longest input the run trained on, in tokens (`sentence_bert_config.json`'s
    /// `max_seq_length`); `None` without that file.
    pub max_seq_length: Option<usize>,
    /// The settings that chose the samples the model trained on (see
    /// [`super::ExportExtras::trained_on`]); `None` in an export without them.
    pub trained_on: Option<Value>,
}

/// The error for a file of an export that is missing or not what this engine writes: it names
/// the file and says what was expected.
pub(crate) fn export_error(path: &Path, message: impl std::fmt::Display) -> Error {
    Error::Weights { file: path.display().to_string(), tensor: None, message: message.to_string() }
}

/// Reads the export in `dir` (what [`super::export_model`] wrote).
///
/// Errors ([`Error::Weights`] naming the file and what was expected; [`Error::Config`] for a
/// `config.json` that is not valid JSON or not a supported model; [`Error::Io`]): `dir` is
/// not a directory; `config.json` or `model.safetensors` is missing; `config.json` is not
/// valid JSON or not a supported model; the safetensors header is damaged; `id2label` is not
/// `{"0": name, …}` with one name per class (`num_labels`) or disagrees with `label2id`;
/// `vocab.json` is not `{"<char>": id}` with one distinct character per token id
/// (`vocab_size`); a ViT's `preprocessor_config.json` is missing (it alone says what scale
/// the model's pixels were trained at), holds a value `ViTImageProcessor` would not take, or
/// resizes to another size than the model's (or not to a square).
pub fn read_export(dir: impl AsRef<Path>) -> Result<ExportedModel> {
    let dir = dir.as_ref();
    if !dir.is_dir() {
        return Err(export_error(
            dir,
            "is not a directory; expected an exported model directory (config.json, model.safetensors)",
        ));
    }
    let config_path = dir.join(CONFIG_FILE);
    let weights = dir.join(WEIGHTS_FILE);
    for required in [&config_path, &weights] {
        if !required.is_file() {
            return Err(export_error(
                required,
                "is missing; expected an exported model directory (config.json, model.safetensors)",
            ));
        }
    }
    let text = std::fs::read_to_string(&config_path).map_err(|source| crate::files::io_error(&config_path, source))?;
    let config = parse_hf_config(&text, &config_path.display().to_string(), None)?;
    // The parse above succeeded, so the text is a JSON object.
    let json: Value = serde_json::from_str(&text).map_err(|e| export_error(&config_path, e))?;
    load_safetensors(&weights)?;
    // A reader builds the model from config.json before it reads the weights: a config of more
    // parameters than the weights file has bytes (a stored one takes 2 at least) describes
    // another model, refused before anything that size is allocated.
    let params = config.spec()?.parameter_count().unwrap_or(usize::MAX);
    let bytes = std::fs::metadata(&weights).map_err(|source| crate::files::io_error(&weights, source))?.len();
    if u64::try_from(params).map_or(true, |p| p > bytes) {
        return Err(export_error(
            &config_path,
            format!(
                "describes a model of {params} parameters, more than {WEIGHTS_FILE} beside it has bytes ({bytes}; \
                 a stored parameter takes 2 at least); expected the config these weights were exported with"
            ),
        ));
    }

    let labels = match num_labels(&config) {
        Some(n) => read_labels(&config_path, &json, n)?,
        None => Vec::new(),
    };
    let chars = match &config {
        ModelConfig::Gpt(c) => read_chars(&dir.join(VOCAB_FILE), c.vocab_size)?,
        _ => Vec::new(),
    };
    let (pixel_scale, resize, normalization) = match &config {
        ModelConfig::Vit(c) => {
            let (transform, resize) = read_preprocessing(&dir.join(PREPROCESSOR_FILE), c.image_size, c.num_channels)?;
            let scale = transform.scale;
            (Some(scale), resize, Some(transform).filter(|t| !t.is_identity(1.0 / scale)))
        }
        _ => (None, false, None),
    };
    let tokenizer = Some(dir.join(TOKENIZER_FILE)).filter(|p| p.is_file());
    let max_seq_length = read_max_seq_length(&dir.join(SENTENCE_CONFIG_FILE))?;
    let trained_on = json.get(super::companions::TRAINED_ON_KEY).cloned();
    Ok(ExportedModel {
        dir: dir.to_path_buf(),
        config,
        weights,
        labels,
        tokenizer,
        chars,
        pixel_scale,
        resize,
        normalization,
        max_seq_length,
        trained_on,
    })
}

/// Class names from `id2label` (absent: none), checked against `num_labels` and `label2id`.
fn read_labels(path: &Path, json: &Value, num_labels: usize) -> Result<Vec<String>> {
    let Some(id2label) = json.get("id2label") else { return Ok(Vec::new()) };
    let Some(map) = id2label.as_object() else {
        return Err(export_error(path, "`id2label` is not an object; expected {\"0\": \"name\", …}"));
    };
    if map.len() != num_labels {
        return Err(export_error(
            path,
            format!("`id2label` has {} entries, but num_labels = {num_labels}; expected one name per class", map.len()),
        ));
    }
    let mut labels = Vec::with_capacity(num_labels);
    for id in 0..num_labels {
        let name = map.get(&id.to_string()).and_then(Value::as_str).ok_or_else(|| {
            export_error(
                path,
                format!("`id2label` has no name for class \"{id}\"; expected ids 0..{num_labels} as strings"),
            )
        })?;
        labels.push(name.to_string());
    }
    if let Some(label2id) = json.get("label2id") {
        check_label2id(path, label2id, &labels)?;
    }
    Ok(labels)
}

/// `label2id` must map every name of `id2label` back to its id.
fn check_label2id(path: &Path, label2id: &Value, labels: &[String]) -> Result<()> {
    let Some(map) = label2id.as_object() else {
        return Err(export_error(path, "`label2id` is not an object; expected {\"name\": 0, …}"));
    };
    for (id, name) in labels.iter().enumerate() {
        let got = map.get(name).and_then(Value::as_u64);
        if got != Some(id as u64) {
            let got = map.get(name).map_or_else(|| "nothing".to_string(), Value::to_string);
            return Err(export_error(
                path,
                format!("`label2id` maps `{name}` to {got}, but `id2label` gives it id {id}; expected the inverse map"),
            ));
        }
    }
    if map.len() != labels.len() {
        return Err(export_error(
            path,
            format!("`label2id` has {} entries, `id2label` {}; expected the inverse map", map.len(), labels.len()),
        ));
    }
    Ok(())
}

/// The characters of `vocab.json` by token id (absent: none): one distinct single-character
/// key per id `0..vocab_size`.
fn read_chars(path: &Path, vocab_size: usize) -> Result<Vec<char>> {
    if !path.is_file() {
        return Ok(Vec::new());
    }
    let text = std::fs::read_to_string(path).map_err(|source| crate::files::io_error(path, source))?;
    let json: Value = serde_json::from_str(&text).map_err(|e| export_error(path, format!("not valid JSON: {e}")))?;
    let Some(map) = json.as_object() else {
        return Err(export_error(path, "is not a JSON object; expected {\"<character>\": id, …}"));
    };
    chars_by_id(path, map, vocab_size)
}

fn chars_by_id(path: &Path, map: &Map<String, Value>, vocab_size: usize) -> Result<Vec<char>> {
    if map.len() != vocab_size {
        return Err(export_error(
            path,
            format!(
                "has {} characters, but config.json's vocab_size = {vocab_size}; expected one per token id",
                map.len()
            ),
        ));
    }
    let mut chars: Vec<Option<char>> = vec![None; vocab_size];
    for (key, id) in map {
        let mut it = key.chars();
        let (Some(ch), None) = (it.next(), it.next()) else {
            return Err(export_error(path, format!("key {key:?} is not a single character")));
        };
        let id =
            id.as_u64().filter(|&i| (i as usize) < vocab_size).ok_or_else(|| {
                export_error(path, format!("{key:?} has id {id}; expected an integer in 0..{vocab_size}"))
            })? as usize;
        if let Some(other) = chars[id].replace(ch) {
            return Err(export_error(path, format!("id {id} is given to both {other:?} and {ch:?}")));
        }
    }
    // `vocab_size` keys, no id twice, every id in range: every slot is filled.
    Ok(chars.into_iter().flatten().collect())
}

/// A ViT's `preprocessor_config.json`: its rescale and normalisation
/// ([`super::read_pixel_transform`]), and `do_resize`, whose `size` must then be the model's
/// `image_size` square (what our resizing makes). Keys left out (or null) are read as
/// `ViTImageProcessor` reads them: a file without `do_resize` resizes, to `size` (a number is
/// a square) or its default 224 × 224.
///
/// The file is required: the scale differs by dataset (1/255 for 8-bit images, 1/16 for
/// scikit-learn's digits) and nothing else in the export records it, so a guessed one would
/// score raw pixel rows at the wrong scale without a word (a digits model read at 1/255 falls
/// from 92 % to chance). Every ViT export of this engine has written it.
fn read_preprocessing(path: &Path, image_size: usize, channels: usize) -> Result<(super::PixelTransform, bool)> {
    let Some(json) = read_optional_json(path)? else {
        return Err(export_error(
            path,
            "is missing; an image model's export needs it: it holds the scale the model's pixels were trained \
             at (`rescale_factor`: raw values are multiplied by it, 1/255 for 8-bit images, 1/16 for \
             scikit-learn's digits), without which raw pixel rows would be read at a guessed scale and give \
             wrong predictions. Export the model again, or write the file, e.g. \
             {\"do_rescale\": true, \"rescale_factor\": 0.0625, \"do_normalize\": false, \"do_resize\": false} for \
             digits",
        ));
    };
    let get = |key: &str| super::pixels::processor_key(&json, key);
    let resize = get("do_resize").and_then(Value::as_bool) != Some(false);
    let default_size = serde_json::json!({"height": 224, "width": 224});
    let size = get("size").unwrap_or(&default_size);
    let side = |key: &str| size.as_u64().or_else(|| size.get(key).and_then(Value::as_u64));
    if resize && (side("height"), side("width")) != (Some(image_size as u64), Some(image_size as u64)) {
        return Err(export_error(
            path,
            format!(
                "resizes to `size` {}; expected {{\"height\": {image_size}, \"width\": {image_size}}}, the model's \
                 image_size",
                get("size").map_or(
                    "{\"height\": 224, \"width\": 224} (the default: the file gives none)".to_string(),
                    Value::to_string
                )
            ),
        ));
    }
    Ok((super::pixels::pixel_transform_of(&json, path, channels)?, resize))
}

/// An export's optional JSON file: `None` without it, an error naming it when unreadable or
/// not JSON.
pub(super) fn read_optional_json(path: &Path) -> Result<Option<Value>> {
    if !path.is_file() {
        return Ok(None);
    }
    let text = std::fs::read_to_string(path).map_err(|source| crate::files::io_error(path, source))?;
    serde_json::from_str(&text).map(Some).map_err(|e| export_error(path, format!("not valid JSON: {e}")))
}

/// `max_seq_length` of sentence-transformers' settings file; `None` without the file.
fn read_max_seq_length(path: &Path) -> Result<Option<usize>> {
    let Some(json) = read_optional_json(path)? else { return Ok(None) };
    match json.get("max_seq_length").map(Value::as_u64) {
        None => Ok(None),
        Some(Some(n)) if n > 0 => Ok(Some(n as usize)),
        Some(_) => Err(export_error(path, "`max_seq_length` is not a positive whole number of tokens")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::CpuDevice;
    use crate::model::{BertConfig, GptConfig, Model, Pooling};
    use crate::weights::{ExportExtras, export_model};

    fn temp_dir(test: &str) -> crate::files::Scratch {
        crate::files::Scratch::new(&format!("read-export-{test}"))
    }

    fn tiny_bert() -> ModelConfig {
        ModelConfig::Bert(BertConfig {
            vocab_size: 7,
            hidden_size: 4,
            num_hidden_layers: 1,
            num_attention_heads: 2,
            intermediate_size: 6,
            hidden_act: "gelu".into(),
            max_position_embeddings: 5,
            type_vocab_size: 2,
            layer_norm_eps: 1e-12,
            hidden_dropout_prob: 0.0,
            attention_probs_dropout_prob: 0.0,
            num_labels: 3,
            pooling: Pooling::ClsPooler,
        })
    }

    /// Exports a tiny model of `config` into a fresh directory, removed when the test passes.
    fn export(test: &str, config: &ModelConfig, extras: &ExportExtras<'_>) -> crate::files::Scratch {
        let dir = temp_dir(test);
        let dev = CpuDevice::<f32>::new(0, 1).unwrap();
        export_model(&Model::new(&dev, config, 1).unwrap(), &dev, config, extras, &dir).unwrap();
        dir
    }

    fn labels() -> Vec<String> {
        ["neg", "neu", "pos"].map(String::from).into()
    }

    /// The error's text, which must name `file`.
    fn error_naming(dir: &Path, file: &str) -> String {
        let e = read_export(dir).unwrap_err().to_string();
        assert!(e.contains(file), "the error does not name {file}: {e}");
        e
    }

    /// A new export replaces the folder whole: a character GPT's vocabulary and tokenizer do
    /// not stay behind to be read with a BERT exported over it, and no staging folder is left.
    #[test]
    fn an_export_replaces_the_folder_whole() {
        let chars: Vec<char> = "abcdefghijklmnopq".chars().collect();
        let gpt_extras = ExportExtras { chars: &chars, ..Default::default() };
        let dir = export("replace", &crate::model::tiny::tiny_gpt(0.0), &gpt_extras);
        assert!(dir.join("vocab.json").exists() && dir.join("tokenizer.json").exists());
        let dev = CpuDevice::<f32>::new(0, 1).unwrap();
        let bert = tiny_bert();
        let extras = ExportExtras { labels: &labels(), ..Default::default() };
        export_model(&Model::new(&dev, &bert, 1).unwrap(), &dev, &bert, &extras, &dir).unwrap();
        assert!(!dir.join("vocab.json").exists() && !dir.join("tokenizer.json").exists());
        let export = read_export(&dir).unwrap();
        assert_eq!((export.config, export.tokenizer), (bert.clone(), None));
        let name = dir.file_name().unwrap().to_string_lossy().into_owned();
        let siblings: Vec<_> = std::fs::read_dir(dir.parent().unwrap())
            .unwrap()
            .filter_map(|e| e.ok()?.file_name().into_string().ok())
            .filter(|n| n.contains(&name) && *n != name)
            .collect();
        assert!(siblings.is_empty(), "{siblings:?}");
        // A path that names no folder (`.`, `..`) is refused before anything is written.
        let err =
            export_model(&Model::new(&dev, &bert, 1).unwrap(), &dev, &bert, &extras, Path::new("..")).unwrap_err();
        assert!(err.to_string().contains("expected a folder's path ending in its name"), "{err}");
    }

    /// Rewrites `config.json` through `edit`.
    fn edit_config(dir: &Path, edit: impl FnOnce(&mut Value)) {
        let path = dir.join(CONFIG_FILE);
        let mut json: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        edit(&mut json);
        std::fs::write(&path, json.to_string()).unwrap();
    }

    #[test]
    fn max_seq_length_is_read_and_a_bad_one_refused_by_file() {
        let labels = labels();
        let dir = export("max-seq", &tiny_bert(), &ExportExtras { labels: &labels, ..Default::default() });
        let path = dir.join(SENTENCE_CONFIG_FILE);
        std::fs::write(&path, r#"{"max_seq_length": 4, "do_lower_case": false}"#).unwrap();
        assert_eq!(read_export(&dir).unwrap().max_seq_length, Some(4));
        for (bad, says) in [(r#"{"max_seq_length": 0}"#, "positive whole number"), ("{", "not valid JSON")] {
            std::fs::write(&path, bad).unwrap();
            assert!(error_naming(&dir, SENTENCE_CONFIG_FILE).contains(says), "{bad}");
        }
    }

    #[test]
    fn reads_what_export_wrote() {
        let labels = labels();
        let dir = export("ok", &tiny_bert(), &ExportExtras { labels: &labels, ..Default::default() });
        let e = read_export(&dir).unwrap();
        assert_eq!((e.config, e.labels, e.tokenizer, e.chars), (tiny_bert(), labels, None, vec![]));
        assert_eq!(e.weights, dir.join(WEIGHTS_FILE));
    }

    #[test]
    fn missing_or_damaged_files_are_named() {
        let dir = export("missing", &tiny_bert(), &ExportExtras::default());
        assert!(error_naming(&dir.join("nope"), "nope").contains("is not a directory"));
        let weights = std::fs::read(dir.join(WEIGHTS_FILE)).unwrap();
        std::fs::write(dir.join(WEIGHTS_FILE), &weights[..weights.len() / 2]).unwrap();
        assert!(matches!(read_export(&dir), Err(Error::Weights { .. })), "a truncated file must be refused");
        std::fs::remove_file(dir.join(WEIGHTS_FILE)).unwrap();
        assert!(error_naming(&dir, "model.safetensors").contains("is missing"));
        std::fs::write(dir.join(WEIGHTS_FILE), &weights).unwrap();
        std::fs::write(dir.join(CONFIG_FILE), "{ not json").unwrap();
        assert!(error_naming(&dir, "config.json").contains("not valid JSON"));
        std::fs::remove_file(dir.join(CONFIG_FILE)).unwrap();
        assert!(error_naming(&dir, "config.json").contains("is missing"));
        // A config far larger than its weights (a vocabulary of three billion) is refused
        // before a model of its size is built.
        let dir = export("too-large", &tiny_bert(), &ExportExtras::default());
        edit_config(&dir, |j| j["vocab_size"] = 3_000_000_000u64.into());
        let e = error_naming(&dir, "config.json");
        assert!(e.contains("describes a model of") && e.contains("a stored parameter takes 2 at least"), "{e}");
    }

    #[test]
    fn class_names_must_match_the_classifier() {
        let labels = labels();
        let dir = export("labels", &tiny_bert(), &ExportExtras { labels: &labels, ..Default::default() });
        edit_config(&dir, |j| {
            j["id2label"].as_object_mut().unwrap().remove("2");
        });
        assert!(error_naming(&dir, "config.json").contains("`id2label` has 2 entries, but num_labels = 3"));
        edit_config(&dir, |j| j["id2label"]["7"] = "far".into());
        assert!(error_naming(&dir, "config.json").contains("no name for class \"2\""));
        edit_config(&dir, |j| {
            j["id2label"] = serde_json::json!({"0": "neg", "1": "neu", "2": "pos"});
            j["label2id"]["pos"] = 0.into();
        });
        let e = error_naming(&dir, "config.json");
        assert!(e.contains("`label2id` maps `pos` to 0, but `id2label` gives it id 2"), "{e}");
        edit_config(&dir, |j| j["id2label"] = "neg".into());
        assert!(error_naming(&dir, "config.json").contains("`id2label` is not an object"));
    }

    #[test]
    fn an_image_preprocessor_is_read_as_vit_image_processor_reads_it() {
        let config = crate::model::tiny::tiny_gray_vit();
        let dir = export("vit", &config, &ExportExtras { pixel_max: Some(16), ..Default::default() });
        assert_eq!(read_export(&dir).unwrap().pixel_scale, Some(1.0 / 16.0));
        let path = dir.join(PREPROCESSOR_FILE);
        let mut json: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        assert_eq!(read_export(&dir).unwrap().normalization, None, "this engine's: none");
        // A normalisation is read as `ViTImageProcessor` reads it: by its keys, or its
        // defaults (mean and std 0.5) where `do_normalize` is left out.
        json["do_normalize"] = true.into();
        json["image_mean"] = serde_json::json!([0.25]);
        std::fs::write(&path, json.to_string()).unwrap();
        let normalization = read_export(&dir).unwrap().normalization;
        assert_eq!(
            normalization,
            Some(super::super::PixelTransform { scale: 1.0 / 16.0, mean: vec![0.25], std: vec![1.0] })
        );
        let object = json.as_object_mut().unwrap();
        for key in ["do_normalize", "image_mean", "image_std"] {
            object.remove(key);
        }
        std::fs::write(&path, json.to_string()).unwrap();
        assert_eq!(read_export(&dir).unwrap().normalization.map(|t| (t.mean, t.std)), Some((vec![0.5], vec![0.5])));
        // Google's ViT's file: `size` a number, no `rescale_factor` (1/255), mean and std 0.5.
        let google = serde_json::json!({"do_normalize": true, "do_resize": true, "size": 4,
            "image_mean": [0.5], "image_std": [0.5], "image_processor_type": "ViTImageProcessor"});
        std::fs::write(&path, google.to_string()).unwrap();
        let read = read_export(&dir).unwrap();
        assert_eq!((read.pixel_scale, read.resize), (Some(1.0 / 255.0), true));
        assert_eq!(read.normalization.map(|t| (t.mean, t.std)), Some((vec![0.5], vec![0.5])));
        json["do_normalize"] = false.into();
        json["rescale_factor"] = (-1.0).into();
        std::fs::write(&path, json.to_string()).unwrap();
        assert!(error_naming(&dir, "preprocessor_config.json").contains("`rescale_factor`"));
        // Resizing, read where its size is the model's; to another size, refused; without
        // `do_resize`, to `size` or 224 × 224, as `ViTImageProcessor` reads the file.
        json["rescale_factor"] = (1.0 / 255.0).into();
        std::fs::write(&path, json.to_string()).unwrap();
        assert!(!read_export(&dir).unwrap().resize);
        let (mut unsaid, mut bare) = (json.clone(), json.clone());
        unsaid.as_object_mut().unwrap().remove("do_resize");
        std::fs::write(&path, unsaid.to_string()).unwrap();
        assert!(read_export(&dir).unwrap().resize, "the model's size: {unsaid}");
        for key in ["do_resize", "size"] {
            bare.as_object_mut().unwrap().remove(key);
        }
        std::fs::write(&path, bare.to_string()).unwrap();
        let e = error_naming(&dir, "preprocessor_config.json");
        assert!(e.contains("224} (the default: the file gives none); expected {\"height\": 4"), "{e}");
        std::fs::write(&path, json.to_string()).unwrap();
        json["do_resize"] = true.into();
        std::fs::write(&path, json.to_string()).unwrap();
        assert!(read_export(&dir).unwrap().resize);
        json["size"] = serde_json::json!({"shortest_edge": 224});
        std::fs::write(&path, json.to_string()).unwrap();
        let e = error_naming(&dir, "preprocessor_config.json");
        assert!(e.contains("resizes to `size` {\"shortest_edge\":224}") && e.contains("\"height\": 4"), "{e}");
        // Without the file the scale is unknown: refused, saying what the file holds and why
        // it is needed, rather than read at a guessed 1/255.
        std::fs::remove_file(&path).unwrap();
        let e = error_naming(&dir, "preprocessor_config.json");
        assert!(e.contains("is missing") && e.contains("rescale_factor") && e.contains("wrong predictions"), "{e}");
    }

    /// Only an image model needs a preprocessor: a text model's and a character GPT's exports
    /// are read without one, as MiniLM's pretrained folder has none.
    #[test]
    fn text_models_need_no_preprocessor() {
        let labels = labels();
        let dir = export("no-preprocessor", &tiny_bert(), &ExportExtras { labels: &labels, ..Default::default() });
        assert!(!dir.join(PREPROCESSOR_FILE).exists());
        assert_eq!(read_export(&dir).unwrap().pixel_scale, None);
        let chars = ['a', 'b', '\n'];
        let config = ModelConfig::Gpt(GptConfig::without_dropout(3, 4, 4, 1, 2));
        let dir = export("no-preprocessor-gpt", &config, &ExportExtras { chars: &chars, ..Default::default() });
        assert_eq!(read_export(&dir).unwrap().pixel_scale, None);
    }

    #[test]
    fn a_character_vocabulary_must_match_the_model() {
        let config = ModelConfig::Gpt(GptConfig::without_dropout(3, 4, 4, 1, 2));
        let chars = ['a', 'b', '\n'];
        let dir = export("chars", &config, &ExportExtras { chars: &chars, ..Default::default() });
        assert_eq!(read_export(&dir).unwrap().chars, chars);
        let vocab = dir.join(VOCAB_FILE);
        std::fs::write(&vocab, r#"{"a": 0, "b": 1}"#).unwrap();
        assert!(error_naming(&dir, "vocab.json").contains("has 2 characters, but config.json's vocab_size = 3"));
        std::fs::write(&vocab, r#"{"a": 0, "bc": 1, "d": 2}"#).unwrap();
        assert!(error_naming(&dir, "vocab.json").contains("\"bc\" is not a single character"));
        std::fs::write(&vocab, r#"{"a": 0, "b": 0, "c": 2}"#).unwrap();
        assert!(error_naming(&dir, "vocab.json").contains("id 0 is given to both"));
        std::fs::write(&vocab, r#"{"a": 0, "b": 1, "c": 3}"#).unwrap();
        assert!(error_naming(&dir, "vocab.json").contains("expected an integer in 0..3"));
        std::fs::write(&vocab, "[1, 2]").unwrap();
        assert!(error_naming(&dir, "vocab.json").contains("is not a JSON object"));
    }
}
