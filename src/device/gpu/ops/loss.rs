//! `kernels/loss.cu`: softmax cross-entropy fused with its gradient, one block per row.

use super::elementwise::{fill, threads_for_columns};
use crate::device::gpu::{Arg, Elem, GpuBuf, GpuDevice, GpuIds, LaunchConfig, check_elem, int};
use crate::error::{Result, check_len};

/// See [`crate::ops::cross_entropy::cross_entropy_forward_backward`]. `losses` is f32
/// (statistics); `logits` and `dlogits` are activations. The labels are checked, and the
/// non-ignored ones counted, on the host copy of `targets`.
#[allow(clippy::too_many_arguments)]
pub fn cross_entropy_forward_backward(
    dev: &GpuDevice,
    losses: &mut GpuBuf,
    dlogits: Option<&mut GpuBuf>,
    logits: &GpuBuf,
    targets: &GpuIds,
    rows: usize,
    vocab: usize,
    ignore_index: u32,
    grad_scale: f64,
) -> Result<usize> {
    const OP: &str = "cross_entropy";
    check_len(OP, "losses", losses.len(), rows)?;
    check_len(OP, "targets", targets.len(), rows)?;
    check_len(OP, "logits", logits.len(), rows * vocab)?;
    if let Some(dl) = dlogits.as_deref() {
        check_len(OP, "dlogits", dl.len(), rows * vocab)?;
        check_elem(OP, "dlogits", dl, dev.act())?;
    }
    check_elem(OP, "losses", losses, Elem::F32)?;
    check_elem(OP, "logits", logits, dev.act())?;
    int(OP, "logits", logits.len())?;
    let count = crate::ops::cross_entropy::count_targets(targets.host(), vocab, ignore_index)?;
    if vocab == 0 {
        // Every row is ignored (validated above); no logits, so no gradient to write.
        fill(dev, losses, 0.0)?;
        return Ok(count);
    }
    if rows == 0 {
        return Ok(count);
    }
    let kernel = format!("cross_entropy_{}", dev.act().suffix());
    let args = [
        Arg::Ptr(losses.ptr()),
        Arg::Ptr(dlogits.map_or(0, |d| d.ptr())),
        Arg::Ptr(logits.ptr()),
        Arg::Ptr(targets.ptr()),
        Arg::I32(vocab as i32),
        Arg::U32(ignore_index),
        Arg::F32(grad_scale as f32),
    ];
    dev.launch(&kernel, LaunchConfig::linear(rows as u32, threads_for_columns(vocab)), &args)?;
    Ok(count)
}
