//! Kernel fusion: lazy expressions over buffers, compiled into one kernel.
//!
//! A chain of ops costs one pass over memory per op; an [`Expr`] builds the chain without
//! running it, and [`Expr::eval`] runs it as **one** generated kernel that reads each input
//! once and writes the result once, every intermediate in registers.
//!
//! - Operands: [`Buffer`](crate::Buffer)s of f32, f16 or bf16 ([`Expr::input`] as one row,
//!   [`Expr::matrix`], [`Expr::col`]) and f32 constants; they broadcast along rows or columns
//!   (NumPy's rule on `[rows, cols]`; shapes that do not broadcast are an
//!   `Error::InvalidArgument` naming them, at `eval`).
//! - Operations: `+ - * /`, [`fma`](Expr::fma), [`min`](Expr::min) / [`max`](Expr::max)
//!   (NaN-propagating), `neg`, `abs`, `exp`, `log`, `sqrt`, `tanh`, `sigmoid`, the ops'
//!   [`Activation`](crate::ops::Activation)s, comparisons (1 or 0) and
//!   [`select`](Expr::select), and [`cast`](Expr::cast)s that round mid-graph. Arithmetic is
//!   f32 on the GPU (IEEE: NaN and infinities propagate as the formulas say) and f64 on the
//!   CPU backend, the reference, with one rounding to the output type.
//! - Reductions (MapReduce): [`sum`](Expr::sum), [`mean`](Expr::mean),
//!   [`reduce_max`](Expr::reduce_max), [`reduce_min`](Expr::reduce_min) of everything, and
//!   [`sum_rows`](Expr::sum_rows), [`mean_rows`](Expr::mean_rows),
//!   [`max_rows`](Expr::max_rows), [`min_rows`](Expr::min_rows) per row, with the map before
//!   them and what follows them (an epilogue) in the same kernel. Row reductions may depend
//!   on each other (softmax: a max, then a sum of exponentials, then a result per element:
//!   one pass over the row per level); whole reductions take reduction-free operands of one
//!   shape, or one value per row of a row program (a batch's mean loss, its accuracy), and
//!   end in scalar arithmetic. [`Expr::col_index`] with a comparison picks one
//!   element per row (a label's logit) inside a row's pass. Whole results are
//!   deterministic (a fixed combining order; no float atomics).
//! - Gathers: [`Expr::gather`] reads a buffer at computed indices (an embedding row per
//!   index; out-of-range indices give NaN, never a read outside the buffer).
//! - Filters (TransformFilter): [`filter_into`](Expr::filter_into) keeps the elements where a
//!   predicate holds, in order, and counts them, in one pass (a single-pass scan with
//!   decoupled look-back), the count left on the device.
//! - MatrixOps: [`matmul_epilogue`], a GEMM with its epilogue (bias, activation, residual):
//!   inside one cuBLASLt matmul where cuBLASLt has the epilogue (bias with GELU or none, bf16
//!   or f16), else the GEMM and one generated epilogue kernel (by default a programmatic
//!   dependent launch over the product's chunks in reverse, the rows still in L2 first);
//!   [`matmul_epilogue_with`] takes an [`EpiloguePlan`] (cuBLAS's plain GEMM, the epilogue
//!   kernel's [`Schedule`]).
//! - Code generation ([`Expr::source`] shows it): CUDA C with 16-byte vector accesses when
//!   the pointers are aligned (a scalar loop for the rest), `__restrict__`,
//!   `__launch_bounds__(256)`, a grid-stride loop over a grid that fills the chip.
//!   Constants are kernel parameters, so the kernel is keyed by the graph's structure (types,
//!   broadcasts, operations) alone: one NVRTC compile per structure per process, its PTX
//!   cached on disk by the kernel floor for the next process, launched on the lean path.
//!
//! ```
//! use warpdrive::fuse::Expr;
//! use warpdrive::{bf16, Buffer, Device};
//!
//! # fn main() -> warpdrive::Result<()> {
//! let stream = Device::cpu().new_stream()?;
//! let x = Buffer::from_host(&stream, &[-1.0f32, 0.5, 2.0, 3.0, -4.0, 0.0])?;
//! let bias = Buffer::from_host(&stream, &[0.25f32, -0.5, 1.0])?;
//! // silu(2·x + bias) over a 2 × 3 matrix, the bias broadcast along rows, clamped at 0 below,
//! // written as bf16: one kernel on a GPU.
//! let e = (Expr::matrix(&x, 2, 3) * 2.0 + &bias).silu().max(0.0);
//! let y = e.eval::<bf16>(&stream)?.to_host(&stream)?;
//! let silu = |v: f32| v / (1.0 + (-v).exp());
//! let want = [-1.75f32, 0.5, 5.0, 6.25, -8.5, 1.0].map(|v| silu(v).max(0.0));
//! for (got, want) in y.iter().zip(want) {
//!     assert!((got.to_f32() - want).abs() <= 0.01 * want.abs() + 1e-6);
//! }
//! assert!(e.source::<bf16>()?.contains("fuse_map"));
//!
//! // A softmax over each row: one kernel on a GPU, a warp per row.
//! let m = Expr::matrix(&x, 2, 3);
//! let z = (&m - m.max_rows()).exp();
//! let p = (&z / z.sum_rows()).eval::<f32>(&stream)?.to_host(&stream)?;
//! assert!((p[..3].iter().sum::<f32>() - 1.0).abs() < 1e-6);
//! // The positive elements, doubled, in order; the count comes back with them.
//! let (kept, n) = (Expr::input(&x) * 2.0).filter::<f32>(Expr::input(&x).gt(0.0), &stream)?;
//! assert_eq!(kept.to_host(&stream)?[..n], [1.0, 4.0, 6.0]);
//! # Ok(())
//! # }
//! ```

mod codegen;
mod cpu;
mod eval;
mod expr;
mod filter;
mod matrix;
mod program;
mod registry;
mod tune;

pub use codegen::{MapShape, Schedule};
pub use expr::{Expr, Shape};
pub use matrix::{matmul_epilogue, matmul_epilogue_with, Epilogue, EpiloguePlan};
pub use program::MAX_OPS;
pub use tune::BLOCK_CANDIDATES;
