//! Collectives across ranks — all-reduce, broadcast, all-gather, reduce-scatter, all-to-all —
//! and point-to-point send / receive, through one communicator handle per rank ([`Comm`]).
//!
//! What exists: the in-process group of the CPU backend, [`Comm::local_group`]: `world` ranks
//! in one process, each [`Comm`] moved to its own thread, exchanging through shared host
//! memory. It is the reference the GPU path will be tested against, and runs data-parallel
//! code on a machine without GPUs. Reductions accumulate in f64 and round once, as the CPU
//! backend does everywhere; all-reduce and reduce-scatter spread the reduction over the
//! ranks (rank `r` reduces slice `r` of every rank's input).
//!
//! Reliability: every wait has the group's timeout. A rank that does not arrive in time
//! makes the waiting ranks fail with [`Error::Collective`] naming the call and the missing
//! ranks, and aborts the group. A rank whose `Comm` is dropped (its thread finished or
//! panicked) has left: the other ranks' collectives, and their sends to it and receives from
//! it (once the messages it sent are taken), fail at once with an error naming it; a rank that
//! panicked aborts the group outright. Each collective first exchanges a small description of the call (which
//! collective, element type, lengths, root, reduction), so ranks that disagree get an error
//! on every rank, never a deadlock or a wrong answer; that step is consumed on every rank and
//! the group stays usable. A call with an invalid argument takes its step too (the others
//! learn of it at once) and returns the argument error on its own rank.
//!
//! Not yet: NCCL communicators through the CUDA backend (a CUDA buffer is
//! [`Error::Unsupported`] today), process groups bootstrapped across processes and hosts as
//! torchrun does, the gradient Reducer (buckets all-reduced while the backward pass runs) and
//! compressed collectives.

mod local;

use std::cell::Cell;
use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use crate::device::{Device, Stream};
use crate::dtype::{DType, Float};
use crate::error::{Error, Result};
use crate::memory::Buffer;

use local::{Call, Group};

/// How a reduction combines the ranks' elements. NaN in any input gives NaN for every op.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ReduceOp {
    Sum,
    Max,
    Min,
    /// The sum divided by the world size (in f64, before the one rounding).
    Average,
}

/// One rank's handle of a communicator group. `Send`, not `Sync`: move each rank's `Comm` to
/// the thread that runs that rank. Collectives must be called in the same order on every
/// rank; send / receive pairs match in order per pair of ranks. Dropping a `Comm` makes the
/// rank leave: the others' collectives fail from then on (see the module docs).
pub struct Comm {
    rank: usize,
    group: Arc<Group>,
    /// Collectives this rank has entered: the step of the next one.
    step: Cell<u64>,
}

impl fmt::Debug for Comm {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "Comm(rank {} of {}, in process)",
            self.rank,
            self.group.world()
        )
    }
}

impl Comm {
    /// A group of `world` ranks in this process, on the CPU backend: one `Comm` per rank, in
    /// rank order. Every wait of the group's calls gives up after `timeout` (then the group
    /// is aborted). `world` 0 or a zero `timeout` is `InvalidArgument`.
    pub fn local_group(world: usize, timeout: Duration) -> Result<Vec<Comm>> {
        if world == 0 {
            return Err(Error::InvalidArgument(
                "Comm::local_group: a group needs at least one rank (world 0)".into(),
            ));
        }
        if timeout.is_zero() {
            return Err(Error::InvalidArgument(
                "Comm::local_group: the timeout must be longer than zero".into(),
            ));
        }
        let group = Arc::new(Group::new(world, timeout)?);
        let mut comms = Vec::new();
        comms.try_reserve_exact(world).map_err(|_| {
            Error::InvalidArgument(format!(
                "Comm::local_group: no memory for {world} ranks' handles"
            ))
        })?;
        comms.extend((0..world).map(|rank| Comm {
            rank,
            group: group.clone(),
            step: Cell::new(0),
        }));
        Ok(comms)
    }

    /// This rank, in `0..world()`.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// The number of ranks in the group.
    pub fn world(&self) -> usize {
        self.group.world()
    }

    /// How long any one call waits for the other ranks before it fails.
    pub fn timeout(&self) -> Duration {
        self.group.timeout()
    }

    /// Reduces `buf` over all ranks with `op`; every rank's `buf` ends holding the result.
    /// Lengths must agree across ranks.
    pub fn all_reduce<T: Float>(
        &self,
        stream: &Stream,
        buf: &mut Buffer<T>,
        op: ReduceOp,
    ) -> Result<()> {
        const OP: &str = "all_reduce";
        let len = buf.len();
        let call = Call::new::<T>(OP, len, len).reducing(op);
        match on_host(stream, buf.device(), OP).and_then(|()| buf.host_view_mut()) {
            Ok(data) => self.group.all_reduce(self.member(), call, data, op),
            Err(e) => self.group.refuse(self.member(), OP, e),
        }
    }

    /// Copies `buf` of rank `root` into `buf` of every other rank. Lengths and `root` must
    /// agree across ranks.
    pub fn broadcast<T: DType>(
        &self,
        stream: &Stream,
        buf: &mut Buffer<T>,
        root: usize,
    ) -> Result<()> {
        const OP: &str = "broadcast";
        let len = buf.len();
        let call = Call::new::<T>(OP, len, len).rooted(root);
        let checked = on_host(stream, buf.device(), OP)
            .and_then(|()| self.check_rank(OP, "root", root))
            .and_then(|()| buf.host_view_mut());
        match checked {
            Ok(data) => self.group.broadcast(self.member(), call, data, root),
            Err(e) => self.group.refuse(self.member(), OP, e),
        }
    }

    /// Every rank's `input`, concatenated in rank order, into every rank's `output`
    /// (`output.len() == world * input.len()`).
    pub fn all_gather<T: DType>(
        &self,
        stream: &Stream,
        input: &Buffer<T>,
        output: &mut Buffer<T>,
    ) -> Result<()> {
        const OP: &str = "all_gather";
        let call = Call::new::<T>(OP, input.len(), output.len());
        let checked = self.check_pair(stream, input, output, OP).and_then(|()| {
            let want = self.times_world(OP, input.len())?;
            if output.len() != want {
                return Err(Error::InvalidArgument(format!(
                    "{OP}: the output holds {} elements; {} ranks × {} input elements need {want}",
                    output.len(),
                    self.world(),
                    input.len()
                )));
            }
            Ok((input.host_view()?, output.host_view_mut()?))
        });
        match checked {
            Ok((input, output)) => self.group.all_gather(self.member(), call, input, output),
            Err(e) => self.group.refuse(self.member(), OP, e),
        }
    }

    /// Reduces `input` over all ranks with `op` and gives rank `r` slice `r` of the result
    /// (`input.len() == world * output.len()`).
    pub fn reduce_scatter<T: Float>(
        &self,
        stream: &Stream,
        input: &Buffer<T>,
        output: &mut Buffer<T>,
        op: ReduceOp,
    ) -> Result<()> {
        const OP: &str = "reduce_scatter";
        let call = Call::new::<T>(OP, input.len(), output.len()).reducing(op);
        let checked = self.check_pair(stream, input, output, OP).and_then(|()| {
            let want = self.times_world(OP, output.len())?;
            if input.len() != want {
                return Err(Error::InvalidArgument(format!(
                    "{OP}: the input holds {} elements; {} ranks × {} output elements need {want}",
                    input.len(),
                    self.world(),
                    output.len()
                )));
            }
            Ok((input.host_view()?, output.host_view_mut()?))
        });
        match checked {
            Ok((input, output)) => {
                self.group
                    .reduce_scatter(self.member(), call, input, output, op)
            }
            Err(e) => self.group.refuse(self.member(), OP, e),
        }
    }

    /// Equal-count all-to-all: `input` and `output` hold `world` chunks of `len / world`
    /// elements each; chunk `j` of rank `i`'s input lands in chunk `i` of rank `j`'s output.
    /// `input.len() == output.len()`, divisible by the world size.
    pub fn all_to_all<T: DType>(
        &self,
        stream: &Stream,
        input: &Buffer<T>,
        output: &mut Buffer<T>,
    ) -> Result<()> {
        const OP: &str = "all_to_all";
        let call = Call::new::<T>(OP, input.len(), output.len());
        let checked = self.check_pair(stream, input, output, OP).and_then(|()| {
            if input.len() != output.len() || input.len() % self.world() != 0 {
                return Err(Error::InvalidArgument(format!(
                    "{OP}: input and output must hold the same number of elements, divisible \
                     by the {} ranks: {} and {}",
                    self.world(),
                    input.len(),
                    output.len()
                )));
            }
            Ok((input.host_view()?, output.host_view_mut()?))
        });
        match checked {
            Ok((input, output)) => self.group.all_to_all(self.member(), call, input, output),
            Err(e) => self.group.refuse(self.member(), OP, e),
        }
    }

    /// Sends `buf` to rank `peer`, whose matching [`recv`](Comm::recv) (in order for this
    /// pair of ranks) must take the same element type and length. Returns once the data is
    /// copied out of `buf` (the group holds it until received), so a ring of sends followed
    /// by receives does not deadlock.
    pub fn send<T: DType>(&self, stream: &Stream, buf: &Buffer<T>, peer: usize) -> Result<()> {
        const OP: &str = "send";
        on_host(stream, buf.device(), OP)?;
        self.check_peer(OP, peer)?;
        self.group.send(self.rank, peer, buf.host_view()?)
    }

    /// Receives into `buf` the next message rank `peer` sent to this rank; waits up to the
    /// group's timeout. A message of another type or length is an error on this rank and
    /// aborts the group (the pair's messages no longer match).
    pub fn recv<T: DType>(&self, stream: &Stream, buf: &mut Buffer<T>, peer: usize) -> Result<()> {
        const OP: &str = "recv";
        on_host(stream, buf.device(), OP)?;
        self.check_peer(OP, peer)?;
        self.group.recv(self.rank, peer, buf.host_view_mut()?)
    }

    /// This rank's part in the group's step protocol.
    fn member(&self) -> local::Member<'_> {
        local::Member {
            rank: self.rank,
            step: &self.step,
        }
    }

    fn check_rank(&self, op: &'static str, what: &str, rank: usize) -> Result<()> {
        if rank < self.world() {
            Ok(())
        } else {
            Err(Error::InvalidArgument(format!(
                "{op}: {what} {rank} is out of range for a group of {} ranks",
                self.world()
            )))
        }
    }

    fn check_peer(&self, op: &'static str, peer: usize) -> Result<()> {
        self.check_rank(op, "peer", peer)?;
        if peer == self.rank {
            return Err(Error::InvalidArgument(format!(
                "{op}: rank {peer} cannot exchange messages with itself"
            )));
        }
        Ok(())
    }

    fn check_pair<T: DType>(
        &self,
        stream: &Stream,
        input: &Buffer<T>,
        output: &Buffer<T>,
        op: &'static str,
    ) -> Result<()> {
        on_host(stream, input.device(), op)?;
        output.check_stream(stream, op)
    }

    /// `world * n`, or `InvalidArgument` when it overflows.
    fn times_world(&self, op: &'static str, n: usize) -> Result<usize> {
        crate::size::product(
            format_args!("{op}: {} ranks' elements", self.world()),
            &[self.world(), n],
        )
    }
}

impl Drop for Comm {
    fn drop(&mut self) {
        self.group.leave(self.rank);
    }
}

/// `DeviceMismatch` unless `device` is the stream's; `Unsupported` unless that is host memory.
fn on_host(stream: &Stream, device: &Device, op: &'static str) -> Result<()> {
    device.same_as(stream.device(), op)?;
    if device.is_host_memory() {
        Ok(())
    } else {
        Err(Error::Unsupported(format!(
            "{op} on {}: dist has the in-process CPU group only; NCCL communicators for GPU \
             buffers come in a later step",
            device.label()
        )))
    }
}
