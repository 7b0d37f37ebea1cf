//! Elementwise ops (map, cast, binary, axpy on 16-bit types) on both backends.
//!
//! Each body runs an op on one backend with fresh random inputs, outputs poisoned (NaN)
//! first, and checks every element against an f64 reference written here (independent
//! formulas); it returns the outputs so the GPU tests can also compare CUDA with the CPU
//! backend on the same inputs. Tolerances (DESIGN.md): |got - ref| <= tol_out · (|ref| + the
//! magnitude of the terms) + the output type's subnormal spacing, tol = 1e-6 (f32), 1e-3
//! (f16), 1e-2 (bf16); casts and max/min are exact.

mod common;

use common::{cuda, device_test, nan, poisoned, random_in, rng, same_or_both_nan, seed, TestFloat};
use half::{bf16, f16};
use rand::Rng;
use warpdrive::ops::{self, Activation, BinaryOp, Loads, Map};
use warpdrive::{Buffer, Device, Error};

/// Sizes: empty, one, an odd size with a scalar tail, and one over a few waves of packs.
const SIZES: [usize; 4] = [0, 1, 1023, (1 << 16) + 5];

/// erf for the reference: Abramowitz & Stegun 7.1.26 (|error| < 1.5e-7), independent of the
/// library's; in GELU it is multiplied by x/2, far inside the bound tol · |x|.
fn erf_ref(x: f64) -> f64 {
    let t = 1.0 / (1.0 + 0.3275911 * x.abs());
    let y = 1.0
        - (((((1.061405429 * t - 1.453152027) * t) + 1.421413741) * t - 0.284496736) * t
            + 0.254829592)
            * t
            * (-x * x).exp();
    y.copysign(x)
}

fn act_ref(act: Activation, x: f64) -> f64 {
    match act {
        Activation::None => x,
        Activation::Silu => x / (1.0 + (-x).exp()),
        Activation::GeluTanh => {
            0.5 * x
                * (1.0 + ((2.0 / std::f64::consts::PI).sqrt() * (x + 0.044715 * x.powi(3))).tanh())
        }
        Activation::GeluErf => 0.5 * x * (1.0 + erf_ref(x / 2f64.sqrt())),
    }
}

/// The maps every type pair is checked with.
fn maps() -> Vec<Map> {
    vec![
        Map::IDENTITY,
        Map::affine(1.5, -0.25),
        Map::activation(Activation::Silu),
        Map::activation(Activation::GeluTanh),
        Map::activation(Activation::GeluErf),
        Map::affine(-0.75, 0.5).then(Activation::GeluErf),
        Map::affine(2.0, 1.0)
            .then(Activation::Silu)
            .with_loads(Loads::Scalar),
    ]
}

/// Every map from `I` to `O` at every size; returns the outputs.
fn map_body<I: TestFloat, O: TestFloat>(dev: &Device, seed: u64) -> Vec<Vec<O>> {
    let s = dev.new_stream().unwrap();
    let mut r = rng(seed);
    let mut outs = Vec::new();
    for m in maps() {
        for n in SIZES {
            let xs: Vec<I> = random_in(&mut r, n, -4.0, 4.0);
            let x = Buffer::from_host(&s, &xs).unwrap();
            let mut y = poisoned::<O>(&s, n, nan());
            ops::map(&s, &m, &x, &mut y).unwrap();
            let got = y.to_host(&s).unwrap();
            for (i, (&g, &xi)) in got.iter().zip(&xs).enumerate() {
                let x = xi.to_f64();
                let lin = if m.scale == 1.0 && m.shift == 0.0 {
                    x
                } else {
                    m.scale as f64 * x + m.shift as f64
                };
                let want = act_ref(m.act, lin);
                let terms = (m.scale as f64 * x).abs() + (m.shift as f64).abs();
                let bound = O::TOL * (want.abs() + terms) + O::TINY;
                let err = (g.to_f64() - want).abs();
                assert!(
                    err <= bound,
                    "map {m:?} {}->{} n={n} i={i}: x={x} got {g:?}, want {want}",
                    I::NAME,
                    O::NAME
                );
            }
            outs.push(got);
        }
    }
    outs
}

/// Casts of random bit patterns (NaN, ±inf, subnormals, overflow included): exact against
/// `half`'s conversions (round to nearest even), NaN only as NaN.
fn cast_body(dev: &Device, seed: u64) {
    let s = dev.new_stream().unwrap();
    let mut r = rng(seed);
    let n = 4099;
    let mut bits: Vec<f32> = (0..n).map(|_| f32::from_bits(r.random())).collect();
    bits.extend([
        0.0,
        -0.0,
        f32::INFINITY,
        f32::NEG_INFINITY,
        65520.0,
        65519.0,
        1e-40,
        -3e-8,
    ]);
    let x = Buffer::from_host(&s, &bits).unwrap();
    let mut h = poisoned::<f16>(&s, bits.len(), f16::NAN);
    let mut b = poisoned::<bf16>(&s, bits.len(), bf16::NAN);
    ops::cast(&s, &x, &mut h).unwrap();
    ops::cast(&s, &x, &mut b).unwrap();
    let (hv, bv) = (h.to_host(&s).unwrap(), b.to_host(&s).unwrap());
    for (i, &v) in bits.iter().enumerate() {
        let (wh, wb) = (f16::from_f32(v), bf16::from_f32(v));
        if v.is_nan() {
            assert!(hv[i].is_nan() && bv[i].is_nan(), "cast NaN {i}");
        } else {
            assert_eq!(hv[i].to_bits(), wh.to_bits(), "f32 {v:e} -> f16");
            assert_eq!(bv[i].to_bits(), wb.to_bits(), "f32 {v:e} -> bf16");
        }
    }
    // Back to f32, and across the 16-bit types: exact.
    let mut back = poisoned::<f32>(&s, bits.len(), f32::NAN);
    ops::cast(&s, &h, &mut back).unwrap();
    for (g, w) in back.to_host(&s).unwrap().iter().zip(&hv) {
        assert!(
            same_or_both_nan(*g as f64, w.to_f64())
                && (g.is_nan() || g.to_bits() == w.to_f32().to_bits())
        );
    }
    let mut hb = poisoned::<bf16>(&s, bits.len(), bf16::NAN);
    ops::cast(&s, &h, &mut hb).unwrap();
    for (g, w) in hb.to_host(&s).unwrap().iter().zip(&hv) {
        let want = bf16::from_f32(w.to_f32());
        assert!(
            if w.is_nan() {
                g.is_nan()
            } else {
                g.to_bits() == want.to_bits()
            },
            "f16 {w} -> bf16: {g}"
        );
    }
    let mut bh = poisoned::<f16>(&s, bits.len(), f16::NAN);
    ops::cast(&s, &b, &mut bh).unwrap();
    for (g, w) in bh.to_host(&s).unwrap().iter().zip(&bv) {
        let want = f16::from_f32(w.to_f32());
        assert!(
            if w.is_nan() {
                g.is_nan()
            } else {
                g.to_bits() == want.to_bits()
            },
            "bf16 {w} -> f16: {g}"
        );
    }
    // f32 -> f32 identity keeps every bit (-0.0 included) but NaN payloads.
    let mut same = poisoned::<f32>(&s, bits.len(), 1.0);
    ops::cast(&s, &x, &mut same).unwrap();
    let got = same.to_host(&s).unwrap();
    for (a, b) in got.iter().zip(&bits) {
        assert!(
            if b.is_nan() {
                a.is_nan()
            } else {
                a.to_bits() == b.to_bits()
            },
            "{b:e} -> {a:e}"
        );
    }
}

const BINARY_OPS: [BinaryOp; 6] = [
    BinaryOp::Add,
    BinaryOp::Sub,
    BinaryOp::Mul,
    BinaryOp::Max,
    BinaryOp::Min,
    BinaryOp::SwiGlu,
];

/// f16 → f32 with the ±inf check: random bit patterns (NaN, subnormals, ±inf sprinkled in
/// or kept out) at every size; the widened values exact, and true exactly when an infinity
/// is there (also when it is the only one, in the scalar tail or the first vector), on
/// every call (a raised flag does not carry over to the next one).
fn widen_checking_inf_body(dev: &Device, seed: u64) {
    let s = dev.new_stream().unwrap();
    let mut r = rng(seed);
    let finite = |r: &mut rand::rngs::StdRng| loop {
        let v = f16::from_bits(r.random());
        if !v.is_infinite() {
            return v;
        }
    };
    for n in SIZES.into_iter().chain([8, 4096 * 8 + 7]) {
        for case in 0..4 {
            let mut xs: Vec<f16> = (0..n).map(|_| finite(&mut r)).collect();
            match case {
                1 if n > 0 => xs[n - 1] = f16::NEG_INFINITY,
                2 if n > 0 => xs[0] = f16::INFINITY,
                3 => {
                    for v in xs.iter_mut() {
                        if r.random_range(0..8) == 0 {
                            *v = f16::INFINITY;
                        }
                    }
                }
                _ => {}
            }
            let x = Buffer::from_host(&s, &xs).unwrap();
            let mut y = poisoned::<f32>(&s, n, f32::NAN);
            let found = ops::widen_f16_checking_inf(&s, &x, &mut y).unwrap();
            let got = y.to_host(&s).unwrap();
            for (i, (g, w)) in got.iter().zip(&xs).enumerate() {
                assert!(
                    if w.is_nan() {
                        g.is_nan()
                    } else {
                        g.to_bits() == w.to_f32().to_bits()
                    },
                    "n={n} i={i}: {w} -> {g}"
                );
            }
            let want = xs.iter().any(|v| v.is_infinite());
            assert_eq!(found, want, "n={n} case {case}");
        }
    }
    // Bad arguments are errors.
    let x = Buffer::<f16>::zeros(&s, 3).unwrap();
    let mut y = Buffer::<f32>::zeros(&s, 4).unwrap();
    assert!(matches!(
        ops::widen_f16_checking_inf(&s, &x, &mut y),
        Err(Error::LengthMismatch { .. })
    ));
}

fn binary_ref(op: BinaryOp, a: f64, b: f64) -> (f64, f64) {
    // (value, magnitude of its terms)
    match op {
        BinaryOp::Add => (a + b, a.abs() + b.abs()),
        BinaryOp::Sub => (a - b, a.abs() + b.abs()),
        BinaryOp::Mul => (a * b, (a * b).abs()),
        BinaryOp::Max => (
            if a.is_nan() || b.is_nan() {
                f64::NAN
            } else {
                a.max(b)
            },
            0.0,
        ),
        BinaryOp::Min => (
            if a.is_nan() || b.is_nan() {
                f64::NAN
            } else {
                a.min(b)
            },
            0.0,
        ),
        BinaryOp::SwiGlu => {
            let v = a / (1.0 + (-a).exp()) * b;
            (v, (a * b).abs())
        }
    }
}

fn binary_body<T: TestFloat>(dev: &Device, seed: u64) -> Vec<Vec<T>> {
    let s = dev.new_stream().unwrap();
    let mut r = rng(seed);
    let mut outs = Vec::new();
    for op in BINARY_OPS {
        for n in SIZES {
            let mut av: Vec<T> = random_in(&mut r, n, -4.0, 4.0);
            let bv: Vec<T> = random_in(&mut r, n, -4.0, 4.0);
            if matches!(op, BinaryOp::Max | BinaryOp::Min) && n > 10 {
                av[3] = nan(); // NaN propagates from either side
            }
            let mut bv = bv;
            if matches!(op, BinaryOp::Max | BinaryOp::Min) && n > 10 {
                bv[7] = nan();
            }
            let (a, b) = (
                Buffer::from_host(&s, &av).unwrap(),
                Buffer::from_host(&s, &bv).unwrap(),
            );
            let mut out = poisoned::<T>(&s, n, nan());
            ops::binary(&s, op, &a, &b, &mut out).unwrap();
            let got = out.to_host(&s).unwrap();
            for i in 0..n {
                let (want, terms) = binary_ref(op, av[i].to_f64(), bv[i].to_f64());
                let g = got[i].to_f64();
                if matches!(op, BinaryOp::Max | BinaryOp::Min) {
                    assert!(
                        same_or_both_nan(g, want),
                        "{op:?} {} i={i}: {g} vs {want}",
                        T::NAME
                    );
                } else {
                    let bound = T::TOL * (want.abs() + terms) + T::TINY;
                    assert!(
                        (g - want).abs() <= bound,
                        "{op:?} {} n={n} i={i}: {g} vs {want}",
                        T::NAME
                    );
                }
            }
            outs.push(got);
        }
    }
    outs
}

/// axpy on the 16-bit types (f32/f64 are covered in tests/ops.rs).
fn axpy_half_body<T: TestFloat>(dev: &Device, seed: u64) -> Vec<Vec<T>> {
    let s = dev.new_stream().unwrap();
    let mut r = rng(seed);
    let mut outs = Vec::new();
    for n in SIZES {
        let alpha: T = random_in(&mut r, 1, -2.0, 2.0)[0];
        let (xs, ys): (Vec<T>, Vec<T>) = (
            random_in(&mut r, n, -1.0, 1.0),
            random_in(&mut r, n, -1.0, 1.0),
        );
        let x = Buffer::from_host(&s, &xs).unwrap();
        let mut y = Buffer::from_host(&s, &ys).unwrap();
        ops::axpy(&s, alpha, &x, &mut y).unwrap();
        let got = y.to_host(&s).unwrap();
        for i in 0..n {
            let (a, xi, yi) = (alpha.to_f64(), xs[i].to_f64(), ys[i].to_f64());
            let want = a * xi + yi;
            let bound = T::TOL * ((a * xi).abs() + yi.abs()) + T::TINY;
            assert!(
                (got[i].to_f64() - want).abs() <= bound,
                "axpy {} i={i}",
                T::NAME
            );
        }
        outs.push(got);
    }
    outs
}

// ---- both backends ----

device_test!(cpu_cast_is_exact, gpu_cast_is_exact, |dev| cast_body(
    dev,
    seed("cast")
));

device_test!(
    cpu_widen_f16_checking_inf,
    gpu_widen_f16_checking_inf,
    |dev| widen_checking_inf_body(dev, seed("widen_checking_inf"))
);

#[test]
fn elementwise_errors() {
    let s = Device::cpu().new_stream().unwrap();
    let x = Buffer::<f32>::zeros(&s, 3).unwrap();
    let mut y = Buffer::<f32>::zeros(&s, 4).unwrap();
    assert!(matches!(
        ops::map(&s, &Map::IDENTITY, &x, &mut y),
        Err(Error::LengthMismatch { .. })
    ));
    assert!(matches!(
        ops::binary(&s, BinaryOp::Add, &x, &x, &mut y),
        Err(Error::LengthMismatch { .. })
    ));
    let d = Buffer::<f64>::zeros(&s, 3).unwrap();
    let mut d2 = Buffer::<f64>::zeros(&s, 3).unwrap();
    assert!(matches!(
        ops::map(&s, &Map::IDENTITY, &d, &mut d2),
        Err(Error::Unsupported(_))
    ));
    assert!(matches!(
        ops::binary(&s, BinaryOp::Mul, &d, &d, &mut d2),
        Err(Error::Unsupported(_))
    ));
}

// ---- both backends; on CUDA also against the CPU backend ----

fn close_all<T: TestFloat>(what: &str, g: &[Vec<T>], c: &[Vec<T>]) {
    assert_eq!(g.len(), c.len());
    for (gv, cv) in g.iter().zip(c) {
        assert_eq!(gv.len(), cv.len());
        for (i, (a, b)) in gv.iter().zip(cv).enumerate() {
            let (a, b) = (a.to_f64(), b.to_f64());
            // Both are within one bound of the f64 reference (checked in the bodies; the
            // terms there are at most 16 in magnitude), so within two of each other; NaN only
            // where both are NaN.
            let bound = 2.0 * T::TOL * (a.abs().max(b.abs()) + 16.0) + T::TINY;
            assert!(
                same_or_both_nan(a, b) || (a - b).abs() <= bound,
                "{what} {}: cuda {a} vs cpu {b} at {i}",
                T::NAME
            );
        }
    }
}

/// `body` on `dev` (checked against the f64 reference inside); on CUDA also on the CPU
/// backend with the same seed, and the two close.
fn checked<T: TestFloat>(what: &str, dev: &Device, sd: u64, body: fn(&Device, u64) -> Vec<Vec<T>>) {
    let got = body(dev, sd);
    if dev.is_cuda() {
        close_all(what, &got, &body(&Device::cpu(), sd));
    }
}

fn map_every_type_pair_body(dev: &Device) {
    let sd = seed("map");
    checked("f32->f32", dev, sd, map_body::<f32, f32>);
    checked("f32->f16", dev, sd, map_body::<f32, f16>);
    checked("f32->bf16", dev, sd, map_body::<f32, bf16>);
    checked("f16->f32", dev, sd, map_body::<f16, f32>);
    checked("f16->f16", dev, sd, map_body::<f16, f16>);
    checked("f16->bf16", dev, sd, map_body::<f16, bf16>);
    checked("bf16->f32", dev, sd, map_body::<bf16, f32>);
    checked("bf16->f16", dev, sd, map_body::<bf16, f16>);
    checked("bf16->bf16", dev, sd, map_body::<bf16, bf16>);
}

device_test!(
    cpu_map_every_type_pair,
    gpu_map_every_type_pair_matches_cpu,
    map_every_type_pair_body
);

device_test!(cpu_binary, gpu_binary_matches_cpu, |dev| {
    let sd = seed("binary");
    checked("binary", dev, sd, binary_body::<f32>);
    checked("binary", dev, sd, binary_body::<f16>);
    checked("binary", dev, sd, binary_body::<bf16>);
});

device_test!(cpu_axpy_16_bit, gpu_axpy_16_bit_matches_cpu, |dev| {
    let sd = seed("axpy_16_bit");
    checked("axpy", dev, sd, axpy_half_body::<f16>);
    checked("axpy", dev, sd, axpy_half_body::<bf16>);
});

#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_map_large_f32_affine() {
    // One size past the chip's first wave with a tail, f32 -> f32 a*x+b (the benchmarked op),
    // both kinds of loads.
    let s = cuda().new_stream().unwrap();
    let mut r = rng(seed("gpu_map_large"));
    let n = (1 << 22) + 7;
    let xs: Vec<f32> = random_in(&mut r, n, -1.0, 1.0);
    let x = Buffer::from_host(&s, &xs).unwrap();
    for loads in [Loads::Vector, Loads::Scalar] {
        let m = Map::affine(1.75, -0.5).with_loads(loads);
        let mut y = poisoned::<f32>(&s, n, f32::NAN);
        ops::map(&s, &m, &x, &mut y).unwrap();
        for (i, (g, x)) in y.to_host(&s).unwrap().iter().zip(&xs).enumerate() {
            let want = 1.75 * *x as f64 - 0.5;
            assert!(
                (*g as f64 - want).abs() <= 1e-6 * (want.abs() + 1.75 * x.abs() as f64 + 0.5),
                "{loads:?} i={i}"
            );
        }
    }
}
