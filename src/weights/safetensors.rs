//! The safetensors format, read through a memory map and written from host slices.
//!
//! A file is an 8-byte little-endian header length `N`, `N` bytes of JSON mapping each tensor
//! name to `{"dtype", "shape", "data_offsets": [begin, end]}` (offsets relative to the end of
//! the header) plus an optional `"__metadata__"` string map, then the raw little-endian data.
//!
//! The header is parsed here rather than through the `safetensors` crate so that every error
//! can name the file and the tensor, and so that a tensor of a dtype we cannot convert can still
//! be listed (and ignored) instead of failing the whole file.

use std::collections::BTreeMap;
use std::fmt;
use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};

use memmap2::Mmap;
use serde_json::Value;

use crate::error::{Error, Result};

/// Element type of a stored tensor, as spelled in the header.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Dtype {
    /// 32-bit IEEE float.
    F32,
    /// 16-bit IEEE float.
    F16,
    /// bfloat16.
    BF16,
    /// 64-bit IEEE float.
    F64,
    /// Another type the format knows (integers, booleans, 8-bit floats): listed, never
    /// converted. Holds the header's spelling and the element size in bits, if known.
    Other(String, Option<usize>),
}

impl Dtype {
    /// Parses the header's spelling (`"F32"`, `"I64"`, …).
    pub fn parse(s: &str) -> Self {
        match s {
            "F32" => Dtype::F32,
            "F16" => Dtype::F16,
            "BF16" => Dtype::BF16,
            "F64" => Dtype::F64,
            other => {
                let bits = match other {
                    "BOOL" | "U8" | "I8" | "F8_E4M3" | "F8_E5M2" | "F8_E8M0" => Some(8),
                    "I16" | "U16" => Some(16),
                    "I32" | "U32" => Some(32),
                    "I64" | "U64" | "C64" => Some(64),
                    // Sub-byte types (F4, F6_*) and unknown names: sizes are not checked.
                    _ => None,
                };
                Dtype::Other(other.to_string(), bits)
            }
        }
    }

    /// Bytes per element, when it is a whole number of bytes we know.
    pub fn size(&self) -> Option<usize> {
        match self {
            Dtype::F32 => Some(4),
            Dtype::F16 | Dtype::BF16 => Some(2),
            Dtype::F64 => Some(8),
            Dtype::Other(_, bits) => bits.map(|b| b / 8),
        }
    }

    /// Whether [`TensorFile::read_f32`] can convert it.
    pub fn is_float(&self) -> bool {
        !matches!(self, Dtype::Other(..))
    }
}

impl fmt::Display for Dtype {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Dtype::F32 => f.write_str("F32"),
            Dtype::F16 => f.write_str("F16"),
            Dtype::BF16 => f.write_str("BF16"),
            Dtype::F64 => f.write_str("F64"),
            Dtype::Other(s, _) => f.write_str(s),
        }
    }
}

/// One tensor's header entry.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorInfo {
    /// Name as stored in the file.
    pub name: String,
    /// Element type.
    pub dtype: Dtype,
    /// Shape (empty for a scalar).
    pub shape: Vec<usize>,
    /// Byte range inside the data section.
    pub data: std::ops::Range<usize>,
}

impl TensorInfo {
    /// Number of elements.
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }
}

/// An open safetensors file: the memory map and its parsed header. Tensor data is read from
/// the map on demand, so opening a 90 MB checkpoint costs only the header parse.
pub struct TensorFile {
    path: PathBuf,
    map: Mmap,
    /// Offset of the data section in the file (`8 + header length`).
    data_start: usize,
    tensors: Vec<TensorInfo>,
    metadata: BTreeMap<String, String>,
}

/// Builds an [`Error::Weights`].
pub(crate) fn weights_error(path: &Path, tensor: Option<&str>, message: impl Into<String>) -> Error {
    Error::Weights { file: path.display().to_string(), tensor: tensor.map(str::to_string), message: message.into() }
}

/// Opens and validates a safetensors file: the header must be JSON, every tensor's byte range
/// must lie inside the file and hold exactly `numel · element size` bytes. Errors name the file
/// and, where one is to blame, the tensor.
pub fn load_safetensors(path: impl AsRef<Path>) -> Result<TensorFile> {
    let path = path.as_ref();
    let io = |source| crate::files::io_error(path, source);
    let file = File::open(path).map_err(io)?;
    let len = file.metadata().map_err(io)?.len();
    if len < 8 {
        return Err(weights_error(
            path,
            None,
            format!("file is {len} bytes; expected at least the 8-byte header length"),
        ));
    }
    // SAFETY: the map is read-only and private to this process. Memory-mapping is unsound only
    // if another process truncates or rewrites the file while it is mapped; checkpoints are
    // written once (our exporter writes a temp file and renames it over, which leaves an
    // existing map pointing at the old inode), so we accept that as the cost of not copying
    // the weights into memory twice.
    let map = unsafe { Mmap::map(&file) }.map_err(io)?;
    let data_start = {
        let mut n = [0u8; 8];
        n.copy_from_slice(&map[..8]);
        let n = u64::from_le_bytes(n);
        let avail = map.len() as u64 - 8;
        // The `safetensors` library's own bound: no real header comes near it, and a hostile
        // one must not make us parse gigabytes of JSON.
        const MOST_HEADER: u64 = 100_000_000;
        if n > MOST_HEADER {
            return Err(weights_error(
                path,
                None,
                format!("header length {n} bytes; expected at most {MOST_HEADER} (the safetensors format's bound)"),
            ));
        }
        if n > avail {
            return Err(weights_error(
                path,
                None,
                format!("header length {n} runs past the end of the file ({} bytes after the length field)", avail),
            ));
        }
        8 + n as usize
    };
    let header = std::str::from_utf8(&map[8..data_start])
        .map_err(|e| weights_error(path, None, format!("header is not UTF-8: {e}")))?;
    let header: Value = serde_json::from_str(header)
        .map_err(|e| weights_error(path, None, format!("header is not valid JSON: {e}")))?;
    let Value::Object(entries) = header else {
        return Err(weights_error(path, None, "header is not a JSON object"));
    };
    let data_len = map.len() - data_start;
    let mut tensors = Vec::with_capacity(entries.len());
    let mut metadata = BTreeMap::new();
    for (name, entry) in entries {
        if name == "__metadata__" {
            if let Value::Object(m) = entry {
                for (k, v) in m {
                    if let Value::String(s) = v {
                        metadata.insert(k, s);
                    }
                }
            }
            continue;
        }
        tensors.push(parse_entry(path, &name, &entry, data_len)?);
    }
    // The header is a JSON object, so its order is not meaningful; keep the data order, which
    // is the order writers emit and the one a reader streams best.
    tensors.sort_by_key(|t| (t.data.start, t.data.end, t.name.clone()));
    // As the `safetensors` library requires: the tensors tile the data section exactly. An
    // overlap would make two parameters alias the same bytes; a gap or a tail holds bytes no
    // tensor names.
    let mut at = 0;
    for t in &tensors {
        if t.data.start != at {
            let what = if t.data.start < at { "overlaps the tensor before it" } else { "leaves a gap before it" };
            return Err(weights_error(
                path,
                Some(&t.name),
                format!(
                    "data_offsets [{}, {}) {what} (which ends at {at}); expected tensors that tile the data section",
                    t.data.start, t.data.end
                ),
            ));
        }
        at = t.data.end;
    }
    if at != data_len {
        return Err(weights_error(
            path,
            None,
            format!("the tensors end at byte {at} of a {data_len}-byte data section; expected them to cover it"),
        ));
    }
    Ok(TensorFile { path: path.to_path_buf(), map, data_start, tensors, metadata })
}

fn parse_entry(path: &Path, name: &str, entry: &Value, data_len: usize) -> Result<TensorInfo> {
    let err = |m: String| weights_error(path, Some(name), m);
    let dtype = entry
        .get("dtype")
        .and_then(Value::as_str)
        .map(Dtype::parse)
        .ok_or_else(|| err("header entry has no string `dtype`".into()))?;
    let shape = entry
        .get("shape")
        .and_then(Value::as_array)
        .ok_or_else(|| err("header entry has no `shape` array".into()))?
        .iter()
        .map(|d| d.as_u64().map(|d| d as usize))
        .collect::<Option<Vec<usize>>>()
        .ok_or_else(|| err("`shape` holds something other than non-negative integers".into()))?;
    let offsets = entry
        .get("data_offsets")
        .and_then(Value::as_array)
        .filter(|a| a.len() == 2)
        .and_then(|a| Some((a[0].as_u64()? as usize, a[1].as_u64()? as usize)))
        .ok_or_else(|| err("header entry has no `data_offsets` pair of integers".into()))?;
    let (begin, end) = offsets;
    if begin > end {
        return Err(err(format!("data_offsets [{begin}, {end}) are reversed")));
    }
    if end > data_len {
        return Err(err(format!(
            "data_offsets [{begin}, {end}) run past the end of the data section ({data_len} bytes): the file is truncated"
        )));
    }
    let numel = shape.iter().try_fold(1usize, |acc, &d| acc.checked_mul(d));
    if let (Some(size), Some(numel)) = (dtype.size(), numel) {
        let want = numel.checked_mul(size);
        if want != Some(end - begin) {
            return Err(err(format!(
                "data_offsets [{begin}, {end}) hold {} bytes; dtype {dtype} and shape {shape:?} need {}",
                end - begin,
                want.map_or("more than usize::MAX".to_string(), |w| w.to_string())
            )));
        }
    } else if numel.is_none() {
        return Err(err(format!("shape {shape:?} has more elements than fit in memory")));
    }
    Ok(TensorInfo { name: name.to_string(), dtype, shape, data: begin..end })
}

impl TensorFile {
    /// The file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Every tensor in the file, in data order.
    pub fn tensors(&self) -> &[TensorInfo] {
        &self.tensors
    }

    /// The tensor called `name`, if present.
    pub fn get(&self, name: &str) -> Option<&TensorInfo> {
        self.tensors.iter().find(|t| t.name == name)
    }

    /// The header's `__metadata__` map (e.g. `format: pt`).
    pub fn metadata(&self) -> &BTreeMap<String, String> {
        &self.metadata
    }

    /// The raw little-endian bytes of a tensor, borrowed from the map.
    pub fn bytes(&self, info: &TensorInfo) -> &[u8] {
        &self.map[self.data_start + info.data.start..self.data_start + info.data.end]
    }

    /// A tensor converted to f32 (F16/BF16 widen exactly; F64 rounds to nearest). Errors, naming
    /// the file and tensor, for a dtype that is not a float.
    pub fn read_f32(&self, info: &TensorInfo) -> Result<Vec<f32>> {
        let b = self.bytes(info);
        // `chunks_exact` + `from_le_bytes` rather than a pointer cast: the data section need not
        // be aligned (the header length is arbitrary), and this also fixes the byte order.
        Ok(match &info.dtype {
            Dtype::F32 => b.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect(),
            Dtype::F16 => b.chunks_exact(2).map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32()).collect(),
            Dtype::BF16 => b.chunks_exact(2).map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32()).collect(),
            Dtype::F64 => self.read_f64(info)?.into_iter().map(|x| x as f32).collect(),
            Dtype::Other(..) => return Err(self.unsupported_dtype(info)),
        })
    }

    /// A tensor converted to f64 (exact for every float dtype), for f64 devices.
    pub fn read_f64(&self, info: &TensorInfo) -> Result<Vec<f64>> {
        let b = self.bytes(info);
        match &info.dtype {
            Dtype::F64 => Ok(b
                .chunks_exact(8)
                .map(|c| f64::from_le_bytes([c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7]]))
                .collect()),
            Dtype::Other(..) => Err(self.unsupported_dtype(info)),
            _ => Ok(self.read_f32(info)?.into_iter().map(f64::from).collect()),
        }
    }

    fn unsupported_dtype(&self, info: &TensorInfo) -> Error {
        weights_error(
            &self.path,
            Some(&info.name),
            format!("dtype {} cannot be loaded into a model weight; expected F32, F16, BF16 or F64", info.dtype),
        )
    }
}

/// One tensor to write: name, shape and f32 values.
pub struct TensorRef<'a> {
    /// Name in the header.
    pub name: &'a str,
    /// Shape.
    pub shape: &'a [usize],
    /// Values, row-major; `shape`'s product of them.
    pub values: &'a [f32],
}

/// Serialises f32 tensors into `out` as safetensors, with `__metadata__ = {format: pt}` (what
/// `transformers` expects of a PyTorch checkpoint). Tensors are laid out in the given order;
/// the header is padded with spaces to a multiple of 8 bytes so the data section is aligned
/// for readers that map it in place.
pub fn write_safetensors(out: &mut impl Write, tensors: &[TensorRef<'_>]) -> std::io::Result<()> {
    let mut header = serde_json::Map::new();
    header.insert("__metadata__".into(), serde_json::json!({ "format": "pt" }));
    let mut offset = 0usize;
    for t in tensors {
        if header.contains_key(t.name) {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                format!("tensor `{}` is named twice; expected distinct names", t.name),
            ));
        }
        let n: usize = t.shape.iter().product();
        if n != t.values.len() {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                format!("tensor `{}`: shape {:?} needs {n} values, got {}", t.name, t.shape, t.values.len()),
            ));
        }
        let end = offset + 4 * n;
        header.insert(
            t.name.to_string(),
            serde_json::json!({ "dtype": "F32", "shape": t.shape, "data_offsets": [offset, end] }),
        );
        offset = end;
    }
    let mut json = serde_json::to_vec(&Value::Object(header)).map_err(std::io::Error::other)?;
    while json.len() % 8 != 0 {
        json.push(b' ');
    }
    out.write_all(&(json.len() as u64).to_le_bytes())?;
    out.write_all(&json)?;
    for t in tensors {
        if cfg!(target_endian = "little") {
            // The values' own bytes: no copy of a 47 MB word table on its way out.
            out.write_all(bytemuck::cast_slice(t.values))?;
        } else {
            out.write_all(&t.values.iter().flat_map(|v| v.to_le_bytes()).collect::<Vec<u8>>())?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `bytes` in a file `name` of a fresh folder, which goes when the folder is dropped.
    fn temp_file(name: &str, bytes: &[u8]) -> (crate::testing::Scratch, PathBuf) {
        let dir = crate::testing::Scratch::new("weights-unit");
        let p = dir.join(name);
        std::fs::write(&p, bytes).unwrap();
        (dir, p)
    }

    #[test]
    fn write_then_read_f32() {
        let a = [1.5f32, -2.0, 3.25, 0.0, f32::MIN_POSITIVE, 7.0];
        let b = [9.0f32];
        let mut buf = Vec::new();
        write_safetensors(
            &mut buf,
            &[TensorRef { name: "a", shape: &[2, 3], values: &a }, TensorRef { name: "b", shape: &[], values: &b }],
        )
        .unwrap();
        assert_eq!(u64::from_le_bytes(buf[..8].try_into().unwrap()) % 8, 0);
        let (_dir, path) = temp_file("rw.safetensors", &buf);
        let f = load_safetensors(path).unwrap();
        assert_eq!(f.metadata().get("format").map(String::as_str), Some("pt"));
        let names: Vec<_> = f.tensors().iter().map(|t| t.name.as_str()).collect();
        assert_eq!(names, ["a", "b"]);
        let ta = f.get("a").unwrap();
        assert_eq!(ta.shape, [2, 3]);
        assert_eq!(f.read_f32(ta).unwrap(), a);
        assert_eq!(f.read_f32(f.get("b").unwrap()).unwrap(), b);
    }

    /// F16, BF16 and F64 convert; integer types are listed but refuse conversion.
    #[test]
    fn dtype_conversions() {
        let f16s: Vec<u8> = [1.0f32, -0.5].iter().flat_map(|&x| half::f16::from_f32(x).to_le_bytes()).collect();
        let bf16s: Vec<u8> = [2.0f32, 0.25].iter().flat_map(|&x| half::bf16::from_f32(x).to_le_bytes()).collect();
        let f64s: Vec<u8> = [0.1f64].iter().flat_map(|x| x.to_le_bytes()).collect();
        let i64s: Vec<u8> = 5i64.to_le_bytes().to_vec();
        let header = serde_json::json!({
            "h": {"dtype": "F16", "shape": [2], "data_offsets": [0, 4]},
            "b": {"dtype": "BF16", "shape": [2], "data_offsets": [4, 8]},
            "d": {"dtype": "F64", "shape": [1], "data_offsets": [8, 16]},
            "i": {"dtype": "I64", "shape": [1, 1], "data_offsets": [16, 24]},
        })
        .to_string();
        let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
        bytes.extend_from_slice(header.as_bytes());
        for part in [&f16s, &bf16s, &f64s, &i64s] {
            bytes.extend_from_slice(part);
        }
        let (_dir, path) = temp_file("dtypes.safetensors", &bytes);
        let f = load_safetensors(path).unwrap();
        assert_eq!(f.read_f32(f.get("h").unwrap()).unwrap(), [1.0, -0.5]);
        assert_eq!(f.read_f32(f.get("b").unwrap()).unwrap(), [2.0, 0.25]);
        assert_eq!(f.read_f64(f.get("d").unwrap()).unwrap(), [0.1]);
        assert_eq!(f.read_f32(f.get("d").unwrap()).unwrap(), [0.1f32]);
        let i = f.get("i").unwrap();
        assert_eq!(i.dtype, Dtype::Other("I64".into(), Some(64)));
        let e = f.read_f32(i).unwrap_err().to_string();
        assert!(e.contains("`i`") && e.contains("I64") && e.contains("expected F32"), "{e}");
    }

    #[test]
    fn tensors_that_do_not_tile_the_data_are_refused() {
        let file = |name: &str, header: &str, data: usize| {
            let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
            bytes.extend_from_slice(header.as_bytes());
            bytes.extend(vec![0; data]);
            let (_dir, path) = temp_file(name, &bytes);
            load_safetensors(path).err().map(|e| e.to_string()).unwrap_or_default()
        };
        let two = |b: &str| {
            format!(
                r#"{{"a":{{"dtype":"F32","shape":[2],"data_offsets":[0,8]}},"b":{{"dtype":"F32","shape":[1],"data_offsets":{b}}}}}"#
            )
        };
        let e = file("overlap.safetensors", &two("[4,8]"), 8);
        assert!(e.contains("`b`") && e.contains("overlaps the tensor before it"), "{e}");
        let e = file("gap.safetensors", &two("[12,16]"), 16);
        assert!(e.contains("`b`") && e.contains("leaves a gap"), "{e}");
        let e = file("tail.safetensors", &two("[8,12]"), 16);
        assert!(e.contains("the tensors end at byte 12 of a 16-byte data section"), "{e}");
        assert_eq!(file("tiled.safetensors", &two("[8,12]"), 12), "");
        let mut out = Vec::new();
        let twice =
            [TensorRef { name: "a", shape: &[], values: &[1.0] }, TensorRef { name: "a", shape: &[], values: &[2.0] }];
        let e = write_safetensors(&mut out, &twice).unwrap_err().to_string();
        assert!(e.contains("`a` is named twice"), "{e}");
    }

    #[test]
    fn byte_count_must_match_shape() {
        let header = r#"{"w":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}}"#;
        let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
        bytes.extend_from_slice(header.as_bytes());
        bytes.extend_from_slice(&[0; 8]);
        let (_dir, path) = temp_file("count.safetensors", &bytes);
        let e = load_safetensors(path).err().unwrap().to_string();
        assert!(e.contains("`w`") && e.contains("hold 8 bytes") && e.contains("need 12"), "{e}");
    }
}
