// archs: sm_90 sm_90a
// The clustered MoE router (module `moe_router_cluster`). Thread-block clusters need sm_90, so
// it has a source of its own that older devices never build: the plan takes it only on
// compute capability 9.0 and later.

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
#define MOE_ROUTER_CLUSTER(T) \
    extern "C" __global__ void __launch_bounds__(MOE_RWARPS * 32, 1) moe_router_cluster_##T(MoeRouter p) { moe_router_cluster<T, 8>(p); }
MOE_ROUTER_CLUSTER(bf16)
MOE_ROUTER_CLUSTER(f16)
