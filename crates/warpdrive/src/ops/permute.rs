//! Permutation primitives for MoE dispatch, all on the device: [`histogram`] and
//! [`exclusive_scan`] of u32, [`gather_rows`] / [`scatter_rows`] by index, and
//! [`sort_by_key`], a stable counting sort of small integer keys that yields the counts per
//! key (tokens per expert), their offsets, the sorted order and its inverse.

use crate::device::{Queue, Stream};
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::kernels::PERMUTE;
use crate::memory::{check_len, Buffer};

use super::{fill, fill_grid, launch, launch_as, rows_of, Args, Scratch, BLOCK};

/// The most bins (distinct keys) [`histogram`] and [`sort_by_key`] take: their per-block
/// counts live in shared memory.
pub const MAX_BINS: usize = 4096;
/// Keys per tile of the sort at most sizes: one per thread of a block of [`BLOCK`], so that
/// 32k keys keep 128 blocks busy (one per SM).
const SORT_TILE: usize = 256;
/// The most tiles of the sort: past 1024 · 256 keys the tile doubles instead, which bounds the
/// scratch at what tiles of 1024 keys took (1024 · (bins + 1) words) and keeps each bucket's
/// run of tile counts (one warp scans it) at most 1024 words.
const MAX_SORT_TILES: usize = 1024;
/// Threads of the scan's blocks (their `__launch_bounds__(1024)`).
const WIDE_BLOCK: u32 = 1024;

fn check_bins(op: &str, bins: usize) -> Result<u32> {
    if bins == 0 || bins > MAX_BINS {
        return Err(Error::InvalidArgument(format!(
            "{op}: {bins} bins, must be 1..={MAX_BINS}"
        )));
    }
    Ok(bins as u32)
}

fn check_count(op: &str, n: usize) -> Result<u64> {
    if n >= u32::MAX as usize {
        return Err(Error::InvalidArgument(format!(
            "{op}: {n} elements; u32 indices need fewer than {}",
            u32::MAX
        )));
    }
    Ok(n as u64)
}

/// `counts[b]` = how many of `keys` equal `b`, for `b < counts.len()` (the bin count, 1 to
/// [`MAX_BINS`]); keys `>= counts.len()` are not counted.
pub fn histogram(stream: &Stream, keys: &Buffer<u32>, counts: &mut Buffer<u32>) -> Result<()> {
    keys.check_stream(stream, "histogram")?;
    counts.check_stream(stream, "histogram")?;
    let bins = check_bins("histogram", counts.len())?;
    stream.run(
        counts,
        |counts| {
            let c = counts.host_view_mut()?;
            c.fill(0);
            for &k in keys.host_view()? {
                if let Some(slot) = c.get_mut(k as usize) {
                    *slot += 1;
                }
            }
            Ok(())
        },
        |counts, q| {
            let d = q.gpu;
            fill(stream, counts, 0)?;
            if keys.is_empty() {
                return Ok(());
            }
            let n = keys.len() as u64;
            // Few blocks: each adds its whole shared histogram into the global one at the end.
            let grid = fill_grid(d, (&PERMUTE, "histogram_u32"), n, BLOCK as u64 * 16)?
                .min(2 * d.sm_count());
            let args = Args::new().buf(keys).u64(n).u32(bins).buf(counts);
            // SAFETY: histogram_u32(const u32* keys, u64 n, u32 bins, u32* counts) with `bins` words
            // of dynamic shared memory: keys holds n, counts bins elements.
            unsafe { launch(q, (&PERMUTE, "histogram_u32"), grid, BLOCK, bins * 4, args) }
        },
    )
}

/// Elements up to which [`exclusive_scan`] runs in one block (past it, a block per tile).
pub const ONE_BLOCK_SCAN: u64 = 1 << 16;
/// Elements a block scans in [`exclusive_scan`]'s many-block path.
const SCAN_TILE: u64 = 4096;

/// `out[i] = x[0] + … + x[i-1]` for `i` in `0..=x.len()`: `out` has one more element than `x`
/// and ends with the total (wrapping on u32 overflow). On a GPU, one block of 1024 threads up
/// to [`ONE_BLOCK_SCAN`] elements; past that a block per tile of 4096 (tile sums kept in
/// `out`, their scan, then each tile from its base): no scratch memory, so it runs inside a
/// graph capture too.
pub fn exclusive_scan(stream: &Stream, x: &Buffer<u32>, out: &mut Buffer<u32>) -> Result<()> {
    x.check_stream(stream, "exclusive_scan")?;
    out.check_stream(stream, "exclusive_scan")?;
    check_len(
        "exclusive_scan (output = input + 1)",
        out.len(),
        x.len() + 1,
    )?;
    stream.run(
        out,
        |out| {
            let o = out.host_view_mut()?;
            let mut run = 0u32;
            for (slot, &v) in o.iter_mut().zip(x.host_view()?) {
                *slot = run;
                run = run.wrapping_add(v);
            }
            o[x.len()] = run;
            Ok(())
        },
        |out, q| {
            let n = x.len() as u64;
            if n <= ONE_BLOCK_SCAN {
                let args = Args::new().buf(x).u64(n).buf(out);
                // SAFETY: exclusive_scan_u32(const u32* x, u64 n, u32* out): x holds n
                // elements and out n + 1 (checked above); one block.
                return unsafe {
                    launch(q, (&PERMUTE, "exclusive_scan_u32"), 1, WIDE_BLOCK, 0, args)
                };
            }
            let tiles = n.div_ceil(SCAN_TILE);
            let tiles_u32 = u32::try_from(tiles).map_err(|_| {
                Error::InvalidArgument(format!("exclusive_scan: {n} elements are too many"))
            })?;
            let args = Args::new().buf(x).u64(n).buf(out);
            // SAFETY: scan_tile_sums(const u32* x, u64 n, u32* out), one block of 1024 per
            // tile of SCAN_TILE: x holds n, out n + 1 > every tile's first slot.
            unsafe {
                launch(
                    q,
                    (&PERMUTE, "scan_tile_sums"),
                    tiles_u32,
                    WIDE_BLOCK,
                    0,
                    args,
                )?
            };
            let args = Args::new().buf(out).u64(n).u64(tiles);
            // SAFETY: scan_tile_bases(u32* out, u64 n, u64 tiles), one block: out holds n + 1,
            // the tiles' first slots and slot n.
            unsafe { launch(q, (&PERMUTE, "scan_tile_bases"), 1, WIDE_BLOCK, 0, args)? };
            let args = Args::new().buf(x).u64(n).buf(out);
            // SAFETY: scan_tiles(const u32* x, u64 n, u32* out), one block of 1024 per tile:
            // x holds n, out n + 1 (checked above); each block writes its own tile only.
            unsafe { launch(q, (&PERMUTE, "scan_tiles"), tiles_u32, WIDE_BLOCK, 0, args) }
        },
    )
}

/// The widest unit (16, 8, 4, 2 or 1 bytes) that divides a row of `row_bytes` and both
/// addresses, and the kernel suffix for it.
fn unit_for(row_bytes: usize, a: u64, b: u64) -> (usize, &'static str, &'static str) {
    const UNITS: [(usize, &str, &str); 5] = [
        (16, "gather_rows_b16", "scatter_rows_b16"),
        (8, "gather_rows_b8", "scatter_rows_b8"),
        (4, "gather_rows_b4", "scatter_rows_b4"),
        (2, "gather_rows_b2", "scatter_rows_b2"),
        (1, "gather_rows_b1", "scatter_rows_b1"),
    ];
    let fits = |u: usize| row_bytes % u == 0 && a % u as u64 == 0 && b % u as u64 == 0;
    UNITS
        .into_iter()
        .find(|&(u, _, _)| fits(u))
        .unwrap_or(UNITS[4])
}

/// `dst` row `i` = `src` row `idx[i]` (rows of `cols` elements): `dst` holds `idx.len()` rows.
/// An index past the last row of `src` gives a row of zero bits.
pub fn gather_rows<T: DType>(
    stream: &Stream,
    src: &Buffer<T>,
    cols: usize,
    idx: &Buffer<u32>,
    dst: &mut Buffer<T>,
) -> Result<()> {
    src.check_stream(stream, "gather_rows")?;
    idx.check_stream(stream, "gather_rows")?;
    dst.check_stream(stream, "gather_rows")?;
    let src_rows = rows_of("gather_rows", src.len(), cols)?;
    let dst_len = crate::size::product("gather_rows (output rows × cols)", &[idx.len(), cols])?;
    check_len("gather_rows (output rows)", dst.len(), dst_len)?;
    if idx.is_empty() {
        return Ok(());
    }
    stream.run(
        dst,
        |dst| {
            let (sv, iv) = (src.host_view()?, idx.host_view()?);
            for (out, &i) in dst.host_view_mut()?.chunks_exact_mut(cols).zip(iv) {
                // The index is checked before it scales: past src's rows, i · cols may overflow.
                let i = i as usize;
                match (i < src_rows).then(|| &sv[i * cols..(i + 1) * cols]) {
                    Some(row) => out.copy_from_slice(row),
                    None => out.fill(T::from_bits_u64(0)),
                }
            }
            Ok(())
        },
        |dst, q| {
            // SAFETY: src holds src_rows rows, idx idx.len() indices and dst idx.len() rows of
            // `cols` elements (checked above).
            unsafe {
                gather_rows_raw(
                    q,
                    src.device_ptr(),
                    src_rows,
                    cols * std::mem::size_of::<T>(),
                    idx.device_ptr(),
                    idx.len(),
                    dst.device_ptr(),
                )
            }
        },
    )
}

/// [`gather_rows`] on raw device addresses (for callers gathering within a larger
/// workspace, such as the MoE layer): `m` rows of `row_bytes`.
///
/// # Safety
/// `src` must hold `src_rows` rows, `idx` `m` u32 indices and `dst` `m` rows, all live on the
/// stream's device.
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn gather_rows_raw(
    q: Queue<'_>,
    src: u64,
    src_rows: usize,
    row_bytes: usize,
    idx: u64,
    m: usize,
    dst: u64,
) -> Result<()> {
    if m == 0 || row_bytes == 0 {
        return Ok(());
    }
    let (unit, name, _) = unit_for(row_bytes, src, dst);
    let units = (row_bytes / unit) as u64;
    let m = m as u64;
    let grid = fill_grid(q.gpu, (&PERMUTE, name), m * units, BLOCK as u64)?;
    let args = Args::new()
        .ptr(src)
        .u64(src_rows as u64)
        .ptr(idx)
        .u64(m)
        .u64(units)
        .ptr(dst);
    // SAFETY: gather_rows_bU(const U* src, u64 src_rows, const u32* idx, u64 m, u64 units,
    // U* dst): src holds src_rows rows and dst m rows of `units` U-byte units each (U divides
    // the row size and both addresses); idx holds m indices, checked against src_rows.
    unsafe { launch(q, (&PERMUTE, name), grid, BLOCK, 0, args) }
}

/// `dst` row `idx[i]` = `src` row `i` (rows of `cols` elements): `src` holds `idx.len()` rows.
/// Indices past the last row of `dst` are skipped; rows no index names keep their contents.
/// Indices should be distinct: where two are equal, which source lands is unspecified.
pub fn scatter_rows<T: DType>(
    stream: &Stream,
    src: &Buffer<T>,
    cols: usize,
    idx: &Buffer<u32>,
    dst: &mut Buffer<T>,
) -> Result<()> {
    src.check_stream(stream, "scatter_rows")?;
    idx.check_stream(stream, "scatter_rows")?;
    dst.check_stream(stream, "scatter_rows")?;
    let dst_rows = rows_of("scatter_rows", dst.len(), cols)?;
    let src_len = crate::size::product("scatter_rows (input rows × cols)", &[idx.len(), cols])?;
    check_len("scatter_rows (input rows)", src.len(), src_len)?;
    if idx.is_empty() {
        return Ok(());
    }
    stream.run(
        dst,
        |dst| {
            let (sv, iv) = (src.host_view()?, idx.host_view()?);
            let dv = dst.host_view_mut()?;
            for (row, &i) in sv.chunks_exact(cols).zip(iv) {
                if (i as usize) < dst_rows {
                    dv[i as usize * cols..(i as usize + 1) * cols].copy_from_slice(row);
                }
            }
            Ok(())
        },
        |dst, q| {
            let d = q.gpu;
            let row_bytes = cols * std::mem::size_of::<T>();
            let (unit, _, name) = unit_for(row_bytes, src.device_ptr(), dst.device_ptr());
            let units = (row_bytes / unit) as u64;
            let m = idx.len() as u64;
            let grid = fill_grid(d, (&PERMUTE, name), m * units, BLOCK as u64)?;
            let args = Args::new()
                .buf(src)
                .buf(idx)
                .u64(m)
                .u64(units)
                .buf(dst)
                .u64(dst_rows as u64);
            // SAFETY: scatter_rows_bU(const U* src, const u32* idx, u64 m, u64 units, U* dst,
            // u64 dst_rows): src holds m rows and dst dst_rows rows of `units` U-byte units; indices
            // are checked against dst_rows.
            unsafe { launch(q, (&PERMUTE, name), grid, BLOCK, 0, args) }
        },
    )
}

/// The outputs and scratch of a stable sort of `len` keys into `bins` buckets, allocated once
/// ([`KeySort::new`]) so that [`sort_by_key`] allocates nothing.
///
/// After a sort: `counts[b]` = keys equal to `b`; `offsets[b]` = where bucket `b` starts in
/// the sorted order (`offsets[bins]` = the number of keys `< bins`); `order[p]` = the input
/// position of the `p`-th key in sorted order (equal keys keep their input order); `rank[i]`
/// = where input `i` went (the inverse of `order`). Keys `>= bins` sort after all others, in
/// input order, and are not counted.
pub struct KeySort {
    bins: usize,
    pub counts: Buffer<u32>,
    pub offsets: Buffer<u32>,
    pub order: Buffer<u32>,
    pub rank: Buffer<u32>,
    scratch: Scratch,
}

impl std::fmt::Debug for KeySort {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "KeySort({} keys, {} bins)", self.len(), self.bins)
    }
}

impl KeySort {
    /// Buffers for sorting `len` keys into `bins` buckets (1 to [`MAX_BINS`]).
    pub fn new(stream: &Stream, len: usize, bins: usize) -> Result<KeySort> {
        check_bins("KeySort", bins)?;
        check_count("KeySort", len)?;
        Ok(KeySort {
            bins,
            counts: Buffer::uninit(stream, bins)?,
            offsets: Buffer::uninit(stream, bins + 1)?,
            order: Buffer::uninit(stream, len)?,
            rank: Buffer::uninit(stream, len)?,
            scratch: Scratch::new(stream, Self::scratch_bytes(len, bins))?,
        })
    }

    /// Per-tile counts of every bucket (the overflow one included).
    fn scratch_bytes(len: usize, bins: usize) -> usize {
        sort_scratch_words(len, bins) * 4
    }

    pub fn bins(&self) -> usize {
        self.bins
    }

    /// The number of keys it sorts.
    pub fn len(&self) -> usize {
        self.order.len()
    }

    pub fn is_empty(&self) -> bool {
        self.order.is_empty()
    }
}

/// Sorts `keys` (as many as `sort` was made for) stably into `sort`'s buffers: three kernels,
/// no atomics, nothing allocated.
pub fn sort_by_key(stream: &Stream, keys: &Buffer<u32>, sort: &mut KeySort) -> Result<()> {
    keys.check_stream(stream, "sort_by_key")?;
    sort.order.check_stream(stream, "sort_by_key")?;
    check_len("sort_by_key (keys)", keys.len(), sort.len())?;
    let n = keys.len();
    let bins = sort.bins;
    stream.run(
        sort,
        |sort| {
            let kv = keys.host_view()?;
            let bucket = |k: u32| (k as usize).min(bins);
            let mut totals = vec![0u32; bins + 1];
            for &k in kv {
                totals[bucket(k)] += 1;
            }
            let mut next = vec![0u32; bins + 1];
            let mut run = 0u32;
            for (b, &c) in totals.iter().enumerate() {
                next[b] = run;
                run += c;
            }
            sort.counts
                .host_view_mut()?
                .copy_from_slice(&totals[..bins]);
            sort.offsets.host_view_mut()?.copy_from_slice(&next);
            let order = sort.order.host_view_mut()?;
            let mut ranks = vec![0u32; n];
            for (i, &k) in kv.iter().enumerate() {
                let b = bucket(k);
                order[next[b] as usize] = i as u32;
                ranks[i] = next[b];
                next[b] += 1;
            }
            sort.rank.host_view_mut()?.copy_from_slice(&ranks);
            Ok(())
        },
        |sort, q| {
            // SAFETY: keys hold n words, the sort's buffers n (order, rank), bins (counts) and
            // bins + 1 (offsets) words, its scratch sort_scratch_words(n, bins) words.
            unsafe {
                sort_by_key_raw(
                    q,
                    keys.device_ptr(),
                    n,
                    bins,
                    sort.scratch.ptr(),
                    [
                        sort.counts.device_ptr(),
                        sort.offsets.device_ptr(),
                        sort.order.device_ptr(),
                        sort.rank.device_ptr(),
                    ],
                )
            }
        },
    )
}

/// Keys per tile of the sort of `n` keys: [`SORT_TILE`], doubled until there are at most
/// [`MAX_SORT_TILES`] tiles; a power of two (the scatter shifts by it) and a multiple of the
/// block, as the kernels need.
fn sort_tile(n: usize) -> usize {
    let mut tile = SORT_TILE;
    while n.div_ceil(tile) > MAX_SORT_TILES {
        tile *= 2;
    }
    tile
}

/// Words of scratch (per-tile counts of every bucket, the overflow one included) that
/// [`sort_by_key_raw`] takes for up to `len` keys into `bins` buckets: a bound on the tiles
/// of every `n <= len` (at most `ceil(n / 256)` and at most [`MAX_SORT_TILES`]).
pub(crate) fn sort_scratch_words(len: usize, bins: usize) -> usize {
    len.div_ceil(SORT_TILE).clamp(1, MAX_SORT_TILES) * (bins + 1)
}

/// The device body of [`sort_by_key`] on raw addresses (three kernels, nothing allocated, no
/// host sync, graph-capturable): `out` = [counts (bins words), offsets (bins + 1), order (n),
/// rank (n)], as [`KeySort`] describes them. For callers that keep these in their own
/// workspace (the MoE layer's prefill dispatch).
///
/// `sort_count` (a block of 256 per tile of 256 keys) ranks each key within its tile and
/// bucket into `rank` and writes the tile's counts bucket-major into the scratch;
/// `sort_offsets` (a warp per bucket) scans each bucket's tile counts in place into each
/// tile's first slot within the bucket and writes the bucket totals to `counts`;
/// `sort_scatter` (grid-stride) scans the totals in every block (block 0 writes `offsets`) and
/// puts each key at bucket slot + tile slot + rank. The last two are programmatic dependent
/// launches (on Hopper their blocks are placed while the kernel before runs, and wait for it).
///
/// # Safety
/// `keys` must hold `n` u32 and `scratch` [`sort_scratch_words`]`(m, bins)` words for some
/// `m >= n`, the outputs the words above, all live device memory of the queue's device; bins
/// at most [`MAX_BINS`].
pub(crate) unsafe fn sort_by_key_raw(
    q: crate::device::Queue<'_>,
    keys: u64,
    n: usize,
    bins: usize,
    scratch: u64,
    [counts, offsets, order, rank]: [u64; 4],
) -> Result<()> {
    let tile = sort_tile(n);
    let tiles = n.div_ceil(tile);
    let shared = (bins as u32 + 1) * 4;
    // n < u32::MAX (KeySort::new, the MoE plan's checks), so tile and tiles fit u32.
    let (n64, bins32, tile32, tiles32) = (n as u64, bins as u32, tile as u32, tiles as u32);
    if tiles > 0 {
        let args = Args::new()
            .ptr(keys)
            .u64(n64)
            .u32(bins32)
            .u32(tile32)
            .u32(tiles32)
            .ptr(scratch)
            .ptr(rank);
        // SAFETY: sort_count(const u32* keys, u64 n, u32 bins, u32 tile, u32 tiles, u32*
        // tile_counts, u32* rank), one block of 256 per tile (tile a multiple of 256), bins + 1
        // words of shared memory: the scratch holds tiles·(bins + 1) words (tiles <= the bound
        // of sort_scratch_words), rank n.
        unsafe { launch(q, (&PERMUTE, "sort_count"), tiles32, BLOCK, shared, args)? };
    }
    // A warp per bucket.
    let warps_per_block = (BLOCK / 32) as usize;
    let scan_grid = u32::try_from((bins + 1).div_ceil(warps_per_block))
        .map_err(|_| Error::InvalidArgument(format!("sort_by_key: {bins} bins")))?;
    let args = Args::new()
        .ptr(scratch)
        .u32(tiles32)
        .u32(bins32)
        .ptr(counts);
    // SAFETY: sort_offsets(u32* tile_counts, u32 tiles, u32 bins, u32* counts), a warp per
    // bucket (bins + 1 warps, 8 a block): tile_counts holds tiles·(bins + 1) words, counts
    // bins. It waits for the previous kernel before it touches anything.
    unsafe {
        launch_as(
            q,
            (&PERMUTE, "sort_offsets"),
            scan_grid,
            BLOCK,
            0,
            args,
            true,
        )?
    };
    // With no keys it still runs (one block): it writes the offsets.
    let grid = fill_grid(q.gpu, (&PERMUTE, "sort_scatter"), n64, BLOCK as u64)?;
    let args = Args::new()
        .ptr(keys)
        .u64(n64)
        .u32(bins32)
        .u32(tile.trailing_zeros())
        .u32(tiles32)
        .ptr(scratch)
        .ptr(counts)
        .ptr(offsets)
        .ptr(order)
        .ptr(rank);
    // SAFETY: sort_scatter(const u32* keys, u64 n, u32 bins, u32 tile_log2, u32 tiles, const u32*
    // tile_starts, const u32* counts, u32* offsets, u32* order, u32* rank), grid-stride, bins
    // + 1 words of shared memory: keys, order and rank hold n words, the scratch tiles·(bins +
    // 1), counts bins, offsets bins + 1, and every position written is below n (the slots
    // partition 0..n). It waits for the previous kernel before it touches anything.
    unsafe {
        launch_as(
            q,
            (&PERMUTE, "sort_scatter"),
            grid,
            BLOCK,
            shared,
            args,
            true,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The scratch sized for `len` keys covers the tiles of every shorter sort (the MoE
    /// workspace sizes it once for its most slots), and tiles stay multiples of the block.
    #[test]
    fn sort_scratch_covers_every_shorter_sort() {
        for bins in [1, 128, 257, MAX_BINS] {
            let mut need = 0;
            for n in (0..300_000)
                .step_by(97)
                .chain([1 << 18, (1 << 18) + 1, 1 << 20])
            {
                let tile = sort_tile(n);
                assert!(tile.is_power_of_two() && tile % BLOCK as usize == 0);
                let tiles = n.div_ceil(tile);
                assert!(tiles <= MAX_SORT_TILES, "n={n} bins={bins}");
                need = need.max(tiles.max(1) * (bins + 1));
                assert!(sort_scratch_words(n, bins) >= need, "n={n} bins={bins}");
            }
        }
        // The MoE prefill shapes keep a tile of 256 keys: 128 blocks at 32k keys.
        assert_eq!(sort_tile(32_768), 256);
        assert_eq!(sort_tile(16_384), 256);
    }
}
