//! CUDA C for a program: the graph once as device functions of one element's values, and
//! the kernel(s) of the program's mode around them.
//!
//! - `fz_final(...)`: the result from the inputs' values at an element, the column index, the
//!   constants and the reductions' results; `fz_stage<L>(...)`: the same for the operands of
//!   the level-`L` reductions, folded into their accumulators.
//! - Map mode, `fuse_map`: a grid-stride loop (the hand-written `elementwise.cu` maps',
//!   generalized): each lane takes `W` consecutive elements per access, `W` = 16 bytes of the
//!   widest type among the inputs and the output (4 with an f32 anywhere, else 8), `U`
//!   vectors in flight per thread (loads first, then the arithmetic).
//! - Rows mode, `fuse_rows_warp` (a warp per row, rows up to [`WARP_ROW_MAX`]) and
//!   `fuse_rows_block` (a block per row): per row, one pass over its elements per reduction
//!   level (a level's reductions share the pass), each ending in a warp or block reduction,
//!   then the result per element or per row.
//! - All mode, `fuse_all`: a grid-stride pass folding every reduction, block results into
//!   `partials`; the last block to finish (an atomic ticket) combines them in block order and
//!   writes `fz_final`, then resets the ticket.
//!
//! Vector paths run when every streamed pointer is 16-byte aligned and, with a row or column
//! broadcast (or per-row loops), the row length is a multiple of `W` (then a vector never
//! straddles two rows); scalar loops cover the rest. Every kernel has `__restrict__` pointers
//! and `__launch_bounds__(256)`; constants are kernel parameters.

use std::fmt::Write;

use crate::dtype::DTypeKind;
use crate::ops::Activation;

use super::expr::{Axis, Binary, Reduce, Unary};
use super::program::{Class, Mode, Op, Program};

/// Threads per block (every kernel's `__launch_bounds__`).
pub(crate) const BLOCK: u32 = 256;
/// The kernels' names.
pub(crate) const KERNEL_MAP: &str = "fuse_map";
pub(crate) const KERNEL_ROWS_WARP: &str = "fuse_rows_warp";
pub(crate) const KERNEL_ROWS_BLOCK: &str = "fuse_rows_block";
pub(crate) const KERNEL_ALL: &str = "fuse_all";
pub(crate) const KERNEL_FILTER: &str = "fuse_filter";
/// Vectors of `W` elements per thread in a filter's tile.
pub(crate) const FILTER_VECS: u64 = 2;
/// Rows at most this long get a warp each; longer ones a block.
pub(crate) const WARP_ROW_MAX: usize = 1024;

/// Which kernels a generated source holds beyond its mode's: the map kernel's block (a tuned
/// block size is its own source), or one of the two row kernels (a launch compiles only the
/// one it needs; `Both`, for showing and compile tests, holds both).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Flavor {
    /// Every kernel of the mode, the map kernel for blocks of [`BLOCK`].
    Both,
    /// The map kernel for blocks of this many threads.
    MapBlock(u32),
    /// Only `fuse_rows_warp`.
    RowsWarp,
    /// Only `fuse_rows_block`.
    RowsBlock,
}

impl Flavor {
    /// What the registry key adds to the signature (nothing for the default).
    pub(crate) fn key(self) -> String {
        match self {
            Flavor::Both => String::new(),
            Flavor::MapBlock(b) if b == BLOCK => String::new(),
            Flavor::MapBlock(b) => format!(";b:{b}"),
            Flavor::RowsWarp => ";rows:warp".into(),
            Flavor::RowsBlock => ";rows:block".into(),
        }
    }
}

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

/// Elements per vector access: 16 bytes of the widest type among the streamed inputs and the
/// output where it is written by vectors (a map's, a row result per element); a reduction's
/// or a filter's output does not narrow the loads.
pub(crate) fn width(prog: &Program<'_>, out: DTypeKind) -> u64 {
    let out_streamed = prog.roots.len() == 1
        && match prog.mode {
            Mode::Map => true,
            Mode::Rows => prog.shape.cols != 1,
            Mode::All => false,
        };
    let widest = prog
        .inputs
        .iter()
        .filter(|i| matches!(i.class, Class::Full | Class::Row))
        .map(|i| i.kind.size())
        .chain(out_streamed.then(|| out.size()))
        .max()
        .unwrap_or(4)
        .max(1);
    16 / widest as u64
}

/// Vectors in flight per thread in the map kernel: fewer with more streamed inputs (bytes in
/// flight and registers stay about those of the hand-written map).
pub(crate) fn unroll(prog: &Program<'_>) -> u64 {
    match streamed(prog).count() {
        0 | 1 => 4,
        2..=4 => 2,
        _ => 1,
    }
}

/// Inputs read per element (full or row class): loaded as vectors.
fn streamed<'p>(prog: &'p Program<'_>) -> impl Iterator<Item = usize> + 'p {
    prog.inputs
        .iter()
        .enumerate()
        .filter(|(_, x)| matches!(x.class, Class::Full | Class::Row))
        .map(|(i, _)| i)
}

/// The combining operation and identity of a reduction (argmax: its value's; its index
/// travels beside it, see `fz_arg_step`).
fn combiner(r: Reduce) -> (&'static str, &'static str) {
    match r {
        Reduce::Sum => ("FzSum()", "0.0f"),
        Reduce::Max => ("FzMax()", "fz_neg_inf()"),
        Reduce::Min => ("FzMin()", "fz_pos_inf()"),
        Reduce::ArgMax => ("", "fz_neg_inf()"),
    }
}

fn is_argmax(prog: &Program<'_>, k: usize) -> bool {
    matches!(prog.ops[k], Op::Reduce(Reduce::ArgMax, ..))
}

/// Where a function call finds its values: per input, the column index, then the constants
/// and reduction results by name.
struct Call<'s> {
    inputs: Vec<String>,
    col: &'s str,
}

/// The kernel source (without the prelude and the `fuse.cu` fragment, which the kernel cache
/// prepends); `signature` goes in a comment.
pub(crate) fn source(
    prog: &Program<'_>,
    out: DTypeKind,
    signature: &str,
    flavor: Flavor,
) -> String {
    let mut s = String::with_capacity(8192);
    let _ = writeln!(s, "{ARCHS}");
    let _ = writeln!(s, "// warpdrive fuse: {signature}");
    let root = prog.roots.first().copied().unwrap_or(0);
    let stages = Stages::new(prog);
    let all_reduces = stages.all();
    // fz_final: the result.
    let _ = writeln!(
        s,
        "__device__ __forceinline__ float fz_final({}) {{",
        params(prog, &all_reduces, &[]).join(", ")
    );
    statements(&mut s, prog, &prog.needed(&[root]));
    let _ = writeln!(s, "    return t{root};\n}}");
    // fz_stage<L>: the operands of the reductions of pass L into their accumulators.
    for level in 1..=prog.depth() {
        let mine = stages.at(level);
        if mine.is_empty() {
            continue;
        }
        let _ = writeln!(
            s,
            "__device__ __forceinline__ void fz_stage{level}({}) {{",
            params(prog, &stages.before(level), &mine).join(", ")
        );
        let operands: Vec<usize> = mine
            .iter()
            .filter(|&&k| !stages.is_online_sum(k))
            .map(|&k| operand(prog, k))
            .collect();
        statements(&mut s, prog, &prog.needed(&operands));
        for &k in &mine {
            match prog.ops[k] {
                _ if stages.is_online_sum(k) => {}
                Op::Reduce(Reduce::ArgMax, _, a) => {
                    let _ = writeln!(s, "    fz_arg_step(a{k}, i{k}, t{a}, (u32)ci);");
                }
                Op::Reduce(_, _, a) if stages.online_sum_of(k).is_some() => {
                    let sum = stages.online_sum_of(k).unwrap_or(k);
                    let _ = writeln!(s, "    fz_lse_step(a{k}, a{sum}, t{a});");
                }
                Op::Reduce(r, _, a) => {
                    let _ = writeln!(s, "    a{k} = {}(a{k}, t{a});", combiner(r).0);
                }
                _ => {}
            }
        }
        let _ = writeln!(s, "}}");
    }
    if let Some(&keep) = prog.roots.get(1) {
        // fz_keep: a filter's predicate.
        let _ = writeln!(
            s,
            "__device__ __forceinline__ float fz_keep({}) {{",
            params(prog, &[], &[]).join(", ")
        );
        statements(&mut s, prog, &prog.needed(&[keep]));
        let _ = writeln!(s, "    return t{keep};\n}}");
        filter_kernel(&mut s, prog, out);
        return s;
    }
    match prog.mode {
        Mode::Map => {
            let block = match flavor {
                Flavor::MapBlock(b) => b,
                _ => BLOCK,
            };
            map_kernel(&mut s, prog, out, block)
        }
        Mode::Rows => rows_kernel(&mut s, prog, out, &all_reduces, flavor),
        Mode::All => all_kernel(&mut s, prog, out, &all_reduces),
    }
    s
}

/// Which pass computes each reduction: its level, except that a row sum of `exp(a − max(a))`
/// joins the pass of that max (`max(a)` over the same operand): an online log-sum-exp
/// (`fz_lse_step`) gives both in one pass over the row, so a softmax's or a cross-entropy's
/// normalizer costs one read of the row, not two.
struct Stages {
    /// (max, sum) pairs computed online.
    online: Vec<(usize, usize)>,
    /// Reductions by pass (index = level).
    passes: Vec<Vec<usize>>,
}

impl Stages {
    fn new(prog: &Program<'_>) -> Stages {
        let mut online: Vec<(usize, usize)> = Vec::new();
        if prog.mode == Mode::Rows {
            for (k, op) in prog.ops.iter().enumerate() {
                let Op::Reduce(Reduce::Sum, Axis::Rows, e) = *op else {
                    continue;
                };
                let Op::Unary(Unary::Exp, d) = prog.ops[e] else {
                    continue;
                };
                let Op::Binary(Binary::Sub, a, m) = prog.ops[d] else {
                    continue;
                };
                if prog.ops[m] == Op::Reduce(Reduce::Max, Axis::Rows, a)
                    && !online.iter().any(|&(pm, _)| pm == m)
                {
                    online.push((m, k));
                }
            }
        }
        let mut passes = vec![Vec::new(); prog.depth() as usize + 1];
        for (k, op) in prog.ops.iter().enumerate() {
            if matches!(op, Op::Reduce(..)) {
                let level = match online.iter().find(|&&(_, sum)| sum == k) {
                    Some(&(max, _)) => prog.levels[max],
                    None => prog.levels[k],
                };
                if let Some(p) = passes.get_mut(level as usize) {
                    p.push(k);
                }
            }
        }
        Stages { online, passes }
    }

    /// The reductions of pass `level`.
    fn at(&self, level: u32) -> Vec<usize> {
        self.passes.get(level as usize).cloned().unwrap_or_default()
    }

    /// The reductions of the passes before `level`.
    fn before(&self, level: u32) -> Vec<usize> {
        self.passes
            .iter()
            .take(level as usize)
            .flatten()
            .copied()
            .collect()
    }

    /// Every reduction, pass by pass.
    fn all(&self) -> Vec<usize> {
        self.passes.iter().flatten().copied().collect()
    }

    fn is_online_sum(&self, k: usize) -> bool {
        self.online.iter().any(|&(_, sum)| sum == k)
    }

    /// The sum computed online with max `k`.
    fn online_sum_of(&self, k: usize) -> Option<usize> {
        self.online
            .iter()
            .find(|&&(max, _)| max == k)
            .map(|&(_, sum)| sum)
    }
}

fn operand(prog: &Program<'_>, k: usize) -> usize {
    match prog.ops[k] {
        Op::Reduce(_, _, a) => a,
        _ => k,
    }
}

/// Parameters of a graph function: inputs, column index, constants, reduction results
/// `results`, accumulators `accs` (by reference).
fn params(prog: &Program<'_>, results: &[usize], accs: &[usize]) -> Vec<String> {
    let mut p: Vec<String> = (0..prog.inputs.len())
        .map(|i| format!("float x{i}"))
        .collect();
    for (j, t) in prog.tables.iter().enumerate() {
        p.push(format!("const {}* __restrict__ g{j}", ctype(t.kind)));
        p.push(format!("u64 gl{j}"));
    }
    p.push("float ci".into());
    p.extend((0..prog.consts.len()).map(|c| format!("float c{c}")));
    p.extend(results.iter().map(|k| format!("float r{k}")));
    for &k in accs {
        p.push(format!("float& a{k}"));
        if is_argmax(prog, k) {
            p.push(format!("u32& i{k}"));
        }
    }
    p
}

/// Arguments matching [`params`].
fn args(prog: &Program<'_>, call: &Call<'_>, results: &[usize], accs: &[usize]) -> String {
    let mut a = call.inputs.clone();
    for j in 0..prog.tables.len() {
        a.push(format!("g{j}"));
        a.push(format!("gl{j}"));
    }
    a.push(call.col.to_string());
    a.extend((0..prog.consts.len()).map(|c| format!("c{c}")));
    a.extend(results.iter().map(|k| format!("r{k}")));
    for &k in accs {
        a.push(format!("a{k}"));
        if is_argmax(prog, k) {
            a.push(format!("i{k}"));
        }
    }
    a.join(", ")
}

fn statements(s: &mut String, prog: &Program<'_>, need: &[bool]) {
    for (k, op) in prog.ops.iter().enumerate() {
        if need[k] {
            let _ = writeln!(s, "    const float t{k} = {};", expr(op, k));
        }
    }
}

/// Kernel parameters: inputs, output, then `middle`, then the constants.
fn kernel_params(prog: &Program<'_>, out: DTypeKind, middle: &[&str]) -> String {
    let mut p: Vec<String> = prog
        .inputs
        .iter()
        .enumerate()
        .map(|(i, x)| format!("const {}* __restrict__ in{i}", ctype(x.kind)))
        .collect();
    for (j, t) in prog.tables.iter().enumerate() {
        p.push(format!("const {}* __restrict__ g{j}", ctype(t.kind)));
        p.push(format!("u64 gl{j}"));
    }
    p.push(format!("{}* __restrict__ out", ctype(out)));
    p.extend(middle.iter().map(|m| m.to_string()));
    p.extend((0..prog.consts.len()).map(|c| format!("float c{c}")));
    p.join(", ")
}

/// `const float s<i>` for the scalar inputs (loaded once).
fn scalar_loads(s: &mut String, prog: &Program<'_>, pad: &str) {
    for (i, x) in prog.inputs.iter().enumerate() {
        if x.class == Class::Scalar {
            let _ = writeln!(s, "{pad}const float s{i} = to_f32(in{i}[0]);");
        }
    }
}

/// The vector-path condition: streamed pointers (and `out` when written per element)
/// aligned, rows a multiple of `W` when indexed per row.
fn vector_condition(prog: &Program<'_>, out_streamed: bool, per_row: bool) -> String {
    let mut conds: Vec<String> = streamed(prog)
        .map(|i| format!("aligned16(in{i})"))
        .collect();
    if out_streamed {
        conds.push("aligned16(out)".into());
    }
    if per_row
        || prog
            .inputs
            .iter()
            .any(|x| matches!(x.class, Class::Row | Class::Col))
    {
        conds.push("cols % W == 0".into());
    }
    if conds.is_empty() {
        "true".into()
    } else {
        conds.join(" && ")
    }
}

/// The map kernel with `__launch_bounds__(block)` (the block it is launched with).
fn map_kernel(s: &mut String, prog: &Program<'_>, out: DTypeKind, block: u32) {
    let w = width(prog, out);
    let u = unroll(prog);
    let ot = ctype(out);
    let _ = writeln!(
        s,
        "extern \"C\" __global__ void __launch_bounds__({block}) {KERNEL_MAP}({}) {{",
        kernel_params(prog, out, &["u64 n", "u64 cols"])
    );
    let _ = writeln!(s, "    constexpr int W = {w};");
    let _ = writeln!(s, "    const u64 stride = (u64)gridDim.x * blockDim.x;");
    let _ = writeln!(
        s,
        "    const u64 tid = blockIdx.x * (u64)blockDim.x + threadIdx.x;"
    );
    let _ = writeln!(s, "    (void)cols;");
    scalar_loads(s, prog, "    ");
    let _ = writeln!(s, "    u64 head = 0;");
    let _ = writeln!(s, "    if ({}) {{", vector_condition(prog, true, false));
    let _ = writeln!(s, "        const u64 vecs = n / W;");
    let _ = writeln!(s, "        u64 i = tid;");
    let _ = writeln!(
        s,
        "        for (; i + {} * stride < vecs; i += {u} * stride) {{",
        u - 1
    );
    map_vector_body(s, prog, ot, u);
    let _ = writeln!(s, "        }}");
    let _ = writeln!(s, "        for (; i < vecs; i += stride) {{");
    map_vector_body(s, prog, ot, 1);
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

/// Scalar loads of every input at element `full` (row `row`, column `col`).
fn element_values(prog: &Program<'_>, full: &str, row: &str, col: &str) -> Vec<String> {
    prog.inputs
        .iter()
        .enumerate()
        .map(|(i, x)| match x.class {
            Class::Full => format!("to_f32(in{i}[{full}])"),
            Class::Row => format!("to_f32(in{i}[{col}])"),
            Class::Col => format!("to_f32(in{i}[{row}])"),
            Class::Scalar => format!("s{i}"),
        })
        .collect()
}

/// One iteration of the map kernel's vector loop with `u` vectors per thread (`i`: the first
/// vector's index).
fn map_vector_body(s: &mut String, prog: &Program<'_>, ot: &str, u: u64) {
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
        let load = match x.class {
            Class::Full => format!("v{i}[u] = load_vec<{t}, W>(in{i} + at[u])"),
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
    let _ = writeln!(s, "{pad}    store_vec(out + at[u], pack_vec<{ot}, W>(y));");
    let _ = writeln!(s, "{pad}}}");
}

/// Values of every input inside a vector loop: element `k` of the unpacked vectors `f<i>`,
/// `col` (with `{i}` for the input's index) for column inputs, `s<i>` for scalars.
fn vector_values(prog: &Program<'_>, col: &str) -> Vec<String> {
    prog.inputs
        .iter()
        .enumerate()
        .map(|(i, x)| match x.class {
            Class::Full | Class::Row => format!("f{i}[k]"),
            Class::Col => col.replace("{i}", &i.to_string()),
            Class::Scalar => format!("s{i}"),
        })
        .collect()
}

/// Vector loads of the streamed inputs at column `c` of row `row` (rows mode), unpacked into
/// `f<i>`.
fn row_vector_loads(s: &mut String, prog: &Program<'_>, pad: &str) {
    for i in streamed(prog) {
        let x = &prog.inputs[i];
        let t = ctype(x.kind);
        let at = if x.class == Class::Full {
            "row * cols + c"
        } else {
            "c"
        };
        let _ = writeln!(s, "{pad}float f{i}[W];");
        let _ = writeln!(s, "{pad}unpack_vec(load_vec<{t}, W>(in{i} + {at}), f{i});");
    }
}

fn rows_kernel(
    s: &mut String,
    prog: &Program<'_>,
    out: DTypeKind,
    reduces: &[usize],
    flavor: Flavor,
) {
    let w = width(prog, out);
    let ot = ctype(out);
    let per_element = prog.shape.cols != 1;
    let kp = kernel_params(prog, out, &["u64 rows", "u64 cols"]);
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
        "    const bool vec = {};",
        vector_condition(prog, per_element, true)
    );
    scalar_loads(s, prog, "    ");
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
        col: "(float)(c + k)",
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
        let _ = writeln!(
            s,
            "                for (u64 c = lane * W; c < cols; c += group * W) {{"
        );
        row_vector_loads(s, prog, "                    ");
        let _ = writeln!(s, "#pragma unroll");
        let _ = writeln!(
            s,
            "                    for (int k = 0; k < W; ++k) fz_stage{level}({});",
            args(prog, &vec_call, &earlier, &mine)
        );
        let _ = writeln!(s, "                }}");
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
        let _ = writeln!(
            s,
            "            for (u64 c = lane * W; c < cols; c += group * W) {{"
        );
        row_vector_loads(s, prog, "                ");
        let _ = writeln!(s, "                float y[W];");
        let _ = writeln!(s, "#pragma unroll");
        let _ = writeln!(
            s,
            "                for (int k = 0; k < W; ++k) y[k] = fz_final({});",
            args(prog, &vec_call, reduces, &[])
        );
        let _ = writeln!(
            s,
            "                store_vec(out + row * cols + c, pack_vec<{ot}, W>(y));"
        );
        let _ = writeln!(s, "            }}");
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
        let _ = writeln!(
            s,
            "        if (lane == 0) out[row] = from_f32<{ot}>(fz_final({}));",
            args(prog, &call, reduces, &[])
        );
    }
    let _ = writeln!(s, "    }}\n}}");
    let names: Vec<String> = prog
        .inputs
        .iter()
        .enumerate()
        .map(|(i, _)| format!("in{i}"))
        .chain((0..prog.tables.len()).flat_map(|j| [format!("g{j}"), format!("gl{j}")]))
        .chain(["out".into(), "rows".into(), "cols".into()])
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

/// Input values where nothing varies per element: `col` for column inputs (with `{i}`),
/// scalars, and 0 for the rest (the graph's result does not read them there).
fn per_row_values(prog: &Program<'_>, col: &str) -> Vec<String> {
    prog.inputs
        .iter()
        .enumerate()
        .map(|(i, x)| match x.class {
            Class::Col => col.replace("{i}", &i.to_string()),
            Class::Scalar => format!("s{i}"),
            _ => "0.0f".into(),
        })
        .collect()
}

fn all_kernel(s: &mut String, prog: &Program<'_>, out: DTypeKind, reduces: &[usize]) {
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
    let _ = writeln!(s, "    }}\n}}");
}

/// A filter (stream compaction) in one pass: each block takes the next tile of
/// `256 · FILTER_VECS · W` elements (a dynamic tile number, so every tile it waits on belongs
/// to a block already running), evaluates value and predicate per element, scans its keep
/// counts, and finds the tile's offset by a decoupled look-back over the tiles before it
/// (`tiles[t]`: a count with a flag, aggregate or inclusive prefix, in one 64-bit word); the
/// last tile writes the total into `count`.
fn filter_kernel(s: &mut String, prog: &Program<'_>, out: DTypeKind) {
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
    let _ = writeln!(s, "    if (threadIdx.x == 0) {{");
    let _ = writeln!(s, "        volatile u64* state = (volatile u64*)tiles;");
    let _ = writeln!(s, "        u64 prefix = 0;");
    let _ = writeln!(s, "        if (tile != 0) {{");
    let _ = writeln!(s, "            state[tile] = AGG | total;");
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
    let _ = writeln!(s, "    u64 at = prefix_s + before;");
    let _ = writeln!(s, "#pragma unroll");
    let _ = writeln!(
        s,
        "    for (int j = 0; j < V * W; ++j) if (keep[j]) out[at++] = from_f32<{ot}>(val[j]);"
    );
    let _ = writeln!(s, "}}");
}

/// The C expression of operation `k`.
fn expr(op: &Op, k: usize) -> String {
    match *op {
        Op::Input(i) => format!("x{i}"),
        Op::Const(c) => format!("c{c}"),
        Op::ColIndex => "ci".into(),
        Op::Reduce(..) => format!("r{k}"),
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
        Op::Gather(g, a) => format!("fz_gather(g{g}, gl{g}, t{a})"),
        Op::Fma(a, b, c) => format!("fmaf(t{a}, t{b}, t{c})"),
        Op::Select(c, a, b) => format!("fz_select(t{c}, t{a}, t{b})"),
    }
}
