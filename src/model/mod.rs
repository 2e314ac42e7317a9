//! Models as ordered lists of units (DESIGN §2.1): embedding, then per Transformer block an
//! attention unit and an MLP unit (residuals inside), then the final norm (pre-LN) and the head.
//!
//! `Model` builds the three families (post-LN BERT with Hugging Face names, pre-LN GPT with a
//! tied LM head, pre-LN ViT), runs forward / loss / backward, freezes a prefix of units, and
//! reports per-unit costs.

pub mod batch;
pub mod block;
pub mod config;
pub mod dropout;
pub mod embedding;
pub mod head;
pub mod init;
pub mod kv_arena;
pub mod layers;
pub mod param;
pub mod replicate;
pub mod tiny;
pub mod unit;

pub use batch::{Batch, DropoutLayout, Hidden, HostBatch, IGNORE_INDEX};
pub use config::{
    BertConfig, Family, GptConfig, HeadSpec, InputSpec, ModelConfig, NormPlacement, Pooling, Spec, VitConfig,
};
pub use kv_arena::{Kv, KvArena};
pub use param::Param;
pub use replicate::Replicate;
pub use unit::{Saved, Unit, UnitCost};

use crate::device::Device;
use crate::error::{Error, Result};
use block::{AttentionNames, AttentionUnit, MlpNames, MlpUnit};
use dropout::DropoutSite;
use embedding::EmbeddingUnit;
use head::{FinalNormUnit, HeadKind, HeadUnit};
use init::{Deferred, Init};
use layers::{INIT_STD, LayerNorm, Linear};

/// A model: its validated spec and its units, in order.
pub struct Model<D: Device> {
    spec: Spec,
    units: Vec<Unit<D>>,
    /// `(unit, param name)` pairs holding tied copies of one weight (GPT's token embedding and
    /// LM head); their gradients are summed before each optimizer step.
    tied: Option<[(usize, String); 2]>,
}

/// A model taken apart: what [`Model::into_parts`] returns and [`Model::from_parts`] takes.
pub struct ModelParts<D: Device> {
    /// The validated spec.
    pub spec: Spec,
    /// The units, in order.
    pub units: Vec<Unit<D>>,
    /// `(unit, param name)` of the two tied copies, if any.
    pub tied: Option<[(usize, String); 2]>,
}

/// Softmax cross-entropy of `logits` (the output of `head`, the model's last unit) against the
/// batch's targets; see [`Model::loss`].
pub fn head_loss<D: Device>(
    dev: &D,
    spec: &Spec,
    head: &Unit<D>,
    batch: &Batch<D>,
    logits: &D::Buf,
    grad_scale: Option<f64>,
) -> Result<LossOutput<D>> {
    let (rows, classes) = match (spec.head, head) {
        (HeadSpec::Classifier { num_labels, .. }, _) => (batch.batch, num_labels),
        (HeadSpec::TiedLmHead, Unit::Head(h)) => (batch.rows(), h.classes()),
        (HeadSpec::TiedLmHead, _) => (batch.rows(), 0),
    };
    let mut losses = dev.alloc_stats(rows)?;
    let mut dlogits = match grad_scale {
        Some(_) => Some(dev.alloc(rows * classes)?),
        None => None,
    };
    let count = dev.cross_entropy_forward_backward(
        &mut losses,
        dlogits.as_mut(),
        logits,
        &batch.targets,
        rows,
        classes,
        IGNORE_INDEX,
        grad_scale.unwrap_or(0.0),
    )?;
    Ok(LossOutput { loss_sum: dev.sum(&losses)?, count, dlogits })
}

/// The loss of one forward pass.
pub struct LossOutput<D: Device> {
    /// Sum of per-row losses over the rows that count.
    pub loss_sum: f64,
    /// Rows that count (not [`IGNORE_INDEX`]).
    pub count: usize,
    /// `∂(loss_sum·grad_scale)/∂logits`, when a gradient was asked for.
    pub dlogits: Option<D::Buf>,
}

impl<D: Device> LossOutput<D> {
    /// Mean loss over the rows that count (0 when none do).
    pub fn mean(&self) -> f64 {
        if self.count == 0 { 0.0 } else { self.loss_sum / self.count as f64 }
    }
}

/// Whether parameter `name` of unit `unit` is the second copy of a tied weight (`tied`, as
/// [`Model::tied`] gives it): left out wherever each weight counts once.
pub fn is_tied_copy(tied: Option<&[(usize, String); 2]>, unit: usize, name: &str) -> bool {
    tied.is_some_and(|[_, (u, n)]| *u == unit && n == name)
}

impl<D: Device> Model<D> {
    /// Builds a randomly initialised model (weights N(0, 0.02²), GPT-2's residual projections
    /// scaled by `1/√(2·layers)`, LayerNorms 1/0, biases 0), every unit trainable.
    pub fn new(dev: &D, config: &ModelConfig, seed: u64) -> Result<Self> {
        Self::build(dev, config, &mut Init::new(seed), &|_| true)
    }

    /// [`new`](Self::new), keeping the values of the units `keep` names only: the others are
    /// [hollow](Param::hollow) as soon as they are built (a stage process builds the whole
    /// model's shapes, but holds its own stages' weights alone). The kept units' values are
    /// those `new` gives, to the bit: drawn after the build from where each weight's draws
    /// start in the stream ([`new_for_loading`](Self::new_for_loading)), so the hollow units
    /// cost no draws (a tied LM head gets its embedding's draw, kept or not).
    pub fn new_keeping(dev: &D, config: &ModelConfig, seed: u64, keep: &dyn Fn(usize) -> bool) -> Result<Self> {
        let (mut model, deferred) = Self::new_for_loading(dev, config, seed, keep)?;
        let names: Vec<String> = model.params().iter().map(|p| p.name.clone()).collect();
        deferred.draw(&mut model, dev, &names)?;
        Ok(model)
    }

    /// [`new_keeping`](Self::new_keeping) for a model whose weights are about to be loaded:
    /// the random draws are put off ([`Init::deferred`]), and the returned [`Deferred`] draws
    /// those a file lacks, as `new_keeping` would have drawn them.
    pub fn new_for_loading(
        dev: &D,
        config: &ModelConfig,
        seed: u64,
        keep: &dyn Fn(usize) -> bool,
    ) -> Result<(Self, Deferred)> {
        let mut init = Init::deferred(seed);
        let model = Self::build(dev, config, &mut init, keep)?;
        Ok((model, init.into_deferred()))
    }

    fn build(dev: &D, config: &ModelConfig, init: &mut Init, keep: &dyn Fn(usize) -> bool) -> Result<Self> {
        let spec = config.spec()?;
        let tied_head = spec.head == HeadSpec::TiedLmHead;
        let hollow_unless_kept =
            |units: &mut Vec<Unit<D>>, i: usize| -> Result<()> { if keep(i) { Ok(()) } else { units[i].hollow(dev) } };
        let site = |unit: usize, local: u64| DropoutSite { p: 0.0, site: unit as u64 * 16 + local };
        let with_p = |s: DropoutSite, p: f32| DropoutSite { p, ..s };
        let mut units = Vec::with_capacity(2 * spec.layers + 3);

        // Embedding.
        let embed_drop = with_p(site(0, 0), spec.embed_dropout);
        units.push(Unit::Embedding(match spec.input {
            InputSpec::Tokens { vocab, max_positions, type_vocab, norm } => {
                let names = match spec.family {
                    Family::Gpt => ["transformer.wte.weight", "transformer.wpe.weight", "", ""],
                    _ => [
                        "embeddings.word_embeddings.weight",
                        "embeddings.position_embeddings.weight",
                        "embeddings.token_type_embeddings.weight",
                        "embeddings.LayerNorm",
                    ],
                };
                let eps = norm.then_some(spec.eps);
                EmbeddingUnit::tokens(dev, init, names, vocab, max_positions, type_vocab, spec.hidden, eps, embed_drop)?
            }
            InputSpec::Image { channels, image_size, patch } => {
                EmbeddingUnit::patches(dev, init, channels, image_size, patch, spec.hidden, embed_drop)?
            }
        }));
        if !tied_head {
            hollow_unless_kept(&mut units, 0)?;
        }

        // Blocks.
        let out_scale = match spec.family {
            Family::Gpt => 1.0 / (2.0 * spec.layers as f64).sqrt(),
            _ => 1.0,
        };
        for i in 0..spec.layers {
            let (attn, mlp) = block_names(spec.family, i);
            let u = units.len();
            let a_drop = with_p(site(u, 0), spec.attn_dropout);
            let o_drop = with_p(site(u, 1), spec.hidden_dropout);
            units.push(Unit::Attention(AttentionUnit::new(dev, init, &attn, &spec, out_scale, a_drop, o_drop)?));
            hollow_unless_kept(&mut units, u)?;
            let m_drop = with_p(site(u + 1, 0), spec.hidden_dropout);
            units.push(Unit::Mlp(MlpUnit::new(dev, init, &mlp, &spec, out_scale, m_drop)?));
            hollow_unless_kept(&mut units, u + 1)?;
        }

        // Final norm (pre-LN) and head.
        match spec.family {
            Family::Gpt => units.push(Unit::FinalNorm(FinalNormUnit {
                norm: LayerNorm::new(dev, "transformer.ln_f", spec.hidden, spec.eps)?,
            })),
            Family::Vit => units.push(Unit::FinalNorm(FinalNormUnit {
                norm: LayerNorm::new(dev, "vit.layernorm", spec.hidden, spec.eps)?,
            })),
            Family::Bert => {}
        }
        if let Some(Unit::FinalNorm(_)) = units.last() {
            let last = units.len() - 1;
            hollow_unless_kept(&mut units, last)?;
        }
        let head_index = units.len();
        let kind = match spec.head {
            HeadSpec::Classifier { pooling, num_labels } => {
                let pooler = match pooling {
                    Pooling::ClsPooler => {
                        Some(Linear::new(dev, init, "pooler.dense", spec.hidden, spec.hidden, INIT_STD)?)
                    }
                    _ => None,
                };
                // Hugging Face's BERT drops out the pooled vector; its ViT does not.
                let p = if spec.family == Family::Bert { spec.hidden_dropout } else { 0.0 };
                HeadKind::Classifier {
                    pooling,
                    pooler,
                    classifier: Linear::new(dev, init, "classifier", spec.hidden, num_labels, INIT_STD)?,
                    dropout: with_p(site(head_index, 0), p),
                }
            }
            HeadSpec::TiedLmHead => {
                let Unit::Embedding(e) = &units[0] else { unreachable!("unit 0 is the embedding") };
                let embedding::EmbeddingKind::Tokens { word, .. } = &e.kind else {
                    return Err(Error::Config {
                        field: "head".into(),
                        message: "a tied LM head needs token embeddings".into(),
                    });
                };
                let values = dev.download(&word.value)?;
                let weight = Param::new(dev, "lm_head.weight", &word.shape, &values, true)?;
                HeadKind::TiedLm {
                    lm_head: Linear { weight, bias: None, in_dim: spec.hidden, out_dim: word.shape[0], deferred: None },
                }
            }
        };
        units.push(Unit::Head(HeadUnit { kind, dim: spec.hidden }));
        hollow_unless_kept(&mut units, head_index)?;
        if tied_head {
            hollow_unless_kept(&mut units, 0)?;
        }
        let tied =
            tied_head.then(|| [(0, "transformer.wte.weight".to_string()), (head_index, "lm_head.weight".to_string())]);
        Ok(Self { spec, units, tied })
    }

    /// The validated description the model was built from.
    pub fn spec(&self) -> &Spec {
        &self.spec
    }

    /// The units, in order.
    pub fn units(&self) -> &[Unit<D>] {
        &self.units
    }

    /// The units, mutable (the pipeline hands them to stages).
    pub fn units_mut(&mut self) -> &mut [Unit<D>] {
        &mut self.units
    }

    /// Every parameter, unit by unit.
    pub fn params(&self) -> Vec<&Param<D>> {
        self.units.iter().flat_map(|u| u.params()).collect()
    }

    /// Every parameter once: a tied weight's second copy left out (it holds the first's value
    /// and, after a backward, the same summed gradient). What a gradient norm sums over, as
    /// PyTorch's one `Parameter` for a tied weight.
    pub fn distinct_params(&self) -> Vec<&Param<D>> {
        let tied = self.tied.as_ref();
        self.units
            .iter()
            .enumerate()
            .flat_map(|(i, u)| u.params().into_iter().filter(move |p| !is_tied_copy(tied, i, &p.name)))
            .collect()
    }

    /// Every parameter, mutable.
    pub fn params_mut(&mut self) -> Vec<&mut Param<D>> {
        self.units.iter_mut().flat_map(|u| u.params_mut()).collect()
    }

    /// Total parameter elements (a tied weight counted once).
    pub fn num_params(&self) -> usize {
        let all: usize = self.params().iter().map(|p| p.numel()).sum();
        let tied = self
            .tied
            .as_ref()
            .map_or(0, |t| self.units[t[1].0].params().iter().find(|p| p.name == t[1].1).map_or(0, |p| p.numel()));
        all - tied
    }

    /// Per-unit costs at sequence length `seq` (the batch's hidden-state length), with
    /// activations counted in the device's dtype.
    pub fn costs(&self, dev: &D, seq: usize) -> Vec<UnitCost> {
        let bytes = dev.activation_dtype().bytes();
        self.units.iter().map(|u| u.cost(dev, seq, bytes)).collect()
    }

    /// Runs every unit forward. Returns the logits and what each unit saved (nothing for
    /// frozen units or in eval mode).
    pub fn forward(&self, dev: &D, batch: &Batch<D>) -> Result<(D::Buf, Vec<Saved<D>>)> {
        let mut saved = Vec::with_capacity(self.units.len());
        let mut x = None;
        let first_trainable = self.frozen_prefix();
        for (i, unit) in self.units.iter().enumerate() {
            let (y, s) = unit.forward(dev, batch, x.take(), batch.train && i >= first_trainable, None)?;
            saved.push(s);
            x = Some(y);
        }
        let logits = x.ok_or_else(|| Error::Internal { what: "model".into(), message: "has no units".into() })?;
        Ok((logits, saved))
    }

    /// Runs every unit except the head, saving nothing, and returns the last hidden states
    /// `[batch, seq, hidden]` (after the final norm for pre-LN models): Hugging Face's
    /// `last_hidden_state`: the deterministic encoder output, without dropout (used to check
    /// loaded weights against PyTorch).
    pub fn forward_hidden(&self, dev: &D, batch: &Batch<D>) -> Result<D::Buf> {
        let body = self.units.len().saturating_sub(1);
        let mut x = None;
        for unit in &self.units[..body] {
            x = Some(unit.forward(dev, batch, x.take(), false, None)?.0);
        }
        x.ok_or_else(|| Error::Internal { what: "model".into(), message: "has no units before the head".into() })
    }

    /// Softmax cross-entropy of `logits` against the batch's targets. With `grad_scale`, also
    /// returns `dlogits` scaled by it (the caller passes `1/count` of the whole global batch,
    /// so micro-batches add up to the full batch's gradient).
    pub fn loss(&self, dev: &D, batch: &Batch<D>, logits: &D::Buf, grad_scale: Option<f64>) -> Result<LossOutput<D>> {
        let head = self
            .units
            .last()
            .ok_or_else(|| Error::Internal { what: "model".into(), message: "has no units".into() })?;
        head_loss(dev, &self.spec, head, batch, logits, grad_scale)
    }

    /// `(unit, param name)` of the two tied copies, if any.
    pub fn tied(&self) -> Option<&[(usize, String); 2]> {
        self.tied.as_ref()
    }

    /// Takes the model apart (a pipeline spreads its units over devices).
    pub fn into_parts(self) -> ModelParts<D> {
        ModelParts { spec: self.spec, units: self.units, tied: self.tied }
    }

    /// Puts a model back together from [`into_parts`](Self::into_parts). A tie that names a
    /// unit past the units, the same unit twice or in the wrong order, or a parameter its unit
    /// does not have is refused.
    pub fn from_parts(parts: ModelParts<D>) -> Result<Self> {
        if let Some([(ua, na), (ub, nb)]) = &parts.tied {
            let has = |u: usize, name: &str| {
                parts.units.get(u).is_some_and(|unit| unit.params().iter().any(|p| p.name == name))
            };
            if ua >= ub || !has(*ua, na) || !has(*ub, nb) {
                return Err(crate::error::config_error(
                    "tied",
                    format!(
                        "({ua}, {na}) and ({ub}, {nb}) of {} units; expected two parameters of the units, the first in an \
                         earlier unit",
                        parts.units.len()
                    ),
                ));
            }
        }
        Ok(Self { spec: parts.spec, units: parts.units, tied: parts.tied })
    }

    /// Runs the units backward from `dlogits`, last unit first, stopping at the frozen
    /// boundary: the first trainable unit is not asked for its input gradient, and frozen
    /// units do no work at all.
    pub fn backward(&mut self, dev: &D, batch: &Batch<D>, saved: Vec<Saved<D>>, dlogits: D::Buf) -> Result<()> {
        let first_trainable = self.frozen_prefix();
        let mut dy = dlogits;
        for (i, (unit, s)) in self.units.iter_mut().zip(saved).enumerate().rev() {
            if i < first_trainable {
                break;
            }
            match unit.backward(dev, batch, s, dy, i > first_trainable, None)? {
                Some(dx) => dy = dx,
                None => break,
            }
        }
        Ok(())
    }

    /// One forward + loss + backward on `batch` (gradients accumulate; tied gradients are
    /// summed). Returns the mean loss.
    pub fn forward_backward(&mut self, dev: &D, batch: &Batch<D>) -> Result<f64> {
        let (logits, saved) = self.forward(dev, batch)?;
        let scale = if batch.target_count == 0 { 0.0 } else { 1.0 / batch.target_count as f64 };
        let out = self.loss(dev, batch, &logits, Some(scale))?;
        drop(logits);
        let mean = out.mean();
        let dlogits =
            out.dlogits.ok_or_else(|| Error::Internal { what: "loss".into(), message: "no gradient".into() })?;
        self.backward(dev, batch, saved, dlogits)?;
        self.sync_tied_grads(dev)?;
        Ok(mean)
    }

    /// [`forward_backward`](Self::forward_backward) over the token slices of one batch
    /// (TeraPipe on one device): the slices run forward in order, each attention unit keeping
    /// the keys and values so far in its arena, then backward last slice first. Every slice's
    /// loss gradient is scaled by the whole batch's target count, so the gradients equal the
    /// unsliced step's. Returns the mean loss.
    pub fn forward_backward_sliced(&mut self, dev: &D, slices: &[Batch<D>]) -> Result<f64> {
        let Some(first) = slices.first() else {
            return Err(Error::Internal { what: "model".into(), message: "no token slices".into() });
        };
        let (width, first_trainable) = (self.spec.hidden, self.frozen_prefix());
        let mut arenas: Vec<Option<KvArena<D>>> = self
            .units
            .iter()
            .map(|u| match u {
                Unit::Attention(_) => KvArena::new(dev, first.batch, first.whole_seq, width).map(Some),
                _ => Ok(None),
            })
            .collect::<Result<_>>()?;
        let count: usize = slices.iter().map(|s| s.target_count).sum();
        let scale = if count == 0 { 0.0 } else { 1.0 / count as f64 };
        let (mut loss_sum, mut pending) = (0.0, Vec::with_capacity(slices.len()));
        for batch in slices {
            let mut saved = Vec::with_capacity(self.units.len());
            let mut x = None;
            for (i, (unit, arena)) in self.units.iter().zip(&mut arenas).enumerate() {
                let (y, s) = unit.forward(dev, batch, x.take(), batch.train && i >= first_trainable, arena.as_mut())?;
                saved.push(s);
                x = Some(y);
            }
            let logits = x.ok_or_else(|| Error::Internal { what: "model".into(), message: "has no units".into() })?;
            let out = self.loss(dev, batch, &logits, Some(scale))?;
            loss_sum += out.loss_sum;
            let dlogits =
                out.dlogits.ok_or_else(|| Error::Internal { what: "loss".into(), message: "no gradient".into() })?;
            pending.push((saved, dlogits));
        }
        for (batch, (saved, dlogits)) in slices.iter().zip(pending).rev() {
            let mut dy = dlogits;
            for (i, ((unit, s), arena)) in self.units.iter_mut().zip(saved).zip(&mut arenas).enumerate().rev() {
                if i < first_trainable {
                    break;
                }
                match unit.backward(dev, batch, s, dy, i > first_trainable, arena.as_mut())? {
                    Some(dx) => dy = dx,
                    None => break,
                }
            }
        }
        self.sync_tied_grads(dev)?;
        Ok(loss_sum * scale)
    }

    /// Sums the gradients of tied copies into both, so identical optimizer updates keep the
    /// copies equal. A no-op when the model ties nothing or the tie is frozen.
    pub fn sync_tied_grads(&mut self, dev: &D) -> Result<()> {
        let Some([(ua, na), (ub, nb)]) = self.tied.clone() else { return Ok(()) };
        let (lo, hi) = self.units.split_at_mut(ub);
        let pa = lo[ua].params_mut().into_iter().find(|p| p.name == na);
        let pb = hi[0].params_mut().into_iter().find(|p| p.name == nb);
        if let (Some(Param { grad: Some(ga), .. }), Some(Param { grad: Some(gb), .. })) = (pa, pb) {
            dev.residual_backward(ga, gb)?;
            dev.copy(gb, ga)?;
        }
        Ok(())
    }

    /// Sets every gradient to zero.
    pub fn zero_grad(&mut self, dev: &D) -> Result<()> {
        for p in self.params_mut() {
            p.zero_grad(dev)?;
        }
        Ok(())
    }

    /// Number of leading frozen units.
    pub fn frozen_prefix(&self) -> usize {
        self.units.iter().take_while(|u| !u.trainable()).count()
    }

    /// Freezes units `0..n` and makes the rest trainable (PipeTransformer freezes a growing
    /// prefix). A tied weight follows its first copy: freezing the embedding freezes the LM
    /// head's copy too, as with a shared tensor.
    pub fn freeze_prefix(&mut self, dev: &D, n: usize) -> Result<()> {
        if n > self.units.len() {
            return Err(Error::Config {
                field: "freeze_prefix".into(),
                message: format!("cannot freeze {n} units: the model has {}", self.units.len()),
            });
        }
        for (i, u) in self.units.iter_mut().enumerate() {
            u.set_trainable(dev, i >= n)?;
        }
        if let Some([(ua, _), (ub, nb)]) = self.tied.clone() {
            let frozen = ua < n;
            if let Some(p) = self.units[ub].params_mut().into_iter().find(|p| p.name == nb) {
                p.set_trainable(dev, !frozen)?;
            }
        }
        Ok(())
    }
}

/// Parameter names of block `i`'s attention and MLP units for a family.
fn block_names(family: Family, i: usize) -> (AttentionNames, MlpNames) {
    match family {
        Family::Bert => {
            let p = format!("encoder.layer.{i}");
            (
                AttentionNames {
                    query: format!("{p}.attention.self.query"),
                    key: format!("{p}.attention.self.key"),
                    value: format!("{p}.attention.self.value"),
                    output: format!("{p}.attention.output.dense"),
                    norm: format!("{p}.attention.output.LayerNorm"),
                },
                MlpNames {
                    fc_in: format!("{p}.intermediate.dense"),
                    fc_out: format!("{p}.output.dense"),
                    norm: format!("{p}.output.LayerNorm"),
                },
            )
        }
        Family::Vit => {
            let p = format!("vit.encoder.layer.{i}");
            (
                AttentionNames {
                    query: format!("{p}.attention.attention.query"),
                    key: format!("{p}.attention.attention.key"),
                    value: format!("{p}.attention.attention.value"),
                    output: format!("{p}.attention.output.dense"),
                    norm: format!("{p}.layernorm_before"),
                },
                MlpNames {
                    fc_in: format!("{p}.intermediate.dense"),
                    fc_out: format!("{p}.output.dense"),
                    norm: format!("{p}.layernorm_after"),
                },
            )
        }
        Family::Gpt => {
            let p = format!("transformer.h.{i}");
            (
                AttentionNames {
                    query: format!("{p}.attn.q_proj"),
                    key: format!("{p}.attn.k_proj"),
                    value: format!("{p}.attn.v_proj"),
                    output: format!("{p}.attn.out_proj"),
                    norm: format!("{p}.ln_1"),
                },
                MlpNames {
                    fc_in: format!("{p}.mlp.fc_in"),
                    fc_out: format!("{p}.mlp.fc_out"),
                    norm: format!("{p}.ln_2"),
                },
            )
        }
    }
}
