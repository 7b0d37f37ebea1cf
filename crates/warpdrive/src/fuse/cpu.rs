//! The CPU backend's evaluation of a program: every operation in f64, one rounding to the
//! output type (casts inside the graph round where they stand). The reference the generated
//! kernels are tested against; its operations mirror `kernels/fuse.cu`.
//!
//! Elementwise programs run in chunks of elements, operation by operation; programs with
//! reductions run operation by operation over each operation's whole shape (broadcasting as
//! the graph says), each value dropped after its last use.

use half::{bf16, f16};

use crate::dtype::{DTypeKind, Float};
use crate::error::Result;

use super::expr::{Axis, Binary, Reduce, Shape, Unary, Values};
use super::program::{Mode, Op, Program};

/// Elements evaluated together, operation by operation (the temporaries stay in cache).
const CHUNK: usize = 2048;

/// Evaluates `prog` into `out` (`prog.len()` elements).
pub(crate) fn eval<O: Float>(prog: &Program<'_>, out: &mut [O]) -> Result<()> {
    if prog.mode != Mode::Map {
        return eval_whole(prog, out);
    }
    let root = prog.roots.first().copied().unwrap_or(0) * CHUNK;
    let n = out.len().min(prog.len());
    chunks(prog, n, |start, len, temps| {
        for (o, &v) in out[start..start + len]
            .iter_mut()
            .zip(&temps[root..root + len])
        {
            *o = O::from_f64(v);
        }
        Ok(())
    })
}

/// Keeps the value (first root) where the predicate (second root) is not 0, in order, into
/// `out`; returns how many were kept.
pub(crate) fn filter<O: Float>(prog: &Program<'_>, out: &mut [O]) -> Result<usize> {
    let (value, keep) = match prog.roots[..] {
        [v, k] => (v * CHUNK, k * CHUNK),
        _ => {
            return Err(crate::error::Error::InvalidArgument(
                "fuse: a filter needs a value and a predicate".into(),
            ))
        }
    };
    let mut kept = 0;
    chunks(prog, prog.len(), |_, len, temps| {
        for e in 0..len {
            if temps[keep + e] != 0.0 {
                if let Some(o) = out.get_mut(kept) {
                    *o = O::from_f64(temps[value + e]);
                }
                kept += 1;
            }
        }
        Ok(())
    })?;
    Ok(kept)
}

/// Runs a map program over its first `n` elements in chunks, handing each chunk's
/// temporaries (operation `k`'s at `k · CHUNK`) to `sink(start, len, temps)`.
fn chunks(
    prog: &Program<'_>,
    n: usize,
    mut sink: impl FnMut(usize, usize, &[f64]) -> Result<()>,
) -> Result<()> {
    let values: Vec<Values<'_>> = prog
        .inputs
        .iter()
        .map(|i| i.buf.values())
        .collect::<Result<_>>()?;
    let cols = prog.shape.cols;
    let tables: Vec<Values<'_>> = prog
        .tables
        .iter()
        .map(|t| t.buf.values())
        .collect::<Result<_>>()?;
    let mut temps = vec![0.0f64; prog.ops.len() * CHUNK];
    let mut start = 0;
    while start < n {
        let len = CHUNK.min(n - start);
        for (k, op) in prog.ops.iter().enumerate() {
            let (done, rest) = temps.split_at_mut(k * CHUNK);
            let dst = &mut rest[..len];
            let t = |j: usize, e: usize| done[j * CHUNK + e];
            match *op {
                Op::Input(slot) => {
                    let s = prog.inputs[slot].shape;
                    let v = &values[slot];
                    for (e, d) in dst.iter_mut().enumerate() {
                        let i = start + e;
                        *d = v.get(at(s, i / cols.max(1), i % cols.max(1)));
                    }
                }
                Op::ColIndex => {
                    for (e, d) in dst.iter_mut().enumerate() {
                        *d = ((start + e) % cols.max(1)) as f64;
                    }
                }
                // Map programs have none.
                Op::Reduce(..) => dst.fill(f64::NAN),
                Op::Gather(g, a) => {
                    for (e, d) in dst.iter_mut().enumerate() {
                        *d = tables[g].at_index(t(a, e));
                    }
                }
                Op::Const(c) => dst.fill(prog.consts[c] as f64),
                Op::Unary(u, a) => {
                    for (e, d) in dst.iter_mut().enumerate() {
                        *d = unary(u, t(a, e));
                    }
                }
                Op::Binary(b, x, y) => {
                    for (e, d) in dst.iter_mut().enumerate() {
                        *d = binary(b, t(x, e), t(y, e));
                    }
                }
                Op::Fma(a, b, c) => {
                    for (e, d) in dst.iter_mut().enumerate() {
                        *d = t(a, e).mul_add(t(b, e), t(c, e));
                    }
                }
                Op::Select(c, a, b) => {
                    for (e, d) in dst.iter_mut().enumerate() {
                        *d = if t(c, e) != 0.0 { t(a, e) } else { t(b, e) };
                    }
                }
            }
        }
        sink(start, len, &temps)?;
        start += len;
    }
    Ok(())
}

/// A unary operation in f64.
pub(crate) fn unary(u: Unary, x: f64) -> f64 {
    match u {
        Unary::Neg => -x,
        Unary::Abs => x.abs(),
        Unary::Exp => x.exp(),
        Unary::Log => x.ln(),
        Unary::Sqrt => x.sqrt(),
        Unary::Tanh => x.tanh(),
        Unary::Sigmoid => 1.0 / (1.0 + (-x).exp()),
        Unary::Act(a) => a.apply(x),
        Unary::Cast(k) => round_to(k, x),
    }
}

/// `x` rounded to `k` (f32, f16, bf16; 16-bit types through f32, as the kernels).
pub(crate) fn round_to(k: DTypeKind, x: f64) -> f64 {
    match k {
        DTypeKind::F16 => f16::from_f32(x as f32).to_f64(),
        DTypeKind::BF16 => bf16::from_f32(x as f32).to_f64(),
        _ => x as f32 as f64,
    }
}

/// A binary operation in f64 (comparisons give 1 or 0).
pub(crate) fn binary(b: Binary, x: f64, y: f64) -> f64 {
    let flag = |c: bool| if c { 1.0 } else { 0.0 };
    match b {
        Binary::Add => x + y,
        Binary::Sub => x - y,
        Binary::Mul => x * y,
        Binary::Div => x / y,
        Binary::Max => {
            if x.is_nan() || x > y {
                x
            } else {
                y
            }
        }
        Binary::Min => {
            if x.is_nan() || x < y {
                x
            } else {
                y
            }
        }
        Binary::Lt => flag(x < y),
        Binary::Le => flag(x <= y),
        Binary::Gt => flag(x > y),
        Binary::Ge => flag(x >= y),
        Binary::Eq => flag(x == y),
        Binary::Ne => flag(x != y),
    }
}

/// The index into a value of shape `s` for element `(r, c)` of a shape it broadcasts to.
fn at(s: Shape, r: usize, c: usize) -> usize {
    let r = if s.rows == 1 { 0 } else { r };
    let c = if s.cols == 1 { 0 } else { c };
    r * s.cols + c
}

/// A reduction of `xs` in f64.
fn fold(r: Reduce, xs: impl Iterator<Item = f64>) -> f64 {
    match r {
        Reduce::Sum => xs.sum(),
        Reduce::Max => xs.fold(f64::NEG_INFINITY, |m, v| binary(Binary::Max, m, v)),
        Reduce::Min => xs.fold(f64::INFINITY, |m, v| binary(Binary::Min, m, v)),
        Reduce::ArgMax => {
            // (value, index): NaN beats numbers, then larger, then the first.
            let best = xs
                .enumerate()
                .fold(None::<(f64, usize)>, |best, (i, v)| match best {
                    None => Some((v, i)),
                    Some((b, _)) if (v.is_nan() && !b.is_nan()) || (!b.is_nan() && v > b) => {
                        Some((v, i))
                    }
                    keep => keep,
                });
            best.map_or(f64::NAN, |(_, i)| i as f64)
        }
    }
}

/// Evaluates a program with reductions, operation by operation over whole shapes.
fn eval_whole<O: Float>(prog: &Program<'_>, out: &mut [O]) -> Result<()> {
    let n_ops = prog.ops.len();
    let mut last_use = vec![0usize; n_ops];
    for (k, op) in prog.ops.iter().enumerate() {
        for j in op.operands() {
            last_use[j] = k;
        }
    }
    for &r in &prog.roots {
        last_use[r] = n_ops;
    }
    let mut vals: Vec<Vec<f64>> = vec![Vec::new(); n_ops];
    for (k, op) in prog.ops.iter().enumerate() {
        let sh = prog.shapes[k];
        let len = sh.rows.saturating_mul(sh.cols);
        let cols = sh.cols.max(1);
        let get = |j: usize, i: usize| vals[j][at(prog.shapes[j], i / cols, i % cols)];
        let v: Vec<f64> = match *op {
            Op::Input(slot) => {
                let values = prog.inputs[slot].buf.values()?;
                (0..len).map(|i| values.get(i)).collect()
            }
            Op::Const(c) => vec![prog.consts[c] as f64; len],
            Op::ColIndex => (0..len).map(|i| (i % cols) as f64).collect(),
            Op::Unary(u, a) => (0..len).map(|i| unary(u, get(a, i))).collect(),
            Op::Binary(b, x, y) => (0..len).map(|i| binary(b, get(x, i), get(y, i))).collect(),
            Op::Fma(a, b, c) => (0..len)
                .map(|i| get(a, i).mul_add(get(b, i), get(c, i)))
                .collect(),
            Op::Select(c, a, b) => (0..len)
                .map(|i| {
                    if get(c, i) != 0.0 {
                        get(a, i)
                    } else {
                        get(b, i)
                    }
                })
                .collect(),
            Op::Gather(g, a) => {
                let table = prog.tables[g].buf.values()?;
                (0..len).map(|i| table.at_index(get(a, i))).collect()
            }
            Op::Reduce(r, Axis::All, a) => vec![fold(r, vals[a].iter().copied())],
            Op::Reduce(r, Axis::Rows, a) => {
                let row = prog.shapes[a].cols;
                (0..len)
                    .map(|i| fold(r, vals[a][i * row..(i + 1) * row].iter().copied()))
                    .collect()
            }
        };
        vals[k] = v;
        for j in op.operands() {
            if last_use[j] == k {
                vals[j] = Vec::new();
            }
        }
    }
    let root = prog
        .roots
        .first()
        .and_then(|&r| vals.get(r))
        .map(Vec::as_slice)
        .unwrap_or(&[]);
    for (o, &v) in out.iter_mut().zip(root) {
        *o = O::from_f64(v);
    }
    Ok(())
}
