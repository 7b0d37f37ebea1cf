//! Downloads through the ring: a chunk's DMA fills its slot, each part waits for its
//! chunk's DMA and copies out, and the thread that copies a chunk's last part enqueues the
//! DMA of the chunk that reuses the slot ([`Flow`]).

use std::mem::MaybeUninit;
use std::sync::atomic::{AtomicBool, AtomicU8, AtomicUsize, Ordering};

use crate::device::{cpu, Event, Stream};
use crate::dtype::DType;
use crate::error::Result;
use crate::memory::{check_len, Buffer};

use super::grid::{align_elems, Grid};
use super::{run_parts, spin_until, wait_event_once, Ring, RingPlan, UNKNOWN};
use crate::transfer::hostmem::{populate, write_copy, FreshVec, HUGE_PAGE};
use crate::transfer::workers::Workers;

/// One download's progress, shared by its threads: the ticket handing out parts, the parts
/// left per chunk, which chunks' DMAs are enqueued and which are known complete, and
/// whether a thread failed.
struct Flow {
    ticket: AtomicUsize,
    total: usize,
    left: Vec<AtomicUsize>,
    sent: Vec<AtomicBool>,
    landed: Vec<AtomicU8>,
    failed: AtomicBool,
}

/// States of a DMA's `landed` flag: nobody asked the driver yet, a thread is waiting in it,
impl Flow {
    fn new(grid: &Grid) -> Flow {
        let chunks = grid.chunks();
        Flow {
            ticket: AtomicUsize::new(0),
            total: grid.total_parts(),
            left: (0..chunks)
                .map(|c| AtomicUsize::new(grid.parts_in(c)))
                .collect(),
            sent: (0..chunks).map(|_| AtomicBool::new(false)).collect(),
            landed: (0..chunks).map(|_| AtomicU8::new(UNKNOWN)).collect(),
            failed: AtomicBool::new(false),
        }
    }

    /// The next part to work on; `None` once all are handed out or a thread failed.
    fn next(&self) -> Option<usize> {
        let p = self.ticket.fetch_add(1, Ordering::Relaxed);
        (p < self.total && !self.failed.load(Ordering::Relaxed)).then_some(p)
    }

    /// Marks chunk `c`'s DMA enqueued (its event recorded).
    fn sent(&self, c: usize) {
        self.sent[c].store(true, Ordering::Release);
    }

    /// Spins (yielding now and then) until chunk `c`'s DMA is enqueued; false when a
    /// thread fails first.
    fn wait_sent(&self, c: usize) -> bool {
        spin_until(&self.failed, || self.sent[c].load(Ordering::Acquire))
    }

    /// Waits until chunk `c`'s DMA, recorded by `event`, is enqueued and complete (see
    /// [`wait_event_once`]); false when a thread fails first. `event` must not be recorded
    /// again before every part waiting here for chunk `c` has returned.
    fn wait_landed(&self, c: usize, event: &Event) -> Result<bool> {
        if !self.wait_sent(c) {
            return Ok(false);
        }
        wait_event_once(&self.landed[c], &self.failed, event, || {})
    }

    /// Counts one part of chunk `c` done; true for its last (AcqRel: the others' work on
    /// the chunk happens before whatever the last one does next).
    fn part_done(&self, c: usize) -> bool {
        self.left[c].fetch_sub(1, Ordering::AcqRel) == 1
    }
}

/// Copies `src` into `dst` (same length) through a ring of pinned blocks on `stream`: up to
/// `plan.threads` copy threads each run `prepare(dst piece)` (while the piece's DMA may
/// still run), then `fill(dst piece, matching ring piece)`, on parts of the copy whose
/// host side starts on `plan.host_align`-byte boundaries (but the first). On `Ok`, `fill`
/// has run on every element of `dst`.
pub(crate) fn ring_download<T: DType, D: Send>(
    stream: &Stream,
    workers: &Workers,
    src: &Buffer<T>,
    dst: &mut [D],
    plan: &RingPlan,
    prepare: impl Fn(&mut [D]) + Sync,
    fill: impl Fn(&mut [D], &[T]) + Sync,
) -> Result<()> {
    check_len("ring_download", src.len(), dst.len())?;
    src.device().same_as(stream.device(), "ring_download")?;
    if dst.is_empty() {
        return Ok(());
    }
    workers.wake(plan.threads);
    let size = std::mem::size_of::<T>();
    let dsize = std::mem::size_of::<D>().max(1);
    let host = dst.as_mut_ptr() as usize;
    let to_boundary = host.next_multiple_of(plan.host_align.max(1)) - host;
    let lead = if to_boundary % dsize == 0 {
        to_boundary / dsize
    } else {
        0
    };
    let grid = Grid::new(dst.len(), plan, lead, align_elems(plan.host_align, dsize));
    let chunks = grid.chunks();
    let slots = plan.slots.min(chunks);
    let ring = Ring::<T>::new(stream, slots, grid.max_chunk(), slots)?;
    let (slots, dev_base) = (ring.slots(), src.device_ptr());
    let flow = Flow::new(&grid);
    // The first chunk of each slot goes out as the threads reach it (one chunk ahead), not
    // all before they start: each DMA and its event take several µs to enqueue, and
    // enqueueing them all first held the threads back (bench/NOTES.md, staging ring).
    let primed = AtomicUsize::new(0);
    let prime = |upto: usize| -> Result<()> {
        let upto = upto.min(slots - 1);
        loop {
            let k = primed.load(Ordering::Acquire);
            if k > upto {
                return Ok(());
            }
            if primed
                .compare_exchange(k, k + 1, Ordering::AcqRel, Ordering::Acquire)
                .is_ok()
            {
                // SAFETY: `src` (borrowed for this call) holds the chunk from `dev_base`;
                // the slot is on its first use (`Ring::new` waited for earlier users), and no
                // thread reads it before this DMA's event completes.
                unsafe { ring.send(stream, &grid, k, dev_base)? };
                flow.sent(k);
            }
        }
    };
    if let Err(e) = prime(0) {
        return ring.finish(stream, Some(e));
    }

    let error = run_parts(workers, plan.threads, &flow.failed, || {
        while let Some(p) = flow.next() {
            let (c, range) = grid.part(p);
            let slot = c % slots;
            prime(c + 1)?;
            // SAFETY: the range lies within `dst` (borrowed mutably for this call, `host` its
            // start), and the ticket hands part p, so this range, to this thread alone.
            let out = unsafe {
                std::slice::from_raw_parts_mut((host as *mut D).add(range.start), range.len())
            };
            prepare(out);
            // The chunk's DMA: enqueued (its event recorded for it, and not again before
            // this part is copied out), then done.
            if !flow.wait_landed(c, &ring.events[slot])? {
                return Ok(());
            }
            let at = range.start - grid.chunk_range(c).start;
            // SAFETY: the slot's block holds `grid.max_chunk()` elements and the part lies
            // within its chunk's first `chunk_range(c).len()`; the chunk's DMA into it has
            // completed and no DMA writes the slot again before every part of it is copied
            // out.
            let piece =
                unsafe { cpu::view::<T>(ring.bases[slot] + (at * size) as u64, range.len()) };
            fill(out, piece);
            // The last part copied out frees the slot for the chunk that reuses it.
            if flow.part_done(c) && c + slots < chunks {
                // SAFETY: `src` holds the chunk as above; every part of chunk c is copied out
                // of the slot, and no thread reads it again before this DMA's event
                // completes.
                unsafe { ring.send(stream, &grid, c + slots, dev_base)? };
                flow.sent(c + slots);
            }
        }
        Ok(())
    });
    ring.finish(stream, error)
}

/// [`ring_download`] of all of `src` appended to `out`'s spare room, its fresh pages
/// faulted in part by part on the copy threads while the DMAs run: parts are whole 2 MiB
/// regions of `out` (one thread faults each huge page, or each page table of 4 KiB pages,
/// whose faults take turns on one lock).
pub(crate) fn ring_download_fresh<T: DType>(
    stream: &Stream,
    workers: &Workers,
    src: &Buffer<T>,
    out: &mut FreshVec<T>,
    plan: &RingPlan,
) -> Result<()> {
    let n = src.len();
    let spare = out.spare_mut(n)?;
    let size = std::mem::size_of::<T>().max(1);
    let plan = RingPlan {
        part_len: (HUGE_PAGE / size).max(1),
        chunk_len: plan.chunk_len.next_multiple_of((HUGE_PAGE / size).max(1)),
        host_align: HUGE_PAGE,
        ..*plan
    };
    ring_download(
        stream,
        workers,
        src,
        spare,
        &plan,
        |d: &mut [MaybeUninit<T>]| {
            populate(d);
        },
        write_copy,
    )?;
    // SAFETY: `ring_download` returned Ok, so `write_copy` ran on every one of the first
    // `n` spare elements, writing each.
    unsafe { out.add_len(n) };
    Ok(())
}
