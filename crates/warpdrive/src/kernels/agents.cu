// archs: sm_80 sm_90 sm_90a
// GPU agents: the uniform grid of spatial messages (FLAME GPU 2's Spatial3D), the Circles
// model's move, and a single-vote consensus.
//   agents_bin_count: block 256, grid-stride; each agent's bin (clamped to the grid, as
//     Spatial3D clamps) into bin_of, and one atomicAdd on its bin's count (agents spread over
//     many bins: low contention). The counts are zeroed before; the exclusive scan of the
//     counts (ops::exclusive_scan) gives each bin's first slot.
//   agents_scatter: block 256, grid-stride; each agent's message, one float4 (x, y, z, and
//     the agent's index as the bits of w: one 16-byte load per message read), into the next
//     slot of its bin (atomicAdd on a copy of the starts). The order inside a bin is whatever
//     the atomics give; the move sums in that order (a float rounding difference).
//   circles_move: block 256, grid-stride over message slots: thread t moves the agent whose
//     message sits in slot t, so neighbouring threads sit in one bin and read the same
//     neighbour strips (L1 hits: what FLAME GPU gets by sorting agents each step). It reads
//     the messages of the 3 x 3 x 3 bins around its own (one contiguous strip of 3 bins per
//     (z, y) row), sums the Circles force and writes the agent's new position (messages are
//     a copy: no read-after-write).
//   agents_vote: block 256, grid-stride; yes votes counted per warp (__ballot_sync and
//     __popc), per block (warp counts in shared memory), one u64 per block into partials,
//     then the last block (a ticket: one atomic per block, not per agent) adds the partials
//     in block order, sets the ticket back to 0 (graph replays) and writes (yes, decision)
//     to mapped host memory, then, after a system-wide fence, the vote's round number: the
//     host polls that word and reads the decision without a copy.

__device__ __forceinline__ u32 agents_axis(float p, float lo, float w, u32 dim) {
    // floorf then a saturating conversion (NaN -> 0), as the CPU reference's `as i32`.
    const float f = floorf((p - lo) / w);
    int b = f != f ? 0 : (f >= 2147483520.0f ? 2147483647 : (f <= -2147483648.0f ? (-2147483647 - 1) : (int)f));
    if (b < 0) b = 0;
    if (b > (int)dim - 1) b = (int)dim - 1;
    return (u32)b;
}

extern "C" __global__ void __launch_bounds__(256) agents_bin_count(
    const float* __restrict__ x, const float* __restrict__ y, const float* __restrict__ z, u64 n,
    float lo, float w, u32 dim, u32* __restrict__ bin_of, u32* __restrict__ counts) {
    const u64 stride = (u64)gridDim.x * blockDim.x;
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < n; i += stride) {
        const u32 bx = agents_axis(x[i], lo, w, dim);
        const u32 by = agents_axis(y[i], lo, w, dim);
        const u32 bz = agents_axis(z[i], lo, w, dim);
        const u32 b = (bz * dim + by) * dim + bx;
        bin_of[i] = b;
        atomicAdd(&counts[b], 1u);
    }
}

extern "C" __global__ void __launch_bounds__(256) agents_scatter(
    const float* __restrict__ x, const float* __restrict__ y, const float* __restrict__ z, u64 n,
    const u32* __restrict__ bin_of, u32* __restrict__ cursor, float4* __restrict__ msg) {
    const u64 stride = (u64)gridDim.x * blockDim.x;
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < n; i += stride) {
        const u32 slot = atomicAdd(&cursor[bin_of[i]], 1u);
        msg[slot] = make_float4(x[i], y[i], z[i], __uint_as_float((u32)i));
    }
}

extern "C" __global__ void __launch_bounds__(256) circles_move(
    float* __restrict__ x, float* __restrict__ y, float* __restrict__ z, u64 n,
    const u32* __restrict__ starts, const float4* __restrict__ msg, float lo, float w, u32 dim,
    float radius, float repulse) {
    const u64 stride = (u64)gridDim.x * blockDim.x;
    for (u64 t = blockIdx.x * (u64)blockDim.x + threadIdx.x; t < n; t += stride) {
        const float4 me = msg[t];
        const float x1 = me.x, y1 = me.y, z1 = me.z;
        const u32 i = __float_as_uint(me.w);
        const int cx = (int)agents_axis(x1, lo, w, dim);
        const int cy = (int)agents_axis(y1, lo, w, dim);
        const int cz = (int)agents_axis(z1, lo, w, dim);
        const int last = (int)dim - 1;
        const int x0 = max(cx - 1, 0), x1b = min(cx + 1, last);
        float fx = 0.0f, fy = 0.0f, fz = 0.0f;
        u32 count = 0;
        for (int bz = max(cz - 1, 0); bz <= min(cz + 1, last); ++bz) {
            for (int by = max(cy - 1, 0); by <= min(cy + 1, last); ++by) {
                const u32 row = ((u32)bz * dim + (u32)by) * dim;
                const u32 first = starts[row + (u32)x0], end = starts[row + (u32)x1b + 1u];
                for (u32 m = first; m < end; ++m) {
                    if ((u64)m == t) continue;
                    const float4 o = msg[m];
                    float dx = o.x - x1, dy = o.y - y1, dz = o.z - z1;
                    // FLAME GPU 2's circles benchmark: cbrt of the squared distance.
                    const float sep = cbrtf(dx * dx + dy * dy + dz * dz);
                    if (sep < radius && sep > 0.0f) {
                        // As the benchmark: the argument in double (3.141 is a double literal).
                        const float k = sinf((float)((double)(sep / radius) * 3.141 * -2.0)) * repulse;
                        dx /= sep;
                        dy /= sep;
                        dz /= sep;
                        fx += k * dx;
                        fy += k * dy;
                        fz += k * dz;
                        ++count;
                    }
                }
            }
        }
        const float c = count > 0 ? (float)count : 1.0f;
        fx /= c;
        fy /= c;
        fz /= c;
        x[i] = x1 + fx;
        y[i] = y1 + fy;
        z[i] = z1 + fz;
    }
}

extern "C" __global__ void __launch_bounds__(256) agents_vote(
    const u32* __restrict__ votes, u64 n, u64* __restrict__ partials, u32* __restrict__ ticket,
    volatile u64* __restrict__ out, u64 round) {
    __shared__ bool last;
    const u32 lane = threadIdx.x & 31u, warp = threadIdx.x >> 5;
    u64 mine = 0;
    const u64 stride = (u64)gridDim.x * blockDim.x;
    // Every lane of a warp runs the same number of rounds (the bound is per warp), so the
    // ballot's full mask is valid.
    const u64 warp_first = blockIdx.x * (u64)blockDim.x + (u64)warp * 32u;
    for (u64 base = warp_first; base < n; base += stride) {
        const u64 i = base + lane;
        const bool yes = i < n && votes[i] != 0u;
        const u32 ballot = __ballot_sync(0xffffffffu, yes);
        if (lane == 0) mine += (u64)__popc(ballot);
    }
    // Warp totals (lane 0 holds each) into one block total, then one u64 per block.
    __shared__ u64 wide[8];
    if (lane == 0) wide[warp] = mine;
    __syncthreads();
    if (threadIdx.x == 0) {
        u64 block = 0;
        for (u32 k = 0; k < (blockDim.x >> 5); ++k) block += wide[k];
        partials[blockIdx.x] = block;
        __threadfence();
        last = atomicAdd(ticket, 1u) == gridDim.x - 1;
    }
    __syncthreads();
    if (!last) return;
    __threadfence();
    // The last block adds the partials in a fixed order (deterministic).
    u64 part = 0;
    for (u32 b = threadIdx.x; b < gridDim.x; b += blockDim.x) part += ((volatile u64*)partials)[b];
    const u64 yes = block_sum(part);
    if (threadIdx.x == 0) {
        *ticket = 0u;
        out[0] = yes;
        out[1] = 2ull * yes > n ? 1ull : 0ull;
        __threadfence_system();
        out[2] = round;
    }
}
