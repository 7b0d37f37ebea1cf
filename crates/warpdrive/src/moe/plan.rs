use crate::device::Stream;
use crate::dtype::Float;
use crate::error::Result;
use crate::kernels::MOE_WGMMA;
use crate::memory::Buffer;
use crate::{ops, size};

use super::config::{
    gemm_blocks_per_sm, gemm_shared_bytes, prefill_router_for, wgmma_overlap_for, wgmma_tma_for,
    wgmma_w256_for, wgmma_wide_for, DecodeShape, GemmShape, MoeConfig, RouterShape, W256Rows,
    WgmmaW256, WgmmaWide, GEMM_BN, WGMMA_ONE_ROW_MIN_INTERMEDIATE, WGMMA_W256_BN, WGMMA_WIDE_MT,
};
use super::layer::inter_pad;

/// What the launch shapes depend on in the device (read once per layer).
#[derive(Debug, Clone, Copy)]
pub(super) struct Gpu {
    pub(super) sms: usize,
    pub(super) l2_bytes: usize,
    /// Thread-block clusters (compute capability 9.0 and later).
    pub(super) clusters: bool,
    /// The most shared memory a block may use (bytes, opted in).
    pub(super) shared_per_block: usize,
    /// The staged tiles run on Hopper's warpgroup MMA (where the `moe_wgmma` source, sm_90a
    /// only, builds), unless [`MoeLayer::set_warpgroup_mma`] turned it off.
    pub(super) wgmma: bool,
    /// The wgmma tiles keep one group of MMAs in flight across stages (the `o` kernels):
    /// forced on or off by [`MoeLayer::set_wgmma_overlap`], else (None) per projection by its
    /// depth and tile ([`wgmma_overlap_for`]); only with `wgmma`.
    pub(super) wgmma_overlap: Option<bool>,
    /// Which projections' wgmma tiles take the wide tile (192 token rows, one block per SM):
    /// `Some` where [`MoeLayer::set_wgmma_wide`] forces it, `None` for the plan's choice by
    /// the rows an expert gets ([`wgmma_wide_for`]); only with `wgmma`.
    pub(super) wgmma_wide: Option<WgmmaWide>,
    /// The wgmma tiles take the warp-specialized TMA kernels: forced on or off by
    /// [`MoeLayer::set_wgmma_tma`], else (None) per projection where one tile holds an
    /// expert's rows ([`wgmma_tma_for`]); only with `wgmma`. The 256-weight-row tile takes
    /// its own (`x256t`: a producer warpgroup) only where forced on.
    pub(super) wgmma_tma: Option<bool>,
    /// The projections forced onto the 256-weight-row wgmma tile ([`MoeLayer::set_wgmma_w256`];
    /// `WgmmaWide::Neither` keeps it off; `None`: the plan's choice, `wgmma_w256_for`); only
    /// with `wgmma`.
    pub(super) wgmma_w256: Option<WgmmaW256>,
    /// The grouped GEMMs' grid order forced ([`MoeLayer::set_gemm_items_fastest`]: `true`
    /// column block by column block, the items fastest; `false` item by item); `None`: the
    /// plan's (item by item where an expert's tiles fit one wave of blocks, else items
    /// fastest).
    pub(super) items_fastest: Option<bool>,
    /// The prefill router (cuBLAS logits, routing and a many-block dispatch): `Some` where
    /// [`MoeLayer::set_prefill_router`] forces it, `None` for the plan's choice
    /// ([`prefill_router_for`]).
    pub(super) prefill_router: Option<bool>,
    /// One-token passes may take the decode kernel, unless
    /// [`MoeLayer::set_decode_kernel`] turned it off.
    pub(super) decode: bool,
}

impl Gpu {
    pub(super) fn of(stream: &Stream) -> Result<Gpu> {
        stream.run(
            (),
            |()| {
                Ok(Gpu {
                    sms: 1,
                    l2_bytes: 0,
                    clusters: false,
                    shared_per_block: 0,
                    wgmma: false,
                    wgmma_overlap: None,
                    wgmma_wide: None,
                    wgmma_tma: None,
                    wgmma_w256: None,
                    items_fastest: None,
                    prefill_router: None,
                    decode: false,
                })
            },
            |(), q| {
                let d = q.gpu;
                Ok(Gpu {
                    sms: d.sm_count() as usize,
                    l2_bytes: d.l2_cache_bytes()?,
                    clusters: d.compute_capability().0 >= 9,
                    shared_per_block: d.shared_per_block_optin()?,
                    // The wgmma source declares sm_90a only: elsewhere it has no arch to
                    // build for.
                    wgmma: MOE_WGMMA.arch_for(d.arch()).is_ok(),
                    wgmma_overlap: None,
                    wgmma_wide: None,
                    wgmma_tma: None,
                    wgmma_w256: None,
                    items_fastest: None,
                    prefill_router: None,
                    decode: true,
                })
            },
        )
    }
}

/// The launch shapes of a forward pass over `tokens` tokens on the device path.
#[derive(Debug, Clone, Copy)]
pub(super) struct Plan {
    pub(super) tokens: usize,
    pub(super) slots: usize,
    /// Rows per item of the dispatch's work list: 16 · the larger mt of the two GEMMs (each
    /// GEMM takes an item as its `subtiles` row tiles).
    pub(super) bm: usize,
    /// Items the dispatch's work list can hold at most (tiles of `bm` rows).
    pub(super) items: usize,
    pub(super) router: RouterShape,
    /// The router runs as the prefill router (cuBLAS logits, `moe_route_softmax` or the
    /// grouped sigmoid kernel, then a stable counting sort and `moe_dispatch_tail`) instead
    /// of the fused router kernel.
    pub(super) prefill_router: bool,
    pub(super) up: GemmShape,
    pub(super) down: GemmShape,
    /// The down projection's blocks prefetch the first `down_early_k` k of their weights
    /// into L2 while the gate/up GEMM finishes (0: none): all of them when the experts the
    /// pass likely touches fit in half the L2; while one wave of blocks covers the pass, the
    /// share of each block's slice that fits in half the L2 together (more would be evicted
    /// before use and read twice); otherwise none (later waves start after the wait).
    pub(super) down_early_k: usize,
    /// One token on the decode kernel instead of the router, GEMM and combine kernels.
    pub(super) decode: Option<DecodeShape>,
}

/// m16 tiles per block for groups of `rows` rows on average: the busiest groups hold
/// about twice the average, and each extra tile of a group streams its weights again (above
/// 32 rows on average the 96-row tile holds most groups whole — mixtral at 256 tokens puts
/// 54–72 rows on each expert — where 64-row tiles left tail tiles; bench/NOTES.md, MoE
/// grouped GEMM).
///
/// With `wgmma` the staged 64-row tile (its MMAs cover only the live rows, its 4-stage ring
/// keeps more weight bytes in flight than the decode tiles' register fragments) replaces
/// the decode and middle tiles from 2 rows per expert, and at 1 row where the experts'
/// `intermediate` depth keeps the ring busy (at 1 row it lost on shallow experts;
/// bench/NOTES.md, MoE grouped GEMM).
pub(super) fn m_tiles(rows: usize, wgmma: bool, intermediate: usize) -> usize {
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
    pub(super) fn new(c: &MoeConfig, tokens: usize, gpu: Gpu) -> Plan {
        let Gpu {
            sms,
            l2_bytes,
            clusters,
            shared_per_block,
            wgmma,
            wgmma_overlap,
            wgmma_wide,
            wgmma_tma,
            wgmma_w256,
            items_fastest: order,
            prefill_router,
            ..
        } = gpu;
        let slots = tokens * c.top_k;
        let active = c.experts.min(slots).max(1);
        let rows_per_expert = slots.div_ceil(active);
        let mut mt = m_tiles(rows_per_expert, wgmma, c.intermediate);
        // A prefill tile whose stages do not fit the device's shared memory (before compute
        // capability 9.0 many GPUs allow about 100 KB per block) gives way to a smaller one.
        while mt >= 4 && gemm_shared_bytes(mt, GEMM_BN, wgmma) as usize > shared_per_block {
            mt = if mt > 4 { 4 } else { 2 };
        }
        // The wide tile, where chosen, takes a projection's wgmma tiles (one expert's rows at
        // up to 192 stream its weights once instead of in 96-row tiles; bench/NOTES.md, MoE
        // wide tile); where its stages do not fit, the tile above. Forced per projection, else
        // both by the rows an expert gets.
        let wide_fits = wgmma
            && mt >= 4
            && gemm_shared_bytes(WGMMA_WIDE_MT, GEMM_BN, true) as usize <= shared_per_block;
        let wide = |forced: Option<bool>| wide_fits && wgmma_wide_for(rows_per_expert, forced);
        let up_mt = if wide(wgmma_wide.map(|w| w.gate_up())) {
            WGMMA_WIDE_MT
        } else {
            mt
        };
        let down_mt = if wide(wgmma_wide.map(|w| w.down())) {
            WGMMA_WIDE_MT
        } else {
            mt
        };
        // The 256-weight-row tile where forced, else by the rows an expert gets, where its
        // stages fit: it takes its projections whatever the wide choice.
        let w256 = wgmma_w256
            .or_else(|| {
                wgmma_w256_for(rows_per_expert)
                    .then(|| WgmmaW256::new(WgmmaWide::Both, W256Rows::Rows128))
            })
            .filter(|w| {
                w.on != WgmmaWide::Neither
                    && wgmma
                    && mt >= 4
                    && gemm_shared_bytes(w.rows.mt(), WGMMA_W256_BN, true) as usize
                        <= shared_per_block
            });
        let (up_mt, down_mt) = match w256 {
            Some(w) => w256_mts(w, up_mt, down_mt),
            None => (up_mt, down_mt),
        };
        let on_w256 =
            |gate_up: bool| w256.filter(|w| if gate_up { w.on.gate_up() } else { w.on.down() });
        let wgmma = wgmma && mt >= 4;
        // One work list for both GEMMs, in the wider tile's items (192 rows divide by 96 and
        // 64: a narrower GEMM takes each item as `subtiles` tiles of its own).
        let bm = 16 * up_mt.max(down_mt);
        let items = active + slots / bm;
        // The overlap kernel per projection, from its depth per block and tile unless forced.
        let on_wgmma = |shape: GemmShape, w256: bool| GemmShape {
            wgmma,
            wgmma_overlap: wgmma
                && wgmma_overlap_for(shape.k_split, w256, rows_per_expert, wgmma_overlap),
            wgmma_tma: wgmma && wgmma_tma_for(rows_per_expert, shape.mt, wgmma_tma),
            ..shape
        };
        let gemm = |n: usize, k: usize, mt: usize, w256: Option<WgmmaW256>| {
            let subtiles = bm / (16 * mt);
            let bn = if w256.is_some() {
                WGMMA_W256_BN
            } else {
                GEMM_BN
            };
            let shape = GemmShape {
                subtiles,
                ..on_wgmma(
                    GemmShape::new(n, k, (mt, bn), (items * subtiles, active), 256, sms),
                    w256.is_some(),
                )
            };
            GemmShape {
                // This tile's warp-specialized kernel (`x256t`) only where forced.
                wgmma_tma: if w256.is_some() {
                    shape.wgmma && wgmma_tma == Some(true)
                } else {
                    shape.wgmma_tma
                },
                items_fastest: order.unwrap_or(shape.items_fastest),
                ..shape
            }
        };
        let down = gemm(c.hidden, c.intermediate, down_mt, on_w256(false));
        Plan {
            tokens,
            slots,
            bm,
            items,
            router: RouterShape::new(c, tokens, sms, clusters),
            prefill_router: prefill_router_for(c, tokens, prefill_router),
            decode: DecodeShape::new(c, tokens, gpu),
            down_early_k: down_prefetch(c, &down, active, l2_bytes, sms),
            up: gemm(2 * c.intermediate, c.hidden, up_mt, on_w256(true)),
            down,
        }
    }
    pub(super) fn partial_len(&self) -> usize {
        self.up
            .partial_len(self.slots)
            .max(self.down.partial_len(self.slots))
    }
    /// Logits of the router (one set per K split).
    pub(super) fn logits_len(&self, c: &MoeConfig) -> usize {
        (self.router.splits * self.tokens * c.experts)
            .max(self.decode.map_or(0, |d| d.router_segs * c.experts))
    }
    pub(super) fn tickets_len(&self) -> usize {
        // The router: one per row tile and one for the dispatch; the decode kernel: 3.
        (self.router.row_tiles + 1)
            .max(3)
            .max(self.up.tiles())
            .max(self.down.tiles())
    }
}

/// The m16 tiles of (gate/up, down) with the 256-weight-row tile `w` on its projections and
/// the plan's `up_mt` / `down_mt` on the others: one work list serves both GEMMs, so where
/// the two tiles' rows do not divide one another the other projection's tile changes (a
/// 96-row or 192-row one beside the 128-row tile becomes the 64-row one; a 64-row one beside
/// the 96-row tile the 96-row one).
pub(super) fn w256_mts(w: WgmmaW256, up_mt: usize, down_mt: usize) -> (usize, usize) {
    let wm = w.rows.mt();
    let fit = |other: usize| {
        if other.max(wm) % other.min(wm) == 0 {
            other
        } else if wm == 8 {
            4
        } else {
            6
        }
    };
    match (w.on.gate_up(), w.on.down()) {
        (true, true) => (wm, wm),
        (true, false) => (wm, fit(down_mt)),
        (false, true) => (fit(up_mt), wm),
        (false, false) => (up_mt, down_mt),
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
    if blocks > gemm_blocks_per_sm(down.mt, down.bn) * sms {
        return 0;
    }
    // Whole 128-byte lines of each of the block's rows.
    let per_row = budget / blocks / (down.bn * dtype);
    let line = 128 / dtype;
    (per_row / line * line).min(down.k_split)
}

/// The most K splits a grouped GEMM takes (see `GemmShape::new`).
pub(super) const GEMM_MAX_SPLITS: usize = 64;

/// Fails with `InvalidArgument` unless every size a pass over `tokens` tokens derives (plans,
/// workspace, the CPU backend's f64 rows) fits `usize`: each is at most slots × the widest
/// row (hidden, 2 × padded intermediate, or experts) × [`GEMM_MAX_SPLITS`] elements of at
/// most 8 bytes. Passes past that bound could never be allocated anyway.
pub(super) fn check_pass(c: &MoeConfig, tokens: usize) -> Result<()> {
    let widest = c.hidden.max(2 * inter_pad(c.intermediate)).max(c.experts);
    size::product(
        format_args!("MoE pass of {tokens} tokens (tokens × top_k × widest row × splits × 8)"),
        &[tokens, c.top_k, widest, GEMM_MAX_SPLITS, 8],
    )
    .map(|_| ())
}

/// Device memory of the forward passes, sized for `tokens` tokens (graphs of smaller
/// counts share it, since they replay one at a time on the layer's stream).
pub(super) struct Workspace<T: Float> {
    pub(super) tokens: usize,
    pub(super) logits: Buffer<f32>,
    pub(super) weights: Buffer<f32>,
    pub(super) experts: Buffer<u32>,
    pub(super) counts: Buffer<u32>,
    pub(super) offsets: Buffer<u32>,
    pub(super) order: Buffer<u32>,
    pub(super) token_of: Buffer<u32>,
    pub(super) slot_pos: Buffer<u32>,
    pub(super) work: Buffer<u32>,
    pub(super) n_items: Buffer<u32>,
    pub(super) tickets: Buffer<u32>,
    /// The prefill dispatch's sort: per-tile counts of each expert
    /// (`ops::permute::sort_scratch_words`).
    pub(super) sort_counts: Buffer<u32>,
    pub(super) partial: Buffer<f32>,
    pub(super) act: Buffer<T>,
    /// Device path: the weighted down projection per permuted row (T, rounded once from the
    /// f32 accumulators).
    pub(super) y: Buffer<T>,
    /// cuBLAS path: gathered inputs, gate/up output, down output (T).
    pub(super) cublas: Option<[Buffer<T>; 3]>,
    /// cuBLAS path: the device pointer arrays of its two grouped GEMMs (6 words per expert).
    pub(super) gemm_pointers: Option<Buffer<u64>>,
    /// The warp-specialized wgmma tile's TMA map of `act` (one 128-byte map; encoded by
    /// `MoeLayer::prepare` on the first plan whose down GEMM takes that tile, dropped with
    /// the workspace: graphs that captured its address are dropped first).
    pub(super) act_map: Option<Buffer<u64>>,
}

impl<T: Float> Workspace<T> {
    pub(super) fn new(
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
        let items = max(&|p| p.items);
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
            sort_counts: Buffer::uninit(
                stream,
                ops::permute::sort_scratch_words(slots, c.experts),
            )?,
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
            act_map: None,
        })
    }
}
