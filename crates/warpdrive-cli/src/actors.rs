//! `warpdrive actors`: a demo of persistent actors with live counters.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use warpdrive::actor::{ActorCtx, ActorSpec, ActorStats, ActorSystem, Backpressure};

use crate::flags::ActorsArgs;

/// 64-byte messages: an id, a value, 1 when a reply is wanted.
type Msg = [u32; 16];

const HANDLER: &str = "struct In { u32 w[16]; };\ntypedef In Out;\nstruct State { u64 n; };\n\
    __device__ void handle(const In* in, Out* out, State* s, ActorCtx* ctx) {\n\
    *out = *in; out->w[1] = in->w[1] * 3u + 1u; s->n += 1; ctx->reply = in->w[2]; }";

fn host_handler(i: &Msg, o: &mut Msg, s: &mut u64, ctx: &mut ActorCtx) {
    *o = *i;
    o[1] = i[1].wrapping_mul(3).wrapping_add(1);
    *s += 1;
    ctx.reply = i[2];
}

pub(crate) fn actors(args: &ActorsArgs) -> Result<()> {
    if !(args.seconds.is_finite() && args.seconds > 0.0 && args.seconds <= 3600.0) {
        bail!(
            "--seconds {}: expected more than 0 and at most 3600",
            args.seconds
        );
    }
    let device = args.device.open()?;
    let mut system = ActorSystem::new(&device)?;
    let actors = (0..args.actors)
        .map(|i| {
            system.spawn(
                ActorSpec::<Msg, Msg, u64>::new(format!("echo{i}"), 0)
                    .cuda(HANDLER)
                    .host(host_handler)
                    .batch(args.batch as usize)
                    .capacity(1 << 14)
                    .backpressure(Backpressure::Block {
                        timeout: Duration::from_secs(5),
                    }),
            )
        })
        .collect::<warpdrive::Result<Vec<_>>>()?;
    let t = Instant::now();
    system.start().context("starting the resident loop")?;
    for a in &actors {
        a.activate()?;
    }
    println!(
        "{} actors on {} (started in {:.1} ms), {} producers, batch {}",
        args.actors,
        device.label(),
        t.elapsed().as_secs_f64() * 1e3,
        args.producers,
        args.batch
    );
    let stop = AtomicBool::new(false);
    let total = |stats: &[ActorStats]| stats.iter().map(|s| s.processed).sum::<u64>();
    std::thread::scope(|s| -> Result<()> {
        let mut producers = Vec::new();
        for p in 0..args.producers as usize {
            let a = actors[p % actors.len()].clone();
            let stop = &stop;
            producers.push(s.spawn(move || -> warpdrive::Result<()> {
                let chunk: Vec<Msg> = (0..256u32)
                    .map(|k| [k, k, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0])
                    .collect();
                while !stop.load(Ordering::Relaxed) {
                    a.send_many(&chunk, 0)?;
                }
                Ok(())
            }));
        }
        let t0 = Instant::now();
        let mut last = (0u64, Instant::now());
        while t0.elapsed().as_secs_f64() < args.seconds {
            std::thread::sleep(Duration::from_millis(500));
            let stats: Vec<ActorStats> = actors.iter().map(|a| a.stats()).collect();
            let n = total(&stats);
            let rate = (n - last.0) as f64 / last.1.elapsed().as_secs_f64();
            last = (n, Instant::now());
            let busy = stats.iter().map(|s| s.busy_ns).sum::<u64>() as f64
                / (t0.elapsed().as_nanos() as f64 * stats.len() as f64);
            let depth = stats.iter().map(|s| s.max_depth).max().unwrap_or(0);
            println!(
                "{:6.1} s  processed {n:>12}  {:>8.2} M msg/s  dropped {}  rejected {}  max depth {depth}  busy {:.0}%",
                t0.elapsed().as_secs_f64(),
                rate / 1e6,
                stats.iter().map(|s| s.dropped).sum::<u64>(),
                stats.iter().map(|s| s.rejected).sum::<u64>(),
                busy * 100.0
            );
        }
        stop.store(true, Ordering::Relaxed);
        for p in producers {
            p.join()
                .map_err(|_| anyhow::anyhow!("a producer panicked"))??;
        }
        Ok(())
    })?;
    let a = &actors[0];
    while a.try_recv()?.is_some() {}
    let mut us: Vec<f64> = (0..10_000u32)
        .map(|k| {
            let t = Instant::now();
            a.request(
                &[k, k, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0],
                0,
                Duration::from_secs(5),
            )
            .map(|_| t.elapsed().as_secs_f64() * 1e6)
        })
        .collect::<warpdrive::Result<_>>()?;
    us.sort_by(f64::total_cmp);
    let at = |q: f64| us[((us.len() - 1) as f64 * q) as usize];
    println!(
        "round trip (64 B, one in flight, 10000): p50 {:.2} µs  p99 {:.2} µs  p99.9 {:.2} µs",
        at(0.5),
        at(0.99),
        at(0.999)
    );
    let took = system.terminate()?;
    println!("terminated in {:.1} µs", took.as_secs_f64() * 1e6);
    Ok(())
}
