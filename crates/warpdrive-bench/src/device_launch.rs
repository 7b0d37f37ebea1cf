//! The `device-launch` suite (issue 33): work launched from the device against the host.
//!
//! - `decision-to-start` (µs from a decision on the GPU to the start of the graph it
//!   launches, `%globaltimer` at both ends): `device-graph` (the kernel launches the graph
//!   itself, fire and forget; `extra.in_call_p50_us`: the launch call's share),
//!   `device-graph-tail` (as the tail launch of its graph),
//!   `device-kernel` (the kernel launches a kernel, no graph: the floor), `host-graph` (the host launched it in advance behind the deciding kernel: the
//!   stream's own gap), `host-round-trip` (the decision reaches the host through mapped
//!   memory, which then launches the graph). `extra.p99_us`.
//! - `dispatch` (size = requests a run): µs per decision of a [`Dispatcher`] run over 64
//!   targets that only stamp their start, `per-round-64` (requests cycling over the targets,
//!   64 launched at once each round) and `chained` (one a round: each target's last kernel
//!   launches the next as its tail); `extra.decisions_per_s`.
//! - `moe-dispatch-<preset>` (size = tokens, 1 … 256): µs per batch of the MoE layer, batches of
//!   one size in a queue: `warpdrive-dispatcher` (chained: the graph for each batch's size
//!   launched by the previous batch's last kernel, no host work per batch;
//!   `-fire-and-forget`: each batch a round of its own, launched by the dispatcher, which
//!   relaunches itself after it) against `host-graph` (the
//!   layer's own graph replayed by the host, as `MoeLayer::forward_into` does);
//!   `extra.ratio_to_host_graph`.

use std::cell::RefCell;
use std::rc::Rc;

use half::bf16;
use warpdrive::error::Result;
use warpdrive::exec::{DeviceLaunchProbe, Dispatcher, LaunchPath};
use warpdrive::memory::Buffer;
use warpdrive::moe::{MoeLayer, MoeWeights};

use super::stats::percentile;
use super::timing::time_host;
use super::{Ctx, Scale};

/// The suite name.
pub const SUITE: &str = "device-launch";

const PRESET: &str = "qwen3-30b-a3b";

pub(crate) fn run_suite(ctx: &mut Ctx) -> Result<()> {
    if !ctx.device().is_cuda() {
        // Launches from the device need a GPU; the CPU backend has no rows here.
        return Ok(());
    }
    latency(ctx)?;
    dispatch(ctx)?;
    moe(ctx)
}

fn latency(ctx: &mut Ctx) -> Result<()> {
    let n = if ctx.scale().quick() { 500 } else { 4000 };
    let stream = ctx.stream().clone();
    ctx.step(format!("{SUITE}: decision-to-start"));
    let mut probe = DeviceLaunchProbe::new(&stream, n + 1)?;
    for (variant, path) in [
        ("device-graph", LaunchPath::Device),
        ("device-graph-tail", LaunchPath::DeviceTail),
        ("device-kernel", LaunchPath::DeviceKernel),
        ("host-graph", LaunchPath::HostGraph),
        ("host-round-trip", LaunchPath::HostRoundTrip),
    ] {
        // A warm-up measurement first (uploads, first launches).
        probe.measure(path, 16)?;
        let times = probe.measure(path, n)?;
        let mut us: Vec<f64> = times.to_start.iter().map(|&v| v as f64 / 1e3).collect();
        let p99 = percentile(&us, 0.99);
        let row = ctx.record_time("decision-to-start", 0, variant, &mut us, None)?;
        row.extra.insert("p99_us".into(), p99.into());
        if !times.in_call.is_empty() {
            // The launch call's share: the rest is the device scheduling the work.
            let call: Vec<f64> = times.in_call.iter().map(|&v| v as f64 / 1e3).collect();
            row.extra
                .insert("in_call_p50_us".into(), percentile(&call, 0.5).into());
        }
    }
    Ok(())
}

fn dispatch(ctx: &mut Ctx) -> Result<()> {
    let n: usize = if ctx.scale().quick() { 1024 } else { 8192 };
    let reps = if ctx.scale().quick() { 5 } else { 20 };
    let stream = ctx.stream().clone();
    for per_round in [64usize, 1] {
        ctx.step(format!("{SUITE}: dispatch per round {per_round}"));
        let mut d = Dispatcher::new(&stream, n, per_round)?;
        for b in 0..64u32 {
            d.add_target(b, |_| Ok(()))?;
        }
        let requests: Vec<u32> = (0..n as u32).map(|i| i % 64).collect();
        d.run(&requests)?;
        let mut us = time_host(1, reps, || {
            d.start(&requests)?;
            stream.synchronize()
        })?;
        let report = d.finish(&requests)?;
        us.iter_mut().for_each(|u| *u /= n as f64);
        let variant = match per_round {
            1 => "chained".to_string(),
            n => format!("per-round-{n}"),
        };
        let row = ctx.record_time("dispatch", n as u64, &variant, &mut us, None)?;
        let per_s = 1e6 / row.median;
        row.extra.insert("decisions_per_s".into(), per_s.into());
        row.extra.insert("rounds".into(), report.rounds.into());
    }
    Ok(())
}

fn moe(ctx: &mut Ctx) -> Result<()> {
    let stream = ctx.stream().clone();
    let (config, _, _) = super::moe::case_at(PRESET, 1, ctx.scale())?;
    let sizes: &[usize] = if ctx.scale() == Scale::Tiny {
        &[1, 2, 4]
    } else {
        &[1, 2, 4, 8, 16, 32, 64, 128, 256]
    };
    let batches = if ctx.scale().quick() { 10 } else { 40 };
    let case = format!("moe-dispatch-{PRESET}");
    ctx.step(format!("{SUITE}: {case}"));
    let layer = Rc::new(RefCell::new(MoeLayer::<bf16>::new(
        &stream,
        config,
        MoeWeights::Random { seed: 7 },
    )?));
    // One input/output pair per size, shared by both paths.
    let mut pairs = Vec::new();
    for &t in sizes {
        let (_, _, x) = super::moe::case_at(PRESET, t, ctx.scale())?;
        let x = Rc::new(Buffer::from_host(&stream, &x)?);
        let y = Rc::new(RefCell::new(Buffer::<bf16>::zeros(&stream, x.len())?));
        pairs.push((t, x, y));
    }
    // Host graphs: the layer's own graph per size (captured on its second pass).
    let mut host_us = Vec::new();
    for (_, x, y) in &pairs {
        let mut l = layer.borrow_mut();
        l.forward_into(x, &mut y.borrow_mut())?;
        let mut us = time_host(2, batches, || {
            l.forward_into(x, &mut y.borrow_mut())?;
            stream.synchronize()
        })?;
        host_us.push(std::mem::take(&mut us));
    }
    // The dispatcher: one target per size, each the layer's kernels for that size captured
    // (the layer's own graphs off, so the capture holds its kernels, not a graph of them).
    layer.borrow_mut().set_graphs(false);
    // Chained (one batch a round), and fire-and-forget rounds of one batch (per_round 2 with
    // every batch the same size: each round holds one).
    let mut chained = Dispatcher::new(&stream, batches, 1)?;
    let mut forget = Dispatcher::new(&stream, batches, 2)?;
    for (t, x, y) in &pairs {
        for d in [&mut chained, &mut forget] {
            layer.borrow_mut().forward_into(x, &mut y.borrow_mut())?;
            let target = |d: &mut Dispatcher<'_>| {
                let (l, x, y) = (layer.clone(), x.clone(), y.clone());
                d.add_target(*t as u32, move |_| {
                    l.borrow_mut().forward_into(&x, &mut y.borrow_mut())
                })
            };
            if let Err(e) = target(d) {
                // The one-token decode kernel is a cooperative launch, which a graph launched
                // from the device may not hold: that size takes the layer's separate kernels.
                eprintln!(
                    "device-launch: MoE at {t} tokens: {e}; retrying without the decode kernel"
                );
                layer.borrow_mut().set_decode_kernel(false);
                layer.borrow_mut().forward_into(x, &mut y.borrow_mut())?;
                target(d)?;
                layer.borrow_mut().set_decode_kernel(true);
            }
        }
    }
    for (i, (t, _, _)) in pairs.iter().enumerate() {
        let requests = vec![*t as u32; batches];
        let host = &mut host_us[i];
        let host_median = ctx
            .record_time(&case, *t as u64, "host-graph", host, None)?
            .median;
        for (variant, d) in [
            ("warpdrive-dispatcher", &mut chained),
            ("warpdrive-dispatcher-fire-and-forget", &mut forget),
        ] {
            d.run(&requests)?;
            let mut us = time_host(1, 5, || {
                d.start(&requests)?;
                stream.synchronize()
            })?;
            us.iter_mut().for_each(|u| *u /= batches as f64);
            let row = ctx.record_time(&case, *t as u64, variant, &mut us, None)?;
            let ratio = row.median / host_median;
            row.extra.insert("ratio_to_host_graph".into(), ratio.into());
        }
    }
    Ok(())
}
