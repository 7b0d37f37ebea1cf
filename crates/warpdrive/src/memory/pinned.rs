//! Page-locked host memory from a pool: [`PinnedBuf<T>`].
//!
//! Pinning is slow (`cuMemHostAlloc` maps and locks every page), so blocks are cached by
//! size class: eight classes per power of two, so a block wastes at most 1/8 of the request
//! (no plain power-of-two rounding). Blocks are allocated with flags 0, cached memory the CPU
//! reads fast (not write-combined, which is fast for the GPU to read but very slow for the
//! CPU). A block returns to its pool on drop and is reused only after the copies that used
//! it have completed: each async copy records an event in the buffer, and a dropped buffer
//! with events still pending waits in the pool until they complete. On the CPU backend the
//! same pool serves plain host memory.

use std::collections::HashMap;
use std::marker::PhantomData;
use std::sync::Arc;

use parking_lot::Mutex;
use serde::Serialize;

use crate::device::dma::Dma;
use crate::device::{cpu, Device, Event, Slot, Stream};
use crate::dtype::DType;
use crate::error::{Error, Result};

use super::Buffer;

/// The size class a pinned request of `bytes` gets: `bytes` rounded up to one of eight
/// steps per power of two (`2ᵏ + j·2ᵏ⁻³`), so the class exceeds the request by less than
/// 1/8 of it. Sizes under 16 bytes are their own class.
pub fn pinned_class(bytes: usize) -> usize {
    let b = bytes.max(1);
    let step = ((1usize << b.ilog2()) / 8).max(1);
    b.div_ceil(step).saturating_mul(step)
}

/// A pinned pool's counters (bytes are of whole class blocks).
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct PinnedStats {
    pub in_use: u64,
    pub peak_in_use: u64,
    /// Bytes pinned (in use, cached, or waiting for copies).
    pub reserved: u64,
    /// Bytes dropped by their owner while copies that use them were still in flight.
    pub pending: u64,
    pub allocations: u64,
    pub driver_allocs: u64,
    pub driver_frees: u64,
}

/// A pool of page-locked host memory for one device. Thread-safe.
pub struct PinnedPool {
    device: Device,
    /// The NUMA node its memory is bound to (`None`: wherever the driver puts it).
    node: Option<u32>,
    state: Mutex<State>,
}

#[derive(Default)]
struct State {
    /// Class → cached blocks.
    free: HashMap<usize, Vec<u64>>,
    /// Dropped blocks whose copies may still run: (events, class, address).
    pending: Vec<(Vec<Event>, usize, u64)>,
    /// Completed events, reused for later copies.
    events: Vec<Event>,
    stats: PinnedStats,
}

impl std::fmt::Debug for PinnedPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "PinnedPool({})", self.device.label())
    }
}

impl PinnedPool {
    /// A new, empty pool for `device`, its memory on the GPU's NUMA node when the machine
    /// has several (see [`Device::numa_placement`]).
    pub fn new(device: &Device) -> Arc<PinnedPool> {
        let node = device
            .numa_placement()
            .node
            .and_then(|n| u32::try_from(n).ok());
        Self::on_node(device, node)
    }

    /// A new, empty pool whose memory is bound to NUMA `node` (`None`: no binding).
    pub fn on_node(device: &Device, node: Option<u32>) -> Arc<PinnedPool> {
        Arc::new(PinnedPool {
            device: device.clone(),
            node,
            state: Mutex::new(State::default()),
        })
    }

    pub fn device(&self) -> &Device {
        &self.device
    }

    /// The NUMA node the pool's memory is bound to, if any.
    pub fn numa_node(&self) -> Option<u32> {
        self.node
    }

    /// Pins a block for a request of `bytes` ahead of time, so the next such request is
    /// served from the cache.
    pub fn prewarm(&self, bytes: usize) -> Result<()> {
        let class = pinned_class(bytes);
        let ptr = self.device.alloc_pinned_raw(class, self.node)?;
        let mut st = self.state.lock();
        st.stats.driver_allocs += 1;
        st.stats.reserved += class as u64;
        st.free.entry(class).or_default().push(ptr);
        Ok(())
    }

    pub fn stats(&self) -> PinnedStats {
        self.state.lock().stats
    }

    /// Unpins every cached block (not those in use or waiting for copies); returns the bytes
    /// released.
    pub fn trim(&self) -> Result<u64> {
        let mut st = self.state.lock();
        poll(&mut st)?;
        let mut released = 0u64;
        for (class, ptrs) in st.free.drain().collect::<Vec<_>>() {
            for ptr in ptrs {
                self.device.free_pinned_raw(ptr, class, self.node)?;
                released += class as u64;
                st.stats.driver_frees += 1;
                st.stats.reserved -= class as u64;
            }
        }
        Ok(released)
    }

    /// A block of class `pinned_class(bytes)`: cached, or freshly pinned.
    fn alloc(&self, bytes: usize) -> Result<(u64, usize)> {
        let class = pinned_class(bytes);
        let mut st = self.state.lock();
        if !st.pending.is_empty() {
            poll(&mut st)?;
        }
        st.stats.allocations += 1;
        if let Some(ptr) = st.free.get_mut(&class).and_then(Vec::pop) {
            st.stats.in_use += class as u64;
            st.stats.peak_in_use = st.stats.peak_in_use.max(st.stats.in_use);
            return Ok((ptr, class));
        }
        let ptr = match self.device.alloc_pinned_raw(class, self.node) {
            Ok(p) => p,
            Err(Error::OutOfMemory { .. }) => {
                // Unpin the cache (but not the blocks in flight) and try once more.
                drop(st);
                self.trim()?;
                st = self.state.lock();
                self.device
                    .alloc_pinned_raw(class, self.node)
                    .map_err(|e| match e {
                        Error::OutOfMemory { requested, detail } => Error::OutOfMemory {
                            requested,
                            detail: format!(
                            "pinned host memory: {detail}; pool: in use {} bytes, pinned {} bytes",
                            st.stats.in_use, st.stats.reserved
                        ),
                        },
                        e => e,
                    })?
            }
            Err(e) => return Err(e),
        };
        st.stats.driver_allocs += 1;
        st.stats.reserved += class as u64;
        st.stats.in_use += class as u64;
        st.stats.peak_in_use = st.stats.peak_in_use.max(st.stats.in_use);
        Ok((ptr, class))
    }

    /// Returns a block; with events, it is reused only once they have all completed.
    fn release(&self, ptr: u64, class: usize, events: Vec<Event>) {
        let mut st = self.state.lock();
        st.stats.in_use -= class as u64;
        if events.is_empty() {
            st.free.entry(class).or_default().push(ptr);
        } else {
            st.stats.pending += class as u64;
            st.pending.push((events, class, ptr));
        }
    }

    /// An event to record a use of its blocks with: a recycled one, or a new one.
    pub(crate) fn take_event(&self) -> Result<Event> {
        match self.state.lock().events.pop() {
            Some(e) => Ok(e),
            None => self.device.new_sync_event(),
        }
    }

    /// Keeps `events` (their uses complete, none to be waited on again) for
    /// [`PinnedPool::take_event`].
    pub(crate) fn recycle_events(&self, events: Vec<Event>) {
        self.state.lock().events.extend(events);
    }
}

/// Moves pending blocks whose copies have all completed back to the cache.
fn poll(st: &mut State) -> Result<()> {
    let mut i = 0;
    while i < st.pending.len() {
        let mut done = true;
        for e in &st.pending[i].0 {
            done &= e.query()?;
        }
        if done {
            let (events, class, ptr) = st.pending.swap_remove(i);
            st.stats.pending -= class as u64;
            st.free.entry(class).or_default().push(ptr);
            st.events.extend(events);
        } else {
            i += 1;
        }
    }
    Ok(())
}

/// The device's default pinned pool, created on first use; [`PinnedBuf::new`] uses it.
/// Trims every default pinned pool made so far (see [`super::release_cached`]).
pub(super) fn trim_default_pools() -> Result<u64> {
    let mut released = 0u64;
    for device in Device::opened() {
        if let Some(pool) = device.state_if_made::<Arc<PinnedPool>>(Slot::PinnedPool)? {
            released = released.saturating_add(pool.trim()?);
        }
    }
    Ok(released)
}

pub fn pinned_pool(device: &Device) -> Result<&'static Arc<PinnedPool>> {
    device.state(Slot::PinnedPool, || Ok(PinnedPool::new(device)))
}

/// `len` elements of `T` in page-locked host memory, from a [`PinnedPool`].
///
/// Host access ([`PinnedBuf::wait_slice`], [`PinnedBuf::wait_slice_mut`]) first waits for the
/// async copies that use the buffer, so the host never sees a half-done copy.
pub struct PinnedBuf<T: DType> {
    pool: Arc<PinnedPool>,
    ptr: u64,
    len: usize,
    class: usize,
    /// Events recorded after the copies that use this buffer.
    events: Vec<Event>,
    _t: PhantomData<T>,
}

impl<T: DType> std::fmt::Debug for PinnedBuf<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "PinnedBuf<{}>[{}] for {}",
            T::KIND.name(),
            self.len,
            self.pool.device().label()
        )
    }
}

impl<T: DType> PinnedBuf<T> {
    /// `len` elements (contents unspecified but valid values) from `device`'s pinned pool.
    pub fn new(device: &Device, len: usize) -> Result<Self> {
        Self::new_in(pinned_pool(device)?, len)
    }

    /// As [`PinnedBuf::new`], from `pool`.
    pub fn new_in(pool: &Arc<PinnedPool>, len: usize) -> Result<Self> {
        let bytes = crate::size::bytes_of::<T>("pinned buffer", len)?;
        super::check_host_bytes("pinned buffer", bytes)?;
        let (ptr, class) = if bytes == 0 {
            (0, 0)
        } else {
            pool.alloc(bytes)?
        };
        Ok(PinnedBuf {
            pool: pool.clone(),
            ptr,
            len,
            class,
            events: Vec::new(),
            _t: PhantomData,
        })
    }

    /// A pinned copy of `data`.
    pub fn from_slice(device: &Device, data: &[T]) -> Result<Self> {
        let mut buf = Self::new(device, data.len())?;
        buf.wait_slice_mut()?.copy_from_slice(data);
        Ok(buf)
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn size_bytes(&self) -> usize {
        self.len * std::mem::size_of::<T>()
    }

    pub fn device(&self) -> &Device {
        self.pool.device()
    }

    /// The pool this buffer came from (and goes back to).
    pub fn pool(&self) -> &Arc<PinnedPool> {
        &self.pool
    }

    /// The host address (also the device's address for it, under unified addressing).
    pub fn host_ptr(&self) -> u64 {
        self.ptr
    }

    /// True when the copies that use the buffer have completed; never waits.
    pub fn ready(&self) -> Result<bool> {
        for e in &self.events {
            if !e.query()? {
                return Ok(false);
            }
        }
        Ok(true)
    }

    /// The elements, after waiting for the copies that use the buffer to complete.
    pub fn wait_slice(&self) -> Result<&[T]> {
        for e in &self.events {
            e.synchronize()?;
        }
        // SAFETY: `ptr` is this buffer's own live block of at least `len` elements (every
        // `DType` is valid for any bits, and blocks are zeroed or written before reuse);
        // the copies using it have completed and `&self` excludes host writers.
        Ok(unsafe { cpu::view(self.ptr, self.len) })
    }

    /// The elements, mutably, after waiting for the copies that use the buffer to complete.
    pub fn wait_slice_mut(&mut self) -> Result<&mut [T]> {
        for e in &self.events {
            e.synchronize()?;
        }
        let done = std::mem::take(&mut self.events);
        self.pool.recycle_events(done);
        // SAFETY: as in `wait_slice`; `&mut self` makes this the only reference.
        Ok(unsafe { cpu::view_mut(self.ptr, self.len) })
    }

    /// Records that work enqueued on `stream` so far uses the buffer: host access and reuse
    /// wait for it. Uses already finished are forgotten first, so a block that a download
    /// reuses chunk after chunk holds one or two events, not one per chunk so far (every
    /// host view waited on each of them, which slowed chunked downloads several-fold;
    /// bench/NOTES.md, staging ring).
    pub(crate) fn record_use(&mut self, stream: &Stream) -> Result<()> {
        let mut done = Vec::new();
        let mut i = 0;
        while i < self.events.len() {
            if self.events[i].query()? {
                done.push(self.events.swap_remove(i));
            } else {
                i += 1;
            }
        }
        self.pool.recycle_events(done);
        let event = self.pool.take_event()?;
        stream.record(&event)?;
        self.events.push(event);
        Ok(())
    }
}

impl<T: DType> Drop for PinnedBuf<T> {
    fn drop(&mut self) {
        if self.ptr == 0 {
            return;
        }
        // Events whose copies are done need no waiting; keep only the others.
        let mut waiting = Vec::new();
        let mut done = Vec::new();
        for e in std::mem::take(&mut self.events) {
            match e.query() {
                Ok(true) => done.push(e),
                Ok(false) => waiting.push(e),
                Err(err) => {
                    // The device is unusable or the event broken: never reuse the block.
                    tracing::warn!("{self:?}: querying a copy event failed ({err}); leaking");
                    return;
                }
            }
        }
        self.pool.recycle_events(done);
        self.pool.release(self.ptr, self.class, waiting);
    }
}

impl<T: DType> Buffer<T> {
    /// Enqueues a copy of `src` (same length) into the buffer on `stream` and returns at
    /// once; `src` records the copy, so its host view and its reuse wait for it.
    pub fn copy_from_pinned(&mut self, stream: &Stream, src: &mut PinnedBuf<T>) -> Result<()> {
        super::check_len("copy_from_pinned", self.len(), src.len())?;
        self.copy_from_pinned_at(stream, 0, src, src.len())
    }

    /// Enqueues a copy of the buffer into `dst` (same length) on `stream` and returns at
    /// once; `dst`'s host view waits for the copy.
    pub fn copy_to_pinned(&self, stream: &Stream, dst: &mut PinnedBuf<T>) -> Result<()> {
        super::check_len("copy_to_pinned", self.len(), dst.len())?;
        self.copy_to_pinned_at(stream, 0, dst, dst.len())
    }

    /// As [`Buffer::copy_from_pinned`] for `src[..len]` into `self[offset..offset + len]`.
    pub fn copy_from_pinned_at(
        &mut self,
        stream: &Stream,
        offset: usize,
        src: &mut PinnedBuf<T>,
        len: usize,
    ) -> Result<()> {
        self.pinned_range(
            "copy_from_pinned",
            stream,
            offset,
            src.device(),
            src.len(),
            len,
        )?;
        if len == 0 {
            return Ok(());
        }
        let bytes = len * std::mem::size_of::<T>();
        let dev = self.device_ptr() + (offset * std::mem::size_of::<T>()) as u64;
        // SAFETY: the ranges were checked above to lie within both allocations; `src`
        // cannot be touched by the host nor reused until the event recorded below
        // has completed.
        unsafe { Dma::of(stream).copy(true, src.ptr as *mut u8, dev, bytes)? };
        src.record_use(stream)
    }

    /// As [`Buffer::copy_to_pinned`] for `self[offset..offset + len]` into `dst[..len]`.
    pub fn copy_to_pinned_at(
        &self,
        stream: &Stream,
        offset: usize,
        dst: &mut PinnedBuf<T>,
        len: usize,
    ) -> Result<()> {
        self.pinned_range(
            "copy_to_pinned",
            stream,
            offset,
            dst.device(),
            dst.len(),
            len,
        )?;
        if len == 0 {
            return Ok(());
        }
        let bytes = len * std::mem::size_of::<T>();
        let dev = self.device_ptr() + (offset * std::mem::size_of::<T>()) as u64;
        // SAFETY: the ranges were checked above to lie within both allocations; `dst`
        // cannot be touched by the host nor reused until the event recorded below
        // has completed.
        unsafe { Dma::of(stream).copy(false, dst.ptr as *mut u8, dev, bytes)? };
        dst.record_use(stream)
    }

    /// Checks the device, stream and range of a pinned copy of `len` elements at `offset`.
    fn pinned_range(
        &self,
        op: &'static str,
        stream: &Stream,
        offset: usize,
        host_device: &Device,
        host_len: usize,
        len: usize,
    ) -> Result<()> {
        self.check_stream(stream, op)?;
        self.device().same_as(host_device, op)?;
        if len > host_len || offset.checked_add(len).is_none_or(|end| end > self.len()) {
            return Err(Error::InvalidArgument(format!(
                "{op}: {len} elements at offset {offset} do not fit a buffer of {} and a \
                 host block of {host_len}",
                self.len()
            )));
        }
        Ok(())
    }
}
