// Definitions shared by the MoE kernel sources (moe, moe_router, moe_router_cluster, moe_gemm,
// moe_wgmma, moe_decode), prepended to each after the prelude (kernels/mod.rs): the dispatch
// block, the softmax top-k of a row, the grouped GEMM's parameters, tile, MMA and stage
// loads, and the router's parameters.
//
// Layouts (row-major): x [T, H]; a slot is (token t, rank r) = t·k + r; permuted rows are
// slots sorted by expert (expert e owns rows offsets[e] .. offsets[e+1]); w13 [E, 2I, H] holds
// w1 and w3 interleaved in blocks of 8 rows (rows 16q..16q+7 = w1 rows 8q.., 16q+8..16q+15 =
// w3 rows 8q..), so one warp's accumulators hold the gate and the up projection of the same
// 8 columns; w2 [E, H, I].

// The dispatch's offsets and GEMM work list from the per-expert counts `cnt` (shared memory,
// complete before the call), on one block: counts[e], offsets[E + 1], the first free row of
// each expert in `cursor` (shared; null: not wanted), work (expert, first row) per tile of
// `bm` rows in expert order and its length in n_items[0]. moe_dispatch_block's middle, and
// the tail of the prefill dispatch (moe_router.cu), so both write the same list.
__device__ void moe_dispatch_work(const u32* cnt, u32 experts, u32 bm, u32* counts, u32* offsets,
                                  u32* cursor, u32* work, u32* n_items) {
    // Each thread scans a contiguous run of experts: rows in the low 32 bits, tiles high.
    const u32 per = (experts + blockDim.x - 1) / blockDim.x;
    const u32 e0 = threadIdx.x * per, e1 = min(experts, e0 + per);
    u64 local = 0;
    for (u32 e = e0; e < e1; ++e) local += (u64)cnt[e] | ((u64)((cnt[e] + bm - 1) / bm) << 32);
    u64 total;
    u64 run = block_exclusive_scan(local, &total);
    for (u32 e = e0; e < e1; ++e) {
        const u32 c = cnt[e], row0 = (u32)run, tile0 = (u32)(run >> 32);
        counts[e] = c;
        offsets[e] = row0;
        if (cursor) cursor[e] = row0;
        for (u32 j = 0; j * bm < c; ++j) {
            work[2 * (tile0 + j)] = e;
            work[2 * (tile0 + j) + 1] = j * bm;
        }
        run += (u64)c | ((u64)((c + bm - 1) / bm) << 32);
    }
    if (threadIdx.x == 0) {
        offsets[experts] = (u32)total;
        n_items[0] = (u32)(total >> 32);
    }
}

// The dispatch on one block (any multiple of 32 threads); `cnt` and `cursor` are E words of
// shared memory each. With L2 the expert ids are read through L2 (other blocks wrote them
// in the same kernel); without, they are in this block's shared memory.
#define MOE_DISPATCH_HELD 4
template <bool L2>
__device__ void moe_dispatch_block(const u32* expert_of_slot, u32 slots, u32 experts, u32 k,
                                   u32 bm, u32* counts, u32* offsets, u32* order, u32* token_of,
                                   u32* slot_pos, u32* work, u32* n_items, u32* cnt, u32* cursor) {
    for (u32 e = threadIdx.x; e < experts; e += blockDim.x) cnt[e] = 0;
    const auto id = [&](u32 i) { return L2 ? __ldcg(expert_of_slot + i) : expert_of_slot[i]; };
    // A thread's first MOE_DISPATCH_HELD ids are loaded at once and kept for the placement
    // below.
    u32 held[MOE_DISPATCH_HELD];
#pragma unroll
    for (int h = 0; h < MOE_DISPATCH_HELD; ++h) {
        const u32 i = threadIdx.x + h * blockDim.x;
        held[h] = i < slots ? id(i) : 0xffffffffu;
    }
    const u32 rest = MOE_DISPATCH_HELD * blockDim.x;
    __syncthreads();
#pragma unroll
    for (int h = 0; h < MOE_DISPATCH_HELD; ++h)
        if (held[h] < experts) atomicAdd(&cnt[held[h]], 1u);
    for (u32 i = threadIdx.x + rest; i < slots; i += blockDim.x) {
        const u32 e = id(i);
        if (e < experts) atomicAdd(&cnt[e], 1u);
    }
    __syncthreads();
    moe_dispatch_work(cnt, experts, bm, counts, offsets, cursor, work, n_items);
    __syncthreads();
    const auto place = [&](u32 i, u32 e) {
        if (e >= experts) return;
        const u32 p = atomicAdd(&cursor[e], 1u);
        order[p] = i;
        token_of[p] = i / k;
        slot_pos[i] = p;
    };
#pragma unroll
    for (int h = 0; h < MOE_DISPATCH_HELD; ++h) place(threadIdx.x + h * blockDim.x, held[h]);
    for (u32 i = threadIdx.x + rest; i < slots; i += blockDim.x) place(i, id(i));
}

// Softmax top-k of one row of `e` logits (e <= 256) in shared memory, by one warp: the same
// choice as ops::route (largest first, NaN largest, ties to the lower index) and weights
// (renormalized over the chosen, or over the row). Lane r < k writes the r-th choice. Each
// pick is two warp reductions (the largest key, then the lowest index holding it).
__device__ __forceinline__ u32 moe_order_key(float x) {
    const u32 b = __float_as_uint(x);
    if (x != x) return 0xffffffffu;
    return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}
// The logit of an order key (the inverse of moe_order_key; NaN keys give a NaN).
__device__ __forceinline__ float moe_key_value(u32 key) {
    return __uint_as_float((key & 0x80000000u) ? (key & 0x7fffffffu) : ~key);
}
// J keys per lane (J·32 >= e): rows of at most 128 experts take half the work per pick.
template <int J>
__device__ u32 moe_route_row_j(const float* row, u32 e, u32 k, int renorm, float* w_out,
                               u32* i_out) {
    const u32 lane = threadIdx.x & 31u;
    // Keys of this lane's logits (index lane + 32j); 0 = absent (every real key is at least
    // 0x007fffff). Taken ones are marked in a bit mask, not cleared, so `key` stays in
    // registers (a store at a computed index would move it to local memory).
    u32 key[J];
#pragma unroll
    for (int j = 0; j < J; ++j) {
        const u32 i = lane + 32 * j;
        key[j] = i < e ? moe_order_key(row[i]) : 0u;
    }
    u32 taken = 0, my_idx = 0, my_key = 0, top_key = 0;
#pragma unroll 1
    for (u32 r = 0; r < k; ++r) {
        u32 local = 0;
#pragma unroll
        for (int j = 0; j < J; ++j) local = max(local, ((taken >> j) & 1u) ? 0u : key[j]);
        const u32 best = __reduce_max_sync(0xffffffffu, local);
        u32 cand = 0xffffffffu;
#pragma unroll
        for (int j = J - 1; j >= 0; --j)
            if (key[j] == best && !((taken >> j) & 1u)) cand = lane + 32 * j;
        const u32 bi = __reduce_min_sync(0xffffffffu, cand);
        if ((bi & 31u) == lane) taken |= 1u << (bi >> 5);
        if (r == 0) top_key = best;
        if (lane == r) { my_idx = bi; my_key = best; }
    }
    const float top = moe_key_value(top_key), my_val = moe_key_value(my_key);
    float denom;
    if (renorm) {
        denom = warp_sum(lane < k ? __expf(my_val - top) : 0.0f);
    } else {
        float part = 0.0f;
        for (u32 i = lane; i < e; i += 32) part += __expf(row[i] - top);
        denom = warp_sum(part);
    }
    if (lane < k) {
        w_out[lane] = __expf(my_val - top) / denom;
        i_out[lane] = my_idx;
    }
    return my_idx;
}
__device__ void moe_route_row(const float* row, u32 e, u32 k, int renorm, float* w_out,
                              u32* i_out) {
    if (e <= 128)
        moe_route_row_j<4>(row, e, k, renorm, w_out, i_out);
    else
        moe_route_row_j<8>(row, e, k, renorm, w_out, i_out);
}

// ---- the grouped GEMM: out[p, n] = Σ_k A[row(p), k] · W_e[n, k] for the permuted rows p of
// each expert e (the work list's tiles). A block of 8 warps computes a tile over one K split:
// the decode and middle tiles (16·MT rows × 64·NG columns, moe_gemm) load their fragments
// straight from global memory; the prefill tiles (64 or 96 × 128, moe_gemm_staged) stage A and W
// through shared memory. With splits > 1 each block stores its partial tile (f32) and the
// last block of a tile to finish (a ticket per tile) sums the partials in split order, so
// results are deterministic. Epilogues: 1 = SwiGLU of the interleaved gate/up columns into T
// act [rows, n/2], 2 = T out [rows, n] scaled by the routing weight of the row's slot (the
// f32 accumulators weighted, then rounded once: half the bytes of f32 rows for the combine
// to read). ----
#define MOE_WARPS 8

__device__ __forceinline__ void moe_prefetch_l2(const void* p) {
    asm volatile("prefetch.global.L2 [%0];" :: "l"(p));
}

// The first `early_k` k (from k_begin, below k_end) of a block's weight rows `rows` (null:
// none) into L2 while the previous kernel finishes: this thread takes every `stride`-th
// 128-byte line of each row from line `first` (the threads sharing a row split its lines).
template <typename T, int R>
__device__ __forceinline__ void moe_prefetch_rows_l2(const T* const (&rows)[R], u32 k_begin, u32 k_end,
                                                     u32 early_k, u32 first, u32 stride) {
    constexpr u32 LINE = 128 / sizeof(T);
    const u32 k_pf = min(k_end, k_begin + early_k);
#pragma unroll
    for (int i = 0; i < R; ++i)
        if (rows[i])
            for (u32 kc = k_begin + first * LINE; kc < k_pf; kc += stride * LINE) moe_prefetch_l2(rows[i] + kc);
}

// One arrival at a ticket shared by `arrivals` blocks; true in the last block to arrive,
// which resets the ticket for the next launch. Every thread's writes before the call are
// visible to the last block after it (a barrier, then thread 0's acq_rel atomic at GPU
// scope: cheaper than a sequentially consistent __threadfence); that block reads them
// through L2 (__ldcg), not through its possibly stale L1. The answer reaches the block
// through the barrier (__syncthreads_or), not a static shared word: the wgmma prefill tile
// needs every byte of its shared memory (two blocks of 113 KB per SM).
// The barrier of the threads that compute a tile: the whole block, or (CONSUMERS) the 256
// threads of the two consumer warpgroups on named barrier 1 while a producer warp, past
// them, takes no part (the TMA wgmma tile, moe_wgmma.cu).
template <bool CONSUMERS>
__device__ __forceinline__ void moe_tile_sync() {
    if constexpr (CONSUMERS)
        asm volatile("bar.sync 1, 256;" ::: "memory");
    else
        __syncthreads();
}
template <bool CONSUMERS>
__device__ __forceinline__ int moe_tile_sync_or(int v) {
    if constexpr (CONSUMERS) {
        int r;
        asm volatile("{ .reg .pred p, q; setp.ne.s32 p, %1, 0; bar.red.or.pred q, 1, 256, p; selp.s32 %0, 1, 0, q; }"
                     : "=r"(r) : "r"(v) : "memory");
        return r;
    } else {
        return __syncthreads_or(v);
    }
}

template <bool CONSUMERS = false>
__device__ __forceinline__ bool moe_arrive_last(u32* ticket, u32 arrivals) {
    moe_tile_sync<CONSUMERS>();
    int last = 0;
    if (threadIdx.x == 0) {
        u32 old;
        asm volatile("atom.add.acq_rel.gpu.u32 %0, [%1], 1;" : "=r"(old) : "l"(ticket) : "memory");
        last = old == arrivals - 1;
        if (last) *ticket = 0;
    }
    return moe_tile_sync_or<CONSUMERS>(last) != 0;
}

struct MoeGemm {
    const void* a;           // [rows_a, k] T
    const u32* a_rows;       // permuted row -> row of a (null: the same row)
    const void* w;           // [groups, n, k] T
    u64 w_stride;            // elements between experts' matrices
    u32 n, k;
    const u32* counts;
    const u32* offsets;
    const u32* work;
    const u32* n_items;
    u32 splits, k_split;     // k_split: a multiple of 32
    float* partial;          // [splits, rows_cap, n]
    u32 rows_cap;
    u32* tickets;            // one per (item, n block), zero between launches
    // Non-zero: the work list may be read before the previous kernel finishes (it was
    // written two kernels back), and the block prefetches the first `early_k` k of its
    // weights into L2 while it waits.
    u32 early_k;
    // Non-zero: blocks take the tiles n block by n block, the work items fastest, so an
    // expert's several row tiles read the same weights at about the same time (all but the
    // first from L2); zero: item by item.
    u32 items_fastest;
    // Row tiles of this kernel per work item (the list's rows per item / BM; at least 1): 2 or
    // 3 where the other projection takes the wide tile and the list comes in its 192-row
    // items. The grid's items are this many per work item; empty ones exit.
    u32 subtiles;
    int epilogue;
    void* out;
    const float* slot_weight;  // epilogue 2
    const u32* order;        // epilogue 2: permuted row -> slot
    // The TMA wgmma tile only (null elsewhere): the weights' tensor map (CUtensorMap, 128
    // bytes in device memory, [experts, n, k], 128-byte swizzled boxes of 64 k × 128 rows).
    const void* w_map;
    // The TMA wgmma tile's down GEMM only (null elsewhere: the tile loads the rows by cp.async):
    // the token rows' 2D map (`act` [rows, k], 128-byte swizzled boxes of 64 k × 32 rows).
    const void* a_map;
};

__device__ __forceinline__ uint4 moe_ld_stream(const void* p) {
    uint4 v;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
}
__device__ __forceinline__ uint4 moe_ld_cached(const void* p) {
    uint4 v;
    asm volatile("ld.global.nc.v4.u32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
}

template <typename T> struct MoeMma;
template <> struct MoeMma<bf16> {
    static __device__ __forceinline__ void run(float (&c)[4], u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                     : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                     : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
    }
};
template <> struct MoeMma<f16> {
    static __device__ __forceinline__ void run(float (&c)[4], u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                     : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                     : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
    }
};

__device__ __forceinline__ float moe_silu(float g) { return g / (1.0f + __expf(-g)); }

// acc = this warp's tile (MT m16 tiles × NG n8 groups) over k in [k_begin, k_end): each lane
// loads 16 bytes (8 consecutive k) of its A rows (g and g + 8 of each m16 tile; null: zero
// rows) and W rows (column g of each n8 group) per 32-k step, every load of U steps before
// any MMA, so U·(NG + 2·MT) 16-byte loads are in flight. The k order inside a step is
// permuted identically for A and W, so the products are those of the plain layout. W is
// streamed (no L1 allocation), A stays cached. With LATE_A (the decode tiles, where W is all
// the traffic) only the W loads of the U steps are in flight together and each step's A
// fragment is loaded just before its MMAs (an L1 hit after the block's first warp): the
// registers that held A hold twice as many W loads. (Double-buffering the W loads in halves
// was no faster.)
template <typename T, int MT, int NG, int U, bool LATE_A = false>
__device__ __forceinline__ void moe_mma_range(float (&acc)[MT][NG][4], const T* const (&a_ptr)[MT][2],
                                              const T* const (&w_ptr)[NG], u32 k_begin, u32 k_end,
                                              u32 q) {
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int ng = 0; ng < NG; ++ng)
#pragma unroll
            for (int i = 0; i < 4; ++i) acc[mt][ng][i] = 0.0f;
    const uint4 zero = make_uint4(0, 0, 0, 0);
    // The loads of one k-step (32 k from k0) into `w` / `a`; steps past k_end load zeros.
    auto load_w = [&](uint4 (&w)[NG], u32 k0) {
        const u32 kc = k0 + q * 8;
#pragma unroll
        for (int ng = 0; ng < NG; ++ng)
            w[ng] = (kc < k_end && w_ptr[ng]) ? moe_ld_stream(w_ptr[ng] + kc) : zero;
    };
    auto load_a = [&](uint4 (&a)[MT][2], u32 k0) {
        const u32 kc = k0 + q * 8;
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int h = 0; h < 2; ++h)
                a[mt][h] = (kc < k_end && a_ptr[mt][h]) ? moe_ld_cached(a_ptr[mt][h] + kc) : zero;
    };
    auto mma = [&](const uint4 (&a)[MT][2], const uint4 (&w)[NG]) {
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int ng = 0; ng < NG; ++ng) {
                MoeMma<T>::run(acc[mt][ng], a[mt][0].x, a[mt][1].x, a[mt][0].y, a[mt][1].y,
                               w[ng].x, w[ng].y);
                MoeMma<T>::run(acc[mt][ng], a[mt][0].z, a[mt][1].z, a[mt][0].w, a[mt][1].w,
                               w[ng].z, w[ng].w);
            }
    };
    for (u32 kk = k_begin; kk < k_end; kk += 32 * U) {
        uint4 wv[U][NG], av[LATE_A ? 1 : U][MT][2];
#pragma unroll
        for (int u = 0; u < U; ++u) {
            load_w(wv[u], kk + u * 32);
            if (!LATE_A) load_a(av[u], kk + u * 32);
        }
#pragma unroll
        for (int u = 0; u < U; ++u) {
            if (LATE_A) load_a(av[0], kk + u * 32);
            mma(av[LATE_A ? 0 : u], wv[u]);
        }
    }
}

// A block's tile of the work list: (item, n block) and K split from blockIdx.x, the item's
// expert and rows. Without early_k it first waits for the previous kernel; false when the
// grid's bound on items exceeds this pass's work list.
struct MoeTile {
    u32 split, tile, nb, expert, rows, row0, k_begin, k_end;
};
__device__ __forceinline__ bool moe_gemm_tile(const MoeGemm& p, u32 bm, u32 bn, MoeTile& t) {
    const u32 n_blocks = (p.n + bn - 1) / bn;
    t.split = blockIdx.x % p.splits;
    t.tile = blockIdx.x / p.splits;  // (item, n block)
    const u32 items_cap = gridDim.x / (p.splits * n_blocks);  // the grid's bound on items
    t.nb = p.items_fastest ? t.tile / items_cap : t.tile % n_blocks;
    const u32 sub_item = p.items_fastest ? t.tile % items_cap : t.tile / n_blocks;
    const u32 subtiles = max(p.subtiles, 1u), item = sub_item / subtiles;
    if (!p.early_k) wait_prior_grid();
    // Through L2: under a programmatic launch these may be read before the wait.
    if (item >= __ldcg(p.n_items)) return false;
    t.expert = __ldcg(p.work + 2 * item);
    const u32 m0 = __ldcg(p.work + 2 * item + 1) + (sub_item % subtiles) * bm;
    const u32 count = __ldcg(p.counts + t.expert);
    if (m0 >= count) return false;  // a sub-tile past the item's last row
    t.rows = min(bm, count - m0);
    t.row0 = __ldcg(p.offsets + t.expert) + m0;
    t.k_begin = t.split * p.k_split;
    t.k_end = min(p.k, t.k_begin + p.k_split);
    return true;
}

// ---- the prefill tiles: 32·MT rows × 128 columns, 8 warps as 2 (rows) × 4 (columns) of
// 16·MT × 32 (MT m16 tiles × 4 n8 groups). A and W pass through a STAGES-deep ring of
// cp.async stages in dynamic shared memory, 64 k each (128-byte rows whose 16-byte chunks are
// XOR-swizzled by row, so ldmatrix reads are conflict-free), and reach the tensor cores
// through ldmatrix: the loads of the next stages stay in flight while the warps compute,
// instead of each warp waiting on its own global loads. W of the first stages is requested
// before the wait for the previous kernel (weights only; through L2). ----
#define MOE_SBK 64
__device__ __forceinline__ void moe_cp_async16(u32 dst, const void* src, u32 bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" :: "r"(dst), "l"(src), "r"(bytes) : "memory");
}
__device__ __forceinline__ void moe_cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void moe_cp_async_wait() { asm volatile("cp.async.wait_group %0;" :: "n"(N) : "memory"); }

// The cp.async loads of a prefill tile, BM rows of A and BN rows of W per 64-k stage into a
// STAGES-deep ring (stage: A then W, 128-byte rows): thread tid moves 16-byte chunk
// c = tid % 8 of tile rows r, r + P, ... (r = tid / 8, P = threads / 8), XOR-swizzled by row
// (chunk c ^ r % 8). Rows past the tile's rows or n, and k past k_end, are zero-filled.
template <typename T, u32 BM, u32 BN, u32 STAGES>
struct MoeStageLoads {
    static constexpr u32 P = MOE_WARPS * 4;
    static constexpr int AR = BM / P, WR = BN / P;
    static constexpr u32 A_BYTES = BM * MOE_SBK * 2, STAGE_BYTES = (BM + BN) * MOE_SBK * 2;
    static_assert(AR * P == BM && WR * P == BN, "whole rows per thread");
    const T* a;
    const T* w;
    const T* a_src[AR];
    const T* w_src[WR];
    u32 c, dst, k_begin, k_end, k_tiles;

    __device__ __forceinline__ MoeStageLoads(const MoeGemm& p, const MoeTile& t, u32 smem) {
        a = reinterpret_cast<const T*>(p.a);
        w = reinterpret_cast<const T*>(p.w) + (u64)t.expert * p.w_stride;
        c = threadIdx.x & 7u;
        const u32 r = threadIdx.x >> 3;
        dst = smem + r * 128 + ((c ^ (r & 7u)) << 4);
#pragma unroll
        for (int i = 0; i < AR; ++i) {
            const u32 row = r + P * i;
            a_src[i] = nullptr;
            if (row < t.rows) {
                const u32 prow = t.row0 + row;
                a_src[i] = a + (u64)(p.a_rows ? __ldcg(p.a_rows + prow) : prow) * p.k;
            }
        }
#pragma unroll
        for (int i = 0; i < WR; ++i) {
            const u32 n = t.nb * BN + r + P * i;
            w_src[i] = n < p.n ? w + (u64)n * p.k : nullptr;
        }
        k_begin = t.k_begin;
        k_end = t.k_end;
        k_tiles = (k_end - k_begin + MOE_SBK - 1) / MOE_SBK;
    }
    __device__ __forceinline__ void load_w(u32 kt) const {
        const u32 kc = k_begin + kt * MOE_SBK + c * 8, d = dst + (kt % STAGES) * STAGE_BYTES + A_BYTES;
#pragma unroll
        for (int i = 0; i < WR; ++i) {
            const bool ok = w_src[i] && kc < k_end;
            moe_cp_async16(d + i * P * 128, ok ? w_src[i] + kc : w, ok ? 16 : 0);
        }
    }
    __device__ __forceinline__ void load_a(u32 kt) const {
        const u32 kc = k_begin + kt * MOE_SBK + c * 8, d = dst + (kt % STAGES) * STAGE_BYTES;
#pragma unroll
        for (int i = 0; i < AR; ++i) {
            const bool ok = a_src[i] && kc < k_end;
            moe_cp_async16(d + i * P * 128, ok ? a_src[i] + kc : a, ok ? 16 : 0);
        }
    }
    // The first STAGES - 1 stages: W (and the early-k L2 prefetch, the 8 threads of a row
    // splitting its lines) before the wait for the previous kernel, A after it. Stage s's
    // data is then in commit groups 0..s, so waiting until at most STAGES - 2 groups are
    // pending covers stage kt; each later stage commits one group.
    __device__ __forceinline__ void start(const MoeGemm& p) const {
        if (p.early_k) moe_prefetch_rows_l2(w_src, k_begin, k_end, p.early_k, c, 8);
#pragma unroll
        for (u32 s = 0; s < STAGES - 1; ++s)
            if (s < k_tiles) load_w(s);
        if (p.early_k) wait_prior_grid();
        release_next_grid();
#pragma unroll
        for (u32 s = 0; s < STAGES - 1; ++s) {
            if (s < k_tiles) load_a(s);
            moe_cp_async_commit();
        }
    }
    // Requests stage kt + STAGES - 1 (or commits an empty group) once every thread is past
    // stage kt - 1, whose slot it reuses.
    __device__ __forceinline__ void next(u32 kt) const {
        const u32 n = kt + STAGES - 1;
        if (n < k_tiles) {
            load_w(n);
            load_a(n);
        }
        moe_cp_async_commit();
    }
};

// The parameters of the routers (moe_router.cu, moe_router_cluster.cu).
#define MOE_RWARPS 16
#define MOE_ROUTER_MAX_SPLITS 8

struct MoeRouter {
    const void* x;        // [tokens, k] T
    const void* w;        // [experts, k] T
    const float* bias;    // [experts] (nullable)
    u32 tokens, k, experts;
    u32 splits, k_split;  // k_split: a multiple of 32; 1 < splits <= 8 only with `route`
    u32 tile_rows;        // rows per row tile: at most 16·MT
    float* logits;        // [splits, tokens, experts]
    u32* tickets;         // row tiles + 1 words, zero between launches
    int route;
    u32 top_k;
    int renorm;
    float* weights;       // [tokens, top_k]
    u32* chosen;          // [tokens, top_k]
    u32 bm;               // rows per tile of the dispatch's GEMM work list
    u32* counts;
    u32* offsets;
    u32* order;
    u32* token_of;
    u32* slot_pos;
    u32* work;
    u32* n_items;
};
