//! How our parameters are laid out in an exported checkpoint, so that Hugging Face's classes
//! load it as is, and how the loader reads that layout back.
//!
//! | family | in the file | why |
//! |---|---|---|
//! | BERT | `bert.` + our name, except `classifier.*` | what `BertForSequenceClassification` saves: it loads every tensor (no freshly initialised head), and `BertModel` / sentence-transformers load the `bert.` part and skip the head |
//! | ViT | our names (`vit.*`, `classifier.*`) | already `ViTForImageClassification`'s |
//! | GPT | GPT-2's: `transformer.h.{i}.attn.c_attn` (q, k, v fused), `attn.c_proj`, `mlp.c_fc`, `mlp.c_proj`, all stored as `Conv1D` weights `[in, out]`; no `lm_head.weight` (tied) | what `GPT2LMHeadModel` reads; our own GPT keeps q/k/v apart, `[out, in]` |
//!
//! Every conversion is a copy or a transpose of f32 values, so an export loads back bitwise.

use super::safetensors::weights_error;
use crate::error::Result;
use std::collections::HashMap;
use std::path::Path;

/// How one of our parameters is read from a file tensor.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum View {
    /// The tensor as stored.
    Whole,
    /// A GPT-2 `Conv1D` tensor: a weight stored `[in, out]` (ours is `[out, in]`), of which
    /// our parameter is output columns `start..start + len` (all of them, unless q/k/v are
    /// fused); for a bias, elements `start..start + len`.
    Conv1d {
        /// First output column.
        start: usize,
        /// Output columns.
        len: usize,
    },
}

impl View {
    /// The shape of our parameter as this view of a tensor of `stored` shape, or `None` when
    /// the stored shape cannot hold it (wrong rank, columns out of range).
    pub(crate) fn shape(&self, stored: &[usize]) -> Option<Vec<usize>> {
        match *self {
            View::Whole => Some(stored.to_vec()),
            View::Conv1d { start, len } => match stored {
                [input, out] if start + len <= *out => Some(vec![len, *input]),
                [out] if start + len <= *out => Some(vec![len]),
                _ => None,
            },
        }
    }

    /// Our parameter's values from the tensor's (`stored` shape, row-major).
    pub(crate) fn apply<T: Copy>(&self, values: Vec<T>, stored: &[usize]) -> Vec<T> {
        match (*self, stored) {
            (View::Whole, _) => values,
            (View::Conv1d { start, len }, [input, out]) => {
                let (input, out) = (*input, *out);
                let mut ours = Vec::with_capacity(len * input);
                for col in start..start + len {
                    ours.extend((0..input).map(|row| values[row * out + col]));
                }
                ours
            }
            (View::Conv1d { start, len }, _) => values[start..start + len].to_vec(),
        }
    }
}

/// The name a BERT parameter has in an export: under `bert.`, as `BertForSequenceClassification`
/// saves it, except the task head, which that class keeps at the top level.
pub(crate) fn bert_export_name(name: &str) -> String {
    if name.starts_with("classifier.") { name.to_string() } else { format!("bert.{name}") }
}

/// GPT-2's names for the two linear layers of a block that are not the fused q/k/v, with ours.
const GPT2_LINEARS: [(&str, &str); 3] =
    [("attn.c_proj", "attn.out_proj"), ("mlp.c_fc", "mlp.fc_in"), ("mlp.c_proj", "mlp.fc_out")];
/// Our separate projections, in the order GPT-2 fuses them into `attn.c_attn`.
const QKV: [&str; 3] = ["attn.q_proj", "attn.k_proj", "attn.v_proj"];

/// Splits `transformer.h.{i}.{rest}` (the `transformer.` prefix optional: GPT-2 checkpoints
/// saved from `GPT2Model` lack it) into `(i, rest)`.
fn gpt2_block(name: &str) -> Option<(usize, &str)> {
    let name = name.strip_prefix("transformer.").unwrap_or(name);
    let (index, rest) = name.strip_prefix("h.")?.split_once('.')?;
    Some((index.parse().ok()?, rest))
}

/// Which of our GPT parameters a GPT-2-layout file tensor feeds, and how; `None` when the
/// name is not a GPT-2 `Conv1D` tensor (it is then matched by name as it is, with the
/// `transformer.` prefix added when missing). `shape` is the stored shape; a fused `c_attn`
/// whose output width is not a multiple of 3 is an error naming the file and tensor.
pub(crate) fn gpt2_targets(file: &Path, name: &str, shape: &[usize]) -> Result<Option<Vec<(String, View)>>> {
    let Some((i, rest)) = gpt2_block(name) else { return Ok(None) };
    let Some((layer, kind)) = rest.rsplit_once('.') else { return Ok(None) };
    if kind != "weight" && kind != "bias" {
        return Ok(None);
    }
    let out = shape.last().copied().unwrap_or(0);
    if layer == "attn.c_attn" {
        if out == 0 || !out.is_multiple_of(3) {
            return Err(weights_error(
                file,
                Some(name),
                format!("GPT-2 fused q/k/v tensor of shape {shape:?}: its last dimension must be 3 × the hidden width"),
            ));
        }
        let len = out / 3;
        let targets = QKV
            .iter()
            .enumerate()
            .map(|(part, ours)| (format!("transformer.h.{i}.{ours}.{kind}"), View::Conv1d { start: part * len, len }))
            .collect();
        return Ok(Some(targets));
    }
    Ok(GPT2_LINEARS
        .iter()
        .find(|(gpt2, _)| *gpt2 == layer)
        .map(|(_, ours)| vec![(format!("transformer.h.{i}.{ours}.{kind}"), View::Conv1d { start: 0, len: out })]))
}

/// A GPT-2 checkpoint name with the `transformer.` prefix that our parameters carry
/// (`GPT2Model` saves `wte.weight`, `h.0.ln_1.weight`, … without it).
pub(crate) fn gpt2_with_prefix(name: &str) -> Option<String> {
    let top = ["wte.", "wpe.", "ln_f.", "h."];
    top.iter().any(|p| name.starts_with(p)).then(|| format!("transformer.{name}"))
}

/// One tensor on the host: a parameter's, or one of an export.
#[derive(Clone, Debug, PartialEq)]
pub struct HostTensor {
    /// Name in the file.
    pub name: String,
    /// Shape in the file.
    pub shape: Vec<usize>,
    /// Values, row-major.
    pub values: Vec<f32>,
}

/// `[out, in]` (ours) to `[in, out]` (`Conv1D`).
fn transpose(values: &[f32], out: usize, input: usize) -> Vec<f32> {
    let mut t = vec![0.0; values.len()];
    for o in 0..out {
        for i in 0..input {
            t[i * out + o] = values[o * input + i];
        }
    }
    t
}

/// Rewrites our GPT tensors (named and shaped as in the model) into GPT-2's layout: q/k/v
/// fused into `c_attn`, every block linear transposed into a `Conv1D` and renamed. Tensors
/// that are not block linears pass through. A q/k/v projection without its two siblings is an
/// internal error (our model always has all three).
pub(crate) fn to_gpt2(tensors: Vec<HostTensor>) -> Result<Vec<HostTensor>> {
    type Parts = [Option<HostTensor>; 3];
    let mut out = Vec::with_capacity(tensors.len());
    // q, k and v of one block and kind, until all three have been seen.
    let mut pending: HashMap<(usize, String), Parts> = HashMap::new();
    for t in tensors {
        let Some((i, layer, kind)) = gpt2_block(&t.name).and_then(|(i, rest)| {
            let (layer, kind) = rest.rsplit_once('.')?;
            Some((i, layer.to_string(), kind.to_string()))
        }) else {
            out.push(t);
            continue;
        };
        if let Some(part) = QKV.iter().position(|q| *q == layer) {
            let key = (i, kind);
            let parts = pending.entry(key.clone()).or_default();
            parts[part] = Some(t);
            if parts.iter().all(Option::is_some) {
                let parts: Vec<HostTensor> = pending.remove(&key).into_iter().flatten().flatten().collect();
                out.push(fuse_qkv(i, &key.1, &parts));
            }
        } else if let Some((gpt2, _)) = GPT2_LINEARS.iter().find(|(_, ours)| *ours == layer) {
            out.push(conv1d(format!("transformer.h.{i}.{gpt2}.{kind}"), &t));
        } else {
            out.push(t);
        }
    }
    if let Some(((i, kind), _)) = pending.into_iter().next() {
        return Err(crate::Error::Internal {
            what: "GPT-2 export".into(),
            message: format!("block {i}: the q/k/v projections' {kind} are not all present"),
        });
    }
    Ok(out)
}

/// One linear as a `Conv1D`: a weight `[out, in]` becomes `[in, out]`; a bias is unchanged.
fn conv1d(name: String, t: &HostTensor) -> HostTensor {
    match t.shape.as_slice() {
        &[out, input] => HostTensor { name, shape: vec![input, out], values: transpose(&t.values, out, input) },
        _ => HostTensor { name, shape: t.shape.clone(), values: t.values.clone() },
    }
}

/// q, k, v (each `[C, C]`, or biases `[C]`) as GPT-2's `c_attn` `[C, 3C]` (or `[3C]`): row `r`
/// of the fused weight is row `r` of q's, k's and v's `Conv1D` forms, side by side.
fn fuse_qkv(i: usize, kind: &str, parts: &[HostTensor]) -> HostTensor {
    let name = format!("transformer.h.{i}.attn.c_attn.{kind}");
    match parts[0].shape.as_slice() {
        &[out, input] => {
            let convs: Vec<Vec<f32>> = parts.iter().map(|p| transpose(&p.values, out, input)).collect();
            let mut values = Vec::with_capacity(3 * out * input);
            for row in 0..input {
                for c in &convs {
                    values.extend_from_slice(&c[row * out..(row + 1) * out]);
                }
            }
            HostTensor { name, shape: vec![input, 3 * out], values }
        }
        shape => {
            let values: Vec<f32> = parts.iter().flat_map(|p| p.values.iter().copied()).collect();
            HostTensor { name, shape: vec![3 * shape.iter().product::<usize>()], values }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn host(name: &str, shape: &[usize], values: Vec<f32>) -> HostTensor {
        HostTensor { name: name.into(), shape: shape.to_vec(), values }
    }

    fn clone_host(t: &HostTensor) -> HostTensor {
        host(&t.name, &t.shape, t.values.clone())
    }

    /// Fusing to GPT-2's layout and reading each part back through its view is the identity.
    #[test]
    fn gpt2_fusion_round_trips() {
        let (c, n) = (2, 4);
        let w = |seed: f32| (0..c * c).map(|k| seed + k as f32).collect::<Vec<_>>();
        let ours = [
            host("transformer.h.0.attn.q_proj.weight", &[c, c], w(0.0)),
            host("transformer.h.0.attn.k_proj.weight", &[c, c], w(10.0)),
            host("transformer.h.0.attn.v_proj.weight", &[c, c], w(20.0)),
            host("transformer.h.0.attn.q_proj.bias", &[c], vec![1.0, 2.0]),
            host("transformer.h.0.attn.k_proj.bias", &[c], vec![3.0, 4.0]),
            host("transformer.h.0.attn.v_proj.bias", &[c], vec![5.0, 6.0]),
            host("transformer.h.0.mlp.fc_in.weight", &[n, c], (0..n * c).map(|k| k as f32).collect()),
            host("transformer.h.0.ln_1.weight", &[c], vec![1.0, 1.0]),
        ];
        let gpt2 = to_gpt2(ours.iter().map(clone_host).collect()).unwrap();
        let names: Vec<&str> = gpt2.iter().map(|t| t.name.as_str()).collect();
        assert_eq!(
            names,
            [
                "transformer.h.0.attn.c_attn.weight",
                "transformer.h.0.attn.c_attn.bias",
                "transformer.h.0.mlp.c_fc.weight",
                "transformer.h.0.ln_1.weight"
            ]
        );
        assert_eq!(gpt2[0].shape, [c, 3 * c]);
        assert_eq!(gpt2[1].values, [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]);
        assert_eq!(gpt2[2].shape, [c, n]);
        let path = Path::new("x.safetensors");
        for t in &gpt2[..3] {
            for (name, view) in gpt2_targets(path, &t.name, &t.shape).unwrap().unwrap() {
                let original = ours.iter().find(|o| o.name == name).unwrap();
                assert_eq!(view.shape(&t.shape).unwrap(), original.shape, "{name}");
                assert_eq!(view.apply(t.values.clone(), &t.shape), original.values, "{name}");
            }
        }
        assert!(gpt2_targets(path, "transformer.h.0.ln_1.weight", &[c]).unwrap().is_none());
        assert!(gpt2_targets(path, "h.1.attn.c_attn.weight", &[c, 5]).is_err());
        assert_eq!(gpt2_with_prefix("h.1.ln_2.bias").as_deref(), Some("transformer.h.1.ln_2.bias"));
        assert_eq!(gpt2_with_prefix("lm_head.weight"), None);
    }

    #[test]
    fn bert_names_follow_bert_for_sequence_classification() {
        assert_eq!(bert_export_name("encoder.layer.0.output.dense.weight"), "bert.encoder.layer.0.output.dense.weight");
        assert_eq!(bert_export_name("pooler.dense.bias"), "bert.pooler.dense.bias");
        assert_eq!(bert_export_name("classifier.weight"), "classifier.weight");
    }
}
