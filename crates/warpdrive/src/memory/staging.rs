//! Staged uploads through a ring of pinned blocks, with no barrier per chunk.
//!
//! The copy threads take the copy's parts in order from one ticket; a part lands in its
//! chunk's ring slot, and the thread that writes a chunk's last part enqueues the chunk's
//! DMA and records the slot's event. A part whose slot an earlier chunk's DMA may still be
//! reading first waits for that chunk's event. No thread waits for the others at a chunk's
//! end, so a slow thread holds back one chunk's DMA rather than every thread, and the link
//! is fed while the threads keep copying: on the H200 host a fork/join per 4 MiB chunk
//! moved 38-44 GB/s, this 40-51 (a copy on 16 threads and the DMA engine together move 52 +
//! 53 GB/s there, so the barrier, not host memory, was the limit).

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

use parking_lot::Mutex;

use crate::device::workers::Workers;
use crate::device::{cpu, Event, Stream};
use crate::dtype::DType;
use crate::error::{Error, Result};

use super::{check_len, Buffer, PinnedBuf};

/// How a ring upload runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RingPlan {
    /// Elements per chunk (one DMA and one ring slot each).
    pub chunk_len: usize,
    /// Ring slots (chunks in flight).
    pub slots: usize,
    /// Elements per part (one thread's piece of a chunk).
    pub part_len: usize,
    /// Copy threads (the caller's included).
    pub threads: usize,
}

/// Sends `src` into `dst` (same length) through a ring of pinned blocks on `stream`: up to
/// `plan.threads` copy threads each run `fill(ring piece, matching src piece)` on parts of
/// the copy (a plain or streaming copy, or a conversion); returns once every DMA has
/// completed. A CUDA stream only (the CPU backend has no DMA to feed).
pub(crate) fn ring_upload<S: Sync, T: DType>(
    stream: &Stream,
    workers: &Workers,
    dst: &mut Buffer<T>,
    src: &[S],
    plan: &RingPlan,
    fill: impl Fn(&mut [T], &[S]) + Sync,
) -> Result<()> {
    check_len("ring_upload", dst.len(), src.len())?;
    dst.device().same_as(stream.device(), "ring_upload")?;
    let Some((device, cu_stream)) = stream.cuda() else {
        return Err(Error::Unsupported(
            "ring_upload needs a CUDA stream".to_string(),
        ));
    };
    let n = src.len();
    if n == 0 {
        return Ok(());
    }
    let size = std::mem::size_of::<T>();
    let chunk = plan.chunk_len.clamp(1, n);
    let part = plan.part_len.clamp(1, chunk);
    let chunks = n.div_ceil(chunk);
    let parts_per_chunk = chunk.div_ceil(part);
    let chunk_len = |c: usize| chunk.min(n - c * chunk);
    let total_parts = (chunks - 1) * parts_per_chunk + chunk_len(chunks - 1).div_ceil(part);
    let mut ring = (0..plan.slots.clamp(1, chunks))
        .map(|_| PinnedBuf::<T>::new(stream.device(), chunk))
        .collect::<Result<Vec<_>>>()?;
    // Waits for any earlier copy still using the blocks; from here on this call owns them.
    let mut bases = Vec::with_capacity(ring.len());
    for block in &mut ring {
        block.as_mut_slice()?;
        bases.push(block.ptr);
    }
    let events = ring
        .iter()
        .map(|block| block.pool.event())
        .collect::<Result<Vec<Event>>>()?;
    let slots = ring.len();
    let dev_base = dst.device_ptr();

    let ticket = AtomicUsize::new(0);
    let left: Vec<AtomicUsize> = (0..chunks)
        .map(|c| AtomicUsize::new(chunk_len(c).div_ceil(part)))
        .collect();
    let sent: Vec<AtomicBool> = (0..chunks).map(|_| AtomicBool::new(false)).collect();
    let failed = AtomicBool::new(false);
    let error: Mutex<Option<Error>> = Mutex::new(None);

    // One thread's share: parts from the ticket until none are left (or another failed).
    let work = || -> Result<()> {
        loop {
            if failed.load(Ordering::Relaxed) {
                return Ok(());
            }
            let p = ticket.fetch_add(1, Ordering::Relaxed);
            if p >= total_parts {
                return Ok(());
            }
            let (c, k) = (p / parts_per_chunk, p % parts_per_chunk);
            let slot = c % slots;
            if c >= slots {
                // The slot's last DMA is chunk c - slots's: wait until it is enqueued (its
                // event recorded), then for the event. Nothing records the event again
                // before this part is written (that takes all of chunk c).
                let mut spins = 0u32;
                while !sent[c - slots].load(Ordering::Acquire) {
                    if failed.load(Ordering::Relaxed) {
                        return Ok(());
                    }
                    spins += 1;
                    if spins % 1024 == 0 {
                        std::thread::yield_now();
                    } else {
                        std::hint::spin_loop();
                    }
                }
                events[slot].synchronize()?;
            }
            let start = c * chunk + k * part;
            let len = part.min(c * chunk + chunk_len(c) - start);
            // SAFETY: the slot's block holds `chunk` elements and `k * part + len <= chunk`;
            // the ticket hands part p to this thread alone, so no one else writes these
            // elements now, and the DMA that last read them has completed (waited for
            // above, or the slot is on its first use after `as_mut_slice` waited).
            let piece = unsafe { cpu::view_mut::<T>(bases[slot] + (k * part * size) as u64, len) };
            fill(piece, &src[start..start + len]);
            // The last part written sends the chunk (AcqRel: the others' writes happen
            // before the DMA is enqueued).
            if left[c].fetch_sub(1, Ordering::AcqRel) == 1 {
                let bytes = chunk_len(c) * size;
                // SAFETY: the slot's block holds the chunk's `bytes`, and `dst` (borrowed
                // mutably for this call) holds `n` elements from `dev_base`, the chunk's
                // range among them; every part of the chunk is written, and no thread
                // writes the slot again before the event recorded next completes.
                unsafe {
                    device.copy_raw_async(
                        cu_stream,
                        true,
                        bases[slot] as *mut u8,
                        dev_base + (c * chunk * size) as u64,
                        bytes,
                    )?
                };
                stream.record(&events[slot])?;
                sent[c].store(true, Ordering::Release);
            }
        }
    };
    workers.run(plan.threads.clamp(1, workers.threads()), &|_| {
        if let Err(e) = work() {
            failed.store(true, Ordering::Relaxed);
            error.lock().get_or_insert(e);
        }
    });
    // The blocks return to the pool only once every DMA enqueued above has read them.
    for block in &mut ring {
        block.record_use(stream)?;
    }
    if let Some(e) = error.into_inner() {
        return Err(e);
    }
    stream.synchronize()?;
    ring[0].pool.recycle(events);
    Ok(())
}
