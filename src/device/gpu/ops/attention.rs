//! `kernels/attention.cu`: fused attention forward and backward (online softmax; the saved state
//! is one log-sum-exp per query row, never the T×T matrix).

use super::not_yet;
use crate::device::gpu::{GpuBuf, GpuDevice, GpuIds};
use crate::error::Result;
use crate::ops::attention::AttentionDims;

/// Elements the forward saves for the backward: one log-sum-exp per (batch, head, query).
pub fn saved_len(d: &AttentionDims) -> usize {
    d.batch * d.heads * d.q_len
}
/// See [`crate::ops::attention::attention_forward`]; `saved` holds [`saved_len`] elements.
#[allow(clippy::too_many_arguments)]
pub fn attention_forward(
    _dev: &GpuDevice,
    _out: &mut GpuBuf,
    _saved: &mut GpuBuf,
    _q: &GpuBuf,
    _k: &GpuBuf,
    _v: &GpuBuf,
    _key_mask: Option<&GpuIds>,
    _d: &AttentionDims,
) -> Result<()> {
    Err(not_yet("attention_forward"))
}
/// See [`crate::ops::attention::attention_backward`].
#[allow(clippy::too_many_arguments)]
pub fn attention_backward(
    _dev: &GpuDevice,
    _dq: &mut GpuBuf,
    _dk: &mut GpuBuf,
    _dv: &mut GpuBuf,
    _dout: &GpuBuf,
    _q: &GpuBuf,
    _k: &GpuBuf,
    _v: &GpuBuf,
    _out: &GpuBuf,
    _saved: &GpuBuf,
    _key_mask: Option<&GpuIds>,
    _d: &AttentionDims,
) -> Result<()> {
    Err(not_yet("attention_backward"))
}
