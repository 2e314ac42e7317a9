//! Tiny model configurations and batches shared by the integration tests.
#![allow(dead_code)]

use pipetransformer::model::{HostBatch, IGNORE_INDEX, ModelConfig};
use pipetransformer::rng::Rng;
use std::path::Path;

/// Whether the setup step's files `paths` are all there. When one is missing the test should
/// return early, with the note this prints, so a checkout without the data still tests the
/// rest; under CI (`CI` set: `.ci/run` sets it) a missing file is a failure instead, so a
/// broken setup step cannot pass by skipping every real-data test.
pub fn installed(paths: &[&Path]) -> bool {
    let missing: Vec<&&Path> = paths.iter().filter(|p| !p.exists()).collect();
    if missing.is_empty() {
        return true;
    }
    assert!(std::env::var_os("CI").is_none(), "CI must have run scripts/setup.sh; missing {missing:?}");
    eprintln!("skipped: {missing:?} not installed (run scripts/setup.sh)");
    false
}

// Each test binary uses some of these.
#[allow(unused_imports)]
pub use pipetransformer::model::tiny::{tiny_bert, tiny_gpt, tiny_vit};

/// A batch for `config`: 3 samples of 7 tokens (the last sample padded after 4 tokens) for
/// BERT, 2 samples of 7 tokens with two ignored targets for GPT, 3 images for ViT.
pub fn tiny_batch(config: &ModelConfig, seed: u64) -> HostBatch {
    let mut rng = Rng::new(seed);
    match config {
        ModelConfig::Bert(c) => {
            let (b, t) = (3, 7);
            let tokens = (0..b * t).map(|_| rng.below(c.vocab_size as u64) as u32).collect();
            let token_types = (0..b * t).map(|i| ((i % t) >= 4) as u32).collect();
            let attention_mask = (0..b * t).map(|i| !(i / t == 2 && i % t >= 4) as u32).collect();
            let targets = (0..b).map(|_| rng.below(c.num_labels as u64) as u32).collect();
            HostBatch {
                batch: b,
                seq: t,
                tokens: Some(tokens),
                token_types: Some(token_types),
                attention_mask: Some(attention_mask),
                targets,
                ..Default::default()
            }
        }
        ModelConfig::Gpt(c) => {
            let (b, t) = (2, 7);
            let tokens: Vec<u32> = (0..b * t).map(|_| rng.below(c.vocab_size as u64) as u32).collect();
            let mut targets: Vec<u32> = (0..b * t).map(|_| rng.below(c.vocab_size as u64) as u32).collect();
            targets[t - 1] = IGNORE_INDEX;
            targets[2 * t - 1] = IGNORE_INDEX;
            HostBatch { batch: b, seq: t, tokens: Some(tokens), targets, ..Default::default() }
        }
        ModelConfig::Vit(c) => {
            let b = 3;
            let n = b * c.num_channels * c.image_size * c.image_size;
            let pixels = (0..n).map(|_| rng.uniform() as f32).collect();
            let targets = (0..b).map(|_| rng.below(c.num_labels as u64) as u32).collect();
            HostBatch { batch: b, pixels: Some(pixels), targets, ..Default::default() }
        }
    }
}

/// A trainer for a model built with `seed` on `devices` by `plan`, with every unit costing its
/// FLOPs (per sample).
pub fn trainer_on<D: pipetransformer::Device>(
    config: &ModelConfig,
    seed: u64,
    devices: Vec<D>,
    plan: pipetransformer::pipeline::PipelineConfig,
    train: pipetransformer::train::TrainConfig,
    batches_per_epoch: usize,
) -> pipetransformer::train::Trainer<D> {
    use pipetransformer::model::Model;
    use pipetransformer::pipeline::{Pipeline, unit_profiles_per_sample};
    let mut model = Model::new(&devices[0], config, seed).unwrap();
    let per_sample = unit_profiles_per_sample(&devices[0], &mut model, &tiny_batch(config, 0), false).unwrap();
    let pipeline = Pipeline::new(devices, model, train.optimizer, plan, &per_sample).unwrap();
    pipetransformer::train::Trainer::new(pipeline, train, batches_per_epoch, per_sample).unwrap()
}

/// A dataset of `n` fixed samples for `config`, shuffled per epoch and batched `batch` at a
/// time, each sample with a stable id: BERT samples of 3 to 7 tokens padded per batch (so a
/// sample's padding changes with its batch), GPT samples of 7 tokens with targets ignored at
/// random places (so samples count different numbers of targets), ViT images.
pub struct Pool {
    samples: Vec<HostBatch>,
    batch: usize,
    seed: u64,
}

impl Pool {
    pub fn new(config: &ModelConfig, n: usize, batch: usize, seed: u64) -> Self {
        let mut rng = Rng::new(seed);
        let samples = (0..n)
            .map(|i| {
                let mut s = match config {
                    ModelConfig::Bert(c) => {
                        let t = 3 + rng.below(5) as usize;
                        HostBatch {
                            batch: 1,
                            seq: t,
                            tokens: Some((0..t).map(|_| rng.below(c.vocab_size as u64) as u32).collect()),
                            token_types: Some((0..t).map(|p| (p >= 2) as u32).collect()),
                            attention_mask: Some(vec![1; t]),
                            targets: vec![rng.below(c.num_labels as u64) as u32],
                            ..Default::default()
                        }
                    }
                    ModelConfig::Gpt(c) => {
                        let t = 7;
                        let tokens = (0..t).map(|_| rng.below(c.vocab_size as u64) as u32).collect();
                        let mut targets: Vec<u32> =
                            (0..t)
                                .map(|_| {
                                    if rng.below(3) == 0 { IGNORE_INDEX } else { rng.below(c.vocab_size as u64) as u32 }
                                })
                                .collect();
                        targets[0] = rng.below(c.vocab_size as u64) as u32;
                        HostBatch { batch: 1, seq: t, tokens: Some(tokens), targets, ..Default::default() }
                    }
                    ModelConfig::Vit(_) => tiny_batch(config, 1000 + i as u64).split(3).unwrap().swap_remove(0),
                };
                s.sample_ids = vec![7000 + i as u64];
                s
            })
            .collect();
        Pool { samples, batch, seed }
    }

    fn join(&self, idx: &[usize], offset: u64) -> pipetransformer::Result<HostBatch> {
        let parts: Vec<HostBatch> = idx.iter().map(|&i| self.samples[i].clone()).collect();
        let mut b = HostBatch::concat(&parts)?;
        b.sample_offset = offset;
        Ok(b)
    }
}

impl pipetransformer::train::BatchSource for Pool {
    fn batches_per_epoch(&self) -> usize {
        self.samples.len() / self.batch
    }
    fn train_batch(&self, epoch: u64, index: usize) -> pipetransformer::Result<HostBatch> {
        let perm = pipetransformer::data::BatchOrder::new(self.samples.len(), self.seed).permutation(epoch);
        self.join(&perm[index * self.batch..(index + 1) * self.batch], (index * self.batch) as u64)
    }
    fn eval_batches(&self) -> usize {
        2
    }
    fn eval_batch(&self, index: usize) -> pipetransformer::Result<HostBatch> {
        let idx: Vec<usize> = (index * self.batch..(index + 1) * self.batch).collect();
        self.join(&idx, (index * self.batch) as u64)
    }
}

/// ‖a−b‖/‖b‖ over all parameters together. (Per tensor it would be dominated by tensors whose
/// exact gradient is zero, like the key bias: AdamW turns their rounding noise into full-size
/// steps of either sign.)
pub fn params_rel(a: &[(String, Vec<f64>)], b: &[(String, Vec<f64>)]) -> f64 {
    assert_eq!(a.len(), b.len());
    let (mut num, mut den) = (0.0, 0.0);
    for ((na, x), (nb, y)) in a.iter().zip(b) {
        assert_eq!(na, nb);
        num += x.iter().zip(y).map(|(p, q)| (p - q).powi(2)).sum::<f64>();
        den += y.iter().map(|q| q * q).sum::<f64>();
    }
    (num / den).sqrt()
}

/// `plain` (a pipeline of 2 stages on 2 devices that recomputes nothing) recomputing `auto`
/// under the largest memory limit, in 400ths below its plan's peak, at which `auto` recomputes
/// part of a stage's units but not all, on the plain plan's stages: what a test of partial
/// recomputation runs. Panics where no limit does.
pub fn partial_recompute(
    plain: &pipetransformer::pipeline::PipelineConfig,
    units: &[pipetransformer::pipeline::UnitProfile],
) -> pipetransformer::pipeline::PipelineConfig {
    use pipetransformer::pipeline::{PipelineConfig, Plan, Recompute};
    let names: Vec<String> = (0..units.len()).map(|u| format!("unit {u}")).collect();
    let plain_plan = Plan::new(plain.clone(), units, names.clone(), 2, 0).unwrap();
    let peak = plain_plan.partition.device_peak(2);
    (1..400)
        .map(|i| PipelineConfig {
            recompute: Recompute::Auto,
            memory_limit: Some(peak - i * peak / 400),
            ..plain.clone()
        })
        .find(|c| {
            let Ok(p) = Plan::new(c.clone(), units, names.clone(), 2, 0) else { return false };
            let mut stages = p.partition.stages.iter().zip(&p.partition.recomputed);
            p.partition.stages == plain_plan.partition.stages
                && stages.any(|(s, again)| !again.is_empty() && again.end < s.end)
        })
        .unwrap_or_else(|| panic!("{}: no limit makes `auto` recompute part of a stage", plain.schedule))
}

/// The digits ViT's config with `output.dir` at `dir` and `sets` on top, or `None` where the
/// dataset is not installed.
pub fn digits_config(dir: &Path, sets: &[&str]) -> Option<pipetransformer::run::RunConfig> {
    if !installed(&[Path::new("data/digits/digits.csv.gz")]) {
        return None;
    }
    let mut all = vec![format!("output.dir={:?}", dir.display().to_string())];
    all.extend(sets.iter().map(|s| s.to_string()));
    Some(pipetransformer::run::RunConfig::load(Path::new("configs/vit-digits.toml"), &all).unwrap())
}

/// A job of `config` on `n` cpu devices of `threads` threads between them.
pub fn cpu_job(
    config: &pipetransformer::run::RunConfig,
    n: usize,
    threads: usize,
) -> pipetransformer::run::Job<pipetransformer::device::CpuDevice<f32>> {
    use pipetransformer::device::{AnyDevices, DeviceKind};
    let Ok(AnyDevices::Cpu(devices)) =
        pipetransformer::run::open_devices(DeviceKind::Cpu, n, threads, pipetransformer::device::Precision::F32)
    else {
        panic!("cpu devices")
    };
    pipetransformer::run::Job::new(devices, config.clone()).unwrap()
}

/// The files a run leaves that a later run must not lose: its log, checkpoint, summary,
/// report and exported weights.
pub const RUN_FILES: [&str; 5] =
    ["metrics.jsonl", "checkpoint.ckpt", "summary.json", "report.html", "model/model.safetensors"];

/// Where a run that starts over sets [`RUN_FILES`] aside, in their order.
pub const SET_ASIDE: [&str; 5] = [
    "metrics.previous.jsonl",
    "checkpoint.previous.ckpt",
    "summary.previous.json",
    "report.previous.html",
    "model.previous/model.safetensors",
];

/// A two-step digits run done in `dir` (its files there, [`RUN_FILES`] among them), and its
/// config for the runs after it; `None` where the dataset is not installed.
pub fn earlier_run(dir: &Path) -> Option<pipetransformer::run::RunConfig> {
    let sets = ["train.epochs=1", "train.max_steps=2", "data.train_limit=64", "data.test_limit=32"];
    let config = digits_config(dir, &sets)?;
    cpu_job(&config, 1, 1).run(&mut |_| {}).unwrap();
    Some(config)
}

/// The bytes of `dir`'s [`RUN_FILES`].
pub fn run_files(dir: &Path) -> [Vec<u8>; 5] {
    RUN_FILES.map(|f| std::fs::read(dir.join(f)).unwrap())
}
