// archs: sm_75 sm_80 sm_90 sm_90a
// Row top-k (k <= 16) and the fused MoE router (softmax -> top-k -> renormalize), over
// f32 / f16 / bf16 rows.
//
// Order (the same on the CPU backend): every element gets a 64-bit rank, its value's order
// key in the high word and (0xffffffff - index) in the low word, and the k largest ranks win,
// largest first. Order keys: NaN (any sign or payload) above +inf, then the values
// descending (-0.0 equal to +0.0), -inf lowest; equal keys go to the lower index. Rank 0 never
// belongs to an element (no value has key 0), so it marks "taken" and padding.
//
// Kernels (block 256, no shared memory):
//   *_tile_v<V>_g<G>: a group of G lanes per row, V consecutive elements per lane held in
//     registers (16-byte loads when aligned), rows up to V*G wide: G = 1..32 with V = 8 up to
//     256 wide, then V = 16 and V = 32 with a full warp up to 1024 wide.
//   *_list: rows wider than 1024, one warp per row; each lane keeps its 16 best ranks sorted
//     while it streams its strided share of the row.
// Then k rounds of: each lane's best rank, the max over the group by xor shuffles (every lane
// gets the winner), the owner drops it, and lane (r % G) of the group writes output r.
// The router writes exp(logit - max) in round r and divides by the sum at the end (the
// winners' sum, or the whole row's when not renormalising); each lane rereads only what it
// wrote itself.

#define KMAX 16

__device__ __forceinline__ u32 order_key(float f) {
    if (f != f) return 0xffffffffu;
    if (f == 0.0f) return 0x80000000u;
    const u32 u = __float_as_uint(f);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}
// The value of a key (exact for every non-NaN value; -0.0 comes back as +0.0).
__device__ __forceinline__ float key_value(u32 k) {
    if (k == 0xffffffffu) return f32_nan();
    return __uint_as_float((k & 0x80000000u) ? (k & 0x7fffffffu) : ~k);
}
__device__ __forceinline__ u64 make_rank(u32 key, u32 idx) { return ((u64)key << 32) | (u64)(0xffffffffu - idx); }
__device__ __forceinline__ u32 rank_index(u64 r) { return 0xffffffffu - (u32)r; }
__device__ __forceinline__ u32 rank_key(u64 r) { return (u32)(r >> 32); }

template <int G> __device__ __forceinline__ u64 group_max(u64 r) {
#pragma unroll
    for (int o = G / 2; o > 0; o >>= 1) { const u64 s = __shfl_xor_sync(0xffffffffu, r, o); r = s > r ? s : r; }
    return r;
}
template <int G> __device__ __forceinline__ float group_sum(float v) {
#pragma unroll
    for (int o = G / 2; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// A row's elements held by a group of G lanes, V consecutive ones per lane, as order keys
// (0 = taken or padding).
template <typename T, int V>
struct Tile {
    u32 key[V];
    u32 base;
    __device__ __forceinline__ Tile(const T* __restrict__ row, u32 cols, bool valid, u32 lane_g) : base(lane_g * V) {
        if (valid && base + V <= cols && aligned16(row + base)) {
#pragma unroll
            for (int p = 0; p < V / 8; ++p) {
                float f[8];
                unpack8(load_pack8(row + base + 8 * p), f);
#pragma unroll
                for (int e = 0; e < 8; ++e) key[8 * p + e] = order_key(f[e]);
            }
        } else {
#pragma unroll
            for (int j = 0; j < V; ++j) key[j] = (valid && base + j < cols) ? order_key(to_f32(row[base + j])) : 0u;
        }
    }
    __device__ __forceinline__ u64 best() const {
        u64 b = 0;
#pragma unroll
        for (int j = 0; j < V; ++j) {
            const u64 c = key[j] ? make_rank(key[j], base + j) : 0;
            b = c > b ? c : b;
        }
        return b;
    }
    __device__ __forceinline__ void drop(u64 winner) {
        const u32 w = rank_index(winner);
#pragma unroll
        for (int j = 0; j < V; ++j)
            if (base + j == w) key[j] = 0u;
    }
};

// A lane's 16 best ranks of its strided share (lane, lane + 32, ...) of a row, best first.
template <typename T>
struct List {
    u64 l[KMAX];
    __device__ __forceinline__ List(const T* __restrict__ row, u32 cols, bool valid, u32 lane) {
#pragma unroll
        for (int i = 0; i < KMAX; ++i) l[i] = 0;
        if (!valid) return;
        for (u32 c = lane; c < cols; c += 32) {
            const u64 x = make_rank(order_key(to_f32(row[c])), c);
            if (x > l[KMAX - 1]) {
                l[KMAX - 1] = x;
#pragma unroll
                for (int i = KMAX - 1; i > 0; --i)
                    if (l[i] > l[i - 1]) { const u64 t = l[i]; l[i] = l[i - 1]; l[i - 1] = t; }
            }
        }
    }
    __device__ __forceinline__ u64 best() const { return l[0]; }
    __device__ __forceinline__ void drop(u64 winner) {
        if (l[0] != winner) return;
#pragma unroll
        for (int i = 0; i < KMAX - 1; ++i) l[i] = l[i + 1];
        l[KMAX - 1] = 0;
    }
};

// k rounds over a group's holder S; writes values and indices of one row.
template <typename T, int G, typename S>
__device__ __forceinline__ void topk_rounds(S& s, const T* __restrict__ row, u32 k, bool valid, u32 lane_g, T* __restrict__ vals, u32* __restrict__ idx) {
    for (u32 r = 0; r < k; ++r) {
        const u64 win = group_max<G>(s.best());
        s.drop(win);
        if (valid && r % G == lane_g) {
            const u32 i = rank_index(win);
            vals[r] = row[i];
            idx[r] = i;
        }
    }
}

// k rounds for the router: weights (softmax restricted to the winners and renormalised, or
// the winners' plain softmax probabilities) and indices of one row. Logits come back exactly
// from the winners' keys; the max is the first winner's (NaN when the row has a NaN).
template <typename T, int G, typename S>
__device__ __forceinline__ void route_rounds(S& s, const T* __restrict__ row, u32 cols, u32 k, int renorm, bool valid, u32 lane_g, float* __restrict__ w, u32* __restrict__ idx) {
    float m = 0.0f, picked = 0.0f;
    for (u32 r = 0; r < k; ++r) {
        const u64 win = group_max<G>(s.best());
        s.drop(win);
        const float logit = key_value(rank_key(win));
        if (r == 0) m = logit;
        const float e = expf(logit - m);
        picked += e;
        if (valid && r % G == lane_g) {
            w[r] = e;
            idx[r] = rank_index(win);
        }
    }
    float denom = picked;
    if (!renorm) {
        float part = 0.0f;
        if (valid)
            for (u32 c = lane_g; c < cols; c += G) part += expf(to_f32(row[c]) - m);
        denom = group_sum<G>(part);
    }
    if (valid)
        for (u32 r = lane_g; r < k; r += G) w[r] = w[r] / denom;
}

template <typename T, int V, int G>
__device__ __forceinline__ void topk_tile(const T* __restrict__ x, u64 rows, u32 cols, u32 k, T* __restrict__ vals, u32* __restrict__ idx) {
    const u64 row = (blockIdx.x * (u64)blockDim.x + threadIdx.x) / G;
    const u32 lane_g = threadIdx.x % G;
    const bool valid = row < rows;
    const u64 at = valid ? row : 0;
    const T* r = x + at * cols;
    Tile<T, V> s(r, cols, valid, lane_g);
    topk_rounds<T, G>(s, r, k, valid, lane_g, vals + at * k, idx + at * k);
}

template <typename T>
__device__ __forceinline__ void topk_list(const T* __restrict__ x, u64 rows, u32 cols, u32 k, T* __restrict__ vals, u32* __restrict__ idx) {
    const u64 row = (blockIdx.x * (u64)blockDim.x + threadIdx.x) / 32;
    const u32 lane = threadIdx.x & 31u;
    const bool valid = row < rows;
    const u64 at = valid ? row : 0;
    const T* r = x + at * cols;
    List<T> s(r, cols, valid, lane);
    topk_rounds<T, 32>(s, r, k, valid, lane, vals + at * k, idx + at * k);
}

template <typename T, int V, int G>
__device__ __forceinline__ void route_tile(const T* __restrict__ x, u64 rows, u32 cols, u32 k, int renorm, float* __restrict__ w, u32* __restrict__ idx) {
    const u64 row = (blockIdx.x * (u64)blockDim.x + threadIdx.x) / G;
    const u32 lane_g = threadIdx.x % G;
    const bool valid = row < rows;
    const u64 at = valid ? row : 0;
    const T* r = x + at * cols;
    Tile<T, V> s(r, cols, valid, lane_g);
    route_rounds<T, G>(s, r, cols, k, renorm, valid, lane_g, w + at * k, idx + at * k);
}

template <typename T>
__device__ __forceinline__ void route_list(const T* __restrict__ x, u64 rows, u32 cols, u32 k, int renorm, float* __restrict__ w, u32* __restrict__ idx) {
    const u64 row = (blockIdx.x * (u64)blockDim.x + threadIdx.x) / 32;
    const u32 lane = threadIdx.x & 31u;
    const bool valid = row < rows;
    const u64 at = valid ? row : 0;
    const T* r = x + at * cols;
    List<T> s(r, cols, valid, lane);
    route_rounds<T, 32>(s, r, cols, k, renorm, valid, lane, w + at * k, idx + at * k);
}

#define TILE(NAME, T, V, G)                                                                              \
extern "C" __global__ void __launch_bounds__(256) topk_tile_v##V##_g##G##_##NAME(const T* __restrict__ x, u64 rows, u32 cols, u32 k, T* __restrict__ vals, u32* __restrict__ idx) { topk_tile<T, V, G>(x, rows, cols, k, vals, idx); } \
extern "C" __global__ void __launch_bounds__(256) route_tile_v##V##_g##G##_##NAME(const T* __restrict__ x, u64 rows, u32 cols, u32 k, int renorm, float* __restrict__ w, u32* __restrict__ idx) { route_tile<T, V, G>(x, rows, cols, k, renorm, w, idx); }
#define ALL(NAME, T)                                                                                     \
TILE(NAME, T, 8, 1) TILE(NAME, T, 8, 2) TILE(NAME, T, 8, 4) TILE(NAME, T, 8, 8) TILE(NAME, T, 8, 16)       \
TILE(NAME, T, 8, 32) TILE(NAME, T, 16, 32) TILE(NAME, T, 32, 32)                                          \
extern "C" __global__ void __launch_bounds__(256) topk_list_##NAME(const T* __restrict__ x, u64 rows, u32 cols, u32 k, T* __restrict__ vals, u32* __restrict__ idx) { topk_list<T>(x, rows, cols, k, vals, idx); } \
extern "C" __global__ void __launch_bounds__(256) route_list_##NAME(const T* __restrict__ x, u64 rows, u32 cols, u32 k, int renorm, float* __restrict__ w, u32* __restrict__ idx) { route_list<T>(x, rows, cols, k, renorm, w, idx); }
ALL(f32, float)
ALL(f16, f16)
ALL(bf16, bf16)
