//! What the device floor did — copies, kernel launches, graph replays — counted through the
//! `metrics` facade (a no-op until a recorder is installed) and, while a timeline records,
//! handed to the sink that `telemetry` installs. The floors below `telemetry` report here;
//! nothing here imports upward.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::OnceLock;
use std::time::Instant;

/// A kind of device-floor activity.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ActivityKind {
    H2D,
    D2H,
    D2D,
    Launch,
    GraphLaunch,
}

impl ActivityKind {
    /// The slice name in a timeline.
    pub fn name(self) -> &'static str {
        match self {
            ActivityKind::H2D => "copy h2d",
            ActivityKind::D2H => "copy d2h",
            ActivityKind::D2D => "copy d2d",
            ActivityKind::Launch => "kernel launch",
            ActivityKind::GraphLaunch => "graph launch",
        }
    }
}

/// One enqueue call on the host: when it started and ended, on which driver stream, and the
/// bytes it moved (0 for launches).
#[derive(Debug, Clone, Copy)]
pub struct Activity {
    pub kind: ActivityKind,
    pub start: Instant,
    pub end: Instant,
    /// The driver's stream handle (an address), to tell streams apart.
    pub cu_stream: u64,
    pub bytes: u64,
}

static SINK: OnceLock<fn(Activity)> = OnceLock::new();
static RECORDING: AtomicBool = AtomicBool::new(false);

/// Installs the function that receives activities while recording (once per process; later
/// calls keep the first sink).
pub fn set_sink(sink: fn(Activity)) {
    let _ = SINK.set(sink);
}

/// Starts or stops handing activities to the sink.
pub fn set_recording(on: bool) {
    RECORDING.store(on, Ordering::Relaxed);
}

/// The start instant when a timeline is recording (one relaxed load otherwise).
#[inline]
pub(crate) fn begin() -> Option<Instant> {
    RECORDING.load(Ordering::Relaxed).then(Instant::now)
}

/// Counts the activity and hands it to the sink if [`begin`] said to record.
#[inline]
pub(crate) fn end(started: Option<Instant>, kind: ActivityKind, cu_stream: u64, bytes: u64) {
    match kind {
        ActivityKind::H2D => metrics::counter!("warpdrive_h2d_bytes_total").increment(bytes),
        ActivityKind::D2H => metrics::counter!("warpdrive_d2h_bytes_total").increment(bytes),
        ActivityKind::D2D => metrics::counter!("warpdrive_d2d_bytes_total").increment(bytes),
        ActivityKind::Launch => metrics::counter!("warpdrive_kernel_launches_total").increment(1),
        ActivityKind::GraphLaunch => {
            metrics::counter!("warpdrive_graph_replays_total").increment(1)
        }
    }
    if let (Some(start), Some(sink)) = (started, SINK.get()) {
        sink(Activity {
            kind,
            start,
            end: Instant::now(),
            cu_stream,
            bytes,
        });
    }
}
