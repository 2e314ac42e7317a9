//! Bad input gives a typed error naming the field and what was expected; nothing panics.

mod common;

use pipetransformer::Error;
use pipetransformer::device::{CpuDevice, Device};
use pipetransformer::model::{Batch, BertConfig, HostBatch, Model, ModelConfig, Pooling};

fn bert() -> BertConfig {
    match common::tiny_bert(Pooling::Mean, 0.0) {
        ModelConfig::Bert(c) => c,
        _ => unreachable!(),
    }
}

fn config_error(config: ModelConfig) -> (String, String) {
    let dev = CpuDevice::<f32>::new(0, 1).unwrap();
    match Model::new(&dev, &config, 0) {
        Err(Error::Config { field, message }) => (field, message),
        Err(e) => panic!("expected a config error, got {e}"),
        Ok(_) => panic!("expected a config error, got a model"),
    }
}

#[test]
fn hidden_size_not_divisible_by_heads() {
    let (field, message) =
        config_error(ModelConfig::Bert(BertConfig { hidden_size: 10, num_attention_heads: 3, ..bert() }));
    assert_eq!(field, "bert.hidden_size");
    assert!(message.contains("multiple of num_attention_heads = 3"), "{message}");
}

#[test]
fn zero_layers() {
    let (field, message) = config_error(ModelConfig::Bert(BertConfig { num_hidden_layers: 0, ..bert() }));
    assert_eq!(field, "bert.num_hidden_layers");
    assert!(message.contains("at least 1"), "{message}");
    let ModelConfig::Gpt(g) = common::tiny_gpt(0.0) else { unreachable!() };
    let (field, _) = config_error(ModelConfig::Gpt(pipetransformer::model::GptConfig { n_layer: 0, ..g }));
    assert_eq!(field, "gpt.n_layer");
}

#[test]
fn unknown_activation() {
    let (field, message) = config_error(ModelConfig::Bert(BertConfig { hidden_act: "relu".into(), ..bert() }));
    assert_eq!(field, "bert.hidden_act");
    assert!(message.contains("unknown activation `relu`") && message.contains("gelu_new"), "{message}");
}

#[test]
fn out_of_range_dropout_and_patch_size() {
    let (field, _) = config_error(ModelConfig::Bert(BertConfig { hidden_dropout_prob: 1.0, ..bert() }));
    assert_eq!(field, "bert.hidden_dropout_prob");
    let ModelConfig::Vit(v) = common::tiny_vit(0.0) else { unreachable!() };
    let (field, message) = config_error(ModelConfig::Vit(pipetransformer::model::VitConfig { patch_size: 4, ..v }));
    assert_eq!(field, "vit.patch_size");
    assert!(message.contains("does not divide image_size 6"), "{message}");
}

#[test]
fn sequence_longer_than_the_position_table() {
    let dev = CpuDevice::<f32>::new(0, 1).unwrap();
    let config = ModelConfig::Bert(bert());
    let model = Model::new(&dev, &config, 0).unwrap();
    let host = HostBatch { batch: 1, seq: 10, tokens: Some(vec![1; 10]), targets: vec![0], ..Default::default() };
    let Err(Error::Data { what, message }) = Batch::upload(&dev, model.spec(), &host, true, 0) else {
        panic!("expected a data error")
    };
    assert_eq!(what, "tokens");
    assert_eq!(message, "sequence length 10 exceeds the position table (9 positions)");
}

#[test]
fn mismatched_shapes() {
    let dev = CpuDevice::<f32>::new(0, 1).unwrap();
    let model = Model::new(&dev, &ModelConfig::Bert(bert()), 0).unwrap();
    // A batch whose token count does not match batch × seq.
    let host = HostBatch { batch: 2, seq: 4, tokens: Some(vec![1; 7]), targets: vec![0, 1], ..Default::default() };
    let err = Batch::upload(&dev, model.spec(), &host, true, 0).err().expect("error");
    assert_eq!(err.to_string(), "tokens: has 7 values, expected 8");
    // Targets of the wrong length.
    let host = HostBatch { batch: 2, seq: 4, tokens: Some(vec![1; 8]), targets: vec![0], ..Default::default() };
    let err = Batch::upload(&dev, model.spec(), &host, true, 0).err().expect("error");
    assert_eq!(err.to_string(), "targets: has 1 values, expected 2");
    // An op handed buffers of the wrong size.
    let x = dev.zeros(12).unwrap();
    let w = dev.zeros(6).unwrap();
    let mut out = dev.alloc(5).unwrap();
    let err = dev.linear_forward(&mut out, &x, &w, None, 4, 3, 2).unwrap_err();
    assert!(matches!(err, Error::Shape { arg: "out", expected: 8, got: 5, .. }), "{err}");
}

#[test]
fn token_and_label_out_of_range() {
    let dev = CpuDevice::<f32>::new(0, 1).unwrap();
    let mut model = Model::new(&dev, &ModelConfig::Bert(bert()), 0).unwrap();
    let host = HostBatch { batch: 1, seq: 3, tokens: Some(vec![1, 99, 2]), targets: vec![0], ..Default::default() };
    let batch = Batch::upload(&dev, model.spec(), &host, true, 0).unwrap();
    let err = model.forward_backward(&dev, &batch).unwrap_err();
    assert!(matches!(&err, Error::Data { .. }) && err.to_string().contains("id 99"), "{err}");
    let host = HostBatch { batch: 1, seq: 3, tokens: Some(vec![1, 2, 3]), targets: vec![7], ..Default::default() };
    let batch = Batch::upload(&dev, model.spec(), &host, true, 0).unwrap();
    let err = model.forward_backward(&dev, &batch).unwrap_err();
    assert!(err.to_string().contains("label 7 is out of range"), "{err}");
}

#[test]
fn configs_round_trip_through_json_with_hugging_face_names() {
    let json = r#"{"family": "bert", "vocab_size": 30522, "hidden_size": 384, "num_hidden_layers": 6,
        "num_attention_heads": 12, "intermediate_size": 1536, "hidden_act": "gelu",
        "max_position_embeddings": 512, "type_vocab_size": 2, "layer_norm_eps": 1e-12,
        "architectures": ["BertModel"], "model_type": "bert"}"#;
    let config: ModelConfig = serde_json::from_str(json).unwrap();
    let spec = config.spec().unwrap();
    assert_eq!((spec.hidden, spec.heads, spec.layers), (384, 12, 6));
    let back: ModelConfig = serde_json::from_str(&serde_json::to_string(&config).unwrap()).unwrap();
    assert_eq!(back, config);
}

/// `scripts/time_to_accuracy.py` refuses, before running anything, an output folder that
/// already holds files (a fresh run would overwrite them: the file stays as it was) and a
/// binary that is not there, each with a message naming it. Skipped without `python3`.
#[test]
fn the_time_to_accuracy_script_refuses_a_used_folder_and_a_missing_binary() {
    use std::process::Command;
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/scripts/time_to_accuracy.py");
    if Command::new("python3").arg("--version").output().is_err() {
        eprintln!("python3 not found: skipped");
        return;
    }
    let dir = pipetransformer::testing::Scratch::new("time-to-accuracy");
    let used = dir.join("used");
    std::fs::create_dir_all(&used).unwrap();
    std::fs::write(used.join("metrics.jsonl"), "earlier run\n").unwrap();
    let run = |out: &std::path::Path, binary: &str| {
        let o = Command::new("python3").arg(script).arg(out).args(["--binary", binary]).output().unwrap();
        (o.status.success(), String::from_utf8_lossy(&o.stderr).into_owned())
    };
    let (ok, err) = run(&used, "/bin/true");
    assert!(!ok && err.contains("already holds files") && !err.contains("Traceback"), "{err}");
    assert_eq!(std::fs::read_to_string(used.join("metrics.jsonl")).unwrap(), "earlier run\n");
    let missing = dir.join("no-such-binary");
    let (ok, err) = run(&dir.join("new"), missing.to_str().unwrap());
    assert!(!ok && err.contains("no such program") && !err.contains("Traceback"), "{err}");
    assert!(!dir.join("new").exists(), "nothing made for a run that did not start");
}

/// A batch whose fields disagree with its sample and token counts (a library user's own
/// batch source) is refused naming the field, by every cut the pipeline makes of it, not a
/// slice panic.
#[test]
fn a_batch_whose_fields_disagree_with_its_size_is_refused_by_every_cut() {
    let good = HostBatch { batch: 2, seq: 4, tokens: Some(vec![1; 8]), targets: vec![0; 8], ..Default::default() };
    assert!(good.split(2).is_ok() && good.select(&[1]).is_ok() && good.token_slices(&[2, 2]).is_ok());
    let bad = [
        ("tokens", HostBatch { tokens: Some(vec![1; 7]), ..good.clone() }),
        ("token_types", HostBatch { token_types: Some(vec![0; 3]), ..good.clone() }),
        ("attention_mask", HostBatch { attention_mask: Some(vec![1; 9]), ..good.clone() }),
        ("targets", HostBatch { targets: vec![0; 5], ..good.clone() }),
        ("sample_ids", HostBatch { sample_ids: vec![0; 3], ..good.clone() }),
        ("pixels", HostBatch { tokens: None, targets: vec![0; 2], pixels: Some(vec![0.0; 5]), ..good.clone() }),
    ];
    for (field, host) in bad {
        let cuts =
            [host.split(2).map(|_| ()), host.select(&[1, 0]).map(|_| ()), host.token_slices(&[2, 2]).map(|_| ())];
        for cut in cuts {
            let Err(Error::Data { what, message }) = cut else { panic!("{field}: expected a data error, got {cut:?}") };
            assert_eq!(what, field, "{message}");
        }
    }
}

/// A model put back together from parts whose tie names a unit they no longer hold (a
/// library caller that dropped units) is refused, not a panic at the first step.
#[test]
fn a_model_from_parts_with_a_tie_past_its_units_is_refused() {
    let dev = CpuDevice::<f32>::new(0, 1).unwrap();
    let model = Model::new(&dev, &common::tiny_gpt(0.0), 0).unwrap();
    let tied = model.tied().cloned();
    assert!(tied.is_some(), "a GPT ties its LM head to the embedding");
    let mut parts = model.into_parts();
    parts.units.pop();
    let Err(Error::Config { field, message }) = Model::from_parts(parts) else { panic!("expected a config error") };
    assert!(field == "tied" && message.contains("expected two parameters of the units"), "{message}");
    let parts = Model::new(&dev, &common::tiny_gpt(0.0), 0).unwrap().into_parts();
    assert!(Model::from_parts(parts).is_ok_and(|m| m.tied().cloned() == tied));
}

/// A sample index past the batch is an error naming it, not a slice panic.
#[test]
fn selecting_a_sample_past_the_batch() {
    let host = HostBatch { batch: 2, seq: 8, tokens: Some(vec![1; 16]), targets: vec![0, 1], ..Default::default() };
    assert_eq!(host.select(&[1, 0]).unwrap().tokens.map(|t| t.len()), Some(16));
    let Err(Error::Data { what, message }) = host.select(&[0, 5]) else { panic!("expected a data error") };
    assert!(what == "sample index" && message.contains("5 selected from a batch of 2 samples"), "{message}");
}
