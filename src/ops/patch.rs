//! Image patch extraction for ViT (im2col with stride = kernel = patch): the patch embedding is
//! this followed by a linear layer whose weight is the PyTorch conv weight
//! `[hidden, channels, patch, patch]` viewed as `[hidden, channels·patch·patch]`.

use crate::error::{Result, check_len};
use crate::scalar::Float;

/// Shape of a batch of images cut into square patches.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PatchDims {
    /// Images in the batch.
    pub batch: usize,
    /// Colour channels.
    pub channels: usize,
    /// Image height in pixels (a multiple of `patch`).
    pub height: usize,
    /// Image width in pixels (a multiple of `patch`).
    pub width: usize,
    /// Patch side in pixels.
    pub patch: usize,
}

impl PatchDims {
    /// Patches per image, `(height/patch)·(width/patch)`, in row-major patch order.
    pub fn num_patches(&self) -> usize {
        (self.height / self.patch) * (self.width / self.patch)
    }
    /// Elements of one flattened patch, `channels·patch·patch`, ordered (channel, row, column).
    pub fn patch_len(&self) -> usize {
        self.channels * self.patch * self.patch
    }
}

/// `out[b, p, (c, y, x)] = img[b, c, py·patch + y, px·patch + x]`, `img` as `[B, C, H, W]`.
pub fn patch_forward<T: Float>(out: &mut [T], img: &[T], d: PatchDims) -> Result<()> {
    todo!()
}

/// The exact adjoint of [`patch_forward`]: writes `dimg` (col2im; patches do not overlap).
pub fn patch_backward<T: Float>(dimg: &mut [T], dout: &[T], d: PatchDims) -> Result<()> {
    todo!()
}

/// `out[b, 0, :] = token`, `out[b, 1 + t, :] = inp[b, t, :]`: prepends ViT's class token to
/// each sequence. `inp` is `[batch, seq, dim]`, `out` is `[batch, seq + 1, dim]`.
pub fn prepend_token_forward<T: Float>(
    out: &mut [T],
    token: &[T],
    inp: &[T],
    batch: usize,
    seq: usize,
    dim: usize,
) -> Result<()> {
    todo!()
}

/// Adds `dtoken += Σ_b dout[b, 0, :]` (fixed order) and, when asked, writes
/// `dinp[b, t, :] = dout[b, 1 + t, :]`.
pub fn prepend_token_backward<T: Float>(
    dtoken: &mut [T],
    dinp: Option<&mut [T]>,
    dout: &[T],
    batch: usize,
    seq: usize,
    dim: usize,
) -> Result<()> {
    todo!()
}
