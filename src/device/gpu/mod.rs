//! `GpuDevice`: the [`Device`] of the `cuda` and `cuda-emu` backends. Every op is the same Rust
//! launch code (grid, block, shared memory, argument list) over a [`Runtime`], which either
//! drives a real GPU through cudarc or runs the same `kernels/*.cu` on the host.
//!
//! Precision ([`Precision`]): in `f32` mode every buffer is f32. In `bf16` mode the buffers the
//! model *allocates* ([`Device::alloc`]: activations, their gradients, saved statistics, losses)
//! are bf16, while the buffers it *uploads or zeroes* ([`Device::upload`], [`Device::zeros`]:
//! parameters, parameter gradients, optimizer state, input images) are f32: f32 master weights
//! and f32 gradient accumulation, bf16 traffic for everything that scales with the batch. Kernels
//! accumulate in f32 in both modes; a kernel's activation type is the suffix of its name
//! (`gelu_forward_f32`, `gelu_forward_bf16`).

pub mod ops;
pub mod runtime;

pub use runtime::{Arg, DevPtr, LaunchConfig, Runtime};

use super::Device;
use crate::error::{Error, Result, check_len};
use crate::ops::attention::AttentionDims;
use crate::ops::dropout::DropoutCoords;
use crate::ops::gelu::Activation;
use crate::ops::optim::{AdamWStep, SgdStep};
use crate::ops::patch::PatchDims;
use crate::ops::rows::RowCopy;
use crate::scalar::DType;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

/// Storage precision of a [`GpuDevice`] (see the module documentation).
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Precision {
    /// Every buffer f32: the mode compared with the `cpu` backend to 1e-5.
    F32,
    /// bf16 activations, f32 master weights, gradients and optimizer state.
    Bf16,
}

/// Element type of one device buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Elem {
    /// IEEE binary32.
    F32,
    /// bfloat16 (8-bit exponent, 7-bit mantissa).
    Bf16,
}

impl Elem {
    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            Elem::F32 => 4,
            Elem::Bf16 => 2,
        }
    }
    /// The suffix of kernels whose activations are of this type.
    pub fn suffix(self) -> &'static str {
        match self {
            Elem::F32 => "f32",
            Elem::Bf16 => "bf16",
        }
    }
}

/// Freed allocations by byte length, kept for reuse (a step repeats its shapes).
struct MemoryPool {
    rt: Arc<dyn Runtime>,
    free: Mutex<HashMap<usize, Vec<DevPtr>>>,
}

impl MemoryPool {
    fn take(&self, bytes: usize) -> Result<DevPtr> {
        let reused = self.free.lock().unwrap_or_else(|e| e.into_inner()).get_mut(&bytes).and_then(Vec::pop);
        if let Some(p) = reused {
            return Ok(p);
        }
        match self.rt.alloc(bytes) {
            Ok(p) => Ok(p),
            // The device may be full of freed buffers of other sizes (batches of other lengths
            // leave theirs here): give them back and try once more, as PyTorch's caching
            // allocator does.
            Err(e) if self.release() == 0 => Err(e),
            Err(_) => self.rt.alloc(bytes),
        }
    }
    fn give(&self, ptr: DevPtr, bytes: usize) {
        self.free.lock().unwrap_or_else(|e| e.into_inner()).entry(bytes).or_default().push(ptr);
    }
    /// Frees every pooled buffer; returns how many.
    fn release(&self) -> usize {
        let free = std::mem::take(&mut *self.free.lock().unwrap_or_else(|e| e.into_inner()));
        let mut count = 0;
        for (bytes, ptrs) in free {
            for p in ptrs {
                // SAFETY: every pooled pointer came from `rt.alloc(bytes)` and has no owner left.
                unsafe { self.rt.free(p, bytes) };
                count += 1;
            }
        }
        count
    }
}

impl Drop for MemoryPool {
    fn drop(&mut self) {
        self.release();
    }
}

/// A buffer of `len` elements of type `elem` in device memory; returns to its pool on drop.
pub struct GpuBuf {
    ptr: DevPtr,
    len: usize,
    elem: Elem,
    pool: Arc<MemoryPool>,
}

impl GpuBuf {
    /// The device address of element 0.
    pub fn ptr(&self) -> DevPtr {
        self.ptr
    }
    /// The element type.
    pub fn elem(&self) -> Elem {
        self.elem
    }
    /// Elements.
    pub fn len(&self) -> usize {
        self.len
    }
    /// Whether it holds no element.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// Bytes.
    fn bytes(&self) -> usize {
        self.len * self.elem.size()
    }
}

impl Drop for GpuBuf {
    fn drop(&mut self) {
        if self.len > 0 {
            self.pool.give(self.ptr, self.bytes());
        }
    }
}

/// A buffer of `u32` ids in device memory, with the host copy it was uploaded from: ids are
/// small and written once per batch, and ops that need them on the host (the deterministic
/// embedding backward buckets rows by id; the loss counts its targets) read them without a copy
/// back.
pub struct GpuIds {
    ptr: DevPtr,
    host: Vec<u32>,
    pool: Arc<MemoryPool>,
}

impl GpuIds {
    /// The device address of element 0.
    pub fn ptr(&self) -> DevPtr {
        self.ptr
    }
    /// The ids, as uploaded.
    pub fn host(&self) -> &[u32] {
        &self.host
    }
    /// Elements.
    pub fn len(&self) -> usize {
        self.host.len()
    }
    /// Whether it holds no element.
    pub fn is_empty(&self) -> bool {
        self.host.is_empty()
    }
}

impl Drop for GpuIds {
    fn drop(&mut self) {
        if !self.host.is_empty() {
            self.pool.give(self.ptr, self.host.len() * 4);
        }
    }
}

/// A device whose ops are the kernels of `kernels/*.cu`, run by a [`Runtime`].
pub struct GpuDevice {
    rt: Arc<dyn Runtime>,
    pool: Arc<MemoryPool>,
    precision: Precision,
    /// Whether fresh allocations are filled with NaN first, so a kernel that forgets to write an
    /// element is caught (on by default on the emulator, where it costs little).
    poison: bool,
}

impl GpuDevice {
    /// A device over `rt` computing in `precision`.
    pub fn new(rt: Arc<dyn Runtime>, precision: Precision, poison: bool) -> Self {
        let pool = Arc::new(MemoryPool { rt: rt.clone(), free: Mutex::new(HashMap::new()) });
        Self { rt, pool, precision, poison }
    }

    /// The element type of the buffers [`Device::alloc`] returns (activations).
    pub fn act(&self) -> Elem {
        match self.precision {
            Precision::F32 => Elem::F32,
            Precision::Bf16 => Elem::Bf16,
        }
    }

    /// The runtime that runs this device's kernels.
    pub fn runtime(&self) -> &dyn Runtime {
        &*self.rt
    }

    /// Launches `kernel` with `args`.
    pub fn launch(&self, kernel: &str, cfg: LaunchConfig, args: &[Arg]) -> Result<()> {
        runtime::launch(&*self.rt, kernel, &cfg, args)
    }

    /// A buffer of `len` elements of type `elem` (NaN-filled when poisoning is on).
    pub fn alloc_elem(&self, len: usize, elem: Elem) -> Result<GpuBuf> {
        let ptr = if len == 0 { 0 } else { self.pool.take(len * elem.size())? };
        let mut buf = GpuBuf { ptr, len, elem, pool: self.pool.clone() };
        if self.poison {
            self.fill(&mut buf, f64::NAN)?;
        }
        Ok(buf)
    }

    fn upload_bytes(&self, bytes: &[u8], len: usize, elem: Elem) -> Result<GpuBuf> {
        let buf = self.alloc_elem(len, elem)?;
        if len > 0 {
            self.rt.copy_to_device(buf.ptr, bytes)?;
        }
        Ok(buf)
    }

    fn download_bytes(&self, buf: &GpuBuf) -> Result<Vec<u8>> {
        let mut bytes = vec![0u8; buf.bytes()];
        if !bytes.is_empty() {
            self.rt.copy_to_host(&mut bytes, buf.ptr)?;
        }
        Ok(bytes)
    }
}

/// Checks that `buf` holds `elem` elements (an [`Error::Config`] naming `op` and `arg` if not); kernels are typed and a mismatch would read garbage.
pub fn check_elem(op: &str, arg: &str, buf: &GpuBuf, elem: Elem) -> Result<()> {
    if buf.elem == elem {
        Ok(())
    } else {
        Err(Error::Config {
            field: format!("{op}.{arg}"),
            message: format!("the buffer holds {:?} elements; the kernel expects {elem:?}", buf.elem),
        })
    }
}

/// A length as the `int` kernels take, or an error for a tensor too large for 32-bit indexing.
pub(crate) fn int(op: &str, what: &str, n: usize) -> Result<i32> {
    i32::try_from(n).map_err(|_| Error::Config {
        field: format!("{op}.{what}"),
        message: format!("{n} exceeds the kernels' 32-bit indexing"),
    })
}

#[allow(clippy::too_many_arguments)]
impl Device for GpuDevice {
    type Buf = GpuBuf;
    type Ids = GpuIds;

    fn name(&self) -> String {
        format!("{} ({:?})", self.rt.name(), self.precision)
    }
    fn precision(&self) -> Precision {
        self.precision
    }
    fn max_head_dim(&self) -> Option<usize> {
        Some(ops::attention::MAX_HEAD_DIM)
    }
    fn activation_dtype(&self) -> DType {
        match self.precision {
            Precision::F32 => DType::F32,
            Precision::Bf16 => DType::Bf16,
        }
    }
    fn len(buf: &Self::Buf) -> usize {
        buf.len
    }
    fn alloc(&self, len: usize) -> Result<Self::Buf> {
        self.alloc_elem(len, self.act())
    }
    fn alloc_stats(&self, len: usize) -> Result<Self::Buf> {
        self.alloc_elem(len, Elem::F32)
    }
    fn zeros(&self, len: usize) -> Result<Self::Buf> {
        let mut buf = self.alloc_elem(len, Elem::F32)?;
        self.fill(&mut buf, 0.0)?;
        Ok(buf)
    }
    fn upload(&self, data: &[f32]) -> Result<Self::Buf> {
        let bytes: Vec<u8> = data.iter().flat_map(|x| x.to_ne_bytes()).collect();
        self.upload_bytes(&bytes, data.len(), Elem::F32)
    }
    fn upload_activations(&self, data: &[f32]) -> Result<Self::Buf> {
        match self.act() {
            Elem::F32 => self.upload(data),
            Elem::Bf16 => {
                let bytes: Vec<u8> = data.iter().flat_map(|&x| half::bf16::from_f32(x).to_ne_bytes()).collect();
                self.upload_bytes(&bytes, data.len(), Elem::Bf16)
            }
        }
    }
    fn upload_f64(&self, data: &[f64]) -> Result<Self::Buf> {
        let narrowed: Vec<f32> = data.iter().map(|&x| x as f32).collect();
        self.upload(&narrowed)
    }
    fn download(&self, buf: &Self::Buf) -> Result<Vec<f32>> {
        let bytes = self.download_bytes(buf)?;
        Ok(match buf.elem {
            Elem::F32 => bytes.chunks_exact(4).map(|b| f32::from_ne_bytes([b[0], b[1], b[2], b[3]])).collect(),
            Elem::Bf16 => bytes.chunks_exact(2).map(|b| half::bf16::from_ne_bytes([b[0], b[1]]).to_f32()).collect(),
        })
    }
    fn download_f64(&self, buf: &Self::Buf) -> Result<Vec<f64>> {
        Ok(self.download(buf)?.into_iter().map(f64::from).collect())
    }
    fn upload_ids(&self, ids: &[u32]) -> Result<Self::Ids> {
        let ptr = if ids.is_empty() { 0 } else { self.pool.take(ids.len() * 4)? };
        let out = GpuIds { ptr, host: ids.to_vec(), pool: self.pool.clone() };
        if !ids.is_empty() {
            let bytes: Vec<u8> = ids.iter().flat_map(|x| x.to_ne_bytes()).collect();
            self.rt.copy_to_device(ptr, &bytes)?;
        }
        Ok(out)
    }
    fn copy(&self, dst: &mut Self::Buf, src: &Self::Buf) -> Result<()> {
        check_len("copy", "dst", dst.len, src.len)?;
        if dst.elem == src.elem {
            if dst.len > 0 {
                self.rt.copy_on_device(dst.ptr, src.ptr, src.bytes())?;
            }
            Ok(())
        } else {
            ops::elementwise::cast(self, dst, src)
        }
    }
    fn fill(&self, dst: &mut Self::Buf, value: f64) -> Result<()> {
        ops::elementwise::fill(self, dst, value)
    }
    fn synchronize(&self) -> Result<()> {
        self.rt.synchronize()
    }
    fn marker(&self) -> Result<crate::device::Marker> {
        self.rt.marker()
    }

    fn linear_forward(
        &self,
        out: &mut Self::Buf,
        inp: &Self::Buf,
        weight: &Self::Buf,
        bias: Option<&Self::Buf>,
        rows: usize,
        in_dim: usize,
        out_dim: usize,
    ) -> Result<()> {
        ops::matmul::linear_forward(self, out, inp, weight, bias, rows, in_dim, out_dim)
    }
    fn linear_backward(
        &self,
        dinp: Option<&mut Self::Buf>,
        dweight: Option<&mut Self::Buf>,
        dbias: Option<&mut Self::Buf>,
        dout: &Self::Buf,
        inp: &Self::Buf,
        weight: &Self::Buf,
        rows: usize,
        in_dim: usize,
        out_dim: usize,
    ) -> Result<()> {
        ops::matmul::linear_backward(self, dinp, dweight, dbias, dout, inp, weight, rows, in_dim, out_dim)
    }
    fn embedding_forward(
        &self,
        out: &mut Self::Buf,
        ids: &Self::Ids,
        table: &Self::Buf,
        dim: usize,
        accumulate: bool,
    ) -> Result<()> {
        ops::embedding::embedding_forward(self, out, ids, table, dim, accumulate)
    }
    fn embedding_backward(&self, dtable: &mut Self::Buf, ids: &Self::Ids, dout: &Self::Buf, dim: usize) -> Result<()> {
        ops::embedding::embedding_backward(self, dtable, ids, dout, dim)
    }
    fn patch_forward(&self, out: &mut Self::Buf, img: &Self::Buf, d: PatchDims) -> Result<()> {
        ops::embedding::patch_forward(self, out, img, d)
    }
    fn patch_backward(&self, dimg: &mut Self::Buf, dout: &Self::Buf, d: PatchDims) -> Result<()> {
        ops::embedding::patch_backward(self, dimg, dout, d)
    }
    fn prepend_token_forward(
        &self,
        out: &mut Self::Buf,
        token: &Self::Buf,
        inp: &Self::Buf,
        batch: usize,
        seq: usize,
        dim: usize,
    ) -> Result<()> {
        ops::embedding::prepend_token_forward(self, out, token, inp, batch, seq, dim)
    }
    fn prepend_token_backward(
        &self,
        dtoken: &mut Self::Buf,
        dinp: Option<&mut Self::Buf>,
        dout: &Self::Buf,
        batch: usize,
        seq: usize,
        dim: usize,
    ) -> Result<()> {
        ops::embedding::prepend_token_backward(self, dtoken, dinp, dout, batch, seq, dim)
    }
    fn layernorm_forward(
        &self,
        out: &mut Self::Buf,
        mean: &mut Self::Buf,
        rstd: &mut Self::Buf,
        inp: &Self::Buf,
        weight: &Self::Buf,
        bias: &Self::Buf,
        rows: usize,
        dim: usize,
        eps: f64,
    ) -> Result<()> {
        ops::norm::layernorm_forward(self, out, mean, rstd, inp, weight, bias, rows, dim, eps)
    }
    fn layernorm_backward(
        &self,
        dinp: &mut Self::Buf,
        dweight: &mut Self::Buf,
        dbias: &mut Self::Buf,
        dout: &Self::Buf,
        inp: &Self::Buf,
        weight: &Self::Buf,
        mean: &Self::Buf,
        rstd: &Self::Buf,
        rows: usize,
        dim: usize,
    ) -> Result<()> {
        ops::norm::layernorm_backward(self, dinp, dweight, dbias, dout, inp, weight, mean, rstd, rows, dim)
    }
    fn gelu_forward(&self, out: &mut Self::Buf, inp: &Self::Buf, kind: Activation) -> Result<()> {
        ops::elementwise::gelu_forward(self, out, inp, kind)
    }
    fn gelu_backward(&self, dinp: &mut Self::Buf, inp: &Self::Buf, dout: &Self::Buf, kind: Activation) -> Result<()> {
        ops::elementwise::gelu_backward(self, dinp, inp, dout, kind)
    }
    fn softmax_forward(&self, out: &mut Self::Buf, inp: &Self::Buf, rows: usize, cols: usize) -> Result<()> {
        ops::norm::softmax_forward(self, out, inp, rows, cols)
    }
    fn softmax_backward(
        &self,
        dinp: &mut Self::Buf,
        out: &Self::Buf,
        dout: &Self::Buf,
        rows: usize,
        cols: usize,
    ) -> Result<()> {
        ops::norm::softmax_backward(self, dinp, out, dout, rows, cols)
    }
    fn tanh_forward(&self, out: &mut Self::Buf, inp: &Self::Buf) -> Result<()> {
        ops::elementwise::tanh_forward(self, out, inp)
    }
    fn tanh_backward(&self, dinp: &mut Self::Buf, out: &Self::Buf, dout: &Self::Buf) -> Result<()> {
        ops::elementwise::tanh_backward(self, dinp, out, dout)
    }
    fn residual_forward(&self, out: &mut Self::Buf, a: &Self::Buf, b: &Self::Buf) -> Result<()> {
        ops::elementwise::residual_forward(self, out, a, b)
    }
    fn residual_backward(&self, dacc: &mut Self::Buf, dout: &Self::Buf) -> Result<()> {
        ops::elementwise::residual_backward(self, dacc, dout)
    }
    fn copy_rows(&self, dst: &mut Self::Buf, src: &Self::Buf, c: RowCopy) -> Result<()> {
        ops::elementwise::copy_rows(self, dst, src, c)
    }
    fn dropout_forward(&self, out: &mut Self::Buf, inp: &Self::Buf, p: f32, at: DropoutCoords) -> Result<()> {
        ops::elementwise::dropout(self, "dropout_forward", out, inp, p, at)
    }
    fn dropout_backward(&self, dinp: &mut Self::Buf, dout: &Self::Buf, p: f32, at: DropoutCoords) -> Result<()> {
        ops::elementwise::dropout(self, "dropout_backward", dinp, dout, p, at)
    }
    fn attention_saved_len(&self, d: &AttentionDims) -> usize {
        ops::attention::saved_len(d)
    }
    fn attention_forward(
        &self,
        out: &mut Self::Buf,
        saved: &mut Self::Buf,
        q: &Self::Buf,
        k: &Self::Buf,
        v: &Self::Buf,
        key_mask: Option<&Self::Ids>,
        d: &AttentionDims,
    ) -> Result<()> {
        ops::attention::attention_forward(self, out, saved, q, k, v, key_mask, d)
    }
    fn attention_backward(
        &self,
        dq: &mut Self::Buf,
        dk: &mut Self::Buf,
        dv: &mut Self::Buf,
        dout: &Self::Buf,
        q: &Self::Buf,
        k: &Self::Buf,
        v: &Self::Buf,
        out: &Self::Buf,
        saved: &Self::Buf,
        key_mask: Option<&Self::Ids>,
        d: &AttentionDims,
    ) -> Result<()> {
        ops::attention::attention_backward(self, dq, dk, dv, dout, q, k, v, out, saved, key_mask, d)
    }
    fn first_token_pool_forward(
        &self,
        out: &mut Self::Buf,
        inp: &Self::Buf,
        batch: usize,
        seq: usize,
        dim: usize,
    ) -> Result<()> {
        ops::embedding::first_token_pool_forward(self, out, inp, batch, seq, dim)
    }
    fn first_token_pool_backward(
        &self,
        dinp: &mut Self::Buf,
        dout: &Self::Buf,
        batch: usize,
        seq: usize,
        dim: usize,
    ) -> Result<()> {
        ops::embedding::first_token_pool_backward(self, dinp, dout, batch, seq, dim)
    }
    fn mean_pool_forward(
        &self,
        out: &mut Self::Buf,
        inp: &Self::Buf,
        mask: Option<&Self::Ids>,
        batch: usize,
        seq: usize,
        dim: usize,
    ) -> Result<()> {
        ops::embedding::mean_pool_forward(self, out, inp, mask, batch, seq, dim)
    }
    fn mean_pool_backward(
        &self,
        dinp: &mut Self::Buf,
        dout: &Self::Buf,
        mask: Option<&Self::Ids>,
        batch: usize,
        seq: usize,
        dim: usize,
    ) -> Result<()> {
        ops::embedding::mean_pool_backward(self, dinp, dout, mask, batch, seq, dim)
    }
    fn cross_entropy_forward_backward(
        &self,
        losses: &mut Self::Buf,
        dlogits: Option<&mut Self::Buf>,
        logits: &Self::Buf,
        targets: &Self::Ids,
        rows: usize,
        vocab: usize,
        ignore_index: u32,
        grad_scale: f64,
    ) -> Result<usize> {
        ops::loss::cross_entropy_forward_backward(
            self,
            losses,
            dlogits,
            logits,
            targets,
            rows,
            vocab,
            ignore_index,
            grad_scale,
        )
    }
    fn adamw_update(
        &self,
        param: &mut Self::Buf,
        grad: &Self::Buf,
        m: &mut Self::Buf,
        v: &mut Self::Buf,
        h: &AdamWStep,
    ) -> Result<()> {
        ops::optim::adamw_update(self, param, grad, m, v, h)
    }
    fn sgd_update(
        &self,
        param: &mut Self::Buf,
        grad: &Self::Buf,
        momentum_buf: &mut Self::Buf,
        first: bool,
        h: &SgdStep,
    ) -> Result<()> {
        ops::optim::sgd_update(self, param, grad, momentum_buf, first, h)
    }
    fn sum_squares(&self, x: &Self::Buf) -> Result<f64> {
        ops::optim::sum_squares(self, x)
    }
    fn sum(&self, x: &Self::Buf) -> Result<f64> {
        ops::optim::sum(self, x)
    }
    fn scale(&self, x: &mut Self::Buf, s: f64) -> Result<()> {
        ops::elementwise::scale(self, x, s)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::ffi::c_void;

    /// A device with room for `capacity` bytes that only allocates: all the pool asks of it.
    struct Budget {
        capacity: usize,
        used: Mutex<usize>,
    }

    impl Runtime for Budget {
        fn name(&self) -> String {
            "budget".into()
        }
        fn alloc(&self, bytes: usize) -> Result<DevPtr> {
            let mut used = self.used.lock().unwrap();
            if *used + bytes > self.capacity {
                return Err(Error::Device { what: "budget".into(), message: format!("out of memory for {bytes}") });
            }
            *used += bytes;
            Ok(*used as DevPtr)
        }
        unsafe fn free(&self, _: DevPtr, bytes: usize) {
            *self.used.lock().unwrap() -= bytes;
        }
        fn copy_to_device(&self, _: DevPtr, _: &[u8]) -> Result<()> {
            unreachable!("the pool only allocates")
        }
        fn copy_to_host(&self, _: &mut [u8], _: DevPtr) -> Result<()> {
            unreachable!("the pool only allocates")
        }
        fn copy_on_device(&self, _: DevPtr, _: DevPtr, _: usize) -> Result<()> {
            unreachable!("the pool only allocates")
        }
        fn launch(&self, _: &str, _: &LaunchConfig, _: &mut [*mut c_void]) -> Result<()> {
            unreachable!("the pool only allocates")
        }
        fn synchronize(&self) -> Result<()> {
            unreachable!("the pool only allocates")
        }
        fn as_any(&self) -> &dyn std::any::Any {
            self
        }
    }

    /// Freed buffers of one size do not keep a request of another size from fitting: the pool
    /// gives them back and tries again; what cannot fit even then fails with the device's error.
    #[test]
    fn a_full_device_gives_pooled_buffers_back_and_tries_again() {
        let pool =
            MemoryPool { rt: Arc::new(Budget { capacity: 1000, used: Mutex::new(0) }), free: Default::default() };
        let a = pool.take(600).unwrap();
        pool.give(a, 600);
        let b = pool.take(700).expect("fits once the pooled 600 bytes are freed");
        pool.give(b, 700);
        assert_eq!(pool.take(700).unwrap(), b, "a freed buffer of the same size is reused");
        let err = pool.take(400).expect_err("700 + 400 bytes cannot fit").to_string();
        assert!(err.contains("out of memory for 400"), "{err}");
    }
}
