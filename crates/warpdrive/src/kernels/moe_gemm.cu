// archs: sm_80 sm_90 sm_90a
// The MoE grouped GEMM on mma.sync (module `moe_gemm`): the decode and middle tiles (moe_gemm)
// and the staged prefill tiles (moe_gemm_staged). Its parameters (MoeGemm), work-list tiles,
// MMA loop and stage loads, shared with the router and moe_wgmma, are in moe_shared.cu with
// the comments that describe the GEMM and its prefill tiles.


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
                T* dst = reinterpret_cast<T*>(p.out) + (u64)prow * p.n;
#pragma unroll
                for (int ng = 0; ng < NG; ++ng) {
                    const u32 c = col0 + ng * 8 + 2 * q;
                    if (c < p.n) dst[c] = from_f32<T>(acc[mt][ng][2 * h] * scale);
                    if (c + 1 < p.n) dst[c + 1] = from_f32<T>(acc[mt][ng][2 * h + 1] * scale);
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

__device__ __forceinline__ void moe_ldmatrix4(u32 (&r)[4], u32 addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr) : "memory");
}

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
// steps of W deep (LATE_A; faster than 4 steps with A held). The middle tile (2 m16 tiles,
// two blocks per SM) keeps 3 steps in flight with A held (faster than 2; 4 or 6 steps with A
// late no better overall). The prefill tile used to be this kernel with 4 m16 tiles × 4
// groups per warp (one block per SM by registers, each warp stalled on its own loads); the
// staged tile replaced it. The variants measured: bench/NOTES.md, MoE grouped GEMM.
#define MOE_GEMM(T, MT, NG, U, LATE_A, B) \
    extern "C" __global__ void __launch_bounds__(256, B) moe_gemm_##T##_m##MT(MoeGemm p) { moe_gemm<T, MT, NG, U, LATE_A>(p); }
MOE_GEMM(bf16, 1, 2, 8, true, 2)
MOE_GEMM(bf16, 2, 2, 3, false, 2)
MOE_GEMM(f16, 1, 2, 8, true, 2)
MOE_GEMM(f16, 2, 2, 3, false, 2)
// The prefill tiles: m4 = 64 rows (2 m16 tiles per warp, 96 KB of shared memory), m6 = 96
// rows (3 per warp, 112 KB), two blocks per SM either way. Where experts average over 32
// rows the 96-row tile holds most experts whole, so fewer tail tiles read the weights again
// (bench/NOTES.md, MoE grouped GEMM).
#define MOE_GEMM_STAGED(T, NAME, MT) \
    extern "C" __global__ void __launch_bounds__(256, 2) moe_gemm_##T##_##NAME(MoeGemm p) { moe_gemm_staged<T, MT, 4, 4, 4>(p); }
MOE_GEMM_STAGED(bf16, m4, 2)
MOE_GEMM_STAGED(bf16, m6, 3)
MOE_GEMM_STAGED(f16, m4, 2)
MOE_GEMM_STAGED(f16, m6, 3)
