//! Files that must never be seen half-written (checkpoints, exports, reports, the activation
//! cache's index): written to a temporary sibling, fsynced, renamed into place, the large
//! ones past the page cache ([`write_atomic_uncached`]); and writes that run on a thread of
//! their own while training goes on ([`Background`]); a folder one process writes at a time
//! ([`lock_folder`]), and a path checked for writing before the work that ends in it
//! ([`check_writable`]). And [`Scratch`], a temp folder that goes when its user is done with it.

use crate::error::{Error, Result, internal};
use std::fs::File;
use std::io::BufWriter;
use std::path::Path;
use std::thread::JoinHandle;

/// The I/O error of `path`.
pub fn io_error(path: &Path, source: std::io::Error) -> Error {
    Error::Io { path: path.display().to_string(), source }
}

/// A fresh, empty folder under the system's temp dir (`pt-<label>-<pid>-<n>`, `n` counting this
/// process's folders, so two users of one label never share a folder; emptied first if an
/// earlier process of the same id left it), removed again when dropped, unless the thread is
/// panicking (a failing test's files stay to be read) or it was [`kept`](Self::keep). Derefs to
/// its path.
pub struct Scratch(Option<std::path::PathBuf>);

impl Scratch {
    /// Creates the folder.
    pub fn create(label: &str) -> Result<Self> {
        Self::create_in(&std::env::temp_dir(), label)
    }

    /// [`create`](Self::create) under `base` instead of the temp dir (e.g. `/dev/shm`, for a
    /// folder written thousands of times a second).
    pub fn create_in(base: &Path, label: &str) -> Result<Self> {
        static MADE: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let n = MADE.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let dir = base.join(format!("pt-{label}-{}-{n}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).map_err(|e| io_error(&dir, e))?;
        Ok(Scratch(Some(dir)))
    }

    /// [`create`](Self::create) for a test's setup: panics where the temp dir cannot be written.
    pub fn new(label: &str) -> Self {
        Self::create(label).unwrap_or_else(|e| panic!("{e}"))
    }

    /// Leaves the folder where it is, to be read after an error; returns its path.
    pub fn keep(mut self) -> std::path::PathBuf {
        self.0.take().expect("a Scratch holds its path until kept")
    }
}

impl std::ops::Deref for Scratch {
    type Target = Path;
    fn deref(&self) -> &Path {
        self.0.as_deref().expect("a Scratch holds its path until kept")
    }
}

impl AsRef<Path> for Scratch {
    fn as_ref(&self) -> &Path {
        self
    }
}

impl AsRef<std::ffi::OsStr> for Scratch {
    fn as_ref(&self) -> &std::ffi::OsStr {
        self.as_os_str()
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        if let Some(dir) = &self.0
            && !std::thread::panicking()
        {
            let _ = std::fs::remove_dir_all(dir);
        }
    }
}

/// The file in a run's folder that [`lock_folder`] holds.
pub const LOCK_FILE: &str = ".lock";

/// Takes `dir/.lock` (an advisory lock the kernel releases when the returned file is dropped
/// or the process ends, however it ends) so that two runs never write one folder at once: the
/// second is refused, naming the first's process, instead of interleaving its metrics and
/// overwriting its checkpoints. Having taken it, removes the temporary files of writers
/// that died mid-write there.
pub fn lock_folder(dir: &Path) -> Result<File> {
    use std::io::Write;
    let path = dir.join(LOCK_FILE);
    let mut file = File::options()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(&path)
        .map_err(|e| io_error(&path, e))?;
    match file.try_lock() {
        Ok(()) => {
            // Whose lock it is, for the message of a run refused while this one goes on.
            let pid = std::process::id().to_string();
            file.set_len(0).and_then(|()| file.write_all(pid.as_bytes())).map_err(|e| io_error(&path, e))?;
            remove_stale_temporaries(dir);
            Ok(file)
        }
        Err(std::fs::TryLockError::WouldBlock) => {
            let holder = lock_holder(&mut file);
            Err(io_error(
                dir,
                std::io::Error::new(
                    std::io::ErrorKind::ResourceBusy,
                    format!(
                        "another run ({holder}) is writing to this folder; wait for it to end, or give this run \
                         another output.dir"
                    ),
                ),
            ))
        }
        Err(std::fs::TryLockError::Error(e)) => Err(io_error(&path, e)),
    }
}

/// The process that holds `dir`'s lock ([`lock_folder`]) now, as "process N": `None` where no
/// run writes to the folder (the lock is only tried, never kept).
pub fn folder_writer(dir: &Path) -> Option<String> {
    let mut file = File::open(dir.join(LOCK_FILE)).ok()?;
    match file.try_lock_shared() {
        Err(std::fs::TryLockError::WouldBlock) => Some(lock_holder(&mut file)),
        _ => None,
    }
}

/// Whose lock `file` is, as its holder wrote it.
fn lock_holder(file: &mut File) -> String {
    use std::io::{Read, Seek};
    let mut holder = String::new();
    let _ = file.rewind().and_then(|_| file.read_to_string(&mut holder));
    match holder.trim().parse::<u32>() {
        Ok(pid) => format!("process {pid}"),
        Err(_) => "another process".into(),
    }
}

/// Checks that a file can be written at `path` (its folder exists and takes a new file;
/// `path` itself is not a folder) by creating and removing a probe beside it: for a file
/// written at the end of a long run, checked before the run starts.
pub fn check_writable(path: &Path) -> Result<()> {
    let not = |message: String| io_error(path, std::io::Error::other(message));
    if path.is_dir() {
        return Err(not("is a folder; expected the path of a file to write".into()));
    }
    let name = path.file_name().ok_or_else(|| not("names no file".into()))?;
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    if !dir.is_dir() {
        return Err(not(format!("{} is not a folder: create it first", dir.display())));
    }
    let probe = dir.join(format!(".{}.probe-{}", name.to_string_lossy(), std::process::id()));
    File::options().write(true).create_new(true).open(&probe).map_err(|e| io_error(path, e))?;
    let _ = std::fs::remove_file(&probe);
    Ok(())
}

/// Checks that files can be written in the folder `dir`, or, where it does not exist yet, in
/// the nearest folder above it that does (where it would be made): a file is made there and
/// removed. So a run learns before it builds anything that its folder cannot take its files
/// (a read-only mount, a folder of another user's).
pub fn check_folder_writable(dir: &Path) -> Result<()> {
    let mut at = dir;
    while !at.exists() {
        at = match at.parent() {
            Some(p) if !p.as_os_str().is_empty() => p,
            _ => Path::new("."),
        };
    }
    // (Named by process and time: a probe a killed process left cannot stand in the way.)
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
    let probe = at.join(format!(".write-check-{}-{}", std::process::id(), now.as_nanos()));
    match File::options().write(true).create_new(true).open(&probe) {
        Ok(_) => {
            let _ = std::fs::remove_file(&probe);
            Ok(())
        }
        Err(e) if at == dir => Err(io_error(dir, std::io::Error::new(e.kind(), format!("cannot write in it: {e}")))),
        Err(e) => Err(io_error(
            dir,
            std::io::Error::new(e.kind(), format!("cannot be made: {} does not take new files ({e})", at.display())),
        )),
    }
}

/// Puts the folder `new` at `path` in one step. Where `path` exists, the two trade places
/// (Linux's `renameat2` with `RENAME_EXCHANGE`): a reader finds one whole folder or the other
/// at `path`, never none, and `new` then holds what `path` held, for the caller to remove.
/// Where the file system cannot exchange, the old folder moves aside first (a moment without
/// `path`) and ends up at `new` all the same (by three renames).
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
    swap_by_renames(new, path)
}

/// [`swap_in`] by three renames, for file systems that cannot exchange two names (NFS, FUSE):
/// `path` moves aside, `new` takes its place, and what was aside goes to `new`. A folder left
/// aside by one of these that a crash cut short is stale (`path` exists, so it has been
/// replaced since) and goes first, so that it cannot stand in the way of every later swap;
/// where `new` cannot take its place, `path` comes back.
fn swap_by_renames(new: &Path, path: &Path) -> Result<()> {
    let rename = |from: &Path, to: &Path| std::fs::rename(from, to).map_err(|e| io_error(to, e));
    let aside = new.with_extension("aside");
    if aside.exists() {
        std::fs::remove_dir_all(&aside).map_err(|e| io_error(&aside, e))?;
    }
    rename(path, &aside)?;
    if let Err(e) = rename(new, path) {
        let _ = std::fs::rename(&aside, path);
        return Err(e);
    }
    rename(&aside, new)
}

/// Writes `path` through a temporary sibling file that is fsynced and renamed into place; on
/// failure the temporary file is removed and `path` is untouched.
pub fn write_atomic(path: &Path, write: impl FnOnce(&mut BufWriter<File>) -> std::io::Result<()>) -> Result<()> {
    through_temporary(path, |tmp| {
        let mut w = BufWriter::new(File::create(tmp)?);
        write(&mut w)?;
        w.into_inner().map_err(std::io::IntoInnerError::into_error)
    })
}

/// [`write_atomic`] for files of many megabytes (checkpoints, exported weights): where the file
/// system takes it, the bytes go to the disk from this process's memory (`O_DIRECT`) instead
/// of being copied into the kernel's page cache and written back from there. On the VMs of
/// docs/PERF.md that copy cost 0.74 s of CPU per 256 MB (0.03 s direct), taken from the
/// training threads while a checkpoint was written in the background.
pub fn write_atomic_uncached(path: &Path, write: impl FnOnce(&mut Uncached) -> std::io::Result<()>) -> Result<()> {
    through_temporary(path, |tmp| {
        let mut w = Uncached::create(tmp, true)?;
        write(&mut w)?;
        w.finish()
    })
}

/// What names a temporary file of [`through_temporary`]: `.NAME` + this + the writer's pid.
const TEMPORARY_TAG: &str = ".tmp-";

/// Removes the temporary files writers killed mid-write left in `dir` (a checkpoint's is its
/// whole size, and each crash left one more under its pid): called by the holder of the
/// folder's lock, when no other writer can be at work. Best-effort: a file that will not go
/// stays.
fn remove_stale_temporaries(dir: &Path) {
    let Ok(entries) = std::fs::read_dir(dir) else { return };
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(name) = name.to_str() else { continue };
        let pid = name.rsplit_once(TEMPORARY_TAG).map(|(_, pid)| pid);
        let ours = name.starts_with('.') && pid.is_some_and(|p| !p.is_empty() && p.bytes().all(|b| b.is_ascii_digit()));
        if ours && entry.file_type().is_ok_and(|t| t.is_file()) {
            let _ = std::fs::remove_file(entry.path());
        }
    }
}

/// Writes a temporary sibling of `path` by `write`, fsyncs it and renames it into place, then
/// fsyncs the folder; on failure removes the temporary file and leaves `path` untouched.
fn through_temporary(path: &Path, write: impl FnOnce(&Path) -> std::io::Result<File>) -> Result<()> {
    let dir = path.parent().filter(|d| !d.as_os_str().is_empty()).unwrap_or(Path::new("."));
    let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    // Same directory, so the rename cannot cross file systems; the pid keeps two concurrent
    // writers from sharing a temporary file.
    let tmp = dir.join(format!(".{name}{TEMPORARY_TAG}{}", std::process::id()));
    // Errors name the file being written, not its temporary (`checkpoint.ckpt: No space left
    // on device`, which the user can act on).
    let result = (|| {
        let file = write(&tmp).map_err(|e| io_error(path, e))?;
        file.sync_all().map_err(|e| io_error(path, e))?;
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

/// Bytes an [`Uncached`] gathers before each write: whole blocks of every disk's logical size.
const UNCACHED_CHUNK: usize = 4 << 20;
/// The alignment `O_DIRECT` asks of a write's address, offset and length (the largest logical
/// block size of common disks).
const DIRECT_ALIGN: usize = 4096;

/// A file writer whose bytes bypass the page cache (`O_DIRECT`, Linux): gathered into an
/// aligned buffer and written a whole chunk at a time, the last one padded to a block and the
/// file then cut to its length. Where the file system refuses direct writes (at the open or at
/// a write) it goes on through the cache from where it stood: the same bytes either way.
pub struct Uncached {
    file: File,
    path: std::path::PathBuf,
    /// `UNCACHED_CHUNK + DIRECT_ALIGN` bytes, of which `start..start + UNCACHED_CHUNK` is aligned.
    buf: Vec<u8>,
    start: usize,
    /// Bytes gathered in the buffer.
    held: usize,
    /// Bytes written to the file before them.
    written: u64,
    /// Whether the file takes direct writes (else it goes through the page cache).
    direct: bool,
}

impl Uncached {
    /// Creates (or truncates) `path`, for direct writes where `direct` and the file system
    /// takes them.
    fn create(path: &Path, direct: bool) -> std::io::Result<Self> {
        let open = |direct: bool| {
            let mut options = std::fs::OpenOptions::new();
            options.write(true).create(true).truncate(true);
            #[cfg(target_os = "linux")]
            if direct {
                use std::os::unix::fs::OpenOptionsExt;
                options.custom_flags(libc::O_DIRECT);
            }
            #[cfg(not(target_os = "linux"))]
            let _ = direct;
            options.open(path)
        };
        let direct = direct && cfg!(target_os = "linux");
        let (file, direct) = match open(direct) {
            Ok(file) => (file, direct),
            Err(e) if direct && e.raw_os_error() == Some(libc::EINVAL) => (open(false)?, false),
            Err(e) => return Err(e),
        };
        let buf = vec![0u8; UNCACHED_CHUNK + DIRECT_ALIGN];
        let start = buf.as_ptr().align_offset(DIRECT_ALIGN).min(DIRECT_ALIGN);
        Ok(Self { file, path: path.to_path_buf(), buf, start, held: 0, written: 0, direct })
    }

    /// Writes the buffer's first `len` bytes at the file's end (`len` a multiple of the
    /// alignment while direct), then empties it.
    fn write_held(&mut self, len: usize) -> std::io::Result<()> {
        let mut done = 0;
        while done < len {
            match std::io::Write::write(&mut self.file, &self.buf[self.start + done..self.start + len]) {
                Ok(0) => return Err(std::io::ErrorKind::WriteZero.into()),
                Ok(n) => done += n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) if self.direct && e.raw_os_error() == Some(libc::EINVAL) => self.through_cache()?,
                Err(e) => return Err(e),
            }
        }
        self.written += done as u64;
        self.held = 0;
        Ok(())
    }

    /// Goes on through the page cache: the file reopened without `O_DIRECT`, at the offset
    /// the direct writes reached.
    fn through_cache(&mut self) -> std::io::Result<()> {
        use std::io::Seek;
        let at = self.file.stream_position()?;
        let mut file = std::fs::OpenOptions::new().write(true).open(&self.path)?;
        file.seek(std::io::SeekFrom::Start(at))?;
        (self.file, self.direct) = (file, false);
        Ok(())
    }

    /// Writes what is held (padded to a block while direct, the file then cut to its length)
    /// and returns the file, for the caller to fsync.
    fn finish(mut self) -> std::io::Result<File> {
        let (held, end) = (self.held, self.written + self.held as u64);
        let padded = if self.direct { held.next_multiple_of(DIRECT_ALIGN) } else { held };
        self.buf[self.start + held..self.start + padded].fill(0);
        self.write_held(padded)?;
        if padded > held {
            self.file.set_len(end)?;
        }
        Ok(self.file)
    }
}

impl std::io::Write for Uncached {
    /// Takes bytes into the buffer, writing it out when full. An error from that write comes
    /// after the bytes were taken (unlike `Write`'s usual contract); every caller gives the
    /// file up on an error, and [`write_atomic_uncached`] removes it.
    fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
        let n = bytes.len().min(UNCACHED_CHUNK - self.held);
        let at = self.start + self.held;
        self.buf[at..at + n].copy_from_slice(&bytes[..n]);
        self.held += n;
        if self.held == UNCACHED_CHUNK {
            self.write_held(UNCACHED_CHUNK)?;
        }
        Ok(n)
    }

    /// Nothing: only whole chunks go out before the writer finishes (a direct write must be
    /// whole blocks).
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
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
        let root = Scratch::new("swap-in");
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
    }

    /// Where the file system cannot exchange names, three renames do the same: a folder a
    /// crash left aside does not stand in their way, and where the new folder cannot take
    /// `path`'s place (here it is gone), `path` keeps the old one.
    #[test]
    fn swap_by_renames_survives_what_a_crash_left_and_keeps_the_old_folder_on_failure() {
        let root = Scratch::new("swap-renames");
        let (new, path, aside) = (root.join(".model.staging"), root.join("model"), root.join(".model.aside"));
        for (dir, marker) in [(&new, "new"), (&path, "old"), (&aside, "stale")] {
            std::fs::create_dir_all(dir).unwrap();
            std::fs::write(dir.join(marker), marker).unwrap();
        }
        swap_by_renames(&new, &path).unwrap();
        assert!(path.join("new").exists() && new.join("old").exists() && !aside.exists());
        std::fs::remove_dir_all(&new).unwrap();
        let e = swap_by_renames(&new, &path).unwrap_err().to_string();
        assert!(e.contains("model"), "{e}");
        assert!(path.join("new").exists() && !aside.exists(), "the old folder stays at `path`");
    }

    /// One holder at a time, named to the one refused; free again once dropped.
    #[test]
    fn a_locked_folder_refuses_a_second_writer_until_released() {
        let dir = Scratch::new("lock");
        let first = lock_folder(&dir).unwrap();
        let e = lock_folder(&dir).unwrap_err().to_string();
        assert!(e.contains(&format!("another run (process {})", std::process::id())), "{e}");
        assert!(e.contains("output.dir"), "{e}");
        drop(first);
        lock_folder(&dir).unwrap();
    }

    /// A writer killed mid-write leaves its temporary file (a whole checkpoint's size, one more
    /// per crash); the next holder of the lock removes those, and nothing else.
    #[test]
    fn the_lock_holder_removes_temporaries_killed_writers_left() {
        use std::io::Write;
        let dir = Scratch::new("stale");
        let names = [".checkpoint.ckpt.tmp-4242", ".summary.json.tmp-17", ".notes.tmp-abc", "run.tmp-9", "kept.ckpt"];
        for name in names {
            std::fs::write(dir.join(name), b"x").unwrap();
        }
        // A real write leaves no temporary of its own, and its file stays.
        write_atomic(&dir.join("kept.json"), |w| w.write_all(b"{}")).unwrap();
        // A write that fails names the file it was writing, not its temporary, and leaves none.
        let e = write_atomic(&dir.join("failing.json"), |_| Err(std::io::Error::other("disk full"))).unwrap_err();
        assert!(e.to_string().contains("failing.json: disk full") && !e.to_string().contains(".tmp-"), "{e}");
        let _lock = lock_folder(&dir).unwrap();
        let mut left: Vec<String> =
            std::fs::read_dir(&dir).unwrap().map(|e| e.unwrap().file_name().into_string().unwrap()).collect();
        left.sort();
        assert_eq!(left, [".lock", ".notes.tmp-abc", "kept.ckpt", "kept.json", "run.tmp-9"]);
    }

    #[test]
    fn a_path_that_cannot_be_written_is_refused_before_the_work() {
        let dir = Scratch::new("writable");
        check_writable(&dir.join("trace.json")).unwrap();
        assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 0, "the probe is gone");
        let file = dir.join("afile");
        std::fs::write(&file, "x").unwrap();
        for (path, says) in [
            (file.join("trace.json"), "is not a folder"),
            (dir.join("missing/trace.json"), "is not a folder"),
            (dir.to_path_buf(), "is a folder"),
        ] {
            let e = check_writable(&path).unwrap_err().to_string();
            assert!(e.contains(&path.display().to_string()) && e.contains(says), "{e}");
        }
    }

    #[test]
    fn a_failed_write_leaves_the_old_file_and_no_temporary() {
        let dir = Scratch::new("files");
        let path = dir.join("x.json");
        write_atomic(&path, |w| std::io::Write::write_all(w, b"old")).unwrap();
        let err = write_atomic(&path, |_| Err(std::io::Error::other("disk full"))).unwrap_err();
        assert!(err.to_string().contains("disk full"), "{err}");
        assert_eq!(std::fs::read(&path).unwrap(), b"old");
        assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 1);
    }

    /// Whatever the length and however it arrives in pieces, an uncached file holds exactly
    /// the bytes written: whole chunks, a tail padded and cut back, an empty file; direct where
    /// the file system takes it and through the cache where not (or where asked).
    #[test]
    fn uncached_files_hold_exactly_what_was_written() {
        let dir = Scratch::new("files-uncached");
        let path = dir.join("big.bin");
        let chunk = UNCACHED_CHUNK;
        for len in [0, 1, 4095, 4096, 4097, chunk - 1, chunk, chunk + 1, 2 * chunk + 4097] {
            let bytes: Vec<u8> = (0..len).map(|i| (i * 7 + i / 4096) as u8).collect();
            for direct in [true, false] {
                let mut w = Uncached::create(&path, direct).unwrap();
                let mut rest = &bytes[..];
                for piece in [1, 1000, 70_000, 3 << 20].into_iter().cycle() {
                    if rest.is_empty() {
                        break;
                    }
                    let (now, later) = rest.split_at(piece.min(rest.len()));
                    std::io::Write::write_all(&mut w, now).unwrap();
                    rest = later;
                }
                drop(w.finish().unwrap());
                let got = std::fs::read(&path).unwrap();
                assert!(got == bytes, "{len} bytes, direct {direct}: read back {} differing", got.len());
            }
        }
        // Through the temporary file and the rename of `write_atomic` (tested above).
        write_atomic_uncached(&path, |w| std::io::Write::write_all(w, b"whole")).unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), b"whole");
        assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 1, "no temporary file left");
    }

    /// A write the file system refuses as direct (here: a length that is not whole blocks,
    /// which ext4 refuses with EINVAL; tmpfs, NFS and others take it through their cache) goes
    /// on through the page cache from the same offset, and the file holds what was written.
    /// Where the unaligned write was taken, the switch is made by hand, so that the rest of
    /// the file goes through the reopened file on every file system.
    #[test]
    fn a_refused_direct_write_goes_on_through_the_cache() {
        let dir = Scratch::new("files-refused");
        let path = dir.join("odd.bin");
        let bytes: Vec<u8> = (0..UNCACHED_CHUNK + 100).map(|i| (i % 251) as u8).collect();
        let mut w = Uncached::create(&path, true).unwrap();
        let direct = w.direct;
        std::io::Write::write_all(&mut w, &bytes[..UNCACHED_CHUNK + 50]).unwrap();
        w.write_held(50).unwrap();
        if w.direct {
            w.through_cache().unwrap();
        }
        std::io::Write::write_all(&mut w, &bytes[UNCACHED_CHUNK + 50..]).unwrap();
        drop(w.finish().unwrap());
        assert_eq!(std::fs::read(&path).unwrap(), bytes, "direct at the start: {direct}");
    }

    #[test]
    fn a_background_write_reports_its_error_and_is_finished_when_dropped() {
        let dir = Scratch::new("files-bg");
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
    }
}
