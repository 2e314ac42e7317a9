//! `TextTokenizer` and `text_batch` on the real all-MiniLM-L6-v2 tokenizer (ids checked against
//! Python's `tokenizers`), the error paths of loading a tokenizer, and text batches fed
//! through a tiny BERT and GPT.
//!
//! Tests that need `weights/all-minilm-l6-v2/tokenizer.json` (installed by the setup) print a
//! note and pass when it is absent; the error-path and tiny-tokenizer tests always run.

mod common;

use std::path::{Path, PathBuf};

use pipetransformer::device::{CpuDevice, Device};
use pipetransformer::model::{Batch, BertConfig, GptConfig, Model, ModelConfig, Pooling};
use pipetransformer::text::{TextInput, TextItem, TextTokenizer, stream_batches, text_batch};
use pipetransformer::{Error, Result};
use serde::Deserialize;

const CLS: u32 = 101;
const SEP: u32 = 102;

fn manifest(rel: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join(rel)
}

/// MiniLM's tokenizer truncating at `max_len`, or `None` (with a note) before the setup ran.
fn minilm(max_len: usize) -> Option<TextTokenizer> {
    let path = manifest("weights/all-minilm-l6-v2/tokenizer.json");
    if !common::installed(&[&path]) {
        return None;
    }
    Some(TextTokenizer::from_file(&path, max_len).unwrap())
}

fn tiny_tokenizer(max_len: usize) -> TextTokenizer {
    TextTokenizer::from_file(manifest("tests/fixtures/tiny_tokenizer.json"), max_len).unwrap()
}

#[test]
fn hello_world() {
    let Some(t) = minilm(128) else { return };
    let e = t.encode("hello world").unwrap();
    assert_eq!(e.ids, [101, 7592, 2088, 102]);
    assert_eq!(e.type_ids, [0, 0, 0, 0]);
    assert_eq!(
        (t.pad_id(), t.vocab_size(), t.token_id("[CLS]"), t.token_id("[SEP]")),
        (0, 30522, Some(CLS), Some(SEP))
    );
}

#[test]
fn pair_type_ids_are_zeros_then_ones() {
    let Some(t) = minilm(128) else { return };
    let e = t.encode_pair("how old are you?", "i am six years old.").unwrap();
    let first_sep = e.ids.iter().position(|&id| id == SEP).unwrap();
    assert_eq!(e.ids[0], CLS);
    assert_eq!(*e.ids.last().unwrap(), SEP);
    assert!(e.type_ids[..=first_sep].iter().all(|&t| t == 0), "{:?}", e.type_ids);
    assert!(e.type_ids[first_sep + 1..].iter().all(|&t| t == 1), "{:?}", e.type_ids);
    assert!(first_sep + 1 < e.ids.len() - 1, "second segment is empty: {:?}", e.ids);
}

#[test]
fn truncation_keeps_the_final_sep() {
    let Some(t) = minilm(8) else { return };
    let e = t.encode("the quick brown fox jumps over the lazy dog").unwrap();
    assert_eq!(e.ids, [CLS, 1996, 4248, 2829, 4419, 14523, 2058, SEP]);
    assert!(e.truncated);
    let p = t.encode_pair("a question", "a passage that is much longer than the question").unwrap();
    assert_eq!(p.ids.len(), 8);
    assert_eq!((p.ids[0], p.ids.iter().filter(|&&id| id == SEP).count(), p.ids[7]), (CLS, 2, SEP));
}

#[test]
fn long_text_is_truncated_to_max_len() {
    let Some(t) = minilm(128) else { return };
    let long = "to be or not to be that is the question ".repeat(60); // 600 words
    let e = t.encode(&long).unwrap();
    assert_eq!(e.ids.len(), 128);
    assert_eq!((e.ids[0], e.ids[127]), (CLS, SEP));
    assert!(e.truncated);
    // The file bakes in padding to 128; ours is off, so a short text stays short.
    assert_eq!(t.encode("short").unwrap().ids.len(), 3);
}

#[test]
fn batch_pads_to_its_longest_item_and_masks_padding() {
    let Some(t) = minilm(64) else { return };
    let texts = ["hello world", "the quick brown fox jumps over the lazy dog", "yes"];
    let items: Vec<TextItem> = texts
        .iter()
        .enumerate()
        .map(|(i, s)| TextItem { id: 100 + i as u64, input: TextInput::Single(s), label: i as u32 })
        .collect();
    let b = text_batch(&t, &items, 12).unwrap();
    let lengths: Vec<usize> = texts.iter().map(|s| t.encode(s).unwrap().ids.len()).collect();
    assert_eq!(b.lengths, lengths);
    assert_eq!(b.host.seq, *lengths.iter().max().unwrap());
    assert!(b.host.seq < 64);
    let (seq, tokens, mask) =
        (b.host.seq, b.host.tokens.as_deref().unwrap(), b.host.attention_mask.as_deref().unwrap());
    for (row, &len) in lengths.iter().enumerate() {
        let r = row * seq..(row + 1) * seq;
        assert_eq!(mask[r.clone()].iter().sum::<u32>() as usize, len);
        assert!(mask[r.clone()].iter().take(len).all(|&m| m == 1));
        assert!(tokens[r.clone()].iter().skip(len).all(|&id| id == t.pad_id()));
        assert_eq!(tokens[r][len - 1], SEP);
    }
    assert_eq!(
        (b.host.targets.clone(), b.host.sample_offset, b.host.sample_ids),
        (vec![0, 1, 2], 12, vec![100, 101, 102])
    );
}

#[test]
fn ids_are_deterministic_across_runs() {
    let Some(t) = minilm(32) else { return };
    // Enough items that the crate's batch encoding spreads them over threads.
    let sentences: Vec<String> = (0..200)
        .map(|i| format!("sentence number {i}: the {} cat sat on mat {}", ["red", "big", "tiny"][i % 3], i * 7))
        .collect();
    let inputs: Vec<TextInput> = sentences.iter().map(|s| TextInput::Single(s)).collect();
    let runs: Vec<_> = (0..3).map(|_| t.encode_batch(&inputs).unwrap()).collect();
    assert_eq!(runs[0], runs[1]);
    assert_eq!(runs[0], runs[2]);
    let one_by_one: Vec<_> = inputs.iter().map(|&i| t.encode_input(i).unwrap()).collect();
    assert_eq!(runs[0], one_by_one);
}

#[derive(Deserialize)]
struct Fixture {
    tokenizer_sha256: String,
    cases: Vec<FixtureCase>,
}

#[derive(Deserialize)]
struct FixtureCase {
    text: String,
    pair: Option<String>,
    max_len: Option<usize>,
    ids: Vec<u32>,
    type_ids: Vec<u32>,
}

#[test]
fn ids_match_python_tokenizers() {
    let Some(_) = minilm(512) else { return };
    let fixture: Fixture =
        serde_json::from_str(&std::fs::read_to_string(manifest("tests/fixtures/minilm_token_ids.json")).unwrap())
            .unwrap();
    assert_eq!(fixture.tokenizer_sha256.len(), 64);
    assert!(fixture.cases.len() >= 5);
    for case in &fixture.cases {
        // The fixture's untruncated cases were encoded with truncation off; 512 (the model's
        // position limit) is above all of them.
        let t = minilm(case.max_len.unwrap_or(512)).unwrap();
        let e = match &case.pair {
            Some(pair) => t.encode_pair(&case.text, pair).unwrap(),
            None => t.encode(&case.text).unwrap(),
        };
        assert_eq!(e.ids, case.ids, "ids of {:?} / {:?}", case.text, case.pair);
        assert_eq!(e.type_ids, case.type_ids, "type ids of {:?} / {:?}", case.text, case.pair);
    }
}

#[test]
fn missing_file_is_an_io_error_naming_it() {
    let path = manifest("tests/fixtures/no_such_tokenizer.json");
    match TextTokenizer::from_file(&path, 128) {
        Err(Error::Io { path: p, source }) => {
            assert_eq!(p, path.display().to_string());
            assert_eq!(source.kind(), std::io::ErrorKind::NotFound);
        }
        other => panic!("expected an I/O error, got {other:?}"),
    }
}

#[test]
fn malformed_files_are_tokenizer_errors_naming_them() {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("text_malformed_tokenizer");
    std::fs::create_dir_all(&dir).unwrap();
    let cases = [
        ("truncated.json", "{\"version\": \"1.0\", \"model\": {"),
        ("not_a_tokenizer.json", "{\"hello\": \"world\"}"),
        ("empty.json", ""),
        ("binary.json", "\u{0}\u{1}\u{2}"),
    ];
    for (name, contents) in cases {
        let path = dir.join(name);
        std::fs::write(&path, contents).unwrap();
        match TextTokenizer::from_file(&path, 128) {
            Err(e @ Error::Tokenizer { .. }) => {
                let Error::Tokenizer { file, .. } = &e else { unreachable!() };
                assert_eq!(*file, path.display().to_string());
                assert!(e.to_string().contains(name), "{e}");
            }
            other => panic!("{name}: expected a tokenizer error, got {other:?}"),
        }
    }
}

#[test]
fn too_small_max_len_is_a_config_error() {
    assert!(matches!(
        TextTokenizer::from_file(manifest("tests/fixtures/tiny_tokenizer.json"), 2),
        Err(Error::Config { .. })
    ));
}

/// The tiny BERT of the other tests, with the tiny tokenizer's 20-token vocabulary.
fn tiny_bert() -> ModelConfig {
    match common::tiny_bert(Pooling::Mean, 0.0) {
        ModelConfig::Bert(c) => ModelConfig::Bert(BertConfig { vocab_size: 20, max_position_embeddings: 16, ..c }),
        _ => unreachable!(),
    }
}

fn logits(
    dev: &CpuDevice<f64>,
    model: &Model<CpuDevice<f64>>,
    host: &pipetransformer::model::HostBatch,
) -> Result<Vec<f64>> {
    let batch = Batch::upload(dev, model.spec(), host, false, 0)?;
    let (logits, _) = model.forward(dev, &batch)?;
    dev.download_f64(&logits)
}

#[test]
fn per_batch_padding_does_not_change_a_bert_classifier() {
    // A sample's logits are the same alone (no padding) and in a batch where it is padded:
    // the mask produced by `text_batch` hides exactly the padding.
    let dev = CpuDevice::<f64>::new(0, 1).unwrap();
    let model = Model::new(&dev, &tiny_bert(), 3).unwrap();
    let t = tiny_tokenizer(16);
    let short = TextItem { id: 0, input: TextInput::Single("hello world"), label: 1 };
    let long =
        TextItem { id: 1, input: TextInput::Pair("the big red dog ran far", "the cats sat on a mat."), label: 2 };
    let both = text_batch(&t, &[short, long], 0).unwrap();
    assert!(both.lengths[0] < both.host.seq);
    let alone = text_batch(&t, &[short], 0).unwrap();
    let (both, alone) = (logits(&dev, &model, &both.host).unwrap(), logits(&dev, &model, &alone.host).unwrap());
    for (a, b) in alone.iter().zip(&both[..3]) {
        assert!((a - b).abs() < 1e-12, "{alone:?} vs {both:?}");
    }
}

#[test]
fn stream_batches_feed_a_gpt() {
    let config = match common::tiny_gpt(0.0) {
        ModelConfig::Gpt(c) => ModelConfig::Gpt(GptConfig { vocab_size: 20, ..c }),
        _ => unreachable!(),
    };
    let dev = CpuDevice::<f64>::new(0, 1).unwrap();
    let model = Model::new(&dev, &config, 3).unwrap();
    let stream: Vec<u32> = (0..40).map(|i| (i * 7 % 20) as u32).collect();
    let batches = stream_batches(&stream, 6, 4, 0).unwrap();
    let mut predicted = 0;
    for host in &batches {
        let batch = Batch::upload(&dev, model.spec(), host, false, 0).unwrap();
        let (logits, _) = model.forward(&dev, &batch).unwrap();
        let loss = model.loss(&dev, &batch, &logits, None).unwrap();
        assert!(loss.loss_sum.is_finite());
        predicted += loss.count;
    }
    assert_eq!(predicted, stream.len() - 1);
}

/// A pretrained model whose token table is smaller than its tokenizer's vocabulary is refused
/// before training, naming both files (an id past the table would have ended the run at the
/// first batch holding it).
#[test]
fn a_tokenizer_larger_than_the_model_is_refused_before_training() {
    let weights = manifest("weights/all-minilm-l6-v2");
    let data_dir = manifest("data");
    let rt = data_dir.join(pipetransformer::data::ROTTEN_TOMATOES_FILE);
    if !common::installed(&[&weights.join("tokenizer.json"), &rt]) {
        return;
    }
    let dir = pipetransformer::testing::Scratch::new("small-table");
    std::fs::copy(weights.join("tokenizer.json"), dir.join("tokenizer.json")).unwrap();
    let mut config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(weights.join("config.json")).unwrap()).unwrap();
    config["vocab_size"] = 1000.into();
    std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
    let overrides = [format!("model.pretrained={}", dir.display()), format!("data.dir={}", data_dir.display())];
    let run = pipetransformer::run::RunConfig::load(&manifest("configs/minilm-rt.toml"), &overrides).unwrap();
    let (_, info) = pipetransformer::run::prepare_data(&run, 1).unwrap();
    let dev = CpuDevice::<f32>::new(0, 1).unwrap();
    let err = pipetransformer::run::build_model(&dev, &run, &info, &|_| true).err().unwrap().to_string();
    assert!(err.contains("model.pretrained") && err.contains("tokenizer.json gives token ids up to 30521"), "{err}");
    assert!(err.contains("the model's table holds 1000"), "{err}");
}
