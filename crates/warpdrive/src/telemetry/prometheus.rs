//! The Prometheus endpoint: installs `metrics-exporter-prometheus` as the process's metrics
//! recorder and serves its text format over a small HTTP listener of our own (plain std
//! networking, so an ephemeral port works and no async runtime is pulled in).
//!
//! Each connection gets its own thread, up to a cap; one over the cap is answered `503` and
//! closed at once. The server waits on a connection's client at most a deadline after it was
//! accepted, however slowly it sends or reads, so idle or trickling clients cannot starve
//! scrapes.

use std::io::{ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};

use crate::error::{Error, Result};

/// Bucket bounds (seconds) of the span latency histograms.
const SPAN_BUCKETS: [f64; 12] = [
    1e-6, 4e-6, 16e-6, 64e-6, 256e-6, 1e-3, 4e-3, 16e-3, 64e-3, 0.256, 1.0, 4.0,
];

/// The installed recorder (installed once per process, on first use).
fn handle() -> Result<&'static PrometheusHandle> {
    static HANDLE: OnceLock<std::result::Result<PrometheusHandle, String>> = OnceLock::new();
    HANDLE
        .get_or_init(|| {
            PrometheusBuilder::new()
                .set_buckets(&SPAN_BUCKETS)
                .and_then(|b| b.install_recorder())
                .map_err(|e| e.to_string())
        })
        .as_ref()
        .map_err(|e| Error::Unsupported(format!("the Prometheus recorder is unavailable: {e}")))
}

/// The metrics in Prometheus's text format, for a server of the caller's own to answer
/// `/metrics` with (the recorder is installed on first use, as by [`serve_prometheus`]).
pub fn render_prometheus() -> Result<String> {
    let handle = handle()?;
    handle.run_upkeep();
    Ok(handle.render())
}

/// Drains the histograms' raw samples into their buckets (no rendering). The recorder keeps
/// every sample a histogram records until then, so a process that records per event and is
/// rarely scraped calls this now and then to keep its memory flat.
pub fn prometheus_upkeep() {
    if let Ok(h) = handle() {
        h.run_upkeep();
    }
}

/// How many connections the endpoint serves at once and how long each may take.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EndpointLimits {
    /// Connections served at once (default 256); one more is answered `503` and closed.
    pub max_connections: usize,
    /// How long after it is accepted the endpoint waits on a connection's client, for its
    /// request and for it to read the answer (default 2 s); past it, the connection is closed
    /// once what already arrived is answered, without waiting for more.
    pub deadline: Duration,
}

impl Default for EndpointLimits {
    fn default() -> Self {
        EndpointLimits {
            max_connections: 256,
            deadline: Duration::from_secs(2),
        }
    }
}

/// The most bytes of a request head read; the answer does not depend on the rest.
const MAX_HEAD: usize = 64 * 1024;

/// A running endpoint; it serves until the process ends.
#[derive(Debug, Clone, Copy)]
pub struct PrometheusServer {
    /// The bound address (with the real port when port 0 was asked for).
    pub addr: SocketAddr,
}

/// Installs the Prometheus recorder and serves `GET /metrics` (any path answers) on `addr`,
/// or on `127.0.0.1:9464` when `None`: loopback unless the caller names another address.
/// [`EndpointLimits::default`] bounds the connections.
pub fn serve_prometheus(addr: Option<SocketAddr>) -> Result<PrometheusServer> {
    serve_prometheus_with(addr, EndpointLimits::default())
}

/// [`serve_prometheus`] with other [`EndpointLimits`]; a zero cap, a zero deadline or one
/// too far to represent is an `InvalidArgument`.
pub fn serve_prometheus_with(
    addr: Option<SocketAddr>,
    limits: EndpointLimits,
) -> Result<PrometheusServer> {
    let deadline_fits = Instant::now().checked_add(limits.deadline).is_some();
    if limits.max_connections == 0 || limits.deadline.is_zero() || !deadline_fits {
        return Err(Error::InvalidArgument(format!(
            "Prometheus endpoint limits need at least one connection and a non-zero, \
             representable deadline (got {limits:?})"
        )));
    }
    let handle = handle()?;
    let addr = addr.unwrap_or_else(|| SocketAddr::from(([127, 0, 0, 1], 9464)));
    let io = |source| Error::Io {
        path: addr.to_string().into(),
        source,
    };
    let listener = TcpListener::bind(addr).map_err(io)?;
    let bound = listener.local_addr().map_err(io)?;
    std::thread::Builder::new()
        .name("warpdrive-prometheus".into())
        .spawn(move || accept_loop(listener, handle, limits))
        .map_err(io)?;
    Ok(PrometheusServer { addr: bound })
}

fn accept_loop(listener: TcpListener, handle: &'static PrometheusHandle, limits: EndpointLimits) {
    let active = Arc::new(AtomicUsize::new(0));
    for conn in listener.incoming() {
        let conn = match conn {
            Ok(c) => c,
            Err(e) => {
                tracing::debug!("prometheus endpoint: accept failed: {e}");
                // Out of file descriptors fails again at once: back off instead of spinning.
                std::thread::sleep(Duration::from_millis(10));
                continue;
            }
        };
        // Only this thread adds, so the count cannot pass the cap between check and add.
        let deadline = Instant::now().checked_add(limits.deadline);
        let (Some(deadline), true) = (
            deadline,
            active.load(Ordering::Acquire) < limits.max_connections,
        ) else {
            refuse(conn);
            continue;
        };
        let slot = Slot::take(&active);
        let spawned = std::thread::Builder::new()
            .name("warpdrive-prometheus-conn".into())
            .spawn(move || {
                let _slot = slot;
                if let Err(e) = answer(conn, handle, deadline) {
                    tracing::debug!("prometheus endpoint: {e}");
                }
            });
        // On failure the closure, with its slot and connection, is dropped: both released.
        if let Err(e) = spawned {
            tracing::debug!("prometheus endpoint: no thread for a connection: {e}");
        }
    }
}

/// One served connection, counted in the endpoint's active count while it lives.
struct Slot(Arc<AtomicUsize>);

impl Slot {
    fn take(active: &Arc<AtomicUsize>) -> Slot {
        active.fetch_add(1, Ordering::AcqRel);
        Slot(Arc::clone(active))
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Answers `503` without ever blocking the accept loop (a client that does not read simply
/// gets the connection closed), then closes.
fn refuse(mut conn: TcpStream) {
    let _ = conn.set_nonblocking(true);
    let _ = conn.write_all(
        b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\nRetry-After: 1\r\n\
          Connection: close\r\n\r\n",
    );
}

/// Time left until `deadline`, or a `TimedOut` error when none is.
fn remaining(deadline: Instant) -> std::io::Result<Duration> {
    deadline
        .checked_duration_since(Instant::now())
        .filter(|d| !d.is_zero())
        .ok_or_else(|| std::io::Error::new(ErrorKind::TimedOut, "the request deadline passed"))
}

/// One read, waiting for the client at most until `deadline`. Past it, what the client has
/// already sent is still read, without waiting: on a busy host this thread may first run
/// after the deadline, and the deadline bounds the client's slowness, not the server's.
fn read_by(conn: &mut TcpStream, buf: &mut [u8], deadline: Instant) -> std::io::Result<usize> {
    match remaining(deadline) {
        Ok(left) => {
            conn.set_read_timeout(Some(left))?;
            conn.read(buf)
        }
        Err(late) => {
            conn.set_nonblocking(true)?;
            conn.read(buf).map_err(|e| would_block_is(e, late))
        }
    }
}

/// One write, waiting for the client to read at most until `deadline`; past it, a write the
/// socket takes at once still goes out (as for [`read_by`]).
fn write_some_by(conn: &mut TcpStream, bytes: &[u8], deadline: Instant) -> std::io::Result<usize> {
    match remaining(deadline) {
        Ok(left) => {
            conn.set_write_timeout(Some(left))?;
            conn.write(bytes)
        }
        Err(late) => {
            conn.set_nonblocking(true)?;
            conn.write(bytes).map_err(|e| would_block_is(e, late))
        }
    }
}

/// `late` for an operation that would have had to wait past the deadline; `e` otherwise.
fn would_block_is(e: std::io::Error, late: std::io::Error) -> std::io::Error {
    if e.kind() == ErrorKind::WouldBlock {
        late
    } else {
        e
    }
}

fn answer(
    mut conn: TcpStream,
    handle: &PrometheusHandle,
    deadline: Instant,
) -> std::io::Result<()> {
    read_head(&mut conn, deadline)?;
    handle.run_upkeep();
    let body = handle.render();
    let head = format!(
        "HTTP/1.1 200 OK\r\nContent-Type: text/plain; version=0.0.4\r\nContent-Length: {}\r\n\
         Connection: close\r\n\r\n",
        body.len()
    );
    write_by(&mut conn, head.as_bytes(), deadline)?;
    write_by(&mut conn, body.as_bytes(), deadline)
}

/// Reads until the end of the request head, the client's end of stream or [`MAX_HEAD`]
/// bytes (we answer every request the same way); fails once it would wait past `deadline`.
fn read_head(conn: &mut TcpStream, deadline: Instant) -> std::io::Result<()> {
    let mut buf = [0u8; 4096];
    let mut got = Vec::new();
    while got.len() < MAX_HEAD {
        let n = match read_by(conn, &mut buf, deadline) {
            Ok(0) => return Ok(()),
            Ok(n) => n,
            Err(e) if e.kind() == ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        };
        // Only the new bytes (and the three before them) can complete the blank line.
        let from = got.len().saturating_sub(3);
        got.extend_from_slice(&buf[..n]);
        if got[from..].windows(4).any(|w| w == b"\r\n\r\n") {
            return Ok(());
        }
    }
    Ok(())
}

/// Writes all of `bytes`, failing once it would wait past `deadline`.
fn write_by(conn: &mut TcpStream, mut bytes: &[u8], deadline: Instant) -> std::io::Result<()> {
    while !bytes.is_empty() {
        match write_some_by(conn, bytes, deadline) {
            Ok(0) => return Err(ErrorKind::WriteZero.into()),
            Ok(n) => bytes = &bytes[n..],
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}
