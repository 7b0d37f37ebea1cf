//! The copy engine a staged copy feeds through its pinned ring: the stream's DMA engine on
//! CUDA; on the CPU backend the calling thread's own copy, complete when the call returns
//! (work on a CPU stream runs at once), so the event recorded after it finds it done. The
//! ring (`transfer::ring`) runs the same protocol on both: enqueue a copy, record its
//! event, reuse the ring's room only once that event has completed.

use super::{cpu, Gpu, GpuStream, Stream};
use crate::error::Result;

/// Where a stream's copies between pinned host memory and its device memory run.
pub(crate) enum Dma<'s> {
    Gpu(&'s Gpu, &'s GpuStream),
    Cpu,
}

impl<'s> Dma<'s> {
    /// The engine of `stream` (one lookup per copy, not per DMA).
    pub(crate) fn of(stream: &'s Stream) -> Dma<'s> {
        match stream.queue() {
            Some(q) => Dma::Gpu(q.gpu, q.stream),
            None => Dma::Cpu,
        }
    }

    /// Enqueues a copy of `bytes` from host memory at `host` to device memory at `dev`
    /// (`to_device`), or back; on the CPU backend it has run when this returns.
    ///
    /// # Safety
    /// `host` and `dev` each hold `bytes` bytes (`dev` in this stream's device memory), and
    /// neither range is written, nor the one this copy writes read, by anyone else until the
    /// stream has passed this copy.
    #[inline]
    pub(crate) unsafe fn copy(
        &self,
        to_device: bool,
        host: *mut u8,
        dev: u64,
        bytes: usize,
    ) -> Result<()> {
        match self {
            // SAFETY: forwarded from this function's contract.
            Dma::Gpu(device, cu_stream) => unsafe {
                device.copy_raw_async(cu_stream, to_device, host, dev, bytes)
            },
            Dma::Cpu => {
                // SAFETY: forwarded from this function's contract (a CPU device address is a
                // host address).
                unsafe { cpu::copy_raw(to_device, host, dev, bytes) };
                Ok(())
            }
        }
    }
}
