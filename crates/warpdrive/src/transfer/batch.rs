//! The coalescer: many small host slices gathered into one pinned block and sent with one
//! DMA, plus a device-side offsets table; and the reverse.

use std::ops::Range;

use parking_lot::Mutex;

use super::workers;
use super::workers::{Workers, MIN_PIECE_BYTES};
use crate::device::{Device, Stream};
use crate::dtype::DType;
use crate::error::Result;
use crate::memory::{host_vec, Buffer, PinnedBuf};

/// One slice pushed into a [`Batch`]: its index in the batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Handle(pub usize);

/// Small slices to send with one DMA. [`Batch::push`] only notes a slice (it stays borrowed
/// until [`Batch::pack`]), so the gather into pinned memory runs once, split over the copy
/// threads. Keeps its pinned blocks across [`Batch::clear`], so a reused batch pins nothing
/// new.
pub struct Batch<'a, T: DType> {
    device: Device,
    data: PinnedBuf<T>,
    /// Element offset of each slice, then the total: `slices + 1` entries, pinned.
    offsets: PinnedBuf<u64>,
    /// The same offsets, on the host (read without waiting for an upload).
    starts: Vec<u64>,
    slices: Vec<&'a [T]>,
}

impl<T: DType> std::fmt::Debug for Batch<'_, T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Batch[{} slices, {} elements]",
            self.slices(),
            self.len()
        )
    }
}

impl<'a, T: DType> Batch<'a, T> {
    /// An empty batch for `device`.
    pub fn new(device: &Device) -> Result<Self> {
        Self::with_capacity(device, 0, 0)
    }

    /// An empty batch with room for `elements` in `slices` slices before it grows.
    /// Counts beyond the host's memory fail before anything is allocated.
    pub fn with_capacity(device: &Device, elements: usize, slices: usize) -> Result<Self> {
        let offsets = crate::size::sum("Batch offsets", slices, 1)?;
        let slices = host_vec("Batch slices", slices)?;
        Ok(Batch {
            device: device.clone(),
            data: PinnedBuf::new(device, elements)?,
            offsets: PinnedBuf::new(device, offsets)?,
            starts: vec![0],
            slices,
        })
    }

    /// Slices pushed so far.
    pub fn slices(&self) -> usize {
        self.slices.len()
    }

    /// Elements pushed so far.
    pub fn len(&self) -> usize {
        self.starts[self.starts.len() - 1] as usize
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Forgets the slices, keeping the pinned blocks.
    pub fn clear(&mut self) {
        self.slices.clear();
        self.starts.truncate(1);
    }

    /// Adds `data` (borrowed until [`Batch::pack`] copies it); its place in the batch.
    pub fn push(&mut self, data: &'a [T]) -> Handle {
        self.starts.push((self.len() + data.len()) as u64);
        self.slices.push(data);
        Handle(self.slices.len() - 1)
    }

    /// Gathers every slice into the pinned block on the copy threads, then enqueues one
    /// copy of it and one of the offsets table on `stream` and returns at once (the
    /// batch's blocks are reused only after the copies complete).
    pub fn pack(&mut self, stream: &Stream) -> Result<Packed<T>> {
        let (len, n) = (self.len(), self.slices());
        if len > self.data.len() {
            self.data = PinnedBuf::new(&self.device, len.max(2 * self.data.len()))?;
        }
        if n + 1 > self.offsets.len() {
            self.offsets = PinnedBuf::new(&self.device, (n + 1).max(2 * self.offsets.len()))?;
        }
        self.offsets.wait_slice_mut()?[..=n].copy_from_slice(&self.starts);
        gather(
            workers(&self.device),
            &mut self.data.wait_slice_mut()?[..len],
            &self.starts,
            &self.slices,
        )?;
        let mut data = Buffer::uninit(stream, len)?;
        data.copy_from_pinned_at(stream, 0, &mut self.data, len)?;
        let mut offsets = Buffer::uninit(stream, n + 1)?;
        offsets.copy_from_pinned_at(stream, 0, &mut self.offsets, n + 1)?;
        Ok(Packed {
            data,
            offsets,
            starts: self.starts.clone(),
        })
    }
}

/// Copies `slices` (slice `i` at `starts[i]..starts[i + 1]`) back to back into `dst`,
/// which is split into equal pieces, one per copy thread.
fn gather<T: DType>(
    workers: &Workers,
    dst: &mut [T],
    starts: &[u64],
    slices: &[&[T]],
) -> Result<()> {
    let total = dst.len();
    let parts = pieces::<T>(workers, total);
    let piece = total.div_ceil(parts).max(1);
    let jobs: Vec<Mutex<(usize, &mut [T])>> = dst
        .chunks_mut(piece)
        .enumerate()
        .map(|(k, d)| Mutex::new((k * piece, d)))
        .collect();
    workers.run(jobs.len(), &|k| {
        let mut job = jobs[k].lock();
        let (lo, d) = &mut *job;
        let (lo, hi) = (*lo, *lo + d.len());
        // The last slice starting at or before `lo` holds it (empty ones are skipped).
        let mut i = starts
            .partition_point(|&s| s as usize <= lo)
            .saturating_sub(1);
        let mut at = lo;
        while at < hi && i < slices.len() {
            let (s0, s1) = (starts[i] as usize, starts[i + 1] as usize);
            let end = hi.min(s1);
            if end > at {
                d[at - lo..end - lo].copy_from_slice(&slices[i][at - s0..end - s0]);
                at = end;
            }
            i += 1;
        }
    })
}

/// How many pieces to split `elements` into on the copy threads.
fn pieces<T>(workers: &Workers, elements: usize) -> usize {
    let min_piece = (MIN_PIECE_BYTES / std::mem::size_of::<T>().max(1)).max(1);
    workers.threads().min(elements.div_ceil(min_piece)).max(1)
}

/// A batch on the device: the slices back to back and the offsets table.
pub struct Packed<T: DType> {
    data: Buffer<T>,
    offsets: Buffer<u64>,
    /// The offsets table, on the host.
    starts: Vec<u64>,
}

impl<T: DType> std::fmt::Debug for Packed<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Packed[{} slices, {:?}]", self.slices(), self.data)
    }
}

impl<T: DType> Packed<T> {
    /// Every slice, back to back.
    pub fn buffer(&self) -> &Buffer<T> {
        &self.data
    }

    /// Mutable, for kernels that work in place.
    pub fn buffer_mut(&mut self) -> &mut Buffer<T> {
        &mut self.data
    }

    /// The device offsets table: slice `i` is elements `offsets[i]..offsets[i + 1]`.
    pub fn offsets(&self) -> &Buffer<u64> {
        &self.offsets
    }

    pub fn slices(&self) -> usize {
        self.starts.len() - 1
    }

    /// The elements of slice `h` in [`Packed::buffer`].
    pub fn range(&self, h: Handle) -> Option<Range<usize>> {
        let (a, b) = (*self.starts.get(h.0)?, *self.starts.get(h.0 + 1)?);
        Some(a as usize..b as usize)
    }

    /// The reverse of [`Batch::pack`]: one copy of the whole buffer to the host, split
    /// back into the slices on the copy threads.
    pub fn download(&self, stream: &Stream) -> Result<Vec<Vec<T>>> {
        let mut host = PinnedBuf::new(stream.device(), self.data.len())?;
        self.data.copy_to_pinned(stream, &mut host)?;
        let all = host.wait_slice()?;
        let mut out: Vec<Vec<T>> = self
            .starts
            .windows(2)
            .map(|w| Vec::with_capacity((w[1] - w[0]) as usize))
            .collect();
        // Groups of consecutive slices of about equal bytes, one per copy thread.
        let workers = workers(stream.device());
        let per = all.len().div_ceil(pieces::<T>(workers, all.len())).max(1);
        let mut jobs = Vec::new();
        let (mut rest, mut first) = (out.as_mut_slice(), 0);
        while !rest.is_empty() {
            let goal = self.starts[first] as usize + per;
            let k = (self.starts[first + 1..].partition_point(|&s| (s as usize) < goal) + 1)
                .min(rest.len());
            let (group, tail) = std::mem::take(&mut rest).split_at_mut(k);
            jobs.push(Mutex::new((first, group)));
            (rest, first) = (tail, first + k);
        }
        workers.run(jobs.len(), &|j| {
            let mut job = jobs[j].lock();
            let (first, group) = &mut *job;
            for (i, v) in group.iter_mut().enumerate() {
                let (a, b) = (self.starts[*first + i], self.starts[*first + i + 1]);
                v.extend_from_slice(&all[a as usize..b as usize]);
            }
        })?;
        Ok(out)
    }
}
