//! Strided row copies: `rows` runs of `len` elements moved from one buffer to another, each side
//! with its own offset and stride, optionally added instead of written. TeraPipe's key/value
//! arena is built from them: a slice's keys written into the arena's rows `c..c+l` of every
//! sample, the context `0..c+l` gathered for attention, and in the backward the context's key
//! gradients added back and the slice's own rows read out.

use crate::error::{Result, config_error};
use crate::scalar::Float;

/// One strided copy: for `r < rows`, `dst[dst_offset + r·dst_stride ..][..len]` receives
/// `src[src_offset + r·src_stride ..][..len]` (written, or added when `accumulate`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RowCopy {
    /// Runs to move.
    pub rows: usize,
    /// Elements per run.
    pub len: usize,
    /// Where run 0 lands in `dst`.
    pub dst_offset: usize,
    /// Distance between runs in `dst`.
    pub dst_stride: usize,
    /// Where run 0 starts in `src`.
    pub src_offset: usize,
    /// Distance between runs in `src`.
    pub src_stride: usize,
    /// `dst += src` instead of `dst = src`.
    pub accumulate: bool,
}

impl RowCopy {
    /// Checks that every run fits its buffer (lengths `dst_len`, `src_len`); the error names the
    /// side that overflows.
    pub fn check(&self, dst_len: usize, src_len: usize) -> Result<()> {
        if self.rows == 0 || self.len == 0 {
            return Ok(());
        }
        for (side, offset, stride, have) in
            [("dst", self.dst_offset, self.dst_stride, dst_len), ("src", self.src_offset, self.src_stride, src_len)]
        {
            let end = (self.rows - 1).checked_mul(stride).and_then(|x| x.checked_add(offset + self.len));
            if end.is_none_or(|end| end > have) {
                return Err(config_error(
                    format!("copy_rows.{side}"),
                    format!(
                        "{} runs of {} at offset {offset}, stride {stride} need {} elements; the buffer has {have}",
                        self.rows,
                        self.len,
                        end.map_or("more than usize".into(), |e| e.to_string())
                    ),
                ));
            }
        }
        Ok(())
    }
}

/// Runs `c` (see [`RowCopy`]). Runs may not overlap inside `dst` (each element is written by one run).
pub fn copy_rows<T: Float>(dst: &mut [T], src: &[T], c: RowCopy) -> Result<()> {
    c.check(dst.len(), src.len())?;
    for r in 0..c.rows {
        let d = &mut dst[c.dst_offset + r * c.dst_stride..][..c.len];
        let s = &src[c.src_offset + r * c.src_stride..][..c.len];
        if c.accumulate {
            d.iter_mut().zip(s).for_each(|(d, &s)| *d += s);
        } else {
            d.copy_from_slice(s);
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn writes_gathers_and_adds_runs() {
        // Two samples of a 5-position arena, width 2: write positions 1..3 of each.
        let mut arena = vec![0.0f64; 2 * 5 * 2];
        let slice: Vec<f64> = (1..=8).map(f64::from).collect(); // [2, 2 positions, 2]
        let write =
            RowCopy { rows: 2, len: 4, dst_offset: 2, dst_stride: 10, src_offset: 0, src_stride: 4, accumulate: false };
        copy_rows(&mut arena, &slice, write).unwrap();
        assert_eq!(arena, [0., 0., 1., 2., 3., 4., 0., 0., 0., 0., 0., 0., 5., 6., 7., 8., 0., 0., 0., 0.]);
        // Adding the same runs again doubles them and leaves the rest alone.
        copy_rows(&mut arena, &slice, RowCopy { accumulate: true, ..write }).unwrap();
        assert_eq!(&arena[2..6], &[2., 4., 6., 8.]);
        assert_eq!(&arena[12..16], &[10., 12., 14., 16.]);
        assert!(arena[..2].iter().chain(&arena[6..12]).chain(&arena[16..]).all(|&x| x == 0.0));
        // Gathering positions 0..3 of each sample.
        let mut ctx = vec![0.0f64; 2 * 3 * 2];
        let gather =
            RowCopy { rows: 2, len: 6, dst_offset: 0, dst_stride: 6, src_offset: 0, src_stride: 10, accumulate: false };
        copy_rows(&mut ctx, &arena, gather).unwrap();
        assert_eq!(ctx, [0., 0., 2., 4., 6., 8., 0., 0., 10., 12., 14., 16.]);
    }

    #[test]
    fn runs_past_the_end_are_errors() {
        let mut dst = vec![0.0f32; 10];
        let c =
            RowCopy { rows: 2, len: 4, dst_offset: 2, dst_stride: 5, src_offset: 0, src_stride: 4, accumulate: false };
        let err = copy_rows(&mut dst, &[0.0; 8], c).unwrap_err().to_string();
        assert!(err.contains("copy_rows.dst") && err.contains("need 11 elements") && err.contains("has 10"), "{err}");
        let err = copy_rows(&mut dst, &[0.0; 7], RowCopy { dst_stride: 4, ..c }).unwrap_err().to_string();
        assert!(err.contains("copy_rows.src"), "{err}");
        assert!(copy_rows(&mut dst, &[], RowCopy { rows: 0, ..c }).is_ok());
    }
}
