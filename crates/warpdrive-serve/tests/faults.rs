//! Device faults: out of memory halves the batch until it fits, and every job is answered;
//! a sticky fault answers every queued job with 503, and the service reports itself
//! unhealthy and refuses new jobs with 503 from then on.

mod common;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use common::{config, http, job, wait_until};
use warpdrive::{Error, Result};
use warpdrive_serve::{Dispatch, Model, ServeConfig, Server};

/// Doubles its input, but runs out of memory on batches over `fits` rows; faults for good
/// once `fault` is set.
struct Fragile {
    fits: usize,
    fault: Arc<AtomicBool>,
    lost: bool,
}

impl Model for Fragile {
    fn name(&self) -> &str {
        "fragile"
    }
    fn width(&self) -> usize {
        1
    }
    fn run(&mut self, input: &[f32], output: &mut Vec<f32>) -> Result<()> {
        if self.fault.load(Ordering::Acquire) {
            self.lost = true;
            return Err(Error::DeviceLost {
                call: "cuLaunchKernel",
                message: "an illegal memory access was encountered".into(),
            });
        }
        if input.len() > self.fits {
            return Err(Error::OutOfMemory {
                requested: input.len() * 4,
                detail: format!("{} rows fit", self.fits),
            });
        }
        output.clear();
        output.extend(input.iter().map(|v| 2.0 * v));
        Ok(())
    }
    fn is_lost(&self) -> bool {
        self.lost
    }
}

fn fragile(fits: usize, fault: Arc<AtomicBool>, config: ServeConfig) -> Server {
    Server::start(
        move || {
            Ok(Box::new(Fragile {
                fits,
                fault,
                lost: false,
            }))
        },
        config,
    )
    .unwrap()
}

#[test]
fn out_of_memory_halves_the_batch_and_answers_every_job() {
    let server = fragile(
        2,
        Arc::new(AtomicBool::new(false)),
        ServeConfig {
            max_delay: Duration::from_millis(50),
            dispatch: Dispatch::Window,
            ..config()
        },
    );
    let a = server.addr;
    let replies: Vec<(u16, String)> = std::thread::scope(|s| {
        let jobs: Vec<_> = (0..8)
            .map(|k| s.spawn(move || http(a, "POST", "/v1/jobs", &job(1, &[k as f32]))))
            .collect();
        jobs.into_iter().map(|j| j.join().unwrap()).collect()
    });
    for (k, (status, body)) in replies.iter().enumerate() {
        assert_eq!(*status, 200, "job {k}: {body}");
        let v: serde_json::Value = serde_json::from_str(body).unwrap();
        assert_eq!(v["data"][0].as_f64(), Some(2.0 * k as f64));
    }
    // A single job too large for the device is that job's error alone.
    let (status, body) = http(a, "POST", "/v1/jobs", &job(3, &[1.0, 2.0, 3.0]));
    assert_eq!(status, 500, "{body}");
    assert!(body.contains("2 rows fit"), "{body}");
    assert_eq!(http(a, "GET", "/health", "").0, 200);
}

#[test]
fn a_sticky_fault_answers_every_job_503_and_stays_unhealthy() {
    let fault = Arc::new(AtomicBool::new(false));
    let server = fragile(
        1,
        fault.clone(),
        ServeConfig {
            max_batch_rows: 1,
            max_delay: Duration::ZERO,
            ..config()
        },
    );
    let a = server.addr;
    assert_eq!(http(a, "POST", "/v1/jobs", &job(1, &[1.0])).0, 200);
    fault.store(true, Ordering::Release);
    let replies: Vec<(u16, String)> = std::thread::scope(|s| {
        let jobs: Vec<_> = (0..4)
            .map(|k| s.spawn(move || http(a, "POST", "/v1/jobs", &job(1, &[k as f32]))))
            .collect();
        jobs.into_iter().map(|j| j.join().unwrap()).collect()
    });
    for (status, body) in &replies {
        assert_eq!(*status, 503, "{body}");
    }
    assert!(
        replies
            .iter()
            .any(|(_, b)| b.contains("illegal memory access")),
        "{replies:?}"
    );
    wait_until("the status to say so", || !server.status().healthy);
    let (status, body) = http(a, "GET", "/health", "");
    assert_eq!(status, 503, "{body}");
    let (status, body) = http(a, "POST", "/v1/jobs", &job(1, &[1.0]));
    assert_eq!(status, 503, "{body}");
    assert!(body.contains("unhealthy"), "{body}");
}
