//! Random augmentation of training images, drawn as torchvision's `RandomCrop(size,
//! padding=p)` then `RandomHorizontalFlip()` draw it: the image padded with `p` zero pixels on
//! every side and cropped back to its size at a uniform offset, then mirrored left to right
//! with probability one half. A sample's draw depends on the run's seed, the epoch and the
//! sample's id alone, so a resumed run, every replica and every process see one view of a
//! sample in an epoch, and another view the next epoch.

use super::images::{ImageSample, Pixels};
use crate::rng::{Rng, hash_u64};

/// Which augmentations a run draws (`data.random_crop`, `data.random_flip`); the default draws
/// none.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ImageAugment {
    /// Mirror left to right with probability one half.
    pub flip: bool,
    /// Zero pixels padded on each side before a crop back to the image's size (0: no crop).
    pub crop_padding: usize,
}

/// Keeps augmentation's draws apart from every other stream of the run's seed.
const AUGMENT_STREAM: u64 = 0x6175_676d_656e_7400; // "augment\0"

impl ImageAugment {
    /// Whether it draws anything.
    pub fn is_on(&self) -> bool {
        self.flip || self.crop_padding > 0
    }

    /// `sample` as epoch `epoch` of a run seeded by `seed` sees it (levels kept as levels: a
    /// zero level pads as a zero value).
    pub fn augmented(&self, sample: &ImageSample, seed: u64, epoch: u64) -> ImageSample {
        let mut rng = Rng::new(hash_u64(hash_u64(hash_u64(seed, AUGMENT_STREAM), epoch), sample.id));
        let pixels = match &sample.pixels {
            Pixels::Levels(levels) => Pixels::Levels(self.view(levels, sample, &mut rng)),
            Pixels::Scaled(values) => Pixels::Scaled(self.view(values, sample, &mut rng)),
        };
        let ImageSample { id, label, width, height, channels, .. } = *sample;
        ImageSample { id, pixels, label, width, height, channels }
    }

    /// `pixels`, `sample`'s, cropped and flipped as `rng` draws.
    fn view<T: Copy + Default>(&self, pixels: &[T], sample: &ImageSample, rng: &mut Rng) -> Vec<T> {
        let (side, channels) = (sample.width, sample.channels);
        debug_assert_eq!(sample.height, side, "square images");
        let mut pixels = match self.crop_padding {
            0 => pixels.to_vec(),
            p => {
                let span = 2 * p as u64 + 1;
                let (top, left) = (rng.below(span) as usize, rng.below(span) as usize);
                crop(pixels, channels, side, p, (top, left))
            }
        };
        if self.flip && rng.below(2) == 1 {
            pixels.chunks_exact_mut(side).for_each(<[T]>::reverse);
        }
        pixels
    }
}

/// The `side × side` window at `(top, left)` of the planes padded with `padding` zeros on each
/// side: pixel `(y, x)` is the input's `(y + top − padding, x + left − padding)`, or 0 outside.
fn crop<T: Copy + Default>(
    pixels: &[T],
    channels: usize,
    side: usize,
    padding: usize,
    (top, left): (usize, usize),
) -> Vec<T> {
    let mut out = vec![T::default(); channels * side * side];
    let inside = |i: usize, offset: usize| (i + offset).checked_sub(padding).filter(|&j| j < side);
    for (plane_in, plane_out) in pixels.chunks_exact(side * side).zip(out.chunks_exact_mut(side * side)) {
        for (y, row_out) in plane_out.chunks_exact_mut(side).enumerate() {
            let Some(from_y) = inside(y, top) else { continue };
            for (x, out) in row_out.iter_mut().enumerate() {
                if let Some(from_x) = inside(x, left) {
                    *out = plane_in[from_y * side + from_x];
                }
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Values 1, 2, 3, … (as levels, of value `level / 255`, where `levels`).
    fn image(id: u64, channels: usize, side: usize, levels: bool) -> ImageSample {
        let values = 1..=(channels * side * side) as u8;
        let pixels = match levels {
            true => Pixels::Levels(values.collect()),
            false => Pixels::Scaled(values.map(f32::from).collect()),
        };
        ImageSample { id, pixels, label: 0, width: side, height: side, channels }
    }

    fn sample(id: u64, channels: usize, side: usize) -> ImageSample {
        image(id, channels, side, false)
    }

    /// A crop moves every plane by the same offset and fills what it uncovers with zeros; the
    /// centre offset (`top = left = padding`) is the image itself.
    #[test]
    fn a_crop_shifts_every_plane_and_fills_with_zeros() {
        let s = sample(0, 2, 3).pixels.to_f32();
        assert_eq!(crop(&s, 2, 3, 1, (1, 1)), s);
        // The image moved one down and one left: row 0 and column 2 come from the padding.
        let got = crop(&s, 2, 3, 1, (0, 2));
        assert_eq!(got, [0.0, 0.0, 0.0, 2.0, 3.0, 0.0, 5.0, 6.0, 0.0, 0.0, 0.0, 0.0, 11.0, 12.0, 0.0, 14.0, 15.0, 0.0]);
        // Past the image: nothing of it left.
        assert_eq!(crop(&s, 2, 3, 3, (0, 0)), vec![0.0; 18]);
    }

    /// Levels are cropped and flipped as levels, into the view their values would give: the
    /// same draws, a zero level where a value pads with zero.
    #[test]
    fn levels_take_the_view_their_values_take() {
        let augment = ImageAugment { flip: true, crop_padding: 2 };
        for epoch in 0..50 {
            let (levels, values) = (image(5, 3, 4, true), image(5, 3, 4, false));
            let view = augment.augmented(&levels, 9, epoch);
            assert!(matches!(view.pixels, Pixels::Levels(_)), "kept as levels");
            let scaled: Vec<f32> =
                augment.augmented(&values, 9, epoch).pixels.to_f32().iter().map(|v| v / 255.0).collect();
            assert_eq!(view.pixels.to_f32(), scaled, "epoch {epoch}");
        }
    }

    /// A sample's view is fixed by the seed, the epoch and its id, and changes with each;
    /// over many samples about half are mirrored, every crop offset is drawn, and each view is
    /// a mirror and a shift of the image (nothing else changes: label, id, shape).
    #[test]
    fn views_are_drawn_by_seed_epoch_and_id() {
        let flip = ImageAugment { flip: true, crop_padding: 0 };
        let s = sample(7, 1, 4);
        assert_eq!(flip.augmented(&s, 1, 2), flip.augmented(&s, 1, 2));
        let values = s.pixels.to_f32();
        let mirrored: Vec<f32> = values.chunks(4).flat_map(|r| r.iter().rev().copied()).collect();
        let views: Vec<Vec<f32>> = (0..400).map(|epoch| flip.augmented(&s, 1, epoch).pixels.to_f32()).collect();
        assert!(views.iter().all(|v| *v == values || *v == mirrored));
        let flipped = views.iter().filter(|v| **v == mirrored).count();
        assert!((160..=240).contains(&flipped), "{flipped} of 400 mirrored");
        let by_id: Vec<bool> = (0..64).map(|id| flip.augmented(&sample(id, 1, 4), 1, 0).pixels != s.pixels).collect();
        let by_seed: Vec<bool> = (0..64).map(|seed| flip.augmented(&s, seed, 0).pixels.to_f32() == mirrored).collect();
        assert!(by_id.contains(&true) && by_id.contains(&false) && by_seed.contains(&true) && by_seed.contains(&false));

        let both = ImageAugment { flip: true, crop_padding: 1 };
        let mut offsets = std::collections::BTreeSet::new();
        for epoch in 0..200 {
            let view = both.augmented(&s, 3, epoch);
            assert_eq!((view.id, view.label, view.width, view.channels), (s.id, s.label, s.width, s.channels));
            let view = view.pixels.to_f32();
            let found = (0..3).flat_map(|t| (0..3).map(move |l| (t, l))).find(|&at| {
                let shifted = crop(&values, 1, 4, 1, at);
                let mirrored: Vec<f32> = shifted.chunks(4).flat_map(|r| r.iter().rev().copied()).collect();
                view == shifted || view == mirrored
            });
            offsets.insert(found.expect("a view is a shifted image, mirrored or not"));
        }
        assert_eq!(offsets.len(), 9, "every offset of 3 × 3: {offsets:?}");
        assert!(!ImageAugment::default().is_on() && both.is_on());
    }
}
