//! The load generator behind `warpdrive load` and the `serve` bench suite: jobs sent to a
//! service on loopback through a pooled [`Client`], either open-loop (Poisson arrivals at a
//! rate, each job timed from the moment it was due, so a slow service cannot slow the
//! arrivals down and hide its own latency) or closed-loop (N clients, each sending its next
//! job when the last one is answered). Bounded in jobs and in time; every job ends as an
//! answer, a failure counted by kind, or a timeout.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rand::{Rng, SeedableRng};
use tokio::task::JoinSet;

use super::client::{Client, ClientConfig, Encoded, Failure, JobResult, JobSpec};
use super::probe::{Probes, Stall};
use super::wire::Format;

/// How jobs arrive.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Arrivals {
    /// Open loop: Poisson arrivals at this many jobs a second.
    Poisson { per_s: f64 },
    /// Closed loop: this many clients, each with one job outstanding.
    Clients(usize),
}

/// A load to offer.
#[derive(Debug, Clone)]
pub struct LoadConfig {
    /// The service (loopback only).
    pub addr: SocketAddr,
    pub arrivals: Arrivals,
    /// Rows per job.
    pub rows: usize,
    /// Jobs sent at most (`None`: until `duration`).
    pub max_jobs: Option<u64>,
    /// How long jobs are sent for.
    pub duration: Duration,
    /// Connections at most (open loop; a closed loop opens one per client).
    pub connections: usize,
    /// The longest a job may take, and how long the run waits for the last ones.
    pub timeout: Duration,
    pub format: Format,
    pub priority: Option<u8>,
    pub tenant: Option<String>,
    /// Seeds the arrival times and the job values.
    pub seed: u64,
    /// Threads of the generator's runtime ([`run`]; 1 keeps a one-client run off the
    /// service's cores as far as it can). The default, a quarter of the cores (2 to 8),
    /// keeps the generator from being what saturates: each job's client side (a JSON reply
    /// of 2048 values parsed, HTTP) costs about as much CPU as the service's side, and two
    /// threads near saturation queued jobs for tens of ms on a 16-core host.
    pub threads: usize,
    /// Task polls between a busy generator thread's looks at the sockets (as the service's
    /// `http_event_interval`: a task parses a reply of thousands of floats).
    pub event_interval: u32,
    /// Stall probes in the generator (a thread and a task on its runtime, [`crate::probe`])
    /// note every wake-up later than this into [`LoadReport::stalls`] (`None`: no probes).
    pub stall_probe: Option<Duration>,
    /// Before the measured run, the same load for this long, on the same runtime and the same
    /// connections, with the same arrival times as the run's start; not counted, its own
    /// report kept in [`LoadReport::warmup`]. A fresh process grows its heaps (each thread's
    /// malloc arena a page at a time), pools and buffers to the load's high-water mark once; a
    /// warm-up pays for that before the clock starts, as the bench suite's warm process does.
    /// `Duration::ZERO` (the default): none.
    pub warmup: Duration,
}

/// The probes' threshold by default: four of their 1 ms ticks.
pub const DEFAULT_STALL_PROBE: Duration = Duration::from_millis(4);

impl LoadConfig {
    /// `arrivals` at `addr` for `duration`, one-row JSON jobs, 64 connections.
    pub fn new(addr: SocketAddr, arrivals: Arrivals, duration: Duration) -> LoadConfig {
        LoadConfig {
            addr,
            arrivals,
            rows: 1,
            max_jobs: None,
            duration,
            connections: 64,
            timeout: Duration::from_secs(30),
            format: Format::Json,
            priority: None,
            tenant: None,
            seed: 1,
            threads: default_threads(),
            event_interval: crate::DEFAULT_EVENT_INTERVAL,
            stall_probe: Some(DEFAULT_STALL_PROBE),
            warmup: Duration::ZERO,
        }
    }

    /// The warm-up [`LoadConfig::warmup`] asks for: this load for that long, uncapped in
    /// jobs (`None`: no warm-up).
    fn warmup_config(&self) -> Option<LoadConfig> {
        (!self.warmup.is_zero()).then(|| LoadConfig {
            duration: self.warmup,
            max_jobs: None,
            warmup: Duration::ZERO,
            ..self.clone()
        })
    }
}

/// What a load run saw.
#[derive(Debug, Clone, Default)]
pub struct LoadReport {
    /// µs from each answered job being due (open loop) or sent (closed loop) to its answer.
    pub latency_us: Vec<f64>,
    /// Seconds from the run's start to when each answered job was due or sent (the same
    /// order as `latency_us`): when in the run the slow jobs were.
    pub sent_at_s: Vec<f64>,
    /// µs from each answered job being due to its task starting (the generator's own lag;
    /// 0 in a closed loop), and its client's wait for a ready connection.
    pub lag_us: Vec<f64>,
    pub connect_us: Vec<f64>,
    /// The part of `lag_us` before the pacing thread handed the job to the runtime (the
    /// rest is the runtime's wait to start its task; 0 in a closed loop).
    pub pace_us: Vec<f64>,
    /// The service's `submit_us`, `queue_us` and `run_us` (its batch's run time) of each
    /// answered job.
    pub submit_us: Vec<f64>,
    pub queue_us: Vec<f64>,
    pub run_us: Vec<f64>,
    /// µs from the generator handing each answered job's request to its connection to the
    /// service accepting the request's headers, and from the service handing the reply to
    /// hyper to the generator having read all of it (wall clocks of the one host; NaN where
    /// the service sent no clocks). A stall of the service's HTTP side shows in the first,
    /// one of the generator (or of the way back) in the second.
    pub to_service_us: Vec<f64>,
    pub from_service_us: Vec<f64>,
    /// The sum over answered jobs of the rows of the batch each ran in.
    pub batch_rows_sum: f64,
    /// Jobs sent.
    pub sent: u64,
    /// Failed jobs by kind (`Failure::key`: the status, `timeout`, `io`, ...).
    pub failures: BTreeMap<String, u64>,
    /// The first failure's text, for a message.
    pub first_failure: Option<String>,
    /// From the first job to the last answer.
    pub elapsed: Duration,
    /// The generator's stalls its probes saw during the run (`LoadConfig::stall_probe`).
    pub stalls: Vec<Stall>,
    /// The wall clock at the run's start (µs since the Unix epoch): `sent_at_s` and the
    /// stalls' times are against it.
    pub started_unix_us: u64,
    /// Jobs a second offered (open loop: the rate asked for).
    pub offered_per_s: Option<f64>,
    /// The warm-up's own report ([`LoadConfig::warmup`]; `None`: there was none): whether
    /// a stall of a fresh process came there instead of in the run.
    pub warmup: Option<Box<LoadReport>>,
}

/// Answered jobs a report keeps room for from the start, at most: 1 M jobs (10 figures of
/// 8 bytes: 80 MiB, reserved and written through before the run); a longer run grows past
/// it.
const MAX_RESERVED_JOBS: usize = 1 << 20;

impl LoadReport {
    /// An empty report with room for `jobs` answered jobs (at most `MAX_RESERVED_JOBS`, 1 M):
    /// a run at 24,000 jobs/s would otherwise double and copy its figures as it goes, on
    /// the thread that gathers the answers.
    pub fn with_capacity(jobs: usize) -> LoadReport {
        let n = jobs.min(MAX_RESERVED_JOBS);
        // Written once through (not `vec![0.0; n]`: calloc leaves fresh pages untouched), so
        // the run does not take the page faults as it fills them.
        let v = || {
            let mut v = Vec::with_capacity(n);
            v.resize(n, 0.0);
            std::hint::black_box(&mut v);
            v.clear();
            v
        };
        LoadReport {
            latency_us: v(),
            sent_at_s: v(),
            lag_us: v(),
            connect_us: v(),
            pace_us: v(),
            submit_us: v(),
            queue_us: v(),
            run_us: v(),
            to_service_us: v(),
            from_service_us: v(),
            ..LoadReport::default()
        }
    }

    /// Answered jobs.
    pub fn answered(&self) -> u64 {
        self.latency_us.len() as u64
    }

    /// Failed jobs.
    pub fn failed(&self) -> u64 {
        self.failures.values().sum()
    }

    /// Answered jobs a second.
    pub fn jobs_per_s(&self) -> f64 {
        self.answered() as f64 / self.elapsed.as_secs_f64().max(1e-9)
    }

    /// The mean size (rows) of the batches answered jobs ran in.
    pub fn mean_batch_rows(&self) -> f64 {
        self.batch_rows_sum / (self.answered().max(1) as f64)
    }

    /// Counts a job due (or sent) at `since`, in a run that started at `start`, whose answer
    /// came at `answered`.
    fn record(
        &mut self,
        start: Instant,
        (since, paced, began, answered): (Instant, Instant, Instant, Instant),
        outcome: Result<JobResult, Failure>,
    ) {
        match outcome {
            Ok(r) => {
                let took = answered.saturating_duration_since(since);
                self.latency_us.push(took.as_secs_f64() * 1e6);
                self.sent_at_s
                    .push(since.saturating_duration_since(start).as_secs_f64());
                self.lag_us
                    .push(began.saturating_duration_since(since).as_secs_f64() * 1e6);
                self.pace_us
                    .push(paced.saturating_duration_since(since).as_secs_f64() * 1e6);
                self.connect_us.push(r.connect_us);
                self.submit_us.push(r.submit_us);
                self.queue_us.push(r.queue_us);
                self.run_us.push(r.run_us);
                self.to_service_us.push(r.accepted_unix_us - r.sent_unix_us);
                self.from_service_us
                    .push(r.received_unix_us - r.replied_unix_us);
                self.batch_rows_sum += r.batch_rows as f64;
            }
            Err(f) => {
                if self.first_failure.is_none() {
                    self.first_failure = Some(f.to_string());
                }
                *self.failures.entry(f.key()).or_insert(0) += 1;
            }
        }
    }
}

/// Why a load could not run at all (a job's failure is counted in the report instead).
#[derive(Debug, Clone, PartialEq)]
pub struct LoadError(pub String);

impl std::fmt::Display for LoadError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "load: {}", self.0)
    }
}

impl std::error::Error for LoadError {}

/// A quarter of this machine's cores, 2 to 8: [`LoadConfig::threads`]' default.
pub fn default_threads() -> usize {
    std::thread::available_parallelism().map_or(2, |n| (n.get() / 4).clamp(2, 8))
}

/// Runs `config` on a tokio runtime of its own (`config.threads` threads) and reports.
pub fn run(config: &LoadConfig) -> Result<LoadReport, LoadError> {
    check(config)?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(config.threads.clamp(1, 64))
        .event_interval(config.event_interval.max(1))
        .thread_name("warpdrive-load")
        .enable_all()
        .build()
        .map_err(|e| LoadError(format!("tokio runtime: {e}")))?;
    runtime.block_on(run_async(config))
}

fn check(config: &LoadConfig) -> Result<(), LoadError> {
    if !config.addr.ip().is_loopback() {
        return Err(LoadError(format!(
            "{} is not a loopback address (load runs against this machine only)",
            config.addr
        )));
    }
    match config.arrivals {
        Arrivals::Poisson { per_s } if !(per_s.is_finite() && per_s > 0.0) => {
            return Err(LoadError(format!("a rate of {per_s} jobs/s")))
        }
        Arrivals::Clients(0) => return Err(LoadError("0 clients".into())),
        _ => {}
    }
    if config.rows == 0 || config.connections == 0 || config.max_jobs == Some(0) {
        return Err(LoadError(
            "rows, connections and jobs must be at least 1".into(),
        ));
    }
    Ok(())
}

/// The job `config` sends, encoded once for `client` (the generator's own work per job stays
/// out of the service's way), and the generator's random numbers after its values.
async fn prepare(
    config: &LoadConfig,
    client: &Client,
) -> Result<(Arc<Encoded>, rand::rngs::StdRng), LoadError> {
    let width = client
        .model()
        .await
        .map_err(|e| LoadError(format!("asking {} for its model: {e}", config.addr)))?
        .width;
    let rows_values = config
        .rows
        .checked_mul(width)
        .ok_or_else(|| LoadError(format!("{} rows of {width}", config.rows)))?;
    let mut rng = rand::rngs::StdRng::seed_from_u64(config.seed);
    let data: Vec<f32> = (0..rows_values)
        .map(|_| rng.random_range(-1.0f32..1.0))
        .collect();
    let job = Arc::new(
        client
            .encode(&JobSpec {
                rows: config.rows,
                data,
                priority: config.priority,
                tenant: config.tenant.clone(),
                deadline: None,
            })
            .map_err(|e| LoadError(format!("encoding the job: {e}")))?,
    );
    Ok((job, rng))
}

/// The same as [`run`], on the caller's tokio runtime.
pub async fn run_async(config: &LoadConfig) -> Result<LoadReport, LoadError> {
    check(config)?;
    let connections = match config.arrivals {
        Arrivals::Clients(n) => n,
        Arrivals::Poisson { .. } => config.connections,
    };
    let client = Client::new(
        config.addr,
        ClientConfig {
            max_connections: connections,
            timeout: config.timeout,
            format: config.format,
        },
    );
    let (job, rng) = prepare(config, &client).await?;
    // The warm-up offers the run's own first arrivals (the same random numbers).
    let warm = match config.warmup_config() {
        Some(w) => Some(Box::new(
            measure(&w, &client, job.clone(), rng.clone()).await,
        )),
        None => None,
    };
    let mut report = measure(config, &client, job, rng).await;
    report.warmup = warm;
    Ok(report)
}

/// One run of `config`'s load through `client`, `job` its every job and `rng` its arrivals.
async fn measure(
    config: &LoadConfig,
    client: &Client,
    job: Arc<Encoded>,
    rng: rand::rngs::StdRng,
) -> LoadReport {
    let client = client.clone();
    let mut report = LoadReport::with_capacity(expected_jobs(config));
    let probes = config
        .stall_probe
        .map(|t| Probes::start(&tokio::runtime::Handle::current(), t, |_| {}));
    let start = Instant::now();
    report.started_unix_us = crate::wire::unix_us_now();
    let stop = crate::later(start, config.duration);
    let max_jobs = config.max_jobs.unwrap_or(u64::MAX);
    match config.arrivals {
        Arrivals::Poisson { per_s } => {
            open_loop(
                config,
                per_s,
                (client, job, rng),
                &mut report,
                (start, stop),
            )
            .await
        }
        Arrivals::Clients(n) => {
            let sent = Arc::new(AtomicU64::new(0));
            let mut clients = JoinSet::new();
            for _ in 0..n {
                let (client, job, sent) = (client.clone(), job.clone(), sent.clone());
                clients.spawn(async move {
                    let mut mine = LoadReport::default();
                    while Instant::now() < stop && sent.fetch_add(1, Ordering::Relaxed) < max_jobs {
                        let t = Instant::now();
                        mine.sent += 1;
                        let outcome = client.submit_encoded(&job).await;
                        mine.record(start, (t, t, t, Instant::now()), outcome);
                    }
                    mine
                });
            }
            let drain = crate::later(stop, config.timeout);
            loop {
                match tokio::time::timeout_at(drain.into(), clients.join_next()).await {
                    Ok(Some(Ok(mine))) => merge(&mut report, mine),
                    Ok(Some(Err(e))) => count(&mut report, "panicked", e.to_string()),
                    Ok(None) => break,
                    Err(_) => {
                        count(&mut report, "timeout", "the run's drain timed out".into());
                        clients.abort_all();
                        break;
                    }
                }
            }
        }
    }
    report.elapsed = start.elapsed();
    if let Some(p) = probes {
        report.stalls = p.finish();
    }
    report
}

/// What one open-loop job came to: when it was due, when the pacer handed it over, when its
/// task began, when its answer came, the answer.
type Done = (
    Instant,
    Instant,
    Instant,
    Instant,
    Result<JobResult, Failure>,
);

/// Poisson arrivals at `per_s` from `start` until `stop` (or `max_jobs`). A thread of its
/// own paces them with the OS's sleep (tens of µs late, where tokio's timer rounds every
/// wake-up to its millisecond tick, and each job is timed from when it was due) and hands
/// each job to this runtime; each job's task times its own answer.
async fn open_loop(
    config: &LoadConfig,
    per_s: f64,
    (client, job, rng): (Client, Arc<Encoded>, rand::rngs::StdRng),
    report: &mut LoadReport,
    (start, stop): (Instant, Instant),
) {
    report.offered_per_s = Some(per_s);
    let max_jobs = config.max_jobs.unwrap_or(u64::MAX);
    let (tx, mut answers) = tokio::sync::mpsc::unbounded_channel::<Done>();
    let sent = Arc::new(AtomicU64::new(0));
    let handle = tokio::runtime::Handle::current();
    let paced = sent.clone();
    let pacer = std::thread::Builder::new()
        .name("warpdrive-load-pacer".into())
        .spawn(move || {
            let going = || !tx.is_closed();
            pace(
                per_s,
                rng,
                (start, stop),
                (max_jobs, &paced),
                going,
                |due, handed| {
                    let (client, job, tx) = (client.clone(), job.clone(), tx.clone());
                    handle.spawn(async move {
                        let _ = tx.send(one_job(client, job, (due, handed)).await);
                    });
                },
            );
        });
    if let Err(e) = pacer {
        count(report, "io", format!("the pacing thread: {e}"));
        return;
    }
    // Every job's task ends within the client's timeout; this bounds the whole drain too.
    // The channel ends once the pacer and every job's task are done with it.
    // One timer for the whole drain: a timeout around each `recv` would insert and remove
    // an entry in the runtime's one timer wheel (under its lock, from this thread, outside
    // the runtime) for every answer, 24,000 times a second.
    let drain = crate::later(stop, config.timeout.saturating_add(Duration::from_secs(1)));
    let mut got = 0u64;
    let gather = async {
        while let Some((due, handed, began, answered, outcome)) = answers.recv().await {
            got += 1;
            report.record(start, (due, handed, began, answered), outcome);
        }
    };
    let _ = tokio::time::timeout_at(drain.into(), gather).await;
    answers.close();
    report.sent = sent.load(Ordering::Acquire);
    count_unanswered(report, got);
}

/// Counts the jobs sent but not heard of by the drain's end as timed out (or panicked).
fn count_unanswered(report: &mut LoadReport, got: u64) {
    if let Some(left) = report.sent.checked_sub(got).filter(|&l| l > 0) {
        *report.failures.entry("timeout".into()).or_insert(0) += left;
        report
            .first_failure
            .get_or_insert_with(|| format!("{left} jobs unanswered when the run's drain ended"));
    }
}

/// Paces Poisson arrivals at `per_s` from `start` until `stop`, while `sent` is under
/// `max_jobs` and `going()` holds: sleeps until each job is due, counts it in `sent` and
/// calls `hand(due, handed)`, `handed` being the moment it was handed on.
fn pace(
    per_s: f64,
    mut rng: rand::rngs::StdRng,
    (start, stop): (Instant, Instant),
    (max_jobs, sent): (u64, &AtomicU64),
    going: impl Fn() -> bool,
    mut hand: impl FnMut(Instant, Instant),
) {
    let mut due = start;
    while sent.load(Ordering::Relaxed) < max_jobs && going() {
        // Exponential gaps: -ln(1 - u) / rate, u in [0, 1).
        let u: f64 = rng.random();
        let gap = Duration::try_from_secs_f64(-(1.0 - u).ln() / per_s).unwrap_or(Duration::MAX);
        due = crate::later(due, gap);
        if due >= stop {
            break;
        }
        std::thread::sleep(due.saturating_duration_since(Instant::now()));
        sent.fetch_add(1, Ordering::Release);
        hand(due, Instant::now());
    }
}

/// One open-loop job due at `due` and handed to its runtime at `handed`: its task times its
/// own start and answer.
async fn one_job(client: Client, job: Arc<Encoded>, (due, handed): (Instant, Instant)) -> Done {
    let began = Instant::now();
    let outcome = client.submit_encoded(&job).await;
    let answered = Instant::now();
    // The rows are freed here, on the thread that allocated them, not on the gathering thread
    // (glibc: a free into another thread's arena takes that arena's lock and may trim it);
    // the report keeps none of them.
    let outcome = outcome.map(|r| r.clone_stats());
    (due, handed, began, answered, outcome)
}

/// The most jobs `config` is likely to send: its job cap, or an open loop's rate over its
/// time with six standard deviations of Poisson spread (a closed loop's clients keep
/// reports of their own, merged once at the end).
fn expected_jobs(config: &LoadConfig) -> usize {
    let cap = config
        .max_jobs
        .map_or(usize::MAX, |m| usize::try_from(m).unwrap_or(usize::MAX));
    let likely = match config.arrivals {
        Arrivals::Poisson { per_s } => {
            let mean = per_s * config.duration.as_secs_f64();
            let n = mean + 6.0 * mean.sqrt() + 64.0;
            // `as` saturates (NaN to 0); `check` has refused a rate that is not finite.
            if n.is_finite() {
                n as usize
            } else {
                MAX_RESERVED_JOBS
            }
        }
        Arrivals::Clients(_) => 0,
    };
    likely.min(cap).min(MAX_RESERVED_JOBS)
}

fn count(report: &mut LoadReport, key: &str, why: String) {
    *report.failures.entry(key.into()).or_insert(0) += 1;
    report.first_failure.get_or_insert(why);
}

fn merge(report: &mut LoadReport, mine: LoadReport) {
    report.latency_us.extend(mine.latency_us);
    report.sent_at_s.extend(mine.sent_at_s);
    report.lag_us.extend(mine.lag_us);
    report.pace_us.extend(mine.pace_us);
    report.connect_us.extend(mine.connect_us);
    report.submit_us.extend(mine.submit_us);
    report.queue_us.extend(mine.queue_us);
    report.run_us.extend(mine.run_us);
    report.to_service_us.extend(mine.to_service_us);
    report.from_service_us.extend(mine.from_service_us);
    report.batch_rows_sum += mine.batch_rows_sum;
    report.sent += mine.sent;
    for (k, v) in mine.failures {
        *report.failures.entry(k).or_insert(0) += v;
    }
    if report.first_failure.is_none() {
        report.first_failure = mine.first_failure;
    }
}
