//! The allocation profiler: opt-in recording of every [`Buffer`](super::Buffer) allocation
//! and free from a device pool (tag, bytes, stream, time), a JSON [`snapshot`], and a
//! [`report`](Snapshot::report) with totals by tag, the peak, size percentiles and fragmentation.
//!
//! Recording is off by default and costs one relaxed atomic load per allocation then. When
//! on, each event is pushed to a per-thread buffer behind its own (uncontended) lock, so
//! recording takes tens of nanoseconds; [`snapshot`] gathers every thread's buffer. The tag
//! defaults to the source file of the code that allocated (`#[track_caller]`).

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Instant;

use parking_lot::Mutex;
use serde::Serialize;

use super::PoolStats;

static RECORDING: AtomicBool = AtomicBool::new(false);

/// Every thread's event buffer, for [`snapshot`].
static BUFFERS: Mutex<Vec<Arc<Mutex<Vec<AllocEvent>>>>> = Mutex::new(Vec::new());

thread_local! {
    static LOCAL: Arc<Mutex<Vec<AllocEvent>>> = {
        let buf = Arc::new(Mutex::new(Vec::new()));
        BUFFERS.lock().push(buf.clone());
        buf
    };
}

fn epoch() -> Instant {
    static EPOCH: OnceLock<Instant> = OnceLock::new();
    *EPOCH.get_or_init(Instant::now)
}

/// Turns recording on (events from now on are kept until [`clear`]).
pub fn start_recording() {
    epoch();
    RECORDING.store(true, Ordering::Release);
}

/// Turns recording off; what was recorded stays.
pub fn stop_recording() {
    RECORDING.store(false, Ordering::Release);
}

pub fn is_recording() -> bool {
    RECORDING.load(Ordering::Relaxed)
}

/// Drops every recorded event.
pub fn clear() {
    for buf in BUFFERS.lock().iter() {
        buf.lock().clear();
    }
}

/// One allocation or free.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct AllocEvent {
    /// Nanoseconds since recording first started in this process.
    pub t_ns: u64,
    /// True for an allocation, false for a free.
    pub alloc: bool,
    /// Who allocated (the source file by default); a free carries its allocation's tag.
    pub tag: &'static str,
    /// Requested bytes.
    pub bytes: u64,
    /// The stream the buffer was allocated on.
    pub stream: u64,
    /// The address (pairs a free with its allocation).
    pub ptr: u64,
}

/// Records an event when recording is on.
#[inline]
pub(crate) fn record(alloc: bool, tag: &'static str, bytes: usize, stream: u64, ptr: u64) {
    if !is_recording() {
        return;
    }
    let event = AllocEvent {
        t_ns: epoch().elapsed().as_nanos() as u64,
        alloc,
        tag,
        bytes: bytes as u64,
        stream,
        ptr,
    };
    // `try_with`: a thread being torn down records nothing rather than panicking.
    let _ = LOCAL.try_with(|buf| buf.lock().push(event));
}

/// Every recorded event, oldest first.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Snapshot {
    pub events: Vec<AllocEvent>,
}

/// The events recorded so far by every thread, in time order.
pub fn snapshot() -> Snapshot {
    let mut events: Vec<AllocEvent> = BUFFERS
        .lock()
        .iter()
        .flat_map(|b| b.lock().clone())
        .collect();
    events.sort_by_key(|e| e.t_ns);
    Snapshot { events }
}

impl Snapshot {
    pub fn to_json(&self) -> String {
        serde_json::to_string(self).unwrap_or_else(|e| format!("{{\"error\":\"{e}\"}}"))
    }

    /// Totals by tag, peak, size percentiles; fragmentation from `pool` when given.
    pub fn report(&self, pool: Option<&PoolStats>) -> Report {
        let mut tags: HashMap<&'static str, TagTotals> = HashMap::new();
        let (mut live, mut peak) = (0u64, 0u64);
        let mut sizes = Vec::new();
        for e in &self.events {
            let t = tags.entry(e.tag).or_insert_with(|| TagTotals {
                tag: e.tag,
                ..TagTotals::default()
            });
            if e.alloc {
                t.allocations += 1;
                t.bytes += e.bytes;
                t.live_bytes += e.bytes;
                t.peak_live_bytes = t.peak_live_bytes.max(t.live_bytes);
                live += e.bytes;
                peak = peak.max(live);
                sizes.push(e.bytes);
            } else {
                t.frees += 1;
                t.live_bytes = t.live_bytes.saturating_sub(e.bytes);
                live = live.saturating_sub(e.bytes);
            }
        }
        sizes.sort_unstable();
        let pct = |p: f64| -> u64 {
            if sizes.is_empty() {
                return 0;
            }
            let i = ((sizes.len() - 1) as f64 * p).round() as usize;
            sizes[i.min(sizes.len() - 1)]
        };
        let mut by_tag: Vec<TagTotals> = tags.into_values().collect();
        by_tag.sort_by(|a, b| b.live_bytes.cmp(&a.live_bytes).then(b.bytes.cmp(&a.bytes)));
        Report {
            allocations: by_tag.iter().map(|t| t.allocations).sum(),
            frees: by_tag.iter().map(|t| t.frees).sum(),
            live_bytes: live,
            peak_live_bytes: peak,
            size_p50: pct(0.5),
            size_p90: pct(0.9),
            size_p99: pct(0.99),
            size_max: sizes.last().copied().unwrap_or(0),
            fragmentation: pool.map(|s| s.fragmentation),
            reserved_over_live: pool
                .filter(|s| s.in_use > 0)
                .map(|s| s.reserved as f64 / s.in_use as f64),
            by_tag,
        }
    }
}

/// What one tag allocated.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct TagTotals {
    pub tag: &'static str,
    pub allocations: u64,
    pub frees: u64,
    /// Requested bytes over all allocations.
    pub bytes: u64,
    pub live_bytes: u64,
    pub peak_live_bytes: u64,
}

/// The profiler's summary of a [`Snapshot`].
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Report {
    pub allocations: u64,
    pub frees: u64,
    /// Requested bytes allocated and not freed.
    pub live_bytes: u64,
    pub peak_live_bytes: u64,
    pub size_p50: u64,
    pub size_p90: u64,
    pub size_p99: u64,
    pub size_max: u64,
    /// The pool's `1 − largest_free / total_free`, when its stats were given.
    pub fragmentation: Option<f64>,
    /// The pool's reserved bytes over its bytes in use, when given.
    pub reserved_over_live: Option<f64>,
    /// Largest live bytes first.
    pub by_tag: Vec<TagTotals>,
}

/// "tag (N bytes live), ..." for the `n` tags holding the most, when recording is on.
pub(crate) fn top_tags(n: usize) -> Option<String> {
    if !is_recording() {
        return None;
    }
    let report = snapshot().report(None);
    let tags: Vec<String> = report
        .by_tag
        .iter()
        .take(n)
        .map(|t| format!("{} ({} bytes live)", t.tag, t.live_bytes))
        .collect();
    Some(tags.join(", "))
}
