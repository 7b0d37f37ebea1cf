//! The tiered store's index: an append-only log of checksummed records (to be written: see
//! issue 34, item 5).

use serde::{Deserialize, Serialize};

/// Where a block's stored bytes are on disk.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Location {
    /// The data segment file (`data-<segment>.seg` in the store's folder).
    pub segment: u64,
    pub offset: u64,
    /// Stored bytes, frame included.
    pub len: u64,
}

/// One change of the index.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Record {
    Put { key: String, at: Location },
    Remove { key: String },
}
