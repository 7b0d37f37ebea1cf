//! A single vote across all agents: each agent's u32 (non-zero = yes), counted by warp
//! ballots, block sums and one last block that adds the blocks' counts in a fixed order and
//! writes the decision (a strict majority) — one kernel, no contended atomics (one ticket
//! per block, not per agent).

use crate::device::Stream;
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

/// A majority vote's device state: per-block counts, the last block's ticket and the
/// decision (`[yes, passed]`), allocated once so a vote allocates nothing (and can be
/// captured in a graph).
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
    out: Buffer<u64>,
    voters: u64,
}

impl Majority {
    /// The vote's buffers on the stream's device.
    pub fn new(stream: &Stream) -> Result<Majority> {
        Ok(Majority {
            partials: Buffer::zeros(stream, MAX_BLOCKS)?,
            ticket: Buffer::zeros(stream, 1)?,
            out: Buffer::zeros(stream, 2)?,
            voters: 0,
        })
    }

    /// Counts `votes` (one per agent, non-zero = yes) and writes the decision on the device.
    pub fn run(&mut self, stream: &Stream, votes: &Buffer<u32>) -> Result<()> {
        votes.check_stream(stream, "agents vote")?;
        let n = votes.len();
        self.voters = n as u64;
        stream.run(
            self,
            |m| {
                let yes = votes.host_view()?.iter().filter(|&&v| v != 0).count() as u64;
                let out = m.out.host_view_mut()?;
                out[0] = yes;
                out[1] = u64::from(2 * yes > n as u64);
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
                    .buf(&m.out);
                // SAFETY: agents_vote(const u32* votes, u64 n, u64* partials, u32* ticket, u64*
                // out) with blocks of 256: votes holds n, partials MAX_BLOCKS >= grid, the ticket
                // one word (zero: zeroed at creation, set back to zero by each vote's last
                // block), out 2.
                unsafe { launch(q, (&AGENTS, "agents_vote"), grid, 256, 0, args) }
            },
        )
    }

    /// The last vote's decision, copied to the host (waits for the stream).
    pub fn decision(&self, stream: &Stream) -> Result<Decision> {
        let out = self.out.to_host(stream)?;
        match out[..] {
            [yes, passed] => Ok(Decision {
                yes,
                voters: self.voters,
                passed: passed != 0,
            }),
            _ => Err(Error::InvalidArgument(
                "agents: the vote's result buffer lost its length (a bug)".into(),
            )),
        }
    }
}
