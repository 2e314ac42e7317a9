//! `kernels/matmul.cu`: the linear layer's forward and backward. Each product is one launch
//! over 64×64 output tiles: SIMT in f32 mode, wmma tensor cores (bf16 inputs, f32 accumulation)
//! in bf16 mode; the bias gradient is a separate deterministic column sum.

use crate::device::gpu::{Arg, Elem, GpuBuf, GpuDevice, LaunchConfig, check_elem, int};
use crate::error::{Result, check_len};

/// Output tile edge of the GEMM kernels (`MM_TILE`).
const TILE: usize = 64;
/// Columns of `dbias` per block of `linear_backward_bias_*`.
const BIAS_COLS: usize = 32;

/// The launch of a GEMM kernel writing an `m × n` output: one block per 64×64 tile (row tiles
/// along x, which has no 65535 limit: `m` is the one that grows with the batch), 256 SIMT
/// threads in f32 mode, four wmma warps in bf16 mode.
fn gemm_config(dev: &GpuDevice, m: usize, n: usize) -> LaunchConfig {
    let threads = match dev.act() {
        Elem::F32 => 256,
        Elem::Bf16 => 128,
    };
    LaunchConfig {
        grid: (m.div_ceil(TILE) as u32, n.div_ceil(TILE) as u32, 1),
        block: (threads, 1, 1),
        shared_bytes: 0,
    }
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
    let cfg = gemm_config(dev, rows, out_dim);
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
        let cfg = gemm_config(dev, rows, in_dim);
        dev.launch(&format!("linear_backward_input_{sfx}"), cfg, &[&args[..], &dims].concat())?;
    }
    // dweight[out_dim, in_dim] += doutᵀ · inp, and dbias += Σ_rows dout: nothing to add without rows.
    if let Some(dweight) = dweight
        && rows > 0
        && in_dim > 0
        && out_dim > 0
    {
        let args = [Arg::Ptr(dweight.ptr()), Arg::Ptr(dout.ptr()), Arg::Ptr(inp.ptr())];
        let cfg = gemm_config(dev, out_dim, in_dim);
        dev.launch(&format!("linear_backward_weight_{sfx}"), cfg, &[&args[..], &dims].concat())?;
    }
    if let Some(dbias) = dbias
        && rows > 0
        && out_dim > 0
    {
        let cfg = LaunchConfig::linear(out_dim.div_ceil(BIAS_COLS) as u32, 256);
        let args = [Arg::Ptr(dbias.ptr()), Arg::Ptr(dout.ptr()), dims[0], dims[2]];
        dev.launch(&format!("linear_backward_bias_{sfx}"), cfg, &args)?;
    }
    Ok(())
}
