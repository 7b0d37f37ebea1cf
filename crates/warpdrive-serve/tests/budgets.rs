//! Budgets per tenant, and bad headers: each refusal a clear 4xx, everyone else served.

mod common;

use std::collections::HashMap;
use std::time::Duration;

use common::{config, double, gated, http_with, job, wait_until};
use warpdrive_serve::{Budget, Dispatch, ServeConfig};

fn tenant(name: &str) -> String {
    format!("x-warpdrive-tenant: {name}\r\n")
}

#[test]
fn a_tenant_past_its_jobs_in_flight_gets_429_and_others_run_on() {
    let (server, open, seen) = gated(ServeConfig {
        max_batch_rows: 1,
        max_delay: Duration::ZERO,
        budget: Budget {
            jobs_in_flight: 1,
            ..Budget::default()
        },
        ..config()
    });
    let a = server.addr;
    std::thread::scope(|s| {
        let first =
            s.spawn(move || http_with(a, "/v1/jobs", &tenant("a"), job(1, &[0.0]).as_bytes()));
        wait_until("a's first job to start", || seen.lock().unwrap().len() == 1);
        let (status, text) = http_with(a, "/v1/jobs", &tenant("a"), job(1, &[1.0]).as_bytes());
        assert_eq!(status, 429, "{text}");
        assert!(text.contains("jobs in flight"), "{text}");
        let other =
            s.spawn(move || http_with(a, "/v1/jobs", &tenant("b"), job(1, &[2.0]).as_bytes()));
        wait_until("b's job to queue", || server.queued() == 1);
        open.send(()).unwrap();
        open.send(()).unwrap();
        assert_eq!(first.join().unwrap().0, 200);
        assert_eq!(other.join().unwrap().0, 200);
    });
    // a's job is done: its budget is back.
    open.send(()).unwrap();
    assert_eq!(
        http_with(a, "/v1/jobs", &tenant("a"), job(1, &[3.0]).as_bytes()).0,
        200
    );
}

#[test]
fn rates_and_bytes_are_budgeted_per_tenant() {
    let mut named = HashMap::new();
    named.insert(
        "slow".to_string(),
        Budget {
            rate_per_s: 0.5,
            burst: 1.0,
            ..Budget::default()
        },
    );
    let server = double(
        1,
        Duration::ZERO,
        ServeConfig {
            budget: Budget {
                bytes_in_flight: 64,
                ..Budget::default()
            },
            tenant_budgets: named,
            ..config()
        },
    );
    let a = server.addr;
    assert_eq!(
        http_with(a, "/v1/jobs", &tenant("slow"), job(1, &[1.0]).as_bytes()).0,
        200
    );
    let (status, text) = http_with(a, "/v1/jobs", &tenant("slow"), job(1, &[1.0]).as_bytes());
    assert_eq!(status, 429, "{text}");
    assert!(
        text.to_ascii_lowercase().contains("retry-after: 2"),
        "{text}"
    );
    // The default budget: 8 bytes a row (in and out), 64 in all.
    assert_eq!(
        http_with(a, "/v1/jobs", "", job(8, &[1.0; 8]).as_bytes()).0,
        200
    );
    let (status, text) = http_with(a, "/v1/jobs", "", job(9, &[1.0; 9]).as_bytes());
    assert_eq!(status, 413, "{text}");
    assert!(text.contains("whole budget of 64"), "{text}");
}

#[test]
fn bad_headers_and_bodies_get_a_4xx_that_says_why() {
    let server = double(2, Duration::ZERO, config());
    let a = server.addr;
    let ok = job(1, &[1.0, 2.0]);
    let mut garbage = b"WDT1".to_vec();
    garbage.extend_from_slice(&[1, 0, 0, 0, 255, 255, 255, 255, 2, 0, 0, 0]);
    for (headers, body, want, why) in [
        (
            "x-warpdrive-priority: 7\r\n",
            ok.as_bytes(),
            400,
            "expected 0",
        ),
        (
            "x-warpdrive-priority: high\r\n",
            ok.as_bytes(),
            400,
            "expected 0",
        ),
        (
            "x-warpdrive-deadline-ms: 0\r\n",
            ok.as_bytes(),
            400,
            "milliseconds",
        ),
        (
            "x-warpdrive-deadline-ms: -5\r\n",
            ok.as_bytes(),
            400,
            "milliseconds",
        ),
        (
            "x-warpdrive-tenant: a b\r\n",
            ok.as_bytes(),
            400,
            "visible ASCII",
        ),
        (
            "Content-Type: text/plain\r\n",
            ok.as_bytes(),
            415,
            "expected application/json",
        ),
        (
            "Content-Type: application/x-warpdrive-tensor\r\n",
            &garbage[..],
            400,
            "the body holds 0",
        ),
        (
            "Content-Type: application/x-warpdrive-tensor\r\n",
            b"WD",
            400,
            "shorter than",
        ),
        (
            "Content-Type: application/x-warpdrive-tensor\r\n",
            ok.as_bytes(),
            400,
            "magic",
        ),
    ] {
        let (status, text) = http_with(a, "/v1/jobs", headers, body);
        assert_eq!(status, want, "{headers}: {text}");
        assert!(text.contains(why), "{headers}: {text}");
    }
    assert_eq!(
        http_with(a, "/v1/jobs", "x-warpdrive-priority: 3\r\n", ok.as_bytes()).0,
        200
    );
}

/// Doubles its input; each row takes 100 bytes of (pretend) device memory.
struct DeviceRows;

impl warpdrive_serve::Model for DeviceRows {
    fn name(&self) -> &str {
        "device-rows"
    }
    fn width(&self) -> usize {
        1
    }
    fn run(&mut self, input: &[f32], output: &mut Vec<f32>) -> warpdrive::Result<()> {
        output.clear();
        output.extend(input.iter().map(|v| 2.0 * v));
        Ok(())
    }
    fn device_bytes(&self, rows: usize) -> usize {
        rows * 100
    }
}

#[test]
fn a_job_past_its_tenants_device_memory_fails_alone_and_its_batch_runs() {
    let mut named = HashMap::new();
    named.insert(
        "small".to_string(),
        Budget {
            device_bytes: 150,
            ..Budget::default()
        },
    );
    // Batches close at 3 rows (the window is longer than any test wait): each round below
    // is one batch.
    let server = warpdrive_serve::Server::start(
        || Ok(Box::new(DeviceRows)),
        ServeConfig {
            max_batch_rows: 3,
            max_delay: Duration::from_secs(60),
            dispatch: Dispatch::Window,
            tenant_budgets: named,
            ..config()
        },
    )
    .unwrap();
    let a = server.addr;
    let send = |who: &'static str, rows: usize| {
        std::thread::spawn(move || {
            http_with(
                a,
                "/v1/jobs",
                &tenant(who),
                job(rows, &vec![1.0; rows]).as_bytes(),
            )
        })
    };
    // Two one-row jobs of "small" (100 bytes each, 150 allowed) and one of another tenant.
    let round = [send("small", 1), send("small", 1), send("other", 1)];
    let [s1, s2, other] = round.map(|t| t.join().unwrap());
    assert_eq!(other.0, 200, "{}", other.1);
    let mut small = [s1, s2];
    small.sort_by_key(|r| r.0);
    assert_eq!((small[0].0, small[1].0), (200, 429), "{small:?}");
    assert!(
        small[1].1.contains("device memory budget is 150 bytes"),
        "{}",
        small[1].1
    );
    // A job no budget of its tenant could hold: 413; its batch-mate runs.
    let round = [send("small", 2), send("other", 1)];
    let [big, other] = round.map(|t| t.join().unwrap());
    assert_eq!(big.0, 413, "{}", big.1);
    assert_eq!(other.0, 200, "{}", other.1);
    // Nothing is held once the batches end: "small" runs again.
    let round = [send("small", 1), send("other", 1), send("other", 1)];
    for r in round.map(|t| t.join().unwrap()) {
        assert_eq!(r.0, 200, "{}", r.1);
    }
}
