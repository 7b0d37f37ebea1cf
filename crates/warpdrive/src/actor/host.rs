//! The host's side of one actor's rings: senders claiming inbox slots under the
//! backpressure policy, and the collector taking replies from the outbox.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::task::Waker;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use super::ring::{self, ctrl, Found, Ring};
use super::spec::{Backpressure, ErasedSpec};
use crate::device::{Device, SharedWords};
use crate::error::{Error, Result};

/// One actor's block of shared words (control words, inbox lanes, outbox) and the host
/// state around it.
pub(crate) struct ActorShared {
    pub(crate) index: usize,
    pub(crate) name: String,
    pub(crate) block: SharedWords,
    pub(crate) lanes: Vec<Ring>,
    pub(crate) outbox: Ring,
    /// Where the loop writes sampled message records (`ring::TRACE_SLOTS` of them).
    pub(crate) trace_base: usize,
    trace_head: Mutex<u64>,
    pub(crate) in_bytes: usize,
    pub(crate) out_bytes: usize,
    pub(crate) backpressure: Backpressure,
    pub(crate) forwards: bool,
    /// Publish each lane's claimed tail for the loop (`ActorSpec::tail_hint`).
    tail_hint: bool,
    /// Sequence numbers claimed by senders, per lane.
    tails: Vec<AtomicU64>,
    next_correlation: AtomicU32,
    pub(crate) rejected: AtomicU64,
    /// Most messages waiting in one lane right after a claim.
    pub(crate) max_depth: AtomicU64,
    collector: Mutex<Collector>,
    /// Futures waiting for replies (`Actor::request_async`), woken by the watcher.
    wakers: Mutex<Vec<Waker>>,
    started: Instant,
}

/// Replies taken from the outbox and not yet handed out.
#[derive(Default)]
struct Collector {
    /// Replies taken so far (the outbox's head).
    head: u64,
    /// Correlation ids `request` calls wait for: their replies go to `claimed`.
    waiting: HashSet<u32>,
    claimed: HashMap<u32, Vec<u8>>,
    /// Requests that gave up: their replies are dropped when they come.
    forgotten: HashSet<u32>,
    /// Replies for `recv`, in order.
    ready: VecDeque<(u32, Vec<u8>)>,
}

/// Messages waiting in a lane up to which senders leave its tail hint alone: the loop's
/// smallest window (two slots, `next_window` in actor_loop.cu) reads them anyway.
const HINT_AFTER: u64 = 2;

/// How long a sender waits for the previous lap's writer of a slot it overwrites.
const OVERWRITE_WAIT: Duration = Duration::from_secs(5);

impl ActorShared {
    /// The block and host state of actor `index` of shape `spec` on `device`.
    pub(crate) fn new(device: &Device, index: usize, spec: &ErasedSpec) -> Result<ActorShared> {
        let (in_bytes, out_bytes) = (spec.in_bytes, spec.out_bytes);
        let (capacity, lanes) = (spec.capacity, spec.lanes);
        let in_words = ring::slot_words(in_bytes);
        let out_words = ring::slot_words(out_bytes);
        let mut base = ctrl::WORDS;
        let mut rings = Vec::with_capacity(lanes);
        for _ in 0..lanes {
            let r = Ring {
                base,
                capacity,
                slot_words: in_words,
            };
            base = base
                .checked_add(r.words())
                .ok_or_else(|| Error::InvalidArgument("actor rings overflow".into()))?;
            rings.push(r);
        }
        let outbox = Ring {
            base,
            capacity,
            slot_words: out_words,
        };
        let trace_base = base
            .checked_add(outbox.words())
            .ok_or_else(|| Error::InvalidArgument("actor rings overflow".into()))?;
        let total = trace_base + ring::TRACE_SLOTS * ring::TRACE_WORDS;
        Ok(ActorShared {
            index,
            name: spec.name.clone(),
            block: device.shared_words(total)?,
            lanes: rings,
            outbox,
            trace_base,
            trace_head: Mutex::new(0),
            in_bytes,
            out_bytes,
            backpressure: spec.backpressure,
            forwards: spec.forward_to.is_some(),
            tail_hint: spec.tail_hint,
            tails: (0..lanes).map(|_| AtomicU64::new(0)).collect(),
            next_correlation: AtomicU32::new(1),
            rejected: AtomicU64::new(0),
            max_depth: AtomicU64::new(0),
            collector: Mutex::new(Collector::default()),
            wakers: Mutex::new(Vec::new()),
            started: Instant::now(),
        })
    }

    pub(crate) fn words(&self) -> &[AtomicU64] {
        self.block.words()
    }

    pub(crate) fn word(&self, i: usize) -> u64 {
        self.words()[i].load(Ordering::Acquire)
    }

    pub(crate) fn set_word(&self, i: usize, v: u64) {
        self.words()[i].store(v, Ordering::Release)
    }

    /// The share of the loop's time since it started spent handling this actor's messages.
    pub(crate) fn busy_ratio(&self) -> f64 {
        let loops_ns = self.word(ctrl::BUSY_NS) as f64;
        let since = self.started.elapsed().as_nanos() as f64;
        if since > 0.0 {
            (loops_ns / since).min(1.0)
        } else {
            0.0
        }
    }

    /// Where the actor's messages and replies are, for a wait that ran out of time: per lane
    /// the sequence numbers claimed by senders against the loop's head, then the replies the
    /// loop wrote against those the host took, and the loop's counts (a lost message or reply
    /// shows as a head or a tail that stopped short).
    pub(crate) fn progress(&self) -> String {
        let mut s = String::new();
        for l in 0..self.lanes.len() {
            let tail = self.tails[l].load(Ordering::Acquire);
            let head = self.word(ctrl::IN_HEAD + l);
            s.push_str(&format!("lane {l}: {tail} sent, {head} taken; "));
        }
        let host_head = self.collector.lock().head;
        s.push_str(&format!(
            "replies: {} written, {host_head} taken; processed {}, loops {}",
            self.word(ctrl::OUT_TAIL),
            self.word(ctrl::PROCESSED),
            self.word(ctrl::LOOPS),
        ));
        s
    }

    /// Messages waiting in lane `lane` (claimed, not yet taken by the loop).
    pub(crate) fn depth(&self, lane: usize) -> u64 {
        let tail = self.tails[lane].load(Ordering::Acquire);
        tail.saturating_sub(self.word(ctrl::IN_HEAD + lane))
    }

    /// Puts `bodies` (each `in_bytes` long) in lane `lane`, in order; returns the first
    /// correlation id (the others follow it). `alive` is asked while a sender waits.
    pub(crate) fn send(
        &self,
        lane: usize,
        bodies: &[&[u8]],
        alive: &dyn Fn() -> Result<()>,
    ) -> Result<u32> {
        self.send_inner(lane, bodies, false, None, alive)
    }

    /// Puts `body` in lane `lane` with its reply awaited by a `request` (registered before
    /// the message can be handled); returns its correlation id.
    pub(crate) fn send_awaited(
        &self,
        lane: usize,
        body: &[u8],
        alive: &dyn Fn() -> Result<()>,
    ) -> Result<u32> {
        self.send_inner(lane, &[body], true, None, alive)
    }

    /// Puts `bodies` in lane `lane` as `send` does, but once their slots are claimed writes
    /// one message every `pause`, each slot torn for half of it: a sender the loop's windows
    /// (and the tail hint) run ahead of (`Actor::send_many_slowly`).
    pub(crate) fn send_slowly(
        &self,
        lane: usize,
        bodies: &[&[u8]],
        pause: Duration,
        alive: &dyn Fn() -> Result<()>,
    ) -> Result<u32> {
        self.send_inner(lane, bodies, false, Some(pause), alive)
    }

    fn send_inner(
        &self,
        lane: usize,
        bodies: &[&[u8]],
        awaited: bool,
        pause: Option<Duration>,
        alive: &dyn Fn() -> Result<()>,
    ) -> Result<u32> {
        let ring = *self.lanes.get(lane).ok_or_else(|| {
            Error::InvalidArgument(format!(
                "actor {}: lane {lane} of {}",
                self.name,
                self.lanes.len()
            ))
        })?;
        let n = bodies.len() as u64;
        if n == 0 {
            return Ok(self.next_correlation.load(Ordering::Relaxed));
        }
        let first = self.claim(lane, n, ring.capacity as u64, alive)?;
        let correlation = self.next_correlation.fetch_add(n as u32, Ordering::Relaxed);
        if awaited {
            self.await_reply(correlation);
        }
        for (k, body) in bodies.iter().enumerate() {
            let seq = first + k as u64;
            if self.backpressure == Backpressure::DropOldest && seq >= ring.capacity as u64 {
                self.wait_previous_lap(&ring, seq, alive)?;
            }
            let header = [correlation.wrapping_add(k as u32), lane as u32];
            match pause {
                None => ring.write(self.words(), seq, header, body),
                Some(p) => {
                    let half = || spin_for(p / 2);
                    half();
                    ring.write_torn(self.words(), seq, header, body, &mut || half());
                }
            }
        }
        Ok(correlation)
    }

    /// Claims `n` sequence numbers of `lane` under the backpressure policy.
    fn claim(
        &self,
        lane: usize,
        n: u64,
        capacity: u64,
        alive: &dyn Fn() -> Result<()>,
    ) -> Result<u64> {
        let drop_oldest = self.backpressure == Backpressure::DropOldest;
        if n > capacity && !drop_oldest {
            return Err(Error::InvalidArgument(format!(
                "actor {}: {n} messages at once into an inbox of {capacity}",
                self.name
            )));
        }
        let tail = &self.tails[lane];
        let mut backoff = Backoff::new();
        loop {
            let t = tail.load(Ordering::Acquire);
            let head = self.word(ctrl::IN_HEAD + lane);
            if drop_oldest || t + n - head.min(t) <= capacity {
                if tail
                    .compare_exchange_weak(t, t + n, Ordering::AcqRel, Ordering::Relaxed)
                    .is_ok()
                {
                    let depth = t + n - head.min(t);
                    self.max_depth.fetch_max(depth, Ordering::Relaxed);
                    // Within the loop's smallest window the hint changes nothing: a lone
                    // request leaves the word (and its line) alone, a stale hint only
                    // understates. A maximum: an earlier claim may publish after a later one.
                    if self.tail_hint && depth > HINT_AFTER {
                        self.words()[ctrl::TAIL_HINT + lane].fetch_max(t + n, Ordering::Release);
                    }
                    return Ok(t);
                }
                continue;
            }
            match self.backpressure {
                Backpressure::Reject => {
                    self.rejected.fetch_add(n, Ordering::Relaxed);
                    return Err(Error::QueueFull {
                        actor: self.name.clone(),
                        lane,
                        capacity: capacity as usize,
                    });
                }
                Backpressure::Block { timeout } => {
                    alive()?;
                    if backoff.waited() > timeout {
                        return Err(Error::Timeout {
                            what: format!(
                                "actor {}: room in inbox lane {lane} ({})",
                                self.name,
                                self.progress()
                            ),
                            after_ms: timeout.as_millis() as u64,
                        });
                    }
                    backoff.pause();
                }
                // Always has room (above).
                Backpressure::DropOldest => continue,
            }
        }
    }

    /// Waits until the slot of `seq` holds the whole message one lap earlier (or later):
    /// another sender may still be writing it, and two laps interleaved in one slot would
    /// never read as whole.
    fn wait_previous_lap(
        &self,
        ring: &Ring,
        seq: u64,
        alive: &dyn Fn() -> Result<()>,
    ) -> Result<()> {
        let previous = seq - ring.capacity as u64;
        let mut backoff = Backoff::new();
        while !ring.written_since(self.words(), previous) {
            alive()?;
            if backoff.waited() > OVERWRITE_WAIT {
                return Err(Error::Timeout {
                    what: format!("actor {}: a sender finishing message {previous}", self.name),
                    after_ms: OVERWRITE_WAIT.as_millis() as u64,
                });
            }
            backoff.pause();
        }
        Ok(())
    }

    /// The sampled message records written since the last call (the oldest are lost when
    /// more than the ring holds came in between).
    pub(crate) fn take_trace(&self) -> Vec<[u64; ring::TRACE_WORDS]> {
        let tail = self.word(ctrl::TRACE_TAIL);
        let mut head = self.trace_head.lock();
        let from = (*head).max(tail.saturating_sub(ring::TRACE_SLOTS as u64));
        let records = (from..tail)
            .map(|seq| {
                let at = self.trace_base + (seq as usize % ring::TRACE_SLOTS) * ring::TRACE_WORDS;
                std::array::from_fn(|i| self.word(at + i))
            })
            .collect();
        *head = tail;
        records
    }

    /// Keeps `waker` until the watcher's next round wakes it.
    pub(crate) fn park_waker(&self, waker: &Waker) {
        let mut w = self.wakers.lock();
        if !w.iter().any(|k| k.will_wake(waker)) {
            w.push(waker.clone());
        }
    }

    /// Wakes every parked future (they poll again); true when there were some.
    pub(crate) fn wake_all(&self) -> bool {
        let wakers = std::mem::take(&mut *self.wakers.lock());
        let any = !wakers.is_empty();
        for w in wakers {
            w.wake();
        }
        any
    }

    /// The next reply for `recv`, if one has arrived.
    pub(crate) fn try_recv(&self) -> Option<(u32, Vec<u8>)> {
        let mut c = self.collector.lock();
        if let Some(r) = c.ready.pop_front() {
            return Some(r);
        }
        self.drain(&mut c, None);
        c.ready.pop_front()
    }

    /// Registers `correlation` as awaited by a `request` (before its message is sent).
    fn await_reply(&self, correlation: u32) {
        self.collector.lock().waiting.insert(correlation);
    }

    /// Stops waiting for `correlation` (a request that gave up); a late reply is dropped.
    pub(crate) fn forget_reply(&self, correlation: u32) {
        let mut c = self.collector.lock();
        if c.waiting.remove(&correlation) && c.claimed.remove(&correlation).is_none() {
            c.forgotten.insert(correlation);
        }
    }

    /// The reply to `correlation` written into `out` if it has arrived (true).
    pub(crate) fn take_reply(&self, correlation: u32, out: &mut [u8]) -> bool {
        let mut c = self.collector.lock();
        if let Some(bytes) = c.claimed.remove(&correlation) {
            c.waiting.remove(&correlation);
            out.copy_from_slice(&bytes);
            return true;
        }
        let found = self.drain(&mut c, Some((correlation, out)));
        if found {
            c.waiting.remove(&correlation);
        }
        found
    }

    /// Takes every reply that has arrived: `want`'s straight into its buffer (true when
    /// it came), awaited ones to `claimed`, the rest to `ready`.
    fn drain(&self, c: &mut Collector, mut want: Option<(u32, &mut [u8])>) -> bool {
        let mut header = [0u32; 2];
        let mut body = [0u8; super::MAX_MESSAGE_BYTES];
        let body = &mut body[..self.out_bytes];
        let mut found = false;
        let start = c.head;
        while self.outbox.read(self.words(), c.head, &mut header, body) == Found::Ready {
            c.head += 1;
            let id = header[0];
            match want.as_mut() {
                Some((w, out)) if *w == id && !found => {
                    out.copy_from_slice(body);
                    found = true;
                }
                _ if c.waiting.contains(&id) => {
                    c.claimed.insert(id, body.to_vec());
                }
                _ if c.forgotten.remove(&id) => {}
                _ => c.ready.push_back((id, body.to_vec())),
            }
        }
        if c.head != start {
            self.set_word(ctrl::OUT_HEAD, c.head);
        }
        found
    }
}

/// Spins for `d` (a pause shorter than a sleep's granularity).
fn spin_for(d: Duration) {
    let t0 = Instant::now();
    while t0.elapsed() < d {
        std::hint::spin_loop();
    }
}

/// Spin, then yield, then sleep: a waiter that answers fast when the wait is short and
/// costs little when it is long. By time, not rounds: a reply takes a few µs, and a spin
/// round's length differs between CPUs.
pub(crate) struct Backoff {
    start: Instant,
}

/// Spin this long, then yield until `YIELD_FOR`, then sleep `SLEEP` at a time.
const SPIN_FOR: Duration = Duration::from_micros(50);
const YIELD_FOR: Duration = Duration::from_millis(1);
const SLEEP: Duration = Duration::from_micros(50);

impl Backoff {
    pub(crate) fn new() -> Backoff {
        Backoff {
            start: Instant::now(),
        }
    }

    pub(crate) fn waited(&self) -> Duration {
        self.start.elapsed()
    }

    pub(crate) fn pause(&mut self) {
        let waited = self.waited();
        if waited < SPIN_FOR {
            std::hint::spin_loop();
        } else if waited < YIELD_FOR {
            std::thread::yield_now();
        } else {
            std::thread::sleep(SLEEP);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::actor::ActorSpec;

    fn shared(hint: bool) -> ActorShared {
        let spec = ActorSpec::<u32, u32, ()>::new("hint", ())
            .capacity(1 << 14)
            .tail_hint(hint)
            .erase()
            .unwrap();
        ActorShared::new(&Device::cpu(), 0, &spec).unwrap()
    }

    #[test]
    fn the_tail_hint_is_published_past_the_smallest_window_and_never_goes_back() {
        let a = shared(true);
        let alive = || -> Result<()> { Ok(()) };
        let bytes = 7u32.to_le_bytes();
        let body: &[u8] = &bytes;
        // A lone message (nothing taken yet: two waiting) leaves the hint alone.
        a.send(0, &[body], &alive).unwrap();
        a.send(0, &[body], &alive).unwrap();
        assert_eq!(a.word(ctrl::TAIL_HINT), 0);
        a.send(0, &[body; 3], &alive).unwrap();
        assert_eq!(a.word(ctrl::TAIL_HINT), 5);
        // Senders on several threads (nothing taken: every claim publishes): the hint read
        // meanwhile only rises, and ends at the last claim.
        let stop = std::sync::atomic::AtomicBool::new(false);
        std::thread::scope(|s| {
            let watcher = s.spawn(|| {
                let mut last = 0;
                while !stop.load(Ordering::Relaxed) {
                    let h = a.word(ctrl::TAIL_HINT);
                    assert!(h >= last, "the hint went back from {last} to {h}");
                    last = h;
                }
            });
            let senders: Vec<_> = (0..4)
                .map(|t| {
                    let a = &a;
                    s.spawn(move || {
                        for k in 0..500 {
                            let n = 1 + (t + k) % 5;
                            a.send(0, &vec![body; n], &alive).unwrap();
                        }
                    })
                })
                .collect();
            for h in senders {
                h.join().unwrap();
            }
            stop.store(true, Ordering::Relaxed);
            watcher.join().unwrap();
        });
        let claimed = a.tails[0].load(Ordering::Acquire);
        assert_eq!(a.word(ctrl::TAIL_HINT), claimed);
        // Off: never written.
        let off = shared(false);
        off.send(0, &[body; 8], &alive).unwrap();
        assert_eq!(off.word(ctrl::TAIL_HINT), 0);
    }
}
