//! The file-system seam of the tiered store (to be written: see issue 34, item 5).

use std::path::{Path, PathBuf};

use crate::error::Result;

/// What the store needs of a file system. Writes are durable only once synced: `sync`
/// makes a file's data durable, `sync_dir` makes the names created, renamed or removed in
/// a folder durable.
pub trait Disk: Send + Sync + 'static {
    /// Creates `dir` and its parents.
    fn create_dir_all(&self, dir: &Path) -> Result<()>;
    /// Appends `bytes` to `path` (created when absent); returns the offset they start at.
    fn append(&self, path: &Path, bytes: &[u8]) -> Result<u64>;
    /// `len` bytes of `path` from `offset`; fewer only at the end of the file.
    fn read_at(&self, path: &Path, offset: u64, len: usize) -> Result<Vec<u8>>;
    /// The whole of `path`.
    fn read_all(&self, path: &Path) -> Result<Vec<u8>>;
    /// The length of `path`, `None` when it does not exist.
    fn len(&self, path: &Path) -> Result<Option<u64>>;
    /// Cuts `path` to `len` bytes.
    fn truncate(&self, path: &Path, len: u64) -> Result<()>;
    /// Makes `path`'s data durable.
    fn sync(&self, path: &Path) -> Result<()>;
    /// Creates or replaces `path` with `bytes` (not synced).
    fn write_new(&self, path: &Path, bytes: &[u8]) -> Result<()>;
    /// Renames `from` to `to`, replacing `to`.
    fn rename(&self, from: &Path, to: &Path) -> Result<()>;
    /// Removes `path` (absent is not an error).
    fn remove(&self, path: &Path) -> Result<()>;
    /// Makes the names in `dir` durable.
    fn sync_dir(&self, dir: &Path) -> Result<()>;
    /// The files in `dir`, sorted.
    fn list(&self, dir: &Path) -> Result<Vec<PathBuf>>;
}
