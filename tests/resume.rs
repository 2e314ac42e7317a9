//! Checkpoint and resume: N steps + save + load + N steps equals 2N steps bit for bit on the
//! CPU; a corrupt checkpoint is a clear error; a failed run leaves the good checkpoint intact.

mod common;

use pipetransformer::Result;
use pipetransformer::device::{CpuDevice, Precision};
use pipetransformer::model::{HostBatch, ModelConfig};
use pipetransformer::pipeline::PipelineConfig;
use pipetransformer::train::{BatchSource, Event, RecordedPlan, TrainConfig, Trainer};
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
        let mut b = HostBatch::random(&self.config, 2, 7, epoch * 100 + index as u64);
        b.sample_offset = (index * 2) as u64;
        Ok(b)
    }
    fn eval_batches(&self) -> usize {
        1
    }
    fn eval_batch(&self, _: usize) -> Result<HostBatch> {
        Ok(HostBatch::random(&self.config, 2, 7, 999))
    }
}

fn train_config() -> TrainConfig {
    TrainConfig {
        epochs: 2,
        max_steps: 0,
        lr: 1e-2,
        min_lr: 0.0,
        warmup_fraction: 0.25,
        decay: pipetransformer::optim::Decay::Cosine,
        optimizer: Default::default(),
        max_grad_norm: 1.0,
        seed: 5,
        eval_every: 0,
        ..TrainConfig::new(0, 0.0)
    }
}

fn trainer(config: &ModelConfig) -> Trainer<CpuDevice<f32>> {
    trainer_for_epochs_of(config, 4)
}

/// A trainer for a source of `batches_per_epoch` batches per epoch.
fn trainer_for_epochs_of(config: &ModelConfig, batches_per_epoch: usize) -> Trainer<CpuDevice<f32>> {
    let dev = CpuDevice::<f32>::new(0, 2).unwrap();
    common::trainer_on(config, 3, vec![dev], Default::default(), train_config(), batches_per_epoch)
}

fn run(t: &mut Trainer<CpuDevice<f32>>, src: &Synthetic, steps: Option<u64>) -> Vec<f64> {
    let mut losses = Vec::new();
    t.fit(src, steps, &mut (), &mut |e| {
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
        let mut straight = trainer(&config);
        let mut all = run(&mut straight, &src, Some(3));
        straight.pipeline.freeze_prefix(2).unwrap();
        all.extend(run(&mut straight, &src, None));
        assert_eq!(all.len(), 8);

        let path = tmp("ckpt");
        let mut first = trainer(&config);
        let mut resumed = run(&mut first, &src, Some(3));
        first.pipeline.freeze_prefix(2).unwrap();
        resumed.extend(run(&mut first, &src, Some(2)));
        first.save_checkpoint(&path, serde_json::json!({"mine": 1})).unwrap();
        drop(first);
        let mut second = trainer(&config);
        assert_eq!(second.load_checkpoint(&path).unwrap(), serde_json::json!({"mine": 1}));
        assert_eq!(second.position.step, 5);
        assert_eq!(second.pipeline.frozen_prefix(), 2);
        resumed.extend(run(&mut second, &src, None));
        assert_eq!(all, resumed, "losses of 8 straight steps vs 5 + resume + 3");
        for (a, b) in straight.pipeline.parameters(0).unwrap().iter().zip(second.pipeline.parameters(0).unwrap()) {
            assert_eq!(a, &b, "{}", a.0);
        }
        std::fs::remove_file(&path).unwrap();
    }
}

/// A run resumed in another shape (one device → a pipeline of two, and back) keeps that shape
/// when asked to ([`RecordedPlan::UnlessReshaped`]) and follows the straight run step by step:
/// the same losses and gradient norms, where a weight or moment loaded onto the wrong stage,
/// or left behind, would change both. [`RecordedPlan::Restore`] restores the checkpoint's.
#[test]
fn a_run_resumed_in_another_shape_keeps_it_and_follows_the_straight_run() {
    let config = common::tiny_bert(pipetransformer::model::Pooling::Mean, 0.1);
    let src = Synthetic { config: config.clone(), fail_at: None };
    let on = |k: usize| {
        let devices = (0..k).map(|i| CpuDevice::<f32>::new(i, 1).unwrap()).collect();
        let plan = PipelineConfig { pipeline_len: k, ..Default::default() };
        common::trainer_on(&config, 3, devices, plan, train_config(), 4)
    };
    let steps = |t: &mut Trainer<CpuDevice<f32>>, n: Option<u64>| {
        let mut seen = Vec::new();
        t.fit(&src, n, &mut (), &mut |e| {
            if let Event::Step { loss, grad_norm, .. } = e {
                seen.push((*loss, *grad_norm))
            }
        })
        .unwrap();
        seen
    };
    let straight = steps(&mut on(1), None);
    for (from, to) in [(1, 2), (2, 1)] {
        let path = tmp(&format!("reshape-{from}-{to}"));
        let mut first = on(from);
        let mut resumed = steps(&mut first, Some(3));
        first.save_checkpoint(&path, serde_json::Value::Null).unwrap();
        drop(first);
        let mut second = on(to);
        let restored = second.load_checkpoint_with(&path, RecordedPlan::UnlessReshaped { slices: false }).unwrap();
        assert_eq!(restored.reshaped_from.map(|c| c.pipeline_len), Some(from));
        assert!(restored.changed.is_empty(), "the same settings: {:?}", restored.changed);
        assert_eq!(second.pipeline.plan().config.pipeline_len, to, "the shape asked for stays");
        resumed.extend(steps(&mut second, None));
        assert_eq!(resumed.len(), straight.len());
        for (i, ((l, g), (want_l, want_g))) in resumed.iter().zip(&straight).enumerate() {
            assert!(
                (l - want_l).abs() <= 1e-5 && (g - want_g).abs() <= 1e-5 * want_g,
                "step {i}: {l} {g} vs {want_l} {want_g}"
            );
        }
        if to == 2 {
            let mut third = on(2);
            assert!(third.load_checkpoint_with(&path, RecordedPlan::Restore).unwrap().reshaped_from.is_none());
            assert_eq!(third.pipeline.plan().config.pipeline_len, 1, "the checkpoint's shape restored");
        }
        std::fs::remove_file(&path).unwrap();
    }
}

/// A checkpoint whose plan cannot run here (two replicas, one device) is refused before the
/// frozen prefix it recorded is applied: the run trains on as a fresh one does, loss and
/// gradient norm at every step, where a load that froze first and failed after would have left
/// units frozen and their optimizer state gone.
#[test]
fn a_refused_plan_leaves_the_frozen_prefix_as_it_was() {
    let config = common::tiny_bert(pipetransformer::model::Pooling::Mean, 0.1);
    let src = Synthetic { config: config.clone(), fail_at: None };
    let on = |devices: usize, replicas: usize| {
        let devices = (0..devices).map(|i| CpuDevice::<f32>::new(i, 1).unwrap()).collect();
        let plan = PipelineConfig { replicas, ..Default::default() };
        common::trainer_on(&config, 3, devices, plan, train_config(), 4)
    };
    let steps = |t: &mut Trainer<CpuDevice<f32>>| {
        let mut seen = Vec::new();
        t.fit(&src, Some(3), &mut (), &mut |e| {
            if let Event::Step { loss, grad_norm, .. } = e {
                seen.push((*loss, *grad_norm))
            }
        })
        .unwrap();
        seen
    };
    let path = tmp("refused-plan");
    let mut first = on(2, 2);
    steps(&mut first);
    first.pipeline.freeze_prefix(2).unwrap();
    first.save_checkpoint(&path, serde_json::Value::Null).unwrap();
    let mut second = on(1, 1);
    let err = second.load_checkpoint_with(&path, RecordedPlan::Restore).map(drop).unwrap_err().to_string();
    assert!(err.contains("cannot run here"), "{err}");
    assert_eq!((second.pipeline.frozen_prefix(), second.position.step), (0, 0));
    assert_eq!(steps(&mut second), steps(&mut on(1, 1)), "(loss, gradient norm) per step");
    std::fs::remove_file(&path).unwrap();
}

/// A resume lists the training settings that changed since the checkpoint, a table's by its
/// own keys, and nothing else.
#[test]
fn a_resume_names_the_training_settings_that_changed() {
    let config = common::tiny_gpt(0.0);
    let src = Synthetic { config: config.clone(), fail_at: None };
    let path = tmp("changed-settings");
    let mut first = trainer(&config);
    run(&mut first, &src, Some(2));
    first.save_checkpoint(&path, serde_json::Value::Null).unwrap();
    let optimizer =
        pipetransformer::optim::OptimizerConfig::AdamW { beta1: 0.5, beta2: 0.999, eps: 1e-8, weight_decay: 0.01 };
    let train = TrainConfig { lr: 2e-2, max_steps: 7, optimizer, ..train_config() };
    let dev = CpuDevice::<f32>::with_precision(0, 1, Precision::Bf16).unwrap();
    let mut second = common::trainer_on(&config, 3, vec![dev], Default::default(), train.clone(), 4);
    let restored = second.load_checkpoint_with(&path, RecordedPlan::Restore).unwrap();
    assert_eq!(
        restored.changed,
        [
            "train.lr 0.01 → 0.02",
            "train.max_steps 0 → 7",
            "train.optimizer.beta1 0.9 → 0.5",
            r#"output.precision "f32" → "bf16""#
        ],
        "by name"
    );
    // The same precision is no change.
    let dev = CpuDevice::<f32>::new(0, 1).unwrap();
    let mut third = common::trainer_on(&config, 3, vec![dev], Default::default(), train, 4);
    let restored = third.load_checkpoint_with(&path, RecordedPlan::Restore).unwrap();
    assert!(!restored.changed.iter().any(|c| c.starts_with("output.")), "{:?}", restored.changed);
    std::fs::remove_file(&path).unwrap();
}

/// A checkpoint past the end of the resuming run (a smaller `train.max_steps`) is refused by
/// name, the trainer unchanged, instead of a run that ends at once having trained nothing; at
/// the end exactly, it resumes (a finished run, nothing left).
#[test]
fn a_checkpoint_past_the_runs_end_is_refused() {
    let config = common::tiny_gpt(0.0);
    let src = Synthetic { config: config.clone(), fail_at: None };
    let path = tmp("past-the-end");
    let mut first = trainer(&config);
    run(&mut first, &src, Some(2));
    first.save_checkpoint(&path, serde_json::Value::Null).unwrap();
    let resumed = |max_steps: u64| {
        let train = TrainConfig { max_steps, ..train_config() };
        let dev = CpuDevice::<f32>::new(0, 1).unwrap();
        let mut t = common::trainer_on(&config, 3, vec![dev], Default::default(), train, 4);
        let r = t.load_checkpoint_with(&path, RecordedPlan::Restore).map(|_| ());
        (r, t.position.step)
    };
    let (refused, step) = resumed(1);
    let e = refused.unwrap_err().to_string();
    assert!(e.contains("train.max_steps") && e.contains("is 1, a run of 1 batches"), "{e}");
    assert!(e.contains("2 batches in (step 2)") && e.contains("nothing would be left to train"), "{e}");
    assert_eq!(step, 0, "the trainer as it was");
    let (at_the_end, step) = resumed(2);
    assert!(at_the_end.is_ok() && step == 2);
    std::fs::remove_file(&path).unwrap();
}

/// `train.freeze_embeddings` survives a resume (the embedding never moves, before or after
/// the checkpoint), and a change of it between the checkpoint's run and the resuming one is
/// refused by name, both ways, before anything is loaded.
#[test]
fn frozen_embeddings_resume_and_refuse_a_checkpoint_that_trained_them() {
    let config = common::tiny_bert(pipetransformer::model::Pooling::Mean, 0.1);
    let src = Synthetic { config: config.clone(), fail_at: None };
    let frozen = |batches| {
        let dev = CpuDevice::<f32>::new(0, 2).unwrap();
        let train = TrainConfig { freeze_embeddings: true, ..train_config() };
        common::trainer_on(&config, 3, vec![dev], Default::default(), train, batches)
    };
    let embedding = |t: &Trainer<CpuDevice<f32>>| {
        let all = t.pipeline.parameters(0).unwrap();
        all.into_iter().filter(|(name, _)| name.starts_with("embeddings.")).collect::<Vec<_>>()
    };
    let mut straight = frozen(4);
    let before = embedding(&straight);
    assert!(!before.is_empty());
    assert_eq!(straight.pipeline.frozen_prefix(), 1);
    let all = run(&mut straight, &src, None);

    let path = tmp("frozen-embeddings");
    let mut first = frozen(4);
    let mut resumed = run(&mut first, &src, Some(3));
    first.save_checkpoint(&path, serde_json::Value::Null).unwrap();
    let mut second = frozen(4);
    second.load_checkpoint(&path).unwrap();
    resumed.extend(run(&mut second, &src, None));
    assert_eq!(all, resumed, "losses straight vs 3 + resume + 5");
    assert_eq!(embedding(&second), before, "the embedding moved");
    assert_ne!(second.pipeline.parameters(0).unwrap(), frozen(4).pipeline.parameters(0).unwrap(), "nothing trained");

    let mut trained = trainer(&config);
    run(&mut trained, &src, Some(2));
    trained.save_checkpoint(&path, serde_json::Value::Null).unwrap();
    let mut refusing = frozen(4);
    let err = refusing.load_checkpoint(&path).unwrap_err().to_string();
    assert!(err.contains("trained the embedding") && err.contains("train.freeze_embeddings"), "{err}");
    assert!(err.contains("--fresh"), "{err}");
    assert_eq!(refusing.position.step, 0);
    // ...and the other way round: a run that trains it does not resume one that kept it frozen.
    first.save_checkpoint(&path, serde_json::Value::Null).unwrap();
    let mut training = trainer(&config);
    let err = training.load_checkpoint(&path).unwrap_err().to_string();
    assert!(err.contains("kept the embedding frozen") && err.contains("train.freeze_embeddings"), "{err}");
    assert_eq!((training.position.step, training.pipeline.frozen_prefix()), (0, 0));
    std::fs::remove_file(&path).unwrap();
}

/// A tiny GPT's checkpoint after `steps` steps, at `tmp(name)`.
fn checkpoint_after(steps: u64, name: &str) -> (ModelConfig, PathBuf) {
    let config = common::tiny_gpt(0.0);
    let mut t = trainer(&config);
    run(&mut t, &Synthetic { config: config.clone(), fail_at: None }, Some(steps));
    let path = tmp(name);
    t.save_checkpoint(&path, serde_json::Value::Null).unwrap();
    (config, path)
}

#[test]
fn corrupt_checkpoint_is_an_error_and_changes_nothing() {
    let (config, path) = checkpoint_after(2, "corrupt");
    let mut bytes = std::fs::read(&path).unwrap();
    let n = bytes.len();
    bytes[n / 2] ^= 0x40;
    std::fs::write(&path, &bytes).unwrap();
    let mut fresh = trainer(&config);
    let err = fresh.load_checkpoint(&path).unwrap_err().to_string();
    assert!(err.contains("corrupt") && err.contains("pt-resume"), "{err}");
    assert_eq!(fresh.position.step, 0);
    // A checkpoint for another model is refused by name.
    let other = common::tiny_bert(pipetransformer::model::Pooling::Mean, 0.0);
    let t_other = trainer(&other);
    t_other.save_checkpoint(&path, serde_json::Value::Null).unwrap();
    let err = fresh.load_checkpoint(&path).unwrap_err().to_string();
    assert!(err.contains("missing"), "{err}");
    std::fs::remove_file(&path).unwrap();
}

/// A checkpoint's position counts batches of its run's epochs: a run whose epochs have another
/// number of batches (a new batch size or training set) is refused by name, unchanged.
#[test]
fn checkpoint_from_other_epochs_is_refused() {
    let (config, path) = checkpoint_after(3, "epochs");
    let mut shorter = trainer_for_epochs_of(&config, 3);
    let err = shorter.load_checkpoint(&path).unwrap_err().to_string();
    assert!(
        err.contains("taken with 4 batches per epoch, this run has 3")
            && err.contains("data.batch_size")
            && err.contains("the device count"),
        "{err}"
    );
    assert_eq!(shorter.position.step, 0);
    std::fs::remove_file(&path).unwrap();
}

/// A position set by hand past its epoch's batches is refused by `fit`, not a panic (or a
/// wrapped subtraction asking the data for batches it does not have), and nothing trains.
#[test]
fn a_position_past_its_epoch_is_refused() {
    let config = common::tiny_gpt(0.0);
    let src = Synthetic { config: config.clone(), fail_at: None };
    for batch in [4, 10] {
        let mut t = trainer(&config);
        t.position.batch = batch;
        let err = t.fit(&src, Some(1), &mut (), &mut |_| {}).unwrap_err().to_string();
        assert!(err.contains(&format!("batch {batch} of epoch 0")) && err.contains("has 4 batches"), "{err}");
        assert_eq!(t.position.step, 0);
    }
}

/// A checkpoint of another optimizer's state (AdamW's two moments, resumed under SGD with
/// momentum's one) is refused by the config key before anything changes: neither the frozen
/// prefix nor a weight.
#[test]
fn checkpoint_of_another_optimizer_is_refused_unchanged() {
    let config = common::tiny_gpt(0.0);
    let src = Synthetic { config: config.clone(), fail_at: None };
    let mut adamw = trainer(&config);
    run(&mut adamw, &src, Some(2));
    adamw.pipeline.freeze_prefix(2).unwrap();
    let path = tmp("optimizer");
    adamw.save_checkpoint(&path, serde_json::Value::Null).unwrap();
    let sgd = TrainConfig {
        optimizer: pipetransformer::optim::OptimizerConfig::Sgd { momentum: 0.9, weight_decay: 0.0, nesterov: false },
        ..train_config()
    };
    let dev = CpuDevice::<f32>::new(0, 2).unwrap();
    let mut other = common::trainer_on(&config, 3, vec![dev], Default::default(), sgd, 4);
    let before = other.pipeline.parameters(0).unwrap();
    let err = other.load_checkpoint(&path).unwrap_err().to_string();
    assert!(err.contains("taken with the adamw optimizer") && err.contains("train.optimizer is sgd"), "{err}");
    assert_eq!(other.pipeline.frozen_prefix(), 0);
    assert_eq!(other.pipeline.parameters(0).unwrap(), before);
    std::fs::remove_file(&path).unwrap();
}

/// A checkpoint of another model is refused by name before anything changes: one with a
/// parameter this model lacks (the pooler of a `cls_pooler` BERT resumed with mean pooling,
/// which was silently dropped), and, where the caller records the model's configuration, one
/// taken under another (the activation, which no parameter's shape shows).
#[test]
fn checkpoint_of_another_model_is_refused_by_the_field() {
    use pipetransformer::model::{ModelConfig, Pooling};
    let pooler = common::tiny_bert(Pooling::ClsPooler, 0.0);
    let path = tmp("model");
    trainer(&pooler).save_checkpoint(&path, serde_json::Value::Null).unwrap();
    let mut mean = trainer(&common::tiny_bert(Pooling::Mean, 0.0));
    let err = mean.load_checkpoint(&path).unwrap_err().to_string();
    assert!(err.contains("holds parameter `pooler.dense.bias`, which this model lacks"), "{err}");
    assert_eq!(mean.position.step, 0);

    let ModelConfig::Bert(gelu) = pooler.clone() else { unreachable!() };
    let tanh = ModelConfig::Bert(pipetransformer::model::BertConfig { hidden_act: "gelu_new".into(), ..gelu });
    let mut saved = trainer(&pooler);
    saved.model_config = Some(serde_json::to_value(&pooler).unwrap());
    saved.save_checkpoint(&path, serde_json::Value::Null).unwrap();
    let mut other = trainer(&tanh);
    other.model_config = Some(serde_json::to_value(&tanh).unwrap());
    let err = other.load_checkpoint(&path).unwrap_err().to_string();
    assert!(err.contains("`hidden_act` = \"gelu\", this run's is \"gelu_new\""), "{err}");
    // The same model resumes.
    let mut same = trainer(&pooler);
    same.model_config = Some(serde_json::to_value(&pooler).unwrap());
    same.load_checkpoint(&path).unwrap();
    std::fs::remove_file(&path).unwrap();
}

#[test]
fn failed_run_keeps_the_good_checkpoint() {
    let config = common::tiny_gpt(0.0);
    let good = Synthetic { config: config.clone(), fail_at: None };
    let mut t = trainer(&config);
    run(&mut t, &good, Some(1));
    let path = tmp("keep");
    t.save_checkpoint(&path, serde_json::Value::Null).unwrap();
    let before = std::fs::read(&path).unwrap();
    let failing = Synthetic { config, fail_at: Some(2) };
    let err = t.fit(&failing, None, &mut (), &mut |_| {}).unwrap_err();
    assert!(err.to_string().contains("injected failure"));
    assert_eq!(std::fs::read(&path).unwrap(), before, "the good checkpoint is untouched");
    assert!(!path.with_extension("tmp").exists());
    std::fs::remove_file(&path).unwrap();
}

/// `eval_every = 2` over 2 epochs of 4 steps: evaluations after steps 2 and 6 inside the
/// epochs, the epochs' own after 4 and 8 (not a second one there), each what `evaluate` gives
/// at that point; a run stopped at step 5 and resumed evaluates at step 6 all the same.
#[test]
fn evaluations_every_n_steps_come_between_the_epochs_and_survive_a_resume() {
    let config = common::tiny_gpt(0.0);
    let src = Synthetic { config: config.clone(), fail_at: None };
    let with_every = || {
        let dev = CpuDevice::<f32>::new(0, 2).unwrap();
        let train = TrainConfig { eval_every: 2, ..train_config() };
        common::trainer_on(&config, 3, vec![dev], Default::default(), train, 4)
    };
    let evals = |t: &mut Trainer<CpuDevice<f32>>, steps: Option<u64>| {
        let mut seen = Vec::new();
        let mut step = t.position.step;
        t.fit(&src, steps, &mut (), &mut |e| match e {
            Event::Step { step: s, .. } => step = *s,
            Event::Eval { step: s, eval, .. } => seen.push(("eval", *s, eval.loss)),
            Event::Epoch { eval, .. } => seen.push(("epoch", step, eval.loss)),
            _ => {}
        })
        .unwrap();
        seen
    };
    let mut straight = with_every();
    let all = evals(&mut straight, None);
    let kinds: Vec<(&str, u64)> = all.iter().map(|&(k, s, _)| (k, s)).collect();
    assert_eq!(kinds, [("eval", 2), ("epoch", 4), ("eval", 6), ("epoch", 8)]);

    // Each is the evaluation of the weights after that step.
    let mut probe = with_every();
    run(&mut probe, &src, Some(2));
    assert_eq!(probe.evaluate(&src).unwrap().loss, all[0].2);

    let path = tmp("ckpt-every");
    let mut first = with_every();
    let mut resumed = evals(&mut first, Some(5));
    first.save_checkpoint(&path, serde_json::json!({})).unwrap();
    let mut second = with_every();
    second.load_checkpoint(&path).unwrap();
    resumed.extend(evals(&mut second, None));
    assert_eq!(resumed, all, "stopped at step 5 and resumed");
    std::fs::remove_file(&path).unwrap();
}
