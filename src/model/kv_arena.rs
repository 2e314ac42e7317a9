//! TeraPipe's key/value arena: for one attention unit and one micro-batch, the keys and values of
//! every position computed so far, `[batch, seq, width]` for the whole sequence, written in place
//! slice by slice. Slice `j` (positions `c..c+l`) writes its rows, then attends over rows `0..c+l`
//! (the context the earlier slices left). The backward runs the slices last-first: each adds the
//! gradient of its whole context into the arena's gradient rows, after which its own rows'
//! gradient is complete (every later slice has added its share) and is read out.

use crate::device::Device;
use crate::error::{Result, internal};
use crate::ops::rows::RowCopy;

/// Bytes of one element of the arena's gradients, for activations of `activation_bytes`: f32
/// on every device (each later slice adds its piece, and a bf16 sum would round at every add
/// where the unsliced backward rounds once), or the activations' dtype where wider.
pub fn grad_elem_bytes(activation_bytes: usize) -> usize {
    activation_bytes.max(4)
}

/// Keys or values.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kv {
    /// The keys.
    Keys,
    /// The values.
    Values,
}

/// One attention unit's keys and values (and their gradients) for one micro-batch.
pub struct KvArena<D: Device> {
    batch: usize,
    seq: usize,
    width: usize,
    /// `[keys, values]`, `[batch, seq, width]` each.
    data: [D::Buf; 2],
    /// Their gradients, zeroed at the first backward.
    grad: Option<[D::Buf; 2]>,
}

impl<D: Device> KvArena<D> {
    /// An arena for `batch` sequences of `seq` positions of `width` channels (contents
    /// unspecified until written).
    pub fn new(dev: &D, batch: usize, seq: usize, width: usize) -> Result<Self> {
        let n = batch * seq * width;
        Ok(Self { batch, seq, width, data: [dev.alloc(n)?, dev.alloc(n)?], grad: None })
    }

    /// Elements the arena holds (keys, values and their gradients once the backward started).
    pub fn elements(&self) -> usize {
        self.elements_in_backward() / if self.grad.is_some() { 1 } else { 2 }
    }

    /// Elements the arena holds once a backward has run: keys, values and their gradients.
    pub fn elements_in_backward(&self) -> usize {
        self.batch * self.seq * self.width * 4
    }

    /// The copy between positions `start..start+len` of the arena and a `[batch, len, width]`
    /// buffer (`into_arena` picks the direction).
    fn rows(&self, start: usize, len: usize, into_arena: bool, accumulate: bool) -> Result<RowCopy> {
        if start + len > self.seq {
            return Err(internal("kv arena", format!("positions {start}..{} of {}", start + len, self.seq)));
        }
        let (arena, slice) = ((start * self.width, self.seq * self.width), (0, len * self.width));
        let ((dst_offset, dst_stride), (src_offset, src_stride)) =
            if into_arena { (arena, slice) } else { (slice, arena) };
        Ok(RowCopy {
            rows: self.batch,
            len: len * self.width,
            dst_offset,
            dst_stride,
            src_offset,
            src_stride,
            accumulate,
        })
    }

    /// Writes `x` (`[batch, len, width]`) at positions `start..start+len`.
    pub fn write(&mut self, dev: &D, which: Kv, x: &D::Buf, start: usize) -> Result<()> {
        let len = D::len(x) / (self.batch * self.width).max(1);
        let c = self.rows(start, len, true, false)?;
        dev.copy_rows(&mut self.data[which as usize], x, c)
    }

    /// Positions `0..end` as a new `[batch, end, width]` buffer: a slice's attention context.
    pub fn context(&self, dev: &D, which: Kv, end: usize) -> Result<D::Buf> {
        let mut out = dev.alloc(self.batch * end * self.width)?;
        dev.copy_rows(&mut out, &self.data[which as usize], self.rows(0, end, false, false)?)?;
        Ok(out)
    }

    /// Adds `g` (`[batch, end, width]`, the gradient of a slice's context `0..end`) into the
    /// arena's gradient.
    pub fn add_grad(&mut self, dev: &D, which: Kv, g: &D::Buf) -> Result<()> {
        self.zero_grad(dev)?;
        let end = D::len(g) / (self.batch * self.width).max(1);
        let c = self.rows(0, end, true, true)?;
        let grad = self.grad.as_mut().ok_or_else(|| internal("kv arena", "no gradient"))?;
        dev.copy_rows(&mut grad[which as usize], g, c)
    }

    /// Allocates the gradient, zeroed, if it is not yet: the first [`add_grad`](Self::add_grad)
    /// does, once per micro-batch; a probe timing one slice as one of many does it before
    /// its clock starts.
    pub fn zero_grad(&mut self, dev: &D) -> Result<()> {
        if self.grad.is_none() {
            let n = self.batch * self.seq * self.width;
            // In f32 (`grad_elem_bytes`).
            let zeros = || -> Result<D::Buf> {
                let mut g = dev.alloc_stats(n)?;
                dev.fill(&mut g, 0.0)?;
                Ok(g)
            };
            self.grad = Some([zeros()?, zeros()?]);
        }
        Ok(())
    }

    /// The gradient of positions `start..start+len` as a `[batch, len, width]` buffer: complete
    /// once every slice that attends to them has run its backward.
    pub fn grad(&self, dev: &D, which: Kv, start: usize, len: usize) -> Result<D::Buf> {
        let grad = self.grad.as_ref().ok_or_else(|| internal("kv arena", "gradient read before any was added"))?;
        let mut out = dev.alloc(self.batch * len * self.width)?;
        dev.copy_rows(&mut out, &grad[which as usize], self.rows(start, len, false, false)?)?;
        Ok(out)
    }
}
