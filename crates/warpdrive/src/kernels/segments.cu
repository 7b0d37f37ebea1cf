// archs: sm_75 sm_80 sm_90 sm_90a
// Many buffers to one and back in one launch: the table holds k segment addresses, then
// k + 1 offsets (segment j is elements offs[j]..offs[j + 1] of the packed buffer). Element i
// of the packed buffer finds its segment by binary search over the offsets.

__device__ __forceinline__ u32 segment_of(const u64* __restrict__ offs, u32 k, u64 i) {
    u32 lo = 0, hi = k;  // offs[lo] <= i < offs[hi]
    while (hi - lo > 1) {
        const u32 mid = (lo + hi) / 2;
        if (offs[mid] <= i) lo = mid; else hi = mid;
    }
    return lo;
}

#define SEGMENTS(NAME, T)                                                                           \
extern "C" __global__ void __launch_bounds__(256) segments_pack_##NAME(const u64* __restrict__ table, u32 k, T* __restrict__ packed, u64 total) { \
    const u64* offs = table + k;                                                                    \
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < total; i += (u64)gridDim.x * blockDim.x) { \
        const u32 s = segment_of(offs, k, i);                                                       \
        packed[i] = reinterpret_cast<const T*>(table[s])[i - offs[s]];                              \
    }                                                                                               \
}                                                                                                   \
extern "C" __global__ void __launch_bounds__(256) segments_unpack_##NAME(const u64* __restrict__ table, u32 k, const T* __restrict__ packed, u64 total) { \
    const u64* offs = table + k;                                                                    \
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < total; i += (u64)gridDim.x * blockDim.x) { \
        const u32 s = segment_of(offs, k, i);                                                       \
        reinterpret_cast<T*>(table[s])[i - offs[s]] = packed[i];                                    \
    }                                                                                               \
}
SEGMENTS(u8, u8)
SEGMENTS(u16, u16)
SEGMENTS(u32, u32)
SEGMENTS(u64, u64)
