//! The loaders on the real files `scripts/setup.sh` installs. Each test skips (with a printed
//! note) when its files are absent, except under CI, where that fails (`common::installed`).

mod common;

use std::path::{Path, PathBuf};

use pipetransformer::data::{self, BatchOrder, Dataset, Sample};

fn data_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join(data::DEFAULT_DATA_DIR)
}

/// True (after printing why) when one of `files` under the data dir is missing; under CI, a
/// failure instead.
fn skip(files: &[&str]) -> bool {
    let paths: Vec<PathBuf> = files.iter().map(|f| data_dir().join(f)).collect();
    !common::installed(&paths.iter().map(PathBuf::as_path).collect::<Vec<_>>())
}

/// A seeded stratified split is reproducible, disjoint, complete, and close to the requested
/// fraction in every class.
fn check_split<S: Sample + Clone + PartialEq + std::fmt::Debug>(full: &Dataset<S>, fraction: f64) {
    let a = full.clone().split_stratified(fraction, 1234).unwrap();
    let b = full.clone().split_stratified(fraction, 1234).unwrap();
    let c = full.clone().split_stratified(fraction, 99).unwrap();
    assert_eq!(a, b, "same seed, same split");
    assert_ne!(a.test, c.test, "another seed, another split");
    assert_eq!(a.train.len() + a.test.len(), full.len());
    let mut ids: Vec<u64> = a.train.samples().iter().chain(a.test.samples()).map(Sample::id).collect();
    ids.sort_unstable();
    ids.dedup();
    assert_eq!(ids.len(), full.len(), "halves overlap");
    for (class, (&n, &t)) in full.class_counts().iter().zip(&a.test.class_counts()).enumerate() {
        assert_eq!(t, (n as f64 * fraction).round() as usize, "class {class}");
    }
}

#[test]
fn rotten_tomatoes_counts_and_split() {
    if skip(&[data::ROTTEN_TOMATOES_FILE]) {
        return;
    }
    let d = data::rotten_tomatoes(data_dir()).unwrap();
    // 7,403 fresh + 5,405 rotten rows; 12,752 distinct texts (no text is both fresh and rotten).
    assert_eq!(d.len(), 12_752);
    assert_eq!(d.class_names(), ["rotten", "fresh"]);
    assert_eq!(d.class_counts(), vec![5_384, 7_368]);
    assert!(d.samples().iter().all(|s| !s.text.is_empty()));
    check_split(&d, 0.2);
    let s = d.split_stratified(0.2, 7).unwrap();
    assert_eq!((s.train.len(), s.test.len()), (10_201, 2_551));
    assert_eq!(s.test.class_counts(), vec![1_077, 1_474]);
}

#[test]
fn reuters_r8_counts() {
    if skip(&[data::REUTERS_R8_TRAIN_FILE, data::REUTERS_R8_TEST_FILE]) {
        return;
    }
    let s = data::reuters_r8(data_dir()).unwrap();
    assert_eq!((s.train.len(), s.test.len()), (5_485, 2_189));
    let names = ["acq", "crude", "earn", "grain", "interest", "money-fx", "ship", "trade"];
    assert_eq!(s.train.class_names(), names);
    assert_eq!(s.test.class_names(), names);
    assert_eq!(s.train.class_counts(), vec![1_596, 253, 2_840, 41, 190, 206, 108, 251]);
    assert_eq!(s.test.class_counts(), vec![696, 121, 1_083, 10, 81, 87, 36, 75]);
    assert_eq!(s.test.get(0).unwrap().id, data::TEST_FILE_ID_BASE);
}

#[test]
fn fashion_mnist_counts() {
    let files = [
        "train-images-idx3-ubyte.gz",
        "train-labels-idx1-ubyte.gz",
        "t10k-images-idx3-ubyte.gz",
        "t10k-labels-idx1-ubyte.gz",
    ]
    .map(|f| format!("{}/{f}", data::FASHION_MNIST_DIR));
    if skip(&files.each_ref().map(String::as_str)) {
        return;
    }
    let s = data::fashion_mnist(data_dir()).unwrap();
    assert_eq!((s.train.len(), s.test.len()), (60_000, 10_000));
    assert_eq!(s.train.class_counts(), vec![6_000; 10]);
    assert_eq!(s.test.class_counts(), vec![1_000; 10]);
    let first = s.test.get(0).unwrap();
    assert_eq!(first.label, 9);
    assert_eq!(s.test.class_names()[9], "Ankle boot");
    assert_eq!((first.width, first.height, first.pixels.len()), (28, 28, 784));
    let (lo, hi) = first.pixels.to_f32().iter().fold((f32::MAX, f32::MIN), |(l, h), &p| (l.min(p), h.max(p)));
    assert_eq!((lo, hi), (0.0, 1.0));
    let b = s.train.batch(&BatchOrder::new(s.train.len(), 3).permutation(0)[..16], 0).unwrap();
    assert_eq!(b.pixels.unwrap().len(), 16 * 784);
}

#[test]
fn mnist5k_counts_and_split() {
    if skip(&[data::MNIST5K_FILE]) {
        return;
    }
    let d = data::mnist5k(data_dir()).unwrap();
    assert_eq!(d.len(), 5_000);
    assert_eq!(d.class_counts(), vec![500; 10]);
    assert_eq!(d.get(0).unwrap().label, 0); // the file is in label order
    assert!(d.samples().iter().all(|s| s.pixels.to_f32().iter().all(|p| (0.0..=1.0).contains(p))));
    check_split(&d, 0.2);
}

#[test]
fn digits_counts_split_and_batch() {
    if skip(&[data::DIGITS_FILE]) {
        return;
    }
    let d = data::digits(data_dir()).unwrap();
    assert_eq!(d.len(), 1_797);
    assert_eq!(d.class_counts(), vec![178, 182, 177, 183, 181, 182, 181, 179, 174, 180]);
    assert!(d.samples().iter().all(|s| s.pixels.to_f32().iter().all(|p| (0.0..=1.0).contains(p))));
    check_split(&d, 0.2);
    let s = d.split_stratified(0.2, 42).unwrap();
    let mut epoch = BatchOrder::new(s.train.len(), 42).epoch(0);
    let idx = epoch.next_batch(32, true).unwrap().to_vec();
    let b = s.train.batch(&idx, 0).unwrap();
    assert_eq!((b.batch, b.pixels.as_ref().unwrap().len(), b.targets.len()), (32, 32 * 64, 32));
}

#[test]
fn hamlet_corpus() {
    if skip(&[data::HAMLET_FILE]) {
        return;
    }
    let c = data::hamlet(data_dir()).unwrap();
    assert_eq!(c.vocab.len(), 66);
    assert_eq!(c.train.len() + c.held_out.len(), 175_176);
    assert_eq!(c.held_out.len(), 17_517); // floor(10 %)
    assert!(c.vocab.decode(&c.train[..40]).unwrap().contains("The Tragedy of Hamlet"));
    let seqs = c.train_sequences(128).unwrap();
    assert_eq!(seqs.len(), (c.train.len() - 1) / 128);
    assert_eq!(seqs[3].input[1..], seqs[3].target[..127]);
    assert_eq!(c.held_out_sequences(128).unwrap().len(), (17_517 - 1) / 128);
}

/// The held-out samples are chosen by `data.split_seed` alone: another `train.seed` (the batch
/// order and dropout) evaluates on the same test set, another `split_seed` on another one.
#[test]
fn the_test_split_follows_the_split_seed_not_the_training_seed() {
    if skip(&[data::DIGITS_FILE]) {
        return;
    }
    let config = Path::new(env!("CARGO_MANIFEST_DIR")).join("configs/vit-digits.toml");
    let test_ids = |sets: &[&str]| {
        let mut overrides = vec![format!("data.dir={}", data_dir().display())];
        overrides.extend(sets.iter().map(|s| s.to_string()));
        let run = pipetransformer::run::RunConfig::load(&config, &overrides).unwrap();
        let (source, _) = pipetransformer::run::prepare_data(&run, 1).unwrap();
        let mut ids: Vec<u64> =
            (0..source.eval_batches()).flat_map(|i| source.eval_batch(i).unwrap().sample_ids).collect();
        ids.sort_unstable();
        ids
    };
    let base = test_ids(&[]);
    assert_eq!(base.len(), 359);
    assert_eq!(test_ids(&["train.seed=7"]), base, "train.seed moved the test split");
    assert_ne!(test_ids(&["data.split_seed=7"]), base);
}

/// A sequence longer than a part of the text is refused by `data.max_len`, naming the file and
/// the part; `data.max_len = 0` is refused when the config is read.
#[test]
fn a_sequence_longer_than_the_held_out_text_names_data_max_len() {
    if skip(&[data::HAMLET_FILE]) {
        return;
    }
    let config = Path::new(env!("CARGO_MANIFEST_DIR")).join("configs/gpt-hamlet.toml");
    let load = |len: &str| {
        let overrides = [format!("data.dir={}", data_dir().display()), format!("data.max_len={len}")];
        pipetransformer::run::RunConfig::load(&config, &overrides)
    };
    let run = load("20000").unwrap();
    let err = pipetransformer::run::prepare_data(&run, 1).err().unwrap().to_string();
    assert!(err.contains("data.max_len") && err.contains("held-out part") && err.contains("hamlet.txt"), "{err}");
    let err = load("0").unwrap_err().to_string();
    assert!(err.contains("data.max_len") && err.contains("at least 1"), "{err}");
}
