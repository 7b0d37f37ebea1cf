//! A client of the service: keep-alive HTTP/1.1 connections from a pool with a cap, every
//! wait bounded by a timeout, JSON or binary bodies.
//!
//! The pool is hyper's connection-level client (`hyper::client::conn::http1`) with a
//! semaphore in front: at most `max_connections` connections exist, and a request waits for
//! a free one (up to its timeout) rather than opening more. A connection goes back to the
//! pool after its reply has been read in full, and one the server closed is dropped.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::client::conn::http1::SendRequest;
use hyper::header::{HeaderValue, CONTENT_TYPE, HOST};
use hyper::{Method, Request, StatusCode};
use hyper_util::rt::TokioIo;
use parking_lot::Mutex;
use serde::Deserialize;
use tokio::sync::Semaphore;

use super::wire::{self, Dtype, Format, JsonReply};

/// The request headers that carry a job's class, tenant and deadline.
pub const PRIORITY_HEADER: &str = "x-warpdrive-priority";
pub const TENANT_HEADER: &str = "x-warpdrive-tenant";
pub const DEADLINE_HEADER: &str = "x-warpdrive-deadline-ms";

/// How a client connects.
#[derive(Debug, Clone)]
pub struct ClientConfig {
    /// Connections open at most (each carries one request at a time).
    pub max_connections: usize,
    /// The longest any step may take: waiting for a connection, connecting, the reply.
    pub timeout: Duration,
    /// How jobs are encoded.
    pub format: Format,
}

impl Default for ClientConfig {
    fn default() -> Self {
        ClientConfig {
            max_connections: 64,
            timeout: Duration::from_secs(30),
            format: Format::Json,
        }
    }
}

/// A job to submit: `rows` rows of the model's width in `data`, and how to queue it.
#[derive(Debug, Clone, Default)]
pub struct JobSpec {
    pub rows: usize,
    pub data: Vec<f32>,
    /// Class 0 (lowest) to 3; the service's default when `None`.
    pub priority: Option<u8>,
    pub tenant: Option<String>,
    /// The job must start running within this long of arriving.
    pub deadline: Option<Duration>,
}

/// A job encoded once, to be submitted any number of times ([`Client::encode`]).
#[derive(Debug, Clone)]
pub struct Encoded {
    body: Bytes,
    headers: Vec<(&'static str, String)>,
}

/// A job's answer.
#[derive(Debug, Clone, PartialEq)]
pub struct JobResult {
    pub rows: usize,
    pub data: Vec<f32>,
    pub batch_rows: usize,
    pub submit_us: f64,
    pub queue_us: f64,
    pub run_us: f64,
    /// µs this client spent before the request could go: waiting for a connection, opening
    /// one, and the connection becoming ready (NaN where no request was timed).
    pub connect_us: f64,
    /// Wall clocks of this host, µs since the Unix epoch (NaN where unknown): this client
    /// handing the request to its connection, the service accepting the request's headers
    /// and handing its reply to hyper (from the reply's headers,
    /// [`wire::ACCEPTED_UNIX_US_HEADER`]), and this client having read the whole reply.
    pub sent_unix_us: f64,
    pub accepted_unix_us: f64,
    pub replied_unix_us: f64,
    pub received_unix_us: f64,
}

impl JobResult {
    /// The batch facts alone (no rows), to build another result from.
    pub(crate) fn clone_stats(&self) -> JobResult {
        JobResult {
            rows: 0,
            data: Vec::new(),
            ..*self
        }
    }
}

/// Why a request failed.
#[derive(Debug, Clone, PartialEq)]
pub enum Failure {
    /// The service answered with this status and reason.
    Status(u16, String),
    /// A step took longer than the client's timeout.
    Timeout(&'static str),
    /// Connecting, sending or reading failed.
    Io(String),
    /// A 200 reply that does not parse.
    BadReply(String),
    /// The job was refused before being sent (client-side batching's checks).
    Invalid(String),
}

impl Failure {
    /// A short key for counting failures by kind: the status (`503`), `timeout`, `io` or
    /// `bad-reply`.
    pub fn key(&self) -> String {
        match self {
            Failure::Status(s, _) => s.to_string(),
            Failure::Timeout(_) => "timeout".into(),
            Failure::Io(_) => "io".into(),
            Failure::BadReply(_) => "bad-reply".into(),
            Failure::Invalid(_) => "invalid".into(),
        }
    }
}

impl std::fmt::Display for Failure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Failure::Status(s, why) => write!(f, "status {s}: {}", why.trim_end()),
            Failure::Timeout(what) => write!(f, "timed out {what}"),
            Failure::Io(e) => write!(f, "{e}"),
            Failure::BadReply(e) => write!(f, "a reply that does not parse: {e}"),
            Failure::Invalid(e) => write!(f, "{e}"),
        }
    }
}

impl std::error::Error for Failure {}

/// What `GET /v1/model` says.
#[derive(Debug, Clone, Deserialize)]
pub struct ModelInfo {
    pub name: String,
    pub width: usize,
}

/// A pooled client of one service. Clones share the pool.
#[derive(Clone)]
pub struct Client {
    inner: Arc<Inner>,
}

struct Inner {
    addr: SocketAddr,
    host: HeaderValue,
    config: ClientConfig,
    idle: Mutex<Vec<SendRequest<Full<Bytes>>>>,
    permits: Semaphore,
}

impl Client {
    /// A client of the service at `addr` (no connection is made until the first request).
    pub fn new(addr: SocketAddr, config: ClientConfig) -> Client {
        let host = HeaderValue::from_str(&addr.to_string())
            .unwrap_or_else(|_| HeaderValue::from_static("localhost"));
        let permits = Semaphore::new(config.max_connections.max(1));
        Client {
            inner: Arc::new(Inner {
                addr,
                host,
                config,
                idle: Mutex::new(Vec::new()),
                permits,
            }),
        }
    }

    /// The longest one step of a request may take.
    pub fn timeout(&self) -> Duration {
        self.inner.config.timeout
    }

    /// The service's model.
    pub async fn model(&self) -> Result<ModelInfo, Failure> {
        let (status, _, body) = self
            .request(Method::GET, "/v1/model", None, Bytes::new(), &[])
            .await?;
        if status != StatusCode::OK {
            return Err(status_failure(status, &body));
        }
        serde_json::from_slice(&body).map_err(|e| Failure::BadReply(e.to_string()))
    }

    /// The status and body of `GET path`.
    pub async fn get(&self, path: &str) -> Result<(u16, Bytes), Failure> {
        let (status, _, body) = self
            .request(Method::GET, path, None, Bytes::new(), &[])
            .await?;
        Ok((status.as_u16(), body))
    }

    /// Submits `job` and waits for its answer.
    pub async fn submit(&self, job: &JobSpec) -> Result<JobResult, Failure> {
        self.submit_encoded(&self.encode(job)?).await
    }

    /// `job`'s body and headers in this client's format, to submit again and again with
    /// [`Client::submit_encoded`] without encoding it each time.
    pub fn encode(&self, job: &JobSpec) -> Result<Encoded, Failure> {
        let body = match self.inner.config.format {
            Format::Json => wire::encode_json(job.rows, &job.data),
            Format::Binary(dtype) => wire::encode_binary(dtype, job.rows, &job.data)
                .ok_or_else(|| Failure::Io(format!("{} rows do not fit a tensor", job.rows)))?,
        };
        let mut headers: Vec<(&'static str, String)> = Vec::new();
        if let Some(p) = job.priority {
            headers.push((PRIORITY_HEADER, p.to_string()));
        }
        if let Some(t) = &job.tenant {
            headers.push((TENANT_HEADER, t.clone()));
        }
        if let Some(d) = job.deadline {
            headers.push((DEADLINE_HEADER, d.as_millis().to_string()));
        }
        Ok(Encoded {
            body: Bytes::from(body),
            headers,
        })
    }

    /// Submits a job [`Client::encode`] made and waits for its answer.
    pub async fn submit_encoded(&self, job: &Encoded) -> Result<JobResult, Failure> {
        let mut timing = Timing::default();
        let content_type = self.inner.config.format.content_type();
        let (status, headers, body) = self
            .request_timed(
                (Method::POST, "/v1/jobs"),
                Some(content_type),
                job.body.clone(),
                &job.headers,
                &mut timing,
            )
            .await?;
        if status != StatusCode::OK {
            return Err(status_failure(status, &body));
        }
        let mut r = parse_result(&headers, &body)?;
        r.connect_us = timing.connect.as_secs_f64() * 1e6;
        r.sent_unix_us = timing.sent_unix_us as f64;
        r.received_unix_us = timing.received_unix_us as f64;
        Ok(r)
    }

    /// Submits `job` without waiting (`POST /v1/jobs?async=true`): its id, for
    /// [`Client::fetch`].
    pub async fn submit_async(&self, job: &JobSpec) -> Result<u64, Failure> {
        let (status, _, body) = self
            .post_job(&self.encode(job)?, "/v1/jobs?async=true")
            .await?;
        if status != StatusCode::ACCEPTED {
            return Err(status_failure(status, &body));
        }
        serde_json::from_slice::<serde_json::Value>(&body)
            .ok()
            .and_then(|v| v["id"].as_u64())
            .ok_or_else(|| Failure::BadReply("a 202 without an id".into()))
    }

    /// The answer of job `id` (from [`Client::submit_async`]), waiting up to `wait` (at most
    /// a minute) for it: `None` while it is pending. An answer is handed out once.
    pub async fn fetch(&self, id: u64, wait: Duration) -> Result<Option<JobResult>, Failure> {
        let path = format!("/v1/jobs/{id}?wait_ms={}", wait.as_millis());
        let (status, headers, body) = self
            .request(Method::GET, &path, None, Bytes::new(), &[])
            .await?;
        match status {
            StatusCode::OK => parse_result(&headers, &body).map(Some),
            StatusCode::ACCEPTED => Ok(None),
            _ => Err(status_failure(status, &body)),
        }
    }

    async fn post_job(
        &self,
        job: &Encoded,
        path: &str,
    ) -> Result<(StatusCode, hyper::HeaderMap, Bytes), Failure> {
        let content_type = self.inner.config.format.content_type();
        self.request(
            Method::POST,
            path,
            Some(content_type),
            job.body.clone(),
            &job.headers,
        )
        .await
    }

    /// One request on a pooled connection: the reply's status, headers and whole body.
    ///
    /// A kept-alive connection the service has just closed (it closes idle ones) fails the
    /// request that meets it before any reply (closed, reset or cut short); such a request is
    /// sent once more on a fresh connection. A job is a pure function of its rows, so the
    /// worst a resend could do is run it twice.
    async fn request(
        &self,
        method: Method,
        path: &str,
        content_type: Option<&'static str>,
        body: Bytes,
        headers: &[(&'static str, String)],
    ) -> Result<(StatusCode, hyper::HeaderMap, Bytes), Failure> {
        let mut timing = Timing::default();
        self.request_timed((method, path), content_type, body, headers, &mut timing)
            .await
    }

    /// [`Client::request`], noting in `timing` the time until the connection that carried
    /// the request was ready to send it, and the wall clock when the request went out and
    /// when its whole reply had been read.
    async fn request_timed(
        &self,
        (method, path): (Method, &str),
        content_type: Option<&'static str>,
        body: Bytes,
        headers: &[(&'static str, String)],
        timing: &mut Timing,
    ) -> Result<(StatusCode, hyper::HeaderMap, Bytes), Failure> {
        let began = std::time::Instant::now();
        let inner = &self.inner;
        let t = inner.config.timeout;
        let _permit = tokio::time::timeout(t, inner.permits.acquire())
            .await
            .map_err(|_| Failure::Timeout("waiting for a connection"))?
            .map_err(|e| Failure::Io(e.to_string()))?;
        let build = || {
            let mut req = Request::builder()
                .method(method.clone())
                .uri(path)
                .header(HOST, inner.host.clone());
            if let Some(ct) = content_type {
                req = req.header(CONTENT_TYPE, ct);
            }
            for (k, v) in headers {
                req = req.header(*k, v.as_str());
            }
            req.body(Full::new(body.clone()))
                .map_err(|e| Failure::Io(format!("building the request: {e}")))
        };
        let mut reused = self.idle_connection();
        loop {
            let retry = reused.is_some();
            let mut sender = match reused.take() {
                Some(s) => s,
                None => self.connect().await?,
            };
            let req = build()?;
            let exchange = async {
                if let Err(e) = sender.ready().await {
                    return Err((true, Failure::Io(format!("connection: {e}"))));
                }
                timing.connect = began.elapsed();
                timing.sent_unix_us = wire::unix_us_now();
                let reply = match sender.try_send_request(req).await {
                    Ok(r) => r,
                    // No reply came: on a kept-alive connection, whatever went wrong (closed,
                    // reset, cut short) is the connection's, not the job's.
                    Err(e) => {
                        let stale = !e.error().is_timeout();
                        return Err((stale, Failure::Io(format!("sending: {}", e.error()))));
                    }
                };
                let (parts, body) = reply.into_parts();
                let body = body
                    .collect()
                    .await
                    .map_err(|e| (false, Failure::Io(format!("reading the reply: {e}"))))?
                    .to_bytes();
                timing.received_unix_us = wire::unix_us_now();
                Ok((parts.status, parts.headers, body))
            };
            match tokio::time::timeout(t, exchange).await {
                Err(_) => return Err(Failure::Timeout("waiting for the reply")),
                Ok(Err((stale, _))) if stale && retry => continue,
                Ok(Err((_, f))) => return Err(f),
                Ok(Ok(out)) => {
                    if !sender.is_closed() {
                        inner.idle.lock().push(sender);
                    }
                    return Ok(out);
                }
            }
        }
    }

    fn idle_connection(&self) -> Option<SendRequest<Full<Bytes>>> {
        let mut idle = self.inner.idle.lock();
        while let Some(s) = idle.pop() {
            if !s.is_closed() {
                return Some(s);
            }
        }
        None
    }

    async fn connect(&self) -> Result<SendRequest<Full<Bytes>>, Failure> {
        let inner = &self.inner;
        let stream = tokio::time::timeout(
            inner.config.timeout,
            tokio::net::TcpStream::connect(inner.addr),
        )
        .await
        .map_err(|_| Failure::Timeout("connecting"))?
        .map_err(|e| Failure::Io(format!("connecting to {}: {e}", inner.addr)))?;
        let _ = stream.set_nodelay(true);
        let (sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
            .await
            .map_err(|e| Failure::Io(format!("handshake: {e}")))?;
        // The connection's own task: it ends when either side closes it.
        tokio::spawn(async move {
            if let Err(e) = conn.await {
                tracing::debug!("serve client: connection ended: {e}");
            }
        });
        Ok(sender)
    }
}

/// What one request's exchange took, and when (this host's wall clock, µs since the Unix
/// epoch; 0 until known).
#[derive(Debug, Default)]
struct Timing {
    connect: Duration,
    sent_unix_us: u64,
    received_unix_us: u64,
}

/// A 200 reply's job result, in the format its content type names.
fn parse_result(headers: &hyper::HeaderMap, body: &[u8]) -> Result<JobResult, Failure> {
    let content_type = headers.get(CONTENT_TYPE).and_then(|v| v.to_str().ok());
    let num = |name: &str| -> f64 {
        headers
            .get(name)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse().ok())
            .unwrap_or(f64::NAN)
    };
    // The service's clocks: the headers (every 200 job reply of this version), else the JSON
    // fields, else unknown.
    let (accepted_unix_us, replied_unix_us) = (
        num(wire::ACCEPTED_UNIX_US_HEADER),
        num(wire::REPLIED_UNIX_US_HEADER),
    );
    let or_field = |h: f64, f: Option<u64>| {
        if h.is_nan() {
            f.map_or(f64::NAN, |v| v as f64)
        } else {
            h
        }
    };
    match wire::format_of(content_type).map_err(|e| Failure::BadReply(e.why))? {
        Format::Json => {
            let r: JsonReply =
                serde_json::from_slice(body).map_err(|e| Failure::BadReply(e.to_string()))?;
            Ok(JobResult {
                rows: r.rows,
                data: r.data,
                batch_rows: r.batch_rows,
                submit_us: r.submit_us,
                queue_us: r.queue_us,
                run_us: r.run_us,
                connect_us: f64::NAN,
                sent_unix_us: f64::NAN,
                accepted_unix_us: or_field(accepted_unix_us, r.accepted_unix_us),
                replied_unix_us: or_field(replied_unix_us, r.replied_unix_us),
                received_unix_us: f64::NAN,
            })
        }
        Format::Binary(_) => {
            let width = wire::tensor_width(body)
                .ok_or_else(|| Failure::BadReply("a tensor reply without a header".into()))?;
            let t = wire::decode(Format::Binary(Dtype::F32), body, width)
                .map_err(|e| Failure::BadReply(e.why))?;
            Ok(JobResult {
                rows: t.rows,
                data: t.data,
                batch_rows: num(wire::BATCH_ROWS_HEADER) as usize,
                submit_us: num(wire::SUBMIT_US_HEADER),
                queue_us: num(wire::QUEUE_US_HEADER),
                run_us: num(wire::RUN_US_HEADER),
                connect_us: f64::NAN,
                sent_unix_us: f64::NAN,
                accepted_unix_us,
                replied_unix_us,
                received_unix_us: f64::NAN,
            })
        }
    }
}

fn status_failure(status: StatusCode, body: &[u8]) -> Failure {
    Failure::Status(
        status.as_u16(),
        String::from_utf8_lossy(body).trim_end().to_string(),
    )
}
