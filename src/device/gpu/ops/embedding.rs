//! `kernels/embedding.cu`: token/position embeddings, ViT patches and the class token, pooling.

use super::not_yet;
use crate::device::gpu::{GpuBuf, GpuDevice, GpuIds};
use crate::error::Result;
use crate::ops::patch::PatchDims;

/// See [`crate::ops::embedding::embedding_forward`].
pub fn embedding_forward(_dev: &GpuDevice, _out: &mut GpuBuf, _ids: &GpuIds, _table: &GpuBuf, _dim: usize, _accumulate: bool) -> Result<()> {
    Err(not_yet("embedding_forward"))
}
/// See [`crate::ops::embedding::embedding_backward`].
pub fn embedding_backward(_dev: &GpuDevice, _dtable: &mut GpuBuf, _ids: &GpuIds, _dout: &GpuBuf, _dim: usize) -> Result<()> {
    Err(not_yet("embedding_backward"))
}
/// See [`crate::ops::patch::patch_forward`].
pub fn patch_forward(_dev: &GpuDevice, _out: &mut GpuBuf, _img: &GpuBuf, _d: PatchDims) -> Result<()> {
    Err(not_yet("patch_forward"))
}
/// See [`crate::ops::patch::patch_backward`].
pub fn patch_backward(_dev: &GpuDevice, _dimg: &mut GpuBuf, _dout: &GpuBuf, _d: PatchDims) -> Result<()> {
    Err(not_yet("patch_backward"))
}
/// See [`crate::ops::patch::prepend_token_forward`].
pub fn prepend_token_forward(_dev: &GpuDevice, _out: &mut GpuBuf, _token: &GpuBuf, _inp: &GpuBuf, _batch: usize, _seq: usize, _dim: usize) -> Result<()> {
    Err(not_yet("prepend_token_forward"))
}
/// See [`crate::ops::patch::prepend_token_backward`].
pub fn prepend_token_backward(_dev: &GpuDevice, _dtoken: &mut GpuBuf, _dinp: Option<&mut GpuBuf>, _dout: &GpuBuf, _batch: usize, _seq: usize, _dim: usize) -> Result<()> {
    Err(not_yet("prepend_token_backward"))
}
/// See [`crate::ops::pooling::first_token_pool_forward`].
pub fn first_token_pool_forward(_dev: &GpuDevice, _out: &mut GpuBuf, _inp: &GpuBuf, _batch: usize, _seq: usize, _dim: usize) -> Result<()> {
    Err(not_yet("first_token_pool_forward"))
}
/// See [`crate::ops::pooling::first_token_pool_backward`].
pub fn first_token_pool_backward(_dev: &GpuDevice, _dinp: &mut GpuBuf, _dout: &GpuBuf, _batch: usize, _seq: usize, _dim: usize) -> Result<()> {
    Err(not_yet("first_token_pool_backward"))
}
/// See [`crate::ops::pooling::mean_pool_forward`].
pub fn mean_pool_forward(_dev: &GpuDevice, _out: &mut GpuBuf, _inp: &GpuBuf, _mask: Option<&GpuIds>, _batch: usize, _seq: usize, _dim: usize) -> Result<()> {
    Err(not_yet("mean_pool_forward"))
}
/// See [`crate::ops::pooling::mean_pool_backward`].
pub fn mean_pool_backward(_dev: &GpuDevice, _dinp: &mut GpuBuf, _dout: &GpuBuf, _mask: Option<&GpuIds>, _batch: usize, _seq: usize, _dim: usize) -> Result<()> {
    Err(not_yet("mean_pool_backward"))
}
