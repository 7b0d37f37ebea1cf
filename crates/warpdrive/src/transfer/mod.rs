//! Host ↔ device transfers at the link's speed.
//!
//! - **Pageable fast path** ([`upload`], [`download`], [`to_host`], [`from_host`]): a large
//!   copy from or to an ordinary slice is split into chunks; the persistent copy threads
//!   ([`Workers`], pinned to the GPU's NUMA node) fill pinned staging blocks from the pinned
//!   pool while the DMA engine moves earlier chunks ([`TransferConfig::depth`] in flight, an
//!   event per chunk guarding each block's reuse), as a ring without a barrier per chunk
//!   (`ring/`: the grid of parts, the upload feed, the download flow); uploads write its
//!   blocks as [`StagingStores`] says. Copies under
//!   [`TransferConfig::direct_below`] take one DMA through one pinned block (filled or read
//!   by the copy threads from [`ALWAYS_DIRECT`]; [`to_host`] faults its fresh pages in
//!   during the DMA), except uploads under 64 KiB: the driver's own copy. Chunk
//!   size and thread count are tuned at the first large copy on a device and kept in the
//!   autotune cache (`exec::tune`); [`set_config`] overrides them.
//!   On the CPU backend the staged copies run through the same ring, the CPU's own copy
//!   standing in for the DMA engine (`device::dma`), so the ring is checked without a GPU;
//!   single-DMA copies there are the backend's plain copy.
//!   [`Buffer`]'s host copies (`from_host`, `copy_from_host`, `copy_to_host`, `to_host`) are
//!   these functions, defined on this floor (`buffer.rs`: `memory` sits below it); the
//!   driver's own copy stays as `Buffer::driver_copy_*`. [`to_host`] fills a fresh `Vec`
//!   never zeroed first, all copy threads taking its page faults in parallel (huge pages
//!   from 32 MiB; `hostmem.rs`: `FreshVec`, the streaming and demoting stores). The copy
//!   threads are [`Workers`] (`workers.rs`), made once per process.
//! - [`Batch`]: many small slices gathered (at upload, on the copy threads) into one pinned
//!   block, one DMA, and a device offsets table; [`Packed::download`] is the reverse.
//! - [`Pipeline`]: chunks streamed through N streams (H2D, user compute, D2H overlapping; a
//!   staging thread does the host copies meanwhile), ordered output, per-stage busy time
//!   and overlap efficiency.
//! - Wire compression ([`upload_f32`], [`download_f32`], [`Compression`]): f32 sent as
//!   bf16/f16 and widened on the device (or narrowed there and widened on the host);
//!   [`Compression::Auto`] picks per size bucket.

mod batch;
mod buffer;
mod compress;
mod hostmem;
mod peer;
mod pipeline;
mod ring;
pub mod workers;

pub use batch::{Batch, Handle, Packed};
pub use compress::{
    auto_choice, download_f32, upload_f32, Compression, BF16_REL_ERROR, F16_ABS_ERROR,
    F16_REL_ERROR,
};
pub use hostmem::stream_copy;
pub use peer::{copy_peer, copy_peer_staged, PeerPath};
pub use pipeline::{Pipeline, PipelineStats};
pub use ring::RingPlan;
pub use workers::Workers;

use std::fmt;
use std::mem::size_of_val;

use parking_lot::Mutex;

use crate::device::{Device, Slot, Stream};
use crate::dtype::{DType, DTypeKind};
use crate::error::Result;
use crate::memory::{check_len, Buffer, PinnedBuf};
use hostmem::{demote_copy, demote_lines, FreshVec, HUGE_PAGE};
use ring::{ring_download, ring_download_fresh, ring_upload};
use workers::PAGE;

const KIB: usize = 1 << 10;
const MIB: usize = 1 << 20;
/// The size the first large copy on a device tunes the chunk size and threads at.
pub const TUNE_BYTES: usize = 64 * MIB;

/// How a staged copy runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TransferConfig {
    /// Bytes per chunk (one pinned staging block each).
    pub chunk_bytes: usize,
    /// Copy threads per chunk (the caller's included).
    pub threads: usize,
    /// Staging blocks in flight.
    pub depth: usize,
    /// Copies of fewer bytes take one DMA without chunks, through one pinned block
    /// (uploads under 64 KiB: the driver's copy).
    pub direct_below: usize,
    /// How uploads write their staging blocks (downloads ignore it).
    pub stores: StagingStores,
}

/// How the copy threads write an upload's staging blocks, which the DMA engine reads next.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum StagingStores {
    /// Non-temporal stores (`stream_copy`): each line goes to memory, and the DMA engine
    /// reads it back from there.
    #[default]
    NonTemporal,
    /// Plain stores, then each line pushed to the shared last-level cache (`demote_copy`):
    /// the DMA engine reads the staging ring from the cache (faster than non-temporal stores
    /// where the CPU has `cldemote`; bench/NOTES.md, staging stores).
    Demoted,
}

impl Default for TransferConfig {
    fn default() -> Self {
        TransferConfig {
            chunk_bytes: 8 * MIB,
            threads: 8,
            depth: 3,
            direct_below: MIB,
            stores: StagingStores::NonTemporal,
        }
    }
}

impl fmt::Display for TransferConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}KiBx{}", self.chunk_bytes / KIB, self.threads)?;
        if self.stores == StagingStores::Demoted {
            write!(f, "-demoted")?;
        }
        Ok(())
    }
}

/// Which way a copy goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Direction {
    H2d,
    D2h,
}

static OVERRIDE: Mutex<Option<TransferConfig>> = Mutex::new(None);

/// What the transfer floor measures once per device: the tuned configuration of each
/// direction and the link's rate (the device's [`Slot::Transfer`]).
#[derive(Default)]
struct Measured {
    tuned: Mutex<[Option<TransferConfig>; 2]>,
    h2d_rate: Mutex<Option<f64>>,
    /// `Compression::Auto`'s choices by direction and size bucket, in front of the autotune
    /// cache (which keys by name).
    auto: Mutex<std::collections::HashMap<(Direction, u32), compress::Compression>>,
}

fn measured(device: &Device) -> Result<&'static Measured> {
    device.state(Slot::Transfer, || Ok(Measured::default()))
}
/// Bytes of pinned ring an upload keeps in flight (`depth` chunks of `chunk_bytes`; a chunk is
/// an upload's longest DMA): a 16 MiB ring stays in the shared last-level cache, where the
/// DMA engine reads it, and beat 32 and 64 MiB ones (bench/NOTES.md, staging ring).
const UPLOAD_RING: usize = 16 * MIB;

/// The upload size the two kinds of staging store are compared at (see [`tune`]).
const STORES_TUNE_BYTES: usize = 256 * MIB;

/// Seconds of timing rounds each stage of the copy tune takes: host-bound copies scatter on
/// a busy VM, and the default quarter second gave them 5-6 rounds (bench/NOTES.md).
const COPY_TUNE_BUDGET_S: f64 = 1.0;

/// Bytes of staging blocks a download keeps in flight: a block is refilled only once all
/// of its chunk is copied out, so the ring must hold the DMA's lead as well as the chunks
/// being copied: 48-96 MiB rings of 4-8 MiB blocks beat three 16 MiB blocks
/// (bench/NOTES.md, staging ring).
const DOWNLOAD_RING: usize = 64 * MIB;

/// The most bytes a copy thread takes at a time in a staged copy (its part of a chunk;
/// copies into fresh memory take whole 2 MiB regions): 128 KiB beat 256 KiB, and smaller
/// parts lost at 64 MiB after the driver's own copy (bench/NOTES.md, staging ring).
const RING_PART: usize = 128 * KIB;

/// Uses `config` for every later copy (instead of the tuned one); `None` goes back to tuning.
pub fn set_config(config: Option<TransferConfig>) {
    *OVERRIDE.lock() = config;
}

/// A new `Vec` holding `src`; from 32 MiB written on `device`'s copy threads,
/// each faulting its own huge pages, where `to_vec` faults 4 KiB pages one by one on one
/// thread (a 64 MiB `to_vec` took 30-40 ms on the build VM). Below that, waking the copy
/// threads cost more than they saved (a 4 MiB disk read 0.5 ms slower; bench/NOTES.md).
pub fn fresh_copy<T: DType>(device: &Device, src: &[T]) -> Result<Vec<T>> {
    let mut out = FreshVec::with_capacity(src.len())?;
    let workers = workers(device);
    out.extend_par(workers, fresh_threads::<T>(workers, src.len()), src)?;
    Ok(out.into_vec())
}

/// A new `Vec` of `len` zeros, written as [`fresh_copy`] writes.
pub fn fresh_zeroed<T: DType>(device: &Device, len: usize) -> Result<Vec<T>> {
    let mut out = FreshVec::with_capacity(len)?;
    let workers = workers(device);
    out.extend_zeroed_par(workers, fresh_threads::<T>(workers, len), len)?;
    Ok(out.into_vec())
}

/// A new `Vec` of `len` zero bytes whose pages nobody has touched yet (fresh from the
/// allocator, transparent huge pages asked for from 32 MiB): a buffer for a read to land in
/// piece by piece on several threads, each faulting in its own pages, with no zeroing pass.
pub fn fresh_landing(len: usize) -> Result<Vec<u8>> {
    let mut v = crate::memory::host_zeroed("a new Vec", len)?;
    if len >= hostmem::HUGE_FROM {
        hostmem::advise_huge_pages(&mut v);
    }
    Ok(v)
}

/// The copy threads [`fresh_copy`] uses for `len` elements.
fn fresh_threads<T>(workers: &Workers, len: usize) -> usize {
    if len.saturating_mul(std::mem::size_of::<T>()) >= hostmem::HUGE_FROM {
        workers.threads()
    } else {
        1
    }
}

/// The copy threads for `device` (pinned to its NUMA node when known).
pub fn workers(device: &Device) -> &'static Workers {
    let numa = || device.info().ok().and_then(|i| i.numa_node);
    match device.state(Slot::CopyWorkers, || Ok(Workers::for_node(numa()))) {
        Ok(w) => w,
        // Only a slot holding another type fails: unplaced threads still copy.
        Err(_) => Workers::for_node(None),
    }
}

/// The configuration copies in `dir` use on the stream's device: the override, else the
/// tuned one (tuned now on a CUDA device's first call), else the default.
pub fn config(stream: &Stream, dir: Direction) -> Result<TransferConfig> {
    if let Some(c) = *OVERRIDE.lock() {
        return Ok(c);
    }
    let device = stream.device();
    if device.is_host_memory() {
        return Ok(TransferConfig::default());
    }
    let measured = measured(device)?;
    if let Some(c) = measured.tuned.lock()[dir as usize] {
        return Ok(c);
    }
    let tuned = tune(stream, dir)?;
    measured.tuned.lock()[dir as usize] = Some(tuned);
    Ok(tuned)
}

/// Host memory for timing copies of `window` bytes: whole windows spanning twice the CPU's
/// last-level cache (at least two), so each timed copy's host side comes from memory, as a
/// large copy's does (a cache-resident source made 4 copy threads look as fast as 16, and
/// the 4 chosen then ran at half speed from memory; bench/NOTES.md, copy tune). Written on
/// every copy thread: untouched pages would all read as the kernel's one shared zero page
/// (always cached) and fault inside the timings.
fn tune_host(stream: &Stream, window: usize) -> Result<Vec<u8>> {
    let llc = crate::device::sysfs::last_level_cache_bytes(std::path::Path::new("/sys"));
    let mut host = vec![0u8; tune_windows(llc.unwrap_or(0), window) * window];
    let workers = workers(stream.device());
    let units = vec![(); host.len()];
    workers.map(workers.threads(), PAGE, &mut host, &units, |d, _| {
        d.fill(0x5a)
    })?;
    Ok(host)
}

/// Times the candidate chunk sizes and thread counts on a [`TUNE_BYTES`] copy (once per
/// device and direction; the winners are kept in the autotune cache). Uploads tune each
/// kind of staging store apart, then time the two winners on a [`STORES_TUNE_BYTES`]
/// upload: the demoted ring's lead grows with the copy (it goes round the ring more often),
/// so the two can tie at 64 MiB and differ at 1 GiB (bench/NOTES.md, copy tune).
fn tune(stream: &Stream, dir: Direction) -> Result<TransferConfig> {
    let max_threads = workers(stream.device()).threads();
    // Each timed copy uses the next window of the host span, sized for the largest timing.
    let mut host = tune_host(
        stream,
        match dir {
            Direction::H2d => STORES_TUNE_BYTES,
            Direction::D2h => TUNE_BYTES,
        },
    )?;
    let (span, mut next) = (host.len(), 0usize);
    let mut window = |bytes: usize| {
        let windows = span / bytes;
        let at = next % windows * bytes;
        next += 1;
        at..at + bytes
    };
    // Zeroed, as the crossover's buffers below: the downloads read it, and a copy of memory
    // nothing wrote is what compute-sanitizer's initcheck reports.
    let mut dev = Buffer::<u8>::zeros(stream, TUNE_BYTES)?;
    let mut best = match dir {
        Direction::D2h => crate::exec::tune::autotune_within(
            stream,
            "transfer.d2h",
            DTypeKind::U8,
            TUNE_BYTES,
            &tune_candidates(dir, max_threads),
            COPY_TUNE_BUDGET_S,
            |s, c| staged_d2h(s, &dev, &mut host[window(TUNE_BYTES)], c),
        )?,
        Direction::H2d => {
            let mut winners = Vec::new();
            for (kernel, stores) in [
                ("transfer.h2d", StagingStores::NonTemporal),
                ("transfer.h2d.demoted", StagingStores::Demoted),
            ] {
                let candidates: Vec<TransferConfig> = tune_candidates(dir, max_threads)
                    .into_iter()
                    .filter(|c| c.stores == stores)
                    .collect();
                winners.push(crate::exec::tune::autotune_within(
                    stream,
                    kernel,
                    DTypeKind::U8,
                    TUNE_BYTES,
                    &candidates,
                    COPY_TUNE_BUDGET_S,
                    |s, c| staged_h2d(s, &mut dev, &host[window(TUNE_BYTES)], c),
                )?);
            }
            drop(dev);
            dev = Buffer::<u8>::uninit(stream, STORES_TUNE_BYTES)?;
            crate::exec::tune::autotune_within(
                stream,
                "transfer.h2d.stores",
                DTypeKind::U8,
                STORES_TUNE_BYTES,
                &winners,
                COPY_TUNE_BUDGET_S,
                |s, c| staged_h2d(s, &mut dev, &host[window(STORES_TUNE_BYTES)], c),
            )?
        }
    };
    drop(dev);
    // The crossover (measured each process, cheap): the smallest size from which on the
    // staged copy beats the driver's clearly at every measured size.
    best.direct_below = 32 * MIB;
    for bytes in [
        16 * MIB,
        8 * MIB,
        4 * MIB,
        2 * MIB,
        MIB,
        512 * KIB,
        ALWAYS_DIRECT,
    ] {
        let h = &mut host[..bytes];
        let mut part = Buffer::<u8>::zeros(stream, bytes)?;
        let direct = fastest(|| match dir {
            Direction::H2d => direct_h2d(stream, &mut part, h),
            Direction::D2h => direct_d2h(stream, &part, h),
        })?;
        let staged = fastest(|| match dir {
            Direction::H2d => staged_h2d(stream, &mut part, h, &best),
            Direction::D2h => staged_d2h(stream, &part, h, &best),
        })?;
        // A clear win only: these few timings drift by about a tenth on a busy host, and a
        // staged copy chosen on noise ran slower than the driver's (bench/NOTES.md, copy tune).
        if staged * 1.1 >= direct {
            break;
        }
        best.direct_below = bytes;
    }
    tracing::debug!(
        "transfer {dir:?}: {best} staged from {} bytes",
        best.direct_below
    );
    Ok(best)
}

/// The configurations the tune times on 4, 8, 16 and 32 copy threads, capped at the
/// `max_threads` the pool has (every one of them is a candidate): uploads 1, 2 and 4 MiB
/// chunks (an upload's longest DMA), as many as fill [`UPLOAD_RING`], with either kind of
/// staging store (which wins depends on the CPU: `cldemote` is a no-op where it is
/// missing); downloads 4, 8 and 16 MiB chunks, as many as fill [`DOWNLOAD_RING`]. (No 8
/// MiB upload chunks: the copy waits for a whole 8 MiB DMA to land before it may reuse its
/// room, and they lost to 4 MiB ones; bench/NOTES.md, copy tune.)
fn tune_candidates(dir: Direction, max_threads: usize) -> Vec<TransferConfig> {
    let (chunks, stores): (&[usize], &[StagingStores]) = match dir {
        Direction::H2d => (
            &[1, 2, 4],
            &[StagingStores::NonTemporal, StagingStores::Demoted],
        ),
        Direction::D2h => (&[4, 8, 16], &[StagingStores::NonTemporal]),
    };
    let mut candidates = Vec::new();
    for &stores in stores {
        for &chunk_mib in chunks {
            for threads in [4, 8, 16, 32] {
                let chunk_bytes = chunk_mib * MIB;
                candidates.push(TransferConfig {
                    chunk_bytes,
                    threads: threads.min(max_threads.max(1)),
                    depth: match dir {
                        Direction::H2d => UPLOAD_RING / chunk_bytes,
                        Direction::D2h => DOWNLOAD_RING / chunk_bytes,
                    },
                    stores,
                    ..TransferConfig::default()
                });
            }
        }
    }
    candidates.dedup();
    candidates
}

/// How many `window`-byte windows a tune cycles through: enough to span twice a last-level
/// cache of `llc` bytes (at least two, so no copy reads what the one before left cached;
/// at most 16).
fn tune_windows(llc: usize, window: usize) -> usize {
    (2 * llc).div_ceil(window.max(1)).clamp(2, 16)
}

/// The fastest of five host-clock runs after a warm-up, in seconds.
fn fastest(mut run: impl FnMut() -> Result<()>) -> Result<f64> {
    run()?;
    let mut best = f64::INFINITY;
    for _ in 0..5 {
        let t = std::time::Instant::now();
        run()?;
        best = best.min(t.elapsed().as_secs_f64());
    }
    Ok(best)
}

/// The capture errors of copies from and to pageable memory (the driver's own wording).
const H2D_IN_CAPTURE: &str = "cuMemcpyHtoDAsync from pageable memory";
const D2H_IN_CAPTURE: &str = "cuMemcpyDtoHAsync to pageable memory";

/// Copies `src` into `dst` (same length) on `stream`; returns when `src` may be reused and
/// the copy has completed. Large copies take the staged fast path.
pub fn upload<T: DType>(stream: &Stream, dst: &mut Buffer<T>, src: &[T]) -> Result<()> {
    check_len("transfer::upload", dst.len(), src.len())?;
    stream.refuse_if_capturing(H2D_IN_CAPTURE)?;
    if std::mem::size_of_val(src) < ALWAYS_DIRECT {
        return direct_h2d(stream, dst, src);
    }
    let cfg = config(stream, Direction::H2d)?;
    upload_with(stream, dst, src, &cfg)
}

/// Copies `src` into `dst` (same length), waiting for the stream. Large copies take the
/// staged fast path.
pub fn download<T: DType>(stream: &Stream, src: &Buffer<T>, dst: &mut [T]) -> Result<()> {
    check_len("transfer::download", src.len(), dst.len())?;
    stream.refuse_if_capturing(D2H_IN_CAPTURE)?;
    if std::mem::size_of_val(dst) < ALWAYS_DIRECT {
        return direct_d2h(stream, src, dst);
    }
    let cfg = config(stream, Direction::D2h)?;
    download_with(stream, src, dst, &cfg)
}

/// The buffer's contents in a new `Vec`, as `tensor.cpu()` gives. The `Vec` is never zeroed
/// first: copies under the crossover go through one pinned block (read by this thread,
/// faulting the pages in as it writes, under [`FRESH_THREADS_FROM`]; from there one thread
/// per 2 MiB faults the pages in during the DMA, then the copy threads copy), large ones
/// through the download ring in parts of whole 2 MiB regions, each thread faulting its
/// part's pages in while the part's DMA may still run (transparent huge pages from 32 MiB).
pub fn to_host<T: DType>(stream: &Stream, src: &Buffer<T>) -> Result<Vec<T>> {
    src.device().same_as(stream.device(), "transfer::to_host")?;
    stream.refuse_if_capturing(D2H_IN_CAPTURE)?;
    let mut out = FreshVec::with_capacity(src.len())?;
    let bytes = src.size_bytes();
    if bytes < FRESH_THREADS_FROM {
        match pinned_d2h(stream, src)? {
            Some(stage) => out.extend_from_slice(stage.wait_slice()?)?,
            None => src.append_to_host(stream, &mut out)?,
        }
        return Ok(out.into_vec());
    }
    let cfg = config(stream, Direction::D2h)?;
    let workers = workers(stream.device());
    if bytes < cfg.direct_below {
        // One DMA into a pinned block while the fresh pages are faulted in, then a parallel
        // copy (the driver's own copy, faulting as it writes, ran slower than into touched
        // pages; bench/NOTES.md, fresh memory).
        let Some(stage) = pinned_d2h(stream, src)? else {
            src.append_to_host(stream, &mut out)?;
            return Ok(out.into_vec());
        };
        // One faulting thread per 2 MiB: faults inside one 2 MiB region take turns on its
        // page-table lock, separate regions fault in parallel (bench/NOTES.md, fresh
        // memory).
        let faulting = bytes.div_ceil(HUGE_PAGE).min(workers.threads());
        out.prefault(workers, faulting, src.len())?;
        out.extend_par(workers, workers.threads(), stage.wait_slice()?)?;
        return Ok(out.into_vec());
    }
    // Page faults, not the memory bus, bound copies into fresh memory: every thread helps.
    let fresh = TransferConfig {
        threads: workers.threads(),
        ..cfg
    };
    ring_download_fresh(
        stream,
        workers,
        src,
        &mut out,
        &ring_plan::<T>(src.len(), &fresh),
    )?;
    Ok(out.into_vec())
}

/// A new buffer holding `src` (through [`upload`]).
#[track_caller]
pub fn from_host<T: DType>(stream: &Stream, src: &[T]) -> Result<Buffer<T>> {
    let mut buf = Buffer::uninit(stream, src.len())?;
    upload(stream, &mut buf, src)?;
    Ok(buf)
}

/// Copies `src` into `dst` (same length) as `convert` writes it, `convert` running on the
/// copy threads over matching pieces (on CUDA, straight into the staging ring's blocks:
/// a conversion on the way, as [`upload_f32`]'s narrowing); returns when done.
pub(crate) fn upload_converted<S: Sync, T: DType>(
    stream: &Stream,
    dst: &mut Buffer<T>,
    src: &[S],
    convert: impl Fn(&mut [T], &[S]) + Sync,
) -> Result<()> {
    check_len("transfer::upload_converted", dst.len(), src.len())?;
    stream.refuse_if_capturing(H2D_IN_CAPTURE)?;
    dst.device()
        .same_as(stream.device(), "transfer::upload_converted")?;
    let cfg = config(stream, Direction::H2d)?;
    let workers = workers(stream.device());
    if stream.device().is_host_memory() {
        return workers.map(cfg.threads, PAGE, dst.host_view_mut()?, src, convert);
    }
    // Chunks of the configured size in source bytes. Written with plain stores, so the
    // ring is best read from the shared cache (see `StagingStores::Demoted`).
    let plan = upload_plan::<S>(stream, src.len(), &cfg)?;
    ring_upload(stream, workers, dst, src, &plan, |d: &mut [T], s: &[S]| {
        convert(d, s);
        demote_lines(d);
    })
}

/// Copies under this many bytes never take the staged path (and never tune): one DMA
/// through a pinned block from the pool that the calling thread fills or reads (uploads
/// under 64 KiB: the driver's copy); from here the copy threads fill or read it.
pub const ALWAYS_DIRECT: usize = 256 * KIB;

/// Downloads into a new `Vec` from this many bytes fault its pages in ahead and copy on the
/// copy threads; smaller ones are read by the calling thread, which faults the pages in as
/// it writes (waking a copy thread and faulting ahead cost more than they saved at 256 KiB;
/// bench/NOTES.md, fresh memory).
pub const FRESH_THREADS_FROM: usize = 512 * KIB;

/// Uploads from this many bytes go through one pinned block (smaller ones: the driver).
const PINNED_H2D_FROM: usize = 64 * KIB;

/// One DMA, without chunks: from [`PINNED_H2D_FROM`] through one pinned block from the pool
/// (filled by this thread under [`ALWAYS_DIRECT`], by the copy threads from there), else
/// the driver's pageable copy. The driver stages pageable copies through pinned memory of
/// its own too, but took longer at 64 KiB; at 4-16 KiB it was as fast or slightly faster
/// (it can carry a few KiB in its command stream). One thread's memcpy made the block the
/// slower from 1 MiB, hence the copy threads there (bench/NOTES.md, small copies).
fn direct_h2d<T: DType>(stream: &Stream, dst: &mut Buffer<T>, src: &[T]) -> Result<()> {
    let bytes = size_of_val(src);
    if stream.device().is_host_memory() || bytes < PINNED_H2D_FROM {
        return dst.driver_copy_from_host(stream, src);
    }
    let mut stage = PinnedBuf::<T>::new(stream.device(), src.len())?;
    block_copy(stream, stage.wait_slice_mut()?, src)?;
    dst.copy_from_pinned(stream, &mut stage)?;
    stream.synchronize()
}

/// The reverse of [`direct_h2d`] at every size: one DMA into a pinned block from the pool,
/// read by this thread under [`ALWAYS_DIRECT`] and by the copy threads from there (the
/// pinned block beat the driver's copy from 4 KiB; bench/NOTES.md, small copies).
fn direct_d2h<T: DType>(stream: &Stream, src: &Buffer<T>, dst: &mut [T]) -> Result<()> {
    let Some(stage) = pinned_d2h(stream, src)? else {
        return src.driver_copy_to_host(stream, dst);
    };
    block_copy(stream, dst, stage.wait_slice()?)
}

/// The host side of a single-DMA copy: on this thread under [`ALWAYS_DIRECT`], else on
/// every copy thread.
fn block_copy<T: DType>(stream: &Stream, dst: &mut [T], src: &[T]) -> Result<()> {
    check_len("transfer::block_copy", dst.len(), src.len())?;
    if size_of_val(src) < ALWAYS_DIRECT {
        dst.copy_from_slice(src);
        Ok(())
    } else {
        let workers = workers(stream.device());
        par_copy(workers, workers.threads(), dst, src)
    }
}

/// `src` copied into a pinned block from the pool (its host view waits for the copy); None
/// where that does not apply (empty, or the CPU backend).
fn pinned_d2h<T: DType>(stream: &Stream, src: &Buffer<T>) -> Result<Option<PinnedBuf<T>>> {
    if src.is_empty() || stream.device().is_host_memory() {
        return Ok(None);
    }
    let mut stage = PinnedBuf::<T>::new(stream.device(), src.len())?;
    src.copy_to_pinned(stream, &mut stage)?;
    Ok(Some(stage))
}

/// [`upload`] with an explicit configuration (its `direct_below` included).
pub fn upload_with<T: DType>(
    stream: &Stream,
    dst: &mut Buffer<T>,
    src: &[T],
    cfg: &TransferConfig,
) -> Result<()> {
    check_len("transfer::upload", dst.len(), src.len())?;
    dst.device().same_as(stream.device(), "transfer::upload")?;
    if std::mem::size_of_val(src) < cfg.direct_below {
        return direct_h2d(stream, dst, src);
    }
    staged_h2d(stream, dst, src, cfg)
}

/// [`download`] with an explicit configuration (its `direct_below` included).
pub fn download_with<T: DType>(
    stream: &Stream,
    src: &Buffer<T>,
    dst: &mut [T],
    cfg: &TransferConfig,
) -> Result<()> {
    check_len("transfer::download", src.len(), dst.len())?;
    src.device()
        .same_as(stream.device(), "transfer::download")?;
    if std::mem::size_of_val(dst) < cfg.direct_below {
        return direct_d2h(stream, src, dst);
    }
    staged_d2h(stream, src, dst, cfg)
}

fn staged_d2h<T: DType>(
    stream: &Stream,
    src: &Buffer<T>,
    dst: &mut [T],
    cfg: &TransferConfig,
) -> Result<()> {
    let workers = workers(stream.device());
    let plan = ring_plan::<T>(dst.len(), cfg);
    ring_download(stream, workers, src, dst, &plan, |_| {}, stream_copy)
}

/// Elements per chunk: the configured chunk, but at least `depth` chunks for copies of a
/// few chunks or less (so even those overlap host copies with the DMA), never under 64 KiB.
fn chunk_len<T>(len: usize, cfg: &TransferConfig) -> usize {
    let size = std::mem::size_of::<T>().max(1);
    let chunk = (cfg.chunk_bytes / size).max(1);
    let spread = len.div_ceil(cfg.depth.max(1)).max((64 * KIB / size).max(1));
    chunk.min(spread).max(1)
}

fn staged_h2d<T: DType>(
    stream: &Stream,
    dst: &mut Buffer<T>,
    src: &[T],
    cfg: &TransferConfig,
) -> Result<()> {
    let workers = workers(stream.device());
    let plan = upload_plan::<T>(stream, src.len(), cfg)?;
    match cfg.stores {
        StagingStores::NonTemporal => ring_upload(stream, workers, dst, src, &plan, stream_copy),
        StagingStores::Demoted => ring_upload(stream, workers, dst, src, &plan, demote_copy),
    }
}

/// How a staged copy of `len` elements of `T` runs through the staging ring (no link rate:
/// downloads need none; uploads take [`upload_plan`]).
fn ring_plan<T>(len: usize, cfg: &TransferConfig) -> RingPlan {
    let size = std::mem::size_of::<T>().max(1);
    RingPlan {
        chunk_len: chunk_len::<T>(len, cfg),
        slots: cfg.depth.max(1),
        part_len: (RING_PART / size).max(1),
        threads: cfg.threads,
        host_align: PAGE,
        h2d_rate: 0.0,
    }
}

/// [`ring_plan`] for an upload on `stream`, with the device's link rate (which paces the
/// feed's DMAs).
fn upload_plan<T>(stream: &Stream, len: usize, cfg: &TransferConfig) -> Result<RingPlan> {
    Ok(RingPlan {
        h2d_rate: h2d_rate(stream)?,
        ..ring_plan::<T>(len, cfg)
    })
}

/// Bytes a link-rate probe sends, and the shorter copy its time is taken against.
const PROBE_BYTES: usize = 16 * MIB;
const PROBE_SHORT: usize = 4 * MIB;

/// The stream's device's host-to-device link rate in bytes per second, from pinned
/// memory: the difference of two DMAs' fastest times, so the fixed cost of a copy and of
/// waiting for it drops out (measured on first use per device; 0 on the CPU backend).
fn h2d_rate(stream: &Stream) -> Result<f64> {
    let device = stream.device();
    if device.is_host_memory() {
        return Ok(0.0);
    }
    let measured = measured(device)?;
    if let Some(r) = *measured.h2d_rate.lock() {
        return Ok(r);
    }
    let mut pinned = PinnedBuf::<u8>::new(device, PROBE_BYTES)?;
    pinned.wait_slice_mut()?.fill(0x5a);
    let mut dev = Buffer::<u8>::uninit(stream, PROBE_BYTES)?;
    let mut time = |bytes: usize| {
        fastest(|| {
            dev.copy_from_pinned_at(stream, 0, &mut pinned, bytes)?;
            stream.synchronize()
        })
    };
    let (long, short) = (time(PROBE_BYTES)?, time(PROBE_SHORT)?);
    let rate = if long > short {
        (PROBE_BYTES - PROBE_SHORT) as f64 / (long - short)
    } else {
        PROBE_BYTES as f64 / long
    };
    *measured.h2d_rate.lock() = Some(rate);
    Ok(rate)
}

/// `dst.copy_from_slice(src)` in up to `threads` page-aligned pieces on the copy threads,
/// with non-temporal stores (`stream_copy`: `dst` is next read by the DMA engine, or is
/// large enough that the cache would not keep it anyway). Slices of different lengths are
/// an [`Error::LengthMismatch`](crate::Error::LengthMismatch), nothing copied.
pub fn par_copy<T: Copy + Send + Sync>(
    workers: &Workers,
    threads: usize,
    dst: &mut [T],
    src: &[T],
) -> Result<()> {
    check_len("transfer::par_copy", dst.len(), src.len())?;
    workers.map(threads, PAGE, dst, src, stream_copy)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_tune_tries_every_thread_count_up_to_the_pools() {
        // Uploads: three chunk sizes with each of two store kinds; downloads: three chunks.
        for (dir, chunks, min_chunk) in [(Direction::H2d, 6, MIB), (Direction::D2h, 3, 4 * MIB)] {
            let threads = |max: usize| {
                let c = tune_candidates(dir, max);
                assert!(c
                    .iter()
                    .all(|c| c.chunk_bytes >= min_chunk && c.threads <= max.max(1)));
                // Uploads keep a 16 MiB ring in flight, downloads a 64 MiB one.
                assert!(c.iter().all(|c| match dir {
                    Direction::H2d => c.depth * c.chunk_bytes == UPLOAD_RING,
                    Direction::D2h => c.depth * c.chunk_bytes == DOWNLOAD_RING,
                }));
                let mut t: Vec<usize> = c.iter().map(|c| c.threads).collect();
                t.sort_unstable();
                t.dedup();
                (c.len(), t)
            };
            assert_eq!(threads(16), (3 * chunks, vec![4, 8, 16]));
            assert_eq!(threads(12), (3 * chunks, vec![4, 8, 12]));
            assert_eq!(threads(24), (4 * chunks, vec![4, 8, 16, 24]));
            assert_eq!(threads(32), (4 * chunks, vec![4, 8, 16, 32]));
            assert_eq!(threads(2), (chunks, vec![2]));
            assert_eq!(threads(0), (chunks, vec![1]));
        }
    }

    #[test]
    fn the_tune_spans_twice_the_last_level_cache() {
        assert_eq!(tune_windows(0, TUNE_BYTES), 2);
        assert_eq!(tune_windows(32 * MIB, TUNE_BYTES), 2);
        assert_eq!(tune_windows(300 * 1000 * 1000, TUNE_BYTES), 9);
        assert_eq!(tune_windows(307_200 * KIB, TUNE_BYTES), 10);
        assert_eq!(tune_windows(usize::MAX / 4, TUNE_BYTES), 16);
        assert_eq!(tune_windows(300 * 1000 * 1000, 256 * MIB), 3);
    }

    #[test]
    fn par_copy_refuses_slices_of_different_lengths_in_every_build() {
        let workers = Workers::new(4, None);
        let src: Vec<u32> = (0..300_000).collect();
        for n in [src.len() - 1, src.len() + 1, 0] {
            let mut dst = vec![7u32; n];
            let r = par_copy(&workers, 4, &mut dst, &src);
            assert!(
                matches!(r, Err(crate::Error::LengthMismatch { op: "transfer::par_copy", left, right })
                    if left == n && right == src.len()),
                "{r:?}"
            );
            assert!(dst.iter().all(|&x| x == 7), "nothing copied");
        }
        let mut dst = vec![7u32; src.len()];
        par_copy(&workers, 4, &mut dst, &src).unwrap();
        assert!(dst == src);
    }

    #[test]
    fn the_demoted_variant_has_a_name_of_its_own() {
        let c = TransferConfig {
            chunk_bytes: 4 * MIB,
            threads: 16,
            ..TransferConfig::default()
        };
        assert_eq!(c.to_string(), "4096KiBx16");
        let demoted = TransferConfig {
            stores: StagingStores::Demoted,
            ..c
        };
        assert_eq!(demoted.to_string(), "4096KiBx16-demoted");
    }
}
