//! An expression graph flattened into a program: its inputs (each buffer once per way it is
//! seen), its constants, and its operations in dependency order, each computed once, with
//! their shapes and reduction levels. Both backends run programs; its
//! [`signature`](Program::signature) is the structural key of the compiled kernel (types,
//! broadcasts and operations, not addresses, sizes or constant values, which are kernel
//! parameters).
//!
//! A program runs in one of three [`Mode`]s, by its reductions:
//! - [`Mode::Map`]: none; one pass over the result's elements.
//! - [`Mode::Rows`]: row reductions (nested ones too) and no whole ones; the kernel walks each
//!   row once per level of reduction, then writes the row's result (per element or per row).
//! - [`Mode::All`]: whole reductions of operands without reductions, all of one shape, and
//!   scalar arithmetic on their results; one pass, then the last block combines.
//! - [`Mode::RowsAll`]: a row program whose per-row values (`[rows, 1]`) feed whole
//!   reductions, then scalar arithmetic (a batch's mean loss): the row kernel, each row's
//!   value folded into the whole reductions, the last block combining.

use std::collections::HashMap;
use std::fmt::Write;

use crate::dtype::DTypeKind;
use crate::error::{Error, Result};
use crate::ops::Activation;

use super::expr::{unsupported, Axis, Binary, Expr, Node, Operand, Reduce, Shape, Unary};

/// How an input is indexed for element `(row, col)` of the program's space `[rows, cols]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum Class {
    /// The space's own shape: element `row · cols + col`.
    Full,
    /// One row, broadcast along rows: element `col`.
    Row,
    /// One column, broadcast along columns: element `row`.
    Col,
    /// One value: element 0.
    Scalar,
}

impl Class {
    fn of(input: Shape, space: Shape) -> Class {
        if input == space {
            Class::Full
        } else if input.rows == 1 && input.cols == 1 {
            Class::Scalar
        } else if input.rows == 1 {
            Class::Row
        } else {
            Class::Col
        }
    }

    fn code(self) -> char {
        match self {
            Class::Full => 'F',
            Class::Row => 'R',
            Class::Col => 'C',
            Class::Scalar => 'S',
        }
    }

    /// Elements of the input the kernel reads for a space of `shape`.
    pub(crate) fn reads(self, shape: Shape) -> usize {
        match self {
            Class::Full => shape.rows.saturating_mul(shape.cols),
            Class::Row => shape.cols,
            Class::Col => shape.rows,
            Class::Scalar => 1,
        }
    }
}

/// A buffer read at computed indices (a gather's table).
pub(crate) struct Table<'a> {
    pub(crate) buf: &'a dyn Operand,
    pub(crate) kind: DTypeKind,
}

pub(crate) struct Input<'a> {
    pub(crate) buf: &'a dyn Operand,
    pub(crate) kind: DTypeKind,
    /// The shape the graph sees it with.
    pub(crate) shape: Shape,
    pub(crate) class: Class,
}

/// One operation; operands are indices of earlier operations.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) enum Op {
    Input(usize),
    Const(usize),
    ColIndex,
    Unary(Unary, usize),
    Binary(Binary, usize, usize),
    Fma(usize, usize, usize),
    Select(usize, usize, usize),
    Reduce(Reduce, Axis, usize),
    /// `tables[t][operand]`.
    Gather(usize, usize),
}

impl Op {
    pub(crate) fn operands(&self) -> Vec<usize> {
        match *self {
            Op::Input(_) | Op::Const(_) | Op::ColIndex => Vec::new(),
            Op::Unary(_, a) | Op::Reduce(_, _, a) | Op::Gather(_, a) => vec![a],
            Op::Binary(_, a, b) => vec![a, b],
            Op::Fma(a, b, c) | Op::Select(a, b, c) => vec![a, b, c],
        }
    }
}

/// How a program runs (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Mode {
    Map,
    Rows,
    All,
    /// A row program whose per-row results feed whole reductions (then scalars).
    RowsAll,
}

pub(crate) struct Program<'a> {
    /// The result's shape.
    pub(crate) shape: Shape,
    /// The index space the kernel walks: the result's shape (map), `[rows, reduced cols]`
    /// (rows), the reductions' operand shape (all).
    pub(crate) space: Shape,
    pub(crate) mode: Mode,
    pub(crate) inputs: Vec<Input<'a>>,
    /// Gathers' tables, each buffer once.
    pub(crate) tables: Vec<Table<'a>>,
    pub(crate) consts: Vec<f32>,
    /// In dependency order.
    pub(crate) ops: Vec<Op>,
    /// The results: the value, and for a filter the predicate.
    pub(crate) roots: Vec<usize>,
    /// Each operation's shape.
    pub(crate) shapes: Vec<Shape>,
    /// Each operation's reduction level: 0 without a reduction below it, else one more than
    /// the highest level among the reductions it depends on (a reduction's own level is its
    /// operand's plus one).
    pub(crate) levels: Vec<u32>,
}

/// Operations in one fused kernel at most (a larger graph is an error, not a slow compile).
pub const MAX_OPS: usize = 4096;

impl<'a> Program<'a> {
    /// Flattens `root` (iteratively: a long chain does not grow the call stack).
    pub(crate) fn new(root: &Expr<'a>) -> Result<Program<'a>> {
        Program::with_roots(&[root])
    }

    /// Flattens several results over one space (their broadcast shape): a filter's value and
    /// predicate.
    pub(crate) fn with_roots(roots: &[&Expr<'a>]) -> Result<Program<'a>> {
        let mut shape = Shape::new(1, 1);
        let mut shapes = Vec::with_capacity(roots.len());
        for r in roots {
            let s = r.shape()?;
            shapes.push(s.to_string());
            shape = shape.broadcast(s).ok_or_else(|| {
                Error::InvalidArgument(format!(
                    "fuse: results of shapes {} do not broadcast",
                    shapes.join(" and ")
                ))
            })?;
        }
        if roots.len() > 1 && roots.iter().any(|r| r.has_reduction()) {
            return Err(Error::Unsupported(
                "fuse: a filter of an expression that holds a reduction".into(),
            ));
        }
        shape.elements().ok_or_else(|| {
            Error::InvalidArgument(format!("fuse: shape {shape} has more elements than usize"))
        })?;
        let mut prog = Program {
            shape,
            space: shape,
            mode: Mode::Map,
            inputs: Vec::new(),
            tables: Vec::new(),
            consts: Vec::new(),
            ops: Vec::new(),
            roots: Vec::new(),
            shapes: Vec::new(),
            levels: Vec::new(),
        };
        let mut done: HashMap<usize, usize> = HashMap::new();
        // (buffer address, shape) -> input slot: a buffer seen the same way is loaded once.
        let mut slots: HashMap<(usize, Shape), usize> = HashMap::new();
        let mut stack: Vec<(&Expr<'a>, bool)> = roots.iter().rev().map(|r| (*r, false)).collect();
        while let Some((e, expanded)) = stack.pop() {
            if done.contains_key(&e.id()) {
                continue;
            }
            if !expanded {
                stack.push((e, true));
                for c in children(e).into_iter().rev() {
                    if !done.contains_key(&c.id()) {
                        stack.push((c, false));
                    }
                }
                continue;
            }
            if prog.ops.len() >= MAX_OPS {
                return Err(Error::InvalidArgument(format!(
                    "fuse: the graph has more than {MAX_OPS} operations"
                )));
            }
            let at = |c: &Expr<'a>| done.get(&c.id()).copied().ok_or_else(internal);
            let op = match e.node() {
                Node::Input(buf, s) => {
                    let kind = buf.kind();
                    if !matches!(kind, DTypeKind::F32 | DTypeKind::F16 | DTypeKind::BF16) {
                        return Err(unsupported(kind));
                    }
                    let addr = *buf as *const dyn Operand as *const u8 as usize;
                    let next = prog.inputs.len();
                    let slot = *slots.entry((addr, *s)).or_insert(next);
                    if slot == next {
                        prog.inputs.push(Input {
                            buf: *buf,
                            kind,
                            shape: *s,
                            class: Class::Full,
                        });
                    }
                    Op::Input(slot)
                }
                Node::Const(v) => {
                    prog.consts.push(*v);
                    Op::Const(prog.consts.len() - 1)
                }
                Node::ColIndex => Op::ColIndex,
                Node::Unary(u, a) => Op::Unary(*u, at(a)?),
                Node::Binary(b, x, y) => Op::Binary(*b, at(x)?, at(y)?),
                Node::Fma(a, b, c) => Op::Fma(at(a)?, at(b)?, at(c)?),
                Node::Select(c, a, b) => Op::Select(at(c)?, at(a)?, at(b)?),
                Node::Reduce(r, axis, a) => Op::Reduce(*r, *axis, at(a)?),
                Node::Gather(buf, index) => {
                    let kind = buf.kind();
                    if !matches!(kind, DTypeKind::F32 | DTypeKind::F16 | DTypeKind::BF16) {
                        return Err(unsupported(kind));
                    }
                    let addr = *buf as *const dyn Operand as *const u8 as usize;
                    let slot = match prog
                        .tables
                        .iter()
                        .position(|t| t.buf as *const dyn Operand as *const u8 as usize == addr)
                    {
                        Some(t) => t,
                        None => {
                            prog.tables.push(Table { buf: *buf, kind });
                            prog.tables.len() - 1
                        }
                    };
                    Op::Gather(slot, at(index)?)
                }
            };
            let level = match op {
                Op::Reduce(_, _, a) => prog.levels[a] + 1,
                _ => op
                    .operands()
                    .iter()
                    .map(|&k| prog.levels[k])
                    .max()
                    .unwrap_or(0),
            };
            done.insert(e.id(), prog.ops.len());
            prog.ops.push(op);
            prog.shapes.push(e.shape()?);
            prog.levels.push(level);
        }
        for r in roots {
            let k = done.get(&r.id()).copied().ok_or_else(internal)?;
            prog.roots.push(k);
        }
        prog.plan()?;
        Ok(prog)
    }

    /// Chooses the mode and the space, and classifies the inputs against the space; refuses
    /// what the kernels do not do.
    fn plan(&mut self) -> Result<()> {
        let reduces: Vec<(Axis, Shape)> = self
            .ops
            .iter()
            .filter_map(|op| match *op {
                Op::Reduce(_, axis, a) => Some((axis, self.shapes[a])),
                _ => None,
            })
            .collect();
        let rows = reduces.iter().any(|(a, _)| *a == Axis::Rows);
        let all = reduces.iter().any(|(a, _)| *a == Axis::All);
        let refuse = |what: String| Err(Error::Unsupported(format!("fuse: {what}")));
        match (rows, all) {
            (false, false) => {}
            (true, true) => {
                self.plan_rows_then_whole(&reduces)?;
            }
            (true, false) => {
                let cols = reduces[0].1.cols;
                if let Some((_, s)) = reduces.iter().find(|(_, s)| s.cols != cols) {
                    return refuse(format!(
                        "row reductions over rows of different lengths ({cols} and {}) in one \
                         expression",
                        s.cols
                    ));
                }
                if cols > 1 << 24
                    && self
                        .ops
                        .iter()
                        .any(|op| matches!(op, Op::Reduce(Reduce::ArgMax, ..)))
                {
                    return refuse(format!(
                        "an argmax over rows of {cols} columns (indices are exact up to 2^24)"
                    ));
                }
                self.space = Shape::new(self.shape.rows, cols);
                if let Some(s) = self.shapes.iter().find(|s| {
                    (s.cols != 1 && s.cols != cols) || (s.rows != 1 && s.rows != self.space.rows)
                }) {
                    return refuse(format!(
                        "a result of shape {s} beside row reductions over {}",
                        self.space
                    ));
                }
                self.mode = Mode::Rows;
            }
            (false, true) => {
                let space = reduces[0].1;
                if let Some((_, s)) = reduces.iter().find(|(_, s)| *s != space) {
                    return refuse(format!(
                        "whole reductions of different shapes ({space} and {s}) in one expression"
                    ));
                }
                // Beyond the reductions' operands only scalars: what the last block computes.
                let feeds = self.reduction_operands();
                for (k, op) in self.ops.iter().enumerate() {
                    if let Op::Reduce(_, _, a) = *op {
                        if self.levels[a] > 0 {
                            return refuse(
                                "a whole reduction of an expression that holds a reduction".into(),
                            );
                        }
                    } else if !feeds[k] && self.shapes[k] != Shape::new(1, 1) {
                        return refuse(format!(
                            "a result of shape {} beside a whole reduction",
                            self.shapes[k]
                        ));
                    }
                }
                self.space = space;
                self.mode = Mode::All;
            }
        }
        let space = self.space;
        for input in &mut self.inputs {
            input.class = Class::of(input.shape, space);
        }
        Ok(())
    }

    /// Whole reductions of per-row results (a batch's mean loss): each whole reduction takes
    /// a column of values per row of a row program, no row reduction depends on a whole one,
    /// and only scalars follow them.
    fn plan_rows_then_whole(&mut self, reduces: &[(Axis, Shape)]) -> Result<()> {
        let refuse = |what: String| Err(Error::Unsupported(format!("fuse: {what}")));
        let cols = reduces
            .iter()
            .find(|(a, _)| *a == Axis::Rows)
            .map_or(1, |(_, s)| s.cols);
        let rows = reduces
            .iter()
            .find(|(a, _)| *a == Axis::All)
            .map_or(1, |(_, s)| s.rows);
        for (axis, s) in reduces {
            match axis {
                Axis::Rows if s.cols != cols => {
                    return refuse(format!(
                        "row reductions over rows of different lengths ({cols} and {}) in one \
                         expression",
                        s.cols
                    ))
                }
                Axis::All if s.cols != 1 || s.rows != rows => {
                    return refuse(format!(
                        "a whole reduction of shape {s} beside row reductions (whole reductions \
                         there take one value per row, [{rows}, 1])"
                    ))
                }
                _ => {}
            }
        }
        if cols > 1 << 24 {
            return refuse(format!(
                "row reductions over {cols} columns beside whole ones"
            ));
        }
        // Ops that depend on a whole reduction: the epilogue, scalars only.
        let mut after_whole = vec![false; self.ops.len()];
        for k in 0..self.ops.len() {
            after_whole[k] = matches!(self.ops[k], Op::Reduce(_, Axis::All, _))
                || self.ops[k].operands().iter().any(|&j| after_whole[j]);
        }
        for (k, op) in self.ops.iter().enumerate() {
            if let Op::Reduce(_, _, a) = *op {
                if after_whole[a] {
                    return refuse(
                        "a reduction of an expression that holds a whole reduction".into(),
                    );
                }
            }
            if after_whole[k] && self.shapes[k] != Shape::new(1, 1) {
                return refuse(format!(
                    "a result of shape {} after a whole reduction",
                    self.shapes[k]
                ));
            }
        }
        self.space = Shape::new(rows, cols);
        if let Some(s) = self
            .shapes
            .iter()
            .find(|s| (s.cols != 1 && s.cols != cols) || (s.rows != 1 && s.rows != rows))
        {
            return refuse(format!(
                "a result of shape {s} beside row reductions over {}",
                self.space
            ));
        }
        self.mode = Mode::RowsAll;
        Ok(())
    }

    /// Which operations feed a reduction's operand (computed in the reductions' passes).
    fn reduction_operands(&self) -> Vec<bool> {
        let mut feeds = vec![false; self.ops.len()];
        for k in (0..self.ops.len()).rev() {
            if let Op::Reduce(_, _, a) = self.ops[k] {
                feeds[a] = true;
            }
            if feeds[k] {
                for j in self.ops[k].operands() {
                    feeds[j] = true;
                }
            }
        }
        feeds
    }

    /// Elements of the result.
    pub(crate) fn len(&self) -> usize {
        self.shape.rows.saturating_mul(self.shape.cols)
    }

    /// The highest reduction level among the operations (0: no reduction).
    pub(crate) fn depth(&self) -> u32 {
        self.levels.iter().copied().max().unwrap_or(0)
    }

    /// The operations `roots` need, stopping at reductions (their results are values by then):
    /// a flag per operation.
    pub(crate) fn needed(&self, roots: &[usize]) -> Vec<bool> {
        let mut need = vec![false; self.ops.len()];
        for &r in roots {
            need[r] = true;
        }
        for k in (0..self.ops.len()).rev() {
            if need[k] && !matches!(self.ops[k], Op::Reduce(..)) {
                for j in self.ops[k].operands() {
                    need[j] = true;
                }
            }
        }
        need
    }

    /// The structural key of this program's kernel with output type `out`: equal for graphs
    /// that compile to the same kernel.
    pub(crate) fn signature(&self, out: DTypeKind) -> String {
        let mut s = String::with_capacity(16 + 8 * self.ops.len());
        let _ = write!(s, "o:{};m:{:?};i:", out.name(), self.mode);
        for i in &self.inputs {
            let _ = write!(s, "{}{},", i.class.code(), i.kind.name());
        }
        let _ = write!(s, ";r:{:?};g:", self.roots);
        for t in &self.tables {
            let _ = write!(s, "{},", t.kind.name());
        }
        s.push_str(";p:");
        for op in &self.ops {
            let _ = match op {
                Op::Input(i) => write!(s, "x{i}"),
                Op::Const(c) => write!(s, "c{c}"),
                Op::ColIndex => write!(s, "ci"),
                Op::Unary(u, a) => write!(s, "{}({a})", unary_code(*u)),
                Op::Binary(b, x, y) => write!(s, "{b:?}({x},{y})"),
                Op::Fma(a, b, c) => write!(s, "fma({a},{b},{c})"),
                Op::Select(c, a, b) => write!(s, "sel({c},{a},{b})"),
                Op::Reduce(r, axis, a) => write!(s, "{r:?}{axis:?}({a})"),
                Op::Gather(t, a) => write!(s, "g{t}({a})"),
            };
            s.push(';');
        }
        s
    }
}

fn unary_code(u: Unary) -> String {
    match u {
        Unary::Act(a) => format!("act{}", act_name(a)),
        Unary::Cast(k) => format!("cast{}", k.name()),
        u => format!("{u:?}"),
    }
}

pub(crate) fn act_name(a: Activation) -> &'static str {
    match a {
        Activation::None => "none",
        Activation::Silu => "silu",
        Activation::GeluTanh => "gelu_tanh",
        Activation::GeluErf => "gelu_erf",
    }
}

fn children<'r, 'a>(e: &'r Expr<'a>) -> Vec<&'r Expr<'a>> {
    match e.node() {
        Node::Input(..) | Node::Const(_) | Node::ColIndex => Vec::new(),
        Node::Unary(_, a) | Node::Reduce(_, _, a) | Node::Gather(_, a) => vec![a],
        Node::Binary(_, a, b) => vec![a, b],
        Node::Fma(a, b, c) | Node::Select(a, b, c) => vec![a, b, c],
    }
}

fn internal() -> Error {
    Error::InvalidArgument("fuse: an operand was visited out of order (a bug)".into())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::Device;
    use crate::memory::Buffer;

    #[test]
    fn shared_nodes_and_inputs_appear_once() {
        let s = Device::cpu().new_stream().unwrap();
        let a = Buffer::from_host(&s, &[1.0f32, 2.0, 3.0]).unwrap();
        let b = Buffer::from_host(&s, &[1.0f32, 2.0, 3.0]).unwrap();
        let x = Expr::input(&a);
        let y = (&x * 2.0f32).exp();
        let e = (&y + &y) * Expr::input(&a) + &b;
        let p = Program::new(&e).unwrap();
        // a once (two nodes, one slot), b once; y once.
        assert_eq!(p.inputs.len(), 2);
        let exps = p
            .ops
            .iter()
            .filter(|o| matches!(o, Op::Unary(Unary::Exp, _)))
            .count();
        assert_eq!(exps, 1);
        assert_eq!(p.consts, vec![2.0]);
        assert_eq!(p.mode, Mode::Map);
    }

    #[test]
    fn signatures_ignore_values_and_sizes_but_not_structure() {
        let s = Device::cpu().new_stream().unwrap();
        let a = Buffer::from_host(&s, &[1.0f32, 2.0]).unwrap();
        let b = Buffer::from_host(&s, &[1.0f32, 2.0, 3.0, 4.0]).unwrap();
        let sig = |e: Expr<'_>| Program::new(&e).unwrap().signature(DTypeKind::F32);
        assert_eq!(
            sig(Expr::input(&a) * 3.0f32),
            sig(Expr::input(&b) * -7.5f32)
        );
        assert_ne!(sig(Expr::input(&a) * 3.0f32), sig(Expr::input(&a) + 3.0f32));
        assert_ne!(
            sig(Expr::input(&a).sum()),
            sig(Expr::input(&a).reduce_max())
        );
        let p = Program::new(&Expr::input(&a)).unwrap();
        assert_ne!(p.signature(DTypeKind::F32), p.signature(DTypeKind::BF16));
    }

    #[test]
    fn modes_levels_and_refusals() {
        let s = Device::cpu().new_stream().unwrap();
        let a = Buffer::from_host(&s, &[1.0f32; 12]).unwrap();
        let b = Buffer::from_host(&s, &[1.0f32; 6]).unwrap();
        let x = Expr::matrix(&a, 3, 4);
        // softmax: two levels of row reductions.
        let m = x.max_rows();
        let e = (&x - &m).exp();
        let p = Program::new(&(&e / e.sum_rows())).unwrap();
        assert_eq!(
            (p.mode, p.depth(), p.space),
            (Mode::Rows, 2, Shape::new(3, 4))
        );
        let p = Program::new(&(x.sum() / x.reduce_max())).unwrap();
        assert_eq!((p.mode, p.depth()), (Mode::All, 1));
        let refused = |e: Expr<'_>| matches!(Program::new(&e), Err(Error::Unsupported(_)));
        assert_eq!(
            Program::new(&x.sum_rows().sum()).unwrap().mode,
            Mode::RowsAll
        );
        assert!(refused(x.sum_rows().sum() + x.max_rows()));
        assert!(refused((x.sum_rows() - x.sum_rows().sum()).max_rows()));
        assert!(refused((&x - x.sum()).sum()));
        assert!(refused(&x - x.sum()));
        assert!(refused(x.sum_rows() + Expr::matrix(&b, 3, 2).sum_rows()));
        // A reduction of one element per group is the element.
        let p = Program::new(&Expr::matrix(&a, 12, 1).sum_rows()).unwrap();
        assert_eq!(p.mode, Mode::Map);
    }

    #[test]
    fn a_long_chain_does_not_recurse() {
        let s = Device::cpu().new_stream().unwrap();
        let a = Buffer::from_host(&s, &[1.0f32]).unwrap();
        let mut e = Expr::input(&a);
        for _ in 0..MAX_OPS {
            e = e + 1.0f32;
        }
        let err = Program::new(&e)
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(err.contains("more than"), "{err}");
    }
}
