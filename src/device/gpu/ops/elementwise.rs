//! `kernels/elementwise.cu`: fill, casts, GELU, tanh, residual, dropout, scale.

use super::not_yet;
use crate::device::gpu::{GpuBuf, GpuDevice};
use crate::error::Result;
use crate::ops::gelu::Activation;

/// `dst ← src` converting between f32 and bf16 (same length).
pub fn cast(_dev: &GpuDevice, _dst: &mut GpuBuf, _src: &GpuBuf) -> Result<()> {
    Err(not_yet("cast"))
}
/// `dst[i] ← value`.
pub fn fill(_dev: &GpuDevice, _dst: &mut GpuBuf, _value: f64) -> Result<()> {
    Err(not_yet("fill"))
}
/// See [`crate::ops::gelu::gelu_forward`].
pub fn gelu_forward(_dev: &GpuDevice, _out: &mut GpuBuf, _inp: &GpuBuf, _kind: Activation) -> Result<()> {
    Err(not_yet("gelu_forward"))
}
/// See [`crate::ops::gelu::gelu_backward`].
pub fn gelu_backward(_dev: &GpuDevice, _dinp: &mut GpuBuf, _inp: &GpuBuf, _dout: &GpuBuf, _kind: Activation) -> Result<()> {
    Err(not_yet("gelu_backward"))
}
/// See [`crate::ops::tanh::tanh_forward`].
pub fn tanh_forward(_dev: &GpuDevice, _out: &mut GpuBuf, _inp: &GpuBuf) -> Result<()> {
    Err(not_yet("tanh_forward"))
}
/// See [`crate::ops::tanh::tanh_backward`].
pub fn tanh_backward(_dev: &GpuDevice, _dinp: &mut GpuBuf, _out: &GpuBuf, _dout: &GpuBuf) -> Result<()> {
    Err(not_yet("tanh_backward"))
}
/// See [`crate::ops::residual::residual_forward`].
pub fn residual_forward(_dev: &GpuDevice, _out: &mut GpuBuf, _a: &GpuBuf, _b: &GpuBuf) -> Result<()> {
    Err(not_yet("residual_forward"))
}
/// See [`crate::ops::residual::residual_backward`].
pub fn residual_backward(_dev: &GpuDevice, _dacc: &mut GpuBuf, _dout: &GpuBuf) -> Result<()> {
    Err(not_yet("residual_backward"))
}
/// See [`crate::ops::dropout`]: the forward and the backward are the same map; `op` names which.
pub fn dropout(_dev: &GpuDevice, op: &str, _dst: &mut GpuBuf, _src: &GpuBuf, _p: f32, _seed: u64, _offset: u64) -> Result<()> {
    Err(not_yet(op))
}
/// `x[i] *= s`.
pub fn scale(_dev: &GpuDevice, _x: &mut GpuBuf, _s: f64) -> Result<()> {
    Err(not_yet("scale"))
}
