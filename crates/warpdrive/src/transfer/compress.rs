//! Wire compression: f32 sent over the link as bf16 or f16 (half the bytes). The host
//! narrows on the copy threads, chunk by chunk, while the DMA engine sends earlier chunks;
//! the device widens with the cast kernel. Downloads narrow on the device and widen on the
//! host. Lossy, opt-in: see [`BF16_REL_ERROR`] and [`F16_REL_ERROR`].

use std::fmt;
use std::mem::size_of_val;

use half::slice::HalfFloatSliceExt;
use half::{bf16, f16};

use super::hostmem::demote_lines;
use super::ring::ring_upload;
use super::{check_len, config, workers, Direction, TransferConfig, PAGE};
use crate::device::Stream;
use crate::dtype::{DTypeKind, Float};
use crate::error::Result;
use crate::exec::tune::{autotune, size_bucket};
use crate::memory::{Buffer, PinnedBuf};

/// Bound on |sent − x| / |x| for finite `x` sent as bf16 (round to nearest, 8 significant
/// bits; f32's whole range, subnormals aside).
pub const BF16_REL_ERROR: f64 = 1.0 / 256.0;
/// Bound on |sent − x| / |x| for `x` sent as f16 with 6.2e-5 ≤ |x| ≤ 65504 (11 significant
/// bits); larger values become ±inf, smaller ones keep [`F16_ABS_ERROR`].
pub const F16_REL_ERROR: f64 = 1.0 / 2048.0;
/// Bound on |sent − x| for `x` sent as f16 with |x| < 6.2e-5 (half of f16's subnormal step,
/// 2⁻²⁵).
pub const F16_ABS_ERROR: f64 = 1.0 / (1u64 << 25) as f64;

/// How f32 data crosses the link.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Compression {
    /// As f32, exact (the pageable fast path).
    None,
    /// As bf16: f32's range, [`BF16_REL_ERROR`].
    Bf16,
    /// As f16: [`F16_REL_ERROR`] in f16's range.
    F16,
    /// The fastest of the others for this size (to the next power of two) and direction,
    /// timed once on the caller's data and kept in the autotune cache (`exec::tune`).
    /// Uploads may pick `F16`, but data with a finite value beyond f16's range goes
    /// uncompressed instead (the copy is redone), so every value is within
    /// [`BF16_REL_ERROR`] relative or [`F16_ABS_ERROR`] absolute. The device flags an
    /// infinity while it widens (into pinned memory the host reads without a copy back) and
    /// the host looks at the source only when there is one, so the check costs the host
    /// nothing (a host-side check added about a fifth to the narrowing work; bench/NOTES.md,
    /// compressed transfers). Downloads pick `None` or `Bf16` (their
    /// narrowing runs on the device, unchecked).
    Auto,
}

impl fmt::Display for Compression {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Compression::None => "none",
            Compression::Bf16 => "bf16",
            Compression::F16 => "f16",
            Compression::Auto => "auto",
        })
    }
}

/// What `Auto` picks for `bytes` of f32 in `dir` on the stream's device: the kept choice for
/// the size's bucket, else the fastest of the candidates timed now by `run`.
fn resolve_auto(
    stream: &Stream,
    dir: Direction,
    bytes: usize,
    run: impl FnMut(&Stream, &Compression) -> Result<()>,
) -> Result<Compression> {
    if let Some(c) = auto_choice(stream, dir, bytes) {
        return Ok(c);
    }
    let key = (dir, size_bucket(bytes));
    let (kernel, candidates): (_, &[Compression]) = match dir {
        Direction::H2d => (
            "transfer.h2d.compression",
            &[Compression::None, Compression::Bf16, Compression::F16],
        ),
        Direction::D2h => (
            "transfer.d2h.compression",
            &[Compression::None, Compression::Bf16],
        ),
    };
    let best = autotune(stream, kernel, DTypeKind::F32, bytes, candidates, run)?;
    super::measured(stream.device())?
        .auto
        .lock()
        .insert(key, best);
    Ok(best)
}

/// What `Auto` has picked for `bytes` of f32 in `dir` on the stream's device in this
/// process (None: not yet asked for that size bucket).
pub fn auto_choice(stream: &Stream, dir: Direction, bytes: usize) -> Option<Compression> {
    let key = (dir, size_bucket(bytes));
    let measured = super::measured(stream.device()).ok()?;
    let choice = measured.auto.lock().get(&key).copied();
    choice
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
    let c = match compression {
        Compression::Auto => resolve_auto(stream, Direction::H2d, size_of_val(src), |s, c| {
            upload_auto(s, dst, src, *c)
        })?,
        c => c,
    };
    match (compression, c) {
        (Compression::Auto, c) => upload_auto(stream, dst, src, c),
        (_, Compression::Bf16) => upload_narrow::<bf16>(stream, dst, src, cast_and_wait),
        (_, Compression::F16) => upload_narrow::<f16>(stream, dst, src, cast_and_wait),
        _ => super::upload(stream, dst, src),
    }
}

/// An upload `Auto` chose `c` for: as `c`, except that `F16` falls back to `None` when
/// some finite value lies beyond f16's range. The device flags a ±inf while it widens;
/// only when it finds one does the host look at the source (an inf that was one already is
/// exact), so the common case costs the host nothing beyond plain `F16`.
fn upload_auto(stream: &Stream, dst: &mut Buffer<f32>, src: &[f32], c: Compression) -> Result<()> {
    if c != Compression::F16 {
        return upload_f32(stream, dst, src, c);
    }
    let mut any_inf = false;
    // The checking widen waits for the stream itself.
    upload_narrow::<f16>(stream, dst, src, |s, wire, dst| {
        any_inf = crate::ops::widen_f16_checking_inf(s, wire, dst)?;
        Ok(())
    })?;
    if !any_inf || !overflows_f16(src) {
        return Ok(());
    }
    tracing::debug!("transfer: data beyond f16's range; sending it uncompressed");
    super::upload(stream, dst, src)
}

/// Whether some finite value of `s` becomes ±inf as f16 (|x| ≥ 65520).
fn overflows_f16(s: &[f32]) -> bool {
    s.iter()
        .any(|&v| v.is_finite() && f16::from_f32(v).is_infinite())
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
    let c = match compression {
        Compression::Auto => resolve_auto(stream, Direction::D2h, size_of_val(dst), |s, c| {
            download_f32(s, src, dst, *c)
        })?,
        c => c,
    };
    match c {
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

/// The plain widening on the device, waited for.
fn cast_and_wait<H: Float>(stream: &Stream, wire: &Buffer<H>, dst: &mut Buffer<f32>) -> Result<()> {
    crate::ops::cast(stream, wire, dst)?;
    stream.synchronize()
}

/// Sends `src` narrowed to `H` (on the copy threads, chunk by chunk) and has `widen` turn
/// the wire into `dst` on the device and wait for it (Auto's checking widen waits inside
/// it: a second wait on the idle stream would be a driver call Auto pays and plain F16 does
/// not); returns when all of it is done.
fn upload_narrow<H: Float>(
    stream: &Stream,
    dst: &mut Buffer<f32>,
    src: &[f32],
    widen: impl FnOnce(&Stream, &Buffer<H>, &mut Buffer<f32>) -> Result<()>,
) -> Result<()>
where
    [H]: HalfFloatSliceExt,
{
    let cfg = config(stream, Direction::H2d)?;
    let workers = workers(stream.device());
    let mut wire = Buffer::<H>::uninit(stream, src.len())?;
    let narrow = |d: &mut [H], s: &[f32]| d.convert_from_f32_slice(s);
    // Converted with plain stores, so the ring is best read from the shared cache (see
    // `StagingStores::Demoted`).
    let narrow_demoted = |d: &mut [H], s: &[f32]| {
        narrow(d, s);
        demote_lines(d);
    };
    if !stream.device().is_host_memory() {
        // Chunks of the configured size in f32 bytes, through the staging ring.
        let plan = super::upload_plan::<f32>(stream, src.len(), &cfg)?;
        ring_upload(stream, workers, &mut wire, src, &plan, narrow_demoted)?;
    } else {
        workers.map(cfg.threads, PAGE, wire.host_view_mut()?, src, narrow)?;
    }
    widen(stream, &wire, dst)
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
            &stage.wait_slice()?[..piece.len()],
            &widen,
        )?;
        let next = i + depth;
        if next < n {
            wire.copy_to_pinned_at(stream, next * chunk, stage, chunk.min(total - next * chunk))?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::Device;
    use crate::test_support::device_test;

    #[test]
    fn f16_overflow_check() {
        let fits: [&[f32]; 5] = [
            &[1.0, -3.5, 65504.0, 65519.0, -65519.9, 6.1e-5, 0.0, -0.0],
            &[f32::INFINITY, f32::NEG_INFINITY, f32::NAN, 12.0],
            &[],
            &[-1.0e-3; 1000],
            &[1.0e-7, -3.0e-30, 2.0],
        ];
        for s in fits {
            assert!(!overflows_f16(s), "{s:?}");
        }
        for s in [
            &[1.0, 65520.0][..],
            &[2.0, -1.0e9],
            &[f32::MAX],
            &[-70000.0],
        ] {
            assert!(overflows_f16(s), "{s:?}");
        }
    }

    /// `Auto` having picked f16 sends data in range as f16 (a source inf included) and data
    /// beyond f16's range uncompressed (exactly).
    fn auto_f16_falls_back_to_exact_body(dev: &Device) {
        let s = dev.new_stream().unwrap();
        let n = (1 << 18) + 3;
        let mut src: Vec<f32> = (0..n).map(|i| (i % 977) as f32 * 0.25 + 1.0).collect();
        src[7] = 1.0e-7;
        src[11] = f32::NEG_INFINITY;
        let mut dst = Buffer::<f32>::from_host(&s, &vec![f32::NAN; n]).unwrap();
        upload_auto(&s, &mut dst, &src, Compression::F16).unwrap();
        let got = dst.to_host(&s).unwrap();
        // In range: sent as f16, within its bounds.
        assert!(got.iter().zip(&src).all(|(g, w)| {
            if w.is_infinite() {
                return g == w;
            }
            let err = f64::from((g - w).abs());
            err <= F16_REL_ERROR * f64::from(w.abs()) || err <= F16_ABS_ERROR
        }));
        assert_ne!(got, src);
        // Beyond it anywhere (the last element: the scalar tail on the device): exact.
        for at in [n - 2, n - 1, 3] {
            let mut wide = src.clone();
            wide[at] = if at == 3 { -1.0e6 } else { 65520.0 };
            upload_auto(&s, &mut dst, &wide, Compression::F16).unwrap();
            assert_eq!(dst.to_host(&s).unwrap(), wide, "beyond f16 at {at}");
        }
    }

    device_test!(
        auto_f16_falls_back_to_exact,
        gpu_auto_f16_falls_back_to_exact,
        auto_f16_falls_back_to_exact_body
    );
}
