//! The doctor: the machine's ceilings, measured in the same invocation as the benchmarks
//! that cite them, and the `ceilings` suite that reports them as rows.

use std::sync::Arc;

use half::bf16;
use rand::rngs::SmallRng;
use rand::{Rng, RngCore, SeedableRng};

use warpdrive::device::{Device, Stream};
use warpdrive::error::{Error, Result};
use warpdrive::exec::probe::LaunchProbe;
use warpdrive::exec::LaunchConfig;
use warpdrive::memory::{Buffer, PinnedBuf, PinnedPool};
use warpdrive::ops;
use warpdrive::transfer::stream_copy;

use super::results::{Ceiling, Ceilings, Row};
use super::timing::{time_gpu, time_host};
use super::{Ctx, Progress, Scale};

/// The suite name of the ceiling rows.
pub const SUITE: &str = "ceilings";
/// The variant of every ceiling row.
pub const VARIANT: &str = "ceiling";

const MIB: usize = 1 << 20;
const GIB: usize = 1 << 30;

/// Sizes and repetitions of each measurement at one [`Scale`].
struct Plan {
    /// Host↔device copy sizes; the best figure over them is the ceiling.
    copy_sizes: &'static [usize],
    pinned_reps: usize,
    pageable_reps: usize,
    d2d_bytes: usize,
    d2d_reps: usize,
    gemm_n: usize,
    gemm_reps: usize,
    /// Empty launches per sample, and samples.
    launch_count: usize,
    launch_samples: usize,
    memcpy_bytes: usize,
    memcpy_reps: usize,
    cpu_gemm_n: usize,
    cpu_gemm_reps: usize,
}

impl Plan {
    fn new(scale: Scale, cuda: bool) -> Plan {
        match scale {
            Scale::Full => Plan {
                copy_sizes: &[256 * MIB, GIB],
                pinned_reps: 10,
                pageable_reps: 5,
                d2d_bytes: GIB,
                d2d_reps: 20,
                gemm_n: 8192,
                gemm_reps: 20,
                launch_count: 10_000,
                launch_samples: 5,
                memcpy_bytes: GIB,
                memcpy_reps: 5,
                cpu_gemm_n: 1024,
                // On a GPU host the CPU GEMM is a side figure: keep it short.
                cpu_gemm_reps: if cuda { 3 } else { 5 },
            },
            Scale::Quick => Plan {
                copy_sizes: &[256 * MIB],
                pinned_reps: 10,
                pageable_reps: 5,
                d2d_bytes: 256 * MIB,
                d2d_reps: 20,
                gemm_n: 4096,
                gemm_reps: 20,
                launch_count: 2_000,
                launch_samples: 5,
                memcpy_bytes: 256 * MIB,
                memcpy_reps: 5,
                cpu_gemm_n: 512,
                cpu_gemm_reps: 5,
            },
            Scale::Tiny => Plan {
                copy_sizes: &[16 * MIB],
                pinned_reps: 3,
                pageable_reps: 3,
                d2d_bytes: 16 * MIB,
                d2d_reps: 5,
                gemm_n: 1024,
                gemm_reps: 5,
                launch_count: 200,
                launch_samples: 3,
                memcpy_bytes: 16 * MIB,
                memcpy_reps: 3,
                cpu_gemm_n: 128,
                cpu_gemm_reps: 3,
            },
        }
    }
}

/// Bytes of the host memcpy ceiling's copies at `scale`: copies smaller than this may stay in
/// the CPU caches and outrun `host_memcpy_gbps`, which is measured from memory.
pub(crate) fn memcpy_bytes(scale: Scale) -> usize {
    Plan::new(scale, false).memcpy_bytes
}

/// Measures the ceilings of `device` (see [`Ceilings`] and `docs/BENCH.md`) with work on
/// `stream`, at full size or, with `quick`, smaller sizes.
///
/// On CUDA: host↔device copies pinned and pageable (best over 256 MiB and 1 GiB), the
/// device-to-device copy at 1 GiB counting bytes read + written, a bf16 GEMM at 8192³
/// through cuBLAS, and the empty-kernel launch costs; on every backend also the host memcpy
/// (best over thread counts and over non-temporal and plain stores, bytes copied once) and an
/// f32 GEMM on the CPU backend (1024³, or 512³ with `quick`). The GPU keys stay `None` on the CPU backend.
///
/// A measurement that fails does not abort the others: its key stays `None` and a warning
/// naming the error is printed on stderr. Fails only when `stream` is not on `device`.
pub fn measure_ceilings(device: &Device, stream: &Stream, quick: bool) -> Result<Ceilings> {
    let scale = if quick { Scale::Quick } else { Scale::Full };
    measure_ceilings_at(device, stream, scale)
}

/// [`measure_ceilings`] at an explicit [`Scale`] (`Scale::Tiny` for tests).
pub fn measure_ceilings_at(device: &Device, stream: &Stream, scale: Scale) -> Result<Ceilings> {
    device.same_as(stream.device(), "measure_ceilings")?;
    Ok(measure(stream, scale, &Progress::hidden()).0)
}

/// The `ceilings` suite: fills the context's ceilings and adds one row per measured key.
pub(crate) fn run_suite(ctx: &mut Ctx) -> Result<()> {
    let (ceilings, rows) = measure(ctx.stream(), ctx.scale(), ctx.progress());
    ctx.set_ceilings(ceilings);
    for row in rows {
        ctx.push(row);
    }
    Ok(())
}

/// Every measurement, each guarded: the ceilings and the best row of each measured key.
fn measure(stream: &Stream, scale: Scale, progress: &Progress) -> (Ceilings, Vec<Row>) {
    let cuda = stream.device().is_cuda();
    let plan = Plan::new(scale, cuda);
    let mut found: Vec<(Ceiling, Row)> = Vec::new();
    let mut attempt = |what: String, f: &mut dyn FnMut() -> Result<Vec<(Ceiling, Row)>>| {
        progress.step(format!("{SUITE}: {what}"));
        match f() {
            Ok(rows) => found.extend(rows),
            Err(e) => progress.warn(&format!("ceiling {what} not measured: {e}")),
        }
    };

    if cuda {
        let copies = [
            (Ceiling::H2dPinned, true, true),
            (Ceiling::D2hPinned, false, true),
            (Ceiling::H2dPageable, true, false),
            (Ceiling::D2hPageable, false, false),
        ];
        for (key, to_device, pinned) in copies {
            for &bytes in plan.copy_sizes {
                let reps = if pinned {
                    plan.pinned_reps
                } else {
                    plan.pageable_reps
                };
                attempt(format!("{} at {}", key.key(), human(bytes)), &mut || {
                    host_copy(stream, key, to_device, pinned, bytes, reps).map(|r| vec![(key, r)])
                });
            }
        }
        attempt(
            format!("d2d_copy_gbps at {}", human(plan.d2d_bytes)),
            &mut || {
                d2d_copy(stream, plan.d2d_bytes, plan.d2d_reps).map(|r| vec![(Ceiling::D2dCopy, r)])
            },
        );
        attempt(
            format!("gemm_bf16_tflops at {}³", plan.gemm_n),
            &mut || {
                gemm_bf16(stream, plan.gemm_n, plan.gemm_reps).map(|r| vec![(Ceiling::GemmBf16, r)])
            },
        );
        attempt("launch_us and launch_sync_us".into(), &mut || {
            launches(stream, plan.launch_count, plan.launch_samples)
        });
    }
    // Both stores, so the ceiling bounds every host copy that cites it: the staged copies'
    // non-temporal stores and `copy_from_slice` (each is the faster on some hosts and builds).
    for threads in memcpy_thread_counts() {
        for stores in [Stores::NonTemporal, Stores::Plain] {
            attempt(
                format!(
                    "host_memcpy_gbps at {} on {threads} thread(s), {}",
                    human(plan.memcpy_bytes),
                    stores.name()
                ),
                &mut || {
                    host_memcpy(plan.memcpy_bytes, threads, stores, plan.memcpy_reps)
                        .map(|r| vec![(Ceiling::HostMemcpy, r)])
                },
            );
        }
    }
    attempt(
        format!("cpu_gemm_f32_gflops at {}³", plan.cpu_gemm_n),
        &mut || {
            cpu_gemm(stream, plan.cpu_gemm_n, plan.cpu_gemm_reps)
                .map(|r| vec![(Ceiling::CpuGemmF32, r)])
        },
    );

    let mut ceilings = Ceilings::default();
    let mut best: Vec<(Ceiling, Row)> = Vec::new();
    for key in Ceiling::ALL {
        let mut top: Option<(f64, Row)> = None;
        for (k, row) in found.iter().filter(|(k, _)| *k == key) {
            let Some(v) = k.achieved(row) else { continue };
            if top.as_ref().is_none_or(|(b, _)| key.better(v, *b)) {
                top = Some((v, row.clone()));
            }
        }
        if let Some((v, row)) = top {
            ceilings.set(key, Some(v));
            best.push((key, row));
        }
    }
    let rows = best
        .into_iter()
        .map(|(key, row)| row.against(key, &ceilings))
        .collect();
    (ceilings, rows)
}

/// `1 GiB`, `256 MiB`, `1000 B`.
fn human(bytes: usize) -> String {
    if bytes >= GIB && bytes % GIB == 0 {
        format!("{} GiB", bytes / GIB)
    } else if bytes >= MIB && bytes % MIB == 0 {
        format!("{} MiB", bytes / MIB)
    } else {
        format!("{bytes} B")
    }
}

fn ceiling_row(key: Ceiling, size: usize, samples_us: &mut [f64]) -> Result<Row> {
    Row::from_samples(SUITE, key.case(), size as u64, VARIANT, samples_us)
}

/// Seeded random bytes (never all zero).
pub(super) fn random_bytes(len: usize, seed: u64) -> Vec<u8> {
    let mut v = vec![0u8; len];
    SmallRng::seed_from_u64(seed).fill_bytes(&mut v);
    v
}

/// Seeded uniform values in [-1, 1).
pub(super) fn random_f32(len: usize, seed: u64) -> Vec<f32> {
    let mut rng = SmallRng::seed_from_u64(seed);
    (0..len).map(|_| rng.random_range(-1.0f32..1.0)).collect()
}

fn not_cuda(what: &str) -> Error {
    Error::Unsupported(format!("{what} needs a CUDA stream"))
}

/// Host↔device copies of `bytes` (pinned: event-timed; pageable: host clock).
fn host_copy(
    stream: &Stream,
    key: Ceiling,
    to_device: bool,
    pinned: bool,
    bytes: usize,
    reps: usize,
) -> Result<Row> {
    if !stream.device().is_cuda() {
        return Err(not_cuda("host copy"));
    }
    let seconds = time_host_copies(stream, to_device, pinned, bytes, reps)?;
    let mut us: Vec<f64> = seconds.into_iter().map(|t| t * 1e6).collect();
    Ok(ceiling_row(key, bytes, &mut us)?
        .with_bytes(bytes as f64)
        .with_extra("timer", if pinned { "cuda events" } else { "host clock" }))
}

/// Seconds per copy of `bytes` between host and device, `reps` times, after one warm-up.
/// Pinned host memory (flags 0, no NUMA binding) is timed with events on `stream`;
/// pageable memory (an ordinary, pre-touched `Vec`) with the host clock around each
/// synchronous copy.
fn time_host_copies(
    stream: &Stream,
    to_device: bool,
    pinned: bool,
    bytes: usize,
    reps: usize,
) -> Result<Vec<f64>> {
    let bytes = bytes.max(1);
    let device = stream.device();
    let mut dev = Buffer::<u8>::uninit(stream, bytes)?;
    if pinned {
        // A pool of its own, trimmed after (a pool frees nothing itself): the memory is
        // pinned afresh for this measurement, as `cuMemHostAlloc` gives it.
        let pool = PinnedPool::on_node(device, None);
        let timed = time_pinned_copies(stream, &pool, &mut dev, to_device, reps);
        let trimmed = pool.trim();
        let times = timed?;
        trimmed?;
        return Ok(times);
    }
    let mut times = Vec::with_capacity(reps);
    let mut host = vec![0u8; bytes];
    fill_pattern(&mut host);
    for rep in 0..=reps {
        let t = std::time::Instant::now();
        if to_device {
            dev.driver_copy_from_host(stream, &host)?;
        } else {
            dev.driver_copy_to_host(stream, &mut host)?;
        }
        if rep > 0 {
            times.push(t.elapsed().as_secs_f64());
        }
    }
    Ok(times)
}

/// Seconds per copy between `dev` and pinned memory from `pool`, event-timed, `reps` times
/// after one warm-up.
fn time_pinned_copies(
    stream: &Stream,
    pool: &Arc<PinnedPool>,
    dev: &mut Buffer<u8>,
    to_device: bool,
    reps: usize,
) -> Result<Vec<f64>> {
    let device = stream.device();
    let mut host = PinnedBuf::<u8>::new_in(pool, dev.len())?;
    fill_pattern(host.wait_slice_mut()?);
    let (start, end) = (device.new_event()?, device.new_event()?);
    let mut times = Vec::with_capacity(reps);
    for rep in 0..=reps {
        stream.record(&start)?;
        if to_device {
            dev.copy_from_pinned(stream, &mut host)?;
        } else {
            dev.copy_to_pinned(stream, &mut host)?;
        }
        stream.record(&end)?;
        let ms = start.elapsed_ms(&end).inspect_err(|_| {
            let _ = stream.synchronize();
        })?;
        if rep > 0 {
            times.push(ms as f64 / 1e3);
        }
    }
    Ok(times)
}

/// Bytes that are not all zero (copies are never timed on zeros).
fn fill_pattern(bytes: &mut [u8]) {
    let mut x: u32 = 0x9e37_79b9;
    for b in bytes.iter_mut() {
        x ^= x << 13;
        x ^= x >> 17;
        x ^= x << 5;
        *b = x as u8;
    }
}

/// `ops::copy` of `bytes` random bytes between two device buffers; GB/s counts the bytes
/// read plus the bytes written (2 × `bytes`).
fn d2d_copy(stream: &Stream, bytes: usize, reps: usize) -> Result<Row> {
    let src = Buffer::<u8>::from_host(stream, &random_bytes(bytes, 0xd2d))?;
    let mut dst = Buffer::<u8>::uninit(stream, bytes)?;
    let mut us = time_gpu(stream, 3, reps, |s| ops::copy(s, &src, &mut dst))?;
    Ok(ceiling_row(Ceiling::D2dCopy, bytes, &mut us)?
        .with_bytes(2.0 * bytes as f64)
        .with_extra("bytes_counted", "read+write"))
}

/// `n`³ bf16 GEMM (f32 accumulation) on random inputs; 2·n³ flops.
fn gemm_bf16(stream: &Stream, n: usize, reps: usize) -> Result<Row> {
    let elems = n * n;
    let host = |seed| -> Vec<bf16> {
        random_f32(elems, seed)
            .into_iter()
            .map(bf16::from_f32)
            .collect()
    };
    let a = Buffer::from_host(stream, &host(0xa))?;
    let b = Buffer::from_host(stream, &host(0xb))?;
    let mut c = Buffer::<bf16>::uninit(stream, elems)?;
    let mut us = time_gpu(stream, 3, reps, |s| {
        ops::gemm::matmul(s, &a, &b, &mut c, (n, n, n))
    })?;
    let flops = 2.0 * (n as f64).powi(3);
    Ok(ceiling_row(Ceiling::GemmBf16, n, &mut us)?
        .with_flops(flops)
        .with_extra("m", n)
        .with_extra("n", n)
        .with_extra("k", n)
        .with_extra("dtype", "bf16"))
}

/// Empty-kernel launch costs, `samples` times over `count` launches each.
fn launches(stream: &Stream, count: usize, samples: usize) -> Result<Vec<(Ceiling, Row)>> {
    if !stream.device().is_cuda() {
        return Err(not_cuda("launch timing"));
    }
    let probe = LaunchProbe::new(stream)?;
    let (mut enqueued, mut round_trip) = (Vec::new(), Vec::new());
    for _ in 0..samples.max(1) {
        let (e, r) = time_empty_launches(stream, &probe, count)?;
        enqueued.push(e);
        round_trip.push(r);
    }
    let round_trips = (count / 10).max(1);
    Ok(vec![
        (
            Ceiling::Launch,
            ceiling_row(Ceiling::Launch, count, &mut enqueued)?
                .with_extra("launches_per_sample", count),
        ),
        (
            Ceiling::LaunchSync,
            ceiling_row(Ceiling::LaunchSync, round_trips, &mut round_trip)?
                .with_extra("round_trips_per_sample", round_trips),
        ),
    ])
}

/// Launch cost of an empty kernel (1 block of 32, a plain launch): (µs per launch when
/// `count` are enqueued back to back with one synchronise at the end, µs for one launch +
/// synchronise round trip).
fn time_empty_launches(stream: &Stream, probe: &LaunchProbe, count: usize) -> Result<(f64, f64)> {
    let launch = || probe.empty(stream, LaunchConfig::linear(1, 32));
    launch()?;
    stream.synchronize()?;
    let count = count.max(1);
    let t = std::time::Instant::now();
    for _ in 0..count {
        launch()?;
    }
    stream.synchronize()?;
    let enqueued = t.elapsed().as_secs_f64() * 1e6 / count as f64;
    let round_trips = (count / 10).max(1);
    let t = std::time::Instant::now();
    for _ in 0..round_trips {
        launch()?;
        stream.synchronize()?;
    }
    let round_trip = t.elapsed().as_secs_f64() * 1e6 / round_trips as f64;
    Ok((enqueued, round_trip))
}

/// The thread counts the host memcpy tries: 1, 2, 4, 8, 16, capped at the cores available.
fn memcpy_thread_counts() -> Vec<usize> {
    let cores = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1);
    [1, 2, 4, 8, 16]
        .into_iter()
        .filter(|&t| t <= cores)
        .collect()
}

/// How a host copy stores its bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Stores {
    /// The staged copies' `stream_copy`: whole lines written without being read first
    /// (faster than `copy_from_slice`, whose `rep movsb` reads each line first, in release
    /// builds; bench/NOTES.md, staging stores).
    NonTemporal,
    /// `copy_from_slice`.
    Plain,
}

impl Stores {
    /// `extra.stores` of the ceiling row.
    fn name(self) -> &'static str {
        match self {
            Stores::NonTemporal => "non-temporal",
            Stores::Plain => "copy_from_slice",
        }
    }
}

/// Host memcpy of `bytes` between two pre-touched `Vec`s split over `threads` scoped
/// threads. GB/s counts the bytes **copied once** (not read + write, unlike `d2d_copy`).
fn host_memcpy(bytes: usize, threads: usize, stores: Stores, reps: usize) -> Result<Row> {
    let src = random_bytes(bytes, 0x4d45_4d43);
    // A non-zero fill writes every page, so none is first touched inside the timing.
    let mut dst = vec![0xa5u8; bytes];
    let mut us = time_host(1, reps, || parallel_copy(&src, &mut dst, threads, stores))?;
    Ok(ceiling_row(Ceiling::HostMemcpy, bytes, &mut us)?
        .with_bytes(bytes as f64)
        .with_extra("threads", threads)
        .with_extra("stores", stores.name())
        .with_extra("bytes_counted", "copied once"))
}

/// `dst.copy_from_slice(src)` in `threads` page-aligned pieces, one scoped thread each, with
/// `stores`.
fn parallel_copy(src: &[u8], dst: &mut [u8], threads: usize, stores: Stores) -> Result<()> {
    if src.len() != dst.len() {
        return Err(Error::LengthMismatch {
            op: "host memcpy",
            left: src.len(),
            right: dst.len(),
        });
    }
    let copy = move |d: &mut [u8], s: &[u8]| match stores {
        Stores::NonTemporal => stream_copy(d, s),
        Stores::Plain => d.copy_from_slice(s),
    };
    if threads <= 1 {
        copy(dst, src);
        return Ok(());
    }
    let piece = src.len().div_ceil(threads).next_multiple_of(4096).max(1);
    std::thread::scope(|scope| {
        let mut handles = Vec::with_capacity(threads);
        for (d, s) in dst.chunks_mut(piece).zip(src.chunks(piece)) {
            let h = std::thread::Builder::new()
                .name("wd-memcpy".into())
                .spawn_scoped(scope, move || copy(d, s))
                .map_err(|e| Error::Unsupported(format!("spawning a memcpy thread: {e}")))?;
            handles.push(h);
        }
        for h in handles {
            h.join()
                .map_err(|_| Error::InvalidArgument("a memcpy thread panicked".into()))?;
        }
        Ok(())
    })
}

/// `n`³ f32 GEMM through `ops::gemm::matmul` on the CPU backend; 2·n³ flops.
fn cpu_gemm(stream: &Stream, n: usize, reps: usize) -> Result<Row> {
    let own;
    let cpu = if stream.device().is_cuda() {
        own = Device::cpu().new_stream()?;
        &own
    } else {
        stream
    };
    let elems = n * n;
    let a = Buffer::from_host(cpu, &random_f32(elems, 0xc0a))?;
    let b = Buffer::from_host(cpu, &random_f32(elems, 0xc0b))?;
    let mut c = Buffer::<f32>::uninit(cpu, elems)?;
    let mut us = time_gpu(cpu, 1, reps, |s| {
        ops::gemm::matmul(s, &a, &b, &mut c, (n, n, n))
    })?;
    Ok(ceiling_row(Ceiling::CpuGemmF32, n, &mut us)?
        .with_flops(2.0 * (n as f64).powi(3))
        .with_extra("m", n)
        .with_extra("n", n)
        .with_extra("k", n)
        .with_extra("dtype", "f32"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tiny_ceilings_on_the_cpu_fill_the_host_keys_only() {
        let device = Device::cpu();
        let stream = device.new_stream().unwrap();
        let c = measure_ceilings_at(&device, &stream, Scale::Tiny).unwrap();
        let memcpy = c.host_memcpy_gbps.expect("host_memcpy_gbps measured");
        let gemm = c.cpu_gemm_f32_gflops.expect("cpu_gemm_f32_gflops measured");
        assert!(memcpy.is_finite() && memcpy > 0.0);
        assert!(gemm.is_finite() && gemm > 0.0);
        for key in Ceiling::ALL.into_iter().filter(|k| k.is_gpu()) {
            assert_eq!(c.get(key), None, "{} on the CPU", key.key());
        }
    }

    #[test]
    fn parallel_copy_copies_every_byte() {
        let src = random_bytes(3 * 4096 + 17, 1);
        for threads in [1, 2, 3, 8] {
            for stores in [Stores::NonTemporal, Stores::Plain] {
                let mut dst = vec![0u8; src.len()];
                parallel_copy(&src, &mut dst, threads, stores).unwrap();
                assert_eq!(dst, src, "{threads} threads, {stores:?}");
            }
        }
        let mut short = vec![0u8; 3];
        assert!(parallel_copy(&src, &mut short, 2, Stores::Plain).is_err());
    }

    #[test]
    fn thread_counts_start_at_one_and_stay_within_the_cores() {
        let t = memcpy_thread_counts();
        let cores = std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(1);
        assert_eq!(t.first(), Some(&1));
        assert!(t.iter().all(|&n| n <= cores && n <= 16));
    }

    #[test]
    fn human_sizes() {
        assert_eq!(human(GIB), "1 GiB");
        assert_eq!(human(256 * MIB), "256 MiB");
        assert_eq!(human(1000), "1000 B");
    }
}
