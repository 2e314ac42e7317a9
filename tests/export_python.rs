//! Exports that the Python ecosystem loads: tiny BERT classifiers (each pooling), a ViT, a
//! character GPT and (when installed) all-MiniLM-L6-v2 with a mean-pooling head are exported with their companions (class names, tokenizer, image
//! preprocessor, sentence-transformers modules), read back with `read_export` (as our
//! `predict` does: same logits, bitwise), and then handed to `scripts/check_export.py`, which
//! loads them with `transformers` / sentence-transformers and compares their outputs with ours
//! (max |difference| ≤ 1e-4, in float32 on the CPU; 1e-6 for the image processor's pixels).
//!
//! The Python step needs an interpreter with torch, transformers, sentence-transformers and
//! pillow: `PT_PYTHON` names it (default `python3`). Without them the step is skipped with a
//! message and the test passes; e.g.
//!
//! ```text
//! python3 -m venv /tmp/pyexp && /tmp/pyexp/bin/pip install torch transformers sentence-transformers pillow
//! PT_PYTHON=/tmp/pyexp/bin/python cargo test --test export_python -- --nocapture
//! ```

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

use pipetransformer::device::{CpuDevice, Device};
use pipetransformer::model::{Batch, HostBatch, Model, ModelConfig, Pooling};
use pipetransformer::rng::Rng;
use pipetransformer::run::Predictor;
use pipetransformer::text::{TextInput, TextItem, TextTokenizer, text_batch};
use pipetransformer::weights::{
    ExportExtras, LoadOptions, export_model, load_into_model, load_safetensors, read_export, read_hf_config,
};
use serde_json::{Value, json};

/// Largest |ours − Python's| accepted for logits and embeddings (float32 on both sides; the
/// differences come from summation order and the erf/tanh implementations).
const TOLERANCE: f64 = 1e-4;
/// The file `scripts/check_export.py` reads the inputs and our outputs from.
const CHECK_FILE: &str = "pipetransformer_check.json";

type Dev = CpuDevice<f32>;

fn write_json(path: &Path, value: &Value) {
    std::fs::write(path, serde_json::to_string_pretty(value).unwrap()).unwrap();
}

/// Logits (eval mode) as rows of `width`.
fn logits(dev: &Dev, model: &Model<Dev>, host: &HostBatch, width: usize) -> Vec<Vec<f32>> {
    let batch = Batch::upload(dev, model.spec(), host, false, 0).unwrap();
    let values = dev.download(&model.forward(dev, &batch).unwrap().0).unwrap();
    values.chunks(width).map(<[f32]>::to_vec).collect()
}

/// The export read back as our `predict` will: `read_export`, a model from its config, a
/// strict load; it must give bitwise the logits of the model that was exported.
fn check_read_back(dev: &Dev, dir: &Path, exported: &Model<Dev>, host: &HostBatch, width: usize) {
    let export = read_export(dir).unwrap();
    let mut model = Model::new(dev, &export.config, 99).unwrap();
    let file = load_safetensors(&export.weights).unwrap();
    load_into_model(&mut model, dev, &file, &LoadOptions::strict()).unwrap();
    let bits = |rows: Vec<Vec<f32>>| rows.concat().iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    assert_eq!(bits(logits(dev, &model, host, width)), bits(logits(dev, exported, host, width)), "{}", dir.display());
}

// ---- the tiny BERT tokenizer ----------------------------------------------------------------

/// `tiny_bert`'s 13-token vocabulary, by id.
const BERT_VOCAB: [&str; 13] =
    ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "the", "cat", "sat", "on", "mat", "dog", "##s", "a"];
const SENTENCES: [&str; 3] = ["the cat sat on the mat", "a dog", "The dogs sat"];

/// A pretrained-model directory holding a WordPiece tokenizer for [`BERT_VOCAB`] (lower-casing,
/// `[CLS] … [SEP]`), in every file the export copies.
fn tiny_bert_tokenizer(dir: &Path) {
    let special = |id: usize| {
        json!({"id": id, "content": BERT_VOCAB[id], "single_word": false, "lstrip": false, "rstrip": false,
               "normalized": false, "special": true})
    };
    let vocab: serde_json::Map<String, Value> =
        BERT_VOCAB.iter().enumerate().map(|(i, t)| (t.to_string(), json!(i))).collect();
    let token = |t: &str, type_id: u32| json!({"SpecialToken": {"id": t, "type_id": type_id}});
    let seq = |s: &str, type_id: u32| json!({"Sequence": {"id": s, "type_id": type_id}});
    let tokenizer = json!({
        "version": "1.0", "truncation": null, "padding": null,
        "added_tokens": (0..5).map(special).collect::<Vec<_>>(),
        "normalizer": {"type": "BertNormalizer", "clean_text": true, "handle_chinese_chars": true,
                       "strip_accents": null, "lowercase": true},
        "pre_tokenizer": {"type": "BertPreTokenizer"},
        "post_processor": {
            "type": "TemplateProcessing",
            "single": [token("[CLS]", 0), seq("A", 0), token("[SEP]", 0)],
            "pair": [token("[CLS]", 0), seq("A", 0), token("[SEP]", 0), seq("B", 1), token("[SEP]", 1)],
            "special_tokens": {
                "[CLS]": {"id": "[CLS]", "ids": [2], "tokens": ["[CLS]"]},
                "[SEP]": {"id": "[SEP]", "ids": [3], "tokens": ["[SEP]"]}
            }
        },
        "decoder": {"type": "WordPiece", "prefix": "##", "cleanup": true},
        "model": {"type": "WordPiece", "unk_token": "[UNK]", "continuing_subword_prefix": "##",
                  "max_input_chars_per_word": 100, "vocab": vocab}
    });
    std::fs::create_dir_all(dir).unwrap();
    write_json(&dir.join("tokenizer.json"), &tokenizer);
    std::fs::write(dir.join("vocab.txt"), BERT_VOCAB.join("\n") + "\n").unwrap();
    write_json(
        &dir.join("tokenizer_config.json"),
        &json!({"tokenizer_class": "BertTokenizer", "do_lower_case": true, "model_max_length": 9}),
    );
    write_json(
        &dir.join("special_tokens_map.json"),
        &json!({"cls_token": "[CLS]", "mask_token": "[MASK]", "pad_token": "[PAD]", "sep_token": "[SEP]",
                "unk_token": "[UNK]"}),
    );
}

// ---- the exports --------------------------------------------------------------------------

/// A BERT classifier to export and check.
struct Bert<'a> {
    model: &'a Model<Dev>,
    config: &'a ModelConfig,
    labels: &'a [String],
    /// Where its tokenizer files are (the "pretrained" directory).
    tokenizer_dir: &'a Path,
    /// The run's `max_len`.
    max_len: usize,
    /// What to feed it.
    sentences: &'a [&'a str],
}

/// A tiny BERT classifier with `pooling`, exported with class names and the tokenizer.
fn export_bert(dev: &Dev, root: &Path, pooling: Pooling, tokenizer_dir: &Path) -> PathBuf {
    let config = common::tiny_bert(pooling, 0.0);
    let model = Model::new(dev, &config, 11).unwrap();
    let labels: Vec<String> = ["negative", "neutral", "positive"].map(String::from).into();
    let bert =
        Bert { model: &model, config: &config, labels: &labels, tokenizer_dir, max_len: 9, sentences: &SENTENCES };
    export_bert_model(dev, root, "bert", &bert)
}

/// all-MiniLM-L6-v2 (when `scripts/setup.sh weights` installed it) with a fresh mean-pooling
/// head for two classes, as the main job (`configs/minilm-rt.toml`) exports it: a real
/// WordPiece vocabulary and real activations.
fn export_minilm(dev: &Dev, root: &Path) -> Option<PathBuf> {
    let pretrained = Path::new(env!("CARGO_MANIFEST_DIR")).join("weights/all-minilm-l6-v2");
    if !pretrained.join("model.safetensors").is_file() {
        println!(
            "SKIP the all-MiniLM-L6-v2 export: {} is not installed (scripts/setup.sh weights)",
            pretrained.display()
        );
        return None;
    }
    let mut config = read_hf_config(pretrained.join("config.json"), None).unwrap();
    if let ModelConfig::Bert(c) = &mut config {
        (c.num_labels, c.pooling, c.hidden_dropout_prob, c.attention_probs_dropout_prob) = (2, Pooling::Mean, 0.0, 0.0);
    }
    let mut model = Model::new(dev, &config, 17).unwrap();
    let file = load_safetensors(pretrained.join("model.safetensors")).unwrap();
    load_into_model(&mut model, dev, &file, &LoadOptions::default()).unwrap();
    let labels: Vec<String> = ["rotten", "fresh"].map(String::from).into();
    let sentences = [
        "A gripping, funny and deeply humane film.",
        "Two hours I will never get back.",
        "Pipeline parallelism splits a model into stages.",
    ];
    let bert = Bert {
        model: &model,
        config: &config,
        labels: &labels,
        tokenizer_dir: &pretrained,
        max_len: 64,
        sentences: &sentences,
    };
    Some(export_bert_model(dev, root, "minilm", &bert))
}

/// Exports `bert` into `root/{prefix}-{pooling}`, with a check file holding the sentences'
/// ids, our logits, and what SentenceTransformer must give: the `[CLS]` hidden state (our
/// `[CLS]` pooler's dense + tanh has no sentence-transformers module), or the masked mean of
/// the hidden states.
fn export_bert_model(dev: &Dev, root: &Path, prefix: &str, bert: &Bert<'_>) -> PathBuf {
    let Bert { model, config, labels, tokenizer_dir, max_len, sentences } = *bert;
    let ModelConfig::Bert(bc) = config else { panic!("not a BERT config") };
    let (pooling, num_labels, c) = (bc.pooling, bc.num_labels, bc.hidden_size);
    let name = match pooling {
        Pooling::ClsPooler => "cls_pooler",
        Pooling::Cls => "cls",
        Pooling::Mean => "mean",
    };
    let dir = root.join(format!("{prefix}-{name}"));
    // A run's export records its data settings in config.json; transformers must still load it.
    let trained_on = json!({"data.dataset": "rotten_tomatoes", "data.split_seed": 0, "data.test_fraction": 0.1});
    let extras = ExportExtras {
        labels,
        tokenizer_dir: Some(tokenizer_dir),
        max_seq_length: Some(max_len),
        trained_on: Some(&trained_on),
        ..Default::default()
    };
    let report = export_model(model, dev, config, &extras, &dir).unwrap();
    assert!(report.companions.iter().any(|p| p.ends_with("1_Pooling/config.json")), "{report:?}");

    let tokenizer = TextTokenizer::from_file(tokenizer_dir.join("tokenizer.json"), max_len).unwrap();
    let items: Vec<TextItem<'_>> = sentences
        .iter()
        .enumerate()
        .map(|(i, s)| TextItem { id: i as u64, input: TextInput::Single(s), label: 0 })
        .collect();
    let host = text_batch(&tokenizer, &items, 0).unwrap().host;
    let (b, t) = (host.batch, host.seq);
    let batch = Batch::upload(dev, model.spec(), &host, false, 0).unwrap();
    let hidden = dev.download(&model.forward_hidden(dev, &batch).unwrap()).unwrap();
    let mask = host.attention_mask.clone().unwrap();
    let embeddings: Vec<Vec<f32>> = (0..b)
        .map(|s| {
            let real: Vec<usize> = (0..t).filter(|&p| mask[s * t + p] == 1).collect();
            (0..c)
                .map(|ch| match pooling {
                    Pooling::Mean => {
                        real.iter().map(|&p| hidden[(s * t + p) * c + ch]).sum::<f32>() / real.len() as f32
                    }
                    Pooling::Cls | Pooling::ClsPooler => hidden[s * t * c + ch],
                })
                .collect()
        })
        .collect();
    let rows = |v: &[u32]| v.chunks(t).map(<[u32]>::to_vec).collect::<Vec<_>>();
    let check = json!({
        "kind": "bert", "pooling": name, "tolerance": TOLERANCE, "sentences": sentences,
        "input_ids": rows(host.tokens.as_ref().unwrap()),
        "attention_mask": rows(&mask),
        "token_type_ids": rows(host.token_types.as_ref().unwrap()),
        "logits": logits(dev, model, &host, num_labels),
        "embedding": if pooling == Pooling::Mean { "mean of the hidden states" } else { "[CLS] hidden state" },
        "embeddings": embeddings,
    });
    write_json(&dir.join(CHECK_FILE), &check);

    let export = read_export(&dir).unwrap();
    assert_eq!(export.labels, labels);
    assert_eq!(export.tokenizer, Some(dir.join("tokenizer.json")));
    assert_eq!(export.max_seq_length, Some(max_len));
    // `predict` cuts a text where the run cut it (`max_len`), not at the model's positions:
    // a long text scores as its first `max_len` tokens, with a warning.
    let predictor = Predictor::load(Dev::new(0, 1).unwrap(), &dir).unwrap();
    let words = |n: usize| vec!["cat"; n].join(" ");
    let got = predictor.classify_texts(&[&words(3 * max_len), &words(max_len - 2)]).unwrap();
    assert!(got[0].warning.is_some() && got[1].warning.is_none(), "{got:?}");
    assert_eq!(got[0].probabilities, got[1].probabilities, "{}", dir.display());
    check_read_back(dev, &dir, model, &host, num_labels);
    dir
}

/// A tiny 1-channel ViT (like our digits/MNIST models) and two images of raw 8-bit pixels.
fn export_vit(dev: &Dev, root: &Path) -> PathBuf {
    let dir = root.join("vit");
    let ModelConfig::Vit(mut c) = common::tiny_vit(0.0) else { unreachable!() };
    c.num_channels = 1;
    let config = ModelConfig::Vit(c.clone());
    let model = Model::new(dev, &config, 12).unwrap();
    let labels: Vec<String> = ["zero", "one", "two"].map(String::from).into();
    let extras = ExportExtras { labels: &labels, pixel_max: Some(255), ..Default::default() };
    export_model(&model, dev, &config, &extras, &dir).unwrap();

    let (b, side) = (2, c.image_size);
    let mut rng = Rng::new(5);
    let raw: Vec<u32> = (0..b * side * side).map(|_| rng.below(256) as u32).collect();
    let pixels: Vec<f32> = raw.iter().map(|&v| v as f32 / 255.0).collect();
    let host = HostBatch { batch: b, pixels: Some(pixels.clone()), targets: vec![0; b], ..Default::default() };
    let image = |v: &[u32]| v.chunks(side).map(<[u32]>::to_vec).collect::<Vec<_>>();
    let images = |v: &[u32]| v.chunks(side * side).map(|img| vec![image(img)]).collect::<Vec<_>>();
    let float_images: Vec<Vec<Vec<Vec<f32>>>> =
        pixels.chunks(side * side).map(|img| vec![img.chunks(side).map(<[f32]>::to_vec).collect()]).collect();
    let check = json!({
        "kind": "vit", "tolerance": TOLERANCE,
        "raw_pixels": images(&raw), "pixels": float_images,
        "logits": logits(dev, &model, &host, 3),
    });
    write_json(&dir.join(CHECK_FILE), &check);

    let export = read_export(&dir).unwrap();
    assert_eq!(export.labels, labels);
    assert_eq!(export.pixel_scale, Some(1.0 / 255.0));
    check_read_back(dev, &dir, &model, &host, 3);
    dir
}

/// A tiny character GPT over 17 characters (newline and space included).
fn export_gpt(dev: &Dev, root: &Path) -> PathBuf {
    let dir = root.join("gpt");
    let config = common::tiny_gpt(0.0);
    let chars: Vec<char> = "\n !',.abdehilmnot".chars().collect();
    assert_eq!(chars.len(), 17);
    let model = Model::new(dev, &config, 13).unwrap();
    let extras = ExportExtras { chars: &chars, ..Default::default() };
    export_model(&model, dev, &config, &extras, &dir).unwrap();

    let texts = ["to be!\n", "no, lie"];
    let ids: Vec<Vec<u32>> = texts
        .iter()
        .map(|t| t.chars().map(|ch| chars.iter().position(|&c| c == ch).unwrap() as u32).collect())
        .collect();
    let (b, t) = (ids.len(), ids[0].len());
    let host =
        HostBatch { batch: b, seq: t, tokens: Some(ids.concat()), targets: vec![0; b * t], ..Default::default() };
    let rows = logits(dev, &model, &host, 17);
    let per_text: Vec<Vec<Vec<f32>>> = rows.chunks(t).map(<[Vec<f32>]>::to_vec).collect();
    let check = json!({"kind": "gpt", "tolerance": TOLERANCE, "texts": texts, "input_ids": ids, "logits": per_text});
    write_json(&dir.join(CHECK_FILE), &check);

    let export = read_export(&dir).unwrap();
    assert_eq!(export.chars, chars);
    assert!(export.labels.is_empty());
    check_read_back(dev, &dir, &model, &host, 17);
    dir
}

// ---- the Python side ----------------------------------------------------------------------

/// The interpreter to use, or why the Python check is skipped.
fn python() -> Result<String, String> {
    let python = std::env::var("PT_PYTHON").unwrap_or_else(|_| "python3".into());
    let probe = "import torch, transformers, sentence_transformers, safetensors, PIL";
    match Command::new(&python).args(["-c", probe]).output() {
        Ok(out) if out.status.success() => Ok(python),
        Ok(out) => Err(format!(
            "`{python}` lacks a package ({})",
            String::from_utf8_lossy(&out.stderr).lines().last().unwrap_or("import failed")
        )),
        Err(e) => Err(format!("cannot run `{python}`: {e}")),
    }
}

#[test]
fn exports_load_in_transformers_and_sentence_transformers() {
    let root = pipetransformer::testing::Scratch::new("export-python");
    let dev = Dev::new(0, 1).unwrap();
    let tokenizer_dir = root.join("pretrained");
    tiny_bert_tokenizer(&tokenizer_dir);
    let mut dirs: Vec<PathBuf> = [Pooling::ClsPooler, Pooling::Mean, Pooling::Cls]
        .into_iter()
        .map(|pooling| export_bert(&dev, &root, pooling, &tokenizer_dir))
        .collect();
    dirs.push(export_vit(&dev, &root));
    dirs.push(export_gpt(&dev, &root));
    dirs.extend(export_minilm(&dev, &root));

    let python = match python() {
        Ok(p) => p,
        Err(why) => {
            println!(
                "SKIP the Python comparison: {why}. Set PT_PYTHON to an interpreter with torch, transformers, \
                 sentence-transformers and pillow to run it."
            );
            return;
        }
    };
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/check_export.py");
    let out = Command::new(&python).arg(&script).args(&dirs).env("TOKENIZERS_PARALLELISM", "false").output().unwrap();
    let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    println!("{stdout}");
    // Python's warnings (e.g. BertModel's freshly initialised pooler for a mean-pooling export).
    eprintln!("{stderr}");
    assert!(out.status.success(), "check_export.py failed:\n{stdout}\n{stderr}");
}
