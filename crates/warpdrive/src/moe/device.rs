use crate::device::TiledMap;
use crate::dtype::Float;
use crate::error::{Error, Result};
use crate::exec::graph::Graph;
use crate::memory::Buffer;

use super::config::{fused_route, ForwardStats, GRAPH_CACHE, GRAPH_MAX_TOKENS};
use super::launcher::Launcher;
use super::layer::{MoeLayer, Pass};
use super::plan::{check_pass, Gpu, Plan, Workspace};

impl<T: Float> MoeLayer<T> {
    // ---- the device path ----

    /// The device as the plans see it (wgmma only where allowed).
    fn plan_gpu(&self) -> Gpu {
        Gpu {
            wgmma: self.gpu.wgmma && self.warpgroup_mma,
            wgmma_overlap: self.wgmma_overlap,
            wgmma_wide: self.wgmma_wide,
            wgmma_tma: self.wgmma_tma,
            wgmma_w256: self.wgmma_w256,
            items_fastest: self.gemm_items_fastest,
            prefill_router: self.prefill_router,
            decode: self.gpu.decode && self.decode_kernel,
            ..self.gpu
        }
    }

    pub(super) fn workspace(&self) -> Result<&Workspace<T>> {
        self.ws
            .as_ref()
            .ok_or_else(|| Error::InvalidArgument("MoE workspace missing".into()))
    }

    /// The plan for `tokens`, with a workspace large enough (reallocated, dropping every
    /// graph, when it is not).
    pub(super) fn prepare(&mut self, tokens: usize, cublas: bool) -> Result<Plan> {
        let plan = Plan::new(&self.config, tokens, self.plan_gpu());
        if (plan.up.wgmma_tma || plan.down.wgmma_tma) && self.wgmma_maps.is_none() {
            self.wgmma_maps = Some(self.encode_wgmma_maps()?);
        }
        let fits = self.ws.as_ref().is_some_and(|w| {
            w.tokens >= tokens
                && (!cublas || w.cublas.is_some())
                && w.partial.len() >= plan.partial_len()
                && w.logits.len() >= plan.logits_len(&self.config)
                && w.tickets.len() >= plan.tickets_len()
                && w.work.len() >= 2 * plan.items
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
        if plan.down.wgmma_tma {
            self.encode_act_map()?;
        }
        Ok(plan)
    }

    pub(super) fn forward_graph(&mut self, tokens: usize, x: u64, y: u64) -> Result<()> {
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
        graph.prepare()?;
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
    pub(super) fn launcher(&self) -> Result<Launcher> {
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
            sort_counts: ws.sort_counts.device_ptr(),
            partial: ws.partial.device_ptr(),
            act: ws.act.device_ptr(),
            y_rows: ws.y.device_ptr(),
            w13_map: self.wgmma_maps.as_ref().map_or(0, |m| m.device_ptr()),
            w2_map: self.wgmma_maps.as_ref().map_or(0, |m| m.device_ptr() + 128),
            act_map: ws.act_map.as_ref().map_or(0, |m| m.device_ptr()),
        })
    }

    /// The TMA tensor maps of w13 ([E, 2I, H]) and w2 ([E, H, I]) for the warp-specialized
    /// wgmma tiles, in one device buffer (w13's at byte 0, w2's at 128): 3D maps
    /// [experts, rows, k] whose boxes (64 k × 128 rows of one expert, the ring's weight
    /// stage) come 128-byte swizzled, zero past the rows and k. Written once, before any
    /// capture: the kernels read them through `MoeGemm::w_map`.
    fn encode_wgmma_maps(&self) -> Result<Buffer<u64>> {
        let q = self.stream.gpu("MoE TMA tensor maps")?;
        let c = &self.config;
        let elem = std::mem::size_of::<T>() as u64;
        let (e, h, i) = (c.experts as u64, c.hidden as u64, c.intermediate as u64);
        let mut words = Vec::with_capacity(32);
        // (weights, rows, k) as the launcher passes them: n = 2I, k = H; then n = H, k = I.
        for (w, n, k) in [(&self.w13, 2 * i, h), (&self.w2, h, i)] {
            let map = q.gpu.encode_tiled_map(&TiledMap {
                dtype: T::KIND,
                address: w.device_ptr(),
                dims: &[k, n, e],
                strides: &[k * elem, n * k * elem],
                boxed: &[64, 128, 1],
            })?;
            words.extend_from_slice(&map.0);
        }
        self.upload_maps(&words)
    }

    /// The workspace's `act` ([rows, I], the down GEMM's token rows, contiguous per expert)
    /// as a 2D TMA map of 32-row boxes (64 k × 32 rows, 128-byte swizzled, zero past the
    /// buffer), once per workspace: its address is fixed until the workspace is reallocated,
    /// which drops the graphs and this map with it. Where I's rows are not 16-byte strided
    /// there is no map and the tile loads the rows by cp.async.
    fn encode_act_map(&mut self) -> Result<()> {
        let elem = std::mem::size_of::<T>();
        let i = self.config.intermediate;
        let (address, rows) = match self.ws.as_ref() {
            Some(ws) if ws.act_map.is_none() && i > 0 && (i * elem) % 16 == 0 => {
                (ws.act.device_ptr(), ws.act.len() / i)
            }
            _ => return Ok(()),
        };
        if rows == 0 {
            return Ok(());
        }
        let q = self.stream.gpu("MoE TMA tensor maps")?;
        let map = q.gpu.encode_tiled_map(&TiledMap {
            dtype: T::KIND,
            address,
            dims: &[i as u64, rows as u64],
            strides: &[(i * elem) as u64],
            boxed: &[64, 32],
        })?;
        let buf = self.upload_maps(&map.0)?;
        if let Some(ws) = self.ws.as_mut() {
            ws.act_map = Some(buf);
        }
        Ok(())
    }

    /// Tensor maps (16 words each) in a device buffer, for the kernels to read.
    fn upload_maps(&self, words: &[u64]) -> Result<Buffer<u64>> {
        let mut buf = Buffer::uninit(&self.stream, words.len())?;
        // The TMA unit reads a map in global memory at a 64-byte-aligned address (CUDA 13's
        // CUtensorMap declares 128).
        if buf.device_ptr() % 128 != 0 {
            return Err(Error::Unsupported(format!(
                "MoE TMA tensor maps: the pool gave {:#x}, not 128-byte aligned",
                buf.device_ptr()
            )));
        }
        buf.driver_copy_from_host(&self.stream, words)?;
        Ok(buf)
    }

    pub(super) fn enqueue_device(
        &self,
        pass: &Pass,
        mark: &mut dyn FnMut(&'static str) -> Result<()>,
    ) -> Result<u32> {
        self.launcher()?.enqueue_marked(&self.stream, pass, mark)
    }

    pub(super) fn enqueue_router(&self, pass: &Pass) -> Result<()> {
        let l = self.launcher()?;
        if pass.plan.prefill_router {
            return l
                .prefill_front(&self.stream, pass, &mut |_| Ok(()), false)
                .map(drop);
        }
        l.router(&self.stream, pass)?;
        if !fused_route(&self.config) {
            l.route(&self.stream, pass)?;
        }
        Ok(())
    }
}
