//! The HTTP side: a tokio runtime on a thread of its own accepting connections (at most
//! `max_connections`), hyper's HTTP/1.1 per connection, the routes, and admission (body,
//! shape, class, deadline, tenant budget) before a job is queued.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::Incoming;
use hyper::header::{HeaderMap, HeaderValue, CONTENT_TYPE, LOCATION, RETRY_AFTER};
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use tokio::sync::{oneshot, watch, Semaphore};
use warpdrive::{Error, Result};

use super::batcher::{self, Job, JobError, ServeConfig, Shared};
use super::budget::{tenant_name, Budgets};
use super::client::{DEADLINE_HEADER, PRIORITY_HEADER, TENANT_HEADER};
use super::dashboard;
use super::model::Model;
use super::probe::{Probes, Stall};
use super::queue::{Refused, CLASSES, DEFAULT_PRIORITY};
use super::reply;
use super::results::{Fetched, Results};
use super::stats::Status;
use super::wire::{self, Format};

/// A reply's body: whole, or a stream (the dashboard's events).
pub(crate) type Body = BoxBody<Bytes, Infallible>;

/// A running service. Dropping it (or [`Server::stop`]) stops accepting, refuses new jobs
/// with 503, answers every job already queued, waits up to `drain_timeout` for the replies
/// to go out and joins its threads.
pub struct Server {
    /// The address it listens on (the port the OS chose when asked for port 0).
    pub addr: SocketAddr,
    shared: Arc<Shared>,
    stop: Option<watch::Sender<bool>>,
    http: Option<JoinHandle<()>>,
    batcher: Vec<JoinHandle<()>>,
    probes: Option<Probes>,
}

pub(crate) struct State {
    pub(crate) shared: Arc<Shared>,
    pub(crate) config: ServeConfig,
    budgets: Arc<Budgets>,
    results: Arc<Results>,
    /// Set once the service is stopping (the dashboard's streams end).
    pub(crate) stopping: watch::Receiver<bool>,
}

impl Server {
    /// Serves the model `make` makes (on the batcher's thread) at `config.addr`, with one
    /// batcher thread (`config.workers` must be 1; see [`Server::start_workers`]).
    pub fn start(
        make: impl FnOnce() -> Result<Box<dyn Model>> + Send + 'static,
        config: ServeConfig,
    ) -> Result<Server> {
        if config.workers != 1 {
            return Err(Error::InvalidArgument(format!(
                "serve: {} workers need a model per worker: Server::start_workers",
                config.workers
            )));
        }
        let once = parking_lot::Mutex::new(Some(make));
        Server::start_workers(
            move || match once.lock().take() {
                Some(make) => make(),
                None => Err(Error::InvalidArgument(
                    "serve: this model can be made once".into(),
                )),
            },
            config,
        )
    }

    /// Serves with `config.workers` batcher threads, each with the model `make` makes on it.
    pub fn start_workers(
        make: impl Fn() -> Result<Box<dyn Model>> + Send + Sync + 'static,
        config: ServeConfig,
    ) -> Result<Server> {
        let listener = std::net::TcpListener::bind(config.addr)
            .and_then(|l| l.set_nonblocking(true).map(|()| l))
            .map_err(|e| Error::InvalidArgument(format!("serve: binding {}: {e}", config.addr)))?;
        let addr = listener
            .local_addr()
            .map_err(|e| Error::InvalidArgument(format!("serve: local address: {e}")))?;
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(config.http_threads.clamp(1, 64))
            .event_interval(config.http_event_interval.max(1))
            .thread_name("warpdrive-http")
            .enable_all()
            .build()
            .map_err(|e| Error::InvalidArgument(format!("serve: tokio runtime: {e}")))?;
        // Installs the metrics recorder now, so the service's counters count from the start
        // (a process with a recorder of its own answers /metrics with 503).
        if let Err(e) = warpdrive::telemetry::render_prometheus() {
            tracing::warn!("serve: /metrics unavailable: {e}");
        }
        let (shared, batcher) = batcher::start(Arc::new(make), &config)?;
        let probes = config
            .stall_probe
            .map(|t| Probes::start(runtime.handle(), t, warn_stall));
        let budgets = Arc::new(Budgets::new(
            config.budget,
            config.tenant_budgets.clone(),
            config.max_tenants,
        ));
        let (stop, stopped) = watch::channel(false);
        let results = Arc::new(Results::new(config.result_slots, config.result_ttl));
        let state = Arc::new(State {
            shared: shared.clone(),
            config,
            budgets,
            results,
            stopping: stopped.clone(),
        });
        let http = std::thread::Builder::new()
            .name("warpdrive-serve".into())
            .spawn(move || runtime.block_on(accept(listener, state, stopped)))
            .map_err(|e| Error::InvalidArgument(format!("serve: server thread: {e}")))?;
        Ok(Server {
            addr,
            shared,
            stop: Some(stop),
            http: Some(http),
            batcher,
            probes,
        })
    }

    /// The status the batcher published last (`GET /v1/status`).
    pub fn status(&self) -> Status {
        self.shared.status.lock().clone()
    }

    /// Seconds the model has run since the start, up to the last batch that ended (exact,
    /// unlike the status's copy, which is as of the last interval).
    pub fn busy_seconds_total(&self) -> f64 {
        self.shared.busy_ns.load(Ordering::Acquire) as f64 * 1e-9
    }

    /// Jobs answered with rows since the start (counted once their batch's run time is in
    /// [`Server::busy_seconds_total`]).
    pub fn jobs_answered(&self) -> u64 {
        self.shared.answered.load(Ordering::Acquire)
    }

    /// Jobs queued now (not yet taken into a batch).
    pub fn queued(&self) -> usize {
        self.shared.queued()
    }

    /// Stops as dropping does, and returns once every thread has ended.
    pub fn stop(mut self) {
        self.shut_down();
    }

    /// Serves until Ctrl-C, SIGTERM or `limit` (when given), then stops.
    pub fn run_until_stopped(self, limit: Option<Duration>) {
        let waited = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map(|rt| {
                rt.block_on(async {
                    let limit = async {
                        match limit {
                            Some(l) => tokio::time::sleep(l).await,
                            None => std::future::pending().await,
                        }
                    };
                    let interrupted = async {
                        // A process that cannot watch for Ctrl-C waits for the rest.
                        if tokio::signal::ctrl_c().await.is_err() {
                            std::future::pending::<()>().await;
                        }
                    };
                    tokio::select! {
                        _ = interrupted => {}
                        _ = terminated() => {}
                        _ = limit => {}
                    }
                })
            });
        if let Err(e) = waited {
            tracing::error!("serve: waiting for a signal: {e}");
        }
        self.stop();
    }

    fn shut_down(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(true);
        }
        if let Some(t) = self.http.take() {
            let _ = t.join();
        }
        // The HTTP side closed the queue; this makes sure of it if that thread died.
        self.shared.close();
        for t in self.batcher.drain(..) {
            let _ = t.join();
        }
        self.probes = None;
    }
}

/// A stall a probe of the service saw, in its log: the wall clock lines it up with a load
/// generator's per-job times on the same host.
fn warn_stall(s: &Stall) {
    tracing::warn!(
        "serve: stall probe ({}): no wake-up for {:.1} ms, until unix {:.6} s{}",
        s.probe.name(),
        s.gap_us * 1e-3,
        s.until_unix_us as f64 * 1e-6,
        s.threads
            .as_ref()
            .map_or(String::new(), |t| format!("; threads: {t}"))
    );
}

impl Drop for Server {
    fn drop(&mut self) {
        self.shut_down();
    }
}

#[cfg(unix)]
async fn terminated() {
    use tokio::signal::unix::{signal, SignalKind};
    match signal(SignalKind::terminate()) {
        Ok(mut s) => {
            s.recv().await;
        }
        Err(_) => std::future::pending().await,
    }
}

#[cfg(not(unix))]
async fn terminated() {
    std::future::pending().await
}

async fn accept(
    listener: std::net::TcpListener,
    state: Arc<State>,
    mut stopped: watch::Receiver<bool>,
) {
    let listener = match tokio::net::TcpListener::from_std(listener) {
        Ok(l) => l,
        Err(e) => {
            tracing::error!("serve: listener: {e}");
            state.shared.close();
            return;
        }
    };
    let graceful = GracefulShutdown::new();
    let open = Arc::new(Semaphore::new(state.config.max_connections.max(1)));
    loop {
        tokio::select! {
            accepted = listener.accept() => {
                let Ok((stream, _)) = accepted else { continue };
                let Ok(permit) = open.clone().try_acquire_owned() else {
                    metrics::counter!("warpdrive_serve_connections_refused_total").increment(1);
                    drop(stream);
                    continue;
                };
                let _ = stream.set_nodelay(true);
                let s = state.clone();
                let conn = http1::Builder::new()
                    .timer(TokioTimer::new())
                    .header_read_timeout(state.config.body_timeout)
                    .serve_connection(
                        TokioIo::new(stream),
                        service_fn(move |req| route(req, s.clone())),
                    );
                let conn = graceful.watch(conn);
                tokio::spawn(async move {
                    if let Err(e) = conn.await {
                        tracing::debug!("serve: connection ended: {e}");
                    }
                    drop(permit);
                });
            }
            _ = stopped.changed() => break,
        }
    }
    drop(listener);
    // New jobs get 503 from here on; the batcher answers every queued one, and each
    // connection closes once its request in flight has its reply.
    state.shared.close();
    if tokio::time::timeout(state.config.drain_timeout, graceful.shutdown())
        .await
        .is_err()
    {
        tracing::warn!(
            "serve: connections still open after {:?}; closing them",
            state.config.drain_timeout
        );
    }
}

pub(crate) fn reply(status: StatusCode, body: impl Into<Bytes>) -> Response<Body> {
    let mut r = Response::new(Full::new(body.into()).boxed());
    *r.status_mut() = status;
    r
}

fn refuse(status: StatusCode, why: &str) -> Response<Body> {
    reply(status, format!("{why}\n"))
}

fn typed(mut r: Response<Body>, content_type: &'static str) -> Response<Body> {
    r.headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static(content_type));
    r
}

const ENDPOINTS: &str =
    "/, /v1/jobs, /v1/jobs/ID, /v1/model, /v1/status, /v1/events, /health, /metrics";

async fn route(
    req: Request<Incoming>,
    state: Arc<State>,
) -> std::result::Result<Response<Body>, Infallible> {
    Ok(match (req.method(), req.uri().path()) {
        (&Method::GET, "/health") => {
            if state.shared.healthy.load(Ordering::Acquire) {
                reply(StatusCode::OK, "ok\n")
            } else {
                refuse(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "unhealthy: the device faulted",
                )
            }
        }
        (&Method::POST, "/v1/jobs") => {
            let r = submit(req, &state).await;
            if r.status() != StatusCode::OK {
                let status = r.status().as_u16().to_string();
                metrics::counter!("warpdrive_serve_refused_total", "status" => status).increment(1);
            }
            r
        }
        (&Method::GET, p) if p.starts_with("/v1/jobs/") => {
            fetch(p, req.uri().query(), &state).await
        }
        (_, p) if p.starts_with("/v1/jobs/") => {
            refuse(StatusCode::METHOD_NOT_ALLOWED, "method not allowed")
        }
        (&Method::GET, "/v1/model") => {
            let info =
                serde_json::json!({ "name": state.shared.name, "width": state.shared.width });
            typed(reply(StatusCode::OK, info.to_string()), wire::JSON_TYPE)
        }
        (&Method::GET, "/v1/status") => {
            let status = state.shared.status.lock().clone();
            match serde_json::to_vec(&status) {
                Ok(v) => typed(reply(StatusCode::OK, v), wire::JSON_TYPE),
                Err(e) => refuse(StatusCode::INTERNAL_SERVER_ERROR, &e.to_string()),
            }
        }
        (&Method::GET, "/") => typed(
            reply(StatusCode::OK, dashboard::PAGE),
            "text/html; charset=utf-8",
        ),
        (&Method::GET, "/v1/events") => dashboard::events(&state, req.uri().query()),
        (&Method::GET, "/metrics") => match warpdrive::telemetry::render_prometheus() {
            Ok(text) => typed(reply(StatusCode::OK, text), "text/plain; version=0.0.4"),
            Err(e) => refuse(StatusCode::SERVICE_UNAVAILABLE, &e.to_string()),
        },
        (
            _,
            "/" | "/health" | "/v1/jobs" | "/v1/model" | "/v1/status" | "/v1/events" | "/metrics",
        ) => refuse(StatusCode::METHOD_NOT_ALLOWED, "method not allowed"),
        _ => refuse(
            StatusCode::NOT_FOUND,
            &format!("no such endpoint: {ENDPOINTS}"),
        ),
    })
}

/// A job's class, tenant and deadline from its headers.
struct Meta<'a> {
    class: usize,
    tenant: &'a str,
    deadline: Duration,
}

fn meta<'a>(headers: &'a HeaderMap, config: &ServeConfig) -> std::result::Result<Meta<'a>, String> {
    let text = |name: &str| headers.get(name).map(|v| v.to_str().unwrap_or("?"));
    let class = match text(PRIORITY_HEADER) {
        None => DEFAULT_PRIORITY as usize,
        Some(p) => match p.trim().parse::<usize>() {
            Ok(c) if c < CLASSES => c,
            _ => {
                return Err(format!(
                    "{PRIORITY_HEADER}: {p:?}: expected 0 (lowest) to {}",
                    CLASSES - 1
                ))
            }
        },
    };
    let deadline = match text(DEADLINE_HEADER) {
        None => config.job_timeout,
        Some(d) => match d.trim().parse::<u64>() {
            Ok(ms) if ms > 0 => Duration::from_millis(ms).min(config.job_timeout),
            _ => {
                return Err(format!(
                    "{DEADLINE_HEADER}: {d:?}: expected milliseconds, 1 or more"
                ))
            }
        },
    };
    let tenant = tenant_name(headers.get(TENANT_HEADER).map(HeaderValue::as_bytes))
        .map_err(|e| format!("{TENANT_HEADER}: {e}"))?;
    Ok(Meta {
        class,
        tenant,
        deadline,
    })
}

async fn submit(req: Request<Incoming>, state: &State) -> Response<Body> {
    let accepted = Instant::now();
    let accepted_unix_us = wire::unix_us_now();
    let config = &state.config;
    let (parts, body) = req.into_parts();
    let format = match wire::format_of(
        parts
            .headers
            .get(CONTENT_TYPE)
            .map(|v| v.to_str().unwrap_or("?")),
    ) {
        Ok(f) => f,
        Err(e) => return refuse(StatusCode::UNSUPPORTED_MEDIA_TYPE, &e.why),
    };
    let meta = match meta(&parts.headers, config) {
        Ok(m) => m,
        Err(why) => return refuse(StatusCode::BAD_REQUEST, &why),
    };
    let asynchronous = match asynchronous(parts.uri.query()) {
        Ok(a) => a,
        Err(why) => return refuse(StatusCode::BAD_REQUEST, &why),
    };
    let body = Limited::new(body, config.max_body_bytes);
    let bytes = match tokio::time::timeout(config.body_timeout, body.collect()).await {
        Err(_) => {
            return refuse(
                StatusCode::REQUEST_TIMEOUT,
                "the body did not arrive in time",
            )
        }
        Ok(Err(e))
            if e.downcast_ref::<http_body_util::LengthLimitError>()
                .is_some() =>
        {
            return refuse(
                StatusCode::PAYLOAD_TOO_LARGE,
                &format!("a body over {} bytes", config.max_body_bytes),
            )
        }
        Ok(Err(e)) => return refuse(StatusCode::BAD_REQUEST, &format!("reading the body: {e}")),
        Ok(Ok(b)) => b.to_bytes(),
    };
    let shared = &state.shared;
    let job = match wire::decode(format, &bytes, shared.width) {
        Ok(t) => t,
        Err(e) => {
            return refuse(
                StatusCode::BAD_REQUEST,
                &format!("{} for {}", e.why, shared.name),
            )
        }
    };
    drop(bytes);
    if !shared.healthy.load(Ordering::Acquire) {
        return refuse(
            StatusCode::SERVICE_UNAVAILABLE,
            "unhealthy: the device faulted",
        );
    }
    // What the job holds while in flight: its input and its output, as f32.
    let held = job
        .data
        .len()
        .saturating_mul(2 * std::mem::size_of::<f32>());
    let grant = match state.budgets.admit(meta.tenant, held, Instant::now()) {
        Ok(g) => g,
        Err(over) => {
            let status =
                StatusCode::from_u16(over.status()).unwrap_or(StatusCode::TOO_MANY_REQUESTS);
            let mut r = refuse(status, &over.message(meta.tenant));
            if let Some(s) = over.retry_after_s() {
                r.headers_mut().insert(RETRY_AFTER, HeaderValue::from(s));
            }
            return r;
        }
    };
    let slot = if asynchronous {
        match state.results.reserve(Instant::now()) {
            Some(id) => Some(id),
            None => {
                return refuse(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "too many results wait to be fetched; try again",
                )
            }
        }
    } else {
        None
    };
    let (tx, rx) = oneshot::channel();
    let arrived = Instant::now();
    let queued = Job {
        data: job.data,
        rows: job.rows,
        class: meta.class,
        tenant: meta.tenant.to_string(),
        arrived,
        deadline: crate::later(arrived, meta.deadline),
        reply: tx,
    };
    let queued = match shared.submit(queued) {
        Ok(at) => at,
        Err((refused, _)) => {
            if let Some(id) = slot {
                state.results.release(id);
            }
            return match refused {
                Refused::Full => refuse(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "the queue is full; try again",
                ),
                Refused::Closed => {
                    refuse(StatusCode::SERVICE_UNAVAILABLE, "the service is stopping")
                }
            };
        }
    };
    let submit_us = queued.duration_since(accepted).as_secs_f64() * 1e6;
    let (rows, deadline, job_timeout) = (job.rows, meta.deadline, config.job_timeout);
    // The job's own deadline bounds its wait for a batch, this the whole of it; past it the
    // reply is dropped here and the batcher skips the job. The grant is held to the end.
    let outcome = async move {
        let answer = tokio::time::timeout(job_timeout, rx).await;
        let reply = reply_of(
            answer,
            format,
            rows,
            deadline,
            (submit_us, accepted_unix_us),
        );
        drop(grant);
        reply
    };
    match slot {
        None => outcome.await,
        Some(id) => {
            let results = state.results.clone();
            tokio::spawn(async move { results.fulfil(id, outcome.await) });
            let body = serde_json::json!({
                "id": id,
                "status": "queued",
                "location": format!("/v1/jobs/{id}"),
                "submit_us": submit_us,
            });
            let mut r = typed(
                reply(StatusCode::ACCEPTED, body.to_string()),
                wire::JSON_TYPE,
            );
            if let Ok(v) = HeaderValue::from_str(&format!("/v1/jobs/{id}")) {
                r.headers_mut().insert(LOCATION, v);
            }
            r
        }
    }
}

/// What a job's answer (or the wait for it) says to its client.
fn reply_of(
    got: std::result::Result<
        std::result::Result<batcher::Answer, oneshot::error::RecvError>,
        tokio::time::error::Elapsed,
    >,
    format: Format,
    rows: usize,
    deadline: Duration,
    stamps: (f64, u64),
) -> Response<Body> {
    match got {
        Err(_) => refuse(
            StatusCode::GATEWAY_TIMEOUT,
            "the job did not finish in time",
        ),
        Ok(Err(_)) => refuse(
            StatusCode::INTERNAL_SERVER_ERROR,
            "the batcher dropped the job",
        ),
        Ok(Ok(Err(e))) => match e {
            JobError::Expired => refuse(
                StatusCode::GATEWAY_TIMEOUT,
                &format!("the job's deadline of {deadline:?} passed before it ran"),
            ),
            JobError::Unhealthy(why) => refuse(StatusCode::SERVICE_UNAVAILABLE, &why),
            JobError::Failed(why) => refuse(StatusCode::INTERNAL_SERVER_ERROR, &why),
            JobError::OverBudget(status, why) => refuse(
                StatusCode::from_u16(status).unwrap_or(StatusCode::TOO_MANY_REQUESTS),
                &why,
            ),
        },
        Ok(Ok(Ok((data, stats)))) => reply::answer(format, rows, data, stats, stamps),
    }
}

/// Whether a submission asks not to wait (`async=true` in its query).
fn asynchronous(query: Option<&str>) -> std::result::Result<bool, String> {
    match query_value(query, "async") {
        None | Some("false" | "0") => Ok(false),
        Some("true" | "1") => Ok(true),
        Some(v) => Err(format!("async={v}: expected true or false")),
    }
}

fn query_value<'a>(query: Option<&'a str>, key: &str) -> Option<&'a str> {
    query?
        .split('&')
        .filter_map(|p| p.split_once('='))
        .find(|(k, _)| *k == key)
        .map(|(_, v)| v)
}

/// The longest a fetch may wait for a result.
const MAX_FETCH_WAIT: Duration = Duration::from_secs(60);

/// `GET /v1/jobs/ID[?wait_ms=N]`: the reply of a job submitted with `async=true`, once.
async fn fetch(path: &str, query: Option<&str>, state: &State) -> Response<Body> {
    let Some(id) = path
        .strip_prefix("/v1/jobs/")
        .and_then(|i| i.parse::<u64>().ok())
    else {
        return refuse(StatusCode::NOT_FOUND, "a job id is a number: /v1/jobs/ID");
    };
    let wait = match query_value(query, "wait_ms").map(str::parse::<u64>) {
        None => Duration::ZERO,
        Some(Ok(ms)) => Duration::from_millis(ms).min(MAX_FETCH_WAIT),
        Some(Err(_)) => return refuse(StatusCode::BAD_REQUEST, "wait_ms: expected milliseconds"),
    };
    match state.results.fetch(id, wait).await {
        Fetched::Ready(r) => r,
        Fetched::Pending => {
            let body = serde_json::json!({ "id": id, "status": "pending" });
            typed(
                reply(StatusCode::ACCEPTED, body.to_string()),
                wire::JSON_TYPE,
            )
        }
        Fetched::Unknown => refuse(
            StatusCode::NOT_FOUND,
            &format!("no job {id} waiting to be fetched (unknown, fetched already, or expired)"),
        ),
    }
}
