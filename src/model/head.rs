//! The units after the last block: the final LayerNorm of pre-LN models, and the head
//! (a pooled classifier, or the LM head tied to the token embedding).

use super::batch::{Batch, DropoutLayout};
use super::config::Pooling;
use super::dropout::DropoutSite;
use super::embedding::missing_saved;
use super::layers::{Held, LayerNorm, LayerNormSaved, Linear, clone_buf, len_of};
use super::param::Param;
use crate::device::Device;
use crate::error::Result;

/// The final LayerNorm of a pre-LN model (`ln_f`, ViT's `vit.layernorm`).
pub struct FinalNormUnit<D: Device> {
    /// The norm.
    pub norm: LayerNorm<D>,
}

/// What the final norm keeps for its backward.
pub struct FinalNormSaved<D: Device> {
    x: D::Buf,
    stats: LayerNormSaved<D>,
}

impl<D: Device> FinalNormSaved<D> {
    /// Elements held.
    pub fn elements(&self) -> usize {
        D::len(&self.x) + self.stats.elements()
    }
}

impl<D: Device> FinalNormUnit<D> {
    /// `y = LN(x)`.
    pub fn forward(
        &self,
        dev: &D,
        batch: &Batch<D>,
        x: D::Buf,
        train: bool,
    ) -> Result<(D::Buf, Option<FinalNormSaved<D>>)> {
        let (y, stats) = self.norm.forward(dev, &x, batch.rows())?;
        Ok((y, train.then_some(FinalNormSaved { x, stats })))
    }
    /// `dx = LN'(dy)`.
    pub fn backward(&mut self, dev: &D, batch: &Batch<D>, s: FinalNormSaved<D>, dy: &D::Buf) -> Result<D::Buf> {
        self.norm.backward(dev, dy, &s.x, &s.stats, batch.rows())
    }
}

/// What the head computes.
pub enum HeadKind<D: Device> {
    /// Pool → (dense → tanh) → dropout → classifier.
    Classifier {
        /// How the sequence is pooled.
        pooling: Pooling,
        /// BERT's `pooler.dense` (with [`Pooling::ClsPooler`]).
        pooler: Option<Linear<D>>,
        /// `classifier` `[num_labels, C]`.
        classifier: Linear<D>,
        /// Dropout before the classifier.
        dropout: DropoutSite,
    },
    /// `logits = h · Eᵀ` with `E` a copy of the token embedding kept equal to it by the model
    /// (gradients summed, identical updates), so the two may live on different pipeline stages.
    TiedLm {
        /// `lm_head.weight` `[vocab, C]`, no bias.
        lm_head: Linear<D>,
    },
}

/// The last unit: hidden states to logits.
pub struct HeadUnit<D: Device> {
    /// The head.
    pub kind: HeadKind<D>,
    /// Hidden width.
    pub dim: usize,
}

/// What the head keeps for its backward.
pub struct HeadSaved<D: Device> {
    /// Classifier: the pooled vector; LM: the hidden states.
    x: D::Buf,
    /// The pooler's tanh output.
    pooled_tanh: Option<D::Buf>,
    /// The classifier's input (after dropout).
    classifier_in: Option<D::Buf>,
}

impl<D: Device> HeadSaved<D> {
    /// Elements held.
    pub fn elements(&self) -> usize {
        D::len(&self.x) + len_of::<D>(self.pooled_tanh.as_ref()) + len_of::<D>(self.classifier_in.as_ref())
    }
}

impl<D: Device> HeadUnit<D> {
    /// What [`forward`](Self::forward) saves, where its logits are not needed (a stage that
    /// recomputes its activations gets them back for the backward): the LM head saves its
    /// input alone, so its vocabulary projection is skipped; a classifier runs its forward.
    pub fn saved_again(&self, dev: &D, batch: &Batch<D>, x: D::Buf, train: bool) -> Result<Option<HeadSaved<D>>> {
        match &self.kind {
            HeadKind::TiedLm { .. } => Ok(train.then_some(HeadSaved { x, pooled_tanh: None, classifier_in: None })),
            HeadKind::Classifier { .. } => Ok(self.forward(dev, batch, x, train)?.1),
        }
    }

    /// Logits: `[B, num_labels]` for a classifier, `[B·T, vocab]` for the LM head.
    pub fn forward(&self, dev: &D, batch: &Batch<D>, x: D::Buf, train: bool) -> Result<(D::Buf, Option<HeadSaved<D>>)> {
        let (b, t, c) = (batch.batch, batch.seq, self.dim);
        match &self.kind {
            HeadKind::Classifier { pooling, pooler, classifier, dropout } => {
                let mut pooled = dev.alloc(b * c)?;
                match pooling {
                    Pooling::Mean => dev.mean_pool_forward(&mut pooled, &x, batch.attention_mask.as_ref(), b, t, c)?,
                    Pooling::Cls | Pooling::ClsPooler => dev.first_token_pool_forward(&mut pooled, &x, b, t, c)?,
                }
                let pooled_tanh = match pooler {
                    Some(p) => {
                        let z = p.forward(dev, &pooled, b)?;
                        let mut tz = dev.alloc(b * c)?;
                        dev.tanh_forward(&mut tz, &z)?;
                        Some(tz)
                    }
                    None => None,
                };
                // The classifier's input is kept apart from what the backward of tanh/pooling needs.
                let features = dropout.forward(
                    dev,
                    batch,
                    clone_buf(dev, pooled_tanh.as_ref().unwrap_or(&pooled))?,
                    DropoutLayout::Samples(c),
                    train,
                )?;
                let logits = classifier.forward(dev, &features, b)?;
                Ok((logits, train.then_some(HeadSaved { x: pooled, pooled_tanh, classifier_in: Some(features) })))
            }
            HeadKind::TiedLm { lm_head } => {
                let logits = lm_head.forward(dev, &x, b * t)?;
                Ok((logits, train.then_some(HeadSaved { x, pooled_tanh: None, classifier_in: None })))
            }
        }
    }

    /// Accumulates the head's gradients; returns `dx` (`[B, T, C]`) when `need_dinp`.
    pub fn backward(
        &mut self,
        dev: &D,
        batch: &Batch<D>,
        s: HeadSaved<D>,
        dlogits: D::Buf,
        need_dinp: bool,
    ) -> Result<Option<D::Buf>> {
        let (b, t, c) = (batch.batch, batch.seq, self.dim);
        match &mut self.kind {
            HeadKind::Classifier { pooling, pooler, classifier, dropout } => {
                let features = s.classifier_in.as_ref().ok_or_else(|| missing_saved("classifier input"))?;
                let need_features_grad = need_dinp || pooler.is_some();
                let Some(dfeatures) =
                    classifier.backward(dev, Held::Given(dlogits), Held::Lent(features), b, need_features_grad)?
                else {
                    return Ok(None);
                };
                let dropped = dropout.backward(dev, batch, &dfeatures, DropoutLayout::Samples(c))?;
                let dfeatures = dropped.unwrap_or(dfeatures);
                let dpooled = match (pooler, &s.pooled_tanh) {
                    (Some(p), Some(tz)) => {
                        let mut dz = dev.alloc(b * c)?;
                        dev.tanh_backward(&mut dz, tz, &dfeatures)?;
                        p.backward(dev, Held::Given(dz), Held::Lent(&s.x), b, need_dinp)?
                    }
                    _ => Some(dfeatures),
                };
                let Some(dpooled) = dpooled.filter(|_| need_dinp) else { return Ok(None) };
                let mut dx = dev.alloc(b * t * c)?;
                match pooling {
                    Pooling::Mean => {
                        dev.mean_pool_backward(&mut dx, &dpooled, batch.attention_mask.as_ref(), b, t, c)?
                    }
                    Pooling::Cls | Pooling::ClsPooler => dev.first_token_pool_backward(&mut dx, &dpooled, b, t, c)?,
                }
                Ok(Some(dx))
            }
            HeadKind::TiedLm { lm_head } => {
                lm_head.backward(dev, Held::Given(dlogits), Held::Lent(&s.x), b * t, need_dinp)
            }
        }
    }

    /// Output classes (labels or vocabulary).
    pub fn classes(&self) -> usize {
        match &self.kind {
            HeadKind::Classifier { classifier, .. } => classifier.out_dim,
            HeadKind::TiedLm { lm_head } => lm_head.out_dim,
        }
    }

    /// The unit's parameters.
    pub fn params_mut(&mut self) -> Vec<&mut Param<D>> {
        match &mut self.kind {
            HeadKind::Classifier { pooler, classifier, .. } => {
                let mut v = Vec::new();
                if let Some(p) = pooler {
                    v.extend(p.params_mut());
                }
                v.extend(classifier.params_mut());
                v
            }
            HeadKind::TiedLm { lm_head } => lm_head.params_mut(),
        }
    }
}
