use crate::device::Stream;
use crate::dtype::{DType, DTypeKind, Float};
use crate::error::{Error, Result};
use crate::exec::graph::Graph;
use crate::kernels::MOE;
use crate::memory::{host_filled, host_vec, Buffer};
use crate::ops;
use crate::telemetry;

use super::config::{
    auto_takes_cublas, ForwardStats, MoeConfig, MoePath, Routing, WgmmaW256, WgmmaWide,
    GRAPH_MAX_TOKENS,
};
use super::plan::{check_pass, Gpu, Plan, Workspace};
use super::{weights, HostWeights, MoeWeights};

/// The span [`MoeLayer::profile`] opens around each stage.
const STAGE_SPAN: &str = "moe.stage";

type GraphKey = (usize, u64, u64);

/// A Mixture-of-Experts layer on one stream.
pub struct MoeLayer<T: Float> {
    // Declaration order is drop order: the graphs go before the workspace they point into.
    pub(super) graphs: Vec<(GraphKey, Graph<'static, ()>)>,
    pub(super) ws: Option<Workspace<T>>,
    /// The weights' TMA tensor maps (w13's, then w2's: 16 words each) for the warp-specialized
    /// wgmma tiles, encoded on first use (the weights never move).
    pub(super) wgmma_maps: Option<Buffer<u64>>,
    pub(super) stream: Stream,
    pub(super) config: MoeConfig,
    pub(super) gate: Buffer<T>,
    pub(super) gate_bias: Option<Buffer<f32>>,
    /// w1 and w3 interleaved in blocks of 8 rows: [E, 2I, H].
    pub(super) w13: Buffer<T>,
    pub(super) w2: Buffer<T>,
    path: MoePath,
    use_graphs: bool,
    /// The staged tiles may take the warpgroup-MMA kernels (where `gpu.wgmma`).
    pub(super) warpgroup_mma: bool,
    /// The wgmma tiles take the overlap kernels: forced on or off, or (None, the default)
    /// per projection by the plan.
    pub(super) wgmma_overlap: Option<bool>,
    /// The wide 192-row wgmma tile: forced per projection, or `None` for the plan's choice.
    pub(super) wgmma_wide: Option<WgmmaWide>,
    /// The warp-specialized TMA wgmma tiles: forced on or off, or `None` (the plan's choice).
    pub(super) wgmma_tma: Option<bool>,
    /// The 256-weight-row wgmma tile: forced on some projections, or `None` (never taken).
    pub(super) wgmma_w256: Option<WgmmaW256>,
    /// The grouped GEMMs' grid order: forced, or `None` (the plan's).
    pub(super) gemm_items_fastest: Option<bool>,
    /// The prefill router: forced on or off, or `None` for the plan's choice.
    pub(super) prefill_router: Option<bool>,
    /// One-token passes may take the decode kernel (where `gpu.decode`).
    pub(super) decode_kernel: bool,
    pub(super) last: ForwardStats,
    pub(super) gpu: Gpu,
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
pub(super) struct Pass {
    pub(super) plan: Plan,
    pub(super) x: u64,
    pub(super) y: u64,
}

impl<T: Float> MoeLayer<T> {
    /// A layer on `stream`'s device with `weights`. Errors: an invalid config (see
    /// [`MoeConfig::validate`]: hidden and intermediate must be multiples of 8 on both
    /// backends), `T` not the config's dtype, weights of the wrong shape (naming the tensor),
    /// or (CUDA) f32, which runs on the CPU backend only. Weights larger than the device's
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
        let half = matches!(T::KIND, DTypeKind::BF16 | DTypeKind::F16);
        stream.run(
            (),
            |()| Ok(()),
            |(), _| match half {
                true => Ok(()),
                false => Err(Error::Unsupported(format!(
                    "MoE layer on CUDA takes bf16 or f16, not {} (f32 runs on the CPU backend)",
                    T::KIND.name()
                ))),
            },
        )?;
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
            MoeWeights::File(file) => {
                let t = file.upload::<T>(stream, &config)?;
                (t.gate, t.gate_bias, t.w13, t.w2)
            }
            MoeWeights::Host(w) => {
                w.check(&config)?;
                upload_weights(stream, &config, &w)?
            }
        };
        Ok(MoeLayer {
            graphs: Vec::new(),
            ws: None,
            wgmma_maps: None,
            stream: stream.clone(),
            config,
            gate,
            gate_bias,
            w13,
            w2,
            path: MoePath::Auto,
            use_graphs: true,
            warpgroup_mma: true,
            wgmma_overlap: None,
            wgmma_wide: None,
            wgmma_tma: None,
            wgmma_w256: None,
            gemm_items_fastest: None,
            prefill_router: None,
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

    /// Forces every warpgroup-MMA tile onto its overlap kernel (`Some(true)`: one group of
    /// MMAs in flight across 64-k stages, loads 2 stages ahead instead of 3; same tiles,
    /// shared memory and work list) or onto the kernel that drains the MMAs every stage
    /// (`Some(false)`); `None` (the default) lets the plan pick per projection: the overlap
    /// kernel where a block runs at least 2560 deep, or on the 256-weight-row tile where an
    /// expert gets 256 rows or more (issue 40). No effect where the tiles do
    /// not run on wgmma. Drops the captured graphs.
    pub fn set_wgmma_overlap(&mut self, choice: Option<bool>) {
        if choice != self.wgmma_overlap {
            self.wgmma_overlap = choice;
            self.graphs.clear();
        }
    }

    /// Forces the wide tile per projection: `Some(WgmmaWide::Both)` puts both GEMMs' warpgroup-MMA
    /// tiles on it (192 token rows × 128 weight rows, one block of 161 KB of stages per SM, so
    /// an expert's rows up to 192 stream its weights once), `Some(WgmmaWide::Neither)` keeps
    /// both on the 64- and 96-row tiles (two per SM), `GateUp` / `Down` put only that
    /// projection on it (the dispatch's work list then comes in 192-row items, which the
    /// other GEMM takes as 2 or 3 tiles of its own). `None` (the default) lets the plan pick
    /// by the rows an expert gets: the wide tile for both where they overflow one 96-row tile
    /// and 192-row tiles pad them at most 10 % more than 96-row tiles do (issue 40). No effect where the tiles do not run on wgmma or its shared memory
    /// does not fit. The overlap choice applies to it as to the others. Drops the captured
    /// graphs.
    pub fn set_wgmma_wide(&mut self, choice: Option<WgmmaWide>) {
        if choice != self.wgmma_wide {
            self.wgmma_wide = choice;
            self.graphs.clear();
        }
    }

    /// Forces every warpgroup-MMA tile onto its warp-specialized kernel (`Some(true)`: one
    /// producer warp loads the weights by TMA into the same 4-stage ring, behind full / empty
    /// mbarriers, and the down projection's token rows too (TMA boxes of the workspace's act
    /// rows), while the two consumer warpgroups multiply, one group of MMAs in flight, and
    /// load the gathered gate/up token rows themselves by cp.async two stages ahead; same
    /// tiles, shared memory, blocks per SM and work list) or keeps the `w` / `o` kernels
    /// (`Some(false)`); `None` (the default) takes it per projection where one tile holds an
    /// expert's rows, 2 of them or more (issue 40). The 256-weight-row tile
    /// ([`MoeLayer::set_wgmma_w256`]) takes its own warp-specialized kernel only with
    /// `Some(true)`: a producer warpgroup (setmaxnreg: 56 registers a thread there, 224 in the
    /// consumers) issues its two weight boxes a stage and act's boxes, or loads the gathered
    /// rows itself; the consumers only multiply. No effect where the tiles do not run on
    /// wgmma. Drops the captured graphs.
    pub fn set_wgmma_tma(&mut self, choice: Option<bool>) {
        if choice != self.wgmma_tma {
            self.wgmma_tma = choice;
            self.graphs.clear();
        }
    }

    /// Forces the 256-weight-row wgmma tile onto `choice.on`'s projections (`choice.rows`
    /// token rows × 256 weight rows where the others take 128: each warpgroup issues two m64
    /// MMAs a k16 step over the same token rows; 4 stages of 176 or 192 KB, one block per SM;
    /// the `w` / `o` kernels by the overlap choice, its warp-specialized one only where
    /// [`MoeLayer::set_wgmma_tma`] forces it on; issue 40), whatever
    /// the wide choice; the other projection keeps the plan's tile, changed where needed so
    /// that one work list serves both (see [`WgmmaW256::on`]; `WgmmaWide::Neither` keeps it
    /// off). `None` (the default): on both projections at 128 token rows where an expert gets
    /// 128 rows or more on average. No effect where the tiles do not run on wgmma or its
    /// shared memory does not fit. Drops the captured graphs.
    pub fn set_wgmma_w256(&mut self, choice: Option<WgmmaW256>) {
        if choice != self.wgmma_w256 {
            self.wgmma_w256 = choice;
            self.graphs.clear();
        }
    }

    /// Forces the grouped GEMMs' grid order: `Some(true)` column block by column block, the
    /// work items fastest (an expert's several row tiles read the same weights side by side),
    /// `Some(false)` item by item (an item's column blocks side by side: a wave covers a few
    /// experts whole, each token row read once); `None` (the default) lets the plan pick:
    /// item by item where an expert's tiles all fit one wave of blocks, else items fastest
    /// (issue 40). Same tiles, kernels and results. Drops the captured graphs.
    pub fn set_gemm_items_fastest(&mut self, choice: Option<bool>) {
        if choice != self.gemm_items_fastest {
            self.gemm_items_fastest = choice;
            self.graphs.clear();
        }
    }

    /// Forces the prefill router (`Some(true)`: the router's logits through cuBLAS, the
    /// routing one warp per token, the dispatch as a stable counting sort over many blocks,
    /// each expert's rows in token order) or the fused router kernel (`Some(false)`: logits,
    /// routing and a one-block dispatch in one launch); `None` (the default) lets the plan
    /// pick per pass: the prefill router from 512 tokens (issue 40). The routing is the same
    /// up to the logits' summation order (cuBLAS's against the fused kernel's), so a near-tie
    /// may go the other way. No effect on the decode kernel's one-token passes, on the CPU
    /// backend, or where the prefill router cannot route the config (a Softmax router over
    /// more than 256 experts). Drops the captured graphs.
    pub fn set_prefill_router(&mut self, choice: Option<bool>) {
        if choice != self.prefill_router {
            self.prefill_router = choice;
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
        let stream = self.stream.clone();
        stream.run(
            (self, y),
            |(l, y)| l.forward_host(x, y).map(drop),
            |(l, y), _| {
                if l.uses_cublas(tokens) {
                    return l
                        .forward_cublas(tokens, x.device_ptr(), y.device_ptr(), &mut |_| Ok(()));
                }
                if l.use_graphs && tokens <= GRAPH_MAX_TOKENS {
                    return l.forward_graph(tokens, x.device_ptr(), y.device_ptr());
                }
                let pass = l.prepare(tokens, false)?;
                let launches = l.enqueue_device(&pass_with(pass, x, y), &mut |_| Ok(()))?;
                l.last.launches = launches;
                Ok(())
            },
        )
    }

    /// Whether a CUDA pass over `tokens` takes the cuBLAS path: always with
    /// [`MoePath::Cublas`], never with [`MoePath::Device`]; with [`MoePath::Auto`] above
    /// [`GRAPH_MAX_TOKENS`] tokens when the experts' GEMMs are large
    /// ([`AUTO_CUBLAS_MIN_FLOPS`](super::AUTO_CUBLAS_MIN_FLOPS)).
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

    /// Runs one eager forward pass and returns the time of each stage in µs (the GPU times of
    /// telemetry spans around the stages, captured for this call alone; the host clock on the
    /// CPU backend, each stage summed over the experts).
    pub fn profile(&mut self, x: &Buffer<T>, y: &mut Buffer<T>) -> Result<Vec<(String, f64)>> {
        let tokens = self.tokens_of(x)?;
        crate::memory::check_len("MoE forward (output)", y.len(), x.len())?;
        if tokens == 0 {
            return Ok(Vec::new());
        }
        let stream = self.stream.clone();
        stream.run(
            (self, y),
            |(l, y)| l.forward_host(x, y),
            |(l, y), _| {
                // One span per stage, each closed where the stage ends (the next one opens
                // on the same stream point, so a boundary costs one event).
                let (names, spans) = telemetry::capture_spans(|| {
                    let stream = l.stream.clone();
                    let mut names = Vec::new();
                    let mut stage = Some(telemetry::span(STAGE_SPAN, &stream));
                    let mut mark = |name: &'static str| -> Result<()> {
                        drop(stage.take());
                        names.push(name);
                        stage = Some(telemetry::span(STAGE_SPAN, &stream));
                        Ok(())
                    };
                    if l.uses_cublas(tokens) {
                        l.forward_cublas(tokens, x.device_ptr(), y.device_ptr(), &mut mark)?;
                    } else {
                        let pass = l.prepare(tokens, false)?;
                        l.enqueue_device(&pass_with(pass, x, y), &mut mark)?;
                    }
                    Ok(names)
                })?;
                names
                    .iter()
                    .zip(&spans)
                    .map(|(name, span)| {
                        let us = span.gpu_us().ok_or_else(|| {
                            Error::Unsupported(format!("MoE profile: no GPU time for {name}"))
                        })?;
                        Ok((name.to_string(), us))
                    })
                    .collect()
            },
        )
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
        let stream = self.stream.clone();
        stream.run(
            self,
            |l| {
                let (weights, experts) = l.route_host(x, tokens)?;
                Ok(Routing { experts, weights })
            },
            |l, _| {
                let pass = l.prepare(tokens, false)?;
                let pass = Pass {
                    plan: pass,
                    x: x.device_ptr(),
                    y: 0,
                };
                l.enqueue_router(&pass)?;
                let ws = l.workspace()?;
                // Only this pass's slots: the rest of the workspace was never written.
                let slots = crate::size::product("MoE routing", &[tokens, k])?;
                Ok(Routing {
                    experts: ws.experts.prefix_to_host(&l.stream, slots)?,
                    weights: ws.weights.prefix_to_host(&l.stream, slots)?,
                })
            },
        )
    }

    /// Runs the router and the permutation (dispatch) stages alone, without the experts
    /// (device path on CUDA, no host sync; the host router on the CPU backend). For
    /// benchmarks and profiling of those stages.
    pub fn route_and_permute(&mut self, x: &Buffer<T>) -> Result<()> {
        let tokens = self.tokens_of(x)?;
        if tokens == 0 {
            return Ok(());
        }
        let stream = self.stream.clone();
        stream.run(
            self,
            |l| l.route_host(x, tokens).map(drop),
            |l, _| {
                let plan = l.prepare(tokens, false)?;
                let pass = Pass {
                    plan,
                    x: x.device_ptr(),
                    y: 0,
                };
                l.launcher()?
                    .front(&l.stream, &pass, &mut |_| Ok(()))
                    .map(|_| ())
            },
        )
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
        s.run(
            (),
            |()| Ok(buf.host_view()?[offset..offset + len].to_vec()),
            |(), q| {
                let d = q.gpu;
                let cs = q.stream;
                let tmp = Buffer::<T>::uninit(s, len)?;
                let size = std::mem::size_of::<T>();
                d.copy_d2d(
                    cs,
                    tmp.device_ptr(),
                    buf.device_ptr() + (offset * size) as u64,
                    len * size,
                )?;
                tmp.to_host(s)
            },
        )
    }
}

fn pass_with<T: DType>(plan: Plan, x: &Buffer<T>, y: &Buffer<T>) -> Pass {
    Pass {
        plan,
        x: x.device_ptr(),
        y: y.device_ptr(),
    }
}

/// The intermediate size rounded up to the 8-row blocks of the w13 interleave (a valid config
/// has a multiple of 8 already; a loader's shapes are padded with zero rows all the same).
pub(super) fn inter_pad(intermediate: usize) -> usize {
    intermediate.div_ceil(8) * 8
}

/// A random tensor of `len` elements (see [`MoeWeights::Random`]).
fn random_buffer<T: Float>(
    stream: &Stream,
    len: usize,
    seed: u64,
    fan_in: usize,
) -> Result<Buffer<T>> {
    let scale = weights::random_scale(fan_in);
    stream.run(
        (),
        |()| {
            // Filled in place: a host copy first would need the memory twice.
            let mut buf = Buffer::<T>::uninit(stream, len)?;
            for (i, v) in buf.host_view_mut()?.iter_mut().enumerate() {
                *v = T::from_f64(weights::random_value(seed, i as u64, scale) as f64);
            }
            Ok(buf)
        },
        |(), q| {
            let d = q.gpu;
            let buf = Buffer::<T>::uninit(stream, len)?;
            let name = ops::by_float!("moe_init_random")[ops::float_index::<T>("MoE init")?];
            let grid = ops::fill_grid(d, (&MOE, name), len as u64, 256)?;
            let args = ops::Args::new()
                .buf(&buf)
                .u64(len as u64)
                .u64(seed)
                .f32(scale);
            // SAFETY: moe_init_random_T(T* out, u64 n, u64 seed, float scale): buf holds len elements.
            unsafe { ops::launch(q, (&MOE, name), grid, 256, 0, args)? };
            Ok(buf)
        },
    )
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
