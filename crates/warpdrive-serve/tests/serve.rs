//! The job service on the CPU backend: batching that answers each job with its own rows,
//! the MoE layer behind it, and bad input refused while everyone else is served.

use std::io::Write;
use std::net::TcpStream;
use std::time::Duration;

use warpdrive::moe::{MoeConfig, MoeLayer, MoeWeights};
use warpdrive::{bf16, Buffer, Device};
use warpdrive_serve::{MoeModel, ServeConfig, Server};

mod common;

use common::{config, http, job, read_response, Double, WAIT};

#[test]
fn each_job_gets_its_own_rows_back_from_shared_batches() {
    let server = Server::start(
        || {
            Ok(Box::new(Double {
                width: 4,
                delay: Duration::from_millis(5),
            }))
        },
        config(),
    )
    .unwrap();
    let replies: Vec<serde_json::Value> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..16)
            .map(|k| {
                let addr = server.addr;
                s.spawn(move || {
                    let rows = 1 + k % 3;
                    let data: Vec<f32> = (0..rows * 4).map(|i| (k * 100 + i) as f32).collect();
                    let (status, body) = http(addr, "POST", "/v1/jobs", &job(rows, &data));
                    assert_eq!(status, 200, "{body}");
                    let v: serde_json::Value = serde_json::from_str(&body).unwrap();
                    let got: Vec<f32> = serde_json::from_value(v["data"].clone()).unwrap();
                    assert_eq!(got, data.iter().map(|x| 2.0 * x).collect::<Vec<_>>());
                    assert_eq!(v["rows"], rows);
                    v
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert!(
        replies
            .iter()
            .any(|v| v["batch_rows"].as_u64().unwrap() > v["rows"].as_u64().unwrap()),
        "no two jobs shared a batch"
    );
}

#[test]
fn the_moe_layer_answers_as_it_does_alone() {
    let device = Device::cpu();
    let config = MoeConfig::tiny();
    let hidden = config.hidden;
    let weights = || MoeWeights::Random { seed: 7 };
    let (d, c) = (device.clone(), config);
    let server = Server::start(
        move || Ok(Box::new(MoeModel::new("moe:tiny", &d, c, weights())?)),
        self::config(),
    )
    .unwrap();
    let stream = device.new_stream().unwrap();
    let mut alone = MoeLayer::<bf16>::new(&stream, config, weights()).unwrap();
    std::thread::scope(|s| {
        for k in 0..4usize {
            let addr = server.addr;
            let rows = k + 1;
            let data: Vec<f32> = (0..rows * hidden)
                .map(|i| bf16::from_f32(((i * 7 + k * 13) % 17) as f32 / 8.0 - 1.0).to_f32())
                .collect();
            let want = {
                let x: Vec<bf16> = data.iter().map(|&v| bf16::from_f32(v)).collect();
                let x = Buffer::from_host(&stream, &x).unwrap();
                let y = alone.forward(&x).unwrap().to_host(&stream).unwrap();
                y.iter().map(|v| v.to_f32()).collect::<Vec<f32>>()
            };
            s.spawn(move || {
                let (status, body) = http(addr, "POST", "/v1/jobs", &job(rows, &data));
                assert_eq!(status, 200, "{body}");
                let v: serde_json::Value = serde_json::from_str(&body).unwrap();
                let got: Vec<f32> = serde_json::from_value(v["data"].clone()).unwrap();
                assert_eq!(got, want, "job {k}");
            });
        }
    });
}

#[test]
fn bad_requests_get_a_4xx_and_the_rest_are_served() {
    let server = Server::start(
        || {
            Ok(Box::new(Double {
                width: 2,
                delay: Duration::ZERO,
            }))
        },
        ServeConfig {
            max_body_bytes: 1 << 10,
            // The slow client's 408 comes this long after its headers; the other client's 200
            // must come before it, so a loaded host gets seconds, not milliseconds, to serve it.
            body_timeout: Duration::from_secs(5),
            ..config()
        },
    )
    .unwrap();
    let a = server.addr;
    assert_eq!(http(a, "GET", "/health", "").0, 200);
    for (body, why) in [
        ("{not json", "not a job"),
        (r#"{"rows": 2, "data": [1, 2, 3]}"#, "not 2 rows of 2"),
        (r#"{"rows": 0, "data": []}"#, "not 0 rows"),
        (r#"{"rows": 1, "data": [1, 2], "extra": 1}"#, "not a job"),
        (r#"{"rows": 1, "data": [1e39, 2]}"#, "not finite"),
    ] {
        let (status, text) = http(a, "POST", "/v1/jobs", body);
        assert_eq!(status, 400, "{body}: {text}");
        assert!(text.contains(why), "{body}: {text}");
    }
    let big = job(300, &vec![1.0; 600]);
    assert_eq!(http(a, "POST", "/v1/jobs", &big).0, 413);
    assert_eq!(http(a, "GET", "/v1/jobs", "").0, 405);
    assert_eq!(http(a, "GET", "/nope", "").0, 404);
    // A client that never finishes its body: 408 for it, and others are served meanwhile.
    let mut slow = TcpStream::connect(a).unwrap();
    slow.set_read_timeout(Some(WAIT)).unwrap();
    write!(
        slow,
        "POST /v1/jobs HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{{\"rows\""
    )
    .unwrap();
    assert_eq!(http(a, "POST", "/v1/jobs", &job(1, &[1.0, 2.0])).0, 200);
    // The other client's 200 came before the slow client's 408: nothing is waiting for it yet.
    slow.set_nonblocking(true).unwrap();
    let early = slow.peek(&mut [0u8; 1]);
    assert!(
        matches!(&early, Err(e) if e.kind() == std::io::ErrorKind::WouldBlock),
        "a slow client held up another: its reply came first ({early:?})"
    );
    slow.set_nonblocking(false).unwrap();
    assert_eq!(read_response(slow).0, 408);
    assert_eq!(http(a, "GET", "/health", "").0, 200);
    let (status, metrics) = http(a, "GET", "/metrics", "");
    assert_eq!(status, 200);
    for name in [
        "warpdrive_serve_jobs_total",
        "warpdrive_serve_batch_rows",
        "warpdrive_serve_refused_total{status=\"400\"}",
        "warpdrive_serve_queue_jobs 0",
    ] {
        assert!(metrics.contains(name), "{name} missing:\n{metrics}");
    }
}
