//! Direct I/O: buffers aligned for `O_DIRECT`, kept per thread, and files opened with it
//! (or through the page cache where the file system refuses it).

use std::fs::{File, OpenOptions};
use std::io::ErrorKind;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use crate::error::{Error, Result};
use crate::transfer::Workers;

use super::dio::{self, DioAlign, InPlace, Op};
use super::engine::{Engine, Io};
use super::uring::{self, Hooks, Pieces};
use super::DIRECT_ALIGN;

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

/// The largest aligned buffer a thread keeps between direct I/Os: a 64 MiB block with its
/// frame header and alignment (larger blocks get a buffer of their own each time).
const SCRATCH_KEEP: usize = (64 << 20) + (64 << 10);

thread_local! {
    /// This thread's aligned buffer for [`OsDisk`]'s direct I/O: a fresh one per call would
    /// be zeroed memory straight from the kernel, faulted in page by page, which cost more
    /// than the I/O itself at 4 MiB (bench/NOTES.md, the tier store's disk).
    static SCRATCH: std::cell::RefCell<Option<AlignedBuf>> = const { std::cell::RefCell::new(None) };
}

/// Runs `f` on an aligned buffer of `len` bytes (rounded up): this thread's kept one when
/// it is large enough, else a new one (kept when at most [`SCRATCH_KEEP`]).
pub(super) fn with_scratch<R>(
    len: usize,
    f: impl FnOnce(&mut AlignedBuf) -> Result<R>,
) -> Result<R> {
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

thread_local! {
    /// I/Os this thread moved in place (straight from or into the caller's memory).
    static IN_PLACE: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

/// How many I/Os this thread has moved in place, with no bounce buffer for the caller's
/// memory beside a last partial sector ([`DioAlign`]): which path an op took, for tests and
/// benches (an op under [`SPLIT_FROM`] runs its I/O on the calling thread).
pub fn in_place_ios() -> u64 {
    IN_PLACE.with(|n| n.get())
}

fn count_in_place() {
    IN_PLACE.with(|n| n.set(n.get() + 1));
}

/// Whether `e` is the kernel refusing an I/O's alignment (`EINVAL`): a file system whose
/// `statx` answer was wider than it honours.
fn refused(e: &Error) -> bool {
    matches!(e, Error::Io { source, .. } if source.raw_os_error() == Some(libc::EINVAL))
}

/// Direct I/Os from this many bytes are split into pieces in flight at once: a virtual disk
/// serves large blocks faster at a queue depth above one, and the store's copy and checksum
/// of one piece overlap the I/O of the others.
pub const SPLIT_FROM: usize = 4 << 20;
/// The smallest and the largest piece of a split I/O: 4 MiB pieces of a 4 MiB block would
/// leave nothing in flight beside the first, 1 MiB pieces of 64 MiB ran a third slower than
/// 4 MiB ones on the build VM's virtual disk (bench/NOTES.md, eighth session).
const PIECE_MIN: usize = 1 << 20;
const PIECE_MAX: usize = 4 << 20;
/// How long a landing thread waits for a piece before giving up (a reading thread gone).
const LAND_WAIT: std::time::Duration = std::time::Duration::from_secs(60);
/// Pieces of a split I/O in flight at once.
pub const QUEUE_DEPTH: usize = 4;

/// The queue depth [`OsDisk`](super::OsDisk) gives a direct I/O of `len` bytes.
pub fn queue_depth(len: usize) -> usize {
    if len >= SPLIT_FROM {
        QUEUE_DEPTH
    } else {
        1
    }
}

/// The bytes of each piece (the last may be shorter) of a direct I/O of `len` bytes: all of
/// it below [`SPLIT_FROM`], else about a [`QUEUE_DEPTH`]th of it in whole MiB, 1 to 4 MiB.
pub fn piece_bytes(len: usize) -> usize {
    if len < SPLIT_FROM {
        return len.max(1);
    }
    (len / QUEUE_DEPTH / PIECE_MIN * PIECE_MIN).clamp(PIECE_MIN, PIECE_MAX)
}

/// The threads that keep a split I/O's pieces in flight (the caller is one of them): made
/// once, as spawning a thread per piece cost tens of µs each.
fn io_threads() -> &'static Workers {
    static POOL: std::sync::OnceLock<Workers> = std::sync::OnceLock::new();
    POOL.get_or_init(|| Workers::new(QUEUE_DEPTH, None))
}

/// Runs `io(k)` for every piece `k` of `pieces` on up to [`QUEUE_DEPTH`] threads, each
/// taking the next piece; the results in piece order, or the first error.
fn in_flight(pieces: usize, io: impl Fn(usize) -> Result<usize> + Sync) -> Result<Vec<usize>> {
    let done = parking_lot::Mutex::new(vec![0usize; pieces]);
    let failed = parking_lot::Mutex::new(None::<Error>);
    // Every piece runs even after one failed (simpler than cancelling the rest; the append
    // cuts off whatever landed).
    io_threads().run(pieces, &|k| match io(k) {
        Ok(n) => done.lock()[k] = n,
        Err(e) => {
            failed.lock().get_or_insert(e);
        }
    })?;
    match failed.into_inner() {
        Some(e) => Err(e),
        None => Ok(done.into_inner()),
    }
}

/// The bytes a split read of pieces of `piece` bytes read: up to the first short piece.
fn total_read(filled: &[usize], piece: usize) -> usize {
    let mut total = 0;
    for &n in filled {
        total += n;
        if n < piece {
            break;
        }
    }
    total
}

/// What a split read hands each piece to as it lands: `(at, bytes)`.
pub(super) type Landing<'a> = &'a (dyn Fn(usize, &[u8]) -> Result<()> + Sync);

/// Where each of `count` pieces of `piece` bytes from `offset` starts in the file.
pub(super) fn piece_offsets(offset: u64, piece: usize, count: usize) -> Vec<u64> {
    (0..count).map(|k| offset + (k * piece) as u64).collect()
}

/// A file opened for direct I/O (`O_DIRECT`), or through the page cache where the file
/// system refuses it (`EINVAL`: tmpfs and others); [`DirectFile::is_direct`] says which. Its
/// I/O runs on the engine it was opened with ([`Io`]): this thread's io_uring ring, or
/// blocking calls with a split I/O's pieces on a thread pool.
#[derive(Debug)]
pub struct DirectFile {
    file: File,
    path: PathBuf,
    direct: bool,
    /// What `O_DIRECT` asks of its I/O, queried once at open ([`DioAlign::of`]).
    align: DioAlign,
    /// Cleared after the kernel refused an in-place I/O: every I/O then goes through a
    /// bounce buffer, as it did before `statx` was asked.
    in_place: std::sync::atomic::AtomicBool,
    io: Io,
    /// Where the next aligned append starts, known after this handle's own appends (an
    /// fstat per append cost 2-5 µs on the build VM, a few % of a 64 KiB write).
    next_append: parking_lot::Mutex<Option<u64>>,
}

impl DirectFile {
    /// Opens `path` for reading and writing, created when absent, for I/O on the thread
    /// pool.
    pub fn open(path: &Path) -> Result<DirectFile> {
        DirectFile::open_with(path, Io::threads())
    }

    /// As [`open`](Self::open), the I/O on `io`'s engine (resolved by
    /// [`DiskIo::resolve`](super::DiskIo::resolve)).
    pub fn open_with(path: &Path, io: Io) -> Result<DirectFile> {
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
        let align = match direct {
            true => DioAlign::of(&file),
            false => DioAlign::BUFFERED,
        };
        Ok(DirectFile {
            file,
            path: path.to_path_buf(),
            direct,
            align,
            in_place: std::sync::atomic::AtomicBool::new(true),
            io,
            next_append: parking_lot::Mutex::new(None),
        })
    }

    pub fn is_direct(&self) -> bool {
        self.direct
    }

    /// The engine and queue depth its I/O runs on.
    pub fn io(&self) -> Io {
        self.io
    }

    /// `pieces` at `offsets` on this thread's ring, `depth` in flight; the bytes each moved.
    fn on_ring(
        &self,
        pieces: Pieces<'_>,
        offsets: &[u64],
        depth: usize,
        before: &mut dyn FnMut(usize, &mut [u8]) -> Result<()>,
        after: &mut dyn FnMut(usize, &[u8]) -> Result<()>,
    ) -> Result<Vec<usize>> {
        let hooks = Hooks { before, after };
        uring::run(&self.path, &self.file, pieces, offsets, depth, hooks)
    }

    /// Writes all of `bytes` at `offset` with one ring entry (and more after a short write).
    fn write_ring(&self, bytes: &[u8], offset: u64) -> Result<()> {
        let none = &mut |_: usize, _: &mut [u8]| Ok(());
        let after = &mut |_: usize, _: &[u8]| Ok(());
        self.on_ring(Pieces::Write(vec![bytes]), &[offset], 1, none, after)
            .map(drop)
    }

    /// The ring's depth for a split I/O the caller asked `depth` of (one: not split).
    fn ring_depth(&self, depth: usize) -> usize {
        if depth <= 1 {
            1
        } else {
            self.io.queue_depth
        }
    }

    /// The file's length in bytes.
    pub fn size(&self) -> Result<u64> {
        Ok(self
            .file
            .metadata()
            .map_err(|e| Error::io(&self.path, e))?
            .len())
    }

    /// The aligned offset past the file's end where an append of `len` bytes goes, and
    /// `write(offset)`, which writes them there: the end after it is remembered when it
    /// succeeds; when it fails the file is cut back to that offset.
    pub(super) fn append_with(
        &self,
        len: usize,
        write: impl FnOnce(u64) -> Result<()>,
    ) -> Result<u64> {
        let known = *self.next_append.lock();
        let offset = match known {
            Some(at) => at,
            None => {
                let size = self.size()?;
                size + super::pad_to_align(size)
            }
        };
        let end = u64::try_from(len)
            .ok()
            .and_then(|n| n.checked_add(super::pad_to_align(n)))
            .and_then(|n| n.checked_add(offset))
            .ok_or_else(|| Error::InvalidArgument(format!("an append of {len} bytes")))?;
        *self.next_append.lock() = None;
        if let Err(e) = write(offset) {
            // Cut off what part of it landed (a full disk's pieces): its space comes back now
            // rather than at the store's next compaction. The file was at most `offset` long.
            if let Err(cut) = self.file.set_len(offset) {
                tracing::warn!(path = %self.path.display(), "could not cut a failed append off: {cut}");
            }
            return Err(e);
        }
        *self.next_append.lock() = Some(end);
        Ok(offset)
    }

    /// Forgets where the file ends (someone appended to it another way).
    pub(super) fn forget_end(&self) {
        *self.next_append.lock() = None;
    }

    /// Writes all of `buf` at `offset` (a multiple of [`DIRECT_ALIGN`]).
    pub fn write_at(&self, buf: &AlignedBuf, offset: u64) -> Result<()> {
        self.write_slice(buf.as_slice(), offset)
    }

    /// Writes `bytes` (from an [`AlignedBuf`], aligned start and length) at `offset`.
    pub(super) fn write_slice(&self, bytes: &[u8], offset: u64) -> Result<()> {
        if self.io.engine == Engine::Uring {
            return self.write_ring(bytes, offset);
        }
        self.file
            .write_all_at(bytes, offset)
            .map_err(|e| Error::io(&self.path, e))
    }

    /// This handle believing `align` whatever the file system said (a file system that
    /// claims less than it honours, for the tests of the fall back).
    #[cfg(test)]
    pub(super) fn claiming(mut self, align: DioAlign) -> DirectFile {
        self.align = align;
        self
    }

    /// What `O_DIRECT` asks of this file's I/O ([`DioAlign::BUFFERED`] where it is not
    /// direct).
    pub fn align(&self) -> DioAlign {
        self.align
    }

    /// How an I/O of `bytes` at `offset` moves in place ([`dio::plan`] under this file's
    /// alignment); `None` where it cannot, or after the kernel refused one.
    pub(super) fn in_place_plan(&self, bytes: &[u8], offset: u64, op: Op) -> Option<InPlace> {
        if !self.in_place.load(std::sync::atomic::Ordering::Relaxed) {
            return None;
        }
        dio::plan(self.align, bytes.as_ptr() as usize, bytes.len(), offset, op)
    }

    /// Whether direct I/O can move all of `bytes` at `offset` as they lie, in one I/O with
    /// no bounce at all (`in_place_plan` with nothing bounced).
    pub fn can_move_in_place(&self, bytes: &[u8], offset: u64) -> bool {
        [Op::Read, Op::Write].iter().all(|&op| {
            self.in_place_plan(bytes, offset, op)
                .is_some_and(|p| p.bounce == 0)
        })
    }

    /// The outcome of an in-place I/O: counted when it succeeded; `None` (go through a
    /// bounce buffer) after the kernel refused its alignment, from then on for this file.
    pub(super) fn after_in_place<T>(&self, r: Result<T>) -> Option<Result<T>> {
        match r {
            Err(e) if refused(&e) => {
                tracing::warn!(
                    path = %self.path.display(),
                    align = ?self.align,
                    "O_DIRECT refused an I/O in place; bouncing this file's I/O from now on"
                );
                self.in_place
                    .store(false, std::sync::atomic::Ordering::Relaxed);
                None
            }
            r => {
                if r.is_ok() {
                    count_in_place();
                }
                Some(r)
            }
        }
    }

    /// Writes `parts` one after another at `offset` in one vectored write (`pwritev`, on the
    /// calling thread whatever the engine: a second I/O for a block's last sector would wait
    /// behind the first where the write extends the file).
    pub(super) fn write_vectored(&self, parts: &[&[u8]], offset: u64) -> Result<()> {
        use std::io::IoSlice;
        let mut slices: Vec<IoSlice<'_>> = parts.iter().map(|p| IoSlice::new(p)).collect();
        let mut rest = &mut slices[..];
        let mut at = offset;
        while !rest.is_empty() {
            match rustix::io::pwritev(&self.file, rest, at) {
                Ok(0) => {
                    let e = std::io::Error::from(ErrorKind::WriteZero);
                    return Err(Error::io(&self.path, e));
                }
                Ok(n) => {
                    IoSlice::advance_slices(&mut rest, n);
                    at += n as u64;
                }
                Err(rustix::io::Errno::INTR) => {}
                Err(e) => return Err(Error::io(&self.path, e.into())),
            }
        }
        Ok(())
    }

    /// Reads into `parts` one after another from `offset` in one vectored read (`preadv`, on
    /// the calling thread) until they are full or the file ends; the bytes read.
    pub(super) fn read_vectored(&self, parts: &mut [&mut [u8]], offset: u64) -> Result<usize> {
        use std::io::IoSliceMut;
        let mut slices: Vec<IoSliceMut<'_>> =
            parts.iter_mut().map(|p| IoSliceMut::new(p)).collect();
        let mut rest = &mut slices[..];
        let mut done = 0usize;
        while !rest.is_empty() {
            match rustix::io::preadv(&self.file, rest, offset + done as u64) {
                Ok(0) => break,
                Ok(n) => {
                    IoSliceMut::advance_slices(&mut rest, n);
                    done += n;
                }
                Err(rustix::io::Errno::INTR) => {}
                Err(e) => return Err(Error::io(&self.path, e.into())),
            }
        }
        Ok(done)
    }

    /// As [`read_in_place_each`](Self::read_in_place_each) under `plan`: its whole sectors
    /// straight into `out`, the last partial sector through an aligned buffer (in the same
    /// `preadv` under [`SPLIT_FROM`], after the pieces from there), copied into `out`'s tail;
    /// `each` is handed `out`'s parts in order. The bytes read.
    pub(super) fn read_in_place_planned(
        &self,
        out: &mut [u8],
        offset: u64,
        plan: InPlace,
        each: Landing<'_>,
    ) -> Result<usize> {
        if plan.bounce == 0 {
            return self.read_in_place_each(out, offset, each);
        }
        let (head, rest) = out.split_at_mut(plan.head.min(out.len()));
        let head_len = head.len();
        with_scratch(plan.bounce, |buf| {
            let tail = &mut buf.as_mut_slice()[..plan.bounce];
            let got = if head_len >= SPLIT_FROM {
                let n = self.read_in_place_each(head, offset, each)?;
                if n < head_len {
                    return Ok(n);
                }
                self.fill(tail, offset + head_len as u64)?
            } else {
                let n = self.read_vectored(&mut [&mut *head, &mut *tail], offset)?;
                each(0, &head[..n.min(head_len)])?;
                if n <= head_len {
                    return Ok(n);
                }
                n - head_len
            };
            let t = got.min(rest.len());
            rest[..t].copy_from_slice(&tail[..t]);
            each(head_len, &rest[..t])?;
            Ok(head_len + t)
        })
    }

    /// Writes `bytes` (aligned, or not direct: [`can_move_in_place`](Self::can_move_in_place))
    /// at `offset` in one I/O, calling `during` once on this thread while it is out on the
    /// ring (the threads' blocking write cannot overlap it: there it runs first).
    pub(super) fn write_during(
        &self,
        bytes: &[u8],
        offset: u64,
        during: &mut dyn FnMut(),
    ) -> Result<()> {
        if self.io.engine == Engine::Uring {
            let mut called = false;
            let mut once = || {
                called = true;
                during();
            };
            let none = &mut |_: usize, _: &mut [u8]| Ok(());
            let after = &mut |_: usize, _: &[u8]| Ok(());
            let hooks = Hooks {
                before: none,
                after,
            };
            let pieces = Pieces::Write(vec![bytes]);
            let r = uring::run_during(
                &self.path,
                &self.file,
                pieces,
                &[offset],
                1,
                hooks,
                Some(&mut once),
            );
            if !called {
                during();
            }
            return r.map(drop);
        }
        during();
        crate::tier::disk::stamp::mark("put: xxh3");
        let r = self
            .file
            .write_all_at(bytes, offset)
            .map_err(|e| Error::io(&self.path, e));
        crate::tier::disk::stamp::mark("put: pwrite");
        r
    }

    /// Reads into `out` (aligned, or not direct: [`can_move_in_place`](Self::can_move_in_place))
    /// from `offset` until it is full or the file ends, in pieces in flight at once from
    /// [`SPLIT_FROM`] bytes, handing each piece to `each(at, bytes)` in order as it lands (a
    /// checksum taken while the later pieces are read); the bytes read.
    pub(super) fn read_in_place_each(
        &self,
        out: &mut [u8],
        offset: u64,
        each: Landing<'_>,
    ) -> Result<usize> {
        let piece = piece_bytes(out.len());
        let filled = if self.io.engine == Engine::Uring {
            let depth = self.ring_depth(queue_depth(out.len()));
            let pieces: Vec<&mut [u8]> = out.chunks_mut(piece).collect();
            let offsets = piece_offsets(offset, piece, pieces.len());
            let none = &mut |_: usize, _: &mut [u8]| Ok(());
            let after = &mut |k: usize, bytes: &[u8]| each(k * piece, bytes);
            self.on_ring(Pieces::Read(pieces), &offsets, depth, none, after)?
        } else {
            let pieces: Vec<parking_lot::Mutex<&mut [u8]>> =
                out.chunks_mut(piece).map(parking_lot::Mutex::new).collect();
            let read = |k: usize| {
                let mut bytes = pieces[k].lock();
                self.fill(&mut bytes, offset + (k * piece) as u64)
            };
            if pieces.len() == 1 {
                crate::tier::disk::stamp::mark("get: handle, plan");
                let n = read(0)?;
                crate::tier::disk::stamp::mark("get: pread");
                each(0, &pieces[0].lock()[..n])?;
                crate::tier::disk::stamp::mark("get: xxh3");
                vec![n]
            } else {
                self.read_landing(&pieces, piece, &read, each)?
            }
        };
        Ok(total_read(&filled, piece))
    }

    /// Fills `buf` from `offset` (a multiple of [`DIRECT_ALIGN`]); returns the bytes read,
    /// fewer only at the end of the file.
    pub fn read_at(&self, buf: &mut AlignedBuf, offset: u64) -> Result<usize> {
        self.fill(buf.as_mut_slice(), offset)
    }

    /// As [`write_at`](Self::write_at) with pieces of the buffer ([`piece_bytes`]) in flight
    /// at once, where `depth` is above one and the buffer spans more than one piece.
    pub fn write_at_depth(&self, buf: &AlignedBuf, offset: u64, depth: usize) -> Result<()> {
        let data = buf.as_slice();
        let piece = piece_bytes(data.len());
        if depth <= 1 || data.len() <= piece {
            return self.write_at(buf, offset);
        }
        let pieces: Vec<&[u8]> = data.chunks(piece).collect();
        if self.io.engine == Engine::Uring {
            let offsets = piece_offsets(offset, piece, pieces.len());
            let none = &mut |_: usize, _: &mut [u8]| Ok(());
            let after = &mut |_: usize, _: &[u8]| Ok(());
            let depth = self.ring_depth(depth);
            return self
                .on_ring(Pieces::Write(pieces), &offsets, depth, none, after)
                .map(drop);
        }
        in_flight(pieces.len(), |k| {
            self.file
                .write_all_at(pieces[k], offset + (k * piece) as u64)
                .map_err(|e| Error::io(&self.path, e))
                .map(|()| pieces[k].len())
        })
        .map(drop)
    }

    /// As [`write_at_depth`](Self::write_at_depth) for `buf`'s bytes from `skip` (a multiple
    /// of [`DIRECT_ALIGN`]; the bytes before it are not written), each piece first written
    /// into `buf` by `fill(at, piece)` (`at`: where it starts in `buf`) on the thread that then
    /// sends it, so filling the later pieces overlaps the writes of the earlier ones.
    pub fn write_at_depth_filled(
        &self,
        buf: &mut AlignedBuf,
        skip: usize,
        offset: u64,
        fill: &(dyn Fn(usize, &mut [u8]) -> Result<()> + Sync),
    ) -> Result<()> {
        let rest = buf.as_mut_slice().get_mut(skip..).unwrap_or_default();
        let piece = piece_bytes(rest.len());
        let pieces: Vec<&mut [u8]> = rest.chunks_mut(piece).collect();
        let offsets = piece_offsets(offset + skip as u64, piece, pieces.len());
        let fill = |k: usize, bytes: &mut [u8]| fill(skip + k * piece, bytes);
        self.write_pieces_filled(pieces, &offsets, &fill)
    }

    /// Writes each of `pieces` (aligned starts and lengths) at its offset in `offsets`, up
    /// to the engine's queue depth in flight at once, each first written by `fill(k, piece)`
    /// on the thread that then sends it, so filling the later pieces overlaps the writes of
    /// the earlier ones. The pieces need not be in file order (a frame's header page last).
    pub(super) fn write_pieces_filled(
        &self,
        pieces: Vec<&mut [u8]>,
        offsets: &[u64],
        fill: &(dyn Fn(usize, &mut [u8]) -> Result<()> + Sync),
    ) -> Result<()> {
        if offsets.len() != pieces.len() {
            return Err(Error::LengthMismatch {
                op: "direct write of pieces",
                left: pieces.len(),
                right: offsets.len(),
            });
        }
        if self.io.engine == Engine::Uring {
            // One thread fills the pieces in order, each going out as soon as it is full.
            let before = &mut |k: usize, bytes: &mut [u8]| fill(k, bytes);
            let after = &mut |_: usize, _: &[u8]| Ok(());
            let depth = self.io.queue_depth;
            return self
                .on_ring(Pieces::Fill(pieces), offsets, depth, before, after)
                .map(drop);
        }
        let pieces: Vec<parking_lot::Mutex<&mut [u8]>> =
            pieces.into_iter().map(parking_lot::Mutex::new).collect();
        in_flight(pieces.len(), |k| {
            let mut bytes = pieces[k].lock();
            fill(k, &mut bytes)?;
            self.file
                .write_all_at(&bytes, offsets[k])
                .map_err(|e| Error::io(&self.path, e))
                .map(|()| bytes.len())
        })
        .map(drop)
    }

    /// As [`read_at`](Self::read_at) with pieces ([`piece_bytes`]) in flight at once where
    /// `depth` is above one.
    pub fn read_at_depth(&self, buf: &mut AlignedBuf, offset: u64, depth: usize) -> Result<usize> {
        if depth <= 1 || buf.as_slice().len() <= piece_bytes(buf.as_slice().len()) {
            return self.read_at(buf, offset);
        }
        self.read_pieces(buf, offset, None)
    }

    /// As [`read_at_depth`](Self::read_at_depth), handing each piece to `each(at, bytes)` on
    /// the thread that read it as soon as it is in (`at`: where it starts in `buf`; `bytes`
    /// ends early only at the end of the file), so the caller's work on a piece overlaps the
    /// reads of the later ones. Returns the bytes read, as `read_at`.
    pub fn read_at_depth_each(
        &self,
        buf: &mut AlignedBuf,
        offset: u64,
        each: &(dyn Fn(usize, &[u8]) -> Result<()> + Sync),
    ) -> Result<usize> {
        self.read_pieces(buf, offset, Some(each))
    }

    /// The pieces of [`read_at_depth_each`](Self::read_at_depth_each), `each` (if any) given
    /// each piece as it lands. On the threads it runs on a landing thread of its own, in
    /// piece order, so the reading threads go straight on to their next pieces (run on the
    /// thread that read, the copy and checksum of 64 MiB held the queue below its depth).
    fn read_pieces(
        &self,
        buf: &mut AlignedBuf,
        offset: u64,
        each: Option<Landing<'_>>,
    ) -> Result<usize> {
        let piece = piece_bytes(buf.as_slice().len());
        let filled = if self.io.engine == Engine::Uring {
            let pieces: Vec<&mut [u8]> = buf.as_mut_slice().chunks_mut(piece).collect();
            let offsets = piece_offsets(offset, piece, pieces.len());
            let none = &mut |_: usize, _: &mut [u8]| Ok(());
            let after = &mut |k: usize, bytes: &[u8]| match each {
                Some(each) => each(k * piece, bytes),
                None => Ok(()),
            };
            let depth = self.io.queue_depth;
            self.on_ring(Pieces::Read(pieces), &offsets, depth, none, after)?
        } else {
            let pieces: Vec<parking_lot::Mutex<&mut [u8]>> = buf
                .as_mut_slice()
                .chunks_mut(piece)
                .map(parking_lot::Mutex::new)
                .collect();
            let read = |k: usize| {
                let mut bytes = pieces[k].lock();
                self.fill(&mut bytes, offset + (k * piece) as u64)
            };
            match each {
                None => in_flight(pieces.len(), read)?,
                Some(each) => self.read_landing(&pieces, piece, &read, each)?,
            }
        };
        Ok(total_read(&filled, piece))
    }

    /// Reads `pieces` (`read(k)` fills piece `k`) on the I/O threads while a landing thread
    /// hands each to `each(k × piece, bytes)` in order once it is in; the bytes each read.
    fn read_landing(
        &self,
        pieces: &[parking_lot::Mutex<&mut [u8]>],
        piece: usize,
        read: &(dyn Fn(usize) -> Result<usize> + Sync),
        each: &(dyn Fn(usize, &[u8]) -> Result<()> + Sync),
    ) -> Result<Vec<usize>> {
        // Per piece the bytes read once it is in; whether a read failed (the landing stops).
        let state = parking_lot::Mutex::new((vec![None::<usize>; pieces.len()], false));
        let landed = parking_lot::Condvar::new();
        std::thread::scope(|scope| {
            let lander = scope.spawn(|| -> Result<()> {
                for (k, bytes) in pieces.iter().enumerate() {
                    let n = {
                        let mut st = state.lock();
                        loop {
                            match (st.0[k], st.1) {
                                (_, true) => return Ok(()),
                                (Some(n), false) => break n,
                                (None, false) => {
                                    if landed.wait_for(&mut st, LAND_WAIT).timed_out() {
                                        return Err(Error::Timeout {
                                            what: format!("piece {k} of a read of {:?}", self.path),
                                            after_ms: LAND_WAIT.as_millis() as u64,
                                        });
                                    }
                                }
                            }
                        }
                    };
                    each(k * piece, &bytes.lock()[..n])?;
                }
                Ok(())
            });
            let read = in_flight(pieces.len(), |k| {
                let r = read(k);
                let mut st = state.lock();
                match &r {
                    Ok(n) => st.0[k] = Some(*n),
                    Err(_) => st.1 = true,
                }
                drop(st);
                landed.notify_all();
                r
            });
            if read.is_err() {
                // Past every piece: the landing thread stops at the first one not in.
                state.lock().1 = true;
                landed.notify_all();
            }
            let landing = lander.join().unwrap_or_else(|_| {
                Err(Error::InvalidArgument(format!(
                    "the landing thread of a read of {:?} panicked",
                    self.path
                )))
            });
            let done = read?;
            landing.map(|()| done)
        })
    }

    /// Reads into `window` from `offset` until it is full or the file ends; the bytes read.
    fn fill(&self, window: &mut [u8], offset: u64) -> Result<usize> {
        if self.io.engine == Engine::Uring {
            let none = &mut |_: usize, _: &mut [u8]| Ok(());
            let after = &mut |_: usize, _: &[u8]| Ok(());
            let done = self.on_ring(Pieces::Read(vec![window]), &[offset], 1, none, after)?;
            return Ok(done.iter().sum());
        }
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
