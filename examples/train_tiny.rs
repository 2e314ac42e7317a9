//! Builds a tiny GPT, freezes its embedding (and with it the LM head, which is the same table:
//! GPT ties them), and trains it for a few steps on a synthetic next-token batch through the
//! public API.

use pipetransformer::device::CpuDevice;
use pipetransformer::model::{Batch, GptConfig, HostBatch, Model, ModelConfig};
use pipetransformer::optim::{Optimizer, OptimizerConfig, train_step};

fn main() -> pipetransformer::Result<()> {
    let config = ModelConfig::Gpt(GptConfig::without_dropout(64, 32, 32, 2, 4));
    let dev = CpuDevice::<f32>::new(0, 0)?;
    let mut model = Model::new(&dev, &config, 42)?;
    model.freeze_prefix(&dev, 1)?;
    let batch = Batch::upload(&dev, model.spec(), &HostBatch::random(&config, 4, 16, 1), true, 7)?;
    let mut opt = Optimizer::new(OptimizerConfig::adamw())?;
    for step in 0..20 {
        let stats = train_step(&dev, &mut model, &mut opt, &batch, 3e-3, Some(1.0))?;
        // A gradient norm that is not finite skips the update rather than ruin the weights.
        let skipped = if stats.applied { "" } else { "  (update skipped: gradient norm not finite)" };
        println!("step {step:2}  loss {:.4}{skipped}", stats.loss);
    }
    // Per unit; the head's table is the embedding's (tied), counted once in the total.
    for (unit, cost) in model.units().iter().zip(model.costs(&dev, 16)) {
        println!("{:<12} params {:>7}  fwd {:>10.0} FLOP/sample", unit.kind_name(), cost.params, cost.forward_flops);
    }
    println!("total        params {:>7}  (the tied table once)", model.num_params());
    Ok(())
}
