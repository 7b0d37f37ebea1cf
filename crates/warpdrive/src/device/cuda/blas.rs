//! cuBLAS: the per-device handle and GEMMs.

use std::ffi::{c_int, c_void};
use std::sync::Arc;

use parking_lot::Mutex;

use crate::error::{Error, Result};

use super::context::{no_alloc_in_capture, CudaDevice, Inner};
use super::exit::{at_exit, release_at_exit};
use super::libraries::libraries;
use super::stream::GpuStream;

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
    /// `c` is f32 whatever `dtype` (16-bit inputs: the f32 accumulators unrounded, as a MoE
    /// router's logits need); [`CudaDevice::gemm`] only, not the grouped call.
    pub f32_out: bool,
    pub batch: usize,
    pub a: u64,
    pub b: u64,
    pub c: u64,
    pub stride_a: usize,
    pub stride_b: usize,
    pub stride_c: usize,
}

pub(super) struct BlasHandle(cudarc::cublas::sys::cublasHandle_t);

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

impl CudaDevice {
    // ---- cuBLAS ----

    /// Runs `body` with this device's cuBLAS handle bound to `stream`.
    pub(crate) fn with_blas<R>(
        &self,
        stream: &GpuStream,
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
    pub(crate) fn prepare_blas(&self, stream: &GpuStream) -> Result<()> {
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
    /// of m·k, k·n and m·n elements of `dtype` (`c` of f32 with `f32_out`) at the given
    /// strides, and `c` must not overlap `a` or `b`.
    pub(crate) unsafe fn gemm(&self, stream: &GpuStream, calls: &[GemmCall]) -> Result<()> {
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
                let c_ty = if call.f32_out {
                    cudaDataType::CUDA_R_32F
                } else {
                    ty
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
                            c_ty,
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
                            c_ty,
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
        stream: &GpuStream,
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
        if calls.iter().any(|c| {
            c.dtype != first.dtype || c.batch > 1 || c.tf32 || c.f32_out || c.trans_a || !c.trans_b
        }) {
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
