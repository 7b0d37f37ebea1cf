//! `ops::quant`: int8 block quantization with error feedback, one body on each backend. The
//! GPU must give the CPU reference's bits (both spell the same IEEE arithmetic; NaNs may
//! differ in payload only); on either
//! backend the outputs keep the format's promises: |q| ≤ 127, q·scale + error = x to one
//! rounding, |error| ≤ scale / 2, a non-finite block flagged by a NaN scale and kept whole in
//! the error, and over many steps the dequantized sum plus the error equals the sum of the
//! gradients (error feedback loses nothing).

mod common;

use common::{device_test, poisoned, random_f32, rng, seed};
use warpdrive::ops::quant::{dequantize_int8, quant_blocks, quantize_int8_ef, QUANT_BLOCK};
use warpdrive::{Buffer, Device, Error, Stream};

const SIZES: [usize; 7] = [1, 31, 255, 256, 257, 4099, 100_003];

/// Gradients with blocks of very different magnitudes, one all zero, one of subnormals and,
/// when `faults`, one with a NaN and one with an infinity.
fn gradients(r: &mut rand::rngs::StdRng, n: usize, faults: bool) -> Vec<f32> {
    let mut g = random_f32(r, n);
    for (b, block) in g.chunks_mut(QUANT_BLOCK).enumerate() {
        let scale = match b % 7 {
            0 => 1.0,
            1 => 1e-3,
            2 => 300.0,
            3 => 0.0,
            4 => 1e-41,
            _ => 0.5,
        };
        block.iter_mut().for_each(|x| *x *= scale);
        if faults && b % 7 == 5 {
            block[block.len() / 2] = f32::NAN;
        }
        if faults && b % 7 == 6 {
            block[0] = f32::INFINITY;
        }
    }
    g
}

/// (error after, q, scales) of one quantization of `g` with the carried error `e`.
fn quantize(dev: &Device, g: &[f32], e: &[f32]) -> (Vec<f32>, Vec<u8>, Vec<f32>) {
    let s = dev.new_stream().unwrap();
    let grad = Buffer::from_host(&s, g).unwrap();
    let mut error = Buffer::from_host(&s, e).unwrap();
    let mut q = poisoned(&s, g.len(), 0xaau8);
    let mut scales = poisoned(&s, quant_blocks(g.len()), -1.0f32);
    quantize_int8_ef(&s, &grad, &mut error, &mut q, &mut scales).unwrap();
    (
        error.to_host(&s).unwrap(),
        q.to_host(&s).unwrap(),
        scales.to_host(&s).unwrap(),
    )
}

fn quantize_body(dev: &Device) {
    let mut r = rng(seed("quantize"));
    for n in SIZES {
        let g = gradients(&mut r, n, true);
        let e: Vec<f32> = random_f32(&mut r, n).iter().map(|x| x * 1e-3).collect();
        let (e2, q, scales) = quantize(dev, &g, &e);
        if dev.is_cuda() {
            let (ce, cq, cs) = quantize(&Device::cpu(), &g, &e);
            assert_eq!(q, cq, "q n={n}");
            // Bit for bit, but NaN's payload: the GPU's arithmetic returns its canonical NaN.
            let same = |a: &[f32], b: &[f32], what: &str| {
                for (i, (x, y)) in a.iter().zip(b).enumerate() {
                    assert!(
                        x.to_bits() == y.to_bits() || (x.is_nan() && y.is_nan()),
                        "{what} n={n} i={i}: {x} vs {y}"
                    );
                }
            };
            same(&scales, &cs, "scales");
            same(&e2, &ce, "error");
        }
        for (b, &scale) in scales.iter().enumerate() {
            let at = b * QUANT_BLOCK..((b + 1) * QUANT_BLOCK).min(n);
            let x: Vec<f32> = at.clone().map(|i| g[i] + e[i]).collect();
            if x.iter().any(|v| !v.is_finite()) {
                assert!(scale.is_nan(), "n={n} block {b}: scale {scale}");
                for (k, i) in at.enumerate() {
                    assert_eq!(q[i], 0, "n={n} block {b}");
                    assert!(
                        e2[i].to_bits() == x[k].to_bits() || (e2[i].is_nan() && x[k].is_nan()),
                        "n={n} block {b}: the error keeps x"
                    );
                }
                continue;
            }
            let amax = x.iter().fold(0.0f32, |m, v| m.max(v.abs()));
            assert_eq!(scale, amax / 127.0, "n={n} block {b}");
            for (k, i) in at.enumerate() {
                let v = q[i] as i8;
                assert!(v != -128, "n={n} block {b}: q {v}");
                let back = f64::from(v) * f64::from(scale) + f64::from(e2[i]);
                // One rounding of x − q·scale: half an ulp of x, or of the subnormals' spacing.
                let ulp = (f64::from(x[k].abs()) * 2f64.powi(-23)).max(1.5e-45);
                assert!(
                    (back - f64::from(x[k])).abs() <= ulp,
                    "n={n} i={i}: {v}·{scale} + {} != {}",
                    e2[i],
                    x[k]
                );
                if scale != 0.0 {
                    // Half a step, plus the quotient's and the fma's roundings.
                    let bound = f64::from(scale) * (0.5 + 1e-5) + 1.5e-45;
                    assert!(
                        f64::from(e2[i].abs()) <= bound,
                        "n={n} i={i}: error {}",
                        e2[i]
                    );
                }
            }
        }
    }
}

/// One payload per rank, quantized from independent gradients: their dequantized average
/// equals the host's formula in rank order, bit for bit.
fn dequantize_body(dev: &Device) {
    let mut r = rng(seed("dequantize"));
    let s = dev.new_stream().unwrap();
    for n in SIZES {
        for ranks in [1, 3] {
            let mut all_q = Vec::new();
            let mut all_s = Vec::new();
            for _ in 0..ranks {
                let g = gradients(&mut r, n, false);
                let (_, q, scales) = quantize(&Device::cpu(), &g, &vec![0.0; n]);
                all_q.extend(q);
                all_s.extend(scales);
            }
            let alpha = 1.0 / ranks as f32;
            let q = Buffer::from_host(&s, &all_q).unwrap();
            let scales = Buffer::from_host(&s, &all_s).unwrap();
            let mut out = poisoned(&s, n, f32::NAN);
            dequantize_int8(&s, &q, &scales, ranks, alpha, &mut out).unwrap();
            let got = out.to_host(&s).unwrap();
            let blocks = quant_blocks(n);
            for (i, &v) in got.iter().enumerate() {
                let want = (0..ranks).fold(0.0f32, |acc, k| {
                    f32::from(all_q[k * n + i] as i8)
                        .mul_add(all_s[k * blocks + i / QUANT_BLOCK] * alpha, acc)
                });
                assert_eq!(v.to_bits(), want.to_bits(), "n={n} ranks={ranks} i={i}");
            }
        }
    }
}

/// The same gradient quantized 40 times, its error carried: the dequantized values summed
/// over the steps plus the last error equal 40 × the gradient (to float rounding), and each
/// step's dequantized value stays within one scale step of the gradient.
fn error_feedback_body(dev: &Device) {
    let mut r = rng(seed("error_feedback"));
    let s = dev.new_stream().unwrap();
    let n = 3 * QUANT_BLOCK + 17;
    let g_host = gradients(&mut r, n, false);
    let g = Buffer::from_host(&s, &g_host).unwrap();
    let mut error = Buffer::from_host(&s, &vec![0.0f32; n]).unwrap();
    let mut q = poisoned(&s, n, 0u8);
    let mut scales = poisoned(&s, quant_blocks(n), 0.0f32);
    let mut step = poisoned(&s, n, f32::NAN);
    let steps = 40;
    let mut total = vec![0.0f64; n];
    for _ in 0..steps {
        quantize_int8_ef(&s, &g, &mut error, &mut q, &mut scales).unwrap();
        dequantize_int8(&s, &q, &scales, 1, 1.0, &mut step).unwrap();
        for (t, v) in total.iter_mut().zip(step.to_host(&s).unwrap()) {
            *t += f64::from(v);
        }
    }
    let e = error.to_host(&s).unwrap();
    for i in 0..n {
        let want = f64::from(g_host[i]) * steps as f64;
        let got = total[i] + f64::from(e[i]);
        let tol = 1e-5 * want.abs().max(f64::from(g_host[i].abs())) + 1e-40;
        assert!((got - want).abs() <= tol, "i={i}: {got} vs {want}");
    }
}

fn errors_body(dev: &Device) {
    let s: Stream = dev.new_stream().unwrap();
    let n = 300;
    let g = Buffer::from_host(&s, &vec![1.0f32; n]).unwrap();
    let mut e = Buffer::from_host(&s, &vec![0.0f32; n]).unwrap();
    let mut q = Buffer::from_host(&s, &vec![0u8; n]).unwrap();
    let mut scales = Buffer::from_host(&s, &[0.0f32; 2]).unwrap();
    let mut short = Buffer::from_host(&s, &vec![0u8; n - 1]).unwrap();
    let mut one_scale = Buffer::from_host(&s, &[0.0f32]).unwrap();
    let mismatch = |r: warpdrive::Result<()>| {
        assert!(matches!(r, Err(Error::LengthMismatch { .. })), "{r:?}");
    };
    mismatch(quantize_int8_ef(&s, &g, &mut e, &mut short, &mut scales));
    mismatch(quantize_int8_ef(&s, &g, &mut e, &mut q, &mut one_scale));
    quantize_int8_ef(&s, &g, &mut e, &mut q, &mut scales).unwrap();
    let mut out = Buffer::from_host(&s, &vec![0.0f32; n]).unwrap();
    mismatch(dequantize_int8(&s, &q, &scales, 2, 0.5, &mut out));
    for (ranks, alpha) in [
        (0, 1.0),
        (1, f32::NAN),
        (1, f32::INFINITY),
        (usize::MAX, 1.0),
    ] {
        let r = dequantize_int8(&s, &q, &scales, ranks, alpha, &mut out);
        assert!(
            matches!(
                r,
                Err(Error::InvalidArgument(_) | Error::LengthMismatch { .. })
            ),
            "ranks {ranks} alpha {alpha}: {r:?}"
        );
    }
    // Empty buffers are valid no-ops.
    let g0 = Buffer::<f32>::from_host(&s, &[]).unwrap();
    let mut e0 = Buffer::<f32>::from_host(&s, &[]).unwrap();
    let mut q0 = Buffer::<u8>::from_host(&s, &[]).unwrap();
    let mut s0 = Buffer::<f32>::from_host(&s, &[]).unwrap();
    quantize_int8_ef(&s, &g0, &mut e0, &mut q0, &mut s0).unwrap();
    dequantize_int8(&s, &q0, &s0, 3, 1.0, &mut e0).unwrap();
}

device_test!(
    cpu_quantize,
    gpu_quantize_matches_the_cpu_bit_for_bit,
    quantize_body
);
device_test!(
    cpu_dequantize,
    gpu_dequantize_matches_the_cpu_bit_for_bit,
    dequantize_body
);
device_test!(
    cpu_error_feedback,
    gpu_error_feedback_loses_nothing,
    error_feedback_body
);
device_test!(cpu_quant_errors, gpu_quant_errors, errors_body);
