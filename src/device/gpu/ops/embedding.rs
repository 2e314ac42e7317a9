//! `kernels/embedding.cu`: token/position embeddings, ViT patches and the class token, pooling.
//! Tables, the class token and images are f32; `out`/`dout`-like buffers are activations.

use super::elementwise::{grid_stride, threads_for_columns};
use crate::device::Device;
use crate::device::gpu::{Arg, Elem, GpuBuf, GpuDevice, GpuIds, LaunchConfig, check_elem, int};
use crate::error::{Result, check_len};
use crate::ops::embedding::{check_ids, table_rows};
use crate::ops::patch::PatchDims;
use crate::ops::patch::check_dims;

/// Threads per block of the one-block-per-sequence pooling backward.
const POOL_THREADS: u32 = 256;

/// See [`crate::ops::embedding::embedding_forward`].
pub fn embedding_forward(
    dev: &GpuDevice,
    out: &mut GpuBuf,
    ids: &GpuIds,
    table: &GpuBuf,
    dim: usize,
    accumulate: bool,
) -> Result<()> {
    const OP: &str = "embedding_forward";
    let rows = table_rows(OP, "table", table.len(), dim)?;
    check_len(OP, "out", out.len(), ids.len() * dim)?;
    check_ids(ids.host(), rows)?;
    check_elem(OP, "out", out, dev.act())?;
    check_elem(OP, "table", table, Elem::F32)?;
    int(OP, "table", table.len())?;
    let n = int(OP, "out", out.len())?;
    if n == 0 {
        return Ok(());
    }
    let kernel = format!("embedding_forward_{}", dev.act().suffix());
    let args = [
        Arg::Ptr(out.ptr()),
        Arg::Ptr(ids.ptr()),
        Arg::Ptr(table.ptr()),
        Arg::I32(n),
        Arg::I32(dim as i32),
        Arg::I32(accumulate as i32),
    ];
    dev.launch(&kernel, grid_stride(out.len()), &args)
}

/// See [`crate::ops::embedding::embedding_backward`]: `dtable[ids[r], :] += dout[r, :]`,
/// deterministic without atomics. The host sorts the rows by id (stably, so each id keeps its
/// rows in increasing order) and launches one block per distinct id, which adds its rows in
/// that order: the cpu's summation order exactly.
pub fn embedding_backward(dev: &GpuDevice, dtable: &mut GpuBuf, ids: &GpuIds, dout: &GpuBuf, dim: usize) -> Result<()> {
    const OP: &str = "embedding_backward";
    let rows = table_rows(OP, "dtable", dtable.len(), dim)?;
    check_len(OP, "dout", dout.len(), ids.len() * dim)?;
    check_ids(ids.host(), rows)?;
    check_elem(OP, "dtable", dtable, Elem::F32)?;
    check_elem(OP, "dout", dout, dev.act())?;
    int(OP, "dtable", dtable.len())?;
    int(OP, "dout", dout.len())?;
    if dim == 0 || ids.is_empty() {
        return Ok(());
    }
    let host = ids.host();
    let mut order: Vec<u32> = (0..host.len() as u32).collect();
    order.sort_by_key(|&r| host[r as usize]);
    // Segment s covers order[start[s]..start[s + 1]], the rows that read table row seg_ids[s].
    let (mut seg_ids, mut seg_start) = (Vec::new(), Vec::new());
    for (k, &r) in order.iter().enumerate() {
        let id = host[r as usize];
        if seg_ids.last() != Some(&id) {
            seg_ids.push(id);
            seg_start.push(k as u32);
        }
    }
    seg_start.push(order.len() as u32);
    // One upload, [order | seg_ids | seg_start], and three pointers into it.
    let (n, segments) = (order.len(), seg_ids.len());
    let packed: Vec<u32> = order.into_iter().chain(seg_ids).chain(seg_start).collect();
    let buckets = dev.upload_ids(&packed)?;
    let kernel = format!("embedding_backward_{}", dev.act().suffix());
    let args = [
        Arg::Ptr(dtable.ptr()),
        Arg::Ptr(dout.ptr()),
        Arg::Ptr(buckets.ptr()),
        Arg::Ptr(buckets.ptr() + 4 * n as u64),
        Arg::Ptr(buckets.ptr() + 4 * (n + segments) as u64),
        Arg::I32(dim as i32),
    ];
    dev.launch(&kernel, LaunchConfig::linear(segments as u32, threads_for_columns(dim)), &args)
}

/// Launches `patch_forward_*` or `patch_backward_*` over the `n` patch elements.
fn patch_launch(dev: &GpuDevice, kernel: &str, dst: &GpuBuf, src: &GpuBuf, n: usize, d: PatchDims) -> Result<()> {
    if n == 0 {
        return Ok(());
    }
    let args = [
        Arg::Ptr(dst.ptr()),
        Arg::Ptr(src.ptr()),
        Arg::I32(n as i32),
        Arg::I32(d.channels as i32),
        Arg::I32(d.height as i32),
        Arg::I32(d.width as i32),
        Arg::I32(d.patch as i32),
    ];
    dev.launch(kernel, grid_stride(n), &args)
}

/// See [`crate::ops::patch::patch_forward`]. `img` is f32 (an input).
pub fn patch_forward(dev: &GpuDevice, out: &mut GpuBuf, img: &GpuBuf, d: PatchDims) -> Result<()> {
    const OP: &str = "patch_forward";
    check_dims(d)?;
    check_len(OP, "img", img.len(), d.batch * d.channels * d.height * d.width)?;
    check_len(OP, "out", out.len(), d.batch * d.num_patches() * d.patch_len())?;
    check_elem(OP, "out", out, dev.act())?;
    check_elem(OP, "img", img, Elem::F32)?;
    // Patches tile the image, so every index is below the image's length.
    int(OP, "img", img.len())?;
    patch_launch(dev, &format!("patch_forward_{}", dev.act().suffix()), out, img, out.len(), d)
}

/// See [`crate::ops::patch::patch_backward`]. `dimg` is f32, the image's type.
pub fn patch_backward(dev: &GpuDevice, dimg: &mut GpuBuf, dout: &GpuBuf, d: PatchDims) -> Result<()> {
    const OP: &str = "patch_backward";
    check_dims(d)?;
    check_len(OP, "dimg", dimg.len(), d.batch * d.channels * d.height * d.width)?;
    check_len(OP, "dout", dout.len(), d.batch * d.num_patches() * d.patch_len())?;
    check_elem(OP, "dimg", dimg, Elem::F32)?;
    check_elem(OP, "dout", dout, dev.act())?;
    int(OP, "dimg", dimg.len())?;
    // Patches do not overlap and cover the image: one pass over dout writes every pixel once.
    patch_launch(dev, &format!("patch_backward_{}", dev.act().suffix()), dimg, dout, dout.len(), d)
}

/// See [`crate::ops::patch::prepend_token_forward`]. `token` is f32 (a parameter).
pub fn prepend_token_forward(
    dev: &GpuDevice,
    out: &mut GpuBuf,
    token: &GpuBuf,
    inp: &GpuBuf,
    batch: usize,
    seq: usize,
    dim: usize,
) -> Result<()> {
    const OP: &str = "prepend_token_forward";
    check_len(OP, "token", token.len(), dim)?;
    check_len(OP, "inp", inp.len(), batch * seq * dim)?;
    check_len(OP, "out", out.len(), batch * (seq + 1) * dim)?;
    check_elem(OP, "out", out, dev.act())?;
    check_elem(OP, "token", token, Elem::F32)?;
    check_elem(OP, "inp", inp, dev.act())?;
    let n = int(OP, "out", out.len())?;
    if n == 0 {
        return Ok(());
    }
    let kernel = format!("prepend_token_forward_{}", dev.act().suffix());
    let args = [
        Arg::Ptr(out.ptr()),
        Arg::Ptr(token.ptr()),
        Arg::Ptr(inp.ptr()),
        Arg::I32(n),
        Arg::I32(seq as i32),
        Arg::I32(dim as i32),
    ];
    dev.launch(&kernel, grid_stride(out.len()), &args)
}

/// See [`crate::ops::patch::prepend_token_backward`]: adds into `dtoken` (f32), writes `dinp`.
pub fn prepend_token_backward(
    dev: &GpuDevice,
    dtoken: &mut GpuBuf,
    dinp: Option<&mut GpuBuf>,
    dout: &GpuBuf,
    batch: usize,
    seq: usize,
    dim: usize,
) -> Result<()> {
    const OP: &str = "prepend_token_backward";
    check_len(OP, "dtoken", dtoken.len(), dim)?;
    check_len(OP, "dout", dout.len(), batch * (seq + 1) * dim)?;
    if let Some(dinp) = &dinp {
        check_len(OP, "dinp", dinp.len(), batch * seq * dim)?;
        check_elem(OP, "dinp", dinp, dev.act())?;
    }
    check_elem(OP, "dtoken", dtoken, Elem::F32)?;
    check_elem(OP, "dout", dout, dev.act())?;
    int(OP, "dout", dout.len())?;
    if dim == 0 {
        return Ok(());
    }
    let act = dev.act().suffix();
    let args = [
        Arg::Ptr(dtoken.ptr()),
        Arg::Ptr(dout.ptr()),
        Arg::I32(batch as i32),
        Arg::I32(seq as i32),
        Arg::I32(dim as i32),
    ];
    dev.launch(&format!("prepend_token_backward_token_{act}"), grid_stride(dim), &args)?;
    match dinp {
        Some(dinp) if !dinp.is_empty() => {
            let args = [
                Arg::Ptr(dinp.ptr()),
                Arg::Ptr(dout.ptr()),
                Arg::I32(dinp.len() as i32),
                Arg::I32(seq as i32),
                Arg::I32(dim as i32),
            ];
            dev.launch(&format!("prepend_token_backward_inp_{act}"), grid_stride(dinp.len()), &args)
        }
        _ => Ok(()),
    }
}

/// Launches a first-token pooling kernel over the `n` elements of `dst`.
fn first_token_launch(dev: &GpuDevice, kernel: &str, dst: &GpuBuf, src: &GpuBuf, seq: usize, dim: usize) -> Result<()> {
    let n = dst.len();
    // `seq = 0` holds one token per sequence, as the lengths the cpu checks say.
    let args = [
        Arg::Ptr(dst.ptr()),
        Arg::Ptr(src.ptr()),
        Arg::I32(n as i32),
        Arg::I32(seq.max(1) as i32),
        Arg::I32(dim as i32),
    ];
    dev.launch(kernel, grid_stride(n), &args)
}

/// See [`crate::ops::pooling::first_token_pool_forward`].
pub fn first_token_pool_forward(
    dev: &GpuDevice,
    out: &mut GpuBuf,
    inp: &GpuBuf,
    batch: usize,
    seq: usize,
    dim: usize,
) -> Result<()> {
    const OP: &str = "first_token_pool_forward";
    check_len(OP, "inp", inp.len(), batch * seq.max(1) * dim)?;
    check_len(OP, "out", out.len(), batch * dim)?;
    check_elem(OP, "out", out, dev.act())?;
    check_elem(OP, "inp", inp, dev.act())?;
    int(OP, "inp", inp.len())?;
    if batch * dim == 0 {
        return Ok(());
    }
    first_token_launch(dev, &format!("first_token_pool_forward_{}", dev.act().suffix()), out, inp, seq, dim)
}

/// See [`crate::ops::pooling::first_token_pool_backward`].
pub fn first_token_pool_backward(
    dev: &GpuDevice,
    dinp: &mut GpuBuf,
    dout: &GpuBuf,
    batch: usize,
    seq: usize,
    dim: usize,
) -> Result<()> {
    const OP: &str = "first_token_pool_backward";
    check_len(OP, "dinp", dinp.len(), batch * seq.max(1) * dim)?;
    check_len(OP, "dout", dout.len(), batch * dim)?;
    check_elem(OP, "dinp", dinp, dev.act())?;
    check_elem(OP, "dout", dout, dev.act())?;
    int(OP, "dinp", dinp.len())?;
    if batch * dim == 0 {
        return Ok(());
    }
    first_token_launch(dev, &format!("first_token_pool_backward_{}", dev.act().suffix()), dinp, dout, seq, dim)
}

/// The masked-mean kernels' shared checks; `dense` is the `[batch, seq, dim]` buffer, `pooled`
/// the `[batch, dim]` one, named as the cpu reference names them.
#[allow(clippy::too_many_arguments)]
fn check_mean_pool(
    dev: &GpuDevice,
    op: &'static str,
    dense: (&'static str, &GpuBuf),
    pooled: (&'static str, &GpuBuf),
    mask: Option<&GpuIds>,
    batch: usize,
    seq: usize,
    dim: usize,
) -> Result<()> {
    check_len(op, dense.0, dense.1.len(), batch * seq * dim)?;
    check_len(op, pooled.0, pooled.1.len(), batch * dim)?;
    if let Some(m) = mask {
        check_len(op, "mask", m.len(), batch * seq)?;
    }
    check_elem(op, dense.0, dense.1, dev.act())?;
    check_elem(op, pooled.0, pooled.1, dev.act())?;
    int(op, dense.0, dense.1.len()).map(|_| ())
}

/// The mask pointer the kernels take: null means every token is real.
fn mask_ptr(mask: Option<&GpuIds>) -> Arg {
    Arg::Ptr(mask.map_or(0, |m| if m.is_empty() { 0 } else { m.ptr() }))
}

/// See [`crate::ops::pooling::mean_pool_forward`]: one block per sequence.
pub fn mean_pool_forward(
    dev: &GpuDevice,
    out: &mut GpuBuf,
    inp: &GpuBuf,
    mask: Option<&GpuIds>,
    batch: usize,
    seq: usize,
    dim: usize,
) -> Result<()> {
    const OP: &str = "mean_pool_forward";
    check_mean_pool(dev, OP, ("inp", inp), ("out", out), mask, batch, seq, dim)?;
    if batch * dim == 0 {
        return Ok(());
    }
    let kernel = format!("mean_pool_forward_{}", dev.act().suffix());
    let args = [Arg::Ptr(out.ptr()), Arg::Ptr(inp.ptr()), mask_ptr(mask), Arg::I32(seq as i32), Arg::I32(dim as i32)];
    dev.launch(&kernel, LaunchConfig::linear(batch as u32, threads_for_columns(dim)), &args)
}

/// See [`crate::ops::pooling::mean_pool_backward`]: one block per sequence.
pub fn mean_pool_backward(
    dev: &GpuDevice,
    dinp: &mut GpuBuf,
    dout: &GpuBuf,
    mask: Option<&GpuIds>,
    batch: usize,
    seq: usize,
    dim: usize,
) -> Result<()> {
    const OP: &str = "mean_pool_backward";
    check_mean_pool(dev, OP, ("dinp", dinp), ("dout", dout), mask, batch, seq, dim)?;
    if batch * seq * dim == 0 {
        return Ok(());
    }
    let kernel = format!("mean_pool_backward_{}", dev.act().suffix());
    let args = [Arg::Ptr(dinp.ptr()), Arg::Ptr(dout.ptr()), mask_ptr(mask), Arg::I32(seq as i32), Arg::I32(dim as i32)];
    dev.launch(&kernel, LaunchConfig::linear(batch as u32, POOL_THREADS), &args)
}
