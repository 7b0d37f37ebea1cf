//! Telemetry: spans (order, unwinding, disabled), the Chrome trace (parses, nests per
//! track), the Prometheus endpoint on loopback, NVML absent, and on a GPU: span times
//! present, positive and ordered with the stream's work, and spans inside a graph capture.
//! (The HTML report's tests live with the harness: `warpdrive-bench/tests/report.rs`.)
//!
//! Telemetry state is process-wide: the tests take one lock and use their own span names.

mod common;

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::sync::{Mutex, MutexGuard};
use std::time::Duration;

use common::{cuda, random_f32, rng, seed};
use serde_json::Value;
use warpdrive::exec::{run_with_backoff, Graph};
use warpdrive::telemetry::{self, GpuTime, Sampler, SpanRecord};
use warpdrive::{ops, Buffer, Device, Error, Stream};

fn lock() -> MutexGuard<'static, ()> {
    static LOCK: Mutex<()> = Mutex::new(());
    LOCK.lock().unwrap_or_else(|e| e.into_inner())
}

fn named<'a>(spans: &'a [SpanRecord], name: &str) -> Vec<&'a SpanRecord> {
    spans.iter().filter(|s| s.name == name).collect()
}

#[test]
fn disabled_spans_record_nothing() {
    let _g = lock();
    telemetry::set_enabled(false);
    let s = Device::cpu().new_stream().unwrap();
    {
        let span = telemetry::span("t.disabled", &s);
        assert!(!span.is_recording());
    }
    assert!(named(&telemetry::collect_spans(true), "t.disabled").is_empty());
}

#[test]
fn captured_spans_stay_with_their_caller() {
    let _g = lock();
    telemetry::set_enabled(false);
    let s = Device::cpu().new_stream().unwrap();
    let (inner, outer) = telemetry::capture_spans(|| {
        let a = telemetry::span("t.captured.a", &s);
        assert!(a.is_recording(), "a capture records with telemetry off");
        drop(a);
        // A nested capture takes its own spans.
        let ((), inner) = telemetry::capture_spans(|| {
            drop(telemetry::span("t.captured.inner", &s));
            Ok(())
        })?;
        drop(telemetry::span("t.captured.b", &s));
        Ok(inner)
    })
    .unwrap();
    let names = |v: &[SpanRecord]| v.iter().map(|r| r.name).collect::<Vec<_>>();
    assert_eq!(names(&outer), ["t.captured.a", "t.captured.b"]);
    assert_eq!(names(&inner), ["t.captured.inner"]);
    assert!(outer.iter().all(|r| matches!(r.gpu, GpuTime::None)));
    // Nothing reached the global queue, and spans are off again after the capture.
    assert!(telemetry::collect_spans(true)
        .iter()
        .all(|r| !r.name.starts_with("t.captured.")));
    assert!(!telemetry::span("t.captured.after", &s).is_recording());
    // An error from the body is returned, the capture ended all the same.
    let r = telemetry::capture_spans(|| -> warpdrive::Result<()> {
        Err(Error::InvalidArgument("t".into()))
    });
    assert!(matches!(r, Err(Error::InvalidArgument(_))));
    assert!(!telemetry::span("t.captured.after", &s).is_recording());
}

#[test]
fn spans_close_in_order_also_when_unwinding() {
    let _g = lock();
    telemetry::set_enabled(true);
    let s = Device::cpu().new_stream().unwrap();
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        let _outer = telemetry::span("t.unwind.outer", &s);
        let _inner = telemetry::span("t.unwind.inner", &s);
        panic!("unwinding through two spans");
    }));
    assert!(r.is_err());
    {
        let _a = telemetry::span("t.order.a", &s);
        let _b = telemetry::span("t.order.b", &s);
    }
    telemetry::set_enabled(false);
    let spans = telemetry::collect_spans(true);
    for (outer, inner) in [
        ("t.unwind.outer", "t.unwind.inner"),
        ("t.order.a", "t.order.b"),
    ] {
        let (o, i) = (named(&spans, outer), named(&spans, inner));
        assert_eq!((o.len(), i.len()), (1, 1), "{outer} {inner}");
        let (o, i) = (o[0], i[0]);
        assert!(i.close_seq < o.close_seq, "inner closes first");
        assert_eq!(i.depth, o.depth + 1);
        assert!(o.host_start_us <= i.host_start_us && i.host_end_us <= o.host_end_us);
        // The CPU backend has a pool too: its bytes are read at both ends.
        assert!(o.pool_in_use_open.is_some() && o.pool_in_use_close.is_some());
        assert!(matches!(o.gpu, GpuTime::None));
    }
}

/// Checks that the `X` slices of every (pid, tid) track nest; returns slices per track.
fn check_nesting(trace: &Value) -> BTreeMap<(u64, u64), usize> {
    let mut tracks: BTreeMap<(u64, u64), Vec<(f64, f64)>> = BTreeMap::new();
    for e in trace["traceEvents"].as_array().unwrap() {
        if e["ph"] == "X" {
            let key = (e["pid"].as_u64().unwrap(), e["tid"].as_u64().unwrap());
            let ts = e["ts"].as_f64().unwrap();
            let dur = e["dur"].as_f64().unwrap();
            assert!(dur >= 0.0, "{e}");
            tracks.entry(key).or_default().push((ts, ts + dur));
        }
    }
    let mut counts = BTreeMap::new();
    for (key, mut slices) in tracks {
        slices.sort_by(|a, b| a.0.total_cmp(&b.0).then(b.1.total_cmp(&a.1)));
        let mut stack: Vec<f64> = Vec::new();
        for &(start, end) in &slices {
            while stack.last().is_some_and(|&e| e <= start) {
                stack.pop();
            }
            if let Some(&parent_end) = stack.last() {
                assert!(end <= parent_end, "track {key:?}: partial overlap");
            }
            stack.push(end);
        }
        counts.insert(key, slices.len());
    }
    counts
}

/// Nested spans on two streams from two threads, some work inside; returns the trace.
fn tempdir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("warpdrive-test-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn traced_run(dev: &Device) -> telemetry::Trace {
    let mut r = rng(seed("traced_run"));
    let x = random_f32(&mut r, (1 << 20) + 3);
    telemetry::start_trace();
    std::thread::scope(|scope| {
        for name in ["t.trace.stream-a", "t.trace.stream-b"] {
            let dev = dev.clone();
            let x = &x;
            scope.spawn(move || {
                let s = dev.new_stream().unwrap();
                let _outer = telemetry::span(name, &s);
                let a = Buffer::from_host(&s, x).unwrap();
                let mut y = Buffer::from_host(&s, x).unwrap();
                for _ in 0..3 {
                    let _inner = telemetry::span("t.trace.axpy", &s);
                    ops::axpy(&s, 0.5f32, &a, &mut y).unwrap();
                }
                let _sum = telemetry::span("t.trace.sum", &s);
                assert!(ops::sum_to_host(&s, &y).unwrap().is_finite());
            });
        }
    });
    let trace = telemetry::finish_trace();
    telemetry::set_enabled(false);
    trace
}

#[test]
fn chrome_trace_parses_and_nests_per_track() {
    let _g = lock();
    let trace = traced_run(&Device::cpu());
    let dir = tempdir("trace");
    let path = dir.join("trace.json");
    trace.write(&path).unwrap();
    let parsed: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    let counts = check_nesting(&parsed);
    // Two host threads, each with 1 + 3 + 1 spans (the CPU backend has no GPU tracks).
    let host: Vec<usize> = counts
        .iter()
        .filter(|((pid, _), _)| *pid == 1)
        .map(|(_, n)| *n)
        .collect();
    assert_eq!(host.len(), 2, "{counts:?}");
    assert!(host.iter().all(|&n| n >= 5), "{counts:?}");
    let names: Vec<&str> = parsed["traceEvents"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["ph"] == "M")
        .filter_map(|e| e["args"]["name"].as_str())
        .collect();
    assert!(names.contains(&"host"), "{names:?}");
}

fn http_get(addr: SocketAddr) -> String {
    let mut c = TcpStream::connect(addr).unwrap();
    c.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    write!(c, "GET /metrics HTTP/1.1\r\nHost: localhost\r\n\r\n").unwrap();
    let mut out = String::new();
    c.read_to_string(&mut out).unwrap();
    out
}

#[test]
fn prometheus_endpoint_answers_on_loopback() {
    let _g = lock();
    let server = telemetry::serve_prometheus(Some("127.0.0.1:0".parse().unwrap())).unwrap();
    assert!(server.addr.ip().is_loopback() && server.addr.port() != 0);
    // Something for each family: a span (histogram), pool stats (gauges), an OOM retry.
    telemetry::set_enabled(true);
    let s = Device::cpu().new_stream().unwrap();
    drop(telemetry::span("t.prometheus", &s));
    telemetry::set_enabled(false);
    drop(telemetry::collect_spans(true));
    let _ = Buffer::<f32>::zeros(&s, 1000).unwrap();
    warpdrive::memory::device_pool(&Device::cpu())
        .unwrap()
        .stats()
        .unwrap();
    let r = run_with_backoff(8, 1, |b| {
        if b == 8 {
            Err(Error::OutOfMemory {
                requested: 1,
                detail: "test".into(),
            })
        } else {
            Ok(b)
        }
    })
    .unwrap();
    assert_eq!(r.value, 4);
    let body = http_get(server.addr);
    assert!(body.starts_with("HTTP/1.1 200"), "{body}");
    for name in [
        "warpdrive_span_seconds_bucket",
        "warpdrive_pool_in_use_bytes",
        "warpdrive_pool_reserved_bytes",
        "warpdrive_pool_peak_in_use_bytes",
        "warpdrive_oom_retries_total",
    ] {
        assert!(body.contains(name), "{name} missing from:\n{body}");
    }
    assert!(body.contains("span=\"t.prometheus\""), "{body}");
    // The default address is loopback too.
    if let Ok(s) = telemetry::serve_prometheus(None) {
        assert!(s.addr.ip().is_loopback());
    }
}

#[test]
fn nvml_absent_says_unavailable() {
    let r = Sampler::start_with_library(
        Path::new("/nonexistent/libnvidia-ml.so.1"),
        0,
        Duration::from_millis(10),
    );
    assert!(
        matches!(&r, Err(Error::LibraryMissing { library: "nvml", hint }) if hint.contains("unavailable")),
        "{r:?}"
    );
    // Without a GPU the real library (if any) finds no device: unavailable, no panic.
    if Device::cuda_count() == 0 {
        assert!(Sampler::start(0, Duration::from_millis(10)).is_err());
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_span_times_are_present_positive_and_ordered() {
    let _g = lock();
    let dev = cuda();
    let s = dev.new_stream().unwrap();
    let mut r = rng(seed("gpu_span_times"));
    let x = Buffer::from_host(&s, &random_f32(&mut r, (1 << 24) + 3)).unwrap();
    let mut y = Buffer::from_host(&s, &random_f32(&mut r, (1 << 24) + 3)).unwrap();
    telemetry::set_enabled(true);
    {
        let _first = telemetry::span("t.gpu.first", &s);
        for _ in 0..4 {
            let _inner = telemetry::span("t.gpu.inner", &s);
            ops::axpy(&s, 0.5f32, &x, &mut y).unwrap();
        }
    }
    {
        let _second = telemetry::span("t.gpu.second", &s);
        ops::axpy(&s, 0.5f32, &x, &mut y).unwrap();
    }
    telemetry::set_enabled(false);
    let spans = telemetry::collect_spans(true);
    let gpu = |name: &str| -> Vec<(f64, f64)> {
        named(&spans, name)
            .iter()
            .map(|s| gpu_interval(s))
            .collect()
    };
    let (first, second, inner) = (
        gpu("t.gpu.first")[0],
        gpu("t.gpu.second")[0],
        gpu("t.gpu.inner"),
    );
    assert_eq!(inner.len(), 4);
    // Each axpy over 2 × 64 MiB takes microseconds at least.
    for (a, b) in inner.iter().chain([&first, &second]) {
        assert!(b - a > 0.0, "{a} {b}");
    }
    let eps = 1.0; // µs: events are resolved to about half a microsecond.
    for w in inner.windows(2) {
        assert!(w[0].1 <= w[1].0 + eps, "inner spans in stream order: {w:?}");
    }
    assert!(first.0 <= inner[0].0 + eps && inner[3].1 <= first.1 + eps);
    assert!(first.1 <= second.0 + eps, "{first:?} then {second:?}");
    let span = named(&spans, "t.gpu.first")[0];
    assert!(span.pool_in_use_open.unwrap() >= 2 * ((1 << 24) + 3) * 4);
}

/// The GPU interval of a resolved span.
fn gpu_interval(span: &SpanRecord) -> (f64, f64) {
    match span.gpu {
        GpuTime::Done { start_us, end_us } => (start_us, end_us),
        ref g => panic!("{}: GPU time {g:?}", span.name),
    }
}

/// Boundaries share an event only where it marks the same point: empty spans back to back
/// share, work between boundaries or an idle gap longer than the window gets a fresh event.
#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_span_boundaries_share_events_only_where_they_may() {
    let _g = lock();
    let dev = cuda();
    let s = dev.new_stream().unwrap();
    let mut r = rng(seed("gpu_span_sharing"));
    let n = (1 << 22) + 5;
    let x = Buffer::from_host(&s, &random_f32(&mut r, n)).unwrap();
    let mut y = Buffer::from_host(&s, &random_f32(&mut r, n)).unwrap();
    s.synchronize().unwrap();
    telemetry::set_enabled(true);
    let before = telemetry::gpu_events_recorded();
    for _ in 0..1000 {
        drop(telemetry::span("t.share.empty", &s));
    }
    let empty_events = telemetry::gpu_events_recorded() - before;
    for _ in 0..3 {
        let _w = telemetry::span("t.share.work", &s);
        ops::axpy(&s, 0.5f32, &x, &mut y).unwrap();
    }
    s.synchronize().unwrap();
    // The stream idle for longer than the sharing window since the last boundary (the
    // window is the condition, so the test waits on the clock for it: a microsecond).
    let idle = std::time::Instant::now();
    while idle.elapsed() <= telemetry::SHARE_WINDOW {
        std::hint::spin_loop();
    }
    let before_late = telemetry::gpu_events_recorded();
    {
        let _late = telemetry::span("t.share.late", &s);
        ops::axpy(&s, 0.5f32, &x, &mut y).unwrap();
    }
    // Both of the late span's boundaries are fresh events: its start does not reuse the last
    // span's end.
    assert_eq!(telemetry::gpu_events_recorded() - before_late, 2);
    telemetry::set_enabled(false);
    let spans = telemetry::collect_spans(true);
    eprintln!("1000 empty spans recorded {empty_events} events");
    assert!(empty_events < 2000, "no boundary shared an event");
    for e in named(&spans, "t.share.empty") {
        let (a, b) = gpu_interval(e);
        assert!(b >= a, "{a} {b}");
    }
    let work: Vec<(f64, f64)> = named(&spans, "t.share.work")
        .iter()
        .map(|s| gpu_interval(s))
        .collect();
    assert_eq!(work.len(), 3);
    for (a, b) in &work {
        assert!(
            b > a,
            "a span around an axpy has a positive GPU time: {a} {b}"
        );
    }
    let eps = 1.0;
    for w in work.windows(2) {
        assert!(w[0].1 <= w[1].0 + eps, "stream order: {w:?}");
    }
    let late = gpu_interval(named(&spans, "t.share.late")[0]);
    assert!(late.0 >= work[2].1, "{late:?} after {:?}", work[2]);
    assert!(late.1 > late.0);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_span_inside_graph_capture_does_not_break_it() {
    let _g = lock();
    let dev = cuda();
    let s = dev.new_stream().unwrap();
    let mut r = rng(seed("gpu_span_in_capture"));
    let host = random_f32(&mut r, 4099);
    let x = Buffer::from_host(&s, &host).unwrap();
    let mut y = Buffer::from_host(&s, &host).unwrap();
    telemetry::set_enabled(true);
    // A span opened before the capture, closed after it, and one inside it.
    let outer = telemetry::span("t.capture.outer", &s);
    let mut g = Graph::capture(&s, |s: &Stream| {
        let _inside = telemetry::span("t.capture.inside", s);
        ops::axpy(s, 2.0f32, &x, &mut y)
    })
    .unwrap();
    drop(outer);
    g.launch().unwrap();
    g.launch().unwrap();
    drop(g);
    telemetry::set_enabled(false);
    let out = y.to_host(&s).unwrap();
    // Captured once (not run), replayed twice: y = x + 2x + 2x.
    for (o, h) in out.iter().zip(&host) {
        assert!(
            (o - 5.0 * h).abs() <= 1e-5 * h.abs().max(1.0),
            "{o} vs {}",
            5.0 * h
        );
    }
    let spans = telemetry::collect_spans(true);
    let inside = named(&spans, "t.capture.inside");
    assert_eq!(inside.len(), 1);
    assert!(matches!(inside[0].gpu, GpuTime::None));
    assert_eq!(named(&spans, "t.capture.outer").len(), 1);
}

/// The multi-stream trace on the GPU: nests per track, has GPU stream tracks and launch and
/// copy slices; written to `WARPDRIVE_TRACE_OUT` when set (the committed example).
#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_trace_of_two_streams_nests() {
    let _g = lock();
    let dev = cuda();
    let sampler = Sampler::start(0, Duration::from_millis(5)).ok();
    let trace = traced_run(&dev);
    drop(sampler);
    let json = trace.to_json();
    let counts = check_nesting(&json);
    let gpu_tracks = counts.keys().filter(|(pid, _)| *pid == 2).count();
    assert_eq!(gpu_tracks, 2, "{counts:?}");
    let names: Vec<&str> = json["traceEvents"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["ph"] == "X")
        .filter_map(|e| e["name"].as_str())
        .collect();
    for want in ["kernel launch", "copy h2d", "copy d2h", "t.trace.axpy"] {
        assert!(names.contains(&want), "{want} missing");
    }
    if let Ok(path) = std::env::var("WARPDRIVE_TRACE_OUT") {
        trace.write(&path).unwrap();
    }
}
