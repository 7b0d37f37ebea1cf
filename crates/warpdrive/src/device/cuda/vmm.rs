//! Peer-mapped memory through CUDA's virtual memory management: physical memory on one GPU
//! mapped read-write for every GPU named, so kernels on any of them load and store it
//! directly (device-initiated puts and signals between GPUs).

use std::ffi::c_int;

use cudarc::driver::sys::{self, CUdevice_attribute as Attr};

use crate::error::{Error, Result};

use super::context::{no_alloc_in_capture, CudaDevice};

/// One VMM allocation: created on its owner, reserved, mapped and opened to each reaching
/// GPU; unmapped, released and its address range freed on drop.
pub(crate) struct PeerMappedAlloc {
    owner: CudaDevice,
    ptr: u64,
    size: usize,
    handle: sys::CUmemGenericAllocationHandle,
    /// Whether `cuMemMap` succeeded (Drop unmaps only then).
    mapped: bool,
}

impl std::fmt::Debug for PeerMappedAlloc {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "PeerMappedAlloc[{} bytes on {:?}]",
            self.size, self.owner
        )
    }
}

fn device_location(d: &CudaDevice) -> sys::CUmemLocation {
    sys::CUmemLocation {
        type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
        id: d.ordinal() as c_int,
    }
}

impl PeerMappedAlloc {
    /// At least `bytes` (> 0, rounded up to the allocation granularity, zeroed) on `owner`,
    /// mapped for `owner` and every device of `reach`. A device that cannot reach the owner's
    /// memory (no peer access) or a GPU without virtual memory management is `Unsupported`.
    pub(crate) fn new(owner: &CudaDevice, bytes: usize, reach: &[CudaDevice]) -> Result<Self> {
        if bytes == 0 {
            return Err(Error::InvalidArgument(
                "a peer-mapped allocation of 0 bytes".into(),
            ));
        }
        for d in std::iter::once(owner).chain(reach) {
            if d.attribute(Attr::CU_DEVICE_ATTRIBUTE_VIRTUAL_ADDRESS_MANAGEMENT_SUPPORTED)? == 0 {
                return Err(Error::Unsupported(format!(
                    "peer-mapped memory: cuda:{} has no virtual memory management",
                    d.ordinal()
                )));
            }
            if d != owner && !d.can_access_peer(owner)? {
                return Err(Error::Unsupported(format!(
                    "peer-mapped memory: cuda:{} cannot reach cuda:{}'s memory (no peer access)",
                    d.ordinal(),
                    owner.ordinal()
                )));
            }
        }
        no_alloc_in_capture("cuMemCreate")?;
        owner.bind()?;
        // SAFETY: an all-zero CUmemAllocationProp is the documented "no extra flags" value;
        // the fields that matter are set below.
        let mut prop: sys::CUmemAllocationProp = unsafe { std::mem::zeroed() };
        prop.type_ = sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
        prop.requestedHandleTypes = sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_NONE;
        prop.location = device_location(owner);
        let mut gran = 0usize;
        // SAFETY: `prop` and `gran` are valid locals for the call.
        let r = unsafe {
            sys::cuMemGetAllocationGranularity(
                &mut gran,
                &prop,
                sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_MINIMUM,
            )
        }
        .result();
        owner.check("cuMemGetAllocationGranularity", r)?;
        let gran = gran.max(1);
        let size = bytes
            .div_ceil(gran)
            .checked_mul(gran)
            .ok_or_else(|| Error::InvalidArgument(format!("{bytes} peer-mapped bytes")))?;
        let mut handle: sys::CUmemGenericAllocationHandle = 0;
        // SAFETY: `prop` describes pinned device memory on the owner; `handle` is a local.
        match unsafe { sys::cuMemCreate(&mut handle, size, &prop, 0) }.result() {
            Ok(()) => {}
            Err(e) if e.0 == sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY => {
                return Err(owner.oom(size, "cuMemCreate refused"));
            }
            Err(e) => return owner.check("cuMemCreate", Err(e)),
        }
        // From here on the value owns the handle: Drop releases whatever was set up.
        let mut alloc = PeerMappedAlloc {
            owner: owner.clone(),
            ptr: 0,
            size,
            handle,
            mapped: false,
        };
        let mut ptr: sys::CUdeviceptr = 0;
        // SAFETY: `ptr` is a local; a range of `size` aligned to the granularity.
        let r = unsafe { sys::cuMemAddressReserve(&mut ptr, size, gran, 0, 0) }.result();
        owner.check("cuMemAddressReserve", r)?;
        alloc.ptr = ptr;
        // SAFETY: the range was just reserved with `size` bytes; the handle holds `size`.
        let r = unsafe { sys::cuMemMap(ptr, size, 0, handle, 0) }.result();
        owner.check("cuMemMap", r)?;
        alloc.mapped = true;
        let mut descs = vec![sys::CUmemAccessDesc {
            location: device_location(owner),
            flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
        }];
        for d in reach.iter().filter(|d| *d != owner) {
            descs.push(sys::CUmemAccessDesc {
                location: device_location(d),
                flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
            });
        }
        // SAFETY: the range is mapped; `descs` outlives the call.
        let r = unsafe { sys::cuMemSetAccess(ptr, size, descs.as_ptr(), descs.len()) }.result();
        owner.check("cuMemSetAccess", r)?;
        // SAFETY: the whole range is mapped read-write for the owner; a synchronous memset
        // (the null stream) so the memory is zero before anyone else sees the address.
        let r = unsafe { sys::cuMemsetD8_v2(ptr, 0, size) }.result();
        owner.check("cuMemsetD8", r)?;
        Ok(alloc)
    }

    /// The mapped range's first address (the same on every reaching GPU).
    pub(crate) fn device_ptr(&self) -> u64 {
        self.ptr
    }

    /// Bytes mapped (the request rounded up to the granularity).
    pub(crate) fn size(&self) -> usize {
        self.size
    }
}

impl Drop for PeerMappedAlloc {
    fn drop(&mut self) {
        if let Err(e) = self.owner.bind() {
            tracing::warn!("peer-mapped memory not freed (binding its GPU failed): {e}");
            return;
        }
        let warn = |call: &str, r: std::result::Result<(), cudarc::driver::DriverError>| {
            if let Err(e) = r {
                tracing::warn!("{call} of peer-mapped memory failed: {e:?}");
            }
        };
        if self.mapped {
            // SAFETY: the range was mapped by `new`; the users' streams are done with it
            // (the owning type waits for them before dropping this).
            warn(
                "cuMemUnmap",
                unsafe { sys::cuMemUnmap(self.ptr, self.size) }.result(),
            );
        }
        if self.ptr != 0 {
            // SAFETY: the range was reserved by `new` with this size and is no longer mapped.
            warn(
                "cuMemAddressFree",
                unsafe { sys::cuMemAddressFree(self.ptr, self.size) }.result(),
            );
        }
        // SAFETY: the handle came from cuMemCreate and no mapping uses it any more.
        warn(
            "cuMemRelease",
            unsafe { sys::cuMemRelease(self.handle) }.result(),
        );
    }
}
