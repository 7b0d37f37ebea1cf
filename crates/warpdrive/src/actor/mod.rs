//! Persistent GPU actors: handlers that live in one resident kernel and answer messages
//! host threads put in rings, at the speed of a doorbell.
//!
//! ```text
//! host threads ──send──▶ inbox rings (mapped host memory, one per priority lane)
//!                               │  the resident loop: one warp per actor polls its lanes,
//!                               ▼  takes up to `batch` messages, runs the handler on each
//! host threads ◀──recv── outbox ring (mapped host memory)  or  the next actor's ring
//!                                                              (device memory)
//! ```
//!
//! **One resident kernel hosts every actor of a system**: separate never-ending kernels are
//! not guaranteed to run at the same time, so a pipeline of actors in several kernels could
//! deadlock. The kernel is launched cooperatively (all its blocks resident at once, or the
//! launch fails with an error), one 32-thread block per actor, on a stream of its own; the
//! rest of the GPU stays free for other work. Before it starts, every kernel warpdrive has is
//! loaded eagerly (a lazily loaded kernel may wait for an idle device), and while it runs the
//! device floor holds frees back and refuses a device-wide synchronize (see
//! `device/cuda/resident.rs`).
//!
//! **Handlers.** On CUDA a handler is CUDA C: the spec's source defines `struct In`,
//! `struct Out`, `struct State` and `__device__ void handle(const In*, Out*, State*,
//! ActorCtx*)`; each actor's source is compiled into the loop in a namespace of its own
//! (NVRTC, cached like every kernel; a source that does not compile is an error with NVRTC's
//! log). The handlers of an actor with state run on one thread in message order; those of
//! an actor without state (`S = ()`: a handler is then a function of its message) run one
//! message per thread of the actor's warp. On the CPU backend the same actor runs a Rust
//! closure of the same meaning, on a host thread that plays the loop: the reference the GPU
//! handler is tested against.
//!
//! **Lifecycle.** [`ActorSystem::spawn`] (before [`ActorSystem::start`]) → `start` launches
//! the loop with every actor inactive → [`Actor::activate`] / [`Actor::deactivate`] →
//! [`ActorSystem::terminate`] (or drop). Liveness both ways: the loop bumps a beat the
//! system's watcher thread checks (a loop that stops beating is reported and every call
//! fails), and the watcher bumps a beat the loop checks (a host that stops beating for
//! `park_after` makes the loop park its actors until it beats again).
//!
//! **Queues.** Each message gets a sequence number per lane and a correlation id; `request`
//! matches its reply by the id. Higher lanes are served first, and a waiting lower lane gets
//! at least one message in every `starvation_limit`. Backpressure is [`Backpressure`]:
//! block with a timeout, reject, or drop the oldest (counted) — never silent.

mod cpu_loop;
mod gpu_loop;
mod host;
pub mod probe;
mod ring;
mod spec;
mod system;

pub use spec::{ActorCtx, ActorSpec, Backpressure};
pub use system::{Actor, ActorStats, ActorSystem, Reply, ReplyFuture, SystemConfig};

/// Largest message (`In` or `Out`) an actor takes, in bytes.
pub const MAX_MESSAGE_BYTES: usize = 256;
/// Most priority lanes an actor has.
pub const MAX_LANES: usize = 4;
/// Smallest and largest inbox capacity (a power of two).
pub const CAPACITY_RANGE: (usize, usize) = (16, 1 << 20);
/// Largest batch the loop takes per iteration.
pub const MAX_BATCH: usize = 256;
