//! Matrix products: row-major `c[m×n] = a[m×k] · b[k×n]`, through cuBLAS on CUDA and the
//! `gemm` crate on the CPU backend.

use half::{bf16, f16};

use crate::device::{cpu, Device, Stream};
use crate::dtype::{DType, DTypeKind};
use crate::error::{Error, Result};
use crate::memory::Buffer;

fn check_shape<T: DType>(buf: &Buffer<T>, what: &str, rows: usize, cols: usize) -> Result<()> {
    let need = rows.checked_mul(cols).ok_or_else(|| {
        Error::InvalidArgument(format!("matmul: {what} shape {rows}x{cols} overflows"))
    })?;
    if buf.len() != need {
        return Err(Error::InvalidArgument(format!(
            "matmul: {what} has {} elements, shape {rows}x{cols} needs {need}",
            buf.len()
        )));
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
    (m, n, k): (usize, usize, usize),
) -> Result<()> {
    for buf in [a.device(), b.device(), c.device()] {
        buf.same_as(stream.device(), "matmul")?;
    }
    check_shape(a, "a", m, k)?;
    check_shape(b, "b", k, n)?;
    check_shape(c, "c", m, n)?;
    if !matches!(T::KIND, DTypeKind::F32 | DTypeKind::F16 | DTypeKind::BF16) {
        return Err(Error::Unsupported(format!("matmul on {}", T::KIND.name())));
    }
    if m == 0 || n == 0 {
        return Ok(());
    }
    match stream.device() {
        Device::Cuda(d) => {
            let Some((_, s)) = stream.cuda() else {
                return Err(Error::InvalidArgument(
                    "matmul: stream is not a CUDA stream".into(),
                ));
            };
            if k == 0 {
                return crate::ops::fill(stream, c, T::default());
            }
            // SAFETY: the three buffers are live device allocations of exactly m·k, k·n and
            // m·n elements of T (checked above).
            unsafe {
                d.gemm(
                    s,
                    T::KIND,
                    (m, n, k),
                    a.device_ptr(),
                    b.device_ptr(),
                    c.device_ptr(),
                )
            }
        }
        Device::Cpu => {
            let widen = |buf: &Buffer<T>| -> Result<Vec<f32>> {
                Ok(buf.host_view()?.iter().map(|&v| to_f32(v)).collect())
            };
            let (a32, b32) = (widen(a)?, widen(b)?);
            let mut c32 = vec![0f32; m * n];
            cpu::gemm_f32(&a32, &b32, &mut c32, m, n, k)?;
            for (dst, v) in c.host_view_mut()?.iter_mut().zip(c32) {
                *dst = from_f32::<T>(v);
            }
            Ok(())
        }
    }
}

/// A float element as f32 (NaN for non-float types, which `matmul` rejects first).
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
