//! The batcher: one thread owns the model, takes batches off the priority queue (closing one
//! at the rows knob or by the [`Dispatch`] rule: by default as soon as the device is idle),
//! runs it and scatters the rows back. Before a batch runs, jobs whose client has gone are
//! dropped and jobs past their deadline are answered 504. A batch the device runs out of
//! memory for is halved and retried; after a sticky fault every job gets an error and the
//! service reports itself unhealthy. Once an interval it sums up what it saw, lets the
//! controller (when on) set the knobs, and publishes the [`Status`]. Once the queue is
//! closed it runs what is left and ends: no queued job goes unanswered.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};
use tokio::sync::oneshot;
use warpdrive::{Error, Result};

use super::budget::{Budget, DeviceLedger};
use super::controller::{Controller, ControllerConfig, Knobs};
use super::dispatch::{Dispatch, Waiting};
use super::model::Model;
use super::queue::{Queue, Queued, Refused};
use super::stats::{Status, Window};
use super::tune;

/// The service's limits.
#[derive(Debug, Clone)]
pub struct ServeConfig {
    /// Where to listen (loopback by default).
    pub addr: SocketAddr,
    /// A batch closes once it holds this many rows (a larger job runs alone); with the
    /// controller on, where its rows knob starts.
    pub max_batch_rows: usize,
    /// ...or once its oldest job has waited this long (with [`Dispatch::WhenIdle`], only
    /// while the device is busy); with the controller on, where its delay knob starts.
    pub max_delay: Duration,
    /// Whether a batch closes as soon as the device is idle (the default) or waits out
    /// `max_delay` (Triton's rule).
    pub dispatch: Dispatch,
    /// Steers the two knobs toward a p99 objective (`None`: they stay as set).
    pub controller: Option<ControllerConfig>,
    /// Times the model on batches of 1, 2, 4, ... rows at start and prefers the sizes it
    /// runs efficiently: batches close at the best size at most, and the controller starts
    /// at the knee and stays at or under the best (see `Status::tuned_knee`).
    pub tune_batch: bool,
    /// Batcher threads, each with a model of its own (its own stream and weights on a GPU),
    /// taking batches off the one queue: one batch's copies and host work overlap
    /// another's device work. More than 1 needs [`Server::start_workers`](crate::Server).
    pub workers: usize,
    /// How often the batcher sums up an interval, publishes its status and steps the
    /// controller.
    pub interval: Duration,
    /// Jobs waiting at most; past it a job is refused with 503.
    pub queue_jobs: usize,
    /// A priority class with jobs waiting through this many batches in a row goes first in
    /// the next one.
    pub starvation_limit: u32,
    /// Every tenant's budget, but for those in `tenant_budgets`.
    pub budget: Budget,
    pub tenant_budgets: std::collections::HashMap<String, Budget>,
    /// Tenants tracked at once (idle ones are forgotten to make room); past it, 429.
    pub max_tenants: usize,
    /// Connections open at once; one past it is closed as soon as it is accepted.
    pub max_connections: usize,
    /// The largest request body; past it, 413.
    pub max_body_bytes: usize,
    /// How long a client may take to send its headers and body; past it, 408.
    pub body_timeout: Duration,
    /// How long a job may take from arrival to answer (and its deadline when it names
    /// none); past it, 504.
    pub job_timeout: Duration,
    /// How long making the model may take (loading weights, compiling kernels).
    pub start_timeout: Duration,
    /// How long stopping waits for the jobs in flight to be answered.
    pub drain_timeout: Duration,
    /// Results of jobs submitted with `async=true` held at once (past it, 503), and how
    /// long a ready one waits to be fetched.
    pub result_slots: usize,
    pub result_ttl: Duration,
    /// Batch sizes (rows) each batcher thread runs its model on once before the service
    /// takes jobs: the first pass of a size may compile or load kernels, capture a graph or
    /// load a library (seconds on a GPU), which no job should wait for.
    pub warm_rows: Vec<usize>,
    /// Threads of the HTTP side's runtime (accepting, parsing, decoding, replies).
    pub http_threads: usize,
    /// Task polls between an HTTP thread's looks at the sockets while it has tasks queued
    /// ([`DEFAULT_EVENT_INTERVAL`]).
    pub http_event_interval: u32,
    /// Stall probes in the service (a thread and a task on the HTTP runtime,
    /// [`crate::probe`]) log a warning with the wall clock for every wake-up later than this
    /// (`None`: no probes).
    pub stall_probe: Option<Duration>,
}

/// Task polls between a busy runtime thread's looks for socket readiness (tokio's
/// `event_interval`; its default is 61). A task here decodes or encodes a body of thousands
/// of floats (~100-200 µs), so with every thread busy, 61 polls left new requests and
/// replies unseen for ~10 ms.
pub const DEFAULT_EVENT_INTERVAL: u32 = 61;

impl Default for ServeConfig {
    fn default() -> Self {
        ServeConfig {
            addr: SocketAddr::from(([127, 0, 0, 1], 8080)),
            max_batch_rows: 256,
            max_delay: Duration::from_millis(10),
            dispatch: Dispatch::default(),
            controller: None,
            tune_batch: false,
            workers: 1,
            interval: Duration::from_millis(250),
            queue_jobs: 4096,
            starvation_limit: 8,
            budget: Budget::default(),
            tenant_budgets: Default::default(),
            max_tenants: 10_000,
            max_connections: 10_000,
            max_body_bytes: 64 << 20,
            body_timeout: Duration::from_secs(10),
            job_timeout: Duration::from_secs(60),
            start_timeout: Duration::from_secs(600),
            drain_timeout: Duration::from_secs(60),
            result_slots: 4096,
            result_ttl: Duration::from_secs(60),
            warm_rows: Vec::new(),
            http_threads: std::thread::available_parallelism().map_or(2, |n| n.get().clamp(2, 8)),
            http_event_interval: DEFAULT_EVENT_INTERVAL,
            stall_probe: Some(crate::load::DEFAULT_STALL_PROBE),
        }
    }
}

/// How a job's batch went.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BatchStats {
    /// Rows in the batch the job ran in.
    pub batch_rows: usize,
    /// µs from the job's arrival in the queue to its batch starting.
    pub queue_us: f64,
    /// µs the batch ran.
    pub run_us: f64,
}

/// Why a queued job got no rows back.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum JobError {
    /// Its deadline passed before it ran (504).
    Expired,
    /// The service's device faulted (503).
    Unhealthy(String),
    /// Its tenant's device memory budget could not hold it (the status: 429 or 413).
    OverBudget(u16, String),
    /// The model failed on its batch (500).
    Failed(String),
}

pub(crate) type Answer = std::result::Result<(Rows, BatchStats), JobError>;

/// A job's rows of its batch's output, shared with the batch's other jobs: scattering the
/// answers copies nothing (the reply's encoding reads them in place).
#[derive(Debug, Clone)]
pub(crate) struct Rows {
    all: Arc<Vec<f32>>,
    at: std::ops::Range<usize>,
}

impl Rows {
    pub(crate) fn as_slice(&self) -> &[f32] {
        self.all.get(self.at.clone()).unwrap_or_default()
    }
}

/// A job: rows of the model's width, its class and deadline, and where its answer goes.
pub(crate) struct Job {
    pub(crate) data: Vec<f32>,
    pub(crate) rows: usize,
    pub(crate) class: usize,
    /// Whose budget its device memory is charged to.
    pub(crate) tenant: String,
    pub(crate) arrived: Instant,
    /// It must start running by then.
    pub(crate) deadline: Instant,
    pub(crate) reply: oneshot::Sender<Answer>,
}

impl Queued for Job {
    fn rows(&self) -> usize {
        self.rows
    }
    fn class(&self) -> usize {
        self.class
    }
    fn arrived(&self) -> Instant {
        self.arrived
    }
}

/// What the HTTP side and the batcher share.
pub(crate) struct Shared {
    queue: Mutex<Queue<Job>>,
    wake: Condvar,
    /// `warpdrive_serve_queue_jobs`, looked up once (set under the queue's lock).
    queue_gauge: metrics::Gauge,
    /// Batches running now; changed under the queue's lock (the dispatch rule reads it).
    running: AtomicUsize,
    dispatch: Dispatch,
    pub(crate) healthy: AtomicBool,
    /// Nanoseconds the model has run, and jobs answered with rows, since the start: kept
    /// after every batch (the busy total comes after its batch's replies).
    pub(crate) busy_ns: AtomicU64,
    pub(crate) answered: AtomicU64,
    pub(crate) width: usize,
    pub(crate) name: String,
    pub(crate) status: Mutex<Status>,
    /// The knobs every batcher thread closes batches by (the first thread steers them).
    knobs: Mutex<Knobs>,
    /// What the other batcher threads saw since the first one last summed up an interval.
    inbox: Mutex<(Window, Totals)>,
    workers: usize,
    /// Device memory each tenant's running jobs hold.
    device: DeviceLedger,
}

impl Shared {
    /// Queues `job` and returns when it was in the queue (before the batcher is woken:
    /// that is the batcher's work, not the submission's), or gives it back with why not.
    pub(crate) fn submit(&self, job: Job) -> std::result::Result<Instant, (Refused, Job)> {
        let mut q = self.queue.lock();
        q.push(job)?;
        // Under the lock, so a batch taken at once cannot be overwritten by a stale count.
        self.queue_gauge.set(q.len() as f64);
        drop(q);
        let queued = Instant::now();
        self.wake.notify_one();
        Ok(queued)
    }

    pub(crate) fn queued(&self) -> usize {
        self.queue.lock().len()
    }

    /// Refuses jobs from now on; the batcher runs those queued and ends.
    pub(crate) fn close(&self) {
        self.queue.lock().close();
        self.wake.notify_all();
    }
}

/// What makes the model, on the batcher's thread.
pub type MakeModel = Box<dyn FnOnce() -> Result<Box<dyn Model>> + Send>;

/// What makes a model for each batcher thread, on that thread.
pub type MakeModels = Arc<dyn Fn() -> Result<Box<dyn Model>> + Send + Sync>;

/// Starts the batcher's threads, each of which makes its model with `make` first; the
/// first also sweeps batch sizes (when asked) and steers.
pub(crate) fn start(
    make: MakeModels,
    config: &ServeConfig,
) -> Result<(Arc<Shared>, Vec<JoinHandle<()>>)> {
    if config.max_batch_rows == 0
        || config.queue_jobs == 0
        || config.interval.is_zero()
        || config.workers == 0
    {
        return Err(Error::InvalidArgument(
            "serve: max_batch_rows, queue_jobs, workers and interval must be more than 0".into(),
        ));
    }
    let (shared, first) = start_first(make.clone(), config)?;
    let mut threads = vec![first];
    let (ready_tx, ready) = std::sync::mpsc::channel();
    for k in 1..config.workers {
        let (make, mine, cfg, ready_tx) = (
            make.clone(),
            shared.clone(),
            config.clone(),
            ready_tx.clone(),
        );
        let spawned = std::thread::Builder::new()
            .name(format!("warpdrive-batcher-{k}"))
            .spawn(move || {
                match make().and_then(|mut m| warm(m.as_mut(), &cfg.warm_rows).map(|()| m)) {
                    Ok(model) => {
                        let _ = ready_tx.send(Ok(()));
                        follow(model, &mine, &cfg)
                    }
                    Err(e) => {
                        let _ = ready_tx.send(Err(e));
                    }
                }
            });
        match spawned {
            Ok(t) => threads.push(t),
            Err(e) => {
                shared.close();
                return Err(Error::InvalidArgument(format!(
                    "serve: batcher thread: {e}"
                )));
            }
        }
    }
    let deadline = crate::later(Instant::now(), config.start_timeout);
    for _ in 1..config.workers {
        let wait = deadline.saturating_duration_since(Instant::now());
        let made = ready.recv_timeout(wait).map_err(|e| Error::Timeout {
            what: format!("serve: making a worker's model ({e})"),
            after_ms: config.start_timeout.as_millis() as u64,
        });
        if let Err(e) = made.and_then(|r| r) {
            // The threads already running end once the closed queue is empty.
            shared.close();
            return Err(e);
        }
    }
    Ok((shared, threads))
}

/// Starts the first batcher thread: it makes its model, sweeps batch sizes when asked,
/// makes what the threads share, and steers.
fn start_first(make: MakeModels, config: &ServeConfig) -> Result<(Arc<Shared>, JoinHandle<()>)> {
    let (made_tx, made) = std::sync::mpsc::sync_channel(1);
    let mut cfg = config.clone();
    let thread = std::thread::Builder::new()
        .name("warpdrive-batcher".into())
        .spawn(move || {
            let mut model =
                match make().and_then(|mut m| warm(m.as_mut(), &cfg.warm_rows).map(|()| m)) {
                    Ok(m) => m,
                    Err(e) => {
                        let _ = made_tx.send(Err(e));
                        return;
                    }
                };
            let mut tuned = None;
            if cfg.tune_batch {
                match tune::sweep(model.as_mut(), tune::largest(&cfg)) {
                    Ok(s) => {
                        tracing::info!("serve: batch sizes: knee {}, best {}", s.knee, s.best);
                        cfg = tune::prefer(cfg, &s);
                        tuned = Some(s);
                    }
                    Err(e) => tracing::warn!("serve: the batch sweep failed ({e}); sizes as set"),
                }
            }
            let shared = Arc::new(Shared {
                queue: Mutex::new(Queue::new(cfg.queue_jobs, cfg.starvation_limit)),
                wake: Condvar::new(),
                queue_gauge: metrics::gauge!("warpdrive_serve_queue_jobs"),
                running: AtomicUsize::new(0),
                dispatch: cfg.dispatch,
                healthy: AtomicBool::new(true),
                busy_ns: AtomicU64::new(0),
                answered: AtomicU64::new(0),
                width: model.width(),
                name: model.name().to_string(),
                status: Mutex::new(Status {
                    model: model.name().to_string(),
                    healthy: true,
                    batch_rows: cfg.max_batch_rows,
                    delay_us: cfg.max_delay.as_secs_f64() * 1e6,
                    controller: cfg.controller.is_some(),
                    tuned_knee: tuned.as_ref().map(|s| s.knee),
                    tuned_best: tuned.as_ref().map(|s| s.best),
                    workers: cfg.workers,
                    ..Status::default()
                }),
                knobs: Mutex::new(Knobs {
                    batch_rows: cfg.max_batch_rows,
                    delay: cfg.max_delay,
                }),
                inbox: Mutex::new((Window::new(Instant::now()), Totals::default())),
                workers: cfg.workers,
                device: DeviceLedger::new(&cfg.budget, &cfg.tenant_budgets),
            });
            if made_tx.send(Ok(shared.clone())).is_err() {
                return;
            }
            run(model, &shared, &cfg)
        })
        .map_err(|e| Error::InvalidArgument(format!("serve: batcher thread: {e}")))?;
    let shared = made
        .recv_timeout(config.start_timeout)
        .map_err(|e| Error::Timeout {
            what: format!("serve: making the model ({e})"),
            after_ms: config.start_timeout.as_millis() as u64,
        })??;
    Ok((shared, thread))
}

/// Runs `model` once on each of `rows` (the warm-up), or fails with the first error.
fn warm(model: &mut dyn Model, rows: &[usize]) -> Result<()> {
    let mut input = Vec::new();
    let mut output = Vec::new();
    for &r in rows {
        let values = r
            .checked_mul(model.width())
            .filter(|&v| v > 0)
            .ok_or_else(|| {
                Error::InvalidArgument(format!(
                    "serve: warming up {r} rows of {}: a size of 0 or past usize",
                    model.width()
                ))
            })?;
        input.clear();
        // Seeded-looking values, not zeros (a kernel may take a shortcut on zeros).
        input.extend((0..values).map(|i| (i % 7) as f32 * 0.25 - 0.75));
        model.run(&input, &mut output).map_err(|e| {
            Error::InvalidArgument(format!(
                "serve: warming up {} on {r} rows: {e}",
                model.name()
            ))
        })?;
    }
    Ok(())
}

enum Next<'a> {
    Batch(Vec<Job>, Running<'a>),
    Idle,
    Done,
}

/// A batch counted as running until it is dropped; the other batcher threads are woken
/// then (the device is idle again).
struct Running<'a>(&'a Shared);

impl Drop for Running<'_> {
    fn drop(&mut self) {
        let _q = self.0.queue.lock();
        self.0.running.fetch_sub(1, Ordering::AcqRel);
        self.0.wake.notify_all();
    }
}

/// The next batch under `knobs`, waiting at most `tick` while nothing is queued.
fn next_batch(shared: &Shared, knobs: Knobs, tick: Duration) -> Next<'_> {
    let give_up = crate::later(Instant::now(), tick);
    let mut q = shared.queue.lock();
    loop {
        let now = Instant::now();
        match q.oldest() {
            None if q.is_closed() => return Next::Done,
            None if now >= give_up => return Next::Idle,
            None => {
                shared.wake.wait_until(&mut q, give_up);
            }
            Some(oldest) => {
                let waiting = Waiting {
                    rows: q.rows(),
                    oldest,
                    running: shared.running.load(Ordering::Acquire),
                    closed: q.is_closed(),
                };
                match shared.dispatch.closes(knobs, waiting, now) {
                    None => {
                        let batch = q.take_batch(knobs.batch_rows);
                        shared.running.fetch_add(1, Ordering::AcqRel);
                        shared.queue_gauge.set(q.len() as f64);
                        return Next::Batch(batch, Running(shared));
                    }
                    Some(due) => {
                        shared.wake.wait_until(&mut q, due);
                    }
                }
            }
        }
    }
}

/// Counts of jobs answered, and of jobs that ended without running, since the start.
#[derive(Debug, Default)]
pub(crate) struct Totals {
    jobs: u64,
    expired: u64,
    cancelled: u64,
    failed: u64,
}

impl Totals {
    fn add(&mut self, o: Totals) {
        self.jobs += o.jobs;
        self.expired += o.expired;
        self.cancelled += o.cancelled;
        self.failed += o.failed;
    }
}

/// A batcher thread other than the first: batches under the knobs the first one sets, its
/// samples left in the inbox for the first one to sum up.
fn follow(mut model: Box<dyn Model>, shared: &Shared, config: &ServeConfig) {
    let mut gathered = Vec::new();
    loop {
        let knobs = *shared.knobs.lock();
        match next_batch(shared, knobs, config.interval) {
            Next::Done => return,
            Next::Idle => {}
            Next::Batch(batch, running) => {
                let full = batch.iter().map(|j| j.rows).sum::<usize>() >= knobs.batch_rows;
                let mut window = Window::new(Instant::now());
                let mut totals = Totals::default();
                run_batch(
                    model.as_mut(),
                    batch,
                    full,
                    shared,
                    &mut window,
                    &mut totals,
                    &mut gathered,
                );
                drop(running);
                let mut inbox = shared.inbox.lock();
                inbox.0.merge(window);
                inbox.1.add(totals);
            }
        }
    }
}

fn run(mut model: Box<dyn Model>, shared: &Shared, config: &ServeConfig) {
    let mut knobs = Knobs {
        batch_rows: config.max_batch_rows,
        delay: config.max_delay,
    };
    let mut controller = config.controller.map(|c| Controller::new(c, knobs));
    if let Some(c) = &controller {
        knobs = c.knobs();
    }
    *shared.knobs.lock() = knobs;
    let mut window = Window::new(Instant::now());
    let mut totals = Totals::default();
    let mut gathered = Vec::new();
    shared.queue_gauge.set(0.0);
    loop {
        let done = match next_batch(shared, knobs, config.interval) {
            Next::Done => true,
            Next::Idle => false,
            Next::Batch(batch, running) => {
                let full = batch.iter().map(|j| j.rows).sum::<usize>() >= knobs.batch_rows;
                run_batch(
                    model.as_mut(),
                    batch,
                    full,
                    shared,
                    &mut window,
                    &mut totals,
                    &mut gathered,
                );
                drop(running);
                false
            }
        };
        let now = Instant::now();
        if done || window.age(now) >= config.interval {
            let queued = shared.queue.lock().len();
            {
                let mut inbox = shared.inbox.lock();
                let (w, t) = std::mem::replace(&mut *inbox, (Window::new(now), Totals::default()));
                window.merge(w);
                totals.add(t);
            }
            let seen = window.finish(now, queued, shared.workers);
            if let Some(c) = controller.as_mut() {
                knobs = c.step(&seen);
                *shared.knobs.lock() = knobs;
            }
            publish(model.as_ref(), shared, &seen, knobs, &totals);
            window = Window::new(now);
        }
        if done {
            return;
        }
    }
}

fn publish(
    model: &dyn Model,
    shared: &Shared,
    seen: &super::stats::Seen,
    knobs: Knobs,
    totals: &Totals,
) {
    let per_s = |n: usize| n as f64 / seen.seconds.max(1e-9);
    let (used, reserved) = model.pool_bytes();
    let mut s = shared.status.lock();
    s.healthy = shared.healthy.load(Ordering::Acquire);
    s.batch_rows = knobs.batch_rows;
    s.delay_us = knobs.delay.as_secs_f64() * 1e6;
    s.last = *seen;
    s.jobs_per_s = per_s(seen.jobs);
    s.rows_per_s = per_s(seen.rows);
    s.jobs_total = totals.jobs;
    s.expired_total = totals.expired;
    s.cancelled_total = totals.cancelled;
    s.failed_total = totals.failed;
    s.busy_seconds_total = shared.busy_ns.load(Ordering::Acquire) as f64 * 1e-9;
    s.pool_used_bytes = used;
    s.pool_reserved_bytes = reserved;
    metrics::gauge!("warpdrive_serve_busy_fraction").set(seen.busy);
    metrics::gauge!("warpdrive_serve_batch_rows_knob").set(knobs.batch_rows as f64);
    metrics::gauge!("warpdrive_serve_delay_us_knob").set(s.delay_us);
    if seen.jobs > 0 {
        metrics::gauge!("warpdrive_serve_latency_p99_us").set(seen.p99_us);
    }
    drop(s);
    // The recorder keeps each batch's `warpdrive_serve_batch_rows` sample (thousands a
    // second) until upkeep; unscraped, the service's memory would grow without end.
    warpdrive::telemetry::prometheus_upkeep();
}

/// Drops jobs whose client has gone, answers those past their deadline, runs the rest.
fn run_batch(
    model: &mut dyn Model,
    batch: Vec<Job>,
    full: bool,
    shared: &Shared,
    window: &mut Window,
    totals: &mut Totals,
    gathered: &mut Vec<f32>,
) {
    let now = Instant::now();
    let mut live = Vec::with_capacity(batch.len());
    for j in batch {
        if j.reply.is_closed() {
            totals.cancelled += 1;
            metrics::counter!("warpdrive_serve_cancelled_total").increment(1);
        } else if now > j.deadline {
            totals.expired += 1;
            metrics::counter!("warpdrive_serve_expired_total").increment(1);
            let _ = j.reply.send(Err(JobError::Expired));
        } else {
            live.push(j);
        }
    }
    // Device memory is charged as the batch is about to allocate it; a job past its
    // tenant's budget fails alone.
    let mut grants = Vec::with_capacity(live.len());
    let mut charged = Vec::with_capacity(live.len());
    for j in live {
        match shared.device.charge(&j.tenant, model.device_bytes(j.rows)) {
            Ok(g) => {
                grants.push(g);
                charged.push(j);
            }
            Err(over) => {
                totals.failed += 1;
                metrics::counter!("warpdrive_serve_over_device_budget_total").increment(1);
                let why = over.message(&j.tenant);
                let _ = j.reply.send(Err(JobError::OverBudget(over.status(), why)));
            }
        }
    }
    let live = charged;
    if live.is_empty() {
        return;
    }
    let rows: usize = live.iter().map(|j| j.rows).sum();
    metrics::counter!("warpdrive_serve_jobs_total").increment(live.len() as u64);
    metrics::histogram!("warpdrive_serve_batch_rows").record(rows as f64);
    let started = Instant::now();
    let answered = totals.jobs;
    execute(model, live, shared, window, totals, gathered);
    let ran = started.elapsed();
    window.batch(rows, ran, full);
    let ns = u64::try_from(ran.as_nanos()).unwrap_or(u64::MAX);
    shared.busy_ns.fetch_add(ns, Ordering::AcqRel);
    shared
        .answered
        .fetch_add(totals.jobs - answered, Ordering::AcqRel);
    drop(grants);
}

/// Runs `batch` and answers each job; out of device memory, runs each half on its own.
/// `gathered` is the thread's buffer for a batch of several jobs' rows.
fn execute(
    model: &mut dyn Model,
    batch: Vec<Job>,
    shared: &Shared,
    window: &mut Window,
    totals: &mut Totals,
    gathered: &mut Vec<f32>,
) {
    if !shared.healthy.load(Ordering::Acquire) {
        fail_all(
            batch,
            JobError::Unhealthy("the service is unhealthy: its device faulted".into()),
            totals,
        );
        return;
    }
    let rows: usize = batch.iter().map(|j| j.rows).sum();
    // One job runs on its own rows; several are gathered into the thread's reused buffer.
    let input: &[f32] = match batch.as_slice() {
        [one] => &one.data,
        _ => {
            gathered.clear();
            for j in &batch {
                gathered.extend_from_slice(&j.data);
            }
            gathered
        }
    };
    let values = input.len();
    let started = Instant::now();
    let mut output = Vec::new();
    match model.run(input, &mut output) {
        Ok(()) if output.len() == values => {
            let run_us = started.elapsed().as_secs_f64() * 1e6;
            let output = Arc::new(output);
            let mut at = 0;
            for j in batch {
                let n = j.data.len();
                let stats = BatchStats {
                    batch_rows: rows,
                    queue_us: started.duration_since(j.arrived).as_secs_f64() * 1e6,
                    run_us,
                };
                let answer = Rows {
                    all: output.clone(),
                    at: at..at + n,
                };
                let _ = j.reply.send(Ok((answer, stats)));
                window.job(j.arrived.elapsed());
                totals.jobs += 1;
                at += n;
            }
        }
        Ok(()) => {
            let why = format!(
                "{}: {} values out for {} in",
                model.name(),
                output.len(),
                values
            );
            fail_all(batch, JobError::Failed(why), totals);
        }
        Err(Error::OutOfMemory { .. }) if batch.len() > 1 => {
            tracing::warn!(
                "{}: out of memory on {rows} rows; halving the batch",
                model.name()
            );
            let mut first = batch;
            let second = first.split_off(first.len() / 2);
            execute(model, first, shared, window, totals, gathered);
            execute(model, second, shared, window, totals, gathered);
        }
        Err(e) => {
            let why = e.to_string();
            if e.is_device_lost() || model.is_lost() {
                shared.healthy.store(false, Ordering::Release);
                shared.status.lock().healthy = false;
                fail_all(batch, JobError::Unhealthy(why), totals);
            } else {
                fail_all(batch, JobError::Failed(why), totals);
            }
        }
    }
}

fn fail_all(batch: Vec<Job>, why: JobError, totals: &mut Totals) {
    totals.failed += batch.len() as u64;
    for j in batch {
        let _ = j.reply.send(Err(why.clone()));
    }
}
