// archs: sm_90a
// The MoE prefill tiles on Hopper's warpgroup MMA (module `moe_wgmma`), built for sm_90a only:
// elsewhere the plan takes the mma.sync tiles of moe_gemm and never loads this module.

// ---- warpgroup MMA (sm_90a): D (64 × N, f32, N / 2 registers per thread) += A · Bᵀ with A
// (64 × 16) and B (N × 16) K-major in shared memory behind 128-byte-swizzle descriptors. ----
template <typename T, int N> struct MoeWgmma;
// The accumulator operands of m64nNk16: N / 2 registers, named 8 per 16 columns, then the
// two descriptors (%N/2, %N/2 + 1).
#define MOE_WGMMA_R16 "%0, %1, %2, %3, %4, %5, %6, %7"
#define MOE_WGMMA_R32 MOE_WGMMA_R16 ", %8, %9, %10, %11, %12, %13, %14, %15"
#define MOE_WGMMA_R48 MOE_WGMMA_R32 ", %16, %17, %18, %19, %20, %21, %22, %23"
#define MOE_WGMMA_R64 MOE_WGMMA_R48 ", %24, %25, %26, %27, %28, %29, %30, %31"
#define MOE_WGMMA_R80 MOE_WGMMA_R64 ", %32, %33, %34, %35, %36, %37, %38, %39"
#define MOE_WGMMA_R96 MOE_WGMMA_R80 ", %40, %41, %42, %43, %44, %45, %46, %47"
#define MOE_WGMMA_R112 MOE_WGMMA_R96 ", %48, %49, %50, %51, %52, %53, %54, %55"
#define MOE_WGMMA_R128 MOE_WGMMA_R112 ", %56, %57, %58, %59, %60, %61, %62, %63"
#define MOE_WGMMA_R144 MOE_WGMMA_R128 ", %64, %65, %66, %67, %68, %69, %70, %71"
#define MOE_WGMMA_R160 MOE_WGMMA_R144 ", %72, %73, %74, %75, %76, %77, %78, %79"
#define MOE_WGMMA_R176 MOE_WGMMA_R160 ", %80, %81, %82, %83, %84, %85, %86, %87"
#define MOE_WGMMA_R192 MOE_WGMMA_R176 ", %88, %89, %90, %91, %92, %93, %94, %95"
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
// The accumulator operands of the first 16·j columns (j = 1 .. 12).
#define MOE_WGMMA_D32 MOE_WGMMA_D16(0), MOE_WGMMA_D16(8)
#define MOE_WGMMA_D48 MOE_WGMMA_D32, MOE_WGMMA_D16(16)
#define MOE_WGMMA_D64 MOE_WGMMA_D48, MOE_WGMMA_D16(24)
#define MOE_WGMMA_D80 MOE_WGMMA_D64, MOE_WGMMA_D16(32)
#define MOE_WGMMA_D96 MOE_WGMMA_D80, MOE_WGMMA_D16(40)
#define MOE_WGMMA_D112 MOE_WGMMA_D96, MOE_WGMMA_D16(48)
#define MOE_WGMMA_D128 MOE_WGMMA_D112, MOE_WGMMA_D16(56)
#define MOE_WGMMA_D144 MOE_WGMMA_D128, MOE_WGMMA_D16(64)
#define MOE_WGMMA_D160 MOE_WGMMA_D144, MOE_WGMMA_D16(72)
#define MOE_WGMMA_D176 MOE_WGMMA_D160, MOE_WGMMA_D16(80)
#define MOE_WGMMA_D192 MOE_WGMMA_D176, MOE_WGMMA_D16(88)
#define MOE_WGMMA_ALL(T, TY) \
    MOE_WGMMA(T, TY, 16, "%8, %9", MOE_WGMMA_D16(0)) \
    MOE_WGMMA(T, TY, 32, "%16, %17", MOE_WGMMA_D32) \
    MOE_WGMMA(T, TY, 48, "%24, %25", MOE_WGMMA_D48) \
    MOE_WGMMA(T, TY, 64, "%32, %33", MOE_WGMMA_D64) \
    MOE_WGMMA(T, TY, 80, "%40, %41", MOE_WGMMA_D80) \
    MOE_WGMMA(T, TY, 96, "%48, %49", MOE_WGMMA_D96) \
    MOE_WGMMA(T, TY, 112, "%56, %57", MOE_WGMMA_D112) \
    MOE_WGMMA(T, TY, 128, "%64, %65", MOE_WGMMA_D128) \
    MOE_WGMMA(T, TY, 144, "%72, %73", MOE_WGMMA_D144) \
    MOE_WGMMA(T, TY, 160, "%80, %81", MOE_WGMMA_D160) \
    MOE_WGMMA(T, TY, 176, "%88, %89", MOE_WGMMA_D176) \
    MOE_WGMMA(T, TY, 192, "%96, %97", MOE_WGMMA_D192)
MOE_WGMMA_ALL(bf16, "bf16")
MOE_WGMMA_ALL(f16, "f16")

// Shared-memory descriptor of a K-major operand tile whose 128-byte rows are stored in the
// 128-byte swizzle (16-byte chunk c of row r at chunk c ^ (r % 8); tile base 1024-aligned):
// leading byte offset unused (1), stride 1024 bytes between 8-row groups, layout 1 (SW128).
__device__ __forceinline__ u64 moe_sw128_desc(u32 addr) {
    return (u64)((addr & 0x3FFFFu) >> 4) | ((u64)1 << 16) | ((u64)(1024 >> 4) << 32) | ((u64)1 << 62);
}
__device__ __forceinline__ void moe_wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void moe_wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void moe_wgmma_wait0() { asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory"); }
__device__ __forceinline__ void moe_wgmma_wait1() { asm volatile("wgmma.wait_group.sync.aligned 1;" ::: "memory"); }
__device__ __forceinline__ void moe_fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }

// One 64-k stage of a warpgroup's MMAs: its 64 weight rows (A, at `wa`) times the tile's first
// N token rows (B, at `xb`), 4 k16 steps (32 bytes along the swizzled rows each).
template <typename T, int N, int NMAX>
__device__ __forceinline__ void moe_wgmma_stage(float (&acc)[NMAX / 2], u32 wa, u32 xb) {
#pragma unroll
    for (u32 kk = 0; kk < MOE_SBK / 16; ++kk)
        MoeWgmma<T, N>::run(acc, moe_sw128_desc(wa + kk * 32), moe_sw128_desc(xb + kk * 32));
}
// The same stage for a warpgroup of CH chunks of 64 weight rows (CH = 2 on the
// 256-weight-row tile): CH m64 MMAs a k16 step on the same token rows, chunk j's 64 weight
// rows 64·j rows (8 KB) past `wa`.
template <typename T, int N, int NMAX, int CH>
__device__ __forceinline__ void moe_wgmma_stage(float (&acc)[CH][NMAX / 2], u32 wa, u32 xb) {
#pragma unroll
    for (u32 kk = 0; kk < MOE_SBK / 16; ++kk) {
        const u64 db = moe_sw128_desc(xb + kk * 32);
#pragma unroll
        for (int j = 0; j < CH; ++j)
            MoeWgmma<T, N>::run(acc[j], moe_sw128_desc(wa + j * 64 * 128 + kk * 32), db);
    }
}

// A prefill tile's k loop on wgmma for its first N token rows (one instance per N, so the
// accumulators keep their registers across the asynchronous MMAs): the warpgroup's 64
// weight rows start `wa` bytes into each stage. `Acc`: float[NMAX / 2], or float[CH][NMAX / 2]
// for CH 64-row chunks (moe_wgmma_stage's overloads).
template <typename T, int N, int NMAX, u32 STAGES, typename Loads, typename Acc>
__device__ __forceinline__ void moe_wgmma_k_loop(Acc& acc, const Loads& loads, u32 smem, u32 wa) {
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

// The wgmma tile's results (accumulator i of chunk j of a thread, warp w of its warpgroup wg,
// lane g·4 + q: weight row 64·CH·wg + 64·j + 16w + g + 8·(i % 4 / 2), token row
// 8·(i / 4) + 2q + i % 2) go through shared memory `c` (the free ring) to whole rows of BN
// weight columns, so the split-K partials, their sums and the epilogues move float4s along
// rows instead of scattered words (n % 8 == 0 on CUDA). Partials are summed in split order by
// the tile's last block: results stay deterministic. CH = 1 (BN = 128: each warpgroup 64
// rows) or 2 (BN = 256: each warpgroup two chunks of 64). CONSUMERS: only the two consumer
// warpgroups (threads 0..255) run it, on named barrier 1.
template <typename T, u32 BM, u32 BN, int CH, bool CONSUMERS>
__device__ void moe_wgmma_finish_n(const MoeGemm& p, const MoeTile& t, const float (&acc)[CH][BM / 2], float* c) {
    static_assert(BN == 128 * CH, "two warpgroups of CH chunks of 64 weight rows");
    constexpr u32 LD = BN + 4;  // padded rows: the scattered writes hit 32 banks
    const u32 lane = threadIdx.x & 31u, warp = threadIdx.x >> 5, g = lane >> 2, q = lane & 3u;
    const u32 nl = (warp >> 2) * 64 * CH + (warp & 3u) * 16 + g;
    // Epilogue 2's routing weights of this warp's rows (warp + 8j: lane j holds row j's),
    // requested by every lane at once before the staging: one dependent pair of loads a
    // tile, not one a row in turn (at K = 256 that pair per row outlasted the tile's MMAs).
    static_assert(BM / MOE_WARPS <= 32, "a lane per row of the warp");
    float lane_scale = 0.0f;
    if (p.epilogue != 1 && warp + MOE_WARPS * lane < t.rows)
        lane_scale = p.slot_weight[p.order[t.row0 + warp + MOE_WARPS * lane]];
    moe_tile_sync<CONSUMERS>();  // every warpgroup is done with the ring
#pragma unroll
    for (int j = 0; j < CH; ++j)
#pragma unroll
        for (int i = 0; i < (int)BM / 2; ++i)
            c[(8u * (i / 4) + 2u * q + i % 2) * LD + nl + 64u * j + 8u * ((i % 4) / 2)] = acc[j][i];
    moe_tile_sync<CONSUMERS>();
    // Thread: float4 columns `col` + 128·cc of rows r0, r0 + 8, ... (one warp per row).
    const u32 col = lane * 4, r0 = warp;
    const auto n_of = [&](u32 cc) { return t.nb * BN + cc * 128 + col; };
    if (p.splits > 1) {
        for (u32 r = r0; r < t.rows; r += MOE_WARPS)
#pragma unroll
            for (u32 cc = 0; cc < BN / 128; ++cc)
                if (n_of(cc) < p.n)
                    *reinterpret_cast<float4*>(p.partial + ((u64)t.split * p.rows_cap + t.row0 + r) * p.n + n_of(cc)) =
                        *reinterpret_cast<const float4*>(c + r * LD + cc * 128 + col);
        if (!moe_arrive_last<CONSUMERS>(&p.tickets[t.tile], p.splits)) return;
        const u64 stride = (u64)p.rows_cap * p.n;
        for (u32 r = r0; r < t.rows; r += MOE_WARPS) {
#pragma unroll
            for (u32 cc = 0; cc < BN / 128; ++cc) {
                const u32 n = n_of(cc);
                if (n >= p.n) continue;
                const float* src = p.partial + ((u64)t.row0 + r) * p.n + n;
                float4 sum = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
                for (u32 sp = 0; sp < p.splits; ++sp) {
                    const float4 v = __ldcg(reinterpret_cast<const float4*>(src + sp * stride));
                    sum.x += v.x;
                    sum.y += v.y;
                    sum.z += v.z;
                    sum.w += v.w;
                }
                *reinterpret_cast<float4*>(c + r * LD + cc * 128 + col) = sum;
            }
        }
        moe_tile_sync<CONSUMERS>();
    }
    if (p.epilogue == 1) {
        // Weight rows 16m + j (gate) and 16m + 8 + j (up) make act column 8m + j: thread
        // (TPR per row) takes act columns 4·j4 .. 4·j4 + 3 of rows r, r + 256 / TPR, ...
        constexpr u32 TPR = BN / 8;
        const u32 half_n = p.n >> 1, j4 = threadIdx.x & (TPR - 1), gate = (j4 >> 1) * 16 + (j4 & 1u) * 4;
        const u32 act = (t.nb * BN >> 1) + 4 * j4;
        if (act >= half_n) return;
        for (u32 r = threadIdx.x / TPR; r < t.rows; r += 256 / TPR) {
            const float4 gv = *reinterpret_cast<const float4*>(c + r * LD + gate);
            const float4 uv = *reinterpret_cast<const float4*>(c + r * LD + gate + 8);
            const float o[4] = {moe_silu(gv.x) * uv.x, moe_silu(gv.y) * uv.y, moe_silu(gv.z) * uv.z,
                                moe_silu(gv.w) * uv.w};
            store_vec<T, 4>(reinterpret_cast<T*>(p.out) + (u64)(t.row0 + r) * half_n + act, pack_vec<T, 4>(o));
        }
    } else {
        // r0 = warp: the loop is warp-uniform, so every lane takes part in the shuffle.
        for (u32 r = r0, j = 0; r < t.rows; r += MOE_WARPS, ++j) {
            const float scale = __shfl_sync(0xffffffffu, lane_scale, j);
            const u32 prow = t.row0 + r;
#pragma unroll
            for (u32 cc = 0; cc < BN / 128; ++cc) {
                const u32 n = n_of(cc);
                if (n >= p.n) continue;
                const float4 v = *reinterpret_cast<const float4*>(c + r * LD + cc * 128 + col);
                const float o[4] = {v.x * scale, v.y * scale, v.z * scale, v.w * scale};
                store_vec<T, 4>(reinterpret_cast<T*>(p.out) + (u64)prow * p.n + n, pack_vec<T, 4>(o));
            }
        }
    }
}

// ---- One group of MMAs in flight across the stage boundary (the `o` tiles, issue 40):
// wgmma.wait_group 1 instead of 0, so stage kt's MMAs are issued while stage kt - 1's still
// run and the tensor pipe does not drain at every 64 k. A stage's slot is then free only once
// the MMAs two stages back are done, so the ring (same 4 slots, same shared memory and
// blocks per SM) runs 2 stages ahead instead of 3. ----

// The first 2 stages (W before the wait for the previous kernel, A after it, as
// MoeStageLoads::start), one commit group each: stage s's data is in groups 0..s.
template <typename Loads>
__device__ __forceinline__ void moe_wgmma_start2(const Loads& loads, const MoeGemm& p) {
    if (p.early_k) moe_prefetch_rows_l2(loads.w_src, loads.k_begin, loads.k_end, p.early_k, loads.c, 8);
#pragma unroll
    for (u32 s = 0; s < 2; ++s)
        if (s < loads.k_tiles) loads.load_w(s);
    if (p.early_k) wait_prior_grid();
    release_next_grid();
#pragma unroll
    for (u32 s = 0; s < 2; ++s) {
        if (s < loads.k_tiles) loads.load_a(s);
        moe_cp_async_commit();
    }
}

// Iteration kt: 2 + kt groups committed before it, stage kt is group kt, so at most 1 may be
// pending. After the barrier every warpgroup has passed its wait_group 1 behind stage kt - 1's
// MMAs, so stage kt - 2's are done everywhere and its slot ((kt + 2) % 4) takes stage kt + 2.
template <typename T, int N, int NMAX, u32 STAGES, typename Loads, typename Acc>
__device__ __forceinline__ void moe_wgmma_k_loop_overlap(Acc& acc, const Loads& loads, u32 smem, u32 wa) {
    static_assert(STAGES == 4, "2 stages loading, 2 being multiplied");
    for (u32 kt = 0; kt < loads.k_tiles; ++kt) {
        moe_cp_async_wait<1>();
        moe_fence_proxy_async();  // this thread's cp.async data, visible to the async proxy
        __syncthreads();          // every thread's; stage kt - 2's MMAs are done everywhere
        if (kt + 2 < loads.k_tiles) {
            loads.load_w(kt + 2);
            loads.load_a(kt + 2);
        }
        moe_cp_async_commit();
        const u32 stage = smem + (kt % STAGES) * Loads::STAGE_BYTES;
        moe_wgmma_fence();
        moe_wgmma_stage<T, N, NMAX>(acc, stage + wa, stage);
        moe_wgmma_commit();
        moe_wgmma_wait1();
    }
    moe_wgmma_wait0();  // the accumulators are read next
}

// The k loop of one tile: stage by stage (`moe_wgmma_k_loop`) or with one group of MMAs in
// flight across stages (`moe_wgmma_k_loop_overlap`).
template <typename T, int N, int NMAX, u32 STAGES, bool OVERLAP, typename Loads, typename Acc>
__device__ __forceinline__ void moe_wgmma_k(Acc& acc, const Loads& loads, u32 smem, u32 wa) {
    if constexpr (OVERLAP)
        moe_wgmma_k_loop_overlap<T, N, NMAX, STAGES>(acc, loads, smem, wa);
    else
        moe_wgmma_k_loop<T, N, NMAX, STAGES>(acc, loads, smem, wa);
}

// The k loop on MMAs N wide for the tile's first `live16` · 16 token rows: the least N from
// N0 up, in steps of 16, that covers them (one instance per N: the accumulators stay in
// registers across the asynchronous MMAs, and no MMA covers rows past the tile's).
template <typename T, int N, int NMAX, u32 STAGES, bool OVERLAP, typename Loads, typename Acc>
__device__ __forceinline__ void moe_wgmma_k_live(u32 live16, Acc& acc, const Loads& loads, u32 smem, u32 wa) {
    if constexpr (N < NMAX) {
        if (live16 * 16 > (u32)N) {
            moe_wgmma_k_live<T, N + 16, NMAX, STAGES, OVERLAP>(live16, acc, loads, smem, wa);
            return;
        }
    }
    moe_wgmma_k<T, N, NMAX, STAGES, OVERLAP>(acc, loads, smem, wa);
}

// The prefill tile on Hopper's warpgroup MMA: the same work list, stages, loads and swizzled
// shared memory as moe_gemm_staged (BM = 32·MT token rows × BN = 128 weight rows, 4 stages;
// BN = 256 for the x256 kernels below), but the two warpgroups each multiply BN / 2 weight rows
// (wgmma M: BN / 128 chunks of 64) by the tile's live token rows
// (wgmma N, rounded up to 16) straight from shared memory: no ldmatrix round trips through
// registers, no MMAs on rows past the tile's rows (accumulators: moe_wgmma_finish_n).
// OVERLAP: the k loop with one group of MMAs in flight (the `o` kernels). MT = 6 (the wide
// tile, 192 rows: one block per SM) holds an expert's rows up to 192 in one tile, so its
// weights stream once where the 96-row tile streamed them twice (issue 40).
template <typename T, int MT, u32 BN, bool OVERLAP>
__device__ void moe_gemm_wgmma(const MoeGemm& p) {
    constexpr u32 BM = 32 * MT, NMAX = BM, STAGES = 4;
    constexpr int CH = BN / 128;  // 64-row chunks of weights a warpgroup
    using Loads = MoeStageLoads<T, BM, BN, STAGES>;
    constexpr u32 A_BYTES = Loads::A_BYTES, STAGE_BYTES = Loads::STAGE_BYTES;
    static_assert(A_BYTES % 1024 == 0 && STAGE_BYTES % 1024 == 0, "SW128 tiles need 1024-byte alignment");
    static_assert(BM * (BN + 4) * 4 <= STAGES * STAGE_BYTES, "the epilogue's staging fits the ring");
    extern __shared__ __align__(128) unsigned char moe_smem[];
    MoeTile t;
    if (!moe_gemm_tile(p, BM, BN, t)) return;
    const u32 warp = threadIdx.x >> 5;
    // The stages from the first 1024-byte boundary (the launch asks for 1 KB more): an
    // __align__(1024) declaration would pad every kernel's static shared memory instead.
    const u32 base = (u32)__cvta_generic_to_shared(moe_smem), smem = (base + 1023u) & ~1023u;
    const Loads loads(p, t, smem);
    if constexpr (OVERLAP)
        moe_wgmma_start2(loads, p);
    else
        loads.start(p);

    const u32 wg = warp >> 2;               // warpgroup: weight rows 64·CH·wg ..
    const u32 live16 = (t.rows + 15) / 16;  // token rows the MMAs cover, in 16s
    float acc[CH][NMAX / 2];
#pragma unroll
    for (int j = 0; j < CH; ++j)
#pragma unroll
        for (int i = 0; i < (int)NMAX / 2; ++i) acc[j][i] = 0.0f;

    moe_wgmma_k_live<T, 16, NMAX, STAGES, OVERLAP>(live16, acc, loads, smem, A_BYTES + wg * 64 * CH * 128);
    moe_cp_async_wait<0>();
    moe_wgmma_finish_n<T, BM, BN, CH, false>(p, t, acc, reinterpret_cast<float*>(moe_smem + (smem - base)));
}

// The `w` kernels drain the MMAs every stage, the `o` kernels (overlap) keep one group in
// flight: same shared memory, blocks per SM and work list, so the plan swaps one for the
// other per launch.
#define MOE_GEMM_WGMMA_AS(T, NAME, MT, BLOCKS, SUFFIX, OVERLAP)                                    \
    extern "C" __global__ void __launch_bounds__(256, BLOCKS) moe_gemm_##T##_##NAME##SUFFIX(MoeGemm p) { \
        moe_gemm_wgmma<T, MT, 128, OVERLAP>(p);                                                       \
    }

// ---- The warp-specialized tile (the `t` kernels, issue 40; off by default,
// MoeLayer::set_wgmma_tma): the same work list, tile, ring of 4 stages, swizzled layout, MMAs
// and epilogue as the `o` kernels, but one producer warp (warp 8, threads 256..287) issues the
// TMA copies while the two consumer warpgroups (warps 0..7) multiply. The weight box of a
// stage (128 rows × 64 k, 16 KB) comes by TMA from the tensor map `p.w_map` ([experts, n, k],
// SWIZZLE_128B: the ring's own layout; rows past n and k past k are zero-filled and still
// counted in the transaction bytes). The token rows come one of two ways (block-uniform):
// - by TMA too (`a_tma`: the down GEMM, whose rows are contiguous per expert in `act`), as
//   32-row boxes of the 2D map `p.a_map` [rows, k] (one per 32 live rows of the tile); rows
//   past the tile's are the next expert's (their MMA columns are discarded) or zeros past the
//   buffer. Only where the k range ends at k or is whole 64-k stages: a box past k_end would
//   bring the next split's k, which the weights' box (also past k_end) would multiply.
// - by the consumers' own cp.async (the gate/up GEMM gathers x rows through a_rows, which no
//   tensor map expresses on sm_90): 3 (m4: 2, m12: 6) 16-byte copies a thread for stage
//   kt + 2 while stage kt is multiplied, as the `o` kernels, so no single warp issues them all.
// Each slot has a full barrier (a_tma: 2 arrivals, the producer's two arrive.expect_tx;
// else 257: the producer's arrive.expect_tx and the 256 consumer threads'
// cp.async.mbarrier.arrive.noinc; plus the TMA's bytes) and an empty barrier (8 arrivals: lane
// 0 of each consumer warp once the MMAs that read the slot are done). Every loop is bounded by
// k_tiles: the producer issues stage kt after the slot's previous use (kt - 4) is released,
// the consumers load stage kt + 2's rows after kt - 2's release and release stage kt - 1 after
// issuing stage kt (wgmma.wait_group 1), so stage k_tiles - 1 is never waited for by the
// producer and never released. ----
#define MOE_TMA_STAGES 4
#define MOE_TMA_THREADS (256 + 32)
#define MOE_TMA_WG_THREADS (256 + 128)

__device__ __forceinline__ void moe_mbar_init(u32 bar, u32 count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" :: "r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void moe_mbar_wait(u32 bar, u32 parity) {
    u32 done;
    do {
        asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
                     : "=r"(done) : "r"(bar), "r"(parity) : "memory");
    } while (!done);
}
__device__ __forceinline__ void moe_mbar_arrive(u32 bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" :: "r"(bar) : "memory");
}
__device__ __forceinline__ void moe_mbar_arrive_tx(u32 bar, u32 bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" :: "r"(bar), "r"(bytes) : "memory");
}
// One arrival on `bar` once every cp.async this thread issued before has landed (noinc: the
// barrier's count includes it).
__device__ __forceinline__ void moe_cp_async_arrive(u32 bar) {
    asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" :: "r"(bar) : "memory");
}
// The box at (k0, n0, expert) of a 3D tensor map into shared memory `dst`, its bytes counted
// on `bar`.
__device__ __forceinline__ void moe_tma_load_3d(u32 dst, const void* map, u32 bar, int k0, int n0, int e) {
    asm volatile("cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], [%5];"
                 :: "r"(dst), "l"(map), "r"(k0), "r"(n0), "r"(e), "r"(bar) : "memory");
}
// The box at (k0, row0) of a 2D tensor map.
__device__ __forceinline__ void moe_tma_load_2d(u32 dst, const void* map, u32 bar, int k0, int row0) {
    asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];"
                 :: "r"(dst), "l"(map), "r"(k0), "r"(row0), "r"(bar) : "memory");
}

// A share of a stage's token rows where they are not a TMA box, loaded by THREADS threads
// (the 256 consumers of the 128-weight-row tile, or the producer warpgroup's 128 of the
// 256-weight-row one): thread tid = threadIdx.x % THREADS copies 16-byte chunk tid % 8 of
// rows tid / 8 + (THREADS / 8)·i, zero-filled past the tile's rows and k_end (rows past the
// MMAs' last 16 are not touched), then arrives on the slot's full barrier once its copies
// have landed.
template <typename T, u32 BM, u32 STAGE_BYTES, u32 THREADS = 256>
struct MoeTmaRows {
    static constexpr u32 P = THREADS / 8, R = BM / P;  // rows a pass, rows a thread
    static_assert(R * P == BM && (THREADS & (THREADS - 1)) == 0, "whole rows per thread");
    const T* a;
    u32 k, k_begin, k_end, c, r, rows16, smem, bars;
    u32 src[R];  // source row of rows r + P·i (~0u: past the tile's rows)
    __device__ __forceinline__ MoeTmaRows(const MoeGemm& p, const MoeTile& t, u32 smem_, u32 bars_)
        : a(reinterpret_cast<const T*>(p.a)), k(p.k), k_begin(t.k_begin), k_end(t.k_end), c(threadIdx.x & 7u),
          r((threadIdx.x & (THREADS - 1)) >> 3), rows16((t.rows + 15) / 16 * 16), smem(smem_), bars(bars_) {
#pragma unroll
        for (u32 i = 0; i < R; ++i) {
            const u32 row = r + P * i;
            src[i] = ~0u;
            if (row < t.rows) src[i] = p.a_rows ? __ldcg(p.a_rows + t.row0 + row) : t.row0 + row;
        }
    }
    __device__ __forceinline__ void load(u32 kt) const {
        const u32 s = kt % MOE_TMA_STAGES, kc = k_begin + kt * MOE_SBK + c * 8;
        const u32 stage = smem + s * STAGE_BYTES;
#pragma unroll
        for (u32 i = 0; i < R; ++i) {
            const u32 row = r + P * i;
            if (row >= rows16) continue;
            const bool ok = src[i] != ~0u && kc < k_end;
            moe_cp_async16(stage + row * 128 + (((c ^ row) & 7u) << 4), ok ? a + (u64)src[i] * k + kc : a, ok ? 16 : 0);
        }
        moe_cp_async_arrive(bars + s * 8);
    }
};
// No token rows to load (the consumers of the 256-weight-row tile: its producer warpgroup
// loads them).
struct MoeNoRows {
    __device__ __forceinline__ void load(u32) const {}
};

// The consumers' k loop for the tile's first N token rows: (LOADS) load this thread's share of
// stage kt + 2's token rows once stage kt - 2's MMAs are done everywhere, wait for stage kt's
// slot, issue its MMAs, keep one group in flight (wgmma.wait_group 1), then release stage
// kt - 1's slot (its MMAs are done in this warp; the empty barrier waits for all 8 warps).
// `Acc`: float[NMAX / 2], or float[CH][NMAX / 2] for CH 64-row chunks a warpgroup.
template <typename T, int N, int NMAX, u32 STAGE_BYTES, typename Rows, typename Acc>
// `fence`: some of the stage's rows came by cp.async (the generic proxy), not all by TMA.
__device__ __forceinline__ void moe_wgmma_tma_k(Acc& acc, u32 k_tiles, u32 smem, u32 wa, u32 bars, u32 lane,
                                                const Rows& rows, bool loads, bool fence) {
    constexpr u32 S = MOE_TMA_STAGES;
    for (u32 kt = 0; kt < k_tiles; ++kt) {
        const u32 s = kt % S;
        if (loads && kt + 2 < k_tiles) {
            const u32 kn = kt + 2;
            if (kn >= S) moe_mbar_wait(bars + (S + kn % S) * 8, (kn / S - 1) & 1u);
            rows.load(kn);
        }
        moe_mbar_wait(bars + s * 8, (kt / S) & 1u);
        if (fence) moe_fence_proxy_async();  // cp.async rows (generic proxy), seen by wgmma
        const u32 stage = smem + s * STAGE_BYTES;
        moe_wgmma_fence();
        moe_wgmma_stage<T, N, NMAX>(acc, stage + wa, stage);
        moe_wgmma_commit();
        moe_wgmma_wait1();
        if (kt > 0 && lane == 0) moe_mbar_arrive(bars + (S + (kt - 1) % S) * 8);
    }
    moe_wgmma_wait0();  // the accumulators are read next
}
// The least N from N0 up, in steps of 16, that covers the live rows (as moe_wgmma_k_live).
template <typename T, int N, int NMAX, u32 STAGE_BYTES, typename Rows, typename Acc>
__device__ __forceinline__ void moe_wgmma_tma_live(u32 live16, Acc& acc, u32 k_tiles, u32 smem, u32 wa, u32 bars,
                                                   u32 lane, const Rows& rows, bool loads, bool fence) {
    if constexpr (N < NMAX) {
        if (live16 * 16 > (u32)N) {
            moe_wgmma_tma_live<T, N + 16, NMAX, STAGE_BYTES>(live16, acc, k_tiles, smem, wa, bars, lane, rows, loads, fence);
            return;
        }
    }
    moe_wgmma_tma_k<T, N, NMAX, STAGE_BYTES>(acc, k_tiles, smem, wa, bars, lane, rows, loads, fence);
}

// The same box into L2 only.
__device__ __forceinline__ void moe_tma_prefetch_3d(const void* map, int k0, int n0, int e) {
    asm volatile("cp.async.bulk.prefetch.tensor.3d.L2.global.tile [%0, {%1, %2, %3}];"
                 :: "l"(map), "r"(k0), "r"(n0), "r"(e) : "memory");
}

// setmaxnreg (sm_90a): this warpgroup's registers a thread, down to R or up to R (every warp
// of the warpgroup runs the same one). The 384-thread tile launches at 168 (65,536 / 384,
// rounded down to 8): the producer gives back 168 - MOE_WS_PRODUCER_REGS a thread, exactly
// what the consumers take to reach MOE_WS_CONSUMER_REGS (128 · 112 = 256 · 56), so the
// consumers' setmaxnreg.inc never waits on registers no one returns.
#define MOE_WS_PRODUCER_REGS 56
#define MOE_WS_CONSUMER_REGS 224
static_assert(128 * (168 - MOE_WS_PRODUCER_REGS) == 256 * (MOE_WS_CONSUMER_REGS - 168), "a balanced pool");
template <u32 R>
__device__ __forceinline__ void moe_regs_dec() {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" :: "n"(R));
}
template <u32 R>
__device__ __forceinline__ void moe_regs_inc() {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" :: "n"(R));
}

// The producer's loop: stage kt into slot kt % S once stage kt - S's MMAs are done there
// (empty barrier `empty0` + 8·slot; the first S slots are free, their weights already on the
// way): the issuer's weights (kt >= S) and act boxes, every producer thread's share of
// gathered rows (`rows`; MoeNoRows where there are none).
template <u32 S, typename LoadW, typename LoadA, typename Rows>
__device__ __forceinline__ void moe_tma_produce(u32 k_tiles, u32 empty0, bool issuer, bool a_tma, const LoadW& load_w,
                                                const LoadA& load_a, const Rows& rows) {
    for (u32 kt = 0; kt < k_tiles; ++kt) {
        if (kt >= S) moe_mbar_wait(empty0 + (kt % S) * 8, (kt / S - 1) & 1u);
        if (issuer) {
            if (kt >= S) load_w(kt);
            if (a_tma) load_a(kt);
        }
        rows.load(kt);
    }
}

// BN = 128: the `t` kernels above (warp 8 produces, the consumers load gathered rows).
// BN = 256 (the `x256t` kernels, forced only: MoeLayer::set_wgmma_tma with the 256-weight-row
// tile): the producer is a whole warpgroup (warps 8..11, 384 threads: setmaxnreg works by
// warpgroup), down to MOE_WS_PRODUCER_REGS registers; thread 256 issues the weights' two
// 128-row boxes a stage (only those starting inside n: a box wholly past n would only bring
// zeros for discarded columns) and the act boxes, and where the rows are gathered all 128
// producer threads load them by cp.async (16-byte chunk tid % 8 of 8 rows a thread), waiting
// for the slot's empty barrier themselves. The consumers, up to MOE_WS_CONSUMER_REGS, only
// multiply: CH = 2 m64 MMAs a k16 step a warpgroup, one group in flight, as the `t` loop.
template <typename T, int MT, u32 BN = 128>
__device__ void moe_gemm_wgmma_tma(const MoeGemm& p) {
    constexpr bool WG = BN == 256;  // a producer warpgroup
    constexpr int CH = BN / 128;    // 64-row chunks of weights a consumer warpgroup
    constexpr u32 BM = 32 * MT, NMAX = BM, S = MOE_TMA_STAGES;
    constexpr u32 A_BYTES = BM * MOE_SBK * 2, W_BYTES = BN * MOE_SBK * 2, STAGE_BYTES = A_BYTES + W_BYTES;
    constexpr u32 RING_BYTES = S * STAGE_BYTES, BOX_BYTES = 32 * MOE_SBK * 2, W_BOX_BYTES = 128 * MOE_SBK * 2;
    static_assert(A_BYTES % 1024 == 0 && STAGE_BYTES % 1024 == 0, "SW128 tiles need 1024-byte alignment");
    static_assert(BN == 128 || BN == 256, "one or two weight boxes a stage");
    static_assert(BM * (BN + 4) * 4 <= RING_BYTES, "the epilogue's staging fits the ring");
    extern __shared__ __align__(128) unsigned char moe_smem[];
    MoeTile t;
    if (!moe_gemm_tile(p, BM, BN, t)) return;  // block-uniform
    const u32 warp = threadIdx.x >> 5, lane = threadIdx.x & 31u;
    // The ring from the first 1024-byte boundary, as moe_gemm_wgmma (the launch asks for
    // 1 KB more); the 2·S barriers (8 bytes each) in the alignment slack: before the ring
    // where that gap holds them, else after it (the gap and the tail make 1 KB together).
    const u32 base = (u32)__cvta_generic_to_shared(moe_smem), smem = (base + 1023u) & ~1023u;
    const u32 bars = (smem - base >= 2 * S * 8) ? ((base + 7u) & ~7u) : smem + RING_BYTES;
    const auto full = [&](u32 s) { return bars + s * 8; };
    const auto empty = [&](u32 s) { return bars + (S + s) * 8; };
    // Token rows by TMA: contiguous rows with a map, and no box past k_end inside the tensor.
    const bool a_tma = p.a_map && !p.a_rows && (t.k_end == p.k || (t.k_end - t.k_begin) % MOE_SBK == 0);
    if (threadIdx.x == 0) {
        for (u32 s = 0; s < S; ++s) {
            // The producer's arrivals (weights, and act boxes) and the row loaders'.
            moe_mbar_init(full(s), a_tma ? 2 : 1 + (WG ? 128 : 256));
            moe_mbar_init(empty(s), 8);
        }
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();
    const u32 k_tiles = (t.k_end - t.k_begin + MOE_SBK - 1) / MOE_SBK;

    if (warp >= 2 * 4) {
        // ---- producer (thread 256 issues the TMA copies; BN = 256: its warpgroup loads the
        // gathered rows) ----
        if constexpr (WG) moe_regs_dec<MOE_WS_PRODUCER_REGS>();
        if (threadIdx.x != 2 * 4 * 32 && !(WG && !a_tma)) return;
        const bool issuer = !WG || threadIdx.x == 2 * 4 * 32;  // BN = 128: only it is left
        // The weight boxes of 128 rows that start inside n.
        const u32 w_boxes = WG ? min(BN / 128, (p.n - t.nb * BN + 127) / 128) : 1;
        const auto load_w = [&](u32 kt) {
            const u32 s = kt % S;
            moe_mbar_arrive_tx(full(s), w_boxes * W_BOX_BYTES);
            for (u32 j = 0; j < w_boxes; ++j)
                moe_tma_load_3d(smem + s * STAGE_BYTES + A_BYTES + j * W_BOX_BYTES, p.w_map, full(s),
                                (int)(t.k_begin + kt * MOE_SBK), (int)(t.nb * BN + 128 * j), (int)t.expert);
        };
        // One 32-row box per 32 live rows (the MMAs read no rows past the tile's last 16).
        const u32 boxes = min((u32)MT, (t.rows + 31) / 32);
        const auto load_a = [&](u32 kt) {
            const u32 s = kt % S;
            moe_mbar_arrive_tx(full(s), boxes * BOX_BYTES);
            for (u32 j = 0; j < boxes; ++j)
                moe_tma_load_2d(smem + s * STAGE_BYTES + j * BOX_BYTES, p.a_map, full(s),
                                (int)(t.k_begin + kt * MOE_SBK), (int)(t.row0 + 32 * j));
        };
        const u32 first = min(S, k_tiles);
        if (issuer) {
            // The maps were written by a host copy (generic proxy) before the launch: acquire
            // them for the tensor-map proxy before their first use.
            asm volatile("fence.proxy.tensormap::generic.acquire.gpu [%0], 128;" :: "l"(p.w_map) : "memory");
            if (a_tma) asm volatile("fence.proxy.tensormap::generic.acquire.gpu [%0], 128;" :: "l"(p.a_map) : "memory");
            // The weights of the first stages do not depend on the previous kernel.
            for (u32 kt = 0; kt < first; ++kt) load_w(kt);
            // The plan's early_k of the weights into L2 (as moe_prefetch_rows_l2), box by box.
            if (p.early_k) {
                const u32 pf_tiles = (min(t.k_end, t.k_begin + p.early_k) - t.k_begin + MOE_SBK - 1) / MOE_SBK;
                for (u32 kt = first; kt < pf_tiles; ++kt)
                    for (u32 j = 0; j < w_boxes; ++j)
                        moe_tma_prefetch_3d(p.w_map, (int)(t.k_begin + kt * MOE_SBK), (int)(t.nb * BN + 128 * j),
                                            (int)t.expert);
            }
        }
        if (p.early_k) wait_prior_grid();  // else moe_gemm_tile waited
        release_next_grid();
        // act was written by the previous kernel's generic stores; read here by the async proxy.
        if (issuer && a_tma) asm volatile("fence.proxy.async.global;" ::: "memory");
        if constexpr (WG) {
            if (!a_tma) {
                const MoeTmaRows<T, BM, STAGE_BYTES, 128> rows(p, t, smem, bars);
                moe_tma_produce<S>(k_tiles, empty(0), issuer, a_tma, load_w, load_a, rows);
                // Nothing of this thread's left in flight at exit (its copies are in no
                // commit group: wait_all = commit + wait_group 0).
                moe_cp_async_commit();
                moe_cp_async_wait<0>();
            } else {
                moe_tma_produce<S>(k_tiles, empty(0), issuer, a_tma, load_w, load_a, MoeNoRows{});
            }
        } else {
            moe_tma_produce<S>(k_tiles, empty(0), issuer, a_tma, load_w, load_a, MoeNoRows{});
        }
        // Stay until the last stages have landed (nothing is left in flight at exit).
        if (issuer)
            for (u32 kt = k_tiles > S ? k_tiles - S : 0; kt < k_tiles; ++kt) moe_mbar_wait(full(kt % S), (kt / S) & 1u);
        return;
    }

    // ---- consumers: warpgroup wg multiplies weight rows 64·CH·wg .. of each stage ----
    if constexpr (WG) moe_regs_inc<MOE_WS_CONSUMER_REGS>();
    if (p.early_k) wait_prior_grid();  // before the token rows, the epilogue's reads and writes
    release_next_grid();
    const u32 wg = warp >> 2, live16 = (t.rows + 15) / 16, wa = A_BYTES + wg * 64 * CH * 128;
    float acc[CH][NMAX / 2];
#pragma unroll
    for (int j = 0; j < CH; ++j)
#pragma unroll
        for (int i = 0; i < (int)NMAX / 2; ++i) acc[j][i] = 0.0f;
    if constexpr (WG) {
        // The producer's cp.async rows need the proxy fence; act's TMA boxes do not.
        moe_wgmma_tma_live<T, 16, NMAX, STAGE_BYTES>(live16, acc, k_tiles, smem, wa, bars, lane, MoeNoRows{}, false,
                                                     !a_tma);
    } else {
        const MoeTmaRows<T, BM, STAGE_BYTES> rows(p, t, smem, bars);
        if (!a_tma)
            for (u32 kt = 0; kt < min(2u, k_tiles); ++kt) rows.load(kt);
        moe_wgmma_tma_live<T, 16, NMAX, STAGE_BYTES>(live16, acc[0], k_tiles, smem, wa, bars, lane, rows, !a_tma,
                                                     true);
    }
    moe_fence_proxy_async();  // the MMAs' reads of the ring before the epilogue's writes to it
    moe_wgmma_finish_n<T, BM, BN, CH, true>(p, t, acc, reinterpret_cast<float*>(moe_smem + (smem - base)));
}

// The `t` kernels: 288 threads, the same shared memory as the `o` kernels (the barriers sit
// in the alignment slack).
#define MOE_GEMM_WGMMA_TMA(T, NAME, MT, BLOCKS)                                                         \
    extern "C" __global__ void __launch_bounds__(MOE_TMA_THREADS, BLOCKS) moe_gemm_##T##_##NAME##t(MoeGemm p) { \
        moe_gemm_wgmma_tma<T, MT>(p);                                                                      \
    }
// Each tile's `w`, `o` and `t` kernels. Two blocks per SM at m4 and m6 (m6: 112 KB of stages
// + 1 KB to align them, no static shared memory). Faster than the mma.sync staged tiles, and
// than the decode and middle tiles from 2 rows per expert (bench/NOTES.md, MoE grouped GEMM).
// The wide m12 tile: 160 KB of stages + 1 KB, one block per SM (MoeLayer::set_wgmma_wide).
#define MOE_GEMM_WGMMA(T, NAME, MT, BLOCKS)                                                          \
    MOE_GEMM_WGMMA_AS(T, NAME, MT, BLOCKS, w, false) MOE_GEMM_WGMMA_AS(T, NAME, MT, BLOCKS, o, true) \
    MOE_GEMM_WGMMA_TMA(T, NAME, MT, BLOCKS)
MOE_GEMM_WGMMA(bf16, m4, 2, 2)
MOE_GEMM_WGMMA(bf16, m6, 3, 2)
MOE_GEMM_WGMMA(bf16, m12, 6, 1)
MOE_GEMM_WGMMA(f16, m4, 2, 2)
MOE_GEMM_WGMMA(f16, m6, 3, 2)
MOE_GEMM_WGMMA(f16, m12, 6, 1)

// ---- The 256-weight-row tile (the `x256` kernels, issue 40; where an expert gets 128 rows
// or more, MoeLayer::set_wgmma_w256): moe_gemm_wgmma with BN = 256 weight rows a tile (Triton's fused MoE's best
// H100 tile is 128 tokens × 256 weight columns): each of the two warpgroups multiplies 128
// weight rows as two m64 MMAs a k16 step on the same token descriptor (2 · BM / 2
// accumulators a thread), so a tile reads its token rows for twice the weight rows and
// each stage's barrier covers twice the MMAs. A stage is (BM + 256) rows × 128 B: 4 stages of
// 176 KB (BM 96) or 192 KB (BM 128) + 1 KB to align, one block per SM; the epilogue stages
// BM × 260 floats in the ring. Gate/up pairs (16-row groups of w13) stay inside a tile.

#define MOE_GEMM_WGMMA_X256_AS(T, NAME, MT, SUFFIX, OVERLAP)                                              \
    extern "C" __global__ void __launch_bounds__(256, 1) moe_gemm_##T##_##NAME##x256##SUFFIX(MoeGemm p) { \
        moe_gemm_wgmma<T, MT, 256, OVERLAP>(p);                                                           \
    }
// 96 token rows (m6, our padding sweet spot at ~256 rows an expert) and 128 (m8, Triton's).
// The warp-specialized `x256t` kernels: a producer warpgroup and the two consumer warpgroups
// (384 threads; moe_gemm_wgmma_tma with BN = 256), the same shared memory.
#define MOE_GEMM_WGMMA_X256_TMA(T, NAME, MT)                                                               \
    extern "C" __global__ void __launch_bounds__(MOE_TMA_WG_THREADS, 1) moe_gemm_##T##_##NAME##x256t(MoeGemm p) { \
        moe_gemm_wgmma_tma<T, MT, 256>(p);                                                                 \
    }
#define MOE_GEMM_WGMMA_X256(T, NAME, MT)                                                          \
    MOE_GEMM_WGMMA_X256_AS(T, NAME, MT, w, false) MOE_GEMM_WGMMA_X256_AS(T, NAME, MT, o, true) \
    MOE_GEMM_WGMMA_X256_TMA(T, NAME, MT)
MOE_GEMM_WGMMA_X256(bf16, m6, 3)
MOE_GEMM_WGMMA_X256(bf16, m8, 4)
MOE_GEMM_WGMMA_X256(f16, m6, 3)
MOE_GEMM_WGMMA_X256(f16, m8, 4)
