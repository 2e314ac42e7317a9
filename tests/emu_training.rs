//! Training through the emulated CUDA kernels follows the `cpu` backend: 20 AdamW steps of a
//! tiny BERT, GPT and ViT (dropout on, padding, ignored targets) on `cuda-emu`, loss by loss,
//! within 1e-4 relative in f32 mode and 2% in bf16 mode. With `PT_TEST_DEVICE=cuda` the same
//! runs go to the GPU.

mod common;

use common::{tiny_batch, tiny_bert, tiny_gpt, tiny_vit};
use pipetransformer::device::{CpuDevice, Device, GpuDevice, Precision};
use pipetransformer::model::{Batch, ModelConfig, Pooling};
use pipetransformer::optim::{Optimizer, OptimizerConfig, train_step};

const STEPS: usize = 20;

/// Losses of `STEPS` AdamW steps on one fixed batch.
fn losses<D: Device>(dev: &D, config: &ModelConfig) -> Vec<f64> {
    let mut model = pipetransformer::model::Model::new(dev, config, 1).expect("model");
    let batch = Batch::upload(dev, model.spec(), &tiny_batch(config, 2), true, 3).expect("batch");
    let mut opt = Optimizer::new(OptimizerConfig::AdamW { beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.01 })
        .expect("optimizer");
    (0..STEPS).map(|_| train_step(dev, &mut model, &mut opt, &batch, 1e-2, Some(1.0)).expect("step").loss).collect()
}

fn device(precision: Precision) -> GpuDevice {
    match std::env::var("PT_TEST_DEVICE").as_deref() {
        Ok("cuda") => pipetransformer::device::cuda::device(0, precision).expect("cuda device"),
        _ => pipetransformer::device::emu::device(0, precision, 1).expect("emu device"),
    }
}

fn check(config: ModelConfig, precision: Precision, tol: f64) {
    let cpu = losses(&CpuDevice::<f32>::new(0, 1).expect("cpu"), &config);
    let gpu = losses(&device(precision), &config);
    assert!(cpu[STEPS - 1] < cpu[0] * 0.7, "the reference run does not learn: {cpu:?}");
    for (step, (c, g)) in cpu.iter().zip(&gpu).enumerate() {
        let rel = (g - c).abs() / c.abs();
        assert!(
            rel <= tol,
            "{precision:?} step {step}: loss {g} vs cpu {c} (relative {rel:.2e} > {tol:.0e})\ncpu {cpu:?}\ngpu {gpu:?}"
        );
    }
}

#[test]
fn bert_f32_follows_cpu() {
    check(tiny_bert(Pooling::ClsPooler, 0.1), Precision::F32, 1e-4);
}

#[test]
fn gpt_f32_follows_cpu() {
    check(tiny_gpt(0.1), Precision::F32, 1e-4);
}

#[test]
fn vit_f32_follows_cpu() {
    check(tiny_vit(0.1), Precision::F32, 1e-4);
}

#[test]
fn bert_bf16_follows_cpu() {
    check(tiny_bert(Pooling::Mean, 0.1), Precision::Bf16, 2e-2);
}

#[test]
fn gpt_bf16_follows_cpu() {
    check(tiny_gpt(0.1), Precision::Bf16, 2e-2);
}
