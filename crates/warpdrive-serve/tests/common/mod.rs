//! What the service's tests share: a model that doubles its input, a loopback config and a
//! raw HTTP/1.1 request on its own connection (so malformed requests can be sent too).
#![allow(dead_code)]

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

use warpdrive::Result;
use warpdrive_serve::{Model, ServeConfig};

pub const WAIT: Duration = Duration::from_secs(20);

/// `out = 2 · in`, after `delay` per batch; counts the rows of the batches it ran.
pub struct Double {
    pub width: usize,
    pub delay: Duration,
}

impl Model for Double {
    fn name(&self) -> &str {
        "double"
    }
    fn width(&self) -> usize {
        self.width
    }
    fn run(&mut self, input: &[f32], output: &mut Vec<f32>) -> Result<()> {
        std::thread::sleep(self.delay);
        output.clear();
        output.extend(input.iter().map(|v| 2.0 * v));
        Ok(())
    }
}

pub fn config() -> ServeConfig {
    ServeConfig {
        addr: "127.0.0.1:0".parse().unwrap(),
        max_delay: Duration::from_millis(20),
        body_timeout: Duration::from_millis(300),
        ..ServeConfig::default()
    }
}

/// (status, body) of one request on its own connection.
pub fn http(addr: SocketAddr, method: &str, path: &str, body: &str) -> (u16, String) {
    let mut c = TcpStream::connect(addr).unwrap();
    c.set_read_timeout(Some(WAIT)).unwrap();
    write!(
        c,
        "{method} {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    read_response(c)
}

pub fn read_response(mut c: TcpStream) -> (u16, String) {
    let mut text = String::new();
    let _ = c.read_to_string(&mut text);
    let status = text
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    let body = text
        .split_once("\r\n\r\n")
        .map_or("", |(_, b)| b)
        .to_string();
    (status, body)
}

pub fn job(rows: usize, data: &[f32]) -> String {
    serde_json::json!({ "rows": rows, "data": data }).to_string()
}

/// A service of [`Double`] with `config`.
pub fn double(width: usize, delay: Duration, config: ServeConfig) -> warpdrive_serve::Server {
    warpdrive_serve::Server::start(move || Ok(Box::new(Double { width, delay })), config)
        .expect("starting the service")
}

/// A model that doubles its input, one batch per permit from its gate (waiting at most
/// [`WAIT`] for each), and records each batch's first value as the batch starts (before
/// its permit: `seen.len()` counts the batches taken off the queue).
pub struct Gated {
    pub width: usize,
    pub gate: std::sync::mpsc::Receiver<()>,
    pub seen: std::sync::Arc<std::sync::Mutex<Vec<f32>>>,
}

impl Model for Gated {
    fn name(&self) -> &str {
        "gated"
    }
    fn width(&self) -> usize {
        self.width
    }
    fn run(&mut self, input: &[f32], output: &mut Vec<f32>) -> Result<()> {
        self.seen.lock().unwrap().push(input[0]);
        self.gate
            .recv_timeout(WAIT)
            .map_err(|e| warpdrive::Error::InvalidArgument(format!("gate: {e}")))?;
        output.clear();
        output.extend(input.iter().map(|v| 2.0 * v));
        Ok(())
    }
}

/// A service of [`Gated`] (width 1): the sender that opens its gate one batch at a time and
/// the first values of the batches it ran.
pub fn gated(
    config: ServeConfig,
) -> (
    warpdrive_serve::Server,
    std::sync::mpsc::Sender<()>,
    std::sync::Arc<std::sync::Mutex<Vec<f32>>>,
) {
    let (open, gate) = std::sync::mpsc::channel();
    let seen = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let s = seen.clone();
    let server = warpdrive_serve::Server::start(
        move || {
            Ok(Box::new(Gated {
                width: 1,
                gate,
                seen: s,
            }))
        },
        config,
    )
    .expect("starting the service");
    (server, open, seen)
}

/// Waits (up to [`WAIT`]) until `done` holds, checking every millisecond.
pub fn wait_until(what: &str, mut done: impl FnMut() -> bool) {
    let t0 = std::time::Instant::now();
    while !done() {
        assert!(t0.elapsed() < WAIT, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// (status, headers and body) of a raw request with extra header lines, on its own
/// connection.
pub fn http_with(addr: SocketAddr, path: &str, headers: &str, body: &[u8]) -> (u16, String) {
    let mut c = TcpStream::connect(addr).unwrap();
    c.set_read_timeout(Some(WAIT)).unwrap();
    write!(
        c,
        "POST {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n{headers}Content-Length: {}\r\n\r\n",
        body.len()
    )
    .unwrap();
    c.write_all(body).unwrap();
    let mut text = Vec::new();
    let _ = c.read_to_end(&mut text);
    let text = String::from_utf8_lossy(&text).into_owned();
    let status = text
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    (status, text)
}
