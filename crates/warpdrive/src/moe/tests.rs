use crate::error::{Error, Result};

use super::config::{
    auto_takes_cublas, prefill_router_for, wgmma_overlap_for, wgmma_wide_for, DecodeShape,
    GemmShape, MoeConfig, Router, W256Rows, WgmmaW256, WgmmaWide, GRAPH_MAX_TOKENS,
    PREFILL_ROUTER_MIN_TOKENS, PRESETS, WGMMA_OVERLAP_MIN_DEPTH, WGMMA_W256_BN,
    WGMMA_W256_OVERLAP_MIN_ROWS,
};
use super::plan::{Gpu, Plan};

/// An H200 as the plans see it.
pub(super) const HOPPER: Gpu = Gpu {
    sms: 132,
    l2_bytes: 50 << 20,
    clusters: true,
    shared_per_block: 227 << 10,
    wgmma: true,
    wgmma_overlap: None,
    wgmma_wide: None,
    wgmma_tma: None,
    wgmma_w256: None,
    items_fastest: None,
    prefill_router: None,
    decode: true,
};

/// [`HOPPER`] with the 256-weight-row tile kept off: the other tiles' rules as they apply
/// where it is not taken.
pub(super) const HOPPER_128: Gpu = Gpu {
    wgmma_w256: Some(WgmmaW256 {
        on: WgmmaWide::Neither,
        rows: W256Rows::Rows128,
    }),
    ..HOPPER
};

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
    let hopper = HOPPER;
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

#[test]
fn wgmma_overlap_only_on_the_wgmma_tiles() -> Result<()> {
    let hopper = Gpu {
        wgmma_overlap: Some(true),
        ..HOPPER
    };
    let qwen3 = MoeConfig::preset("qwen3-30b-a3b")?;
    let p = Plan::new(&qwen3, 4096, hopper);
    assert!(p.up.wgmma && p.up.wgmma_overlap && p.down.wgmma && p.down.wgmma_overlap);
    // Forced off, off without wgmma, off on the mma.sync decode and middle tiles.
    let drained = Plan::new(
        &qwen3,
        4096,
        Gpu {
            wgmma_overlap: Some(false),
            ..hopper
        },
    );
    assert!(drained.up.wgmma && !drained.up.wgmma_overlap);
    let no_wgmma = Plan::new(
        &qwen3,
        4096,
        Gpu {
            wgmma: false,
            ..hopper
        },
    );
    assert!(!no_wgmma.up.wgmma_overlap && !no_wgmma.down.wgmma_overlap);
    let one_row = Plan::new(&qwen3, 1, hopper);
    assert_eq!(one_row.up.wgmma, one_row.up.wgmma_overlap);
    assert!(!one_row.up.wgmma || one_row.up.mt >= 4);
    Ok(())
}

/// By default the overlap kernel goes to the projections whose blocks run at least
/// `WGMMA_OVERLAP_MIN_DEPTH` deep: at 4096 tokens (one split everywhere) every projection of
/// gpt-oss and mixtral and deepseek's gate/up (the presets the H100 measured faster with it),
/// not deepseek's 256-deep down projection; and to the 256-weight-row tile where an expert
/// gets 256 rows or more: both of qwen3's (2048 deep at most) at 4096 tokens.
#[test]
fn wgmma_overlap_by_default_where_the_blocks_run_deep() -> Result<()> {
    let expect = [
        ("qwen3-30b-a3b", true, true),
        ("deepseek-v3-slice", true, false),
        ("gpt-oss-120b", true, true),
        ("mixtral-8x7b", true, true),
    ];
    for (name, up, down) in expect {
        let p = Plan::new(&MoeConfig::preset(name)?, 4096, HOPPER);
        assert!(p.up.wgmma && p.down.wgmma, "{name}");
        assert_eq!((p.up.splits, p.down.splits), (1, 1), "{name}");
        assert_eq!(
            (p.up.wgmma_overlap, p.down.wgmma_overlap),
            (up, down),
            "{name}"
        );
    }
    // The rule reads each block's depth (split K makes the blocks shallower) and, on the
    // 256-weight-row tile, the rows an expert gets.
    for name in PRESETS {
        let c = MoeConfig::preset(name)?;
        for tokens in [1, 16, 64, 256, 1024, 4096] {
            let p = Plan::new(&c, tokens, HOPPER);
            let slots = tokens * c.top_k;
            let many_rows = slots.div_ceil(c.experts.min(slots)) >= WGMMA_W256_OVERLAP_MIN_ROWS;
            for g in [p.up, p.down] {
                let w256 = g.bn == WGMMA_W256_BN;
                let want = g.wgmma && (g.k_split >= WGMMA_OVERLAP_MIN_DEPTH || (w256 && many_rows));
                assert_eq!(g.wgmma_overlap, want, "{name} at {tokens}: {g:?}");
            }
        }
    }
    // The layer `tests/moe.rs` runs the plan's own choice on (`mixed_depths`): overlap on
    // its 2624-deep gate/up, drained on its 256-deep down projection, with either tile.
    let mixed = MoeConfig {
        hidden: 2624,
        intermediate: 256,
        experts: 64,
        top_k: 2,
        ..MoeConfig::tiny()
    };
    let wide = Gpu {
        wgmma_wide: Some(WgmmaWide::Both),
        ..HOPPER
    };
    for (tokens, gpu) in [(301, HOPPER), (1025, HOPPER), (301, wide), (1025, wide)] {
        let p = Plan::new(&mixed, tokens, gpu);
        assert!(p.up.wgmma && p.up.wgmma_overlap, "{tokens}: {:?}", p.up);
        assert!(
            p.down.wgmma && !p.down.wgmma_overlap,
            "{tokens}: {:?}",
            p.down
        );
    }
    let shallow = WGMMA_OVERLAP_MIN_DEPTH - 32;
    assert!(!wgmma_overlap_for(shallow, false, 1 << 20, None));
    assert!(wgmma_overlap_for(WGMMA_OVERLAP_MIN_DEPTH, false, 1, None));
    // The 256-weight-row tile from its row threshold, at any depth.
    let rows = WGMMA_W256_OVERLAP_MIN_ROWS;
    assert!(!wgmma_overlap_for(shallow, true, rows - 1, None));
    assert!(wgmma_overlap_for(shallow, true, rows, None));
    assert!(!wgmma_overlap_for(shallow, true, rows, Some(false)));
    assert!(wgmma_overlap_for(64, false, 1, Some(true)));
    assert!(!wgmma_overlap_for(1 << 20, true, 1 << 20, Some(false)));
    Ok(())
}

/// The wide tile, where asked for, takes every wgmma tile (192 rows, dispatched in 192-row
/// items, waves of one block per SM) where its shared memory fits, and nothing else.
#[test]
fn wgmma_wide_takes_the_wgmma_tiles() -> Result<()> {
    let wide = Gpu {
        wgmma_wide: Some(WgmmaWide::Both),
        ..HOPPER_128
    };
    for name in PRESETS {
        let c = MoeConfig::preset(name)?;
        for tokens in [1, 5, 64, 4096] {
            let base = Plan::new(&c, tokens, HOPPER_128);
            let p = Plan::new(&c, tokens, wide);
            if base.up.wgmma {
                assert_eq!((p.up.mt, p.down.mt, p.bm), (12, 12, 192), "{name} {tokens}");
                assert!(p.up.wgmma && p.down.wgmma);
                let slots = tokens * c.top_k;
                assert_eq!(p.up.items, c.experts.min(slots) + slots / 192);
            } else {
                assert_eq!((p.up.mt, p.bm), (base.up.mt, base.bm), "{name} {tokens}");
            }
            // The overlap rule applies to the wide tile too.
            assert_eq!(
                p.up.wgmma_overlap,
                p.up.wgmma && p.up.k_split >= WGMMA_OVERLAP_MIN_DEPTH
            );
        }
    }
    // One block per SM: mixtral's down projection at one token (2 experts × 32 column
    // blocks busy) splits K to fill one wave of 132 places, not 264.
    let mixtral = MoeConfig::preset("mixtral-8x7b")?;
    assert_eq!(Plan::new(&mixtral, 1, HOPPER_128).down.splits, 4);
    assert_eq!(Plan::new(&mixtral, 1, wide).down.splits, 2);
    // Not where its 161 KB of stages do not fit, nor without wgmma.
    let small = Gpu {
        shared_per_block: 120 << 10,
        ..wide
    };
    let qwen3 = MoeConfig::preset("qwen3-30b-a3b")?;
    assert_eq!(Plan::new(&qwen3, 4096, small).up.mt, 6);
    let off = Gpu {
        wgmma: false,
        ..wide
    };
    assert_eq!(Plan::new(&qwen3, 4096, off).up.mt, 6);
    assert!(!Plan::new(&qwen3, 4096, off).up.wgmma);
    Ok(())
}

/// The plan's own choice of the wide tile (what an H100 measured from 512 to 4096 tokens): on
/// where an expert's rows overflow one 96-row tile and 192-row tiles pad them at most 10 %
/// more (128 rows: gpt-oss and deepseek-v3-slice at 4096, qwen3 at 2048; mixtral's 1024 at
/// 4096), off where they pad a third more (256 rows: qwen3 at 4096, mixtral at 1024) or fit
/// one tile; forcing wins either way.
#[test]
fn wgmma_wide_is_chosen_by_the_rows_it_pads() -> Result<()> {
    let off = Gpu {
        wgmma_wide: Some(WgmmaWide::Neither),
        ..HOPPER_128
    };
    for (name, tokens, wide) in [
        ("gpt-oss-120b", 4096, true),
        ("mixtral-8x7b", 4096, true),
        ("qwen3-30b-a3b", 4096, false),
        ("qwen3-30b-a3b", 2048, true),
        ("deepseek-v3-slice", 4096, true),
        ("mixtral-8x7b", 1024, false),
        ("mixtral-8x7b", 512, true),
        ("gpt-oss-120b", 1024, false),
        ("gpt-oss-120b", 1, false),
    ] {
        let c = MoeConfig::preset(name)?;
        let p = Plan::new(&c, tokens, HOPPER_128);
        assert_eq!(p.bm == 192, wide, "{name} at {tokens}: bm {}", p.bm);
        assert_ne!(
            Plan::new(&c, tokens, off).bm,
            192,
            "{name} at {tokens}, forced off"
        );
    }
    for (rows, wide) in [
        (96, false),
        (97, true),
        (192, true),
        (193, false),
        (288, false),
        (289, true),
        (384, true),
        (385, false),
        (1024, true),
    ] {
        assert_eq!(wgmma_wide_for(rows, None), wide, "{rows} rows");
    }
    assert!(wgmma_wide_for(1, Some(true)));
    assert!(!wgmma_wide_for(1024, Some(false)));
    // Rows past any pass's size saturate rather than overflow.
    let _ = wgmma_wide_for(usize::MAX, None);
    Ok(())
}

/// The plan's default choices (tiles, work list, splits, overlap, TMA, grid order, prefetch)
/// for the four presets at 1024 and 4096 tokens on an H100 / H200, pinned: none moves
/// without a GPU run. These are the H100's of 2026-11-27 (the wide tile by the rows it pads,
/// the TMA tile where one tile holds an expert's rows, the 256-weight-row tile from 128 rows
/// an expert, item by item where an expert's tiles fit one wave, the overlap kernel on that
/// tile from 256 rows an expert; bench/NOTES.md).
#[test]
fn the_default_plans_are_the_measured_ones() -> Result<()> {
    type G = (usize, usize, usize, usize, bool, bool, bool, bool);
    let g = |s: &GemmShape| -> G {
        (
            s.mt,
            s.items,
            s.splits,
            s.k_split,
            s.items_fastest,
            s.wgmma,
            s.wgmma_overlap,
            s.wgmma_tma,
        )
    };
    // (preset, tokens, bm, up, down, down_early_k), printed from `Plan::new`.
    #[rustfmt::skip]
    let main: [(&str, usize, usize, G, G, usize); 8] = [
        ("qwen3-30b-a3b", 1024, 96, (6, 213, 1, 2048, false, true, false, true), (6, 213, 1, 768, false, true, false, true), 0),
        ("qwen3-30b-a3b", 4096, 128, (8, 384, 1, 2048, false, true, true, false), (8, 384, 1, 768, false, true, true, false), 0),
        ("deepseek-v3-slice", 1024, 64, (4, 384, 1, 7168, false, true, true, true), (4, 384, 1, 256, false, true, false, true), 0),
        ("deepseek-v3-slice", 4096, 128, (8, 512, 1, 7168, false, true, true, false), (8, 512, 1, 256, false, true, false, false), 0),
        ("gpt-oss-120b", 1024, 64, (4, 192, 1, 2880, false, true, true, true), (4, 192, 1, 2880, false, true, true, true), 0),
        ("gpt-oss-120b", 4096, 128, (8, 256, 1, 2880, false, true, true, false), (8, 256, 1, 2880, false, true, true, false), 0),
        ("mixtral-8x7b", 1024, 128, (8, 24, 1, 4096, true, true, true, false), (8, 24, 1, 14336, false, true, true, false), 384),
        ("mixtral-8x7b", 4096, 128, (8, 72, 1, 4096, true, true, true, false), (8, 72, 1, 14336, true, true, true, false), 384),
    ];
    for (name, tokens, bm, up, down, early) in main {
        let p = Plan::new(&MoeConfig::preset(name)?, tokens, HOPPER);
        let now = (p.bm, g(&p.up), g(&p.down), p.down_early_k);
        assert_eq!(now, (bm, up, down, early), "{name} at {tokens} tokens");
        assert_eq!((p.items, p.up.subtiles, p.down.subtiles), (up.1, 1, 1));
    }
    Ok(())
}

/// Forcing the wide tile on one projection: that GEMM takes the 192-row tile, the other keeps
/// the tile it has without forcing, the work list comes in 192-row items and the narrower
/// GEMM takes each as 2 (96-row) or 3 (64-row) tiles, its grid sized for them.
#[test]
fn wgmma_wide_forced_per_projection() -> Result<()> {
    let with = |w| Gpu {
        wgmma_wide: Some(w),
        ..HOPPER_128
    };
    for name in PRESETS {
        let c = MoeConfig::preset(name)?;
        for tokens in [1, 5, 64, 301, 1024, 4096] {
            let base = Plan::new(&c, tokens, with(WgmmaWide::Neither));
            for w in [WgmmaWide::GateUp, WgmmaWide::Down, WgmmaWide::Both] {
                let p = Plan::new(&c, tokens, with(w));
                if !base.up.wgmma {
                    assert_eq!(
                        (p.up.mt, p.down.mt, p.bm),
                        (base.up.mt, base.down.mt, base.bm)
                    );
                    continue;
                }
                let want = |wide: bool, b: &GemmShape| if wide { 12 } else { b.mt };
                let at = format!("{name} at {tokens}, {w:?}");
                assert_eq!(p.up.mt, want(w.gate_up(), &base.up), "{at}");
                assert_eq!(p.down.mt, want(w.down(), &base.down), "{at}");
                assert_eq!(p.bm, 192, "{at}");
                let slots = tokens * c.top_k;
                assert_eq!(p.items, c.experts.min(slots) + slots / 192, "{at}");
                for s in [&p.up, &p.down] {
                    assert_eq!(s.subtiles * 16 * s.mt, p.bm, "{at}");
                    assert_eq!(s.items, p.items * s.subtiles, "{at}");
                    assert!(s.wgmma, "{at}");
                }
                assert!(p.tickets_len() >= p.up.tiles().max(p.down.tiles()));
            }
        }
    }
    // The plan's own choice per projection agrees with the setter's `Both` where it is on.
    let gpt = MoeConfig::preset("gpt-oss-120b")?;
    let p = Plan::new(&gpt, 4096, HOPPER_128);
    assert_eq!((p.up.mt, p.down.mt), (12, 12));
    assert_eq!(WgmmaWide::of(true, false), WgmmaWide::GateUp);
    assert_eq!(WgmmaWide::of(false, true), WgmmaWide::Down);
    assert!(WgmmaWide::Both.gate_up() && WgmmaWide::Both.down());
    assert!(!WgmmaWide::Neither.gate_up() && !WgmmaWide::Neither.down());
    Ok(())
}

/// The prefill router from `PREFILL_ROUTER_MIN_TOKENS` tokens, never on a graph-sized pass
/// by default (decode and the graphs keep the fused router), forced either way by the layer,
/// and never for a Softmax router over more than 256 experts (the grouped sigmoid router
/// takes it).
#[test]
fn prefill_router_from_its_size_unless_forced() -> Result<()> {
    const { assert!(PREFILL_ROUTER_MIN_TOKENS > GRAPH_MAX_TOKENS) };
    for name in PRESETS {
        let c = MoeConfig::preset(name)?;
        for tokens in [1, 64, GRAPH_MAX_TOKENS, PREFILL_ROUTER_MIN_TOKENS - 1] {
            assert!(!prefill_router_for(&c, tokens, None), "{name} {tokens}");
            assert!(
                !Plan::new(&c, tokens, HOPPER).prefill_router,
                "{name} {tokens}"
            );
        }
        for tokens in [PREFILL_ROUTER_MIN_TOKENS, 4096] {
            assert!(
                Plan::new(&c, tokens, HOPPER).prefill_router,
                "{name} {tokens}"
            );
        }
        let on = Gpu {
            prefill_router: Some(true),
            ..HOPPER
        };
        let off = Gpu {
            prefill_router: Some(false),
            ..HOPPER
        };
        assert!(Plan::new(&c, 37, on).prefill_router, "{name}");
        assert!(!Plan::new(&c, 4096, off).prefill_router, "{name}");
    }
    let wide = MoeConfig {
        experts: 300,
        top_k: 4,
        ..MoeConfig::tiny()
    };
    assert!(!prefill_router_for(&wide, 4096, None));
    assert!(!prefill_router_for(&wide, 4096, Some(true)));
    let grouped = MoeConfig {
        router: Router::SigmoidGrouped {
            n_group: 8,
            topk_group: 4,
            routed_scaling: 2.5,
        },
        ..MoeConfig::preset("deepseek-v3-slice")?
    };
    assert!(prefill_router_for(&grouped, 4096, None));
    Ok(())
}

/// The warp-specialized TMA tiles run by default where one wgmma tile holds an expert's rows
/// (2 or more), forced on every wgmma tile and nothing else, forced off nowhere, with the
/// same tiles, splits, overlap choice and grid either way (same shared memory and blocks per
/// SM; only the kernel changes).
#[test]
fn wgmma_tma_where_one_tile_holds_an_experts_rows() -> Result<()> {
    let forced = |choice| Gpu {
        wgmma_tma: choice,
        ..HOPPER_128
    };
    for name in PRESETS {
        let c = MoeConfig::preset(name)?;
        for tokens in [1, 5, 64, 1025, 4096] {
            let base = Plan::new(&c, tokens, HOPPER_128);
            let rows = (tokens * c.top_k).div_ceil(c.experts.min(tokens * c.top_k));
            for g in [&base.up, &base.down] {
                let one_tile = (2..=16 * g.mt).contains(&rows);
                assert_eq!(g.wgmma_tma, g.wgmma && one_tile, "{name} {tokens}");
            }
            let off = Plan::new(&c, tokens, forced(Some(false)));
            assert!(!off.up.wgmma_tma && !off.down.wgmma_tma, "{name} {tokens}");
            let on = Plan::new(&c, tokens, forced(Some(true)));
            for (b, t) in [(&off.up, &on.up), (&off.down, &on.down)] {
                assert_eq!(t.wgmma_tma, b.wgmma, "{name} {tokens}");
                assert_eq!(
                    (
                        t.mt,
                        t.splits,
                        t.k_split,
                        t.items,
                        t.wgmma_overlap,
                        t.grid()
                    ),
                    (
                        b.mt,
                        b.splits,
                        b.k_split,
                        b.items,
                        b.wgmma_overlap,
                        b.grid()
                    ),
                    "{name} {tokens}"
                );
            }
            let no_wgmma = Gpu {
                wgmma: false,
                ..forced(Some(true))
            };
            let p = Plan::new(&c, tokens, no_wgmma);
            assert!(!p.up.wgmma_tma && !p.down.wgmma_tma, "{name} {tokens}");
        }
    }
    Ok(())
}
