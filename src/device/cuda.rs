//! The `cuda` backend (in progress).

use crate::device::gpu::{GpuDevice, Precision};
use crate::error::{Error, Result};

/// GPU `ordinal` computing in `precision`.
pub fn device(ordinal: usize, precision: Precision) -> Result<GpuDevice> {
    let _ = (ordinal, precision);
    Err(Error::State { what: "cuda".into(), message: "the cuda backend is not built yet".into() })
}
