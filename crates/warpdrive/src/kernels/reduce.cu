// archs: sm_75 sm_80 sm_90 sm_90a
// Deterministic reductions (sum / max / mean) over f32, f64, f16, bf16, accumulated in f32
// (f64 for f64). No atomics anywhere: every result comes out of a fixed-shape tree.
//   Whole buffer, two passes: reduce_partial_<op>_<t> (block 256, grid-stride over 16-byte
//   packs, several in flight per thread; grid = SMs x resident blocks, at most 4096) writes one
//   partial per block into the caller's scratch; reduce_final_<op>_<t> (one block of 1024)
//   folds the partials into out[0]. reduce_partial_scalar_* is the one-element-per-load
//   baseline. Mean = sum partials, divided by n in the final pass.
//   Per row: reduce_rows_warp_* (block 256 = 8 rows, one warp per row, rows up to 1024 wide)
//   and reduce_rows_block_* (block 256 per row, wider rows).

template <typename T> struct Acc { typedef float type; };
template <> struct Acc<double> { typedef double type; };
__device__ __forceinline__ double to_acc(double v) { return v; }
template <typename T> __device__ __forceinline__ float to_acc(T v) { return to_f32(v); }
template <typename T> __device__ __forceinline__ T from_acc(typename Acc<T>::type v) { return from_f32<T>(v); }
template <> __device__ __forceinline__ double from_acc<double>(double v) { return v; }
__device__ __forceinline__ void unpack8(const Pack8<double>& p, double (&v)[8]) {
    const double* d = reinterpret_cast<const double*>(p.w);
#pragma unroll
    for (int i = 0; i < 8; ++i) v[i] = d[i];
}

template <typename A> __device__ __forceinline__ A identity_of(OpSum) { return A(0); }
template <typename A> __device__ __forceinline__ A identity_of(OpMax) { return -__int_as_float(0x7f800000); }

template <typename T, typename Op>
__device__ __forceinline__ void reduce_partial(const T* __restrict__ x, u64 n, typename Acc<T>::type* __restrict__ partial, Op op) {
    typedef typename Acc<T>::type A;
    constexpr int U = sizeof(T) >= 8 ? 1 : 64 / (8 * (int)sizeof(T));  // 64 bytes in flight
    const u64 stride = (u64)gridDim.x * blockDim.x;
    const u64 tid = blockIdx.x * (u64)blockDim.x + threadIdx.x;
    const A id = identity_of<A>(op);
    A acc[8];
#pragma unroll
    for (int e = 0; e < 8; ++e) acc[e] = id;
    u64 head = 0;
    if (aligned16(x)) {
        const u64 packs = n / 8;
        u64 i = tid;
        for (; i + (U - 1) * stride < packs; i += U * stride) {
            Pack8<T> in[U];
#pragma unroll
            for (int u = 0; u < U; ++u) in[u] = load_pack8(x + (i + u * stride) * 8);
#pragma unroll
            for (int u = 0; u < U; ++u) {
                A v[8];
                unpack8(in[u], v);
#pragma unroll
                for (int e = 0; e < 8; ++e) acc[e] = op(acc[e], v[e]);
            }
        }
        for (; i < packs; i += stride) {
            A v[8];
            unpack8(load_pack8(x + i * 8), v);
#pragma unroll
            for (int e = 0; e < 8; ++e) acc[e] = op(acc[e], v[e]);
        }
        head = packs * 8;
    }
    for (u64 i = head + tid; i < n; i += stride) acc[0] = op(acc[0], to_acc(x[i]));
#pragma unroll
    for (int w = 4; w > 0; w >>= 1)
#pragma unroll
        for (int e = 0; e < w; ++e) acc[e] = op(acc[e], acc[e + w]);
    const A total = block_allreduce(acc[0], op, id);
    if (threadIdx.x == 0) partial[blockIdx.x] = total;
}

template <typename T, typename Op>
__device__ __forceinline__ void reduce_partial_scalar(const T* __restrict__ x, u64 n, typename Acc<T>::type* __restrict__ partial, Op op) {
    typedef typename Acc<T>::type A;
    const u64 stride = (u64)gridDim.x * blockDim.x;
    const A id = identity_of<A>(op);
    A acc = id;
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < n; i += stride) acc = op(acc, to_acc(x[i]));
    const A total = block_allreduce(acc, op, id);
    if (threadIdx.x == 0) partial[blockIdx.x] = total;
}

// divide_by: n for a mean (0 otherwise).
template <typename T, typename Op>
__device__ __forceinline__ void reduce_final(const typename Acc<T>::type* __restrict__ partial, u32 count, T* __restrict__ out, Op op, u64 divide_by, int mean) {
    typedef typename Acc<T>::type A;
    const A id = identity_of<A>(op);
    A acc = id;
    for (u32 i = threadIdx.x; i < count; i += blockDim.x) acc = op(acc, partial[i]);
    acc = block_allreduce(acc, op, id);
    if (threadIdx.x == 0) out[0] = from_acc<T>(mean ? acc / (A)divide_by : acc);
}

template <typename T, typename Op>
__device__ __forceinline__ void reduce_rows_warp(const T* __restrict__ x, u64 rows, u64 cols, T* __restrict__ out, Op op, int mean) {
    typedef typename Acc<T>::type A;
    const u64 row = blockIdx.x * (u64)(blockDim.x >> 5) + (threadIdx.x >> 5);
    const u32 lane = threadIdx.x & 31u;
    if (row >= rows) return;  // whole warps leave together
    const T* r = x + row * cols;
    const A id = identity_of<A>(op);
    A acc = id;
    for (u64 j = lane; j < cols; j += 32) acc = op(acc, to_acc(r[j]));
    acc = warp_reduce(acc, op);
    if (lane == 0) out[row] = from_acc<T>(mean ? acc / (A)cols : acc);
}

template <typename T, typename Op>
__device__ __forceinline__ void reduce_rows_block(const T* __restrict__ x, u64 cols, T* __restrict__ out, Op op, int mean) {
    typedef typename Acc<T>::type A;
    const T* r = x + (u64)blockIdx.x * cols;
    const A id = identity_of<A>(op);
    A acc = id;
    for (u64 j = threadIdx.x; j < cols; j += blockDim.x) acc = op(acc, to_acc(r[j]));
    acc = block_allreduce(acc, op, id);
    if (threadIdx.x == 0) out[blockIdx.x] = from_acc<T>(mean ? acc / (A)cols : acc);
}

#define REDUCE(NAME, T)                                                                                  \
extern "C" __global__ void __launch_bounds__(256) reduce_partial_sum_##NAME(const T* __restrict__ x, u64 n, Acc<T>::type* __restrict__ p) { reduce_partial<T>(x, n, p, OpSum()); } \
extern "C" __global__ void __launch_bounds__(256) reduce_partial_max_##NAME(const T* __restrict__ x, u64 n, Acc<T>::type* __restrict__ p) { reduce_partial<T>(x, n, p, OpMax()); } \
extern "C" __global__ void __launch_bounds__(256) reduce_partial_scalar_sum_##NAME(const T* __restrict__ x, u64 n, Acc<T>::type* __restrict__ p) { reduce_partial_scalar<T>(x, n, p, OpSum()); } \
extern "C" __global__ void __launch_bounds__(256) reduce_partial_scalar_max_##NAME(const T* __restrict__ x, u64 n, Acc<T>::type* __restrict__ p) { reduce_partial_scalar<T>(x, n, p, OpMax()); } \
extern "C" __global__ void __launch_bounds__(1024) reduce_final_sum_##NAME(const Acc<T>::type* __restrict__ p, u32 count, T* __restrict__ out, u64 n, int mean) { reduce_final<T>(p, count, out, OpSum(), n, mean); } \
extern "C" __global__ void __launch_bounds__(1024) reduce_final_max_##NAME(const Acc<T>::type* __restrict__ p, u32 count, T* __restrict__ out, u64 n, int mean) { reduce_final<T>(p, count, out, OpMax(), n, 0); } \
extern "C" __global__ void __launch_bounds__(256) reduce_rows_warp_sum_##NAME(const T* __restrict__ x, u64 rows, u64 cols, T* __restrict__ out, int mean) { reduce_rows_warp<T>(x, rows, cols, out, OpSum(), mean); } \
extern "C" __global__ void __launch_bounds__(256) reduce_rows_warp_max_##NAME(const T* __restrict__ x, u64 rows, u64 cols, T* __restrict__ out, int mean) { reduce_rows_warp<T>(x, rows, cols, out, OpMax(), 0); } \
extern "C" __global__ void __launch_bounds__(256) reduce_rows_block_sum_##NAME(const T* __restrict__ x, u64 rows, u64 cols, T* __restrict__ out, int mean) { reduce_rows_block<T>(x, cols, out, OpSum(), mean); } \
extern "C" __global__ void __launch_bounds__(256) reduce_rows_block_max_##NAME(const T* __restrict__ x, u64 rows, u64 cols, T* __restrict__ out, int mean) { reduce_rows_block<T>(x, cols, out, OpMax(), 0); }
REDUCE(f32, float)
REDUCE(f64, double)
REDUCE(f16, f16)
REDUCE(bf16, bf16)
