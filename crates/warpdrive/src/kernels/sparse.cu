// archs: sm_75 sm_80 sm_90 sm_90a
// Gradient sparsification (DGC): momentum and error accumulation fused with a top-k per block
// of SB elements (one CUDA block each, a bitonic sort of the block's ranks in shared memory),
// and the scatter-add that densifies what the ranks sent (one launch per rank, in rank order). The arithmetic is spelled out
// (explicit fmaf) so that the CPU reference in ops/sparse.rs gets the same bits.

#define SB 2048
#define ST 256

// Larger first: |v| by its bits (NaN first), then the lower index.
__device__ __forceinline__ u64 sparse_rank(float v, u32 j) {
    const float a = fabsf(v);
    const u32 key = (a != a) ? 0xffffffffu : (__float_as_uint(a) | 0x80000000u);
    return ((u64)key << 32) | (u64)(0xffffffffu - j);
}

// Per element: u = momentum * u + g, v = v + u. Per block of SB: the `kb` elements of largest
// |v| (kb = ceil(len * keep / SB) for a block of len elements) go out as (index, value) in rank
// order into slots [block * keep, block * keep + keep) (unused slots: index 0xffffffff, value
// 0), and their u and v become 0 (momentum factor masking; what is not sent stays in v).
extern "C" __global__ void __launch_bounds__(ST) topk_ef(const float* __restrict__ g, float* __restrict__ u, float* __restrict__ v, float momentum, u32 keep, u32* __restrict__ idx, float* __restrict__ val, u64 n) {
    __shared__ u64 ranks[SB];
    const u64 base = (u64)blockIdx.x * SB;
    const u32 len = (u32)min((u64)SB, n - base);
    for (u32 j = threadIdx.x; j < SB; j += ST) {
        u64 r = 0;  // padding ranks last
        if (j < len) {
            const u64 i = base + j;
            const float uu = fmaf(momentum, u[i], g[i]);
            const float vv = v[i] + uu;
            u[i] = uu;
            v[i] = vv;
            r = sparse_rank(vv, j);
        }
        ranks[j] = r;
    }
    // Bitonic sort, descending.
    for (u32 k = 2; k <= SB; k <<= 1) {
        for (u32 s = k >> 1; s > 0; s >>= 1) {
            __syncthreads();
            for (u32 t = threadIdx.x; t < SB; t += ST) {
                const u32 p = t ^ s;
                if (p > t) {
                    const u64 a = ranks[t], b = ranks[p];
                    if (((t & k) == 0) == (a < b)) {
                        ranks[t] = b;
                        ranks[p] = a;
                    }
                }
            }
        }
    }
    __syncthreads();
    const u32 kb = (u32)(((u64)len * keep + SB - 1) / SB);
    for (u32 j = threadIdx.x; j < keep; j += ST) {
        const u64 o = (u64)blockIdx.x * keep + j;
        if (j < kb) {
            const u64 i = base + (0xffffffffu - (u32)ranks[j]);
            idx[o] = (u32)i;
            val[o] = v[i];
            v[i] = 0.0f;
            u[i] = 0.0f;
        } else {
            idx[o] = 0xffffffffu;
            val[o] = 0.0f;
        }
    }
}

// out[idx[j]] = fmaf(val[j], alpha, out[idx[j]]) for the m entries of one payload (its indices
// distinct; those >= n, the unused slots among them, are skipped).
extern "C" __global__ void __launch_bounds__(256) sparse_scatter_add(const u32* __restrict__ idx, const float* __restrict__ val, float alpha, float* __restrict__ out, u64 m, u64 n) {
    for (u64 j = blockIdx.x * (u64)blockDim.x + threadIdx.x; j < m; j += (u64)gridDim.x * blockDim.x) {
        const u64 i = idx[j];
        if (i < n) out[i] = fmaf(val[j], alpha, out[i]);
    }
}
