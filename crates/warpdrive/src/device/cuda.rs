//! The CUDA backend: every call into the driver, NVRTC, cuBLAS, NCCL and cuFile goes through
//! this file, so this is where warpdrive's `unsafe` lives (besides kernel launch sites).
//!
//! Libraries are loaded at run time (cudarc's `dynamic-loading`); cudarc panics when a call
//! reaches a library that is absent, so each library's presence is checked once, before its
//! first call, and reported as an [`Error`] instead.

use std::cell::Cell;
use std::collections::HashMap;
use std::ffi::{c_int, c_void};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};

use cudarc::driver::result::DriverError;
use cudarc::driver::sys::{self, CUdevice_attribute as Attr, CUresult};
use cudarc::driver::{
    result, CudaContext, CudaEvent, CudaFunction, CudaGraph, CudaModule, CudaStream,
};
use parking_lot::Mutex;

use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::kernels::{self, KernelSource};

use super::activity::{self, ActivityKind};
use super::{DeviceInfo, LibraryStatus};

/// Dynamic shared memory a launch may ask for without opting its function in (48 KiB).
const DEFAULT_DYNAMIC_SHARED: u32 = 48 * 1024;

/// Which dynamically loaded CUDA libraries can be opened on this machine. Checked once.
pub(crate) struct Libraries {
    pub driver: bool,
    pub nvrtc: bool,
    pub cublas: bool,
    pub cublaslt: bool,
    pub nccl: bool,
    pub cufile: bool,
}

pub(crate) fn libraries() -> &'static Libraries {
    static LIBS: OnceLock<Libraries> = OnceLock::new();
    // SAFETY: `is_culib_present` only tries to dlopen each candidate name and drops the handle.
    LIBS.get_or_init(|| unsafe {
        Libraries {
            driver: cudarc::driver::sys::is_culib_present(),
            nvrtc: cudarc::nvrtc::sys::is_culib_present(),
            cublas: cudarc::cublas::sys::is_culib_present(),
            cublaslt: cudarc::cublaslt::sys::is_culib_present(),
            nccl: cudarc::nccl::sys::is_culib_present(),
            cufile: cudarc::cufile::sys::is_culib_present(),
        }
    })
}

/// NVRTC's version, or `None` when libnvrtc cannot be loaded.
pub(crate) fn nvrtc_version() -> Option<(i32, i32)> {
    if !libraries().nvrtc {
        return None;
    }
    let (mut major, mut minor) = (0, 0);
    // SAFETY: libnvrtc is loaded (checked above); both out-pointers are valid locals.
    let status = unsafe { cudarc::nvrtc::sys::nvrtcVersion(&mut major, &mut minor) };
    (status == cudarc::nvrtc::sys::nvrtcResult::NVRTC_SUCCESS).then_some((major, minor))
}

/// Initialises the driver and returns the number of CUDA devices.
pub(crate) fn device_count() -> Result<usize> {
    if !libraries().driver {
        return Err(Error::NoDriver(
            "libcuda.so could not be loaded (is the NVIDIA driver installed?)".into(),
        ));
    }
    result::init().map_err(|e| Error::NoDriver(describe(e)))?;
    let n = result::device::get_count().map_err(|e| Error::NoDriver(describe(e)))?;
    Ok(n.max(0) as usize)
}

/// "CUDA_ERROR_NAME: description" for a driver error.
fn describe(e: DriverError) -> String {
    let name = e
        .error_name()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_else(|_| format!("{:?}", e.0));
    let text = e
        .error_string()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_default();
    format!("{name}: {text}")
}

/// Errors after which the context is unusable: every later call fails the same way.
fn is_sticky(code: CUresult) -> bool {
    matches!(
        code,
        CUresult::CUDA_ERROR_ILLEGAL_ADDRESS
            | CUresult::CUDA_ERROR_LAUNCH_FAILED
            | CUresult::CUDA_ERROR_ILLEGAL_INSTRUCTION
            | CUresult::CUDA_ERROR_MISALIGNED_ADDRESS
            | CUresult::CUDA_ERROR_INVALID_ADDRESS_SPACE
            | CUresult::CUDA_ERROR_INVALID_PC
            | CUresult::CUDA_ERROR_HARDWARE_STACK_ERROR
            | CUresult::CUDA_ERROR_ASSERT
            | CUresult::CUDA_ERROR_LAUNCH_TIMEOUT
            | CUresult::CUDA_ERROR_CONTEXT_IS_DESTROYED
    )
}

/// (source, kernel, block size, dynamic shared bytes) of a cached resident-blocks figure.
type OccupancyKey = (&'static str, &'static str, u32, u32);

thread_local! {
    /// The context warpdrive last made current on this thread, so kernel launches can skip
    /// `cuCtxGetCurrent` (a launch that finds another context current fails and is retried
    /// after a full bind).
    static BOUND: Cell<usize> = const { Cell::new(0) };
    /// Graph captures this thread has begun and not yet ended. Captures run in
    /// `THREAD_LOCAL` mode: the driver forbids this thread (only) allocations, event queries
    /// and synchronisation meanwhile, so warpdrive refuses those calls first, with an error,
    /// instead of letting them invalidate the capture.
    static CAPTURING: Cell<u32> = const { Cell::new(0) };
}

/// The "lost" flag of device `ordinal`, shared by every `CudaDevice` on it: a sticky fault
/// breaks the primary context for the whole process.
fn lost_flag(ordinal: usize) -> Arc<AtomicBool> {
    static FLAGS: OnceLock<Mutex<HashMap<usize, Arc<AtomicBool>>>> = OnceLock::new();
    FLAGS
        .get_or_init(|| Mutex::new(HashMap::new()))
        .lock()
        .entry(ordinal)
        .or_default()
        .clone()
}

fn lost_error() -> Error {
    Error::DeviceLost {
        call: "(earlier fault)",
        message: "the context had a sticky fault; the process must restart to use the device"
            .into(),
    }
}

/// True while this thread is capturing a graph (warpdrive's own capture tracking).
pub(crate) fn thread_is_capturing() -> bool {
    CAPTURING.with(Cell::get) > 0
}

/// Refuses `call` while this thread is capturing a graph.
fn refuse_in_capture(call: &'static str, hint: &str) -> Result<()> {
    if CAPTURING.with(Cell::get) > 0 {
        return Err(Error::Capture {
            call,
            hint: hint.into(),
        });
    }
    Ok(())
}

/// Refuses event queries and synchronisation during a capture.
fn no_sync_in_capture(call: &'static str) -> Result<()> {
    refuse_in_capture(
        call,
        "a captured stream cannot be waited on or queried; wait after the capture ends",
    )
}

/// Refuses driver allocations and frees during a capture.
fn no_alloc_in_capture(call: &'static str) -> Result<()> {
    refuse_in_capture(
        call,
        "allocate before capturing (the pool serves a capture from blocks it already holds)",
    )
}

/// One row-major GEMM (or a strided batch of them) for [`CudaDevice::gemm`]:
/// `c = op(a) · op(b)` with `op(a)` m×k, `op(b)` k×n, `c` m×n; `trans_a` means `a` is stored
/// k×m (and `trans_b` that `b` is stored n×k). Strides are in elements, between batch items.
#[derive(Debug, Clone, Copy)]
pub(crate) struct GemmCall {
    pub dtype: crate::dtype::DTypeKind,
    pub m: usize,
    pub n: usize,
    pub k: usize,
    pub trans_a: bool,
    pub trans_b: bool,
    /// f32 only: let cuBLAS round inputs to TF32 on the tensor cores.
    pub tf32: bool,
    pub batch: usize,
    pub a: u64,
    pub b: u64,
    pub c: u64,
    pub stride_a: usize,
    pub stride_b: usize,
    pub stride_c: usize,
}

/// One CUDA device: its primary context, loaded modules and cuBLAS handle. Cheap to clone.
#[derive(Clone)]
pub struct CudaDevice {
    inner: Arc<Inner>,
}

struct Inner {
    ctx: Arc<CudaContext>,
    ordinal: usize,
    compute_capability: (i32, i32),
    sm_count: u32,
    lost: Arc<AtomicBool>,
    functions: Mutex<HashMap<(&'static str, &'static str), CudaFunction>>,
    occupancy: Mutex<HashMap<OccupancyKey, u32>>,
    modules: Mutex<HashMap<&'static str, Arc<CudaModule>>>,
    blas: Mutex<Option<BlasHandle>>,
}

struct BlasHandle(cudarc::cublas::sys::cublasHandle_t);

// SAFETY: a cuBLAS handle may be used from any thread as long as calls are not concurrent;
// it lives behind the device's mutex, which serialises every use.
unsafe impl Send for BlasHandle {}

impl Drop for BlasHandle {
    fn drop(&mut self) {
        // SAFETY: the handle came from `create_handle` and is destroyed exactly once, here.
        if let Err(e) = unsafe { cudarc::cublas::result::destroy_handle(self.0) } {
            tracing::warn!("cublasDestroy failed: {e:?}");
        }
    }
}

impl std::fmt::Debug for CudaDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "cuda:{}", self.inner.ordinal)
    }
}

impl PartialEq for CudaDevice {
    fn eq(&self, other: &Self) -> bool {
        self.inner.ordinal == other.inner.ordinal
    }
}

impl CudaDevice {
    /// Opens device `ordinal` (its primary context).
    pub(crate) fn new(ordinal: usize) -> Result<Self> {
        let count = device_count()?;
        if ordinal >= count {
            return Err(Error::BadOrdinal { ordinal, count });
        }
        let lost = lost_flag(ordinal);
        if lost.load(Ordering::Acquire) {
            return Err(lost_error());
        }
        let ctx = CudaContext::new(ordinal).map_err(|e| Error::NoDriver(describe(e)))?;
        // warpdrive never hands out `CudaSlice`s, so cudarc's per-slice event tracking is pure
        // overhead; ordering across streams is recorded explicitly where it is needed.
        // SAFETY: no `CudaSlice` exists yet on this context.
        unsafe { ctx.disable_event_tracking() };
        let compute_capability = ctx
            .compute_capability()
            .map_err(|e| Error::NoDriver(describe(e)))?;
        let sm_count = ctx
            .attribute(Attr::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .map_err(|e| Error::NoDriver(describe(e)))?
            .max(1) as u32;
        Ok(CudaDevice {
            inner: Arc::new(Inner {
                ctx,
                ordinal,
                compute_capability,
                sm_count,
                lost,
                functions: Mutex::new(HashMap::new()),
                occupancy: Mutex::new(HashMap::new()),
                modules: Mutex::new(HashMap::new()),
                blas: Mutex::new(None),
            }),
        })
    }

    pub fn ordinal(&self) -> usize {
        self.inner.ordinal
    }

    pub fn compute_capability(&self) -> (i32, i32) {
        self.inner.compute_capability
    }

    /// Streaming multiprocessors.
    pub fn sm_count(&self) -> u32 {
        self.inner.sm_count
    }

    /// Bytes of L2 cache.
    pub fn l2_cache_bytes(&self) -> Result<usize> {
        Ok(self
            .attribute(Attr::CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE)?
            .max(0) as usize)
    }

    /// The most shared memory one block may use once its function opts in (bytes).
    pub fn shared_per_block_optin(&self) -> Result<usize> {
        Ok(self
            .attribute(Attr::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)?
            .max(0) as usize)
    }

    /// Turns a driver result into warpdrive's, marking the device lost on a sticky fault.
    pub(crate) fn check<T>(
        &self,
        call: &'static str,
        r: std::result::Result<T, DriverError>,
    ) -> Result<T> {
        r.map_err(|e| {
            if is_sticky(e.0) {
                self.inner.lost.store(true, Ordering::Release);
                Error::DeviceLost {
                    call,
                    message: describe(e),
                }
            } else {
                Error::Driver {
                    call,
                    message: describe(e),
                }
            }
        })
    }

    /// True once a sticky fault was seen on this device (in this process).
    pub fn is_lost(&self) -> bool {
        self.inner.lost.load(Ordering::Acquire)
    }

    /// `DeviceLost` once a sticky fault was seen, without calling the driver.
    pub(crate) fn check_usable(&self) -> Result<()> {
        if self.is_lost() {
            return Err(lost_error());
        }
        Ok(())
    }

    /// Binds the context to this thread; fails with `DeviceLost` after a sticky fault.
    pub(crate) fn bind(&self) -> Result<()> {
        if self.is_lost() {
            return Err(lost_error());
        }
        let r = self.inner.ctx.bind_to_thread();
        self.check("cuCtxSetCurrent", r)?;
        BOUND.with(|b| b.set(self.ctx_key()));
        Ok(())
    }

    fn ctx_key(&self) -> usize {
        self.inner.ctx.cu_ctx() as usize
    }

    /// [`bind`](Self::bind) unless this thread's last bind was to this context: the lean
    /// path of kernel and graph launches (callers retry with a full bind when the launch
    /// fails, in case something outside warpdrive changed the current context).
    fn bind_cached(&self) -> Result<bool> {
        if self.is_lost() {
            return Err(lost_error());
        }
        if BOUND.with(Cell::get) == self.ctx_key() {
            return Ok(true);
        }
        self.bind()?;
        Ok(false)
    }

    /// Above the default limit a function must opt in to its dynamic shared memory (a
    /// host-side attribute; cheap, and allowed while a stream is captured).
    fn opt_in_dynamic_shared(&self, f: &CudaFunction, bytes: u32) -> Result<()> {
        if bytes <= DEFAULT_DYNAMIC_SHARED {
            return Ok(());
        }
        self.lean("cuFuncSetAttribute", || {
            f.set_attribute(
                sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                bytes as i32,
            )
        })
    }

    /// Runs a launch-like driver call on the lean path: cached bind, then on failure (other
    /// than a sticky fault) one full bind and a retry.
    fn lean<T>(
        &self,
        call: &'static str,
        mut f: impl FnMut() -> std::result::Result<T, DriverError>,
    ) -> Result<T> {
        let cached = self.bind_cached()?;
        match f() {
            Ok(v) => Ok(v),
            // What a launch reports when another context is current.
            Err(e)
                if cached
                    && matches!(
                        e.0,
                        CUresult::CUDA_ERROR_INVALID_CONTEXT | CUresult::CUDA_ERROR_INVALID_HANDLE
                    ) =>
            {
                self.bind()?;
                self.check(call, f())
            }
            Err(e) => self.check(call, Err(e)),
        }
    }

    /// The device's name ("NVIDIA H200").
    pub fn name(&self) -> Result<String> {
        let r = self.inner.ctx.name();
        self.check("cuDeviceGetName", r)
    }

    pub(crate) fn attribute(&self, attr: Attr) -> Result<i32> {
        let r = self.inner.ctx.attribute(attr);
        self.check("cuDeviceGetAttribute", r)
    }

    /// (free, total) device memory in bytes.
    pub(crate) fn mem_info(&self) -> Result<(usize, usize)> {
        self.bind()?;
        self.check("cuMemGetInfo", result::mem_get_info())
    }

    // ---- streams and events ----

    pub(crate) fn new_stream(&self) -> Result<Arc<CudaStream>> {
        self.bind()?;
        let r = self.inner.ctx.new_stream();
        self.check("cuStreamCreate", r)
    }

    pub(crate) fn synchronize_stream(&self, stream: &CudaStream) -> Result<()> {
        // This thread's captures are refused here; a capture begun on another thread makes
        // the driver return an error (not worth a cuStreamIsCapturing on every sync).
        no_sync_in_capture("cuStreamSynchronize")?;
        self.bind()?;
        self.check("cuStreamSynchronize", stream.synchronize())
    }

    /// True while `stream` is capturing a graph (begun on any thread).
    pub(crate) fn is_capturing(&self, stream: &CudaStream) -> Result<bool> {
        self.bind()?;
        // SAFETY: the stream is alive (borrowed) and its context is bound.
        let r = unsafe { result::stream::is_capturing(stream.cu_stream()) };
        let status = self.check("cuStreamIsCapturing", r)?;
        Ok(status != sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE)
    }

    /// Binds, then refuses `call` (a synchronising one) when this thread or `stream` is
    /// capturing a graph.
    pub(crate) fn refuse_if_capturing(
        &self,
        stream: &CudaStream,
        call: &'static str,
    ) -> Result<()> {
        no_sync_in_capture(call)?;
        if self.is_capturing(stream)? {
            return Err(Error::Capture {
                call,
                hint: "the stream is capturing a graph (begun on another thread)".into(),
            });
        }
        Ok(())
    }

    /// A timing-enabled event (`CU_EVENT_DEFAULT`).
    pub(crate) fn new_timing_event(&self) -> Result<CudaEvent> {
        self.bind()?;
        let r = self
            .inner
            .ctx
            .new_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT));
        self.check("cuEventCreate", r)
    }

    /// An event for ordering only (timing disabled).
    pub(crate) fn new_sync_event(&self) -> Result<CudaEvent> {
        self.bind()?;
        let r = self.inner.ctx.new_event(None);
        self.check("cuEventCreate", r)
    }

    /// True when the work before `event` has finished; never waits.
    pub(crate) fn event_query(&self, event: &CudaEvent) -> Result<bool> {
        no_sync_in_capture("cuEventQuery")?;
        self.bind()?;
        self.check("cuEventQuery", event.try_is_complete())
    }

    /// Waits for all work on this device.
    pub(crate) fn synchronize(&self) -> Result<()> {
        no_sync_in_capture("cuCtxSynchronize")?;
        self.bind()?;
        self.check("cuCtxSynchronize", result::ctx::synchronize())
    }

    /// Records `event` on `stream` (both of this device) on the lean path: spans record one
    /// per boundary, where two context reads per call would show.
    pub(crate) fn record_event(&self, event: &CudaEvent, stream: &CudaStream) -> Result<()> {
        self.lean("cuEventRecord", || {
            // SAFETY: the event and the stream are alive (borrowed) and belong to this
            // device's context (the caller checked the device), which `lean` bound.
            unsafe { result::event::record(event.cu_event(), stream.cu_stream()) }
        })
    }

    pub(crate) fn event_synchronize(&self, event: &CudaEvent) -> Result<()> {
        no_sync_in_capture("cuEventSynchronize")?;
        self.bind()?;
        self.check("cuEventSynchronize", event.synchronize())
    }

    pub(crate) fn event_elapsed_ms(&self, start: &CudaEvent, end: &CudaEvent) -> Result<f32> {
        self.bind()?;
        self.check("cuEventElapsedTime", start.elapsed_ms(end))
    }

    pub(crate) fn stream_wait_event(&self, stream: &CudaStream, event: &CudaEvent) -> Result<()> {
        self.bind()?;
        self.check("cuStreamWaitEvent", stream.wait(event))
    }

    // ---- raw memory ----

    /// Allocates `bytes` of device memory (`bytes > 0`).
    pub(crate) fn alloc(&self, bytes: usize) -> Result<u64> {
        no_alloc_in_capture("cuMemAlloc")?;
        self.bind()?;
        // SAFETY: the context is bound; the returned pointer is owned by the caller, which
        // frees it with `free`.
        match unsafe { result::malloc_sync(bytes) } {
            Ok(ptr) => Ok(ptr),
            Err(e) if e.0 == CUresult::CUDA_ERROR_OUT_OF_MEMORY => {
                Err(self.oom(bytes, "cuMemAlloc refused"))
            }
            Err(e) => self.check("cuMemAlloc", Err(e)),
        }
    }

    /// `OutOfMemory` for a refused request of `bytes`, naming the device's free memory.
    fn oom(&self, bytes: usize, what: &str) -> Error {
        let detail = match result::mem_get_info() {
            Ok((free, total)) => format!("{what}; device free {free} of {total} bytes"),
            Err(_) => format!("{what}; device free memory unknown"),
        };
        Error::OutOfMemory {
            requested: bytes,
            detail,
        }
    }

    /// Page-locked host memory of `bytes > 0`, flags 0: cached, so the CPU reads it fast
    /// (not write-combined). Free with `free_host`.
    pub(crate) fn alloc_host(&self, bytes: usize) -> Result<u64> {
        no_alloc_in_capture("cuMemHostAlloc")?;
        self.bind()?;
        // SAFETY: the context is bound; the pointer is owned by the caller, which frees it
        // with `free_host`.
        match unsafe { result::malloc_host(bytes, 0) } {
            Ok(ptr) => Ok(ptr as u64),
            Err(e) if e.0 == CUresult::CUDA_ERROR_OUT_OF_MEMORY => {
                Err(self.oom(bytes, "cuMemHostAlloc refused"))
            }
            Err(e) => self.check("cuMemHostAlloc", Err(e)),
        }
    }

    /// Frees memory from `alloc_host`; the caller has made sure no copy still uses it.
    pub(crate) fn free_host(&self, ptr: u64) -> Result<()> {
        no_alloc_in_capture("cuMemFreeHost")?;
        self.bind()?;
        // SAFETY: `ptr` came from cuMemHostAlloc and its owner gives it up here.
        let r = unsafe { result::free_host(ptr as *mut c_void) };
        self.check("cuMemFreeHost", r)
    }

    /// A stream-ordered memory pool of CUDA's own (`cuMemPoolCreate`) on this device, its
    /// release threshold at the maximum so freed memory stays cached.
    pub(crate) fn new_async_pool(&self) -> Result<AsyncMemPool> {
        self.bind()?;
        // SAFETY: all-zero is a valid `CUmemPoolProps` (plain integers, enums whose 0 is
        // valid or overwritten below, a null pointer and reserved bytes).
        let mut props: sys::CUmemPoolProps = unsafe { std::mem::zeroed() };
        props.allocType = sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
        props.handleTypes = sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_NONE;
        props.location.type_ = sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
        props.location.id = self.inner.ordinal as c_int;
        // SAFETY: `props` is a valid, fully initialised struct that outlives the call.
        let pool = self.check("cuMemPoolCreate", unsafe {
            result::mem_pool::create(&props)
        })?;
        let pool = AsyncMemPool {
            device: self.clone(),
            pool,
        };
        let mut threshold = u64::MAX;
        // SAFETY: the pool is valid; RELEASE_THRESHOLD takes a u64 (cuuint64_t).
        let r = unsafe {
            result::mem_pool::set_attribute(
                pool.pool,
                sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
                &mut threshold as *mut u64 as *mut c_void,
            )
        };
        self.check("cuMemPoolSetAttribute", r)?;
        Ok(pool)
    }

    /// `bytes > 0` of managed (unified) memory, attached globally. The caller has checked
    /// the request against the device's free memory: over-subscription can hang the GPU.
    /// Free with `free`.
    pub(crate) fn alloc_managed(&self, bytes: usize) -> Result<u64> {
        no_alloc_in_capture("cuMemAllocManaged")?;
        self.bind()?;
        // SAFETY: the context is bound; the pointer is owned by the caller, which frees it
        // with `free` (cuMemFree frees managed memory too).
        match unsafe { result::malloc_managed(bytes, sys::CUmemAttach_flags::CU_MEM_ATTACH_GLOBAL) }
        {
            Ok(ptr) => Ok(ptr),
            Err(e) if e.0 == CUresult::CUDA_ERROR_OUT_OF_MEMORY => {
                Err(self.oom(bytes, "cuMemAllocManaged refused"))
            }
            Err(e) => self.check("cuMemAllocManaged", Err(e)),
        }
    }

    /// `cuMemAdvise` on managed memory: `advice` 1..=6 as `CUmem_advise`, `device` the
    /// location (`None`: the host).
    pub(crate) fn mem_advise(
        &self,
        ptr: u64,
        bytes: usize,
        advice: sys::CUmem_advise,
        device: Option<usize>,
    ) -> Result<()> {
        self.bind()?;
        // SAFETY: `ptr..ptr+bytes` lies in a live managed allocation (callers check the
        // range); advice never moves or frees memory.
        let r = unsafe { result::mem_advise(ptr, bytes, advice, location(device)) };
        self.check("cuMemAdvise", r)
    }

    /// `cuMemPrefetchAsync` of managed memory to `device` (`None`: the host) on `stream`.
    pub(crate) fn mem_prefetch(
        &self,
        stream: &CudaStream,
        ptr: u64,
        bytes: usize,
        device: Option<usize>,
    ) -> Result<()> {
        self.bind()?;
        // SAFETY: `ptr..ptr+bytes` lies in a live managed allocation that its owner keeps
        // alive past the stream's work (frees wait for the device).
        let r =
            unsafe { result::mem_prefetch_async(ptr, bytes, location(device), stream.cu_stream()) };
        self.check("cuMemPrefetchAsync", r)
    }

    /// Page-locked host memory of `bytes > 0` on NUMA node `node`: mapped, bound there with
    /// `mbind`, then pinned with `cuMemHostRegister` (which faults the pages in, on the
    /// node). Free with `free_host_on_node`.
    pub(crate) fn alloc_host_on_node(&self, bytes: usize, node: u32) -> Result<u64> {
        no_alloc_in_capture("cuMemHostRegister")?;
        self.bind()?;
        let ptr = super::cpu::map_on_node(bytes, node)?;
        // SAFETY: the mapping is ours, page-aligned and `bytes` long; it stays mapped until
        // `free_host_on_node` unregisters it.
        let r = unsafe { sys::cuMemHostRegister_v2(ptr as *mut c_void, bytes, 0).result() };
        if let Err(e) = self.check("cuMemHostRegister", r) {
            super::cpu::unmap(ptr, bytes);
            return Err(e);
        }
        Ok(ptr)
    }

    /// Frees memory from `alloc_host_on_node`; the caller has made sure no copy uses it.
    pub(crate) fn free_host_on_node(&self, ptr: u64, bytes: usize) -> Result<()> {
        no_alloc_in_capture("cuMemHostUnregister")?;
        self.bind()?;
        // SAFETY: `ptr` was registered by `alloc_host_on_node` and is given up here.
        let r = unsafe { sys::cuMemHostUnregister(ptr as *mut c_void).result() };
        self.check("cuMemHostUnregister", r)?;
        super::cpu::unmap(ptr, bytes);
        Ok(())
    }

    /// Where this GPU's host memory and staging threads belong, from `/sys`.
    pub(crate) fn numa(&self) -> super::sysfs::NumaPlacement {
        let node = self
            .pci_bus_id()
            .ok()
            .and_then(|id| super::sysfs::PciDevice::new(&id).numa_node());
        super::sysfs::NumaPlacement::detect(std::path::Path::new("/sys"), node)
    }

    /// Frees memory returned by `alloc`.
    pub(crate) fn free(&self, ptr: u64) -> Result<()> {
        no_alloc_in_capture("cuMemFree")?;
        self.bind()?;
        // SAFETY: `ptr` came from `alloc` on this context and its owner gives it up here;
        // cuMemFree waits for work that may still use it.
        let r = unsafe { result::free_sync(ptr) };
        self.check("cuMemFree", r)
    }

    /// Copies `src` into device memory at `dst` on `stream`; returns when `src` may be reused.
    pub(crate) fn copy_h2d<T: DType>(
        &self,
        stream: &CudaStream,
        dst: u64,
        src: &[T],
    ) -> Result<()> {
        if src.is_empty() {
            return Ok(());
        }
        self.refuse_if_capturing(stream, "cuMemcpyHtoDAsync from pageable memory")?;
        let t = activity::begin();
        // SAFETY: the caller guarantees `dst` holds at least `size_of_val(src)` bytes. `src` is
        // borrowed for this call only, so the stream is synchronised before returning (a
        // pinned `src` would otherwise still be read by the DMA engine after the borrow ends).
        let r = unsafe { result::memcpy_htod_async(dst, src, stream.cu_stream()) };
        self.check("cuMemcpyHtoDAsync", r)?;
        self.synchronize_stream(stream)?;
        let bytes = std::mem::size_of_val(src) as u64;
        activity::end(t, ActivityKind::H2D, stream.cu_stream() as u64, bytes);
        Ok(())
    }

    /// Copies device memory at `src` into `dst` on `stream` and waits for it.
    pub(crate) fn copy_d2h<T: DType>(
        &self,
        stream: &CudaStream,
        dst: &mut [T],
        src: u64,
    ) -> Result<()> {
        let bytes = std::mem::size_of_val(dst);
        // SAFETY: `dst` is `bytes` of writable memory borrowed for the whole (synchronous)
        // copy; the caller guarantees `src` holds as many.
        unsafe { self.copy_d2h_raw(stream, dst.as_mut_ptr().cast(), src, bytes) }
    }

    /// Copies `bytes` of device memory at `src` to host memory at `dst` on `stream` and
    /// waits for it.
    ///
    /// # Safety
    /// `dst` must be valid for `bytes` of writes, untouched by anyone else until this
    /// returns, and `src` must cover `bytes`.
    pub(crate) unsafe fn copy_d2h_raw(
        &self,
        stream: &CudaStream,
        dst: *mut u8,
        src: u64,
        bytes: usize,
    ) -> Result<()> {
        if bytes == 0 {
            return Ok(());
        }
        self.refuse_if_capturing(stream, "cuMemcpyDtoHAsync to pageable memory")?;
        let t = activity::begin();
        // SAFETY: forwarded from this function's contract; the stream is synchronised
        // before returning.
        let r = unsafe {
            sys::cuMemcpyDtoHAsync_v2(dst as *mut c_void, src, bytes, stream.cu_stream()).result()
        };
        self.check("cuMemcpyDtoHAsync", r)?;
        self.synchronize_stream(stream)?;
        activity::end(
            t,
            ActivityKind::D2H,
            stream.cu_stream() as u64,
            bytes as u64,
        );
        Ok(())
    }

    /// Enqueues a device-to-device copy of `bytes` on `stream`.
    pub(crate) fn copy_d2d(
        &self,
        stream: &CudaStream,
        dst: u64,
        src: u64,
        bytes: usize,
    ) -> Result<()> {
        if bytes == 0 {
            return Ok(());
        }
        self.bind()?;
        let t = activity::begin();
        // SAFETY: the caller guarantees both ranges are live device allocations of `bytes`.
        let r = unsafe { result::memcpy_dtod_async(dst, src, bytes, stream.cu_stream()) };
        self.check("cuMemcpyDtoDAsync", r)?;
        activity::end(
            t,
            ActivityKind::D2D,
            stream.cu_stream() as u64,
            bytes as u64,
        );
        Ok(())
    }

    // ---- kernels ----

    /// The NVRTC architecture this device compiles for.
    pub(crate) fn arch(&self) -> kernels::Arch {
        let (major, minor) = self.inner.compute_capability;
        kernels::Arch::from_compute_capability(major as u32, minor as u32)
    }

    /// Loads (compiling through the disk cache on first use) kernel `name` of `source`.
    pub(crate) fn function(
        &self,
        source: &'static KernelSource,
        name: &'static str,
    ) -> Result<CudaFunction> {
        if let Some(f) = self.inner.functions.lock().get(&(source.name, name)) {
            return Ok(f.clone());
        }
        let module = self.module(source)?;
        self.bind()?;
        let r = module.load_function(name);
        let f = self.check("cuModuleGetFunction", r)?;
        self.inner
            .functions
            .lock()
            .insert((source.name, name), f.clone());
        Ok(f)
    }

    /// How many blocks of `block` threads (with `shared_bytes` of dynamic shared memory) of
    /// kernel `name` fit on one SM at once (at least 1), from the driver's occupancy
    /// calculator; cached per kernel and shape. Grid-stride kernels launch SMs × this.
    pub(crate) fn resident_blocks(
        &self,
        source: &'static KernelSource,
        name: &'static str,
        block: u32,
        shared_bytes: u32,
    ) -> Result<u32> {
        let key = (source.name, name, block, shared_bytes);
        if let Some(&n) = self.inner.occupancy.lock().get(&key) {
            return Ok(n);
        }
        let f = self.function(source, name)?;
        self.bind()?;
        // The calculator counts no block that asks for more than the function is opted in
        // to (what a launch of this size sets anyway).
        self.opt_in_dynamic_shared(&f, shared_bytes)?;
        let r =
            f.occupancy_max_active_blocks_per_multiprocessor(block, shared_bytes as usize, None);
        let n = self
            .check("cuOccupancyMaxActiveBlocksPerMultiprocessor", r)?
            .max(1);
        self.inner.occupancy.lock().insert(key, n);
        Ok(n)
    }

    fn module(&self, source: &'static KernelSource) -> Result<Arc<CudaModule>> {
        if let Some(m) = self.inner.modules.lock().get(source.name) {
            return Ok(m.clone());
        }
        let arch = source.arch_for(self.arch())?;
        let module = kernels::PtxCache::global().load(source, arch, |ptx| {
            self.bind()?;
            let r = self
                .inner
                .ctx
                .load_module(cudarc::nvrtc::Ptx::from_src(ptx.to_string()));
            self.check("cuModuleLoadData", r)
        })?;
        self.inner
            .modules
            .lock()
            .insert(source.name, module.clone());
        Ok(module)
    }

    /// Launches `f` on `stream` as `mode` says (see [`LaunchMode`]).
    ///
    /// # Safety
    /// `params` must point at values whose types and order match the kernel's parameters,
    /// and every device pointer among them must cover what the kernel reads and writes
    /// for this grid. With `mode.programmatic`, the kernel must execute `griddepcontrol.wait`
    /// before it reads anything earlier work on the stream writes, or writes anything that
    /// work reads (before the wait it may only read data no earlier work writes, such as
    /// weights, and only through L2).
    #[allow(clippy::too_many_arguments)]
    pub(crate) unsafe fn launch(
        &self,
        stream: &CudaStream,
        f: &CudaFunction,
        grid: (u32, u32, u32),
        block: (u32, u32, u32),
        shared_mem_bytes: u32,
        params: &mut [*mut c_void],
        mode: LaunchMode,
    ) -> Result<()> {
        let LaunchMode {
            programmatic,
            cluster,
            cooperative,
        } = mode;
        if grid.0 == 0 || grid.1 == 0 || grid.2 == 0 || block.0 == 0 || block.1 == 0 || block.2 == 0
        {
            return Err(Error::InvalidArgument(format!(
                "empty launch: grid {grid:?}, block {block:?}"
            )));
        }
        if cluster > 1 && (self.compute_capability().0 < 9 || cluster > 8 || grid.0 % cluster != 0)
        {
            return Err(Error::InvalidArgument(format!(
                "clusters of {cluster} blocks: need compute capability 9.0 (have {:?}), at most 8 \
                 blocks and a grid.x ({}) they divide",
                self.compute_capability(),
                grid.0
            )));
        }
        // The lean path: no cuCtxGetCurrent when this thread already bound this context,
        // no events (warpdrive orders streams explicitly where it must).
        let t = activity::begin();
        self.opt_in_dynamic_shared(f, shared_mem_bytes)?;
        let programmatic = programmatic && self.compute_capability().0 >= 9;
        if programmatic || cluster > 1 || cooperative {
            // SAFETY: an all-zero CUlaunchAttribute is a valid value (plain integers and a
            // union of them); ids and values are set right after.
            let mut attrs: [sys::CUlaunchAttribute; 3] = unsafe { std::mem::zeroed() };
            let mut n = 0;
            if programmatic {
                attrs[n].id =
                    sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
                attrs[n].value.programmaticStreamSerializationAllowed = 1;
                n += 1;
            }
            if cluster > 1 {
                attrs[n].id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION;
                attrs[n].value.clusterDim.x = cluster;
                attrs[n].value.clusterDim.y = 1;
                attrs[n].value.clusterDim.z = 1;
                n += 1;
            }
            if cooperative {
                attrs[n].id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_COOPERATIVE;
                attrs[n].value.cooperative = 1;
                n += 1;
            }
            let config = sys::CUlaunchConfig {
                gridDimX: grid.0,
                gridDimY: grid.1,
                gridDimZ: grid.2,
                blockDimX: block.0,
                blockDimY: block.1,
                blockDimZ: block.2,
                sharedMemBytes: shared_mem_bytes,
                hStream: stream.cu_stream(),
                attrs: attrs.as_mut_ptr(),
                numAttrs: n as u32,
            };
            self.lean("cuLaunchKernelEx", || {
                // SAFETY: forwarded from this function's contract; `config` and `attrs` live
                // across the call; the function handle is alive (its module is held by `f`).
                unsafe {
                    sys::cuLaunchKernelEx(
                        &config,
                        f.cu_function(),
                        params.as_mut_ptr(),
                        std::ptr::null_mut(),
                    )
                    .result()
                }
            })?;
        } else {
            self.lean("cuLaunchKernel", || {
                // SAFETY: forwarded from this function's contract; the function handle is
                // alive (its module is held by `f`).
                unsafe {
                    result::launch_kernel(
                        f.cu_function(),
                        grid,
                        block,
                        shared_mem_bytes,
                        stream.cu_stream(),
                        params,
                    )
                }
            })?;
        }
        activity::end(t, ActivityKind::Launch, stream.cu_stream() as u64, 0);
        Ok(())
    }

    /// The block size that maximises occupancy for `f` with `shared_mem_bytes` of dynamic
    /// shared memory per block (`cuOccupancyMaxPotentialBlockSize`), and the smallest grid
    /// that reaches it: (min grid, block).
    pub(crate) fn occupancy_block_size(
        &self,
        f: &CudaFunction,
        shared_mem_bytes: usize,
    ) -> Result<(u32, u32)> {
        self.bind()?;
        // SAFETY: the function handle is alive (its module is held by `f`); no callback.
        let r = unsafe {
            result::occupancy::max_potential_block_size(f.cu_function(), None, shared_mem_bytes, 0)
        };
        let (grid, block) = self.check("cuOccupancyMaxPotentialBlockSize", r)?;
        Ok((grid.max(1) as u32, block.max(1) as u32))
    }

    /// The most threads per block `f` can be launched with (its `__launch_bounds__`, or
    /// what its registers allow).
    pub(crate) fn max_block_threads(&self, f: &CudaFunction) -> Result<u32> {
        let r = f.get_attribute(sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK);
        Ok(self.check("cuFuncGetAttribute", r)?.max(1) as u32)
    }

    // ---- graphs ----

    /// Starts capturing `stream` (THREAD_LOCAL mode). Every successful call must be paired
    /// with [`end_capture`](Self::end_capture) on the same thread.
    pub(crate) fn begin_capture(&self, stream: &CudaStream) -> Result<()> {
        if self.is_capturing(stream)? {
            return Err(Error::Capture {
                call: "cuStreamBeginCapture",
                hint: "the stream is already capturing a graph".into(),
            });
        }
        let r = stream.begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL);
        self.check("cuStreamBeginCapture", r)?;
        CAPTURING.with(|c| c.set(c.get() + 1));
        Ok(())
    }

    /// Ends the capture begun by [`begin_capture`](Self::begin_capture) and instantiates the
    /// graph (`None` when nothing was captured). The stream leaves capture mode even when
    /// this fails (for instance when the capture was invalidated).
    pub(crate) fn end_capture(&self, stream: &Arc<CudaStream>) -> Result<Option<CudaGraph>> {
        CAPTURING.with(|c| c.set(c.get().saturating_sub(1)));
        if self.is_lost() {
            return Err(lost_error());
        }
        let r = stream.end_capture(sys::CUgraphInstantiate_flags(0));
        BOUND.with(|b| b.set(self.ctx_key()));
        self.check("cuStreamEndCapture", r)
    }

    /// Uploads `graph` to the device on `stream`, so its first launch does no setup.
    pub(crate) fn upload_graph(&self, graph: &CudaGraph, stream: &CudaStream) -> Result<()> {
        self.lean("cuGraphUpload", || {
            // SAFETY: the executable graph is alive (borrowed) and belongs to this context.
            unsafe { result::graph::upload(graph.cu_graph_exec(), stream.cu_stream()) }
        })
    }

    /// Launches `graph` on `stream` (the lean path, as kernel launches).
    pub(crate) fn launch_graph(&self, graph: &CudaGraph, stream: &CudaStream) -> Result<()> {
        let t = activity::begin();
        self.lean("cuGraphLaunch", || {
            // SAFETY: the executable graph is alive (borrowed) and belongs to this context.
            unsafe { result::graph::launch(graph.cu_graph_exec(), stream.cu_stream()) }
        })?;
        activity::end(t, ActivityKind::GraphLaunch, stream.cu_stream() as u64, 0);
        Ok(())
    }

    // ---- cuBLAS ----

    /// Runs `body` with this device's cuBLAS handle bound to `stream`.
    pub(crate) fn with_blas<R>(
        &self,
        stream: &CudaStream,
        body: impl FnOnce(cudarc::cublas::sys::cublasHandle_t) -> Result<R>,
    ) -> Result<R> {
        if !libraries().cublas {
            return Err(Error::LibraryMissing {
                library: "cuBLAS",
                hint: "libcublas.so.13 not found on the library path".into(),
            });
        }
        self.bind()?;
        let mut guard = self.inner.blas.lock();
        if guard.is_none() {
            no_alloc_in_capture("cublasCreate")?;
            let h = cudarc::cublas::result::create_handle().map_err(|e| Error::Blas {
                call: "cublasCreate",
                message: format!("{e:?}"),
            })?;
            *guard = Some(BlasHandle(h));
            if release_at_exit() {
                BLAS_OWNERS.lock().push(Arc::downgrade(&self.inner));
                at_exit(release_blas_handles);
            }
        }
        let Some(handle) = guard.as_ref().map(|h| h.0) else {
            return Err(Error::Blas {
                call: "cublasCreate",
                message: "no handle".into(),
            });
        };
        // SAFETY: the handle is valid and used by this thread alone while the lock is held;
        // cuBLAS's stream type is the driver's.
        unsafe { cudarc::cublas::result::set_stream(handle, stream.cu_stream() as _) }.map_err(
            |e| Error::Blas {
                call: "cublasSetStream",
                message: format!("{e:?}"),
            },
        )?;
        body(handle)
    }

    /// Creates the cuBLAS handle now if cuBLAS is present (before a graph capture, where
    /// creating it would allocate). Without cuBLAS this does nothing.
    pub(crate) fn prepare_blas(&self, stream: &CudaStream) -> Result<()> {
        if !libraries().cublas {
            return Ok(());
        }
        self.with_blas(stream, |_| Ok(()))
    }

    /// Row-major GEMMs (see [`GemmCall`]) through `cublasGemmEx`, or
    /// `cublasGemmStridedBatchedEx` for batches, all under one hold of the cuBLAS handle.
    ///
    /// # Safety
    /// For each call, `a`, `b`, `c` must be live device allocations covering `batch` items
    /// of m·k, k·n and m·n elements of `dtype` at the given strides, and `c` must not overlap
    /// `a` or `b`.
    pub(crate) unsafe fn gemm(&self, stream: &CudaStream, calls: &[GemmCall]) -> Result<()> {
        use crate::dtype::DTypeKind;
        use cudarc::cublas::sys::{
            cublasComputeType_t, cublasGemmAlgo_t, cublasOperation_t, cudaDataType,
        };
        let int = |v: usize| {
            c_int::try_from(v)
                .map_err(|_| Error::InvalidArgument(format!("GEMM dimension {v} exceeds i32")))
        };
        let long = |v: usize| {
            i64::try_from(v)
                .map_err(|_| Error::InvalidArgument(format!("GEMM stride {v} exceeds i64")))
        };
        let alpha = 1.0f32;
        let beta = 0.0f32;
        self.with_blas(stream, |h| {
            for call in calls {
                let (ty, compute) = match (call.dtype, call.tf32) {
                    (DTypeKind::BF16, _) => (
                        cudaDataType::CUDA_R_16BF,
                        cublasComputeType_t::CUBLAS_COMPUTE_32F,
                    ),
                    (DTypeKind::F16, _) => (
                        cudaDataType::CUDA_R_16F,
                        cublasComputeType_t::CUBLAS_COMPUTE_32F,
                    ),
                    (DTypeKind::F32, false) => (
                        cudaDataType::CUDA_R_32F,
                        cublasComputeType_t::CUBLAS_COMPUTE_32F,
                    ),
                    (DTypeKind::F32, true) => (
                        cudaDataType::CUDA_R_32F,
                        cublasComputeType_t::CUBLAS_COMPUTE_32F_FAST_TF32,
                    ),
                    (other, _) => {
                        return Err(Error::Unsupported(format!(
                            "cuBLAS GEMM for {}",
                            other.name()
                        )))
                    }
                };
                // Row-major C = op(A)·op(B) is column-major Cᵀ = op(B)ᵀ·op(A)ᵀ: swap the
                // operands; a row-major matrix read column-major is its transpose.
                let op = |t: bool| {
                    if t {
                        cublasOperation_t::CUBLAS_OP_T
                    } else {
                        cublasOperation_t::CUBLAS_OP_N
                    }
                };
                let (m, n, k) = (int(call.m)?, int(call.n)?, int(call.k)?);
                let ldb = if call.trans_b { k } else { n };
                let lda = if call.trans_a { m } else { k };
                let r = if call.batch <= 1 {
                    // SAFETY: the caller guarantees the three allocations; alpha/beta outlive
                    // the call.
                    unsafe {
                        cudarc::cublas::result::gemm_ex(
                            h,
                            op(call.trans_b),
                            op(call.trans_a),
                            n,
                            m,
                            k,
                            &alpha as *const f32 as *const c_void,
                            call.b as *const c_void,
                            ty,
                            ldb,
                            call.a as *const c_void,
                            ty,
                            lda,
                            &beta as *const f32 as *const c_void,
                            call.c as *mut c_void,
                            ty,
                            n,
                            compute,
                            cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
                        )
                    }
                } else {
                    let (sa, sb, sc) = (
                        long(call.stride_a)?,
                        long(call.stride_b)?,
                        long(call.stride_c)?,
                    );
                    // SAFETY: as above, for every batch item at its stride.
                    unsafe {
                        cudarc::cublas::result::gemm_strided_batched_ex(
                            h,
                            op(call.trans_b),
                            op(call.trans_a),
                            n,
                            m,
                            k,
                            &alpha as *const f32 as *const c_void,
                            call.b as *const c_void,
                            ty,
                            ldb,
                            sb,
                            call.a as *const c_void,
                            ty,
                            lda,
                            sa,
                            &beta as *const f32 as *const c_void,
                            call.c as *mut c_void,
                            ty,
                            n,
                            sc,
                            int(call.batch)?,
                            compute,
                            cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
                        )
                    }
                };
                r.map_err(|e| Error::Blas {
                    call: if call.batch <= 1 {
                        "cublasGemmEx"
                    } else {
                        "cublasGemmStridedBatchedEx"
                    },
                    message: format!("{e:?}"),
                })?;
            }
            Ok(())
        })
    }

    /// The device pointer arrays [`gemm_grouped`](Self::gemm_grouped) reads for `calls`, in
    /// its order (3 · calls.len() words), for the caller to place in device memory.
    pub(crate) fn grouped_gemm_pointers(calls: &[GemmCall]) -> Vec<u64> {
        let mut ptrs: Vec<u64> = calls.iter().map(|c| c.b).collect();
        ptrs.extend(calls.iter().map(|c| c.a));
        ptrs.extend(calls.iter().map(|c| c.c));
        ptrs
    }

    /// Row-major GEMMs of one dtype (bf16, f16 or f32 without TF32, `batch` 1, `trans_a`
    /// false, `trans_b` true: activations × weightsᵀ) as one `cublasGemmGroupedBatchedEx`
    /// call, one group per GEMM.
    ///
    /// # Safety
    /// As [`gemm`](Self::gemm) for each call; `pointers` must be device memory holding
    /// [`grouped_gemm_pointers`](Self::grouped_gemm_pointers)`(calls)`, written before this
    /// call in the stream's order and unchanged until the stream passes it.
    pub(crate) unsafe fn gemm_grouped(
        &self,
        stream: &CudaStream,
        calls: &[GemmCall],
        pointers: u64,
    ) -> Result<()> {
        use crate::dtype::DTypeKind;
        use cudarc::cublas::sys::{cublasComputeType_t, cublasOperation_t, cudaDataType};
        let Some(first) = calls.first() else {
            return Ok(());
        };
        let ty = match first.dtype {
            DTypeKind::BF16 => cudaDataType::CUDA_R_16BF,
            DTypeKind::F16 => cudaDataType::CUDA_R_16F,
            DTypeKind::F32 => cudaDataType::CUDA_R_32F,
            other => {
                return Err(Error::Unsupported(format!(
                    "cuBLAS grouped GEMM for {}",
                    other.name()
                )))
            }
        };
        if calls
            .iter()
            .any(|c| c.dtype != first.dtype || c.batch > 1 || c.tf32 || c.trans_a || !c.trans_b)
        {
            return Err(Error::InvalidArgument(
                "grouped GEMM: every call must be one un-batched activations × weightsᵀ product of the same dtype".into(),
            ));
        }
        let int = |v: usize| {
            c_int::try_from(v)
                .map_err(|_| Error::InvalidArgument(format!("GEMM dimension {v} exceeds i32")))
        };
        let groups = int(calls.len())?;
        // Column-major view of row-major C = A·Bᵀ: Cᵀ (n×m) = B (n×k, stored k-major, so
        // op T) · Aᵀ (k×m, op N).
        let (mut m, mut n, mut k) = (Vec::new(), Vec::new(), Vec::new());
        for c in calls {
            m.push(int(c.n)?);
            n.push(int(c.m)?);
            k.push(int(c.k)?);
        }
        let len = calls.len();
        let op_t = vec![cublasOperation_t::CUBLAS_OP_T; len];
        let op_n = vec![cublasOperation_t::CUBLAS_OP_N; len];
        let alpha = vec![1.0f32; len];
        let beta = vec![0.0f32; len];
        let ones = vec![1 as c_int; len];
        let word = std::mem::size_of::<u64>() as u64;
        self.with_blas(stream, |h| {
            // SAFETY: the host arrays hold one entry per group and outlive the call; the
            // three device pointer arrays are at `pointers` and the matrices are the
            // caller's (this function's contract); lda = ldb = k, ldc = n for row-major
            // storage.
            let r = unsafe {
                cudarc::cublas::sys::cublasGemmGroupedBatchedEx(
                    h,
                    op_t.as_ptr(),
                    op_n.as_ptr(),
                    m.as_ptr(),
                    n.as_ptr(),
                    k.as_ptr(),
                    alpha.as_ptr() as *const c_void,
                    pointers as *const *const c_void,
                    ty,
                    k.as_ptr(),
                    (pointers + len as u64 * word) as *const *const c_void,
                    ty,
                    k.as_ptr(),
                    beta.as_ptr() as *const c_void,
                    (pointers + 2 * len as u64 * word) as *const *mut c_void,
                    ty,
                    m.as_ptr(),
                    groups,
                    ones.as_ptr(),
                    cublasComputeType_t::CUBLAS_COMPUTE_32F,
                )
            };
            r.result().map_err(|e| Error::Blas {
                call: "cublasGemmGroupedBatchedEx",
                message: format!("{e:?}"),
            })
        })
    }

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

    /// Copies raw bytes host→device or device→host on `stream` without synchronising.
    ///
    /// # Safety
    /// `host` must stay valid and untouched until the stream has passed this copy, and
    /// `dev` must cover `bytes`.
    pub(crate) unsafe fn copy_raw_async(
        &self,
        stream: &CudaStream,
        to_device: bool,
        host: *mut u8,
        dev: u64,
        bytes: usize,
    ) -> Result<()> {
        self.bind()?;
        let s = stream.cu_stream();
        // SAFETY: forwarded from this function's contract.
        let r = unsafe {
            if to_device {
                sys::cuMemcpyHtoDAsync_v2(dev, host as *const c_void, bytes, s).result()
            } else {
                sys::cuMemcpyDtoHAsync_v2(host as *mut c_void, dev, bytes, s).result()
            }
        };
        self.check("cuMemcpyAsync", r)
    }

    // ---- device information ----

    pub(crate) fn info(&self) -> Result<DeviceInfo> {
        self.bind()?;
        let name = self.check("cuDeviceGetName", self.inner.ctx.name())?;
        let (free, total) = self.mem_info()?;
        let sms = self.attribute(Attr::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?;
        let l2 = self.l2_cache_bytes()?;
        let bus_id = self.pci_bus_id().ok();
        let sysfs = bus_id.as_deref().map(super::sysfs::PciDevice::new);
        let (pcie_gen, pcie_width) = sysfs
            .as_ref()
            .map(|d| (d.link_generation(), d.link_width()))
            .unwrap_or((None, None));
        let numa_node = sysfs.as_ref().and_then(|d| d.numa_node());
        let numa = super::sysfs::NumaPlacement::detect(std::path::Path::new("/sys"), numa_node);
        let mut cuda_version = 0;
        // SAFETY: the driver is loaded; the out-pointer is a valid local.
        let r = unsafe { sys::cuDriverGetVersion(&mut cuda_version).result() };
        self.check("cuDriverGetVersion", r)?;
        let (major, minor) = self.inner.compute_capability;
        Ok(DeviceInfo {
            backend: "cuda",
            ordinal: Some(self.inner.ordinal),
            name,
            compute_capability: Some(format!("{major}.{minor}")),
            arch: Some(self.arch().name().to_string()),
            sms: Some(sms.max(0) as u32),
            cpu_threads: std::thread::available_parallelism()
                .map(|n| n.get())
                .unwrap_or(1),
            memory_total: total as u64,
            memory_free: free as u64,
            l2_bytes: Some(l2 as u64),
            pci_bus_id: bus_id,
            pcie_gen,
            pcie_width,
            numa_node,
            numa,
            driver: super::sysfs::nvidia_driver_version(),
            cuda: Some(format!(
                "{}.{}",
                cuda_version / 1000,
                (cuda_version % 1000) / 10
            )),
            libraries: library_statuses(),
        })
    }

    fn pci_bus_id(&self) -> Result<String> {
        let mut buf = [0 as std::ffi::c_char; 32];
        // SAFETY: the buffer is valid for its stated length; the driver NUL-terminates it.
        let r = unsafe {
            sys::cuDeviceGetPCIBusId(
                buf.as_mut_ptr(),
                buf.len() as c_int,
                self.inner.ctx.cu_device(),
            )
            .result()
        };
        self.check("cuDeviceGetPCIBusId", r)?;
        let bytes: Vec<u8> = buf
            .iter()
            .take_while(|&&c| c != 0)
            .map(|&c| c as u8)
            .collect();
        Ok(String::from_utf8_lossy(&bytes).to_lowercase())
    }
}

/// A `CUmemLocation` for device `n`, or the host.
fn location(device: Option<usize>) -> sys::CUmemLocation {
    match device {
        Some(n) => sys::CUmemLocation {
            type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
            id: n as c_int,
        },
        None => sys::CUmemLocation {
            type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_HOST,
            id: 0,
        },
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

/// A CUDA stream-ordered memory pool (`cuMemPoolCreate`), destroyed on drop (the driver
/// releases its memory once every allocation from it has been freed).
pub(crate) struct AsyncMemPool {
    device: CudaDevice,
    pool: sys::CUmemoryPool,
}

// SAFETY: a CUmemoryPool handle may be used from any thread; the driver synchronises calls.
unsafe impl Send for AsyncMemPool {}
// SAFETY: as above; no method mutates Rust-side state.
unsafe impl Sync for AsyncMemPool {}

/// What an [`AsyncMemPool`] holds, from its attributes.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct AsyncPoolUsage {
    pub reserved: u64,
    pub reserved_high: u64,
    pub used: u64,
}

impl AsyncMemPool {
    /// `bytes > 0` from the pool, ordered on `stream` (usable by work enqueued after it).
    pub(crate) fn alloc(&self, stream: &CudaStream, bytes: usize) -> Result<u64> {
        self.device.bind()?;
        // SAFETY: pool and stream are valid; the memory is uninitialised device memory owned
        // by the caller, who frees it with `free`.
        match unsafe { result::mem_pool::alloc_async(self.pool, bytes, stream.cu_stream()) } {
            Ok(ptr) => Ok(ptr),
            Err(e) if e.0 == CUresult::CUDA_ERROR_OUT_OF_MEMORY => {
                Err(self.device.oom(bytes, "cuMemAllocFromPoolAsync refused"))
            }
            Err(e) => self.device.check("cuMemAllocFromPoolAsync", Err(e)),
        }
    }

    /// Returns `ptr` to the pool once `stream` reaches this point.
    ///
    /// # Safety
    /// `ptr` came from `alloc` on this pool, is freed once, and no work enqueued after this
    /// point on any stream (without waiting on `stream`) uses it.
    pub(crate) unsafe fn free(&self, ptr: u64, stream: &CudaStream) -> Result<()> {
        self.device.bind()?;
        // SAFETY: forwarded from this function's contract.
        let r = unsafe { result::free_async(ptr, stream.cu_stream()) };
        self.device.check("cuMemFreeAsync", r)
    }

    /// Releases the pool's unused memory to the driver.
    pub(crate) fn trim(&self) -> Result<()> {
        self.device.bind()?;
        // SAFETY: the pool is valid.
        let r = unsafe { result::mem_pool::trim_to(self.pool, 0) };
        self.device.check("cuMemPoolTrimTo", r)
    }

    pub(crate) fn usage(&self) -> Result<AsyncPoolUsage> {
        use sys::CUmemPool_attribute as A;
        self.device.bind()?;
        let get = |attr| {
            let mut v = 0u64;
            // SAFETY: the pool is valid; these attributes are cuuint64_t.
            let r = unsafe {
                result::mem_pool::get_attribute(self.pool, attr, &mut v as *mut u64 as *mut c_void)
            };
            self.device.check("cuMemPoolGetAttribute", r).map(|_| v)
        };
        Ok(AsyncPoolUsage {
            reserved: get(A::CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT)?,
            reserved_high: get(A::CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH)?,
            used: get(A::CU_MEMPOOL_ATTR_USED_MEM_CURRENT)?,
        })
    }
}

impl Drop for AsyncMemPool {
    fn drop(&mut self) {
        if self.device.bind().is_err() {
            return;
        }
        // SAFETY: the pool is destroyed once, here; outstanding allocations keep its memory
        // alive inside the driver until they are freed.
        if let Err(e) = unsafe { result::mem_pool::destroy(self.pool) } {
            tracing::warn!("cuMemPoolDestroy failed: {}", describe(e));
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

/// Whether each CUDA library loads here, and its version when it does.
/// With this variable set to `1`, what warpdrive caches for the process's life (the default
/// pools' memory, the cuBLAS handles) is handed back when the process exits, so
/// `compute-sanitizer --leak-check full` reports only memory something still holds (the GPU
/// bundle's `run.sh` sets it).
pub const RELEASE_AT_EXIT: &str = "WARPDRIVE_RELEASE_AT_EXIT";

/// Whether [`RELEASE_AT_EXIT`] is set to `1` (read once).
pub(crate) fn release_at_exit() -> bool {
    static SET: OnceLock<bool> = OnceLock::new();
    *SET.get_or_init(|| std::env::var_os(RELEASE_AT_EXIT).is_some_and(|v| v == "1"))
}

/// Devices holding a cuBLAS handle, for [`release_blas_handles`].
static BLAS_OWNERS: Mutex<Vec<std::sync::Weak<Inner>>> = Mutex::new(Vec::new());

/// Destroys every device's cuBLAS handle (an exit hook under [`RELEASE_AT_EXIT`]).
fn release_blas_handles() {
    // Taken first: a handle's lock is never waited for while holding this list's.
    let owners = std::mem::take(&mut *BLAS_OWNERS.lock());
    for owner in owners {
        if let Some(inner) = owner.upgrade() {
            drop(inner.blas.lock().take());
        }
    }
}

/// Functions run when the process exits normally ([`at_exit`]), in registration order.
static EXIT_HOOKS: Mutex<Vec<fn()>> = Mutex::new(Vec::new());

/// Runs the latest hook not yet run: C calls one of these per [`at_exit`], newest first.
extern "C" fn run_latest_exit_hook() {
    let hook = EXIT_HOOKS.lock().pop();
    if let Some(hook) = hook {
        // A panic must not unwind into C's exit.
        let _ = std::panic::catch_unwind(hook);
    }
}

/// Runs `hook` when the process exits normally. Each registration is its own C `atexit`
/// entry, so a hook runs before the teardown of whatever was loaded before it registered
/// (the CUDA driver registers at `cuInit`; cuBLAS when it loads). A hook registered more
/// than once runs once.
pub(crate) fn at_exit(hook: fn()) {
    let mut hooks = EXIT_HOOKS.lock();
    if hooks.iter().any(|h| std::ptr::fn_addr_eq(*h, hook)) {
        return;
    }
    hooks.push(hook);
    // SAFETY: `run_latest_exit_hook` is a plain `extern "C" fn()` that never unwinds;
    // atexit only stores the pointer.
    if unsafe { libc::atexit(run_latest_exit_hook) } != 0 {
        hooks.pop();
        tracing::warn!("atexit refused a hook: it will not run at exit");
    }
}

pub(crate) fn library_statuses() -> Vec<LibraryStatus> {
    let libs = libraries();
    let status = |name: &'static str, loaded: bool, version: Option<String>| LibraryStatus {
        name,
        loaded,
        version,
    };
    let driver_version = libs.driver.then(|| {
        let mut v = 0;
        // SAFETY: the driver library is loaded; the out-pointer is a valid local.
        let ok = unsafe { sys::cuDriverGetVersion(&mut v) } == CUresult::CUDA_SUCCESS;
        ok.then(|| format!("{}.{}", v / 1000, (v % 1000) / 10))
    });
    let cublas_version = libs.cublas.then(|| {
        use cudarc::cublas::sys::{cublasGetProperty, cublasStatus_t, libraryPropertyType};
        let mut parts = [0; 3];
        let kinds = [
            libraryPropertyType::MAJOR_VERSION,
            libraryPropertyType::MINOR_VERSION,
            libraryPropertyType::PATCH_LEVEL,
        ];
        for (slot, kind) in parts.iter_mut().zip(kinds) {
            // SAFETY: libcublas is loaded; the out-pointer is a valid local.
            if unsafe { cublasGetProperty(kind, slot) } != cublasStatus_t::CUBLAS_STATUS_SUCCESS {
                return None;
            }
        }
        Some(format!("{}.{}.{}", parts[0], parts[1], parts[2]))
    });
    let cublaslt_version = libs.cublaslt.then(|| {
        // SAFETY: libcublasLt is loaded; the call takes no arguments.
        let v = unsafe { cudarc::cublaslt::sys::cublasLtGetVersion() };
        Some(format!("{}.{}.{}", v / 10000, (v % 10000) / 100, v % 100))
    });
    let nccl_version = libs.nccl.then(|| {
        let mut v = 0;
        // SAFETY: libnccl is loaded; the out-pointer is a valid local.
        let ok = unsafe { cudarc::nccl::sys::ncclGetVersion(&mut v) }
            == cudarc::nccl::sys::ncclResult_t::ncclSuccess;
        ok.then(|| format!("{}.{}.{}", v / 10000, (v % 10000) / 100, v % 100))
    });
    let cufile_version = libs.cufile.then(|| {
        let mut v = 0;
        // SAFETY: libcufile is loaded; the out-pointer is a valid local.
        let r = unsafe { cudarc::cufile::sys::cuFileGetVersion(&mut v) };
        (r.err == cudarc::cufile::sys::CUfileOpError::CU_FILE_SUCCESS)
            .then(|| format!("{}.{}", v / 1000, (v % 1000) / 10))
    });
    vec![
        status("driver", libs.driver, driver_version.flatten()),
        status(
            "nvrtc",
            libs.nvrtc,
            nvrtc_version().map(|(a, b)| format!("{a}.{b}")),
        ),
        status("cublas", libs.cublas, cublas_version.flatten()),
        status("cublaslt", libs.cublaslt, cublaslt_version.flatten()),
        status("nccl", libs.nccl, nccl_version.flatten()),
        status("cufile", libs.cufile, cufile_version.flatten()),
    ]
}

/// How [`CudaDevice::launch`] starts a kernel beyond its shape. The default is a plain launch.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct LaunchMode {
    /// A programmatic dependent launch (Hopper and later; ignored before compute capability
    /// 9.0): the kernel's blocks may start while the stream's previous kernel finishes (in a
    /// captured graph, a programmatic edge).
    pub programmatic: bool,
    /// Above 1, every `cluster` consecutive blocks along x form a thread-block cluster
    /// (compute capability 9.0 and later; at most 8, dividing grid.x).
    pub cluster: u32,
    /// A cooperative launch: every block is resident at once (the driver refuses a grid
    /// that cannot be), so blocks may wait for each other.
    pub cooperative: bool,
}
