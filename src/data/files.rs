//! Reading dataset files: a missing file becomes an error that says how to fetch it, and the
//! compression is chosen by the file name (`.gz`, `.bz2`, else plain; a gzip or bzip2 stream also
//! by its first bytes, as a user's file need not be named for it), so that tests can hand the parsers
//! small uncompressed files.

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

/// The path that names standard input among a user's files (`--file -`).
const STDIN: &str = "-";

/// An [`Error::Dataset`] about `file` (at `line`, 1-based, when given).
pub(crate) fn dataset_error(file: &Path, line: Option<usize>, message: impl Into<String>) -> Error {
    let file = match file == Path::new(STDIN) {
        true => "standard input".to_string(),
        false => file.display().to_string(),
    };
    Error::Dataset { file, line, message: message.into() }
}

/// The most bytes a compressed file may expand to: far above any dataset here (Fashion-MNIST's
/// training images are 47 MB), and a bound on what a small hostile file can make us allocate.
const MOST_DECOMPRESSED: u64 = 4 << 30;

/// The whole file, decompressed according to its extension. A missing file is an
/// [`Error::Dataset`] naming the setup command; a corrupt stream is one naming the format.
pub(crate) fn read_bytes(path: &Path, group: SetupGroup) -> Result<Vec<u8>> {
    read_bytes_within(path, group, MOST_DECOMPRESSED)
}

/// [`read_bytes`], refusing a compressed file that expands past `most` bytes.
pub(crate) fn read_bytes_within(path: &Path, group: SetupGroup, most: u64) -> Result<Vec<u8>> {
    let (decoder, format) = decoded(path, group)?;
    let mut out = Vec::new();
    let read = decoder.take(if format.is_some() { most + 1 } else { u64::MAX }).read_to_end(&mut out);
    match (read, format) {
        (Ok(n), Some(format)) if n as u64 > most => Err(dataset_error(
            path,
            None,
            format!(
                "expands to more than {most} bytes of {format}-compressed data; expected a dataset file below that"
            ),
        )),
        (Ok(_), _) => Ok(out),
        // A decoder's error means the bytes are not a (complete) stream of that format: say so
        // rather than pass on an unexplained "unexpected end of file".
        (Err(e), Some(format)) => {
            Err(dataset_error(path, None, format!("is not a valid {format} stream ({e}); {}", group.remedy())))
        }
        (Err(source), None) => Err(crate::files::io_error(path, source)),
    }
}

/// `path` (a user's `-`: standard input, as for `predict`) as a reader of its decompressed
/// bytes, and the compression it was read through, if any: gzip or bzip2 by the name or by
/// the first bytes.
fn decoded(path: &Path, group: SetupGroup) -> Result<(Box<dyn Read>, Option<&'static str>)> {
    let file: Box<dyn Read> = match group == SetupGroup::User && path == Path::new(STDIN) {
        true => Box::new(std::io::stdin().lock()),
        false => Box::new(open(path, group)?),
    };
    let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    let mut file = std::io::BufReader::new(file);
    let head = std::io::BufRead::fill_buf(&mut file).map_err(|source| crate::files::io_error(path, source))?;
    let (gzip_bytes, bzip2_bytes) = (head.starts_with(&[0x1f, 0x8b]), is_bzip2(head));
    // The multi-stream decoders: `pbzip2`, `bgzip` and `cat a.gz b.gz` write several streams
    // to one file, and the single-stream ones stop silently after the first.
    Ok(if name.ends_with(".gz") || gzip_bytes {
        (Box::new(flate2::read::MultiGzDecoder::new(file)), Some("gzip"))
    } else if name.ends_with(".bz2") || bzip2_bytes {
        (Box::new(bzip2::read::MultiBzDecoder::new(file)), Some("bzip2"))
    } else {
        (Box::new(file), None)
    })
}

/// Whether `head` opens a bzip2 stream: `BZh`, a block size `1`–`9`, and the magic of a first
/// block (the digits of π) or of an empty stream's end (of √π). Ten bytes, where gzip's two
/// suffice: a text line may well start with `BZh9`.
fn is_bzip2(head: &[u8]) -> bool {
    const BLOCK: [u8; 6] = [0x31, 0x41, 0x59, 0x26, 0x53, 0x59];
    const END: [u8; 6] = [0x17, 0x72, 0x45, 0x38, 0x50, 0x90];
    head.len() >= 10
        && head.starts_with(b"BZh")
        && (b'1'..=b'9').contains(&head[3])
        && (head[4..10] == BLOCK || head[4..10] == END)
}

/// An error reading `path` through a decoder of `format` (a damaged stream), or directly.
fn read_error(path: &Path, format: Option<&str>, e: std::io::Error) -> Error {
    match format {
        Some(format) => dataset_error(path, None, format!("is not a valid {format} stream ({e})")),
        None => crate::files::io_error(path, e),
    }
}

/// The first `n` bytes of a file a user named, decompressed as [`read_user_text`] does: what
/// tells its kind apart (`predict`'s inputs). A damaged stream is an error naming its format.
pub(crate) fn user_head(path: &Path, n: u64) -> Result<Vec<u8>> {
    let (decoder, format) = decoded(path, SetupGroup::User)?;
    let mut head = Vec::new();
    decoder.take(n).read_to_end(&mut head).map_err(|e| read_error(path, format, e))?;
    Ok(head)
}

/// The longest line [`user_lines`] reads: far beyond any input's (a text is cut to the
/// model's tokens, a prompt to its window, a row of pixels holds thousands of values), and far
/// short of what a file without line breaks would make one line hold.
pub(crate) const LONGEST_LINE: usize = 16 << 20;

/// The lines of a text file a user named (`predict --file`; `-`: standard input), each as it
/// comes (a terminal's too), decompressed as [`read_user_text`] does, a byte-order mark and
/// each line's `\r` dropped. A line that is not UTF-8 is an [`Error::Dataset`] naming its
/// number, and the lines after it go on; a line holding a NUL byte (a binary file), one
/// longer than 16 MiB (a file without line breaks: read no further), or a stream
/// that cannot be read (or decompressed), ends them with an error naming no line.
pub fn user_lines(path: &Path) -> Result<impl Iterator<Item = Result<String>>> {
    use std::io::BufRead;
    let (decoder, format) = decoded(path, SetupGroup::User)?;
    let path = path.to_path_buf();
    let mut reader = std::io::BufReader::new(decoder);
    let (mut number, mut ended) = (0, false);
    Ok(std::iter::from_fn(move || {
        if ended {
            return None;
        }
        let mut bytes = Vec::new();
        // (One byte past the longest line: a line that long is refused, not read to its end.)
        match (&mut reader).take(LONGEST_LINE as u64 + 1).read_until(b'\n', &mut bytes) {
            Ok(0) => return None,
            Ok(_) => number += 1,
            Err(e) => {
                ended = true;
                return Some(Err(read_error(&path, format, e)));
            }
        }
        let ends_its_line = bytes.last() == Some(&b'\n');
        if ends_its_line {
            bytes.pop();
        }
        // A NUL byte is no text's: the file is binary (an image given as the list, say), and
        // its lines would be inputs of junk. It ends the stream.
        if bytes.contains(&0) {
            ended = true;
            return Some(Err(dataset_error(
                &path,
                None,
                format!(
                    "is not text: line {number} holds a NUL byte; expected UTF-8 text, one input a line (an image is \
                     given as an argument itself, not in a --file list)"
                ),
            )));
        }
        if !ends_its_line && bytes.len() > LONGEST_LINE {
            ended = true;
            return Some(Err(dataset_error(
                &path,
                None,
                format!(
                    "line {number} is longer than {} MiB, and is not read further; expected one input a line",
                    LONGEST_LINE >> 20
                ),
            )));
        }
        if bytes.last() == Some(&b'\r') {
            bytes.pop();
        }
        if number == 1 && bytes.starts_with("\u{feff}".as_bytes()) {
            bytes.drain(..3);
        }
        Some(String::from_utf8(bytes).map_err(|e| {
            let at = e.utf8_error().valid_up_to();
            dataset_error(&path, Some(number), format!("is not valid UTF-8 (byte offset {at}); expected UTF-8 text"))
        }))
    }))
}

/// The whole file as UTF-8 text (decompressed as [`read_bytes`] does).
pub(crate) fn read_text(path: &Path, group: SetupGroup) -> Result<String> {
    let mut bytes = read_bytes(path, group)?;
    // A byte-order mark (Excel and Notepad write one) is not part of the first field's name.
    if bytes.starts_with("\u{feff}".as_bytes()) {
        bytes.drain(..3);
    }
    String::from_utf8(bytes).map_err(|e| {
        let at = e.utf8_error().valid_up_to();
        let bytes = e.as_bytes();
        let line = 1 + bytes[..at].iter().filter(|&&b| b == b'\n').count();
        dataset_error(path, Some(line), format!("is not valid UTF-8 (byte offset {at}); expected UTF-8 text"))
    })
}

/// `path` opened for reading; a folder, or a file that is not there, is an [`Error::Dataset`]
/// saying so (and, for a file not there, what to do about it).
fn open(path: &Path, group: SetupGroup) -> Result<std::fs::File> {
    if path.is_dir() {
        // (Opened, a folder reads as the bare "Is a directory" error.)
        return Err(dataset_error(path, None, "is a folder; expected a file"));
    }
    match std::fs::File::open(path) {
        Ok(f) => Ok(f),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            // A relative path is read from the current folder, which may not be the one the
            // data was installed under (a run started from elsewhere).
            let from = match std::env::current_dir() {
                Ok(cwd) if path.is_relative() => format!(" (a relative path, read from {})", cwd.display()),
                _ => String::new(),
            };
            Err(dataset_error(path, None, format!("not found{from}: {}", group.remedy())))
        }
        Err(source) => Err(crate::files::io_error(path, source)),
    }
}

/// A text file a user named (`predict`'s and `evaluate`'s inputs), decompressed as
/// the dataset readers do (gzip by its name or first bytes); `-` reads standard input.
pub fn read_user_text(path: &Path) -> Result<String> {
    read_text(path, SetupGroup::User)
}

/// Lines of `text` with their 1-based numbers (`str::lines` also drops the `\r` of CRLF files).
pub(crate) fn numbered_lines(text: &str) -> impl Iterator<Item = (usize, &str)> {
    text.lines().enumerate().map(|(i, l)| (i + 1, l))
}
