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

mod all;
mod filter;
mod map;
mod rows;

use all::all_kernel;
use filter::filter_kernel;
use map::map_kernel;
use rows::rows_kernel;

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

/// The map kernel's launch shape, what a tuning chooses: threads a block and bytes a vector
/// access (16, or 8 where every streamed array has one element size: on an H100 a 2-in 1-out
/// f32 map moved 3.00 TB/s on 8-byte vectors, 512 threads, against 2.95 on 16-byte ones).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct MapShape {
    pub block: u32,
    pub vector_bytes: u32,
    /// Full inputs and the output loaded and stored without the streaming cache hint (plain
    /// `ld.global` / `st.global`, as torch.compile's kernels do) instead of `.cs`: where our
    /// output sat at the start of an allocation the hinted kernel ran 1-3 % slower and
    /// torch's did not (bench/NOTES.md, "where the f32 chains' last 2-3 % go").
    pub plain: bool,
}

impl MapShape {
    /// 256 threads, 16-byte vectors, streaming hints.
    pub const DEFAULT: MapShape = MapShape {
        block: BLOCK,
        vector_bytes: 16,
        plain: false,
    };
}

/// `256` for 16-byte vectors (as tuned winners were written before 8-byte ones existed),
/// `512x8` otherwise; a `p` after either without the streaming hints (`256x8p`).
impl std::fmt::Display for MapShape {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.vector_bytes == 16 && !self.plain {
            write!(f, "{}", self.block)
        } else {
            write!(f, "{}x{}", self.block, self.vector_bytes)?;
            if self.plain {
                write!(f, "p")?;
            }
            Ok(())
        }
    }
}

impl std::str::FromStr for MapShape {
    type Err = String;
    fn from_str(s: &str) -> Result<MapShape, String> {
        let (body, plain) = match s.strip_suffix('p') {
            Some(b) => (b, true),
            None => (s, false),
        };
        let (block, bytes) = body.split_once('x').unwrap_or((body, "16"));
        let block = block.parse().map_err(|_| format!("a map shape {s:?}"))?;
        let vector_bytes = bytes.parse().map_err(|_| format!("a map shape {s:?}"))?;
        Ok(MapShape {
            block,
            vector_bytes,
            plain,
        })
    }
}

/// How a map kernel meets the kernel before it on the stream (a GEMM whose product it reads:
/// `fuse::matmul_epilogue`'s epilogue). The default is a plain launch in chunk order.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Schedule {
    /// Chunks in reverse order (the block dispatched first takes the last chunk): right after
    /// a GEMM, the rows of the product it wrote last are the ones still in L2.
    pub reverse: bool,
    /// A programmatic dependent launch (compute capability 9.0 and later; a plain launch
    /// before): the kernel's blocks start as the previous kernel's drain, and every block
    /// waits (`griddepcontrol.wait`) for that kernel to finish before its first load.
    pub programmatic: bool,
    /// With `programmatic`: before the wait, each block prefetches its chunk of every
    /// streamed input into L2 (a prefetch moves no data into the SM and L2 is where every
    /// write lands, so it is safe even for what the previous kernel is still writing).
    pub prefetch: bool,
}

impl Schedule {
    /// What the registry key adds for this schedule (nothing for the default).
    fn key(self) -> String {
        if self == Schedule::default() {
            return String::new();
        }
        let flag = |on: bool, c: char| if on { c } else { '-' };
        format!(
            ";s:{}{}{}",
            flag(self.reverse, 'r'),
            flag(self.programmatic, 'p'),
            flag(self.prefetch, 'f')
        )
    }
}

/// Which kernels a generated source holds beyond its mode's: the map kernel's shape and
/// schedule (a tuned shape is its own source), or one of the two row kernels (a launch
/// compiles only the one it needs; `Both`, for showing and compile tests, holds both).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Flavor {
    /// Every kernel of the mode, the map kernel in [`MapShape::DEFAULT`].
    Both,
    /// The map kernel in this shape and schedule.
    Map(MapShape, Schedule),
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
            Flavor::Map(m, s) if m == MapShape::DEFAULT => s.key(),
            Flavor::Map(m, s) => format!(";b:{m}{}", s.key()),
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
    16 / widest(prog, out)
}

/// Elements per vector access of the map kernel in `shape`.
pub(crate) fn map_width(prog: &Program<'_>, out: DTypeKind, shape: MapShape) -> u64 {
    (shape.vector_bytes as u64 / widest(prog, out)).max(1)
}

/// Vectors in flight per thread of the map kernel in `shape`: one on 8-byte vectors (the
/// shape that wins there has more threads instead), else [`unroll`].
pub(crate) fn map_unroll(prog: &Program<'_>, shape: MapShape) -> u64 {
    if shape.vector_bytes < 16 {
        1
    } else {
        unroll(prog)
    }
}

/// Whether every streamed input and the map's output have one element size: the map kernel
/// may then use 8-byte vectors (each array's vector is exactly 8 bytes).
pub(crate) fn one_element_size(prog: &Program<'_>, out: DTypeKind) -> bool {
    prog.inputs
        .iter()
        .filter(|i| matches!(i.class, Class::Full | Class::Row))
        .all(|i| i.kind.size() == out.size())
}

/// The widest element (bytes) among the streamed inputs and the output where written by
/// vectors.
fn widest(prog: &Program<'_>, out: DTypeKind) -> u64 {
    let out_streamed = prog.roots.len() == 1
        && match prog.mode {
            Mode::Map => true,
            Mode::Rows => prog.shape.cols != 1,
            Mode::All | Mode::RowsAll => false,
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
    widest as u64
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
    // A row program's whole reductions: the result reads only them.
    let wholes = wholes_of_rows(prog);
    let final_results = if prog.mode == Mode::RowsAll {
        &wholes
    } else {
        &all_reduces
    };
    // fz_final: the result.
    let _ = writeln!(
        s,
        "__device__ __forceinline__ float fz_final({}) {{",
        params(prog, final_results, &[]).join(", ")
    );
    statements(&mut s, prog, &prog.needed(&[root]));
    let _ = writeln!(s, "    return t{root};\n}}");
    // fz_rowval<k>: a row's value for whole reduction k, from the row's reductions.
    for &k in &wholes {
        let a = operand(prog, k);
        let _ = writeln!(
            s,
            "__device__ __forceinline__ float fz_rowval{k}({}) {{",
            params(prog, &all_reduces, &[]).join(", ")
        );
        statements(&mut s, prog, &prog.needed(&[a]));
        let _ = writeln!(s, "    return t{a};\n}}");
    }
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
            let (shape, schedule) = match flavor {
                Flavor::Map(m, s) => (m, s),
                _ => (MapShape::DEFAULT, Schedule::default()),
            };
            map_kernel(&mut s, prog, out, shape, schedule)
        }
        Mode::Rows | Mode::RowsAll => rows_kernel(&mut s, prog, out, &all_reduces, &wholes, flavor),
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
        if matches!(prog.mode, Mode::Rows | Mode::RowsAll) {
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
            // A row program's whole reductions fold each row's value, outside the passes.
            let whole_of_rows =
                prog.mode == Mode::RowsAll && matches!(op, Op::Reduce(_, Axis::All, _));
            if matches!(op, Op::Reduce(..)) && !whole_of_rows {
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

/// The whole reductions of a row program (none in the other modes).
fn wholes_of_rows(prog: &Program<'_>) -> Vec<usize> {
    if prog.mode != Mode::RowsAll {
        return Vec::new();
    }
    (0..prog.ops.len())
        .filter(|&k| matches!(prog.ops[k], Op::Reduce(_, Axis::All, _)))
        .collect()
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
