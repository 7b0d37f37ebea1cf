use crate::device::cpu;
use crate::dtype::Float;
use crate::error::Result;
use crate::memory::{host_filled, host_vec, Buffer};
use crate::ops::{self, Route};

use super::config::{ForwardStats, Router};
use super::layer::{inter_pad, MoeLayer};

impl<T: Float> MoeLayer<T> {
    // ---- the CPU backend ----

    pub(super) fn route_host(&self, x: &Buffer<T>, tokens: usize) -> Result<(Vec<f32>, Vec<u32>)> {
        let c = &self.config;
        let (h, e, k) = (c.hidden, c.experts, c.top_k);
        let xs = x.host_view()?;
        let gate = self.gate.host_view()?;
        let bias = match &self.gate_bias {
            Some(b) => Some(b.host_view()?),
            None => None,
        };
        let mut logits = host_filled("MoE router logits (CPU)", tokens * e, 0f32)?;
        for t in 0..tokens {
            let xr = &xs[t * h..(t + 1) * h];
            for j in 0..e {
                let g = &gate[j * h..(j + 1) * h];
                let dot: f64 = xr.iter().zip(g).map(|(a, b)| a.to_f64() * b.to_f64()).sum();
                logits[t * e + j] = dot as f32;
            }
        }
        match c.router {
            Router::Softmax => {
                if let Some(b) = bias {
                    for row in logits.chunks_exact_mut(e) {
                        for (l, &bv) in row.iter_mut().zip(b) {
                            *l += bv;
                        }
                    }
                }
                let s = &self.stream;
                let lb = Buffer::from_host(s, &logits)?;
                let mut w = Buffer::<f32>::zeros(s, tokens * k)?;
                let mut idx = Buffer::<u32>::zeros(s, tokens * k)?;
                let r = Route {
                    experts: e,
                    k,
                    renormalize: c.renormalize,
                };
                ops::route(s, &r, &lb, &mut w, &mut idx)?;
                Ok((w.host_view()?.to_vec(), idx.host_view()?.to_vec()))
            }
            Router::SigmoidGrouped {
                n_group,
                topk_group,
                routed_scaling,
            } => {
                let mut w = host_vec("MoE routing weights (CPU)", tokens * k)?;
                let mut idx = host_vec("MoE routing experts (CPU)", tokens * k)?;
                for row in logits.chunks_exact(e) {
                    let (rw, ri) = sigmoid_grouped(
                        row,
                        bias,
                        k,
                        (n_group, topk_group),
                        c.renormalize,
                        routed_scaling,
                    );
                    w.extend(rw);
                    idx.extend(ri);
                }
                Ok((w, idx))
            }
        }
    }

    /// The pass on the host; returns µs per stage (host clock), named as the device path's
    /// `profile` names them, each summed over the experts.
    pub(super) fn forward_host(
        &mut self,
        x: &Buffer<T>,
        y: &mut Buffer<T>,
    ) -> Result<Vec<(String, f64)>> {
        let c = self.config;
        let (h, inter, k) = (c.hidden, c.intermediate, c.top_k);
        let wide = 2 * inter_pad(inter);
        let tokens = ops::rows_of("MoE forward", x.len(), h)?;
        const STAGES: &[&str] = &[
            "router",
            "dispatch",
            "experts-gate-up",
            "swiglu",
            "experts-down",
            "combine",
        ];
        let mut stages = StageClock::new(STAGES);
        let (weights, experts) = self.route_host(x, tokens)?;
        stages.lap(0);
        let mut xs = host_vec("MoE input as f32 (CPU)", x.len())?;
        xs.extend(x.host_view()?.iter().map(|v| v.to_f64() as f32));
        let (w13_all, w2_all) = (self.w13.host_view()?, self.w2.host_view()?);
        let widen = |v: &[T]| -> Vec<f32> { v.iter().map(|x| x.to_f64() as f32).collect() };
        let mut by_expert: Vec<Vec<usize>> = vec![Vec::new(); c.experts];
        for (slot, &e) in experts.iter().enumerate() {
            if let Some(list) = by_expert.get_mut(e as usize) {
                list.push(slot);
            }
        }
        let mut out = host_filled("MoE output as f64 (CPU)", tokens * h, 0f64)?;
        for (e, slots) in by_expert.iter().enumerate() {
            if slots.is_empty() {
                continue;
            }
            let m = slots.len();
            let mut a = host_vec("MoE expert input (CPU)", m * h)?;
            for &s in slots {
                a.extend_from_slice(&xs[(s / k) * h..(s / k + 1) * h]);
            }
            stages.lap(1);
            let mut hbuf = host_filled("MoE gate/up output (CPU)", m * wide, 0f32)?;
            let b = widen(&w13_all[e * wide * h..(e + 1) * wide * h]);
            cpu::gemm_f32(&a, &b, &mut hbuf, (m, wide, h), (false, true))?;
            stages.lap(2);
            // SwiGLU on the interleaved columns, rounded to T as the device path stores it.
            let mut act = host_filled("MoE activations (CPU)", m * inter, 0f32)?;
            for r in 0..m {
                for col in 0..inter {
                    let base = (col / 8) * 16 + col % 8;
                    let g = hbuf[r * wide + base] as f64;
                    let u = hbuf[r * wide + base + 8] as f64;
                    act[r * inter + col] = T::from_f64(g / (1.0 + (-g).exp()) * u).to_f64() as f32;
                }
            }
            stages.lap(3);
            let mut yb = host_filled("MoE down output (CPU)", m * h, 0f32)?;
            let b2 = widen(&w2_all[e * h * inter..(e + 1) * h * inter]);
            cpu::gemm_f32(&act, &b2, &mut yb, (m, h, inter), (false, true))?;
            stages.lap(4);
            for (r, &s) in slots.iter().enumerate() {
                let wgt = weights[s] as f64;
                let dst = &mut out[(s / k) * h..(s / k + 1) * h];
                for (o, &v) in dst.iter_mut().zip(&yb[r * h..(r + 1) * h]) {
                    *o += wgt * v as f64;
                }
            }
            stages.lap(5);
        }
        for (dst, v) in y.host_view_mut()?.iter_mut().zip(out) {
            *dst = T::from_f64(v);
        }
        stages.lap(5);
        self.last = ForwardStats::default();
        Ok(stages.into_us())
    }
}

/// Host time per named stage, the time since the last lap going to the stage named there.
struct StageClock {
    names: &'static [&'static str],
    us: Vec<f64>,
    last: std::time::Instant,
}

impl StageClock {
    fn new(names: &'static [&'static str]) -> StageClock {
        StageClock {
            names,
            us: vec![0.0; names.len()],
            last: std::time::Instant::now(),
        }
    }

    /// Adds the time since the last lap to stage `i`.
    fn lap(&mut self, i: usize) {
        let now = std::time::Instant::now();
        if let Some(t) = self.us.get_mut(i) {
            *t += (now - self.last).as_secs_f64() * 1e6;
        }
        self.last = now;
    }

    fn into_us(self) -> Vec<(String, f64)> {
        self.names
            .iter()
            .map(|n| n.to_string())
            .zip(self.us)
            .collect()
    }
}

/// The grouped sigmoid router for one token (the CPU reference of
/// `moe_route_sigmoid_grouped`): (weights, experts).
pub(crate) fn sigmoid_grouped(
    logits: &[f32],
    bias: Option<&[f32]>,
    k: usize,
    (n_group, topk_group): (usize, usize),
    renormalize: bool,
    scaling: f32,
) -> (Vec<f32>, Vec<u32>) {
    let e = logits.len();
    let per = e / n_group;
    let score = |i: usize| 1.0 / (1.0 + (-(logits[i] as f64)).exp());
    let mut sel: Vec<f64> = (0..e)
        .map(|i| score(i) + bias.map_or(0.0, |b| b[i] as f64))
        .collect();
    let mut groups: Vec<(f64, usize)> = (0..n_group)
        .map(|g| {
            let mut v: Vec<f64> = sel[g * per..(g + 1) * per].to_vec();
            v.sort_by(|a, b| b.total_cmp(a));
            (v.iter().take(2).sum(), g)
        })
        .collect();
    // Best first; ties to the lower group.
    groups.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
    let kept: Vec<usize> = groups.iter().take(topk_group).map(|g| g.1).collect();
    for (i, s) in sel.iter_mut().enumerate() {
        if !kept.contains(&(i / per)) {
            *s = f64::NEG_INFINITY;
        }
    }
    let mut chosen = Vec::with_capacity(k);
    for _ in 0..k {
        let mut best = 0usize;
        for i in 1..e {
            if sel[i] > sel[best] {
                best = i;
            }
        }
        chosen.push(best);
        sel[best] = f64::NEG_INFINITY;
    }
    let sum: f64 = chosen.iter().map(|&i| score(i)).sum();
    let w = chosen
        .iter()
        .map(|&i| {
            let s = score(i);
            ((if renormalize { s / sum } else { s }) * scaling as f64) as f32
        })
        .collect();
    (w, chosen.iter().map(|&i| i as u32).collect())
}
