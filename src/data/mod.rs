//! Datasets: loaders for the files `scripts/setup.sh` installs under `data/`, samples with
//! stable ids (the frozen-activation cache keys on them), seeded splits and epoch orders, and
//! image/LM batches.
//!
//! | module | defines |
//! |---|---|
//! | `dataset` | [`Dataset`] (samples, class names), [`Sample`], [`Split`], seeded stratified split |
//! | `text` | [`TextSample`]; Rotten Tomatoes ([`rotten_tomatoes`]), Reuters R8 ([`reuters_r8`]), a user's ([`labelled_text_files`]) |
//! | `images` | [`ImageSample`]; [`digits`], [`mnist5k`], [`fashion_mnist`], a user's ([`labelled_image_files`]); [`image_batch`] |
//! | `image_files` | a user's images for `predict`: [`read_image_file`] (PNG, JPEG, PGM), [`read_idx_images`] |
//! | `jpeg` | (private) JPEG decoding to the pixels Pillow's libjpeg-turbo gives: baseline and progressive, its integer IDCT, fancy upsampling |
//! | `augment` | [`ImageAugment`]: random crops and mirror images of training images, drawn by seed, epoch and sample id |
//! | `resize` | [`resize_image`]: an image resized as Pillow's bilinear filter (torchvision's `Resize`) resizes it |
//! | `image_folder` | a user's images as a folder of class subfolders: to train on (through [`labelled_image_files`]), and for `evaluate --file`; `read_each` (files read on every core, in order) |
//! | `lm` | [`CharVocab`], [`LmCorpus`] ([`hamlet`], a user's: [`user_corpus_files`]), [`lm_sequences`], [`lm_batch`] |
//! | `order` | [`BatchOrder`] / [`EpochOrder`]: per-epoch seeded permutation, resumable |
//! | `csv`, `files` | (private) the CSV record reader; file reading, decompression, errors |
//!
//! Every loader of a built-in dataset takes the data directory (normally [`DEFAULT_DATA_DIR`]),
//! and a loader of the user's files their paths. A missing file is an
//! [`Error::Dataset`](crate::Error::Dataset) that names it and the `scripts/setup.sh` group that
//! fetches it (or, for a user's file, says to check the path); a malformed record is one that
//! names the file, the line (text formats) and what was expected.
//!
//! ```no_run
//! use pipetransformer::data::{self, BatchOrder};
//! # fn main() -> pipetransformer::Result<()> {
//! let split = data::digits(data::DEFAULT_DATA_DIR)?.split_stratified(0.2, 42)?;
//! let mut epoch = BatchOrder::new(split.train.len(), 42).epoch(0);
//! while let Some(indices) = epoch.next_batch(64, true) {
//!     let batch = split.train.batch(indices, 0)?; // pixels [64, 1, 8, 8]
//!     # let _ = batch;
//! }
//! # Ok(())
//! # }
//! ```

mod augment;
mod csv;
mod dataset;
mod files;
mod image_files;
mod image_folder;
mod images;
mod jpeg;
mod lm;
mod order;
mod resize;
mod text;

#[cfg(test)]
mod tests;

pub use augment::ImageAugment;
pub use dataset::{Dataset, Sample, Split, TEST_FILE_ID_BASE};
pub(crate) use files::{dataset_error, user_head};
pub use files::{read_user_text, user_lines};
pub(crate) use image_files::{ImageFormat, StoredImage, read_image_file_as_stored};
pub use image_files::{ImagePixels, read_idx_images, read_image_file};
pub(crate) use image_folder::{class_files, class_folders, files_under, folder_entries, read_each};
pub(crate) use images::opens_idx;
pub use images::{
    DIGITS_FILE, DIGITS_PIXEL_MAX, FASHION_MNIST_CLASSES, FASHION_MNIST_DIR, ImageSample, MNIST5K_FILE, Pixels, digits,
    fashion_mnist, idx_files, image_batch, image_channels, image_csv_file, labelled_image_files, level_value, mnist5k,
};
pub use lm::{
    CharVocab, HAMLET_FILE, HELD_OUT_FRACTION, LmCorpus, LmSequence, char_corpus_file, hamlet, lm_batch, lm_sequences,
    user_corpus_files,
};
pub use order::{BatchOrder, EpochOrder};
pub use resize::resize_image;
pub use text::{
    REUTERS_R8_TEST_FILE, REUTERS_R8_TRAIN_FILE, ROTTEN_TOMATOES_FILE, TextSample, labelled_text_files,
    orange_tab_files, reuters_r8, rotten_tomatoes, rotten_tomatoes_file,
};

/// Where `scripts/setup.sh` puts the datasets, relative to the repository root.
pub const DEFAULT_DATA_DIR: &str = "data";
