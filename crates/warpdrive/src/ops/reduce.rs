//! Deterministic reductions over f32, f64, f16 and bf16: sum, max and mean, of a whole buffer
//! ([`reduce_into`]) or of each row ([`reduce_rows`]).
//!
//! Kernels accumulate in f32 (f64 for f64) in a fixed tree of warp shuffles and shared
//! memory, with no atomics, so a result depends only on the input and the device (the grid of
//! the whole-buffer pass is SMs × resident blocks). The CPU backend accumulates in f64.
//! Max propagates NaN (any NaN in, NaN out). Over no elements: sum 0, max -inf, mean NaN.

use crate::device::Stream;
use crate::dtype::{DType, DTypeKind, Float};
use crate::error::{Error, Result};
use crate::kernels::REDUCE;
use crate::memory::{check_len, Buffer};

use super::{fill_grid, grid_for_rows, launch, rows_of, Args, Loads, Scratch, BLOCK};

/// Partials of the whole-buffer pass at most (one per block of its grid).
const MAX_PARTIALS: u64 = 4096;
/// Threads of the final pass (its `__launch_bounds__(1024)`).
const FINAL_BLOCK: u32 = 1024;
/// Rows at most this wide get one warp each; wider rows one block of 256.
const WARP_ROW_MAX: usize = 1024;

/// Bytes of [`Scratch`] that [`reduce_into`] needs (room for every block's partial result).
pub const REDUCE_SCRATCH_BYTES: usize = MAX_PARTIALS as usize * 8;

/// What a reduction computes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ReduceOp {
    Sum,
    Max,
    /// The sum divided by the count.
    Mean,
}

/// A whole-buffer reduction and the accesses its kernel uses ([`Loads::Vector`] unless asked;
/// a plain [`ReduceOp`] converts into one).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Reduce {
    pub op: ReduceOp,
    pub loads: Loads,
}

impl From<ReduceOp> for Reduce {
    fn from(op: ReduceOp) -> Reduce {
        Reduce {
            op,
            loads: Loads::Vector,
        }
    }
}

impl ReduceOp {
    /// The reduction in f64 (the CPU backend).
    fn apply<T: Float>(self, xs: &[T]) -> f64 {
        match self {
            ReduceOp::Sum => xs.iter().map(|v| v.to_f64()).sum(),
            ReduceOp::Mean => xs.iter().map(|v| v.to_f64()).sum::<f64>() / xs.len() as f64,
            ReduceOp::Max => xs.iter().fold(f64::NEG_INFINITY, |m, v| {
                let v = v.to_f64();
                if m.is_nan() || m > v {
                    m
                } else {
                    v
                }
            }),
        }
    }

    /// `sum` or `max`: the kernel family (a mean sums, then divides).
    fn family(self) -> usize {
        match self {
            ReduceOp::Sum | ReduceOp::Mean => 0,
            ReduceOp::Max => 1,
        }
    }
}

/// The position of `T` among the reduction kernels' types (f32, f64, f16, bf16).
fn type_index<T: DType>(op: &str) -> Result<usize> {
    match T::KIND {
        DTypeKind::F32 => Ok(0),
        DTypeKind::F64 => Ok(1),
        DTypeKind::F16 => Ok(2),
        DTypeKind::BF16 => Ok(3),
        _ => Err(Error::Unsupported(format!("{op} on {}", T::KIND.name()))),
    }
}

macro_rules! by_type {
    ($p:literal) => {
        [
            concat!($p, "_f32"),
            concat!($p, "_f64"),
            concat!($p, "_f16"),
            concat!($p, "_bf16"),
        ]
    };
}

/// [family][type]: sum, max.
const PARTIAL: [[&str; 4]; 2] = [
    by_type!("reduce_partial_sum"),
    by_type!("reduce_partial_max"),
];
const PARTIAL_SCALAR: [[&str; 4]; 2] = [
    by_type!("reduce_partial_scalar_sum"),
    by_type!("reduce_partial_scalar_max"),
];
const FINAL: [[&str; 4]; 2] = [by_type!("reduce_final_sum"), by_type!("reduce_final_max")];
const ROWS_WARP: [[&str; 4]; 2] = [
    by_type!("reduce_rows_warp_sum"),
    by_type!("reduce_rows_warp_max"),
];
const ROWS_BLOCK: [[&str; 4]; 2] = [
    by_type!("reduce_rows_block_sum"),
    by_type!("reduce_rows_block_max"),
];

/// Reduces all of `x` into `out[0]` (`out.len() == 1`), using `scratch` (at least
/// [`REDUCE_SCRATCH_BYTES`]) for the per-block partials: nothing is allocated.
pub fn reduce_into<T: Float>(
    stream: &Stream,
    op: impl Into<Reduce>,
    x: &Buffer<T>,
    out: &mut Buffer<T>,
    scratch: &Scratch,
) -> Result<()> {
    let Reduce { op, loads } = op.into();
    x.check_stream(stream, "reduce")?;
    out.check_stream(stream, "reduce")?;
    check_len("reduce (output)", out.len(), 1)?;
    scratch.check(stream, "reduce", REDUCE_SCRATCH_BYTES)?;
    let t = type_index::<T>("reduce")?;
    stream.run(
        out,
        |out| {
            out.host_view_mut()?[0] = T::from_f64(op.apply(x.host_view()?));
            Ok(())
        },
        |out, q| {
            let d = q.gpu;
            let f = op.family();
            let n = x.len() as u64;
            let (partial, per_thread) = match loads {
                Loads::Vector => (PARTIAL[f][t], 16),
                Loads::Scalar => (PARTIAL_SCALAR[f][t], 1),
            };
            let mut blocks = 0u32;
            if n > 0 {
                blocks = fill_grid(d, (&REDUCE, partial), n, BLOCK as u64 * per_thread)?
                    .min(MAX_PARTIALS as u32);
                let args = Args::new().buf(x).u64(n).ptr(scratch.ptr());
                // SAFETY: reduce_partial_*_<T>(const T* x, u64 n, A* partial): x holds n elements;
                // the scratch holds MAX_PARTIALS >= blocks accumulators of 8 bytes or less.
                unsafe { launch(q, (&REDUCE, partial), blocks, BLOCK, 0, args)? };
            }
            let mean = i32::from(op == ReduceOp::Mean);
            let args = Args::new()
                .ptr(scratch.ptr())
                .u32(blocks)
                .buf(out)
                .u64(n)
                .i32(mean);
            // SAFETY: reduce_final_*_<T>(const A* partial, u32 count, T* out, u64 n, int mean): the
            // scratch holds `blocks` partials written above (none read when 0) and `out` one element.
            unsafe { launch(q, (&REDUCE, FINAL[f][t]), 1, FINAL_BLOCK, 0, args) }
        },
    )
}

/// Reduces each row of `x` (row-major, `cols` per row) into `out[row]`.
pub fn reduce_rows<T: Float>(
    stream: &Stream,
    op: ReduceOp,
    x: &Buffer<T>,
    cols: usize,
    out: &mut Buffer<T>,
) -> Result<()> {
    x.check_stream(stream, "reduce_rows")?;
    out.check_stream(stream, "reduce_rows")?;
    let rows = rows_of("reduce_rows", x.len(), cols)?;
    check_len("reduce_rows (output rows)", out.len(), rows)?;
    let t = type_index::<T>("reduce_rows")?;
    if rows == 0 {
        return Ok(());
    }
    stream.run(
        out,
        |out| {
            let xs = x.host_view()?;
            for (o, row) in out.host_view_mut()?.iter_mut().zip(xs.chunks_exact(cols)) {
                *o = T::from_f64(op.apply(row));
            }
            Ok(())
        },
        |out, q| {
            let f = op.family();
            let (name, grid) = if cols <= WARP_ROW_MAX {
                (
                    ROWS_WARP[f][t],
                    grid_for_rows(rows as u64, 8, "reduce_rows")?,
                )
            } else {
                (
                    ROWS_BLOCK[f][t],
                    grid_for_rows(rows as u64, 1, "reduce_rows")?,
                )
            };
            let mean = i32::from(op == ReduceOp::Mean);
            let args = Args::new()
                .buf(x)
                .u64(rows as u64)
                .u64(cols as u64)
                .buf(out)
                .i32(mean);
            // SAFETY: reduce_rows_*_<T>(const T* x, u64 rows, u64 cols, T* out, int mean): x holds
            // rows·cols elements, out `rows`; the grid covers the rows (8 per block, or 1).
            unsafe { launch(q, (&REDUCE, name), grid, BLOCK, 0, args) }
        },
    )
}
