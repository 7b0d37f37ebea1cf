//! The MoE layer. CPU backend against a plain f64 reference on small random configs (experts
//! with no tokens, every token on one expert, k = E, both routers, f32 and bf16); errors for
//! bad configs, shapes and weights; safetensors loading (stacked and per-expert names). GPU
//! tests (`gpu_smem_*`, ignored without a GPU) compare CUDA with the CPU backend with bf16
//! tolerances under identical routing (routing flips are counted and bounded separately),
//! graph replay with eager, and the device path with the cuBLAS path. A layer loaded from a
//! file computes what the layer built from the same weights in memory does (both backends).
//!
//! Tolerances: each output element within TOL × Σ_r |w_r| Σ_i |w2·act| (+ a small floor) of
//! the f64 reference: f32 1e-5 (f32 GEMM accumulation), bf16 3e-2 (bf16 inputs, act and
//! output rounding).

mod common;

use common::{cuda, device_test, random_f32, rng, seed};
use half::{bf16, f16};
use warpdrive::moe::{
    HostWeights, MoeConfig, MoeLayer, MoePath, MoeWeights, Router, Routing, WeightsFile,
    GRAPH_MAX_TOKENS,
};
use warpdrive::{Buffer, DTypeKind, Device, Error, Float};

fn config(h: usize, i: usize, e: usize, k: usize, router: Router, dtype: DTypeKind) -> MoeConfig {
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

const GROUPED: Router = Router::SigmoidGrouped {
    n_group: 4,
    topk_group: 2,
    routed_scaling: 2.5,
};

fn host_weights(c: &MoeConfig, seed: u64, bias: Option<f32>) -> HostWeights {
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
fn route_ref(c: &MoeConfig, w: &HostWeights, x: &[f64]) -> (Vec<f64>, Vec<usize>) {
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
fn forward_ref(c: &MoeConfig, w: &HostWeights, x: &[f64]) -> (Vec<f64>, Vec<f64>, Vec<usize>) {
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

fn widen<T: Float>(v: &[T]) -> Vec<f64> {
    v.iter().map(|x| x.to_f64()).collect()
}

fn narrow<T: Float>(v: &[f32]) -> Vec<T> {
    v.iter().map(|&x| T::from_f64(x as f64)).collect()
}

/// The CPU backend's forward of `tokens` random tokens against the f64 reference.
fn cpu_matches_reference<T: Float>(
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

#[test]
fn cpu_forward_matches_f64_reference() {
    let s = seed("cpu_forward_matches_f64_reference");
    // Odd sizes; 9 experts for 3 tokens leaves most experts without tokens.
    cpu_matches_reference::<f32>(
        config(40, 24, 5, 2, Router::Softmax, DTypeKind::F32),
        37,
        None,
        1e-5,
        s,
    );
    cpu_matches_reference::<f32>(
        config(56, 8, 9, 1, Router::Softmax, DTypeKind::F32),
        3,
        Some(0.5),
        1e-5,
        s + 10,
    );
    // k = E.
    cpu_matches_reference::<f32>(
        config(24, 16, 4, 4, Router::Softmax, DTypeKind::F32),
        11,
        None,
        1e-5,
        s + 20,
    );
    // The grouped sigmoid router with a selection bias.
    cpu_matches_reference::<f32>(
        config(32, 24, 16, 3, GROUPED, DTypeKind::F32),
        21,
        Some(0.3),
        1e-5,
        s + 30,
    );
    cpu_matches_reference::<bf16>(
        config(40, 24, 8, 2, Router::Softmax, DTypeKind::BF16),
        19,
        None,
        3e-2,
        s + 40,
    );
    cpu_matches_reference::<bf16>(
        config(32, 16, 16, 4, GROUPED, DTypeKind::BF16),
        9,
        None,
        3e-2,
        s + 50,
    );
    cpu_matches_reference::<f16>(
        config(40, 24, 8, 2, Router::Softmax, DTypeKind::F16),
        19,
        None,
        4e-3,
        s + 60,
    );
}

device_test!(
    /// `profile` times the pass stage by stage on every backend (the CPU once timed it as one
    /// `forward` stage), and the stages add up to no more than the pass.
    profile_times_each_stage,
    gpu_profile_times_each_stage,
    |dev| {
        let s = seed("profile_times_each_stage");
        let c = config(64, 32, 4, 2, Router::Softmax, DTypeKind::BF16);
        let st = dev.new_stream().unwrap();
        let mut layer = MoeLayer::<bf16>::new(&st, c, MoeWeights::Random { seed: s }).unwrap();
        let x: Vec<bf16> = random_f32(&mut rng(s + 1), 5 * 64)
            .into_iter()
            .map(bf16::from_f32)
            .collect();
        let xb = Buffer::from_host(&st, &x).unwrap();
        let mut y = Buffer::<bf16>::uninit(&st, x.len()).unwrap();
        layer.profile(&xb, &mut y).unwrap();
        let stages = layer.profile(&xb, &mut y).unwrap();
        let names: Vec<&str> = stages.iter().map(|(n, _)| n.as_str()).collect();
        assert!(stages.len() > 1, "{names:?}");
        assert!(!names.contains(&"forward"), "{names:?}");
        for want in ["experts-gate-up", "experts-down", "combine"] {
            assert!(names.contains(&want), "{want} missing from {names:?}");
        }
        assert!(stages.iter().all(|(_, us)| *us >= 0.0), "{stages:?}");
    }
);

#[test]
fn all_tokens_on_one_expert() {
    let s = seed("all_tokens_on_one_expert");
    let c = config(16, 8, 6, 1, Router::Softmax, DTypeKind::F32);
    let mut w = host_weights(&c, s, None);
    let mut bias = vec![0f32; 6];
    bias[4] = 1e3;
    w.gate_bias = Some(bias);
    let st = Device::cpu().new_stream().unwrap();
    let mut layer = MoeLayer::<f32>::new(&st, c, MoeWeights::Host(w.clone())).unwrap();
    let x = random_f32(&mut rng(s + 1), 7 * 16);
    let xb = Buffer::from_host(&st, &x).unwrap();
    let routing = layer.route(&xb).unwrap();
    assert!(routing.experts.iter().all(|&e| e == 4));
    assert!(routing.weights.iter().all(|&v| v == 1.0));
    let y = layer.forward(&xb).unwrap().to_host(&st).unwrap();
    let xs: Vec<f64> = x.iter().map(|&v| v as f64).collect();
    for t in 0..7 {
        let (r, mag, _) = forward_ref(&c, &w, &xs[t * 16..(t + 1) * 16]);
        for o in 0..16 {
            assert!((y[t * 16 + o] as f64 - r[o]).abs() <= 1e-5 * mag[o] + 1e-6);
        }
    }
}

#[test]
fn bad_configs_and_shapes_are_errors() {
    let st = Device::cpu().new_stream().unwrap();
    let ok = config(16, 8, 4, 2, Router::Softmax, DTypeKind::F32);
    let bad = [
        MoeConfig { top_k: 5, ..ok },
        MoeConfig { top_k: 0, ..ok },
        MoeConfig { hidden: 0, ..ok },
        MoeConfig {
            dtype: DTypeKind::I32,
            ..ok
        },
        MoeConfig {
            router: Router::SigmoidGrouped {
                n_group: 3,
                topk_group: 1,
                routed_scaling: 1.0,
            },
            ..ok
        },
        MoeConfig {
            router: Router::SigmoidGrouped {
                n_group: 2,
                topk_group: 3,
                routed_scaling: 1.0,
            },
            ..ok
        },
        MoeConfig {
            top_k: 3,
            router: Router::SigmoidGrouped {
                n_group: 2,
                topk_group: 1,
                routed_scaling: 1.0,
            },
            ..ok
        },
    ];
    for c in bad {
        assert!(
            matches!(
                MoeLayer::<f32>::new(&st, c, MoeWeights::Random { seed: 1 }),
                Err(Error::InvalidArgument(_))
            ),
            "{c:?}"
        );
    }
    // The layer's element type must be the config's.
    assert!(MoeLayer::<bf16>::new(&st, ok, MoeWeights::Random { seed: 1 }).is_err());
    // Weights of the wrong shape name the tensor.
    let mut w = host_weights(&ok, 1, None);
    w.w2.pop();
    let err = MoeLayer::<f32>::new(&st, ok, MoeWeights::Host(w)).unwrap_err();
    assert!(err.to_string().contains("experts.w2"), "{err}");
    let mut layer = MoeLayer::<f32>::new(&st, ok, MoeWeights::Random { seed: 1 }).unwrap();
    let x = Buffer::<f32>::zeros(&st, 17).unwrap();
    assert!(matches!(layer.forward(&x), Err(Error::InvalidArgument(_))));
    let x = Buffer::<f32>::zeros(&st, 32).unwrap();
    let mut y = Buffer::<f32>::zeros(&st, 16).unwrap();
    assert!(layer.forward_into(&x, &mut y).is_err());
    // Zero tokens: nothing to do.
    let x = Buffer::<f32>::zeros(&st, 0).unwrap();
    assert_eq!(layer.forward(&x).unwrap().len(), 0);
    assert!(MoeConfig::preset("nope").is_err());
    for name in warpdrive::moe::PRESETS {
        MoeConfig::preset(name).unwrap().validate().unwrap();
    }
    assert_eq!(
        MoeConfig::preset(warpdrive::moe::TINY).unwrap(),
        MoeConfig::tiny()
    );
    assert_eq!(MoeConfig::default(), MoeConfig::tiny());
}

/// What the CUDA kernels refuse (16-byte rows: hidden and intermediate multiples of 8) is
/// refused on the CPU backend too, with the reason, so a config that runs in CI runs on a GPU.
#[test]
fn cpu_refuses_sizes_the_cuda_kernels_refuse() {
    let st = Device::cpu().new_stream().unwrap();
    for (h, i) in [(12, 8), (16, 7), (13, 7)] {
        let c = config(h, i, 4, 2, Router::Softmax, DTypeKind::F32);
        let err = c.validate().unwrap_err();
        assert!(
            matches!(err, Error::InvalidArgument(ref m) if m.contains("multiples of 8")),
            "{h}×{i}: {err}"
        );
        let err = MoeLayer::<f32>::new(&st, c, MoeWeights::Random { seed: 1 }).unwrap_err();
        assert!(err.to_string().contains("multiples of 8"), "{h}×{i}: {err}");
    }
    MoeLayer::<f32>::new(
        &st,
        config(16, 8, 4, 2, Router::Softmax, DTypeKind::F32),
        MoeWeights::Random { seed: 1 },
    )
    .unwrap();
}

#[test]
fn random_init_is_the_same_for_the_same_seed() {
    let st = Device::cpu().new_stream().unwrap();
    let c = config(16, 8, 4, 2, Router::Softmax, DTypeKind::BF16);
    let a = MoeLayer::<bf16>::new(&st, c, MoeWeights::Random { seed: 3 }).unwrap();
    let b = MoeLayer::<bf16>::new(&st, c, MoeWeights::Random { seed: 3 }).unwrap();
    let d = MoeLayer::<bf16>::new(&st, c, MoeWeights::Random { seed: 4 }).unwrap();
    let (wa, wb, wd) = (
        a.host_weights().unwrap(),
        b.host_weights().unwrap(),
        d.host_weights().unwrap(),
    );
    assert!(wa == wb, "same seed, other weights");
    assert_ne!(wa.w1, wd.w1);
    assert_ne!(wa.w1, wa.w3);
    assert!(wa.w2.iter().all(|v| v.abs() <= (3.0f32 / 8.0).sqrt()));
}

// ---- safetensors ----

fn bf16_bytes(v: &[f32]) -> Vec<u8> {
    v.iter()
        .flat_map(|&x| bf16::from_f32(x).to_bits().to_le_bytes())
        .collect()
}

fn write_safetensors(path: &std::path::Path, tensors: Vec<(String, Vec<usize>, Vec<f32>)>) {
    use safetensors::tensor::TensorView;
    let data: Vec<(String, Vec<usize>, Vec<u8>)> = tensors
        .into_iter()
        .map(|(n, s, v)| (n, s, bf16_bytes(&v)))
        .collect();
    let views: Vec<(String, TensorView)> = data
        .iter()
        .map(|(n, s, b)| {
            (
                n.clone(),
                TensorView::new(safetensors::Dtype::BF16, s.clone(), b).unwrap(),
            )
        })
        .collect();
    safetensors::serialize_to_file(views, None, path).unwrap();
}

#[test]
fn safetensors_stacked_and_per_expert_names_load() {
    let s = seed("safetensors_stacked_and_per_expert_names_load");
    let c = config(16, 8, 3, 2, Router::Softmax, DTypeKind::BF16);
    let (h, i, e) = (16, 8, 3);
    let mut w = host_weights(&c, s, Some(0.1));
    // The file stores bf16: make the bias exactly representable so the layers compare equal.
    w.gate_bias = w
        .gate_bias
        .map(|b| b.iter().map(|&v| bf16::from_f32(v).to_f32()).collect());
    let dir = std::env::temp_dir().join(format!("wd-moe-st-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let stacked = dir.join("stacked.safetensors");
    write_safetensors(
        &stacked,
        vec![
            ("gate.weight".into(), vec![e, h], w.gate.clone()),
            ("gate.bias".into(), vec![e], w.gate_bias.clone().unwrap()),
            ("experts.w1".into(), vec![e, i, h], w.w1.clone()),
            ("experts.w3".into(), vec![e, i, h], w.w3.clone()),
            ("experts.w2".into(), vec![e, h, i], w.w2.clone()),
        ],
    );
    let per_expert = dir.join("hf.safetensors");
    let mut tensors = vec![
        (
            "model.layers.0.mlp.gate.weight".to_string(),
            vec![e, h],
            w.gate.clone(),
        ),
        (
            "model.layers.0.mlp.gate.bias".to_string(),
            vec![e],
            w.gate_bias.clone().unwrap(),
        ),
    ];
    for x in 0..e {
        let p = format!("model.layers.0.mlp.experts.{x}");
        tensors.push((
            format!("{p}.gate_proj.weight"),
            vec![i, h],
            w.w1[x * i * h..(x + 1) * i * h].to_vec(),
        ));
        tensors.push((
            format!("{p}.up_proj.weight"),
            vec![i, h],
            w.w3[x * i * h..(x + 1) * i * h].to_vec(),
        ));
        tensors.push((
            format!("{p}.down_proj.weight"),
            vec![h, i],
            w.w2[x * h * i..(x + 1) * h * i].to_vec(),
        ));
    }
    write_safetensors(&per_expert, tensors);
    let st = Device::cpu().new_stream().unwrap();
    let a = MoeLayer::<bf16>::new(&st, c, MoeWeights::File(WeightsFile::new(&stacked))).unwrap();
    let b = MoeLayer::<bf16>::new(&st, c, MoeWeights::File(WeightsFile::new(per_expert))).unwrap();
    let hw = MoeLayer::<bf16>::new(&st, c, MoeWeights::Host(w.clone())).unwrap();
    let want = hw.host_weights().unwrap();
    assert!(
        a.host_weights().unwrap() == want,
        "stacked names load other values"
    );
    assert!(
        b.host_weights().unwrap() == want,
        "per-expert names load other values"
    );

    // A missing tensor and a mis-shaped one are errors naming them.
    let missing = dir.join("missing.safetensors");
    write_safetensors(
        &missing,
        vec![
            ("gate.weight".into(), vec![e, h], w.gate.clone()),
            ("experts.w1".into(), vec![e, i, h], w.w1.clone()),
            ("experts.w2".into(), vec![e, h, i], w.w2.clone()),
        ],
    );
    let err =
        MoeLayer::<bf16>::new(&st, c, MoeWeights::File(WeightsFile::new(missing))).unwrap_err();
    assert!(err.to_string().contains("w3"), "{err}");
    let shaped = dir.join("shaped.safetensors");
    write_safetensors(
        &shaped,
        vec![
            ("gate.weight".into(), vec![h, e], w.gate.clone()),
            ("experts.w1".into(), vec![e, i, h], w.w1.clone()),
            ("experts.w3".into(), vec![e, i, h], w.w3.clone()),
            ("experts.w2".into(), vec![e, h, i], w.w2.clone()),
        ],
    );
    let err =
        MoeLayer::<bf16>::new(&st, c, MoeWeights::File(WeightsFile::new(shaped))).unwrap_err();
    assert!(err.to_string().contains("gate.weight"), "{err}");
    let absent = WeightsFile::new(dir.join("absent.safetensors"));
    let err = MoeLayer::<bf16>::new(&st, c, MoeWeights::File(absent)).unwrap_err();
    assert!(matches!(err, Error::Io { .. }), "{err}");
    let _ = std::fs::remove_dir_all(&dir);
}

device_test!(
    a_layer_from_a_file_computes_as_the_layer_from_memory,
    gpu_a_layer_from_a_file_computes_as_the_layer_from_memory,
    |dev| {
        let s = seed("a_layer_from_a_file_computes_as_the_layer_from_memory");
        let c = config(64, 32, 4, 2, Router::Softmax, DTypeKind::BF16);
        let (h, i, e) = (64, 32, 4);
        // bf16 values, so the file and the memory hold the same weights.
        let round = |v: Vec<f32>| -> Vec<f32> {
            v.into_iter().map(|x| bf16::from_f32(x).to_f32()).collect()
        };
        let w = host_weights(&c, s, Some(0.1));
        let w = HostWeights {
            gate: round(w.gate),
            gate_bias: w.gate_bias.map(round),
            w1: round(w.w1),
            w3: round(w.w3),
            w2: round(w.w2),
        };
        let dir = std::env::temp_dir().join(format!(
            "wd-moe-file-{}-{}",
            dev.label().replace(':', "-"),
            std::process::id()
        ));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("layer.safetensors");
        let mut tensors = vec![
            ("gate.weight".to_string(), vec![e, h], w.gate.clone()),
            (
                "gate.bias".to_string(),
                vec![e],
                w.gate_bias.clone().unwrap(),
            ),
        ];
        for x in 0..e {
            let p = format!("experts.{x}");
            let part = |v: &[f32], n: usize| v[x * n..(x + 1) * n].to_vec();
            tensors.push((format!("{p}.w1.weight"), vec![i, h], part(&w.w1, i * h)));
            tensors.push((format!("{p}.w3.weight"), vec![i, h], part(&w.w3, i * h)));
            tensors.push((format!("{p}.w2.weight"), vec![h, i], part(&w.w2, h * i)));
        }
        write_safetensors(&path, tensors);
        let st = dev.new_stream().unwrap();
        let file = MoeWeights::File(WeightsFile::new(&path));
        let mut from_file = MoeLayer::<bf16>::new(&st, c, file).unwrap();
        let mut from_memory = MoeLayer::<bf16>::new(&st, c, MoeWeights::Host(w)).unwrap();
        assert!(from_file.host_weights().unwrap() == from_memory.host_weights().unwrap());
        let tokens = 5;
        let x: Vec<bf16> = narrow(&random_f32(&mut rng(s ^ 3), tokens * h));
        let x = Buffer::from_host(&st, &x).unwrap();
        let a = from_file.forward(&x).unwrap().to_host(&st).unwrap();
        let b = from_memory.forward(&x).unwrap().to_host(&st).unwrap();
        let bits = |v: &[bf16]| v.iter().map(|y| y.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&a), bits(&b), "the layers' outputs differ");
        let _ = std::fs::remove_dir_all(&dir);
    }
);

// ---- CUDA against the CPU backend ----

struct Compared {
    flips: usize,
    slots: usize,
}

/// How the CUDA layer runs: its path, graphs on or off, whether the prefill tiles may take
/// Hopper's warpgroup MMA (off: the mma.sync kernels of older GPUs) and one-token passes
/// the decode kernel (off: the kernels of larger batches).
#[derive(Debug, Clone, Copy)]
struct Run {
    path: MoePath,
    graphs: bool,
    wgmma: bool,
    decode: bool,
    /// The wgmma tiles forced onto their overlap kernels or off them
    /// (`MoeLayer::set_wgmma_overlap`); None: the plan's choice per projection.
    overlap: Option<bool>,
    /// Every wgmma tile forced onto the wide 192-row tile (`MoeLayer::set_wgmma_wide`);
    /// false: the plan's choice.
    wide: bool,
    /// Seeded host weights whose router bias sends every token's first choice to expert 0.
    one_expert: bool,
    /// The prefill router forced on or off (`MoeLayer::set_prefill_router`); None: the
    /// plan's choice (from `PREFILL_ROUTER_MIN_TOKENS` tokens).
    prefill: Option<bool>,
}

const fn run(path: MoePath, graphs: bool) -> Run {
    Run {
        path,
        graphs,
        wgmma: true,
        decode: true,
        overlap: None,
        wide: false,
        one_expert: false,
        prefill: None,
    }
}

/// CUDA vs CPU for one config and token count, same seeded weights and inputs, in the
/// config's element type (bf16 or f16). Tokens whose expert sets match are compared
/// elementwise (bf16 tolerance, which bounds f16 too); the others are counted.
fn cuda_vs_cpu(c: MoeConfig, tokens: usize, r: Run, s: u64) -> Compared {
    match c.dtype {
        DTypeKind::F16 => cuda_vs_cpu_as::<f16>(c, tokens, r, s),
        _ => cuda_vs_cpu_as::<bf16>(c, tokens, r, s),
    }
}

fn cuda_vs_cpu_as<T: Float>(c: MoeConfig, tokens: usize, r: Run, s: u64) -> Compared {
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
    if r.wide {
        g.set_wgmma_wide(Some(true));
    }
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

fn assert_few_flips(r: Compared, what: &str) {
    // Near-ties can flip in bf16; more than 2% of slots is a bug.
    assert!(
        r.flips * 50 <= r.slots.max(50),
        "{what}: {} of {} slots flipped",
        r.flips,
        r.slots
    );
}

/// [`cuda_vs_cpu`] at each of `tokens`, each with few flips.
fn few_flips_at(tokens: &[usize], c: MoeConfig, r: Run, s: u64, what: &str) {
    for &t in tokens {
        assert_few_flips(cuda_vs_cpu(c, t, r, s), what);
    }
}

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

/// The wgmma overlap kernels (issue 40; by default only on blocks at least 2560 deep, so
/// forced here): 64- and 96-row tiles at 1, 5, 37, 301 and 4,097 tokens, split-K gate/up
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
/// one block per SM), drained and overlapped: 1, 5, 37, 301 and 4,097 tokens (up to ten
/// 192-row tiles per expert), split-K gate/up (deep), one row per deep expert with most of
/// 64 experts empty, every token on one expert (k = 1: 4,097 rows in 22 tiles, the other
/// experts empty), f16, graphs on and off, and the plan's per-projection overlap. Where the
/// GPU has no wgmma this runs the mma.sync tiles.
#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_smem_moe_wgmma_wide_matches_cpu() {
    let s = seed("gpu_smem_moe_wgmma_wide_matches_cpu");
    let wide = |graphs, overlap| Run {
        wide: true,
        overlap,
        ..run(MoePath::Device, graphs)
    };
    let small = config(72, 40, 7, 3, Router::Softmax, DTypeKind::BF16);
    let tokens = [1, 5, 37, 301, 4097];
    few_flips_at(&tokens, small, wide(true, Some(false)), s, "small, wide");
    few_flips_at(
        &tokens,
        small,
        wide(true, Some(true)),
        s + 1,
        "small, wide, overlap",
    );
    let deep = config(1024, 256, 8, 2, Router::Softmax, DTypeKind::BF16);
    few_flips_at(
        &[3, 256],
        deep,
        wide(false, Some(false)),
        s + 2,
        "deep, wide",
    );
    few_flips_at(
        &[3, 256],
        deep,
        wide(false, Some(true)),
        s + 3,
        "deep, wide, overlap",
    );
    let sparse = config(256, 1024, 64, 2, Router::Softmax, DTypeKind::BF16);
    few_flips_at(
        &[1, 5, 40],
        sparse,
        wide(true, Some(true)),
        s + 4,
        "empty experts, wide",
    );
    let single = config(72, 40, 7, 1, Router::Softmax, DTypeKind::BF16);
    for overlap in [Some(false), Some(true)] {
        let one = Run {
            one_expert: true,
            ..wide(true, overlap)
        };
        few_flips_at(&[1, 301, 4097], single, one, s + 5, "one expert, wide");
    }
    let half = config(72, 40, 7, 3, Router::Softmax, DTypeKind::F16);
    few_flips_at(&[37, 301], half, wide(true, Some(true)), s + 6, "f16, wide");
    few_flips_at(
        &[301, 1025],
        mixed_depths(),
        wide(true, None),
        s + 7,
        "wide, overlap on the deep projection only",
    );
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
        wide: false,
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
