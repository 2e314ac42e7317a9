//! An image resized as PIL's bilinear filter resizes it (`Image.resize(size, BILINEAR)`, what
//! torchvision's `Resize` and Hugging Face's `ViTImageProcessor` run by default), so a model
//! trained here sees a user's images as those tools would have fed them. Each output pixel is a
//! weighted mean of the input pixels under a triangle as wide as the output pixel's footprint:
//! a shrunk image averages every pixel it covers (antialiased, where plain bilinear sampling
//! would skip some), an enlarged one interpolates between neighbours. The filter is separable:
//! rows first, then columns, into an intermediate image of the input's type (whole levels for
//! an 8-bit image, `f32`s for a float one), as Pillow up to 12 resizes. Pillow 13 takes the
//! columns first where the height shrinks much more than the width (python-pillow/Pillow#9549);
//! an 8-bit image it resizes so can differ from ours by a level in some pixels.

/// `channels` planes of `h × w` pixels (`[C, H, W]`, values in `[0, 1]` after dividing by
/// their format's largest value `max`) resized to `out_h × out_w` each (the aspect ratio is
/// not kept: a square model input from an oblong image, as `Resize((n, n))`). 8-bit images
/// (`max` 255) are resized as Pillow up to 12 resizes an 8-bit image, what `ViTImageProcessor`
/// and torchvision's `Resize` do with one: in whole levels, bit for bit (Pillow 13: the module's
/// note). Any other depth in floating point, as Pillow resizes a float (`F`) image. (Pillow
/// opens a PGM of a maximum over 255 in whole levels of 65535: within about 1e-5 of ours. One
/// of a maximum `m` under 255 it opens as 8-bit, `v` as the level `round(v/m · 255)`, ties to
/// even (checked for every `m` against Pillow 13): up to half a level, 2e-3, from our `v/m`.)
pub fn resize_image(pixels: &[f32], max: u32, channels: usize, from: (usize, usize), to: (usize, usize)) -> Vec<f32> {
    if max != 255 {
        return resize_bilinear(pixels, channels, from, to);
    }
    // The values are `level / 255` in f32: `× 255` is within 1e-4 of the level, so adding a
    // half and truncating (`as` saturates at 0 and 255) gives the level back exactly, without
    // `round`'s call to libm.
    let levels: Vec<u8> = pixels.iter().map(|&v| (v * 255.0 + 0.5) as u8).collect();
    resize_levels(&levels, channels, from, to).into_iter().map(super::level_value).collect()
}

/// [`resize_image`] of 8-bit levels (`[C, H, W]`), to levels.
pub(crate) fn resize_levels(levels: &[u8], channels: usize, from: (usize, usize), to: (usize, usize)) -> Vec<u8> {
    resample(levels, channels, from, to)
}

/// [`resize_image`]'s floating-point resize, for pixels of any scale.
fn resize_bilinear(pixels: &[f32], channels: usize, from: (usize, usize), to: (usize, usize)) -> Vec<f32> {
    resample(pixels, channels, from, to)
}

/// A pixel type Pillow resamples: how it keeps a tap's weights and sums them.
trait Resampled: Copy + Default {
    type Weight;
    fn weights(w: &[f64]) -> Vec<Self::Weight>;
    fn mean<'a>(weights: &[Self::Weight], values: impl Iterator<Item = &'a Self>) -> Self
    where
        Self: 'a;
}

impl Resampled for f32 {
    type Weight = f64;
    fn weights(w: &[f64]) -> Vec<f64> {
        w.to_vec()
    }
    #[inline(always)]
    fn mean<'a>(weights: &[f64], values: impl Iterator<Item = &'a f32>) -> f32 {
        weights.iter().zip(values).map(|(&k, &v)| k * v as f64).sum::<f64>() as f32
    }
}

/// Pillow's fixed point for 8-bit images: weights of 22 fractional bits (`PRECISION_BITS`,
/// leaving room for 8-bit values and a sign), each rounded half away from zero.
const PRECISION_BITS: u32 = 32 - 8 - 2;

impl Resampled for u8 {
    type Weight = i32;
    fn weights(w: &[f64]) -> Vec<i32> {
        let one = (1i64 << PRECISION_BITS) as f64;
        w.iter().map(|&k| (k * one + if k < 0.0 { -0.5 } else { 0.5 }) as i32).collect()
    }
    /// The sum from one half (rounding), clipped to a level (Pillow's `clip8`).
    #[inline(always)]
    fn mean<'a>(weights: &[i32], values: impl Iterator<Item = &'a u8>) -> u8 {
        let sum = weights.iter().zip(values).fold(1i32 << (PRECISION_BITS - 1), |s, (&k, &v)| s + k * v as i32);
        (sum >> PRECISION_BITS).clamp(0, 255) as u8
    }
}

/// The filter over each plane: rows first, into a `h × out_w` image of `T`s, then columns.
fn resample<T: Resampled>(
    pixels: &[T],
    channels: usize,
    (h, w): (usize, usize),
    (out_h, out_w): (usize, usize),
) -> Vec<T> {
    debug_assert_eq!(pixels.len(), channels * h * w);
    let typed = |taps: Vec<(usize, Vec<f64>)>| -> Vec<(usize, Vec<T::Weight>)> {
        taps.into_iter().map(|(first, w)| (first, T::weights(&w))).collect()
    };
    let (across, down) = (typed(weights(w, out_w)), typed(weights(h, out_h)));
    let mut rows = vec![T::default(); channels * h * out_w];
    // (Compiled for the CPU's vector width: a level's taps sum in its lanes; integers, so in
    // any order. Floats keep theirs: the compiler does not reorder their sums.)
    crate::ops::simd::vectorized(
        #[inline(always)]
        || {
            for (row_in, row_out) in pixels.chunks_exact(w).zip(rows.chunks_exact_mut(out_w)) {
                for (out, (first, ws)) in row_out.iter_mut().zip(&across) {
                    *out = T::mean(ws, row_in[*first..].iter());
                }
            }
        },
    );
    let mut out = vec![T::default(); channels * out_h * out_w];
    for (plane_in, plane_out) in rows.chunks_exact(h * out_w).zip(out.chunks_exact_mut(out_h * out_w)) {
        for (row_out, (first, ws)) in plane_out.chunks_exact_mut(out_w).zip(&down) {
            for (x, out) in row_out.iter_mut().enumerate() {
                *out = T::mean(ws, plane_in[first * out_w + x..].iter().step_by(out_w));
            }
        }
    }
    out
}

/// For each of `out_size` output positions along one dimension of `in_size` pixels, the first
/// input pixel it reads and the weights of it and those after it (summing to 1), as Pillow's
/// `precompute_coeffs` makes them for its bilinear filter (support 1, widened by the scale when
/// shrinking).
fn weights(in_size: usize, out_size: usize) -> Vec<(usize, Vec<f64>)> {
    let scale = in_size as f64 / out_size as f64;
    let widen = scale.max(1.0);
    let (support, narrow) = (widen, 1.0 / widen);
    let triangle = |x: f64| (1.0 - x.abs()).max(0.0);
    (0..out_size)
        .map(|i| {
            let center = (i as f64 + 0.5) * scale;
            // C's truncation toward zero, as Pillow's `(int)` casts (then clamped to the image).
            let first = (center - support + 0.5).trunc().max(0.0) as usize;
            let end = ((center + support + 0.5).trunc() as usize).min(in_size);
            let mut ws: Vec<f64> = (first..end).map(|x| triangle((x as f64 - center + 0.5) * narrow)).collect();
            let total: f64 = ws.iter().sum();
            if total != 0.0 {
                ws.iter_mut().for_each(|w| *w /= total);
            }
            (first, ws)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A 7-wide, 5-high image, pixel `(x, y)` = `((3x + 5y) mod 11) / 10`, resized by Pillow
    /// 13.0.0 in float mode (`Image.new('F', (7, 5))`, `putdata`, `resize((w, h),
    /// Image.Resampling.BILINEAR)`), printed to 9 significant digits: shrinking, enlarging,
    /// both at once and the same size. Pillow keeps its weights and sums in f64 and rounds each
    /// pass to f32, as ours: within 1e-6.
    #[test]
    #[allow(clippy::excessive_precision)] // Pillow's values as it printed them
    fn resizing_matches_pillows_bilinear_filter() {
        let image: Vec<f32> = (0..5).flat_map(|y| (0..7).map(move |x| ((x * 3 + y * 5) % 11) as f32 / 10.0)).collect();
        let pillow: [((usize, usize), &[f32]); 4] = [
            (
                (4, 3),
                &[
                    0.323214293,
                    0.52352941,
                    0.469642878,
                    0.533333361,
                    0.411274523,
                    0.46369049,
                    0.612500012,
                    0.503921568,
                    0.405357152,
                    0.501785696,
                    0.607352972,
                    0.471428573,
                ],
            ),
            (
                (4, 4),
                &[
                    0.269047618,
                    0.528999984,
                    0.432000011,
                    0.523809493,
                    0.616666675,
                    0.360666662,
                    0.454333365,
                    0.456746042,
                    0.588888884,
                    0.636000037,
                    0.395999998,
                    0.398412704,
                    0.53928566,
                    0.497000009,
                    0.68599999,
                    0.38809526,
                ],
            ),
            (
                (9, 11),
                &[
                    0.0,
                    0.13636364,
                    0.327272743,
                    0.51818186,
                    0.709090889,
                    0.899999976,
                    0.390909076,
                    0.181818187,
                    0.372727275,
                    0.563636363,
                    0.699999988,
                    0.166666672,
                    0.303030312,
                    0.460606068,
                    0.418181837,
                    0.5090909,
                    0.699999988,
                    0.424242407,
                    0.348484844,
                    0.539393961,
                    0.530303001,
                    0.5,
                    0.444444448,
                    0.580808043,
                    0.682828307,
                    0.25151515,
                    0.175757587,
                    0.366666675,
                    0.479797989,
                    0.626262605,
                    0.817171693,
                    0.474747479,
                    0.166666672,
                    0.722222209,
                    0.636363626,
                    0.50505054,
                    0.307070702,
                    0.331313133,
                    0.522222221,
                    0.402020216,
                    0.415151507,
                    0.606060624,
                    0.463636369,
                    0.322222233,
                    1.0,
                    0.636363626,
                    0.227272734,
                    0.418181807,
                    0.609090924,
                    0.800000012,
                    0.290909082,
                    0.0818181857,
                    0.272727281,
                    0.463636369,
                    0.600000024,
                    0.666666687,
                    0.580808103,
                    0.50505048,
                    0.695959628,
                    0.664646447,
                    0.466666669,
                    0.346464664,
                    0.359595954,
                    0.550505102,
                    0.408080816,
                    0.266666681,
                    0.455555558,
                    0.536363661,
                    0.660606027,
                    0.851515174,
                    0.686868668,
                    0.25555557,
                    0.446464658,
                    0.604040384,
                    0.717171729,
                    0.363636374,
                    0.055555556,
                    0.733333349,
                    0.536363602,
                    0.327272713,
                    0.518181801,
                    0.575757563,
                    0.533333302,
                    0.724242449,
                    0.715151548,
                    0.439393967,
                    0.363636374,
                    0.333333343,
                    0.899999976,
                    0.536363602,
                    0.127272725,
                    0.318181813,
                    0.5090909,
                    0.699999988,
                    0.890909076,
                    0.781818211,
                    0.272727281,
                    0.363636374,
                    0.5,
                ],
            ),
            ((5, 7), &[]),
        ];
        for ((out_h, out_w), expected) in pillow {
            let expected = if expected.is_empty() { &image[..] } else { expected };
            let got = resize_bilinear(&image, 1, (5, 7), (out_h, out_w));
            assert_eq!(got.len(), expected.len(), "{out_h}×{out_w}");
            for (i, (g, e)) in got.iter().zip(expected).enumerate() {
                assert!((g - e).abs() <= 1e-6, "{out_h}×{out_w}, pixel {i}: {g} against Pillow's {e}");
            }
        }
    }

    /// A 7-wide, 5-high 8-bit image, pixel `(x, y)` = `(53x + 91y + 17xy) mod 256`, resized by
    /// Pillow 13.0.0 (`Image.new('L', (7, 5))`, `putdata`, `resize((w, h),
    /// Image.Resampling.BILINEAR)`; Pillow 12.3.0 gives the same): its fixed-point weights and
    /// its rounding of each pass to a level, bit for bit.
    #[test]
    fn eight_bit_images_are_resized_as_pillow_resizes_them_to_the_level() {
        let level = |x: usize, y: usize| ((x * 53 + y * 91 + x * y * 17) % 256) as u8;
        let image: Vec<u8> = (0..5).flat_map(|y| (0..7).map(move |x| level(x, y))).collect();
        let pillow: [((usize, usize), &[u8]); 4] = [
            ((4, 3), &[72, 138, 102, 126, 117, 162, 100, 124, 104, 144, 150, 119]),
            (
                (9, 11),
                &[
                    0, 24, 58, 92, 125, 159, 193, 157, 27, 38, 62, 30, 57, 94, 132, 138, 121, 159, 149, 78, 100, 126,
                    81, 112, 155, 199, 159, 58, 101, 137, 162, 202, 234, 131, 115, 102, 152, 149, 108, 85, 93, 143,
                    191, 227, 182, 105, 21, 76, 132, 187, 79, 42, 97, 152, 192, 90, 82, 82, 143, 153, 124, 112, 94, 65,
                    113, 157, 27, 75, 140, 190, 166, 89, 138, 133, 56, 87, 122, 78, 130, 188, 153, 149, 168, 132, 121,
                    140, 112, 87, 108, 163, 217, 131, 138, 215, 129, 113, 190, 127, 66,
                ],
            ),
            ((4, 4), &[53, 124, 145, 89, 119, 141, 98, 188, 86, 139, 103, 112, 137, 157, 136, 116]),
            ((2, 2), &[113, 130, 128, 121]),
        ];
        for (to, expected) in pillow {
            assert_eq!(resample(&image, 1, (5, 7), to), expected, "{to:?}");
            // Through the pixels' [0, 1] values, as the loaders hold them.
            let pixels: Vec<f32> = image.iter().map(|&l| l as f32 / 255.0).collect();
            let levels: Vec<f32> = expected.iter().map(|&l| l as f32 / 255.0).collect();
            assert_eq!(resize_image(&pixels, 255, 1, (5, 7), to), levels, "{to:?}");
        }
        assert_eq!(resample(&image, 1, (5, 7), (5, 7)), image);
    }

    /// The same pattern 7 wide and 23 high, shrunk in height more than in width, where the
    /// order of the passes moves some pixels by a level: rows first, as Pillow 12.3.0 resizes
    /// (Pillow 13.0.0 takes the columns first here and gives, for 4 × 8, 128 and 131 for the
    /// 14th and 15th pixels and 126 for the 22nd).
    #[test]
    fn the_rows_are_resized_first_as_pillow_12_does() {
        let level = |x: usize, y: usize| ((x * 53 + y * 91 + x * y * 17) % 256) as u8;
        let image: Vec<u8> = (0..23).flat_map(|y| (0..7).map(move |x| level(x, y))).collect();
        let pillow_12: [((usize, usize), &[u8]); 2] = [
            (
                (4, 8),
                &[
                    96, 109, 144, 147, 133, 121, 112, 134, 132, 116, 135, 132, 122, 129, 130, 99, 144, 132, 128, 133,
                    129, 125, 131, 111, 115, 120, 113, 115, 118, 113, 106, 112,
                ],
            ),
            ((3, 5), &[106, 137, 137, 123, 118, 135, 130, 129, 130, 117, 123, 119, 120, 113, 112]),
        ];
        for (to, expected) in pillow_12 {
            assert_eq!(resample(&image, 1, (23, 7), to), expected, "{to:?}");
        }
    }

    /// Every plane is resized alone: a second channel's values never leak into the first's.
    #[test]
    fn each_channel_is_resized_on_its_own() {
        let (a, b): (Vec<f32>, Vec<f32>) = (0..30).map(|i| (i as f32 / 29.0, 1.0 - (i % 7) as f32 / 6.0)).unzip();
        let both = resize_bilinear(&[a.clone(), b.clone()].concat(), 2, (5, 6), (3, 4));
        let (ra, rb) = (resize_bilinear(&a, 1, (5, 6), (3, 4)), resize_bilinear(&b, 1, (5, 6), (3, 4)));
        assert_eq!(both, [ra, rb].concat());
    }
}
