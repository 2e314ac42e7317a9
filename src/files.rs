//! Files that must never be seen half-written (checkpoints, exports, reports, the activation
//! cache's index): written to a temporary sibling, fsynced, renamed into place; and writes
//! that run on a thread of their own while training goes on ([`Background`]).

use crate::error::{Error, Result, internal};
use std::fs::File;
use std::io::BufWriter;
use std::path::Path;
use std::thread::JoinHandle;

/// The I/O error of `path`.
pub fn io_error(path: &Path, source: std::io::Error) -> Error {
    Error::Io { path: path.display().to_string(), source }
}

/// Puts the folder `new` at `path` in one step. Where `path` exists, the two trade places
/// (Linux's `renameat2` with `RENAME_EXCHANGE`): a reader finds one whole folder or the other
/// at `path`, never none, and `new` then holds what `path` held, for the caller to remove.
/// Where the file system cannot exchange, the old folder moves aside first (a moment without
/// `path`) and ends up at `new` all the same.
pub fn swap_in(new: &Path, path: &Path) -> Result<()> {
    let rename = |from: &Path, to: &Path| std::fs::rename(from, to).map_err(|e| io_error(to, e));
    if !path.exists() {
        return rename(new, path);
    }
    #[cfg(target_os = "linux")]
    {
        use std::os::unix::ffi::OsStrExt;
        let c_path = |p: &Path| std::ffi::CString::new(p.as_os_str().as_bytes());
        if let (Ok(from), Ok(to)) = (c_path(new), c_path(path)) {
            // SAFETY: two NUL-terminated paths that live across the call, which only reads them.
            let rc = unsafe {
                libc::renameat2(libc::AT_FDCWD, from.as_ptr(), libc::AT_FDCWD, to.as_ptr(), libc::RENAME_EXCHANGE)
            };
            if rc == 0 {
                return Ok(());
            }
            let e = std::io::Error::last_os_error();
            if !matches!(e.raw_os_error(), Some(libc::EINVAL | libc::ENOSYS | libc::EOPNOTSUPP)) {
                return Err(io_error(path, e));
            }
        }
    }
    let aside = new.with_extension("aside");
    rename(path, &aside)?;
    rename(new, path)?;
    rename(&aside, new)
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

/// A write running on its own thread: a checkpoint and an export go to disk while the next
/// steps train, instead of holding the step loop through the kernel's copy and the `fsync`s.
/// Its outcome is read by [`wait`](Self::wait); dropped unread (the run failed elsewhere), it
/// is still waited for, so a file it was writing is whole (or untouched) when the run ends.
#[must_use = "a background write's error is only seen through wait"]
pub struct Background {
    what: &'static str,
    thread: Option<JoinHandle<Result<()>>>,
}

impl Background {
    /// Starts `write` on a new thread; `what` names it in errors.
    pub fn spawn(what: &'static str, write: impl FnOnce() -> Result<()> + Send + 'static) -> Result<Self> {
        let thread = std::thread::Builder::new()
            .name(format!("write-{what}"))
            .spawn(write)
            .map_err(|e| internal(what, format!("cannot start its writing thread: {e}")))?;
        Ok(Self { what, thread: Some(thread) })
    }

    /// Waits for the write to end and returns its outcome.
    pub fn wait(mut self) -> Result<()> {
        self.join()
    }

    fn join(&mut self) -> Result<()> {
        match self.thread.take().map(JoinHandle::join) {
            None | Some(Ok(Ok(()))) => Ok(()),
            Some(Ok(Err(e))) => Err(e),
            Some(Err(_)) => Err(internal(self.what, "its writing thread panicked")),
        }
    }
}

impl Drop for Background {
    fn drop(&mut self) {
        let _ = self.join();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Two folders trade places: `path` holds the new one, `new` the old one; with no folder at
    /// `path`, the new one is simply moved there.
    #[test]
    fn swap_in_trades_the_folders() {
        let root = std::env::temp_dir().join(format!("pt-swap-in-{}", std::process::id()));
        let (new, path) = (root.join(".model.staging"), root.join("model"));
        for (dir, marker) in [(&new, "new"), (&path, "old")] {
            std::fs::create_dir_all(dir).unwrap();
            std::fs::write(dir.join(marker), marker).unwrap();
        }
        swap_in(&new, &path).unwrap();
        assert!(path.join("new").exists() && !path.join("old").exists());
        assert!(new.join("old").exists() && !new.join("new").exists());
        std::fs::remove_dir_all(&path).unwrap();
        swap_in(&new, &path).unwrap();
        assert!(path.join("old").exists() && !new.exists());
        std::fs::remove_dir_all(&root).unwrap();
    }

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

    #[test]
    fn a_background_write_reports_its_error_and_is_finished_when_dropped() {
        let dir = std::env::temp_dir().join(format!("pt-files-bg-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("late.bin");
        let p = path.clone();
        let slow = Background::spawn("test", move || {
            std::thread::sleep(std::time::Duration::from_millis(200));
            write_atomic(&p, |w| std::io::Write::write_all(w, b"done"))
        })
        .unwrap();
        drop(slow);
        assert_eq!(std::fs::read(&path).unwrap(), b"done", "dropping waits for the write");
        let failing = Background::spawn("test", || Err(internal("disk", "full"))).unwrap();
        assert!(failing.wait().unwrap_err().to_string().contains("full"));
        let panicking = Background::spawn("checkpoint", || panic!("boom")).unwrap();
        assert!(panicking.wait().unwrap_err().to_string().contains("checkpoint"));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
