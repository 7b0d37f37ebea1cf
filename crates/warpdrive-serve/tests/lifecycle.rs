//! The service's life: stopping answers every job it accepted, the controller stops making
//! a lone client wait, idle connections cost no one else a reply and past the cap are closed.

mod common;

use std::io::Read;
use std::net::TcpStream;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use common::{config, double, gated, http, http_with, job, wait_until, WAIT};
use warpdrive_serve::load::{self, Arrivals, LoadConfig};
use warpdrive_serve::{ControllerConfig, ServeConfig};

#[test]
fn stopping_answers_every_accepted_job() {
    let (server, open, seen) = gated(ServeConfig {
        max_batch_rows: 1,
        max_delay: Duration::ZERO,
        ..config()
    });
    let a = server.addr;
    std::thread::scope(|s| {
        let jobs: Vec<_> = (0..5)
            .map(|k| s.spawn(move || http_with(a, "/v1/jobs", "", job(1, &[k as f32]).as_bytes())))
            .collect();
        wait_until("one job running and four queued", || {
            seen.lock().unwrap().len() == 1 && server.queued() == 4
        });
        let stopping = s.spawn(move || server.stop());
        wait_until("the service to stop accepting", || {
            TcpStream::connect(a).is_err()
        });
        for _ in 0..5 {
            open.send(()).unwrap();
        }
        for j in jobs {
            let (status, text) = j.join().unwrap();
            assert_eq!(status, 200, "{text}");
        }
        stopping.join().unwrap();
    });
    assert_eq!(seen.lock().unwrap().len(), 5);
}

#[test]
fn the_controller_stops_making_a_lone_client_wait() {
    let server = double(
        2,
        Duration::ZERO,
        ServeConfig {
            max_delay: Duration::from_millis(20),
            interval: Duration::from_millis(20),
            controller: Some(ControllerConfig {
                p99_target: Duration::from_millis(50),
                max_batch_rows: 64,
                max_delay: Duration::from_millis(20),
            }),
            ..config()
        },
    );
    assert!(server.status().controller);
    assert_eq!(server.status().delay_us, 20_000.0);
    let done = AtomicBool::new(false);
    std::thread::scope(|s| {
        s.spawn(|| {
            while !done.load(Ordering::Relaxed) {
                let c = LoadConfig {
                    max_jobs: Some(5),
                    ..LoadConfig::new(server.addr, Arrivals::Clients(1), WAIT)
                };
                let r = load::run(&c).unwrap();
                assert_eq!(r.failed(), 0, "{:?}", r.first_failure);
            }
        });
        wait_until("the delay to reach 0", || server.status().delay_us == 0.0);
        done.store(true, Ordering::Relaxed);
    });
    let s = server.status();
    assert!(s.jobs_total > 0 && s.last.busy < 0.5, "{s:?}");
}

#[test]
fn idle_connections_hold_up_no_one_and_past_the_cap_are_closed() {
    let server = double(
        2,
        Duration::ZERO,
        ServeConfig {
            body_timeout: Duration::from_secs(10),
            max_connections: 600,
            ..config()
        },
    );
    let a = server.addr;
    let idle: Vec<TcpStream> = (0..500).map(|_| TcpStream::connect(a).unwrap()).collect();
    assert_eq!(http(a, "POST", "/v1/jobs", &job(1, &[1.0, 2.0])).0, 200);
    let more: Vec<TcpStream> = (0..200).map(|_| TcpStream::connect(a).unwrap()).collect();
    // Some of the last ones were over the cap: closed without a word.
    let closed = more
        .into_iter()
        .filter_map(|mut c| {
            c.set_read_timeout(Some(Duration::from_millis(50))).unwrap();
            let mut b = [0u8; 1];
            matches!(c.read(&mut b), Ok(0)).then_some(())
        })
        .count();
    assert!(closed >= 90, "{closed} of 200 closed");
    drop(idle);
    wait_until("a connection to be served again", || {
        let mut c = TcpStream::connect(a).unwrap();
        c.set_read_timeout(Some(WAIT)).unwrap();
        use std::io::Write;
        let _ = write!(
            c,
            "GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
        );
        let mut text = String::new();
        let _ = c.read_to_string(&mut text);
        text.starts_with("HTTP/1.1 200")
    });
}

#[test]
fn timeouts_of_forever_are_not_a_panic() {
    let server = double(
        1,
        Duration::ZERO,
        ServeConfig {
            max_batch_rows: 1,
            max_delay: Duration::MAX,
            job_timeout: Duration::MAX,
            drain_timeout: Duration::MAX,
            interval: Duration::MAX,
            ..config()
        },
    );
    let (status, text) = http_with(
        server.addr,
        "/v1/jobs",
        "x-warpdrive-deadline-ms: 18446744073709551615\r\n",
        job(1, &[1.0]).as_bytes(),
    );
    assert_eq!(status, 200, "{text}");
    server.stop();
}

/// Resident memory of this process, bytes (Linux).
fn rss_bytes() -> Option<u64> {
    let statm = std::fs::read_to_string("/proc/self/statm").ok()?;
    let pages: u64 = statm.split_whitespace().nth(1)?.parse().ok()?;
    Some(pages * 4096)
}

/// The soak: the MoE layer (tiny scale) on the CPU backend at 80 % of its measured maximum
/// for `WARPDRIVE_SOAK_SECONDS` (600 by default), open loop, in 30-second legs: no job may
/// fail and resident memory must stay flat (the last leg within 10 % + 16 MiB of the
/// first). Outside CI's budget: `cargo test -p warpdrive-serve --release --test lifecycle
/// soak -- --ignored --nocapture`.
#[test]
#[ignore = "a soak of 10 minutes (WARPDRIVE_SOAK_SECONDS): run by hand"]
fn soak_at_80_percent_fails_nothing_and_holds_memory_flat() {
    use warpdrive::moe::{MoeConfig, MoeWeights};
    use warpdrive::Device;
    use warpdrive_serve::{MoeModel, Server};
    let seconds: u64 = std::env::var("WARPDRIVE_SOAK_SECONDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(600);
    let device = Device::cpu();
    let server = Server::start(
        move || {
            Ok(Box::new(MoeModel::new(
                "moe:tiny",
                &device,
                MoeConfig::tiny(),
                MoeWeights::Random { seed: 7 },
            )?))
        },
        ServeConfig {
            max_batch_rows: 256,
            max_delay: Duration::from_millis(2),
            ..config()
        },
    )
    .unwrap();
    let most = load::run(&LoadConfig::new(
        server.addr,
        Arrivals::Clients(32),
        Duration::from_secs(5),
    ))
    .unwrap()
    .jobs_per_s();
    let rate = 0.8 * most;
    eprintln!("soak: maximum {most:.0} jobs/s; offering {rate:.0} for {seconds} s");
    let leg = Duration::from_secs(seconds.clamp(1, 30));
    let legs = seconds.div_ceil(leg.as_secs()).max(1);
    let mut rss = Vec::new();
    for k in 0..legs {
        let r = load::run(&LoadConfig::new(
            server.addr,
            Arrivals::Poisson { per_s: rate },
            leg,
        ))
        .unwrap();
        let mut lat = r.latency_us.clone();
        lat.sort_by(f64::total_cmp);
        let p99 = lat.get(lat.len() * 99 / 100).copied().unwrap_or(f64::NAN);
        let now = rss_bytes().unwrap_or(0);
        eprintln!(
            "leg {k}: {} sent, {} answered, {} failed {:?}, {:.0} jobs/s, p99 {:.0} µs, rss {:.1} MiB",
            r.sent,
            r.answered(),
            r.failed(),
            r.failures,
            r.jobs_per_s(),
            p99,
            now as f64 / 1048576.0
        );
        assert_eq!(r.failed(), 0, "{:?}: {:?}", r.failures, r.first_failure);
        rss.push(now);
    }
    let (first, last) = (rss[0], *rss.last().unwrap());
    assert!(
        last <= first + first / 10 + (16 << 20),
        "resident memory grew from {first} to {last} bytes"
    );
}
