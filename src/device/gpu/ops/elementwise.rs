//! `kernels/elementwise.cu`: fill, casts, scale, GELU, tanh, residual, dropout. Every kernel is
//! a grid-stride loop over the elements, launched by `map`.

use crate::device::Device;
use crate::device::gpu::{Arg, Elem, GpuBuf, GpuDevice, LaunchConfig, check_elem, int};
use crate::error::{Result, check_len};
use crate::ops::dropout::DropoutCoords;
use crate::ops::gelu::Activation;
use crate::ops::rows::RowCopy;

/// Threads per block of the grid-stride kernels.
const THREADS: u32 = 256;
/// Blocks at most: enough to fill an H100 (132 SMs × 8 resident blocks of 256 threads) several
/// times over; larger tensors loop instead of launching more blocks.
const MAX_BLOCKS: usize = 4096;

/// The launch of a grid-stride kernel over `n` elements.
pub(super) fn grid_stride(n: usize) -> LaunchConfig {
    LaunchConfig::linear(n.div_ceil(THREADS as usize).clamp(1, MAX_BLOCKS) as u32, THREADS)
}

/// Threads for a block that walks `cols` columns (one per thread up to 256, then loops): a
/// function of the shape alone, so a kernel's summation order never depends on anything else.
pub(super) fn threads_for_columns(cols: usize) -> u32 {
    cols.next_multiple_of(32).clamp(32, 256) as u32
}

/// Launches the grid-stride `kernel` over `n` elements with arguments `ptrs`, then `n`, then
/// `rest` (every kernel of this file takes its element count right after its pointers).
fn map(dev: &GpuDevice, kernel: &str, n: usize, ptrs: &[Arg], rest: &[Arg]) -> Result<()> {
    if n == 0 {
        return Ok(());
    }
    let mut args = ptrs.to_vec();
    args.push(Arg::I32(int(kernel, "n", n)?));
    args.extend_from_slice(rest);
    dev.launch(kernel, grid_stride(n), &args)
}

/// Checks that every buffer in `bufs` holds the device's activation type.
fn check_acts(dev: &GpuDevice, op: &str, bufs: &[(&str, &GpuBuf)]) -> Result<()> {
    bufs.iter().try_for_each(|(arg, buf)| check_elem(op, arg, buf, dev.act()))
}

/// The element type all of `bufs` share (the first's), or an error naming the odd one. The
/// residual add also sums f32 gradients (the tied copies), so it follows its buffers, not the
/// device's activation type.
fn common_elem(op: &str, bufs: &[(&str, &GpuBuf)]) -> Result<crate::device::gpu::Elem> {
    let elem = bufs[0].1.elem();
    bufs.iter().try_for_each(|(arg, buf)| check_elem(op, arg, buf, elem))?;
    Ok(elem)
}

/// `dst ← src` converting between f32 and bf16 (same length).
pub fn cast(dev: &GpuDevice, dst: &mut GpuBuf, src: &GpuBuf) -> Result<()> {
    check_len("cast", "dst", dst.len(), src.len())?;
    if dst.elem() == src.elem() {
        return if src.is_empty() { Ok(()) } else { dev.runtime().copy_on_device(dst.ptr(), src.ptr(), src.bytes()) };
    }
    let kernel = format!("cast_{}_to_{}", src.elem().suffix(), dst.elem().suffix());
    map(dev, &kernel, dst.len(), &[Arg::Ptr(dst.ptr()), Arg::Ptr(src.ptr())], &[])
}

/// `dst[i] ← value` (rounded to the buffer's element type).
pub fn fill(dev: &GpuDevice, dst: &mut GpuBuf, value: f64) -> Result<()> {
    let kernel = format!("fill_{}", dst.elem().suffix());
    map(dev, &kernel, dst.len(), &[Arg::Ptr(dst.ptr())], &[Arg::F32(value as f32)])
}

/// `x[i] *= s`, on a buffer of either element type.
pub fn scale(dev: &GpuDevice, x: &mut GpuBuf, s: f64) -> Result<()> {
    let kernel = format!("scale_{}", x.elem().suffix());
    map(dev, &kernel, x.len(), &[Arg::Ptr(x.ptr())], &[Arg::F32(s as f32)])
}

/// The kernel-name stem of a GELU form.
fn gelu_stem(kind: Activation) -> &'static str {
    match kind {
        Activation::GeluErf => "gelu_erf",
        Activation::GeluTanh => "gelu_tanh",
    }
}

/// See [`crate::ops::gelu::gelu_forward`].
pub fn gelu_forward(dev: &GpuDevice, out: &mut GpuBuf, inp: &GpuBuf, kind: Activation) -> Result<()> {
    const OP: &str = "gelu_forward";
    check_len(OP, "out", out.len(), inp.len())?;
    check_acts(dev, OP, &[("out", out), ("inp", inp)])?;
    let kernel = format!("{}_forward_{}", gelu_stem(kind), dev.act().suffix());
    map(dev, &kernel, out.len(), &[Arg::Ptr(out.ptr()), Arg::Ptr(inp.ptr())], &[])
}

/// See [`crate::ops::gelu::gelu_backward`].
pub fn gelu_backward(dev: &GpuDevice, dinp: &mut GpuBuf, inp: &GpuBuf, dout: &GpuBuf, kind: Activation) -> Result<()> {
    const OP: &str = "gelu_backward";
    check_len(OP, "inp", inp.len(), dinp.len())?;
    check_len(OP, "dout", dout.len(), dinp.len())?;
    check_acts(dev, OP, &[("dinp", dinp), ("inp", inp), ("dout", dout)])?;
    let kernel = format!("{}_backward_{}", gelu_stem(kind), dev.act().suffix());
    map(dev, &kernel, dinp.len(), &[Arg::Ptr(dinp.ptr()), Arg::Ptr(inp.ptr()), Arg::Ptr(dout.ptr())], &[])
}

/// See [`crate::ops::tanh::tanh_forward`].
pub fn tanh_forward(dev: &GpuDevice, out: &mut GpuBuf, inp: &GpuBuf) -> Result<()> {
    const OP: &str = "tanh_forward";
    check_len(OP, "inp", inp.len(), out.len())?;
    check_acts(dev, OP, &[("out", out), ("inp", inp)])?;
    let kernel = format!("tanh_forward_{}", dev.act().suffix());
    map(dev, &kernel, out.len(), &[Arg::Ptr(out.ptr()), Arg::Ptr(inp.ptr())], &[])
}

/// See [`crate::ops::tanh::tanh_backward`].
pub fn tanh_backward(dev: &GpuDevice, dinp: &mut GpuBuf, out: &GpuBuf, dout: &GpuBuf) -> Result<()> {
    const OP: &str = "tanh_backward";
    check_len(OP, "out", out.len(), dinp.len())?;
    check_len(OP, "dout", dout.len(), dinp.len())?;
    check_acts(dev, OP, &[("dinp", dinp), ("out", out), ("dout", dout)])?;
    let kernel = format!("tanh_backward_{}", dev.act().suffix());
    map(dev, &kernel, dinp.len(), &[Arg::Ptr(dinp.ptr()), Arg::Ptr(out.ptr()), Arg::Ptr(dout.ptr())], &[])
}

/// See [`crate::ops::residual::residual_forward`].
pub fn residual_forward(dev: &GpuDevice, out: &mut GpuBuf, a: &GpuBuf, b: &GpuBuf) -> Result<()> {
    const OP: &str = "residual_forward";
    check_len(OP, "a", a.len(), out.len())?;
    check_len(OP, "b", b.len(), out.len())?;
    let elem = common_elem(OP, &[("out", out), ("a", a), ("b", b)])?;
    let kernel = format!("residual_forward_{}", elem.suffix());
    map(dev, &kernel, out.len(), &[Arg::Ptr(out.ptr()), Arg::Ptr(a.ptr()), Arg::Ptr(b.ptr())], &[])
}

/// See [`crate::ops::residual::residual_backward`]: `dacc += dout`.
pub fn residual_backward(dev: &GpuDevice, dacc: &mut GpuBuf, dout: &GpuBuf) -> Result<()> {
    const OP: &str = "residual_backward";
    check_len(OP, "dout", dout.len(), dacc.len())?;
    let elem = common_elem(OP, &[("dacc", dacc), ("dout", dout)])?;
    let kernel = format!("residual_backward_{}", elem.suffix());
    map(dev, &kernel, dacc.len(), &[Arg::Ptr(dacc.ptr()), Arg::Ptr(dout.ptr())], &[])
}

/// See [`crate::ops::rows::copy_rows`]: one thread per element of the runs. Each buffer holds
/// activations or f32 (a sum of bf16 pieces kept in f32, and read back as bf16).
pub fn copy_rows(dev: &GpuDevice, dst: &mut GpuBuf, src: &GpuBuf, c: RowCopy) -> Result<()> {
    const OP: &str = "copy_rows";
    c.check(dst.len(), src.len())?;
    for (arg, buf) in [("dst", &*dst), ("src", src)] {
        if buf.elem() != Elem::F32 {
            check_elem(OP, arg, buf, dev.act())?;
        }
    }
    let kernel = match (src.elem(), dst.elem()) {
        (from, to) if from == to => format!("copy_rows_{}", to.suffix()),
        (from, to) => format!("copy_rows_{}_to_{}", from.suffix(), to.suffix()),
    };
    let n = c.rows * c.len;
    int_indices(&c)?;
    let rest = [
        Arg::I32(int(OP, "len", c.len)?),
        Arg::I32(int(OP, "dst_offset", c.dst_offset)?),
        Arg::I32(int(OP, "dst_stride", c.dst_stride)?),
        Arg::I32(int(OP, "src_offset", c.src_offset)?),
        Arg::I32(int(OP, "src_stride", c.src_stride)?),
        Arg::I32(c.accumulate as i32),
    ];
    map(dev, &kernel, n, &[Arg::Ptr(dst.ptr()), Arg::Ptr(src.ptr())], &rest)
}

/// The kernel forms `offset + r·stride + e` in an `int`: each term fitting is not enough, the
/// last run's end must (a TeraPipe key/value arena of 16 × 16384 × 12288 has a stride that fits
/// and an end that does not).
fn int_indices(c: &RowCopy) -> Result<()> {
    if c.rows > 0 {
        for (side, offset, stride) in [("dst", c.dst_offset, c.dst_stride), ("src", c.src_offset, c.src_stride)] {
            // No overflow: `RowCopy::check` has bounded it by the buffer's length.
            int("copy_rows", &format!("{side} end"), offset + (c.rows - 1) * stride + c.len)?;
        }
    }
    Ok(())
}

/// See [`crate::ops::dropout`]: the forward and the backward are the same map; `op` names which.
pub fn dropout(dev: &GpuDevice, op: &str, dst: &mut GpuBuf, src: &GpuBuf, p: f32, at: DropoutCoords) -> Result<()> {
    // The same checks, in the same order, as the cpu reference.
    crate::ops::dropout::check_p(p)?;
    let (op, arg, got, expected) = match op {
        "dropout_backward" => ("dropout_backward", "dout", src.len(), dst.len()),
        _ => ("dropout_forward", "out", dst.len(), src.len()),
    };
    check_len(op, arg, got, expected)?;
    check_acts(dev, op, &[("dst", dst), ("src", src)])?;
    if p == 0.0 {
        // Keeps every element at scale 1: a copy, as on the cpu.
        return dev.copy(dst, src);
    }
    let threshold = crate::ops::dropout::keep_threshold(p);
    let scale = (1.0 / (1.0 - p as f64)) as f32;
    let kernel = format!("dropout_{}", dev.act().suffix());
    let rest = [
        Arg::U64(at.seed),
        Arg::U64(at.offset),
        // The kernel's indices stay below 2³¹ (`n` is an int), so a longer row reads the same
        // as u32::MAX: every index falls in its first row.
        Arg::U32(u32::try_from(at.row).unwrap_or(u32::MAX)),
        Arg::U64(at.stride),
        Arg::U64(threshold),
        Arg::F32(scale),
    ];
    map(dev, &kernel, dst.len(), &[Arg::Ptr(dst.ptr()), Arg::Ptr(src.ptr())], &rest)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Key/value rows of 16 sequences × 16384 positions × 12288 channels: every argument is an
    /// `int`, the last run's index is not.
    #[test]
    fn a_row_copy_whose_last_index_passes_2_pow_31_is_refused() {
        let stride = 16384 * 12288;
        let c = RowCopy {
            rows: 16,
            len: 512 * 12288,
            dst_offset: 0,
            dst_stride: stride,
            src_offset: 0,
            src_stride: 512 * 12288,
            accumulate: false,
        };
        let err = int_indices(&c).expect_err("the end passes 2³¹").to_string();
        assert!(err.contains("copy_rows.dst end"), "{err}");
        assert!(int_indices(&RowCopy { rows: 10, ..c }).is_ok(), "10 runs end below 2³¹");
    }
}
