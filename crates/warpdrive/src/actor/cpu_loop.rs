//! The CPU backend's loop: a host thread doing what the resident kernel does, with each
//! actor's host closure as its handler. The reference the GPU loop is tested against.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use super::host::{ActorShared, Backoff};
use super::ring::{ctrl, sys, Found, TRACE_SLOTS, TRACE_WORDS};
use super::spec::{ActorCtx, ErasedSpec, HostFn};
use super::system::Loop;
use crate::device::SharedWords;
use crate::error::{Error, Result};

/// The loop's thread and what the host reads of it.
pub(crate) struct CpuLoop {
    thread: Option<JoinHandle<()>>,
    ended: Arc<AtomicBool>,
    states: Arc<Vec<Mutex<Vec<u8>>>>,
}

/// A message the loop has read and not yet handled, or a position it found overwritten.
enum Entry {
    Message { correlation: u32, body: Vec<u8> },
    Dropped,
}

/// One actor as the loop keeps it.
struct Worker {
    shared: Arc<ActorShared>,
    handler: HostFn,
    batch: usize,
    starvation_limit: u32,
    forward_to: Option<usize>,
    /// Next sequence number to read, per lane.
    heads: Vec<u64>,
    out_tail: u64,
    handled: u64,
    dropped: u64,
    since_lower: u32,
    busy_ns: u64,
    forwarded: u64,
    /// Every `trace_every`-th message handled gets a record in the trace ring (0: none).
    trace_every: u32,
    traced: u64,
}

pub(crate) fn start(
    sys: &Arc<SharedWords>,
    actors: &[Arc<ActorShared>],
    specs: Vec<ErasedSpec>,
    trace_every: u32,
) -> Result<CpuLoop> {
    let mut workers = Vec::with_capacity(specs.len());
    let mut states = Vec::with_capacity(specs.len());
    let mut capacities = Vec::with_capacity(specs.len());
    for (spec, shared) in specs.into_iter().zip(actors) {
        let handler = spec.host.ok_or_else(|| {
            Error::InvalidArgument(format!(
                "actor {}: no host handler (the CPU backend runs `ActorSpec::host`)",
                spec.name
            ))
        })?;
        states.push(Mutex::new(spec.state));
        capacities.push(spec.capacity);
        workers.push(Worker {
            shared: shared.clone(),
            handler,
            batch: spec.batch,
            starvation_limit: spec.starvation_limit,
            forward_to: spec.forward_to,
            heads: vec![0; spec.lanes],
            out_tail: 0,
            handled: 0,
            dropped: 0,
            since_lower: 0,
            busy_ns: 0,
            forwarded: 0,
            trace_every,
            traced: 0,
        });
    }
    let states = Arc::new(states);
    let ended = Arc::new(AtomicBool::new(false));
    let (sys, st, end) = (sys.clone(), states.clone(), ended.clone());
    let thread = std::thread::Builder::new()
        .name("warpdrive-actor-loop".into())
        .spawn(move || {
            run(&sys, workers, capacities, &st);
            end.store(true, Ordering::Release);
        })
        .map_err(|e| Error::Actor {
            actor: "(system)".into(),
            detail: format!("the loop thread did not start: {e}"),
        })?;
    Ok(CpuLoop {
        thread: Some(thread),
        ended,
        states,
    })
}

impl Loop for CpuLoop {
    fn join(&mut self, timeout: Duration) -> Result<bool> {
        let t0 = Instant::now();
        while !self.ended.load(Ordering::Acquire) {
            if t0.elapsed() > timeout {
                return Ok(false);
            }
            std::thread::sleep(Duration::from_micros(20));
        }
        if let Some(t) = self.thread.take() {
            t.join()
                .map_err(|_| Error::WorkerPanicked("the actor loop thread".into()))?;
        }
        Ok(true)
    }

    fn running(&self) -> Result<bool> {
        Ok(!self.ended.load(Ordering::Acquire))
    }

    fn state(&self, actor: usize) -> Result<Vec<u8>> {
        self.states
            .get(actor)
            .map(|s| s.lock().clone())
            .ok_or_else(|| Error::InvalidArgument(format!("no actor {actor}")))
    }
}

fn run(
    sys_words: &SharedWords,
    mut workers: Vec<Worker>,
    capacities: Vec<usize>,
    states: &[Mutex<Vec<u8>>],
) {
    let words = sys_words.words();
    let get = |i: usize| words[i].load(Ordering::Acquire);
    let clock = Instant::now();
    let mut device_inboxes: Vec<VecDeque<(u32, Vec<u8>)>> =
        capacities.iter().map(|_| VecDeque::new()).collect();
    for w in &workers {
        w.shared.set_word(ctrl::CLOCK_START, 0);
    }
    let (mut host_beat, mut beat_seen) = (get(sys::HOST_BEAT), Instant::now());
    let mut idle = Backoff::new();
    loop {
        if get(sys::COMMAND) == 1 {
            break;
        }
        let request = get(sys::CAL_REQ);
        if request != get(sys::CAL_ACK) {
            words[sys::CAL_NS].store(clock.elapsed().as_nanos() as u64, Ordering::Release);
            words[sys::CAL_ACK].store(request, Ordering::Release);
        }
        words[sys::LOOP_BEAT].fetch_add(1, Ordering::AcqRel);
        let beat = get(sys::HOST_BEAT);
        if beat != host_beat {
            (host_beat, beat_seen) = (beat, Instant::now());
            words[sys::PARKED].store(0, Ordering::Release);
        } else if beat_seen.elapsed().as_nanos() as u64 > get(sys::PARK_NS) {
            words[sys::PARKED].store(1, Ordering::Release);
            std::thread::sleep(Duration::from_millis(1));
            continue;
        }
        let mut did = 0;
        for i in 0..workers.len() {
            did += step(
                &mut workers,
                i,
                &capacities,
                &mut device_inboxes,
                states,
                clock,
            );
        }
        if did == 0 {
            idle.pause();
        } else {
            idle = Backoff::new();
        }
    }
}

/// One iteration for actor `i`: read, pick by priority, handle, answer, publish. Returns
/// the messages handled.
fn step(
    workers: &mut [Worker],
    i: usize,
    capacities: &[usize],
    device_inboxes: &mut [VecDeque<(u32, Vec<u8>)>],
    states: &[Mutex<Vec<u8>>],
    clock: Instant,
) -> usize {
    let t0 = Instant::now();
    let now_ns = clock.elapsed().as_nanos() as u64;
    let mut traced: Vec<(u64, u64)> = Vec::new();
    let w = &mut workers[i];
    let s = w.shared.clone();
    let command = s.word(ctrl::COMMAND) & 1;
    if s.word(ctrl::STATUS) != command {
        s.set_word(ctrl::STATUS, command);
    }
    if command == 0 {
        return 0;
    }
    let lanes = w.heads.len();
    // Entries per rank: rank 0 is the highest lane, rank `lanes` the device inbox.
    let mut ranks: Vec<VecDeque<Entry>> = Vec::with_capacity(lanes + 1);
    for r in 0..lanes {
        let lane = lanes - 1 - r;
        let ring = s.lanes[lane];
        let mut entries = VecDeque::new();
        let mut header = [0u32; 2];
        let mut seq = w.heads[lane];
        while entries.len() < w.batch {
            let mut body = vec![0u8; s.in_bytes];
            match ring.read(s.words(), seq, &mut header, &mut body) {
                Found::Ready => entries.push_back(Entry::Message {
                    correlation: header[0],
                    body,
                }),
                Found::Overwritten => entries.push_back(Entry::Dropped),
                Found::Empty => break,
            }
            seq += 1;
        }
        ranks.push(entries);
    }
    ranks.push(
        device_inboxes[i]
            .iter()
            .take(w.batch)
            .map(|(c, b)| Entry::Message {
                correlation: *c,
                body: b.clone(),
            })
            .collect(),
    );
    // Room for answers.
    let room = match w.forward_to {
        Some(t) => capacities[t].saturating_sub(device_inboxes[t].len()),
        None => {
            let taken = s.word(ctrl::OUT_HEAD);
            s.outbox.capacity - (w.out_tail - taken.min(w.out_tail)) as usize
        }
    };
    let limit = w.batch.min(room);
    // A rank whose read stopped at `batch` may have more waiting: those come first.
    let full: Vec<bool> = ranks.iter().map(|e| e.len() == w.batch).collect();
    let mut consumed = vec![0u64; lanes + 1];
    let mut handled = 0;
    let mut out = vec![0u8; s.out_bytes];
    let mut state = states[i].lock();
    loop {
        for (r, entries) in ranks.iter_mut().enumerate() {
            while let Some(Entry::Dropped) = entries.front() {
                entries.pop_front();
                consumed[r] += 1;
                w.dropped += 1;
            }
        }
        if handled >= limit {
            break;
        }
        let Some(top) = (0..ranks.len()).find(|&r| !ranks[r].is_empty() || full[r]) else {
            break;
        };
        let lower = (top + 1..ranks.len()).find(|&r| !ranks[r].is_empty());
        let starving = lower.is_some() && w.since_lower >= w.starvation_limit;
        if ranks[top].is_empty() && !starving {
            break;
        }
        let rank = match lower {
            Some(l) if starving => {
                w.since_lower = 0;
                l
            }
            Some(_) => {
                w.since_lower += 1;
                top
            }
            None => {
                w.since_lower = 0;
                top
            }
        };
        let Some(Entry::Message { correlation, body }) = ranks[rank].pop_front() else {
            break;
        };
        consumed[rank] += 1;
        let mut ctx = ActorCtx {
            actor: i as u32,
            lane: if rank < lanes {
                (lanes - 1 - rank) as u32
            } else {
                0
            },
            correlation,
            reply: 1,
            seq: w.handled,
            now_ns,
        };
        out.fill(0);
        if w.trace_every > 0 && w.handled % w.trace_every as u64 == 0 {
            let id = correlation as u64 | (ctx.lane as u64) << 32;
            traced.push((id, clock.elapsed().as_nanos() as u64));
        }
        (w.handler)(&body, &mut out, &mut state, &mut ctx);
        w.handled += 1;
        handled += 1;
        if ctx.reply == 0 {
            continue;
        }
        match w.forward_to {
            Some(t) => {
                device_inboxes[t].push_back((correlation, out.clone()));
                w.forwarded += 1;
            }
            None => {
                s.outbox
                    .write(s.words(), w.out_tail, [correlation, 0], &out);
                w.out_tail += 1;
            }
        }
    }
    drop(state);
    if !traced.is_empty() {
        let done = clock.elapsed().as_nanos() as u64;
        for (id, started) in traced {
            let at = s.trace_base + (w.traced as usize % TRACE_SLOTS) * TRACE_WORDS;
            for (k, v) in [id, now_ns, started, done].into_iter().enumerate() {
                s.set_word(at + k, v);
            }
            w.traced += 1;
        }
        s.set_word(ctrl::TRACE_TAIL, w.traced);
    }
    for (r, &n) in consumed.iter().enumerate().take(lanes) {
        if n > 0 {
            let lane = lanes - 1 - r;
            w.heads[lane] += n;
            s.set_word(ctrl::IN_HEAD + lane, w.heads[lane]);
        }
    }
    for _ in 0..consumed[lanes] {
        device_inboxes[i].pop_front();
    }
    if handled > 0 {
        w.busy_ns += t0.elapsed().as_nanos() as u64;
    }
    s.set_word(ctrl::PROCESSED, w.handled);
    s.set_word(ctrl::DROPPED, w.dropped);
    s.set_word(ctrl::BUSY_NS, w.busy_ns);
    s.set_word(ctrl::OUT_TAIL, w.out_tail);
    s.set_word(ctrl::FORWARDED, w.forwarded);
    s.set_word(ctrl::LOOPS, s.word(ctrl::LOOPS) + 1);
    handled
}
