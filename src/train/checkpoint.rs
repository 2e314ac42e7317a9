//! The checkpoint file: named f32 tensors and a JSON header, in one file written atomically
//! (temp file, fsync, rename), so a crash or a failed run never leaves a half-written file in
//! place of a good one. What goes in it is the trainer's business.
//!
//! Layout: magic `PTCKPT02` · u64 LE header length · JSON header · raw little-endian f32 data ·
//! u64 LE checksum of everything before it: its CRC-32 (format 01, still read, stored an FNV-1a
//! hash there, one serial multiply per byte: docs/PERF.md measures what the change saved). The
//! checksum catches truncation and corruption.

use crate::error::{Error, Result};
use crate::files::io_error;
use crate::rng::{FNV_OFFSET, fnv1a};
use serde::{Deserialize, Serialize};
use std::io::Write;
use std::path::Path;

/// The first 8 bytes of every checkpoint written now (the fuzzer restores them after mutating
/// one).
pub(crate) const MAGIC: &[u8; 8] = b"PTCKPT02";

/// The first 8 bytes of a checkpoint written before the CRC-32 (format 01: FNV-1a).
pub(crate) const MAGIC_V1: &[u8; 8] = b"PTCKPT01";

/// The checksum stored in a checkpoint's last 8 bytes, over everything before them, by the
/// format its first 8 bytes name (the fuzzer recomputes it so that mutated files reach the
/// header parser).
pub(crate) fn hash(body: &[u8]) -> u64 {
    if body.starts_with(MAGIC_V1) { fnv1a(body, FNV_OFFSET) } else { crc32fast::hash(body) as u64 }
}

/// A writer that keeps the CRC-32 of what passes through it.
struct Checksummed<W> {
    inner: W,
    crc: crc32fast::Hasher,
}

impl<W: Write> Checksummed<W> {
    fn put(&mut self, bytes: &[u8]) -> std::io::Result<()> {
        self.crc.update(bytes);
        self.inner.write_all(bytes)
    }
}

/// The name prefix of a parameter's tensor in a checkpoint (`param/` and the model's name).
pub const PARAM: &str = "param/";

/// One named f32 tensor in a checkpoint.
#[derive(Clone, Debug, PartialEq)]
pub struct Tensor {
    /// Unique name (`param/…`, `opt/…`).
    pub name: String,
    /// Values.
    pub data: Vec<f32>,
}

#[derive(Serialize, Deserialize)]
struct Header {
    meta: serde_json::Value,
    tensors: Vec<(String, usize)>,
}

fn corrupt(path: &Path, message: impl Into<String>) -> Error {
    Error::State { what: format!("checkpoint {}", path.display()), message: message.into() }
}

/// Writes `meta` and `tensors` to `path` atomically: the bytes go to a temporary sibling
/// (`.{name}.tmp-{pid}`), which is fsynced and then renamed over `path`; the directory is
/// fsynced too. The tensors stream
/// out as they are (no copy of the file in memory), checksummed on the way, past the page
/// cache ([`crate::files::write_atomic_uncached`]).
pub fn save(path: &Path, meta: &serde_json::Value, tensors: &[Tensor]) -> Result<()> {
    let header =
        Header { meta: meta.clone(), tensors: tensors.iter().map(|t| (t.name.clone(), t.data.len())).collect() };
    let header = serde_json::to_vec(&header).map_err(|e| corrupt(path, format!("cannot encode header: {e}")))?;
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).map_err(|e| io_error(dir, e))?;
    }
    crate::files::write_atomic_uncached(path, |w| {
        let mut out = Checksummed { inner: w, crc: crc32fast::Hasher::new() };
        out.put(MAGIC)?;
        out.put(&(header.len() as u64).to_le_bytes())?;
        out.put(&header)?;
        for t in tensors {
            if cfg!(target_endian = "little") {
                out.put(bytemuck::cast_slice(&t.data))?;
            } else {
                out.put(&t.data.iter().flat_map(|v| v.to_le_bytes()).collect::<Vec<u8>>())?;
            }
        }
        let sum = out.crc.finalize() as u64;
        out.inner.write_all(&sum.to_le_bytes())
    })
}

/// Reads a checkpoint written by [`save`] (format 02 or 01), verifying its magic, lengths and
/// checksum.
pub fn load(path: &Path) -> Result<(serde_json::Value, Vec<Tensor>)> {
    let bytes = std::fs::read(path).map_err(|e| io_error(path, e))?;
    if bytes.len() < 24 || (&bytes[..8] != MAGIC && &bytes[..8] != MAGIC_V1) {
        return Err(corrupt(path, "not a pipetransformer checkpoint (bad magic or too short)"));
    }
    let (body, tail) = bytes.split_at(bytes.len() - 8);
    let stored = u64::from_le_bytes(tail.try_into().map_err(|_| corrupt(path, "truncated"))?);
    if hash(body) != stored {
        return Err(corrupt(path, "hash mismatch: the file is truncated or corrupt"));
    }
    let header_len = u64::from_le_bytes(body[8..16].try_into().map_err(|_| corrupt(path, "truncated"))?) as usize;
    let data_start = 16usize
        .checked_add(header_len)
        .filter(|&e| e <= body.len())
        .ok_or_else(|| corrupt(path, "header past the end"))?;
    let header: Header =
        serde_json::from_slice(&body[16..data_start]).map_err(|e| corrupt(path, format!("bad header: {e}")))?;
    let mut offset = data_start;
    let mut tensors = Vec::with_capacity(header.tensors.len());
    for (name, len) in header.tensors {
        let end = len.checked_mul(4).and_then(|n| n.checked_add(offset)).filter(|&e| e <= body.len());
        let end = end.ok_or_else(|| corrupt(path, format!("tensor `{name}` runs past the end of the file")))?;
        let data = body[offset..end].chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect();
        tensors.push(Tensor { name, data });
        offset = end;
    }
    if offset != body.len() {
        return Err(corrupt(path, "trailing bytes after the last tensor"));
    }
    Ok((header.meta, tensors))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> (serde_json::Value, Vec<Tensor>) {
        let meta = serde_json::json!({"step": 7, "note": "x"});
        let tensors = vec![
            Tensor { name: "a".into(), data: vec![1.0, -2.5, f32::MIN_POSITIVE] },
            Tensor { name: "b".into(), data: vec![] },
            Tensor { name: "c".into(), data: vec![3.25; 5] },
        ];
        (meta, tensors)
    }

    /// [`sample`] saved as `c.ckpt` in a folder named for `test` that `save` makes, inside a
    /// scratch folder removed when the test passes: (scratch, folder, file, sample).
    fn saved(
        test: &str,
    ) -> (crate::files::Scratch, std::path::PathBuf, std::path::PathBuf, serde_json::Value, Vec<Tensor>) {
        let scratch = crate::files::Scratch::new(&format!("ckpt-{test}"));
        let dir = scratch.join(test);
        let path = dir.join("c.ckpt");
        let (meta, tensors) = sample();
        save(&path, &meta, &tensors).unwrap();
        (scratch, dir, path, meta, tensors)
    }

    #[test]
    fn round_trip_is_exact() {
        let (_scratch, dir, path, meta, tensors) = saved("round-trip");
        let (m2, t2) = load(&path).unwrap();
        assert_eq!(m2, meta);
        assert_eq!(t2, tensors);
        assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 1, "the temp file is renamed away");
    }

    /// A checkpoint of format 01 (FNV-1a checksum) still loads; with a wrong checksum for its
    /// format, neither does.
    #[test]
    fn format_01_still_loads() {
        let (_scratch, _, path, meta, tensors) = saved("v1");
        let mut bytes = std::fs::read(&path).unwrap();
        let body = bytes.len() - 8;
        assert_eq!(&bytes[..8], MAGIC);
        assert_eq!(u64::from_le_bytes(bytes[body..].try_into().unwrap()), crc32fast::hash(&bytes[..body]) as u64);
        bytes[..8].copy_from_slice(MAGIC_V1);
        std::fs::write(&path, &bytes).unwrap();
        assert!(load(&path).unwrap_err().to_string().contains("hash mismatch"), "a CRC-32 under format 01");
        // Format 01's hash is FNV-1a 64 as published (its test vector for "a"), not whatever
        // `fnv1a` computes today.
        assert_eq!(fnv1a(b"a", FNV_OFFSET), 0xaf63_dc4c_8601_ec8c);
        let sum = fnv1a(&bytes[..body], FNV_OFFSET);
        bytes[body..].copy_from_slice(&sum.to_le_bytes());
        std::fs::write(&path, &bytes).unwrap();
        let (m2, t2) = load(&path).unwrap();
        assert_eq!((m2, t2), (meta, tensors));
        bytes[..8].copy_from_slice(MAGIC);
        std::fs::write(&path, &bytes).unwrap();
        assert!(load(&path).unwrap_err().to_string().contains("hash mismatch"), "an FNV-1a under format 02");
    }

    #[test]
    fn truncated_or_corrupt_files_are_errors() {
        let (_scratch, dir, path, ..) = saved("bad");
        let good = std::fs::read(&path).unwrap();
        for (what, bytes) in [
            ("truncated", good[..good.len() - 5].to_vec()),
            ("flipped", {
                let mut b = good.clone();
                b[30] ^= 1;
                b
            }),
            ("empty", vec![]),
        ] {
            std::fs::write(&path, &bytes).unwrap();
            let err = load(&path).unwrap_err().to_string();
            assert!(err.contains("c.ckpt"), "{what}: {err}");
        }
        assert!(load(&dir.join("missing.ckpt")).unwrap_err().to_string().contains("missing.ckpt"));
    }
}
