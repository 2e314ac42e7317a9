//! What a run trained on, as checkpoints and exports record it: the settings that choose its
//! samples and their order, and the user's files by their bytes. A resume over other data names
//! the setting that changed; an evaluation on a split holding training samples is refused.

use super::config::RunConfig;
use super::data_setup::tokenizer_dir;
use crate::data;
use crate::weights;
use std::path::Path;

/// The settings that choose a run's training samples and their order, by the names a config
/// gives them: checkpoints record them (a resume over other data names the one that changed)
/// and exports (an evaluation on a split holding training samples is refused).
pub(crate) fn data_settings(config: &RunConfig) -> serde_json::Value {
    let d = &config.data;
    let mut settings = serde_json::json!({
        "data.dataset": d.dataset,
        "train.seed": config.train.seed,
        "data.split_seed": d.split_seed,
        "data.validation_fraction": d.validation_fraction,
        "data.train_limit": d.train_limit,
        "data.group_by_length": d.group_by_length,
    });
    let Some(map) = settings.as_object_mut() else { return settings };
    // (A dataset with a test set of its own reads no fraction.)
    if d.cut_by_seed() {
        map.insert("data.test_fraction".into(), d.test_fraction.into());
    }
    // A user's files by their bytes, as the tokenizer below: the row ids the samples'
    // fingerprint follows stay the same when a file is edited.
    for (key, file) in [(TRAIN_FILE, &d.train_file), (TEST_FILE, &d.test_file)] {
        if let Some(file) = file.as_ref().filter(|_| d.dataset.from_user_files()) {
            map.insert(key.into(), file_print(file).into());
        }
    }
    if let Some(max) = d.user_pixel_max() {
        map.insert(PIXEL_MAX.into(), max.into());
    }
    // (A checkpoint written before the key existed, of one channel, compares as unchanged: a
    // key missing on one side is.)
    if let Some(channels) = d.user_channels() {
        map.insert("data.channels".into(), channels.into());
    }
    if let Some(side) = d.resize_to {
        map.insert("data.resize_to".into(), side.into());
    }
    // Images' augmentation (a crop's padding 0 where none is drawn): a resume under another
    // names the change, which the samples' fingerprint does not follow.
    if d.dataset.is_image() {
        map.insert("data.random_flip".into(), d.random_flip.into());
        map.insert("data.random_crop".into(), d.random_crop.unwrap_or(0).into());
    }
    // What turns a text into ids, which the samples' fingerprint does not follow (a resume
    // under others names them), and a corpus's window length, which it does (a resume refused
    // names it).
    if d.dataset.is_text() || d.dataset.is_corpus() {
        map.insert(MAX_LEN.into(), d.max_len.into());
    }
    if d.dataset.is_text() {
        // The file's bytes, not its path: the same tokenizer under another path (a node's own
        // copy) is the same.
        let file = tokenizer_dir(config).ok().map(|dir| dir.join(weights::TOKENIZER_FILE));
        map.insert(TOKENIZER.into(), file.as_deref().and_then(hashed).into());
    }
    settings
}

/// The data settings that turn a text into ids ([`data_settings`]' keys), which an epoch's
/// order follows where its batches are grouped by length.
pub(crate) const MAX_LEN: &str = "data.max_len";
pub(crate) const TOKENIZER: &str = "model.tokenizer";

/// The user's files a dataset's samples come from ([`data_settings`]' keys), each as its name
/// and a hash of its bytes ([`file_print`]).
pub(crate) const TRAIN_FILE: &str = "data.train_file";
pub(crate) const TEST_FILE: &str = "data.test_file";
/// The scale of a user's images ([`data_settings`]' key): what a pixel is divided by.
pub(crate) const PIXEL_MAX: &str = "data.pixel_max";

/// A file as its name and a hash of its bytes (`reviews.tsv #…`), a folder of images as its name
/// and a hash of its files ([`folder_hash`]), or `None` where it cannot be read: the same file
/// under another folder is the same, an edited one is not.
fn hashed(file: &Path) -> Option<String> {
    let hash = match file.is_dir() {
        true => folder_hash(file)?,
        false => crate::rng::fnv1a(&std::fs::read(file).ok()?, crate::rng::FNV_OFFSET),
    };
    Some(format!("{} #{hash:016x}", file_name(file)))
}

/// The files of a folder of class subfolders, as the loader lists them, each by its path within
/// the folder and its bytes: a file renamed, moved to another class, added or edited changes it.
fn folder_hash(dir: &Path) -> Option<u64> {
    use crate::rng::fnv1a;
    let mut hash = crate::rng::FNV_OFFSET;
    for class in data::folder_entries(dir).ok()? {
        for file in data::folder_entries(&class).ok()? {
            let name = file.strip_prefix(dir).ok()?.to_string_lossy().into_owned();
            hash = fnv1a(&[name.as_bytes(), &[0]].concat(), hash);
            hash = fnv1a(&std::fs::read(&file).ok()?, hash);
        }
    }
    Some(hash)
}

fn file_name(file: &Path) -> String {
    file.file_name().map_or_else(|| file.display().to_string(), |n| n.to_string_lossy().into_owned())
}

/// A user's data file as [`hashed`], or by its name alone where unreadable (reading its
/// samples then says why).
fn file_print(file: &Path) -> String {
    hashed(file).unwrap_or_else(|| file_name(file))
}
