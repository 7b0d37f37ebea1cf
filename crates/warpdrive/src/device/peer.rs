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
