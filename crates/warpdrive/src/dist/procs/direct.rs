//! The large all-reduces over shared memory on the ranks' own buffers: lent (each rank maps
//! the others' regions and reduces its part in place) or through [`cma`] (copies between the
//! processes), with only the descriptions and barriers going through the segment's rounds.

use super::*;

/// Regions of each other rank kept mapped: a few buffers all-reduced in turn (a Reducer's
/// buckets) stay mapped; an older one is unmapped (mapping it again costs its page tables).
const MAPPED_PER_RANK: usize = 8;
/// Bytes a rank reduces at once on the [`cma`] path: the other ranks' pieces, copied in,
/// and the result stay in the cache until the result is copied out.
const CMA_PIECE_BYTES: usize = 256 << 10;

impl Procs {
    /// The all-reduce on the ranks' buffers where they are: the ranks show one another where
    /// their buffers are (process, address, and the shared region holding it, if any). When
    /// every buffer is in a shared region and every rank maps the others', the lent path runs
    /// ([`all_reduce_lent`](Self::all_reduce_lent)); else, where the ranks can, the [`cma`]
    /// path. `Ok(false)`: neither (on every rank alike), the caller stages through the segment.
    pub(super) fn all_reduce_direct<T: Float>(&self, data: &mut [T], op: ReduceOp) -> Result<bool> {
        const OP: &str = "all_reduce";
        const NONE: u64 = u64::MAX;
        let deadline = self.deadline();
        let whole = |_: usize, _: usize| WHOLE;
        let region = self
            .lend
            .then(|| shared_host::find(data.as_ptr() as usize, size_of_val(data)))
            .flatten();
        let shown = match region {
            Some(r) => [r.fd as u64, r.token, r.len as u64, r.offset as u64],
            None => [NONE; 4],
        };
        let shown = [
            cma::pid() as u64,
            data.as_ptr() as usize as u64,
            shown[0],
            shown[1],
            shown[2],
            shown[3],
        ];
        let seq = self.post(OP, 48, |b| copy_in(b, &shown), &whole, deadline)?;
        let mut peers = Vec::with_capacity(self.world);
        let mut regions = Vec::with_capacity(self.world);
        self.collect(OP, seq, &whole, deadline, |parts| {
            for p in parts {
                let &[pid, at, fd, token, len, offset] = typed::<u64>(p)? else {
                    return Err(failed(OP, "a rank showed no buffer".into()));
                };
                peers.push((
                    i32::try_from(pid).unwrap_or(-1),
                    usize::try_from(at).unwrap_or(usize::MAX),
                ));
                let shown = (fd != NONE).then(|| {
                    Some(Shown {
                        fd: i32::try_from(fd).ok()?,
                        token,
                        len: usize::try_from(len).ok()?,
                        offset: usize::try_from(offset).ok()?,
                    })
                });
                regions.push(shown.flatten());
            }
            Ok(())
        })?;
        if regions.iter().all(Option::is_some) {
            let regions: Vec<Shown> = regions.into_iter().flatten().collect();
            if self.all_reduce_lent(data, op, &peers, &regions)? {
                return Ok(true);
            }
        }
        if !self.cma {
            return Ok(false);
        }
        self.all_reduce_cma(data, op, &peers).map(|()| true)
    }

    /// The lent all-reduce: every rank maps the others' regions (kept for later calls) and
    /// says whether it could; when all could, rank `r` reduces part `r` of every buffer in
    /// place on this process's copy threads, as the in-process group does (each element read
    /// once and written once), and a last round keeps every rank in the call until no rank
    /// touches its buffer any more. `Ok(false)` on every rank when some rank could not map.
    fn all_reduce_lent<T: Float>(
        &self,
        data: &mut [T],
        op: ReduceOp,
        peers: &[(i32, usize)],
        regions: &[Shown],
    ) -> Result<bool> {
        const OP: &str = "all_reduce";
        let (n, me) = (self.world, self.rank);
        let deadline = self.deadline();
        let whole = |_: usize, _: usize| WHOLE;
        let mut mapped = self.mapped.borrow_mut();
        let mut can = true;
        for q in (0..n).filter(|&q| q != me) {
            let (pid, shown) = (peers[q].0, &regions[q]);
            let Some(cache) = mapped.get_mut(q) else {
                can = false;
                break;
            };
            // Regions their owner has freed since: this mapping alone would keep the memory.
            cache.retain(|m| m.token() == shown.token || m.owner_holds());
            match cache.iter().position(|m| m.token() == shown.token) {
                Some(i) => {
                    let hit = cache.remove(i);
                    cache.push(hit);
                }
                None => match PeerRegion::open(pid, shown) {
                    Ok(m) => {
                        if cache.len() >= MAPPED_PER_RANK {
                            cache.remove(0);
                        }
                        cache.push(m);
                    }
                    Err(e) => {
                        tracing::debug!("rank {me}: cannot map rank {q}'s buffer: {e}");
                        can = false;
                    }
                },
            }
        }
        let verdict = [u64::from(can)];
        let seq = self.post(OP, 8, |b| copy_in(b, &verdict), &whole, deadline)?;
        let mut all = true;
        self.collect(OP, seq, &whole, deadline, |parts| {
            for p in parts {
                all &= typed::<u64>(p)?.first() == Some(&1);
            }
            Ok(())
        })?;
        if !all {
            return Ok(false);
        }
        let len = data.len();
        let mut own = Some(data);
        let mut buffers = Vec::with_capacity(n);
        for (q, shown) in regions.iter().enumerate() {
            if q == me {
                buffers.push(Lent::Own(
                    own.take()
                        .ok_or_else(|| failed(OP, "two own buffers".into()))?,
                ));
                continue;
            }
            // Mapped above (the verdict was this rank's too), the most recent last.
            let region = mapped
                .get(q)
                .and_then(|c| c.last())
                .filter(|m| m.token() == shown.token)
                .ok_or_else(|| failed(OP, format!("rank {q}'s region is not mapped")))?;
            buffers.push(Lent::Peer(region, shown.offset));
        }
        shared_host::with_lent(buffers, len, part(len, n, me), |parts| {
            reduce_pooled(op, parts)
        })
        .map_err(|e| failed(OP, format!("lending the buffers: {e}")))?;
        // Every rank done with every buffer: each may return.
        let seq = self.post(OP, 0, |_| Ok(()), &whole, deadline)?;
        self.collect(OP, seq, &whole, deadline, |_| Ok(()))?;
        Ok(true)
    }

    /// The all-reduce through [`cma`]: with the buffers' places shown (`peers`: each rank's
    /// process and buffer address), rank `r` reduces part `r` of every buffer piece by piece
    /// (the others' pieces copied in, the result copied out into every buffer) on this
    /// process's copy threads, and a last round keeps every rank in the call until no rank
    /// touches its buffer any more.
    fn all_reduce_cma<T: Float>(
        &self,
        data: &mut [T],
        op: ReduceOp,
        peers: &[(i32, usize)],
    ) -> Result<()> {
        const OP: &str = "all_reduce";
        let (n, me, size) = (self.world, self.rank, size_of::<T>());
        let deadline = self.deadline();
        let whole = |_: usize, _: usize| WHOLE;
        let span = part(data.len(), n, me);
        let piece = (CMA_PIECE_BYTES / size).max(8);
        let pieces: Vec<parking_lot::Mutex<(bool, &mut [T])>> = data[span.clone()]
            .chunks_mut(piece)
            .map(|c| parking_lot::Mutex::new((false, c)))
            .collect();
        let failure = parking_lot::Mutex::new(None);
        let work = |i: usize| {
            let mut p = pieces[i].lock();
            let (done, slice) = &mut *p;
            if let Err(e) = reduce_piece(op, peers, me, span.start + i * piece, slice) {
                failure.lock().get_or_insert(e);
            }
            *done = true;
        };
        let workers = crate::transfer::workers(&crate::Device::cpu());
        if let Err(e) = workers.run(pieces.len(), &work) {
            tracing::warn!("the copy threads could not reduce ({e}); reducing on this thread");
        }
        for (i, p) in pieces.iter().enumerate() {
            let done = p.lock().0;
            if !done {
                work(i);
            }
        }
        if let Some(e) = failure.into_inner() {
            return Err(e);
        }
        // Every rank done with every buffer: each may return.
        let seq = self.post(OP, 0, |_| Ok(()), &whole, deadline)?;
        self.collect(OP, seq, &whole, deadline, |_| Ok(()))
    }
}

thread_local! {
    /// A copy thread's room for the other ranks' pieces and the result ([`reduce_piece`]).
    static SCRATCH: RefCell<Vec<u64>> = const { RefCell::new(Vec::new()) };
}

/// Reduces `mine` (elements from `start` of this rank's buffer) with the same elements of
/// every other rank's buffer (`peers`: each rank's process and buffer address), in rank
/// order, and writes the result into every buffer.
fn reduce_piece<T: Float>(
    op: ReduceOp,
    peers: &[(i32, usize)],
    me: usize,
    start: usize,
    mine: &mut [T],
) -> Result<()> {
    const OP: &str = "all_reduce";
    let (n, bytes) = (peers.len(), std::mem::size_of_val(mine));
    let offset = start
        .checked_mul(size_of::<T>())
        .ok_or_else(|| failed(OP, "a piece past the address space".into()))?;
    let at = |q: usize| {
        peers[q]
            .1
            .checked_add(offset)
            .ok_or_else(|| failed(OP, format!("rank {q}'s buffer address is out of range")))
    };
    let moved = |q: usize, e: std::io::Error| {
        failed(
            OP,
            format!("copying a piece of rank {q}'s buffer failed: {e}"),
        )
    };
    SCRATCH.with(|scratch| {
        let mut scratch = scratch.borrow_mut();
        let words = bytes.div_ceil(8);
        let need = words
            .checked_mul(n)
            .ok_or_else(|| failed(OP, "the scratch of a piece overflows".into()))?;
        let have = scratch.len();
        if have < need {
            scratch
                .try_reserve(need - have)
                .map_err(|_| Error::OutOfMemory {
                    requested: need * 8,
                    detail: "host memory for the all-reduce's pieces".into(),
                })?;
            scratch.resize(need, 0);
        }
        let (ins, out) = scratch[..need].split_at_mut((n - 1) * words);
        for (q, room) in (0..n).filter(|&q| q != me).zip(ins.chunks_exact_mut(words)) {
            let room = &mut bytemuck::cast_slice_mut::<u64, u8>(room)[..bytes];
            cma::read(peers[q].0, at(q)?, room).map_err(|e| moved(q, e))?;
        }
        let mut theirs = ins.chunks_exact(words);
        let mut inputs: Vec<&[T]> = Vec::with_capacity(n);
        for q in 0..n {
            if q == me {
                inputs.push(mine);
            } else if let Some(room) = theirs.next() {
                inputs.push(typed::<T>(&bytemuck::cast_slice::<u64, u8>(room)[..bytes])?);
            }
        }
        let out = typed_mut::<T>(&mut bytemuck::cast_slice_mut::<u64, u8>(out)[..bytes])?;
        reduce(op, &inputs, out);
        mine.copy_from_slice(out);
        let result: &[u8] = bytemuck::cast_slice(out);
        for q in (0..n).filter(|&q| q != me) {
            cma::write(peers[q].0, at(q)?, result).map_err(|e| moved(q, e))?;
        }
        Ok(())
    })
}
