//! The tiered store: blocks kept on the GPU, in pinned host memory and on disk, moved between
//! them at the link's and the disk's speed, compressed and checksummed on disk, and never
//! lost once a put is acknowledged as durable.
//!
//! - [`codec`]: how a block is stored on disk — an optional byte-shuffle filter for 16-bit
//!   floats, lz4 or zstd (or raw when that does not shrink it), with a 32-byte header holding
//!   an xxh3 checksum that every read verifies. The store keeps the header in the block's
//!   index record and only the payload in the data segment.
//! - [`disk`]: the file-system seam: the operating system's files, or a simulated disk that
//!   loses every write not yet synced on a power loss (the crash tests' disk).
//! - [`log`]: the index, an append-only log of checksummed records replayed on open (a torn
//!   tail is dropped) and compacted when mostly dead; a put's record holds where the block's
//!   payload is and its header.
//! - [`moves`]: blocks, bytes and time moved per (from, to) tier pair.
//! - [`policy`]: each tier's byte budget and watermarks, and CLOCK eviction that respects
//!   pins.
//! - [`prefetch`]: sequential, strided and random access told apart from the positions of
//!   recent gets, and the positions a pattern predicts.

pub mod codec;
pub mod disk;
pub mod log;
pub mod moves;
pub mod policy;
pub mod prefetch;
mod store;

pub use store::{
    DiskFolder, Durability, Tier, TierConfig, TierStats, TierStore, MAX_BLOCK, MAX_KEY,
};
