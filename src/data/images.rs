//! Image classification datasets (pixels `f32` in [0, 1], `[C, H, W]`): scikit-learn digits
//! (8×8), MNIST-5k (28×28), Fashion-MNIST (28×28, IDX), all one channel, and a user's labelled
//! images of any channel count; and image batches as the ViT models take them.

use std::path::Path;

use super::dataset::{Dataset, Sample, Split, TEST_FILE_ID_BASE, label_index, refuse_stray_label, sorted_classes};
use super::files::{SetupGroup, dataset_error, numbered_lines, read_bytes, read_text};
use crate::error::{Result, counted, data_error};
use crate::model::HostBatch;

/// Digits CSV, relative to the data directory.
pub const DIGITS_FILE: &str = "digits/digits.csv.gz";
/// MNIST-5k CSV, relative to the data directory.
pub const MNIST5K_FILE: &str = "mnist5k/mnist_5k.csv.gz";
/// Fashion-MNIST folder, relative to the data directory.
pub const FASHION_MNIST_DIR: &str = "fashion-mnist";

/// Fashion-MNIST class names, indexed by label.
pub const FASHION_MNIST_CLASSES: [&str; 10] =
    ["T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot"];

/// IDX magic of unsigned-byte data with 3 dimensions (images).
pub(crate) const IDX_IMAGES_MAGIC: u32 = 0x0803;
/// IDX magic of unsigned-byte data with 1 dimension (labels).
const IDX_LABELS_MAGIC: u32 = 0x0801;

/// Whether `head`, a file's first bytes, opens IDX data of unsigned bytes: two zero bytes,
/// then the type code 8 (the dimension count after it is left to the reader to check).
pub(crate) fn opens_idx(head: &[u8]) -> bool {
    head.starts_with(&[0, 0, 8])
}

/// One image.
#[derive(Clone, Debug, PartialEq)]
pub struct ImageSample {
    /// Stable id (see each loader for how it is derived).
    pub id: u64,
    /// `channels · height · width` values in [0, 1] (8-bit levels, or scaled), each channel's
    /// plane, row-major.
    pub pixels: Pixels,
    /// Class index.
    pub label: u32,
    /// Width in pixels.
    pub width: usize,
    /// Height in pixels.
    pub height: usize,
    /// Colour channels.
    pub channels: usize,
}

/// An image's values in `[0, 1]` as its source gave them: 8-bit levels, a quarter of the
/// memory of floats (what IDX files and every 8-bit PNG and JPEG decode to, and resize to, as
/// Pillow resizes them), or values already scaled (a 16-bit PNG, a PGM of another depth, CSV
/// rows divided by their `pixel_max`, the digits' 17 levels). A training set of a user's photos
/// is held as the bytes they decode to: 150 KiB for a 224 × 224 RGB image, not 600 KiB.
#[derive(Clone, Debug, PartialEq)]
pub enum Pixels {
    /// 8-bit levels, each the value `level / 255` ([`level_value`]).
    Levels(Vec<u8>),
    /// Values in `[0, 1]`.
    Scaled(Vec<f32>),
}

/// The value of 8-bit level `level`: `level / 255`, rounded once (what every reader of 8-bit
/// images here divides by, so levels kept as bytes read back as they were scaled before).
pub fn level_value(level: u8) -> f32 {
    f32::from(level) / 255.0
}

impl Pixels {
    /// How many values.
    pub fn len(&self) -> usize {
        match self {
            Pixels::Levels(levels) => levels.len(),
            Pixels::Scaled(values) => values.len(),
        }
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Appends the values, in `[0, 1]`, to `out`.
    pub fn append_to(&self, out: &mut Vec<f32>) {
        match self {
            Pixels::Levels(levels) => out.extend(levels.iter().map(|&l| level_value(l))),
            Pixels::Scaled(values) => out.extend_from_slice(values),
        }
    }

    /// The values, in `[0, 1]`, taking the floats where they are.
    pub fn into_f32(self) -> Vec<f32> {
        match self {
            Pixels::Levels(levels) => levels.into_iter().map(level_value).collect(),
            Pixels::Scaled(values) => values,
        }
    }

    /// The values, in `[0, 1]`.
    pub fn to_f32(&self) -> Vec<f32> {
        let mut out = Vec::with_capacity(self.len());
        self.append_to(&mut out);
        out
    }
}

impl From<Vec<f32>> for Pixels {
    fn from(values: Vec<f32>) -> Self {
        Pixels::Scaled(values)
    }
}

impl Sample for ImageSample {
    fn id(&self) -> u64 {
        self.id
    }
    fn label(&self) -> u32 {
        self.label
    }
}

fn digit_names() -> Vec<String> {
    (0..10).map(|d| d.to_string()).collect()
}

/// The largest pixel value of scikit-learn's digits (the other image sets hold bytes, 0..=255).
pub const DIGITS_PIXEL_MAX: u32 = 16;

/// scikit-learn's digits ([`DIGITS_FILE`]): 1797 8×8 images, values 0..16 (scaled by 1/16),
/// labels 0..9. Ids are row indices. Split with [`Dataset::split_stratified`].
pub fn digits(data_dir: impl AsRef<Path>) -> Result<Dataset<ImageSample>> {
    image_csv_file("digits", &data_dir.as_ref().join(DIGITS_FILE), 8, 8, DIGITS_PIXEL_MAX, digit_names())
}

/// MNIST-5k ([`MNIST5K_FILE`]): 5000 28×28 images, values 0..255, 500 per digit in label order.
/// Ids are row indices. Split with [`Dataset::split_stratified`].
pub fn mnist5k(data_dir: impl AsRef<Path>) -> Result<Dataset<ImageSample>> {
    image_csv_file("mnist5k", &data_dir.as_ref().join(MNIST5K_FILE), 28, 28, 255, digit_names())
}

/// Images in a CSV file (gzip if the name ends in `.gz`), no header: each row holds
/// `width · height` integer pixels in `0..=max_value`, row-major, then the label, which must be
/// `< class_names.len()`. Pixels are divided by `max_value`. Blank lines are skipped; a
/// sample's id is its 0-based row index.
pub fn image_csv_file(
    name: &str,
    path: &Path,
    width: usize,
    height: usize,
    max_value: u32,
    class_names: Vec<String>,
) -> Result<Dataset<ImageSample>> {
    let text = read_text(path, SetupGroup::Images)?;
    let n_pixels = width * height;
    let scale = 1.0 / max_value as f32;
    let mut samples = Vec::new();
    for (line, row) in numbered_lines(&text) {
        if row.trim().is_empty() {
            continue;
        }
        let mut values = Vec::with_capacity(n_pixels + 1);
        for (col, field) in row.split(',').enumerate() {
            let v: u32 = field.trim().parse().map_err(|_| {
                dataset_error(path, Some(line), format!("column {}: `{field}` is not a non-negative integer", col + 1))
            })?;
            values.push(v);
        }
        if values.len() != n_pixels + 1 {
            return Err(dataset_error(
                path,
                Some(line),
                format!("has {} values, expected {} ({n_pixels} pixels and a label)", values.len(), n_pixels + 1),
            ));
        }
        let label = values[n_pixels];
        if label as usize >= class_names.len() {
            return Err(dataset_error(
                path,
                Some(line),
                format!("label {label} is out of range; expected 0..={}", class_names.len() - 1),
            ));
        }
        if let Some(col) = values[..n_pixels].iter().position(|&v| v > max_value) {
            return Err(dataset_error(
                path,
                Some(line),
                format!("column {}: pixel value {} exceeds the maximum {max_value}", col + 1, values[col]),
            ));
        }
        let pixels = Pixels::Scaled(values[..n_pixels].iter().map(|&v| v as f32 * scale).collect());
        samples.push(ImageSample { id: samples.len() as u64, pixels, label, width, height, channels: 1 });
    }
    if samples.is_empty() {
        return Err(dataset_error(path, None, "has no rows; expected at least one image"));
    }
    Dataset::new(name, class_names, samples)
}

/// A user's labelled images (`dataset = "labelled_images"`): CSV rows of square images of
/// `channels` planes, `channels · side²` raw values in `0..=pixel_max`, each plane row-major,
/// then the label (the rows `evaluate --file` reads), gzip or bzip2 by name or by the first
/// bytes; blank lines are skipped. Every row of both files has the first row's value count.
/// The classes are the training file's distinct labels, sorted (as numbers where every label is
/// an integer); every label of the held-out file must be among them. Ids: the 0-based row
/// index, from [`TEST_FILE_ID_BASE`] in the held-out file. Where `train` (and `test`) name
/// folders, their class subfolders' PNG, JPEG and PGM images instead (`image_folder`; `pixel_max` is
/// then unused: the files' format scales them, as `predict` scales such a file, and must be one
/// for all; `resize_to` resizes each, of any size). Also returns what the raw values were
/// divided by: `pixel_max`, or the format's.
pub fn labelled_image_files(
    train: &Path,
    test: Option<&Path>,
    pixel_max: u32,
    channels: usize,
    resize_to: Option<usize>,
) -> Result<(Dataset<ImageSample>, Option<Dataset<ImageSample>>, u32)> {
    if train.is_dir() || test.is_some_and(Path::is_dir) {
        return super::image_folder::image_folders(train, test, channels, resize_to);
    }
    let train_rows = read_labelled_pixels(train, pixel_max, channels, None)?;
    let side = (train_rows[0].1.len() / channels).isqrt();
    let test_rows = test.map(|path| read_labelled_pixels(path, pixel_max, channels, Some(side)).map(|r| (path, r)));
    let test_rows = test_rows.transpose()?;
    refuse_stray_label(train, train_rows.iter().map(|r| (r.0, r.2.as_str())))?;
    let classes = sorted_classes(train, train_rows.iter().map(|r| r.2.as_str()))?;
    let to_samples = |rows: Vec<PixelRow>, path: &Path, id_base: u64| -> Result<Vec<ImageSample>> {
        let scale = 1.0 / pixel_max as f32;
        rows.into_iter()
            .enumerate()
            .map(|(i, (line, pixels, label))| {
                let label = label_index(&classes, &label, train, path, line)?;
                let pixels = Pixels::Scaled(pixels.iter().map(|&v| v as f32 * scale).collect());
                Ok(ImageSample { id: id_base + i as u64, pixels, label, width: side, height: side, channels })
            })
            .collect()
    };
    let held_out = match test_rows {
        Some((path, rows)) => {
            Some(Dataset::new("labelled_images/test", classes.clone(), to_samples(rows, path, TEST_FILE_ID_BASE)?)?)
        }
        None => None,
    };
    let samples = to_samples(train_rows, train, 0)?;
    Ok((Dataset::new("labelled_images", classes, samples)?, held_out, pixel_max))
}

/// A row of a user's image file: its line, its raw pixels, its label.
type PixelRow = (usize, Vec<u32>, String);

/// The rows of a user's image file: `channels · side²` values each (`side` the first row's where
/// `None`), in `0..=pixel_max`, then a label; a bad row is an error naming its line.
fn read_labelled_pixels(path: &Path, pixel_max: u32, channels: usize, side: Option<usize>) -> Result<Vec<PixelRow>> {
    let text = read_text(path, SetupGroup::User)?;
    let mut rows: Vec<PixelRow> = Vec::new();
    let mut want = side.map(|side| channels * side * side);
    // "a 3×3 image", "a 3×3 image of 3 channels".
    let shape = |side: usize| match channels {
        1 => format!("a {side}×{side} image"),
        c => format!("a {side}×{side} image of {c} channels"),
    };
    for (line, row) in numbered_lines(&text) {
        if row.trim().is_empty() {
            continue;
        }
        let bad = |message: String| dataset_error(path, Some(line), message);
        let Some((values, label)) = row.rsplit_once(',') else {
            return Err(bad("has no comma; expected CSV pixels then the label".into()));
        };
        let label = label.trim();
        if label.is_empty() {
            return Err(bad("has an empty label; expected CSV pixels then the label".into()));
        }
        let mut image = Vec::new();
        for (col, field) in values.split(',').enumerate() {
            let v: u32 = field.trim().parse().map_err(|_| {
                let header = if rows.is_empty() { " (a header row? the file holds none)" } else { "" };
                bad(format!("column {}: `{field}` is not a whole number ≥ 0{header}", col + 1))
            })?;
            if v > pixel_max {
                return Err(bad(format!("column {}: pixel value {v} exceeds data.pixel_max = {pixel_max}", col + 1)));
            }
            image.push(v);
        }
        let n = image.len();
        let side = (n / channels).isqrt();
        match want {
            Some(w) if n != w => {
                return Err(bad(format!(
                    "has {n} values, expected {w} ({}) then the label",
                    shape((w / channels).isqrt())
                )));
            }
            None if channels * side * side != n => {
                let per = if channels == 1 { "side²".to_string() } else { format!("{channels} × side²") };
                // The channel count the row would fit, if a usual one does.
                let fits = [1, 3, 4].into_iter().filter(|&c| c != channels && n % c == 0).find_map(|c| {
                    let side = (n / c).isqrt();
                    (side > 1 && c * side * side == n)
                        .then(|| format!(" (as data.channels = {c}, {} of {side}×{side})", image_channels(c)))
                });
                return Err(bad(format!(
                    "has {n} values, which is no square image of data.channels = {channels}; expected {per} pixel \
                     values then the label{}",
                    fits.unwrap_or_default()
                )));
            }
            _ => want = Some(n),
        }
        rows.push((line, image, label.to_string()));
    }
    if rows.is_empty() {
        return Err(dataset_error(path, None, "has no rows; expected CSV rows of pixels then the label"));
    }
    Ok(rows)
}

/// Fashion-MNIST from `data_dir/fashion-mnist/` (`{train,t10k}-{images-idx3,labels-idx1}-ubyte.gz`):
/// 60000 train and 10000 test 28×28 images, values /255. Ids: the index in the train file, or
/// [`TEST_FILE_ID_BASE`] + the index in the test file.
pub fn fashion_mnist(data_dir: impl AsRef<Path>) -> Result<Split<ImageSample>> {
    let dir = data_dir.as_ref().join(FASHION_MNIST_DIR);
    let classes: Vec<String> = FASHION_MNIST_CLASSES.iter().map(|s| s.to_string()).collect();
    let train = idx_files(
        "fashion-mnist/train",
        &dir.join("train-images-idx3-ubyte.gz"),
        &dir.join("train-labels-idx1-ubyte.gz"),
        0,
        classes.clone(),
    )?;
    let test = idx_files(
        "fashion-mnist/test",
        &dir.join("t10k-images-idx3-ubyte.gz"),
        &dir.join("t10k-labels-idx1-ubyte.gz"),
        TEST_FILE_ID_BASE,
        classes,
    )?;
    // The model reads every image at one shape: a test file of other rows × columns (even
    // with as many pixels) would be read wrongly, not refused.
    let shape = |d: &Dataset<ImageSample>| d.samples().first().map(|s| (s.height, s.width));
    if let (Some((h, w)), Some((th, tw))) = (shape(&train), shape(&test))
        && (h, w) != (th, tw)
    {
        return Err(dataset_error(
            &dir.join("t10k-images-idx3-ubyte.gz"),
            None,
            format!("holds {th}×{tw} images, expected {h}×{w} as in train-images-idx3-ubyte.gz"),
        ));
    }
    Ok(Split { train, test })
}

/// An image file (IDX, magic 0x803: count × rows × columns bytes) and its label file (IDX, magic
/// 0x801: count bytes), each gzip if the name ends in `.gz`. Pixels are divided by 255; labels
/// must be `< class_names.len()`. Sample `i` gets id `id_base + i`.
pub fn idx_files(
    name: &str,
    images: &Path,
    labels: &Path,
    id_base: u64,
    class_names: Vec<String>,
) -> Result<Dataset<ImageSample>> {
    let image_bytes = read_bytes(images, SetupGroup::Images)?;
    let (dims, pixels) = parse_idx(images, &image_bytes, IDX_IMAGES_MAGIC)?;
    let label_bytes = read_bytes(labels, SetupGroup::Images)?;
    let (label_dims, label_data) = parse_idx(labels, &label_bytes, IDX_LABELS_MAGIC)?;
    let (count, height, width) = (dims[0], dims[1], dims[2]);
    if label_dims[0] != count {
        return Err(dataset_error(
            labels,
            None,
            format!("holds {} labels, expected {count} (one per image in {})", label_dims[0], images.display()),
        ));
    }
    if let Some(i) = label_data.iter().position(|&l| l as usize >= class_names.len()) {
        return Err(dataset_error(
            labels,
            None,
            format!("record {i}: label {} is out of range; expected 0..={}", label_data[i], class_names.len() - 1),
        ));
    }
    let n = height * width;
    let samples = pixels
        .chunks_exact(n)
        .zip(label_data)
        .enumerate()
        .map(|(i, (px, &label))| ImageSample {
            id: id_base + i as u64,
            pixels: Pixels::Levels(px.to_vec()),
            label: label as u32,
            width,
            height,
            channels: 1,
        })
        .collect();
    Dataset::new(name, class_names, samples)
}

/// Checks an IDX header (magic `0x0000_08NN`: unsigned bytes, NN dimensions) and returns the
/// dimensions and the data, which must be exactly their product in bytes.
pub(crate) fn parse_idx<'a>(path: &Path, bytes: &'a [u8], magic: u32) -> Result<(Vec<usize>, &'a [u8])> {
    let ndim = (magic & 0xff) as usize;
    let kind = if ndim == 1 { "labels" } else { "images" };
    let header = 4 + 4 * ndim;
    if bytes.len() < 4 {
        return Err(dataset_error(path, None, format!("is {} bytes, too short for an IDX header", bytes.len())));
    }
    let word = |i: usize| u32::from_be_bytes([bytes[4 * i], bytes[4 * i + 1], bytes[4 * i + 2], bytes[4 * i + 3]]);
    let got = word(0);
    if got != magic {
        return Err(dataset_error(
            path,
            None,
            format!("has IDX magic {got:#010x}, expected {magic:#010x} (unsigned-byte {kind}, {ndim} dimensions)"),
        ));
    }
    if bytes.len() < header {
        return Err(dataset_error(
            path,
            None,
            format!("is truncated: {} bytes, expected a {header}-byte IDX header", bytes.len()),
        ));
    }
    let dims: Vec<usize> = (1..=ndim).map(|i| word(i) as usize).collect();
    let count = dims[0];
    if count == 0 || dims.contains(&0) {
        return Err(dataset_error(
            path,
            None,
            format!("is empty: IDX dimensions {dims:?}; expected at least one record"),
        ));
    }
    let per_record: usize = dims[1..].iter().product();
    let data = &bytes[header..];
    // Checked: a corrupt header can promise more than memory can address.
    let Some(want) = count.checked_mul(per_record) else {
        return Err(dataset_error(path, None, format!("has impossible IDX dimensions {dims:?}")));
    };
    if data.len() < want {
        return Err(dataset_error(
            path,
            None,
            format!(
                "is truncated: the header promises {count} records of {per_record} bytes ({want} bytes), the file \
                 holds {} (record {} is incomplete)",
                data.len(),
                data.len() / per_record
            ),
        ));
    }
    if data.len() > want {
        return Err(dataset_error(
            path,
            None,
            format!("has {} bytes after the {count} records its header promises; expected none", data.len() - want),
        ));
    }
    Ok((dims, data))
}

/// "1 channel", "3 channels": an image's channels in a message.
pub fn image_channels(n: usize) -> String {
    format!("{n} channel{}", if n == 1 { "" } else { "s" })
}

/// An image batch for a ViT: `pixels` `[B, C, H, W]`, `targets` the labels, `sample_offset` as
/// given (the global index of the first sample, see [`HostBatch::sample_offset`]). All images
/// must share one size and channel count.
pub fn image_batch(samples: &[&ImageSample], sample_offset: u64) -> Result<HostBatch> {
    let Some(first) = samples.first() else {
        return Err(data_error("image batch", "is empty; expected at least one sample"));
    };
    let (w, h, c) = (first.width, first.height, first.channels);
    let mut pixels = Vec::with_capacity(samples.len() * c * w * h);
    for s in samples {
        if (s.width, s.height, s.channels) != (w, h, c) || s.pixels.len() != c * w * h {
            return Err(data_error(
                "image batch",
                format!(
                    "sample id {} is {}×{} of {} with {} values; expected {w}×{h} of {} like the first sample",
                    s.id,
                    s.width,
                    s.height,
                    counted(s.channels, "channel"),
                    s.pixels.len(),
                    counted(c, "channel")
                ),
            ));
        }
        s.pixels.append_to(&mut pixels);
    }
    Ok(HostBatch {
        batch: samples.len(),
        pixels: Some(pixels),
        targets: samples.iter().map(|s| s.label).collect(),
        sample_offset,
        sample_ids: samples.iter().map(|s| s.id).collect(),
        ..Default::default()
    })
}

impl Dataset<ImageSample> {
    /// [`image_batch`] of the samples at `indices` (e.g. a slice of a
    /// [`BatchOrder`](super::BatchOrder) permutation).
    pub fn batch(&self, indices: &[usize], sample_offset: u64) -> Result<HostBatch> {
        let samples = indices
            .iter()
            .map(|&i| {
                self.get(i).ok_or_else(|| {
                    data_error(
                        self.name(),
                        format!("index {i} is out of range; the dataset has {} samples", self.len()),
                    )
                })
            })
            .collect::<Result<Vec<_>>>()?;
        image_batch(&samples, sample_offset)
    }
}
