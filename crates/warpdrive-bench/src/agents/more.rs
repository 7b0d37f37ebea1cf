//! The `agents` rows beyond Circles and the majority vote: the weighted quorum, iterative
//! averaging and birth and death.
//!
//! - `quorum-N`: a weighted vote over N agents (u32 votes, f32 weights), µs from the host
//!   enqueuing it to the host holding the decision, as `vote-N`; `extra.p99_us`. Variant
//!   `warpdrive-resident`: the same vote served by a resident kernel (`ResidentQuorum`).
//! - `averaging-N`: iterative averaging at rate 0.5 to a tolerance of 1e-3 from values in
//!   ±50 (about 16 rounds): µs per round from the host enqueuing the run to the host holding
//!   the outcome, divided by the rounds (the values are uploaded again before each sample,
//!   outside the time); `extra.rounds`.
//! - `life-N`: one `apply_life` over N agents with three fields (10 % die, 10 % have one
//!   child) built and uploaded before each sample, outside the time: µs from the call to
//!   its return (it reads the new size back, so the host waits for the work);
//!   `extra.agents_per_s`.
//! - `submit-N`: `agents::submit` of N agents with two f32 fields (load the step, upload,
//!   first step), µs of the whole call: `warpdrive-cold` a step no cache has seen (NVRTC),
//!   `warpdrive-warm` a step whose cubin is cached on disk, its load timed as a new process
//!   pays it (`StepFn::load_fresh`); `extra` has each stage's median and, for warm, the
//!   target (10 ms).
//! - `steps-N`: 100 steps of a drift step over N agents, µs per sample:
//!   `warpdrive-persistent` (`StepFn::run_steps`: one cooperative kernel, a grid-wide barrier
//!   between steps) against `warpdrive-graph` (the one-step graph replayed 100 times);
//!   `extra.agent_steps_per_s`.

use warpdrive::agents::{
    submit, Averaging, FieldKind, HostField, Population, Quorum, ResidentQuorum, StepFn,
    StepInputs, SubmitTimes,
};
use warpdrive::error::Result;
use warpdrive::exec::Graph;
use warpdrive::kernels::PtxCache;
use warpdrive::memory::Buffer;

use super::{label, reps, SUITE};
use crate::stats::percentile;
use crate::timing::{time_gpu, time_host};
use crate::Ctx;
use warpdrive::transfer::upload;

/// µs of `run` on `state` after `setup` (untimed) each time: `warm` runs dropped, then
/// `reps` kept.
fn timed_after_setup<S>(
    warm: usize,
    reps: usize,
    state: &mut S,
    mut setup: impl FnMut(&mut S) -> Result<()>,
    mut run: impl FnMut(&mut S) -> Result<()>,
) -> Result<Vec<f64>> {
    let mut us = Vec::with_capacity(reps);
    for i in 0..warm + reps {
        setup(state)?;
        let t = std::time::Instant::now();
        run(state)?;
        if i >= warm {
            us.push(t.elapsed().as_secs_f64() * 1e6);
        }
    }
    Ok(us)
}

/// A seeded sequence of values in 0..100.
pub(super) fn percents(n: usize, seed: u64) -> Vec<u32> {
    let mut state = seed;
    (0..n)
        .map(|_| {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((state >> 33) % 100) as u32
        })
        .collect()
}

pub(super) fn quorum(ctx: &mut Ctx, n: usize) -> Result<()> {
    let (warm, reps) = reps(ctx.scale());
    let case = format!("quorum-{}", label(n));
    let stream = ctx.stream().clone();
    ctx.step(format!("{SUITE}: {case}"));
    let p = percents(n, 0x9_0a1);
    let votes: Vec<u32> = p.iter().map(|&v| u32::from(v < 55)).collect();
    let weights: Vec<f32> = p.iter().map(|&v| 0.5 + v as f32 / 100.0).collect();
    let (votes, weights) = (
        Buffer::from_host(&stream, &votes)?,
        Buffer::from_host(&stream, &weights)?,
    );
    let mut q = Quorum::new(&stream)?;
    let mut passed = false;
    let mut us = time_host(warm, reps * 10, || {
        q.run(&stream, &votes, &weights, 2.0 / 3.0)?;
        passed = q.decision(&stream)?.passed;
        Ok(())
    })?;
    let p99 = percentile(&us, 0.99);
    let row = ctx.record_time(&case, n as u64, "warpdrive", &mut us, None)?;
    row.extra.insert("p99_us".into(), p99.into());
    row.extra.insert("passed".into(), passed.into());
    drop(q);
    // The same vote served by the resident kernel (no launch a vote).
    let mut resident = ResidentQuorum::start(&stream, votes, weights, 2.0 / 3.0)?;
    let mut us = time_host(warm * 10, reps * 10, || {
        passed = resident.vote()?.passed;
        Ok(())
    })?;
    resident.stop()?;
    let p99 = percentile(&us, 0.99);
    let row = ctx.record_time(&case, n as u64, "warpdrive-resident", &mut us, None)?;
    row.extra.insert("p99_us".into(), p99.into());
    row.extra.insert("passed".into(), passed.into());
    Ok(())
}

pub(super) fn averaging(ctx: &mut Ctx, n: usize) -> Result<()> {
    let (warm, reps) = reps(ctx.scale());
    let case = format!("averaging-{}", label(n));
    let stream = ctx.stream().clone();
    ctx.step(format!("{SUITE}: {case}"));
    let start: Vec<f32> = percents(n, 0xa7e)
        .iter()
        .map(|&v| v as f32 - 50.0)
        .collect();
    let mut x = Buffer::from_host(&stream, &start)?;
    let mut avg = Averaging::new(&stream)?;
    let mut rounds = 0u64;
    let mut us = timed_after_setup(
        warm,
        reps,
        &mut x,
        |x| upload(&stream, x, &start),
        |x| {
            avg.run(&stream, x, 0.5, 1e-3, 64)?;
            rounds = avg.outcome(&stream)?.rounds;
            Ok(())
        },
    )?;
    let per_round = rounds.max(1) as f64;
    for v in us.iter_mut() {
        *v /= per_round;
    }
    let row = ctx.record_time(&case, n as u64, "warpdrive", &mut us, None)?;
    row.extra.insert("rounds".into(), rounds.into());
    row.extra
        .insert("unit_of_samples".into(), "us per round".into());
    Ok(())
}

pub(super) fn life(ctx: &mut Ctx, n: usize) -> Result<()> {
    let (warm, reps) = reps(ctx.scale());
    let case = format!("life-{}", label(n));
    let stream = ctx.stream().clone();
    ctx.step(format!("{SUITE}: {case}"));
    let p = percents(n, 0x11fe);
    let alive: Vec<u32> = p.iter().map(|&v| u32::from(v >= 10)).collect();
    let births: Vec<u32> = p.iter().map(|&v| u32::from(v >= 90)).collect();
    let xs: Vec<f32> = p.iter().map(|&v| v as f32).collect();
    let mut pop = Population::new(0);
    let mut us = timed_after_setup(
        warm,
        reps,
        &mut pop,
        |pop| {
            *pop = Population::new(n);
            pop.add_f32(&stream, "x", &xs)?;
            pop.add_u32(&stream, "alive", &alive)?;
            pop.add_u32(&stream, "births", &births)?;
            stream.synchronize()
        },
        |pop| pop.apply_life(&stream, "alive", "births", 1).map(|_| ()),
    )?;
    let row = ctx.record_time(&case, n as u64, "warpdrive", &mut us, None)?;
    let rate = n as f64 / (row.median * 1e-6);
    row.extra.insert("agents_per_s".into(), rate.into());
    Ok(())
}

/// The step the submission rows load: a drift with a clamp (a comment makes a body new).
fn submit_step(tag: &str) -> StepFn {
    let body = format!("x[i] += v[i] * p[0]; if (x[i] > p[1]) x[i] = p[1]; // {tag}");
    StepFn::new("submit", &body, |i, f, p| {
        f.f32[0][i] += f.f32[1][i] * p[0];
        if f.f32[0][i] > p[1] {
            f.f32[0][i] = p[1];
        }
    })
}

pub(super) fn submission(ctx: &mut Ctx, n: usize) -> Result<()> {
    let (_, reps) = reps(ctx.scale());
    let reps = reps.clamp(3, 10);
    let case = format!("submit-{}", label(n));
    let stream = ctx.stream().clone();
    ctx.step(format!("{SUITE}: {case}"));
    let x: Vec<f32> = percents(n, 0x5b).iter().map(|&v| v as f32).collect();
    let v: Vec<f32> = percents(n, 0x5c)
        .iter()
        .map(|&v| v as f32 / 100.0)
        .collect();
    let fields = [("x", HostField::F32(&x)), ("v", HostField::F32(&v))];
    let kinds = [("x", FieldKind::F32), ("v", FieldKind::F32)];
    let params = [0.5, 90.0];
    let run = std::process::id();
    // Cold: a step no cache has seen (NVRTC, then the load).
    let mut cold = Vec::with_capacity(reps);
    let mut stages = Vec::with_capacity(reps);
    for k in 0..reps {
        let step = submit_step(&format!("cold {run}-{n}-{k}"));
        let job = submit(&stream, n, &fields, &step, &params)?;
        cold.push(job.times.total.as_secs_f64() * 1e6);
        stages.push(job.times);
    }
    let row = ctx.record_time(&case, n as u64, "warpdrive-cold", &mut cold, None)?;
    insert_stages(row, &stages);
    // Warm: the step's cubin is on disk; a new process pays its load (`load_fresh`, a module
    // of its own) where this one finds it in the device's table.
    let step = submit_step("warm");
    submit(&stream, n, &fields, &step, &params)?;
    let mut warm = Vec::with_capacity(reps);
    let mut stages = Vec::with_capacity(reps);
    for _ in 0..reps {
        let t = std::time::Instant::now();
        step.load_fresh(&stream, &kinds, PtxCache::global())?;
        let load = t.elapsed();
        let mut job = submit(&stream, n, &fields, &step, &params)?;
        job.times.load += load;
        job.times.total += load;
        warm.push(job.times.total.as_secs_f64() * 1e6);
        stages.push(job.times);
    }
    let row = ctx.record_time(&case, n as u64, "warpdrive-warm", &mut warm, None)?;
    insert_stages(row, &stages);
    row.extra
        .insert("target_us".into(), TARGET_SUBMIT_WARM_US.into());
    Ok(())
}

/// Issue 38's target for job submission with a warm cache: 10 ms.
const TARGET_SUBMIT_WARM_US: f64 = 10_000.0;

/// The stages' medians (µs) into the row.
fn insert_stages(row: &mut crate::Row, stages: &[SubmitTimes]) {
    let median = |f: fn(&SubmitTimes) -> std::time::Duration| {
        let mut us: Vec<f64> = stages.iter().map(|t| f(t).as_secs_f64() * 1e6).collect();
        us.sort_by(f64::total_cmp);
        us.get(us.len() / 2).copied().unwrap_or(0.0)
    };
    row.extra
        .insert("load_us".into(), median(|t| t.load).into());
    row.extra
        .insert("upload_us".into(), median(|t| t.upload).into());
    row.extra
        .insert("first_step_us".into(), median(|t| t.first_step).into());
}

/// Steps per sample of the `steps-N` rows.
const LOOP_STEPS: u64 = 100;

pub(super) fn stepping(ctx: &mut Ctx, n: usize) -> Result<()> {
    let (warm, reps) = reps(ctx.scale());
    let case = format!("steps-{}", label(n));
    let stream = ctx.stream().clone();
    ctx.step(format!("{SUITE}: {case}"));
    let x: Vec<f32> = percents(n, 0x51).iter().map(|&v| v as f32).collect();
    let v: Vec<f32> = percents(n, 0x52).iter().map(|&v| v as f32 / 1e4).collect();
    let mut pop = Population::new(n);
    pop.add_f32(&stream, "x", &x)?;
    pop.add_f32(&stream, "v", &v)?;
    let step = submit_step("steps");
    let none = StepInputs::new();
    let params = [0.5, 1e9];
    let mut persistent = time_gpu(&stream, warm, reps, |s| {
        step.run_steps(s, &mut pop, &none, &params, LOOP_STEPS)
    })?;
    let mut graph = Graph::capture(&stream, |s| step.run(s, &mut pop, &params))?;
    graph.prepare()?;
    let mut graphed = time_gpu(&stream, warm, reps, |_| {
        (0..LOOP_STEPS).try_for_each(|_| graph.launch())
    })?;
    drop(graph);
    for (variant, us) in [
        ("warpdrive-persistent", &mut persistent),
        ("warpdrive-graph", &mut graphed),
    ] {
        let row = ctx.record_time(&case, n as u64, variant, us, None)?;
        let rate = n as f64 * LOOP_STEPS as f64 / (row.median * 1e-6);
        row.extra.insert("agent_steps_per_s".into(), rate.into());
        row.extra.insert("steps".into(), LOOP_STEPS.into());
    }
    Ok(())
}
