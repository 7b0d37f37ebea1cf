// archs: sm_75 sm_80 sm_90 sm_90a
// Permutation primitives for MoE dispatch: histogram, exclusive prefix sum, a stable
// counting sort of small integer keys, and row gather / scatter.
//   histogram_u32: block 256, grid-stride; per-block counts in shared memory (bins words of
//     dynamic shared memory), then added into the zeroed global counts (integer adds: the
//     result does not depend on their order).
//   exclusive_scan_u32: one block of 1024; tiles of 4096 (4 per thread), carried in order.
//   scan_tile_sums / scan_tile_bases / scan_tiles: the same scan over many blocks for long
//     arrays, with no scratch: each block of 1024 sums its tile of 4096 into out[tile·4096],
//     one block scans those sums in place into each tile's base (and writes the total), then
//     each block reads its base and scans its tile from it.
//   sort_count / sort_offsets / sort_scatter: the stable sort (keys >= bins go to one
//     overflow bucket after every valid key). Tiles of 256 keys (more past 1024 tiles), one
//     block of 256 per tile ranks each key within its tile and bucket (rounds of 256, warps
//     one after another, lanes by __match_any_sync, so equal keys keep their input order) and
//     counts the buckets; a warp per bucket scans the bucket's tile counts in place and writes
//     its total; then every block scans the totals (bins words) in shared memory and places
//     its keys at bucket slot + tile slot + rank, all in parallel. The last two are
//     programmatic dependent launches.
//   gather_rows_* / scatter_rows_*: block 256, grid-stride over (row, unit) with units of 16,
//     8, 4, 2 or 1 bytes, whichever the row size and addresses allow.

extern "C" __global__ void __launch_bounds__(256) histogram_u32(const u32* __restrict__ keys, u64 n, u32 bins, u32* __restrict__ counts) {
    extern __shared__ u32 local[];
    for (u32 b = threadIdx.x; b < bins; b += blockDim.x) local[b] = 0;
    __syncthreads();
    const u64 stride = (u64)gridDim.x * blockDim.x;
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < n; i += stride) {
        const u32 k = keys[i];
        if (k < bins) atomicAdd(&local[k], 1u);
    }
    __syncthreads();
    for (u32 b = threadIdx.x; b < bins; b += blockDim.x)
        if (local[b]) atomicAdd(&counts[b], local[b]);
}

// out[i] = x[0] + ... + x[i-1] for i <= n (out has n + 1 entries; out[n] is the total).
extern "C" __global__ void __launch_bounds__(1024) exclusive_scan_u32(const u32* __restrict__ x, u64 n, u32* __restrict__ out) {
    u32 carry = 0;
    for (u64 base = 0; base < n; base += 4ull * blockDim.x) {
        const u64 first = base + 4ull * threadIdx.x;
        u32 v[4];
#pragma unroll
        for (int j = 0; j < 4; ++j) v[j] = first + j < n ? x[first + j] : 0u;
        const u32 mine = v[0] + v[1] + v[2] + v[3];
        u32 tile_total;
        u32 run = carry + block_exclusive_scan(mine, &tile_total);
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            if (first + j < n) out[first + j] = run;
            run += v[j];
        }
        carry += tile_total;
    }
    if (threadIdx.x == 0) out[n] = carry;
}

// The many-block scan keeps its tile sums in `out` itself (slot t·4096, which the last
// pass overwrites only after reading it), so it needs no scratch memory.
extern "C" __global__ void __launch_bounds__(1024) scan_tile_sums(const u32* __restrict__ x, u64 n, u32* __restrict__ out) {
    const u64 first = (u64)blockIdx.x * 4096u + 4ull * threadIdx.x;
    u32 mine = 0;
#pragma unroll
    for (int j = 0; j < 4; ++j) mine += first + j < n ? x[first + j] : 0u;
    const u32 total = block_sum(mine);
    if (threadIdx.x == 0) out[(u64)blockIdx.x * 4096u] = total;
}

// One block: the tile sums at out[t·4096] become each tile's base (an exclusive scan in
// place, each thread a contiguous run of tiles); out[n] gets the total.
extern "C" __global__ void __launch_bounds__(1024) scan_tile_bases(u32* __restrict__ out, u64 n, u64 tiles) {
    const u64 per = (tiles + blockDim.x - 1) / blockDim.x;
    const u64 t0 = per * threadIdx.x, t1 = min(t0 + per, tiles);
    u32 mine = 0;
    for (u64 t = t0; t < t1; ++t) mine += out[t * 4096u];
    u32 total;
    u32 run = block_exclusive_scan(mine, &total);
    for (u64 t = t0; t < t1; ++t) {
        const u32 v = out[t * 4096u];
        out[t * 4096u] = run;
        run += v;
    }
    if (threadIdx.x == 0) out[n] = total;
}

extern "C" __global__ void __launch_bounds__(1024) scan_tiles(const u32* __restrict__ x, u64 n, u32* __restrict__ out) {
    __shared__ u32 base;
    const u64 first = (u64)blockIdx.x * 4096u + 4ull * threadIdx.x;
    if (threadIdx.x == 0) base = out[(u64)blockIdx.x * 4096u];
    __syncthreads();
    u32 v[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) v[j] = first + j < n ? x[first + j] : 0u;
    u32 tile_total;
    u32 run = base + block_exclusive_scan(v[0] + v[1] + v[2] + v[3], &tile_total);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        if (first + j < n) out[first + j] = run;
        run += v[j];
    }
}

// The sort's tiles are `tile` keys (256 or more, a multiple of 256: ops::permute picks it),
// one block of 256 per tile; tile_counts is bucket-major ([b * tiles + t]), so that each
// bucket's per-tile counts are one contiguous run that a warp scans coalesced. rank[] carries
// each key's rank within its tile and bucket from sort_count to sort_scatter, which adds the
// bucket's and the tile's first slots.

// Ranks each key among the keys of its bucket before it in the tile (stable: rounds of 256 in
// index order, warps one after another, lanes by __match_any_sync) and writes the tile's
// count of each bucket. bins + 1 words of dynamic shared memory.
extern "C" __global__ void __launch_bounds__(256) sort_count(const u32* __restrict__ keys, u64 n, u32 bins, u32 tile, u32 tiles, u32* __restrict__ tile_counts, u32* __restrict__ rank) {
    extern __shared__ u32 next[];  // keys of each bucket ranked so far in this tile
    // sort_offsets (a programmatic dependent launch) may be placed now: it waits for us.
    release_next_grid();
    const u32 buckets = bins + 1;
    for (u32 b = threadIdx.x; b < buckets; b += blockDim.x) next[b] = 0;
    __syncthreads();
    const u32 lane = threadIdx.x & 31u, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    const u32 below = (1u << lane) - 1u;
    const u64 first = (u64)blockIdx.x * tile;
    for (u32 r = 0; r < tile && first + r < n; r += blockDim.x) {
        const u64 i = first + r + threadIdx.x;
        const bool valid = i < n;
        const u32 key = valid ? keys[i] : 0u;
        const u32 bucket = key < bins ? key : bins;
        // Lanes past n form their own group (their tag has the top bit set) and write nothing.
        const u32 tag = valid ? bucket : (0x80000000u | bucket);
        const u32 peers = __match_any_sync(0xffffffffu, tag);
        const u32 leader = __ffs(peers) - 1;
        u32 start = 0;
        for (u32 w = 0; w < warps; ++w) {
            if (warp == w && valid && lane == leader) {
                start = next[bucket];
                next[bucket] = start + __popc(peers);
            }
            __syncthreads();
        }
        start = __shfl_sync(0xffffffffu, start, leader);
        if (valid) rank[i] = start + __popc(peers & below);
    }
    // The last round ended with a barrier: next[] holds the tile's counts.
    u32* col = tile_counts + blockIdx.x;
    for (u32 b = threadIdx.x; b < buckets; b += blockDim.x) col[(u64)b * tiles] = next[b];
}

// A warp per bucket (bins + 1 of them, 8 a block): scans the bucket's per-tile counts (a
// contiguous run of `tiles` words, coalesced, four chunks of 32 in flight) in place into each
// tile's first slot within the bucket, and writes counts[b] = the bucket's total (b < bins).
extern "C" __global__ void __launch_bounds__(256) sort_offsets(u32* __restrict__ tile_counts, u32 tiles, u32 bins, u32* __restrict__ counts) {
    wait_prior_grid();
    release_next_grid();
    const u32 lane = threadIdx.x & 31u;
    const u32 b = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (b > bins) return;  // whole warps: no barrier below
    u32* run = tile_counts + (u64)b * tiles;
    u32 carry = 0;
    for (u32 t0 = 0; t0 < tiles; t0 += 128u) {
        u32 v[4];
#pragma unroll
        for (u32 k = 0; k < 4; ++k) {
            const u32 t = t0 + 32u * k + lane;
            v[k] = t < tiles ? run[t] : 0u;
        }
#pragma unroll
        for (u32 k = 0; k < 4; ++k) {
            u32 incl = v[k];
#pragma unroll
            for (u32 o = 1; o < 32; o <<= 1) {
                const u32 up = __shfl_up_sync(0xffffffffu, incl, o);
                if (lane >= o) incl += up;
            }
            const u32 t = t0 + 32u * k + lane;
            if (t < tiles) run[t] = carry + incl - v[k];
            carry += __shfl_sync(0xffffffffu, incl, 31);
        }
    }
    if (b < bins && lane == 0) counts[b] = carry;
}

// Each block first scans counts[] into every bucket's first slot (bins + 1 words of dynamic
// shared memory; block 0 writes them to offsets[], offsets[bins] = the valid keys), then
// places its keys (grid-stride): pos = the bucket's first slot + the tile's first slot within
// the bucket + the key's rank there; order[pos] = i and rank[i] = pos.
extern "C" __global__ void __launch_bounds__(256) sort_scatter(const u32* __restrict__ keys, u64 n, u32 bins, u32 tile_log2, u32 tiles, const u32* tile_starts, const u32* counts, u32* __restrict__ offsets, u32* __restrict__ order, u32* __restrict__ rank) {
    // tile_starts and counts (the previous grid's, read after the wait) take plain loads.
    extern __shared__ u32 base[];
    wait_prior_grid();
    for (u32 b = threadIdx.x; b < bins; b += blockDim.x) base[b] = counts[b];
    __syncthreads();
    // Each thread a run of consecutive buckets.
    const u32 per = (bins + blockDim.x - 1) / blockDim.x;
    const u32 lo = min(per * threadIdx.x, bins), hi = min(lo + per, bins);
    u32 mine = 0;
    for (u32 b = lo; b < hi; ++b) mine += base[b];
    u32 total;
    u32 run = block_exclusive_scan(mine, &total);
    for (u32 b = lo; b < hi; ++b) {
        const u32 v = base[b];
        base[b] = run;
        run += v;
    }
    if (threadIdx.x == 0) base[bins] = total;
    __syncthreads();
    if (blockIdx.x == 0)
        for (u32 b = threadIdx.x; b <= bins; b += blockDim.x) offsets[b] = base[b];
    const u64 stride = (u64)gridDim.x * blockDim.x;
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < n; i += stride) {
        const u32 key = keys[i];
        const u32 bucket = key < bins ? key : bins;
        const u32 pos = base[bucket] + tile_starts[(u64)bucket * tiles + (i >> tile_log2)] + rank[i];
        order[pos] = (u32)i;
        rank[i] = pos;
    }
}

template <typename U>
__device__ __forceinline__ void gather_rows(const U* __restrict__ src, u64 src_rows, const u32* __restrict__ idx, u64 m, u64 units, U* __restrict__ dst) {
    const u64 stride = (u64)gridDim.x * blockDim.x;
    const u64 total = m * units;
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < total; i += stride) {
        const u64 r = i / units, u = i - r * units;
        const u32 s = idx[r];
        U zero{};
        dst[i] = s < src_rows ? src[(u64)s * units + u] : zero;
    }
}

template <typename U>
__device__ __forceinline__ void scatter_rows(const U* __restrict__ src, const u32* __restrict__ idx, u64 m, u64 units, U* __restrict__ dst, u64 dst_rows) {
    const u64 stride = (u64)gridDim.x * blockDim.x;
    const u64 total = m * units;
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < total; i += stride) {
        const u64 r = i / units, u = i - r * units;
        const u32 d = idx[r];
        if (d < dst_rows) dst[(u64)d * units + u] = src[i];
    }
}

#define MOVE_ROWS(NAME, U)                                                                               \
extern "C" __global__ void __launch_bounds__(256) gather_rows_##NAME(const U* __restrict__ src, u64 src_rows, const u32* __restrict__ idx, u64 m, u64 units, U* __restrict__ dst) { gather_rows<U>(src, src_rows, idx, m, units, dst); } \
extern "C" __global__ void __launch_bounds__(256) scatter_rows_##NAME(const U* __restrict__ src, const u32* __restrict__ idx, u64 m, u64 units, U* __restrict__ dst, u64 dst_rows) { scatter_rows<U>(src, idx, m, units, dst, dst_rows); }
MOVE_ROWS(b1, u8)
MOVE_ROWS(b2, u16)
MOVE_ROWS(b4, u32)
MOVE_ROWS(b8, u64)
MOVE_ROWS(b16, uint4)
