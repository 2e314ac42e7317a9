//! Weights in and out: the pretrained all-MiniLM-L6-v2 against PyTorch's outputs, export → load
//! round trips, and bad files (each a typed error naming the file and tensor, never a panic).

mod common;

use std::path::Path;

use pipetransformer::Error;
use pipetransformer::device::{CpuDevice, Device};
use pipetransformer::model::{Batch, HostBatch, Model, ModelConfig, Pooling};
use pipetransformer::testing::Scratch;
use pipetransformer::weights::{
    ExportExtras, LoadOptions, export_model, load_into_model, load_safetensors, read_hf_config, write_safetensors,
};
use serde::Deserialize;

const MINILM_DIR: &str = "weights/all-minilm-l6-v2";

/// A fresh, empty directory for one test, removed when it passes.
fn temp_dir(test: &str) -> Scratch {
    Scratch::new(&format!("weights-{test}"))
}

/// A safetensors file written by hand: `(name, dtype, shape, raw bytes)` per tensor, laid out in
/// order. `data_len` overrides how many data bytes are actually written (to truncate).
fn handmade(entries: &[(&str, &str, &[usize], Vec<u8>)], data_len: Option<usize>) -> Vec<u8> {
    let mut header = Vec::new();
    let mut data = Vec::new();
    for (name, dtype, shape, bytes) in entries {
        let (begin, end) = (data.len(), data.len() + bytes.len());
        header.push(format!(r#""{name}":{{"dtype":"{dtype}","shape":{shape:?},"data_offsets":[{begin},{end}]}}"#));
        data.extend_from_slice(bytes);
    }
    let header = format!("{{{}}}", header.join(","));
    let mut out = (header.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(header.as_bytes());
    data.truncate(data_len.unwrap_or(data.len()));
    out.extend_from_slice(&data);
    out
}

fn f32_bytes(n: usize, value: f32) -> Vec<u8> {
    (0..n).flat_map(|_| value.to_le_bytes()).collect()
}

fn weights_error(e: Error) -> (String, Option<String>, String) {
    match e {
        Error::Weights { file, tensor, message } => (file, tensor, message),
        other => panic!("expected Error::Weights, got {other:?}"),
    }
}

fn bits<D: Device>(dev: &D, model: &Model<D>) -> Vec<(String, Vec<u32>)> {
    model
        .params()
        .iter()
        .map(|p| (p.name.clone(), dev.download(&p.value).unwrap().iter().map(|x| x.to_bits()).collect()))
        .collect()
}

// ---- golden check against PyTorch --------------------------------------------------------

#[derive(Deserialize)]
struct Golden {
    torch: String,
    transformers: String,
    batch: usize,
    seq: usize,
    hidden: usize,
    input_ids: Vec<Vec<u32>>,
    token_type_ids: Vec<Vec<u32>>,
    attention_mask: Vec<Vec<u32>>,
    last_hidden_state: Vec<Vec<Vec<f32>>>,
    mean_pooled: Vec<Vec<f32>>,
}

/// Our BERT with all-MiniLM-L6-v2's weights reproduces `transformers.BertModel`'s
/// `last_hidden_state` (eval, f32) to 1e-4 at every position of a padded batch, and its
/// mean-pooled sentence embedding. The fixture comes from `scripts/make_golden.py`.
#[test]
fn minilm_matches_pytorch() {
    let weights = Path::new(MINILM_DIR).join("model.safetensors");
    if !common::installed(&[&weights]) {
        return;
    }
    let golden: Golden =
        serde_json::from_str(&std::fs::read_to_string("tests/fixtures/minilm_golden.json").unwrap()).unwrap();
    let (b, t, c) = (golden.batch, golden.seq, golden.hidden);

    let mut config = read_hf_config(Path::new(MINILM_DIR).join("config.json"), None).unwrap();
    let ModelConfig::Bert(bert) = &mut config else { panic!("MiniLM's config.json should read as BERT") };
    bert.pooling = Pooling::Mean;
    let dev = CpuDevice::<f32>::new(0, 0).unwrap();
    let mut model = Model::new(&dev, &config, 0).unwrap();
    let file = load_safetensors(&weights).unwrap();
    assert_eq!(file.tensors().len(), 104);
    let report = load_into_model(&mut model, &dev, &file, &LoadOptions::default()).unwrap();
    println!("{report}");
    assert_eq!(report.loaded.len(), 101);
    assert_eq!(report.missing, ["classifier.weight", "classifier.bias"]);
    let mut unexpected = report.unexpected.clone();
    unexpected.sort();
    assert_eq!(unexpected, ["pooler.dense.bias", "pooler.dense.weight"]);
    assert_eq!(report.ignored, ["embeddings.position_ids"]);

    let host = HostBatch {
        batch: b,
        seq: t,
        tokens: Some(golden.input_ids.concat()),
        token_types: Some(golden.token_type_ids.concat()),
        attention_mask: Some(golden.attention_mask.concat()),
        targets: vec![0; b],
        ..HostBatch::default()
    };
    let batch = Batch::upload(&dev, model.spec(), &host, false, 0).unwrap();
    let hidden = dev.download(&model.forward_hidden(&dev, &batch).unwrap()).unwrap();
    assert_eq!(hidden.len(), b * t * c);
    let at = |s: usize, p: usize, ch: usize| hidden[(s * t + p) * c + ch];

    let (mut max_hidden, mut max_mean) = (0f32, 0f32);
    for s in 0..b {
        for p in 0..t {
            for ch in 0..c {
                max_hidden = max_hidden.max((at(s, p, ch) - golden.last_hidden_state[s][p][ch]).abs());
            }
        }
        let real: Vec<usize> = (0..t).filter(|&p| golden.attention_mask[s][p] == 1).collect();
        for ch in 0..c {
            let mean = real.iter().map(|&p| at(s, p, ch)).sum::<f32>() / real.len() as f32;
            max_mean = max_mean.max((mean - golden.mean_pooled[s][ch]).abs());
        }
    }
    println!(
        "all-MiniLM-L6-v2 vs torch {} / transformers {}: max |Δ| over all {b}×{t}×{c} hidden values \
         {max_hidden:.2e}, mean-pooled {max_mean:.2e}",
        golden.torch, golden.transformers
    );
    for (what, d) in [("hidden states", max_hidden), ("mean-pooled", max_mean)] {
        assert!(d <= 1e-4, "{what} differ from PyTorch by {d:e} > 1e-4");
    }
}

// ---- export → load round trips ------------------------------------------------------------

/// Exports a model, loads the export into a differently initialised model of the same config
/// (strictly: every parameter from the file, every tensor used), and checks the parameters
/// bitwise and the config.
fn round_trip(config: ModelConfig, test: &str) -> pipetransformer::weights::LoadReport {
    let dir = temp_dir(test);
    let dev = CpuDevice::<f32>::new(0, 1).unwrap();
    let source = Model::new(&dev, &config, 1).unwrap();
    let exported = export_model(&source, &dev, &config, &ExportExtras::default(), &dir).unwrap();
    let mut target = Model::new(&dev, &config, 2).unwrap();
    assert_ne!(bits(&dev, &source), bits(&dev, &target));
    let file = load_safetensors(&exported.weights).unwrap();
    let report = load_into_model(&mut target, &dev, &file, &LoadOptions::strict()).unwrap();
    assert_eq!(bits(&dev, &source), bits(&dev, &target));
    assert_eq!(read_hf_config(&exported.config, None).unwrap(), config);
    // No temporary files are left behind: only the weights, the config and the companions.
    let mut names: Vec<_> =
        std::fs::read_dir(&dir).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
    names.sort();
    let mut expected: Vec<String> = ["config.json", "model.safetensors"].map(String::from).into();
    expected.extend(exported.companions.iter().map(|p| p.file_name().unwrap().to_string_lossy().into_owned()));
    expected.sort();
    assert_eq!(names, expected);
    report
}

#[test]
fn round_trip_bert_is_bitwise() {
    let report = round_trip(common::tiny_bert(Pooling::ClsPooler, 0.1), "rt-bert");
    assert!(report.loaded.iter().any(|n| n == "pooler.dense.weight"));
    assert!(report.missing.is_empty() && report.unexpected.is_empty() && report.tied.is_empty());
}

#[test]
fn round_trip_vit_is_bitwise() {
    round_trip(common::tiny_vit(0.0), "rt-vit");
}

/// The tied LM head is not written (as Hugging Face does) and comes back from the embedding.
#[test]
fn round_trip_gpt_restores_the_tied_head() {
    let config = common::tiny_gpt(0.0);
    let dev = CpuDevice::<f32>::new(0, 1).unwrap();
    let dir = temp_dir("gpt-tied");
    let exported =
        export_model(&Model::new(&dev, &config, 1).unwrap(), &dev, &config, &ExportExtras::default(), &dir).unwrap();
    assert_eq!(exported.skipped, ["lm_head.weight"]);
    let file = load_safetensors(&exported.weights).unwrap();
    assert!(file.get("lm_head.weight").is_none() && file.get("transformer.wte.weight").is_some());
    // GPT-2's layout, which GPT2LMHeadModel reads: q/k/v fused into a Conv1D `[in, 3·out]`.
    assert_eq!(file.get("transformer.h.0.attn.c_attn.weight").map(|t| t.shape.clone()), Some(vec![10, 30]));
    assert!(file.get("transformer.h.0.attn.q_proj.weight").is_none());
    let report = round_trip(config, "rt-gpt");
    assert_eq!(report.tied, ["lm_head.weight"]);
    assert!(!report.loaded.iter().any(|n| n == "lm_head.weight"));
}

/// A caller's tensor whose values disagree with its shape is refused by name before anything
/// is written, not a panic in GPT-2's transposes.
#[test]
fn export_values_refuses_a_tensor_whose_values_disagree_with_its_shape() {
    use pipetransformer::pipeline::{Pipeline, PipelineConfig, unit_profiles_per_sample};
    let config = common::tiny_gpt(0.0);
    let dev = CpuDevice::<f32>::new(0, 1).unwrap();
    let mut model = Model::new(&dev, &config, 1).unwrap();
    let profiles = unit_profiles_per_sample(&dev, &mut model, &common::tiny_batch(&config, 0), false).unwrap();
    let optimizer = pipetransformer::optim::OptimizerConfig::default();
    let pipeline = Pipeline::new(vec![dev], model, optimizer, PipelineConfig::default(), &profiles).unwrap();
    let mut tensors = pipeline.parameter_tensors().unwrap();
    let at = tensors.iter().position(|t| t.shape.len() == 2 && !t.name.contains("wte")).unwrap();
    let name = tensors[at].name.clone();
    tensors[at].values.pop();
    let dir = temp_dir("export-short");
    let out = dir.join("model");
    let spec = config.spec().unwrap();
    let e = pipetransformer::weights::export_values(&spec, tensors, &config, &ExportExtras::default(), &out);
    let Err(Error::Config { message, .. }) = e else { panic!("expected a config error, got {e:?}") };
    assert!(message.contains(&format!("tensor {name} has")) && message.contains("expected their product"), "{message}");
    assert!(!out.exists());
}

/// A stage process's model (`Model::new_keeping`) loads the values of the units it keeps
/// only: the others stay hollow and are reported as held by other processes, after the file
/// was checked against every parameter's shape. GPT keeps its last two units (the tied head,
/// whose embedding is hollow, and the final norm), BERT every other unit.
#[test]
fn a_hollow_unit_is_checked_but_not_loaded() {
    let dev = CpuDevice::<f32>::new(0, 1).unwrap();
    let dir = temp_dir("hollow");
    let gpt = common::tiny_gpt(0.0);
    let last_two = |n: usize| move |u: usize| u + 2 >= n;
    for (config, keep) in [
        (gpt.clone(), Box::new(last_two(7)) as Box<dyn Fn(usize) -> bool>),
        (common::tiny_bert(Pooling::ClsPooler, 0.1), Box::new(|u: usize| u % 2 == 1)),
    ] {
        let source = Model::new(&dev, &config, 1).unwrap();
        let exported = export_model(&source, &dev, &config, &ExportExtras::default(), &dir).unwrap();
        let file = load_safetensors(&exported.weights).unwrap();
        let mut target = Model::new_keeping(&dev, &config, 2, &keep).unwrap();
        let report = load_into_model(&mut target, &dev, &file, &LoadOptions::strict()).unwrap();
        for (u, (a, b)) in source.units().iter().zip(target.units()).enumerate() {
            for (p, q) in a.params().iter().zip(b.params()) {
                let held_elsewhere = report.held_elsewhere.contains(&q.name);
                assert_eq!(q.is_hollow(), !keep(u), "{}", q.name);
                assert_eq!(held_elsewhere, q.is_hollow(), "{}", q.name);
                if !q.is_hollow() {
                    assert_eq!(dev.download(&p.value).unwrap(), dev.download(&q.value).unwrap(), "{}", q.name);
                }
            }
        }
        let held = format!("{} held by other processes", report.held_elsewhere.len());
        assert!(report.to_string().contains(&held), "{report}");
    }
    // A wrong shape is refused for a hollow parameter too (GPT's position table, in the
    // hollow embedding only).
    let exported =
        export_model(&Model::new(&dev, &gpt, 1).unwrap(), &dev, &gpt, &ExportExtras::default(), &dir).unwrap();
    let file = load_safetensors(&exported.weights).unwrap();
    let mut wrong = gpt.clone();
    if let ModelConfig::Gpt(c) = &mut wrong {
        c.n_positions += 1;
    }
    let mut other = Model::new_keeping(&dev, &wrong, 2, &last_two(7)).unwrap();
    let e = load_into_model(&mut other, &dev, &file, &LoadOptions::strict()).unwrap_err().to_string();
    assert!(e.contains("shape") && e.contains("wpe"), "{e}");
}

/// A `BertForSequenceClassification`-style file (`bert.` prefix, its own classifier) loads
/// into our BERT; the classifier comes from the file.
#[test]
fn bert_prefix_is_stripped() {
    let config = common::tiny_bert(Pooling::ClsPooler, 0.0);
    let dev = CpuDevice::<f32>::new(0, 1).unwrap();
    let source = Model::new(&dev, &config, 3).unwrap();
    let host: Vec<(String, Vec<usize>, Vec<f32>)> = source
        .params()
        .iter()
        .map(|p| {
            let name = if p.name.starts_with("classifier.") { p.name.clone() } else { format!("bert.{}", p.name) };
            (name, p.shape.clone(), dev.download(&p.value).unwrap())
        })
        .collect();
    let refs: Vec<_> =
        host.iter().map(|(n, s, v)| pipetransformer::weights::TensorRef { name: n, shape: s, values: v }).collect();
    let mut bytes = Vec::new();
    write_safetensors(&mut bytes, &refs).unwrap();
    let scratch = temp_dir("prefix");
    let path = scratch.join("model.safetensors");
    std::fs::write(&path, bytes).unwrap();
    let mut target = Model::new(&dev, &config, 4).unwrap();
    let report = load_into_model(&mut target, &dev, &load_safetensors(&path).unwrap(), &LoadOptions::strict()).unwrap();
    assert_eq!(report.loaded.len(), source.params().len());
    assert_eq!(bits(&dev, &source), bits(&dev, &target));
}

// ---- bad input ----------------------------------------------------------------------------

#[test]
fn missing_file_is_an_io_error_naming_it() {
    let scratch = temp_dir("missing");
    let path = scratch.join("nope.safetensors");
    match load_safetensors(&path) {
        Err(Error::Io { path: p, .. }) => assert!(p.ends_with("nope.safetensors"), "{p}"),
        other => panic!("expected Error::Io, got {:?}", other.err()),
    }
}

#[test]
fn shorter_than_the_length_field() {
    let scratch = temp_dir("short");
    let path = scratch.join("short.safetensors");
    std::fs::write(&path, [1, 2, 3]).unwrap();
    let (file, tensor, message) = weights_error(load_safetensors(&path).err().unwrap());
    assert!(file.ends_with("short.safetensors") && tensor.is_none());
    assert!(message.contains("3 bytes") && message.contains("8-byte header length"), "{message}");
}

#[test]
fn header_length_past_the_end() {
    let scratch = temp_dir("header");
    let path = scratch.join("header.safetensors");
    let mut bytes = handmade(&[("w", "F32", &[2], f32_bytes(2, 1.0))], None);
    bytes[..8].copy_from_slice(&10_000u64.to_le_bytes());
    std::fs::write(&path, &bytes).unwrap();
    let (file, tensor, message) = weights_error(load_safetensors(&path).err().unwrap());
    assert!(file.ends_with("header.safetensors") && tensor.is_none());
    assert!(message.contains("header length 10000 runs past the end of the file"), "{message}");
}

#[test]
fn data_past_the_end() {
    let scratch = temp_dir("data");
    let path = scratch.join("data.safetensors");
    let entries = [("a", "F32", &[2][..], f32_bytes(2, 1.0)), ("b", "F32", &[3][..], f32_bytes(3, 2.0))];
    std::fs::write(&path, handmade(&entries, Some(16))).unwrap();
    let (file, tensor, message) = weights_error(load_safetensors(&path).err().unwrap());
    assert!(file.ends_with("data.safetensors"));
    assert_eq!(tensor.as_deref(), Some("b"));
    assert!(message.contains("data_offsets [8, 20) run past the end of the data section (16 bytes)"), "{message}");
}

#[test]
fn header_not_json() {
    let scratch = temp_dir("json");
    let path = scratch.join("json.safetensors");
    let mut bytes = 5u64.to_le_bytes().to_vec();
    bytes.extend_from_slice(b"{oops");
    std::fs::write(&path, &bytes).unwrap();
    let (_, tensor, message) = weights_error(load_safetensors(&path).err().unwrap());
    assert!(tensor.is_none() && message.contains("not valid JSON"), "{message}");
}

/// The tiny BERT's word embedding table is `[13, 10]`.
#[test]
fn wrong_shape_names_both_shapes_and_leaves_the_model_unchanged() {
    let config = common::tiny_bert(Pooling::Mean, 0.0);
    let dev = CpuDevice::<f32>::new(0, 1).unwrap();
    let mut model = Model::new(&dev, &config, 0).unwrap();
    let before = bits(&dev, &model);
    let scratch = temp_dir("shape");
    let path = scratch.join("shape.safetensors");
    let entries = [
        ("embeddings.LayerNorm.weight", "F32", &[10][..], f32_bytes(10, 2.0)),
        ("embeddings.word_embeddings.weight", "F32", &[10, 13][..], f32_bytes(130, 0.5)),
    ];
    std::fs::write(&path, handmade(&entries, None)).unwrap();
    let file = load_safetensors(&path).unwrap();
    let e = load_into_model(&mut model, &dev, &file, &LoadOptions::default()).err().unwrap();
    let (file_name, tensor, message) = weights_error(e);
    assert!(file_name.ends_with("shape.safetensors"));
    assert_eq!(tensor.as_deref(), Some("embeddings.word_embeddings.weight"));
    assert!(message.contains("shape [10, 13] in the file") && message.contains("has shape [13, 10]"), "{message}");
    assert_eq!(bits(&dev, &model), before, "a failed load must not change the model");
}

#[test]
fn integer_dtype_for_a_weight() {
    let config = common::tiny_bert(Pooling::Mean, 0.0);
    let dev = CpuDevice::<f32>::new(0, 1).unwrap();
    let mut model = Model::new(&dev, &config, 0).unwrap();
    let scratch = temp_dir("dtype");
    let path = scratch.join("dtype.safetensors");
    let entries = [("embeddings.word_embeddings.weight", "I64", &[13, 10][..], vec![0u8; 8 * 130])];
    std::fs::write(&path, handmade(&entries, None)).unwrap();
    let file = load_safetensors(&path).unwrap();
    let (file_name, tensor, message) =
        weights_error(load_into_model(&mut model, &dev, &file, &LoadOptions::default()).err().unwrap());
    assert!(file_name.ends_with("dtype.safetensors"));
    assert_eq!(tensor.as_deref(), Some("embeddings.word_embeddings.weight"));
    assert!(message.contains("dtype I64") && message.contains("expected F32, F16, BF16 or F64"), "{message}");
}

/// A file lacking encoder weights fails (the head may be missing, the encoder may not); one
/// lacking only the head loads, reports the head missing, and keeps its initialisation.
#[test]
fn missing_tensors() {
    let config = common::tiny_bert(Pooling::ClsPooler, 0.0);
    let dev = CpuDevice::<f32>::new(0, 1).unwrap();
    let source = Model::new(&dev, &config, 5).unwrap();
    let encoder: Vec<(String, Vec<usize>, Vec<f32>)> = source
        .params()
        .iter()
        .filter(|p| !p.name.starts_with("classifier.") && !p.name.starts_with("pooler."))
        .map(|p| (p.name.clone(), p.shape.clone(), dev.download(&p.value).unwrap()))
        .collect();
    let write = |skip: usize, name: &str| {
        let refs: Vec<_> = encoder
            .iter()
            .skip(skip)
            .map(|(n, s, v)| pipetransformer::weights::TensorRef { name: n, shape: s, values: v })
            .collect();
        let mut bytes = Vec::new();
        write_safetensors(&mut bytes, &refs).unwrap();
        let scratch = temp_dir(name);
        let path = scratch.join("m.safetensors");
        std::fs::write(&path, bytes).unwrap();
        (load_safetensors(path).unwrap(), scratch)
    };

    let mut model = Model::new(&dev, &config, 6).unwrap();
    let head_before: Vec<_> = bits(&dev, &model)
        .into_iter()
        .filter(|(n, _)| n.starts_with("classifier.") || n.starts_with("pooler."))
        .collect();
    let report = load_into_model(&mut model, &dev, &write(0, "missing-head").0, &LoadOptions::default()).unwrap();
    assert_eq!(report.missing, ["pooler.dense.weight", "pooler.dense.bias", "classifier.weight", "classifier.bias"]);
    let head_after: Vec<_> = bits(&dev, &model)
        .into_iter()
        .filter(|(n, _)| n.starts_with("classifier.") || n.starts_with("pooler."))
        .collect();
    assert_eq!(head_before, head_after);
    // Strict loading refuses the same file.
    let e = load_into_model(&mut model, &dev, &write(0, "missing-strict").0, &LoadOptions::strict()).err().unwrap();
    assert_eq!(weights_error(e).1.as_deref(), Some("pooler.dense.weight"));

    // Without the word embeddings the load fails and names them.
    let e = load_into_model(&mut model, &dev, &write(1, "missing-encoder").0, &LoadOptions::default()).err().unwrap();
    let (_, tensor, message) = weights_error(e);
    assert_eq!(tensor.as_deref(), Some("embeddings.word_embeddings.weight"));
    assert!(message.contains("embeddings.word_embeddings.weight [13, 10] is not in the file"), "{message}");
}

#[test]
fn unexpected_tensors_are_reported_or_refused() {
    let config = common::tiny_bert(Pooling::Mean, 0.0);
    let dev = CpuDevice::<f32>::new(0, 1).unwrap();
    let dir = temp_dir("unexpected");
    let exported =
        export_model(&Model::new(&dev, &config, 1).unwrap(), &dev, &config, &ExportExtras::default(), &dir).unwrap();
    // Append an extra tensor by rewriting the file with one more entry.
    let file = load_safetensors(&exported.weights).unwrap();
    let host: Vec<_> =
        file.tensors().iter().map(|t| (t.name.clone(), t.shape.clone(), file.read_f32(t).unwrap())).collect();
    let extra = vec![1.0f32; 3];
    let mut refs: Vec<_> =
        host.iter().map(|(n, s, v)| pipetransformer::weights::TensorRef { name: n, shape: s, values: v }).collect();
    refs.push(pipetransformer::weights::TensorRef { name: "cls.predictions.bias", shape: &[3], values: &extra });
    let mut bytes = Vec::new();
    write_safetensors(&mut bytes, &refs).unwrap();
    let path = dir.join("extra.safetensors");
    std::fs::write(&path, bytes).unwrap();
    let file = load_safetensors(&path).unwrap();
    let mut model = Model::new(&dev, &config, 2).unwrap();
    let report = load_into_model(&mut model, &dev, &file, &LoadOptions::default()).unwrap();
    assert_eq!(report.unexpected, ["cls.predictions.bias"]);
    let e = load_into_model(&mut model, &dev, &file, &LoadOptions::strict()).err().unwrap();
    assert_eq!(weights_error(e).1.as_deref(), Some("cls.predictions.bias"));
}

#[test]
fn unsupported_architecture_in_config_json() {
    let scratch = temp_dir("llama");
    let path = scratch.join("config.json");
    std::fs::write(&path, r#"{"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 576}"#)
        .unwrap();
    match read_hf_config(&path, None) {
        Err(Error::Config { field, message }) => {
            assert_eq!(field, "model_type");
            assert!(message.contains("unsupported architecture `llama`; supported: bert"), "{message}");
            assert!(message.contains("config.json"), "{message}");
        }
        other => panic!("expected Error::Config, got {other:?}"),
    }
    // A missing config.json is an I/O error naming it.
    assert!(matches!(read_hf_config(path.with_file_name("absent.json"), None), Err(Error::Io { .. })));
}
