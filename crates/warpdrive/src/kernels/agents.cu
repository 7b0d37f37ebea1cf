// archs: sm_80 sm_90 sm_90a
// GPU agents: the uniform grid of spatial messages (FLAME GPU 2's Spatial3D), the Circles
// model's move, and a single-vote consensus.
//   agents_bin_count: block 256, grid-stride; each agent's bin (clamped to the grid, as
//     Spatial3D clamps) into bin_of, and one atomicAdd on its bin's count (agents spread over
//     many bins: low contention) whose old value is the agent's rank in its bin (into rank).
//     The counts are zeroed before; the exclusive scan of the counts (ops::exclusive_scan)
//     gives each bin's first slot.
//   agents_scatter: block 256, grid-stride; each agent's message, one float4 (x, y, z, and
//     the agent's index as the bits of w: one 16-byte load per message read), into slot
//     starts[bin] + rank: no atomics and no copy of the starts (the scatter was atomic-bound:
//     ~530 cycles an issued instruction). The order inside a bin is whatever the count's
//     atomics gave; the move sums in that order (a float rounding difference).
//   circles_move: block 256, grid-stride over message slots: thread t moves the agent whose
//     message sits in slot t, so neighbouring threads sit in one bin and read the same
//     neighbour strips (L1 hits: what FLAME GPU gets by sorting agents each step). It reads
//     the messages of the 3 x 3 x 3 bins around its own (one contiguous strip of 3 bins per
//     (z, y) row), sums the Circles force and writes the agent's new position (messages are
//     a copy: no read-after-write). The cube root runs only for messages whose squared
//     distance is below radius³ (plus a margin): cbrt is monotonic, so the rest cannot count.
//   agents_vote: block 256, grid-stride over 16-byte vectors of four votes, four vectors a
//     thread a step (fewer blocks: fewer tickets on one word, fewer partials); yes votes
//     counted per thread, per warp (shuffles), per block (warp counts in shared memory),
//     one u64 per block into partials, then the last block (a ticket: one atomic per block, not per agent) adds the partials
//     in block order, sets the ticket back to 0 (graph replays) and writes the decision to
//     mapped host memory: when asked (packed) and below 2^31 voters one packed word (round's low 32 bits, passed,
//     yes: one store, no fence); else (yes, decision), a system-wide fence, the round. The
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
    float lo, float w, u32 dim, u32* __restrict__ bin_of, u32* __restrict__ counts,
    u32* __restrict__ rank) {
    const u64 stride = (u64)gridDim.x * blockDim.x;
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < n; i += stride) {
        const u32 bx = agents_axis(x[i], lo, w, dim);
        const u32 by = agents_axis(y[i], lo, w, dim);
        const u32 bz = agents_axis(z[i], lo, w, dim);
        const u32 b = (bz * dim + by) * dim + bx;
        bin_of[i] = b;
        rank[i] = atomicAdd(&counts[b], 1u);
    }
}

extern "C" __global__ void __launch_bounds__(256) agents_scatter(
    const float* __restrict__ x, const float* __restrict__ y, const float* __restrict__ z, u64 n,
    const u32* __restrict__ bin_of, const u32* __restrict__ rank, const u32* __restrict__ starts,
    float4* __restrict__ msg) {
    const u64 stride = (u64)gridDim.x * blockDim.x;
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < n; i += stride) {
        const u32 slot = starts[bin_of[i]] + rank[i];
        msg[slot] = make_float4(x[i], y[i], z[i], __uint_as_float((u32)i));
    }
}

// circles_move_fast: circles_move's walk and in/out decision, a cheaper force. A warp pays for
// the force of a message when any of its lanes has one inside (about 44 % of the messages
// read are: |d| < 2√2), so the force's cost, not the loads, set circles_move's time: a precise
// cbrtf, a sinf of a double argument and three IEEE divisions, about 100 instructions a
// message. Here: the decision is circles_move's (cbrtf(d2) < radius) wherever it could differ
// (d2 within 1e-4 of radius³, or tiny d2); elsewhere it is certain, and the force takes
// s = 2^(log2(d2)/3), sin of (s · -2·3.141/radius) shifted into [-π, π] for __sinf, and one
// approximate reciprocal: four MUFU and ~15 FP32 instructions, each within ~1e-6 relative.
__device__ __forceinline__ float circles_ex2(float v) {
    float r;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(v));
    return r;
}

__device__ __forceinline__ void circles_force(float dx, float dy, float dz, float sep,
                                              float ka, float repulse, float& fx, float& fy,
                                              float& fz) {
    // sin(θ) = -sin(θ + π): θ = sep · ka lies in [-2 · 3.141, 0]; __sinf is most accurate on
    // [-π, π].
    const float k = -__sinf(fmaf(sep, ka, 3.14159265358979f)) * repulse;
    const float kk = __fdividef(k, sep);
    fx = fmaf(kk, dx, fx);
    fy = fmaf(kk, dy, fy);
    fz = fmaf(kk, dz, fz);
}

// One agent's Circles move from the messages of the 3 x 3 x 3 bins around it: FAST takes
// circles_move_fast's force, else circles_move's (the precise one, kept to compare).
template <bool FAST>
__device__ __forceinline__ void circles_move_agent(
    float* __restrict__ x, float* __restrict__ y, float* __restrict__ z, u64 t,
    const u32* __restrict__ starts, const float4* __restrict__ msg, float lo, float w, u32 dim,
    float radius, float repulse) {
    const float r3 = radius * radius * radius;
    // cbrtf is monotonic and within an ulp: beyond r3 · 1.0001 nothing counts; in FAST,
    // below r3 · 0.9999 everything with d2 > 1e-30 does and only the band between takes cbrtf.
    const float r3_hi = r3 * 1.0001f, r3_lo = r3 * 0.9999f;
    // As the benchmark's argument (double)(sep / radius) * 3.141 * -2.0, folded once.
    const float ka = (float)(-2.0 * 3.141 / (double)radius);
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
                // FAST: the agent's own message (d2 = 0) falls to the cbrtf branch and fails
                // sep > 0: no index compare in the loop.
                if constexpr (!FAST)
                    if ((u64)m == t) continue;
                const float4 o = msg[m];
                float dx = o.x - x1, dy = o.y - y1, dz = o.z - z1;
                const float d2 = dx * dx + dy * dy + dz * dz;
                if (!(d2 < r3_hi)) continue;
                if constexpr (FAST) {
                    float sep;
                    if (d2 < r3_lo && d2 > 1e-30f) {
                        sep = circles_ex2(__log2f(d2) * (1.0f / 3.0f));
                    } else {
                        // The boundary band (and tiny or zero d2): the exact test.
                        sep = cbrtf(d2);
                        if (!(sep < radius && sep > 0.0f)) continue;
                    }
                    circles_force(dx, dy, dz, sep, ka, repulse, fx, fy, fz);
                    ++count;
                } else {
                    // FLAME GPU 2's circles benchmark: cbrt of the squared distance.
                    const float sep = cbrtf(d2);
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
    }
    const float c = count > 0 ? (float)count : 1.0f;
    x[i] = x1 + fx / c;
    y[i] = y1 + fy / c;
    z[i] = z1 + fz / c;
}

#define CIRCLES_MOVE(NAME, FAST)                                                                     \
    extern "C" __global__ void __launch_bounds__(256) NAME(                                         \
        float* __restrict__ x, float* __restrict__ y, float* __restrict__ z, u64 n,                 \
        const u32* __restrict__ starts, const float4* __restrict__ msg, float lo, float w, u32 dim, \
        float radius, float repulse) {                                                              \
        const u64 stride = (u64)gridDim.x * blockDim.x;                                             \
        for (u64 t = blockIdx.x * (u64)blockDim.x + threadIdx.x; t < n; t += stride)                \
            circles_move_agent<FAST>(x, y, z, t, starts, msg, lo, w, dim, radius, repulse);         \
    }
CIRCLES_MOVE(circles_move, false)
CIRCLES_MOVE(circles_move_fast, true)

// Yes votes (non-zero) in this thread's grid-stride share of n: four votes a 16-byte load,
// four loads in flight a thread (the grid is sized for it), the tail past the last whole
// vector one by one. CG: loads that skip L1 (a resident kernel, whose votes change between
// rounds while it stays).
template <bool CG> __device__ __forceinline__ u32 agents_vote_ld(const u32* p) {
    if constexpr (CG) return __ldcg(p); else return *p;
}
template <bool CG> __device__ __forceinline__ uint4 agents_vote_ld4(const uint4* p) {
    if constexpr (CG) return __ldcg(p); else return *p;
}
template <bool CG>
__device__ __forceinline__ u32 agents_count_share(const u32* __restrict__ votes, u64 n, u64 tid,
                                                  u64 stride) {
    u32 count = 0;
    u64 whole = 0;
    if (aligned16(votes)) {
        whole = n / 4u;
        const uint4* v4 = (const uint4*)votes;
        u64 k = tid;
        for (; k + 3u * stride < whole; k += 4u * stride) {
            uint4 v[4];
#pragma unroll
            for (int j = 0; j < 4; ++j) v[j] = agents_vote_ld4<CG>(v4 + k + j * stride);
#pragma unroll
            for (int j = 0; j < 4; ++j)
                count += (v[j].x != 0u) + (v[j].y != 0u) + (v[j].z != 0u) + (v[j].w != 0u);
        }
        for (; k < whole; k += stride) {
            const uint4 v = agents_vote_ld4<CG>(v4 + k);
            count += (v.x != 0u) + (v.y != 0u) + (v.z != 0u) + (v.w != 0u);
        }
        whole *= 4u;
    }
    for (u64 i = whole + tid; i < n; i += stride) count += agents_vote_ld<CG>(votes + i) != 0u;
    return count;
}

// The weight of this thread's grid-stride share of n (f64) into all, and of its yes voters
// into yes. CG as above.
template <bool CG>
__device__ __forceinline__ void agents_weigh_share(const u32* __restrict__ votes,
                                                   const float* __restrict__ weights, u64 n,
                                                   u64 tid, u64 stride, double& yes, double& all) {
    for (u64 i = tid; i < n; i += stride) {
        const double w = (double)(CG ? __ldcg(weights + i) : weights[i]);
        all += w;
        if (agents_vote_ld<CG>(votes + i) != 0u) yes += w;
    }
}

extern "C" __global__ void __launch_bounds__(256) agents_vote(
    const u32* __restrict__ votes, u64 n, u64* __restrict__ partials, u32* __restrict__ ticket,
    volatile u64* __restrict__ out, u64 round, u32 packed) {
    __shared__ bool last;
    const u32 lane = threadIdx.x & 31u, warp = threadIdx.x >> 5;
    const u64 tid = blockIdx.x * (u64)blockDim.x + threadIdx.x;
    const u32 count = agents_count_share<false>(votes, n, tid, (u64)gridDim.x * blockDim.x);
    const u64 mine = (u64)warp_sum(count);
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
        const u64 passed = 2ull * yes > n ? 1ull : 0ull;
        if (packed != 0u && n < (1ull << 31)) {
            // One 8-byte store (single-copy atomic): round's low 32 bits, passed, yes. No
            // system fence, a PCIe round trip, before the host can see it.
            out[2] = (round & 0xffffffffull) << 32 | passed << 31 | (yes & 0x7fffffffull);
        } else {
            out[0] = yes;
            out[1] = passed;
            __threadfence_system();
            out[2] = round;
        }
    }
}

// Birth and death (agents::Population::apply_life). Each thread owns LIFE_ITEMS consecutive
// agents of its block's tile, so a block scan keeps the agents' order.
//   agents_life_count: block 256; per block, agents alive (non-zero) and births (each agent's
//     count clamped to max_births) into block_alive[b] and block_births[b].
//   agents_life_plan: block 256, same tiles; after the exclusive scans of those per-block
//     counts (alive_base, births_base: gridDim.x + 1 entries, the last the total), writes
//     each new agent's source: survivors first in order, then each parent's children in
//     parent order (src[alive total + births before + j] = parent).
#define LIFE_ITEMS 8u
#define LIFE_TILE (256u * LIFE_ITEMS)

__device__ __forceinline__ void agents_life_tally(const u32* alive, const u32* births, u64 n,
                                                  u32 max_births, u64 first, u32* a, u32* b) {
    *a = 0u;
    *b = 0u;
#pragma unroll
    for (u32 k = 0; k < LIFE_ITEMS; ++k) {
        const u64 i = first + k;
        if (i < n) {
            *a += alive[i] != 0u ? 1u : 0u;
            *b += min(births[i], max_births);
        }
    }
}

extern "C" __global__ void __launch_bounds__(256) agents_life_count(
    const u32* __restrict__ alive, const u32* __restrict__ births, u64 n, u32 max_births,
    u32* __restrict__ block_alive, u32* __restrict__ block_births) {
    const u64 first = (u64)blockIdx.x * LIFE_TILE + (u64)threadIdx.x * LIFE_ITEMS;
    u32 a, b;
    agents_life_tally(alive, births, n, max_births, first, &a, &b);
    u32 ta, tb;
    block_exclusive_scan(a, &ta);
    block_exclusive_scan(b, &tb);
    if (threadIdx.x == 0) {
        block_alive[blockIdx.x] = ta;
        block_births[blockIdx.x] = tb;
    }
}

extern "C" __global__ void __launch_bounds__(256) agents_life_plan(
    const u32* __restrict__ alive, const u32* __restrict__ births, u64 n, u32 max_births,
    const u32* __restrict__ alive_base, const u32* __restrict__ births_base,
    u32* __restrict__ src) {
    const u64 first = (u64)blockIdx.x * LIFE_TILE + (u64)threadIdx.x * LIFE_ITEMS;
    u32 a, b;
    agents_life_tally(alive, births, n, max_births, first, &a, &b);
    u32 ta, tb;
    u32 pa = alive_base[blockIdx.x] + block_exclusive_scan(a, &ta);
    u32 pb = alive_base[gridDim.x] + births_base[blockIdx.x] + block_exclusive_scan(b, &tb);
    for (u32 k = 0; k < LIFE_ITEMS; ++k) {
        const u64 i = first + k;
        if (i >= n) break;
        if (alive[i] != 0u) src[pa++] = (u32)i;
        const u32 c = min(births[i], max_births);
        for (u32 j = 0; j < c; ++j) src[pb++] = (u32)i;
    }
}

// Weighted quorum (agents::Quorum): block 256, grid-stride; each thread sums the weights of
// its agents (f64) and of those voting yes; block sums, one pair per block into partials,
// the last block (a ticket) adds the pairs in block order and writes (yes weight, total
// weight, passed = yes >= quorum * total and total > 0) to mapped memory, then the round.
extern "C" __global__ void __launch_bounds__(256) agents_quorum(
    const u32* __restrict__ votes, const float* __restrict__ weights, u64 n, double quorum,
    double* __restrict__ partials, u32* __restrict__ ticket, volatile u64* __restrict__ out,
    u64 round) {
    __shared__ bool last;
    double yes = 0.0, all = 0.0;
    const u64 stride = (u64)gridDim.x * blockDim.x;
    agents_weigh_share<false>(votes, weights, n, blockIdx.x * (u64)blockDim.x + threadIdx.x,
                              stride, yes, all);
    yes = block_sum(yes);
    __syncthreads();
    all = block_sum(all);
    if (threadIdx.x == 0) {
        partials[2 * blockIdx.x] = yes;
        partials[2 * blockIdx.x + 1] = all;
        __threadfence();
        last = atomicAdd(ticket, 1u) == gridDim.x - 1;
    }
    __syncthreads();
    if (!last) return;
    __threadfence();
    double py = 0.0, pa = 0.0;
    for (u32 b = threadIdx.x; b < gridDim.x; b += blockDim.x) {
        py += ((volatile double*)partials)[2 * b];
        pa += ((volatile double*)partials)[2 * b + 1];
    }
    py = block_sum(py);
    __syncthreads();
    pa = block_sum(pa);
    if (threadIdx.x == 0) {
        *ticket = 0u;
        out[0] = (u64)__double_as_longlong(py);
        out[1] = (u64)__double_as_longlong(pa);
        out[2] = (pa > 0.0 && py >= quorum * pa) ? 1ull : 0ull;
        __threadfence_system();
        out[3] = round;
    }
}

// Iterative averaging (agents::Averaging): rounds of (measure, update) kernels enqueued at
// once, the host out of the loop. state (device): [0] mean (f64 bits), [1] spread (f64
// bits), [2] converged, [3] updates applied.
//   agents_avg_measure: block 256, grid-stride (returns at once once converged); f64 sum and
//     f32 min / max per block into partials (3 a block); the last block (all its threads)
//     adds them up, then computes the mean
//     and the spread max(max - mean, mean - min), marks convergence when spread <= tol, and
//     writes (updates, mean, spread, converged) to mapped memory, then the round.
//   agents_avg_update: grid-stride, nothing once converged; x += rate * (mean - x), counting
//     the update (block 0, thread 0).
extern "C" __global__ void __launch_bounds__(256) agents_avg_measure(
    const float* __restrict__ x, u64 n, double tol, double* __restrict__ partials,
    u32* __restrict__ ticket, u64* state, volatile u64* __restrict__ out, u64 round) {
    __shared__ bool last;
    __shared__ float lo_w[8], hi_w[8];
    if (((volatile u64*)state)[2] != 0ull) {
        // Converged earlier: the figures stand; publish this round so the host stops polling.
        if (blockIdx.x == 0 && threadIdx.x == 0) out[4] = round;
        return;
    }
    double sum = 0.0;
    float lo = __int_as_float(0x7f800000), hi = -__int_as_float(0x7f800000);
    const u64 stride = (u64)gridDim.x * blockDim.x;
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < n; i += stride) {
        const float v = x[i];
        sum += (double)v;
        lo = fminf(lo, v);
        hi = fmaxf(hi, v);
    }
    sum = block_sum(sum);
    const u32 lane = threadIdx.x & 31u, warp = threadIdx.x >> 5;
    for (int o = 16; o > 0; o >>= 1) {
        lo = fminf(lo, __shfl_xor_sync(0xffffffffu, lo, o));
        hi = fmaxf(hi, __shfl_xor_sync(0xffffffffu, hi, o));
    }
    if (lane == 0) {
        lo_w[warp] = lo;
        hi_w[warp] = hi;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        for (u32 k = 1; k < (blockDim.x >> 5); ++k) {
            lo = fminf(lo, lo_w[k]);
            hi = fmaxf(hi, hi_w[k]);
        }
        partials[3 * blockIdx.x] = sum;
        partials[3 * blockIdx.x + 1] = (double)lo;
        partials[3 * blockIdx.x + 2] = (double)hi;
        __threadfence();
        last = atomicAdd(ticket, 1u) == gridDim.x - 1;
    }
    __syncthreads();
    if (!last) return;
    __threadfence();
    // The whole last block adds the blocks' partials (a fixed order for a given grid: each
    // thread a strided run, then the block's tree), min and max alike.
    const volatile double* p = partials;
    double s = 0.0, mn = __longlong_as_double(0x7ff0000000000000ll), mx = -mn;
    for (u32 b = threadIdx.x; b < gridDim.x; b += blockDim.x) {
        s += p[3 * b];
        mn = fmin(mn, p[3 * b + 1]);
        mx = fmax(mx, p[3 * b + 2]);
    }
    s = block_sum(s);
    for (int o = 16; o > 0; o >>= 1) {
        mn = fmin(mn, __shfl_xor_sync(0xffffffffu, mn, o));
        mx = fmax(mx, __shfl_xor_sync(0xffffffffu, mx, o));
    }
    __shared__ double mn_w[8], mx_w[8];
    if (lane == 0) {
        mn_w[warp] = mn;
        mx_w[warp] = mx;
    }
    __syncthreads();
    if (threadIdx.x != 0) return;
    for (u32 k = 1; k < (blockDim.x >> 5); ++k) {
        mn = fmin(mn, mn_w[k]);
        mx = fmax(mx, mx_w[k]);
    }
    const double mean = n ? s / (double)n : 0.0;
    const double spread = n ? fmax(mx - mean, mean - mn) : 0.0;
    const bool done = spread <= tol;
    *ticket = 0u;
    state[0] = (u64)__double_as_longlong(mean);
    state[1] = (u64)__double_as_longlong(spread);
    if (done) state[2] = 1ull;
    out[0] = state[3];
    out[1] = (u64)__double_as_longlong(mean);
    out[2] = (u64)__double_as_longlong(spread);
    out[3] = done ? 1ull : 0ull;
    __threadfence_system();
    out[4] = round;
}

extern "C" __global__ void __launch_bounds__(256) agents_avg_update(
    float* __restrict__ x, u64 n, float rate, u64* state) {
    if (((volatile u64*)state)[2] != 0ull) return;
    const float mean = (float)__longlong_as_double((long long)((volatile u64*)state)[0]);
    const u64 stride = (u64)gridDim.x * blockDim.x;
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < n; i += stride)
        x[i] += rate * (mean - x[i]);
    if (blockIdx.x == 0 && threadIdx.x == 0) state[3] += 1ull;
}

// The resident vote (agents::ResidentMajority / ResidentQuorum): one cooperative launch (every
// block resident; the host gives it one block an SM, leaving the rest of each SM to other
// work) that serves votes until told to stop, no launch a vote. words (mapped host memory):
// [0] the host's command: a round number (1..2^32-1, one more each vote), or ~0 to stop;
// [8] the decision word, [9] and [10] the quorum's weights (the host writes [0] only, the
// kernel [8..11] only: separate cache lines).
//   Block 0's thread 0 polls [0] (an acquire load at system scope, so the votes the host
//   rewrote before it are seen) and relays a new round to the other blocks through ticket[1]
//   (device memory, release / acquire: the chain carries what block 0 saw); ticket[1] is 0
//   until the first relay, and rounds are never 0. One poller of host memory, not one a
//   block: 132 blocks polling the mapped word made a round take ~700 µs on an H100 (PCIe
//   reads in a storm; bench/NOTES.md). A new round: the block counts its grid-stride share of the
//   votes with loads that skip L1 (the votes change between rounds while the kernel stays),
//   one f64 pair a block into partials, a fence, one ticket per block on a counter that only
//   grows (no contended atomics: a ticket a block, not an agent). The ticket that ends a
//   round (G of them a round, rounds never overlap: the host waits for each decision) makes
//   its block add the partials in block order and publish:
//   rule 0 (majority): [8] = round << 32 | passed << 31 | yes, one 8-byte store (no fence);
//   rule 1 (quorum): [9] yes weight, [10] total (f64 bits), a system fence, then
//   [8] = round << 32 | passed. served: the round the host last saw before this launch (a
//   restart does not answer it again).
extern "C" __global__ void __launch_bounds__(512) agents_vote_serve(
    const u32* __restrict__ votes, const float* __restrict__ weights, u64 n, u32 rule,
    double quorum, double* __restrict__ partials, u64* __restrict__ ticket, u64* words,
    u64 served) {
    __shared__ u64 s_cmd;
    __shared__ bool s_last;
    const u64 tid = blockIdx.x * (u64)blockDim.x + threadIdx.x;
    const u64 stride = (u64)gridDim.x * blockDim.x;
    for (;;) {
        if (threadIdx.x == 0) {
            u64 c;
            if (blockIdx.x == 0) {
                for (;;) {
                    asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(c) : "l"(words) : "memory");
                    if (c != served) break;
                }
                asm volatile("st.release.gpu.global.u64 [%0], %1;" ::"l"(ticket + 1), "l"(c) : "memory");
            } else {
                for (;;) {
                    asm volatile("ld.acquire.gpu.global.u64 %0, [%1];" : "=l"(c) : "l"(ticket + 1) : "memory");
                    if (c != served && c != 0ull) break;
                }
            }
            s_cmd = c;
        }
        __syncthreads();
        const u64 round = s_cmd;
        if (round == ~0ull) return;
        served = round;
        double yes = 0.0, all = 0.0;
        if (rule == 0u) {
            const u32 count = agents_count_share<true>(votes, n, tid, stride);
            // Below 2^31 voters (the host's bound) a u32 count and its f64 are exact.
            yes = (double)block_sum(count);
        } else {
            agents_weigh_share<true>(votes, weights, n, tid, stride, yes, all);
            yes = block_sum(yes);
            __syncthreads();
            all = block_sum(all);
        }
        if (threadIdx.x == 0) {
            partials[2 * blockIdx.x] = yes;
            partials[2 * blockIdx.x + 1] = all;
            __threadfence();
            const u64 t = atomicAdd((unsigned long long*)ticket, 1ull);
            s_last = (t + 1u) % gridDim.x == 0u;
        }
        __syncthreads();
        if (s_last) {
            __threadfence();
            double py = 0.0, pa = 0.0;
            for (u32 b = threadIdx.x; b < gridDim.x; b += blockDim.x) {
                py += __ldcg(partials + 2 * b);
                pa += __ldcg(partials + 2 * b + 1);
            }
            py = block_sum(py);
            __syncthreads();
            pa = block_sum(pa);
            if (threadIdx.x == 0) {
                volatile u64* out = words + 8;
                const u64 tag = (round & 0xffffffffull) << 32;
                if (rule == 0u) {
                    const u64 y = (u64)py;
                    const u64 passed = 2ull * y > n ? 1ull : 0ull;
                    out[0] = tag | passed << 31 | (y & 0x7fffffffull);
                } else {
                    const u64 passed = (pa > 0.0 && py >= quorum * pa) ? 1ull : 0ull;
                    out[1] = (u64)__double_as_longlong(py);
                    out[2] = (u64)__double_as_longlong(pa);
                    __threadfence_system();
                    out[0] = tag | passed << 31;
                }
            }
        }
        // s_cmd and s_last are rewritten next round only after every thread has read them.
        __syncthreads();
    }
}
