// archs: sm_75 sm_80 sm_90 sm_90a
// Elementwise ops over f32 / f16 / bf16, arithmetic in f32.
//   map_<in>_<out>:        y = cast(a * x + b), one pass (no activation: few registers, so
//                          the chip holds 2048 threads per SM)
//   map_act_<in>_<out>:    y = cast(act(a * x + b)), one pass, intermediates in registers
//   map_scalar_<in>_<out>: either, one element per access (the measured baseline)
//   binary_<t>:            out = op(a, b) for add, sub, mul, max, min, swiglu
// Block size 256 (__launch_bounds__(256)); grid-stride loops, so the host sizes the grid to
// fill the chip (SMs x resident blocks) and any grid covers any n. Vector paths give each
// lane W consecutive elements per access, W = 16 bytes of the wider type (f32: 4, f16/bf16:
// 8), so every access instruction of a warp covers one contiguous span (16-byte accesses on
// the wider side, 8-byte on the narrower side of a cast); 4 vectors in flight per thread.
// The scalar head/tail covers unaligned pointers and n % W.

#define ACT_NONE 0
#define ACT_SILU 1
#define ACT_GELU_TANH 2
#define ACT_GELU_ERF 3

// silu(x) = x * sigmoid(x).
__device__ __forceinline__ float silu(float x) { return x / (1.0f + expf(-x)); }
// 0.5 x erfc(-x / sqrt 2) == 0.5 x (1 + erf(x / sqrt 2)) without the cancellation for x < 0.
// Out of line: erfcf is long, and inlining it into every unrolled element slows NVRTC a lot.
__device__ __noinline__ float gelu_erf(float x) { return 0.5f * x * erfcf(-0.7071067811865476f * x); }

__device__ __forceinline__ float activate(float x, int act) {
    if (act == ACT_NONE) return x;
    if (act == ACT_GELU_ERF) return gelu_erf(x);
    // silu(x) = x * sigmoid(x); gelu_tanh(x) = 0.5 x (1 + tanh(u)) = x * sigmoid(2u) with
    // u = sqrt(2/pi) (x + 0.044715 x^3): the sigmoid form has no cancellation for x < 0.
    const float z = act == ACT_SILU ? x : 1.5957691216057308f * (x + 0.044715f * x * x * x);
    return x / (1.0f + expf(-z));
}

// a*x+b, skipped for the identity so a cast keeps -0.0 and NaN payloads bit for bit.
__device__ __forceinline__ float affine(float x, float a, float b) { return (a == 1.0f && b == 0.0f) ? x : fmaf(a, x, b); }

// Vectors in flight per thread per iteration (64 bytes of the wider type).
#define UNROLL 4

template <typename I, typename O> struct Width {
    static constexpr int value = 16 / (sizeof(I) > sizeof(O) ? (int)sizeof(I) : (int)sizeof(O));
};

template <bool ACT>
__device__ __forceinline__ float map_one(float x, float a, float b, int act) {
    const float v = affine(x, a, b);
    return ACT ? activate(v, act) : v;
}

template <typename I, typename O, bool ACT>
__device__ __forceinline__ void map_vec(const I* __restrict__ x, O* __restrict__ y, u64 n, float a, float b, int act) {
    constexpr int W = Width<I, O>::value;
    const u64 stride = (u64)gridDim.x * blockDim.x;
    const u64 tid = blockIdx.x * (u64)blockDim.x + threadIdx.x;
    u64 head = 0;
    if (aligned16(x) && aligned16(y)) {
        const u64 vecs = n / W;
        u64 i = tid;
        for (; i + (UNROLL - 1) * stride < vecs; i += UNROLL * stride) {
            Vec<I, W> in[UNROLL];
#pragma unroll
            for (int u = 0; u < UNROLL; ++u) in[u] = load_vec<I, W>(x + (i + u * stride) * W);
#pragma unroll
            for (int u = 0; u < UNROLL; ++u) {
                float v[W];
                unpack_vec(in[u], v);
#pragma unroll
                for (int e = 0; e < W; ++e) v[e] = map_one<ACT>(v[e], a, b, act);
                store_vec(y + (i + u * stride) * W, pack_vec<O, W>(v));
            }
        }
        for (; i < vecs; i += stride) {
            float v[W];
            unpack_vec(load_vec<I, W>(x + i * W), v);
#pragma unroll
            for (int e = 0; e < W; ++e) v[e] = map_one<ACT>(v[e], a, b, act);
            store_vec(y + i * W, pack_vec<O, W>(v));
        }
        head = vecs * W;
    }
    for (u64 i = head + tid; i < n; i += stride) y[i] = from_f32<O>(map_one<ACT>(to_f32(x[i]), a, b, act));
}

template <typename I, typename O>
__device__ __forceinline__ void map_scalar(const I* __restrict__ x, O* __restrict__ y, u64 n, float a, float b, int act) {
    const u64 stride = (u64)gridDim.x * blockDim.x;
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < n; i += stride)
        y[i] = from_f32<O>(activate(affine(to_f32(x[i]), a, b), act));
}

#define MAP(IN, OUT, I, O)                                                                            \
extern "C" __global__ void __launch_bounds__(256) map_##IN##_##OUT(const I* __restrict__ x, O* __restrict__ y, u64 n, float a, float b, int act) { map_vec<I, O, false>(x, y, n, a, b, act); } \
extern "C" __global__ void __launch_bounds__(256) map_act_##IN##_##OUT(const I* __restrict__ x, O* __restrict__ y, u64 n, float a, float b, int act) { map_vec<I, O, true>(x, y, n, a, b, act); } \
extern "C" __global__ void __launch_bounds__(256) map_scalar_##IN##_##OUT(const I* __restrict__ x, O* __restrict__ y, u64 n, float a, float b, int act) { map_scalar<I, O>(x, y, n, a, b, act); }
MAP(f32, f32, float, float)
MAP(f32, f16, float, f16)
MAP(f32, bf16, float, bf16)
MAP(f16, f32, f16, float)
MAP(f16, f16, f16, f16)
MAP(f16, bf16, f16, bf16)
MAP(bf16, f32, bf16, float)
MAP(bf16, f16, bf16, f16)
MAP(bf16, bf16, bf16, bf16)

// f16 -> f32 (the identity cast) that also sets *any_inf to 1
// when some input is ±inf (one plain store per warp that met one, into pinned host memory
// the host reads once the stream is done: no copy back, no atomics). An upload narrowed to
// f16 on the host learns whether f16's range held without another host pass over its data.
__device__ __forceinline__ u32 infs_in_pair(u32 two_halves) {
    return ((two_halves & 0x7fffu) == 0x7c00u) + (((two_halves >> 16) & 0x7fffu) == 0x7c00u);
}
// Widens four halves into y (16-byte aligned); returns their number of ±inf.
__device__ __forceinline__ u32 widen_vec(const Vec<f16, 4>& v, float* __restrict__ y) {
    float f[4];
    unpack_vec(v, f);
    store_vec(y, pack_vec<float, 4>(f));
    return infs_in_pair(v.raw.x) + infs_in_pair(v.raw.y);
}
// The f16 -> f32 map's own access pattern (8-byte loads, 16-byte stores, UNROLL in flight,
// the same grid): 16-byte loads of eight halves with half the blocks ran well behind the
// cast (bench/NOTES.md, compressed transfers).
extern "C" __global__ void __launch_bounds__(256) widen_f16_flag_inf(const f16* __restrict__ x, float* __restrict__ y, u64 n, volatile u32* any_inf) {
    constexpr int W = 4;
    const u64 stride = (u64)gridDim.x * blockDim.x;
    const u64 tid = blockIdx.x * (u64)blockDim.x + threadIdx.x;
    u32 found = 0;
    u64 head = 0;
    if (aligned16(x) && aligned16(y)) {
        const u64 vecs = n / W;
        u64 i = tid;
        for (; i + (UNROLL - 1) * stride < vecs; i += UNROLL * stride) {
            Vec<f16, W> in[UNROLL];
#pragma unroll
            for (int u = 0; u < UNROLL; ++u) in[u] = load_vec<f16, W>(x + (i + u * stride) * W);
#pragma unroll
            for (int u = 0; u < UNROLL; ++u) found += widen_vec(in[u], y + (i + u * stride) * W);
        }
        for (; i < vecs; i += stride) found += widen_vec(load_vec<f16, W>(x + i * W), y + i * W);
        head = vecs * W;
    }
    for (u64 i = head + tid; i < n; i += stride) {
        found += (x[i].bits & 0x7fffu) == 0x7c00u;
        y[i] = to_f32(x[i]);
    }
    // Every thread of the grid gets here (no early exit), so the whole warp takes part.
    if (__any_sync(0xffffffffu, found != 0) && (threadIdx.x & 31u) == 0) *any_inf = 1u;
}

#define BIN_ADD 0
#define BIN_SUB 1
#define BIN_MUL 2
#define BIN_MAX 3
#define BIN_MIN 4
#define BIN_SWIGLU 5

__device__ __forceinline__ float binary_op(float a, float b, int op) {
    switch (op) {
    case BIN_ADD: return a + b;
    case BIN_SUB: return a - b;
    case BIN_MUL: return a * b;
    case BIN_MAX: return (a != a || a > b) ? a : b;   // NaN propagates
    case BIN_MIN: return (a != a || a < b) ? a : b;
    default: return silu(a) * b;                        // swiglu: silu(gate) * up
    }
}

template <typename T>
__device__ __forceinline__ void binary(const T* __restrict__ a, const T* __restrict__ b, T* __restrict__ out, u64 n, int op) {
    constexpr int W = 16 / (int)sizeof(T);
    constexpr int U = UNROLL / 2;  // two inputs: the same bytes in flight as a map
    const u64 stride = (u64)gridDim.x * blockDim.x;
    const u64 tid = blockIdx.x * (u64)blockDim.x + threadIdx.x;
    u64 head = 0;
    if (aligned16(a) && aligned16(b) && aligned16(out)) {
        const u64 vecs = n / W;
        u64 i = tid;
        for (; i + (U - 1) * stride < vecs; i += U * stride) {
            Vec<T, W> va[U], vb[U];
#pragma unroll
            for (int u = 0; u < U; ++u) {
                va[u] = load_vec<T, W>(a + (i + u * stride) * W);
                vb[u] = load_vec<T, W>(b + (i + u * stride) * W);
            }
#pragma unroll
            for (int u = 0; u < U; ++u) {
                float fa[W], fb[W];
                unpack_vec(va[u], fa);
                unpack_vec(vb[u], fb);
#pragma unroll
                for (int e = 0; e < W; ++e) fa[e] = binary_op(fa[e], fb[e], op);
                store_vec(out + (i + u * stride) * W, pack_vec<T, W>(fa));
            }
        }
        for (; i < vecs; i += stride) {
            float fa[W], fb[W];
            unpack_vec(load_vec<T, W>(a + i * W), fa);
            unpack_vec(load_vec<T, W>(b + i * W), fb);
#pragma unroll
            for (int e = 0; e < W; ++e) fa[e] = binary_op(fa[e], fb[e], op);
            store_vec(out + i * W, pack_vec<T, W>(fa));
        }
        head = vecs * W;
    }
    for (u64 i = head + tid; i < n; i += stride) out[i] = from_f32<T>(binary_op(to_f32(a[i]), to_f32(b[i]), op));
}

#define BINARY(NAME, T) \
extern "C" __global__ void __launch_bounds__(256) binary_##NAME(const T* __restrict__ a, const T* __restrict__ b, T* __restrict__ out, u64 n, int op) { binary<T>(a, b, out, n, op); }
BINARY(f32, float)
BINARY(f16, f16)
BINARY(bf16, bf16)
