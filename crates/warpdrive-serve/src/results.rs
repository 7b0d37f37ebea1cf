//! Results of jobs submitted without waiting (`POST /v1/jobs?async=true`): each has a slot
//! from the moment it is accepted until its reply is fetched once (`GET /v1/jobs/ID`, which
//! may wait a while for it), or until `ttl` after it was ready when no one fetches it. At most
//! `cap` slots exist; past that a new asynchronous job is refused (503).

use std::collections::HashMap;
use std::time::{Duration, Instant};

use hyper::Response;
use parking_lot::Mutex;
use tokio::sync::watch;

use super::http::Body;

struct Slot {
    reply: Option<(Response<Body>, Instant)>,
    ready: watch::Sender<bool>,
}

pub(crate) struct Results {
    slots: Mutex<(u64, HashMap<u64, Slot>)>,
    cap: usize,
    ttl: Duration,
}

/// What a fetch found.
pub(crate) enum Fetched {
    /// The job's reply (the slot is gone now).
    Ready(Response<Body>),
    /// Not answered within the wait.
    Pending,
    /// No such job, already fetched, or expired.
    Unknown,
}

impl Results {
    pub(crate) fn new(cap: usize, ttl: Duration) -> Results {
        Results {
            slots: Mutex::new((1, HashMap::new())),
            cap: cap.max(1),
            ttl,
        }
    }

    /// A new slot's id, or `None` when every slot is taken (after forgetting replies that
    /// waited past the ttl).
    pub(crate) fn reserve(&self, now: Instant) -> Option<u64> {
        let mut g = self.slots.lock();
        let (next, slots) = &mut *g;
        if slots.len() >= self.cap {
            let ttl = self.ttl;
            slots.retain(|_, s| match &s.reply {
                Some((_, at)) => now.saturating_duration_since(*at) < ttl,
                None => true,
            });
            if slots.len() >= self.cap {
                return None;
            }
        }
        let id = *next;
        *next = next.wrapping_add(1).max(1);
        let (ready, _) = watch::channel(false);
        slots.insert(id, Slot { reply: None, ready });
        Some(id)
    }

    /// Gives a slot back unused (its job was not queued).
    pub(crate) fn release(&self, id: u64) {
        self.slots.lock().1.remove(&id);
    }

    /// The reply of job `id`.
    pub(crate) fn fulfil(&self, id: u64, reply: Response<Body>) {
        let mut g = self.slots.lock();
        if let Some(s) = g.1.get_mut(&id) {
            s.reply = Some((reply, Instant::now()));
            s.ready.send_replace(true);
        }
    }

    /// Job `id`'s reply, waiting up to `wait` for it.
    pub(crate) async fn fetch(&self, id: u64, wait: Duration) -> Fetched {
        let mut ready = {
            let mut g = self.slots.lock();
            match g.1.get(&id) {
                None => return Fetched::Unknown,
                Some(s) if s.reply.is_some() => {
                    return match g.1.remove(&id).and_then(|s| s.reply) {
                        Some((r, _)) => Fetched::Ready(r),
                        None => Fetched::Unknown,
                    }
                }
                Some(s) => s.ready.subscribe(),
            }
        };
        if !wait.is_zero() {
            let _ = tokio::time::timeout(wait, ready.wait_for(|r| *r)).await;
        }
        let mut g = self.slots.lock();
        match g.1.get(&id) {
            None => Fetched::Unknown,
            Some(s) if s.reply.is_none() => Fetched::Pending,
            Some(_) => match g.1.remove(&id).and_then(|s| s.reply) {
                Some((r, _)) => Fetched::Ready(r),
                None => Fetched::Unknown,
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::{BodyExt, Full};

    fn reply(text: &'static str) -> Response<Body> {
        Response::new(Full::new(bytes::Bytes::from_static(text.as_bytes())).boxed())
    }

    fn rt() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap()
    }

    #[test]
    fn a_reply_is_fetched_once() {
        let r = Results::new(4, Duration::from_secs(60));
        let id = r.reserve(Instant::now()).unwrap();
        let rt = rt();
        assert!(matches!(
            rt.block_on(r.fetch(id, Duration::ZERO)),
            Fetched::Pending
        ));
        r.fulfil(id, reply("done"));
        assert!(matches!(
            rt.block_on(r.fetch(id, Duration::ZERO)),
            Fetched::Ready(_)
        ));
        assert!(matches!(
            rt.block_on(r.fetch(id, Duration::ZERO)),
            Fetched::Unknown
        ));
        assert!(matches!(
            rt.block_on(r.fetch(999, Duration::ZERO)),
            Fetched::Unknown
        ));
    }

    #[test]
    fn a_waiting_fetch_wakes_when_the_reply_comes() {
        let r = std::sync::Arc::new(Results::new(4, Duration::from_secs(60)));
        let id = r.reserve(Instant::now()).unwrap();
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap();
        let r2 = r.clone();
        let fetched = rt.spawn(async move { r2.fetch(id, Duration::from_secs(30)).await });
        r.fulfil(id, reply("done"));
        assert!(matches!(rt.block_on(fetched).unwrap(), Fetched::Ready(_)));
    }

    #[test]
    fn slots_are_capped_and_stale_replies_make_room() {
        let r = Results::new(2, Duration::from_secs(1));
        let t0 = Instant::now();
        let a = r.reserve(t0).unwrap();
        let _b = r.reserve(t0).unwrap();
        assert!(r.reserve(t0).is_none(), "full");
        r.fulfil(a, reply("a"));
        assert!(
            r.reserve(Instant::now()).is_none(),
            "a's reply is still fresh"
        );
        assert!(r.reserve(Instant::now() + Duration::from_secs(2)).is_some());
    }
}
