//! Telemetry: GPU-timed spans, the Chrome-trace timeline, Prometheus metrics and the NVML
//! sampler. Above `ops`/`exec`; the floors below report through the `metrics` facade and
//! the device floor's [`activity`](crate::device::activity) hook, which this module drains.
//!
//! - [`span`]: `let _s = telemetry::span("moe.router", &stream);` — host time, GPU events on
//!   the stream (at most one per boundary, shared with the neighbouring spans' boundaries
//!   where they mark the same point; resolved lazily, never by synchronising on the hot
//!   path), the pool's bytes in use at open and close, an NVTX range with the `nvtx`
//!   feature. Off by default: `WARPDRIVE_PROFILE=1` or [`set_enabled`] turns it on; when off
//!   a span costs one branch.
//! - [`start_trace`] / [`finish_trace`]: spans, kernel launches and copies as a [`Trace`]
//!   that exports Chrome trace JSON (opens in Perfetto).
//! - `serve_prometheus`: the metrics on an HTTP endpoint (loopback unless told otherwise);
//!   with the `prometheus` cargo feature (on by default).
//! - `Sampler`: NVML readings into gauges and trace counter tracks; with the `nvml` cargo
//!   feature (on by default).
//!
//! Without a feature its API is absent (not a stub that fails at run time), so a build
//! that needs it fails to compile instead of at run time.

#[cfg(feature = "nvml")]
mod nvml;
#[cfg(feature = "prometheus")]
mod prometheus;
mod span;
mod trace;

use std::sync::atomic::{AtomicU8, Ordering};

#[cfg(feature = "nvml")]
pub use nvml::{NvmlReading, Sampler};
#[cfg(feature = "prometheus")]
pub use prometheus::{
    prometheus_upkeep, render_prometheus, serve_prometheus, serve_prometheus_with, EndpointLimits,
    PrometheusServer,
};
pub use span::{
    capture_spans, collect_spans, discard_spans, gpu_events_recorded, span, GpuTime, PendingGpu,
    Span, SpanRecord, SHARE_WINDOW,
};
pub use trace::{finish_trace, start_trace, Trace};
pub(crate) use trace::{host_us, is_tracing, push_track_slice};

/// The environment variable that turns spans on (`1`, `true`, `on`).
pub const PROFILE_ENV: &str = "WARPDRIVE_PROFILE";

const UNSET: u8 = 0;
const OFF: u8 = 1;
const ON: u8 = 2;
static STATE: AtomicU8 = AtomicU8::new(UNSET);

/// True when spans record (the environment decides until [`set_enabled`] is called).
#[inline]
pub fn enabled() -> bool {
    match STATE.load(Ordering::Relaxed) {
        ON => true,
        OFF => false,
        _ => init_from_env(),
    }
}

#[cold]
fn init_from_env() -> bool {
    let on = std::env::var(PROFILE_ENV)
        .map(|v| matches!(v.trim(), "1" | "true" | "on" | "yes"))
        .unwrap_or(false);
    // Only the first reader decides; an explicit `set_enabled` meanwhile wins.
    let _ = STATE.compare_exchange(
        UNSET,
        if on { ON } else { OFF },
        Ordering::Relaxed,
        Ordering::Relaxed,
    );
    STATE.load(Ordering::Relaxed) == ON
}

/// Turns spans on or off for the whole process.
pub fn set_enabled(on: bool) {
    STATE.store(if on { ON } else { OFF }, Ordering::Relaxed);
}
