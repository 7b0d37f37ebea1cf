//! Copies between two devices' memory, as the floors above use them: whether a device can
//! reach another's memory directly, and the direct copy once it can.

use super::{Device, Stream};
use crate::error::{Error, Result};

impl Device {
    /// Whether this device can copy to and from `peer`'s memory directly: the same device,
    /// or two GPUs with peer access (NVLink or PCIe peer-to-peer). The CPU backend and a GPU
    /// cannot (their copies go through the transfer floor).
    pub fn can_access_peer(&self, peer: &Device) -> Result<bool> {
        match (self, peer) {
            (Device::Cuda(a), Device::Cuda(b)) => a.can_access_peer(b),
            (Device::Cpu, Device::Cpu) => Ok(true),
            _ => Ok(false),
        }
    }
}

impl Stream {
    /// Enqueues a direct copy of `bytes` from `src` in `from`'s memory to `dst` in this
    /// stream's device memory, turning peer access on first (once per pair). Call it where
    /// [`Device::can_access_peer`] is true: otherwise turning access on fails (a driver
    /// error), and between the CPU backend and a GPU it is `Unsupported`.
    ///
    /// # Safety
    /// `src` holds `bytes` on `from`, `dst` holds `bytes` on this stream's device, both stay
    /// live until the stream has passed the copy, and neither is written by anyone else
    /// meanwhile (nor `dst` read).
    pub(crate) unsafe fn copy_from_peer(
        &self,
        dst: u64,
        from: &Device,
        src: u64,
        bytes: usize,
    ) -> Result<()> {
        match (self.queue(), from) {
            (Some(q), Device::Cuda(peer)) => {
                q.gpu.enable_peer_access(peer)?;
                // SAFETY: forwarded from this function's contract.
                unsafe { q.gpu.copy_from_peer(q.stream, dst, peer, src, bytes) }
            }
            (None, Device::Cpu) => {
                // SAFETY: forwarded (CPU device addresses are host addresses; work on a CPU
                // stream runs at once).
                unsafe { super::cpu::copy_raw(true, src as *mut u8, dst, bytes) };
                Ok(())
            }
            _ => Err(Error::Unsupported(format!(
                "a direct copy from {} to {}",
                from.label(),
                self.device().label()
            ))),
        }
    }
}

/// Memory on one device that kernels on several devices load and store directly: VMM
/// memory of one GPU mapped for each GPU named (CUDA), or zeroed host memory (the CPU
/// backend, whose "kernels" are host threads). Zeroed when made.
#[derive(Debug)]
pub(crate) enum PeerMemory {
    /// Host words: 8-byte aligned so signal words are atomics.
    Host(Box<[std::sync::atomic::AtomicU64]>),
    Mapped(super::cuda::PeerMappedAlloc),
}

impl PeerMemory {
    /// Its first address, the same for every device that reaches it (a host address on the
    /// CPU backend).
    pub(crate) fn device_ptr(&self) -> u64 {
        match self {
            PeerMemory::Host(w) => w.as_ptr() as u64,
            PeerMemory::Mapped(m) => m.device_ptr(),
        }
    }

    /// Bytes it holds (at least what was asked).
    pub(crate) fn size(&self) -> usize {
        match self {
            PeerMemory::Host(w) => w.len() * 8,
            PeerMemory::Mapped(m) => m.size(),
        }
    }

    /// The words, where the memory is host memory (the CPU backend).
    pub(crate) fn host_words(&self) -> Option<&[std::sync::atomic::AtomicU64]> {
        match self {
            PeerMemory::Host(w) => Some(w),
            PeerMemory::Mapped(_) => None,
        }
    }

    fn check_range(&self, offset: usize, len: usize) -> Result<()> {
        match offset.checked_add(len) {
            Some(end) if end <= self.size() => Ok(()),
            _ => Err(Error::InvalidArgument(format!(
                "bytes {offset}..+{len} of peer-mapped memory of {} bytes",
                self.size()
            ))),
        }
    }

    /// Copies `data` to byte `offset`, done on return, through `stream` (a stream of a
    /// device that reaches this memory; any CPU stream on the CPU backend).
    pub(crate) fn write(&self, stream: &Stream, offset: usize, data: &[u8]) -> Result<()> {
        self.check_range(offset, data.len())?;
        match (self, stream.queue()) {
            (PeerMemory::Host(words), None) => {
                host_write(words, offset, data);
                Ok(())
            }
            (PeerMemory::Mapped(m), Some(q)) => {
                q.gpu
                    .copy_h2d(q.stream, m.device_ptr() + offset as u64, data)
            }
            _ => Err(Error::Unsupported(format!(
                "peer-mapped memory written through a stream of {}",
                stream.device().label()
            ))),
        }
    }

    /// Copies the bytes at `offset` into `out`, done on return, through `stream` (as
    /// [`write`](Self::write)).
    pub(crate) fn read(&self, stream: &Stream, offset: usize, out: &mut [u8]) -> Result<()> {
        self.check_range(offset, out.len())?;
        match (self, stream.queue()) {
            (PeerMemory::Host(words), None) => {
                host_read(words, offset, out);
                Ok(())
            }
            (PeerMemory::Mapped(m), Some(q)) => {
                q.gpu
                    .copy_d2h(q.stream, out, m.device_ptr() + offset as u64)
            }
            _ => Err(Error::Unsupported(format!(
                "peer-mapped memory read through a stream of {}",
                stream.device().label()
            ))),
        }
    }
}

/// Stores `data` at byte `offset` of `words` (little-endian bytes of each word), a whole
/// word at a time where the range covers it and by compare-and-swap at its two ends, so
/// concurrent writers of neighbouring bytes never lose each other's bytes.
pub(crate) fn host_write(words: &[std::sync::atomic::AtomicU64], offset: usize, data: &[u8]) {
    use std::sync::atomic::Ordering::Relaxed;
    let mut at = 0;
    while at < data.len() {
        let byte = offset + at;
        let (w, lo) = (byte / 8, byte % 8);
        let n = (8 - lo).min(data.len() - at);
        let mut bytes = [0u8; 8];
        bytes[lo..lo + n].copy_from_slice(&data[at..at + n]);
        let value = u64::from_le_bytes(bytes);
        if n == 8 {
            words[w].store(value, Relaxed);
        } else {
            let mask = (u64::MAX >> (64 - 8 * n as u32)) << (8 * lo as u32);
            let _ = words[w].fetch_update(Relaxed, Relaxed, |old| Some(old & !mask | value));
        }
        at += n;
    }
}

/// Loads the bytes at `offset` of `words` into `out` (little-endian bytes of each word).
pub(crate) fn host_read(words: &[std::sync::atomic::AtomicU64], offset: usize, out: &mut [u8]) {
    let mut at = 0;
    while at < out.len() {
        let byte = offset + at;
        let (w, lo) = (byte / 8, byte % 8);
        let n = (8 - lo).min(out.len() - at);
        let bytes = words[w]
            .load(std::sync::atomic::Ordering::Relaxed)
            .to_le_bytes();
        out[at..at + n].copy_from_slice(&bytes[lo..lo + n]);
        at += n;
    }
}

impl Device {
    /// `bytes > 0` zeroed bytes of this device's memory that kernels on this device and on
    /// each of `reach` load and store directly. Every device must be of this one's backend;
    /// a GPU that cannot reach this one's memory (no peer access) is `Unsupported`.
    pub(crate) fn peer_memory(&self, bytes: usize, reach: &[Device]) -> Result<PeerMemory> {
        if bytes == 0 {
            return Err(Error::InvalidArgument(
                "peer-mapped memory of 0 bytes".into(),
            ));
        }
        match self {
            Device::Cpu => {
                if let Some(d) = reach.iter().find(|d| !d.is_host_memory()) {
                    return Err(Error::Unsupported(format!(
                        "peer-mapped memory between the CPU backend and {}",
                        d.label()
                    )));
                }
                let words = bytes.div_ceil(8);
                // Refused as a value, not an abort, when the host cannot hold it.
                let mut host = Vec::new();
                host.try_reserve_exact(words)
                    .map_err(|e| Error::OutOfMemory {
                        requested: bytes,
                        detail: format!("peer-mapped memory on the host: {e}"),
                    })?;
                host.extend((0..words).map(|_| std::sync::atomic::AtomicU64::new(0)));
                Ok(PeerMemory::Host(host.into_boxed_slice()))
            }
            Device::Cuda(owner) => {
                let mut gpus = Vec::with_capacity(reach.len());
                for d in reach {
                    match d {
                        Device::Cuda(g) => gpus.push(g.clone()),
                        _ => {
                            return Err(Error::Unsupported(format!(
                                "peer-mapped memory between {} and {}",
                                self.label(),
                                d.label()
                            )))
                        }
                    }
                }
                super::cuda::PeerMappedAlloc::new(owner, bytes, &gpus).map(PeerMemory::Mapped)
            }
        }
    }
}
