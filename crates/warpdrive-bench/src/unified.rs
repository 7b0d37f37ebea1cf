//! The `unified` suite: what the first device touch of host-written memory costs, managed
//! (faulting or prefetched) against explicit mirrors and the pinned copy; and what the
//! allocation profiler costs.
//!
//! - `managed-first-touch` (size = bytes of f32): the host writes the memory (untimed), then
//!   the host clock runs until a sum kernel (`ops::reduce_into`) that reads all of it is done.
//!   Variants `warpdrive-fault` (a `ManagedBuffer`, no hints: the kernel faults pages over),
//!   `warpdrive-prefetch` (`ManagedBuffer::prefetch` to the device first, same stream),
//!   `warpdrive-mirror` (`UnifiedBuffer::sync_to_device` then the kernel) and `driver-pinned`
//!   (a pinned buffer copied with `cuMemcpyHtoDAsync` then the kernel). GB/s counts the bytes
//!   once; `pct_of_ceiling` is against the pinned host→device copy ceiling (the kernel's time
//!   is included, so 100% is out of reach by the kernel's share). 256 MiB and 4 GiB on CUDA;
//!   16 and 64 MiB on the CPU backend.
//! - `profiler-overhead` (size = bytes per allocation): µs per `Buffer::uninit` + drop pair
//!   from the device pool, recording off (`warpdrive`) and on (`warpdrive-recording`);
//!   `extra.us_per_event` on the recording row is the added cost per event (two per pair).

use std::time::Instant;

use warpdrive::error::Result;
use warpdrive::memory::{profiler, Buffer, ManagedBuffer, PinnedBuf, UnifiedBuffer};
use warpdrive::ops::{self, Reduce, ReduceOp, Scratch, REDUCE_SCRATCH_BYTES};

use super::kernels::size_label;
use super::results::Ceiling;
use super::timing::time_host;
use super::{Ctx, Scale};

/// The suite name.
pub const SUITE: &str = "unified";

const MIB: usize = 1 << 20;

struct Plan {
    sizes: &'static [usize],
    reps: usize,
    pairs: usize,
}

impl Plan {
    fn new(scale: Scale) -> Plan {
        match scale {
            Scale::Full => Plan {
                sizes: &[256 * MIB, 4096 * MIB],
                reps: 7,
                pairs: 20_000,
            },
            Scale::Quick => Plan {
                sizes: &[16 * MIB, 64 * MIB],
                reps: 3,
                pairs: 2_000,
            },
            Scale::Tiny => Plan {
                sizes: &[MIB],
                reps: 2,
                pairs: 100,
            },
        }
    }
}

pub(crate) fn run_suite(ctx: &mut Ctx) -> Result<()> {
    let plan = Plan::new(ctx.scale());
    for &bytes in plan.sizes {
        first_touch(ctx, &plan, bytes)?;
    }
    profiler_overhead(ctx, &plan)
}

/// Host-clock µs per rep of `touch` (untimed host writes with rep-dependent values) then
/// `work` (timed, finished by a stream synchronise).
fn time_touch(
    ctx: &Ctx,
    reps: usize,
    mut touch: impl FnMut(f32) -> Result<()>,
    mut work: impl FnMut() -> Result<()>,
) -> Result<Vec<f64>> {
    let mut out = Vec::with_capacity(reps);
    // One warm-up rep: module loads and first allocations stay out.
    for rep in 0..=reps {
        touch(0.5 + rep as f32)?;
        ctx.stream().synchronize()?;
        let t = Instant::now();
        work()?;
        ctx.stream().synchronize()?;
        if rep > 0 {
            out.push(t.elapsed().as_secs_f64() * 1e6);
        }
    }
    Ok(out)
}

fn first_touch(ctx: &mut Ctx, plan: &Plan, bytes: usize) -> Result<()> {
    const CASE: &str = "managed-first-touch";
    ctx.step(format!("{SUITE}: {CASE} {}", size_label(bytes)));
    let n = bytes / 4;
    let stream = ctx.stream().clone();
    let scratch = Scratch::new(&stream, REDUCE_SCRATCH_BYTES)?;
    let mut total = Buffer::<f32>::uninit(&stream, 1)?;
    let sum = Reduce::from(ReduceOp::Sum);
    let ordinal = ctx.device().ordinal().unwrap_or(0);
    let mut rows: Vec<(&str, Vec<f64>)> = Vec::new();
    {
        let mut m = ManagedBuffer::<f32>::new(&stream, n)?;
        let mut us = Vec::new();
        for prefetch in [false, true] {
            let cell = std::cell::RefCell::new(&mut m);
            us.push(time_touch(
                ctx,
                plan.reps,
                |v| {
                    cell.borrow_mut().host_mut()?.fill(v);
                    Ok(())
                },
                || {
                    let m = cell.borrow();
                    if prefetch {
                        m.prefetch(0..n, warpdrive::memory::Location::Device(ordinal), &stream)?;
                    }
                    ops::reduce_into(&stream, sum, m.as_buffer(), &mut total, &scratch)
                },
            )?);
        }
        rows.push(("warpdrive-fault", us.remove(0)));
        rows.push(("warpdrive-prefetch", us.remove(0)));
    }
    {
        let mirror = std::cell::RefCell::new(UnifiedBuffer::<f32>::zeros(&stream, n)?);
        let us = time_touch(
            ctx,
            plan.reps,
            |v| {
                mirror.borrow_mut().host_mut()?.fill(v);
                Ok(())
            },
            || {
                let mut u = mirror.borrow_mut();
                u.sync_to_device(&stream)?;
                ops::reduce_into(&stream, sum, u.device(&stream)?, &mut total, &scratch)
            },
        )?;
        rows.push(("warpdrive-mirror", us));
    }
    {
        let pinned = std::cell::RefCell::new(PinnedBuf::<f32>::new(ctx.device(), n)?);
        let mut dev = Buffer::<f32>::uninit(&stream, n)?;
        let us = time_touch(
            ctx,
            plan.reps,
            |v| {
                pinned.borrow_mut().wait_slice_mut()?.fill(v);
                Ok(())
            },
            || {
                dev.copy_from_pinned(&stream, &mut pinned.borrow_mut())?;
                ops::reduce_into(&stream, sum, &dev, &mut total, &scratch)
            },
        )?;
        rows.push(("driver-pinned", us));
    }
    let pinned_median = median(&rows[3].1);
    for (variant, mut us) in rows {
        let med = median(&us);
        let row = ctx.record_bytes(
            CASE,
            bytes as u64,
            variant,
            &mut us,
            bytes as f64,
            Some(Ceiling::H2dPinned),
        )?;
        row.extra.insert("dtype".into(), "f32".into());
        row.extra
            .insert("kernel".into(), "sum (reads every byte once)".into());
        if pinned_median > 0.0 {
            row.extra
                .insert("over_driver_pinned".into(), (med / pinned_median).into());
        }
    }
    Ok(())
}

fn median(v: &[f64]) -> f64 {
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    s.get(s.len() / 2).copied().unwrap_or(0.0)
}

fn profiler_overhead(ctx: &mut Ctx, plan: &Plan) -> Result<()> {
    const CASE: &str = "profiler-overhead";
    const BYTES: usize = 64 << 10;
    ctx.step(format!("{SUITE}: {CASE}"));
    let stream = ctx.stream().clone();
    let pairs = plan.pairs;
    let run = |record: bool| -> Result<Vec<f64>> {
        profiler::clear();
        if record {
            profiler::start_recording();
        }
        let r = time_host(1, plan.reps.max(5), || {
            for _ in 0..pairs {
                drop(Buffer::<u8>::uninit(&stream, BYTES)?);
            }
            profiler::clear();
            Ok(())
        });
        profiler::stop_recording();
        let us = r?;
        Ok(us.iter().map(|t| t / pairs as f64).collect())
    };
    let mut off = run(false)?;
    let mut on = run(true)?;
    let per_event = (median(&on) - median(&off)) / 2.0;
    ctx.record_time(CASE, BYTES as u64, "warpdrive", &mut off, None)?
        .extra
        .insert("pairs_per_sample".into(), pairs.into());
    let row = ctx.record_time(CASE, BYTES as u64, "warpdrive-recording", &mut on, None)?;
    row.extra.insert("pairs_per_sample".into(), pairs.into());
    row.extra.insert("us_per_event".into(), per_event.into());
    Ok(())
}
