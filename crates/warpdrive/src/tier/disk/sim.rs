//! [`SimDisk`]: an in-memory file system that loses every write not yet synced on a power
//! loss, with injected faults — the crash tests' disk.

use std::collections::{BTreeMap, HashMap};
use std::ffi::OsString;
use std::io::ErrorKind;
use std::path::{Path, PathBuf};

use parking_lot::Mutex;

use crate::error::{Error, Result};
use crate::files::folder;

use super::Disk;
#[cfg(doc)]
use super::OsDisk;

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
    /// Calls of `append` so far.
    appends: u64,
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

    /// How many appends (writes at a file's end) the disk has served.
    pub fn appends(&self) -> u64 {
        self.state.lock().appends
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
        s.appends += 1;
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
    use super::super::is_no_space;
    use super::*;

    fn sim() -> (SimDisk, PathBuf) {
        let disk = SimDisk::new();
        let dir = PathBuf::from("/store");
        disk.create_dir_all(&dir).unwrap();
        (disk, dir)
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
}
