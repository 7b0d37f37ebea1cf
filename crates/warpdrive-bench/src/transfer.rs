//! The `transfer` suite: host ↔ device copies from ordinary (pageable) memory.
//!
//! - `h2d`, `d2h` (size = bytes, 4 KiB to 1 GiB in ×4 steps): `driver-pageable` (the
//!   driver's own copy from/to a touched `Vec`, host clock), `driver-pinned` (from/to a
//!   pinned block, events; the ceiling), `warpdrive` (the pageable fast path
//!   `transfer::upload`; D2H `transfer::to_host` into a fresh `Vec` each time, as
//!   `tensor.cpu()` does) and, for D2H, `warpdrive-reuse` (`transfer::download` into a
//!   reused `Vec`). `extra.x_driver_pageable` = driver-pageable median / this median,
//!   `extra.config` the fast path's tuned configuration; the pageable variants of a
//!   direction are timed in interleaved rounds (`time_host_rounds`).
//!   Peers: `torch-pageable`, `torch-pinned-nonblocking`, `torch-cpu`.
//! - `host-copy-rate` (size = threads; `extra.bytes` = the host memcpy ceiling's size, 1 GiB
//!   at full scale), `staged-copy`: µs to copy between two touched host buffers on the copy
//!   threads with the staged copies' non-temporal stores; `memcpy`: the same with
//!   `copy_from_slice`, in interleaved rounds; both against `host_memcpy_gbps` (the better
//!   of both stores at this size).
//! - On the CPU backend `h2d` and `d2h` are host memcpys (`extra.copy`); they cite
//!   `host_memcpy_gbps` at its size or above, and below it carry `extra.unbounded` instead
//!   (cache-resident copies can outrun a ceiling measured from memory).
//! - `h2d-bound` (size = bytes; CUDA only): `copy-with-dma`, the copy threads' host copy (the
//!   tuned upload's thread count, `extra.threads`) while the DMA engine sends pinned memory on
//!   another stream; `dma-with-copy`, those DMAs while the threads copy; `extra.bound_gbps`,
//!   the slower of the two medians: what a staged upload can reach on this host.
//! - `coalesce-1000x4KiB`: `baseline` (1000 driver copies from pageable slices) vs
//!   `warpdrive` (one [`Batch`]); `extra.speedup`, `extra.memory_efficiency` (the slices'
//!   bytes / those plus the offsets table).
//! - `pipeline` (size = bytes streamed): a balanced workload (per chunk, device copies
//!   taking about as long as the chunk's upload) on `streams-1/2/3`;
//!   `extra.overlap_efficiency`, `extra.transfer_overhead` (wall time not covered by the
//!   compute / wall; CUDA only), the stage totals and `stager_wait_s` (see `PipelineStats`),
//!   all of the timed run with the median wall time.
//! - Rows citing a bandwidth ceiling carry `extra.bandwidth_utilization` (see `derived`).
//! - `compressed-h2d` (size = f32 bytes): `warpdrive` (uncompressed), `warpdrive-bf16`,
//!   `warpdrive-f16`, `warpdrive-auto`, timed in interleaved rounds (`time_host_rounds`);
//!   `extra.auto_pick` on the `warpdrive-auto` row: what `Auto` chose for that size.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use warpdrive::error::{Error, Result};
use warpdrive::memory::{Buffer, PinnedBuf};
use warpdrive::ops;
use warpdrive::transfer::workers::PAGE;
use warpdrive::transfer::{self, Batch, Compression, Direction, Pipeline};

use super::ceilings::{random_bytes, random_f32};
use super::{time_gpu, time_host, time_host_rounds, Ceiling, Ctx, Scale};

pub(crate) const SUITE: &str = "transfer";

/// What `h2d` and `d2h` are on the CPU backend (`extra.copy`).
const CPU_COPY: &str = "host memcpy (CPU backend: no PCIe)";

const KIB: usize = 1 << 10;
const MIB: usize = 1 << 20;

fn sizes(scale: Scale) -> Vec<usize> {
    let top = match scale {
        Scale::Full => 1 << 30,
        Scale::Quick => 16 * MIB,
        Scale::Tiny => 256 * KIB,
    };
    std::iter::successors(Some(4 * KIB), |s| Some(s * 4))
        .take_while(|s| *s <= top)
        .collect()
}

/// Samples per variant: 9 from 256 MiB (5 left a 1 GiB upload's p10 and p90 far apart;
/// bench/NOTES.md, bench sampling); the peer script takes as many.
fn reps(bytes: usize) -> usize {
    if bytes >= 256 * MIB {
        9
    } else if bytes >= 16 * MIB {
        10
    } else {
        30
    }
}

pub(crate) fn run_suite(ctx: &mut Ctx) -> Result<()> {
    let scale = ctx.scale();
    for &bytes in &sizes(scale) {
        copies(ctx, bytes)?;
    }
    host_copy_rate(ctx)?;
    upload_bound(ctx)?;
    coalesce(ctx)?;
    pipeline(ctx)?;
    compressed(ctx)?;
    Ok(())
}

fn copies(ctx: &mut Ctx, bytes: usize) -> Result<()> {
    ctx.step(format!("h2d/d2h {bytes} bytes"));
    let s = ctx.stream().clone();
    let reps = reps(bytes);
    let mut host = random_bytes(bytes, 0x7a);
    let mut dev = Buffer::<u8>::uninit(&s, bytes)?;
    if s.device().is_cuda() {
        let mut pinned = PinnedBuf::<u8>::from_slice(s.device(), &host)?;
        let mut us = time_gpu(&s, 1, reps, |s| dev.copy_from_pinned(s, &mut pinned))?;
        ctx.record_bytes(
            "h2d",
            bytes as u64,
            "driver-pinned",
            &mut us,
            bytes as f64,
            Some(Ceiling::H2dPinned),
        )?;
        let mut us = time_gpu(&s, 1, reps, |s| dev.copy_to_pinned(s, &mut pinned))?;
        ctx.record_bytes(
            "d2h",
            bytes as u64,
            "driver-pinned",
            &mut us,
            bytes as f64,
            Some(Ceiling::D2hPinned),
        )?;
    }
    // The pageable variants in interleaved rounds: below a few MiB they are the same driver
    // copy (or differ by a page fault), closer than this host drifts between blocks of reps.
    let mut h2d = time_host_rounds(1, reps, 2, |i| match i {
        0 => dev.driver_copy_from_host(&s, &host),
        _ => transfer::upload(&s, &mut dev, &host),
    })?;
    let mut d2h = time_host_rounds(1, reps, 3, |i| match i {
        0 => dev.driver_copy_to_host(&s, &mut host),
        1 => transfer::to_host(&s, &dev).map(drop),
        _ => transfer::download(&s, &dev, &mut host),
    })?;
    // On the CPU backend both directions are host memcpys: bounded by the host memcpy
    // ceiling only at its size or above (smaller copies can run from the CPU caches).
    let cpu = !s.device().is_cuda();
    let memcpy_bytes = super::ceilings::memcpy_bytes(ctx.scale());
    let cpu_ceiling = (bytes >= memcpy_bytes).then_some(Ceiling::HostMemcpy);
    for (case, samples, ceiling, dir) in [
        ("h2d", &mut h2d, Ceiling::H2dPinned, Direction::H2d),
        ("d2h", &mut d2h, Ceiling::D2hPinned, Direction::D2h),
    ] {
        let ceiling = if cpu { cpu_ceiling } else { Some(ceiling) };
        // The configuration the fast path tuned (or was given) in this process.
        let cfg = transfer::config(&s, dir)?;
        let cfg = format!(
            "chunk {} KiB, {} threads, depth {}, direct under {} KiB{}",
            cfg.chunk_bytes / KIB,
            cfg.threads,
            cfg.depth,
            cfg.direct_below / KIB,
            if dir == Direction::H2d && cfg.stores == transfer::StagingStores::Demoted {
                ", demoted stores"
            } else {
                ""
            }
        );
        let base_med = super::Stats::from_samples(&mut samples[0].clone())?.median;
        let variants = ["driver-pageable", "warpdrive", "warpdrive-reuse"];
        for (variant, us) in variants.iter().zip(samples.iter_mut()) {
            let med = super::Stats::from_samples(&mut us.clone())?.median;
            let row = ctx.record_bytes(case, bytes as u64, variant, us, bytes as f64, ceiling)?;
            if cpu {
                row.extra.insert("copy".into(), CPU_COPY.into());
                if ceiling.is_none() {
                    row.extra.insert(
                        "unbounded".into(),
                        format!(
                            "below the host memcpy ceiling's {} MiB: can run from the CPU \
                             caches, faster than host_memcpy_gbps",
                            memcpy_bytes / MIB
                        )
                        .into(),
                    );
                }
            }
            if *variant != "driver-pageable" {
                row.extra
                    .insert("x_driver_pageable".into(), (base_med / med).into());
                row.extra.insert("config".into(), cfg.clone().into());
            }
        }
    }
    Ok(())
}

fn host_copy_rate(ctx: &mut Ctx) -> Result<()> {
    // The host memcpy ceiling's size, so that `memcpy` is bounded by it (a smaller copy may
    // run from the caches).
    let bytes = super::ceilings::memcpy_bytes(ctx.scale());
    let src = random_bytes(bytes, 0xc0);
    let mut dst = random_bytes(bytes, 0xc1);
    let workers = transfer::workers(ctx.device());
    for threads in [1, 2, 4, 8, 16] {
        ctx.step(format!("host-copy-rate {threads} threads"));
        // `staged-copy` is the staged copies' own (non-temporal) copy, `memcpy` what
        // `copy_from_slice` reaches on the same threads; the ceiling is the better of both
        // at this size, so it bounds each.
        let mut samples = time_host_rounds(1, 5, 2, |v| match v {
            0 => transfer::par_copy(workers, threads, &mut dst, &src),
            _ => workers.map(threads, PAGE, &mut dst, &src, |d, s| d.copy_from_slice(s)),
        })?;
        for (variant, us) in ["staged-copy", "memcpy"].iter().zip(samples.iter_mut()) {
            let row = ctx.record_bytes(
                "host-copy-rate",
                threads as u64,
                variant,
                us,
                bytes as f64,
                Some(Ceiling::HostMemcpy),
            )?;
            row.extra
                .insert("threads_available".into(), workers.threads().into());
            row.extra.insert("bytes".into(), bytes.into());
        }
    }
    Ok(())
}

/// The bound of a staged upload on this host: the copy threads' host copy (as many threads
/// as the tuned upload uses) timed while the DMA engine sends pinned memory, and those DMAs
/// timed while the threads copy. Both use the host's memory; on contended VMs the DMAs ran
/// ~39 GB/s under the copy against ~55 alone (bench/NOTES.md, ring profile).
fn upload_bound(ctx: &mut Ctx) -> Result<()> {
    if !ctx.device().is_cuda() {
        return Ok(());
    }
    ctx.step("h2d-bound");
    let bytes = if ctx.quick() { 16 * MIB } else { 256 * MIB };
    let dma_bytes = bytes / 4;
    let src = random_bytes(bytes, 0xb0);
    let mut dst = random_bytes(bytes, 0xb1);
    let workers = transfer::workers(ctx.device());
    let threads = transfer::config(ctx.stream(), Direction::H2d)?.threads;
    let device = ctx.device().clone();
    let dma_stream = device.new_stream()?;
    let mut pinned = PinnedBuf::<u8>::from_slice(&device, &src[..dma_bytes])?;
    let mut dev = Buffer::<u8>::uninit(&dma_stream, dma_bytes)?;
    let stop = AtomicBool::new(false);
    let (copies, dmas) = std::thread::scope(|scope| {
        let dmas = scope.spawn(|| -> Result<Vec<f64>> {
            let mut us = Vec::new();
            while !stop.load(Ordering::Relaxed) {
                let t = Instant::now();
                dev.copy_from_pinned(&dma_stream, &mut pinned)?;
                dma_stream.synchronize()?;
                us.push(t.elapsed().as_secs_f64() * 1e6);
            }
            Ok(us)
        });
        let copies = time_host(1, 5, || {
            transfer::par_copy(workers, threads, &mut dst, &src)
        });
        stop.store(true, Ordering::Relaxed);
        let dmas = dmas
            .join()
            .unwrap_or_else(|_| Err(Error::WorkerPanicked("the DMA thread panicked".into())));
        (copies, dmas)
    });
    let (mut copies, mut dmas) = (copies?, dmas?);
    let rate = |us: &[f64], b: usize| -> Result<f64> {
        Ok(b as f64 / super::Stats::from_samples(&mut us.to_vec())?.median / 1e3)
    };
    let bound = rate(&copies, bytes)?.min(rate(&dmas, dma_bytes)?);
    ctx.record_bytes(
        "h2d-bound",
        bytes as u64,
        "copy-with-dma",
        &mut copies,
        bytes as f64,
        Some(Ceiling::HostMemcpy),
    )?
    .extra
    .insert("threads".into(), threads.into());
    ctx.record_bytes(
        "h2d-bound",
        bytes as u64,
        "dma-with-copy",
        &mut dmas,
        dma_bytes as f64,
        Some(Ceiling::H2dPinned),
    )?
    .extra
    .insert("bound_gbps".into(), bound.into());
    Ok(())
}

fn coalesce(ctx: &mut Ctx) -> Result<()> {
    ctx.step("coalesce-1000x4KiB");
    let s = ctx.stream().clone();
    let slices: Vec<Vec<u8>> = (0..1000).map(|i| random_bytes(4 * KIB, i)).collect();
    let mut bufs = (0..1000)
        .map(|_| Buffer::<u8>::uninit(&s, 4 * KIB))
        .collect::<Result<Vec<_>>>()?;
    let bytes = 1000.0 * 4.0 * KIB as f64;
    let mut base = time_host(1, 10, || {
        for (b, x) in bufs.iter_mut().zip(&slices) {
            b.driver_copy_from_host(&s, x)?;
        }
        Ok(())
    })?;
    let base_med = super::Stats::from_samples(&mut base.clone())?.median;
    ctx.record_bytes(
        "coalesce-1000x4KiB",
        1000,
        "baseline",
        &mut base,
        bytes,
        Some(Ceiling::H2dPinned),
    )?;
    let mut batch = Batch::<u8>::with_capacity(s.device(), 1000 * 4 * KIB, 1000)?;
    let mut us = time_host(1, 10, || {
        batch.clear();
        for x in &slices {
            batch.push(x);
        }
        let packed = batch.pack(&s)?;
        s.synchronize()?;
        drop(packed);
        Ok(())
    })?;
    let med = super::Stats::from_samples(&mut us.clone())?.median;
    let offsets_table = ((batch.slices() + 1) * std::mem::size_of::<u64>()) as f64;
    ctx.record_bytes(
        "coalesce-1000x4KiB",
        1000,
        "warpdrive",
        &mut us,
        bytes,
        Some(Ceiling::H2dPinned),
    )?
    .set_memory_efficiency(bytes, bytes + offsets_table)
    .extra
    .insert("speedup".into(), (base_med / med).into());
    Ok(())
}

/// Timed runs per pipeline row (each streams 512 MiB: tens of ms).
const PIPELINE_REPS: usize = 9;

fn pipeline(ctx: &mut Ctx) -> Result<()> {
    let s = ctx.stream().clone();
    let (total, chunk) = if ctx.quick() {
        (8 * MIB, MIB)
    } else {
        (512 * MIB, 16 * MIB)
    };
    let input = random_f32(total / 4, 0x919e);
    let mut output = vec![0f32; input.len()];
    // The balanced kernel: enough device copies of the chunk to take as long as its upload.
    let x = Buffer::<f32>::from_host(&s, &input[..chunk / 4])?;
    let mut y = Buffer::<f32>::uninit(&s, chunk / 4)?;
    let mut one = time_gpu(&s, 2, 10, |s| ops::copy(s, &x, &mut y))?;
    let one_us = super::Stats::from_samples(&mut one)?.median;
    let upload_us = ctx
        .ceilings()
        .get(Ceiling::H2dPinned)
        .map_or(one_us, |gbps| chunk as f64 / (gbps * 1e3));
    let passes = ((upload_us / one_us).round() as usize).max(1);
    drop((x, y));
    for streams in 1..=3 {
        ctx.step(format!("pipeline streams-{streams}"));
        let p = Pipeline::new(ctx.device(), streams, chunk / 4, 2)?;
        let mut runs = Vec::new();
        let mut us = time_host(1, PIPELINE_REPS, || {
            let st = p.run(&input, &mut output, |s, x, y| {
                for _ in 0..passes {
                    ops::copy(s, x, y)?;
                }
                Ok(())
            })?;
            runs.push(st);
            Ok(())
        })?;
        // The stage figures of the run with the median wall time (the warm-up's dropped),
        // so they describe the run the median row reports, not whichever came last.
        let mut timed = runs.split_off(runs.len().saturating_sub(PIPELINE_REPS));
        timed.sort_by(|a, b| a.wall_s.total_cmp(&b.wall_s));
        let st = timed.get(timed.len() / 2).copied().unwrap_or_default();
        let row = ctx.record_bytes(
            "pipeline",
            total as u64,
            &format!("streams-{streams}"),
            &mut us,
            total as f64,
            Some(Ceiling::H2dPinned),
        )?;
        row.set_overlap_efficiency(&[st.host_s, st.h2d_s, st.compute_s, st.d2h_s], st.wall_s);
        if st.compute_s > 0.0 {
            row.set_transfer_overhead(st.wall_s - st.compute_s, st.wall_s);
        }
        for (k, v) in [
            ("wall_s", st.wall_s),
            ("host_s", st.host_s),
            ("stager_wait_s", st.wait_s),
            ("h2d_s", st.h2d_s),
            ("compute_s", st.compute_s),
            ("d2h_s", st.d2h_s),
            (
                "wall_over_max_stage",
                st.wall_s / st.max_stage_s().max(1e-12),
            ),
        ] {
            row.extra.insert(k.into(), v.into());
        }
        row.extra.insert("compute_passes".into(), passes.into());
    }
    Ok(())
}

fn compressed(ctx: &mut Ctx) -> Result<()> {
    let s = ctx.stream().clone();
    let sizes: Vec<usize> = if ctx.quick() {
        vec![4 * MIB, 16 * MIB]
    } else {
        vec![4 * MIB, 16 * MIB, 64 * MIB, 256 * MIB, 1 << 30]
    };
    for bytes in sizes {
        ctx.step(format!("compressed-h2d {bytes}"));
        let host = random_f32(bytes / 4, 0xc3);
        let mut dev = Buffer::<f32>::uninit(&s, bytes / 4)?;
        let variants = [
            ("warpdrive", Compression::None),
            ("warpdrive-bf16", Compression::Bf16),
            ("warpdrive-f16", Compression::F16),
            ("warpdrive-auto", Compression::Auto),
        ];
        // In rounds: Auto is judged against the best of the others within a few percent,
        // closer than this host drifts between blocks of reps (and than the medians of 10
        // rounds agreed). Up to 64 MiB the compressed uploads spread widely, so 60 rounds
        // there (bench/NOTES.md, bench sampling).
        let rounds = if bytes <= 64 * MIB { 60 } else { 20 };
        let mut samples = time_host_rounds(1, reps(bytes).max(rounds), variants.len(), |i| {
            transfer::upload_f32(&s, &mut dev, &host, variants[i].1)
        })?;
        let pick = transfer::auto_choice(&s, Direction::H2d, bytes);
        for ((variant, c), us) in variants.iter().zip(samples.iter_mut()) {
            let row = ctx.record_bytes(
                "compressed-h2d",
                bytes as u64,
                variant,
                us,
                bytes as f64,
                Some(Ceiling::H2dPinned),
            )?;
            if let (Compression::Auto, Some(p)) = (c, pick) {
                row.extra.insert("auto_pick".into(), p.to_string().into());
            }
        }
    }
    Ok(())
}
