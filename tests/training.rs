//! End-to-end training on the CPU: tiny models memorise one batch, runs are deterministic, and
//! freezing mid-run keeps training the rest.

mod common;

use pipetransformer::device::CpuDevice;
use pipetransformer::model::{Batch, GptConfig, HostBatch, Model, ModelConfig, VitConfig};
use pipetransformer::optim::{Optimizer, OptimizerConfig, train_step};

fn gpt() -> ModelConfig {
    ModelConfig::Gpt(GptConfig::without_dropout(16, 16, 32, 2, 4))
}

fn vit() -> ModelConfig {
    ModelConfig::Vit(VitConfig {
        image_size: 8,
        patch_size: 4,
        num_channels: 1,
        hidden_size: 32,
        num_hidden_layers: 2,
        num_attention_heads: 4,
        intermediate_size: 64,
        hidden_act: "gelu".into(),
        layer_norm_eps: 1e-12,
        hidden_dropout_prob: 0.0,
        attention_probs_dropout_prob: 0.0,
        num_labels: 4,
    })
}

/// Trains `steps` AdamW steps on one fixed batch; returns the losses.
fn train(config: &ModelConfig, batch: usize, seq: usize, steps: usize, lr: f64, threads: usize) -> Vec<f64> {
    let dev = CpuDevice::<f32>::new(0, threads).unwrap();
    let mut model = Model::new(&dev, config, 1).unwrap();
    let host = HostBatch::random(config, batch, seq, 2);
    let batch = Batch::upload(&dev, model.spec(), &host, true, 3).unwrap();
    let mut opt =
        Optimizer::new(OptimizerConfig::AdamW { beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.0 }).unwrap();
    (0..steps).map(|_| train_step(&dev, &mut model, &mut opt, &batch, lr, Some(1.0)).unwrap().loss).collect()
}

#[test]
fn tiny_gpt_overfits_one_batch() {
    let losses = train(&gpt(), 2, 12, 150, 1e-2, 1);
    let (first, last) = (losses[0], *losses.last().unwrap());
    // Start near ln(16) = 2.77 (uniform over the vocabulary), end near zero.
    assert!((first - 16f64.ln()).abs() < 0.3, "initial loss {first}");
    assert!(last < 0.02, "final loss {last} (first {first})");
}

#[test]
fn tiny_vit_overfits_one_batch() {
    let losses = train(&vit(), 8, 0, 100, 1e-2, 1);
    let (first, last) = (losses[0], *losses.last().unwrap());
    assert!((first - 4f64.ln()).abs() < 0.3, "initial loss {first}");
    assert!(last < 0.02, "final loss {last} (first {first})");
}

#[test]
fn same_seed_same_thread_count_gives_bitwise_identical_losses() {
    for threads in [1, 2] {
        let a = train(&gpt(), 2, 12, 5, 1e-2, threads);
        let b = train(&gpt(), 2, 12, 5, 1e-2, threads);
        assert_eq!(a, b, "{threads} threads");
    }
}

#[test]
fn dropout_runs_are_deterministic_and_differ_from_no_dropout() {
    let with_dropout = common::tiny_gpt(0.1);
    let a = train(&with_dropout, 2, 7, 3, 1e-2, 2);
    let b = train(&with_dropout, 2, 7, 3, 1e-2, 2);
    let c = train(&common::tiny_gpt(0.0), 2, 7, 3, 1e-2, 2);
    assert_eq!(a, b);
    assert_ne!(a, c, "dropout changes the losses");
}

#[test]
fn freezing_mid_run_keeps_frozen_weights_and_drops_their_optimizer_state() {
    let dev = CpuDevice::<f32>::new(0, 1).unwrap();
    let config = gpt();
    let mut model = Model::new(&dev, &config, 1).unwrap();
    let batch = Batch::upload(&dev, model.spec(), &HostBatch::random(&config, 2, 12, 2), true, 3).unwrap();
    let mut opt = Optimizer::new(OptimizerConfig::adamw()).unwrap();
    for _ in 0..3 {
        train_step(&dev, &mut model, &mut opt, &batch, 1e-2, None).unwrap();
    }
    model.freeze_prefix(&dev, 3).unwrap();
    let released = opt.release_frozen(&model.params());
    assert!(released > 0, "the frozen units' optimizer state is released");
    let snapshot = |m: &Model<CpuDevice<f32>>| -> Vec<Vec<f32>> {
        m.units()[..3].iter().flat_map(|u| u.params()).map(|p| dev_download(&dev, &p.value)).collect()
    };
    let before = snapshot(&model);
    let last_trainable = |m: &Model<CpuDevice<f32>>| {
        dev_download(&dev, &m.params().into_iter().rfind(|p| p.trainable()).expect("a trainable parameter").value)
    };
    let top_before = last_trainable(&model);
    for _ in 0..3 {
        train_step(&dev, &mut model, &mut opt, &batch, 1e-2, None).unwrap();
    }
    assert_eq!(before, snapshot(&model), "frozen weights do not move");
    assert!(top_before != last_trainable(&model), "the rest keeps training");
    for p in model.params().iter().filter(|p| p.grad.is_none()) {
        assert!(!opt.has_state(&p.name), "{} is frozen but has optimizer state", p.name);
    }
}

fn dev_download(dev: &CpuDevice<f32>, b: &<CpuDevice<f32> as pipetransformer::Device>::Buf) -> Vec<f32> {
    use pipetransformer::Device;
    dev.download(b).unwrap()
}

/// `train_step` clips inside the optimizer's update: on f64 its weights equal those of scaling
/// the gradients first (by the norm's coefficient, then `Optimizer::step`) to the bit, for AdamW and SGD,
/// on steps where clipping is due (norm above the cap) and where it is not.
#[test]
fn clipping_inside_the_update_equals_clipping_first() {
    use pipetransformer::optim::{clip_coefficient, global_grad_norm, scale_grads};
    let dev = CpuDevice::<f64>::new(0, 2).unwrap();
    let config = gpt();
    let host = HostBatch::random(&config, 3, 8, 2);
    for opt_config in [OptimizerConfig::adamw(), OptimizerConfig::sgd()] {
        for max_norm in [1e-3, 1e3] {
            let (mut fused, mut first) = (Model::new(&dev, &config, 1).unwrap(), Model::new(&dev, &config, 1).unwrap());
            let (mut opt_fused, mut opt_first) =
                (Optimizer::new(opt_config).unwrap(), Optimizer::new(opt_config).unwrap());
            for step in 0..3 {
                let batch = Batch::upload(&dev, fused.spec(), &host, true, step).unwrap();
                let stats = train_step(&dev, &mut fused, &mut opt_fused, &batch, 1e-2, Some(max_norm)).unwrap();
                first.zero_grad(&dev).unwrap();
                let loss = first.forward_backward(&dev, &batch).unwrap();
                // The tied weight's norm counted once, both copies scaled.
                let norm = global_grad_norm(&dev, &first.distinct_params()).unwrap();
                let mut params = first.params_mut();
                if let Some(coef) = clip_coefficient(norm, max_norm).unwrap() {
                    scale_grads(&dev, &mut params, coef).unwrap();
                }
                opt_first.step(&dev, &mut params, 1e-2).unwrap();
                assert_eq!((stats.loss, stats.grad_norm), (loss, norm));
                assert_eq!(max_norm < norm, max_norm == 1e-3, "clipping due only under the small cap");
            }
            for (a, b) in fused.params().iter().zip(first.params()) {
                let (a, b) = (
                    pipetransformer::Device::download_f64(&dev, &a.value).unwrap(),
                    pipetransformer::Device::download_f64(&dev, &b.value).unwrap(),
                );
                assert_eq!(a, b, "{opt_config:?} max_norm {max_norm}");
            }
        }
    }
}
