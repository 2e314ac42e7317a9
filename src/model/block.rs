//! The two units of a Transformer block, each with its residual connection inside (so a
//! pipeline cut between units never cuts a skip connection):
//! - `AttentionUnit`: multi-head self-attention;
//! - `MlpUnit`: linear → GELU → linear.
//!
//! Post-LN (BERT): `y = LN(x + drop(f(x)))`. Pre-LN (GPT-2, ViT): `y = x + drop(f(LN(x)))`.

use super::batch::Batch;
use super::config::NormPlacement;
use super::dropout::DropoutSite;
use super::embedding::missing_saved;
use super::layers::{LayerNorm, LayerNormSaved, Linear};
use super::param::Param;
use crate::device::Device;
use crate::error::Result;
use crate::ops::attention::AttentionDims;
use crate::ops::gelu::Activation;

/// Parameter names of an attention unit.
pub struct AttentionNames {
    /// Query projection.
    pub query: String,
    /// Key projection.
    pub key: String,
    /// Value projection.
    pub value: String,
    /// Output projection.
    pub output: String,
    /// The unit's LayerNorm.
    pub norm: String,
}

/// Multi-head self-attention with its residual and LayerNorm.
pub struct AttentionUnit<D: Device> {
    /// Query projection `[C, C]`.
    pub query: Linear<D>,
    /// Key projection `[C, C]`.
    pub key: Linear<D>,
    /// Value projection `[C, C]`.
    pub value: Linear<D>,
    /// Output projection `[C, C]`.
    pub output: Linear<D>,
    /// LayerNorm (before the attention in pre-LN, after the residual in post-LN).
    pub norm: LayerNorm<D>,
    /// Where the norm sits.
    pub placement: NormPlacement,
    /// Heads.
    pub heads: usize,
    /// Causal mask (language models).
    pub causal: bool,
    /// Dropout on attention probabilities.
    pub attn_dropout: DropoutSite,
    /// Dropout on the branch output.
    pub out_dropout: DropoutSite,
}

/// Activations an attention unit keeps for its backward.
pub struct AttentionSaved<D: Device> {
    x: D::Buf,
    /// Pre-LN: the LayerNorm output (the projections' input).
    normed: Option<D::Buf>,
    /// Post-LN: the residual sum (the LayerNorm input).
    residual: Option<D::Buf>,
    stats: LayerNormSaved<D>,
    q: D::Buf,
    k: D::Buf,
    v: D::Buf,
    probs: D::Buf,
    attended: D::Buf,
}

impl<D: Device> AttentionUnit<D> {
    fn dims(&self, batch: &Batch<D>) -> AttentionDims {
        let (seed, offset) = batch.dropout_coords(self.attn_dropout.site, self.heads * batch.seq * batch.seq);
        AttentionDims {
            batch: batch.batch,
            q_len: batch.seq,
            kv_len: batch.seq,
            heads: self.heads,
            head_dim: self.query.out_dim / self.heads,
            causal: self.causal,
            dropout: if self.attn_dropout.active(batch) { self.attn_dropout.p } else { 0.0 },
            dropout_seed: seed,
            dropout_offset: offset,
        }
    }

    /// `[B, T, C] → [B, T, C]`; keeps activations when `save`.
    pub fn forward(
        &self,
        dev: &D,
        batch: &Batch<D>,
        x: D::Buf,
        save: bool,
    ) -> Result<(D::Buf, Option<AttentionSaved<D>>)> {
        let rows = batch.rows();
        let c = self.query.out_dim;
        let d = self.dims(batch);
        // Pre-LN normalises the branch input; post-LN feeds x itself.
        let (normed, pre_stats) = match self.placement {
            NormPlacement::Pre => {
                let (h, s) = self.norm.forward(dev, &x, rows)?;
                (Some(h), Some(s))
            }
            NormPlacement::Post => (None, None),
        };
        let inp = normed.as_ref().unwrap_or(&x);
        let q = self.query.forward(dev, inp, rows)?;
        let k = self.key.forward(dev, inp, rows)?;
        let v = self.value.forward(dev, inp, rows)?;
        let mut attended = dev.alloc(rows * c)?;
        let mut probs = dev.alloc(batch.batch * self.heads * batch.seq * batch.seq)?;
        dev.attention_forward(&mut attended, &mut probs, &q, &k, &v, batch.attention_mask.as_ref(), &d)?;
        let o = self.output.forward(dev, &attended, rows)?;
        let o = self.out_dropout.forward(dev, batch, o, batch.seq * c)?;
        let mut r = dev.alloc(rows * c)?;
        dev.residual_forward(&mut r, &x, &o)?;
        let (y, residual, stats) = match (self.placement, pre_stats) {
            (NormPlacement::Pre, Some(s)) => (r, None, s),
            _ => {
                let (y, s) = self.norm.forward(dev, &r, rows)?;
                (y, Some(r), s)
            }
        };
        let saved = save.then_some(AttentionSaved { x, normed, residual, stats, q, k, v, probs, attended });
        Ok((y, saved))
    }

    /// The forward chain reversed. Returns `dx` when `need_dinp`.
    pub fn backward(
        &mut self,
        dev: &D,
        batch: &Batch<D>,
        s: AttentionSaved<D>,
        dy: &D::Buf,
        need_dinp: bool,
    ) -> Result<Option<D::Buf>> {
        let rows = batch.rows();
        let c = self.query.out_dim;
        let d = self.dims(batch);
        // Post-LN: through the LayerNorm to the residual sum r = x + o.
        let dr_owned = match (&self.placement, &s.residual) {
            (NormPlacement::Post, Some(r)) => Some(self.norm.backward(dev, dy, r, &s.stats, rows)?),
            (NormPlacement::Post, None) => return Err(missing_saved("attention residual")),
            (NormPlacement::Pre, _) => None,
        };
        let dr = dr_owned.as_ref().unwrap_or(dy);
        // r = x + drop(o): the branch gets dr through the dropout mask.
        let do_dropped = self.out_dropout.backward(dev, batch, dr, batch.seq * c)?;
        let d_o = do_dropped.as_ref().unwrap_or(dr);
        // o = attended · Woᵀ
        let d_attended =
            self.output.backward(dev, d_o, &s.attended, rows, true)?.ok_or_else(|| missing_saved("dattended"))?;
        // attended = attention(q, k, v)
        let mut dq = dev.alloc(rows * c)?;
        let mut dk = dev.alloc(rows * c)?;
        let mut dv = dev.alloc(rows * c)?;
        dev.attention_backward(
            &mut dq,
            &mut dk,
            &mut dv,
            &d_attended,
            &s.q,
            &s.k,
            &s.v,
            &s.probs,
            batch.attention_mask.as_ref(),
            &d,
        )?;
        // q, k, v = inp · W{q,k,v}ᵀ, where inp is LN(x) (pre) or x (post). Pre-LN always needs
        // d(inp) for the LayerNorm's own gradients; post-LN only when dx is wanted.
        let inp = s.normed.as_ref().unwrap_or(&s.x);
        let need_dinp_branch = need_dinp || self.placement == NormPlacement::Pre;
        let dinp = self.query.backward(dev, &dq, inp, rows, need_dinp_branch)?;
        let dk_in = self.key.backward(dev, &dk, inp, rows, need_dinp_branch)?;
        let dv_in = self.value.backward(dev, &dv, inp, rows, need_dinp_branch)?;
        let Some(mut dinp) = dinp else { return Ok(None) };
        for part in [dk_in, dv_in].into_iter().flatten() {
            dev.residual_backward(&mut dinp, &part)?;
        }
        // Skip connection: dx = dr + d(branch input) (through the pre-LN norm if any).
        let mut dx = match self.placement {
            NormPlacement::Pre => self.norm.backward(dev, &dinp, &s.x, &s.stats, rows)?,
            NormPlacement::Post => dinp,
        };
        if !need_dinp {
            return Ok(None);
        }
        dev.residual_backward(&mut dx, dr)?;
        Ok(Some(dx))
    }

    /// The unit's parameters, in Hugging Face order.
    pub fn params_mut(&mut self) -> Vec<&mut Param<D>> {
        let mut v = Vec::new();
        for l in [&mut self.query, &mut self.key, &mut self.value, &mut self.output] {
            v.extend(l.params_mut());
        }
        v.extend(self.norm.params_mut());
        v
    }
}

/// Parameter names of an MLP unit.
pub struct MlpNames {
    /// `C → F` projection.
    pub fc_in: String,
    /// `F → C` projection.
    pub fc_out: String,
    /// The unit's LayerNorm.
    pub norm: String,
}

/// Linear → GELU → linear, with its residual and LayerNorm.
pub struct MlpUnit<D: Device> {
    /// `[F, C]`.
    pub fc_in: Linear<D>,
    /// `[C, F]`.
    pub fc_out: Linear<D>,
    /// LayerNorm.
    pub norm: LayerNorm<D>,
    /// Where the norm sits.
    pub placement: NormPlacement,
    /// GELU form.
    pub act: Activation,
    /// Dropout on the branch output.
    pub dropout: DropoutSite,
}

/// Activations an MLP unit keeps for its backward.
pub struct MlpSaved<D: Device> {
    x: D::Buf,
    normed: Option<D::Buf>,
    residual: Option<D::Buf>,
    stats: LayerNormSaved<D>,
    pre_act: D::Buf,
    act: D::Buf,
}

impl<D: Device> MlpUnit<D> {
    /// `[B, T, C] → [B, T, C]`; keeps activations when `save`.
    pub fn forward(&self, dev: &D, batch: &Batch<D>, x: D::Buf, save: bool) -> Result<(D::Buf, Option<MlpSaved<D>>)> {
        let rows = batch.rows();
        let c = self.fc_in.in_dim;
        let (normed, pre_stats) = match self.placement {
            NormPlacement::Pre => {
                let (h, s) = self.norm.forward(dev, &x, rows)?;
                (Some(h), Some(s))
            }
            NormPlacement::Post => (None, None),
        };
        let inp = normed.as_ref().unwrap_or(&x);
        let pre_act = self.fc_in.forward(dev, inp, rows)?;
        let mut act = dev.alloc(D::len(&pre_act))?;
        dev.gelu_forward(&mut act, &pre_act, self.act)?;
        let z = self.fc_out.forward(dev, &act, rows)?;
        let z = self.dropout.forward(dev, batch, z, batch.seq * c)?;
        let mut r = dev.alloc(rows * c)?;
        dev.residual_forward(&mut r, &x, &z)?;
        let (y, residual, stats) = match (self.placement, pre_stats) {
            (NormPlacement::Pre, Some(s)) => (r, None, s),
            _ => {
                let (y, s) = self.norm.forward(dev, &r, rows)?;
                (y, Some(r), s)
            }
        };
        Ok((y, save.then_some(MlpSaved { x, normed, residual, stats, pre_act, act })))
    }

    /// The forward chain reversed. Returns `dx` when `need_dinp`.
    pub fn backward(
        &mut self,
        dev: &D,
        batch: &Batch<D>,
        s: MlpSaved<D>,
        dy: &D::Buf,
        need_dinp: bool,
    ) -> Result<Option<D::Buf>> {
        let rows = batch.rows();
        let c = self.fc_in.in_dim;
        // Post-LN: through the LayerNorm to r = x + z.
        let dr_owned = match (&self.placement, &s.residual) {
            (NormPlacement::Post, Some(r)) => Some(self.norm.backward(dev, dy, r, &s.stats, rows)?),
            (NormPlacement::Post, None) => return Err(missing_saved("mlp residual")),
            (NormPlacement::Pre, _) => None,
        };
        let dr = dr_owned.as_ref().unwrap_or(dy);
        // z = drop(act · W_outᵀ)
        let dz_dropped = self.dropout.backward(dev, batch, dr, batch.seq * c)?;
        let dz = dz_dropped.as_ref().unwrap_or(dr);
        let dact = self.fc_out.backward(dev, dz, &s.act, rows, true)?.ok_or_else(|| missing_saved("dact"))?;
        // act = gelu(pre_act)
        let mut dpre = dev.alloc(D::len(&dact))?;
        dev.gelu_backward(&mut dpre, &s.pre_act, &dact, self.act)?;
        // pre_act = inp · W_inᵀ
        let inp = s.normed.as_ref().unwrap_or(&s.x);
        let need_dinp_branch = need_dinp || self.placement == NormPlacement::Pre;
        let Some(dinp) = self.fc_in.backward(dev, &dpre, inp, rows, need_dinp_branch)? else { return Ok(None) };
        let mut dx = match self.placement {
            NormPlacement::Pre => self.norm.backward(dev, &dinp, &s.x, &s.stats, rows)?,
            NormPlacement::Post => dinp,
        };
        if !need_dinp {
            return Ok(None);
        }
        dev.residual_backward(&mut dx, dr)?;
        Ok(Some(dx))
    }

    /// The unit's parameters, in Hugging Face order.
    pub fn params_mut(&mut self) -> Vec<&mut Param<D>> {
        let mut v = self.fc_in.params_mut();
        v.extend(self.fc_out.params_mut());
        v.extend(self.norm.params_mut());
        v
    }
}

impl<D: Device> AttentionUnit<D> {
    /// A unit with projections initialised N(0, 0.02²) (the output projection scaled by
    /// `out_std_scale`, GPT-2's `1/√(2·layers)`), LayerNorm at 1/0.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        dev: &D,
        rng: &mut crate::rng::Rng,
        names: &AttentionNames,
        spec: &super::config::Spec,
        out_std_scale: f64,
        attn_dropout: DropoutSite,
        out_dropout: DropoutSite,
    ) -> Result<Self> {
        let c = spec.hidden;
        let std = super::layers::INIT_STD;
        Ok(Self {
            query: Linear::new(dev, rng, &names.query, c, c, std)?,
            key: Linear::new(dev, rng, &names.key, c, c, std)?,
            value: Linear::new(dev, rng, &names.value, c, c, std)?,
            output: Linear::new(dev, rng, &names.output, c, c, std * out_std_scale)?,
            norm: LayerNorm::new(dev, &names.norm, c, spec.eps)?,
            placement: spec.norm,
            heads: spec.heads,
            causal: spec.causal,
            attn_dropout,
            out_dropout,
        })
    }
}

impl<D: Device> MlpUnit<D> {
    /// A unit with N(0, 0.02²) weights (`fc_out` scaled by `out_std_scale`), zero biases.
    pub fn new(
        dev: &D,
        rng: &mut crate::rng::Rng,
        names: &MlpNames,
        spec: &super::config::Spec,
        out_std_scale: f64,
        dropout: DropoutSite,
    ) -> Result<Self> {
        let std = super::layers::INIT_STD;
        Ok(Self {
            fc_in: Linear::new(dev, rng, &names.fc_in, spec.hidden, spec.mlp_hidden, std)?,
            fc_out: Linear::new(dev, rng, &names.fc_out, spec.mlp_hidden, spec.hidden, std * out_std_scale)?,
            norm: LayerNorm::new(dev, &names.norm, spec.hidden, spec.eps)?,
            placement: spec.norm,
            act: spec.act,
            dropout,
        })
    }
}
