//! AutoCache (PipeTransformer §3.4): the frozen prefix's output per sample, so a later epoch
//! starts the pipeline at the first trainable unit instead of running the frozen ones again.
//!
//! One host-memory arena (f32, or bf16 at half the bytes) up to a byte cap; entries beyond it
//! go to a spill file read through `memmap2`. An entry is keyed by the sample's stable id and
//! holds its real positions only (text batches are padded per batch, and a padded position's
//! value never reaches a real one), at one depth: when the frozen boundary moves from `a` to
//! `b`, a batch read at depth `a` runs units `a..b` and is written back at `b` in place (same
//! size), so the cache advances incrementally and never holds two depths of a sample. Frozen
//! units run without dropout, so an f32 entry is exactly what the forward would give.
//!
//! Not reused across processes: a resumed run rebuilds its cache. Each cache spills to a file
//! of its own, created new under a name no other cache uses and unlinked at once, so a second
//! process pointed at the same directory (`plan`, or a run refused because the directory holds
//! a checkpoint) never touches a live run's spill, and a killed run leaves none behind.

use crate::error::{Result, config_error};
use crate::files::io_error;
use crate::model::{Hidden, HostBatch};
use half::bf16;
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::fs::File;
use std::io::{Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

/// How cached values are stored.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CacheDtype {
    /// Exact.
    #[default]
    F32,
    /// Half the bytes; the cached value is the forward's rounded to bf16.
    Bf16,
}

impl CacheDtype {
    /// Bytes per value.
    pub fn bytes(self) -> usize {
        match self {
            CacheDtype::F32 => 4,
            CacheDtype::Bf16 => 2,
        }
    }
}

/// Where an entry's bytes are.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Place {
    Memory(usize),
    Disk(u64),
}

#[derive(Clone, Copy, Debug, PartialEq)]
struct Entry {
    /// The unit these hidden states enter.
    depth: usize,
    /// Real positions stored.
    rows: usize,
    place: Place,
}

/// A batch read from the cache: each sample's depth (the unit its states enter; `None` when
/// the cache does not hold it) and the values, `[batch, positions, width]`, zero where a sample
/// is padding or missing.
#[derive(Clone, Debug, PartialEq)]
pub struct CachedBatch {
    /// Per sample.
    pub depths: Vec<Option<usize>>,
    /// Values.
    pub data: Vec<f32>,
}

impl CachedBatch {
    /// Samples the cache held.
    pub fn held(&self) -> usize {
        self.depths.iter().flatten().count()
    }
}

/// Samples served and not served so far.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct CacheStats {
    /// Samples read from the cache.
    pub hits: usize,
    /// Samples it did not hold.
    pub misses: usize,
}

/// The spill file and its read-only map.
struct Spill {
    path: PathBuf,
    file: File,
    len: u64,
    map: Option<memmap2::Mmap>,
}

impl Spill {
    fn create(dir: &Path) -> Result<Self> {
        static CACHES: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        std::fs::create_dir_all(dir).map_err(|e| io_error(dir, e))?;
        loop {
            let n = CACHES.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            let path = dir.join(format!("activations-{}-{n}.bin", std::process::id()));
            // `create_new`: a file of that name is another cache's (a killed process's whose id
            // came round again): neither truncated nor trusted; the next name is tried.
            match File::options().read(true).write(true).create_new(true).open(&path) {
                Ok(file) => {
                    // Unlinked at once: the descriptor and the map go on working, and the
                    // system frees the bytes when the cache closes it, even in a process
                    // that is killed (no spill is left behind to pile up).
                    std::fs::remove_file(&path).map_err(|e| io_error(&path, e))?;
                    return Ok(Spill { path, file, len: 0, map: None });
                }
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => continue,
                Err(e) => return Err(io_error(&path, e)),
            }
        }
    }

    fn write(&mut self, at: u64, bytes: &[u8]) -> Result<()> {
        let io = |e| io_error(&self.path, e);
        self.file.seek(SeekFrom::Start(at)).map_err(io)?;
        self.file.write_all(bytes).map_err(|e| io_error(&self.path, e))?;
        self.len = self.len.max(at + bytes.len() as u64);
        Ok(())
    }

    fn read(&mut self, at: u64, len: usize) -> Result<&[u8]> {
        let end = at + len as u64;
        if self.map.as_ref().is_none_or(|m| (m.len() as u64) < end) {
            // SAFETY: the file is this cache's own, created new and unlinked at once (no other
            // process can open it), and only ever grown by it; nothing truncates it while the map lives. Writes after
            // mapping go through the same page cache, so the map sees them.
            self.map = Some(unsafe { memmap2::Mmap::map(&self.file) }.map_err(|e| io_error(&self.path, e))?);
        }
        let map = self.map.as_ref().map(|m| &m[..]).unwrap_or_default();
        Ok(&map[at as usize..end as usize])
    }
}

/// The frozen-activation cache.
pub struct ActivationCache {
    width: usize,
    dtype: CacheDtype,
    cap: usize,
    arena: Vec<u8>,
    index: HashMap<u64, Entry>,
    dir: PathBuf,
    spill: Option<Spill>,
    /// Whole-batch hits and misses since the last [`take_stats`](Self::take_stats).
    stats: CacheStats,
}

impl ActivationCache {
    /// A cache of `width`-wide hidden states holding at most `cap` bytes in memory, spilling to
    /// `dir`. `batch_bytes` is one batch's largest size: a cap below it is refused, as is a
    /// directory that cannot be written (checked now, before training starts).
    pub fn new(width: usize, dtype: CacheDtype, cap: usize, batch_bytes: usize, dir: &Path) -> Result<Self> {
        if cap < batch_bytes {
            return Err(config_error(
                "elastic.cache_bytes",
                format!("{cap} bytes cannot hold one batch ({batch_bytes} bytes); raise it or turn the cache off"),
            ));
        }
        if dir.exists() && !dir.is_dir() {
            return Err(config_error(
                "elastic.cache_dir",
                format!("{} is a file; expected a folder for the cache's spill file", dir.display()),
            ));
        }
        // Folders made only for this check go again (the spill file is unlinked at once, and
        // its folder made again if it is ever replaced): a run refused before it trains, or
        // `plan`, leaves no empty folder behind.
        let made =
            dir.ancestors().take_while(|a| !a.as_os_str().is_empty() && !a.exists()).last().map(Path::to_path_buf);
        let spill =
            Spill::create(dir).map_err(|e| config_error("elastic.cache_dir", format!("cannot be written: {e}")))?;
        if let Some(top) = made {
            for d in dir.ancestors() {
                if std::fs::remove_dir(d).is_err() || d == top {
                    break;
                }
            }
        }
        Ok(Self {
            width,
            dtype,
            cap,
            arena: Vec::new(),
            index: HashMap::new(),
            dir: dir.to_path_buf(),
            spill: Some(spill),
            stats: CacheStats::default(),
        })
    }

    /// Samples held.
    pub fn entries(&self) -> usize {
        self.index.len()
    }

    /// Bytes in host memory.
    pub fn memory_bytes(&self) -> usize {
        self.arena.len()
    }

    /// Bytes in the spill file.
    pub fn disk_bytes(&self) -> usize {
        self.spill.as_ref().map_or(0, |s| s.len as usize)
    }

    /// The memory cap.
    pub fn cap(&self) -> usize {
        self.cap
    }

    /// Hits and misses since the last call; counting starts again.
    pub fn take_stats(&mut self) -> CacheStats {
        std::mem::take(&mut self.stats)
    }

    /// Forgets every entry (a new run, a model whose frozen prefix changed under it, or a cache
    /// switched off), and gives its memory back. The spill file goes too; the next entry past
    /// the cap makes a new one (until then, no folder is made for it: a resumed run that never
    /// spills leaves none).
    pub fn clear(&mut self) {
        self.index.clear();
        self.arena = Vec::new();
        self.spill = None;
    }

    /// Real positions of each sample of `host`: the leading ones of its attention mask (text
    /// batches pad at the end), else all.
    pub fn rows_of(host: &HostBatch, positions: usize) -> Vec<usize> {
        match &host.attention_mask {
            Some(m) if host.seq == positions => {
                m.chunks(positions.max(1)).map(|row| row.iter().take_while(|&&v| v != 0).count()).collect()
            }
            _ => vec![positions; host.batch],
        }
    }

    /// What the cache holds of the batch at depths of at most `max_depth` (samples may differ
    /// in depth after a boundary moved mid-epoch), padded to `positions` with zeros; `None` when
    /// the batch carries no sample ids. Whether the step uses it is the caller's to
    /// [`record`](Self::record).
    pub fn get(&mut self, host: &HostBatch, positions: usize, max_depth: usize) -> Result<Option<CachedBatch>> {
        if host.sample_ids.len() != host.batch {
            return Ok(None);
        }
        let rows = Self::rows_of(host, positions);
        let entries: Vec<Option<Entry>> = host
            .sample_ids
            .iter()
            .zip(&rows)
            .map(|(id, &r)| self.index.get(id).copied().filter(|e| e.depth <= max_depth && e.rows == r))
            .collect();
        let w = self.width;
        let mut data = vec![0f32; host.batch * positions * w];
        for (i, e) in entries.iter().enumerate() {
            let Some(e) = e else { continue };
            let bytes = e.rows * w * self.dtype.bytes();
            let src = match e.place {
                Place::Memory(at) => &self.arena[at..at + bytes],
                Place::Disk(at) => self.spill.as_mut().map(|s| s.read(at, bytes)).transpose()?.unwrap_or_default(),
            };
            decode(self.dtype, src, &mut data[i * positions * w..][..e.rows * w]);
        }
        let depths: Vec<Option<usize>> = entries.iter().map(|e| e.map(|e| e.depth)).collect();
        Ok(Some(CachedBatch { depths, data }))
    }

    /// Counts a step's samples: `hits` served from the cache, `misses` run through the frozen
    /// units (also those it held, when the step did not use it).
    pub fn record(&mut self, hits: usize, misses: usize) {
        self.stats.hits += hits;
        self.stats.misses += misses;
    }

    /// Stores each sample's real positions of `hidden` (the batch's frozen-prefix output),
    /// replacing what it held: in place when the sample was there (same size), else in memory
    /// while under the cap, else in the spill file.
    pub fn put(&mut self, host: &HostBatch, hidden: &Hidden) -> Result<()> {
        if host.sample_ids.len() != host.batch || hidden.width != self.width || host.batch == 0 {
            return Ok(());
        }
        let positions = hidden.data.len() / (host.batch * self.width);
        let rows = Self::rows_of(host, positions);
        let w = self.width;
        let mut bytes = Vec::new();
        for (i, (&id, &r)) in host.sample_ids.iter().zip(&rows).enumerate() {
            bytes.clear();
            encode(self.dtype, &hidden.data[i * positions * w..][..r * w], &mut bytes);
            let place = match self.index.get(&id) {
                Some(e) if e.rows == r => e.place,
                _ if self.arena.len() + bytes.len() <= self.cap => {
                    self.arena.resize(self.arena.len() + bytes.len(), 0);
                    Place::Memory(self.arena.len() - bytes.len())
                }
                _ => Place::Disk(self.spill.as_ref().map_or(0, |s| s.len)),
            };
            match place {
                Place::Memory(at) => self.arena[at..at + bytes.len()].copy_from_slice(&bytes),
                Place::Disk(at) => {
                    let spill = match &mut self.spill {
                        Some(s) => s,
                        None => self.spill.insert(Spill::create(&self.dir)?),
                    };
                    spill.write(at, &bytes)?;
                }
            }
            self.index.insert(id, Entry { depth: hidden.depth, rows: r, place });
        }
        Ok(())
    }

    /// Seconds to read and decode one batch of `values` cached values (the profiler that
    /// decides whether the cache pays): measured on a scratch buffer of that size.
    pub fn measure_read(&self, values: usize) -> f64 {
        let mut src = Vec::new();
        encode(self.dtype, &vec![0.5f32; values], &mut src);
        let mut out = vec![0f32; values];
        let start = std::time::Instant::now();
        for _ in 0..3 {
            decode(self.dtype, std::hint::black_box(&src), &mut out);
        }
        std::hint::black_box(&out);
        start.elapsed().as_secs_f64() / 3.0
    }
}

fn encode(dtype: CacheDtype, values: &[f32], out: &mut Vec<u8>) {
    match dtype {
        CacheDtype::F32 => out.extend(values.iter().flat_map(|v| v.to_le_bytes())),
        CacheDtype::Bf16 => out.extend(values.iter().flat_map(|&v| bf16::from_f32(v).to_le_bytes())),
    }
}

fn decode(dtype: CacheDtype, bytes: &[u8], out: &mut [f32]) {
    match dtype {
        CacheDtype::F32 => {
            for (o, c) in out.iter_mut().zip(bytes.chunks_exact(4)) {
                *o = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
            }
        }
        CacheDtype::Bf16 => {
            for (o, c) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                *o = bf16::from_le_bytes([c[0], c[1]]).to_f32();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A test's own temp folder; the cache directory is a subfolder of it that does not exist
    /// yet (the cache makes it).
    fn scratch(name: &str) -> crate::files::Scratch {
        crate::files::Scratch::new(&format!("cache-{name}"))
    }

    /// A text-like batch: `ids`, `seq` positions, sample i real for `lens[i]` of them.
    fn batch(ids: &[u64], lens: &[usize], seq: usize) -> HostBatch {
        let mask = lens.iter().flat_map(|&l| (0..seq).map(move |p| (p < l) as u32)).collect();
        HostBatch { batch: ids.len(), seq, attention_mask: Some(mask), sample_ids: ids.to_vec(), ..Default::default() }
    }

    fn hidden(depth: usize, n: usize, seq: usize, w: usize, salt: f32) -> Hidden {
        let data = (0..n * seq * w).map(|i| (i as f32 * 0.37 + salt).sin() * 1e3).collect();
        Hidden { depth, width: w, data }
    }

    /// The real positions of sample `i`, zeros elsewhere.
    fn masked(h: &Hidden, lens: &[usize], seq: usize) -> Vec<f32> {
        let w = h.width;
        let mut out = vec![0.0; h.data.len()];
        for (i, &l) in lens.iter().enumerate() {
            out[i * seq * w..][..l * w].copy_from_slice(&h.data[i * seq * w..][..l * w]);
        }
        out
    }

    #[test]
    fn spilled_entries_read_back_bitwise_and_the_cap_holds() {
        let w = 3;
        let one = 5 * 4 * w * 4; // one batch: 4 samples × 5 positions
        let scratch = scratch("spill");
        let d = scratch.join("cache");
        // Room for about one and a half batches in memory: the rest spills.
        let mut cache = ActivationCache::new(w, CacheDtype::F32, one + one / 2, one, &d).unwrap();
        let lens = [5, 2, 4, 1];
        let mut stored = Vec::new();
        for b in 0..4u64 {
            let ids: Vec<u64> = (0..4).map(|i| 100 * b + i).collect();
            let host = batch(&ids, &lens, 5);
            let h = hidden(3, 4, 5, w, b as f32);
            cache.put(&host, &h).unwrap();
            assert!(cache.memory_bytes() <= cache.cap(), "batch {b}: {} bytes in memory", cache.memory_bytes());
            stored.push((host, h));
        }
        assert!(cache.disk_bytes() > 0, "something spilled");
        // The spill is unlinked, and its folder, made for it, gone again: a killed run, or one
        // refused before it trains, leaves neither.
        assert!(!d.exists() && scratch.exists(), "{} is left", d.display());
        std::fs::create_dir(&d).unwrap();
        assert_eq!(cache.entries(), 16);
        // A second cache spilling into the same directory (another process's `plan`, or a run
        // refused at start) comes and goes without touching this one's spill.
        let mut other = ActivationCache::new(w, CacheDtype::F32, 0, 0, &d).unwrap();
        other.put(&stored[0].0, &hidden(3, 4, 5, w, 7.0)).unwrap();
        assert!(other.disk_bytes() > 0);
        drop(other);
        assert!(std::fs::read_dir(&d).unwrap().next().is_none(), "a folder that was there stays, empty");
        for (host, h) in &stored {
            let got = cache.get(host, 5, 3).unwrap().unwrap();
            assert_eq!(got.depths, [Some(3); 4]);
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&got.data), bits(&masked(h, &lens, 5)));
        }
        // Deeper than allowed, or a stranger in the batch: not held.
        assert_eq!(cache.get(&stored[0].0, 5, 2).unwrap().unwrap().held(), 0);
        let strangers = cache.get(&batch(&[0, 1, 2, 999], &lens, 5), 5, 3).unwrap().unwrap();
        assert_eq!(strangers.depths, [Some(3), Some(3), Some(3), None]);
        assert_eq!(&strangers.data[..3 * 5 * w], &masked(&stored[0].1, &lens, 5)[..3 * 5 * w]);
        assert_eq!(cache.take_stats(), CacheStats::default(), "reading counts nothing; the step records");
        // Advancing in place: a new depth, the same bytes.
        let (host, _) = &stored[3];
        let deeper = hidden(5, 4, 5, w, 9.0);
        let (mem, disk) = (cache.memory_bytes(), cache.disk_bytes());
        cache.put(host, &deeper).unwrap();
        assert_eq!((cache.memory_bytes(), cache.disk_bytes()), (mem, disk), "no second copy");
        let got = cache.get(host, 5, 5).unwrap().unwrap();
        assert_eq!((got.depths, got.data), (vec![Some(5); 4], masked(&deeper, &lens, 5)));
        // One sample advanced alone: the batch reads back at mixed depths.
        let one = host.select(&[2]).unwrap();
        cache.put(&one, &hidden(7, 1, 5, w, 4.0)).unwrap();
        assert_eq!(cache.get(host, 5, 7).unwrap().unwrap().depths, [Some(5), Some(5), Some(7), Some(5)]);
        drop(cache);
        assert!(std::fs::read_dir(&d).unwrap().next().is_none(), "the spill file goes with the cache");
    }

    /// A resumed run clears its cache: no folder is made for a spill until something spills
    /// (every resume left an empty `cache/` in the run's folder); then the entries past the
    /// cap spill to a new file and read back.
    #[test]
    fn a_cleared_cache_makes_its_spill_only_when_it_spills() {
        let w = 2;
        let scratch = scratch("cleared");
        let d = scratch.join("cache");
        let mut cache = ActivationCache::new(w, CacheDtype::F32, 0, 0, &d).unwrap();
        cache.clear();
        assert!(!d.exists(), "{} made by clear", d.display());
        let host = batch(&[1, 2], &[3, 2], 3);
        let h = hidden(2, 2, 3, w, 1.0);
        cache.put(&host, &h).unwrap();
        assert!(cache.disk_bytes() > 0 && cache.entries() == 2);
        assert_eq!(cache.get(&host, 3, 2).unwrap().unwrap().data, masked(&h, &[3, 2], 3));
    }

    #[test]
    fn bf16_entries_are_the_values_rounded() {
        let scratch = scratch("bf16");
        let d = scratch.join("cache");
        let mut cache = ActivationCache::new(2, CacheDtype::Bf16, 1 << 20, 0, &d).unwrap();
        let host = batch(&[1, 2], &[3, 3], 3);
        let h = hidden(1, 2, 3, 2, 0.0);
        cache.put(&host, &h).unwrap();
        assert_eq!(cache.memory_bytes(), 2 * 3 * 2 * 2);
        let got = cache.get(&host, 3, 1).unwrap().unwrap();
        let want: Vec<f32> = h.data.iter().map(|&v| bf16::from_f32(v).to_f32()).collect();
        assert_eq!(got.data, want);
    }

    #[test]
    fn a_cap_below_one_batch_or_an_unwritable_directory_is_refused() {
        let scratch = scratch("refused");
        let e = ActivationCache::new(4, CacheDtype::F32, 100, 101, &scratch.join("small")).err().unwrap().to_string();
        assert!(e.contains("elastic.cache_bytes") && e.contains("101 bytes"), "{e}");
        let file = scratch.join("file");
        std::fs::write(&file, b"x").unwrap();
        let e = ActivationCache::new(4, CacheDtype::F32, 1 << 20, 0, &file.join("sub")).err().unwrap().to_string();
        assert!(e.contains("elastic.cache_dir") && e.contains("cannot be written"), "{e}");
        let e = ActivationCache::new(4, CacheDtype::F32, 1 << 20, 0, &file).err().unwrap().to_string();
        assert!(e.contains("elastic.cache_dir") && e.contains("is a file; expected a folder"), "{e}");
        assert_eq!(std::fs::read(&file).unwrap(), b"x");
    }
}
