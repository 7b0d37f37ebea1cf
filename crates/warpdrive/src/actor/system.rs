//! The actor system: spawning, starting the loop, the typed handles, the watcher thread
//! (liveness both ways) and termination.

use std::future::Future;
use std::marker::PhantomData;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};
use std::sync::{Arc, Weak};
use std::task::{Context, Poll};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use bytemuck::Pod;
use parking_lot::Mutex;

use super::host::{ActorShared, Backoff};
use super::ring::{ctrl, sys};
use super::spec::{ActorSpec, ErasedSpec};
use crate::device::{Device, SharedWords};
use crate::error::{Error, Result};

/// How the system watches its loop and how the loop watches the host.
#[derive(Debug, Clone, Copy)]
pub struct SystemConfig {
    /// The loop parks its actors when the host's watcher has not beaten for this long.
    pub park_after: Duration,
    /// A loop that has not beaten for this long is reported hung: every call fails.
    pub hang_after: Duration,
    /// How often the watcher beats and checks.
    pub watch_every: Duration,
    /// How long `terminate` waits for the loop to end (a handler may be mid-message).
    pub terminate_timeout: Duration,
    /// Load every kernel of the library before the loop starts, the MoE layer's too (slow
    /// the first time on a machine, when each is compiled); otherwise the common ones and
    /// those this process has loaded already. A kernel first loaded while the loop runs may
    /// wait for the device to go idle, which it never does: preload what you will use.
    pub preload_all: bool,
    /// Every `trace_every`-th message an actor handles gets a record (the loop's clock —
    /// `%globaltimer` on CUDA — when it was read, handled and answered), shown as a slice on
    /// the actor's track of a Chrome trace (`telemetry::start_trace`); 0: none.
    pub trace_every: u32,
    /// On the GPU backend, after an iteration that answered several messages and replied to
    /// the host, the loop waits before its next read as after a lone answer (the adaptive
    /// gap), for every actor: a client that sends its next request when a reply comes is
    /// then found by that read rather than by the one after it, a whole iteration later.
    /// Costs a stream whose messages want replies one gap an iteration; the messages and
    /// their order are the same either way. On by default (see `ActorSpec::quick_stream`).
    pub reply_gap: bool,
}

impl Default for SystemConfig {
    fn default() -> Self {
        SystemConfig {
            park_after: Duration::from_millis(200),
            hang_after: Duration::from_secs(2),
            watch_every: Duration::from_millis(1),
            terminate_timeout: Duration::from_secs(5),
            preload_all: false,
            trace_every: 0,
            reply_gap: true,
        }
    }
}

/// A running loop, on one backend.
pub(crate) trait Loop: Send {
    /// Tells the loop to end (the system block's command is set already) and waits for it
    /// up to `timeout`: true when it ended.
    fn join(&mut self, timeout: Duration) -> Result<bool>;
    /// `Err` after a fault of the device; `Ok(false)` when the loop has ended.
    fn running(&self) -> Result<bool>;
    /// The state bytes of actor `actor`.
    fn state(&self, actor: usize) -> Result<Vec<u8>>;
}

const BUILDING: u8 = 0;
const RUNNING: u8 = 1;
const TERMINATED: u8 = 2;
const LOST: u8 = 3;
const HUNG: u8 = 4;

/// What the handles and the watcher share.
pub(crate) struct Shared {
    device: Device,
    config: SystemConfig,
    sys: Arc<SharedWords>,
    phase: AtomicU8,
    actors: Mutex<Vec<Arc<ActorShared>>>,
    specs: Mutex<Vec<ErasedSpec>>,
    running: Mutex<Option<Box<dyn Loop>>>,
    watcher_stop: AtomicBool,
}

impl Shared {
    fn sys_word(&self, i: usize) -> u64 {
        self.sys.words()[i].load(Ordering::Acquire)
    }

    fn set_sys_word(&self, i: usize, v: u64) {
        self.sys.words()[i].store(v, Ordering::Release)
    }

    /// `Ok` while calls may go on: not terminated, not lost, not hung.
    fn alive(&self, actor: &str) -> Result<()> {
        let detail = match self.phase.load(Ordering::Acquire) {
            BUILDING | RUNNING => return Ok(()),
            TERMINATED => "the system was terminated",
            LOST => {
                return Err(Error::DeviceLost {
                    call: "actor loop",
                    message: format!("the device faulted while actor {actor} ran"),
                })
            }
            _ => "the loop stopped beating (hung); the system is unusable",
        };
        Err(Error::Actor {
            actor: actor.into(),
            detail: detail.into(),
        })
    }
}

/// A set of actors hosted by one resident loop on one device. Dropping it terminates them.
pub struct ActorSystem {
    shared: Arc<Shared>,
    watcher: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for ActorSystem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "ActorSystem({}, {} actors)",
            self.shared.device.label(),
            self.shared.actors.lock().len()
        )
    }
}

impl ActorSystem {
    /// An empty system on `device` with the default [`SystemConfig`].
    pub fn new(device: &Device) -> Result<ActorSystem> {
        ActorSystem::with_config(device, SystemConfig::default())
    }

    /// An empty system on `device`.
    pub fn with_config(device: &Device, config: SystemConfig) -> Result<ActorSystem> {
        device.check_usable()?;
        let sys = Arc::new(device.shared_words(sys::WORDS)?);
        sys.words()[sys::PARK_NS].store(
            config.park_after.as_nanos().min(u64::MAX as u128) as u64,
            Ordering::Release,
        );
        Ok(ActorSystem {
            shared: Arc::new(Shared {
                device: device.clone(),
                config,
                sys,
                phase: AtomicU8::new(BUILDING),
                actors: Mutex::new(Vec::new()),
                specs: Mutex::new(Vec::new()),
                running: Mutex::new(None),
                watcher_stop: AtomicBool::new(false),
            }),
            watcher: None,
        })
    }

    /// The device the actors run on.
    pub fn device(&self) -> &Device {
        &self.shared.device
    }

    /// Adds an actor; allowed before [`start`](Self::start) only (the loop is compiled for
    /// the actors it hosts). The handle sends and receives once the system runs.
    pub fn spawn<In: Pod, Out: Pod, S: Pod>(
        &self,
        spec: ActorSpec<In, Out, S>,
    ) -> Result<Actor<In, Out>> {
        if self.shared.phase.load(Ordering::Acquire) != BUILDING {
            return Err(Error::Actor {
                actor: spec.name,
                detail: "spawn before start: the loop is built for the actors it hosts".into(),
            });
        }
        let spec = spec.erase()?;
        let mut actors = self.shared.actors.lock();
        let index = actors.len();
        if let Some(next) = spec.forward_to {
            let target = actors.get(next).ok_or_else(|| {
                Error::InvalidArgument(format!("actor {}: forwards to an unknown actor", spec.name))
            })?;
            if target.in_bytes != spec.out_bytes {
                return Err(Error::InvalidArgument(format!(
                    "actor {}: Out is {} bytes, {}'s In {}",
                    spec.name, spec.out_bytes, target.name, target.in_bytes
                )));
            }
        }
        let actor = Arc::new(ActorShared::new(&self.shared.device, index, &spec)?);
        actors.push(actor.clone());
        self.shared.specs.lock().push(spec);
        Ok(Actor {
            system: self.shared.clone(),
            actor,
            _types: PhantomData,
        })
    }

    /// Compiles the CUDA loop of the actors spawned so far for `arch` (NVRTC only, no GPU):
    /// a handler that does not compile is an `Error::Compile` with NVRTC's log.
    pub fn check_compiles(&self, arch: crate::kernels::Arch) -> Result<()> {
        super::gpu_loop::compile(
            &self.shared.specs.lock(),
            arch,
            self.shared.config.reply_gap,
        )
        .map(|_| ())
    }

    /// Launches the loop with every actor inactive and, once it has beaten (up to 10 s: a
    /// `Timeout` past that), the watcher.
    pub fn start(&mut self) -> Result<()> {
        let shared = &self.shared;
        if shared.phase.load(Ordering::Acquire) != BUILDING {
            return Err(Error::Actor {
                actor: "(system)".into(),
                detail: "started twice".into(),
            });
        }
        let specs = std::mem::take(&mut *shared.specs.lock());
        if specs.is_empty() {
            return Err(Error::InvalidArgument(
                "an actor system with no actors".into(),
            ));
        }
        let actors = shared.actors.lock().clone();
        let running: Box<dyn Loop> = if shared.device.is_host_memory() {
            Box::new(super::cpu_loop::start(
                &shared.sys,
                &actors,
                specs,
                shared.config.trace_every,
            )?)
        } else {
            Box::new(super::gpu_loop::start(
                &shared.device,
                &shared.sys,
                &actors,
                specs,
                shared.config.preload_all,
                shared.config.trace_every,
                shared.config.reply_gap,
            )?)
        };
        *shared.running.lock() = Some(running);
        shared.phase.store(RUNNING, Ordering::Release);
        // The watcher's hang clock and the first activation start from a loop that runs, not
        // from a launch still waiting for room on the device (another process's resident
        // kernels) or for its module: `start` returns once the loop has beaten.
        first_beat(shared)?;
        let weak = Arc::downgrade(shared);
        let every = shared.config.watch_every;
        let watcher = std::thread::Builder::new()
            .name("warpdrive-actors".into())
            .spawn(move || watch(weak, every))
            .map_err(|e| Error::Actor {
                actor: "(system)".into(),
                detail: format!("the watcher thread did not start: {e}"),
            })?;
        self.watcher = Some(watcher);
        tracing::debug!("actor system: started, the watcher running");
        Ok(())
    }

    /// Ends the loop and every actor; returns how long the loop took to end after being
    /// told. Calls on the handles fail from then on.
    pub fn terminate(&mut self) -> Result<Duration> {
        let shared = &self.shared;
        let was = shared.phase.swap(TERMINATED, Ordering::AcqRel);
        shared.watcher_stop.store(true, Ordering::Release);
        if let Some(w) = self.watcher.take() {
            let _ = w.join();
        }
        let t0 = Instant::now();
        shared.set_sys_word(sys::COMMAND, 1);
        let mut running = shared.running.lock();
        let Some(r) = running.as_mut() else {
            return Ok(Duration::ZERO);
        };
        if was == LOST {
            running.take();
            return Err(Error::DeviceLost {
                call: "actor loop",
                message: "the device faulted; the loop's memory stays allocated".into(),
            });
        }
        let ended = r.join(shared.config.terminate_timeout)?;
        let took = t0.elapsed();
        if !ended {
            // The loop may still write to its memory: leak it rather than free it.
            if let Some(r) = running.take() {
                std::mem::forget(r);
            }
            std::mem::forget(shared.actors.lock().drain(..).collect::<Vec<_>>());
            return Err(Error::Actor {
                actor: "(system)".into(),
                detail: format!("the loop did not end within {took:?}"),
            });
        }
        running.take();
        Ok(took)
    }

    /// True while the loop's host watcher finds it parked (no host beat for `park_after`).
    pub fn is_parked(&self) -> bool {
        self.shared.sys_word(sys::PARKED) == 1
    }

    /// Stops (`false`) or resumes (`true`) the watcher's beat, as a host that stopped
    /// polling would: the loop parks after `park_after` (tests, demos).
    pub fn set_host_beat(&self, on: bool) {
        self.shared.watcher_stop.store(!on, Ordering::Release);
    }
}

impl Drop for ActorSystem {
    fn drop(&mut self) {
        if self.shared.phase.load(Ordering::Acquire) != TERMINATED {
            if let Err(e) = self.terminate() {
                tracing::warn!("terminating the actor system on drop: {e}");
            }
        }
    }
}

/// The watcher: beats for the host, checks the loop's beat and the device.
fn watch(shared: Weak<Shared>, every: Duration) {
    let mut last_beat = 0;
    let mut last_change = Instant::now();
    let mut last_metrics = Instant::now();
    let mut waiting = false;
    // µs to subtract from the loop's clock (in µs) to get the trace's, and when measured.
    let mut offset: Option<(f64, Instant)> = None;
    let mut request = 0;
    let mut last_report = Instant::now();
    loop {
        // Futures waiting for replies are woken often; otherwise a beat per `every`.
        std::thread::sleep(if waiting {
            WAKE_EVERY.min(every)
        } else {
            every
        });
        let Some(s) = shared.upgrade() else { return };
        let actors = s.actors.lock().clone();
        waiting = false;
        for a in &actors {
            waiting |= a.wake_all();
        }
        if last_metrics.elapsed() >= METRICS_EVERY {
            last_metrics = Instant::now();
            export_metrics(&actors);
        }
        // Read before the records are drained, so the last pass (after `terminate`) takes
        // every record the loop wrote before its replies were seen.
        let running = s.phase.load(Ordering::Acquire) == RUNNING;
        if s.config.trace_every > 0 && crate::telemetry::is_tracing() {
            if offset.is_none_or(|(_, at)| at.elapsed() > CALIBRATE_EVERY) {
                request += 1;
                offset = calibrate(&s, request)
                    .map(|o| (o, Instant::now()))
                    .or(offset);
            }
            if let Some((off, _)) = offset {
                for a in &actors {
                    trace_records(a, off);
                }
            }
        }
        if !running {
            tracing::debug!("actor watcher: the system stopped running");
            return;
        }
        if !s.watcher_stop.load(Ordering::Acquire) {
            let beat = s.sys_word(sys::HOST_BEAT);
            s.set_sys_word(sys::HOST_BEAT, beat.wrapping_add(1));
        }
        let state = s.running.lock().as_ref().map(|r| r.running());
        match state {
            Some(Err(e)) if e.is_device_lost() => {
                tracing::error!("the actor loop faulted: {e}");
                s.phase.store(LOST, Ordering::Release);
                return;
            }
            Some(Ok(false)) | Some(Err(_)) => {
                tracing::error!("the actor loop ended without being told to");
                s.phase.store(HUNG, Ordering::Release);
                return;
            }
            _ => {}
        }
        let beat = s.sys_word(sys::LOOP_BEAT);
        if last_report.elapsed() >= REPORT_EVERY && tracing::enabled!(tracing::Level::DEBUG) {
            last_report = Instant::now();
            for a in &actors {
                tracing::debug!(
                    "actor watcher: loop beat {beat}, parked {}; {}: status {}, processed {}, in head {}, out tail {}",
                    s.sys_word(sys::PARKED),
                    a.name,
                    a.word(ctrl::STATUS),
                    a.word(ctrl::PROCESSED),
                    a.word(ctrl::IN_HEAD),
                    a.word(ctrl::OUT_TAIL),
                );
            }
        }
        if beat != last_beat || s.sys_word(sys::PARKED) == 1 {
            last_beat = beat;
            last_change = Instant::now();
        } else if last_change.elapsed() > s.config.hang_after {
            tracing::error!(
                "the actor loop has not beaten for {:?}: reported hung",
                s.config.hang_after
            );
            s.phase.store(HUNG, Ordering::Release);
            return;
        }
    }
}

/// How often the watcher wakes futures waiting for replies.
const WAKE_EVERY: Duration = Duration::from_micros(20);
/// How often the watcher reports the loop's words at debug level.
const REPORT_EVERY: Duration = Duration::from_secs(1);
/// How often the watcher exports the actors' counters as metrics.
const METRICS_EVERY: Duration = Duration::from_millis(100);

/// Each actor's counters as metrics, labelled by actor: `warpdrive_actor_processed_total`,
/// `_dropped_total`, `_rejected_total`, `_forwarded_total`, and the gauges
/// `warpdrive_actor_depth` (messages waiting, all lanes) and `warpdrive_actor_busy_ratio`
/// (loop time spent handling since the start).
fn export_metrics(actors: &[Arc<ActorShared>]) {
    for a in actors {
        let label = [("actor", a.name.clone())];
        let w = |i| a.word(i);
        metrics::counter!("warpdrive_actor_processed_total", &label).absolute(w(ctrl::PROCESSED));
        metrics::counter!("warpdrive_actor_dropped_total", &label).absolute(w(ctrl::DROPPED));
        metrics::counter!("warpdrive_actor_forwarded_total", &label).absolute(w(ctrl::FORWARDED));
        metrics::counter!("warpdrive_actor_rejected_total", &label)
            .absolute(a.rejected.load(Ordering::Relaxed));
        let depth: u64 = (0..a.lanes.len()).map(|l| a.depth(l)).sum();
        metrics::gauge!("warpdrive_actor_depth", &label).set(depth as f64);
        metrics::gauge!("warpdrive_actor_busy_ratio", &label).set(a.busy_ratio());
    }
}

/// How long `start` waits for the loop's first beat.
const START_WAIT: Duration = Duration::from_secs(10);

/// Waits (up to [`START_WAIT`]) until the loop has beaten once; an error when it ended or
/// faulted first. (A loop left running after a timeout here is ended by the system's drop.)
fn first_beat(s: &Shared) -> Result<()> {
    let before = s.sys_word(sys::LOOP_BEAT);
    let mut backoff = Backoff::new();
    while s.sys_word(sys::LOOP_BEAT) == before {
        let running = match s.running.lock().as_ref() {
            Some(r) => r.running()?,
            None => false,
        };
        if !running {
            return Err(Error::Actor {
                actor: "(system)".into(),
                detail: "the actor loop ended before its first beat".into(),
            });
        }
        if backoff.waited() > START_WAIT {
            return Err(Error::Timeout {
                what: "the actor loop's first beat after its launch".into(),
                after_ms: START_WAIT.as_millis() as u64,
            });
        }
        backoff.pause();
    }
    Ok(())
}

/// How often the watcher maps the loop's clock onto the trace's while tracing.
const CALIBRATE_EVERY: Duration = Duration::from_secs(1);
/// How long a calibration waits for the loop's answer.
const CALIBRATE_WAIT: Duration = Duration::from_millis(50);

/// The offset (µs) from the trace's clock to the loop's: the loop's clock read while the
/// host waited, against the middle of that wait. `None` when the loop did not answer.
fn calibrate(s: &Shared, request: u64) -> Option<f64> {
    let t0 = Instant::now();
    s.set_sys_word(sys::CAL_REQ, request);
    while s.sys_word(sys::CAL_ACK) != request {
        if t0.elapsed() > CALIBRATE_WAIT {
            return None;
        }
        std::hint::spin_loop();
    }
    let wait = t0.elapsed();
    let loop_us = s.sys_word(sys::CAL_NS) as f64 / 1e3;
    Some(loop_us - (crate::telemetry::host_us(t0) + wait.as_secs_f64() * 0.5e6))
}

/// The actor's sampled message records as slices of its trace track: `handle` from the
/// handler's start to the answer, with the time it waited after being read.
fn trace_records(a: &ActorShared, offset_us: f64) {
    for [id, seen, started, done] in a.take_trace() {
        let us = |ns: u64| ns as f64 / 1e3 - offset_us;
        crate::telemetry::push_track_slice(
            &a.name,
            "handle",
            us(started),
            (done.saturating_sub(started)) as f64 / 1e3,
            serde_json::json!({
                "correlation": id as u32,
                "lane": id >> 32,
                "waited_us": started.saturating_sub(seen) as f64 / 1e3,
            }),
        );
    }
}

/// A reply on its way ([`Actor::request_async`]): a future any executor can poll; the
/// system's watcher thread wakes it (every 20 µs while some future waits), so no async
/// runtime is needed. Dropping it stops waiting (a late reply is discarded).
pub struct ReplyFuture<Out> {
    system: Arc<Shared>,
    actor: Arc<ActorShared>,
    /// The request's correlation id, or why it was not sent.
    id: std::result::Result<u32, Option<Error>>,
    started: Instant,
    timeout: Duration,
    done: bool,
    _out: PhantomData<fn() -> Out>,
}

impl<Out: Pod> Future for ReplyFuture<Out> {
    type Output = Result<Out>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Result<Out>> {
        let this = self.get_mut();
        let id = match &mut this.id {
            Ok(id) => *id,
            Err(e) => {
                this.done = true;
                return Poll::Ready(Err(e.take().unwrap_or_else(|| Error::Actor {
                    actor: this.actor.name.clone(),
                    detail: "a reply future polled after it finished".into(),
                })));
            }
        };
        let mut out = Out::zeroed();
        for attempt in 0..2 {
            if this.actor.take_reply(id, bytemuck::bytes_of_mut(&mut out)) {
                this.done = true;
                return Poll::Ready(Ok(out));
            }
            if attempt == 0 {
                // Parked before the second look, so a reply landing in between still wakes it.
                this.actor.park_waker(cx.waker());
            }
        }
        let failed = match this.system.alive(&this.actor.name) {
            Err(e) => Some(e),
            Ok(()) if this.started.elapsed() > this.timeout => Some(Error::Timeout {
                what: format!(
                    "actor {}: the reply to request {id} ({})",
                    this.actor.name,
                    this.actor.progress()
                ),
                after_ms: this.timeout.as_millis() as u64,
            }),
            Ok(()) => None,
        };
        match failed {
            Some(e) => {
                this.done = true;
                this.actor.forget_reply(id);
                Poll::Ready(Err(e))
            }
            None => Poll::Pending,
        }
    }
}

impl<Out> Drop for ReplyFuture<Out> {
    fn drop(&mut self) {
        if let (Ok(id), false) = (&self.id, self.done) {
            self.actor.forget_reply(*id);
        }
    }
}

/// A reply taken by [`Actor::recv`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Reply<Out> {
    /// The correlation id of the message it answers (what `send` returned).
    pub correlation: u32,
    pub value: Out,
}

/// What an actor has done, as its loop counts it (plus the host's rejections). The loop
/// publishes its counts at the end of each iteration, after that iteration's replies: a
/// reply can be received a moment before the counts that include it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ActorStats {
    /// Messages taken from the inboxes (the loop handles each in the iteration that takes
    /// it, so this equals `processed`; dropped ones were never received).
    pub received: u64,
    /// Messages handled.
    pub processed: u64,
    /// Messages overwritten before the loop saw them (`DropOldest`).
    pub dropped: u64,
    /// Messages refused with `QueueFull` (`Reject`).
    pub rejected: u64,
    /// Most messages waiting at once in one lane (as senders found it).
    pub max_depth: u64,
    /// Nanoseconds the loop spent in iterations that handled messages.
    pub busy_ns: u64,
    /// Loop iterations.
    pub loops: u64,
    /// Replies sent to the next actor.
    pub forwarded: u64,
    /// Nanoseconds the loop spent, over all its iterations, in each phase: reading the
    /// inboxes and the control words (round trips to host memory), deciding on the control
    /// words, counting and picking messages, handling them and writing the answers, and the
    /// bookkeeping after the answers have left (heads, counters, published words; an idle
    /// iteration's whole tail). Published with `loops`, every 256 iterations (on the CPU
    /// backend, zeros).
    pub phase_ns: [u64; 5],
    /// How long the loop waits, after answering every message it saw, before it reads again
    /// (ns): a closed-loop client is still writing its next request. It adapts to the first
    /// read after the wait finding that request (on the CPU backend, 0).
    pub gap_ns: u64,
    /// The reads right after that wait: `[hits, misses]`, a hit finding a message, a miss
    /// finding none while the next read found one (it came a read later). The wait settles
    /// where misses are a set share of these (on the CPU backend, zeros).
    pub gap_reads: [u64; 2],
    /// The inbox slots the loop read, summed over its iterations: each iteration's window
    /// of the first lane (it doubles after a full read and falls after an empty one, to two
    /// slots or, after a stream, `ActorSpec::wide_window`'s; with `ActorSpec::tail_hint`
    /// never below the messages claimed beyond it); `/ loops`, the mean window.
    /// Published with `loops` (on the CPU backend, 0).
    pub window_slots: u64,
    /// Iterations that took messages (`busy_ns` is their time; on the CPU backend, 0).
    pub busy_loops: u64,
}

/// A typed handle on one actor: `In` goes in, `Out` comes back. Cheap to clone; usable
/// from many threads at once.
pub struct Actor<In, Out> {
    system: Arc<Shared>,
    actor: Arc<ActorShared>,
    _types: PhantomData<fn(In) -> Out>,
}

impl<In, Out> Clone for Actor<In, Out> {
    fn clone(&self) -> Self {
        Actor {
            system: self.system.clone(),
            actor: self.actor.clone(),
            _types: PhantomData,
        }
    }
}

impl<In, Out> std::fmt::Debug for Actor<In, Out> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Actor({} #{})", self.actor.name, self.actor.index)
    }
}

impl<In, Out> Actor<In, Out> {
    pub(crate) fn index(&self) -> usize {
        self.actor.index
    }
}

impl<In: Pod, Out: Pod> Actor<In, Out> {
    /// The actor's name.
    pub fn name(&self) -> &str {
        &self.actor.name
    }

    fn alive(&self) -> Result<()> {
        self.system.alive(&self.actor.name)
    }

    /// Lets the loop handle this actor's messages.
    pub fn activate(&self) -> Result<()> {
        self.set_active(true)
    }

    /// Stops handling (messages wait in the inbox) and returns once the loop has stopped.
    pub fn deactivate(&self) -> Result<()> {
        self.set_active(false)
    }

    fn set_active(&self, on: bool) -> Result<()> {
        self.alive()?;
        self.actor.set_word(ctrl::COMMAND, on as u64);
        if self.system.phase.load(Ordering::Acquire) != RUNNING {
            return Ok(());
        }
        let mut backoff = Backoff::new();
        while self.actor.word(ctrl::STATUS) & 1 != on as u64 {
            self.alive()?;
            if self.system.sys_word(sys::PARKED) == 1 {
                return Ok(());
            }
            if backoff.waited() > self.system.config.hang_after {
                return Err(Error::Timeout {
                    what: format!("actor {}: the loop acknowledging activation", self.name()),
                    after_ms: self.system.config.hang_after.as_millis() as u64,
                });
            }
            backoff.pause();
        }
        Ok(())
    }

    /// Puts `msg` in lane 0; returns its correlation id.
    pub fn send(&self, msg: &In) -> Result<u32> {
        self.send_lane(msg, 0)
    }

    /// Puts `msg` in priority lane `lane` (higher lanes are served first).
    pub fn send_lane(&self, msg: &In, lane: usize) -> Result<u32> {
        self.alive()?;
        let alive = || self.alive();
        self.actor.send(lane, &[bytemuck::bytes_of(msg)], &alive)
    }

    /// Puts `msgs` in lane `lane` in order, claiming their slots at once; returns the first
    /// correlation id (the others follow it).
    pub fn send_many(&self, msgs: &[In], lane: usize) -> Result<u32> {
        self.alive()?;
        let bodies: Vec<&[u8]> = msgs.iter().map(bytemuck::bytes_of).collect();
        let alive = || self.alive();
        self.actor.send(lane, &bodies, &alive)
    }

    /// `send_many`, but after claiming the slots (and publishing the lane's tail,
    /// `ActorSpec::tail_hint`) one message is written every `pause`, each slot half written
    /// for half of it: a slow sender the loop's windows run ahead of (the tail hint's tests).
    #[doc(hidden)]
    pub fn send_many_slowly(&self, msgs: &[In], lane: usize, pause: Duration) -> Result<u32> {
        self.alive()?;
        let bodies: Vec<&[u8]> = msgs.iter().map(bytemuck::bytes_of).collect();
        let alive = || self.alive();
        self.actor.send_slowly(lane, &bodies, pause, &alive)
    }

    fn refuse_forwarder(&self) -> Result<()> {
        if self.actor.forwards {
            return Err(Error::Actor {
                actor: self.actor.name.clone(),
                detail: "its replies go to the next actor, not to the host".into(),
            });
        }
        Ok(())
    }

    /// The next reply, if one has arrived.
    pub fn try_recv(&self) -> Result<Option<Reply<Out>>> {
        self.refuse_forwarder()?;
        self.alive()?;
        Ok(self.actor.try_recv().map(|(correlation, bytes)| Reply {
            correlation,
            value: bytemuck::pod_read_unaligned(&bytes),
        }))
    }

    /// The next reply, waiting up to `timeout`.
    pub fn recv(&self, timeout: Duration) -> Result<Reply<Out>> {
        let mut backoff = Backoff::new();
        loop {
            if let Some(r) = self.try_recv()? {
                return Ok(r);
            }
            if backoff.waited() > timeout {
                return Err(Error::Timeout {
                    what: format!("actor {}: a reply ({})", self.name(), self.actor.progress()),
                    after_ms: timeout.as_millis() as u64,
                });
            }
            backoff.pause();
        }
    }

    /// Sends `msg` on lane `lane` and waits up to `timeout` for its reply (matched by
    /// correlation id; other replies stay for `recv`).
    pub fn request(&self, msg: &In, lane: usize, timeout: Duration) -> Result<Out> {
        self.refuse_forwarder()?;
        self.alive()?;
        let alive = || self.alive();
        let mut out = Out::zeroed();
        // The id is known only once sent; the next one is reserved by registering after
        // the send, and a reply that came first is found among `ready` by `take_reply`.
        let id = self
            .actor
            .send_awaited(lane, bytemuck::bytes_of(msg), &alive)?;
        let mut backoff = Backoff::new();
        loop {
            if self.actor.take_reply(id, bytemuck::bytes_of_mut(&mut out)) {
                return Ok(out);
            }
            if let Err(e) = self.alive() {
                self.actor.forget_reply(id);
                return Err(e);
            }
            if backoff.waited() > timeout {
                self.actor.forget_reply(id);
                return Err(Error::Timeout {
                    what: format!(
                        "actor {}: the reply to request {id} ({})",
                        self.name(),
                        self.actor.progress()
                    ),
                    after_ms: timeout.as_millis() as u64,
                });
            }
            backoff.pause();
        }
    }

    /// Sends `msg` on lane `lane` (as [`request`](Self::request): a full inbox blocks the
    /// caller under `Block`) and returns a future of its reply, failing after `timeout`.
    pub fn request_async(&self, msg: &In, lane: usize, timeout: Duration) -> ReplyFuture<Out> {
        let alive = || self.alive();
        let id = self
            .refuse_forwarder()
            .and_then(|()| self.alive())
            .and_then(|()| {
                self.actor
                    .send_awaited(lane, bytemuck::bytes_of(msg), &alive)
            })
            .map_err(Some);
        ReplyFuture {
            system: self.system.clone(),
            actor: self.actor.clone(),
            id,
            started: Instant::now(),
            timeout,
            done: false,
            _out: PhantomData,
        }
    }

    /// What the actor has done so far.
    pub fn stats(&self) -> ActorStats {
        let w = |i| self.actor.word(i);
        ActorStats {
            received: w(ctrl::PROCESSED),
            processed: w(ctrl::PROCESSED),
            dropped: w(ctrl::DROPPED),
            rejected: self.actor.rejected.load(Ordering::Relaxed),
            max_depth: self.actor.max_depth.load(Ordering::Relaxed),
            busy_ns: w(ctrl::BUSY_NS),
            loops: w(ctrl::LOOPS),
            forwarded: w(ctrl::FORWARDED),
            phase_ns: std::array::from_fn(|i| w(ctrl::PHASE_NS + i)),
            gap_ns: w(ctrl::GAP_NS),
            gap_reads: [w(ctrl::GAP_READS), w(ctrl::GAP_READS + 1)],
            window_slots: w(ctrl::WINDOW_SLOTS),
            busy_loops: w(ctrl::WINDOW_SLOTS + 1),
        }
    }

    /// Messages waiting in lane `lane`.
    pub fn depth(&self, lane: usize) -> u64 {
        self.actor
            .depth(lane.min(self.actor.lanes.len().saturating_sub(1)))
    }

    /// The actor's state; deactivate it first for a value no handler is changing.
    pub fn state<S: Pod>(&self) -> Result<S> {
        self.alive()?;
        let running = self.system.running.lock();
        let r = running.as_ref().ok_or_else(|| Error::Actor {
            actor: self.actor.name.clone(),
            detail: "the system is not running".into(),
        })?;
        let bytes = r.state(self.actor.index)?;
        bytemuck::try_pod_read_unaligned(&bytes).map_err(|_| {
            Error::InvalidArgument(format!(
                "actor {}: state is {} bytes, asked for {}",
                self.actor.name,
                bytes.len(),
                size_of::<S>()
            ))
        })
    }
}
