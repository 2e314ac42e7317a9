//! Model configurations (serde, Hugging Face field names) and `Spec`, the validated,
//! family-independent description the units are built from.

use crate::error::{Error, Result, config_error};
use crate::ops::gelu::Activation;
use serde::{Deserialize, Serialize};

/// Where LayerNorm sits relative to each residual branch.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum NormPlacement {
    /// BERT: `y = LN(x + f(x))`.
    Post,
    /// GPT-2, ViT: `y = x + f(LN(x))`, with a final LayerNorm after the last block.
    Pre,
}

/// How a classifier turns a sequence of hidden states into one vector.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Pooling {
    /// BERT's pooler: `tanh(dense(h[CLS]))` (Hugging Face `BertForSequenceClassification`).
    #[default]
    ClsPooler,
    /// The first token's hidden state as is (ViT's class token).
    Cls,
    /// Mean over real (unmasked) tokens: sentence-transformers' pooling for all-MiniLM-L6-v2.
    Mean,
}

/// A post-LN BERT encoder with a sequence-classification head (Hugging Face `BertConfig` names,
/// so a model's `config.json` deserialises directly).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct BertConfig {
    /// Token vocabulary size.
    pub vocab_size: usize,
    /// Width of the hidden states.
    pub hidden_size: usize,
    /// Transformer blocks.
    pub num_hidden_layers: usize,
    /// Attention heads per block.
    pub num_attention_heads: usize,
    /// Width of the MLP's hidden layer.
    pub intermediate_size: usize,
    /// `gelu` (erf) or a tanh-GELU name.
    #[serde(default = "default_gelu")]
    pub hidden_act: String,
    /// Rows of the position table: the longest sequence the model accepts.
    pub max_position_embeddings: usize,
    /// Rows of the token-type (segment) table.
    #[serde(default = "default_type_vocab")]
    pub type_vocab_size: usize,
    /// LayerNorm epsilon.
    #[serde(default = "default_bert_eps")]
    pub layer_norm_eps: f64,
    /// Dropout on embeddings and residual branches.
    #[serde(default = "default_dropout")]
    pub hidden_dropout_prob: f32,
    /// Dropout on attention probabilities.
    #[serde(default = "default_dropout")]
    pub attention_probs_dropout_prob: f32,
    /// Classes of the classification head.
    #[serde(default = "default_num_labels")]
    pub num_labels: usize,
    /// How the classification head pools the sequence.
    #[serde(default)]
    pub pooling: Pooling,
}

/// A pre-LN causal language model, GPT-2 style, with the LM head tied to the token embedding
/// (Hugging Face `GPT2Config` names).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct GptConfig {
    /// Token vocabulary size.
    pub vocab_size: usize,
    /// Rows of the position table.
    pub n_positions: usize,
    /// Width of the hidden states.
    pub n_embd: usize,
    /// Transformer blocks.
    pub n_layer: usize,
    /// Attention heads per block.
    pub n_head: usize,
    /// Width of the MLP's hidden layer (default `4·n_embd`).
    #[serde(default)]
    pub n_inner: Option<usize>,
    /// GELU form (GPT-2 uses `gelu_new`, the tanh form).
    #[serde(default = "default_gelu_new")]
    pub activation_function: String,
    /// LayerNorm epsilon.
    #[serde(default = "default_gpt_eps")]
    pub layer_norm_epsilon: f64,
    /// Dropout on residual branches.
    #[serde(default = "default_dropout")]
    pub resid_pdrop: f32,
    /// Dropout on the embeddings.
    #[serde(default = "default_dropout")]
    pub embd_pdrop: f32,
    /// Dropout on attention probabilities.
    #[serde(default = "default_dropout")]
    pub attn_pdrop: f32,
}

impl GptConfig {
    /// A GPT-2-style model without dropout and with GPT-2's defaults elsewhere (tanh GELU,
    /// MLP width `4·n_embd`, epsilon 1e-5): the shape small experiments and tests need.
    pub fn without_dropout(
        vocab_size: usize,
        n_positions: usize,
        n_embd: usize,
        n_layer: usize,
        n_head: usize,
    ) -> Self {
        Self {
            vocab_size,
            n_positions,
            n_embd,
            n_layer,
            n_head,
            n_inner: None,
            activation_function: default_gelu_new(),
            layer_norm_epsilon: default_gpt_eps(),
            resid_pdrop: 0.0,
            embd_pdrop: 0.0,
            attn_pdrop: 0.0,
        }
    }
}

/// A pre-LN Vision Transformer classifier (Hugging Face `ViTConfig` names): square images cut
/// into square patches, a class token, learned positions.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct VitConfig {
    /// Image side in pixels.
    pub image_size: usize,
    /// Patch side in pixels (must divide `image_size`).
    pub patch_size: usize,
    /// Colour channels.
    #[serde(default = "default_channels")]
    pub num_channels: usize,
    /// Width of the hidden states.
    pub hidden_size: usize,
    /// Transformer blocks.
    pub num_hidden_layers: usize,
    /// Attention heads per block.
    pub num_attention_heads: usize,
    /// Width of the MLP's hidden layer.
    pub intermediate_size: usize,
    /// GELU form.
    #[serde(default = "default_gelu")]
    pub hidden_act: String,
    /// LayerNorm epsilon.
    #[serde(default = "default_bert_eps")]
    pub layer_norm_eps: f64,
    /// Dropout on embeddings and residual branches.
    #[serde(default)]
    pub hidden_dropout_prob: f32,
    /// Dropout on attention probabilities.
    #[serde(default)]
    pub attention_probs_dropout_prob: f32,
    /// Classes of the classification head.
    #[serde(default = "default_num_labels")]
    pub num_labels: usize,
}

fn default_gelu() -> String {
    "gelu".into()
}
fn default_gelu_new() -> String {
    "gelu_new".into()
}
fn default_type_vocab() -> usize {
    2
}
fn default_bert_eps() -> f64 {
    1e-12
}
fn default_gpt_eps() -> f64 {
    1e-5
}
fn default_dropout() -> f32 {
    0.1
}
fn default_num_labels() -> usize {
    2
}
fn default_channels() -> usize {
    3
}

/// Any of the three model families.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "family", rename_all = "snake_case")]
pub enum ModelConfig {
    /// Post-LN BERT classifier.
    Bert(BertConfig),
    /// Pre-LN causal LM with a tied head.
    Gpt(GptConfig),
    /// Pre-LN ViT classifier.
    Vit(VitConfig),
}

/// Which family a [`Spec`] came from: decides parameter names.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Family {
    /// BERT (Hugging Face `BertModel` names, no `bert.` prefix, plus `classifier.*`).
    Bert,
    /// GPT (GPT-2-like names under `transformer.`, separate q/k/v projections).
    Gpt,
    /// ViT (Hugging Face `ViTForImageClassification` names).
    Vit,
}

impl std::fmt::Display for Family {
    /// The name as people write it: `BERT`, `GPT`, `ViT`.
    fn fmt(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str(match self {
            Family::Bert => "BERT",
            Family::Gpt => "GPT",
            Family::Vit => "ViT",
        })
    }
}

/// What the embedding unit consumes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum InputSpec {
    /// Token ids (and, for BERT, token types), with a learned position table.
    Tokens {
        /// Vocabulary size.
        vocab: usize,
        /// Rows of the position table.
        max_positions: usize,
        /// Rows of the token-type table, if the model has one.
        type_vocab: Option<usize>,
        /// Whether a LayerNorm follows the embedding sum (BERT).
        norm: bool,
    },
    /// Images cut into patches, plus a class token.
    Image {
        /// Colour channels.
        channels: usize,
        /// Image side in pixels.
        image_size: usize,
        /// Patch side in pixels.
        patch: usize,
    },
}

/// What the last unit computes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HeadSpec {
    /// Pool the sequence, then a linear classifier over `num_labels` classes.
    Classifier {
        /// Pooling.
        pooling: Pooling,
        /// Classes.
        num_labels: usize,
    },
    /// Next-token logits through the transposed token-embedding table.
    TiedLmHead,
}

/// A validated model description, common to all families.
#[derive(Clone, Debug, PartialEq)]
pub struct Spec {
    /// Family (parameter names).
    pub family: Family,
    /// Hidden width `C`.
    pub hidden: usize,
    /// Attention heads (`C` is a multiple).
    pub heads: usize,
    /// Transformer blocks (≥ 1).
    pub layers: usize,
    /// MLP hidden width.
    pub mlp_hidden: usize,
    /// GELU form.
    pub act: Activation,
    /// LayerNorm epsilon.
    pub eps: f64,
    /// LayerNorm placement.
    pub norm: NormPlacement,
    /// Causal attention (language models).
    pub causal: bool,
    /// Dropout on the embedding output.
    pub embed_dropout: f32,
    /// Dropout on residual branches (and BERT's classifier input).
    pub hidden_dropout: f32,
    /// Dropout on attention probabilities.
    pub attn_dropout: f32,
    /// Input side.
    pub input: InputSpec,
    /// Output side.
    pub head: HeadSpec,
}

impl Spec {
    /// Channels per head.
    pub fn head_dim(&self) -> usize {
        self.hidden / self.heads
    }
    /// Hidden-state positions per sample for a given input length (tokens, or patches + 1).
    pub fn max_seq(&self) -> usize {
        match self.input {
            InputSpec::Tokens { max_positions, .. } => max_positions,
            InputSpec::Image { image_size, patch, .. } => (image_size / patch).pow(2) + 1,
        }
    }
}

/// Most parameters a model may have (~1.1e12, 4 TiB of f32 weights): far beyond any model
/// this engine trains, and low enough that every size the model derives from its config
/// (`in·out` of each layer, the tables, their sum, their bytes) fits in `usize`.
pub const MAX_PARAMETERS: usize = 1 << 40;

impl Spec {
    /// Parameters a model of this spec holds, or `None` if the count overflows `usize`.
    pub fn parameter_count(&self) -> Option<usize> {
        let h = self.hidden;
        let linear = |i: usize, o: usize| i.checked_mul(o)?.checked_add(o);
        let norm = h.checked_mul(2)?;
        let embedding = match self.input {
            InputSpec::Tokens { vocab, max_positions, type_vocab, norm: with_norm } => {
                let rows = vocab.checked_add(max_positions)?.checked_add(type_vocab.unwrap_or(0))?;
                rows.checked_mul(h)?.checked_add(if with_norm { norm } else { 0 })?
            }
            InputSpec::Image { channels, image_size, patch } => {
                let patches = (image_size / patch.max(1)).checked_pow(2)?;
                let projection = linear(channels.checked_mul(patch)?.checked_mul(patch)?, h)?;
                // Class token plus one position per patch and the class token.
                projection.checked_add(patches.checked_add(2)?.checked_mul(h)?)?
            }
        };
        // Q, K, V and output projections, two norms, the MLP's two layers.
        let block = linear(h, h)?
            .checked_mul(4)?
            .checked_add(norm.checked_mul(2)?)?
            .checked_add(linear(h, self.mlp_hidden)?)?
            .checked_add(linear(self.mlp_hidden, h)?)?;
        let head = match self.head {
            HeadSpec::Classifier { pooling, num_labels } => {
                let pooler = if pooling == Pooling::ClsPooler { linear(h, h)? } else { 0 };
                pooler.checked_add(linear(h, num_labels)?)?
            }
            HeadSpec::TiedLmHead => 0,
        };
        // Pre-LN families end in a final norm.
        let final_norm = if self.norm == NormPlacement::Pre { norm } else { 0 };
        embedding.checked_add(block.checked_mul(self.layers)?)?.checked_add(head)?.checked_add(final_norm)
    }
}

impl ModelConfig {
    /// Which family this is.
    pub fn family(&self) -> Family {
        match self {
            ModelConfig::Bert(_) => Family::Bert,
            ModelConfig::Gpt(_) => Family::Gpt,
            ModelConfig::Vit(_) => Family::Vit,
        }
    }

    /// Validates the configuration and derives the [`Spec`]. Every error names the field.
    pub fn spec(&self) -> Result<Spec> {
        let spec = self.spec_fields()?;
        match spec.parameter_count() {
            Some(n) if n <= MAX_PARAMETERS => Ok(spec),
            count => {
                let family = match spec.family {
                    Family::Bert => "bert",
                    Family::Gpt => "gpt",
                    Family::Vit => "vit",
                };
                Err(config_error(
                    family,
                    format!(
                        "these sizes make {} parameters; expected at most {MAX_PARAMETERS} (check hidden, vocabulary, \
                         position, image and layer sizes)",
                        count.map_or("more than usize::MAX".to_string(), |n| n.to_string())
                    ),
                ))
            }
        }
    }

    /// [`ModelConfig::spec`] without the overall size check.
    fn spec_fields(&self) -> Result<Spec> {
        match self {
            ModelConfig::Bert(c) => {
                let act = Activation::parse(&c.hidden_act, "bert.hidden_act")?;
                check_common(
                    "bert",
                    &[
                        ("vocab_size", c.vocab_size),
                        ("max_position_embeddings", c.max_position_embeddings),
                        ("intermediate_size", c.intermediate_size),
                        ("type_vocab_size", c.type_vocab_size),
                        ("num_labels", c.num_labels),
                    ],
                    c.hidden_size,
                    c.num_attention_heads,
                    c.num_hidden_layers,
                    ("hidden_size", "num_attention_heads", "num_hidden_layers"),
                )?;
                check_eps("bert.layer_norm_eps", c.layer_norm_eps)?;
                check_classes("bert.num_labels", c.num_labels)?;
                check_dropout("bert.hidden_dropout_prob", c.hidden_dropout_prob)?;
                check_dropout("bert.attention_probs_dropout_prob", c.attention_probs_dropout_prob)?;
                Ok(Spec {
                    family: Family::Bert,
                    hidden: c.hidden_size,
                    heads: c.num_attention_heads,
                    layers: c.num_hidden_layers,
                    mlp_hidden: c.intermediate_size,
                    act,
                    eps: c.layer_norm_eps,
                    norm: NormPlacement::Post,
                    causal: false,
                    embed_dropout: c.hidden_dropout_prob,
                    hidden_dropout: c.hidden_dropout_prob,
                    attn_dropout: c.attention_probs_dropout_prob,
                    input: InputSpec::Tokens {
                        vocab: c.vocab_size,
                        max_positions: c.max_position_embeddings,
                        type_vocab: Some(c.type_vocab_size),
                        norm: true,
                    },
                    head: HeadSpec::Classifier { pooling: c.pooling, num_labels: c.num_labels },
                })
            }
            ModelConfig::Gpt(c) => {
                let act = Activation::parse(&c.activation_function, "gpt.activation_function")?;
                let inner = match c.n_inner {
                    Some(n) => n,
                    None => c.n_embd.checked_mul(4).ok_or_else(|| {
                        config_error(
                            "gpt.n_embd",
                            format!("{} is too large: 4 × n_embd (the default n_inner) overflows", c.n_embd),
                        )
                    })?,
                };
                check_common(
                    "gpt",
                    &[("vocab_size", c.vocab_size), ("n_positions", c.n_positions), ("n_inner", inner)],
                    c.n_embd,
                    c.n_head,
                    c.n_layer,
                    ("n_embd", "n_head", "n_layer"),
                )?;
                check_eps("gpt.layer_norm_epsilon", c.layer_norm_epsilon)?;
                check_dropout("gpt.resid_pdrop", c.resid_pdrop)?;
                check_dropout("gpt.embd_pdrop", c.embd_pdrop)?;
                check_dropout("gpt.attn_pdrop", c.attn_pdrop)?;
                Ok(Spec {
                    family: Family::Gpt,
                    hidden: c.n_embd,
                    heads: c.n_head,
                    layers: c.n_layer,
                    mlp_hidden: inner,
                    act,
                    eps: c.layer_norm_epsilon,
                    norm: NormPlacement::Pre,
                    causal: true,
                    embed_dropout: c.embd_pdrop,
                    hidden_dropout: c.resid_pdrop,
                    attn_dropout: c.attn_pdrop,
                    input: InputSpec::Tokens {
                        vocab: c.vocab_size,
                        max_positions: c.n_positions,
                        type_vocab: None,
                        norm: false,
                    },
                    head: HeadSpec::TiedLmHead,
                })
            }
            ModelConfig::Vit(c) => {
                let act = Activation::parse(&c.hidden_act, "vit.hidden_act")?;
                check_common(
                    "vit",
                    &[
                        ("image_size", c.image_size),
                        ("patch_size", c.patch_size),
                        ("num_channels", c.num_channels),
                        ("intermediate_size", c.intermediate_size),
                        ("num_labels", c.num_labels),
                    ],
                    c.hidden_size,
                    c.num_attention_heads,
                    c.num_hidden_layers,
                    ("hidden_size", "num_attention_heads", "num_hidden_layers"),
                )?;
                if c.image_size % c.patch_size != 0 {
                    return Err(config_error(
                        "vit.patch_size",
                        format!("{} does not divide image_size {}", c.patch_size, c.image_size),
                    ));
                }
                check_eps("vit.layer_norm_eps", c.layer_norm_eps)?;
                check_classes("vit.num_labels", c.num_labels)?;
                check_dropout("vit.hidden_dropout_prob", c.hidden_dropout_prob)?;
                check_dropout("vit.attention_probs_dropout_prob", c.attention_probs_dropout_prob)?;
                Ok(Spec {
                    family: Family::Vit,
                    hidden: c.hidden_size,
                    heads: c.num_attention_heads,
                    layers: c.num_hidden_layers,
                    mlp_hidden: c.intermediate_size,
                    act,
                    eps: c.layer_norm_eps,
                    norm: NormPlacement::Pre,
                    causal: false,
                    embed_dropout: c.hidden_dropout_prob,
                    hidden_dropout: c.hidden_dropout_prob,
                    attn_dropout: c.attention_probs_dropout_prob,
                    input: InputSpec::Image { channels: c.num_channels, image_size: c.image_size, patch: c.patch_size },
                    head: HeadSpec::Classifier { pooling: Pooling::Cls, num_labels: c.num_labels },
                })
            }
        }
    }
}

/// Checks the fields every family has: positive sizes, at least one layer, and a hidden width
/// divisible by the head count.
fn check_common(
    family: &str,
    positive: &[(&str, usize)],
    hidden: usize,
    heads: usize,
    layers: usize,
    names: (&str, &str, &str),
) -> Result<()> {
    for &(name, value) in positive {
        if value == 0 {
            return Err(config_error(format!("{family}.{name}"), "must be at least 1, got 0"));
        }
    }
    if layers == 0 {
        return Err(config_error(format!("{family}.{}", names.2), "must be at least 1 layer, got 0"));
    }
    if heads == 0 {
        return Err(config_error(format!("{family}.{}", names.1), "must be at least 1, got 0"));
    }
    if hidden == 0 || !hidden.is_multiple_of(heads) {
        return Err(config_error(
            format!("{family}.{}", names.0),
            format!("{} = {hidden} must be a positive multiple of {} = {heads}", names.0, names.1),
        ));
    }
    Ok(())
}

/// A LayerNorm epsilon: positive, and no smaller than the least normal f32, whose scale
/// `1/sqrt(var + eps)` of a constant row (var 0) an f32 still holds (below about 1e-77 it
/// overflows, and the row's `0 · inf` is NaN where the answer is the bias).
fn check_eps(field: &str, eps: f64) -> Result<()> {
    let least = f64::from(f32::MIN_POSITIVE);
    if eps >= least && eps.is_finite() {
        Ok(())
    } else {
        Err(config_error(
            field,
            format!("must be a positive number of at least {least:e} (the least normal f32), got {eps}"),
        ))
    }
}

/// A classifier's class count: two at least (one class has nothing to tell apart, and its
/// loss is 0 whatever the weights; Hugging Face reads `num_labels = 1` as a regression head,
/// which this engine does not train).
fn check_classes(field: &str, n: usize) -> Result<()> {
    match n {
        0 | 1 => Err(config_error(
            field,
            format!(
                "{n} classes; a classifier needs two at least (a regression head, num_labels = 1, is not trained here)"
            ),
        )),
        _ => Ok(()),
    }
}

fn check_dropout(field: &str, p: f32) -> Result<(), Error> {
    if (0.0..1.0).contains(&p) { Ok(()) } else { Err(config_error(field, format!("must be in [0, 1), got {p}"))) }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn field_of(config: ModelConfig) -> (String, String) {
        match config.spec() {
            Err(Error::Config { field, message }) => (field, message),
            other => panic!("expected a config error, got {other:?}"),
        }
    }

    /// Found by fuzzing `config.json` (src/fuzz): sizes whose derived products overflowed
    /// panicked in debug builds and wrapped to a wrong size in release.
    #[test]
    fn sizes_that_overflow_are_config_errors() {
        let gpt = GptConfig::without_dropout(65, 128, usize::MAX / 2, 2, 1);
        let (field, message) = field_of(ModelConfig::Gpt(gpt));
        assert_eq!(field, "gpt.n_embd");
        assert!(message.contains("4 × n_embd"), "{message}");

        // `(image_size / patch_size)²` in the position table overflowed `max_seq`.
        let vit = VitConfig {
            image_size: 1 << 40,
            patch_size: 1,
            num_channels: 1,
            hidden_size: 4,
            num_hidden_layers: 1,
            num_attention_heads: 1,
            intermediate_size: 4,
            hidden_act: "gelu".into(),
            layer_norm_eps: 1e-6,
            hidden_dropout_prob: 0.0,
            attention_probs_dropout_prob: 0.0,
            num_labels: 10,
        };
        let (field, message) = field_of(ModelConfig::Vit(vit.clone()));
        assert_eq!(field, "vit");
        assert!(message.contains("more than usize::MAX parameters"), "{message}");

        // Large but representable: refused by count, naming it.
        let huge = GptConfig::without_dropout(1 << 30, 128, 1 << 12, 2, 1);
        let (field, message) = field_of(ModelConfig::Gpt(huge));
        assert_eq!(field, "gpt");
        assert!(message.contains(&format!("expected at most {MAX_PARAMETERS}")), "{message}");

        // A small model is unaffected.
        let small = ModelConfig::Vit(VitConfig { image_size: 8, patch_size: 2, hidden_size: 8, ..vit });
        assert_eq!(small.spec().unwrap().max_seq(), 17);
    }

    /// A LayerNorm epsilon an f32 scale of a constant row overflows at (NaN, where the answer
    /// is the bias), and a classifier of one class (nothing to tell apart; Hugging Face's
    /// regression head), are refused naming their keys.
    #[test]
    fn a_tiny_epsilon_and_a_single_class_are_config_errors() {
        let mut gpt = GptConfig::without_dropout(65, 16, 8, 2, 1);
        gpt.layer_norm_epsilon = 1e-80;
        let (field, message) = field_of(ModelConfig::Gpt(gpt.clone()));
        assert_eq!(field, "gpt.layer_norm_epsilon");
        assert!(message.contains("least normal f32"), "{message}");
        gpt.layer_norm_epsilon = 1e-30;
        ModelConfig::Gpt(gpt).spec().unwrap();
        let ModelConfig::Vit(mut vit) = crate::model::tiny::tiny_gray_vit() else { panic!("a ViT") };
        vit.num_labels = 1;
        let (field, message) = field_of(ModelConfig::Vit(vit));
        assert_eq!(field, "vit.num_labels");
        assert!(message.contains("two at least"), "{message}");
    }

    /// The count the size check uses is exactly what a model of the spec holds.
    #[test]
    fn parameter_count_matches_the_built_model() {
        use crate::device::CpuDevice;
        let dev = CpuDevice::<f32>::new(0, 1).unwrap();
        use crate::model::tiny::{tiny_bert, tiny_gpt, tiny_vit};
        for config in [
            tiny_bert(Pooling::ClsPooler, 0.0),
            tiny_bert(Pooling::Mean, 0.0),
            ModelConfig::Gpt(GptConfig::without_dropout(17, 9, 8, 2, 2)),
            tiny_gpt(0.0),
            tiny_vit(0.0),
        ] {
            let model = crate::model::Model::new(&dev, &config, 0).unwrap();
            assert_eq!(config.spec().unwrap().parameter_count(), Some(model.num_params()), "{config:?}");
        }
    }
}
