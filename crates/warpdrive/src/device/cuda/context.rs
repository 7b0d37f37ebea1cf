//! `CudaDevice` and its context: opening a device, binding it to a thread, sticky-fault
//! ("lost") tracking, the lean launch path and the graph-capture guards.

use std::cell::Cell;
use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};

use cudarc::driver::result::DriverError;
use cudarc::driver::sys::{self, CUdevice_attribute as Attr, CUresult};
use cudarc::driver::{result, CudaContext, CudaFunction, CudaModule};

use super::launch::Function;
use crate::device::state::DeviceState;
use parking_lot::Mutex;

use crate::error::{Error, Result};

use super::blas::BlasHandle;
use super::libraries::device_count;

/// Dynamic shared memory a launch may ask for without opting its function in (48 KiB).
const DEFAULT_DYNAMIC_SHARED: u32 = 48 * 1024;

/// "CUDA_ERROR_NAME: description" for a driver error.
pub(super) fn describe(e: DriverError) -> String {
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
    pub(super) static BOUND: Cell<usize> = const { Cell::new(0) };
    /// Graph captures this thread has begun and not yet ended. Captures run in
    /// `THREAD_LOCAL` mode: the driver forbids this thread (only) allocations, event queries
    /// and synchronisation meanwhile, so warpdrive refuses those calls first, with an error,
    /// instead of letting them invalidate the capture.
    pub(super) static CAPTURING: Cell<u32> = const { Cell::new(0) };
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

pub(super) fn lost_error() -> Error {
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
pub(super) fn no_sync_in_capture(call: &'static str) -> Result<()> {
    refuse_in_capture(
        call,
        "a captured stream cannot be waited on or queried; wait after the capture ends",
    )
}

/// Refuses driver allocations and frees during a capture.
pub(super) fn no_alloc_in_capture(call: &'static str) -> Result<()> {
    refuse_in_capture(
        call,
        "allocate before capturing (the pool serves a capture from blocks it already holds)",
    )
}

/// One CUDA device: its primary context, loaded modules and cuBLAS handle. Cheap to clone.
#[derive(Clone)]
pub struct CudaDevice {
    pub(super) inner: Arc<Inner>,
}

pub(super) struct Inner {
    pub(super) ctx: Arc<CudaContext>,
    pub(super) ordinal: usize,
    pub(super) compute_capability: (i32, i32),
    sm_count: u32,
    lost: Arc<AtomicBool>,
    pub(super) functions: Mutex<HashMap<(&'static str, &'static str), Function>>,
    pub(super) occupancy: Mutex<HashMap<OccupancyKey, u32>>,
    pub(super) modules: Mutex<HashMap<&'static str, Arc<CudaModule>>>,
    pub(super) blas: Mutex<Option<BlasHandle>>,
    /// The cuBLASLt handle and the algorithms its heuristic chose, made on first use.
    pub(super) blaslt: Mutex<Option<super::blaslt::LtState>>,
    /// Ordinals of the devices this one's peer access is on for.
    pub(super) peers: Mutex<HashSet<usize>>,
    /// The floors above's per-device state (pools, tuned configurations, clocks).
    state: DeviceState,
    /// Resident (never-ending) kernels running now, and the frees they hold back: see
    /// `resident.rs`.
    pub(super) resident: super::resident::Resident,
}

/// Every CUDA device this process opened, by ordinal: the handles of one device share its
/// loaded kernels, its per-device state and its lost flag.
fn opened_devices() -> &'static Mutex<HashMap<usize, CudaDevice>> {
    static OPEN: OnceLock<Mutex<HashMap<usize, CudaDevice>>> = OnceLock::new();
    OPEN.get_or_init(|| Mutex::new(HashMap::new()))
}

/// The CUDA devices opened so far, by ordinal.
pub(crate) fn opened() -> Vec<CudaDevice> {
    let mut all: Vec<CudaDevice> = opened_devices().lock().values().cloned().collect();
    all.sort_by_key(CudaDevice::ordinal);
    all
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
        let mut open = opened_devices().lock();
        if let Some(d) = open.get(&ordinal) {
            return Ok(d.clone());
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
        let device = CudaDevice {
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
                blaslt: Mutex::new(None),
                peers: Mutex::new(HashSet::new()),
                state: DeviceState::new(),
                resident: Default::default(),
            }),
        };
        open.insert(ordinal, device.clone());
        Ok(device)
    }

    /// The floors above's per-device state.
    pub(crate) fn state(&self) -> &DeviceState {
        &self.inner.state
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

    pub(super) fn ctx_key(&self) -> usize {
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
    pub(super) fn opt_in_dynamic_shared(&self, f: &CudaFunction, bytes: u32) -> Result<()> {
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
    pub(super) fn lean<T>(
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
}
