//! Direct I/O through io_uring: the pieces of one I/O submitted to this thread's ring, up to
//! the queue depth in flight at once, with the caller's work on a piece (filling it before
//! its write, taking it after its read) done on the calling thread while the others are in
//! the kernel's hands. Every call waits for all it submitted before it returns, so the
//! buffers the kernel reads and writes outlive its use of them.

use std::cell::RefCell;
use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::fs::FileExt;
use std::path::Path;

use io_uring::{cqueue, opcode, types, IoUring};

use crate::error::{Error, Result};

thread_local! {
    /// This thread's ring, made on first use and grown when a call wants a deeper one.
    static RING: RefCell<Option<IoUring>> = const { RefCell::new(None) };
}

/// Whether this kernel sets up a ring and runs `IORING_OP_READ` / `IORING_OP_WRITE` on it
/// (Linux 5.6 and later, unless disabled or filtered out).
pub fn probe() -> io::Result<()> {
    let ring = IoUring::new(2)?;
    let mut probe = io_uring::Probe::new();
    ring.submitter().register_probe(&mut probe)?;
    for (name, code) in [("read", opcode::Read::CODE), ("write", opcode::Write::CODE)] {
        if !probe.is_supported(code) {
            return Err(io::Error::new(
                io::ErrorKind::Unsupported,
                format!("io_uring without {name}"),
            ));
        }
    }
    Ok(())
}

/// The buffers of one I/O's pieces: read into, written from, or filled then written.
pub(super) enum Pieces<'a> {
    Read(Vec<&'a mut [u8]>),
    Write(Vec<&'a [u8]>),
    Fill(Vec<&'a mut [u8]>),
}

impl Pieces<'_> {
    fn len(&self) -> usize {
        match self {
            Pieces::Read(p) | Pieces::Fill(p) => p.len(),
            Pieces::Write(p) => p.len(),
        }
    }

    fn piece_len(&self, k: usize) -> usize {
        match self {
            Pieces::Read(p) | Pieces::Fill(p) => p[k].len(),
            Pieces::Write(p) => p[k].len(),
        }
    }

    /// The submission for piece `k`'s bytes from `done` on, at `offset` in the file.
    fn entry(&mut self, fd: RawFd, k: usize, done: usize, offset: u64) -> io_uring::squeue::Entry {
        // A piece is at most a split I/O's piece or a whole block of at most 256 MiB plus
        // its frame, well under u32::MAX; the kernel caps one I/O below that anyway.
        let len = |n: usize| u32::try_from(n - done).unwrap_or(u32::MAX);
        let fd = types::Fd(fd);
        let entry = match self {
            Pieces::Read(p) => {
                let buf = &mut p[k][done..];
                opcode::Read::new(fd, buf.as_mut_ptr(), len(p[k].len()))
                    .offset(offset)
                    .build()
            }
            Pieces::Fill(p) => {
                let buf = &p[k][done..];
                opcode::Write::new(fd, buf.as_ptr(), len(p[k].len()))
                    .offset(offset)
                    .build()
            }
            Pieces::Write(p) => {
                let buf = &p[k][done..];
                opcode::Write::new(fd, buf.as_ptr(), len(p[k].len()))
                    .offset(offset)
                    .build()
            }
        };
        entry.user_data(k as u64)
    }
}

/// What one I/O's caller does with its pieces on the calling thread.
pub(super) struct Hooks<'h> {
    /// Piece `k` is about to be written: fill it (for [`Pieces::Fill`]).
    pub before: &'h mut dyn FnMut(usize, &mut [u8]) -> Result<()>,
    /// Piece `k` is done with these bytes (fewer than its length only at the file's end).
    pub after: &'h mut dyn FnMut(usize, &[u8]) -> Result<()>,
}

/// Runs `pieces` (piece `k` at `offsets[k]` in `file`) on this thread's ring with up to
/// `depth` in flight; the bytes each moved, or the first error (after every piece
/// submitted has completed). A thread that cannot set a ring up (the locked-memory limit
/// older kernels charge rings to) runs them one by one with blocking calls instead.
pub(super) fn run(
    path: &Path,
    file: &File,
    pieces: Pieces<'_>,
    offsets: &[u64],
    depth: usize,
    hooks: Hooks<'_>,
) -> Result<Vec<usize>> {
    run_during(path, file, pieces, offsets, depth, hooks, None)
}

/// As [`run`], calling `during` once on this thread after the first pieces are submitted
/// and before waiting for them (a checksum taken while the I/O is out); without a ring it
/// runs before the blocking I/O.
pub(super) fn run_during(
    path: &Path,
    file: &File,
    mut pieces: Pieces<'_>,
    offsets: &[u64],
    depth: usize,
    hooks: Hooks<'_>,
    during: Option<&mut dyn FnMut()>,
) -> Result<Vec<usize>> {
    let depth = depth.max(1);
    let taken = RING.try_with(|r| r.borrow_mut().take()).ok().flatten();
    let made = match taken {
        Some(r) if r.params().sq_entries() as usize >= depth => Ok(r),
        _ => {
            let entries = u32::try_from(depth.next_power_of_two())
                .map_err(|_| Error::InvalidArgument(format!("a queue depth of {depth}")))?;
            IoUring::new(entries)
        }
    };
    let mut ring = match made {
        Ok(ring) => ring,
        Err(e) => {
            tracing::debug!("tier disk: no io_uring ring on this thread ({e}): blocking I/O");
            if let Some(during) = during {
                during();
            }
            return run_blocking(path, file, &mut pieces, offsets, hooks);
        }
    };
    let fd = file.as_raw_fd();
    let r = run_on(
        &mut ring,
        path,
        fd,
        &mut pieces,
        offsets,
        depth,
        hooks,
        during,
    );
    let _ = RING.try_with(|slot| *slot.borrow_mut() = Some(ring));
    r
}

/// [`run`] without a ring: each piece filled, moved by blocking calls and handed over in turn.
fn run_blocking(
    path: &Path,
    file: &File,
    pieces: &mut Pieces<'_>,
    offsets: &[u64],
    hooks: Hooks<'_>,
) -> Result<Vec<usize>> {
    let mut done = Vec::with_capacity(pieces.len());
    for (k, &offset) in offsets.iter().enumerate().take(pieces.len()) {
        let n = match pieces {
            Pieces::Write(p) => {
                file.write_all_at(p[k], offset)
                    .map_err(|e| Error::io(path, e))?;
                p[k].len()
            }
            Pieces::Fill(p) => {
                (hooks.before)(k, &mut *p[k])?;
                file.write_all_at(p[k], offset)
                    .map_err(|e| Error::io(path, e))?;
                p[k].len()
            }
            Pieces::Read(p) => {
                let window = &mut *p[k];
                let mut filled = 0;
                while filled < window.len() {
                    match file.read_at(&mut window[filled..], offset + filled as u64) {
                        Ok(0) => break,
                        Ok(n) => filled += n,
                        Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                        Err(e) => return Err(Error::io(path, e)),
                    }
                }
                (hooks.after)(k, &window[..filled])?;
                filled
            }
        };
        done.push(n);
    }
    Ok(done)
}

#[allow(clippy::too_many_arguments)]
fn run_on(
    ring: &mut IoUring,
    path: &Path,
    fd: RawFd,
    pieces: &mut Pieces<'_>,
    offsets: &[u64],
    depth: usize,
    hooks: Hooks<'_>,
    mut during: Option<&mut dyn FnMut()>,
) -> Result<Vec<usize>> {
    let n = pieces.len();
    let mut done = vec![0usize; n];
    let mut next = 0;
    let mut in_flight = 0usize;
    let mut failed: Option<Error> = None;
    let mut completions: Vec<(usize, i32)> = Vec::with_capacity(depth);
    // Pieces to submit again from where a short transfer stopped.
    let mut again: Vec<usize> = Vec::new();
    // Read pieces complete, their `after` not yet run: it runs in piece order (a checksum
    // taken as they land), once the freed slots are refilled and submitted, so the caller's
    // work on a piece (a copy, a checksum) overlaps a full queue rather than holding the next
    // reads back.
    let mut ready = vec![false; n];
    let mut next_after = 0;
    loop {
        if failed.is_none() {
            for k in again.drain(..) {
                push(
                    ring,
                    pieces.entry(fd, k, done[k], offsets[k] + done[k] as u64),
                );
                in_flight += 1;
            }
            while next < n && in_flight < depth {
                if let Pieces::Fill(p) = pieces {
                    if let Err(e) = (hooks.before)(next, &mut *p[next]) {
                        failed = Some(e);
                        break;
                    }
                }
                push(ring, pieces.entry(fd, next, 0, offsets[next]));
                if matches!(pieces, Pieces::Fill(_)) {
                    // Out now, while the next piece is filled: queued until the wait, the
                    // pieces filled first sat idle through the filling of the rest. A
                    // failed submit leaves it queued for the wait.
                    let _ = ring.submit();
                }
                in_flight += 1;
                next += 1;
            }
        }
        if ready.get(next_after).copied().unwrap_or(false) {
            if in_flight > 0 {
                let _ = ring.submit();
            }
            while ready.get(next_after).copied().unwrap_or(false) {
                let k = next_after;
                next_after += 1;
                if let (None, Pieces::Read(p)) = (&failed, &*pieces) {
                    if let Err(e) = (hooks.after)(k, &p[k][..done[k]]) {
                        failed = Some(e);
                    }
                }
            }
            continue;
        }
        if in_flight == 0 {
            break;
        }
        if let Some(during) = during.take() {
            // Out before the caller's work, so the two overlap.
            let _ = ring.submit();
            during();
        }
        wait(ring, &mut completions);
        for (k, res) in completions.drain(..) {
            in_flight -= 1;
            if k >= n {
                continue;
            }
            let want = pieces.piece_len(k);
            let reading = matches!(pieces, Pieces::Read(_));
            if res < 0 {
                let e = io::Error::from_raw_os_error(-res);
                failed.get_or_insert(Error::io(path, e));
                continue;
            }
            let got = res as usize;
            if got == 0 && !reading {
                let e = io::Error::from(io::ErrorKind::WriteZero);
                failed.get_or_insert(Error::io(path, e));
                continue;
            }
            done[k] += got;
            if got > 0 && done[k] < want {
                again.push(k);
                continue;
            }
            if reading {
                ready[k] = true;
            }
        }
    }
    match failed {
        Some(e) => Err(e),
        None => Ok(done),
    }
}

/// Queues `entry`; the ring has room, as at most its depth are ever in flight.
fn push(ring: &mut IoUring, entry: io_uring::squeue::Entry) {
    // SAFETY: the entry's buffer is a piece borrowed by `run` for its whole call, and `run`
    // returns only after every submitted entry has completed (`wait` until none is in
    // flight), so the kernel never touches it after the borrow ends.
    let pushed = unsafe { ring.submission().push(&entry) };
    if pushed.is_err() {
        // Full: hand what is queued to the kernel, which empties the queue, then queue it.
        let _ = ring.submit();
        // SAFETY: as above.
        let _ = unsafe { ring.submission().push(&entry) };
    }
}

/// Submits what is queued and waits for at least one completion, collected into `out` as
/// (piece, result). A failed wait (a signal, a busy completion queue) is tried again; a ring
/// whose wait keeps failing is polled, as the kernel posts completions whether or not
/// anyone waits.
fn wait(ring: &mut IoUring, out: &mut Vec<(usize, i32)>) {
    loop {
        if let Err(e) = ring.submit_and_wait(1) {
            if !matches!(
                e.raw_os_error(),
                Some(libc::EINTR) | Some(libc::EAGAIN) | Some(libc::EBUSY)
            ) {
                std::thread::sleep(std::time::Duration::from_micros(50));
            }
        }
        let cq: cqueue::CompletionQueue<'_> = ring.completion();
        out.extend(cq.map(|c| (c.user_data() as usize, c.result())));
        if !out.is_empty() {
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The ring's pieces and the blocking fallback's move the same bytes and hand over the
    /// same pieces (a short last read at the file's end included).
    #[test]
    fn the_ring_and_the_blocking_fallback_agree() {
        let dir = std::env::temp_dir().join(format!("wd-uring-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let ring = probe().is_ok();
        for on_ring in [false, true] {
            if on_ring && !ring {
                eprintln!("no io_uring here: the ring's half is skipped");
                continue;
            }
            let path = dir.join(format!("pieces-{on_ring}"));
            let file = File::options()
                .read(true)
                .write(true)
                .create(true)
                .truncate(true)
                .open(&path)
                .unwrap();
            let go = |pieces: Pieces<'_>, offsets: &[u64], hooks: Hooks<'_>| {
                let mut pieces = pieces;
                match on_ring {
                    true => run(&path, &file, pieces, offsets, 2, hooks),
                    false => run_blocking(&path, &file, &mut pieces, offsets, hooks),
                }
            };
            let data: Vec<u8> = (0..10_000u32).map(|i| (i * 7 % 253) as u8).collect();
            let offsets = [0u64, 4000, 8000];
            let none = &mut |_: usize, _: &mut [u8]| Ok(());
            let after = &mut |_: usize, _: &[u8]| Ok(());
            let pieces = Pieces::Write(data.chunks(4000).collect());
            let hooks = Hooks {
                before: none,
                after,
            };
            assert_eq!(go(pieces, &offsets, hooks).unwrap(), vec![4000, 4000, 2000]);
            let mut filled = vec![0u8; 10_000];
            let fill = &mut |k: usize, b: &mut [u8]| {
                b.fill(k as u8 + 1);
                Ok(())
            };
            let pieces = Pieces::Fill(filled.chunks_mut(4000).collect());
            let hooks = Hooks {
                before: fill,
                after,
            };
            let at = [10_000u64, 14_000, 18_000];
            assert_eq!(go(pieces, &at, hooks).unwrap(), vec![4000, 4000, 2000]);
            let mut back = vec![0u8; 3 * 8000];
            let mut seen = Vec::new();
            let take = &mut |k: usize, b: &[u8]| {
                seen.push((k, b.len()));
                Ok(())
            };
            let pieces = Pieces::Read(back.chunks_mut(8000).collect());
            let hooks = Hooks {
                before: none,
                after: take,
            };
            let got = go(pieces, &[0, 8000, 16_000], hooks).unwrap();
            assert_eq!(
                got,
                vec![8000, 8000, 4000],
                "the last read stops at the end"
            );
            seen.sort_unstable();
            assert_eq!(seen, vec![(0, 8000), (1, 8000), (2, 4000)]);
            assert!(back[..10_000] == data[..]);
            assert!(back[10_000..14_000].iter().all(|&b| b == 1));
            assert!(back[18_000..20_000].iter().all(|&b| b == 3));
        }
        let _ = std::fs::remove_dir_all(&dir);
    }
}
