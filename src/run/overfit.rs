//! `overfit`: a small randomly initialised model memorises one fixed random batch. Forward,
//! backward and AdamW have to work together for the loss to reach zero, so this is the quickest
//! end-to-end check of a device (seconds, no data to install).

use crate::device::Device;
use crate::error::{Result, config_error};
use crate::model::{Batch, BertConfig, Family, GptConfig, HostBatch, Model, ModelConfig, Pooling, VitConfig};
use crate::optim::{Decay, LrSchedule, Optimizer, OptimizerConfig, train_step};

/// A small model of `family` without dropout (so memorisation is exact), with the batch size
/// and sequence length of its batch (0 for images).
fn small_config(family: Family) -> (ModelConfig, usize, usize) {
    match family {
        Family::Bert => (
            ModelConfig::Bert(BertConfig {
                vocab_size: 100,
                hidden_size: 64,
                num_hidden_layers: 2,
                num_attention_heads: 4,
                intermediate_size: 256,
                hidden_act: "gelu".into(),
                max_position_embeddings: 64,
                type_vocab_size: 2,
                layer_norm_eps: 1e-12,
                hidden_dropout_prob: 0.0,
                attention_probs_dropout_prob: 0.0,
                num_labels: 4,
                pooling: Pooling::ClsPooler,
            }),
            16,
            32,
        ),
        Family::Gpt => (ModelConfig::Gpt(GptConfig::without_dropout(64, 64, 64, 2, 4)), 4, 32),
        Family::Vit => (
            ModelConfig::Vit(VitConfig {
                image_size: 8,
                patch_size: 4,
                num_channels: 1,
                hidden_size: 64,
                num_hidden_layers: 2,
                num_attention_heads: 4,
                intermediate_size: 256,
                hidden_act: "gelu".into(),
                layer_norm_eps: 1e-12,
                hidden_dropout_prob: 0.0,
                attention_probs_dropout_prob: 0.0,
                num_labels: 10,
            }),
            32,
            0,
        ),
    }
}

/// Trains a small model of `family` (two layers of width 64, no dropout) for `steps` AdamW
/// steps (clipped at 1.0) on one random batch, the learning rate warming up over the first
/// tenth to `lr` and decaying by a cosine to `lr/10`. `say` receives the console's lines: what runs where, the loss every 20 steps and at
/// the last, and the final loss with the steps' time. Returns the losses, one per step.
///
/// Errors: `steps` of 0 or a learning rate that is not finite and ≥ 0 are
/// [`crate::Error::Config`]s on `steps` and `lr`; a loss that stops being finite is
/// [`crate::Error::Diverged`]; a device's failure as the device reports it.
pub fn overfit<D: Device>(
    dev: &D,
    family: Family,
    steps: u64,
    lr: f64,
    seed: u64,
    mut say: impl FnMut(String),
) -> Result<Vec<f64>> {
    if steps == 0 {
        return Err(config_error("steps", "must be at least 1"));
    }
    if !(lr.is_finite() && lr >= 0.0) {
        return Err(config_error("lr", format!("{lr} is not a learning rate: expected a number, finite and ≥ 0")));
    }
    let lr_schedule = LrSchedule {
        base_lr: lr,
        min_lr: lr / 10.0,
        warmup_steps: steps / 10,
        total_steps: steps,
        decay: Decay::Cosine,
    };
    let (config, batch, seq) = small_config(family);
    let mut model = Model::new(dev, &config, seed)?;
    let host = HostBatch::random(&config, batch, seq, seed.wrapping_add(1));
    let batch = Batch::upload(dev, model.spec(), &host, true, seed)?;
    let mut optimizer =
        Optimizer::new(OptimizerConfig::AdamW { beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.0 })?;
    say(format!(
        "overfit: {family:?} with {} parameters on {} — one batch of {} samples",
        model.num_params(),
        dev.name(),
        batch.batch
    ));
    let start = std::time::Instant::now();
    let mut losses = Vec::new(); // (not reserved: `--steps` is the user's, and may be any u64)
    for step in 0..steps {
        let stats = train_step(dev, &mut model, &mut optimizer, &batch, lr_schedule.lr_at(step), Some(1.0))?;
        if !stats.loss.is_finite() {
            say(format!("step {step:4}  loss {}", stats.loss));
            return Err(crate::Error::Diverged { step, loss: stats.loss });
        }
        losses.push(stats.loss);
        if step % 20 == 0 || step + 1 == steps {
            say(format!("step {step:4}  loss {:.5}  grad-norm {:.3}", stats.loss, stats.grad_norm));
        }
    }
    let last = losses.last().copied().unwrap_or(f64::NAN);
    say(format!("final loss {last:.5} after {steps} steps in {:.1} s", start.elapsed().as_secs_f64()));
    Ok(losses)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::CpuDevice;

    /// Each family memorises its batch: the loss starts near `ln(classes)` and falls more than
    /// tenfold in 100 steps (a wrong backward or update stalls it), and the console gets a line
    /// per 20 steps and the last.
    #[test]
    fn every_family_memorises_its_batch() {
        let dev = CpuDevice::<f32>::new(0, 1).unwrap();
        for (family, classes) in [(Family::Bert, 4.0f64), (Family::Gpt, 64.0), (Family::Vit, 10.0)] {
            let mut lines = Vec::new();
            let losses = overfit(&dev, family, 100, 3e-3, 0, |l| lines.push(l)).unwrap();
            let (first, last) = (losses[0], losses[99]);
            assert!((first - classes.ln()).abs() < 0.5, "{family:?}: first loss {first}");
            assert!(last < first / 10.0, "{family:?}: loss {first} → {last}");
            assert_eq!(lines.len(), 1 + 5 + 1 + 1, "{family:?}: {lines:?}");
            assert!(lines[0].starts_with(&format!("overfit: {family:?} with")), "{lines:?}");
            assert!(lines[7].starts_with(&format!("final loss {last:.5} after 100 steps in ")), "{lines:?}");
        }
    }

    #[test]
    fn no_steps_or_a_bad_rate_is_refused_by_name() {
        let dev = CpuDevice::<f32>::new(0, 1).unwrap();
        let e = overfit(&dev, Family::Gpt, 0, 1e-3, 0, |_| {}).unwrap_err();
        assert!(e.to_string().contains("steps") && e.to_string().contains("at least 1"), "{e}");
        for lr in [f64::NAN, -1e-3] {
            let e = overfit(&dev, Family::Gpt, 5, lr, 0, |_| {}).unwrap_err().to_string();
            assert!(e.contains("`lr`") && e.contains("not a learning rate"), "{e}");
        }
        // A rate that blows the loss up ends the command with an error, not a NaN "result".
        let mut lines = Vec::new();
        let e = overfit(&dev, Family::Vit, 3, 1e9, 0, |l| lines.push(l)).unwrap_err();
        assert!(matches!(e, crate::Error::Diverged { .. }), "{e}");
        assert!(lines.last().is_some_and(|l| l.contains("NaN") || l.contains("inf")), "{lines:?}");
    }
}
