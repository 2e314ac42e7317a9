//! `kernels/optim.cu`: AdamW and SGD on f32 master weights, deterministic sums.

use super::not_yet;
use crate::device::gpu::{GpuBuf, GpuDevice};
use crate::error::Result;
use crate::ops::optim::{AdamWStep, SgdStep};

/// See [`crate::ops::optim::adamw_update`].
pub fn adamw_update(_dev: &GpuDevice, _param: &mut GpuBuf, _grad: &GpuBuf, _m: &mut GpuBuf, _v: &mut GpuBuf, _h: &AdamWStep) -> Result<()> {
    Err(not_yet("adamw_update"))
}
/// See [`crate::ops::optim::sgd_update`].
pub fn sgd_update(_dev: &GpuDevice, _param: &mut GpuBuf, _grad: &GpuBuf, _momentum: &mut GpuBuf, _first: bool, _h: &SgdStep) -> Result<()> {
    Err(not_yet("sgd_update"))
}
/// `Σ x²` in f64, deterministic.
pub fn sum_squares(_dev: &GpuDevice, _x: &GpuBuf) -> Result<f64> {
    Err(not_yet("sum_squares"))
}
/// `Σ x` in f64, deterministic.
pub fn sum(_dev: &GpuDevice, _x: &GpuBuf) -> Result<f64> {
    Err(not_yet("sum"))
}
