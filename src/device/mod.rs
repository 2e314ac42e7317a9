//! The device abstraction: a `Device` owns buffers and implements every op (forward and
//! backward), the optimizer kernels, reductions and copies. Model, optimizer and (later) pipeline
//! code are generic over `D: Device` and never touch host memory except through
//! `upload`/`download`, so the `cpu`, `cuda` and `cuda-emu` backends run the same model code.
//!
//! Op semantics are those of the reference kernels in [`crate::ops`]: `*_backward` writes input
//! gradients and adds into parameter gradients; every buffer length is checked.

pub mod cpu;
pub mod cuda;
pub mod emu;
pub mod gpu;
pub mod host_pool;
pub mod kernels;

pub use cpu::{CpuBuf, CpuDevice};
pub use gpu::{GpuBuf, GpuDevice, GpuIds, Precision};
pub use host_pool::HostPool;

use crate::error::{Error, Result, check_len};
use crate::ops::attention::AttentionDims;
use crate::ops::dropout::DropoutCoords;
use crate::ops::gelu::Activation;
use crate::ops::optim::{AdamWStep, SgdStep};
use crate::ops::patch::PatchDims;
use crate::ops::rows::RowCopy;
use crate::scalar::DType;

/// A compute device and its op set. Buffers (`Buf`: floats, `Ids`: `u32` token ids, labels and
/// masks) are handles owned by the device that created them.
#[allow(clippy::too_many_arguments)]
pub trait Device: Send + Sync + 'static {
    /// A buffer of floating-point elements in the device's compute dtype.
    type Buf: Send + Sync;
    /// A buffer of `u32` (token ids, positions, labels, masks).
    type Ids: Send + Sync;

    // ---- identity and memory -----------------------------------------------------------
    /// Human-readable name, e.g. `cpu:0 (f32, 2 threads)`.
    fn name(&self) -> String;
    /// The dtype activations are stored in (bf16 on a bf16 GPU device, whose parameters keep
    /// f32 masters; the element type itself on the cpu backend, also where its products round
    /// their operands to bf16).
    fn activation_dtype(&self) -> DType;
    /// The precision the device was opened with (`--precision`): what a checkpoint records,
    /// so that a run resumed in another names the change.
    fn precision(&self) -> Precision;
    /// Bytes this device keeps beside a linear layer's `out_dim × in_dim` weight for its
    /// products, where the layer passes an `input_gradient` back or not: the cpu backend's bf16
    /// packs of `Wᵀ` (the forward's) and `W` (the input gradient's;
    /// [`crate::ops::gemm_bf16::PackedB`]), none elsewhere. The planner's memory model counts
    /// them with the weights.
    fn weight_pack_bytes(&self, in_dim: usize, out_dim: usize, input_gradient: bool) -> usize {
        let _ = (in_dim, out_dim, input_gradient);
        0
    }
    /// The largest attention head dimension the device's kernels run, where they have one
    /// (the GPU kernels hold a row of a head in registers): a run checks its model against it
    /// before it starts, not at the first forward.
    fn max_head_dim(&self) -> Option<usize> {
        None
    }
    /// Makes those packs of `weight` now, where they are stale: the forward's (`forward`),
    /// the input gradient's (`input_gradient`), or both. The products would make them at
    /// their first use; a pipeline stage calls this where it would otherwise wait, so that
    /// work leaves the step's critical path. Changes no result. A no-op where nothing is packed.
    fn pack_weight(
        &self,
        weight: &Self::Buf,
        in_dim: usize,
        out_dim: usize,
        forward: bool,
        input_gradient: bool,
    ) -> Result<()> {
        let _ = (weight, in_dim, out_dim, forward, input_gradient);
        Ok(())
    }
    /// Elements in `buf`.
    fn len(buf: &Self::Buf) -> usize;
    /// A buffer of `len` elements with unspecified contents (reused allocations).
    fn alloc(&self, len: usize) -> Result<Self::Buf>;
    /// A buffer of `len` elements for per-row statistics and losses (LayerNorm mean and rstd,
    /// attention's saved state, per-row losses): f32 on every device, even where activations are
    /// bf16, because these values feed divisions and exponentials in the backward.
    fn alloc_stats(&self, len: usize) -> Result<Self::Buf>;
    /// A buffer of `len` zeros, of the parameters' dtype (f32 on every GPU).
    fn zeros(&self, len: usize) -> Result<Self::Buf>;
    /// Copies host f32 values into a new buffer of the parameters' dtype (weights, gradients,
    /// optimizer state: f32 on every GPU; the element type on the cpu backend).
    fn upload(&self, data: &[f32]) -> Result<Self::Buf>;
    /// `dst ← data` (same length): a gradient summed with other replicas' or processes'. Where
    /// the backend records the rows that may be non-zero (an embedding table's gradient on the
    /// cpu), the sum keeps a record: the rows of `data` not all +0, the union of the replicas'
    /// rows, so that zeroing, the norm and AdamW go on skipping the others.
    fn upload_into(&self, dst: &mut Self::Buf, data: &[f32]) -> Result<()> {
        check_len("upload_into", "data", data.len(), Self::len(dst))?;
        *dst = self.upload(data)?;
        Ok(())
    }
    /// Copies host f32 values into a new buffer of the [activation dtype](Self::activation_dtype)
    /// (rounding to bf16 on a bf16 GPU): hidden states and their gradients that reach a stage
    /// from another device, a process or the activation cache.
    fn upload_activations(&self, data: &[f32]) -> Result<Self::Buf> {
        self.upload(data)
    }
    /// Copies host f64 values into a new buffer (rounding to the device dtype).
    fn upload_f64(&self, data: &[f64]) -> Result<Self::Buf>;
    /// Reads a buffer back as f32.
    fn download(&self, buf: &Self::Buf) -> Result<Vec<f32>>;
    /// Appends a buffer's values as f32 to `out` (no allocation of its own where the backend
    /// can read in place).
    fn download_extend(&self, buf: &Self::Buf, out: &mut Vec<f32>) -> Result<()> {
        out.extend(self.download(buf)?);
        Ok(())
    }
    /// Reads a buffer back as f64 (exact for f32 and f64 devices).
    fn download_f64(&self, buf: &Self::Buf) -> Result<Vec<f64>>;
    /// Copies host ids into a new id buffer.
    fn upload_ids(&self, ids: &[u32]) -> Result<Self::Ids>;
    /// `dst ← src` (same length).
    fn copy(&self, dst: &mut Self::Buf, src: &Self::Buf) -> Result<()>;
    /// `dst[i] ← value`.
    fn fill(&self, dst: &mut Self::Buf, value: f64) -> Result<()>;
    /// Waits until all queued work on this device is done.
    fn synchronize(&self) -> Result<()>;
    /// The host threads this device computes with, where that is a setting (cpu); `None`
    /// elsewhere.
    fn threads(&self) -> Option<usize> {
        None
    }
    /// Computes with `threads` host threads from the next op on (cpu devices, which share one
    /// host's cores: a device a plan leaves idle lends its threads to one at work). Other
    /// backends have no such setting.
    fn set_threads(&mut self, threads: usize) -> Result<()> {
        Err(crate::error::config_error(
            "threads",
            format!(
                "{} computes on its own hardware; only cpu devices take a thread count ({threads} asked)",
                self.name()
            ),
        ))
    }
    /// Runs `f`, a thread's worth of this device's ops (a pipeline worker's step), where those
    /// ops cost least to start. The cpu backend runs it inside the device's thread pool, so that
    /// each op runs on the calling thread instead of being handed to the pool and waited for: a
    /// thread wake-up per op, thousands per step. One thread enters a pool at a time; a second
    /// one meanwhile runs `f` as it is, as every backend but cpu always does.
    fn enter<R: Send>(&self, f: impl FnOnce() -> R + Send) -> R {
        f()
    }
    /// The host threads this device's ops run on (cpu), which the run's cpu devices share;
    /// `None` elsewhere.
    fn host_pool(&self) -> Option<&std::sync::Arc<HostPool>> {
        None
    }
    /// A point in this device's work, for timing it ([`Marker`]). The default, the host clock,
    /// is right for backends whose ops return when their work is done.
    fn marker(&self) -> Result<Marker> {
        Ok(Marker::Host(std::time::Instant::now()))
    }

    // ---- ops: forward and backward side by side ------------------------------------------
    /// See [`crate::ops::linear::linear_forward`].
    fn linear_forward(
        &self,
        out: &mut Self::Buf,
        inp: &Self::Buf,
        weight: &Self::Buf,
        bias: Option<&Self::Buf>,
        rows: usize,
        in_dim: usize,
        out_dim: usize,
    ) -> Result<()>;
    /// See [`crate::ops::linear::linear_backward`].
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
    ) -> Result<()>;
    /// See [`crate::ops::embedding::embedding_forward`].
    fn embedding_forward(
        &self,
        out: &mut Self::Buf,
        ids: &Self::Ids,
        table: &Self::Buf,
        dim: usize,
        accumulate: bool,
    ) -> Result<()>;
    /// See [`crate::ops::embedding::embedding_backward`].
    fn embedding_backward(&self, dtable: &mut Self::Buf, ids: &Self::Ids, dout: &Self::Buf, dim: usize) -> Result<()>;
    /// See [`crate::ops::patch::patch_forward`].
    fn patch_forward(&self, out: &mut Self::Buf, img: &Self::Buf, d: PatchDims) -> Result<()>;
    /// See [`crate::ops::patch::patch_backward`].
    fn patch_backward(&self, dimg: &mut Self::Buf, dout: &Self::Buf, d: PatchDims) -> Result<()>;
    /// See [`crate::ops::patch::prepend_token_forward`].
    fn prepend_token_forward(
        &self,
        out: &mut Self::Buf,
        token: &Self::Buf,
        inp: &Self::Buf,
        batch: usize,
        seq: usize,
        dim: usize,
    ) -> Result<()>;
    /// See [`crate::ops::patch::prepend_token_backward`].
    fn prepend_token_backward(
        &self,
        dtoken: &mut Self::Buf,
        dinp: Option<&mut Self::Buf>,
        dout: &Self::Buf,
        batch: usize,
        seq: usize,
        dim: usize,
    ) -> Result<()>;
    /// See [`crate::ops::layernorm::layernorm_forward`].
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
    ) -> Result<()>;
    /// See [`crate::ops::layernorm::layernorm_backward`].
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
    ) -> Result<()>;
    /// See [`crate::ops::gelu::gelu_forward`].
    fn gelu_forward(&self, out: &mut Self::Buf, inp: &Self::Buf, kind: Activation) -> Result<()>;
    /// See [`crate::ops::gelu::gelu_backward`].
    fn gelu_backward(&self, dinp: &mut Self::Buf, inp: &Self::Buf, dout: &Self::Buf, kind: Activation) -> Result<()>;
    /// See [`crate::ops::softmax::softmax_forward`].
    fn softmax_forward(&self, out: &mut Self::Buf, inp: &Self::Buf, rows: usize, cols: usize) -> Result<()>;
    /// See [`crate::ops::softmax::softmax_backward`].
    fn softmax_backward(
        &self,
        dinp: &mut Self::Buf,
        out: &Self::Buf,
        dout: &Self::Buf,
        rows: usize,
        cols: usize,
    ) -> Result<()>;
    /// See [`crate::ops::tanh::tanh_forward`].
    fn tanh_forward(&self, out: &mut Self::Buf, inp: &Self::Buf) -> Result<()>;
    /// See [`crate::ops::tanh::tanh_backward`].
    fn tanh_backward(&self, dinp: &mut Self::Buf, out: &Self::Buf, dout: &Self::Buf) -> Result<()>;
    /// See [`crate::ops::residual::residual_forward`].
    fn residual_forward(&self, out: &mut Self::Buf, a: &Self::Buf, b: &Self::Buf) -> Result<()>;
    /// See [`crate::ops::residual::residual_backward`].
    fn residual_backward(&self, dacc: &mut Self::Buf, dout: &Self::Buf) -> Result<()>;
    /// See [`crate::ops::rows::copy_rows`].
    fn copy_rows(&self, dst: &mut Self::Buf, src: &Self::Buf, c: RowCopy) -> Result<()>;
    /// See [`crate::ops::dropout::dropout_forward`].
    fn dropout_forward(&self, out: &mut Self::Buf, inp: &Self::Buf, p: f32, at: DropoutCoords) -> Result<()>;
    /// See [`crate::ops::dropout::dropout_backward`].
    fn dropout_backward(&self, dinp: &mut Self::Buf, dout: &Self::Buf, p: f32, at: DropoutCoords) -> Result<()>;
    /// Elements of the state `attention_forward` saves for `attention_backward`: the whole
    /// probability matrix on `cpu` (sign bits carrying the dropout mask), one log-sum-exp per
    /// query row on the fused GPU kernels.
    fn attention_saved_len(&self, d: &AttentionDims) -> usize;
    /// See [`crate::ops::attention::attention_forward`]; `saved` holds
    /// [`attention_saved_len`](Self::attention_saved_len) elements.
    fn attention_forward(
        &self,
        out: &mut Self::Buf,
        saved: &mut Self::Buf,
        q: &Self::Buf,
        k: &Self::Buf,
        v: &Self::Buf,
        key_mask: Option<&Self::Ids>,
        d: &AttentionDims,
    ) -> Result<()>;
    /// See [`crate::ops::attention::attention_backward`].
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
    ) -> Result<()>;
    /// See [`crate::ops::pooling::first_token_pool_forward`].
    fn first_token_pool_forward(
        &self,
        out: &mut Self::Buf,
        inp: &Self::Buf,
        batch: usize,
        seq: usize,
        dim: usize,
    ) -> Result<()>;
    /// See [`crate::ops::pooling::first_token_pool_backward`].
    fn first_token_pool_backward(
        &self,
        dinp: &mut Self::Buf,
        dout: &Self::Buf,
        batch: usize,
        seq: usize,
        dim: usize,
    ) -> Result<()>;
    /// See [`crate::ops::pooling::mean_pool_forward`].
    fn mean_pool_forward(
        &self,
        out: &mut Self::Buf,
        inp: &Self::Buf,
        mask: Option<&Self::Ids>,
        batch: usize,
        seq: usize,
        dim: usize,
    ) -> Result<()>;
    /// See [`crate::ops::pooling::mean_pool_backward`].
    fn mean_pool_backward(
        &self,
        dinp: &mut Self::Buf,
        dout: &Self::Buf,
        mask: Option<&Self::Ids>,
        batch: usize,
        seq: usize,
        dim: usize,
    ) -> Result<()>;
    /// See [`crate::ops::cross_entropy::cross_entropy_forward_backward`]; `losses` has one
    /// element per row.
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
    ) -> Result<usize>;

    // ---- optimizer and reductions ------------------------------------------------------
    /// See [`crate::ops::optim::adamw_update`].
    fn adamw_update(
        &self,
        param: &mut Self::Buf,
        grad: &Self::Buf,
        m: &mut Self::Buf,
        v: &mut Self::Buf,
        h: &AdamWStep,
    ) -> Result<()>;
    /// See [`crate::ops::optim::sgd_update`].
    fn sgd_update(
        &self,
        param: &mut Self::Buf,
        grad: &Self::Buf,
        momentum_buf: &mut Self::Buf,
        first: bool,
        h: &SgdStep,
    ) -> Result<()>;
    /// `Σ x²` in f64 (deterministic).
    fn sum_squares(&self, x: &Self::Buf) -> Result<f64>;
    /// `Σ x` in f64 (deterministic).
    fn sum(&self, x: &Self::Buf) -> Result<f64>;
    /// `x[i] *= s`.
    fn scale(&self, x: &mut Self::Buf, s: f64) -> Result<()>;
}

/// Which backend a command runs on (`--device`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum DeviceKind {
    /// `cuda` when a driver and a GPU are present, `cpu` otherwise.
    Auto,
    /// The pure-Rust backend.
    Cpu,
    /// A real GPU through the CUDA driver.
    Cuda,
    /// The CUDA kernels run on the host by the emulator (slow; for checking kernels).
    CudaEmu,
}

impl DeviceKind {
    /// `Auto` resolved against this machine.
    pub fn resolve(self) -> DeviceKind {
        self.resolve_for(1)
    }

    /// `Auto` resolved for a run on GPUs `0..needed`: cuda when the driver sees that many,
    /// else cpu (the main job's two devices on a one-GPU machine run on the CPU instead of
    /// failing to open the second GPU).
    pub fn resolve_for(self, needed: usize) -> DeviceKind {
        match self {
            DeviceKind::Auto if cuda::device_count() >= needed.max(1) => DeviceKind::Cuda,
            DeviceKind::Auto => DeviceKind::Cpu,
            k => k,
        }
    }
}

/// The precision a run asks for (`--precision`, `output.precision`): f32, bf16, or `auto`,
/// which [`resolve`](Self::resolve) turns into bf16 where the hardware's bf16 products are
/// faster than its f32 ones (a CPU with AMX, or an AMD CPU with `avx512_bf16`:
/// [`bf16_is_faster`](crate::ops::gemm_bf16::bf16_is_faster); a GPU of compute capability 8.0
/// or later) and f32 elsewhere, including on the emulator, which is for checking, not speed.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum PrecisionChoice {
    /// Every product in f32.
    #[default]
    F32,
    /// bf16 products (see [`Precision::Bf16`]).
    Bf16,
    /// bf16 where it is faster, else f32.
    Auto,
}

impl PrecisionChoice {
    /// The precision device `index` of `kind` runs in.
    pub fn resolve(self, kind: DeviceKind, index: usize) -> Result<Precision> {
        Ok(match self {
            PrecisionChoice::F32 => Precision::F32,
            PrecisionChoice::Bf16 => Precision::Bf16,
            PrecisionChoice::Auto => match kind.resolve() {
                DeviceKind::Cpu if crate::ops::gemm_bf16::bf16_is_faster() => Precision::Bf16,
                DeviceKind::Cuda if cuda::CudaRuntime::new(index)?.arch() >= 80 => Precision::Bf16,
                _ => Precision::F32,
            },
        })
    }
}

impl std::str::FromStr for DeviceKind {
    type Err = crate::Error;
    fn from_str(s: &str) -> Result<Self> {
        Ok(match s {
            "auto" => DeviceKind::Auto,
            "cpu" => DeviceKind::Cpu,
            "cuda" => DeviceKind::Cuda,
            "cuda-emu" => DeviceKind::CudaEmu,
            _ => {
                // `cuda:1`, as PyTorch names one GPU: here devices are a kind and a count.
                let count = match s.contains(':') {
                    true => {
                        " (a kind, not one device: train and plan take how many as --devices N, and \
                             CUDA_VISIBLE_DEVICES picks which GPUs a process sees)"
                    }
                    false => "",
                };
                return Err(crate::error::config_error(
                    "device",
                    format!("unknown device `{s}`; expected auto, cpu, cuda or cuda-emu{count}"),
                ));
            }
        })
    }
}

/// A point in a device's stream of work, to time what the device did rather than when the host
/// queued it. Backends that finish each op before returning (cpu, the CUDA emulator) read the
/// host clock; `cuda` records a CUDA event on its stream, which the GPU stamps when its work
/// reaches it (a launch returns as soon as the kernel is queued, so the host clock would charge
/// the GPU's time to whatever synchronises next).
#[derive(Clone)]
pub enum Marker {
    /// The host clock when the point was reached.
    Host(std::time::Instant),
    /// A timing-enabled CUDA event recorded on the device's stream.
    Event(std::sync::Arc<cudarc::driver::CudaEvent>),
}

impl Marker {
    /// Seconds from `self` to `later`, once the device has reached `later` (waits for it).
    pub fn seconds_to(&self, later: &Marker) -> Result<f64> {
        match (self, later) {
            (Marker::Host(a), Marker::Host(b)) => Ok(b.saturating_duration_since(*a).as_secs_f64()),
            (Marker::Event(a), Marker::Event(b)) => a.elapsed_ms(b).map(|ms| f64::from(ms) / 1e3).map_err(|e| {
                crate::error::Error::Device { what: "cuda event timing".into(), message: format!("{e:?}") }
            }),
            _ => Err(crate::error::Error::Device {
                what: "device timing".into(),
                message: "markers of different devices or backends cannot be compared".into(),
            }),
        }
    }
}

/// A device of any backend, for programs that choose the backend at run time and then call one
/// generic function per arm.
pub enum AnyDevice {
    /// See [`CpuDevice`].
    Cpu(CpuDevice<f32>),
    /// See [`GpuDevice`] (`cuda` or `cuda-emu`).
    Gpu(GpuDevice),
}

/// Several devices of one backend (a pipeline's).
pub enum AnyDevices {
    /// See [`CpuDevice`].
    Cpu(Vec<CpuDevice<f32>>),
    /// See [`GpuDevice`].
    Gpu(Vec<GpuDevice>),
}

/// The most threads (or devices) one process opens: each costs a pool thread, and a typo of a
/// million must be an error, not a million threads.
pub const MOST_THREADS: usize = 4096;

/// What asking for `threads` (by `what`: a setting, `output.threads = 8`, or a flag,
/// `--threads 8`) on a machine of fewer cores is warned with: only the cores are used
/// ([`usable_threads`]). `None` within the cores, or for 0 (all of them).
pub fn threads_beyond_cores(what: &str, threads: usize) -> Option<String> {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    (threads > cores).then(|| {
        format!(
            "{what}, but this machine has {cores} cores: {cores} are used (threads beyond the cores would take \
             turns, and every product wait for the last; 0: all cores)"
        )
    })
}

/// The threads a user's request gets: all the machine's cores for 0, and never more than them.
/// A pool's workers wait for work by spinning, so threads beyond the cores do not take turns
/// gently: every product waits for the last to be scheduled (a thousand on two cores made a
/// three-step run of a tiny model take minutes).
pub fn usable_threads(asked: usize) -> usize {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    if asked == 0 { cores } else { asked.min(cores) }
}

/// `PT_EMU_SEED`: the seed an emulated device draws its blocks' and threads' order from, so
/// that a run on `cuda-emu` can be repeated in other orders (a result that changes with it is a
/// race in a kernel). Unset: 0.
fn emu_seed() -> Result<u64> {
    match std::env::var("PT_EMU_SEED") {
        Err(std::env::VarError::NotPresent) => Ok(0),
        Ok(v) => v.trim().parse().map_err(|_| Error::Config {
            field: "PT_EMU_SEED".into(),
            message: format!("is {v:?}; expected a whole number ≥ 0 (0: block order, threads first come first served)"),
        }),
        Err(_) => Err(Error::Config { field: "PT_EMU_SEED".into(), message: "is not UTF-8; expected a number".into() }),
    }
}

impl AnyDevice {
    /// Device number `index` of `kind` in `precision`, with `threads` CPU threads
    /// ([`usable_threads`]) for `cpu` (where bf16 means bf16 operands in the linear layers'
    /// products, f32 everything else).
    pub fn open(kind: DeviceKind, index: usize, threads: usize, precision: Precision) -> Result<Self> {
        let threads = usable_threads(threads);
        match kind.resolve() {
            DeviceKind::Cpu => Ok(AnyDevice::Cpu(CpuDevice::with_precision(index, threads, precision)?)),
            DeviceKind::Cuda => Ok(AnyDevice::Gpu(cuda::device(index, precision)?)),
            DeviceKind::CudaEmu | DeviceKind::Auto => {
                // The launch's blocks spread over `threads` threads, in the order PT_EMU_SEED
                // draws (unset or 0: block order, threads first come first served).
                let rt = emu::EmuRuntime::new(index, emu_seed()?, threads)?;
                Ok(AnyDevice::Gpu(GpuDevice::new(std::sync::Arc::new(rt), precision, true)))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `auto` runs on cuda only when the driver sees every GPU the run needs; a named kind
    /// stays what it is.
    #[test]
    fn auto_takes_the_gpus_only_when_there_are_enough() {
        let gpus = cuda::device_count();
        for needed in [1, 2, 8] {
            let want = if gpus >= needed { DeviceKind::Cuda } else { DeviceKind::Cpu };
            assert_eq!(DeviceKind::Auto.resolve_for(needed), want, "{needed} of {gpus}");
            for named in [DeviceKind::Cpu, DeviceKind::Cuda, DeviceKind::CudaEmu] {
                assert_eq!(named.resolve_for(needed), named);
            }
        }
        assert_eq!(DeviceKind::Auto.resolve_for(gpus + 1), DeviceKind::Cpu);
    }

    /// `auto` is bf16 exactly where the CPU's bf16 products are the faster, f32 on the
    /// emulator; the two explicit choices are taken as they are.
    #[test]
    fn auto_precision_is_bf16_where_the_hardware_has_it() {
        let faster = crate::ops::gemm_bf16::bf16_is_faster();
        let native = if faster { Precision::Bf16 } else { Precision::F32 };
        assert_eq!(PrecisionChoice::Auto.resolve(DeviceKind::Cpu, 0).unwrap(), native);
        assert_eq!(PrecisionChoice::Auto.resolve(DeviceKind::CudaEmu, 0).unwrap(), Precision::F32);
        for kind in [DeviceKind::Cpu, DeviceKind::CudaEmu] {
            assert_eq!(PrecisionChoice::F32.resolve(kind, 0).unwrap(), Precision::F32);
            assert_eq!(PrecisionChoice::Bf16.resolve(kind, 0).unwrap(), Precision::Bf16);
        }
    }

    #[test]
    fn host_markers_measure_the_host_clock_and_mixed_markers_are_refused() {
        let a = std::time::Instant::now();
        let b = a + std::time::Duration::from_millis(250);
        assert!((Marker::Host(a).seconds_to(&Marker::Host(b)).unwrap() - 0.25).abs() < 1e-9);
        assert_eq!(Marker::Host(b).seconds_to(&Marker::Host(a)).unwrap(), 0.0, "never negative");
        let cpu = CpuDevice::<f32>::new(0, 1).unwrap();
        assert!(matches!(cpu.marker().unwrap(), Marker::Host(_)));
    }
}
