//! NCCL communicators. A rank's communicator is made non-blocking, so joining cannot hang:
//! NCCL reports the join in progress and it is polled with `ncclCommGetAsyncError` until it
//! settles or the timeout passes, and then aborted. Calls then go through a blocking
//! communicator split from it and connected to every peer before it is handed out (a
//! non-blocking communicator hands each call to a new NCCL thread, ~60 µs a call on an
//! H200 pair against a few for a blocking one; bench/NOTES.md, NCCL): once connected, a
//! blocking call only enqueues work, so it cannot wait on a peer either. `wait` polls the
//! stream and the asynchronous error up to the timeout and aborts the communicator on
//! either (which also stops its kernels, so a stream waiting on a peer that died drains).

use std::ffi::{c_int, c_void, CStr};
use std::time::{Duration, Instant};

use cudarc::driver::sys as drv;
use cudarc::nccl::sys;
use cudarc::nccl::sys::ncclResult_t as R;

use crate::dtype::DTypeKind;
use crate::error::{Error, Result};

use super::context::CudaDevice;
use super::libraries::libraries;
use super::stream::GpuStream;

/// Bytes of an NCCL unique id, the token every rank of a communicator starts from.
pub(crate) const NCCL_ID_BYTES: usize = 128;

/// How a reduction combines the ranks' elements.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum NcclReduce {
    Sum,
    Max,
    Min,
    Average,
}

/// One collective or point-to-point call. Addresses are device pointers; counts are
/// elements of `dtype`.
#[derive(Debug, Clone, Copy)]
pub(crate) enum NcclCall<'a> {
    AllReduce {
        send: u64,
        recv: u64,
        count: usize,
        op: NcclReduce,
    },
    Broadcast {
        send: u64,
        recv: u64,
        count: usize,
        root: usize,
    },
    /// `count` elements from each rank.
    AllGather {
        send: u64,
        recv: u64,
        count: usize,
    },
    /// `count` elements to each rank.
    ReduceScatter {
        send: u64,
        recv: u64,
        count: usize,
        op: NcclReduce,
    },
    /// `send_counts[j]` elements to rank `j` (in rank order from `send`), `recv_counts[i]`
    /// from rank `i` (in rank order into `recv`), as one group of sends and receives.
    AllToAll {
        send: u64,
        recv: u64,
        send_counts: &'a [usize],
        recv_counts: &'a [usize],
    },
    Send {
        buf: u64,
        count: usize,
        peer: usize,
    },
    Recv {
        buf: u64,
        count: usize,
        peer: usize,
    },
}

/// `NCCL_CONFIG_UNDEF_INT`: a config field NCCL sets itself.
const UNDEF: c_int = c_int::MIN;

/// One rank's NCCL communicator on one GPU.
pub(crate) struct NcclComm {
    /// The non-blocking communicator the rank joined with.
    guard: sys::ncclComm_t,
    /// The blocking communicator split from `guard` that calls go through (null until made).
    fast: sys::ncclComm_t,
    device: CudaDevice,
    rank: usize,
    world: usize,
    timeout: Duration,
    /// Set once aborted: every later call fails, and drop does not finalize.
    aborted: Option<String>,
    /// NCCL's CTA policy for this communicator's kernels (`NCCL_CONFIG_UNDEF_INT`: NCCL's
    /// default), kept for the communicators split from it.
    cta_policy: c_int,
}

// SAFETY: an NCCL communicator may be used from any thread as long as calls on it do not
// overlap; `NcclComm` is `Send` but not `Sync`, and every call takes `&mut self` or runs on
// the one thread that holds it.
unsafe impl Send for NcclComm {}

impl std::fmt::Debug for NcclComm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "NcclComm(rank {} of {} on cuda:{})",
            self.rank,
            self.world,
            self.device.ordinal()
        )
    }
}

/// `LibraryMissing` unless libnccl loads here.
fn require_nccl() -> Result<()> {
    if libraries().nccl {
        Ok(())
    } else {
        Err(Error::LibraryMissing {
            library: "NCCL",
            hint: "libnccl.so.2 not found on the library path".into(),
        })
    }
}

/// NCCL's version code (e.g. 22803 for 2.28.3).
pub(crate) fn nccl_version_code() -> Result<i32> {
    require_nccl()?;
    let mut v: c_int = 0;
    // SAFETY: the library is loaded; the out-pointer is a valid local.
    let r = unsafe { sys::ncclGetVersion(&mut v) };
    ok("ncclGetVersion", r, None)?;
    Ok(v)
}

/// A fresh unique id (rank 0 makes it and hands it to the others).
pub(crate) fn nccl_unique_id() -> Result<[u8; NCCL_ID_BYTES]> {
    require_nccl()?;
    let mut id = sys::ncclUniqueId {
        internal: [0; NCCL_ID_BYTES],
    };
    // SAFETY: the library is loaded; the out-pointer is a valid local.
    let r = unsafe { sys::ncclGetUniqueId(&mut id) };
    ok("ncclGetUniqueId", r, None)?;
    Ok(id.internal.map(|c| c as u8))
}

/// Runs `calls` (NCCL calls made on this thread) between `ncclGroupStart` and
/// `ncclGroupEnd`, so NCCL launches them together: sends and receives that would wait on
/// each other in turn run. The group is closed whatever `calls` returned. The outer error
/// is the group's own (its start or end failed); the inner result is `calls`'s. An end left
/// in progress (non-blocking communicators) is for the caller to settle.
pub(crate) fn nccl_group<V>(calls: impl FnOnce() -> Result<V>) -> Result<Result<V>> {
    require_nccl()?;
    // SAFETY: the library is loaded; a group is per thread and takes no arguments.
    ok("ncclGroupStart", unsafe { sys::ncclGroupStart() }, None)?;
    let made = calls();
    // SAFETY: closes the group opened above, on the same thread.
    let end = unsafe { sys::ncclGroupEnd() };
    if end != R::ncclInProgress {
        ok("ncclGroupEnd", end, None)?;
    }
    Ok(made)
}

impl NcclComm {
    /// One communicator per device, all in this process (rank `i` on `devices[i]`), made
    /// together in one NCCL group; each is then used from its own thread.
    pub(crate) fn for_devices(devices: &[CudaDevice], timeout: Duration) -> Result<Vec<NcclComm>> {
        require_nccl()?;
        let world = devices.len();
        let id = nccl_unique_id()?;
        let mut comms = Vec::with_capacity(world);
        nccl_group(|| {
            for (rank, device) in devices.iter().enumerate() {
                comms.push(NcclComm {
                    guard: init_rank(device, &id, world, rank)?,
                    fast: std::ptr::null_mut(),
                    device: device.clone(),
                    rank,
                    world,
                    timeout,
                    aborted: None,
                    cta_policy: UNDEF,
                });
            }
            Ok(())
        })??;
        for c in &mut comms {
            c.settle(c.guard, "ncclCommInitRankConfig")?;
        }
        connect_fast(&mut comms)?;
        Ok(comms)
    }

    /// This process's rank of a communicator of `world` ranks that all start from `id`.
    pub(crate) fn for_rank(
        device: &CudaDevice,
        id: &[u8; NCCL_ID_BYTES],
        world: usize,
        rank: usize,
        timeout: Duration,
    ) -> Result<NcclComm> {
        require_nccl()?;
        let guard = init_rank(device, id, world, rank)?;
        let mut comm = NcclComm {
            guard,
            fast: std::ptr::null_mut(),
            device: device.clone(),
            rank,
            world,
            timeout,
            aborted: None,
            cta_policy: UNDEF,
        };
        comm.settle(comm.guard, "ncclCommInitRankConfig")?;
        connect_fast(std::slice::from_mut(&mut comm))?;
        Ok(comm)
    }

    /// This rank's communicator among the ranks that pass the same `color` (every rank of
    /// this one calls, each from its own thread), ordered by `key` then rank; joined and
    /// connected as a new one is. `efficient`: whether its kernels take as few SMs as give
    /// decent bandwidth (NCCL's CTA efficiency policy) or as many as give the most; `None`:
    /// as this communicator's do.
    pub(crate) fn split(
        &mut self,
        color: usize,
        key: usize,
        efficient: Option<bool>,
    ) -> Result<NcclComm> {
        self.check_open()?;
        let as_int = |what: &str, v: usize| {
            c_int::try_from(v).map_err(|_| {
                Error::InvalidArgument(format!("NCCL split: the {what} {v} is too large"))
            })
        };
        let (color, key) = (as_int("color", color)?, as_int("key", key)?);
        self.device.bind()?;
        // NCCL_CTA_POLICY_EFFICIENCY and NCCL_CTA_POLICY_DEFAULT.
        let cta_policy = efficient.map_or(self.cta_policy, |e| if e { 1 } else { 0 });
        let mut config = nccl_config(0, cta_policy)?;
        let mut guard: sys::ncclComm_t = std::ptr::null_mut();
        // SAFETY: `guard` (ours) is live and settled; the out-pointer and config are valid
        // locals that outlive the call.
        let r = unsafe { sys::ncclCommSplit(self.guard, color, key, &mut guard, &mut config) };
        if r != R::ncclSuccess && r != R::ncclInProgress {
            return Err(self.fail("ncclCommSplit", describe(r, Some(self.guard))));
        }
        self.settle(self.guard, "ncclCommSplit")?;
        if guard.is_null() {
            return Err(self.fail("ncclCommSplit", "NCCL returned no communicator".into()));
        }
        let (mut rank, mut world): (c_int, c_int) = (0, 0);
        // SAFETY: `guard` is the live communicator just made; the out-pointers are locals.
        let r = unsafe { sys::ncclCommUserRank(guard, &mut rank) };
        ok("ncclCommUserRank", r, Some(guard))?;
        // SAFETY: as above.
        let r = unsafe { sys::ncclCommCount(guard, &mut world) };
        ok("ncclCommCount", r, Some(guard))?;
        let mut child = NcclComm {
            guard,
            fast: std::ptr::null_mut(),
            device: self.device.clone(),
            rank: usize::try_from(rank).unwrap_or(0),
            world: usize::try_from(world).unwrap_or(0),
            timeout: self.timeout,
            aborted: None,
            cta_policy,
        };
        child.settle(child.guard, "ncclCommSplit")?;
        connect_fast(std::slice::from_mut(&mut child))?;
        Ok(child)
    }

    /// The rank and the number of ranks.
    pub(crate) fn place(&self) -> (usize, usize) {
        (self.rank, self.world)
    }

    /// Enqueues `call` on `stream` (its context bound), then polls until NCCL has taken it.
    pub(crate) fn enqueue(
        &mut self,
        stream: &GpuStream,
        dtype: DTypeKind,
        call: NcclCall<'_>,
    ) -> Result<()> {
        self.check_open()?;
        // No context bind: NCCL selects its communicator's device itself.
        let ty = nccl_type(dtype)?;
        let elem = dtype.size();
        let s = stream.cu_stream() as sys::cudaStream_t;
        let c = self.hot();
        let p = |a: u64| a as *mut c_void;
        // SAFETY (every arm): the caller passes device addresses of live buffers on this
        // communicator's device holding at least the counts named (checked in `dist`: for
        // all-to-all, the counts sum to the buffers' lengths), and the stream belongs to
        // that device; NCCL selects the device itself.
        let (name, r) = unsafe {
            match call {
                NcclCall::AllReduce {
                    send,
                    recv,
                    count,
                    op,
                } => (
                    "ncclAllReduce",
                    sys::ncclAllReduce(p(send), p(recv), count, ty, red(op), c, s),
                ),
                NcclCall::Broadcast {
                    send,
                    recv,
                    count,
                    root,
                } => (
                    "ncclBroadcast",
                    sys::ncclBroadcast(p(send), p(recv), count, ty, root as c_int, c, s),
                ),
                NcclCall::AllGather { send, recv, count } => (
                    "ncclAllGather",
                    sys::ncclAllGather(p(send), p(recv), count, ty, c, s),
                ),
                NcclCall::ReduceScatter {
                    send,
                    recv,
                    count,
                    op,
                } => (
                    "ncclReduceScatter",
                    sys::ncclReduceScatter(p(send), p(recv), count, ty, red(op), c, s),
                ),
                NcclCall::Send { buf, count, peer } => (
                    "ncclSend",
                    sys::ncclSend(p(buf), count, ty, peer as c_int, c, s),
                ),
                NcclCall::Recv { buf, count, peer } => (
                    "ncclRecv",
                    sys::ncclRecv(p(buf), count, ty, peer as c_int, c, s),
                ),
                NcclCall::AllToAll {
                    send,
                    recv,
                    send_counts,
                    recv_counts,
                } => {
                    // A group of sends and receives (NCCL's own all-to-all takes equal
                    // counts only, and older libraries lack it).
                    let (mut send_at, mut recv_at) = (send, recv);
                    let grouped = nccl_group(|| {
                        for peer in 0..self.world {
                            let out = send_counts.get(peer).copied().unwrap_or(0);
                            let inc = recv_counts.get(peer).copied().unwrap_or(0);
                            if out > 0 {
                                let r = sys::ncclSend(p(send_at), out, ty, peer as c_int, c, s);
                                ok("ncclSend", r, Some(c))?;
                            }
                            if inc > 0 {
                                let r = sys::ncclRecv(p(recv_at), inc, ty, peer as c_int, c, s);
                                ok("ncclRecv", r, Some(c))?;
                            }
                            send_at += (out * elem) as u64;
                            recv_at += (inc * elem) as u64;
                        }
                        Ok(())
                    });
                    return match grouped.and_then(|made| made) {
                        Ok(()) => Ok(()),
                        Err(e) => Err(self.fail("ncclAlltoAll (grouped send/recv)", e.to_string())),
                    };
                }
            }
        };
        self.after(name, r)
    }

    /// Waits until the work enqueued on `stream` so far has finished, polling the
    /// communicator's asynchronous error; aborts it when that reports an error or the
    /// timeout passes (a peer that died or never called), and returns the error.
    pub(crate) fn wait(&mut self, stream: &GpuStream) -> Result<()> {
        self.check_open()?;
        self.device.bind()?;
        let start = Instant::now();
        let deadline = start + self.timeout;
        loop {
            // SAFETY: the stream is alive (borrowed) and its context bound.
            match unsafe { drv::cuStreamQuery(stream.cu_stream()) } {
                drv::CUresult::CUDA_SUCCESS => return Ok(()),
                drv::CUresult::CUDA_ERROR_NOT_READY => {}
                e => return self.device.check("cuStreamQuery", e.result()),
            }
            let state = self.async_state(self.hot())?;
            if state != R::ncclSuccess && state != R::ncclInProgress {
                return Err(self.fail("wait", describe(state, Some(self.hot()))));
            }
            if Instant::now() >= deadline {
                return Err(self.fail(
                    "wait",
                    format!(
                        "the stream's collectives did not finish within {:?} (a rank that \
                         never called, called with other arguments, or died); the \
                         communicator is aborted",
                        self.timeout
                    ),
                ));
            }
            // Collectives finish in microseconds to milliseconds: poll closely at first, then
            // let the core go while a long wait (queued compute, a slow peer) runs out.
            if start.elapsed() < Duration::from_millis(2) {
                std::thread::yield_now();
            } else {
                std::thread::sleep(Duration::from_micros(50));
            }
        }
    }

    /// Aborts the communicator: its kernels stop, every later call fails.
    pub(crate) fn abort(&mut self, why: &str) {
        if self.aborted.is_none() {
            for c in [self.fast, self.guard] {
                if c.is_null() {
                    continue;
                }
                // SAFETY: `c` is a live communicator, aborted at most once (`aborted` is set).
                let r = unsafe { sys::ncclCommAbort(c) };
                if r != R::ncclSuccess && r != R::ncclInProgress {
                    tracing::warn!("ncclCommAbort failed: {r:?}");
                }
            }
            self.aborted = Some(why.to_string());
        }
    }

    fn check_open(&self) -> Result<()> {
        match &self.aborted {
            None => Ok(()),
            Some(why) => Err(Error::Collective {
                op: "nccl",
                detail: format!("the communicator was aborted earlier: {why}"),
            }),
        }
    }

    /// The communicator calls go through: the blocking one once made.
    fn hot(&self) -> sys::ncclComm_t {
        if self.fast.is_null() {
            self.guard
        } else {
            self.fast
        }
    }

    fn async_state(&self, comm: sys::ncclComm_t) -> Result<R> {
        let mut state = R::ncclSuccess;
        // SAFETY: `comm` is one of this rank's live communicators; the out-pointer is a
        // valid local.
        let r = unsafe { sys::ncclCommGetAsyncError(comm, &mut state) };
        ok("ncclCommGetAsyncError", r, Some(comm))?;
        Ok(state)
    }

    /// After a call: success, or in progress (polled until it settles), or an error.
    fn after(&mut self, name: &'static str, r: R) -> Result<()> {
        match r {
            R::ncclSuccess => Ok(()),
            R::ncclInProgress => self.settle(self.hot(), name),
            e => Err(self.fail(name, describe(e, Some(self.hot())))),
        }
    }

    /// Polls the asynchronous state until it leaves `ncclInProgress`, up to the timeout.
    /// A non-blocking communicator hands every call to NCCL's own thread and reports it in
    /// progress until that thread has enqueued it: microseconds in the steady state, so the
    /// poll spins first (a 50 µs sleep between polls made every call cost ~130 µs on an
    /// H200 pair; bench/NOTES.md, NCCL), and sleeps only once the wait is long (a peer
    /// connecting, or never coming).
    fn settle(&mut self, comm: sys::ncclComm_t, name: &'static str) -> Result<()> {
        const SPIN: Duration = Duration::from_millis(2);
        let start = Instant::now();
        let deadline = start + self.timeout;
        loop {
            match self.async_state(comm)? {
                R::ncclSuccess => return Ok(()),
                R::ncclInProgress => {}
                e => return Err(self.fail(name, describe(e, Some(comm)))),
            }
            if Instant::now() >= deadline {
                return Err(self.fail(
                    name,
                    format!(
                        "still in progress after {:?} (a rank that never joined?); the \
                         communicator is aborted",
                        self.timeout
                    ),
                ));
            }
            if start.elapsed() < SPIN {
                std::hint::spin_loop();
            } else {
                std::thread::sleep(Duration::from_micros(50));
            }
        }
    }

    fn fail(&mut self, op: &'static str, detail: String) -> Error {
        self.abort(&detail);
        Error::Collective {
            op,
            detail: format!("rank {} of {}: {detail}", self.rank, self.world),
        }
    }
}

impl Drop for NcclComm {
    fn drop(&mut self) {
        if self.aborted.is_some() {
            return;
        }
        // The blocking communicator is aborted, not finalized: finalizing waits for its
        // outstanding work, which a peer that is gone would hold forever.
        if !self.fast.is_null() {
            // SAFETY: `fast` is live and released once, here.
            let r = unsafe { sys::ncclCommAbort(self.fast) };
            if r != R::ncclSuccess {
                tracing::warn!("ncclCommAbort failed: {r:?}");
            }
            self.fast = std::ptr::null_mut();
        }
        if self.device.bind().is_err() {
            self.abort("dropped on a lost device");
            return;
        }
        // Finalize flushes the rank's outstanding work (and in non-blocking mode may stay in
        // progress); a peer that is gone would keep it there, so it is bounded like any wait.
        // SAFETY: `guard` is a live communicator, finalized and destroyed once, here.
        let r = unsafe { sys::ncclCommFinalize(self.guard) };
        let settled = match r {
            R::ncclSuccess => Ok(()),
            R::ncclInProgress => self.settle(self.guard, "ncclCommFinalize"),
            e => Err(self.fail("ncclCommFinalize", describe(e, Some(self.guard)))),
        };
        if settled.is_err() || self.aborted.is_some() {
            return;
        }
        // SAFETY: finalized above; destroyed exactly once.
        let r = unsafe { sys::ncclCommDestroy(self.guard) };
        if r != R::ncclSuccess {
            tracing::warn!("ncclCommDestroy failed: {r:?}");
        }
    }
}

/// Splits a blocking communicator off each rank's (all of this process's ranks, in one
/// NCCL group), then connects it to every peer with one tiny all-reduce, all-gather and
/// send / receive pair each (NCCL connects lazily, on a call's first use of a path: the
/// blocking call that did so would wait for the peer), bounded by the timeout.
fn connect_fast(comms: &mut [NcclComm]) -> Result<()> {
    let Some(first) = comms.first() else {
        return Ok(());
    };
    let world = first.world;
    let mut config = nccl_config(1, first.cta_policy)?;
    nccl_group(|| {
        for c in comms.iter_mut() {
            c.device.bind()?;
            // SAFETY: `guard` is live and settled; `fast` and `config` outlive the call.
            let r = unsafe {
                sys::ncclCommSplit(c.guard, 0, c.rank as c_int, &mut c.fast, &mut config)
            };
            if r != R::ncclInProgress {
                ok("ncclCommSplit", r, Some(c.guard))?;
            }
        }
        Ok(())
    })??;
    for c in comms.iter_mut() {
        let settling = if c.fast.is_null() { c.guard } else { c.fast };
        c.settle(settling, "ncclCommSplit")?;
        if c.fast.is_null() {
            return Err(c.fail("ncclCommSplit", "NCCL returned no communicator".into()));
        }
    }
    // Scratch for the connecting calls: one f32 to all-reduce, one to gather `world` of,
    // and a slot a peer for the send / receive pairs. Its contents do not matter.
    let floats = 2 + 2 * world;
    let mut scratch = Vec::with_capacity(comms.len());
    for c in comms.iter() {
        let stream = c.device.new_stream()?;
        let ptr = c.device.alloc(floats * 4)?;
        scratch.push((stream, ptr));
    }
    let mut outcome = connect_calls(comms, &scratch, world);
    for (c, (stream, ptr)) in comms.iter_mut().zip(&scratch) {
        outcome = outcome.and_then(|()| c.wait(stream));
        if outcome.is_err() {
            // Stops any of its kernels still waiting on a peer before the scratch goes.
            c.abort("its connecting calls failed");
        }
        if let Err(e) = c.device.free(*ptr) {
            tracing::warn!("freeing NCCL's connection scratch: {e}");
        }
    }
    outcome
}

/// The grouped calls of [`connect_fast`] on each rank's blocking communicator.
fn connect_calls(comms: &mut [NcclComm], scratch: &[(GpuStream, u64)], world: usize) -> Result<()> {
    let f = sys::ncclDataType_t::ncclFloat32;
    for p2p in [false, true] {
        if p2p && world == 1 {
            break;
        }
        nccl_group(|| {
            for (c, (stream, ptr)) in comms.iter().zip(scratch) {
                let s = stream.cu_stream() as sys::cudaStream_t;
                let at = |i: usize| (ptr + 4 * i as u64) as *mut c_void;
                let (sum, fast) = (red(NcclReduce::Sum), c.fast);
                // SAFETY (each call): `at(i)` lies in the rank's scratch of 2 + 2·world
                // floats on its own device; the stream is that device's; `fast` is live.
                if !p2p {
                    let r = unsafe { sys::ncclAllReduce(at(0), at(0), 1, f, sum, fast, s) };
                    ok("ncclAllReduce", r, Some(fast))?;
                    let r = unsafe { sys::ncclAllGather(at(1), at(2), 1, f, fast, s) };
                    ok("ncclAllGather", r, Some(fast))?;
                    continue;
                }
                for peer in (0..world).filter(|&p| p != c.rank) {
                    let r = unsafe { sys::ncclSend(at(0), 1, f, peer as c_int, fast, s) };
                    ok("ncclSend", r, Some(fast))?;
                    let into = at(2 + world + peer);
                    let r = unsafe { sys::ncclRecv(into, 1, f, peer as c_int, fast, s) };
                    ok("ncclRecv", r, Some(fast))?;
                }
            }
            Ok(())
        })??;
    }
    Ok(())
}

/// Starts one rank's non-blocking init on `device` (bound to this thread).
fn init_rank(
    device: &CudaDevice,
    id: &[u8; NCCL_ID_BYTES],
    world: usize,
    rank: usize,
) -> Result<sys::ncclComm_t> {
    let n = c_int::try_from(world).map_err(|_| {
        Error::InvalidArgument(format!(
            "NCCL: a communicator of {world} ranks is too large"
        ))
    })?;
    if rank >= world {
        return Err(Error::InvalidArgument(format!(
            "NCCL: rank {rank} is out of range for {world} ranks"
        )));
    }
    device.bind()?;
    let mut config = nccl_config(0, UNDEF)?;
    let unique = sys::ncclUniqueId {
        internal: id.map(|b| b as std::ffi::c_char),
    };
    let mut raw: sys::ncclComm_t = std::ptr::null_mut();
    // SAFETY: the context is bound; `raw` and `config` are valid locals that outlive the call
    // (NCCL copies the config).
    let r = unsafe { sys::ncclCommInitRankConfig(&mut raw, n, unique, rank as c_int, &mut config) };
    match r {
        R::ncclSuccess | R::ncclInProgress if !raw.is_null() => Ok(raw),
        R::ncclSuccess | R::ncclInProgress => Err(Error::Collective {
            op: "ncclCommInitRankConfig",
            detail: "NCCL returned no communicator".into(),
        }),
        e => Err(Error::Collective {
            op: "ncclCommInitRankConfig",
            detail: describe(e, None),
        }),
    }
}

/// NCCL's `NCCL_CONFIG_INITIALIZER` with `blocking` set: every other field undefined (NCCL's
/// defaults and environment apply). The size told is what the loaded library knows: fields
/// appended after 2.28 are left out for an older library.
fn nccl_config(blocking: c_int, cta_policy: c_int) -> Result<sys::ncclConfig_t> {
    let version = nccl_version_code()?;
    let size = if version >= 22900 {
        std::mem::size_of::<sys::ncclConfig_t>()
    } else {
        std::mem::offset_of!(sys::ncclConfig_t, graphUsageMode)
    };
    Ok(sys::ncclConfig_t {
        size,
        magic: 0xcafe_beef,
        version: version as u32,
        blocking,
        cgaClusterSize: UNDEF,
        minCTAs: UNDEF,
        maxCTAs: UNDEF,
        netName: std::ptr::null(),
        splitShare: UNDEF,
        trafficClass: UNDEF,
        commName: std::ptr::null(),
        collnetEnable: UNDEF,
        CTAPolicy: cta_policy,
        shrinkShare: UNDEF,
        nvlsCTAs: UNDEF,
        nChannelsPerNetPeer: UNDEF,
        nvlinkCentricSched: UNDEF,
        graphUsageMode: UNDEF,
        numRmaCtx: UNDEF,
        maxP2pPeers: UNDEF,
    })
}

fn nccl_type(dtype: DTypeKind) -> Result<sys::ncclDataType_t> {
    use sys::ncclDataType_t as T;
    Ok(match dtype {
        DTypeKind::F32 => T::ncclFloat32,
        DTypeKind::F64 => T::ncclFloat64,
        DTypeKind::F16 => T::ncclFloat16,
        DTypeKind::BF16 => T::ncclBfloat16,
        DTypeKind::I32 => T::ncclInt32,
        DTypeKind::U32 => T::ncclUint32,
        DTypeKind::I64 => T::ncclInt64,
        DTypeKind::U64 => T::ncclUint64,
        DTypeKind::U8 => T::ncclUint8,
    })
}

fn red(op: NcclReduce) -> sys::ncclRedOp_t {
    match op {
        NcclReduce::Sum => sys::ncclRedOp_t::ncclSum,
        NcclReduce::Max => sys::ncclRedOp_t::ncclMax,
        NcclReduce::Min => sys::ncclRedOp_t::ncclMin,
        NcclReduce::Average => sys::ncclRedOp_t::ncclAvg,
    }
}

fn ok(call: &'static str, r: R, comm: Option<sys::ncclComm_t>) -> Result<()> {
    if r == R::ncclSuccess {
        Ok(())
    } else {
        Err(Error::Collective {
            op: call,
            detail: describe(r, comm),
        })
    }
}

/// NCCL's words for `r`, with the communicator's last error message when there is one.
fn describe(r: R, comm: Option<sys::ncclComm_t>) -> String {
    let text = |p: *const std::ffi::c_char| {
        // SAFETY: `p` is non-null and came from NCCL, which returns NUL-terminated strings
        // that live as long as the library (or the communicator, until its next call).
        (!p.is_null()).then(|| unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned())
    };
    // SAFETY: the library is loaded (a communicator or an error code came from it).
    let what = text(unsafe { sys::ncclGetErrorString(r) }).unwrap_or_default();
    let last = comm
        // SAFETY: `c` is a live communicator of this library.
        .and_then(|c| text(unsafe { sys::ncclGetLastError(c) }))
        .filter(|s| !s.is_empty());
    match last {
        Some(last) => format!("{r:?} ({what}): {last}"),
        None => format!("{r:?} ({what})"),
    }
}
