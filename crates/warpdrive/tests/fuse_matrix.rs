//! MatrixOps (`fuse::matmul_epilogue`): a GEMM with its epilogue on both backends: bias and
//! GELU (tanh) or none inside cuBLASLt's matmul for bf16 / f16 on a GPU, the GEMM and one
//! generated epilogue kernel otherwise (a residual, another activation, f32); with a
//! residual after cuBLASLt's GEMM, in chunks of rows (`Chunks`, run by both backends).
//!
//! The reference is the product of the (rounded) inputs in f64 and the epilogue's formula;
//! the bound is the type's tolerance (DESIGN.md) relative to the terms' magnitudes
//! (Σ|a·b| + |bias|, times the activation's slope, + |residual|).

mod common;

use common::{device_test, nan, poisoned, random_in, rng, seed, TestFloat};
use half::{bf16, f16};
use warpdrive::fuse::{
    matmul_epilogue, matmul_epilogue_overlapped, matmul_epilogue_with, Chunks, Epilogue,
};
use warpdrive::ops::Activation;
use warpdrive::{Buffer, Device, Error};

fn act_ref(act: Activation, x: f64) -> f64 {
    let sig = |z: f64| 1.0 / (1.0 + (-z).exp());
    match act {
        Activation::None => x,
        Activation::Silu => x * sig(x),
        Activation::GeluTanh => {
            0.5 * x
                * (1.0 + ((2.0 / std::f64::consts::PI).sqrt() * (x + 0.044715 * x.powi(3))).tanh())
        }
        Activation::GeluErf => unreachable!("not in these cases"),
    }
}

/// The inputs of one product, on the host.
struct Host<T> {
    a: Vec<T>,
    b: Vec<T>,
    bias: Vec<T>,
    res: Vec<T>,
}

/// Checks `got` against the product of `h`'s inputs with `epi`'s epilogue (`what` names the
/// case in a failure).
fn check<T: TestFloat>(
    h: &Host<T>,
    (m, n, k): (usize, usize, usize),
    epi: &Epilogue<'_, T>,
    got: &[T],
    what: &str,
) {
    for i in 0..m {
        for j in 0..n {
            let (mut x, mut terms) = (0.0f64, 0.0f64);
            for p in 0..k {
                let t = h.a[i * k + p].to_f64() * h.b[p * n + j].to_f64();
                x += t;
                terms += t.abs();
            }
            if epi.bias.is_some() {
                x += h.bias[j].to_f64();
                terms += h.bias[j].to_f64().abs();
            }
            let mut want = act_ref(epi.act, x);
            let mut mag = 1.2 * terms;
            if epi.residual.is_some() {
                want += h.res[i * n + j].to_f64();
                mag += h.res[i * n + j].to_f64().abs();
            }
            let g = got[i * n + j].to_f64();
            let bound = T::TOL * (mag + want.abs()) + T::TINY;
            assert!(
                (g - want).abs() <= bound,
                "{} {m}x{n}x{k} {:?} cublaslt={} {what} at ({i},{j}): got {g}, want {want}",
                T::NAME,
                epi.act,
                epi.in_cublaslt()
            );
        }
    }
}

fn body_as<T: TestFloat>(dev: &Device, seed: u64) {
    let s = dev.new_stream().unwrap();
    let mut r = rng(seed);
    for (m, n, k) in [
        (1, 1, 1),
        (5, 7, 3),
        (33, 40, 17),
        (64, 64, 64),
        (3, 4, 0),
        (0, 3, 4),
    ] {
        let av: Vec<T> = random_in(&mut r, m * k, -1.0, 1.0);
        let bv: Vec<T> = random_in(&mut r, k * n, -1.0, 1.0);
        let biasv: Vec<T> = random_in(&mut r, n, -1.0, 1.0);
        let resv: Vec<T> = random_in(&mut r, m * n, -1.0, 1.0);
        let a = Buffer::from_host(&s, &av).unwrap();
        let b = Buffer::from_host(&s, &bv).unwrap();
        let bias = Buffer::from_host(&s, &biasv).unwrap();
        let res = Buffer::from_host(&s, &resv).unwrap();
        let cases = [
            Epilogue::bias(&bias, Activation::GeluTanh),
            Epilogue::bias(&bias, Activation::None),
            Epilogue::bias(&bias, Activation::GeluTanh).with_residual(&res),
            Epilogue {
                bias: None,
                act: Activation::Silu,
                residual: Some(&res),
            },
        ];
        let h = Host {
            a: av,
            b: bv,
            bias: biasv,
            res: resv,
        };
        for epi in cases {
            let mut out = poisoned::<T>(&s, m * n, nan());
            matmul_epilogue(&s, &a, &b, (m, n, k), &epi, &mut out).unwrap();
            check(&h, (m, n, k), &epi, &out.to_host(&s).unwrap(), "auto");
        }
    }
}

/// The residual path in chunks of rows: chunk sizes that do not divide the rows (the last
/// chunk shorter), rows not a multiple of 128, rows whose chunks start at unaligned
/// addresses (odd n and k), and `Whole` / `Auto` on the same inputs; the same chunks with
/// their epilogues on a second stream (`matmul_epilogue_overlapped`), read back on the first
/// (which must have waited for them). Every element of a NaN-poisoned output is checked, so
/// a chunk left unwritten or written out of place fails.
fn chunks_as<T: TestFloat>(dev: &Device, seed: u64) {
    let s = dev.new_stream().unwrap();
    let side = dev.new_stream().unwrap();
    let mut r = rng(seed);
    for ((m, n, k), rows) in [
        ((1100, 64, 40), 256),
        ((1100, 37, 19), 128),
        ((300, 48, 32), 100),
        ((257, 16, 8), 1),
    ] {
        let h = Host::<T> {
            a: random_in(&mut r, m * k, -1.0, 1.0),
            b: random_in(&mut r, k * n, -1.0, 1.0),
            bias: random_in(&mut r, n, -1.0, 1.0),
            res: random_in(&mut r, m * n, -1.0, 1.0),
        };
        let a = Buffer::from_host(&s, &h.a).unwrap();
        let b = Buffer::from_host(&s, &h.b).unwrap();
        let bias = Buffer::from_host(&s, &h.bias).unwrap();
        let res = Buffer::from_host(&s, &h.res).unwrap();
        for act in [Activation::GeluTanh, Activation::None] {
            let epi = Epilogue::bias(&bias, act).with_residual(&res);
            for chunks in [Chunks::Rows(rows), Chunks::Whole, Chunks::Auto] {
                let mut out = poisoned::<T>(&s, m * n, nan());
                matmul_epilogue_with(&s, &a, &b, (m, n, k), &epi, chunks, &mut out).unwrap();
                let what = format!("{chunks:?}");
                check(&h, (m, n, k), &epi, &out.to_host(&s).unwrap(), &what);
            }
            for rows in [rows, m.div_ceil(3)] {
                let mut out = poisoned::<T>(&s, m * n, nan());
                let chunks = Chunks::Rows(rows);
                matmul_epilogue_overlapped(&s, &side, &a, &b, (m, n, k), &epi, chunks, &mut out)
                    .unwrap();
                let what = format!("{chunks:?} overlapped");
                check(&h, (m, n, k), &epi, &out.to_host(&s).unwrap(), &what);
            }
        }
    }
}

device_test!(gemm_with_epilogues, gpu_gemm_with_epilogues, |dev| {
    let seed = seed("gemm_with_epilogues");
    body_as::<bf16>(dev, seed);
    body_as::<f16>(dev, seed);
    body_as::<f32>(dev, seed);
});

device_test!(
    gemm_residual_in_chunks,
    gpu_gemm_residual_in_chunks,
    |dev| {
        let seed = seed("gemm_residual_in_chunks");
        chunks_as::<bf16>(dev, seed);
        chunks_as::<f16>(dev, seed);
        // f32 takes the GEMM and one kernel: chunks are ignored, the result the same.
        chunks_as::<f32>(dev, seed);
    }
);

#[test]
fn chunk_choices() {
    let s = Device::cpu().new_stream().unwrap();
    // Auto on the CPU backend (no L2 known) and Whole: one GEMM.
    assert_eq!(Chunks::Auto.rows::<bf16>(&s, (4096, 4096)).unwrap(), None);
    assert_eq!(Chunks::Whole.rows::<bf16>(&s, (4096, 4096)).unwrap(), None);
    assert_eq!(
        Chunks::Rows(1000).rows::<bf16>(&s, (4096, 64)).unwrap(),
        Some(1000)
    );
    // As many rows as the product or more: one chunk.
    assert_eq!(Chunks::Rows(64).rows::<bf16>(&s, (64, 64)).unwrap(), None);
    assert!(Chunks::Rows(0).rows::<bf16>(&s, (64, 64)).is_err());
    // Zero-row chunks are refused by matmul_epilogue_with too, before anything runs.
    let a = Buffer::from_host(&s, &[bf16::ONE; 6]).unwrap();
    let bias = Buffer::from_host(&s, &[bf16::ONE; 2]).unwrap();
    let res = Buffer::from_host(&s, &[bf16::ONE; 4]).unwrap();
    let mut out = Buffer::<bf16>::zeros(&s, 4).unwrap();
    let epi = Epilogue::bias(&bias, Activation::GeluTanh).with_residual(&res);
    let r = matmul_epilogue_with(&s, &a, &a, (2, 2, 3), &epi, Chunks::Rows(0), &mut out);
    assert!(matches!(r, Err(Error::InvalidArgument(_))), "{r:?}");
}

#[test]
fn shapes_are_checked() {
    let s = Device::cpu().new_stream().unwrap();
    let a = Buffer::from_host(&s, &[bf16::ONE; 6]).unwrap();
    let b = Buffer::from_host(&s, &[bf16::ONE; 6]).unwrap();
    let short = Buffer::from_host(&s, &[bf16::ONE; 2]).unwrap();
    let mut out = Buffer::<bf16>::zeros(&s, 4).unwrap();
    // (m, n, k) = (2, 2, 3): a 2×3, b 3×2, out 2×2; the bias must have 2.
    let ok = Buffer::from_host(&s, &[bf16::ONE; 2]).unwrap();
    matmul_epilogue(
        &s,
        &a,
        &b,
        (2, 2, 3),
        &Epilogue::bias(&ok, Activation::GeluTanh),
        &mut out,
    )
    .unwrap();
    let bad = Buffer::from_host(&s, &[bf16::ONE; 3]).unwrap();
    let r = matmul_epilogue(
        &s,
        &a,
        &b,
        (2, 2, 3),
        &Epilogue::bias(&bad, Activation::None),
        &mut out,
    );
    assert!(matches!(r, Err(Error::LengthMismatch { .. })), "{r:?}");
    let r = matmul_epilogue(
        &s,
        &a,
        &b,
        (2, 2, 3),
        &Epilogue::bias(&ok, Activation::None).with_residual(&short),
        &mut out,
    );
    assert!(matches!(r, Err(Error::LengthMismatch { .. })), "{r:?}");
    let r = matmul_epilogue(
        &s,
        &a,
        &b,
        (3, 2, 3),
        &Epilogue::bias(&ok, Activation::None),
        &mut out,
    );
    assert!(r.is_err());
    assert!(Epilogue::bias(&ok, Activation::GeluTanh).in_cublaslt());
    assert!(!Epilogue::bias(&ok, Activation::Silu).in_cublaslt());
    assert!(!Epilogue::bias(&ok, Activation::None)
        .with_residual(&ok)
        .in_cublaslt());
}
