//! Hugging Face `config.json` ↔ [`ModelConfig`].
//!
//! Our config structs use Hugging Face field names, so the work here is choosing the family
//! from `model_type` (or `architectures`) and refusing architectures whose weights our units
//! cannot hold, with a message that says which ones can.

use std::path::Path;

use serde_json::Value;

use crate::error::{Error, Result, config_error};
use crate::model::{Family, ModelConfig};

/// `model_type` this engine writes for its own GPT: Hugging Face's `gpt2` fuses q/k/v into one
/// Conv1D (`c_attn`, stored transposed), which our separate `q_proj`/`k_proj`/`v_proj` linear
/// layers do not read, so claiming `gpt2` would make real GPT-2 tools misread our files.
pub const OWN_GPT_MODEL_TYPE: &str = "pipetransformer_gpt";

const SUPPORTED: &str = "supported: bert, vit, pipetransformer_gpt (this engine's own GPT export)";

fn family_of_model_type(model_type: &str, origin: &str) -> Result<Family> {
    match model_type {
        "bert" => Ok(Family::Bert),
        "vit" => Ok(Family::Vit),
        OWN_GPT_MODEL_TYPE => Ok(Family::Gpt),
        "gpt2" => Err(config_error(
            "model_type",
            format!(
                "{origin}: unsupported architecture `gpt2`: its checkpoints fuse q/k/v into Conv1D `c_attn` \
                 weights, which this engine's GPT (separate q/k/v projections) does not read; {SUPPORTED}"
            ),
        )),
        other => Err(config_error("model_type", format!("{origin}: unsupported architecture `{other}`; {SUPPORTED}"))),
    }
}

/// The family an `architectures` entry names (`BertModel`, `BertForSequenceClassification`,
/// `ViTForImageClassification`, …), for configs without `model_type`.
fn family_of_architecture(arch: &str, origin: &str) -> Result<Family> {
    if arch.starts_with("Bert") {
        Ok(Family::Bert)
    } else if arch.starts_with("ViT") {
        Ok(Family::Vit)
    } else if arch == "PipeTransformerGpt" {
        Ok(Family::Gpt)
    } else {
        Err(config_error("architectures", format!("{origin}: unsupported architecture `{arch}`; {SUPPORTED}")))
    }
}

/// Reads a Hugging Face `config.json` into a [`ModelConfig`].
///
/// The family comes from `model_type`, else from the first `architectures` entry, else from
/// `family_hint`; a hint that contradicts the file is an error, as is an architecture we do not
/// support (e.g. `llama`). Fields we do not use are ignored. The task head is the caller's:
/// `num_labels` and BERT's `pooling` are read when present (configs this engine exported) and
/// otherwise take their defaults (2 labels, the `[CLS]` pooler); set them for the task at hand.
/// The result is validated with [`ModelConfig::spec`].
pub fn read_hf_config(path: impl AsRef<Path>, family_hint: Option<Family>) -> Result<ModelConfig> {
    let path = path.as_ref();
    let text =
        std::fs::read_to_string(path).map_err(|source| Error::Io { path: path.display().to_string(), source })?;
    parse_hf_config(&text, &path.display().to_string(), family_hint)
}

/// [`read_hf_config`] on text already read; `origin` names it in errors.
pub fn parse_hf_config(text: &str, origin: &str, family_hint: Option<Family>) -> Result<ModelConfig> {
    let value: Value = serde_json::from_str(text)
        .map_err(|e| config_error("config.json", format!("{origin}: not valid JSON: {e}")))?;
    if !value.is_object() {
        return Err(config_error("config.json", format!("{origin}: expected a JSON object")));
    }
    let from_type = match value.get("model_type").and_then(Value::as_str) {
        Some(t) => Some(family_of_model_type(t, origin)?),
        None => None,
    };
    let from_arch = match value.get("architectures").and_then(Value::as_array).and_then(|a| a.first()) {
        Some(Value::String(a)) if from_type.is_none() => Some(family_of_architecture(a, origin)?),
        _ => None,
    };
    let family = match (from_type.or(from_arch), family_hint) {
        (Some(f), Some(h)) if f != h => {
            return Err(config_error(
                "model_type",
                format!("{origin}: describes a {f:?} model, but a {h:?} model was asked for"),
            ));
        }
        (Some(f), _) | (None, Some(f)) => f,
        (None, None) => {
            return Err(config_error(
                "model_type",
                format!("{origin}: has neither `model_type` nor `architectures`, and no family was given; {SUPPORTED}"),
            ));
        }
    };
    let config = match family {
        Family::Bert => {
            // Relative or rotary position schemes change the attention itself, not just names.
            if let Some(kind) = value.get("position_embedding_type").and_then(Value::as_str)
                && kind != "absolute"
            {
                return Err(config_error(
                    "bert.position_embedding_type",
                    format!("{origin}: `{kind}` is not supported; expected `absolute`"),
                ));
            }
            ModelConfig::Bert(deserialize(value, origin, "bert")?)
        }
        Family::Vit => ModelConfig::Vit(deserialize(value, origin, "vit")?),
        Family::Gpt => ModelConfig::Gpt(deserialize(value, origin, "gpt")?),
    };
    config.spec()?;
    Ok(config)
}

fn deserialize<T: serde::de::DeserializeOwned>(value: Value, origin: &str, family: &str) -> Result<T> {
    serde_json::from_value(value).map_err(|e| config_error(family, format!("{origin}: {e}")))
}

/// The `config.json` this engine writes for a model: the config's own (Hugging Face-named)
/// fields plus `model_type`, `architectures` and `torch_dtype`, so that [`read_hf_config`]
/// reads it back and, for BERT and ViT, `transformers` recognises it.
pub fn hf_config_json(config: &ModelConfig) -> Result<Value> {
    let (fields, model_type, arch) = match config {
        ModelConfig::Bert(c) => (serde_json::to_value(c), "bert", "BertModel"),
        ModelConfig::Vit(c) => (serde_json::to_value(c), "vit", "ViTForImageClassification"),
        ModelConfig::Gpt(c) => (serde_json::to_value(c), OWN_GPT_MODEL_TYPE, "PipeTransformerGpt"),
    };
    let mut fields = fields.map_err(|e| config_error("config", format!("cannot serialise: {e}")))?;
    if let Value::Object(m) = &mut fields {
        m.insert("model_type".into(), model_type.into());
        m.insert("architectures".into(), serde_json::json!([arch]));
        m.insert("torch_dtype".into(), "float32".into());
    }
    Ok(fields)
}

#[cfg(test)]
mod tests {
    use super::*;

    const MINILM: &str = r#"{
      "_name_or_path": "nreimers/MiniLM-L6-H384-uncased", "architectures": ["BertModel"],
      "attention_probs_dropout_prob": 0.1, "gradient_checkpointing": false, "hidden_act": "gelu",
      "hidden_dropout_prob": 0.1, "hidden_size": 384, "initializer_range": 0.02, "intermediate_size": 1536,
      "layer_norm_eps": 1e-12, "max_position_embeddings": 512, "model_type": "bert", "num_attention_heads": 12,
      "num_hidden_layers": 6, "pad_token_id": 0, "position_embedding_type": "absolute",
      "transformers_version": "4.8.2", "type_vocab_size": 2, "use_cache": true, "vocab_size": 30522 }"#;

    #[test]
    fn minilm_config_reads_as_bert() {
        let ModelConfig::Bert(c) = parse_hf_config(MINILM, "config.json", None).unwrap() else { panic!("not bert") };
        assert_eq!((c.hidden_size, c.num_hidden_layers, c.num_attention_heads), (384, 6, 12));
        assert_eq!((c.intermediate_size, c.vocab_size, c.type_vocab_size), (1536, 30522, 2));
        assert_eq!(c.layer_norm_eps, 1e-12);
        assert_eq!(c.hidden_act, "gelu");
    }

    #[test]
    fn unsupported_architecture_is_named() {
        let e = parse_hf_config(r#"{"model_type": "llama", "hidden_size": 8}"#, "x/config.json", None).unwrap_err();
        let Error::Config { field, message } = e else { panic!("{e}") };
        assert_eq!(field, "model_type");
        assert!(message.contains("unsupported architecture `llama`; supported: bert"), "{message}");
        assert!(message.contains("x/config.json"), "{message}");
        let e = parse_hf_config(r#"{"architectures": ["LlamaForCausalLM"]}"#, "c", None).unwrap_err().to_string();
        assert!(e.contains("`LlamaForCausalLM`"), "{e}");
    }

    #[test]
    fn hint_and_architectures() {
        let no_type = MINILM.replace(r#""model_type": "bert","#, "");
        assert!(matches!(parse_hf_config(&no_type, "c", None), Ok(ModelConfig::Bert(_))));
        let bare = no_type.replace(r#""architectures": ["BertModel"],"#, "");
        assert!(parse_hf_config(&bare, "c", None).is_err());
        assert!(matches!(parse_hf_config(&bare, "c", Some(Family::Bert)), Ok(ModelConfig::Bert(_))));
        let e = parse_hf_config(MINILM, "c", Some(Family::Gpt)).unwrap_err().to_string();
        assert!(e.contains("Bert model") && e.contains("Gpt model was asked for"), "{e}");
    }

    #[test]
    fn written_config_reads_back() {
        let mut config = parse_hf_config(MINILM, "c", None).unwrap();
        if let ModelConfig::Bert(c) = &mut config {
            c.num_labels = 8;
            c.pooling = crate::model::Pooling::Mean;
        }
        let text = hf_config_json(&config).unwrap().to_string();
        assert_eq!(parse_hf_config(&text, "c", None).unwrap(), config);
    }
}
