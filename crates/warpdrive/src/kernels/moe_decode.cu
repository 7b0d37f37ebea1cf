// archs: sm_80 sm_90 sm_90a
// The one-token MoE decode kernel (module `moe_decode`): the whole layer in one launch.

// ---- the one-token decode: router, routing, gate/up, SwiGLU, down projection and combine
// in one kernel. A decode pass is a stream of weight bytes (the gate and the k chosen
// experts' w13 and w2 rows) with a dot product per row, so every warp streams its rows
// straight from global memory (MOE_DEC_BATCH 16-byte loads per lane and row in flight, twice
// that for the down rows) against f32 vectors in shared memory, and the phases meet at grid
// counters instead of kernel boundaries: separate kernels cost a ramp of the memory stream
// each and the tail of the one before. (A first version streamed through a ring of bulk
// copies into shared memory: its per-stage block barriers left the warps issuing one
// instruction in 15 cycles, slower than the separate kernels; bench/NOTES.md, MoE decode.)
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
