//! The CPU group across processes behind [`Comm::cpu_rank`](super::Comm::cpu_rank) and
//! [`Comm::cpu_from_env`](super::Comm::cpu_from_env): one process a rank, started as
//! `torchrun` starts them, exchanging through a shared-memory segment on one host
//! ([`Segment`]) or through TCP between hosts; point-to-point messages, and the news that a
//! rank left or aborted, always go over TCP ([`Mesh`]).
//!
//! Every collective is a step of rounds (see `shm.rs`): the first round carries each rank's
//! description of its call ([`Call`]), so ranks that disagree, or a rank whose call failed
//! its own checks, get an error on every rank and the group stays usable; the data rounds
//! follow, each at most [`SLOT_BYTES`] a rank. Rank `r` reduces part `r` of every chunk, in
//! rank order, in f64, rounded once, as the in-process group does. A failure inside a step (a
//! timeout, a rank that left) aborts the group on every rank. Large all-reduces over shared
//! memory skip the slots: the ranks map one another's buffers ([`shared_host`]) or copy
//! between them ([`cma`]; `direct.rs`), and only their descriptions and the barriers go through
//! rounds.

use std::cell::{Cell, RefCell};
use std::net::{IpAddr, SocketAddr, TcpListener};
use std::ops::Range;
use std::time::{Duration, Instant};

use super::bootstrap::{LaunchEnv, Table};
use super::call::{dtype_code, Call};
use super::local::{reduce, reduce_pooled};
use super::mesh::{dial_addr, Kind, Mesh, Payload};
use super::ReduceOp;
use crate::device::cma;
use crate::device::lending::share;
use crate::device::shared_host::{self, Lent, PeerRegion, Shown};
use crate::device::shm::{Segment, SHM_DIR, SLOT_BYTES};
use crate::dtype::{DType, Float};
use crate::error::{Error, Result};

mod direct;

/// How the ranks of a CPU process group exchange data.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Transport {
    /// Shared memory when every rank is on one host (the same host name, and `/dev/shm`
    /// there), TCP otherwise.
    Auto,
    /// A segment under `/dev/shm` that every rank maps: ranks on one host only.
    SharedMemory,
    /// TCP connections between every pair of ranks, wherever they run.
    Tcp,
}

impl Transport {
    /// The variable that picks the transport for [`Comm::cpu_from_env`](super::Comm::cpu_from_env).
    pub const ENV: &'static str = "WARPDRIVE_DIST_TRANSPORT";

    /// `WARPDRIVE_DIST_TRANSPORT`: `shm`, `tcp` or `auto` (the default when unset).
    pub fn from_env() -> Result<Transport> {
        match std::env::var(Self::ENV) {
            Err(_) => Ok(Transport::Auto),
            Ok(v) => match v.trim() {
                "" | "auto" => Ok(Transport::Auto),
                "shm" => Ok(Transport::SharedMemory),
                "tcp" => Ok(Transport::Tcp),
                other => Err(Error::InvalidArgument(format!(
                    "{}={other:?}: expected shm, tcp or auto",
                    Self::ENV
                ))),
            },
        }
    }

    fn code(self) -> u8 {
        match self {
            Transport::Auto => 0,
            Transport::SharedMemory => 1,
            Transport::Tcp => 2,
        }
    }
}

/// One rank's part of a CPU process group.
pub(super) struct Procs {
    rank: usize,
    world: usize,
    timeout: Duration,
    mesh: Mesh,
    /// The shared-memory segment, or `None` over TCP.
    shm: Option<RefCell<Segment>>,
    /// Rounds this rank has posted: the number of the last.
    seq: Cell<u64>,
    /// Collectives this rank has entered: the step of the next one.
    step: Cell<u64>,
    /// Over TCP, this rank's part of the round in progress (it reads its own piece there).
    own: RefCell<Payload>,
    /// Whether every rank can copy from and into every other's memory ([`cma`]): the large
    /// all-reduces then skip the segment.
    cma: bool,
    /// Whether this rank shows its buffers' shared regions ([`shared_host`]) for the others to
    /// map (`WARPDRIVE_DIST_LEND=0` turns it off, and with it the lent all-reduce).
    lend: bool,
    /// The other ranks' regions this rank has mapped, by rank, the most recently used last.
    mapped: RefCell<Vec<Vec<PeerRegion>>>,
    /// Where each rank is reached (its mesh address), and the transport this rank asked for:
    /// a split's sub-groups meet at their first member's address, as the group did.
    addrs: Vec<SocketAddr>,
    transport: Transport,
}

/// All-reduces from this many bytes a rank work on the ranks' buffers directly (lent, or
/// through [`cma`]) where the ranks can.
const CMA_FROM_BYTES: usize = 1 << 20;

/// A rank's entry in the rendezvous table: its mesh port, the transport it asks for,
/// whether it can use `/dev/shm` (`shm`), its host name.
fn entry(port: u16, transport: Transport, shm: bool) -> Vec<u8> {
    let mut e = port.to_le_bytes().to_vec();
    e.push(transport.code());
    e.push(u8::from(shm && std::path::Path::new(SHM_DIR).is_dir()));
    e.extend_from_slice(host_name().as_bytes());
    e
}

/// This host's name as the kernel has it (empty where it cannot be read: such a rank then
/// matches no other, and `Auto` picks TCP; the hierarchy by host sees one host then).
pub(super) fn host_name() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_string())
        .unwrap_or_default()
}

/// Whether the ranks (their table entries) run on shared memory; an error on every rank when
/// they ask for transports that cannot both hold, or for shared memory across hosts.
fn use_shm(table: &Table) -> Result<bool> {
    let parse = |e: &[u8]| -> Option<(u16, u8, bool, String)> {
        let port = u16::from_le_bytes([*e.first()?, *e.get(1)?]);
        let host = String::from_utf8_lossy(e.get(4..)?).into_owned();
        Some((port, *e.get(2)?, *e.get(3)? == 1, host))
    };
    let entries: Vec<_> = table
        .entries
        .iter()
        .map(|(_, e)| parse(e).ok_or_else(|| fail("a rank's rendezvous entry is malformed".into())))
        .collect::<Result<_>>()?;
    let wants = |code| entries.iter().any(|e| e.1 == code);
    let one_host = entries
        .iter()
        .all(|e| e.3 == entries[0].3 && !e.3.is_empty() && e.2);
    match (
        wants(Transport::SharedMemory.code()),
        wants(Transport::Tcp.code()),
    ) {
        (true, true) => Err(fail(
            "the ranks ask for different transports (WARPDRIVE_DIST_TRANSPORT shm and tcp)".into(),
        )),
        (true, false) if !one_host => {
            let hosts: Vec<&str> = entries.iter().map(|e| e.3.as_str()).collect();
            Err(fail(format!(
                "shared memory needs every rank on one host with {SHM_DIR}; the ranks run on \
                 {hosts:?}"
            )))
        }
        (true, false) => Ok(true),
        (false, true) => Ok(false),
        (false, false) => Ok(one_host),
    }
}

impl Procs {
    /// Joins the group `env` describes over `transport`: the rendezvous at rank 0, the TCP
    /// links between every pair, the shared-memory segment, then one round that every rank
    /// takes once all are linked (and have mapped the segment). Fails after `timeout`.
    pub(super) fn join(env: &LaunchEnv, transport: Transport, timeout: Duration) -> Result<Procs> {
        let deadline = Instant::now().checked_add(timeout);
        let far = deadline.unwrap_or_else(|| Instant::now() + Duration::from_secs(86_400 * 365));
        let listener = TcpListener::bind(("0.0.0.0", 0)).map_err(|e| {
            fail(format!(
                "rank {} cannot listen for its peers: {e}",
                env.rank
            ))
        })?;
        let port = listener
            .local_addr()
            .map_err(|e| fail(format!("rank {}'s listener: {e}", env.rank)))?
            .port();
        let job = if env.rank == 0 { job_token() } else { 0 };
        // Rank 0 makes the segment before any rank can learn its name (dropped, and unlinked,
        // if the ranks settle on TCP).
        let made = (env.rank == 0 && transport != Transport::Tcp && env.world > 0)
            .then(|| Segment::create(job, env.world));
        // A rank 0 that could not make the segment says so: `Auto` then picks TCP.
        let shm_ok = made.as_ref().is_none_or(|m| m.is_ok());
        let table = env.gather_table(&entry(port, transport, shm_ok), job, far)?;
        let shm = use_shm(&table)?;
        let master: IpAddr = env
            .master_addrs()?
            .first()
            .map(SocketAddr::ip)
            .ok_or_else(|| fail(format!("MASTER_ADDR {} has no address", env.master_addr)))?;
        let addrs = table
            .entries
            .iter()
            .map(|(seen, e)| {
                let port = u16::from_le_bytes([
                    e.first().copied().unwrap_or(0),
                    e.get(1).copied().unwrap_or(0),
                ]);
                dial_addr(*seen, master, port)
            })
            .collect::<Vec<_>>();
        let segment = match (shm, made) {
            (false, _) => None,
            (true, Some(made)) => Some(made?),
            (true, None) if env.rank == 0 => {
                return Err(fail("rank 0 made no segment for shared memory".into()))
            }
            (true, None) => None,
        };
        let mesh = Mesh::connect(env.rank, &addrs, listener, table.job, timeout, far)?;
        let segment = match segment {
            Some(s) => Some(s),
            None if shm => Some(Segment::open(table.job, env.world, env.rank)?),
            None => None,
        };
        if segment.is_some() && env.world > 1 {
            // Buffers from now on can be lent to the other ranks (the lent all-reduce).
            shared_host::enable();
        }
        let procs = Procs {
            rank: env.rank,
            world: env.world,
            timeout,
            mesh,
            shm: segment.map(RefCell::new),
            seq: Cell::new(0),
            step: Cell::new(0),
            own: RefCell::new(Payload::default()),
            cma: false,
            lend: std::env::var("WARPDRIVE_DIST_LEND").map_or(true, |v| v.trim() != "0"),
            mapped: RefCell::new((0..env.world).map(|_| Vec::new()).collect()),
            addrs,
            transport,
        };
        // Every rank linked (and mapped the segment): rank 0 can remove its file.
        let seq = procs.post("join", 0, |_| Ok(()), &|_, _| 0..0, deadline)?;
        procs.collect("join", seq, &|_, _| 0..0, deadline, |_| Ok(()))?;
        if let Some(s) = &procs.shm {
            s.borrow_mut().unlink();
        }
        let mut procs = procs;
        procs.cma = procs.shm.is_some() && procs.world > 1 && procs.probe_cma(deadline)?;
        Ok(procs)
    }

    /// Whether every rank can read every other's memory ([`cma`]), agreed in two rounds:
    /// each rank shows a word of its own for the others to read, then says whether it read
    /// all of theirs. `WARPDRIVE_DIST_CMA=0` on any rank turns it off for the group.
    fn probe_cma(&self, deadline: Option<Instant>) -> Result<bool> {
        const OP: &str = "join";
        let word: u64 = 0x5eed_c0de_0000_0000 ^ self.rank as u64;
        let shown = [cma::pid() as u64, &word as *const u64 as usize as u64, word];
        let whole = |_: usize, _: usize| WHOLE;
        let seq = self.post(OP, 24, |b| copy_in(b, &shown), &whole, deadline)?;
        let mut can = std::env::var("WARPDRIVE_DIST_CMA").map_or(true, |v| v.trim() != "0");
        self.collect(OP, seq, &whole, deadline, |parts| {
            for (q, p) in parts.iter().enumerate().filter(|&(q, _)| q != self.rank) {
                let w = typed::<u64>(p)?;
                let pid = w.first().and_then(|&p| i32::try_from(p).ok());
                can &= match (pid, w.get(1..3)) {
                    (Some(pid), Some(&[at, value])) => {
                        usize::try_from(at).is_ok_and(|at| cma::probe(pid, at, value))
                    }
                    _ => false,
                };
                if !can {
                    tracing::debug!("rank {}: cannot read rank {q}'s memory", self.rank);
                }
            }
            Ok(())
        })?;
        let verdict = [u64::from(can)];
        let seq = self.post(OP, 8, |b| copy_in(b, &verdict), &whole, deadline)?;
        let mut all = true;
        self.collect(OP, seq, &whole, deadline, |parts| {
            for p in parts {
                all &= typed::<u64>(p)?.first() == Some(&1);
            }
            Ok(())
        })?;
        // The word stays in memory, where the others read it, until every rank has.
        std::hint::black_box(&word);
        Ok(all)
    }

    pub(super) fn rank(&self) -> usize {
        self.rank
    }

    /// Where rank `q` is reached, for a sub-group that meets there ([`split`](super::Comm::split)).
    pub(super) fn address_of(&self, q: usize) -> Option<IpAddr> {
        self.addrs.get(q).map(SocketAddr::ip)
    }

    /// The transport for a sub-group: shared memory where this group has it, else what this
    /// rank asked for.
    pub(super) fn sub_transport(&self) -> Transport {
        if self.shm.is_some() {
            Transport::SharedMemory
        } else {
            self.transport
        }
    }

    pub(super) fn world(&self) -> usize {
        self.world
    }

    /// How the ranks exchange, in words.
    pub(super) fn how(&self) -> &'static str {
        match (&self.shm, self.cma) {
            (None, _) => "TCP",
            (Some(_), false) => "shared memory",
            (Some(_), true) => "shared memory, cross-memory attach",
        }
    }

    fn deadline(&self) -> Option<Instant> {
        Instant::now().checked_add(self.timeout)
    }

    /// Aborts the group (every rank's later calls fail) and returns `e`.
    fn abort(&self, op: &'static str, e: Error) -> Error {
        self.mesh
            .abort(&format!("rank {} failed in {op}: {e}", self.rank));
        e
    }

    fn timed_out(&self, op: &'static str, peer: usize, what: &str) -> Error {
        let step = self.step.get().saturating_sub(1);
        failed(
            op,
            format!(
                "rank {} waited {:?} in {op} (step {step}) for rank {peer}, which did not {what}",
                self.rank, self.timeout
            ),
        )
    }

    /// Posts this rank's part of the next round: `len` bytes that `fill` writes. `pieces(q,
    /// r)` is the byte range of rank `q`'s part that rank `r` reads (over TCP only those
    /// bytes travel). Returns the round's number, for [`collect`](Self::collect).
    fn post(
        &self,
        op: &'static str,
        len: usize,
        fill: impl FnOnce(&mut [u8]) -> Result<()>,
        pieces: &dyn Fn(usize, usize) -> Range<usize>,
        deadline: Option<Instant>,
    ) -> Result<u64> {
        let seq = self.seq.get() + 1;
        self.seq.set(seq);
        let Some(shm) = &self.shm else {
            let mut own = Payload::zeroed(len)?;
            fill(own.bytes_mut())?;
            for q in (0..self.world).filter(|&q| q != self.rank) {
                let piece = own
                    .bytes()
                    .get(clip(pieces(self.rank, q), len))
                    .ok_or_else(|| {
                        failed(
                            op,
                            format!("rank {}'s piece for rank {q} is out of its part", self.rank),
                        )
                    })?;
                self.mesh
                    .send(q, Kind::Round, (seq, 0), Payload::copy_of(piece)?)?;
            }
            *self.own.borrow_mut() = own;
            return Ok(seq);
        };
        if seq > 2 {
            for q in 0..self.world {
                let shm = shm.borrow();
                let check = || self.mesh.trouble(op, Some(q));
                if !shm.wait_consumed(q, seq - 2, deadline, check)? {
                    return Err(self.timed_out(op, q, "finish reading its last round"));
                }
            }
        }
        let mut shm = shm.borrow_mut();
        let slot = shm.slot_mut(self.rank, seq, len).ok_or_else(|| {
            failed(
                op,
                format!("a round of {len} bytes is more than a slot holds ({SLOT_BYTES})"),
            )
        })?;
        fill(slot)?;
        shm.post(self.rank, seq, len);
        Ok(seq)
    }

    /// Waits for every rank's part of round `seq` and hands `read` the piece of each that
    /// this rank reads (`pieces(q, rank)`), in rank order.
    fn collect(
        &self,
        op: &'static str,
        seq: u64,
        pieces: &dyn Fn(usize, usize) -> Range<usize>,
        deadline: Option<Instant>,
        read: impl FnOnce(&[&[u8]]) -> Result<()>,
    ) -> Result<()> {
        let me = self.rank;
        let out_of = |q: usize| {
            failed(
                op,
                format!("rank {q}'s part is shorter than rank {me} reads"),
            )
        };
        let Some(shm) = &self.shm else {
            let mut frames = Vec::with_capacity(self.world);
            for q in 0..self.world {
                if q == me {
                    frames.push(None);
                    continue;
                }
                let frame = self
                    .mesh
                    .take(op, q, Kind::Round, deadline)
                    .map_err(|e| match self.mesh.trouble(op, Some(q)) {
                        Some(_) => e,
                        None => self.timed_out(op, q, "send its part"),
                    })?;
                let got = frame.payload.bytes().len();
                if frame.tag.0 != seq || got != clip(pieces(q, me), got).len() {
                    return Err(failed(
                        op,
                        format!(
                            "rank {q} sent a part of round {} where {seq} was due",
                            frame.tag.0
                        ),
                    ));
                }
                frames.push(Some(frame));
            }
            let own = self.own.borrow();
            let mine = own
                .bytes()
                .get(clip(pieces(me, me), own.bytes().len()))
                .ok_or_else(|| out_of(me))?;
            let parts: Vec<&[u8]> = frames
                .iter()
                .map(|f| f.as_ref().map_or(mine, |f| f.payload.bytes()))
                .collect();
            return read(&parts);
        };
        let shm = shm.borrow();
        let mut parts = Vec::with_capacity(self.world);
        for q in 0..self.world {
            let check = || self.mesh.trouble(op, Some(q));
            if !shm.wait_posted(q, seq, deadline, check)? {
                return Err(self.timed_out(op, q, "arrive"));
            }
            let len = shm.posted_len(q, seq);
            let piece = shm
                .slot(q, seq, len)
                .and_then(|s| s.get(clip(pieces(q, me), len)))
                .ok_or_else(|| out_of(q))?;
            parts.push(piece);
        }
        let result = read(&parts);
        shm.consume(me, seq);
        result
    }

    /// Starts a step: every rank's call (or its refusal) in one round, compared. Returns the
    /// calls in rank order; an error, on every rank, when one was refused or they disagree.
    fn open(
        &self,
        op: &'static str,
        call: std::result::Result<&Call, String>,
    ) -> Result<Vec<Call>> {
        let step = self.step.get();
        self.step.set(step + 1);
        // Passed on as an abort: its frame reaches the others before this rank's connections
        // close, so they learn which rank left first, not that this one did.
        if let Some(e) = self.mesh.trouble(op, None) {
            return Err(self.abort(op, e));
        }
        let words: Vec<u64> = match call {
            Ok(call) => std::iter::once(0).chain(call.encode()).collect(),
            Err(why) => {
                let mut text = why.into_bytes();
                let len = text.len() as u64;
                text.resize(text.len().next_multiple_of(8), 0);
                let packed = text.chunks_exact(8).map(|w| {
                    let mut b = [0u8; 8];
                    b.copy_from_slice(w);
                    u64::from_le_bytes(b)
                });
                [1, len].into_iter().chain(packed).collect()
            }
        };
        let blob: &[u8] = bytemuck::cast_slice(&words);
        let deadline = self.deadline();
        // The parts differ in length: every rank reads every part whole.
        let whole = |_: usize, _: usize| WHOLE;
        let seq = self
            .post(op, blob.len(), |b| copy_in(b, blob), &whole, deadline)
            .map_err(|e| self.abort(op, e))?;
        let mut outcome: Vec<std::result::Result<Call, String>> = Vec::new();
        self.collect(op, seq, &whole, deadline, |parts| {
            outcome.extend(parts.iter().map(|p| decode(p)));
            Ok(())
        })
        .map_err(|e| self.abort(op, e))?;
        let mut calls = Vec::with_capacity(self.world);
        for (q, got) in outcome.into_iter().enumerate() {
            match got {
                Ok(call) => calls.push(call),
                Err(why) => {
                    let whose = if q == self.rank {
                        "this rank's".to_string()
                    } else {
                        format!("rank {q}'s")
                    };
                    return Err(failed(
                        op,
                        format!("{whose} call at step {step} was refused: {why}"),
                    ));
                }
            }
        }
        let refs: Vec<&Call> = calls.iter().collect();
        if !Call::agree(&refs) {
            return Err(Call::disagreement(op, step, &refs));
        }
        Ok(calls)
    }

    /// A call that failed its own checks still takes its step (the others learn of it at
    /// once and the steps stay in line); returns `error`.
    pub(super) fn refuse(&self, op: &'static str, error: Error) -> Result<()> {
        let _ = self.open(op, Err(error.to_string()));
        Err(error)
    }

    /// Runs `rounds` (the data rounds of a step), aborting the group when they fail.
    fn data<R>(&self, op: &'static str, rounds: impl FnOnce() -> Result<R>) -> Result<R> {
        rounds().map_err(|e| self.abort(op, e))
    }

    pub(super) fn all_reduce<T: Float>(
        &self,
        call: Call,
        data: &mut [T],
        op: ReduceOp,
    ) -> Result<()> {
        const OP: &str = "all_reduce";
        self.open(OP, Ok(&call))?;
        let (n, me, size) = (self.world, self.rank, size_of::<T>());
        // Every rank takes the same path: `lend` is this rank's alone, so it only changes
        // what this rank shows in the direct path's first round.
        let direct = self.shm.is_some() && n > 1;
        if direct && data.len().saturating_mul(size) >= CMA_FROM_BYTES {
            let done = self.data(OP, || self.all_reduce_direct(data, op))?;
            if done {
                return Ok(());
            }
        }
        let per = chunk_elems::<T>(1);
        self.data(OP, || {
            for k in (0..data.len()).step_by(per.max(1)) {
                let s = per.min(data.len() - k);
                let deadline = self.deadline();
                // Round 1: every rank's chunk; rank r reads part r of each and reduces it.
                let a = |_: usize, r: usize| bytes(part(s, n, r), size);
                let chunk = &data[k..k + s];
                let seq = self.post(OP, s * size, |b| copy_in(b, chunk), &a, deadline)?;
                let mine = part(s, n, me);
                let out = &mut data[k + mine.start..k + mine.end];
                self.collect(OP, seq, &a, deadline, |parts| {
                    let inputs = parts
                        .iter()
                        .map(|p| typed::<T>(p))
                        .collect::<Result<Vec<_>>>()?;
                    reduce(op, &inputs, out);
                    Ok(())
                })?;
                // Round 2: every rank's reduced part, to every rank.
                let b = |q: usize, _: usize| bytes(0..part(s, n, q).len(), size);
                let reduced = &data[k + mine.start..k + mine.end];
                let seq = self.post(
                    OP,
                    reduced.len() * size,
                    |b| copy_in(b, reduced),
                    &b,
                    deadline,
                )?;
                let chunk = &mut data[k..k + s];
                self.collect(OP, seq, &b, deadline, |parts| {
                    for (q, p) in parts.iter().enumerate().filter(|&(q, _)| q != me) {
                        chunk[part(s, n, q)].copy_from_slice(typed::<T>(p)?);
                    }
                    Ok(())
                })?;
            }
            Ok(())
        })
    }

    pub(super) fn broadcast<T: DType>(
        &self,
        call: Call,
        data: &mut [T],
        root: usize,
    ) -> Result<()> {
        const OP: &str = "broadcast";
        self.open(OP, Ok(&call))?;
        let (me, size) = (self.rank, size_of::<T>());
        let per = chunk_elems::<T>(1);
        self.data(OP, || {
            for k in (0..data.len()).step_by(per.max(1)) {
                let s = per.min(data.len() - k);
                let deadline = self.deadline();
                let pieces = |q: usize, _: usize| if q == root { 0..s * size } else { 0..0 };
                let len = if me == root { s * size } else { 0 };
                let chunk = &data[k..k + s];
                let seq = self.post(
                    OP,
                    len,
                    |b| copy_in(b, &chunk[..b.len() / size]),
                    &pieces,
                    deadline,
                )?;
                let chunk = &mut data[k..k + s];
                self.collect(OP, seq, &pieces, deadline, |parts| {
                    if me != root {
                        chunk.copy_from_slice(typed::<T>(parts[root])?);
                    }
                    Ok(())
                })?;
            }
            Ok(())
        })
    }

    pub(super) fn all_gather<T: DType>(
        &self,
        call: Call,
        input: &[T],
        output: &mut [T],
    ) -> Result<()> {
        const OP: &str = "all_gather";
        self.open(OP, Ok(&call))?;
        let (m, size) = (input.len(), size_of::<T>());
        let per = chunk_elems::<T>(1);
        self.data(OP, || {
            for k in (0..m).step_by(per.max(1)) {
                let s = per.min(m - k);
                let deadline = self.deadline();
                let pieces = |_: usize, _: usize| 0..s * size;
                let chunk = &input[k..k + s];
                let seq = self.post(OP, s * size, |b| copy_in(b, chunk), &pieces, deadline)?;
                self.collect(OP, seq, &pieces, deadline, |parts| {
                    for (q, p) in parts.iter().enumerate() {
                        output[q * m + k..q * m + k + s].copy_from_slice(typed::<T>(p)?);
                    }
                    Ok(())
                })?;
            }
            Ok(())
        })
    }

    pub(super) fn reduce_scatter<T: Float>(
        &self,
        call: Call,
        input: &[T],
        output: &mut [T],
        op: ReduceOp,
    ) -> Result<()> {
        const OP: &str = "reduce_scatter";
        self.open(OP, Ok(&call))?;
        let (n, m, size) = (self.world, output.len(), size_of::<T>());
        let per = chunk_elems::<T>(n);
        self.data(OP, || {
            for k in (0..m).step_by(per.max(1)) {
                let s = per.min(m - k);
                let deadline = self.deadline();
                let stride = (s * size).next_multiple_of(8);
                let pieces = |_: usize, r: usize| r * stride..r * stride + s * size;
                let fill = |b: &mut [u8]| {
                    (0..n).try_for_each(|d| {
                        copy_in(&mut b[pieces(0, d)], &input[d * m + k..d * m + k + s])
                    })
                };
                let seq = self.post(OP, n * stride, fill, &pieces, deadline)?;
                let out = &mut output[k..k + s];
                self.collect(OP, seq, &pieces, deadline, |parts| {
                    let inputs = parts
                        .iter()
                        .map(|p| typed::<T>(p))
                        .collect::<Result<Vec<_>>>()?;
                    reduce(op, &inputs, out);
                    Ok(())
                })?;
            }
            Ok(())
        })
    }

    /// All-to-all, equal (`call` without counts: `input.len() / world` for every pair) or
    /// with the per-rank counts every rank's call carries.
    pub(super) fn all_to_all<T: DType>(
        &self,
        call: Call,
        input: &[T],
        output: &mut [T],
    ) -> Result<()> {
        let op = call.op;
        let calls = self.open(op, Ok(&call))?;
        let (n, me, size) = (self.world, self.rank, size_of::<T>());
        let table: Vec<Vec<usize>> = calls
            .iter()
            .map(|c| match &c.counts {
                Some((send, _)) => send.clone(),
                None => vec![c.input / n; n],
            })
            .collect();
        let offsets = |row: &mut dyn Iterator<Item = usize>| {
            let mut at = 0usize;
            row.map(|c| {
                let o = at;
                at = at.saturating_add(c);
                o
            })
            .collect::<Vec<usize>>()
        };
        let send_at = offsets(&mut table[me].iter().copied());
        let recv_at = offsets(&mut (0..n).map(|q| table[q][me]));
        let most = table.iter().flatten().copied().max().unwrap_or(0);
        let per = chunk_elems::<T>(n);
        self.data(op, || {
            for lo in (0..most).step_by(per.max(1)) {
                let deadline = self.deadline();
                let len = |q: usize, d: usize| table[q][d].saturating_sub(lo).min(per);
                let stride = per * size;
                let pieces = |q: usize, r: usize| r * stride..r * stride + len(q, r) * size;
                let fill = |b: &mut [u8]| {
                    (0..n).try_for_each(|d| {
                        let from = send_at[d] + lo.min(table[me][d]);
                        copy_in(&mut b[pieces(me, d)], &input[from..from + len(me, d)])
                    })
                };
                let seq = self.post(op, n * stride, fill, &pieces, deadline)?;
                self.collect(op, seq, &pieces, deadline, |parts| {
                    for (q, p) in parts.iter().enumerate() {
                        let to = recv_at[q] + lo.min(table[q][me]);
                        output[to..to + len(q, me)].copy_from_slice(typed::<T>(p)?);
                    }
                    Ok(())
                })?;
            }
            Ok(())
        })
    }

    /// Queues `data` for rank `to`; returns once it is copied.
    pub(super) fn send<T: DType>(&self, to: usize, data: &[T]) -> Result<()> {
        let tag = (dtype_code(T::KIND), data.len() as u64);
        let payload = Payload::copy_of(bytemuck::cast_slice(data))?;
        self.mesh.send(to, Kind::Message, tag, payload)
    }

    /// Receives the next message from rank `from` into `data`: the same type and length, or
    /// an error that aborts the group (the pair's messages no longer match).
    pub(super) fn recv<T: DType>(&self, from: usize, data: &mut [T]) -> Result<()> {
        const OP: &str = "recv";
        let frame = self
            .mesh
            .take(OP, from, Kind::Message, self.deadline())
            .map_err(|e| match self.mesh.trouble(OP, Some(from)) {
                Some(_) => e,
                None => {
                    let reason = format!(
                        "rank {} waited {:?} in recv for a message from rank {from}",
                        self.rank, self.timeout
                    );
                    self.abort(OP, failed(OP, format!("{reason}; the group is aborted")))
                }
            })?;
        let want = (dtype_code(T::KIND), data.len() as u64);
        if frame.tag != want {
            let name = super::call::dtype_name(frame.tag.0);
            let reason = format!(
                "rank {} received {name} × {} from rank {from} into a buffer of {} × {}",
                self.rank,
                frame.tag.1,
                T::KIND.name(),
                data.len()
            );
            return Err(self.abort(OP, failed(OP, format!("{reason}; the group is aborted"))));
        }
        data.copy_from_slice(typed::<T>(frame.payload.bytes())?);
        Ok(())
    }
}

/// The piece of a part that is all of it, whatever its length.
const WHOLE: Range<usize> = 0..usize::MAX;

/// `r` with [`WHOLE`]'s end taken as the part's length `len`.
fn clip(r: Range<usize>, len: usize) -> Range<usize> {
    if r.end == usize::MAX {
        r.start..len
    } else {
        r
    }
}

/// A port free on this host now (bound, then released), where a sub-group's first rank
/// gathers the others.
pub(super) fn free_port() -> Result<u16> {
    TcpListener::bind(("0.0.0.0", 0))
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .map_err(|e| failed("split", format!("no free port for a sub-group: {e}")))
}

/// A job token no other job on the host has: the file name of its segment.
fn job_token() -> u64 {
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    rand::random::<u64>() ^ t.rotate_left(17) ^ u64::from(std::process::id())
}

/// Elements of `T` a round moves for each of `pieces` destinations: a slot's worth, a whole
/// number of 8-element units (so every piece starts 8-byte aligned), at least one unit.
fn chunk_elems<T>(pieces: usize) -> usize {
    let per = SLOT_BYTES / size_of::<T>().max(1) / pieces.max(1);
    (per / 8 * 8).max(8)
}

/// Part `r` of a chunk of `s` elements split over `n` ranks, in whole 8-element units (so
/// each part starts 8-byte aligned in the chunk).
fn part(s: usize, n: usize, r: usize) -> Range<usize> {
    let (a, b) = share(s.div_ceil(8), n, r);
    (a * 8).min(s)..(b * 8).min(s)
}

fn bytes(r: Range<usize>, size: usize) -> Range<usize> {
    r.start * size..r.end * size
}

fn copy_in<T: DType>(dst: &mut [u8], src: &[T]) -> Result<()> {
    let src: &[u8] = bytemuck::cast_slice(src);
    dst.get_mut(..src.len())
        .ok_or_else(|| failed("step", "a part is shorter than its data".into()))?
        .copy_from_slice(src);
    Ok(())
}

fn typed_mut<T: DType>(b: &mut [u8]) -> Result<&mut [T]> {
    let len = b.len();
    bytemuck::try_cast_slice_mut(b).map_err(|e| {
        failed(
            "step",
            format!("a part of {len} bytes as {}: {e}", T::KIND.name()),
        )
    })
}

fn typed<T: DType>(b: &[u8]) -> Result<&[T]> {
    bytemuck::try_cast_slice(b).map_err(|e| {
        failed(
            "step",
            format!("a part of {} bytes as {}: {e}", b.len(), T::KIND.name()),
        )
    })
}

/// A rank's first round: its call, or why it refused.
fn decode(part: &[u8]) -> std::result::Result<Call, String> {
    let Ok(words) = bytemuck::try_cast_slice::<u8, u64>(part) else {
        return Err("a call this rank cannot read".into());
    };
    match words.split_first() {
        Some((0, call)) => Call::decode(call).map_err(|e| e.to_string()),
        Some((1, rest)) => {
            let len = rest.first().map_or(0, |&l| l as usize);
            let text: &[u8] = bytemuck::cast_slice(rest.get(1..).unwrap_or(&[]));
            Err(String::from_utf8_lossy(&text[..len.min(text.len())]).into_owned())
        }
        _ => Err("a call this rank cannot read".into()),
    }
}

fn failed(op: &'static str, detail: String) -> Error {
    Error::Collective { op, detail }
}

fn fail(detail: String) -> Error {
    failed("bootstrap", detail)
}
