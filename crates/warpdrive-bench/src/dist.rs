//! The `dist` suite: collectives of the CPU backend's groups and, on a GPU host,
//! of NCCL over every GPU (one rank a GPU, a thread each).
//!
//! - `all-reduce-w4` (size = bytes of f32 per rank): a sum over four ranks, each a thread of
//!   this process; µs per call, the slowest rank's time of each round. Variants: the
//!   in-process group (`warpdrive-cpu`), the group across processes over shared memory
//!   (`warpdrive-cpu-shm`) and over TCP on loopback (`warpdrive-cpu-tcp`, up to 16 MiB), the
//!   latter two with a thread a rank that shares nothing with the others but the transport
//!   (`dist/cpu.rs`). `gbps` is the algorithm bandwidth (bytes per rank / time), `extra.bus_gbps` the bus bandwidth in the
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
//! - `int8-codec` (size = bytes of f32; on the suite's device): µs of one int8 quantization
//!   with error feedback and one dequantization (what an `Int8Reducer` adds to its
//!   all-gather); `extra.ratio` = f32 bytes / wire bytes.
//! - `int8-all-reduce` (size = bytes of f32 per rank; GPU hosts, from 64 KiB): an
//!   `Int8Reducer`'s average over every GPU, timed as `nccl-all-reduce`; `extra.x_plain` =
//!   the plain all-reduce's median over this one (above 1: compression wins here),
//!   `extra.wins_below_gbps` the link rate below which it would win, from the codec's time
//!   (none where the all-gather alone moves more than the ring: one rank, or n > 2·ratio).
//! - `topk-codec` (size = bytes of f32; on the suite's device): µs of one DGC top-k at 1%
//!   (`ops::sparse::topk_ef`: momentum, accumulation and selection) and one `densify` of its
//!   payload (a `TopkReducer`'s work besides its all-gather); `extra.ratio` = f32 bytes / wire
//!   bytes.
//! - `topk-all-reduce` (size = bytes of f32 per rank; GPU hosts, from 64 KiB): a
//!   `TopkReducer`'s (1%) average over every GPU, timed as `nccl-all-reduce`; `extra.x_plain`
//!   and `extra.wins_below_gbps` as for int8 (ratio ≈ 48.8).
//! - `powersgd-all-reduce` (size = bytes of f32 per rank; GPU hosts, from 64 KiB): a
//!   `PowerSgdReducer`'s average (rank 4, the gradient as rows × 1024), timed as
//!   `nccl-all-reduce`; `extra.x_plain` and `extra.ratio` (f32 values over values sent).
//! - `peer-copy` (size = bytes; hosts with two GPUs or more): GPU 0 to GPU 1, GB/s from events
//!   around a run of copies on GPU 1's stream: `warpdrive` (`copy_peer`: direct where the
//!   GPUs have peer access, `extra.path`) and `warpdrive-staged` (`copy_peer_staged`, through
//!   pinned host memory); the `torch-copy` peer row is `Tensor.copy_` across the GPUs.
//! - `nccl-graph` (size = bytes of f32 per rank, 8 B and 1 KiB; GPU hosts): µs per
//!   all-reduce of a CUDA graph holding a run of them, replayed (events around each replay,
//!   the slowest rank's); `extra.eager_us` the same run's eager `nccl-all-reduce` median and
//!   `extra.x_eager` eager over graph.
//! - `mlp-scaling` (size = ranks; hosts with two GPUs or more): µs per data-parallel step of
//!   a bf16 MLP (width 8192, depth 4, 8192 rows a rank: `dist/mlp.rs`) on one GPU, two and
//!   all of them, the Reducer averaging its gradients during the backward pass;
//!   `extra.scaling` = one-GPU step / this one (weak scaling), `extra.tflops_per_rank`.
//!   Variant `warpdrive-cta-efficiency` (here and in `reducer-resnet50` on GPUs): the Reducer
//!   on a communicator of NCCL's CTA efficiency policy (`Comm::with_cta_policy`).
//! - `nccl-call` (size 8 B): host µs per call of a run of 8-byte all-reduces enqueued back to
//!   back, the cost of the call itself; `extra.overhead_us` warpdrive's minus the direct
//!   call's (the bar: at most 1 µs).
//! - `peer-signal` (size 8 B): one-way µs of a device-initiated signal through peer-mapped
//!   memory, two streams of the suite's device and, with two GPUs, cuda:0 and cuda:1
//!   (`dist/signal.rs`).

use std::collections::hash_map::Entry;
use std::collections::HashMap;
use std::time::{Duration, Instant};

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use warpdrive::dist::{
    Comm, CtaPolicy, Int8Reducer, PowerSgdReducer, ReduceOp, Reducer, TopkReducer,
    DEFAULT_BUCKET_BYTES,
};
use warpdrive::error::{Error, Result};
use warpdrive::exec::Graph;
use warpdrive::ops::gemm::matmul;
use warpdrive::ops::quant::{dequantize_int8, quant_blocks, quantize_int8_ef, QUANT_BLOCK};
use warpdrive::ops::sparse::{densify, topk_ef, Sparsity};
use warpdrive::transfer::{copy_peer, copy_peer_staged};
use warpdrive::{Buffer, Device, Stream};

mod cpu;
mod mlp;
mod signal;

use super::ceilings::random_f32;
use super::timing::time_gpu;
use super::{Ctx, Scale};

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
    cpu::all_reduce_rows(ctx, sizes, rounds)?;
    let codecs = codec_rows(ctx)?;
    let cpu_ranks = (0..WORLD).map(|_| Device::cpu()).collect();
    reducer_rows(
        ctx,
        Comm::local_group(WORLD, TIMEOUT)?,
        cpu_ranks,
        CtaPolicy::Default,
        "warpdrive-cpu",
    )?;
    signal::signal_rows(ctx)?;
    if ctx.device().is_cuda() {
        nccl_rows(ctx, &codecs)?;
        graph_rows(ctx)?;
        let world = Device::cuda_count();
        if world >= 2 {
            peer_copy_rows(ctx)?;
            let devices = (0..world).map(Device::cuda).collect::<Result<Vec<_>>>()?;
            let comms = Comm::nccl_group(&devices, TIMEOUT)?;
            reducer_rows(ctx, comms, devices.clone(), CtaPolicy::Default, "warpdrive")?;
            let comms = Comm::nccl_group(&devices, TIMEOUT)?;
            let variant = "warpdrive-cta-efficiency";
            reducer_rows(ctx, comms, devices.clone(), CtaPolicy::Efficiency, variant)?;
            mlp_rows(ctx, &devices)?;
        }
    }
    Ok(())
}

/// The `mlp-scaling` rows on the GPUs `devices`: one rank (the first GPU), then all of
/// them (and two, when there are more).
fn mlp_rows(ctx: &mut Ctx, devices: &[Device]) -> Result<()> {
    let shape = match ctx.scale() {
        Scale::Full => mlp::Shape {
            width: 8192,
            depth: 4,
            batch: 8192,
            rounds: 12,
        },
        _ => mlp::Shape {
            width: 256,
            depth: 2,
            batch: 128,
            rounds: 2,
        },
    };
    let mut worlds = vec![1, devices.len()];
    if devices.len() > 2 {
        worlds.insert(1, 2);
    }
    let mut one = None;
    for world in worlds {
        // One GPU has nothing to reduce: the CTA policy matters from two.
        let policies: &[(CtaPolicy, &str)] = if world == 1 {
            &[(CtaPolicy::Default, "warpdrive")]
        } else {
            &[
                (CtaPolicy::Default, "warpdrive"),
                (CtaPolicy::Efficiency, "warpdrive-cta-efficiency"),
            ]
        };
        for &(policy, variant) in policies {
            ctx.step(format!(
                "{SUITE}: MLP step (width {}, depth {}, batch {} bf16) on {world} GPUs, {policy:?} CTAs",
                shape.width, shape.depth, shape.batch
            ));
            let group = devices[..world].to_vec();
            let comms = Comm::nccl_group(&group, TIMEOUT)?;
            let mut us = mlp::step_times(comms, group, shape, policy)?;
            let row = ctx.record_time("mlp-scaling", world as u64, variant, &mut us, None)?;
            let median = row.median;
            for (k, v) in [
                ("width", shape.width),
                ("depth", shape.depth),
                ("batch_per_rank", shape.batch),
            ] {
                row.extra.insert(k.into(), v.into());
            }
            row.extra.insert("dtype".into(), "bf16".into());
            row.extra
                .insert("tflops_per_rank".into(), mlp::tflops(shape, median).into());
            match one {
                None => one = Some(median),
                Some(t1) => {
                    row.extra.insert("scaling".into(), (t1 / median).into());
                }
            }
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

/// The `reducer-resnet50` row of one group (`comms[i]` on `devices[i]`, a thread each), the
/// Reducer on a communicator of `policy`.
fn reducer_rows(
    ctx: &mut Ctx,
    comms: Vec<Comm>,
    devices: Vec<Device>,
    policy: CtaPolicy,
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
        let comm = match policy {
            CtaPolicy::Default => comm,
            other => comm.with_cta_policy(other)?,
        };
        reducer_rank(&comm, &sync, &device, &sizes, side, rounds)
    })?;
    // Every rank holds the slowest rank's times.
    let ReducerTimes {
        backward,
        reduce,
        mut step,
    } = per_rank
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

/// One rank of [`reducer_rows`]: µs of the backward alone, the reduction alone and both
/// (the step), each round's slowest rank.
fn reducer_rank(
    comm: &Comm,
    sync: &Comm,
    device: &Device,
    sizes: &[usize],
    side: usize,
    rounds: usize,
) -> Result<ReducerTimes> {
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
    let mut out = ReducerTimes::default();
    // One warm-up round, then the timed ones.
    for round in 0..=rounds {
        for phase in [Phase::Backward, Phase::Reduce, Phase::Both] {
            barrier(sync, &host)?;
            let t = Instant::now();
            for e in &events {
                if phase != Phase::Reduce {
                    matmul(&compute, &a, &a, &mut c, (side, side, side))?;
                }
                compute.record(e)?;
            }
            if phase != Phase::Backward {
                let mut pairs: Vec<_> = grads.iter_mut().zip(&events).collect();
                reducer.all_reduce(comm, &compute, &mut pairs)?;
                comm.wait(reducer.stream())?;
            }
            compute.synchronize()?;
            let us = slowest(sync, &host, t.elapsed().as_secs_f64() * 1e6)?;
            if round > 0 {
                let times = match phase {
                    Phase::Backward => &mut out.backward,
                    Phase::Reduce => &mut out.reduce,
                    Phase::Both => &mut out.step,
                };
                times.push(us);
            }
        }
    }
    Ok(out)
}

/// What one timed pass of [`reducer_rank`] runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// The stand-in backward pass alone.
    Backward,
    /// The Reducer alone (every gradient ready at once).
    Reduce,
    /// Both: the Reducer overlapping the backward pass.
    Both,
}

/// µs of each timed round of [`reducer_rank`]'s passes, the slowest rank's.
#[derive(Debug, Default)]
struct ReducerTimes {
    backward: Vec<f64>,
    reduce: Vec<f64>,
    step: Vec<f64>,
}

/// How one timed call is made.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Via {
    Warpdrive,
    Direct,
    /// An [`Int8Reducer`]'s compressed average.
    Int8,
    /// A [`TopkReducer`]'s (density [`TOPK_DENSITY`]).
    Topk,
    /// A [`PowerSgdReducer`]'s (rank [`POWERSGD_RANK`], [`POWERSGD_COLS`] columns).
    PowerSgd,
}

/// The rank and the matrix width of the `powersgd-all-reduce` rows.
const POWERSGD_RANK: usize = 4;
const POWERSGD_COLS: usize = 1024;

/// The density of the `topk-*` rows (DGC's 99% sparsity is the check).
const TOPK_DENSITY: f64 = 0.01;

/// A rank's compressing reducers, one per gradient length, made on first use.
#[derive(Default)]
struct Compressors {
    int8: HashMap<usize, Int8Reducer>,
    topk: HashMap<usize, TopkReducer>,
    powersgd: HashMap<usize, PowerSgdReducer>,
}

/// The reducer in `made` for gradients of `n` elements, made by `make` the first time.
fn reducer_for<R>(
    made: &mut HashMap<usize, R>,
    n: usize,
    make: impl FnOnce() -> Result<R>,
) -> Result<&mut R> {
    Ok(match made.entry(n) {
        Entry::Occupied(e) => e.into_mut(),
        Entry::Vacant(e) => e.insert(make()?),
    })
}

impl Via {
    fn name(self) -> &'static str {
        match self {
            Via::Warpdrive => "warpdrive",
            Via::Direct => "nccl-direct",
            Via::Int8 => "warpdrive-int8",
            Via::Topk => "warpdrive-topk",
            Via::PowerSgd => "warpdrive-powersgd",
        }
    }

    /// The row case of a compressed call's timings.
    fn compressed_case(self) -> &'static str {
        match self {
            Via::Topk => "topk-all-reduce",
            Via::PowerSgd => "powersgd-all-reduce",
            _ => "int8-all-reduce",
        }
    }

    /// One call on `buf`, with the rank's compressing reducers in `c`.
    fn all_reduce(
        self,
        comm: &Comm,
        stream: &Stream,
        buf: &mut Buffer<f32>,
        c: &mut Compressors,
    ) -> Result<()> {
        let n = buf.len();
        match self {
            Via::Warpdrive => comm.all_reduce(stream, buf, ReduceOp::Sum),
            Via::Direct => comm.direct_all_reduce(stream, buf, ReduceOp::Sum),
            Via::Int8 => reducer_for(&mut c.int8, n, || Int8Reducer::new(comm, stream, n))?
                .all_reduce(comm, stream, buf),
            Via::Topk => reducer_for(&mut c.topk, n, || {
                TopkReducer::new(comm, stream, n, Sparsity::new(TOPK_DENSITY)?, 0.0)
            })?
            .all_reduce(comm, stream, buf),
            Via::PowerSgd => reducer_for(&mut c.powersgd, n, || {
                PowerSgdReducer::new(stream, n / POWERSGD_COLS, POWERSGD_COLS, POWERSGD_RANK)
            })?
            .all_reduce(comm, stream, buf),
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

/// The smallest all-reduce the `int8-all-reduce` rows time.
const INT8_FROM: usize = 64 * KIB;

fn median(v: &[f64]) -> f64 {
    let mut v = v.to_vec();
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
}

/// The link rate (bus bandwidth, GB/s) below which a compressed all-reduce (an all-gather of
/// each rank's payload, `ratio` times smaller than its `bytes` of f32) beats a ring all-reduce,
/// given its codec time `codec_us`: the ring moves 2(n−1)/n·B over the link, the all-gather
/// (n−1)·B/r, so compression wins while `codec + (n−1)·B/(r·L) < 2(n−1)/n·B/L`, i.e.
/// `L < (n−1)·B·(2/n − 1/r) / codec`. None for one rank, or where the all-gather alone moves
/// more than the ring (n > 2r).
fn compressed_wins_below(bytes: usize, ratio: f64, world: usize, codec_us: f64) -> Option<f64> {
    let n = world as f64;
    let saved = (n - 1.0) * bytes as f64 * (2.0 / n - 1.0 / ratio);
    (world > 1 && saved > 0.0 && codec_us > 0.0).then(|| saved / (codec_us * 1e3))
}

/// The int8 payload's ratio: f32 bytes over int8 values plus an f32 scale per block.
fn int8_ratio(bytes: usize) -> f64 {
    let elems = bytes / 4;
    bytes as f64 / (elems + 4 * elems.div_ceil(QUANT_BLOCK)) as f64
}

/// The top-k payload's ratio: f32 bytes over an index and a value per slot.
fn topk_ratio(bytes: usize) -> Result<f64> {
    let slots = Sparsity::new(TOPK_DENSITY)?.slots(bytes / 4)?;
    Ok(bytes as f64 / (8 * slots.max(1)) as f64)
}

fn nccl_rows(ctx: &mut Ctx, codecs: &[(usize, Via, f64)]) -> Result<()> {
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
    let pairs = jobs.len();
    for via in [Via::Int8, Via::Topk, Via::PowerSgd] {
        for &bytes in sizes.iter().filter(|&&b| b >= INT8_FROM) {
            jobs.push(Job {
                bytes,
                calls: (64 * MIB / bytes).clamp(1, 20),
                host: false,
                via,
            });
        }
    }
    let times = nccl_jobs(world, &jobs, rounds)?;
    let plain: Vec<(usize, f64)> = jobs[..pairs]
        .chunks(2)
        .zip(times.chunks(2))
        .filter(|(j, _)| !j[0].host)
        .map(|(j, t)| (j[0].bytes, median(&t[0])))
        .collect();
    for (job, us) in jobs[pairs..].iter().zip(&times[pairs..]) {
        let mut us = us.clone();
        let row = ctx.record_bytes(
            job.via.compressed_case(),
            job.bytes as u64,
            job.via.name(),
            &mut us,
            job.bytes as f64,
            None,
        )?;
        row.extra.insert("ranks".into(), world.into());
        if let Some((_, p)) = plain.iter().find(|(b, _)| *b == job.bytes) {
            row.extra.insert("x_plain".into(), (p / row.median).into());
        }
        let codec = codecs.iter().find(|c| c.0 == job.bytes && c.1 == job.via);
        let ratio = match job.via {
            Via::Topk => topk_ratio(job.bytes)?,
            Via::PowerSgd => {
                let (rows, cols) = (job.bytes / 4 / POWERSGD_COLS, POWERSGD_COLS);
                (rows * cols) as f64 / ((rows + cols) * POWERSGD_RANK) as f64
            }
            _ => int8_ratio(job.bytes),
        };
        row.extra.insert("ratio".into(), ratio.into());
        if let Some(&(_, _, codec_us)) = codec {
            if let Some(gbps) = compressed_wins_below(job.bytes, ratio, world, codec_us) {
                row.extra.insert("wins_below_gbps".into(), gbps.into());
            }
        }
    }
    for pair in jobs[..pairs].chunks(2).zip(times[..pairs].chunks(2)) {
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
    let mut compressors = Compressors::default();
    let mut out = vec![Vec::with_capacity(rounds); jobs.len()];
    // One warm-up round, then the timed ones.
    for round in 0..=rounds {
        for (job, times) in jobs.iter().zip(out.iter_mut()) {
            let buf = bufs
                .iter_mut()
                .find(|b| b.len() == job.bytes / 4)
                .ok_or_else(|| Error::InvalidArgument("no buffer for a job".into()))?;
            // Every rank starts the job together.
            barrier(sync, &host)?;
            let us = if job.host {
                let t = Instant::now();
                for _ in 0..job.calls {
                    job.via.all_reduce(comm, &stream, buf, &mut compressors)?;
                }
                let us = t.elapsed().as_secs_f64() * 1e6 / job.calls as f64;
                comm.wait(&stream)?;
                us
            } else {
                stream.record(&start)?;
                for _ in 0..job.calls {
                    job.via.all_reduce(comm, &stream, buf, &mut compressors)?;
                }
                stream.record(&end)?;
                comm.wait(&stream)?;
                f64::from(start.elapsed_ms(&end)?) * 1e3 / job.calls as f64
            };
            let us = slowest(sync, &host, us)?;
            if round > 0 {
                times.push(us);
            }
        }
    }
    Ok(out)
}

/// All-reduces a graph of the `nccl-graph` rows holds.
const GRAPH_CALLS: usize = 100;

/// The `nccl-graph` rows: a graph of [`GRAPH_CALLS`] all-reduces captured once per rank and
/// size, replayed; µs per all-reduce.
fn graph_rows(ctx: &mut Ctx) -> Result<()> {
    let rounds = match ctx.scale() {
        Scale::Full => 10,
        Scale::Quick | Scale::Tiny => 3,
    };
    let sizes = [8usize, KIB];
    let world = Device::cuda_count().max(1);
    ctx.step(format!(
        "{SUITE}: all-reduces replayed from a graph over {world} GPU(s)"
    ));
    let devices = (0..world).map(Device::cuda).collect::<Result<Vec<_>>>()?;
    let comms = Comm::nccl_group(&devices, TIMEOUT)?;
    let sync = Comm::local_group(world, TIMEOUT)?;
    let ranks = comms.into_iter().zip(sync).zip(devices).collect();
    let per_rank = on_rank_threads(ranks, |_, ((comm, sync), device)| {
        let stream = device.new_stream()?;
        let host = Device::cpu().new_stream()?;
        let (start, end) = (device.new_event()?, device.new_event()?);
        let mut out = Vec::new();
        for &bytes in &sizes {
            let mut buf = Buffer::from_host(&stream, &random_f32(bytes / 4, 0x9a4f))?;
            let mut graph = Graph::capture_with(&stream, &mut buf, |s, b| {
                (0..GRAPH_CALLS).try_for_each(|_| comm.all_reduce(s, b, ReduceOp::Sum))
            })?;
            let mut us = Vec::with_capacity(rounds);
            for round in 0..=rounds {
                barrier(&sync, &host)?;
                stream.record(&start)?;
                graph.launch_with(&mut buf)?;
                stream.record(&end)?;
                comm.wait(&stream)?;
                let t = f64::from(start.elapsed_ms(&end)?) * 1e3 / GRAPH_CALLS as f64;
                let t = slowest(&sync, &host, t)?;
                if round > 0 {
                    us.push(t);
                }
            }
            out.push(us);
        }
        Ok(out)
    })?;
    let times = per_rank
        .into_iter()
        .next()
        .ok_or_else(|| Error::InvalidArgument("no GPU rank ran".into()))?;
    for (&bytes, mut us) in sizes.iter().zip(times) {
        let eager = ctx
            .rows()
            .iter()
            .find(|r| {
                r.case == "nccl-all-reduce" && r.variant == "warpdrive" && r.size == bytes as u64
            })
            .map(|r| r.median);
        let row = ctx.record_bytes(
            "nccl-graph",
            bytes as u64,
            "warpdrive-graph",
            &mut us,
            bytes as f64,
            None,
        )?;
        row.extra.insert("ranks".into(), world.into());
        if let Some(eager) = eager {
            row.extra.insert("eager_us".into(), eager.into());
            row.extra
                .insert("x_eager".into(), (eager / row.median).into());
        }
    }
    Ok(())
}

/// The `int8-codec` rows on the suite's device: µs of one [`quantize_int8_ef`] and one
/// [`dequantize_int8`] of a payload (an [`Int8Reducer`]'s work besides its all-gather),
/// events around a run of calls; `gbps` is f32 bytes in per µs, `extra.ratio` f32 bytes over
/// wire bytes; and the `topk-codec` rows alike. Returns (bytes, which, median µs) per size and
/// codec for the compressed rows' model.
fn codec_rows(ctx: &mut Ctx) -> Result<Vec<(usize, Via, f64)>> {
    let (sizes, rounds, calls): (&[usize], usize, usize) =
        match (ctx.scale(), ctx.device().is_cuda()) {
            (Scale::Full, true) => (&[64 * KIB, MIB, 16 * MIB, 64 * MIB, 256 * MIB, GIB], 10, 10),
            (Scale::Full | Scale::Quick, _) => (&[64 * KIB, MIB, 16 * MIB], 5, 3),
            (Scale::Tiny, _) => (&[64 * KIB], 2, 1),
        };
    let stream = ctx.stream().clone();
    let mut out = Vec::new();
    for &bytes in sizes {
        ctx.step(format!("{SUITE}: int8 and top-k codecs of {bytes} B"));
        let n = bytes / 4;
        let grad = Buffer::from_host(&stream, &random_f32(n, 0xc0de))?;
        let mut error = Buffer::zeros(&stream, n)?;
        let mut q = Buffer::<u8>::zeros(&stream, n)?;
        let mut scales = Buffer::zeros(&stream, quant_blocks(n))?;
        let mut back = Buffer::zeros(&stream, n)?;
        let mut us = time_per_call(&stream, rounds, calls, |s| {
            quantize_int8_ef(s, &grad, &mut error, &mut q, &mut scales)?;
            dequantize_int8(s, &q, &scales, 1, 1.0, &mut back)
        })?;
        let row = ctx.record_bytes(
            "int8-codec",
            bytes as u64,
            "warpdrive",
            &mut us,
            bytes as f64,
            None,
        )?;
        row.extra.insert("ratio".into(), int8_ratio(bytes).into());
        out.push((bytes, Via::Int8, row.median));

        let sparsity = Sparsity::new(TOPK_DENSITY)?;
        let slots = sparsity.slots(n)?;
        let (mut u, mut v) = (Buffer::zeros(&stream, n)?, Buffer::zeros(&stream, n)?);
        let mut idx = Buffer::<u32>::zeros(&stream, slots)?;
        let mut val = Buffer::zeros(&stream, slots)?;
        let mut us = time_per_call(&stream, rounds, calls, |s| {
            topk_ef(s, &grad, &mut u, &mut v, 0.0, sparsity, &mut idx, &mut val)?;
            densify(s, &idx, &val, 1, 1.0, &mut back)
        })?;
        let row = ctx.record_bytes(
            "topk-codec",
            bytes as u64,
            "warpdrive",
            &mut us,
            bytes as f64,
            None,
        )?;
        row.extra.insert("ratio".into(), topk_ratio(bytes)?.into());
        out.push((bytes, Via::Topk, row.median));
    }
    Ok(out)
}

/// µs per call of `work`, `calls` of them a round, over `rounds` rounds after a warm-up one
/// (GPU-timed on a GPU stream, see [`time_gpu`]).
fn time_per_call(
    stream: &Stream,
    rounds: usize,
    calls: usize,
    mut work: impl FnMut(&Stream) -> Result<()>,
) -> Result<Vec<f64>> {
    let us = time_gpu(stream, 1, rounds, |s| (0..calls).try_for_each(|_| work(s)))?;
    Ok(us.into_iter().map(|t| t / calls.max(1) as f64).collect())
}

/// The `peer-copy` rows: GPU 0 to GPU 1 by [`copy_peer`] and [`copy_peer_staged`], events
/// around a run of copies on GPU 1's stream.
fn peer_copy_rows(ctx: &mut Ctx) -> Result<()> {
    let (sizes, rounds): (&[usize], usize) = match ctx.scale() {
        Scale::Full => (&[MIB, 64 * MIB, 256 * MIB, GIB], 10),
        Scale::Quick | Scale::Tiny => (&[MIB, 64 * MIB], 3),
    };
    let (a, b) = (Device::cuda(0)?, Device::cuda(1)?);
    let (sa, sb) = (a.new_stream()?, b.new_stream()?);
    let peer = b.can_access_peer(&a)?;
    for &bytes in sizes {
        ctx.step(format!("{SUITE}: peer copy of {bytes} B, cuda:0 to cuda:1"));
        let src = Buffer::from_host(&sa, &random_f32(bytes / 4, 0x9ee4))?;
        sa.synchronize()?;
        let mut dst = Buffer::<f32>::zeros(&sb, bytes / 4)?;
        let calls = (256 * MIB / bytes).clamp(1, 20);
        for staged in [false, true] {
            let mut path = None;
            let mut us = time_per_call(&sb, rounds, calls, |s| {
                if staged {
                    copy_peer_staged(s, &src, &mut dst)
                } else {
                    path = Some(copy_peer(s, &src, &mut dst)?);
                    Ok(())
                }
            })?;
            let variant = if staged {
                "warpdrive-staged"
            } else {
                "warpdrive"
            };
            let row = ctx.record_bytes(
                "peer-copy",
                bytes as u64,
                variant,
                &mut us,
                bytes as f64,
                None,
            )?;
            row.extra.insert("peer_access".into(), peer.into());
            if let Some(path) = path {
                row.extra.insert("path".into(), format!("{path:?}").into());
            }
        }
    }
    Ok(())
}

/// Waits until every rank of the host group `sync` is here, so timed work starts together.
fn barrier(sync: &Comm, host: &Stream) -> Result<()> {
    let mut flag = Buffer::from_host(host, &[0.0f32])?;
    sync.all_reduce(host, &mut flag, ReduceOp::Max)
}

/// The largest of every rank's `us` over the host group `sync`: a round's time is its
/// slowest rank's.
fn slowest(sync: &Comm, host: &Stream, us: f64) -> Result<f64> {
    let mut t = Buffer::from_host(host, &[us as f32])?;
    sync.all_reduce(host, &mut t, ReduceOp::Max)?;
    Ok(f64::from(t.to_host(host)?[0]))
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
        let codec = ctx
            .rows()
            .iter()
            .find(|r| r.case == "int8-codec")
            .expect("the int8 codec's row");
        let ratio = codec.extra["ratio"].as_f64().unwrap();
        assert!((3.9..4.0).contains(&ratio), "{ratio}");
        // Top-k at 1%: 21 pairs of 8 bytes per 2048 f32 (8 KiB).
        let topk = ctx
            .rows()
            .iter()
            .find(|r| r.case == "topk-codec")
            .expect("the top-k codec's row");
        let ratio = topk.extra["ratio"].as_f64().unwrap();
        assert!((48.0..49.0).contains(&ratio), "{ratio}");
    }

    #[test]
    fn int8_compression_wins_only_on_links_slower_than_its_codec_and_below_2r_ranks() {
        // 2 ranks, 1 GiB, a 1 ms codec: (2/2 − 1/r)·1 GiB / 1 ms ≈ 0.746 × 1074 GB/s.
        let gbps = compressed_wins_below(GIB, int8_ratio(GIB), 2, 1000.0).unwrap();
        assert!((795.0..805.0).contains(&gbps), "{gbps}");
        assert_eq!(compressed_wins_below(GIB, int8_ratio(GIB), 1, 1000.0), None);
        assert_eq!(compressed_wins_below(GIB, int8_ratio(GIB), 8, 1000.0), None);
        assert!(compressed_wins_below(GIB, int8_ratio(GIB), 4, 1000.0).unwrap() < gbps * 2.0);
    }
}
