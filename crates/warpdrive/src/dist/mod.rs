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
//! The same group with one process a rank, [`Comm::cpu_rank`] and [`Comm::cpu_from_env`],
//! started as `torchrun` starts them: rank 0 gathers every rank's address at
//! `MASTER_ADDR:MASTER_PORT` (`bootstrap.rs`), every pair of ranks links over TCP
//! (`mesh.rs`: send / receive, and the news that a rank left or aborted), and the collectives
//! run as rounds (`procs.rs`) through a shared-memory segment under `/dev/shm` on one host
//! (`device/shm.rs`) or over those TCP links ([`Transport`]). Large all-reduces on one host work
//! on the ranks' buffers where they are: in a process that joined such a group, the CPU
//! backend's buffers from 1 MiB live in memory files the other ranks map
//! (`device/shared_host.rs`; buffers made before the join are not), so each rank reduces its
//! part of every buffer in place as the in-process group does; where a buffer is not in one,
//! they copy straight between the buffers where the kernel allows it (`device/cma.rs`). The
//! same checks hold: every call's description is compared first (an error on every rank when
//! they differ, the group usable after), every wait has the timeout, and a rank whose process
//! ends is seen at once through its closed connections. A [`Comm::split`] of such a group
//! makes each sub-group a group of its own, gathered at its first member's address on a port
//! that member picks (new links, and a new segment over shared memory).
//!
//! On GPUs the same `Comm` runs on NCCL ([`Comm::nccl_group`]: one process driving several
//! GPUs, one thread per rank; [`Comm::nccl_rank`] and [`Comm::from_env`]: one process per
//! GPU, bootstrapped as `torchrun` does). Calls are enqueued on the caller's stream and
//! return at once; [`Comm::wait`] waits for them with the communicator's timeout, and a rank
//! that dies, never calls or calls with other arguments makes the others' `wait` fail with
//! [`Error::Collective`] (the communicator is aborted: NCCL's kernels stop) instead of hanging.
//! NCCL does not compare the ranks' arguments: a mismatch is that timeout, not an early error.
//!
//! [`Reducer`] averages gradients in buckets as they become ready, on a stream of its own.
//!
//! [`Comm::split`] makes sub-communicators; [`Comm::hierarchy`] the two a hierarchical
//! all-reduce runs on ([`Hierarchy`]).
//!
//! [`Int8Reducer`] averages a gradient through int8 block quantization with error feedback,
//! [`TopkReducer`] through top-k sparsification with error feedback and momentum (DGC),
//! [`PowerSgdReducer`] through a rank-r PowerSGD approximation with error feedback.
//!
//! [`PeerMapped`] buffers live in one GPU's memory mapped for others (CUDA virtual memory
//! management); [`put_signal`] copies into one from a kernel and raises a signal word once
//! the data has landed, [`wait_signal`] waits for it on the device, so data and its "ready"
//! move between GPUs with no host in the loop; [`SignalPingPong`] measures that signal's
//! latency.
//!
//! [`Comm::tuned_bucket_bytes`] (and [`Reducer::tuned`]) pick the Reducer's bucket size per
//! topology through the autotune cache; [`Comm::hierarchy_by_host`] picks the hierarchical
//! all-reduce when the ranks span hosts.

mod bootstrap;
mod bucket_tune;
mod call;
mod compress;
mod hierarchy;
mod local;
mod mesh;
mod nccl;
mod procs;
mod reducer;
mod symmetric;

use std::cell::Cell;
use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use crate::device::{Device, NcclCall, Stream};
use crate::dtype::{DType, Float};
use crate::error::{Error, Result};
use crate::memory::Buffer;

pub use bootstrap::{LaunchEnv, NcclId};
pub use bucket_tune::BUCKET_CANDIDATES;
use call::Call;
pub use compress::{Int8Reducer, PowerSgdReducer, TopkReducer};
pub use hierarchy::Hierarchy;
use local::Group;
use nccl::NcclLink;
use procs::Procs;
pub use procs::Transport;
pub use reducer::{Reducer, ReducerStats, DEFAULT_BUCKET_BYTES};
pub use symmetric::{put_signal, wait_signal, PeerMapped, SignalPingPong, SignalWait};

/// How a reduction combines the ranks' elements. NaN in any input gives NaN for every op.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ReduceOp {
    Sum,
    Max,
    Min,
    /// The sum divided by the world size (in f64, before the one rounding).
    Average,
}

/// How many of the GPU's SMs a communicator's NCCL kernels take (NCCL's CTA policy).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum CtaPolicy {
    /// As many as give the most bandwidth (NCCL's default).
    Default,
    /// As few as give decent bandwidth, leaving the rest to kernels that run beside them.
    Efficiency,
}

/// One rank's handle of a communicator group. `Send`, not `Sync`: move each rank's `Comm` to
/// the thread that runs that rank. Collectives must be called in the same order on every
/// rank; send / receive pairs match in order per pair of ranks. Dropping a `Comm` makes the
/// rank leave: the others' collectives fail from then on (see the module docs). On NCCL,
/// dropping aborts the communicator, which stops calls still running: [`wait`](Comm::wait)
/// for them first.
pub struct Comm {
    rank: usize,
    world: usize,
    timeout: Duration,
    link: Link,
}

/// How this rank reaches the others.
enum Link {
    /// The in-process CPU group.
    Host {
        group: Arc<Group>,
        /// Collectives this rank has entered: the step of the next one.
        step: Cell<u64>,
    },
    /// The CPU group across processes.
    Procs(Box<Procs>),
    /// An NCCL communicator.
    Nccl(NcclLink),
}

/// The CPU side of a call: the in-process group (with this rank's step) or the group across
/// processes.
enum Cpu<'c> {
    Local(&'c Group, local::Member<'c>),
    Procs(&'c Procs),
}

impl Cpu<'_> {
    fn refuse(self, op: &'static str, e: Error) -> Result<()> {
        match self {
            Cpu::Local(g, me) => g.refuse(me, op, e),
            Cpu::Procs(p) => p.refuse(op, e),
        }
    }

    fn all_reduce<T: Float>(self, call: Call, data: &mut [T], op: ReduceOp) -> Result<()> {
        match self {
            Cpu::Local(g, me) => g.all_reduce(me, call, data, op),
            Cpu::Procs(p) => p.all_reduce(call, data, op),
        }
    }

    fn broadcast<T: DType>(self, call: Call, data: &mut [T], root: usize) -> Result<()> {
        match self {
            Cpu::Local(g, me) => g.broadcast(me, call, data, root),
            Cpu::Procs(p) => p.broadcast(call, data, root),
        }
    }

    fn all_gather<T: DType>(self, call: Call, input: &[T], output: &mut [T]) -> Result<()> {
        match self {
            Cpu::Local(g, me) => g.all_gather(me, call, input, output),
            Cpu::Procs(p) => p.all_gather(call, input, output),
        }
    }

    fn reduce_scatter<T: Float>(
        self,
        call: Call,
        input: &[T],
        output: &mut [T],
        op: ReduceOp,
    ) -> Result<()> {
        match self {
            Cpu::Local(g, me) => g.reduce_scatter(me, call, input, output, op),
            Cpu::Procs(p) => p.reduce_scatter(call, input, output, op),
        }
    }

    fn all_to_all<T: DType>(self, call: Call, input: &[T], output: &mut [T]) -> Result<()> {
        match self {
            Cpu::Local(g, me) => g.all_to_all(me, call, input, output),
            Cpu::Procs(p) => p.all_to_all(call, input, output),
        }
    }

    fn all_to_all_v<T: DType>(self, call: Call, input: &[T], output: &mut [T]) -> Result<()> {
        match self {
            Cpu::Local(g, me) => g.all_to_all_v(me, call, input, output),
            Cpu::Procs(p) => p.all_to_all(call, input, output),
        }
    }
}

impl fmt::Debug for Comm {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let how = match &self.link {
            Link::Host { .. } => "in process".to_string(),
            Link::Procs(p) => format!("across processes, {}", p.how()),
            Link::Nccl(n) => format!("NCCL on {}", n.device().label()),
        };
        write!(f, "Comm(rank {} of {}, {how})", self.rank, self.world)
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
        check_timeout("Comm::local_group", timeout)?;
        let group = Arc::new(Group::new(world, timeout)?);
        let mut comms = Vec::new();
        comms.try_reserve_exact(world).map_err(|_| {
            Error::InvalidArgument(format!(
                "Comm::local_group: no memory for {world} ranks' handles"
            ))
        })?;
        comms.extend((0..world).map(|rank| Comm {
            rank,
            world,
            timeout,
            link: Link::Host {
                group: group.clone(),
                step: Cell::new(0),
            },
        }));
        Ok(comms)
    }

    /// One NCCL rank per device, all in this process (rank `i` on `devices[i]`, each a
    /// distinct GPU): move each `Comm` to its own thread. Every wait gives up after `timeout`.
    pub fn nccl_group(devices: &[Device], timeout: Duration) -> Result<Vec<Comm>> {
        check_timeout("Comm::nccl_group", timeout)?;
        if devices.is_empty() {
            return Err(Error::InvalidArgument(
                "Comm::nccl_group: a group needs at least one device".into(),
            ));
        }
        let links = NcclLink::for_devices(devices, timeout)?;
        let world = devices.len();
        Ok(links
            .into_iter()
            .enumerate()
            .map(|(rank, link)| Comm {
                rank,
                world,
                timeout,
                link: Link::Nccl(link),
            })
            .collect())
    }

    /// Rank `rank` of a `world`-rank NCCL communicator on `device`, every rank starting from
    /// the same `id` (made by one of them with [`NcclId::new`] and handed to the others).
    /// Returns once every rank has joined, or fails after `timeout`.
    pub fn nccl_rank(
        device: &Device,
        id: &NcclId,
        world: usize,
        rank: usize,
        timeout: Duration,
    ) -> Result<Comm> {
        check_timeout("Comm::nccl_rank", timeout)?;
        let link = NcclLink::for_rank(device, id, world, rank, timeout)?;
        Ok(Comm {
            rank,
            world,
            timeout,
            link: Link::Nccl(link),
        })
    }

    /// This process's rank as `torchrun` starts it (`RANK`, `WORLD_SIZE`, `MASTER_ADDR`,
    /// `MASTER_PORT`; see [`LaunchEnv`]): rank 0 makes the NCCL id and serves it over TCP at
    /// the master address, the others fetch it; then [`Comm::nccl_rank`] on `device`.
    pub fn from_env(device: &Device, timeout: Duration) -> Result<Comm> {
        check_timeout("Comm::from_env", timeout)?;
        let env = LaunchEnv::from_env()?;
        let mine = if env.rank == 0 {
            Some(NcclId::new()?)
        } else {
            None
        };
        let id = env.share_id(mine, timeout)?;
        Comm::nccl_rank(device, &id, env.world, env.rank, timeout)
    }

    /// Rank `env.rank` of a CPU group of `env.world` processes, started as `torchrun` starts
    /// them: rank 0 gathers every rank at `MASTER_ADDR:MASTER_PORT`, then the ranks link to
    /// one another and exchange through `transport` (shared memory under `/dev/shm` on one
    /// host, TCP across hosts; [`Transport::Auto`] picks by the ranks' host names). The same
    /// collectives, send / receive and [`split`](Comm::split) as [`Comm::local_group`]'s,
    /// with the same checks. Returns once every rank has joined, or fails after
    /// `timeout` (a wrong port, a rank that never comes, ranks that disagree on the job).
    pub fn cpu_rank(env: &LaunchEnv, transport: Transport, timeout: Duration) -> Result<Comm> {
        check_timeout("Comm::cpu_rank", timeout)?;
        let procs = Procs::join(env, transport, timeout)?;
        Ok(Comm {
            rank: procs.rank(),
            world: procs.world(),
            timeout,
            link: Link::Procs(Box::new(procs)),
        })
    }

    /// [`Comm::cpu_rank`] from the environment: `RANK`, `WORLD_SIZE`, `MASTER_ADDR`,
    /// `MASTER_PORT` ([`LaunchEnv`]) and `WARPDRIVE_DIST_TRANSPORT` ([`Transport::from_env`]).
    pub fn cpu_from_env(timeout: Duration) -> Result<Comm> {
        Comm::cpu_rank(&LaunchEnv::from_env()?, Transport::from_env()?, timeout)
    }

    /// This rank, in `0..world()`.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// The number of ranks in the group.
    pub fn world(&self) -> usize {
        self.world
    }

    /// How long any one call waits for the other ranks before it fails.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// Waits until this rank's calls enqueued on `stream` have finished, up to the timeout.
    /// The CPU group's calls finish before they return; on NCCL a timeout or an error
    /// reported by NCCL aborts the communicator and fails every later call.
    pub fn wait(&self, stream: &Stream) -> Result<()> {
        match &self.link {
            Link::Host { .. } | Link::Procs(_) => stream.synchronize(),
            Link::Nccl(n) => n.wait(stream),
        }
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
        let cpu = match &self.link {
            Link::Nccl(n) => {
                let ptr = buf.device_ptr();
                return n.enqueue::<T>(stream, &[buf.device()], OP, || {
                    Ok(NcclCall::AllReduce {
                        send: ptr,
                        recv: ptr,
                        count: len,
                        op: op.into(),
                    })
                });
            }
            Link::Host { group, step } => Cpu::Local(group, self.member(step)),
            Link::Procs(p) => Cpu::Procs(p),
        };
        let call = Call::new::<T>(OP, len, len).reducing(op);
        match on_host(stream, buf.device(), OP).and_then(|()| buf.host_view_mut()) {
            Ok(data) => cpu.all_reduce(call, data, op),
            Err(e) => cpu.refuse(OP, e),
        }
    }

    /// This rank's `Comm` among the ranks that pass the same `color`, ranked by `key` (then
    /// by rank here); every rank of this group calls it (a collective step). The new `Comm`
    /// has this one's timeout and backend.
    pub fn split(&self, color: usize, key: usize) -> Result<Comm> {
        self.split_with(color, key, None)
    }

    /// A `Comm` over the same ranks in the same order whose NCCL kernels follow `policy`:
    /// [`CtaPolicy::Efficiency`] for collectives that run beside compute (a [`Reducer`]'s
    /// under a backward pass), which then keeps more of the GPU's SMs. Every rank calls it (a
    /// collective step). The CPU group has no kernels: a new group of the same ranks.
    pub fn with_cta_policy(&self, policy: CtaPolicy) -> Result<Comm> {
        self.split_with(0, self.rank, Some(policy == CtaPolicy::Efficiency))
    }

    fn split_with(&self, color: usize, key: usize, efficient: Option<bool>) -> Result<Comm> {
        match &self.link {
            Link::Procs(p) => {
                let host = Device::cpu().new_stream()?;
                let (rank, members) = self.members(&host, color, key)?;
                // The first member meets the others on a port of its own, at its address.
                let port = if rank == 0 { procs::free_port()? } else { 0 };
                let mine = Buffer::from_host(&host, &[u64::from(port)])?;
                let mut ports = Buffer::from_host(&host, &vec![0u64; self.world])?;
                self.all_gather(&host, &mine, &mut ports)?;
                let first = members[0];
                let port = ports.to_host(&host)?.get(first).copied().unwrap_or(0);
                let addr = p.address_of(first).filter(|_| port > 0);
                let (Some(addr), Ok(port)) = (addr, u16::try_from(port)) else {
                    return Err(Error::Collective {
                        op: "split",
                        detail: format!("rank {first} showed no place for its sub-group"),
                    });
                };
                let env = LaunchEnv {
                    rank,
                    world: members.len(),
                    local_rank: rank,
                    master_addr: addr.to_string(),
                    master_port: port,
                };
                let procs = Procs::join(&env, p.sub_transport(), self.timeout)?;
                Ok(Comm {
                    rank,
                    world: members.len(),
                    timeout: self.timeout,
                    link: Link::Procs(Box::new(procs)),
                })
            }
            Link::Nccl(n) => {
                let (link, rank, world) = n.split(color, key, efficient)?;
                Ok(Comm {
                    rank,
                    world,
                    timeout: self.timeout,
                    link: Link::Nccl(link),
                })
            }
            Link::Host { group, step } => {
                let host = Device::cpu().new_stream()?;
                let (rank, members) = self.members(&host, color, key)?;
                // Every rank is now past the same step: it names this split.
                let at = step.get();
                Ok(Comm {
                    rank,
                    world: members.len(),
                    timeout: self.timeout,
                    link: Link::Host {
                        group: group.subgroup(at, color as u64, members.len())?,
                        step: Cell::new(0),
                    },
                })
            }
        }
    }

    /// The ranks of this group that pass `color` to a split, ordered by their `key` (then by
    /// rank), and this rank's place among them: every rank's pair is all-gathered.
    fn members(&self, host: &Stream, color: usize, key: usize) -> Result<(usize, Vec<usize>)> {
        let mine = Buffer::from_host(host, &[color as u64, key as u64])?;
        let mut all = Buffer::from_host(host, &vec![0u64; 2 * self.world])?;
        self.all_gather(host, &mine, &mut all)?;
        let all = all.to_host(host)?;
        let mut members: Vec<(u64, usize)> = (0..self.world)
            .filter(|&q| all[2 * q] == color as u64)
            .map(|q| (all[2 * q + 1], q))
            .collect();
        members.sort_unstable();
        let rank = members
            .iter()
            .position(|&(_, q)| q == self.rank)
            .ok_or_else(|| Error::Collective {
                op: "split",
                detail: "this rank is missing from its own color".into(),
            })?;
        Ok((rank, members.into_iter().map(|(_, q)| q).collect()))
    }

    /// Runs `calls` (this rank's calls on this `Comm`) as one group: on NCCL they launch
    /// together, so a rank may receive before it sends (a ring exchange, a pipeline step)
    /// without waiting on a peer that does the same. The CPU group runs them as made, where
    /// a send never waits but a receive does: there, put each rank's sends first.
    pub fn group<R>(&self, calls: impl FnOnce(&Comm) -> Result<R>) -> Result<R> {
        match &self.link {
            Link::Host { .. } | Link::Procs(_) => calls(self),
            Link::Nccl(n) => n.group(|| calls(self)),
        }
    }

    /// NCCL's all-reduce of `buf` in place with none of [`all_reduce`](Comm::all_reduce)'s
    /// checks but the buffer's device: what calling NCCL directly costs, for the `dist`
    /// bench's `nccl-direct` rows (which measure the checks' cost). `Unsupported` on a CPU
    /// group.
    #[doc(hidden)]
    pub fn direct_all_reduce<T: Float>(
        &self,
        stream: &Stream,
        buf: &mut Buffer<T>,
        op: ReduceOp,
    ) -> Result<()> {
        let Link::Nccl(n) = &self.link else {
            return Err(Error::Unsupported(
                "direct_all_reduce: a CPU group has no NCCL to call".into(),
            ));
        };
        let call = NcclCall::AllReduce {
            send: buf.device_ptr(),
            recv: buf.device_ptr(),
            count: buf.len(),
            op: op.into(),
        };
        n.enqueue_direct::<T>(stream, buf.device(), call)
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
        let cpu = match &self.link {
            Link::Nccl(n) => {
                let ptr = buf.device_ptr();
                return n.enqueue::<T>(stream, &[buf.device()], OP, || {
                    self.check_rank(OP, "root", root)?;
                    Ok(NcclCall::Broadcast {
                        send: ptr,
                        recv: ptr,
                        count: len,
                        root,
                    })
                });
            }
            Link::Host { group, step } => Cpu::Local(group, self.member(step)),
            Link::Procs(p) => Cpu::Procs(p),
        };
        let call = Call::new::<T>(OP, len, len).rooted(root);
        let checked = on_host(stream, buf.device(), OP)
            .and_then(|()| self.check_rank(OP, "root", root))
            .and_then(|()| buf.host_view_mut());
        match checked {
            Ok(data) => cpu.broadcast(call, data, root),
            Err(e) => cpu.refuse(OP, e),
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
        let (in_len, out_len) = (input.len(), output.len());
        let check = move || {
            let want = self.times_world(OP, in_len)?;
            if out_len != want {
                return Err(Error::InvalidArgument(format!(
                    "{OP}: the output holds {} elements; {} ranks × {} input elements need {want}",
                    out_len,
                    self.world(),
                    in_len
                )));
            }
            Ok(())
        };
        let cpu = match &self.link {
            Link::Nccl(n) => {
                let (send, recv, count) = (input.device_ptr(), output.device_ptr(), input.len());
                return n.enqueue::<T>(stream, &[input.device(), output.device()], OP, || {
                    check()?;
                    Ok(NcclCall::AllGather { send, recv, count })
                });
            }
            Link::Host { group, step } => Cpu::Local(group, self.member(step)),
            Link::Procs(p) => Cpu::Procs(p),
        };
        let call = Call::new::<T>(OP, input.len(), output.len());
        let checked = self.check_pair(stream, input, output, OP).and_then(|()| {
            check()?;
            Ok((input.host_view()?, output.host_view_mut()?))
        });
        match checked {
            Ok((input, output)) => cpu.all_gather(call, input, output),
            Err(e) => cpu.refuse(OP, e),
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
        let (in_len, out_len) = (input.len(), output.len());
        let check = move || {
            let want = self.times_world(OP, out_len)?;
            if in_len != want {
                return Err(Error::InvalidArgument(format!(
                    "{OP}: the input holds {} elements; {} ranks × {} output elements need {want}",
                    in_len,
                    self.world(),
                    out_len
                )));
            }
            Ok(())
        };
        let cpu = match &self.link {
            Link::Nccl(n) => {
                let (send, recv, count) = (input.device_ptr(), output.device_ptr(), output.len());
                return n.enqueue::<T>(stream, &[input.device(), output.device()], OP, || {
                    check()?;
                    Ok(NcclCall::ReduceScatter {
                        send,
                        recv,
                        count,
                        op: op.into(),
                    })
                });
            }
            Link::Host { group, step } => Cpu::Local(group, self.member(step)),
            Link::Procs(p) => Cpu::Procs(p),
        };
        let call = Call::new::<T>(OP, input.len(), output.len()).reducing(op);
        let checked = self.check_pair(stream, input, output, OP).and_then(|()| {
            check()?;
            Ok((input.host_view()?, output.host_view_mut()?))
        });
        match checked {
            Ok((input, output)) => cpu.reduce_scatter(call, input, output, op),
            Err(e) => cpu.refuse(OP, e),
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
        let (in_len, out_len) = (input.len(), output.len());
        let check = move || {
            if in_len != out_len || in_len % self.world() != 0 {
                return Err(Error::InvalidArgument(format!(
                    "{OP}: input and output must hold the same number of elements, divisible \
                     by the {} ranks: {} and {}",
                    self.world(),
                    in_len,
                    out_len
                )));
            }
            Ok(())
        };
        let cpu = match &self.link {
            Link::Nccl(n) => {
                let (send, recv) = (input.device_ptr(), output.device_ptr());
                let counts = vec![input.len() / self.world(); self.world()];
                return n.enqueue::<T>(stream, &[input.device(), output.device()], OP, || {
                    check()?;
                    Ok(NcclCall::AllToAll {
                        send,
                        recv,
                        send_counts: &counts,
                        recv_counts: &counts,
                    })
                });
            }
            Link::Host { group, step } => Cpu::Local(group, self.member(step)),
            Link::Procs(p) => Cpu::Procs(p),
        };
        let call = Call::new::<T>(OP, input.len(), output.len());
        let checked = self.check_pair(stream, input, output, OP).and_then(|()| {
            check()?;
            Ok((input.host_view()?, output.host_view_mut()?))
        });
        match checked {
            Ok((input, output)) => cpu.all_to_all(call, input, output),
            Err(e) => cpu.refuse(OP, e),
        }
    }

    /// All-to-all with per-rank counts: `input` holds `send_counts[j]` elements for rank `j`
    /// and `output` receives `recv_counts[i]` elements from rank `i`, both in rank order.
    /// What rank `i` sends to `j` must be what `j` receives from `i`: the CPU group checks
    /// the whole table (an error on every rank); NCCL does not (a mismatch ends in `wait`'s
    /// timeout).
    pub fn all_to_all_v<T: DType>(
        &self,
        stream: &Stream,
        input: &Buffer<T>,
        send_counts: &[usize],
        output: &mut Buffer<T>,
        recv_counts: &[usize],
    ) -> Result<()> {
        const OP: &str = "all_to_all_v";
        let (in_len, out_len, world) = (input.len(), output.len(), self.world());
        let check = move || {
            let total = |counts: &[usize]| {
                counts
                    .iter()
                    .try_fold(0usize, |a, &c| a.checked_add(c))
                    .ok_or_else(|| {
                        Error::InvalidArgument(format!("{OP}: the counts {counts:?} overflow"))
                    })
            };
            if send_counts.len() != world || recv_counts.len() != world {
                return Err(Error::InvalidArgument(format!(
                    "{OP}: {world} send and receive counts needed, got {} and {}",
                    send_counts.len(),
                    recv_counts.len()
                )));
            }
            let (sent, received) = (total(send_counts)?, total(recv_counts)?);
            if sent != in_len || received != out_len {
                return Err(Error::InvalidArgument(format!(
                    "{OP}: the send counts add up to {sent} and the receive counts to \
                     {received}; the input holds {in_len} elements and the output {out_len}"
                )));
            }
            Ok(())
        };
        let cpu = match &self.link {
            Link::Nccl(n) => {
                let (send, recv) = (input.device_ptr(), output.device_ptr());
                return n.enqueue::<T>(stream, &[input.device(), output.device()], OP, || {
                    check()?;
                    Ok(NcclCall::AllToAll {
                        send,
                        recv,
                        send_counts,
                        recv_counts,
                    })
                });
            }
            Link::Host { group, step } => Cpu::Local(group, self.member(step)),
            Link::Procs(p) => Cpu::Procs(p),
        };
        let call = Call::new::<T>(OP, in_len, out_len).counting(send_counts, recv_counts);
        let checked = self.check_pair(stream, input, output, OP).and_then(|()| {
            check()?;
            Ok((input.host_view()?, output.host_view_mut()?))
        });
        match checked {
            Ok((input, output)) => cpu.all_to_all_v(call, input, output),
            Err(e) => cpu.refuse(OP, e),
        }
    }

    /// Sends `buf` to rank `peer`, whose matching [`recv`](Comm::recv) (in order for this
    /// pair of ranks) must take the same element type and length. Returns once the data is
    /// copied out of `buf` (the group holds it until received), so a ring of sends followed
    /// by receives does not deadlock.
    pub fn send<T: DType>(&self, stream: &Stream, buf: &Buffer<T>, peer: usize) -> Result<()> {
        const OP: &str = "send";
        self.check_peer(OP, peer)?;
        match &self.link {
            Link::Nccl(n) => {
                let (ptr, count) = (buf.device_ptr(), buf.len());
                n.enqueue::<T>(stream, &[buf.device()], OP, || {
                    Ok(NcclCall::Send {
                        buf: ptr,
                        count,
                        peer,
                    })
                })
            }
            Link::Host { group, .. } => {
                on_host(stream, buf.device(), OP)?;
                group.send(self.rank, peer, buf.host_view()?)
            }
            Link::Procs(p) => {
                on_host(stream, buf.device(), OP)?;
                p.send(peer, buf.host_view()?)
            }
        }
    }

    /// Receives into `buf` the next message rank `peer` sent to this rank; waits up to the
    /// group's timeout. A message of another type or length is an error on this rank and
    /// aborts the group (the pair's messages no longer match).
    pub fn recv<T: DType>(&self, stream: &Stream, buf: &mut Buffer<T>, peer: usize) -> Result<()> {
        const OP: &str = "recv";
        self.check_peer(OP, peer)?;
        match &self.link {
            Link::Nccl(n) => {
                let (ptr, count) = (buf.device_ptr(), buf.len());
                n.enqueue::<T>(stream, &[buf.device()], OP, || {
                    Ok(NcclCall::Recv {
                        buf: ptr,
                        count,
                        peer,
                    })
                })
            }
            Link::Host { group, .. } => {
                on_host(stream, buf.device(), OP)?;
                group.recv(self.rank, peer, buf.host_view_mut()?)
            }
            Link::Procs(p) => {
                on_host(stream, buf.device(), OP)?;
                p.recv(peer, buf.host_view_mut()?)
            }
        }
    }

    /// This rank's part in the CPU group's step protocol.
    fn member<'c>(&self, step: &'c Cell<u64>) -> local::Member<'c> {
        local::Member {
            rank: self.rank,
            step,
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
        if let Link::Host { group, .. } = &self.link {
            group.leave(self.rank);
        }
    }
}

fn check_timeout(op: &str, timeout: Duration) -> Result<()> {
    if timeout.is_zero() {
        return Err(Error::InvalidArgument(format!(
            "{op}: the timeout must be longer than zero"
        )));
    }
    Ok(())
}

/// `DeviceMismatch` unless `device` is the stream's; `Unsupported` unless that is host memory.
fn on_host(stream: &Stream, device: &Device, op: &'static str) -> Result<()> {
    device.same_as(stream.device(), op)?;
    if device.is_host_memory() {
        Ok(())
    } else {
        Err(Error::Unsupported(format!(
            "{op} on {}: a CPU group's buffers live in host memory; GPU buffers go through an \
             NCCL communicator (Comm::nccl_group, Comm::nccl_rank, Comm::from_env)",
            device.label()
        )))
    }
}

impl From<ReduceOp> for crate::device::NcclReduce {
    fn from(op: ReduceOp) -> Self {
        match op {
            ReduceOp::Sum => Self::Sum,
            ReduceOp::Max => Self::Max,
            ReduceOp::Min => Self::Min,
            ReduceOp::Average => Self::Average,
        }
    }
}
