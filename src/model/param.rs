//! `Param`: one named parameter tensor, its gradient and its optimizer settings.

use crate::device::Device;
use crate::error::Result;

/// A parameter tensor with its Hugging Face name, shape, value and gradient.
pub struct Param<D: Device> {
    /// Hugging Face name, e.g. `encoder.layer.0.attention.self.query.weight`.
    pub name: String,
    /// Shape, PyTorch layout (linear weights are `[out, in]`).
    pub shape: Vec<usize>,
    /// The values.
    pub value: D::Buf,
    /// The accumulated gradient; `None` while the parameter is frozen (no memory, no work).
    pub grad: Option<D::Buf>,
    /// Whether decoupled weight decay applies (false for LayerNorm weights and all biases).
    pub decay: bool,
}

impl<D: Device> Param<D> {
    /// A trainable parameter initialised from host values; its gradient starts at zero.
    pub fn new(dev: &D, name: impl Into<String>, shape: &[usize], values: &[f32], decay: bool) -> Result<Self> {
        let numel: usize = shape.iter().product();
        crate::error::check_len("Param::new", "values", values.len(), numel)?;
        Ok(Self {
            name: name.into(),
            shape: shape.to_vec(),
            value: dev.upload(values)?,
            grad: Some(dev.zeros(numel)?),
            decay,
        })
    }
    /// Number of elements.
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }
    /// Whether the parameter receives gradients.
    pub fn trainable(&self) -> bool {
        self.grad.is_some()
    }
    /// Freezes (drops the gradient buffer) or unfreezes (allocates a zero gradient).
    pub fn set_trainable(&mut self, dev: &D, trainable: bool) -> Result<()> {
        match (trainable, self.grad.is_some()) {
            (true, false) => self.grad = Some(dev.zeros(self.numel())?),
            (false, true) => self.grad = None,
            _ => {}
        }
        Ok(())
    }
    /// Drops the values (and a gradient's memory) but keeps the name, shape and whether it
    /// trains: a stage process's copy of a parameter another process trains and holds.
    pub fn hollow(&mut self, dev: &D) -> Result<()> {
        self.value = dev.upload(&[])?;
        if self.grad.is_some() {
            self.grad = Some(dev.upload(&[])?);
        }
        Ok(())
    }
    /// Whether [`hollow`](Self::hollow) left it without values.
    pub fn is_hollow(&self) -> bool {
        D::len(&self.value) == 0 && self.numel() > 0
    }
    /// Sets the gradient to zero (if trainable).
    pub fn zero_grad(&mut self, dev: &D) -> Result<()> {
        if let Some(g) = &mut self.grad {
            dev.fill(g, 0.0)?;
        }
        Ok(())
    }
}
