//! MatrixOps (`fuse::matmul_epilogue`): a GEMM with its epilogue on both backends: bias and
//! GELU (tanh) or none inside cuBLASLt's matmul for bf16 / f16 on a GPU, the GEMM and one
//! generated epilogue kernel otherwise (a residual, another activation, f32).
//!
//! The reference is the product of the (rounded) inputs in f64 and the epilogue's formula;
//! the bound is the type's tolerance (DESIGN.md) relative to the terms' magnitudes
//! (Σ|a·b| + |bias|, times the activation's slope, + |residual|).

mod common;

use common::{device_test, nan, poisoned, random_in, rng, seed, TestFloat};
use half::{bf16, f16};
use warpdrive::exec::Graph;
use warpdrive::fuse::{
    matmul_epilogue, matmul_epilogue_with, Epilogue, EpiloguePlan, Expr, Schedule,
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

fn body_as<T: TestFloat>(dev: &Device, seed: u64) {
    let shapes = [
        (1, 1, 1),
        (5, 7, 3),
        (33, 40, 17),
        (64, 64, 64),
        (3, 4, 0),
        (0, 3, 4),
    ];
    body_with::<T>(dev, seed, &shapes, EpiloguePlan::default());
}

/// Every epilogue of the cases below, each shape, in `plan`, against the f64 reference.
fn body_with<T: TestFloat>(
    dev: &Device,
    seed: u64,
    shapes: &[(usize, usize, usize)],
    plan: EpiloguePlan,
) {
    let s = dev.new_stream().unwrap();
    let mut r = rng(seed);
    for &(m, n, k) in shapes {
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
        for epi in cases {
            let mut out = poisoned::<T>(&s, m * n, nan());
            if plan == EpiloguePlan::default() {
                matmul_epilogue(&s, &a, &b, (m, n, k), &epi, &mut out).unwrap();
            } else {
                matmul_epilogue_with(&s, &a, &b, (m, n, k), &epi, &mut out, plan).unwrap();
            }
            let got = out.to_host(&s).unwrap();
            for i in 0..m {
                for j in 0..n {
                    let (mut x, mut terms) = (0.0f64, 0.0f64);
                    for p in 0..k {
                        let t = av[i * k + p].to_f64() * bv[p * n + j].to_f64();
                        x += t;
                        terms += t.abs();
                    }
                    if epi.bias.is_some() {
                        x += biasv[j].to_f64();
                        terms += biasv[j].to_f64().abs();
                    }
                    let mut want = act_ref(epi.act, x);
                    let mut mag = 1.2 * terms;
                    if epi.residual.is_some() {
                        want += resv[i * n + j].to_f64();
                        mag += resv[i * n + j].to_f64().abs();
                    }
                    let g = got[i * n + j].to_f64();
                    let bound = T::TOL * (mag + want.abs()) + T::TINY;
                    assert!(
                        (g - want).abs() <= bound,
                        "{} {m}x{n}x{k} {:?} cublaslt={} {plan:?} at ({i},{j}): got {g}, want {want}",
                        T::NAME,
                        epi.act,
                        epi.in_cublaslt()
                    );
                }
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

// Every plan of the epilogue kernel after the GEMM (cuBLAS's plain GEMM or cuBLASLt's with
// the bias, the kernel launched as a programmatic dependent, its chunks reversed, its inputs
// prefetched) computes what the default does: odd shapes (the scalar loop), shapes whose rows
// are a multiple of the vector (the vector loop, over tens of chunks so the order matters),
// the output NaN-poisoned, the default's tolerances.
device_test!(epilogue_plans, gpu_epilogue_plans, |dev| {
    let seed = seed("epilogue_plans");
    let shapes = [(5, 7, 3), (131, 333, 3), (300, 264, 2)];
    let sched = |reverse, programmatic, prefetch| Schedule {
        reverse,
        programmatic,
        prefetch,
    };
    for plain_gemm in [false, true] {
        for schedule in [
            sched(false, false, false),
            sched(false, true, false),
            sched(false, true, true),
            sched(true, false, false),
            sched(true, true, false),
            sched(true, true, true),
        ] {
            let plan = EpiloguePlan {
                plain_gemm,
                schedule,
            };
            body_with::<bf16>(dev, seed, &shapes, plan);
            body_with::<f16>(dev, seed, &shapes, plan);
            body_with::<f32>(dev, seed, &shapes, plan);
        }
    }
});

// A captured graph of the epilogue plans (the programmatic epilogue kernel becomes a
// programmatic edge from the GEMM's node) replays what eager execution computes, into a
// NaN-poisoned output, with new left operands written between replays.
device_test!(
    epilogue_plans_in_a_graph,
    gpu_epilogue_plans_in_a_graph,
    |dev| {
        let s = dev.new_stream().unwrap();
        let mut r = rng(seed("epilogue_plans_in_a_graph"));
        let (m, n, k) = (300, 264, 40);
        let bv: Vec<bf16> = random_in(&mut r, k * n, -1.0, 1.0);
        let biasv: Vec<bf16> = random_in(&mut r, n, -1.0, 1.0);
        let resv: Vec<bf16> = random_in(&mut r, m * n, -1.0, 1.0);
        let b = Buffer::from_host(&s, &bv).unwrap();
        let bias = Buffer::from_host(&s, &biasv).unwrap();
        let res = Buffer::from_host(&s, &resv).unwrap();
        let epi = Epilogue::bias(&bias, Activation::GeluTanh).with_residual(&res);
        let sched = Schedule {
            reverse: true,
            programmatic: true,
            prefetch: true,
        };
        for plain_gemm in [false, true] {
            let plan = EpiloguePlan {
                plain_gemm,
                schedule: sched,
            };
            let a = poisoned::<bf16>(&s, m * k, bf16::ZERO);
            let mut out = poisoned::<bf16>(&s, m * n, nan());
            let mut want = poisoned::<bf16>(&s, m * n, nan());
            // Once before the capture: kernels load, the pool holds the blocks it will hand out.
            matmul_epilogue_with(&s, &a, &b, (m, n, k), &epi, &mut out, plan).unwrap();
            s.synchronize().unwrap();
            let mut state = (a, out);
            let mut graph = Graph::capture_with(&s, &mut state, |s, (a, out)| {
                matmul_epilogue_with(s, a, &b, (m, n, k), &epi, out, plan)
            })
            .unwrap();
            for round in 0..3 {
                let av: Vec<bf16> = random_in(&mut r, m * k, -1.0, 1.0);
                // The graph replays on the buffers it captured: write the new operand there.
                let fresh = Buffer::from_host(&s, &av).unwrap();
                warpdrive::ops::copy(&s, &fresh, &mut state.0).unwrap();
                warpdrive::ops::fill(&s, &mut state.1, nan::<bf16>()).unwrap();
                graph.launch_with(&mut state).unwrap();
                matmul_epilogue_with(&s, &fresh, &b, (m, n, k), &epi, &mut want, plan).unwrap();
                let (got, eager) = (state.1.to_host(&s).unwrap(), want.to_host(&s).unwrap());
                assert!(
                got.iter().zip(&eager).all(|(g, w)| g.to_bits() == w.to_bits()),
                "plain_gemm={plain_gemm} round {round}: the replay differs from eager execution"
            );
                assert!(got.iter().all(|g| !g.is_nan()), "round {round}");
            }
        }
    }
);

// A schedule is for elementwise expressions: one for a reduction is refused (on both
// backends alike, checked before any launch); the default schedule is plain `eval_into`.
#[test]
fn a_schedule_is_for_maps_only() {
    let s = Device::cpu().new_stream().unwrap();
    let x = Buffer::from_host(&s, &[1.0f32, -2.0, 3.0, 4.0, 5.0, -6.0]).unwrap();
    let mut one = Buffer::<f32>::zeros(&s, 1).unwrap();
    let reverse = Schedule {
        reverse: true,
        ..Schedule::default()
    };
    let r = Expr::input(&x)
        .sum()
        .eval_into_scheduled(&s, &mut one, reverse);
    assert!(matches!(r, Err(Error::InvalidArgument(_))), "{r:?}");
    Expr::input(&x)
        .sum()
        .eval_into_scheduled(&s, &mut one, Schedule::default())
        .unwrap();
    assert_eq!(one.to_host(&s).unwrap(), [5.0]);
    let mut six = Buffer::<f32>::zeros(&s, 6).unwrap();
    (Expr::input(&x) * 2.0)
        .eval_into_scheduled(&s, &mut six, reverse)
        .unwrap();
    assert_eq!(six.to_host(&s).unwrap(), [2.0, -4.0, 6.0, 8.0, 10.0, -12.0]);
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
