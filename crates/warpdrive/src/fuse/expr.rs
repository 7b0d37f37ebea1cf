//! The lazy expression graph: its nodes, shapes and the builder API.
//!
//! An [`Expr`] is an immutable node shared by reference count, so a subexpression used twice
//! is one node (computed once in the kernel). Building never fails: a shape error (operands
//! that do not broadcast) is kept in the node and returned by [`Expr::shape`], `eval` and
//! `source`, so arithmetic can use operators.

use std::fmt;
use std::sync::Arc;

use half::{bf16, f16};

use crate::device::Stream;
use crate::dtype::{DTypeKind, Float};
use crate::error::{Error, Result};
use crate::memory::Buffer;
use crate::ops::Activation;

/// A 2-D shape, `rows × cols`, row-major. A plain buffer is one row; a column vector is
/// `[n, 1]`. Operands broadcast as in NumPy: along each axis the sizes are equal or one of
/// them is 1.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Shape {
    pub rows: usize,
    pub cols: usize,
}

impl Shape {
    pub fn new(rows: usize, cols: usize) -> Shape {
        Shape { rows, cols }
    }

    /// Elements in this shape (`None` past `usize`).
    pub fn elements(self) -> Option<usize> {
        self.rows.checked_mul(self.cols)
    }

    /// The shape both broadcast to, if they do.
    pub fn broadcast(self, other: Shape) -> Option<Shape> {
        let dim = |a: usize, b: usize| match (a, b) {
            _ if a == b => Some(a),
            (1, _) => Some(b),
            (_, 1) => Some(a),
            _ => None,
        };
        Some(Shape {
            rows: dim(self.rows, other.rows)?,
            cols: dim(self.cols, other.cols)?,
        })
    }
}

impl fmt::Display for Shape {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "[{}, {}]", self.rows, self.cols)
    }
}

/// The elements of an input on the CPU backend, as stored.
pub(crate) enum Values<'a> {
    F32(&'a [f32]),
    F16(&'a [f16]),
    BF16(&'a [bf16]),
}

impl Values<'_> {
    pub(crate) fn len(&self) -> usize {
        match self {
            Values::F32(v) => v.len(),
            Values::F16(v) => v.len(),
            Values::BF16(v) => v.len(),
        }
    }

    /// The element at a gather's index (truncated), NaN where the index is NaN, negative or
    /// past the end.
    pub(crate) fn at_index(&self, index: f64) -> f64 {
        if index.is_nan() || index < 0.0 || index >= self.len() as f64 {
            return f64::NAN;
        }
        self.get(index as usize)
    }

    /// Element `i` widened exactly to f64 (`i` in bounds: the shapes were checked).
    pub(crate) fn get(&self, i: usize) -> f64 {
        match self {
            Values::F32(v) => v.get(i).map_or(f64::NAN, |&x| x as f64),
            Values::F16(v) => v.get(i).map_or(f64::NAN, |x| x.to_f64()),
            Values::BF16(v) => v.get(i).map_or(f64::NAN, |x| x.to_f64()),
        }
    }
}

/// A buffer an expression reads, with its element type erased.
pub(crate) trait Operand: Send + Sync {
    fn kind(&self) -> DTypeKind;
    fn elements(&self) -> usize;
    fn device_ptr(&self) -> u64;
    fn check_stream(&self, stream: &Stream) -> Result<()>;
    /// The elements, on the CPU backend.
    fn values(&self) -> Result<Values<'_>>;
}

impl<T: Float> Operand for Buffer<T> {
    fn kind(&self) -> DTypeKind {
        T::KIND
    }
    fn elements(&self) -> usize {
        self.len()
    }
    fn device_ptr(&self) -> u64 {
        Buffer::device_ptr(self)
    }
    fn check_stream(&self, stream: &Stream) -> Result<()> {
        Buffer::check_stream(self, stream, "fuse")
    }
    fn values(&self) -> Result<Values<'_>> {
        let v = self.host_view()?;
        let cast = |e: bytemuck::PodCastError| Error::Unsupported(format!("fuse input: {e}"));
        match T::KIND {
            DTypeKind::F32 => bytemuck::try_cast_slice(v).map(Values::F32).map_err(cast),
            DTypeKind::F16 => bytemuck::try_cast_slice(v).map(Values::F16).map_err(cast),
            DTypeKind::BF16 => bytemuck::try_cast_slice(v).map(Values::BF16).map_err(cast),
            k => Err(unsupported(k)),
        }
    }
}

pub(crate) fn unsupported(k: DTypeKind) -> Error {
    Error::Unsupported(format!(
        "fuse on {} (f32, f16 and bf16 are fused)",
        k.name()
    ))
}

/// An operation of one operand.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum Unary {
    Neg,
    Abs,
    Exp,
    Log,
    Sqrt,
    Tanh,
    Sigmoid,
    Act(Activation),
    /// Rounds to the type (f32, f16 or bf16) and continues with that value.
    Cast(DTypeKind),
}

/// An operation of two operands; comparisons give 1 or 0.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum Binary {
    Add,
    Sub,
    Mul,
    Div,
    Max,
    Min,
    Lt,
    Le,
    Gt,
    Ge,
    Eq,
    Ne,
}

/// What a reduction computes (a mean is a sum divided by the count).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum Reduce {
    Sum,
    /// NaN if any element is NaN; -inf over nothing.
    Max,
    /// NaN if any element is NaN; +inf over nothing.
    Min,
    /// The column of the largest element (rows only): NaN beats every number (the first NaN
    /// wins), ties go to the first; NaN over nothing. The index as a float value, exact for
    /// rows up to 2²⁴ columns.
    ArgMax,
}

/// What a reduction reduces over.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum Axis {
    /// Each row: `[rows, cols]` → `[rows, 1]`.
    Rows,
    /// Everything: `[rows, cols]` → `[1, 1]`.
    All,
}

pub(crate) enum Node<'a> {
    /// A buffer seen with `shape` (its length checked when the node was made).
    Input(&'a dyn Operand, Shape),
    /// A constant (rounded to f32, the kernels' arithmetic), passed to the kernel as a
    /// parameter so another value reuses the compiled kernel.
    Const(f32),
    Unary(Unary, Expr<'a>),
    Binary(Binary, Expr<'a>, Expr<'a>),
    /// `a · b + c`.
    Fma(Expr<'a>, Expr<'a>, Expr<'a>),
    /// `c ≠ 0 ? a : b` (NaN counts as true).
    Select(Expr<'a>, Expr<'a>, Expr<'a>),
    /// A reduction of the operand.
    Reduce(Reduce, Axis, Expr<'a>),
    /// The column index of each element, `[1, cols]`.
    ColIndex,
    /// `table[index]` per element of the index.
    Gather(&'a dyn Operand, Expr<'a>),
}

pub(crate) struct Inner<'a> {
    pub(crate) node: Node<'a>,
    /// The node's shape, or why it has none (the message names the shapes).
    pub(crate) shape: std::result::Result<Shape, Arc<str>>,
}

/// A lazy elementwise expression over [`Buffer`]s of f32, f16 or bf16, evaluated as one
/// generated kernel on a GPU (the CPU backend evaluates it in f64). Cheap to clone: clones
/// share the node. See the [module docs](super).
#[derive(Clone)]
pub struct Expr<'a>(pub(crate) Arc<Inner<'a>>);

impl fmt::Debug for Expr<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.0.shape {
            Ok(s) => write!(f, "Expr{s}"),
            Err(e) => write!(f, "Expr(error: {e})"),
        }
    }
}

impl<'a> Expr<'a> {
    fn make(node: Node<'a>, shape: std::result::Result<Shape, Arc<str>>) -> Expr<'a> {
        Expr(Arc::new(Inner { node, shape }))
    }

    /// `buf` as one row, `[1, len]` (a plain vector; broadcast along rows against a matrix).
    pub fn input<T: Float>(buf: &'a Buffer<T>) -> Expr<'a> {
        Expr::make(
            Node::Input(buf, Shape::new(1, buf.len())),
            Ok(Shape::new(1, buf.len())),
        )
    }

    /// `buf` as a row-major `[rows, cols]` matrix; its length must be `rows · cols`.
    pub fn matrix<T: Float>(buf: &'a Buffer<T>, rows: usize, cols: usize) -> Expr<'a> {
        let shape = Shape::new(rows, cols);
        let checked = match shape.elements() {
            Some(n) if n == buf.len() => Ok(shape),
            _ => Err(format!(
                "fuse: a buffer of {} elements is not a matrix of shape {shape}",
                buf.len()
            )
            .into()),
        };
        Expr::make(Node::Input(buf, shape), checked)
    }

    /// `buf` as a column, `[len, 1]` (broadcast along columns against a matrix: one value per
    /// row).
    pub fn col<T: Float>(buf: &'a Buffer<T>) -> Expr<'a> {
        let shape = Shape::new(buf.len(), 1);
        Expr::make(Node::Input(buf, shape), Ok(shape))
    }

    /// A constant, `[1, 1]` (rounded to f32: the kernels compute in f32).
    pub fn constant(v: f32) -> Expr<'a> {
        Expr::make(Node::Const(v), Ok(Shape::new(1, 1)))
    }

    /// The column index of each element, `0 .. cols`, as a `[1, cols]` row (exact below
    /// 2²⁴): with a comparison against a column of indices, it picks one element per row
    /// (`col_index(n).equals(Expr::col(&labels)).select(&x, 0.0).sum_rows()` is
    /// `x[row, labels[row]]`, fused into the same pass as the row's other reductions).
    pub fn col_index(cols: usize) -> Expr<'a> {
        if cols == 1 {
            // Broadcast along columns it must stay 0.
            return Expr::constant(0.0);
        }
        Expr::make(Node::ColIndex, Ok(Shape::new(1, cols)))
    }

    /// `table[index]` for each element of `index` (its shape), the index's value truncated
    /// toward zero; NaN where it is NaN, negative or past the table's end (no read outside the
    /// table). Indices are computed in f32 on the GPU (f64 on the CPU backend): keep them
    /// integers below 2²⁴ (exact in both), e.g. from an f32 buffer of indices, a
    /// [`col_index`](Self::col_index), or an integer-valued product of them.
    pub fn gather<T: Float>(table: &'a Buffer<T>, index: impl Into<Expr<'a>>) -> Expr<'a> {
        let index = index.into();
        let shape = index.0.shape.clone();
        Expr::make(Node::Gather(table, index), shape)
    }

    /// The shape of the result, or an error naming the shapes that do not broadcast.
    pub fn shape(&self) -> Result<Shape> {
        self.0
            .shape
            .clone()
            .map_err(|e| Error::InvalidArgument(e.to_string()))
    }

    /// Whether a reduction is among this expression's nodes.
    pub(crate) fn has_reduction(&self) -> bool {
        let mut stack = vec![self];
        let mut seen = std::collections::HashSet::new();
        while let Some(e) = stack.pop() {
            if !seen.insert(e.id()) {
                continue;
            }
            match e.node() {
                Node::Reduce(..) => return true,
                Node::Input(..) | Node::Const(_) | Node::ColIndex => {}
                Node::Unary(_, a) | Node::Gather(_, a) => stack.push(a),
                Node::Binary(_, a, b) => stack.extend([a, b]),
                Node::Fma(a, b, c) | Node::Select(a, b, c) => stack.extend([a, b, c]),
            }
        }
        false
    }

    pub(crate) fn node(&self) -> &Node<'a> {
        &self.0.node
    }

    /// The node's identity (shared subexpressions are one node).
    pub(crate) fn id(&self) -> usize {
        Arc::as_ptr(&self.0) as *const u8 as usize
    }

    fn unary(&self, op: Unary) -> Expr<'a> {
        Expr::make(Node::Unary(op, self.clone()), self.0.shape.clone())
    }

    fn binary(&self, op: Binary, other: Expr<'a>) -> Expr<'a> {
        let shape = joint(op_name(op), &[self, &other]);
        Expr::make(Node::Binary(op, self.clone(), other), shape)
    }

    /// `-self`, also as the `-` operator.
    pub fn neg(&self) -> Expr<'a> {
        self.unary(Unary::Neg)
    }
    pub fn abs(&self) -> Expr<'a> {
        self.unary(Unary::Abs)
    }
    pub fn exp(&self) -> Expr<'a> {
        self.unary(Unary::Exp)
    }
    /// The natural logarithm (NaN below 0, -inf at 0).
    pub fn log(&self) -> Expr<'a> {
        self.unary(Unary::Log)
    }
    pub fn sqrt(&self) -> Expr<'a> {
        self.unary(Unary::Sqrt)
    }
    pub fn tanh(&self) -> Expr<'a> {
        self.unary(Unary::Tanh)
    }
    /// `1 / (1 + e^-x)`.
    pub fn sigmoid(&self) -> Expr<'a> {
        self.unary(Unary::Sigmoid)
    }
    /// One of the activations the ops have ([`Activation::None`] is the identity).
    pub fn activation(&self, act: Activation) -> Expr<'a> {
        if act == Activation::None {
            return self.clone();
        }
        self.unary(Unary::Act(act))
    }
    /// `x · sigmoid(x)`.
    pub fn silu(&self) -> Expr<'a> {
        self.activation(Activation::Silu)
    }
    /// GELU, tanh approximation.
    pub fn gelu_tanh(&self) -> Expr<'a> {
        self.activation(Activation::GeluTanh)
    }
    /// GELU with erf.
    pub fn gelu_erf(&self) -> Expr<'a> {
        self.activation(Activation::GeluErf)
    }
    /// The value rounded to `T` (f32, f16 or bf16; round to nearest even, f16 overflow to
    /// ±inf), continuing with the rounded value: a cast inside the graph. The output's type
    /// is chosen at `eval`.
    pub fn cast<T: Float>(&self) -> Expr<'a> {
        self.unary(Unary::Cast(T::KIND))
    }

    fn reduce(&self, r: Reduce, axis: Axis) -> Expr<'a> {
        let shape = match (&self.0.shape, axis) {
            // A reduction of one element per group is the element itself.
            (Ok(s), Axis::Rows) if s.cols == 1 => return self.clone(),
            (Ok(s), Axis::All) if s.rows == 1 && s.cols == 1 => return self.clone(),
            (Ok(s), Axis::Rows) => Ok(Shape::new(s.rows, 1)),
            (Ok(_), Axis::All) => Ok(Shape::new(1, 1)),
            (Err(e), _) => Err(e.clone()),
        };
        Expr::make(Node::Reduce(r, axis, self.clone()), shape)
    }

    /// The number of elements of this expression as f32 (1 where its shape is an error:
    /// the error comes first anyway).
    fn count(&self, axis: Axis) -> f64 {
        match (&self.0.shape, axis) {
            (Ok(s), Axis::Rows) => s.cols as f64,
            (Ok(s), Axis::All) => s.rows as f64 * s.cols as f64,
            (Err(_), _) => 1.0,
        }
    }

    /// The sum of every element, `[1, 1]` (0 over nothing). On a GPU one kernel reads the
    /// operands once: each block reduces its share, the last block to finish combines the
    /// blocks' results in a fixed order (deterministic) and applies what follows.
    pub fn sum(&self) -> Expr<'a> {
        self.reduce(Reduce::Sum, Axis::All)
    }
    /// The largest element, `[1, 1]` (NaN if any is NaN; -inf over nothing).
    pub fn reduce_max(&self) -> Expr<'a> {
        self.reduce(Reduce::Max, Axis::All)
    }
    /// The smallest element, `[1, 1]` (NaN if any is NaN; +inf over nothing).
    pub fn reduce_min(&self) -> Expr<'a> {
        self.reduce(Reduce::Min, Axis::All)
    }
    /// The mean of every element, `[1, 1]` (NaN over nothing).
    pub fn mean(&self) -> Expr<'a> {
        let n = self.count(Axis::All);
        self.sum() / n
    }
    /// The sum of each row, `[rows, 1]`. On a GPU one warp (rows up to 1024) or one block
    /// per row; reductions that depend on each other run as passes over the row in the same
    /// kernel, and what follows them (per row or per element) is applied there too.
    pub fn sum_rows(&self) -> Expr<'a> {
        self.reduce(Reduce::Sum, Axis::Rows)
    }
    /// The largest element of each row, `[rows, 1]`.
    pub fn max_rows(&self) -> Expr<'a> {
        self.reduce(Reduce::Max, Axis::Rows)
    }
    /// The smallest element of each row, `[rows, 1]`.
    pub fn min_rows(&self) -> Expr<'a> {
        self.reduce(Reduce::Min, Axis::Rows)
    }
    /// The column index of each row's largest element, `[rows, 1]`, as a value (exact: rows
    /// longer than 2²⁴ columns are refused). NaN counts as the largest (the first NaN wins, as
    /// PyTorch's argmax); ties go to the first; an empty row gives NaN.
    pub fn argmax_rows(&self) -> Expr<'a> {
        let shape = self.0.shape.clone().map(|s| Shape::new(s.rows, 1));
        Expr::make(
            Node::Reduce(Reduce::ArgMax, Axis::Rows, self.clone()),
            shape,
        )
    }

    /// The mean of each row, `[rows, 1]`.
    pub fn mean_rows(&self) -> Expr<'a> {
        let n = self.count(Axis::Rows);
        self.sum_rows() / n
    }

    /// The larger; NaN if either is NaN.
    pub fn max(&self, other: impl Into<Expr<'a>>) -> Expr<'a> {
        self.binary(Binary::Max, other.into())
    }
    /// The smaller; NaN if either is NaN.
    pub fn min(&self, other: impl Into<Expr<'a>>) -> Expr<'a> {
        self.binary(Binary::Min, other.into())
    }
    /// 1 where `self < other`, else 0 (0 when either is NaN).
    pub fn lt(&self, other: impl Into<Expr<'a>>) -> Expr<'a> {
        self.binary(Binary::Lt, other.into())
    }
    pub fn le(&self, other: impl Into<Expr<'a>>) -> Expr<'a> {
        self.binary(Binary::Le, other.into())
    }
    pub fn gt(&self, other: impl Into<Expr<'a>>) -> Expr<'a> {
        self.binary(Binary::Gt, other.into())
    }
    pub fn ge(&self, other: impl Into<Expr<'a>>) -> Expr<'a> {
        self.binary(Binary::Ge, other.into())
    }
    /// 1 where equal (so 0 when either is NaN), else 0.
    pub fn equals(&self, other: impl Into<Expr<'a>>) -> Expr<'a> {
        self.binary(Binary::Eq, other.into())
    }
    /// 1 where not equal (so 1 when either is NaN), else 0.
    pub fn not_equals(&self, other: impl Into<Expr<'a>>) -> Expr<'a> {
        self.binary(Binary::Ne, other.into())
    }
    /// `self · b + c` (one rounding on the GPU).
    pub fn fma(&self, b: impl Into<Expr<'a>>, c: impl Into<Expr<'a>>) -> Expr<'a> {
        let (b, c) = (b.into(), c.into());
        let shape = joint("fma", &[self, &b, &c]);
        Expr::make(Node::Fma(self.clone(), b, c), shape)
    }
    /// `if_true` where `self` is not 0 (NaN counts as not 0), else `if_false`.
    pub fn select(&self, if_true: impl Into<Expr<'a>>, if_false: impl Into<Expr<'a>>) -> Expr<'a> {
        let (a, b) = (if_true.into(), if_false.into());
        let shape = joint("select", &[self, &a, &b]);
        Expr::make(Node::Select(self.clone(), a, b), shape)
    }
}

fn op_name(op: Binary) -> &'static str {
    match op {
        Binary::Add => "add",
        Binary::Sub => "sub",
        Binary::Mul => "mul",
        Binary::Div => "div",
        Binary::Max => "max",
        Binary::Min => "min",
        Binary::Lt => "lt",
        Binary::Le => "le",
        Binary::Gt => "gt",
        Binary::Ge => "ge",
        Binary::Eq => "equals",
        Binary::Ne => "not_equals",
    }
}

/// The broadcast shape of `operands`, or the first error among them, or an error naming
/// every operand's shape.
fn joint(op: &str, operands: &[&Expr<'_>]) -> std::result::Result<Shape, Arc<str>> {
    let mut shapes = Vec::with_capacity(operands.len());
    for e in operands {
        shapes.push(e.0.shape.clone()?);
    }
    let mut out = shapes[0];
    for &s in &shapes[1..] {
        match out.broadcast(s) {
            Some(b) => out = b,
            None => {
                let list: Vec<String> = shapes.iter().map(Shape::to_string).collect();
                return Err(format!(
                    "fuse: {op} of shapes {} do not broadcast",
                    list.join(" and ")
                )
                .into());
            }
        }
    }
    Ok(out)
}

impl<'a, T: Float> From<&'a Buffer<T>> for Expr<'a> {
    fn from(buf: &'a Buffer<T>) -> Expr<'a> {
        Expr::input(buf)
    }
}

impl<'a> From<f32> for Expr<'a> {
    fn from(v: f32) -> Expr<'a> {
        Expr::constant(v)
    }
}

/// A constant rounded to f32 (so float literals work without a suffix).
impl<'a> From<f64> for Expr<'a> {
    fn from(v: f64) -> Expr<'a> {
        Expr::constant(v as f32)
    }
}

impl<'a> From<&Expr<'a>> for Expr<'a> {
    fn from(e: &Expr<'a>) -> Expr<'a> {
        e.clone()
    }
}

macro_rules! operator {
    ($trait:ident, $method:ident, $op:expr) => {
        impl<'a, R: Into<Expr<'a>>> std::ops::$trait<R> for Expr<'a> {
            type Output = Expr<'a>;
            fn $method(self, rhs: R) -> Expr<'a> {
                self.binary($op, rhs.into())
            }
        }
        impl<'a, R: Into<Expr<'a>>> std::ops::$trait<R> for &Expr<'a> {
            type Output = Expr<'a>;
            fn $method(self, rhs: R) -> Expr<'a> {
                self.binary($op, rhs.into())
            }
        }
        operator!(@scalar $trait, $method, $op, f32);
        operator!(@scalar $trait, $method, $op, f64);
    };
    (@scalar $trait:ident, $method:ident, $op:expr, $t:ty) => {
        impl<'a> std::ops::$trait<Expr<'a>> for $t {
            type Output = Expr<'a>;
            fn $method(self, rhs: Expr<'a>) -> Expr<'a> {
                Expr::from(self).binary($op, rhs)
            }
        }
        impl<'a> std::ops::$trait<&Expr<'a>> for $t {
            type Output = Expr<'a>;
            fn $method(self, rhs: &Expr<'a>) -> Expr<'a> {
                Expr::from(self).binary($op, rhs.clone())
            }
        }
    };
}
operator!(Add, add, Binary::Add);
operator!(Sub, sub, Binary::Sub);
operator!(Mul, mul, Binary::Mul);
operator!(Div, div, Binary::Div);

impl<'a> std::ops::Neg for Expr<'a> {
    type Output = Expr<'a>;
    fn neg(self) -> Expr<'a> {
        self.unary(Unary::Neg)
    }
}

impl<'a> std::ops::Neg for &Expr<'a> {
    type Output = Expr<'a>;
    fn neg(self) -> Expr<'a> {
        self.unary(Unary::Neg)
    }
}
