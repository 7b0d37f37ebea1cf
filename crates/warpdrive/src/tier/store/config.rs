//! How a store is laid out: its tiers' budgets, the disk's compression and I/O, prefetching.

use super::super::codec::{Compression, Filter};
use super::super::disk::DiskIo;
use super::super::policy::Budget;
use super::super::prefetch::Prefetch;

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
