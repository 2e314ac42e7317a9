//! Images a user hands to `predict`: PNG, JPEG and PGM files, and IDX files of many images. Pixels
//! come out channel-first (`[C, H, W]`, what the ViT's patch embedding reads) in `[0, 1]`
//! (8-bit values / 255, 16-bit / 65535), as the training datasets are scaled.

use super::files::{SetupGroup, dataset_error, read_bytes};
use super::images::{IDX_IMAGES_MAGIC, Pixels, level_value, parse_idx};
use super::jpeg::decode_jpeg;
use crate::error::Result;
use std::path::Path;

/// An image: width, height, channels and `[C, H, W]` pixels in `[0, 1]`.
pub type ImagePixels = (usize, usize, usize, Vec<f32>);

/// Every image of an IDX file (magic `0x0803`, unsigned bytes; gzip if the name ends in
/// `.gz`): one channel each.
pub fn read_idx_images(path: &Path) -> Result<Vec<ImagePixels>> {
    let bytes = read_bytes(path, SetupGroup::User)?;
    let (dims, data) = parse_idx(path, &bytes, IDX_IMAGES_MAGIC)?;
    let (h, w) = (dims[1], dims[2]);
    Ok(data.chunks_exact(h * w).map(|px| (w, h, 1, px.iter().map(|&v| level_value(v)).collect())).collect())
}

/// A PNG (grayscale, RGB, with or without alpha, 8 or 16 bits; alpha is dropped), baseline or
/// progressive JPEG, or PGM (`P2` text or `P5` binary) file.
pub fn read_image_file(path: &Path) -> Result<ImagePixels> {
    read_image_file_as_stored(path).map(StoredImage::into_pixels)
}

/// An image file's pixels as its format stored them, and how.
pub(crate) struct StoredImage {
    /// Width, height and channels.
    pub shape: (usize, usize, usize),
    /// `[C, H, W]` values: 8-bit levels kept as bytes (a resize works on the levels, as
    /// Pillow's does), or values already scaled to `[0, 1]`.
    values: Pixels,
    /// The largest value of the file's format, which its values are divided by (255 for an
    /// 8-bit PNG or a JPEG, 65535 for a 16-bit PNG, a PGM's own maximum).
    pub max: u32,
    /// Whether an alpha channel was dropped.
    pub alpha: bool,
}

impl StoredImage {
    /// An image of 8-bit levels (`max` 255), `[C, H, W]`.
    pub fn of_levels((w, h, c): (usize, usize, usize), levels: Vec<u8>, alpha: bool) -> Self {
        StoredImage { shape: (w, h, c), values: Pixels::Levels(levels), max: 255, alpha }
    }

    /// An image of values already divided by the format's `max`.
    pub fn of_scaled((w, h, c, pixels): ImagePixels, max: u32, alpha: bool) -> Self {
        StoredImage { shape: (w, h, c), values: Pixels::Scaled(pixels), max, alpha }
    }

    /// The image with `channels` channels: as it is, or a one-channel image as RGB, its plane
    /// three times (Pillow's `convert("RGB")`, which torchvision's image folders apply to every
    /// file: a grayscale JPEG among colour ones reads as they do); `None` for any other pair.
    pub fn with_channels(self, channels: usize) -> Option<Self> {
        let (w, h, c) = self.shape;
        match (c, channels) {
            _ if c == channels => Some(self),
            (1, 3) => {
                let values = match self.values {
                    Pixels::Levels(levels) => Pixels::Levels(levels.repeat(3)),
                    Pixels::Scaled(pixels) => Pixels::Scaled(pixels.repeat(3)),
                };
                Some(StoredImage { shape: (w, h, 3), values, ..self })
            }
            _ => None,
        }
    }

    /// The pixels as [`read_image_file`] gives them.
    pub fn into_pixels(self) -> ImagePixels {
        let (w, h, c) = self.shape;
        (w, h, c, self.values.into_f32())
    }

    /// The pixels resized to `side` × `side` ([`resize_image`](super::resize_image)'s
    /// resampling), or as they are where the image is already of that size.
    pub fn resized(self, side: usize) -> Vec<f32> {
        self.into_resized(side).into_f32()
    }

    /// [`resized`](Self::resized), 8-bit levels kept as bytes (a training set's images).
    pub fn into_resized(self, side: usize) -> Pixels {
        let (w, h, c) = self.shape;
        match self.values {
            _ if (w, h) == (side, side) => self.values,
            Pixels::Levels(levels) => Pixels::Levels(super::resize::resize_levels(&levels, c, (h, w), (side, side))),
            Pixels::Scaled(pixels) => Pixels::Scaled(super::resize_image(&pixels, self.max, c, (h, w), (side, side))),
        }
    }

    /// The pixels as a training set keeps them: 8-bit levels as bytes.
    pub fn into_sample_pixels(self) -> Pixels {
        self.values
    }
}

/// [`read_image_file`], with the format's maximum and whether alpha was dropped.
pub(crate) fn read_image_file_as_stored(path: &Path) -> Result<StoredImage> {
    let bytes = read_bytes(path, SetupGroup::User)?;
    match ImageFormat::of(&bytes) {
        Some(ImageFormat::Png) => decode_png(path, &bytes),
        Some(ImageFormat::Jpeg) => {
            let image = decode_jpeg(&bytes, MAX_IMAGE_PIXELS).map_err(|e| dataset_error(path, None, e))?;
            Ok(StoredImage::of_levels((image.width, image.height, image.channels), image.pixels, false))
        }
        Some(ImageFormat::Pgm) => decode_pgm(path, &bytes),
        None => Err(dataset_error(path, None, "is not a PNG, JPEG or PGM image (by its first bytes)")),
    }
}

/// The image formats [`read_image_file`] reads.
#[derive(Clone, Copy)]
pub(crate) enum ImageFormat {
    Png,
    Jpeg,
    Pgm,
}

impl ImageFormat {
    /// A file's format by its first bytes (its magic number), if it is one of these.
    pub(crate) fn of(head: &[u8]) -> Option<Self> {
        if head.starts_with(b"\x89PNG") {
            Some(Self::Png)
        } else if head.starts_with(b"\xFF\xD8") {
            Some(Self::Jpeg)
        } else if head.starts_with(b"P5") || head.starts_with(b"P2") {
            Some(Self::Pgm)
        } else {
            None
        }
    }

    /// The format's name, as its users know it.
    pub(crate) fn name(self) -> &'static str {
        match self {
            Self::Png => "PNG",
            Self::Jpeg => "JPEG",
            Self::Pgm => "PGM",
        }
    }
}

fn decode_png(path: &Path, bytes: &[u8]) -> Result<StoredImage> {
    let bad = |e: png::DecodingError| dataset_error(path, None, format!("is not a readable PNG: {e}"));
    let mut decoder = png::Decoder::new(std::io::Cursor::new(bytes));
    // Palettes and sub-byte depths become 8-bit gray or RGB(A).
    decoder.set_transformations(png::Transformations::EXPAND);
    let mut reader = decoder.read_info().map_err(bad)?;
    check_png_size(path, reader.info(), bytes.len())?;
    let size = reader.output_buffer_size().ok_or_else(|| dataset_error(path, None, "is a PNG too large to decode"))?;
    let mut buf = vec![0; size];
    let frame = reader.next_frame(&mut buf).map_err(bad)?;
    let (w, h) = (frame.width as usize, frame.height as usize);
    let (stored, kept) = match frame.color_type {
        png::ColorType::Grayscale => (1, 1),
        png::ColorType::GrayscaleAlpha => (2, 1),
        png::ColorType::Rgb => (3, 3),
        png::ColorType::Rgba => (4, 3),
        png::ColorType::Indexed => {
            return Err(dataset_error(path, None, "is an indexed PNG that did not expand; save it as gray or RGB"));
        }
    };
    // The values of the interleaved `[H, W, stored]` in channel-first `[kept, H, W]` order.
    let order = || (0..kept).flat_map(move |c| (0..h * w).map(move |i| i * stored + c));
    let alpha = stored > kept;
    if frame.bit_depth == png::BitDepth::Sixteen {
        let pixels = order().map(|i| f32::from(u16::from_be_bytes([buf[2 * i], buf[2 * i + 1]])) / 65535.0).collect();
        return Ok(StoredImage::of_scaled((w, h, kept, pixels), 65535, alpha));
    }
    Ok(StoredImage::of_levels((w, h, kept), order().map(|i| buf[i]).collect(), alpha))
}

/// Largest image side accepted (a 61-megapixel camera's photos fit, to be resized by
/// `data.resize_to`), and so pixels: bounds what one image takes decoded (≤ 768 MiB of `f32` RGB).
const MAX_IMAGE_SIDE: u64 = 8192;
const MAX_IMAGE_PIXELS: u64 = MAX_IMAGE_SIDE * MAX_IMAGE_SIDE;

/// Deflate's best case: 258 bytes from a 2-bit length/distance pair, ~1032:1. No PNG of `n`
/// bytes inflates to more than this many times `n`.
const MAX_DEFLATE_RATIO: u64 = 1032;

/// Refuses, before the output buffer is allocated, a PNG whose header promises more pixels
/// than [`MAX_IMAGE_PIXELS`] or more image data than its `file_len` bytes could inflate to: a
/// corrupt width or height would otherwise make us allocate gigabytes for a tiny file.
fn check_png_size(path: &Path, info: &png::Info<'_>, file_len: usize) -> Result<()> {
    let (w, h) = info.size();
    let pixels = u64::from(w) * u64::from(h);
    if pixels > MAX_IMAGE_PIXELS {
        return Err(dataset_error(
            path,
            None,
            format!(
                "is a {w}×{h} PNG; expected at most {MAX_IMAGE_PIXELS} pixels ({MAX_IMAGE_SIDE} × {MAX_IMAGE_SIDE})"
            ),
        ));
    }
    // Filtered rows of the stored format: a lower bound on the inflated data a complete
    // image needs (interlacing only adds to it).
    let raw = u64::from(h) * info.raw_row_length() as u64;
    if raw > MAX_DEFLATE_RATIO * file_len as u64 {
        return Err(dataset_error(
            path,
            None,
            format!(
                "is a {w}×{h} PNG whose image data needs {raw} bytes, more than its {file_len} bytes can hold \
                 compressed; the file is truncated or its header is corrupt"
            ),
        ));
    }
    Ok(())
}

fn decode_pgm(path: &Path, bytes: &[u8]) -> Result<StoredImage> {
    // Header: magic, width, height, maxval as whitespace-separated text (comments from `#` to
    // the end of a line), then one whitespace byte and the raster.
    let mut fields = Vec::new();
    let mut at = 2;
    while fields.len() < 3 {
        match bytes.get(at) {
            None => return Err(dataset_error(path, None, "is a PGM whose header ends early")),
            Some(b'#') => {
                while bytes.get(at).is_some_and(|&b| b != b'\n') {
                    at += 1;
                }
            }
            Some(b) if b.is_ascii_whitespace() => at += 1,
            Some(_) => {
                let start = at;
                while bytes.get(at).is_some_and(|b| !b.is_ascii_whitespace()) {
                    at += 1;
                }
                let text = String::from_utf8_lossy(&bytes[start..at]);
                let v: usize = text.parse().ok().filter(|&v| v > 0).ok_or_else(|| {
                    dataset_error(path, None, format!("PGM header field `{text}` is not a positive integer"))
                })?;
                fields.push(v);
            }
        }
    }
    let (w, h, max) = (fields[0], fields[1], fields[2]);
    if max > 65535 {
        return Err(dataset_error(path, None, format!("PGM maximum value {max} exceeds 65535")));
    }
    let n = w.checked_mul(h).ok_or_else(|| dataset_error(path, None, "has impossible PGM dimensions"))?;
    let values: Vec<usize> = if bytes.starts_with(b"P5") {
        let raster = &bytes[(at + 1).min(bytes.len())..];
        let width = if max < 256 { 1 } else { 2 };
        if n.checked_mul(width) != Some(raster.len()) {
            return Err(dataset_error(
                path,
                None,
                format!(
                    "PGM raster holds {} bytes; expected {w}×{h}×{width} = {}",
                    raster.len(),
                    n as u128 * width as u128
                ),
            ));
        }
        if width == 1 {
            raster.iter().map(|&b| b as usize).collect()
        } else {
            raster.chunks_exact(2).map(|p| u16::from_be_bytes([p[0], p[1]]) as usize).collect()
        }
    } else {
        let text = String::from_utf8_lossy(&bytes[at..]);
        let values: Vec<usize> = text
            .split_ascii_whitespace()
            .map(|t| t.parse().map_err(|_| dataset_error(path, None, format!("PGM value `{t}` is not an integer"))))
            .collect::<Result<_>>()?;
        if values.len() != n {
            return Err(dataset_error(
                path,
                None,
                format!("PGM holds {} values; expected {w}×{h} = {n}", values.len()),
            ));
        }
        values
    };
    if let Some(v) = values.iter().find(|&&v| v > max) {
        return Err(dataset_error(path, None, format!("PGM value {v} exceeds its maximum {max}")));
    }
    if max == 255 {
        return Ok(StoredImage::of_levels((w, h, 1), values.iter().map(|&v| v as u8).collect(), false));
    }
    let pixels = (w, h, 1, values.iter().map(|&v| v as f32 / max as f32).collect());
    Ok(StoredImage::of_scaled(pixels, max as u32, false))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A file of `bytes` in the temp dir, removed when the returned guard drops (at the end of
    /// the statement that reads it).
    fn scratch(name: &str, bytes: &[u8]) -> Scratch {
        let path = std::env::temp_dir().join(format!("pt-image-{}-{name}", std::process::id()));
        std::fs::write(&path, bytes).unwrap_or_else(|e| panic!("{e}"));
        Scratch(path)
    }

    struct Scratch(std::path::PathBuf);

    impl std::ops::Deref for Scratch {
        type Target = Path;
        fn deref(&self) -> &Path {
            &self.0
        }
    }

    impl Drop for Scratch {
        fn drop(&mut self) {
            let _ = std::fs::remove_file(&self.0);
        }
    }

    /// An image kept as 8-bit levels gives the pixels, resized or not, that the same image
    /// scaled to `[0, 1]` first gives, to the bit, at sizes up, down and unchanged.
    #[test]
    fn levels_resize_as_their_scaled_values_do() {
        let mut rng = crate::rng::Rng::new(7);
        for (w, h, c, side) in [(5, 3, 3, 4), (7, 7, 1, 7), (2, 9, 3, 6), (16, 12, 1, 3)] {
            let levels: Vec<u8> = (0..w * h * c).map(|_| rng.below(256) as u8).collect();
            let scaled: Vec<f32> = levels.iter().map(|&v| f32::from(v) / 255.0).collect();
            let as_levels = || StoredImage::of_levels((w, h, c), levels.clone(), false);
            let as_scaled = || StoredImage::of_scaled((w, h, c, scaled.clone()), 255, false);
            assert_eq!(as_levels().into_pixels(), as_scaled().into_pixels());
            assert_eq!(as_levels().resized(side), as_scaled().resized(side), "{w}×{h}×{c} to {side}");
            if (w, h) != (side, side) {
                let resized = super::super::resize_image(&scaled, 255, c, (h, w), (side, side));
                assert_eq!(as_levels().resized(side), resized);
            }
        }
    }

    #[test]
    fn png_pgm_and_idx_give_channel_first_pixels_in_unit_range() {
        let (w, h, c, px) = read_image_file(&scratch("a.png", &two_pixel_png())).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!((w, h, c), (2, 1, 3));
        assert_eq!(px, vec![1.0, 0.0, 0.0, 1.0, 0.2, 0.4]);

        let pgm = read_image_file(&scratch("b.pgm", b"P2\n# two by two\n2 2\n16\n0 16\n8 4\n"));
        assert_eq!(pgm.unwrap_or_else(|e| panic!("{e}")), (2, 2, 1, vec![0.0, 1.0, 0.5, 0.25]));
        let p5 = read_image_file(&scratch("c.pgm", b"P5 1 2 255\n\x00\xff"));
        assert_eq!(p5.unwrap_or_else(|e| panic!("{e}")), (1, 2, 1, vec![0.0, 1.0]));

        let mut idx = vec![0, 0, 8, 3, 0, 0, 0, 2, 0, 0, 0, 1, 0, 0, 0, 2];
        idx.extend([0, 255, 51, 102]);
        let images = read_idx_images(&scratch("d-idx3-ubyte", &idx)).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(images, vec![(2, 1, 1, vec![0.0, 1.0]), (2, 1, 1, vec![0.2, 0.4])]);
    }

    /// A 2×1 RGB PNG: (255, 0, 51) then (0, 255, 102).
    fn two_pixel_png() -> Vec<u8> {
        let mut bytes = Vec::new();
        {
            let mut enc = png::Encoder::new(&mut bytes, 2, 1);
            enc.set_color(png::ColorType::Rgb);
            enc.set_depth(png::BitDepth::Eight);
            let mut w = enc.write_header().unwrap_or_else(|e| panic!("{e}"));
            w.write_image_data(&[255, 0, 51, 0, 255, 102]).unwrap_or_else(|e| panic!("{e}"));
        }
        bytes
    }

    /// [`two_pixel_png`] whose header then claims `width`×`height` (CRC recomputed).
    fn png_claiming(width: u32, height: u32) -> Vec<u8> {
        let mut bytes = two_pixel_png();
        // Signature (8), IHDR length (4) and type (4), then width and height, then the CRC
        // over type and the 13 data bytes.
        assert_eq!(&bytes[12..16], b"IHDR");
        bytes[16..20].copy_from_slice(&width.to_be_bytes());
        bytes[20..24].copy_from_slice(&height.to_be_bytes());
        let mut crc = flate2::Crc::new();
        crc.update(&bytes[12..29]);
        bytes[29..33].copy_from_slice(&crc.sum().to_be_bytes());
        bytes
    }

    /// Found by fuzzing (src/fuzz): the output buffer was sized from the header alone, so
    /// mutated 70-byte seeds asked for 25 GB and for 17 PB, and the process aborted.
    #[test]
    fn png_headers_claiming_more_than_the_file_holds_are_refused_before_allocating() {
        let e = read_image_file(&scratch("huge.png", &png_claiming(1_000_000, 1_000_000))).unwrap_err().to_string();
        let said = "1000000×1000000 PNG; expected at most 67108864 pixels (8192 × 8192)";
        assert!(e.contains("huge.png") && e.contains(said), "{e}");
        let e = read_image_file(&scratch("lying.png", &png_claiming(4000, 4000))).unwrap_err().to_string();
        assert!(e.contains("needs 48004000 bytes") && e.contains("truncated or its header is corrupt"), "{e}");
        assert!(read_image_file(&scratch("honest.png", &png_claiming(2, 1))).is_ok());
    }

    /// Found beside the PNG finding: a P5 PGM whose width × height × 2 bytes overflows
    /// panicked in debug builds (and wrapped in release).
    #[test]
    fn pgm_sizes_that_overflow_are_refused() {
        let e = read_image_file(&scratch("big.pgm", b"P5 4611686018427387904 2 65535\n\x00\x01")).unwrap_err();
        let e = e.to_string();
        assert!(e.contains("raster holds 2 bytes; expected 4611686018427387904×2×2 = 18446744073709551616"), "{e}");
    }

    #[test]
    fn damaged_images_are_refused_by_name() {
        let e = read_image_file(&scratch("e.png", b"\x89PNG not really")).unwrap_err().to_string();
        assert!(e.contains("e.png") && e.contains("not a readable PNG"), "{e}");
        let e = read_image_file(&scratch("f.pgm", b"P5 2 2 255\n\x00")).unwrap_err().to_string();
        assert!(e.contains("expected 2×2×1 = 4"), "{e}");
        let e = read_image_file(&scratch("g.jpg", b"\xff\xd8")).unwrap_err().to_string();
        assert!(e.contains("g.jpg") && e.contains("ends before its end-of-image marker"), "{e}");
        let e = read_image_file(&scratch("i.gif", b"GIF89a")).unwrap_err().to_string();
        assert!(e.contains("i.gif") && e.contains("not a PNG, JPEG or PGM"), "{e}");
        let e = read_image_file(Path::new("/nonexistent/h.png")).unwrap_err().to_string();
        assert!(e.contains("not found") && e.contains("check the path"), "{e}");
    }
}
