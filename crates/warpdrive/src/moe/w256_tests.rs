//! The 256-weight-row wgmma tile's plans: which GEMMs take it, forced or by the rows an
//! expert gets, their kernels, shared memory, grid, order and work list, and the other
//! projection's tile beside it.

use crate::error::Result;

use super::config::{
    gemm_blocks_per_sm, gemm_shared_bytes, wgmma_w256_for, GemmShape, MoeConfig, W256Rows,
    WgmmaW256, WgmmaWide, GEMM_BN, PRESETS, WGMMA_OVERLAP_MIN_DEPTH, WGMMA_W256_BN,
    WGMMA_W256_OVERLAP_MIN_ROWS,
};
use super::launcher::wgmma_name;
use super::plan::{w256_mts, Gpu, Plan};
use super::tests::{HOPPER, HOPPER_128};

const TOKENS: [usize; 8] = [1, 5, 37, 64, 301, 1024, 2048, 4096];

fn forced(on: WgmmaWide, rows: W256Rows) -> Gpu {
    Gpu {
        wgmma_w256: Some(WgmmaW256::new(on, rows)),
        ..HOPPER
    }
}

/// A GEMM on the 256-weight-row tile: its kernel (bf16 and f16, drained or overlapped by the
/// overlap rule, never TMA), 256 columns a block, one block per SM, its shared memory, grid,
/// and item by item where an expert's tiles (of `experts` busy, `slots` rows in all) fit one
/// wave of 132 blocks.
fn assert_w256(
    s: &GemmShape,
    rows: W256Rows,
    (experts, slots): (usize, usize),
    at: &str,
) -> Result<()> {
    assert!(s.wgmma && !s.wgmma_tma, "{at}: {s:?}");
    assert_eq!((s.mt, s.bn), (rows.mt(), WGMMA_W256_BN), "{at}");
    let wave = s.items.div_ceil(experts) * s.n_blocks() * s.splits;
    assert_eq!(s.items_fastest, wave > 132, "{at}: {wave} tiles an expert");
    assert_eq!(
        s.wgmma_overlap,
        s.k_split >= WGMMA_OVERLAP_MIN_DEPTH
            || slots.div_ceil(experts) >= WGMMA_W256_OVERLAP_MIN_ROWS,
        "{at}"
    );
    assert_eq!(gemm_blocks_per_sm(s.mt, s.bn), 1, "{at}");
    assert_eq!(s.grid(), s.items * s.n.div_ceil(256) * s.splits, "{at}");
    let suffix = if s.wgmma_overlap { 'o' } else { 'w' };
    let m = rows.mt();
    assert_eq!(
        wgmma_name(s, 1, false)?,
        format!("moe_gemm_bf16_m{m}x256{suffix}")
    );
    assert_eq!(
        wgmma_name(s, 0, true)?,
        format!("moe_gemm_f16_m{m}x256{suffix}")
    );
    Ok(())
}

/// Forced on both projections: both GEMMs take it (96 or 128 token rows), the work list comes
/// in its items, wherever the plan runs wgmma tiles at all; nothing changes elsewhere.
#[test]
fn wgmma_w256_forced_on_both_projections() -> Result<()> {
    for name in PRESETS {
        let c = MoeConfig::preset(name)?;
        for tokens in TOKENS {
            let base = Plan::new(&c, tokens, HOPPER);
            for rows in [W256Rows::Rows96, W256Rows::Rows128] {
                let p = Plan::new(&c, tokens, forced(WgmmaWide::Both, rows));
                let at = format!("{name} at {tokens}, {rows:?}");
                if !base.up.wgmma {
                    assert_eq!(
                        (p.bm, p.up.mt, p.up.bn),
                        (base.bm, base.up.mt, GEMM_BN),
                        "{at}"
                    );
                    continue;
                }
                let experts = c.experts.min(tokens * c.top_k);
                assert_w256(&p.up, rows, (experts, tokens * c.top_k), &at)?;
                assert_w256(&p.down, rows, (experts, tokens * c.top_k), &at)?;
                assert_eq!(p.bm, 16 * rows.mt(), "{at}");
                let slots = tokens * c.top_k;
                assert_eq!(p.items, c.experts.min(slots) + slots / p.bm, "{at}");
                assert_eq!((p.up.subtiles, p.down.subtiles), (1, 1), "{at}");
                assert_eq!((p.up.items, p.down.items), (p.items, p.items), "{at}");
                assert!(p.tickets_len() >= p.up.tiles().max(p.down.tiles()), "{at}");
            }
        }
    }
    // qwen3 at 4096 tokens: 128 experts × ~256 rows; 128-row items (384: two tiles an expert
    // plus the spill) where the default 96-row list has 469; 8 (down) and 6 (gate/up) column
    // blocks of 256; one split (places: 132 blocks, one a SM).
    let qwen3 = MoeConfig::preset("qwen3-30b-a3b")?;
    let p = Plan::new(&qwen3, 4096, forced(WgmmaWide::Both, W256Rows::Rows128));
    assert_eq!((p.items, p.up.n_blocks(), p.down.n_blocks()), (384, 6, 8));
    assert_eq!((p.up.splits, p.down.splits), (1, 1));
    let p96 = Plan::new(&qwen3, 4096, forced(WgmmaWide::Both, W256Rows::Rows96));
    assert_eq!(p96.items, 469);
    // Shared memory: 4 stages of (96 or 128 + 256) rows × 128 B + 1 KB to align.
    assert_eq!(gemm_shared_bytes(6, WGMMA_W256_BN, true), 181_248);
    assert_eq!(gemm_shared_bytes(8, WGMMA_W256_BN, true), 197_632);
    // Where the 128-row one does not fit (190 KB a block), the plan's tiles stay; the 96-row
    // one fits. Nor without wgmma.
    let small = Gpu {
        shared_per_block: 190 << 10,
        ..forced(WgmmaWide::Both, W256Rows::Rows128)
    };
    let p = Plan::new(&qwen3, 4096, small);
    assert_eq!((p.up.bn, p.up.mt, p.bm), (GEMM_BN, 6, 96));
    let small96 = Gpu {
        wgmma_w256: Some(WgmmaW256::new(WgmmaWide::Both, W256Rows::Rows96)),
        ..small
    };
    assert_eq!(Plan::new(&qwen3, 4096, small96).up.bn, WGMMA_W256_BN);
    let off = Gpu {
        wgmma: false,
        ..forced(WgmmaWide::Both, W256Rows::Rows128)
    };
    let p = Plan::new(&qwen3, 4096, off);
    assert!(!p.up.wgmma && p.up.bn == GEMM_BN && p.down.bn == GEMM_BN);
    // The grid order on request; the overlap choice forced as on the other tiles.
    let fastest = Gpu {
        items_fastest: Some(true),
        wgmma_overlap: Some(true),
        ..forced(WgmmaWide::Both, W256Rows::Rows128)
    };
    let p = Plan::new(&qwen3, 4096, fastest);
    assert!(p.up.items_fastest && p.down.items_fastest);
    assert!(p.up.wgmma_overlap && p.down.wgmma_overlap);
    assert_eq!(wgmma_name(&p.down, 1, false)?, "moe_gemm_bf16_m8x256o");
    // Neither projection: no change at all.
    let p = Plan::new(&qwen3, 4096, forced(WgmmaWide::Neither, W256Rows::Rows128));
    assert_eq!((p.bm, p.up.bn, p.down.bn), (96, GEMM_BN, GEMM_BN));
    Ok(())
}

/// Forced on one projection: that GEMM takes it, the other keeps the plan's tile where one
/// work list serves both, else the tile that divides or holds the other's rows (96 or 192
/// beside 128 → 64; 64 beside 96 → 96); each GEMM's row tiles make up the list's items.
#[test]
fn wgmma_w256_forced_per_projection() -> Result<()> {
    for name in PRESETS {
        let c = MoeConfig::preset(name)?;
        for tokens in TOKENS {
            let base = Plan::new(&c, tokens, HOPPER_128);
            for rows in [W256Rows::Rows96, W256Rows::Rows128] {
                for on in [WgmmaWide::GateUp, WgmmaWide::Down] {
                    let p = Plan::new(&c, tokens, forced(on, rows));
                    let at = format!("{name} at {tokens}, {on:?}, {rows:?}");
                    if !base.up.wgmma {
                        assert_eq!((p.bm, p.up.bn, p.down.bn), (base.bm, GEMM_BN, GEMM_BN));
                        continue;
                    }
                    let (w, other, base_other) = if on.gate_up() {
                        (&p.up, &p.down, &base.down)
                    } else {
                        (&p.down, &p.up, &base.up)
                    };
                    let slots = tokens * c.top_k;
                    assert_w256(w, rows, (c.experts.min(slots), slots), &at)?;
                    assert_eq!(other.bn, GEMM_BN, "{at}");
                    let want = w256_mts(WgmmaW256::new(on, rows), base.up.mt, base.down.mt);
                    assert_eq!((p.up.mt, p.down.mt), want, "{at}");
                    let (wm, om) = (16 * w.mt, 16 * other.mt);
                    assert_eq!(wm.max(om) % wm.min(om), 0, "{at}");
                    assert_eq!(p.bm, wm.max(om), "{at}");
                    for s in [&p.up, &p.down] {
                        assert_eq!(s.subtiles * 16 * s.mt, p.bm, "{at}");
                        assert_eq!(s.items, p.items * s.subtiles, "{at}");
                    }
                    // The other projection's kernel as the plan's rules pick it (TMA where
                    // one tile holds an expert's rows).
                    assert!(other.wgmma, "{at}");
                    if other.mt == base_other.mt {
                        assert_eq!(other.wgmma_tma, base_other.wgmma_tma, "{at}");
                    }
                    assert!(p.tickets_len() >= p.up.tiles().max(p.down.tiles()), "{at}");
                }
            }
        }
    }
    let both = |up, down| (up, down);
    let w = |on, rows| WgmmaW256::new(on, rows);
    // 128 rows: a 96-row or 192-row other becomes 64; a 64-row one stays.
    assert_eq!(
        w256_mts(w(WgmmaWide::GateUp, W256Rows::Rows128), 6, 6),
        both(8, 4)
    );
    assert_eq!(
        w256_mts(w(WgmmaWide::Down, W256Rows::Rows128), 12, 12),
        both(4, 8)
    );
    assert_eq!(
        w256_mts(w(WgmmaWide::Down, W256Rows::Rows128), 4, 4),
        both(4, 8)
    );
    // 96 rows: a 64-row other becomes 96; 96 and 192 stay.
    assert_eq!(
        w256_mts(w(WgmmaWide::GateUp, W256Rows::Rows96), 4, 4),
        both(6, 6)
    );
    assert_eq!(
        w256_mts(w(WgmmaWide::GateUp, W256Rows::Rows96), 12, 12),
        both(6, 12)
    );
    assert_eq!(
        w256_mts(w(WgmmaWide::Down, W256Rows::Rows96), 6, 6),
        both(6, 6)
    );
    // deepseek-v3-slice at 4096 (the plan's wide 192-row tiles): gate/up on the 96-row
    // 256-weight-row tile, two of them an item; down keeps the wide TMA tile.
    let deepseek = MoeConfig::preset("deepseek-v3-slice")?;
    let p = Plan::new(&deepseek, 4096, forced(WgmmaWide::GateUp, W256Rows::Rows96));
    assert_eq!(
        (p.bm, p.up.subtiles, p.down.mt, p.down.subtiles),
        (192, 2, 12, 1)
    );
    assert!(p.down.wgmma_tma);
    Ok(())
}

/// The grid order forced on every GEMM (the plan's tiles too), and nothing else changed;
/// unforced, the plan's own (pinned in `the_default_plans_are_the_measured_ones`).
#[test]
fn gemm_items_fastest_forced_either_way() -> Result<()> {
    for name in PRESETS {
        let c = MoeConfig::preset(name)?;
        for tokens in TOKENS {
            let base = Plan::new(&c, tokens, HOPPER);
            for order in [false, true] {
                let gpu = Gpu {
                    items_fastest: Some(order),
                    ..HOPPER
                };
                let p = Plan::new(&c, tokens, gpu);
                for (b, s) in [(&base.up, &p.up), (&base.down, &p.down)] {
                    assert_eq!(s.items_fastest, order, "{name} at {tokens}");
                    let key = |g: &GemmShape| {
                        (
                            g.mt,
                            g.bn,
                            g.items,
                            g.splits,
                            g.k_split,
                            g.wgmma_overlap,
                            g.wgmma_tma,
                        )
                    };
                    assert_eq!(key(s), key(b), "{name} at {tokens}");
                }
                assert_eq!(
                    (p.bm, p.items, p.down_early_k),
                    (base.bm, base.items, base.down_early_k)
                );
            }
        }
    }
    Ok(())
}

/// Unforced, the plan takes the tile (128 token rows, both projections) exactly where an
/// expert gets 128 rows or more on average and the wgmma tiles run; forced off, never.
#[test]
fn wgmma_w256_by_the_rows_an_expert_gets() -> Result<()> {
    for name in PRESETS {
        let c = MoeConfig::preset(name)?;
        for tokens in TOKENS {
            let p = Plan::new(&c, tokens, HOPPER);
            let off = Plan::new(&c, tokens, HOPPER_128);
            let slots = tokens * c.top_k;
            let rows = slots.div_ceil(c.experts.min(slots));
            let at = format!("{name} at {tokens}: {rows} rows an expert");
            if rows >= 128 && off.up.wgmma {
                let busy = (c.experts.min(slots), slots);
                assert_w256(&p.up, W256Rows::Rows128, busy, &at)?;
                assert_w256(&p.down, W256Rows::Rows128, busy, &at)?;
            } else {
                assert_eq!(
                    (p.up.bn, p.down.bn, p.bm),
                    (GEMM_BN, GEMM_BN, off.bm),
                    "{at}"
                );
            }
            assert_eq!((off.up.bn, off.down.bn), (GEMM_BN, GEMM_BN), "{at}");
        }
    }
    assert!(!wgmma_w256_for(127) && wgmma_w256_for(128) && wgmma_w256_for(1 << 20));
    Ok(())
}

/// The tile's warp-specialized kernel (`x256t`: a producer warpgroup, 384 threads) only
/// where the TMA kernels are forced on: with the tile forced or by the plan's rule, on each
/// projection that takes the tile (the other keeps its `t` kernel where forced), same tiles,
/// grid and shared memory; never unforced (deepseek-v3-slice at 4096, 128 rows an expert, is
/// where the 128-row tiles' rule would pick TMA) nor forced off.
#[test]
fn wgmma_w256_tma_only_where_forced() -> Result<()> {
    use super::launcher::wgmma_tma_block;
    for name in PRESETS {
        let c = MoeConfig::preset(name)?;
        for tokens in TOKENS {
            for w256 in [
                None,
                Some(WgmmaW256::new(WgmmaWide::Both, W256Rows::Rows128)),
                Some(WgmmaW256::new(WgmmaWide::Down, W256Rows::Rows96)),
            ] {
                let gpu = |tma| Gpu {
                    wgmma_tma: tma,
                    wgmma_w256: w256,
                    ..HOPPER
                };
                let base = Plan::new(&c, tokens, gpu(None));
                let off = Plan::new(&c, tokens, gpu(Some(false)));
                let on = Plan::new(&c, tokens, gpu(Some(true)));
                let at = format!("{name} at {tokens}, {w256:?}");
                for ((b, f), t) in [(&base.up, &off.up), (&base.down, &off.down)]
                    .into_iter()
                    .zip([&on.up, &on.down])
                {
                    assert_eq!((t.mt, t.bn, t.grid()), (b.mt, b.bn, b.grid()), "{at}");
                    assert!(!f.wgmma_tma, "{at}");
                    if b.bn != WGMMA_W256_BN {
                        continue;
                    }
                    assert!(!b.wgmma_tma && t.wgmma_tma == t.wgmma, "{at}");
                    if !t.wgmma {
                        continue;
                    }
                    let m = t.mt;
                    assert_eq!(
                        wgmma_name(t, 1, true)?,
                        format!("moe_gemm_bf16_m{m}x256t"),
                        "{at}"
                    );
                    assert_eq!(
                        wgmma_name(t, 0, true)?,
                        format!("moe_gemm_f16_m{m}x256t"),
                        "{at}"
                    );
                    // Without the weights' map: refused, not run.
                    assert!(wgmma_name(t, 1, false).is_err(), "{at}");
                    assert_eq!(gemm_blocks_per_sm(t.mt, t.bn), 1, "{at}");
                }
            }
        }
    }
    let qwen3 = MoeConfig::preset("qwen3-30b-a3b")?;
    let gpu = Gpu {
        wgmma_tma: Some(true),
        ..HOPPER
    };
    let p = Plan::new(&qwen3, 4096, gpu);
    assert_eq!(wgmma_name(&p.up, 1, true)?, "moe_gemm_bf16_m8x256t");
    assert_eq!(wgmma_name(&p.down, 1, true)?, "moe_gemm_bf16_m8x256t");
    assert_eq!(gemm_shared_bytes(8, WGMMA_W256_BN, true), 197_632);
    assert_eq!(
        (wgmma_tma_block(WGMMA_W256_BN), wgmma_tma_block(GEMM_BN)),
        (384, 288)
    );
    Ok(())
}
