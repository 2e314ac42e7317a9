//! A run's metrics log, `metrics.jsonl`: one JSON event a line. A run that starts over
//! (`--fresh`) leaves the earlier run's log and checkpoint where they are until its own first
//! step is done, its lines held in memory until then; so a run that fails or stops before (a
//! setting that the first step refuses, a device that fails, Ctrl-C) loses nothing already
//! written, and the earlier run can still be resumed.

use std::fs::File;
use std::io::{self, Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

/// Where a run's log lines go.
pub(super) enum MetricsLog {
    /// A process that does not write the run's files.
    Sink,
    /// A run that starts over, before its first step: its lines so far, the log's path, and
    /// the earlier run's files to move aside (from, to) before the log is opened.
    Held { lines: Vec<u8>, path: PathBuf, aside: Vec<(PathBuf, PathBuf)> },
    /// The log, appended to.
    Open(File),
}

impl MetricsLog {
    /// The log at `path`, continued (a resumed run, or a call after one that failed). A run
    /// killed in the middle of a line left it unfinished: it is ended, so that the next event
    /// stands on a line of its own.
    pub(super) fn continued(path: &Path) -> io::Result<Self> {
        let mut file = std::fs::OpenOptions::new().create(true).append(true).read(true).open(path)?;
        if ends_mid_line(&mut file)? {
            file.write_all(b"\n")?;
        }
        Ok(MetricsLog::Open(file))
    }

    /// The log at `path` of a run that starts over: at its first step the earlier run's files
    /// (each of `others`' `from` that exists: its checkpoint first, then its summary, report,
    /// exported model), then its log (where not empty, to `log_aside`), move to their `to`,
    /// replacing older ones there. The checkpoint goes first: a move that fails after it
    /// leaves no checkpoint for a resume to continue under a log set aside.
    ///
    /// An earlier run that left no checkpoint (`others[0]`, stopped or failed before its first)
    /// while one set aside before is there keeps nothing aside: its log is replaced, and the
    /// files set aside stay one resumable run's, not mixed with its.
    pub(super) fn starting_over(path: &Path, log_aside: PathBuf, others: &[(PathBuf, PathBuf)]) -> Self {
        MetricsLog::Held { lines: Vec::new(), path: path.to_path_buf(), aside: moves_aside(path, log_aside, others) }
    }

    /// Writes one line (`line` ends with its newline), in one write so that a line is never
    /// split between two.
    pub(super) fn write_line(&mut self, line: &[u8]) -> io::Result<()> {
        match self {
            MetricsLog::Sink => Ok(()),
            MetricsLog::Held { lines, .. } => {
                lines.extend_from_slice(line);
                Ok(())
            }
            MetricsLog::Open(file) => file.write_all(line),
        }
    }

    /// Whether the lines are still held (no step done yet in a run that starts over).
    pub(super) fn is_held(&self) -> bool {
        matches!(self, MetricsLog::Held { .. })
    }

    /// Moves the earlier run's files aside (while the lines are held; nothing to do after).
    /// Where a move fails, what is not yet moved stays in place, and a later call goes on
    /// from there.
    pub(super) fn set_aside(&mut self) -> io::Result<()> {
        let MetricsLog::Held { aside, .. } = self else { return Ok(()) };
        while let Some((from, to)) = aside.first() {
            // (A folder, the exported model, replaces an older one aside only once that is gone.)
            if from.is_dir() && to.is_dir() {
                std::fs::remove_dir_all(to)
                    .map_err(|e| io::Error::new(e.kind(), format!("removing the older {}: {e}", to.display())))?;
            }
            std::fs::rename(from, to).map_err(|e| {
                io::Error::new(e.kind(), format!("moving {} aside to {}: {e}", from.display(), to.display()))
            })?;
            aside.remove(0);
        }
        Ok(())
    }

    /// [Sets the earlier run's files aside](Self::set_aside), opens the log and writes the
    /// lines held: after a run's first step, or at its end where it took none. Nothing to do
    /// once open; held still where it fails (the log is not opened over a file not moved).
    pub(super) fn open(&mut self) -> io::Result<()> {
        self.set_aside()?;
        let MetricsLog::Held { lines, path, .. } = self else { return Ok(()) };
        // (The earlier log is aside, or was empty.)
        let mut file = std::fs::OpenOptions::new().create(true).truncate(true).write(true).open(&*path)?;
        file.write_all(lines)?;
        *self = MetricsLog::Open(file);
        Ok(())
    }
}

/// The moves (from, to) that [`MetricsLog::starting_over`] makes at a run's first step, in
/// order; none where the earlier run is unresumable (see there).
pub(super) fn moves_aside(path: &Path, log_aside: PathBuf, others: &[(PathBuf, PathBuf)]) -> Vec<(PathBuf, PathBuf)> {
    let unresumable = others.first().is_some_and(|(checkpoint, aside)| !checkpoint.exists() && aside.exists());
    if unresumable {
        return Vec::new();
    }
    let mut aside: Vec<(PathBuf, PathBuf)> = others.iter().filter(|(from, _)| from.exists()).cloned().collect();
    if path.metadata().is_ok_and(|m| m.len() > 0) {
        aside.push((path.to_path_buf(), log_aside));
    }
    aside
}

/// Whether `file` is non-empty and its last byte is not a newline.
fn ends_mid_line(file: &mut File) -> io::Result<bool> {
    if file.metadata()?.len() == 0 {
        return Ok(false);
    }
    file.seek(SeekFrom::End(-1))?;
    let mut last = [0u8];
    file.read_exact(&mut last)?;
    Ok(last[0] != b'\n')
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A run that starts over touches nothing of the earlier run's until it opens its log;
    /// then the earlier log and checkpoint are aside and the log holds this run's lines alone.
    #[test]
    fn an_earlier_runs_files_move_aside_only_when_the_log_opens() {
        let dir = std::env::temp_dir().join(format!("pt-metrics-log-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let (log, ckpt) = (dir.join("metrics.jsonl"), dir.join("checkpoint.ckpt"));
        let (log_aside, ckpt_aside) = (dir.join("metrics.previous.jsonl"), dir.join("checkpoint.previous.ckpt"));
        std::fs::write(&log, b"{\"earlier\":1}\n").unwrap();
        std::fs::write(&ckpt, b"weights").unwrap();
        let others = [(ckpt.clone(), ckpt_aside.clone())];
        let mut m = MetricsLog::starting_over(&log, log_aside.clone(), &others);
        m.write_line(b"{\"start\":1}\n").unwrap();
        assert!(m.is_held());
        drop(m);
        assert_eq!(std::fs::read(&log).unwrap(), b"{\"earlier\":1}\n", "a run that stops before its first step");
        assert_eq!(std::fs::read(&ckpt).unwrap(), b"weights");
        assert!(!log_aside.exists() && !ckpt_aside.exists());
        let mut m = MetricsLog::starting_over(&log, log_aside.clone(), &others);
        m.write_line(b"{\"start\":2}\n").unwrap();
        m.open().unwrap();
        m.write_line(b"{\"step\":1}\n").unwrap();
        assert!(!m.is_held());
        drop(m);
        assert_eq!(std::fs::read(&log).unwrap(), b"{\"start\":2}\n{\"step\":1}\n");
        assert_eq!(std::fs::read(&log_aside).unwrap(), b"{\"earlier\":1}\n");
        assert_eq!(std::fs::read(&ckpt_aside).unwrap(), b"weights");
        assert!(!ckpt.exists());
        // A move that fails (the place aside is a folder) keeps the earlier log where it was,
        // whole, and the lines held (its checkpoint, moved first, is aside: no resume goes on
        // under the log): a later call goes on once the way is clear.
        std::fs::write(&log, b"{\"second\":1}\n").unwrap();
        std::fs::write(&ckpt, b"second weights").unwrap();
        std::fs::remove_file(&log_aside).unwrap();
        std::fs::create_dir_all(log_aside.join("blocked")).unwrap();
        let mut m = MetricsLog::starting_over(&log, log_aside.clone(), &others);
        m.write_line(b"{\"start\":3}\n").unwrap();
        assert!(m.open().is_err() && m.open().is_err() && m.is_held());
        assert_eq!(std::fs::read(&log).unwrap(), b"{\"second\":1}\n");
        assert!(!ckpt.exists() && std::fs::read(&ckpt_aside).unwrap() == b"second weights");
        std::fs::remove_dir_all(&log_aside).unwrap();
        m.open().unwrap();
        drop(m);
        assert_eq!(std::fs::read(&log).unwrap(), b"{\"start\":3}\n");
        assert_eq!(std::fs::read(&log_aside).unwrap(), b"{\"second\":1}\n");
        // An earlier run that left no checkpoint (it stopped before its first) sets nothing
        // aside over the resumable run set aside before: its log alone is replaced.
        let mut m = MetricsLog::starting_over(&log, log_aside.clone(), &others);
        m.write_line(b"{\"start\":4}\n").unwrap();
        m.open().unwrap();
        drop(m);
        assert_eq!(std::fs::read(&log).unwrap(), b"{\"start\":4}\n");
        assert_eq!(std::fs::read(&log_aside).unwrap(), b"{\"second\":1}\n");
        assert_eq!(std::fs::read(&ckpt_aside).unwrap(), b"second weights");
        // Continued after a line cut short: the next line starts on its own.
        std::fs::write(&log, b"{\"step\":1}\n{\"st").unwrap();
        let mut m = MetricsLog::continued(&log).unwrap();
        m.write_line(b"{\"step\":2}\n").unwrap();
        drop(m);
        assert_eq!(std::fs::read(&log).unwrap(), b"{\"step\":1}\n{\"st\n{\"step\":2}\n");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
