//! Jobs submitted without waiting (`POST /v1/jobs?async=true`) and fetched later
//! (`GET /v1/jobs/ID`, once, optionally waiting): in both body formats, pending until the
//! batch runs, a cap on results waiting to be fetched, and bad ids and queries refused.

mod common;

use std::time::Duration;

use common::{config, double, gated, http, http_with, job, wait_until};
use warpdrive_serve::wire::{Dtype, Format};
use warpdrive_serve::{Client, ClientConfig, Failure, JobSpec, ServeConfig};

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

fn one(v: f32) -> JobSpec {
    JobSpec {
        rows: 1,
        data: vec![v],
        ..JobSpec::default()
    }
}

#[test]
fn a_job_submitted_without_waiting_is_fetched_once() {
    let server = double(1, Duration::ZERO, config());
    let rt = runtime();
    for format in [Format::Json, Format::Binary(Dtype::Bf16)] {
        let client = Client::new(
            server.addr,
            ClientConfig {
                format,
                ..ClientConfig::default()
            },
        );
        let id = rt.block_on(client.submit_async(&one(3.0))).unwrap();
        let r = rt
            .block_on(client.fetch(id, Duration::from_secs(20)))
            .unwrap()
            .expect("answered within the wait");
        assert_eq!((r.rows, r.data.as_slice()), (1, &[6.0][..]), "{format:?}");
        match rt.block_on(client.fetch(id, Duration::ZERO)) {
            Err(Failure::Status(404, why)) => assert!(why.contains("fetched already"), "{why}"),
            other => panic!("{other:?}"),
        }
    }
}

#[test]
fn a_result_is_pending_until_its_batch_runs() {
    let (server, open, seen) = gated(ServeConfig {
        max_batch_rows: 1,
        max_delay: Duration::ZERO,
        result_slots: 1,
        ..config()
    });
    let rt = runtime();
    let client = Client::new(server.addr, ClientConfig::default());
    let id = rt.block_on(client.submit_async(&one(1.0))).unwrap();
    wait_until("the job to start", || seen.lock().unwrap().len() == 1);
    assert_eq!(rt.block_on(client.fetch(id, Duration::ZERO)), Ok(None));
    assert_eq!(
        rt.block_on(client.fetch(id, Duration::from_millis(20))),
        Ok(None),
        "a wait that ends first says pending"
    );
    // One slot, taken: another asynchronous job is refused; a waiting one is not.
    match rt.block_on(client.submit_async(&one(2.0))) {
        Err(Failure::Status(503, why)) => assert!(why.contains("fetched"), "{why}"),
        other => panic!("{other:?}"),
    }
    open.send(()).unwrap();
    let r = rt
        .block_on(client.fetch(id, Duration::from_secs(20)))
        .unwrap()
        .expect("answered");
    assert_eq!(r.data, [2.0]);
    open.send(()).unwrap();
    assert_eq!(rt.block_on(client.submit(&one(2.0))).unwrap().data, [4.0]);
}

#[test]
fn bad_ids_and_queries_are_refused() {
    let server = double(1, Duration::ZERO, config());
    let a = server.addr;
    let body = job(1, &[1.0]);
    let (status, text) = http_with(a, "/v1/jobs?async=maybe", "", body.as_bytes());
    assert_eq!(status, 400, "{text}");
    assert!(text.contains("async=maybe"), "{text}");
    assert_eq!(http(a, "GET", "/v1/jobs/abc", "").0, 404);
    assert_eq!(http(a, "GET", "/v1/jobs/99999", "").0, 404);
    assert_eq!(http(a, "GET", "/v1/jobs/1?wait_ms=soon", "").0, 400);
    assert_eq!(http(a, "DELETE", "/v1/jobs/1", "").0, 405);
    // async=false is the plain, waiting submission.
    assert_eq!(
        http_with(a, "/v1/jobs?async=false", "", body.as_bytes()).0,
        200
    );
}
