//! cuBLASLt: a GEMM with its epilogue (bias, and GELU) inside the GEMM kernel, where cuBLASLt
//! has one.

use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::Arc;

use cudarc::cublaslt::{result, sys};
use parking_lot::Mutex;

use crate::error::{Error, Result};

use super::context::{no_alloc_in_capture, CudaDevice, Inner};
use super::exit::{at_exit, release_at_exit};
use super::libraries::libraries;
use super::stream::GpuStream;

/// One row-major bf16 or f16 GEMM with a bias epilogue for [`CudaDevice::gemm_bias`]:
/// `d = act(a · b + bias)`, `a` m×k, `b` k×n, `bias` one per column of `d` (n), `d` m×n, all
/// of `dtype`; `act` GELU (tanh approximation, cuBLASLt's) when `gelu`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct BiasGemm {
    pub dtype: crate::dtype::DTypeKind,
    pub m: usize,
    pub n: usize,
    pub k: usize,
    pub gelu: bool,
    pub a: u64,
    pub b: u64,
    pub bias: u64,
    pub d: u64,
    /// Scratch for cuBLASLt on this call's stream (0 for none) and its size in bytes: with
    /// one, the heuristic may choose split-K and larger-tile kernels (torch gives 32 MiB on
    /// Hopper).
    pub workspace: u64,
    pub workspace_bytes: usize,
}

/// What the heuristic's choice depends on: the problem, the workspace it may use and how
/// the pointers are aligned (capped at 256 bytes).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
struct AlgoKey {
    ty: u32,
    m: u64,
    n: u64,
    k: u64,
    gelu: bool,
    workspace_bytes: usize,
    align: [u32; 5],
}

/// A device's cuBLASLt handle, kept for the process (made once, not per call), and the
/// algorithm the heuristic chose for each problem, so a repeated GEMM skips the query.
pub(crate) struct LtState {
    handle: sys::cublasLtHandle_t,
    algos: HashMap<AlgoKey, sys::cublasLtMatmulAlgo_t>,
}

// SAFETY: a cuBLASLt handle may be used from any thread; it lives behind the device's mutex,
// which serialises every use.
unsafe impl Send for LtState {}

impl Drop for LtState {
    fn drop(&mut self) {
        // SAFETY: the handle came from `create_handle` and is destroyed exactly once, here.
        if let Err(e) = unsafe { result::destroy_handle(self.handle) } {
            tracing::warn!("cublasLtDestroy failed: {e:?}");
        }
    }
}

/// Devices holding a cuBLASLt handle, for [`release_lt_handles`].
static LT_OWNERS: Mutex<Vec<std::sync::Weak<Inner>>> = Mutex::new(Vec::new());

/// Destroys every device's cuBLASLt handle (an exit hook under `RELEASE_AT_EXIT`).
fn release_lt_handles() {
    // Taken first: a handle's lock is never waited for while holding this list's.
    let owners = std::mem::take(&mut *LT_OWNERS.lock());
    for owner in owners {
        if let Some(inner) = owner.upgrade() {
            drop(inner.blaslt.lock().take());
        }
    }
}

fn lt_error(call: &'static str) -> impl Fn(result::CublasError) -> Error {
    move |e| Error::Blas {
        call,
        message: format!("{e:?}"),
    }
}

/// The cuBLASLt objects of one call, destroyed however the call ends.
struct Objects {
    desc: Option<sys::cublasLtMatmulDesc_t>,
    layouts: Vec<sys::cublasLtMatrixLayout_t>,
    pref: Option<sys::cublasLtMatmulPreference_t>,
}

impl Drop for Objects {
    fn drop(&mut self) {
        // SAFETY: each object was created by cuBLASLt in `gemm_bias` and is destroyed once,
        // here, after the matmul call that used it was enqueued (cuBLASLt copies what it needs).
        unsafe {
            if let Some(p) = self.pref.take() {
                let _ = result::destroy_matmul_pref(p);
            }
            for l in self.layouts.drain(..) {
                let _ = result::destroy_matrix_layout(l);
            }
            if let Some(d) = self.desc.take() {
                let _ = result::destroy_matmul_desc(d);
            }
        }
    }
}

impl CudaDevice {
    /// `d = act(a · b + bias)` as one cuBLASLt matmul with its bias (+ GELU) epilogue. The
    /// device's handle is made on first use and kept; the descriptors are made for the call
    /// (cuBLASLt's are light); the heuristic's algorithm is kept per problem; the workspace
    /// is the caller's. Inside a graph capture only once the handle exists (a call before the
    /// capture makes it), as with cuBLAS.
    ///
    /// # Safety
    /// `a`, `b`, `bias` and `d` must be live device allocations of m·k, k·n, n and m·n
    /// elements of `call.dtype`, and `d` must not overlap the others; `call.workspace`, when
    /// not 0, a live allocation of `call.workspace_bytes` used by nothing else until this
    /// call's work on `stream` is done.
    pub(crate) unsafe fn gemm_bias(&self, stream: &GpuStream, call: &BiasGemm) -> Result<()> {
        use crate::dtype::DTypeKind;
        if !libraries().cublaslt {
            return Err(Error::LibraryMissing {
                library: "cuBLASLt",
                hint: "libcublasLt.so.13 not found on the library path".into(),
            });
        }
        let ty = match call.dtype {
            DTypeKind::BF16 => sys::cudaDataType::CUDA_R_16BF,
            DTypeKind::F16 => sys::cudaDataType::CUDA_R_16F,
            other => {
                return Err(Error::Unsupported(format!(
                    "a cuBLASLt bias epilogue on {}",
                    other.name()
                )))
            }
        };
        let dim = |v: usize| {
            u64::try_from(v)
                .ok()
                .filter(|&v| v <= i32::MAX as u64)
                .ok_or_else(|| Error::InvalidArgument(format!("GEMM dimension {v} exceeds i32")))
        };
        let (m, n, k) = (dim(call.m)?, dim(call.n)?, dim(call.k)?);
        self.bind()?;
        let mut guard = self.inner.blaslt.lock();
        if guard.is_none() {
            no_alloc_in_capture("cublasLtCreate")?;
            let handle = result::create_handle().map_err(lt_error("cublasLtCreate"))?;
            *guard = Some(LtState {
                handle,
                algos: HashMap::new(),
            });
            if release_at_exit() {
                LT_OWNERS.lock().push(Arc::downgrade(&self.inner));
                at_exit(release_lt_handles);
            }
        }
        let Some(state) = guard.as_mut() else {
            return Err(Error::Blas {
                call: "cublasLtCreate",
                message: "no handle".into(),
            });
        };
        let handle = state.handle;
        let (workspace_ptr, workspace) = if call.workspace == 0 {
            (0u64, 0usize)
        } else {
            (call.workspace, call.workspace_bytes)
        };
        let align = |p: u64| {
            if p == 0 {
                256
            } else {
                1u32 << p.trailing_zeros().min(8)
            }
        };
        let key = AlgoKey {
            ty: ty as u32,
            m,
            n,
            k,
            gelu: call.gelu,
            workspace_bytes: workspace,
            align: [
                align(call.a),
                align(call.b),
                align(call.bias),
                align(call.d),
                align(workspace_ptr),
            ],
        };
        let mut o = Objects {
            desc: None,
            layouts: Vec::new(),
            pref: None,
        };
        let desc = result::create_matmul_desc(
            sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
            sys::cudaDataType::CUDA_R_32F,
        )
        .map_err(lt_error("cublasLtMatmulDescCreate"))?;
        o.desc = Some(desc);
        let epilogue = if call.gelu {
            sys::cublasLtEpilogue_t::CUBLASLT_EPILOGUE_GELU_BIAS
        } else {
            sys::cublasLtEpilogue_t::CUBLASLT_EPILOGUE_BIAS
        };
        let bias_ptr = call.bias;
        // SAFETY: `desc` is live; each value is read during the call from a local of the
        // attribute's type and size.
        unsafe {
            result::set_matmul_desc_attribute(
                desc,
                sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_EPILOGUE,
                &epilogue as *const _ as *const c_void,
                std::mem::size_of_val(&epilogue),
            )
            .map_err(lt_error("cublasLtMatmulDescSetAttribute(EPILOGUE)"))?;
            result::set_matmul_desc_attribute(
                desc,
                sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_BIAS_POINTER,
                &bias_ptr as *const u64 as *const c_void,
                std::mem::size_of::<u64>(),
            )
            .map_err(lt_error("cublasLtMatmulDescSetAttribute(BIAS_POINTER)"))?;
        }
        // Row-major d = a·b is column-major dᵀ (n×m) = bᵀ (n×k) · aᵀ (k×m): cuBLASLt's A is our
        // b (n×k, ld n), its B our a (k×m, ld k), its D our d (n×m, ld n); the bias has one
        // entry per row of its D, n: one per column of ours.
        for (rows, cols, ld) in [(n, k, n), (k, m, k), (n, m, n)] {
            let l = result::create_matrix_layout(ty, rows, cols, ld as i64)
                .map_err(lt_error("cublasLtMatrixLayoutCreate"))?;
            o.layouts.push(l);
        }
        let (la, lb, ld) = (o.layouts[0], o.layouts[1], o.layouts[2]);
        let algo = match state.algos.get(&key) {
            Some(a) => *a,
            None => {
                let pref = result::create_matmul_pref()
                    .map_err(lt_error("cublasLtMatmulPreferenceCreate"))?;
                o.pref = Some(pref);
                // SAFETY: `pref` is live; the value is a local usize.
                unsafe {
                    result::set_matmul_pref_attribute(
                        pref,
                        sys::cublasLtMatmulPreferenceAttributes_t::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                        &workspace as *const usize as *const c_void,
                        std::mem::size_of::<usize>(),
                    )
                    .map_err(lt_error("cublasLtMatmulPreferenceSetAttribute"))?;
                }
                // SAFETY: every descriptor is live (held by `o`).
                let heuristic = unsafe {
                    result::get_matmul_algo_heuristic(handle, desc, la, lb, ld, ld, pref)
                }
                .map_err(lt_error("cublasLtMatmulAlgoGetHeuristic"))?;
                state.algos.insert(key, heuristic.algo);
                heuristic.algo
            }
        };
        let (alpha, beta) = (1.0f32, 0.0f32);
        // SAFETY: the caller guarantees the four allocations and their sizes, which match the
        // layouts, and the workspace; beta is 0, so C (given as D) is not read; alpha and beta
        // are f32 locals (the scale type); the stream is this device's, whose context is
        // bound; the handle is used under the device's lock.
        let r = unsafe {
            result::matmul(
                handle,
                desc,
                &alpha as *const f32 as *const c_void,
                &beta as *const f32 as *const c_void,
                call.b as *const c_void,
                la,
                call.a as *const c_void,
                lb,
                call.d as *const c_void,
                ld,
                call.d as *mut c_void,
                ld,
                &algo,
                workspace_ptr as *mut c_void,
                workspace,
                stream.cu_stream() as sys::cudaStream_t,
            )
        }
        .map_err(lt_error("cublasLtMatmul"));
        drop(o);
        r
    }
}
