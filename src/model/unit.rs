//! `Unit`: the partition granularity of the pipeline. A model is an ordered list of units; each
//! owns its parameters, runs `forward` (saving what its backward needs, unless frozen or in
//! eval) and `backward` (accumulating parameter gradients, returning the input gradient), and
//! reports its costs for the planner.

use super::batch::Batch;
use super::block::{AttentionSaved, AttentionUnit, MlpSaved, MlpUnit};
use super::embedding::{EmbeddingKind, EmbeddingSaved, EmbeddingUnit};
use super::head::{FinalNormSaved, FinalNormUnit, HeadKind, HeadSaved, HeadUnit};
use super::kv_arena::KvArena;
use super::layers::{Linear, held_elements};
use super::param::Param;
use crate::device::Device;
use crate::error::{Error, Result};

/// One unit of a model. (Variants differ in size, but a model holds a dozen units and they
/// are never moved in a hot loop, so boxing would only add indirection.)
#[allow(clippy::large_enum_variant)]
pub enum Unit<D: Device> {
    /// Inputs → hidden states.
    Embedding(EmbeddingUnit<D>),
    /// Self-attention with residual (and LayerNorm).
    Attention(AttentionUnit<D>),
    /// MLP with residual (and LayerNorm).
    Mlp(MlpUnit<D>),
    /// Final LayerNorm (pre-LN models).
    FinalNorm(FinalNormUnit<D>),
    /// Hidden states → logits.
    Head(HeadUnit<D>),
}

/// What a unit's forward kept for its backward. `None` for frozen units and eval.
pub enum Saved<D: Device> {
    /// Nothing was saved.
    None,
    /// See [`EmbeddingUnit`].
    Embedding(EmbeddingSaved<D>),
    /// See [`AttentionUnit`].
    Attention(AttentionSaved<D>),
    /// See [`MlpUnit`].
    Mlp(MlpSaved<D>),
    /// See [`FinalNormUnit`].
    FinalNorm(FinalNormSaved<D>),
    /// See [`HeadUnit`].
    Head(HeadSaved<D>),
}

impl<D: Device> Saved<D> {
    /// Elements of activations held for the backward (what a pipeline stage's memory holds per
    /// piece in flight).
    pub fn elements(&self) -> usize {
        match self {
            Saved::None => 0,
            Saved::Embedding(s) => s.elements(),
            Saved::Attention((r, b)) => r.elements() + b.elements(),
            Saved::Mlp((r, b)) => r.elements() + b.elements(),
            Saved::FinalNorm(s) => s.elements(),
            Saved::Head(s) => s.elements(),
        }
    }
}

/// A unit's size and cost per sample, at a given sequence length: what the partitioner and
/// the memory model of the pipeline planner consume.
#[derive(Clone, Copy, Debug, Default, PartialEq, serde::Serialize)]
pub struct UnitCost {
    /// Parameters (elements).
    pub params: usize,
    /// Forward FLOPs per sample (multiply-add = 2).
    pub forward_flops: f64,
    /// Backward FLOPs per sample (input and weight gradients).
    pub backward_flops: f64,
    /// Bytes of activations the forward keeps for the backward, per sample.
    pub activation_bytes: usize,
    /// Of those, the attention probabilities (`heads × seq × seq`): the part token slicing
    /// shrinks (TeraPipe keeps `l × (c + l)` per slice).
    pub score_bytes: usize,
    /// What token slicing adds: the keys' and values' gradients, which the stage's key/value
    /// arena sums ([`kv_arena::grad_elem_bytes`](super::kv_arena::grad_elem_bytes) each: at
    /// bf16 twice the keys and values themselves).
    pub kv_grad_bytes: usize,
    /// The keys and values themselves, which a sliced attention unit keeps in its arena for
    /// the later slices: among the activations a trained unit keeps, and all a frozen one
    /// keeps.
    pub kv_bytes: usize,
    /// The hidden states the unit reads, per sample: what a pipeline stage that recomputes
    /// activations keeps of a micro-batch when this is the first unit it recomputes (none for
    /// the embeddings, which read the batch itself).
    pub input_bytes: usize,
    /// Of the activations, the loss's gradient with respect to the head's logits, which the
    /// last stage holds from the forward (where the loss is taken) to the backward: held for
    /// each micro-batch in flight even where the head recomputes.
    pub loss_grad_bytes: usize,
    /// Bytes the device keeps beside the linear layers' weights for its products (not per
    /// sample; [`crate::device::Device::weight_pack_bytes`]), as when the unit trains above
    /// trainable units: for a frozen unit, or the first trainable one above frozen units (whose
    /// input gradient is not computed), an upper bound.
    pub weight_pack_bytes: usize,
}

fn wrap<S, D: Device>(r: (D::Buf, Option<S>), f: impl FnOnce(S) -> Saved<D>) -> (D::Buf, Saved<D>) {
    (r.0, r.1.map_or(Saved::None, f))
}

/// A unit's linear layers, in the order of its parameters, borrowed by `$borrow` (`&` or
/// `&mut`; `$iter` iterates an `Option` so): written once for both.
macro_rules! linears_of {
    ($unit:expr, $iter:ident, $($borrow:tt)+) => {
        match $unit {
            Unit::Embedding(u) => match $($borrow)+ u.kind {
                EmbeddingKind::Tokens { .. } => Vec::new(),
                EmbeddingKind::Patches { projection, .. } => vec![projection],
            },
            Unit::Attention(u) => vec![$($borrow)+ u.query, $($borrow)+ u.key, $($borrow)+ u.value, $($borrow)+ u.output],
            Unit::Mlp(u) => vec![$($borrow)+ u.fc_in, $($borrow)+ u.fc_out],
            Unit::FinalNorm(_) => Vec::new(),
            Unit::Head(u) => match $($borrow)+ u.kind {
                HeadKind::Classifier { pooler, classifier, .. } => pooler.$iter().chain([classifier]).collect(),
                HeadKind::TiedLm { lm_head } => vec![lm_head],
            },
        }
    };
}

impl<D: Device> Unit<D> {
    /// A short name for logs and plans, e.g. `embeddings`, `attention`, `mlp`, `head`.
    pub fn kind_name(&self) -> &'static str {
        match self {
            Unit::Embedding(_) => "embeddings",
            Unit::Attention(_) => "attention",
            Unit::Mlp(_) => "mlp",
            Unit::FinalNorm(_) => "final_norm",
            Unit::Head(_) => "head",
        }
    }

    /// Runs the unit. `x` is `None` for the embedding unit and the previous unit's output for
    /// the others. A training pass (`train`: the model asks for one above the frozen prefix)
    /// applies dropout and keeps activations for the backward; otherwise the unit runs forward
    /// only and deterministically. A token slice (TeraPipe) passes its attention unit's
    /// key/value `arena` (the other units work token by token and need none).
    pub fn forward(
        &self,
        dev: &D,
        batch: &Batch<D>,
        x: Option<D::Buf>,
        train: bool,
        arena: Option<&mut KvArena<D>>,
    ) -> Result<(D::Buf, Saved<D>)> {
        Ok(match self {
            Unit::Embedding(u) => wrap(u.forward(dev, batch, train)?, Saved::Embedding),
            Unit::Attention(u) => wrap(u.forward(dev, batch, self.input(x)?, train, arena)?, Saved::Attention),
            Unit::Mlp(u) => wrap(u.forward(dev, batch, self.input(x)?, train)?, Saved::Mlp),
            Unit::FinalNorm(u) => wrap(u.forward(dev, batch, self.input(x)?, train)?, Saved::FinalNorm),
            Unit::Head(u) => wrap(u.forward(dev, batch, self.input(x)?, train)?, Saved::Head),
        })
    }

    /// The input hidden states every unit but the embeddings reads.
    fn input(&self, x: Option<D::Buf>) -> Result<D::Buf> {
        x.ok_or_else(|| Error::Internal { what: self.kind_name().into(), message: "no input hidden states".into() })
    }

    /// What [`forward`](Self::forward) saves, where its output is not needed: the last unit a
    /// pipeline stage recomputes (the LM head then skips its vocabulary
    /// projection, which its backward does not read).
    pub fn saved_again(
        &self,
        dev: &D,
        batch: &Batch<D>,
        x: Option<D::Buf>,
        train: bool,
        arena: Option<&mut KvArena<D>>,
    ) -> Result<Saved<D>> {
        match self {
            Unit::Head(u) => Ok(u.saved_again(dev, batch, self.input(x)?, train)?.map_or(Saved::None, Saved::Head)),
            _ => Ok(self.forward(dev, batch, x, train, arena)?.1),
        }
    }

    /// Backward of one unit: accumulates its parameter gradients and returns the gradient of
    /// its input when `need_dinp` (the unit below is trainable). A token slice passes the arena
    /// its forward wrote, as in [`forward`](Self::forward). `dy` is given, not lent: the head
    /// keeps it when its weight gradient is put off (zero bubble) instead of copying it.
    pub fn backward(
        &mut self,
        dev: &D,
        batch: &Batch<D>,
        saved: Saved<D>,
        dy: D::Buf,
        need_dinp: bool,
        arena: Option<&mut KvArena<D>>,
    ) -> Result<Option<D::Buf>> {
        let name = self.kind_name();
        let mismatch = || Error::Internal {
            what: name.into(),
            message: "saved activations missing or of another unit (was the forward run in eval mode or frozen?)"
                .into(),
        };
        match (self, saved) {
            (Unit::Embedding(u), Saved::Embedding(s)) => u.backward(dev, batch, s, &dy).map(|_| None),
            (Unit::Attention(u), Saved::Attention(s)) => u.backward(dev, batch, s, &dy, need_dinp, arena),
            (Unit::Mlp(u), Saved::Mlp(s)) => u.backward(dev, batch, s, &dy, need_dinp),
            (Unit::FinalNorm(u), Saved::FinalNorm(s)) => u.backward(dev, batch, s, &dy).map(Some),
            (Unit::Head(u), Saved::Head(s)) => u.backward(dev, batch, s, dy, need_dinp),
            _ => Err(mismatch()),
        }
    }

    /// The unit's parameters.
    pub fn params_mut(&mut self) -> Vec<&mut Param<D>> {
        match self {
            Unit::Embedding(u) => u.params_mut(),
            Unit::Attention(u) => u.params_mut(),
            Unit::Mlp(u) => u.params_mut(),
            Unit::FinalNorm(u) => u.norm.params_mut(),
            Unit::Head(u) => u.params_mut(),
        }
    }

    /// The unit's linear layers, in the order of its parameters.
    fn linears(&self) -> Vec<&Linear<D>> {
        linears_of!(self, iter, &)
    }

    /// [`linears`](Self::linears), to change.
    fn linears_mut(&mut self) -> Vec<&mut Linear<D>> {
        linears_of!(self, iter_mut, &mut)
    }

    /// Has `dev` pack its linear layers' weights ([`Device::pack_weight`]) for the products
    /// ahead where they are stale: the forward's (`forward`), and the input gradients the
    /// backward computes (`backward`; those of the layers reading the unit's input only when
    /// `need_dinp`, as in [`backward`](Self::backward)). For a pipeline stage's idle moments.
    pub fn pack_weights(&self, dev: &D, forward: bool, backward: bool, need_dinp: bool) -> Result<()> {
        // How many of `linears()`, from the first, read the unit's input. (An embedding's
        // projection reads pixels: no gradient of those is ever asked for.)
        let reading_input = match self {
            Unit::Attention(_) => 3,
            Unit::Mlp(_) | Unit::Head(_) => 1,
            Unit::Embedding(_) | Unit::FinalNorm(_) => 0,
        };
        let backward = backward && !matches!(self, Unit::Embedding(_));
        for (i, l) in self.linears().into_iter().enumerate() {
            let input_gradient = backward && (i >= reading_input || need_dinp);
            dev.pack_weight(&l.weight.value, l.in_dim, l.out_dim, forward, input_gradient)?;
        }
        Ok(())
    }

    /// Puts off (or stops putting off) the weight gradients of the unit's linear layers in its
    /// backward, for a zero-bubble schedule; see [`Linear::defer_weight_grads`].
    pub fn defer_weight_grads(&mut self, on: bool) {
        for l in self.linears_mut() {
            l.defer_weight_grads(on);
        }
    }

    /// Adds the oldest put-off weight gradients of each of the unit's linear layers (a zero-bubble
    /// schedule's `W`).
    pub fn backward_weights(&mut self, dev: &D) -> Result<()> {
        for l in self.linears_mut() {
            l.backward_weights(dev)?;
        }
        Ok(())
    }

    /// Elements its linear layers hold for put-off weight gradients (an input they share
    /// counted once).
    pub fn deferred_elements(&self) -> usize {
        held_elements::<D>(self.linears().into_iter().flat_map(Linear::deferred_buffers))
    }

    /// The unit's parameters, read-only.
    pub fn params(&self) -> Vec<&Param<D>> {
        let mut out = Vec::new();
        self.visit_params(&mut |p| out.push(p));
        out
    }

    fn visit_params<'a>(&'a self, f: &mut dyn FnMut(&'a Param<D>)) {
        use super::layers::LayerNorm;
        fn lin<'a, D: Device>(l: &'a Linear<D>, f: &mut dyn FnMut(&'a Param<D>)) {
            f(&l.weight);
            if let Some(b) = &l.bias {
                f(b);
            }
        }
        fn ln<'a, D: Device>(l: &'a LayerNorm<D>, f: &mut dyn FnMut(&'a Param<D>)) {
            f(&l.weight);
            f(&l.bias);
        }
        match self {
            Unit::Embedding(u) => match &u.kind {
                EmbeddingKind::Tokens { word, position, token_type, norm } => {
                    f(word);
                    f(position);
                    if let Some(t) = token_type {
                        f(t);
                    }
                    if let Some(n) = norm {
                        ln(n, f);
                    }
                }
                EmbeddingKind::Patches { projection, cls, position, .. } => {
                    f(cls);
                    f(position);
                    lin(projection, f);
                }
            },
            Unit::Attention(u) => {
                for l in [&u.query, &u.key, &u.value, &u.output] {
                    lin(l, f);
                }
                ln(&u.residual.norm, f);
            }
            Unit::Mlp(u) => {
                lin(&u.fc_in, f);
                lin(&u.fc_out, f);
                ln(&u.residual.norm, f);
            }
            Unit::FinalNorm(u) => ln(&u.norm, f),
            Unit::Head(u) => match &u.kind {
                HeadKind::Classifier { pooler, classifier, .. } => {
                    if let Some(p) = pooler {
                        lin(p, f);
                    }
                    lin(classifier, f);
                }
                HeadKind::TiedLm { lm_head } => lin(lm_head, f),
            },
        }
    }

    /// Whether any of the unit's parameters trains. (A unit whose parameters are all frozen
    /// but which sits above a trainable unit, like an LM head tied to a frozen embedding, still
    /// passes gradients through.)
    pub fn trainable(&self) -> bool {
        self.params().iter().any(|p| p.trainable())
    }

    /// Drops every parameter's values, keeping names and shapes ([`Param::hollow`]): a unit
    /// another process holds.
    pub fn hollow(&mut self, dev: &D) -> Result<()> {
        self.params_mut().into_iter().try_for_each(|p| p.hollow(dev))
    }

    /// Freezes or unfreezes every parameter of the unit (a frozen unit has no gradient
    /// buffers; the optimizer keeps no state for it).
    pub fn set_trainable(&mut self, dev: &D, trainable: bool) -> Result<()> {
        for p in self.params_mut() {
            p.set_trainable(dev, trainable)?;
        }
        Ok(())
    }

    /// Parameters, FLOPs and saved-activation bytes per sample at sequence length `seq`, for
    /// elements of `elem_bytes` bytes, on `dev` (which may keep bytes beside the weights).
    pub fn cost(&self, dev: &D, seq: usize, elem_bytes: usize) -> UnitCost {
        let params = self.params().iter().map(|p| p.numel()).sum();
        // Every linear layer passes a gradient back but ViT's patch projection (below it: pixels).
        let input_gradient = !matches!(self, Unit::Embedding(_));
        let weight_pack_bytes =
            self.linears().iter().map(|l| dev.weight_pack_bytes(l.in_dim, l.out_dim, input_gradient)).sum();
        let t = seq as f64;
        // (forward flops, backward flops, saved elements) per sample.
        let (mut score, mut kv) = (0, 0);
        let (fwd, bwd, saved) = match self {
            Unit::Embedding(u) => {
                let c = u.dim as f64;
                match &u.kind {
                    EmbeddingKind::Tokens { norm, .. } => {
                        // Gathers, sums and LayerNorm: ~10 flops per element each way.
                        let saved = if norm.is_some() { seq * u.dim + 2 * seq } else { 0 };
                        (10.0 * t * c, 10.0 * t * c, saved)
                    }
                    EmbeddingKind::Patches { projection, .. } => {
                        let n = (seq - 1) as f64;
                        let k = projection.in_dim as f64;
                        // Backward needs only the weight gradient: one GEMM, same size.
                        (2.0 * n * k * c, 2.0 * n * k * c, (seq - 1) * projection.in_dim)
                    }
                }
            }
            Unit::Attention(u) => {
                let c = u.query.out_dim as f64;
                let h = u.heads;
                // Four C×C projections plus QKᵀ and P·V (2·T²·C each); backward twice that.
                let fwd = 8.0 * t * c * c + 4.0 * t * t * c;
                // x, q, k, v, attended, normed-or-residual: 6·T·C; probs H·T²; stats 2·T.
                (score, kv) = (h * seq * seq, 2 * seq * u.query.out_dim);
                (fwd, 2.0 * fwd, 6 * seq * u.query.out_dim + h * seq * seq + 2 * seq)
            }
            Unit::Mlp(u) => {
                let (c, f) = (u.fc_in.in_dim, u.fc_in.out_dim);
                let fwd = 4.0 * t * c as f64 * f as f64;
                (fwd, 2.0 * fwd, 2 * seq * c + 2 * seq * f + 2 * seq)
            }
            Unit::FinalNorm(u) => {
                (8.0 * t * u.norm.dim as f64, 8.0 * t * u.norm.dim as f64, seq * u.norm.dim + 2 * seq)
            }
            Unit::Head(u) => match &u.kind {
                HeadKind::Classifier { pooler, classifier, .. } => {
                    let c = u.dim as f64;
                    let fwd = 2.0 * c * classifier.out_dim as f64 + pooler.as_ref().map_or(0.0, |_| 2.0 * c * c);
                    // Pooled features, plus the class scores' gradient, held from the loss on.
                    (fwd, 2.0 * fwd, 3 * u.dim + classifier.out_dim)
                }
                HeadKind::TiedLm { lm_head } => {
                    let fwd = 2.0 * t * u.dim as f64 * lm_head.out_dim as f64;
                    // Hidden states plus the logits, held until the loss consumes them.
                    (fwd, 2.0 * fwd, seq * u.dim + seq * lm_head.out_dim)
                }
            },
        };
        let loss_grad = match self {
            Unit::Head(u) => match &u.kind {
                HeadKind::TiedLm { lm_head } => seq * lm_head.out_dim,
                HeadKind::Classifier { classifier, .. } => classifier.out_dim,
            },
            _ => 0,
        };
        let input = match self {
            Unit::Embedding(_) => 0,
            Unit::Attention(u) => seq * u.query.in_dim,
            Unit::Mlp(u) => seq * u.fc_in.in_dim,
            Unit::FinalNorm(u) => seq * u.norm.dim,
            Unit::Head(u) => seq * u.dim,
        };
        UnitCost {
            params,
            forward_flops: fwd,
            backward_flops: bwd,
            activation_bytes: saved * elem_bytes,
            score_bytes: score * elem_bytes,
            kv_grad_bytes: kv * super::kv_arena::grad_elem_bytes(elem_bytes),
            kv_bytes: kv * elem_bytes,
            input_bytes: input * elem_bytes,
            loss_grad_bytes: loss_grad * elem_bytes,
            weight_pack_bytes,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::Precision;
    use crate::device::cpu::{CpuBuf, CpuDevice};
    use crate::model::{Model, Pooling, tiny::tiny_bert, tiny::tiny_vit};
    use crate::ops::gemm_bf16::{Bf16Path, bf16_path};

    /// A token slice through a bidirectional encoder's attention is refused: it would attend to
    /// its earlier tokens only (the run refuses such slicing up front; this is the library's
    /// own guard). The whole sequence through an arena is its plain attention.
    #[test]
    fn a_token_slice_of_an_encoder_is_refused() {
        let dev = CpuDevice::<f32>::new(0, 1).unwrap();
        let model = Model::new(&dev, &tiny_bert(Pooling::Mean, 0.0), 3).unwrap();
        let attention = model.units.iter().find(|u| u.kind_name() == "attention").unwrap();
        let hidden = model.spec().hidden;
        for (seq, offset, refused) in [(4, 4, true), (8, 0, false)] {
            let host = crate::model::HostBatch {
                batch: 2,
                seq,
                whole_seq: 8,
                position_offset: offset,
                tokens: Some(vec![1; 2 * seq]),
                targets: vec![0; 2],
                ..Default::default()
            };
            let batch = crate::model::Batch::upload(&dev, model.spec(), &host, false, 0).unwrap();
            let mut arena = crate::model::KvArena::new(&dev, 2, 8, hidden).unwrap();
            let x = dev.upload(&vec![0.1; 2 * seq * hidden]).unwrap();
            let got = attention.forward(&dev, &batch, Some(x), false, Some(&mut arena));
            match got {
                Err(e) => assert!(refused && e.to_string().contains("causal language model"), "{e}"),
                Ok(_) => assert!(!refused, "a slice of {seq} at {offset} ran"),
            }
        }
    }

    /// `pack_weights` packs what the products ahead will read, as the backward reads it: the
    /// input gradients of the layers that read a unit's input only when the unit below is
    /// trainable, the others' always, a forward's only when asked.
    #[test]
    fn pack_weights_packs_what_the_products_read() {
        let dev = CpuDevice::<f32>::with_precision(0, 1, Precision::Bf16).unwrap();
        let model = Model::new(&dev, &tiny_bert(Pooling::Mean, 0.0), 3).unwrap();
        let p = bf16_path() != Bf16Path::Fallback; // whether this CPU packs at all
        let fresh = |u: &Unit<CpuDevice<f32>>| -> Vec<(bool, bool)> {
            u.linears().iter().map(|l| CpuBuf::packs_fresh(&l.weight.value)).collect()
        };
        let unit = |kind: &str| model.units.iter().find(|u| u.kind_name() == kind).unwrap();
        let (attention, mlp, head) = (unit("attention"), unit("mlp"), unit("head"));

        attention.pack_weights(&dev, true, true, false).unwrap();
        assert_eq!(fresh(attention), [(p, false), (p, false), (p, false), (p, p)], "q, k, v, output");
        attention.pack_weights(&dev, false, true, true).unwrap();
        assert_eq!(fresh(attention), [(p, p); 4], "with the unit's input gradient");

        mlp.pack_weights(&dev, false, true, false).unwrap();
        assert_eq!(fresh(mlp), [(false, false), (false, p)], "fc_in, fc_out: backward only");

        head.pack_weights(&dev, true, false, true).unwrap();
        assert!(fresh(head).iter().all(|&f| f == (p, false)), "forward only: {:?}", fresh(head));

        // A ViT's patch projection reads pixels: never an input gradient.
        let vit = Model::new(&dev, &tiny_vit(0.0), 3).unwrap();
        let patches = &vit.units[0];
        patches.pack_weights(&dev, true, true, true).unwrap();
        assert_eq!(fresh(patches), [(p, false)], "the patch projection");
    }
}
