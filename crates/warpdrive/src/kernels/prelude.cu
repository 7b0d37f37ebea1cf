// warpdrive prelude, prepended to every kernel source. Self-contained: no CUDA headers.
typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;
typedef long long i64;

// 16-bit floats as raw bits; arithmetic happens in f32 after conversion.
struct __align__(2) bf16 { u16 bits; };
struct __align__(2) f16 { u16 bits; };

__device__ __forceinline__ float bf16_to_f32(bf16 v) { return __uint_as_float(((u32)v.bits) << 16); }
__device__ __forceinline__ bf16 f32_to_bf16(float f) {
    bf16 r;
#if __CUDA_ARCH__ >= 800
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r.bits) : "f"(f));
#else
    u32 u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) { r.bits = (u16)((u >> 16) | 0x40u); return r; }  // NaN stays NaN
    u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest even
    r.bits = (u16)(u >> 16);
#endif
    return r;
}
__device__ __forceinline__ float f16_to_f32(f16 v) { float f; asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(v.bits)); return f; }
__device__ __forceinline__ f16 f32_to_f16(float f) { f16 r; asm("cvt.rn.f16.f32 %0, %1;" : "=h"(r.bits) : "f"(f)); return r; }

// Warp-wide reductions over all 32 lanes (every lane gets the result).
template <typename T> __device__ __forceinline__ T warp_sum(T v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
template <typename T> __device__ __forceinline__ T warp_max(T v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) { T w = __shfl_xor_sync(0xffffffffu, v, o); v = w > v ? w : v; }
    return v;
}

// Sum over a whole block (blockDim.x a multiple of 32, at most 1024). Every thread calls it;
// thread 0 gets the result. The order of additions is fixed, so the result is deterministic.
template <typename T> __device__ __forceinline__ T block_sum(T v) {
    __shared__ T partials[32];
    const u32 lane = threadIdx.x & 31u, warp = threadIdx.x >> 5;
    v = warp_sum(v);
    if (lane == 0) partials[warp] = v;
    __syncthreads();
    T total = T(0);
    if (warp == 0) {
        total = lane < (blockDim.x >> 5) ? partials[lane] : T(0);
        total = warp_sum(total);
    }
    return total;
}

__device__ __forceinline__ bool aligned16(const void* p) { return (((u64)p) & 15u) == 0; }
