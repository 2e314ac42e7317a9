//! `kernels/norm.cu`: LayerNorm and row softmax. Forward kernels and the softmax backward take
//! one warp per row; the LayerNorm backward reduces `dweight`/`dbias` through per-block partial
//! rows combined in a fixed order, so its result does not depend on thread order.

use super::elementwise::threads_for_columns;
use crate::device::gpu::runtime::LaunchLimits;
use crate::device::gpu::{Arg, Elem, GpuBuf, GpuDevice, LaunchConfig, check_elem, int};
use crate::error::{Error, Result, check_len};

/// Threads per block of the warp-per-row kernels (8 rows per block).
const ROW_THREADS: u32 = 256;
/// Blocks the LayerNorm backward aims for. A block walks its rows one at a time, a barrier per
/// row, so it takes several blocks per SM (an H100 has 132) to hide latency; each block adds a
/// partial row of 2·dim floats to write and combine, which at 512 blocks is a few percent of
/// the traffic of a large backward.
const BACKWARD_BLOCKS: usize = 512;
/// Warps of `layernorm_param_grads` (its `PARAM_GRAD_WARPS`).
const PARAM_GRAD_WARPS: u32 = 8;
/// Static shared memory of `layernorm_backward` (its `scratch[2][2][32]` floats): it counts
/// against the same per-block limit as the dynamic accumulators.
const BACKWARD_STATIC_SHARED: u32 = 2 * 2 * 32 * 4;

/// One warp per row for `rows` rows.
fn warp_per_row(rows: usize) -> LaunchConfig {
    LaunchConfig::linear(rows.div_ceil(ROW_THREADS as usize / 32) as u32, ROW_THREADS)
}

/// See [`crate::ops::layernorm::layernorm_forward`]. `mean` and `rstd` are f32 (statistics).
#[allow(clippy::too_many_arguments)]
pub fn layernorm_forward(
    dev: &GpuDevice,
    out: &mut GpuBuf,
    mean: &mut GpuBuf,
    rstd: &mut GpuBuf,
    inp: &GpuBuf,
    weight: &GpuBuf,
    bias: &GpuBuf,
    rows: usize,
    dim: usize,
    eps: f64,
) -> Result<()> {
    const OP: &str = "layernorm_forward";
    crate::ops::layernorm::check_forward_lens(
        [out.len(), mean.len(), rstd.len(), inp.len(), weight.len(), bias.len()],
        rows,
        dim,
    )?;
    check_elem(OP, "out", out, dev.act())?;
    check_elem(OP, "inp", inp, dev.act())?;
    for (arg, buf) in [("mean", &*mean), ("rstd", &*rstd), ("weight", weight), ("bias", bias)] {
        check_elem(OP, arg, buf, Elem::F32)?;
    }
    if rows == 0 || dim == 0 {
        return Ok(());
    }
    // Every index the kernel forms is below rows·dim.
    int(OP, "rows·dim", rows * dim)?;
    let kernel = format!("layernorm_forward_{}", dev.act().suffix());
    let args = [
        Arg::Ptr(out.ptr()),
        Arg::Ptr(mean.ptr()),
        Arg::Ptr(rstd.ptr()),
        Arg::Ptr(inp.ptr()),
        Arg::Ptr(weight.ptr()),
        Arg::Ptr(bias.ptr()),
        Arg::I32(rows as i32),
        Arg::I32(dim as i32),
        Arg::F32(eps as f32),
    ];
    dev.launch(&kernel, warp_per_row(rows), &args)
}

/// See [`crate::ops::layernorm::layernorm_backward`]: writes `dinp`, adds into `dweight` and
/// `dbias`.
#[allow(clippy::too_many_arguments)]
pub fn layernorm_backward(
    dev: &GpuDevice,
    dinp: &mut GpuBuf,
    dweight: &mut GpuBuf,
    dbias: &mut GpuBuf,
    dout: &GpuBuf,
    inp: &GpuBuf,
    weight: &GpuBuf,
    mean: &GpuBuf,
    rstd: &GpuBuf,
    rows: usize,
    dim: usize,
) -> Result<()> {
    const OP: &str = "layernorm_backward";
    crate::ops::layernorm::check_backward_lens(
        [dinp.len(), dweight.len(), dbias.len(), dout.len(), inp.len(), weight.len(), mean.len(), rstd.len()],
        rows,
        dim,
    )?;
    for (arg, buf) in [("dinp", &*dinp), ("dout", dout), ("inp", inp)] {
        check_elem(OP, arg, buf, dev.act())?;
    }
    for (arg, buf) in [("dweight", &*dweight), ("dbias", &*dbias), ("weight", weight), ("mean", mean), ("rstd", rstd)] {
        check_elem(OP, arg, buf, Elem::F32)?;
    }
    if rows == 0 || dim == 0 {
        return Ok(());
    }
    // The block's two column accumulators live in shared memory: past 48 KiB (with the static
    // part) the launch opts in, up to what the smallest target GPU (sm_80) allows.
    let shared = 2 * dim * 4;
    let max_shared = (LaunchLimits::SM80.max_shared_optin - BACKWARD_STATIC_SHARED) as usize;
    if shared > max_shared {
        return Err(Error::Config {
            field: format!("{OP}.dim"),
            message: format!("{dim} exceeds the {} columns the kernel's shared memory holds", max_shared / 8),
        });
    }
    let threads = threads_for_columns(dim);
    let rows_per_block = rows.div_ceil(BACKWARD_BLOCKS);
    let blocks = rows.div_ceil(rows_per_block);
    // Every index the kernels form is below rows·dim or the partials' length.
    int(OP, "rows·dim", rows * dim)?;
    int(OP, "partials", blocks * 2 * dim)?;
    let partials = dev.alloc_elem(blocks * 2 * dim, Elem::F32)?;
    let kernel = format!("layernorm_backward_{}", dev.act().suffix());
    let args = [
        Arg::Ptr(dinp.ptr()),
        Arg::Ptr(partials.ptr()),
        Arg::Ptr(dout.ptr()),
        Arg::Ptr(inp.ptr()),
        Arg::Ptr(weight.ptr()),
        Arg::Ptr(mean.ptr()),
        Arg::Ptr(rstd.ptr()),
        Arg::I32(rows as i32),
        Arg::I32(dim as i32),
        Arg::I32(rows_per_block as i32),
    ];
    dev.launch(&kernel, LaunchConfig::linear(blocks as u32, threads).with_shared(shared), &args)?;
    let args = [
        Arg::Ptr(dweight.ptr()),
        Arg::Ptr(dbias.ptr()),
        Arg::Ptr(partials.ptr()),
        Arg::I32(blocks as i32),
        Arg::I32(dim as i32),
    ];
    let cfg = LaunchConfig::linear((2 * dim).div_ceil(32) as u32, PARAM_GRAD_WARPS * 32);
    dev.launch("layernorm_param_grads", cfg, &args)
}

/// Checks the shared lengths and types of the softmax kernels' buffers.
fn check_rows(
    dev: &GpuDevice,
    op: &'static str,
    bufs: &[(&'static str, &GpuBuf)],
    rows: usize,
    cols: usize,
) -> Result<()> {
    for (arg, buf) in bufs {
        check_len(op, arg, buf.len(), rows * cols)?;
    }
    for (arg, buf) in bufs {
        check_elem(op, arg, buf, dev.act())?;
    }
    int(op, "rows·cols", rows * cols).map(|_| ())
}

/// See [`crate::ops::softmax::softmax_forward`].
pub fn softmax_forward(dev: &GpuDevice, out: &mut GpuBuf, inp: &GpuBuf, rows: usize, cols: usize) -> Result<()> {
    const OP: &str = "softmax_forward";
    check_rows(dev, OP, &[("inp", inp), ("out", out)], rows, cols)?;
    if rows == 0 || cols == 0 {
        return Ok(());
    }
    let kernel = format!("softmax_forward_{}", dev.act().suffix());
    let args = [Arg::Ptr(out.ptr()), Arg::Ptr(inp.ptr()), Arg::I32(rows as i32), Arg::I32(cols as i32)];
    dev.launch(&kernel, warp_per_row(rows), &args)
}

/// See [`crate::ops::softmax::softmax_backward`].
pub fn softmax_backward(
    dev: &GpuDevice,
    dinp: &mut GpuBuf,
    out: &GpuBuf,
    dout: &GpuBuf,
    rows: usize,
    cols: usize,
) -> Result<()> {
    const OP: &str = "softmax_backward";
    check_rows(dev, OP, &[("out", out), ("dout", dout), ("dinp", dinp)], rows, cols)?;
    if rows == 0 || cols == 0 {
        return Ok(());
    }
    let kernel = format!("softmax_backward_{}", dev.act().suffix());
    let args =
        [Arg::Ptr(dinp.ptr()), Arg::Ptr(out.ptr()), Arg::Ptr(dout.ptr()), Arg::I32(rows as i32), Arg::I32(cols as i32)];
    dev.launch(&kernel, warp_per_row(rows), &args)
}
