//! The CPU backend's evaluation of a program: every operation in f64, one rounding to the
//! output type (casts inside the graph round where they stand). The reference the generated
//! kernels are tested against; its operations mirror `kernels/fuse.cu`.

use half::{bf16, f16};

use crate::dtype::{DTypeKind, Float};
use crate::error::Result;

use super::expr::{Binary, Unary, Values};
use super::program::{Op, Program};

/// Elements evaluated together, operation by operation (the temporaries stay in cache).
const CHUNK: usize = 2048;

/// Evaluates `prog` into `out` (`prog.len()` elements).
pub(crate) fn eval<O: Float>(prog: &Program<'_>, out: &mut [O]) -> Result<()> {
    let values: Vec<Values<'_>> = prog
        .inputs
        .iter()
        .map(|i| i.buf.values())
        .collect::<Result<_>>()?;
    let cols = prog.shape.cols;
    let mut temps = vec![0.0f64; prog.ops.len() * CHUNK];
    let n = out.len().min(prog.len());
    let mut start = 0;
    while start < n {
        let len = CHUNK.min(n - start);
        for (k, op) in prog.ops.iter().enumerate() {
            let (done, rest) = temps.split_at_mut(k * CHUNK);
            let dst = &mut rest[..len];
            let t = |j: usize, e: usize| done[j * CHUNK + e];
            match *op {
                Op::Input(slot) => {
                    let input = &prog.inputs[slot];
                    let v = &values[slot];
                    for (e, d) in dst.iter_mut().enumerate() {
                        *d = v.get(input.class.index(start + e, cols));
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
        let last = prog.ops.len().saturating_sub(1) * CHUNK;
        for (o, &v) in out[start..start + len]
            .iter_mut()
            .zip(&temps[last..last + len])
        {
            *o = O::from_f64(v);
        }
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
