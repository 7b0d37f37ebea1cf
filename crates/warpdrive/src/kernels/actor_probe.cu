// archs: sm_80 sm_90
// The actors suite's baselines (actor/probe.rs): a doorbell, the least a resident kernel
// can do per message, and a one-message kernel for the launch-per-message baselines.

// words[0]: the host's ring (a counter), words[1]: 1 to stop (read together, one load);
// words[2]: the answer.
extern "C" __global__ void doorbell(u64* words) {
    if (threadIdx.x != 0 || blockIdx.x != 0) return;
    u64 last = 0;
    for (;;) {
        u64 v, stop;
        asm volatile("ld.volatile.global.v2.u64 {%0,%1}, [%2];" : "=l"(v), "=l"(stop) : "l"(words) : "memory");
        if (stop == 1) return;
        if (v != last) {
            last = v;
            asm volatile("st.volatile.global.u64 [%0], %1;" ::"l"(words + 2), "l"(v) : "memory");
        }
    }
}

// One message of `n` u32 words: out = 3 in + 1 (the actors suite's echo), one warp.
extern "C" __global__ void echo_once(const u32* __restrict__ in, u32* __restrict__ out, u32 n) {
    for (u32 i = threadIdx.x; i < n; i += blockDim.x) out[i] = in[i] * 3u + 1u;
}
