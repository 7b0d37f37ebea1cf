//! `warpdrive moe`: one MoE layer pass, timed stage by stage and as `forward` runs it.

use std::time::Instant;

use anyhow::{bail, Context, Result};
use warpdrive::moe::{W256Rows, WeightsFile, WgmmaW256, WgmmaWide};
use warpdrive_bench::{self as bench, Scale};

use crate::flags::DeviceOpt;

/// Which kernels the layer may take (the CLI's switches).
pub(crate) struct Kernels {
    /// The staged tiles on Hopper's warpgroup MMA.
    pub(crate) wgmma: bool,
    /// One token on the decode kernel.
    pub(crate) decode: bool,
    /// The wgmma tiles' overlap kernels forced on or off; None: the plan's choice.
    pub(crate) overlap: Option<bool>,
    /// The projections whose wgmma tiles are forced onto the wide 192-row tile (the others
    /// off it); None: the plan's choice.
    pub(crate) wide: Option<WgmmaWide>,
    /// The wgmma tiles' warp-specialized TMA kernels forced on or off; None: the plan's choice.
    pub(crate) tma: Option<bool>,
    /// The 256-weight-row wgmma tile forced on some projections; None: never.
    pub(crate) w256: Option<WgmmaW256>,
    /// The grouped GEMMs' grid order forced (items fastest or item by item); None: the plan's.
    pub(crate) items_fastest: Option<bool>,
    /// The prefill router forced on or off; None: the plan's choice.
    pub(crate) prefill_router: Option<bool>,
}

pub(crate) fn moe(
    (preset, scale): (&str, Scale),
    tokens: usize,
    path: &str,
    reps: u32,
    kernels: Kernels,
    file: Option<WeightsFile>,
    device: &DeviceOpt,
) -> Result<()> {
    use warpdrive::moe::{MoeLayer, MoePath, MoeWeights};
    let path = match path {
        "auto" => MoePath::Auto,
        "device" => MoePath::Device,
        "cublas" => MoePath::Cublas,
        other => bail!("--path {other}: expected auto, device or cublas"),
    };
    // No tokens is no pass to time: refused rather than an empty profile.
    if tokens == 0 {
        bail!("--tokens 0: a pass needs at least one token");
    }
    let progress = bench::Progress::lines();
    let (config, mut weights, x) = bench::moe::case_at(preset, tokens, scale)?;
    let layer_name = bench::moe::case_name(preset, scale);
    let source = match file {
        Some(file) => {
            let source = file.path().display().to_string();
            weights = MoeWeights::File(file);
            source
        }
        None => "seeded weights".into(),
    };
    let device = device.open()?;
    let stream = device.new_stream()?;
    progress.step(format!(
        "loading the {layer_name} layer on {} ({source}, {:.2} GB)",
        device.label(),
        config.weight_bytes()? as f64 / 1e9
    ));
    let mut layer = MoeLayer::<half::bf16>::new(&stream, config, weights)
        .with_context(|| format!("loading the {layer_name} layer from {source}"))?;
    layer.set_path(path);
    let Kernels {
        wgmma,
        decode,
        overlap,
        wide,
        tma,
        w256,
        items_fastest,
        prefill_router,
    } = kernels;
    layer.set_warpgroup_mma(wgmma);
    layer.set_wgmma_overlap(overlap);
    layer.set_wgmma_wide(wide);
    layer.set_wgmma_tma(tma);
    layer.set_wgmma_w256(w256);
    layer.set_gemm_items_fastest(items_fastest);
    layer.set_prefill_router(prefill_router);
    layer.set_decode_kernel(decode);
    let x = warpdrive::Buffer::from_host(&stream, &x)?;
    let mut y = warpdrive::Buffer::<half::bf16>::uninit(&stream, x.len())?;
    progress.step("warm-up pass".into());
    layer.profile(&x, &mut y)?;
    progress.step("one pass timed stage by stage".into());
    let stages = layer.profile(&x, &mut y)?;
    let passes = if reps == 1 { "pass" } else { "passes" };
    progress.step(format!("{reps} {passes} as forward runs them"));
    layer.forward_into(&x, &mut y)?;
    stream.synchronize()?;
    let t = Instant::now();
    for _ in 0..reps {
        layer.forward_into(&x, &mut y)?;
    }
    stream.synchronize()?;
    let per_pass = t.elapsed().as_secs_f64() * 1e6 / f64::from(reps);
    let stats = layer.last_stats();
    println!(
        "{layer_name} (hidden {}, intermediate {}), {tokens} tokens on {} ({source}, {path:?}{}{}{}{}{}{}{}):",
        config.hidden,
        config.intermediate,
        device.label(),
        if wgmma { "" } else { ", no wgmma" },
        if decode { "" } else { ", no decode kernel" },
        match overlap {
            Some(true) => ", wgmma overlap",
            Some(false) => ", no wgmma overlap",
            None => "",
        },
        match wide {
            Some(WgmmaWide::Both) => ", wide wgmma tile",
            Some(WgmmaWide::GateUp) => ", wide wgmma tile on gate/up",
            Some(WgmmaWide::Down) => ", wide wgmma tile on down",
            Some(WgmmaWide::Neither) => ", no wide wgmma tile",
            None => "",
        },
        match w256 {
            Some(w) if w.on == WgmmaWide::Neither => ", no 256-weight-row wgmma tile".into(),
            Some(w) => format!(
                ", 256-weight-row wgmma tile on {} ({} token rows)",
                match w.on {
                    WgmmaWide::Both => "both",
                    WgmmaWide::GateUp => "gate/up",
                    WgmmaWide::Down => "down",
                    WgmmaWide::Neither => "neither",
                },
                match w.rows {
                    W256Rows::Rows96 => 96,
                    W256Rows::Rows128 => 128,
                },
            ),
            None => String::new(),
        },
        match items_fastest {
            Some(true) => ", GEMM items fastest",
            Some(false) => ", GEMM item by item",
            None => "",
        },
        match prefill_router {
            Some(true) => ", prefill router",
            Some(false) => ", fused router",
            None => "",
        }
    );
    for (name, us) in &stages {
        println!("  {name:<16} {us:>10.1} us");
    }
    let total: f64 = stages.iter().map(|(_, us)| us).sum();
    println!(
        "  {:<16} {total:>10.1} us (one eager pass, timed stage by stage)",
        "stages total"
    );
    println!(
        "  {:<16} {per_pass:>10.1} us per pass as forward runs it, {reps} back to back (graph: {}, host syncs: {}, launches: {})",
        "whole pass",
        stats.graph,
        stats.host_syncs,
        stats.launches
    );
    Ok(())
}
