//! `warpdrive serve`: a GPU job service (issue 37). HTTP/1.1 on tokio and hyper, loopback
//! by default; jobs queue per model and a batcher closes a batch at a token count or when
//! its oldest job has waited a delay (Triton's `max_queue_delay`), runs it, and scatters
//! the rows back to each job.
//!
//! - [`Model`]: what a job runs (a batch of rows in, the same rows out); [`MoeModel`] is the
//!   MoE layer. More job kinds implement the trait.
//! - [`Server::start`]: the service on an address, with [`ServeConfig`]'s limits; the model
//!   is made on the batcher's thread, which alone runs it.
//! - Endpoints: `POST /v1/jobs` (JSON `{"rows": R, "data": [R × width numbers]}` → `{"rows",
//!   "data", "batch_rows", "submit_us", "queue_us", "run_us"}`), `GET /health` (`ok`, or 503 once the
//!   device is lost), `GET /metrics` (Prometheus: `warpdrive_serve_jobs_total`,
//!   `warpdrive_serve_batch_rows`, `warpdrive_serve_queue_jobs`,
//!   `warpdrive_serve_refused_total{status}`, and every warpdrive metric).
//!
//! Every bad request gets a 4xx with a one-line reason and the service keeps serving the
//! others: malformed JSON or shapes (400), a body over the limit (413), a body that does not
//! finish within the body timeout (408), a full queue (503).

mod batcher;
pub mod client;
mod http;
pub mod load;
mod model;
pub mod wire;

pub use batcher::{BatchStats, MakeModel, ServeConfig};
pub use client::{Client, ClientConfig, Failure, JobResult, JobSpec};
pub use http::Server;
pub use load::{Arrivals, LoadConfig, LoadReport};
pub use model::{Model, MoeModel};
