//! Driver-level primitives behind the benchmarks' reference figures: one allocation pair
//! straight from the driver, and cudarc's launch builder and raw `cuLaunchKernel` as a
//! cudarc user gets them. Each is safe (it owns its memory); the timing loops live in the
//! `warpdrive-bench` crate, which has no `unsafe`.

use std::ffi::c_void;
use std::marker::PhantomData;
use std::sync::Arc;

use cudarc::driver::{result, CudaContext, CudaFunction, CudaSlice, CudaStream};

use crate::device::Stream;
use crate::error::{Error, Result};

use super::context::{describe, CudaDevice};
use super::launch::Function;
use super::memory::AsyncMemPool;
use super::stream::GpuStream;

impl CudaDevice {
    /// One `cuMemAlloc` + `cuMemFree` pair of `bytes` (at least 1).
    pub(crate) fn alloc_free_pair(&self, bytes: usize) -> Result<()> {
        drop(DeviceAlloc::new(self, bytes.max(1))?);
        Ok(())
    }

    /// One `cuMemHostAlloc` (flags 0) + `cuMemFreeHost` pair of `bytes` (at least 1). The
    /// free waits for the context first, as it did when this memory also served the copy
    /// ceilings, so the `driver-cuMemHostAlloc` figures stay comparable with earlier runs.
    pub(crate) fn host_alloc_free_pair(&self, bytes: usize) -> Result<()> {
        drop(self.alloc_pinned(bytes)?);
        Ok(())
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
        })
    }
}

impl AsyncMemPool {
    /// One `cuMemAllocFromPoolAsync` + `cuMemFreeAsync` pair of `bytes` (at least 1) on
    /// `stream`, which must be on the pool's device; the memory is never used.
    pub(crate) fn alloc_free_pair(&self, stream: &Stream, bytes: usize) -> Result<()> {
        match stream.queue().map(|q| (q.gpu, q.stream)) {
            Some((d, s)) if *d == self.device => {
                let ptr = self.alloc(s, bytes.max(1))?;
                // SAFETY: `ptr` was just allocated on `s` and is never used.
                unsafe { self.free(ptr, s) }
            }
            _ => Err(Error::DeviceMismatch {
                op: "DriverPool::alloc_free_pair",
                left: stream.device().label(),
                right: format!("cuda:{}", self.device.ordinal()),
            }),
        }
    }
}

/// cudarc's launch builder and raw `cuLaunchKernel`, each launching `basic.cu`'s `fill_u32`
/// on one element (1 block of 32): the references the launch-cost benchmarks compare
/// warpdrive's lean path with.
///
/// The builder launches as a cudarc user gets them: on a context handle of its own with
/// event tracking on (the default), on a stream of its own, with a `CudaSlice` argument, so
/// each launch also waits on and records the slice's events. The raw launches go to the
/// stream given to [`ReferenceLaunches::new`] with no bind and no checks: call
/// [`ReferenceLaunches::bind`] on this thread before them. Not `Send`: a thread's bound
/// context is what the raw launches rely on.
pub struct ReferenceLaunches {
    device: CudaDevice,
    builder_stream: Arc<CudaStream>,
    builder_fn: CudaFunction,
    slice: CudaSlice<u32>,
    stream: GpuStream,
    raw_fn: Function,
    out: DeviceAlloc,
    _not_send: PhantomData<*const ()>,
}

/// The value both references fill their element with, and the element count.
const FILL: (u32, u64) = (7, 1);

fn one_block() -> cudarc::driver::LaunchConfig {
    cudarc::driver::LaunchConfig {
        grid_dim: (1, 1, 1),
        block_dim: (32, 1, 1),
        shared_mem_bytes: 0,
    }
}

impl ReferenceLaunches {
    /// Loads `fill_u32` of `ptx` (`basic.cu` built for the device) on a new cudarc context
    /// handle and stream (the builder's) and on warpdrive's context (the raw launches', which
    /// go to `stream`). CUDA only.
    pub(crate) fn with_ptx(stream: &Stream, ptx: &str) -> Result<ReferenceLaunches> {
        let q = stream.gpu("reference launches")?;
        let (d, s) = (q.gpu, q.stream);
        let ctx = CudaContext::new(d.inner.ordinal).map_err(|e| Error::NoDriver(describe(e)))?;
        let builder_stream = d.check("cuStreamCreate", ctx.new_stream())?;
        let module = d.check(
            "cuModuleLoadData",
            ctx.load_module(cudarc::nvrtc::Ptx::from_src(ptx.to_string())),
        )?;
        let builder_fn = d.check("cuModuleGetFunction", module.load_function("fill_u32"))?;
        let slice = d.check("cuMemAllocAsync", builder_stream.alloc_zeros::<u32>(1))?;
        let raw_fn = d.function("reference-launches", "fill_u32", || d.load_module(ptx))?;
        let out = DeviceAlloc::new(d, 4)?;
        Ok(ReferenceLaunches {
            device: d.clone(),
            builder_stream,
            builder_fn,
            slice,
            stream: s.clone(),
            raw_fn,
            out,
            _not_send: PhantomData,
        })
    }

    /// One launch through cudarc's builder on its own stream.
    pub fn builder_launch(&mut self) -> Result<()> {
        use cudarc::driver::PushKernelArg;
        let (value, n) = FILL;
        let mut b = self.builder_stream.launch_builder(&self.builder_fn);
        b.arg(&mut self.slice).arg(&value).arg(&n);
        // SAFETY: fill_u32(u32* out, u32 value, u64 n): `slice` holds one u32.
        let r = unsafe { b.launch(one_block()) };
        self.device.check("cuLaunchKernel (builder)", r.map(drop))
    }

    /// Waits for the builder's stream.
    pub fn builder_synchronize(&self) -> Result<()> {
        self.device
            .check("cuStreamSynchronize", self.builder_stream.synchronize())
    }

    /// Binds warpdrive's context to this thread, once before the raw launches.
    pub fn bind(&self) -> Result<()> {
        self.device.bind()
    }

    /// One raw `cuLaunchKernel` on warpdrive's stream: no bind, no checks.
    pub fn raw_launch(&mut self) -> Result<()> {
        let (mut p_out, (mut p_value, mut p_n)) = (self.out.ptr, FILL);
        let mut params = [
            &mut p_out as *mut u64 as *mut c_void,
            &mut p_value as *mut u32 as *mut c_void,
            &mut p_n as *mut u64 as *mut c_void,
        ];
        let config = one_block();
        // SAFETY: fill_u32(u32* out, u32 value, u64 n): `out` holds one u32 and outlives
        // the launches (the stream is synchronised before it is freed, in `drop`).
        let r = unsafe {
            result::launch_kernel(
                self.raw_fn.cu_function(),
                config.grid_dim,
                config.block_dim,
                0,
                self.stream.cu_stream(),
                &mut params,
            )
        };
        self.device.check("cuLaunchKernel", r)
    }
}

impl Drop for ReferenceLaunches {
    fn drop(&mut self) {
        // Raw launches may still write `out`: wait for them before it is freed.
        if let Err(e) = self.device.synchronize_stream(&self.stream) {
            tracing::warn!("synchronise before freeing the reference launches failed: {e}");
        }
    }
}

/// A device allocation owned by a probe, freed on drop.
struct DeviceAlloc {
    device: CudaDevice,
    ptr: u64,
}

impl DeviceAlloc {
    fn new(device: &CudaDevice, bytes: usize) -> Result<Self> {
        Ok(DeviceAlloc {
            device: device.clone(),
            ptr: device.alloc(bytes)?,
        })
    }
}

impl Drop for DeviceAlloc {
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
}

impl Drop for PinnedHost {
    fn drop(&mut self) {
        if self.device.bind().is_err() {
            return;
        }
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
