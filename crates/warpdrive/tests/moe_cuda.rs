//! The MoE layer on CUDA against the CPU backend (`gpu_smem_*`, ignored without a GPU): bf16
//! tolerances under identical routing (routing flips counted and bounded separately), every
//! kernel family the plan can choose (wgmma drained, overlapped and wide, mma.sync, decode,
//! the prefill router, the cuBLAS path), graph replay against eager, f32 refused.
//! Tolerances and the reference: tests/common/moe.rs.

mod common;

use common::moe::*;
use common::{cuda, random_f32, rng, seed};
use half::bf16;
use warpdrive::moe::{
    MoeConfig, MoeLayer, MoePath, MoeWeights, Router, W256Rows, WgmmaW256, WgmmaWide,
    GRAPH_MAX_TOKENS,
};
use warpdrive::{Buffer, DTypeKind, Error};

/// The 256-weight-row tile kept off: the overlap, wide and TMA tests cover their own kernels
/// where the plan would now take that tile (128 rows an expert or more).
const W256_OFF: Option<WgmmaW256> = Some(WgmmaW256 {
    on: WgmmaWide::Neither,
    rows: W256Rows::Rows128,
});

#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_smem_moe_matches_cpu() {
    let s = seed("gpu_smem_moe_matches_cpu");
    let small = config(72, 40, 7, 3, Router::Softmax, DTypeKind::BF16);
    let tokens = [1, 5, 37, GRAPH_MAX_TOKENS, GRAPH_MAX_TOKENS + 45];
    few_flips_at(&tokens, small, run(MoePath::Auto, true), s, "small");
    // Above the graph sizes the device kernels run eagerly (what Auto also picks for
    // experts this small), in 96-row tiles.
    assert_few_flips(
        cuda_vs_cpu(small, GRAPH_MAX_TOKENS + 45, run(MoePath::Device, true), s),
        "small, device path",
    );
    // Split-K (deep rows, few tokens) and several m-tiles per expert (many tokens, 8 experts).
    let deep = config(1024, 256, 8, 2, Router::Softmax, DTypeKind::BF16);
    few_flips_at(
        &[1, 3, 256],
        deep,
        run(MoePath::Device, false),
        s + 1,
        "deep",
    );
    // Deep experts (intermediate >= 1024): on Hopper one row per expert takes the staged
    // wgmma tile, its down projection split over K.
    let deep_experts = config(256, 1024, 8, 2, Router::Softmax, DTypeKind::BF16);
    few_flips_at(
        &[1, 3, 40],
        deep_experts,
        run(MoePath::Device, true),
        s + 8,
        "deep experts",
    );
    // A deep router (hidden >= 2 × 1024): its K splits summed by the routing block; one
    // tile, half tiles and full tiles of tokens.
    let deep_router = config(3072, 64, 24, 3, Router::Softmax, DTypeKind::BF16);
    few_flips_at(
        &[1, 40, 200],
        deep_router,
        run(MoePath::Auto, true),
        s + 4,
        "deep router",
    );
    // The clustered router (Hopper, up to 64 tokens over at most 128 experts): a full
    // cluster of 8 blocks; one row tile (dispatched from shared memory) and several; a
    // last block with 4 of its 16 experts and the most slots a tile can hold (16 × 16).
    let clustered = config(256, 32, 128, 8, Router::Softmax, DTypeKind::BF16);
    few_flips_at(
        &[1, 16, 64],
        clustered,
        run(MoePath::Auto, true),
        s + 5,
        "clustered",
    );
    let partial = config(64, 32, 100, 16, Router::Softmax, DTypeKind::BF16);
    few_flips_at(
        &[16, 50],
        partial,
        run(MoePath::Auto, true),
        s + 6,
        "clustered, partial block",
    );
    // f16 weights and activations: the decode, middle and prefill tiles and the clustered
    // router (bf16 everywhere else).
    let half = config(72, 40, 7, 3, Router::Softmax, DTypeKind::F16);
    few_flips_at(
        &[1, 37, 301],
        half,
        run(MoePath::Device, true),
        s + 7,
        "f16",
    );
    // More experts than one router block routes: the separate softmax top-k kernel.
    let wide = config(64, 32, 300, 4, Router::Softmax, DTypeKind::BF16);
    few_flips_at(&[3, 40], wide, run(MoePath::Auto, true), s + 3, "wide");
    let grouped = config(64, 48, 32, 4, GROUPED, DTypeKind::BF16);
    few_flips_at(
        &[1, 29, 200],
        grouped,
        run(MoePath::Auto, true),
        s + 2,
        "grouped",
    );
}

/// The wgmma overlap kernels (issue 40; by default only on blocks at least 2560 deep and
/// where an expert's rows take more than one tile, so forced here, the TMA kernels off): 64- and 96-row tiles at 1, 5, 37, 301 and 4,097 tokens, split-K gate/up
/// (deep), one row per deep expert with most of 64 experts empty, every token on one expert
/// (k = 1: one expert's many tiles), f16, graphs on and off; and the plan's own choice on
/// a layer whose gate/up blocks run 2624 deep (overlap) and its down projection 256
/// (drained; `moe::tests` checks that plan). Where the GPU has no wgmma this runs the
/// mma.sync tiles.
#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_smem_moe_wgmma_overlap_matches_cpu() {
    let s = seed("gpu_smem_moe_wgmma_overlap_matches_cpu");
    let overlap = |graphs| Run {
        overlap: Some(true),
        tma: Some(false),
        w256: W256_OFF,
        ..run(MoePath::Device, graphs)
    };
    let small = config(72, 40, 7, 3, Router::Softmax, DTypeKind::BF16);
    few_flips_at(
        &[1, 5, 37, 301, 4097],
        small,
        overlap(true),
        s,
        "small, overlap",
    );
    let deep = config(1024, 256, 8, 2, Router::Softmax, DTypeKind::BF16);
    few_flips_at(&[3, 256], deep, overlap(false), s + 1, "deep, overlap");
    let sparse = config(256, 1024, 64, 2, Router::Softmax, DTypeKind::BF16);
    few_flips_at(
        &[1, 5, 40],
        sparse,
        overlap(true),
        s + 2,
        "empty experts, overlap",
    );
    let one = Run {
        one_expert: true,
        ..overlap(true)
    };
    let single = config(72, 40, 7, 1, Router::Softmax, DTypeKind::BF16);
    few_flips_at(&[1, 301, 4097], single, one, s + 3, "one expert, overlap");
    let half = config(72, 40, 7, 3, Router::Softmax, DTypeKind::F16);
    few_flips_at(&[37, 301], half, overlap(true), s + 4, "f16, overlap");
    few_flips_at(
        &[301, 1025],
        mixed_depths(),
        run(MoePath::Device, true),
        s + 5,
        "overlap on the deep projection only",
    );
}

/// A layer whose gate/up blocks run 2624 deep (one K split: 64 experts × 4 column blocks
/// fill a wave of either tile) and its down projection 256 deep: by default the plan takes the
/// overlap kernel for the first GEMM only.
fn mixed_depths() -> MoeConfig {
    config(2624, 256, 64, 2, Router::Softmax, DTypeKind::BF16)
}

/// The wide wgmma tile (issue 40; off by default, so forced here: every wgmma tile 192 rows,
/// one block per SM), drained and overlapped (`wide_cases`): 1, 5, 37, 301 and 4,097 tokens
/// (up to ten 192-row tiles per expert), split-K gate/up (deep), one row per deep expert with
/// most of 64 experts empty, every token on one expert (k = 1: 4,097 rows in 22 tiles, the
/// other experts empty), f16, graphs on and off, and the plan's per-projection overlap. Where
/// the GPU has no wgmma this runs the mma.sync tiles.
#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_smem_moe_wgmma_wide_matches_cpu() {
    wide_cases(WgmmaWide::Both, seed("gpu_smem_moe_wgmma_wide_matches_cpu"));
}

/// The wide tile on one projection only (`WgmmaWide::GateUp`, `WgmmaWide::Down`): the
/// work list in 192-row items, which the other GEMM takes as 2 (96-row) or 3 (64-row: 5 and
/// 37 tokens of the small layer) tiles of its own, the ones past an expert's rows empty; the
/// wide test's cases (graphs on and off, split-K, empty experts, one expert with 4,097 rows,
/// f16, the plan's overlap per projection).
#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_smem_moe_wgmma_wide_per_projection_matches_cpu() {
    let s = seed("gpu_smem_moe_wgmma_wide_per_projection_matches_cpu");
    wide_cases(WgmmaWide::GateUp, s);
    wide_cases(WgmmaWide::Down, s + 16);
}

/// The wide tests' cases with the wide tile forced on `which` projections, on the `w` / `o`
/// kernels (the TMA kernels forced off: the plan takes them where one tile holds an expert's
/// rows; the TMA test runs them wide).
fn wide_cases(which: WgmmaWide, s: u64) {
    let wide = |graphs, overlap| Run {
        wide: Some(which),
        overlap,
        tma: Some(false),
        w256: W256_OFF,
        ..run(MoePath::Device, graphs)
    };
    let small = config(72, 40, 7, 3, Router::Softmax, DTypeKind::BF16);
    let tokens = [1, 5, 37, 301, 4097];
    few_flips_at(
        &tokens,
        small,
        wide(true, Some(false)),
        s,
        &format!("small, wide, {which:?}"),
    );
    few_flips_at(
        &tokens,
        small,
        wide(true, Some(true)),
        s + 1,
        &format!("small, wide, overlap, {which:?}"),
    );
    let deep = config(1024, 256, 8, 2, Router::Softmax, DTypeKind::BF16);
    few_flips_at(
        &[3, 256],
        deep,
        wide(false, Some(false)),
        s + 2,
        &format!("deep, wide, {which:?}"),
    );
    few_flips_at(
        &[3, 256],
        deep,
        wide(false, Some(true)),
        s + 3,
        &format!("deep, wide, overlap, {which:?}"),
    );
    let sparse = config(256, 1024, 64, 2, Router::Softmax, DTypeKind::BF16);
    few_flips_at(
        &[1, 5, 40],
        sparse,
        wide(true, Some(true)),
        s + 4,
        &format!("empty experts, wide, {which:?}"),
    );
    let single = config(72, 40, 7, 1, Router::Softmax, DTypeKind::BF16);
    for overlap in [Some(false), Some(true)] {
        let one = Run {
            one_expert: true,
            ..wide(true, overlap)
        };
        few_flips_at(
            &[1, 301, 4097],
            single,
            one,
            s + 5,
            &format!("one expert, wide, {which:?}"),
        );
    }
    let half = config(72, 40, 7, 3, Router::Softmax, DTypeKind::F16);
    few_flips_at(
        &[37, 301],
        half,
        wide(true, Some(true)),
        s + 6,
        &format!("f16, wide, {which:?}"),
    );
    few_flips_at(
        &[301, 1025],
        mixed_depths(),
        wide(true, None),
        s + 7,
        &format!("wide, overlap on the deep projection only, {which:?}"),
    );
}

/// The warp-specialized TMA wgmma tiles (issue 40; off by default, so forced here: the
/// weights by TMA from the layer's tensor maps, the token rows by a producer warp's cp.async,
/// full / empty mbarriers per ring slot) on the 64/96-row tiles and the wide tile: 1, 5, 37,
/// 301 and 4,097 tokens of a layer whose widths are no multiple of the 128-row box or the
/// 64-k stage (hidden 72, intermediate 40: both boxes run past the tensor and are
/// zero-filled), split-K (deep: stages that straddle a split's end), the down GEMM's token
/// rows by TMA (act's 32-row boxes: every down GEMM here, split-K where the splits are whole
/// stages) and by the consumers' cp.async (a down split ending inside a stage), most of 64
/// experts empty, one token on the TMA tile (decode kernel off), every token on one expert (4,097
/// rows), f16, graphs on and off. Where the GPU has
/// no wgmma this runs the mma.sync tiles.
#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_smem_moe_wgmma_tma_matches_cpu() {
    let s = seed("gpu_smem_moe_wgmma_tma_matches_cpu");
    let tma = |graphs, wide: bool| Run {
        tma: Some(true),
        wide: wide.then_some(WgmmaWide::Both),
        w256: W256_OFF,
        ..run(MoePath::Device, graphs)
    };
    let small = config(72, 40, 7, 3, Router::Softmax, DTypeKind::BF16);
    let tokens = [1, 5, 37, 301, 4097];
    few_flips_at(&tokens, small, tma(true, false), s, "small, tma");
    few_flips_at(&tokens, small, tma(false, true), s + 1, "small, tma, wide");
    let deep = config(1024, 256, 8, 2, Router::Softmax, DTypeKind::BF16);
    few_flips_at(&[3, 256], deep, tma(false, false), s + 2, "deep, tma");
    few_flips_at(&[3, 256], deep, tma(true, true), s + 3, "deep, tma, wide");
    let sparse = config(256, 1024, 64, 2, Router::Softmax, DTypeKind::BF16);
    few_flips_at(
        &[1, 5, 40],
        sparse,
        tma(true, false),
        s + 4,
        "empty experts, tma",
    );
    // The down GEMM split at 288 k (I = 1,120, 4 splits at 1 and 5 tokens): the first three
    // splits end inside a 64-k stage, so their token rows come by the consumers' cp.async,
    // the last one's (ending at I) and the 576-k splits' at 40 tokens by TMA boxes of act.
    let odd_split = config(256, 1120, 64, 2, Router::Softmax, DTypeKind::BF16);
    few_flips_at(
        &[1, 5, 40],
        odd_split,
        tma(true, false),
        s + 9,
        "odd down split, tma",
    );
    // One token on the TMA tile itself (deep experts take the wgmma tile from one row; the
    // decode kernel would take it otherwise): 1-row tiles, 62 of 64 experts empty.
    let one_token = Run {
        decode: false,
        ..tma(false, false)
    };
    few_flips_at(&[1, 2], sparse, one_token, s + 8, "one token, tma");
    let single = config(72, 40, 7, 1, Router::Softmax, DTypeKind::BF16);
    for wide in [false, true] {
        let one = Run {
            one_expert: true,
            ..tma(true, wide)
        };
        few_flips_at(&[1, 301, 4097], single, one, s + 5, "one expert, tma");
    }
    let half = config(72, 40, 7, 3, Router::Softmax, DTypeKind::F16);
    few_flips_at(&[37, 301], half, tma(true, false), s + 6, "f16, tma");
    few_flips_at(
        &[301, 1025],
        mixed_depths(),
        tma(true, false),
        s + 7,
        "mixed depths, tma",
    );
}

/// The 256-weight-row wgmma tile (issue 40; by default from 128 rows an expert, forced here:
/// 96 and 128 token rows × 256 weight rows, one block per SM) on both projections
/// (`w256_cases`): 1, 5, 37, 301 and 4,097 tokens, drained and overlapped, graphs on and off, split-K gate/up
/// (deep: 256-column partials), widths past one 256-row block and no multiple of it or of the
/// 64-k stage (hidden 328, intermediate 200), most of 64 experts empty, every token on one
/// expert (4,097 rows), f16, the plan's overlap per projection, and the tiles in column-block
/// order (`set_gemm_items_fastest`); then the plan's own tiles in either forced order. Where
/// the GPU has no wgmma this runs the mma.sync tiles.
#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_smem_moe_wgmma_w256_matches_cpu() {
    let s = seed("gpu_smem_moe_wgmma_w256_matches_cpu");
    w256_cases(WgmmaWide::Both, W256Rows::Rows128, None, s);
    w256_cases(WgmmaWide::Both, W256Rows::Rows96, None, s + 32);
    // The plan's own tiles in either forced grid order (`set_gemm_items_fastest`).
    let small = config(72, 40, 7, 3, Router::Softmax, DTypeKind::BF16);
    let deep = config(1024, 256, 8, 2, Router::Softmax, DTypeKind::BF16);
    for (j, order) in [false, true].into_iter().enumerate() {
        let r = Run {
            items_fastest: Some(order),
            ..run(MoePath::Device, true)
        };
        let what = format!("plan's tiles, items fastest {order}");
        few_flips_at(&[301, 4097], small, r, s + 64 + j as u64, &what);
        few_flips_at(&[256], deep, r, s + 66 + j as u64, &what);
    }
}

/// The 256-weight-row tile on one projection (`GateUp`, `Down`; 96 and 128 token rows): the
/// other GEMM on the plan's tile, or on the one that fits the work list (64 rows beside 128,
/// 96 beside 96, 2 sub-tiles an item beside the plan's 192-row tile); the cases of
/// `gpu_smem_moe_wgmma_w256_matches_cpu`.
#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_smem_moe_wgmma_w256_per_projection_matches_cpu() {
    let s = seed("gpu_smem_moe_wgmma_w256_per_projection_matches_cpu");
    for (i, on) in [WgmmaWide::GateUp, WgmmaWide::Down].into_iter().enumerate() {
        let s = s + 64 * i as u64;
        w256_cases(on, W256Rows::Rows128, None, s);
        w256_cases(on, W256Rows::Rows96, None, s + 32);
    }
}

/// The 256-weight-row tile's warp-specialized kernel (`x256t`, issue 40; forced only: a
/// producer warpgroup issues the weights' two TMA boxes a stage and act's boxes or loads the
/// gathered rows by cp.async, setmaxnreg, the consumers multiply): the cases of
/// `w256_cases` on both projections at 128 and 96 token rows and on each projection alone
/// at 128 (odd widths: a column block whose second weight box starts past n; split-K gate/up
/// and down; 4,097 rows on one expert), then the TMA test's down splits ending inside a
/// stage (act rows by the producer warpgroup's cp.async) and one token on the tile.
#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_smem_moe_wgmma_w256_tma_matches_cpu() {
    let s = seed("gpu_smem_moe_wgmma_w256_tma_matches_cpu");
    w256_cases(WgmmaWide::Both, W256Rows::Rows128, Some(true), s);
    w256_cases(WgmmaWide::Both, W256Rows::Rows96, Some(true), s + 32);
    for (i, on) in [WgmmaWide::GateUp, WgmmaWide::Down].into_iter().enumerate() {
        w256_cases(on, W256Rows::Rows128, Some(true), s + 64 + 16 * i as u64);
    }
    let tma = |graphs| Run {
        tma: Some(true),
        w256: Some(WgmmaW256::new(WgmmaWide::Both, W256Rows::Rows128)),
        ..run(MoePath::Device, graphs)
    };
    let odd_split = config(256, 1120, 64, 2, Router::Softmax, DTypeKind::BF16);
    few_flips_at(
        &[1, 5, 40],
        odd_split,
        tma(true),
        s + 96,
        "odd down split, 256 weight rows, tma",
    );
    let sparse = config(256, 1024, 64, 2, Router::Softmax, DTypeKind::BF16);
    let one_token = Run {
        decode: false,
        ..tma(false)
    };
    few_flips_at(
        &[1, 2],
        sparse,
        one_token,
        s + 97,
        "one token, 256 weight rows, tma",
    );
}

/// The 256-weight-row tests' cases with that tile forced on `on` with `rows` token rows (and
/// the TMA kernels forced as `tma`).
fn w256_cases(on: WgmmaWide, rows: W256Rows, tma: Option<bool>, s: u64) {
    let w256 = |graphs, overlap| Run {
        w256: Some(WgmmaW256::new(on, rows)),
        overlap,
        tma,
        ..run(MoePath::Device, graphs)
    };
    let what = |case: &str| format!("{case}, 256 weight rows, {on:?}, {rows:?}, tma {tma:?}");
    let small = config(72, 40, 7, 3, Router::Softmax, DTypeKind::BF16);
    let tokens = [1, 5, 37, 301, 4097];
    few_flips_at(&tokens, small, w256(true, Some(false)), s, &what("small"));
    few_flips_at(
        &tokens,
        small,
        w256(false, Some(true)),
        s + 1,
        &what("small, overlap, eager"),
    );
    let deep = config(1024, 256, 8, 2, Router::Softmax, DTypeKind::BF16);
    for (j, overlap) in [Some(false), Some(true)].into_iter().enumerate() {
        few_flips_at(
            &[3, 256],
            deep,
            w256(false, overlap),
            s + 2 + j as u64,
            &what("deep, split-K"),
        );
    }
    let odd = config(328, 200, 16, 4, Router::Softmax, DTypeKind::BF16);
    few_flips_at(
        &[37, 301, 1025],
        odd,
        w256(true, None),
        s + 4,
        &what("odd widths"),
    );
    let sparse = config(256, 1024, 64, 2, Router::Softmax, DTypeKind::BF16);
    few_flips_at(
        &[1, 5, 40],
        sparse,
        w256(true, Some(true)),
        s + 5,
        &what("empty experts"),
    );
    let single = config(72, 40, 7, 1, Router::Softmax, DTypeKind::BF16);
    for overlap in [Some(false), Some(true)] {
        let one = Run {
            one_expert: true,
            ..w256(true, overlap)
        };
        few_flips_at(&[1, 301, 4097], single, one, s + 6, &what("one expert"));
    }
    let half = config(72, 40, 7, 3, Router::Softmax, DTypeKind::F16);
    few_flips_at(
        &[37, 301],
        half,
        w256(true, Some(true)),
        s + 7,
        &what("f16"),
    );
    let odd_half = config(328, 200, 16, 4, Router::Softmax, DTypeKind::F16);
    few_flips_at(
        &[301],
        odd_half,
        w256(false, Some(false)),
        s + 8,
        &what("f16, odd widths"),
    );
    few_flips_at(
        &[301, 1025],
        mixed_depths(),
        w256(true, None),
        s + 9,
        &what("the plan's overlap per projection"),
    );
    let fastest = Run {
        items_fastest: Some(true),
        ..w256(true, None)
    };
    few_flips_at(
        &[4097],
        small,
        fastest,
        s + 10,
        &what("small, items fastest"),
    );
    few_flips_at(&[256], deep, fastest, s + 11, &what("deep, items fastest"));
}

/// The prefill router (issue 40; by default from `PREFILL_ROUTER_MIN_TOKENS` tokens) through
/// the whole layer: forced at odd counts below, at and above its size (graphs on: a captured
/// pass holds its cuBLAS call), every token on one expert, the grouped sigmoid router, a
/// deep router, k = 16, f16; and the fused router forced at 4,097 tokens. The routing
/// against the fused router's: `moe::prefill_tests` (GPU, in the library's unit tests).
#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_smem_moe_prefill_router_matches_cpu() {
    let s = seed("gpu_smem_moe_prefill_router_matches_cpu");
    let prefill = |on, graphs| Run {
        prefill: Some(on),
        ..run(MoePath::Device, graphs)
    };
    let small = config(72, 40, 7, 3, Router::Softmax, DTypeKind::BF16);
    let tokens = [1, 37, 257, 1000, 4097];
    few_flips_at(
        &tokens,
        small,
        prefill(true, true),
        s,
        "small, prefill router",
    );
    few_flips_at(
        &[4097],
        small,
        prefill(false, true),
        s + 1,
        "small, fused router",
    );
    let one = Run {
        one_expert: true,
        ..prefill(true, true)
    };
    let single = config(72, 40, 7, 1, Router::Softmax, DTypeKind::BF16);
    few_flips_at(
        &[301, 4097],
        single,
        one,
        s + 2,
        "one expert, prefill router",
    );
    let grouped = config(64, 48, 32, 4, GROUPED, DTypeKind::BF16);
    few_flips_at(
        &[29, 1000],
        grouped,
        prefill(true, true),
        s + 3,
        "grouped, prefill router",
    );
    let deep_router = config(3072, 64, 24, 3, Router::Softmax, DTypeKind::BF16);
    few_flips_at(
        &[1000],
        deep_router,
        prefill(true, false),
        s + 4,
        "deep router, prefill",
    );
    let k16 = config(64, 32, 100, 16, Router::Softmax, DTypeKind::BF16);
    few_flips_at(
        &[50, 600],
        k16,
        prefill(true, true),
        s + 5,
        "k = 16, prefill router",
    );
    let half = config(72, 40, 7, 3, Router::Softmax, DTypeKind::F16);
    few_flips_at(
        &[1000],
        half,
        prefill(true, false),
        s + 6,
        "f16, prefill router",
    );
    // Auto above the graph sizes with the plan's choice (the prefill router).
    few_flips_at(
        &[1025],
        mixed_depths(),
        run(MoePath::Auto, true),
        s + 7,
        "mixed depths",
    );
}

/// Every tile on mma.sync (what GPUs before Hopper run; on Hopper the staged wgmma tiles
/// take over from 2 rows per expert): the decode and middle tiles (small: 5 tokens put 3
/// rows on each expert, 37 put 16), the 96-row tile with split-K gate/up (deep, 256
/// tokens), the 64-row tile (grouped, 200), f16, and the eager device path above the graph
/// sizes.
#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_smem_moe_mma_sync_tiles_match_cpu() {
    let s = seed("gpu_smem_moe_mma_sync_tiles_match_cpu");
    let sync = |graphs| Run {
        path: MoePath::Device,
        graphs,
        wgmma: false,
        decode: false,
        overlap: None,
        wide: None,
        tma: None,
        w256: None,
        items_fastest: None,
        one_expert: false,
        prefill: None,
    };
    let small = config(72, 40, 7, 3, Router::Softmax, DTypeKind::BF16);
    few_flips_at(
        &[1, 5, 37, 301],
        small,
        sync(true),
        s + 3,
        "small, mma.sync",
    );
    let deep = config(1024, 256, 8, 2, Router::Softmax, DTypeKind::BF16);
    few_flips_at(&[3, 256], deep, sync(false), s, "deep, mma.sync");
    let grouped = config(64, 48, 32, 4, GROUPED, DTypeKind::BF16);
    few_flips_at(&[200], grouped, sync(true), s + 1, "grouped, mma.sync");
    let half = config(72, 40, 7, 3, Router::Softmax, DTypeKind::F16);
    few_flips_at(&[1, 37, 301], half, sync(true), s + 2, "f16, mma.sync");
}

/// The one-token decode kernel: more experts than warps per gate row (router segments),
/// 256 experts with k = 16, k = E with act rows of two chunks (the down rows of several
/// ranks in one lane step) and long gate rows (hidden 9008), act rows of 16384 (k = 1) and
/// 8192 (k = 3; on Hopper these deep experts take the staged wgmma tile, so they run with
/// wgmma off), f16 without renormalization; each also on the kernels of larger batches.
/// The eager pass is one launch.
#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_smem_moe_decode_kernel_matches_cpu() {
    let s = seed("gpu_smem_moe_decode_kernel_matches_cpu");
    let cases = [
        (
            config(2056, 40, 200, 8, Router::Softmax, DTypeKind::BF16),
            "200 experts",
        ),
        (
            config(256, 32, 256, 16, Router::Softmax, DTypeKind::BF16),
            "256 experts",
        ),
        (
            config(9008, 16, 6, 6, Router::Softmax, DTypeKind::BF16),
            "k = E, act rows of 16",
        ),
        (
            config(64, 16384, 3, 1, Router::Softmax, DTypeKind::BF16),
            "intermediate 16384",
        ),
        (
            config(64, 8192, 4, 3, Router::Softmax, DTypeKind::BF16),
            "act rows of 8192",
        ),
        (
            MoeConfig {
                renormalize: false,
                ..config(72, 40, 7, 3, Router::Softmax, DTypeKind::F16)
            },
            "f16, not renormalized",
        ),
    ];
    for (i, (c, what)) in cases.iter().enumerate() {
        for decode in [true, false] {
            let r = Run {
                decode,
                wgmma: c.intermediate < 1024,
                ..run(MoePath::Auto, true)
            };
            assert_few_flips(cuda_vs_cpu(*c, 1, r, s + i as u64), what);
        }
    }
    let st = cuda().new_stream().unwrap();
    let (c, _) = cases[0];
    let mut layer = MoeLayer::<bf16>::new(&st, c, MoeWeights::Random { seed: s }).unwrap();
    layer.set_graphs(false);
    let x: Vec<bf16> = narrow(&random_f32(&mut rng(s), c.hidden));
    let x = Buffer::from_host(&st, &x).unwrap();
    layer.forward(&x).unwrap();
    assert_eq!(layer.last_stats().launches, 1);
    layer.set_decode_kernel(false);
    layer.forward(&x).unwrap();
    assert!(layer.last_stats().launches > 1);
    // Pass after pass on new inputs, eager and replayed: each reads only its own act rows
    // (the kernel tags them with the launch), so an input that comes back gives the same bits.
    layer.set_decode_kernel(true);
    let x2: Vec<bf16> = narrow(&random_f32(&mut rng(s + 99), c.hidden));
    let x2 = Buffer::from_host(&st, &x2).unwrap();
    for graphs in [false, true] {
        layer.set_graphs(graphs);
        let y1 = layer.forward(&x).unwrap().to_host(&st).unwrap();
        let y2 = layer.forward(&x2).unwrap().to_host(&st).unwrap();
        let y1_again = layer.forward(&x).unwrap().to_host(&st).unwrap();
        assert_eq!(layer.last_stats().launches, 1);
        assert_ne!(y1, y2);
        assert_eq!(y1, y1_again, "graphs {graphs}");
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_smem_moe_cublas_path_matches_cpu() {
    let s = seed("gpu_smem_moe_cublas_path_matches_cpu");
    let c = config(96, 64, 9, 2, Router::Softmax, DTypeKind::BF16);
    few_flips_at(&[1, 33, 300], c, run(MoePath::Cublas, false), s, "cublas");
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_smem_moe_graph_replay_equals_eager() {
    let s = seed("gpu_smem_moe_graph_replay_equals_eager");
    let gpu = cuda();
    let st = gpu.new_stream().unwrap();
    let c = config(512, 128, 16, 4, Router::Softmax, DTypeKind::BF16);
    let mut graphed = MoeLayer::<bf16>::new(&st, c, MoeWeights::Random { seed: s }).unwrap();
    let mut eager = MoeLayer::<bf16>::new(&st, c, MoeWeights::Random { seed: s }).unwrap();
    eager.set_graphs(false);
    let tokens = 24;
    let mut xb = Buffer::<bf16>::zeros(&st, tokens * c.hidden).unwrap();
    let mut yg = Buffer::<bf16>::zeros(&st, tokens * c.hidden).unwrap();
    let mut ye = Buffer::<bf16>::zeros(&st, tokens * c.hidden).unwrap();
    for round in 0..3u64 {
        // New contents in the same buffers each round.
        let x: Vec<bf16> = narrow(&random_f32(&mut rng(s + round), tokens * c.hidden));
        xb.copy_from_host(&st, &x).unwrap();
        graphed.forward_into(&xb, &mut yg).unwrap();
        let stats = graphed.last_stats();
        assert_eq!(stats.host_syncs, 0);
        assert_eq!(stats.graph, round > 0, "round {round}: {stats:?}");
        eager.forward_into(&xb, &mut ye).unwrap();
        let (a, b) = (yg.to_host(&st).unwrap(), ye.to_host(&st).unwrap());
        assert!(a.iter().all(|v| v.is_finite()));
        assert_eq!(a, b, "round {round}: graph replay differs from eager");
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_moe_f32_on_cuda_is_unsupported() {
    let st = cuda().new_stream().unwrap();
    let c = config(16, 8, 4, 2, Router::Softmax, DTypeKind::F32);
    assert!(matches!(
        MoeLayer::<f32>::new(&st, c, MoeWeights::Random { seed: 1 }),
        Err(Error::Unsupported(_))
    ));
    let odd = config(12, 8, 4, 2, Router::Softmax, DTypeKind::BF16);
    assert!(MoeLayer::<bf16>::new(&st, odd, MoeWeights::Random { seed: 1 }).is_err());
}
