//! `kernels/optim.cu`: AdamW and SGD on f32 master weights, deterministic sums.

use super::elementwise::grid_stride;
use crate::device::gpu::{Arg, Elem, GpuBuf, GpuDevice, LaunchConfig, check_elem, int};
use crate::error::{Result, check_len, config_error};
use crate::ops::optim::{AdamWStep, SgdStep};

/// Threads per block of the sum kernels (their `SUM_THREADS`).
const SUM_THREADS: usize = 256;
/// Blocks of the sum kernels at most: enough to fill an H100, few enough that the host adds
/// the partials in no time.
const SUM_BLOCKS: usize = 1024;

/// Checks that every buffer of an update has the parameter's length and is f32.
fn check_update(op: &'static str, param: &GpuBuf, others: &[(&'static str, &GpuBuf)]) -> Result<i32> {
    for (arg, buf) in others {
        check_len(op, arg, buf.len(), param.len())?;
    }
    check_elem(op, "param", param, Elem::F32)?;
    for (arg, buf) in others {
        check_elem(op, arg, buf, Elem::F32)?;
    }
    int(op, "param", param.len())
}

/// See [`crate::ops::optim::adamw_update`]. The bias corrections are computed here in f64, as
/// the cpu reference computes them, and passed as f32.
pub fn adamw_update(
    dev: &GpuDevice,
    param: &mut GpuBuf,
    grad: &GpuBuf,
    m: &mut GpuBuf,
    v: &mut GpuBuf,
    h: &AdamWStep,
) -> Result<()> {
    const OP: &str = "adamw_update";
    let n = check_update(OP, param, &[("grad", grad), ("m", m), ("v", v)])?;
    if h.step == 0 {
        // 1 − β⁰ = 0 would divide by zero: the caller forgot to count the step.
        return Err(config_error("adamw.step", "AdamW steps are 1-based; got 0"));
    }
    if n == 0 {
        return Ok(());
    }
    let t = h.step as f64;
    let step_size = h.lr / (1.0 - h.beta1.powf(t));
    let bc2_sqrt = (1.0 - h.beta2.powf(t)).sqrt();
    let args = [
        Arg::Ptr(param.ptr()),
        Arg::Ptr(grad.ptr()),
        Arg::Ptr(m.ptr()),
        Arg::Ptr(v.ptr()),
        Arg::I32(n),
        Arg::F32(h.beta1 as f32),
        Arg::F32((1.0 - h.beta1) as f32),
        Arg::F32(h.beta2 as f32),
        Arg::F32((1.0 - h.beta2) as f32),
        Arg::F32(h.eps as f32),
        Arg::F32((h.lr * h.weight_decay) as f32),
        Arg::F32(step_size as f32),
        Arg::F32(bc2_sqrt as f32),
        Arg::F32(h.grad_scale as f32),
    ];
    dev.launch("adamw_update", grid_stride(param.len()), &args)
}

/// See [`crate::ops::optim::sgd_update`].
pub fn sgd_update(
    dev: &GpuDevice,
    param: &mut GpuBuf,
    grad: &GpuBuf,
    momentum: &mut GpuBuf,
    first: bool,
    h: &SgdStep,
) -> Result<()> {
    const OP: &str = "sgd_update";
    let n = check_update(OP, param, &[("grad", grad), ("momentum_buf", momentum)])?;
    if n == 0 {
        return Ok(());
    }
    let args = [
        Arg::Ptr(param.ptr()),
        Arg::Ptr(grad.ptr()),
        Arg::Ptr(momentum.ptr()),
        Arg::I32(n),
        Arg::F32(h.lr as f32),
        Arg::F32(h.momentum as f32),
        Arg::F32(h.weight_decay as f32),
        Arg::I32(h.nesterov as i32),
        Arg::I32(first as i32),
        Arg::F32(h.grad_scale as f32),
    ];
    dev.launch("sgd_update", grid_stride(param.len()), &args)
}

/// Runs `sum_*` or `sum_squares_*` over `x` (either element type): per-block f64 partials on
/// the device, added on the host in block order. The grid depends on `x.len()` alone, so the
/// result is the same bits on every run.
fn reduce(dev: &GpuDevice, stem: &str, x: &GpuBuf) -> Result<f64> {
    let n = int(stem, "x", x.len())?;
    if n == 0 {
        return Ok(0.0);
    }
    let blocks = x.len().div_ceil(SUM_THREADS).min(SUM_BLOCKS);
    // f64 partials, held as pairs of f32 elements and read back as raw bytes.
    let partials = dev.alloc_elem(2 * blocks, Elem::F32)?;
    let kernel = format!("{stem}_{}", x.elem().suffix());
    let args = [Arg::Ptr(partials.ptr()), Arg::Ptr(x.ptr()), Arg::I32(n)];
    dev.launch(&kernel, LaunchConfig::linear(blocks as u32, SUM_THREADS as u32), &args)?;
    let bytes = dev.download_bytes(&partials)?;
    Ok(bytes.chunks_exact(8).map(|b| f64::from_ne_bytes([b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7]])).sum())
}

/// `Σ x²` in f64, deterministic.
pub fn sum_squares(dev: &GpuDevice, x: &GpuBuf) -> Result<f64> {
    reduce(dev, "sum_squares", x)
}

/// `Σ x` in f64, deterministic.
pub fn sum(dev: &GpuDevice, x: &GpuBuf) -> Result<f64> {
    reduce(dev, "sum", x)
}
