//! The resident vote: a majority or weighted quorum over a population's votes served by a
//! kernel that stays on the GPU between votes, so a vote costs no launch. The host writes a
//! round number into mapped memory; the resident kernel's first block (of one an SM, launched
//! cooperatively so all are resident) sees it and relays it to the others through device
//! memory (one poller of host memory: a poller a block made a round ~700 µs), each block
//! counts its share of the votes (warp and block sums), takes one ticket, and the block whose ticket ends the round adds the blocks'
//! partials in order and writes the decision word into mapped memory, which the host polls
//! (`agents_vote_serve` in `kernels/agents.cu`). Every wait has a timeout; a kernel that ended
//! or hung is an error. On the CPU backend the host plays the kernel at each vote (the
//! reference), through the same words.
//!
//! While it runs, the device counts a resident kernel: the persistent stepper
//! ([`StepFn::run_steps`](super::StepFn::run_steps)) and the actors refuse to start (they
//! could not all be resident), launched work (steps, Circles, copies) runs beside it on the
//! rest of each SM, frees are held back and a device-wide synchronize is refused until it
//! stops. Load the kernels you will launch beside it first (a lazy load may wait for an idle
//! device).

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use crate::device::{LaunchMode, ResidentGuard, SharedWords};
use crate::error::{Error, Result};
use crate::kernels::{self, AGENTS};
use crate::memory::Buffer;
use crate::ops::{launch_with, Args};
use crate::{Event, Stream};

use super::consensus::{Decision, QuorumDecision};

const KERNEL: &str = "agents_vote_serve";
/// Threads a block of the resident kernel.
const BLOCK: u32 = 512;
/// The host's command word: a round, or [`STOP`].
const CMD: usize = 0;
/// The decision word (`round << 32 | passed << 31 | yes`), then the quorum's two weights.
const OUT: usize = 8;
const STOP: u64 = u64::MAX;
/// Votes of more voters than this would not fit the decision word's yes count.
const MAX_VOTERS: usize = (1 << 31) - 1;
/// How long a vote, a start or a stop waits by default.
const DEFAULT_TIMEOUT: Duration = Duration::from_secs(2);

/// What the resident kernel counts.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Rule {
    Majority,
    Quorum(f64),
}

/// The device side of a server: what the kernel reads and writes while it runs (leaked, not
/// freed, if it cannot be stopped).
#[derive(Debug)]
struct Served {
    votes: Buffer<u32>,
    weights: Option<Buffer<f32>>,
    partials: Buffer<f64>,
    ticket: Buffer<u64>,
    words: SharedWords,
}

/// A running kernel: the event recorded after it (done once it has ended) and the device's
/// resident mark; the CPU backend's "kernel" is the host, at each vote.
enum Running {
    Host,
    Gpu {
        done: Event,
        guard: Option<ResidentGuard>,
    },
}

impl std::fmt::Debug for Running {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Running::Host => write!(f, "Running::Host"),
            Running::Gpu { guard, .. } => write!(f, "Running::Gpu({guard:?})"),
        }
    }
}

/// The server behind [`ResidentMajority`] and [`ResidentQuorum`].
#[derive(Debug)]
struct Server {
    stream: Stream,
    served: Option<Served>,
    rule: Rule,
    /// The last round asked (0: none yet).
    round: u64,
    running: Option<Running>,
    timeout: Duration,
    blocks: u32,
}

impl Server {
    fn new(
        stream: &Stream,
        votes: Buffer<u32>,
        weights: Option<Buffer<f32>>,
        rule: Rule,
    ) -> Result<Server> {
        let what = "agents resident vote";
        votes.check_stream(stream, what)?;
        if let Some(w) = &weights {
            w.check_stream(stream, what)?;
            crate::memory::check_len("agents resident quorum (weights)", w.len(), votes.len())?;
        }
        if votes.len() > MAX_VOTERS {
            return Err(Error::InvalidArgument(format!(
                "agents: a resident vote of {} voters (at most {MAX_VOTERS})",
                votes.len()
            )));
        }
        let device = stream.device();
        let stream = device.new_stream()?;
        let served = Served {
            votes,
            weights,
            partials: Buffer::zeros(&stream, 2 * super::MAX_BLOCKS)?,
            // The ticket counter, then the round block 0 relays to the others.
            ticket: Buffer::zeros(&stream, 2)?,
            words: device.shared_words(OUT + 8)?,
        };
        let mut s = Server {
            stream,
            served: Some(served),
            rule,
            round: 0,
            running: None,
            timeout: DEFAULT_TIMEOUT,
            blocks: 0,
        };
        s.start()?;
        Ok(s)
    }

    fn served(&self) -> Result<&Served> {
        self.served
            .as_ref()
            .ok_or_else(|| lost("its memory was leaked"))
    }

    /// Launches the kernel (a no-op start on the CPU backend); an error if it runs.
    fn start(&mut self) -> Result<()> {
        if self.running.is_some() {
            return Err(Error::InvalidArgument(
                "agents: the resident vote is already running".into(),
            ));
        }
        let dev = self.stream.device().clone();
        if dev.has_resident_kernel() {
            return Err(Error::Unsupported(
                "agents: a resident vote while another resident kernel (actors, a resident \
                 vote) runs on this GPU (they might not all be resident; stop it first)"
                    .into(),
            ));
        }
        let served = self.served()?;
        // The kernel answers rounds other than the last one asked; ~0 would stop it.
        served.words.words()[CMD].store(self.round, Ordering::Release);
        let (rule, quorum) = match self.rule {
            Rule::Majority => (0u32, 0.0),
            Rule::Quorum(q) => (1, q),
        };
        let n = served.votes.len() as u64;
        let round = self.round;
        let done = dev.new_sync_event()?;
        let stream = &self.stream;
        let started = stream.run(
            served,
            |_| Ok(Ok((Running::Host, 0))),
            |m, q| {
                let f = (&AGENTS, KERNEL);
                kernels::function(q.gpu, f.0, f.1)?;
                // Every module loaded now: a lazy load beside a resident kernel may hang.
                kernels::load_eagerly(q.gpu, false)?;
                // One block an SM at most (the rest of each SM stays free for other work),
                // no more than the votes need (four a thread in a 16-byte load).
                let per_block = u64::from(if rule == 0 { 4 * BLOCK } else { BLOCK });
                let most = u64::from(q.gpu.sm_count()).min(super::MAX_BLOCKS as u64);
                let blocks = n.div_ceil(per_block).clamp(1, most.max(1)) as u32;
                q.gpu.memset_zero(q.stream, m.ticket.device_ptr(), 16)?;
                let weights = m.weights.as_ref().map_or(0, |w| w.device_ptr());
                let args = Args::new()
                    .buf(&m.votes)
                    .ptr(weights)
                    .u64(n)
                    .u32(rule)
                    .f64(quorum)
                    .buf(&m.partials)
                    .buf(&m.ticket)
                    .ptr(m.words.device_ptr())
                    .u64(round);
                let guard = q.gpu.resident_guard();
                let mode = LaunchMode {
                    cooperative: true,
                    ..LaunchMode::default()
                };
                // SAFETY: agents_vote_serve(const u32* votes, const float* weights, u64 n, u32
                // rule, double quorum, double* partials, u64* ticket, u64* words, u64 served):
                // votes holds n (weights n too when rule is 1; unread and 0 otherwise),
                // partials 2 · MAX_BLOCKS >= 2 · blocks, the ticket two words zeroed just
                // before on this stream, words OUT + 8 mapped words; all live in `Served`,
                // which is freed only after the kernel has ended (or leaked). A cooperative
                // launch of at most one block an SM (the driver refuses a grid that cannot
                // all be resident), so every block reaches each round's ticket.
                unsafe { launch_with(q, f, blocks, BLOCK, 0, args, mode)? };
                // Launched: from here a failure must stop the kernel, not free its memory.
                Ok(match stream.record(&done) {
                    Ok(()) => Ok((
                        Running::Gpu {
                            done,
                            guard: Some(guard),
                        },
                        blocks,
                    )),
                    Err(e) => Err((e, guard)),
                })
            },
        )?;
        match started {
            Ok((running, blocks)) => {
                self.blocks = blocks;
                self.running = Some(running);
                Ok(())
            }
            Err((e, guard)) => {
                // No event to tell when it ends: stop it and leak what it may still touch.
                self.leak(Some(guard));
                Err(e)
            }
        }
    }

    /// Tells a kernel that cannot be waited for to stop, and leaks its memory and the
    /// device's resident mark (frees stay held back: safer than a kernel writing freed
    /// memory).
    fn leak(&mut self, guard: Option<ResidentGuard>) {
        if let Some(m) = self.served.take() {
            m.words.words()[CMD].store(STOP, Ordering::Release);
            std::mem::forget(m);
        }
        if let Some(g) = guard {
            std::mem::forget(g);
        }
        tracing::warn!("agents: a resident vote kernel could not be stopped; its memory leaks");
    }

    /// Asks the next round and waits (up to the timeout) for its decision words: the
    /// decision word, the yes weight and the total weight.
    fn round(&mut self) -> Result<[u64; 3]> {
        if self.running.is_none() {
            return Err(Error::InvalidArgument(
                "agents: the resident vote is stopped (restart it first)".into(),
            ));
        }
        let round = if self.round >= u64::from(u32::MAX) {
            1
        } else {
            self.round + 1
        };
        self.round = round;
        let served = self.served()?;
        let words = served.words.words();
        words[CMD].store(round, Ordering::Release);
        // The CPU backend's "kernel": the host counts now and writes the same words.
        let rule = self.rule;
        self.stream
            .run(served, |m| serve_on_host(m, rule, round), |_, _| Ok(()))?;
        let done = match &self.running {
            Some(Running::Gpu { done, .. }) => Some(done),
            _ => None,
        };
        let seen = wait_for(
            &words[OUT],
            |w| w >> 32 == round,
            self.timeout,
            || match done {
                // The kernel ended before answering: stopped behind our back, or failed.
                Some(e) => e.query(),
                None => Ok(false),
            },
        );
        match seen {
            Ok(w) => Ok([
                w,
                words[OUT + 1].load(Ordering::Relaxed),
                words[OUT + 2].load(Ordering::Relaxed),
            ]),
            Err(e) => Err(match e {
                Wait::TimedOut(ms) => Error::Timeout {
                    what: format!("the resident vote's round {round} (a hung kernel?)"),
                    after_ms: ms,
                },
                Wait::Ended => lost(&format!("its kernel ended before round {round}")),
                Wait::Failed(e) => e,
            }),
        }
    }

    /// Stops the kernel and waits (up to the timeout) for it to end; a no-op when stopped.
    /// A kernel that does not end in time is an error, and its memory is leaked.
    fn stop(&mut self) -> Result<()> {
        let Some(running) = self.running.take() else {
            return Ok(());
        };
        let Running::Gpu { done, mut guard } = running else {
            return Ok(());
        };
        if let Some(m) = &self.served {
            m.words.words()[CMD].store(STOP, Ordering::Release);
        }
        let t0 = Instant::now();
        loop {
            match done.query() {
                Ok(true) => {
                    drop(guard.take());
                    return Ok(());
                }
                Ok(false) if t0.elapsed() < self.timeout => std::thread::yield_now(),
                Ok(false) => {
                    self.leak(guard.take());
                    return Err(Error::Timeout {
                        what: "the resident vote's kernel to stop".into(),
                        after_ms: self.timeout.as_millis() as u64,
                    });
                }
                Err(e) => {
                    self.leak(guard.take());
                    return Err(e);
                }
            }
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        if let Err(e) = self.stop() {
            tracing::warn!("agents: stopping a resident vote on drop: {e}");
        }
    }
}

/// The CPU backend's round: the votes counted on the host, the words written as the kernel
/// writes them.
fn serve_on_host(m: &Served, rule: Rule, round: u64) -> Result<()> {
    let votes = m.votes.host_view()?;
    let tag = (round & 0xffff_ffff) << 32;
    let out = m.words.words();
    match rule {
        Rule::Majority => {
            let yes = votes.iter().filter(|&&v| v != 0).count() as u64;
            let passed = 2 * yes > votes.len() as u64;
            out[OUT].store(tag | u64::from(passed) << 31 | yes, Ordering::Release);
        }
        Rule::Quorum(q) => {
            let w = match &m.weights {
                Some(w) => w.host_view()?,
                None => &[],
            };
            let (mut yes, mut all) = (0.0f64, 0.0f64);
            for (&v, &w) in votes.iter().zip(w) {
                all += f64::from(w);
                if v != 0 {
                    yes += f64::from(w);
                }
            }
            let passed = all > 0.0 && yes >= q * all;
            out[OUT + 1].store(yes.to_bits(), Ordering::Relaxed);
            out[OUT + 2].store(all.to_bits(), Ordering::Relaxed);
            out[OUT].store(tag | u64::from(passed) << 31, Ordering::Release);
        }
    }
    Ok(())
}

/// Why [`wait_for`] gave up.
#[derive(Debug)]
enum Wait {
    TimedOut(u64),
    Ended,
    Failed(Error),
}

/// Spins until `word` satisfies `seen` (returning it), checking the clock and `ended` (true
/// once nothing will write the word) every few thousand spins; gives up after `timeout`.
fn wait_for(
    word: &std::sync::atomic::AtomicU64,
    seen: impl Fn(u64) -> bool,
    timeout: Duration,
    ended: impl Fn() -> Result<bool>,
) -> std::result::Result<u64, Wait> {
    let t0 = Instant::now();
    loop {
        for _ in 0..4096 {
            let w = word.load(Ordering::Acquire);
            if seen(w) {
                return Ok(w);
            }
            std::hint::spin_loop();
        }
        match ended() {
            Ok(false) => {}
            // A last look: it may have answered and then ended.
            Ok(true) => {
                let w = word.load(Ordering::Acquire);
                return if seen(w) { Ok(w) } else { Err(Wait::Ended) };
            }
            Err(e) => return Err(Wait::Failed(e)),
        }
        if t0.elapsed() >= timeout {
            return Err(Wait::TimedOut(timeout.as_millis() as u64));
        }
    }
}

fn lost(why: &str) -> Error {
    Error::InvalidArgument(format!("agents: the resident vote is gone ({why})"))
}

/// A majority vote served by a resident kernel: [`vote`](Self::vote) asks a round through
/// mapped memory and returns the decision (`2 · yes > voters`) as soon as the host sees it,
/// with no launch (see the module docs). It owns the votes ([`votes_mut`](Self::votes_mut)
/// to change them between votes). Stops when dropped.
///
/// ```
/// use warpdrive::agents::ResidentMajority;
/// use warpdrive::{Buffer, Device};
///
/// # fn main() -> warpdrive::Result<()> {
/// let stream = Device::cpu().new_stream()?;
/// let votes = Buffer::from_host(&stream, &[1u32, 0, 7, 0, 1])?;
/// let mut vote = ResidentMajority::start(&stream, votes)?;
/// let d = vote.vote()?;
/// assert_eq!((d.yes, d.voters, d.passed), (3, 5, true));
/// vote.votes_mut()?.copy_from_host(&stream, &[0, 0, 0, 0, 1])?;
/// assert!(!vote.vote()?.passed);
/// vote.stop()?;
/// assert!(vote.vote().is_err());
/// # Ok(())
/// # }
/// ```
#[derive(Debug)]
pub struct ResidentMajority {
    server: Server,
}

/// A weighted quorum served by a resident kernel, as [`ResidentMajority`]: each agent's
/// vote (u32, non-zero = yes) counts with its weight (f32); the proposal passes when the
/// yes weight is at least `quorum` (a fraction in 0..=1) of the total, the total above 0.
#[derive(Debug)]
pub struct ResidentQuorum {
    server: Server,
}

/// The methods both resident votes share.
macro_rules! resident_common {
    () => {
        /// Stops the kernel (waiting up to the timeout for it to end); a no-op when
        /// stopped. A kernel that does not end is an error and its memory is leaked.
        pub fn stop(&mut self) -> Result<()> {
            self.server.stop()
        }

        /// Starts the kernel again after [`stop`](Self::stop) (an error while it runs).
        pub fn restart(&mut self) -> Result<()> {
            self.server.start()
        }

        /// Whether the kernel is running (started and not stopped).
        pub fn is_running(&self) -> bool {
            self.server.running.is_some()
        }

        /// How long a vote or a stop waits before it is an error (2 s by default).
        pub fn set_timeout(&mut self, timeout: Duration) {
            self.server.timeout = timeout;
        }

        /// The votes, to change between votes (e.g. with `copy_from_host`, which returns
        /// once the copy is done). Work on another stream that writes them must have
        /// finished before the next [`vote`](Self::vote).
        pub fn votes_mut(&mut self) -> Result<&mut Buffer<u32>> {
            let m = self
                .server
                .served
                .as_mut()
                .ok_or_else(|| lost("its memory was leaked"))?;
            Ok(&mut m.votes)
        }

        /// Blocks of the resident kernel (one an SM at most; 0 on the CPU backend).
        pub fn blocks(&self) -> u32 {
            self.server.blocks
        }
    };
}

impl ResidentMajority {
    /// Starts a resident majority vote over `votes` (one per agent, non-zero = yes; fewer
    /// than 2³¹) on the stream's device, on a stream of its own. Refused while another
    /// resident kernel runs on the GPU.
    pub fn start(stream: &Stream, votes: Buffer<u32>) -> Result<ResidentMajority> {
        Ok(ResidentMajority {
            server: Server::new(stream, votes, None, Rule::Majority)?,
        })
    }

    /// One vote over the current votes: the decision as soon as the host sees it.
    pub fn vote(&mut self) -> Result<Decision> {
        let voters = self.server.served()?.votes.len() as u64;
        let [w, _, _] = self.server.round()?;
        Ok(Decision {
            yes: w & 0x7fff_ffff,
            voters,
            passed: (w >> 31) & 1 != 0,
        })
    }

    resident_common!();
}

impl ResidentQuorum {
    /// Starts a resident weighted quorum over `votes` and `weights` (one each per agent,
    /// fewer than 2³¹) against `quorum` (a fraction in 0..=1), as
    /// [`ResidentMajority::start`].
    pub fn start(
        stream: &Stream,
        votes: Buffer<u32>,
        weights: Buffer<f32>,
        quorum: f64,
    ) -> Result<ResidentQuorum> {
        if !(0.0..=1.0).contains(&quorum) {
            return Err(Error::InvalidArgument(format!(
                "agents: a quorum of {quorum} is not a fraction in 0..=1"
            )));
        }
        Ok(ResidentQuorum {
            server: Server::new(stream, votes, Some(weights), Rule::Quorum(quorum))?,
        })
    }

    /// One vote over the current votes and weights: the decision as soon as the host sees
    /// it.
    pub fn vote(&mut self) -> Result<QuorumDecision> {
        let [w, yes, all] = self.server.round()?;
        Ok(QuorumDecision {
            yes_weight: f64::from_bits(yes),
            total_weight: f64::from_bits(all),
            passed: (w >> 31) & 1 != 0,
        })
    }

    /// The weights, to change between votes (as [`votes_mut`](Self::votes_mut)).
    pub fn weights_mut(&mut self) -> Result<&mut Buffer<f32>> {
        let m = self
            .server
            .served
            .as_mut()
            .and_then(|m| m.weights.as_mut())
            .ok_or_else(|| lost("its memory was leaked"))?;
        Ok(m)
    }

    resident_common!();
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicU64;

    #[test]
    fn a_word_nobody_writes_times_out() {
        let w = AtomicU64::new(0);
        let t0 = Instant::now();
        let r = wait_for(&w, |v| v == 1, Duration::from_millis(50), || Ok(false));
        assert!(matches!(r, Err(Wait::TimedOut(50))), "{r:?}");
        assert!(t0.elapsed() < Duration::from_secs(5));
    }

    #[test]
    fn an_ended_writer_is_an_error_at_once() {
        let w = AtomicU64::new(0);
        let r = wait_for(&w, |v| v == 1, Duration::from_secs(60), || Ok(true));
        assert!(matches!(r, Err(Wait::Ended)), "{r:?}");
        w.store(1, Ordering::Release);
        let r = wait_for(&w, |v| v == 1, Duration::from_secs(60), || Ok(true));
        assert!(matches!(r, Ok(1)), "{r:?}");
    }
}
