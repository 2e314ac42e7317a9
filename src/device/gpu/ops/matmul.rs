//! `kernels/matmul.cu`: the linear layer's forward and backward. Each product is one launch
//! over 64×64 output tiles: SIMT in f32 mode, wmma tensor cores (bf16 inputs, f32 accumulation)
//! in bf16 mode. The weight gradient may split its long sum over rows into slices (partials in a
//! pooled scratch buffer, added in order by a second launch); the bias gradient is a separate
//! deterministic column sum.

use super::elementwise::grid_stride;
use crate::device::gpu::{Arg, Elem, GpuBuf, GpuDevice, LaunchConfig, check_elem, int};
use crate::error::{Result, check_len};

/// Output tile edge of the GEMM kernels (`MM_TILE`).
const TILE: usize = 64;
/// Columns of `dbias` per block of `linear_backward_bias_*`.
const BIAS_COLS: usize = 32;
/// Threads of a `linear_backward_bias_*` block: 32 row groups of 32 columns.
const BIAS_THREADS: u32 = 1024;
/// Blocks the weight gradient aims for when it splits its rows: four per SM of an H100 (132
/// SMs), two waves of the bf16 kernel's two resident blocks. Measured on an H100 at the MiniLM
/// shapes (rows 2048): against 264, the same for the 384-wide weights and 8% (bf16) to 22% (f32)
/// faster for the 384×1536 ones; against no split, 1.9× (bf16) to 5.6× (f32) faster for 384×384.
const WEIGHT_SPLIT_BLOCKS: usize = 528;
/// Rows one slice of a split weight gradient sums at least: four 64-deep stages, so the
/// pipeline of the GEMM still runs and the partial slices stay few.
const WEIGHT_SPLIT_MIN_ROWS: usize = 256;

/// Threads of a GEMM block (the kernels' `__launch_bounds__`): 16×16 SIMT threads in f32 mode,
/// eight wmma warps in bf16 mode.
const GEMM_THREADS: u32 = 256;

/// The launch of a GEMM kernel writing an `m × n` output: one block per 64×64 tile (row tiles
/// along x, which has no 65535 limit: `m` is the one that grows with the batch).
fn gemm_config(m: usize, n: usize) -> LaunchConfig {
    LaunchConfig {
        grid: (m.div_ceil(TILE) as u32, n.div_ceil(TILE) as u32, 1),
        block: (GEMM_THREADS, 1, 1),
        shared_bytes: 0,
    }
}

/// How the weight gradient's sum over `rows` is split: `(slices, rows per slice)`, the slices
/// summed by separate blocks into partial gradients that a second kernel adds in order. The
/// product has only ⌈out_dim/64⌉·⌈in_dim/64⌉ output tiles (36 for a 384×384 weight) but a long
/// K = rows, so without a split a few blocks would each walk 2048 rows while most SMs idle. A
/// function of the shape alone: the summation order, hence every bit of the result, does not
/// depend on the GPU it runs on.
fn weight_row_split(rows: usize, out_dim: usize, in_dim: usize) -> (usize, usize) {
    let tiles = out_dim.div_ceil(TILE) * in_dim.div_ceil(TILE);
    let wanted = WEIGHT_SPLIT_BLOCKS.div_ceil(tiles).min(rows / WEIGHT_SPLIT_MIN_ROWS).max(1);
    // Whole 64-row stages per slice; rounding up may leave fewer slices than wanted.
    let chunk = rows.div_ceil(wanted).next_multiple_of(TILE);
    (rows.div_ceil(chunk), chunk)
}

/// `rows, in_dim, out_dim` as the kernels' `int` arguments, or an error when a tensor of the
/// layer exceeds 32-bit indexing.
fn kernel_dims(op: &str, rows: usize, in_dim: usize, out_dim: usize) -> Result<[Arg; 3]> {
    int(op, "rows·in_dim", rows * in_dim)?;
    int(op, "rows·out_dim", rows * out_dim)?;
    int(op, "out_dim·in_dim", out_dim * in_dim)?;
    Ok([Arg::I32(int(op, "rows", rows)?), Arg::I32(int(op, "in_dim", in_dim)?), Arg::I32(int(op, "out_dim", out_dim)?)])
}

/// See [`crate::ops::linear::linear_forward`].
#[allow(clippy::too_many_arguments)]
pub fn linear_forward(
    dev: &GpuDevice,
    out: &mut GpuBuf,
    inp: &GpuBuf,
    weight: &GpuBuf,
    bias: Option<&GpuBuf>,
    rows: usize,
    in_dim: usize,
    out_dim: usize,
) -> Result<()> {
    const OP: &str = "linear_forward";
    check_len(OP, "out", out.len(), rows * out_dim)?;
    check_len(OP, "inp", inp.len(), rows * in_dim)?;
    check_len(OP, "weight", weight.len(), out_dim * in_dim)?;
    if let Some(bias) = bias {
        check_len(OP, "bias", bias.len(), out_dim)?;
        check_elem(OP, "bias", bias, Elem::F32)?;
    }
    let act = dev.act();
    check_elem(OP, "out", out, act)?;
    check_elem(OP, "inp", inp, act)?;
    check_elem(OP, "weight", weight, Elem::F32)?;
    let dims = kernel_dims(OP, rows, in_dim, out_dim)?;
    if rows == 0 || out_dim == 0 {
        return Ok(()); // `out` is empty
    }
    let args =
        [Arg::Ptr(out.ptr()), Arg::Ptr(inp.ptr()), Arg::Ptr(weight.ptr()), Arg::Ptr(bias.map_or(0, GpuBuf::ptr))];
    let cfg = gemm_config(rows, out_dim);
    dev.launch(&format!("linear_forward_{}", act.suffix()), cfg, &[&args[..], &dims].concat())
}

/// See [`crate::ops::linear::linear_backward`]: writes `dinp`, adds into `dweight` and `dbias`.
#[allow(clippy::too_many_arguments)]
pub fn linear_backward(
    dev: &GpuDevice,
    dinp: Option<&mut GpuBuf>,
    dweight: Option<&mut GpuBuf>,
    dbias: Option<&mut GpuBuf>,
    dout: &GpuBuf,
    inp: &GpuBuf,
    weight: &GpuBuf,
    rows: usize,
    in_dim: usize,
    out_dim: usize,
) -> Result<()> {
    const OP: &str = "linear_backward";
    check_len(OP, "dout", dout.len(), rows * out_dim)?;
    check_len(OP, "inp", inp.len(), rows * in_dim)?;
    check_len(OP, "weight", weight.len(), out_dim * in_dim)?;
    let act = dev.act();
    if let Some(dinp) = &dinp {
        check_len(OP, "dinp", dinp.len(), rows * in_dim)?;
        check_elem(OP, "dinp", dinp, act)?;
    }
    if let Some(dweight) = &dweight {
        check_len(OP, "dweight", dweight.len(), out_dim * in_dim)?;
        check_elem(OP, "dweight", dweight, Elem::F32)?;
    }
    if let Some(dbias) = &dbias {
        check_len(OP, "dbias", dbias.len(), out_dim)?;
        check_elem(OP, "dbias", dbias, Elem::F32)?;
    }
    check_elem(OP, "dout", dout, act)?;
    check_elem(OP, "inp", inp, act)?;
    check_elem(OP, "weight", weight, Elem::F32)?;
    let dims = kernel_dims(OP, rows, in_dim, out_dim)?;
    let sfx = act.suffix();

    // dinp[rows, in_dim] = dout · weight (zeros when out_dim = 0: the kernel's K loop is empty).
    if let Some(dinp) = dinp
        && rows > 0
        && in_dim > 0
    {
        let args = [Arg::Ptr(dinp.ptr()), Arg::Ptr(dout.ptr()), Arg::Ptr(weight.ptr())];
        let cfg = gemm_config(rows, in_dim);
        dev.launch(&format!("linear_backward_input_{sfx}"), cfg, &[&args[..], &dims].concat())?;
    }
    // dweight[out_dim, in_dim] += doutᵀ · inp, and dbias += Σ_rows dout: nothing to add without rows.
    if let Some(dweight) = dweight
        && rows > 0
        && in_dim > 0
        && out_dim > 0
    {
        let kernel = format!("linear_backward_weight_{sfx}");
        let (splits, chunk) = weight_row_split(rows, out_dim, in_dim);
        let mut cfg = gemm_config(out_dim, in_dim);
        cfg.grid.2 = splits as u32;
        let tail = [dims[0], dims[1], dims[2], Arg::I32(int(OP, "rows", chunk)?)];
        if splits == 1 {
            let args = [Arg::Ptr(dweight.ptr()), Arg::Ptr(dout.ptr()), Arg::Ptr(inp.ptr())];
            dev.launch(&kernel, cfg, &[&args[..], &tail].concat())?;
        } else {
            // The kernels index the partials with 32-bit offsets; `n` and `splits` are then small too.
            let n = out_dim * in_dim;
            int(OP, "row splits·out_dim·in_dim", splits * n)?;
            let partials = dev.alloc_elem(splits * n, Elem::F32)?;
            let args = [Arg::Ptr(partials.ptr()), Arg::Ptr(dout.ptr()), Arg::Ptr(inp.ptr())];
            dev.launch(&kernel, cfg, &[&args[..], &tail].concat())?;
            let args = [Arg::Ptr(dweight.ptr()), Arg::Ptr(partials.ptr()), Arg::I32(n as i32), Arg::I32(splits as i32)];
            dev.launch("linear_backward_weight_reduce", grid_stride(n), &args)?;
        }
    }
    if let Some(dbias) = dbias
        && rows > 0
        && out_dim > 0
    {
        let cfg = LaunchConfig::linear(out_dim.div_ceil(BIAS_COLS) as u32, BIAS_THREADS);
        let args = [Arg::Ptr(dbias.ptr()), Arg::Ptr(dout.ptr()), dims[0], dims[2]];
        dev.launch(&format!("linear_backward_bias_{sfx}"), cfg, &args)?;
    }
    Ok(())
}
