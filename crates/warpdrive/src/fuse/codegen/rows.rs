//! The row kernels, `fuse_rows_warp` (a warp per row) and `fuse_rows_block` (a block per
//! row): per row, one pass over its elements per pass of reductions (`Stages`), each ending in
//! a warp or block reduction, then the result per element or per row.

use std::fmt::Write;

use crate::dtype::DTypeKind;

use super::super::expr::Reduce;
use super::super::program::{Class, Op, Program};
use super::*;

/// Vector loads of the streamed inputs at column `c` of row `row` (rows mode) into `v<i><tag>`;
/// `once`: the kernel reads each row once, so full inputs are loaded streaming (evict first).
fn row_vector_fetch(s: &mut String, prog: &Program<'_>, pad: &str, tag: &str, c: &str, once: bool) {
    for i in streamed(prog) {
        let x = &prog.inputs[i];
        let t = ctype(x.kind);
        let (at, hint) = if x.class == Class::Full {
            (
                format!("row * cols + {c}"),
                if once { ", FZ_STREAM" } else { "" },
            )
        } else {
            (c.to_string(), "")
        };
        let _ = writeln!(
            s,
            "{pad}const Vec<{t}, W> v{i}{tag} = load_vec<{t}, W>(in{i} + {at}{hint});"
        );
    }
}

/// Whether the program reads the column index (`ci`).
fn uses_col(prog: &Program<'_>) -> bool {
    prog.ops.iter().any(|o| matches!(o, Op::ColIndex))
}

/// The loaded vectors `v<i><tag>` unpacked into `f<i>`, and the vector's first column as a
/// float, `cf`: element k's column is `cf + k`, one add, not a 64-bit integer conversion per
/// element (exact: where the index is read, the vector loop runs only for rows of at most
/// 2^24 columns, so c + k and cf are integers a float holds; unread, it is dead code).
fn row_vector_unpack(s: &mut String, prog: &Program<'_>, pad: &str, tag: &str) {
    let _ = writeln!(s, "{pad}const float cf = (float)c;");
    for i in streamed(prog) {
        let _ = writeln!(s, "{pad}float f{i}[W];");
        let _ = writeln!(s, "{pad}unpack_vec(v{i}{tag}, f{i});");
    }
}

/// A vector loop over a row's columns, `group * W` apart: two vectors per thread per
/// iteration while both fit (both loaded before either is used, so two are in flight), then
/// one. `body` writes the statements for one vector at column `c` from `f<i>`.
fn row_vector_loop(
    s: &mut String,
    prog: &Program<'_>,
    pad: &str,
    once: bool,
    body: &dyn Fn(&mut String, &str),
) {
    let inner = format!("{pad}        ");
    let _ = writeln!(s, "{pad}u64 c = lane * W;");
    let _ = writeln!(
        s,
        "{pad}for (; c + group * W < cols; c += 2 * group * W) {{"
    );
    // (Not c0, c1: the kernel's constants are c<n>.)
    let _ = writeln!(s, "{pad}    const u64 col_0 = c, col_1 = c + group * W;");
    row_vector_fetch(s, prog, &format!("{pad}    "), "_0", "col_0", once);
    row_vector_fetch(s, prog, &format!("{pad}    "), "_1", "col_1", once);
    for tag in ["0", "1"] {
        let _ = writeln!(s, "{pad}    {{");
        let _ = writeln!(s, "{inner}const u64 c = col_{tag};");
        row_vector_unpack(s, prog, &inner, &format!("_{tag}"));
        body(s, &inner);
        let _ = writeln!(s, "{pad}    }}");
    }
    let _ = writeln!(s, "{pad}}}");
    let _ = writeln!(s, "{pad}for (; c < cols; c += group * W) {{");
    row_vector_fetch(s, prog, &format!("{pad}    "), "_0", "c", once);
    row_vector_unpack(s, prog, &format!("{pad}    "), "_0");
    body(s, &format!("{pad}    "));
    let _ = writeln!(s, "{pad}}}");
}

pub(super) fn rows_kernel(
    s: &mut String,
    prog: &Program<'_>,
    out: DTypeKind,
    reduces: &[usize],
    wholes: &[usize],
    flavor: Flavor,
) {
    let w = width(prog, out);
    let ot = ctype(out);
    let per_element = prog.shape.cols != 1;
    let middle: &[&str] = if wholes.is_empty() {
        &["u64 rows", "u64 cols"]
    } else {
        &["float* partials", "u32* ticket", "u64 rows", "u64 cols"]
    };
    let kp = kernel_params(prog, out, middle);
    let _ = writeln!(
        s,
        "template <bool WARP>\n__device__ __forceinline__ void fz_rows({kp}) {{"
    );
    let _ = writeln!(s, "    constexpr int W = {w};");
    let _ = writeln!(
        s,
        "    const u64 lane = WARP ? (threadIdx.x & 31u) : threadIdx.x;"
    );
    let _ = writeln!(s, "    const u64 group = WARP ? 32u : blockDim.x;");
    let _ = writeln!(s, "    const u64 first = WARP ? (u64)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5) : (u64)blockIdx.x;");
    let _ = writeln!(
        s,
        "    const u64 step = WARP ? (u64)gridDim.x * (blockDim.x >> 5) : (u64)gridDim.x;"
    );
    let _ = writeln!(
        s,
        "    const bool vec = {}{};",
        vector_condition(prog, per_element, true),
        if uses_col(prog) {
            " && cols <= 16777216ull"
        } else {
            ""
        }
    );
    scalar_loads(s, prog, "    ");
    for &k in wholes {
        if let Op::Reduce(r, _, _) = prog.ops[k] {
            let _ = writeln!(s, "    float a{k} = {};", combiner(r).1);
        }
    }
    let _ = writeln!(s, "    for (u64 row = first; row < rows; row += step) {{");
    for (i, x) in prog.inputs.iter().enumerate() {
        if x.class == Class::Col {
            let _ = writeln!(s, "        const float p{i} = to_f32(in{i}[row]);");
        }
    }
    for &k in reduces {
        let _ = writeln!(s, "        float r{k};");
    }
    let vec_call = Call {
        inputs: vector_values(prog, "p{i}"),
        col: "(cf + (float)k)",
    };
    let scalar_call = Call {
        inputs: element_values(prog, "row * cols + c", "row", "c")
            .into_iter()
            .enumerate()
            .map(|(i, v)| {
                if prog.inputs[i].class == Class::Col {
                    format!("p{i}")
                } else {
                    v
                }
            })
            .collect(),
        col: "(float)c",
    };
    let stages = Stages::new(prog);
    // Whether each row is read once (one pass, its reductions, and nothing per element, or
    // only the per-element pass): then its full inputs are loaded streaming; a row read again
    // keeps its lines in L2 for the later pass.
    let passes = (1..=prog.depth())
        .filter(|&l| !stages.at(l).is_empty())
        .count()
        + usize::from(per_element);
    let once = passes == 1;
    for level in 1..=prog.depth() {
        let mine = stages.at(level);
        if mine.is_empty() {
            continue;
        }
        let earlier = stages.before(level);
        let _ = writeln!(s, "        {{");
        for &k in &mine {
            if let Op::Reduce(r, _, _) = prog.ops[k] {
                let _ = writeln!(s, "            float a{k} = {};", combiner(r).1);
                if r == Reduce::ArgMax {
                    let _ = writeln!(s, "            u32 i{k} = FZ_NO_INDEX;");
                }
            }
        }
        let _ = writeln!(s, "            if (vec) {{");
        let stage_args = args(prog, &vec_call, &earlier, &mine);
        row_vector_loop(s, prog, "                ", once, &|s, pad| {
            let _ = writeln!(s, "#pragma unroll");
            let _ = writeln!(
                s,
                "{pad}for (int k = 0; k < W; ++k) fz_stage{level}({stage_args});"
            );
        });
        let _ = writeln!(s, "            }} else {{");
        let _ = writeln!(
            s,
            "                for (u64 c = lane; c < cols; c += group) fz_stage{level}({});",
            args(prog, &scalar_call, &earlier, &mine)
        );
        let _ = writeln!(s, "            }}");
        for &k in &mine {
            match prog.ops[k] {
                _ if stages.is_online_sum(k) => {}
                _ if stages.online_sum_of(k).is_some() => {
                    let sum = stages.online_sum_of(k).unwrap_or(k);
                    let _ = writeln!(
                        s,
                        "            fz_group_lse<WARP>(a{k}, a{sum}, cols); r{k} = a{k}; r{sum} = a{sum};"
                    );
                }
                Op::Reduce(Reduce::ArgMax, _, _) => {
                    let _ = writeln!(s, "            r{k} = fz_group_argmax<WARP>(a{k}, i{k});");
                }
                Op::Reduce(r, _, _) => {
                    let (op, id) = combiner(r);
                    let _ = writeln!(
                        s,
                        "            r{k} = fz_group_reduce<WARP>(a{k}, {op}, {id});"
                    );
                }
                _ => {}
            }
        }
        let _ = writeln!(s, "        }}");
    }
    if per_element {
        let _ = writeln!(s, "        if (vec) {{");
        let final_args = args(prog, &vec_call, reduces, &[]);
        row_vector_loop(s, prog, "            ", once, &|s, pad| {
            let _ = writeln!(s, "{pad}float y[W];");
            let _ = writeln!(s, "#pragma unroll");
            let _ = writeln!(
                s,
                "{pad}for (int k = 0; k < W; ++k) y[k] = fz_final({final_args});"
            );
            let _ = writeln!(
                s,
                "{pad}store_vec(out + row * cols + c, pack_vec<{ot}, W>(y), FZ_STREAM);"
            );
        });
        let _ = writeln!(s, "        }} else {{");
        let _ = writeln!(
            s,
            "            for (u64 c = lane; c < cols; c += group) out[row * cols + c] = from_f32<{ot}>(fz_final({}));",
            args(prog, &scalar_call, reduces, &[])
        );
        let _ = writeln!(s, "        }}");
    } else {
        // One value per row: nothing per element is left (the result's shape has one column).
        let call = Call {
            inputs: per_row_values(prog, "p{i}"),
            col: "0.0f",
        };
        if wholes.is_empty() {
            let _ = writeln!(
                s,
                "        if (lane == 0) out[row] = from_f32<{ot}>(fz_final({}));",
                args(prog, &call, reduces, &[])
            );
        } else {
            // Each row's values folded into the whole reductions by its group's first thread.
            let _ = writeln!(s, "        if (lane == 0) {{");
            for &k in wholes {
                if let Op::Reduce(r, _, _) = prog.ops[k] {
                    let _ = writeln!(
                        s,
                        "            a{k} = {}(a{k}, fz_rowval{k}({}));",
                        combiner(r).0,
                        args(prog, &call, reduces, &[])
                    );
                }
            }
            let _ = writeln!(s, "        }}");
        }
    }
    let _ = writeln!(s, "    }}");
    if !wholes.is_empty() {
        super::all::finish_whole(s, prog, ot, wholes);
    }
    let _ = writeln!(s, "}}");
    let names: Vec<String> = prog
        .inputs
        .iter()
        .enumerate()
        .map(|(i, _)| format!("in{i}"))
        .chain((0..prog.tables.len()).flat_map(|j| [format!("g{j}"), format!("gl{j}")]))
        .chain(["out".into()])
        .chain(
            (!wholes.is_empty())
                .then(|| ["partials".to_string(), "ticket".to_string()])
                .into_iter()
                .flatten(),
        )
        .chain(["rows".into(), "cols".into()])
        .chain((0..prog.consts.len()).map(|c| format!("c{c}")))
        .collect();
    let kernels: &[(&str, &str)] = match flavor {
        Flavor::RowsWarp => &[(KERNEL_ROWS_WARP, "true")],
        Flavor::RowsBlock => &[(KERNEL_ROWS_BLOCK, "false")],
        _ => &[(KERNEL_ROWS_WARP, "true"), (KERNEL_ROWS_BLOCK, "false")],
    };
    for &(name, warp) in kernels {
        let _ = writeln!(
            s,
            "extern \"C\" __global__ void __launch_bounds__({BLOCK}) {name}({kp}) {{ fz_rows<{warp}>({}); }}",
            names.join(", ")
        );
    }
}
