//! The `cpu` backend: buffers are `Vec<T>` recycled through a per-device pool, ops are the
//! reference kernels of [`crate::ops`] run on the device's own rayon pool (so several CPU
//! "devices" can share a machine as pipeline stages without fighting over one global pool).
//!
//! Why a buffer pool: a fresh multi-megabyte `Vec` per op goes back to the kernel for pages every
//! step (candle spent as much time in page faults as in GEMMs). Buffers return to the pool on
//! drop, keyed by a size class (the length rounded up to one of eight steps per power of two), so
//! batches padded to different lengths still reuse each other's buffers: keyed by exact length,
//! the main job's variable-length text batches missed the pool and spent a quarter of its time
//! in the kernel faulting pages in.
//!
//! Precision: an f32 device computes in f32, or, with [`Precision::Bf16`], runs the linear
//! layers' matrix products on bf16-rounded operands with f32 accumulation
//! ([`crate::ops::gemm_bf16`]); activations, parameters, gradients and optimizer state stay f32
//! (the f32 masters), and every other op is unchanged.

use super::host_pool::HostPool;
use super::{Device, Precision};
use crate::debug;
use crate::error::{Result, check_len};
use crate::ops;
use crate::ops::attention::AttentionDims;
use crate::ops::dropout::DropoutCoords;
use crate::ops::gelu::Activation;
use crate::ops::gemm_bf16::{PackedB, Products};
use crate::ops::matmul::MatRef;
use crate::ops::optim::{AdamWStep, LiveRows, SgdStep};
use crate::ops::patch::PatchDims;
use crate::ops::rows::RowCopy;
use crate::scalar::{DType, Float};
use std::collections::HashMap;
use std::ops::{Deref, DerefMut};
use std::sync::{Arc, Mutex};

/// Free buffers by size class, and how many elements they hold in all.
struct FreeLists<T> {
    by_class: HashMap<usize, Vec<Vec<T>>>,
    cached: usize,
}

/// Free buffers by size class, with a cap on the elements kept.
struct Pool<T> {
    free: Mutex<FreeLists<T>>,
    max_cached_elems: usize,
}

/// Classes above its own a request may take a free buffer from (each an eighth of a power of
/// two larger): batches a little shorter than the last reuse its buffers instead of faulting
/// fresh pages in, as evaluation's batches, longest first, all are.
const LARGER_CLASSES: usize = 2;

/// The size class of a `len`-element buffer: `len` rounded up to a multiple of an eighth of its
/// largest power of two, so a buffer wastes under 12.5 % and lengths a few percent apart share
/// a class.
fn size_class(len: usize) -> usize {
    if len <= 16 {
        return len;
    }
    let shift = usize::BITS - 1 - len.leading_zeros() - 3;
    len.div_ceil(1 << shift) << shift
}

impl<T> Pool<T> {
    /// A free buffer of `class` elements (a [`size_class`]), else of one of the next
    /// [`LARGER_CLASSES`] classes up, if one is cached.
    fn take(&self, class: usize) -> Option<Vec<T>> {
        let mut free = self.free.lock().unwrap_or_else(|e| e.into_inner());
        let mut c = class;
        for _ in 0..=LARGER_CLASSES {
            if let Some(v) = free.by_class.get_mut(&c).and_then(Vec::pop) {
                free.cached -= c;
                return Some(v);
            }
            c = size_class(c + 1);
        }
        None
    }
    fn give(&self, v: Vec<T>) {
        let len = v.len();
        let mut free = self.free.lock().unwrap_or_else(|e| e.into_inner());
        if free.cached + len <= self.max_cached_elems {
            free.cached += len;
            free.by_class.entry(len).or_default().push(v);
        }
    }
}

/// A host buffer owned by a [`CpuDevice`]; derefs to its first `len` elements (`data` holds a
/// whole size class) and returns to the pool on drop.
pub struct CpuBuf<T: Float> {
    data: Vec<T>,
    len: usize,
    pool: Arc<Pool<T>>,
    /// This buffer as a linear layer's weight, packed for bf16 products.
    packs: Mutex<WeightPacks>,
    /// The rows that may hold non-zeros, every other row being +0, where known: an embedding
    /// table's gradient after a step's backwards, and its AdamW moments. Set by the ops that
    /// know it (a fill with zeros, the embedding backward, AdamW), cleared by any other write
    /// (`DerefMut`). Zeroing, the sum of squares and AdamW then skip the other rows: the
    /// same bits, a fraction of the memory traffic (docs/PERF.md).
    live: Option<LiveRows>,
}

/// A weight packed as the B operand of bf16 products, kept while the weight does not change:
/// packed by the first product that reads it after a change, reused by the products after it
/// (the other micro-batches of a step; every step, for a frozen layer), marked stale by any
/// write to the buffer (every write goes through `DerefMut`, which takes `&mut`, so no product
/// can be reading the packs then). Memory: each pack is the weight in bf16 pairs with k padded
/// to a multiple of 2 and n to one of 48, about half the f32 weight; two of them about as much
/// again as the weight itself, which the planner's memory model counts
/// ([`Device::weight_pack_bytes`]).
#[derive(Default)]
struct WeightPacks {
    /// `Wᵀ`: the forward's B.
    transposed: PackedB,
    /// `W`: the input gradient's B.
    plain: PackedB,
    /// Whether `transposed` holds the buffer's current values.
    transposed_fresh: bool,
    /// Whether `plain` does.
    plain_fresh: bool,
}

impl<T: Float> CpuBuf<T> {
    /// Bytes its packs for bf16 products hold (as a linear layer's weight; stale ones too).
    pub fn packed_bytes(&self) -> usize {
        let packs = self.packs.lock().unwrap_or_else(|e| e.into_inner());
        packs.transposed.held_bytes() + packs.plain.held_bytes()
    }

    /// Whether its packs hold its current values: (`Wᵀ`, the forward's; `W`, the input
    /// gradient's).
    pub fn packs_fresh(&self) -> (bool, bool) {
        let packs = self.packs.lock().unwrap_or_else(|e| e.into_inner());
        (packs.transposed_fresh, packs.plain_fresh)
    }
}

impl<T: Float> Deref for CpuBuf<T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        &self.data[..self.len]
    }
}

impl<T: Float> DerefMut for CpuBuf<T> {
    fn deref_mut(&mut self) -> &mut [T] {
        self.live = None;
        let packs = self.packs.get_mut().unwrap_or_else(|e| e.into_inner());
        (packs.transposed_fresh, packs.plain_fresh) = (false, false);
        &mut self.data[..self.len]
    }
}

impl<T: Float> Drop for CpuBuf<T> {
    fn drop(&mut self) {
        if !self.data.is_empty() {
            self.pool.give(std::mem::take(&mut self.data));
        }
    }
}

/// A CPU device computing in `T` (f32 for training, f64 for gradient checks), with its own rayon
/// pool of `threads` threads.
pub struct CpuDevice<T: Float> {
    index: usize,
    threads: usize,
    /// The count it was opened with, which names it ([`Device::set_threads`] lends more).
    own_threads: usize,
    /// The arithmetic of the linear layers' products (bf16 on an f32 device with `Precision::Bf16`).
    products: Products,
    /// The threads its ops run on: its own, or those it shares with the run's other cpu devices.
    threads_pool: Arc<HostPool>,
    buffers: Arc<Pool<T>>,
}

/// Elements the buffer pool keeps at most (1 GiB of f32): enough for every activation of a
/// MiniLM-sized step, bounded so varying shapes cannot grow it without limit.
const DEFAULT_POOL_ELEMS: usize = 1 << 28;

impl<T: Float> CpuDevice<T> {
    /// CPU device number `index` with `threads` worker threads (0 means all cores), computing in `T`.
    pub fn new(index: usize, threads: usize) -> Result<Self> {
        Self::with_precision(index, threads, Precision::F32)
    }

    /// [`new`](Self::new) with a precision: `Bf16` (f32 devices only) rounds the operands of the
    /// linear layers' products to bf16 and accumulates in f32; everything else stays in `T`.
    pub fn with_precision(index: usize, threads: usize, precision: Precision) -> Result<Self> {
        let products = Self::products_for(precision)?;
        let threads = if threads == 0 { std::thread::available_parallelism().map_or(1, |n| n.get()) } else { threads };
        Self::on(index, own_pool(index, threads)?, threads, products)
    }

    /// CPU device number `index` computing on `pool` ([`HostPool::shared`]), which it shares
    /// with other devices of the run; `threads` is its share, the count a planner reckons with.
    pub fn sharing(index: usize, pool: Arc<HostPool>, threads: usize, precision: Precision) -> Result<Self> {
        if !pool.is_shared() {
            return Err(crate::error::config_error("threads", "devices share only a pool made by HostPool::shared"));
        }
        Self::on(index, pool, threads.max(1), Self::products_for(precision)?)
    }

    fn on(index: usize, pool: Arc<HostPool>, threads: usize, products: Products) -> Result<Self> {
        Ok(Self {
            index,
            threads,
            own_threads: threads,
            products,
            threads_pool: pool,
            buffers: Arc::new(Pool {
                free: Mutex::new(FreeLists { by_class: HashMap::new(), cached: 0 }),
                max_cached_elems: DEFAULT_POOL_ELEMS,
            }),
        })
    }

    fn products_for(precision: Precision) -> Result<Products> {
        match precision {
            Precision::F32 => Ok(Products::Native),
            Precision::Bf16 if T::DTYPE == DType::F32 => Ok(Products::Bf16),
            Precision::Bf16 => Err(crate::error::config_error(
                "precision",
                format!("bf16 products need an f32 cpu device, not {:?}", T::DTYPE),
            )),
        }
    }

    /// Runs op `op` (`f`) on this device's thread pool, timed at `PT_DEBUG=2` ([`debug::timed`]).
    fn run<R: Send>(&self, op: &'static str, f: impl FnOnce() -> R + Send) -> R {
        debug::timed(op, || self.threads_pool.install(f))
    }

    /// With bf16 products, `weight` (`[out_dim, in_dim]`) packed as the forward's B
    /// (`transposed`) or the input gradient's, packed now if it changed since it was last packed;
    /// None where products are not packed (f32, or a CPU without the bf16 micro-kernel), and
    /// where another thread holds the packs: the product then packs its own copy, the same bits,
    /// instead of waiting (a thread that waited could be one that holds them, running stolen
    /// rayon work).
    fn weight_packs<'w>(
        &self,
        weight: &'w CpuBuf<T>,
        transposed: bool,
        in_dim: usize,
        out_dim: usize,
    ) -> Option<std::sync::MutexGuard<'w, WeightPacks>> {
        if self.products != Products::Bf16 || weight.len != in_dim * out_dim {
            return None;
        }
        let mut guard = match weight.packs.try_lock() {
            Ok(g) => g,
            Err(std::sync::TryLockError::Poisoned(e)) => e.into_inner(),
            Err(std::sync::TryLockError::WouldBlock) => return None,
        };
        let packs = &mut *guard;
        let w = MatRef::rows(&weight[..], in_dim);
        // (pack, whether it is current, B's view and its k × n)
        let (slot, fresh, b, k, n) = if transposed {
            (&mut packs.transposed, &mut packs.transposed_fresh, w.t(), in_dim, out_dim)
        } else {
            (&mut packs.plain, &mut packs.plain_fresh, w, out_dim, in_dim)
        };
        if !(*fresh && slot.holds(k, n)) {
            *fresh = slot.pack(b, k, n);
        }
        let usable = *fresh;
        usable.then_some(guard)
    }

    /// A buffer of `len` elements: a free one of its size class, else a fresh one.
    fn take(&self, len: usize) -> CpuBuf<T> {
        let class = size_class(len);
        let data = self.buffers.take(class).unwrap_or_else(|| vec![T::ZERO; class]);
        CpuBuf { data, len, pool: self.buffers.clone(), packs: Mutex::default(), live: None }
    }
}

/// The pool of a device that has one of its own.
fn own_pool(index: usize, threads: usize) -> Result<Arc<HostPool>> {
    HostPool::new(&format!("cpu{index}"), threads)
}

impl<T: Float> Device for CpuDevice<T> {
    type Buf = CpuBuf<T>;
    type Ids = Vec<u32>;

    fn name(&self) -> String {
        let products = match self.products {
            // Which kernel: a result says what computed it.
            Products::Bf16 => format!(", bf16 products ({})", crate::ops::gemm_bf16::bf16_path().name()),
            Products::Native => String::new(),
        };
        // Its own count: a device lent another's threads (and a resumed run that lends them
        // again) is still the same device.
        let plural = if self.own_threads == 1 { "" } else { "s" };
        format!("cpu:{} ({:?}{products}, {} thread{plural})", self.index, T::DTYPE, self.own_threads)
    }
    fn weight_pack_bytes(&self, in_dim: usize, out_dim: usize, input_gradient: bool) -> usize {
        match self.products {
            // `Wᵀ` (k = in, n = out) for the forward, `W` (k = out, n = in) for the input gradient.
            Products::Bf16 => {
                PackedB::bytes(in_dim, out_dim) + if input_gradient { PackedB::bytes(out_dim, in_dim) } else { 0 }
            }
            Products::Native => 0,
        }
    }
    fn pack_weight(
        &self,
        weight: &Self::Buf,
        in_dim: usize,
        out_dim: usize,
        forward: bool,
        input_gradient: bool,
    ) -> Result<()> {
        self.run("pack_weight", || {
            // `Wᵀ` (the forward's) and `W` (the input gradient's), each where asked for.
            for (transposed, wanted) in [(true, forward), (false, input_gradient)] {
                if wanted {
                    drop(self.weight_packs(weight, transposed, in_dim, out_dim));
                }
            }
        });
        Ok(())
    }
    fn precision(&self) -> Precision {
        match self.products {
            Products::Native => Precision::F32,
            Products::Bf16 => Precision::Bf16,
        }
    }

    fn activation_dtype(&self) -> DType {
        // Also with bf16 products: activations are stored in `T`, rounded only as the products
        // pack them (what the memory model must count).
        T::DTYPE
    }
    fn len(buf: &Self::Buf) -> usize {
        buf.len
    }
    fn alloc(&self, len: usize) -> Result<Self::Buf> {
        Ok(self.take(len))
    }
    fn alloc_stats(&self, len: usize) -> Result<Self::Buf> {
        self.alloc(len)
    }
    fn zeros(&self, len: usize) -> Result<Self::Buf> {
        let mut b = self.alloc(len)?;
        b.fill(T::ZERO);
        b.live = Some(LiveRows::none());
        Ok(b)
    }
    fn upload(&self, data: &[f32]) -> Result<Self::Buf> {
        let mut b = self.alloc(data.len())?;
        for (d, &s) in b.iter_mut().zip(data) {
            *d = T::from_f64(s as f64);
        }
        Ok(b)
    }
    fn upload_into(&self, dst: &mut Self::Buf, data: &[f32]) -> Result<()> {
        check_len("upload_into", "data", data.len(), dst.len())?;
        let Some(own) = dst.live.take().filter(|l| l.row_len() > 0) else {
            for (d, &s) in dst.iter_mut().zip(data) {
                *d = T::from_f64(s as f64);
            }
            return Ok(());
        };
        // Rows outside `own` are +0 here already: of those, only the ones the sum reaches
        // (another replica's rows) are written. One read of `data`, and a record of its rows.
        let row_len = own.row_len();
        let mut reached = Vec::new();
        for (r, (d, s)) in dst.chunks_mut(row_len).zip(data.chunks(row_len)).enumerate() {
            // Any bit set: a value other than +0 (a −0 counts).
            let nonzero = s.iter().fold(0u32, |acc, x| acc | x.to_bits()) != 0;
            if nonzero || own.contains(r) {
                d.iter_mut().zip(s).for_each(|(d, &s)| *d = T::from_f64(s as f64));
            }
            if nonzero {
                reached.push(r);
            }
        }
        let mut live = LiveRows::none();
        live.add(reached, row_len);
        dst.live = Some(live);
        Ok(())
    }
    fn upload_f64(&self, data: &[f64]) -> Result<Self::Buf> {
        let mut b = self.alloc(data.len())?;
        for (d, &s) in b.iter_mut().zip(data) {
            *d = T::from_f64(s);
        }
        Ok(b)
    }
    fn download(&self, buf: &Self::Buf) -> Result<Vec<f32>> {
        Ok(buf.iter().map(|x| x.to_f64() as f32).collect())
    }
    fn download_extend(&self, buf: &Self::Buf, out: &mut Vec<f32>) -> Result<()> {
        out.extend(buf.iter().map(|x| x.to_f64() as f32));
        Ok(())
    }
    fn download_f64(&self, buf: &Self::Buf) -> Result<Vec<f64>> {
        Ok(buf.iter().map(|x| x.to_f64()).collect())
    }
    fn upload_ids(&self, ids: &[u32]) -> Result<Self::Ids> {
        Ok(ids.to_vec())
    }
    fn copy(&self, dst: &mut Self::Buf, src: &Self::Buf) -> Result<()> {
        check_len("copy", "dst", dst.len(), src.len())?;
        dst.copy_from_slice(src);
        Ok(())
    }
    fn fill(&self, dst: &mut Self::Buf, value: f64) -> Result<()> {
        debug::timed("fill", || {
            // Zeros (+0, not −0) where only some rows can be non-zero: those rows alone.
            let zero = value.to_bits() == 0;
            match dst.live.take() {
                Some(live) if zero => {
                    let (row_len, data) = (live.row_len(), &mut dst[..]);
                    let len = data.len();
                    for r in live.rows() {
                        data[(r * row_len).min(len)..((r + 1) * row_len).min(len)].fill(T::ZERO);
                    }
                }
                _ => dst.fill(T::from_f64(value)),
            }
            dst.live = zero.then(LiveRows::none);
            Ok(())
        })
    }
    fn synchronize(&self) -> Result<()> {
        Ok(())
    }
    fn threads(&self) -> Option<usize> {
        Some(self.threads)
    }
    fn set_threads(&mut self, threads: usize) -> Result<()> {
        // A shared pool's idle threads already take pieces of this device's ops: only the
        // count the planner reckons with changes.
        let threads = threads.max(1);
        if threads != self.threads && !self.threads_pool.is_shared() {
            self.threads_pool = own_pool(self.index, threads)?;
        }
        self.threads = threads;
        Ok(())
    }
    fn host_pool(&self) -> Option<&Arc<HostPool>> {
        Some(&self.threads_pool)
    }
    fn enter<R: Send>(&self, f: impl FnOnce() -> R + Send) -> R {
        self.threads_pool.enter(f)
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
        self.run("linear_forward", || {
            let packs = self.weight_packs(weight, true, in_dim, out_dim);
            let wt = packs.as_ref().map(|p| &p.transposed);
            ops::linear::linear_forward_in(
                self.products,
                out,
                inp,
                weight,
                wt,
                bias.map(|b| &b[..]),
                rows,
                in_dim,
                out_dim,
            )
        })
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
        self.run("linear_backward", || {
            let products = self.products;
            if let Some(dinp) = dinp {
                // The input gradient alone first, so the packs are let go before the rest.
                let packs = self.weight_packs(weight, false, in_dim, out_dim);
                let w = packs.as_ref().map(|p| &p.plain);
                ops::linear::linear_backward_in(
                    products,
                    Some(dinp),
                    None,
                    None,
                    dout,
                    inp,
                    weight,
                    w,
                    rows,
                    in_dim,
                    out_dim,
                )?;
            }
            let (dweight, dbias) = (dweight.map(|b| &mut b[..]), dbias.map(|b| &mut b[..]));
            ops::linear::linear_backward_in(
                products, None, dweight, dbias, dout, inp, weight, None, rows, in_dim, out_dim,
            )
        })
    }
    fn embedding_forward(
        &self,
        out: &mut Self::Buf,
        ids: &Self::Ids,
        table: &Self::Buf,
        dim: usize,
        accumulate: bool,
    ) -> Result<()> {
        self.run("embedding_forward", || ops::embedding::embedding_forward(out, ids, table, dim, accumulate))
    }
    fn embedding_backward(&self, dtable: &mut Self::Buf, ids: &Self::Ids, dout: &Self::Buf, dim: usize) -> Result<()> {
        let live = dtable.live.take();
        self.run("embedding_backward", || ops::embedding::embedding_backward(dtable, ids, dout, dim))?;
        // Only the rows `ids` names were added to.
        dtable.live =
            live.filter(|_| dim > 0).and_then(|mut l| l.add(ids.iter().map(|&i| i as usize), dim).then_some(l));
        Ok(())
    }
    fn patch_forward(&self, out: &mut Self::Buf, img: &Self::Buf, d: PatchDims) -> Result<()> {
        self.run("patch_forward", || ops::patch::patch_forward(out, img, d))
    }
    fn patch_backward(&self, dimg: &mut Self::Buf, dout: &Self::Buf, d: PatchDims) -> Result<()> {
        self.run("patch_backward", || ops::patch::patch_backward(dimg, dout, d))
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
        self.run("prepend_token_forward", || ops::patch::prepend_token_forward(out, token, inp, batch, seq, dim))
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
        self.run("prepend_token_backward", || {
            ops::patch::prepend_token_backward(dtoken, dinp.map(|b| &mut b[..]), dout, batch, seq, dim)
        })
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
        self.run("layernorm_forward", || {
            ops::layernorm::layernorm_forward(out, mean, rstd, inp, weight, bias, rows, dim, eps)
        })
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
        self.run("layernorm_backward", || {
            ops::layernorm::layernorm_backward(dinp, dweight, dbias, dout, inp, weight, mean, rstd, rows, dim)
        })
    }
    fn gelu_forward(&self, out: &mut Self::Buf, inp: &Self::Buf, kind: Activation) -> Result<()> {
        self.run("gelu_forward", || ops::gelu::gelu_forward(out, inp, kind))
    }
    fn gelu_backward(&self, dinp: &mut Self::Buf, inp: &Self::Buf, dout: &Self::Buf, kind: Activation) -> Result<()> {
        self.run("gelu_backward", || ops::gelu::gelu_backward(dinp, inp, dout, kind))
    }
    fn softmax_forward(&self, out: &mut Self::Buf, inp: &Self::Buf, rows: usize, cols: usize) -> Result<()> {
        self.run("softmax_forward", || ops::softmax::softmax_forward(out, inp, rows, cols))
    }
    fn softmax_backward(
        &self,
        dinp: &mut Self::Buf,
        out: &Self::Buf,
        dout: &Self::Buf,
        rows: usize,
        cols: usize,
    ) -> Result<()> {
        self.run("softmax_backward", || ops::softmax::softmax_backward(dinp, out, dout, rows, cols))
    }
    fn tanh_forward(&self, out: &mut Self::Buf, inp: &Self::Buf) -> Result<()> {
        self.run("tanh_forward", || ops::tanh::tanh_forward(out, inp))
    }
    fn tanh_backward(&self, dinp: &mut Self::Buf, out: &Self::Buf, dout: &Self::Buf) -> Result<()> {
        self.run("tanh_backward", || ops::tanh::tanh_backward(dinp, out, dout))
    }
    fn residual_forward(&self, out: &mut Self::Buf, a: &Self::Buf, b: &Self::Buf) -> Result<()> {
        self.run("residual_forward", || ops::residual::residual_forward(out, a, b))
    }
    fn residual_backward(&self, dacc: &mut Self::Buf, dout: &Self::Buf) -> Result<()> {
        self.run("residual_backward", || ops::residual::residual_backward(dacc, dout))
    }
    fn copy_rows(&self, dst: &mut Self::Buf, src: &Self::Buf, c: RowCopy) -> Result<()> {
        self.run("copy_rows", || ops::rows::copy_rows(dst, src, c))
    }
    fn dropout_forward(&self, out: &mut Self::Buf, inp: &Self::Buf, p: f32, at: DropoutCoords) -> Result<()> {
        self.run("dropout_forward", || ops::dropout::dropout_forward(out, inp, p, at))
    }
    fn dropout_backward(&self, dinp: &mut Self::Buf, dout: &Self::Buf, p: f32, at: DropoutCoords) -> Result<()> {
        self.run("dropout_backward", || ops::dropout::dropout_backward(dinp, dout, p, at))
    }
    fn attention_saved_len(&self, d: &AttentionDims) -> usize {
        d.batch * d.heads * d.q_len * d.kv_len
    }
    fn attention_forward(
        &self,
        out: &mut Self::Buf,
        probs: &mut Self::Buf,
        q: &Self::Buf,
        k: &Self::Buf,
        v: &Self::Buf,
        key_mask: Option<&Self::Ids>,
        d: &AttentionDims,
    ) -> Result<()> {
        self.run("attention_forward", || {
            ops::attention::attention_forward(out, probs, q, k, v, key_mask.map(|m| &m[..]), d)
        })
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
        _out: &Self::Buf,
        probs: &Self::Buf,
        key_mask: Option<&Self::Ids>,
        d: &AttentionDims,
    ) -> Result<()> {
        self.run("attention_backward", || {
            ops::attention::attention_backward(dq, dk, dv, dout, q, k, v, probs, key_mask.map(|m| &m[..]), d)
        })
    }
    fn first_token_pool_forward(
        &self,
        out: &mut Self::Buf,
        inp: &Self::Buf,
        batch: usize,
        seq: usize,
        dim: usize,
    ) -> Result<()> {
        self.run("first_token_pool_forward", || ops::pooling::first_token_pool_forward(out, inp, batch, seq, dim))
    }
    fn first_token_pool_backward(
        &self,
        dinp: &mut Self::Buf,
        dout: &Self::Buf,
        batch: usize,
        seq: usize,
        dim: usize,
    ) -> Result<()> {
        self.run("first_token_pool_backward", || ops::pooling::first_token_pool_backward(dinp, dout, batch, seq, dim))
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
        self.run("mean_pool_forward", || {
            ops::pooling::mean_pool_forward(out, inp, mask.map(|m| &m[..]), batch, seq, dim)
        })
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
        self.run("mean_pool_backward", || {
            ops::pooling::mean_pool_backward(dinp, dout, mask.map(|m| &m[..]), batch, seq, dim)
        })
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
        self.run("cross_entropy_forward_backward", || {
            ops::cross_entropy::cross_entropy_forward_backward(
                losses,
                dlogits.map(|b| &mut b[..]),
                logits,
                targets,
                rows,
                vocab,
                ignore_index,
                grad_scale,
            )
        })
    }
    fn adamw_update(
        &self,
        param: &mut Self::Buf,
        grad: &Self::Buf,
        m: &mut Self::Buf,
        v: &mut Self::Buf,
        h: &AdamWStep,
    ) -> Result<()> {
        // Rows where the gradient and both moments are +0 take only their weight decay.
        // Moments that came without the record of their rows (loaded from a checkpoint, or
        // handed to another device by a re-plan) are scanned for it once, at the width of the
        // gradient's rows: from then on the update skips the rows no batch has reached, as it
        // did before.
        if let Some(row_len) = grad.live.as_ref().map(LiveRows::row_len).filter(|&r| r > 0) {
            for moments in [&mut *m, &mut *v] {
                if moments.live.is_none() {
                    moments.live = Some(LiveRows::reached(&moments[..], row_len));
                }
            }
        }
        let live = match (&grad.live, &m.live, &v.live) {
            (Some(g), Some(m), Some(v)) => g.union(m).and_then(|gm| gm.union(v)),
            _ => None,
        };
        let zero_outside =
            self.run("adamw_update_live", || ops::optim::adamw_update_live(param, grad, m, v, h, live.as_ref()))?;
        // The moments stay +0 outside the rows the gradient or they already reached.
        let live = live.filter(|_| zero_outside);
        (m.live, v.live) = (live.clone(), live);
        Ok(())
    }
    fn sgd_update(
        &self,
        param: &mut Self::Buf,
        grad: &Self::Buf,
        momentum_buf: &mut Self::Buf,
        first: bool,
        h: &SgdStep,
    ) -> Result<()> {
        self.run("sgd_update", || ops::optim::sgd_update(param, grad, momentum_buf, first, h))
    }
    fn sum_squares(&self, x: &Self::Buf) -> Result<f64> {
        Ok(self.run("sum_squares_live", || ops::optim::sum_squares_live(x, x.live.as_ref())))
    }
    fn sum(&self, x: &Self::Buf) -> Result<f64> {
        Ok(x.iter().map(|v| v.to_f64()).sum())
    }
    fn scale(&self, x: &mut Self::Buf, s: f64) -> Result<()> {
        self.run("scale_inplace", || ops::optim::scale_inplace(x, s));
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An embedding table's gradient and AdamW moments know their live rows through a run of
    /// steps (zero, backward, norm, update), and every value equals the full ops on plain slices
    /// to the bit: the gradient, its sum of squares, the weights and both moments. The live
    /// rows are the batches' ids (the moments': every id so far); any other write forgets them.
    #[test]
    fn live_rows_follow_an_embedding_through_steps() {
        use crate::testing::Rng;
        let (rows, dim) = (700, 24);
        let dev = CpuDevice::<f32>::new(0, 2).unwrap();
        let mut rng = Rng::new(8);
        let table: Vec<f32> = rng.vec(rows * dim, 1.0).into_iter().map(|x| x as f32).collect();
        let mut p = dev.upload(&table).unwrap();
        let (mut g, mut m, mut v) =
            (dev.zeros(rows * dim).unwrap(), dev.zeros(rows * dim).unwrap(), dev.zeros(rows * dim).unwrap());
        let (mut want_p, mut want_m, mut want_v) = (table.clone(), vec![0f32; rows * dim], vec![0f32; rows * dim]);
        let mut seen = std::collections::BTreeSet::new();
        for step in 1..=4u64 {
            dev.fill(&mut g, 0.0).unwrap();
            let ids: Vec<u32> = (0..9).map(|i| ((i * 131 + step * 17) % rows as u64) as u32).collect();
            let dout: Vec<f32> = rng.vec(ids.len() * dim, 1.0).into_iter().map(|x| x as f32).collect();
            dev.embedding_backward(&mut g, &ids, &dev.upload(&dout).unwrap(), dim).unwrap();
            let mut want_g = vec![0f32; rows * dim];
            ops::embedding::embedding_backward(&mut want_g, &ids, &dout, dim).unwrap();
            let batch: std::collections::BTreeSet<usize> = ids.iter().map(|&i| i as usize).collect();
            assert_eq!(g.live.as_ref().unwrap().rows().collect::<Vec<_>>(), batch.iter().copied().collect::<Vec<_>>());
            assert_eq!(dev.sum_squares(&g).unwrap().to_bits(), ops::optim::sum_squares(&want_g).to_bits());
            let h =
                AdamWStep { lr: 1e-2, beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.1, step, grad_scale: 0.5 };
            dev.adamw_update(&mut p, &g, &mut m, &mut v, &h).unwrap();
            ops::optim::adamw_update(&mut want_p, &want_g, &mut want_m, &mut want_v, &h).unwrap();
            seen.extend(batch);
            assert_eq!(m.live.as_ref().unwrap().rows().collect::<Vec<_>>(), seen.iter().copied().collect::<Vec<_>>());
            let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&g), bits(&want_g), "step {step}: gradient");
            assert_eq!(bits(&p), bits(&want_p), "step {step}: weights");
            assert_eq!((bits(&m), bits(&v)), (bits(&want_m), bits(&want_v)), "step {step}: moments");
        }
        // A resume: the moments come back from a checkpoint without their rows' record (and
        // here with a −0 in a row no batch reached, which the full update turns into +0). The
        // update finds the rows they reach, and from then on skips the others again: the same
        // bits as the full update, and the moments' record holds every row reached so far.
        let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
        let unreached = (0..rows).find(|r| !seen.contains(r)).unwrap();
        want_v[unreached * dim + 1] = -0.0;
        (m, v) = (dev.upload(&want_m).unwrap(), dev.upload(&want_v).unwrap());
        assert!(m.live.is_none() && v.live.is_none(), "loaded moments come without a record");
        dev.fill(&mut g, 0.0).unwrap();
        let ids: Vec<u32> = vec![3, 3, 11];
        let dout: Vec<f32> = rng.vec(ids.len() * dim, 1.0).into_iter().map(|x| x as f32).collect();
        dev.embedding_backward(&mut g, &ids, &dev.upload(&dout).unwrap(), dim).unwrap();
        let mut want_g = vec![0f32; rows * dim];
        ops::embedding::embedding_backward(&mut want_g, &ids, &dout, dim).unwrap();
        let h =
            AdamWStep { lr: 1e-2, beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.1, step: 5, grad_scale: 0.5 };
        dev.adamw_update(&mut p, &g, &mut m, &mut v, &h).unwrap();
        ops::optim::adamw_update(&mut want_p, &want_g, &mut want_m, &mut want_v, &h).unwrap();
        assert_eq!(bits(&p), bits(&want_p), "after the resume: weights");
        assert_eq!((bits(&m), bits(&v)), (bits(&want_m), bits(&want_v)), "after the resume: moments");
        seen.extend([3, 11, unreached]);
        assert_eq!(m.live.as_ref().unwrap().rows().collect::<Vec<_>>(), seen.iter().copied().collect::<Vec<_>>());
        assert_eq!(LiveRows::reached(&[0.0f32, 0.0, f32::NAN, 0.0, 0.0, 0.0], 2).rows().collect::<Vec<_>>(), [1]);
        // A write the bookkeeping cannot follow (here into a row no batch reached): the rows are
        // forgotten, so the norm and the next zeroing see it.
        let dead = (0..rows).find(|r| !seen.contains(r)).unwrap();
        g[dead * dim] = 3.0;
        assert!(g.live.is_none());
        assert!(dev.sum_squares(&g).unwrap() >= 9.0);
        dev.fill(&mut g, 0.0).unwrap();
        assert!(g.iter().all(|&x| x.to_bits() == 0));
        assert_eq!(g.live, Some(LiveRows::none()));
        // A fill with anything but +0 leaves nothing known.
        dev.fill(&mut g, -0.0).unwrap();
        assert!(g.live.is_none());
        // Nor does an update whose clipping coefficient is not finite: it makes NaNs of the
        // moments' unreached rows.
        let mut g = dev.zeros(rows * dim).unwrap();
        dev.embedding_backward(&mut g, &vec![3], &dev.upload(&vec![1.0; dim]).unwrap(), dim).unwrap();
        let h = AdamWStep {
            lr: 1e-2,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.1,
            step: 5,
            grad_scale: f64::INFINITY,
        };
        dev.adamw_update(&mut p, &g, &mut m, &mut v, &h).unwrap();
        assert!(m.live.is_none() && v.live.is_none());
        assert!(m[dead * dim].is_nan());
    }

    /// An embedding table's gradient summed across two replicas (on the host, as the ring
    /// does) and written back keeps a record of its rows: the union of the replicas' rows, less
    /// any that the sum made +0, with a −0 counted. Zeroing, the norm and AdamW then give the
    /// full update's bits; a gradient written back without a record stays without one.
    #[test]
    fn a_gradient_summed_across_replicas_keeps_its_rows() {
        let (rows, dim) = (300, 16);
        let dev = CpuDevice::<f32>::new(0, 2).unwrap();
        let mut grads = [dev.zeros(rows * dim).unwrap(), dev.zeros(rows * dim).unwrap()];
        // Replica 0 reaches rows 4, 9 and 40; replica 1 rows 9, 77 and 250. Row 40's values
        // cancel in the sum (+0); row 77 carries a −0 beside its zeros.
        let dout = |vals: [f32; 3]| dev.upload(&vals.iter().flat_map(|&v| vec![v; dim]).collect::<Vec<_>>()).unwrap();
        dev.embedding_backward(&mut grads[0], &vec![4, 9, 40], &dout([1.0, 2.0, 0.5]), dim).unwrap();
        dev.embedding_backward(&mut grads[1], &vec![9, 77, 250], &dout([3.0, 0.0, -1.5]), dim).unwrap();
        let mut sum: Vec<f32> = grads[0].iter().zip(grads[1].iter()).map(|(a, b)| a + b).collect();
        sum[40 * dim..41 * dim].fill(0.0);
        sum[77 * dim + 3] = -0.0;
        for g in &mut grads {
            dev.upload_into(g, &sum).unwrap();
            assert_eq!(&g[..], &sum[..]);
            assert_eq!(g.live.as_ref().unwrap().rows().collect::<Vec<_>>(), [4, 9, 77, 250]);
        }
        let (mut p, mut m, mut v) = (
            dev.upload(&vec![0.25; rows * dim]).unwrap(),
            dev.zeros(rows * dim).unwrap(),
            dev.zeros(rows * dim).unwrap(),
        );
        let (mut want_p, mut want_m, mut want_v) =
            (vec![0.25f32; rows * dim], vec![0f32; rows * dim], vec![0f32; rows * dim]);
        let h =
            AdamWStep { lr: 1e-2, beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.1, step: 1, grad_scale: 0.5 };
        dev.adamw_update(&mut p, &grads[0], &mut m, &mut v, &h).unwrap();
        ops::optim::adamw_update(&mut want_p, &sum, &mut want_m, &mut want_v, &h).unwrap();
        let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
        assert_eq!((bits(&p), bits(&m), bits(&v)), (bits(&want_p), bits(&want_m), bits(&want_v)));
        assert_eq!(m.live.as_ref().unwrap().rows().collect::<Vec<_>>(), [4, 9, 77, 250]);
        assert_eq!(dev.sum_squares(&grads[0]).unwrap().to_bits(), ops::optim::sum_squares(&sum).to_bits());
        dev.fill(&mut grads[0], 0.0).unwrap();
        assert!(grads[0].iter().all(|&x| x.to_bits() == 0), "the zeroing reaches every row of the sum");
        // A dense gradient (no record) written back stays dense.
        let mut dense = dev.upload(&vec![1.0; rows * dim]).unwrap();
        dev.upload_into(&mut dense, &sum).unwrap();
        assert!(dense.live.is_none());
        assert_eq!(&dense[..], &sum[..]);
        assert!(dev.upload_into(&mut dense, &sum[1..]).is_err(), "a length that does not match");
    }

    /// With bf16 products the device packs a weight once and reuses it, and a write to the
    /// weight (here through the AdamW kernel, then directly) is seen by the next product: every
    /// result equals the op computed from the plain slices, to the bit.
    #[test]
    fn packed_weights_follow_every_write() {
        use crate::testing::Rng;
        let (rows, in_dim, out_dim) = (24, 40, 56);
        let dev = CpuDevice::<f32>::with_precision(0, 1, Precision::Bf16).unwrap();
        let mut rng = Rng::new(5);
        let host = |rng: &mut Rng, n: usize| rng.vec(n, 1.0).into_iter().map(|x| x as f32).collect::<Vec<f32>>();
        let (x, dy) = (host(&mut rng, rows * out_dim), host(&mut rng, rows * out_dim));
        let mut w = dev.upload(&host(&mut rng, out_dim * in_dim)).unwrap();
        let check = |w: &CpuBuf<f32>, (in_dim, out_dim): (usize, usize), when: &str| {
            let (x, dy) = (&x[..rows * in_dim], &dy[..rows * out_dim]);
            let (xb, dyb) = (dev.upload(x).unwrap(), dev.upload(dy).unwrap());
            let mut y = dev.zeros(rows * out_dim).unwrap();
            let mut dx = dev.zeros(rows * in_dim).unwrap();
            dev.linear_forward(&mut y, &xb, w, None, rows, in_dim, out_dim).unwrap();
            dev.linear_backward(Some(&mut dx), None, None, &dyb, &xb, w, rows, in_dim, out_dim).unwrap();
            let mut want_y = vec![0.0; rows * out_dim];
            let mut want_dx = vec![0.0; rows * in_dim];
            let bf16 = Products::Bf16;
            ops::linear::linear_forward_in(bf16, &mut want_y, x, w, None, None, rows, in_dim, out_dim).unwrap();
            ops::linear::linear_backward_in(
                bf16,
                Some(&mut want_dx),
                None,
                None,
                dy,
                x,
                w,
                None,
                rows,
                in_dim,
                out_dim,
            )
            .unwrap();
            for (what, got, want) in [("forward", &y[..], &want_y[..]), ("input gradient", &dx[..], &want_dx[..])] {
                let differs = got.iter().zip(want).position(|(g, w)| g.to_bits() != w.to_bits());
                assert_eq!(differs, None, "{what} {when}: first different element");
            }
        };
        let dims = (in_dim, out_dim);
        check(&w, dims, "first");
        check(&w, dims, "again, from the packs");
        check(&w, (out_dim, in_dim), "read as a weight of the transposed shape");
        check(&w, dims, "in its own shape again");
        let grad = dev.upload(&host(&mut rng, out_dim * in_dim)).unwrap();
        let (mut m, mut v) = (dev.zeros(out_dim * in_dim).unwrap(), dev.zeros(out_dim * in_dim).unwrap());
        let step =
            AdamWStep { lr: 0.5, beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.0, step: 1, grad_scale: 1.0 };
        dev.adamw_update(&mut w, &grad, &mut m, &mut v, &step).unwrap();
        check(&w, dims, "after an AdamW step");
        w[3] = 7.0;
        check(&w, dims, "after a direct write");
        // Packed ahead (what a pipeline stage does while it waits): the packs asked for, and
        // only those, become current, and the products read them.
        let packs = crate::ops::gemm_bf16::bf16_path() != crate::ops::gemm_bf16::Bf16Path::Fallback;
        w[5] = -3.0;
        assert_eq!(w.packs_fresh(), (false, false), "a write leaves no pack current");
        dev.pack_weight(&w, in_dim, out_dim, true, false).unwrap();
        assert_eq!(w.packs_fresh(), (packs, false), "the forward's pack alone");
        dev.pack_weight(&w, in_dim, out_dim, false, true).unwrap();
        assert_eq!(w.packs_fresh(), (packs, packs), "and the input gradient's");
        check(&w, dims, "packed ahead");
    }

    /// Two threads entering one device at once both finish: the second runs outside the pool
    /// instead of queueing behind the first, which here waits for it (a pipeline worker waits
    /// for its peers the same way).
    #[test]
    fn a_second_thread_entering_runs_beside_the_first() {
        let dev = Arc::new(CpuDevice::<f32>::new(0, 1).unwrap());
        let barrier = Arc::new(std::sync::Barrier::new(2));
        let (tx, rx) = std::sync::mpsc::channel();
        for _ in 0..2 {
            let (dev, barrier, tx) = (dev.clone(), barrier.clone(), tx.clone());
            std::thread::spawn(move || {
                let y = dev.enter(|| {
                    barrier.wait();
                    let (x, w) = (dev.upload(&[1.0, 2.0]).unwrap(), dev.upload(&[3.0, 4.0]).unwrap());
                    let mut y = dev.zeros(1).unwrap();
                    dev.linear_forward(&mut y, &x, &w, None, 1, 2, 1).unwrap();
                    y[0]
                });
                tx.send(y).ok();
            });
        }
        for _ in 0..2 {
            let y = rx.recv_timeout(std::time::Duration::from_secs(30)).expect("neither thread waits behind the other");
            assert_eq!(y, 11.0);
        }
    }

    /// Only a pool made to be shared takes several devices: a device's own pool installs
    /// whole steps, which on a pool other devices queue ops on could deadlock.
    #[test]
    fn devices_share_only_a_shared_pool() {
        let own = HostPool::new("t", 1).unwrap();
        let e = CpuDevice::<f32>::sharing(0, own, 1, Precision::F32).err().map(|e| e.to_string()).unwrap_or_default();
        assert!(e.contains("HostPool::shared"), "{e}");
        assert!(CpuDevice::<f32>::sharing(0, HostPool::shared("t", 1).unwrap(), 1, Precision::F32).is_ok());
    }

    #[test]
    fn buffers_are_recycled_by_length() {
        let dev = CpuDevice::<f32>::new(0, 1).unwrap();
        let a = dev.upload(&[1.0, 2.0, 3.0]).unwrap();
        let ptr = a.as_ptr();
        drop(a);
        let b = dev.alloc(3).unwrap();
        assert_eq!(b.as_ptr(), ptr, "a freed buffer of the same length is reused");
        let z = dev.zeros(3).unwrap();
        assert!(z.iter().all(|&x| x == 0.0));
    }

    /// Where a buffer of `len` elements lay, now back in `dev`'s pool.
    fn freed_buffer(dev: &CpuDevice<f32>, len: usize) -> *const f32 {
        dev.alloc(len).unwrap().as_ptr()
    }

    #[test]
    fn lengths_in_one_size_class_share_buffers() {
        // A batch padded to 61 tokens reuses the buffers of one padded to 64.
        let dev = CpuDevice::<f32>::new(0, 1).unwrap();
        let ptr = freed_buffer(&dev, 32 * 64 * 384);
        let mut b = dev.alloc(32 * 61 * 384).unwrap();
        assert_eq!(b.as_ptr(), ptr, "a freed buffer of the same size class is reused");
        assert_eq!(CpuDevice::len(&b), 32 * 61 * 384);
        assert_eq!(b.len(), 32 * 61 * 384);
        b.fill(1.0);
        drop(b);
        // Another class: a fresh buffer; zeros clears a reused one.
        let c = dev.zeros(32 * 40 * 384).unwrap();
        assert_ne!(c.as_ptr(), ptr);
        let z = dev.zeros(32 * 63 * 384).unwrap();
        assert_eq!(z.as_ptr(), ptr);
        assert!(z.iter().all(|&x| x == 0.0));
    }

    /// A request a class or two below a freed buffer takes it (evaluation's batches, longest
    /// first, each a little shorter than the last); further below, a fresh one.
    #[test]
    fn a_slightly_shorter_batch_reuses_a_larger_free_buffer() {
        let dev = CpuDevice::<f32>::new(0, 1).unwrap();
        let ptr = freed_buffer(&dev, 32 * 64 * 384);
        // 56 tokens: one class below 64's.
        assert_eq!(size_class(32 * 64 * 384), size_class(size_class(32 * 56 * 384) + 1));
        let b = dev.zeros(32 * 56 * 384).unwrap();
        assert_eq!(b.as_ptr(), ptr, "one class up is taken");
        assert_eq!(b.len(), 32 * 56 * 384);
        assert!(b.iter().all(|&x| x == 0.0));
        drop(b);
        // The buffer goes back to its own class: a 64-token batch finds it there.
        assert_eq!(dev.alloc(32 * 64 * 384).unwrap().as_ptr(), ptr);
        // 32 tokens: half the size, too far below to hold on to twice the memory.
        assert_ne!(dev.alloc(32 * 32 * 384).unwrap().as_ptr(), ptr);
    }

    #[test]
    fn size_classes_waste_under_an_eighth() {
        for len in (0..20).chain([100, 1000, 4097, 786_432, 123_456_789]) {
            let class = size_class(len);
            assert!(class >= len && (class - len) * 8 <= len, "len {len} → class {class}");
            assert_eq!(size_class(class), class, "a class is its own class");
        }
        assert_eq!(size_class(32 * 61 * 384), size_class(32 * 64 * 384));
    }

    #[test]
    fn copy_checks_lengths() {
        let dev = CpuDevice::<f64>::new(0, 1).unwrap();
        let mut a = dev.zeros(2).unwrap();
        let b = dev.zeros(3).unwrap();
        let err = dev.copy(&mut a, &b).unwrap_err();
        assert!(err.to_string().contains("copy: `dst` has 2 elements, expected 3"), "{err}");
    }
}
