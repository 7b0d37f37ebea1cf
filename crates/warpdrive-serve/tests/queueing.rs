//! How queued jobs are taken: higher classes first with a starvation bound, a job past its
//! deadline answered 504 without running, a job whose client left dropped without running;
//! everyone else served; a full queue refuses with 503.

mod common;

use std::io::Write;
use std::net::{Shutdown, TcpStream};
use std::time::{Duration, Instant};

use common::{config, gated, http, http_with, job, wait_until, Double};
use warpdrive_serve::{ServeConfig, Server};

fn one_at_a_time() -> ServeConfig {
    ServeConfig {
        max_batch_rows: 1,
        max_delay: Duration::ZERO,
        ..config()
    }
}

fn priority(class: u8) -> String {
    format!("x-warpdrive-priority: {class}\r\n")
}

#[test]
fn higher_classes_run_first_and_a_starved_class_gets_its_turn() {
    let (server, open, seen) = gated(ServeConfig {
        starvation_limit: 3,
        ..one_at_a_time()
    });
    let a = server.addr;
    let statuses: Vec<u16> = std::thread::scope(|s| {
        let send = |value: f32, class: u8| {
            s.spawn(move || {
                http_with(a, "/v1/jobs", &priority(class), job(1, &[value]).as_bytes()).0
            })
        };
        let mut sent = vec![send(0.0, 1)];
        wait_until("the first job to start", || seen.lock().unwrap().len() == 1);
        sent.push(send(1.0, 0));
        wait_until("the low job to queue", || server.queued() == 1);
        for k in 0..6 {
            sent.push(send(10.0 + k as f32, 3));
            wait_until("a high job to queue", || server.queued() == 2 + k);
        }
        for _ in 0..8 {
            open.send(()).unwrap();
        }
        sent.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert!(statuses.iter().all(|&s| s == 200), "{statuses:?}");
    assert_eq!(
        *seen.lock().unwrap(),
        [0.0, 10.0, 11.0, 12.0, 1.0, 13.0, 14.0, 15.0],
        "three batches passed the low job over, the fourth took it first"
    );
}

#[test]
fn a_job_past_its_deadline_is_answered_504_without_running() {
    let (server, open, seen) = gated(one_at_a_time());
    let a = server.addr;
    std::thread::scope(|s| {
        let first = s.spawn(move || http_with(a, "/v1/jobs", "", job(1, &[0.0]).as_bytes()));
        wait_until("the first job to start", || seen.lock().unwrap().len() == 1);
        let late = s.spawn(move || {
            http_with(
                a,
                "/v1/jobs",
                "x-warpdrive-deadline-ms: 30\r\n",
                job(1, &[1.0]).as_bytes(),
            )
        });
        wait_until("the late job to queue", || server.queued() == 1);
        let t0 = Instant::now();
        wait_until("its deadline to pass", || {
            t0.elapsed() > Duration::from_millis(40)
        });
        open.send(()).unwrap();
        let (status, text) = late.join().unwrap();
        assert_eq!(status, 504, "{text}");
        assert!(text.contains("deadline"), "{text}");
        assert_eq!(first.join().unwrap().0, 200);
    });
    assert_eq!(*seen.lock().unwrap(), [0.0]);
    wait_until("the status to count it", || {
        server.status().expired_total == 1
    });
}

#[test]
fn a_client_that_leaves_mid_batch_costs_no_one_else() {
    let (server, open, seen) = gated(ServeConfig {
        interval: Duration::from_millis(10),
        ..one_at_a_time()
    });
    let a = server.addr;
    std::thread::scope(|s| {
        let first = s.spawn(move || http_with(a, "/v1/jobs", "", job(1, &[0.0]).as_bytes()));
        wait_until("the first job to start", || seen.lock().unwrap().len() == 1);
        let body = job(1, &[5.0]);
        let mut gone = TcpStream::connect(a).unwrap();
        write!(
            gone,
            "POST /v1/jobs HTTP/1.1\r\nHost: x\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        )
        .unwrap();
        wait_until("its job to queue", || server.queued() == 1);
        gone.shutdown(Shutdown::Both).unwrap();
        drop(gone);
        let stays = s.spawn(move || http_with(a, "/v1/jobs", "", job(1, &[7.0]).as_bytes()));
        wait_until("the other job to queue", || server.queued() == 2);
        for _ in 0..3 {
            open.send(()).unwrap();
        }
        assert_eq!(first.join().unwrap().0, 200);
        assert_eq!(stays.join().unwrap().0, 200);
    });
    wait_until("the status to count the job that left", || {
        server.status().cancelled_total == 1
    });
    assert_eq!(*seen.lock().unwrap(), [0.0, 7.0]);
}

#[test]
fn a_full_queue_refuses_with_503() {
    // In this binary, not serve.rs's: the metrics are the process's, and the job it holds
    // queued would show in the queue gauge that a test there reads.
    let server = Server::start(
        || {
            Ok(Box::new(Double {
                width: 1,
                delay: Duration::from_millis(300),
            }))
        },
        ServeConfig {
            queue_jobs: 1,
            max_batch_rows: 1,
            max_delay: Duration::ZERO,
            ..config()
        },
    )
    .unwrap();
    let statuses: Vec<u16> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..6)
            .map(|k| {
                let a = server.addr;
                s.spawn(move || http(a, "POST", "/v1/jobs", &job(1, &[k as f32])).0)
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert!(statuses.contains(&200), "{statuses:?}");
    assert!(statuses.contains(&503), "{statuses:?}");
    assert!(
        statuses.iter().all(|s| *s == 200 || *s == 503),
        "{statuses:?}"
    );
}
