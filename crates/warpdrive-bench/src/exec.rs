//! The exec floor's cases, run as part of the `kernels` suite (after its streaming and
//! router cases; rows carry the running suite's name):
//!
//! - `gemm-bf16-N` (size = n: 8192 at full scale, so `gemm-bf16-8192`): an n³ bf16 GEMM through `ops::gemm::matmul`
//!   (`warpdrive`); TFLOP/s and `pct_of_ceiling` against `gemm_bf16_tflops`. Peer:
//!   `torch-matmul`.
//! - `40xN-gemm` (size = n: 256 at full scale; `extra.batch` = 40): 40 f32 GEMMs of n³ (full f32, no TF32):
//!   `baseline` is a Rust loop of 40 cuBLAS calls, `warpdrive` one strided-batched call.
//!   Inputs rotate among 4 sets (they fit in L2). Peer: `torch-bmm`.
//! - `tiny-launches` (size = 1000 launches; median = µs per kernel, host clock over 1000
//!   launches of a one-element fill kernel enqueued back to back and one synchronise):
//!   `baseline` (cudarc's launch builder with its default event tracking),
//!   `driver-cuLaunchKernel` (raw launches, no bind, no checks: the floor),
//!   `warpdrive-eager` (`exec::launch`, the lean path, as programmatic dependent launches:
//!   each fill waits for the previous kernel before writing, as `ops::fill` launches it),
//!   `warpdrive-eager-plain` (the same, plain launches), `warpdrive` (one replay of a graph
//!   of the 1000 programmatic launches), `warpdrive-plain-edges` (the same graph with plain
//!   launches), `warpdrive-empty-kernels` (a graph of empty kernels) and
//!   `warpdrive-after-second-stream` (the `warpdrive` graph again after the references:
//!   once a process has run cuBLAS's large GEMMs and kernels on a second stream, the
//!   driver costs more per launch). warpdrive's variants run before the references for
//!   that reason. Peer: `torch-graph`. `pct_of_ceiling` against `launch_us`.
//! - `launch-sync` (size = 1): one launch + synchronise round trip: `baseline`,
//!   `warpdrive-eager`; against `launch_sync_us`.
//!
//! On the CPU backend sizes shrink and the launch cases time `ops::fill` on one element
//! (eager, and replayed from a recorded graph).

use std::time::Instant;

use half::bf16;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

use warpdrive::device::probe::ReferenceLaunches;
use warpdrive::device::Stream;
use warpdrive::error::{Error, Result};
use warpdrive::exec::probe::LaunchProbe;
use warpdrive::exec::{Graph, LaunchConfig};
use warpdrive::memory::Buffer;
use warpdrive::ops::{self, gemm};

use super::{time_gpu, Ceiling, Ctx, Scale};

/// Sizes and repetitions at one scale.
struct Plan {
    gemm_n: usize,
    gemm_reps: usize,
    batch: usize,
    batch_n: usize,
    batch_reps: usize,
    launches: usize,
    launch_samples: usize,
    round_trips: usize,
}

impl Plan {
    fn new(scale: Scale) -> Plan {
        match scale {
            Scale::Full => Plan {
                gemm_n: 8192,
                gemm_reps: 20,
                batch: 40,
                batch_n: 256,
                batch_reps: 50,
                launches: 1000,
                launch_samples: 21,
                round_trips: 200,
            },
            Scale::Quick => Plan {
                gemm_n: 512,
                gemm_reps: 10,
                batch: 40,
                batch_n: 64,
                batch_reps: 20,
                launches: 1000,
                launch_samples: 11,
                round_trips: 200,
            },
            Scale::Tiny => Plan {
                gemm_n: 64,
                gemm_reps: 3,
                batch: 40,
                batch_n: 16,
                batch_reps: 3,
                launches: 1000,
                launch_samples: 3,
                round_trips: 20,
            },
        }
    }
}

/// Runs every case; a case that fails is reported and the others still run (the first
/// error is returned at the end).
/// The case of the launch-cost rows.
const LAUNCH_CASE: &str = "tiny-launches";

pub(super) fn run_cases(ctx: &mut Ctx) -> Result<()> {
    let plan = Plan::new(ctx.scale());
    let mut first = None;
    for (name, case) in [
        ("gemm-bf16", gemm_bf16 as fn(&mut Ctx, &Plan) -> Result<()>),
        ("batched gemm", batched),
        ("tiny-launches / launch-sync", launches),
    ] {
        let suite = ctx.suite();
        ctx.step(format!("{suite}: {name}"));
        if let Err(e) = case(ctx, &plan) {
            ctx.warn(&format!("{suite}: case {name} failed: {e}"));
            first.get_or_insert(e);
        }
    }
    first.map_or(Ok(()), Err)
}

fn random<T>(len: usize, seed: u64, cast: fn(f32) -> T) -> Vec<T> {
    let mut rng = SmallRng::seed_from_u64(seed);
    (0..len)
        .map(|_| cast(rng.random_range(-1.0f32..1.0)))
        .collect()
}

fn gemm_bf16(ctx: &mut Ctx, plan: &Plan) -> Result<()> {
    let s = ctx.stream().clone();
    let n = plan.gemm_n;
    // The case names its size, which shrinks off full scale.
    let case = format!("gemm-bf16-{n}");
    let a = Buffer::from_host(&s, &random(n * n, 0xa, bf16::from_f32))?;
    let b = Buffer::from_host(&s, &random(n * n, 0xb, bf16::from_f32))?;
    let mut c = Buffer::<bf16>::uninit(&s, n * n)?;
    let mut us = time_gpu(&s, 3, plan.gemm_reps, |s| {
        gemm::matmul(s, &a, &b, &mut c, (n, n, n))
    })?;
    let flops = 2.0 * (n as f64).powi(3);
    ctx.record_flops(
        &case,
        n as u64,
        "warpdrive",
        &mut us,
        flops,
        Some(Ceiling::GemmBf16),
    )?
    .extra
    .extend([
        ("dtype".to_string(), "bf16".into()),
        ("api".to_string(), "cublasGemmEx".into()),
    ]);
    Ok(())
}

fn batched(ctx: &mut Ctx, plan: &Plan) -> Result<()> {
    const SETS: usize = 4;
    let s = ctx.stream().clone();
    let (batch, n) = (plan.batch, plan.batch_n);
    let case = format!("{batch}x{n}-gemm");
    let one = n * n;
    let flops = 2.0 * batch as f64 * (n as f64).powi(3);
    // SETS rotating sets of contiguous batch×n×n operands; the loop uses views of the
    // same data as separate per-item buffers.
    let mut sets = Vec::with_capacity(SETS);
    let mut items = Vec::with_capacity(SETS);
    for set in 0..SETS {
        let ha = random(batch * one, 0x40a + set as u64, |v| v);
        let hb = random(batch * one, 0x40b + set as u64, |v| v);
        let per_item = (0..batch)
            .map(|i| {
                Ok((
                    Buffer::from_host(&s, &ha[i * one..(i + 1) * one])?,
                    Buffer::from_host(&s, &hb[i * one..(i + 1) * one])?,
                    Buffer::<f32>::uninit(&s, one)?,
                ))
            })
            .collect::<Result<Vec<_>>>()?;
        items.push(per_item);
        sets.push((
            Buffer::from_host(&s, &ha)?,
            Buffer::from_host(&s, &hb)?,
            Buffer::<f32>::uninit(&s, batch * one)?,
        ));
    }
    let mut rep = 0;
    let mut loop_us = time_gpu(&s, 3, plan.batch_reps, |s| {
        rep += 1;
        for (a, b, c) in items[rep % SETS].iter_mut() {
            gemm::matmul(s, a, b, c, (n, n, n))?;
        }
        Ok(())
    })?;
    let row = ctx.record_flops(&case, n as u64, "baseline", &mut loop_us, flops, None)?;
    row.extra.insert("batch".into(), batch.into());
    row.extra
        .insert("api".into(), format!("{batch} x cublasGemmEx").into());
    let baseline = row.median;
    let mut rep = 0;
    let mut batched_us = time_gpu(&s, 3, plan.batch_reps, |s| {
        rep += 1;
        let (a, b, c) = &mut sets[rep % SETS];
        gemm::matmul_batched(s, a, b, c, batch, (n, n, n), gemm::GemmOptions::default())
    })?;
    let row = ctx.record_flops(&case, n as u64, "warpdrive", &mut batched_us, flops, None)?;
    row.extra.insert("batch".into(), batch.into());
    row.extra
        .insert("api".into(), "cublasGemmStridedBatchedEx".into());
    row.extra.insert(
        "x_faster_than_baseline".into(),
        (baseline / row.median).into(),
    );
    Ok(())
}

/// Launch timing: per sample, µs per launch for `count` launches and one `sync` (the
/// median's figure), and µs per launch up to the last launch's return (the host's enqueue
/// cost alone); after one warm-up sample.
/// Captures `count` calls of `launch` in one graph and times its replays: (µs per captured
/// launch, µs to enqueue one replay) per sample.
fn graph_replays(
    s: &Stream,
    count: usize,
    samples: usize,
    launch: impl Fn(&Stream) -> Result<()>,
) -> Result<(Vec<f64>, Vec<f64>)> {
    let mut graph = Graph::capture(s, |s| {
        for _ in 0..count {
            launch(s)?;
        }
        Ok(())
    })?;
    graph.prepare()?;
    let (mut replay, enqueue) = launch_samples(samples, 1, || graph.launch(), || s.synchronize())?;
    for v in replay.iter_mut() {
        *v /= count.max(1) as f64;
    }
    Ok((replay, enqueue))
}

fn launch_samples(
    samples: usize,
    count: usize,
    mut launch: impl FnMut() -> Result<()>,
    mut sync: impl FnMut() -> Result<()>,
) -> Result<(Vec<f64>, Vec<f64>)> {
    let per = |t: Instant| t.elapsed().as_secs_f64() * 1e6 / count.max(1) as f64;
    let (mut total, mut enqueue) = (Vec::new(), Vec::new());
    for i in 0..=samples.max(1) {
        let t = Instant::now();
        for _ in 0..count {
            launch()?;
        }
        let e = per(t);
        sync()?;
        if i > 0 {
            total.push(per(t));
            enqueue.push(e);
        }
    }
    Ok((total, enqueue))
}

fn median(v: &[f64]) -> f64 {
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    s.get(s.len() / 2).copied().unwrap_or(f64::NAN)
}

/// µs per item: `samples` samples of `per_sample` items each, `work` running one sample.
fn host_samples(
    samples: usize,
    per_sample: usize,
    mut work: impl FnMut() -> Result<()>,
) -> Result<Vec<f64>> {
    work()?;
    (0..samples.max(1))
        .map(|_| {
            let t = Instant::now();
            work()?;
            Ok(t.elapsed().as_secs_f64() * 1e6 / per_sample.max(1) as f64)
        })
        .collect()
}

fn launches(ctx: &mut Ctx, plan: &Plan) -> Result<()> {
    const CASE: &str = LAUNCH_CASE;
    const SYNC_CASE: &str = "launch-sync";
    let s = ctx.stream().clone();
    let count = plan.launches;
    let timer = "host clock, one synchronise per sample";

    if !s.device().is_cuda() {
        // The CPU backend: the same shape of work through ops.
        let mut buf = Buffer::<u32>::zeros(&s, 1)?;
        let mut eager = host_samples(plan.launch_samples, count, || {
            for i in 0..count {
                ops::fill(&s, &mut buf, i as u32)?;
            }
            s.synchronize()
        })?;
        ctx.record_time(CASE, count as u64, "warpdrive-eager", &mut eager, None)?;
        let mut graph = Graph::capture(&s, |s| {
            for i in 0..count {
                ops::fill(s, &mut buf, i as u32)?;
            }
            Ok(())
        })?;
        let mut replay = host_samples(plan.launch_samples, count, || {
            graph.launch()?;
            s.synchronize()
        })?;
        drop(graph);
        ctx.record_time(CASE, count as u64, "warpdrive", &mut replay, None)?;
        let mut sync = host_samples(plan.launch_samples, plan.round_trips, || {
            for _ in 0..plan.round_trips {
                ops::fill(&s, &mut buf, 1)?;
                s.synchronize()?;
            }
            Ok(())
        })?;
        ctx.record_time(SYNC_CASE, 1, "warpdrive-eager", &mut sync, None)?;
        return Ok(());
    }

    // warpdrive's variants run first: the reference launches below put kernels on a second
    // stream, and once a process has run cuBLAS's large GEMMs (the ceilings suite did) and
    // kernels on two streams, the driver costs more per launch for the rest of the process
    // (reproduced with raw driver calls and no warpdrive; bench/NOTES.md, kernel
    // launches). The programmatic graph is timed again after them to show it.
    let probe = LaunchProbe::new(&s)?;
    let plain = LaunchConfig::linear(1, 32);
    let chained = LaunchConfig {
        programmatic: true,
        ..plain
    };
    // The fill waits for the previous kernel before it writes (programmatic launches).
    let launch_with = |s: &Stream, config: LaunchConfig| probe.fill(s, 7, config);
    for (variant, config, api) in [
        (
            "warpdrive-eager",
            chained,
            "exec::launch, programmatic (as ops::fill launches)",
        ),
        (
            "warpdrive-eager-plain",
            plain,
            "exec::launch, plain launches",
        ),
    ] {
        let (mut eager, eager_enqueue) = launch_samples(
            plan.launch_samples,
            count,
            || launch_with(&s, config),
            || s.synchronize(),
        )?;
        launch_row(ctx, count, variant, &mut eager, api, timer)?
            .extra
            .insert("enqueue_us".into(), median(&eager_enqueue).into());
    }

    let (mut replay, replay_enqueue) =
        graph_replays(&s, count, plan.launch_samples, |s| launch_with(s, chained))?;
    let api = "one graph of the launches (programmatic edges), replayed";
    launch_row(ctx, count, "warpdrive", &mut replay, api, timer)?
        .extra
        .insert("graph_launch_us".into(), median(&replay_enqueue).into());
    let (mut replay, _) = graph_replays(&s, count, plan.launch_samples, |s| launch_with(s, plain))?;
    let api = "one graph of the launches (plain edges), replayed";
    launch_row(ctx, count, "warpdrive-plain-edges", &mut replay, api, timer)?;

    // The same graph of empty kernels: separates the graph's per-node cost from the work of
    // the fill kernel itself.
    let (mut replay, _) =
        graph_replays(&s, count, plan.launch_samples, |s| probe.empty(s, chained))?;
    let api = "one graph of empty kernels (programmatic edges), replayed: the graph's own cost";
    launch_row(
        ctx,
        count,
        "warpdrive-empty-kernels",
        &mut replay,
        api,
        timer,
    )?;
    let mut sync = host_samples(plan.launch_samples, plan.round_trips, || {
        for _ in 0..plan.round_trips {
            launch_with(&s, plain)?;
            s.synchronize()?;
        }
        Ok(())
    })?;
    let variant = ctx.record_time(
        SYNC_CASE,
        1,
        "warpdrive-eager",
        &mut sync,
        Some(Ceiling::LaunchSync),
    )?;
    note(variant, "exec::launch + Stream::synchronize", "host clock");

    // Reference figures: cudarc's builder and raw cuLaunchKernel.
    let (mut builder, mut builder_enqueue) = (Vec::new(), Vec::new());
    let mut builder_sync = Vec::new();
    let (mut raw, mut raw_enqueue) = (Vec::new(), Vec::new());
    for _ in 0..plan.launch_samples {
        let r = time_reference_launches(&s, count, plan.round_trips / 4)?;
        builder.push(r.builder);
        builder_enqueue.push(r.builder_enqueue);
        builder_sync.push(r.builder_round_trip);
        raw.push(r.raw);
        raw_enqueue.push(r.raw_enqueue);
    }
    for (variant, samples, enqueue, api) in [
        (
            "baseline",
            &mut builder,
            &builder_enqueue,
            "cudarc launch_builder, event tracking on",
        ),
        (
            "driver-cuLaunchKernel",
            &mut raw,
            &raw_enqueue,
            "cuLaunchKernel, no bind, no checks",
        ),
    ] {
        launch_row(ctx, count, variant, samples, api, timer)?
            .extra
            .insert("enqueue_us".into(), median(enqueue).into());
    }
    let (mut replay, _) =
        graph_replays(&s, count, plan.launch_samples, |s| launch_with(s, chained))?;
    let api = "the `warpdrive` graph again, after the references ran kernels on a second stream";
    launch_row(
        ctx,
        count,
        "warpdrive-after-second-stream",
        &mut replay,
        api,
        timer,
    )?;

    let variant = ctx.record_time(
        SYNC_CASE,
        1,
        "baseline",
        &mut builder_sync,
        Some(Ceiling::LaunchSync),
    )?;
    note(variant, "cudarc launch_builder + synchronize", "host clock");
    s.synchronize()?;
    if probe.value(&s)? != 7 {
        return Err(Error::InvalidArgument(
            "tiny-launches: the fill kernel did not write its element".into(),
        ));
    }
    Ok(())
}

/// What [`time_reference_launches`] measured (host-clock µs).
#[derive(Debug, Clone, Copy)]
struct ReferenceFigures {
    /// Per launch through cudarc's builder, enqueued back to back (the final synchronise
    /// included).
    builder: f64,
    /// The same, up to the last launch's return (no synchronise).
    builder_enqueue: f64,
    /// Per builder launch + stream synchronise.
    builder_round_trip: f64,
    /// Per raw `cuLaunchKernel`, enqueued back to back (the final synchronise included).
    raw: f64,
    /// The same, up to the last launch's return.
    raw_enqueue: f64,
}

/// Reference launch costs of `basic.cu`'s `fill_u32` on one element ([`ReferenceLaunches`]:
/// cudarc's launch builder as a cudarc user gets it, and raw `cuLaunchKernel` calls with no
/// bind and no checks on `stream`). Each figure is host-clock µs: per launch over `count`
/// launches enqueued back to back with one synchronise at the end, or per launch +
/// synchronise over `round_trips`.
fn time_reference_launches(
    stream: &Stream,
    count: usize,
    round_trips: usize,
) -> Result<ReferenceFigures> {
    let (count, round_trips) = (count.max(1), round_trips.max(1));
    let per = |t: Instant, n: usize| t.elapsed().as_secs_f64() * 1e6 / n as f64;
    let mut r = ReferenceLaunches::new(stream)?;

    // cudarc's builder on its own context handle (tracking on) and stream.
    r.builder_launch()?;
    r.builder_synchronize()?;
    let t = Instant::now();
    for _ in 0..count {
        r.builder_launch()?;
    }
    let builder_enqueue = per(t, count);
    r.builder_synchronize()?;
    let builder = per(t, count);
    let t = Instant::now();
    for _ in 0..round_trips {
        r.builder_launch()?;
        r.builder_synchronize()?;
    }
    let builder_round_trip = per(t, round_trips);

    // Raw cuLaunchKernel on warpdrive's context and `stream`.
    r.bind()?;
    r.raw_launch()?;
    stream.synchronize()?;
    let t = Instant::now();
    for _ in 0..count {
        r.raw_launch()?;
    }
    let raw_enqueue = per(t, count);
    stream.synchronize()?;
    let raw = per(t, count);
    Ok(ReferenceFigures {
        builder,
        builder_enqueue,
        builder_round_trip,
        raw,
        raw_enqueue,
    })
}

/// Records a [`LAUNCH_CASE`] row of `count` launches against the launch ceiling, with its
/// notes.
fn launch_row<'a>(
    ctx: &'a mut Ctx,
    count: usize,
    variant: &str,
    samples_us: &mut [f64],
    api: &str,
    timer: &str,
) -> Result<&'a mut super::Row> {
    let row = ctx.record_time(
        LAUNCH_CASE,
        count as u64,
        variant,
        samples_us,
        Some(Ceiling::Launch),
    )?;
    note(row, api, timer);
    Ok(row)
}

/// Names the API and the timer of a launch row.
fn note(row: &mut super::Row, api: &str, timer: &str) {
    row.extra.insert("api".into(), api.into());
    row.extra.insert("timer".into(), timer.into());
}

#[cfg(test)]
mod tests {
    use super::*;
    use warpdrive::device::Device;

    #[test]
    fn tiny_exec_cases_on_the_cpu_record_their_rows() {
        let mut ctx = Ctx::new(&Device::cpu(), Scale::Tiny).unwrap();
        ctx.suite = "kernels";
        run_cases(&mut ctx).unwrap();
        let find = |case: &str, variant: &str| {
            ctx.rows()
                .iter()
                .filter(|r| r.case == case && r.variant == variant)
                .count()
        };
        // The cases name the size they ran (Tiny: 64³ and 40 × 16³), as their rows' size.
        assert_eq!(find("gemm-bf16-64", "warpdrive"), 1);
        assert_eq!(find("40x16-gemm", "baseline"), 1);
        assert_eq!(find("40x16-gemm", "warpdrive"), 1);
        assert_eq!(find("tiny-launches", "warpdrive-eager"), 1);
        assert_eq!(find("tiny-launches", "warpdrive"), 1);
        assert_eq!(find("launch-sync", "warpdrive-eager"), 1);
        for r in ctx.rows() {
            assert_eq!(r.suite, "kernels");
            assert!(r.p10 <= r.median && r.median <= r.p90, "{r:?}");
        }
        let gemm = ctx.rows().iter().find(|r| r.case == "40x16-gemm").unwrap();
        assert!(gemm.tflops.unwrap() > 0.0);
    }
}
