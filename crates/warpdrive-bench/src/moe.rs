//! The `moe` suite: one MoE layer forward pass (bf16, Softmax router, renormalized, seeded
//! random weights, inputs N(0,1)) per preset and token count.
//!
//! - case = preset name (`mixtral-8x7b`, `qwen3-30b-a3b`, `deepseek-v3-slice`,
//!   `gpt-oss-120b`), size = tokens (1, 4, 16, 64, 256, 1024, 4096 on CUDA). Variants
//!   `warpdrive` (`MoePath::Auto`: device-driven grouped GEMMs, in one CUDA graph up to 256
//!   tokens; above, eagerly, or the cuBLAS path where the experts' GEMMs are large, see
//!   `AUTO_CUBLAS_MIN_FLOPS`) and `warpdrive-cublas` (counts read back once, then cuBLAS: one grouped call
//!   per projection or one GEMM per expert, see `CUBLAS_GROUPED_MAX_FLOPS`; at every size);
//!   from 1024 tokens on CUDA also `warpdrive-device` (`MoePath::Device`, the grouped-GEMM
//!   kernels whatever Auto picks: the wgmma overlap kernels and the wide tile where the plan
//!   picks them), `warpdrive-device-drain` / `warpdrive-device-overlap` (the 64- and 96-row
//!   tiles with `MoeLayer::set_wgmma_overlap` forced off / on: every wgmma tile drains its
//!   MMAs each stage / keeps them in flight across stages) and `warpdrive-device-wide` (the
//!   same with `MoeLayer::set_wgmma_wide` forced on: 192-row wgmma tiles, one block per SM;
//!   these three keep the 256-weight-row tile off),
//!   `warpdrive-device-w256` (`MoeLayer::set_wgmma_w256` forced on both projections: 128
//!   token rows × 256 weight rows, one block per SM) and `warpdrive-device-fused-router`
//!   (`MoeLayer::set_prefill_router` forced off: the fused router kernel where the plan takes
//!   the prefill router);
//!   the peer adds `torch-hf-eager`, `torch-grouped-mm` and `triton-fused-moe` (a fused-MoE
//!   Triton kernel of the design serving engines ship, tiles from its own sweep per GPU, the
//!   layer in one CUDA graph). Median / p10 / p90
//!   in µs per forward over ≥ 200 passes. GB/s counts the bytes of the distinct experts the
//!   batch routes to plus the router weight (`extra.bytes`), so `pct_of_ceiling` (also in
//!   `extra.hbm_pct`) is against the device copy ceiling. `extra`: `host_syncs` and
//!   `launches` per layer, `graph`, `distinct_experts`, and `rel_err` = ‖y − ref‖₂ / ‖ref‖₂
//!   over the first token against the f64 reference with the same routing. On CUDA, rows of
//!   `warpdrive` up to 16 tokens also carry `read_floor_us`: the time of one streaming read
//!   of the same bytes (`ops::reduce_into` sum over memory that is not in L2) in the same
//!   run, and `pct_of_read_floor` = that / median · 100. Streaming a few tens of MB does not
//!   reach the copy ceiling (bench/NOTES.md, bench suites), so this is the floor a pass
//!   that only read its weights would hit.
//! - `router-permute` (size = tokens 1, 64, 256, 4096; the qwen3-30b-a3b shape): the router
//!   logits, softmax/top-k and the permutation (counts, offsets, order) alone, replayed as a
//!   captured graph as the layer runs them; from `PREFILL_ROUTER_MIN_TOKENS` also
//!   `warpdrive-fused-router` (the fused router kernel instead of the prefill router).
//!
//! - `weights-load` (size = bytes of the file): one mixtral-8x7b layer (2.8 GB of bf16
//!   experts at full scale) from a safetensors file in the page cache to a ready layer,
//!   against `transfer::upload` of the same bytes in the same run (see `weights_load`).
//!
//! On the CPU backend (`--quick`): hidden and intermediate divided by 8 (rounded up to a
//! multiple of 8), and the case says so (`mixtral-8x7b/8`; `extra.hidden`,
//! `extra.intermediate` give the shape), tokens 1, 16, 64, fewer passes.

use half::bf16;

use warpdrive::device::Stream;
use warpdrive::error::Result;
use warpdrive::exec::graph::Graph;
use warpdrive::memory::host_vec;
use warpdrive::memory::Buffer;
use warpdrive::moe::weights::random_bits;
use warpdrive::moe::{
    MoeConfig, MoeLayer, MoePath, MoeWeights, W256Rows, WgmmaW256, WgmmaWide,
    PREFILL_ROUTER_MIN_TOKENS, PRESETS,
};
use warpdrive::ops::{reduce_into, ReduceOp, Scratch, REDUCE_SCRATCH_BYTES};

use super::results::{Ceiling, Ceilings};
use super::stats::Stats;
use super::timing::time_gpu;
use super::{Ctx, Scale};

mod weights_load;

/// The suite name.
pub const SUITE: &str = "moe";

const SEED: u64 = 0x6d6f_6521;

struct Plan {
    tokens: &'static [usize],
    router_tokens: &'static [usize],
    /// Timed passes per row (at least).
    reps: usize,
    /// Fewer passes for rows whose pass is slower than this many µs (at least `min_reps`).
    budget_us: f64,
    min_reps: usize,
    shrink: usize,
}

impl Plan {
    fn new(scale: Scale) -> Plan {
        match scale {
            Scale::Full => Plan {
                tokens: &[1, 4, 16, 64, 256, 1024, 4096],
                router_tokens: &[1, 64, 256, 4096],
                reps: 200,
                budget_us: 3e6,
                min_reps: 200,
                shrink: 1,
            },
            Scale::Quick => Plan {
                tokens: &[1, 16, 64],
                router_tokens: &[1, 64],
                reps: 5,
                budget_us: 2e5,
                min_reps: 3,
                shrink: 8,
            },
            Scale::Tiny => Plan {
                tokens: &[1],
                router_tokens: &[1],
                reps: 2,
                budget_us: 1e5,
                min_reps: 2,
                shrink: 16,
            },
        }
    }

    /// The case of `preset`'s rows: `PRESET/8` where hidden and intermediate are divided by
    /// 8 (the CPU backend), so no row passes a shrunk layer off as the preset.
    fn case(&self, preset: &str) -> String {
        if self.shrink > 1 {
            format!("{preset}/{}", self.shrink)
        } else {
            preset.to_string()
        }
    }

    fn config(&self, preset: &str) -> Result<MoeConfig> {
        let mut c = MoeConfig::preset(preset)?;
        if self.shrink > 1 {
            c.hidden = (c.hidden / self.shrink).div_ceil(8) * 8;
            c.intermediate = (c.intermediate / self.shrink).div_ceil(8) * 8;
        }
        Ok(c)
    }
}

/// The suite's pass of `preset`'s layer over `tokens` tokens: its seeded random weights and
/// its N(0, 1) input (`warpdrive moe` runs the same pass, so its figures match the rows).
/// An input whose size overflows or exceeds the host's memory is `InvalidArgument`.
pub fn case(preset: &str, tokens: usize) -> Result<(MoeConfig, MoeWeights, Vec<bf16>)> {
    case_at(preset, tokens, Scale::Full)
}

/// [`case`] with the layer at `scale` as the suite shrinks it (hidden and intermediate
/// divided by 8 at `Quick`); [`case_name`] names it.
pub fn case_at(
    preset: &str,
    tokens: usize,
    scale: Scale,
) -> Result<(MoeConfig, MoeWeights, Vec<bf16>)> {
    let config = Plan::new(scale).config(preset)?;
    let what = format!("MoE input of {tokens} tokens × hidden {}", config.hidden);
    let n = warpdrive::size::product(&what, &[tokens, config.hidden])?;
    let x = normal_bf16(&what, SEED ^ tokens as u64, n)?;
    Ok((config, MoeWeights::Random { seed: SEED }, x))
}

/// The suite's case for `preset` at `scale`: the preset's name, or `PRESET/8` where its
/// hidden and intermediate sizes are divided by 8.
pub fn case_name(preset: &str, scale: Scale) -> String {
    Plan::new(scale).case(preset)
}

/// `n` bf16 values from N(0, 1): Box–Muller on pairs of words of the layer's counter-based
/// generator (`weights::random_bits`), the same function `bench/peers/moe.py` computes, so
/// the peers see these inputs; `what` names them in an error.
fn normal_bf16(what: &str, seed: u64, n: usize) -> Result<Vec<bf16>> {
    let mut out = host_vec(what, n)?;
    out.extend((0..n as u64).map(|j| bf16::from_f64(counter_normal(seed, j))));
    Ok(out)
}

/// Value `j` of [`normal_bf16`] before rounding: pair `j / 2`'s words give u1 in (0, 1] and
/// u2 in [0, 1) (53 bits each), value `j` is its cosine (even `j`) or sine (odd) part.
fn counter_normal(seed: u64, j: u64) -> f64 {
    const ULP: f64 = 1.0 / (1u64 << 53) as f64;
    let pair = j / 2 * 2;
    let u1 = ((random_bits(seed, pair) >> 11) + 1) as f64 * ULP;
    let u2 = (random_bits(seed, pair + 1) >> 11) as f64 * ULP;
    let (m, a) = ((-2.0 * u1.ln()).sqrt(), 2.0 * std::f64::consts::PI * u2);
    if j % 2 == 0 {
        m * a.cos()
    } else {
        m * a.sin()
    }
}

/// Median µs of one streaming read of `bytes` (a sum over bf16), rotating over three
/// buffers so that no pass finds its data in L2.
fn read_floor(stream: &Stream, bytes: usize, reps: usize) -> Result<f64> {
    let len = (bytes / 2).max(1);
    let bufs = (0..3)
        .map(|_| Buffer::<bf16>::zeros(stream, len))
        .collect::<Result<Vec<_>>>()?;
    let mut out = Buffer::<bf16>::zeros(stream, 1)?;
    let scratch = Scratch::new(stream, REDUCE_SCRATCH_BYTES)?;
    let mut next = 0;
    let mut us = time_gpu(stream, 3, reps, |s| {
        next = (next + 1) % bufs.len();
        reduce_into(s, ReduceOp::Sum, &bufs[next], &mut out, &scratch)
    })?;
    Ok(Stats::from_samples(&mut us)?.median)
}

pub(crate) fn run_suite(ctx: &mut Ctx) -> Result<()> {
    let plan = Plan::new(ctx.scale());
    for preset in PRESETS {
        preset_rows(ctx, &plan, preset)?;
    }
    router_permute(ctx, &plan)?;
    weights_load::weights_load(ctx, plan.config("mixtral-8x7b")?, plan.min_reps.min(5))
}

fn preset_rows(ctx: &mut Ctx, plan: &Plan, preset: &'static str) -> Result<()> {
    let config = plan.config(preset)?;
    let case = plan.case(preset);
    ctx.step(format!("{SUITE}: {case} (weights)"));
    let stream = ctx.stream().clone();
    let ceilings = ctx.ceilings().clone();
    let mut layer = MoeLayer::<bf16>::new(&stream, config, MoeWeights::Random { seed: SEED })?;
    for &tokens in plan.tokens {
        ctx.step(format!("{SUITE}: {case} tokens {tokens}"));
        let xh = normal_bf16("MoE input", SEED ^ tokens as u64, tokens * config.hidden)?;
        let x = Buffer::from_host(&stream, &xh)?;
        let mut y = Buffer::<bf16>::uninit(&stream, xh.len())?;
        let routing = layer.route(&x)?;
        let distinct = routing.distinct_experts();
        let bytes = distinct * config.expert_bytes()? + config.router_bytes()?;
        let k = config.top_k;
        let reference = layer.reference_token(
            &xh[..config.hidden],
            &routing.experts[..k],
            &routing.weights[..k],
        )?;
        // From 1024 tokens on CUDA the device kernels also run on their own (Auto may take
        // cuBLAS there), the wgmma variants side by side (issue 40).
        let kernels = tokens >= 1024 && stream.device().is_cuda();
        const W256_OFF: Option<WgmmaW256> = Some(WgmmaW256 {
            on: WgmmaWide::Neither,
            rows: W256Rows::Rows128,
        });
        let variants = [
            ("warpdrive", MoePath::Auto, None, None, None, None),
            ("warpdrive-cublas", MoePath::Cublas, None, None, None, None),
            ("warpdrive-device", MoePath::Device, None, None, None, None),
            (
                "warpdrive-device-drain",
                MoePath::Device,
                Some(false),
                Some(WgmmaWide::Neither),
                None,
                W256_OFF,
            ),
            (
                "warpdrive-device-overlap",
                MoePath::Device,
                Some(true),
                Some(WgmmaWide::Neither),
                None,
                W256_OFF,
            ),
            (
                "warpdrive-device-wide",
                MoePath::Device,
                None,
                Some(WgmmaWide::Both),
                None,
                W256_OFF,
            ),
            (
                "warpdrive-device-w256",
                MoePath::Device,
                None,
                None,
                None,
                Some(WgmmaW256::new(WgmmaWide::Both, W256Rows::Rows128)),
            ),
            (
                "warpdrive-device-fused-router",
                MoePath::Device,
                None,
                None,
                Some(false),
                None,
            ),
        ];
        for (variant, path, overlap, wide, prefill_router, w256) in variants {
            if path == MoePath::Device && !kernels {
                continue;
            }
            layer.set_path(path);
            layer.set_wgmma_overlap(overlap);
            layer.set_wgmma_wide(wide);
            layer.set_wgmma_w256(w256);
            layer.set_prefill_router(prefill_router);
            // Warm-up (captures the graph, loads kernels), then size the reps by one pass.
            layer.forward_into(&x, &mut y)?;
            let probe = time_gpu(&stream, 1, 1, |_| layer.forward_into(&x, &mut y))?;
            let per = probe.first().copied().unwrap_or(1.0).max(1.0);
            let reps = if per * plan.reps as f64 > plan.budget_us {
                ((plan.budget_us / per) as usize).max(plan.min_reps)
            } else {
                plan.reps
            };
            let mut us = time_gpu(&stream, 2, reps, |_| layer.forward_into(&x, &mut y))?;
            let stats = layer.last_stats();
            let got = y.to_host(&stream)?;
            let (mut num, mut den) = (0f64, 0f64);
            for (g, r) in got[..config.hidden].iter().zip(&reference) {
                num += (g.to_f64() - r).powi(2);
                den += r * r;
            }
            let rel_err = if den > 0.0 {
                (num / den).sqrt()
            } else {
                num.sqrt()
            };
            let row = ctx.record_bytes(
                &case,
                tokens as u64,
                variant,
                &mut us,
                bytes as f64,
                Some(Ceiling::D2dCopy),
            )?;
            let hbm = row.pct_of_ceiling;
            let extra = &mut row.extra;
            extra.insert("host_syncs".into(), stats.host_syncs.into());
            extra.insert("launches".into(), stats.launches.into());
            extra.insert("graph".into(), stats.graph.into());
            extra.insert("distinct_experts".into(), distinct.into());
            extra.insert("bytes".into(), bytes.into());
            extra.insert("rel_err".into(), rel_err.into());
            extra.insert("reps".into(), reps.into());
            if let Some(h) = hbm {
                extra.insert("hbm_pct".into(), h.into());
            }
            extra.insert("dtype".into(), "bf16".into());
            extra.insert("hidden".into(), config.hidden.into());
            extra.insert("intermediate".into(), config.intermediate.into());
            let floors = pass_floors(&config, tokens, bytes, &ceilings, row.median);
            row.extra.extend(floors);
            if variant == "warpdrive" && tokens <= 16 && stream.device().is_cuda() {
                let floor = read_floor(&stream, bytes, plan.min_reps.max(20))?;
                let median = row.median;
                row.extra.insert("read_floor_us".into(), floor.into());
                row.extra
                    .insert("pct_of_read_floor".into(), (100.0 * floor / median).into());
            }
        }
    }
    Ok(())
}

/// What no pass of `tokens` tokens beats, from the same run's ceilings (issue 40 sets its
/// targets against them): `flops` (both projections over every routed slot, and the router's
/// logits), this row's `tflops` and `pct_of_gemm_ceiling`; `dram_floor_us`, the `weight_bytes`
/// the batch routes to (`bytes`), the input read and the output written once, at the copy
/// ceiling; `dram_floor_slot_rows_us`, that plus each slot's down-projection row written and
/// read back once, as every pass that combines after the down GEMM moves them (ours and the
/// Triton peer's). Figures whose ceiling the run lacks are left out.
fn pass_floors(
    config: &MoeConfig,
    tokens: usize,
    weight_bytes: usize,
    ceilings: &Ceilings,
    median_us: f64,
) -> serde_json::Map<String, serde_json::Value> {
    let mut out = serde_json::Map::new();
    let (t, h, i) = (
        tokens as f64,
        config.hidden as f64,
        config.intermediate as f64,
    );
    let slots = t * config.top_k as f64;
    let elem = config.dtype.size() as f64;
    let flops = 6.0 * slots * h * i + 2.0 * t * config.experts as f64 * h;
    out.insert("flops".into(), flops.into());
    if median_us > 0.0 {
        let tflops = flops / median_us / 1e6;
        out.insert("tflops".into(), tflops.into());
        if let Some(c) = ceilings.get(Ceiling::GemmBf16).filter(|c| *c > 0.0) {
            out.insert("pct_of_gemm_ceiling".into(), (100.0 * tflops / c).into());
        }
    }
    if let Some(gbps) = ceilings.get(Ceiling::D2dCopy).filter(|c| *c > 0.0) {
        let io = 2.0 * t * h * elem;
        let floor = (weight_bytes as f64 + io) / gbps / 1e3;
        let rows = 2.0 * slots * h * elem / gbps / 1e3;
        out.insert("dram_floor_us".into(), floor.into());
        out.insert("dram_floor_slot_rows_us".into(), (floor + rows).into());
    }
    out
}

fn router_permute(ctx: &mut Ctx, plan: &Plan) -> Result<()> {
    const CASE: &str = "router-permute";
    let config = plan.config("qwen3-30b-a3b")?;
    let stream = ctx.stream().clone();
    let mut layer = MoeLayer::<bf16>::new(&stream, config, MoeWeights::Random { seed: SEED })?;
    for &tokens in plan.router_tokens {
        ctx.step(format!("{SUITE}: {CASE} tokens {tokens}"));
        let x = Buffer::from_host(
            &stream,
            &normal_bf16("MoE input", SEED ^ tokens as u64, tokens * config.hidden)?,
        )?;
        // From the prefill router's size, the fused router kernel beside it (issue 40).
        let prefill = tokens >= PREFILL_ROUTER_MIN_TOKENS;
        for (variant, choice) in [("warpdrive", None), ("warpdrive-fused-router", Some(false))] {
            if choice.is_some() && !prefill {
                continue;
            }
            layer.set_prefill_router(choice);
            // As the layer runs these stages: inside its graph (first pass eager: workspace
            // and kernels).
            layer.route_and_permute(&x)?;
            let mut graph = Graph::capture(&stream, |_| layer.route_and_permute(&x))?;
            graph.prepare()?;
            let mut us = time_gpu(&stream, 3, plan.reps.max(3), |_| graph.launch())?;
            drop(graph);
            let row = ctx.record_time(CASE, tokens as u64, variant, &mut us, None)?;
            row.extra
                .insert("preset".into(), plan.case("qwen3-30b-a3b").into());
            let stages = if prefill && choice.is_none() {
                "the prefill router: logits by cuBLAS, softmax/top-k/renormalize one warp per \
                 token, dispatch by a stable counting sort (3 kernels) and its tail (token rows, \
                 GEMM work list), as a graph"
            } else {
                "one router kernel: logits, softmax/top-k/renormalize and dispatch (counts, \
                 offsets, order, GEMM work list), as a graph"
            };
            row.extra.insert("stages".into(), stages.into());
        }
        layer.set_prefill_router(None);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_peers_inputs_are_these() {
        // bench/peers/moe.py recomputes the input for 16 tokens and pins the same values
        // (WD_PINNED_INPUT; f64 before rounding: the libm's last bit may differ).
        let want = [
            0.7074515805294876,
            -0.5279720798884339,
            0.5600406153330743,
            -1.1844142294926885,
            1.0448524129518435,
            0.8497358760943176,
        ];
        for (j, w) in want.iter().enumerate() {
            let got = counter_normal(SEED ^ 16, j as u64);
            assert!((got - w).abs() <= 1e-12, "value {j}: {got} against {w}");
        }
        let x = normal_bf16("input", SEED ^ 16, 7).unwrap();
        assert_eq!(x.len(), 7);
        assert_eq!(x[0], bf16::from_f64(want[0]));
    }
}
