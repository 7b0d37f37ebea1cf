//! Copies between devices: direct where the devices reach each other's memory (the same
//! device, or GPUs with peer access over NVLink or PCIe), staged through pinned host memory
//! where they do not, and through the upload and download paths between a GPU and the CPU
//! backend.

use crate::device::{Event, Stream};
use crate::dtype::DType;
use crate::error::Result;
use crate::memory::{check_len, Buffer, PinnedBuf};

use super::{download, upload};

/// Bytes per staging chunk: one DMA each way, two in flight (one filling from the source
/// while the other drains into the destination).
const STAGE_CHUNK: usize = 8 << 20;

/// How [`copy_peer`] moved the bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PeerPath {
    /// One copy the destination's device reaches directly (same device or peer access).
    Direct,
    /// Chunks through pinned host memory: the source's device downloads, the destination's
    /// uploads, overlapped.
    Staged,
    /// One side is the CPU backend: an upload or a download.
    Host,
}

/// Copies `src` into `dst` (same length, any two devices) on `stream`, a stream of `dst`'s
/// device: directly where `dst`'s device reaches `src`'s memory, else staged through pinned
/// host memory ([`copy_peer_staged`]). Enqueued (a copy to or from the CPU backend is done on
/// return); `src` must be ready when `stream` reaches the copy (its writes done, or ordered
/// before by [`Stream::wait`] on an event). Returns the path taken.
pub fn copy_peer<T: DType>(
    stream: &Stream,
    src: &Buffer<T>,
    dst: &mut Buffer<T>,
) -> Result<PeerPath> {
    check_args(stream, src, dst)?;
    if src.device().is_host_memory() || dst.device().is_host_memory() {
        return copy_host_side(stream, src, dst);
    }
    if dst.device().can_access_peer(src.device())? {
        // SAFETY: `src` and `dst` hold `size_bytes` each (lengths checked) and live until the
        // stream is done with them (the caller's buffers, borrowed for the call; the pools
        // order their reuse after the stream's work); `&mut dst` excludes other users.
        unsafe {
            stream.copy_from_peer(
                dst.device_ptr(),
                src.device(),
                src.device_ptr(),
                src.size_bytes(),
            )?
        };
        return Ok(PeerPath::Direct);
    }
    copy_peer_staged(stream, src, dst).map(|()| PeerPath::Staged)
}

/// [`copy_peer`] through pinned host memory whatever the devices: a stream of `src`'s device
/// downloads chunks into two pinned blocks and `stream` uploads each once it has landed, so
/// both links run at once. For GPUs without peer access (and to measure against the direct
/// path where they have it).
pub fn copy_peer_staged<T: DType>(
    stream: &Stream,
    src: &Buffer<T>,
    dst: &mut Buffer<T>,
) -> Result<()> {
    check_args(stream, src, dst)?;
    if src.device().is_host_memory() || dst.device().is_host_memory() {
        return copy_host_side(stream, src, dst).map(|_| ());
    }
    let bytes = src.size_bytes();
    if bytes == 0 {
        return Ok(());
    }
    let chunk = STAGE_CHUNK.min(bytes);
    let from = src.device().new_stream()?;
    // The download starts after what the caller ordered on `stream` (a wait for `src`'s
    // writer among it).
    let start = stream.device().new_event()?;
    stream.record(&start)?;
    from.wait(&start)?;
    let mut blocks = [
        PinnedBuf::<u8>::new(stream.device(), chunk)?,
        PinnedBuf::<u8>::new(stream.device(), chunk)?,
    ];
    let mut bases = [0u64; 2];
    for (base, block) in bases.iter_mut().zip(&mut blocks) {
        block.wait_slice_mut()?;
        *base = block.host_ptr();
    }
    let landed: [Event; 2] = [src.device().new_event()?, src.device().new_event()?];
    let sent: [Event; 2] = [stream.device().new_event()?, stream.device().new_event()?];
    let (up, down) = (
        crate::device::dma::Dma::of(stream),
        crate::device::dma::Dma::of(&from),
    );
    let result = (|| {
        for (i, at) in (0..bytes).step_by(chunk).enumerate() {
            let (slot, len) = (i % 2, chunk.min(bytes - at));
            if i >= 2 {
                from.wait(&sent[slot])?;
            }
            // SAFETY: the block holds `chunk` ≥ len bytes, `src` holds `bytes` from its base,
            // and the block's last upload has completed before this download runs (the wait
            // above); the upload below reads it only after this download lands.
            unsafe {
                down.copy(
                    false,
                    bases[slot] as *mut u8,
                    src.device_ptr() + at as u64,
                    len,
                )?
            };
            from.record(&landed[slot])?;
            stream.wait(&landed[slot])?;
            // SAFETY: as above; `dst` holds `bytes` and `&mut dst` excludes other users.
            unsafe {
                up.copy(
                    true,
                    bases[slot] as *mut u8,
                    dst.device_ptr() + at as u64,
                    len,
                )?
            };
            stream.record(&sent[slot])?;
        }
        Ok(())
    })();
    // The blocks go back to the pool once the stream's uploads (the last use of each) are
    // done, whether or not every chunk was enqueued.
    for block in &mut blocks {
        block.record_use(stream)?;
    }
    result
}

fn check_args<T: DType>(stream: &Stream, src: &Buffer<T>, dst: &Buffer<T>) -> Result<()> {
    check_len("copy_peer", src.len(), dst.len())?;
    dst.device().same_as(
        stream.device(),
        "copy_peer (the stream is the destination's)",
    )
}

/// A copy with the CPU backend on one side: the transfer floor's upload or download.
fn copy_host_side<T: DType>(
    stream: &Stream,
    src: &Buffer<T>,
    dst: &mut Buffer<T>,
) -> Result<PeerPath> {
    match (src.device().is_host_memory(), dst.device().is_host_memory()) {
        (true, true) => {
            dst.host_view_mut()?.copy_from_slice(src.host_view()?);
            Ok(PeerPath::Direct)
        }
        (true, false) => upload(stream, dst, src.host_view()?).map(|()| PeerPath::Host),
        _ => {
            let from = src.device().new_stream()?;
            download(&from, src, dst.host_view_mut()?).map(|()| PeerPath::Host)
        }
    }
}
