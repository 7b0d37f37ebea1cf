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

// ---- one spelling for every float type: to_f32 / from_f32<T> ----
__device__ __forceinline__ float to_f32(float v) { return v; }
__device__ __forceinline__ float to_f32(bf16 v) { return bf16_to_f32(v); }
__device__ __forceinline__ float to_f32(f16 v) { return f16_to_f32(v); }
template <typename T> __device__ __forceinline__ T from_f32(float v);
template <> __device__ __forceinline__ float from_f32<float>(float v) { return v; }
template <> __device__ __forceinline__ bf16 from_f32<bf16>(float v) { return f32_to_bf16(v); }
template <> __device__ __forceinline__ f16 from_f32<f16>(float v) { return f32_to_f16(v); }

// ---- 16-byte vector access: 8 consecutive elements as one (2-byte types) or two (f32)
// uint4 words. Load every pack a thread needs first, then unpack, so several 16-byte loads
// are in flight per thread. The address must be 16-byte aligned. ----
template <typename T> struct Pack8 { uint4 w[sizeof(T) / 2]; };
template <typename T> __device__ __forceinline__ Pack8<T> load_pack8(const T* __restrict__ p) {
    Pack8<T> r;
    const uint4* q = reinterpret_cast<const uint4*>(p);
#pragma unroll
    for (int i = 0; i < (int)(sizeof(T) / 2); ++i) r.w[i] = q[i];
    return r;
}
template <typename T> __device__ __forceinline__ void store_pack8(T* __restrict__ p, const Pack8<T>& v) {
    uint4* q = reinterpret_cast<uint4*>(p);
#pragma unroll
    for (int i = 0; i < (int)(sizeof(T) / 2); ++i) q[i] = v.w[i];
}
__device__ __forceinline__ void unpack8(const Pack8<float>& p, float (&v)[8]) {
    const float* f = reinterpret_cast<const float*>(p.w);
#pragma unroll
    for (int i = 0; i < 8; ++i) v[i] = f[i];
}
__device__ __forceinline__ void unpack8(const Pack8<bf16>& p, float (&v)[8]) {
    const u32* u = reinterpret_cast<const u32*>(p.w);
#pragma unroll
    for (int i = 0; i < 4; ++i) { v[2 * i] = __uint_as_float(u[i] << 16); v[2 * i + 1] = __uint_as_float(u[i] & 0xffff0000u); }
}
__device__ __forceinline__ void unpack8(const Pack8<f16>& p, float (&v)[8]) {
    const u32* u = reinterpret_cast<const u32*>(p.w);
#pragma unroll
    for (int i = 0; i < 4; ++i) { v[2 * i] = f16_to_f32(f16{(u16)u[i]}); v[2 * i + 1] = f16_to_f32(f16{(u16)(u[i] >> 16)}); }
}
template <typename T> __device__ __forceinline__ Pack8<T> pack8(const float (&v)[8]) {
    Pack8<T> p;
    T* e = reinterpret_cast<T*>(p.w);
#pragma unroll
    for (int i = 0; i < 8; ++i) e[i] = from_f32<T>(v[i]);
    return p;
}

// ---- warp and block reductions with an operator ----
struct OpSum { template <typename T> __device__ __forceinline__ T operator()(T a, T b) const { return a + b; } };
// max that propagates NaN (fmaxf would drop it): any NaN in, NaN out.
struct OpMax {
    __device__ __forceinline__ float operator()(float a, float b) const { return (a != a || a > b) ? a : b; }
    __device__ __forceinline__ double operator()(double a, double b) const { return (a != a || a > b) ? a : b; }
};
template <typename T, typename Op> __device__ __forceinline__ T warp_reduce(T v, Op op) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = op(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}
// Reduction over the whole block (blockDim.x a multiple of 32); every thread gets the result.
// Fixed order, so deterministic. Ends with a barrier, so it may be called again at once.
template <typename T, typename Op> __device__ __forceinline__ T block_allreduce(T v, Op op, T identity) {
    __shared__ T partials[33];
    const u32 lane = threadIdx.x & 31u, warp = threadIdx.x >> 5;
    v = warp_reduce(v, op);
    if (lane == 0) partials[warp] = v;
    __syncthreads();
    if (warp == 0) {
        T t = lane < (blockDim.x >> 5) ? partials[lane] : identity;
        t = warp_reduce(t, op);
        if (lane == 0) partials[32] = t;
    }
    __syncthreads();
    const T r = partials[32];
    __syncthreads();
    return r;
}

__device__ __forceinline__ float f32_neg_inf() { return __uint_as_float(0xff800000u); }
__device__ __forceinline__ float f32_nan() { return __uint_as_float(0x7fc00000u); }

// ---- W consecutive elements as one 16- or 8-byte access (elementwise kernels): with one
// vector per lane, every access instruction of a warp covers one contiguous span. ----
template <int B> struct RawBytes;
template <> struct RawBytes<16> { typedef uint4 type; };
template <> struct RawBytes<8> { typedef uint2 type; };
template <typename T, int W> struct Vec { typename RawBytes<W * sizeof(T)>::type raw; };
template <typename T, int W> __device__ __forceinline__ Vec<T, W> load_vec(const T* __restrict__ p) {
    Vec<T, W> v;
    v.raw = *reinterpret_cast<const typename RawBytes<W * sizeof(T)>::type*>(p);
    return v;
}
template <typename T, int W> __device__ __forceinline__ void store_vec(T* __restrict__ p, const Vec<T, W>& v) {
    *reinterpret_cast<typename RawBytes<W * sizeof(T)>::type*>(p) = v.raw;
}
template <typename T, int W> __device__ __forceinline__ void unpack_vec(const Vec<T, W>& v, float (&f)[W]) {
    const T* e = reinterpret_cast<const T*>(&v.raw);
#pragma unroll
    for (int i = 0; i < W; ++i) f[i] = to_f32(e[i]);
}
template <typename T, int W> __device__ __forceinline__ Vec<T, W> pack_vec(const float (&f)[W]) {
    Vec<T, W> v;
    T* e = reinterpret_cast<T*>(&v.raw);
#pragma unroll
    for (int i = 0; i < W; ++i) e[i] = from_f32<T>(f[i]);
    return v;
}

// Programmatic dependent launch (Hopper and later; no-ops before): `wait_prior_grid` blocks
// until the stream's previous kernel has finished and its writes are visible (at once when
// this kernel was launched normally); `release_next_grid` lets the next kernel's blocks
// start (they wait in turn before touching this kernel's results).
__device__ __forceinline__ void wait_prior_grid() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
__device__ __forceinline__ void release_next_grid() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// Exclusive scan of one value per thread over the block (blockDim.x a multiple of 32);
// *total gets the sum of all. Ends with a barrier, so it may be called again at once.
template <typename T>
__device__ __forceinline__ T block_exclusive_scan(T v, T* total) {
    __shared__ T warp_sums[32];
    const u32 lane = threadIdx.x & 31u, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    T incl = v;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const T t = __shfl_up_sync(0xffffffffu, incl, o);
        if (lane >= (u32)o) incl += t;
    }
    if (lane == 31) warp_sums[warp] = incl;
    __syncthreads();
    if (warp == 0) {
        T s = lane < warps ? warp_sums[lane] : T(0);
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            const T t = __shfl_up_sync(0xffffffffu, s, o);
            if (lane >= (u32)o) s += t;
        }
        if (lane < warps) warp_sums[lane] = s;
    }
    __syncthreads();
    const T before = warp ? warp_sums[warp - 1] : T(0);
    *total = warp_sums[warps - 1];
    __syncthreads();
    return before + incl - v;
}
