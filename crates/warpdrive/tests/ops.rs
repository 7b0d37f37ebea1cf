//! The foundation ops on both backends. CPU tests compare with an f64 reference; GPU tests
//! (`gpu_*`, ignored without a GPU) compare CUDA with the CPU backend on fresh random inputs,
//! with every output poisoned (NaN) before the op so unwritten elements fail.
//!
//! Tolerances (DESIGN.md): elementwise results within 1e-6 (f32) / 1e-14 (f64) of the
//! magnitude of their terms; sums within 1e-6 (f32) / 1e-12 (f64) of Σ|x|.

mod common;

use common::{cuda, device_test, random_f32, random_f64, rng, seed, SIZES};
use warpdrive::{ops, Buffer, Device, Error, Float};

trait Tol: Float {
    const ELEMENT: f64;
    const SUM: f64;
    fn random(rng: &mut rand::rngs::StdRng, n: usize) -> Vec<Self>;
    fn poison() -> Self;
}
impl Tol for f32 {
    const ELEMENT: f64 = 1e-6;
    const SUM: f64 = 1e-6;
    fn random(rng: &mut rand::rngs::StdRng, n: usize) -> Vec<Self> {
        random_f32(rng, n)
    }
    fn poison() -> Self {
        f32::NAN
    }
}
impl Tol for f64 {
    const ELEMENT: f64 = 1e-14;
    const SUM: f64 = 1e-12;
    fn random(rng: &mut rand::rngs::StdRng, n: usize) -> Vec<Self> {
        random_f64(rng, n)
    }
    fn poison() -> Self {
        f64::NAN
    }
}

/// A buffer of `n` poisoned elements.
fn poisoned<T: Tol>(dev: &Device, n: usize) -> Buffer<T> {
    let s = dev.new_stream().unwrap();
    Buffer::from_host(&s, &vec![T::poison(); n]).unwrap()
}

// ---- one body per op, run on each backend ----

fn fill_body<T: Tol>(dev: &Device, seed: u64) {
    let s = dev.new_stream().unwrap();
    let mut r = rng(seed);
    for n in SIZES {
        let value = T::random(&mut r, 1)[0];
        let mut buf = poisoned::<T>(dev, n);
        ops::fill(&s, &mut buf, value).unwrap();
        let out = buf.to_host(&s).unwrap();
        assert_eq!(out.len(), n);
        assert!(out.iter().all(|&v| v == value), "fill n={n}");
    }
}

fn copy_body<T: Tol>(dev: &Device, seed: u64) {
    let s = dev.new_stream().unwrap();
    let mut r = rng(seed);
    for n in SIZES {
        let data = T::random(&mut r, n);
        let src = Buffer::from_host(&s, &data).unwrap();
        let mut dst = poisoned::<T>(dev, n);
        ops::copy(&s, &src, &mut dst).unwrap();
        assert!(dst.to_host(&s).unwrap() == data, "copy n={n}");
    }
}

/// axpy on `dev`, checked against an f64 reference; returns each result with its bound.
fn axpy_body<T: Tol>(dev: &Device, seed: u64) -> Vec<Vec<(T, f64)>> {
    let s = dev.new_stream().unwrap();
    let mut r = rng(seed);
    let mut outputs = Vec::new();
    for n in SIZES {
        let alpha = T::random(&mut r, 1)[0];
        let (xs, ys) = (T::random(&mut r, n), T::random(&mut r, n));
        let x = Buffer::from_host(&s, &xs).unwrap();
        let mut y = poisoned::<T>(dev, n);
        y.copy_from_host(&s, &ys).unwrap();
        ops::axpy(&s, alpha, &x, &mut y).unwrap();
        let got = y.to_host(&s).unwrap();
        let mut checked = Vec::with_capacity(n);
        for i in 0..n {
            let (a, xi, yi) = (alpha.to_f64(), xs[i].to_f64(), ys[i].to_f64());
            let want = a * xi + yi;
            let bound = T::ELEMENT * ((a * xi).abs() + yi.abs()) + f64::MIN_POSITIVE;
            let err = (got[i].to_f64() - want).abs();
            assert!(
                err <= bound,
                "axpy n={n} i={i}: got {:?}, want {want}",
                got[i]
            );
            checked.push((got[i], bound));
        }
        outputs.push(checked);
    }
    outputs
}

/// sum on `dev`, checked against an f64 reference; returns the sums.
fn sum_body<T: Tol>(dev: &Device, seed: u64) -> Vec<T> {
    let s = dev.new_stream().unwrap();
    let mut r = rng(seed);
    let mut sums = Vec::new();
    for n in SIZES {
        let xs = T::random(&mut r, n);
        let x = Buffer::from_host(&s, &xs).unwrap();
        let mut out = poisoned::<T>(dev, 1);
        ops::sum_into(&s, &x, &mut out).unwrap();
        let got = out.to_host(&s).unwrap()[0];
        let want: f64 = xs.iter().map(|v| v.to_f64()).sum();
        let magnitude: f64 = xs.iter().map(|v| v.to_f64().abs()).sum();
        let err = (got.to_f64() - want).abs();
        assert!(
            err <= T::SUM * magnitude + f64::MIN_POSITIVE,
            "sum n={n}: got {got:?}, want {want} (err {err:e}, Σ|x| {magnitude})"
        );
        assert_eq!(
            ops::sum_to_host(&s, &x).unwrap(),
            got,
            "sum is deterministic"
        );
        sums.push(got);
    }
    sums
}

// ---- both backends ----

device_test!(cpu_fill, gpu_fill, |dev| {
    fill_body::<f32>(dev, seed("fill f32"));
    fill_body::<f64>(dev, seed("fill f64"));
});

device_test!(cpu_copy, gpu_copy, |dev| {
    copy_body::<f32>(dev, seed("copy f32"));
    copy_body::<f64>(dev, seed("copy f64"));
});

#[test]
fn cpu_fill_every_dtype() {
    use half::{bf16, f16};
    let s = Device::cpu().new_stream().unwrap();
    let mut b = Buffer::<bf16>::uninit(&s, 5).unwrap();
    ops::fill(&s, &mut b, bf16::from_f32(1.5)).unwrap();
    assert_eq!(b.to_host(&s).unwrap(), vec![bf16::from_f32(1.5); 5]);
    let mut h = Buffer::<f16>::zeros(&s, 3).unwrap();
    assert_eq!(h.to_host(&s).unwrap(), vec![f16::ZERO; 3]);
    ops::fill(&s, &mut h, f16::from_f32(-2.0)).unwrap();
    assert_eq!(h.to_host(&s).unwrap(), vec![f16::from_f32(-2.0); 3]);
    let mut u = Buffer::<u8>::uninit(&s, 7).unwrap();
    ops::fill(&s, &mut u, 0xab).unwrap();
    assert_eq!(u.to_host(&s).unwrap(), vec![0xab; 7]);
}

// ---- errors ----

#[test]
fn length_mismatches_are_errors() {
    let s = Device::cpu().new_stream().unwrap();
    let x = Buffer::<f32>::zeros(&s, 3).unwrap();
    let mut y = Buffer::<f32>::zeros(&s, 4).unwrap();
    let err = ops::axpy(&s, 1.0, &x, &mut y).unwrap_err();
    assert!(
        matches!(
            err,
            Error::LengthMismatch {
                left: 3,
                right: 4,
                ..
            }
        ),
        "{err}"
    );
    assert!(err.to_string().contains("axpy"), "{err}");
    assert!(matches!(
        ops::copy(&s, &x, &mut y),
        Err(Error::LengthMismatch { .. })
    ));
    assert!(matches!(
        y.copy_from_host(&s, &[1.0; 2]),
        Err(Error::LengthMismatch { .. })
    ));
    let mut short = [0f32; 2];
    assert!(matches!(
        x.copy_to_host(&s, &mut short),
        Err(Error::LengthMismatch { .. })
    ));
    let mut two = Buffer::<f32>::zeros(&s, 2).unwrap();
    assert!(matches!(
        ops::sum_into(&s, &x, &mut two),
        Err(Error::LengthMismatch { .. })
    ));
}

#[test]
fn empty_buffers_are_no_ops() {
    let s = Device::cpu().new_stream().unwrap();
    let x = Buffer::<f32>::from_host(&s, &[]).unwrap();
    let mut y = Buffer::<f32>::zeros(&s, 0).unwrap();
    assert!(x.is_empty() && y.is_empty());
    ops::axpy(&s, 2.0, &x, &mut y).unwrap();
    ops::copy(&s, &x, &mut y).unwrap();
    ops::fill(&s, &mut y, 1.0).unwrap();
    assert_eq!(ops::sum_to_host(&s, &x).unwrap(), 0.0);
    assert!(y.to_host(&s).unwrap().is_empty());
}

// ---- CUDA against the CPU backend ----

#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_fill_every_width() {
    use half::bf16;
    let s = cuda().new_stream().unwrap();
    let mut b = Buffer::<bf16>::from_host(&s, &[bf16::NAN; 1025]).unwrap();
    ops::fill(&s, &mut b, bf16::from_f32(1.5)).unwrap();
    assert_eq!(b.to_host(&s).unwrap(), vec![bf16::from_f32(1.5); 1025]);
    let mut u = Buffer::<u8>::from_host(&s, &[0u8; 4099]).unwrap();
    ops::fill(&s, &mut u, 0xab).unwrap();
    assert_eq!(u.to_host(&s).unwrap(), vec![0xab; 4099]);
    let mut w = Buffer::<u64>::from_host(&s, &[0u64; 33]).unwrap();
    ops::fill(&s, &mut w, u64::MAX - 5).unwrap();
    assert_eq!(w.to_host(&s).unwrap(), vec![u64::MAX - 5; 33]);
    let z = Buffer::<f32>::zeros(&s, 77).unwrap();
    assert_eq!(z.to_host(&s).unwrap(), vec![0.0; 77]);
}

/// axpy of `T` on `dev` (checked in the body). On CUDA, the same inputs on the CPU backend:
/// CUDA must match it element for element (FMA contraction may differ by rounding, within
/// the elementwise bound).
fn axpy_checked<T: Tol>(dev: &Device, test: &str) {
    let seed = seed(test);
    let gpu = axpy_body::<T>(dev, seed);
    if !dev.is_cuda() {
        return;
    }
    let cpu = axpy_body::<T>(&Device::cpu(), seed);
    for (g, c) in gpu.iter().zip(&cpu) {
        assert_eq!(g.len(), c.len());
        for (&(a, bound), &(b, _)) in g.iter().zip(c) {
            let diff = (a.to_f64() - b.to_f64()).abs();
            assert!(diff <= 2.0 * bound, "{test}: cuda {a:?} vs cpu {b:?}");
        }
    }
}

/// Sums of `T` on `dev`, checked against the f64 reference in the body. On CUDA, the same
/// inputs on the CPU backend too: the two must agree within the same bound.
fn sum_checked<T: Tol>(dev: &Device, test: &str) {
    let seed = seed(test);
    let gpu = sum_body::<T>(dev, seed);
    if !dev.is_cuda() {
        return;
    }
    let cpu = sum_body::<T>(&Device::cpu(), seed);
    let mut r = rng(seed);
    for ((g, c), n) in gpu.iter().zip(&cpu).zip(SIZES) {
        let magnitude: f64 = T::random(&mut r, n).iter().map(|v| v.to_f64().abs()).sum();
        // The body drew `n` values for this size from the same stream; re-drawing them here
        // keeps `r` in step, so `magnitude` is this size's Σ|x|.
        let diff = (g.to_f64() - c.to_f64()).abs();
        assert!(
            diff <= 2.0 * T::SUM * magnitude + f64::MIN_POSITIVE,
            "{test} n={n}: cuda {g:?} vs cpu {c:?}"
        );
    }
}

device_test!(cpu_axpy, gpu_axpy_matches_cpu, |dev| {
    axpy_checked::<f32>(dev, "axpy f32");
    axpy_checked::<f64>(dev, "axpy f64");
});

device_test!(cpu_sum, gpu_smem_sum_matches_cpu, |dev| {
    sum_checked::<f32>(dev, "sum f32");
    sum_checked::<f64>(dev, "sum f64");
});

/// Row-major matmul on `dev` against an f64 reference, bound relative to Σ|a·b| per element.
fn matmul_body<T: warpdrive::DType>(
    dev: &Device,
    seed: u64,
    tol: f64,
    cast: fn(f32) -> T,
    back: fn(T) -> f64,
) {
    let s = dev.new_stream().unwrap();
    let mut r = rng(seed);
    for (m, n, k) in [(1, 1, 1), (17, 33, 65), (64, 1, 129), (5, 7, 0)] {
        let a: Vec<T> = random_f32(&mut r, m * k).into_iter().map(cast).collect();
        let b: Vec<T> = random_f32(&mut r, k * n).into_iter().map(cast).collect();
        let (da, db) = (
            Buffer::from_host(&s, &a).unwrap(),
            Buffer::from_host(&s, &b).unwrap(),
        );
        let mut dc = Buffer::from_host(&s, &vec![cast(f32::NAN); m * n]).unwrap();
        ops::gemm::matmul(&s, &da, &db, &mut dc, (m, n, k)).unwrap();
        let c = dc.to_host(&s).unwrap();
        for i in 0..m {
            for j in 0..n {
                let (mut want, mut mag) = (0.0, 0.0);
                for p in 0..k {
                    let t = back(a[i * k + p]) * back(b[p * n + j]);
                    want += t;
                    mag += t.abs();
                }
                let got = back(c[i * n + j]);
                assert!(
                    (got - want).abs() <= tol * mag + tol * want.abs() + 1e-30,
                    "{m}x{n}x{k} [{i},{j}]: {got} vs {want}"
                );
            }
        }
    }
    let x = Buffer::from_host(&s, &[cast(1.0); 6]).unwrap();
    let mut y = Buffer::from_host(&s, &[cast(1.0); 4]).unwrap();
    let err = ops::gemm::matmul(&s, &x, &x, &mut y, (2, 2, 2)).unwrap_err();
    assert!(matches!(err, Error::InvalidArgument(_)), "{err}");
}

/// f32 (full f32 on CUDA: cuBLAS uses TF32 only when asked), bf16 and f16.
fn matmul_every_type_body(dev: &Device) {
    let f32_tol = if dev.is_cuda() { 1e-5 } else { 1e-6 };
    matmul_body::<f32>(dev, seed("matmul f32"), f32_tol, |v| v, |v| v as f64);
    matmul_body::<half::bf16>(dev, seed("matmul bf16"), 1e-2, half::bf16::from_f32, |v| {
        v.to_f64()
    });
    matmul_body::<half::f16>(dev, seed("matmul f16"), 1e-3, half::f16::from_f32, |v| {
        v.to_f64()
    });
}

device_test!(cpu_matmul, gpu_matmul, matmul_every_type_body);

#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_errors_and_empty_buffers() {
    let dev = cuda();
    let s = dev.new_stream().unwrap();
    let x = Buffer::<f32>::zeros(&s, 3).unwrap();
    let mut y = Buffer::<f32>::zeros(&s, 4).unwrap();
    assert!(matches!(
        ops::axpy(&s, 1.0, &x, &mut y),
        Err(Error::LengthMismatch { .. })
    ));
    let cpu = Device::cpu().new_stream().unwrap();
    assert!(matches!(
        ops::fill(&cpu, &mut y, 1.0),
        Err(Error::DeviceMismatch { .. })
    ));
    let e = Buffer::<f32>::zeros(&s, 0).unwrap();
    let mut e2 = Buffer::<f32>::from_host(&s, &[]).unwrap();
    ops::axpy(&s, 1.0, &e, &mut e2).unwrap();
    ops::copy(&s, &e, &mut e2).unwrap();
    assert_eq!(ops::sum_to_host(&s, &e).unwrap(), 0.0);
}
