//! The Prometheus endpoint: installs `metrics-exporter-prometheus` as the process's metrics
//! recorder and serves its text format over a small HTTP listener of our own (plain std
//! networking, so an ephemeral port works and no async runtime is pulled in).

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::OnceLock;
use std::time::Duration;

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

/// A running endpoint; it serves until the process ends.
#[derive(Debug, Clone, Copy)]
pub struct PrometheusServer {
    /// The bound address (with the real port when port 0 was asked for).
    pub addr: SocketAddr,
}

/// Installs the Prometheus recorder and serves `GET /metrics` (any path answers) on `addr`,
/// or on `127.0.0.1:9464` when `None`: loopback unless the caller names another address.
pub fn serve_prometheus(addr: Option<SocketAddr>) -> Result<PrometheusServer> {
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
        .spawn(move || {
            for conn in listener.incoming().flatten() {
                if let Err(e) = answer(conn, handle) {
                    tracing::debug!("prometheus endpoint: {e}");
                }
            }
        })
        .map_err(io)?;
    Ok(PrometheusServer { addr: bound })
}

fn answer(mut conn: TcpStream, handle: &PrometheusHandle) -> std::io::Result<()> {
    conn.set_read_timeout(Some(Duration::from_secs(2)))?;
    // Read the request head (we answer every request the same way).
    let mut buf = [0u8; 4096];
    let mut got = Vec::new();
    while !got.windows(4).any(|w| w == b"\r\n\r\n") && got.len() < 64 * 1024 {
        let n = conn.read(&mut buf)?;
        if n == 0 {
            break;
        }
        got.extend_from_slice(&buf[..n]);
    }
    handle.run_upkeep();
    let body = handle.render();
    write!(
        conn,
        "HTTP/1.1 200 OK\r\nContent-Type: text/plain; version=0.0.4\r\nContent-Length: {}\r\n\
         Connection: close\r\n\r\n{body}",
        body.len()
    )
}
