// archs: sm_75 sm_80 sm_90 sm_90a
// Gradient sparsification (DGC): momentum and error accumulation fused with a top-k per block
// of SB elements (one CUDA block each: a radix select of the kth largest |v|, then a scan),
// and the scatter-add that densifies what the ranks sent (one launch per rank, in rank
// order). The arithmetic is spelled out (explicit fmaf) so that the CPU reference in
// ops/sparse.rs gets the same bits.

#define SB 2048
#define ST 256
#define PER (SB / ST)  // elements a thread holds: a contiguous run, so index order is thread order

// |v| by its bits, NaN above every number: larger keys rank first.
__device__ __forceinline__ u32 sparse_key(float v) {
    const float a = fabsf(v);
    return (a != a) ? 0xffffffffu : (__float_as_uint(a) | 0x80000000u);
}

// Per element: u = momentum * u + g, v = v + u. Per block of SB: the kb entries of largest |v|
// (kb = ceil(len * keep / SB) for a block of len elements; ties to the lower index) go out as
// (index, value) in index order into slots [block * keep, block * keep + keep) (unused slots:
// index 0xffffffff, value 0), and their u and v become 0 (momentum factor masking; what is not
// sent stays in v). The kb-th largest key comes from a radix select (four passes of 8 bits,
// a histogram in shared memory each, warp-aggregated counts); one block scan then places the
// chosen entries.
extern "C" __global__ void __launch_bounds__(ST) topk_ef(const float* __restrict__ g, float* __restrict__ u, float* __restrict__ v, float momentum, u32 keep, u32* __restrict__ idx, float* __restrict__ val, u64 n) {
    __shared__ u32 hist[256];
    __shared__ u32 pick[3];  // the digit chosen, the keys of its bin still to take, the bin's count
    const u64 base = (u64)blockIdx.x * SB;
    const u32 len = (u32)min((u64)SB, n - base);
    const u32 first = threadIdx.x * PER;
    const u32 lane = threadIdx.x & 31u;
    u32 key[PER];
    float val_[PER];
    // A full block with 16-byte aligned rows reads and writes four floats at a time.
    const bool vec = len == SB && (((u64)g | (u64)u | (u64)v) & 15u) == 0u;
    if (vec) {
#pragma unroll
        for (int h = 0; h < PER / 4; ++h) {
            const u64 i = base + first + 4 * h;
            const float4 gg = *reinterpret_cast<const float4*>(g + i);
            float4 uu = *reinterpret_cast<const float4*>(u + i);
            float4 vv = *reinterpret_cast<const float4*>(v + i);
            uu.x = fmaf(momentum, uu.x, gg.x);
            uu.y = fmaf(momentum, uu.y, gg.y);
            uu.z = fmaf(momentum, uu.z, gg.z);
            uu.w = fmaf(momentum, uu.w, gg.w);
            vv.x += uu.x;
            vv.y += uu.y;
            vv.z += uu.z;
            vv.w += uu.w;
            *reinterpret_cast<float4*>(u + i) = uu;
            *reinterpret_cast<float4*>(v + i) = vv;
            val_[4 * h] = vv.x;
            val_[4 * h + 1] = vv.y;
            val_[4 * h + 2] = vv.z;
            val_[4 * h + 3] = vv.w;
        }
#pragma unroll
        for (int e = 0; e < PER; ++e) key[e] = sparse_key(val_[e]);
    } else {
#pragma unroll
        for (int e = 0; e < PER; ++e) {
            const u32 j = first + e;
            key[e] = 0u;  // padding ranks last and is never taken (kb <= len)
            val_[e] = 0.0f;
            if (j < len) {
                const u64 i = base + j;
                const float uu = fmaf(momentum, u[i], g[i]);
                const float vv = v[i] + uu;
                u[i] = uu;
                v[i] = vv;
                key[e] = sparse_key(vv);
                val_[e] = vv;
            }
        }
    }
    const u32 kb = (u32)(((u64)len * keep + SB - 1) / SB);
    // Radix select of the kb-th largest key. Bit 31 is set in every key but padding's, so the
    // digits are bits 30-23 (the exponent), 22-15, 14-7 and 6-0; `prefix` holds the bits
    // chosen so far. Once the chosen bin holds exactly the keys still to take, all of it goes
    // and the lower bits need no pass (`low`: the bits left unresolved).
    u32 prefix = 0x80000000u, remaining = kb, low = 0u;
#pragma unroll 1
    for (int p = 0; p < 4; ++p) {
        const int shift = p == 0 ? 23 : p == 1 ? 15 : p == 2 ? 7 : 0;
        const int width = p == 3 ? 7 : 8;
        const u32 digits = (1u << width) - 1u;
        const u32 above = 0xffffffffu << (shift + width);
        hist[threadIdx.x] = 0u;  // ST == 256 bins
        __syncthreads();
#pragma unroll
        for (int e = 0; e < PER; ++e) {
            const bool in = (key[e] & above) == prefix;
            const u32 digit = (key[e] >> shift) & digits;
            const u32 same = __match_any_sync(0xffffffffu, in ? digit : 0x100u + lane);
            if (in && lane == (u32)(__ffs(same) - 1)) atomicAdd(&hist[digit], (u32)__popc(same));
        }
        __syncthreads();
        if (threadIdx.x < 32) {
            // Lane l sums bins 255 - 8l down to 248 - 8l; a scan from the top finds the bin
            // where the count of larger keys reaches `remaining`.
            u32 c[8], sum = 0u;
#pragma unroll
            for (int b = 0; b < 8; ++b) {
                c[b] = hist[255 - 8 * lane - b];
                sum += c[b];
            }
            u32 incl = sum;
#pragma unroll
            for (int o = 1; o < 32; o <<= 1) {
                const u32 t = __shfl_up_sync(0xffffffffu, incl, o);
                if (lane >= (u32)o) incl += t;
            }
            const u32 before = incl - sum;
            if (before < remaining && remaining <= incl) {
                u32 acc = before;
#pragma unroll
                for (int b = 0; b < 8; ++b) {
                    if (acc < remaining && remaining <= acc + c[b]) {
                        pick[0] = 255u - 8u * lane - (u32)b;
                        pick[1] = remaining - acc;
                        pick[2] = c[b];
                    }
                    acc += c[b];
                }
            }
        }
        __syncthreads();
        prefix |= pick[0] << shift;
        remaining = pick[1];
        if (pick[2] == remaining) {
            low = (u32)shift;
            break;
        }
    }
    // Take every key above the threshold `prefix` (compared on its resolved bits) and the
    // first `remaining` keys equal to it, in index order.
    const u32 cut = prefix >> low;
    u32 gt = 0u, eq = 0u;
#pragma unroll
    for (int e = 0; e < PER; ++e) {
        gt += (key[e] >> low) > cut;
        eq += (key[e] >> low) == cut;
    }
    u32 total;
    const u32 packed = block_exclusive_scan<u32>((gt << 16) | eq, &total);
    u32 gt_before = packed >> 16, eq_before = packed & 0xffffu;
#pragma unroll
    for (int e = 0; e < PER; ++e) {
        const u32 k = key[e] >> low;
        const bool take = k > cut || (k == cut && eq_before < remaining);
        if (take) {
            const u32 slot = gt_before + min(eq_before, remaining);
            const u64 o = (u64)blockIdx.x * keep + slot;
            const u64 i = base + first + e;
            idx[o] = (u32)i;
            val[o] = val_[e];
            v[i] = 0.0f;
            u[i] = 0.0f;
        }
        gt_before += k > cut;
        eq_before += k == cut;
    }
    for (u32 j = kb + threadIdx.x; j < keep; j += ST) {
        const u64 o = (u64)blockIdx.x * keep + j;
        idx[o] = 0xffffffffu;
        val[o] = 0.0f;
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
