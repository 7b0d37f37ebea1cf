//! `warpdrive serve` and `warpdrive load` as processes: the service says where it listens,
//! the load generator's summary counts every job answered, and SIGTERM stops the service
//! after answering what it accepted (exit status 0, "stopped"). CPU backend, tiny layer.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

mod common;

const WAIT: Duration = Duration::from_secs(60);

/// A bound on the service's start only (seeded weights, then each batch path warmed once):
/// about 3 s of CPU, 3-6 s on an idle 2-core host, 18-32 s beside the library's unit tests,
/// and past 60 s in 4 of 5 runs on 2 cores under heavier load. A hang guard, not a goal.
const START_WAIT: Duration = Duration::from_secs(300);

/// Kills the service if a check fails before it is stopped.
struct Service(Child);

impl Drop for Service {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn load_against_a_served_layer_then_sigterm_stops_it() {
    let mut child = Command::new(common::warpdrive_bin())
        .args([
            "serve",
            "--model",
            "moe:qwen3-30b-a3b",
            "--scale",
            "tiny",
            "--device",
            "cpu",
            "--addr",
            "127.0.0.1:0",
            "--p99-target-ms",
            "50",
            "--http-event-interval",
            "2",
        ])
        .env_remove("WARPDRIVE_DEVICE")
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let stdout = child.stdout.take().unwrap();
    let mut service = Service(child);
    let (tx, lines) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    let first = lines
        .recv_timeout(START_WAIT)
        .expect("the service's first line");
    let addr = first
        .split("http://")
        .nth(1)
        .and_then(|s| s.split_whitespace().next())
        .unwrap_or_else(|| panic!("no address in {first:?}"))
        .to_string();
    assert!(first.contains("dashboard at http://"), "{first}");

    let csv = std::env::temp_dir().join(format!("warpdrive-load-{}.csv", std::process::id()));
    let out = Command::new(common::warpdrive_bin())
        .args([
            "load",
            "--addr",
            &addr,
            "--clients",
            "2",
            "--jobs",
            "20",
            "--format",
            "bf16",
            "--event-interval",
            "2",
            "--jobs-csv",
            csv.to_str().unwrap(),
            "--jobs-csv-min-us",
            "1e12",
        ])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(text.contains("20 sent, 20 answered, 0 failed"), "{text}");
    assert!(text.contains("latency µs: p50 "), "{text}");
    // No job took 10⁶ s: the file holds its header alone.
    let written = std::fs::read_to_string(&csv).unwrap();
    let _ = std::fs::remove_file(&csv);
    assert_eq!(written.lines().count(), 1, "{written}");

    let pid = service.0.id().to_string();
    assert!(Command::new("kill")
        .args(["-TERM", &pid])
        .status()
        .unwrap()
        .success());
    let t0 = Instant::now();
    let status = loop {
        if let Some(s) = service.0.try_wait().unwrap() {
            break s;
        }
        assert!(t0.elapsed() < WAIT, "the service did not stop on SIGTERM");
        std::thread::sleep(Duration::from_millis(10));
    };
    assert!(status.success(), "{status}");
    // The rest of its output, until the pipe closes.
    let mut rest = Vec::new();
    while let Ok(line) = lines.recv_timeout(WAIT) {
        rest.push(line);
    }
    assert!(rest.iter().any(|l| l == "stopped"), "{rest:?}");
}
