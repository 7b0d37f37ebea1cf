//! The file-system seam of the tiered store: [`OsDisk`], the operating system's files, and
//! [`SimDisk`], an in-memory file system that loses every write not yet synced on a
//! [`SimDisk::power_loss`] (the crash tests' disk), with injected faults (a full disk, short
//! writes, flipped bytes, a process that dies after a given number of writes).

use std::collections::{BTreeMap, HashMap};
use std::ffi::OsString;
use std::fs::{File, OpenOptions};
use std::io::{ErrorKind, Write};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use parking_lot::Mutex;

use crate::error::{Error, Result};
use crate::files::folder;

/// What the store needs of a file system. Writes are durable only once synced: `sync`
/// makes a file's data durable, `sync_dir` makes the names created, renamed or removed in
/// a folder durable.
pub trait Disk: Send + Sync + 'static {
    /// Creates `dir` and its parents; the folders created are durable when it returns.
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

    /// Appends `bytes` for direct I/O: at an offset aligned to [`DIRECT_ALIGN`], zeros after
    /// them up to the next alignment; returns their offset. The default pads and appends
    /// through [`append`](Self::append); [`OsDisk`] writes with `O_DIRECT` where the file
    /// system allows it (no page cache in the way).
    fn append_aligned(&self, path: &Path, bytes: &[u8]) -> Result<u64> {
        default_append_aligned(self, path, bytes)
    }

    /// `len` bytes at `offset` of a file [`append_aligned`](Self::append_aligned) wrote;
    /// fewer only at its end. [`OsDisk`] reads with `O_DIRECT` where it can.
    fn read_aligned(&self, path: &Path, offset: u64, len: usize) -> Result<Vec<u8>> {
        self.read_at(path, offset, len)
    }

    /// Hands `len` bytes at `offset` of a file [`append_aligned`](Self::append_aligned)
    /// wrote (fewer only at its end) to `use_bytes`, without a copy of its own where it can
    /// ([`OsDisk`] passes its direct-I/O buffer).
    fn with_aligned(
        &self,
        path: &Path,
        offset: u64,
        len: usize,
        use_bytes: &mut dyn FnMut(&[u8]) -> Result<()>,
    ) -> Result<()> {
        use_bytes(&self.read_aligned(path, offset, len)?)
    }
}

/// The alignment of direct I/O: offsets, lengths and buffers (the file systems' 4 KiB).
pub const DIRECT_ALIGN: u64 = 4096;

/// Bytes from `n` to the next multiple of [`DIRECT_ALIGN`].
pub fn pad_to_align(n: u64) -> u64 {
    (DIRECT_ALIGN - n % DIRECT_ALIGN) % DIRECT_ALIGN
}

/// A zeroed buffer whose start and length are multiples of [`DIRECT_ALIGN`]: what direct
/// I/O reads into and writes from.
pub struct AlignedBuf {
    buf: Vec<u8>,
    start: usize,
    len: usize,
}

impl AlignedBuf {
    /// `len` bytes rounded up to the alignment.
    pub fn new(len: usize) -> Result<AlignedBuf> {
        let align = DIRECT_ALIGN as usize;
        let len = len
            .checked_add(align - 1)
            .map(|n| n / align * align)
            .ok_or_else(|| Error::InvalidArgument(format!("a direct I/O of {len} bytes")))?;
        let total = len
            .checked_add(align)
            .ok_or_else(|| Error::InvalidArgument(format!("a direct I/O of {len} bytes")))?;
        let buf = vec![0u8; total];
        let start = (align - buf.as_ptr() as usize % align) % align;
        Ok(AlignedBuf { buf, start, len })
    }

    pub fn as_slice(&self) -> &[u8] {
        &self.buf[self.start..self.start + self.len]
    }

    /// The most bytes this buffer can hold.
    pub fn capacity(&self) -> usize {
        self.buf.len() - self.start
    }

    /// Uses `len` bytes (rounded up to the alignment) of the buffer: `false`, unchanged,
    /// when that is more than its capacity.
    pub fn set_len(&mut self, len: usize) -> bool {
        let align = DIRECT_ALIGN as usize;
        match len.checked_add(align - 1).map(|n| n / align * align) {
            Some(n) if n <= self.capacity() => {
                self.len = n;
                true
            }
            _ => false,
        }
    }

    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        &mut self.buf[self.start..self.start + self.len]
    }
}

/// The largest aligned buffer a thread keeps between direct I/Os.
const SCRATCH_KEEP: usize = 64 << 20;

thread_local! {
    /// This thread's aligned buffer for [`OsDisk`]'s direct I/O: a fresh one per call would
    /// be zeroed memory straight from the kernel, faulted in page by page, which cost more
    /// than the I/O itself at 4 MiB (bench/NOTES.md, the tier store's disk).
    static SCRATCH: std::cell::RefCell<Option<AlignedBuf>> = const { std::cell::RefCell::new(None) };
}

/// Runs `f` on an aligned buffer of `len` bytes (rounded up): this thread's kept one when
/// it is large enough, else a new one (kept when at most [`SCRATCH_KEEP`]).
fn with_scratch<R>(len: usize, f: impl FnOnce(&mut AlignedBuf) -> Result<R>) -> Result<R> {
    let kept = SCRATCH.try_with(|s| s.borrow_mut().take()).ok().flatten();
    let mut buf = match kept {
        Some(b) => b,
        None => AlignedBuf::new(len)?,
    };
    if !buf.set_len(len) {
        buf = AlignedBuf::new(len)?;
    }
    let r = f(&mut buf);
    if buf.capacity() <= SCRATCH_KEEP {
        let _ = SCRATCH.try_with(|s| *s.borrow_mut() = Some(buf));
    }
    r
}

/// A file opened for direct I/O (`O_DIRECT`), or through the page cache where the file
/// system refuses it (`EINVAL`: tmpfs and others); [`DirectFile::is_direct`] says which.
pub struct DirectFile {
    file: File,
    path: PathBuf,
    direct: bool,
}

impl DirectFile {
    /// Opens `path` for reading and writing, created when absent.
    pub fn open(path: &Path) -> Result<DirectFile> {
        use std::os::unix::fs::OpenOptionsExt;
        let mut options = OpenOptions::new();
        options.read(true).write(true).create(true);
        let (file, direct) = match options.clone().custom_flags(libc::O_DIRECT).open(path) {
            Ok(f) => (f, true),
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {
                (options.open(path).map_err(|e| Error::io(path, e))?, false)
            }
            Err(e) => return Err(Error::io(path, e)),
        };
        Ok(DirectFile {
            file,
            path: path.to_path_buf(),
            direct,
        })
    }

    pub fn is_direct(&self) -> bool {
        self.direct
    }

    /// The file's length in bytes.
    pub fn size(&self) -> Result<u64> {
        Ok(self
            .file
            .metadata()
            .map_err(|e| Error::io(&self.path, e))?
            .len())
    }

    /// Writes all of `buf` at `offset` (a multiple of [`DIRECT_ALIGN`]).
    pub fn write_at(&self, buf: &AlignedBuf, offset: u64) -> Result<()> {
        self.file
            .write_all_at(buf.as_slice(), offset)
            .map_err(|e| Error::io(&self.path, e))
    }

    /// Fills `buf` from `offset` (a multiple of [`DIRECT_ALIGN`]); returns the bytes read,
    /// fewer only at the end of the file.
    pub fn read_at(&self, buf: &mut AlignedBuf, offset: u64) -> Result<usize> {
        let window = buf.as_mut_slice();
        let mut filled = 0;
        while filled < window.len() {
            match self
                .file
                .read_at(&mut window[filled..], offset + filled as u64)
            {
                Ok(0) => break,
                Ok(n) => filled += n,
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) => return Err(Error::io(&self.path, e)),
            }
        }
        Ok(filled)
    }

    /// Makes the file's data durable.
    pub fn sync(&self) -> Result<()> {
        self.file.sync_data().map_err(|e| Error::io(&self.path, e))
    }
}

/// [`Disk::append_aligned`]'s default body, for [`OsDisk`] where `O_DIRECT` is refused.
fn default_append_aligned<D: Disk + ?Sized>(disk: &D, path: &Path, bytes: &[u8]) -> Result<u64> {
    let len = disk.len(path)?.unwrap_or(0);
    let head = pad_to_align(len);
    if head > 0 {
        disk.append(path, &vec![0; head as usize])?;
    }
    let offset = disk.append(path, bytes)?;
    let tail = pad_to_align(bytes.len() as u64);
    if tail > 0 {
        disk.append(path, &vec![0; tail as usize])?;
    }
    Ok(offset)
}

/// The operating system's files through `std::fs`. Every error is an [`Error::Io`] naming
/// the path, a full disk included (`ENOSPC`, after which the file may hold part of the
/// write: callers cut it back).
#[derive(Debug, Default, Clone, Copy)]
pub struct OsDisk;

impl Disk for OsDisk {
    fn create_dir_all(&self, dir: &Path) -> Result<()> {
        // The folders about to be created: each one's name is made durable in its parent.
        let missing: Vec<&Path> = dir
            .ancestors()
            .take_while(|a| !a.as_os_str().is_empty() && !a.exists())
            .collect();
        std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
        for created in missing.iter().rev() {
            self.sync_dir(folder(created))?;
        }
        Ok(())
    }

    fn append(&self, path: &Path, bytes: &[u8]) -> Result<u64> {
        let mut file = OpenOptions::new()
            .append(true)
            .create(true)
            .open(path)
            .map_err(|e| Error::io(path, e))?;
        let offset = file.metadata().map_err(|e| Error::io(path, e))?.len();
        file.write_all(bytes).map_err(|e| Error::io(path, e))?;
        Ok(offset)
    }

    fn read_at(&self, path: &Path, offset: u64, len: usize) -> Result<Vec<u8>> {
        let file = File::open(path).map_err(|e| Error::io(path, e))?;
        let mut out = vec![0u8; len];
        let mut filled = 0;
        while filled < len {
            let at = offset
                .checked_add(filled as u64)
                .ok_or_else(|| Error::InvalidArgument(format!("read past 2^64 in {path:?}")))?;
            match file.read_at(&mut out[filled..], at) {
                Ok(0) => break,
                Ok(n) => filled += n,
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) => return Err(Error::io(path, e)),
            }
        }
        out.truncate(filled);
        Ok(out)
    }

    fn read_all(&self, path: &Path) -> Result<Vec<u8>> {
        std::fs::read(path).map_err(|e| Error::io(path, e))
    }

    fn append_aligned(&self, path: &Path, bytes: &[u8]) -> Result<u64> {
        let file = DirectFile::open(path)?;
        let len = file.size()?;
        let offset = len + pad_to_align(len);
        with_scratch(bytes.len(), |buf| {
            let window = buf.as_mut_slice();
            window[..bytes.len()].copy_from_slice(bytes);
            // The padding: zeros, not what the buffer held before.
            window[bytes.len()..].fill(0);
            file.write_at(buf, offset)
        })?;
        Ok(offset)
    }

    fn read_aligned(&self, path: &Path, offset: u64, len: usize) -> Result<Vec<u8>> {
        let mut out = Vec::new();
        self.with_aligned(path, offset, len, &mut |bytes| {
            out = bytes.to_vec();
            Ok(())
        })?;
        Ok(out)
    }

    fn with_aligned(
        &self,
        path: &Path,
        offset: u64,
        len: usize,
        use_bytes: &mut dyn FnMut(&[u8]) -> Result<()>,
    ) -> Result<()> {
        if !path.exists() {
            return Err(Error::io(path, std::io::Error::from(ErrorKind::NotFound)));
        }
        let file = DirectFile::open(path)?;
        let start = offset - offset % DIRECT_ALIGN;
        let end = offset
            .checked_add(len as u64)
            .ok_or_else(|| Error::InvalidArgument(format!("read past 2^64 in {path:?}")))?;
        let span = usize::try_from(end - start)
            .map_err(|_| Error::InvalidArgument(format!("a read of {len} bytes")))?;
        with_scratch(span, |buf| {
            let filled = file.read_at(buf, start)?;
            let skip = (offset - start) as usize;
            let got = filled.saturating_sub(skip).min(len);
            use_bytes(&buf.as_slice()[skip..skip + got])
        })
    }

    fn len(&self, path: &Path) -> Result<Option<u64>> {
        match std::fs::metadata(path) {
            Ok(m) => Ok(Some(m.len())),
            Err(e) if e.kind() == ErrorKind::NotFound => Ok(None),
            Err(e) => Err(Error::io(path, e)),
        }
    }

    fn truncate(&self, path: &Path, len: u64) -> Result<()> {
        OpenOptions::new()
            .write(true)
            .open(path)
            .and_then(|f| f.set_len(len))
            .map_err(|e| Error::io(path, e))
    }

    fn sync(&self, path: &Path) -> Result<()> {
        File::open(path)
            .and_then(|f| f.sync_data())
            .map_err(|e| Error::io(path, e))
    }

    fn write_new(&self, path: &Path, bytes: &[u8]) -> Result<()> {
        File::create(path)
            .and_then(|mut f| f.write_all(bytes))
            .map_err(|e| Error::io(path, e))
    }

    fn rename(&self, from: &Path, to: &Path) -> Result<()> {
        std::fs::rename(from, to).map_err(|e| Error::io(from, e))
    }

    fn remove(&self, path: &Path) -> Result<()> {
        match std::fs::remove_file(path) {
            Err(e) if e.kind() != ErrorKind::NotFound => Err(Error::io(path, e)),
            _ => Ok(()),
        }
    }

    fn sync_dir(&self, dir: &Path) -> Result<()> {
        File::open(dir)
            .and_then(|f| f.sync_all())
            .map_err(|e| Error::io(dir, e))
    }

    fn list(&self, dir: &Path) -> Result<Vec<PathBuf>> {
        let mut files = Vec::new();
        for entry in std::fs::read_dir(dir).map_err(|e| Error::io(dir, e))? {
            let entry = entry.map_err(|e| Error::io(dir, e))?;
            if entry.file_type().map_err(|e| Error::io(dir, e))?.is_file() {
                files.push(entry.path());
            }
        }
        files.sort();
        Ok(files)
    }
}

/// An in-memory file system for crash tests. Each file has its current bytes and its
/// durable bytes (those of its last `sync`); each folder has its current names and its
/// durable names (those of its last `sync_dir`). A create, rename or remove changes only
/// the current names, so a file synced under a name not yet made durable keeps its data
/// but loses its name on [`power_loss`](Self::power_loss), which puts back every durable
/// state. Folders are durable once created (as [`OsDisk::create_dir_all`] makes them).
///
/// Faults: [`set_capacity`](Self::set_capacity) (writes past it fail with `ENOSPC`, whole
/// or, with [`set_short_writes`](Self::set_short_writes), after writing what fits),
/// [`fail_next_sync`](Self::fail_next_sync) (a failed `fsync` that drops the writes it
/// failed to write back), [`flip_byte`](Self::flip_byte) (damage on the medium) and
/// [`crash_after`](Self::crash_after) (the process dies after that many more changes; then
/// [`restart`](Self::restart) is a `kill -9` and [`power_loss`](Self::power_loss) a power
/// cut).
#[derive(Debug, Default)]
pub struct SimDisk {
    state: Mutex<SimState>,
}

#[derive(Debug, Default)]
struct SimState {
    folders: BTreeMap<PathBuf, SimFolder>,
    /// Files by inode: a name points at one, so a rename moves the data, not a copy.
    files: HashMap<u64, SimFile>,
    next_inode: u64,
    capacity: Option<u64>,
    short_writes: bool,
    /// Changes left before the simulated process dies; `Some(0)`: dead.
    changes_left: Option<u64>,
    /// The next `sync` fails.
    fail_next_sync: bool,
}

#[derive(Debug, Default)]
struct SimFolder {
    current: BTreeMap<OsString, u64>,
    durable: BTreeMap<OsString, u64>,
}

#[derive(Debug, Default)]
struct SimFile {
    current: Vec<u8>,
    durable: Vec<u8>,
    /// Bytes whose write-back failed: the cache holds them, clean, so no later sync writes
    /// them (as Linux does after a failed `fsync`); they read as zeros after a power loss.
    lost: Option<std::ops::Range<usize>>,
}

impl SimFile {
    /// The bytes a sync would leave on the medium.
    fn written_back(&self) -> Vec<u8> {
        let mut data = self.current.clone();
        if let Some(lost) = &self.lost {
            data[lost.clone()].fill(0);
        }
        data
    }
}

fn not_found(path: &Path) -> Error {
    Error::io(path, std::io::Error::from(ErrorKind::NotFound))
}

fn no_space(path: &Path) -> Error {
    Error::io(path, std::io::Error::from_raw_os_error(libc::ENOSPC))
}

/// The folder and the name of `path`.
fn split(path: &Path) -> Result<(&Path, OsString)> {
    let name = path
        .file_name()
        .ok_or_else(|| Error::InvalidArgument(format!("{} names no file", path.display())))?;
    Ok((folder(path), name.to_os_string()))
}

impl SimState {
    /// Fails every call once the simulated process has died; counts `change`s towards it.
    fn step(&mut self, path: &Path, change: bool) -> Result<()> {
        match self.changes_left {
            Some(0) => Err(Error::io(
                path,
                std::io::Error::other("simulated crash: the process is dead"),
            )),
            Some(n) if change => {
                self.changes_left = Some(n - 1);
                Ok(())
            }
            _ => Ok(()),
        }
    }

    fn inode(&self, path: &Path) -> Result<u64> {
        let (dir, name) = split(path)?;
        self.folders
            .get(dir)
            .and_then(|f| f.current.get(&name))
            .copied()
            .ok_or_else(|| not_found(path))
    }

    fn file(&self, path: &Path) -> Result<&SimFile> {
        let inode = self.inode(path)?;
        self.files.get(&inode).ok_or_else(|| not_found(path))
    }

    fn file_mut(&mut self, path: &Path) -> Result<&mut SimFile> {
        let inode = self.inode(path)?;
        self.files.get_mut(&inode).ok_or_else(|| not_found(path))
    }

    /// `path`'s inode, a new empty file when absent (its folder must exist).
    fn open_or_create(&mut self, path: &Path) -> Result<u64> {
        let (dir, name) = split(path)?;
        let next = self.next_inode;
        let folder = self.folders.get_mut(dir).ok_or_else(|| not_found(path))?;
        let inode = *folder.current.entry(name).or_insert(next);
        if inode == next {
            self.next_inode += 1;
            self.files.insert(inode, SimFile::default());
        }
        Ok(inode)
    }

    /// Bytes free under the capacity, not counting `except` (a file being replaced).
    fn free(&self, except: Option<u64>) -> u64 {
        let Some(capacity) = self.capacity else {
            return u64::MAX;
        };
        let used: u64 = self
            .folders
            .values()
            .flat_map(|f| f.current.values())
            .filter(|&&inode| Some(inode) != except)
            .filter_map(|inode| self.files.get(inode))
            .map(|f| f.current.len() as u64)
            .sum();
        capacity.saturating_sub(used)
    }

    /// Drops the files no name, current or durable, points at.
    fn collect_garbage(&mut self) {
        let named: std::collections::HashSet<u64> = self
            .folders
            .values()
            .flat_map(|f| f.current.values().chain(f.durable.values()))
            .copied()
            .collect();
        self.files.retain(|inode, _| named.contains(inode));
    }
}

impl SimDisk {
    /// An empty simulated disk with no capacity limit.
    pub fn new() -> Self {
        Self::default()
    }

    /// Reverts every file and folder to its durable state, as after a power cut: data not
    /// synced, and names not made durable by `sync_dir`, are lost. Also revives the process
    /// killed by [`crash_after`](Self::crash_after) and clears a pending
    /// [`fail_next_sync`](Self::fail_next_sync).
    pub fn power_loss(&self) {
        let mut s = self.state.lock();
        for folder in s.folders.values_mut() {
            folder.current = folder.durable.clone();
        }
        for file in s.files.values_mut() {
            file.current = file.durable.clone();
            file.lost = None;
        }
        s.collect_garbage();
        s.changes_left = None;
        s.fail_next_sync = false;
    }

    /// Limits the bytes of all files together; `None` lifts the limit. Writes past it fail
    /// with an `ENOSPC` [`Error::Io`].
    pub fn set_capacity(&self, bytes: Option<u64>) {
        self.state.lock().capacity = bytes;
    }

    /// When on, a write past the capacity first writes the part that fits (a short write),
    /// then fails; when off (the default) it writes nothing.
    pub fn set_short_writes(&self, on: bool) {
        self.state.lock().short_writes = on;
    }

    /// The simulated process dies after `changes` more calls that change the disk (append,
    /// write, truncate, rename, remove, sync, folder creation or sync): every call after
    /// them fails, writing nothing, until [`power_loss`](Self::power_loss).
    pub fn crash_after(&self, changes: u64) {
        self.state.lock().changes_left = Some(changes);
    }

    /// Starts the process [`crash_after`](Self::crash_after) killed again with every write
    /// kept, synced or not: a `kill -9`, whose writes the page cache still holds.
    pub fn restart(&self) {
        self.state.lock().changes_left = None;
    }

    /// The next `sync` fails with `EIO`, and the file's writes since its last sync are lost
    /// to the medium though still read back until a power loss: a later sync does not
    /// write them, only writing them again does (Linux's behaviour after a failed `fsync`).
    pub fn fail_next_sync(&self) {
        self.state.lock().fail_next_sync = true;
    }

    /// Inverts the byte at `offset` of `path`, in its current and its durable data alike
    /// (damage on the medium).
    pub fn flip_byte(&self, path: &Path, offset: u64) -> Result<()> {
        let mut s = self.state.lock();
        let file = s.file_mut(path)?;
        let mut flipped = false;
        for data in [&mut file.current, &mut file.durable] {
            if let Some(b) = usize::try_from(offset).ok().and_then(|i| data.get_mut(i)) {
                *b ^= 0xFF;
                flipped = true;
            }
        }
        if flipped {
            Ok(())
        } else {
            Err(Error::InvalidArgument(format!(
                "byte {offset} is past the end of {}",
                path.display()
            )))
        }
    }
}

impl Disk for SimDisk {
    fn create_dir_all(&self, dir: &Path) -> Result<()> {
        let mut s = self.state.lock();
        s.step(dir, true)?;
        for a in dir.ancestors() {
            s.folders.entry(a.to_path_buf()).or_default();
        }
        Ok(())
    }

    fn append(&self, path: &Path, bytes: &[u8]) -> Result<u64> {
        let mut s = self.state.lock();
        s.step(path, true)?;
        let free = s.free(None);
        let short = s.short_writes;
        let inode = s.open_or_create(path)?;
        let file = s.files.get_mut(&inode).ok_or_else(|| not_found(path))?;
        let offset = file.current.len() as u64;
        if bytes.len() as u64 > free {
            if short {
                file.current.extend_from_slice(&bytes[..free as usize]);
            }
            return Err(no_space(path));
        }
        file.current.extend_from_slice(bytes);
        Ok(offset)
    }

    fn read_at(&self, path: &Path, offset: u64, len: usize) -> Result<Vec<u8>> {
        let mut s = self.state.lock();
        s.step(path, false)?;
        let data = &s.file(path)?.current;
        let start = usize::try_from(offset).map_or(data.len(), |o| o.min(data.len()));
        let end = start.saturating_add(len).min(data.len());
        Ok(data[start..end].to_vec())
    }

    fn read_all(&self, path: &Path) -> Result<Vec<u8>> {
        let mut s = self.state.lock();
        s.step(path, false)?;
        Ok(s.file(path)?.current.clone())
    }

    fn len(&self, path: &Path) -> Result<Option<u64>> {
        let mut s = self.state.lock();
        s.step(path, false)?;
        match s.file(path) {
            Ok(f) => Ok(Some(f.current.len() as u64)),
            Err(_) => Ok(None),
        }
    }

    fn truncate(&self, path: &Path, len: u64) -> Result<()> {
        let mut s = self.state.lock();
        s.step(path, true)?;
        let len = usize::try_from(len)
            .map_err(|_| Error::InvalidArgument(format!("length {len} past the address space")))?;
        let file = s.file_mut(path)?;
        file.current.resize(len, 0);
        if let Some(lost) = &mut file.lost {
            lost.end = lost.end.min(len);
            if lost.start >= lost.end {
                file.lost = None;
            }
        }
        Ok(())
    }

    fn sync(&self, path: &Path) -> Result<()> {
        let mut s = self.state.lock();
        s.step(path, true)?;
        let fail = std::mem::take(&mut s.fail_next_sync);
        let file = s.file_mut(path)?;
        if fail {
            let first_dirty = file
                .current
                .iter()
                .zip(&file.durable)
                .position(|(c, d)| c != d)
                .unwrap_or(file.current.len().min(file.durable.len()));
            let start = file
                .lost
                .as_ref()
                .map_or(first_dirty, |l| l.start.min(first_dirty));
            file.lost = Some(start..file.current.len());
            return Err(Error::io(
                path,
                std::io::Error::from_raw_os_error(libc::EIO),
            ));
        }
        file.durable = file.written_back();
        Ok(())
    }

    fn write_new(&self, path: &Path, bytes: &[u8]) -> Result<()> {
        let mut s = self.state.lock();
        s.step(path, true)?;
        let (dir, _) = split(path)?;
        if !s.folders.contains_key(dir) {
            return Err(not_found(path));
        }
        let free = s.free(s.inode(path).ok());
        let fits = bytes.len() as u64 <= free;
        if !fits && !s.short_writes {
            return Err(no_space(path));
        }
        let inode = s.open_or_create(path)?;
        let file = s.files.get_mut(&inode).ok_or_else(|| not_found(path))?;
        file.lost = None;
        if fits {
            file.current = bytes.to_vec();
            Ok(())
        } else {
            file.current = bytes[..free as usize].to_vec();
            Err(no_space(path))
        }
    }

    fn rename(&self, from: &Path, to: &Path) -> Result<()> {
        let mut s = self.state.lock();
        s.step(from, true)?;
        let inode = s.inode(from)?;
        let (from_dir, from_name) = split(from)?;
        let (to_dir, to_name) = split(to)?;
        if !s.folders.contains_key(to_dir) {
            return Err(not_found(to));
        }
        if let Some(f) = s.folders.get_mut(from_dir) {
            f.current.remove(&from_name);
        }
        if let Some(f) = s.folders.get_mut(to_dir) {
            f.current.insert(to_name, inode);
        }
        s.collect_garbage();
        Ok(())
    }

    fn remove(&self, path: &Path) -> Result<()> {
        let mut s = self.state.lock();
        s.step(path, true)?;
        let (dir, name) = split(path)?;
        if let Some(f) = s.folders.get_mut(dir) {
            f.current.remove(&name);
        }
        s.collect_garbage();
        Ok(())
    }

    fn sync_dir(&self, dir: &Path) -> Result<()> {
        let mut s = self.state.lock();
        s.step(dir, true)?;
        let folder = s.folders.get_mut(dir).ok_or_else(|| not_found(dir))?;
        folder.durable = folder.current.clone();
        s.collect_garbage();
        Ok(())
    }

    fn list(&self, dir: &Path) -> Result<Vec<PathBuf>> {
        let mut s = self.state.lock();
        s.step(dir, false)?;
        let folder = s.folders.get(dir).ok_or_else(|| not_found(dir))?;
        Ok(folder.current.keys().map(|name| dir.join(name)).collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sim() -> (SimDisk, PathBuf) {
        let disk = SimDisk::new();
        let dir = PathBuf::from("/store");
        disk.create_dir_all(&dir).unwrap();
        (disk, dir)
    }

    fn is_no_space(e: &Error) -> bool {
        matches!(e, Error::Io { source, .. } if source.raw_os_error() == Some(libc::ENOSPC))
    }

    #[test]
    fn power_loss_keeps_synced_data_and_drops_the_rest() {
        let (disk, dir) = sim();
        let f = dir.join("a");
        assert_eq!(disk.append(&f, b"abc").unwrap(), 0);
        disk.sync(&f).unwrap();
        disk.sync_dir(&dir).unwrap();
        assert_eq!(disk.append(&f, b"def").unwrap(), 3);
        assert_eq!(disk.read_all(&f).unwrap(), b"abcdef");
        disk.power_loss();
        assert_eq!(disk.read_all(&f).unwrap(), b"abc");
        // A truncate not synced reverts too.
        disk.truncate(&f, 1).unwrap();
        disk.power_loss();
        assert_eq!(disk.read_all(&f).unwrap(), b"abc");
    }

    #[test]
    fn a_synced_file_whose_name_is_not_durable_disappears() {
        let (disk, dir) = sim();
        let f = dir.join("new");
        disk.write_new(&f, b"data").unwrap();
        disk.sync(&f).unwrap();
        disk.power_loss();
        assert_eq!(disk.len(&f).unwrap(), None);
        assert!(disk.list(&dir).unwrap().is_empty());

        // Named durably but its data never synced: an empty file.
        disk.write_new(&f, b"data").unwrap();
        disk.sync_dir(&dir).unwrap();
        disk.power_loss();
        assert_eq!(disk.len(&f).unwrap(), Some(0));
    }

    #[test]
    fn renames_and_removes_revert_until_the_folder_is_synced() {
        let (disk, dir) = sim();
        let (old, tmp) = (dir.join("log"), dir.join("log.tmp"));
        disk.write_new(&old, b"old").unwrap();
        disk.sync(&old).unwrap();
        disk.sync_dir(&dir).unwrap();

        disk.write_new(&tmp, b"new").unwrap();
        disk.sync(&tmp).unwrap();
        disk.rename(&tmp, &old).unwrap();
        assert_eq!(disk.read_all(&old).unwrap(), b"new");
        assert_eq!(disk.list(&dir).unwrap(), vec![old.clone()]);
        disk.power_loss();
        assert_eq!(disk.read_all(&old).unwrap(), b"old");
        assert_eq!(disk.len(&tmp).unwrap(), None);

        disk.write_new(&tmp, b"new").unwrap();
        disk.sync(&tmp).unwrap();
        disk.rename(&tmp, &old).unwrap();
        disk.sync_dir(&dir).unwrap();
        disk.power_loss();
        assert_eq!(disk.read_all(&old).unwrap(), b"new");

        disk.remove(&old).unwrap();
        disk.remove(&old).unwrap(); // absent: no error
        assert_eq!(disk.len(&old).unwrap(), None);
        disk.power_loss();
        assert_eq!(disk.read_all(&old).unwrap(), b"new");
        disk.remove(&old).unwrap();
        disk.sync_dir(&dir).unwrap();
        disk.power_loss();
        assert_eq!(disk.len(&old).unwrap(), None);
    }

    #[test]
    fn writes_past_the_capacity_fail_with_enospc_whole_or_short() {
        let (disk, dir) = sim();
        let (a, b) = (dir.join("a"), dir.join("b"));
        disk.set_capacity(Some(10));
        disk.append(&a, b"123456").unwrap();
        let e = disk.append(&a, b"abcdef").unwrap_err();
        assert!(is_no_space(&e), "{e}");
        assert_eq!(disk.read_all(&a).unwrap(), b"123456", "nothing written");
        assert!(is_no_space(&disk.write_new(&b, b"abcde").unwrap_err()));
        assert_eq!(disk.len(&b).unwrap(), None);
        // Replacing a file counts its new size only.
        disk.write_new(&a, b"0123456789").unwrap();

        disk.write_new(&a, b"123456").unwrap();
        disk.set_short_writes(true);
        assert!(is_no_space(&disk.append(&a, b"abcdef").unwrap_err()));
        assert_eq!(disk.read_all(&a).unwrap(), b"123456abcd");
        // Space comes back when files go.
        disk.remove(&a).unwrap();
        disk.append(&b, b"0123456789").unwrap();
        disk.set_capacity(None);
        disk.append(&b, &[7; 100]).unwrap();
    }

    #[test]
    fn flip_byte_damages_current_and_durable_data() {
        let (disk, dir) = sim();
        let f = dir.join("a");
        disk.append(&f, b"abc").unwrap();
        disk.sync(&f).unwrap();
        disk.sync_dir(&dir).unwrap();
        disk.flip_byte(&f, 1).unwrap();
        assert_eq!(disk.read_all(&f).unwrap(), [b'a', !b'b', b'c']);
        disk.power_loss();
        assert_eq!(disk.read_at(&f, 1, 5).unwrap(), [!b'b', b'c']);
        assert!(matches!(
            disk.flip_byte(&f, 3),
            Err(Error::InvalidArgument(_))
        ));
    }

    #[test]
    fn a_crashed_process_changes_nothing_more_until_power_loss() {
        let (disk, dir) = sim();
        let f = dir.join("a");
        disk.crash_after(2);
        disk.append(&f, b"ab").unwrap();
        disk.sync(&f).unwrap();
        assert!(disk.sync_dir(&dir).is_err());
        assert!(disk.append(&f, b"cd").is_err());
        assert!(disk.read_all(&f).is_err(), "a dead process reads nothing");
        disk.restart();
        assert_eq!(
            disk.read_all(&f).unwrap(),
            b"ab",
            "a kill keeps every write"
        );
        disk.crash_after(0);
        assert!(disk.len(&f).is_err());
        disk.power_loss();
        assert_eq!(disk.len(&f).unwrap(), None, "the name was never durable");
        disk.append(&f, b"ab").unwrap();
    }

    #[test]
    fn writes_a_failed_sync_dropped_are_lost_until_written_again() {
        let (disk, dir) = sim();
        let f = dir.join("a");
        disk.append(&f, b"ab").unwrap();
        disk.sync(&f).unwrap();
        disk.sync_dir(&dir).unwrap();
        disk.append(&f, b"cd").unwrap();
        disk.fail_next_sync();
        let e = disk.sync(&f).unwrap_err();
        assert!(matches!(&e, Error::Io { source, .. } if source.raw_os_error() == Some(libc::EIO)));
        assert_eq!(disk.read_all(&f).unwrap(), b"abcd", "still cached");
        disk.append(&f, b"ef").unwrap();
        disk.sync(&f).unwrap();
        disk.power_loss();
        assert_eq!(
            disk.read_all(&f).unwrap(),
            b"ab\0\0ef",
            "never written back"
        );

        // Written again, they reach the medium.
        disk.truncate(&f, 2).unwrap();
        disk.append(&f, b"cd").unwrap();
        disk.fail_next_sync();
        assert!(disk.sync(&f).is_err());
        disk.truncate(&f, 2).unwrap();
        disk.append(&f, b"CD").unwrap();
        disk.sync(&f).unwrap();
        disk.power_loss();
        assert_eq!(disk.read_all(&f).unwrap(), b"abCD");
    }

    #[test]
    fn missing_files_and_folders_are_io_errors() {
        let (disk, dir) = sim();
        let missing = dir.join("none");
        assert_eq!(disk.len(&missing).unwrap(), None);
        for e in [
            disk.read_all(&missing).unwrap_err(),
            disk.sync(&missing).unwrap_err(),
            disk.rename(&missing, &dir.join("x")).unwrap_err(),
            disk.append(Path::new("/nowhere/a"), b"x").unwrap_err(),
            disk.list(Path::new("/nowhere")).unwrap_err(),
        ] {
            assert!(
                matches!(&e, Error::Io { source, .. } if source.kind() == ErrorKind::NotFound),
                "{e}"
            );
        }
    }

    fn tempdir(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("wd-disk-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        d
    }

    #[test]
    fn os_disk_does_what_the_trait_says() {
        let dir = tempdir("os");
        let disk = OsDisk;
        disk.create_dir_all(&dir.join("sub")).unwrap();
        let (a, b) = (dir.join("a"), dir.join("b"));
        assert_eq!(disk.len(&a).unwrap(), None);
        assert_eq!(disk.append(&a, b"abc").unwrap(), 0);
        assert_eq!(disk.append(&a, b"def").unwrap(), 3);
        disk.sync(&a).unwrap();
        assert_eq!(disk.read_at(&a, 2, 10).unwrap(), b"cdef");
        disk.truncate(&a, 4).unwrap();
        assert_eq!(disk.read_all(&a).unwrap(), b"abcd");
        disk.write_new(&b, b"xy").unwrap();
        disk.write_new(&b, b"z").unwrap();
        assert_eq!(disk.len(&b).unwrap(), Some(1));
        assert_eq!(disk.list(&dir).unwrap(), vec![a.clone(), b.clone()]);
        disk.rename(&b, &a).unwrap();
        disk.sync_dir(&dir).unwrap();
        assert_eq!(disk.read_all(&a).unwrap(), b"z");
        disk.remove(&b).unwrap();
        disk.remove(&a).unwrap();
        assert_eq!(disk.list(&dir).unwrap(), Vec::<PathBuf>::new());
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn os_disk_reports_a_full_disk_as_enospc() {
        // /dev/full fails every write with ENOSPC.
        let full = Path::new("/dev/full");
        let e = OsDisk.append(full, b"x").unwrap_err();
        assert!(is_no_space(&e), "{e}");
        assert!(e.to_string().contains("/dev/full"), "{e}");
    }
}
