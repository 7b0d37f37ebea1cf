//! RAII spans: host time, GPU events and pool bytes; finished spans go to a lock-free queue
//! and their GPU times are read only when someone collects them.
//!
//! GPU times come from timing events, one per span boundary at most: a boundary reuses the
//! previous boundary's event on the same stream (kept per thread) when nothing was enqueued
//! on the stream since ([`Stream::work_seq`]) and that event was recorded less than
//! [`SHARE_WINDOW`] ago. Both mark the same point of the stream, so the shared time is exact
//! while the stream is busy; on an idle stream a fresh event would have been stamped at most
//! the window later. So a span's end serves as the next span's start, a nested span's start
//! is its parent's, and an empty span costs no event at all.

use std::cell::{Cell, RefCell};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use crossbeam_queue::SegQueue;
use parking_lot::Mutex;

use crate::device::{Device, Event, Slot, Stream};
use crate::exec;
use crate::memory::{device_pool, DevicePool};

/// How recent the previous boundary's event must be for a boundary to share it (about two
/// ticks of the events' 0.5 µs resolution): the bound on how early a shared boundary's GPU
/// time can be, when the stream was idle.
pub const SHARE_WINDOW: Duration = Duration::from_micros(1);

/// Where a span's GPU time stands.
#[derive(Debug)]
pub enum GpuTime {
    /// No GPU time: the CPU backend, a span opened during a graph capture, or no events.
    None,
    /// Events recorded; the GPU has not been asked yet.
    Pending(PendingGpu),
    /// Microseconds since the process epoch (the same clock as the host times).
    Done { start_us: f64, end_us: f64 },
}

/// The recorded start and end points of a span whose GPU time is not read yet (possibly
/// the same point, or shared with neighbouring spans).
pub struct PendingGpu {
    start: Arc<Mark>,
    end: Arc<Mark>,
}

impl std::fmt::Debug for PendingGpu {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let shared = Arc::ptr_eq(&self.start, &self.end);
        write!(f, "PendingGpu{{ one event: {shared} }}")
    }
}

/// A closed span.
#[derive(Debug)]
pub struct SpanRecord {
    pub name: &'static str,
    /// The host thread that opened it (small numbers, per process).
    pub thread: u64,
    pub thread_name: Option<Arc<str>>,
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
    /// The start point (recorded or shared); `None` without GPU times.
    gpu: Option<Arc<Mark>>,
}

/// Opens a span named `name` on `stream` (a no-op costing one branch while telemetry is off).
#[inline]
pub fn span(name: &'static str, stream: &Stream) -> Span {
    if !super::enabled() && !capturing_here() {
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
static EVENTS_RECORDED: AtomicU64 = AtomicU64::new(0);

/// GPU events spans have recorded so far in this process (boundaries that shared an
/// earlier event do not count): with the spans closed, the events-per-span ratio.
pub fn gpu_events_recorded() -> u64 {
    EVENTS_RECORDED.load(Ordering::Relaxed)
}

thread_local! {
    static DEPTH: Cell<u32> = const { Cell::new(0) };
    /// This thread's last recorded boundary, which the next one may share.
    static LAST: RefCell<Option<LastMark>> = const { RefCell::new(None) };
    /// Spans this thread closes while [`capture_spans`] runs: kept here, not queued.
    static CAPTURED: RefCell<Option<Vec<SpanRecord>>> = const { RefCell::new(None) };
}

/// The process epoch all timeline times count from.
pub(crate) fn epoch() -> Instant {
    static EPOCH: OnceLock<Instant> = OnceLock::new();
    *EPOCH.get_or_init(Instant::now)
}

pub(crate) fn us_since_epoch(t: Instant) -> f64 {
    t.saturating_duration_since(epoch()).as_secs_f64() * 1e6
}

/// A small per-process number for the calling thread, and its name (read once per thread).
pub(crate) fn thread_id() -> (u64, Option<Arc<str>>) {
    static NEXT: AtomicU64 = AtomicU64::new(1);
    thread_local! {
        static ID: (u64, Option<Arc<str>>) = (
            NEXT.fetch_add(1, Ordering::Relaxed),
            std::thread::current().name().map(Arc::from),
        );
    }
    ID.with(Clone::clone)
}

/// Per GPU: a reference event whose host time is known (so GPU times land on the host
/// clock), and recycled timing events.
pub struct DeviceClock {
    device: Device,
    reference: Event,
    reference_us: f64,
    free: Mutex<Vec<Event>>,
}

fn clock(device: &Device) -> Option<&'static DeviceClock> {
    device.ordinal()?;
    let clock = device.state(Slot::SpanClock, || match new_clock(device) {
        Ok(c) => Ok(Some(c)),
        Err(e) => {
            tracing::warn!("telemetry: no GPU times on {}: {e}", device.label());
            Ok(None)
        }
    });
    clock.ok()?.as_ref()
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

    fn to_us(&self, e: &Event) -> crate::Result<f64> {
        Ok(self.reference_us + f64::from(self.reference.elapsed_ms(e)?) * 1e3)
    }
}

/// A recorded point of a stream, shared by the span boundaries that fall on it; its event
/// goes back to the clock's free list when the last of them is done with it.
struct Mark {
    clock: &'static DeviceClock,
    event: Option<Event>,
    /// The point's time, once read.
    us: OnceLock<f64>,
}

impl Mark {
    fn query(&self) -> bool {
        self.event
            .as_ref()
            .is_none_or(|e| e.query().unwrap_or(false))
    }

    fn us(&self) -> crate::Result<f64> {
        if let Some(&us) = self.us.get() {
            return Ok(us);
        }
        let event = self.event.as_ref().ok_or_else(|| {
            crate::Error::InvalidArgument("telemetry: a span mark without its event".into())
        })?;
        let us = self.clock.to_us(event)?;
        Ok(*self.us.get_or_init(|| us))
    }
}

impl Drop for Mark {
    fn drop(&mut self) {
        if let Some(e) = self.event.take() {
            self.clock.free.lock().push(e);
        }
    }
}

/// The last boundary a thread recorded: where, when, and the stream's work count then.
struct LastMark {
    stream: u64,
    work_seq: u64,
    /// Host time just after the record returned.
    at: Instant,
    mark: Arc<Mark>,
}

/// The mark for a span boundary on `stream` at host time `now`: the thread's last one when
/// it may be shared (see the module docs), else a newly recorded one. Also returns the host
/// time after it (later than `now` when an event was recorded).
fn boundary(
    clock: &'static DeviceClock,
    stream: &Stream,
    now: Instant,
) -> (Option<Arc<Mark>>, Instant) {
    let work_seq = stream.work_seq();
    let shared = LAST.try_with(|last| {
        last.borrow().as_ref().and_then(|l| {
            (l.stream == stream.id()
                && l.work_seq == work_seq
                && now.saturating_duration_since(l.at) <= SHARE_WINDOW)
                .then(|| l.mark.clone())
        })
    });
    if let Ok(Some(mark)) = shared {
        return (Some(mark), now);
    }
    let made = clock.event().and_then(|e| stream.record(&e).map(|()| e));
    let at = Instant::now();
    match made {
        Ok(event) => {
            EVENTS_RECORDED.fetch_add(1, Ordering::Relaxed);
            let mark = Arc::new(Mark {
                clock,
                event: Some(event),
                us: OnceLock::new(),
            });
            let _ = LAST.try_with(|last| {
                *last.borrow_mut() = Some(LastMark {
                    stream: stream.id(),
                    work_seq,
                    at,
                    mark: mark.clone(),
                });
            });
            (Some(mark), at)
        }
        Err(e) => {
            tracing::warn!("telemetry: span event not recorded: {e}");
            (None, at)
        }
    }
}

fn pool_in_use(pool: Option<&'static Arc<DevicePool>>) -> Option<u64> {
    pool.map(|p| p.in_use())
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
    let now = Instant::now();
    // Inside a capture the stream's work goes into the graph: record nothing on the GPU.
    let (gpu, host_start) = match clock(stream.device()) {
        Some(c) if !exec::capturing() => boundary(c, stream, now),
        _ => (None, now),
    };
    Open {
        name,
        stream: stream.clone(),
        host_start,
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
        Some(start) if !exec::capturing() => match boundary(start.clock, &open.stream, host_end) {
            (Some(end), _) => GpuTime::Pending(PendingGpu { start, end }),
            (None, _) => GpuTime::None,
        },
        _ => GpuTime::None,
    };
    DEPTH.with(|d| d.set(d.get().saturating_sub(1)));
    let (thread, thread_name) = thread_id();
    let secs = host_end.duration_since(open.host_start).as_secs_f64();
    metrics::histogram!("warpdrive_span_seconds", "span" => open.name).record(secs);
    let record = SpanRecord {
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
    };
    let kept = CAPTURED.try_with(|c| match c.borrow_mut().as_mut() {
        Some(spans) => {
            spans.push(record);
            None
        }
        None => Some(record),
    });
    match kept {
        Ok(Some(record)) => SPANS.push(record),
        Ok(None) => {}
        // The thread is exiting: nothing is capturing on it.
        Err(_) => {}
    }
    #[cfg(feature = "nvtx")]
    nvtx::range_pop!();
}

fn capturing_here() -> bool {
    CAPTURED.try_with(|c| c.borrow().is_some()).unwrap_or(false)
}

/// Runs `body` with spans on for this thread alone and returns the spans it closed on this
/// thread, GPU times resolved (waited for), in closing order; they do not reach
/// [`collect_spans`]. Telemetry's global switch is not touched, so a caller's own spans
/// elsewhere are unaffected. Captures nest: an inner capture takes its own spans.
pub fn capture_spans<R>(
    body: impl FnOnce() -> crate::Result<R>,
) -> crate::Result<(R, Vec<SpanRecord>)> {
    /// Puts the outer capture back, also when `body` unwinds.
    struct Restore(Option<Option<Vec<SpanRecord>>>);
    impl Drop for Restore {
        fn drop(&mut self) {
            if let Some(outer) = self.0.take() {
                let _ = CAPTURED.try_with(|c| *c.borrow_mut() = outer);
            }
        }
    }
    let mut restore = Restore(Some(CAPTURED.with(|c| c.borrow_mut().replace(Vec::new()))));
    let r = body();
    let outer = restore.0.take().unwrap_or_default();
    let mut spans = CAPTURED
        .with(|c| std::mem::replace(&mut *c.borrow_mut(), outer))
        .unwrap_or_default();
    for s in &mut spans {
        resolve(s, true);
    }
    Ok((r?, spans))
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
    let GpuTime::Pending(p) = &r.gpu else {
        return;
    };
    if !wait && !p.end.query() {
        return;
    }
    match p.start.us().and_then(|s| Ok((s, p.end.us()?))) {
        Ok((start_us, end_us)) => {
            metrics::histogram!("warpdrive_span_gpu_seconds", "span" => r.name)
                .record((end_us - start_us) * 1e-6);
            r.gpu = GpuTime::Done { start_us, end_us };
        }
        Err(e) => {
            tracing::warn!("telemetry: span {} GPU time unavailable: {e}", r.name);
            r.gpu = GpuTime::None;
        }
    }
}
