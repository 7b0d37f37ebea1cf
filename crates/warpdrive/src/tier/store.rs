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
//! On disk: data segments `data-<n>.seg` in one or more folders (`folders` places blocks
//! among them by size and budget; segment numbers run across all of them), blocks framed by [`codec`](super::codec), each
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
//!
//! Here: the store's state, puts, removes, pins and syncs. Beside it: `config` (the layout),
//! `open` (recovery on open), `read` (gets), `prefetching`, `migrate` (explicit moves),
//! `movement` (promotion and eviction), `disk_io` (blocks to and from segments), `compact`.

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::sync::Arc;

use parking_lot::Mutex;

use crate::device::Stream;
use crate::error::{Error, Result};
use crate::memory::{Buffer, PinnedBuf};

use super::disk::{Disk, Io};
use super::log::{IndexLog, Location, Record};
use super::moves::Moves;
use super::policy::Clock;
use super::prefetch::Detector;

mod compact;
mod config;
mod disk_io;
mod folders;
mod migrate;
mod movement;
mod open;
mod prefetching;
mod read;

pub use config::{DiskFolder, TierConfig};
use open::segment_name;

/// The largest block a store takes.
pub const MAX_BLOCK: usize = 256 << 20;
/// The longest key.
pub const MAX_KEY: usize = 1024;

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
    /// The folders blocks are written to (`config.disk_folders`, or the store's folder).
    folders: Vec<DiskFolder>,
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
    /// Per folder, the segment new blocks are appended to...
    current: Vec<u64>,
    /// ...and whether its name is durable (its folder synced since it was created).
    named: Vec<bool>,
    /// The number the next new segment takes, in any folder.
    next_segment: u64,
    stats: TierStats,
    /// The prefetcher's detectors, by key prefix (a few: the oldest is forgotten).
    detectors: Vec<(String, Detector)>,
    /// Keys the prefetcher brought up that no get has asked for yet.
    prefetched: std::collections::HashSet<String>,
    /// Per data segment, by (folder, number).
    segments: HashMap<(u32, u64), SegmentUse>,
}

/// What a data segment holds.
#[derive(Debug, Clone, Copy, Default)]
struct SegmentUse {
    /// Bytes of blocks the index still points at.
    live: u64,
    /// Bytes written (the file's length).
    total: u64,
    /// Bytes of its folder's pages its blocks were charged (dead ones until it goes).
    charged: u64,
}

/// A closed segment whose live bytes fall under this share of its size is rewritten.
const SEGMENT_LIVE_MIN: f64 = 0.5;
/// The index log is compacted once it holds this many records and mostly dead ones.
const LOG_COMPACT_RECORDS: u64 = 4096;

/// Where a block below the GPU tier was found.
enum Below {
    /// The host tier holds it (its pinned block stays there until the block moves up).
    Host,
    /// Read from the disk into a pinned block of its own.
    Disk(PinnedBuf<u8>),
}

/// The bytes each memory tier holds, as gauges (`warpdrive_tier_bytes{tier}`).
fn publish_occupancy(g: &Inner) {
    metrics::gauge!("warpdrive_tier_bytes", "tier" => "gpu").set(g.gpu.used() as f64);
    metrics::gauge!("warpdrive_tier_bytes", "tier" => "host").set(g.host.used() as f64);
}

/// Takes a block the index no longer points at off its segment's live bytes.
fn forget(g: &mut Inner, at: Location) {
    if let Some(s) = g.segments.get_mut(&(at.folder, at.segment)) {
        s.live = s.live.saturating_sub(at.len);
    }
}

impl std::fmt::Debug for TierStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "TierStore({})", self.dir.display())
    }
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
    pub fn config(&self) -> TierConfig {
        self.config.clone()
    }

    /// The folders blocks are written to on disk.
    pub fn disk_folders(&self) -> &[DiskFolder] {
        &self.folders
    }

    /// Per disk folder, in [`disk_folders`](Self::disk_folders) order, the bytes of its
    /// pages charged against its budget.
    pub fn disk_folder_bytes(&self) -> Vec<u64> {
        let g = self.inner.lock();
        (0..self.folders.len() as u32)
            .map(|f| folders::used(&g, f))
            .collect()
    }

    /// Segment `n` in folder `folder` (a folder the index names: checked on open).
    fn segment_path(&self, folder: u32, n: u64) -> PathBuf {
        let dir = self
            .folders
            .get(folder as usize)
            .map_or(&self.dir, |f| &f.path);
        dir.join(segment_name(n))
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
        crate::tier::disk::stamp::mark("put: key, lock, memory tiers");
        let on_disk = durability != Durability::Memory;
        if on_disk {
            self.write_to_disk(&mut g, &key, data, durability == Durability::Sync)?;
            crate::tier::disk::stamp::mark("put: index, segment use");
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
        for (f, folder) in self.folders.iter().enumerate() {
            let segment = folder.path.join(segment_name(g.current[f]));
            if self.disk.len(&segment)?.is_some() {
                self.disk.sync(&segment)?;
                self.disk.sync_dir(&folder.path)?;
                g.named[f] = true;
            }
        }
        g.log.sync()
    }

    fn drop_from_memory(&self, g: &mut Inner, key: &String) -> bool {
        let gpu = g.gpu.remove(key).is_some();
        g.gpu_blocks.remove(key);
        let host = g.host.remove(key).is_some();
        g.host_blocks.remove(key);
        gpu || host
    }
}
