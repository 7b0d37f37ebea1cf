// archs: sm_75 sm_80 sm_90 sm_90a
// Gradient compression: int8 block quantization with error feedback. Blocks of QB elements,
// one warp per block (8 elements a lane, strided by 32 so loads coalesce), one scale each.
// The arithmetic is spelled out (IEEE division, explicit fmaf, rintf) so that the CPU
// reference in ops/quant.rs gets the same bits.

#define QB 256
#define FLT_MAX_ 3.402823466e38f

// x = g + e per element; scale = max|x| / 127 (NaN when the block holds a non-finite value,
// 0 when max|x| / 127 underflows to 0); q = rint(x / scale) in [-127, 127] (0 for those two);
// e = x - q * scale: the part the int8 values lost, added to the next call's gradient.
extern "C" __global__ void __launch_bounds__(256) quantize_int8_ef(const float* __restrict__ g, float* __restrict__ e, signed char* __restrict__ q, float* __restrict__ scales, u64 n) {
    const u64 blocks = (n + QB - 1) / QB;
    const u32 lane = threadIdx.x & 31u;
    const u64 warps = (u64)gridDim.x * (blockDim.x >> 5);
    for (u64 b = blockIdx.x * (u64)(blockDim.x >> 5) + (threadIdx.x >> 5); b < blocks; b += warps) {
        const u64 base = b * QB;
        float x[QB / 32];
        float amax = 0.0f;
        bool bad = false;
#pragma unroll
        for (int k = 0; k < QB / 32; ++k) {
            const u64 i = base + lane + 32u * k;
            x[k] = i < n ? g[i] + e[i] : 0.0f;
            const float a = fabsf(x[k]);
            bad |= !(a <= FLT_MAX_);
            amax = a > amax ? a : amax;
        }
        amax = warp_max(amax);
        bad = __any_sync(0xffffffffu, bad);
        const float scale = bad ? __int_as_float(0x7fc00000) : amax / 127.0f;
        const bool keep = bad || scale == 0.0f;  // nothing quantized: all of x stays in e
#pragma unroll
        for (int k = 0; k < QB / 32; ++k) {
            const u64 i = base + lane + 32u * k;
            if (i < n) {
                const float r = keep ? 0.0f : fminf(fmaxf(rintf(x[k] / scale), -127.0f), 127.0f);
                q[i] = (signed char)(int)r;
                e[i] = keep ? x[k] : fmaf(-r, scale, x[k]);
            }
        }
        if (lane == 0) scales[b] = scale;
    }
}

// out = sum over r < ranks of q_r * (scale_r * alpha), in rank order (payload r: q + r*n,
// scales + r*blocks). A NaN scale makes its block NaN.
extern "C" __global__ void __launch_bounds__(256) dequantize_int8(const signed char* __restrict__ q, const float* __restrict__ scales, u32 ranks, float alpha, float* __restrict__ out, u64 n) {
    const u64 blocks = (n + QB - 1) / QB;
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x) {
        float acc = 0.0f;
        for (u32 r = 0; r < ranks; ++r)
            acc = fmaf((float)q[r * n + i], scales[r * blocks + i / QB] * alpha, acc);
        out[i] = acc;
    }
}
