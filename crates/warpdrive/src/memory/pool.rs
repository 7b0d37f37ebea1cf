//! The device pool: one per device by default ([`device_pool`]), behind every
//! [`Buffer`](super::Buffer). Two strategies, chosen at construction:
//!
//! - [`PoolStrategy::Caching`] (the default): warpdrive's caching allocator
//!   ([`caching`](super::caching) holds its policy) over the device's raw allocator
//!   (`cuMemAlloc`, or host memory on the CPU backend), behind a mutex.
//! - [`PoolStrategy::CudaAsync`]: CUDA's own stream-ordered allocator
//!   (`cuMemAllocFromPoolAsync` / `cuMemFreeAsync` on a pool whose release threshold is the
//!   maximum), so the two can be compared. CUDA only.
//!
//! Cross-stream use: a buffer used on streams other than the one it was allocated on is
//! marked with [`Buffer::record_stream`](super::Buffer::record_stream); when it is dropped,
//! an event is recorded on each of those streams and its block is reused only after they
//! complete (the async strategy makes the allocating stream wait on them instead).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use parking_lot::Mutex;

use crate::device::{AsyncMemPool, Device, Event, Slot, Stream};
use crate::error::{Error, Result};

use super::caching::{Core, PoolConfig, PoolStats, RawAlloc};

/// How a [`DevicePool`] gets memory.
#[derive(Debug, Clone, PartialEq)]
pub enum PoolStrategy {
    /// warpdrive's caching allocator, tuned by the config.
    Caching(PoolConfig),
    /// CUDA's stream-ordered allocator on a pool of its own (release threshold at the max).
    CudaAsync,
}

impl Default for PoolStrategy {
    fn default() -> Self {
        PoolStrategy::Caching(PoolConfig::default())
    }
}

/// The device's raw allocator, as the caching core sees it.
struct DeviceRaw {
    device: Device,
    /// Total device memory, read once.
    total: Option<usize>,
}

impl DeviceRaw {
    fn new(device: &Device) -> Self {
        DeviceRaw {
            device: device.clone(),
            total: None,
        }
    }
}

impl RawAlloc for DeviceRaw {
    fn alloc(&mut self, bytes: usize) -> Result<u64> {
        self.device.alloc_raw(bytes)
    }
    fn free(&mut self, addr: u64, bytes: usize) -> Result<()> {
        self.device.free_raw(addr, bytes)
    }
    fn synchronize(&mut self) -> Result<bool> {
        if self.device.has_resident_kernel() {
            return Ok(false);
        }
        self.device.synchronize().map(|()| true)
    }
    fn mem_info(&self) -> Option<(usize, usize)> {
        self.device.mem_info().ok()
    }
    fn capacity(&mut self) -> Option<usize> {
        if self.total.is_none() {
            self.total = self
                .device
                .mem_info()
                .ok()
                .map(|(_, t)| t)
                .filter(|&t| t > 0);
        }
        self.total
    }
}

/// A pool of device memory on one device. Thread-safe; share it as `Arc<DevicePool>`.
pub struct DevicePool {
    device: Device,
    kind: Kind,
}

// One pool per device and strategy: the size difference between variants does not matter.
#[allow(clippy::large_enum_variant)]
enum Kind {
    Caching(Mutex<Core<DeviceRaw, Event>>),
    Async(AsyncStrategy),
}

struct AsyncStrategy {
    pool: AsyncMemPool,
    /// Total device memory (0: unknown): larger requests fail without asking the driver, as
    /// the caching core's do.
    total: usize,
    /// Events for cross-stream frees, reused.
    events: Mutex<Vec<Event>>,
    allocations: AtomicU64,
    in_use: AtomicU64,
    peak_in_use: AtomicU64,
}

/// What a pool handed out, as the buffer keeps it until it is returned.
pub(crate) enum Allocation {
    /// Nothing (an empty buffer).
    None,
    Cached {
        block: u32,
    },
    Async {
        stream: Stream,
        bytes: usize,
    },
}

impl std::fmt::Debug for DevicePool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "DevicePool({}, {})",
            self.device.label(),
            self.strategy_name()
        )
    }
}

/// A pool hands its cached segments back to the driver when its last handle goes (no
/// buffer is left then: each holds the pool), so a pool made for one job does not keep the
/// device's memory until the process ends. A failure is logged: a drop cannot return it.
impl Drop for DevicePool {
    fn drop(&mut self) {
        if let Kind::Caching(core) = &self.kind {
            if let Err(e) = core.lock().trim() {
                tracing::warn!("a dropped device pool could not free its cache: {e}");
            }
        }
    }
}

impl DevicePool {
    /// A new pool on `device`. `CudaAsync` needs a CUDA device.
    pub fn new(device: &Device, strategy: PoolStrategy) -> Result<Arc<DevicePool>> {
        let kind = match strategy {
            PoolStrategy::Caching(config) => {
                Kind::Caching(Mutex::new(Core::new(DeviceRaw::new(device), config)))
            }
            PoolStrategy::CudaAsync => {
                let d = device.gpu("the CUDA stream-ordered pool strategy")?;
                Kind::Async(AsyncStrategy {
                    pool: d.new_async_pool()?,
                    total: d.mem_info()?.1,
                    events: Mutex::new(Vec::new()),
                    allocations: AtomicU64::new(0),
                    in_use: AtomicU64::new(0),
                    peak_in_use: AtomicU64::new(0),
                })
            }
        };
        Ok(Arc::new(DevicePool {
            device: device.clone(),
            kind,
        }))
    }

    pub fn device(&self) -> &Device {
        &self.device
    }

    /// `caching` or `cuda-async`.
    pub fn strategy_name(&self) -> &'static str {
        match self.kind {
            Kind::Caching(_) => "caching",
            Kind::Async(_) => "cuda-async",
        }
    }

    /// `bytes > 0` for work on `stream`; returns the address and the handle to free it with.
    pub(crate) fn alloc(&self, stream: &Stream, bytes: usize) -> Result<(u64, Allocation)> {
        self.device.same_as(stream.device(), "pool allocation")?;
        self.device.check_usable()?;
        match &self.kind {
            Kind::Caching(core) => {
                let g = core.lock().alloc(bytes, stream.id())?;
                Ok((g.addr, Allocation::Cached { block: g.block }))
            }
            Kind::Async(a) => {
                let q = stream.gpu("the async pool")?;
                if a.total > 0 && bytes > a.total {
                    return Err(Error::OutOfMemory {
                        requested: bytes,
                        detail: format!("more than the device's total memory ({} bytes)", a.total),
                    });
                }
                let ptr = a.pool.alloc(q.stream, bytes)?;
                a.allocations.fetch_add(1, Ordering::Relaxed);
                let now = a.in_use.fetch_add(bytes as u64, Ordering::Relaxed) + bytes as u64;
                a.peak_in_use.fetch_max(now, Ordering::Relaxed);
                Ok((
                    ptr,
                    Allocation::Async {
                        stream: stream.clone(),
                        bytes,
                    },
                ))
            }
        }
    }

    /// Returns an allocation; `uses` are the other streams it was used on. Errors are
    /// logged: this runs in `Drop`. A block whose cross-stream events could not be recorded
    /// is never reused (leaked with a warning) rather than risk handing it out too early.
    pub(crate) fn free(&self, ptr: u64, alloc: Allocation, uses: &[Stream]) {
        if let Err(e) = self.try_free(ptr, alloc, uses) {
            tracing::warn!("{self:?}: returning a block failed: {e}");
        }
    }

    fn try_free(&self, ptr: u64, alloc: Allocation, uses: &[Stream]) -> Result<()> {
        match (&self.kind, alloc) {
            (_, Allocation::None) => Ok(()),
            (Kind::Caching(core), Allocation::Cached { block }) => {
                let mut core = core.lock();
                let mut fences = Vec::with_capacity(uses.len());
                for s in uses {
                    let event = match core.take_spent_fence() {
                        Some(e) => e,
                        None => self.device.new_sync_event()?,
                    };
                    s.record(&event)?;
                    fences.push(event);
                }
                core.free(block, fences)
            }
            (Kind::Async(a), Allocation::Async { stream, bytes }) => {
                let q = stream.gpu("the async pool")?;
                for u in uses {
                    let event = match a.events.lock().pop() {
                        Some(e) => e,
                        None => self.device.new_sync_event()?,
                    };
                    u.record(&event)?;
                    stream.wait(&event)?;
                    // The wait captured the event's state; it may be recorded again.
                    a.events.lock().push(event);
                }
                a.in_use.fetch_sub(bytes as u64, Ordering::Relaxed);
                // SAFETY: `ptr` came from this pool on `stream`; the buffer that owned it is
                // gone, and work on the other streams it was used on is waited for above.
                unsafe { a.pool.free(ptr, q.stream) }
            }
            _ => Err(Error::InvalidArgument(
                "an allocation returned to a pool of another strategy".into(),
            )),
        }
    }

    /// The pool's counters. For `CudaAsync`, reserved and peak reserved come from the
    /// driver's pool attributes, in-use counts from warpdrive's own, and the free-block
    /// figures are unknown (0).
    pub fn stats(&self) -> Result<PoolStats> {
        let s = self.read_stats()?;
        // Published here (not on every allocation): readers of the stats — the bench, the
        // NVML sampler's callers — keep the gauges current at no cost to allocations.
        metrics::gauge!("warpdrive_pool_in_use_bytes").set(s.in_use as f64);
        metrics::gauge!("warpdrive_pool_reserved_bytes").set(s.reserved as f64);
        metrics::gauge!("warpdrive_pool_peak_in_use_bytes").set(s.peak_in_use as f64);
        Ok(s)
    }

    /// Bytes in use (`stats().in_use`) without the rest: no walk over the free blocks, no
    /// driver call, no gauges. What spans read at every open and close.
    pub fn in_use(&self) -> u64 {
        match &self.kind {
            Kind::Caching(core) => core.lock().in_use(),
            Kind::Async(a) => a.in_use.load(Ordering::Relaxed),
        }
    }

    fn read_stats(&self) -> Result<PoolStats> {
        match &self.kind {
            Kind::Caching(core) => Ok(core.lock().stats()),
            Kind::Async(a) => {
                let u = a.pool.usage()?;
                Ok(PoolStats {
                    in_use: a.in_use.load(Ordering::Relaxed),
                    peak_in_use: a.peak_in_use.load(Ordering::Relaxed),
                    reserved: u.reserved,
                    peak_reserved: u.reserved_high,
                    allocations: a.allocations.load(Ordering::Relaxed),
                    total_free: u.reserved.saturating_sub(u.used),
                    ..PoolStats::default()
                })
            }
        }
    }

    /// Restarts the peak counters from the current values (caching strategy; the async
    /// strategy's peaks are the driver's and are not reset).
    pub fn reset_peaks(&self) {
        match &self.kind {
            Kind::Caching(core) => core.lock().reset_peaks(),
            Kind::Async(a) => a
                .peak_in_use
                .store(a.in_use.load(Ordering::Relaxed), Ordering::Relaxed),
        }
    }

    /// Returns cached free memory to the driver; the bytes released (0 when unknown).
    pub fn trim(&self) -> Result<u64> {
        match &self.kind {
            Kind::Caching(core) => core.lock().trim(),
            // Nothing goes back while a resident kernel runs (see `RawAlloc::synchronize`).
            Kind::Async(_) if self.device.has_resident_kernel() => Ok(0),
            Kind::Async(a) => {
                let before = a.pool.usage()?.reserved;
                self.device.synchronize()?;
                a.pool.trim()?;
                Ok(before.saturating_sub(a.pool.usage()?.reserved))
            }
        }
    }

    /// Puts `stream` in capture mode: until [`GraphMemory::end_capture`], allocations on it
    /// come only from blocks the pool already holds (never the driver; nothing fitting is
    /// an `OutOfMemory` error saying so), and the blocks it takes or frees stay reserved for
    /// the graph while the returned handle lives. Call it before the stream starts
    /// capturing; keep the handle with the graph. The async strategy needs nothing of this
    /// (CUDA records its allocations in the graph) and returns an inert handle.
    pub fn begin_capture(self: &Arc<Self>, stream: &Stream) -> Result<GraphMemory> {
        self.device.same_as(stream.device(), "begin_capture")?;
        let graph = match &self.kind {
            Kind::Caching(core) => core.lock().begin_capture(stream.id())?,
            Kind::Async(_) => 0,
        };
        Ok(GraphMemory {
            pool: self.clone(),
            graph,
        })
    }

    fn end_capture(&self, graph: u64) {
        if let Kind::Caching(core) = &self.kind {
            core.lock().end_capture(graph);
        }
    }

    fn release_graph(&self, graph: u64) {
        if let Kind::Caching(core) = &self.kind {
            core.lock().release_graph(graph);
        }
    }
}

/// The memory a captured graph holds in its pool; released to the pool's cache on drop.
pub struct GraphMemory {
    pool: Arc<DevicePool>,
    graph: u64,
}

impl std::fmt::Debug for GraphMemory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "GraphMemory(#{} in {:?})", self.graph, self.pool)
    }
}

impl GraphMemory {
    /// Leaves capture mode (the graph's blocks stay reserved while `self` lives).
    pub fn end_capture(&self) {
        self.pool.end_capture(self.graph);
    }

    pub fn pool(&self) -> &Arc<DevicePool> {
        &self.pool
    }
}

impl Drop for GraphMemory {
    fn drop(&mut self) {
        self.pool.release_graph(self.graph);
    }
}

/// Hands the cached memory of every default device and pinned pool back to the driver
/// (what [`DevicePool::trim`] and [`PinnedPool::trim`](super::PinnedPool::trim) free);
/// memory in use stays. Returns the bytes released.
pub fn release_cached() -> Result<u64> {
    let mut released = 0u64;
    for device in Device::opened() {
        if let Some(pool) = device.state_if_made::<Arc<DevicePool>>(Slot::DevicePool)? {
            released = released.saturating_add(pool.trim()?);
        }
    }
    Ok(released.saturating_add(super::pinned::trim_default_pools()?))
}

fn release_cached_at_exit() {
    if let Err(e) = release_cached() {
        eprintln!("warpdrive: releasing cached memory at exit: {e}");
    }
}

/// The device's default pool (the caching strategy with the default config), created on
/// first use. Every [`Buffer`](super::Buffer) comes from it unless it was made with
/// [`Buffer::uninit_in`](super::Buffer::uninit_in).
pub fn device_pool(device: &Device) -> Result<&'static Arc<DevicePool>> {
    device.state(Slot::DevicePool, || {
        device.release_at_exit(release_cached_at_exit);
        Ok(Arc::new(DevicePool {
            device: device.clone(),
            kind: Kind::Caching(Mutex::new(Core::new(
                DeviceRaw::new(device),
                PoolConfig::default(),
            ))),
        }))
    })
}

#[cfg(test)]
mod tests {
    use std::ffi::c_void;

    use super::*;
    use crate::kernels::BASIC;
    use crate::memory::{Buffer, PinnedBuf};

    /// A block used on a second stream by a kernel that runs until the host lets it go is
    /// not handed out again until that kernel is done; then it is.
    #[test]
    #[ignore = "needs a CUDA GPU"]
    fn gpu_a_block_used_on_another_stream_waits_for_its_kernel() {
        let dev = Device::cuda(0).expect("a CUDA device");
        let pool = DevicePool::new(&dev, PoolStrategy::default()).unwrap();
        let (s1, s2) = (dev.new_stream().unwrap(), dev.new_stream().unwrap());
        let mut flag = PinnedBuf::<u32>::new(&dev, 1).unwrap();
        flag.wait_slice_mut().unwrap()[0] = 0;
        let status = Buffer::<u32>::from_host(&s2, &[0]).unwrap();
        let n = 1usize << 20;
        let mut a = Buffer::<u32>::uninit_in(&pool, &s1, n).unwrap();
        let a_ptr = a.device_ptr();

        let q = s2.gpu("the test").unwrap();
        let (d, cs2) = (q.gpu, q.stream);
        let f = crate::kernels::function(d, &BASIC, "wait_flag_then_fill").unwrap();
        let (mut fp, mut out, mut value, mut len, mut limit, mut st) = (
            flag.host_ptr(),
            a_ptr,
            0xabcd_u32,
            n as u64,
            20_000_000u64,
            status.device_ptr(),
        );
        let mut params = [
            &mut fp as *mut u64 as *mut c_void,
            &mut out as *mut u64 as *mut c_void,
            &mut value as *mut u32 as *mut c_void,
            &mut len as *mut u64 as *mut c_void,
            &mut limit as *mut u64 as *mut c_void,
            &mut st as *mut u64 as *mut c_void,
        ];
        // SAFETY: wait_flag_then_fill(const u32* flag, u32* out, u32 value, u64 n, u64 limit,
        // u32* status): `flag` is a live pinned word (device-visible under unified
        // addressing), `out` holds n u32s and stays allocated (pending in the pool) until
        // the kernel is done, `status` holds one u32.
        unsafe {
            d.launch(
                cs2,
                &f,
                (1, 1, 1),
                (256, 1, 1),
                0,
                &mut params,
                crate::device::LaunchMode::default(),
            )
        }
        .unwrap();
        a.record_stream(&s2).unwrap();
        drop(a);
        assert_eq!(pool.stats().unwrap().pending, (n * 4) as u64);

        // The kernel is still spinning (the flag is unset): the block must not come back.
        let b = Buffer::<u32>::uninit_in(&pool, &s1, n).unwrap();
        assert_ne!(
            b.device_ptr(),
            a_ptr,
            "handed out while a kernel still uses it"
        );
        assert_eq!(pool.stats().unwrap().pending, (n * 4) as u64);

        flag.wait_slice_mut().unwrap()[0] = 1;
        s2.synchronize().unwrap();
        assert_eq!(status.to_host(&s2).unwrap(), [1], "the kernel saw the flag");
        drop(b);
        let c = Buffer::<u32>::uninit_in(&pool, &s1, n).unwrap();
        assert_eq!(pool.stats().unwrap().pending, 0);
        assert_eq!(c.device_ptr(), a_ptr, "reusable once the kernel is done");
    }
}
