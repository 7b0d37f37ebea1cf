//! When a batch closes: on an idle device at once (a lone job never waits out the delay),
//! and while the device is busy the jobs that arrive wait and leave together as the next
//! batch.

mod common;

use std::time::Duration;

use common::{config, gated, http, job, wait_until};
use warpdrive_serve::ServeConfig;

/// A delay no test waits out: a job answered at all was not held for it.
const FOREVER: Duration = Duration::from_secs(3600);

fn when_idle() -> ServeConfig {
    ServeConfig {
        max_batch_rows: 256,
        max_delay: FOREVER,
        ..config()
    }
}

#[test]
fn a_lone_job_on_an_idle_device_runs_without_waiting_out_the_delay() {
    let (server, open, seen) = gated(when_idle());
    let a = server.addr;
    std::thread::scope(|s| {
        let lone = s.spawn(move || http(a, "POST", "/v1/jobs", &job(1, &[3.0])));
        wait_until("the lone job to start", || seen.lock().unwrap().len() == 1);
        open.send(()).unwrap();
        let (status, body) = lone.join().unwrap();
        assert_eq!(status, 200, "{body}");
        let v: serde_json::Value = serde_json::from_str(&body).unwrap();
        assert_eq!(
            (v["data"][0].as_f64(), v["batch_rows"].as_u64()),
            (Some(6.0), Some(1))
        );
    });
}

#[test]
fn jobs_that_arrive_while_a_batch_runs_leave_together_as_the_next() {
    let (server, open, seen) = gated(when_idle());
    let a = server.addr;
    let replies: Vec<(u16, String)> = std::thread::scope(|s| {
        let mut sent = vec![s.spawn(move || http(a, "POST", "/v1/jobs", &job(1, &[0.0])))];
        wait_until("the first batch to start", || {
            seen.lock().unwrap().len() == 1
        });
        for k in 1..=3 {
            sent.push(s.spawn(move || http(a, "POST", "/v1/jobs", &job(1, &[k as f32]))));
        }
        wait_until("three jobs to queue behind it", || server.queued() == 3);
        open.send(()).unwrap();
        wait_until("the second batch to start", || {
            seen.lock().unwrap().len() == 2
        });
        open.send(()).unwrap();
        sent.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let rows: Vec<u64> = replies
        .iter()
        .map(|(status, body)| {
            assert_eq!(*status, 200, "{body}");
            let v: serde_json::Value = serde_json::from_str(body).unwrap();
            v["batch_rows"].as_u64().unwrap_or(0)
        })
        .collect();
    assert_eq!(
        rows,
        [1, 3, 3, 3],
        "the first alone, the three queued behind it as one batch"
    );
    assert_eq!(seen.lock().unwrap().len(), 2);
}
