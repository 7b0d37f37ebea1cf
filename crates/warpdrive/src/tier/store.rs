//! [`TierStore`]: blocks by key on the GPU, in pinned host memory and on disk.
//!
//! A put lands in the highest tier with room (the GPU, then pinned host memory); a tier
//! that would fill past its high watermark first moves unpinned blocks one tier down, in
//! CLOCK order, until it is back at its low one: GPU → host is a DMA into a pinned block,
//! host → disk an encoded block appended to the current data segment (unless the block is on
//! disk already). A get promotes what it finds to the GPU. Durability is per put:
//! `Memory` blocks reach the disk only when evicted, `Disk` ones are written at once,
//! `Sync` ones are synced (data, then the index record) before the put returns.
//!
//! On disk: data segments `data-<n>.seg` (blocks framed by [`codec`](super::codec), each
//! checksummed and verified on every read) and the index log ([`IndexLog`]). A reopened store
//! starts a new segment and drops index entries whose bytes run past their segment's end
//! (a crash between a block's write and its sync).
//!
//! What "a data file written under a temporary name and renamed" means here: a segment is an
//! append-only file, and a block in it counts only once the index points at it (a torn
//! append is dropped on reopen, above), so appends go in place. A file written whole, the
//! segment a compaction rewrites live blocks into, is written as `data-<n>.seg.tmp`, synced,
//! renamed and its folder synced before any index record names it; reopening removes a
//! leftover `.seg.tmp` (see `compact`).

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use parking_lot::Mutex;

use crate::device::Stream;
use crate::error::{Error, Result};
use crate::memory::{Buffer, PinnedBuf};
use crate::ops;
use crate::transfer;

use super::codec::{self, Compression, Filter};
use super::disk::{Disk, DiskIo, Io, OsDisk};
use super::log::{IndexLog, Location, Record};
use super::moves::Moves;
use super::policy::{Budget, Clock};
use super::prefetch::{Detector, Prefetch};

mod compact;
mod disk_io;

/// The largest block a store takes.
pub const MAX_BLOCK: usize = 256 << 20;
/// The longest key.
pub const MAX_KEY: usize = 1024;

/// How a store is laid out.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TierConfig {
    /// Device memory for blocks (0: no GPU tier).
    pub gpu: Budget,
    /// Pinned host memory for blocks (0: no host tier).
    pub host: Budget,
    /// How blocks are compressed on disk (the seed: lz4, zstd for cold data).
    pub disk_compression: Compression,
    pub disk_filter: Filter,
    /// Gets of keys ending in a number (`layer.7`, `kv-000123`) are watched per prefix;
    /// sequential or strided runs bring the next blocks up to the GPU.
    pub prefetch: Prefetch,
    /// The engine of the disk's direct I/O (io_uring or threads) and its queue depth, for
    /// [`TierStore::open`] (a disk given to [`TierStore::open_on`] brings its own).
    pub disk_io: DiskIo,
}

impl TierConfig {
    /// `gpu` and `host` bytes with the default watermarks; lz4 on disk, no filter.
    pub fn new(gpu: u64, host: u64) -> TierConfig {
        TierConfig {
            gpu: Budget::new(gpu),
            host: Budget::new(host),
            disk_compression: Compression::Lz4,
            disk_filter: Filter::None,
            prefetch: Prefetch::Auto { distance: 4 },
            disk_io: DiskIo::default(),
        }
    }
}

/// How far a put must get before it returns.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Durability {
    /// In memory; written to disk only when evicted there. Lost on a crash.
    Memory,
    /// Written to disk (the operating system's cache) before the put returns.
    Disk,
    /// Written and synced, data and index, before the put returns: survives power loss.
    Sync,
}

/// Where a block was found or is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Tier {
    Gpu,
    Host,
    Disk,
}

impl Tier {
    /// `gpu`, `host` or `disk` (metric labels, benchmark case names).
    pub fn name(self) -> &'static str {
        match self {
            Tier::Gpu => "gpu",
            Tier::Host => "host",
            Tier::Disk => "disk",
        }
    }
}

/// Counts since the store opened.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TierStats {
    pub gpu_hits: u64,
    pub host_hits: u64,
    pub disk_hits: u64,
    pub misses: u64,
    pub gpu_evictions: u64,
    pub host_evictions: u64,
    pub disk_bytes_written: u64,
    pub disk_bytes_read: u64,
    /// Blocks the prefetcher brought up, and gets that found one of them there.
    pub prefetched: u64,
    pub prefetch_hits: u64,
    /// Blocks, bytes and time moved per (from, to) tier pair ([`Moves::pair`]).
    pub moves: Moves,
}

/// Blocks by key on three tiers. All methods take `&self`; one lock orders them.
pub struct TierStore {
    stream: Stream,
    disk: Arc<dyn Disk>,
    dir: PathBuf,
    config: TierConfig,
    inner: Mutex<Inner>,
}

struct Inner {
    gpu: Clock<String>,
    gpu_blocks: HashMap<String, Buffer<u8>>,
    host: Clock<String>,
    host_blocks: HashMap<String, PinnedBuf<u8>>,
    /// Blocks on disk.
    index: BTreeMap<String, Location>,
    log: IndexLog,
    /// The segment new blocks are appended to.
    segment: u64,
    /// Whether that segment's name is durable (its folder synced since it was created).
    segment_named: bool,
    stats: TierStats,
    /// The prefetcher's detectors, by key prefix (a few: the oldest is forgotten).
    detectors: Vec<(String, Detector)>,
    /// Keys the prefetcher brought up that no get has asked for yet.
    prefetched: std::collections::HashSet<String>,
    /// Per data segment: (bytes of blocks the index still points at, bytes written).
    segments: HashMap<u64, (u64, u64)>,
}

/// A closed segment whose live bytes fall under this share of its size is rewritten.
const SEGMENT_LIVE_MIN: f64 = 0.5;
/// The index log is compacted once it holds this many records and mostly dead ones.
const LOG_COMPACT_RECORDS: u64 = 4096;

/// The highest tier holding `key`.
/// Blocks under this size that go down to the disk together share one write...
const BATCH_BELOW: usize = 64 << 10;
/// ...of about this many bytes.
const BATCH_BYTES: usize = 1 << 20;

/// Where a block below the GPU tier was found.
enum Below {
    /// The host tier holds it (its pinned block stays there until the block moves up).
    Host,
    /// Read from the disk into a pinned block of its own.
    Disk(PinnedBuf<u8>),
}

fn highest_tier(g: &Inner, key: &String) -> Option<Tier> {
    if g.gpu.contains(key) {
        Some(Tier::Gpu)
    } else if g.host.contains(key) {
        Some(Tier::Host)
    } else {
        g.index.contains_key(key).then_some(Tier::Disk)
    }
}

/// The bytes each memory tier holds, as gauges (`warpdrive_tier_bytes{tier}`).
fn publish_occupancy(g: &Inner) {
    metrics::gauge!("warpdrive_tier_bytes", "tier" => "gpu").set(g.gpu.used() as f64);
    metrics::gauge!("warpdrive_tier_bytes", "tier" => "host").set(g.host.used() as f64);
}

/// Takes a block the index no longer points at off its segment's live bytes.
fn forget(g: &mut Inner, at: Location) {
    if let Some(s) = g.segments.get_mut(&at.segment) {
        s.0 = s.0.saturating_sub(at.len);
    }
}

/// Detectors kept at once (key prefixes watched).
const DETECTORS: usize = 16;

/// `key` as (prefix, number, digits) when it ends in a decimal number.
fn numbered(key: &str) -> Option<(&str, i64, usize)> {
    let digits = key.bytes().rev().take_while(u8::is_ascii_digit).count();
    if digits == 0 || digits > 18 {
        return None;
    }
    let (prefix, number) = key.split_at(key.len() - digits);
    Some((prefix, number.parse().ok()?, digits))
}

impl std::fmt::Debug for TierStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "TierStore({})", self.dir.display())
    }
}

fn segment_name(n: u64) -> String {
    format!("data-{n}.seg")
}

/// A data segment while a compaction writes it, before it is renamed to [`segment_name`].
fn temp_segment_name(n: u64) -> String {
    format!("data-{n}.seg.tmp")
}

fn is_temp_segment(path: &Path) -> bool {
    path.file_name()
        .and_then(|n| n.to_str())
        .is_some_and(|n| n.starts_with("data-") && n.ends_with(".seg.tmp"))
}

fn segment_number(path: &Path) -> Option<u64> {
    let name = path.file_name()?.to_str()?;
    name.strip_prefix("data-")?
        .strip_suffix(".seg")?
        .parse()
        .ok()
}

fn check_key(key: &str) -> Result<()> {
    if key.is_empty() || key.len() > MAX_KEY {
        return Err(Error::InvalidArgument(format!(
            "tier store: a key of {} bytes (1 to {MAX_KEY})",
            key.len()
        )));
    }
    Ok(())
}

impl TierStore {
    /// Opens (or creates) the store in `dir` on the operating system's files; blocks in
    /// memory tiers live on `stream`'s device and its pinned pool.
    /// The disk's direct I/O runs on the engine `config.disk_io` resolves to here
    /// ([`io`](Self::io) says which).
    pub fn open(dir: impl AsRef<Path>, config: TierConfig, stream: &Stream) -> Result<TierStore> {
        let disk = OsDisk::with_io(config.disk_io)?;
        TierStore::open_on(Arc::new(disk), dir, config, stream)
    }

    /// [`open`](Self::open) on any [`Disk`] (a simulated one in crash tests).
    pub fn open_on(
        disk: Arc<dyn Disk>,
        dir: impl AsRef<Path>,
        config: TierConfig,
        stream: &Stream,
    ) -> Result<TierStore> {
        config.gpu.check("gpu")?;
        config.host.check("host")?;
        if let Some(io) = disk.io() {
            tracing::debug!(
                engine = io.engine.name(),
                depth = io.queue_depth,
                "tier disk I/O"
            );
            metrics::gauge!("warpdrive_tier_io_queue_depth", "engine" => io.engine.name())
                .set(io.queue_depth as f64);
        }
        let dir = dir.as_ref().to_path_buf();
        disk.create_dir_all(&dir)?;
        let (log, mut index) = IndexLog::open(disk.clone(), &dir)?;
        let mut last = 0u64;
        let mut lens = HashMap::new();
        // A compaction's output not renamed yet: nothing points at it.
        for path in disk.list(&dir)? {
            if is_temp_segment(&path) {
                tracing::warn!(path = %path.display(), "discarding an interrupted compaction's segment");
                disk.remove(&path)?;
            }
        }
        for path in disk.list(&dir)? {
            if let Some(n) = segment_number(&path) {
                last = last.max(n);
                lens.insert(n, disk.len(&path)?.unwrap_or(0));
            }
        }
        // Entries whose bytes never reached their segment (a crash before the data sync).
        index.retain(|_, at| {
            lens.get(&at.segment)
                .is_some_and(|&len| at.offset.saturating_add(at.len) <= len)
        });
        let mut segments: HashMap<u64, (u64, u64)> =
            lens.iter().map(|(&n, &len)| (n, (0, len))).collect();
        for at in index.values() {
            if let Some(s) = segments.get_mut(&at.segment) {
                s.0 += at.len;
            }
        }
        // Segments nothing points at (emptied by a compaction that crashed before removing
        // them, or by removes) go now.
        for (&n, &(live, _)) in &segments {
            if live == 0 {
                disk.remove(&dir.join(segment_name(n)))?;
            }
        }
        segments.retain(|_, s| s.0 > 0);
        Ok(TierStore {
            stream: stream.clone(),
            disk,
            dir,
            config,
            inner: Mutex::new(Inner {
                gpu: Clock::new(config.gpu),
                gpu_blocks: HashMap::new(),
                host: Clock::new(config.host),
                host_blocks: HashMap::new(),
                index,
                log,
                segment: last + 1,
                segment_named: false,
                stats: TierStats::default(),
                detectors: Vec::new(),
                prefetched: Default::default(),
                segments,
            }),
        })
    }

    pub fn config(&self) -> TierConfig {
        self.config
    }

    pub fn stats(&self) -> TierStats {
        self.inner.lock().stats
    }

    /// The engine and queue depth of the disk's direct I/O; `None` on a disk that does none
    /// (the simulator).
    pub fn io(&self) -> Option<Io> {
        self.disk.io()
    }

    /// The tiers that hold `key`, highest first.
    pub fn tiers_of(&self, key: &str) -> Vec<Tier> {
        let g = self.inner.lock();
        let mut out = Vec::new();
        if g.gpu.contains(&key.to_string()) {
            out.push(Tier::Gpu);
        }
        if g.host.contains(&key.to_string()) {
            out.push(Tier::Host);
        }
        if g.index.contains_key(key) {
            out.push(Tier::Disk);
        }
        out
    }

    /// Stores `data` under `key` (replacing what it held), as durable as `durability` says.
    pub fn put(&self, key: &str, data: &[u8], durability: Durability) -> Result<()> {
        check_key(key)?;
        if data.is_empty() || data.len() > MAX_BLOCK {
            return Err(Error::InvalidArgument(format!(
                "tier store: a block of {} bytes (1 to {MAX_BLOCK})",
                data.len()
            )));
        }
        let key = key.to_string();
        let mut g = self.inner.lock();
        self.drop_from_memory(&mut g, &key);
        let on_disk = durability != Durability::Memory;
        if on_disk {
            self.write_to_disk(&mut g, &key, data, durability == Durability::Sync)?;
        } else if let Some(old) = g.index.remove(&key) {
            // The disk copy is stale now.
            forget(&mut g, old);
            g.log.append(&Record::Remove { key: key.clone() }, false)?;
        }
        let bytes = data.len() as u64;
        if g.gpu.fits(bytes) {
            self.make_room_on_gpu(&mut g, bytes)?;
            let buf = Buffer::from_host(&self.stream, data)?;
            g.gpu.insert(key.clone(), bytes);
            g.gpu_blocks.insert(key, buf);
        } else if g.host.fits(bytes) {
            self.make_room_on_host(&mut g, bytes)?;
            let mut pinned = PinnedBuf::<u8>::new(self.stream.device(), data.len())?;
            pinned.wait_slice_mut()?.copy_from_slice(data);
            g.host.insert(key.clone(), bytes);
            g.host_blocks.insert(key, pinned);
        } else if !on_disk {
            self.write_to_disk(&mut g, &key, data, false)?;
        }
        publish_occupancy(&g);
        Ok(())
    }

    /// The block under `key` on the stream's device, promoted to the GPU tier when it came
    /// from below.
    pub fn get(&self, key: &str) -> Result<Buffer<u8>> {
        check_key(key)?;
        let key = key.to_string();
        let mut g = self.inner.lock();
        let loaded = match g.gpu_blocks.contains_key(&key) {
            true => {
                self.gpu_hit(&mut g, &key);
                None
            }
            false => {
                let since = Instant::now();
                let below = self.find_below_gpu(&mut g, &key)?;
                self.promote(&mut g, &key, below, since)?
            }
        };
        // From the GPU tier's block when it holds one (a block promoted just now crossed the
        // link once); else (too large for the tier) the one upload is the caller's copy.
        let out = match (g.gpu_blocks.get(&key), loaded) {
            (Some(src), _) => {
                let mut out = Buffer::<u8>::uninit(&self.stream, src.len())?;
                ops::copy(&self.stream, src, &mut out)?;
                out
            }
            (None, Some(Below::Disk(mut p))) => self.upload_pinned(&mut p)?,
            (None, Some(Below::Host)) => match g.host_blocks.get_mut(&key) {
                Some(p) => self.upload_pinned(p)?,
                None => return Err(Error::NotFound { key }),
            },
            (None, None) => return Err(Error::NotFound { key }),
        };
        self.prefetch_after(&mut g, &key)?;
        Ok(out)
    }

    /// The block under `key` in host memory.
    pub fn get_host(&self, key: &str) -> Result<Vec<u8>> {
        check_key(key)?;
        let key = key.to_string();
        let mut g = self.inner.lock();
        let data = match g.gpu_blocks.get(&key) {
            Some(src) => {
                let data = src.to_host(&self.stream)?;
                self.gpu_hit(&mut g, &key);
                data
            }
            None if !g.host_blocks.contains_key(&key) && !self.may_fit_gpu(&g, &key) => {
                // Straight into the caller's Vec: the GPU tier could not take it anyway.
                let since = Instant::now();
                let fresh = transfer::fresh_landing;
                let streamed =
                    self.read_disk_streamed(&mut g, &key, fresh, |v| Ok(v.as_mut_slice()));
                if let Some(data) = streamed? {
                    g.stats.moves.record(
                        Tier::Disk,
                        Tier::Host,
                        data.len() as u64,
                        since.elapsed(),
                    );
                    self.prefetch_after(&mut g, &key)?;
                    return Ok(data);
                }
                let data =
                    self.read_disk(&mut g, &key, |stored| codec::decode_block(stored, &key))?;
                g.stats
                    .moves
                    .record(Tier::Disk, Tier::Host, data.len() as u64, since.elapsed());
                data
            }
            None => {
                let since = Instant::now();
                let below = self.find_below_gpu(&mut g, &key)?;
                let data = match (&below, g.host_blocks.get(&key)) {
                    (Below::Disk(p), _) | (Below::Host, Some(p)) => {
                        transfer::fresh_copy(self.stream.device(), p.wait_slice()?)?
                    }
                    (Below::Host, None) => return Err(Error::NotFound { key }),
                };
                self.promote(&mut g, &key, below, since)?;
                data
            }
        };
        self.prefetch_after(&mut g, &key)?;
        Ok(data)
    }

    /// As [`get_host`](Self::get_host) into `out`, which must be exactly the block's length
    /// (`LengthMismatch` otherwise): a block read from the disk lands in `out` itself,
    /// checksum verified, with no new memory (whose page faults cost a large read more than
    /// its copy: bench/NOTES.md). After an error `out` holds no block's bytes: a block that
    /// fails its checksum is zeroed out of it.
    pub fn get_host_into(&self, key: &str, out: &mut [u8]) -> Result<()> {
        check_key(key)?;
        let key = key.to_string();
        let want = out.len();
        let fits = |len: usize| match len == want {
            true => Ok(()),
            false => Err(Error::LengthMismatch {
                op: "TierStore::get_host_into",
                left: want,
                right: len,
            }),
        };
        let mut g = self.inner.lock();
        if let Some(src) = g.gpu_blocks.get(&key) {
            fits(src.len())?;
            src.copy_to_host(&self.stream, out)?;
            self.gpu_hit(&mut g, &key);
        } else if !g.host_blocks.contains_key(&key) && !self.may_fit_gpu(&g, &key) {
            let since = Instant::now();
            let landed = self.land_from_disk(&mut g, &key, out, &fits);
            if matches!(landed, Err(Error::Corrupt { .. })) {
                out.fill(0);
            }
            landed?;
            g.stats
                .moves
                .record(Tier::Disk, Tier::Host, want as u64, since.elapsed());
        } else {
            let since = Instant::now();
            let below = self.find_below_gpu(&mut g, &key)?;
            match (&below, g.host_blocks.get(&key)) {
                (Below::Disk(p), _) | (Below::Host, Some(p)) => {
                    let data = p.wait_slice()?;
                    fits(data.len())?;
                    out.copy_from_slice(data);
                }
                (Below::Host, None) => return Err(Error::NotFound { key }),
            }
            self.promote(&mut g, &key, below, since)?;
        }
        self.prefetch_after(&mut g, &key)
    }

    /// `key`'s block read from the disk into `out` (its length checked by `fits`): landed
    /// piece by piece when large and plain, else read whole and decoded into it.
    fn land_from_disk(
        &self,
        g: &mut Inner,
        key: &String,
        out: &mut [u8],
        fits: &dyn Fn(usize) -> Result<()>,
    ) -> Result<()> {
        let streamed = self
            .read_disk_streamed(
                g,
                key,
                |len| fits(len).map(|()| &mut *out),
                |o| Ok(&mut **o),
            )?
            .is_some();
        if streamed {
            return Ok(());
        }
        self.read_disk(g, key, move |stored| {
            let make = move |len| fits(len).map(|()| out);
            codec::decode_block_into(stored, key, make, |o| Ok(&mut **o)).map(drop)
        })
    }

    /// Brings `keys` up to the GPU tier ahead of their gets (absent keys are skipped).
    pub fn prefetch(&self, keys: &[&str]) -> Result<()> {
        for key in keys {
            check_key(key)?;
            let key = key.to_string();
            let mut g = self.inner.lock();
            // Absent keys and blocks the GPU tier cannot take are skipped.
            if g.gpu.contains(&key) || !self.may_fit_gpu(&g, &key) {
                continue;
            }
            let since = Instant::now();
            let below = self.find_below_gpu(&mut g, &key)?;
            self.promote(&mut g, &key, below, since)?;
        }
        Ok(())
    }

    /// Moves the block under `key` to tier `to`: up to the GPU or the host (making room
    /// there as a put does), or down to the disk (written there unless it is already, then
    /// dropped from the memory tiers). A pinned block does not move down.
    pub fn migrate(&self, key: &str, to: Tier) -> Result<()> {
        check_key(key)?;
        let started = std::time::Instant::now();
        let key = key.to_string();
        let mut g = self.inner.lock();
        let from = highest_tier(&g, &key);
        let r = self.migrate_locked(&mut g, key, to);
        if let (Ok(()), Some(from)) = (&r, from) {
            metrics::histogram!(
                "warpdrive_tier_migration_seconds",
                "from" => from.name(),
                "to" => to.name()
            )
            .record(started.elapsed().as_secs_f64());
        }
        publish_occupancy(&g);
        r
    }

    fn migrate_locked(&self, g: &mut Inner, key: String, to: Tier) -> Result<()> {
        let pinned = g.gpu.is_pinned(&key) || g.host.is_pinned(&key);
        match to {
            Tier::Gpu => {
                if g.gpu.contains(&key) {
                    return Ok(());
                }
                let since = Instant::now();
                let below = self.find_below_gpu(g, &key)?;
                if let Some(below) = self.promote(g, &key, below, since)? {
                    let bytes = match below {
                        Below::Disk(p) => p.len(),
                        Below::Host => g.host_blocks.get(&key).map_or(0, |p| p.len()),
                    };
                    return Err(Error::InvalidArgument(format!(
                        "tier store: {key} ({bytes} bytes) does not fit the GPU tier's budget"
                    )));
                }
                Ok(())
            }
            Tier::Host => {
                if g.host.contains(&key) {
                    return Ok(());
                }
                if pinned {
                    return Err(Error::InvalidArgument(format!(
                        "tier store: {key} is pinned"
                    )));
                }
                let bytes;
                let since = Instant::now();
                let pinned_copy = match g.gpu_blocks.get(&key) {
                    Some(buf) => {
                        bytes = buf.len() as u64;
                        let mut p = PinnedBuf::<u8>::new(self.stream.device(), buf.len())?;
                        buf.copy_to_pinned(&self.stream, &mut p)?;
                        g.stats
                            .moves
                            .record(Tier::Gpu, Tier::Host, bytes, since.elapsed());
                        p
                    }
                    None => match self.find_below_gpu(g, &key)? {
                        Below::Disk(p) => {
                            bytes = p.len() as u64;
                            g.stats
                                .moves
                                .record(Tier::Disk, Tier::Host, bytes, since.elapsed());
                            p
                        }
                        Below::Host => return Ok(()),
                    },
                };
                if !g.host.fits(bytes) {
                    return Err(Error::InvalidArgument(format!(
                        "tier store: {key} ({bytes} bytes) does not fit the host tier's budget"
                    )));
                }
                self.make_room_on_host(g, bytes)?;
                g.gpu.remove(&key);
                g.gpu_blocks.remove(&key);
                g.host.insert(key.clone(), bytes);
                g.host_blocks.insert(key, pinned_copy);
                Ok(())
            }
            Tier::Disk => {
                if pinned {
                    return Err(Error::InvalidArgument(format!(
                        "tier store: {key} is pinned"
                    )));
                }
                if !g.index.contains_key(&key) {
                    let since = Instant::now();
                    // Encoded straight from the pinned block when the host holds it.
                    if let Some(p) = g.host_blocks.remove(&key) {
                        let written = self.write_to_disk(g, &key, p.wait_slice()?, false);
                        let bytes = p.len() as u64;
                        if written.is_err() {
                            g.host_blocks.insert(key.clone(), p);
                        }
                        written?;
                        g.stats
                            .moves
                            .record(Tier::Host, Tier::Disk, bytes, since.elapsed());
                    } else if let Some(buf) = g.gpu_blocks.get(&key) {
                        let data = buf.to_host(&self.stream)?;
                        self.write_to_disk(g, &key, &data, false)?;
                        let bytes = data.len() as u64;
                        g.stats
                            .moves
                            .record(Tier::Gpu, Tier::Disk, bytes, since.elapsed());
                    } else {
                        return Err(Error::NotFound { key });
                    }
                }
                self.drop_from_memory(g, &key);
                Ok(())
            }
        }
    }

    /// Keeps `key` in the memory tier that holds it until as many [`unpin`](Self::unpin)s;
    /// `NotFound` when no memory tier holds it (a `get` or `prefetch` brings it up).
    pub fn pin(&self, key: &str) -> Result<()> {
        let key = key.to_string();
        let mut g = self.inner.lock();
        if g.gpu.pin(&key) || g.host.pin(&key) {
            return Ok(());
        }
        Err(Error::NotFound { key })
    }

    /// Undoes one [`pin`](Self::pin).
    pub fn unpin(&self, key: &str) -> Result<()> {
        let key = key.to_string();
        let mut g = self.inner.lock();
        if g.gpu.unpin(&key) || g.host.unpin(&key) {
            return Ok(());
        }
        Err(Error::InvalidArgument(format!(
            "tier store: {key} is not pinned"
        )))
    }

    /// Removes `key` from every tier; `NotFound` when no tier held it.
    pub fn remove(&self, key: &str) -> Result<()> {
        check_key(key)?;
        let key = key.to_string();
        let mut g = self.inner.lock();
        let in_memory = self.drop_from_memory(&mut g, &key);
        let on_disk = match g.index.remove(&key) {
            Some(old) => {
                forget(&mut g, old);
                g.log.append(&Record::Remove { key: key.clone() }, false)?;
                true
            }
            None => false,
        };
        if !(in_memory || on_disk) {
            return Err(Error::NotFound { key });
        }
        Ok(())
    }

    /// Makes every write so far durable (data segments, then the index).
    pub fn sync(&self) -> Result<()> {
        let mut g = self.inner.lock();
        let segment = self.dir.join(segment_name(g.segment));
        if self.disk.len(&segment)?.is_some() {
            self.disk.sync(&segment)?;
            self.disk.sync_dir(&self.dir)?;
            g.segment_named = true;
        }
        g.log.sync()
    }

    fn gpu_hit(&self, g: &mut Inner, key: &String) {
        g.gpu.touch(key);
        g.stats.gpu_hits += 1;
        metrics::counter!("warpdrive_tier_hits_total", "tier" => "gpu").increment(1);
        if g.prefetched.remove(key) {
            g.stats.prefetch_hits += 1;
        }
    }

    /// Notes a get of `key` and brings up what its prefix's pattern predicts.
    fn prefetch_after(&self, g: &mut Inner, key: &str) -> Result<()> {
        let Prefetch::Auto { distance } = self.config.prefetch else {
            return Ok(());
        };
        let Some((prefix, n, digits)) = numbered(key) else {
            return Ok(());
        };
        let i = match g.detectors.iter().position(|(p, _)| p == prefix) {
            Some(i) => i,
            None => {
                if g.detectors.len() == DETECTORS {
                    g.detectors.remove(0);
                }
                g.detectors.push((prefix.to_string(), Detector::new(4)));
                g.detectors.len() - 1
            }
        };
        g.detectors[i].1.record(n);
        for next in g.detectors[i].1.predict(distance) {
            if next < 0 {
                continue;
            }
            let key = format!("{prefix}{next:0digits$}");
            if g.gpu.contains(&key) || !self.may_fit_gpu(g, &key) {
                continue;
            }
            let since = Instant::now();
            let below = self.find_below_gpu(g, &key)?;
            if self.promote(g, &key, below, since)?.is_none() {
                g.stats.prefetched += 1;
                g.prefetched.insert(key);
            }
        }
        Ok(())
    }

    fn drop_from_memory(&self, g: &mut Inner, key: &String) -> bool {
        let gpu = g.gpu.remove(key).is_some();
        g.gpu_blocks.remove(key);
        let host = g.host.remove(key).is_some();
        g.host_blocks.remove(key);
        gpu || host
    }

    /// Whether the GPU tier could take `key`'s block, judged by the bytes it holds below
    /// (a compressed block's data may still turn out larger).
    fn may_fit_gpu(&self, g: &Inner, key: &String) -> bool {
        let below = match (g.host_blocks.get(key), g.index.get(key)) {
            (Some(p), _) => p.len() as u64,
            (None, Some(at)) => at.len.saturating_sub(codec::HEADER_BYTES as u64),
            (None, None) => return false,
        };
        g.gpu.fits(below)
    }

    /// Puts a block found below the GPU into the GPU tier when it fits there, by one DMA from
    /// its pinned block (the host tier lets its copy go); gives the block back when it does
    /// not fit (nothing moves). A block from the disk is counted as moved disk → GPU in the
    /// time since `since` (its read included); one from the host tier, in its upload's time.
    fn promote(
        &self,
        g: &mut Inner,
        key: &String,
        below: Below,
        since: Instant,
    ) -> Result<Option<Below>> {
        let bytes = match &below {
            Below::Disk(p) => p.len() as u64,
            Below::Host => match g.host_blocks.get(key) {
                Some(p) => p.len() as u64,
                None => return Ok(Some(below)),
            },
        };
        if !g.gpu.fits(bytes) {
            return Ok(Some(below));
        }
        // Out of the host tier first, so that making room there cannot evict it; back in
        // if the move fails.
        let from_host_tier = matches!(below, Below::Host);
        let upload_started = Instant::now();
        let mut source = match below {
            Below::Disk(p) => p,
            Below::Host => match g.host_blocks.remove(key) {
                Some(p) => p,
                None => return Ok(Some(Below::Host)),
            },
        };
        let moved = self
            .make_room_on_gpu(g, bytes)
            .and_then(|()| self.upload_pinned(&mut source));
        let buf = match moved {
            Ok(buf) => buf,
            Err(e) => {
                if from_host_tier {
                    g.host_blocks.insert(key.clone(), source);
                }
                return Err(e);
            }
        };
        // The pinned block goes back to its pool, which reuses it once the DMA is done.
        drop(source);
        if from_host_tier {
            g.host.remove(key);
        }
        let (from, took) = match from_host_tier {
            true => (Tier::Host, upload_started.elapsed()),
            false => (Tier::Disk, since.elapsed()),
        };
        g.stats.moves.record(from, Tier::Gpu, bytes, took);
        g.gpu.insert(key.clone(), bytes);
        g.gpu_blocks.insert(key.clone(), buf);
        Ok(None)
    }

    /// A device copy of a pinned block: one DMA on the store's stream, no host copy.
    fn upload_pinned(&self, p: &mut PinnedBuf<u8>) -> Result<Buffer<u8>> {
        let mut buf = Buffer::<u8>::uninit(&self.stream, p.len())?;
        buf.copy_from_pinned(&self.stream, p)?;
        Ok(buf)
    }

    /// Moves GPU victims down to the host tier (or the disk) before `incoming` bytes arrive.
    fn make_room_on_gpu(&self, g: &mut Inner, incoming: u64) -> Result<()> {
        for (key, bytes) in g.gpu.victims(incoming) {
            let Some(buf) = g.gpu_blocks.remove(&key) else {
                continue;
            };
            g.gpu.remove(&key);
            g.stats.gpu_evictions += 1;
            metrics::counter!("warpdrive_tier_evictions_total", "tier" => "gpu").increment(1);
            if g.host.fits(bytes) {
                self.make_room_on_host(g, bytes)?;
                let since = Instant::now();
                let mut pinned = PinnedBuf::<u8>::new(self.stream.device(), buf.len())?;
                buf.copy_to_pinned(&self.stream, &mut pinned)?;
                g.stats
                    .moves
                    .record(Tier::Gpu, Tier::Host, bytes, since.elapsed());
                g.host.insert(key.clone(), bytes);
                g.host_blocks.insert(key, pinned);
            } else if !g.index.contains_key(&key) {
                let since = Instant::now();
                let data = buf.to_host(&self.stream)?;
                self.write_to_disk(g, &key, &data, false)?;
                g.stats
                    .moves
                    .record(Tier::Gpu, Tier::Disk, bytes, since.elapsed());
            }
        }
        Ok(())
    }

    /// Moves host victims to the disk (unless already there) before `incoming` bytes arrive.
    fn make_room_on_host(&self, g: &mut Inner, incoming: u64) -> Result<()> {
        // Victims not on disk yet go down together: small ones gathered into writes of
        // about `BATCH_BYTES`, large ones one write each.
        let mut batch: Vec<(String, PinnedBuf<u8>)> = Vec::new();
        let mut batched = 0;
        for (key, _) in g.host.victims(incoming) {
            let Some(pinned) = g.host_blocks.remove(&key) else {
                continue;
            };
            g.host.remove(&key);
            g.stats.host_evictions += 1;
            metrics::counter!("warpdrive_tier_evictions_total", "tier" => "host").increment(1);
            if g.index.contains_key(&key) {
                continue;
            }
            if pinned.len() >= BATCH_BELOW {
                self.write_batch(g, &mut vec![(key, pinned)])?;
                continue;
            }
            batched += pinned.len();
            batch.push((key, pinned));
            if batched >= BATCH_BYTES {
                self.write_batch(g, &mut batch)?;
                batched = 0;
            }
        }
        self.write_batch(g, &mut batch)
    }

    /// Writes evicted blocks in one I/O and empties `batch`; when the write fails they go
    /// back to the host tier (over its budget for now) rather than being lost.
    fn write_batch(&self, g: &mut Inner, batch: &mut Vec<(String, PinnedBuf<u8>)>) -> Result<()> {
        if batch.is_empty() {
            return Ok(());
        }
        let since = Instant::now();
        let written = batch
            .iter()
            .map(|(key, p)| Ok((key.as_str(), p.wait_slice()?)))
            .collect::<Result<Vec<_>>>()
            .and_then(|blocks| self.write_many_to_disk(g, &blocks, false));
        match written {
            // The one write's time is shared out by the blocks' bytes.
            Ok(()) => {
                let took = since.elapsed();
                let lens: Vec<u64> = batch.iter().map(|(_, p)| p.len() as u64).collect();
                let total: u64 = lens.iter().sum();
                for len in lens {
                    let share = match total {
                        0 => took,
                        t => took.mul_f64(len as f64 / t as f64),
                    };
                    g.stats.moves.record(Tier::Host, Tier::Disk, len, share);
                }
            }
            Err(_) => {
                for (key, p) in batch.drain(..) {
                    g.host.insert(key.clone(), p.len() as u64);
                    g.host_blocks.insert(key, p);
                }
            }
        }
        batch.clear();
        written
    }
}
