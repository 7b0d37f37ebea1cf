//! The dashboard: `GET /` is one self-contained page (no external scripts or fonts) whose
//! charts — busy fraction, throughput, latency p50/p99, queue depth, device pool memory,
//! the batch knobs — follow `GET /v1/events`, a server-sent event stream of the
//! [`Status`](crate::Status) JSON, one event each status interval. A stream ends when its
//! client goes, when it stops reading (a send waits at most a few seconds), when the
//! service stops, or after `?limit=N` events (the page passes its own query on, so
//! `/?limit=N` gives a page whose streams end: a headless browser's virtual time stands
//! still while a request is open).

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::channel::Channel;
use http_body_util::{BodyExt, Full};
use hyper::header::{HeaderValue, CACHE_CONTROL, CONTENT_TYPE};
use hyper::{Response, StatusCode};

use super::http::{Body, State};

/// The page.
pub(crate) const PAGE: &str = include_str!("page.html");

/// How long one event may wait for a client that does not read.
const SEND_TIMEOUT: Duration = Duration::from_secs(5);

/// The event stream: the status now, then once an interval.
pub(crate) fn events(state: &Arc<State>, query: Option<&str>) -> Response<Body> {
    let limit = match limit(query) {
        Ok(l) => l,
        Err(why) => {
            let mut r = Response::new(Full::new(Bytes::from(format!("{why}\n"))).boxed());
            *r.status_mut() = StatusCode::BAD_REQUEST;
            return r;
        }
    };
    let (mut tx, body) = Channel::<Bytes, Infallible>::new(2);
    let (shared, mut stopping) = (state.shared.clone(), state.stopping.clone());
    let every = state.config.interval;
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(every);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
        // A client that reconnects waits a moment, not the default few seconds.
        let retry = Bytes::from_static(b"retry: 200\n\n");
        if tx.send_data(retry).await.is_err() {
            return;
        }
        let mut sent = 0u64;
        while !*stopping.borrow() && sent < limit {
            tokio::select! {
                _ = tick.tick() => {
                    let json = serde_json::to_string(&*shared.status.lock())
                        .unwrap_or_else(|e| format!("{{\"error\": \"{e}\"}}"));
                    let event = Bytes::from(format!("data: {json}\n\n"));
                    match tokio::time::timeout(SEND_TIMEOUT, tx.send_data(event)).await {
                        Ok(Ok(())) => sent += 1,
                        _ => break,
                    }
                }
                _ = stopping.changed() => break,
            }
        }
    });
    let mut r = Response::new(body.boxed());
    *r.status_mut() = StatusCode::OK;
    let h = r.headers_mut();
    h.insert(CONTENT_TYPE, HeaderValue::from_static("text/event-stream"));
    h.insert(CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    r
}

/// The events a stream sends at most, from its query (`limit=N`; no limit without one).
fn limit(query: Option<&str>) -> Result<u64, String> {
    let Some(q) = query else {
        return Ok(u64::MAX);
    };
    for pair in q.split('&') {
        match pair.split_once('=') {
            Some(("limit", n)) => {
                return n
                    .parse::<u64>()
                    .ok()
                    .filter(|&n| n > 0)
                    .ok_or_else(|| format!("limit={n}: expected a count, 1 or more"))
            }
            _ => continue,
        }
    }
    Ok(u64::MAX)
}

#[cfg(test)]
mod tests {
    use super::limit;

    #[test]
    fn the_limit_comes_from_the_query() {
        assert_eq!(limit(None), Ok(u64::MAX));
        assert_eq!(limit(Some("x=1&limit=3")), Ok(3));
        assert!(limit(Some("limit=0")).is_err());
        assert!(limit(Some("limit=-1")).is_err());
        assert!(limit(Some("limit=99999999999999999999999")).is_err());
    }
}
