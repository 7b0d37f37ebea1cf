//! A single vote across all agents: each agent's u32 (non-zero = yes), counted by warp
//! ballots, block sums and one last block that adds the blocks' counts in a fixed order and
//! writes the decision (a strict majority) — one kernel, no contended atomics (one ticket
//! per block, not per agent). The decision lands in mapped host memory with the vote's
//! round number written last, so the host sees it by polling one word, with no copy.

use std::sync::atomic::Ordering;

use crate::device::{SharedWords, Stream};
use crate::error::{Error, Result};
use crate::kernels::AGENTS;
use crate::memory::Buffer;
use crate::ops::{fill_grid, launch, Args};

/// Blocks of the vote kernel at most (its partials hold one count per block).
pub const MAX_BLOCKS: usize = 4096;

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
/// the decision (`[yes, passed, round]`) in mapped host memory (plain host memory on the CPU
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
        })
    }

    /// Counts `votes` (one per agent, non-zero = yes) and writes the decision on the device.
    pub fn run(&mut self, stream: &Stream, votes: &Buffer<u32>) -> Result<()> {
        votes.check_stream(stream, "agents vote")?;
        let n = votes.len();
        self.voters = n as u64;
        self.round = self.round.wrapping_add(1).max(1);
        let round = self.round;
        stream.run(
            self,
            |m| {
                let yes = votes.host_view()?.iter().filter(|&&v| v != 0).count() as u64;
                let out = m.out.words();
                out[0].store(yes, Ordering::Relaxed);
                out[1].store(u64::from(2 * yes > n as u64), Ordering::Relaxed);
                out[2].store(round, Ordering::Release);
                Ok(())
            },
            |m, q| {
                let grid = fill_grid(q.gpu, (&AGENTS, "agents_vote"), n as u64, 256)?
                    .min(MAX_BLOCKS as u32);
                let args = Args::new()
                    .buf(votes)
                    .u64(n as u64)
                    .buf(&m.partials)
                    .buf(&m.ticket)
                    .ptr(m.out.device_ptr())
                    .u64(round);
                // SAFETY: agents_vote(const u32* votes, u64 n, u64* partials, u32* ticket,
                // volatile u64* out, u64 round) with blocks of 256: votes holds n, partials
                // MAX_BLOCKS >= grid, the ticket one word (zero: zeroed at creation, set back to
                // zero by each vote's last block), out 3 mapped words that live as long as self.
                unsafe { launch(q, (&AGENTS, "agents_vote"), grid, 256, 0, args) }
            },
        )
    }

    /// The last vote's decision, as soon as the host sees it in mapped memory: polls the
    /// round word (no copy, no stream wait); after many polls without it, waits for the
    /// stream (which reports a failed kernel) and reads once more.
    pub fn decision(&self, stream: &Stream) -> Result<Decision> {
        let words = self.out.words();
        let seen = |w: &[std::sync::atomic::AtomicU64]| w[2].load(Ordering::Acquire) == self.round;
        let mut ready = seen(words);
        let mut spins = 0u32;
        while !ready && spins < 1 << 16 {
            std::hint::spin_loop();
            spins += 1;
            ready = seen(words);
        }
        if !ready {
            stream.synchronize()?;
            if !seen(words) {
                return Err(Error::InvalidArgument(format!(
                    "agents: vote round {} has no decision after its stream finished \
                     (no vote run on this stream?)",
                    self.round
                )));
            }
        }
        Ok(Decision {
            yes: words[0].load(Ordering::Relaxed),
            voters: self.voters,
            passed: words[1].load(Ordering::Relaxed) != 0,
        })
    }
}
