//! Suite `telemetry`: what a span costs on the host.
//!
//! Case `span-overhead` (size = spans per sample): µs per span opened and closed on the
//! suite's stream, variants `disabled` (telemetry off: one branch; target ≤ 0.005 µs) and
//! `enabled` (host time, GPU events on CUDA, pool bytes, histogram, queue push; target
//! ≤ 1 µs). Closed spans are drained between samples, outside the timed loop.
//!
//! The spans are empty, so on CUDA their boundaries share events (see `telemetry::span`):
//! `extra.gpu_events_per_span` says how many were recorded per span, and
//! `extra.event_record_us` what one costs on the host (one `Stream::record` of a timing
//! event), so a span that encloses work — one event at its close — costs about
//! `median + (1 - gpu_events_per_span) × event_record_us`.

use std::hint::black_box;
use std::time::Instant;

use super::{Ctx, Stats};
use warpdrive::device::Stream;
use warpdrive::error::Result;
use warpdrive::telemetry;

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
        let events_before = telemetry::gpu_events_recorded();
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
        let events = telemetry::gpu_events_recorded() - events_before;
        let record_us = if on && stream.device().is_cuda() {
            Some(event_record_us(&stream, samples)?)
        } else {
            None
        };
        let row = ctx.record_time("span-overhead", spans as u64, variant, &mut times, None)?;
        let met = row.median <= target;
        row.extra.insert("target_us".into(), target.into());
        row.extra.insert("target_met".into(), met.into());
        if on {
            let per_span = events as f64 / (spans * (samples + 1)) as f64;
            row.extra
                .insert("gpu_events_per_span".into(), per_span.into());
        }
        if let Some(us) = record_us {
            row.extra.insert("event_record_us".into(), us.into());
        }
    }
    Ok(())
}

/// Median host µs of one `Stream::record` of a timing event (1000 per sample).
fn event_record_us(stream: &Stream, samples: usize) -> Result<f64> {
    const RECORDS: usize = 1000;
    let event = stream.device().new_event()?;
    let mut us = Vec::with_capacity(samples);
    for _ in 0..samples {
        let t = Instant::now();
        for _ in 0..RECORDS {
            stream.record(&event)?;
        }
        us.push(t.elapsed().as_secs_f64() * 1e6 / RECORDS as f64);
        stream.synchronize()?;
    }
    Ok(Stats::from_samples(&mut us)?.median)
}
