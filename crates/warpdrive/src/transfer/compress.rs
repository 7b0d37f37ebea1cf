//! Wire compression: f32 sent over the link as bf16 or f16 (half the bytes). The host
//! narrows on the copy threads, chunk by chunk, while the DMA engine sends earlier chunks;
//! the device widens with the cast kernel. Downloads narrow on the device and widen on the
//! host. Lossy, opt-in: see [`BF16_REL_ERROR`] and [`F16_REL_ERROR`].

use std::collections::HashMap;

use half::slice::HalfFloatSliceExt;
use half::{bf16, f16};
use parking_lot::Mutex;

use super::{check_len, config, workers, Direction, TransferConfig, MIB, PAGE};
use crate::device::Stream;
use crate::dtype::Float;
use crate::error::Result;
use crate::memory::{Buffer, PinnedBuf};

/// Bound on |sent − x| / |x| for finite `x` sent as bf16 (round to nearest, 8 significant
/// bits; f32's whole range, subnormals aside).
pub const BF16_REL_ERROR: f64 = 1.0 / 256.0;
/// Bound on |sent − x| / |x| for `x` sent as f16 with 6.2e-5 ≤ |x| ≤ 65504 (11 significant
/// bits); larger values become ±inf, smaller ones lose precision.
pub const F16_REL_ERROR: f64 = 1.0 / 2048.0;

/// How f32 data crosses the link.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Compression {
    /// As f32, exact (the pageable fast path).
    None,
    /// As bf16: f32's range, [`BF16_REL_ERROR`].
    Bf16,
    /// As f16: [`F16_REL_ERROR`] in f16's range.
    F16,
    /// `None` or `Bf16`, whichever was faster when measured once on this device and
    /// direction (lossy when it picks `Bf16`).
    Auto,
}

/// The size `Auto` measures at.
const AUTO_BYTES: usize = 64 * MIB;

static AUTO: Mutex<Option<HashMap<(String, Direction), Compression>>> = Mutex::new(None);

/// What `Auto` resolves to on the stream's device for `dir` (measured on first use).
pub fn resolve(stream: &Stream, dir: Direction, c: Compression) -> Result<Compression> {
    if c != Compression::Auto {
        return Ok(c);
    }
    let key = (stream.device().label(), dir);
    if let Some(c) = AUTO.lock().as_ref().and_then(|m| m.get(&key)) {
        return Ok(*c);
    }
    // Small on the CPU backend, where there is no link to win against.
    let bytes = if stream.device().is_cuda() {
        AUTO_BYTES
    } else {
        AUTO_BYTES / 16
    };
    let n = bytes / 4;
    let mut host: Vec<f32> = (0..n).map(|i| (i % 1000) as f32 * 0.37).collect();
    let mut dev = Buffer::<f32>::uninit(stream, n)?;
    let mut best = (f64::INFINITY, Compression::None);
    for c in [Compression::None, Compression::Bf16] {
        let mut times = Vec::new();
        for _ in 0..4 {
            let t = std::time::Instant::now();
            match dir {
                Direction::H2d => upload_f32(stream, &mut dev, &host, c)?,
                Direction::D2h => download_f32(stream, &dev, &mut host, c)?,
            }
            times.push(t.elapsed().as_secs_f64());
        }
        // The first run warms up.
        let t = times[1..].iter().copied().fold(f64::INFINITY, f64::min);
        if t < best.0 {
            best = (t, c);
        }
    }
    AUTO.lock()
        .get_or_insert_with(HashMap::new)
        .insert(key, best.1);
    Ok(best.1)
}

/// Copies `src` into `dst` (same length) as `compression` says; returns when done.
pub fn upload_f32(
    stream: &Stream,
    dst: &mut Buffer<f32>,
    src: &[f32],
    compression: Compression,
) -> Result<()> {
    check_len("transfer::upload_f32", dst.len(), src.len())?;
    if std::mem::size_of_val(src) < super::ALWAYS_DIRECT {
        return super::upload(stream, dst, src);
    }
    match resolve(stream, Direction::H2d, compression)? {
        Compression::Bf16 => {
            upload_narrow::<bf16>(stream, dst, src, |d, s| d.convert_from_f32_slice(s))
        }
        Compression::F16 => {
            upload_narrow::<f16>(stream, dst, src, |d, s| d.convert_from_f32_slice(s))
        }
        _ => super::upload(stream, dst, src),
    }
}

/// Copies `src` into `dst` (same length) as `compression` says; returns when done.
pub fn download_f32(
    stream: &Stream,
    src: &Buffer<f32>,
    dst: &mut [f32],
    compression: Compression,
) -> Result<()> {
    check_len("transfer::download_f32", src.len(), dst.len())?;
    if std::mem::size_of_val(dst) < super::ALWAYS_DIRECT {
        return super::download(stream, src, dst);
    }
    match resolve(stream, Direction::D2h, compression)? {
        Compression::Bf16 => {
            download_narrow::<bf16>(stream, src, dst, |d, s| s.convert_to_f32_slice(d))
        }
        Compression::F16 => {
            download_narrow::<f16>(stream, src, dst, |d, s| s.convert_to_f32_slice(d))
        }
        _ => super::download(stream, src, dst),
    }
}

fn chunking(len: usize, cfg: &TransferConfig) -> usize {
    // Chunks of the configured size in f32 bytes.
    super::chunk_len::<f32>(len, cfg)
}

fn upload_narrow<H: Float>(
    stream: &Stream,
    dst: &mut Buffer<f32>,
    src: &[f32],
    narrow: impl Fn(&mut [H], &[f32]) + Sync,
) -> Result<()> {
    let cfg = config(stream, Direction::H2d)?;
    let workers = workers(stream.device());
    let chunk = chunking(src.len(), &cfg);
    let n = src.len().div_ceil(chunk);
    let mut wire = Buffer::<H>::uninit(stream, src.len())?;
    let mut slots = (0..cfg.depth.clamp(1, n.max(1)))
        .map(|_| PinnedBuf::<H>::new(stream.device(), chunk))
        .collect::<Result<Vec<_>>>()?;
    let depth = slots.len();
    for (i, piece) in src.chunks(chunk).enumerate() {
        let stage = &mut slots[i % depth];
        workers.map(
            cfg.threads,
            PAGE,
            &mut stage.as_mut_slice()?[..piece.len()],
            piece,
            &narrow,
        );
        wire.copy_from_pinned_at(stream, i * chunk, stage, piece.len())?;
    }
    crate::ops::cast(stream, &wire, dst)?;
    stream.synchronize()
}

fn download_narrow<H: Float>(
    stream: &Stream,
    src: &Buffer<f32>,
    dst: &mut [f32],
    widen: impl Fn(&mut [f32], &[H]) + Sync,
) -> Result<()> {
    let cfg = config(stream, Direction::D2h)?;
    let workers = workers(stream.device());
    let chunk = chunking(dst.len(), &cfg);
    let n = dst.len().div_ceil(chunk);
    let mut wire = Buffer::<H>::uninit(stream, src.len())?;
    crate::ops::cast(stream, src, &mut wire)?;
    let mut slots = (0..cfg.depth.clamp(1, n.max(1)))
        .map(|_| PinnedBuf::<H>::new(stream.device(), chunk))
        .collect::<Result<Vec<_>>>()?;
    let depth = slots.len();
    let total = dst.len();
    for (i, stage) in slots.iter_mut().enumerate() {
        wire.copy_to_pinned_at(stream, i * chunk, stage, chunk.min(total - i * chunk))?;
    }
    for (i, piece) in dst.chunks_mut(chunk).enumerate() {
        let stage = &mut slots[i % depth];
        workers.map(
            cfg.threads,
            PAGE,
            piece,
            &stage.as_slice()?[..piece.len()],
            &widen,
        );
        let next = i + depth;
        if next < n {
            wire.copy_to_pinned_at(stream, next * chunk, stage, chunk.min(total - next * chunk))?;
        }
    }
    Ok(())
}
