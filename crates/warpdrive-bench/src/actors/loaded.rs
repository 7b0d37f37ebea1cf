//! The `actors` suite's `round-trip-loaded` rows: an actor's maximum under a paced load
//! (`paced_max`), then `warpdrive` round trips at fractions of it (`SWEEP`) for the default
//! loop and each of `LOADED_VARIANTS` (see the suite's doc in actors.rs).

use std::sync::atomic::Ordering;
use std::time::Instant;

use warpdrive::actor::{Actor, ActorSpec, ActorStats, ActorSystem, SystemConfig};
use warpdrive::error::{Error, Result};

use super::{
    all_processed, before, check, drive, echo_spec, loop_extras, median_rate, message,
    record_latency, whereabouts, Ctx, Extras, LoopOptions, Msg64, Plan, CAPACITY, STEP_LIMIT,
    SUITE, WAIT,
};

/// Steps of [`paced_max`]: each rate this fraction of the one before, at most this many.
const PACED_STEP: f64 = 0.95;
const PACED_STEPS: usize = 14;

/// The highest paced load (one producer, as `drive` paces it) `a`'s loop keeps up with:
/// from `unpaced` down in steps of `PACED_STEP`, each rate offered for as long as a loaded
/// step runs and kept up where at most `CAPACITY / 16` messages wait at its end (a fifth as
/// long, a rate ~1 % over what the loop sustains went unseen, and the 90 % step of such a
/// maximum filled the inbox: bench/NOTES.md). Paced, the loop reads slots
/// written microseconds before, whose lines still sit modified in the sending core's cache
/// and come over PCIe slower than a full inbox's long-written ones (bench/NOTES.md). Returns
/// the rate and the messages the probes sent; `done` messages were sent to `a` before, and
/// every message is handled on return.
fn paced_max(plan: &Plan, a: &Actor<Msg64, Msg64>, unpaced: f64, done: u64) -> Result<(f64, u64)> {
    let probe = *plan;
    let one = std::slice::from_ref(a);
    let (mut rate, mut sent) = (unpaced, 0);
    for _ in 0..PACED_STEPS {
        let mut depth = 0;
        sent += drive(&probe, one, one, 1, Some(rate), |_| {
            depth = a.depth(0);
            Ok(())
        })?
        .sent;
        all_processed(a, done + sent)?;
        if depth as usize <= CAPACITY / 16 {
            return Ok((rate, sent));
        }
        rate *= PACED_STEP;
    }
    Err(Error::Actor {
        actor: a.name().into(),
        detail: format!(
            "round-trip-loaded: the loop keeps up with no paced load from {unpaced:.0} msg/s down \
             to {:.0}",
            rate / PACED_STEP
        ),
    })
}

/// The loaded step's loads, as fractions of the actor's maximum under a paced load, at full
/// scale: a sweep whose 50 % and 90 % rows are the issue's; a small run takes those two.
const SWEEP: [f64; 5] = [0.1, 0.3, 0.5, 0.7, 0.9];

/// The loaded step's variants: the defaults, the loop without the options, without the
/// wide window and without the tail hint.
pub(super) const LOADED_VARIANTS: [(&str, LoopOptions); 4] = [
    ("warpdrive", LoopOptions::DEFAULT),
    ("warpdrive-narrow", LoopOptions::NARROW),
    (
        "warpdrive-no-wide",
        LoopOptions {
            wide_window: false,
            ..LoopOptions::DEFAULT
        },
    ),
    ("warpdrive-no-hint", LoopOptions::NO_HINT),
];

/// Round trips under load (`SWEEP`), for the default loop and each of `LOADED_VARIANTS`, each
/// on its own actor against its own maximum (`b32_p1`: the `throughput` row's rate of the
/// same spec, recorded beside it). A variant that fails (its error says why) does not stop
/// the others; the first error is returned.
pub(super) fn loaded(ctx: &mut Ctx, plan: &Plan, b32_p1: f64) -> Result<()> {
    let fractions: &[f64] = if ctx.scale().quick() {
        &[0.5, 0.9]
    } else {
        &SWEEP
    };
    let mut first_error = None;
    for (variant, options) in LOADED_VARIANTS {
        let (spec, config) = options.apply(echo_spec::<Msg64>("echo", 32));
        if let Err(e) = loaded_sweep(ctx, plan, b32_p1, variant, spec, config, fractions) {
            first_error.get_or_insert(e);
        }
    }
    first_error.map_or(Ok(()), Err)
}

/// One actor's maximum under a paced load, then its round trips at each of `fractions` of
/// it, a row each.
fn loaded_sweep(
    ctx: &mut Ctx,
    plan: &Plan,
    b32_p1: f64,
    variant: &str,
    spec: ActorSpec<Msg64, Msg64, ()>,
    config: SystemConfig,
    fractions: &[f64],
) -> Result<()> {
    const CASE: &str = "round-trip-loaded";
    let device = ctx.device().clone();
    let full = !ctx.scale().quick();
    ctx.step(format!("{SUITE}: {CASE} {variant}: the maximum"));
    let mut system = ActorSystem::with_config(&device, config)?;
    let a = system.spawn(spec)?;
    system.start()?;
    let result = (|| -> Result<()> {
        a.activate()?;
        // This actor's maximum fed at full speed, then its inbox drained, then under a paced
        // load (a small run's short probes on a busy CPU prove little: there, the first).
        let one = std::slice::from_ref(&a);
        let saturated = drive(plan, one, one, 1, None, |_| Ok(()))?;
        all_processed(&a, saturated.sent)?;
        let unpaced = median_rate(&saturated.ns);
        let (max, probed) = if full {
            paced_max(plan, &a, unpaced, saturated.sent)?
        } else {
            (unpaced, 0)
        };
        let mut total = saturated.sent + probed;
        for &fraction in fractions {
            ctx.step(format!(
                "{SUITE}: {CASE} {variant} at {:.0}%",
                fraction * 100.0
            ));
            let rate = max * fraction;
            let step = loaded_step(plan, &a, rate, full)?;
            total += step.sent + step.us.len() as u64;
            // Every message the producer sent and every request handled: none lost.
            all_processed(&a, total)?;
            let mut extra: Extras = vec![
                ("load_fraction".into(), fraction),
                ("load_msgs_per_s".into(), rate),
                ("load_max_msgs_per_s".into(), max),
                ("unpaced_max_msgs_per_s".into(), unpaced),
                ("b32_p1_msgs_per_s".into(), b32_p1),
                ("inbox_depth_at_start".into(), step.depth_at_start as f64),
            ];
            extra.extend(loop_extras(&step.from, &step.to));
            let extra: Vec<(&str, f64)> = extra.iter().map(|(k, v)| (k.as_str(), *v)).collect();
            record_latency(ctx, CASE, 64, variant, step.us, None, &extra)?;
        }
        Ok(())
    })();
    // Terminated before a failed step's error is returned.
    system.terminate()?;
    result
}

/// What [`loaded_step`] measured.
struct Loaded {
    /// µs per round trip.
    us: Vec<f64>,
    /// Messages the producer sent.
    sent: u64,
    /// Messages waiting when the requests began.
    depth_at_start: u64,
    /// The actor's stats when the requests began and ended.
    from: ActorStats,
    to: ActorStats,
}

/// Round trips to `a` while one producer sends it `rate` messages a second that need no
/// reply.
fn loaded_step(plan: &Plan, a: &Actor<Msg64, Msg64>, rate: f64, full: bool) -> Result<Loaded> {
    const CASE: &str = "round-trip-loaded";
    let trips = plan.round_trips / 5;
    let mut us = Vec::with_capacity(trips);
    let mut depth_at_start = 0;
    let (mut from, mut to) = (a.stats(), a.stats());
    let one = std::slice::from_ref(a);
    let driven = drive(plan, one, one, 1, Some(rate), |halted| {
        let deadline = Instant::now() + STEP_LIMIT;
        // Messages waiting when the requests begin: near the inbox's capacity, the offered
        // load is more than the loop handles while answering requests, and each request
        // waits behind a full inbox.
        let depth = a.depth(0);
        depth_at_start = depth;
        // (At full scale only: a small run's short load on a busy CPU proves little.)
        if full && depth as usize > CAPACITY / 2 {
            return Err(Error::Actor {
                actor: a.name().into(),
                detail: format!(
                    "{CASE}: the loop does not keep up with {rate:.0} msg/s: {depth} of \
                     {CAPACITY} inbox slots full after {:?} of load ({})",
                    plan.interval * (plan.intervals as u32 + 1),
                    whereabouts(a)
                ),
            });
        }
        from = a.stats();
        for k in 0..trips as u32 {
            // A producer that stopped has its error returned by `drive`.
            if halted.load(Ordering::Relaxed) {
                return Ok(());
            }
            before(deadline, || {
                format!(
                    "{SUITE} {CASE}: {trips} round trips under {rate:.0} msg/s ({k} done; \
                     {depth} messages waited when they began, of {CAPACITY}; {})",
                    whereabouts(a)
                )
            })?;
            let m = message::<Msg64>(k, true);
            let t = Instant::now();
            check(&a.request(&m, 0, WAIT)?, k)?;
            us.push(t.elapsed().as_secs_f64() * 1e6);
        }
        to = a.stats();
        Ok(())
    })?;
    Ok(Loaded {
        us,
        sent: driven.sent,
        depth_at_start,
        from,
        to,
    })
}
