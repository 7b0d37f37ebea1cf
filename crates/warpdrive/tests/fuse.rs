//! Kernel fusion (`warpdrive::fuse`) on both backends, and every kind of generated kernel
//! through the real NVRTC.
//!
//! References are written here, independently of the library: a test-side tree ([`G`]) is
//! built into an `Expr` and evaluated in f64 with a running error bound (the rounding each
//! operation may add in f32, times how much later operations amplify it; a cast to a 16-bit
//! type adds one unit of that type's precision). A result passes when
//! `|got - want| <= 2·bound + ulp(out)·|want| + the output type's subnormal spacing`.
//! Outputs are poisoned (NaN) first.

mod common;

use common::{device_test, nan, poisoned, random_in, rng, seed, TestFloat};
use half::{bf16, f16};
use proptest::prelude::*;
use proptest::test_runner::{Config, TestCaseError, TestRunner};
use rand::Rng;
use warpdrive::fuse::{Expr, MapShape, Shape};
use warpdrive::kernels::Arch;
use warpdrive::ops::Activation;
use warpdrive::{Buffer, DTypeKind, Device, Error};

/// Unit roundoff of f32, and the rounding one f32 operation may add (transcendentals: a
/// few ulps).
const EPS: f64 = 1.0 / (1u64 << 24) as f64;
const OP_ERR: f64 = 2.0 * EPS;
const FN_ERR: f64 = 8.0 * EPS;

/// Relative spacing of a type's values (one ulp relative to the value).
fn ulp(k: DTypeKind) -> f64 {
    match k {
        DTypeKind::F16 => 1.0 / 1024.0,
        DTypeKind::BF16 => 1.0 / 128.0,
        _ => 2.0 * EPS,
    }
}

fn round_to(k: DTypeKind, v: f64) -> f64 {
    match k {
        DTypeKind::F16 => f16::from_f32(v as f32).to_f64(),
        DTypeKind::BF16 => bf16::from_f32(v as f32).to_f64(),
        _ => v as f32 as f64,
    }
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum Un {
    Neg,
    Abs,
    /// `exp(clamp(x, -4, 4))`
    Exp,
    /// `log(|x| + 0.5)`
    Log,
    /// `sqrt(|x| + 0.25)`
    Sqrt,
    Tanh,
    Sigmoid,
    Silu,
    GeluTanh,
    GeluErf,
    Cast(DTypeKind),
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum Bin {
    Add,
    Sub,
    Mul,
    /// `a / (|b| + 0.5)`
    Div,
    Max,
    Min,
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum Cmp {
    Lt,
    Le,
    Gt,
    Ge,
    Eq,
    Ne,
}

/// A test-side expression. Comparisons take leaves (exact on both backends), so the selected
/// branch never depends on rounding.
#[derive(Debug, Clone)]
enum G {
    In(usize),
    C(f32),
    Un(Un, Box<G>),
    Bin(Bin, Box<G>, Box<G>),
    Fma(Box<G>, Box<G>, Box<G>),
    Sel(Cmp, Box<G>, Box<G>, Box<G>, Box<G>),
}

/// Inputs of a case: values as f64 (exact) with their shapes.
struct Inputs<'a> {
    exprs: Vec<Expr<'a>>,
    values: Vec<Vec<f64>>,
    shapes: Vec<Shape>,
}

impl G {
    fn build<'a>(&self, ins: &[Expr<'a>]) -> Expr<'a> {
        match self {
            G::In(i) => ins[*i].clone(),
            G::C(c) => Expr::constant(*c),
            G::Un(u, a) => {
                let a = a.build(ins);
                match u {
                    Un::Neg => -a,
                    Un::Abs => a.abs(),
                    Un::Exp => a.max(-4.0).min(4.0).exp(),
                    Un::Log => (a.abs() + 0.5).log(),
                    Un::Sqrt => (a.abs() + 0.25).sqrt(),
                    Un::Tanh => a.tanh(),
                    Un::Sigmoid => a.sigmoid(),
                    Un::Silu => a.silu(),
                    Un::GeluTanh => a.gelu_tanh(),
                    Un::GeluErf => a.activation(Activation::GeluErf),
                    Un::Cast(DTypeKind::F16) => a.cast::<f16>(),
                    Un::Cast(DTypeKind::BF16) => a.cast::<bf16>(),
                    Un::Cast(_) => a.cast::<f32>(),
                }
            }
            G::Bin(b, x, y) => {
                let (x, y) = (x.build(ins), y.build(ins));
                match b {
                    Bin::Add => x + y,
                    Bin::Sub => x - y,
                    Bin::Mul => x * y,
                    Bin::Div => x / (y.abs() + 0.5),
                    Bin::Max => x.max(y),
                    Bin::Min => x.min(y),
                }
            }
            G::Fma(a, b, c) => a.build(ins).fma(b.build(ins), c.build(ins)),
            G::Sel(c, l, r, a, b) => {
                let (l, r) = (l.build(ins), r.build(ins));
                let cond = match c {
                    Cmp::Lt => l.lt(r),
                    Cmp::Le => l.le(r),
                    Cmp::Gt => l.gt(r),
                    Cmp::Ge => l.ge(r),
                    Cmp::Eq => l.equals(r),
                    Cmp::Ne => l.not_equals(r),
                };
                cond.select(a.build(ins), b.build(ins))
            }
        }
    }

    /// (value, error bound) at output element `i` of a `[rows, cols]` result.
    fn eval(&self, ins: &Inputs<'_>, i: usize, cols: usize) -> (f64, f64) {
        match self {
            G::In(k) => {
                let s = ins.shapes[*k];
                let (r, c) = (i / cols, i % cols);
                let at = if s.rows == 1 { 0 } else { r } * s.cols + if s.cols == 1 { 0 } else { c };
                (ins.values[*k][at], 0.0)
            }
            G::C(c) => (*c as f64, 0.0),
            G::Un(u, a) => {
                let (x, e) = a.eval(ins, i, cols);
                let sig = |z: f64| 1.0 / (1.0 + (-z).exp());
                match u {
                    Un::Neg => (-x, e),
                    Un::Abs => (x.abs(), e),
                    Un::Exp => {
                        let v = x.clamp(-4.0, 4.0).exp();
                        (v, v * (e + FN_ERR))
                    }
                    Un::Log => {
                        let d = x.abs() + 0.5;
                        let v = d.ln();
                        (v, (e + OP_ERR * d) / d + FN_ERR * v.abs() + FN_ERR)
                    }
                    Un::Sqrt => {
                        let d = x.abs() + 0.25;
                        let v = d.sqrt();
                        (v, (e + OP_ERR * d) / (2.0 * v) + FN_ERR * v)
                    }
                    Un::Tanh => {
                        let v = x.tanh();
                        (v, e + FN_ERR * v.abs() + FN_ERR * x.abs())
                    }
                    Un::Sigmoid => {
                        let v = sig(x);
                        (v, 0.25 * e + FN_ERR * v)
                    }
                    Un::Silu => {
                        let v = x * sig(x);
                        (v, 1.1 * e + FN_ERR * (v.abs() + x.abs()))
                    }
                    Un::GeluTanh => {
                        let u = (2.0 / std::f64::consts::PI).sqrt() * (x + 0.044715 * x.powi(3));
                        let v = 0.5 * x * (1.0 + u.tanh());
                        (v, 1.2 * e + FN_ERR * (v.abs() + x.abs() * (1.0 + x * x)))
                    }
                    Un::GeluErf => {
                        let v = 0.5 * x * (1.0 + erf_ref(x / 2f64.sqrt()));
                        // erf_ref is within 1.5e-7: times x/2.
                        (v, 1.2 * e + FN_ERR * (v.abs() + x.abs()) + 1e-7 * x.abs())
                    }
                    Un::Cast(k) => {
                        let v = round_to(*k, x);
                        // The GPU rounds its f32 value: another neighbour of the type within
                        // the error, or across a rounding boundary one ulp away.
                        (v, e + ulp(*k) * v.abs().max(x.abs()))
                    }
                }
            }
            G::Bin(b, x, y) => {
                let ((a, ea), (c, ec)) = (x.eval(ins, i, cols), y.eval(ins, i, cols));
                match b {
                    Bin::Add => (a + c, ea + ec + OP_ERR * (a + c).abs()),
                    Bin::Sub => (a - c, ea + ec + OP_ERR * (a - c).abs()),
                    Bin::Mul => (
                        a * c,
                        ea * c.abs() + ec * a.abs() + ea * ec + OP_ERR * (a * c).abs(),
                    ),
                    Bin::Div => {
                        let d = c.abs() + 0.5;
                        let ed = ec + OP_ERR * d;
                        let v = a / d;
                        (
                            v,
                            (ea + v.abs() * ed) / (d - ed).max(0.25) + OP_ERR * v.abs(),
                        )
                    }
                    Bin::Max => (if a > c { a } else { c }, ea.max(ec)),
                    Bin::Min => (if a < c { a } else { c }, ea.max(ec)),
                }
            }
            G::Fma(a, b, c) => {
                let ((x, ex), (y, ey), (z, ez)) = (
                    a.eval(ins, i, cols),
                    b.eval(ins, i, cols),
                    c.eval(ins, i, cols),
                );
                let v = x * y + z;
                (
                    v,
                    ex * y.abs() + ey * x.abs() + ex * ey + ez + OP_ERR * (v.abs() + (x * y).abs()),
                )
            }
            G::Sel(op, l, r, a, b) => {
                let ((l, _), (r, _)) = (l.eval(ins, i, cols), r.eval(ins, i, cols));
                let take = match op {
                    Cmp::Lt => l < r,
                    Cmp::Le => l <= r,
                    Cmp::Gt => l > r,
                    Cmp::Ge => l >= r,
                    Cmp::Eq => l == r,
                    Cmp::Ne => l != r,
                };
                if take {
                    a.eval(ins, i, cols)
                } else {
                    b.eval(ins, i, cols)
                }
            }
        }
    }
}

/// erf for the reference: Abramowitz & Stegun 7.1.26 (|error| < 1.5e-7), independent of the
/// library's.
fn erf_ref(x: f64) -> f64 {
    let t = 1.0 / (1.0 + 0.3275911 * x.abs());
    let y = 1.0
        - (((((1.061405429 * t - 1.453152027) * t) + 1.421413741) * t - 0.284496736) * t
            + 0.254829592)
            * t
            * (-x * x).exp();
    y.copysign(x)
}

fn leaf(inputs: usize) -> impl Strategy<Value = G> {
    prop_oneof![
        3 => (0..inputs).prop_map(G::In),
        1 => (-2.0f32..2.0).prop_map(G::C),
    ]
}

fn un() -> impl Strategy<Value = Un> {
    prop_oneof![
        Just(Un::Neg),
        Just(Un::Abs),
        Just(Un::Exp),
        Just(Un::Log),
        Just(Un::Sqrt),
        Just(Un::Tanh),
        Just(Un::Sigmoid),
        Just(Un::Silu),
        Just(Un::GeluTanh),
        Just(Un::GeluErf),
        Just(Un::Cast(DTypeKind::F32)),
        Just(Un::Cast(DTypeKind::F16)),
        Just(Un::Cast(DTypeKind::BF16)),
    ]
}

fn bin() -> impl Strategy<Value = Bin> {
    prop_oneof![
        Just(Bin::Add),
        Just(Bin::Sub),
        Just(Bin::Mul),
        Just(Bin::Div),
        Just(Bin::Max),
        Just(Bin::Min),
    ]
}

fn cmp() -> impl Strategy<Value = Cmp> {
    prop_oneof![
        Just(Cmp::Lt),
        Just(Cmp::Le),
        Just(Cmp::Gt),
        Just(Cmp::Ge),
        Just(Cmp::Eq),
        Just(Cmp::Ne),
    ]
}

/// Random graphs over `inputs` inputs, depth at most 4 (values stay far inside f16's range:
/// the root is clamped to ±1000 besides).
fn graph(inputs: usize) -> impl Strategy<Value = G> {
    leaf(inputs).prop_recursive(4, 24, 3, move |inner| {
        prop_oneof![
            3 => (un(), inner.clone()).prop_map(|(u, a)| G::Un(u, Box::new(a))),
            4 => (bin(), inner.clone(), inner.clone())
                .prop_map(|(b, x, y)| G::Bin(b, Box::new(x), Box::new(y))),
            1 => (inner.clone(), inner.clone(), inner.clone())
                .prop_map(|(a, b, c)| G::Fma(Box::new(a), Box::new(b), Box::new(c))),
            1 => (cmp(), leaf(inputs), leaf(inputs), inner.clone(), inner)
                .prop_map(|(c, l, r, a, b)| G::Sel(c, Box::new(l), Box::new(r), Box::new(a), Box::new(b))),
        ]
    })
}

fn clamp_root(g: G) -> G {
    G::Bin(
        Bin::Min,
        Box::new(G::Bin(Bin::Max, Box::new(g), Box::new(G::C(-1000.0)))),
        Box::new(G::C(1000.0)),
    )
}

/// One case: the input types and the output type, the result's shape.
#[derive(Debug, Clone)]
struct Case {
    graph: G,
    /// Input element types: a full matrix, a row, a column.
    kinds: [DTypeKind; 3],
    out: DTypeKind,
    rows: usize,
    cols: usize,
    seed: u64,
}

fn kind() -> impl Strategy<Value = DTypeKind> {
    prop_oneof![
        Just(DTypeKind::F32),
        Just(DTypeKind::F16),
        Just(DTypeKind::BF16)
    ]
}

fn case(big: bool) -> impl Strategy<Value = Case> {
    let rows = if big { 1..300usize } else { 1..12usize };
    // Columns: odd ones (the scalar path) and multiples of 8 (vectors with broadcasts).
    let cols = prop_oneof![1..40usize, (1..64usize).prop_map(|c| c * 8)];
    (
        graph(3),
        [kind(), kind(), kind()],
        kind(),
        rows,
        cols,
        any::<u64>(),
    )
        .prop_map(|(graph, kinds, out, rows, cols, seed)| Case {
            graph: clamp_root(graph),
            kinds,
            out,
            rows,
            cols,
            seed,
        })
}

fn upload(s: &warpdrive::Stream, k: DTypeKind, vals: &[f32]) -> Input {
    match k {
        DTypeKind::F16 => Input::F16(
            Buffer::from_host(
                s,
                &vals.iter().map(|&v| f16::from_f32(v)).collect::<Vec<_>>(),
            )
            .unwrap(),
        ),
        DTypeKind::BF16 => Input::BF16(
            Buffer::from_host(
                s,
                &vals.iter().map(|&v| bf16::from_f32(v)).collect::<Vec<_>>(),
            )
            .unwrap(),
        ),
        _ => Input::F32(Buffer::from_host(s, vals).unwrap()),
    }
}

/// A test input of one of the three types.
enum Input {
    F32(Buffer<f32>),
    F16(Buffer<f16>),
    BF16(Buffer<bf16>),
}

impl Input {
    fn values(&self, s: &warpdrive::Stream) -> Vec<f64> {
        match self {
            Input::F32(b) => b.to_host(s).unwrap().iter().map(|v| *v as f64).collect(),
            Input::F16(b) => b.to_host(s).unwrap().iter().map(|v| v.to_f64()).collect(),
            Input::BF16(b) => b.to_host(s).unwrap().iter().map(|v| v.to_f64()).collect(),
        }
    }
    fn expr(&self, rows: usize, cols: usize) -> Expr<'_> {
        match self {
            Input::F32(b) => Expr::matrix(b, rows, cols),
            Input::F16(b) => Expr::matrix(b, rows, cols),
            Input::BF16(b) => Expr::matrix(b, rows, cols),
        }
    }
}

/// Evaluates `c` on `dev` into `O` and checks every element; `Err` names the first bad one.
fn check_case_as<O: TestFloat>(dev: &Device, c: &Case) -> Result<(), TestCaseError> {
    let s = dev.new_stream().unwrap();
    let mut r = rng(c.seed);
    let (rows, cols) = (c.rows, c.cols);
    let shapes = [
        Shape::new(rows, cols),
        Shape::new(1, cols),
        Shape::new(rows, 1),
    ];
    let bufs: Vec<Input> = shapes
        .iter()
        .zip(c.kinds)
        .map(|(sh, k)| {
            let vals: Vec<f32> = (0..sh.rows * sh.cols)
                .map(|_| r.random_range(-2.0f32..2.0))
                .collect();
            upload(&s, k, &vals)
        })
        .collect();
    let exprs: Vec<Expr<'_>> = bufs
        .iter()
        .zip(shapes)
        .map(|(b, sh)| b.expr(sh.rows, sh.cols))
        .collect();
    let ins = Inputs {
        values: bufs.iter().map(|b| b.values(&s)).collect(),
        exprs,
        shapes: shapes.to_vec(),
    };
    let e = c.graph.build(&ins.exprs);
    let sh = e.shape().map_err(|e| TestCaseError::fail(e.to_string()))?;
    // The broadcast shape: the full matrix's unless the graph does not read it.
    let n = sh.rows * sh.cols;
    let mut y = poisoned::<O>(&s, n, nan());
    e.eval_into(&s, &mut y)
        .map_err(|e| TestCaseError::fail(e.to_string()))?;
    let got = y.to_host(&s).unwrap();
    for (i, g) in got.iter().enumerate() {
        let (want, err) = c.graph.eval(&ins, i, sh.cols);
        let bound = 2.0 * err + ulp(O::KIND) * want.abs() + O::TINY;
        let g = g.to_f64();
        prop_assert!(
            (g - want).abs() <= bound,
            "{} element {i} of {sh}: got {g}, want {want} (bound {bound})",
            O::NAME
        );
    }
    Ok(())
}

fn check_case(dev: &Device, c: &Case) -> Result<(), TestCaseError> {
    match c.out {
        DTypeKind::F16 => check_case_as::<f16>(dev, c),
        DTypeKind::BF16 => check_case_as::<bf16>(dev, c),
        _ => check_case_as::<f32>(dev, c),
    }
}

/// Random graphs over a full matrix, a row and a column of mixed types, into each type.
fn random_graphs_body(dev: &Device) {
    let cases = if dev.is_cuda() { 96 } else { 256 };
    let mut runner = TestRunner::new(Config {
        cases,
        failure_persistence: None,
        ..Config::default()
    });
    let result = runner.run(&case(dev.is_cuda()), |c| check_case(dev, &c));
    if let Err(e) = result {
        panic!("{e}");
    }
}

device_test!(
    random_graphs_match_the_f64_reference,
    gpu_random_graphs_match_the_f64_reference,
    random_graphs_body
);

/// Sizes: empty, one, odd with a scalar tail, and several waves of vectors plus a tail.
const SIZES: [usize; 4] = [0, 1, 1023, (1 << 20) + 5];

/// A 5-op chain of the benchmarks' kind (fma, max, compare/select, cast) over `T`.
fn chain_body_as<T: TestFloat>(dev: &Device, seed: u64) {
    let s = dev.new_stream().unwrap();
    let mut r = rng(seed);
    for n in SIZES {
        let xs: Vec<T> = random_in(&mut r, n, -3.0, 3.0);
        let ys: Vec<T> = random_in(&mut r, n, -3.0, 3.0);
        let (x, y) = (
            Buffer::from_host(&s, &xs).unwrap(),
            Buffer::from_host(&s, &ys).unwrap(),
        );
        let (ex, ey) = (Expr::input(&x), Expr::input(&y));
        let e = ex
            .fma(1.5, &ey)
            .max(-1.0)
            .gt(&ex)
            .select(&ex * &ey, ex - 0.5)
            .cast::<bf16>()
            + 0.25;
        let mut out = poisoned::<T>(&s, n, nan());
        e.eval_into(&s, &mut out).unwrap();
        let got = out.to_host(&s).unwrap();
        for (i, g) in got.iter().enumerate() {
            let (a, b) = (xs[i].to_f64(), ys[i].to_f64());
            let m = (a * 1.5 + b).max(-1.0);
            // Either branch where f32 rounding may decide the comparison.
            let branches: &[f64] = if (m - a).abs() <= 4.0 * EPS * (m.abs() + a.abs()) {
                &[a * b, a - 0.5]
            } else if m > a {
                &[a * b]
            } else {
                &[a - 0.5]
            };
            let ok = branches.iter().any(|&v| {
                let want = round_to(DTypeKind::BF16, v) + 0.25;
                // The bf16 cast may take the other neighbour (an f32 product near a tie).
                let bound = ulp(DTypeKind::BF16) * v.abs() + ulp(T::KIND) * want.abs() + T::TINY;
                (g.to_f64() - want).abs() <= bound
            });
            assert!(
                ok,
                "{} n={n} i={i}: a={a} b={b}: got {g:?}, want one of {branches:?}",
                T::NAME
            );
        }
    }
}

device_test!(chain_of_five_ops, gpu_chain_of_five_ops, |dev| {
    let seed = seed("chain_of_five_ops");
    chain_body_as::<f32>(dev, seed);
    chain_body_as::<f16>(dev, seed);
    chain_body_as::<bf16>(dev, seed);
});

// A row bias and a column scale over a matrix, rows of odd length and of a multiple of 8.
device_test!(
    broadcasts_rows_and_columns,
    gpu_broadcasts_rows_and_columns,
    |dev| {
        let s = dev.new_stream().unwrap();
        let mut r = rng(seed("broadcasts_rows_and_columns"));
        for (rows, cols) in [(1, 1), (3, 5), (7, 64), (513, 24), (65, 1001)] {
            let xs: Vec<bf16> = random_in(&mut r, rows * cols, -2.0, 2.0);
            let bias: Vec<f32> = random_in(&mut r, cols, -1.0, 1.0);
            let scale: Vec<f16> = random_in(&mut r, rows, 0.5, 2.0);
            let x = Buffer::from_host(&s, &xs).unwrap();
            let b = Buffer::from_host(&s, &bias).unwrap();
            let sc = Buffer::from_host(&s, &scale).unwrap();
            let e = (Expr::matrix(&x, rows, cols) + &b) * Expr::col(&sc) - 1.0;
            assert_eq!(e.shape().unwrap(), Shape::new(rows, cols));
            let mut out = poisoned::<f32>(&s, rows * cols, f32::NAN);
            e.eval_into(&s, &mut out).unwrap();
            let got = out.to_host(&s).unwrap();
            for i in 0..rows * cols {
                let (ri, ci) = (i / cols, i % cols);
                let want = (xs[i].to_f64() + bias[ci] as f64) * scale[ri].to_f64() - 1.0;
                let terms =
                    (xs[i].to_f64().abs() + (bias[ci] as f64).abs()) * scale[ri].to_f64() + 1.0;
                assert!(
                    (got[i] as f64 - want).abs() <= 1e-6 * terms,
                    "[{rows}, {cols}] at ({ri}, {ci}): got {}, want {want}",
                    got[i]
                );
            }
        }
    }
);

// NaN and infinities through every operation, as IEEE and the documented rules say (max and
// min propagate NaN; comparisons with NaN are false but `!=`; select takes NaN as true).
device_test!(
    nan_and_infinity_follow_ieee,
    gpu_nan_and_infinity_follow_ieee,
    |dev| {
        let s = dev.new_stream().unwrap();
        let inf = f32::INFINITY;
        let a = [f32::NAN, inf, -inf, 1.0, -0.0, 0.0, inf, 2.0, f32::NAN];
        let b = [1.0, -inf, -inf, f32::NAN, 0.0, -0.0, 1.0, inf, f32::NAN];
        let (xa, xb) = (
            Buffer::from_host(&s, &a).unwrap(),
            Buffer::from_host(&s, &b).unwrap(),
        );
        let (ea, eb) = (Expr::input(&xa), Expr::input(&xb));
        type Case<'e> = (&'static str, Expr<'e>, fn(f64, f64) -> f64);
        let cases: Vec<Case<'_>> = vec![
            ("add", &ea + &eb, |x, y| x + y),
            ("sub", &ea - &eb, |x, y| x - y),
            ("mul", &ea * &eb, |x, y| x * y),
            ("div", &ea / &eb, |x, y| x / y),
            // NaN if either is; otherwise the larger (the second of two equal values).
            (
                "max",
                ea.max(&eb),
                |x, y| if x.is_nan() || x > y { x } else { y },
            ),
            (
                "min",
                ea.min(&eb),
                |x, y| if x.is_nan() || x < y { x } else { y },
            ),
            ("lt", ea.lt(&eb), |x, y| (x < y) as u8 as f64),
            ("ge", ea.ge(&eb), |x, y| (x >= y) as u8 as f64),
            ("eq", ea.equals(&eb), |x, y| (x == y) as u8 as f64),
            ("ne", ea.not_equals(&eb), |x, y| (x != y) as u8 as f64),
            ("select", ea.select(&eb, 7.0), |x, y| {
                if x != 0.0 {
                    y
                } else {
                    7.0
                }
            }),
            ("exp", ea.exp(), |x, _| x.exp()),
            ("log", eb.log(), |_, y| y.ln()),
            ("sqrt", ea.sqrt(), |x, _| x.sqrt()),
            ("neg", -&ea, |x, _| -x),
            ("abs", ea.abs(), |x, _| x.abs()),
            ("tanh", ea.tanh(), |x, _| x.tanh()),
            ("fma", ea.fma(&eb, 1.0), |x, y| x * y + 1.0),
            ("cast_f16", (&ea * 1e5).cast::<f16>(), |x, _| {
                f16::from_f32((x * 1e5) as f32).to_f64()
            }),
        ];
        for (name, e, f) in cases {
            let got = e.eval::<f32>(&s).unwrap().to_host(&s).unwrap();
            for (i, g) in got.iter().enumerate() {
                let want = f(a[i] as f64, b[i] as f64);
                let g = *g as f64;
                let ok = if want.is_nan() {
                    g.is_nan()
                } else if want.is_infinite() || want == 0.0 {
                    g == want && g.is_sign_negative() == want.is_sign_negative()
                } else {
                    (g - want).abs() <= 8.0 * EPS * want.abs()
                };
                assert!(ok, "{name}({}, {}): got {g}, want {want}", a[i], b[i]);
            }
        }
    }
);

#[test]
fn shapes_that_do_not_broadcast_are_an_error_naming_them() {
    let s = Device::cpu().new_stream().unwrap();
    let x = Buffer::from_host(&s, &[1.0f32; 12]).unwrap();
    let v = Buffer::from_host(&s, &[1.0f32; 5]).unwrap();
    let e = Expr::matrix(&x, 3, 4) + Expr::col(&v);
    let err = e.eval::<f32>(&s).unwrap_err();
    assert!(
        matches!(&err, Error::InvalidArgument(m) if m.contains("[3, 4]") && m.contains("[5, 1]")),
        "{err}"
    );
    // The error travels up through later operations, and `source` reports it too.
    let later = (e * 2.0).exp();
    assert!(later.shape().unwrap_err().to_string().contains("[5, 1]"));
    assert!(later.source::<f32>().is_err());
    let bad = Expr::matrix(&x, 5, 3);
    let err = bad.eval::<f32>(&s).unwrap_err().to_string();
    assert!(err.contains("12") && err.contains("[5, 3]"), "{err}");
}

#[test]
fn outputs_and_types_are_checked() {
    let s = Device::cpu().new_stream().unwrap();
    let x = Buffer::from_host(&s, &[1.0f32; 6]).unwrap();
    let mut short = Buffer::<f32>::zeros(&s, 5).unwrap();
    let e = Expr::input(&x) + 1.0;
    assert!(matches!(
        e.eval_into(&s, &mut short),
        Err(Error::LengthMismatch { .. })
    ));
    assert!(matches!(e.eval::<f64>(&s), Err(Error::Unsupported(_))));
    let d = Buffer::from_host(&s, &[1.0f64; 6]).unwrap();
    assert!(matches!(
        (Expr::input(&d) + 1.0).eval::<f32>(&s),
        Err(Error::Unsupported(_))
    ));
    // Empty results are valid no-ops.
    let empty = Buffer::<f32>::zeros(&s, 0).unwrap();
    assert_eq!(
        (Expr::input(&empty) * 2.0).eval::<f32>(&s).unwrap().len(),
        0
    );
}

#[test]
fn the_source_is_keyed_by_structure_not_values() {
    let s = Device::cpu().new_stream().unwrap();
    let a = Buffer::from_host(&s, &[1.0f32; 64]).unwrap();
    let b = Buffer::from_host(&s, &[1.0f32; 1000]).unwrap();
    let src = |e: Expr<'_>| e.source::<bf16>().unwrap();
    let one = src((Expr::input(&a) * 3.0).silu());
    assert_eq!(one, src((Expr::input(&b) * -0.5).silu()));
    assert_ne!(one, src((Expr::input(&a) + 3.0).silu()));
    assert!(
        one.contains("__launch_bounds__(256)") && one.contains("__restrict__"),
        "{one}"
    );
    assert!(one.contains("load_vec<float, W>"), "{one}");
}

/// The generated kernels of the benchmark chains, the broadcasts and many random graphs,
/// compiled for sm_90a through the real NVRTC (no GPU): 16-byte vector loads in the PTX.
#[test]
#[ignore = "needs NVRTC: eval $(scripts/setup-nvrtc)"]
fn generated_kernels_compile_with_nvrtc() {
    let s = Device::cpu().new_stream().unwrap();
    let n = 1024;
    let x = Buffer::from_host(&s, &vec![1.0f32; n]).unwrap();
    let h = Buffer::from_host(&s, &vec![bf16::ONE; n]).unwrap();
    let row = Buffer::from_host(&s, &[f16::ONE; 32]).unwrap();
    let col = Buffer::from_host(&s, &[1.0f32; 32]).unwrap();
    let (ex, eh) = (Expr::input(&x), Expr::input(&h));
    let m = Expr::matrix(&x, 32, 32);
    let graphs = vec![
        ("chain2", (&ex * 1.5 + 0.25), true),
        (
            "chain5-bf16",
            eh.fma(2.0, &eh).max(0.0).gt(0.5).select(&eh, -&eh) * 3.0,
            true,
        ),
        (
            "activations",
            ex.gelu_tanh().silu().gelu_erf().sigmoid().tanh(),
            true,
        ),
        ("math", (ex.abs() + 1.0).log().sqrt().exp() / 3.0, true),
        (
            "broadcast",
            (&m + Expr::input(&row)) * Expr::col(&col) - 1.0,
            true,
        ),
        (
            "casts",
            ex.cast::<f16>().cast::<bf16>().cast::<f32>() + 1.0,
            true,
        ),
        (
            "gather",
            Expr::gather(&h, (ex.abs() * 100.0).min(1000.0)) + &ex,
            true,
        ),
        (
            "gather-rows",
            Expr::gather(&x, Expr::col(&col) * 32.0 + Expr::col_index(32)) * &m,
            true,
        ),
    ];
    // Every declared architecture (a device picks its own or the highest below it).
    for arch in ["sm_75", "sm_80", "sm_90"].map(|a| Arch::parse(a).expect("an arch name")) {
        let e = &graphs[1].1;
        let ptx = e
            .ptx::<bf16>(arch)
            .unwrap_or_else(|err| panic!("{arch}: {err}"));
        assert!(ptx.contains(".entry fuse_map"), "{arch}");
    }
    for (name, e, vector) in graphs {
        for out in [DTypeKind::F32, DTypeKind::F16, DTypeKind::BF16] {
            let ptx = match out {
                DTypeKind::F16 => e.ptx::<f16>(Arch::SM_90A),
                DTypeKind::BF16 => e.ptx::<bf16>(Arch::SM_90A),
                _ => e.ptx::<f32>(Arch::SM_90A),
            }
            .unwrap_or_else(|err| panic!("{name} -> {}: {err}", out.name()));
            assert!(ptx.contains(".entry fuse_map"), "{name}: no entry");
            if vector {
                assert!(
                    ptx.contains(".v4.") || ptx.contains(".v2."),
                    "{name}: no vector access"
                );
            }
        }
    }
    // Random graphs of the property test.
    let mut runner = TestRunner::new(Config {
        cases: 24,
        failure_persistence: None,
        ..Config::default()
    });
    let result = runner.run(&case(false), |c| {
        let bufs = [
            Buffer::from_host(&s, &vec![1.0f32; c.rows * c.cols]).unwrap(),
            Buffer::from_host(&s, &vec![1.0f32; c.cols]).unwrap(),
            Buffer::from_host(&s, &vec![1.0f32; c.rows]).unwrap(),
        ];
        let ins = [
            Expr::matrix(&bufs[0], c.rows, c.cols),
            Expr::input(&bufs[1]),
            Expr::col(&bufs[2]),
        ];
        let e = c.graph.build(&ins);
        e.ptx::<bf16>(Arch::SM_90A)
            .map(|_| ())
            .map_err(|err| TestCaseError::fail(format!("{c:?}: {err}")))
    });
    if let Err(e) = result {
        panic!("{e}");
    }
}

// A tuned block size (each candidate its own kernel) computes what the default one does.
device_test!(
    tuned_blocks_compute_the_same,
    gpu_tuned_blocks_compute_the_same,
    |dev| {
        let s = dev.new_stream().unwrap();
        let mut r = rng(seed("tuned_blocks_compute_the_same"));
        let n = (1 << 20) + 5;
        let xs: Vec<bf16> = random_in(&mut r, n, -2.0, 2.0);
        let x = Buffer::from_host(&s, &xs).unwrap();
        let e = (Expr::input(&x) * 1.5 + 0.25).silu();
        let block = e.tune::<f32>(&s).unwrap();
        assert!(
            warpdrive::fuse::BLOCK_CANDIDATES.contains(&block),
            "{block}"
        );
        let mut out = poisoned::<f32>(&s, n, f32::NAN);
        e.eval_into(&s, &mut out).unwrap();
        for (i, (g, x)) in out.to_host(&s).unwrap().iter().zip(&xs).enumerate() {
            let v = 1.5 * x.to_f64() + 0.25;
            let want = v / (1.0 + (-v).exp());
            let bound = 1e-6 * (want.abs() + 1.5 * x.to_f64().abs() + 0.25);
            assert!(
                (*g as f64 - want).abs() <= bound,
                "block {block} at {i}: {g} vs {want}"
            );
        }
    }
);

// Every map shape a tuning tries (8-byte vectors included: f32 in, f32 out) computes the
// same as the reference at an odd size; shapes outside the candidates are refused.
device_test!(
    every_map_shape_computes_the_same,
    gpu_every_map_shape_computes_the_same,
    |dev| {
        let s = dev.new_stream().unwrap();
        let mut r = rng(seed("every_map_shape_computes_the_same"));
        let n = (1 << 20) + 7;
        let xs: Vec<f32> = random_in(&mut r, n, -2.0, 2.0);
        let ys: Vec<f32> = random_in(&mut r, n, -2.0, 2.0);
        let (x, y) = (
            Buffer::from_host(&s, &xs).unwrap(),
            Buffer::from_host(&s, &ys).unwrap(),
        );
        let e = (Expr::input(&x) * Expr::input(&y)) * 1.5 + 0.25;
        let mut shapes: Vec<MapShape> = warpdrive::fuse::BLOCK_CANDIDATES
            .iter()
            .map(|&block| MapShape {
                block,
                vector_bytes: 16,
                plain: false,
            })
            .collect();
        for plain in [false, true] {
            shapes.extend([256, 512].map(|block| MapShape {
                block,
                vector_bytes: 8,
                plain,
            }));
        }
        for shape in shapes {
            let mut out = poisoned::<f32>(&s, n, f32::NAN);
            e.eval_into_shape(&s, &mut out, shape).unwrap();
            for (i, g) in out.to_host(&s).unwrap().iter().enumerate() {
                let want = 1.5 * (xs[i] as f64 * ys[i] as f64) + 0.25;
                let bound = 1e-6 * (1.5 * (xs[i] as f64 * ys[i] as f64).abs() + 0.25);
                assert!(
                    (*g as f64 - want).abs() <= bound,
                    "{shape} at {i}: {g} vs {want}"
                );
            }
        }
        let mut out = poisoned::<f32>(&s, n, f32::NAN);
        for bad in [(100, 16), (2048, 16), (256, 4), (256, 32)] {
            let shape = MapShape {
                block: bad.0,
                vector_bytes: bad.1,
                plain: false,
            };
            assert!(e.eval_into_shape(&s, &mut out, shape).is_err(), "{shape}");
        }
        // 8-byte vectors over bf16 in, f32 out: refused (mixed element sizes).
        let h: Vec<bf16> = random_in(&mut r, 99, -2.0, 2.0);
        let hb = Buffer::from_host(&s, &h).unwrap();
        let mut o99 = poisoned::<f32>(&s, 99, f32::NAN);
        let narrow = MapShape {
            block: 256,
            vector_bytes: 8,
            plain: false,
        };
        assert!((Expr::input(&hb) * 2.0)
            .eval_into_shape(&s, &mut o99, narrow)
            .is_err());
    }
);

// Gathers: embedding rows by index (a column of indices times the row length plus the column
// index), a gather inside a row reduction, and NaN for NaN, negative and past-the-end
// indices (no read outside the table).
device_test!(gathers_read_by_index, gpu_gathers_read_by_index, |dev| {
    let s = dev.new_stream().unwrap();
    let mut r = rng(seed("gathers_read_by_index"));
    let (vocab, dim, rows) = (1000, 64, 333);
    let table: Vec<bf16> = random_in(&mut r, vocab * dim, -1.0, 1.0);
    let idx: Vec<f32> = (0..rows).map(|_| r.random_range(0..vocab) as f32).collect();
    let (t, i) = (
        Buffer::from_host(&s, &table).unwrap(),
        Buffer::from_host(&s, &idx).unwrap(),
    );
    let at = Expr::col(&i) * dim as f32 + Expr::col_index(dim);
    let emb = Expr::gather(&t, &at);
    assert_eq!(emb.shape().unwrap(), Shape::new(rows, dim));
    let got = (&emb * 2.0).eval::<f32>(&s).unwrap().to_host(&s).unwrap();
    let norms = (&emb * &emb)
        .sum_rows()
        .eval::<f32>(&s)
        .unwrap()
        .to_host(&s)
        .unwrap();
    for row in 0..rows {
        let base = idx[row] as usize * dim;
        let mut norm = 0.0f64;
        for c in 0..dim {
            let v = table[base + c].to_f64();
            norm += v * v;
            assert_eq!(got[row * dim + c] as f64, 2.0 * v, "row {row} col {c}");
        }
        assert!(
            (norms[row] as f64 - norm).abs() <= 4e-6 * norm,
            "row {row}: {} vs {norm}",
            norms[row]
        );
    }
    let odd = Buffer::from_host(&s, &[2.0f32, -1.0, f32::NAN, 1e9, 4.999, 5.0, -0.5]).unwrap();
    let small = Buffer::from_host(&s, &[10.0f32, 11.0, 12.0, 13.0, 14.0]).unwrap();
    let got = Expr::gather(&small, Expr::input(&odd))
        .eval::<f32>(&s)
        .unwrap()
        .to_host(&s)
        .unwrap();
    let want = [12.0, f32::NAN, f32::NAN, f32::NAN, 14.0, f32::NAN, f32::NAN];
    for (g, w) in got.iter().zip(want) {
        assert!(g == &w || (g.is_nan() && w.is_nan()), "{got:?} vs {want:?}");
    }
});
