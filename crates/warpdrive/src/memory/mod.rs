//! Typed device memory and the pools behind it.
//!
//! - [`Buffer<T>`] holds a raw device address (a host address on the CPU backend) rather than
//!   the bindings' owning slice type, so the pool can hand out sub-ranges of its segments. Every buffer
//!   comes from its device's [`DevicePool`] ([`device_pool`]) unless made with
//!   [`Buffer::uninit_in`], and returns to it on drop, tagged with its stream.
//! - [`DevicePool`]: the caching allocator (policy in `caching`, backend-free) or CUDA's
//!   stream-ordered allocator, chosen by [`PoolStrategy`]; stats, trim, capture mode.
//! - [`PinnedBuf<T>`]: page-locked host memory from the [`PinnedPool`].
//! - [`UnifiedBuffer<T>`] (host and device mirrors with explicit syncs) and
//!   [`ManagedBuffer<T>`] (CUDA managed memory with hints and prefetch).
//! - [`profiler`]: opt-in recording of every buffer allocation and free.
//! - [`host_vec`]: host memory sized from caller input, refused as an error value when the
//!   machine cannot hold it.
//!
//! The staging ring, the copy threads and the fresh-`Vec` helpers that use these sit one
//! floor up, in `transfer`.

mod caching;
mod host;
mod pinned;
mod pool;
pub mod profiler;
mod unified;

pub use caching::{round_size, segment_size, PoolConfig, PoolStats, ROUND, SMALL_MAX};
pub use host::host_vec;
pub(crate) use host::{check_host_bytes, host_filled, host_zeroed};
pub use pinned::{pinned_class, pinned_pool, PinnedBuf, PinnedPool, PinnedStats};
pub use pool::{device_pool, release_cached, DevicePool, GraphMemory, PoolStrategy};
pub use unified::{Advice, Coherence, Location, ManagedBuffer, UnifiedBuffer};

use std::marker::PhantomData;
use std::mem::{size_of_val, MaybeUninit};
use std::sync::Arc;

use crate::device::{cpu, Device, Stream};
use crate::dtype::DType;
use crate::error::{Error, Result};

/// `len` elements of `T` on one device, from a [`DevicePool`].
pub struct Buffer<T: DType> {
    pool: Arc<DevicePool>,
    /// Device address (host address on the CPU backend); 0 when `len == 0`.
    ptr: u64,
    len: usize,
    /// The stream it was allocated on.
    stream: u64,
    alloc: pool::Allocation,
    /// Other streams it was used on (see [`Buffer::record_stream`]).
    uses: Vec<Stream>,
    /// Who allocated it, for the profiler.
    tag: &'static str,
    _t: PhantomData<T>,
}

impl<T: DType> std::fmt::Debug for Buffer<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Buffer<{}>[{}] on {}",
            T::KIND.name(),
            self.len,
            self.pool.device().label()
        )
    }
}

/// Bytes of a buffer of `len` elements of `T`, checked.
fn bytes_for<T: DType>(len: usize) -> Result<usize> {
    crate::size::bytes_of::<T>("buffer", len)
}

impl<T: DType> Buffer<T> {
    /// `len` elements with unspecified contents (the caller writes them before reading),
    /// from the device's pool, for work on `stream`.
    #[track_caller]
    pub fn uninit(stream: &Stream, len: usize) -> Result<Self> {
        Self::uninit_in(device_pool(stream.device())?, stream, len)
    }

    /// As [`Buffer::uninit`], from `pool` (which must be on the stream's device).
    #[track_caller]
    pub fn uninit_in(pool: &Arc<DevicePool>, stream: &Stream, len: usize) -> Result<Self> {
        let tag = std::panic::Location::caller().file();
        let bytes = bytes_for::<T>(len)?;
        let (ptr, alloc) = if bytes == 0 {
            pool.device().same_as(stream.device(), "Buffer::uninit")?;
            (0, pool::Allocation::None)
        } else {
            match pool.alloc(stream, bytes) {
                Ok(a) => a,
                Err(Error::OutOfMemory { requested, detail }) => {
                    let detail = match profiler::top_tags(3) {
                        Some(tags) => format!("{detail}; top tags: {tags}"),
                        None => detail,
                    };
                    return Err(Error::OutOfMemory { requested, detail });
                }
                Err(e) => return Err(e),
            }
        };
        if bytes > 0 {
            profiler::record(true, tag, bytes, stream.id(), ptr);
        }
        Ok(Buffer {
            pool: pool.clone(),
            ptr,
            len,
            stream: stream.id(),
            alloc,
            uses: Vec::new(),
            tag,
            _t: PhantomData,
        })
    }

    /// Marks the buffer as used on `stream` as well as the stream it was allocated on
    /// (PyTorch's `record_stream`): when it is dropped, its memory is reused only after the
    /// work enqueued on `stream` by then has completed. Needed whenever work on another
    /// stream may still use the buffer when it is dropped.
    pub fn record_stream(&mut self, stream: &Stream) -> Result<()> {
        self.check_stream(stream, "record_stream")?;
        if stream.id() != self.stream && !self.uses.iter().any(|s| s.id() == stream.id()) {
            self.uses.push(stream.clone());
        }
        Ok(())
    }

    /// The pool this buffer came from.
    pub fn pool(&self) -> &Arc<DevicePool> {
        &self.pool
    }

    /// `len` elements, all bits zero (a device memset on the stream).
    #[track_caller]
    pub fn zeros(stream: &Stream, len: usize) -> Result<Self> {
        let buf = Self::uninit(stream, len)?;
        stream.run(
            buf,
            |mut buf| {
                buf.host_view_mut()?.fill(T::default());
                Ok(buf)
            },
            |buf, q| {
                q.gpu.memset_zero(q.stream, buf.ptr, buf.size_bytes())?;
                Ok(buf)
            },
        )
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn size_bytes(&self) -> usize {
        self.len * std::mem::size_of::<T>()
    }

    pub fn device(&self) -> &Device {
        self.pool.device()
    }

    /// The raw device address, for kernel arguments and interop.
    pub fn device_ptr(&self) -> u64 {
        self.ptr
    }

    /// The driver's own copy of `src` (same length) into the buffer, through its pageable
    /// staging; returns when `src` may be reused. [`Buffer::copy_from_host`] (the transfer
    /// floor's fast path, this copy under its crossover) is the one to use; this one is for
    /// baselines and for that path's own small copies.
    pub fn driver_copy_from_host(&mut self, stream: &Stream, src: &[T]) -> Result<()> {
        self.check_stream(stream, "driver_copy_from_host")?;
        check_len("driver_copy_from_host", self.len, src.len())?;
        stream.run(
            self,
            |b| {
                b.host_view_mut()?.copy_from_slice(src);
                Ok(())
            },
            |b, q| q.gpu.copy_h2d(q.stream, b.ptr, src),
        )
    }

    /// The driver's own copy of the buffer into `dst` (same length), waiting for the stream:
    /// the baseline of [`Buffer::copy_to_host`], which is the one to use.
    pub fn driver_copy_to_host(&self, stream: &Stream, dst: &mut [T]) -> Result<()> {
        self.check_stream(stream, "driver_copy_to_host")?;
        check_len("driver_copy_to_host", self.len, dst.len())?;
        stream.run(
            dst,
            |dst| {
                dst.copy_from_slice(self.host_view()?);
                Ok(())
            },
            |dst, q| q.gpu.copy_d2h(q.stream, dst, self.ptr),
        )
    }

    /// The driver's own copy of the first `dst.len()` elements into `dst`, waiting for the
    /// stream; on `Ok` every element of `dst` is written (the fresh-`Vec` downloads of the
    /// transfer floor write straight into a `Vec`'s spare capacity through it).
    pub(crate) fn driver_copy_prefix_to_uninit(
        &self,
        stream: &Stream,
        dst: &mut [MaybeUninit<T>],
    ) -> Result<()> {
        self.check_stream(stream, "to_host")?;
        let len = dst.len();
        if len > self.len {
            return Err(Error::InvalidArgument(format!(
                "to_host: {len} elements of a buffer of {}",
                self.len
            )));
        }
        stream.run(
            dst,
            |dst| {
                for (d, s) in dst.iter_mut().zip(&self.host_view()?[..len]) {
                    d.write(*s);
                }
                Ok(())
            },
            // SAFETY: `dst` holds `len` elements, borrowed mutably for the whole
            // (synchronous) copy, and the buffer holds at least `len` from `ptr`.
            |dst, q| unsafe {
                q.gpu.copy_d2h_raw(
                    q.stream,
                    dst.as_mut_ptr().cast::<u8>(),
                    self.ptr,
                    size_of_val(dst),
                )
            },
        )
    }

    /// Copies `rows` rows of `width` elements from `src` into this buffer, enqueued on
    /// `stream`; each side's rows start at its `(first, pitch)`: the first row's element and
    /// the elements between rows' starts. Rows out of either buffer are an error.
    pub(crate) fn copy_rows_from(
        &mut self,
        stream: &Stream,
        dst: (usize, usize),
        src: (&Buffer<T>, usize, usize),
        width: usize,
        rows: usize,
    ) -> Result<()> {
        const OP: &str = "copy_rows_from";
        let (from, src_first, src_pitch) = src;
        self.check_stream(stream, OP)?;
        from.check_stream(stream, OP)?;
        if width == 0 || rows == 0 {
            return Ok(());
        }
        let fits = |(first, pitch): (usize, usize), len: usize| {
            (rows == 1 || pitch >= width)
                && (rows - 1)
                    .checked_mul(pitch)
                    .and_then(|n| n.checked_add(first))
                    .and_then(|n| n.checked_add(width))
                    .is_some_and(|end| end <= len)
        };
        if !fits(dst, self.len) || !fits((src_first, src_pitch), from.len) {
            return Err(Error::InvalidArgument(format!(
                "{OP}: {rows} rows of {width} from {src_first} (pitch {src_pitch}) of {} \
                 elements to {} (pitch {}) of {}",
                from.len, dst.0, dst.1, self.len
            )));
        }
        let size = std::mem::size_of::<T>();
        stream.run(
            self,
            |to| {
                let (src_view, dst_view) = (from.host_view()?, to.host_view_mut()?);
                for r in 0..rows {
                    let (s, d) = (src_first + r * src_pitch, dst.0 + r * dst.1);
                    dst_view[d..d + width].copy_from_slice(&src_view[s..s + width]);
                }
                Ok(())
            },
            |to, q| {
                q.gpu.copy_d2d_rows(
                    q.stream,
                    (to.ptr + (dst.0 * size) as u64, dst.1 * size),
                    (from.ptr + (src_first * size) as u64, src_pitch * size),
                    width * size,
                    rows,
                )
            },
        )
    }

    pub(crate) fn check_stream(&self, stream: &Stream, op: &'static str) -> Result<()> {
        self.device().same_as(stream.device(), op)
    }

    /// The elements, on the CPU backend.
    pub(crate) fn host_view(&self) -> Result<&[T]> {
        self.require_cpu()?;
        // SAFETY: a CPU buffer's `ptr` is its own live allocation of `len` initialised
        // elements (all `DType`s are valid for any bits), and `&self` excludes writers.
        Ok(unsafe { cpu::view(self.ptr, self.len) })
    }

    /// The elements, mutably, on the CPU backend.
    pub(crate) fn host_view_mut(&mut self) -> Result<&mut [T]> {
        self.require_cpu()?;
        // SAFETY: as in `host_view`; `&mut self` makes this the only reference.
        Ok(unsafe { cpu::view_mut(self.ptr, self.len) })
    }

    fn require_cpu(&self) -> Result<()> {
        self.device().same_as(&Device::cpu(), "host view")
    }
}

impl<T: DType> Drop for Buffer<T> {
    fn drop(&mut self) {
        let alloc = std::mem::replace(&mut self.alloc, pool::Allocation::None);
        if !matches!(alloc, pool::Allocation::None) {
            profiler::record(false, self.tag, self.size_bytes(), self.stream, self.ptr);
        }
        self.pool.free(self.ptr, alloc, &self.uses);
    }
}

pub(crate) fn check_len(op: &'static str, left: usize, right: usize) -> Result<()> {
    if left == right {
        Ok(())
    } else {
        Err(Error::LengthMismatch { op, left, right })
    }
}
