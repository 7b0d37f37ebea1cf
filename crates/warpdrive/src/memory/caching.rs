//! The caching allocator's policy, free of any backend: it manages address ranges that a
//! [`RawAlloc`] hands out (device memory on CUDA, host memory on the CPU backend, counters
//! in the property tests), so the same code serves both backends and is tested without a GPU.
//!
//! - Every request is rounded up to [`ROUND`] bytes. Requests of at most [`SMALL_MAX`] come
//!   from [`SMALL_SEGMENT`]-byte segments; larger ones from segments of their own size class
//!   (see [`segment_size`]), so small blocks never fragment the large segments.
//! - A request takes the best-fitting free block (smallest size, then lowest address) and
//!   splits off the rest when it is at least [`ROUND`] bytes; a block larger than
//!   [`PoolConfig::max_split_bytes`] is never split (and is handed only to requests close to
//!   its size). Freed neighbours in a segment coalesce.
//! - Free lists are per stream: a segment belongs to the stream that asked for it, and its
//!   blocks are reused only by that stream, at once (stream order makes that safe). A block
//!   that was also used on other streams comes back with [`Fence`]s recorded on those
//!   streams and is reusable only once all of them have completed.
//! - Capture mode: while a stream is captured into a graph, its allocations come only from
//!   blocks the pool already holds, never the driver; those blocks (and every block freed on
//!   that stream meanwhile) stay reserved for the graph until [`Core::release_graph`].
//! - On a miss the pool asks the driver for a segment. If that would raise the reserved
//!   high-water mark, fully free cached segments are returned first. When the driver refuses,
//!   the pool waits for the device (every pending block completes) and serves the request
//!   from its cache if a block now fits; else every free segment is returned and the driver
//!   asked once more before `OutOfMemory`.
//!   A request beyond the device's total memory fails at once (the driver is not asked).

use std::collections::{BTreeMap, HashMap, VecDeque};

use serde::Serialize;

use crate::error::{Error, Result};

/// Every request is rounded up to a multiple of this.
pub const ROUND: usize = 512;
/// Requests of at most this many bytes are "small".
pub const SMALL_MAX: usize = 1 << 20;
/// Small requests are packed into segments of this size.
pub const SMALL_SEGMENT: usize = 2 << 20;
/// Large requests under [`MID_MAX`] share segments of this size.
pub const MID_SEGMENT: usize = 20 << 20;
/// Requests from here on get a segment of their own size, rounded to [`LARGE_ROUND`].
pub const MID_MAX: usize = 10 << 20;
pub const LARGE_ROUND: usize = 2 << 20;
/// A request at or above `max_split_bytes` takes an unsplittable block only if the block is
/// at most this much larger (so a huge block is not wasted on a much smaller request).
pub const OVERSIZE_SLACK: usize = 20 << 20;

const NIL: u32 = u32::MAX;
/// Tags of graph-reserved free lists carry this bit; stream tags are stream ids (< 2⁶³).
const GRAPH_BIT: u64 = 1 << 63;

/// Where the pool gets its segments: the device's raw allocator (or a test double).
pub(crate) trait RawAlloc {
    /// `bytes > 0` of fresh memory; `Error::OutOfMemory` when the backend refuses.
    fn alloc(&mut self, bytes: usize) -> Result<u64>;
    /// Returns a range from `alloc` (with its size).
    fn free(&mut self, addr: u64, bytes: usize) -> Result<()>;
    /// Waits until no queued work can still use any memory (before segments are freed);
    /// false when the device cannot be waited for (a resident kernel runs): then nothing is
    /// released, as a free would be held back anyway.
    fn synchronize(&mut self) -> Result<bool>;
    /// (free, total) bytes of the backend, for error messages.
    fn mem_info(&self) -> Option<(usize, usize)>;
    /// The backend's total bytes, when known: larger requests fail without asking it.
    fn capacity(&mut self) -> Option<usize>;
}

/// A point recorded on a stream; the pool polls it, never waits on it.
pub(crate) trait Fence {
    fn is_done(&self) -> Result<bool>;
}

impl Fence for crate::device::Event {
    fn is_done(&self) -> Result<bool> {
        self.query()
    }
}

/// Tuning of the caching allocator.
#[derive(Debug, Clone, PartialEq)]
pub struct PoolConfig {
    /// Blocks larger than this are never split (PyTorch's `max_split_size`), and are handed
    /// only to requests above it within `OVERSIZE_SLACK` (20 MiB) of their size. `usize::MAX`
    /// (the default) lets every block split; values under `MID_SEGMENT` (20 MiB) count as
    /// that.
    pub max_split_bytes: usize,
    /// Before a new segment would raise the reserved high-water mark, return fully free
    /// cached segments to the driver first (default on: it costs driver frees only on
    /// misses that would grow the peak, and keeps `reserved` close to what is live).
    pub release_before_growth: bool,
}

impl Default for PoolConfig {
    fn default() -> Self {
        PoolConfig {
            max_split_bytes: usize::MAX,
            release_before_growth: true,
        }
    }
}

/// A snapshot of a pool's counters. Byte counts are of rounded blocks.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct PoolStats {
    /// Bytes in blocks handed out and not yet freed.
    pub in_use: u64,
    pub peak_in_use: u64,
    /// Bytes held from the driver (all segments).
    pub reserved: u64,
    pub peak_reserved: u64,
    /// Bytes freed by their owner but waiting for other streams' work to complete.
    pub pending: u64,
    /// Bytes held for graphs (free blocks reserved for a captured graph).
    pub graph_reserved: u64,
    /// Allocations served, and how many of them needed the driver.
    pub allocations: u64,
    pub driver_allocs: u64,
    pub driver_frees: u64,
    pub segments: u64,
    pub largest_free: u64,
    pub total_free: u64,
    /// `1 − largest_free / total_free` (0 when nothing is free).
    pub fragmentation: f64,
}

/// A block handed out by [`Core::alloc`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Grant {
    pub block: u32,
    pub addr: u64,
    /// The rounded size held.
    pub size: usize,
}

/// Rounds `bytes` up to [`ROUND`] (at least one unit); `None` on overflow.
pub fn round_size(bytes: usize) -> Option<usize> {
    Some(bytes.max(1).checked_add(ROUND - 1)? / ROUND * ROUND)
}

/// The segment a miss of `rounded` bytes asks the driver for.
pub fn segment_size(rounded: usize) -> usize {
    if rounded <= SMALL_MAX {
        SMALL_SEGMENT
    } else if rounded < MID_MAX {
        MID_SEGMENT
    } else {
        rounded.div_ceil(LARGE_ROUND).saturating_mul(LARGE_ROUND)
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    Free,
    Used,
    /// Freed, waiting for this many fences.
    Pending(u32),
    /// Slab slot not in use.
    Vacant,
}

#[derive(Debug, Clone)]
struct Block {
    addr: u64,
    size: usize,
    seg: u32,
    prev: u32,
    next: u32,
    state: State,
    /// The graph this block is reserved for (0: none).
    graph: u64,
}

#[derive(Debug, Clone)]
struct Segment {
    addr: u64,
    size: usize,
    stream: u64,
    small: bool,
    /// Its first block (lowest address).
    head: u32,
}

/// Free-list key: (tag, small, size, addr). Ordered so that a range query from
/// `(tag, small, size, 0)` yields the best fit first.
type Key = (u64, bool, usize, u64);

/// The allocator state. Not thread-safe by itself: the device pool wraps it in a mutex.
pub(crate) struct Core<R, F> {
    raw: R,
    config: PoolConfig,
    blocks: Vec<Block>,
    vacant_blocks: Vec<u32>,
    segments: Vec<Option<Segment>>,
    vacant_segments: Vec<u32>,
    free: BTreeMap<Key, u32>,
    pending: VecDeque<(F, u32)>,
    /// Fences whose work completed, kept for reuse.
    spent: Vec<F>,
    /// Capturing stream → graph.
    captures: HashMap<u64, u64>,
    /// Live graphs → their stream.
    graphs: HashMap<u64, u64>,
    next_graph: u64,
    stats: PoolStats,
}

impl<R: RawAlloc, F: Fence> Core<R, F> {
    pub fn new(raw: R, mut config: PoolConfig) -> Self {
        // Segments of up to MID_SEGMENT bytes must split, or every small request would
        // hold a whole segment.
        config.max_split_bytes = config.max_split_bytes.max(MID_SEGMENT);
        Core {
            raw,
            config,
            blocks: Vec::new(),
            vacant_blocks: Vec::new(),
            segments: Vec::new(),
            vacant_segments: Vec::new(),
            free: BTreeMap::new(),
            pending: VecDeque::new(),
            spent: Vec::new(),
            captures: HashMap::new(),
            graphs: HashMap::new(),
            next_graph: 1,
            stats: PoolStats::default(),
        }
    }

    #[cfg(test)]
    pub fn raw(&self) -> &R {
        &self.raw
    }

    /// A fence whose work completed earlier, for reuse.
    pub fn take_spent_fence(&mut self) -> Option<F> {
        self.spent.pop()
    }

    /// `bytes` for `stream`.
    pub fn alloc(&mut self, bytes: usize, stream: u64) -> Result<Grant> {
        let rounded = round_size(bytes).ok_or_else(|| self.oom(bytes, "the size overflows"))?;
        let small = rounded <= SMALL_MAX;
        if let Some(&graph) = self.captures.get(&stream) {
            return self.alloc_captured(bytes, rounded, small, stream, graph);
        }
        if !self.pending.is_empty() {
            self.poll(false)?;
        }
        if let Some(idx) = self.find(stream, small, rounded) {
            return Ok(self.take(idx, rounded, 0));
        }
        if !self.pending.is_empty() {
            self.poll(true)?;
            if let Some(idx) = self.find(stream, small, rounded) {
                return Ok(self.take(idx, rounded, 0));
            }
        }
        let seg_bytes = segment_size(rounded);
        let addr = match self.grow(bytes, seg_bytes)? {
            Some(addr) => addr,
            None => {
                // Refused: wait for the device, so that every pending block completes (one
                // may fit, though its segment holds live blocks and cannot go back); else
                // return every free segment and ask once more.
                let waited = self.raw.synchronize()?;
                self.poll(true)?;
                if let Some(idx) = self.find(stream, small, rounded) {
                    return Ok(self.take(idx, rounded, 0));
                }
                if waited {
                    self.release_segments(u64::MAX)?;
                }
                match self.raw.alloc(seg_bytes) {
                    Ok(addr) => addr,
                    Err(Error::OutOfMemory { .. }) => {
                        let why = format!("the driver refused {seg_bytes} bytes");
                        return Err(self.oom(bytes, &why));
                    }
                    Err(e) => return Err(e),
                }
            }
        };
        let idx = self.add_segment(addr, seg_bytes, stream, small);
        Ok(self.take(idx, rounded, 0))
    }

    fn alloc_captured(
        &mut self,
        bytes: usize,
        rounded: usize,
        small: bool,
        stream: u64,
        graph: u64,
    ) -> Result<Grant> {
        // Graph-reserved blocks first, then the stream's own cache; never the driver, and
        // no fence polling (event queries are not allowed while capturing).
        if let Some(idx) = self.find(GRAPH_BIT | graph, small, rounded) {
            return Ok(self.take(idx, rounded, graph));
        }
        if let Some(idx) = self.find(stream, small, rounded) {
            return Ok(self.take(idx, rounded, graph));
        }
        Err(self.oom(
            bytes,
            &format!(
                "stream #{stream} is being captured into a graph, so the pool may not call the \
                 driver, and it holds no free block of {rounded} bytes for it; allocate the \
                 graph's buffers once before capturing (or allocate them outside the capture)"
            ),
        ))
    }

    /// Returns a block. Without fences it is reusable at once on its stream; with fences,
    /// once every one of them has completed.
    pub fn free(&mut self, block: u32, fences: Vec<F>) -> Result<()> {
        let b = self
            .blocks
            .get_mut(block as usize)
            .filter(|b| b.state == State::Used)
            .ok_or_else(|| Error::InvalidArgument(format!("pool: block {block} is not in use")))?;
        let size = b.size as u64;
        let seg = b.seg;
        self.stats.in_use -= size;
        // A block freed while its stream is being captured may still be used by the graph's
        // replays: it stays reserved for that graph.
        if b.graph == 0 && !self.captures.is_empty() {
            if let Some(s) = &self.segments[seg as usize] {
                if let Some(&g) = self.captures.get(&s.stream) {
                    self.blocks[block as usize].graph = g;
                }
            }
        }
        if fences.is_empty() {
            self.release(block);
        } else {
            self.blocks[block as usize].state = State::Pending(fences.len() as u32);
            self.stats.pending += size;
            self.pending.extend(fences.into_iter().map(|f| (f, block)));
        }
        Ok(())
    }

    /// Polls pending fences: only up to the first incomplete one, or all with `all`.
    pub fn poll(&mut self, all: bool) -> Result<()> {
        let mut i = 0;
        while i < self.pending.len() {
            if !self.pending[i].0.is_done()? {
                if !all {
                    break;
                }
                i += 1;
                continue;
            }
            let Some((fence, block)) = self.pending.remove(i) else {
                break;
            };
            self.spent.push(fence);
            let b = &mut self.blocks[block as usize];
            if let State::Pending(n) = b.state {
                if n > 1 {
                    b.state = State::Pending(n - 1);
                } else {
                    let size = b.size as u64;
                    b.state = State::Used;
                    self.stats.pending -= size;
                    self.release(block);
                }
            }
        }
        Ok(())
    }

    /// Returns every fully free segment (not reserved for a graph) to the driver, after
    /// waiting for the device; returns the bytes released. Does nothing while a capture is
    /// on (freeing memory is not allowed then).
    pub fn trim(&mut self) -> Result<u64> {
        if !self.captures.is_empty() {
            return Ok(0);
        }
        if !self.raw.synchronize()? {
            return Ok(0);
        }
        self.poll(true)?;
        self.release_segments(u64::MAX)
    }

    /// Releases fully free segments, largest first, until `want` bytes are released.
    fn release_segments(&mut self, want: u64) -> Result<u64> {
        let mut whole: Vec<(usize, u32)> = self
            .segments
            .iter()
            .enumerate()
            .filter_map(|(i, s)| {
                let s = s.as_ref()?;
                let b = &self.blocks[s.head as usize];
                (b.state == State::Free && b.graph == 0 && b.size == s.size)
                    .then_some((s.size, i as u32))
            })
            .collect();
        whole.sort_unstable_by(|a, b| b.cmp(a));
        let mut released = 0u64;
        for (_, seg) in whole {
            if released >= want {
                break;
            }
            released += self.free_segment(seg)?;
        }
        Ok(released)
    }

    fn free_segment(&mut self, seg: u32) -> Result<u64> {
        let Some(head) = self.segments[seg as usize].as_ref().map(|s| s.head) else {
            return Ok(0);
        };
        let key = self.key(head);
        self.free.remove(&key);
        let Some(s) = self.segments[seg as usize].take() else {
            return Ok(0);
        };
        self.vacate(head);
        self.vacant_segments.push(seg);
        self.stats.reserved -= s.size as u64;
        self.stats.segments -= 1;
        self.stats.driver_frees += 1;
        self.raw.free(s.addr, s.size)?;
        Ok(s.size as u64)
    }

    /// A fresh segment of `seg_bytes` from the driver, making room first as the config says;
    /// `None` when the driver refused and the caller may wait for the device and retry (no
    /// capture is on).
    fn grow(&mut self, bytes: usize, seg_bytes: usize) -> Result<Option<u64>> {
        if self.raw.capacity().is_some_and(|cap| seg_bytes > cap) {
            return Err(self.oom(bytes, "more than the device's total memory"));
        }
        // While any capture is on, nothing is freed (a free may synchronise the device).
        let capturing = !self.captures.is_empty();
        let reserved_after = self.stats.reserved + seg_bytes as u64;
        if !capturing
            && self.config.release_before_growth
            && reserved_after > self.stats.peak_reserved
        {
            let want = reserved_after - self.stats.peak_reserved;
            if self.has_whole_free_segment() && self.raw.synchronize()? {
                self.release_segments(want)?;
            }
        }
        match self.raw.alloc(seg_bytes) {
            Ok(addr) => Ok(Some(addr)),
            Err(Error::OutOfMemory { .. }) if !capturing => Ok(None),
            Err(Error::OutOfMemory { .. }) => Err(self.oom(
                bytes,
                &format!("the driver refused {seg_bytes} bytes during a graph capture"),
            )),
            Err(e) => Err(e),
        }
    }

    fn has_whole_free_segment(&self) -> bool {
        self.segments.iter().flatten().any(|s| {
            let b = &self.blocks[s.head as usize];
            b.state == State::Free && b.graph == 0 && b.size == s.size
        })
    }

    /// Starts capture mode for `stream`; returns the graph id that reserves its memory.
    pub fn begin_capture(&mut self, stream: u64) -> Result<u64> {
        if self.captures.contains_key(&stream) {
            return Err(Error::InvalidArgument(format!(
                "stream #{stream} is already being captured"
            )));
        }
        let graph = self.next_graph;
        self.next_graph += 1;
        self.captures.insert(stream, graph);
        self.graphs.insert(graph, stream);
        Ok(graph)
    }

    /// Ends capture mode for `graph`'s stream; its blocks stay reserved for it.
    pub fn end_capture(&mut self, graph: u64) {
        if let Some(&stream) = self.graphs.get(&graph) {
            if self.captures.get(&stream) == Some(&graph) {
                self.captures.remove(&stream);
            }
        }
    }

    /// The graph is gone: its free blocks return to their streams' caches, and its blocks
    /// still in use will when they are freed.
    pub fn release_graph(&mut self, graph: u64) {
        self.end_capture(graph);
        if self.graphs.remove(&graph).is_none() {
            return;
        }
        let tag = GRAPH_BIT | graph;
        let held: Vec<u32> = self
            .free
            .range((tag, false, 0, 0)..=(tag, true, usize::MAX, u64::MAX))
            .map(|(_, &i)| i)
            .collect();
        for idx in held {
            let key = self.key(idx);
            self.free.remove(&key);
            self.blocks[idx as usize].graph = 0;
            self.blocks[idx as usize].state = State::Used;
            self.release(idx);
        }
    }

    #[cfg(test)]
    pub fn is_capturing(&self, stream: u64) -> bool {
        self.captures.contains_key(&stream)
    }

    /// Bytes handed out and not yet returned (the one figure [`stats`](Self::stats) does not
    /// have to walk the free blocks for).
    pub fn in_use(&self) -> u64 {
        self.stats.in_use
    }

    pub fn stats(&self) -> PoolStats {
        let mut s = self.stats;
        let (mut largest, mut total, mut graph) = (0u64, 0u64, 0u64);
        for &(tag, _, size, _) in self.free.keys() {
            largest = largest.max(size as u64);
            total += size as u64;
            if tag & GRAPH_BIT != 0 {
                graph += size as u64;
            }
        }
        s.largest_free = largest;
        s.total_free = total;
        s.graph_reserved = graph;
        s.fragmentation = if total == 0 {
            0.0
        } else {
            1.0 - largest as f64 / total as f64
        };
        s
    }

    /// Restarts the peaks from the current values.
    pub fn reset_peaks(&mut self) {
        self.stats.peak_in_use = self.stats.in_use;
        self.stats.peak_reserved = self.stats.reserved;
    }

    /// `OutOfMemory` for `bytes`, with the pool's and the backend's state.
    pub fn oom(&self, bytes: usize, why: &str) -> Error {
        let s = self.stats();
        let device = match self.raw.mem_info() {
            Some((free, total)) => format!("device free {free} of {total} bytes"),
            None => "device free memory unknown".into(),
        };
        Error::OutOfMemory {
            requested: bytes,
            detail: format!(
                "{why}; pool: in use {} bytes, reserved {} bytes, largest free block {} \
                 bytes; {device}",
                s.in_use, s.reserved, s.largest_free
            ),
        }
    }

    // ---- internals ----

    /// The best-fitting free block in list `tag`, honouring the never-split threshold.
    fn find(&self, tag: u64, small: bool, rounded: usize) -> Option<u32> {
        let (&(_, _, size, _), &idx) = self
            .free
            .range((tag, small, rounded, 0)..=(tag, small, usize::MAX, u64::MAX))
            .next()?;
        let max_split = self.config.max_split_bytes;
        if size > max_split && (rounded <= max_split || size - rounded > OVERSIZE_SLACK) {
            // An unsplittable block, too large for this request (larger ones are too).
            return None;
        }
        Some(idx)
    }

    fn key(&self, idx: u32) -> Key {
        let b = &self.blocks[idx as usize];
        let (stream, small) = self.segments[b.seg as usize]
            .as_ref()
            .map(|s| (s.stream, s.small))
            .unwrap_or((0, false));
        let tag = if b.graph != 0 {
            GRAPH_BIT | b.graph
        } else {
            stream
        };
        (tag, small, b.size, b.addr)
    }

    /// Hands out free block `idx` for `rounded` bytes, splitting off the rest; the taken
    /// part is reserved for `graph` when that is not 0.
    fn take(&mut self, idx: u32, rounded: usize, graph: u64) -> Grant {
        let key = self.key(idx);
        self.free.remove(&key);
        let b = &self.blocks[idx as usize];
        let rest = b.size - rounded;
        if rest >= ROUND && b.size <= self.config.max_split_bytes {
            let tail = Block {
                addr: b.addr + rounded as u64,
                size: rest,
                seg: b.seg,
                prev: idx,
                next: b.next,
                state: State::Free,
                graph: b.graph,
            };
            let next = b.next;
            let t = self.insert_block(tail);
            if next != NIL {
                self.blocks[next as usize].prev = t;
            }
            let b = &mut self.blocks[idx as usize];
            b.next = t;
            b.size = rounded;
            let k = self.key(t);
            self.free.insert(k, t);
        }
        let b = &mut self.blocks[idx as usize];
        b.state = State::Used;
        if graph != 0 {
            b.graph = graph;
        }
        let size = b.size;
        self.stats.allocations += 1;
        self.stats.in_use += size as u64;
        self.stats.peak_in_use = self.stats.peak_in_use.max(self.stats.in_use);
        Grant {
            block: idx,
            addr: b.addr,
            size,
        }
    }

    /// Marks used block `idx` free: coalesces it with free neighbours of the same
    /// reservation and puts the result on its free list.
    fn release(&mut self, idx: u32) {
        let graph = self.blocks[idx as usize].graph;
        if graph != 0 && !self.graphs.contains_key(&graph) {
            self.blocks[idx as usize].graph = 0;
        }
        self.blocks[idx as usize].state = State::Free;
        let mut idx = idx;
        let prev = self.blocks[idx as usize].prev;
        if self.mergeable(idx, prev) {
            self.absorb(prev, idx);
            idx = prev;
        }
        let next = self.blocks[idx as usize].next;
        if self.mergeable(idx, next) {
            self.absorb(idx, next);
        }
        let key = self.key(idx);
        self.free.insert(key, idx);
    }

    fn mergeable(&self, idx: u32, other: u32) -> bool {
        other != NIL && {
            let (a, b) = (&self.blocks[idx as usize], &self.blocks[other as usize]);
            b.state == State::Free && a.graph == b.graph
        }
    }

    /// Merges block `hi` (just after `lo`) into `lo`; whichever of them is on a free list
    /// is taken off it first.
    fn absorb(&mut self, lo: u32, hi: u32) {
        for i in [lo, hi] {
            if self.blocks[i as usize].state == State::Free {
                let key = self.key(i);
                self.free.remove(&key);
            }
        }
        let (size, next) = {
            let h = &self.blocks[hi as usize];
            (h.size, h.next)
        };
        let l = &mut self.blocks[lo as usize];
        l.size += size;
        l.next = next;
        if next != NIL {
            self.blocks[next as usize].prev = lo;
        }
        self.vacate(hi);
    }

    fn insert_block(&mut self, block: Block) -> u32 {
        match self.vacant_blocks.pop() {
            Some(i) => {
                self.blocks[i as usize] = block;
                i
            }
            None => {
                self.blocks.push(block);
                (self.blocks.len() - 1) as u32
            }
        }
    }

    fn vacate(&mut self, idx: u32) {
        self.blocks[idx as usize].state = State::Vacant;
        self.vacant_blocks.push(idx);
    }

    /// Registers a fresh segment as one free block (on no list yet); returns the block.
    fn add_segment(&mut self, addr: u64, size: usize, stream: u64, small: bool) -> u32 {
        let seg = Segment {
            addr,
            size,
            stream,
            small,
            head: NIL,
        };
        let s = match self.vacant_segments.pop() {
            Some(i) => {
                self.segments[i as usize] = Some(seg);
                i
            }
            None => {
                self.segments.push(Some(seg));
                (self.segments.len() - 1) as u32
            }
        };
        let idx = self.insert_block(Block {
            addr,
            size,
            seg: s,
            prev: NIL,
            next: NIL,
            state: State::Free,
            graph: 0,
        });
        if let Some(seg) = self.segments[s as usize].as_mut() {
            seg.head = idx;
        }
        self.stats.reserved += size as u64;
        self.stats.peak_reserved = self.stats.peak_reserved.max(self.stats.reserved);
        self.stats.segments += 1;
        self.stats.driver_allocs += 1;
        let key = self.key(idx);
        self.free.insert(key, idx);
        idx
    }

    /// Every live block as (addr, size, in use?), in address order per segment (tests).
    #[cfg(test)]
    pub fn layout(&self) -> Vec<(u64, usize, bool)> {
        let mut out = Vec::new();
        for s in self.segments.iter().flatten() {
            let mut i = s.head;
            while i != NIL {
                let b = &self.blocks[i as usize];
                out.push((b.addr, b.size, b.state != State::Free));
                i = b.next;
            }
        }
        out
    }
}

#[cfg(test)]
mod tests;
