//! Tiny model configurations with odd sizes (2 layers, hidden 10, 2 heads of 5, MLP 14): small
//! enough for finite differences and step-by-step comparisons, uneven enough to catch a
//! transposed shape. Shared by the unit tests, the integration tests and the benches.

use super::config::{BertConfig, GptConfig, ModelConfig, Pooling, VitConfig};

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

/// A 1-layer ViT on 4×4 one-channel images cut into 2×2 patches (hidden 4, 2 heads, MLP 6,
/// 2 labels): the smallest that reads digit-like pixel rows, for the export and `predict`
/// tests.
pub fn tiny_gray_vit() -> ModelConfig {
    ModelConfig::Vit(VitConfig {
        image_size: 4,
        patch_size: 2,
        num_channels: 1,
        hidden_size: 4,
        num_hidden_layers: 1,
        num_attention_heads: 2,
        intermediate_size: 6,
        hidden_act: "gelu".into(),
        layer_norm_eps: 1e-12,
        hidden_dropout_prob: 0.0,
        attention_probs_dropout_prob: 0.0,
        num_labels: 2,
    })
}
