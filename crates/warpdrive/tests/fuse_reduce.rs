//! Fused reductions (MapReduce, `warpdrive::fuse`): whole-buffer and per-row sums, means,
//! maxima and minima of elementwise maps, with what follows them fused in (softmax, a
//! softmax cross-entropy), on both backends, and their kernels through the real NVRTC.
//!
//! References are computed here in f64. Sums are bounded relative to the sum of the terms'
//! magnitudes (DESIGN.md): f32 accumulation in a tree of depth about log₂ n adds at most a
//! few 1e-6 of Σ|terms|; max and min are exact.

mod common;

use common::{device_test, poisoned, random_in, rng, seed, TestFloat};
use half::{bf16, f16};
use rand::Rng;
use warpdrive::fuse::{Expr, Shape};
use warpdrive::kernels::Arch;
use warpdrive::{Buffer, Device, Error};

/// Relative to Σ|terms| for the f32 accumulations.
const SUM_TOL: f64 = 4e-6;

const SIZES: [usize; 5] = [0, 1, 1023, 4096, (1 << 20) + 5];

fn whole_body_as<T: TestFloat>(dev: &Device, seed: u64) {
    let s = dev.new_stream().unwrap();
    let mut r = rng(seed);
    for n in SIZES {
        let xs: Vec<T> = random_in(&mut r, n, -2.0, 2.0);
        let ys: Vec<T> = random_in(&mut r, n, -2.0, 2.0);
        let (x, y) = (
            Buffer::from_host(&s, &xs).unwrap(),
            Buffer::from_host(&s, &ys).unwrap(),
        );
        let (ex, ey) = (Expr::input(&x), Expr::input(&y));
        let (xf, yf): (Vec<f64>, Vec<f64>) = (
            xs.iter().map(|v| v.to_f64()).collect(),
            ys.iter().map(|v| v.to_f64()).collect(),
        );
        let one = |e: Expr<'_>| {
            let mut out = poisoned::<f32>(&s, 1, f32::NAN);
            e.eval_into(&s, &mut out).unwrap();
            out.to_host(&s).unwrap()[0] as f64
        };
        // A dot product with its epilogue: Σ x·y / (1 + Σ|x|).
        let dot: f64 = xf.iter().zip(&yf).map(|(a, b)| a * b).sum();
        let abs: f64 = xf.iter().map(|a| a.abs()).sum();
        let terms: f64 = xf.iter().zip(&yf).map(|(a, b)| (a * b).abs()).sum();
        let got = one((&ex * &ey).sum() / (ex.abs().sum() + 1.0));
        let want = dot / (abs + 1.0);
        let bound = SUM_TOL * (terms + dot.abs()) / (abs + 1.0) + SUM_TOL * want.abs() + 1e-30;
        assert!(
            (got - want).abs() <= bound,
            "{} n={n}: dot/abs got {got}, want {want}",
            T::NAME
        );
        // mean of a map
        let got = one((&ex * 2.0 - &ey).mean());
        let sum: f64 = xf.iter().zip(&yf).map(|(a, b)| 2.0 * a - b).sum();
        let mag: f64 = xf
            .iter()
            .zip(&yf)
            .map(|(a, b)| (2.0 * a).abs() + b.abs())
            .sum();
        if n == 0 {
            assert!(got.is_nan(), "mean of nothing: {got}");
        } else {
            let want = sum / n as f64;
            assert!(
                (got - want).abs() <= SUM_TOL * mag / n as f64 + 1e-30,
                "{} n={n}: mean got {got}, want {want}",
                T::NAME
            );
        }
        // max and min: exact
        let mx = xf
            .iter()
            .zip(&yf)
            .map(|(a, b)| a - b)
            .fold(f64::NEG_INFINITY, f64::max);
        let mn = xf.iter().fold(f64::INFINITY, |m, &a| m.min(a));
        let got = one((&ex - &ey).reduce_max());
        let want = mx as f32 as f64;
        assert!(
            got == want || (got - want).abs() <= 1e-7 * want.abs(),
            "{} n={n}: max got {got}, want {mx}",
            T::NAME
        );
        assert_eq!(one(ex.reduce_min()), mn, "{} n={n}: min", T::NAME);
    }
}

device_test!(
    whole_reductions_with_epilogues,
    gpu_smem_whole_reductions_with_epilogues,
    |dev| {
        let seed = seed("whole_reductions_with_epilogues");
        whole_body_as::<f32>(dev, seed);
        whole_body_as::<f16>(dev, seed);
        whole_body_as::<bf16>(dev, seed);
    }
);

device_test!(
    reductions_propagate_nan,
    gpu_smem_reductions_propagate_nan,
    |dev| {
        let s = dev.new_stream().unwrap();
        let mut v: Vec<f32> = (0..5000).map(|i| (i % 17) as f32 - 8.0).collect();
        v[3777] = f32::NAN;
        let x = Buffer::from_host(&s, &v).unwrap();
        let one = |e: Expr<'_>| e.eval::<f32>(&s).unwrap().to_host(&s).unwrap()[0];
        let ex = Expr::input(&x);
        assert!(one(ex.sum()).is_nan());
        assert!(one(ex.reduce_max()).is_nan());
        assert!(one(ex.reduce_min()).is_nan());
        let m = Expr::matrix(&x, 50, 100);
        let rows = m.max_rows().eval::<f32>(&s).unwrap().to_host(&s).unwrap();
        for (r, v) in rows.iter().enumerate() {
            assert_eq!(v.is_nan(), r == 37, "row {r}: {v}");
        }
        // Infinity: the sum is +inf, the max too.
        let w = Buffer::from_host(&s, &[1.0f32, f32::INFINITY, -3.0]).unwrap();
        assert_eq!(one(Expr::input(&w).sum()), f32::INFINITY);
        assert_eq!(one(Expr::input(&w).reduce_max()), f32::INFINITY);
    }
);

/// Per-row sums, means, maxima and minima of a map with a row bias and a column scale, over
/// rows too short for a vector, vector-sized, and longer than a warp's share (block rows).
fn rows_body(dev: &Device) {
    let s = dev.new_stream().unwrap();
    let mut r = rng(seed("row_reductions"));
    for (rows, cols) in [
        (1, 3),
        (5, 7),
        (33, 64),
        (300, 1000),
        (9, 1025),
        (3, 4096),
        (4, 0),
    ] {
        let xs: Vec<bf16> = random_in(&mut r, rows * cols, -2.0, 2.0);
        let bias: Vec<f32> = random_in(&mut r, cols, -1.0, 1.0);
        let scale: Vec<f32> = random_in(&mut r, rows, 0.5, 1.5);
        let x = Buffer::from_host(&s, &xs).unwrap();
        let b = Buffer::from_host(&s, &bias).unwrap();
        let sc = Buffer::from_host(&s, &scale).unwrap();
        let m = (Expr::matrix(&x, rows, cols) + &b) * Expr::col(&sc);
        let val =
            |i: usize, j: usize| (xs[i * cols + j].to_f64() + bias[j] as f64) * scale[i] as f64;
        let mag = |i: usize, j: usize| {
            (xs[i * cols + j].to_f64().abs() + (bias[j] as f64).abs()) * scale[i] as f64
        };
        let run = |e: Expr<'_>| {
            assert_eq!(e.shape().unwrap(), Shape::new(rows, 1));
            let mut out = poisoned::<f32>(&s, rows, f32::NAN);
            e.eval_into(&s, &mut out).unwrap();
            out.to_host(&s).unwrap()
        };
        let (sums, means, maxs, mins) = (
            run(m.sum_rows()),
            run(m.mean_rows()),
            run(m.max_rows()),
            run(m.min_rows()),
        );
        for i in 0..rows {
            let vals: Vec<f64> = (0..cols).map(|j| val(i, j)).collect();
            let terms: f64 = (0..cols).map(|j| mag(i, j)).sum();
            let sum: f64 = vals.iter().sum();
            let ctx = format!("[{rows}, {cols}] row {i}");
            assert!(
                (sums[i] as f64 - sum).abs() <= SUM_TOL * terms + 1e-30,
                "{ctx}: sum {} vs {sum}",
                sums[i]
            );
            if cols == 0 {
                assert!(means[i].is_nan(), "{ctx}: mean of nothing");
                assert_eq!(
                    (maxs[i], mins[i]),
                    (f32::NEG_INFINITY, f32::INFINITY),
                    "{ctx}"
                );
                continue;
            }
            let mean = sum / cols as f64;
            assert!(
                (means[i] as f64 - mean).abs() <= SUM_TOL * terms / cols as f64 + 1e-30,
                "{ctx}: mean {} vs {mean}",
                means[i]
            );
            // (x + b)·s rounds twice in f32 on the way: two roundings of the extreme value.
            let mx = vals.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            let mn = vals.iter().copied().fold(f64::INFINITY, f64::min);
            assert!(
                (maxs[i] as f64 - mx).abs() <= 3e-7 * mx.abs().max(1.0),
                "{ctx}: max {} vs {mx}",
                maxs[i]
            );
            assert!(
                (mins[i] as f64 - mn).abs() <= 3e-7 * mn.abs().max(1.0),
                "{ctx}: min {} vs {mn}",
                mins[i]
            );
        }
    }
}

device_test!(row_reductions, gpu_smem_row_reductions, rows_body);

/// Softmax over rows (two levels of reduction, a result per element) and the softmax
/// cross-entropy per row with integer labels picked by column index, in bf16 and f32.
fn softmax_body_as<T: TestFloat>(dev: &Device) {
    let s = dev.new_stream().unwrap();
    let mut r = rng(seed("softmax_and_cross_entropy"));
    for (rows, cols) in [(1, 1), (3, 5), (17, 256), (64, 1000), (5, 3000)] {
        let xs: Vec<T> = random_in(&mut r, rows * cols, -6.0, 6.0);
        let labels: Vec<f32> = (0..rows).map(|_| r.random_range(0..cols) as f32).collect();
        let x = Buffer::from_host(&s, &xs).unwrap();
        let l = Buffer::from_host(&s, &labels).unwrap();
        let ex = Expr::matrix(&x, rows, cols);
        let m = ex.max_rows();
        let z = (&ex - &m).exp();
        let soft = (&z / z.sum_rows())
            .eval::<f32>(&s)
            .unwrap()
            .to_host(&s)
            .unwrap();
        let picked = Expr::col_index(cols)
            .equals(Expr::col(&l))
            .select(&ex, 0.0)
            .sum_rows();
        let xent = (z.sum_rows().log() + &m - picked)
            .eval::<f32>(&s)
            .unwrap()
            .to_host(&s)
            .unwrap();
        for i in 0..rows {
            let row: Vec<f64> = (0..cols).map(|j| xs[i * cols + j].to_f64()).collect();
            let mx = row.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            let total: f64 = row.iter().map(|v| (v - mx).exp()).sum();
            for j in 0..cols {
                let want = (row[j] - mx).exp() / total;
                let got = soft[i * cols + j] as f64;
                assert!(
                    (got - want).abs() <= 2e-6 * want + 1e-9,
                    "softmax {} [{rows},{cols}] ({i},{j}): {got} vs {want}",
                    T::NAME
                );
            }
            let want = total.ln() + mx - row[labels[i] as usize];
            let got = xent[i] as f64;
            assert!(
                (got - want).abs() <= 1e-5 * (1.0 + want.abs() + mx.abs()),
                "xent {} [{rows},{cols}] row {i}: {got} vs {want}",
                T::NAME
            );
        }
    }
}

device_test!(
    softmax_and_cross_entropy,
    gpu_smem_softmax_and_cross_entropy,
    |dev| {
        softmax_body_as::<f32>(dev);
        softmax_body_as::<bf16>(dev);
    }
);

// Argmax per row: random rows (warp and block rows), ties to the first, NaN winning, -inf
// rows, empty rows; and fused with what follows (is the argmax the label?).
device_test!(argmax_rows, gpu_smem_argmax_rows, |dev| {
    let s = dev.new_stream().unwrap();
    let mut r = rng(seed("argmax_rows"));
    for (rows, cols) in [(1, 1), (7, 5), (40, 64), (9, 1000), (5, 3001), (3, 0)] {
        let mut xs: Vec<f32> = (0..rows * cols)
            .map(|_| r.random_range(-4i32..4) as f32)
            .collect();
        if rows * cols > 20 {
            xs[7] = f32::NAN;
            xs[11] = f32::NAN;
            let last = rows * cols - 1;
            xs[last - cols.min(last)..]
                .iter_mut()
                .for_each(|v| *v = f32::NEG_INFINITY);
        }
        let x = Buffer::from_host(&s, &xs).unwrap();
        let labels: Vec<f32> = (0..rows).map(|i| (i % cols.max(1)) as f32).collect();
        let l = Buffer::from_host(&s, &labels).unwrap();
        let m = Expr::matrix(&x, rows, cols);
        let got = m
            .argmax_rows()
            .eval::<f32>(&s)
            .unwrap()
            .to_host(&s)
            .unwrap();
        let hit = m
            .argmax_rows()
            .equals(Expr::col(&l))
            .eval::<f32>(&s)
            .unwrap()
            .to_host(&s)
            .unwrap();
        for i in 0..rows {
            let row = &xs[i * cols..(i + 1) * cols];
            let want = row.iter().position(|v| v.is_nan()).or_else(|| {
                let mx = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                row.iter().position(|&v| v == mx)
            });
            match want {
                None => assert!(got[i].is_nan(), "[{rows},{cols}] row {i}: {}", got[i]),
                Some(w) => {
                    assert_eq!(got[i], w as f32, "[{rows},{cols}] row {i}");
                    assert_eq!(hit[i], (w as f32 == labels[i]) as u8 as f32, "row {i}");
                }
            }
        }
    }
});

// A row's max and Σ exp(x − max) in one pass on a GPU (online log-sum-exp) give the
// two-pass values in the special cases too: rows of only -inf, with +inf, with NaN; on warp
// rows (3 columns) and block rows (1500, padded with -inf, which adds nothing).
device_test!(
    log_sum_exp_special_values,
    gpu_smem_log_sum_exp_special_values,
    |dev| {
        let s = dev.new_stream().unwrap();
        let (inf, nan) = (f32::INFINITY, f32::NAN);
        let rows: [[f32; 3]; 7] = [
            [1.0, 2.0, 3.0],
            [-inf, -inf, -inf],
            [-inf, 0.0, 1.0],
            [inf, 0.0, 1.0],
            [nan, 0.0, 1.0],
            [1.0, inf, inf],
            [-80.0, 80.0, 0.5],
        ];
        for cols in [3usize, 1500] {
            let mut xs = Vec::new();
            for r in &rows {
                xs.extend_from_slice(r);
                xs.extend(std::iter::repeat_n(-inf, cols - 3));
            }
            let x = Buffer::from_host(&s, &xs).unwrap();
            let m = Expr::matrix(&x, rows.len(), cols);
            let mx = m.max_rows();
            let z = (&m - &mx).exp();
            let lse = (z.sum_rows().log() + &mx)
                .eval::<f32>(&s)
                .unwrap()
                .to_host(&s)
                .unwrap();
            let soft = (&z / z.sum_rows())
                .eval::<f32>(&s)
                .unwrap()
                .to_host(&s)
                .unwrap();
            for (i, r) in rows.iter().enumerate() {
                let row: Vec<f64> = xs[i * cols..(i + 1) * cols]
                    .iter()
                    .map(|&v| v as f64)
                    .collect();
                let big = row.iter().copied().fold(f64::NEG_INFINITY, |a, v| {
                    if a.is_nan() || v.is_nan() {
                        f64::NAN
                    } else {
                        a.max(v)
                    }
                });
                let total: f64 = row.iter().map(|v| (v - big).exp()).sum();
                let want = total.ln() + big;
                let got = lse[i] as f64;
                assert!(
                    (got.is_nan() && want.is_nan())
                        || got == want
                        || (got - want).abs() <= 1e-6 * (1.0 + want.abs()),
                    "cols {cols}, row {r:?}: log-sum-exp {got} vs {want}"
                );
                for j in 0..cols {
                    let want = (row[j] - big).exp() / total;
                    let got = soft[i * cols + j] as f64;
                    assert!(
                        (got.is_nan() && want.is_nan())
                            || (got - want).abs() <= 2e-6 * want.abs() + 1e-12,
                        "cols {cols}, row {r:?}, col {j}: softmax {got} vs {want}"
                    );
                }
            }
        }
    }
);

// Whole reductions of per-row results in the row kernel: a batch's mean softmax
// cross-entropy, its accuracy (argmax equals the label), the sum of the rows' maxima; warp and
// block rows.
device_test!(
    whole_reductions_of_row_results,
    gpu_smem_whole_reductions_of_row_results,
    |dev| {
        let s = dev.new_stream().unwrap();
        let mut r = rng(seed("whole_reductions_of_row_results"));
        for (rows, cols) in [(1, 5), (37, 64), (300, 100), (9, 2000)] {
            let xs: Vec<bf16> = random_in(&mut r, rows * cols, -4.0, 4.0);
            let labels: Vec<f32> = (0..rows).map(|_| r.random_range(0..cols) as f32).collect();
            let x = Buffer::from_host(&s, &xs).unwrap();
            let l = Buffer::from_host(&s, &labels).unwrap();
            let (ex, el) = (Expr::matrix(&x, rows, cols), Expr::col(&l));
            let m = ex.max_rows();
            let picked = Expr::col_index(cols)
                .equals(&el)
                .select(&ex, 0.0)
                .sum_rows();
            let loss = (&ex - &m).exp().sum_rows().log() + &m - picked;
            let one = |e: Expr<'_>| {
                let mut out = poisoned::<f32>(&s, 1, f32::NAN);
                e.eval_into(&s, &mut out).unwrap();
                out.to_host(&s).unwrap()[0] as f64
            };
            let (mean_loss, accuracy, max_sum) = (
                one(loss.mean()),
                one(ex.argmax_rows().equals(&el).mean()),
                one(m.sum() * 2.0),
            );
            let (mut want_loss, mut hits, mut want_max, mut mag) = (0.0f64, 0usize, 0.0f64, 0.0f64);
            for i in 0..rows {
                let row: Vec<f64> = (0..cols).map(|j| xs[i * cols + j].to_f64()).collect();
                let mx = row.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                let lse = row.iter().map(|v| (v - mx).exp()).sum::<f64>().ln() + mx;
                want_loss += lse - row[labels[i] as usize];
                mag += lse.abs() + row[labels[i] as usize].abs();
                let arg = row.iter().position(|&v| v == mx).unwrap_or(0);
                hits += (arg as f32 == labels[i]) as usize;
                want_max += mx;
            }
            let n = rows as f64;
            assert!(
                (mean_loss - want_loss / n).abs() <= 1e-5 * mag / n,
                "[{rows},{cols}] mean loss {mean_loss} vs {}",
                want_loss / n
            );
            assert!(
                (accuracy - hits as f64 / n).abs() <= 1e-6,
                "[{rows},{cols}] accuracy {accuracy}"
            );
            assert!(
                (max_sum - 2.0 * want_max).abs() <= 1e-5 * n * 8.0,
                "[{rows},{cols}] {max_sum}"
            );
        }
    }
);

#[test]
fn unsupported_nestings_are_errors() {
    let s = Device::cpu().new_stream().unwrap();
    let x = Buffer::from_host(&s, &[1.0f32; 12]).unwrap();
    let m = Expr::matrix(&x, 3, 4);
    for e in [
        (&m - m.sum()).sum(),
        &m - m.mean(),
        m.sum_rows().sum() + m.max_rows(),
        (m.sum_rows() - m.sum_rows().sum()).max_rows(),
        m.sum_rows().sum() + m.sum(),
    ] {
        let r = e.eval::<f32>(&s);
        assert!(matches!(r, Err(Error::Unsupported(_))), "{r:?}");
    }
}

/// Reduction kernels through the real NVRTC for sm_90a: whole (with an epilogue), rows per
/// warp and per block with per-row and per-element results, every output type.
#[test]
#[ignore = "needs NVRTC: eval $(scripts/setup-nvrtc)"]
fn reduction_kernels_compile_with_nvrtc() {
    let s = Device::cpu().new_stream().unwrap();
    let x = Buffer::from_host(&s, &[bf16::ONE; 64]).unwrap();
    let l = Buffer::from_host(&s, &[1.0f32; 8]).unwrap();
    let b = Buffer::from_host(&s, &[1.0f32; 8]).unwrap();
    let ex = Expr::matrix(&x, 8, 8);
    let m = ex.max_rows();
    let z = (&ex - &m).exp();
    let picked = Expr::col_index(8)
        .equals(Expr::col(&l))
        .select(&ex, 0.0)
        .sum_rows();
    let graphs = [
        (
            "whole",
            (&ex * Expr::input(&b)).sum() / ex.abs().reduce_max() + ex.reduce_min(),
        ),
        ("mean", ex.mean()),
        ("softmax", &z / z.sum_rows()),
        ("xent", z.sum_rows().log() + &m - picked),
        ("rows", (&ex + Expr::input(&b)).mean_rows() * Expr::col(&l)),
        (
            "argmax",
            ex.argmax_rows().equals(Expr::col(&l)) + ex.max_rows(),
        ),
        (
            "gather-rows",
            Expr::gather(&b, Expr::col_index(8)).sum_rows() + Expr::gather(&x, Expr::col(&l)),
        ),
        (
            "gather-all",
            Expr::gather(&b, ex.abs() * 4.0).sum() / ex.reduce_max(),
        ),
        (
            "rows-then-whole",
            (z.sum_rows().log() + &m).mean() + ex.argmax_rows().sum(),
        ),
    ];
    let sm80 = Arch::parse("sm_80").expect("an arch name");
    for (name, e) in &graphs {
        e.ptx::<bf16>(sm80)
            .unwrap_or_else(|err| panic!("{name} for sm_80: {err}"));
    }
    for (name, e) in graphs {
        for ptx in [
            e.ptx::<f32>(Arch::SM_90A),
            e.ptx::<bf16>(Arch::SM_90A),
            e.ptx::<f16>(Arch::SM_90A),
        ] {
            let ptx = ptx.unwrap_or_else(|err| panic!("{name}: {err}"));
            assert!(ptx.contains(".entry fuse_"), "{name}: no entry");
        }
    }
}
