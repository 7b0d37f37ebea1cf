//! The `kernels` suite: streaming kernels against the device's copy ceiling, and the fused MoE
//! router against PyTorch (`bench/peers/kernels.py`).
//!
//! - `scale-<size>`: `y = 1.5 x + 0.25` over `size` bytes of f32 (the fused map); GB/s counts
//!   bytes read + written. Variants `warpdrive-scalar` (4-byte accesses), `warpdrive` (16-byte
//!   vectors), `ceiling` (`ops::copy` of the same buffers, the doctor's device copy).
//! - `sum-<size>`: the deterministic sum of the same f32 buffer; GB/s counts bytes read. Same
//!   variants (the `ceiling` row is the same copy, read + written).
//! - `router-E<E>-k<k>`: softmax → top-k → renormalize of bf16 logits, `size` = tokens;
//!   variant `warpdrive` (the fused kernel). Inputs and outputs rotate among enough sets to
//!   exceed twice the L2, and each sample times a batch of routes, divided per route.
//!
//! The streaming rows carry `extra.bandwidth_utilization` (GB/s / `d2d_copy_gbps`).
//!
//! Sizes: 1 GiB and tokens 1, 64, 1024, 16384 on CUDA; 16 MiB and tokens up to 1024 on the
//! CPU backend (`--quick` for the peer).

use half::bf16;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

use warpdrive::error::Result;
use warpdrive::memory::Buffer;
use warpdrive::ops::{self, Loads, Map, Reduce, ReduceOp, Route, Scratch, REDUCE_SCRATCH_BYTES};

use super::ceilings::random_f32;
use super::results::Ceiling;
use super::timing::time_gpu;
use super::{Ctx, Scale};

/// The suite name.
pub const SUITE: &str = "kernels";

/// The router shapes (experts, k) the issue names.
pub const ROUTES: [(usize, usize); 4] = [(8, 2), (64, 8), (128, 8), (256, 8)];
/// Rotation sets at most per router case.
const MAX_SETS: usize = 128;

struct Plan {
    stream_bytes: usize,
    tokens: &'static [usize],
    routes: &'static [(usize, usize)],
    warmup: usize,
    reps: usize,
    /// Routes per timed sample.
    batch: usize,
}

impl Plan {
    fn new(scale: Scale) -> Plan {
        match scale {
            Scale::Full => Plan {
                stream_bytes: 1 << 30,
                tokens: &[1, 64, 1024, 16384],
                routes: &ROUTES,
                warmup: 5,
                reps: 30,
                batch: 20,
            },
            Scale::Quick => Plan {
                stream_bytes: 16 << 20,
                tokens: &[1, 64, 1024],
                routes: &ROUTES,
                warmup: 1,
                reps: 5,
                batch: 2,
            },
            Scale::Tiny => Plan {
                stream_bytes: 1 << 20,
                tokens: &[1, 64],
                routes: &ROUTES[..2],
                warmup: 1,
                reps: 2,
                batch: 1,
            },
        }
    }
}

/// `1GiB`, `16MiB`, `1000B`: the size in a case name.
pub fn size_label(bytes: usize) -> String {
    if bytes >= 1 << 30 && bytes % (1 << 30) == 0 {
        format!("{}GiB", bytes >> 30)
    } else if bytes >= 1 << 20 && bytes % (1 << 20) == 0 {
        format!("{}MiB", bytes >> 20)
    } else {
        format!("{bytes}B")
    }
}

pub(crate) fn run_suite(ctx: &mut Ctx) -> Result<()> {
    let plan = Plan::new(ctx.scale());
    streaming(ctx, &plan)?;
    router(ctx, &plan)
}

/// `scale-*` and `sum-*`.
fn streaming(ctx: &mut Ctx, plan: &Plan) -> Result<()> {
    let bytes = plan.stream_bytes;
    let (scale_case, sum_case) = (
        format!("scale-{}", size_label(bytes)),
        format!("sum-{}", size_label(bytes)),
    );
    ctx.step(format!("{SUITE}: {scale_case} and {sum_case}"));
    let n = bytes / 4;
    let stream = ctx.stream();
    let x = Buffer::from_host(stream, &random_f32(n, 0x5ca1e))?;
    let mut y = Buffer::<f32>::uninit(stream, n)?;
    let mut total = Buffer::<f32>::uninit(stream, 1)?;
    let scratch = Scratch::new(stream, REDUCE_SCRATCH_BYTES)?;
    let (warm, reps) = (plan.warmup, plan.reps);
    let copy_us = time_gpu(stream, warm, reps, |s| ops::copy(s, &x, &mut y))?;
    let size = bytes as u64;
    let moved = 2.0 * bytes as f64;
    for (variant, loads) in [
        ("warpdrive-scalar", Loads::Scalar),
        ("warpdrive", Loads::Vector),
    ] {
        let m = Map::affine(1.5, 0.25).with_loads(loads);
        let mut us = time_gpu(ctx.stream(), warm, reps, |s| ops::map(s, &m, &x, &mut y))?;
        let row = ctx.record_bytes(
            &scale_case,
            size,
            variant,
            &mut us,
            moved,
            Some(Ceiling::D2dCopy),
        )?;
        row.extra.insert("dtype".into(), "f32".into());
        row.extra.insert("op".into(), "y = 1.5 x + 0.25".into());
        row.extra
            .insert("bytes_counted".into(), "read+write".into());
        let r = Reduce {
            op: ReduceOp::Sum,
            loads,
        };
        let mut us = time_gpu(ctx.stream(), warm, reps, |s| {
            ops::reduce_into(s, r, &x, &mut total, &scratch)
        })?;
        let row = ctx.record_bytes(
            &sum_case,
            size,
            variant,
            &mut us,
            bytes as f64,
            Some(Ceiling::D2dCopy),
        )?;
        row.extra.insert("dtype".into(), "f32".into());
        row.extra.insert("bytes_counted".into(), "read".into());
    }
    for case in [&scale_case, &sum_case] {
        let mut us = copy_us.clone();
        let row = ctx.record_bytes(
            case,
            size,
            "ceiling",
            &mut us,
            moved,
            Some(Ceiling::D2dCopy),
        )?;
        row.extra
            .insert("op".into(), "ops::copy (device to device)".into());
        row.extra
            .insert("bytes_counted".into(), "read+write".into());
    }
    Ok(())
}

/// How many input/output sets to rotate through so that together they exceed twice the L2
/// (1 where there is no L2 to defeat: the CPU backend).
fn rotation_sets(ctx: &Ctx, bytes_per_set: usize) -> usize {
    match ctx.info().l2_bytes {
        Some(l2) if ctx.device().is_cuda() => (2 * l2 as usize)
            .div_ceil(bytes_per_set.max(1))
            .clamp(1, MAX_SETS),
        _ => 1,
    }
}

/// Logits like a router's: a sum of uniforms (roughly normal, σ ≈ 1.7), rounded to bf16.
fn logits(len: usize, seed: u64) -> Vec<bf16> {
    let mut rng = SmallRng::seed_from_u64(seed);
    (0..len)
        .map(|_| bf16::from_f32((0..4).map(|_| rng.random_range(-1.5f32..1.5)).sum()))
        .collect()
}

/// `router-E*-k*`.
fn router(ctx: &mut Ctx, plan: &Plan) -> Result<()> {
    for &(experts, k) in plan.routes {
        let case = format!("router-E{experts}-k{k}");
        for &tokens in plan.tokens {
            ctx.step(format!("{SUITE}: {case} at {tokens} tokens"));
            let set_bytes = tokens * experts * 2 + tokens * k * 8;
            let sets = rotation_sets(ctx, set_bytes);
            let stream = ctx.stream();
            let mut inputs = Vec::with_capacity(sets);
            let mut weights = Vec::with_capacity(sets);
            let mut indices = Vec::with_capacity(sets);
            for i in 0..sets {
                let seed = (experts * 1_000_003 + tokens * 7919 + i) as u64;
                inputs.push(Buffer::from_host(stream, &logits(tokens * experts, seed))?);
                weights.push(Buffer::<f32>::uninit(stream, tokens * k)?);
                indices.push(Buffer::<u32>::uninit(stream, tokens * k)?);
            }
            let route = Route {
                experts,
                k,
                renormalize: true,
            };
            let mut next = 0usize;
            let batch = plan.batch;
            let mut us = time_gpu(stream, plan.warmup, plan.reps, |s| {
                for _ in 0..batch {
                    let j = next % sets;
                    next += 1;
                    ops::route(s, &route, &inputs[j], &mut weights[j], &mut indices[j])?;
                }
                Ok(())
            })?;
            us.iter_mut().for_each(|t| *t /= batch as f64);
            let row = ctx.record_time(&case, tokens as u64, "warpdrive", &mut us, None)?;
            for (key, value) in [
                ("experts", experts.into()),
                ("k", k.into()),
                ("tokens", tokens.into()),
                ("dtype", "bf16".into()),
                ("renormalize", true.into()),
                ("rotation_sets", sets.into()),
                ("routes_per_sample", batch.into()),
            ] {
                row.extra.insert(key.into(), value);
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use warpdrive::device::Device;

    #[test]
    fn size_labels() {
        assert_eq!(size_label(1 << 30), "1GiB");
        assert_eq!(size_label(16 << 20), "16MiB");
        assert_eq!(size_label(1000), "1000B");
    }

    #[test]
    fn tiny_run_on_the_cpu_has_every_case_and_variant() {
        let mut ctx = Ctx::new(&Device::cpu(), Scale::Tiny).unwrap();
        ctx.suite = SUITE;
        run_suite(&mut ctx).unwrap();
        let rows = ctx.rows();
        for case in ["scale-1MiB", "sum-1MiB"] {
            for variant in ["warpdrive-scalar", "warpdrive", "ceiling"] {
                let row = rows
                    .iter()
                    .find(|r| r.case == case && r.variant == variant)
                    .unwrap_or_else(|| panic!("{case} {variant} missing"));
                assert_eq!(row.size, 1 << 20);
                assert!(row.gbps.is_some_and(|g| g > 0.0), "{case} {variant}");
                assert_eq!(row.suite, SUITE);
            }
        }
        let routes: Vec<_> = rows
            .iter()
            .filter(|r| r.case.starts_with("router-"))
            .collect();
        assert_eq!(routes.len(), 4);
        assert!(routes
            .iter()
            .all(|r| r.variant == "warpdrive" && r.median >= 0.0));
        assert!(routes
            .iter()
            .any(|r| r.case == "router-E64-k8" && r.size == 64));
    }
}
