//! The Prometheus endpoint: whatever a client sends, the server answers or closes the
//! connection within its deadline, and keeps serving.
#![no_main]

use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpStream};
use std::sync::OnceLock;
use std::time::Duration;

use libfuzzer_sys::fuzz_target;
use warpdrive::telemetry::{serve_prometheus_with, EndpointLimits};

const DEADLINE: Duration = Duration::from_millis(100);

fn server() -> SocketAddr {
    static ADDR: OnceLock<SocketAddr> = OnceLock::new();
    *ADDR.get_or_init(|| {
        let limits = EndpointLimits {
            deadline: DEADLINE,
            ..EndpointLimits::default()
        };
        let local = SocketAddr::from(([127, 0, 0, 1], 0));
        match serve_prometheus_with(Some(local), limits) {
            Ok(s) => s.addr,
            Err(e) => panic!("the endpoint did not start: {e}"),
        }
    })
}

fuzz_target!(|data: &[u8]| {
    // The first byte says whether the client closes its side after sending.
    let Some((&close, request)) = data.split_first() else {
        return;
    };
    let Ok(mut conn) = TcpStream::connect(server()) else {
        return;
    };
    // Well past the deadline: a read that times out means the server held the connection.
    let _ = conn.set_read_timeout(Some(DEADLINE * 20));
    let _ = conn.set_write_timeout(Some(DEADLINE * 20));
    let _ = conn.write_all(request);
    if close & 1 == 1 {
        let _ = conn.shutdown(Shutdown::Write);
    }
    let mut answer = Vec::new();
    if let Err(e) = conn.read_to_end(&mut answer) {
        let held = matches!(
            e.kind(),
            std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
        );
        assert!(!held, "the server held the connection past its deadline");
    }
    assert!(answer.is_empty() || answer.starts_with(b"HTTP/1.1 "));
});
