//! The MoE layer. CPU backend against a plain f64 reference on small random configs (experts
//! with no tokens, every token on one expert, k = E, both routers, f32 and bf16); errors for
//! bad configs, shapes and weights; safetensors loading (stacked and per-expert names). A
//! layer loaded from a file computes what the layer built from the same weights in memory
//! does (both backends). CUDA against the CPU backend: tests/moe_cuda.rs; the shared
//! reference: tests/common/moe.rs.
//!
//! Tolerances: each output element within TOL × Σ_r |w_r| Σ_i |w2·act| (+ a small floor) of
//! the f64 reference: f32 1e-5 (f32 GEMM accumulation), bf16 3e-2 (bf16 inputs, act and
//! output rounding).

mod common;

use common::moe::*;
use common::{device_test, random_f32, rng, seed};
use half::{bf16, f16};
use warpdrive::moe::{HostWeights, MoeConfig, MoeLayer, MoeWeights, Router, WeightsFile};
use warpdrive::{Buffer, DTypeKind, Device, Error};

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
