//! Operations on buffers, each on both backends: the CUDA kernels in `kernels/*.cu` and the
//! CPU backend, which computes the same results (in f64, rounded once) and is their reference.
//! Ops on empty buffers are valid no-ops; mismatched lengths are `Error::LengthMismatch`, bad
//! shapes and parameters `Error::InvalidArgument`, an element type an op does not take
//! `Error::Unsupported` (the same on both backends).
//!
//! - here: `fill`, `copy`, `axpy`, `sum_into` / `sum_to_host`, and [`Scratch`], the caller's
//!   device memory for ops that need room for intermediate results (so no op allocates);
//! - [`elementwise`]: fused `act(a·x + b)` → cast maps, casts, binary ops, SwiGLU;
//! - [`reduce`]: deterministic sum / max / mean over a buffer or per row;
//! - [`softmax`], [`topk`], [`router`]: row softmax, row top-k, the fused MoE router;
//! - [`permute`]: histogram, exclusive scan, gather / scatter rows, stable sort by key;
//! - [`gemm`]: matrix products;
//! - [`quant`]: int8 block quantization with error feedback (gradient compression);
//! - [`segments`]: many buffers packed into one and back, one launch each way.

pub mod elementwise;
pub mod gemm;
pub mod permute;
pub mod quant;
pub mod reduce;
pub mod router;
pub mod segments;
pub mod softmax;
pub mod sparse;
pub mod topk;

pub use elementwise::{
    binary, cast, map, widen_f16_checking_inf, Activation, BinaryOp, Loads, Map,
};
pub use permute::{
    exclusive_scan, gather_rows, histogram, scatter_rows, sort_by_key, KeySort, MAX_BINS,
};
pub use reduce::{reduce_into, reduce_rows, Reduce, ReduceOp, REDUCE_SCRATCH_BYTES};
pub use router::{route, Route};
pub use softmax::softmax_rows;
pub use topk::{topk_rows, MAX_K};

use std::ffi::c_void;

use crate::device::{Gpu, LaunchMode, Queue, Stream};
use crate::dtype::{DType, DTypeKind, Float};
use crate::error::{Error, Result};
use crate::kernels::{self, KernelSource, BASIC};
use crate::memory::{check_len, Buffer};

#[cfg(target_endian = "big")]
compile_error!("kernel arguments are passed as little-endian 8-byte slots");

/// Threads per block of the streaming kernels (their `__launch_bounds__(256)`).
const BLOCK: u32 = 256;

/// Kernel arguments in launch order, each in an 8-byte slot (the driver reads the low bytes
/// of a narrower parameter: little-endian only, checked above).
#[derive(Default)]
pub(crate) struct Args(Vec<u64>);

impl Args {
    pub(crate) fn new() -> Args {
        Args(Vec::with_capacity(8))
    }
    /// A buffer's device address.
    pub(crate) fn buf<T: DType>(mut self, b: &Buffer<T>) -> Args {
        self.0.push(b.device_ptr());
        self
    }
    /// A raw device address (scratch).
    pub(crate) fn ptr(mut self, p: u64) -> Args {
        self.0.push(p);
        self
    }
    pub(crate) fn u64(mut self, v: u64) -> Args {
        self.0.push(v);
        self
    }
    pub(crate) fn u32(mut self, v: u32) -> Args {
        self.0.push(v as u64);
        self
    }
    pub(crate) fn i32(mut self, v: i32) -> Args {
        self.0.push(v as u32 as u64);
        self
    }
    pub(crate) fn f32(mut self, v: f32) -> Args {
        self.0.push(v.to_bits() as u64);
        self
    }
    pub(crate) fn f64(mut self, v: f64) -> Args {
        self.0.push(v.to_bits());
        self
    }
    /// Raw bits of the low `size_of::<T>()` bytes (fill values).
    pub(crate) fn bits(mut self, v: u64) -> Args {
        self.0.push(v);
        self
    }
}

/// Launches kernel `name` of `source` with a 1-D grid and block.
///
/// # Safety
/// `args` must match the kernel's parameters in number, order and width, and every address
/// among them must cover what the kernel reads and writes for this grid.
pub(crate) unsafe fn launch(
    q: Queue<'_>,
    kernel: (&'static KernelSource, &'static str),
    grid: u32,
    block: u32,
    shared_bytes: u32,
    args: Args,
) -> Result<()> {
    // SAFETY: forwarded from this function's contract.
    unsafe { launch_as(q, kernel, grid, block, shared_bytes, args, false) }
}

/// [`launch`], as a programmatic dependent launch when `programmatic`
/// (the backend's launch).
///
/// # Safety
/// As [`launch`]; with `programmatic`, the kernel runs `griddepcontrol.wait` before it
/// touches what earlier work on the stream writes or reads.
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn launch_as(
    q: Queue<'_>,
    kernel: (&'static KernelSource, &'static str),
    grid: u32,
    block: u32,
    shared_bytes: u32,
    args: Args,
    programmatic: bool,
) -> Result<()> {
    let mode = LaunchMode {
        programmatic,
        ..LaunchMode::default()
    };
    // SAFETY: forwarded from this function's contract.
    unsafe { launch_with(q, kernel, grid, block, shared_bytes, args, mode) }
}

/// [`launch`] in launch mode `mode` (a cooperative launch: every block resident at once).
///
/// # Safety
/// As [`launch`]; with `mode.programmatic`, as [`launch_as`].
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn launch_with(
    q: Queue<'_>,
    (source, name): (&'static KernelSource, &'static str),
    grid: u32,
    block: u32,
    shared_bytes: u32,
    mut args: Args,
    mode: LaunchMode,
) -> Result<()> {
    let f = kernels::function(q.gpu, source, name)?;
    let mut params: Vec<*mut c_void> = args
        .0
        .iter_mut()
        .map(|v| v as *mut u64 as *mut c_void)
        .collect();
    // SAFETY: forwarded from this function's contract; `args` outlives the call (the driver
    // copies the parameter values during the launch).
    unsafe {
        q.gpu.launch(
            q.stream,
            &f,
            (grid, 1, 1),
            (block, 1, 1),
            shared_bytes,
            &mut params,
            mode,
        )
    }
}

/// Grid for a grid-stride kernel with `items` units of work, `per_block` per block and
/// iteration: enough blocks to fill every SM (SMs × resident blocks), never more than the
/// work needs, at least 1.
pub(crate) fn fill_grid(
    d: &Gpu,
    kernel: (&'static KernelSource, &'static str),
    items: u64,
    per_block: u64,
) -> Result<u32> {
    let f = kernels::function(d, kernel.0, kernel.1)?;
    let resident = d.resident_blocks(&f, BLOCK, 0)?;
    let full = d.sm_count() as u64 * resident as u64;
    Ok(items.div_ceil(per_block.max(1)).clamp(1, full) as u32)
}

/// Blocks for one unit per `per_block`, as a grid size (errors past the driver's limit).
pub(crate) fn grid_for_rows(rows: u64, per_block: u64, op: &str) -> Result<u32> {
    let blocks = rows.div_ceil(per_block.max(1)).max(1);
    u32::try_from(blocks)
        .ok()
        .filter(|&b| b <= i32::MAX as u32)
        .ok_or_else(|| Error::InvalidArgument(format!("{op}: {rows} rows need too many blocks")))
}

fn unsupported<T: DType>(op: &str) -> Error {
    Error::Unsupported(format!("{op} on {}", T::KIND.name()))
}

/// The position of `T` among the kernels' float types (f32, f16, bf16), or `Unsupported`.
pub(crate) fn float_index<T: DType>(op: &str) -> Result<usize> {
    match T::KIND {
        DTypeKind::F32 => Ok(0),
        DTypeKind::F16 => Ok(1),
        DTypeKind::BF16 => Ok(2),
        _ => Err(unsupported::<T>(op)),
    }
}

/// Kernel names for f32, f16, bf16 (the order of [`float_index`]).
macro_rules! by_float {
    ($p:expr) => {
        [
            concat!($p, "_f32"),
            concat!($p, "_f16"),
            concat!($p, "_bf16"),
        ]
    };
}
pub(crate) use by_float;

/// `rows` for a row-major buffer of `len` elements with `cols` per row.
pub(crate) fn rows_of(op: &str, len: usize, cols: usize) -> Result<usize> {
    if cols == 0 {
        return Err(Error::InvalidArgument(format!("{op}: rows of 0 columns")));
    }
    if len % cols != 0 {
        return Err(Error::InvalidArgument(format!(
            "{op}: {len} elements are not whole rows of {cols}"
        )));
    }
    Ok(len / cols)
}

/// `cols` as the kernels' u32, or an error.
pub(crate) fn cols_u32(op: &str, cols: usize) -> Result<u32> {
    u32::try_from(cols)
        .map_err(|_| Error::InvalidArgument(format!("{op}: {cols} columns exceed u32")))
}

/// Device memory an op borrows for intermediate results (partial sums, per-tile counts).
/// The caller allocates it once, outside any hot loop, so the op itself never allocates;
/// each op that takes one documents the bytes it needs and fails with `InvalidArgument`
/// (on both backends) when the scratch is smaller.
pub struct Scratch {
    words: Buffer<u64>,
}

impl std::fmt::Debug for Scratch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Scratch({} bytes)", self.bytes())
    }
}

impl Scratch {
    /// At least `bytes` of scratch on the stream's device (8-byte aligned).
    pub fn new(stream: &Stream, bytes: usize) -> Result<Scratch> {
        Ok(Scratch {
            words: Buffer::uninit(stream, bytes.div_ceil(8))?,
        })
    }

    pub fn bytes(&self) -> usize {
        self.words.size_bytes()
    }

    pub(crate) fn ptr(&self) -> u64 {
        self.words.device_ptr()
    }

    /// Fails unless this scratch is on the stream's device and holds `need` bytes.
    pub(crate) fn check(&self, stream: &Stream, op: &'static str, need: usize) -> Result<()> {
        self.words.check_stream(stream, op)?;
        if self.bytes() < need {
            return Err(Error::InvalidArgument(format!(
                "{op}: scratch of {} bytes, {need} needed",
                self.bytes()
            )));
        }
        Ok(())
    }
}

/// Sets every element of `buf` to `value`.
pub fn fill<T: DType>(stream: &Stream, buf: &mut Buffer<T>, value: T) -> Result<()> {
    buf.check_stream(stream, "fill")?;
    if buf.is_empty() {
        return Ok(());
    }
    stream.run(
        buf,
        |buf| {
            buf.host_view_mut()?.fill(value);
            Ok(())
        },
        |buf, q| {
            let d = q.gpu;
            let name = match std::mem::size_of::<T>() {
                1 => "fill_u8",
                2 => "fill_u16",
                4 => "fill_u32",
                8 => "fill_u64",
                _ => return Err(unsupported::<T>("fill")),
            };
            let grid = fill_grid(d, (&BASIC, name), buf.len() as u64, BLOCK as u64)?;
            let args = Args::new()
                .buf(buf)
                .bits(value.to_bits_u64())
                .u64(buf.len() as u64);
            // A programmatic launch: it costs the host less than a plain one, and the fill waits
            // for the previous kernel before it writes.
            // SAFETY: fill_uN(uN* out, uN value, u64 n): the value's width matches the kernel picked
            // by element size, and `out` holds `n` elements; the kernel runs wait_prior_grid() first.
            unsafe { launch_as(q, (&BASIC, name), grid, BLOCK, 0, args, true) }
        },
    )
}

/// Copies `src` into `dst` (same length) on the device.
pub fn copy<T: DType>(stream: &Stream, src: &Buffer<T>, dst: &mut Buffer<T>) -> Result<()> {
    src.check_stream(stream, "copy")?;
    dst.check_stream(stream, "copy")?;
    check_len("copy", src.len(), dst.len())?;
    stream.run(
        dst,
        |dst| {
            dst.host_view_mut()?.copy_from_slice(src.host_view()?);
            Ok(())
        },
        |dst, q| {
            q.gpu.copy_d2d(
                q.stream,
                dst.device_ptr(),
                src.device_ptr(),
                src.size_bytes(),
            )
        },
    )
}

/// `y = alpha * x + y`, elementwise (f32, f64, f16, bf16; 16-bit types in f32 arithmetic).
pub fn axpy<T: Float>(stream: &Stream, alpha: T, x: &Buffer<T>, y: &mut Buffer<T>) -> Result<()> {
    x.check_stream(stream, "axpy")?;
    y.check_stream(stream, "axpy")?;
    check_len("axpy", x.len(), y.len())?;
    if x.is_empty() {
        return Ok(());
    }
    stream.run(
        y,
        |y| {
            let a = alpha.to_f64();
            for (yi, &xi) in y.host_view_mut()?.iter_mut().zip(x.host_view()?) {
                *yi = T::from_f64(a * xi.to_f64() + yi.to_f64());
            }
            Ok(())
        },
        |y, q| {
            let d = q.gpu;
            let (name, per_thread, args) = match T::KIND {
                DTypeKind::F32 => (
                    "axpy_f32",
                    4,
                    Args::new().buf(x).buf(y).f32(alpha.to_f64() as f32),
                ),
                DTypeKind::F64 => ("axpy_f64", 2, Args::new().buf(x).buf(y).f64(alpha.to_f64())),
                DTypeKind::F16 => (
                    "axpy_f16",
                    8,
                    Args::new().buf(x).buf(y).f32(alpha.to_f64() as f32),
                ),
                DTypeKind::BF16 => (
                    "axpy_bf16",
                    8,
                    Args::new().buf(x).buf(y).f32(alpha.to_f64() as f32),
                ),
                _ => return Err(unsupported::<T>("axpy")),
            };
            let grid = fill_grid(d, (&BASIC, name), x.len() as u64, BLOCK as u64 * per_thread)?;
            // SAFETY: axpy_T(const T* x, T* y, A a, u64 n) with A = T for f32/f64 and f32 for the
            // 16-bit types; both buffers hold `n` elements.
            unsafe { launch(q, (&BASIC, name), grid, BLOCK, 0, args.u64(x.len() as u64)) }
        },
    )
}

/// Writes the sum of `x` into `out[0]` (`out.len() == 1`), deterministically (no atomics).
/// The empty sum is 0. Allocates its scratch: in a loop, use [`reduce_into`] with a
/// [`Scratch`] of [`REDUCE_SCRATCH_BYTES`] instead.
pub fn sum_into<T: Float>(stream: &Stream, x: &Buffer<T>, out: &mut Buffer<T>) -> Result<()> {
    let scratch = Scratch::new(stream, REDUCE_SCRATCH_BYTES)?;
    reduce_into(stream, ReduceOp::Sum, x, out, &scratch)
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
        let q = stream.gpu("the test").expect("a CUDA stream");
        let f = kernels::function(q.gpu, &BASIC, "empty_kernel").expect("the empty kernel");
        for (grid, block) in [((0, 1, 1), (32, 1, 1)), ((1, 1, 1), (0, 1, 1))] {
            // SAFETY: `empty_kernel` takes no parameters.
            let r = unsafe {
                q.gpu
                    .launch(q.stream, &f, grid, block, 0, &mut [], LaunchMode::default())
            };
            assert!(matches!(r, Err(Error::InvalidArgument(_))), "{r:?}");
        }
        // The device is still usable afterwards.
        stream.synchronize().expect("synchronize");
    }

    #[test]
    fn scratch_checks_its_size() {
        let s = Device::cpu().new_stream().unwrap();
        let scratch = Scratch::new(&s, 13).unwrap();
        assert_eq!(scratch.bytes(), 16);
        assert!(scratch.check(&s, "t", 16).is_ok());
        assert!(matches!(
            scratch.check(&s, "t", 17),
            Err(Error::InvalidArgument(_))
        ));
    }

    #[test]
    fn rows_and_cols_are_checked() {
        assert_eq!(rows_of("t", 12, 4).unwrap(), 3);
        assert_eq!(rows_of("t", 0, 4).unwrap(), 0);
        assert!(rows_of("t", 12, 0).is_err());
        assert!(rows_of("t", 13, 4).is_err());
    }
}
