//! The prefill router against the fused router on CUDA (issue 40): the same choices (up to
//! near-ties of the logits, which cuBLAS sums in another order) and weights, and a dispatch
//! equal to a host counting sort of its own choices: counts, offsets, work list, and each
//! expert's rows in slot order (the fused router's one-block dispatch places them with
//! atomics, so only its sets per expert are compared).

use half::{bf16, f16};

use crate::device::Device;
use crate::dtype::{DTypeKind, Float};
use crate::memory::Buffer;

use super::config::{prefill_routes, MoeConfig, Router, PRESETS};
use super::layer::{MoeLayer, Pass};
use super::weights::random_value;
use super::MoeWeights;

/// What the front of a pass left in the workspace.
struct Front {
    experts: Vec<u32>,
    weights: Vec<f32>,
    /// The prefill router's logits (cuBLAS, without bias); empty for the fused router.
    logits: Vec<f32>,
    counts: Vec<u32>,
    offsets: Vec<u32>,
    order: Vec<u32>,
    token_of: Vec<u32>,
    slot_pos: Vec<u32>,
    work: Vec<u32>,
    bm: usize,
}

fn front<T: Float>(layer: &mut MoeLayer<T>, x: &Buffer<T>, tokens: usize, prefill: bool) -> Front {
    layer.set_prefill_router(Some(prefill));
    let plan = layer.prepare(tokens, false).expect("a plan");
    assert_eq!(plan.prefill_router, prefill, "the forced choice");
    assert!(
        plan.decode.is_none(),
        "a pass of {tokens} tokens on the decode kernel"
    );
    let pass = Pass {
        plan,
        x: x.device_ptr(),
        y: 0,
    };
    let s = layer.stream.clone();
    // Poison what the front writes, so a slot it skips shows.
    let ws = layer.ws.as_mut().expect("a workspace");
    for buf in [
        &mut ws.experts,
        &mut ws.order,
        &mut ws.token_of,
        &mut ws.slot_pos,
        &mut ws.counts,
        &mut ws.offsets,
        &mut ws.work,
    ] {
        crate::ops::fill(&s, buf, u32::MAX).expect("poison");
    }
    crate::ops::fill(&s, &mut ws.weights, f32::NAN).expect("poison");
    let l = layer.launcher().expect("a launcher");
    l.front(&s, &pass, &mut |_| Ok(())).expect("the front");
    let ws = layer.workspace().expect("a workspace");
    let c = *layer.config();
    let slots = tokens * c.top_k;
    let get = |b: &Buffer<u32>, n: usize| b.prefix_to_host(&s, n).expect("a read");
    let n_items = get(&ws.n_items, 1)[0] as usize;
    Front {
        experts: get(&ws.experts, slots),
        weights: ws.weights.prefix_to_host(&s, slots).expect("weights"),
        logits: if prefill {
            ws.logits
                .prefix_to_host(&s, tokens * c.experts)
                .expect("logits")
        } else {
            Vec::new()
        },
        counts: get(&ws.counts, c.experts),
        offsets: get(&ws.offsets, c.experts + 1),
        order: get(&ws.order, slots),
        token_of: get(&ws.token_of, slots),
        slot_pos: get(&ws.slot_pos, slots),
        work: get(&ws.work, 2 * n_items),
        bm: plan.bm,
    }
}

/// The dispatch of `f`'s own choices as a host counting sort would lay it out; with
/// `slot_order` each expert's rows must be in slot order, else only as a set.
fn check_dispatch(f: &Front, k: usize, experts: usize, slot_order: bool, what: &str) {
    let slots = f.experts.len();
    let mut counts = vec![0u32; experts];
    for &e in &f.experts {
        assert!((e as usize) < experts, "{what}: expert {e}");
        counts[e as usize] += 1;
    }
    assert_eq!(f.counts, counts, "{what}: counts");
    let mut offsets = vec![0u32; experts + 1];
    for e in 0..experts {
        offsets[e + 1] = offsets[e] + counts[e];
    }
    assert_eq!(f.offsets, offsets, "{what}: offsets");
    let mut work = Vec::new();
    for (e, &c) in counts.iter().enumerate() {
        for first in (0..c as usize).step_by(f.bm) {
            work.extend([e as u32, first as u32]);
        }
    }
    assert_eq!(f.work, work, "{what}: work list");
    let mut sorted: Vec<u32> = (0..slots as u32).collect();
    sorted.sort_by_key(|&i| f.experts[i as usize]); // stable: slot order within an expert
    for e in 0..experts {
        let (a, b) = (offsets[e] as usize, offsets[e + 1] as usize);
        let mut got = f.order[a..b].to_vec();
        if !slot_order {
            got.sort_unstable();
        }
        assert_eq!(got, sorted[a..b], "{what}: expert {e}'s rows");
    }
    for (p, &i) in f.order.iter().enumerate() {
        assert_eq!(f.token_of[p], i / k as u32, "{what}: token of row {p}");
        assert_eq!(
            f.slot_pos[i as usize], p as u32,
            "{what}: position of slot {i}"
        );
    }
}

/// Largest logit gap (with the bias) that a near-tie may flip: cuBLAS and the fused kernel
/// sum the same bf16 products in f32 in another order, a few ulps of logits of order 1.
const TIE: f32 = 1e-4;
/// Weights of the same choices: softmax of logits within a few ulps.
const WEIGHT_TOL: f32 = 2e-5;

fn compare<T: Float>(c: MoeConfig, tokens: usize, seed: u64, dev: &Device, what: &str) {
    let what = format!("{what}, {tokens} tokens, seed {seed:#x}");
    let s = dev.new_stream().expect("a stream");
    let mut layer = MoeLayer::<T>::new(&s, c, MoeWeights::Random { seed }).expect("a layer");
    let x: Vec<T> = (0..tokens * c.hidden)
        .map(|i| T::from_f64(random_value(seed ^ 0x5eed, i as u64, 1.0) as f64))
        .collect();
    let x = Buffer::from_host(&s, &x).expect("x");
    if !prefill_routes(&c) {
        layer.set_prefill_router(Some(true));
        let plan = layer.prepare(tokens, false).expect("a plan");
        assert!(!plan.prefill_router, "{what}: a router it cannot run");
        return;
    }
    let fused = front(&mut layer, &x, tokens, false);
    let prefill = front(&mut layer, &x, tokens, true);
    check_dispatch(&fused, c.top_k, c.experts, false, &format!("{what}, fused"));
    check_dispatch(
        &prefill,
        c.top_k,
        c.experts,
        true,
        &format!("{what}, prefill"),
    );
    let bias = layer
        .gate_bias
        .as_ref()
        .map(|b| b.to_host(&s).expect("bias"));
    let logit = |t: usize, e: u32| {
        prefill.logits[t * c.experts + e as usize] + bias.as_ref().map_or(0.0, |b| b[e as usize])
    };
    let k = c.top_k;
    let mut flipped = 0;
    for t in 0..tokens {
        let (a, b) = (&fused.experts[t * k..][..k], &prefill.experts[t * k..][..k]);
        if a == b {
            for r in 0..k {
                let (wa, wb) = (fused.weights[t * k + r], prefill.weights[t * k + r]);
                assert!(
                    (wa - wb).abs() <= WEIGHT_TOL,
                    "{what}: token {t} rank {r}: {wa} vs {wb}"
                );
            }
            continue;
        }
        flipped += 1;
        // Only the grouped sigmoid router may flip a whole group on a near-tie of group
        // scores; the softmax top-k swaps only experts whose logits nearly tie.
        if c.router == Router::Softmax {
            for r in 0..k {
                let gap = (logit(t, a[r]) - logit(t, b[r])).abs();
                assert!(
                    gap <= TIE,
                    "{what}: token {t} rank {r}: {} vs {} (gap {gap})",
                    a[r],
                    b[r]
                );
            }
        }
    }
    assert!(
        flipped * 100 <= tokens.max(100),
        "{what}: {flipped} of {tokens} tokens flipped"
    );
}

fn config(h: usize, i: usize, e: usize, k: usize, router: Router) -> MoeConfig {
    MoeConfig {
        hidden: h,
        intermediate: i,
        experts: e,
        top_k: k,
        router,
        ..MoeConfig::tiny()
    }
}

const GROUPED: Router = Router::SigmoidGrouped {
    n_group: 4,
    topk_group: 2,
    routed_scaling: 2.5,
};

/// Every layer shape the MoE tests run (tests/moe.rs) and the four presets, at odd token
/// counts around the prefill router's sizes; f16 once; a Softmax router over 300 experts
/// keeps the fused path even when forced.
#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_prefill_router_equals_the_fused_router() {
    let dev = Device::cuda(0).expect("a CUDA device");
    let seed: u64 = rand::random();
    let shapes = [
        (config(72, 40, 7, 3, Router::Softmax), "small"),
        (config(1024, 256, 8, 2, Router::Softmax), "deep"),
        (config(256, 1024, 8, 2, Router::Softmax), "deep experts"),
        (config(3072, 64, 24, 3, Router::Softmax), "deep router"),
        (config(256, 32, 128, 8, Router::Softmax), "clustered shape"),
        (config(64, 32, 100, 16, Router::Softmax), "k = 16"),
        (config(72, 40, 7, 1, Router::Softmax), "k = 1"),
        (config(2624, 256, 64, 2, Router::Softmax), "mixed depths"),
        (config(64, 48, 32, 4, GROUPED), "grouped"),
        (config(64, 32, 300, 4, Router::Softmax), "300 experts"),
    ];
    for (i, (c, what)) in shapes.into_iter().enumerate() {
        for tokens in [257, 1000, 4097] {
            compare::<bf16>(c, tokens, seed.wrapping_add(i as u64), &dev, what);
        }
    }
    let half = MoeConfig {
        dtype: DTypeKind::F16,
        ..config(72, 40, 7, 3, Router::Softmax)
    };
    compare::<f16>(half, 1000, seed ^ 1, &dev, "f16");
    for (i, name) in PRESETS.iter().enumerate() {
        let c = MoeConfig::preset(name).expect("a preset");
        for tokens in [257, 1000, 4097] {
            compare::<bf16>(c, tokens, seed.wrapping_add(100 + i as u64), &dev, name);
        }
    }
}
