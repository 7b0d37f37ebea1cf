//! The batcher: one thread owns the model, takes jobs off a bounded queue, closes a batch at
//! `max_batch_rows` or when its oldest job has waited `max_delay`, runs it and scatters the
//! rows back. A batch the device runs out of memory for is halved and retried; after a
//! sticky fault every job gets an error and the service reports itself unhealthy.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::mpsc::{sync_channel, Receiver, RecvTimeoutError, SyncSender};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use tokio::sync::oneshot;
use warpdrive::{Error, Result};

use super::model::Model;

/// The service's limits.
#[derive(Debug, Clone)]
pub struct ServeConfig {
    /// Where to listen (loopback by default).
    pub addr: SocketAddr,
    /// A batch closes once it holds this many rows (a larger job runs alone).
    pub max_batch_rows: usize,
    /// ...or once its oldest job has waited this long.
    pub max_delay: Duration,
    /// Jobs waiting at most; past it a job is refused with 503.
    pub queue_jobs: usize,
    /// The largest request body; past it, 413.
    pub max_body_bytes: usize,
    /// How long a client may take to send its headers and body; past it, 408.
    pub body_timeout: Duration,
    /// How long a job may wait for its result; past it, 504.
    pub job_timeout: Duration,
    /// How long making the model may take (loading weights, compiling kernels).
    pub start_timeout: Duration,
}

impl Default for ServeConfig {
    fn default() -> Self {
        ServeConfig {
            addr: SocketAddr::from(([127, 0, 0, 1], 8080)),
            max_batch_rows: 256,
            max_delay: Duration::from_millis(10),
            queue_jobs: 4096,
            max_body_bytes: 64 << 20,
            body_timeout: Duration::from_secs(10),
            job_timeout: Duration::from_secs(60),
            start_timeout: Duration::from_secs(600),
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

/// A job: rows of the model's width, and where its answer goes.
pub(crate) struct Job {
    pub(crate) data: Vec<f32>,
    pub(crate) rows: usize,
    pub(crate) arrived: Instant,
    pub(crate) reply: oneshot::Sender<std::result::Result<(Vec<f32>, BatchStats), String>>,
}

/// The queue into the batcher and what handlers need to know of the model. The batcher
/// ends once every clone of the sender is gone.
pub(crate) struct Queue {
    pub(crate) jobs: SyncSender<Job>,
    /// Jobs queued and not yet taken into a batch (the `warpdrive_serve_queue_jobs` gauge).
    pub(crate) waiting: Arc<AtomicUsize>,
    pub(crate) healthy: Arc<AtomicBool>,
    pub(crate) width: usize,
    pub(crate) name: String,
}

/// What makes the model, on the batcher's thread.
pub type MakeModel = Box<dyn FnOnce() -> Result<Box<dyn Model>> + Send>;

/// Starts the batcher's thread, which makes the model with `make` first.
pub(crate) fn start(make: MakeModel, config: &ServeConfig) -> Result<(Queue, JoinHandle<()>)> {
    if config.max_batch_rows == 0 || config.queue_jobs == 0 {
        return Err(Error::InvalidArgument(
            "serve: max_batch_rows and queue_jobs must be at least 1".into(),
        ));
    }
    let (jobs, queued) = sync_channel(config.queue_jobs);
    let healthy = Arc::new(AtomicBool::new(true));
    let waiting = Arc::new(AtomicUsize::new(0));
    let (h, cfg, w) = (healthy.clone(), config.clone(), waiting.clone());
    let (made_tx, made) = sync_channel(1);
    let thread = std::thread::Builder::new()
        .name("warpdrive-batcher".into())
        .spawn(move || {
            let model = match make() {
                Ok(m) => m,
                Err(e) => {
                    let _ = made_tx.send(Err(e));
                    return;
                }
            };
            let _ = made_tx.send(Ok((model.width(), model.name().to_string())));
            run(model, queued, &cfg, &h, &w)
        })
        .map_err(|e| Error::InvalidArgument(format!("serve: batcher thread: {e}")))?;
    let (width, name) = made
        .recv_timeout(config.start_timeout)
        .map_err(|e| Error::Timeout {
            what: format!("serve: making the model ({e})"),
            after_ms: config.start_timeout.as_millis() as u64,
        })??;
    Ok((
        Queue {
            jobs,
            waiting,
            healthy,
            width,
            name,
        },
        thread,
    ))
}

fn run(
    mut model: Box<dyn Model>,
    jobs: Receiver<Job>,
    config: &ServeConfig,
    healthy: &AtomicBool,
    waiting: &AtomicUsize,
) {
    let mut next: Option<Job> = None;
    loop {
        // Jobs taken off the queue this round (for the queue gauge).
        let mut received = 0;
        let first = match next.take() {
            Some(j) => j,
            None => match jobs.recv() {
                Ok(j) => {
                    received += 1;
                    j
                }
                Err(_) => return,
            },
        };
        let deadline = first.arrived + config.max_delay;
        let mut rows = first.rows;
        let mut batch = vec![first];
        while rows < config.max_batch_rows {
            let wait = deadline.saturating_duration_since(Instant::now());
            match jobs.recv_timeout(wait) {
                Ok(j) if rows + j.rows > config.max_batch_rows => {
                    received += 1;
                    next = Some(j);
                    break;
                }
                Ok(j) => {
                    received += 1;
                    rows += j.rows;
                    batch.push(j);
                }
                Err(RecvTimeoutError::Timeout) | Err(RecvTimeoutError::Disconnected) => break,
            }
        }
        let left = waiting
            .fetch_sub(received, Ordering::AcqRel)
            .saturating_sub(received);
        metrics::gauge!("warpdrive_serve_queue_jobs").set(left as f64);
        metrics::counter!("warpdrive_serve_jobs_total").increment(batch.len() as u64);
        metrics::histogram!("warpdrive_serve_batch_rows").record(rows as f64);
        run_batch(model.as_mut(), batch, healthy);
    }
}

/// Runs `batch` and answers each job; out of device memory, runs each half on its own.
fn run_batch(model: &mut dyn Model, batch: Vec<Job>, healthy: &AtomicBool) {
    if !healthy.load(Ordering::Acquire) {
        answer_all(batch, "the service is unhealthy: its device faulted");
        return;
    }
    let rows: usize = batch.iter().map(|j| j.rows).sum();
    let mut input = Vec::with_capacity(batch.iter().map(|j| j.data.len()).sum());
    for j in &batch {
        input.extend_from_slice(&j.data);
    }
    let started = Instant::now();
    let mut output = Vec::new();
    match model.run(&input, &mut output) {
        Ok(()) if output.len() == input.len() => {
            let run_us = started.elapsed().as_secs_f64() * 1e6;
            let mut at = 0;
            for j in batch {
                let n = j.data.len();
                let stats = BatchStats {
                    batch_rows: rows,
                    queue_us: started.duration_since(j.arrived).as_secs_f64() * 1e6,
                    run_us,
                };
                let _ = j.reply.send(Ok((output[at..at + n].to_vec(), stats)));
                at += n;
            }
        }
        Ok(()) => answer_all(
            batch,
            &format!(
                "{}: {} values out for {} in",
                model.name(),
                output.len(),
                input.len()
            ),
        ),
        Err(Error::OutOfMemory { .. }) if batch.len() > 1 => {
            tracing::warn!(
                "{}: out of memory on {rows} rows; halving the batch",
                model.name()
            );
            let mut first = batch;
            let second = first.split_off(first.len() / 2);
            run_batch(model, first, healthy);
            run_batch(model, second, healthy);
        }
        Err(e) => {
            if e.is_device_lost() || model.is_lost() {
                healthy.store(false, Ordering::Release);
            }
            answer_all(batch, &e.to_string());
        }
    }
}

fn answer_all(batch: Vec<Job>, why: &str) {
    for j in batch {
        let _ = j.reply.send(Err(why.to_string()));
    }
}
