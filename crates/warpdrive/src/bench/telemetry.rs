//! Suite `telemetry`: what a span costs on the host.
//!
//! Case `span-overhead` (size = spans per sample): µs per span opened and closed on the
//! suite's stream, variants `disabled` (telemetry off: one branch; target ≤ 0.005 µs) and
//! `enabled` (host time, two GPU events on CUDA, pool bytes, histogram, queue push; target
//! ≤ 1 µs). Closed spans are drained between samples, outside the timed loop.

use std::hint::black_box;
use std::time::Instant;

use super::Ctx;
use crate::error::Result;
use crate::telemetry;

pub(super) const SUITE: &str = "telemetry";

/// The name of the measured spans (dropped between samples; other spans stay queued).
const SPAN: &str = "bench.span";

const TARGET_DISABLED_US: f64 = 0.005;
const TARGET_ENABLED_US: f64 = 1.0;

pub(super) fn run_suite(ctx: &mut Ctx) -> Result<()> {
    let was_on = telemetry::enabled();
    let out = run_cases(ctx);
    telemetry::set_enabled(was_on);
    telemetry::discard_spans(SPAN);
    out
}

fn run_cases(ctx: &mut Ctx) -> Result<()> {
    let samples = if ctx.quick() { 7 } else { 21 };
    for (variant, on, spans, target) in [
        ("disabled", false, 1_000_000usize, TARGET_DISABLED_US),
        ("enabled", true, 2_000, TARGET_ENABLED_US),
    ] {
        let spans = if ctx.scale() == super::Scale::Tiny {
            spans / 100
        } else {
            spans
        };
        ctx.step(format!("span-overhead {variant}"));
        telemetry::set_enabled(on);
        let stream = ctx.stream().clone();
        let mut times = Vec::with_capacity(samples);
        // One warm-up sample (GPU clock setup, event pool, histogram registration).
        for i in 0..=samples {
            let t = Instant::now();
            for _ in 0..spans {
                let s = telemetry::span(black_box(SPAN), &stream);
                black_box(&s);
                drop(s);
            }
            let us = t.elapsed().as_secs_f64() * 1e6 / spans as f64;
            telemetry::discard_spans(SPAN);
            if i > 0 {
                times.push(us);
            }
        }
        let row = ctx.record_time("span-overhead", spans as u64, variant, &mut times, None)?;
        let met = row.median <= target;
        row.extra.insert("target_us".into(), target.into());
        row.extra.insert("target_met".into(), met.into());
    }
    Ok(())
}
