//! Row top-k (k ≤ [`MAX_K`]) over f32 / f16 / bf16, with values and indices.
//!
//! # Order
//! The same on both backends, and total:
//! - NaN (any sign or payload) ranks above +inf; then the values in descending order, with
//!   -0.0 equal to +0.0; -inf ranks lowest;
//! - equal values (and NaNs among themselves) go to the lower index first.
//!
//! Output `r` of a row is its `r`-th element in that order (`r = 0` the largest); values are
//! copied bit for bit from the input.
//!
//! # Kernels
//! Rows up to 1024 wide: a group of G lanes per row (G = 1…32, smaller groups for narrower
//! rows, so several rows share a warp), each lane holding V consecutive elements in
//! registers; k rounds pick the best by xor shuffles. Wider rows: one warp per row, each lane
//! keeping its 16 best while streaming the row, then k rounds over the lanes' heads (slower).

use crate::device::{Queue, Stream};
use crate::dtype::Float;
use crate::error::{Error, Result};
use crate::kernels::TOPK;
use crate::memory::{check_len, Buffer};

use super::{cols_u32, float_index, grid_for_rows, launch, rows_of, Args, BLOCK};

/// The largest k the top-k and router kernels take.
pub const MAX_K: usize = 16;

/// The order key of a value: larger keys rank first (see the module docs); never 0.
pub(crate) fn order_key(v: f32) -> u32 {
    if v.is_nan() {
        return u32::MAX;
    }
    if v == 0.0 {
        return 0x8000_0000;
    }
    let u = v.to_bits();
    if u & 0x8000_0000 != 0 {
        !u
    } else {
        u | 0x8000_0000
    }
}

/// The indices of the `k` best elements of `row` in rank order (the kernels' order).
pub(crate) fn top_indices<T: Float>(row: &[T], k: usize) -> Vec<u32> {
    let rank = |i: usize| {
        ((order_key(row[i].to_f64() as f32) as u64) << 32) | (u32::MAX - i as u32) as u64
    };
    let mut idx: Vec<usize> = (0..row.len()).collect();
    idx.sort_unstable_by_key(|&i| std::cmp::Reverse(rank(i)));
    idx.into_iter().take(k).map(|i| i as u32).collect()
}

/// Checks k against the row width and [`MAX_K`].
pub(crate) fn check_k(op: &str, k: usize, cols: usize) -> Result<()> {
    if k == 0 || k > MAX_K {
        return Err(Error::InvalidArgument(format!(
            "{op}: k = {k}, must be 1..={MAX_K}"
        )));
    }
    if k > cols {
        return Err(Error::InvalidArgument(format!(
            "{op}: k = {k} is more than the {cols} elements of a row"
        )));
    }
    Ok(())
}

/// The kernel variant for rows `cols` wide: index into the name tables, and rows per block.
/// Tile variants in order (V, G): (8,1) (8,2) (8,4) (8,8) (8,16) (8,32) (16,32) (32,32); then
/// the list variant (one warp per row).
pub(crate) fn variant(cols: usize) -> (usize, u64) {
    const TILES: [(usize, u64); 8] = [
        (8, 1),
        (16, 2),
        (32, 4),
        (64, 8),
        (128, 16),
        (256, 32),
        (512, 32),
        (1024, 32),
    ];
    match TILES.iter().position(|&(w, _)| cols <= w) {
        Some(i) => (i, BLOCK as u64 / TILES[i].1),
        None => (8, BLOCK as u64 / 32),
    }
}

macro_rules! variants {
    ($p:literal) => {
        [
            $crate::ops::by_float!(concat!($p, "_tile_v8_g1")),
            $crate::ops::by_float!(concat!($p, "_tile_v8_g2")),
            $crate::ops::by_float!(concat!($p, "_tile_v8_g4")),
            $crate::ops::by_float!(concat!($p, "_tile_v8_g8")),
            $crate::ops::by_float!(concat!($p, "_tile_v8_g16")),
            $crate::ops::by_float!(concat!($p, "_tile_v8_g32")),
            $crate::ops::by_float!(concat!($p, "_tile_v16_g32")),
            $crate::ops::by_float!(concat!($p, "_tile_v32_g32")),
            $crate::ops::by_float!(concat!($p, "_list")),
        ]
    };
}
pub(crate) use variants;

const TOPK_NAMES: [[&str; 3]; 9] = variants!("topk");

/// Launches the top-k family kernel for `rows` rows of `cols`.
///
/// # Safety
/// `args` must match `(const T* x, u64 rows, u32 cols, u32 k, ...)` followed by the
/// kernel's outputs, covering `rows` rows.
pub(crate) unsafe fn launch_rows(
    q: Queue<'_>,
    name: &'static str,
    rows: usize,
    per_block: u64,
    args: Args,
) -> Result<()> {
    let grid = grid_for_rows(rows as u64, per_block, name)?;
    // SAFETY: forwarded from this function's contract.
    unsafe { launch(q, (&TOPK, name), grid, BLOCK, 0, args) }
}

/// The `k` largest elements of each row of `x` (row-major, `cols` per row), in the order of
/// the module docs: `values[row·k + r]` and `indices[row·k + r]` (the column in the row).
///
/// Errors: k = 0, k > 16 or k > cols (`InvalidArgument`); `values` / `indices` not
/// rows·k long (`LengthMismatch`).
pub fn topk_rows<T: Float>(
    stream: &Stream,
    x: &Buffer<T>,
    cols: usize,
    k: usize,
    values: &mut Buffer<T>,
    indices: &mut Buffer<u32>,
) -> Result<()> {
    x.check_stream(stream, "topk_rows")?;
    values.check_stream(stream, "topk_rows")?;
    indices.check_stream(stream, "topk_rows")?;
    let rows = rows_of("topk_rows", x.len(), cols)?;
    let cols32 = cols_u32("topk_rows", cols)?;
    check_k("topk_rows", k, cols)?;
    check_len("topk_rows (values)", values.len(), rows * k)?;
    check_len("topk_rows (indices)", indices.len(), rows * k)?;
    let t = float_index::<T>("topk_rows")?;
    if rows == 0 {
        return Ok(());
    }
    stream.run(
        (indices, values),
        |(indices, values)| {
            let xs = x.host_view()?;
            let vals = values.host_view_mut()?;
            let idx = indices.host_view_mut()?;
            for (r, row) in xs.chunks_exact(cols).enumerate() {
                for (j, i) in top_indices(row, k).into_iter().enumerate() {
                    vals[r * k + j] = row[i as usize];
                    idx[r * k + j] = i;
                }
            }
            Ok(())
        },
        |(indices, values), q| {
            let (v, per_block) = variant(cols);
            let args = Args::new()
                .buf(x)
                .u64(rows as u64)
                .u32(cols32)
                .u32(k as u32)
                .buf(values)
                .buf(indices);
            // SAFETY: topk_*_<T>(const T* x, u64 rows, u32 cols, u32 k, T* vals, u32* idx): x holds
            // rows·cols elements of T, values and indices rows·k each (checked above).
            unsafe { launch_rows(q, TOPK_NAMES[v][t], rows, per_block, args) }
        },
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn order_keys_follow_the_documented_order() {
        let ordered = [
            f32::NAN,
            f32::INFINITY,
            f32::MAX,
            1.0,
            f32::MIN_POSITIVE,
            1e-45,
            0.0,
            -1e-45,
            -1.0,
            f32::MIN,
            f32::NEG_INFINITY,
        ];
        for w in ordered.windows(2) {
            assert!(order_key(w[0]) > order_key(w[1]), "{} vs {}", w[0], w[1]);
        }
        assert_eq!(order_key(-0.0), order_key(0.0));
        assert_eq!(order_key(-f32::NAN), order_key(f32::NAN));
        assert!(ordered.iter().all(|&v| order_key(v) != 0));
    }

    #[test]
    fn ties_go_to_the_lower_index() {
        let row = [1.0f32, 3.0, 3.0, f32::NAN, -0.0, 0.0, f32::NAN];
        assert_eq!(top_indices(&row, 7), vec![3, 6, 1, 2, 0, 4, 5]);
    }

    #[test]
    fn variants_cover_every_width() {
        assert_eq!(variant(1), (0, 256));
        assert_eq!(variant(8), (0, 256));
        assert_eq!(variant(9), (1, 128));
        assert_eq!(variant(256), (5, 8));
        assert_eq!(variant(257), (6, 8));
        assert_eq!(variant(1024), (7, 8));
        assert_eq!(variant(1025), (8, 8));
    }
}
