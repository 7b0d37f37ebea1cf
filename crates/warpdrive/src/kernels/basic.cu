// archs: sm_75 sm_80 sm_90 sm_90a
// The foundation ops: fill and axpy (the sum lives in reduce.cu).
// Block size 256 for the streaming kernels (8 warps: full occupancy at any register count
// under 128); grid-stride loops so any grid covers any n.

// The fills and the empty kernel may be programmatic dependent launches (exec::launch with
// LaunchConfig::programmatic): they write nothing before the previous kernel is done.
#define FILL(NAME, T)                                                                         \
extern "C" __global__ void __launch_bounds__(256) NAME(T* __restrict__ out, T value, u64 n) { \
    release_next_grid();                                                                      \
    wait_prior_grid();                                                                        \
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x) \
        out[i] = value;                                                                       \
}
FILL(fill_u8, u8)
FILL(fill_u16, u16)
FILL(fill_u32, u32)
FILL(fill_u64, u64)

// y = a*x + y. 16-byte vectors when both pointers allow, scalar otherwise and for the tail.
template <typename T, typename V, int W>
__device__ __forceinline__ void axpy(const T* __restrict__ x, T* __restrict__ y, T a, u64 n) {
    const u64 stride = (u64)gridDim.x * blockDim.x;
    const u64 tid = blockIdx.x * (u64)blockDim.x + threadIdx.x;
    u64 head = 0;
    if (aligned16(x) && aligned16(y)) {
        const u64 nv = n / W;
        const V* xv = reinterpret_cast<const V*>(x);
        V* yv = reinterpret_cast<V*>(y);
        for (u64 i = tid; i < nv; i += stride) {
            V xi = xv[i], yi = yv[i];
            T* xs = reinterpret_cast<T*>(&xi);
            T* ys = reinterpret_cast<T*>(&yi);
#pragma unroll
            for (int k = 0; k < W; ++k) ys[k] = a * xs[k] + ys[k];
            yv[i] = yi;
        }
        head = nv * W;
    }
    for (u64 i = head + tid; i < n; i += stride) y[i] = a * x[i] + y[i];
}
extern "C" __global__ void __launch_bounds__(256) axpy_f32(const float* __restrict__ x, float* __restrict__ y, float a, u64 n) { axpy<float, float4, 4>(x, y, a, n); }
// f16 / bf16: 8 elements per 16-byte pack, arithmetic in f32, one rounding per element.
template <typename T>
__device__ __forceinline__ void axpy_half(const T* __restrict__ x, T* __restrict__ y, float a, u64 n) {
    const u64 stride = (u64)gridDim.x * blockDim.x;
    const u64 tid = blockIdx.x * (u64)blockDim.x + threadIdx.x;
    u64 head = 0;
    if (aligned16(x) && aligned16(y)) {
        const u64 packs = n / 8;
        for (u64 i = tid; i < packs; i += stride) {
            float xs[8], ys[8];
            unpack8(load_pack8(x + i * 8), xs);
            unpack8(load_pack8(y + i * 8), ys);
#pragma unroll
            for (int k = 0; k < 8; ++k) ys[k] = fmaf(a, xs[k], ys[k]);
            store_pack8(y + i * 8, pack8<T>(ys));
        }
        head = packs * 8;
    }
    for (u64 i = head + tid; i < n; i += stride) y[i] = from_f32<T>(fmaf(a, to_f32(x[i]), to_f32(y[i])));
}
extern "C" __global__ void __launch_bounds__(256) axpy_f16(const f16* __restrict__ x, f16* __restrict__ y, float a, u64 n) { axpy_half<f16>(x, y, a, n); }
extern "C" __global__ void __launch_bounds__(256) axpy_bf16(const bf16* __restrict__ x, bf16* __restrict__ y, float a, u64 n) { axpy_half<bf16>(x, y, a, n); }
extern "C" __global__ void __launch_bounds__(256) axpy_f64(const double* __restrict__ x, double* __restrict__ y, double a, u64 n) { axpy<double, double2, 2>(x, y, a, n); }

// Does nothing: the doctor times launch overhead with it.
extern "C" __global__ void empty_kernel() {
    release_next_grid();
    wait_prior_grid();
}

// Test helper for stream ordering: thread 0 polls *flag (page-locked host memory, read
// through unified addressing) until it is non-zero or `limit` polls of ~1 µs have passed;
// then the grid writes `value` to out[0..n) and thread 0 of block 0 writes 1 (flag seen)
// or 2 (gave up) to *status. Block size 256; any grid (each block waits on its own).
extern "C" __global__ void __launch_bounds__(256) wait_flag_then_fill(const volatile u32* flag, u32* __restrict__ out, u32 value, u64 n, u64 limit, u32* __restrict__ status) {
    if (threadIdx.x == 0) {
        u64 polls = 0;
        while (*flag == 0 && polls < limit) { __nanosleep(1000); ++polls; }
        if (blockIdx.x == 0) *status = *flag != 0 ? 1u : 2u;
    }
    __syncthreads();
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x)
        out[i] = value;
}
