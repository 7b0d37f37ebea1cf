//! Several batcher threads, each with its own model, on one queue: two batches run at once,
//! every job gets its own rows back, and `Server::start` refuses more than one worker.

mod common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{config, http, job, WAIT};
use warpdrive::Result;
use warpdrive_serve::load::{self, Arrivals, LoadConfig};
use warpdrive_serve::{Model, ServeConfig, Server};

/// Doubles its input; each run waits (up to [`WAIT`]) until `together` runs are under way
/// at once, and counts the runs that saw them.
struct Meet {
    running: Arc<AtomicUsize>,
    met: Arc<AtomicUsize>,
    together: usize,
}

impl Model for Meet {
    fn name(&self) -> &str {
        "meet"
    }
    fn width(&self) -> usize {
        1
    }
    fn run(&mut self, input: &[f32], output: &mut Vec<f32>) -> Result<()> {
        self.running.fetch_add(1, Ordering::AcqRel);
        let t0 = Instant::now();
        while self.running.load(Ordering::Acquire) < self.together && t0.elapsed() < WAIT {
            std::thread::sleep(Duration::from_millis(1));
        }
        if self.running.load(Ordering::Acquire) >= self.together {
            self.met.fetch_add(1, Ordering::AcqRel);
        }
        output.clear();
        output.extend(input.iter().map(|v| 2.0 * v));
        // Leave only once the others have seen this one running too.
        while self.met.load(Ordering::Acquire) < self.together && t0.elapsed() < WAIT {
            std::thread::sleep(Duration::from_millis(1));
        }
        self.running.fetch_sub(1, Ordering::AcqRel);
        Ok(())
    }
}

fn two_workers() -> ServeConfig {
    ServeConfig {
        workers: 2,
        max_batch_rows: 1,
        max_delay: Duration::ZERO,
        ..config()
    }
}

#[test]
fn two_workers_run_two_batches_at_once() {
    let (running, met) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
    let (r, m) = (running.clone(), met.clone());
    let server = Server::start_workers(
        move || {
            Ok(Box::new(Meet {
                running: r.clone(),
                met: m.clone(),
                together: 2,
            }))
        },
        two_workers(),
    )
    .unwrap();
    assert_eq!(server.status().workers, 2);
    let a = server.addr;
    let replies: Vec<(u16, String)> = std::thread::scope(|s| {
        let jobs: Vec<_> = (0..2)
            .map(|k| s.spawn(move || http(a, "POST", "/v1/jobs", &job(1, &[k as f32]))))
            .collect();
        jobs.into_iter().map(|j| j.join().unwrap()).collect()
    });
    for (status, body) in &replies {
        assert_eq!(*status, 200, "{body}");
    }
    assert_eq!(
        met.load(Ordering::Acquire),
        2,
        "the two batches never ran together"
    );
}

#[test]
fn every_job_gets_its_rows_back_from_several_workers() {
    let server = Server::start_workers(
        || {
            Ok(Box::new(common::Double {
                width: 3,
                delay: Duration::from_millis(1),
            }))
        },
        ServeConfig {
            max_batch_rows: 8,
            max_delay: Duration::from_millis(1),
            workers: 3,
            ..config()
        },
    )
    .unwrap();
    let r = load::run(&LoadConfig {
        max_jobs: Some(200),
        rows: 2,
        ..LoadConfig::new(server.addr, Arrivals::Clients(8), WAIT)
    })
    .unwrap();
    assert_eq!(
        (r.answered(), r.failed()),
        (200, 0),
        "{:?}",
        r.first_failure
    );
    for (status, body) in (0..3).map(|k| {
        http(
            server.addr,
            "POST",
            "/v1/jobs",
            &job(1, &[k as f32, 1.0, 2.0]),
        )
    }) {
        assert_eq!(status, 200, "{body}");
    }
    server.stop();
}

#[test]
fn start_refuses_several_workers_with_one_model() {
    let e = Server::start(
        || {
            Ok(Box::new(common::Double {
                width: 1,
                delay: Duration::ZERO,
            }))
        },
        two_workers(),
    )
    .err()
    .expect("refused");
    assert!(e.to_string().contains("start_workers"), "{e}");
}

/// Doubles its input and records the rows of every run.
struct Seen(Arc<std::sync::Mutex<Vec<usize>>>);

impl Model for Seen {
    fn name(&self) -> &str {
        "seen"
    }
    fn width(&self) -> usize {
        2
    }
    fn run(&mut self, input: &[f32], output: &mut Vec<f32>) -> Result<()> {
        if input.iter().all(|&v| v == 0.0) {
            return Err(warpdrive::Error::InvalidArgument("zeros".into()));
        }
        self.0.lock().unwrap().push(input.len() / 2);
        output.clear();
        output.extend(input.iter().map(|v| 2.0 * v));
        Ok(())
    }
}

#[test]
fn every_worker_warms_up_each_batch_size_before_serving() {
    let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
    let s = seen.clone();
    let server = Server::start_workers(
        move || Ok(Box::new(Seen(s.clone()))),
        ServeConfig {
            warm_rows: vec![1, 3, 8],
            ..two_workers()
        },
    )
    .unwrap();
    let mut runs = seen.lock().unwrap().clone();
    runs.sort_unstable();
    assert_eq!(runs, [1, 1, 3, 3, 8, 8], "each size once on each worker");
    assert_eq!(
        http(server.addr, "POST", "/v1/jobs", &job(1, &[1.0, 2.0])).0,
        200
    );
    drop(server);
    // A size the model fails on fails the start, with the size in the reason.
    let e = Server::start(
        || Ok(Box::new(Seen(Default::default()))),
        ServeConfig {
            warm_rows: vec![0],
            ..config()
        },
    )
    .err()
    .map(|e| e.to_string())
    .unwrap_or_default();
    assert!(e.contains("warming up 0 rows"), "{e}");
}
