//! Workloads and measurements shared by the criterion benches (`benches/`) and the
//! `pipetransformer bench-step` report: the MiniLM-shaped encoder, synthetic batches, FLOP
//! counts and the machine's large-GEMM rate (the roofline the step is compared against).

use crate::device::Device;
use crate::model::{BertConfig, HostBatch, IGNORE_INDEX, Model, ModelConfig, Pooling};
use crate::ops::matmul::{MatRef, matmul};
use crate::rng::Rng;
use std::time::Instant;

/// all-MiniLM-L6-v2's shape: 6 layers, hidden 384, 12 heads, MLP 1536, vocabulary 30522, with a
/// 2-class mean-pooling head and Hugging Face's default dropout of 0.1.
pub fn minilm_shaped() -> ModelConfig {
    ModelConfig::Bert(BertConfig {
        vocab_size: 30522,
        hidden_size: 384,
        num_hidden_layers: 6,
        num_attention_heads: 12,
        intermediate_size: 1536,
        hidden_act: "gelu".into(),
        max_position_embeddings: 512,
        type_vocab_size: 2,
        layer_norm_eps: 1e-12,
        hidden_dropout_prob: 0.1,
        attention_probs_dropout_prob: 0.1,
        num_labels: 2,
        pooling: Pooling::Mean,
    })
}

/// A batch of random inputs for `config`: `batch` sequences of `seq` tokens (text), or
/// `batch` random images; random labels (next tokens for a language model).
pub fn random_batch(config: &ModelConfig, batch: usize, seq: usize, seed: u64) -> HostBatch {
    let mut rng = Rng::new(seed);
    let ids = |rng: &mut Rng, n: usize, below: usize| -> Vec<u32> {
        (0..n).map(|_| rng.below(below as u64) as u32).collect()
    };
    match config {
        ModelConfig::Bert(c) => HostBatch {
            batch,
            seq,
            tokens: Some(ids(&mut rng, batch * seq, c.vocab_size)),
            targets: ids(&mut rng, batch, c.num_labels),
            ..Default::default()
        },
        ModelConfig::Gpt(c) => {
            let tokens = ids(&mut rng, batch * seq, c.vocab_size);
            // Next-token targets: the sequence shifted left, the last position ignored.
            let targets =
                (0..batch * seq).map(|i| if (i + 1) % seq == 0 { IGNORE_INDEX } else { tokens[i + 1] }).collect();
            HostBatch { batch, seq, tokens: Some(tokens), targets, ..Default::default() }
        }
        ModelConfig::Vit(c) => {
            let n = batch * c.num_channels * c.image_size * c.image_size;
            let pixels = (0..n).map(|_| rng.uniform() as f32).collect();
            let targets = ids(&mut rng, batch, c.num_labels);
            HostBatch { batch, pixels: Some(pixels), targets, ..Default::default() }
        }
    }
}

/// FLOPs of one training step (forward + backward) of `batch` samples at hidden-state length
/// `seq`, from the units' analytic costs.
pub fn step_flops<D: Device>(model: &Model<D>, dev: &D, batch: usize, seq: usize) -> f64 {
    model.costs(dev, seq).iter().map(|c| c.forward_flops + c.backward_flops).sum::<f64>() * batch as f64
}

/// The best rate, in GFLOP/s, of `reps` f32 `n×n×n` GEMMs through [`matmul`] on a pool of
/// `threads` threads: the machine's practical f32 peak for this engine.
pub fn gemm_gflops(threads: usize, n: usize, reps: usize) -> crate::Result<f64> {
    let pool = rayon::ThreadPoolBuilder::new().num_threads(threads.max(1)).build().map_err(|e| {
        crate::Error::Config { field: "threads".into(), message: format!("cannot start {threads} threads: {e}") }
    })?;
    let mut rng = Rng::new(1);
    let a: Vec<f32> = rng.vec(n * n, 1.0).iter().map(|&x| x as f32).collect();
    let b: Vec<f32> = rng.vec(n * n, 1.0).iter().map(|&x| x as f32).collect();
    let mut c = vec![0f32; n * n];
    let mut best = f64::INFINITY;
    for _ in 0..reps.max(1) {
        let t = Instant::now();
        pool.install(|| matmul(&mut c, n, MatRef::rows(&a, n), MatRef::rows(&b, n), n, n, n, false));
        best = best.min(t.elapsed().as_secs_f64());
    }
    Ok(2.0 * (n as f64).powi(3) / best / 1e9)
}
