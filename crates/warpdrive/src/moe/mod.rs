//! The Mixture-of-Experts layer: `y = Σ_r w_r · W2_e(silu(W1_e·x) ⊙ W3_e·x)` over the `top_k`
//! experts `e` the router picks for each token.
//!
//! On CUDA (bf16 or f16) the forward pass is four to six kernels and no host
//! synchronization: the router kernel (logits by blocks that split K across their warps, so
//! no cross-block fix-up; the last block of each row tile routes its tokens, softmax top-k
//! over up to 256 experts, and the last routed tile dispatches: tokens per expert, offsets,
//! permutation and a GEMM work list, all on the device; on Hopper, up to 64 tokens over at
//! most 128 experts, a row tile's blocks form a thread-block cluster and hand their logits to
//! the first block through shared memory instead; the DeepSeek-style grouped sigmoid
//! router and wider layers route and dispatch in two more kernels); the gate/up projection as a grouped GEMM over the permuted tokens with SwiGLU
//! fused into its epilogue; the down projection as a second grouped GEMM that scales each row
//! by its routing weight; and the combine back to token order. The grouped GEMM
//! (`kernels/moe.cu`) reads the per-expert counts from device memory, so for up to
//! [`GRAPH_MAX_TOKENS`] tokens the whole layer is captured once per token count (and
//! input/output buffer pair) as a CUDA graph and replayed. Above that, the default path runs
//! the same kernels eagerly, or, where each expert's GEMMs are large
//! ([`AUTO_CUBLAS_MIN_FLOPS`]; [`MoeLayer::uses_cublas`]), reads the counts back once and
//! runs the experts through cuBLAS: one grouped call per projection for many small experts,
//! one GEMM per expert for large ones ([`CUBLAS_GROUPED_MAX_FLOPS`]; [`MoePath::Cublas`]
//! forces that path at every size for comparison). On Hopper the staged tiles run on the
//! warpgroup MMA (`wgmma`) from the same shared-memory stages and take over from the decode
//! tiles at 2 rows per expert ([`MoeLayer::set_warpgroup_mma`]).
//!
//! One token over experts that would run on the decode tile (every expert one row; on
//! Hopper only shallow ones, intermediate below 1024) takes one kernel instead
//! (`moe_decode_*`, [`MoeLayer::set_decode_kernel`]): its warps compute the router logits,
//! every block routes the token itself, then the warps stream the chosen experts' gate/up
//! rows and down rows straight from global memory, the phases meeting at grid counters
//! (a cooperative launch) instead of kernel boundaries. In the `moe` suite on the H200 (µs,
//! separate kernels → decode kernel): qwen3 38.2 → 33.2, deepseek-slice 40.5 → 38.6.
//!
//! On Hopper the grouped GEMMs and the combine are programmatic dependent launches: each
//! starts while the kernel before it finishes and waits (`griddepcontrol.wait`) before it
//! touches that kernel's results; when the experts a pass likely touches fit in half the L2,
//! the down projection prefetches its weights into L2 meanwhile.
//!
//! On the CPU backend the same layer computes in f32/f64 on the host (the reference).
//!
//! The permuted order of tokens within an expert may differ between runs (the dispatch
//! places them with atomics), but each output row depends only on its own token, so the
//! layer's output is deterministic.

pub mod weights;

pub use weights::{HostWeights, MoeWeights, WeightsFile};

use std::ffi::c_void;

use crate::device::hostmem::{host_filled, host_vec};
use crate::device::{cpu, GemmCall, LaunchMode, Stream};
use crate::dtype::{DType, DTypeKind, Float};
use crate::error::{Error, Result};
use crate::exec::graph::Graph;
use crate::kernels::{Arch, MOE};
use crate::memory::Buffer;
use crate::ops::{self, Route};
use crate::size;

/// The most tokens whose forward pass runs as a captured CUDA graph with no host sync.
pub const GRAPH_MAX_TOKENS: usize = 256;
/// The cuBLAS path runs each projection as one `cublasGemmGroupedBatchedEx` call when the
/// average routed expert's gate/up GEMM does fewer FLOPs than this, else one `cublasGemmEx`
/// per expert. Measured on the H200 (forward µs, per-expert calls → grouped): qwen3 at 4096
/// tokens 2161 → 1486 (1.6 GFLOP per expert), deepseek 4096 3196 → 2315 (0.9), gpt-oss 1024
/// 1326 → 1098 (1.1); but gpt-oss 4096 2119 → 3402 (4.2) and mixtral 1024 1360 → 3028 (60):
/// the grouped kernels lose to cuBLAS's per-shape choice once each GEMM is large.
pub const CUBLAS_GROUPED_MAX_FLOPS: f64 = 2.5e9;
/// Above [`GRAPH_MAX_TOKENS`] tokens, [`MoePath::Auto`] runs the experts through cuBLAS when
/// the average expert's gate/up GEMM (its expected share of the routed rows) does more FLOPs
/// than this, else the device kernels (eagerly, still without a host sync). Forward µs on the
/// H200, device (wgmma) vs cuBLAS: mixtral 512 1241 vs 993 (30 GFLOP per expert), 1024 1936
/// vs 1429 (60); but qwen3 1024 425 vs 558 (0.4), 4096 1184 vs 1497 (1.6), gpt-oss 1024 1614
/// vs 1841 (1.1), 4096 3302 vs 3386 (4.2), deepseek 1024 1011 vs 1078 (0.2), 4096 2552 vs
/// 2478 (0.9).
pub const AUTO_CUBLAS_MIN_FLOPS: f64 = 8e9;

/// [`MoePath::Auto`]'s choice of the cuBLAS path for `tokens` tokens.
fn auto_takes_cublas(c: &MoeConfig, tokens: usize) -> bool {
    // Saturating: only a comparison reads it, and any count a pass can hold is exact.
    let slots = tokens.saturating_mul(c.top_k);
    let rows = slots as f64 / c.experts.min(slots).max(1) as f64;
    tokens > GRAPH_MAX_TOKENS
        && 2.0 * rows * (2 * c.intermediate) as f64 * c.hidden as f64 > AUTO_CUBLAS_MIN_FLOPS
}

/// The least intermediate size at which one routed row per expert takes the staged wgmma
/// tile (see `m_tiles`).
const WGMMA_ONE_ROW_MIN_INTERMEDIATE: usize = 1024;

/// Graphs kept per layer (least recently used dropped first).
const GRAPH_CACHE: usize = 32;
/// Threads of the dispatch kernel (its `__launch_bounds__(1024)`).
const DISPATCH_BLOCK: u32 = 1024;
/// Threads of the grouped GEMM (8 warps).
const GEMM_BLOCK: u32 = 256;

/// Columns per block of the router kernels (`moe_router_*`: one n8 group, K split over
/// 16 warps).
const ROUTER_BN: usize = 8;
/// Threads of the router kernels (16 warps).
const ROUTER_BLOCK: u32 = 512;
/// The least K per split of the router kernel (two 32-wide steps per warp).
const ROUTER_MIN_DEPTH: usize = 1024;
/// The most K splits of the router kernel (`MOE_ROUTER_MAX_SPLITS`: the routing block
/// loads every split of a row at once).
const ROUTER_MAX_SPLITS: usize = 8;
/// The most experts the router kernel routes itself (softmax top-k by one warp per row).
const ROUTER_ROUTES_MAX: usize = 256;
/// Experts per block of the clustered router (`MOE_CLUSTER_BN`: two n8 groups).
const ROUTER_CLUSTER_BN: usize = 16;
/// The most experts the clustered router takes (`MOE_CLUSTER_MAX_EXPERTS`: a row tile's
/// logits in one block's shared memory, at most 8 blocks per cluster).
const ROUTER_CLUSTER_MAX_EXPERTS: usize = 128;
/// The most slots (16 tokens × top_k) of the clustered router's one row tile
/// (`MOE_CLUSTER_MAX_SLOTS`: its choices in shared memory for the dispatch).
const ROUTER_CLUSTER_MAX_SLOTS: usize = 256;

/// Whether the router kernel also routes and dispatches (Softmax over at most
/// [`ROUTER_ROUTES_MAX`] experts) instead of leaving logits to separate kernels.
fn fused_route(c: &MoeConfig) -> bool {
    c.router == Router::Softmax && c.experts <= ROUTER_ROUTES_MAX
}

/// Columns per block of the grouped GEMM (as the kernels are instantiated in `moe.cu`: 8
/// warps × 2 n8 groups for m1 / m2, `MOE_SBN` for the staged prefill tile m4).
const GEMM_BN: usize = 128;
/// Dynamic shared memory of the grouped GEMM for `mt` m16 tiles: the staged prefill tiles (m4,
/// m6) keep 4 stages of 16·mt × 64 A and [`GEMM_BN`] × 64 W (bf16 / f16), on `wgmma` from a
/// 1024-byte boundary (1 KB more to find it); m1 / m2 none.
fn gemm_shared_bytes(mt: usize, wgmma: bool) -> u32 {
    if mt >= 4 {
        (4 * (16 * mt + GEMM_BN) * 64 * 2 + if wgmma { 1024 } else { 0 }) as u32
    } else {
        0
    }
}
/// Threads of the decode kernel (`MOE_DEC_WARPS` warps).
const DECODE_BLOCK: u32 = 256;
/// Blocks of the decode kernel per SM at most (its registers allow two; the launch takes as
/// many as fit).
const DECODE_BLOCKS_PER_SM: usize = 2;
/// K segments per gate row of the decode kernel's router at most (`MOE_DEC_MAX_SEGS`).
const DECODE_MAX_SEGS: usize = 16;
/// The most top-k the decode kernel routes (`MOE_DEC_MAX_K`).
const DECODE_MAX_K: usize = 32;
/// A bound on the decode kernel's static shared memory (its logits and routing).
const DECODE_STATIC_SHARED: usize = 2048;

/// Warps (tokens) per block of the grouped sigmoid router.
const ROUTER_WARPS: u32 = 4;

/// How tokens choose experts.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Router {
    /// Softmax over the experts' logits (plus `gate.bias` when present), top-k; with
    /// `renormalize` the k weights are divided by their sum (Mixtral).
    Softmax,
    /// DeepSeek-V3: sigmoid scores; experts are selected by score + `gate.bias` among the best
    /// `topk_group` of `n_group` equal groups of experts (a group's score is the sum of its
    /// two best); the weights are the chosen scores without bias, renormalized when asked,
    /// times `routed_scaling`.
    SigmoidGrouped {
        n_group: usize,
        topk_group: usize,
        routed_scaling: f32,
    },
}

/// The shape of a layer.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MoeConfig {
    pub hidden: usize,
    pub intermediate: usize,
    pub experts: usize,
    pub top_k: usize,
    /// Element type of activations and weights: bf16 or f16 on CUDA; f32 too on the CPU.
    pub dtype: DTypeKind,
    pub router: Router,
    pub renormalize: bool,
}

/// The presets `MoeConfig::preset` knows (all with the Softmax router, renormalized, bf16).
pub const PRESETS: [&str; 4] = [
    "mixtral-8x7b",
    "qwen3-30b-a3b",
    "deepseek-v3-slice",
    "gpt-oss-120b",
];

impl MoeConfig {
    /// A named shape: `mixtral-8x7b` (4096, 14336, 8 experts, top-2), `qwen3-30b-a3b` (2048,
    /// 768, 128, top-8), `deepseek-v3-slice` (7168, 256, 256, top-8), `gpt-oss-120b` (2880,
    /// 2880, 128, top-4).
    pub fn preset(name: &str) -> Result<MoeConfig> {
        let (hidden, intermediate, experts, top_k) = match name {
            "mixtral-8x7b" => (4096, 14336, 8, 2),
            "qwen3-30b-a3b" => (2048, 768, 128, 8),
            "deepseek-v3-slice" => (7168, 256, 256, 8),
            "gpt-oss-120b" => (2880, 2880, 128, 4),
            other => {
                return Err(Error::InvalidArgument(format!(
                    "unknown MoE preset `{other}`; known: {}",
                    PRESETS.join(", ")
                )))
            }
        };
        Ok(MoeConfig {
            hidden,
            intermediate,
            experts,
            top_k,
            dtype: DTypeKind::BF16,
            router: Router::Softmax,
            renormalize: true,
        })
    }

    /// Fails with `InvalidArgument` on a shape the layer cannot run.
    pub fn validate(&self) -> Result<()> {
        let bad = |m: String| Err(Error::InvalidArgument(format!("MoE config: {m}")));
        if self.hidden == 0 || self.intermediate == 0 || self.experts == 0 {
            return bad(format!(
                "hidden {}, intermediate {}, experts {}: all must be positive",
                self.hidden, self.intermediate, self.experts
            ));
        }
        if self.experts > ops::MAX_BINS {
            return bad(format!(
                "{} experts, at most {}",
                self.experts,
                ops::MAX_BINS
            ));
        }
        if self.top_k == 0 || self.top_k > self.experts || self.top_k > ops::MAX_K {
            return bad(format!(
                "top_k = {} with {} experts: must be 1..={}",
                self.top_k,
                self.experts,
                self.experts.min(ops::MAX_K)
            ));
        }
        if !matches!(
            self.dtype,
            DTypeKind::F32 | DTypeKind::F16 | DTypeKind::BF16
        ) {
            return bad(format!("dtype {} (f32, f16 or bf16)", self.dtype.name()));
        }
        if let Router::SigmoidGrouped {
            n_group,
            topk_group,
            routed_scaling,
        } = self.router
        {
            if n_group == 0 || n_group > 32 || self.experts % n_group != 0 {
                return bad(format!(
                    "n_group = {n_group}: must be 1..=32 and divide {} experts",
                    self.experts
                ));
            }
            if topk_group == 0 || topk_group > n_group {
                return bad(format!("topk_group = {topk_group} of {n_group} groups"));
            }
            if self.top_k > topk_group * (self.experts / n_group) {
                return bad(format!(
                    "top_k = {} exceeds the {} experts of the {topk_group} kept groups",
                    self.top_k,
                    topk_group * (self.experts / n_group)
                ));
            }
            if !routed_scaling.is_finite() {
                return bad(format!("routed_scaling = {routed_scaling}"));
            }
        }
        // Every size the layer derives from the shape alone is bounded by these.
        self.expert_bytes()?;
        self.router_bytes()?;
        self.weight_bytes()?;
        Ok(())
    }

    /// Bytes of one expert's three matrices (`InvalidArgument` where that overflows `usize`;
    /// never where [`MoeConfig::validate`] passed).
    pub fn expert_bytes(&self) -> Result<usize> {
        size::product(
            "MoE config: one expert's bytes (3 × hidden × intermediate × dtype)",
            &[3, self.hidden, self.intermediate, self.dtype.size()],
        )
    }

    /// Bytes of the router's weight (`InvalidArgument` as [`MoeConfig::expert_bytes`]).
    pub fn router_bytes(&self) -> Result<usize> {
        size::product(
            "MoE config: router bytes (experts × hidden × dtype)",
            &[self.experts, self.hidden, self.dtype.size()],
        )
    }

    /// Bytes of every weight as a layer keeps them on its device: the router [E, H], w1 and
    /// w3 interleaved [E, 2·I, H] with I rounded up to a multiple of 8, and w2 [E, H, I]
    /// (without the optional router bias; `InvalidArgument` as [`MoeConfig::expert_bytes`]).
    pub fn weight_bytes(&self) -> Result<usize> {
        let what = "MoE config: weight bytes (experts × hidden × (1 + 2·pad8(intermediate) \
                    + intermediate) × dtype)";
        let (h, i, e) = (self.hidden, self.intermediate, self.experts);
        let gate = size::product(what, &[e, h])?;
        let w13 = size::product(what, &[e, 2, i.div_ceil(8), 8, h])?;
        let w2 = size::product(what, &[e, h, i])?;
        let elements = size::sum(what, size::sum(what, gate, w13)?, w2)?;
        size::product(what, &[elements, self.dtype.size()])
    }
}

/// Which implementation a CUDA forward pass takes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum MoePath {
    /// The device-driven grouped GEMMs (graphs up to [`GRAPH_MAX_TOKENS`] tokens); above,
    /// cuBLAS where the experts' GEMMs are large ([`AUTO_CUBLAS_MIN_FLOPS`]).
    #[default]
    Auto,
    /// The device-driven grouped GEMMs at every size (graphs up to [`GRAPH_MAX_TOKENS`]).
    Device,
    /// Counts read back once, then cuBLAS (grouped or per expert, see
    /// [`CUBLAS_GROUPED_MAX_FLOPS`]), at every size.
    Cublas,
}

/// The experts and weights the router chose, slot `t·k + r` for token `t`'s `r`-th expert.
#[derive(Debug, Clone, PartialEq)]
pub struct Routing {
    pub experts: Vec<u32>,
    pub weights: Vec<f32>,
}

impl Routing {
    /// How many distinct experts the batch uses.
    pub fn distinct_experts(&self) -> usize {
        let mut seen: Vec<u32> = self.experts.clone();
        seen.sort_unstable();
        seen.dedup();
        seen.len()
    }
}

/// What the last forward pass cost the host.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ForwardStats {
    /// Times the host waited for the device.
    pub host_syncs: u32,
    /// Kernel and graph launches (a graph replay counts once).
    pub launches: u32,
    /// True when the pass replayed a captured graph.
    pub graph: bool,
}

/// One grouped GEMM's launch shape.
#[derive(Debug, Clone, Copy)]
struct GemmShape {
    n: usize,
    k: usize,
    mt: usize,
    /// Columns per block of the kernel that runs it.
    bn: usize,
    items: usize,
    splits: usize,
    k_split: usize,
    /// Blocks take the tiles n block by n block, the work items fastest (`items_fastest` of
    /// `MoeGemm`), instead of item by item.
    items_fastest: bool,
    /// A prefill tile (mt 4 or 6) on the warpgroup-MMA kernel (`moe_gemm_wgmma`).
    wgmma: bool,
}

impl GemmShape {
    fn new(
        n: usize,
        k: usize,
        (mt, bn): (usize, usize),
        (items, busy): (usize, usize),
        min_depth: usize,
        sms: usize,
    ) -> Self {
        let n_blocks = n.div_ceil(bn);
        // The work list holds `busy` experts' first tiles plus one per further full tile of
        // rows: from twice as many items, most experts take several tiles that stream the
        // same weights, so those run side by side and all but the first read from L2 (on
        // the H200, mixtral 256 tokens 2003 → 1802 µs per forward; item by item stays faster
        // where most experts take one tile: qwen3 64 tokens 253.6 vs 262.2).
        let items_fastest = items >= 2 * busy;
        // At most one wave of blocks (two per SM) over the tiles likely to be busy, each
        // split at least `min_depth` deep, so that a few experts still stream their weights
        // at full bandwidth without paying for more split-K fix-ups than the bandwidth needs
        // (rounding up left a few blocks to a second wave: 288 blocks for 264 places).
        let busy = (busy * n_blocks).max(1);
        let places = 2 * sms.max(1);
        let max_splits = (k / min_depth.max(32)).clamp(1, GEMM_MAX_SPLITS);
        let mut splits = (places / busy).clamp(1, max_splits);
        // Tiles that fill more than a wave but leave the last one mostly idle (384 tiles in
        // 2 × 264 places) are split until the waves come out nearly full.
        let fill = |s: usize| {
            let blocks = busy * s;
            blocks as f64 / (blocks.div_ceil(places) * places) as f64
        };
        if busy >= places && fill(1) < 0.8 {
            if let Some(s) = (2..=max_splits).find(|&s| fill(s) >= 0.9) {
                splits = s;
            }
        }
        let k_split = k.div_ceil(splits).div_ceil(32) * 32;
        GemmShape {
            n,
            k,
            mt,
            bn,
            items,
            splits: k.div_ceil(k_split).max(1),
            k_split,
            items_fastest,
            wgmma: false,
        }
    }
    fn n_blocks(&self) -> usize {
        self.n.div_ceil(self.bn)
    }
    fn tiles(&self) -> usize {
        self.items * self.n_blocks()
    }
    fn grid(&self) -> usize {
        self.tiles() * self.splits
    }
    fn partial_len(&self, rows: usize) -> usize {
        if self.splits > 1 {
            self.splits * rows * self.n
        } else {
            0
        }
    }
}

/// The router kernel's launch shape: row tiles of `tile_rows` (at most 16·mt) tokens ×
/// column blocks of [`ROUTER_BN`] experts × `splits` K ranges of `k_split`.
#[derive(Debug, Clone, Copy)]
struct RouterShape {
    /// The clustered router (`moe_router_cluster_*`): each row tile's `col_blocks` blocks
    /// (16 experts each, the whole K) form one thread-block cluster.
    cluster: bool,
    mt: usize,
    tile_rows: usize,
    row_tiles: usize,
    col_blocks: usize,
    splits: usize,
    k_split: usize,
}

impl RouterShape {
    /// `clusters`: the device runs thread-block clusters (compute capability 9.0).
    fn new(c: &MoeConfig, tokens: usize, sms: usize, clusters: bool) -> Self {
        // Small tiles while tokens are few (more blocks streaming the gate), larger ones
        // reuse each gate fragment over more rows.
        let mt = match tokens {
            0..=64 => 1,
            65..=256 => 2,
            _ => 4,
        };
        // Up to 64 tokens over at most 128 experts, a cluster per row tile passes the logits
        // through shared memory instead of L2 and a ticket (on the H200, the qwen3 router
        // and dispatch at 1 / 64 tokens: 9.4 / 11.4 → 8.0 / 9.7 µs per graph replay).
        let cluster = clusters
            && mt == 1
            && fused_route(c)
            && c.experts <= ROUTER_CLUSTER_MAX_EXPERTS
            && 16 * c.top_k <= ROUTER_CLUSTER_MAX_SLOTS;
        let col_blocks = c.experts.div_ceil(if cluster {
            ROUTER_CLUSTER_BN
        } else {
            ROUTER_BN
        });
        // A tile's last block routes its rows one per warp: above one tile, half tiles
        // spread that over twice the SMs while the grid still fits one wave.
        let tile_rows = if tokens > 16 * mt && tokens.div_ceil(8 * mt) * col_blocks <= sms {
            8 * mt
        } else {
            16 * mt
        };
        let row_tiles = tokens.div_ceil(tile_rows).max(1);
        // Split K (only where the kernel routes, and so sums the splits itself) while every
        // block still has an SM of its own (one wave), each split at least
        // ROUTER_MIN_DEPTH deep.
        let splits = if fused_route(c) && !cluster {
            (sms / (row_tiles * col_blocks))
                .min(c.hidden / ROUTER_MIN_DEPTH)
                .clamp(1, ROUTER_MAX_SPLITS)
        } else {
            1
        };
        let k_split = c.hidden.div_ceil(splits).div_ceil(32) * 32;
        RouterShape {
            cluster,
            mt,
            tile_rows,
            row_tiles,
            col_blocks,
            splits: c.hidden.div_ceil(k_split).max(1),
            k_split,
        }
    }
}

/// The one-token decode kernel's launch shape (`moe_decode_*`: router, routing, both expert
/// projections and the combine in one kernel whose warps stream their weight rows and meet
/// at grid counters).
#[derive(Debug, Clone, Copy)]
struct DecodeShape {
    /// K segments per gate row (router tasks = experts × segments, about one per warp).
    router_segs: usize,
    /// Bytes of the down rows the warps prefetch into L2 while the gate/up units finish.
    prefetch_bytes: usize,
    sms: usize,
}

impl DecodeShape {
    /// The shape for `tokens` tokens, or None where the decode kernel does not apply: more
    /// than one token, one routed row per expert that the staged wgmma tile takes (deep
    /// experts on Hopper: there the split kernels were faster — gpt-oss 66.0 vs 70.9 µs,
    /// mixtral 175 vs 213 on the H200 — where the decode kernel's warps, each summing whole
    /// rows of a few KB, keep too few bytes in flight), a router the kernel does not run (it
    /// routes by Softmax over at most [`ROUTER_ROUTES_MAX`] experts), top-k above
    /// [`DECODE_MAX_K`], or x and the k act rows (f32) beyond a block's shared memory.
    fn new(c: &MoeConfig, tokens: usize, gpu: Gpu) -> Option<Self> {
        if !gpu.decode
            || tokens != 1
            || m_tiles(1, gpu.wgmma, c.intermediate) != 1
            || !fused_route(c)
            || c.top_k > DECODE_MAX_K
        {
            return None;
        }
        let shared = Self::shared_bytes(c) + DECODE_STATIC_SHARED;
        if shared > gpu.shared_per_block {
            return None;
        }
        let warps = gpu.sms * DECODE_BLOCKS_PER_SM * (DECODE_BLOCK as usize / 32);
        // About one task per warp, each at least one 16-byte chunk per lane (qwen3's router
        // at one row per warp, 8 loads per lane, took 3.1 µs; in 8 segments 2.0).
        let router_segs = (warps / c.experts)
            .min(c.hidden / (8 * 32))
            .clamp(1, DECODE_MAX_SEGS);
        Some(DecodeShape {
            router_segs,
            prefetch_bytes: gpu.l2_bytes / 2,
            sms: gpu.sms,
        })
    }
    /// Dynamic shared memory: x and the k act rows (f32). Saturating: it is only compared
    /// with the block's limit.
    fn shared_bytes(c: &MoeConfig) -> usize {
        c.top_k
            .saturating_mul(c.intermediate)
            .saturating_add(c.hidden)
            .saturating_mul(4)
    }
}

/// What the launch shapes depend on in the device (read once per layer).
#[derive(Debug, Clone, Copy)]
struct Gpu {
    sms: usize,
    l2_bytes: usize,
    /// Thread-block clusters (compute capability 9.0 and later).
    clusters: bool,
    /// The most shared memory a block may use (bytes, opted in).
    shared_per_block: usize,
    /// The staged tiles run on Hopper's warpgroup MMA (the MoE kernels are built for
    /// sm_90a there), unless [`MoeLayer::set_warpgroup_mma`] turned it off.
    wgmma: bool,
    /// One-token passes may take the decode kernel, unless
    /// [`MoeLayer::set_decode_kernel`] turned it off.
    decode: bool,
}

impl Gpu {
    fn of(stream: &Stream) -> Result<Gpu> {
        Ok(match stream.cuda() {
            Some((d, _)) => Gpu {
                sms: d.sm_count() as usize,
                l2_bytes: d.l2_cache_bytes()?,
                clusters: d.compute_capability().0 >= 9,
                shared_per_block: d.shared_per_block_optin()?,
                wgmma: MOE.arch_for(d.arch()).is_ok_and(|a| a == Arch::SM_90A),
                decode: true,
            },
            None => Gpu {
                sms: 1,
                l2_bytes: 0,
                clusters: false,
                shared_per_block: 0,
                wgmma: false,
                decode: false,
            },
        })
    }
}

/// The launch shapes of a forward pass over `tokens` tokens on the device path.
#[derive(Debug, Clone, Copy)]
struct Plan {
    tokens: usize,
    slots: usize,
    /// Rows per expert tile of the dispatch's work list (16 · gate.mt).
    bm: usize,
    router: RouterShape,
    up: GemmShape,
    down: GemmShape,
    /// The down projection's blocks prefetch the first `down_early_k` k of their weights
    /// into L2 while the gate/up GEMM finishes (0: none): all of them when the experts the
    /// pass likely touches fit in half the L2; while one wave of blocks covers the pass, the
    /// share of each block's slice that fits in half the L2 together (more would be evicted
    /// before use and read twice); otherwise none (later waves start after the wait).
    down_early_k: usize,
    /// One token on the decode kernel instead of the router, GEMM and combine kernels.
    decode: Option<DecodeShape>,
}

/// m16 tiles per block for groups of `rows` rows on average: the busiest groups hold
/// about twice the average, and each extra tile of a group streams its weights again (above
/// 32 rows on average the 96-row tile holds most groups whole — mixtral at 256 tokens puts
/// 54–72 rows on each expert — where 64-row tiles left tail tiles: on the H200, 1058 → 773 µs
/// per forward).
///
/// With `wgmma` the staged 64-row tile (its MMAs cover only the live rows, its 4-stage ring
/// keeps more weight bytes in flight than the decode tiles' register fragments) replaces
/// the decode and middle tiles from 2 rows per expert, and at 1 row where the experts'
/// `intermediate` depth keeps the ring busy. Forward µs on the H200, decode / middle tile →
/// staged: qwen3 256 tokens (16 rows) 388 → 329, deepseek 256 (8) 916 → 789, gpt-oss 256
/// (8) 1852 → 1519, mixtral 64 (16) 815 → 683, gpt-oss 64 (2) 1386 → 1277, mixtral 8 (2) 473
/// → 439; at 1 row mixtral (14336) 195 → 180.5, gpt-oss 16 tokens (2880) 649 → 601, but
/// deepseek (256) 38.8 → 42.0 and qwen3 (768) 35.6 → 36.1.
fn m_tiles(rows: usize, wgmma: bool, intermediate: usize) -> usize {
    match rows {
        0..=1 if wgmma && intermediate >= WGMMA_ONE_ROW_MIN_INTERMEDIATE => 4,
        0..=1 => 1,
        2..=32 if wgmma => 4,
        2..=6 => 1,
        7..=16 => 2,
        17..=32 => 4,
        _ => 6,
    }
}

impl Plan {
    fn new(c: &MoeConfig, tokens: usize, gpu: Gpu) -> Plan {
        let Gpu {
            sms,
            l2_bytes,
            clusters,
            shared_per_block,
            wgmma,
            ..
        } = gpu;
        let slots = tokens * c.top_k;
        let active = c.experts.min(slots).max(1);
        let mut mt = m_tiles(slots.div_ceil(active), wgmma, c.intermediate);
        // A prefill tile whose stages do not fit the device's shared memory (before compute
        // capability 9.0 many GPUs allow about 100 KB per block) gives way to a smaller one.
        while mt >= 4 && gemm_shared_bytes(mt, wgmma) as usize > shared_per_block {
            mt = if mt > 4 { 4 } else { 2 };
        }
        let wgmma = wgmma && mt >= 4;
        let bm = 16 * mt;
        let items = active + slots / bm;
        let down = GemmShape {
            wgmma,
            ..GemmShape::new(
                c.hidden,
                c.intermediate,
                (mt, GEMM_BN),
                (items, active),
                256,
                sms,
            )
        };
        Plan {
            tokens,
            slots,
            bm,
            router: RouterShape::new(c, tokens, sms, clusters),
            decode: DecodeShape::new(c, tokens, gpu),
            down_early_k: down_prefetch(c, &down, active, l2_bytes, sms),
            up: GemmShape {
                wgmma,
                ..GemmShape::new(
                    2 * c.intermediate,
                    c.hidden,
                    (mt, GEMM_BN),
                    (items, active),
                    256,
                    sms,
                )
            },
            down,
        }
    }
    fn partial_len(&self) -> usize {
        self.up
            .partial_len(self.slots)
            .max(self.down.partial_len(self.slots))
    }
    /// Logits of the router (one set per K split).
    fn logits_len(&self, c: &MoeConfig) -> usize {
        (self.router.splits * self.tokens * c.experts)
            .max(self.decode.map_or(0, |d| d.router_segs * c.experts))
    }
    fn tickets_len(&self) -> usize {
        // The router: one per row tile and one for the dispatch; the decode kernel: 3.
        (self.router.row_tiles + 1)
            .max(3)
            .max(self.up.tiles())
            .max(self.down.tiles())
    }
}

/// [`Plan::down_early_k`] of the down projection `down` for a pass that likely touches
/// `active` experts.
fn down_prefetch(
    c: &MoeConfig,
    down: &GemmShape,
    active: usize,
    l2_bytes: usize,
    sms: usize,
) -> usize {
    let budget = l2_bytes / 2;
    let dtype = c.dtype.size();
    if active * c.hidden * c.intermediate * dtype <= budget {
        return down.k_split;
    }
    let blocks = (active * down.n_blocks() * down.splits).max(1);
    if blocks > 2 * sms {
        return 0;
    }
    // Whole 128-byte lines of each of the block's rows.
    let per_row = budget / blocks / (down.bn * dtype);
    let line = 128 / dtype;
    (per_row / line * line).min(down.k_split)
}

/// The most K splits a grouped GEMM takes (see `GemmShape::new`).
const GEMM_MAX_SPLITS: usize = 64;

/// Fails with `InvalidArgument` unless every size a pass over `tokens` tokens derives (plans,
/// workspace, the CPU backend's f64 rows) fits `usize`: each is at most slots × the widest
/// row (hidden, 2 × padded intermediate, or experts) × [`GEMM_MAX_SPLITS`] elements of at
/// most 8 bytes. Passes past that bound could never be allocated anyway.
fn check_pass(c: &MoeConfig, tokens: usize) -> Result<()> {
    let widest = c.hidden.max(2 * inter_pad(c.intermediate)).max(c.experts);
    size::product(
        format_args!("MoE pass of {tokens} tokens (tokens × top_k × widest row × splits × 8)"),
        &[tokens, c.top_k, widest, GEMM_MAX_SPLITS, 8],
    )
    .map(|_| ())
}

/// Device memory of the forward passes, sized for `tokens` tokens (graphs of smaller
/// counts share it, since they replay one at a time on the layer's stream).
struct Workspace<T: Float> {
    tokens: usize,
    logits: Buffer<f32>,
    weights: Buffer<f32>,
    experts: Buffer<u32>,
    counts: Buffer<u32>,
    offsets: Buffer<u32>,
    order: Buffer<u32>,
    token_of: Buffer<u32>,
    slot_pos: Buffer<u32>,
    work: Buffer<u32>,
    n_items: Buffer<u32>,
    tickets: Buffer<u32>,
    partial: Buffer<f32>,
    act: Buffer<T>,
    /// Device path: the weighted down projection per permuted row (f32).
    y: Buffer<f32>,
    /// cuBLAS path: gathered inputs, gate/up output, down output (T).
    cublas: Option<[Buffer<T>; 3]>,
    /// cuBLAS path: the device pointer arrays of its two grouped GEMMs (6 words per expert).
    gemm_pointers: Option<Buffer<u64>>,
}

impl<T: Float> Workspace<T> {
    fn new(
        stream: &Stream,
        c: &MoeConfig,
        tokens: usize,
        plans: &[Plan],
        cublas: bool,
    ) -> Result<Self> {
        // Every length below is within `check_pass(c, tokens)`, which `prepare` checked.
        let slots = tokens * c.top_k;
        let max = |f: &dyn Fn(&Plan) -> usize| plans.iter().map(f).max().unwrap_or(0).max(1);
        // Zero once: each GEMM's last block per tile resets its ticket.
        let tickets = Buffer::zeros(stream, max(&|p| p.tickets_len()))?;
        let items = max(&|p| p.up.items);
        Ok(Workspace {
            tokens,
            logits: Buffer::uninit(stream, max(&|p| p.logits_len(c)))?,
            weights: Buffer::uninit(stream, slots)?,
            experts: Buffer::uninit(stream, slots)?,
            counts: Buffer::uninit(stream, c.experts)?,
            offsets: Buffer::uninit(stream, c.experts + 1)?,
            order: Buffer::uninit(stream, slots)?,
            token_of: Buffer::uninit(stream, slots)?,
            slot_pos: Buffer::uninit(stream, slots)?,
            work: Buffer::uninit(stream, 2 * items)?,
            n_items: Buffer::uninit(stream, 1)?,
            tickets,
            partial: Buffer::uninit(stream, max(&|p| p.partial_len()))?,
            // The decode kernel keeps k act rows in f32 there.
            act: Buffer::uninit(
                stream,
                (slots * c.intermediate)
                    .max((4 * c.top_k * c.intermediate).div_ceil(std::mem::size_of::<T>())),
            )?,
            y: Buffer::uninit(stream, slots * c.hidden)?,
            cublas: if cublas {
                Some([
                    Buffer::uninit(stream, slots * c.hidden)?,
                    Buffer::uninit(stream, slots * 2 * c.intermediate)?,
                    Buffer::uninit(stream, slots * c.hidden)?,
                ])
            } else {
                None
            },
            gemm_pointers: if cublas {
                Some(Buffer::uninit(stream, 6 * c.experts)?)
            } else {
                None
            },
        })
    }
}

type GraphKey = (usize, u64, u64);

/// A Mixture-of-Experts layer on one stream.
pub struct MoeLayer<T: Float> {
    // Declaration order is drop order: the graphs go before the workspace they point into.
    graphs: Vec<(GraphKey, Graph<'static, ()>)>,
    ws: Option<Workspace<T>>,
    stream: Stream,
    config: MoeConfig,
    gate: Buffer<T>,
    gate_bias: Option<Buffer<f32>>,
    /// w1 and w3 interleaved in blocks of 8 rows: [E, 2I, H].
    w13: Buffer<T>,
    w2: Buffer<T>,
    path: MoePath,
    use_graphs: bool,
    /// The staged tiles may take the warpgroup-MMA kernels (where `gpu.wgmma`).
    warpgroup_mma: bool,
    /// One-token passes may take the decode kernel (where `gpu.decode`).
    decode_kernel: bool,
    last: ForwardStats,
    gpu: Gpu,
}

impl<T: Float> std::fmt::Debug for MoeLayer<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MoeLayer")
            .field("config", &self.config)
            .field("path", &self.path)
            .field("graphs", &self.graphs.len())
            .finish()
    }
}

/// Raw addresses and sizes of one forward pass (what a captured graph bakes in).
#[derive(Clone, Copy)]
struct Pass {
    plan: Plan,
    x: u64,
    y: u64,
}

impl<T: Float> MoeLayer<T> {
    /// A layer on `stream`'s device with `weights`. Errors: an invalid config, `T` not the
    /// config's dtype, weights of the wrong shape (naming the tensor), or (CUDA) a dtype or
    /// shape the device kernels do not take: f32 runs on the CPU backend only, and hidden and
    /// intermediate must be multiples of 8 (16-byte rows). Weights larger than the device's
    /// total memory ([`MoeConfig::weight_bytes`]; the host's on the CPU backend) are
    /// `OutOfMemory` before anything is read or allocated.
    pub fn new(stream: &Stream, config: MoeConfig, weights: MoeWeights) -> Result<Self> {
        config.validate()?;
        let bytes = config.weight_bytes()?;
        let (_, total) = stream.device().mem_info()?;
        if total > 0 && bytes > total {
            return Err(Error::OutOfMemory {
                requested: bytes,
                detail: format!(
                    "MoE weights ({} experts × hidden {} × intermediate {} of {}) exceed the \
                     device's total {total} bytes",
                    config.experts,
                    config.hidden,
                    config.intermediate,
                    config.dtype.name()
                ),
            });
        }
        if T::KIND != config.dtype {
            return Err(Error::InvalidArgument(format!(
                "MoE layer of {} with a config of {}",
                T::KIND.name(),
                config.dtype.name()
            )));
        }
        if stream.cuda().is_some() {
            if !matches!(T::KIND, DTypeKind::BF16 | DTypeKind::F16) {
                return Err(Error::Unsupported(format!(
                    "MoE layer on CUDA takes bf16 or f16, not {} (f32 runs on the CPU backend)",
                    T::KIND.name()
                )));
            }
            if config.hidden % 8 != 0 || config.intermediate % 8 != 0 {
                return Err(Error::InvalidArgument(format!(
                    "MoE layer on CUDA: hidden {} and intermediate {} must be multiples of 8 \
                     (16-byte rows)",
                    config.hidden, config.intermediate
                )));
            }
        }
        let (h, i, e) = (config.hidden, config.intermediate, config.experts);
        let (gate, gate_bias, w13, w2) = match weights {
            MoeWeights::Random { seed } => (
                random_buffer(stream, e * h, seed ^ weights::SEED_GATE, h)?,
                None,
                random_buffer(
                    stream,
                    e * 2 * inter_pad(i) * h,
                    seed ^ weights::SEED_W13,
                    h,
                )?,
                random_buffer(stream, e * h * i, seed ^ weights::SEED_W2, i)?,
            ),
            MoeWeights::File(file) => upload_weights(stream, &config, &file.load(&config)?)?,
            MoeWeights::Host(w) => {
                w.check(&config)?;
                upload_weights(stream, &config, &w)?
            }
        };
        Ok(MoeLayer {
            graphs: Vec::new(),
            ws: None,
            stream: stream.clone(),
            config,
            gate,
            gate_bias,
            w13,
            w2,
            path: MoePath::Auto,
            use_graphs: true,
            warpgroup_mma: true,
            decode_kernel: true,
            last: ForwardStats::default(),
            gpu: Gpu::of(stream)?,
        })
    }

    pub fn config(&self) -> &MoeConfig {
        &self.config
    }

    pub fn stream(&self) -> &Stream {
        &self.stream
    }

    /// Chooses the CUDA implementation (ignored on the CPU backend).
    pub fn set_path(&mut self, path: MoePath) {
        self.path = path;
    }

    /// Turns graph capture and replay on (the default) or off (every pass eager).
    pub fn set_graphs(&mut self, on: bool) {
        self.use_graphs = on;
    }

    /// Lets the staged tiles run on Hopper's warpgroup MMA (`wgmma`, the default where the
    /// GPU has it; they then also take batches from 2 rows per expert, or 1 with deep experts,
    /// from the decode tiles) or keeps every tile on the `mma.sync` kernels other GPUs run.
    /// Drops the captured graphs.
    pub fn set_warpgroup_mma(&mut self, on: bool) {
        if on != self.warpgroup_mma {
            self.warpgroup_mma = on;
            self.graphs.clear();
        }
    }

    /// Lets one-token passes run on the decode kernel (the default where the config allows
    /// it: a Softmax router over at most 256 experts, top-k at most 32) or keeps them on the
    /// router, grouped GEMM and combine kernels of larger batches. Drops the captured
    /// graphs.
    pub fn set_decode_kernel(&mut self, on: bool) {
        if on != self.decode_kernel {
            self.decode_kernel = on;
            self.graphs.clear();
        }
    }

    /// What the last forward pass cost the host.
    pub fn last_stats(&self) -> ForwardStats {
        self.last
    }

    /// The weights as f32 on the host, in `nn.Linear` layout (w1 and w3 separate).
    pub fn host_weights(&self) -> Result<HostWeights> {
        let s = &self.stream;
        let widen = |b: &Buffer<T>| -> Result<Vec<f32>> {
            Ok(b.to_host(s)?.iter().map(|v| v.to_f64() as f32).collect())
        };
        let (h, i, e) = (
            self.config.hidden,
            self.config.intermediate,
            self.config.experts,
        );
        let w13 = widen(&self.w13)?;
        let mut w1 = host_filled("MoE host weights (w1)", e * i * h, 0f32)?;
        let mut w3 = host_filled("MoE host weights (w3)", e * i * h, 0f32)?;
        for (row, src) in w13.chunks_exact(h).enumerate() {
            let (is_w3, e, r) = weights::w13_source(row, inter_pad(i));
            if r >= i {
                continue; // padding
            }
            let dst = if is_w3 { &mut w3 } else { &mut w1 };
            dst[(e * i + r) * h..(e * i + r + 1) * h].copy_from_slice(src);
        }
        Ok(HostWeights {
            gate: widen(&self.gate)?,
            gate_bias: self.gate_bias.as_ref().map(|b| b.to_host(s)).transpose()?,
            w1,
            w3,
            w2: widen(&self.w2)?,
        })
    }

    /// The rows of `x`, as tokens of a pass whose sizes fit (`check_pass`).
    fn tokens_of(&self, x: &Buffer<T>) -> Result<usize> {
        x.check_stream(&self.stream, "MoE forward")?;
        let tokens = ops::rows_of("MoE forward", x.len(), self.config.hidden)?;
        check_pass(&self.config, tokens)?;
        Ok(tokens)
    }

    /// `y = layer(x)` for `x` and `y` of [tokens, hidden]. Up to [`GRAPH_MAX_TOKENS`]
    /// tokens on CUDA, the first pass with a given (tokens, x, y) runs eagerly and captures a
    /// graph; later ones replay it. Errors: `x` not whole rows, `y` not the same length,
    /// buffers on another device.
    pub fn forward_into(&mut self, x: &Buffer<T>, y: &mut Buffer<T>) -> Result<()> {
        let tokens = self.tokens_of(x)?;
        y.check_stream(&self.stream, "MoE forward")?;
        crate::memory::check_len("MoE forward (output)", y.len(), x.len())?;
        self.last = ForwardStats::default();
        if tokens == 0 {
            return Ok(());
        }
        if self.stream.cuda().is_none() {
            return self.forward_host(x, y);
        }
        if self.uses_cublas(tokens) {
            return self.forward_cublas(tokens, x.device_ptr(), y.device_ptr(), &mut |_| Ok(()));
        }
        if self.use_graphs && tokens <= GRAPH_MAX_TOKENS {
            return self.forward_graph(tokens, x.device_ptr(), y.device_ptr());
        }
        let pass = self.prepare(tokens, false)?;
        let launches = self.enqueue_device(&pass_with(pass, x, y), &mut |_| Ok(()))?;
        self.last.launches = launches;
        Ok(())
    }

    /// Whether a CUDA pass over `tokens` takes the cuBLAS path: always with
    /// [`MoePath::Cublas`], never with [`MoePath::Device`]; with [`MoePath::Auto`] above
    /// [`GRAPH_MAX_TOKENS`] tokens when the experts' GEMMs are large
    /// ([`AUTO_CUBLAS_MIN_FLOPS`]).
    pub fn uses_cublas(&self, tokens: usize) -> bool {
        match self.path {
            MoePath::Cublas => true,
            MoePath::Device => false,
            MoePath::Auto => auto_takes_cublas(&self.config, tokens),
        }
    }

    /// [`forward_into`](Self::forward_into) into a new buffer.
    pub fn forward(&mut self, x: &Buffer<T>) -> Result<Buffer<T>> {
        let mut y = Buffer::uninit(&self.stream, x.len())?;
        self.forward_into(x, &mut y)?;
        Ok(y)
    }

    /// Runs one eager forward pass and returns the time of each stage in µs (CUDA events
    /// between stages; the host clock on the CPU backend, as one stage).
    pub fn profile(&mut self, x: &Buffer<T>, y: &mut Buffer<T>) -> Result<Vec<(String, f64)>> {
        let tokens = self.tokens_of(x)?;
        crate::memory::check_len("MoE forward (output)", y.len(), x.len())?;
        if tokens == 0 {
            return Ok(Vec::new());
        }
        if self.stream.cuda().is_none() {
            let t0 = std::time::Instant::now();
            self.forward_host(x, y)?;
            return Ok(vec![(
                "forward".to_string(),
                t0.elapsed().as_secs_f64() * 1e6,
            )]);
        }
        let dev = self.stream.device().clone();
        let stream = self.stream.clone();
        let mut marks: Vec<(&'static str, crate::device::Event)> = Vec::new();
        let start = dev.new_event()?;
        stream.record(&start)?;
        let mut mark = |name: &'static str| -> Result<()> {
            let e = dev.new_event()?;
            stream.record(&e)?;
            marks.push((name, e));
            Ok(())
        };
        if self.uses_cublas(tokens) {
            self.forward_cublas(tokens, x.device_ptr(), y.device_ptr(), &mut mark)?;
        } else {
            let pass = self.prepare(tokens, false)?;
            self.enqueue_device(&pass_with(pass, x, y), &mut mark)?;
        }
        let mut out = Vec::with_capacity(marks.len());
        let mut prev = &start;
        for (name, e) in &marks {
            out.push((name.to_string(), prev.elapsed_ms(e)? as f64 * 1e3));
            prev = e;
        }
        Ok(out)
    }

    /// The router's choice for each token of `x` (computed as the forward pass does, by the
    /// router kernels; a one-token pass on the decode kernel sums the logits in another
    /// order, so a near-tie may go the other way there).
    pub fn route(&mut self, x: &Buffer<T>) -> Result<Routing> {
        let tokens = self.tokens_of(x)?;
        if tokens == 0 {
            return Ok(Routing {
                experts: Vec::new(),
                weights: Vec::new(),
            });
        }
        let k = self.config.top_k;
        if self.stream.cuda().is_none() {
            let (weights, experts) = self.route_host(x, tokens)?;
            return Ok(Routing { experts, weights });
        }
        let pass = self.prepare(tokens, false)?;
        let pass = Pass {
            plan: pass,
            x: x.device_ptr(),
            y: 0,
        };
        self.enqueue_router(&pass)?;
        let ws = self.workspace()?;
        // Only this pass's slots: the rest of the workspace was never written.
        let slots = crate::size::product("MoE routing", &[tokens, k])?;
        Ok(Routing {
            experts: ws.experts.prefix_to_host(&self.stream, slots)?,
            weights: ws.weights.prefix_to_host(&self.stream, slots)?,
        })
    }

    /// Runs the router and the permutation (dispatch) stages alone, without the experts
    /// (device path on CUDA, no host sync; the host router on the CPU backend). For
    /// benchmarks and profiling of those stages.
    pub fn route_and_permute(&mut self, x: &Buffer<T>) -> Result<()> {
        let tokens = self.tokens_of(x)?;
        if tokens == 0 {
            return Ok(());
        }
        if self.stream.cuda().is_none() {
            self.route_host(x, tokens)?;
            return Ok(());
        }
        let plan = self.prepare(tokens, false)?;
        let pass = Pass {
            plan,
            x: x.device_ptr(),
            y: 0,
        };
        self.launcher()?
            .front(&self.stream, &pass, &mut |_| Ok(()))
            .map(|_| ())
    }

    /// One token through the layer in f64 with the given routing (its `top_k` experts and
    /// weights), reading the weights the layer holds: the reference the forward pass is
    /// checked against. The expert activations are not rounded.
    pub fn reference_token(&self, x: &[T], experts: &[u32], weights: &[f32]) -> Result<Vec<f64>> {
        let c = &self.config;
        let (h, i) = (c.hidden, c.intermediate);
        crate::memory::check_len("MoE reference (token)", x.len(), h)?;
        crate::memory::check_len("MoE reference (weights)", weights.len(), experts.len())?;
        let wide = 2 * inter_pad(i);
        let x: Vec<f64> = x.iter().map(|v| v.to_f64()).collect();
        let mut out = vec![0f64; h];
        for (&e, &wr) in experts.iter().zip(weights) {
            let e = e as usize;
            if e >= c.experts {
                return Err(Error::InvalidArgument(format!(
                    "MoE reference: expert {e} of {}",
                    c.experts
                )));
            }
            let w13 = self.slice_to_host(&self.w13, e * wide * h, wide * h)?;
            let w2 = self.slice_to_host(&self.w2, e * h * i, h * i)?;
            let dot = |row: &[T]| -> f64 { row.iter().zip(&x).map(|(a, b)| a.to_f64() * b).sum() };
            let act: Vec<f64> = (0..i)
                .map(|col| {
                    let base = (col / 8) * 16 + col % 8;
                    let g = dot(&w13[base * h..(base + 1) * h]);
                    let u = dot(&w13[(base + 8) * h..(base + 9) * h]);
                    g / (1.0 + (-g).exp()) * u
                })
                .collect();
            for (o, dst) in out.iter_mut().enumerate() {
                let row = &w2[o * i..(o + 1) * i];
                let v: f64 = row.iter().zip(&act).map(|(a, b)| a.to_f64() * b).sum();
                *dst += wr as f64 * v;
            }
        }
        Ok(out)
    }

    /// `len` elements of `buf` from `offset`, on the host.
    fn slice_to_host(&self, buf: &Buffer<T>, offset: usize, len: usize) -> Result<Vec<T>> {
        if offset.checked_add(len).is_none_or(|end| end > buf.len()) {
            return Err(Error::InvalidArgument(format!(
                "MoE weight slice {offset}..+{len} of {} elements",
                buf.len()
            )));
        }
        let s = &self.stream;
        let Some((d, cs)) = s.cuda() else {
            return Ok(buf.host_view()?[offset..offset + len].to_vec());
        };
        let tmp = Buffer::<T>::uninit(s, len)?;
        let size = std::mem::size_of::<T>();
        d.copy_d2d(
            cs,
            tmp.device_ptr(),
            buf.device_ptr() + (offset * size) as u64,
            len * size,
        )?;
        tmp.to_host(s)
    }

    // ---- the device path ----

    /// The device as the plans see it (wgmma only where allowed).
    fn plan_gpu(&self) -> Gpu {
        Gpu {
            wgmma: self.gpu.wgmma && self.warpgroup_mma,
            decode: self.gpu.decode && self.decode_kernel,
            ..self.gpu
        }
    }

    fn workspace(&self) -> Result<&Workspace<T>> {
        self.ws
            .as_ref()
            .ok_or_else(|| Error::InvalidArgument("MoE workspace missing".into()))
    }

    /// The plan for `tokens`, with a workspace large enough (reallocated, dropping every
    /// graph, when it is not).
    fn prepare(&mut self, tokens: usize, cublas: bool) -> Result<Plan> {
        let plan = Plan::new(&self.config, tokens, self.plan_gpu());
        let fits = self.ws.as_ref().is_some_and(|w| {
            w.tokens >= tokens
                && (!cublas || w.cublas.is_some())
                && w.partial.len() >= plan.partial_len()
                && w.logits.len() >= plan.logits_len(&self.config)
                && w.tickets.len() >= plan.tickets_len()
                && w.work.len() >= 2 * plan.up.items
        });
        if !fits {
            // Graph-sized passes share one workspace sized for all of them.
            let cap = if tokens <= GRAPH_MAX_TOKENS {
                GRAPH_MAX_TOKENS
            } else {
                tokens
            };
            let cap = cap.max(self.ws.as_ref().map_or(0, |w| w.tokens));
            check_pass(&self.config, cap)?;
            let mut plans: Vec<Plan> = (1..=cap.min(GRAPH_MAX_TOKENS))
                .map(|t| Plan::new(&self.config, t, self.plan_gpu()))
                .collect();
            plans.push(plan);
            plans.push(Plan::new(&self.config, cap, self.plan_gpu()));
            let keep_cublas = self.ws.as_ref().is_some_and(|w| w.cublas.is_some());
            self.graphs.clear();
            self.ws = None;
            self.ws = Some(Workspace::new(
                &self.stream,
                &self.config,
                cap,
                &plans,
                cublas || keep_cublas,
            )?);
        }
        Ok(plan)
    }

    fn forward_graph(&mut self, tokens: usize, x: u64, y: u64) -> Result<()> {
        let key = (tokens, x, y);
        if let Some(at) = self.graphs.iter().position(|(k, _)| *k == key) {
            let entry = self.graphs.remove(at);
            self.graphs.push(entry);
            if let Some((_, g)) = self.graphs.last_mut() {
                g.launch()?;
            }
            self.last = ForwardStats {
                host_syncs: 0,
                launches: 1,
                graph: true,
            };
            return Ok(());
        }
        // First pass at this key: run eagerly (loads every kernel, checks the pass), then
        // capture the same launches.
        let plan = self.prepare(tokens, false)?;
        let pass = Pass { plan, x, y };
        let launches = self.enqueue_device(&pass, &mut |_| Ok(()))?;
        let launcher = self.launcher()?;
        let graph = Graph::capture(&self.stream, move |s| launcher.enqueue(s, &pass))?;
        graph.upload()?;
        if self.graphs.len() >= GRAPH_CACHE {
            self.graphs.remove(0);
        }
        self.graphs.push((key, graph));
        self.last = ForwardStats {
            host_syncs: 0,
            launches,
            graph: false,
        };
        Ok(())
    }

    /// Everything a device pass needs, as plain addresses (`Copy`, owned by a graph's body).
    fn launcher(&self) -> Result<Launcher> {
        let ws = self.workspace()?;
        Ok(Launcher {
            config: self.config,
            dtype: T::KIND,
            gate: self.gate.device_ptr(),
            gate_bias: self.gate_bias.as_ref().map_or(0, |b| b.device_ptr()),
            w13: self.w13.device_ptr(),
            w2: self.w2.device_ptr(),
            logits: ws.logits.device_ptr(),
            weights: ws.weights.device_ptr(),
            experts: ws.experts.device_ptr(),
            counts: ws.counts.device_ptr(),
            offsets: ws.offsets.device_ptr(),
            order: ws.order.device_ptr(),
            token_of: ws.token_of.device_ptr(),
            slot_pos: ws.slot_pos.device_ptr(),
            work: ws.work.device_ptr(),
            n_items: ws.n_items.device_ptr(),
            tickets: ws.tickets.device_ptr(),
            partial: ws.partial.device_ptr(),
            act: ws.act.device_ptr(),
            y_rows: ws.y.device_ptr(),
        })
    }

    fn enqueue_device(
        &self,
        pass: &Pass,
        mark: &mut dyn FnMut(&'static str) -> Result<()>,
    ) -> Result<u32> {
        self.launcher()?.enqueue_marked(&self.stream, pass, mark)
    }

    fn enqueue_router(&self, pass: &Pass) -> Result<()> {
        let l = self.launcher()?;
        l.router(&self.stream, pass)?;
        if !fused_route(&self.config) {
            l.route(&self.stream, pass)?;
        }
        Ok(())
    }

    // ---- the cuBLAS path ----

    fn forward_cublas(
        &mut self,
        tokens: usize,
        x: u64,
        y: u64,
        mark: &mut dyn FnMut(&'static str) -> Result<()>,
    ) -> Result<()> {
        let plan = self.prepare(tokens, true)?;
        let pass = Pass { plan, x, y };
        let l = self.launcher()?;
        let s = &self.stream;
        let front = l.front(s, &pass, mark)?;
        let ws = self.workspace()?;
        let counts = ws.counts.to_host(s)?;
        let (Some([xp, h, yt]), Some(pointers)) = (ws.cublas.as_ref(), ws.gemm_pointers.as_ref())
        else {
            return Err(Error::InvalidArgument(
                "MoE cuBLAS workspace missing".into(),
            ));
        };
        let (hd, inter) = (self.config.hidden, self.config.intermediate);
        let Some((d, cs)) = s.cuda() else {
            return Err(Error::Unsupported("the cuBLAS path needs CUDA".into()));
        };
        let size = std::mem::size_of::<T>() as u64;
        // SAFETY: token_of holds `slots` row indices below `tokens` (the dispatch wrote them),
        // x holds tokens·hidden elements, xp slots·hidden.
        unsafe {
            ops::permute::gather_rows_raw(
                d,
                cs,
                x,
                tokens,
                hd * size as usize,
                ws.token_of.device_ptr(),
                plan.slots,
                xp.device_ptr(),
            )?;
        }
        let mut up = Vec::new();
        let mut down = Vec::new();
        let mut row = 0usize;
        for (e, &c) in counts.iter().enumerate() {
            let m = c as usize;
            if m > 0 {
                let call = |n, k, a: u64, b: u64, c: u64| GemmCall {
                    dtype: T::KIND,
                    m,
                    n,
                    k,
                    trans_a: false,
                    trans_b: true,
                    tf32: false,
                    batch: 1,
                    a,
                    b,
                    c,
                    stride_a: 0,
                    stride_b: 0,
                    stride_c: 0,
                };
                up.push(call(
                    2 * inter,
                    hd,
                    xp.device_ptr() + (row * hd) as u64 * size,
                    self.w13.device_ptr() + (e * 2 * inter * hd) as u64 * size,
                    h.device_ptr() + (row * 2 * inter) as u64 * size,
                ));
                down.push(call(
                    hd,
                    inter,
                    ws.act.device_ptr() + (row * inter) as u64 * size,
                    self.w2.device_ptr() + (e * hd * inter) as u64 * size,
                    yt.device_ptr() + (row * hd) as u64 * size,
                ));
            }
            row += m;
        }
        if row != plan.slots {
            return Err(Error::InvalidArgument(format!(
                "MoE dispatch counted {row} routed slots, {} expected",
                plan.slots
            )));
        }
        let t = l.dtype_index()?;
        let rows = plan.slots / up.len().max(1);
        let grouped =
            2.0 * rows as f64 * (2 * inter) as f64 * (hd as f64) < CUBLAS_GROUPED_MAX_FLOPS;
        let (up_ptrs, down_ptrs) = (
            pointers.device_ptr(),
            pointers.device_ptr() + (3 * up.len() * 8) as u64,
        );
        if grouped {
            let mut ptrs = crate::device::CudaDevice::grouped_gemm_pointers(&up);
            ptrs.extend(crate::device::CudaDevice::grouped_gemm_pointers(&down));
            d.copy_h2d(cs, up_ptrs, &ptrs)?;
        }
        let run = |calls: &[GemmCall], ptrs: u64| -> Result<()> {
            // SAFETY: each call's rows lie inside xp / h / act / yt (offsets from the counts,
            // which sum to `slots`, checked above) and inside w13 / w2 (one matrix per
            // expert); the pointer arrays (at most 6 words per expert) were copied above.
            unsafe {
                if grouped {
                    d.gemm_grouped(cs, calls, ptrs)
                } else {
                    d.gemm(cs, calls)
                }
            }
        };
        run(&up, up_ptrs)?;
        mark("experts-gate-up")?;
        let args = ops::Args::new()
            .ptr(h.device_ptr())
            .u64(plan.slots as u64)
            .u32(inter as u32)
            .ptr(ws.act.device_ptr());
        let name = ["moe_swiglu_f16", "moe_swiglu_bf16"][t];
        let grid = ops::fill_grid(d, (&MOE, name), (plan.slots * inter) as u64, 256)?;
        // SAFETY: moe_swiglu_T(const T* h, u64 rows, u32 inter, T* act): h holds slots·2I,
        // act slots·I elements.
        unsafe { ops::launch(d, cs, (&MOE, name), grid, 256, 0, args)? };
        mark("swiglu")?;
        run(&down, down_ptrs)?;
        mark("experts-down")?;
        l.combine(s, &pass, yt.device_ptr(), ws.weights.device_ptr(), true)?;
        mark("combine")?;
        self.last = ForwardStats {
            host_syncs: 1,
            launches: front
                + 3
                + if grouped {
                    2
                } else {
                    (up.len() + down.len()) as u32
                },
            graph: false,
        };
        Ok(())
    }

    // ---- the CPU backend ----

    fn route_host(&self, x: &Buffer<T>, tokens: usize) -> Result<(Vec<f32>, Vec<u32>)> {
        let c = &self.config;
        let (h, e, k) = (c.hidden, c.experts, c.top_k);
        let xs = x.host_view()?;
        let gate = self.gate.host_view()?;
        let bias = match &self.gate_bias {
            Some(b) => Some(b.host_view()?),
            None => None,
        };
        let mut logits = host_filled("MoE router logits (CPU)", tokens * e, 0f32)?;
        for t in 0..tokens {
            let xr = &xs[t * h..(t + 1) * h];
            for j in 0..e {
                let g = &gate[j * h..(j + 1) * h];
                let dot: f64 = xr.iter().zip(g).map(|(a, b)| a.to_f64() * b.to_f64()).sum();
                logits[t * e + j] = dot as f32;
            }
        }
        match c.router {
            Router::Softmax => {
                if let Some(b) = bias {
                    for row in logits.chunks_exact_mut(e) {
                        for (l, &bv) in row.iter_mut().zip(b) {
                            *l += bv;
                        }
                    }
                }
                let s = &self.stream;
                let lb = Buffer::from_host(s, &logits)?;
                let mut w = Buffer::<f32>::zeros(s, tokens * k)?;
                let mut idx = Buffer::<u32>::zeros(s, tokens * k)?;
                let r = Route {
                    experts: e,
                    k,
                    renormalize: c.renormalize,
                };
                ops::route(s, &r, &lb, &mut w, &mut idx)?;
                Ok((w.host_view()?.to_vec(), idx.host_view()?.to_vec()))
            }
            Router::SigmoidGrouped {
                n_group,
                topk_group,
                routed_scaling,
            } => {
                let mut w = host_vec("MoE routing weights (CPU)", tokens * k)?;
                let mut idx = host_vec("MoE routing experts (CPU)", tokens * k)?;
                for row in logits.chunks_exact(e) {
                    let (rw, ri) = sigmoid_grouped(
                        row,
                        bias,
                        k,
                        (n_group, topk_group),
                        c.renormalize,
                        routed_scaling,
                    );
                    w.extend(rw);
                    idx.extend(ri);
                }
                Ok((w, idx))
            }
        }
    }

    fn forward_host(&mut self, x: &Buffer<T>, y: &mut Buffer<T>) -> Result<()> {
        let c = self.config;
        let (h, inter, k) = (c.hidden, c.intermediate, c.top_k);
        let wide = 2 * inter_pad(inter);
        let tokens = ops::rows_of("MoE forward", x.len(), h)?;
        let (weights, experts) = self.route_host(x, tokens)?;
        let mut xs = host_vec("MoE input as f32 (CPU)", x.len())?;
        xs.extend(x.host_view()?.iter().map(|v| v.to_f64() as f32));
        let (w13_all, w2_all) = (self.w13.host_view()?, self.w2.host_view()?);
        let widen = |v: &[T]| -> Vec<f32> { v.iter().map(|x| x.to_f64() as f32).collect() };
        let mut by_expert: Vec<Vec<usize>> = vec![Vec::new(); c.experts];
        for (slot, &e) in experts.iter().enumerate() {
            if let Some(list) = by_expert.get_mut(e as usize) {
                list.push(slot);
            }
        }
        let mut out = host_filled("MoE output as f64 (CPU)", tokens * h, 0f64)?;
        for (e, slots) in by_expert.iter().enumerate() {
            if slots.is_empty() {
                continue;
            }
            let m = slots.len();
            let mut a = host_vec("MoE expert input (CPU)", m * h)?;
            for &s in slots {
                a.extend_from_slice(&xs[(s / k) * h..(s / k + 1) * h]);
            }
            let mut hbuf = host_filled("MoE gate/up output (CPU)", m * wide, 0f32)?;
            let b = widen(&w13_all[e * wide * h..(e + 1) * wide * h]);
            cpu::gemm_f32(&a, &b, &mut hbuf, (m, wide, h), (false, true))?;
            // SwiGLU on the interleaved columns, rounded to T as the device path stores it.
            let mut act = host_filled("MoE activations (CPU)", m * inter, 0f32)?;
            for r in 0..m {
                for col in 0..inter {
                    let base = (col / 8) * 16 + col % 8;
                    let g = hbuf[r * wide + base] as f64;
                    let u = hbuf[r * wide + base + 8] as f64;
                    act[r * inter + col] = T::from_f64(g / (1.0 + (-g).exp()) * u).to_f64() as f32;
                }
            }
            let mut yb = host_filled("MoE down output (CPU)", m * h, 0f32)?;
            let b2 = widen(&w2_all[e * h * inter..(e + 1) * h * inter]);
            cpu::gemm_f32(&act, &b2, &mut yb, (m, h, inter), (false, true))?;
            for (r, &s) in slots.iter().enumerate() {
                let wgt = weights[s] as f64;
                let dst = &mut out[(s / k) * h..(s / k + 1) * h];
                for (o, &v) in dst.iter_mut().zip(&yb[r * h..(r + 1) * h]) {
                    *o += wgt * v as f64;
                }
            }
        }
        for (dst, v) in y.host_view_mut()?.iter_mut().zip(out) {
            *dst = T::from_f64(v);
        }
        self.last = ForwardStats::default();
        Ok(())
    }
}

fn pass_with<T: DType>(plan: Plan, x: &Buffer<T>, y: &Buffer<T>) -> Pass {
    Pass {
        plan,
        x: x.device_ptr(),
        y: y.device_ptr(),
    }
}

/// The intermediate size rounded up to the 8-row blocks of the w13 interleave (the CUDA
/// path requires it to be a multiple of 8 already; the CPU backend pads with zero rows).
fn inter_pad(intermediate: usize) -> usize {
    intermediate.div_ceil(8) * 8
}

/// The grouped sigmoid router for one token (the CPU reference of
/// `moe_route_sigmoid_grouped`): (weights, experts).
pub(crate) fn sigmoid_grouped(
    logits: &[f32],
    bias: Option<&[f32]>,
    k: usize,
    (n_group, topk_group): (usize, usize),
    renormalize: bool,
    scaling: f32,
) -> (Vec<f32>, Vec<u32>) {
    let e = logits.len();
    let per = e / n_group;
    let score = |i: usize| 1.0 / (1.0 + (-(logits[i] as f64)).exp());
    let mut sel: Vec<f64> = (0..e)
        .map(|i| score(i) + bias.map_or(0.0, |b| b[i] as f64))
        .collect();
    let mut groups: Vec<(f64, usize)> = (0..n_group)
        .map(|g| {
            let mut v: Vec<f64> = sel[g * per..(g + 1) * per].to_vec();
            v.sort_by(|a, b| b.total_cmp(a));
            (v.iter().take(2).sum(), g)
        })
        .collect();
    // Best first; ties to the lower group.
    groups.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
    let kept: Vec<usize> = groups.iter().take(topk_group).map(|g| g.1).collect();
    for (i, s) in sel.iter_mut().enumerate() {
        if !kept.contains(&(i / per)) {
            *s = f64::NEG_INFINITY;
        }
    }
    let mut chosen = Vec::with_capacity(k);
    for _ in 0..k {
        let mut best = 0usize;
        for i in 1..e {
            if sel[i] > sel[best] {
                best = i;
            }
        }
        chosen.push(best);
        sel[best] = f64::NEG_INFINITY;
    }
    let sum: f64 = chosen.iter().map(|&i| score(i)).sum();
    let w = chosen
        .iter()
        .map(|&i| {
            let s = score(i);
            ((if renormalize { s / sum } else { s }) * scaling as f64) as f32
        })
        .collect();
    (w, chosen.iter().map(|&i| i as u32).collect())
}

/// A random tensor of `len` elements (see [`MoeWeights::Random`]).
fn random_buffer<T: Float>(
    stream: &Stream,
    len: usize,
    seed: u64,
    fan_in: usize,
) -> Result<Buffer<T>> {
    let scale = weights::random_scale(fan_in);
    let Some((d, s)) = stream.cuda() else {
        // Filled in place: a host copy first would need the memory twice.
        let mut buf = Buffer::<T>::uninit(stream, len)?;
        for (i, v) in buf.host_view_mut()?.iter_mut().enumerate() {
            *v = T::from_f64(weights::random_value(seed, i as u64, scale) as f64);
        }
        return Ok(buf);
    };
    let buf = Buffer::<T>::uninit(stream, len)?;
    let name = ops::by_float!("moe_init_random")[ops::float_index::<T>("MoE init")?];
    let grid = ops::fill_grid(d, (&MOE, name), len as u64, 256)?;
    let args = ops::Args::new()
        .buf(&buf)
        .u64(len as u64)
        .u64(seed)
        .f32(scale);
    // SAFETY: moe_init_random_T(T* out, u64 n, u64 seed, float scale): buf holds len elements.
    unsafe { ops::launch(d, s, (&MOE, name), grid, 256, 0, args)? };
    Ok(buf)
}

type Uploaded<T> = (Buffer<T>, Option<Buffer<f32>>, Buffer<T>, Buffer<T>);

/// The host tensors on the device, w1 and w3 interleaved into w13.
fn upload_weights<T: Float>(
    stream: &Stream,
    c: &MoeConfig,
    w: &HostWeights,
) -> Result<Uploaded<T>> {
    let (h, i) = (c.hidden, c.intermediate);
    let narrow = |v: &[f32]| -> Vec<T> { v.iter().map(|&x| T::from_f64(x as f64)).collect() };
    let ip = inter_pad(i);
    let mut w13 = host_vec("MoE weights (w13)", c.experts * 2 * ip * h)?;
    for row in 0..c.experts * 2 * ip {
        let (is_w3, e, r) = weights::w13_source(row, ip);
        let src = if is_w3 { &w.w3 } else { &w.w1 };
        match src.get((e * i + r) * h..(e * i + r + 1) * h) {
            Some(vals) if r < i => w13.extend(vals.iter().map(|&x| T::from_f64(x as f64))),
            _ => w13.extend(std::iter::repeat_n(T::default(), h)), // padding
        }
    }
    Ok((
        Buffer::from_host(stream, &narrow(&w.gate))?,
        w.gate_bias
            .as_ref()
            .map(|b| Buffer::from_host(stream, b))
            .transpose()?,
        Buffer::from_host(stream, &w13)?,
        Buffer::from_host(stream, &narrow(&w.w2))?,
    ))
}

/// The layer's buffers as raw addresses: what a captured graph's body keeps.
#[derive(Clone, Copy)]
struct Launcher {
    config: MoeConfig,
    dtype: DTypeKind,
    gate: u64,
    gate_bias: u64,
    w13: u64,
    w2: u64,
    logits: u64,
    weights: u64,
    experts: u64,
    counts: u64,
    offsets: u64,
    order: u64,
    token_of: u64,
    slot_pos: u64,
    work: u64,
    n_items: u64,
    tickets: u64,
    partial: u64,
    act: u64,
    y_rows: u64,
}

/// `MoeGemm` of `kernels/moe.cu`, field for field (C layout).
#[repr(C)]
#[derive(Clone, Copy, Default)]
struct GemmParams {
    a: u64,
    a_rows: u64,
    w: u64,
    w_stride: u64,
    n: u32,
    k: u32,
    counts: u64,
    offsets: u64,
    work: u64,
    n_items: u64,
    splits: u32,
    k_split: u32,
    partial: u64,
    rows_cap: u32,
    tickets: u64,
    early_k: u32,
    items_fastest: u32,
    epilogue: i32,
    out: u64,
    slot_weight: u64,
    order: u64,
}

/// `MoeDecode` of `kernels/moe.cu`, field for field (C layout).
#[repr(C)]
#[derive(Clone, Copy, Default)]
struct DecodeParams {
    x: u64,
    gate: u64,
    bias: u64,
    w13: u64,
    w2: u64,
    hidden: u32,
    inter: u32,
    experts: u32,
    top_k: u32,
    renorm: i32,
    router_segs: u32,
    prefetch_bytes: u32,
    logits: u64,
    weights: u64,
    chosen: u64,
    act: u64,
    counters: u64,
    out: u64,
}

const DECODE_NAMES: [&str; 2] = ["moe_decode_f16", "moe_decode_bf16"];

/// `MoeRouter` of `kernels/moe.cu`, field for field (C layout).
#[repr(C)]
#[derive(Clone, Copy, Default)]
struct RouterParams {
    x: u64,
    w: u64,
    bias: u64,
    tokens: u32,
    k: u32,
    experts: u32,
    splits: u32,
    k_split: u32,
    tile_rows: u32,
    logits: u64,
    tickets: u64,
    route: i32,
    top_k: u32,
    renorm: i32,
    weights: u64,
    chosen: u64,
    bm: u32,
    counts: u64,
    offsets: u64,
    order: u64,
    token_of: u64,
    slot_pos: u64,
    work: u64,
    n_items: u64,
}

const ROUTER_NAMES: [[&str; 3]; 2] = [
    [
        "moe_router_f16_m1",
        "moe_router_f16_m2",
        "moe_router_f16_m4",
    ],
    [
        "moe_router_bf16_m1",
        "moe_router_bf16_m2",
        "moe_router_bf16_m4",
    ],
];

const ROUTER_CLUSTER_NAMES: [&str; 2] = ["moe_router_cluster_f16", "moe_router_cluster_bf16"];

/// The staged tiles on Hopper's warpgroup MMA (`moe_gemm_wgmma`; m4, m6), where the module
/// is built for sm_90a.
const GEMM_WGMMA_NAMES: [[&str; 2]; 2] = [
    ["moe_gemm_f16_m4w", "moe_gemm_f16_m6w"],
    ["moe_gemm_bf16_m4w", "moe_gemm_bf16_m6w"],
];

const GEMM_NAMES: [[&str; 4]; 2] = [
    [
        "moe_gemm_f16_m1",
        "moe_gemm_f16_m2",
        "moe_gemm_f16_m4",
        "moe_gemm_f16_m6",
    ],
    [
        "moe_gemm_bf16_m1",
        "moe_gemm_bf16_m2",
        "moe_gemm_bf16_m4",
        "moe_gemm_bf16_m6",
    ],
];

fn u32_of(v: usize, what: &str) -> Result<u32> {
    u32::try_from(v).map_err(|_| Error::InvalidArgument(format!("MoE: {what} = {v} exceeds u32")))
}

impl Launcher {
    /// 0 for f16, 1 for bf16.
    fn dtype_index(&self) -> Result<usize> {
        match self.dtype {
            DTypeKind::F16 => Ok(0),
            DTypeKind::BF16 => Ok(1),
            other => Err(Error::Unsupported(format!(
                "MoE kernels on {}",
                other.name()
            ))),
        }
    }

    fn enqueue(&self, s: &Stream, pass: &Pass) -> Result<()> {
        self.enqueue_marked(s, pass, &mut |_| Ok(())).map(|_| ())
    }

    fn enqueue_marked(
        &self,
        s: &Stream,
        pass: &Pass,
        mark: &mut dyn FnMut(&'static str) -> Result<()>,
    ) -> Result<u32> {
        if let Some(shape) = &pass.plan.decode {
            self.decode(s, pass, shape)?;
            mark("decode")?;
            return Ok(1);
        }
        let front = self.front(s, pass, mark)?;
        let c = &self.config;
        let p = &pass.plan;
        let expert_rows = GemmParams {
            counts: self.counts,
            offsets: self.offsets,
            work: self.work,
            n_items: self.n_items,
            partial: self.partial,
            rows_cap: u32_of(p.slots, "routed slots")?,
            tickets: self.tickets,
            ..GemmParams::default()
        };
        self.gemm(
            s,
            &p.up,
            GemmParams {
                a: pass.x,
                a_rows: self.token_of,
                w: self.w13,
                w_stride: (2 * c.intermediate * c.hidden) as u64,
                epilogue: 1,
                out: self.act,
                ..expert_rows
            },
        )?;
        mark("experts-gate-up")?;
        self.gemm(
            s,
            &p.down,
            GemmParams {
                a: self.act,
                w: self.w2,
                w_stride: (c.hidden * c.intermediate) as u64,
                // The dispatch wrote the work list before the gate/up GEMM started.
                early_k: u32_of(p.down_early_k, "down projection prefetch")?,
                epilogue: 2,
                out: self.y_rows,
                slot_weight: self.weights,
                order: self.order,
                ..expert_rows
            },
        )?;
        mark("experts-down")?;
        self.combine(s, pass, self.y_rows, 0, false)?;
        mark("combine")?;
        Ok(front + 3)
    }

    /// The router, the routing and the dispatch, as few kernels as the config allows:
    /// returns how many it launched.
    fn front(
        &self,
        s: &Stream,
        pass: &Pass,
        mark: &mut dyn FnMut(&'static str) -> Result<()>,
    ) -> Result<u32> {
        self.router(s, pass)?;
        mark("router")?;
        if fused_route(&self.config) {
            return Ok(1);
        }
        self.route(s, pass)?;
        mark("route")?;
        self.dispatch(s, pass)?;
        mark("dispatch")?;
        Ok(3)
    }

    /// The router kernel: f32 logits (+ bias for the Softmax router) and, when the config
    /// allows ([`fused_route`]), the softmax top-k into weights / experts and the dispatch.
    fn router(&self, s: &Stream, pass: &Pass) -> Result<()> {
        let Some((d, cs)) = s.cuda() else {
            return Err(Error::Unsupported("MoE router kernel on the CPU".into()));
        };
        let p = &pass.plan;
        let c = &self.config;
        let route = fused_route(c);
        let mut params = RouterParams {
            x: pass.x,
            w: self.gate,
            bias: if c.router == Router::Softmax {
                self.gate_bias
            } else {
                0
            },
            tokens: u32_of(p.tokens, "tokens")?,
            k: u32_of(c.hidden, "hidden")?,
            experts: u32_of(c.experts, "experts")?,
            splits: u32_of(p.router.splits, "router splits")?,
            k_split: u32_of(p.router.k_split, "router split")?,
            tile_rows: p.router.tile_rows as u32,
            logits: self.logits,
            tickets: self.tickets,
            route: i32::from(route),
            top_k: c.top_k as u32,
            renorm: i32::from(c.renormalize),
            weights: self.weights,
            chosen: self.experts,
            bm: p.bm as u32,
            counts: self.counts,
            offsets: self.offsets,
            order: self.order,
            token_of: self.token_of,
            slot_pos: self.slot_pos,
            work: self.work,
            n_items: self.n_items,
        };
        let shape = &p.router;
        let mt = match shape.mt {
            1 => 0,
            2 => 1,
            _ => 2,
        };
        let name = if shape.cluster {
            ROUTER_CLUSTER_NAMES[self.dtype_index()?]
        } else {
            ROUTER_NAMES[self.dtype_index()?][mt]
        };
        let f = d.function(&MOE, name)?;
        let grid = (
            u32_of(shape.col_blocks * shape.splits, "router column blocks")?,
            u32_of(shape.row_tiles, "router row tiles")?,
            1,
        );
        if grid.1 > 65_535 {
            return Err(Error::InvalidArgument(format!(
                "MoE router: {} tokens need {} row tiles, at most 65535",
                p.tokens, grid.1
            )));
        }
        let mut args = [&mut params as *mut RouterParams as *mut c_void];
        let cluster = if shape.cluster { grid.0 } else { 1 };
        // SAFETY: moe_router_T_mMT / moe_router_cluster_T (MoeRouter p): RouterParams is
        // MoeRouter's C layout; x holds tokens·hidden elements, the gate experts·hidden,
        // logits splits·tokens·E, weights / chosen / order / token_of / slot_pos tokens·k,
        // counts E, offsets E + 1, work 2·items words, tickets at least row_tiles + 1 zeroed
        // words (the workspace is sized from this plan); routing only with E <= 256 (its
        // shared rows and dispatch arrays); the clustered kernel only with E <= 128, row
        // tiles of at most 16 tokens, one split and the grid's x as one cluster (its shared
        // tile of logits).
        unsafe {
            d.launch(
                cs,
                &f,
                grid,
                (ROUTER_BLOCK, 1, 1),
                0,
                &mut args,
                LaunchMode {
                    cluster,
                    ..LaunchMode::default()
                },
            )
        }
    }

    fn route(&self, s: &Stream, pass: &Pass) -> Result<()> {
        let Some((d, cs)) = s.cuda() else {
            return Err(Error::Unsupported("MoE device router on the CPU".into()));
        };
        let c = &self.config;
        let tokens = pass.plan.tokens;
        match c.router {
            Router::Softmax => {
                let r = Route {
                    experts: c.experts,
                    k: c.top_k,
                    renormalize: c.renormalize,
                };
                // SAFETY: logits hold tokens·E f32, weights and experts tokens·k each (the
                // workspace is sized for at least `tokens`); k was validated with the config.
                unsafe {
                    ops::router::route_raw::<f32>(
                        d,
                        cs,
                        &r,
                        self.logits,
                        tokens,
                        self.weights,
                        self.experts,
                    )
                }
            }
            Router::SigmoidGrouped {
                n_group,
                topk_group,
                routed_scaling,
            } => {
                let name = "moe_route_sigmoid_grouped";
                let grid = u32_of(tokens.div_ceil(ROUTER_WARPS as usize), "router blocks")?;
                let smem = u32_of(
                    ROUTER_WARPS as usize * c.experts * 4,
                    "router shared memory",
                )?;
                let args = ops::Args::new()
                    .ptr(self.logits)
                    .ptr(self.gate_bias)
                    .u32(tokens as u32)
                    .u32(c.experts as u32)
                    .u32(c.top_k as u32)
                    .u32(n_group as u32)
                    .u32(topk_group as u32)
                    .i32(i32::from(c.renormalize))
                    .f32(routed_scaling)
                    .ptr(self.weights)
                    .ptr(self.experts);
                // SAFETY: moe_route_sigmoid_grouped(const float* logits, const float* bias
                // (nullable), u32 tokens, u32 experts, u32 k, u32 n_group, u32 topk_group,
                // int renorm, float scaling, float* weights, u32* indices): logits hold
                // tokens·E, bias E (or null), weights/indices tokens·k; E floats of shared
                // memory per warp; k <= 16 and n_group <= 32 (validated).
                unsafe { ops::launch(d, cs, (&MOE, name), grid, ROUTER_WARPS * 32, smem, args) }
            }
        }
    }

    fn dispatch(&self, s: &Stream, pass: &Pass) -> Result<()> {
        let Some((d, cs)) = s.cuda() else {
            return Err(Error::Unsupported("MoE dispatch on the CPU".into()));
        };
        let c = &self.config;
        let args = ops::Args::new()
            .ptr(self.experts)
            .u32(u32_of(pass.plan.slots, "routed slots")?)
            .u32(c.experts as u32)
            .u32(c.top_k as u32)
            .u32(pass.plan.bm as u32)
            .ptr(self.counts)
            .ptr(self.offsets)
            .ptr(self.order)
            .ptr(self.token_of)
            .ptr(self.slot_pos)
            .ptr(self.work)
            .ptr(self.n_items);
        // SAFETY: moe_dispatch(const u32* experts, u32 slots, u32 E, u32 k, u32 bm, u32*
        // counts, u32* offsets, u32* order, u32* token_of, u32* slot_pos, u32* work, u32*
        // n_items): the workspace holds slots ids and slots entries of each permutation array,
        // E counts, E + 1 offsets, 2·items work words (items = the most tiles of `bm` rows
        // `slots` rows can need over E experts); 2·E words of shared memory (E <= 4096).
        unsafe {
            ops::launch(
                d,
                cs,
                (&MOE, "moe_dispatch"),
                1,
                DISPATCH_BLOCK,
                (2 * c.experts * 4) as u32,
                args,
            )
        }
    }

    /// The whole one-token pass in one kernel (see [`DecodeShape`]).
    fn decode(&self, s: &Stream, pass: &Pass, shape: &DecodeShape) -> Result<()> {
        let Some((d, cs)) = s.cuda() else {
            return Err(Error::Unsupported("MoE decode kernel on the CPU".into()));
        };
        let c = &self.config;
        let mut params = DecodeParams {
            x: pass.x,
            gate: self.gate,
            bias: self.gate_bias,
            w13: self.w13,
            w2: self.w2,
            hidden: u32_of(c.hidden, "hidden")?,
            inter: u32_of(c.intermediate, "intermediate")?,
            experts: u32_of(c.experts, "experts")?,
            top_k: u32_of(c.top_k, "top_k")?,
            renorm: i32::from(c.renormalize),
            router_segs: u32_of(shape.router_segs, "decode router segments")?,
            prefetch_bytes: u32_of(shape.prefetch_bytes, "decode prefetch")?,
            logits: self.logits,
            weights: self.weights,
            chosen: self.experts,
            act: self.act,
            counters: self.tickets,
            out: pass.y,
        };
        let name = DECODE_NAMES[self.dtype_index()?];
        let f = d.function(&MOE, name)?;
        let shared = u32_of(DecodeShape::shared_bytes(c), "decode shared memory")?;
        let resident = d.resident_blocks(&MOE, name, DECODE_BLOCK, shared)? as usize;
        // As many blocks per SM as fit, at most DECODE_BLOCKS_PER_SM: all are resident.
        let grid = shape.sms * resident.min(DECODE_BLOCKS_PER_SM);
        let mut args = [&mut params as *mut DecodeParams as *mut c_void];
        // SAFETY: moe_decode_T(MoeDecode p): DecodeParams is MoeDecode's C layout; x holds
        // hidden elements and y as many, the gate experts·hidden (+ bias experts f32 or
        // null), w13 experts·2·intermediate·hidden, w2 experts·hidden·intermediate; logits
        // at least router_segs·E f32 (Plan::logits_len), weights / chosen k words, act
        // k·intermediate f32 (Workspace::new sizes it so), the tickets at least 3 zeroed
        // words (Plan::tickets_len); E <= 256, k <= 32, router_segs <= 16 and the shared
        // memory of x and act (DecodeShape::new). The launch is cooperative with no more
        // blocks than fit at once, so the blocks that wait for each other are all resident.
        unsafe {
            d.launch(
                cs,
                &f,
                (u32_of(grid, "decode blocks")?, 1, 1),
                (DECODE_BLOCK, 1, 1),
                shared,
                &mut args,
                LaunchMode {
                    cooperative: true,
                    ..LaunchMode::default()
                },
            )
        }
    }

    fn gemm(&self, s: &Stream, shape: &GemmShape, mut p: GemmParams) -> Result<()> {
        let Some((d, cs)) = s.cuda() else {
            return Err(Error::Unsupported("MoE grouped GEMM on the CPU".into()));
        };
        p.n = u32_of(shape.n, "GEMM columns")?;
        p.k = u32_of(shape.k, "GEMM depth")?;
        p.splits = shape.splits as u32;
        p.k_split = u32_of(shape.k_split, "GEMM split")?;
        p.items_fastest = u32::from(shape.items_fastest);
        let mt = match shape.mt {
            1 => 0,
            2 => 1,
            4 => 2,
            _ => 3,
        };
        let t = self.dtype_index()?;
        let name = if shape.wgmma {
            GEMM_WGMMA_NAMES[t][mt - 2]
        } else {
            GEMM_NAMES[t][mt]
        };
        let f = d.function(&MOE, name)?;
        let grid = u32_of(shape.grid(), "GEMM blocks")?;
        let shared = gemm_shared_bytes(shape.mt, shape.wgmma);
        let mut params = [&mut p as *mut GemmParams as *mut c_void];
        // SAFETY: moe_gemm_T_mMT(MoeGemm p): GemmParams is MoeGemm's C layout; `a` holds the
        // rows the work list names (row indices from the dispatch), `w` one n×k matrix per
        // expert, `partial` splits·rows_cap·n f32 and `tickets` one word per tile (the
        // workspace is sized from this plan), `out` rows_cap rows of the epilogue's width.
        // The kernel waits for the previous one before it reads anything but the weights and
        // (with early_k, written two kernels back) the work list, and before any write.
        unsafe {
            d.launch(
                cs,
                &f,
                (grid, 1, 1),
                (GEMM_BLOCK, 1, 1),
                shared,
                &mut params,
                LaunchMode {
                    programmatic: true,
                    ..LaunchMode::default()
                },
            )
        }
    }

    /// `y[t] = Σ_r scale · rows[slot_pos[t·k + r]]`; `weighted` rows are T with the routing
    /// weights applied here, else f32 rows already weighted.
    fn combine(&self, s: &Stream, pass: &Pass, rows: u64, weights: u64, typed: bool) -> Result<()> {
        let Some((d, cs)) = s.cuda() else {
            return Err(Error::Unsupported("MoE combine on the CPU".into()));
        };
        let c = &self.config;
        let t = self.dtype_index()?;
        let name = if typed {
            ["moe_combine_f16_f16", "moe_combine_bf16_bf16"][t]
        } else {
            ["moe_combine_f32_f16", "moe_combine_f32_bf16"][t]
        };
        let quads = (pass.plan.tokens * c.hidden / 4) as u64;
        let grid = ops::fill_grid(d, (&MOE, name), quads, 256)?;
        let args = ops::Args::new()
            .ptr(rows)
            .ptr(self.slot_pos)
            .ptr(weights)
            .u32(pass.plan.tokens as u32)
            .u32(c.top_k as u32)
            .u32(c.hidden as u32)
            .ptr(pass.y);
        // SAFETY: moe_combine_TY_T(const TY* y, const u32* slot_pos, const float* weights
        // (nullable), u32 tokens, u32 k, u32 hidden, T* out): rows hold slots·hidden, slot_pos
        // and weights slots entries, out tokens·hidden; hidden % 8 == 0. It waits for the
        // previous kernel before it reads or writes anything.
        unsafe { ops::launch_as(d, cs, (&MOE, name), grid, 256, 0, args, true) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn auto_path_takes_cublas_for_large_experts_above_the_graph_sizes() -> Result<()> {
        let mixtral = MoeConfig::preset("mixtral-8x7b")?;
        // The graph sizes stay on the device kernels whatever the experts.
        assert!(!auto_takes_cublas(&mixtral, GRAPH_MAX_TOKENS));
        assert!(auto_takes_cublas(&mixtral, GRAPH_MAX_TOKENS + 1));
        assert!(auto_takes_cublas(&mixtral, 4096));
        for name in ["qwen3-30b-a3b", "deepseek-v3-slice", "gpt-oss-120b"] {
            let c = MoeConfig::preset(name)?;
            assert!(!auto_takes_cublas(&c, 1024), "{name}");
            assert!(!auto_takes_cublas(&c, 4096), "{name}");
        }
        Ok(())
    }

    #[test]
    fn decode_kernel_takes_one_token_where_the_decode_tile_would() -> Result<()> {
        // The H200 as the plans see it.
        let hopper = Gpu {
            sms: 132,
            l2_bytes: 50 << 20,
            clusters: true,
            shared_per_block: 227 << 10,
            wgmma: true,
            decode: true,
        };
        let shape = |name: &str, tokens: usize, gpu: Gpu| -> Result<Option<DecodeShape>> {
            Ok(DecodeShape::new(&MoeConfig::preset(name)?, tokens, gpu))
        };
        // Shallow experts: one kernel at one token, router segments of at least one load
        // per lane, about one task per warp (2112 warps).
        let on_decode = |name: &str| -> Result<DecodeShape> {
            shape(name, 1, hopper)?
                .ok_or_else(|| Error::InvalidArgument(format!("{name} not on the decode kernel")))
        };
        let qwen3 = on_decode("qwen3-30b-a3b")?;
        assert_eq!(qwen3.router_segs, 8);
        let deepseek = on_decode("deepseek-v3-slice")?;
        assert_eq!(deepseek.router_segs, 8);
        assert_eq!(
            Plan::new(&MoeConfig::preset("qwen3-30b-a3b")?, 1, hopper)
                .decode
                .map(|d| d.router_segs),
            Some(8)
        );
        // Deep experts stay on the staged wgmma tile on Hopper, take the decode kernel
        // without it; more tokens never do; nor does a layer with it turned off.
        for name in ["gpt-oss-120b", "mixtral-8x7b"] {
            assert!(shape(name, 1, hopper)?.is_none(), "{name}");
            let no_wgmma = Gpu {
                wgmma: false,
                ..hopper
            };
            assert!(shape(name, 1, no_wgmma)?.is_some(), "{name}");
        }
        assert!(shape("qwen3-30b-a3b", 2, hopper)?.is_none());
        let off = Gpu {
            decode: false,
            ..hopper
        };
        assert!(shape("qwen3-30b-a3b", 1, off)?.is_none());
        // Routers the kernel does not run, and x and act beyond a block's shared memory.
        let grouped = MoeConfig {
            router: Router::SigmoidGrouped {
                n_group: 8,
                topk_group: 4,
                routed_scaling: 2.5,
            },
            ..MoeConfig::preset("deepseek-v3-slice")?
        };
        assert!(DecodeShape::new(&grouped, 1, hopper).is_none());
        let small = Gpu {
            shared_per_block: 48 << 10,
            ..hopper
        };
        assert!(shape("qwen3-30b-a3b", 1, small)?.is_some());
        assert!(shape("deepseek-v3-slice", 1, small)?.is_some());
        let tiny = Gpu {
            shared_per_block: 16 << 10,
            ..hopper
        };
        assert!(shape("qwen3-30b-a3b", 1, tiny)?.is_none());
        Ok(())
    }
}
