//! Files read through a read-only memory mapping: a checkpoint's tensors go from the page
//! cache to the staging ring with no read into a buffer of their own first.

use std::fs::File;
use std::path::Path;

use crate::error::{Error, Result};

/// A whole file mapped read-only.
///
/// The mapping shows the file as it is on disk: if another process truncates or rewrites
/// the file while it is mapped, reads of the lost part end the process with SIGBUS and
/// rewritten bytes are seen as they change. Callers map files nobody writes meanwhile (model
/// checkpoints) and say so in their docs.
pub struct MappedFile {
    map: memmap2::Mmap,
}

impl std::fmt::Debug for MappedFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "MappedFile[{} bytes]", self.map.len())
    }
}

impl MappedFile {
    /// Maps the file at `path` (an empty file maps to no bytes).
    pub fn open(path: &Path) -> Result<MappedFile> {
        let file = File::open(path).map_err(|e| Error::io(path, e))?;
        // SAFETY: the mapping is read-only and private to this value, so this process never
        // writes it; another process changing or truncating the file meanwhile would change
        // the bytes under the reader or fault it (SIGBUS), which the loader's docs rule out:
        // it maps checkpoints, which nothing writes while they are loaded.
        let map = unsafe { memmap2::Mmap::map(&file) }.map_err(|e| Error::io(path, e))?;
        Ok(MappedFile { map })
    }

    /// The file's bytes.
    pub fn bytes(&self) -> &[u8] {
        &self.map
    }
}
