//! Peer access between GPUs: whether one device can reach another's memory (NVLink or PCIe
//! peer-to-peer), turning that access on, and copies between two devices' memory.

use cudarc::driver::result;
use cudarc::driver::sys::{self, CUresult};

use crate::error::Result;

use super::super::activity::{self, ActivityKind};
use super::context::CudaDevice;
use super::stream::GpuStream;

impl CudaDevice {
    /// Whether this device can read and write `peer`'s memory directly (no driver call once
    /// its access is on).
    pub(crate) fn can_access_peer(&self, peer: &CudaDevice) -> Result<bool> {
        if peer == self || self.inner.peers.lock().contains(&peer.ordinal()) {
            return Ok(true);
        }
        self.bind()?;
        let mut can = 0;
        // SAFETY: both are devices the driver opened; `can` outlives the call.
        let r = unsafe {
            sys::cuDeviceCanAccessPeer(
                &mut can,
                self.inner.ctx.cu_device(),
                peer.inner.ctx.cu_device(),
            )
        }
        .result();
        self.check("cuDeviceCanAccessPeer", r)?;
        Ok(can != 0)
    }

    /// Lets this device's copies and kernels reach `peer`'s memory (once per pair and process:
    /// the driver keeps it on until the context goes). Fails where
    /// [`can_access_peer`](Self::can_access_peer) is false.
    pub(crate) fn enable_peer_access(&self, peer: &CudaDevice) -> Result<()> {
        if peer == self || self.inner.peers.lock().contains(&peer.ordinal()) {
            return Ok(());
        }
        self.bind()?;
        // SAFETY: the current context is this device's; the peer's context is alive (its
        // device handle holds it).
        let r = unsafe { sys::cuCtxEnablePeerAccess(peer.inner.ctx.cu_ctx(), 0) };
        if r != CUresult::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED {
            self.check("cuCtxEnablePeerAccess", r.result())?;
        }
        self.inner.peers.lock().insert(peer.ordinal());
        Ok(())
    }

    /// Enqueues on `stream` (this device's) a copy of `bytes` from `src` in `from`'s memory
    /// to `dst` in this device's memory: direct where peer access is on, staged by the driver
    /// otherwise.
    ///
    /// # Safety
    /// `src` holds `bytes` on `from` and `dst` holds `bytes` on this device, both live until
    /// the stream has passed the copy, and neither is written by anyone else meanwhile.
    pub(crate) unsafe fn copy_from_peer(
        &self,
        stream: &GpuStream,
        dst: u64,
        from: &CudaDevice,
        src: u64,
        bytes: usize,
    ) -> Result<()> {
        if bytes == 0 {
            return Ok(());
        }
        self.bind()?;
        let t = activity::begin();
        // SAFETY: forwarded from this function's contract; both contexts are alive.
        let r = unsafe {
            result::memcpy_peer_async(
                self.inner.ctx.cu_ctx(),
                dst,
                from.inner.ctx.cu_ctx(),
                src,
                bytes,
                stream.cu_stream(),
            )
        };
        self.check("cuMemcpyPeerAsync", r)?;
        activity::end(
            t,
            ActivityKind::D2D,
            stream.cu_stream() as u64,
            bytes as u64,
        );
        Ok(())
    }
}
