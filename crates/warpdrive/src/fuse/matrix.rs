//! MatrixOps: a GEMM with its epilogue fused, `out = act(a · b + bias) + residual`.
//!
//! Where cuBLASLt has the epilogue (a bias, with GELU in its tanh form or none, no residual,
//! bf16 or f16), the whole thing is one cuBLASLt matmul: the epilogue runs inside the GEMM
//! kernel on its f32 accumulators (a shape cuBLASLt finds no algorithm for takes the other
//! way). With a residual as well, cuBLASLt's GEMM adds the bias and one generated kernel
//! applies the activation and adds the residual. Otherwise the GEMM (cuBLAS) writes the
//! product once and
//! one generated kernel applies the whole epilogue (bias, activation, residual, cast) in a
//! single read and write. The CPU backend computes the product (f32 accumulation) and the
//! epilogue in f64.

use crate::device::{BiasGemm, Stream};
use crate::dtype::{DTypeKind, Float};
use crate::error::{Error, Result};
use crate::memory::{check_len, Buffer};
use crate::ops::{gemm, Activation};

use super::codegen::Schedule;
use super::expr::Expr;

/// The workspace cuBLASLt may use for one GEMM: what torch gives it on Hopper (32 MiB), which
/// lets its heuristic choose the kernels it chooses there (no workspace rules out split-K and
/// some larger-tile kernels).
const LT_WORKSPACE_BYTES: usize = 32 << 20;

/// What follows the product in [`matmul_epilogue`].
#[derive(Debug, Clone, Copy)]
pub struct Epilogue<'a, T: Float> {
    /// One value per column of the product (n), added to every row.
    pub bias: Option<&'a Buffer<T>>,
    pub act: Activation,
    /// An m×n matrix added after the activation.
    pub residual: Option<&'a Buffer<T>>,
}

impl<'a, T: Float> Epilogue<'a, T> {
    /// `act(x + bias)`.
    pub fn bias(bias: &'a Buffer<T>, act: Activation) -> Epilogue<'a, T> {
        Epilogue {
            bias: Some(bias),
            act,
            residual: None,
        }
    }

    /// This epilogue with `residual` added last.
    pub fn with_residual(self, residual: &'a Buffer<T>) -> Epilogue<'a, T> {
        Epilogue {
            residual: Some(residual),
            ..self
        }
    }

    /// Whether cuBLASLt runs this epilogue inside the GEMM.
    pub fn in_cublaslt(&self) -> bool {
        self.bias.is_some()
            && self.residual.is_none()
            && matches!(self.act, Activation::None | Activation::GeluTanh)
            && matches!(T::KIND, DTypeKind::BF16 | DTypeKind::F16)
    }
}

/// How [`matmul_epilogue_with`] runs an epilogue that takes a kernel after the GEMM: which
/// GEMM, and how that kernel follows it. The default is [`matmul_epilogue`]'s path.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EpiloguePlan {
    /// cuBLAS's plain GEMM (torch's) and the whole epilogue, bias included, in the generated
    /// kernel, even where cuBLASLt could run part of it inside the GEMM.
    pub plain_gemm: bool,
    /// The generated epilogue kernel's schedule after the GEMM (chunk order, a programmatic
    /// dependent launch).
    pub schedule: Schedule,
}

impl Default for EpiloguePlan {
    /// cuBLASLt's GEMM, then the epilogue kernel as a programmatic dependent launch over the
    /// product's chunks in reverse: the fastest plan in four H100 runs of the residual case
    /// (2-12 µs under the in-order launch at 4096³; bench/NOTES.md).
    fn default() -> Self {
        EpiloguePlan {
            plain_gemm: false,
            schedule: Schedule {
                reverse: true,
                programmatic: true,
                prefetch: false,
            },
        }
    }
}

/// `out = act(a · b + bias) + residual` for row-major `a` (m×k), `b` (k×n), `out` (m×n), with
/// `mnk = (m, n, k)`: one cuBLASLt matmul where [`Epilogue::in_cublaslt`], else the GEMM and
/// one fused epilogue kernel (the product in a buffer of the pool). f32, f16, bf16 (cuBLASLt
/// for the 16-bit types).
pub fn matmul_epilogue<T: Float>(
    stream: &Stream,
    a: &Buffer<T>,
    b: &Buffer<T>,
    mnk: (usize, usize, usize),
    epilogue: &Epilogue<'_, T>,
    out: &mut Buffer<T>,
) -> Result<()> {
    matmul_epilogue_with(stream, a, b, mnk, epilogue, out, EpiloguePlan::default())
}

/// [`matmul_epilogue`] as `plan` says (the same result: the CPU backend computes it alike in
/// every plan).
pub fn matmul_epilogue_with<T: Float>(
    stream: &Stream,
    a: &Buffer<T>,
    b: &Buffer<T>,
    (m, n, k): (usize, usize, usize),
    epilogue: &Epilogue<'_, T>,
    out: &mut Buffer<T>,
    plan: EpiloguePlan,
) -> Result<()> {
    let size = |what: &str, x: usize, y: usize| {
        x.checked_mul(y).ok_or_else(|| {
            Error::InvalidArgument(format!("matmul_epilogue: {what} {x}×{y} overflows"))
        })
    };
    let (mk, kn, mn) = (size("a", m, k)?, size("b", k, n)?, size("out", m, n)?);
    a.check_stream(stream, "matmul_epilogue")?;
    b.check_stream(stream, "matmul_epilogue")?;
    out.check_stream(stream, "matmul_epilogue")?;
    check_len("matmul_epilogue (a)", a.len(), mk)?;
    check_len("matmul_epilogue (b)", b.len(), kn)?;
    check_len("matmul_epilogue (out)", out.len(), mn)?;
    if let Some(bias) = epilogue.bias {
        bias.check_stream(stream, "matmul_epilogue")?;
        check_len("matmul_epilogue (bias)", bias.len(), n)?;
    }
    if let Some(r) = epilogue.residual {
        r.check_stream(stream, "matmul_epilogue")?;
        check_len("matmul_epilogue (residual)", r.len(), mn)?;
    }
    if mn == 0 {
        return Ok(());
    }
    // cuBLASLt is not asked for an empty product (k = 0): the epilogue of zeros.
    let sched = plan.schedule;
    if plan.plain_gemm || !lt_head(epilogue) || k == 0 {
        return two_kernels(stream, a, b, (m, n, k), epilogue, out, sched);
    }
    stream.run(
        out,
        |out| two_kernels(stream, a, b, (m, n, k), epilogue, out, sched),
        |out, q| {
            let Some(residual) = epilogue.residual else {
                return match lt_gemm(stream, q, a, b, (m, n, k), epilogue, out) {
                    Err(e) if no_lt_algo(&e) => {
                        two_kernels(stream, a, b, (m, n, k), epilogue, out, sched)
                    }
                    r => r,
                };
            };
            // A residual: cuBLASLt's GEMM with only the bias inside it, then one kernel
            // applies the activation and adds the residual (same bytes as GELU inside the
            // GEMM and a kernel adding the residual, and measured faster: bench/NOTES.md).
            let bias_only = Epilogue {
                act: Activation::None,
                residual: None,
                ..*epilogue
            };
            let mut head = Buffer::<T>::uninit(stream, out.len())?;
            match lt_gemm(stream, q, a, b, (m, n, k), &bias_only, &mut head) {
                Err(e) if no_lt_algo(&e) => {
                    two_kernels(stream, a, b, (m, n, k), epilogue, out, sched)
                }
                Err(e) => Err(e),
                Ok(()) => (Expr::matrix(&head, m, n).activation(epilogue.act)
                    + Expr::matrix(residual, m, n))
                .eval_into_scheduled(stream, out, sched),
            }
        },
    )
}

/// Whether cuBLASLt can run the epilogue's bias and activation inside the GEMM (what
/// [`Epilogue::in_cublaslt`] asks, less the residual, which a kernel after it adds).
fn lt_head<T: Float>(epilogue: &Epilogue<'_, T>) -> bool {
    Epilogue {
        residual: None,
        ..*epilogue
    }
    .in_cublaslt()
}

/// cuBLASLt found no algorithm for the shape (odd leading dimensions, say): the caller takes
/// the GEMM and the generated epilogue instead.
fn no_lt_algo(e: &Error) -> bool {
    matches!(
        e,
        Error::Blas {
            call: "cublasLtMatmulAlgoGetHeuristic",
            ..
        }
    )
}

/// `out = act(a · b + bias)` as one cuBLASLt matmul (bias present, [`lt_head`]), k > 0.
fn lt_gemm<T: Float>(
    stream: &Stream,
    q: crate::device::Queue<'_>,
    a: &Buffer<T>,
    b: &Buffer<T>,
    (m, n, k): (usize, usize, usize),
    epilogue: &Epilogue<'_, T>,
    out: &mut Buffer<T>,
) -> Result<()> {
    // cuBLASLt's workspace, from the pool (a cached block, stream-ordered, so one stream's
    // GEMMs reuse it and no other stream's touch it until they are done); without the
    // memory, none.
    let workspace = Buffer::<u8>::uninit(stream, LT_WORKSPACE_BYTES).ok();
    let call = BiasGemm {
        dtype: T::KIND,
        m,
        n,
        k,
        gelu: epilogue.act == Activation::GeluTanh,
        a: a.device_ptr(),
        b: b.device_ptr(),
        bias: epilogue.bias.map_or(0, |b| b.device_ptr()),
        d: out.device_ptr(),
        workspace: workspace.as_ref().map_or(0, |w| w.device_ptr()),
        workspace_bytes: workspace.as_ref().map_or(0, |w| w.len()),
    };
    // SAFETY: a, b, bias and out are live buffers of m·k, k·n, n and m·n elements of T
    // (checked by the caller; bias is present: lt_head), and `out` is borrowed mutably, so
    // it overlaps none of them; the workspace is this call's, on its stream.
    unsafe { q.gpu.gemm_bias(q.stream, &call) }
}

/// The GEMM into a pooled buffer, then the epilogue as one generated kernel in `schedule`.
fn two_kernels<T: Float>(
    stream: &Stream,
    a: &Buffer<T>,
    b: &Buffer<T>,
    (m, n, k): (usize, usize, usize),
    epilogue: &Epilogue<'_, T>,
    out: &mut Buffer<T>,
    schedule: Schedule,
) -> Result<()> {
    let mut product = Buffer::<T>::uninit(stream, out.len())?;
    gemm::matmul(stream, a, b, &mut product, (m, n, k))?;
    let mut e = Expr::matrix(&product, m, n);
    if let Some(bias) = epilogue.bias {
        e = e + Expr::input(bias);
    }
    e = e.activation(epilogue.act);
    if let Some(r) = epilogue.residual {
        e = e + Expr::matrix(r, m, n);
    }
    e.eval_into_scheduled(stream, out, schedule)
}
