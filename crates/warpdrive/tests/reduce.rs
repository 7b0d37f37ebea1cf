//! Reductions (sum / max / mean, whole buffer and per row) on both backends, against an f64
//! reference: sums and means within tol · Σ|x| (· 1/n for a mean) + the output's subnormal
//! spacing, tol = 1e-6 (f32), 1e-3 (f16), 1e-2 (bf16), 1e-12 (f64); max exact. NaN in, NaN
//! out for max; over nothing: sum 0, max -inf, mean NaN. Outputs are poisoned first.

mod common;

use common::{cuda, device_test, poisoned, random_in, rng, same_or_both_nan, seed, TestFloat};
use half::{bf16, f16};
use warpdrive::ops::{self, Loads, Reduce, ReduceOp, Scratch, REDUCE_SCRATCH_BYTES};
use warpdrive::{Buffer, Device, Error, Float};

const SIZES: [usize; 5] = [0, 1, 1023, 4097, (1 << 20) + 3];
const OPS: [ReduceOp; 3] = [ReduceOp::Sum, ReduceOp::Max, ReduceOp::Mean];

/// (rows, cols): warp rows, block rows (> 1024 wide), a single column, many short rows.
const SHAPES: [(usize, usize); 7] = [
    (1, 1),
    (3, 1000),
    (257, 33),
    (64, 1024),
    (5, 1025),
    (2, 70001),
    (0, 7),
];

fn reference(op: ReduceOp, xs: &[f64]) -> (f64, f64) {
    // (value, its error scale)
    let abs: f64 = xs.iter().map(|v| v.abs()).sum();
    match op {
        ReduceOp::Sum => (xs.iter().sum(), abs),
        ReduceOp::Mean => (
            xs.iter().sum::<f64>() / xs.len() as f64,
            abs / xs.len() as f64,
        ),
        ReduceOp::Max => (
            xs.iter().fold(f64::NEG_INFINITY, |m, &v| {
                if m.is_nan() || v.is_nan() {
                    f64::NAN
                } else {
                    m.max(v)
                }
            }),
            0.0,
        ),
    }
}

/// Checks `got` against the f64 reference; returns (got, the bound it met).
fn check(what: &str, op: ReduceOp, got: f64, xs: &[f64], tol: f64, tiny: f64) -> (f64, f64) {
    let (want, scale) = reference(op, xs);
    let bound = tol * scale + tiny;
    if op == ReduceOp::Max || xs.is_empty() {
        assert!(
            same_or_both_nan(got, want),
            "{what}: got {got}, want {want}"
        );
    } else {
        let err = (got - want).abs();
        assert!(
            err <= bound,
            "{what}: got {got}, want {want} (err {err:e}, scale {scale})"
        );
    }
    (got, bound)
}

/// Whole-buffer reductions at every size, both kinds of loads; NaN injected for max.
fn whole_body<T: Float>(
    dev: &Device,
    seed: u64,
    tol: f64,
    tiny: f64,
    random: fn(&mut rand::rngs::StdRng, usize) -> Vec<T>,
    poison: T,
) -> Vec<(f64, f64)> {
    let s = dev.new_stream().unwrap();
    let scratch = Scratch::new(&s, REDUCE_SCRATCH_BYTES).unwrap();
    let mut r = rng(seed);
    let mut outs = Vec::new();
    for n in SIZES {
        let mut xs = random(&mut r, n);
        for op in OPS {
            for loads in [Loads::Vector, Loads::Scalar] {
                let x = Buffer::from_host(&s, &xs).unwrap();
                let mut out = poisoned::<T>(&s, 1, poison);
                ops::reduce_into(&s, Reduce { op, loads }, &x, &mut out, &scratch).unwrap();
                let got = out.to_host(&s).unwrap()[0];
                let f: Vec<f64> = xs.iter().map(|v| v.to_f64()).collect();
                let what = format!("{op:?} {loads:?} n={n}");
                outs.push(check(&what, op, got.to_f64(), &f, tol, tiny));
                // Deterministic: the same input gives the same bits.
                let mut again = poisoned::<T>(&s, 1, poison);
                ops::reduce_into(&s, Reduce { op, loads }, &x, &mut again, &scratch).unwrap();
                assert_eq!(
                    again.to_host(&s).unwrap()[0].to_bits_u64(),
                    got.to_bits_u64()
                );
            }
        }
        if n > 100 {
            xs[n / 2] = poison; // NaN: max is NaN
            let x = Buffer::from_host(&s, &xs).unwrap();
            let mut out = Buffer::<T>::zeros(&s, 1).unwrap();
            ops::reduce_into(&s, ReduceOp::Max, &x, &mut out, &scratch).unwrap();
            assert!(
                out.to_host(&s).unwrap()[0].to_f64().is_nan(),
                "max with NaN n={n}"
            );
        }
    }
    outs
}

fn rows_body<T: Float>(
    dev: &Device,
    seed: u64,
    tol: f64,
    tiny: f64,
    random: fn(&mut rand::rngs::StdRng, usize) -> Vec<T>,
    poison: T,
) -> Vec<(f64, f64)> {
    let s = dev.new_stream().unwrap();
    let mut r = rng(seed);
    let mut outs = Vec::new();
    for (rows, cols) in SHAPES {
        let xs = random(&mut r, rows * cols);
        let x = Buffer::from_host(&s, &xs).unwrap();
        for op in OPS {
            let mut out = poisoned::<T>(&s, rows, poison);
            ops::reduce_rows(&s, op, &x, cols, &mut out).unwrap();
            let got = out.to_host(&s).unwrap();
            for (i, row) in xs.chunks_exact(cols).enumerate() {
                let f: Vec<f64> = row.iter().map(|v| v.to_f64()).collect();
                let what = format!("rows {op:?} {rows}x{cols} row {i}");
                outs.push(check(&what, op, got[i].to_f64(), &f, tol, tiny));
            }
        }
    }
    outs
}

fn random_half<T: TestFloat>(r: &mut rand::rngs::StdRng, n: usize) -> Vec<T> {
    random_in(r, n, -1.0, 1.0)
}

/// Every reduction of every type on `dev`: (result, bound) pairs in a fixed order.
fn run_all(dev: &Device, sd: u64) -> Vec<(f64, f64)> {
    let mut out = Vec::new();
    macro_rules! one {
        ($t:ty, $tol:expr, $tiny:expr, $random:expr) => {{
            let nan: $t = <$t as Float>::from_f64(f64::NAN);
            out.extend(whole_body::<$t>(dev, sd, $tol, $tiny, $random, nan));
            out.extend(rows_body::<$t>(dev, sd, $tol, $tiny, $random, nan));
        }};
    }
    one!(f32, f32::TOL, f32::TINY, random_half::<f32>);
    one!(f16, f16::TOL, f16::TINY, random_half::<f16>);
    one!(bf16, bf16::TOL, bf16::TINY, random_half::<bf16>);
    one!(f64, 1e-12, 0.0, common::random_f64);
    out
}

/// Every reduction on `dev` (each checked against the f64 reference in the bodies). On
/// CUDA the CPU backend runs the same inputs: the two agree within the sum of both bounds.
fn reductions_body(dev: &Device) {
    let sd = seed("reductions");
    let g = run_all(dev, sd);
    if !dev.is_cuda() {
        return;
    }
    let c = run_all(&Device::cpu(), sd);
    assert_eq!(g.len(), c.len());
    for (i, ((a, ba), (b, bb))) in g.iter().zip(&c).enumerate() {
        assert!(
            same_or_both_nan(*a, *b) || (a - b).abs() <= ba + bb,
            "result {i}: cuda {a} vs cpu {b}"
        );
    }
}

device_test!(
    cpu_reductions,
    gpu_smem_reductions_match_cpu,
    reductions_body
);

#[test]
fn reduction_errors() {
    let s = Device::cpu().new_stream().unwrap();
    let x = Buffer::<f32>::zeros(&s, 12).unwrap();
    let mut two = Buffer::<f32>::zeros(&s, 2).unwrap();
    let scratch = Scratch::new(&s, REDUCE_SCRATCH_BYTES).unwrap();
    let small = Scratch::new(&s, 64).unwrap();
    let mut one = Buffer::<f32>::zeros(&s, 1).unwrap();
    assert!(matches!(
        ops::reduce_into(&s, ReduceOp::Sum, &x, &mut two, &scratch),
        Err(Error::LengthMismatch { .. })
    ));
    assert!(matches!(
        ops::reduce_into(&s, ReduceOp::Sum, &x, &mut one, &small),
        Err(Error::InvalidArgument(_))
    ));
    assert!(matches!(
        ops::reduce_rows(&s, ReduceOp::Sum, &x, 5, &mut two),
        Err(Error::InvalidArgument(_))
    ));
    assert!(matches!(
        ops::reduce_rows(&s, ReduceOp::Sum, &x, 0, &mut two),
        Err(Error::InvalidArgument(_))
    ));
    assert!(matches!(
        ops::reduce_rows(&s, ReduceOp::Max, &x, 4, &mut two),
        Err(Error::LengthMismatch { .. })
    ));
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_smem_reduction_errors_and_empty() {
    let s = cuda().new_stream().unwrap();
    let scratch = Scratch::new(&s, REDUCE_SCRATCH_BYTES).unwrap();
    let small = Scratch::new(&s, 64).unwrap();
    let x = Buffer::<f32>::zeros(&s, 12).unwrap();
    let mut one = poisoned::<f32>(&s, 1, 1.0);
    assert!(matches!(
        ops::reduce_into(&s, ReduceOp::Sum, &x, &mut one, &small),
        Err(Error::InvalidArgument(_))
    ));
    let empty = Buffer::<f32>::zeros(&s, 0).unwrap();
    for (op, want) in [
        (ReduceOp::Sum, 0.0),
        (ReduceOp::Max, f64::NEG_INFINITY),
        (ReduceOp::Mean, f64::NAN),
    ] {
        ops::reduce_into(&s, op, &empty, &mut one, &scratch).unwrap();
        assert!(
            same_or_both_nan(one.to_host(&s).unwrap()[0] as f64, want),
            "{op:?} of nothing"
        );
    }
    let cpu = Device::cpu().new_stream().unwrap();
    assert!(matches!(
        ops::reduce_into(&cpu, ReduceOp::Sum, &x, &mut one, &scratch),
        Err(Error::DeviceMismatch { .. })
    ));
}
