//! Checkpoint and resume: N steps + save + load + N steps equals 2N steps bit for bit on the
//! CPU; a corrupt checkpoint is a clear error; a failed run leaves the good checkpoint intact.

mod common;

use pipetransformer::Result;
use pipetransformer::bench::random_batch;
use pipetransformer::device::CpuDevice;
use pipetransformer::model::{HostBatch, Model, ModelConfig};
use pipetransformer::train::{BatchSource, Event, TrainConfig, Trainer};
use std::path::PathBuf;

/// Four random batches per epoch, one eval batch; optionally failing at one batch.
struct Synthetic {
    config: ModelConfig,
    fail_at: Option<usize>,
}

impl BatchSource for Synthetic {
    fn batches_per_epoch(&self) -> usize {
        4
    }
    fn train_batch(&self, epoch: u64, index: usize) -> Result<HostBatch> {
        if self.fail_at == Some(index) {
            return Err(pipetransformer::Error::Data { what: "batch".into(), message: "injected failure".into() });
        }
        let mut b = random_batch(&self.config, 2, 7, epoch * 100 + index as u64);
        b.sample_offset = (index * 2) as u64;
        Ok(b)
    }
    fn eval_batches(&self) -> usize {
        1
    }
    fn eval_batch(&self, _: usize) -> Result<HostBatch> {
        Ok(random_batch(&self.config, 2, 7, 999))
    }
}

fn train_config() -> TrainConfig {
    TrainConfig {
        epochs: 2,
        max_steps: 0,
        lr: 1e-2,
        min_lr: 0.0,
        warmup_fraction: 0.25,
        decay: pipetransformer::train::Decay::Cosine,
        optimizer: Default::default(),
        max_grad_norm: 1.0,
        seed: 5,
    }
}

fn trainer(config: &ModelConfig) -> (CpuDevice<f32>, Trainer<CpuDevice<f32>>) {
    let dev = CpuDevice::<f32>::new(0, 2).unwrap();
    let model = Model::new(&dev, config, 3).unwrap();
    let t = Trainer::new(model, train_config(), 4).unwrap();
    (dev, t)
}

fn run(dev: &CpuDevice<f32>, t: &mut Trainer<CpuDevice<f32>>, src: &Synthetic, steps: Option<u64>) -> Vec<f64> {
    let mut losses = Vec::new();
    t.fit(dev, src, steps, &mut |e| {
        if let Event::Step { loss, .. } = e {
            losses.push(*loss)
        }
    })
    .unwrap();
    losses
}

fn tmp(name: &str) -> PathBuf {
    std::env::temp_dir().join(format!("pt-resume-{}-{name}", std::process::id()))
}

#[test]
fn resumed_run_is_bitwise_identical() {
    // Dropout on, a freeze in the middle: everything that must survive the checkpoint does.
    for config in [common::tiny_gpt(0.1), common::tiny_bert(pipetransformer::model::Pooling::Mean, 0.1)] {
        let src = Synthetic { config: config.clone(), fail_at: None };
        let (dev, mut straight) = trainer(&config);
        let mut all = run(&dev, &mut straight, &src, Some(3));
        straight.model.freeze_prefix(&dev, 2).unwrap();
        all.extend(run(&dev, &mut straight, &src, None));
        assert_eq!(all.len(), 8);

        let path = tmp("ckpt");
        let (dev, mut first) = trainer(&config);
        let mut resumed = run(&dev, &mut first, &src, Some(3));
        first.model.freeze_prefix(&dev, 2).unwrap();
        resumed.extend(run(&dev, &mut first, &src, Some(2)));
        first.save_checkpoint(&dev, &path).unwrap();
        drop(first);
        let (dev, mut second) = trainer(&config);
        second.load_checkpoint(&dev, &path).unwrap();
        assert_eq!(second.position.step, 5);
        resumed.extend(run(&dev, &mut second, &src, None));
        assert_eq!(all, resumed, "losses of 8 straight steps vs 5 + resume + 3");
        for (a, b) in straight.model.params().iter().zip(second.model.params()) {
            use pipetransformer::Device;
            assert_eq!(dev.download(&a.value).unwrap(), dev.download(&b.value).unwrap(), "{}", a.name);
        }
        std::fs::remove_file(&path).unwrap();
    }
}

#[test]
fn corrupt_checkpoint_is_an_error_and_changes_nothing() {
    let config = common::tiny_gpt(0.0);
    let src = Synthetic { config: config.clone(), fail_at: None };
    let (dev, mut t) = trainer(&config);
    run(&dev, &mut t, &src, Some(2));
    let path = tmp("corrupt");
    t.save_checkpoint(&dev, &path).unwrap();
    let mut bytes = std::fs::read(&path).unwrap();
    let n = bytes.len();
    bytes[n / 2] ^= 0x40;
    std::fs::write(&path, &bytes).unwrap();
    let (dev, mut fresh) = trainer(&config);
    let err = fresh.load_checkpoint(&dev, &path).unwrap_err().to_string();
    assert!(err.contains("corrupt") && err.contains("pt-resume"), "{err}");
    assert_eq!(fresh.position.step, 0);
    // A checkpoint for another model is refused by name.
    let other = common::tiny_bert(pipetransformer::model::Pooling::Mean, 0.0);
    let (dev, t_other) = trainer(&other);
    t_other.save_checkpoint(&dev, &path).unwrap();
    let err = fresh.load_checkpoint(&dev, &path).unwrap_err().to_string();
    assert!(err.contains("missing"), "{err}");
    std::fs::remove_file(&path).unwrap();
}

#[test]
fn failed_run_keeps_the_good_checkpoint() {
    let config = common::tiny_gpt(0.0);
    let good = Synthetic { config: config.clone(), fail_at: None };
    let (dev, mut t) = trainer(&config);
    run(&dev, &mut t, &good, Some(1));
    let path = tmp("keep");
    t.save_checkpoint(&dev, &path).unwrap();
    let before = std::fs::read(&path).unwrap();
    let failing = Synthetic { config, fail_at: Some(2) };
    let err = t.fit(&dev, &failing, None, &mut |_| {}).unwrap_err();
    assert!(err.to_string().contains("injected failure"));
    assert_eq!(std::fs::read(&path).unwrap(), before, "the good checkpoint is untouched");
    assert!(!path.with_extension("tmp").exists());
    std::fs::remove_file(&path).unwrap();
}
