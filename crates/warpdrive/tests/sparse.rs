//! `ops::sparse`: DGC's top-k per block with error feedback and momentum, and the densify
//! that sums the ranks' payloads, one body on each backend. The GPU must give the CPU
//! reference's bits (NaNs may differ in payload only); on either backend the outputs keep the
//! format's promises: each block sends ⌈len·keep/2048⌉ distinct indices of its own, in index
//! order, none smaller in |v| than any entry left behind (ties to the lower index); sent entries leave `u` and `v` at zero; and over many steps what was sent plus what
//! is still held equals the sum of the gradients (nothing is lost).

mod common;

use common::{device_test, poisoned, random_f32, rng, seed};
use warpdrive::ops::sparse::{densify, topk_ef, Sparsity, SPARSE_BLOCK, UNUSED};
use warpdrive::{Buffer, Device, Error};

const SIZES: [usize; 6] = [1, 31, 2047, 2048, 2049, 100_003];

/// One step's outputs: (u, v, idx, val).
type Step = (Vec<f32>, Vec<f32>, Vec<u32>, Vec<f32>);

fn step(dev: &Device, g: &[f32], u: &[f32], v: &[f32], m: f32, sp: Sparsity) -> Step {
    let s = dev.new_stream().unwrap();
    let grad = Buffer::from_host(&s, g).unwrap();
    let (mut ub, mut vb) = (
        Buffer::from_host(&s, u).unwrap(),
        Buffer::from_host(&s, v).unwrap(),
    );
    let slots = sp.slots(g.len()).unwrap();
    let mut idx = poisoned(&s, slots, 0xdead_beefu32);
    let mut val = poisoned(&s, slots, -7.0f32);
    topk_ef(&s, &grad, &mut ub, &mut vb, m, sp, &mut idx, &mut val).unwrap();
    (
        ub.to_host(&s).unwrap(),
        vb.to_host(&s).unwrap(),
        idx.to_host(&s).unwrap(),
        val.to_host(&s).unwrap(),
    )
}

fn same_bits(a: &[f32], b: &[f32], what: &str) {
    assert_eq!(a.len(), b.len(), "{what}: lengths");
    for (i, (x, y)) in a.iter().zip(b).enumerate() {
        assert!(
            x.to_bits() == y.to_bits() || (x.is_nan() && y.is_nan()),
            "{what} i={i}: {x} vs {y}"
        );
    }
}

fn topk_ef_body(dev: &Device) {
    let mut r = rng(seed("topk_ef"));
    for n in SIZES {
        for (density, m) in [(0.01, 0.0f32), (0.1, 0.9), (1.0, 0.5)] {
            let sp = Sparsity::new(density).unwrap();
            let mut g = random_f32(&mut r, n);
            // Ties (a repeated magnitude) and a NaN: both orders are defined.
            if n > 40 {
                g[7] = 0.75;
                g[9] = -0.75;
                g[n - 3] = f32::NAN;
            }
            let u: Vec<f32> = random_f32(&mut r, n).iter().map(|x| x * 0.1).collect();
            let v: Vec<f32> = random_f32(&mut r, n).iter().map(|x| x * 0.5).collect();
            let what = format!("n={n} density={density} m={m}");
            let (u2, v2, idx, val) = step(dev, &g, &u, &v, m, sp);
            if dev.is_cuda() {
                let (cu, cv, ci, cval) = step(&Device::cpu(), &g, &u, &v, m, sp);
                assert_eq!(idx, ci, "{what}: idx");
                same_bits(&val, &cval, &format!("{what}: val"));
                same_bits(&u2, &cu, &format!("{what}: u"));
                same_bits(&v2, &cv, &format!("{what}: v"));
            }
            // The accumulation, as the docs state it.
            let acc_u: Vec<f32> = (0..n).map(|i| m.mul_add(u[i], g[i])).collect();
            let acc_v: Vec<f32> = (0..n).map(|i| v[i] + acc_u[i]).collect();
            let keep = sp.keep();
            for (b, start) in (0..n).step_by(SPARSE_BLOCK).enumerate() {
                let end = (start + SPARSE_BLOCK).min(n);
                let sent = ((end - start) * keep).div_ceil(SPARSE_BLOCK);
                let slots = &idx[b * keep..(b + 1) * keep];
                assert!(slots[sent..].iter().all(|&i| i == UNUSED), "{what} b={b}");
                assert!(val[b * keep + sent..(b + 1) * keep]
                    .iter()
                    .all(|&x| x == 0.0));
                let key = |i: usize| {
                    // |v| by its bits, NaN above every number; then the lower index.
                    let a = acc_v[i].abs();
                    let bits = if a.is_nan() { u32::MAX } else { a.to_bits() };
                    (bits, std::cmp::Reverse(i))
                };
                let mut chosen = vec![false; end - start];
                for (j, &i) in slots[..sent].iter().enumerate() {
                    let i = i as usize;
                    assert!(
                        (start..end).contains(&i),
                        "{what}: index {i} outside block {b}"
                    );
                    assert!(!chosen[i - start], "{what}: index {i} twice");
                    chosen[i - start] = true;
                    let x = val[b * keep + j];
                    assert!(x.to_bits() == acc_v[i].to_bits() || (x.is_nan() && acc_v[i].is_nan()));
                    assert_eq!((u2[i], v2[i]), (0.0, 0.0), "{what}: sent {i} cleared");
                    if j > 0 {
                        assert!(slots[j - 1] < slots[j], "{what}: index order at slot {j}");
                    }
                }
                let weakest = slots[..sent].iter().map(|&i| key(i as usize)).min();
                for i in start..end {
                    if !chosen[i - start] {
                        assert!(Some(key(i)) < weakest, "{what}: {i} left behind");
                        same_bits(&[u2[i], v2[i]], &[acc_u[i], acc_v[i]], &what);
                    }
                }
            }
        }
    }
}

/// Every |v| equal: each block takes its first entries.
fn ties_body(dev: &Device) {
    let n = 5_000;
    let sp = Sparsity::new(0.01).unwrap();
    let g: Vec<f32> = (0..n)
        .map(|i| if i % 2 == 0 { 0.5 } else { -0.5 })
        .collect();
    let zeros = vec![0.0f32; n];
    let (_, v, idx, val) = step(dev, &g, &zeros, &zeros, 0.0, sp);
    let keep = sp.keep();
    for (b, start) in (0..n).step_by(SPARSE_BLOCK).enumerate() {
        let len = (n - start).min(SPARSE_BLOCK);
        let sent = (len * keep).div_ceil(SPARSE_BLOCK);
        let want: Vec<u32> = (start..start + sent).map(|i| i as u32).collect();
        assert_eq!(&idx[b * keep..b * keep + sent], &want[..], "block {b}");
        for (j, &i) in want.iter().enumerate() {
            assert_eq!(val[b * keep + j], g[i as usize]);
            assert_eq!(v[i as usize], 0.0);
        }
        assert_eq!(
            v[start + sent],
            g[start + sent],
            "block {b}: the next one stays"
        );
    }
}

/// Over many steps, what was sent plus what `v` still holds is the sum of the gradients
/// (momentum 0: u is the gradient itself), to rounding.
fn nothing_lost_body(dev: &Device) {
    let mut r = rng(seed("topk_nothing_lost"));
    let n = 5_000;
    let sp = Sparsity::new(0.01).unwrap();
    let s = dev.new_stream().unwrap();
    let (mut u, mut v) = (
        Buffer::from_host(&s, &vec![0.0f32; n]).unwrap(),
        Buffer::from_host(&s, &vec![0.0f32; n]).unwrap(),
    );
    let slots = sp.slots(n).unwrap();
    let mut idx = poisoned(&s, slots, 0u32);
    let mut val = poisoned(&s, slots, 0.0f32);
    let mut out = poisoned(&s, n, f32::NAN);
    let (mut total, mut sent) = (vec![0.0f64; n], vec![0.0f64; n]);
    for _ in 0..60 {
        let g = random_f32(&mut r, n);
        g.iter().zip(&mut total).for_each(|(g, t)| *t += *g as f64);
        let grad = Buffer::from_host(&s, &g).unwrap();
        topk_ef(&s, &grad, &mut u, &mut v, 0.0, sp, &mut idx, &mut val).unwrap();
        densify(&s, &idx, &val, 1, 1.0, &mut out).unwrap();
        let o = out.to_host(&s).unwrap();
        o.iter().zip(&mut sent).for_each(|(o, t)| *t += *o as f64);
    }
    let held = v.to_host(&s).unwrap();
    for i in 0..n {
        let back = sent[i] + held[i] as f64;
        assert!(
            (back - total[i]).abs() <= 1e-4,
            "i={i}: {back} vs {}",
            total[i]
        );
    }
}

/// `densify` sums payloads in rank order with alpha, zero elsewhere, skipping unused slots.
fn densify_body(dev: &Device) {
    let mut r = rng(seed("densify"));
    for n in [1usize, 300, 70_001] {
        for ranks in [1usize, 3] {
            let m = 64;
            let mut idx = Vec::new();
            for k in 0..ranks {
                // Distinct within a payload, overlapping across ranks, one unused and one out
                // of range.
                let mut p: Vec<u32> = (0..m as u32)
                    .map(|j| (j * 7 + k as u32) % n as u32)
                    .collect();
                p.sort_unstable();
                p.dedup();
                p.resize(m - 2, UNUSED);
                p.push(UNUSED);
                p.push(n as u32 + 5);
                idx.extend(p);
            }
            let val = random_f32(&mut r, idx.len());
            let alpha = 1.0 / ranks as f32;
            let s = dev.new_stream().unwrap();
            let (ib, vb) = (
                Buffer::from_host(&s, &idx).unwrap(),
                Buffer::from_host(&s, &val).unwrap(),
            );
            let mut out = poisoned(&s, n, f32::NAN);
            densify(&s, &ib, &vb, ranks, alpha, &mut out).unwrap();
            let got = out.to_host(&s).unwrap();
            let mut want = vec![0.0f32; n];
            for (&i, &x) in idx.iter().zip(&val) {
                if (i as usize) < n {
                    want[i as usize] = x.mul_add(alpha, want[i as usize]);
                }
            }
            same_bits(&got, &want, &format!("n={n} ranks={ranks}"));
        }
    }
}

fn errors_body(dev: &Device) {
    assert!(matches!(Sparsity::new(0.0), Err(Error::InvalidArgument(_))));
    assert!(matches!(Sparsity::new(1.5), Err(Error::InvalidArgument(_))));
    assert!(matches!(
        Sparsity::new(f64::NAN),
        Err(Error::InvalidArgument(_))
    ));
    assert_eq!(Sparsity::new(1e-9).unwrap().keep(), 1);
    assert_eq!(Sparsity::new(1.0).unwrap().keep(), SPARSE_BLOCK);
    let s = dev.new_stream().unwrap();
    let sp = Sparsity::new(0.01).unwrap();
    let n = 3000;
    let g = Buffer::from_host(&s, &vec![1.0f32; n]).unwrap();
    let mut u = Buffer::from_host(&s, &vec![0.0f32; n]).unwrap();
    let mut v = Buffer::from_host(&s, &vec![0.0f32; n - 1]).unwrap();
    let slots = sp.slots(n).unwrap();
    let mut idx = Buffer::from_host(&s, &vec![0u32; slots]).unwrap();
    let mut val = Buffer::from_host(&s, &vec![0.0f32; slots]).unwrap();
    let e = topk_ef(&s, &g, &mut u, &mut v, 0.0, sp, &mut idx, &mut val);
    assert!(matches!(e, Err(Error::LengthMismatch { .. })), "{e:?}");
    let mut v = Buffer::from_host(&s, &vec![0.0f32; n]).unwrap();
    let e = topk_ef(&s, &g, &mut u, &mut v, f32::NAN, sp, &mut idx, &mut val);
    assert!(matches!(e, Err(Error::InvalidArgument(_))), "{e:?}");
    let mut short = Buffer::from_host(&s, &vec![0u32; slots - 1]).unwrap();
    let e = topk_ef(&s, &g, &mut u, &mut v, 0.0, sp, &mut short, &mut val);
    assert!(matches!(e, Err(Error::LengthMismatch { .. })), "{e:?}");
    let mut out = Buffer::from_host(&s, &vec![0.0f32; n]).unwrap();
    let e = densify(&s, &idx, &val, 0, 1.0, &mut out);
    assert!(matches!(e, Err(Error::InvalidArgument(_))), "{e:?}");
    let e = densify(&s, &idx, &val, slots + 1, 1.0, &mut out);
    assert!(matches!(e, Err(Error::InvalidArgument(_))), "{e:?}");
    let e = densify(&s, &idx, &val, 1, f32::INFINITY, &mut out);
    assert!(matches!(e, Err(Error::InvalidArgument(_))), "{e:?}");
}

device_test!(
    topk_ef_sends_each_blocks_largest_and_keeps_the_rest,
    gpu_smem_topk_ef_sends_each_blocks_largest_and_keeps_the_rest,
    topk_ef_body
);
device_test!(
    topk_ef_breaks_ties_by_index,
    gpu_smem_topk_ef_breaks_ties_by_index,
    ties_body
);
device_test!(
    topk_ef_loses_nothing_over_many_steps,
    gpu_topk_ef_loses_nothing_over_many_steps,
    nothing_lost_body
);
device_test!(
    densify_sums_payloads_in_rank_order,
    gpu_densify_sums_payloads_in_rank_order,
    densify_body
);
device_test!(
    sparse_ops_reject_bad_arguments,
    gpu_sparse_ops_reject_bad_arguments,
    errors_body
);
