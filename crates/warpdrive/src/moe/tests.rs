use crate::error::{Error, Result};

use super::config::{auto_takes_cublas, DecodeShape, MoeConfig, Router, GRAPH_MAX_TOKENS};
use super::plan::{Gpu, Plan};

/// An H200 as the plans see it.
const HOPPER: Gpu = Gpu {
    sms: 132,
    l2_bytes: 50 << 20,
    clusters: true,
    shared_per_block: 227 << 10,
    wgmma: true,
    wgmma_overlap: false,
    decode: true,
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
        wgmma_overlap: true,
        ..HOPPER
    };
    let qwen3 = MoeConfig::preset("qwen3-30b-a3b")?;
    let p = Plan::new(&qwen3, 4096, hopper);
    assert!(p.up.wgmma && p.up.wgmma_overlap && p.down.wgmma && p.down.wgmma_overlap);
    // Off by default, off without wgmma, off on the mma.sync decode and middle tiles.
    let drained = Plan::new(
        &qwen3,
        4096,
        Gpu {
            wgmma_overlap: false,
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
