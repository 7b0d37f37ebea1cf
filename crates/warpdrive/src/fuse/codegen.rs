//! CUDA C for a program: one grid-stride kernel `fuse_map` that reads each input once and
//! writes the result once, the whole graph in f32 registers in between.
//!
//! Shape of the kernel (the hand-written `elementwise.cu` maps', generalized): each lane
//! takes `W` consecutive elements per access, `W` = 16 bytes of the widest type among the
//! inputs and the output (4 with an f32 anywhere, else 8), `U` vectors in flight per thread
//! (loads first, then the arithmetic), `__restrict__` pointers, `__launch_bounds__(256)`.
//! The vector path runs when every streamed pointer is 16-byte aligned and, with a row or
//! column broadcast, the row length is a multiple of `W` (then a vector never straddles two
//! rows); a scalar loop covers the rest and the tail. Constants are kernel parameters.

use std::fmt::Write;

use crate::dtype::DTypeKind;
use crate::ops::Activation;

use super::expr::{Binary, Unary};
use super::program::{Class, Op, Program};

/// Threads per block (the kernel's `__launch_bounds__`).
pub(crate) const BLOCK: u32 = 256;
/// The kernel's name in every generated module.
pub(crate) const KERNEL: &str = "fuse_map";

/// The architectures generated kernels are built for (as `elementwise.cu`).
const ARCHS: &str = "// archs: sm_75 sm_80 sm_90 sm_90a";

/// C type of a float kind.
fn ctype(k: DTypeKind) -> &'static str {
    match k {
        DTypeKind::F16 => "f16",
        DTypeKind::BF16 => "bf16",
        _ => "float",
    }
}

/// Elements per vector access: 16 bytes of the widest type.
pub(crate) fn width(prog: &Program<'_>, out: DTypeKind) -> u64 {
    let widest = prog
        .inputs
        .iter()
        .map(|i| i.kind.size())
        .chain([out.size()])
        .max()
        .unwrap_or(4)
        .max(1);
    16 / widest as u64
}

/// Vectors in flight per thread: fewer with more streamed inputs (bytes in flight and
/// registers stay about those of the hand-written map).
pub(crate) fn unroll(prog: &Program<'_>) -> u64 {
    let streamed = prog
        .inputs
        .iter()
        .filter(|i| matches!(i.class, Class::Full | Class::Row))
        .count();
    match streamed {
        0 | 1 => 4,
        2..=4 => 2,
        _ => 1,
    }
}

/// The kernel source (without the prelude and the `fuse.cu` fragment, which the kernel cache
/// prepends); `signature` goes in a comment.
pub(crate) fn source(prog: &Program<'_>, out: DTypeKind, signature: &str) -> String {
    let w = width(prog, out);
    let u = unroll(prog);
    let ot = ctype(out);
    let mut s = String::with_capacity(4096);
    let _ = writeln!(s, "{ARCHS}");
    let _ = writeln!(s, "// warpdrive fuse: {signature}");
    // The graph, once, as a function of one element's input values and the constants.
    let mut params: Vec<String> = (0..prog.inputs.len())
        .map(|i| format!("float x{i}"))
        .collect();
    params.extend((0..prog.consts.len()).map(|c| format!("float c{c}")));
    let _ = writeln!(
        s,
        "__device__ __forceinline__ float fz_expr({}) {{",
        params.join(", ")
    );
    for (k, op) in prog.ops.iter().enumerate() {
        let _ = writeln!(s, "    const float t{k} = {};", expr(op));
    }
    let _ = writeln!(s, "    return t{};\n}}", prog.ops.len().saturating_sub(1));

    // Kernel parameters: inputs, output, sizes, constants.
    let mut kparams: Vec<String> = prog
        .inputs
        .iter()
        .enumerate()
        .map(|(i, x)| format!("const {}* __restrict__ in{i}", ctype(x.kind)))
        .collect();
    kparams.push(format!("{ot}* __restrict__ out"));
    kparams.push("u64 n".into());
    kparams.push("u64 cols".into());
    kparams.extend((0..prog.consts.len()).map(|c| format!("float c{c}")));
    let consts: Vec<String> = (0..prog.consts.len()).map(|c| format!("c{c}")).collect();
    let _ = writeln!(
        s,
        "extern \"C\" __global__ void __launch_bounds__({BLOCK}) {KERNEL}({}) {{",
        kparams.join(", ")
    );
    let _ = writeln!(s, "    constexpr int W = {w};");
    let _ = writeln!(s, "    const u64 stride = (u64)gridDim.x * blockDim.x;");
    let _ = writeln!(
        s,
        "    const u64 tid = blockIdx.x * (u64)blockDim.x + threadIdx.x;"
    );
    let _ = writeln!(s, "    (void)cols;");
    // Broadcast scalars: loaded once.
    for (i, x) in prog.inputs.iter().enumerate() {
        if x.class == Class::Scalar {
            let _ = writeln!(s, "    const float s{i} = to_f32(in{i}[0]);");
        }
    }
    let mut conds: Vec<String> = prog
        .inputs
        .iter()
        .enumerate()
        .filter(|(_, x)| matches!(x.class, Class::Full | Class::Row))
        .map(|(i, _)| format!("aligned16(in{i})"))
        .collect();
    conds.push("aligned16(out)".into());
    if prog
        .inputs
        .iter()
        .any(|x| matches!(x.class, Class::Row | Class::Col))
    {
        conds.push("cols % W == 0".into());
    }
    let _ = writeln!(s, "    u64 head = 0;");
    let _ = writeln!(s, "    if ({}) {{", conds.join(" && "));
    let _ = writeln!(s, "        const u64 vecs = n / W;");
    let _ = writeln!(s, "        u64 i = tid;");
    let _ = writeln!(
        s,
        "        for (; i + {} * stride < vecs; i += {u} * stride) {{",
        u - 1
    );
    vector_body(&mut s, prog, ot, u, &consts);
    let _ = writeln!(s, "        }}");
    let _ = writeln!(s, "        for (; i < vecs; i += stride) {{");
    vector_body(&mut s, prog, ot, 1, &consts);
    let _ = writeln!(s, "        }}");
    let _ = writeln!(s, "        head = vecs * W;");
    let _ = writeln!(s, "    }}");
    // Scalar loop: unaligned pointers, rows not a multiple of W, and the tail.
    let args: Vec<String> = prog
        .inputs
        .iter()
        .enumerate()
        .map(|(i, x)| match x.class {
            Class::Full => format!("to_f32(in{i}[e])"),
            Class::Row => format!("to_f32(in{i}[e % cols])"),
            Class::Col => format!("to_f32(in{i}[e / cols])"),
            Class::Scalar => format!("s{i}"),
        })
        .chain(consts.iter().cloned())
        .collect();
    let _ = writeln!(
        s,
        "    for (u64 e = head + tid; e < n; e += stride) out[e] = from_f32<{ot}>(fz_expr({}));",
        args.join(", ")
    );
    let _ = writeln!(s, "}}");
    s
}

/// One iteration of the vector loop with `u` vectors per thread (`i`: the first vector's
/// index).
fn vector_body(s: &mut String, prog: &Program<'_>, ot: &str, u: u64, consts: &[String]) {
    let pad = "            ";
    let _ = writeln!(s, "{pad}u64 at[{u}];");
    let _ = writeln!(s, "#pragma unroll");
    let _ = writeln!(
        s,
        "{pad}for (int u = 0; u < {u}; ++u) at[u] = (i + u * stride) * W;"
    );
    // Loads first: every vector of every input in flight before any arithmetic.
    for (i, x) in prog.inputs.iter().enumerate() {
        let t = ctype(x.kind);
        match x.class {
            Class::Full => {
                let _ = writeln!(s, "{pad}Vec<{t}, W> v{i}[{u}];");
                let _ = writeln!(s, "#pragma unroll");
                let _ = writeln!(
                    s,
                    "{pad}for (int u = 0; u < {u}; ++u) v{i}[u] = load_vec<{t}, W>(in{i} + at[u]);"
                );
            }
            Class::Row => {
                let _ = writeln!(s, "{pad}Vec<{t}, W> v{i}[{u}];");
                let _ = writeln!(s, "#pragma unroll");
                let _ = writeln!(
                    s,
                    "{pad}for (int u = 0; u < {u}; ++u) v{i}[u] = load_vec<{t}, W>(in{i} + at[u] % cols);"
                );
            }
            Class::Col => {
                let _ = writeln!(s, "{pad}float r{i}[{u}];");
                let _ = writeln!(s, "#pragma unroll");
                let _ = writeln!(
                    s,
                    "{pad}for (int u = 0; u < {u}; ++u) r{i}[u] = to_f32(in{i}[at[u] / cols]);"
                );
            }
            Class::Scalar => {}
        }
    }
    let _ = writeln!(s, "#pragma unroll");
    let _ = writeln!(s, "{pad}for (int u = 0; u < {u}; ++u) {{");
    for (i, x) in prog.inputs.iter().enumerate() {
        if matches!(x.class, Class::Full | Class::Row) {
            let _ = writeln!(s, "{pad}    float a{i}[W];");
            let _ = writeln!(s, "{pad}    unpack_vec(v{i}[u], a{i});");
        }
    }
    let args: Vec<String> = prog
        .inputs
        .iter()
        .enumerate()
        .map(|(i, x)| match x.class {
            Class::Full | Class::Row => format!("a{i}[k]"),
            Class::Col => format!("r{i}[u]"),
            Class::Scalar => format!("s{i}"),
        })
        .chain(consts.iter().cloned())
        .collect();
    let _ = writeln!(s, "{pad}    float y[W];");
    let _ = writeln!(s, "#pragma unroll");
    let _ = writeln!(
        s,
        "{pad}    for (int k = 0; k < W; ++k) y[k] = fz_expr({});",
        args.join(", ")
    );
    let _ = writeln!(s, "{pad}    store_vec(out + at[u], pack_vec<{ot}, W>(y));");
    let _ = writeln!(s, "{pad}}}");
}

/// The C expression of one operation.
fn expr(op: &Op) -> String {
    match *op {
        Op::Input(i) => format!("x{i}"),
        Op::Const(c) => format!("c{c}"),
        Op::Unary(u, a) => {
            let a = format!("t{a}");
            match u {
                Unary::Neg => format!("-{a}"),
                Unary::Abs => format!("fabsf({a})"),
                Unary::Exp => format!("expf({a})"),
                Unary::Log => format!("logf({a})"),
                Unary::Sqrt => format!("sqrtf({a})"),
                Unary::Tanh => format!("tanhf({a})"),
                Unary::Sigmoid => format!("fz_sigmoid({a})"),
                Unary::Act(Activation::None) => a,
                Unary::Act(Activation::Silu) => format!("fz_silu({a})"),
                Unary::Act(Activation::GeluTanh) => format!("fz_gelu_tanh({a})"),
                Unary::Act(Activation::GeluErf) => format!("fz_gelu_erf({a})"),
                Unary::Cast(DTypeKind::F16) => format!("fz_round_f16({a})"),
                Unary::Cast(DTypeKind::BF16) => format!("fz_round_bf16({a})"),
                // Everything is f32 in registers already.
                Unary::Cast(_) => a,
            }
        }
        Op::Binary(b, x, y) => {
            let (x, y) = (format!("t{x}"), format!("t{y}"));
            match b {
                Binary::Add => format!("{x} + {y}"),
                Binary::Sub => format!("{x} - {y}"),
                Binary::Mul => format!("{x} * {y}"),
                Binary::Div => format!("{x} / {y}"),
                Binary::Max => format!("fz_max({x}, {y})"),
                Binary::Min => format!("fz_min({x}, {y})"),
                Binary::Lt => format!("fz_bool({x} < {y})"),
                Binary::Le => format!("fz_bool({x} <= {y})"),
                Binary::Gt => format!("fz_bool({x} > {y})"),
                Binary::Ge => format!("fz_bool({x} >= {y})"),
                Binary::Eq => format!("fz_bool({x} == {y})"),
                Binary::Ne => format!("fz_bool({x} != {y})"),
            }
        }
        Op::Fma(a, b, c) => format!("fmaf(t{a}, t{b}, t{c})"),
        Op::Select(c, a, b) => format!("fz_select(t{c}, t{a}, t{b})"),
    }
}
