//! Short training runs on the real data `scripts/setup.sh` installs (the README's test command
//! runs it first). Without the files the tests print a note and pass, except under CI
//! (`CI` set), where missing data is a failure.

use pipetransformer::device::CpuDevice;
use pipetransformer::run::{Job, RunConfig};
use std::path::Path;

fn have(paths: &[&str]) -> bool {
    let missing: Vec<&&str> = paths.iter().filter(|p| !Path::new(p).exists()).collect();
    if missing.is_empty() {
        return true;
    }
    assert!(std::env::var_os("CI").is_none(), "CI must have run scripts/setup.sh; missing {missing:?}");
    eprintln!("skipping: {missing:?} not installed (run scripts/setup.sh)");
    false
}

fn run(config: &str, overrides: &[&str]) -> pipetransformer::run::Summary {
    let out = std::env::temp_dir().join(format!("pt-real-{}-{}", std::process::id(), config.replace('/', "_")));
    let mut sets: Vec<String> = overrides.iter().map(|s| s.to_string()).collect();
    sets.push(format!("output.dir={}", out.display()));
    let config = RunConfig::load(Path::new(config), &sets).unwrap();
    let dev = CpuDevice::<f32>::new(0, 0).unwrap();
    let mut job = Job::new(vec![dev], config).unwrap();
    let summary = job.run(&mut |_| {}).unwrap();
    std::fs::remove_dir_all(&out).unwrap();
    summary
}

#[test]
fn minilm_on_a_slice_of_rotten_tomatoes_beats_70_percent() {
    if !have(&["weights/all-minilm-l6-v2/model.safetensors", "data/text/rotten_tomatoes_corpus_full.csv.bz2"]) {
        return;
    }
    // 3,200 training snippets, 200 steps of 16; 600 held-out snippets.
    let s = run(
        "configs/minilm-rt.toml",
        &[
            "data.train_limit=3200",
            "data.test_limit=600",
            "data.batch_size=16",
            "data.max_len=48",
            "output.checkpoint_every=0",
        ],
    );
    let acc = s.eval.unwrap().accuracy;
    eprintln!("MiniLM on Rotten Tomatoes slice: {} steps, accuracy {:.2}%", s.steps, 100.0 * acc);
    assert_eq!(s.steps, 200);
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
