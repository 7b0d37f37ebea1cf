//! How a block is stored on disk (to be written: see issue 34, item 3).

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

/// How a tier compresses a block.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Compression {
    None,
    Lz4,
    /// zstd at `level` (1..=22; negative levels are zstd's fast modes).
    Zstd {
        level: i32,
    },
}

/// A filter applied before compression.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Filter {
    None,
    /// Byte-shuffle by element width (2 for bf16 / f16): the i-th bytes of every element
    /// together, so exponents sit next to exponents.
    Shuffle {
        width: u8,
    },
}

/// Bytes of the frame around a stored block's payload.
pub const HEADER_BYTES: usize = 32;

/// `data` framed as a stored block (header with the codec actually used, lengths and an
/// xxh3 checksum, then the payload); stored raw when compression does not shrink it.
pub fn encode_block(data: &[u8], compression: Compression, filter: Filter) -> Result<Vec<u8>> {
    let _ = (data, compression, filter);
    Err(Error::Unsupported("tier codec: not built yet".into()))
}

/// The data of a stored block, its checksum and framing verified; `key` names the block in
/// `Error::Corrupt`.
pub fn decode_block(stored: &[u8], key: &str) -> Result<Vec<u8>> {
    let _ = (stored, key);
    Err(Error::Unsupported("tier codec: not built yet".into()))
}
