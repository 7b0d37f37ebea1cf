//! Matrix products, row-major: `c = op(a) · op(b)` with `op(a)` m×k, `op(b)` k×n and `c`
//! m×n, through cuBLAS (`cublasGemmEx`, `cublasGemmStridedBatchedEx`) on CUDA and the `gemm`
//! crate on the CPU backend. f32, f16 and bf16; 16-bit inputs accumulate in f32 on both
//! backends.
//!
//! - [`matmul`] / [`matmul_with`]: one product, with [`GemmOptions`] for transposed operands
//!   and opt-in TF32 for f32.
//! - [`matmul_batched`]: `batch` products of one shape over contiguous operands (one
//!   strided-batched cuBLAS call instead of `batch` calls).
//! - [`matmul_grouped`]: one product per group with a different row count `m` per group
//!   (counts known on the host): the rows of `a` and `c` are the groups' rows back to back,
//!   `b` holds one k×n matrix per group (a Mixture-of-Experts layer's experts).
//!
//! Shapes that do not match the buffers are `Error::InvalidArgument`; other element types
//! are `Error::Unsupported`.

use half::{bf16, f16};

use crate::device::{cpu, GemmCall, Stream};
use crate::dtype::{DType, DTypeKind};
use crate::error::{Error, Result};
use crate::memory::{host_filled, host_vec, Buffer};

/// How a GEMM reads its operands and computes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct GemmOptions {
    /// `a` is stored k×m (row-major) and used transposed.
    pub trans_a: bool,
    /// `b` is stored n×k (row-major) and used transposed.
    pub trans_b: bool,
    /// f32 only: let cuBLAS round the inputs to TF32 on the tensor cores (about 1e-3
    /// relative error, several times faster). Off by default; ignored for f16 and bf16
    /// (which use the tensor cores anyway) and on the CPU backend (which computes in f32).
    pub tf32: bool,
}

impl GemmOptions {
    /// `a` used transposed (`a` stored k×m).
    pub fn trans_a(mut self) -> Self {
        self.trans_a = true;
        self
    }

    /// `b` used transposed (`b` stored n×k).
    pub fn trans_b(mut self) -> Self {
        self.trans_b = true;
        self
    }

    /// TF32 math for f32 GEMMs.
    pub fn tf32(mut self) -> Self {
        self.tf32 = true;
        self
    }
}

fn elems(what: &str, dims: &[usize]) -> Result<usize> {
    crate::size::product(format_args!("matmul: {what} shape"), dims)
}

fn check_len<T: DType>(buf: &Buffer<T>, what: &str, dims: &[usize]) -> Result<()> {
    let need = elems(what, dims)?;
    if buf.len() != need {
        let shape: Vec<String> = dims.iter().map(|d| d.to_string()).collect();
        return Err(Error::InvalidArgument(format!(
            "matmul: {what} has {} elements, shape {} needs {need}",
            buf.len(),
            shape.join("x")
        )));
    }
    Ok(())
}

fn check_common<T: DType>(
    stream: &Stream,
    a: &Buffer<T>,
    b: &Buffer<T>,
    c: &Buffer<T>,
) -> Result<()> {
    for buf in [a.device(), b.device(), c.device()] {
        buf.same_as(stream.device(), "matmul")?;
    }
    if !matches!(T::KIND, DTypeKind::F32 | DTypeKind::F16 | DTypeKind::BF16) {
        return Err(Error::Unsupported(format!("matmul on {}", T::KIND.name())));
    }
    Ok(())
}

/// `c = a · b` for row-major `a` (m×k), `b` (k×n), `c` (m×n); f32, f16 or bf16 (accumulated
/// in f32).
pub fn matmul<T: DType>(
    stream: &Stream,
    a: &Buffer<T>,
    b: &Buffer<T>,
    c: &mut Buffer<T>,
    mnk: (usize, usize, usize),
) -> Result<()> {
    matmul_with(stream, a, b, c, mnk, GemmOptions::default())
}

/// `c = op(a) · op(b)` as [`matmul`], with transposes and TF32 as `opts` says.
pub fn matmul_with<T: DType>(
    stream: &Stream,
    a: &Buffer<T>,
    b: &Buffer<T>,
    c: &mut Buffer<T>,
    mnk: (usize, usize, usize),
    opts: GemmOptions,
) -> Result<()> {
    matmul_batched(stream, a, b, c, 1, mnk, opts)
}

/// `batch` products `c[i] = op(a[i]) · op(b[i])`, each operand `batch` matrices back to back
/// (`a` holds batch·m·k elements, `b` batch·k·n, `c` batch·m·n): one strided-batched cuBLAS
/// call on CUDA.
pub fn matmul_batched<T: DType>(
    stream: &Stream,
    a: &Buffer<T>,
    b: &Buffer<T>,
    c: &mut Buffer<T>,
    batch: usize,
    (m, n, k): (usize, usize, usize),
    opts: GemmOptions,
) -> Result<()> {
    check_common(stream, a, b, c)?;
    check_len(a, "a", &[batch, m, k])?;
    check_len(b, "b", &[batch, k, n])?;
    check_len(c, "c", &[batch, m, n])?;
    if batch == 0 || m == 0 || n == 0 {
        return Ok(());
    }
    if k == 0 {
        return crate::ops::fill(stream, c, T::default());
    }
    let call = GemmCall {
        dtype: T::KIND,
        m,
        n,
        k,
        trans_a: opts.trans_a,
        trans_b: opts.trans_b,
        tf32: opts.tf32 && T::KIND == DTypeKind::F32,
        f32_out: false,
        batch,
        a: a.device_ptr(),
        b: b.device_ptr(),
        c: c.device_ptr(),
        stride_a: m * k,
        stride_b: k * n,
        stride_c: m * n,
    };
    run(stream, a, b, c, &[call])
}

/// Grouped products with a different row count per group: group `g` computes
/// `c[rows_g] = op(a[rows_g]) · op(b[g])` for its `group_rows[g]` rows. `a` holds the groups'
/// m_g×k blocks back to back (k×m_g each with `trans_a`), `b` one k×n matrix per group (n×k
/// with `trans_b`), `c` the m_g×n blocks back to back. Empty groups are skipped.
pub fn matmul_grouped<T: DType>(
    stream: &Stream,
    a: &Buffer<T>,
    b: &Buffer<T>,
    c: &mut Buffer<T>,
    group_rows: &[usize],
    (n, k): (usize, usize),
    opts: GemmOptions,
) -> Result<()> {
    check_common(stream, a, b, c)?;
    let rows = group_rows
        .iter()
        .try_fold(0usize, |acc, &m| acc.checked_add(m))
        .ok_or_else(|| Error::InvalidArgument("matmul_grouped: row counts overflow".into()))?;
    check_len(a, "a", &[rows, k])?;
    check_len(b, "b", &[group_rows.len(), k, n])?;
    check_len(c, "c", &[rows, n])?;
    if rows == 0 || n == 0 {
        return Ok(());
    }
    if k == 0 {
        return crate::ops::fill(stream, c, T::default());
    }
    let size = std::mem::size_of::<T>() as u64;
    let mut calls = Vec::with_capacity(group_rows.len());
    let mut row = 0usize;
    for (g, &m) in group_rows.iter().enumerate() {
        if m > 0 {
            calls.push(GemmCall {
                dtype: T::KIND,
                m,
                n,
                k,
                trans_a: opts.trans_a,
                trans_b: opts.trans_b,
                tf32: opts.tf32 && T::KIND == DTypeKind::F32,
                f32_out: false,
                batch: 1,
                a: a.device_ptr() + (row * k) as u64 * size,
                b: b.device_ptr() + (g * k * n) as u64 * size,
                c: c.device_ptr() + (row * n) as u64 * size,
                stride_a: 0,
                stride_b: 0,
                stride_c: 0,
            });
        }
        row += m;
    }
    run(stream, a, b, c, &calls)
}

/// Runs checked calls on the stream's backend. Pointers in `calls` are device addresses on
/// CUDA and offsets-from-the-buffer-start (as addresses) on the CPU backend alike: both are
/// the buffers' own addresses plus element offsets.
fn run<T: DType>(
    stream: &Stream,
    a: &Buffer<T>,
    b: &Buffer<T>,
    c: &mut Buffer<T>,
    calls: &[GemmCall],
) -> Result<()> {
    stream.run(
        c,
        |c| gemm_on_host(a, b, c, calls),
        // SAFETY: every call's operands lie inside `a`, `b` and `c` (shapes checked against
        // the buffers' lengths by the callers, offsets computed from those shapes), which are
        // live device buffers; `c` is borrowed mutably, so it overlaps neither input.
        |_, q| unsafe { q.gpu.gemm(q.stream, calls) },
    )
}

/// The CPU backend's body of [`run`]: f32 products of the widened operands.
fn gemm_on_host<T: DType>(
    a: &Buffer<T>,
    b: &Buffer<T>,
    c: &mut Buffer<T>,
    calls: &[GemmCall],
) -> Result<()> {
    let size = std::mem::size_of::<T>() as u64;
    let (a32, b32) = (widen(a.host_view()?)?, widen(b.host_view()?)?);
    let mut c32 = host_filled("matmul (CPU): c as f32", c.len(), 0f32)?;
    let offset = |ptr: u64, base: u64| ((ptr - base) / size) as usize;
    for call in calls {
        for i in 0..call.batch.max(1) {
            let ao = offset(call.a, a.device_ptr()) + i * call.stride_a;
            let bo = offset(call.b, b.device_ptr()) + i * call.stride_b;
            let co = offset(call.c, c.device_ptr()) + i * call.stride_c;
            let (m, n, k) = (call.m, call.n, call.k);
            cpu::gemm_f32(
                a32.get(ao..ao + m * k).unwrap_or(&[]),
                b32.get(bo..bo + k * n).unwrap_or(&[]),
                c32.get_mut(co..co + m * n).unwrap_or(&mut []),
                (m, n, k),
                (call.trans_a, call.trans_b),
            )?;
        }
    }
    for (dst, v) in c.host_view_mut()?.iter_mut().zip(c32) {
        *dst = from_f32::<T>(v);
    }
    Ok(())
}

/// The values as f32, in a host `Vec` that may be larger than the buffer (checked).
fn widen<T: DType>(values: &[T]) -> Result<Vec<f32>> {
    let mut out = host_vec("matmul (CPU): an operand as f32", values.len())?;
    out.extend(values.iter().map(|&v| to_f32(v)));
    Ok(out)
}

/// A float element as f32 (NaN for non-float types, which the ops reject first).
fn to_f32<T: DType>(v: T) -> f32 {
    let bits = v.to_bits_u64();
    match T::KIND {
        DTypeKind::F32 => f32::from_bits(bits as u32),
        DTypeKind::F16 => f16::from_bits(bits as u16).to_f32(),
        DTypeKind::BF16 => bf16::from_bits(bits as u16).to_f32(),
        _ => f32::NAN,
    }
}

/// An f32 rounded to the float element type `T`.
fn from_f32<T: DType>(v: f32) -> T {
    let bits = match T::KIND {
        DTypeKind::F16 => f16::from_f32(v).to_bits() as u64,
        DTypeKind::BF16 => bf16::from_f32(v).to_bits() as u64,
        _ => v.to_bits() as u64,
    };
    T::from_bits_u64(bits)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::Device;

    #[test]
    fn shapes_that_do_not_match_are_errors() {
        let s = Device::cpu().new_stream().unwrap();
        let a = Buffer::<f32>::zeros(&s, 6).unwrap();
        let mut c = Buffer::<f32>::zeros(&s, 4).unwrap();
        let o = GemmOptions::default();
        assert!(matmul_batched(&s, &a, &a, &mut c, 2, (1, 2, 3), o).is_err());
        assert!(matmul_grouped(&s, &a, &a, &mut c, &[1, 2], (2, 2), o).is_err());
        let i = Buffer::<i32>::zeros(&s, 1).unwrap();
        let mut ic = Buffer::<i32>::zeros(&s, 1).unwrap();
        assert!(matches!(
            matmul(&s, &i, &i, &mut ic, (1, 1, 1)),
            Err(Error::Unsupported(_))
        ));
    }
}
