//! A single vote across all agents: each agent's u32 (non-zero = yes), counted by warp
//! ballots, block sums and one last block that adds the blocks' counts in a fixed order and
//! writes the decision (a strict majority) — one kernel, no contended atomics (one ticket
//! per block, not per agent). The decision lands in mapped host memory with the vote's
//! round number written last, so the host sees it by polling one word, with no copy.

use std::sync::atomic::{AtomicU64, Ordering};

use crate::device::{SharedWords, Stream};
use crate::error::{Error, Result};
use crate::kernels::AGENTS;
use crate::memory::Buffer;
use crate::ops::{fill_grid, launch, Args};

/// Blocks of the vote kernel at most (its partials hold one count per block).
pub const MAX_BLOCKS: usize = 4096;

/// Votes of fewer voters than this publish their decision as one packed word (see
/// [`packed_decision`]); larger ones as `[yes, passed, round]` behind a system fence.
const PACKED_VOTERS: u64 = 1 << 31;

/// The majority vote's one-word decision: the round's low 32 bits, then whether it passed
/// (bit 31), then the yes count (bits 0-30). One 8-byte store is single-copy atomic, so the
/// kernel needs no system-scope fence before it (a PCIe round trip on the host's path).
fn packed_decision(round: u64, passed: bool, yes: u64) -> u64 {
    (round & 0xffff_ffff) << 32 | u64::from(passed) << 31 | (yes & 0x7fff_ffff)
}

/// The outcome of a vote.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Decision {
    /// Yes votes.
    pub yes: u64,
    /// Voters.
    pub voters: u64,
    /// Whether the yes votes are a strict majority (`2 · yes > voters`).
    pub passed: bool,
}

/// A majority vote's state: per-block counts and the last block's ticket on the device, and
/// the decision (`[yes, passed, round]`, or one packed word in the third for fewer than
/// 2³¹ voters) in mapped host memory (plain host memory on the CPU
/// backend); allocated once, so a vote allocates nothing.
///
/// ```
/// use warpdrive::agents::Majority;
/// use warpdrive::{Buffer, Device};
///
/// # fn main() -> warpdrive::Result<()> {
/// let stream = Device::cpu().new_stream()?;
/// let votes = Buffer::from_host(&stream, &[1u32, 0, 7, 0, 1])?;
/// let mut vote = Majority::new(&stream)?;
/// vote.run(&stream, &votes)?;
/// let d = vote.decision(&stream)?;
/// assert_eq!((d.yes, d.voters, d.passed), (3, 5, true));
/// # Ok(())
/// # }
/// ```
#[derive(Debug)]
pub struct Majority {
    partials: Buffer<u64>,
    ticket: Buffer<u32>,
    out: SharedWords,
    voters: u64,
    round: u64,
    /// Whether votes of fewer than 2³¹ voters publish the packed word (the default).
    packed: bool,
    /// Whether the last vote published the packed word.
    sent_packed: bool,
}

impl Majority {
    /// The vote's buffers on the stream's device.
    pub fn new(stream: &Stream) -> Result<Majority> {
        Ok(Majority {
            partials: Buffer::zeros(stream, MAX_BLOCKS)?,
            ticket: Buffer::zeros(stream, 1)?,
            out: stream.device().shared_words(3)?,
            voters: 0,
            round: 0,
            packed: true,
            sent_packed: false,
        })
    }

    /// Whether the decision is published as one packed word when it fits (the default), or
    /// always as three words behind a system-scope fence (the earlier way, kept to compare).
    pub fn set_packed(&mut self, packed: bool) {
        self.packed = packed;
    }

    /// Whether the decision goes out as one packed word when it fits.
    fn packs(&self) -> bool {
        self.packed && self.voters < PACKED_VOTERS
    }

    /// Counts `votes` (one per agent, non-zero = yes) and writes the decision on the device.
    pub fn run(&mut self, stream: &Stream, votes: &Buffer<u32>) -> Result<()> {
        votes.check_stream(stream, "agents vote")?;
        let n = votes.len();
        self.voters = n as u64;
        self.round = self.round.wrapping_add(1).max(1);
        let round = self.round;
        let packs = self.packs();
        self.sent_packed = packs;
        stream.run(
            self,
            |m| {
                let yes = votes.host_view()?.iter().filter(|&&v| v != 0).count() as u64;
                let out = m.out.words();
                let passed = 2 * yes > n as u64;
                if packs {
                    out[2].store(packed_decision(round, passed, yes), Ordering::Release);
                } else {
                    out[0].store(yes, Ordering::Relaxed);
                    out[1].store(u64::from(passed), Ordering::Relaxed);
                    out[2].store(round, Ordering::Release);
                }
                Ok(())
            },
            |m, q| {
                // Four 16-byte vectors of four votes a thread: a quarter of the blocks one
                // vector a thread takes, so a quarter of the tickets on the one counter.
                let vectors = (n as u64).div_ceil(4);
                let grid = fill_grid(q.gpu, (&AGENTS, "agents_vote"), vectors, 4 * 256)?
                    .min(MAX_BLOCKS as u32);
                let args = Args::new()
                    .buf(votes)
                    .u64(n as u64)
                    .buf(&m.partials)
                    .buf(&m.ticket)
                    .ptr(m.out.device_ptr())
                    .u64(round)
                    .u32(u32::from(packs));
                // SAFETY: agents_vote(const u32* votes, u64 n, u64* partials, u32* ticket,
                // volatile u64* out, u64 round, u32 packed) with blocks of 256: votes holds n, partials
                // MAX_BLOCKS >= grid, the ticket one word (zero: zeroed at creation, set back to
                // zero by each vote's last block), out 3 mapped words that live as long as self
                // (8-byte aligned: the packed word is one store).
                unsafe { launch(q, (&AGENTS, "agents_vote"), grid, 256, 0, args) }
            },
        )
    }

    /// The last vote's decision, as soon as the host sees it in mapped memory: polls the
    /// round word (no copy, no stream wait); after many polls without it, waits for the
    /// stream (which reports a failed kernel) and reads once more.
    pub fn decision(&self, stream: &Stream) -> Result<Decision> {
        if self.sent_packed {
            let tag = self.round & 0xffff_ffff;
            let words = seen(&self.out, 2, |w| w >> 32 == tag, self.round, stream)?;
            let w = words[2].load(Ordering::Acquire);
            return Ok(Decision {
                yes: w & 0x7fff_ffff,
                voters: self.voters,
                passed: (w >> 31) & 1 != 0,
            });
        }
        let words = seen_round(&self.out, 2, self.round, stream)?;
        Ok(Decision {
            yes: words[0].load(Ordering::Relaxed),
            voters: self.voters,
            passed: words[1].load(Ordering::Relaxed) != 0,
        })
    }
}

/// The words of `out` once word `at` holds `round` (the kernel writes it last, after a
/// system-wide fence): polls it, then after many polls waits for the stream (which reports
/// a failed kernel) and looks once more.
fn seen_round<'w>(
    out: &'w SharedWords,
    at: usize,
    round: u64,
    stream: &Stream,
) -> Result<&'w [AtomicU64]> {
    seen(out, at, |w| w == round, round, stream)
}

/// As [`seen_round`], with word `at` tested by `done`.
fn seen<'w>(
    out: &'w SharedWords,
    at: usize,
    done: impl Fn(u64) -> bool,
    round: u64,
    stream: &Stream,
) -> Result<&'w [AtomicU64]> {
    let words = out.words();
    let seen = || done(words[at].load(Ordering::Acquire));
    let mut spins = 0u32;
    while !seen() && spins < 1 << 16 {
        std::hint::spin_loop();
        spins += 1;
    }
    if !seen() {
        stream.synchronize()?;
        if !seen() {
            return Err(Error::InvalidArgument(format!(
                "agents: round {round} has no result after its stream finished (nothing run \
                 on this stream?)"
            )));
        }
    }
    Ok(words)
}

/// The outcome of a weighted vote.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct QuorumDecision {
    /// The weight of the yes votes.
    pub yes_weight: f64,
    /// The weight of every voter.
    pub total_weight: f64,
    /// Whether `yes_weight >= quorum · total_weight` (and the total is above 0).
    pub passed: bool,
}

/// A weighted quorum: each agent's vote (u32, non-zero = yes) counts with its weight (f32),
/// and the proposal passes when the yes weight reaches a fraction of the total. One kernel
/// (block sums in f64, the last block adds them in block order), the decision in mapped
/// host memory as for [`Majority`]; allocated once.
///
/// ```
/// use warpdrive::agents::Quorum;
/// use warpdrive::{Buffer, Device};
///
/// # fn main() -> warpdrive::Result<()> {
/// let stream = Device::cpu().new_stream()?;
/// let votes = Buffer::from_host(&stream, &[1u32, 0, 1])?;
/// let weights = Buffer::from_host(&stream, &[3.0f32, 5.0, 1.0])?;
/// let mut vote = Quorum::new(&stream)?;
/// vote.run(&stream, &votes, &weights, 0.5)?;
/// let d = vote.decision(&stream)?;
/// assert_eq!((d.yes_weight, d.total_weight, d.passed), (4.0, 9.0, false));
/// # Ok(())
/// # }
/// ```
#[derive(Debug)]
pub struct Quorum {
    partials: Buffer<f64>,
    ticket: Buffer<u32>,
    out: SharedWords,
    round: u64,
}

impl Quorum {
    /// The vote's buffers on the stream's device.
    pub fn new(stream: &Stream) -> Result<Quorum> {
        Ok(Quorum {
            partials: Buffer::zeros(stream, 2 * MAX_BLOCKS)?,
            ticket: Buffer::zeros(stream, 1)?,
            out: stream.device().shared_words(4)?,
            round: 0,
        })
    }

    /// Weighs `votes` by `weights` (one each per agent) against `quorum` (a fraction in
    /// 0..=1) and writes the decision on the device.
    pub fn run(
        &mut self,
        stream: &Stream,
        votes: &Buffer<u32>,
        weights: &Buffer<f32>,
        quorum: f64,
    ) -> Result<()> {
        votes.check_stream(stream, "agents quorum")?;
        weights.check_stream(stream, "agents quorum")?;
        crate::memory::check_len("agents quorum (weights)", weights.len(), votes.len())?;
        if !(0.0..=1.0).contains(&quorum) {
            return Err(Error::InvalidArgument(format!(
                "agents: a quorum of {quorum} is not a fraction in 0..=1"
            )));
        }
        let n = votes.len();
        self.round = self.round.wrapping_add(1).max(1);
        let round = self.round;
        stream.run(
            self,
            |m| {
                let (v, w) = (votes.host_view()?, weights.host_view()?);
                let (mut yes, mut all) = (0.0f64, 0.0f64);
                for (&v, &w) in v.iter().zip(w) {
                    all += f64::from(w);
                    if v != 0 {
                        yes += f64::from(w);
                    }
                }
                let out = m.out.words();
                out[0].store(yes.to_bits(), Ordering::Relaxed);
                out[1].store(all.to_bits(), Ordering::Relaxed);
                out[2].store(
                    u64::from(all > 0.0 && yes >= quorum * all),
                    Ordering::Relaxed,
                );
                out[3].store(round, Ordering::Release);
                Ok(())
            },
            |m, q| {
                let grid = fill_grid(q.gpu, (&AGENTS, "agents_quorum"), n as u64, 256)?
                    .min(MAX_BLOCKS as u32);
                let args = Args::new()
                    .buf(votes)
                    .buf(weights)
                    .u64(n as u64)
                    .f64(quorum)
                    .buf(&m.partials)
                    .buf(&m.ticket)
                    .ptr(m.out.device_ptr())
                    .u64(round);
                // SAFETY: agents_quorum(const u32* votes, const float* weights, u64 n, double
                // quorum, double* partials, u32* ticket, volatile u64* out, u64 round), blocks
                // of 256: votes and weights hold n (checked), partials 2 · MAX_BLOCKS >= 2 ·
                // grid, the ticket one zeroed word (reset by each vote's last block), out 4
                // mapped words that live as long as self.
                unsafe { launch(q, (&AGENTS, "agents_quorum"), grid, 256, 0, args) }
            },
        )
    }

    /// The last vote's decision, as soon as the host sees it (as [`Majority::decision`]).
    pub fn decision(&self, stream: &Stream) -> Result<QuorumDecision> {
        let words = seen_round(&self.out, 3, self.round, stream)?;
        Ok(QuorumDecision {
            yes_weight: f64::from_bits(words[0].load(Ordering::Relaxed)),
            total_weight: f64::from_bits(words[1].load(Ordering::Relaxed)),
            passed: words[2].load(Ordering::Relaxed) != 0,
        })
    }
}

/// Where an [`Averaging`] run ended.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AveragingOutcome {
    /// Update rounds applied.
    pub rounds: u64,
    /// The values' mean (the updates keep it).
    pub mean: f64,
    /// The largest distance of a value from the mean, when last measured.
    pub spread: f64,
    /// Whether the spread reached the tolerance within the rounds allowed.
    pub converged: bool,
}

/// Iterative averaging to a tolerance: each round every agent moves its value toward the
/// mean (`x += rate · (mean − x)`) until every value is within `tolerance` of it. All
/// rounds are enqueued at once — a measuring kernel (block sums, the last block decides)
/// and an updating kernel a round, both idle once converged — so no round waits for the
/// host; the outcome lands in mapped host memory. Allocated once.
///
/// ```
/// use warpdrive::agents::Averaging;
/// use warpdrive::{Buffer, Device};
///
/// # fn main() -> warpdrive::Result<()> {
/// let stream = Device::cpu().new_stream()?;
/// let mut x = Buffer::from_host(&stream, &[0.0f32, 4.0, 8.0])?;
/// let mut avg = Averaging::new(&stream)?;
/// avg.run(&stream, &mut x, 0.5, 0.01, 100)?;
/// let o = avg.outcome(&stream)?;
/// assert!(o.converged && o.spread <= 0.01 && o.mean == 4.0);
/// # Ok(())
/// # }
/// ```
#[derive(Debug)]
pub struct Averaging {
    partials: Buffer<f64>,
    ticket: Buffer<u32>,
    state: Buffer<u64>,
    out: SharedWords,
    round: u64,
}

impl Averaging {
    /// The run's buffers on the stream's device.
    pub fn new(stream: &Stream) -> Result<Averaging> {
        Ok(Averaging {
            partials: Buffer::zeros(stream, 3 * MAX_BLOCKS)?,
            ticket: Buffer::zeros(stream, 1)?,
            state: Buffer::zeros(stream, 4)?,
            out: stream.device().shared_words(5)?,
            round: 0,
        })
    }

    /// Enqueues up to `max_rounds` rounds over `x` with step `rate` (in (0, 1]) until the
    /// spread is at most `tolerance` (≥ 0). Read the outcome with
    /// [`outcome`](Self::outcome).
    pub fn run(
        &mut self,
        stream: &Stream,
        x: &mut Buffer<f32>,
        rate: f32,
        tolerance: f32,
        max_rounds: u32,
    ) -> Result<()> {
        x.check_stream(stream, "agents averaging")?;
        let rate_ok = rate > 0.0 && rate <= 1.0;
        if !rate_ok || tolerance.is_nan() || tolerance < 0.0 {
            return Err(Error::InvalidArgument(format!(
                "agents: averaging needs a rate in (0, 1] and a tolerance >= 0, not {rate} and \
                 {tolerance}"
            )));
        }
        let n = x.len();
        let first = self.round.wrapping_add(1).max(1);
        // One published round per measuring kernel: max_rounds + 1 of them.
        self.round = first.wrapping_add(u64::from(max_rounds));
        let last = self.round;
        stream.run(
            (&mut *self, x),
            |(m, x)| {
                let v = x.host_view_mut()?;
                let (mut updates, mut mean, mut spread, mut done) = (0u64, 0.0, 0.0, false);
                for _ in 0..=max_rounds {
                    (mean, spread) = measure(v);
                    done = spread <= f64::from(tolerance);
                    if done || updates == u64::from(max_rounds) {
                        break;
                    }
                    let to = mean as f32;
                    for e in v.iter_mut() {
                        *e += rate * (to - *e);
                    }
                    updates += 1;
                }
                let out = m.out.words();
                out[0].store(updates, Ordering::Relaxed);
                out[1].store(mean.to_bits(), Ordering::Relaxed);
                out[2].store(spread.to_bits(), Ordering::Relaxed);
                out[3].store(u64::from(done), Ordering::Relaxed);
                out[4].store(last, Ordering::Release);
                Ok(())
            },
            |(m, x), q| {
                m.state.check_stream(stream, "agents averaging")?;
                q.gpu.memset_zero(q.stream, m.state.device_ptr(), 32)?;
                let measure = (&AGENTS, "agents_avg_measure");
                let update = (&AGENTS, "agents_avg_update");
                let grid = fill_grid(q.gpu, measure, n as u64, 256)?.min(MAX_BLOCKS as u32);
                for r in 0..=u64::from(max_rounds) {
                    let args = Args::new()
                        .buf(x)
                        .u64(n as u64)
                        .f64(f64::from(tolerance))
                        .buf(&m.partials)
                        .buf(&m.ticket)
                        .buf(&m.state)
                        .ptr(m.out.device_ptr())
                        .u64(first.wrapping_add(r));
                    // SAFETY: agents_avg_measure(const float* x, u64 n, double tol, double*
                    // partials, u32* ticket, u64* state, volatile u64* out, u64 round), blocks
                    // of 256: x holds n, partials 3 · MAX_BLOCKS >= 3 · grid, the ticket one
                    // word reset by each last block, state 4 zeroed words, out 5 mapped
                    // words, all living as long as self (x is borrowed for the call, and its
                    // pool reuses it only after this stream's work).
                    unsafe { launch(q, measure, grid, 256, 0, args)? };
                    if r == u64::from(max_rounds) {
                        break;
                    }
                    let args = Args::new().buf(x).u64(n as u64).f32(rate).buf(&m.state);
                    // SAFETY: agents_avg_update(float* x, u64 n, float rate, u64* state):
                    // as above.
                    unsafe { launch(q, update, grid, 256, 0, args)? };
                }
                Ok(())
            },
        )
    }

    /// The last run's outcome, as soon as the host sees it in mapped memory.
    pub fn outcome(&self, stream: &Stream) -> Result<AveragingOutcome> {
        let words = seen_round(&self.out, 4, self.round, stream)?;
        Ok(AveragingOutcome {
            rounds: words[0].load(Ordering::Relaxed),
            mean: f64::from_bits(words[1].load(Ordering::Relaxed)),
            spread: f64::from_bits(words[2].load(Ordering::Relaxed)),
            converged: words[3].load(Ordering::Relaxed) != 0,
        })
    }
}

/// The mean (f64 sum) and the spread `max(max − mean, mean − min)` of `v`; (0, 0) when empty.
fn measure(v: &[f32]) -> (f64, f64) {
    if v.is_empty() {
        return (0.0, 0.0);
    }
    let sum: f64 = v.iter().map(|&e| f64::from(e)).sum();
    let mean = sum / v.len() as f64;
    let (lo, hi) = v
        .iter()
        .fold((f32::INFINITY, f32::NEG_INFINITY), |(lo, hi), &e| {
            (lo.min(e), hi.max(e))
        });
    (mean, (f64::from(hi) - mean).max(mean - f64::from(lo)))
}
