// archs: sm_80 sm_90 sm_90a
// Device-initiated puts and signals through peer-mapped memory (dist::PeerMapped): the
// stores cross NVLink or PCIe to another GPU's memory, so every fence and signal is at
// system scope.
//   peer_put_signal: block 256, grid-stride copy (16-byte vectors when both ends are
//     16-byte aligned, then bytes), then, when `flag` is set, each block fences its stores
//     and takes a ticket; the last block sets the ticket back to 0 (graph replays) and
//     stores `value` into `flag` with release semantics: whoever acquires the flag sees
//     every byte of the put.
//   peer_wait: one thread spins on an acquire load of `flag` until it is >= `value`, or
//     `timeout_ns` of %globaltimer have passed; writes 0 (arrived) or 1 (timed out) to
//     `status`. Work after it on its stream sees the put's bytes.
//   peer_pingpong: one thread; `rounds` round trips of a signal between two kernels (one
//     per side): the side that serves first stores r into the other's flag and waits for
//     its own to reach r; the other waits, then answers. Flags live in the memory of the
//     GPU that polls them (local loads, remote stores).

__device__ __forceinline__ void peer_store_release(u64* p, u64 v) {
    asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

__device__ __forceinline__ u64 peer_load_acquire(const u64* p) {
    u64 v;
    asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
    return v;
}

__device__ __forceinline__ u64 peer_now() {
    u64 t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

extern "C" __global__ void __launch_bounds__(256) peer_put_signal(
    const u8* __restrict__ src, u8* __restrict__ dst, u64 bytes, u32 aligned16,
    u32* __restrict__ ticket, u64* flag, u64 value) {
    __shared__ bool last;
    const u64 tid = blockIdx.x * (u64)blockDim.x + threadIdx.x;
    const u64 stride = (u64)gridDim.x * blockDim.x;
    u64 done = 0;
    if (aligned16) {
        const u64 vecs = bytes / 16u;
        const uint4* s = (const uint4*)src;
        uint4* d = (uint4*)dst;
        for (u64 k = tid; k < vecs; k += stride) d[k] = s[k];
        done = vecs * 16u;
    }
    for (u64 k = done + tid; k < bytes; k += stride) dst[k] = src[k];
    if (flag == 0) return;
    __threadfence_system();
    __syncthreads();
    if (threadIdx.x == 0) last = atomicAdd(ticket, 1u) == gridDim.x - 1u;
    __syncthreads();
    if (last && threadIdx.x == 0) {
        *ticket = 0u;
        __threadfence_system();
        peer_store_release(flag, value);
    }
}

extern "C" __global__ void peer_wait(const u64* flag, u64 value, u64 timeout_ns,
                                     u32* __restrict__ status) {
    if (threadIdx.x != 0 || blockIdx.x != 0) return;
    const u64 start = peer_now();
    while (peer_load_acquire(flag) < value) {
        if (peer_now() - start > timeout_ns) {
            *status = 1u;
            return;
        }
    }
    *status = 0u;
}

extern "C" __global__ void peer_pingpong(const u64* mine, u64* theirs, u64 base, u64 rounds,
                                         u32 serve_first, u64 timeout_ns,
                                         u32* __restrict__ status) {
    if (threadIdx.x != 0 || blockIdx.x != 0) return;
    const u64 start = peer_now();
    for (u64 r = base + 1; r <= base + rounds; ++r) {
        if (serve_first) peer_store_release(theirs, r);
        while (peer_load_acquire(mine) < r) {
            if (peer_now() - start > timeout_ns) {
                *status = 1u;
                return;
            }
        }
        if (!serve_first) peer_store_release(theirs, r);
    }
    *status = 0u;
}
