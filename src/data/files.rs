//! Reading dataset files: a missing file becomes an error that says how to fetch it, and the
//! compression is chosen by the file name (`.gz`, `.bz2`, else plain), so that tests can hand
//! the parsers small uncompressed files.

use std::io::Read;
use std::path::Path;

use crate::error::{Error, Result};

/// The `scripts/setup.sh` group that fetches a file, named in "not found" errors.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum SetupGroup {
    /// `scripts/setup.sh text`: Rotten Tomatoes, Reuters R8, Hamlet.
    Text,
    /// `scripts/setup.sh images`: digits, MNIST-5k, Fashion-MNIST.
    Images,
    /// A file the user named (`predict` inputs): no setup step makes it.
    User,
}

impl SetupGroup {
    /// What to do about a missing or corrupt file.
    fn remedy(self) -> &'static str {
        match self {
            SetupGroup::Text => "run scripts/setup.sh text",
            SetupGroup::Images => "run scripts/setup.sh images",
            SetupGroup::User => "check the path",
        }
    }
}

/// An [`Error::Dataset`] about `file` (at `line`, 1-based, when given).
pub(crate) fn dataset_error(file: &Path, line: Option<usize>, message: impl Into<String>) -> Error {
    Error::Dataset { file: file.display().to_string(), line, message: message.into() }
}

/// The whole file, decompressed according to its extension. A missing file is an
/// [`Error::Dataset`] naming the setup command; a corrupt stream is one naming the format.
pub(crate) fn read_bytes(path: &Path, group: SetupGroup) -> Result<Vec<u8>> {
    let file = match std::fs::File::open(path) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return Err(dataset_error(path, None, format!("not found: {}", group.remedy())));
        }
        Err(source) => return Err(Error::Io { path: path.display().to_string(), source }),
    };
    let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    let mut out = Vec::new();
    let (read, format) = if name.ends_with(".gz") {
        (flate2::read::GzDecoder::new(std::io::BufReader::new(file)).read_to_end(&mut out), Some("gzip"))
    } else if name.ends_with(".bz2") {
        (bzip2::read::BzDecoder::new(std::io::BufReader::new(file)).read_to_end(&mut out), Some("bzip2"))
    } else {
        (std::io::BufReader::new(file).read_to_end(&mut out), None)
    };
    match (read, format) {
        (Ok(_), _) => Ok(out),
        // A decoder's error means the bytes are not a (complete) stream of that format: say so
        // rather than pass on an unexplained "unexpected end of file".
        (Err(e), Some(format)) => {
            Err(dataset_error(path, None, format!("is not a valid {format} stream ({e}); {}", group.remedy())))
        }
        (Err(source), None) => Err(Error::Io { path: path.display().to_string(), source }),
    }
}

/// The whole file as UTF-8 text (decompressed as [`read_bytes`] does).
pub(crate) fn read_text(path: &Path, group: SetupGroup) -> Result<String> {
    let bytes = read_bytes(path, group)?;
    String::from_utf8(bytes).map_err(|e| {
        let at = e.utf8_error().valid_up_to();
        let bytes = e.as_bytes();
        let line = 1 + bytes[..at].iter().filter(|&&b| b == b'\n').count();
        dataset_error(path, Some(line), format!("is not valid UTF-8 (byte offset {at}); expected UTF-8 text"))
    })
}

/// Lines of `text` with their 1-based numbers (`str::lines` also drops the `\r` of CRLF files).
pub(crate) fn numbered_lines(text: &str) -> impl Iterator<Item = (usize, &str)> {
    text.lines().enumerate().map(|(i, l)| (i + 1, l))
}
