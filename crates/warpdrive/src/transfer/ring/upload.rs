//! Uploads through the ring: the copy threads write parts into one pinned ring and the
//! thread that finishes one may send what is written in order as the next DMA ([`Feed`]).

use std::sync::atomic::{AtomicBool, AtomicU8, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use crate::device::dma::Dma;
use crate::device::{cpu, Event, Stream};
use crate::dtype::DType;
use crate::error::Result;
use crate::memory::{check_len, Buffer};

use super::grid::{align_elems, Grid, RAMP};
use super::{run_parts, wait_event_once, Ring, RingPlan, FALLBACK_RATE, UNKNOWN};
use crate::transfer::workers::Workers;

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
