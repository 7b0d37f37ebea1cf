//! Measurements for the doctor's ceilings (used by `bench/`).

use std::ffi::c_void;
use std::sync::Arc;

use cudarc::driver::{result, CudaContext, CudaStream};

use crate::error::{Error, Result};
use crate::kernels;

use super::context::{describe, CudaDevice};
use super::launch::LaunchMode;
use super::memory::AsyncMemPool;

impl CudaDevice {
    // ---- measurements for the doctor's ceilings (they own their memory, so they are safe) ----

    /// Seconds per copy of `bytes` between host and device, `reps` times, after one warm-up.
    /// Pinned host memory is timed with events on `stream`; pageable memory (an ordinary,
    /// pre-touched `Vec`) with the host clock around each synchronous copy.
    pub(crate) fn time_host_copies(
        &self,
        stream: &CudaStream,
        to_device: bool,
        pinned: bool,
        bytes: usize,
        reps: usize,
    ) -> Result<Vec<f64>> {
        let bytes = bytes.max(1);
        let dev = DeviceAlloc::new(self, bytes)?;
        let mut times = Vec::with_capacity(reps);
        if pinned {
            let mut host = self.alloc_pinned(bytes)?;
            fill_pattern(host.as_mut_slice());
            let (start, end) = (self.new_timing_event()?, self.new_timing_event()?);
            for rep in 0..=reps {
                self.record_event(&start, stream)?;
                // SAFETY: `host` and `dev` both hold `bytes` and outlive the copy: the stream
                // is synchronised (through `end`) before either is dropped or reused.
                unsafe { self.copy_raw_async(stream, to_device, host.ptr, dev.ptr, bytes)? };
                self.record_event(&end, stream)?;
                let ms = self.event_elapsed_ms(&start, &end).inspect_err(|_| {
                    let _ = self.synchronize_stream(stream);
                })?;
                if rep > 0 {
                    times.push(ms as f64 / 1e3);
                }
            }
        } else {
            let mut host = vec![0u8; bytes];
            fill_pattern(&mut host);
            for rep in 0..=reps {
                let t = std::time::Instant::now();
                if to_device {
                    self.copy_h2d(stream, dev.ptr, &host)?;
                } else {
                    self.copy_d2h(stream, &mut host, dev.ptr)?;
                }
                if rep > 0 {
                    times.push(t.elapsed().as_secs_f64());
                }
            }
        }
        Ok(times)
    }

    /// Launch cost of an empty kernel: (µs per launch when `count` are enqueued back to back
    /// with one synchronise at the end, µs for one launch + synchronise round trip).
    pub(crate) fn time_empty_launches(
        &self,
        stream: &CudaStream,
        count: usize,
    ) -> Result<(f64, f64)> {
        let f = self.function(&kernels::BASIC, "empty_kernel")?;
        let launch = || {
            // SAFETY: `empty_kernel` takes no parameters.
            unsafe {
                self.launch(
                    stream,
                    &f,
                    (1, 1, 1),
                    (32, 1, 1),
                    0,
                    &mut [],
                    LaunchMode::default(),
                )
            }
        };
        launch()?;
        self.synchronize_stream(stream)?;
        let count = count.max(1);
        let t = std::time::Instant::now();
        for _ in 0..count {
            launch()?;
        }
        self.synchronize_stream(stream)?;
        let enqueued = t.elapsed().as_secs_f64() * 1e6 / count as f64;
        let round_trips = (count / 10).max(1);
        let t = std::time::Instant::now();
        for _ in 0..round_trips {
            launch()?;
            self.synchronize_stream(stream)?;
        }
        let round_trip = t.elapsed().as_secs_f64() * 1e6 / round_trips as f64;
        Ok((enqueued, round_trip))
    }

    /// Reference launch costs of `basic.cu`'s `fill_u32` on one element (1 block of 32):
    /// cudarc's launch builder as a cudarc user gets it (a context handle with event tracking
    /// on, the default, and a `CudaSlice` argument, so each launch also waits on and records
    /// the slice's events), and raw `cuLaunchKernel` calls with no bind and no checks. Each
    /// figure is host-clock µs: per launch over `count` launches enqueued back to back with
    /// one synchronise at the end, or per launch + synchronise over `round_trips`.
    pub(crate) fn time_reference_launches(
        &self,
        stream: &CudaStream,
        count: usize,
        round_trips: usize,
    ) -> Result<ReferenceLaunches> {
        let (count, round_trips) = (count.max(1), round_trips.max(1));
        let per = |t: std::time::Instant, n: usize| t.elapsed().as_secs_f64() * 1e6 / n as f64;
        let config = cudarc::driver::LaunchConfig {
            grid_dim: (1, 1, 1),
            block_dim: (32, 1, 1),
            shared_mem_bytes: 0,
        };
        let (value, n) = (7u32, 1u64);

        // cudarc's builder on its own context handle (tracking on) and stream.
        let ctx = CudaContext::new(self.inner.ordinal).map_err(|e| Error::NoDriver(describe(e)))?;
        let builder_stream = self.check("cuStreamCreate", ctx.new_stream())?;
        let arch = kernels::BASIC.arch_for(self.arch())?;
        let module = kernels::PtxCache::global().load(&kernels::BASIC, arch, |ptx| {
            self.check(
                "cuModuleLoadData",
                ctx.load_module(cudarc::nvrtc::Ptx::from_src(ptx.to_string())),
            )
        })?;
        let f = self.check("cuModuleGetFunction", module.load_function("fill_u32"))?;
        let mut slice = self.check("cuMemAllocAsync", builder_stream.alloc_zeros::<u32>(1))?;
        let mut builder_launch = || {
            use cudarc::driver::PushKernelArg;
            let mut b = builder_stream.launch_builder(&f);
            b.arg(&mut slice).arg(&value).arg(&n);
            // SAFETY: fill_u32(u32* out, u32 value, u64 n): `slice` holds one u32.
            let r = unsafe { b.launch(config) };
            self.check("cuLaunchKernel (builder)", r.map(drop))
        };
        let builder_sync = |s: &Arc<CudaStream>| self.check("cuStreamSynchronize", s.synchronize());
        builder_launch()?;
        builder_sync(&builder_stream)?;
        let t = std::time::Instant::now();
        for _ in 0..count {
            builder_launch()?;
        }
        let builder_enqueue = per(t, count);
        builder_sync(&builder_stream)?;
        let builder = per(t, count);
        let t = std::time::Instant::now();
        for _ in 0..round_trips {
            builder_launch()?;
            builder_sync(&builder_stream)?;
        }
        let builder_round_trip = per(t, round_trips);

        // Raw cuLaunchKernel on warpdrive's context and `stream`.
        let raw_f = self.function(&kernels::BASIC, "fill_u32")?;
        let out = DeviceAlloc::new(self, 4)?;
        self.bind()?;
        let (mut p_out, mut p_value, mut p_n) = (out.ptr, value, n);
        let mut params = [
            &mut p_out as *mut u64 as *mut c_void,
            &mut p_value as *mut u32 as *mut c_void,
            &mut p_n as *mut u64 as *mut c_void,
        ];
        let mut raw_launch = || {
            // SAFETY: fill_u32(u32* out, u32 value, u64 n): `out` holds one u32 and outlives
            // the launches (the stream is synchronised before it is freed).
            let r = unsafe {
                result::launch_kernel(
                    raw_f.cu_function(),
                    config.grid_dim,
                    config.block_dim,
                    0,
                    stream.cu_stream(),
                    &mut params,
                )
            };
            self.check("cuLaunchKernel", r)
        };
        raw_launch()?;
        self.synchronize_stream(stream)?;
        let t = std::time::Instant::now();
        for _ in 0..count {
            raw_launch()?;
        }
        let raw_enqueue = per(t, count);
        self.synchronize_stream(stream)?;
        let raw = per(t, count);
        Ok(ReferenceLaunches {
            builder,
            builder_enqueue,
            builder_round_trip,
            raw,
            raw_enqueue,
        })
    }

    /// µs per `cuMemAlloc` + `cuMemFree` pair of `bytes`, host clock over `pairs` pairs.
    pub(crate) fn time_alloc_free(&self, bytes: usize, pairs: usize) -> Result<f64> {
        let pairs = pairs.max(1);
        let t = std::time::Instant::now();
        for _ in 0..pairs {
            drop(DeviceAlloc::new(self, bytes.max(1))?);
        }
        Ok(t.elapsed().as_secs_f64() * 1e6 / pairs as f64)
    }

    /// µs per `cuMemAllocFromPoolAsync` + `cuMemFreeAsync` pair of `bytes` on `stream`, host
    /// clock over `pairs` pairs and one stream synchronise at the end.
    pub(crate) fn time_async_alloc_free(
        &self,
        pool: &AsyncMemPool,
        stream: &CudaStream,
        bytes: usize,
        pairs: usize,
    ) -> Result<f64> {
        let pairs = pairs.max(1);
        let t = std::time::Instant::now();
        for _ in 0..pairs {
            let ptr = pool.alloc(stream, bytes.max(1))?;
            // SAFETY: `ptr` was just allocated on `stream` and is never used.
            unsafe { pool.free(ptr, stream)? };
        }
        self.synchronize_stream(stream)?;
        Ok(t.elapsed().as_secs_f64() * 1e6 / pairs as f64)
    }

    /// µs per `cuMemHostAlloc` (flags 0) + `cuMemFreeHost` pair of `bytes`, host clock over
    /// `pairs` pairs.
    pub(crate) fn time_host_alloc_free(&self, bytes: usize, pairs: usize) -> Result<f64> {
        let pairs = pairs.max(1);
        let t = std::time::Instant::now();
        for _ in 0..pairs {
            drop(self.alloc_pinned(bytes)?);
        }
        Ok(t.elapsed().as_secs_f64() * 1e6 / pairs as f64)
    }

    /// Page-locked host memory of `bytes` (flags 0: cached, fast for the CPU to read too).
    fn alloc_pinned(&self, bytes: usize) -> Result<PinnedHost> {
        self.bind()?;
        // SAFETY: the context is bound; the pointer is owned by the returned value.
        let r = unsafe { result::malloc_host(bytes.max(1), 0) };
        let ptr = self.check("cuMemHostAlloc", r)?;
        Ok(PinnedHost {
            device: self.clone(),
            ptr: ptr as *mut u8,
            bytes: bytes.max(1),
        })
    }
}

/// What [`CudaDevice::time_reference_launches`] measured (host-clock µs).
#[derive(Debug, Clone, Copy)]
pub(crate) struct ReferenceLaunches {
    /// Per launch through cudarc's builder, enqueued back to back (the final synchronise
    /// included).
    pub builder: f64,
    /// The same, up to the last launch's return (no synchronise).
    pub builder_enqueue: f64,
    /// Per builder launch + stream synchronise.
    pub builder_round_trip: f64,
    /// Per raw `cuLaunchKernel`, enqueued back to back (the final synchronise included).
    pub raw: f64,
    /// The same, up to the last launch's return.
    pub raw_enqueue: f64,
}

/// Bytes that are not all zero (copies are never timed on zeros).
fn fill_pattern(bytes: &mut [u8]) {
    let mut x: u32 = 0x9e37_79b9;
    for b in bytes.iter_mut() {
        x ^= x << 13;
        x ^= x >> 17;
        x ^= x << 5;
        *b = x as u8;
    }
}

/// A device allocation owned by a probe, freed on drop.
struct DeviceAlloc<'a> {
    device: &'a CudaDevice,
    ptr: u64,
}

impl<'a> DeviceAlloc<'a> {
    fn new(device: &'a CudaDevice, bytes: usize) -> Result<Self> {
        Ok(DeviceAlloc {
            device,
            ptr: device.alloc(bytes)?,
        })
    }
}

impl Drop for DeviceAlloc<'_> {
    fn drop(&mut self) {
        if let Err(e) = self.device.free(self.ptr) {
            tracing::warn!("freeing a probe allocation failed: {e}");
        }
    }
}

/// Page-locked host memory, freed on drop.
struct PinnedHost {
    device: CudaDevice,
    ptr: *mut u8,
    bytes: usize,
}

impl PinnedHost {
    fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: `ptr` is a live allocation of `bytes` (at least 1) owned by `self`, and the
        // `&mut self` borrow makes this the only access.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.bytes) }
    }
}

impl Drop for PinnedHost {
    fn drop(&mut self) {
        if self.device.bind().is_err() {
            return;
        }
        // Copies from this memory may still be queued: wait for the device before freeing.
        if let Err(e) = self
            .device
            .check("cuCtxSynchronize", result::ctx::synchronize())
        {
            tracing::warn!("synchronise before freeing pinned memory failed: {e}");
        }
        // SAFETY: `ptr` came from cuMemHostAlloc and is freed exactly once, here.
        if let Err(e) = unsafe { result::free_host(self.ptr as *mut c_void) } {
            tracing::warn!("cuMemFreeHost failed: {}", describe(e));
        }
    }
}
