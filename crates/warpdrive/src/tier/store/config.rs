//! How a store is laid out: its tiers' budgets, the disk folders, the disk's compression and
//! I/O, prefetching.

use std::path::PathBuf;

use super::super::codec::{Compression, Filter};
use super::super::disk::DiskIo;
use super::super::policy::Budget;
use super::super::prefetch::Prefetch;

/// A folder blocks are written to on disk.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DiskFolder {
    pub path: PathBuf,
    /// The unit a block occupies here (a power of two, at least 4 KiB): a block is charged
    /// its stored bytes rounded up to it, and blocks up to this size prefer the folder with
    /// the smallest page that holds them (see [`TierConfig::disk_folders`]).
    pub page: u64,
    /// The bytes of pages this folder may hold (`u64::MAX`: no limit). Removed and replaced
    /// blocks count until a compaction frees their segment.
    pub budget: u64,
}

impl DiskFolder {
    pub fn new(path: impl Into<PathBuf>, page: u64, budget: u64) -> DiskFolder {
        DiskFolder {
            path: path.into(),
            page,
            budget,
        }
    }
}

/// How a store is laid out.
#[derive(Debug, Clone, PartialEq)]
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
    /// [`TierStore::open`](crate::tier::TierStore::open) (a disk given to
    /// [`TierStore::open_on`](crate::tier::TierStore::open_on) brings its own).
    pub disk_io: DiskIo,
    /// Where blocks go on disk. Empty (the default): the store's own folder, 4 KiB pages, no
    /// limit. Otherwise these folders (the index log stays in the store's folder). A block
    /// goes to the folder with the smallest page at least its length (unencoded), or, longer
    /// than every page, to the one with the largest page; when that folder's budget cannot
    /// take it, to the next larger page, then the next smaller one (ties in list order).
    /// The index names a folder by its position here: keep the order, append new ones (each
    /// folder carries a mark of its position, so a reordered list or an empty folder in the
    /// place of one with blocks is refused on open).
    pub disk_folders: Vec<DiskFolder>,
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
            disk_folders: Vec::new(),
        }
    }
}
