#!/usr/bin/env python3
"""PyTorch peer of warpdrive's `moe` suite (issue 9; contract: bench/peers/README.md).

Cases (case = preset, size = tokens), bf16, each preset with the Softmax router: logits =
x @ gate^T in bf16, softmax over the experts in f32, top-k, weights divided by their sum.

  preset              hidden  intermediate  experts  top_k
  mixtral-8x7b          4096         14336        8      2
  qwen3-30b-a3b         2048           768      128      8
  deepseek-v3-slice     7168           256      256      8
  gpt-oss-120b          2880          2880      128      4

  at tokens 1, 4, 16, 64, 256, 1024, 4096, variants:
  torch-hf-eager    Hugging Face's MixtralSparseMoeBlock forward written out: router, one_hot
                    expert mask, a loop over the experts that got tokens (torch.where, gather,
                    w2(silu(w1 x) * w3 x) * weight, index_add_); per-expert [out, in] weights.
  torch-grouped-mm  torchtitan-style: the same router, token slots sorted by expert (argsort),
                    counts by histc, int32 offsets by cumsum (on the device), gathered rows,
                    three torch._grouped_mm calls on weights stored once as [E, H, I] (w1, w3)
                    and [E, I, H] (w2), weighted, index_add_ back to token order.
  router-permute (qwen3-30b-a3b's shape; tokens 1, 64, 256, 4096), variant
  torch-router-permute: the router and permutation stages of torch-grouped-mm alone (router
                    linear, softmax/top-k/renormalize, argsort, counts, offsets, row gather).

--quick (warpdrive ran on its CPU backend): hidden and intermediate / 8 (rounded up to a
multiple of 8), experts and top_k as they are, cases named PRESET/8; tokens 1, 16, 64 (router-permute: 1, 64, on
qwen3-30b-a3b's quick shape).

Method (BENCH.md): weights N(0,1) / sqrt(fan_in) (the router's too), input N(0,1), seeded, one
input per (preset, tokens); warm-up, then back-to-back CUDA events (the host clock on the
CPU); reps sized to about BUDGET_S of timed work per row, never under 200 (30 where one
forward takes over 20 ms); median and p10/p90 by linear interpolation, us per forward.
No new case starts past 70% of $WARPDRIVE_PEER_TIMEOUT_S (default 900 s): a slow machine
returns the rows it has instead of being killed with none.
bytes = 3 * H * I * 2 per distinct expert the batch hits + the router weight E * H * 2
(router-permute: the router weight only); gbps = bytes / median; ceiling d2d_copy_gbps.
The grouped-mm row's extra holds rel_err_vs_hf_eager (same routing, both in bf16) as a check
that the two peers compute the same layer.

torch._grouped_mm (torch 2.11): bf16 operands, offs a 1-D int32 tensor on the operands'
device with one entry per expert (the end of each group, last = rows), 16-byte aligned data
pointers and strides (hidden and intermediate are multiples of 8 here, so row strides are);
on sm90/sm100 with bf16 it runs a CUTLASS grouped GEMM without a host sync. Where it is
missing or fails a probe: skipped on a GPU (one warning), emulated by a loop of matmuls on
the CPU (extra.emulated = true).

`python3 moe.py --list` prints the cases without importing torch.
"""

import argparse
import functools
import json
import math
import os
import sys
import time

from peer_stats import percentile, timed_row

SUITE = "moe"
# (case, hidden, intermediate, experts, top_k)
PRESETS = [
    ("mixtral-8x7b", 4096, 14336, 8, 2),
    ("qwen3-30b-a3b", 2048, 768, 128, 8),
    ("deepseek-v3-slice", 7168, 256, 256, 8),
    ("gpt-oss-120b", 2880, 2880, 128, 4),
]
TOKENS, QUICK_TOKENS = [1, 4, 16, 64, 256, 1024, 4096], [1, 16, 64]
ROUTER_CASE, ROUTER_PRESET = "router-permute", "qwen3-30b-a3b"
ROUTER_TOKENS, QUICK_ROUTER_TOKENS = [1, 64, 256, 4096], [1, 64]
LAYER_VARIANTS = ["torch-hf-eager", "torch-grouped-mm"]
ROUTER_VARIANT = "torch-router-permute"

BUDGET_S, QUICK_BUDGET_S = 1.5, 0.5  # timed work per row
MIN_REPS, SLOW_MIN_REPS, SLOW_US, MAX_REPS = 200, 30, 20000.0, 2000
WARMUP, PILOT = 3, 3
# warpdrive kills a peer after $WARPDRIVE_PEER_TIMEOUT_S (all its rows lost): start no new
# case past this fraction of it, so a slow machine still returns the rows it has
TIMEOUT_ENV, DEFAULT_TIMEOUT_S, STOP_FRACTION = "WARPDRIVE_PEER_TIMEOUT_S", 900, 0.7
SEED = 0x30E9
BF16 = 2  # bytes


def log(msg):
    print(f"moe.py: {msg}", file=sys.stderr, flush=True)


# ---- pure Python: the case table, rep counts, bytes, rows (testable without torch) ----


def quick_dim(d):
    """warpdrive's --quick shrink: d / 8 rounded up, then up to a multiple of 8."""
    q = -(-d // 8)
    return -(-q // 8) * 8


def presets(quick):
    """[(case, hidden, intermediate, experts, top_k)] at the run's scale; a --quick case
    is named PRESET/8 as warpdrive names its shrunk layer."""
    if not quick:
        return list(PRESETS)
    return [(f"{c}/8", quick_dim(h), quick_dim(i), e, k) for c, h, i, e, k in PRESETS]


def router_shape(quick):
    """(hidden, experts, top_k) of the router-permute case: qwen3-30b-a3b's at this scale."""
    for c, h, _, e, k in presets(quick):
        if c.split("/")[0] == ROUTER_PRESET:
            return h, e, k
    raise KeyError(ROUTER_PRESET)


def plan(quick):
    """Every (case, size, variant) this script reports, in run order (the cheap
    router-permute first)."""
    out = [(ROUTER_CASE, t, ROUTER_VARIANT)
           for t in (QUICK_ROUTER_TOKENS if quick else ROUTER_TOKENS)]
    for c, *_ in presets(quick):
        for t in QUICK_TOKENS if quick else TOKENS:
            out += [(c, t, v) for v in LAYER_VARIANTS]
    return out


def stop_after_s(env):
    """Seconds after which no new case starts: STOP_FRACTION of the runner's timeout."""
    try:
        timeout = float(env.get(TIMEOUT_ENV, ""))
    except ValueError:
        timeout = 0.0
    return STOP_FRACTION * (timeout if timeout > 0 else DEFAULT_TIMEOUT_S)


def plan_reps(est_us, budget_s):
    """Timed reps for one row: about budget_s of work, at least MIN_REPS (SLOW_MIN_REPS when
    one forward takes over SLOW_US), at most MAX_REPS (unless the floor is higher)."""
    floor = SLOW_MIN_REPS if est_us > SLOW_US else MIN_REPS
    n = int(budget_s * 1e6 / max(est_us, 1e-3))
    return max(floor, min(MAX_REPS, n))


def layer_bytes(hidden, intermediate, experts, experts_hit):
    """Bytes a forward must read at least: each distinct expert hit (w1, w3, w2) once, plus
    the router weight."""
    return 3 * hidden * intermediate * BF16 * experts_hit + experts * hidden * BF16


def row(case, size, variant, samples, nbytes, extra):
    """peer_stats.timed_row with the bandwidth of `nbytes` (the bytes the case must move)."""
    r = timed_row(SUITE, case, size, variant, samples,
                  dict({"ceiling": "d2d_copy_gbps", "bytes": int(nbytes)}, **extra))
    r["gbps"] = (nbytes / (r["median"] * 1e3)) if nbytes and r["median"] > 0 else None
    return r


def table(rows):
    """The rows as a text table (standalone runs without --json)."""
    head = (f"{'case':>20} {'tokens':>6} {'variant':>22} {'median us':>10} {'p10':>10} "
            f"{'p90':>10} {'GB/s':>8}")
    lines = [head]
    for r in rows:
        gbps = f"{r['gbps']:8.1f}" if r["gbps"] is not None else f"{'-':>8}"
        lines.append(f"{r['case']:>20} {r['size']:>6} {r['variant']:>22} {r['median']:10.1f} "
                     f"{r['p10']:10.1f} {r['p90']:10.1f} {gbps}")
    return "\n".join(lines)


# ---- the two MoE forwards (torch) ----


def route(torch, x, gate, k):
    """Softmax router: bf16 logits, softmax over experts in f32, top-k, renormalized."""
    logits = torch.nn.functional.linear(x, gate)
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    w, ids = torch.topk(probs, k, dim=-1)
    return w / w.sum(dim=-1, keepdim=True), ids


def permute(torch, x, ids, experts):
    """Token slots sorted by expert on the device: (order of the flattened slots, token of
    each sorted slot, int32 group ends, gathered rows [T * k, H])."""
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    # histc with explicit bounds needs no host sync (bincount reads the max back); it takes
    # floating input on the CPU, so count the ids as f32 (exact below 2^24)
    counts = torch.histc(flat.float(), bins=experts, min=0, max=experts)
    offs = torch.cumsum(counts, 0, dtype=torch.int32)
    tok = order // ids.shape[1]
    return order, tok, offs, x.index_select(0, tok)


def router_permute(torch, x, gate, k):
    w, ids = route(torch, x, gate, k)
    order, _, offs, xp = permute(torch, x, ids, gate.shape[0])
    return w, order, offs, xp


def hf_eager_forward(torch, x, gate, experts, k):
    """transformers' MixtralSparseMoeBlock.forward; experts[e] = (w1, w3, w2) as nn.Linear
    weights ([I, H], [I, H], [H, I])."""
    F = torch.nn.functional
    n_experts = gate.shape[0]
    w, ids = route(torch, x, gate, k)
    w = w.to(x.dtype)
    out = torch.zeros_like(x)
    mask = F.one_hot(ids, num_classes=n_experts).permute(2, 1, 0)  # [E, k, T]
    hit = torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero().flatten().tolist()
    for e in hit:
        w1, w3, w2 = experts[e]
        slot, tok = torch.where(mask[e])
        xs = x[tok]
        y = F.linear(F.silu(F.linear(xs, w1)) * F.linear(xs, w3), w2) * w[tok, slot, None]
        out.index_add_(0, tok, y.to(x.dtype))
    return out


def grouped_forward(torch, gmm, x, gate, w1, w3, w2, k):
    """torchtitan's MoE forward with grouped GEMMs; w1, w3 [E, H, I], w2 [E, I, H]."""
    F = torch.nn.functional
    w, ids = route(torch, x, gate, k)
    order, tok, offs, xp = permute(torch, x, ids, gate.shape[0])
    h = F.silu(gmm(xp, w1, offs)) * gmm(xp, w3, offs)
    y = gmm(h, w2, offs)
    y = (y.float() * w.reshape(-1)[order].unsqueeze(1)).to(x.dtype)
    out = torch.zeros_like(x)
    out.index_add_(0, tok, y)
    return out


def emulated_grouped_mm(torch, a, b, offs):
    """torch._grouped_mm(a [M, K], b [G, K, N], offs) as one matmul per group (CPU only: it
    reads the offsets back)."""
    out = a.new_empty((a.shape[0], b.shape[-1]))
    start = 0
    for g, end in enumerate(offs.tolist()):
        if end > start:
            torch.mm(a[start:end], b[g], out=out[start:end])
        start = end
    return out


def grouped_mm_for(torch, device):
    """(gmm(a, b, offs), emulated) for this device; (None, False) when the variant must be
    skipped. Probes torch._grouped_mm once on a small case against per-group matmuls."""
    fn = getattr(torch, "_grouped_mm", None)
    why = f"torch {torch.__version__} has no torch._grouped_mm"
    if fn is not None:
        try:
            gen = torch.Generator(device=device).manual_seed(1)
            a = torch.randn((24, 16), generator=gen, device=device, dtype=torch.bfloat16)
            b = torch.randn((3, 16, 32), generator=gen, device=device, dtype=torch.bfloat16)
            offs = torch.tensor([8, 8, 24], dtype=torch.int32, device=device)  # one empty group
            got = fn(a, b, offs=offs).float()
            want = emulated_grouped_mm(torch, a, b, offs).float()
            err = float((got - want).norm() / want.norm())
            if err < 1e-2:
                return (lambda a, b, offs: fn(a, b, offs=offs)), False
            why = f"torch._grouped_mm probe off by {err:.3g}"
        except Exception as e:  # noqa: BLE001 -- any failure means: not usable here
            why = f"torch._grouped_mm failed its probe: {str(e).splitlines()[0] if str(e) else e!r}"
    if device.type == "cpu":
        log(f"{why}; torch-grouped-mm runs as a loop of matmuls (extra.emulated)")
        return (lambda a, b, offs: emulated_grouped_mm(torch, a, b, offs)), True
    log(f"warning: {why}; skipping torch-grouped-mm")
    return None, False


# ---- timing ----


class Timer:
    """us per call of fn: back-to-back CUDA events on a GPU (each sample from the end of the
    previous one), the host clock on the CPU."""

    def __init__(self, torch, device):
        self.torch = torch
        self.cuda = device.type == "cuda"

    def __call__(self, fn, reps):
        torch = self.torch
        if self.cuda:
            torch.cuda.synchronize()
            ev = [torch.cuda.Event(enable_timing=True) for _ in range(reps + 1)]
            ev[0].record()
            for i in range(reps):
                fn()
                ev[i + 1].record()
            ev[-1].synchronize()
            return [ev[i].elapsed_time(ev[i + 1]) * 1e3 for i in range(reps)]
        out = []
        for _ in range(reps):
            t = time.perf_counter()
            fn()
            out.append((time.perf_counter() - t) * 1e6)
        return out

    def measure(self, fn, budget_s):
        """Warm up, size the reps from a short pilot, time them: (samples, reps)."""
        for _ in range(WARMUP):
            fn()
        pilot = sorted(self(fn, PILOT))
        reps = plan_reps(percentile(pilot, 0.5), budget_s)
        return self(fn, reps), reps


def rel_err(torch, got, want):
    want = want.float()
    return float((got.float() - want).norm() / want.norm().clamp_min(1e-30))


# ---- the run ----


def normal(torch, gen, device, shape, scale=1.0):
    """Seeded N(0, 1) * scale in bf16, drawn on the device."""
    t = torch.randn(shape, generator=gen, device=device, dtype=torch.bfloat16)
    return t.mul_(scale) if scale != 1.0 else t


def run_preset(torch, device, index, preset, tokens_list, timer, gmm, emulated, budget,
               out_of_time):
    """Rows of one preset: its weights are built once here and die with this frame."""
    case, hidden, inter, n_exp, k = preset
    gen = torch.Generator(device=device).manual_seed(SEED + index)
    expert_gb = 3 * n_exp * hidden * inter * BF16 / 1e9
    log(f"{case}: H={hidden} I={inter} E={n_exp} top-{k}, experts {expert_gb:.2f} GB "
        f"(held twice: grouped and per-expert layouts)")
    gate = normal(torch, gen, device, (n_exp, hidden), 1 / math.sqrt(hidden))
    # _grouped_mm's layout, stored once: xp [M, H] @ w1[e] [H, I]; h [M, I] @ w2[e] [I, H]
    w1 = normal(torch, gen, device, (n_exp, hidden, inter), 1 / math.sqrt(hidden))
    w3 = normal(torch, gen, device, (n_exp, hidden, inter), 1 / math.sqrt(hidden))
    w2 = normal(torch, gen, device, (n_exp, inter, hidden), 1 / math.sqrt(inter))
    # the same values as nn.Linear weights [out, in], one contiguous tensor per expert
    hw1, hw3, hw2 = (w.transpose(1, 2).contiguous() for w in (w1, w3, w2))
    experts = [(hw1[e], hw3[e], hw2[e]) for e in range(n_exp)]

    rows = []
    for tokens in tokens_list:
        if out_of_time(f"{case} T={tokens}"):
            break
        x = normal(torch, gen, device, (tokens, hidden))
        _, ids = route(torch, x, gate, k)
        hit = int(torch.unique(ids).numel())
        nbytes = layer_bytes(hidden, inter, n_exp, hit)
        base = {"hidden": hidden, "intermediate": inter, "experts": n_exp, "top_k": k,
                "tokens": tokens, "experts_hit": hit, "dtype": "bf16", "router": "softmax",
                "renormalize": True}

        hf = functools.partial(hf_eager_forward, torch, x, gate, experts, k)
        samples, reps = timer.measure(hf, budget)
        r = row(case, tokens, "torch-hf-eager", samples, nbytes, dict(base, reps=reps))
        rows.append(r)
        log(f"{case} T={tokens} torch-hf-eager: {r['median']:.1f} us ({reps} reps, "
            f"{hit} experts hit)")
        if gmm is None:
            continue

        grouped = functools.partial(grouped_forward, torch, gmm, x, gate, w1, w3, w2, k)
        err = rel_err(torch, grouped(), hf())
        if not err < 5e-2:
            log(f"warning: {case} T={tokens}: torch-grouped-mm differs from torch-hf-eager by "
                f"{err:.3g} (relative)")
        samples, reps = timer.measure(grouped, budget)
        extra = dict(base, reps=reps, rel_err_vs_hf_eager=err)
        if emulated:
            extra["emulated"] = True
        r = row(case, tokens, "torch-grouped-mm", samples, nbytes, extra)
        rows.append(r)
        log(f"{case} T={tokens} torch-grouped-mm: {r['median']:.1f} us ({reps} reps)")
    return rows


def run_router_permute(torch, device, quick, timer, budget):
    hidden, n_exp, k = router_shape(quick)
    gen = torch.Generator(device=device).manual_seed(SEED + len(PRESETS))
    gate = normal(torch, gen, device, (n_exp, hidden), 1 / math.sqrt(hidden))
    nbytes = n_exp * hidden * BF16
    rows = []
    for tokens in QUICK_ROUTER_TOKENS if quick else ROUTER_TOKENS:
        x = normal(torch, gen, device, (tokens, hidden))
        fn = functools.partial(router_permute, torch, x, gate, k)
        samples, reps = timer.measure(fn, budget)
        r = row(ROUTER_CASE, tokens, ROUTER_VARIANT, samples, nbytes,
                {"hidden": hidden, "experts": n_exp, "top_k": k, "tokens": tokens,
                 "dtype": "bf16", "shape_of": ROUTER_PRESET, "bytes_counted": "router weight",
                 "reps": reps})
        rows.append(r)
        log(f"{ROUTER_CASE} T={tokens}: {r['median']:.1f} us ({reps} reps)")
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--list", action="store_true", help="print the cases and exit (no torch)")
    args = ap.parse_args()

    if args.list:
        for c, h, i, e, k in presets(args.quick):
            print(f"{c:>20} H={h} I={i} E={e} top_k={k}")
        h, e, k = router_shape(args.quick)
        print(f"{ROUTER_CASE:>20} H={h} E={e} top_k={k} (shape of {ROUTER_PRESET})")
        for c, t, v in plan(args.quick):
            print(f"{c:>20} {t:>6} {v}")
        return

    import torch

    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    log(f"torch {torch.__version__} on {device}{' (quick sizes)' if args.quick else ''}")
    start, stop_s, warned = time.perf_counter(), stop_after_s(os.environ), []

    def out_of_time(what):
        late = time.perf_counter() - start > stop_s
        if late and not warned:
            warned.append(what)
            log(f"warning: past {stop_s:.0f} s (of ${TIMEOUT_ENV}); {what} and the cases "
                f"after it are left out")
        return late

    timer = Timer(torch, device)
    gmm, emulated = grouped_mm_for(torch, device)
    budget = QUICK_BUDGET_S if args.quick else BUDGET_S
    tokens_list = QUICK_TOKENS if args.quick else TOKENS
    with torch.inference_mode():
        rows = run_router_permute(torch, device, args.quick, timer, budget)
        for i, preset in enumerate(presets(args.quick)):
            if out_of_time(preset[0]):
                break
            rows += run_preset(torch, device, i, preset, tokens_list, timer, gmm, emulated,
                               budget, out_of_time)
            if device.type == "cuda":
                torch.cuda.empty_cache()  # the preset's weights are gone (gpt-oss holds 13 GB)
    log(f"{len(rows)} rows in {time.perf_counter() - start:.0f} s")

    if args.json:
        json.dump(rows, sys.stdout)
        sys.stdout.write("\n")
    else:
        print(table(rows))


if __name__ == "__main__":
    main()
