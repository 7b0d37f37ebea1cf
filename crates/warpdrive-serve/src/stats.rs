//! What the service saw over an interval ([`Seen`], which the controller steers by), and the
//! status it publishes ([`Status`]: `GET /v1/status`, the dashboard's stream).

use std::time::{Duration, Instant};

use serde::Serialize;

/// One interval, summed up.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct Seen {
    /// The interval's length.
    pub seconds: f64,
    /// Jobs answered (with rows) in it.
    pub jobs: usize,
    pub rows: usize,
    pub batches: usize,
    /// The fraction of the interval the model ran (0 to 1).
    pub busy: f64,
    /// Latency percentiles of the jobs answered, arrival to answer, µs (NaN without jobs).
    pub p50_us: f64,
    pub p99_us: f64,
    /// The 99th percentile of the batches' run times, µs.
    pub run_p99_us: f64,
    /// The fraction of batches that closed at the rows knob.
    pub full_batches: f64,
    /// Jobs waiting when the interval ended.
    pub queue_jobs: usize,
}

/// The samples of the interval under way, kept by the batcher.
#[derive(Debug)]
pub(crate) struct Window {
    started: Instant,
    busy: Duration,
    latency_us: Vec<f64>,
    run_us: Vec<f64>,
    rows: usize,
    full: usize,
}

/// Samples kept per interval at most (a busier interval keeps the first ones).
const MAX_SAMPLES: usize = 1 << 16;

impl Window {
    pub(crate) fn new(now: Instant) -> Window {
        Window {
            started: now,
            busy: Duration::ZERO,
            latency_us: Vec::new(),
            run_us: Vec::new(),
            rows: 0,
            full: 0,
        }
    }

    pub(crate) fn age(&self, now: Instant) -> Duration {
        now.saturating_duration_since(self.started)
    }

    /// A batch of `rows` ran for `run`; `full` when it closed at the rows knob.
    pub(crate) fn batch(&mut self, rows: usize, run: Duration, full: bool) {
        self.busy += run;
        self.rows = self.rows.saturating_add(rows);
        self.full += usize::from(full);
        if self.run_us.len() < MAX_SAMPLES {
            self.run_us.push(run.as_secs_f64() * 1e6);
        }
    }

    /// A job was answered `latency` after it arrived.
    pub(crate) fn job(&mut self, latency: Duration) {
        if self.latency_us.len() < MAX_SAMPLES {
            self.latency_us.push(latency.as_secs_f64() * 1e6);
        }
    }

    /// Adds `other`'s samples (another batcher thread's) to this interval's.
    pub(crate) fn merge(&mut self, other: Window) {
        self.busy += other.busy;
        self.rows = self.rows.saturating_add(other.rows);
        self.full += other.full;
        let room = MAX_SAMPLES.saturating_sub(self.latency_us.len());
        self.latency_us
            .extend(other.latency_us.into_iter().take(room));
        let room = MAX_SAMPLES.saturating_sub(self.run_us.len());
        self.run_us.extend(other.run_us.into_iter().take(room));
    }

    /// The interval up to `now`, summed up; busy is the mean over `workers` threads.
    pub(crate) fn finish(&mut self, now: Instant, queue_jobs: usize, workers: usize) -> Seen {
        let seconds = self.age(now).as_secs_f64();
        let batches = self.run_us.len();
        Seen {
            seconds,
            jobs: self.latency_us.len(),
            rows: self.rows,
            batches,
            busy: (self.busy.as_secs_f64() / (seconds.max(1e-9) * workers.max(1) as f64)).min(1.0),
            p50_us: quantile(&mut self.latency_us, 0.5),
            p99_us: quantile(&mut self.latency_us, 0.99),
            run_p99_us: quantile(&mut self.run_us, 0.99),
            full_batches: self.full as f64 / batches.max(1) as f64,
            queue_jobs,
        }
    }
}

/// The nearest-rank quantile `q` of `v` (NaN when empty). warpdrive-bench has the
/// interpolating one the results use, but it depends on this crate, not the other way round;
/// the controller needs no interpolation.
fn quantile(v: &mut [f64], q: f64) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    let k = ((v.len() - 1) as f64 * q.clamp(0.0, 1.0)).round() as usize;
    *v.select_nth_unstable_by(k, f64::total_cmp).1
}

/// The service's state, published once an interval.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Status {
    pub model: String,
    pub healthy: bool,
    /// The knobs now: rows a batch closes at, and the delay, µs.
    pub batch_rows: usize,
    pub delay_us: f64,
    /// Whether the controller sets the knobs.
    pub controller: bool,
    /// Batcher threads (each with its own model).
    pub workers: usize,
    /// The batch sweep at start (`ServeConfig::tune_batch`): the smallest batch within
    /// 90 % of the best throughput, and the best.
    pub tuned_knee: Option<usize>,
    pub tuned_best: Option<usize>,
    /// The last interval.
    pub last: Seen,
    /// Jobs and rows a second over the last interval.
    pub jobs_per_s: f64,
    pub rows_per_s: f64,
    /// Jobs answered since the start, and jobs refused or failed after being queued
    /// (expired, cancelled by their client, failed by the model).
    pub jobs_total: u64,
    pub expired_total: u64,
    pub cancelled_total: u64,
    pub failed_total: u64,
    /// Seconds the model has run since the start (the busy fraction over any span is the
    /// change in this over the span's length).
    pub busy_seconds_total: f64,
    /// Device memory the pools hold and use, bytes (0 on the CPU backend).
    pub pool_reserved_bytes: u64,
    pub pool_used_bytes: u64,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_interval_sums_up_its_batches_and_jobs() {
        let t0 = Instant::now();
        let mut w = Window::new(t0);
        for i in 1..=100u64 {
            w.job(Duration::from_micros(i));
        }
        w.batch(8, Duration::from_millis(10), true);
        w.batch(2, Duration::from_millis(20), false);
        let s = w.finish(t0 + Duration::from_millis(100), 3, 1);
        assert_eq!((s.jobs, s.rows, s.batches, s.queue_jobs), (100, 10, 2, 3));
        assert!((s.busy - 0.3).abs() < 1e-9, "{}", s.busy);
        assert_eq!((s.p50_us, s.p99_us), (51.0, 99.0));
        assert_eq!(s.full_batches, 0.5);
        assert_eq!(s.run_p99_us, 20_000.0);
    }

    #[test]
    fn an_empty_interval_has_no_percentiles() {
        let t0 = Instant::now();
        let s = Window::new(t0).finish(t0, 0, 1);
        assert!(s.p99_us.is_nan() && s.busy == 0.0 && s.jobs == 0);
    }
}
