// archs: sm_80 sm_90 sm_90a
// MoE routing (module `moe_router`): the DeepSeek-style grouped sigmoid router, the dispatch
// (tokens per expert, offsets, permutation, GEMM work list) and the router (logits, softmax
// top-k and dispatch in one kernel). What they share with the other MoE sources
// (moe_dispatch_block, moe_route_row, moe_mma_range, MoeRouter) is in moe_shared.cu.

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

extern "C" __global__ void __launch_bounds__(1024) moe_dispatch(
    const u32* __restrict__ expert_of_slot, u32 slots, u32 experts, u32 k, u32 bm,
    u32* __restrict__ counts, u32* __restrict__ offsets, u32* __restrict__ order,
    u32* __restrict__ token_of, u32* __restrict__ slot_pos, u32* __restrict__ work,
    u32* __restrict__ n_items) {
    extern __shared__ u32 moe_dispatch_smem[];
    moe_dispatch_block<true>(expert_of_slot, slots, experts, k, bm, counts, offsets, order, token_of,
                       slot_pos, work, n_items, moe_dispatch_smem, moe_dispatch_smem + experts);
}

// ---- the prefill router (moe::plan's choice from a few hundred tokens): the logits come
// from cuBLAS, then these route and finish the dispatch over many blocks. ----

// Softmax top-k of each token's logits [tokens, E] (+ bias), one warp per token, E <= 256:
// moe_route_row, as the fused router routes a row.
#define MOE_ROUTE_WARPS 8
extern "C" __global__ void __launch_bounds__(MOE_ROUTE_WARPS * 32) moe_route_softmax(
    const float* __restrict__ logits, const float* __restrict__ bias, u32 tokens, u32 experts,
    u32 k, int renorm, float* __restrict__ weights, u32* __restrict__ chosen) {
    __shared__ float rows[MOE_ROUTE_WARPS][256];
    const u32 warp = threadIdx.x >> 5, lane = threadIdx.x & 31u;
    const u64 t = (u64)blockIdx.x * MOE_ROUTE_WARPS + warp;
    if (t >= tokens) return;  // the whole warp: moe_route_row's shuffles take full warps
    for (u32 i = lane; i < experts; i += 32)
        rows[warp][i] = logits[t * experts + i] + (bias ? bias[i] : 0.0f);
    __syncwarp();
    moe_route_row(rows[warp], experts, k, renorm, weights + t * k, chosen + t * k);
}

// The dispatch's tail after the stable sort of the slots by expert (permute.cu's sort_count,
// sort_offsets and sort_scatter wrote counts, offsets, order and slot_pos, each expert's
// slots in slot order): token_of[p] = order[p] / k over every block, and block 0 the GEMM
// work list from the counts (moe_dispatch_work, the list moe_dispatch_block writes).
// Shared memory: E words.
extern "C" __global__ void __launch_bounds__(1024) moe_dispatch_tail(
    const u32* __restrict__ order, u32 slots, u32 experts, u32 k, u32 bm, u32* __restrict__ counts,
    u32* __restrict__ offsets, u32* __restrict__ token_of, u32* __restrict__ work,
    u32* __restrict__ n_items) {
    extern __shared__ u32 moe_tail_smem[];
    // The grouped GEMM after this kernel may start its blocks; they wait for it before
    // reading anything it writes.
    release_next_grid();
    for (u32 p = blockIdx.x * blockDim.x + threadIdx.x; p < slots; p += gridDim.x * blockDim.x)
        token_of[p] = order[p] / k;
    if (blockIdx.x != 0) return;
    for (u32 e = threadIdx.x; e < experts; e += blockDim.x) moe_tail_smem[e] = counts[e];
    __syncthreads();
    moe_dispatch_work(moe_tail_smem, experts, bm, counts, offsets, nullptr, work, n_items);
}

// ---- the router: logits [tokens, E] (f32) = x · gateᵀ (+ bias). A block of 16 warps
// computes a tile of up to 16·MT rows × 8 columns over one of `splits` K ranges (grid: column
// blocks × splits, row tiles); its warps split that range into contiguous runs and sum
// through shared memory in warp order. With one split the block writes the logits; with
// more it writes its partial sums (split s at logits + s·tokens·E) and the row tile's last
// block adds them in split order, so the logits are deterministic either way. With
// `route`, the last block of a row tile to finish (a ticket per tile) routes the tile's
// rows (softmax top-k, one warp per row, E <= 256), and the last row tile to be routed (one
// more ticket) runs the dispatch: router, routing and dispatch in one kernel. ----
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
