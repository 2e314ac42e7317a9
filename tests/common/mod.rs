//! Tiny model configurations and batches shared by the integration tests.
#![allow(dead_code)]

use pipetransformer::model::{BertConfig, GptConfig, HostBatch, IGNORE_INDEX, ModelConfig, Pooling, VitConfig};
use pipetransformer::rng::Rng;

/// A 2-layer post-LN BERT with odd sizes: hidden 10, 2 heads of 5, MLP 14, 3 labels.
pub fn tiny_bert(pooling: Pooling, dropout: f32) -> ModelConfig {
    ModelConfig::Bert(BertConfig {
        vocab_size: 13,
        hidden_size: 10,
        num_hidden_layers: 2,
        num_attention_heads: 2,
        intermediate_size: 14,
        hidden_act: "gelu".into(),
        max_position_embeddings: 9,
        type_vocab_size: 2,
        layer_norm_eps: 1e-12,
        hidden_dropout_prob: dropout,
        attention_probs_dropout_prob: dropout,
        num_labels: 3,
        pooling,
    })
}

/// A 2-layer pre-LN causal GPT: hidden 10, 2 heads, MLP 14, vocab 17, tied head.
pub fn tiny_gpt(dropout: f32) -> ModelConfig {
    ModelConfig::Gpt(GptConfig {
        vocab_size: 17,
        n_positions: 9,
        n_embd: 10,
        n_layer: 2,
        n_head: 2,
        n_inner: Some(14),
        activation_function: "gelu_new".into(),
        layer_norm_epsilon: 1e-5,
        resid_pdrop: dropout,
        embd_pdrop: dropout,
        attn_pdrop: dropout,
    })
}

/// A 2-layer pre-LN ViT on 6×6 two-channel images cut into 3×3 patches: hidden 10, 3 labels.
pub fn tiny_vit(dropout: f32) -> ModelConfig {
    ModelConfig::Vit(VitConfig {
        image_size: 6,
        patch_size: 3,
        num_channels: 2,
        hidden_size: 10,
        num_hidden_layers: 2,
        num_attention_heads: 2,
        intermediate_size: 14,
        hidden_act: "gelu".into(),
        layer_norm_eps: 1e-12,
        hidden_dropout_prob: dropout,
        attention_probs_dropout_prob: dropout,
        num_labels: 3,
    })
}

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
