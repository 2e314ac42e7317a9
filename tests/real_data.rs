//! Short training runs on the real data `scripts/setup.sh` installs (the README's test command
//! runs it first). Without the files the tests print a note and pass, except under CI
//! (`CI` set), where missing data is a failure.

mod common;

use pipetransformer::device::{AnyDevices, DeviceKind, Precision};
use pipetransformer::run::{Job, RunConfig, open_devices, prepare_data};
use std::path::Path;

fn have(paths: &[&str]) -> bool {
    common::installed(&paths.iter().map(Path::new).collect::<Vec<_>>())
}

fn run(config: &str, overrides: &[&str]) -> pipetransformer::run::Summary {
    run_then(config, overrides, |_, _| {})
}

/// [`run`], then `check` on the run's output directory and config before it is removed.
fn run_then(config: &str, overrides: &[&str], check: impl FnOnce(&Path, &RunConfig)) -> pipetransformer::run::Summary {
    let scratch = pipetransformer::testing::Scratch::new(&format!("real-{}", config.replace('/', "_")));
    let out = scratch.join("out");
    let mut sets: Vec<String> = overrides.iter().map(|s| s.to_string()).collect();
    sets.push(format!("output.dir={}", out.display()));
    let config = RunConfig::load(Path::new(config), &sets).unwrap();
    let (_, count) = config.pipeline.resolve().unwrap();
    let AnyDevices::Cpu(devices) = open_devices(DeviceKind::Cpu, count, 0, Precision::F32).unwrap() else {
        unreachable!("cpu devices")
    };
    let mut job = Job::new(devices, config.clone()).unwrap();
    let summary = job.run(&mut |_| {}).unwrap();
    check(&out, &config);
    summary
}

#[test]
fn minilm_on_a_slice_of_rotten_tomatoes_beats_70_percent() {
    if !have(&["weights/all-minilm-l6-v2/model.safetensors", "data/text/rotten_tomatoes_corpus_full.csv.bz2"]) {
        return;
    }
    // The main job's whole PipeTransformer system on a slice: 1,600 training snippets, two
    // epochs of 100 steps of 16, Eq. 1 every 50 steps (so the cache filled in the first epoch
    // serves the second); 600 held-out snippets.
    // The export, loaded as `predict` and `evaluate` load it: the same test-split metrics as
    // the run's own evaluation (on the pipeline there, a predictor here), and clear reviews classified.
    let exported = std::cell::Cell::new(None);
    let s = run_then(
        "configs/minilm-rt.toml",
        &[
            "data.train_limit=1600",
            "data.test_limit=600",
            "data.batch_size=16",
            "data.max_len=48",
            "elastic.freeze_interval=50",
            // The shapes asserted below are the planner's, not a timing's (AutoPipe's trial of
            // pipeline lengths has its own test in tests/elastic.rs).
            "elastic.time_pipeline_len=false",
            "output.checkpoint_every=0",
        ],
        |out, config| {
            let dev = pipetransformer::device::CpuDevice::<f32>::new(0, 0).unwrap();
            let p = pipetransformer::run::Predictor::load(dev, &out.join("model")).unwrap();
            let metrics = p.evaluate_dataset(config).unwrap();
            let texts = ["a moving, funny and beautiful film", "dull, tedious and a waste of time"];
            let labels: Vec<String> = p.classify_texts(&texts).unwrap().into_iter().map(|c| c.label).collect();
            // A text longer than the positions is cut, and says so.
            let long = "a moving, funny film ".repeat(200);
            let cut = p.classify_texts(&[texts[0], &long]).unwrap();
            assert!(cut[0].warning.is_none() && cut[1].warning.as_ref().is_some_and(|w| w.contains("cut")), "{cut:?}");
            exported.set(Some((metrics, labels)));
        },
    );
    let (metrics, labels) = exported.take().unwrap();
    let eval = s.eval.clone().unwrap();
    assert_eq!((metrics.count, metrics.accuracy), (eval.count, eval.accuracy), "{metrics} vs {eval}");
    assert!((metrics.loss - eval.loss).abs() <= 1e-5 * eval.loss, "{metrics} vs {eval}");
    assert_eq!(labels, ["fresh", "rotten"]);
    let acc = s.eval.unwrap().accuracy;
    eprintln!(
        "MiniLM on Rotten Tomatoes slice: {} steps, accuracy {:.2}%, {} frozen layers, K R M = {} {} {}",
        s.steps,
        100.0 * acc,
        s.frozen_layers,
        s.final_plan.pipeline_len,
        s.final_plan.replicas,
        s.final_plan.micro_batches
    );
    assert_eq!(s.steps, 200);
    assert!(s.frozen_layers >= 2, "the freeze rule ran three times: {}", s.frozen_layers);
    // The config's `freed_devices = "threads"`: the freed device lends its thread instead of
    // becoming a replica.
    assert_eq!((s.final_plan.pipeline_len, s.final_plan.replicas), (1, 1), "one stage on one device at the end");
    assert!(acc > 0.70, "accuracy {acc}");
}

#[test]
fn vit_on_digits_beats_90_percent() {
    if !have(&["data/digits/digits.csv.gz"]) {
        return;
    }
    let s = run("configs/vit-digits.toml", &[]);
    let acc = s.eval.unwrap().accuracy;
    eprintln!("ViT on digits: {} steps, accuracy {:.2}%", s.steps, 100.0 * acc);
    assert!(acc > 0.90, "accuracy {acc}");
}

#[test]
fn every_shipped_config_parses() {
    for entry in std::fs::read_dir("configs").unwrap() {
        let path = entry.unwrap().path();
        RunConfig::load(&path, &[]).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    }
}

/// `data.validation_fraction` through the job's data: the run trains on the rest of the
/// training half and evaluates on the part carved off, and says so; the test split is unused.
#[test]
fn a_validation_part_replaces_the_test_split() {
    if !have(&["data/digits/digits.csv.gz"]) {
        return;
    }
    let load = |sets: &[&str]| {
        let sets: Vec<String> = sets.iter().map(|s| s.to_string()).collect();
        prepare_data(&RunConfig::load(Path::new("configs/vit-digits.toml"), &sets).unwrap(), 1).unwrap().1
    };
    let (plain, held) = (load(&[]), load(&["data.validation_fraction=0.25"]));
    assert_eq!((plain.evaluated_on.as_str(), held.evaluated_on.as_str()), ("test", "validation"));
    assert_eq!(held.train + held.test, plain.train, "carved from the training half");
    let quarter = plain.train as f64 / 4.0;
    assert!((held.test as f64 - quarter).abs() <= 10.0, "{} of {}", held.test, plain.train);
}

/// A `data.max_len` past the model's position table is refused by that key when the job is
/// built, not at the first long enough batch mid-run (MiniLM holds 512 positions).
#[test]
fn a_max_len_past_the_position_table_is_refused_by_its_key() {
    if !have(&["weights/all-minilm-l6-v2/model.safetensors", "data/text/rotten_tomatoes_corpus_full.csv.bz2"]) {
        return;
    }
    let scratch = pipetransformer::testing::Scratch::new("real-max-len");
    let out = scratch.join("out");
    let job = |max_len: usize| {
        let sets =
            [format!("data.max_len={max_len}"), "data.train_limit=64".into(), format!("output.dir={}", out.display())];
        let config = RunConfig::load(Path::new("configs/minilm-rt.toml"), &sets).unwrap();
        let AnyDevices::Cpu(devices) = open_devices(DeviceKind::Cpu, 2, 0, Precision::F32).unwrap() else {
            unreachable!("cpu devices")
        };
        Job::new(devices, config).map(|_| ())
    };
    let err = job(513).unwrap_err().to_string();
    assert!(err.contains("data.max_len") && err.contains("513") && err.contains("holds 512"), "{err}");
    job(512).unwrap();
    assert!(!out.join("metrics.jsonl").exists(), "nothing written by building a job");
}

/// `train.freeze_embeddings` reaches the plan, not only the training (the trainer alone would
/// freeze the embedding after the plan was made): its profile is charged the forward only, and
/// stage 0's planned memory holds no gradient or moments for the word table.
#[test]
fn a_frozen_embedding_is_planned_as_frozen() {
    if !have(&["weights/all-minilm-l6-v2/model.safetensors", "data/text/rotten_tomatoes_corpus_full.csv.bz2"]) {
        return;
    }
    let out = pipetransformer::testing::Scratch::new("real-planned");
    let planned = |frozen: bool| {
        // Costs from FLOPs, not timed (AutoPipe off): the same stages whatever else runs.
        let sets = [
            format!("train.freeze_embeddings={frozen}"),
            "data.train_limit=64".into(),
            "elastic.freeze=\"off\"".into(),
            "elastic.auto_pipe=false".into(),
            "elastic.auto_dp=false".into(),
            "elastic.cache=false".into(),
            format!("output.dir={}", out.display()),
        ];
        let config = RunConfig::load(Path::new("configs/minilm-rt.toml"), &sets).unwrap();
        let AnyDevices::Cpu(devices) = open_devices(DeviceKind::Cpu, 2, 0, Precision::F32).unwrap() else {
            unreachable!("cpu devices")
        };
        let job = Job::new(devices, config).unwrap();
        let plan = job.trainer.pipeline.plan();
        (job.trainer.profiles[0].trainable, plan.partition.stage_memory[0], plan.partition.stages.clone())
    };
    let ((trains, trained_bytes, stages), (still_trains, frozen_bytes, same)) = (planned(false), planned(true));
    assert!(trains && !still_trains);
    assert_eq!(stages, same);
    // The word table's gradient and two moments: 3 × 30,522 × 384 f32.
    let table_state = 3 * 30_522 * 384 * 4;
    assert!(trained_bytes >= frozen_bytes + table_state, "stage 0: {trained_bytes} B trained, {frozen_bytes} B frozen");
}
