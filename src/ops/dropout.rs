//! Inverted dropout with a counter-based mask: element `i` is kept iff
//! `hash_u64(seed, offset + i)` falls above `p·2⁶⁴`, and kept values are scaled by `1/(1−p)`.
//! Nothing is stored: the backward (and a CUDA kernel, and a micro-batch of the same samples)
//! recomputes the same mask from `(seed, offset + i)`.

use crate::error::{Result, check_len};
use crate::rng::hash_u64;
use crate::scalar::Float;

/// Whether element `counter` survives dropout with drop probability `p` (0 ≤ p < 1).
#[inline(always)]
pub fn dropout_keep(seed: u64, counter: u64, p: f32) -> bool {
    let threshold = (p as f64 * 18_446_744_073_709_551_616.0) as u64; // p·2⁶⁴, saturating
    hash_u64(seed, counter) >= threshold
}

/// `out[i] = keep(i) ? inp[i]/(1−p) : 0`. `p = 0` is the identity (a copy).
pub fn dropout_forward<T: Float>(out: &mut [T], inp: &[T], p: f32, seed: u64, offset: u64) -> Result<()> {
    todo!()
}

/// Writes `dinp[i] = keep(i) ? dout[i]/(1−p) : 0`, the same mask as the forward.
pub fn dropout_backward<T: Float>(dinp: &mut [T], dout: &[T], p: f32, seed: u64, offset: u64) -> Result<()> {
    todo!()
}
