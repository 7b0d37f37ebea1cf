//! RAII spans: host time, GPU start/end events and pool bytes; finished spans go to a
//! lock-free queue and their GPU times are read only when someone collects them.

use std::cell::Cell;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Instant;

use crossbeam_queue::SegQueue;
use parking_lot::Mutex;

use crate::device::{Device, Event, Stream};
use crate::exec;
use crate::memory::{device_pool, DevicePool};

/// Where a span's GPU time stands.
pub enum GpuTime {
    /// No GPU time: the CPU backend, a span opened during a graph capture, or no events.
    None,
    /// Events recorded; the GPU has not been asked yet.
    Pending {
        clock: &'static DeviceClock,
        start: Event,
        end: Event,
    },
    /// Microseconds since the process epoch (the same clock as the host times).
    Done { start_us: f64, end_us: f64 },
}

impl std::fmt::Debug for GpuTime {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            GpuTime::None => write!(f, "None"),
            GpuTime::Pending { .. } => write!(f, "Pending"),
            GpuTime::Done { start_us, end_us } => write!(f, "Done({start_us}..{end_us})"),
        }
    }
}

/// A closed span.
#[derive(Debug)]
pub struct SpanRecord {
    pub name: &'static str,
    /// The host thread that opened it (small numbers, per process).
    pub thread: u64,
    pub thread_name: Option<String>,
    /// [`Stream::id`] of the span's stream.
    pub stream: u64,
    /// Microseconds since the process epoch.
    pub host_start_us: f64,
    pub host_end_us: f64,
    /// Spans open on this thread when it opened (0 at the top).
    pub depth: u32,
    /// Order of closing, process-wide.
    pub close_seq: u64,
    /// The device pool's bytes in use at open and at close (`None` when unknown).
    pub pool_in_use_open: Option<u64>,
    pub pool_in_use_close: Option<u64>,
    pub gpu: GpuTime,
}

impl SpanRecord {
    /// The GPU duration in microseconds, once resolved.
    pub fn gpu_us(&self) -> Option<f64> {
        match self.gpu {
            GpuTime::Done { start_us, end_us } => Some(end_us - start_us),
            _ => None,
        }
    }
}

/// An open span; it closes when dropped (also while unwinding from a panic).
#[must_use = "a span closes when dropped: bind it with `let _s = ...`"]
pub struct Span {
    /// Boxed so a disabled span is one null pointer.
    open: Option<Box<Open>>,
}

struct Open {
    name: &'static str,
    stream: Stream,
    host_start: Instant,
    depth: u32,
    pool: Option<&'static Arc<DevicePool>>,
    pool_in_use_open: Option<u64>,
    /// The start event (recorded) and the device state its end event comes from.
    gpu: Option<(Event, &'static DeviceClock)>,
}

/// Opens a span named `name` on `stream` (a no-op costing one branch while telemetry is off).
#[inline]
pub fn span(name: &'static str, stream: &Stream) -> Span {
    if !super::enabled() {
        return Span { open: None };
    }
    Span {
        open: Some(Box::new(open(name, stream))),
    }
}

impl Span {
    /// True when this span records (telemetry was on when it opened).
    pub fn is_recording(&self) -> bool {
        self.open.is_some()
    }
}

impl Drop for Span {
    #[inline]
    fn drop(&mut self) {
        if let Some(open) = self.open.take() {
            close(*open);
        }
    }
}

static SPANS: SegQueue<SpanRecord> = SegQueue::new();
static CLOSE_SEQ: AtomicU64 = AtomicU64::new(0);

thread_local! {
    static DEPTH: Cell<u32> = const { Cell::new(0) };
}

/// The process epoch all timeline times count from.
pub(crate) fn epoch() -> Instant {
    static EPOCH: OnceLock<Instant> = OnceLock::new();
    *EPOCH.get_or_init(Instant::now)
}

pub(crate) fn us_since_epoch(t: Instant) -> f64 {
    t.saturating_duration_since(epoch()).as_secs_f64() * 1e6
}

/// A small per-process number for the calling thread, and its name.
pub(crate) fn thread_id() -> (u64, Option<String>) {
    static NEXT: AtomicU64 = AtomicU64::new(1);
    thread_local! {
        static ID: u64 = NEXT.fetch_add(1, Ordering::Relaxed);
    }
    let id = ID.with(|i| *i);
    (id, std::thread::current().name().map(str::to_string))
}

/// Per GPU: a reference event whose host time is known (so GPU times land on the host
/// clock), and recycled timing events.
pub struct DeviceClock {
    device: Device,
    reference: Event,
    reference_us: f64,
    free: Mutex<Vec<Event>>,
}

const MAX_DEVICES: usize = 64;

fn clock(device: &Device) -> Option<&'static DeviceClock> {
    static CLOCKS: [OnceLock<Option<DeviceClock>>; MAX_DEVICES] =
        [const { OnceLock::new() }; MAX_DEVICES];
    let ordinal = device.ordinal()?;
    CLOCKS
        .get(ordinal)?
        .get_or_init(|| match new_clock(device) {
            Ok(c) => Some(c),
            Err(e) => {
                tracing::warn!("telemetry: no GPU times on {}: {e}", device.label());
                None
            }
        })
        .as_ref()
}

fn new_clock(device: &Device) -> crate::Result<DeviceClock> {
    let stream = device.new_stream()?;
    let reference = device.new_event()?;
    stream.record(&reference)?;
    reference.synchronize()?;
    Ok(DeviceClock {
        device: device.clone(),
        reference,
        reference_us: us_since_epoch(Instant::now()),
        free: Mutex::new(Vec::new()),
    })
}

impl DeviceClock {
    fn event(&self) -> crate::Result<Event> {
        match self.free.lock().pop() {
            Some(e) => Ok(e),
            None => self.device.new_event(),
        }
    }

    fn recycle(&self, e: Event) {
        self.free.lock().push(e);
    }

    fn to_us(&self, e: &Event) -> crate::Result<f64> {
        Ok(self.reference_us + f64::from(self.reference.elapsed_ms(e)?) * 1e3)
    }
}

fn record_event(clock: &'static DeviceClock, stream: &Stream) -> Option<Event> {
    let made = clock.event().and_then(|e| stream.record(&e).map(|()| e));
    match made {
        Ok(e) => Some(e),
        Err(e) => {
            tracing::warn!("telemetry: span event not recorded: {e}");
            None
        }
    }
}

fn pool_in_use(pool: Option<&'static Arc<DevicePool>>) -> Option<u64> {
    pool.and_then(|p| p.stats().ok()).map(|s| s.in_use)
}

#[cold]
fn open(name: &'static str, stream: &Stream) -> Open {
    #[cfg(feature = "nvtx")]
    nvtx::range_push!("{name}");
    let depth = DEPTH.with(|d| {
        let v = d.get();
        d.set(v + 1);
        v
    });
    let pool = device_pool(stream.device()).ok();
    let pool_in_use_open = pool_in_use(pool);
    // Inside a capture the stream's work goes into the graph: record nothing on the GPU.
    let gpu = if exec::capturing() {
        None
    } else {
        clock(stream.device()).and_then(|c| record_event(c, stream).map(|e| (e, c)))
    };
    Open {
        name,
        stream: stream.clone(),
        host_start: Instant::now(),
        depth,
        pool,
        pool_in_use_open,
        gpu,
    }
}

#[cold]
fn close(open: Open) {
    let host_end = Instant::now();
    let gpu = match open.gpu {
        Some((start, clock)) if !exec::capturing() => match record_event(clock, &open.stream) {
            Some(end) => GpuTime::Pending { clock, start, end },
            None => {
                clock.recycle(start);
                GpuTime::None
            }
        },
        Some((start, clock)) => {
            clock.recycle(start);
            GpuTime::None
        }
        None => GpuTime::None,
    };
    DEPTH.with(|d| d.set(d.get().saturating_sub(1)));
    let (thread, thread_name) = thread_id();
    let secs = host_end.duration_since(open.host_start).as_secs_f64();
    metrics::histogram!("warpdrive_span_seconds", "span" => open.name).record(secs);
    SPANS.push(SpanRecord {
        name: open.name,
        thread,
        thread_name,
        stream: open.stream.id(),
        host_start_us: us_since_epoch(open.host_start),
        host_end_us: us_since_epoch(host_end),
        depth: open.depth,
        close_seq: CLOSE_SEQ.fetch_add(1, Ordering::Relaxed),
        pool_in_use_open: open.pool_in_use_open,
        pool_in_use_close: pool_in_use(open.pool),
        gpu,
    });
    #[cfg(feature = "nvtx")]
    nvtx::range_pop!();
}

/// Takes every closed span. GPU times are resolved for spans whose end event has completed;
/// with `wait`, every pending span is waited for (off the hot path: exports and tests).
/// Spans still pending without `wait` are returned as `Pending`.
pub fn collect_spans(wait: bool) -> Vec<SpanRecord> {
    let mut out = Vec::with_capacity(SPANS.len());
    while let Some(mut r) = SPANS.pop() {
        resolve(&mut r, wait);
        out.push(r);
    }
    out.sort_by_key(|r| r.close_seq);
    out
}

/// Drops the closed spans called `name` (waiting for their GPU times, so their events are
/// reused) and keeps the others for the next [`collect_spans`].
pub fn discard_spans(name: &str) {
    for r in collect_spans(true) {
        if r.name != name {
            SPANS.push(r);
        }
    }
}

fn resolve(r: &mut SpanRecord, wait: bool) {
    let GpuTime::Pending { clock, start, end } = &r.gpu else {
        return;
    };
    let clock: &'static DeviceClock = clock;
    if !wait && !end.query().unwrap_or(false) {
        return;
    }
    let times = clock.to_us(start).and_then(|s| Ok((s, clock.to_us(end)?)));
    let GpuTime::Pending { start, end, .. } = std::mem::replace(&mut r.gpu, GpuTime::None) else {
        return;
    };
    clock.recycle(start);
    clock.recycle(end);
    match times {
        Ok((start_us, end_us)) => {
            metrics::histogram!("warpdrive_span_gpu_seconds", "span" => r.name)
                .record((end_us - start_us) * 1e-6);
            r.gpu = GpuTime::Done { start_us, end_us };
        }
        Err(e) => tracing::warn!("telemetry: span {} GPU time unavailable: {e}", r.name),
    }
}
