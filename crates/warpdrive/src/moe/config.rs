use crate::dtype::DTypeKind;
use crate::error::{Error, Result};
use crate::{ops, size};

use super::plan::{m_tiles, Gpu, GEMM_MAX_SPLITS};

/// The most tokens whose forward pass runs as a captured CUDA graph with no host sync.
pub const GRAPH_MAX_TOKENS: usize = 256;
/// The cuBLAS path runs each projection as one `cublasGemmGroupedBatchedEx` call when the
/// average routed expert's gate/up GEMM does fewer FLOPs than this, else one `cublasGemmEx`
/// per expert: the grouped kernels win on many small GEMMs and lose to cuBLAS's per-shape
/// choice once each GEMM is large (bench/NOTES.md, MoE paths).
pub const CUBLAS_GROUPED_MAX_FLOPS: f64 = 2.5e9;
/// Above [`GRAPH_MAX_TOKENS`] tokens, [`MoePath::Auto`] runs the experts through cuBLAS when
/// the average expert's gate/up GEMM (its expected share of the routed rows) does more FLOPs
/// than this, else the device kernels (eagerly, still without a host sync): the device
/// kernels win up to a few GFLOP per expert, cuBLAS on large experts (bench/NOTES.md, MoE
/// paths).
pub const AUTO_CUBLAS_MIN_FLOPS: f64 = 8e9;

/// [`MoePath::Auto`]'s choice of the cuBLAS path for `tokens` tokens.
pub(super) fn auto_takes_cublas(c: &MoeConfig, tokens: usize) -> bool {
    // Saturating: only a comparison reads it, and any count a pass can hold is exact.
    let slots = tokens.saturating_mul(c.top_k);
    let rows = slots as f64 / c.experts.min(slots).max(1) as f64;
    tokens > GRAPH_MAX_TOKENS
        && 2.0 * rows * (2 * c.intermediate) as f64 * c.hidden as f64 > AUTO_CUBLAS_MIN_FLOPS
}

/// The least intermediate size at which one routed row per expert takes the staged wgmma
/// tile (see `m_tiles`).
pub(super) const WGMMA_ONE_ROW_MIN_INTERMEDIATE: usize = 1024;

/// The least depth per block (a projection's K split) at which the wgmma tiles take the
/// overlap kernels unless the layer forces a choice ([`MoeLayer::set_wgmma_overlap`]): at
/// 4096 tokens on an H100 the overlap took 7–9 % off the passes whose experts have a
/// projection at least 2880 deep (deepseek-v3-slice's gate/up, 7168; gpt-oss, 2880;
/// mixtral, 4096 and 14336) and added 1.5 % to qwen3's, whose deepest is 2048
/// (bench/NOTES.md, MoE overlap per shape). Passes of fewer tokens split K, so their blocks
/// run shallower and keep the drained kernels.
///
/// [`MoeLayer::set_wgmma_overlap`]: super::MoeLayer::set_wgmma_overlap
pub(super) const WGMMA_OVERLAP_MIN_DEPTH: usize = 2560;

/// Which projections a layer forces onto the wide wgmma tile
/// ([`MoeLayer::set_wgmma_wide`]); the others run the plan's 64- or 96-row tile. The
/// dispatch's work list then comes in the wide tile's 192-row items and a narrower GEMM takes
/// each item as 2 or 3 row tiles of its own.
///
/// [`MoeLayer::set_wgmma_wide`]: super::MoeLayer::set_wgmma_wide
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WgmmaWide {
    /// Neither projection: the 64- and 96-row tiles (two blocks per SM).
    Neither,
    /// The gate/up projection only (K = hidden).
    GateUp,
    /// The down projection only (K = intermediate).
    Down,
    /// Both projections.
    Both,
}

impl WgmmaWide {
    /// From a choice per projection.
    pub fn of(gate_up: bool, down: bool) -> WgmmaWide {
        match (gate_up, down) {
            (false, false) => WgmmaWide::Neither,
            (true, false) => WgmmaWide::GateUp,
            (false, true) => WgmmaWide::Down,
            (true, true) => WgmmaWide::Both,
        }
    }
    /// Whether the gate/up projection takes the wide tile.
    pub fn gate_up(self) -> bool {
        matches!(self, WgmmaWide::GateUp | WgmmaWide::Both)
    }
    /// Whether the down projection takes the wide tile.
    pub fn down(self) -> bool {
        matches!(self, WgmmaWide::Down | WgmmaWide::Both)
    }
}

/// The token rows of the 256-weight-row wgmma tile ([`WgmmaW256`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum W256Rows {
    /// 96 token rows (three tiles for ~256 rows an expert, as the default 96-row tile).
    Rows96,
    /// 128 token rows (Triton's fused MoE's BM = 128).
    Rows128,
}

impl W256Rows {
    /// m16 tiles (token rows / 16) of the kernel.
    pub(super) fn mt(self) -> usize {
        match self {
            W256Rows::Rows96 => 6,
            W256Rows::Rows128 => 8,
        }
    }
}

/// The 256-weight-row wgmma tile, forced ([`MoeLayer::set_wgmma_w256`]; never the plan's own
/// choice): its tiles are `rows` token rows × 256 weight rows (the others' 128), one block
/// per SM, on the `w` / `o` kernels (the overlap rule applies; the warp-specialized `x256t`
/// kernel only where [`MoeLayer::set_wgmma_tma`] forces it), item by item
/// unless the layer forces the grid order ([`MoeLayer::set_gemm_items_fastest`]): the blocks
/// running together then cover a few experts whole and read each token row and weight row
/// from DRAM about once.
///
/// [`MoeLayer::set_wgmma_w256`]: super::MoeLayer::set_wgmma_w256
/// [`MoeLayer::set_wgmma_tma`]: super::MoeLayer::set_wgmma_tma
/// [`MoeLayer::set_gemm_items_fastest`]: super::MoeLayer::set_gemm_items_fastest
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WgmmaW256 {
    /// The projections that take it; the others keep the plan's tile (a 96-row one beside
    /// 128-row items becomes the 64-row one, a 64-row one beside 96-row items the 96-row one,
    /// so that one work list serves both GEMMs).
    pub on: WgmmaWide,
    pub rows: W256Rows,
}

impl WgmmaW256 {
    /// On `on` with `rows` token rows.
    pub fn new(on: WgmmaWide, rows: W256Rows) -> WgmmaW256 {
        WgmmaW256 { on, rows }
    }
}

/// Whether a pass's wgmma tiles take the wide tile (192 token rows, one block per SM):
/// `forced` (per projection) when the layer forces it, else where an expert's rows overflow
/// one 96-row tile (`rows_per_expert` > 96) and 192-row tiles hold them in at most 10 % more
/// tile rows than 96-row tiles do (128 rows: one wide tile streams the weights once where two
/// narrow ones stream them twice; 256: 384 tile rows against 288, a short second wide tile).
/// The rule follows the H100's measurements, not a profile: −9 % on deepseek-v3-slice at 4096
/// tokens (128 rows), −14 % on qwen3 at 2048 (128), −10 % on mixtral at 4096 (1024), and +9 %
/// on qwen3 at 4096 (256), +5 % on mixtral at 1024 (256) (bench/NOTES.md, MoE: the wide tile
/// by the rows it pads).
pub(super) fn wgmma_wide_for(rows_per_expert: usize, forced: Option<bool>) -> bool {
    forced.unwrap_or_else(|| {
        let padded = |tile: usize| rows_per_expert.div_ceil(tile).saturating_mul(tile);
        rows_per_expert > 96 && padded(192).saturating_mul(10) <= padded(96).saturating_mul(11)
    })
}

/// Whether a pass's wgmma tiles take the 256-weight-row tile (128 token rows, one block per
/// SM) on both projections, unless forced: where an expert gets 128 rows or more on average
/// (its 128-row tiles pad as little as the 96-row ones there and read each token row half as
/// often). On an H100 it took 4-8 % off deepseek-v3-slice at 4096 tokens (128 rows), qwen3 at
/// 2048 (128) and 4096 (256) and mixtral at 1024 (256, items fastest), left gpt-oss at 4096
/// (128) within 0.3 %, and added 6 % on qwen3 at 1024 (64 rows) (bench/NOTES.md, MoE: the
/// 256-weight-row tile and the grid order).
pub(super) fn wgmma_w256_for(rows_per_expert: usize) -> bool {
    rows_per_expert >= 128
}

/// Whether a wgmma tile of `mt` m16 tiles takes the warp-specialized TMA kernel: `forced`
/// when the layer forces it, else where one tile holds an expert's rows (2 to 16·`mt`; one
/// row is the decode's). On an H100 it took 2-5 % off every pass measured where an expert's
/// rows fit one tile, and added 8-19 % where they take several (mixtral at 1024 and 4096
/// tokens, deepseek-v3-slice's 128 rows in 96-row tiles) (bench/NOTES.md, as above).
pub(super) fn wgmma_tma_for(rows_per_expert: usize, mt: usize, forced: Option<bool>) -> bool {
    forced.unwrap_or(rows_per_expert >= 2 && rows_per_expert <= 16 * mt)
}

/// Whether a wgmma tile `k_split` deep per block takes the overlap kernel: `forced` when the
/// layer forces it, else from [`WGMMA_OVERLAP_MIN_DEPTH`], or on the 256-weight-row tile
/// (`w256`) where an expert gets [`WGMMA_W256_OVERLAP_MIN_ROWS`] rows or more.
pub(super) fn wgmma_overlap_for(
    k_split: usize,
    w256: bool,
    rows_per_expert: usize,
    forced: Option<bool>,
) -> bool {
    forced.unwrap_or(
        k_split >= WGMMA_OVERLAP_MIN_DEPTH
            || (w256 && rows_per_expert >= WGMMA_W256_OVERLAP_MIN_ROWS),
    )
}

/// The least rows an expert gets at which the 256-weight-row tile takes the overlap kernel
/// at any depth: an expert's rows take two tiles or more, so a block's next tile is another
/// row tile of the same weights. On an H100 it took 2.5-3.7 % off qwen3 at 4096 tokens (256
/// rows, 2048 deep: 885-892 against 915-920 µs) and added 2 % at 128 rows (qwen3 at 2048)
/// (bench/NOTES.md, the 256-weight-row tile and the grid order; sixteenth session).
pub(super) const WGMMA_W256_OVERLAP_MIN_ROWS: usize = 256;

/// The least tokens at which a pass takes the prefill router unless the layer forces a
/// choice ([`MoeLayer::set_prefill_router`]): the logits through cuBLAS, a routing kernel of
/// one warp per token, and the dispatch as a stable counting sort over many blocks, six
/// launches in place of the fused router's one. The fused router's column blocks each re-read
/// x, a row tile routes only after its slowest block and one block dispatches every slot, so
/// its time grows with the tokens (4096: 405 µs on deepseek-v3-slice, 171 on qwen3 on an
/// H100; bench/NOTES.md, the prefill router); the prefill router's six launches cost a few
/// µs each. 512 is the structure's crossover, not a measured one: every graph-sized pass
/// (up to [`GRAPH_MAX_TOKENS`]) keeps the fused router as it is, and from 512 tokens the
/// fused router reads x once per column block in 8 or more row tiles of 64 tokens and its
/// one dispatching block places at least 1024 slots while the other SMs wait.
///
/// [`MoeLayer::set_prefill_router`]: super::MoeLayer::set_prefill_router
pub const PREFILL_ROUTER_MIN_TOKENS: usize = 512;

/// Whether the prefill router can route `c`: the Softmax router over at most 256 experts
/// (the row top-k of the fused router) or the grouped sigmoid router (its own kernel).
pub(super) fn prefill_routes(c: &MoeConfig) -> bool {
    fused_route(c) || matches!(c.router, Router::SigmoidGrouped { .. })
}

/// Whether a pass over `tokens` takes the prefill router: `forced` when the layer forces it,
/// else from [`PREFILL_ROUTER_MIN_TOKENS`]; never where it cannot route `c`.
pub(super) fn prefill_router_for(c: &MoeConfig, tokens: usize, forced: Option<bool>) -> bool {
    prefill_routes(c) && forced.unwrap_or(tokens >= PREFILL_ROUTER_MIN_TOKENS)
}

/// Threads of the prefill routing kernel (`MOE_ROUTE_WARPS` warps, one token each).
pub(super) const ROUTE_BLOCK: u32 = 256;

/// Graphs kept per layer (least recently used dropped first).
pub(super) const GRAPH_CACHE: usize = 32;
/// Threads of the dispatch kernel (its `__launch_bounds__(1024)`).
pub(super) const DISPATCH_BLOCK: u32 = 1024;
/// Threads of the grouped GEMM (8 warps).
pub(super) const GEMM_BLOCK: u32 = 256;

/// Columns per block of the router kernels (`moe_router_*`: one n8 group, K split over
/// 16 warps).
const ROUTER_BN: usize = 8;
/// Threads of the router kernels (16 warps).
pub(super) const ROUTER_BLOCK: u32 = 512;
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
pub(super) fn fused_route(c: &MoeConfig) -> bool {
    c.router == Router::Softmax && c.experts <= ROUTER_ROUTES_MAX
}

/// Columns per block of the grouped GEMM (as the kernels are instantiated in `moe_gemm.cu`: 8
/// warps × 2 n8 groups for m1 / m2, `MOE_SBN` for the staged prefill tile m4).
pub(super) const GEMM_BN: usize = 128;
/// Weight rows (columns of the output) per block of the 256-weight-row wgmma tile
/// (`moe_gemm_*_m{6,8}x256{w,o}`; [`WgmmaW256`]).
pub(super) const WGMMA_W256_BN: usize = 256;
/// m16 tiles of the wide wgmma tile (`moe_gemm_*_m12w` / `m12o`: 192 token rows, one block
/// per SM; [`MoeLayer::set_wgmma_wide`](super::MoeLayer::set_wgmma_wide)).
pub(super) const WGMMA_WIDE_MT: usize = 12;
/// Blocks of the grouped GEMM per SM for `mt` m16 tiles × `bn` weight rows: the wide wgmma
/// tile's 161 KB of stages and the 256-weight-row tile's 177 or 193 KB leave room for one,
/// every other tile runs two (`__launch_bounds__` in `moe_wgmma.cu` / `moe_gemm.cu`).
pub(super) fn gemm_blocks_per_sm(mt: usize, bn: usize) -> usize {
    if mt > 6 || bn > GEMM_BN {
        1
    } else {
        2
    }
}
/// Dynamic shared memory of the grouped GEMM for `mt` m16 tiles × `bn` weight rows: the
/// staged prefill tiles (m4, m6, and m12 on wgmma; bn [`GEMM_BN`], or [`WGMMA_W256_BN`] for
/// m6 / m8 on wgmma) keep 4 stages of 16·mt × 64 A and bn × 64 W (bf16 / f16), on `wgmma`
/// from a 1024-byte boundary (1 KB more to find it); m1 / m2 none.
pub(super) fn gemm_shared_bytes(mt: usize, bn: usize, wgmma: bool) -> u32 {
    if mt >= 4 {
        (4 * (16 * mt + bn) * 64 * 2 + if wgmma { 1024 } else { 0 }) as u32
    } else {
        0
    }
}
/// Threads of the decode kernel (`MOE_DEC_WARPS` warps).
pub(super) const DECODE_BLOCK: u32 = 256;
/// Blocks of the decode kernel per SM at most (its registers allow two; the launch takes as
/// many as fit).
pub(super) const DECODE_BLOCKS_PER_SM: usize = 2;
/// K segments per gate row of the decode kernel's router at most (`MOE_DEC_MAX_SEGS`).
const DECODE_MAX_SEGS: usize = 16;
/// The most top-k the decode kernel routes (`MOE_DEC_MAX_K`).
const DECODE_MAX_K: usize = 32;
/// A bound on the decode kernel's static shared memory (its logits and routing).
const DECODE_STATIC_SHARED: usize = 2048;

/// Warps (tokens) per block of the grouped sigmoid router.
pub(super) const ROUTER_WARPS: u32 = 4;

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

/// The model shapes `MoeConfig::preset` knows (all with the Softmax router, renormalized,
/// bf16), which the `moe` benchmark suite runs; `preset` also knows [`TINY`].
pub const PRESETS: [&str; 4] = [
    "mixtral-8x7b",
    "qwen3-30b-a3b",
    "deepseek-v3-slice",
    "gpt-oss-120b",
];

/// The name of [`MoeConfig::tiny`] for [`MoeConfig::preset`].
pub const TINY: &str = "tiny";

/// [`MoeConfig::tiny`]: a user's first layer starts from it
/// (`MoeConfig { experts: 16, ..Default::default() }`).
impl Default for MoeConfig {
    fn default() -> Self {
        MoeConfig::tiny()
    }
}

impl MoeConfig {
    /// A small shape for examples and tests: hidden 256, intermediate 512, 8 experts, top-2,
    /// bf16, the Softmax router, renormalized. A forward pass of a few hundred tokens takes
    /// milliseconds on the CPU backend.
    pub fn tiny() -> MoeConfig {
        MoeConfig {
            hidden: 256,
            intermediate: 512,
            experts: 8,
            top_k: 2,
            dtype: DTypeKind::BF16,
            router: Router::Softmax,
            renormalize: true,
        }
    }

    /// A named shape, with the rest of [`MoeConfig::tiny`] (bf16, Softmax router,
    /// renormalized): `tiny` itself, `mixtral-8x7b` (4096, 14336, 8 experts, top-2),
    /// `qwen3-30b-a3b` (2048, 768, 128, top-8), `deepseek-v3-slice` (7168, 256, 256, top-8),
    /// `gpt-oss-120b` (2880, 2880, 128, top-4).
    pub fn preset(name: &str) -> Result<MoeConfig> {
        let (hidden, intermediate, experts, top_k) = match name {
            "mixtral-8x7b" => (4096, 14336, 8, 2),
            "qwen3-30b-a3b" => (2048, 768, 128, 8),
            "deepseek-v3-slice" => (7168, 256, 256, 8),
            "gpt-oss-120b" => (2880, 2880, 128, 4),
            TINY => return Ok(MoeConfig::tiny()),
            other => {
                return Err(Error::InvalidArgument(format!(
                    "unknown MoE preset `{other}`; known: {TINY}, {}",
                    PRESETS.join(", ")
                )))
            }
        };
        Ok(MoeConfig {
            hidden,
            intermediate,
            experts,
            top_k,
            ..MoeConfig::tiny()
        })
    }

    /// Fails with `InvalidArgument` on a shape the layer cannot run, on either backend:
    /// what the CUDA kernels refuse (hidden or intermediate not a multiple of 8) is refused
    /// on the CPU too, so a config that runs in CI runs on a GPU.
    pub fn validate(&self) -> Result<()> {
        let bad = |m: String| Err(Error::InvalidArgument(format!("MoE config: {m}")));
        if self.hidden == 0 || self.intermediate == 0 || self.experts == 0 {
            return bad(format!(
                "hidden {}, intermediate {}, experts {}: all must be positive",
                self.hidden, self.intermediate, self.experts
            ));
        }
        if self.hidden % 8 != 0 || self.intermediate % 8 != 0 {
            return bad(format!(
                "hidden {} and intermediate {} must be multiples of 8 (the CUDA kernels read \
                 16-byte rows)",
                self.hidden, self.intermediate
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
pub(super) struct GemmShape {
    pub(super) n: usize,
    pub(super) k: usize,
    pub(super) mt: usize,
    /// Row tiles of this GEMM per item of the dispatch's work list (the list's rows per item
    /// over 16·mt): 1, or 2 / 3 for a 96- / 64-row tile where the other projection takes
    /// the wide tile and the list comes in its 192-row items (`subtiles` of `MoeGemm`).
    pub(super) subtiles: usize,
    /// Columns (weight rows) per block of the kernel that runs it: [`GEMM_BN`], or
    /// [`WGMMA_W256_BN`] on the 256-weight-row wgmma tile.
    pub(super) bn: usize,
    pub(super) items: usize,
    pub(super) splits: usize,
    pub(super) k_split: usize,
    /// Blocks take the tiles n block by n block, the work items fastest (`items_fastest` of
    /// `MoeGemm`), instead of item by item.
    pub(super) items_fastest: bool,
    /// A prefill tile (mt 4 or 6) on the warpgroup-MMA kernel (`moe_gemm_wgmma`).
    pub(super) wgmma: bool,
    /// With `wgmma`, the overlap kernel (`moe_gemm_wgmma<…, OVERLAP>`: the same tiles,
    /// shared memory and blocks per SM, one group of MMAs in flight across stages).
    pub(super) wgmma_overlap: bool,
    /// With `wgmma`, the warp-specialized tile (`moe_gemm_wgmma_tma`, the `t` kernels: the
    /// weights and the down GEMM's act rows by TMA from a producer warp, the gathered rows by
    /// the consumers' cp.async, mbarriers; same tiles, shared memory and blocks per
    /// SM, always one group of MMAs in flight), in place of the `w` / `o` kernels. On the
    /// 256-weight-row tile (only where forced) the `x256t` kernels: a producer warpgroup that
    /// also loads the gathered rows, 384 threads.
    pub(super) wgmma_tma: bool,
}

impl GemmShape {
    pub(super) fn new(
        n: usize,
        k: usize,
        (mt, bn): (usize, usize),
        (items, busy): (usize, usize),
        min_depth: usize,
        sms: usize,
    ) -> Self {
        let n_blocks = n.div_ceil(bn);
        let experts = busy.max(1);
        // At most one wave of blocks (two per SM, one for the wide tile) over the tiles likely to be busy, each
        // split at least `min_depth` deep, so that a few experts still stream their weights
        // at full bandwidth without paying for more split-K fix-ups than the bandwidth needs
        // (rounding up left a few blocks to a second wave: 288 blocks for 264 places).
        let busy = (busy * n_blocks).max(1);
        let places = gemm_blocks_per_sm(mt, bn) * sms.max(1);
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
        // Item by item where an expert's tiles (its items × n blocks × K splits) all fit in
        // one wave of blocks: they run side by side, so its weights and token rows come from
        // DRAM about once. Otherwise n block by n block, the items fastest: an expert's items
        // then read each weight tile together (all but the first from L2), for the price of
        // reading the token rows once per n block (qwen3 at 4096 tokens: 1147 → 933 µs item
        // by item; mixtral at 1024: 1860 items fastest against 2612; bench/NOTES.md, MoE:
        // the 256-weight-row tile and the grid order).
        let splits = k.div_ceil(k_split).max(1);
        let items_fastest = items.div_ceil(experts) * n_blocks * splits > places;
        GemmShape {
            n,
            k,
            mt,
            subtiles: 1,
            bn,
            items,
            splits,
            k_split,
            items_fastest,
            wgmma: false,
            wgmma_overlap: false,
            wgmma_tma: false,
        }
    }
    pub(super) fn n_blocks(&self) -> usize {
        self.n.div_ceil(self.bn)
    }
    pub(super) fn tiles(&self) -> usize {
        self.items * self.n_blocks()
    }
    pub(super) fn grid(&self) -> usize {
        self.tiles() * self.splits
    }
    pub(super) fn partial_len(&self, rows: usize) -> usize {
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
pub(super) struct RouterShape {
    /// The clustered router (`moe_router_cluster_*`): each row tile's `col_blocks` blocks
    /// (16 experts each, the whole K) form one thread-block cluster.
    pub(super) cluster: bool,
    pub(super) mt: usize,
    pub(super) tile_rows: usize,
    pub(super) row_tiles: usize,
    pub(super) col_blocks: usize,
    pub(super) splits: usize,
    pub(super) k_split: usize,
}

impl RouterShape {
    /// `clusters`: the device runs thread-block clusters (compute capability 9.0).
    pub(super) fn new(c: &MoeConfig, tokens: usize, sms: usize, clusters: bool) -> Self {
        // Small tiles while tokens are few (more blocks streaming the gate), larger ones
        // reuse each gate fragment over more rows.
        let mt = match tokens {
            0..=64 => 1,
            65..=256 => 2,
            _ => 4,
        };
        // Up to 64 tokens over at most 128 experts, a cluster per row tile passes the logits
        // through shared memory instead of L2 and a ticket, which is faster (bench/NOTES.md,
        // MoE paths).
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
pub(super) struct DecodeShape {
    /// K segments per gate row (router tasks = experts × segments, about one per warp).
    pub(super) router_segs: usize,
    /// Bytes of the down rows the warps prefetch into L2 while the gate/up units finish.
    pub(super) prefetch_bytes: usize,
    pub(super) sms: usize,
}

impl DecodeShape {
    /// The shape for `tokens` tokens, or None where the decode kernel does not apply: more
    /// than one token, one routed row per expert that the staged wgmma tile takes (deep
    /// experts on Hopper, where the split kernels were faster: the decode kernel's warps,
    /// each summing whole rows of a few KB, keep too few bytes in flight; bench/NOTES.md,
    /// MoE decode), a router the kernel does not run (it routes by Softmax over at most
    /// [`ROUTER_ROUTES_MAX`] experts), top-k above [`DECODE_MAX_K`], or x and the k act rows
    /// (f32) beyond a block's shared memory.
    pub(super) fn new(c: &MoeConfig, tokens: usize, gpu: Gpu) -> Option<Self> {
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
        // About one task per warp, each at least one 16-byte chunk per lane (segments beat
        // one row per warp on qwen3's router; bench/NOTES.md, MoE decode).
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
    pub(super) fn shared_bytes(c: &MoeConfig) -> usize {
        c.top_k
            .saturating_mul(c.intermediate)
            .saturating_add(c.hidden)
            .saturating_mul(4)
    }
}
