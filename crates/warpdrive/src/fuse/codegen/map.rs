//! The map kernel, `fuse_map`: each block takes a chunk of `U × blockDim` vectors of `W`
//! elements (thread t the vectors t, t + blockDim, …: `U` in flight, loads first, then the
//! arithmetic), the grid as many blocks as there are chunks (a chunk-stride loop only past
//! the grid's limit); a scalar loop for unaligned pointers, rows that are not a multiple of
//! `W`, and the tail. One chunk a block, not a grid-stride loop over a resident grid: on an
//! H100 the resident grid moved 2.79 TB/s where one chunk a block moves 2.95 (bench/NOTES.md).
//! A [`Schedule`] may reverse the chunks' order (block 0 takes the last) and make the kernel a
//! programmatic dependent of the one before it (its blocks wait before their first load,
//! after prefetching their chunk into L2 where asked).

use std::fmt::Write;

use crate::dtype::DTypeKind;

use super::super::program::{Class, Program};
use super::*;

/// The map kernel in `shape`, with `__launch_bounds__(shape.block)` (the block it is
/// launched with), in `schedule` (the default: chunks in order, no wait).
pub(super) fn map_kernel(
    s: &mut String,
    prog: &Program<'_>,
    out: DTypeKind,
    shape: MapShape,
    schedule: Schedule,
) {
    let block = shape.block;
    let w = map_width(prog, out, shape);
    let u = map_unroll(prog, shape);
    let ot = ctype(out);
    let _ = writeln!(
        s,
        "extern \"C\" __global__ void __launch_bounds__({block}) {KERNEL_MAP}({}) {{",
        kernel_params(prog, out, &["u64 n", "u64 cols"])
    );
    let _ = writeln!(s, "    constexpr int W = {w};");
    let _ = writeln!(s, "    const u64 stride = (u64)gridDim.x * blockDim.x;");
    // The block's place in the order: reversed, block 0 (dispatched first) takes the last
    // chunk. In order, the source is the one before schedules existed, byte for byte.
    let bx = if schedule.reverse {
        let _ = writeln!(s, "    const u64 bx = (u64)(gridDim.x - 1 - blockIdx.x);");
        let _ = writeln!(s, "    const u64 tid = bx * blockDim.x + threadIdx.x;");
        "bx"
    } else {
        let _ = writeln!(
            s,
            "    const u64 tid = blockIdx.x * (u64)blockDim.x + threadIdx.x;"
        );
        "blockIdx.x"
    };
    let _ = writeln!(s, "    (void)cols;");
    if schedule.programmatic {
        if schedule.prefetch {
            // This block's first chunk of every full input into L2 while the previous
            // kernel finishes (the vector path's vectors; the scalar path takes none).
            let _ = writeln!(s, "    if ({}) {{", vector_condition(prog, true, false));
            let _ = writeln!(s, "        const u64 vecs = n / W;");
            let _ = writeln!(s, "#pragma unroll");
            let _ = writeln!(s, "        for (int u = 0; u < {u}; ++u) {{");
            let _ = writeln!(
                s,
                "            const u64 v = (u64){bx} * {u} * blockDim.x + threadIdx.x + u * (u64)blockDim.x;"
            );
            let _ = writeln!(s, "            if (v < vecs) {{");
            for (i, x) in prog.inputs.iter().enumerate() {
                if x.class == Class::Full {
                    let _ = writeln!(
                        s,
                        "                asm volatile(\"prefetch.global.L2 [%0];\" :: \"l\"(in{i} + v * W));"
                    );
                }
            }
            let _ = writeln!(s, "            }}");
            let _ = writeln!(s, "        }}");
            let _ = writeln!(s, "    }}");
        }
        // Launched as a programmatic dependent: nothing the previous kernel writes is read
        // before it has finished (a no-op when launched plainly or before sm_90).
        let _ = writeln!(s, "    wait_prior_grid();");
    }
    scalar_loads(s, prog, "    ");
    let _ = writeln!(s, "    u64 head = 0;");
    let _ = writeln!(s, "    if ({}) {{", vector_condition(prog, true, false));
    let _ = writeln!(s, "        const u64 vecs = n / W;");
    let _ = writeln!(s, "        const u64 chunk = (u64)blockDim.x * {u};");
    let _ = writeln!(
        s,
        "        for (u64 i = {bx} * chunk + threadIdx.x; i < vecs; i += (u64)gridDim.x * chunk) {{"
    );
    let _ = writeln!(
        s,
        "          if (i + {} * (u64)blockDim.x < vecs) {{",
        u - 1
    );
    map_vector_body(s, prog, ot, u, "i", shape.plain);
    let _ = writeln!(s, "          }} else {{");
    let _ = writeln!(
        s,
        "           for (u64 j = i; j < vecs; j += blockDim.x) {{"
    );
    map_vector_body(s, prog, ot, 1, "j", shape.plain);
    let _ = writeln!(s, "           }}");
    let _ = writeln!(s, "          }}");
    let _ = writeln!(s, "        }}");
    let _ = writeln!(s, "        head = vecs * W;");
    let _ = writeln!(s, "    }}");
    // Scalar loop: unaligned pointers, rows not a multiple of W, and the tail.
    let call = Call {
        inputs: element_values(prog, "e", "e / cols", "e % cols"),
        col: "(float)(e % cols)",
    };
    let _ = writeln!(
        s,
        "    for (u64 e = head + tid; e < n; e += stride) out[e] = from_f32<{ot}>(fz_final({}));",
        args(prog, &call, &[], &[])
    );
    let _ = writeln!(s, "}}");
}

/// One iteration of the map kernel's vector loop with `u` vectors per thread (`first`: the
/// first vector's index, the next ones `blockDim` apart). Full inputs and the output are read
/// and written once: streaming loads and stores (a row-class input is reread by every row and
/// stays cached); `plain`: without the hint.
fn map_vector_body(s: &mut String, prog: &Program<'_>, ot: &str, u: u64, first: &str, plain: bool) {
    let pad = "            ";
    let hint = if plain { "" } else { ", FZ_STREAM" };
    let _ = writeln!(s, "{pad}u64 at[{u}];");
    let _ = writeln!(s, "#pragma unroll");
    let _ = writeln!(
        s,
        "{pad}for (int u = 0; u < {u}; ++u) at[u] = ({first} + u * (u64)blockDim.x) * W;"
    );
    // Loads first: every vector of every input in flight before any arithmetic.
    for (i, x) in prog.inputs.iter().enumerate() {
        let t = ctype(x.kind);
        let load = match x.class {
            Class::Full => format!("v{i}[u] = load_vec<{t}, W>(in{i} + at[u]{hint})"),
            Class::Row => format!("v{i}[u] = load_vec<{t}, W>(in{i} + at[u] % cols)"),
            Class::Col => format!("v{i}[u] = to_f32(in{i}[at[u] / cols])"),
            Class::Scalar => continue,
        };
        let decl = if x.class == Class::Col {
            format!("float v{i}[{u}]")
        } else {
            format!("Vec<{t}, W> v{i}[{u}]")
        };
        let _ = writeln!(s, "{pad}{decl};");
        let _ = writeln!(s, "#pragma unroll");
        let _ = writeln!(s, "{pad}for (int u = 0; u < {u}; ++u) {load};");
    }
    let _ = writeln!(s, "#pragma unroll");
    let _ = writeln!(s, "{pad}for (int u = 0; u < {u}; ++u) {{");
    for i in streamed(prog) {
        let _ = writeln!(s, "{pad}    float f{i}[W];");
        let _ = writeln!(s, "{pad}    unpack_vec(v{i}[u], f{i});");
    }
    let call = Call {
        inputs: vector_values(prog, "v{i}[u]"),
        col: "(float)((at[u] + k) % cols)",
    };
    let _ = writeln!(s, "{pad}    float y[W];");
    let _ = writeln!(s, "#pragma unroll");
    let _ = writeln!(
        s,
        "{pad}    for (int k = 0; k < W; ++k) y[k] = fz_final({});",
        args(prog, &call, &[], &[])
    );
    let _ = writeln!(
        s,
        "{pad}    store_vec(out + at[u], pack_vec<{ot}, W>(y){hint});"
    );
    let _ = writeln!(s, "{pad}}}");
}
