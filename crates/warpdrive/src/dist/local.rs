//! The in-process group behind [`Comm::local_group`](super::Comm::local_group): shared slots
//! that each rank deposits its input in, barriers with generation counts and timeouts, and
//! per-pair mailboxes for send / receive.
//!
//! A collective is a step: the rank deposits its input in its slot for the step's parity,
//! arrives at a barrier with a description of its call, compares every rank's description,
//! then reads the other ranks' slots. All-reduce deposits nothing: the ranks lend their
//! buffers to one another ([`Lending`]) and rank `r` reduces slice `r` of every buffer in
//! place, each element read once and written once a rank. Slots alternate by step parity: a
//! rank writes its slot of parity `p` again only at step `s + 2`, after the first barrier of
//! step `s + 1`, which every rank reaches only once done reading step `s`.

use std::cell::Cell;
use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex, MutexGuard, RwLock};

use super::call::Call;
use super::ReduceOp;
use crate::device::lending::{LendError, Lending};
use crate::dtype::{DType, DTypeKind, Float};
use crate::error::{Error, Result};

/// A rank's arrival at a step's first barrier.
#[derive(Debug, Clone)]
enum Arrival {
    Call(Call),
    /// The call failed its own checks (the reason); the rank takes no further part.
    Refused(String),
}

/// One rank's part in the step protocol: its rank and its step counter.
pub(super) struct Member<'c> {
    pub(super) rank: usize,
    pub(super) step: &'c Cell<u64>,
}

/// A message between two ranks.
struct Message {
    dtype: DTypeKind,
    len: usize,
    data: Vec<u64>,
}

struct State {
    /// Barriers each rank has arrived at.
    ticks: Vec<u64>,
    /// Each rank's arrival at the first barrier of the last step of each parity.
    arrivals: [Vec<Option<Arrival>>; 2],
    /// Why the group was aborted; every call from then on fails with it.
    abort: Option<String>,
    /// Each rank that dropped its `Comm`: in which order it left, and how. Collectives fail
    /// from then on, and so do sends to it and receives from it once its messages are taken.
    left: Vec<Option<(usize, &'static str)>>,
    /// Ranks that have left.
    departures: usize,
    /// Messages sent and not yet received, at `from * world + to`.
    mail: Vec<VecDeque<Message>>,
    /// Received messages' storage, for the next sends.
    spare: Vec<Vec<u64>>,
}

/// The shared state of an in-process group.
pub(super) struct Group {
    world: usize,
    timeout: Duration,
    state: Mutex<State>,
    changed: Condvar,
    /// Each rank's deposit, per step parity (u64 words so any element type aligns).
    deposits: Vec<[RwLock<Vec<u64>>; 2]>,
    /// The ranks' buffers lent to one another during an all-reduce.
    lending: Lending,
    /// Subgroups being made by a split, by (step, color).
    splits: Mutex<HashMap<(u64, u64), Subgroup>>,
}

/// A subgroup a split made, and how many of its ranks have yet to take it.
type Subgroup = (Arc<Group>, usize);

fn failed(op: &'static str, detail: String) -> Error {
    Error::Collective { op, detail }
}

/// A vector of `n` values from `f`, or an error when the host cannot hold it.
fn vec_of<V>(n: usize, f: impl FnMut(usize) -> V) -> Result<Vec<V>> {
    let mut v = Vec::new();
    v.try_reserve_exact(n).map_err(|_| {
        Error::InvalidArgument(format!(
            "Comm::local_group: no memory for the state of {n} ranks"
        ))
    })?;
    v.extend((0..n).map(f));
    Ok(v)
}

impl Group {
    pub(super) fn new(world: usize, timeout: Duration) -> Result<Group> {
        let pairs = crate::size::product("Comm::local_group: rank pairs", &[world, world])?;
        let slots = |_| [RwLock::new(Vec::new()), RwLock::new(Vec::new())];
        Ok(Group {
            world,
            timeout,
            state: Mutex::new(State {
                ticks: vec_of(world, |_| 0)?,
                arrivals: [vec_of(world, |_| None)?, vec_of(world, |_| None)?],
                abort: None,
                left: vec_of(world, |_| None)?,
                departures: 0,
                mail: vec_of(pairs, |_| VecDeque::new())?,
                spare: Vec::new(),
            }),
            changed: Condvar::new(),
            deposits: vec_of(world, slots)?,
            lending: Lending::new(world),
            splits: Mutex::new(HashMap::new()),
        })
    }

    /// When a call entered now gives up (`None`: the timeout is too long to be a time).
    fn deadline(&self) -> Option<Instant> {
        Instant::now().checked_add(self.timeout)
    }

    /// Aborts the group (the first reason stays) and wakes every waiting rank.
    fn abort(&self, state: &mut State, reason: String) {
        if state.abort.is_none() {
            state.abort = Some(reason);
        }
        self.changed.notify_all();
    }

    /// The rank's `Comm` was dropped: the others' collectives fail from now on; a rank that
    /// panicked aborts the whole group.
    pub(super) fn leave(&self, rank: usize) {
        let panicked = std::thread::panicking();
        let how = if panicked {
            "while its thread panicked"
        } else {
            "(its thread finished or let it go)"
        };
        let mut state = self.state.lock();
        state.left[rank] = Some((state.departures, how));
        state.departures += 1;
        if panicked {
            self.abort(&mut state, Self::left_detail(rank, how));
        }
        self.changed.notify_all();
    }

    fn left_detail(rank: usize, how: &str) -> String {
        format!("rank {rank} left the group: its Comm was dropped {how}")
    }

    /// The error of a call that needs one of `ranks` after it left (the first of them to
    /// leave: the others may have left because of it), or of any call after the group was
    /// aborted.
    fn broken(
        state: &State,
        op: &'static str,
        ranks: impl Iterator<Item = usize>,
    ) -> Option<Error> {
        if let Some(reason) = &state.abort {
            return Some(Self::aborted(op, reason));
        }
        ranks
            .filter_map(|q| state.left[q].map(|(order, how)| (order, q, how)))
            .min()
            .map(|(_, q, how)| failed(op, Self::left_detail(q, how)))
    }

    fn aborted(op: &'static str, reason: &str) -> Error {
        failed(op, format!("the group is aborted: {reason}"))
    }

    /// Waits for a change to the group's state until `deadline` (none: for as long as it
    /// takes); true when it timed out.
    fn wait(&self, state: &mut MutexGuard<'_, State>, deadline: Option<Instant>) -> bool {
        match deadline {
            Some(deadline) => self.changed.wait_until(state, deadline).timed_out(),
            None => {
                self.changed.wait(state);
                false
            }
        }
    }

    /// Arrives at the rank's next barrier and waits for every rank to arrive there. A rank
    /// still missing at `deadline` aborts the group.
    fn barrier(
        &self,
        state: &mut MutexGuard<'_, State>,
        who: &Member<'_>,
        op: &'static str,
        deadline: Option<Instant>,
    ) -> Result<()> {
        let tick = state.ticks[who.rank] + 1;
        state.ticks[who.rank] = tick;
        self.changed.notify_all();
        loop {
            if state.ticks.iter().all(|&t| t >= tick) {
                return Ok(());
            }
            let missing = (0..self.world).filter(|&q| state.ticks[q] < tick);
            if let Some(e) = Self::broken(state, op, missing) {
                return Err(e);
            }
            let timed_out = self.wait(state, deadline);
            if timed_out && !state.ticks.iter().all(|&t| t >= tick) {
                let missing: Vec<usize> =
                    (0..self.world).filter(|&q| state.ticks[q] < tick).collect();
                let step = who.step.get().saturating_sub(1);
                let reason = format!(
                    "rank {} waited {:?} in {op} (step {step}) for ranks {missing:?}, which did \
                     not arrive",
                    who.rank, self.timeout
                );
                self.abort(state, reason.clone());
                return Err(failed(op, format!("{reason}; the group is aborted")));
            }
        }
    }

    /// Starts a step: deposits `data` (when given) in the rank's slot, arrives with `call`
    /// and checks that every rank asked for the same. Returns the step's parity.
    fn open<T: DType>(
        &self,
        who: &Member<'_>,
        op: &'static str,
        arrival: std::result::Result<Call, String>,
        data: Option<&[T]>,
    ) -> Result<usize> {
        let deadline = self.deadline();
        if let Some(e) = Self::broken(&self.state.lock(), op, 0..self.world) {
            return Err(e);
        }
        let step = who.step.get();
        who.step.set(step + 1);
        let parity = (step % 2) as usize;
        let mut arrival = match arrival {
            Ok(call) => Arrival::Call(call),
            Err(why) => Arrival::Refused(why),
        };
        if let (Arrival::Call(_), Some(data)) = (&arrival, data) {
            if let Err(e) = store(&mut self.deposits[who.rank][parity].write(), data) {
                arrival = Arrival::Refused(e.to_string());
            }
        }
        let mut state = self.state.lock();
        state.arrivals[parity][who.rank] = Some(arrival);
        self.barrier(&mut state, who, op, deadline)?;
        let arrivals = &state.arrivals[parity];
        for (q, arrival) in arrivals.iter().enumerate() {
            if let Some(Arrival::Refused(why)) = arrival {
                let whose = if q == who.rank {
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
        let calls: Vec<&Call> = arrivals
            .iter()
            .filter_map(|a| match a {
                Some(Arrival::Call(call)) => Some(call),
                _ => None,
            })
            .collect();
        if calls.len() != self.world || !Call::agree(&calls) {
            return Err(Call::disagreement(op, step, &calls));
        }
        Ok(parity)
    }

    /// A call that failed its own checks still takes its step, so the other ranks learn of it
    /// at once and the steps stay in line; returns `error`.
    pub(super) fn refuse(&self, who: Member<'_>, op: &'static str, error: Error) -> Result<()> {
        // The step's outcome is known here whatever the others did: this call's own error.
        let _ = self.open::<u8>(&who, op, Err(error.to_string()), None);
        Err(error)
    }

    /// Aborts the group when `result` (the rest of a step, after its first barrier) failed:
    /// the other ranks would otherwise wait for this one.
    fn or_abort<R>(&self, who: &Member<'_>, op: &'static str, result: Result<R>) -> Result<R> {
        if let Err(e) = &result {
            let mut state = self.state.lock();
            self.abort(&mut state, format!("rank {} failed in {op}: {e}", who.rank));
        }
        result
    }

    /// The ranks' deposits of a step, read-locked.
    fn read_deposits(&self, parity: usize) -> Vec<parking_lot::RwLockReadGuard<'_, Vec<u64>>> {
        self.deposits.iter().map(|d| d[parity].read()).collect()
    }

    pub(super) fn all_reduce<T: Float>(
        &self,
        who: Member<'_>,
        call: Call,
        data: &mut [T],
        op: ReduceOp,
    ) -> Result<()> {
        const OP: &str = "all_reduce";
        let deadline = self.deadline();
        self.open::<T>(&who, OP, Ok(call), None)?;
        let result = self
            .lending
            .lend(who.rank, data, deadline, |parts| reduce_pooled(op, parts))
            .map_err(|e| {
                failed(
                    OP,
                    match e {
                        LendError::Missing(ranks) => format!(
                            "ranks {ranks:?} did not lend their buffers within {:?}",
                            self.timeout
                        ),
                        LendError::Mismatch(lens) => {
                            format!("the ranks lent buffers of (elements, bytes each) {lens:?}")
                        }
                        LendError::BadRank(r) => format!("rank {r} is outside the group"),
                    },
                )
            });
        self.or_abort(&who, OP, result)
    }

    pub(super) fn broadcast<T: DType>(
        &self,
        who: Member<'_>,
        call: Call,
        data: &mut [T],
        root: usize,
    ) -> Result<()> {
        const OP: &str = "broadcast";
        let mine = (who.rank == root).then_some(&*data);
        let parity = self.open(&who, OP, Ok(call), mine)?;
        if who.rank == root {
            return Ok(());
        }
        let len = data.len();
        let result = view::<T>(&self.deposits[root][parity].read(), len)
            .map(|from| data.copy_from_slice(from));
        self.or_abort(&who, OP, result)
    }

    /// The subgroup of `color` made by the split at step `at` (`world` ranks): the first of
    /// its ranks to ask makes it, the others take the same one.
    pub(super) fn subgroup(&self, at: u64, color: u64, world: usize) -> Result<Arc<Group>> {
        let mut splits = self.splits.lock();
        if let Some((group, waiting)) = splits.get_mut(&(at, color)) {
            let group = group.clone();
            *waiting -= 1;
            if *waiting == 0 {
                splits.remove(&(at, color));
            }
            return Ok(group);
        }
        let group = Arc::new(Group::new(world, self.timeout)?);
        if world > 1 {
            splits.insert((at, color), (group.clone(), world - 1));
        }
        Ok(group)
    }

    pub(super) fn all_gather<T: DType>(
        &self,
        who: Member<'_>,
        call: Call,
        input: &[T],
        output: &mut [T],
    ) -> Result<()> {
        const OP: &str = "all_gather";
        let parity = self.open(&who, OP, Ok(call), Some(input))?;
        let result = self.gather(&who, parity, input, 0..input.len(), output);
        self.or_abort(&who, OP, result)
    }

    pub(super) fn reduce_scatter<T: Float>(
        &self,
        who: Member<'_>,
        call: Call,
        input: &[T],
        output: &mut [T],
        op: ReduceOp,
    ) -> Result<()> {
        const OP: &str = "reduce_scatter";
        let parity = self.open(&who, OP, Ok(call), Some(input))?;
        let (len, m) = (input.len(), output.len());
        let result = (|| {
            let deposits = self.read_deposits(parity);
            let start = who.rank * m;
            let inputs = deposits
                .iter()
                .map(|d| Ok(&view::<T>(d, len)?[start..start + m]))
                .collect::<Result<Vec<&[T]>>>()?;
            reduce(op, &inputs, output);
            Ok(())
        })();
        self.or_abort(&who, OP, result)
    }

    pub(super) fn all_to_all<T: DType>(
        &self,
        who: Member<'_>,
        call: Call,
        input: &[T],
        output: &mut [T],
    ) -> Result<()> {
        const OP: &str = "all_to_all";
        let parity = self.open(&who, OP, Ok(call), Some(input))?;
        let c = input.len() / self.world;
        let result = self.gather(
            &who,
            parity,
            input,
            who.rank * c..(who.rank + 1) * c,
            output,
        );
        self.or_abort(&who, OP, result)
    }

    /// All-to-all with per-rank counts: rank `q`'s chunk for this rank (its offset the sum
    /// of what it sends to the ranks before this one) lands at this rank's offset for `q`.
    pub(super) fn all_to_all_v<T: DType>(
        &self,
        who: Member<'_>,
        call: Call,
        input: &[T],
        output: &mut [T],
    ) -> Result<()> {
        const OP: &str = "all_to_all_v";
        let parity = self.open(&who, OP, Ok(call), Some(input))?;
        let result = (|| {
            let rows: Vec<(Vec<usize>, usize)> = {
                let state = self.state.lock();
                state.arrivals[parity]
                    .iter()
                    .map(|a| match a {
                        Some(Arrival::Call(Call {
                            counts: Some((send, _)),
                            input,
                            ..
                        })) => Ok((send.clone(), *input)),
                        _ => Err(failed(OP, "a rank's counts went missing".into())),
                    })
                    .collect::<Result<_>>()?
            };
            let mut at = 0;
            for (q, (send, len)) in rows.iter().enumerate() {
                let from: usize = send[..who.rank].iter().sum();
                let n = send[who.rank];
                let chunk = &mut output[at..at + n];
                if q == who.rank {
                    chunk.copy_from_slice(&input[from..from + n]);
                } else {
                    let deposit = self.deposits[q][parity].read();
                    chunk.copy_from_slice(&view::<T>(&deposit, *len)?[from..from + n]);
                }
                at += n;
            }
            Ok(())
        })();
        self.or_abort(&who, OP, result)
    }

    /// Fills chunk `q` of `output` with `part` of rank `q`'s deposit (this rank's own
    /// `input` for its chunk): all-gather takes whole deposits, all-to-all one chunk of each.
    fn gather<T: DType>(
        &self,
        who: &Member<'_>,
        parity: usize,
        input: &[T],
        part: std::ops::Range<usize>,
        output: &mut [T],
    ) -> Result<()> {
        for (q, chunk) in output.chunks_exact_mut(part.len().max(1)).enumerate() {
            if q == who.rank {
                chunk.copy_from_slice(&input[part.clone()]);
            } else {
                let deposit = self.deposits[q][parity].read();
                chunk.copy_from_slice(&view::<T>(&deposit, input.len())?[part.clone()]);
            }
        }
        Ok(())
    }

    pub(super) fn send<T: DType>(&self, from: usize, to: usize, data: &[T]) -> Result<()> {
        const OP: &str = "send";
        let mut storage = {
            let mut state = self.state.lock();
            if let Some(e) = Self::broken(&state, OP, std::iter::once(to)) {
                return Err(e);
            }
            state.spare.pop().unwrap_or_default()
        };
        store(&mut storage, data)?;
        let mut state = self.state.lock();
        if let Some(e) = Self::broken(&state, OP, std::iter::once(to)) {
            return Err(e);
        }
        state.mail[from * self.world + to].push_back(Message {
            dtype: T::KIND,
            len: data.len(),
            data: storage,
        });
        self.changed.notify_all();
        Ok(())
    }

    pub(super) fn recv<T: DType>(&self, to: usize, from: usize, data: &mut [T]) -> Result<()> {
        const OP: &str = "recv";
        let deadline = self.deadline();
        let mut state = self.state.lock();
        let message = loop {
            // Messages sent before the group was aborted (a sender that finished) still arrive.
            if let Some(message) = state.mail[from * self.world + to].pop_front() {
                break message;
            }
            if let Some(e) = Self::broken(&state, OP, std::iter::once(from)) {
                return Err(e);
            }
            let timed_out = self.wait(&mut state, deadline);
            if timed_out && state.mail[from * self.world + to].is_empty() {
                let reason = format!(
                    "rank {to} waited {:?} in recv for a message from rank {from}",
                    self.timeout
                );
                self.abort(&mut state, reason.clone());
                return Err(failed(OP, format!("{reason}; the group is aborted")));
            }
        };
        drop(state);
        let result = if message.dtype != T::KIND || message.len != data.len() {
            Err(format!(
                "rank {to} received {} × {} from rank {from} into a buffer of {} × {}",
                message.dtype.name(),
                message.len,
                T::KIND.name(),
                data.len()
            ))
        } else {
            view::<T>(&message.data, message.len)
                .map(|from| data.copy_from_slice(from))
                .map_err(|e| e.to_string())
        };
        let mut state = self.state.lock();
        if state.spare.len() < self.world {
            state.spare.push(message.data);
        }
        result.map_err(|reason| {
            self.abort(&mut state, reason.clone());
            failed(OP, format!("{reason}; the group is aborted"))
        })
    }
}

/// Elements a reduction works on at once: its f64 accumulator stays in the L1 cache.
const BLOCK: usize = 2048;

/// Reduces element-wise over `inputs` into `out`: in f64, in rank order, rounded once.
pub(super) fn reduce<T: Float>(op: ReduceOp, inputs: &[&[T]], out: &mut [T]) {
    for (b, out) in out.chunks_mut(BLOCK).enumerate() {
        let range = b * BLOCK..b * BLOCK + out.len();
        reduce_block(op, inputs.iter().map(|x| &x[range.clone()]), out);
    }
}

/// Reduces element-wise over `parts` (the same range of every rank's buffer, in rank order)
/// and writes the result into every part: in f64, in rank order, rounded once.
/// A rank's slice from this many bytes is reduced by the host's copy threads in
/// [`POOL_CHUNK_BYTES`] pieces: one thread per rank reads memory at a fraction of what the
/// machine's cores can (the group's all-reduce on 16-core hosts ran at 30% of its bound).
const POOLED_FROM_BYTES: usize = 4 << 20;
const POOL_CHUNK_BYTES: usize = 1 << 20;

/// One piece of every rank's share, and whether a copy thread has reduced it.
type Piece<'a, T> = (bool, Vec<&'a mut [T]>);

/// [`reduce_in_place`], split over the copy threads for large slices. A piece a worker did
/// not finish (the pool could not run it) is reduced on this thread, so the result is whole.
pub(super) fn reduce_pooled<T: Float>(op: ReduceOp, parts: &mut [&mut [T]]) {
    let len = parts.first().map_or(0, |p| p.len());
    let workers = crate::transfer::workers(&crate::Device::cpu());
    if len.saturating_mul(size_of::<T>()) < POOLED_FROM_BYTES || workers.threads() <= 1 {
        return reduce_in_place(op, parts);
    }
    let chunk = (POOL_CHUNK_BYTES / size_of::<T>()).next_multiple_of(BLOCK);
    let mut pieces: Vec<Mutex<Piece<'_, T>>> = (0..len.div_ceil(chunk))
        .map(|_| Mutex::new((false, Vec::with_capacity(parts.len()))))
        .collect();
    for p in parts.iter_mut() {
        for (i, c) in p.chunks_mut(chunk).enumerate() {
            pieces[i].get_mut().1.push(c);
        }
    }
    let ran = workers.run(pieces.len(), &|i| {
        let mut piece = pieces[i].lock();
        reduce_in_place(op, &mut piece.1);
        piece.0 = true;
    });
    if let Err(e) = ran {
        tracing::warn!("the copy threads could not reduce ({e}); reducing on this thread");
    }
    for piece in &mut pieces {
        let (done, slices) = piece.get_mut();
        if !*done {
            reduce_in_place(op, slices);
        }
    }
}

fn reduce_in_place<T: Float>(op: ReduceOp, parts: &mut [&mut [T]]) {
    let len = parts.first().map_or(0, |p| p.len());
    let mut out = [T::from_f64(0.0); BLOCK];
    for start in (0..len).step_by(BLOCK) {
        let end = (start + BLOCK).min(len);
        let out = &mut out[..end - start];
        reduce_block(op, parts.iter().map(|p| &p[start..end]), out);
        for p in parts.iter_mut() {
            p[start..end].copy_from_slice(out);
        }
    }
}

/// One block (at most [`BLOCK`] elements) of a reduction: one input at a time into an f64
/// accumulator, each op its own loop, so the loops vectorize (an op matched per element ran
/// far below memory speed).
fn reduce_block<'s, T: Float + 's>(
    op: ReduceOp,
    mut inputs: impl Iterator<Item = &'s [T]>,
    out: &mut [T],
) {
    let Some(first) = inputs.next() else {
        return;
    };
    let mut acc = [0.0f64; BLOCK];
    let acc = &mut acc[..out.len()];
    for (a, x) in acc.iter_mut().zip(first) {
        *a = x.to_f64();
    }
    let mut count = 1.0;
    for input in inputs {
        count += 1.0;
        let xs = acc.iter_mut().zip(input);
        match op {
            ReduceOp::Sum | ReduceOp::Average => xs.for_each(|(a, x)| *a += x.to_f64()),
            ReduceOp::Max => xs.for_each(|(a, x)| {
                let v = x.to_f64();
                if v > *a || v.is_nan() {
                    *a = v;
                }
            }),
            ReduceOp::Min => xs.for_each(|(a, x)| {
                let v = x.to_f64();
                if v < *a || v.is_nan() {
                    *a = v;
                }
            }),
        }
    }
    if op == ReduceOp::Average {
        acc.iter_mut().for_each(|a| *a /= count);
    }
    for (o, a) in out.iter_mut().zip(acc.iter()) {
        *o = T::from_f64(*a);
    }
}

/// The bytes of `len` elements of `T`, checked.
fn bytes_of<T: DType>(len: usize) -> Result<usize> {
    crate::size::bytes_of::<T>("dist slot", len)
}

/// `slot` resized (its storage reused) to hold `len` elements of `T`, viewed as those.
fn resized<T: DType>(slot: &mut Vec<u64>, len: usize) -> Result<&mut [T]> {
    let bytes = bytes_of::<T>(len)?;
    let words = bytes.div_ceil(8);
    if slot.len() < words {
        slot.try_reserve(words - slot.len())
            .map_err(|_| Error::OutOfMemory {
                requested: bytes,
                detail: "host memory for a dist slot".into(),
            })?;
        slot.resize(words, 0);
    } else {
        slot.truncate(words);
    }
    let bytes_view = &mut bytemuck::cast_slice_mut::<u64, u8>(slot)[..bytes];
    bytemuck::try_cast_slice_mut(bytes_view)
        .map_err(|e| Error::InvalidArgument(format!("dist slot view: {e}")))
}

/// Copies `data` into `slot`, reusing its storage.
fn store<T: DType>(slot: &mut Vec<u64>, data: &[T]) -> Result<()> {
    resized::<T>(slot, data.len())?.copy_from_slice(data);
    Ok(())
}

/// The first `len` elements of `T` in `slot`.
fn view<T: DType>(slot: &[u64], len: usize) -> Result<&[T]> {
    let bytes = bytes_of::<T>(len)?;
    bytemuck::cast_slice::<u64, u8>(slot)
        .get(..bytes)
        .and_then(|b| bytemuck::try_cast_slice(b).ok())
        .ok_or_else(|| {
            Error::InvalidArgument(format!(
                "dist slot holds {} bytes, not {len} × {}",
                slot.len() * 8,
                T::KIND.name()
            ))
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slices_cover_the_length_in_order() {
        for len in [0, 1, 7, 8, 1003] {
            for world in 1..=5 {
                let mut next = 0;
                for r in 0..world {
                    let (start, end) = crate::device::lending::share(len, world, r);
                    assert_eq!(start, next);
                    assert!(end - start <= len / world + 1);
                    next = end;
                }
                assert_eq!(next, len);
            }
        }
    }

    #[test]
    fn slots_hold_any_element_type_and_reuse_their_storage() {
        let mut slot = Vec::new();
        store(&mut slot, &[1.5f64, -2.0, 3.25]).unwrap();
        assert_eq!(view::<f64>(&slot, 3).unwrap(), [1.5, -2.0, 3.25]);
        let capacity = slot.capacity();
        store(&mut slot, &[7u8, 8, 9]).unwrap();
        assert_eq!(view::<u8>(&slot, 3).unwrap(), [7, 8, 9]);
        assert_eq!(slot.capacity(), capacity);
        assert!(view::<u8>(&slot, 9).is_err());
    }
}
