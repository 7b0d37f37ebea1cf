//! GEMMs on both backends: every dtype, every transpose, odd shapes, strided-batched and
//! grouped, against an f64 reference with the error bounded relative to Σ|a·b| of each
//! output element (DESIGN.md: f32 1e-6, f16 1e-3, bf16 1e-2; TF32 2e-3). Outputs are
//! poisoned (NaN) first. GPU tests (`gpu_*`) also compare CUDA with the CPU backend.

mod common;

use common::{cuda, device_test, random_f32, rng, seed};
use half::{bf16, f16};
use warpdrive::ops::gemm::{matmul_batched, matmul_grouped, matmul_with, GemmOptions};
use warpdrive::{Buffer, DType, Device, Error, Stream};

trait Elem: DType {
    const TOL: f64;
    fn from_f32(v: f32) -> Self;
    fn to_f64(self) -> f64;
}
impl Elem for f32 {
    const TOL: f64 = 1e-6;
    fn from_f32(v: f32) -> Self {
        v
    }
    fn to_f64(self) -> f64 {
        self as f64
    }
}
impl Elem for f16 {
    const TOL: f64 = 1e-3;
    fn from_f32(v: f32) -> Self {
        f16::from_f32(v)
    }
    fn to_f64(self) -> f64 {
        f16::to_f64(self)
    }
}
impl Elem for bf16 {
    const TOL: f64 = 1e-2;
    fn from_f32(v: f32) -> Self {
        bf16::from_f32(v)
    }
    fn to_f64(self) -> f64 {
        bf16::to_f64(self)
    }
}

/// Odd shapes, degenerate ones included.
const SHAPES: [(usize, usize, usize); 7] = [
    (1, 1, 1),
    (17, 33, 65),
    (64, 1, 129),
    (129, 67, 31),
    (5, 7, 0),
    (3, 0, 4),
    (0, 5, 3),
];

const TRANSPOSES: [(bool, bool); 4] = [(false, false), (true, false), (false, true), (true, true)];

fn random<T: Elem>(r: &mut rand::rngs::StdRng, n: usize) -> Vec<T> {
    random_f32(r, n).into_iter().map(T::from_f32).collect()
}

fn poisoned<T: Elem>(s: &Stream, n: usize) -> Buffer<T> {
    Buffer::from_host(s, &vec![T::from_f32(f32::NAN); n]).unwrap()
}

/// Element (i, p) of op(x) where x is stored rows×cols (row-major) and op transposes when
/// `t`: op(x) is (t ? cols×rows : rows×cols).
fn at<T: Elem>(x: &[T], t: bool, i: usize, p: usize, stored_cols: usize) -> f64 {
    if t {
        x[p * stored_cols + i].to_f64()
    } else {
        x[i * stored_cols + p].to_f64()
    }
}

/// Checks `c` (m×n) against op(a)·op(b) in f64; `tol` relative to Σ|a·b| per element.
#[allow(clippy::too_many_arguments)]
fn check<T: Elem>(
    what: &str,
    a: &[T],
    b: &[T],
    c: &[T],
    (m, n, k): (usize, usize, usize),
    (ta, tb): (bool, bool),
    tol: f64,
) {
    let a_cols = if ta { m } else { k };
    let b_cols = if tb { k } else { n };
    for i in 0..m {
        for j in 0..n {
            let (mut want, mut mag) = (0.0f64, 0.0f64);
            for p in 0..k {
                let t = at(a, ta, i, p, a_cols) * at(b, tb, p, j, b_cols);
                want += t;
                mag += t.abs();
            }
            let got = c[i * n + j].to_f64();
            // The output's own rounding to T is relative to |want| (≤ Σ|a·b|).
            assert!(
                (got - want).abs() <= tol * (mag + want.abs()) + 1e-30,
                "{what} {m}x{n}x{k} t={ta},{tb} [{i},{j}]: {got} vs {want} (Σ|a·b| {mag})"
            );
        }
    }
}

/// Every shape and transpose through `matmul_with`; returns the outputs.
fn matmul_body<T: Elem>(dev: &Device, seed: u64, tf32: bool, tol: f64) -> Vec<Vec<T>> {
    let s = dev.new_stream().unwrap();
    let mut r = rng(seed);
    let mut outs = Vec::new();
    for (m, n, k) in SHAPES {
        for (ta, tb) in TRANSPOSES {
            let (a, b) = (random::<T>(&mut r, m * k), random::<T>(&mut r, k * n));
            let (da, db) = (
                Buffer::from_host(&s, &a).unwrap(),
                Buffer::from_host(&s, &b).unwrap(),
            );
            let mut dc = poisoned::<T>(&s, m * n);
            let opts = GemmOptions {
                trans_a: ta,
                trans_b: tb,
                tf32,
            };
            matmul_with(&s, &da, &db, &mut dc, (m, n, k), opts).unwrap();
            let c = dc.to_host(&s).unwrap();
            check("matmul", &a, &b, &c, (m, n, k), (ta, tb), tol);
            outs.push(c);
        }
    }
    outs
}

/// Strided-batched products of odd shapes, each item checked; returns the outputs.
fn batched_body<T: Elem>(dev: &Device, seed: u64) -> Vec<Vec<T>> {
    let s = dev.new_stream().unwrap();
    let mut r = rng(seed);
    let mut outs = Vec::new();
    for (batch, (m, n, k)) in [
        (3, (17, 33, 65)),
        (7, (1, 5, 9)),
        (1, (8, 8, 8)),
        (0, (4, 4, 4)),
    ] {
        for (ta, tb) in TRANSPOSES {
            let (a, b) = (
                random::<T>(&mut r, batch * m * k),
                random::<T>(&mut r, batch * k * n),
            );
            let (da, db) = (
                Buffer::from_host(&s, &a).unwrap(),
                Buffer::from_host(&s, &b).unwrap(),
            );
            let mut dc = poisoned::<T>(&s, batch * m * n);
            let opts = GemmOptions {
                trans_a: ta,
                trans_b: tb,
                tf32: false,
            };
            matmul_batched(&s, &da, &db, &mut dc, batch, (m, n, k), opts).unwrap();
            let c = dc.to_host(&s).unwrap();
            for i in 0..batch {
                check(
                    "batched",
                    &a[i * m * k..(i + 1) * m * k],
                    &b[i * k * n..(i + 1) * k * n],
                    &c[i * m * n..(i + 1) * m * n],
                    (m, n, k),
                    (ta, tb),
                    T::TOL,
                );
            }
            outs.push(c);
        }
    }
    outs
}

/// Grouped products with a different m per group (empty groups included); returns the
/// outputs.
fn grouped_body<T: Elem>(dev: &Device, seed: u64) -> Vec<Vec<T>> {
    let s = dev.new_stream().unwrap();
    let mut r = rng(seed);
    let mut outs = Vec::new();
    let (n, k) = (19, 37);
    for rows in [&[5usize, 0, 17, 1, 33][..], &[0, 0], &[64]] {
        for (ta, tb) in TRANSPOSES {
            let total: usize = rows.iter().sum();
            let (a, b) = (
                random::<T>(&mut r, total * k),
                random::<T>(&mut r, rows.len() * k * n),
            );
            let (da, db) = (
                Buffer::from_host(&s, &a).unwrap(),
                Buffer::from_host(&s, &b).unwrap(),
            );
            let mut dc = poisoned::<T>(&s, total * n);
            let opts = GemmOptions {
                trans_a: ta,
                trans_b: tb,
                tf32: false,
            };
            matmul_grouped(&s, &da, &db, &mut dc, rows, (n, k), opts).unwrap();
            let c = dc.to_host(&s).unwrap();
            let mut row = 0;
            for (g, &m) in rows.iter().enumerate() {
                check(
                    "grouped",
                    &a[row * k..(row + m) * k],
                    &b[g * k * n..(g + 1) * k * n],
                    &c[row * n..(row + m) * n],
                    (m, n, k),
                    (ta, tb),
                    T::TOL,
                );
                row += m;
            }
            outs.push(c);
        }
    }
    outs
}

fn every_body<T: Elem>(dev: &Device, test: &str) -> [Vec<Vec<T>>; 3] {
    let seed = seed(test);
    [
        matmul_body::<T>(dev, seed, false, T::TOL),
        batched_body::<T>(dev, seed),
        grouped_body::<T>(dev, seed),
    ]
}

fn shape_errors(dev: &Device) {
    let s = dev.new_stream().unwrap();
    let x = Buffer::<f32>::zeros(&s, 6).unwrap();
    let mut y = Buffer::<f32>::zeros(&s, 4).unwrap();
    let o = GemmOptions::default();
    for r in [
        matmul_with(&s, &x, &x, &mut y, (2, 2, 2), o),
        matmul_batched(&s, &x, &x, &mut y, 2, (1, 2, 3), o),
        matmul_grouped(&s, &x, &x, &mut y, &[1, 1], (2, 3), o),
        matmul_grouped(&s, &x, &x, &mut y, &[usize::MAX, 2], (2, 3), o),
    ] {
        assert!(matches!(r, Err(Error::InvalidArgument(_))), "{r:?}");
    }
}

// ---- both backends: against the f64 reference, and CUDA against the CPU backend ----

/// Every GEMM entry point on `dev`, each within the bound of the f64 reference (checked in
/// the body). On CUDA the CPU backend runs too: both within the bound, so within twice it of
/// each other; NaN never.
fn gemm_body<T: Elem>(dev: &Device) {
    let test = format!("gemm {}", std::any::type_name::<T>());
    let got = every_body::<T>(dev, &test);
    if dev.is_cuda() {
        let cpu = every_body::<T>(&Device::cpu(), &test);
        for (g, c) in got.iter().flatten().zip(cpu.iter().flatten()) {
            assert_eq!(g.len(), c.len());
            assert!(g.iter().all(|v| !v.to_f64().is_nan()), "{test}: NaN left");
        }
    }
}

device_test!(cpu_gemm_f32, gpu_gemm_f32, gemm_body::<f32>);
device_test!(cpu_gemm_f16, gpu_gemm_f16, gemm_body::<f16>);
device_test!(cpu_gemm_bf16, gpu_gemm_bf16, gemm_body::<bf16>);
device_test!(cpu_gemm_shape_errors, gpu_gemm_shape_errors, shape_errors);

#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_gemm_tf32_is_opt_in_and_within_its_bound() {
    // TF32 rounds inputs to 10-bit mantissas: about 1e-3 of Σ|a·b|.
    matmul_body::<f32>(&cuda(), seed("gpu_gemm tf32"), true, 2e-3);
}
