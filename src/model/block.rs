//! The two units of a Transformer block, each with its residual connection inside (so a
//! pipeline cut between units never cuts a skip connection):
//! - `AttentionUnit`: multi-head self-attention;
//! - `MlpUnit`: linear → GELU → linear.
//!
//! Both wrap their branch `f` in the same `Residual`: post-LN (BERT) `y = LN(x + drop(f(x)))`,
//! pre-LN (GPT-2, ViT) `y = x + drop(f(LN(x)))`.

use super::batch::{Batch, DropoutLayout};
use super::config::{NormPlacement, Spec};
use super::dropout::DropoutSite;
use super::embedding::missing_saved;
use super::init::Init;
use super::kv_arena::{Kv, KvArena};
use super::layers::{Held, INIT_STD, LayerNorm, LayerNormSaved, Linear, clone_buf, len_of};
use super::param::Param;
use crate::device::Device;
use crate::error::{Result, config_error};
use crate::ops::attention::AttentionDims;
use crate::ops::gelu::Activation;
use std::sync::Arc;

/// A branch's LayerNorm, output dropout and skip connection.
pub struct Residual<D: Device> {
    /// The LayerNorm (before the branch in pre-LN, after the sum in post-LN).
    pub norm: LayerNorm<D>,
    /// Where the norm sits.
    pub placement: NormPlacement,
    /// Dropout on the branch output.
    pub dropout: DropoutSite,
}

/// What the residual wrapper keeps for its backward.
pub struct ResidualSaved<D: Device> {
    x: D::Buf,
    /// Pre-LN: `LN(x)`, the branch input.
    normed: Option<D::Buf>,
    /// Post-LN: `x + drop(f(x))`, the norm input.
    sum: Option<D::Buf>,
    stats: LayerNormSaved<D>,
}

impl<D: Device> ResidualSaved<D> {
    /// Elements held.
    pub fn elements(&self) -> usize {
        D::len(&self.x) + len_of::<D>(self.normed.as_ref()) + len_of::<D>(self.sum.as_ref()) + self.stats.elements()
    }
}

/// A unit's output and, when saved, what its backward needs: the residual's activations and the
/// branch's.
pub type Forward<D, S> = (<D as Device>::Buf, Option<(ResidualSaved<D>, S)>);

impl<D: Device> Residual<D> {
    /// Runs `branch` on the branch input (`LN(x)` or `x`) and wraps its output. `branch`
    /// returns its output and what its own backward needs.
    pub fn forward<S>(
        &self,
        dev: &D,
        batch: &Batch<D>,
        x: D::Buf,
        train: bool,
        branch: impl FnOnce(&D::Buf) -> Result<(D::Buf, S)>,
    ) -> Result<Forward<D, S>> {
        let rows = batch.rows();
        let pre = match self.placement {
            NormPlacement::Pre => Some(self.norm.forward(dev, &x, rows)?),
            NormPlacement::Post => None,
        };
        let (z, branch_saved) = branch(pre.as_ref().map_or(&x, |(h, _)| h))?;
        let z = self.dropout.forward(dev, batch, z, DropoutLayout::Tokens(self.norm.dim), train)?;
        let mut sum = dev.alloc(rows * self.norm.dim)?;
        dev.residual_forward(&mut sum, &x, &z)?;
        let (y, normed, sum, stats) = match pre {
            Some((h, stats)) => (sum, Some(h), None, stats),
            None => {
                let (y, stats) = self.norm.forward(dev, &sum, rows)?;
                (y, None, Some(sum), stats)
            }
        };
        Ok((y, train.then_some((ResidualSaved { x, normed, sum, stats }, branch_saved))))
    }

    /// The forward reversed. `branch(dz, branch_input, need_input_grad)` runs the branch's
    /// backward and returns the gradient of its input when asked. Returns `dx` when
    /// `need_dinp`.
    pub fn backward(
        &mut self,
        dev: &D,
        batch: &Batch<D>,
        s: ResidualSaved<D>,
        dy: &D::Buf,
        need_dinp: bool,
        branch: impl FnOnce(&D::Buf, &D::Buf, bool) -> Result<Option<D::Buf>>,
    ) -> Result<Option<D::Buf>> {
        let rows = batch.rows();
        // Post-LN: through the norm to the sum x + drop(z).
        let dsum_owned = match &s.sum {
            Some(sum) => Some(self.norm.backward(dev, dy, sum, &s.stats, rows)?),
            None => None,
        };
        let dsum = dsum_owned.as_ref().unwrap_or(dy);
        // The branch's share goes through the dropout mask.
        let dz_owned = self.dropout.backward(dev, batch, dsum, DropoutLayout::Tokens(self.norm.dim))?;
        let dz = dz_owned.as_ref().unwrap_or(dsum);
        // Pre-LN needs the branch input's gradient even when dx is not wanted: the norm's own
        // parameter gradients come from it.
        let Some(dbranch_in) = branch(dz, s.normed.as_ref().unwrap_or(&s.x), need_dinp || s.normed.is_some())? else {
            return Ok(None);
        };
        let mut dx = match &s.normed {
            Some(_) => self.norm.backward(dev, &dbranch_in, &s.x, &s.stats, rows)?,
            None => dbranch_in,
        };
        if !need_dinp {
            return Ok(None);
        }
        // The skip connection.
        dev.residual_backward(&mut dx, dsum)?;
        Ok(Some(dx))
    }
}

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

/// Multi-head self-attention inside a [`Residual`].
pub struct AttentionUnit<D: Device> {
    /// Query projection `[C, C]`.
    pub query: Linear<D>,
    /// Key projection `[C, C]`.
    pub key: Linear<D>,
    /// Value projection `[C, C]`.
    pub value: Linear<D>,
    /// Output projection `[C, C]`.
    pub output: Linear<D>,
    /// Norm, output dropout and skip connection.
    pub residual: Residual<D>,
    /// Heads.
    pub heads: usize,
    /// Causal mask (language models).
    pub causal: bool,
    /// Dropout on attention probabilities.
    pub attn_dropout: DropoutSite,
}

/// What the attention branch keeps for its backward.
pub struct AttentionBranchSaved<D: Device> {
    q: D::Buf,
    /// The keys and values attended over; `None` for a token slice, whose context is read
    /// back from the arena (keeping it would hold every earlier slice's keys once per slice).
    kv: Option<(D::Buf, D::Buf)>,
    probs: D::Buf,
    attended: D::Buf,
}

impl<D: Device> AttentionBranchSaved<D> {
    /// Elements held.
    pub fn elements(&self) -> usize {
        let kv = self.kv.as_ref().map_or(0, |(k, v)| D::len(k) + D::len(v));
        D::len(&self.q) + kv + D::len(&self.probs) + D::len(&self.attended)
    }
}

/// Activations an attention unit keeps for its backward.
pub type AttentionSaved<D> = (ResidualSaved<D>, AttentionBranchSaved<D>);

impl<D: Device> AttentionUnit<D> {
    /// A unit with projections initialised N(0, 0.02²) (the output projection scaled by
    /// `out_std_scale`, GPT-2's `1/√(2·layers)`), LayerNorm at 1/0.
    pub fn new(
        dev: &D,
        init: &mut Init,
        names: &AttentionNames,
        spec: &Spec,
        out_std_scale: f64,
        attn_dropout: DropoutSite,
        out_dropout: DropoutSite,
    ) -> Result<Self> {
        let c = spec.hidden;
        Ok(Self {
            query: Linear::new(dev, init, &names.query, c, c, INIT_STD)?,
            key: Linear::new(dev, init, &names.key, c, c, INIT_STD)?,
            value: Linear::new(dev, init, &names.value, c, c, INIT_STD)?,
            output: Linear::new(dev, init, &names.output, c, c, INIT_STD * out_std_scale)?,
            residual: Residual {
                norm: LayerNorm::new(dev, &names.norm, c, spec.eps)?,
                placement: spec.norm,
                dropout: out_dropout,
            },
            heads: spec.heads,
            causal: spec.causal,
            attn_dropout,
        })
    }

    /// A token slice attends over its context: every position before it and its own.
    fn dims(&self, batch: &Batch<D>, train: bool) -> AttentionDims {
        let (seed, offset) = batch.attention_dropout(self.attn_dropout.site, self.heads);
        AttentionDims {
            batch: batch.batch,
            q_len: batch.seq,
            kv_len: batch.position_offset + batch.seq,
            heads: self.heads,
            head_dim: self.query.out_dim / self.heads,
            causal: self.causal,
            dropout: if self.attn_dropout.active(train) { self.attn_dropout.p } else { 0.0 },
            dropout_seed: seed,
            dropout_offset: offset,
            mask_seq: batch.whole_seq,
        }
    }

    /// `[B, T, C] → [B, T, C]`; in a training pass (`train`: dropout on, activations kept for
    /// the backward). A token slice (TeraPipe) writes its keys and values into `arena` at its
    /// positions and attends over the arena's rows up to its end.
    pub fn forward(
        &self,
        dev: &D,
        batch: &Batch<D>,
        x: D::Buf,
        train: bool,
        arena: Option<&mut KvArena<D>>,
    ) -> Result<(D::Buf, Option<AttentionSaved<D>>)> {
        if arena.is_some() && !self.causal && batch.seq != batch.whole_seq {
            // A slice of a bidirectional encoder would attend to its earlier tokens only.
            return Err(config_error(
                "pipeline.token_slices",
                "token slices need a causal language model (a GPT): a BERT's or ViT's tokens attend to later ones too",
            ));
        }
        let rows = batch.rows();
        let d = self.dims(batch, train);
        self.residual.forward(dev, batch, x, train, |inp| {
            let q = self.query.forward(dev, inp, rows)?;
            let k = self.key.forward(dev, inp, rows)?;
            let v = self.value.forward(dev, inp, rows)?;
            let (k, v, kv) = match arena {
                Some(arena) => {
                    arena.write(dev, Kv::Keys, &k, batch.position_offset)?;
                    arena.write(dev, Kv::Values, &v, batch.position_offset)?;
                    (arena.context(dev, Kv::Keys, d.kv_len)?, arena.context(dev, Kv::Values, d.kv_len)?, false)
                }
                None if d.kv_len != d.q_len => return Err(missing_saved("the key/value arena of a token slice")),
                None => (k, v, true),
            };
            let mut attended = dev.alloc(rows * self.query.out_dim)?;
            let mut probs = dev.alloc_stats(dev.attention_saved_len(&d))?;
            dev.attention_forward(&mut attended, &mut probs, &q, &k, &v, batch.attention_mask.as_ref(), &d)?;
            let z = self.output.forward(dev, &attended, rows)?;
            Ok((z, AttentionBranchSaved { q, kv: kv.then_some((k, v)), probs, attended }))
        })
    }

    /// The forward chain reversed. Returns `dx` when `need_dinp`. A token slice reads its
    /// context back from `arena`, adds the context's key/value gradients into it, and takes its
    /// own rows' (complete, since later slices ran their backward first).
    pub fn backward(
        &mut self,
        dev: &D,
        batch: &Batch<D>,
        (residual, s): AttentionSaved<D>,
        dy: &D::Buf,
        need_dinp: bool,
        arena: Option<&mut KvArena<D>>,
    ) -> Result<Option<D::Buf>> {
        let rows = batch.rows();
        let c = self.query.out_dim;
        let d = self.dims(batch, true);
        let (query, key, value, output) = (&mut self.query, &mut self.key, &mut self.value, &mut self.output);
        self.residual.backward(dev, batch, residual, dy, need_dinp, |dz, inp, need_dinp| {
            // z = attended · Woᵀ
            let dattended = output
                .backward(dev, Held::Lent(dz), Held::Lent(&s.attended), rows, true)?
                .ok_or_else(|| missing_saved("dattended"))?;
            // attended = attention(q, k, v), k and v over the whole context.
            let context;
            let (k, v) = match (&s.kv, &arena) {
                (Some((k, v)), _) => (k, v),
                (None, Some(arena)) => {
                    context = (arena.context(dev, Kv::Keys, d.kv_len)?, arena.context(dev, Kv::Values, d.kv_len)?);
                    (&context.0, &context.1)
                }
                (None, None) => return Err(missing_saved("the key/value arena of a token slice")),
            };
            let kv_rows = batch.batch * d.kv_len * c;
            let (mut dq, mut dk, mut dv) = (dev.alloc(rows * c)?, dev.alloc(kv_rows)?, dev.alloc(kv_rows)?);
            let mask = batch.attention_mask.as_ref();
            dev.attention_backward(&mut dq, &mut dk, &mut dv, &dattended, &s.q, k, v, &s.attended, &s.probs, mask, &d)?;
            // A slice's keys and values fed every later slice too: their gradients gather in
            // the arena, and this slice's rows are complete once its own share is in.
            if let Some(arena) = arena {
                arena.add_grad(dev, Kv::Keys, &dk)?;
                arena.add_grad(dev, Kv::Values, &dv)?;
                dk = arena.grad(dev, Kv::Keys, batch.position_offset, batch.seq)?;
                dv = arena.grad(dev, Kv::Values, batch.position_offset, batch.seq)?;
            }
            // q, k, v = inp · W{q,k,v}ᵀ: the input gradient is the sum of the three. Put-off
            // weight gradients share one copy of the input.
            let defers = [&*query, &*key, &*value].iter().any(|l| l.defers_weight_grads());
            let shared = if defers { Some(Arc::new(clone_buf(dev, inp)?)) } else { None };
            let held = || shared.as_ref().map_or(Held::Lent(inp), |s| Held::Shared(s.clone()));
            let dinp = query.backward(dev, Held::Given(dq), held(), rows, need_dinp)?;
            let dinp_k = key.backward(dev, Held::Given(dk), held(), rows, need_dinp)?;
            let dinp_v = value.backward(dev, Held::Given(dv), held(), rows, need_dinp)?;
            let Some(mut dinp) = dinp else { return Ok(None) };
            for part in [dinp_k, dinp_v].into_iter().flatten() {
                dev.residual_backward(&mut dinp, &part)?;
            }
            Ok(Some(dinp))
        })
    }

    /// The unit's parameters, in Hugging Face order.
    pub fn params_mut(&mut self) -> Vec<&mut Param<D>> {
        let mut v = Vec::new();
        for l in [&mut self.query, &mut self.key, &mut self.value, &mut self.output] {
            v.extend(l.params_mut());
        }
        v.extend(self.residual.norm.params_mut());
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

/// Linear → GELU → linear inside a [`Residual`].
pub struct MlpUnit<D: Device> {
    /// `[F, C]`.
    pub fc_in: Linear<D>,
    /// `[C, F]`.
    pub fc_out: Linear<D>,
    /// Norm, output dropout and skip connection.
    pub residual: Residual<D>,
    /// GELU form.
    pub act: Activation,
}

/// What the MLP branch keeps for its backward.
pub struct MlpBranchSaved<D: Device> {
    pre_act: D::Buf,
    act: D::Buf,
}

impl<D: Device> MlpBranchSaved<D> {
    /// Elements held.
    pub fn elements(&self) -> usize {
        D::len(&self.pre_act) + D::len(&self.act)
    }
}

/// Activations an MLP unit keeps for its backward.
pub type MlpSaved<D> = (ResidualSaved<D>, MlpBranchSaved<D>);

impl<D: Device> MlpUnit<D> {
    /// A unit with N(0, 0.02²) weights (`fc_out` scaled by `out_std_scale`), zero biases.
    pub fn new(
        dev: &D,
        init: &mut Init,
        names: &MlpNames,
        spec: &Spec,
        out_std_scale: f64,
        dropout: DropoutSite,
    ) -> Result<Self> {
        Ok(Self {
            fc_in: Linear::new(dev, init, &names.fc_in, spec.hidden, spec.mlp_hidden, INIT_STD)?,
            fc_out: Linear::new(dev, init, &names.fc_out, spec.mlp_hidden, spec.hidden, INIT_STD * out_std_scale)?,
            residual: Residual {
                norm: LayerNorm::new(dev, &names.norm, spec.hidden, spec.eps)?,
                placement: spec.norm,
                dropout,
            },
            act: spec.act,
        })
    }

    /// `[B, T, C] → [B, T, C]`; in a training pass (`train`: dropout on, activations kept for the backward).
    pub fn forward(&self, dev: &D, batch: &Batch<D>, x: D::Buf, train: bool) -> Result<(D::Buf, Option<MlpSaved<D>>)> {
        let rows = batch.rows();
        self.residual.forward(dev, batch, x, train, |inp| {
            let pre_act = self.fc_in.forward(dev, inp, rows)?;
            let mut act = dev.alloc(D::len(&pre_act))?;
            dev.gelu_forward(&mut act, &pre_act, self.act)?;
            let z = self.fc_out.forward(dev, &act, rows)?;
            Ok((z, MlpBranchSaved { pre_act, act }))
        })
    }

    /// The forward chain reversed. Returns `dx` when `need_dinp`.
    pub fn backward(
        &mut self,
        dev: &D,
        batch: &Batch<D>,
        (residual, s): MlpSaved<D>,
        dy: &D::Buf,
        need_dinp: bool,
    ) -> Result<Option<D::Buf>> {
        let rows = batch.rows();
        let (fc_in, fc_out, kind) = (&mut self.fc_in, &mut self.fc_out, self.act);
        let MlpBranchSaved { pre_act, act } = s;
        self.residual.backward(dev, batch, residual, dy, need_dinp, |dz, inp, need_dinp| {
            // z = act · W_outᵀ
            let dact = fc_out
                .backward(dev, Held::Lent(dz), Held::Given(act), rows, true)?
                .ok_or_else(|| missing_saved("dact"))?;
            // act = gelu(pre_act)
            let mut dpre = dev.alloc(D::len(&dact))?;
            dev.gelu_backward(&mut dpre, &pre_act, &dact, kind)?;
            // pre_act = inp · W_inᵀ
            fc_in.backward(dev, Held::Given(dpre), Held::Lent(inp), rows, need_dinp)
        })
    }

    /// The unit's parameters, in Hugging Face order.
    pub fn params_mut(&mut self) -> Vec<&mut Param<D>> {
        let mut v = self.fc_in.params_mut();
        v.extend(self.fc_out.params_mut());
        v.extend(self.residual.norm.params_mut());
        v
    }
}
