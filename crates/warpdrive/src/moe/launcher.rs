use std::ffi::c_void;

use crate::device::{GemmCall, LaunchMode, Stream};
use crate::dtype::DTypeKind;
use crate::error::{Error, Result};
use crate::kernels::{self, MOE, MOE_DECODE, MOE_GEMM, MOE_ROUTER, MOE_ROUTER_CLUSTER, MOE_WGMMA};
use crate::ops::{self, Route};

use super::config::{
    fused_route, gemm_shared_bytes, DecodeShape, GemmShape, MoeConfig, Router, DECODE_BLOCK,
    DECODE_BLOCKS_PER_SM, DISPATCH_BLOCK, GEMM_BLOCK, GEMM_BN, ROUTER_BLOCK, ROUTER_WARPS,
    ROUTE_BLOCK, WGMMA_W256_BN, WGMMA_WIDE_MT,
};
use super::layer::Pass;

/// The layer's buffers as raw addresses: what a captured graph's body keeps.
#[derive(Clone, Copy)]
pub(super) struct Launcher {
    pub(super) config: MoeConfig,
    pub(super) dtype: DTypeKind,
    pub(super) gate: u64,
    pub(super) gate_bias: u64,
    pub(super) w13: u64,
    pub(super) w2: u64,
    pub(super) logits: u64,
    pub(super) weights: u64,
    pub(super) experts: u64,
    pub(super) counts: u64,
    pub(super) offsets: u64,
    pub(super) order: u64,
    pub(super) token_of: u64,
    pub(super) slot_pos: u64,
    pub(super) work: u64,
    pub(super) n_items: u64,
    pub(super) tickets: u64,
    pub(super) sort_counts: u64,
    pub(super) partial: u64,
    pub(super) act: u64,
    pub(super) y_rows: u64,
    /// The TMA tensor maps of w13 and w2 (device addresses, 0 until the layer encodes them:
    /// only for the warp-specialized wgmma tiles).
    pub(super) w13_map: u64,
    pub(super) w2_map: u64,
    /// The 2D TMA map of `act` (0 unless the workspace has one: the down GEMM's token rows on
    /// the warp-specialized tile; without it that tile loads them by cp.async).
    pub(super) act_map: u64,
}

/// `MoeGemm` of `kernels/moe_shared.cu`, field for field (C layout).
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
    subtiles: u32,
    epilogue: i32,
    out: u64,
    slot_weight: u64,
    order: u64,
    w_map: u64,
    a_map: u64,
}

/// `MoeDecode` of `kernels/moe_decode.cu`, field for field (C layout).
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

/// `MoeRouter` of `kernels/moe_shared.cu`, field for field (C layout).
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

/// The staged tiles on Hopper's warpgroup MMA (`moe_gemm_wgmma`; m4, m6 and the wide m12),
/// in the `moe_wgmma` source (built for sm_90a only).
const GEMM_WGMMA_NAMES: [[&str; 3]; 2] = [
    ["moe_gemm_f16_m4w", "moe_gemm_f16_m6w", "moe_gemm_f16_m12w"],
    [
        "moe_gemm_bf16_m4w",
        "moe_gemm_bf16_m6w",
        "moe_gemm_bf16_m12w",
    ],
];

/// The warp-specialized tiles (`moe_gemm_wgmma_tma`: a producer warp, the weights by TMA):
/// one more warp than the others.
const GEMM_WGMMA_TMA_NAMES: [[&str; 3]; 2] = [
    ["moe_gemm_f16_m4t", "moe_gemm_f16_m6t", "moe_gemm_f16_m12t"],
    [
        "moe_gemm_bf16_m4t",
        "moe_gemm_bf16_m6t",
        "moe_gemm_bf16_m12t",
    ],
];

/// The same tiles with one group of MMAs in flight across stages (`OVERLAP`).
const GEMM_WGMMA_OVERLAP_NAMES: [[&str; 3]; 2] = [
    ["moe_gemm_f16_m4o", "moe_gemm_f16_m6o", "moe_gemm_f16_m12o"],
    [
        "moe_gemm_bf16_m4o",
        "moe_gemm_bf16_m6o",
        "moe_gemm_bf16_m12o",
    ],
];

/// The 256-weight-row tiles (`moe_gemm_wgmma_x256`: 96 and 128 token rows), drained and
/// overlapped: [dtype][overlap][m6, m8].
const GEMM_WGMMA_X256_NAMES: [[[&str; 2]; 2]; 2] = [
    [
        ["moe_gemm_f16_m6x256w", "moe_gemm_f16_m8x256w"],
        ["moe_gemm_f16_m6x256o", "moe_gemm_f16_m8x256o"],
    ],
    [
        ["moe_gemm_bf16_m6x256w", "moe_gemm_bf16_m8x256w"],
        ["moe_gemm_bf16_m6x256o", "moe_gemm_bf16_m8x256o"],
    ],
];

/// The 256-weight-row tiles' warp-specialized kernels (`moe_gemm_wgmma_tma` with BN = 256:
/// a producer warpgroup, 384 threads): [dtype][m6, m8].
const GEMM_WGMMA_X256_TMA_NAMES: [[&str; 2]; 2] = [
    ["moe_gemm_f16_m6x256t", "moe_gemm_f16_m8x256t"],
    ["moe_gemm_bf16_m6x256t", "moe_gemm_bf16_m8x256t"],
];

/// Threads of the warp-specialized wgmma tiles: the two consumer warpgroups and a producer
/// warp (128 weight rows) or warpgroup (256: setmaxnreg moves registers by warpgroup).
pub(super) fn wgmma_tma_block(bn: usize) -> u32 {
    GEMM_BLOCK + if bn == WGMMA_W256_BN { 128 } else { 32 }
}

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

/// A plan's tile that no kernel instantiates (a bug in `moe::plan`, reported, not run).
fn no_tile(mt: usize, wgmma: bool) -> Error {
    Error::InvalidArgument(format!(
        "MoE grouped GEMM: no {} kernel of {mt} m16 tiles",
        if wgmma { "wgmma" } else { "mma.sync" }
    ))
}

fn no_map() -> Error {
    Error::InvalidArgument(
        "MoE grouped GEMM: the TMA wgmma tile without its weights' tensor map".into(),
    )
}

/// The kernel of a wgmma shape (`shape.wgmma`): the 256-weight-row tile, the TMA, overlap or
/// drained kernels of the 128-weight-row tiles. `w_map`: the weights' tensor map is there.
pub(super) fn wgmma_name(shape: &GemmShape, t: usize, w_map: bool) -> Result<&'static str> {
    if shape.bn == WGMMA_W256_BN {
        let mt = match shape.mt {
            6 => 0,
            8 => 1,
            other => return Err(no_tile(other, true)),
        };
        if shape.wgmma_tma {
            if !w_map {
                return Err(no_map());
            }
            return Ok(GEMM_WGMMA_X256_TMA_NAMES[t][mt]);
        }
        return Ok(GEMM_WGMMA_X256_NAMES[t][usize::from(shape.wgmma_overlap)][mt]);
    }
    if shape.bn != GEMM_BN {
        return Err(Error::InvalidArgument(format!(
            "MoE grouped GEMM: no wgmma kernel of {} weight rows",
            shape.bn
        )));
    }
    let mt = match shape.mt {
        4 => 0,
        6 => 1,
        WGMMA_WIDE_MT => 2,
        other => return Err(no_tile(other, true)),
    };
    let names = if shape.wgmma_tma {
        if !w_map {
            return Err(no_map());
        }
        &GEMM_WGMMA_TMA_NAMES
    } else if shape.wgmma_overlap {
        &GEMM_WGMMA_OVERLAP_NAMES
    } else {
        &GEMM_WGMMA_NAMES
    };
    Ok(names[t][mt])
}

fn u32_of(v: usize, what: &str) -> Result<u32> {
    u32::try_from(v).map_err(|_| Error::InvalidArgument(format!("MoE: {what} = {v} exceeds u32")))
}

impl Launcher {
    /// 0 for f16, 1 for bf16.
    pub(super) fn dtype_index(&self) -> Result<usize> {
        match self.dtype {
            DTypeKind::F16 => Ok(0),
            DTypeKind::BF16 => Ok(1),
            other => Err(Error::Unsupported(format!(
                "MoE kernels on {}",
                other.name()
            ))),
        }
    }

    pub(super) fn enqueue(&self, s: &Stream, pass: &Pass) -> Result<()> {
        self.enqueue_marked(s, pass, &mut |_| Ok(())).map(|_| ())
    }

    pub(super) fn enqueue_marked(
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
                w_map: self.w13_map,
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
                w_map: self.w2_map,
                a_map: self.act_map,
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
        self.combine(s, pass, self.y_rows, 0)?;
        mark("combine")?;
        Ok(front + 3)
    }

    /// The router, the routing and the dispatch, as few kernels as the config allows:
    /// returns how many it launched.
    pub(super) fn front(
        &self,
        s: &Stream,
        pass: &Pass,
        mark: &mut dyn FnMut(&'static str) -> Result<()>,
    ) -> Result<u32> {
        if pass.plan.prefill_router {
            return self.prefill_front(s, pass, mark, true);
        }
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

    /// The prefill router ([`Plan::prefill_router`]): the logits through cuBLAS, the routing
    /// one warp per token, and with `dispatch` the dispatch as a stable counting sort of the
    /// slots by expert over many blocks (each expert's rows in slot order) and its tail
    /// (token rows, GEMM work list). No host sync. Returns how many launches it made.
    ///
    /// [`Plan::prefill_router`]: super::plan::Plan::prefill_router
    pub(super) fn prefill_front(
        &self,
        s: &Stream,
        pass: &Pass,
        mark: &mut dyn FnMut(&'static str) -> Result<()>,
        dispatch: bool,
    ) -> Result<u32> {
        self.router_logits(s, pass)?;
        mark("router")?;
        self.prefill_route(s, pass)?;
        mark("route")?;
        if !dispatch {
            return Ok(2);
        }
        self.sorted_dispatch(s, pass)?;
        mark("dispatch")?;
        Ok(6)
    }

    /// logits [tokens, E] (f32, no bias) = x · gateᵀ through cuBLAS.
    fn router_logits(&self, s: &Stream, pass: &Pass) -> Result<()> {
        let q = s.gpu("MoE prefill router logits")?;
        let c = &self.config;
        let call = GemmCall {
            dtype: self.dtype,
            m: pass.plan.tokens,
            n: c.experts,
            k: c.hidden,
            trans_a: false,
            trans_b: true,
            tf32: false,
            f32_out: true,
            batch: 1,
            a: pass.x,
            b: self.gate,
            c: self.logits,
            stride_a: 0,
            stride_b: 0,
            stride_c: 0,
        };
        // SAFETY: x holds tokens·hidden elements of the layer's dtype, the gate experts·hidden,
        // the logits at least tokens·E f32 (Plan::logits_len); the logits overlap neither.
        unsafe { q.gpu.gemm(q.stream, &[call]) }
    }

    /// The prefill router's routing of the logits: softmax top-k (+ bias) by
    /// `moe_route_softmax`, or the grouped sigmoid router's own kernel.
    fn prefill_route(&self, s: &Stream, pass: &Pass) -> Result<()> {
        let c = &self.config;
        if c.router != Router::Softmax {
            return self.route(s, pass);
        }
        let q = s.gpu("MoE prefill routing")?;
        let tokens = pass.plan.tokens;
        let warps = (ROUTE_BLOCK / 32) as usize;
        let grid = u32_of(tokens.div_ceil(warps), "routing blocks")?;
        let args = ops::Args::new()
            .ptr(self.logits)
            .ptr(self.gate_bias)
            .u32(u32_of(tokens, "tokens")?)
            .u32(c.experts as u32)
            .u32(c.top_k as u32)
            .i32(i32::from(c.renormalize))
            .ptr(self.weights)
            .ptr(self.experts);
        // SAFETY: moe_route_softmax(const float* logits, const float* bias (nullable), u32
        // tokens, u32 experts, u32 k, int renorm, float* weights, u32* chosen): logits hold
        // tokens·E f32, bias E (or null), weights / chosen tokens·k; E <= 256 and k <= 16
        // (prefill_routes and the config's validation).
        unsafe {
            ops::launch(
                q,
                (&MOE_ROUTER, "moe_route_softmax"),
                grid,
                ROUTE_BLOCK,
                0,
                args,
            )
        }
    }

    /// The dispatch over many blocks: the stable sort of the slots' experts (counts,
    /// offsets, order and slot_pos, `ops::permute`'s sort), then `moe_dispatch_tail` (token
    /// rows and the GEMM work list, the list `moe_dispatch` writes).
    fn sorted_dispatch(&self, s: &Stream, pass: &Pass) -> Result<()> {
        let q = s.gpu("MoE prefill dispatch")?;
        let c = &self.config;
        let slots = pass.plan.slots;
        // SAFETY: the slots' expert ids (slots words, each below E: the routing wrote them),
        // the sort's scratch (sort_scratch_words(slots of the workspace's tokens, E) words,
        // at least what `slots` needs), counts E, offsets E + 1, order and slot_pos slots
        // words each; E <= MAX_BINS (validated).
        unsafe {
            ops::permute::sort_by_key_raw(
                q,
                self.experts,
                slots,
                c.experts,
                self.sort_counts,
                [self.counts, self.offsets, self.order, self.slot_pos],
            )?;
        }
        let name = "moe_dispatch_tail";
        let grid = ops::fill_grid(
            q.gpu,
            (&MOE_ROUTER, name),
            slots as u64,
            DISPATCH_BLOCK as u64,
        )?;
        let args = ops::Args::new()
            .ptr(self.order)
            .u32(u32_of(slots, "routed slots")?)
            .u32(c.experts as u32)
            .u32(c.top_k as u32)
            .u32(pass.plan.bm as u32)
            .ptr(self.counts)
            .ptr(self.offsets)
            .ptr(self.token_of)
            .ptr(self.work)
            .ptr(self.n_items);
        // SAFETY: moe_dispatch_tail(const u32* order, u32 slots, u32 E, u32 k, u32 bm, u32*
        // counts, u32* offsets, u32* token_of, u32* work, u32* n_items): order and token_of
        // hold slots words, counts E, offsets E + 1, work 2·items words (items = the most
        // tiles of `bm` rows `slots` rows can need over E experts), n_items one; E words of
        // shared memory (E <= 4096).
        unsafe {
            ops::launch(
                q,
                (&MOE_ROUTER, name),
                grid,
                DISPATCH_BLOCK,
                (c.experts * 4) as u32,
                args,
            )
        }
    }

    /// The router kernel: f32 logits (+ bias for the Softmax router) and, when the config
    /// allows ([`fused_route`]), the softmax top-k into weights / experts and the dispatch.
    pub(super) fn router(&self, s: &Stream, pass: &Pass) -> Result<()> {
        let q = s.gpu("MoE router kernel")?;
        let d = q.gpu;
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
        let (source, name) = if shape.cluster {
            (
                &MOE_ROUTER_CLUSTER,
                ROUTER_CLUSTER_NAMES[self.dtype_index()?],
            )
        } else {
            (&MOE_ROUTER, ROUTER_NAMES[self.dtype_index()?][mt])
        };
        let f = kernels::function(d, source, name)?;
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
                q.stream,
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

    pub(super) fn route(&self, s: &Stream, pass: &Pass) -> Result<()> {
        let q = s.gpu("MoE device router")?;
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
                        q,
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
                unsafe { ops::launch(q, (&MOE_ROUTER, name), grid, ROUTER_WARPS * 32, smem, args) }
            }
        }
    }

    fn dispatch(&self, s: &Stream, pass: &Pass) -> Result<()> {
        let q = s.gpu("MoE dispatch")?;
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
                q,
                (&MOE_ROUTER, "moe_dispatch"),
                1,
                DISPATCH_BLOCK,
                (2 * c.experts * 4) as u32,
                args,
            )
        }
    }

    /// The whole one-token pass in one kernel (see [`DecodeShape`]).
    fn decode(&self, s: &Stream, pass: &Pass, shape: &DecodeShape) -> Result<()> {
        let q = s.gpu("MoE decode kernel")?;
        let d = q.gpu;
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
        let f = kernels::function(d, &MOE_DECODE, name)?;
        let shared = u32_of(DecodeShape::shared_bytes(c), "decode shared memory")?;
        let resident = d.resident_blocks(&f, DECODE_BLOCK, shared)? as usize;
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
                q.stream,
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
        let q = s.gpu("MoE grouped GEMM")?;
        let d = q.gpu;
        p.n = u32_of(shape.n, "GEMM columns")?;
        p.k = u32_of(shape.k, "GEMM depth")?;
        p.splits = shape.splits as u32;
        p.k_split = u32_of(shape.k_split, "GEMM split")?;
        p.items_fastest = u32::from(shape.items_fastest);
        p.subtiles = u32_of(shape.subtiles, "GEMM tiles per work item")?;
        let t = self.dtype_index()?;
        let (source, name) = if shape.wgmma {
            (&MOE_WGMMA, wgmma_name(shape, t, p.w_map != 0)?)
        } else {
            let mt = match shape.mt {
                1 => 0,
                2 => 1,
                4 => 2,
                6 => 3,
                other => return Err(no_tile(other, false)),
            };
            (&MOE_GEMM, GEMM_NAMES[t][mt])
        };
        let f = kernels::function(d, source, name)?;
        let grid = u32_of(shape.grid(), "GEMM blocks")?;
        let shared = gemm_shared_bytes(shape.mt, shape.bn, shape.wgmma);
        // The TMA tile's producer warp (warpgroup) comes after the two consumer warpgroups.
        let block = if shape.wgmma && shape.wgmma_tma {
            wgmma_tma_block(shape.bn)
        } else {
            GEMM_BLOCK
        };
        let mut params = [&mut p as *mut GemmParams as *mut c_void];
        // SAFETY: moe_gemm_T_mMT(MoeGemm p): GemmParams is MoeGemm's C layout; `a` holds the
        // rows the work list names (row indices from the dispatch; `subtiles` · 16·mt = the
        // list's rows per item, Plan::new), `w` one n×k matrix per
        // expert, `partial` splits·rows_cap·n f32 and `tickets` one word per tile (the
        // workspace is sized from this plan), `out` rows_cap rows of the epilogue's width (T).
        // The kernel waits for the previous one before it reads anything but the weights and
        // (with early_k, written two kernels back) the work list, and before any write. The
        // TMA tile's `w_map` is a 128-byte tensor map of `w` in device memory, written once;
        // its `a_map` (or 0) one of `a` (the workspace's act, [its rows, k]) written with it.
        unsafe {
            d.launch(
                q.stream,
                &f,
                (grid, 1, 1),
                (block, 1, 1),
                shared,
                &mut params,
                LaunchMode {
                    programmatic: true,
                    ..LaunchMode::default()
                },
            )
        }
    }

    /// `y[t] = Σ_r scale · rows[slot_pos[t·k + r]]` over rows of T: `weights` (f32 per slot)
    /// applied here, or (0) rows already weighted (the device path's down projection).
    pub(super) fn combine(&self, s: &Stream, pass: &Pass, rows: u64, weights: u64) -> Result<()> {
        let q = s.gpu("MoE combine")?;
        let d = q.gpu;
        let c = &self.config;
        let t = self.dtype_index()?;
        let name = ["moe_combine_f16_f16", "moe_combine_bf16_bf16"][t];
        // One thread a run of 8 columns (moe.cu).
        let octs = (pass.plan.tokens * c.hidden / 8) as u64;
        let grid = ops::fill_grid(d, (&MOE, name), octs, 256)?;
        let args = ops::Args::new()
            .ptr(rows)
            .ptr(self.slot_pos)
            .ptr(weights)
            .u32(pass.plan.tokens as u32)
            .u32(c.top_k as u32)
            .u32(c.hidden as u32)
            .ptr(pass.y);
        // SAFETY: moe_combine_T_T(const T* y, const u32* slot_pos, const float* weights
        // (nullable), u32 tokens, u32 k, u32 hidden, T* out): rows hold slots·hidden, slot_pos
        // and weights slots entries, out tokens·hidden; hidden % 8 == 0. It waits for the
        // previous kernel before it reads or writes anything.
        unsafe { ops::launch_as(q, (&MOE, name), grid, 256, 0, args, true) }
    }
}
