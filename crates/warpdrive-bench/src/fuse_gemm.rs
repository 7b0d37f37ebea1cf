//! The `fuse` suite's MatrixOps cases: a bf16 GEMM with its epilogue.
//!
//! - `gemm-bias-gelu-bf16`: `gelu_tanh(a·b + bias)`, `a` m×k, `b` k×n, `bias` one per column,
//!   m = n = k = `size` (4096 on CUDA).
//! - `gemm-bias-gelu-residual-bf16`: the same `+ r` (an m×n residual).
//! - `gemm-bf16`: the bare product (cuBLAS, and cuBLASLt with a zero bias), what the
//!   epilogues above add to.
//!
//! Variants: `warpdrive-cublaslt` (`fuse::matmul_epilogue`: one cuBLASLt matmul with its
//! GELU_BIAS epilogue inside the GEMM; with a residual, its BIAS epilogue, then GELU and the
//! residual in one generated kernel, launched as a programmatic dependent launch over the
//! product's chunks in reverse: the default `fuse::EpiloguePlan`), `warpdrive-fused` (the GEMM through cuBLAS
//! into bf16, then the whole epilogue as one generated kernel: bias broadcast along rows,
//! GELU, residual, one read and one write of the product), `warpdrive-unfused` (the GEMM,
//! then one kernel per epilogue op). The peer (`bench/peers/fuse.py`) gives `torch-eager`,
//! `torch-compile` and `torch-addmm-activation` (`torch._addmm_activation`: cuBLASLt's own
//! bias-GELU epilogue, as PyTorch calls it). TFLOP/s count the GEMM's 2·m·n·k and cite
//! `gemm_bf16_tflops`.

use half::bf16;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

use warpdrive::device::Stream;
use warpdrive::error::Error;
use warpdrive::error::Result;
use warpdrive::fuse::{
    matmul_epilogue, matmul_epilogue_with, Epilogue, EpiloguePlan, Expr, Schedule,
};
use warpdrive::memory::Buffer;
use warpdrive::ops::{self, Activation, BinaryOp, Map};

use super::results::Ceiling;
use super::timing::time_gpu;
use super::{Ctx, Scale};

/// m = n = k of the cases.
fn dim(scale: Scale) -> usize {
    match scale {
        Scale::Full => 4096,
        Scale::Quick => 256,
        Scale::Tiny => 32,
    }
}

fn random(n: usize, seed: u64, scale: f32) -> Vec<bf16> {
    let mut rng = SmallRng::seed_from_u64(seed);
    (0..n)
        .map(|_| bf16::from_f32(rng.random_range(-scale..scale)))
        .collect()
}

pub(crate) fn run_cases(ctx: &mut Ctx, warmup: usize, reps: usize) -> Result<()> {
    let d = dim(ctx.scale());
    let stream = ctx.stream().clone();
    // Entries of a·b stay O(1): k terms of size 1/sqrt(k).
    let s = 1.0 / (d as f32).sqrt().max(1.0);
    let a = Buffer::from_host(&stream, &random(d * d, 0x6e1, 1.0))?;
    let b = Buffer::from_host(&stream, &random(d * d, 0x6e2, s))?;
    let bias = Buffer::from_host(&stream, &random(d, 0x6e3, 1.0))?;
    let r = Buffer::from_host(&stream, &random(d * d, 0x6e4, 1.0))?;
    // Another left operand: the plans' outputs are checked on it right after a timed run on
    // `a`, so a kernel reading the product before the GEMM wrote it would read a's.
    let a2 = Buffer::from_host(&stream, &random(d * d, 0x6e5, 1.0))?;
    let mut c = Buffer::<bf16>::uninit(&stream, d * d)?;
    let mut t = Buffer::<bf16>::uninit(&stream, d * d)?;
    let mut out = Buffer::<bf16>::uninit(&stream, d * d)?;
    let flops = 2.0 * (d as f64).powi(3);
    // The bare product: what the epilogues add is read against it.
    ctx.step(format!("{}: gemm-bf16 ({d}³)", super::fuse::SUITE));
    let mut us = time_gpu(&stream, warmup, reps, |s| {
        ops::gemm::matmul(s, &a, &b, &mut c, (d, d, d))
    })?;
    ctx.record_flops(
        "gemm-bf16",
        d as u64,
        "warpdrive-cublas",
        &mut us,
        flops,
        Some(Ceiling::GemmBf16),
    )?;
    let no_bias = Buffer::from_host(&stream, &vec![bf16::ZERO; d])?;
    let lt_plain = Epilogue::bias(&no_bias, Activation::None);
    let mut us = time_gpu(&stream, warmup, reps, |s| {
        matmul_epilogue(s, &a, &b, (d, d, d), &lt_plain, &mut c)
    })?;
    let row = ctx.record_flops(
        "gemm-bf16",
        d as u64,
        "warpdrive-cublaslt",
        &mut us,
        flops,
        Some(Ceiling::GemmBf16),
    )?;
    row.extra
        .insert("epilogue".into(), "cuBLASLt BIAS (a zero bias)".into());
    for residual in [false, true] {
        let case = if residual {
            "gemm-bias-gelu-residual-bf16"
        } else {
            "gemm-bias-gelu-bf16"
        };
        ctx.step(format!("{}: {case} ({d}³)", super::fuse::SUITE));
        let mut us = time_gpu(&stream, warmup, reps, |s| {
            ops::gemm::matmul(s, &a, &b, &mut c, (d, d, d))?;
            let act = (Expr::matrix(&c, d, d) + &bias).gelu_tanh();
            if residual {
                (act + Expr::matrix(&r, d, d)).eval_into(s, &mut out)
            } else {
                act.eval_into(s, &mut out)
            }
        })?;
        let row = ctx.record_flops(
            case,
            d as u64,
            "warpdrive-fused",
            &mut us,
            flops,
            Some(Ceiling::GemmBf16),
        )?;
        row.extra.insert("kernels".into(), 2.into());
        row.extra.insert(
            "epilogue".into(),
            "one generated kernel after the cuBLAS GEMM".into(),
        );
        // The library's own path (fuse::matmul_epilogue): one cuBLASLt matmul with its
        // GELU_BIAS epilogue; with a residual, cuBLASLt's BIAS epilogue and one kernel.
        let epi = Epilogue::bias(&bias, Activation::GeluTanh);
        let epi = if residual { epi.with_residual(&r) } else { epi };
        let mut us = time_gpu(&stream, warmup, reps, |s| {
            matmul_epilogue(s, &a, &b, (d, d, d), &epi, &mut out)
        })?;
        let row = ctx.record_flops(
            case,
            d as u64,
            "warpdrive-cublaslt",
            &mut us,
            flops,
            Some(Ceiling::GemmBf16),
        )?;
        row.extra
            .insert("kernels".into(), (if residual { 2 } else { 1 }).into());
        row.extra.insert(
            "epilogue".into(),
            if residual {
                "cuBLASLt BIAS inside the GEMM, then GELU and the residual in one generated \
                 kernel (fuse::matmul_epilogue)"
            } else {
                "cuBLASLt GELU_BIAS inside the GEMM (fuse::matmul_epilogue)"
            }
            .into(),
        );
        if residual {
            plans(ctx, &stream, (warmup, reps), (&a, &a2, &b), &epi, &mut out)?;
        }
        let mut us = time_gpu(&stream, warmup, reps, |s| {
            ops::gemm::matmul(s, &a, &b, &mut c, (d, d, d))?;
            (Expr::matrix(&c, d, d) + &bias).eval_into(s, &mut t)?;
            if residual {
                ops::map(s, &Map::activation(Activation::GeluTanh), &t, &mut c)?;
                ops::binary(s, BinaryOp::Add, &c, &r, &mut out)
            } else {
                ops::map(s, &Map::activation(Activation::GeluTanh), &t, &mut out)
            }
        })?;
        let row = ctx.record_flops(
            case,
            d as u64,
            "warpdrive-unfused",
            &mut us,
            flops,
            Some(Ceiling::GemmBf16),
        )?;
        row.extra
            .insert("kernels".into(), (if residual { 4 } else { 3 }).into());
    }
    Ok(())
}

/// The residual case's plans beside the default (`fuse::EpiloguePlan`), one row each: the
/// epilogue kernel as a plain launch in chunk order (`in-order`, the default before), as a programmatic dependent launch of the GEMM (`pdl`; `prefetch`: its
/// blocks' inputs into L2 before they wait), over the product's chunks in reverse (the rows
/// the GEMM wrote last first, from L2), and cuBLAS's plain GEMM with the bias in the kernel
/// (`plain-gemm`, torch.compile's split). Each plan's output on `a2`, right after timed runs
/// on `a`, is checked against the default path's (within a bf16 ulp for the cuBLASLt plans:
/// the same GEMM and kernel arithmetic, expected bitwise; within bf16 rounding of the product
/// for `plain-gemm`); a mismatch fails the suite.
fn plans(
    ctx: &mut Ctx,
    stream: &Stream,
    (warmup, reps): (usize, usize),
    (a, a2, b): (&Buffer<bf16>, &Buffer<bf16>, &Buffer<bf16>),
    epi: &Epilogue<'_, bf16>,
    out: &mut Buffer<bf16>,
) -> Result<()> {
    let d = dim(ctx.scale());
    let flops = 2.0 * (d as f64).powi(3);
    matmul_epilogue(stream, a2, b, (d, d, d), epi, out)?;
    let want = out.to_host(stream)?;
    let sched = |reverse, programmatic, prefetch| Schedule {
        reverse,
        programmatic,
        prefetch,
    };
    let lt = |schedule| EpiloguePlan {
        plain_gemm: false,
        schedule,
    };
    let plain = |schedule| EpiloguePlan {
        plain_gemm: true,
        schedule,
    };
    for (variant, plan) in [
        ("warpdrive-in-order", lt(sched(false, false, false))),
        ("warpdrive-pdl", lt(sched(false, true, false))),
        ("warpdrive-pdl-prefetch", lt(sched(false, true, true))),
        ("warpdrive-reverse", lt(sched(true, false, false))),
        ("warpdrive-pdl-reverse", lt(sched(true, true, false))),
        (
            "warpdrive-pdl-reverse-prefetch",
            lt(sched(true, true, true)),
        ),
        ("warpdrive-plain-gemm", plain(sched(false, false, false))),
        (
            "warpdrive-plain-gemm-pdl-reverse",
            plain(sched(true, true, false)),
        ),
    ] {
        let mut us = time_gpu(stream, warmup, reps, |s| {
            matmul_epilogue_with(s, a, b, (d, d, d), epi, out, plan)
        })?;
        matmul_epilogue_with(stream, a2, b, (d, d, d), epi, out, plan)?;
        let got = out.to_host(stream)?;
        let mut worst = 0.0f64;
        let mut wrong = 0usize;
        let mut inexact = 0usize;
        for (g, w) in got.iter().zip(&want) {
            let (g, w) = (g.to_f64(), w.to_f64());
            let diff = (g - w).abs();
            // The plain GEMM rounds the product to bf16 before the bias (cuBLASLt adds it to
            // the f32 accumulator): a few bf16 ulps of the terms after GELU and the residual.
            // The cuBLASLt plans run the same arithmetic in another kernel build: one bf16 ulp
            // at most (a product read before the GEMM wrote it is off by O(1)).
            let bound = if plan.plain_gemm {
                4.0 * 2f64.powi(-8) * (w.abs() + 1.0)
            } else {
                2f64.powi(-7) * w.abs()
            };
            if diff != 0.0 {
                inexact += 1;
            }
            if diff.is_nan() || diff > bound {
                wrong += 1;
            }
            if diff > worst || diff.is_nan() {
                worst = diff;
            }
        }
        if wrong > 0 {
            return Err(Error::InvalidArgument(format!(
                "{variant}: {wrong} of {} elements differ from the default path's (worst {worst})",
                got.len()
            )));
        }
        let row = ctx.record_flops(
            "gemm-bias-gelu-residual-bf16",
            d as u64,
            variant,
            &mut us,
            flops,
            Some(Ceiling::GemmBf16),
        )?;
        row.extra.insert("kernels".into(), 2.into());
        row.extra.insert("max_diff_vs_default".into(), worst.into());
        row.extra
            .insert("elements_not_bitwise_default".into(), inexact.into());
        row.extra.insert(
            "plan".into(),
            format!(
                "{} GEMM; epilogue kernel reverse={} programmatic={} prefetch={}",
                if plan.plain_gemm {
                    "cuBLAS plain"
                } else {
                    "cuBLASLt BIAS"
                },
                plan.schedule.reverse,
                plan.schedule.programmatic,
                plan.schedule.prefetch
            )
            .into(),
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use warpdrive::device::Device;

    #[test]
    fn tiny_run_on_the_cpu_records_both_cases() {
        let mut ctx = Ctx::new(&Device::cpu(), Scale::Tiny).unwrap();
        ctx.suite = super::super::fuse::SUITE;
        run_cases(&mut ctx, 1, 2).unwrap();
        for case in ["gemm-bias-gelu-bf16", "gemm-bias-gelu-residual-bf16"] {
            for variant in ["warpdrive-fused", "warpdrive-unfused"] {
                let row = ctx
                    .rows()
                    .iter()
                    .find(|r| r.case == case && r.variant == variant)
                    .unwrap_or_else(|| panic!("{case} {variant} missing"));
                assert_eq!(row.size, 32);
                assert!(row.tflops.is_some_and(|t| t > 0.0));
            }
        }
        for (case, variant) in [
            ("gemm-bias-gelu-bf16", "warpdrive-cublaslt"),
            ("gemm-bias-gelu-residual-bf16", "warpdrive-cublaslt"),
            ("gemm-bias-gelu-residual-bf16", "warpdrive-in-order"),
            ("gemm-bias-gelu-residual-bf16", "warpdrive-pdl"),
            (
                "gemm-bias-gelu-residual-bf16",
                "warpdrive-pdl-reverse-prefetch",
            ),
            ("gemm-bias-gelu-residual-bf16", "warpdrive-plain-gemm"),
            (
                "gemm-bias-gelu-residual-bf16",
                "warpdrive-plain-gemm-pdl-reverse",
            ),
            ("gemm-bf16", "warpdrive-cublas"),
            ("gemm-bf16", "warpdrive-cublaslt"),
        ] {
            assert!(
                ctx.rows()
                    .iter()
                    .any(|r| r.case == case && r.variant == variant),
                "{case} {variant} missing"
            );
        }
    }
}
