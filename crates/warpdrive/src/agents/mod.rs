//! GPU agents: populations of agents whose state lives on the device as structure-of-arrays
//! fields, stepped by kernels, with spatial messages, birth and death, and votes across all
//! agents.
//!
//! - [`Population`]: named f32 / u32 fields, one [`Buffer`](crate::Buffer) each, from host
//!   vectors and back; a field whose length is not the population's is an error.
//! - [`StepFn`]: one agent's update as a CUDA C body (NVRTC at run time, cached as PTX and
//!   cubin on disk) and a Rust closure of the same meaning for the CPU backend; a body that
//!   does not compile gives `Error::Compile` with NVRTC's log.
//! - [`SpatialGrid`]: spatial messages in a uniform grid rebuilt each step by a counting sort
//!   (bin count, exclusive scan, scatter), as FLAME GPU 2's `MessageSpatial3D`.
//! - [`Circles`]: FLAME GPU 2's Circles benchmark model on that grid (what was matched: the
//!   `circles` module's docs).
//! - [`Majority`]: a single vote, warp ballots and block sums in one kernel, the decision
//!   written to mapped host memory (the host polls one word for it, no copy); [`Quorum`]: a
//!   weighted vote; [`Averaging`]: iterative averaging to a tolerance, every round enqueued
//!   at once.
//! - [`ResidentMajority`], [`ResidentQuorum`]: the same votes served by a kernel that stays
//!   resident between votes (one block an SM), signalled by a round number in mapped memory:
//!   no launch a vote; stop / restart, every wait timed.
//! - [`Population::apply_life`]: birth and death after a step (a stream compaction: survivors
//!   in order, then each parent's children), counts exact on both backends.
//! - [`submit`]: a job from host fields to its first step in one call, timed by stage
//!   ([`StepFn::load_fresh`] times what a new process pays to load a step).
//!
//! - [`StepInputs`]: what a step reads besides its fields: brute-force messages (a snapshot
//!   of fields), a graph's edges (CSR), any read-only array.
//!
//! - [`StepFn::run_steps`]: many steps in one persistent cooperative kernel (a grid-wide
//!   barrier between steps), refused while resident actors run on the GPU.
//!
//! - [`TieredPopulation`]: a population over a GPU tier and a pinned-host tier under a
//!   [`TierBudget`] (the seed's 64 k GPU / 200 k CPU pool): agents beyond the GPU budget are
//!   parked in page-locked host memory, [`StepFn::run_tiered`] steps them all (the parked
//!   ones streamed through the GPU in chunks, copies overlapping kernels on two streams,
//!   the same result as one population), [`TieredPopulation::set_budget`] parks and
//!   unparks, [`TieredPopulation::apply_life`] is birth and death over both tiers; a
//!   population beyond the budgets is an error naming the excess.
//!
//! Not yet: Circles in one persistent kernel.
//!
//! ```
//! use warpdrive::agents::{Circles, CirclesConfig, Majority};
//! use warpdrive::Device;
//!
//! # fn main() -> warpdrive::Result<()> {
//! let stream = Device::cpu().new_stream()?;
//! let mut sim = Circles::new(&stream, CirclesConfig::new(4096, 1))?;
//! sim.step(&stream)?;
//! // About 27 bins of 8 unit volumes at density 1 around each agent, fewer at the faces.
//! let per_agent = sim.messages_read().unwrap_or(0) as f64 / 4096.0;
//! assert!(per_agent > 100.0 && per_agent < 216.0);
//! let mut vote = Majority::new(&stream)?;
//! let votes = warpdrive::Buffer::from_host(&stream, &[1u32; 10])?;
//! vote.run(&stream, &votes)?;
//! assert!(vote.decision(&stream)?.passed);
//! # Ok(())
//! # }
//! ```

mod circles;
mod consensus;
mod grid;
mod inputs;
mod life;
mod population;
mod resident;
mod step;
mod submit;
mod tiered;
mod tiered_move;
mod tiered_step;

pub use circles::{Circles, CirclesConfig, MoveKernel, RADIUS, REPULSE};
pub use consensus::{
    Averaging, AveragingOutcome, Decision, Majority, Quorum, QuorumDecision, MAX_BLOCKS,
};
pub use grid::{GridShape, SpatialGrid, MAX_DIM};
pub use inputs::StepInputs;
pub use life::LifeCounts;
pub use population::{FieldKind, Population};
pub use resident::{ResidentMajority, ResidentQuorum};
pub use step::{HostFields, StepFn, MAX_PARAMS};
pub use submit::{submit, HostField, Submission, SubmitTimes};
pub use tiered::{TierBudget, TieredPopulation, DEFAULT_CHUNK};
