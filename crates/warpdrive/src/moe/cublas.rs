use crate::device::GemmCall;
use crate::dtype::Float;
use crate::error::{Error, Result};
use crate::kernels::MOE;
use crate::ops;

use super::config::{ForwardStats, CUBLAS_GROUPED_MAX_FLOPS};
use super::layer::{MoeLayer, Pass};

impl<T: Float> MoeLayer<T> {
    // ---- the cuBLAS path ----

    pub(super) fn forward_cublas(
        &mut self,
        tokens: usize,
        x: u64,
        y: u64,
        mark: &mut dyn FnMut(&'static str) -> Result<()>,
    ) -> Result<()> {
        let plan = self.prepare(tokens, true)?;
        let pass = Pass { plan, x, y };
        let l = self.launcher()?;
        let s = &self.stream;
        let front = l.front(s, &pass, mark)?;
        let ws = self.workspace()?;
        let counts = ws.counts.to_host(s)?;
        let (Some([xp, h, yt]), Some(pointers)) = (ws.cublas.as_ref(), ws.gemm_pointers.as_ref())
        else {
            return Err(Error::InvalidArgument(
                "MoE cuBLAS workspace missing".into(),
            ));
        };
        let (hd, inter) = (self.config.hidden, self.config.intermediate);
        let q = s.gpu("the cuBLAS path")?;
        let d = q.gpu;
        let size = std::mem::size_of::<T>() as u64;
        // SAFETY: token_of holds `slots` row indices below `tokens` (the dispatch wrote them),
        // x holds tokens·hidden elements, xp slots·hidden.
        unsafe {
            ops::permute::gather_rows_raw(
                q,
                x,
                tokens,
                hd * size as usize,
                ws.token_of.device_ptr(),
                plan.slots,
                xp.device_ptr(),
            )?;
        }
        let mut up = Vec::new();
        let mut down = Vec::new();
        let mut row = 0usize;
        for (e, &c) in counts.iter().enumerate() {
            let m = c as usize;
            if m > 0 {
                let call = |n, k, a: u64, b: u64, c: u64| GemmCall {
                    dtype: T::KIND,
                    m,
                    n,
                    k,
                    trans_a: false,
                    trans_b: true,
                    tf32: false,
                    f32_out: false,
                    batch: 1,
                    a,
                    b,
                    c,
                    stride_a: 0,
                    stride_b: 0,
                    stride_c: 0,
                };
                up.push(call(
                    2 * inter,
                    hd,
                    xp.device_ptr() + (row * hd) as u64 * size,
                    self.w13.device_ptr() + (e * 2 * inter * hd) as u64 * size,
                    h.device_ptr() + (row * 2 * inter) as u64 * size,
                ));
                down.push(call(
                    hd,
                    inter,
                    ws.act.device_ptr() + (row * inter) as u64 * size,
                    self.w2.device_ptr() + (e * hd * inter) as u64 * size,
                    yt.device_ptr() + (row * hd) as u64 * size,
                ));
            }
            row += m;
        }
        if row != plan.slots {
            return Err(Error::InvalidArgument(format!(
                "MoE dispatch counted {row} routed slots, {} expected",
                plan.slots
            )));
        }
        let t = l.dtype_index()?;
        let rows = plan.slots / up.len().max(1);
        let grouped =
            2.0 * rows as f64 * (2 * inter) as f64 * (hd as f64) < CUBLAS_GROUPED_MAX_FLOPS;
        let (up_ptrs, down_ptrs) = (
            pointers.device_ptr(),
            pointers.device_ptr() + (3 * up.len() * 8) as u64,
        );
        if grouped {
            let mut ptrs = crate::device::Gpu::grouped_gemm_pointers(&up);
            ptrs.extend(crate::device::Gpu::grouped_gemm_pointers(&down));
            d.copy_h2d(q.stream, up_ptrs, &ptrs)?;
        }
        let run = |calls: &[GemmCall], ptrs: u64| -> Result<()> {
            // SAFETY: each call's rows lie inside xp / h / act / yt (offsets from the counts,
            // which sum to `slots`, checked above) and inside w13 / w2 (one matrix per
            // expert); the pointer arrays (at most 6 words per expert) were copied above.
            unsafe {
                if grouped {
                    d.gemm_grouped(q.stream, calls, ptrs)
                } else {
                    d.gemm(q.stream, calls)
                }
            }
        };
        run(&up, up_ptrs)?;
        mark("experts-gate-up")?;
        let args = ops::Args::new()
            .ptr(h.device_ptr())
            .u64(plan.slots as u64)
            .u32(inter as u32)
            .ptr(ws.act.device_ptr());
        let name = ["moe_swiglu_f16", "moe_swiglu_bf16"][t];
        // One thread a block of 8 columns (moe.cu).
        let grid = ops::fill_grid(d, (&MOE, name), (plan.slots * inter / 8) as u64, 256)?;
        // SAFETY: moe_swiglu_T(const T* h, u64 rows, u32 inter, T* act): h holds slots·2I,
        // act slots·I elements.
        unsafe { ops::launch(q, (&MOE, name), grid, 256, 0, args)? };
        mark("swiglu")?;
        run(&down, down_ptrs)?;
        mark("experts-down")?;
        l.combine(s, &pass, yt.device_ptr(), ws.weights.device_ptr())?;
        mark("combine")?;
        self.last = ForwardStats {
            host_syncs: 1,
            launches: front
                + 3
                + if grouped {
                    2
                } else {
                    (up.len() + down.len()) as u32
                },
            graph: false,
        };
        Ok(())
    }
}
