// archs: sm_80 sm_90 sm_90a
// The MoE layer's kernels outside the router, GEMM and decode sources (module `moe`): seeded
// weight init, the SwiGLU of the cuBLAS path and the combine.

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

// ---- SwiGLU of the cuBLAS path: h [rows, 2I] with interleaved gate/up blocks of 8 columns
// (the w13 layout) -> act [rows, I]. A thread takes one block of 8 (I % 8 == 0): its gate and
// up halves are two 16-byte loads and its 8 results one store (one element a thread ran at
// ~55 % of the copy rate on mixtral's 470 MB of h); misaligned buffers take elements. ----
template <typename T>
__device__ void moe_swiglu(const T* __restrict__ h, u64 rows, u32 inter, T* __restrict__ act) {
    const u64 stride = (u64)gridDim.x * blockDim.x;
    const u64 tid = blockIdx.x * (u64)blockDim.x + threadIdx.x;
    if (aligned16(h) && aligned16(act)) {
        const u64 blocks = rows * (inter / 8);
        for (u64 b = tid; b < blocks; b += stride) {
            float g[8], u[8];
            unpack8(load_pack8(h + b * 16), g);
            unpack8(load_pack8(h + b * 16 + 8), u);
#pragma unroll
            for (int j = 0; j < 8; ++j) g[j] = moe_silu(g[j]) * u[j];
            store_pack8(act + b * 8, pack8<T>(g));
        }
        return;
    }
    const u64 n = rows * inter;
    for (u64 i = tid; i < n; i += stride) {
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
// scale_r = slot_weight[t·k + r] (null: 1, the rows are already weighted: the device path's
// down projection weights them); the sum in f32. A thread takes 8 columns (hidden % 8 == 0)
// and has four ranks' 16-byte loads in flight before it adds them (a rank at a time, 8 bytes
// a load, ran at ~50 % of the copy rate); misaligned buffers take 4 columns a rank at a time.
// The same additions in the same order either way. ----
template <typename TY, typename T>
__device__ void moe_combine(const TY* __restrict__ y, const u32* __restrict__ slot_pos,
                            const float* __restrict__ slot_weight, u32 tokens, u32 k, u32 hidden,
                            T* __restrict__ out) {
    wait_prior_grid();
    release_next_grid();
    const u64 stride = (u64)gridDim.x * blockDim.x;
    const u64 tid = blockIdx.x * (u64)blockDim.x + threadIdx.x;
    if (aligned16(y) && aligned16(out)) {
        const u32 octs = hidden / 8;
        const u64 n = (u64)tokens * octs;
        for (u64 i = tid; i < n; i += stride) {
            const u32 t = (u32)(i / octs), c = (u32)(i % octs) * 8;
            float s[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
            for (u32 r0 = 0; r0 < k; r0 += 4) {
                const u32 m = min(4u, k - r0);
                Pack8<TY> v[4];
                float wgt[4];
#pragma unroll
                for (u32 j = 0; j < 4; ++j) {
                    if (j < m) {
                        const u32 slot = t * k + r0 + j;
                        wgt[j] = slot_weight ? slot_weight[slot] : 1.0f;
                        v[j] = load_pack8(y + (u64)slot_pos[slot] * hidden + c);
                    }
                }
#pragma unroll
                for (u32 j = 0; j < 4; ++j) {
                    if (j < m) {
                        float f[8];
                        unpack8(v[j], f);
#pragma unroll
                        for (int e = 0; e < 8; ++e) s[e] += wgt[j] * f[e];
                    }
                }
            }
            store_pack8(out + (u64)t * hidden + c, pack8<T>(s));
        }
        return;
    }
    const u32 quads = hidden / 4;
    const u64 n = (u64)tokens * quads;
    for (u64 i = tid; i < n; i += stride) {
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
MOE_COMBINE(f16, f16)
MOE_COMBINE(bf16, bf16)
