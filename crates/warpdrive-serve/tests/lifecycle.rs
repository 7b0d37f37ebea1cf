//! The service's life: stopping answers every job it accepted, the controller stops making
//! a lone client wait, idle connections cost no one else a reply and past the cap are closed.

mod common;

use std::io::Read;
use std::net::{SocketAddr, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

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
        // Its own listening socket closed: a refused connect would hang here whenever another
        // test's service took the port meanwhile (where /proc says nothing, that is the test).
        let listener = listening_socket(a);
        let stopping = s.spawn(move || server.stop());
        wait_until("the service to stop accepting", || match listener {
            Some(inode) => !holds_socket(inode),
            None => TcpStream::connect(a).is_err(),
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

/// The inode of this process's socket listening at `a`'s port (Linux's /proc/net/tcp).
fn listening_socket(a: SocketAddr) -> Option<u64> {
    let port = format!(":{:04X}", a.port());
    let table = std::fs::read_to_string("/proc/net/tcp").ok()?;
    table.lines().skip(1).find_map(|l| {
        let f: Vec<&str> = l.split_whitespace().collect();
        let listening = f.get(1)?.ends_with(&port) && *f.get(3)? == "0A";
        let inode = f.get(9)?.parse().ok()?;
        (listening && holds_socket(inode)).then_some(inode)
    })
}

/// Whether one of this process's descriptors is the socket `inode`.
fn holds_socket(inode: u64) -> bool {
    let name = format!("socket:[{inode}]");
    std::fs::read_dir("/proc/self/fd").is_ok_and(|fds| {
        fds.flatten()
            .any(|fd| std::fs::read_link(fd.path()).is_ok_and(|l| l.as_os_str() == name.as_str()))
    })
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
        // The lone client's jobs leave the model mostly idle. Measured over a second, not the
        // status's 20 ms interval: there one run descheduled on a loaded host reads as busy.
        let (busy0, jobs0, t0) = (
            server.busy_seconds_total(),
            server.jobs_answered(),
            Instant::now(),
        );
        std::thread::sleep(Duration::from_secs(1));
        let (busy, jobs) = (
            server.busy_seconds_total() - busy0,
            server.jobs_answered() - jobs0,
        );
        let busy = busy / t0.elapsed().as_secs_f64();
        done.store(true, Ordering::Relaxed);
        assert!(jobs > 0 && busy < 0.5, "{jobs} jobs, busy {busy}");
    });
}

/// This process's soft limit on open files (1024 when /proc does not say).
fn open_files_limit() -> usize {
    std::fs::read_to_string("/proc/self/limits")
        .ok()
        .and_then(|t| {
            t.lines()
                .find(|l| l.starts_with("Max open files"))
                .and_then(|l| l.split_whitespace().nth(3).map(str::to_string))
        })
        .and_then(|n| n.parse().ok())
        .unwrap_or(1024)
}

#[test]
fn idle_connections_hold_up_no_one_and_past_the_cap_are_closed() {
    // Each connection costs this process two descriptors (both ends); other tests run
    // beside this one, so stay well under the limit: up to 2000 idle ones.
    let idle_n = ((open_files_limit().saturating_sub(400)) / 4).clamp(50, 2000);
    let more_n = idle_n / 2;
    let server = double(
        2,
        Duration::ZERO,
        ServeConfig {
            // Long enough that no idle connection is closed for idling during the test
            // (only for being past the cap).
            body_timeout: Duration::from_secs(300),
            max_connections: idle_n + more_n / 2,
            ..config()
        },
    );
    let a = server.addr;
    let idle: Vec<TcpStream> = (0..idle_n)
        .map(|_| TcpStream::connect(a).unwrap())
        .collect();
    assert_eq!(http(a, "POST", "/v1/jobs", &job(1, &[1.0, 2.0])).0, 200);
    let more: Vec<TcpStream> = (0..more_n)
        .map(|_| TcpStream::connect(a).unwrap())
        .collect();
    // Those past the cap are closed without a word (checked without blocking, until
    // enough are or the wait runs out).
    let want = more_n - more_n / 2 - 10;
    let mut open_ones = more;
    let mut closed = 0;
    for c in &open_ones {
        c.set_nonblocking(true).unwrap();
    }
    wait_until("the connections past the cap to be closed", || {
        open_ones.retain_mut(|c| {
            let mut b = [0u8; 1];
            match c.read(&mut b) {
                Ok(0) => {
                    closed += 1;
                    false
                }
                _ => true,
            }
        });
        closed >= want
    });
    assert!(
        open_ones.len() + 10 >= more_n / 2,
        "{} of {more_n} left open, but the cap left room for {}",
        open_ones.len(),
        more_n / 2
    );
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
