//! Row softmax over f32 / f16 / bf16: `y = exp(x - max) / Σ exp(x - max)` per row, in f32 on
//! the GPU (f64 on the CPU backend). A NaN in a row makes the whole row NaN, and a row of
//! -inf is NaN (0 / 0), as the f64 formula gives.

use crate::device::Stream;
use crate::dtype::Float;
use crate::error::Result;
use crate::kernels::SOFTMAX;
use crate::memory::{check_len, Buffer};

use super::{by_float, cols_u32, float_index, grid_for_rows, launch, rows_of, Args, BLOCK};

const WARP8: [&str; 3] = by_float!("softmax_warp8");
const WARP32: [&str; 3] = by_float!("softmax_warp32");
const ROW_BLOCK: [&str; 3] = by_float!("softmax_block");

/// Softmax of each row of `x` (row-major, `cols` per row) into `y` (same length).
///
/// Rows up to 1024 wide take one warp each and stay in registers; wider rows take a block.
pub fn softmax_rows<T: Float>(
    stream: &Stream,
    x: &Buffer<T>,
    cols: usize,
    y: &mut Buffer<T>,
) -> Result<()> {
    x.check_stream(stream, "softmax_rows")?;
    y.check_stream(stream, "softmax_rows")?;
    check_len("softmax_rows", x.len(), y.len())?;
    let rows = rows_of("softmax_rows", x.len(), cols)?;
    let cols32 = cols_u32("softmax_rows", cols)?;
    let t = float_index::<T>("softmax_rows")?;
    if rows == 0 {
        return Ok(());
    }
    stream.run(
        y,
        |y| {
            let xs = x.host_view()?;
            for (out, row) in y
                .host_view_mut()?
                .chunks_exact_mut(cols)
                .zip(xs.chunks_exact(cols))
            {
                let m = row.iter().fold(f64::NEG_INFINITY, |m, v| {
                    let v = v.to_f64();
                    if m.is_nan() || m > v {
                        m
                    } else {
                        v
                    }
                });
                let sum: f64 = row.iter().map(|v| (v.to_f64() - m).exp()).sum();
                for (o, v) in out.iter_mut().zip(row) {
                    *o = T::from_f64((v.to_f64() - m).exp() / sum);
                }
            }
            Ok(())
        },
        |y, q| {
            let (name, grid) = match cols {
                0..=256 => (WARP8[t], grid_for_rows(rows as u64, 8, "softmax_rows")?),
                257..=1024 => (WARP32[t], grid_for_rows(rows as u64, 8, "softmax_rows")?),
                _ => (ROW_BLOCK[t], grid_for_rows(rows as u64, 1, "softmax_rows")?),
            };
            let args = Args::new().buf(x).u64(rows as u64).u32(cols32).buf(y);
            // SAFETY: softmax_*_<T>(const T* x, u64 rows, u32 cols, T* y): x and y hold rows·cols
            // elements of T; the grid covers the rows (8 per block, or 1).
            unsafe { launch(q, (&SOFTMAX, name), grid, BLOCK, 0, args) }
        },
    )
}
