//! `kernels/norm.cu`: LayerNorm and row softmax.

use super::not_yet;
use crate::device::gpu::{GpuBuf, GpuDevice};
use crate::error::Result;

/// See [`crate::ops::layernorm::layernorm_forward`].
#[allow(clippy::too_many_arguments)]
pub fn layernorm_forward(_dev: &GpuDevice, _out: &mut GpuBuf, _mean: &mut GpuBuf, _rstd: &mut GpuBuf, _inp: &GpuBuf, _weight: &GpuBuf, _bias: &GpuBuf, _rows: usize, _dim: usize, _eps: f64) -> Result<()> {
    Err(not_yet("layernorm_forward"))
}
/// See [`crate::ops::layernorm::layernorm_backward`].
#[allow(clippy::too_many_arguments)]
pub fn layernorm_backward(_dev: &GpuDevice, _dinp: &mut GpuBuf, _dweight: &mut GpuBuf, _dbias: &mut GpuBuf, _dout: &GpuBuf, _inp: &GpuBuf, _weight: &GpuBuf, _mean: &GpuBuf, _rstd: &GpuBuf, _rows: usize, _dim: usize) -> Result<()> {
    Err(not_yet("layernorm_backward"))
}
/// See [`crate::ops::softmax::softmax_forward`].
pub fn softmax_forward(_dev: &GpuDevice, _out: &mut GpuBuf, _inp: &GpuBuf, _rows: usize, _cols: usize) -> Result<()> {
    Err(not_yet("softmax_forward"))
}
/// See [`crate::ops::softmax::softmax_backward`].
pub fn softmax_backward(_dev: &GpuDevice, _dinp: &mut GpuBuf, _out: &GpuBuf, _dout: &GpuBuf, _rows: usize, _cols: usize) -> Result<()> {
    Err(not_yet("softmax_backward"))
}
