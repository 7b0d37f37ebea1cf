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
//! (`kernels/moe_gemm.cu`) reads the per-expert counts from device memory, so for up to
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
//! (a cooperative launch) instead of kernel boundaries, which is faster than the separate
//! kernels (bench/NOTES.md, MoE decode).
//!
//! On Hopper the grouped GEMMs and the combine are programmatic dependent launches: each
//! starts while the kernel before it finishes and waits (`griddepcontrol.wait`) before it
//! touches that kernel's results; when the experts a pass likely touches fit in half the L2,
//! the down projection prefetches its weights into L2 meanwhile.
//!
//! On the CPU backend the same layer computes in f32/f64 on the host (the reference).
//!
//! From [`PREFILL_ROUTER_MIN_TOKENS`] tokens the router runs as the prefill router instead
//! ([`MoeLayer::set_prefill_router`]): the logits through cuBLAS, a routing kernel of one
//! warp per token (the fused router's row top-k, or the grouped sigmoid kernel), and the
//! dispatch as a stable counting sort of the slots by expert over many blocks
//! (`ops::permute`'s sort) and a tail kernel for the token rows and the GEMM work list: the
//! same counts, offsets and work list, with no host sync.
//!
//! The permuted order of tokens within an expert may differ between runs of the fused
//! router (its one-block dispatch places them with atomics; the prefill router's sort keeps
//! slot order), but each output row depends only on its own token, so the layer's output is
//! deterministic.

mod config;
mod cpu;
mod cublas;
mod device;
mod launcher;
mod layer;
mod plan;
#[cfg(test)]
mod prefill_tests;
#[cfg(test)]
mod tests;
#[cfg(test)]
mod w256_tests;
pub mod weights;

pub use config::{
    ForwardStats, MoeConfig, MoePath, Router, Routing, W256Rows, WgmmaW256, WgmmaWide,
    AUTO_CUBLAS_MIN_FLOPS, CUBLAS_GROUPED_MAX_FLOPS, GRAPH_MAX_TOKENS, PREFILL_ROUTER_MIN_TOKENS,
    PRESETS, TINY,
};
pub use layer::MoeLayer;
pub use weights::{HostWeights, MoeWeights, WeightsFile};
