//! The `actors` suite (issue 32): persistent actors against the ways a user would answer a
//! message without them, and against a doorbell, the ceiling of a round trip.
//!
//! - `round-trip` (size = message bytes, 64 and 256): host send → handler (`out = 3·in + 1`
//!   per word for the baselines, the same on the value for the actor) → host sees the reply,
//!   one message in flight; µs per message; `extra` has p99 / p99.9 and the ratio to the
//!   doorbell (and for `warpdrive` the loop's mean iteration and its phases, idle and while
//!   answering: `idle_read_ns` … `idle_after_ns`, `idle_loop_ns`, the same `busy_…`, see
//!   `ActorStats::phase_ns`; `gap_ns`, the loop's wait after an answer, `ActorStats::gap_ns`;
//!   `gap_hits` / `gap_misses` / `gap_miss_pct`, the reads right after it while answering,
//!   `ActorStats::gap_reads`; `warpdrive-narrow` at 64 B: without the loop's stream options,
//!   `ActorSpec::quick_stream`, `ActorSpec::wide_window`, `SystemConfig::reply_gap`,
//!   `ActorSpec::tail_hint`; `warpdrive-no-hint` at 64 B: the defaults without the tail hint).
//!   Variants `doorbell` (one GPU thread polling one mapped word,
//!   no queue), `warpdrive` (`Actor::request`), `kernel-per-message` (write the message to mapped
//!   memory, launch, synchronize, read), `graph-per-message` (the same kernel in a graph).
//! - `round-trip-loaded` (size 64): `warpdrive` requests while another thread sends
//!   messages that need no reply, paced, at 10 / 30 / 50 / 70 / 90 % (a small run: 50 and
//!   90) of that actor's maximum under such a paced load, measured on the same actor just
//!   before (`paced_max`: from its rate fed by a producer at full speed, as the `throughput`
//!   row of batch 32, down in steps of 5% to the first rate its loop keeps up with; at full
//!   scale only, else the unpaced rate), a row each; variants `warpdrive-narrow` (the loop
//!   without its stream options, as above), `warpdrive-no-wide` (without
//!   `ActorSpec::wide_window`) and `warpdrive-no-hint` (without `ActorSpec::tail_hint`) the
//!   same on their own actors. The loop while the requests ran:
//!   `extra.iter_{read,control,pick,answer,after,loop}_ns` (mean iteration, idle and busy),
//!   `busy_iteration_ns`, `msgs_per_busy_iteration`, `busy_iteration_share`,
//!   `window_slots`, `window_fill` (see `loop_extras`; the `throughput` rows of one actor
//!   carry the same). `extra.load_fraction`, `extra.load_max_msgs_per_s` (that maximum),
//!   `extra.unpaced_max_msgs_per_s`, `extra.load_msgs_per_s`, `extra.b32_p1_msgs_per_s` (the
//!   `throughput` row's rate, for comparison), `extra.inbox_depth_at_start` (the messages
//!   waiting when the requests began). A step's messages stop at `STEP_LIMIT` with an error that says where
//!   they are, and at full scale a load the loop does not keep up with (over half the inbox
//!   waiting when the requests begin) is an error at once.
//! - `throughput` (size 64): messages handled per second, counted by the loop, by a sink
//!   actor (no replies, no state: the loop runs its handlers 32 at a time) with batch 1 / 16
//!   / 256 and 1 or 4 host producers sending 256 at a time, and `warpdrive-b256-p4-stateful`
//!   (a message counter as state: handlers one at a time); `pipeline`: a two-actor chain on the device (the first forwards, the second
//!   sinks). Samples are ns per message over intervals; `extra.msgs_per_s` the median rate.
//! - `terminate`: µs from `ActorSystem::terminate` to the loop's end.
//!
//! The `ringkernel` crate (a Rust ring-kernel framework on cudarc) is not measured here:
//! it runs its kernels through its own cudarc context and CUDA C toolchain, not through a
//! shared entry point a suite can time beside ours (see bench/NOTES.md).

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use bytemuck::{Pod, Zeroable};
use warpdrive::actor::probe::{Doorbell, OneShot};
use warpdrive::actor::{
    Actor, ActorCtx, ActorSpec, ActorStats, ActorSystem, Backpressure, SystemConfig,
};
use warpdrive::error::{Error, Result};
use warpdrive::exec::Graph;

use super::stats::percentile;
use super::{Ctx, Scale};

mod loaded;
use loaded::loaded;

/// The suite name.
pub const SUITE: &str = "actors";

const WAIT: Duration = Duration::from_secs(10);

/// How long the messages of one measuring step may take in all: a lost reply fails its
/// request after `WAIT`, and replies that each come late but within it (a loop that cannot
/// keep up, a message stranded until a later one) must not stretch a step without end.
const STEP_LIMIT: Duration = Duration::from_secs(60);

/// The actor's counts, for an error: what was taken from its inbox and what waits there.
fn whereabouts<I: Pod, O: Pod>(a: &Actor<I, O>) -> String {
    let s = a.stats();
    format!(
        "actor {}: {} processed, {} waiting in its inbox, {} loop iterations",
        a.name(),
        s.processed,
        a.depth(0),
        s.loops
    )
}

/// `Err` once `deadline` has passed, naming `what` and how far it got.
fn before(deadline: Instant, what: impl FnOnce() -> String) -> Result<()> {
    if Instant::now() > deadline {
        return Err(Error::Timeout {
            what: what(),
            after_ms: STEP_LIMIT.as_millis() as u64,
        });
    }
    Ok(())
}

/// Messages of 64 and 256 bytes: word 0 the id, word 1 a value, word 2 1 when a reply is
/// wanted.
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
#[repr(C)]
struct Msg64([u32; 16]);
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
#[repr(C)]
struct Msg256([u32; 64]);

/// The echo handler; without state (`S = ()`) the loop runs up to 32 at once.
fn handler_source(words: usize, stateful: bool) -> String {
    let (state, count) = if stateful {
        ("struct State { u64 count; };", "s->count += 1;")
    } else {
        ("struct State {};", "")
    };
    format!(
        "struct In {{ u32 w[{words}]; }};\ntypedef In Out;\n{state}\n\
         __device__ void handle(const In* in, Out* out, State* s, ActorCtx* ctx) {{\n\
         out->w[0] = in->w[0]; out->w[1] = in->w[1] * 3u + 1u; {count}\n\
         ctx->reply = in->w[2]; }}"
    )
}

fn echo<M: Pod>(i: &M, o: &mut M, ctx: &mut ActorCtx) {
    let (i, o) = (
        bytemuck::cast_slice::<_, u32>(std::slice::from_ref(i)),
        bytemuck::cast_slice_mut::<_, u32>(std::slice::from_mut(o)),
    );
    o[0] = i[0];
    o[1] = i[1].wrapping_mul(3).wrapping_add(1);
    ctx.reply = i[2];
}

/// Inbox slots of the suite's actors.
const CAPACITY: usize = 1 << 16;

/// The suite's queue settings: `batch`, `CAPACITY` slots, producers blocked while full.
fn sized<M: Pod, S: Pod>(spec: ActorSpec<M, M, S>, batch: usize) -> ActorSpec<M, M, S> {
    spec.batch(batch)
        .capacity(CAPACITY)
        .backpressure(Backpressure::Block { timeout: WAIT })
}

fn echo_spec<M: Pod>(name: &str, batch: usize) -> ActorSpec<M, M, ()> {
    let spec = ActorSpec::new(name, ())
        .cuda(handler_source(size_of::<M>() / 4, false))
        .host(|i: &M, o: &mut M, _: &mut (), ctx: &mut ActorCtx| echo(i, o, ctx));
    sized(spec, batch)
}

/// The echo with a message counter as its state: its handlers run one at a time.
fn counting_echo_spec(name: &str, batch: usize) -> ActorSpec<Msg64, Msg64, u64> {
    let spec = ActorSpec::new(name, 0u64)
        .cuda(handler_source(16, true))
        .host(
            |i: &Msg64, o: &mut Msg64, s: &mut u64, ctx: &mut ActorCtx| {
                echo(i, o, ctx);
                *s += 1;
            },
        );
    sized(spec, batch)
}

fn message<M: Pod>(id: u32, reply: bool) -> M {
    let mut m = M::zeroed();
    let w = bytemuck::cast_slice_mut::<_, u32>(std::slice::from_mut(&mut m));
    w[0] = id;
    w[1] = id.wrapping_mul(7);
    w[2] = reply as u32;
    m
}

#[derive(Clone, Copy)]
struct Plan {
    round_trips: usize,
    baseline_trips: usize,
    interval: Duration,
    intervals: usize,
    terminates: usize,
}

impl Plan {
    fn new(scale: Scale) -> Plan {
        match scale {
            Scale::Full => Plan {
                round_trips: 100_000,
                baseline_trips: 20_000,
                interval: Duration::from_millis(50),
                intervals: 10,
                terminates: 20,
            },
            Scale::Quick => Plan {
                round_trips: 5_000,
                baseline_trips: 2_000,
                interval: Duration::from_millis(20),
                intervals: 5,
                terminates: 5,
            },
            Scale::Tiny => Plan {
                round_trips: 200,
                baseline_trips: 100,
                interval: Duration::from_millis(5),
                intervals: 3,
                terminates: 2,
            },
        }
    }
}

pub(crate) fn run_suite(ctx: &mut Ctx) -> Result<()> {
    let plan = Plan::new(ctx.scale());
    round_trip::<Msg64>(ctx, &plan)?;
    round_trip::<Msg256>(ctx, &plan)?;
    let max = throughput(ctx, &plan)?;
    // A loaded step that fails (its error says why) still leaves the terminate row.
    let loaded = loaded(ctx, &plan, max);
    terminate(ctx, &plan)?;
    loaded
}

/// Named figures for a row's `extra`.
type Extras = Vec<(String, f64)>;

/// The loop's phases (`ActorStats::phase_ns`), then the whole iteration.
const PHASES: [&str; 6] = ["read", "control", "pick", "answer", "after", "loop"];

/// Mean ns per loop iteration between two stats of one actor: each phase, then the sum.
fn per_iteration(from: &ActorStats, to: &ActorStats) -> [f64; 6] {
    let loops = to.loops.saturating_sub(from.loops).max(1) as f64;
    let mut ns = [0.0; 6];
    for (i, v) in ns.iter_mut().take(5).enumerate() {
        *v = to.phase_ns[i].saturating_sub(from.phase_ns[i]) as f64 / loops;
    }
    ns[5] = ns[..5].iter().sum();
    ns
}

fn record_latency(
    ctx: &mut Ctx,
    case: &str,
    bytes: usize,
    variant: &str,
    mut us: Vec<f64>,
    doorbell: Option<f64>,
    extra: &[(&str, f64)],
) -> Result<f64> {
    let (p99, p999) = (percentile(&us, 0.99), percentile(&us, 0.999));
    let n = us.len();
    let row = ctx.record_time(case, bytes as u64, variant, &mut us, None)?;
    row.extra.insert("p99_us".into(), p99.into());
    row.extra.insert("p999_us".into(), p999.into());
    row.extra.insert("messages".into(), n.into());
    for (k, v) in extra {
        row.extra.insert((*k).into(), (*v).into());
    }
    let median = row.median;
    if let Some(d) = doorbell.filter(|d| *d > 0.0) {
        row.extra
            .insert("over_doorbell".into(), (median / d).into());
    }
    Ok(median)
}

fn round_trip<M: Pod>(ctx: &mut Ctx, plan: &Plan) -> Result<()> {
    const CASE: &str = "round-trip";
    let bytes = size_of::<M>();
    let device = ctx.device().clone();
    ctx.step(format!("{SUITE}: {CASE} {bytes} B doorbell"));
    let doorbell = {
        let mut bell = Doorbell::start(&device)?;
        for _ in 0..1000 {
            bell.ring(WAIT)?;
        }
        let mut us = Vec::with_capacity(plan.round_trips);
        for _ in 0..plan.round_trips {
            let t = Instant::now();
            bell.ring(WAIT)?;
            us.push(t.elapsed().as_secs_f64() * 1e6);
        }
        record_latency(ctx, CASE, bytes, "doorbell", us, None, &[])?
    };
    // `warpdrive-narrow`: the loop without the stream options (at 64 B, where the wide
    // window is wider than two slots); `warpdrive-no-hint`: without the tail hint (what its
    // extra load costs a closed-loop client).
    for (variant, options) in [
        ("warpdrive", LoopOptions::DEFAULT),
        ("warpdrive-narrow", LoopOptions::NARROW),
        ("warpdrive-no-hint", LoopOptions::NO_HINT),
    ] {
        if options != LoopOptions::DEFAULT && bytes != 64 {
            continue;
        }
        ctx.step(format!("{SUITE}: {CASE} {bytes} B {variant}"));
        actor_round_trip::<M>(ctx, plan, variant, options, doorbell)?;
    }
    ctx.step(format!(
        "{SUITE}: {CASE} {bytes} B kernel/graph per message"
    ));
    let stream = ctx.stream().clone();
    let shot = OneShot::new(&device, bytes)?;
    let mut reply = vec![0u8; bytes];
    let mut per_message = |launch: &mut dyn FnMut() -> Result<()>| -> Result<Vec<f64>> {
        let mut us = Vec::with_capacity(plan.baseline_trips);
        for k in 0..(plan.baseline_trips + 100) as u32 {
            let m = message::<M>(k, true);
            let t = Instant::now();
            shot.write(bytemuck::bytes_of(&m));
            launch()?;
            stream.synchronize()?;
            shot.read(&mut reply);
            let e = t.elapsed().as_secs_f64() * 1e6;
            let got: &[u32] = bytemuck::cast_slice(&reply);
            if got[0] != k.wrapping_mul(3).wrapping_add(1) {
                return Err(Error::InvalidArgument(format!(
                    "one-shot reply {} for {k}",
                    got[0]
                )));
            }
            if k >= 100 {
                us.push(e);
            }
        }
        Ok(us)
    };
    let us = per_message(&mut || shot.enqueue(&stream))?;
    record_latency(
        ctx,
        CASE,
        bytes,
        "kernel-per-message",
        us,
        Some(doorbell),
        &[],
    )?;
    let mut graph = Graph::capture(&stream, |s| shot.enqueue(s))?;
    let us = per_message(&mut || graph.launch())?;
    drop(graph);
    record_latency(
        ctx,
        CASE,
        bytes,
        "graph-per-message",
        us,
        Some(doorbell),
        &[],
    )?;
    Ok(())
}

/// The actor's closed-loop round trips (`round-trip` rows of `variant`), with its loop's
/// iteration idle and busy.
fn actor_round_trip<M: Pod>(
    ctx: &mut Ctx,
    plan: &Plan,
    variant: &str,
    options: LoopOptions,
    doorbell: f64,
) -> Result<()> {
    const CASE: &str = "round-trip";
    let bytes = size_of::<M>();
    let device = ctx.device().clone();
    let (spec, config) = options.apply(echo_spec::<M>("echo", 32));
    let mut system = ActorSystem::with_config(&device, config)?;
    let a = system.spawn(spec)?;
    system.start()?;
    a.activate()?;
    for k in 0..1000 {
        a.request(&message::<M>(k, true), 0, WAIT)?;
    }
    // The loop's iteration and its phases with nothing to do, then while it answers.
    let idle0 = a.stats();
    std::thread::sleep(plan.interval);
    let idle = per_iteration(&idle0, &a.stats());
    let mut us = Vec::with_capacity(plan.round_trips);
    let busy0 = a.stats();
    let deadline = Instant::now() + STEP_LIMIT;
    for k in 0..plan.round_trips as u32 {
        before(deadline, || {
            format!(
                "{SUITE} {CASE} {bytes} B: {} round trips ({k} done; {})",
                plan.round_trips,
                whereabouts(&a)
            )
        })?;
        let m = message::<M>(k, true);
        let t = Instant::now();
        let out = a.request(&m, 0, WAIT)?;
        us.push(t.elapsed().as_secs_f64() * 1e6);
        check(&out, k)?;
    }
    let busy_stats = a.stats();
    let busy = per_iteration(&busy0, &busy_stats);
    system.terminate()?;
    let mut extra = vec![("gap_ns".to_string(), busy_stats.gap_ns as f64)];
    // The reads right after the gap while answering: hits and misses (a miss costs its
    // message one more read).
    let [hits, misses] =
        std::array::from_fn(|i| busy_stats.gap_reads[i].saturating_sub(busy0.gap_reads[i]) as f64);
    extra.push(("gap_hits".into(), hits));
    extra.push(("gap_misses".into(), misses));
    if hits + misses > 0.0 {
        extra.push(("gap_miss_pct".into(), 100.0 * misses / (hits + misses)));
    }
    for (when, ns) in [("idle", idle), ("busy", busy)] {
        for (phase, v) in PHASES.iter().zip(ns) {
            extra.push((format!("{when}_{phase}_ns"), v));
        }
    }
    let extra: Vec<(&str, f64)> = extra.iter().map(|(k, v)| (k.as_str(), *v)).collect();
    record_latency(ctx, CASE, bytes, variant, us, Some(doorbell), &extra)?;
    Ok(())
}

fn check<M: Pod>(out: &M, k: u32) -> Result<()> {
    let w = bytemuck::cast_slice::<_, u32>(std::slice::from_ref(out));
    if w[0] != k || w[1] != k.wrapping_mul(7).wrapping_mul(3).wrapping_add(1) {
        return Err(Error::InvalidArgument(format!(
            "actor reply {:?} for {k}",
            &w[..2]
        )));
    }
    Ok(())
}

/// What [`drive`] measured: ns per handled message over each interval, and the messages
/// its producers sent.
struct Driven {
    ns: Vec<f64>,
    sent: u64,
}

/// Runs `producers` threads sending no-reply messages to `targets` (round robin) as fast
/// as they can (or paced to `rate` messages per second in all), and samples the handled
/// count of `counted` each interval: ns per message per interval. `during` runs after the
/// sampling, with the flag that is set once a producer has stopped (on an error, which
/// `drive` returns).
fn drive(
    plan: &Plan,
    targets: &[Actor<Msg64, Msg64>],
    counted: &[Actor<Msg64, Msg64>],
    producers: usize,
    rate: Option<f64>,
    during: impl FnOnce(&AtomicBool) -> Result<()>,
) -> Result<Driven> {
    let stop = AtomicBool::new(false);
    let chunk: Vec<Msg64> = (0..256).map(|k| message(k, false)).collect();
    std::thread::scope(|s| -> Result<Driven> {
        let mut handles = Vec::new();
        for p in 0..producers {
            let a = targets[p % targets.len()].clone();
            let (stop, chunk) = (&stop, &chunk);
            let per_thread = rate.map(|r| r / producers as f64);
            handles.push(s.spawn(move || -> Result<u64> {
                let t0 = Instant::now();
                let mut sent = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    let n = match per_thread {
                        Some(r) => {
                            let due = (t0.elapsed().as_secs_f64() * r) as u64;
                            if due < sent + 16 {
                                std::hint::spin_loop();
                                continue;
                            }
                            ((due - sent) as usize).min(chunk.len())
                        }
                        None => chunk.len(),
                    };
                    if let Err(e) = a.send_many(&chunk[..n], 0) {
                        // The others stop too, and `during` sees it.
                        stop.store(true, Ordering::Relaxed);
                        return Err(e);
                    }
                    sent += n as u64;
                }
                Ok(sent)
            }));
        }
        let count = || counted.iter().map(|a| a.stats().processed).sum::<u64>();
        std::thread::sleep(plan.interval);
        let mut ns = Vec::with_capacity(plan.intervals);
        let measured = sample(plan, &count, &mut ns).and_then(|()| during(&stop));
        stop.store(true, Ordering::Relaxed);
        let mut sent = 0;
        for h in handles {
            sent += h
                .join()
                .map_err(|_| Error::WorkerPanicked("an actors producer".into()))??;
        }
        measured?;
        if ns.is_empty() {
            return Err(Error::InvalidArgument("no message was handled".into()));
        }
        Ok(Driven { ns, sent })
    })
}

/// Waits (up to `WAIT`) until `a` has processed `total` messages: none was lost.
fn all_processed(a: &Actor<Msg64, Msg64>, total: u64) -> Result<()> {
    let t0 = Instant::now();
    while a.stats().processed < total {
        if t0.elapsed() > WAIT {
            return Err(Error::Timeout {
                what: format!("{total} messages sent: {}", whereabouts(a)),
                after_ms: WAIT.as_millis() as u64,
            });
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    Ok(())
}

/// ns per handled message over each of the plan's intervals (an interval in which nothing
/// was handled adds no sample; on a busy host more intervals are taken, up to 5 s, until
/// one has some).
fn sample(plan: &Plan, count: &dyn Fn() -> u64, ns: &mut Vec<f64>) -> Result<()> {
    let start = Instant::now();
    let mut taken = 0;
    while taken < plan.intervals || (ns.is_empty() && start.elapsed() < Duration::from_secs(5)) {
        let (c0, t0) = (count(), Instant::now());
        std::thread::sleep(plan.interval);
        let (c1, dt) = (count(), t0.elapsed());
        if c1 > c0 {
            ns.push(dt.as_secs_f64() * 1e9 / (c1 - c0) as f64);
        }
        taken += 1;
    }
    Ok(())
}

/// Messages per second at the median of ns-per-message samples (`drive` returns some).
fn median_rate(ns: &[f64]) -> f64 {
    let mut sorted = ns.to_vec();
    sorted.sort_by(f64::total_cmp);
    sorted.get(sorted.len() / 2).map_or(0.0, |v| 1e9 / v)
}

fn record_rate(
    ctx: &mut Ctx,
    case: &str,
    variant: &str,
    ns: Vec<f64>,
    extra: &[(String, f64)],
) -> Result<f64> {
    let mut us: Vec<f64> = ns.iter().map(|v| v / 1e3).collect();
    let rate = median_rate(&ns);
    let row = ctx.record_time(case, 64, variant, &mut us, None)?;
    row.extra.insert("msgs_per_s".into(), rate.into());
    for (k, v) in extra {
        row.extra.insert(k.clone(), (*v).into());
    }
    row.extra
        .insert("unit_of_samples".into(), "us per message".into());
    Ok(rate)
}

/// The throughput rows; returns the 1-producer rate of batch 32 (the latency actor's).
fn throughput(ctx: &mut Ctx, plan: &Plan) -> Result<f64> {
    const CASE: &str = "throughput";
    let device = ctx.device().clone();
    let mut base = 0.0;
    for batch in [1usize, 16, 32, 256] {
        for producers in [1usize, 4] {
            if batch == 32 && producers == 4 {
                continue;
            }
            ctx.step(format!(
                "{SUITE}: {CASE} batch {batch}, {producers} producers"
            ));
            let (ns, extra) = one_sink(&device, plan, echo_spec("sink", batch), producers)?;
            let variant = format!("warpdrive-b{batch}-p{producers}");
            let rate = record_rate(ctx, CASE, &variant, ns, &extra)?;
            if batch == 32 {
                base = rate;
            }
        }
    }
    ctx.step(format!(
        "{SUITE}: {CASE} batch 256, 4 producers, with state"
    ));
    let (ns, extra) = one_sink(&device, plan, counting_echo_spec("counter", 256), 4)?;
    record_rate(ctx, CASE, "warpdrive-b256-p4-stateful", ns, &extra)?;
    ctx.step(format!("{SUITE}: {CASE} 4 producers, 4 actors"));
    {
        let mut system = ActorSystem::new(&device)?;
        let actors: Vec<_> = (0..4)
            .map(|i| system.spawn(echo_spec::<Msg64>(&format!("sink{i}"), 256)))
            .collect::<Result<_>>()?;
        system.start()?;
        for a in &actors {
            a.activate()?;
        }
        let ns = drive(plan, &actors, &actors, 4, None, |_| Ok(()))?.ns;
        system.terminate()?;
        record_rate(ctx, CASE, "warpdrive-b256-p4-a4", ns, &[])?;
    }
    ctx.step(format!("{SUITE}: pipeline"));
    {
        let mut system = ActorSystem::new(&device)?;
        let second = system.spawn(echo_spec::<Msg64>("second", 256))?;
        // The first stage answers every message (to the second), which sinks them.
        let first = system.spawn(
            ActorSpec::<Msg64, Msg64, ()>::new("first", ())
                .cuda(
                    "struct In { u32 w[16]; };\ntypedef In Out;\nstruct State {};\n\
                     __device__ void handle(const In* in, Out* out, State*, ActorCtx*) {\n\
                     *out = *in; out->w[1] = in->w[1] + 1u; }",
                )
                .host(|i: &Msg64, o: &mut Msg64, _: &mut (), _: &mut ActorCtx| {
                    *o = *i;
                    o.0[1] = i.0[1].wrapping_add(1);
                })
                .batch(256)
                .capacity(CAPACITY)
                .forward_to(&second),
        )?;
        system.start()?;
        first.activate()?;
        second.activate()?;
        let ns = drive(
            plan,
            std::slice::from_ref(&first),
            std::slice::from_ref(&second),
            4,
            None,
            |_| Ok(()),
        )?
        .ns;
        system.terminate()?;
        record_rate(ctx, "pipeline", "warpdrive-2-stages-p4", ns, &[])?;
    }
    Ok(base)
}

/// ns per message handled by one sink actor of `spec` fed by `producers` threads, and its
/// loop over that time (`loop_extras`).
fn one_sink<S: Pod>(
    device: &warpdrive::Device,
    plan: &Plan,
    spec: ActorSpec<Msg64, Msg64, S>,
    producers: usize,
) -> Result<(Vec<f64>, Extras)> {
    let mut system = ActorSystem::new(device)?;
    let a = system.spawn(spec)?;
    system.start()?;
    a.activate()?;
    let targets = std::slice::from_ref(&a);
    let from = a.stats();
    let ns = drive(plan, targets, targets, producers, None, |_| Ok(()))?.ns;
    let extra = loop_extras(&from, &a.stats());
    system.terminate()?;
    Ok((ns, extra))
}

/// The loop's stream options a row runs with: `ActorSpec::quick_stream`,
/// `ActorSpec::wide_window`, `SystemConfig::reply_gap`, `ActorSpec::tail_hint`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct LoopOptions {
    quick_stream: bool,
    wide_window: bool,
    reply_gap: bool,
    tail_hint: bool,
}

impl LoopOptions {
    /// The library's defaults (all four).
    const DEFAULT: LoopOptions = LoopOptions {
        quick_stream: true,
        wide_window: true,
        reply_gap: true,
        tail_hint: true,
    };
    /// None of them: the loop before them (the `-narrow` rows).
    const NARROW: LoopOptions = LoopOptions {
        quick_stream: false,
        wide_window: false,
        reply_gap: false,
        tail_hint: false,
    };
    /// The defaults without the tail hint (the `-no-hint` rows).
    const NO_HINT: LoopOptions = LoopOptions {
        tail_hint: false,
        ..LoopOptions::DEFAULT
    };

    /// `spec` with these options, and the default system config with them.
    fn apply<M: Pod>(self, spec: ActorSpec<M, M, ()>) -> (ActorSpec<M, M, ()>, SystemConfig) {
        let config = SystemConfig {
            reply_gap: self.reply_gap,
            ..SystemConfig::default()
        };
        let spec = spec
            .quick_stream(self.quick_stream)
            .wide_window(self.wide_window)
            .tail_hint(self.tail_hint);
        (spec, config)
    }
}

/// The loop between two stats of one actor: its mean iteration and phases (`iter_…_ns`, idle
/// and busy iterations together), and where it took messages: `busy_iteration_ns` (from its
/// start to the answers), `msgs_per_busy_iteration`, `busy_iteration_share` of all; the mean
/// window it read (`window_slots`) and the share of the windows that held messages
/// (`window_fill`). The loop publishes its counts every 256 iterations (the CPU backend
/// none: only zeros, and no busy or window figures).
fn loop_extras(from: &ActorStats, to: &ActorStats) -> Extras {
    let mut extra: Extras = PHASES
        .iter()
        .zip(per_iteration(from, to))
        .map(|(phase, v)| (format!("iter_{phase}_ns"), v))
        .collect();
    let d = |a: u64, b: u64| b.saturating_sub(a) as f64;
    let (loops, busy_loops) = (d(from.loops, to.loops), d(from.busy_loops, to.busy_loops));
    let processed = d(from.processed, to.processed);
    let slots = d(from.window_slots, to.window_slots);
    extra.push(("iterations".into(), loops));
    if busy_loops > 0.0 {
        extra.push((
            "busy_iteration_ns".into(),
            d(from.busy_ns, to.busy_ns) / busy_loops,
        ));
        extra.push(("msgs_per_busy_iteration".into(), processed / busy_loops));
        extra.push(("busy_iteration_share".into(), busy_loops / loops.max(1.0)));
    }
    if loops > 0.0 && slots > 0.0 {
        extra.push(("window_slots".into(), slots / loops));
        extra.push(("window_fill".into(), processed / slots));
    }
    extra
}

fn terminate(ctx: &mut Ctx, plan: &Plan) -> Result<()> {
    const CASE: &str = "terminate";
    ctx.step(format!("{SUITE}: {CASE}"));
    let device = ctx.device().clone();
    let mut us = Vec::with_capacity(plan.terminates);
    for _ in 0..plan.terminates {
        let mut system = ActorSystem::new(&device)?;
        let a = system.spawn(echo_spec::<Msg64>("echo", 32))?;
        system.start()?;
        a.activate()?;
        a.request(&message::<Msg64>(1, true), 0, WAIT)?;
        us.push(system.terminate()?.as_secs_f64() * 1e6);
    }
    ctx.record_time(CASE, 64, "warpdrive", &mut us, None)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::loaded::LOADED_VARIANTS;
    use super::*;

    #[test]
    fn tiny_run_on_the_cpu_records_every_case() {
        let mut ctx = Ctx::new(&warpdrive::Device::cpu(), Scale::Tiny).unwrap();
        ctx.suite = SUITE;
        run_suite(&mut ctx).unwrap();
        let rows = ctx.rows();
        for (case, variant) in [
            ("round-trip", "doorbell"),
            ("round-trip", "warpdrive"),
            ("round-trip", "kernel-per-message"),
            ("round-trip", "graph-per-message"),
            ("throughput", "warpdrive-b256-p4"),
            ("pipeline", "warpdrive-2-stages-p4"),
            ("round-trip-loaded", "warpdrive"),
            ("round-trip", "warpdrive-narrow"),
            ("round-trip-loaded", "warpdrive-narrow"),
            ("round-trip-loaded", "warpdrive-no-wide"),
            ("round-trip", "warpdrive-no-hint"),
            ("round-trip-loaded", "warpdrive-no-hint"),
            ("terminate", "warpdrive"),
        ] {
            assert!(
                rows.iter().any(|r| r.case == case && r.variant == variant),
                "{case} {variant} missing"
            );
        }
        let warp = rows
            .iter()
            .find(|r| r.case == "round-trip" && r.variant == "warpdrive" && r.size == 64)
            .unwrap();
        assert!(warp.extra["p999_us"].as_f64().unwrap() >= warp.median);
        assert!(warp.extra["over_doorbell"].as_f64().unwrap() > 0.0);
        // A small run's loads: 50 % and 90 %, one row each, per variant (four).
        let loaded: Vec<_> = rows
            .iter()
            .filter(|r| r.case == "round-trip-loaded")
            .collect();
        assert_eq!(loaded.len(), 2 * LOADED_VARIANTS.len());
        for row in loaded {
            assert!(row.extra.contains_key("iter_loop_ns"));
            let max = row.extra["load_max_msgs_per_s"].as_f64().unwrap();
            assert!(max <= row.extra["unpaced_max_msgs_per_s"].as_f64().unwrap());
            let load = row.extra["load_msgs_per_s"].as_f64().unwrap();
            let fraction = row.extra["load_fraction"].as_f64().unwrap();
            assert!(max > 0.0 && (load - max * fraction).abs() <= 1e-6 * max);
        }
    }
}
