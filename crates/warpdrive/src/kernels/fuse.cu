// The operations of fused kernels (`fuse` module): a fragment prepended (after the prelude)
// to every kernel the fuse module generates, which calls these on f32 registers. Each has the
// semantics of the CPU backend's f64 evaluation (fuse/cpu.rs); keep the two in step.

// The larger / smaller; NaN if either is NaN (fmaxf would drop it), as ops::BinaryOp.
__device__ __forceinline__ float fz_max(float a, float b) { return (a != a || a > b) ? a : b; }
__device__ __forceinline__ float fz_min(float a, float b) { return (a != a || a < b) ? a : b; }
// Comparisons as 1 / 0 (IEEE: every comparison with NaN is false, except !=).
__device__ __forceinline__ float fz_bool(bool b) { return b ? 1.0f : 0.0f; }
// select: NaN counts as true (it is not 0), as on the CPU backend.
__device__ __forceinline__ float fz_select(float c, float a, float b) { return c != 0.0f ? a : b; }
__device__ __forceinline__ float fz_sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }
// silu(x) = x * sigmoid(x).
__device__ __forceinline__ float fz_silu(float x) { return x / (1.0f + expf(-x)); }
// gelu_tanh(x) = 0.5 x (1 + tanh(u)) = x * sigmoid(2u), u = sqrt(2/pi) (x + 0.044715 x^3): the
// sigmoid form has no cancellation for x < 0 (as elementwise.cu).
__device__ __forceinline__ float fz_gelu_tanh(float x) {
    const float z = 1.5957691216057308f * (x + 0.044715f * x * x * x);
    return x / (1.0f + expf(-z));
}
// 0.5 x erfc(-x / sqrt 2): no cancellation for x < 0. Out of line: erfcf is long, and inlining
// it into every unrolled element slows NVRTC a lot.
__device__ __noinline__ float fz_gelu_erf(float x) { return 0.5f * x * erfcf(-0.7071067811865476f * x); }
// Rounds to a narrower float type and back: the value a cast in the middle of a graph leaves.
__device__ __forceinline__ float fz_round_f16(float x) { return to_f32(from_f32<f16>(x)); }
__device__ __forceinline__ float fz_round_bf16(float x) { return to_f32(from_f32<bf16>(x)); }

// Reductions: the combining operations (max and min keep NaN) and their identities.
struct FzSum { __device__ __forceinline__ float operator()(float a, float b) const { return a + b; } };
struct FzMax { __device__ __forceinline__ float operator()(float a, float b) const { return fz_max(a, b); } };
struct FzMin { __device__ __forceinline__ float operator()(float a, float b) const { return fz_min(a, b); } };
__device__ __forceinline__ float fz_pos_inf() { return __uint_as_float(0x7f800000u); }
__device__ __forceinline__ float fz_neg_inf() { return __uint_as_float(0xff800000u); }

// Reduction over a row's group of threads (a warp, or the whole block); every thread of the
// group gets the result. Fixed order, so deterministic; the block form ends with a barrier.
template <bool WARP, typename Op>
__device__ __forceinline__ float fz_group_reduce(float v, Op op, float identity) {
    if (WARP) return warp_reduce(v, op);
    return block_allreduce(v, op, identity);
}

// A value another block wrote (after its fence and the atomic that ordered it): not from L1.
__device__ __forceinline__ float fz_load_volatile(const float* p) { return *(const volatile float*)p; }

// Argmax: (value, index) pairs; NaN beats every number (the first NaN wins, as torch's
// argmax), then the larger value, then the smaller index. The identity is (-inf, none).
#define FZ_NO_INDEX 0xffffffffu
__device__ __forceinline__ bool fz_arg_better(float v, u32 i, float w, u32 j) {
    const bool vn = v != v, wn = w != w;
    if (vn != wn) return vn;
    if (!vn && v != w) return v > w;
    return i < j;
}
__device__ __forceinline__ void fz_arg_step(float& best, u32& at, float v, u32 i) {
    if (fz_arg_better(v, i, best, at)) { best = v; at = i; }
}
// The winning index of a row's group (a warp, or the whole block) as a float (NaN when the
// row is empty); every thread gets it. Ends with a barrier in the block form.
template <bool WARP>
__device__ __forceinline__ float fz_group_argmax(float v, u32 i) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float w = __shfl_xor_sync(0xffffffffu, v, o);
        const u32 j = __shfl_xor_sync(0xffffffffu, i, o);
        fz_arg_step(v, i, w, j);
    }
    if (!WARP) {
        __shared__ float vals[32];
        __shared__ u32 idxs[32];
        __shared__ u32 result;
        const u32 lane = threadIdx.x & 31u, warp = threadIdx.x >> 5;
        if (lane == 0) { vals[warp] = v; idxs[warp] = i; }
        __syncthreads();
        if (warp == 0) {
            v = lane < (blockDim.x >> 5) ? vals[lane] : fz_neg_inf();
            i = lane < (blockDim.x >> 5) ? idxs[lane] : FZ_NO_INDEX;
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) {
                const float w = __shfl_xor_sync(0xffffffffu, v, o);
                const u32 j = __shfl_xor_sync(0xffffffffu, i, o);
                fz_arg_step(v, i, w, j);
            }
            if (lane == 0) result = i;
        }
        __syncthreads();
        i = result;
        __syncthreads();
    }
    return i == FZ_NO_INDEX ? __uint_as_float(0x7fc00000u) : (float)i;
}

// Gather: table[index] with the index truncated toward zero; NaN for a NaN, negative or
// out-of-range index (the bounds are checked here, so no index reads outside the table).
template <typename T>
__device__ __forceinline__ float fz_gather(const T* __restrict__ table, u64 len, float index) {
    if (!(index >= 0.0f) || !(index < 18446744073709551616.0f)) return __uint_as_float(0x7fc00000u);
    const u64 k = (u64)index;
    return k < len ? to_f32(table[k]) : __uint_as_float(0x7fc00000u);
}

// Online log-sum-exp: a row's max m and s = Σ exp(x - m) in one pass (a max and the sum of
// exp(x - max) over the same operand fused), giving the two-pass values, special cases
// included: any NaN makes both NaN; +inf makes m = inf and s = NaN (exp(inf - inf)); -inf
// elements add nothing, and a non-empty row of only -inf gets s = NaN (fz_group_lse).
__device__ __forceinline__ void fz_lse_step(float& m, float& s, float x) {
    if (x != x) { m = x; s = x; return; }
    if (x == fz_neg_inf()) return;
    // One exp either way, no branch: a new max rescales s by exp(m - x) (0 when m is -inf,
    // where s is still 0) and adds 1; otherwise exp(x - m) is added. As exp2f of the scaled
    // difference: a multiply and the SFU's exp2, where expf's range reduction costs several
    // instructions an element (the step is issue-bound); a few 1e-6 relative off expf at most.
    const bool up = x > m;  // false once m is NaN
    const float e = exp2f((up ? m - x : x - m) * 1.4426950408889634f);
    s = up ? s * e + (x == fz_pos_inf() ? __uint_as_float(0x7fc00000u) : 1.0f) : s + e;
    m = up ? x : m;
}
// (m, s) merged with (m2, s2); symmetric, so every lane of a butterfly gets the same result.
__device__ __forceinline__ void fz_lse_merge(float& m, float& s, float m2, float s2) {
    if (m != m || m2 != m2) { m = __uint_as_float(0x7fc00000u); s = m; return; }
    const float mx = m > m2 ? m : m2;
    if (mx == fz_neg_inf()) { s = s + s2; return; }
    const float a = m == fz_neg_inf() ? 0.0f : s * expf(m - mx);
    const float b = m2 == fz_neg_inf() ? 0.0f : s2 * expf(m2 - mx);
    s = a + b;
    m = mx;
}
// The row's (m, s) over its group (a warp, or the whole block) of `count` elements; every
// thread gets it. Ends with a barrier in the block form.
template <bool WARP>
__device__ __forceinline__ void fz_group_lse(float& m, float& s, u64 count) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float m2 = __shfl_xor_sync(0xffffffffu, m, o);
        const float s2 = __shfl_xor_sync(0xffffffffu, s, o);
        fz_lse_merge(m, s, m2, s2);
    }
    if (!WARP) {
        __shared__ float ms[32], ss[32];
        __shared__ float rm, rs;
        const u32 lane = threadIdx.x & 31u, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
        if (lane == 0) { ms[warp] = m; ss[warp] = s; }
        __syncthreads();
        if (warp == 0) {
            m = lane < warps ? ms[lane] : fz_neg_inf();
            s = lane < warps ? ss[lane] : 0.0f;
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) {
                const float m2 = __shfl_xor_sync(0xffffffffu, m, o);
                const float s2 = __shfl_xor_sync(0xffffffffu, s, o);
                fz_lse_merge(m, s, m2, s2);
            }
            if (lane == 0) { rm = m; rs = s; }
        }
        __syncthreads();
        m = rm;
        s = rs;
        __syncthreads();
    }
    if (m == fz_neg_inf() && count > 0) s = __uint_as_float(0x7fc00000u);
}

// Streaming vector loads and stores for data a kernel touches once (a map's full inputs and
// its output, a row kernel's rows): load_vec / store_vec with the tag FZ_STREAM, cache-
// streaming (`ld.global.cs` / `st.global.cs`, evict first), so a pass over more than L2 holds
// does not evict lines still wanted; the values are those of the untagged forms.
struct FzStream {};
#define FZ_STREAM FzStream{}
template <typename T, int W> __device__ __forceinline__ Vec<T, W> load_vec(const T* __restrict__ p, FzStream) {
    Vec<T, W> v;
    v.raw = __ldcs(reinterpret_cast<const typename RawBytes<W * sizeof(T)>::type*>(p));
    return v;
}
template <typename T, int W> __device__ __forceinline__ void store_vec(T* __restrict__ p, const Vec<T, W>& v, FzStream) {
    __stcs(reinterpret_cast<typename RawBytes<W * sizeof(T)>::type*>(p), v.raw);
}
