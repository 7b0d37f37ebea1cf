//! The HTTP side: a tokio runtime on a thread of its own accepting connections, hyper's
//! HTTP/1.1 per connection, and the routes.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::mpsc::TrySendError;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Instant;

use bytes::Bytes;
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::Incoming;
use hyper::header::HeaderValue;
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::sync::{oneshot, watch};
use warpdrive::{Error, Result};

use super::batcher::{self, BatchStats, Job, Queue, ServeConfig};
use super::model::Model;
use super::wire::{self, Format, JsonReply};

/// A running service. Dropping it stops accepting, lets jobs in the queue finish and joins
/// its threads.
pub struct Server {
    /// The address it listens on (the port the OS chose when asked for port 0).
    pub addr: SocketAddr,
    stop: Option<watch::Sender<bool>>,
    http: Option<JoinHandle<()>>,
    batcher: Option<JoinHandle<()>>,
}

struct State {
    queue: Queue,
    config: ServeConfig,
}

impl Server {
    /// Serves the model `make` makes (on the batcher's thread) at `config.addr`.
    pub fn start(
        make: impl FnOnce() -> Result<Box<dyn Model>> + Send + 'static,
        config: ServeConfig,
    ) -> Result<Server> {
        let listener = std::net::TcpListener::bind(config.addr)
            .and_then(|l| l.set_nonblocking(true).map(|()| l))
            .map_err(|e| Error::InvalidArgument(format!("serve: binding {}: {e}", config.addr)))?;
        let addr = listener
            .local_addr()
            .map_err(|e| Error::InvalidArgument(format!("serve: local address: {e}")))?;
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("warpdrive-http")
            .enable_all()
            .build()
            .map_err(|e| Error::InvalidArgument(format!("serve: tokio runtime: {e}")))?;
        // Installs the metrics recorder now, so the service's counters count from the start
        // (a process with a recorder of its own answers /metrics with 503).
        if let Err(e) = warpdrive::telemetry::render_prometheus() {
            tracing::warn!("serve: /metrics unavailable: {e}");
        }
        let (queue, batcher) = batcher::start(Box::new(make), &config)?;
        let state = Arc::new(State { queue, config });
        let (stop, stopped) = watch::channel(false);
        let http = std::thread::Builder::new()
            .name("warpdrive-serve".into())
            .spawn(move || runtime.block_on(accept(listener, state, stopped)))
            .map_err(|e| Error::InvalidArgument(format!("serve: server thread: {e}")))?;
        Ok(Server {
            addr,
            stop: Some(stop),
            http: Some(http),
            batcher: Some(batcher),
        })
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(true);
        }
        if let Some(t) = self.http.take() {
            let _ = t.join();
        }
        if let Some(t) = self.batcher.take() {
            let _ = t.join();
        }
    }
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
            return;
        }
    };
    loop {
        tokio::select! {
            accepted = listener.accept() => {
                let Ok((stream, _)) = accepted else { continue };
                let state = state.clone();
                let header_timeout = state.config.body_timeout;
                tokio::spawn(async move {
                    let service = service_fn(move |req| route(req, state.clone()));
                    let conn = http1::Builder::new()
                        .timer(TokioTimer::new())
                        .header_read_timeout(header_timeout)
                        .serve_connection(TokioIo::new(stream), service);
                    if let Err(e) = conn.await {
                        tracing::debug!("serve: connection ended: {e}");
                    }
                });
            }
            _ = stopped.changed() => return,
        }
    }
}

fn reply(status: StatusCode, body: impl Into<Bytes>) -> Response<Full<Bytes>> {
    let mut r = Response::new(Full::new(body.into()));
    *r.status_mut() = status;
    r
}

fn refuse(status: StatusCode, why: &str) -> Response<Full<Bytes>> {
    reply(status, format!("{why}\n"))
}

async fn route(
    req: Request<Incoming>,
    state: Arc<State>,
) -> std::result::Result<Response<Full<Bytes>>, Infallible> {
    Ok(match (req.method(), req.uri().path()) {
        (&Method::GET, "/health") => {
            if state.queue.healthy.load(Ordering::Acquire) {
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
        (&Method::GET, "/metrics") => match warpdrive::telemetry::render_prometheus() {
            Ok(text) => {
                let mut r = reply(StatusCode::OK, text);
                r.headers_mut().insert(
                    hyper::header::CONTENT_TYPE,
                    hyper::header::HeaderValue::from_static("text/plain; version=0.0.4"),
                );
                r
            }
            Err(e) => refuse(StatusCode::SERVICE_UNAVAILABLE, &e.to_string()),
        },
        (&Method::GET, "/v1/model") => {
            let info = serde_json::json!({ "name": state.queue.name, "width": state.queue.width });
            let mut r = reply(StatusCode::OK, info.to_string());
            r.headers_mut().insert(
                hyper::header::CONTENT_TYPE,
                HeaderValue::from_static(wire::JSON_TYPE),
            );
            r
        }
        (_, "/health" | "/v1/jobs" | "/v1/model" | "/metrics") => {
            refuse(StatusCode::METHOD_NOT_ALLOWED, "method not allowed")
        }
        _ => refuse(
            StatusCode::NOT_FOUND,
            "no such endpoint: /v1/jobs, /v1/model, /health, /metrics",
        ),
    })
}

async fn submit(req: Request<Incoming>, state: &State) -> Response<Full<Bytes>> {
    let accepted = Instant::now();
    let config = &state.config;
    let content_type = req
        .headers()
        .get(hyper::header::CONTENT_TYPE)
        .map(|v| v.to_str().unwrap_or("?"));
    let format = match wire::format_of(content_type) {
        Ok(f) => f,
        Err(e) => return refuse(StatusCode::UNSUPPORTED_MEDIA_TYPE, &e.why),
    };
    let body = Limited::new(req.into_body(), config.max_body_bytes);
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
    let width = state.queue.width;
    let job = match wire::decode(format, &bytes, width) {
        Ok(t) => t,
        Err(e) => {
            return refuse(
                StatusCode::BAD_REQUEST,
                &format!("{} for {}", e.why, state.queue.name),
            )
        }
    };
    if !state.queue.healthy.load(Ordering::Acquire) {
        return refuse(
            StatusCode::SERVICE_UNAVAILABLE,
            "unhealthy: the device faulted",
        );
    }
    let (tx, rx) = oneshot::channel();
    let queued = Job {
        data: job.data,
        rows: job.rows,
        arrived: Instant::now(),
        reply: tx,
    };
    match state.queue.jobs.try_send(queued) {
        Ok(()) => {
            state.queue.waiting.fetch_add(1, Ordering::AcqRel);
        }
        Err(TrySendError::Full(_)) => {
            return refuse(
                StatusCode::SERVICE_UNAVAILABLE,
                "the queue is full; try again",
            )
        }
        Err(TrySendError::Disconnected(_)) => {
            return refuse(StatusCode::SERVICE_UNAVAILABLE, "the service is stopping")
        }
    }
    let submit_us = accepted.elapsed().as_secs_f64() * 1e6;
    match tokio::time::timeout(config.job_timeout, rx).await {
        Err(_) => refuse(
            StatusCode::GATEWAY_TIMEOUT,
            "the job did not finish in time",
        ),
        Ok(Err(_)) => refuse(
            StatusCode::INTERNAL_SERVER_ERROR,
            "the batcher dropped the job",
        ),
        Ok(Ok(Err(why))) => refuse(StatusCode::INTERNAL_SERVER_ERROR, &why),
        Ok(Ok(Ok((data, stats)))) => answer(format, job.rows, data, stats, submit_us),
    }
}

/// The 200 reply of a job in its request's format.
fn answer(
    format: Format,
    rows: usize,
    data: Vec<f32>,
    stats: BatchStats,
    submit_us: f64,
) -> Response<Full<Bytes>> {
    let body = match format {
        Format::Json => serde_json::to_vec(&JsonReply {
            rows,
            data,
            batch_rows: stats.batch_rows,
            submit_us,
            queue_us: stats.queue_us,
            run_us: stats.run_us,
        })
        .map_err(|e| e.to_string()),
        Format::Binary(dtype) => wire::encode_binary(dtype, rows, &data)
            .ok_or_else(|| format!("{rows} rows do not fit a tensor")),
    };
    let body = match body {
        Ok(b) => b,
        Err(e) => return refuse(StatusCode::INTERNAL_SERVER_ERROR, &format!("encoding: {e}")),
    };
    let mut r = reply(StatusCode::OK, body);
    let h = r.headers_mut();
    h.insert(
        hyper::header::CONTENT_TYPE,
        HeaderValue::from_static(format.content_type()),
    );
    if let Format::Binary(_) = format {
        for (name, v) in [
            (wire::BATCH_ROWS_HEADER, stats.batch_rows as f64),
            (wire::SUBMIT_US_HEADER, submit_us),
            (wire::QUEUE_US_HEADER, stats.queue_us),
            (wire::RUN_US_HEADER, stats.run_us),
        ] {
            if let Ok(v) = HeaderValue::from_str(&format!("{v:.1}")) {
                h.insert(name, v);
            }
        }
    }
    r
}
