//! The dashboard: the page is self-contained, the event stream carries the status, and (where
//! Chromium is installed, or `WARPDRIVE_CHROMIUM` names it) the page runs in headless
//! Chromium, fills in from the stream and is saved as a screenshot.

mod common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::{config, double, http, job, WAIT};
use warpdrive_serve::ServeConfig;

fn quick() -> ServeConfig {
    ServeConfig {
        interval: Duration::from_millis(50),
        ..config()
    }
}

#[test]
fn the_page_needs_nothing_from_outside() {
    let server = double(2, Duration::ZERO, quick());
    let (status, page) = http(server.addr, "GET", "/", "");
    assert_eq!(status, 200);
    for id in ["busy", "throughput", "latency", "queue", "memory", "knobs"] {
        assert!(page.contains(&format!("<canvas id=\"{id}\">")), "{id}");
    }
    assert!(page.contains("EventSource(\"/v1/events\" + location.search)"));
    for outside in ["http://", "https://", "<link", "src="] {
        assert!(!page.contains(outside), "{outside}");
    }
    assert_eq!(http(server.addr, "POST", "/", "").0, 405);
}

#[test]
fn the_event_stream_carries_the_status() {
    let server = double(2, Duration::ZERO, quick());
    assert_eq!(
        http(server.addr, "POST", "/v1/jobs", &job(1, &[1.0, 2.0])).0,
        200
    );
    let mut c = TcpStream::connect(server.addr).unwrap();
    c.set_read_timeout(Some(WAIT)).unwrap();
    write!(c, "GET /v1/events HTTP/1.1\r\nHost: x\r\n\r\n").unwrap();
    // Read until two events have come (the first is sent at once).
    let mut text = String::new();
    let mut buf = [0u8; 4096];
    while text.matches("data: ").count() < 2 {
        let n = c.read(&mut buf).unwrap();
        assert!(n > 0, "the stream ended: {text}");
        text.push_str(&String::from_utf8_lossy(&buf[..n]));
    }
    assert!(text.contains("text/event-stream"), "{text}");
    let event = text.split("data: ").nth(2).unwrap();
    let json = event.split("\n\n").next().unwrap();
    let status: serde_json::Value = serde_json::from_str(json).unwrap();
    assert_eq!(status["model"], "double");
    assert_eq!(status["healthy"], true);
    assert!(status["last"]["busy"].is_number(), "{status}");
    // Stopping ends the stream (and so lets the service stop).
    drop(server);
    let mut rest = Vec::new();
    let _ = c.read_to_end(&mut rest);
}

fn chromium() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("WARPDRIVE_CHROMIUM") {
        return Some(p.into());
    }
    [
        "/usr/bin/chromium",
        "/usr/bin/chromium-browser",
        "/usr/bin/google-chrome",
    ]
    .iter()
    .map(PathBuf::from)
    .find(|p| p.exists())
}

#[test]
fn headless_chromium_fills_the_page_from_the_stream() {
    let Some(browser) = chromium() else {
        eprintln!("no Chromium here (set WARPDRIVE_CHROMIUM): the browser check is skipped");
        return;
    };
    let server = double(2, Duration::from_millis(1), quick());
    for k in 0..20 {
        assert_eq!(
            http(server.addr, "POST", "/v1/jobs", &job(1, &[k as f32, 1.0])).0,
            200
        );
    }
    let url = format!("http://{}/?limit=3", server.addr);
    let out_dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR"));
    let shot = out_dir.join("dashboard.png");
    let profile = out_dir.join(format!("chromium-profile-{}", std::process::id()));
    // Headless Chromium may stay up after it has done its work (here it does, without a
    // D-Bus): each run is read until it has what it was asked for, then killed.
    let run = |extra: &[String], done: &dyn Fn(&str) -> bool| -> String {
        let mut child = Command::new(&browser)
            .args([
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--hide-scrollbars",
            ])
            .arg(format!("--user-data-dir={}", profile.display()))
            .args(["--virtual-time-budget=3000", "--window-size=1300,900"])
            .args(extra)
            .arg(&url)
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("running Chromium");
        let mut stdout = child.stdout.take().unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let mut buf = [0u8; 8192];
            while let Ok(n) = stdout.read(&mut buf) {
                if n == 0 || tx.send(buf[..n].to_vec()).is_err() {
                    break;
                }
            }
        });
        let t0 = Instant::now();
        let mut text = String::new();
        while !done(&text) && t0.elapsed() < WAIT {
            if let Ok(chunk) = rx.recv_timeout(Duration::from_millis(50)) {
                text.push_str(&String::from_utf8_lossy(&chunk));
            }
        }
        let _ = child.kill();
        let _ = child.wait();
        text
    };
    let dom = run(&["--dump-dom".to_string()], &|t: &str| {
        t.contains("</html>")
    });
    let updates: u64 = dom
        .split("data-updates=\"")
        .nth(1)
        .and_then(|s| s.split('"').next())
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    assert!(updates >= 1, "the page took no event:\n{dom}");
    assert!(dom.contains("double — healthy"), "{dom}");
    let _ = std::fs::remove_file(&shot);
    let written = || {
        std::fs::metadata(&shot)
            .map(|m| m.len() > 1000)
            .unwrap_or(false)
    };
    run(&[format!("--screenshot={}", shot.display())], &|_: &str| {
        written()
    });
    assert!(written(), "no screenshot at {}", shot.display());
    eprintln!("dashboard screenshot: {}", shot.display());
    let _ = std::fs::remove_dir_all(&profile);
}
