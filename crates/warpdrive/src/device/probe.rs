//! Probes of what the driver itself costs, for the benchmarks that compare warpdrive with
//! it: an allocation + free pair straight from the backend's allocator, CUDA's own
//! stream-ordered pool, and reference launches ([`ReferenceLaunches`]). Safe wrappers, so
//! the benchmark crate needs no `unsafe`; not meant for anything but measuring.

use crate::error::{Error, Result};

use super::cuda::AsyncMemPool;
use super::{Device, Stream};

pub use super::cuda::ReferenceLaunches;

/// One allocate + free pair of `bytes` (at least 1) straight from `device`'s allocator, no
/// pool: `cuMemAlloc` + `cuMemFree` on CUDA, the host allocator on the CPU backend.
pub fn alloc_free_pair(device: &Device, bytes: usize) -> Result<()> {
    match device {
        Device::Cuda(d) => d.alloc_free_pair(bytes),
        Device::Cpu => {
            let bytes = bytes.max(1);
            let p = device.alloc_raw(bytes)?;
            device.free_raw(p, bytes)
        }
    }
}

/// One allocate + free pair of `bytes` (at least 1) of page-locked host memory straight from
/// the driver, no pool: `cuMemHostAlloc` (flags 0) + `cuMemFreeHost` on CUDA, the host
/// allocator on the CPU backend.
pub fn pinned_alloc_free_pair(device: &Device, bytes: usize) -> Result<()> {
    match device {
        Device::Cuda(d) => d.host_alloc_free_pair(bytes),
        Device::Cpu => {
            let bytes = bytes.max(1);
            let p = device.alloc_pinned_raw(bytes, None)?;
            device.free_pinned_raw(p, bytes, None)
        }
    }
}

/// CUDA's own stream-ordered memory pool (`cuMemPoolCreate`, its release threshold at the
/// maximum so freed memory stays cached), for measuring what warpdrive's pools save.
pub struct DriverPool {
    pool: AsyncMemPool,
}

impl DriverPool {
    /// A new pool on `device`. CUDA only (`Error::Unsupported` on the CPU backend).
    pub fn new(device: &Device) -> Result<DriverPool> {
        match device {
            Device::Cuda(d) => Ok(DriverPool {
                pool: d.new_async_pool()?,
            }),
            Device::Cpu => Err(Error::Unsupported(
                "CUDA's stream-ordered pool needs a CUDA device".into(),
            )),
        }
    }

    /// One `cuMemAllocFromPoolAsync` + `cuMemFreeAsync` pair of `bytes` (at least 1) on
    /// `stream`, which must be on the pool's device; the memory is never used.
    pub fn alloc_free_pair(&self, stream: &Stream, bytes: usize) -> Result<()> {
        self.pool.alloc_free_pair(stream, bytes)
    }
}
