//! Fused stream compaction (TransformFilter, `Expr::filter_into`): a map and a filter in one
//! pass on both backends, its order, count and bounds, and its kernels through NVRTC.

mod common;

use common::{device_test, poisoned, random_in, rng, seed, TestFloat};
use half::{bf16, f16};
use warpdrive::fuse::Expr;
use warpdrive::kernels::Arch;
use warpdrive::{Buffer, Device, Error};

const SIZES: [usize; 5] = [0, 1, 1023, 5000, (1 << 20) + 5];

/// `2x + 1` where `x < t`, for thresholds keeping none, about 1 %, half, and all.
fn filter_body_as<T: TestFloat>(dev: &Device, seed: u64) {
    let s = dev.new_stream().unwrap();
    let mut r = rng(seed);
    for n in SIZES {
        let xs: Vec<T> = random_in(&mut r, n, -1.0, 1.0);
        let x = Buffer::from_host(&s, &xs).unwrap();
        let ex = Expr::input(&x);
        for t in [-2.0f32, -0.98, 0.0, 2.0] {
            let mut out = poisoned::<f32>(&s, n + 3, -7.0);
            let mut count = poisoned::<u32>(&s, 1, u32::MAX);
            (&ex * 2.0 + 1.0)
                .filter_into(ex.lt(t), &s, &mut out, &mut count)
                .unwrap();
            let (got, k) = (
                out.to_host(&s).unwrap(),
                count.to_host(&s).unwrap()[0] as usize,
            );
            let want: Vec<f64> = xs
                .iter()
                .map(|v| v.to_f64())
                .filter(|&v| v < t as f64)
                .map(|v| 2.0 * v + 1.0)
                .collect();
            assert_eq!(k, want.len(), "{} n={n} t={t}: count", T::NAME);
            for (i, (&g, &w)) in got.iter().zip(&want).enumerate() {
                assert!(
                    (g as f64 - w).abs() <= 2e-7 * (w.abs() + 1.0),
                    "{} n={n} t={t} at {i}: got {g}, want {w}",
                    T::NAME
                );
            }
            assert!(
                got[k..].iter().all(|&g| g == -7.0),
                "{} n={n} t={t}: wrote past the count",
                T::NAME
            );
        }
    }
}

device_test!(
    filter_keeps_in_order,
    gpu_smem_filter_keeps_in_order,
    |dev| {
        let seed = seed("filter_keeps_in_order");
        filter_body_as::<f32>(dev, seed);
        filter_body_as::<bf16>(dev, seed);
    }
);

// A matrix filtered by a per-row predicate (a column broadcast) and a per-column one (a row
// broadcast); NaN counts as keep, as in select.
device_test!(
    filter_broadcasts_and_nan,
    gpu_smem_filter_broadcasts_and_nan,
    |dev| {
        let s = dev.new_stream().unwrap();
        let (rows, cols) = (37, 64);
        let xs: Vec<f32> = (0..rows * cols).map(|i| i as f32).collect();
        let flags: Vec<f32> = (0..rows)
            .map(|r| if r % 3 == 0 { 1.0 } else { 0.0 })
            .collect();
        let colflags: Vec<f32> = (0..cols)
            .map(|c| {
                if c == 5 {
                    f32::NAN
                } else if c % 2 == 0 {
                    1.0
                } else {
                    0.0
                }
            })
            .collect();
        let (x, f, g) = (
            Buffer::from_host(&s, &xs).unwrap(),
            Buffer::from_host(&s, &flags).unwrap(),
            Buffer::from_host(&s, &colflags).unwrap(),
        );
        let m = Expr::matrix(&x, rows, cols);
        let (got, k) = m.filter::<f32>(Expr::col(&f), &s).unwrap();
        let want: Vec<f32> = xs
            .iter()
            .copied()
            .filter(|v| (*v as usize / cols) % 3 == 0)
            .collect();
        assert_eq!(got.to_host(&s).unwrap()[..k], want[..]);
        let (got, k) = m.filter::<f32>(Expr::input(&g), &s).unwrap();
        let want: Vec<f32> = xs
            .iter()
            .copied()
            .filter(|v| {
                let c = *v as usize % cols;
                c == 5 || c % 2 == 0
            })
            .collect();
        assert_eq!(got.to_host(&s).unwrap()[..k], want[..]);
    }
);

#[test]
fn filter_checks_its_outputs() {
    let s = Device::cpu().new_stream().unwrap();
    let x = Buffer::from_host(&s, &[1.0f32; 10]).unwrap();
    let ex = Expr::input(&x);
    let mut short = Buffer::<f32>::zeros(&s, 9).unwrap();
    let mut count = Buffer::<u32>::zeros(&s, 1).unwrap();
    let r = ex.filter_into(ex.gt(0.0), &s, &mut short, &mut count);
    assert!(matches!(r, Err(Error::InvalidArgument(m)) if m.contains("9")));
    let mut out = Buffer::<f32>::zeros(&s, 10).unwrap();
    let mut two = Buffer::<u32>::zeros(&s, 2).unwrap();
    assert!(ex.filter_into(ex.gt(0.0), &s, &mut out, &mut two).is_err());
    let y = Buffer::from_host(&s, &[1.0f32; 4]).unwrap();
    let r = ex.filter_into(Expr::input(&y).gt(0.0), &s, &mut out, &mut count);
    assert!(
        matches!(r, Err(Error::InvalidArgument(m)) if m.contains("[1, 10]") && m.contains("[1, 4]"))
    );
    assert!(matches!(
        ex.filter_into(ex.sum(), &s, &mut out, &mut count),
        Err(Error::Unsupported(_))
    ));
}

#[test]
#[ignore = "needs NVRTC: eval $(scripts/setup-nvrtc)"]
fn filter_kernels_compile_with_nvrtc() {
    let s = Device::cpu().new_stream().unwrap();
    let x = Buffer::from_host(&s, &[bf16::ONE; 64]).unwrap();
    let c = Buffer::from_host(&s, &[1.0f32; 8]).unwrap();
    let ex = Expr::matrix(&x, 8, 8);
    let gathered = Expr::gather(&c, Expr::col_index(8)).gt(0.0);
    for keep in [
        ex.gt(0.5),
        Expr::col(&c).gt(0.0),
        Expr::input(&c).equals(1.0),
        gathered,
    ] {
        let src = ex.filter_source::<bf16>(&keep).unwrap();
        assert!(
            src.contains("fuse_filter") && src.contains("block_exclusive_scan"),
            "{src}"
        );
        let ptx = ex.filter_ptx::<f32>(&keep, Arch::SM_90A).unwrap();
        assert!(ptx.contains(".entry fuse_filter"));
        ex.filter_ptx::<bf16>(&keep, Arch::SM_90A).unwrap();
        ex.filter_ptx::<f16>(&keep, Arch::parse("sm_80").expect("an arch name"))
            .unwrap();
    }
}
