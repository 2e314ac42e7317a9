//! Dropout as units use it: a no-op (the buffer moves through) in eval or at p = 0, otherwise
//! the counter-based mask of [`crate::ops::dropout`] at coordinates derived from the batch.

use super::batch::{Batch, DropoutLayout};
use crate::device::Device;
use crate::error::Result;

/// A dropout site inside a unit: its probability and a site id unique in the model.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct DropoutSite {
    /// Drop probability.
    pub p: f32,
    /// Unique id of the site (unit index · 16 + local index).
    pub site: u64,
}

impl DropoutSite {
    /// Whether this site drops anything in a pass: only a training pass through a trainable
    /// unit does (frozen units and evaluation run deterministically, so a frozen prefix's output
    /// can be cached and reused exactly).
    pub fn active(&self, train: bool) -> bool {
        train && self.p > 0.0
    }

    /// Applies dropout to `x` (laid out as `layout` says) in a training pass, consuming it.
    pub fn forward<D: Device>(
        &self,
        dev: &D,
        batch: &Batch<D>,
        x: D::Buf,
        layout: DropoutLayout,
        train: bool,
    ) -> Result<D::Buf> {
        if !self.active(train) {
            return Ok(x);
        }
        let mut out = dev.alloc(D::len(&x))?;
        dev.dropout_forward(&mut out, &x, self.p, batch.dropout_coords(self.site, layout))?;
        Ok(out)
    }

    /// The gradient through the same mask (a backward always follows a training pass); `None`
    /// means "unchanged: use `dy`".
    pub fn backward<D: Device>(
        &self,
        dev: &D,
        batch: &Batch<D>,
        dy: &D::Buf,
        layout: DropoutLayout,
    ) -> Result<Option<D::Buf>> {
        if !self.active(true) {
            return Ok(None);
        }
        let mut dx = dev.alloc(D::len(dy))?;
        dev.dropout_backward(&mut dx, dy, self.p, batch.dropout_coords(self.site, layout))?;
        Ok(Some(dx))
    }
}
