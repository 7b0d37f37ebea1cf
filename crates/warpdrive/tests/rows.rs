//! Row ops on both backends: softmax, top-k and the fused MoE router, against f64
//! references written here.
//!
//! - softmax: |got - ref| <= tol · (1 + log2 cols) · ref + the output's subnormal spacing
//!   (the denominator is a tree sum of `cols` terms), tol = 1e-6 / 1e-3 / 1e-2;
//! - top-k: exact (indices and value bits), in the documented order (NaN above +inf, -0.0
//!   equal to +0.0, ties to the lower index), inputs full of ties, NaN and ±inf;
//! - router: indices exact, f32 weights within 1e-6 · (1 + log2 terms) relative.

mod common;

use std::cmp::Ordering;

use common::{device_test, nan, poisoned, random_in, rng, seed, TestFloat};
use half::{bf16, f16};
use rand::rngs::StdRng;
use rand::Rng;
use warpdrive::ops::{self, Route};
use warpdrive::{Buffer, Device, Error};

const SOFTMAX_SHAPES: [(usize, usize); 9] = [
    (1, 1),
    (7, 3),
    (33, 256),
    (9, 257),
    (5, 1000),
    (3, 1024),
    (3, 1025),
    (2, 5000),
    (0, 4),
];

fn softmax_body<T: TestFloat>(dev: &Device, seed: u64) -> Vec<Vec<f64>> {
    let s = dev.new_stream().unwrap();
    let mut r = rng(seed);
    let mut outs = Vec::new();
    for (rows, cols) in SOFTMAX_SHAPES {
        let mut xs: Vec<T> = random_in(&mut r, rows * cols, -4.0, 4.0);
        if rows * cols > 40 {
            xs[17] = T::of(f32::NEG_INFINITY); // exp(-inf) = 0, the row stays finite
        }
        let x = Buffer::from_host(&s, &xs).unwrap();
        let mut y = poisoned::<T>(&s, rows * cols, nan());
        ops::softmax_rows(&s, &x, cols, &mut y).unwrap();
        let got: Vec<f64> = y.to_host(&s).unwrap().iter().map(|v| v.to_f64()).collect();
        let rel = T::TOL * (1.0 + (cols as f64).log2());
        for (i, (row, out)) in xs
            .chunks_exact(cols)
            .zip(got.chunks_exact(cols))
            .enumerate()
        {
            let f: Vec<f64> = row.iter().map(|v| v.to_f64()).collect();
            let m = f.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let sum: f64 = f.iter().map(|v| (v - m).exp()).sum();
            for (j, (&g, &v)) in out.iter().zip(&f).enumerate() {
                let want = (v - m).exp() / sum;
                assert!(
                    (g - want).abs() <= rel * want + T::TINY,
                    "softmax {} {rows}x{cols} [{i},{j}]: {g} vs {want}",
                    T::NAME
                );
            }
        }
        outs.push(got);
    }
    // A NaN makes its row NaN; a row of -inf is NaN (0 / 0).
    let row: Vec<T> = vec![
        T::of(1.0),
        nan(),
        T::of(2.0),
        T::of(f32::NEG_INFINITY),
        T::of(f32::NEG_INFINITY),
        T::of(f32::NEG_INFINITY),
    ];
    let x = Buffer::from_host(&s, &row).unwrap();
    let mut y = poisoned::<T>(&s, 6, T::of(0.5));
    ops::softmax_rows(&s, &x, 3, &mut y).unwrap();
    assert!(
        y.to_host(&s).unwrap().iter().all(|v| v.to_f64().is_nan()),
        "NaN rows"
    );
    outs
}

/// The documented order: NaN first, then larger values (-0.0 == +0.0), ties to the lower
/// index. Written with comparisons, independently of the kernels' order keys.
fn rank_cmp(a: (f64, usize), b: (f64, usize)) -> Ordering {
    let by_value = match (a.0.is_nan(), b.0.is_nan()) {
        (true, true) => Ordering::Equal,
        (true, false) => Ordering::Less,
        (false, true) => Ordering::Greater,
        _ => b.0.partial_cmp(&a.0).unwrap_or(Ordering::Equal),
    };
    by_value.then(a.1.cmp(&b.1))
}

fn top_ref(row: &[f64], k: usize) -> Vec<usize> {
    let mut idx: Vec<usize> = (0..row.len()).collect();
    idx.sort_by(|&i, &j| rank_cmp((row[i], i), (row[j], j)));
    idx.truncate(k);
    idx
}

/// Values drawn from few distinct levels (many ties), with NaN, ±inf and ±0.0 sprinkled in.
fn tied_values<T: TestFloat>(r: &mut StdRng, n: usize) -> Vec<T> {
    (0..n)
        .map(|_| match r.random_range(0..40) {
            0 => nan(),
            1 => T::of(f32::INFINITY),
            2 => T::of(f32::NEG_INFINITY),
            3 => T::of(-0.0),
            4 => T::of(0.0),
            _ => T::of(r.random_range(-6i32..6) as f32 * 0.5),
        })
        .collect()
}

/// (rows, cols, k): every kernel variant (group sizes 1…32, 8/16/32 per lane, the list
/// path past 1024), k = cols, k = 16.
const TOPK_SHAPES: [(usize, usize, usize); 16] = [
    (1, 1, 1),
    (5, 8, 8),
    (37, 8, 2),
    (3, 5, 5),
    (13, 16, 4),
    (11, 16, 16),
    (9, 33, 16),
    (7, 64, 8),
    (5, 128, 8),
    (4, 256, 8),
    (3, 257, 16),
    (3, 512, 5),
    (2, 1000, 16),
    (2, 1024, 3),
    (2, 1025, 16),
    (1, 20000, 7),
];

fn topk_body<T: TestFloat>(dev: &Device, seed: u64) -> Vec<(Vec<u64>, Vec<u32>)> {
    let s = dev.new_stream().unwrap();
    let mut r = rng(seed);
    let mut outs = Vec::new();
    for (rows, cols, k) in TOPK_SHAPES {
        let xs: Vec<T> = tied_values(&mut r, rows * cols);
        let x = Buffer::from_host(&s, &xs).unwrap();
        let mut vals = poisoned::<T>(&s, rows * k, T::of(-7.0));
        let mut idx = poisoned::<u32>(&s, rows * k, u32::MAX);
        ops::topk_rows(&s, &x, cols, k, &mut vals, &mut idx).unwrap();
        let (gv, gi) = (vals.to_host(&s).unwrap(), idx.to_host(&s).unwrap());
        for (row_i, row) in xs.chunks_exact(cols).enumerate() {
            let f: Vec<f64> = row.iter().map(|v| v.to_f64()).collect();
            let want = top_ref(&f, k);
            for (j, &w) in want.iter().enumerate() {
                let at = row_i * k + j;
                assert_eq!(
                    gi[at] as usize,
                    w,
                    "topk {} {rows}x{cols} k={k} row {row_i} out {j}",
                    T::NAME
                );
                assert_eq!(
                    gv[at].to_bits_u64(),
                    row[w].to_bits_u64(),
                    "topk value bits"
                );
            }
        }
        outs.push((gv.iter().map(|v| v.to_bits_u64()).collect(), gi));
    }
    outs
}

/// (tokens, experts, k): the benchmark's router shapes at small token counts, odd widths,
/// k = experts, k = 16 and the list path.
const ROUTE_SHAPES: [(usize, usize, usize); 8] = [
    (1, 8, 2),
    (64, 64, 8),
    (37, 128, 8),
    (33, 256, 8),
    (5, 7, 7),
    (3, 300, 16),
    (2, 1500, 4),
    (0, 8, 2),
];

fn route_body<T: TestFloat>(dev: &Device, seed: u64) -> Vec<(Vec<f32>, Vec<u32>)> {
    let s = dev.new_stream().unwrap();
    let mut r = rng(seed);
    let mut outs = Vec::new();
    for renormalize in [true, false] {
        for (tokens, experts, k) in ROUTE_SHAPES {
            // Gaussian-ish logits, rounded to T: plenty of ties in bf16.
            let xs: Vec<T> = (0..tokens * experts)
                .map(|_| T::of((0..4).map(|_| r.random_range(-1.5f32..1.5)).sum::<f32>()))
                .collect();
            let x = Buffer::from_host(&s, &xs).unwrap();
            let route = Route {
                experts,
                k,
                renormalize,
            };
            let mut w = poisoned::<f32>(&s, tokens * k, f32::NAN);
            let mut idx = poisoned::<u32>(&s, tokens * k, u32::MAX);
            ops::route(&s, &route, &x, &mut w, &mut idx).unwrap();
            let (gw, gi) = (w.to_host(&s).unwrap(), idx.to_host(&s).unwrap());
            for (t, row) in xs.chunks_exact(experts).enumerate() {
                let f: Vec<f64> = row.iter().map(|v| v.to_f64()).collect();
                let chosen = top_ref(&f, k);
                let m = f.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let all: f64 = f.iter().map(|v| (v - m).exp()).sum();
                let picked: f64 = chosen.iter().map(|&i| (f[i] - m).exp()).sum();
                let (denom, terms) = if renormalize {
                    (picked, k)
                } else {
                    (all, experts)
                };
                let rel = 1e-6 * (1.0 + (terms as f64).log2());
                for (j, &c) in chosen.iter().enumerate() {
                    let want = (f[c] - m).exp() / denom;
                    assert_eq!(
                        gi[t * k + j] as usize,
                        c,
                        "route {route:?} token {t} out {j}"
                    );
                    let g = gw[t * k + j] as f64;
                    assert!(
                        (g - want).abs() <= rel * want + 1e-45,
                        "route {route:?} token {t} out {j}: {g} vs {want}"
                    );
                }
            }
            outs.push((gw, gi));
        }
    }
    // NaN or +inf logits make the row's weights NaN; the experts still follow the order.
    let row: Vec<T> = [1.0, f32::NAN, 3.0, 2.0, 1.0, f32::INFINITY, 0.5, 3.0]
        .iter()
        .map(|&v| T::of(v))
        .collect();
    let x = Buffer::from_host(&s, &row).unwrap();
    let mut w = poisoned::<f32>(&s, 6, 0.5);
    let mut idx = poisoned::<u32>(&s, 6, u32::MAX);
    ops::route(
        &s,
        &Route {
            experts: 4,
            k: 3,
            renormalize: true,
        },
        &x,
        &mut w,
        &mut idx,
    )
    .unwrap();
    assert_eq!(idx.to_host(&s).unwrap(), vec![1, 2, 3, 1, 3, 0]);
    assert!(w.to_host(&s).unwrap().iter().all(|v| v.is_nan()));
    // -inf logits are fine: chosen with k = experts, they weigh 0.
    let row: Vec<T> = [0.0, f32::NEG_INFINITY, 1.0]
        .iter()
        .map(|&v| T::of(v))
        .collect();
    let x = Buffer::from_host(&s, &row).unwrap();
    let mut w = poisoned::<f32>(&s, 3, f32::NAN);
    let mut idx = poisoned::<u32>(&s, 3, u32::MAX);
    ops::route(
        &s,
        &Route {
            experts: 3,
            k: 3,
            renormalize: false,
        },
        &x,
        &mut w,
        &mut idx,
    )
    .unwrap();
    assert_eq!(idx.to_host(&s).unwrap(), vec![2, 0, 1]);
    let w = w.to_host(&s).unwrap();
    assert!(
        (w[0] as f64 - 1.0 / (1.0 + (-1f64).exp())).abs() < 1e-6 && w[2] == 0.0,
        "{w:?}"
    );
    outs
}

/// Bad k and bad shapes are errors before anything runs, the same on every backend.
fn errors_body(dev: &Device) {
    let s = dev.new_stream().unwrap();
    let x = Buffer::<bf16>::zeros(&s, 24).unwrap();
    let mut v = Buffer::<bf16>::zeros(&s, 6).unwrap();
    let mut w = Buffer::<f32>::zeros(&s, 6).unwrap();
    let mut i = Buffer::<u32>::zeros(&s, 6).unwrap();
    let bad = |r: warpdrive::Result<()>| matches!(r, Err(Error::InvalidArgument(_)));
    let mismatch = |r: warpdrive::Result<()>| matches!(r, Err(Error::LengthMismatch { .. }));
    // 3 rows of 8: k = 2 fits 6 outputs.
    assert!(ops::topk_rows(&s, &x, 8, 2, &mut v, &mut i).is_ok());
    assert!(bad(ops::topk_rows(&s, &x, 8, 0, &mut v, &mut i)));
    assert!(bad(ops::topk_rows(&s, &x, 24, 17, &mut v, &mut i)));
    assert!(bad(ops::topk_rows(&s, &x, 1, 2, &mut v, &mut i))); // k > cols
    assert!(bad(ops::topk_rows(&s, &x, 5, 2, &mut v, &mut i))); // not whole rows
    assert!(mismatch(ops::topk_rows(&s, &x, 8, 1, &mut v, &mut i)));
    let route = |experts, k| Route {
        experts,
        k,
        renormalize: true,
    };
    assert!(ops::route(&s, &route(8, 2), &x, &mut w, &mut i).is_ok());
    assert!(bad(ops::route(&s, &route(8, 9), &x, &mut w, &mut i))); // k > experts
    assert!(bad(ops::route(&s, &route(8, 0), &x, &mut w, &mut i)));
    assert!(bad(ops::route(&s, &route(7, 2), &x, &mut w, &mut i)));
    assert!(mismatch(ops::route(&s, &route(4, 2), &x, &mut w, &mut i)));
    let mut short = Buffer::<u32>::zeros(&s, 5).unwrap();
    assert!(mismatch(ops::route(
        &s,
        &route(8, 2),
        &x,
        &mut w,
        &mut short
    )));
    let mut y = Buffer::<bf16>::zeros(&s, 23).unwrap();
    assert!(mismatch(ops::softmax_rows(&s, &x, 8, &mut y)));
    let mut y = Buffer::<bf16>::zeros(&s, 24).unwrap();
    assert!(bad(ops::softmax_rows(&s, &x, 0, &mut y)));
    let d = Buffer::<f64>::zeros(&s, 4).unwrap();
    let mut dv = Buffer::<f64>::zeros(&s, 2).unwrap();
    let mut di = Buffer::<u32>::zeros(&s, 2).unwrap();
    assert!(matches!(
        ops::topk_rows(&s, &d, 2, 1, &mut dv, &mut di),
        Err(Error::Unsupported(_))
    ));
}

// ---- both backends; CUDA also against the CPU backend on the same inputs ----

/// Softmax of `T` on `dev` (checked in the body); on CUDA, within the bound of the CPU's.
fn softmax_checked<T: TestFloat>(dev: &Device, sd: u64) {
    let g = softmax_body::<T>(dev, sd);
    if !dev.is_cuda() {
        return;
    }
    let c = softmax_body::<T>(&Device::cpu(), sd);
    for ((gv, cv), (_, cols)) in g.iter().zip(&c).zip(SOFTMAX_SHAPES) {
        let rel = 2.0 * T::TOL * (1.0 + (cols as f64).log2());
        for (a, b) in gv.iter().zip(cv) {
            assert!(
                (a - b).abs() <= rel * a.max(*b) + 2.0 * T::TINY,
                "softmax {}: cuda {a} vs cpu {b}",
                T::NAME
            );
        }
    }
}

fn softmax_test(dev: &Device) {
    let sd = seed("softmax");
    softmax_checked::<f32>(dev, sd);
    softmax_checked::<f16>(dev, sd);
    softmax_checked::<bf16>(dev, sd);
}

/// Top-k of `T` on `dev` (checked in the body); on CUDA, exactly the CPU's.
fn topk_checked<T: TestFloat>(dev: &Device, sd: u64) {
    let got = topk_body::<T>(dev, sd);
    if dev.is_cuda() {
        assert_eq!(got, topk_body::<T>(&Device::cpu(), sd), "topk {}", T::NAME);
    }
}

fn topk_test(dev: &Device) {
    let sd = seed("topk");
    topk_checked::<f32>(dev, sd);
    topk_checked::<f16>(dev, sd);
    topk_checked::<bf16>(dev, sd);
}

/// Routing of `T` on `dev` (checked in the body); on CUDA, the CPU's experts, and weights
/// within the bound of the CPU's.
fn route_checked<T: TestFloat>(dev: &Device, sd: u64) {
    let g = route_body::<T>(dev, sd);
    if !dev.is_cuda() {
        return;
    }
    let c = route_body::<T>(&Device::cpu(), sd);
    for ((gw, gi), (cw, ci)) in g.iter().zip(&c) {
        assert_eq!(gi, ci, "router indices {}", T::NAME);
        for (a, b) in gw.iter().zip(cw) {
            // Each within 1e-6 · (1 + log2 1500) of the f64 weight.
            let (a, b) = (*a as f64, *b as f64);
            assert!(
                (a - b).abs() <= 2.0 * 1.2e-5 * a.max(b) + 1e-45,
                "router weights {}: {a} vs {b}",
                T::NAME
            );
        }
    }
}

fn route_test(dev: &Device) {
    let sd = seed("route");
    route_checked::<bf16>(dev, sd);
    route_checked::<f16>(dev, sd);
    route_checked::<f32>(dev, sd);
}

device_test!(cpu_softmax, gpu_smem_softmax_matches_cpu, softmax_test);
device_test!(cpu_topk, gpu_topk_matches_cpu_exactly, topk_test);
device_test!(cpu_route, gpu_route_matches_cpu, route_test);
device_test!(cpu_row_op_errors, gpu_row_op_errors, errors_body);
