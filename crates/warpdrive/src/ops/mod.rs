//! Operations on buffers, each on both backends. The foundation ops (`fill`, `copy`, `axpy`,
//! `sum`) prove the path end to end; ops on empty buffers are valid no-ops.

pub mod gemm;

use std::ffi::c_void;

use crate::device::{CudaDevice, Stream};
use crate::dtype::{DType, DTypeKind, Float};
use crate::error::{Error, Result};
use crate::kernels::BASIC;
use crate::memory::{check_len, Buffer};

/// Threads per block of the streaming kernels in `basic.cu` (their `__launch_bounds__`).
const BLOCK: u32 = 256;
/// Blocks of the first `sum` pass at most; also the width of its single-block second pass.
const SUM_MAX_BLOCKS: u32 = 1024;

/// Grid for a grid-stride kernel over `n` items, `per_thread` per thread per iteration:
/// enough blocks to fill every SM many times over, never more than the work needs.
fn grid_for(device: &CudaDevice, n: usize, per_thread: usize) -> u32 {
    let per_block = BLOCK as usize * per_thread.max(1);
    let wanted = n.div_ceil(per_block).max(1);
    let cap = device.sm_count() as usize * 16;
    wanted.min(cap).max(1) as u32
}

fn unsupported<T: DType>(op: &str) -> Error {
    Error::Unsupported(format!("{op} on {}", T::KIND.name()))
}

/// Sets every element of `buf` to `value`.
pub fn fill<T: DType>(stream: &Stream, buf: &mut Buffer<T>, value: T) -> Result<()> {
    buf.check_stream(stream, "fill")?;
    if buf.is_empty() {
        return Ok(());
    }
    let Some((d, s)) = stream.cuda() else {
        buf.host_view_mut()?.fill(value);
        return Ok(());
    };
    let bits = value.to_bits_u64();
    let name = match std::mem::size_of::<T>() {
        1 => "fill_u8",
        2 => "fill_u16",
        4 => "fill_u32",
        8 => "fill_u64",
        _ => return Err(unsupported::<T>("fill")),
    };
    let f = d.function(&BASIC, name)?;
    let mut out = buf.device_ptr();
    let mut n = buf.len() as u64;
    let (mut v8, mut v16, mut v32, mut v64) = (bits as u8, bits as u16, bits as u32, bits);
    let value_arg: *mut c_void = match name {
        "fill_u8" => &mut v8 as *mut u8 as *mut c_void,
        "fill_u16" => &mut v16 as *mut u16 as *mut c_void,
        "fill_u32" => &mut v32 as *mut u32 as *mut c_void,
        _ => &mut v64 as *mut u64 as *mut c_void,
    };
    let mut params = [
        &mut out as *mut u64 as *mut c_void,
        value_arg,
        &mut n as *mut u64 as *mut c_void,
    ];
    let grid = grid_for(d, buf.len(), 1);
    // SAFETY: fill_uN(uN* out, uN value, u64 n): the value's width matches the kernel picked
    // by element size, and `out` holds `n` elements.
    unsafe { d.launch(s, &f, (grid, 1, 1), (BLOCK, 1, 1), 0, &mut params) }
}

/// Copies `src` into `dst` (same length) on the device.
pub fn copy<T: DType>(stream: &Stream, src: &Buffer<T>, dst: &mut Buffer<T>) -> Result<()> {
    src.check_stream(stream, "copy")?;
    dst.check_stream(stream, "copy")?;
    check_len("copy", src.len(), dst.len())?;
    match stream.cuda() {
        Some((d, s)) => d.copy_d2d(s, dst.device_ptr(), src.device_ptr(), src.size_bytes()),
        None => {
            dst.host_view_mut()?.copy_from_slice(src.host_view()?);
            Ok(())
        }
    }
}

/// `y = alpha * x + y`, elementwise.
pub fn axpy<T: Float>(stream: &Stream, alpha: T, x: &Buffer<T>, y: &mut Buffer<T>) -> Result<()> {
    x.check_stream(stream, "axpy")?;
    y.check_stream(stream, "axpy")?;
    check_len("axpy", x.len(), y.len())?;
    if x.is_empty() {
        return Ok(());
    }
    let Some((d, s)) = stream.cuda() else {
        for (yi, &xi) in y.host_view_mut()?.iter_mut().zip(x.host_view()?) {
            *yi = alpha * xi + *yi;
        }
        return Ok(());
    };
    let (name, per_thread) = match T::KIND {
        DTypeKind::F32 => ("axpy_f32", 4),
        DTypeKind::F64 => ("axpy_f64", 2),
        _ => return Err(unsupported::<T>("axpy")),
    };
    let f = d.function(&BASIC, name)?;
    let (mut xp, mut yp, mut a, mut n) = (x.device_ptr(), y.device_ptr(), alpha, x.len() as u64);
    let mut params = [
        &mut xp as *mut u64 as *mut c_void,
        &mut yp as *mut u64 as *mut c_void,
        &mut a as *mut T as *mut c_void,
        &mut n as *mut u64 as *mut c_void,
    ];
    let grid = grid_for(d, x.len(), per_thread);
    // SAFETY: axpy_T(const T* x, T* y, T a, u64 n) with T matching the buffers' element type;
    // both buffers hold `n` elements.
    unsafe { d.launch(s, &f, (grid, 1, 1), (BLOCK, 1, 1), 0, &mut params) }
}

/// Writes the sum of `x` into `out[0]` (`out.len() == 1`), deterministically: a fixed grid
/// of block sums, then one block over those, with no atomics. The empty sum is 0.
pub fn sum_into<T: Float>(stream: &Stream, x: &Buffer<T>, out: &mut Buffer<T>) -> Result<()> {
    x.check_stream(stream, "sum")?;
    out.check_stream(stream, "sum")?;
    check_len("sum (output)", out.len(), 1)?;
    let Some((d, s)) = stream.cuda() else {
        // Accumulate in f64: the reference is as exact as the element type allows.
        let total: f64 = x.host_view()?.iter().map(|v| v.to_f64()).sum();
        out.host_view_mut()?[0] = T::from_f64(total);
        return Ok(());
    };
    let (partial_name, final_name, per_thread) = match T::KIND {
        DTypeKind::F32 => ("sum_partial_f32", "sum_final_f32", 4),
        DTypeKind::F64 => ("sum_partial_f64", "sum_final_f64", 2),
        _ => return Err(unsupported::<T>("sum")),
    };
    let blocks = (x.len().div_ceil(BLOCK as usize * per_thread) as u32).min(SUM_MAX_BLOCKS);
    let partials = Buffer::<T>::uninit(stream, blocks as usize)?;
    if blocks > 0 {
        let f = d.function(&BASIC, partial_name)?;
        let (mut xp, mut n, mut pp) = (x.device_ptr(), x.len() as u64, partials.device_ptr());
        let mut params = [
            &mut xp as *mut u64 as *mut c_void,
            &mut n as *mut u64 as *mut c_void,
            &mut pp as *mut u64 as *mut c_void,
        ];
        // SAFETY: sum_partial_T(const T* x, u64 n, T* partial): `x` holds n elements and
        // `partials` one per block of this grid.
        unsafe { d.launch(s, &f, (blocks, 1, 1), (BLOCK, 1, 1), 0, &mut params)? };
    }
    let f = d.function(&BASIC, final_name)?;
    let (mut pp, mut count, mut op) = (partials.device_ptr(), blocks, out.device_ptr());
    let mut params = [
        &mut pp as *mut u64 as *mut c_void,
        &mut count as *mut u32 as *mut c_void,
        &mut op as *mut u64 as *mut c_void,
    ];
    // SAFETY: sum_final_T(const T* partial, u32 count, T* out): `partials` holds `count`
    // elements (none read when 0) and `out` one.
    unsafe { d.launch(s, &f, (1, 1, 1), (SUM_MAX_BLOCKS, 1, 1), 0, &mut params) }
}

/// The sum of `x`, waiting for the stream to return it to the host.
pub fn sum_to_host<T: Float>(stream: &Stream, x: &Buffer<T>) -> Result<T> {
    let mut out = Buffer::<T>::uninit(stream, 1)?;
    sum_into(stream, x, &mut out)?;
    Ok(out.to_host(stream)?[0])
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::Device;

    #[test]
    #[ignore = "needs a CUDA GPU"]
    fn gpu_a_raw_launch_with_an_empty_grid_is_an_error() {
        let dev = Device::cuda(0).expect("a CUDA device");
        let stream = dev.new_stream().expect("a stream");
        let (d, s) = stream.cuda().expect("a CUDA stream");
        let f = d
            .function(&BASIC, "empty_kernel")
            .expect("the empty kernel");
        for (grid, block) in [((0, 1, 1), (32, 1, 1)), ((1, 1, 1), (0, 1, 1))] {
            // SAFETY: `empty_kernel` takes no parameters.
            let r = unsafe { d.launch(s, &f, grid, block, 0, &mut []) };
            assert!(matches!(r, Err(Error::InvalidArgument(_))), "{r:?}");
        }
        // The device is still usable afterwards.
        stream.synchronize().expect("synchronize");
    }
}
