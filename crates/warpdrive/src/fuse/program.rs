//! An expression graph flattened into a program: its inputs (each buffer once per way it is
//! seen), its constants, and its operations in dependency order, each computed once. Both
//! backends run programs; its [`signature`](Program::signature) is the structural key of
//! the compiled kernel (types, broadcasts and operations, not addresses, sizes or constant
//! values, which are kernel parameters).

use std::collections::HashMap;
use std::fmt::Write;

use crate::dtype::DTypeKind;
use crate::error::{Error, Result};
use crate::ops::Activation;

use super::expr::{unsupported, Binary, Expr, Node, Operand, Shape, Unary};

/// How an input is indexed for output element `i` of a `[rows, cols]` result.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum Class {
    /// The output's own shape: element `i`.
    Full,
    /// One row, broadcast along rows: element `i % cols`.
    Row,
    /// One column, broadcast along columns: element `i / cols`.
    Col,
    /// One value: element 0.
    Scalar,
}

impl Class {
    fn of(input: Shape, out: Shape) -> Class {
        if input == out {
            Class::Full
        } else if input.rows == 1 && input.cols == 1 {
            Class::Scalar
        } else if input.rows == 1 {
            Class::Row
        } else {
            Class::Col
        }
    }

    /// The index into the input for output element `i` of a result with `cols` columns.
    pub(crate) fn index(self, i: usize, cols: usize) -> usize {
        match self {
            Class::Full => i,
            Class::Row => i % cols.max(1),
            Class::Col => i / cols.max(1),
            Class::Scalar => 0,
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
}

pub(crate) struct Input<'a> {
    pub(crate) buf: &'a dyn Operand,
    pub(crate) kind: DTypeKind,
    pub(crate) class: Class,
}

/// One operation; operands are indices of earlier operations.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) enum Op {
    Input(usize),
    Const(usize),
    Unary(Unary, usize),
    Binary(Binary, usize, usize),
    Fma(usize, usize, usize),
    Select(usize, usize, usize),
}

pub(crate) struct Program<'a> {
    pub(crate) shape: Shape,
    pub(crate) inputs: Vec<Input<'a>>,
    pub(crate) consts: Vec<f32>,
    /// In dependency order; the last is the result.
    pub(crate) ops: Vec<Op>,
}

/// Operations in one fused kernel at most (a larger graph is an error, not a slow compile).
pub const MAX_OPS: usize = 4096;

impl<'a> Program<'a> {
    /// Flattens `root` (iteratively: a long chain does not grow the call stack).
    pub(crate) fn new(root: &Expr<'a>) -> Result<Program<'a>> {
        let shape = root.shape()?;
        shape.elements().ok_or_else(|| {
            Error::InvalidArgument(format!("fuse: shape {shape} has more elements than usize"))
        })?;
        let mut prog = Program {
            shape,
            inputs: Vec::new(),
            consts: Vec::new(),
            ops: Vec::new(),
        };
        let mut done: HashMap<usize, usize> = HashMap::new();
        // (buffer address, class) -> input slot: a buffer read the same way is loaded once.
        let mut slots: HashMap<(usize, Class), usize> = HashMap::new();
        let mut stack: Vec<(&Expr<'a>, bool)> = vec![(root, false)];
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
                    let class = Class::of(*s, shape);
                    let addr = *buf as *const dyn Operand as *const u8 as usize;
                    let next = prog.inputs.len();
                    let slot = *slots.entry((addr, class)).or_insert(next);
                    if slot == next {
                        prog.inputs.push(Input {
                            buf: *buf,
                            kind,
                            class,
                        });
                    }
                    Op::Input(slot)
                }
                Node::Const(v) => {
                    prog.consts.push(*v);
                    Op::Const(prog.consts.len() - 1)
                }
                Node::Unary(u, a) => Op::Unary(*u, at(a)?),
                Node::Binary(b, x, y) => Op::Binary(*b, at(x)?, at(y)?),
                Node::Fma(a, b, c) => Op::Fma(at(a)?, at(b)?, at(c)?),
                Node::Select(c, a, b) => Op::Select(at(c)?, at(a)?, at(b)?),
            };
            done.insert(e.id(), prog.ops.len());
            prog.ops.push(op);
        }
        Ok(prog)
    }

    /// Elements of the result.
    pub(crate) fn len(&self) -> usize {
        self.shape.rows.saturating_mul(self.shape.cols)
    }

    /// The structural key of this program's kernel with output type `out`: equal for graphs
    /// that compile to the same kernel.
    pub(crate) fn signature(&self, out: DTypeKind) -> String {
        let mut s = String::with_capacity(16 + 8 * self.ops.len());
        let _ = write!(s, "o:{};i:", out.name());
        for i in &self.inputs {
            let _ = write!(s, "{}{},", i.class.code(), i.kind.name());
        }
        s.push_str(";p:");
        for op in &self.ops {
            let _ = match op {
                Op::Input(i) => write!(s, "x{i}"),
                Op::Const(c) => write!(s, "c{c}"),
                Op::Unary(u, a) => write!(s, "{}({a})", unary_code(*u)),
                Op::Binary(b, x, y) => write!(s, "{b:?}({x},{y})"),
                Op::Fma(a, b, c) => write!(s, "fma({a},{b},{c})"),
                Op::Select(c, a, b) => write!(s, "sel({c},{a},{b})"),
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
        Node::Input(..) | Node::Const(_) => Vec::new(),
        Node::Unary(_, a) => vec![a],
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
        let p = Program::new(&Expr::input(&a)).unwrap();
        assert_ne!(p.signature(DTypeKind::F32), p.signature(DTypeKind::BF16));
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
