//! Raw memory: device, pinned host, managed and NUMA-placed allocations, copies, and
//! CUDA's own stream-ordered pools.

use std::ffi::{c_int, c_void};

use cudarc::driver::result;
use cudarc::driver::sys::{self, CUresult};

use crate::device::MemAdvice;
use crate::dtype::DType;
use crate::error::{Error, Result};

use super::super::activity::{self, ActivityKind};
use super::context::{describe, no_alloc_in_capture, CudaDevice};
use super::resident::HeldFree;
use super::stream::GpuStream;

impl CudaDevice {
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
    pub(crate) fn oom(&self, bytes: usize, what: &str) -> Error {
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
        if self.hold_free(HeldFree::Host(ptr)) {
            return Ok(());
        }
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

    /// `cuMemAdvise` on managed memory, about `device` (`None`: the host).
    pub(crate) fn mem_advise(
        &self,
        ptr: u64,
        bytes: usize,
        advice: MemAdvice,
        device: Option<usize>,
    ) -> Result<()> {
        use sys::CUmem_advise as A;
        let advice = match advice {
            MemAdvice::ReadMostly => A::CU_MEM_ADVISE_SET_READ_MOSTLY,
            MemAdvice::PreferredLocation => A::CU_MEM_ADVISE_SET_PREFERRED_LOCATION,
            MemAdvice::AccessedBy => A::CU_MEM_ADVISE_SET_ACCESSED_BY,
        };
        self.bind()?;
        // SAFETY: `ptr..ptr+bytes` lies in a live managed allocation (callers check the
        // range); advice never moves or frees memory.
        let r = unsafe { result::mem_advise(ptr, bytes, advice, location(device)) };
        self.check("cuMemAdvise", r)
    }

    /// `cuMemPrefetchAsync` of managed memory to `device` (`None`: the host) on `stream`.
    pub(crate) fn mem_prefetch(
        &self,
        stream: &GpuStream,
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
        if self.hold_free(HeldFree::HostOnNode(ptr, bytes)) {
            return Ok(());
        }
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
        if self.hold_free(HeldFree::Device(ptr)) {
            return Ok(());
        }
        self.bind()?;
        // SAFETY: `ptr` came from `alloc` on this context and its owner gives it up here;
        // cuMemFree waits for work that may still use it.
        let r = unsafe { result::free_sync(ptr) };
        self.check("cuMemFree", r)
    }

    /// Copies `src` into device memory at `dst` on `stream`; returns when `src` may be reused.
    pub(crate) fn copy_h2d<T: DType>(&self, stream: &GpuStream, dst: u64, src: &[T]) -> Result<()> {
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
        stream: &GpuStream,
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
        stream: &GpuStream,
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

    /// Enqueues setting `bytes` of device memory at `dst` to zero on `stream`.
    pub(crate) fn memset_zero(&self, stream: &GpuStream, dst: u64, bytes: usize) -> Result<()> {
        if bytes == 0 {
            return Ok(());
        }
        self.bind()?;
        // SAFETY: the caller guarantees `dst` is a live device allocation of at least `bytes`
        // used in `stream`'s order; zero bits are a valid value of every `DType`.
        let r = unsafe { result::memset_d8_async(dst, 0, bytes, stream.cu_stream()) };
        self.check("cuMemsetD8Async", r)
    }

    /// Enqueues a device-to-device copy of `bytes` on `stream`.
    pub(crate) fn copy_d2d(
        &self,
        stream: &GpuStream,
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

    /// Enqueues a strided device-to-device copy on `stream`: `rows` rows of `width` bytes,
    /// the first at `src` and `dst`, the next ones `src_pitch` and `dst_pitch` bytes further.
    pub(crate) fn copy_d2d_rows(
        &self,
        stream: &GpuStream,
        (dst, dst_pitch): (u64, usize),
        (src, src_pitch): (u64, usize),
        width: usize,
        rows: usize,
    ) -> Result<()> {
        if width == 0 || rows == 0 {
            return Ok(());
        }
        // Contiguous rows are one plain copy: the 2D copy is for strided rows.
        if rows == 1 || (src_pitch == width && dst_pitch == width) {
            let bytes = width.checked_mul(rows).ok_or_else(|| {
                Error::InvalidArgument(format!("copy_d2d_rows: {rows} rows of {width} bytes"))
            })?;
            return self.copy_d2d(stream, dst, src, bytes);
        }
        self.bind()?;
        let t = activity::begin();
        let copy = sys::CUDA_MEMCPY2D {
            srcXInBytes: 0,
            srcY: 0,
            srcMemoryType: sys::CUmemorytype::CU_MEMORYTYPE_DEVICE,
            srcHost: std::ptr::null(),
            srcDevice: src,
            srcArray: std::ptr::null_mut(),
            srcPitch: src_pitch,
            dstXInBytes: 0,
            dstY: 0,
            dstMemoryType: sys::CUmemorytype::CU_MEMORYTYPE_DEVICE,
            dstHost: std::ptr::null_mut(),
            dstDevice: dst,
            dstArray: std::ptr::null_mut(),
            dstPitch: dst_pitch,
            WidthInBytes: width,
            Height: rows,
        };
        // SAFETY: the caller guarantees both strided ranges lie in live device allocations;
        // `copy` outlives the call, which reads it before returning.
        let r = unsafe { sys::cuMemcpy2DAsync_v2(&copy, stream.cu_stream()).result() };
        self.check("cuMemcpy2DAsync", r)?;
        let bytes = width.saturating_mul(rows) as u64;
        activity::end(t, ActivityKind::D2D, stream.cu_stream() as u64, bytes);
        Ok(())
    }

    /// Copies raw bytes host→device or device→host on `stream` without synchronising.
    ///
    /// # Safety
    /// `host` must stay valid and untouched until the stream has passed this copy, and
    /// `dev` must cover `bytes`.
    pub(crate) unsafe fn copy_raw_async(
        &self,
        stream: &GpuStream,
        to_device: bool,
        host: *mut u8,
        dev: u64,
        bytes: usize,
    ) -> Result<()> {
        self.bind()?;
        let s = stream.cu_stream();
        let t = activity::begin();
        // SAFETY: forwarded from this function's contract.
        let r = unsafe {
            if to_device {
                sys::cuMemcpyHtoDAsync_v2(dev, host as *const c_void, bytes, s).result()
            } else {
                sys::cuMemcpyDtoHAsync_v2(host as *mut c_void, dev, bytes, s).result()
            }
        };
        self.check("cuMemcpyAsync", r)?;
        // Each DMA of a staged copy is reported, so traces and byte counters see the fast
        // path as they see the driver's copies.
        let kind = if to_device {
            ActivityKind::H2D
        } else {
            ActivityKind::D2H
        };
        activity::end(t, kind, s as u64, bytes as u64);
        Ok(())
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

/// A CUDA stream-ordered memory pool (`cuMemPoolCreate`), destroyed on drop (the driver
/// releases its memory once every allocation from it has been freed).
pub(crate) struct AsyncMemPool {
    pub(super) device: CudaDevice,
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
    pub(crate) fn alloc(&self, stream: &GpuStream, bytes: usize) -> Result<u64> {
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
    pub(crate) unsafe fn free(&self, ptr: u64, stream: &GpuStream) -> Result<()> {
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
