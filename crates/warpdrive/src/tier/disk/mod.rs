//! The file-system seam of the tiered store: [`OsDisk`], the operating system's files, and
//! [`SimDisk`], an in-memory file system that loses every write not yet synced on a
//! [`SimDisk::power_loss`] (the crash tests' disk), with injected faults (a full disk, short
//! writes, flipped bytes, a process that dies after a given number of writes). The direct
//! I/O (`O_DIRECT`) under [`OsDisk`]'s aligned calls is in `direct`, run on io_uring
//! (`uring`) or a thread pool as `engine` chooses; the simulator is in `sim`, at this seam,
//! above either engine.

mod dio;
mod direct;
mod engine;
mod sim;
pub mod stamp;
mod uring;

use std::fs::{File, OpenOptions};
use std::sync::Arc;

use parking_lot::Mutex;
use std::io::{ErrorKind, Write};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use crate::error::{Error, Result};
use crate::files::folder;

pub use dio::DioAlign;
use direct::with_scratch;
pub use direct::{in_place_ios, AlignedBuf, DirectFile};
pub use direct::{piece_bytes, queue_depth, QUEUE_DEPTH, SPLIT_FROM};
pub use engine::{DiskIo, Engine, Io, IoEngine, MAX_QUEUE_DEPTH};
pub use sim::SimDisk;

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

    /// The engine and queue depth of this disk's direct I/O; `None` for a disk that does
    /// none (the simulator).
    fn io(&self) -> Option<Io> {
        None
    }

    /// Appends `parts` one after another (a block's header and payload) for direct I/O: at
    /// an offset aligned to [`DIRECT_ALIGN`], zeros after them up to the next alignment;
    /// returns their offset. The default pads and appends
    /// through [`append`](Self::append); [`OsDisk`] writes with `O_DIRECT` where the file
    /// system allows it (no page cache in the way).
    fn append_aligned(&self, path: &Path, parts: &[&[u8]]) -> Result<u64> {
        let bytes = parts.concat();
        let len = self.len(path)?.unwrap_or(0);
        let head = pad_to_align(len);
        if head > 0 {
            self.append(path, &vec![0; head as usize])?;
        }
        let offset = self.append(path, &bytes)?;
        let tail = pad_to_align(bytes.len() as u64);
        if tail > 0 {
            self.append(path, &vec![0; tail as usize])?;
        }
        Ok(offset)
    }

    /// As [`append_aligned`](Self::append_aligned) for a header of `header_len` bytes and
    /// `body`, both made by `framer`: it copies the body in order, then gives the header (a
    /// checksum of the body, say). [`OsDisk`] sends the body's pieces out as each is copied
    /// while the framer takes the body in ([`Framer::absorb`]), and sends the header's page
    /// beside them once the framer is done; with no header (`header_len` 0: a bare block) the
    /// pieces are the body's alone, each copied and checksummed in order as it goes out. The
    /// default frames into a buffer first. A header of another length is `InvalidArgument`.
    fn append_aligned_framed(
        &self,
        path: &Path,
        header_len: usize,
        body: &[u8],
        framer: &mut dyn Framer,
    ) -> Result<u64> {
        let len = header_len
            .checked_add(body.len())
            .ok_or_else(|| Error::InvalidArgument("an append past usize::MAX".into()))?;
        self.append_aligned_filled(path, len, &mut |out| {
            frame_into(header_len, body, framer, out)
        })
    }

    /// As [`append_aligned`](Self::append_aligned) for `len` bytes that `fill` writes in
    /// place (a block framed while it is copied): [`OsDisk`] hands it its direct-I/O buffer,
    /// so the bytes are copied once. The default fills a new buffer and appends it.
    fn append_aligned_filled(
        &self,
        path: &Path,
        len: usize,
        fill: &mut dyn FnMut(&mut [u8]) -> Result<()>,
    ) -> Result<u64> {
        let mut bytes = vec![0; len];
        fill(&mut bytes)?;
        self.append_aligned(path, &[&bytes])
    }

    /// Appends `data` as [`append_aligned`](Self::append_aligned) appends one part, handing
    /// all of it to `take` in order (in one or more pieces) before returning: [`OsDisk`]
    /// writes it straight from where it lies when the file's direct-I/O alignment
    /// ([`DioAlign`]) allows (no copy; a last partial sector and the pad from a bounce in the
    /// same write), and runs `take`
    /// while the write is out on io_uring, or chunk by chunk as it copies `data` into its
    /// direct-I/O buffer on the threads (one pass). For blocks under [`SPLIT_FROM`] (one
    /// I/O); the default takes `data`, then appends it.
    fn append_aligned_taking(
        &self,
        path: &Path,
        data: &[u8],
        take: &mut dyn FnMut(&[u8]),
    ) -> Result<u64> {
        take(data);
        self.append_aligned(path, &[data])
    }

    /// Reads `out.len()` bytes at `offset` of a file [`append_aligned`](Self::append_aligned)
    /// wrote straight into `out` where direct I/O can land them there (`out` at the file's
    /// direct-I/O memory alignment, [`DioAlign`]; a last partial sector through a bounce),
    /// handing `each(at, bytes)` the parts of `out` read, in order, as they land
    /// (pieces in flight at once from [`SPLIT_FROM`]); the bytes read (fewer only at the
    /// file's end), or `None`, nothing read, where it cannot
    /// ([`with_aligned`](Self::with_aligned) then reads through an aligned buffer). The
    /// default reads, copies and hands over the whole.
    fn read_aligned_into(
        &self,
        path: &Path,
        offset: u64,
        out: &mut [u8],
        each: &(dyn Fn(usize, &[u8]) -> Result<()> + Sync),
    ) -> Result<Option<usize>> {
        let bytes = self.read_aligned(path, offset, out.len())?;
        let n = bytes.len().min(out.len());
        out[..n].copy_from_slice(&bytes[..n]);
        each(0, &out[..n])?;
        Ok(Some(n))
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

    /// Reads `len` bytes at `offset` of a file [`append_aligned`](Self::append_aligned) wrote
    /// and hands them to `each(at, bytes)` in disjoint pieces covering `0..len` (`at` counted
    /// from `offset`), possibly from several threads at once and in any order, each as soon as
    /// it is in; returns the bytes handed over (fewer only at the file's end). The default
    /// reads everything, then hands it over as one piece; [`OsDisk`] hands over the pieces of
    /// its split direct I/O as they land, so the caller's work overlaps the reading.
    fn read_aligned_each(
        &self,
        path: &Path,
        offset: u64,
        len: usize,
        each: &(dyn Fn(usize, &[u8]) -> Result<()> + Sync),
    ) -> Result<usize> {
        let bytes = self.read_aligned(path, offset, len)?;
        each(0, &bytes)?;
        Ok(bytes.len())
    }
}

/// The alignment of direct I/O: offsets, lengths and buffers (the file systems' 4 KiB).
pub const DIRECT_ALIGN: u64 = 4096;

/// Bytes from `n` to the next multiple of [`DIRECT_ALIGN`].
pub fn pad_to_align(n: u64) -> u64 {
    (DIRECT_ALIGN - n % DIRECT_ALIGN) % DIRECT_ALIGN
}

/// Makes a block's bytes for [`Disk::append_aligned_framed`]: its body copied or absorbed
/// in order (a checksum taken on the way), then its header.
pub trait Framer: Send {
    /// Copies `src`, the body's next bytes, into `dst` (as long).
    fn copy(&mut self, src: &[u8], dst: &mut [u8]);
    /// Takes `src`, the body's next bytes, without copying them (copied elsewhere).
    fn absorb(&mut self, src: &[u8]);
    /// The header, once the whole body has been copied.
    fn header(&mut self) -> Vec<u8>;
}

/// `header_len` bytes of header then `body`, framed by `framer` into `out` (as long).
fn frame_into(
    header_len: usize,
    body: &[u8],
    framer: &mut dyn Framer,
    out: &mut [u8],
) -> Result<()> {
    let (head, rest) = out.split_at_mut(header_len.min(out.len()));
    framer.copy(body, rest);
    head.copy_from_slice(&checked_header(header_len, framer.header())?);
    Ok(())
}

/// How long a piece of a framed append waits for the copy of the piece before it (the
/// thread copying that is running: this only bounds a bug).
const TURN_WAIT: std::time::Duration = std::time::Duration::from_secs(60);

/// The operating system's files through `std::fs`, the aligned appends and reads with
/// `O_DIRECT` on the engine it was made with ([`OsDisk::with_io`]). Every error is an [`Error::Io`] naming
/// the path, a full disk included (`ENOSPC`, after which the file may hold part of the
/// write: callers cut it back). The files it appends to and reads blocks from stay open
/// between calls (a few of each), so a small block costs its I/O rather than an open and a
/// close; removing, renaming, replacing or cutting a file closes its handles first.
#[derive(Debug)]
pub struct OsDisk {
    appending: Mutex<Vec<(PathBuf, Arc<Appending>)>>,
    direct: Mutex<Vec<(PathBuf, Arc<DirectFile>)>>,
    io: Io,
}

impl Default for OsDisk {
    fn default() -> Self {
        OsDisk {
            appending: Mutex::default(),
            direct: Mutex::default(),
            io: Io::threads(),
        }
    }
}

/// A file [`OsDisk::append`] keeps open, with its length once known: an append (the index
/// log's record after every put) then needs no `statx` to learn where it lands. Only this
/// disk changes the file while the handle is kept: cutting, replacing, renaming or removing
/// it closes the handle, a direct-I/O append to it forgets the length.
#[derive(Debug)]
struct Appending {
    file: File,
    end: Mutex<Option<u64>>,
}

/// Handles [`OsDisk`] keeps open per kind.
const KEEP_OPEN: usize = 8;

/// The handle for `path` in `cache`, opened by `open` when absent (the oldest handle is
/// closed when the cache is full).
fn kept<F>(
    cache: &Mutex<Vec<(PathBuf, Arc<F>)>>,
    path: &Path,
    open: impl FnOnce() -> Result<F>,
) -> Result<Arc<F>> {
    let mut cache = cache.lock();
    if let Some((_, f)) = cache.iter().find(|(p, _)| p == path) {
        return Ok(f.clone());
    }
    let f = Arc::new(open()?);
    if cache.len() == KEEP_OPEN {
        cache.remove(0);
    }
    cache.push((path.to_path_buf(), f.clone()));
    Ok(f)
}

/// `head` when it is `len` bytes long, else `InvalidArgument`.
fn checked_header(len: usize, head: Vec<u8>) -> Result<Vec<u8>> {
    if head.len() != len {
        return Err(Error::InvalidArgument(format!(
            "append_aligned_framed: a {}-byte header where {len} were announced",
            head.len()
        )));
    }
    Ok(head)
}

/// Writes bytes `from..from + out.len()` of `parts` laid one after another, zeros past
/// their end (the padding, not what the buffer held before), into `out`.
fn fill_from(parts: &[&[u8]], from: usize, out: &mut [u8]) {
    let mut at = 0; // where the current part starts in the concatenation
    let mut done = 0; // bytes of `out` written
    for part in parts {
        let end = at + part.len();
        let want = from + done;
        if want < end && done < out.len() {
            let src = &part[want - at..];
            let n = src.len().min(out.len() - done);
            out[done..done + n].copy_from_slice(&src[..n]);
            done += n;
        }
        at = end;
    }
    out[done..].fill(0);
}

/// The aligned start of a read of `len` bytes at `offset` and the bytes from there to the
/// read's end.
fn aligned_span(path: &Path, offset: u64, len: usize) -> Result<(u64, usize)> {
    let start = offset - offset % DIRECT_ALIGN;
    let end = offset
        .checked_add(len as u64)
        .ok_or_else(|| Error::InvalidArgument(format!("read past 2^64 in {path:?}")))?;
    let span = usize::try_from(end - start)
        .map_err(|_| Error::InvalidArgument(format!("a read of {len} bytes")))?;
    Ok((start, span))
}

impl OsDisk {
    /// `path` opened for direct I/O (kept): opening creates the file, so a missing one is
    /// an error here.
    fn kept_for_read(&self, path: &Path) -> Result<Arc<DirectFile>> {
        kept(&self.direct, path, || {
            if !path.exists() {
                return Err(Error::io(path, std::io::Error::from(ErrorKind::NotFound)));
            }
            DirectFile::open_with(path, self.io)
        })
    }

    /// The direct I/O on the thread pool.
    pub fn new() -> OsDisk {
        OsDisk::default()
    }

    /// The direct I/O on the engine `io` resolves to on this kernel ([`DiskIo::resolve`]):
    /// `Auto` falls back to the thread pool where no ring can be set up.
    pub fn with_io(io: DiskIo) -> Result<OsDisk> {
        Ok(OsDisk::on(io.resolve()?))
    }

    /// The direct I/O on `io`, resolved already.
    pub fn on(io: Io) -> OsDisk {
        OsDisk {
            io,
            ..OsDisk::default()
        }
    }

    /// The direct-I/O handle for appending to `path` (kept); the appending handle's length
    /// is forgotten, as this append changes it.
    fn kept_for_append(&self, path: &Path) -> Result<Arc<DirectFile>> {
        if let Some((_, a)) = self.appending.lock().iter().find(|(p, _)| p == path) {
            *a.end.lock() = None;
        }
        kept(&self.direct, path, || DirectFile::open_with(path, self.io))
    }

    /// Closes the handles kept for `path`.
    fn forget(&self, path: &Path) {
        self.appending.lock().retain(|(p, _)| p != path);
        self.direct.lock().retain(|(p, _)| p != path);
    }
}

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
        if let Some((_, direct)) = self.direct.lock().iter().find(|(p, _)| p == path) {
            direct.forget_end();
        }
        let kept = kept(&self.appending, path, || {
            let file = OpenOptions::new()
                .append(true)
                .create(true)
                .open(path)
                .map_err(|e| Error::io(path, e))?;
            let end = Mutex::new(None);
            Ok(Appending { file, end })
        })?;
        let mut end = kept.end.lock();
        let offset = match *end {
            Some(at) => at,
            None => kept.file.metadata().map_err(|e| Error::io(path, e))?.len(),
        };
        // After a failed write the length is unknown (part of it may have landed).
        *end = None;
        (&kept.file)
            .write_all(bytes)
            .map_err(|e| Error::io(path, e))?;
        *end = offset.checked_add(bytes.len() as u64);
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

    fn append_aligned(&self, path: &Path, parts: &[&[u8]]) -> Result<u64> {
        let file = self.kept_for_append(path)?;
        let total = parts
            .iter()
            .try_fold(0usize, |n, p| n.checked_add(p.len()))
            .ok_or_else(|| Error::InvalidArgument("an append past usize::MAX".into()))?;
        file.append_with(total, |offset| {
            with_scratch(total, |buf| {
                let depth = queue_depth(total);
                if depth <= 1 {
                    fill_from(parts, 0, buf.as_mut_slice());
                    return file.write_at_depth(buf, offset, depth);
                }
                // Each writing thread copies its own piece in first: the copying of the later
                // pieces overlaps the writes of the earlier ones.
                let fill = |at: usize, piece: &mut [u8]| {
                    fill_from(parts, at, piece);
                    Ok(())
                };
                file.write_at_depth_filled(buf, 0, offset, &fill)
            })
        })
    }

    fn append_aligned_filled(
        &self,
        path: &Path,
        len: usize,
        fill: &mut dyn FnMut(&mut [u8]) -> Result<()>,
    ) -> Result<u64> {
        let file = self.kept_for_append(path)?;
        file.append_with(len, |offset| {
            with_scratch(len, |buf| {
                let (bytes, pad) = buf.as_mut_slice().split_at_mut(len);
                fill(bytes)?;
                pad.fill(0);
                file.write_at_depth(buf, offset, queue_depth(len))
            })
        })
    }

    fn append_aligned_framed(
        &self,
        path: &Path,
        header_len: usize,
        body: &[u8],
        framer: &mut dyn Framer,
    ) -> Result<u64> {
        const PAGE: usize = DIRECT_ALIGN as usize;
        let total = header_len
            .checked_add(body.len())
            .ok_or_else(|| Error::InvalidArgument("an append past usize::MAX".into()))?;
        if queue_depth(total) <= 1 || header_len > PAGE || total <= PAGE {
            let mut fill = |out: &mut [u8]| frame_into(header_len, body, framer, out);
            return self.append_aligned_filled(path, total, &mut fill);
        }
        let file = self.kept_for_append(path)?;
        // The body's pieces past the first page go out as soon as each is copied, the first
        // page (it holds the header) once the framer has taken the whole body, beside the
        // pieces still in flight (after them, it was a serial tail). Where the ring has every
        // piece in flight at once, they are copied alone and the first page's filling takes
        // the checksum from `body` itself ([`Framer::absorb`]) while they are out: the ring's
        // one thread no longer holds the first pieces back to checksum the later ones. Else
        // each piece is copied and checksummed in one pass in order (threads take turns), so
        // that no I/O slot waits through a whole-body checksum.
        file.append_with(total, |offset| {
            with_scratch(total, |buf| {
                // No header (a bare block): the pieces are the body's, copied and hashed in
                // order as each goes out.
                let (page, rest) = if header_len == 0 {
                    (None, buf.as_mut_slice())
                } else {
                    let (page, rest) = buf.as_mut_slice().split_at_mut(PAGE);
                    (Some(page), rest)
                };
                let body_at = offset + if page.is_some() { PAGE as u64 } else { 0 };
                let piece = piece_bytes(rest.len());
                let mut pieces: Vec<&mut [u8]> = rest.chunks_mut(piece).collect();
                let mut offsets = direct::piece_offsets(body_at, piece, pieces.len());
                let data_pieces = pieces.len();
                let in_order = page.is_none()
                    || file.io().engine != Engine::Uring
                    || data_pieces > file.io().queue_depth;
                if let Some(page) = page {
                    pieces.push(page);
                    offsets.push(offset);
                }
                // Body bytes in the first page (total > PAGE), none without a header page.
                let first = if header_len == 0 {
                    0
                } else {
                    PAGE - header_len
                };
                // The next piece to take its turn through the framer, and the framer.
                let turn = parking_lot::Mutex::new((0usize, &mut *framer));
                let turned = parking_lot::Condvar::new();
                let fill = |k: usize, bytes: &mut [u8]| -> Result<()> {
                    let mut t = turn.lock();
                    if in_order {
                        while t.0 != k {
                            if turned.wait_for(&mut t, TURN_WAIT).timed_out() {
                                return Err(Error::InvalidArgument(format!(
                                    "a framed append: piece {k} waited for the copy before it"
                                )));
                            }
                        }
                    } else if k < data_pieces {
                        drop(t);
                        let from = (first + k * piece).min(body.len());
                        let n = bytes.len().min(body.len() - from);
                        let (own, pad) = bytes.split_at_mut(n);
                        own.copy_from_slice(&body[from..from + n]);
                        pad.fill(0);
                        return Ok(());
                    }
                    let framer = &mut t.1;
                    if k < data_pieces {
                        let from = (first + k * piece).min(body.len());
                        let n = bytes.len().min(body.len() - from);
                        let (own, pad) = bytes.split_at_mut(n);
                        if k == 0 {
                            framer.absorb(&body[..first]);
                        }
                        framer.copy(&body[from..from + n], own);
                        pad.fill(0);
                    } else {
                        let (head, own) = bytes.split_at_mut(header_len);
                        if in_order {
                            own.copy_from_slice(&body[..first]);
                        } else {
                            framer.copy(&body[..first], own);
                            framer.absorb(&body[first..]);
                        }
                        head.copy_from_slice(&checked_header(header_len, framer.header())?);
                    }
                    t.0 = k + 1;
                    drop(t);
                    turned.notify_all();
                    Ok(())
                };
                file.write_pieces_filled(pieces, &offsets, &fill)
            })
        })
    }

    fn append_aligned_taking(
        &self,
        path: &Path,
        data: &[u8],
        take: &mut dyn FnMut(&[u8]),
    ) -> Result<u64> {
        let len = data.len();
        if queue_depth(len) > 1 {
            take(data);
            return self.append_aligned(path, &[data]);
        }
        let file = self.kept_for_append(path)?;
        file.append_with(len, |offset| {
            // Taken once whatever happens after: a refused in-place write is redone bounced
            // without taking the bytes again.
            let mut taken = false;
            if let Some(plan) = file.in_place_plan(data, offset, dio::Op::Write) {
                let r = if plan.bounce == 0 {
                    let mut once = || {
                        taken = true;
                        take(data);
                    };
                    file.write_during(data, offset, &mut once)
                } else {
                    // The block's whole sectors from where they lie, its last partial sector
                    // and the zero pad from a bounce, in one write.
                    taken = true;
                    take(data);
                    with_scratch(plan.bounce, |buf| {
                        let bounce = &mut buf.as_mut_slice()[..plan.bounce];
                        let (tail, pad) = bounce.split_at_mut(len - plan.head);
                        tail.copy_from_slice(&data[plan.head..]);
                        pad.fill(0);
                        file.write_vectored(&[&data[..plan.head], bounce], offset)
                    })
                };
                if let Some(r) = file.after_in_place(r) {
                    return r;
                }
            }
            let mut taken_already = |_: &[u8]| {};
            let take: &mut dyn FnMut(&[u8]) = match taken {
                true => &mut taken_already,
                false => take,
            };
            with_scratch(len, |buf| {
                let (bytes, pad) = buf.as_mut_slice().split_at_mut(len);
                pad.fill(0);
                if file.io().engine == Engine::Uring {
                    bytes.copy_from_slice(data);
                    return file.write_during(buf.as_slice(), offset, &mut || take(data));
                }
                // Each chunk taken from the cache right after its copy.
                let chunk = crate::tier::codec::COPY_CHUNK;
                for (s, d) in data.chunks(chunk).zip(bytes.chunks_mut(chunk)) {
                    d.copy_from_slice(s);
                    take(d);
                }
                stamp::mark("put: copy + xxh3");
                let r = file.write_slice(buf.as_slice(), offset);
                stamp::mark("put: pwrite");
                r
            })
        })
    }

    fn read_aligned_into(
        &self,
        path: &Path,
        offset: u64,
        out: &mut [u8],
        each: &(dyn Fn(usize, &[u8]) -> Result<()> + Sync),
    ) -> Result<Option<usize>> {
        let file = self.kept_for_read(path)?;
        let Some(plan) = file.in_place_plan(out, offset, dio::Op::Read) else {
            return Ok(None);
        };
        // Refused: `None`, the caller reads it again through a bounce buffer (what landed in
        // `out` is overwritten or zeroed there, never handed back unverified).
        let r = file.read_in_place_planned(out, offset, plan, each);
        file.after_in_place(r).transpose()
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
        let file = self.kept_for_read(path)?;
        let (start, span) = aligned_span(path, offset, len)?;
        with_scratch(span, |buf| {
            stamp::mark("get: handle, plan");
            let filled = file.read_at_depth(buf, start, queue_depth(span))?;
            stamp::mark("get: pread");
            let skip = (offset - start) as usize;
            let got = filled.saturating_sub(skip).min(len);
            let r = use_bytes(&buf.as_slice()[skip..skip + got]);
            stamp::mark("get: copy out + xxh3");
            r
        })
    }

    fn read_aligned_each(
        &self,
        path: &Path,
        offset: u64,
        len: usize,
        each: &(dyn Fn(usize, &[u8]) -> Result<()> + Sync),
    ) -> Result<usize> {
        let file = self.kept_for_read(path)?;
        let (start, span) = aligned_span(path, offset, len)?;
        let skip = (offset - start) as usize;
        with_scratch(span, |buf| {
            // A piece holds span bytes `first`.., the caller's `at` = that − skip, clipped to
            // 0..len.
            let clip = |first: usize, bytes: &[u8]| -> Result<()> {
                let from = skip.saturating_sub(first).min(bytes.len());
                let at = (first + from).saturating_sub(skip);
                let to = bytes.len().min((len + skip).saturating_sub(first));
                if from < to {
                    each(at, &bytes[from..to])?;
                }
                Ok(())
            };
            let filled = file.read_at_depth_each(buf, start, &clip)?;
            Ok(filled.saturating_sub(skip).min(len))
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
        self.forget(path);
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
        self.forget(path);
        File::create(path)
            .and_then(|mut f| f.write_all(bytes))
            .map_err(|e| Error::io(path, e))
    }

    fn rename(&self, from: &Path, to: &Path) -> Result<()> {
        self.forget(from);
        self.forget(to);
        std::fs::rename(from, to).map_err(|e| Error::io(from, e))
    }

    fn remove(&self, path: &Path) -> Result<()> {
        self.forget(path);
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

    fn io(&self) -> Option<Io> {
        Some(self.io)
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

/// A full disk's error, as both disks report it (the tests of each).
#[cfg(test)]
fn is_no_space(e: &Error) -> bool {
    matches!(e, Error::Io { source, .. } if source.raw_os_error() == Some(libc::ENOSPC))
}

#[cfg(test)]
mod tests;
