//! The client and the load generator against the service on the CPU backend: both body
//! formats, the connection cap, open and closed loops that lose no job.

mod common;

use std::time::Duration;

use common::{config, double};
use warpdrive_serve::load::{self, Arrivals, LoadConfig};
use warpdrive_serve::wire::{Dtype, Format};
use warpdrive_serve::{Batching, Client, ClientConfig, Failure, JobSpec};

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

#[test]
fn json_and_binary_jobs_come_back_doubled() {
    let server = double(3, Duration::ZERO, config());
    let rt = runtime();
    for format in [
        Format::Json,
        Format::Binary(Dtype::F32),
        Format::Binary(Dtype::Bf16),
    ] {
        let client = Client::new(
            server.addr,
            ClientConfig {
                format,
                ..ClientConfig::default()
            },
        );
        let data: Vec<f32> = (0..6).map(|i| i as f32 * 0.5 - 1.0).collect();
        let job = JobSpec {
            rows: 2,
            data: data.clone(),
            ..JobSpec::default()
        };
        let r = rt.block_on(client.submit(&job)).unwrap();
        assert_eq!(r.rows, 2, "{format:?}");
        assert_eq!(r.data, data.iter().map(|v| 2.0 * v).collect::<Vec<_>>());
        assert!(
            r.batch_rows >= 2 && r.submit_us.is_finite(),
            "{format:?}: {r:?}"
        );
        // The wall clocks of the one host, in the order the exchange ran: sent, accepted by
        // the service, handed back to hyper, read in full (µs since the Unix epoch).
        let clocks = [
            r.sent_unix_us,
            r.accepted_unix_us,
            r.replied_unix_us,
            r.received_unix_us,
        ];
        assert!(
            clocks.iter().all(|c| c.is_finite() && *c > 1.6e15)
                && clocks.windows(2).all(|w| w[0] <= w[1]),
            "{format:?}: {clocks:?}"
        );
        let info = rt.block_on(client.model()).unwrap();
        assert_eq!((info.name.as_str(), info.width), ("double", 3));
        // A job of the wrong width is the service's 400, with its reason.
        let bad = JobSpec {
            rows: 1,
            data: vec![1.0; 4],
            ..JobSpec::default()
        };
        match rt.block_on(client.submit(&bad)) {
            Err(Failure::Status(400, why)) => assert!(!why.is_empty()),
            other => panic!("{format:?}: {other:?}"),
        }
    }
}

#[test]
fn one_connection_means_one_job_at_a_time() {
    let server = double(1, Duration::from_millis(2), config());
    let rt = runtime();
    let batch_rows = |connections: usize| -> Vec<usize> {
        let client = Client::new(
            server.addr,
            ClientConfig {
                max_connections: connections,
                ..ClientConfig::default()
            },
        );
        rt.block_on(async {
            let jobs: Vec<_> = (0..8)
                .map(|k| {
                    let client = client.clone();
                    tokio::spawn(async move {
                        let job = JobSpec {
                            rows: 1,
                            data: vec![k as f32],
                            ..JobSpec::default()
                        };
                        client.submit(&job).await.unwrap().batch_rows
                    })
                })
                .collect();
            let mut rows = Vec::new();
            for j in jobs {
                rows.push(j.await.unwrap());
            }
            rows
        })
    };
    assert!(
        batch_rows(1).iter().all(|&r| r == 1),
        "a second connection was opened"
    );
    assert!(
        batch_rows(8).iter().any(|&r| r > 1),
        "eight connections never shared a batch"
    );
}

#[test]
fn open_and_closed_loops_answer_every_job() {
    let server = double(4, Duration::from_millis(1), config());
    let open = LoadConfig {
        max_jobs: Some(60),
        ..LoadConfig::new(
            server.addr,
            Arrivals::Poisson { per_s: 400.0 },
            Duration::from_secs(10),
        )
    };
    let r = load::run(&open).unwrap();
    assert_eq!(r.sent, 60);
    assert_eq!((r.answered(), r.failed()), (60, 0), "{:?}", r.first_failure);
    assert!(r.jobs_per_s() > 0.0 && r.mean_batch_rows() >= 1.0);
    // Every job's legs to and from the service (the host's wall clock, so a clock step could
    // make one slightly negative: a second of slack), and the pacer's part of its lag.
    for (name, v) in [
        ("to_service_us", &r.to_service_us),
        ("from_service_us", &r.from_service_us),
        ("pace_us", &r.pace_us),
    ] {
        assert_eq!(v.len(), 60, "{name}");
        assert!(
            v.iter().all(|x| x.is_finite() && *x > -1e6),
            "{name}: {v:?}"
        );
    }
    assert!(r.pace_us.iter().zip(&r.lag_us).all(|(p, l)| p <= l));
    let closed = LoadConfig {
        max_jobs: Some(100),
        format: Format::Binary(Dtype::Bf16),
        rows: 3,
        ..LoadConfig::new(server.addr, Arrivals::Clients(4), Duration::from_secs(10))
    };
    let r = load::run(&closed).unwrap();
    assert_eq!((r.sent, r.answered(), r.failed()), (100, 100, 0));
    assert_eq!(r.submit_us.len(), 100);
    assert_eq!(r.to_service_us.len(), 100);
    assert!(r.from_service_us.iter().all(|x| x.is_finite()));
}

#[test]
fn a_warm_up_comes_first_and_is_not_counted() {
    let server = double(4, Duration::from_millis(1), config());
    let open = LoadConfig {
        max_jobs: Some(40),
        warmup: Duration::from_millis(100),
        ..LoadConfig::new(
            server.addr,
            Arrivals::Poisson { per_s: 400.0 },
            Duration::from_secs(10),
        )
    };
    let closed = LoadConfig {
        max_jobs: Some(30),
        ..LoadConfig::new(server.addr, Arrivals::Clients(2), Duration::from_secs(10))
    };
    for (name, c) in [("open", open), ("closed", closed.clone())] {
        let c = LoadConfig {
            warmup: Duration::from_millis(100),
            ..c
        };
        let r = load::run(&c).unwrap();
        let jobs = c.max_jobs.unwrap();
        // The run's own jobs only; the warm-up's (its arrivals are the run's first ones, due
        // within its 100 ms, none capped) in a report of their own, before the run's.
        assert_eq!(
            (r.sent, r.answered(), r.failed()),
            (jobs, jobs, 0),
            "{name}"
        );
        let w = r.warmup.as_deref().expect(name);
        assert!(w.sent > 0, "{name}");
        assert_eq!((w.answered(), w.failed()), (w.sent, 0), "{name}");
        assert!(w.warmup.is_none(), "{name}");
        assert!(w.started_unix_us <= r.started_unix_us, "{name}");
    }
    // None asked, none run.
    assert!(load::run(&closed).unwrap().warmup.is_none());
}

#[test]
fn load_refuses_what_it_cannot_run() {
    let remote = "10.1.2.3:80".parse().unwrap();
    let e = load::run(&LoadConfig::new(
        remote,
        Arrivals::Clients(1),
        Duration::from_secs(1),
    ))
    .unwrap_err();
    assert!(e.0.contains("loopback"), "{e}");
    let local = "127.0.0.1:9".parse().unwrap();
    for arrivals in [Arrivals::Poisson { per_s: 0.0 }, Arrivals::Clients(0)] {
        assert!(load::run(&LoadConfig::new(local, arrivals, Duration::from_secs(1))).is_err());
    }
    // Nothing listening: an error that says so, quickly.
    let mut c = LoadConfig::new(local, Arrivals::Clients(1), Duration::from_secs(1));
    c.timeout = Duration::from_secs(2);
    let e = load::run(&c).unwrap_err();
    assert!(e.0.contains("asking"), "{e}");
}

#[test]
fn client_side_batching_sends_many_jobs_as_one_request() {
    let server = double(2, Duration::ZERO, config());
    let rt = runtime();
    let results = rt.block_on(async {
        let batching = Batching::new(
            Client::new(server.addr, ClientConfig::default()),
            2,
            8,
            Duration::from_secs(5),
        );
        let jobs: Vec<_> = (0..8)
            .map(|k| {
                let b = batching.clone();
                tokio::spawn(async move {
                    let data = vec![k as f32, -(k as f32)];
                    let r = b
                        .submit(JobSpec {
                            rows: 1,
                            data: data.clone(),
                            ..JobSpec::default()
                        })
                        .await;
                    (data, r)
                })
            })
            .collect();
        // A job of another width is refused on its own, before anything is sent.
        let odd = batching
            .submit(JobSpec {
                rows: 1,
                data: vec![1.0; 3],
                ..JobSpec::default()
            })
            .await;
        let mut out = Vec::new();
        for j in jobs {
            out.push(j.await.unwrap());
        }
        (out, odd)
    });
    let (out, odd) = results;
    for (data, r) in out {
        let r = r.unwrap();
        assert_eq!(r.data, data.iter().map(|v| 2.0 * v).collect::<Vec<_>>());
        assert_eq!((r.rows, r.batch_rows), (1, 8), "eight jobs, one request");
    }
    assert!(matches!(odd, Err(Failure::Invalid(_))), "{odd:?}");
}

#[test]
fn large_tensor_jobs_batched_together_each_get_their_own_rows() {
    // Eight 256-row f32 tensor jobs close one batch of 2048 rows: the replies are cut from
    // the one output in place.
    let width = 64;
    let server = double(
        width,
        Duration::ZERO,
        warpdrive_serve::ServeConfig {
            max_batch_rows: 8 * 256,
            max_delay: Duration::from_secs(10),
            dispatch: warpdrive_serve::Dispatch::Window,
            ..config()
        },
    );
    let rt = runtime();
    let client = Client::new(
        server.addr,
        ClientConfig {
            format: Format::Binary(Dtype::F32),
            ..ClientConfig::default()
        },
    );
    let jobs: Vec<JobSpec> = (0..8)
        .map(|k| JobSpec {
            rows: 256,
            data: (0..256 * width)
                .map(|i| (k * 1_000_000 + i) as f32 * 0.25)
                .collect(),
            ..JobSpec::default()
        })
        .collect();
    let answers = rt.block_on(async {
        let mut tasks = tokio::task::JoinSet::new();
        for (k, job) in jobs.iter().cloned().enumerate() {
            let client = client.clone();
            tasks.spawn(async move { (k, client.submit(&job).await) });
        }
        let mut out = Vec::new();
        while let Some(done) = tasks.join_next().await {
            out.push(done.unwrap());
        }
        out
    });
    assert_eq!(answers.len(), 8);
    for (k, r) in answers {
        let r = r.unwrap();
        assert_eq!((r.rows, r.batch_rows), (256, 8 * 256), "job {k}");
        let want: Vec<f32> = jobs[k].data.iter().map(|v| 2.0 * v).collect();
        assert!(r.data == want, "job {k} got another job's rows");
    }
}
