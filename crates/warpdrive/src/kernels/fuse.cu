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
