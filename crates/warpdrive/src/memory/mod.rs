//! Typed device memory. [`Buffer<T>`] holds a raw device address (a host address on the CPU
//! backend) rather than a cudarc `CudaSlice`, so the caching pool can hand out sub-ranges of
//! its segments; for now each buffer is a plain allocation of its own.

mod caching;

pub use caching::{round_size, segment_size, PoolConfig, PoolStats};

use std::marker::PhantomData;

use crate::device::{cpu, Device, Stream};
use crate::dtype::DType;
use crate::error::{Error, Result};

/// `len` elements of `T` on one device.
pub struct Buffer<T: DType> {
    device: Device,
    /// Device address (host address on the CPU backend); 0 when `len == 0`.
    ptr: u64,
    len: usize,
    _t: PhantomData<T>,
}

impl<T: DType> std::fmt::Debug for Buffer<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Buffer<{}>[{}] on {}",
            T::KIND.name(),
            self.len,
            self.device.label()
        )
    }
}

fn bytes_for<T: DType>(len: usize) -> Result<usize> {
    len.checked_mul(std::mem::size_of::<T>())
        .ok_or_else(|| Error::InvalidArgument(format!("{len} elements overflow the address space")))
}

impl<T: DType> Buffer<T> {
    /// `len` elements with unspecified contents (the caller writes them before reading).
    pub fn uninit(stream: &Stream, len: usize) -> Result<Self> {
        let device = stream.device().clone();
        let bytes = bytes_for::<T>(len)?;
        let ptr = if bytes == 0 {
            0
        } else {
            device.alloc_raw(bytes)?
        };
        Ok(Buffer {
            device,
            ptr,
            len,
            _t: PhantomData,
        })
    }

    /// A copy of `data` on the stream's device; returns when `data` may be reused.
    pub fn from_host(stream: &Stream, data: &[T]) -> Result<Self> {
        let mut buf = Self::uninit(stream, data.len())?;
        buf.copy_from_host(stream, data)?;
        Ok(buf)
    }

    /// `len` elements, all bits zero.
    pub fn zeros(stream: &Stream, len: usize) -> Result<Self> {
        let mut buf = Self::uninit(stream, len)?;
        crate::ops::fill(stream, &mut buf, T::default())?;
        Ok(buf)
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
        &self.device
    }

    /// The raw device address, for kernel arguments and interop.
    pub fn device_ptr(&self) -> u64 {
        self.ptr
    }

    /// Overwrites the buffer with `src` (same length); returns when `src` may be reused.
    pub fn copy_from_host(&mut self, stream: &Stream, src: &[T]) -> Result<()> {
        self.check_stream(stream, "copy_from_host")?;
        check_len("copy_from_host", self.len, src.len())?;
        match stream.cuda() {
            Some((d, s)) => d.copy_h2d(s, self.ptr, src),
            None => {
                self.host_view_mut()?.copy_from_slice(src);
                Ok(())
            }
        }
    }

    /// Copies the buffer into `dst` (same length), waiting for the stream.
    pub fn copy_to_host(&self, stream: &Stream, dst: &mut [T]) -> Result<()> {
        self.check_stream(stream, "copy_to_host")?;
        check_len("copy_to_host", self.len, dst.len())?;
        match stream.cuda() {
            Some((d, s)) => d.copy_d2h(s, dst, self.ptr),
            None => {
                dst.copy_from_slice(self.host_view()?);
                Ok(())
            }
        }
    }

    /// The contents as a `Vec`, waiting for the stream.
    pub fn to_host(&self, stream: &Stream) -> Result<Vec<T>> {
        let mut out = vec![T::default(); self.len];
        self.copy_to_host(stream, &mut out)?;
        Ok(out)
    }

    pub(crate) fn check_stream(&self, stream: &Stream, op: &'static str) -> Result<()> {
        self.device.same_as(stream.device(), op)
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
        match self.device {
            Device::Cpu => Ok(()),
            _ => Err(Error::DeviceMismatch {
                op: "host view",
                left: self.device.label(),
                right: "cpu".into(),
            }),
        }
    }
}

impl<T: DType> Drop for Buffer<T> {
    fn drop(&mut self) {
        if self.ptr == 0 {
            return;
        }
        if let Err(e) = self.device.free_raw(self.ptr, self.size_bytes()) {
            tracing::warn!("freeing {self:?} failed: {e}");
        }
    }
}

pub(crate) fn check_len(op: &'static str, left: usize, right: usize) -> Result<()> {
    if left == right {
        Ok(())
    } else {
        Err(Error::LengthMismatch { op, left, right })
    }
}
