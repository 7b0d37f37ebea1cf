//! The `dist` suite: collectives of the CPU backend's in-process group and, on a GPU host,
//! of NCCL over every GPU (one rank a GPU, a thread each).
//!
//! - `all-reduce-w4` (size = bytes of f32 per rank): a sum over four ranks, each a thread of
//!   this process; µs per call, the slowest rank's time of each round. `gbps` is the
//!   algorithm bandwidth (bytes per rank / time), `extra.bus_gbps` the bus bandwidth in the
//!   nccl-tests convention (× 2(n−1)/n), `extra.pct_of_bound` the share of the
//!   minimal-traffic bound: in shared memory every rank's input must be read once and its
//!   output written once, n × bytes copied at the host memcpy ceiling.
//! - `nccl-all-reduce` (size = bytes of f32 per rank; GPU hosts): an in-place sum over every
//!   GPU, µs per call from events around a run of calls (the slowest rank's, each round);
//!   variant `warpdrive` (`Comm::all_reduce`) against `nccl-direct` (the same communicator's
//!   bare NCCL call) in alternating rounds. `extra.bus_gbps` as above (none for one rank),
//!   `extra.x_direct` the direct call's median over warpdrive's.
//! - `reducer-resnet50` (size = gradient bytes): a ResNet-50-sized set of f32 gradients (161
//!   of them, 25.6 M elements, sizes log-uniform from 64 to 2.4 M, seeded) averaged by a
//!   `Reducer` (25 MiB buckets) while a stand-in backward pass (one square matmul before
//!   each gradient is ready) runs on the compute stream: µs of the whole step, the slowest
//!   rank's; `extra.backward_us` and `extra.reduce_us` alone, `extra.overlap` =
//!   (backward + reduce − step) / the shorter of the two (1: fully hidden), on GPUs (two
//!   or more) only: the CPU group (four ranks) runs calls as made, nothing overlaps.
//! - `nccl-call` (size 8 B): host µs per call of a run of 8-byte all-reduces enqueued back to
//!   back, the cost of the call itself; `extra.overhead_us` warpdrive's minus the direct
//!   call's (the bar: at most 1 µs).

use std::time::{Duration, Instant};

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use warpdrive::dist::{Comm, ReduceOp, Reducer, DEFAULT_BUCKET_BYTES};
use warpdrive::error::{Error, Result};
use warpdrive::ops::gemm::matmul;
use warpdrive::{Buffer, Device, Stream};

use super::ceilings::random_f32;
use super::{Ceiling, Ctx, Scale};

pub(crate) const SUITE: &str = "dist";

const WORLD: usize = 4;
const KIB: usize = 1 << 10;
const MIB: usize = 1 << 20;
const GIB: usize = 1 << 30;
/// Longer than any healthy call of the suite takes.
const TIMEOUT: Duration = Duration::from_secs(120);

pub(crate) fn run_suite(ctx: &mut Ctx) -> Result<()> {
    let (sizes, rounds): (&[usize], usize) = match ctx.scale() {
        Scale::Full => (&[MIB, 16 * MIB, 256 * MIB], 10),
        Scale::Quick => (&[MIB, 16 * MIB, 256 * MIB], 5),
        Scale::Tiny => (&[64 * KIB], 2),
    };
    let copy_gbps = ctx.ceilings().get(Ceiling::HostMemcpy);
    for &bytes in sizes {
        ctx.step(format!(
            "{SUITE}: all-reduce over {WORLD} ranks of {bytes} B"
        ));
        let mut us = all_reduce_rounds(bytes / 4, rounds)?;
        let row = ctx.record_bytes(
            "all-reduce-w4",
            bytes as u64,
            "warpdrive-cpu",
            &mut us,
            bytes as f64,
            None,
        )?;
        let median = row.median;
        let bus = bytes as f64 / (median * 1e3) * 2.0 * (WORLD - 1) as f64 / WORLD as f64;
        row.extra.insert("bus_gbps".into(), bus.into());
        row.extra.insert("ranks".into(), WORLD.into());
        if let Some(copy) = copy_gbps {
            let bound_us = (WORLD * bytes) as f64 / (copy * 1e3);
            row.extra
                .insert("pct_of_bound".into(), (100.0 * bound_us / median).into());
        }
    }
    let cpu_ranks = (0..WORLD).map(|_| Device::cpu()).collect();
    reducer_rows(
        ctx,
        Comm::local_group(WORLD, TIMEOUT)?,
        cpu_ranks,
        "warpdrive-cpu",
    )?;
    if ctx.device().is_cuda() {
        nccl_rows(ctx)?;
        let world = Device::cuda_count();
        if world >= 2 {
            let devices = (0..world).map(Device::cuda).collect::<Result<Vec<_>>>()?;
            let comms = Comm::nccl_group(&devices, TIMEOUT)?;
            reducer_rows(ctx, comms, devices, "warpdrive")?;
        }
    }
    Ok(())
}

/// ResNet-50's count of parameter tensors and of parameters.
const RESNET50_TENSORS: usize = 161;
const RESNET50_PARAMS: usize = 25_557_032;

/// Gradient lengths summing to `total`: `n` log-uniform sizes from 64 to 2.4 M, scaled.
fn gradient_sizes(n: usize, total: usize) -> Vec<usize> {
    let mut r = SmallRng::seed_from_u64(0x5e50);
    let raw: Vec<f64> = (0..n)
        .map(|_| (r.random_range(64f64.ln()..2.4e6f64.ln())).exp())
        .collect();
    let sum: f64 = raw.iter().sum();
    raw.iter()
        .map(|x| ((x / sum) * total as f64).max(1.0) as usize)
        .collect()
}

/// The `reducer-resnet50` row of one group (`comms[i]` on `devices[i]`, a thread each).
fn reducer_rows(
    ctx: &mut Ctx,
    comms: Vec<Comm>,
    devices: Vec<Device>,
    variant: &str,
) -> Result<()> {
    let gpu = devices.first().is_some_and(Device::is_cuda);
    let (scale_down, side, rounds) = match (ctx.scale(), gpu) {
        (Scale::Full, true) => (1, 1024, 5),
        (Scale::Full | Scale::Quick, _) => (16, 48, 3),
        (Scale::Tiny, _) => (1024, 8, 1),
    };
    let sizes = gradient_sizes(RESNET50_TENSORS, RESNET50_PARAMS / scale_down);
    let bytes = sizes.iter().sum::<usize>() * 4;
    let world = comms.len();
    ctx.step(format!(
        "{SUITE}: Reducer over {world} ranks, {} gradients of {bytes} B",
        sizes.len()
    ));
    let sync = Comm::local_group(world, TIMEOUT)?;
    let ranks = comms.into_iter().zip(sync).zip(devices).collect();
    let per_rank = on_rank_threads(ranks, |_, ((comm, sync), device)| {
        reducer_rank(&comm, &sync, &device, &sizes, side, rounds)
    })?;
    // Every rank holds the slowest rank's times.
    let [mut step, backward, reduce] = per_rank
        .into_iter()
        .next()
        .ok_or_else(|| Error::InvalidArgument("no rank ran".into()))?;
    let median = |v: &[f64]| {
        let mut v = v.to_vec();
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let (bw, ar) = (median(&backward), median(&reduce));
    let row = ctx.record_time("reducer-resnet50", bytes as u64, variant, &mut step, None)?;
    row.extra.insert("backward_us".into(), bw.into());
    row.extra.insert("reduce_us".into(), ar.into());
    // The CPU group runs calls as made: nothing overlaps there, whatever the timings say.
    if gpu {
        let hidden = (bw + ar - row.median) / bw.min(ar);
        row.extra
            .insert("overlap".into(), hidden.clamp(0.0, 1.0).into());
    }
    row.extra.insert("ranks".into(), world.into());
    row.extra
        .insert("bucket_bytes".into(), DEFAULT_BUCKET_BYTES.into());
    Ok(())
}

/// One rank of [`reducer_rows`]: µs of the step, the backward alone and the reduction alone,
/// each round's slowest rank.
fn reducer_rank(
    comm: &Comm,
    sync: &Comm,
    device: &Device,
    sizes: &[usize],
    side: usize,
    rounds: usize,
) -> Result<[Vec<f64>; 3]> {
    let compute = device.new_stream()?;
    let host = Device::cpu().new_stream()?;
    let square = random_f32(side * side, 0x5e51 + comm.rank() as u64);
    let a = Buffer::from_host(&compute, &square)?;
    let mut c = Buffer::from_host(&compute, &square)?;
    let mut grads = sizes
        .iter()
        .map(|&n| Buffer::from_host(&compute, &random_f32(n, n as u64)))
        .collect::<Result<Vec<_>>>()?;
    let events = sizes
        .iter()
        .map(|_| device.new_event())
        .collect::<Result<Vec<_>>>()?;
    let mut reducer = Reducer::new(device, DEFAULT_BUCKET_BYTES)?;
    let mut out: [Vec<f64>; 3] = Default::default();
    // Phase 0: the backward alone, 1: the reduction alone, 2: both (one warm-up round).
    for round in 0..=rounds {
        for (phase, times) in out.iter_mut().enumerate() {
            let mut barrier = Buffer::from_host(&host, &[0.0f32])?;
            sync.all_reduce(&host, &mut barrier, ReduceOp::Max)?;
            let t = Instant::now();
            for e in &events {
                if phase != 1 {
                    matmul(&compute, &a, &a, &mut c, (side, side, side))?;
                }
                compute.record(e)?;
            }
            if phase != 0 {
                let mut pairs: Vec<_> = grads.iter_mut().zip(&events).collect();
                reducer.all_reduce(comm, &compute, &mut pairs)?;
                comm.wait(reducer.stream())?;
            }
            compute.synchronize()?;
            let us = t.elapsed().as_secs_f64() * 1e6;
            let mut slowest = Buffer::from_host(&host, &[us as f32])?;
            sync.all_reduce(&host, &mut slowest, ReduceOp::Max)?;
            if round > 0 {
                times.push(f64::from(slowest.to_host(&host)?[0]));
            }
        }
    }
    Ok(out)
}

/// How one timed call is made.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Via {
    Warpdrive,
    Direct,
}

impl Via {
    fn name(self) -> &'static str {
        match self {
            Via::Warpdrive => "warpdrive",
            Via::Direct => "nccl-direct",
        }
    }

    fn all_reduce(self, comm: &Comm, stream: &Stream, buf: &mut Buffer<f32>) -> Result<()> {
        match self {
            Via::Warpdrive => comm.all_reduce(stream, buf, ReduceOp::Sum),
            Via::Direct => comm.direct_all_reduce(stream, buf, ReduceOp::Sum),
        }
    }
}

/// One measurement: all-reduces of `bytes`, `calls` a round, GPU-timed (`host` false) or
/// host-timed per call (`host` true).
#[derive(Debug, Clone, Copy)]
struct Job {
    bytes: usize,
    calls: usize,
    host: bool,
    via: Via,
}

fn nccl_rows(ctx: &mut Ctx) -> Result<()> {
    let (sizes, rounds): (&[usize], usize) = match ctx.scale() {
        Scale::Full => (
            &[8, KIB, 64 * KIB, MIB, 16 * MIB, 64 * MIB, 256 * MIB, GIB],
            10,
        ),
        Scale::Quick => (&[8, 64 * KIB, 16 * MIB], 3),
        Scale::Tiny => (&[8, 64 * KIB], 2),
    };
    let world = Device::cuda_count().max(1);
    ctx.step(format!(
        "{SUITE}: NCCL all-reduce over {world} GPU(s), {} sizes",
        sizes.len()
    ));
    let mut jobs = Vec::new();
    for via in [Via::Warpdrive, Via::Direct] {
        jobs.push(Job {
            bytes: 8,
            calls: 1000,
            host: true,
            via,
        });
    }
    for &bytes in sizes {
        for via in [Via::Warpdrive, Via::Direct] {
            jobs.push(Job {
                bytes,
                calls: (64 * MIB / bytes).clamp(1, 20),
                host: false,
                via,
            });
        }
    }
    let times = nccl_jobs(world, &jobs, rounds)?;
    for pair in jobs.chunks(2).zip(times.chunks(2)) {
        let ([ours, direct], [ours_us, direct_us]) = pair else {
            continue;
        };
        let case = if ours.host {
            "nccl-call"
        } else {
            "nccl-all-reduce"
        };
        let bytes = ours.bytes;
        let mut direct_us = direct_us.clone();
        let direct_median = ctx
            .record_bytes(
                case,
                bytes as u64,
                direct.via.name(),
                &mut direct_us,
                bytes as f64,
                None,
            )?
            .median;
        let mut ours_us = ours_us.clone();
        let row = ctx.record_bytes(
            case,
            bytes as u64,
            ours.via.name(),
            &mut ours_us,
            bytes as f64,
            None,
        )?;
        row.extra.insert("ranks".into(), world.into());
        if ours.host {
            row.extra
                .insert("overhead_us".into(), (row.median - direct_median).into());
        } else {
            row.extra
                .insert("x_direct".into(), (direct_median / row.median).into());
            if world > 1 {
                let bus =
                    bytes as f64 / (row.median * 1e3) * 2.0 * (world - 1) as f64 / world as f64;
                row.extra.insert("bus_gbps".into(), bus.into());
            }
        }
    }
    Ok(())
}

/// Runs every job `rounds` times (the jobs of a round in order) on one thread per GPU; µs
/// per call of each job and round, the slowest rank's.
fn nccl_jobs(world: usize, jobs: &[Job], rounds: usize) -> Result<Vec<Vec<f64>>> {
    let devices = (0..world).map(Device::cuda).collect::<Result<Vec<_>>>()?;
    let comms = Comm::nccl_group(&devices, TIMEOUT)?;
    // A CPU group beside it: its all-reduce is the ranks' barrier (with a timeout) and the
    // maximum over their times.
    let sync = Comm::local_group(world, TIMEOUT)?;
    let ranks = comms.into_iter().zip(sync).zip(devices).collect();
    let per_rank = on_rank_threads(ranks, |_, ((comm, sync), device)| {
        nccl_rank(&comm, &sync, &device, jobs, rounds)
    })?;
    // Every rank holds the slowest rank's times.
    per_rank
        .into_iter()
        .next()
        .ok_or_else(|| Error::InvalidArgument("no GPU rank ran".into()))
}

/// One rank's part of [`nccl_jobs`]: its times, already the maximum over the ranks.
fn nccl_rank(
    comm: &Comm,
    sync: &Comm,
    device: &Device,
    jobs: &[Job],
    rounds: usize,
) -> Result<Vec<Vec<f64>>> {
    let stream = device.new_stream()?;
    let host = Device::cpu().new_stream()?;
    let largest = jobs.iter().map(|j| j.bytes).max().unwrap_or(8);
    let data = random_f32(largest / 4, 0xd157 + comm.rank() as u64);
    let mut bufs: Vec<Buffer<f32>> = Vec::new();
    for job in jobs {
        if !bufs.iter().any(|b| b.len() == job.bytes / 4) {
            bufs.push(Buffer::from_host(&stream, &data[..job.bytes / 4])?);
        }
    }
    let (start, end) = (device.new_event()?, device.new_event()?);
    let mut out = vec![Vec::with_capacity(rounds); jobs.len()];
    // One warm-up round, then the timed ones.
    for round in 0..=rounds {
        for (job, times) in jobs.iter().zip(out.iter_mut()) {
            let buf = bufs
                .iter_mut()
                .find(|b| b.len() == job.bytes / 4)
                .ok_or_else(|| Error::InvalidArgument("no buffer for a job".into()))?;
            // Every rank starts the job together.
            let mut barrier = Buffer::from_host(&host, &[0.0f32])?;
            sync.all_reduce(&host, &mut barrier, ReduceOp::Max)?;
            let us = if job.host {
                let t = Instant::now();
                for _ in 0..job.calls {
                    job.via.all_reduce(comm, &stream, buf)?;
                }
                let us = t.elapsed().as_secs_f64() * 1e6 / job.calls as f64;
                comm.wait(&stream)?;
                us
            } else {
                stream.record(&start)?;
                for _ in 0..job.calls {
                    job.via.all_reduce(comm, &stream, buf)?;
                }
                stream.record(&end)?;
                comm.wait(&stream)?;
                f64::from(start.elapsed_ms(&end)?) * 1e3 / job.calls as f64
            };
            let mut slowest = Buffer::from_host(&host, &[us as f32])?;
            sync.all_reduce(&host, &mut slowest, ReduceOp::Max)?;
            if round > 0 {
                times.push(f64::from(slowest.to_host(&host)?[0]));
            }
        }
    }
    Ok(out)
}

/// µs of each of `rounds` all-reduces of `len` f32 (after one warm-up), the slowest rank's.
fn all_reduce_rounds(len: usize, rounds: usize) -> Result<Vec<f64>> {
    let comms = Comm::local_group(WORLD, Duration::from_secs(120))?;
    let per_rank = on_rank_threads(comms, |rank, comm| -> Result<Vec<f64>> {
        let stream = Device::cpu().new_stream()?;
        let input = random_f32(len, 0xd157 + rank as u64);
        let mut buf = Buffer::from_host(&stream, &input)?;
        comm.all_reduce(&stream, &mut buf, ReduceOp::Sum)?;
        (0..rounds)
            .map(|_| {
                let start = Instant::now();
                comm.all_reduce(&stream, &mut buf, ReduceOp::Sum)?;
                Ok(start.elapsed().as_secs_f64() * 1e6)
            })
            .collect()
    })?;
    Ok((0..rounds)
        .map(|i| per_rank.iter().map(|t| t[i]).fold(0.0, f64::max))
        .collect())
}

/// Runs `rank(i, ranks[i])` on a thread each; their results in rank order, or the first
/// rank's error (a panic as `WorkerPanicked`).
fn on_rank_threads<I: Send, R: Send>(
    ranks: Vec<I>,
    rank: impl Fn(usize, I) -> Result<R> + Sync,
) -> Result<Vec<R>> {
    std::thread::scope(|s| {
        let rank = &rank;
        let handles: Vec<_> = ranks
            .into_iter()
            .enumerate()
            .map(|(i, item)| s.spawn(move || rank(i, item)))
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join().unwrap_or_else(|_| {
                    Err(Error::WorkerPanicked("a rank of the dist suite".into()))
                })
            })
            .collect()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_tiny_run_records_the_bus_bandwidth() {
        let mut ctx = Ctx::new(&Device::cpu(), Scale::Tiny).unwrap();
        ctx.suite = SUITE;
        run_suite(&mut ctx).unwrap();
        let row = &ctx.rows()[0];
        assert_eq!((row.case.as_str(), row.size), ("all-reduce-w4", 64 * 1024));
        assert!(row.extra["bus_gbps"].as_f64().unwrap() > 0.0);
        let reducer = ctx
            .rows()
            .iter()
            .find(|r| r.case == "reducer-resnet50")
            .expect("the reducer's row");
        assert!(!reducer.extra.contains_key("overlap"));
        assert!(reducer.extra["reduce_us"].as_f64().unwrap() > 0.0);
    }
}
