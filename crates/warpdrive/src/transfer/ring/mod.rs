//! Staged copies through a ring of pinned memory, with no barrier per chunk.
//!
//! The copy threads take the copy's parts in order from one ticket. Uploads (`upload.rs`): a
//! part is written into the ring (after the DMA that read its room a ring's length back has
//! completed), and the thread that writes one may send everything written in order since
//! the last DMA as the next one, sized to keep the DMA engine fed. Downloads
//! (`download.rs`): a chunk's DMA fills its ring slot, each part waits for its chunk's DMA
//! and copies out, and the thread that copies a chunk's last part enqueues the DMA of the
//! chunk that reuses the slot. No thread waits for the others at a chunk's end, so a slow
//! thread holds back one chunk rather than every thread, and the link is fed while the
//! threads keep copying (the per-chunk barrier, not host memory, limited the fork/join copy
//! this replaced; see bench/NOTES.md, staging ring). Parts are small at the start and the
//! end (`grid.rs`, the ramp), so the first DMA (upload) or copy-out (download) starts after
//! a little of the copy that every thread helps with.
//!
//! This file holds what both directions share: the [`RingPlan`], the ring of pinned blocks
//! and the waits on its events. The DMAs go through the stream's `device::dma` engine: the
//! GPU's copy engine on CUDA, the calling thread's copy on the CPU backend (complete when
//! enqueued), under the same protocol of events, so the ring's ordering and every byte it
//! moves are checked without a GPU too.

mod download;
mod grid;
mod upload;

use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};

use parking_lot::Mutex;

use crate::device::dma::Dma;
use crate::device::{Event, Stream};
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::memory::PinnedBuf;
use crate::transfer::workers::Workers;

use grid::Grid;

pub(crate) use download::{ring_download, ring_download_fresh};
pub(crate) use upload::ring_upload;

/// How a ring copy runs.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RingPlan {
    /// Elements per chunk (one DMA and one ring slot each) in the middle of the copy; the
    /// ramp at either end takes smaller ones.
    pub chunk_len: usize,
    /// Ring slots (chunks in flight).
    pub slots: usize,
    /// The most elements per part (one thread's piece of a chunk).
    pub part_len: usize,
    /// Copy threads (the caller's included).
    pub threads: usize,
    /// The byte boundary the host side of every part starts on (downloads: but the first,
    /// which ends at the first boundary of `dst`).
    pub host_align: usize,
    /// Bytes per second the link moves host to device (uploads: when the DMA engine is due
    /// to run dry); not positive: `FALLBACK_RATE`.
    pub h2d_rate: f64,
}

/// The link rate an upload assumes when given none: PCIe 4.0 x16's, about.
pub const FALLBACK_RATE: f64 = 25e9;

/// The ring of one copy: pinned blocks (waited free), their host addresses, and events for
/// its DMAs (downloads: one per block).
struct Ring<T: DType> {
    blocks: Vec<PinnedBuf<T>>,
    bases: Vec<u64>,
    events: Vec<Event>,
}

impl<T: DType> Ring<T> {
    fn new(stream: &Stream, slots: usize, chunk: usize, events: usize) -> Result<Ring<T>> {
        let mut blocks = (0..slots.max(1))
            .map(|_| PinnedBuf::<T>::new(stream.device(), chunk))
            .collect::<Result<Vec<_>>>()?;
        // Waits for any earlier copy still using the blocks; from here on this copy owns
        // them.
        let mut bases = Vec::with_capacity(blocks.len());
        for block in &mut blocks {
            block.wait_slice_mut()?;
            bases.push(block.host_ptr());
        }
        let events = (0..events)
            .map(|_| blocks[0].pool().take_event())
            .collect::<Result<Vec<Event>>>()?;
        Ok(Ring {
            blocks,
            bases,
            events,
        })
    }

    fn slots(&self) -> usize {
        self.blocks.len()
    }

    /// Enqueues on `stream` the DMA of `grid`'s chunk `c` from the device buffer at
    /// `dev_base` into its slot (`c % slots`), then records the slot's event.
    ///
    /// # Safety
    /// `dev_base` holds every element of the chunk until the stream is done with it, the
    /// ring's blocks hold `grid.max_chunk()` elements, and no host thread touches the slot
    /// before the event recorded here completes (nor still does, for an earlier chunk).
    unsafe fn send(&self, stream: &Stream, grid: &Grid, c: usize, dev_base: u64) -> Result<()> {
        let dma = Dma::of(stream);
        let size = std::mem::size_of::<T>();
        let slot = c % self.slots();
        let chunk = grid.chunk_range(c);
        // SAFETY: forwarded from this function's contract.
        unsafe {
            dma.copy(
                false,
                self.bases[slot] as *mut u8,
                dev_base + (chunk.start * size) as u64,
                chunk.len() * size,
            )?
        };
        stream.record(&self.events[slot])
    }

    /// Ends the copy: waits for every DMA enqueued on `stream`, so the blocks go back to the
    /// pool free, with no event recorded per block (a driver call each, 16 a copy with a
    /// 16-slot ring). When the copy failed, or the wait does, each block instead records
    /// that the stream's work uses it, and goes back only once that is done.
    fn finish(mut self, stream: &Stream, error: Option<Error>) -> Result<()> {
        let result = match error {
            Some(e) => Err(e),
            None => stream.synchronize(),
        };
        if result.is_err() {
            for block in &mut self.blocks {
                // Best effort: the copy's own error is the one to report.
                let _ = block.record_use(stream);
            }
            return result;
        }
        self.blocks[0]
            .pool()
            .recycle_events(std::mem::take(&mut self.events));
        Ok(())
    }
}

/// done.
const UNKNOWN: u8 = 0;
const ASKING: u8 = 1;
const LANDED: u8 = 2;

/// Spins (yielding now and then) until `done()`; false once `failed` is set first.
fn spin_until(failed: &AtomicBool, done: impl Fn() -> bool) -> bool {
    let mut spins = 0u32;
    while !done() {
        if failed.load(Ordering::Relaxed) {
            return false;
        }
        spins = spins.wrapping_add(1);
        if spins % 1024 == 0 {
            std::thread::yield_now();
        } else {
            std::hint::spin_loop();
        }
    }
    true
}

/// Waits for `event` (recorded) to complete, whose state `landed` holds, running `then` before
/// marking it landed; false when `failed` is set first. One thread asks the driver and the
/// others watch for its answer: a driver call per part took turns on the driver's lock with
/// the thread enqueueing DMAs, and small parts made uploads run at about half speed
/// (bench/NOTES.md, staging ring).
fn wait_event_once(
    landed: &AtomicU8,
    failed: &AtomicBool,
    event: &Event,
    then: impl FnOnce(),
) -> Result<bool> {
    let ask = landed.compare_exchange(UNKNOWN, ASKING, Ordering::AcqRel, Ordering::Acquire);
    if ask.is_err() {
        // Another thread asks (or has asked); if it fails, `failed` ends the wait.
        return Ok(spin_until(failed, || {
            landed.load(Ordering::Acquire) == LANDED
        }));
    }
    event.synchronize()?;
    then();
    landed.store(LANDED, Ordering::Release);
    Ok(true)
}

/// Runs `work` on up to `threads` copy threads; the first error (or panic) sets `failed`
/// (which stops the others) and is returned.
fn run_parts(
    workers: &Workers,
    threads: usize,
    failed: &AtomicBool,
    work: impl Fn() -> Result<()> + Sync,
) -> Option<Error> {
    let error: Mutex<Option<Error>> = Mutex::new(None);
    let ran = workers.run(threads.clamp(1, workers.threads()), &|_| {
        // A thread that panics stops the others too: they may be waiting for a DMA it was
        // to send.
        let _stop = FailOnPanic(failed);
        if let Err(e) = work() {
            failed.store(true, Ordering::Relaxed);
            error.lock().get_or_insert(e);
        }
    });
    error.into_inner().or(ran.err())
}

/// Sets its flag when dropped during a panic.
struct FailOnPanic<'a>(&'a AtomicBool);

impl Drop for FailOnPanic<'_> {
    fn drop(&mut self) {
        if std::thread::panicking() {
            self.0.store(true, Ordering::Relaxed);
        }
    }
}

#[cfg(test)]
mod tests;
