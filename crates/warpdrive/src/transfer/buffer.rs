//! [`Buffer`]'s host copies: the staged fast path of this floor, which takes the driver's
//! own copy below its crossover, so a user knows one API. (`memory` sits below this floor;
//! the driver's copy stays there as `Buffer::driver_copy_from_host` / `driver_copy_to_host`.)

use super::hostmem::FreshVec;
use crate::dtype::DType;
use crate::error::Result;
use crate::memory::Buffer;
use crate::Stream;

impl<T: DType> Buffer<T> {
    /// A copy of `data` on the stream's device; returns when `data` may be reused and the
    /// copy is done ([`super::from_host`]).
    #[track_caller]
    pub fn from_host(stream: &Stream, data: &[T]) -> Result<Self> {
        super::from_host(stream, data)
    }

    /// Overwrites the buffer with `src` (same length); returns when `src` may be reused and
    /// the copy is done ([`super::upload`]).
    pub fn copy_from_host(&mut self, stream: &Stream, src: &[T]) -> Result<()> {
        super::upload(stream, self, src)
    }

    /// Copies the buffer into `dst` (same length), waiting for the stream
    /// ([`super::download`]).
    pub fn copy_to_host(&self, stream: &Stream, dst: &mut [T]) -> Result<()> {
        super::download(stream, self, dst)
    }

    /// The contents in a new `Vec`, waiting for the stream ([`super::to_host`]: the `Vec`
    /// is never zeroed first).
    pub fn to_host(&self, stream: &Stream) -> Result<Vec<T>> {
        super::to_host(stream, self)
    }
}

impl<T: DType> Buffer<T> {
    /// The first `len` elements as a `Vec`, waiting for the stream (for buffers sized for a
    /// capacity of which a pass wrote a prefix: the rest is never read).
    pub(crate) fn prefix_to_host(&self, stream: &Stream, len: usize) -> Result<Vec<T>> {
        let mut out = FreshVec::with_capacity(len)?;
        out.extend_from_device(stream, self, len)?;
        Ok(out.into_vec())
    }

    /// Appends the contents to `out` (straight into its spare capacity, no zeroing first),
    /// waiting for the stream.
    pub(crate) fn append_to_host(&self, stream: &Stream, out: &mut FreshVec<T>) -> Result<()> {
        out.extend_from_device(stream, self, self.len())
    }
}
