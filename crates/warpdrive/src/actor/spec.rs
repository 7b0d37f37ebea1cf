//! What an actor is: its handler (CUDA C and a Rust closure of the same meaning), its
//! queue's shape and its backpressure policy.

use std::time::Duration;

use bytemuck::Pod;

use super::{CAPACITY_RANGE, MAX_BATCH, MAX_LANES, MAX_MESSAGE_BYTES};
use crate::error::{Error, Result};

/// What a handler learns about the message it handles, and how it answers. The CUDA
/// handler gets the same struct (`ActorCtx` in the loop's source).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ActorCtx {
    /// The actor's index in its system.
    pub actor: u32,
    /// The lane the message came in on (0 for messages from the previous actor).
    pub lane: u32,
    /// The message's correlation id (copied into the reply).
    pub correlation: u32,
    /// 1 (the default): the handler's `Out` is sent on; set to 0 to send nothing.
    pub reply: u32,
    /// Messages this actor handled before this one.
    pub seq: u64,
    /// The loop's clock in nanoseconds (`%globaltimer` on CUDA).
    pub now_ns: u64,
}

/// What a full inbox does to a sender.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backpressure {
    /// Wait for room, up to `timeout`, then fail with `Error::Timeout`.
    Block { timeout: Duration },
    /// Fail at once with `Error::QueueFull` (counted in `ActorStats::rejected`).
    Reject,
    /// Overwrite the oldest waiting message; the loop counts each one it never saw
    /// (`ActorStats::dropped`).
    DropOldest,
}

impl Default for Backpressure {
    fn default() -> Self {
        Backpressure::Block {
            timeout: Duration::from_secs(5),
        }
    }
}

/// A host handler of messages as bytes (the typed closure behind it).
pub(crate) type HostFn = Box<dyn FnMut(&[u8], &mut [u8], &mut [u8], &mut ActorCtx) + Send>;

/// A typed host handler.
type TypedHostFn<In, Out, S> = Box<dyn FnMut(&In, &mut Out, &mut S, &mut ActorCtx) + Send>;

/// An actor to spawn: `In → Out` messages (plain data, at most 256 bytes each) with state
/// `S`.
pub struct ActorSpec<In, Out, S = ()> {
    pub(crate) name: String,
    pub(crate) cuda: Option<String>,
    pub(crate) host: Option<TypedHostFn<In, Out, S>>,
    pub(crate) capacity: usize,
    pub(crate) lanes: usize,
    pub(crate) batch: usize,
    pub(crate) backpressure: Backpressure,
    pub(crate) starvation_limit: u32,
    pub(crate) state: S,
    pub(crate) forward_to: Option<usize>,
    pub(crate) quick_stream: bool,
    pub(crate) wide_window: bool,
    pub(crate) tail_hint: bool,
}

impl<In: Pod, Out: Pod, S: Pod> ActorSpec<In, Out, S> {
    /// An actor named `name` (in errors, telemetry and the trace) with state `state`, one
    /// lane of 4096 messages, batches of up to 32, `Block` for 5 s, and no handler yet.
    pub fn new(name: impl Into<String>, state: S) -> Self {
        ActorSpec {
            name: name.into(),
            cuda: None,
            host: None,
            capacity: 4096,
            lanes: 1,
            batch: 32,
            backpressure: Backpressure::default(),
            starvation_limit: 8,
            state,
            forward_to: None,
            quick_stream: true,
            wide_window: true,
            tail_hint: true,
        }
    }

    /// The CUDA handler: source defining `In`, `Out`, `State` (sizes as the Rust types') and
    /// `__device__ void handle(const In*, Out*, State*, ActorCtx*)`. Self-contained: no
    /// `#include`. With state (`S` not `()`) the handler sees the messages one at a time in
    /// order; without, up to 32 run at once (one per thread), so it must not share memory
    /// between messages other than through atomics.
    pub fn cuda(mut self, source: impl Into<String>) -> Self {
        self.cuda = Some(source.into());
        self
    }

    /// The host handler (the CPU backend's), of the same meaning as the CUDA one.
    pub fn host(
        mut self,
        handler: impl FnMut(&In, &mut Out, &mut S, &mut ActorCtx) + Send + 'static,
    ) -> Self {
        self.host = Some(Box::new(handler));
        self
    }

    /// Inbox slots per lane: a power of two from 16 to 1 Mi.
    pub fn capacity(mut self, slots: usize) -> Self {
        self.capacity = slots;
        self
    }

    /// Priority lanes, 1 to 4 (lane `lanes - 1` is served first).
    pub fn lanes(mut self, lanes: usize) -> Self {
        self.lanes = lanes;
        self
    }

    /// Most messages handled per loop iteration, 1 to 256.
    pub fn batch(mut self, batch: usize) -> Self {
        self.batch = batch;
        self
    }

    /// What a full inbox does to senders.
    pub fn backpressure(mut self, policy: Backpressure) -> Self {
        self.backpressure = policy;
        self
    }

    /// A waiting lower lane gets at least one message in every `n` (at least 1).
    pub fn starvation_limit(mut self, n: u32) -> Self {
        self.starvation_limit = n;
        self
    }

    /// Sends every reply to `next`'s inbox on the device instead of to the host.
    pub fn forward_to<X>(mut self, next: &super::Actor<Out, X>) -> Self {
        self.forward_to = Some(next.index());
        self
    }

    /// On the GPU backend, count a stream's messages as a lone one's: when the actor has one
    /// lane and no device inbox, a read of a window larger than one round of loads finds
    /// its messages by two reductions in registers instead of slot states in shared memory
    /// and ballots. The messages and their order are the same either way (the CPU backend
    /// has no windows). The loop of a system with such an actor is compiled with that path
    /// (a few bytes of register spills on sm_90). On by default, as are `wide_window` and
    /// `SystemConfig::reply_gap`: together they shorten the round trip of requests that
    /// come beside a stream (`warpdrive bench actors`, `round-trip-loaded`; bench/NOTES.md).
    pub fn quick_stream(mut self, on: bool) -> Self {
        self.quick_stream = on;
        self
    }

    /// On the GPU backend, when the actor has one lane and its last busy read took a stream
    /// (more than two messages), the read after an empty one covers as many slots as one
    /// round of loads (ten 64-byte messages) instead of two: the stream's next burst is then
    /// taken in one or two reads rather than a window doubling from two slots, read after
    /// read; after a lone message the window stays two slots, so a closed-loop client's
    /// round trip keeps its short read. The messages and their order are the same either
    /// way. On by default (see `quick_stream`).
    pub fn wide_window(mut self, on: bool) -> Self {
        self.wide_window = on;
        self
    }

    /// Senders publish each lane's claimed tail in a word the GPU loop loads with every read
    /// (no extra round trip), and the loop makes its next window of the lane at least the
    /// messages claimed beyond what it took (up to its largest window): a burst that lands
    /// behind a small read is then taken by the next read whole, not through a window
    /// doubling read after read. A size only: slots claimed but not yet written still read
    /// as not written, so the messages and their order are the same either way (the CPU
    /// backend has no windows). Costs a send that leaves more than two messages waiting one
    /// atomic maximum on a shared word (a lone request none). On by default; `warpdrive bench
    /// actors` measures it off too (`warpdrive-no-hint`).
    pub fn tail_hint(mut self, on: bool) -> Self {
        self.tail_hint = on;
        self
    }

    /// Checks the shape and erases the types.
    pub(crate) fn erase(self) -> Result<ErasedSpec> {
        let bad = |what: String| Error::InvalidArgument(format!("actor {}: {what}", self.name));
        let (in_bytes, out_bytes) = (size_of::<In>(), size_of::<Out>());
        for (what, n) in [("In", in_bytes), ("Out", out_bytes)] {
            if n == 0 || n > MAX_MESSAGE_BYTES {
                return Err(bad(format!(
                    "{what} is {n} bytes; messages are 1 to {MAX_MESSAGE_BYTES} bytes"
                )));
            }
        }
        let (lo, hi) = CAPACITY_RANGE;
        if !self.capacity.is_power_of_two() || self.capacity < lo || self.capacity > hi {
            return Err(bad(format!(
                "capacity {} is not a power of two from {lo} to {hi}",
                self.capacity
            )));
        }
        if self.lanes == 0 || self.lanes > MAX_LANES {
            return Err(bad(format!("{} lanes; 1 to {MAX_LANES}", self.lanes)));
        }
        if self.batch == 0 || self.batch > MAX_BATCH {
            return Err(bad(format!("batch {}; 1 to {MAX_BATCH}", self.batch)));
        }
        if self.starvation_limit == 0 {
            return Err(bad("starvation limit 0; at least 1".into()));
        }
        let host: Option<HostFn> = self.host.map(|mut f| {
            let erased: HostFn = Box::new(move |i: &[u8], o: &mut [u8], s: &mut [u8], ctx| {
                let input: In = bytemuck::pod_read_unaligned(i);
                let mut out: Out = bytemuck::pod_read_unaligned(o);
                let mut state: S = bytemuck::pod_read_unaligned(s);
                f(&input, &mut out, &mut state, ctx);
                o.copy_from_slice(bytemuck::bytes_of(&out));
                s.copy_from_slice(bytemuck::bytes_of(&state));
            });
            erased
        });
        Ok(ErasedSpec {
            name: self.name,
            cuda: self.cuda,
            host,
            in_bytes,
            out_bytes,
            state: bytemuck::bytes_of(&self.state).to_vec(),
            capacity: self.capacity,
            lanes: self.lanes,
            batch: self.batch,
            backpressure: self.backpressure,
            starvation_limit: self.starvation_limit,
            forward_to: self.forward_to,
            quick_stream: self.quick_stream,
            wide_window: self.wide_window,
            tail_hint: self.tail_hint,
        })
    }
}

/// A spec with its types erased: what the loops take.
pub(crate) struct ErasedSpec {
    pub(crate) name: String,
    pub(crate) cuda: Option<String>,
    pub(crate) host: Option<HostFn>,
    pub(crate) in_bytes: usize,
    pub(crate) out_bytes: usize,
    /// The initial state's bytes (`S`; may be empty).
    pub(crate) state: Vec<u8>,
    pub(crate) capacity: usize,
    pub(crate) lanes: usize,
    pub(crate) batch: usize,
    pub(crate) backpressure: Backpressure,
    pub(crate) starvation_limit: u32,
    pub(crate) forward_to: Option<usize>,
    /// `ActorSpec::quick_stream`.
    pub(crate) quick_stream: bool,
    /// `ActorSpec::wide_window`.
    pub(crate) wide_window: bool,
    /// `ActorSpec::tail_hint`.
    pub(crate) tail_hint: bool,
}
