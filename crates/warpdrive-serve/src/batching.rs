//! Client-side batching: jobs submitted through a [`Batching`] handle are coalesced into one
//! request of up to `max_rows` rows — or of what has come within `max_delay` of the first —
//! and each caller gets its own rows back. Many small jobs then cost the service one
//! request, one parse and one queue entry instead of many (the seed's message batching: 100
//! messages or 10 ms).

use std::time::{Duration, Instant};

use tokio::sync::{mpsc, oneshot};

use super::client::{Client, Failure, JobResult, JobSpec};

struct Pending {
    job: JobSpec,
    reply: oneshot::Sender<Result<JobResult, Failure>>,
}

/// A batching handle on a [`Client`]. Clones share the batcher; it ends once every clone is
/// gone and the jobs it holds are answered.
#[derive(Clone)]
pub struct Batching {
    tx: mpsc::Sender<Pending>,
    width: usize,
    timeout: Duration,
}

impl Batching {
    /// Batches jobs of rows of `width` values (the service's model's, [`Client::model`])
    /// for `client`: a request goes out at `max_rows` rows or `max_delay` after its first
    /// job. Must be called inside a tokio runtime (the batcher is a task on it). The
    /// priority, tenant and deadline of a request are its first job's.
    pub fn new(client: Client, width: usize, max_rows: usize, max_delay: Duration) -> Batching {
        let (tx, rx) = mpsc::channel(max_rows.clamp(1, 1 << 16));
        let timeout = client.timeout();
        tokio::spawn(gather(client, rx, max_rows.max(1), max_delay));
        Batching { tx, width, timeout }
    }

    /// Submits `job` in the next request and waits for its own rows.
    pub async fn submit(&self, job: JobSpec) -> Result<JobResult, Failure> {
        if job.rows == 0 || job.rows.checked_mul(self.width) != Some(job.data.len()) {
            return Err(Failure::Invalid(format!(
                "{} values are not {} rows of {}",
                job.data.len(),
                job.rows,
                self.width
            )));
        }
        let (reply, answer) = oneshot::channel();
        tokio::time::timeout(self.timeout, self.tx.send(Pending { job, reply }))
            .await
            .map_err(|_| Failure::Timeout("waiting for the batcher"))?
            .map_err(|_| Failure::Io("the batcher has ended".into()))?;
        // The request itself is bounded by the client's timeout; this bounds the gathering.
        let limit = self.timeout.saturating_mul(2);
        tokio::time::timeout(limit, answer)
            .await
            .map_err(|_| Failure::Timeout("waiting for the batched reply"))?
            .map_err(|_| Failure::Io("the batcher dropped the job".into()))?
    }
}

async fn gather(
    client: Client,
    mut rx: mpsc::Receiver<Pending>,
    max_rows: usize,
    max_delay: Duration,
) {
    let mut carried: Option<Pending> = None;
    loop {
        let first = match carried.take() {
            Some(p) => p,
            None => match rx.recv().await {
                Some(p) => p,
                None => return,
            },
        };
        let due = crate::later(Instant::now(), max_delay);
        let mut rows = first.job.rows;
        let mut batch = vec![first];
        while rows < max_rows {
            match tokio::time::timeout_at(due.into(), rx.recv()).await {
                Ok(Some(p)) if rows.saturating_add(p.job.rows) > max_rows => {
                    carried = Some(p);
                    break;
                }
                Ok(Some(p)) => {
                    rows += p.job.rows;
                    batch.push(p);
                }
                Ok(None) | Err(_) => break,
            }
        }
        let client = client.clone();
        tokio::spawn(send(client, batch, rows));
    }
}

/// Sends `batch` as one job of `rows` rows and answers each of its jobs.
async fn send(client: Client, batch: Vec<Pending>, rows: usize) {
    let mut data = Vec::with_capacity(batch.iter().map(|p| p.job.data.len()).sum());
    for p in &batch {
        data.extend_from_slice(&p.job.data);
    }
    let head = &batch[0].job;
    let job = JobSpec {
        rows,
        data,
        priority: head.priority,
        tenant: head.tenant.clone(),
        deadline: head.deadline,
    };
    match client.submit(&job).await {
        Ok(r) if r.data.len() == job.data.len() => {
            let mut at = 0;
            for p in batch {
                let n = p.job.data.len();
                let _ = p.reply.send(Ok(JobResult {
                    rows: p.job.rows,
                    data: r.data[at..at + n].to_vec(),
                    ..r.clone_stats()
                }));
                at += n;
            }
        }
        Ok(r) => {
            let why = format!("{} values back for {} sent", r.data.len(), job.data.len());
            for p in batch {
                let _ = p.reply.send(Err(Failure::BadReply(why.clone())));
            }
        }
        Err(f) => {
            for p in batch {
                let _ = p.reply.send(Err(f.clone()));
            }
        }
    }
}
