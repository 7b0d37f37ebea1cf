//! Memory seen from both sides: [`UnifiedBuffer<T>`] (explicit host and device mirrors) and
//! [`ManagedBuffer<T>`] (CUDA managed memory, migrated by the driver, steered by hints).
//!
//! A `UnifiedBuffer` keeps which side is newer and copies only toward the stale side. Reads
//! of a stale side are refused; reads of a side that an async copy is still writing wait:
//! the pinned mirror waits for its copy events, and device work on another stream is ordered
//! after the last copy by an event. `&mut self` on every writer and sync makes a borrowed
//! slice outlive no copy.

use std::marker::PhantomData;
use std::ops::Range;

use parking_lot::Mutex;

use crate::device::{cpu, Device, Event, MemAdvice, Stream};
use crate::dtype::DType;
use crate::error::{Error, Result};

use super::{bytes_for, device_pool, pool, Buffer, PinnedBuf};

/// Which mirror of a [`UnifiedBuffer`] holds the latest data.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Coherence {
    /// The host mirror was written since the last sync; the device mirror is stale.
    HostNewer,
    /// The device mirror was written since the last sync; the host mirror is stale.
    DeviceNewer,
    /// Both hold the same data.
    InSync,
}

/// `len` elements with a pinned host mirror and a device mirror.
pub struct UnifiedBuffer<T: DType> {
    host: PinnedBuf<T>,
    device: Buffer<T>,
    state: Coherence,
    /// The stream of the last device-side use, and a fence for ordering other streams after
    /// it.
    order: Mutex<(Stream, Event)>,
}

impl<T: DType> std::fmt::Debug for UnifiedBuffer<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "UnifiedBuffer<{}>[{}] on {} ({:?})",
            T::KIND.name(),
            self.len(),
            self.device.device().label(),
            self.state
        )
    }
}

impl<T: DType> UnifiedBuffer<T> {
    /// A buffer holding `data` on the host side (host newer), its device side from the
    /// stream's device pool.
    #[track_caller]
    pub fn from_host(stream: &Stream, data: &[T]) -> Result<Self> {
        Self::host_newer(stream, data.len(), |host| host.copy_from_slice(data))
    }

    /// `len` elements, all zero on the host side (host newer).
    #[track_caller]
    pub fn zeros(stream: &Stream, len: usize) -> Result<Self> {
        Self::host_newer(stream, len, |host| host.fill(T::default()))
    }

    /// `len` elements whose host side `fill` writes (the device side allocated first, so a
    /// length beyond the device fails before any host memory is touched).
    #[track_caller]
    fn host_newer(stream: &Stream, len: usize, fill: impl FnOnce(&mut [T])) -> Result<Self> {
        let device = Buffer::uninit(stream, len)?;
        let mut host = PinnedBuf::new(stream.device(), len)?;
        fill(host.wait_slice_mut()?);
        Ok(UnifiedBuffer {
            host,
            device,
            state: Coherence::HostNewer,
            order: Mutex::new((stream.clone(), stream.device().new_sync_event()?)),
        })
    }

    pub fn len(&self) -> usize {
        self.device.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn state(&self) -> Coherence {
        self.state
    }

    /// The host mirror, once copies into it have completed; refused while the device side is
    /// newer (call [`UnifiedBuffer::sync_to_host`] first).
    pub fn host(&self) -> Result<&[T]> {
        self.require_not(Coherence::DeviceNewer, "host")?;
        self.host.wait_slice()
    }

    /// The host mirror for writing (the host side becomes newer), once copies that use it
    /// have completed; refused while the device side is newer.
    pub fn host_mut(&mut self) -> Result<&mut [T]> {
        self.require_not(Coherence::DeviceNewer, "host_mut")?;
        let slice = self.host.wait_slice_mut()?;
        self.state = Coherence::HostNewer;
        Ok(slice)
    }

    /// The device mirror for reading by work on `stream` (ordered after the last copy);
    /// refused while the host side is newer (call [`UnifiedBuffer::sync_to_device`]).
    pub fn device(&self, stream: &Stream) -> Result<&Buffer<T>> {
        self.require_not(Coherence::HostNewer, "device")?;
        self.order_on(stream)?;
        Ok(&self.device)
    }

    /// The device mirror for writing by work on `stream` (the device side becomes newer);
    /// refused while the host side is newer.
    pub fn device_mut(&mut self, stream: &Stream) -> Result<&mut Buffer<T>> {
        self.require_not(Coherence::HostNewer, "device_mut")?;
        self.order_on(stream)?;
        self.state = Coherence::DeviceNewer;
        Ok(&mut self.device)
    }

    /// Enqueues a copy of the host mirror to the device mirror on `stream` when the host side
    /// is newer; returns whether it copied. Returns at once: the host mirror's writers wait
    /// for the copy, and device work on other streams is ordered after it.
    pub fn sync_to_device(&mut self, stream: &Stream) -> Result<bool> {
        if self.state != Coherence::HostNewer {
            return Ok(false);
        }
        self.order_on(stream)?;
        self.device.copy_from_pinned(stream, &mut self.host)?;
        self.state = Coherence::InSync;
        Ok(true)
    }

    /// Enqueues a copy of the device mirror to the host mirror on `stream` when the device
    /// side is newer; returns whether it copied. Returns at once: [`UnifiedBuffer::host`]
    /// waits for the copy.
    pub fn sync_to_host(&mut self, stream: &Stream) -> Result<bool> {
        if self.state != Coherence::DeviceNewer {
            return Ok(false);
        }
        self.order_on(stream)?;
        self.device.copy_to_pinned(stream, &mut self.host)?;
        self.state = Coherence::InSync;
        Ok(true)
    }

    fn require_not(&self, stale: Coherence, op: &str) -> Result<()> {
        if self.state == stale {
            let (side, sync) = match stale {
                Coherence::DeviceNewer => ("device", "sync_to_host"),
                _ => ("host", "sync_to_device"),
            };
            return Err(Error::InvalidArgument(format!(
                "UnifiedBuffer::{op}: the {side} side is newer; call {sync} first"
            )));
        }
        Ok(())
    }

    /// Orders work on `stream` after the device-side work enqueued so far on the stream of
    /// the last device-side use, and makes `stream` that stream.
    fn order_on(&self, stream: &Stream) -> Result<()> {
        self.device.check_stream(stream, "UnifiedBuffer")?;
        let mut order = self.order.lock();
        if order.0.id() != stream.id() {
            order.0.record(&order.1)?;
            stream.wait(&order.1)?;
            order.0 = stream.clone();
        }
        Ok(())
    }
}

impl<T: DType> Drop for UnifiedBuffer<T> {
    fn drop(&mut self) {
        // The device mirror returns to its pool ordered on its allocation stream: make that
        // wait for the last stream that used it.
        let last = self.order.get_mut().0.clone();
        if let Err(e) = self.device.record_stream(&last) {
            tracing::warn!("{self:?}: ordering its free failed ({e})");
        }
    }
}

/// Where managed memory is prefetched to or advised for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Location {
    /// CUDA device `n`.
    Device(usize),
    /// Host memory.
    Host,
}

impl Location {
    fn ordinal(self) -> Option<usize> {
        match self {
            Location::Device(n) => Some(n),
            Location::Host => None,
        }
    }
}

/// A `cuMemAdvise` hint for managed memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Advice {
    /// Mostly read: the driver keeps read-only copies where it is read.
    ReadMostly,
    /// Pages stay at this location when possible; others fault or map remotely.
    PreferredLocation(Location),
    /// This location keeps a mapping, so its accesses do not fault.
    AccessedBy(Location),
}

/// `len` elements of CUDA managed memory (`cuMemAllocManaged`), reachable from the host and
/// the device; host memory on the CPU backend, where hints and prefetches do nothing.
///
/// Allocation is refused when it exceeds the device's free memory: over-subscribed managed
/// memory can hang the GPU.
pub struct ManagedBuffer<T: DType> {
    /// A view of the whole allocation for ops (it frees nothing on drop).
    view: Buffer<T>,
    _t: PhantomData<T>,
}

impl<T: DType> std::fmt::Debug for ManagedBuffer<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "ManagedBuffer<{}>[{}] on {}",
            T::KIND.name(),
            self.len(),
            self.device().label()
        )
    }
}

impl<T: DType> ManagedBuffer<T> {
    /// `len` elements (contents unspecified but valid values) of managed memory, for work on
    /// `stream`'s device. `OutOfMemory` without any allocation when the request exceeds the
    /// device's free memory.
    pub fn new(stream: &Stream, len: usize) -> Result<Self> {
        let device = stream.device();
        let bytes = bytes_for::<T>(len)?;
        let (free, _) = device.mem_info()?;
        if bytes > free {
            return Err(Error::OutOfMemory {
                requested: bytes,
                detail: format!(
                    "managed memory beyond the device's free {free} bytes is refused \
                     (over-subscription can hang the GPU)"
                ),
            });
        }
        let ptr = match bytes {
            0 => 0,
            _ => device.alloc_managed(bytes)?,
        };
        Ok(ManagedBuffer {
            view: Buffer {
                pool: device_pool(device)?.clone(),
                ptr,
                len,
                stream: stream.id(),
                alloc: pool::Allocation::None,
                uses: Vec::new(),
                tag: "managed",
                _t: PhantomData,
            },
            _t: PhantomData,
        })
    }

    pub fn len(&self) -> usize {
        self.view.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn size_bytes(&self) -> usize {
        self.view.size_bytes()
    }

    pub fn device(&self) -> &Device {
        self.view.device()
    }

    /// The memory as a [`Buffer`], for ops and kernels.
    pub fn as_buffer(&self) -> &Buffer<T> {
        &self.view
    }

    /// The memory as a mutable [`Buffer`], for ops and kernels that write it.
    pub fn as_buffer_mut(&mut self) -> &mut Buffer<T> {
        &mut self.view
    }

    /// The elements on the host, once all work on the device has finished (a host access
    /// racing a kernel on managed memory is undefined).
    pub fn host(&self) -> Result<&[T]> {
        self.device().synchronize()?;
        // SAFETY: `ptr` is this buffer's own live allocation of `len` elements, valid for
        // any bits; the device is idle and `&self` excludes host writers.
        Ok(unsafe { cpu::view(self.view.ptr, self.len()) })
    }

    /// The elements on the host for writing, once all work on the device has finished.
    pub fn host_mut(&mut self) -> Result<&mut [T]> {
        self.device().synchronize()?;
        // SAFETY: as in `host`; `&mut self` makes this the only reference.
        Ok(unsafe { cpu::view_mut(self.view.ptr, self.len()) })
    }

    /// Applies `advice` to the whole buffer.
    pub fn advise(&self, advice: Advice) -> Result<()> {
        if self.is_empty() {
            return Ok(());
        }
        let device = self.device();
        let (what, at) = match advice {
            Advice::ReadMostly => (MemAdvice::ReadMostly, device.ordinal()),
            Advice::PreferredLocation(l) => (MemAdvice::PreferredLocation, l.ordinal()),
            Advice::AccessedBy(l) => (MemAdvice::AccessedBy, l.ordinal()),
        };
        device.mem_advise(self.view.ptr, self.size_bytes(), what, at)
    }

    /// Enqueues a migration of elements `range` to `to` on `stream`.
    pub fn prefetch(&self, range: Range<usize>, to: Location, stream: &Stream) -> Result<()> {
        self.view.check_stream(stream, "ManagedBuffer::prefetch")?;
        if range.start > range.end || range.end > self.len() {
            return Err(Error::InvalidArgument(format!(
                "prefetch range {range:?} is outside 0..{}",
                self.len()
            )));
        }
        stream.run(
            (),
            |()| Ok(()),
            |(), q| {
                let d = q.gpu;
                let s = q.stream;
                if range.is_empty() {
                    return Ok(());
                }
                let size = std::mem::size_of::<T>();
                let ptr = self.view.ptr + (range.start * size) as u64;
                d.mem_prefetch(s, ptr, range.len() * size, to.ordinal())
            },
        )
    }
}

impl<T: DType> Drop for ManagedBuffer<T> {
    fn drop(&mut self) {
        if self.view.ptr == 0 {
            return;
        }
        let bytes = self.size_bytes();
        if let Err(e) = self.device().free_managed(self.view.ptr, bytes) {
            tracing::warn!("freeing managed memory failed: {e}");
        }
    }
}
