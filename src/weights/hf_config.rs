//! Hugging Face `config.json` ↔ [`ModelConfig`].
//!
//! Our config structs use Hugging Face field names, so the work here is choosing the family
//! from `model_type` (or `architectures`) and refusing architectures whose weights our units
//! cannot hold, with a message that says which ones can. On the way out, `config.json` also
//! names the Hugging Face class that loads the export and carries the class names
//! (`id2label`, `label2id`).

use std::path::Path;

use serde_json::Value;

use crate::error::{Result, config_error};
use crate::model::{Family, ModelConfig, Pooling};

/// `model_type` of this engine's earlier GPT exports, whose files keep our separate
/// `q_proj`/`k_proj`/`v_proj` layers. Still read; exports now write GPT-2's own layout
/// (`gpt2`, fused `c_attn`, see `layout.rs`), which `GPT2LMHeadModel` loads.
pub const OWN_GPT_MODEL_TYPE: &str = "pipetransformer_gpt";

const SUPPORTED: &str = "supported: bert, vit, gpt2, pipetransformer_gpt (this engine's earlier GPT exports)";

fn family_of_model_type(model_type: &str, origin: &str) -> Result<Family> {
    match model_type {
        "bert" => Ok(Family::Bert),
        "vit" => Ok(Family::Vit),
        "gpt2" | OWN_GPT_MODEL_TYPE => Ok(Family::Gpt),
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
    } else if arch.starts_with("GPT2") || arch == "PipeTransformerGpt" {
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
    let text = std::fs::read_to_string(path).map_err(|source| crate::files::io_error(path, source))?;
    parse_hf_config(&text, &path.display().to_string(), family_hint)
}

/// [`read_hf_config`] on text already read; `origin` names it in errors.
pub fn parse_hf_config(text: &str, origin: &str, family_hint: Option<Family>) -> Result<ModelConfig> {
    let value: Value = serde_json::from_str(text)
        .map_err(|e| config_error("config.json", format!("{origin}: not valid JSON: {e}")))?;
    let Value::Object(mut value) = value else {
        return Err(config_error("config.json", format!("{origin}: expected a JSON object")));
    };
    // `transformers`' own `save_pretrained` writes `id2label` and leaves `num_labels` out: the
    // class count is then the map's.
    if !value.contains_key("num_labels")
        && let Some(n) = value.get("id2label").and_then(Value::as_object).map(|m| m.len())
    {
        value.insert("num_labels".into(), n.into());
    }
    let value = Value::Object(value);
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
        Family::Gpt => {
            check_gpt2_attention(&value, origin)?;
            // Our GPT's head is its token embedding; an untied `lm_head` would be read as
            // the embedding and exported without its own values.
            if value.get("tie_word_embeddings").and_then(Value::as_bool) == Some(false) {
                return Err(config_error(
                    "gpt.tie_word_embeddings",
                    format!("{origin}: `false` is not supported; expected the head tied to the token embedding"),
                ));
            }
            ModelConfig::Gpt(deserialize(value, origin, "gpt")?)
        }
    };
    config.spec()?;
    Ok(config)
}

/// GPT-2 switches that change the attention itself: our GPT scales scores by `1/√head_dim`
/// and nothing else, so a config asking otherwise is refused rather than silently misread.
fn check_gpt2_attention(value: &Value, origin: &str) -> Result<()> {
    let flags =
        [("scale_attn_weights", true), ("scale_attn_by_inverse_layer_idx", false), ("reorder_and_upcast_attn", false)];
    for (flag, ours) in flags {
        if let Some(v) = value.get(flag).and_then(Value::as_bool)
            && v != ours
        {
            return Err(config_error(
                format!("gpt.{flag}"),
                format!("{origin}: `{v}` is not supported; expected `{ours}`"),
            ));
        }
    }
    Ok(())
}

fn deserialize<T: serde::de::DeserializeOwned>(value: Value, origin: &str, family: &str) -> Result<T> {
    serde_json::from_value(value).map_err(|e| config_error(family, format!("{origin}: {e}")))
}

/// The Hugging Face class that loads an export of `config` whole (every tensor used, none
/// freshly initialised, the same outputs). A mean-pooling BERT classifier has none
/// (`BertForSequenceClassification` always classifies the pooler's `tanh(dense(h[CLS]))`), so
/// its export names `BertModel`, which loads the encoder.
pub fn hf_architecture(config: &ModelConfig) -> &'static str {
    match config {
        ModelConfig::Bert(c) if c.pooling == Pooling::ClsPooler => "BertForSequenceClassification",
        ModelConfig::Bert(_) => "BertModel",
        ModelConfig::Vit(_) => "ViTForImageClassification",
        ModelConfig::Gpt(_) => "GPT2LMHeadModel",
    }
}

/// The `config.json` this engine writes for a model: the config's own (Hugging Face-named)
/// fields plus `model_type`, `architectures` ([`hf_architecture`]) and `torch_dtype`, so that
/// [`read_hf_config`] reads it back and `transformers` recognises it; for a classifier with
/// class names, `id2label` (`{"0": name, …}`) and `label2id` too. `labels` must be empty or
/// hold one name per class, all distinct (`label2id` could not map a repeated name back).
/// A GPT is written as `gpt2` (the layout the export writes its weights in).
pub fn hf_config_json(config: &ModelConfig, labels: &[String]) -> Result<Value> {
    let (fields, model_type) = match config {
        ModelConfig::Bert(c) => (serde_json::to_value(c), "bert"),
        ModelConfig::Vit(c) => (serde_json::to_value(c), "vit"),
        ModelConfig::Gpt(c) => (serde_json::to_value(c), "gpt2"),
    };
    let mut fields = fields.map_err(|e| config_error("config", format!("cannot serialise: {e}")))?;
    let Value::Object(m) = &mut fields else {
        return Err(config_error("config", "did not serialise to a JSON object"));
    };
    // The tanh form under the name `transformers` knows it by (it has no `gelu_tanh`).
    for key in ["hidden_act", "activation_function"] {
        if m.get(key).and_then(Value::as_str) == Some("gelu_tanh") {
            m.insert(key.into(), "gelu_new".into());
        }
    }
    m.insert("model_type".into(), model_type.into());
    m.insert("architectures".into(), serde_json::json!([hf_architecture(config)]));
    m.insert("torch_dtype".into(), "float32".into());
    if let ModelConfig::Gpt(_) = config {
        // GPT2Config defaults these to GPT-2's own 50256, which is outside a small vocabulary.
        m.insert("bos_token_id".into(), Value::Null);
        m.insert("eos_token_id".into(), Value::Null);
    }
    if !labels.is_empty() {
        let (id2label, label2id) = label_maps(config, labels)?;
        m.insert("id2label".into(), id2label);
        m.insert("label2id".into(), label2id);
    }
    Ok(fields)
}

/// Classes of a classifier config, `None` for a language model.
pub(crate) fn num_labels(config: &ModelConfig) -> Option<usize> {
    match config {
        ModelConfig::Bert(c) => Some(c.num_labels),
        ModelConfig::Vit(c) => Some(c.num_labels),
        ModelConfig::Gpt(_) => None,
    }
}

/// `id2label` and `label2id` for `labels`, checked against the config's class count.
fn label_maps(config: &ModelConfig, labels: &[String]) -> Result<(Value, Value)> {
    let Some(n) = num_labels(config) else {
        return Err(config_error("labels", "a language model has no class names; expected none"));
    };
    if labels.len() != n {
        return Err(config_error(
            "labels",
            format!("{} class names for a model with num_labels = {n}; expected one name per class", labels.len()),
        ));
    }
    let mut id2label = serde_json::Map::new();
    let mut label2id = serde_json::Map::new();
    for (id, name) in labels.iter().enumerate() {
        id2label.insert(id.to_string(), name.clone().into());
        if label2id.insert(name.clone(), id.into()).is_some() {
            return Err(config_error("labels", format!("class name `{name}` appears twice; expected distinct names")));
        }
    }
    Ok((Value::Object(id2label), Value::Object(label2id)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::Error;
    use crate::model::{BertConfig, GptConfig};

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

    /// What `transformers` writes or reads differently: `save_pretrained` leaves out
    /// `num_labels` beside `id2label`; it knows the tanh GELU as `gelu_new`, not `gelu_tanh`;
    /// an untied GPT-2 head is refused (ours is the token embedding).
    #[test]
    fn configs_as_transformers_writes_and_reads_them() {
        let saved = MINILM.replace(
            r#""vocab_size": 30522 }"#,
            r#""vocab_size": 30522, "id2label": {"0": "a", "1": "b", "2": "c"} }"#,
        );
        let ModelConfig::Bert(c) = parse_hf_config(&saved, "c", None).unwrap() else { panic!("not bert") };
        assert_eq!(c.num_labels, 3);
        let tanh = ModelConfig::Bert(BertConfig { hidden_act: "gelu_tanh".into(), ..c });
        let json = hf_config_json(&tanh, &[]).unwrap();
        assert_eq!(json["hidden_act"], "gelu_new");
        let ModelConfig::Gpt(g) = crate::model::tiny::tiny_gpt(0.0) else { unreachable!() };
        let gpt =
            hf_config_json(&ModelConfig::Gpt(GptConfig { activation_function: "gelu_tanh".into(), ..g }), &[]).unwrap();
        assert_eq!(gpt["activation_function"], "gelu_new");
        let mut untied = gpt.clone();
        untied["tie_word_embeddings"] = false.into();
        let err = parse_hf_config(&untied.to_string(), "c", None).unwrap_err().to_string();
        assert!(err.contains("gpt.tie_word_embeddings"), "{err}");
        assert!(parse_hf_config(&gpt.to_string(), "c", None).is_ok());
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
        let labels: Vec<String> = (0..8).map(|i| format!("class {i}")).collect();
        let json = hf_config_json(&config, &labels).unwrap();
        assert_eq!(json["architectures"][0], "BertModel"); // mean pooling: no HF classifier class
        assert_eq!(json["id2label"]["7"], "class 7");
        assert_eq!(json["label2id"]["class 0"], 0);
        assert_eq!(parse_hf_config(&json.to_string(), "c", None).unwrap(), config);
        let e = hf_config_json(&config, &labels[..3]).unwrap_err().to_string();
        assert!(e.contains("3 class names for a model with num_labels = 8"), "{e}");
        let mut twice = labels.clone();
        twice[1] = "class 0".into();
        assert!(hf_config_json(&config, &twice).unwrap_err().to_string().contains("`class 0` appears twice"));
    }

    #[test]
    fn gpt2_configs_read_as_gpt_unless_the_attention_differs() {
        let gpt2 = r#"{"model_type": "gpt2", "vocab_size": 50257, "n_positions": 1024, "n_embd": 768,
            "n_layer": 12, "n_head": 12, "n_inner": null, "activation_function": "gelu_new"}"#;
        assert!(matches!(parse_hf_config(gpt2, "c", None), Ok(ModelConfig::Gpt(_))));
        let odd = gpt2.replace("\"n_inner\"", "\"scale_attn_by_inverse_layer_idx\": true, \"n_inner\"");
        let e = parse_hf_config(&odd, "c", None).unwrap_err().to_string();
        assert!(e.contains("gpt.scale_attn_by_inverse_layer_idx") && e.contains("expected `false`"), "{e}");
    }
}
