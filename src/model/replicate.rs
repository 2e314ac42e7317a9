//! Copies of units on another device: what a pipeline does when a re-plan gives a unit a new
//! owner, or adds a data-parallel replica. Values and gradients travel through the host in
//! f64, so a copy is exact on every backend; structure and settings are copied as they are.

use super::block::{AttentionUnit, MlpUnit, Residual};
use super::embedding::{EmbeddingKind, EmbeddingUnit};
use super::head::{FinalNormUnit, HeadKind, HeadUnit};
use super::layers::{LayerNorm, Linear};
use super::param::Param;
use super::unit::Unit;
use crate::device::Device;
use crate::error::Result;

/// A copy of `self` whose buffers live on `to` (`self`'s live on `from`).
pub trait Replicate<D: Device>: Sized {
    /// See the trait.
    fn replicate(&self, from: &D, to: &D) -> Result<Self>;
}

impl<D: Device, T: Replicate<D>> Replicate<D> for Option<T> {
    fn replicate(&self, from: &D, to: &D) -> Result<Self> {
        self.as_ref().map(|x| x.replicate(from, to)).transpose()
    }
}

fn copy_buf<D: Device>(buf: &D::Buf, from: &D, to: &D) -> Result<D::Buf> {
    to.upload_f64(&from.download_f64(buf)?)
}

impl<D: Device> Replicate<D> for Param<D> {
    fn replicate(&self, from: &D, to: &D) -> Result<Self> {
        Ok(Param {
            name: self.name.clone(),
            shape: self.shape.clone(),
            value: copy_buf(&self.value, from, to)?,
            grad: self.grad.as_ref().map(|g| copy_buf(g, from, to)).transpose()?,
            decay: self.decay,
        })
    }
}

impl<D: Device> Replicate<D> for Linear<D> {
    fn replicate(&self, from: &D, to: &D) -> Result<Self> {
        Ok(Linear {
            weight: self.weight.replicate(from, to)?,
            bias: self.bias.replicate(from, to)?,
            in_dim: self.in_dim,
            out_dim: self.out_dim,
            deferred: None,
        })
    }
}

impl<D: Device> Replicate<D> for LayerNorm<D> {
    fn replicate(&self, from: &D, to: &D) -> Result<Self> {
        Ok(LayerNorm {
            weight: self.weight.replicate(from, to)?,
            bias: self.bias.replicate(from, to)?,
            dim: self.dim,
            eps: self.eps,
        })
    }
}

impl<D: Device> Replicate<D> for Residual<D> {
    fn replicate(&self, from: &D, to: &D) -> Result<Self> {
        Ok(Residual { norm: self.norm.replicate(from, to)?, placement: self.placement, dropout: self.dropout })
    }
}

impl<D: Device> Replicate<D> for Unit<D> {
    fn replicate(&self, from: &D, to: &D) -> Result<Self> {
        Ok(match self {
            Unit::Embedding(u) => Unit::Embedding(EmbeddingUnit {
                kind: match &u.kind {
                    EmbeddingKind::Tokens { word, position, token_type, norm } => EmbeddingKind::Tokens {
                        word: word.replicate(from, to)?,
                        position: position.replicate(from, to)?,
                        token_type: token_type.replicate(from, to)?,
                        norm: norm.replicate(from, to)?,
                    },
                    EmbeddingKind::Patches { projection, cls, position, channels, image_size, patch } => {
                        EmbeddingKind::Patches {
                            projection: projection.replicate(from, to)?,
                            cls: cls.replicate(from, to)?,
                            position: position.replicate(from, to)?,
                            channels: *channels,
                            image_size: *image_size,
                            patch: *patch,
                        }
                    }
                },
                dim: u.dim,
                dropout: u.dropout,
            }),
            Unit::Attention(u) => Unit::Attention(AttentionUnit {
                query: u.query.replicate(from, to)?,
                key: u.key.replicate(from, to)?,
                value: u.value.replicate(from, to)?,
                output: u.output.replicate(from, to)?,
                residual: u.residual.replicate(from, to)?,
                heads: u.heads,
                causal: u.causal,
                attn_dropout: u.attn_dropout,
            }),
            Unit::Mlp(u) => Unit::Mlp(MlpUnit {
                fc_in: u.fc_in.replicate(from, to)?,
                fc_out: u.fc_out.replicate(from, to)?,
                residual: u.residual.replicate(from, to)?,
                act: u.act,
            }),
            Unit::FinalNorm(u) => Unit::FinalNorm(FinalNormUnit { norm: u.norm.replicate(from, to)? }),
            Unit::Head(u) => Unit::Head(HeadUnit {
                kind: match &u.kind {
                    HeadKind::Classifier { pooling, pooler, classifier, dropout } => HeadKind::Classifier {
                        pooling: *pooling,
                        pooler: pooler.replicate(from, to)?,
                        classifier: classifier.replicate(from, to)?,
                        dropout: *dropout,
                    },
                    HeadKind::TiedLm { lm_head } => HeadKind::TiedLm { lm_head: lm_head.replicate(from, to)? },
                },
                dim: u.dim,
            }),
        })
    }
}

impl<D: Device> super::Model<D> {
    /// A copy of the whole model on `to` (this one lives on `from`).
    pub fn replicate_to(&self, from: &D, to: &D) -> Result<Self> {
        let units = self.units().iter().map(|u| u.replicate(from, to)).collect::<Result<_>>()?;
        let parts = super::ModelParts { spec: self.spec().clone(), units, tied: self.tied().cloned() };
        super::Model::from_parts(parts)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::CpuDevice;
    use crate::model::{BertConfig, Model, ModelConfig, Pooling};

    #[test]
    fn a_replicated_unit_has_the_same_parameters_on_the_other_device() {
        let (a, b) = (CpuDevice::<f64>::new(0, 1).unwrap(), CpuDevice::<f64>::new(1, 1).unwrap());
        let config = ModelConfig::Bert(BertConfig {
            vocab_size: 11,
            hidden_size: 8,
            num_hidden_layers: 1,
            num_attention_heads: 2,
            intermediate_size: 12,
            hidden_act: "gelu".into(),
            max_position_embeddings: 6,
            type_vocab_size: 2,
            layer_norm_eps: 1e-12,
            hidden_dropout_prob: 0.1,
            attention_probs_dropout_prob: 0.1,
            num_labels: 3,
            pooling: Pooling::ClsPooler,
        });
        let model = Model::new(&a, &config, 5).unwrap();
        for unit in model.units() {
            let copy = unit.replicate(&a, &b).unwrap();
            let (p, q) = (unit.params(), copy.params());
            assert_eq!(p.len(), q.len());
            for (p, q) in p.iter().zip(&q) {
                assert_eq!(p.name, q.name);
                assert_eq!(a.download_f64(&p.value).unwrap(), b.download_f64(&q.value).unwrap());
                assert_eq!(p.grad.is_some(), q.grad.is_some());
            }
        }
    }
}
