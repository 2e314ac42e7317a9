//! The two parameterised building blocks units are made of, `Linear` and `LayerNorm`, each a
//! forward/backward pair over the device's ops that knows its own parameters.

use super::init::Init;
use super::param::Param;
use crate::device::Device;
use crate::error::Result;
use crate::rng::Rng;
use std::collections::VecDeque;
use std::sync::Arc;

/// Standard deviation of the normal initialisation of weights and embeddings (BERT, GPT-2 and
/// ViT all use 0.02).
pub const INIT_STD: f64 = 0.02;

/// `n` draws from N(0, std²), as f32.
pub fn normal_init(rng: &mut Rng, n: usize, std: f64) -> Vec<f32> {
    (0..n).map(|_| (rng.normal() * std) as f32).collect()
}

/// A linear layer, weight `[out, in]`.
pub struct Linear<D: Device> {
    /// `[out_dim, in_dim]`.
    pub weight: Param<D>,
    /// `[out_dim]`, if the layer has one.
    pub bias: Option<Param<D>>,
    /// Input features.
    pub in_dim: usize,
    /// Output features.
    pub out_dim: usize,
    /// Weight gradients put off by backwards, oldest first, while a zero-bubble schedule runs
    /// (`None`: each backward adds its own at once). See [`Linear::defer_weight_grads`].
    pub deferred: Option<VecDeque<DeferredWeightGrad<D>>>,
}

/// A buffer a backward reads that its caller may give away: a put-off weight gradient keeps a
/// given one instead of copying it.
pub enum Held<'a, B> {
    /// Still the caller's: copied if it must be kept.
    Lent(&'a B),
    /// The caller's no longer.
    Given(B),
    /// Already a kept copy that several layers read (attention's q, k and v projections share
    /// their input): each put-off weight gradient keeps a handle, not a copy.
    Shared(Arc<B>),
}

impl<B> Held<'_, B> {
    fn get(&self) -> &B {
        match self {
            Held::Lent(b) => b,
            Held::Given(b) => b,
            Held::Shared(b) => b,
        }
    }

    fn keep<D: Device<Buf = B>>(self, dev: &D) -> Result<Arc<B>> {
        match self {
            Held::Lent(src) => Ok(Arc::new(clone_buf(dev, src)?)),
            Held::Given(b) => Ok(Arc::new(b)),
            Held::Shared(b) => Ok(b),
        }
    }
}

/// Elements in `buffers`, a buffer held more than once counted once.
pub fn held_elements<'a, D: Device>(buffers: impl IntoIterator<Item = &'a Arc<D::Buf>>) -> usize {
    let mut seen = std::collections::HashSet::new();
    buffers.into_iter().filter(|b| seen.insert(Arc::as_ptr(b))).map(|b| D::len(b)).sum()
}

/// A device-side copy of `src`.
pub(crate) fn clone_buf<D: Device>(dev: &D, src: &D::Buf) -> Result<D::Buf> {
    let mut dst = dev.alloc(D::len(src))?;
    dev.copy(&mut dst, src)?;
    Ok(dst)
}

/// What a put-off weight gradient needs: one backward's input rows (perhaps shared with other
/// layers' put-off gradients) and output gradient.
pub struct DeferredWeightGrad<D: Device> {
    inp: Arc<D::Buf>,
    dout: Arc<D::Buf>,
    rows: usize,
}

impl<D: Device> Linear<D> {
    /// A layer named `name` (parameters `name.weight`, `name.bias`), weights N(0, std²),
    /// bias zero. `weight_shape` is the shape reported for the weight (ViT's patch projection is
    /// stored as a conv weight `[out, ch, p, p]`).
    pub fn new(dev: &D, init: &mut Init, name: &str, in_dim: usize, out_dim: usize, std: f64) -> Result<Self> {
        Self::with_shape(dev, init, name, in_dim, out_dim, std, &[out_dim, in_dim])
    }

    /// [`Linear::new`] with an explicit shape for the weight (same number of elements).
    pub fn with_shape(
        dev: &D,
        init: &mut Init,
        name: &str,
        in_dim: usize,
        out_dim: usize,
        std: f64,
        weight_shape: &[usize],
    ) -> Result<Self> {
        let name_w = format!("{name}.weight");
        let weight = Param::new(dev, &name_w, weight_shape, &init.normal(&name_w, in_dim * out_dim, std), true)?;
        let bias = Some(Param::new(dev, format!("{name}.bias"), &[out_dim], &vec![0.0; out_dim], false)?);
        Ok(Self { weight, bias, in_dim, out_dim, deferred: None })
    }

    /// `out[rows, out] = inp[rows, in]·Wᵀ + b`, into a new buffer.
    pub fn forward(&self, dev: &D, inp: &D::Buf, rows: usize) -> Result<D::Buf> {
        let mut out = dev.alloc(rows * self.out_dim)?;
        dev.linear_forward(
            &mut out,
            inp,
            &self.weight.value,
            self.bias.as_ref().map(|b| &b.value),
            rows,
            self.in_dim,
            self.out_dim,
        )?;
        Ok(out)
    }

    /// Accumulates parameter gradients and returns `dinp` when `need_dinp`. While weight
    /// gradients are deferred, the weight's is put off (its input and `dout` kept) until
    /// [`backward_weights`](Self::backward_weights).
    pub fn backward(
        &mut self,
        dev: &D,
        dout: Held<'_, D::Buf>,
        inp: Held<'_, D::Buf>,
        rows: usize,
        need_dinp: bool,
    ) -> Result<Option<D::Buf>> {
        let mut dinp = if need_dinp { Some(dev.alloc(rows * self.in_dim)?) } else { None };
        let defer = self.defers_weight_grads();
        dev.linear_backward(
            dinp.as_mut(),
            if defer { None } else { self.weight.grad.as_mut() },
            self.bias.as_mut().and_then(|b| b.grad.as_mut()),
            dout.get(),
            inp.get(),
            &self.weight.value,
            rows,
            self.in_dim,
            self.out_dim,
        )?;
        if let (true, Some(queue)) = (defer, self.deferred.as_mut()) {
            queue.push_back(DeferredWeightGrad { inp: inp.keep(dev)?, dout: dout.keep(dev)?, rows });
        }
        Ok(dinp)
    }

    /// Puts off (`on`) or stops putting off the weight's gradient in [`backward`](Self::backward);
    /// either way drops whatever was still put off.
    pub fn defer_weight_grads(&mut self, on: bool) {
        self.deferred = on.then(VecDeque::new);
    }

    /// Whether a training backward now puts the weight's gradient off.
    pub fn defers_weight_grads(&self) -> bool {
        self.deferred.is_some() && self.weight.grad.is_some()
    }

    /// The buffers put-off weight gradients hold (inputs and output gradients), each as often
    /// as it is held: [`held_elements`] counts a shared one once.
    pub fn deferred_buffers(&self) -> impl Iterator<Item = &Arc<D::Buf>> {
        self.deferred.iter().flatten().flat_map(|d| [&d.inp, &d.dout])
    }

    /// Adds the oldest put-off weight gradient: `dW += doutᵀ·inp`, the product the backward
    /// would have run, so the sum is the same to the bit. A frozen layer has none; a training
    /// one without any means a schedule asked for weight gradients its backwards did not put
    /// off, an error rather than a gradient silently missing.
    pub fn backward_weights(&mut self, dev: &D) -> Result<()> {
        if self.weight.grad.is_none() {
            return Ok(());
        }
        let Some(d) = self.deferred.as_mut().and_then(VecDeque::pop_front) else {
            return Err(crate::error::internal(
                self.weight.name.clone(),
                "weight gradients asked for, but no backward put any off",
            ));
        };
        dev.linear_backward(
            None,
            self.weight.grad.as_mut(),
            None,
            &*d.dout,
            &*d.inp,
            &self.weight.value,
            d.rows,
            self.in_dim,
            self.out_dim,
        )
    }

    /// The layer's parameters.
    pub fn params_mut(&mut self) -> Vec<&mut Param<D>> {
        let mut v = vec![&mut self.weight];
        v.extend(self.bias.as_mut());
        v
    }
}

/// What a LayerNorm forward keeps for its backward (the caller keeps the input, which is
/// usually also needed by a residual or a linear).
pub struct LayerNormSaved<D: Device> {
    /// Per-row mean.
    pub mean: D::Buf,
    /// Per-row reciprocal standard deviation.
    pub rstd: D::Buf,
}

impl<D: Device> LayerNormSaved<D> {
    /// Elements held.
    pub fn elements(&self) -> usize {
        D::len(&self.mean) + D::len(&self.rstd)
    }
}

/// Elements of an optional buffer (0 when absent).
pub(crate) fn len_of<D: Device>(b: Option<&D::Buf>) -> usize {
    b.map_or(0, D::len)
}

/// LayerNorm over the hidden dimension.
pub struct LayerNorm<D: Device> {
    /// Scale, initialised to 1.
    pub weight: Param<D>,
    /// Shift, initialised to 0.
    pub bias: Param<D>,
    /// Normalised width.
    pub dim: usize,
    /// Epsilon added to the variance.
    pub eps: f64,
}

impl<D: Device> LayerNorm<D> {
    /// A LayerNorm named `name` (parameters `name.weight`, `name.bias`), excluded from decay.
    pub fn new(dev: &D, name: &str, dim: usize, eps: f64) -> Result<Self> {
        Ok(Self {
            weight: Param::new(dev, format!("{name}.weight"), &[dim], &vec![1.0; dim], false)?,
            bias: Param::new(dev, format!("{name}.bias"), &[dim], &vec![0.0; dim], false)?,
            dim,
            eps,
        })
    }

    /// Normalises `inp` (`rows` rows); returns the output and the row statistics.
    pub fn forward(&self, dev: &D, inp: &D::Buf, rows: usize) -> Result<(D::Buf, LayerNormSaved<D>)> {
        let mut out = dev.alloc(rows * self.dim)?;
        let mut mean = dev.alloc_stats(rows)?;
        let mut rstd = dev.alloc_stats(rows)?;
        dev.layernorm_forward(
            &mut out,
            &mut mean,
            &mut rstd,
            inp,
            &self.weight.value,
            &self.bias.value,
            rows,
            self.dim,
            self.eps,
        )?;
        Ok((out, LayerNormSaved { mean, rstd }))
    }

    /// Accumulates parameter gradients and returns `dinp`.
    pub fn backward(
        &mut self,
        dev: &D,
        dout: &D::Buf,
        inp: &D::Buf,
        saved: &LayerNormSaved<D>,
        rows: usize,
    ) -> Result<D::Buf> {
        let mut dinp = dev.alloc(rows * self.dim)?;
        let (Some(dw), Some(db)) = (self.weight.grad.as_mut(), self.bias.grad.as_mut()) else {
            return Err(crate::Error::Internal {
                what: self.weight.name.clone(),
                message: "backward through a frozen LayerNorm".into(),
            });
        };
        dev.layernorm_backward(
            &mut dinp,
            dw,
            db,
            dout,
            inp,
            &self.weight.value,
            &saved.mean,
            &saved.rstd,
            rows,
            self.dim,
        )?;
        Ok(dinp)
    }

    /// The layer's parameters.
    pub fn params_mut(&mut self) -> Vec<&mut Param<D>> {
        vec![&mut self.weight, &mut self.bias]
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::CpuDevice;

    /// Put off, a backward adds the bias's gradient and not the weight's; the weight's, added
    /// later, is the same bits as the backward adding it at once. Asking for weight gradients
    /// nobody put off is an error on a training layer and nothing on a frozen one.
    #[test]
    fn put_off_weight_gradients_are_the_same_bits_later() {
        let dev = CpuDevice::<f32>::new(0, 1).unwrap();
        let mut rng = Rng::new(4);
        let (rows, inp, out) = (5, 3, 4);
        let x = dev.upload(&normal_init(&mut rng, rows * inp, 1.0)).unwrap();
        let dy = dev.upload(&normal_init(&mut rng, rows * out, 1.0)).unwrap();
        let layer = |init: &mut Init| {
            let mut l = Linear::new(&dev, init, "l", inp, out, 0.5).unwrap();
            for p in l.params_mut() {
                p.grad = Some(dev.upload(&vec![0.25; D::len(&p.value)]).unwrap());
            }
            l
        };
        type D = CpuDevice<f32>;
        let grads = |l: &Linear<D>| -> Vec<Vec<f32>> {
            [&l.weight, l.bias.as_ref().unwrap()].iter().map(|p| p.grad.as_ref().unwrap().to_vec()).collect()
        };
        let (mut now, mut later) = (layer(&mut Init::new(1)), layer(&mut Init::new(1)));
        later.defer_weight_grads(true);
        for _ in 0..2 {
            let a = now.backward(&dev, Held::Lent(&dy), Held::Lent(&x), rows, true).unwrap();
            let b = later.backward(&dev, Held::Lent(&dy), Held::Lent(&x), rows, true).unwrap();
            assert_eq!(a.unwrap().to_vec(), b.unwrap().to_vec(), "the input's gradient at once");
        }
        let before = grads(&later);
        assert_eq!(before[0], vec![0.25; out * inp], "the weight's gradient waits");
        assert_eq!(before[1], grads(&now)[1], "the bias's does not");
        assert_eq!(held_elements::<D>(later.deferred_buffers()), 2 * rows * (inp + out));
        later.backward_weights(&dev).unwrap();
        later.backward_weights(&dev).unwrap();
        assert_eq!(grads(&later), grads(&now));
        let e = later.backward_weights(&dev).unwrap_err().to_string();
        assert!(e.contains("no backward put any off"), "{e}");
        later.weight.grad = None;
        later.backward_weights(&dev).unwrap();
    }
}
