//! The coalescer: many small host slices gathered into one pinned block and sent with one
//! DMA, plus a device-side offsets table; and the reverse.

use std::ops::Range;

use crate::device::{Device, Stream};
use crate::dtype::DType;
use crate::error::Result;
use crate::memory::{Buffer, PinnedBuf};

/// One slice pushed into a [`Batch`]: its index in the batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Handle(pub usize);

/// Small slices gathered into one pinned block. Keeps its pinned blocks across
/// [`Batch::clear`], so a reused batch pins nothing new.
pub struct Batch<T: DType> {
    device: Device,
    data: PinnedBuf<T>,
    len: usize,
    /// Element offset of each slice, then the total: `slices + 1` entries.
    offsets: PinnedBuf<u64>,
    /// The same offsets, on the host (read without waiting for an upload).
    starts: Vec<u64>,
    slices: usize,
}

impl<T: DType> std::fmt::Debug for Batch<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Batch[{} slices, {} elements]", self.slices, self.len)
    }
}

impl<T: DType> Batch<T> {
    /// An empty batch for `device`.
    pub fn new(device: &Device) -> Result<Self> {
        Self::with_capacity(device, 0, 0)
    }

    /// An empty batch with room for `elements` in `slices` slices before it grows.
    pub fn with_capacity(device: &Device, elements: usize, slices: usize) -> Result<Self> {
        let mut offsets = PinnedBuf::new(device, slices + 1)?;
        offsets.as_mut_slice()?[0] = 0;
        Ok(Batch {
            device: device.clone(),
            data: PinnedBuf::new(device, elements)?,
            len: 0,
            offsets,
            starts: vec![0],
            slices: 0,
        })
    }

    /// Slices pushed so far.
    pub fn slices(&self) -> usize {
        self.slices
    }

    /// Elements pushed so far.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Forgets the slices, keeping the pinned blocks.
    pub fn clear(&mut self) {
        self.len = 0;
        self.slices = 0;
        self.starts.truncate(1);
    }

    /// Appends a copy of `data` (straight into pinned memory); its place in the batch.
    pub fn push(&mut self, data: &[T]) -> Result<Handle> {
        let end = self.len + data.len();
        if end > self.data.len() {
            let mut grown = PinnedBuf::new(&self.device, end.max(2 * self.data.len()))?;
            grown.as_mut_slice()?[..self.len].copy_from_slice(&self.data.as_slice()?[..self.len]);
            self.data = grown;
        }
        if self.slices + 2 > self.offsets.len() {
            let mut grown =
                PinnedBuf::new(&self.device, (self.slices + 2).max(2 * self.offsets.len()))?;
            grown.as_mut_slice()?[..=self.slices]
                .copy_from_slice(&self.offsets.as_slice()?[..=self.slices]);
            self.offsets = grown;
        }
        self.data.as_mut_slice()?[self.len..end].copy_from_slice(data);
        let offsets = self.offsets.as_mut_slice()?;
        offsets[self.slices] = self.len as u64;
        offsets[self.slices + 1] = end as u64;
        self.starts.push(end as u64);
        self.len = end;
        self.slices += 1;
        Ok(Handle(self.slices - 1))
    }

    /// Enqueues one copy of every slice and one of the offsets table on `stream` and
    /// returns at once (the batch's blocks are reused only after the copies complete).
    pub fn upload(&mut self, stream: &Stream) -> Result<Packed<T>> {
        let mut data = Buffer::uninit(stream, self.len)?;
        data.copy_from_pinned_at(stream, 0, &mut self.data, self.len)?;
        let mut offsets = Buffer::uninit(stream, self.slices + 1)?;
        offsets.copy_from_pinned_at(stream, 0, &mut self.offsets, self.slices + 1)?;
        Ok(Packed {
            data,
            offsets,
            starts: self.starts.clone(),
        })
    }
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

    /// The reverse of [`Batch::upload`]: one copy of the whole buffer to the host, split
    /// back into the slices.
    pub fn download(&self, stream: &Stream) -> Result<Vec<Vec<T>>> {
        let mut host = PinnedBuf::new(stream.device(), self.data.len())?;
        self.data.copy_to_pinned(stream, &mut host)?;
        let all = host.as_slice()?;
        Ok(self
            .starts
            .windows(2)
            .map(|w| all[w[0] as usize..w[1] as usize].to_vec())
            .collect())
    }
}
