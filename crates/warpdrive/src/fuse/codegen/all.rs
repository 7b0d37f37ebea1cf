//! The whole-reduction kernel, `fuse_all`: a grid-stride pass folding every reduction, block
//! results into `partials`; the last block to finish (an atomic ticket) combines them in
//! block order, writes the scalar epilogue, and resets the ticket.

use std::fmt::Write;

use crate::dtype::DTypeKind;

use super::super::program::{Class, Op, Program};
use super::*;

pub(super) fn all_kernel(s: &mut String, prog: &Program<'_>, out: DTypeKind, reduces: &[usize]) {
    let w = width(prog, out);
    let ot = ctype(out);
    let _ = writeln!(
        s,
        "extern \"C\" __global__ void __launch_bounds__({BLOCK}) {KERNEL_ALL}({}) {{",
        kernel_params(
            prog,
            out,
            &["float* partials", "u32* ticket", "u64 n", "u64 cols"]
        )
    );
    let _ = writeln!(s, "    constexpr int W = {w};");
    let _ = writeln!(s, "    const u64 stride = (u64)gridDim.x * blockDim.x;");
    let _ = writeln!(
        s,
        "    const u64 tid = blockIdx.x * (u64)blockDim.x + threadIdx.x;"
    );
    let _ = writeln!(s, "    (void)cols;");
    scalar_loads(s, prog, "    ");
    for &k in reduces {
        if let Op::Reduce(r, _, _) = prog.ops[k] {
            let _ = writeln!(s, "    float a{k} = {};", combiner(r).1);
        }
    }
    let _ = writeln!(s, "    u64 head = 0;");
    let _ = writeln!(s, "    if ({}) {{", vector_condition(prog, false, false));
    let _ = writeln!(s, "        const u64 vecs = n / W;");
    let _ = writeln!(s, "        for (u64 i = tid; i < vecs; i += stride) {{");
    let _ = writeln!(s, "            const u64 e0 = i * W;");
    for (i, x) in prog.inputs.iter().enumerate() {
        let t = ctype(x.kind);
        match x.class {
            Class::Full => {
                let _ = writeln!(s, "            float f{i}[W];");
                let _ = writeln!(
                    s,
                    "            unpack_vec(load_vec<{t}, W>(in{i} + e0), f{i});"
                );
            }
            Class::Row => {
                let _ = writeln!(s, "            float f{i}[W];");
                let _ = writeln!(
                    s,
                    "            unpack_vec(load_vec<{t}, W>(in{i} + e0 % cols), f{i});"
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
    let _ = writeln!(s, "#pragma unroll");
    let _ = writeln!(
        s,
        "            for (int k = 0; k < W; ++k) fz_stage1({});",
        args(prog, &call, &[], reduces)
    );
    let _ = writeln!(s, "        }}");
    let _ = writeln!(s, "        head = vecs * W;");
    let _ = writeln!(s, "    }}");
    let call = Call {
        inputs: element_values(prog, "e", "e / cols", "e % cols"),
        col: "(float)(e % cols)",
    };
    let _ = writeln!(
        s,
        "    for (u64 e = head + tid; e < n; e += stride) fz_stage1({});",
        args(prog, &call, &[], reduces)
    );
    finish_whole(s, prog, ot, reduces);
    let _ = writeln!(s, "}}");
}

/// The end of a kernel folding whole reductions (accumulators `a<k>` in every thread, the
/// identity where a thread folded nothing): each block's results into `partials`, then the
/// last block to take the ticket combines them in block order, writes `fz_final` (which reads
/// only these reductions' results and scalars) into `out[0]` and resets the ticket.
pub(super) fn finish_whole(s: &mut String, prog: &Program<'_>, ot: &str, reduces: &[usize]) {
    // Each block's results, then the last block combines them in block order.
    for (j, &k) in reduces.iter().enumerate() {
        if let Op::Reduce(r, _, _) = prog.ops[k] {
            let (op, id) = combiner(r);
            let _ = writeln!(s, "    {{ const float b = block_allreduce(a{k}, {op}, {id}); if (threadIdx.x == 0) partials[{j}u * gridDim.x + blockIdx.x] = b; }}");
        }
    }
    let _ = writeln!(s, "    __shared__ bool last;");
    let _ = writeln!(s, "    __threadfence();");
    let _ = writeln!(
        s,
        "    if (threadIdx.x == 0) last = atomicAdd(ticket, 1u) == gridDim.x - 1;"
    );
    let _ = writeln!(s, "    __syncthreads();");
    let _ = writeln!(s, "    if (!last) return;");
    let _ = writeln!(s, "    __threadfence();");
    for (j, &k) in reduces.iter().enumerate() {
        if let Op::Reduce(r, _, _) = prog.ops[k] {
            let (op, id) = combiner(r);
            let _ = writeln!(s, "    float q{k} = {id};");
            let _ = writeln!(s, "    for (u32 b = threadIdx.x; b < gridDim.x; b += blockDim.x) q{k} = {op}(q{k}, fz_load_volatile(partials + {j}u * gridDim.x + b));");
            let _ = writeln!(
                s,
                "    const float r{k} = block_allreduce(q{k}, {op}, {id});"
            );
        }
    }
    let call = Call {
        inputs: per_row_values(prog, "0.0f"),
        col: "0.0f",
    };
    let _ = writeln!(s, "    if (threadIdx.x == 0) {{");
    let _ = writeln!(
        s,
        "        out[0] = from_f32<{ot}>(fz_final({}));",
        args(prog, &call, reduces, &[])
    );
    let _ = writeln!(s, "        *ticket = 0u;");
    let _ = writeln!(s, "    }}");
}
