//! The timeline: spans (host thread tracks and one GPU track per stream), warpdrive's kernel
//! launches and copies (on the host thread that enqueued them), and NVML counter tracks, as
//! Chrome trace JSON (`chrome://tracing`, Perfetto).

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use crossbeam_queue::SegQueue;
use serde_json::{json, Value};

use super::span::{collect_spans, thread_id, us_since_epoch, GpuTime, SpanRecord};
use crate::device::activity::{self, Activity};
use crate::error::{Error, Result};

/// One enqueue call of the device floor, with the thread that made it.
struct HostActivity {
    thread: u64,
    thread_name: Option<Arc<str>>,
    activity: Activity,
}

static ACTIVITIES: SegQueue<HostActivity> = SegQueue::new();
/// Activities kept per trace: a benchmark of launch cost makes millions; the first ones
/// show the pattern and keep the file openable.
const MAX_ACTIVITIES: usize = 200_000;
static KEPT: AtomicUsize = AtomicUsize::new(0);
static COUNTERS: SegQueue<(&'static str, f64, f64)> = SegQueue::new();
/// Slices of the workloads' own tracks (one per actor): track, name, start, duration, args.
static TRACKS: SegQueue<TrackSlice> = SegQueue::new();
static TRACING: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

struct TrackSlice {
    track: String,
    name: &'static str,
    ts_us: f64,
    dur_us: f64,
    args: Value,
}

/// True between [`start_trace`] and [`finish_trace`].
pub(crate) fn is_tracing() -> bool {
    TRACING.load(Ordering::Relaxed)
}

/// Adds a slice to `track`, a timeline of its own (an actor's), at `ts_us` on the trace's
/// clock ([`host_us`]) lasting `dur_us`; kept only while a trace is recorded.
pub(crate) fn push_track_slice(
    track: &str,
    name: &'static str,
    ts_us: f64,
    dur_us: f64,
    args: Value,
) {
    if is_tracing() && KEPT.fetch_add(1, Ordering::Relaxed) < MAX_ACTIVITIES {
        TRACKS.push(TrackSlice {
            track: track.to_string(),
            name,
            ts_us,
            dur_us,
            args,
        });
    }
}

/// `t` on the trace's clock: µs since the process's telemetry epoch.
pub(crate) fn host_us(t: std::time::Instant) -> f64 {
    us_since_epoch(t)
}

fn sink(activity: Activity) {
    if KEPT.fetch_add(1, Ordering::Relaxed) >= MAX_ACTIVITIES {
        return;
    }
    let (thread, thread_name) = thread_id();
    ACTIVITIES.push(HostActivity {
        thread,
        thread_name,
        activity,
    });
}

/// Adds a counter sample (`name` = value at `ts_us` since the epoch) to the timeline (the
/// NVML sampler's readings).
#[cfg(feature = "nvml")]
pub(crate) fn push_counter(name: &'static str, ts_us: f64, value: f64) {
    COUNTERS.push((name, ts_us, value));
}

/// Starts recording a timeline: turns spans on and has the device floor report its launches
/// and copies. Records left from before are discarded.
pub fn start_trace() {
    activity::set_sink(sink);
    super::set_enabled(true);
    drop(collect_spans(false));
    while ACTIVITIES.pop().is_some() {}
    while COUNTERS.pop().is_some() {}
    while TRACKS.pop().is_some() {}
    KEPT.store(0, Ordering::Relaxed);
    activity::set_recording(true);
    TRACING.store(true, Ordering::Relaxed);
}

/// Stops recording and returns the timeline, waiting for the GPU times of open spans.
pub fn finish_trace() -> Trace {
    activity::set_recording(false);
    TRACING.store(false, Ordering::Relaxed);
    let spans = collect_spans(true);
    let mut activities = Vec::new();
    while let Some(a) = ACTIVITIES.pop() {
        activities.push(a);
    }
    let mut counters = Vec::new();
    while let Some(c) = COUNTERS.pop() {
        counters.push(c);
    }
    let mut tracks = Vec::new();
    while let Some(t) = TRACKS.pop() {
        tracks.push(t);
    }
    Trace::build(&spans, &activities, &counters, &tracks)
}

/// A recorded timeline.
#[derive(Debug, Clone)]
pub struct Trace {
    events: Vec<Value>,
}

const HOST_PID: u64 = 1;
const GPU_PID: u64 = 2;
const COUNTER_PID: u64 = 3;
const TRACK_PID: u64 = 4;

/// A complete slice on one track.
struct Slice {
    pid: u64,
    tid: u64,
    name: String,
    ts: f64,
    dur: f64,
    args: Value,
}

impl Trace {
    fn build(
        spans: &[SpanRecord],
        activities: &[HostActivity],
        counters: &[(&'static str, f64, f64)],
        tracks: &[TrackSlice],
    ) -> Trace {
        let mut slices = Vec::new();
        let mut threads: BTreeMap<u64, String> = BTreeMap::new();
        let mut streams: BTreeMap<u64, ()> = BTreeMap::new();
        for s in spans {
            threads
                .entry(s.thread)
                .or_insert_with(|| thread_label(s.thread, &s.thread_name));
            let args = json!({
                "stream": s.stream,
                "pool_in_use_open": s.pool_in_use_open,
                "pool_in_use_close": s.pool_in_use_close,
                "gpu_us": s.gpu_us(),
            });
            slices.push(Slice {
                pid: HOST_PID,
                tid: s.thread,
                name: s.name.to_string(),
                ts: s.host_start_us,
                dur: s.host_end_us - s.host_start_us,
                args: args.clone(),
            });
            if let GpuTime::Done { start_us, end_us } = s.gpu {
                streams.insert(s.stream, ());
                slices.push(Slice {
                    pid: GPU_PID,
                    tid: s.stream,
                    name: s.name.to_string(),
                    ts: start_us,
                    dur: end_us - start_us,
                    args,
                });
            }
        }
        for a in activities {
            threads
                .entry(a.thread)
                .or_insert_with(|| thread_label(a.thread, &a.thread_name));
            let start = us_since_epoch(a.activity.start);
            slices.push(Slice {
                pid: HOST_PID,
                tid: a.thread,
                name: a.activity.kind.name().to_string(),
                ts: start,
                dur: us_since_epoch(a.activity.end) - start,
                args: json!({ "cu_stream": format!("{:#x}", a.activity.cu_stream),
                              "bytes": a.activity.bytes }),
            });
        }
        let mut track_ids: BTreeMap<&str, u64> = BTreeMap::new();
        for t in tracks {
            let next = track_ids.len() as u64 + 1;
            let tid = *track_ids.entry(t.track.as_str()).or_insert(next);
            slices.push(Slice {
                pid: TRACK_PID,
                tid,
                name: t.name.to_string(),
                ts: t.ts_us,
                dur: t.dur_us,
                args: t.args.clone(),
            });
        }
        let mut events = vec![
            meta(HOST_PID, None, "process_name", "host"),
            meta(GPU_PID, None, "process_name", "GPU streams (span events)"),
        ];
        for (tid, name) in &threads {
            events.push(meta(HOST_PID, Some(*tid), "thread_name", name));
        }
        for tid in streams.keys() {
            events.push(meta(
                GPU_PID,
                Some(*tid),
                "thread_name",
                &format!("stream #{tid}"),
            ));
        }
        if !counters.is_empty() {
            events.push(meta(COUNTER_PID, None, "process_name", "NVML"));
        }
        if !track_ids.is_empty() {
            events.push(meta(TRACK_PID, None, "process_name", "actors"));
        }
        for (name, tid) in &track_ids {
            events.push(meta(TRACK_PID, Some(*tid), "thread_name", name));
        }
        events.extend(nest(slices).into_iter().map(|s| {
            json!({ "name": s.name, "ph": "X", "pid": s.pid, "tid": s.tid,
                    "ts": s.ts, "dur": s.dur, "args": s.args })
        }));
        events.extend(counters.iter().map(|(name, ts, v)| {
            json!({ "name": name, "ph": "C", "pid": COUNTER_PID, "tid": 0, "ts": ts,
                    "args": { "value": v } })
        }));
        Trace { events }
    }

    /// The trace events (Chrome trace "JSON object format").
    pub fn to_json(&self) -> Value {
        json!({ "traceEvents": self.events, "displayTimeUnit": "ms" })
    }

    /// Writes the Chrome trace JSON to `path` atomically (see
    /// [`crate::files::write_atomic`]), creating missing parent folders.
    pub fn write(&self, path: impl AsRef<Path>) -> Result<()> {
        let text = serde_json::to_string(&self.to_json())
            .map_err(|e| Error::InvalidArgument(format!("trace serialisation failed: {e}")))?;
        crate::files::write_atomic(path.as_ref(), text.as_bytes())
    }

    /// The number of complete slices.
    pub fn slices(&self) -> usize {
        self.events.iter().filter(|e| e["ph"] == "X").count()
    }
}

fn thread_label(id: u64, name: &Option<Arc<str>>) -> String {
    match name {
        Some(n) => format!("{n} (#{id})"),
        None => format!("thread #{id}"),
    }
}

fn meta(pid: u64, tid: Option<u64>, kind: &str, name: &str) -> Value {
    json!({ "name": kind, "ph": "M", "pid": pid, "tid": tid.unwrap_or(0),
            "args": { "name": name } })
}

/// Makes the slices of each track nest: sorted by start (longer first on ties), a slice that
/// starts inside another but ends after it is clipped to its end (two threads' spans on one
/// stream can overlap partially; Chrome's viewer needs a stack per track).
fn nest(mut slices: Vec<Slice>) -> Vec<Slice> {
    slices.sort_by(|a, b| {
        (a.pid, a.tid)
            .cmp(&(b.pid, b.tid))
            .then(a.ts.total_cmp(&b.ts))
            .then(b.dur.total_cmp(&a.dur))
    });
    let mut stack: Vec<(u64, u64, f64)> = Vec::new();
    for s in &mut slices {
        s.dur = s.dur.max(0.0);
        while let Some(&(pid, tid, end)) = stack.last() {
            if (pid, tid) != (s.pid, s.tid) || end <= s.ts {
                stack.pop();
            } else {
                break;
            }
        }
        if let Some(&(_, _, end)) = stack.last() {
            if s.ts + s.dur > end {
                s.dur = end - s.ts;
                if let Value::Object(m) = &mut s.args {
                    m.insert("clipped".into(), Value::Bool(true));
                }
            }
        }
        stack.push((s.pid, s.tid, s.ts + s.dur));
    }
    slices
}

#[cfg(test)]
mod tests {
    use super::*;

    fn slice(tid: u64, ts: f64, dur: f64) -> Slice {
        Slice {
            pid: GPU_PID,
            tid,
            name: String::new(),
            ts,
            dur,
            args: json!({}),
        }
    }

    #[test]
    fn partial_overlaps_are_clipped_per_track() {
        // On track 7: [0, 10) and [5, 15) overlap partially; [2, 3) nests in the first.
        // Track 8's slice is left alone.
        let out = nest(vec![
            slice(7, 5.0, 10.0),
            slice(8, 1.0, 100.0),
            slice(7, 0.0, 10.0),
            slice(7, 2.0, 1.0),
        ]);
        let got: Vec<(u64, f64, f64)> = out.iter().map(|s| (s.tid, s.ts, s.dur)).collect();
        assert_eq!(
            got,
            [
                (7, 0.0, 10.0),
                (7, 2.0, 1.0),
                (7, 5.0, 5.0),
                (8, 1.0, 100.0)
            ]
        );
        assert_eq!(out[2].args["clipped"], true);
    }
}
