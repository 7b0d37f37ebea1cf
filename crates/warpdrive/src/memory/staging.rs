//! Staged copies through a ring of pinned memory, with no barrier per chunk.
//!
//! The copy threads take the copy's parts in order from one ticket. Uploads ([`Feed`]): a
//! part is written into the ring (after the DMA that read its room a ring's length back has
//! completed), and the thread that writes one may send everything written in order since
//! the last DMA as the next one, sized to keep the DMA engine fed. Downloads: a chunk's DMA
//! fills its ring slot, each part waits for its chunk's DMA and copies out, and the thread
//! that copies a chunk's last part enqueues the DMA of the chunk that reuses the slot. No
//! thread waits for the others at a chunk's end, so a slow thread holds back one chunk
//! rather than every thread, and the link is fed while the threads keep copying (the
//! per-chunk barrier, not host memory, limited the fork/join copy this replaced; see
//! bench/NOTES.md, staging ring). Parts are small at the start and the end ([`Grid`]'s ramp), so
//! the first DMA (upload) or copy-out (download) starts after a little of the copy that
//! every thread helps with.
//!
//! The DMAs go through the stream's [`Dma`] engine: the GPU's copy engine on CUDA, the
//! calling thread's copy on the CPU backend (complete when enqueued), under the same
//! protocol of events, so the ring's ordering and every byte it moves are checked without
//! a GPU too.

use std::mem::MaybeUninit;
use std::ops::Range;
use std::sync::atomic::{AtomicBool, AtomicU8, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use crate::device::dma::Dma;
use crate::device::hostmem::{populate, write_copy, FreshVec, HUGE_PAGE};
use crate::device::workers::Workers;
use crate::device::{cpu, Event, Stream};
use crate::dtype::DType;
use crate::error::{Error, Result};

use super::{check_len, Buffer, PinnedBuf};

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

/// Where a ring copy's chunks and parts lie. Chunks are `plan.chunk_len` elements in the
/// middle, after a shorter first one of `lead` elements when `0 < lead <= chunk` (so the
/// host side of every later chunk and part starts on an alignment boundary), with a ramp at
/// both ends: chunks of 1/32, 1/16, 1/8, 1/4 and 1/2 of that (while the copy has room for
/// them at both ends, and none empty), so the DMA starts (uploads) or the copy-out starts
/// (downloads) after a small first chunk, and the last one leaves little to do after it.
/// Each chunk is cut into parts of about its length over `plan.threads`, between the
/// alignment and `plan.part_len`, so every thread helps with the small chunks too.
struct Grid {
    /// Chunk `c` covers `bounds[c]..bounds[c + 1]`.
    bounds: Vec<usize>,
    /// Elements per part in chunk `c`.
    part: Vec<usize>,
    /// Parts before chunk `c`; the last entry counts all of them.
    first_part: Vec<usize>,
    /// Elements of the short first chunk (0: none).
    #[cfg(test)]
    lead: usize,
}

/// `align` bytes in elements of `size` bytes (1 where it is no whole number of them).
fn align_elems(align: usize, size: usize) -> usize {
    let size = size.max(1);
    if align % size == 0 {
        (align / size).max(1)
    } else {
        1
    }
}

/// Ramp chunks at each end of a ring copy, as fractions of a chunk: 1/32 to 1/2. After the
/// copy threads idled, the caller writes most of the first chunk alone while they wake, so
/// a small first chunk starts the DMA engine sooner (bench/NOTES.md, staging ring).
const RAMP: [u32; 5] = [5, 4, 3, 2, 1];

impl Grid {
    /// `align`: elements the host side of every part past the lead starts a multiple of.
    fn new(n: usize, plan: &RingPlan, lead: usize, align: usize) -> Grid {
        let align = align.max(1);
        // Chunks and parts in whole alignment units (a chunk at least one unit).
        let chunk = plan.chunk_len.clamp(1, n.max(1)).next_multiple_of(align);
        let lead = if lead < n && lead <= chunk { lead } else { 0 };
        let mut left = n - lead;
        // The ramp's chunks, taken at both ends.
        let mut ramp = Vec::new();
        for shift in RAMP {
            let size = (chunk >> shift).next_multiple_of(align);
            // Not for chunks of under 32 elements, whose small steps round to nothing: an
            // empty chunk has no last part to send the DMA a ring after it.
            if size == 0 || size >= chunk || left < 2 * size + chunk {
                continue;
            }
            ramp.push(size);
            left -= 2 * size;
        }
        let mut sizes = Vec::new();
        if lead > 0 {
            sizes.push(lead);
        }
        sizes.extend(&ramp);
        // Whole chunks, then the rest: its aligned part as a chunk of its own, what is left
        // under one unit joining the last chunk.
        sizes.extend(std::iter::repeat_n(chunk, left / chunk));
        let rest = left % chunk;
        if rest >= align {
            sizes.push(rest - rest % align);
        }
        sizes.extend(ramp.iter().rev());
        match sizes.last_mut() {
            Some(last) => *last += rest % align,
            None => sizes.push(n),
        }
        let threads = plan.threads.max(1);
        let part_cap = plan.part_len.max(1).next_multiple_of(align);
        let (mut bounds, mut part, mut first_part) = (vec![0], Vec::new(), vec![0]);
        for size in sizes {
            let p = size
                .div_ceil(threads)
                .next_multiple_of(align)
                .min(part_cap)
                .max(1);
            bounds.push(bounds[bounds.len() - 1] + size);
            first_part.push(first_part[first_part.len() - 1] + size.div_ceil(p));
            part.push(p);
        }
        Grid {
            bounds,
            part,
            first_part,
            #[cfg(test)]
            lead,
        }
    }

    fn chunks(&self) -> usize {
        self.part.len()
    }

    /// The longest chunk (what a ring slot holds).
    fn max_chunk(&self) -> usize {
        self.bounds
            .windows(2)
            .map(|w| w[1] - w[0])
            .max()
            .unwrap_or(0)
    }

    fn chunk_range(&self, c: usize) -> Range<usize> {
        self.bounds[c]..self.bounds[c + 1]
    }

    fn parts_in(&self, c: usize) -> usize {
        self.first_part[c + 1] - self.first_part[c]
    }

    fn total_parts(&self) -> usize {
        self.first_part[self.chunks()]
    }

    /// Part `p` of the whole copy: (its chunk, its element range).
    fn part(&self, p: usize) -> (usize, Range<usize>) {
        let c = self.first_part.partition_point(|&f| f <= p) - 1;
        let range = self.chunk_range(c);
        let start = range.start + (p - self.first_part[c]) * self.part[c];
        (c, start..(start + self.part[c]).min(range.end))
    }
}

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
            block.as_mut_slice()?;
            bases.push(block.ptr);
        }
        let events = (0..events)
            .map(|_| blocks[0].pool.event())
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
            .pool
            .recycle(std::mem::take(&mut self.events));
        Ok(())
    }
}

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
/// done.
const UNKNOWN: u8 = 0;
const ASKING: u8 = 1;
const LANDED: u8 = 2;

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

/// DMA slots an upload's feed cycles through (one event each): more than an upload keeps in
/// flight at once in practice, so the sender seldom waits for one to come free.
const FEED_EVENTS: usize = 32;

/// Engine time each DMA costs besides its bytes, from one large pinned DMA timed against
/// the same bytes as many (bench/NOTES.md, staging ring).
const DMA_COST: Duration = Duration::from_micros(3);

/// How long before the DMA engine is due to run dry a thread finishing a part sends what
/// is ready: the time a send takes to enqueue, and a little to the next part's end.
const DRY_SLACK: Duration = Duration::from_micros(10);

/// An upload's DMAs. The copy threads write parts, in the order of one ticket, into a ring
/// of pinned memory; the thread that finishes a part then may send everything written in
/// order and not yet sent as one DMA: when a chunk's worth is ready, when the engine is due
/// to run dry (predicted from the bytes sent and the link's rate) and a ramp chunk's worth is
/// ready, or when a thread needs the ring room it holds. So the engine starts after the
/// first few parts and is kept fed, in DMAs that grow when the copy runs ahead of the link
/// (each costs the engine [`DMA_COST`]): a fixed schedule of chunks either left it idle while the
/// next, larger chunk was written or sent many small ones.
struct Feed<'g> {
    grid: &'g Grid,
    /// Elements in the ring.
    ring_len: usize,
    ticket: AtomicUsize,
    written: Vec<AtomicBool>,
    failed: AtomicBool,
    sender: Mutex<Sender>,
    /// DMAs enqueued: DMA `d` covers elements up to `ends[d]` from where the one before
    /// ended, its event `events[d % FEED_EVENTS]`.
    sent: AtomicUsize,
    ends: Vec<AtomicUsize>,
    landed: Vec<AtomicU8>,
    /// Elements known to have landed (every DMA up to one that ends there has completed).
    landed_to: AtomicUsize,
}

/// What the sending thread keeps: the first part not known written, the elements sent, and
/// when the DMA engine is due to finish what it has been given.
struct Sender {
    next_part: usize,
    sent_to: usize,
    busy_until: Instant,
}

/// The stream, ring and device side of an upload, for [`Feed::pump`].
struct Wire<'a> {
    stream: &'a Stream,
    dma: Dma<'a>,
    ring: u64,
    dev_base: u64,
    events: &'a [Event],
    /// Bytes per element.
    size: usize,
    /// Elements per DMA at most, and the fewest sent because the engine is due to run dry.
    max_dma: usize,
    min_dma: usize,
    /// The link's rate in bytes per second.
    rate: f64,
}

impl<'g> Feed<'g> {
    fn new(grid: &'g Grid, n: usize, ring_len: usize, max_dma: usize) -> Feed<'g> {
        // DMA ends only grow, and each is a part's end, the ring's end or `max_dma` past the
        // one before.
        let most = grid.total_parts() + n / ring_len.max(1) + n / max_dma.max(1) + 2;
        Feed {
            grid,
            ring_len,
            ticket: AtomicUsize::new(0),
            written: (0..grid.total_parts())
                .map(|_| AtomicBool::new(false))
                .collect(),
            failed: AtomicBool::new(false),
            sender: Mutex::new(Sender {
                next_part: 0,
                sent_to: 0,
                busy_until: Instant::now(),
            }),
            sent: AtomicUsize::new(0),
            ends: (0..most).map(|_| AtomicUsize::new(0)).collect(),
            landed: (0..most).map(|_| AtomicU8::new(UNKNOWN)).collect(),
            landed_to: AtomicUsize::new(0),
        }
    }

    fn n(&self) -> usize {
        self.grid.bounds[self.grid.chunks()]
    }

    /// The next part to write; `None` once all are handed out or a thread failed.
    fn next(&self) -> Option<usize> {
        let p = self.ticket.fetch_add(1, Ordering::Relaxed);
        (p < self.written.len() && !self.failed.load(Ordering::Relaxed)).then_some(p)
    }

    /// Sends what is ready by the rules in [`Feed`]'s doc, and at least up to element `need`
    /// when that much is written (0: no need). Without a need, returns at once while another
    /// thread sends.
    fn pump(&self, wire: &Wire, need: usize) -> Result<()> {
        let mut s = if need > 0 {
            self.sender.lock()
        } else {
            match self.sender.try_lock() {
                Some(s) => s,
                None => return Ok(()),
            }
        };
        let parts = self.written.len();
        while s.next_part < parts && self.written[s.next_part].load(Ordering::Acquire) {
            s.next_part += 1;
        }
        let frontier = match s.next_part {
            p if p == parts => self.n(),
            p => self.grid.part(p).1.start,
        };
        loop {
            let ready = frontier - s.sent_to;
            if ready == 0 {
                return Ok(());
            }
            let now = Instant::now();
            let go = frontier == self.n()
                || ready >= wire.max_dma
                || (s.sent_to < need && frontier >= need)
                || (ready >= wire.min_dma && now + DRY_SLACK >= s.busy_until);
            if !go {
                return Ok(());
            }
            let at = s.sent_to % self.ring_len;
            let len = ready.min(wire.max_dma).min(self.ring_len - at);
            let d = self.sent.load(Ordering::Relaxed);
            // The event slot's last DMA must be done before its event is recorded again.
            if d >= FEED_EVENTS && !self.wait_dma(d - FEED_EVENTS, wire.events)? {
                return Ok(());
            }
            let size = wire.size;
            // SAFETY: the ring holds `ring_len` elements from `wire.ring`, and the range
            // lies within it (it stops at the ring's end); every part in it is written
            // (their flags read with Acquire) and no thread writes it again before this
            // DMA's event completes (`wait_room`). `dst` holds every element from
            // `dev_base` until `ring_upload` returns, after the stream is done.
            unsafe {
                wire.dma.copy(
                    true,
                    (wire.ring + (at * size) as u64) as *mut u8,
                    wire.dev_base + (s.sent_to * size) as u64,
                    len * size,
                )?
            };
            wire.stream.record(&wire.events[d % FEED_EVENTS])?;
            s.sent_to += len;
            self.ends[d].store(s.sent_to, Ordering::Relaxed);
            self.sent.store(d + 1, Ordering::Release);
            s.busy_until = now.max(s.busy_until)
                + DMA_COST
                + Duration::from_secs_f64((len * size) as f64 / wire.rate);
        }
    }

    /// Waits for DMA `d` (enqueued) to complete (see [`wait_event_once`]); false when a
    /// thread fails first.
    fn wait_dma(&self, d: usize, events: &[Event]) -> Result<bool> {
        wait_event_once(
            &self.landed[d],
            &self.failed,
            &events[d % FEED_EVENTS],
            || {
                self.landed_to
                    .fetch_max(self.ends[d].load(Ordering::Relaxed), Ordering::AcqRel);
            },
        )
    }

    /// Waits until every element before `upto` has landed (so the ring room it held may be
    /// written again), sending it first when it is written but not yet sent. False when a
    /// thread fails first.
    fn wait_room(&self, wire: &Wire, upto: usize) -> Result<bool> {
        loop {
            if self.landed_to.load(Ordering::Acquire) >= upto {
                return Ok(true);
            }
            if self.failed.load(Ordering::Relaxed) {
                return Ok(false);
            }
            let sent = self.sent.load(Ordering::Acquire);
            // The first DMA that ends at or past `upto`.
            let lo = self.ends[..sent].partition_point(|e| e.load(Ordering::Relaxed) < upto);
            if lo < sent {
                if !self.wait_dma(lo, wire.events)? {
                    return Ok(false);
                }
            } else {
                // Not sent: send it once written (an earlier part may still be in hand).
                self.pump(wire, upto)?;
                if self.sent.load(Ordering::Acquire) == sent {
                    std::hint::spin_loop();
                }
            }
        }
    }
}

/// Sends `src` into `dst` (same length) through a ring of pinned memory on `stream` (see
/// [`Feed`]): up to `plan.threads` copy threads each run `fill(ring piece, matching src
/// piece)` on parts of the copy (a plain or streaming copy, or a conversion); returns once
/// every DMA has completed.
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
    if src.is_empty() {
        return Ok(());
    }
    // The copy threads wake while the ring is set up.
    workers.wake(plan.threads);
    let (n, size) = (src.len(), std::mem::size_of::<T>());
    let grid = Grid::new(n, plan, 0, align_elems(plan.host_align, size));
    let ring_len = (plan.slots.max(1) * grid.max_chunk()).min(n);
    let ring = Ring::<T>::new(stream, 1, ring_len, FEED_EVENTS)?;
    let max_dma = plan.chunk_len.clamp(1, ring_len);
    let feed = Feed::new(&grid, n, ring_len, max_dma);
    let wire = Wire {
        stream,
        dma: Dma::of(stream),
        ring: ring.bases[0],
        dev_base: dst.device_ptr(),
        events: &ring.events,
        size,
        max_dma,
        min_dma: (max_dma >> RAMP[0]).max(1),
        rate: if plan.h2d_rate > 0.0 {
            plan.h2d_rate
        } else {
            FALLBACK_RATE
        },
    };

    let error = run_parts(workers, plan.threads, &feed.failed, || {
        while let Some(p) = feed.next() {
            let (_, range) = grid.part(p);
            // The room this part takes held elements a ring's length back.
            if range.end > ring_len && !feed.wait_room(&wire, range.end - ring_len)? {
                return Ok(());
            }
            // Up to the ring's end, then from its start.
            let at = range.start % ring_len;
            let head = range.len().min(ring_len - at);
            for (at, from, len) in [
                (at, range.start, head),
                (0, range.start + head, range.len() - head),
            ] {
                if len == 0 {
                    continue;
                }
                // SAFETY: the ring's block holds `ring_len` elements and `at + len` is at most
                // that; the ticket hands part p to this thread alone, and the DMAs that read
                // this room for earlier elements have completed (`wait_room`), or it is on
                // its first use after `Ring::new` waited for earlier users.
                let piece = unsafe { cpu::view_mut::<T>(wire.ring + (at * size) as u64, len) };
                fill(piece, &src[from..from + len]);
            }
            feed.written[p].store(true, Ordering::Release);
            feed.pump(&wire, 0)?;
        }
        Ok(())
    });
    // Every part is written unless a thread failed: send what is left.
    let error = match error {
        None => feed.pump(&wire, n).err(),
        e => e,
    };
    ring.finish(stream, error)
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

#[cfg(test)]
mod tests;
