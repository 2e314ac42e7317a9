//! A user's images as a folder of class subfolders (`dataset = "labelled_images"` where
//! `data.train_file` names a folder, the layout torchvision's `ImageFolder` reads): each
//! subfolder's name is a class, its PNG, JPEG and PGM files that class's images, scaled by their own
//! format as `predict` scales such a file ([`read_image_file`](super::read_image_file)). Class
//! names that are all integers sort as numbers (`2` before `10`), as a user's labels do, where
//! `ImageFolder` sorts them as text. The files are decoded and resized on every core
//! ([`read_each`]), into the order one thread would give.

use super::dataset::{Dataset, TEST_FILE_ID_BASE, shown_classes, sorted_classes};
use super::files::dataset_error;
use super::image_files::read_image_file_as_stored;
use super::images::ImageSample;
use crate::error::{Result, counted};
use std::path::{Path, PathBuf};

/// The entries of `dir` in name order, leaving out those whose names start with `.` (a file
/// manager's or an editor's leftovers).
pub(crate) fn folder_entries(dir: &Path) -> Result<Vec<PathBuf>> {
    let unlisted = |e: std::io::Error| dataset_error(dir, None, format!("cannot be listed: {e}"));
    let mut paths = Vec::new();
    for entry in std::fs::read_dir(dir).map_err(unlisted)? {
        let entry = entry.map_err(unlisted)?;
        if !entry.file_name().to_string_lossy().starts_with('.') {
            paths.push(entry.path());
        }
    }
    paths.sort();
    Ok(paths)
}

/// The files in `dir` and its subfolders, depth first in name order, leaving out names that
/// start with `.`. A link to a folder is listed as it is, not followed (a link back up would
/// never end).
pub(crate) fn files_under(dir: &Path) -> Result<Vec<PathBuf>> {
    let mut files = Vec::new();
    for path in folder_entries(dir)? {
        match std::fs::symlink_metadata(&path) {
            Ok(m) if m.is_dir() => files.extend(files_under(&path)?),
            _ => files.push(path),
        }
    }
    Ok(files)
}

/// The training folder `train` and the held-out folder `test`, if given, and the largest value
/// of their images' format, which their values were divided by: the classes are the training
/// folder's subfolders (sorted as labels are, as numbers where all are integers), every image
/// of the first one's format maximum (8-bit, 16-bit, a PGM's own) and `channels` channels, and
/// square and of the first one's size, or of any size and resized to `resize_to ×
/// resize_to` ([`resize_image`](super::resize_image)); a held-out subfolder must be one of the
/// classes. Ids count the images in folder then file name order, from [`TEST_FILE_ID_BASE`] in
/// the held-out folder.
pub(crate) fn image_folders(
    train: &Path,
    test: Option<&Path>,
    channels: usize,
    resize_to: Option<usize>,
) -> Result<(Dataset<ImageSample>, Option<Dataset<ImageSample>>, u32)> {
    for path in [Some(train), test].into_iter().flatten() {
        if !path.exists() {
            return Err(dataset_error(path, None, "not found; expected a folder of class subfolders of images"));
        }
        if !path.is_dir() {
            return Err(dataset_error(
                path,
                None,
                "is a file, but the other of data.train_file and data.test_file is a folder; expected both \
                 folders of class subfolders, or both CSV files",
            ));
        }
    }
    let classes = class_folders(train)?;
    if let [(only, _)] = classes.as_slice() {
        return Err(dataset_error(
            train,
            None,
            format!("holds one class folder, `{only}`; expected at least two classes to tell apart"),
        ));
    }
    let names: Vec<&str> = classes.iter().map(|(name, _)| name.as_str()).collect();
    let classes_sorted = sorted_classes(train, names.into_iter())?;
    let read = Read { channels, resize_to };
    let (samples, first) = images(&classes, &classes_sorted, read, None, 0)?;
    let held_out = match test {
        Some(test) => {
            let theirs = class_folders(test)?;
            if let Some((name, path)) = theirs.iter().find(|(name, _)| !classes_sorted.contains(name)) {
                return Err(dataset_error(
                    path,
                    None,
                    format!(
                        "is no class of the training folder {}: `{name}`; expected one of {}",
                        train.display(),
                        shown_classes(&classes_sorted)
                    ),
                ));
            }
            let (samples, _) = images(&theirs, &classes_sorted, read, Some(&first), TEST_FILE_ID_BASE)?;
            Some(Dataset::new("labelled_images/test", classes_sorted.clone(), samples)?)
        }
        None => None,
    };
    Ok((Dataset::new("labelled_images", classes_sorted, samples)?, held_out, first.max))
}

/// The class subfolders of `dir`, by name (UTF-8: two names that differ only in bytes that are
/// not would read as one class); a file beside them, or none, is an error.
pub(crate) fn class_folders(dir: &Path) -> Result<Vec<(String, PathBuf)>> {
    let mut classes = Vec::new();
    let entries = folder_entries(dir)?;
    if !entries.is_empty() && !entries.iter().any(|p| p.is_dir()) {
        return Err(dataset_error(
            dir,
            None,
            "holds files but no class subfolders; expected one subfolder per class, each holding its images \
             (name the folder above them)",
        ));
    }
    for path in entries {
        if !path.is_dir() {
            return Err(dataset_error(
                &path,
                None,
                format!(
                    "is a file beside the class folders of {}; expected only one subfolder per class, each \
                     holding its images",
                    dir.display()
                ),
            ));
        }
        let Some(name) = path.file_name().and_then(|n| n.to_str()).map(str::to_string) else {
            return Err(dataset_error(&path, None, "has a name that is not UTF-8; expected a class name"));
        };
        classes.push((name, path));
    }
    if classes.is_empty() {
        return Err(dataset_error(
            dir,
            None,
            "holds no class folders; expected one subfolder per class, each holding its PNG, JPEG or PGM images",
        ));
    }
    Ok(classes)
}

/// The files of the folder of class `name`: at least one, and no folder among them.
pub(crate) fn class_files(name: &str, folder: &Path) -> Result<Vec<PathBuf>> {
    let files = folder_entries(folder)?;
    if files.is_empty() {
        return Err(dataset_error(
            folder,
            None,
            format!("holds no images; expected the PNG, JPEG or PGM images of class `{name}`"),
        ));
    }
    if let Some(inner) = files.iter().find(|f| f.is_dir()) {
        return Err(dataset_error(
            inner,
            None,
            format!("is a folder inside the folder of class `{name}`; expected only its image files"),
        ));
    }
    Ok(files)
}

/// The first image of a folder: what every other image (and the held-out folder's) must match.
struct First {
    side: usize,
    max: u32,
    /// Where it is, or `None` for the training images seen from the held-out folder.
    path: Option<PathBuf>,
}

impl First {
    fn named(&self) -> String {
        self.path.as_ref().map_or_else(|| "the training images are".to_string(), |p| format!("{} is", p.display()))
    }
}

/// How a folder's images are read: their channels, and the side they are resized to, if any.
#[derive(Clone, Copy)]
struct Read {
    channels: usize,
    resize_to: Option<usize>,
}

/// The images of `classes` (name, folder), labelled by their index in `sorted`: each of
/// `read.channels` channels and of the format maximum of `first` (the first image's where
/// `None`), and resized to `read.resize_to`, or else square and of the size of `first`.
/// Returns them and the first. The files are decoded and resized on every core
/// ([`read_each`]); what each must match is checked in file order, so the error a folder gets
/// is the one its first bad file gets read alone.
fn images(
    classes: &[(String, PathBuf)],
    sorted: &[String],
    Read { channels, resize_to }: Read,
    first: Option<&First>,
    id_base: u64,
) -> Result<(Vec<ImageSample>, First)> {
    let mut files = Vec::new();
    for (name, folder) in classes {
        let label = sorted.iter().position(|c| c == name).unwrap_or_default() as u32;
        files.extend(class_files(name, folder)?.into_iter().map(|file| (label, file)));
    }
    // Each file alone: decoded, of the channels asked for, square or resized.
    let decoded = read_each(&files, |(_, file)| {
        let image = read_image_file_as_stored(file)?;
        let ((w, h, c), max, alpha) = (image.shape, image.max, image.alpha);
        let bad = |message: String| Err(dataset_error(file, None, message));
        if w != h && resize_to.is_none() {
            return bad(format!(
                "is {w}×{h}; expected square images (or set data.resize_to to the model's image_size to resize each)"
            ));
        }
        let Some(image) = image.with_channels(channels) else {
            let dropped = if alpha { " (its alpha channel dropped)" } else { "" };
            return bad(format!(
                "has {}{dropped}, but data.channels = {channels}; set data.channels (and the model's \
                 num_channels) to the images' (with 3, a grayscale image reads as RGB)",
                counted(c, "channel")
            ));
        };
        Ok(match resize_to {
            Some(side) => (image.into_resized(side), side, max, (w, h)),
            None => (image.into_sample_pixels(), w, max, (w, h)),
        })
    });
    // Each against the first, in order.
    let mut samples: Vec<ImageSample> = Vec::with_capacity(decoded.len());
    let mut want = first.map(|f| First { side: f.side, max: f.max, path: None });
    for ((label, file), image) in files.iter().zip(decoded) {
        let (pixels, side, max, (w, h)) = image?;
        let bad = |message: String| Err(dataset_error(file, None, message));
        match &want {
            Some(f) if f.side != side => {
                return bad(format!(
                    "is {w}×{h}, but {} {1}×{1}; expected every image of one size (or set data.resize_to to the \
                     model's image_size to resize each)",
                    f.named(),
                    f.side
                ));
            }
            Some(f) if f.max != max => {
                return bad(format!(
                    "stores values up to {max}, but {} up to {}; expected every image of one depth (the values are \
                     divided by it)",
                    f.named(),
                    f.max
                ));
            }
            Some(_) => {}
            None => want = Some(First { side, max, path: Some(file.clone()) }),
        }
        let id = id_base + samples.len() as u64;
        samples.push(ImageSample { id, pixels, label: *label, width: side, height: side, channels });
    }
    // (Every class holds an image, and there is one class at least.)
    Ok((samples, want.unwrap_or(First { side: 0, max: 255, path: None })))
}

/// `read` of each of `items`, on every core, in the items' order: all of them, or those before
/// the first that fails and its error. (Items after that one may be read too, but their
/// results are dropped: which error a caller gets never depends on the threads' timing.)
pub(crate) fn read_each<T: Sync, U: Send>(items: &[T], read: impl Fn(&T) -> Result<U> + Sync) -> Vec<Result<U>> {
    // (One item is read here, without asking the system for its cores.)
    let cores = if items.len() < 2 { 1 } else { std::thread::available_parallelism().map_or(1, |n| n.get()) };
    read_each_on(cores, items, read)
}

/// [`read_each`] on `threads` threads (this one among them).
fn read_each_on<T: Sync, U: Send>(
    threads: usize,
    items: &[T],
    read: impl Fn(&T) -> Result<U> + Sync,
) -> Vec<Result<U>> {
    use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};
    let threads = threads.min(items.len());
    // The next item to claim, and the first that failed: a thread claims items in order and
    // stops past a failure, so every item before the first failure is read.
    let (next, failed) = (AtomicUsize::new(0), AtomicUsize::new(usize::MAX));
    let work = || {
        let mut done = Vec::new();
        loop {
            let i = next.fetch_add(1, Relaxed);
            if i >= items.len() || i > failed.load(Relaxed) {
                return done;
            }
            let result = read(&items[i]);
            if result.is_err() {
                failed.fetch_min(i, Relaxed);
            }
            done.push((i, result));
        }
    };
    let mut slots: Vec<Option<Result<U>>> = std::iter::repeat_with(|| None).take(items.len()).collect();
    std::thread::scope(|scope| {
        let workers: Vec<_> = (1..threads).map(|_| scope.spawn(work)).collect();
        let mine = work();
        for (i, result) in
            workers.into_iter().flat_map(|w| w.join().unwrap_or_else(|p| std::panic::resume_unwind(p))).chain(mine)
        {
            slots[i] = Some(result);
        }
    });
    let mut results = Vec::with_capacity(items.len());
    for result in slots.into_iter().map_while(|slot| slot) {
        let failed = result.is_err();
        results.push(result);
        if failed {
            break;
        }
    }
    results
}

#[cfg(test)]
mod tests {
    use super::read_each_on;
    use crate::error::{Result, internal};

    /// Every item read once, the results in the items' order whatever order the threads finish
    /// them in; and where items fail, the first failure in order ends the results, even when a
    /// later one fails sooner.
    #[test]
    fn items_are_read_on_threads_into_their_order() {
        let items: Vec<u64> = (0..40).collect();
        // Early items take longest, so the threads finish them out of order.
        let slow = |&i: &u64| -> Result<u64> {
            std::thread::sleep(std::time::Duration::from_micros(2000u64.saturating_sub(i * 50)));
            Ok(i * i)
        };
        for threads in [1, 2, 4, 64] {
            let got: Vec<u64> = read_each_on(threads, &items, slow).into_iter().map(|r| r.unwrap()).collect();
            assert_eq!(got, items.iter().map(|i| i * i).collect::<Vec<_>>(), "{threads} threads");
        }
        assert!(read_each_on(4, &[] as &[u64], slow).is_empty());
        // Item 7 fails slowly, items 20.. fail at once: 7's error, after 0..7.
        let failing = |&i: &u64| -> Result<u64> {
            match i {
                7 => {
                    std::thread::sleep(std::time::Duration::from_millis(20));
                    Err(internal("item", format!("{i}")))
                }
                20.. => Err(internal("item", format!("{i}"))),
                _ => Ok(i),
            }
        };
        for threads in [1, 2, 4] {
            let got = read_each_on(threads, &items, failing);
            assert_eq!(got.len(), 8, "{threads} threads");
            assert!(got[..7].iter().enumerate().all(|(i, r)| matches!(r, Ok(v) if *v == i as u64)));
            assert!(matches!(&got[7], Err(e) if e.to_string().ends_with(": 7")), "{:?}", got[7]);
        }
    }
}
