//! `kernels/matmul.cu`: the linear layer's forward and backward.

use super::not_yet;
use crate::device::gpu::{GpuBuf, GpuDevice};
use crate::error::Result;

/// See [`crate::ops::linear::linear_forward`].
#[allow(clippy::too_many_arguments)]
pub fn linear_forward(
    _dev: &GpuDevice,
    _out: &mut GpuBuf,
    _inp: &GpuBuf,
    _weight: &GpuBuf,
    _bias: Option<&GpuBuf>,
    _rows: usize,
    _in_dim: usize,
    _out_dim: usize,
) -> Result<()> {
    Err(not_yet("linear_forward"))
}
/// See [`crate::ops::linear::linear_backward`].
#[allow(clippy::too_many_arguments)]
pub fn linear_backward(
    _dev: &GpuDevice,
    _dinp: Option<&mut GpuBuf>,
    _dweight: Option<&mut GpuBuf>,
    _dbias: Option<&mut GpuBuf>,
    _dout: &GpuBuf,
    _inp: &GpuBuf,
    _weight: &GpuBuf,
    _rows: usize,
    _in_dim: usize,
    _out_dim: usize,
) -> Result<()> {
    Err(not_yet("linear_backward"))
}
