//! The shared-memory segment of a CPU process group on one host: a file under `/dev/shm`
//! that every rank maps, with a control block and two data slots per rank.
//!
//! A collective runs as rounds numbered by a sequence every rank counts alike. In round `s`
//! a rank writes its part into its slot `s % 2`, publishes `posted = s`, reads what it needs
//! of every rank's slot `s % 2` once that rank has posted `s`, then publishes
//! `consumed = s`. It writes slot `s % 2` again only in round `s + 2`, once every rank has
//! consumed round `s`: the two slots let a rank fill its next round while slower ranks
//! still read the last one. Rank 0 creates the file under a name unique to the job and
//! unlinks it as soon as every rank has mapped it (or when it fails before that), so no file
//! outlives the job.

use std::fs::OpenOptions;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use memmap2::MmapMut;

use crate::error::{Error, Result};

/// Bytes of one data slot: a round moves at most this much a rank.
pub(crate) const SLOT_BYTES: usize = 4 << 20;
/// Bytes of a rank's control block (its two counters on cache lines of their own).
const CONTROL: usize = 256;
const HEADER: usize = 4096;
const MAGIC: u64 = u64::from_le_bytes(*b"wdshm001");
/// Offsets in a control block: the posted counter, the two slots' lengths, the consumed
/// counter.
const POSTED: usize = 0;
const LENS: usize = 8;
const CONSUMED: usize = 128;

/// Where the segments live: a memory file system on Linux.
pub(crate) const SHM_DIR: &str = "/dev/shm";

/// One rank's mapping of the job's segment.
pub(crate) struct Segment {
    map: MmapMut,
    /// The mapping's first byte: slots and counters are reached through it, never through a
    /// reference to the whole mapping, which other processes write at the same time.
    base: *mut u8,
    world: usize,
    /// The file while it is still linked and this rank made it (rank 0 unlinks it).
    owned: Option<PathBuf>,
}

impl Segment {
    fn path(job: u64) -> PathBuf {
        PathBuf::from(format!("{SHM_DIR}/warpdrive-dist-{job:016x}"))
    }

    fn bytes(world: usize) -> Result<usize> {
        let per_rank = CONTROL + 2 * SLOT_BYTES;
        crate::size::product("shared-memory segment", &[world, per_rank])?
            .checked_add(HEADER)
            .ok_or_else(|| Error::InvalidArgument(format!("a segment for {world} ranks")))
    }

    /// Rank 0 makes the job's segment (a new file: a stale one of the same name is an error).
    pub(crate) fn create(job: u64, world: usize) -> Result<Segment> {
        let path = Self::path(job);
        let bytes = Self::bytes(world)?;
        let io = |what: &str, e: std::io::Error| {
            fail(format!("rank 0 cannot {what} {}: {e}", path.display()))
        };
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .open(&path)
            .map_err(|e| io("create", e))?;
        // From here the file is unlinked on every way out.
        let mut segment = Segment {
            map: MmapMut::map_anon(1).map_err(|e| io("map", e))?,
            base: std::ptr::null_mut(),
            world,
            owned: Some(path.clone()),
        };
        file.set_len(bytes as u64).map_err(|e| io("size", e))?;
        // SAFETY: the file was just created by this process under a name unique to the job;
        // the other ranks map it only after the rendezvous and never truncate it.
        segment.map = unsafe { MmapMut::map_mut(&file) }.map_err(|e| io("map", e))?;
        segment.base = segment.map.as_mut_ptr();
        segment.word(0).store(world as u64, Ordering::Relaxed);
        segment.word(8).store(MAGIC, Ordering::Release);
        Ok(segment)
    }

    /// Another rank maps rank 0's segment (an error naming the file when this rank is not on
    /// rank 0's host, or the file is not the job's).
    pub(crate) fn open(job: u64, world: usize, rank: usize) -> Result<Segment> {
        let path = Self::path(job);
        let bytes = Self::bytes(world)?;
        let io = |what: &str, e: String| {
            fail(format!(
                "rank {rank} cannot {what} {} ({e}): is it on rank 0's host?",
                path.display()
            ))
        };
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .open(&path)
            .map_err(|e| io("open", e.to_string()))?;
        let len = file
            .metadata()
            .map_err(|e| io("read", e.to_string()))?
            .len();
        if len != bytes as u64 {
            return Err(io("use", format!("{len} bytes, not {bytes}")));
        }
        // SAFETY: the file has the job's size, checked above; rank 0 made it and no rank
        // truncates it while mapped.
        let mut map = unsafe { MmapMut::map_mut(&file) }.map_err(|e| io("map", e.to_string()))?;
        let segment = Segment {
            base: map.as_mut_ptr(),
            map,
            world,
            owned: None,
        };
        let magic = segment.word(8).load(Ordering::Acquire);
        if magic != MAGIC || segment.word(0).load(Ordering::Relaxed) != world as u64 {
            return Err(io("use", "not a segment of this job's size".into()));
        }
        Ok(segment)
    }

    /// Rank 0 removes the file once every rank has mapped it (the mappings live on).
    pub(crate) fn unlink(&mut self) {
        if let Some(path) = self.owned.take() {
            let _ = std::fs::remove_file(path);
        }
    }

    /// The atomic word at byte `at` of the mapping (8-byte aligned, inside the header or a
    /// control block).
    fn word(&self, at: usize) -> &AtomicU64 {
        debug_assert!(at % 8 == 0 && at + 8 <= HEADER + self.world * CONTROL);
        // SAFETY: the mapping is page-aligned and at least HEADER + world × CONTROL bytes
        // long (`bytes`), `at` is 8-aligned inside that, and every process touches these
        // words only through atomics.
        unsafe { &*(self.base.add(at) as *const AtomicU64) }
    }

    fn control(&self, rank: usize, at: usize) -> &AtomicU64 {
        self.word(HEADER + rank * CONTROL + at)
    }

    fn slot_offset(&self, rank: usize, half: usize) -> usize {
        HEADER + self.world * CONTROL + (2 * rank + half) * SLOT_BYTES
    }

    /// Rank `rank`'s slot of round `seq`, `len` bytes of it, to read: `None` when `len` is
    /// past the slot.
    pub(crate) fn slot(&self, rank: usize, seq: u64, len: usize) -> Option<&[u8]> {
        let start = self.slot_offset(rank, (seq % 2) as usize);
        // SAFETY: the slot lies inside the mapping (`bytes`); its rank writes it only in
        // round `seq + 2`, after this rank has consumed round `seq` (the round protocol).
        (len <= SLOT_BYTES)
            .then(|| unsafe { std::slice::from_raw_parts(self.base.add(start), len) })
    }

    /// This rank's slot of round `seq` to fill. The caller is the slot's rank and has waited
    /// for every rank to consume round `seq - 2` ([`wait_consumed`](Self::wait_consumed)).
    pub(crate) fn slot_mut(&mut self, rank: usize, seq: u64, len: usize) -> Option<&mut [u8]> {
        let start = self.slot_offset(rank, (seq % 2) as usize);
        // SAFETY: the slot lies inside the mapping; no rank reads it before this rank posts
        // round `seq`, and every rank has consumed round `seq - 2`, its last use.
        (len <= SLOT_BYTES)
            .then(|| unsafe { std::slice::from_raw_parts_mut(self.base.add(start), len) })
    }

    /// Publishes this rank's round `seq`, `len` bytes in its slot.
    pub(crate) fn post(&self, rank: usize, seq: u64, len: usize) {
        self.control(rank, LENS + 8 * (seq % 2) as usize)
            .store(len as u64, Ordering::Relaxed);
        self.control(rank, POSTED).store(seq, Ordering::Release);
    }

    /// What rank `rank` put in its slot for round `seq` (posted).
    pub(crate) fn posted_len(&self, rank: usize, seq: u64) -> usize {
        let len = self
            .control(rank, LENS + 8 * (seq % 2) as usize)
            .load(Ordering::Relaxed);
        usize::try_from(len).unwrap_or(usize::MAX)
    }

    pub(crate) fn consume(&self, rank: usize, seq: u64) {
        self.control(rank, CONSUMED).store(seq, Ordering::Release);
    }

    /// Waits until `rank` has posted round `seq`: `Ok(false)` when `deadline` passed first;
    /// `check` runs between waits (a peer that left, an abort) and its error ends the wait.
    pub(crate) fn wait_posted(
        &self,
        rank: usize,
        seq: u64,
        deadline: Option<Instant>,
        check: impl Fn() -> Option<Error>,
    ) -> Result<bool> {
        let counter = self.control(rank, POSTED);
        wait_for(|| counter.load(Ordering::Acquire) >= seq, deadline, check)
    }

    /// Waits until `rank` has consumed round `seq`, as [`wait_posted`](Self::wait_posted).
    pub(crate) fn wait_consumed(
        &self,
        rank: usize,
        seq: u64,
        deadline: Option<Instant>,
        check: impl Fn() -> Option<Error>,
    ) -> Result<bool> {
        let counter = self.control(rank, CONSUMED);
        wait_for(|| counter.load(Ordering::Acquire) >= seq, deadline, check)
    }
}

// SAFETY: `base` points into `map`, which the segment owns and which lives as long as it;
// the memory is shared between processes anyway, and the round protocol orders every access.
unsafe impl Send for Segment {}

impl Drop for Segment {
    fn drop(&mut self) {
        self.unlink();
    }
}

/// Spins briefly, then yields, then naps, until `done` (`Ok(true)`); an error from `check`
/// or `deadline` passing (`Ok(false)`) ends it. The ranks usually arrive within microseconds of one
/// another; when they do not (more ranks than cores), yielding lets the late one run.
fn wait_for(
    done: impl Fn() -> bool,
    deadline: Option<Instant>,
    check: impl Fn() -> Option<Error>,
) -> Result<bool> {
    for i in 0u64.. {
        if done() {
            return Ok(true);
        }
        if i < 128 {
            std::hint::spin_loop();
            continue;
        }
        if let Some(e) = check() {
            // What the peer did before it left still counts.
            return if done() { Ok(true) } else { Err(e) };
        }
        if deadline.is_some_and(|d| Instant::now() >= d) {
            return Ok(done());
        }
        if i < 4096 {
            std::thread::yield_now();
        } else {
            std::thread::sleep(Duration::from_micros(50));
        }
    }
    Ok(done())
}

fn fail(detail: String) -> Error {
    Error::Collective {
        op: "bootstrap",
        detail,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_segment_is_unlinked_once_mapped_or_when_its_maker_fails() {
        let job = rand::random::<u64>();
        let path = Segment::path(job);
        let mut made = Segment::create(job, 2).unwrap();
        assert!(path.exists());
        assert!(
            Segment::create(job, 2).is_err(),
            "a second segment of one job"
        );
        let other = Segment::open(job, 2, 1).unwrap();
        assert!(Segment::open(job, 3, 1).is_err(), "another world size");
        // A round through the mapping: rank 0 posts, rank 1 reads it.
        made.slot_mut(0, 1, 4)
            .unwrap()
            .copy_from_slice(&[1, 2, 3, 4]);
        made.post(0, 1, 4);
        assert!(other.wait_posted(0, 1, None, || None).unwrap());
        assert_eq!(
            other.slot(0, 1, other.posted_len(0, 1)).unwrap(),
            [1, 2, 3, 4]
        );
        made.unlink();
        assert!(!path.exists());
        let e = Segment::open(job, 2, 1).err().unwrap();
        assert!(e.to_string().contains("rank 0's host"), "{e}");
        // Dropped before every rank mapped it: no file left behind.
        let job = job.wrapping_add(1);
        drop(Segment::create(job, 2).unwrap());
        assert!(!Segment::path(job).exists());
    }

    #[test]
    fn a_wait_ends_at_its_deadline_or_at_the_checks_error() {
        let job = rand::random::<u64>();
        let s = Segment::create(job, 2).unwrap();
        let soon = Some(Instant::now() + Duration::from_millis(20));
        assert!(!s.wait_posted(1, 1, soon, || None).unwrap());
        let e = s.wait_consumed(1, 1, None, || Some(fail("gone".into())));
        assert!(e.is_err());
    }
}
