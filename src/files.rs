//! Files that must never be seen half-written (checkpoints, exports, reports, the activation
//! cache's index): written to a temporary sibling, fsynced, renamed into place.

use crate::error::{Error, Result};
use std::fs::File;
use std::io::BufWriter;
use std::path::Path;

/// The I/O error of `path`.
pub fn io_error(path: &Path, source: std::io::Error) -> Error {
    Error::Io { path: path.display().to_string(), source }
}

/// Writes `path` through a temporary sibling file that is fsynced and renamed into place; on
/// failure the temporary file is removed and `path` is untouched.
pub fn write_atomic(path: &Path, write: impl FnOnce(&mut BufWriter<File>) -> std::io::Result<()>) -> Result<()> {
    let dir = path.parent().filter(|d| !d.as_os_str().is_empty()).unwrap_or(Path::new("."));
    let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    // Same directory, so the rename cannot cross file systems; the pid keeps two concurrent
    // writers from sharing a temporary file.
    let tmp = dir.join(format!(".{name}.tmp-{}", std::process::id()));
    let result = (|| {
        let file = File::create(&tmp).map_err(|e| io_error(&tmp, e))?;
        let mut w = BufWriter::new(file);
        write(&mut w).map_err(|e| io_error(&tmp, e))?;
        let file = w.into_inner().map_err(|e| io_error(&tmp, e.into_error()))?;
        file.sync_all().map_err(|e| io_error(&tmp, e))?;
        std::fs::rename(&tmp, path).map_err(|e| io_error(path, e))
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
        return result;
    }
    // Persist the rename itself. Some file systems refuse to fsync a directory; the data is
    // already durable then, so that failure is not worth failing the write for.
    if let Ok(d) = File::open(dir) {
        let _ = d.sync_all();
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_failed_write_leaves_the_old_file_and_no_temporary() {
        let dir = std::env::temp_dir().join(format!("pt-files-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("x.json");
        write_atomic(&path, |w| std::io::Write::write_all(w, b"old")).unwrap();
        let err = write_atomic(&path, |_| Err(std::io::Error::other("disk full"))).unwrap_err();
        assert!(err.to_string().contains("disk full"), "{err}");
        assert_eq!(std::fs::read(&path).unwrap(), b"old");
        assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 1);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
