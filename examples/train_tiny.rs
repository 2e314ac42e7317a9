//! Builds a tiny GPT, freezes its embedding, and trains it for a few steps on a synthetic
//! next-token batch through the public API.

use pipetransformer::bench::random_batch;
use pipetransformer::device::CpuDevice;
use pipetransformer::model::{Batch, GptConfig, Model, ModelConfig};
use pipetransformer::train::{Optimizer, OptimizerConfig, train_step};

fn main() -> pipetransformer::Result<()> {
    let config = ModelConfig::Gpt(GptConfig {
        vocab_size: 64,
        n_positions: 32,
        n_embd: 32,
        n_layer: 2,
        n_head: 4,
        n_inner: None,
        activation_function: "gelu_new".into(),
        layer_norm_epsilon: 1e-5,
        resid_pdrop: 0.0,
        embd_pdrop: 0.0,
        attn_pdrop: 0.0,
    });
    let dev = CpuDevice::<f32>::new(0, 0)?;
    let mut model = Model::new(&dev, &config, 42)?;
    model.freeze_prefix(&dev, 1)?;
    let batch = Batch::upload(&dev, model.spec(), &random_batch(&config, 4, 16, 1), true, 7)?;
    let mut opt = Optimizer::new(OptimizerConfig::adamw())?;
    for step in 0..20 {
        let stats = train_step(&dev, &mut model, &mut opt, &batch, 3e-3, Some(1.0))?;
        println!("step {step:2}  loss {:.4}", stats.loss);
    }
    for (unit, cost) in model.units().iter().zip(model.costs(&dev, 16)) {
        println!("{:<12} params {:>7}  fwd {:>10.0} FLOP/sample", unit.kind_name(), cost.params, cost.forward_flops);
    }
    Ok(())
}
