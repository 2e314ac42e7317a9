//! Mapping a safetensors file's tensors onto a model's parameters by Hugging Face name.

use std::collections::HashMap;
use std::fmt;
use std::path::PathBuf;

use super::layout::{View, gpt2_targets, gpt2_with_prefix};
use super::safetensors::{TensorFile, TensorInfo, weights_error};
use crate::device::Device;
use crate::error::Result;
use crate::model::{Family, HeadSpec, Model};
use crate::scalar::DType;

/// Name of the GPT token embedding that the LM head is tied to.
const TIED_SOURCE: &str = "transformer.wte.weight";
/// Name of the GPT LM head's copy of it.
const TIED_COPY: &str = "lm_head.weight";

/// How file names are matched to model parameters, and which gaps are acceptable.
///
/// The default suits Hugging Face BERT checkpoints: `bert.` is stripped (so a
/// `BertForSequenceClassification` file loads as well as a bare `BertModel` one),
/// `embeddings.position_ids` (a constant buffer, not a weight) is skipped, and the task head
/// (`classifier.*`) and `pooler.*` may be absent, since a pretrained encoder ships without the
/// head a fine-tuning run adds. Any other parameter missing from the file is an error.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LoadOptions {
    /// Prefixes removed from a file name before matching it (tried in order; the name as
    /// stored is tried first).
    pub strip_prefixes: Vec<String>,
    /// File tensors to skip without reporting them as unexpected (exact names, as stored or
    /// after stripping a prefix).
    pub ignore: Vec<String>,
    /// Model-parameter name prefixes that may be absent from the file; those parameters keep
    /// their initialisation and are listed in [`LoadReport::missing`]. Any other missing
    /// parameter makes the load fail.
    pub allow_missing: Vec<String>,
    /// Whether file tensors that match no parameter make the load fail (by default they are
    /// only listed in [`LoadReport::unexpected`]).
    pub deny_unexpected: bool,
}

impl Default for LoadOptions {
    fn default() -> Self {
        Self {
            strip_prefixes: vec!["bert.".into()],
            ignore: vec!["embeddings.position_ids".into()],
            allow_missing: vec!["classifier.".into(), "pooler.".into()],
            deny_unexpected: false,
        }
    }
}

impl LoadOptions {
    /// Every parameter must come from the file and every file tensor must be used (ignored
    /// names excepted): for reloading a checkpoint this engine exported.
    pub fn strict() -> Self {
        Self { allow_missing: Vec::new(), deny_unexpected: true, ..Self::default() }
    }

    fn missing_allowed(&self, param: &str) -> bool {
        self.allow_missing.iter().any(|p| param.starts_with(p.as_str()))
    }
}

/// What a load did. Parameters in [`missing`](Self::missing) kept their initialisation;
/// tensors in [`unexpected`](Self::unexpected) were not used. The caller decides whether either
/// matters (the trainer prints both).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct LoadReport {
    /// The file loaded from.
    pub file: PathBuf,
    /// Parameters set from the file, by model name.
    pub loaded: Vec<String>,
    /// Parameters set from a tied tensor because the file lacks their own copy (GPT's
    /// `lm_head.weight`, filled from `transformer.wte.weight`).
    pub tied: Vec<String>,
    /// Parameters absent from the file that were allowed to be (they keep their init).
    pub missing: Vec<String>,
    /// File tensors that match no parameter, by stored name.
    pub unexpected: Vec<String>,
    /// File tensors skipped on purpose ([`LoadOptions::ignore`]).
    pub ignored: Vec<String>,
    /// Parameters matched and checked but not set: [hollow](crate::model::Param::hollow)
    /// here, since another stage process holds them.
    pub held_elsewhere: Vec<String>,
    /// What was folded into the loaded weights after the load, if anything (a pretrained ViT's
    /// pixel preprocessing: [`PixelTransform`](super::PixelTransform)).
    pub folded: Option<String>,
}

impl fmt::Display for LoadReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: loaded {} tensors", self.file.display(), self.loaded.len())?;
        let lists = [
            ("tied copies", &self.tied),
            ("missing (kept their initialisation)", &self.missing),
            ("unexpected (not used)", &self.unexpected),
            ("ignored", &self.ignored),
        ];
        for (what, names) in lists {
            if !names.is_empty() {
                write!(f, "; {what}: {}", names.join(", "))?;
            }
        }
        if !self.held_elsewhere.is_empty() {
            write!(f, "; {} held by other processes", self.held_elsewhere.len())?;
        }
        if let Some(folded) = &self.folded {
            write!(f, "; {folded}")?;
        }
        Ok(())
    }
}

/// Loads `file`'s tensors into `model`'s parameters, matched by name under `options`.
///
/// Everything is checked before any parameter changes, so a failed load leaves the model as it
/// was. Errors ([`crate::Error::Weights`], naming the file and tensor): a matched tensor whose
/// shape differs from the parameter's (both shapes given), a matched tensor that is not a float
/// type, a parameter missing from the file that [`LoadOptions::allow_missing`] does not cover,
/// two file tensors mapping onto one parameter, and (only with
/// [`LoadOptions::deny_unexpected`]) an unused tensor.
///
/// For a model with a tied LM head, `lm_head.weight` is set from `transformer.wte.weight` when
/// the file has no copy of its own (Hugging Face omits it when saving).
///
/// A GPT model also reads GPT-2's layout (what [`super::export_model`] writes, and what
/// `GPT2LMHeadModel` saves, with or without the `transformer.` prefix): the fused
/// `attn.c_attn` `Conv1D` feeds `q_proj`/`k_proj`/`v_proj`, and `attn.c_proj`, `mlp.c_fc`,
/// `mlp.c_proj` feed `out_proj`, `fc_in`, `fc_out`, transposed (see `layout.rs`).
pub fn load_into_model<'f, D: Device>(
    model: &mut Model<D>,
    dev: &D,
    file: &'f TensorFile,
    options: &LoadOptions,
) -> Result<LoadReport> {
    let path = file.path();
    let tied_head = model.spec().head == HeadSpec::TiedLmHead;
    let gpt = model.spec().family == Family::Gpt;
    let mut report = LoadReport { file: path.to_path_buf(), ..LoadReport::default() };

    // Which parameter each file tensor feeds.
    let params: HashMap<String, Vec<usize>> = {
        let mut m = HashMap::new();
        for p in model.params() {
            m.insert(p.name.clone(), p.shape.clone());
        }
        m
    };
    // Which tensor (and which view of it) feeds each parameter.
    let mut source: HashMap<String, (&TensorInfo, View)> = HashMap::new();
    let mut provide = |name: String, t: &'f TensorInfo, view: View| -> Result<()> {
        if let Some((prev, _)) = source.insert(name.clone(), (t, view)) {
            return Err(weights_error(
                path,
                Some(&t.name),
                format!("maps onto parameter `{name}`, which tensor `{}` already provides", prev.name),
            ));
        }
        Ok(())
    };
    for t in file.tensors() {
        // GPT-2's layout (our own GPT export, or a GPT-2 checkpoint): fused and transposed
        // `Conv1D` tensors feed our separate linear layers.
        if gpt {
            if let Some(targets) = gpt2_targets(path, &t.name, &t.shape)? {
                for (name, view) in targets {
                    if params.contains_key(&name) {
                        provide(name, t, view)?;
                    } else {
                        report.unexpected.push(t.name.clone());
                    }
                }
                continue;
            }
            if let Some(name) = gpt2_with_prefix(&t.name).filter(|n| params.contains_key(n)) {
                provide(name, t, View::Whole)?;
                continue;
            }
        }
        let candidates = std::iter::once(t.name.as_str())
            .chain(options.strip_prefixes.iter().filter_map(|p| t.name.strip_prefix(p.as_str())));
        let mut ignored = false;
        let mut target = None;
        for c in candidates {
            if options.ignore.iter().any(|i| i == c) {
                ignored = true;
                break;
            }
            if params.contains_key(c) {
                target = Some(c.to_string());
                break;
            }
        }
        match (ignored, target) {
            (true, _) => report.ignored.push(t.name.clone()),
            (false, Some(name)) => provide(name, t, View::Whole)?,
            (false, None) => report.unexpected.push(t.name.clone()),
        }
    }
    report.unexpected.dedup();
    if tied_head
        && !source.contains_key(TIED_COPY)
        && params.contains_key(TIED_COPY)
        && let Some(&t) = source.get(TIED_SOURCE)
    {
        source.insert(TIED_COPY.to_string(), t);
        report.tied.push(TIED_COPY.to_string());
    }

    // Validate every match, and the gaps, before touching the model.
    let mut hard_missing = Vec::new();
    for p in model.params() {
        match source.get(&p.name) {
            Some((t, view)) => {
                if view.shape(&t.shape).as_ref() != Some(&p.shape) {
                    let stored = match view {
                        View::Whole => String::new(),
                        View::Conv1d { .. } => " (a GPT-2 Conv1D tensor, stored [in, out])".into(),
                    };
                    return Err(weights_error(
                        path,
                        Some(&t.name),
                        format!(
                            "shape {:?}{stored} in the file, but parameter `{}` has shape {:?}",
                            t.shape, p.name, p.shape
                        ),
                    ));
                }
                if !t.dtype.is_float() {
                    return Err(weights_error(
                        path,
                        Some(&t.name),
                        format!(
                            "dtype {} cannot be loaded into parameter `{}`; expected F32, F16, BF16 or F64",
                            t.dtype, p.name
                        ),
                    ));
                }
            }
            None if options.missing_allowed(&p.name) => report.missing.push(p.name.clone()),
            None => hard_missing.push((p.name.clone(), p.shape.clone())),
        }
    }
    if let Some((first, _)) = hard_missing.first() {
        let listed: Vec<String> = hard_missing.iter().map(|(n, s)| format!("{n} {s:?}")).collect();
        let more = match listed.len() {
            1 => String::new(),
            n => format!(" (and {} more: {})", n - 1, listed[1..].join(", ")),
        };
        return Err(weights_error(
            path,
            Some(first),
            format!(
                "the model's parameter {} is not in the file{more}; stripped prefixes {:?}, allowed missing {:?}",
                listed[0], options.strip_prefixes, options.allow_missing
            ),
        ));
    }
    if options.deny_unexpected
        && let Some(first) = report.unexpected.first()
    {
        return Err(weights_error(
            path,
            Some(first),
            format!("matches no model parameter ({} unused tensors in all)", report.unexpected.len()),
        ));
    }

    // Upload. f64 devices read f64 so that F64 checkpoints lose nothing.
    let wide = dev.activation_dtype() == DType::F64;
    for p in model.params_mut() {
        let Some((t, view)) = source.get(&p.name) else { continue };
        if p.is_hollow() {
            if !report.tied.contains(&p.name) {
                report.held_elsewhere.push(p.name.clone());
            }
            continue;
        }
        p.value = if wide {
            dev.upload_f64(&view.apply(file.read_f64(t)?, &t.shape))?
        } else {
            dev.upload(&view.apply(file.read_f32(t)?, &t.shape))?
        };
        if !report.tied.contains(&p.name) {
            report.loaded.push(p.name.clone());
        }
    }
    Ok(report)
}
