//! `warpdrive serve`: a GPU job service (issue 37). HTTP/1.1 on tokio and hyper, loopback
//! by default; jobs queue per model in priority classes, and a batcher closes a batch at a
//! row count or as soon as the device is idle (or, with [`Dispatch::Window`], when its
//! oldest job has waited a delay: Triton's `max_queue_delay`), runs it, and scatters the
//! rows back.
//!
//! - [`Model`]: what a job runs (a batch of rows in, the same rows out); [`MoeModel`] is the
//!   MoE layer. More job kinds implement the trait.
//! - [`Server::start`]: the service on an address, with [`ServeConfig`]'s limits; the model
//!   is made on the batcher's thread, which alone runs it. Dropping the server (or
//!   [`Server::stop`], or Ctrl-C / SIGTERM under [`Server::run_until_stopped`]) stops
//!   accepting, refuses new jobs with 503 and answers every job already accepted.
//! - Endpoints: `POST /v1/jobs` (a job in JSON or as a binary tensor, [`wire`]; optional
//!   headers `x-warpdrive-priority: 0..3` (higher first, default 1), `x-warpdrive-tenant`,
//!   `x-warpdrive-deadline-ms` (it must start running by then)); with `?async=true` it
//!   answers 202 with an id at once, and `GET /v1/jobs/ID[?wait_ms=N]` fetches the reply
//!   once (202 while pending, waiting up to N ms for it), `GET /v1/model` (name,
//!   width), `GET /v1/status` ([`Status`]), `GET /` (the dashboard) and `GET /v1/events`
//!   (its server-sent events), `GET /health` (`ok`, or 503 once the device is lost),
//!   `GET /metrics` (Prometheus: `warpdrive_serve_jobs_total`, `_batch_rows`, `_queue_jobs`,
//!   `_refused_total{status}`, `_expired_total`, `_cancelled_total`, `_busy_fraction`, the
//!   knobs, `_latency_p99_us`, and every warpdrive metric).
//! - Priorities ([`CLASSES`]): higher classes first, FIFO within one; a class passed over
//!   `starvation_limit` batches in a row goes first in the next.
//! - [`Budget`]s per tenant: jobs and bytes in flight, a request rate (429, `Retry-After`),
//!   one job larger than the whole budget (413), and device memory, charged from
//!   [`Model::device_bytes`] as a batch is about to run (a job past it fails alone).
//! - `ServeConfig::warm_rows`: batch sizes every batcher thread runs once before serving;
//!   [`Echo`]: a job kind that answers each row with itself (the request path's stand-in).
//! - The [`Controller`] (optional): steers the batch rows and delay toward a p99 objective
//!   from the busy fraction and latencies of each interval.
//! - [`Client`] (pooled keep-alive connections under a cap), [`Batching`] (client-side
//!   batching: many small jobs as one request) and [`load`] (open- and closed-loop load,
//!   what `warpdrive load` and the bench suite use).
//! - [`probe`]: stall probes (a thread, and a task on the HTTP or the generator's runtime)
//!   that note every wake-up over 4 ms late: the service logs them, the generator reports
//!   them; every job reply carries the service's wall clock (accepted, replied) so the
//!   generator splits a job's time into the legs to and from the service.
//!
//! Every bad request gets a 4xx with a one-line reason and the service keeps serving the
//! others: malformed JSON, tensors, shapes or headers (400), an unknown content type (415),
//! a body over the limit (413), a body that does not finish within the body timeout (408),
//! a tenant over budget (429), a full queue (503), a deadline that passed before the job ran
//! (504). A client that leaves has its queued job dropped unrun; connections past
//! `max_connections` are closed at once.

mod batcher;
pub mod batching;
mod budget;
pub mod client;
mod controller;
mod dashboard;
mod dispatch;
mod http;
pub mod load;
mod model;
pub mod probe;
mod queue;
mod reply;
mod results;
mod snapshot;
mod stats;
mod tune;
pub mod wire;

pub use batcher::{BatchStats, MakeModel, MakeModels, ServeConfig, DEFAULT_EVENT_INTERVAL};
pub use batching::Batching;
pub use budget::Budget;
pub use client::{Client, ClientConfig, Encoded, Failure, JobResult, JobSpec};
pub use controller::{Controller, ControllerConfig, Knobs};
pub use dispatch::Dispatch;
pub use http::Server;
pub use load::{Arrivals, LoadConfig, LoadReport};
pub use model::{Echo, Model, MoeModel};
pub use queue::{CLASSES, DEFAULT_PRIORITY};
pub use stats::{Seen, Status};

/// `t + d`, or as late as an `Instant` can be near that when the sum overflows (a
/// configured timeout of `Duration::MAX` means "never", not a panic).
pub(crate) fn later(t: std::time::Instant, d: std::time::Duration) -> std::time::Instant {
    const YEAR: std::time::Duration = std::time::Duration::from_secs(365 * 24 * 3600);
    t.checked_add(d)
        .or_else(|| t.checked_add(YEAR))
        .unwrap_or(t)
}
