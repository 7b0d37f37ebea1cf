// archs: sm_75 sm_80 sm_90 sm_90a
// Row softmax, numerically stable (exp(x - max) / sum), over f32 / f16 / bf16 in f32.
//   softmax_warp<V>_<t>: one warp per row holding the row in registers (V values per lane,
//     rows up to 32 V wide); block 256 = 8 rows; grid = ceil(rows / 8).
//   softmax_block_<t>: one block of 256 per row for wider rows; three passes over the row
//     (max, sum, write), the later ones mostly from L1/L2.
// A NaN anywhere in a row makes the row NaN; a row of -inf is NaN (0 / 0), as in f64.

template <typename T, int V>
__device__ __forceinline__ void softmax_warp(const T* __restrict__ x, u64 rows, u32 cols, T* __restrict__ y) {
    const u64 row = blockIdx.x * (u64)(blockDim.x >> 5) + (threadIdx.x >> 5);
    const u32 lane = threadIdx.x & 31u;
    if (row >= rows) return;  // whole warps leave together
    const T* r = x + row * cols;
    float v[V];
    float m = f32_neg_inf();
#pragma unroll
    for (int j = 0; j < V; ++j) {
        const u32 c = lane + 32u * j;
        v[j] = c < cols ? to_f32(r[c]) : f32_neg_inf();
        m = OpMax()(m, v[j]);
    }
    m = warp_reduce(m, OpMax());
    float s = 0.0f;
#pragma unroll
    for (int j = 0; j < V; ++j) {
        if (lane + 32u * j < cols) { v[j] = expf(v[j] - m); s += v[j]; }
    }
    s = warp_reduce(s, OpSum());
    T* o = y + row * cols;
#pragma unroll
    for (int j = 0; j < V; ++j) {
        const u32 c = lane + 32u * j;
        if (c < cols) o[c] = from_f32<T>(v[j] / s);
    }
}

template <typename T>
__device__ __forceinline__ void softmax_block(const T* __restrict__ x, u32 cols, T* __restrict__ y) {
    const T* r = x + (u64)blockIdx.x * cols;
    T* o = y + (u64)blockIdx.x * cols;
    float m = f32_neg_inf();
    for (u32 c = threadIdx.x; c < cols; c += blockDim.x) m = OpMax()(m, to_f32(r[c]));
    m = block_allreduce(m, OpMax(), f32_neg_inf());
    float s = 0.0f;
    for (u32 c = threadIdx.x; c < cols; c += blockDim.x) s += expf(to_f32(r[c]) - m);
    s = block_allreduce(s, OpSum(), 0.0f);
    for (u32 c = threadIdx.x; c < cols; c += blockDim.x) o[c] = from_f32<T>(expf(to_f32(r[c]) - m) / s);
}

#define SOFTMAX(NAME, T)                                                                                  \
extern "C" __global__ void __launch_bounds__(256) softmax_warp8_##NAME(const T* __restrict__ x, u64 rows, u32 cols, T* __restrict__ y) { softmax_warp<T, 8>(x, rows, cols, y); } \
extern "C" __global__ void __launch_bounds__(256) softmax_warp32_##NAME(const T* __restrict__ x, u64 rows, u32 cols, T* __restrict__ y) { softmax_warp<T, 32>(x, rows, cols, y); } \
extern "C" __global__ void __launch_bounds__(256) softmax_block_##NAME(const T* __restrict__ x, u64 rows, u32 cols, T* __restrict__ y) { softmax_block<T>(x, cols, y); }
SOFTMAX(f32, float)
SOFTMAX(f16, f16)
SOFTMAX(bf16, bf16)
