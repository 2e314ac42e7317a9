//! The embedding unit: token + position (+ token-type) embeddings with BERT's LayerNorm, or
//! ViT's patch projection + class token + positions; then dropout.

use super::batch::{Batch, DropoutLayout};
use super::dropout::DropoutSite;
use super::init::Init;
use super::layers::{Held, INIT_STD, LayerNorm, LayerNormSaved, Linear, len_of};
use super::param::Param;
use crate::device::Device;
use crate::error::{Error, Result, data_error};
use crate::ops::patch::PatchDims;

/// How the embedding unit turns inputs into hidden states.
pub enum EmbeddingKind<D: Device> {
    /// `word[id] + position[pos] (+ token_type[type])`, then an optional LayerNorm.
    Tokens {
        /// `[vocab, C]`.
        word: Param<D>,
        /// `[max_positions, C]`.
        position: Param<D>,
        /// `[type_vocab, C]` (BERT).
        token_type: Option<Param<D>>,
        /// BERT's `embeddings.LayerNorm`.
        norm: Option<LayerNorm<D>>,
    },
    /// `[cls; patches·Wᵀ + b] + position`.
    Patches {
        /// Conv-as-linear projection, weight stored as `[C, ch, p, p]`.
        projection: Linear<D>,
        /// Class token `[1, 1, C]`.
        cls: Param<D>,
        /// Positions `[1, patches + 1, C]`.
        position: Param<D>,
        /// Channels, image side, patch side.
        channels: usize,
        /// Image side in pixels.
        image_size: usize,
        /// Patch side in pixels.
        patch: usize,
    },
}

/// The first unit of every model.
pub struct EmbeddingUnit<D: Device> {
    /// The embedding tables.
    pub kind: EmbeddingKind<D>,
    /// Hidden width.
    pub dim: usize,
    /// Dropout on the output.
    pub dropout: DropoutSite,
}

/// What the embedding forward keeps for its backward.
pub struct EmbeddingSaved<D: Device> {
    /// Sum of the embeddings (LayerNorm input), text models with a norm.
    pre_norm: Option<(D::Buf, LayerNormSaved<D>)>,
    /// Extracted patches `[B·N, ch·p·p]`, image models.
    patches: Option<D::Buf>,
}

impl<D: Device> EmbeddingSaved<D> {
    /// Elements held.
    pub fn elements(&self) -> usize {
        self.pre_norm.as_ref().map_or(0, |(x, s)| D::len(x) + s.elements()) + len_of::<D>(self.patches.as_ref())
    }
}

impl<D: Device> EmbeddingUnit<D> {
    /// Token embeddings named `{prefix}word_embeddings.weight` etc. (BERT naming) or
    /// `word_name`/`position_name` directly (GPT naming).
    #[allow(clippy::too_many_arguments)]
    pub fn tokens(
        dev: &D,
        init: &mut Init,
        names: [&str; 4],
        vocab: usize,
        max_positions: usize,
        type_vocab: Option<usize>,
        dim: usize,
        norm_eps: Option<f64>,
        dropout: DropoutSite,
    ) -> Result<Self> {
        let [word_name, position_name, type_name, norm_name] = names;
        let word = Param::new(dev, word_name, &[vocab, dim], &init.normal(word_name, vocab * dim, INIT_STD), true)?;
        let position = Param::new(
            dev,
            position_name,
            &[max_positions, dim],
            &init.normal(position_name, max_positions * dim, INIT_STD),
            true,
        )?;
        let token_type = match type_vocab {
            Some(tv) => {
                Some(Param::new(dev, type_name, &[tv, dim], &init.normal(type_name, tv * dim, INIT_STD), true)?)
            }
            None => None,
        };
        let norm = match norm_eps {
            Some(eps) => Some(LayerNorm::new(dev, norm_name, dim, eps)?),
            None => None,
        };
        Ok(Self { kind: EmbeddingKind::Tokens { word, position, token_type, norm }, dim, dropout })
    }

    /// ViT patch embeddings with Hugging Face names under `vit.embeddings.`.
    pub fn patches(
        dev: &D,
        init: &mut Init,
        channels: usize,
        image_size: usize,
        patch: usize,
        dim: usize,
        dropout: DropoutSite,
    ) -> Result<Self> {
        let n = (image_size / patch).pow(2);
        let projection = Linear::with_shape(
            dev,
            init,
            "vit.embeddings.patch_embeddings.projection",
            channels * patch * patch,
            dim,
            INIT_STD,
            &[dim, channels, patch, patch],
        )?;
        let cls_name = "vit.embeddings.cls_token";
        let cls = Param::new(dev, cls_name, &[1, 1, dim], &init.normal(cls_name, dim, INIT_STD), true)?;
        let position_name = "vit.embeddings.position_embeddings";
        let position = Param::new(
            dev,
            position_name,
            &[1, n + 1, dim],
            &init.normal(position_name, (n + 1) * dim, INIT_STD),
            true,
        )?;
        Ok(Self {
            kind: EmbeddingKind::Patches { projection, cls, position, channels, image_size, patch },
            dim,
            dropout,
        })
    }

    /// Embeds the batch's inputs into `[B, T, C]` hidden states.
    pub fn forward(&self, dev: &D, batch: &Batch<D>, train: bool) -> Result<(D::Buf, Option<EmbeddingSaved<D>>)> {
        let rows = batch.rows();
        let c = self.dim;
        let (e, saved) = match &self.kind {
            EmbeddingKind::Tokens { word, position, token_type, norm } => {
                let tokens = batch.tokens.as_ref().ok_or_else(|| data_error("tokens", "missing for a text model"))?;
                let mut e = dev.alloc(rows * c)?;
                dev.embedding_forward(&mut e, tokens, &word.value, c, false)?;
                dev.embedding_forward(&mut e, &batch.positions, &position.value, c, true)?;
                if let (Some(tt), Some(types)) = (token_type, &batch.token_types) {
                    dev.embedding_forward(&mut e, types, &tt.value, c, true)?;
                }
                match norm {
                    Some(norm) => {
                        let (y, stats) = norm.forward(dev, &e, rows)?;
                        (y, train.then_some(EmbeddingSaved { pre_norm: Some((e, stats)), patches: None }))
                    }
                    None => (e, train.then_some(EmbeddingSaved { pre_norm: None, patches: None })),
                }
            }
            EmbeddingKind::Patches { projection, cls, position, channels, image_size, patch } => {
                let pixels = batch.pixels.as_ref().ok_or_else(|| data_error("pixels", "missing for an image model"))?;
                let d = PatchDims {
                    batch: batch.batch,
                    channels: *channels,
                    height: *image_size,
                    width: *image_size,
                    patch: *patch,
                };
                let n = d.num_patches();
                let mut patches = dev.alloc(batch.batch * n * d.patch_len())?;
                dev.patch_forward(&mut patches, pixels, d)?;
                let projected = projection.forward(dev, &patches, batch.batch * n)?;
                let mut e = dev.alloc(rows * c)?;
                dev.prepend_token_forward(&mut e, &cls.value, &projected, batch.batch, n, c)?;
                dev.embedding_forward(&mut e, &batch.positions, &position.value, c, true)?;
                (e, train.then_some(EmbeddingSaved { pre_norm: None, patches: Some(patches) }))
            }
        };
        Ok((self.dropout.forward(dev, batch, e, DropoutLayout::Tokens(c), train)?, saved))
    }

    /// Accumulates the tables' gradients (there is no input gradient).
    pub fn backward(&mut self, dev: &D, batch: &Batch<D>, saved: EmbeddingSaved<D>, dy: &D::Buf) -> Result<()> {
        let rows = batch.rows();
        let c = self.dim;
        let dropped = self.dropout.backward(dev, batch, dy, DropoutLayout::Tokens(c))?;
        let dy = dropped.as_ref().unwrap_or(dy);
        match &mut self.kind {
            EmbeddingKind::Tokens { word, position, token_type, norm } => {
                let normed;
                let de = match (norm, &saved.pre_norm) {
                    (Some(norm), Some((e, stats))) => {
                        normed = norm.backward(dev, dy, e, stats, rows)?;
                        &normed
                    }
                    _ => dy,
                };
                let tokens = batch.tokens.as_ref().ok_or_else(|| data_error("tokens", "missing for a text model"))?;
                dev.embedding_backward(grad_of(word)?, tokens, de, c)?;
                dev.embedding_backward(grad_of(position)?, &batch.positions, de, c)?;
                if let (Some(tt), Some(types)) = (token_type, &batch.token_types) {
                    dev.embedding_backward(grad_of(tt)?, types, de, c)?;
                }
            }
            EmbeddingKind::Patches { projection, cls, position, .. } => {
                let n = batch.seq - 1;
                let patches = saved.patches.as_ref().ok_or_else(|| missing_saved("patches"))?;
                dev.embedding_backward(grad_of(position)?, &batch.positions, dy, c)?;
                let mut dprojected = dev.alloc(batch.batch * n * c)?;
                dev.prepend_token_backward(grad_of(cls)?, Some(&mut dprojected), dy, batch.batch, n, c)?;
                projection.backward(dev, Held::Given(dprojected), Held::Lent(patches), batch.batch * n, false)?;
            }
        }
        Ok(())
    }

    /// The unit's parameters, in Hugging Face order.
    pub fn params_mut(&mut self) -> Vec<&mut Param<D>> {
        match &mut self.kind {
            EmbeddingKind::Tokens { word, position, token_type, norm } => {
                let mut v = vec![word, position];
                v.extend(token_type.as_mut());
                if let Some(n) = norm {
                    v.extend(n.params_mut());
                }
                v
            }
            EmbeddingKind::Patches { projection, cls, position, .. } => {
                let mut v = vec![cls, position];
                v.extend(projection.params_mut());
                v
            }
        }
    }
}

/// The gradient buffer of a trainable parameter (an error for a frozen one).
pub(crate) fn grad_of<D: Device>(p: &mut Param<D>) -> Result<&mut D::Buf> {
    let name = p.name.clone();
    p.grad.as_mut().ok_or(Error::Internal { what: name, message: "backward through a frozen parameter".into() })
}

/// The error for a backward that finds no saved activation (forward ran without saving).
pub(crate) fn missing_saved(what: &str) -> Error {
    Error::Internal { what: what.into(), message: "no saved activation: the forward ran in eval mode or frozen".into() }
}
