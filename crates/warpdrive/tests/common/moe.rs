//! What the MoE tests share: small configs, seeded host weights, the plain f64 reference
//! (routing and forward), the CPU backend against it, and CUDA against the CPU backend with
//! routing flips counted apart (tests/moe.rs, tests/moe_cuda.rs).

use half::{bf16, f16};
use warpdrive::moe::{
    HostWeights, MoeConfig, MoeLayer, MoePath, MoeWeights, Router, Routing, WgmmaW256, WgmmaWide,
};
use warpdrive::{Buffer, DTypeKind, Device, Float};

use super::{cuda, random_f32, rng};

pub fn config(
    h: usize,
    i: usize,
    e: usize,
    k: usize,
    router: Router,
    dtype: DTypeKind,
) -> MoeConfig {
    MoeConfig {
        hidden: h,
        intermediate: i,
        experts: e,
        top_k: k,
        dtype,
        router,
        renormalize: true,
    }
}

pub const GROUPED: Router = Router::SigmoidGrouped {
    n_group: 4,
    topk_group: 2,
    routed_scaling: 2.5,
};

pub fn host_weights(c: &MoeConfig, seed: u64, bias: Option<f32>) -> HostWeights {
    let mut r = rng(seed);
    let (h, i, e) = (c.hidden, c.intermediate, c.experts);
    let scale = |v: Vec<f32>, fan: usize| -> Vec<f32> {
        v.into_iter().map(|x| x / (fan as f32).sqrt()).collect()
    };
    HostWeights {
        gate: scale(random_f32(&mut r, e * h), 1),
        gate_bias: bias.map(|b| random_f32(&mut r, e).into_iter().map(|x| x * b).collect()),
        w1: scale(random_f32(&mut r, e * i * h), h),
        w3: scale(random_f32(&mut r, e * i * h), h),
        w2: scale(random_f32(&mut r, e * h * i), i),
    }
}

/// Routing of one token in f64: (weights, experts), ties to the lower index.
pub fn route_ref(c: &MoeConfig, w: &HostWeights, x: &[f64]) -> (Vec<f64>, Vec<usize>) {
    let (h, e, k) = (c.hidden, c.experts, c.top_k);
    let logit = |j: usize| -> f64 { (0..h).map(|q| x[q] * w.gate[j * h + q] as f64).sum::<f64>() };
    let bias = |j: usize| w.gate_bias.as_ref().map_or(0.0, |b| b[j] as f64);
    let pick = |score: &dyn Fn(usize) -> f64, allowed: &dyn Fn(usize) -> bool| -> Vec<usize> {
        let mut left: Vec<usize> = (0..e).filter(|&j| allowed(j)).collect();
        let mut out = Vec::new();
        for _ in 0..k {
            let (at, _) = left
                .iter()
                .enumerate()
                .fold((0, f64::NEG_INFINITY), |best, (p, &j)| {
                    if score(j) > best.1 {
                        (p, score(j))
                    } else {
                        best
                    }
                });
            out.push(left.remove(at));
        }
        out
    };
    match c.router {
        Router::Softmax => {
            let l: Vec<f64> = (0..e).map(|j| logit(j) + bias(j)).collect();
            let chosen = pick(&|j| l[j], &|_| true);
            let m = l[chosen[0]];
            let ex: Vec<f64> = chosen.iter().map(|&j| (l[j] - m).exp()).collect();
            let denom: f64 = if c.renormalize {
                ex.iter().sum()
            } else {
                l.iter().map(|v| (v - m).exp()).sum()
            };
            (ex.iter().map(|v| v / denom).collect(), chosen)
        }
        Router::SigmoidGrouped {
            n_group,
            topk_group,
            routed_scaling,
        } => {
            let s: Vec<f64> = (0..e).map(|j| 1.0 / (1.0 + (-logit(j)).exp())).collect();
            let per = e / n_group;
            let mut gs: Vec<(f64, usize)> = (0..n_group)
                .map(|g| {
                    let mut v: Vec<f64> =
                        (g * per..(g + 1) * per).map(|j| s[j] + bias(j)).collect();
                    v.sort_by(|a, b| b.total_cmp(a));
                    (v.iter().take(2).sum(), g)
                })
                .collect();
            gs.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
            let kept: Vec<usize> = gs.iter().take(topk_group).map(|g| g.1).collect();
            let chosen = pick(&|j| s[j] + bias(j), &|j| kept.contains(&(j / per)));
            let sum: f64 = chosen.iter().map(|&j| s[j]).sum();
            let w = chosen
                .iter()
                .map(|&j| (if c.renormalize { s[j] / sum } else { s[j] }) * routed_scaling as f64)
                .collect();
            (w, chosen)
        }
    }
}

/// The f64 forward of one token: (output, magnitude bound per element).
pub fn forward_ref(c: &MoeConfig, w: &HostWeights, x: &[f64]) -> (Vec<f64>, Vec<f64>, Vec<usize>) {
    let (h, i) = (c.hidden, c.intermediate);
    let (ws, experts) = route_ref(c, w, x);
    let mut out = vec![0f64; h];
    let mut mag = vec![0f64; h];
    for (&wr, &e) in ws.iter().zip(&experts) {
        let act: Vec<f64> = (0..i)
            .map(|r| {
                let dot = |m: &[f32]| -> f64 {
                    (0..h).map(|q| x[q] * m[(e * i + r) * h + q] as f64).sum()
                };
                let g = dot(&w.w1);
                g / (1.0 + (-g).exp()) * dot(&w.w3)
            })
            .collect();
        for o in 0..h {
            let row = &w.w2[(e * h + o) * i..(e * h + o + 1) * i];
            let terms = act.iter().zip(row).map(|(a, b)| a * *b as f64);
            let (s, m) = terms.fold((0.0, 0.0), |(s, m), t| (s + t, m + t.abs()));
            out[o] += wr * s;
            mag[o] += wr.abs() * m;
        }
    }
    (out, mag, experts)
}

pub fn widen<T: Float>(v: &[T]) -> Vec<f64> {
    v.iter().map(|x| x.to_f64()).collect()
}

pub fn narrow<T: Float>(v: &[f32]) -> Vec<T> {
    v.iter().map(|&x| T::from_f64(x as f64)).collect()
}

/// The CPU backend's forward of `tokens` random tokens against the f64 reference.
pub fn cpu_matches_reference<T: Float>(
    c: MoeConfig,
    tokens: usize,
    bias: Option<f32>,
    tol: f64,
    s: u64,
) {
    let dev = Device::cpu();
    let st = dev.new_stream().unwrap();
    let w = host_weights(&c, s, bias);
    let mut layer = MoeLayer::<T>::new(&st, c, MoeWeights::Host(w.clone())).unwrap();
    // The reference sees the weights as the layer stores them (rounded to T).
    let w = layer.host_weights().unwrap();
    let x: Vec<T> = narrow(&random_f32(&mut rng(s + 1), tokens * c.hidden));
    let xb = Buffer::from_host(&st, &x).unwrap();
    let mut yb = Buffer::from_host(&st, &vec![T::from_f64(f64::NAN); x.len()]).unwrap();
    layer.forward_into(&xb, &mut yb).unwrap();
    let y = widen(&yb.to_host(&st).unwrap());
    let routing = layer.route(&xb).unwrap();
    let xs = widen(&x);
    for t in 0..tokens {
        let (r, mag, experts) = forward_ref(&c, &w, &xs[t * c.hidden..(t + 1) * c.hidden]);
        let got: Vec<usize> = routing.experts[t * c.top_k..(t + 1) * c.top_k]
            .iter()
            .map(|&e| e as usize)
            .collect();
        assert_eq!(got, experts, "token {t}: routing");
        for o in 0..c.hidden {
            let v = y[t * c.hidden + o];
            let bound = tol * mag[o] + 1e-6;
            assert!(
                (v - r[o]).abs() <= bound,
                "token {t} col {o}: {v} vs {} (bound {bound}) for {c:?}",
                r[o]
            );
        }
    }
}

// ---- CUDA against the CPU backend ----

pub struct Compared {
    pub flips: usize,
    pub slots: usize,
}

/// How the CUDA layer runs: its path, graphs on or off, whether the prefill tiles may take
/// Hopper's warpgroup MMA (off: the mma.sync kernels of older GPUs) and one-token passes
/// the decode kernel (off: the kernels of larger batches).
#[derive(Debug, Clone, Copy)]
pub struct Run {
    pub path: MoePath,
    pub graphs: bool,
    pub wgmma: bool,
    pub decode: bool,
    /// The wgmma tiles forced onto their overlap kernels or off them
    /// (`MoeLayer::set_wgmma_overlap`); None: the plan's choice per projection.
    pub overlap: Option<bool>,
    /// The wgmma tiles of these projections forced onto the wide 192-row tile, the others off
    /// it (`MoeLayer::set_wgmma_wide`); None: the plan's choice.
    pub wide: Option<WgmmaWide>,
    /// The wgmma tiles forced onto their warp-specialized TMA kernels or off them
    /// (`MoeLayer::set_wgmma_tma`); None: the plan's choice (where one tile holds an
    /// expert's rows).
    pub tma: Option<bool>,
    /// The 256-weight-row wgmma tile forced on some projections
    /// (`MoeLayer::set_wgmma_w256`; `WgmmaWide::Neither` keeps it off); None: the plan's choice.
    pub w256: Option<WgmmaW256>,
    /// The GEMMs' grid order forced (`MoeLayer::set_gemm_items_fastest`); None: the plan's.
    pub items_fastest: Option<bool>,
    /// Seeded host weights whose router bias sends every token's first choice to expert 0.
    pub one_expert: bool,
    /// The prefill router forced on or off (`MoeLayer::set_prefill_router`); None: the
    /// plan's choice (from `PREFILL_ROUTER_MIN_TOKENS` tokens).
    pub prefill: Option<bool>,
}

pub const fn run(path: MoePath, graphs: bool) -> Run {
    Run {
        path,
        graphs,
        wgmma: true,
        decode: true,
        overlap: None,
        wide: None,
        tma: None,
        w256: None,
        items_fastest: None,
        one_expert: false,
        prefill: None,
    }
}

/// CUDA vs CPU for one config and token count, same seeded weights and inputs, in the
/// config's element type (bf16 or f16). Tokens whose expert sets match are compared
/// elementwise (bf16 tolerance, which bounds f16 too); the others are counted.
pub fn cuda_vs_cpu(c: MoeConfig, tokens: usize, r: Run, s: u64) -> Compared {
    match c.dtype {
        DTypeKind::F16 => cuda_vs_cpu_as::<f16>(c, tokens, r, s),
        _ => cuda_vs_cpu_as::<bf16>(c, tokens, r, s),
    }
}

pub fn cuda_vs_cpu_as<T: Float>(c: MoeConfig, tokens: usize, r: Run, s: u64) -> Compared {
    let gpu = cuda();
    let gs = gpu.new_stream().unwrap();
    let cs = Device::cpu().new_stream().unwrap();
    let weights = if r.one_expert {
        let mut w = host_weights(&c, s, None);
        let mut bias = vec![0f32; c.experts];
        bias[0] = 1e3;
        w.gate_bias = Some(bias);
        MoeWeights::Host(w)
    } else {
        MoeWeights::Random { seed: s }
    };
    let mut g = MoeLayer::<T>::new(&gs, c, weights.clone()).unwrap();
    g.set_path(r.path);
    g.set_graphs(r.graphs);
    g.set_warpgroup_mma(r.wgmma);
    g.set_wgmma_overlap(r.overlap);
    g.set_wgmma_wide(r.wide);
    g.set_wgmma_tma(r.tma);
    g.set_wgmma_w256(r.w256);
    g.set_gemm_items_fastest(r.items_fastest);
    g.set_decode_kernel(r.decode);
    g.set_prefill_router(r.prefill);
    let mut h = MoeLayer::<T>::new(&cs, c, weights).unwrap();
    let hw = h.host_weights().unwrap();
    assert!(
        g.host_weights().unwrap() == hw,
        "weights differ between backends"
    );
    let x: Vec<T> = narrow(&random_f32(&mut rng(s + 7), tokens * c.hidden));
    let xg = Buffer::from_host(&gs, &x).unwrap();
    let xc = Buffer::from_host(&cs, &x).unwrap();
    let nan = vec![T::from_f64(f64::NAN); x.len()];
    let mut yg = Buffer::from_host(&gs, &nan).unwrap();
    g.forward_into(&xg, &mut yg).unwrap();
    // Twice: the second pass replays the graph where there is one.
    g.forward_into(&xg, &mut yg).unwrap();
    let yg = widen(&yg.to_host(&gs).unwrap());
    let yc = widen(&h.forward(&xc).unwrap().to_host(&cs).unwrap());
    let rg: Routing = g.route(&xg).unwrap();
    let rc: Routing = h.route(&xc).unwrap();
    let k = c.top_k;
    let xs = widen(&x);
    let mut flips = 0;
    for t in 0..tokens {
        let mut a = rg.experts[t * k..(t + 1) * k].to_vec();
        let mut b = rc.experts[t * k..(t + 1) * k].to_vec();
        a.sort_unstable();
        b.sort_unstable();
        if a != b {
            flips += a.iter().filter(|e| !b.contains(e)).count();
            continue;
        }
        let (_, mag, _) = forward_ref(&c, &hw, &xs[t * c.hidden..(t + 1) * c.hidden]);
        for o in 0..c.hidden {
            let (vg, vc) = (yg[t * c.hidden + o], yc[t * c.hidden + o]);
            let bound = 3e-2 * mag[o] + 1e-3;
            assert!(
                (vg - vc).abs() <= bound,
                "token {t} col {o}: cuda {vg} cpu {vc} (bound {bound}) {c:?} tokens {tokens} {r:?}"
            );
        }
    }
    Compared {
        flips,
        slots: tokens * k,
    }
}

pub fn assert_few_flips(r: Compared, what: &str) {
    // Near-ties can flip in bf16; more than 2% of slots is a bug.
    assert!(
        r.flips * 50 <= r.slots.max(50),
        "{what}: {} of {} slots flipped",
        r.flips,
        r.slots
    );
}

/// [`cuda_vs_cpu`] at each of `tokens`, each with few flips.
pub fn few_flips_at(tokens: &[usize], c: MoeConfig, r: Run, s: u64, what: &str) {
    for &t in tokens {
        assert_few_flips(cuda_vs_cpu(c, t, r, s), what);
    }
}
