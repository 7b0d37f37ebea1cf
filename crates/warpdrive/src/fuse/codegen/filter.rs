//! The filter kernel, `fuse_filter`: a map and stream compaction in one pass.

use std::fmt::Write;

use crate::dtype::DTypeKind;

use super::super::program::{Class, Program};
use super::*;

/// A filter (stream compaction) in one pass: each block takes the next tile of
/// `256 · FILTER_VECS · W` elements (a dynamic tile number, so every tile it waits on belongs
/// to a block already running), evaluates value and predicate per element, scans its keep
/// counts, and finds the tile's offset by a decoupled look-back over the tiles before it
/// (`tiles[t]`: a count with a flag, aggregate or inclusive prefix, in one 64-bit word); the
/// last tile writes the total into `count`.
pub(super) fn filter_kernel(s: &mut String, prog: &Program<'_>, out: DTypeKind) {
    let w = width(prog, out);
    let ot = ctype(out);
    let _ = writeln!(
        s,
        "extern \"C\" __global__ void __launch_bounds__({BLOCK}) {KERNEL_FILTER}({}) {{",
        kernel_params(
            prog,
            out,
            &["u64* tiles", "u32* count", "u64 n", "u64 cols"]
        )
    );
    let _ = writeln!(s, "    constexpr int W = {w};");
    let _ = writeln!(s, "    constexpr int V = {FILTER_VECS};");
    let _ = writeln!(s, "    constexpr u64 TILE = {BLOCK}ull * V * W;");
    let _ = writeln!(
        s,
        "    constexpr u64 AGG = 1ull << 62, PREFIX = 2ull << 62, VALUE = (1ull << 62) - 1;"
    );
    let _ = writeln!(s, "    (void)cols;");
    let _ = writeln!(s, "    __shared__ u64 tile_s, prefix_s;");
    let _ = writeln!(s, "    if (threadIdx.x == 0) tile_s = atomicAdd((unsigned long long*)(tiles + gridDim.x), 1ull);");
    let _ = writeln!(s, "    __syncthreads();");
    let _ = writeln!(s, "    const u64 tile = tile_s;");
    scalar_loads(s, prog, "    ");
    let _ = writeln!(s, "    float val[V * W];");
    let _ = writeln!(s, "    bool keep[V * W];");
    let _ = writeln!(
        s,
        "    const u64 first = tile * TILE + (u64)threadIdx.x * (V * W);"
    );
    let _ = writeln!(
        s,
        "    if (first + V * W <= n && {}) {{",
        vector_condition(prog, false, false)
    );
    let _ = writeln!(s, "#pragma unroll");
    let _ = writeln!(s, "        for (int v = 0; v < V; ++v) {{");
    let _ = writeln!(s, "            const u64 e0 = first + (u64)v * W;");
    for (i, x) in prog.inputs.iter().enumerate() {
        let t = ctype(x.kind);
        match x.class {
            Class::Full | Class::Row => {
                let at = if x.class == Class::Full {
                    "e0"
                } else {
                    "e0 % cols"
                };
                let _ = writeln!(s, "            float f{i}[W];");
                let _ = writeln!(
                    s,
                    "            unpack_vec(load_vec<{t}, W>(in{i} + {at}), f{i});"
                );
            }
            Class::Col => {
                let _ = writeln!(
                    s,
                    "            const float p{i} = to_f32(in{i}[e0 / cols]);"
                );
            }
            Class::Scalar => {}
        }
    }
    let call = Call {
        inputs: vector_values(prog, "p{i}"),
        col: "(float)((e0 + k) % cols)",
    };
    let a = args(prog, &call, &[], &[]);
    let _ = writeln!(s, "#pragma unroll");
    let _ = writeln!(s, "            for (int k = 0; k < W; ++k) {{ val[v * W + k] = fz_final({a}); keep[v * W + k] = fz_keep({a}) != 0.0f; }}");
    let _ = writeln!(s, "        }}");
    let _ = writeln!(s, "    }} else {{");
    let call = Call {
        inputs: element_values(prog, "e", "e / cols", "e % cols"),
        col: "(float)(e % cols)",
    };
    let a = args(prog, &call, &[], &[]);
    let _ = writeln!(s, "#pragma unroll");
    let _ = writeln!(s, "        for (int j = 0; j < V * W; ++j) {{");
    let _ = writeln!(s, "            const u64 e = first + j;");
    let _ = writeln!(s, "            keep[j] = false;");
    let _ = writeln!(s, "            val[j] = 0.0f;");
    let _ = writeln!(
        s,
        "            if (e < n) {{ val[j] = fz_final({a}); keep[j] = fz_keep({a}) != 0.0f; }}"
    );
    let _ = writeln!(s, "        }}");
    let _ = writeln!(s, "    }}");
    let _ = writeln!(s, "    u32 mine = 0;");
    let _ = writeln!(s, "#pragma unroll");
    let _ = writeln!(
        s,
        "    for (int j = 0; j < V * W; ++j) mine += keep[j] ? 1u : 0u;"
    );
    let _ = writeln!(s, "    u32 total;");
    let _ = writeln!(
        s,
        "    const u32 before = block_exclusive_scan(mine, &total);"
    );
    // The kept values into shared memory in order (the scan ended with a barrier), so the
    // tile's output is written by consecutive threads to consecutive addresses below.
    // The tile's count first, so tiles behind it can look back past it while it stages.
    let _ = writeln!(
        s,
        "    if (threadIdx.x == 0 && tile != 0) ((volatile u64*)tiles)[tile] = AGG | total;"
    );
    let _ = writeln!(s, "    __shared__ {ot} staged[{BLOCK} * V * W];");
    let _ = writeln!(s, "    u32 o = before;");
    let _ = writeln!(s, "#pragma unroll");
    let _ = writeln!(
        s,
        "    for (int j = 0; j < V * W; ++j) if (keep[j]) staged[o++] = from_f32<{ot}>(val[j]);"
    );
    let _ = writeln!(s, "    if (threadIdx.x == 0) {{");
    let _ = writeln!(s, "        volatile u64* state = (volatile u64*)tiles;");
    let _ = writeln!(s, "        u64 prefix = 0;");
    let _ = writeln!(s, "        if (tile != 0) {{");
    let _ = writeln!(s, "            for (u64 t = tile - 1;; --t) {{");
    let _ = writeln!(s, "                u64 word;");
    let _ = writeln!(
        s,
        "                do {{ word = state[t]; }} while ((word >> 62) == 0);"
    );
    let _ = writeln!(s, "                prefix += word & VALUE;");
    let _ = writeln!(
        s,
        "                if ((word & PREFIX) != 0 || t == 0) break;"
    );
    let _ = writeln!(s, "            }}");
    let _ = writeln!(s, "        }}");
    let _ = writeln!(s, "        state[tile] = PREFIX | (prefix + total);");
    let _ = writeln!(s, "        prefix_s = prefix;");
    let _ = writeln!(
        s,
        "        if (tile == gridDim.x - 1) *count = (u32)(prefix + total);"
    );
    let _ = writeln!(s, "    }}");
    let _ = writeln!(s, "    __syncthreads();");
    let _ = writeln!(
        s,
        "    for (u32 i = threadIdx.x; i < total; i += blockDim.x) out[prefix_s + i] = staged[i];"
    );
    let _ = writeln!(s, "}}");
}
