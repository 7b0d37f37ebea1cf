// archs: sm_80 sm_90 sm_90a
// Mixture-of-Experts kernels (module `moe`): seeded weight init, the DeepSeek-style grouped
// sigmoid router, dispatch (tokens per expert, offsets, permutation, GEMM work list), the
// router (logits, softmax top-k and dispatch in one kernel), the device-driven grouped GEMM on tensor cores (mma.sync m16n8k16, bf16 / f16 in, f32
// accumulate) with its epilogues, the SwiGLU of the cuBLAS path, the combine, and the one-token
// decode kernel (the whole layer in one launch).
//
// Layouts (row-major): x [T, H]; a slot is (token t, rank r) = t·k + r; permuted rows are
// slots sorted by expert (expert e owns rows offsets[e] .. offsets[e+1]); w13 [E, 2I, H] holds
// w1 and w3 interleaved in blocks of 8 rows (rows 16q..16q+7 = w1 rows 8q.., 16q+8..16q+15 =
// w3 rows 8q..), so one warp's accumulators hold the gate and the up projection of the same
// 8 columns; w2 [E, H, I].

typedef float f32;  // for the kernel-name macros

// ---- seeded weights: identical bits on the CPU backend (moe/weights.rs `random_value`) ----
__device__ __forceinline__ u64 moe_mix64(u64 z) {
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}
// Uniform in [-scale, scale): 24 random bits, exact in f32.
__device__ __forceinline__ float moe_random(u64 seed, u64 i, float scale) {
    const u32 bits = (u32)(moe_mix64(seed ^ moe_mix64(i + 0x9e3779b97f4a7c15ull)) >> 40);
    const float u = (float)bits * 5.9604644775390625e-8f;  // 2^-24
    return (u * 2.0f - 1.0f) * scale;
}
template <typename T>
__device__ void moe_init_random(T* __restrict__ out, u64 n, u64 seed, float scale) {
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x)
        out[i] = from_f32<T>(moe_random(seed, i, scale));
}
#define MOE_INIT(T) \
    extern "C" __global__ void __launch_bounds__(256) moe_init_random_##T(T* out, u64 n, u64 seed, float scale) \
    { moe_init_random<T>(out, n, seed, scale); }
MOE_INIT(f32)
MOE_INIT(f16)
MOE_INIT(bf16)

// ---- DeepSeek-V3 router: sigmoid scores; selection by score + bias within the best
// `topk_group` of `n_group` groups (a group's score = the sum of its two best); weights are
// the chosen scores (without bias), renormalized if asked, times `scaling`. One warp per
// token, scores in shared memory (E floats per warp). Ties go to the lower index. ----
extern "C" __global__ void __launch_bounds__(128) moe_route_sigmoid_grouped(
    const float* __restrict__ logits, const float* __restrict__ bias, u32 tokens, u32 experts,
    u32 k, u32 n_group, u32 topk_group, int renorm, float scaling, float* __restrict__ weights,
    u32* __restrict__ indices) {
    extern __shared__ float moe_route_smem[];
    const u32 warp = threadIdx.x >> 5, lane = threadIdx.x & 31u;
    const u32 t = blockIdx.x * (blockDim.x >> 5) + warp;
    if (t >= tokens) return;
    float* sel = moe_route_smem + (size_t)warp * experts;
    const float* row = logits + (size_t)t * experts;
    const u32 per_group = experts / n_group;
    for (u32 e = lane; e < experts; e += 32) {
        const float s = 1.0f / (1.0f + __expf(-row[e]));
        sel[e] = s + (bias ? bias[e] : 0.0f);
    }
    __syncwarp();
    // Group scores (lane g holds group g's; n_group <= 32).
    float gscore = f32_neg_inf();
    if (lane < n_group) {
        float b1 = f32_neg_inf(), b2 = f32_neg_inf();
        for (u32 j = 0; j < per_group; ++j) {
            const float v = sel[lane * per_group + j];
            if (v > b1) { b2 = b1; b1 = v; } else if (v > b2) { b2 = v; }
        }
        gscore = per_group >= 2 ? b1 + b2 : b1;
    }
    // Keep the best topk_group groups: drop the others' experts from the selection.
    u32 kept = 0;  // bit g set: group g kept
    for (u32 r = 0; r < topk_group; ++r) {
        float best = gscore;
        u32 arg = lane;
        for (int o = 16; o > 0; o >>= 1) {
            const float ob = __shfl_xor_sync(0xffffffffu, best, o);
            const u32 oa = __shfl_xor_sync(0xffffffffu, arg, o);
            if (ob > best || (ob == best && oa < arg)) { best = ob; arg = oa; }
        }
        kept |= 1u << arg;
        if (lane == arg) gscore = f32_neg_inf();
    }
    __syncwarp();  // every lane has read the group scores before any is masked
    for (u32 e = lane; e < experts; e += 32)
        if (!((kept >> (e / per_group)) & 1u)) sel[e] = f32_neg_inf();
    __syncwarp();
    float chosen_w = 0.0f, sum = 0.0f;
    u32 chosen_i = 0;
    for (u32 r = 0; r < k; ++r) {
        float best = f32_neg_inf();
        u32 arg = 0xffffffffu;
        for (u32 e = lane; e < experts; e += 32) {
            const float v = sel[e];
            if (v > best || (v == best && e < arg)) { best = v; arg = e; }
        }
        for (int o = 16; o > 0; o >>= 1) {
            const float ob = __shfl_xor_sync(0xffffffffu, best, o);
            const u32 oa = __shfl_xor_sync(0xffffffffu, arg, o);
            if (ob > best || (ob == best && oa < arg)) { best = ob; arg = oa; }
        }
        if (arg >= experts) arg = 0;  // fewer than k candidates (cannot happen for valid configs)
        const float s = 1.0f / (1.0f + __expf(-row[arg]));
        sum += s;
        if (lane == r) { chosen_w = s; chosen_i = arg; }
        __syncwarp();
        if (lane == 0) sel[arg] = f32_neg_inf();
        __syncwarp();
    }
    if (lane < k) {
        const float w = renorm ? chosen_w / sum : chosen_w;
        weights[(size_t)t * k + lane] = w * scaling;
        indices[(size_t)t * k + lane] = chosen_i;
    }
}

// ---- dispatch: one block of 1024 threads. From the slots' expert ids: counts[E],
// offsets[E+1], order[p] (the slot at permuted row p), token_of[p] = order[p] / k,
// slot_pos[slot] = p, and the GEMM work list (one item per (expert, tile of `bm` rows):
// work[2i] = expert, work[2i+1] = first row within the expert) with its length in
// n_items[0]. Positions within an expert come from shared atomics, so the order inside an
// expert varies between runs; every row's result depends only on its own slot, so the
// layer's output does not. Shared memory: 2·E words. ----

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
        cursor[e] = row0;
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

extern "C" __global__ void __launch_bounds__(1024) moe_dispatch(
    const u32* __restrict__ expert_of_slot, u32 slots, u32 experts, u32 k, u32 bm,
    u32* __restrict__ counts, u32* __restrict__ offsets, u32* __restrict__ order,
    u32* __restrict__ token_of, u32* __restrict__ slot_pos, u32* __restrict__ work,
    u32* __restrict__ n_items) {
    extern __shared__ u32 moe_dispatch_smem[];
    moe_dispatch_block<true>(expert_of_slot, slots, experts, k, bm, counts, offsets, order, token_of,
                       slot_pos, work, n_items, moe_dispatch_smem, moe_dispatch_smem + experts);
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
// act [rows, n/2], 2 = f32 out scaled by the routing weight of the row's slot. ----
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
__device__ __forceinline__ bool moe_arrive_last(u32* ticket, u32 arrivals) {
    __syncthreads();
    int last = 0;
    if (threadIdx.x == 0) {
        u32 old;
        asm volatile("atom.add.acq_rel.gpu.u32 %0, [%1], 1;" : "=r"(old) : "l"(ticket) : "memory");
        last = old == arrivals - 1;
        if (last) *ticket = 0;
    }
    return __syncthreads_or(last) != 0;
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
    int epilogue;
    void* out;
    const float* slot_weight;  // epilogue 2
    const u32* order;        // epilogue 2: permuted row -> slot
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
// measured no faster on the H200.)
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
    const u32 item = p.items_fastest ? t.tile % items_cap : t.tile / n_blocks;
    if (!p.early_k) wait_prior_grid();
    // Through L2: under a programmatic launch these may be read before the wait.
    if (item >= __ldcg(p.n_items)) return false;
    t.expert = __ldcg(p.work + 2 * item);
    const u32 m0 = __ldcg(p.work + 2 * item + 1);
    t.rows = min(bm, __ldcg(p.counts + t.expert) - m0);
    t.row0 = __ldcg(p.offsets + t.expert) + m0;
    t.k_begin = t.split * p.k_split;
    t.k_end = min(p.k, t.k_begin + p.k_split);
    return true;
}

// The rest of a block's tile once its warps hold their accumulators: with splits > 1 the
// partial tile goes to `partial` and the tile's last block sums them; then the epilogue. The
// block is WM × WN warps (WM = 8 / WN), each MT m16 tiles × NG n8 groups: accumulator i of
// (mt, ng) of warp w is row (w / WN)·16·MT + mt·16 + g + 8·(i / 2), column
// nb·BN + (w % WN)·8·NG + ng·8 + 2q + i % 2 (BN = WN·8·NG). `red` holds 16·BN floats.
template <typename T, int MT, int NG, int WN>
__device__ void moe_gemm_finish(const MoeGemm& p, const MoeTile& t, float (&acc)[MT][NG][4],
                                float* red) {
    constexpr u32 BN = WN * NG * 8, WM = MOE_WARPS / WN;
    const u32 lane = threadIdx.x & 31u, warp = threadIdx.x >> 5;
    const u32 g = lane >> 2, q = lane & 3u;
    const u32 wrow = (warp / WN) * 16 * MT;
    const u32 col0 = t.nb * BN + (warp % WN) * (NG * 8);
    if (p.splits > 1) {
        // Store this split's partial tile, then let the tile's last block reduce.
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const u32 r = wrow + mt * 16 + h * 8 + g;
                if (r >= t.rows) continue;
                float* dst = p.partial + ((u64)t.split * p.rows_cap + t.row0 + r) * p.n;
#pragma unroll
                for (int ng = 0; ng < NG; ++ng) {
                    const u32 c = col0 + ng * 8 + 2 * q;
                    // Scalar stores: an odd n leaves rows 4-byte aligned only.
                    if (c < p.n) dst[c] = acc[mt][ng][2 * h];
                    if (c + 1 < p.n) dst[c + 1] = acc[mt][ng][2 * h + 1];
                }
            }
        if (!moe_arrive_last(&p.tickets[t.tile], p.splits)) return;
        // The whole block sums the tile's partials (coalesced, 8 loads in flight per thread,
        // added in split order), 16 rows at a time through shared memory back into the
        // accumulator layout.
        const u32 n_base = t.nb * BN;
        const u64 stride = (u64)p.rows_cap * p.n;
        for (u32 wm = 0; wm < WM; ++wm) {
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                const u32 r16 = wm * 16 * MT + mt * 16;
                if (r16 >= t.rows) break;  // the same for every thread
                for (u32 i = threadIdx.x; i < 16 * BN; i += blockDim.x) {
                    const u32 r = i / BN, c = i % BN;
                    float sum = 0.0f;
                    if (r16 + r < t.rows && n_base + c < p.n) {
                        const float* src = p.partial + ((u64)t.row0 + r16 + r) * p.n + n_base + c;
                        u32 sp = 0;
                        for (; sp + 8 <= p.splits; sp += 8) {
                            float v[8];
#pragma unroll
                            for (int j = 0; j < 8; ++j) v[j] = __ldcg(src + (sp + j) * stride);
#pragma unroll
                            for (int j = 0; j < 8; ++j) sum += v[j];
                        }
                        for (; sp < p.splits; ++sp) sum += __ldcg(src + sp * stride);
                    }
                    red[i] = sum;
                }
                __syncthreads();
                if (warp / WN == wm) {
#pragma unroll
                    for (int h = 0; h < 2; ++h)
#pragma unroll
                        for (int ng = 0; ng < NG; ++ng) {
                            const u32 c = (warp % WN) * (NG * 8) + ng * 8 + 2 * q;
                            acc[mt][ng][2 * h] = red[(h * 8 + g) * BN + c];
                            acc[mt][ng][2 * h + 1] = red[(h * 8 + g) * BN + c + 1];
                        }
                }
                __syncthreads();
            }
        }
    }

    // Epilogue.
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const u32 r = wrow + mt * 16 + h * 8 + g;
            if (r >= t.rows) continue;
            const u32 prow = t.row0 + r;
            if (p.epilogue == 1) {
                // Group pair (2j, 2j + 1) of this warp = (gate, up) of act columns
                // (col0 + 16j)/2 + 2q + {0, 1}.
                const u32 half_n = p.n >> 1;
#pragma unroll
                for (int j = 0; j < NG / 2; ++j) {
                    const u32 c = ((col0 + 16 * j) >> 1) + 2 * q;
                    if (c < half_n) {
                        T* dst = reinterpret_cast<T*>(p.out) + (u64)prow * half_n + c;
                        dst[0] = from_f32<T>(moe_silu(acc[mt][2 * j][2 * h]) * acc[mt][2 * j + 1][2 * h]);
                        dst[1] = from_f32<T>(moe_silu(acc[mt][2 * j][2 * h + 1]) * acc[mt][2 * j + 1][2 * h + 1]);
                    }
                }
            } else {
                const float scale = p.slot_weight[p.order[prow]];
                float* dst = reinterpret_cast<float*>(p.out) + (u64)prow * p.n;
#pragma unroll
                for (int ng = 0; ng < NG; ++ng) {
                    const u32 c = col0 + ng * 8 + 2 * q;
                    if (c < p.n) dst[c] = acc[mt][ng][2 * h] * scale;
                    if (c + 1 < p.n) dst[c + 1] = acc[mt][ng][2 * h + 1] * scale;
                }
            }
        }
}

// The decode and middle tiles: 16·MT rows × 64·NG columns, each warp MT m16 tiles × NG n8
// groups side by side, fragments straight from global memory (moe_mma_range).
template <typename T, int MT, int MOE_NG, int U, bool LATE_A>
__device__ void moe_gemm(const MoeGemm& p) {
    constexpr u32 MOE_BN = MOE_WARPS * MOE_NG * 8;
    const u32 lane = threadIdx.x & 31u, warp = threadIdx.x >> 5;
    MoeTile t;
    if (!moe_gemm_tile(p, 16 * MT, MOE_BN, t)) return;
    __shared__ float red[16 * MOE_BN];  // split-K sums
    const T* w = reinterpret_cast<const T*>(p.w) + (u64)t.expert * p.w_stride;
    const T* a = reinterpret_cast<const T*>(p.a);
    const u32 g = lane >> 2, q = lane & 3u;
    const u32 col0 = t.nb * MOE_BN + warp * (MOE_NG * 8);

    // This lane's A rows (g and g + 8 of each m16 tile) and W rows (column g of each n8 group).
    const T* a_ptr[MT][2];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const u32 r = mt * 16 + h * 8 + g;
            a_ptr[mt][h] = nullptr;
            if (r < t.rows) {
                const u32 prow = t.row0 + r;
                const u32 src = p.a_rows ? __ldcg(p.a_rows + prow) : prow;
                a_ptr[mt][h] = a + (u64)src * p.k;
            }
        }
    const T* w_ptr[MOE_NG];
#pragma unroll
    for (int ng = 0; ng < MOE_NG; ++ng) {
        const u32 n = col0 + ng * 8 + g;
        w_ptr[ng] = n < p.n ? w + (u64)n * p.k : nullptr;
    }
    if (p.early_k) {
        // The four lanes of a row split its lines.
        moe_prefetch_rows_l2(w_ptr, t.k_begin, t.k_end, p.early_k, q, 4);
        wait_prior_grid();
    }
    release_next_grid();

    float acc[MT][MOE_NG][4];
    moe_mma_range<T, MT, MOE_NG, U, LATE_A>(acc, a_ptr, w_ptr, t.k_begin, t.k_end, q);
    moe_gemm_finish<T, MT, MOE_NG, MOE_WARPS>(p, t, acc, red);
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
__device__ __forceinline__ void moe_ldmatrix4(u32 (&r)[4], u32 addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr) : "memory");
}

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

// One stage (64 k) of a warp's MMAs over its first LIVE m16 tiles (ldmatrix addresses as
// set up in moe_gemm_staged).
template <typename T, int LIVE, int MT, int NG>
__device__ __forceinline__ void moe_staged_mma(float (&acc)[MT][NG][4], u32 stage, const u32 (&a_row)[MT],
                                               const u32 (&w_row)[NG / 2], u32 a_chunk, u32 w_chunk, u32 l7) {
#pragma unroll
    for (u32 kk = 0; kk < MOE_SBK / 16; ++kk) {
        u32 af[LIVE][4], bf[NG / 2][4];
#pragma unroll
        for (int mt = 0; mt < LIVE; ++mt)
            moe_ldmatrix4(af[mt], stage + a_row[mt] + (((kk * 2 + a_chunk) ^ l7) << 4));
#pragma unroll
        for (int j = 0; j < NG / 2; ++j)
            moe_ldmatrix4(bf[j], stage + w_row[j] + (((kk * 2 + w_chunk) ^ l7) << 4));
#pragma unroll
        for (int mt = 0; mt < LIVE; ++mt)
#pragma unroll
            for (int ng = 0; ng < NG; ++ng)
                MoeMma<T>::run(acc[mt][ng], af[mt][0], af[mt][1], af[mt][2], af[mt][3],
                               bf[ng / 2][(ng & 1) * 2], bf[ng / 2][(ng & 1) * 2 + 1]);
    }
}

template <typename T, int MT, int NG, int WN, int STAGES>
__device__ void moe_gemm_staged(const MoeGemm& p) {
    constexpr u32 BM = (MOE_WARPS / WN) * MT * 16, BN = WN * NG * 8;
    using Loads = MoeStageLoads<T, BM, BN, STAGES>;
    constexpr u32 A_BYTES = Loads::A_BYTES, STAGE_BYTES = Loads::STAGE_BYTES;
    extern __shared__ __align__(128) unsigned char moe_smem[];
    MoeTile t;
    if (!moe_gemm_tile(p, BM, BN, t)) return;
    const u32 lane = threadIdx.x & 31u, warp = threadIdx.x >> 5;
    const u32 smem = (u32)__cvta_generic_to_shared(moe_smem);
    const Loads loads(p, t, smem);
    loads.start(p);

    // ldmatrix addresses: lane l feeds row l % 8 of matrix l / 8. A (m16 × k16): matrices
    // (rows +0, k +0), (+8, +0), (+0, +8), (+8, +8) = a0..a3; W (n16 × k16): (n +0, k +0),
    // (+0, +8), (+8, +0), (+8, +8) = b0, b1 of group 2j and of group 2j + 1.
    const u32 wm = warp / WN, wn = warp % WN, mi = lane >> 3, l7 = lane & 7u;
    u32 a_row[MT], w_row[NG / 2];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) a_row[mt] = (wm * MT * 16 + mt * 16 + (mi & 1u) * 8 + l7) * 128;
#pragma unroll
    for (int j = 0; j < NG / 2; ++j) w_row[j] = A_BYTES + (wn * NG * 8 + j * 16 + (mi >> 1) * 8 + l7) * 128;
    const u32 a_chunk = mi >> 1, w_chunk = mi & 1u;

    static_assert(MT == 2 || MT == 3, "live m16 tiles: 1 .. MT");
    const u32 wr0 = wm * MT * 16;
    const u32 live = t.rows > wr0 ? min((u32)MT, (t.rows - wr0 + 15) / 16) : 0;
    float acc[MT][NG][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int ng = 0; ng < NG; ++ng)
#pragma unroll
            for (int i = 0; i < 4; ++i) acc[mt][ng][i] = 0.0f;

    for (u32 kt = 0; kt < loads.k_tiles; ++kt) {
        moe_cp_async_wait<STAGES - 2>();
        __syncthreads();  // stage kt landed for every thread; stage kt - 1 is free
        loads.next(kt);
        const u32 stage = smem + (kt % STAGES) * STAGE_BYTES;
        // Only the m16 tiles that hold rows: a tile's last few rows cost a quarter of the MMAs.
        if (live == MT)
            moe_staged_mma<T, MT, MT, NG>(acc, stage, a_row, w_row, a_chunk, w_chunk, l7);
        else if (live == 2)
            moe_staged_mma<T, (MT > 2 ? 2 : MT), MT, NG>(acc, stage, a_row, w_row, a_chunk, w_chunk, l7);
        else if (live == 1)
            moe_staged_mma<T, 1, MT, NG>(acc, stage, a_row, w_row, a_chunk, w_chunk, l7);
    }
    moe_cp_async_wait<0>();
    __syncthreads();  // the ring is free for the split-K sums
    moe_gemm_finish<T, MT, NG, WN>(p, t, acc, reinterpret_cast<float*>(moe_smem));
}

// (MT m16 tiles, NG n8 groups per warp, U k-steps of loads in flight, LATE_A, blocks per SM):
// two resident blocks keep 16 warps' loads in flight per SM for the decode tiles, each 8
// steps of W deep (LATE_A; with GemmShape's one wave, against 4 steps with A held: qwen3 1
// token 44.5 → 37.8 µs per forward, its gate/up GEMM 24.6 → 19.6 µs on the H200). The middle
// tile (2 m16 tiles, two blocks per SM) keeps 3 steps in flight with A held (per forward on
// the H200 against 2 steps: qwen3 256 tokens 406 → 382 µs, deepseek 256 666 → 632, gpt-oss
// 256 893 → 839, mixtral 64 833 → 794; 4 or 6 steps with A late no better overall). The
// prefill tile used to be this kernel with 4 m16 tiles × 4 groups per warp (one block per SM
// by registers, each warp stalled on its own loads): the staged tile took mixtral 256 tokens
// from 1685 to 1190 µs per forward in the moe suite on the H200. Measured against it there
// (per CLI forward, mixtral 256 tokens): 3 stages +1%, 5 stages (one block per SM) +25%,
// 64 × 256 tiles of 32 × 64 per warp (one block per SM by registers) +6%, 128 × 128 tiles of
// 16 warps (each expert's rows in one tile, W read once) +2%; ncu there: the gate/up GEMM at
// 86% of L2 throughput (A re-read by every column block, tail tiles' W from L2), the down
// projection's second wave only partly full.
#define MOE_GEMM(T, MT, NG, U, LATE_A, B) \
    extern "C" __global__ void __launch_bounds__(256, B) moe_gemm_##T##_m##MT(MoeGemm p) { moe_gemm<T, MT, NG, U, LATE_A>(p); }
MOE_GEMM(bf16, 1, 2, 8, true, 2)
MOE_GEMM(bf16, 2, 2, 3, false, 2)
MOE_GEMM(f16, 1, 2, 8, true, 2)
MOE_GEMM(f16, 2, 2, 3, false, 2)
// The prefill tiles: m4 = 64 rows (2 m16 tiles per warp, 96 KB of shared memory), m6 = 96
// rows (3 per warp, 112 KB), two blocks per SM either way. Where experts average over 32
// rows the 96-row tile holds most experts whole, so fewer tail tiles read the weights again:
// on the H200, per CLI forward, mixtral 256 tokens 1058 → 773 µs (its down
// projection 417 → 262), qwen3 1024 (device path) 528 → 474; deepseek / gpt-oss 1024 (32
// rows on average) 1% / 0.4% slower than with m4.
#define MOE_GEMM_STAGED(T, NAME, MT) \
    extern "C" __global__ void __launch_bounds__(256, 2) moe_gemm_##T##_##NAME(MoeGemm p) { moe_gemm_staged<T, MT, 4, 4, 4>(p); }
MOE_GEMM_STAGED(bf16, m4, 2)
MOE_GEMM_STAGED(bf16, m6, 3)
MOE_GEMM_STAGED(f16, m4, 2)
MOE_GEMM_STAGED(f16, m6, 3)

// ---- warpgroup MMA (sm_90a): D (64 × N, f32, N / 2 registers per thread) += A · Bᵀ with A
// (64 × 16) and B (N × 16) K-major in shared memory behind 128-byte-swizzle descriptors. ----
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
template <typename T, int N> struct MoeWgmma;
// The accumulator operands of m64nNk16: N / 2 registers, named 8 per 16 columns, then the
// two descriptors (%N/2, %N/2 + 1).
#define MOE_WGMMA_R16 "%0, %1, %2, %3, %4, %5, %6, %7"
#define MOE_WGMMA_R32 MOE_WGMMA_R16 ", %8, %9, %10, %11, %12, %13, %14, %15"
#define MOE_WGMMA_R48 MOE_WGMMA_R32 ", %16, %17, %18, %19, %20, %21, %22, %23"
#define MOE_WGMMA_R64 MOE_WGMMA_R48 ", %24, %25, %26, %27, %28, %29, %30, %31"
#define MOE_WGMMA_R80 MOE_WGMMA_R64 ", %32, %33, %34, %35, %36, %37, %38, %39"
#define MOE_WGMMA_R96 MOE_WGMMA_R80 ", %40, %41, %42, %43, %44, %45, %46, %47"
#define MOE_WGMMA_D16(o) "+f"(d[o]), "+f"(d[o + 1]), "+f"(d[o + 2]), "+f"(d[o + 3]), "+f"(d[o + 4]), "+f"(d[o + 5]), "+f"(d[o + 6]), "+f"(d[o + 7])
#define MOE_WGMMA(T, TY, N, DESC, ...)                                                              \
    template <> struct MoeWgmma<T, N> {                                                               \
        static __device__ __forceinline__ void run(float* d, u64 da, u64 db) {                        \
            asm volatile("{ .reg .pred p; setp.eq.u32 p, 1, 1; wgmma.mma_async.sync.aligned.m64n" #N  \
                         "k16.f32." TY "." TY " {" MOE_WGMMA_R##N "}, " DESC ", p, 1, 1, 0, 0; }"       \
                         : __VA_ARGS__                                                                \
                         : "l"(da), "l"(db));                                                         \
        }                                                                                             \
    };
#define MOE_WGMMA_ALL(T, TY) \
    MOE_WGMMA(T, TY, 16, "%8, %9", MOE_WGMMA_D16(0)) \
    MOE_WGMMA(T, TY, 32, "%16, %17", MOE_WGMMA_D16(0), MOE_WGMMA_D16(8)) \
    MOE_WGMMA(T, TY, 48, "%24, %25", MOE_WGMMA_D16(0), MOE_WGMMA_D16(8), MOE_WGMMA_D16(16)) \
    MOE_WGMMA(T, TY, 64, "%32, %33", MOE_WGMMA_D16(0), MOE_WGMMA_D16(8), MOE_WGMMA_D16(16), MOE_WGMMA_D16(24)) \
    MOE_WGMMA(T, TY, 80, "%40, %41", MOE_WGMMA_D16(0), MOE_WGMMA_D16(8), MOE_WGMMA_D16(16), MOE_WGMMA_D16(24), MOE_WGMMA_D16(32)) \
    MOE_WGMMA(T, TY, 96, "%48, %49", MOE_WGMMA_D16(0), MOE_WGMMA_D16(8), MOE_WGMMA_D16(16), MOE_WGMMA_D16(24), MOE_WGMMA_D16(32), MOE_WGMMA_D16(40))
MOE_WGMMA_ALL(bf16, "bf16")
MOE_WGMMA_ALL(f16, "f16")
#endif

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
// Shared-memory descriptor of a K-major operand tile whose 128-byte rows are stored in the
// 128-byte swizzle (16-byte chunk c of row r at chunk c ^ (r % 8); tile base 1024-aligned):
// leading byte offset unused (1), stride 1024 bytes between 8-row groups, layout 1 (SW128).
__device__ __forceinline__ u64 moe_sw128_desc(u32 addr) {
    return (u64)((addr & 0x3FFFFu) >> 4) | ((u64)1 << 16) | ((u64)(1024 >> 4) << 32) | ((u64)1 << 62);
}
__device__ __forceinline__ void moe_wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void moe_wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void moe_wgmma_wait0() { asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory"); }
__device__ __forceinline__ void moe_fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }

// One 64-k stage of a warpgroup's MMAs: its 64 weight rows (A, at `wa`) times the tile's first
// N token rows (B, at `xb`), 4 k16 steps (32 bytes along the swizzled rows each).
template <typename T, int N, int NMAX>
__device__ __forceinline__ void moe_wgmma_stage(float (&acc)[NMAX / 2], u32 wa, u32 xb) {
#pragma unroll
    for (u32 kk = 0; kk < MOE_SBK / 16; ++kk)
        MoeWgmma<T, N>::run(acc, moe_sw128_desc(wa + kk * 32), moe_sw128_desc(xb + kk * 32));
}

// A prefill tile's k loop on wgmma for its first N token rows (one instance per N, so the
// accumulators keep their registers across the asynchronous MMAs): the warpgroup's 64
// weight rows start `wa` bytes into each stage.
template <typename T, int N, int NMAX, u32 STAGES, typename Loads>
__device__ __forceinline__ void moe_wgmma_k_loop(float (&acc)[NMAX / 2], const Loads& loads, u32 smem, u32 wa) {
    for (u32 kt = 0; kt < loads.k_tiles; ++kt) {
        moe_cp_async_wait<STAGES - 2>();
        moe_fence_proxy_async();  // this thread's cp.async data, visible to the async proxy
        __syncthreads();          // every thread's; and stage kt - 1's MMAs are done
        loads.next(kt);
        const u32 stage = smem + (kt % STAGES) * Loads::STAGE_BYTES;
        moe_wgmma_fence();
        moe_wgmma_stage<T, N, NMAX>(acc, stage + wa, stage);
        moe_wgmma_commit();
        moe_wgmma_wait0();
    }
}

// The wgmma tile's results (accumulator i of a thread, warp w of its warpgroup, lane g·4 + q:
// weight row 16w + g + 8·(i % 4 / 2), token row 8·(i / 4) + 2q + i % 2) go through shared
// memory `c` (the free ring) to whole rows, so the split-K partials, their sums and the
// epilogues move float4s along rows instead of scattered words (n % 8 == 0 on CUDA).
// Partials are summed in split order by the tile's last block: results stay deterministic.
template <typename T, u32 BM>
__device__ void moe_wgmma_finish(const MoeGemm& p, const MoeTile& t, const float (&acc)[BM / 2], float* c) {
    constexpr u32 BN = 128, LD = BN + 4;  // padded rows: the scattered writes hit 32 banks
    const u32 lane = threadIdx.x & 31u, warp = threadIdx.x >> 5, g = lane >> 2, q = lane & 3u;
    const u32 nl = (warp >> 2) * 64 + (warp & 3u) * 16 + g;
    __syncthreads();  // every warpgroup is done with the ring
#pragma unroll
    for (int i = 0; i < (int)BM / 2; ++i)
        c[(8u * (i / 4) + 2u * q + i % 2) * LD + nl + 8u * ((i % 4) / 2)] = acc[i];
    __syncthreads();
    // Thread: float4 column `col` of rows r0, r0 + 8, ... (one warp per row).
    const u32 col = lane * 4, r0 = warp, n = t.nb * BN + col;
    const bool in_n = n < p.n;
    if (p.splits > 1) {
        for (u32 r = r0; r < t.rows; r += MOE_WARPS)
            if (in_n)
                *reinterpret_cast<float4*>(p.partial + ((u64)t.split * p.rows_cap + t.row0 + r) * p.n + n) =
                    *reinterpret_cast<const float4*>(c + r * LD + col);
        if (!moe_arrive_last(&p.tickets[t.tile], p.splits)) return;
        const u64 stride = (u64)p.rows_cap * p.n;
        for (u32 r = r0; r < t.rows; r += MOE_WARPS) {
            if (!in_n) continue;
            const float* src = p.partial + ((u64)t.row0 + r) * p.n + n;
            float4 sum = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
            for (u32 sp = 0; sp < p.splits; ++sp) {
                const float4 v = __ldcg(reinterpret_cast<const float4*>(src + sp * stride));
                sum.x += v.x;
                sum.y += v.y;
                sum.z += v.z;
                sum.w += v.w;
            }
            *reinterpret_cast<float4*>(c + r * LD + col) = sum;
        }
        __syncthreads();
    }
    if (p.epilogue == 1) {
        // Weight rows 16m + j (gate) and 16m + 8 + j (up) make act column 8m + j: thread
        // (16 per row) takes act columns 4·j4 .. 4·j4 + 3 of rows r, r + 16, ...
        const u32 half_n = p.n >> 1, j4 = threadIdx.x & 15u, gate = (j4 >> 1) * 16 + (j4 & 1u) * 4;
        const u32 act = (t.nb * BN >> 1) + 4 * j4;
        if (act >= half_n) return;
        for (u32 r = threadIdx.x >> 4; r < t.rows; r += 16) {
            const float4 gv = *reinterpret_cast<const float4*>(c + r * LD + gate);
            const float4 uv = *reinterpret_cast<const float4*>(c + r * LD + gate + 8);
            const float o[4] = {moe_silu(gv.x) * uv.x, moe_silu(gv.y) * uv.y, moe_silu(gv.z) * uv.z,
                                moe_silu(gv.w) * uv.w};
            store_vec<T, 4>(reinterpret_cast<T*>(p.out) + (u64)(t.row0 + r) * half_n + act, pack_vec<T, 4>(o));
        }
    } else {
        if (!in_n) return;
        for (u32 r = r0; r < t.rows; r += MOE_WARPS) {
            const u32 prow = t.row0 + r;
            const float scale = p.slot_weight[p.order[prow]];
            float4 v = *reinterpret_cast<const float4*>(c + r * LD + col);
            v.x *= scale;
            v.y *= scale;
            v.z *= scale;
            v.w *= scale;
            *reinterpret_cast<float4*>(reinterpret_cast<float*>(p.out) + (u64)prow * p.n + n) = v;
        }
    }
}

// The prefill tile on Hopper's warpgroup MMA: the same work list, stages, loads and swizzled
// shared memory as moe_gemm_staged (BM = 32·MT token rows × 128 weight rows, STAGES deep),
// but the two warpgroups each multiply 64 weight rows (wgmma M) by the tile's live token rows
// (wgmma N, rounded up to 16) straight from shared memory: no ldmatrix round trips through
// registers, no MMAs on rows past the tile's rows. Accumulator i of a thread (warp w of its
// warpgroup, lane g·4 + q): weight row 16w + g + 8·(i % 4 / 2), token row 8·(i / 4) + 2q + i % 2.
template <typename T, int MT, int STAGES>
__device__ void moe_gemm_wgmma(const MoeGemm& p) {
    constexpr u32 BM = 32 * MT, BN = 128, NMAX = BM;
    using Loads = MoeStageLoads<T, BM, BN, STAGES>;
    constexpr u32 A_BYTES = Loads::A_BYTES, STAGE_BYTES = Loads::STAGE_BYTES;
    static_assert(A_BYTES % 1024 == 0 && STAGE_BYTES % 1024 == 0, "SW128 tiles need 1024-byte alignment");
    extern __shared__ __align__(128) unsigned char moe_smem[];
    MoeTile t;
    if (!moe_gemm_tile(p, BM, BN, t)) return;
    const u32 warp = threadIdx.x >> 5;
    // The stages from the first 1024-byte boundary (the launch asks for 1 KB more): an
    // __align__(1024) declaration would pad every kernel's static shared memory instead.
    const u32 base = (u32)__cvta_generic_to_shared(moe_smem), smem = (base + 1023u) & ~1023u;
    const Loads loads(p, t, smem);
    loads.start(p);

    const u32 wg = warp >> 2;           // warpgroup: weight rows 64·wg ..
    const u32 live16 = (t.rows + 15) / 16;  // token rows the MMAs cover, in 16s
    float acc[NMAX / 2];
#pragma unroll
    for (int i = 0; i < NMAX / 2; ++i) acc[i] = 0.0f;

    const u32 wa = A_BYTES + wg * 64 * 128;
    switch (live16) {
        case 1: moe_wgmma_k_loop<T, 16, NMAX, STAGES>(acc, loads, smem, wa); break;
        case 2: moe_wgmma_k_loop<T, 32, NMAX, STAGES>(acc, loads, smem, wa); break;
        case 3: moe_wgmma_k_loop<T, 48, NMAX, STAGES>(acc, loads, smem, wa); break;
        case 4: moe_wgmma_k_loop<T, (NMAX >= 64 ? 64 : 16), NMAX, STAGES>(acc, loads, smem, wa); break;
        case 5: moe_wgmma_k_loop<T, (NMAX >= 80 ? 80 : 16), NMAX, STAGES>(acc, loads, smem, wa); break;
        default: moe_wgmma_k_loop<T, NMAX, NMAX, STAGES>(acc, loads, smem, wa); break;
    }
    moe_cp_async_wait<0>();
    moe_wgmma_finish<T, BM>(p, t, acc, reinterpret_cast<float*>(moe_smem + (smem - base)));
}

#define MOE_GEMM_WGMMA(T, NAME, MT) \
    extern "C" __global__ void __launch_bounds__(256, 2) moe_gemm_##T##_##NAME##w(MoeGemm p) { moe_gemm_wgmma<T, MT, 4>(p); }
#else
#define MOE_GEMM_WGMMA(T, NAME, MT) \
    extern "C" __global__ void __launch_bounds__(256, 2) moe_gemm_##T##_##NAME##w(MoeGemm p) { __trap(); }
#endif
// Two blocks per SM at either size (m6: 112 KB of stages + 1 KB to align them, no static
// shared memory). Against the mma.sync staged tiles on the H200 (CLI forward, device path):
// mixtral 256 tokens 733.5 vs 890.4 µs over 3000 back-to-back passes (the mma.sync tile ran
// at the 700 W power cap, SM clock ~1700 MHz), qwen3 1024 418.6 vs 470.1, mixtral 1024 1965
// vs 2609; and, taking over from the decode and middle tiles at 2 rows per expert, gpt-oss
// 256 1852 → 1519, deepseek 256 916 → 789.
MOE_GEMM_WGMMA(bf16, m4, 2)
MOE_GEMM_WGMMA(bf16, m6, 3)
MOE_GEMM_WGMMA(f16, m4, 2)
MOE_GEMM_WGMMA(f16, m6, 3)

// ---- the router: logits [tokens, E] (f32) = x · gateᵀ (+ bias). A block of 16 warps
// computes a tile of up to 16·MT rows × 8 columns over one of `splits` K ranges (grid: column
// blocks × splits, row tiles); its warps split that range into contiguous runs and sum
// through shared memory in warp order. With one split the block writes the logits; with
// more it writes its partial sums (split s at logits + s·tokens·E) and the row tile's last
// block adds them in split order, so the logits are deterministic either way. With
// `route`, the last block of a row tile to finish (a ticket per tile) routes the tile's
// rows (softmax top-k, one warp per row, E <= 256), and the last row tile to be routed (one
// more ticket) runs the dispatch: router, routing and dispatch in one kernel. ----
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

template <typename T, int MT, int U>
__device__ void moe_router(const MoeRouter& p) {
    // The grouped GEMM after this kernel may start its blocks (on SMs this one leaves free);
    // they wait for this kernel before reading anything.
    release_next_grid();
    const u32 lane = threadIdx.x & 31u, warp = threadIdx.x >> 5;
    const u32 g = lane >> 2, q = lane & 3u;
    const u32 col_blocks = gridDim.x / p.splits;
    const u32 split = blockIdx.x / col_blocks;
    const u32 col0 = (blockIdx.x % col_blocks) * 8;
    const u32 row0 = blockIdx.y * p.tile_rows;
    const u32 rows = min(p.tile_rows, p.tokens - row0);
    const u32 split_begin = split * p.k_split;
    const u32 split_end = min(p.k, split_begin + p.k_split);
    const u32 steps = (split_end - split_begin + 31) / 32;
    const u32 per_warp = (steps + MOE_RWARPS - 1) / MOE_RWARPS;
    const u32 k_begin = min(split_end, split_begin + warp * per_warp * 32);
    const u32 k_end = min(split_end, split_begin + (warp + 1) * per_warp * 32);
    const T* x = reinterpret_cast<const T*>(p.x);
    const T* a_ptr[MT][2];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const u32 r = mt * 16 + h * 8 + g;
            a_ptr[mt][h] = r < rows ? x + (u64)(row0 + r) * p.k : nullptr;
        }
    const u32 n = col0 + g;
    const T* w_ptr[1] = {n < p.experts ? reinterpret_cast<const T*>(p.w) + (u64)n * p.k : nullptr};
    float acc[MT][1][4];
    moe_mma_range<T, MT, 1, U>(acc, a_ptr, w_ptr, k_begin, k_end, q);
    // Sum the warps' partial tiles, one m16 tile at a time. Accumulator i of a tile: row
    // g + 8·(i / 2), column 2q + i % 2. The bias goes into split 0's sums only.
    __shared__ float red[MOE_RWARPS][16][8];
    float* out = p.logits + (u64)split * p.tokens * p.experts;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
        for (int i = 0; i < 4; ++i) red[warp][g + 8 * (i / 2)][2 * q + i % 2] = acc[mt][0][i];
        __syncthreads();
        if (threadIdx.x < 128) {
            const u32 r = threadIdx.x / 8, c = threadIdx.x % 8;
            float sum = 0.0f;
#pragma unroll
            for (int wi = 0; wi < MOE_RWARPS; ++wi) sum += red[wi][r][c];
            const u32 row = mt * 16 + r, col = col0 + c;
            if (row < rows && col < p.experts)
                out[(u64)(row0 + row) * p.experts + col] =
                    sum + (p.bias && split == 0 ? p.bias[col] : 0.0f);
        }
        __syncthreads();
    }
    if (!p.route) return;

    // The tile's last block routes its rows (the splits' sums added in split order).
    if (!moe_arrive_last(&p.tickets[blockIdx.y], gridDim.x)) return;
    __shared__ float logit_rows[MOE_RWARPS][256];
    const u64 split_stride = (u64)p.tokens * p.experts;
    for (u32 r = warp; r < rows; r += MOE_RWARPS) {
        const u64 t = row0 + r;
        // Every load of the row (8 per lane and split at most) in flight at once.
        float part[MOE_ROUTER_MAX_SPLITS][8];
#pragma unroll
        for (int sp = 0; sp < MOE_ROUTER_MAX_SPLITS; ++sp)
#pragma unroll
            for (int j = 0; j < 8; ++j) {
                const u32 i = lane + 32 * j;
                part[sp][j] = (sp < (int)p.splits && i < p.experts)
                                  ? __ldcg(p.logits + sp * split_stride + t * p.experts + i)
                                  : 0.0f;
            }
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            const u32 i = lane + 32 * j;
            float v = part[0][j];
#pragma unroll
            for (int sp = 1; sp < MOE_ROUTER_MAX_SPLITS; ++sp) v += part[sp][j];
            if (i < p.experts) logit_rows[warp][i] = v;
        }
        __syncwarp();
        moe_route_row(logit_rows[warp], p.experts, p.top_k, p.renorm, p.weights + t * p.top_k,
                      p.chosen + t * p.top_k);
        __syncwarp();
    }

    // The last routed tile dispatches every token (a single tile needs no second ticket).
    if (gridDim.y > 1 && !moe_arrive_last(&p.tickets[gridDim.y], gridDim.y)) return;
    if (gridDim.y == 1) __syncthreads();
    __shared__ u32 dsm[2 * 256];
    moe_dispatch_block<true>(p.chosen, p.tokens * p.top_k, p.experts, p.top_k, p.bm, p.counts,
                       p.offsets, p.order, p.token_of, p.slot_pos, p.work, p.n_items, dsm,
                       dsm + 256);
}

// (MT m16 tiles, U k-steps of loads in flight): 1 for decode (a block per 16 tokens keeps
// many SMs streaming the gate), 2 and 4 reuse each gate fragment over more rows.
#define MOE_ROUTER(T, MT, U) \
    extern "C" __global__ void __launch_bounds__(MOE_RWARPS * 32, 1) moe_router_##T##_m##MT(MoeRouter p) { moe_router<T, MT, U>(p); }
MOE_ROUTER(bf16, 1, 8)
MOE_ROUTER(bf16, 2, 4)
MOE_ROUTER(bf16, 4, 2)
MOE_ROUTER(f16, 1, 8)
MOE_ROUTER(f16, 2, 4)
MOE_ROUTER(f16, 4, 2)

// ---- the clustered router (Softmax over at most 128 experts, row tiles of at most 16
// tokens): a row tile's blocks form one thread-block cluster (grid.x = the cluster, one
// block per 16 experts, the whole K each). Every block writes its logits into the shared
// memory of the cluster's first block and all meet at the cluster barrier, so the first
// block routes its rows from shared memory: no tile ticket and no round trip of the logits
// through L2. With one row tile it dispatches from shared memory too (top_k <= 16, so at
// most 256 slots); with more, the last routed tile dispatches (a ticket at
// tickets[row tiles], as in moe_router). ----
#define MOE_CLUSTER_NG 2
#define MOE_CLUSTER_BN (8 * MOE_CLUSTER_NG)
#define MOE_CLUSTER_MAX_EXPERTS 128
#define MOE_CLUSTER_MAX_SLOTS 256  // 16 tokens × top_k <= 16

__device__ __forceinline__ u32 moe_cluster_rank() {
    u32 r;
    asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
    return r;
}
// Stores `v` at the address that `local` (this block's shared memory) has in the shared
// memory of the cluster's block `rank`.
__device__ __forceinline__ void moe_store_cluster(float* local, u32 rank, float v) {
    u32 addr, remote;
    asm("{ .reg .u64 a; cvta.to.shared.u64 a, %1; cvt.u32.u64 %0, a; }" : "=r"(addr) : "l"(local));
    asm("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(addr), "r"(rank));
    asm volatile("st.shared::cluster.f32 [%0], %1;" :: "r"(remote), "f"(v) : "memory");
}
__device__ __forceinline__ void moe_cluster_arrive_relaxed() {
    asm volatile("barrier.cluster.arrive.relaxed.aligned;" ::: "memory");
}
__device__ __forceinline__ void moe_cluster_arrive() {
    asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory");
}
__device__ __forceinline__ void moe_cluster_wait() {
    asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory");
}

template <typename T, int U>
__device__ void moe_router_cluster(const MoeRouter& p) {
    release_next_grid();
    // First cluster barrier phase: no block writes into the first block's shared memory
    // before that block is running (waited for just before the writes, long after).
    moe_cluster_arrive_relaxed();
    const u32 lane = threadIdx.x & 31u, warp = threadIdx.x >> 5;
    const u32 g = lane >> 2, q = lane & 3u;
    const u32 col0 = blockIdx.x * MOE_CLUSTER_BN;
    const u32 row0 = blockIdx.y * p.tile_rows;
    const u32 rows = min(p.tile_rows, p.tokens - row0);
    const u32 steps = (p.k + 31) / 32;
    const u32 per_warp = (steps + MOE_RWARPS - 1) / MOE_RWARPS;
    const u32 k_begin = min(p.k, warp * per_warp * 32);
    const u32 k_end = min(p.k, (warp + 1) * per_warp * 32);
    const T* x = reinterpret_cast<const T*>(p.x);
    const T* a_ptr[1][2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const u32 r = h * 8 + g;
        a_ptr[0][h] = r < rows ? x + (u64)(row0 + r) * p.k : nullptr;
    }
    const T* w_ptr[MOE_CLUSTER_NG];
#pragma unroll
    for (int ng = 0; ng < MOE_CLUSTER_NG; ++ng) {
        const u32 n = col0 + ng * 8 + g;
        w_ptr[ng] = n < p.experts ? reinterpret_cast<const T*>(p.w) + (u64)n * p.k : nullptr;
    }
    float acc[1][MOE_CLUSTER_NG][4];
    moe_mma_range<T, 1, MOE_CLUSTER_NG, U>(acc, a_ptr, w_ptr, k_begin, k_end, q);
    // Sum the warps' partial tiles (in warp order) straight into the first block's rows.
    // Accumulator i of group ng: row g + 8·(i / 2), column ng·8 + 2q + i % 2.
    __shared__ float red[MOE_RWARPS][16][MOE_CLUSTER_BN];
    __shared__ float tile[16][MOE_CLUSTER_MAX_EXPERTS];  // the first block's: the tile's logits
#pragma unroll
    for (int ng = 0; ng < MOE_CLUSTER_NG; ++ng)
#pragma unroll
        for (int i = 0; i < 4; ++i) red[warp][g + 8 * (i / 2)][ng * 8 + 2 * q + i % 2] = acc[0][ng][i];
    moe_cluster_wait();
    __syncthreads();
    if (threadIdx.x < 16 * MOE_CLUSTER_BN) {
        const u32 r = threadIdx.x / MOE_CLUSTER_BN, c = threadIdx.x % MOE_CLUSTER_BN;
        const u32 col = col0 + c;
        if (r < rows && col < p.experts) {
            float sum = 0.0f;
#pragma unroll
            for (int wi = 0; wi < MOE_RWARPS; ++wi) sum += red[wi][r][c];
            moe_store_cluster(&tile[r][col], 0, sum + (p.bias ? p.bias[col] : 0.0f));
        }
    }
    // The other blocks leave once their stores are released (only the first block's shared
    // memory is written); the first waits for them all.
    moe_cluster_arrive();
    if (moe_cluster_rank() != 0) return;
    moe_cluster_wait();

    __shared__ u32 chosen[MOE_CLUSTER_MAX_SLOTS];  // one row tile: the dispatch reads these
    const bool local = gridDim.y == 1;
    for (u32 r = warp; r < rows; r += MOE_RWARPS) {
        const u64 t = row0 + r;
        const u32 e = moe_route_row_j<4>(tile[r], p.experts, p.top_k, p.renorm,
                                         p.weights + t * p.top_k, p.chosen + t * p.top_k);
        if (local && lane < p.top_k) chosen[t * p.top_k + lane] = e;
    }
    __shared__ u32 dsm[2 * MOE_CLUSTER_MAX_EXPERTS];
    if (local) {
        __syncthreads();
        moe_dispatch_block<false>(chosen, p.tokens * p.top_k, p.experts, p.top_k, p.bm,
                                  p.counts, p.offsets, p.order, p.token_of, p.slot_pos, p.work,
                                  p.n_items, dsm, dsm + MOE_CLUSTER_MAX_EXPERTS);
        return;
    }
    if (!moe_arrive_last(&p.tickets[gridDim.y], gridDim.y)) return;
    moe_dispatch_block<true>(p.chosen, p.tokens * p.top_k, p.experts, p.top_k, p.bm, p.counts,
                             p.offsets, p.order, p.token_of, p.slot_pos, p.work, p.n_items, dsm,
                             dsm + MOE_CLUSTER_MAX_EXPERTS);
}
// Clusters need sm_90; the host launches this kernel only there.
#if __CUDA_ARCH__ >= 900
#define MOE_ROUTER_CLUSTER_BODY(T) moe_router_cluster<T, 8>(p);
#else
#define MOE_ROUTER_CLUSTER_BODY(T) __trap();
#endif
#define MOE_ROUTER_CLUSTER(T) \
    extern "C" __global__ void __launch_bounds__(MOE_RWARPS * 32, 1) moe_router_cluster_##T(MoeRouter p) { MOE_ROUTER_CLUSTER_BODY(T) }
MOE_ROUTER_CLUSTER(bf16)
MOE_ROUTER_CLUSTER(f16)

// ---- the one-token decode: router, routing, gate/up, SwiGLU, down projection and combine
// in one kernel. A decode pass is a stream of weight bytes (the gate and the k chosen
// experts' w13 and w2 rows) with a dot product per row, so every warp streams its rows
// straight from global memory (MOE_DEC_BATCH 16-byte loads per lane and row in flight, twice
// that for the down rows) against f32 vectors in shared memory, and the phases meet at grid
// counters instead of kernel boundaries: separate kernels cost a ramp of the memory stream
// each and the tail of the one before. (A first version streamed through a ring of bulk
// copies into shared memory: its per-stage block barriers left the warps issuing one
// instruction in 15 cycles, qwen3 49 µs against 36 for the separate kernels.)
//   (1) x into shared memory; the gate's rows as (expert, K segment) tasks over the warps,
// partial logits to global; every block arrives at counter 0. (2) Every block waits for all
// and routes the token itself (the segments summed in order, softmax top-k). (3) Gate/up:
// each block takes an even share of contiguous (rank, column) units, its warps one at a
// time (a shared counter), a unit being the gate and up rows of one act column (w13 rows
// 16·(c / 8) + c % 8 and 8 below); it stores act = SwiGLU (rounded to T, as the GEMM path
// stores it; kept in f32). Each warp then prefetches an even share of the start of the down
// rows into L2; the block arrives at counter 1, waits for every block and copies act into
// shared memory. (4) Down: the same for output rows h, a unit being w2 row h of every
// rank, summed over the ranks weighted by their routing weights (the GEMM path's epilogue
// and combine; the order of the sums differs), and written out.
// The grid must be co-resident (a cooperative launch): blocks wait for each other. The last
// block to leave resets the counters. ----
#define MOE_DEC_WARPS 8
#define MOE_DEC_BATCH 8
#define MOE_DEC_MAX_EXPERTS 256
#define MOE_DEC_MAX_K 32
#define MOE_DEC_MAX_SEGS 16

struct MoeDecode {
    const void* x;         // [H] T
    const void* gate;      // [E, H] T
    const float* bias;     // [E] (nullable)
    const void* w13;       // [E, 2I, H] T, gate/up interleaved in blocks of 8 rows
    const void* w2;        // [E, H, I] T
    u32 hidden, inter, experts, top_k;
    int renorm;
    u32 router_segs;       // K segments per gate row: segs·E <= the grid's warps, <= MOE_DEC_MAX_SEGS
    u32 prefetch_bytes;    // of the warps' down rows together, into L2 before the wait for act
    float* logits;         // [router_segs, E] partial logits
    float* weights;        // [k] (block 0 writes the routing here too)
    u32* chosen;           // [k]
    float* act;            // [k, I]
    u32* counters;         // 3 words, zero between launches: router arrivals, gate/up arrivals, exits
    void* out;             // [H] T
};
__device__ __forceinline__ void moe_red_release(u32* p, u32 v) {
    asm volatile("red.release.gpu.global.add.u32 [%0], %1;" :: "l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ u32 moe_ld_acquire(const u32* p) {
    u32 v;
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}
// The block arrives at *p (after all its threads' writes) and waits until every block of
// the grid has.
__device__ __forceinline__ void moe_grid_meet(u32* p) {
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence();
        moe_red_release(p, 1);
        while (moe_ld_acquire(p) < gridDim.x) __nanosleep(32);
    }
    __syncthreads();
}

// Σ over 8 elements of w (16 bytes of T) · v (8 f32).
template <typename T>
__device__ __forceinline__ float moe_dot8(uint4 w, float4 v0, float4 v1) {
    Pack8<T> pw;
    pw.w[0] = w;
    float a[8];
    unpack8(pw, a);
    float s0 = a[0] * v0.x, s1 = a[1] * v0.y;
    s0 = fmaf(a[2], v0.z, s0);
    s1 = fmaf(a[3], v0.w, s1);
    s0 = fmaf(a[4], v1.x, s0);
    s1 = fmaf(a[5], v1.y, s1);
    s0 = fmaf(a[6], v1.z, s0);
    s1 = fmaf(a[7], v1.w, s1);
    return s0 + s1;
}

// The warp's dot products of NR rows (16-byte chunks c0 .. c1 of each) with `vec` (f32,
// shared memory), summed over the warp: lane-strided chunks, MOE_DEC_BATCH per lane and row
// loaded before any is used.
template <typename T, int NR>
__device__ __forceinline__ void moe_dec_dot(const T* const (&rows)[NR], const float* vec, u32 c0,
                                            u32 c1, float (&out)[NR]) {
    const u32 lane = threadIdx.x & 31u;
    const float4* v = reinterpret_cast<const float4*>(vec);
    float acc[NR];
#pragma unroll
    for (int r = 0; r < NR; ++r) acc[r] = 0.0f;
    for (u32 base = c0 + lane; base < c1; base += 32 * MOE_DEC_BATCH) {
        uint4 w[NR][MOE_DEC_BATCH];
#pragma unroll
        for (int j = 0; j < MOE_DEC_BATCH; ++j)
#pragma unroll
            for (int r = 0; r < NR; ++r) {
                const u32 c = base + 32 * j;
                if (c < c1) w[r][j] = moe_ld_stream(rows[r] + 8 * (u64)c);
            }
#pragma unroll
        for (int j = 0; j < MOE_DEC_BATCH; ++j) {
            const u32 c = base + 32 * j;
            if (c < c1) {
                const float4 v0 = v[2 * c], v1 = v[2 * c + 1];
#pragma unroll
                for (int r = 0; r < NR; ++r) acc[r] += moe_dot8<T>(w[r][j], v0, v1);
            }
        }
    }
#pragma unroll
    for (int r = 0; r < NR; ++r) out[r] = warp_sum(acc[r]);
}

// Σ_r wgt[r] · (w2 row h of expert experts[r]) · act_r over the K ranks, summed over the
// warp: the K rows as one sequence of 16-byte chunks, lane-strided, B per lane loaded before
// any is used (rows of a few hundred elements would leave a rank at a time
// with one load per lane in flight).
template <typename T, int B>
__device__ __forceinline__ float moe_dec_down(const T* w2, u32 H, u32 I, u32 h, u32 K,
                                              const u32* experts, const float* wgt,
                                              const float* acts) {
    const u32 lane = threadIdx.x & 31u, ic = I / 8;
    u32 r = lane / ic, c = lane % ic;  // this lane's next chunk
    float acc = 0.0f;
    while (r < K) {
        uint4 w[B];
        u32 rj[B], cj[B];
#pragma unroll
        for (int j = 0; j < B; ++j) {
            rj[j] = r;
            cj[j] = c;
            if (r < K) w[j] = moe_ld_stream(w2 + ((u64)experts[r] * H + h) * I + 8 * c);
            c += 32;
            while (c >= ic) {
                c -= ic;
                ++r;
            }
        }
#pragma unroll
        for (int j = 0; j < B; ++j)
            if (rj[j] < K) {
                const float4* v = reinterpret_cast<const float4*>(acts + (u64)rj[j] * I) + 2 * cj[j];
                acc = fmaf(wgt[rj[j]], moe_dot8<T>(w[j], v[0], v[1]), acc);
            }
    }
    return warp_sum(acc);
}

template <typename T>
__device__ void moe_decode(const MoeDecode& p) {
    extern __shared__ __align__(16) unsigned char moe_smem[];
    const u32 H = p.hidden, I = p.inter, E = p.experts, K = p.top_k;
    const u32 warp = threadIdx.x >> 5, lane = threadIdx.x & 31u;
    const u32 warps = gridDim.x * MOE_DEC_WARPS, gw = blockIdx.x * MOE_DEC_WARPS + warp;
    float* xs = reinterpret_cast<float*>(moe_smem);  // [H]
    float* acts = xs + H;                            // [K, I]
    __shared__ float route_w[MOE_DEC_MAX_K];
    __shared__ u32 route_e[MOE_DEC_MAX_K];
    __shared__ float logit_row[MOE_DEC_MAX_EXPERTS];
    __shared__ u32 next_unit;  // the block's next gate/up unit or down row

    // (1) x, then this warp's router tasks.
    const T* x = reinterpret_cast<const T*>(p.x);
    for (u32 c = threadIdx.x; c < H / 8; c += blockDim.x) {
        float v[8];
        unpack8(load_pack8(x + 8 * c), v);
        reinterpret_cast<float4*>(xs)[2 * c] = make_float4(v[0], v[1], v[2], v[3]);
        reinterpret_cast<float4*>(xs)[2 * c + 1] = make_float4(v[4], v[5], v[6], v[7]);
    }
    __syncthreads();
    const u32 hc = H / 8, segs = p.router_segs;
    for (u32 task = gw; task < E * segs; task += warps) {
        const u32 e = task % E, s = task / E;
        const T* row[1] = {reinterpret_cast<const T*>(p.gate) + (u64)e * H};
        float d[1];
        moe_dec_dot<T, 1>(row, xs, s * hc / segs, (s + 1) * hc / segs, d);
        if (lane == 0) p.logits[s * E + e] = d[0];
    }
    moe_grid_meet(p.counters);

    // (2) Route (every block, the same choice).
    for (u32 e = threadIdx.x; e < E; e += blockDim.x) {
        float part[MOE_DEC_MAX_SEGS];  // every load in flight at once
#pragma unroll
        for (u32 s = 0; s < MOE_DEC_MAX_SEGS; ++s) part[s] = s < segs ? __ldcg(p.logits + s * E + e) : 0.0f;
        float v = p.bias ? p.bias[e] : 0.0f;
#pragma unroll
        for (u32 s = 0; s < MOE_DEC_MAX_SEGS; ++s) v += part[s];
        logit_row[e] = v;
    }
    __syncthreads();
    if (warp == 0) {
        moe_route_row(logit_row, E, K, p.renorm, route_w, route_e);
        __syncwarp();
        if (blockIdx.x == 0 && lane < K) {
            p.weights[lane] = route_w[lane];
            p.chosen[lane] = route_e[lane];
        }
    }
    __syncthreads();

    // (3) Gate/up units: an even share of contiguous ones per block, taken one at a time by
    // its warps (a shared counter), so that warps done early take more (a fixed share per
    // warp left the SMs' last warps streaming alone: 6 units where others had 5).
    const T* w13 = reinterpret_cast<const T*>(p.w13);
    const T* w2 = reinterpret_cast<const T*>(p.w2);
    const u32 up_units = K * I;
    const u32 u1 = (u32)((u64)(blockIdx.x + 1) * up_units / gridDim.x);
    if (threadIdx.x == 0) next_unit = (u32)((u64)blockIdx.x * up_units / gridDim.x);
    __syncthreads();
    auto take = [&]() {
        u32 v = 0;
        if (lane == 0) v = atomicAdd(&next_unit, 1u);
        return __shfl_sync(0xffffffffu, v, 0);
    };
    for (u32 u = take(); u < u1; u = take()) {
        const u32 r = u / I, c = u % I;
        const T* g = w13 + ((u64)route_e[r] * 2 * I + 16 * (c / 8) + c % 8) * H;
        const T* rows[2] = {g, g + 8 * (u64)H};
        float d[2];
        moe_dec_dot<T, 2>(rows, xs, 0, hc, d);
        if (lane == 0) p.act[u] = to_f32(from_f32<T>(moe_silu(d[0]) * d[1]));
    }
    // This warp's share of prefetch_bytes: the start of an even share of the block's down
    // rows (rank by rank) into L2 while the other blocks finish their units.
    const u32 h0 = (u32)((u64)gw * H / warps), h1 = (u32)((u64)(gw + 1) * H / warps);
    const u32 line_elems = 128 / sizeof(T);
    for (u32 r = 0; r < K && h1 > h0; ++r) {
        const T* first = w2 + ((u64)route_e[r] * H + h0) * I;
        const u32 span = (h1 - h0) * I;  // contiguous: rows h0 .. h1 of rank r
        const u32 lines = min((span + line_elems - 1) / line_elems, p.prefetch_bytes / warps / 128 / K);
        for (u32 l = lane; l < lines; l += 32) moe_prefetch_l2(first + (u64)l * line_elems);
    }
    moe_grid_meet(p.counters + 1);
    if (threadIdx.x == 0) next_unit = (u32)((u64)blockIdx.x * H / gridDim.x);
    for (u32 c = threadIdx.x; c < K * I / 4; c += blockDim.x)
        reinterpret_cast<float4*>(acts)[c] = __ldcg(reinterpret_cast<const float4*>(p.act) + c);
    __syncthreads();

    // (4) Down rows h (the block's even share, taken one at a time by its warps): row h of
    // every rank, weighted.
    const u32 hb1 = (u32)((u64)(blockIdx.x + 1) * H / gridDim.x);
    for (u32 h = take(); h < hb1; h = take()) {
        const float y = moe_dec_down<T, 2 * MOE_DEC_BATCH>(w2, H, I, h, K, route_e, route_w, acts);
        if (lane == 0) reinterpret_cast<T*>(p.out)[h] = from_f32<T>(y);
    }
    // The last block out resets the counters for the next launch.
    if (moe_arrive_last(p.counters + 2, gridDim.x) && threadIdx.x == 0) {
        p.counters[0] = 0;
        p.counters[1] = 0;
    }
}
#define MOE_DECODE(T) \
    extern "C" __global__ void __launch_bounds__(MOE_DEC_WARPS * 32) moe_decode_##T(MoeDecode p) { moe_decode<T>(p); }
MOE_DECODE(bf16)
MOE_DECODE(f16)

// ---- SwiGLU of the cuBLAS path: h [rows, 2I] with interleaved gate/up blocks of 8 columns
// (the w13 layout) -> act [rows, I]. ----
template <typename T>
__device__ void moe_swiglu(const T* __restrict__ h, u64 rows, u32 inter, T* __restrict__ act) {
    const u64 n = rows * inter;
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x) {
        const u64 r = i / inter;
        const u32 c = (u32)(i % inter);
        const T* row = h + r * 2 * inter;
        const u32 base = (c / 8) * 16 + c % 8;
        act[i] = from_f32<T>(moe_silu(to_f32(row[base])) * to_f32(row[base + 8]));
    }
}
#define MOE_SWIGLU(T) \
    extern "C" __global__ void __launch_bounds__(256) moe_swiglu_##T(const T* h, u64 rows, u32 inter, T* act) \
    { moe_swiglu<T>(h, rows, inter, act); }
MOE_SWIGLU(f16)
MOE_SWIGLU(bf16)

// ---- combine: out[t, :] = Σ_r scale_r · y[slot_pos[t·k + r], :] in rank order, where
// scale_r = slot_weight[t·k + r] (null: 1, the rows are already weighted). Y is f32 (the
// device path) or T (the cuBLAS path); 4 columns per thread (hidden % 4 == 0). ----
template <typename TY, typename T>
__device__ void moe_combine(const TY* __restrict__ y, const u32* __restrict__ slot_pos,
                            const float* __restrict__ slot_weight, u32 tokens, u32 k, u32 hidden,
                            T* __restrict__ out) {
    wait_prior_grid();
    release_next_grid();
    const u32 quads = hidden / 4;
    const u64 n = (u64)tokens * quads;
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x) {
        const u32 t = (u32)(i / quads), c = (u32)(i % quads) * 4;
        float s[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        for (u32 r = 0; r < k; ++r) {
            const u32 slot = t * k + r;
            const float wgt = slot_weight ? slot_weight[slot] : 1.0f;
            const TY* src = y + (u64)slot_pos[slot] * hidden + c;
#pragma unroll
            for (int j = 0; j < 4; ++j) s[j] += wgt * to_f32(src[j]);
        }
        T* dst = out + (u64)t * hidden + c;
#pragma unroll
        for (int j = 0; j < 4; ++j) dst[j] = from_f32<T>(s[j]);
    }
}
#define MOE_COMBINE(TY, T) \
    extern "C" __global__ void __launch_bounds__(256) moe_combine_##TY##_##T(const TY* y, const u32* slot_pos, \
        const float* slot_weight, u32 tokens, u32 k, u32 hidden, T* out) \
    { moe_combine<TY, T>(y, slot_pos, slot_weight, tokens, k, hidden, out); }
MOE_COMBINE(f32, f16)
MOE_COMBINE(f32, bf16)
MOE_COMBINE(f16, f16)
MOE_COMBINE(bf16, bf16)
