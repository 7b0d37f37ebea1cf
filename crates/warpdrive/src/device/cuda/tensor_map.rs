//! TMA tensor maps: the driver's `cuTensorMapEncodeTiled` for 16-bit float tensors whose boxes
//! land in shared memory in the 128-byte swizzle (the layout the wgmma tiles read), encoded
//! on the host into plain words that a caller copies into device memory once (kernels read
//! the map through a pointer, so launches and graph captures stay as they are).

use cudarc::driver::sys;

use crate::dtype::DTypeKind;
use crate::error::{Error, Result};

use super::context::CudaDevice;

/// An encoded `CUtensorMap` (128 bytes): copy it to a 64-byte-aligned address of device
/// memory before a kernel uses it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct TensorMap(pub [u64; 16]);

/// A tiled map over a row-major tensor of F16 or BF16 elements at `address`: `dims`
/// innermost first (rank 2 to 5), `strides` the bytes between consecutive indices of each
/// outer dimension (rank - 1 values), `boxed` the box loaded per copy (innermost at most 64
/// elements: one 128-byte swizzle row). Elements outside the tensor read as zero.
#[derive(Debug, Clone, Copy)]
pub(crate) struct TiledMap<'a> {
    pub(crate) dtype: DTypeKind,
    pub(crate) address: u64,
    pub(crate) dims: &'a [u64],
    pub(crate) strides: &'a [u64],
    pub(crate) boxed: &'a [u32],
}

impl TiledMap<'_> {
    fn invalid(&self, why: &str) -> Error {
        Error::InvalidArgument(format!(
            "tensor map over {} at {:#x}, dims {:?}, strides {:?}, box {:?}: {why}",
            self.dtype.name(),
            self.address,
            self.dims,
            self.strides,
            self.boxed
        ))
    }

    /// The driver's limits (CUDA driver API, cuTensorMapEncodeTiled), checked here so a bad
    /// shape is an error that names it rather than the driver's bare CUDA_ERROR_INVALID_VALUE.
    fn check(&self) -> Result<sys::CUtensorMapDataType> {
        let dtype = match self.dtype {
            DTypeKind::F16 => sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_FLOAT16,
            DTypeKind::BF16 => sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
            other => {
                return Err(Error::Unsupported(format!(
                    "a swizzled tensor map of {}",
                    other.name()
                )))
            }
        };
        let rank = self.dims.len();
        if !(2..=5).contains(&rank) {
            return Err(self.invalid("rank must be 2 to 5"));
        }
        if self.strides.len() != rank - 1 || self.boxed.len() != rank {
            return Err(self.invalid("rank - 1 strides and rank box sizes expected"));
        }
        if self.address == 0 || self.address % 16 != 0 {
            return Err(self.invalid("the address must be non-null and 16-byte aligned"));
        }
        if self.dims.iter().any(|&d| d == 0 || d > 1 << 32) {
            return Err(self.invalid("each dimension must be 1 to 2^32"));
        }
        if self
            .strides
            .iter()
            .any(|&s| s == 0 || s % 16 != 0 || s >= 1 << 40)
        {
            return Err(self.invalid("each stride must be a non-zero multiple of 16 below 2^40"));
        }
        if self.boxed.iter().any(|&b| b == 0 || b > 256) {
            return Err(self.invalid("each box size must be 1 to 256"));
        }
        if self.boxed[0] > 64 {
            return Err(self.invalid("the 128-byte swizzle takes at most 64 elements innermost"));
        }
        Ok(dtype)
    }
}

impl CudaDevice {
    /// Encodes `map` (see [`TiledMap`]) with the 128-byte swizzle, zero fill outside the
    /// tensor and 256-byte L2 promotion. Only encodes: nothing is read at `map.address`.
    pub(crate) fn encode_tiled_map(&self, map: &TiledMap<'_>) -> Result<TensorMap> {
        let dtype = map.check()?;
        let rank = map.dims.len();
        let elem_strides = [1u32; 5];
        let mut out = sys::CUtensorMap { opaque: [0; 16] };
        // SAFETY: `out` is a local CUtensorMap the driver writes; dims, strides, box and
        // element strides point at rank, rank - 1, rank and rank valid values (checked above
        // against the driver's limits); the address is only encoded, never dereferenced here.
        let r = unsafe {
            sys::cuTensorMapEncodeTiled(
                &mut out,
                dtype,
                rank as u32,
                map.address as *mut std::ffi::c_void,
                map.dims.as_ptr(),
                map.strides.as_ptr(),
                map.boxed.as_ptr(),
                elem_strides.as_ptr(),
                sys::CUtensorMapInterleave::CU_TENSOR_MAP_INTERLEAVE_NONE,
                sys::CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_128B,
                sys::CUtensorMapL2promotion::CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                sys::CUtensorMapFloatOOBfill::CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
            )
        }
        .result();
        self.check("cuTensorMapEncodeTiled", r)?;
        Ok(TensorMap(out.opaque))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The limits are checked before the driver is called (no GPU needed): the MoE weight
    /// map's shape passes, each broken limit is an error naming the map.
    #[test]
    fn shapes_are_checked_before_the_driver() {
        let ok = TiledMap {
            dtype: DTypeKind::BF16,
            address: 0x7f00_0000_0000,
            dims: &[72, 80, 7],
            strides: &[144, 80 * 144],
            boxed: &[64, 128, 1],
        };
        assert!(ok.check().is_ok());
        let bad = [
            TiledMap {
                dtype: DTypeKind::F32,
                ..ok
            },
            TiledMap {
                address: 0x7f00_0000_0008,
                ..ok
            },
            TiledMap {
                strides: &[136, 80 * 136],
                ..ok
            },
            TiledMap {
                boxed: &[128, 128, 1],
                ..ok
            },
            TiledMap {
                boxed: &[64, 512, 1],
                ..ok
            },
            TiledMap {
                dims: &[72],
                strides: &[],
                boxed: &[64],
                ..ok
            },
            TiledMap {
                dims: &[72, 0, 7],
                ..ok
            },
            TiledMap {
                strides: &[144],
                ..ok
            },
        ];
        for m in bad {
            let e = m.check().unwrap_err().to_string();
            assert!(e.contains("tensor map"), "{e}");
        }
    }
}
