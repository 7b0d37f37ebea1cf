#!/usr/bin/env python3
"""PyTorch and Triton peer of warpdrive's `moe` suite (issues 9, 40; contract:
bench/peers/README.md).

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
  triton-fused-moe  vLLM's fused_moe design in our own Triton kernels (moe_triton.py): the same
                    router (route(), torch ops); moe_align (one kernel: token slots sorted by
                    expert, each expert's segment padded to BLOCK_M, the expert of each M-block,
                    the padded length; worst-case buffer sizes, no host sync); grouped GEMM 1
                    over (M-block, N-block) programs, x rows gathered through the sorted slots,
                    times the block's expert's fused [w1; w3] ([E, 2I, H]), f32 accumulation,
                    SiLU(gate) * up in the epilogue, bf16 h [padded slots, I]; grouped GEMM 2
                    with w2 [E, H, I], the routing weight applied in the epilogue, bf16 per-slot
                    rows; then a sum over each token's top_k rows. The whole layer (router to
                    sum) is one CUDA graph, replayed in the timed loop (extra.graph; eager, with
                    one warning, if capture fails). Block configs (BLOCK_M/N/K, GROUP_M, warps,
                    stages; extra.config, e.g. BM64-BN128-BK64-G8-w4-s4) come from a sweep of
                    about 7 candidates per (preset, tokens), picked by rows per expert and timed
                    briefly as graphs (extra.sweep_us), cached by GPU name, preset and tokens in
                    $XDG_CACHE_HOME/warpdrive/moe-triton-configs.json (else ~/.cache/...) for
                    the same Triton version (extra.config_source: sweep or cache; set
                    WARPDRIVE_MOE_RESWEEP=1 to sweep again). A row's sweep stops trying
                    candidates after SWEEP_ROW_S (30 s, compiling included) or past the stop
                    time below, and keeps the fastest so far uncached (extra.sweep_partial).
                    GPU only: skipped with one line on stderr on the CPU (--quick).
  router-permute (qwen3-30b-a3b's shape; tokens 1, 64, 256, 4096), variant
  torch-router-permute: the router and permutation stages of torch-grouped-mm alone (router
                    linear, softmax/top-k/renormalize, argsort, counts, offsets, row gather).

--quick (warpdrive ran on its CPU backend): hidden and intermediate / 8 (rounded up to a
multiple of 8), experts and top_k as they are, cases named PRESET/8; tokens 1, 16, 64 (router-permute: 1, 64, on
qwen3-30b-a3b's quick shape).

Method (BENCH.md): the router weight and the input are warpdrive's own (its counter-based
generator, recomputed here: wd_gate, wd_input; the input N(0,1), one per (preset, tokens)), so
every row routes the same tokens to the same experts; expert weights N(0,1) / sqrt(fan_in),
seeded; warm-up, then back-to-back CUDA events (the host clock on the
CPU); reps sized to about BUDGET_S of timed work per row, never under 200 (30 where one
forward takes over 20 ms); median and p10/p90 by linear interpolation, us per forward.
No new case starts past 70% of $WARPDRIVE_PEER_TIMEOUT_S (default 900 s): a slow machine
returns the rows it has instead of being killed with none.
bytes = 3 * H * I * 2 per distinct expert the batch hits + the router weight E * H * 2
(router-permute: the router weight only); gbps = bytes / median; ceiling d2d_copy_gbps.
The grouped-mm and triton-fused-moe rows' extra holds rel_err_vs_hf_eager (same routing, all
in bf16) as a check that the peers compute the same layer; a triton-fused-moe row over
TRITON_TOL (5e-2) is left out with a warning (so is a sweep candidate that is).

torch._grouped_mm (torch 2.11): bf16 operands, offs a 1-D int32 tensor on the operands'
device with one entry per expert (the end of each group, last = rows), 16-byte aligned data
pointers and strides (hidden and intermediate are multiples of 8 here, so row strides are);
on sm90/sm100 with bf16 it runs a CUTLASS grouped GEMM without a host sync. Where it is
missing or fails a probe: skipped on a GPU (one warning), emulated by a loop of matmuls on
the CPU (extra.emulated = true).

`python3 moe.py --list` prints the cases without importing torch. `python3 moe.py --self-test`
runs triton-fused-moe's kernels on small shapes (hidden 64, intermediate 48, 8 experts, top-2,
1, 5 and 33 tokens, routed and skewed: experts with no tokens, one with all) through Triton's
interpreter on the CPU (it sets TRITON_INTERPRET=1), checks the alignment buffers exactly and
the output against an f32 reference and torch-hf-eager, and ends with 'N passed, N failed'.
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
TRITON_VARIANT = "triton-fused-moe"
LAYER_VARIANTS = ["torch-hf-eager", "torch-grouped-mm", TRITON_VARIANT]
GPU_ONLY_VARIANTS = {TRITON_VARIANT}  # Triton kernels need a CUDA device
ROUTER_VARIANT = "torch-router-permute"

BUDGET_S, QUICK_BUDGET_S = 1.5, 0.5  # timed work per row
MIN_REPS, SLOW_MIN_REPS, SLOW_US, MAX_REPS = 200, 30, 20000.0, 2000
WARMUP, PILOT = 3, 3
# warpdrive kills a peer after $WARPDRIVE_PEER_TIMEOUT_S (all its rows lost): start no new
# case past this fraction of it, so a slow machine still returns the rows it has
TIMEOUT_ENV, DEFAULT_TIMEOUT_S, STOP_FRACTION = "WARPDRIVE_PEER_TIMEOUT_S", 900, 0.7
SEED = 0x30E9
BF16 = 2  # bytes
# triton-fused-moe: a row whose output is off torch-hf-eager's by more than this (relative,
# both bf16) is left out with a warning; a sweep candidate that is, is rejected
TRITON_TOL = 5e-2
# the block-config sweep: each candidate timed for about SWEEP_CAND_S (reps in
# [SWEEP_MIN_REPS, SWEEP_MAX_REPS]); one row's sweep stops trying candidates after
# SWEEP_ROW_S (compilation included) or once the run is past its stop time, and keeps the
# fastest so far (a sweep cut short is not cached)
SWEEP_CAND_S, SWEEP_MIN_REPS, SWEEP_MAX_REPS, SWEEP_ROW_S = 0.04, 5, 200, 30.0
CACHE_FILE, CACHE_FORMAT = "moe-triton-configs.json", "warpdrive-moe-triton-configs/1"
RESWEEP_ENV = "WARPDRIVE_MOE_RESWEEP"  # =1: ignore cached configs (and overwrite them)


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


def plan(quick, gpu=None):
    """Every (case, size, variant) this script reports, in run order (the cheap
    router-permute first). `gpu` (default: not quick) says whether the GPU-only variants
    run: --quick means warpdrive ran on its CPU backend, where they are skipped."""
    gpu = (not quick) if gpu is None else gpu
    variants = [v for v in LAYER_VARIANTS if gpu or v not in GPU_ONLY_VARIANTS]
    out = [(ROUTER_CASE, t, ROUTER_VARIANT)
           for t in (QUICK_ROUTER_TOKENS if quick else ROUTER_TOKENS)]
    for c, *_ in presets(quick):
        for t in QUICK_TOKENS if quick else TOKENS:
            out += [(c, t, v) for v in variants]
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


# ---- triton-fused-moe block configs (pure Python) ----
#
# A config is (BM, BN, BK, GM, warps, stages): BM rows of sorted token slots per program (each
# expert's segment is padded to a multiple of BM), BN output columns per program of the fused
# [w1; w3] product (BN / 2 of gate and BN / 2 of up, i.e. BN / 2 intermediate columns) and of
# the w2 product, BK the K step, GM the grouped program order (GM M-blocks share the N sweep,
# for L2 reuse of the weight tiles), then num_warps and num_stages. Both GEMMs use the same
# config (BM must match: the alignment is shared).

# by rows per routed expert r = slots / min(experts, slots) (rows_per_expert): the first of
# each list is the default (used alone when the run is out of time). Shared memory per stage
# is (BM + BN) * BK * 2 bytes: at most 64 KB here, and at most 192 KB over all the stages
# (sm90 has 227 KB a block).
CANDIDATES = [
    (8, [  # decode: a few rows per expert; reading the weights is the whole cost
        (16, 64, 128, 1, 4, 4), (16, 64, 64, 1, 4, 4), (16, 128, 128, 1, 4, 3),
        (16, 128, 64, 1, 4, 4), (16, 256, 64, 1, 8, 3), (16, 32, 128, 1, 4, 4),
        (32, 64, 128, 1, 4, 3)]),
    (16, [
        (16, 64, 128, 1, 4, 4), (16, 128, 64, 1, 4, 4), (32, 64, 128, 8, 4, 4),
        (32, 128, 64, 8, 4, 4), (32, 128, 128, 8, 4, 3), (32, 256, 64, 8, 8, 3),
        (64, 128, 64, 8, 4, 4)]),
    (128, [
        (64, 128, 64, 8, 4, 4), (32, 128, 64, 8, 4, 4), (64, 64, 64, 8, 4, 4),
        (64, 256, 64, 8, 8, 3), (128, 128, 64, 8, 8, 3), (128, 64, 64, 8, 4, 4),
        (128, 256, 64, 8, 8, 4)]),
    (None, [  # prefill: GEMMs big enough for 128-row tiles
        (128, 128, 64, 8, 8, 3), (64, 128, 64, 8, 4, 4), (64, 256, 64, 8, 8, 3),
        (128, 128, 64, 8, 4, 4), (128, 256, 64, 8, 8, 3), (128, 128, 128, 8, 8, 3),
        (128, 256, 64, 8, 8, 4)]),
]


def rows_per_expert(tokens, top_k, experts):
    """Mean token slots per routed expert, if the slots spread over as many experts as they
    can."""
    slots = tokens * top_k
    return slots / min(experts, slots)


def candidate_configs(tokens, top_k, experts):
    """The sweep's candidates for one (preset, tokens), the default first."""
    r = rows_per_expert(tokens, top_k, experts)
    for bound, configs in CANDIDATES:
        if bound is None or r <= bound:
            return list(configs)
    raise AssertionError("unreachable")


def config_name(cfg):
    """(64, 128, 64, 8, 4, 3) -> 'BM64-BN128-BK64-G8-w4-s3'."""
    bm, bn, bk, gm, w, st = cfg
    return f"BM{bm}-BN{bn}-BK{bk}-G{gm}-w{w}-s{st}"


def parse_config(name):
    """config_name's inverse; None when `name` is not one."""
    parts = name.split("-") if isinstance(name, str) else []
    keys = ["BM", "BN", "BK", "G", "w", "s"]
    if len(parts) != len(keys) or not all(p.startswith(k) for p, k in zip(parts, keys)):
        return None
    try:
        cfg = tuple(int(p[len(k):]) for p, k in zip(parts, keys))
    except ValueError:
        return None
    bm, bn, bk, gm, w, st = cfg
    pow2 = all(v > 0 and v & (v - 1) == 0 for v in (bm, bn, bk, w))
    return cfg if pow2 and bm >= 16 and bn >= 32 and bk >= 16 and gm >= 1 and st >= 1 else None


def padded_slots(slots, experts, block_m):
    """Worst-case rows after padding each routed expert's segment to a multiple of block_m
    (each of at most min(experts, slots) segments gains at most block_m - 1), rounded up to
    whole blocks: the size of sorted_token_ids, known without reading the routing back."""
    worst = slots + min(experts, slots) * (block_m - 1)
    return -(-worst // block_m) * block_m


def cache_path(env):
    """$XDG_CACHE_HOME/warpdrive/CACHE_FILE, else ~/.cache/warpdrive/CACHE_FILE."""
    base = env.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "warpdrive", CACHE_FILE)


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


# ---- triton-fused-moe: the kernels are in moe_triton.py beside this file ----


@functools.lru_cache(maxsize=None)
def triton_kernels():
    """moe_triton (its kernels: align, up, down; and `triton`), imported on first use: set
    TRITON_INTERPRET=1 before this for the interpreter. Raises ImportError without Triton."""
    import moe_triton

    return moe_triton


def first_line(e):
    """An exception's message, its first line only (or its repr when it has none)."""
    text = str(e).strip()
    return text.splitlines()[0] if text else repr(e)


def triton_for(device):
    """(kernels, None) where triton-fused-moe can run, else (None, why)."""
    if device.type != "cuda":
        return None, f"Triton kernels need a CUDA GPU (--device {device})"
    try:
        return triton_kernels(), None
    except Exception as e:  # noqa: BLE001 -- ImportError, or a Triton too old for the kernels
        return None, f"Triton is not usable here: {first_line(e)}"


class FusedMoe:
    """triton-fused-moe at one (weights, tokens, config): its buffers, allocated once at
    worst-case sizes, and the launches of one forward (no host sync, so a CUDA graph can hold
    it). w13 [E, 2I, H] (w1's rows, then w3's), w2 [E, H, I], both [out, in] per expert."""

    def __init__(self, torch, kern, gate, w13, w2, top_k, tokens, cfg, dot_f32=False):
        n_exp, two_i, hidden = w13.shape
        assert w13.is_contiguous() and w2.is_contiguous() and two_i % 2 == 0
        assert tuple(w2.shape) == (n_exp, hidden, two_i // 2)
        self.torch, self.kern, self.gate, self.w13, self.w2 = torch, kern, gate, w13, w2
        self.experts, self.inter, self.hidden, self.k = n_exp, two_i // 2, hidden, top_k
        self.tokens, self.slots, self.cfg, self.dot_f32 = tokens, tokens * top_k, cfg, dot_f32
        bm = cfg[0]
        self.rows = padded_slots(self.slots, n_exp, bm)
        i32, dev, dt = torch.int32, w13.device, w13.dtype
        self.sorted = torch.empty(self.rows, dtype=i32, device=dev)
        self.block_expert = torch.empty(self.rows // bm, dtype=i32, device=dev)
        self.num_post = torch.empty(1, dtype=i32, device=dev)
        self.h = torch.empty((self.rows, self.inter), dtype=dt, device=dev)
        self.y = torch.empty((self.slots, hidden), dtype=dt, device=dev)
        self.out = torch.empty((tokens, hidden), dtype=dt, device=dev)
        self.nbins = 1 << n_exp.bit_length()  # a power of two > experts (bin `experts`: none)
        self.chunk = 128 if self.slots <= 128 else 1024

    def experts_forward(self, x, weights, ids):
        """The layer after the router: x [T, H], weights [T, k] f32 and ids [T, k] (int64 or
        int32), all contiguous; returns self.out [T, H]."""
        bm, bn, bk, gm, warps, stages = self.cfg
        kern, n_m = self.kern, self.rows // bm
        kern.align[(self.experts,)](
            ids, self.sorted, self.block_expert, self.num_post, self.slots, self.experts,
            BM=bm, NBINS=self.nbins, CHUNK=self.chunk, num_warps=4)
        kern.up[(n_m * -(-self.inter // (bn // 2)),)](
            x, self.w13, self.h, self.sorted, self.block_expert, self.num_post,
            self.inter, self.hidden, self.rows, self.slots, self.k,
            x.stride(0), self.w13.stride(0), self.w13.stride(1), self.h.stride(0),
            BM=bm, BN=bn, BK=bk, GM=gm, EVEN_K=self.hidden % bk == 0, DOT_F32=self.dot_f32,
            num_warps=warps, num_stages=stages)
        kern.down[(n_m * -(-self.hidden // bn),)](
            self.h, self.w2, self.y, weights, self.sorted, self.block_expert, self.num_post,
            self.hidden, self.inter, self.rows, self.slots,
            self.h.stride(0), self.w2.stride(0), self.w2.stride(1), self.y.stride(0),
            BM=bm, BN=bn, BK=bk, GM=gm, EVEN_K=self.inter % bk == 0, DOT_F32=self.dot_f32,
            num_warps=warps, num_stages=stages)
        self.torch.sum(self.y.view(self.tokens, self.k, self.hidden), dim=1, out=self.out)
        return self.out

    def forward(self, x):
        """The whole layer: the router (as route()), then experts_forward."""
        weights, ids = route(self.torch, x, self.gate, self.k)
        return self.experts_forward(x, weights, ids)


class TritonTuner:
    """triton-fused-moe's rows: picks a block config per (preset, tokens) (from the cache
    file, else by a timed sweep of candidate_configs), captures the layer in a CUDA graph
    and times its replays."""

    def __init__(self, torch, kern, device, timer, late, env):
        self.torch, self.kern, self.timer, self.late = torch, kern, timer, late
        self.gpu = torch.cuda.get_device_name(device)
        self.version = kern.triton.__version__
        self.path = cache_path(env)
        self.resweep = env.get(RESWEEP_ENV, "") == "1"
        self.cache = self._load()
        self.warned = set()

    def warn_once(self, key, msg):
        if key not in self.warned:
            self.warned.add(key)
            log(f"warning: {msg}")

    def _load(self):
        try:
            with open(self.path) as f:
                data = json.load(f)
            if isinstance(data, dict) and data.get("format") == CACHE_FORMAT:
                return data
            log(f"warning: {self.path} is not a {CACHE_FORMAT} file; sweeping afresh")
        except FileNotFoundError:
            pass
        except (OSError, ValueError) as e:
            log(f"warning: cannot read {self.path} ({first_line(e)}); sweeping afresh")
        return {"format": CACHE_FORMAT, "gpus": {}}

    def _save(self):
        try:
            os.makedirs(os.path.dirname(self.path), exist_ok=True)
            tmp = f"{self.path}.{os.getpid()}.tmp"
            with open(tmp, "w") as f:
                json.dump(self.cache, f, indent=1, sort_keys=True)
            os.replace(tmp, self.path)
        except OSError as e:
            self.warn_once("save", f"cannot write {self.path} ({first_line(e)}); the swept "
                           f"configs are not kept")

    def cached(self, case, tokens):
        """The cached config of (this GPU, case, tokens), if made by this Triton version."""
        entry = self.cache.get("gpus", {}).get(self.gpu, {}).get(case, {}).get(str(tokens))
        if self.resweep or not isinstance(entry, dict) or entry.get("triton") != self.version:
            return None
        return parse_config(entry.get("config"))

    def remember(self, case, tokens, cfg, us):
        per_case = self.cache.setdefault("gpus", {}).setdefault(self.gpu, {})
        per_case.setdefault(case, {})[str(tokens)] = {
            "config": config_name(cfg), "us": round(us, 2), "triton": self.version,
            "torch": self.torch.__version__}
        self._save()

    def capture(self, fn):
        """fn() captured in a CUDA graph (replayed once), or None with one warning a run."""
        torch = self.torch
        try:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                fn()
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                fn()
            graph.replay()
            torch.cuda.synchronize()
            return graph
        except Exception as e:  # noqa: BLE001 -- any failure: time it eagerly instead
            try:
                torch.cuda.synchronize()
            except Exception:  # noqa: BLE001 -- the eager path will say what is wrong
                pass
            self.warn_once("graph", f"{TRITON_VARIANT}: CUDA graph capture failed "
                           f"({first_line(e)}); timing it eagerly (extra.graph = false)")
            return None

    def build(self, layer, x, ref, cfg):
        """(fused, graph, rel_err) for cfg: one eager forward (compiles the kernels), its
        output checked against ref, then the graph; raises when the config fails."""
        fused = FusedMoe(self.torch, self.kern, *layer, x.shape[0], cfg)
        err = rel_err(self.torch, fused.forward(x), ref)
        if not err < TRITON_TOL:
            raise ValueError(f"output off torch-hf-eager's by {err:.3g} (relative)")
        graph = self.capture(lambda: fused.forward(x))
        if graph is not None:
            fused.out.fill_(float("nan"))
            graph.replay()
            err = rel_err(self.torch, fused.out, ref)
            if not err < TRITON_TOL:
                raise ValueError(f"graph replay's output off torch-hf-eager's by {err:.3g}")
        return fused, graph, err

    @staticmethod
    def runner(fused, graph, x):
        return graph.replay if graph is not None else (lambda: fused.forward(x))

    def quick_time(self, fn):
        """Median us of a short timing (the sweep's)."""
        for _ in range(2):
            fn()
        est = percentile(sorted(self.timer(fn, 3)), 0.5)
        reps = max(SWEEP_MIN_REPS, min(SWEEP_MAX_REPS, int(SWEEP_CAND_S * 1e6 / max(est, 1.0))))
        return percentile(sorted(self.timer(fn, reps)), 0.5)

    def choose(self, case, tokens, layer, x, ref):
        """((fused, graph, err), cfg, extra) of the config this row runs."""
        cfg = self.cached(case, tokens)
        if cfg is not None:
            try:
                return self.build(layer, x, ref, cfg), cfg, {"config_source": "cache"}
            except Exception as e:  # noqa: BLE001
                log(f"warning: {case} T={tokens}: cached config {config_name(cfg)} failed "
                    f"({first_line(e)}); sweeping")
        top_k, n_exp = layer[3], layer[1].shape[0]
        start, best, times, failed, cut = time.perf_counter(), None, {}, [], False
        for i, cfg in enumerate(candidate_configs(tokens, top_k, n_exp)):
            if i > 0 and (self.late() or time.perf_counter() - start > SWEEP_ROW_S):
                cut = True
                break
            try:
                built = self.build(layer, x, ref, cfg)
                us = self.quick_time(self.runner(built[0], built[1], x))
            except Exception as e:  # noqa: BLE001 -- out of resources, compile error, ...
                failed.append(config_name(cfg))
                self.warn_once(("cfg", config_name(cfg), first_line(e)),
                               f"{TRITON_VARIANT} config {config_name(cfg)} failed "
                               f"({first_line(e)})")
                continue
            times[config_name(cfg)] = round(us, 2)
            if best is None or us < best[2]:
                best = (built, cfg, us)
            del built
        if best is None:
            raise RuntimeError(f"no candidate config ran ({', '.join(failed)} failed)")
        built, cfg, us = best
        extra = {"config_source": "sweep", "sweep_us": times,
                 "sweep_s": round(time.perf_counter() - start, 2)}
        if failed:
            extra["sweep_failed"] = failed
        if cut:
            extra["sweep_partial"] = True
        else:
            self.remember(case, tokens, cfg, us)
        return built, cfg, extra

    def row(self, case, tokens, layer, x, ref, budget, nbytes, base):
        """The triton-fused-moe row, or None (with a warning) when it cannot be had."""
        torch = self.torch
        try:
            (fused, graph, _), cfg, how = self.choose(case, tokens, layer, x, ref)
            samples, reps = self.timer.measure(self.runner(fused, graph, x), budget)
            torch.cuda.synchronize()
            err = rel_err(torch, fused.out, ref)  # the output of the replays just timed
        except Exception as e:  # noqa: BLE001
            log(f"warning: {case} T={tokens}: {TRITON_VARIANT} left out: {first_line(e)}")
            return None
        if not err < TRITON_TOL:
            log(f"warning: {case} T={tokens}: {TRITON_VARIANT} left out: its output is off "
                f"torch-hf-eager's by {err:.3g} (relative; the bound is {TRITON_TOL})")
            return None
        extra = dict(base, reps=reps, rel_err_vs_hf_eager=err, config=config_name(cfg),
                     graph=graph is not None, triton=self.version, **how)
        return row(case, tokens, TRITON_VARIANT, samples, nbytes, extra)


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


# ---- warpdrive's router weight and inputs (crates/warpdrive-bench/src/moe.rs): every peer
# routes the same tokens to the same experts as the warpdrive rows, so a row's time is for
# the same experts' bytes (with independent draws, 16 tokens of gpt-oss hit 49 experts here
# and 50 there: 2 % of the bytes) ----

WD_SEED = 0x6D6F6521  # moe.rs SEED: the layer's MoeWeights::Random seed; input seed ^ tokens
WD_SEED_GATE = 0x67617465  # moe/weights.rs SEED_GATE
M64 = (1 << 64) - 1


def wd_random_bits(seed, i, u=int):
    """moe/weights.rs random_bits: word i of the counter-based generator keyed by seed (i a
    Python int, or a numpy uint64 array with u=numpy.uint64)."""
    def mix64(z):
        z = ((z ^ (z >> u(30))) * u(0xBF58476D1CE4E5B9)) & u(M64)
        z = ((z ^ (z >> u(27))) * u(0x94D049BB133111EB)) & u(M64)
        return z ^ (z >> u(31))
    return mix64(u(seed) ^ mix64((i + u(0x9E3779B97F4A7C15)) & u(M64)))


def wd_gate_values(n, hidden, np):
    """gate.weight's first n values as float32 (weights.rs random_value: 24 bits, uniform in
    [-s, s), s = sqrt(3 / hidden))."""
    i = np.arange(n, dtype=np.uint64)
    bits = (wd_random_bits(WD_SEED ^ WD_SEED_GATE, i, np.uint64) >> np.uint64(40)).astype(np.float32)
    f = np.float32
    return (bits * f(2.0 ** -24) * f(2.0) - f(1.0)) * f(math.sqrt(3.0 / hidden))


def wd_input_values(tokens, n, np):
    """moe.rs normal_bf16's first n values for `tokens` tokens, as float64: Box-Muller on
    word pairs (2p, 2p + 1), cosine part at even positions, sine at odd."""
    j = np.arange(n, dtype=np.uint64)
    pair = (j >> np.uint64(1)) << np.uint64(1)
    seed = WD_SEED ^ tokens
    ulp = 2.0 ** -53
    u1 = ((wd_random_bits(seed, pair, np.uint64) >> np.uint64(11)) + np.uint64(1)).astype(np.float64) * ulp
    u2 = (wd_random_bits(seed, pair + np.uint64(1), np.uint64) >> np.uint64(11)).astype(np.float64) * ulp
    m, a = np.sqrt(-2.0 * np.log(u1)), 2.0 * math.pi * u2
    return np.where(j % np.uint64(2) == np.uint64(0), m * np.cos(a), m * np.sin(a))


# gate.weight [0..6) at H = 2048, and the input for 16 tokens [0..6) (f64, before rounding)
WD_PINNED_GATE = [-0.017404694110155106, -0.032054174691438675, 0.014484505169093609,
                  -0.02284870110452175, -0.004696317482739687, -0.02791733480989933]
WD_PINNED_INPUT = [0.7074515805294876, -0.5279720798884339, 0.5600406153330743,
                   -1.1844142294926885, 1.0448524129518435, 0.8497358760943176]


def wd_gate(torch, device, n_exp, hidden):
    """warpdrive's router weight [E, H] in bf16 on the device."""
    import numpy as np
    v = wd_gate_values(n_exp * hidden, hidden, np)
    return torch.from_numpy(v).reshape(n_exp, hidden).to(device=device, dtype=torch.bfloat16)


def wd_input(torch, device, tokens, hidden):
    """warpdrive's input for `tokens` tokens [T, H] in bf16 on the device."""
    import numpy as np
    v = wd_input_values(tokens, tokens * hidden, np)
    return torch.from_numpy(v).reshape(tokens, hidden).to(device=device, dtype=torch.bfloat16)


def normal(torch, gen, device, shape, scale=1.0):
    """Seeded N(0, 1) * scale in bf16, drawn on the device."""
    t = torch.randn(shape, generator=gen, device=device, dtype=torch.bfloat16)
    return t.mul_(scale) if scale != 1.0 else t


def run_preset(torch, device, index, preset, tokens_list, timer, gmm, emulated, budget,
               out_of_time, tuner=None):
    """Rows of one preset: its weights are built once here and die with this frame."""
    case, hidden, inter, n_exp, k = preset
    gen = torch.Generator(device=device).manual_seed(SEED + index)
    expert_gb = 3 * n_exp * hidden * inter * BF16 / 1e9
    log(f"{case}: H={hidden} I={inter} E={n_exp} top-{k}, experts {expert_gb:.2f} GB "
        f"(held twice: grouped and per-expert layouts"
        f"{'; w1 and w3 a third time, fused for Triton' if tuner else ''})")
    gate = wd_gate(torch, device, n_exp, hidden)
    # _grouped_mm's layout, stored once: xp [M, H] @ w1[e] [H, I]; h [M, I] @ w2[e] [I, H]
    w1 = normal(torch, gen, device, (n_exp, hidden, inter), 1 / math.sqrt(hidden))
    w3 = normal(torch, gen, device, (n_exp, hidden, inter), 1 / math.sqrt(hidden))
    w2 = normal(torch, gen, device, (n_exp, inter, hidden), 1 / math.sqrt(inter))
    # the same values as nn.Linear weights [out, in], one contiguous tensor per expert
    hw1, hw3, hw2 = (w.transpose(1, 2).contiguous() for w in (w1, w3, w2))
    experts = [(hw1[e], hw3[e], hw2[e]) for e in range(n_exp)]
    # triton-fused-moe: per expert [w1; w3] as one [2I, H] matrix, and w2 as [H, I]
    layer = (gate, torch.cat([hw1, hw3], dim=1), hw2, k) if tuner else None

    rows = []
    for tokens in tokens_list:
        if out_of_time(f"{case} T={tokens}"):
            break
        x = wd_input(torch, device, tokens, hidden)
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

        if gmm is not None:
            grouped = functools.partial(grouped_forward, torch, gmm, x, gate, w1, w3, w2, k)
            err = rel_err(torch, grouped(), hf())
            if not err < 5e-2:
                log(f"warning: {case} T={tokens}: torch-grouped-mm differs from torch-hf-eager "
                    f"by {err:.3g} (relative)")
            samples, reps = timer.measure(grouped, budget)
            extra = dict(base, reps=reps, rel_err_vs_hf_eager=err)
            if emulated:
                extra["emulated"] = True
            r = row(case, tokens, "torch-grouped-mm", samples, nbytes, extra)
            rows.append(r)
            log(f"{case} T={tokens} torch-grouped-mm: {r['median']:.1f} us ({reps} reps)")

        if tuner is not None:
            r = tuner.row(case, tokens, layer, x, hf(), budget, nbytes, base)
            if r is not None:
                rows.append(r)
                e = r["extra"]
                log(f"{case} T={tokens} {TRITON_VARIANT}: {r['median']:.1f} us ({e['reps']} "
                    f"reps, {e['config']} from {e['config_source']}, graph {e['graph']}, "
                    f"rel_err {e['rel_err_vs_hf_eager']:.2g})")
    return rows


def run_router_permute(torch, device, quick, timer, budget):
    hidden, n_exp, k = router_shape(quick)
    gate = wd_gate(torch, device, n_exp, hidden)
    nbytes = n_exp * hidden * BF16
    rows = []
    for tokens in QUICK_ROUTER_TOKENS if quick else ROUTER_TOKENS:
        x = wd_input(torch, device, tokens, hidden)
        fn = functools.partial(router_permute, torch, x, gate, k)
        samples, reps = timer.measure(fn, budget)
        r = row(ROUTER_CASE, tokens, ROUTER_VARIANT, samples, nbytes,
                {"hidden": hidden, "experts": n_exp, "top_k": k, "tokens": tokens,
                 "dtype": "bf16", "shape_of": ROUTER_PRESET, "bytes_counted": "router weight",
                 "reps": reps})
        rows.append(r)
        log(f"{ROUTER_CASE} T={tokens}: {r['median']:.1f} us ({reps} reps)")
    return rows


# ---- --self-test: the Triton kernels through the interpreter, on the CPU ----


def check_alignment(fused, ids):
    """Problems (strings) in fused's moe_align outputs for the routing `ids`."""
    bm = fused.cfg[0]
    flat = ids.reshape(-1).tolist()
    n_post = int(fused.num_post[0])
    if n_post % bm or n_post > fused.rows:
        return [f"num_post {n_post} not a multiple of {bm} in [0, {fused.rows}]"]
    got = fused.sorted[:n_post].tolist()
    blocks = fused.block_expert[:n_post // bm].tolist()
    bad, pos = [], 0
    for e in range(fused.experts):
        mine = [s for s, x in enumerate(flat) if x == e]
        span = -(-len(mine) // bm) * bm
        if got[pos:pos + len(mine)] != mine:
            bad.append(f"expert {e}: slots {got[pos:pos + len(mine)]}, expected {mine}")
        if any(v != fused.slots for v in got[pos + len(mine):pos + span]):
            bad.append(f"expert {e}: padding {got[pos + len(mine):pos + span]}")
        if blocks[pos // bm:(pos + span) // bm] != [e] * (span // bm):
            bad.append(f"expert {e}: block experts {blocks[pos // bm:(pos + span) // bm]}")
        pos += span
    if pos != n_post:
        bad.append(f"num_post {n_post}, expected {pos}")
    return bad


def reference_experts(torch, x, w13, w2, weights, ids):
    """The layer after the router in f32 from the same bf16 values, slot by slot."""
    inter = w2.shape[2]
    xf, out = x.float(), torch.zeros(x.shape, dtype=torch.float32)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            w = w13[e].float()
            h = torch.nn.functional.silu(xf[t] @ w[:inter].T) * (xf[t] @ w[inter:].T)
            out[t] += float(weights[t, j]) * (h @ w2[e].float().T)
    return out


def interpreter_numpy_shim():
    """Triton's interpreter (3.6 at least) holds a scalar argument as a 1-element array and
    takes a loop bound from it with int(array), which NumPy 2.4 refuses: make it take the
    element. True when patched."""
    import numpy as np

    try:
        int(np.array([1]))
        return False
    except TypeError:
        pass
    from triton.runtime import interpreter

    orig = getattr(interpreter, "_patch_lang_tensor", None)
    if orig is None:
        return False

    def patched(tensor, scope):
        orig(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interpreter._patch_lang_tensor = patched
    return True


def self_test():
    """Runs the checks; returns the exit status (0: all passed)."""
    os.environ["TRITON_INTERPRET"] = "1"  # before Triton builds the kernels
    import torch

    passed, failed = 0, 0

    def report(ok, what):
        nonlocal passed, failed
        passed, failed = passed + ok, failed + (not ok)
        print(f"{'ok  ' if ok else 'FAIL'} {what}", flush=True)

    # the pure-Python side: every candidate names and parses back, every case has some
    for c, _, _, e, k in presets(False) + presets(True):
        for t in TOKENS:
            cands = candidate_configs(t, k, e)
            ok = len(cands) >= 6 and all(parse_config(config_name(x)) == x for x in cands)
            if not ok:
                report(False, f"candidates of {c} T={t}: {cands}")
    report(True, "candidate configs of every preset and token count name and parse back")

    # warpdrive's inputs: the values its own tests pin (moe/weights.rs and the bench's moe.rs,
    # `the_peers_inputs_are_these`)
    import numpy as np
    gate6 = [float(v) for v in wd_gate_values(6, 2048, np)]
    x6 = [float(v) for v in wd_input_values(16, 6, np)]
    report(gate6 == WD_PINNED_GATE and all(abs(a - b) <= 1e-12 for a, b in zip(x6, WD_PINNED_INPUT)),
           f"warpdrive's router weight and input recomputed: {gate6[:2]}, {x6[:2]}")

    try:
        kern = triton_kernels()
    except Exception as e:  # noqa: BLE001
        report(False, f"Triton: {first_line(e)}")
        print(f"{passed} passed, {failed} failed")
        return 1
    if interpreter_numpy_shim():
        print("(NumPy >= 2.4: Triton's interpreter patched to read scalar arguments)")
    hidden, inter, n_exp, k = 64, 48, 8, 2
    torch.manual_seed(SEED)
    gate = torch.randn(n_exp, hidden).div_(math.sqrt(hidden)).bfloat16()
    w13 = torch.randn(n_exp, 2 * inter, hidden).div_(math.sqrt(hidden)).bfloat16()
    w2 = torch.randn(n_exp, hidden, inter).div_(math.sqrt(inter)).bfloat16()
    experts = [(w13[e, :inter], w13[e, inter:], w2[e]) for e in range(n_exp)]
    # BK 32 over hidden 64: two K steps; over inter 48: a masked tail; BN / 2 = 32 over
    # inter 48: a masked column tail
    configs = [(16, 32, 32, 1, 4, 1), (32, 64, 32, 2, 4, 1), (16, 64, 64, 4, 4, 1)]
    print(f"Triton {kern.triton.__version__} interpreter, torch {torch.__version__}: "
          f"H={hidden} I={inter} E={n_exp} top_k={k}", flush=True)
    for tokens in (1, 5, 33):
        x = torch.randn(tokens, hidden).bfloat16()
        routed_w, routed_ids = route(torch, x, gate, k)
        # skewed: every token's first choice is expert 3, the second one of 4, 5, 6; experts
        # 0, 1, 2 and 7 get no tokens
        skew_ids = torch.stack([torch.full((tokens,), 3), 4 + torch.arange(tokens) % 3], 1)
        skew_w = torch.rand(tokens, k) + 0.1
        skew_w /= skew_w.sum(1, keepdim=True)
        for name, weights, ids in (("router", routed_w, routed_ids),
                                   ("skewed", skew_w, skew_ids)):
            want = reference_experts(torch, x, w13, w2, weights, ids)
            for cfg in configs:
                what = f"T={tokens:<2} {name} {config_name(cfg)}"
                fused = FusedMoe(torch, kern, gate, w13, w2, k, tokens, cfg, dot_f32=True)
                for buf, poison in ((fused.sorted, -7), (fused.block_expert, -7),
                                    (fused.h, float("nan")), (fused.y, float("nan")),
                                    (fused.out, float("nan"))):
                    buf.fill_(poison)
                try:
                    got = fused.experts_forward(x, weights.contiguous(), ids.contiguous())
                except Exception as e:  # noqa: BLE001
                    report(False, f"{what}: {type(e).__name__}: {first_line(e)}")
                    continue
                bad = check_alignment(fused, ids)
                err = rel_err(torch, got, want)
                report(not bad and err < 2e-2,
                       f"{what}: alignment {'; '.join(bad) or 'ok'} (num_post "
                       f"{int(fused.num_post[0])} of {fused.rows}), rel_err vs f32 {err:.2e}")
        # the whole layer (router included) against torch-hf-eager, as the benchmark checks it
        fused = FusedMoe(torch, kern, gate, w13, w2, k, tokens, configs[1], dot_f32=True)
        err = rel_err(torch, fused.forward(x), hf_eager_forward(torch, x, gate, experts, k))
        report(err < 2e-2, f"T={tokens:<2} layer vs torch-hf-eager (bf16): rel_err {err:.2e}")
    print(f"{passed} passed, {failed} failed")
    return 0 if failed == 0 else 1


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--list", action="store_true", help="print the cases and exit (no torch)")
    ap.add_argument("--self-test", action="store_true",
                    help=f"check {TRITON_VARIANT}'s kernels on small shapes on the CPU through "
                         "Triton's interpreter (TRITON_INTERPRET=1) and exit")
    args = ap.parse_args()

    if args.list:
        for c, h, i, e, k in presets(args.quick):
            print(f"{c:>20} H={h} I={i} E={e} top_k={k}")
        h, e, k = router_shape(args.quick)
        print(f"{ROUTER_CASE:>20} H={h} E={e} top_k={k} (shape of {ROUTER_PRESET})")
        for c, t, v in plan(args.quick):
            print(f"{c:>20} {t:>6} {v}")
        return
    if args.self_test:
        sys.exit(self_test())

    import torch

    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    log(f"torch {torch.__version__} on {device}{' (quick sizes)' if args.quick else ''}")
    start, stop_s, warned = time.perf_counter(), stop_after_s(os.environ), []

    def late():
        return time.perf_counter() - start > stop_s

    def out_of_time(what):
        if late() and not warned:
            warned.append(what)
            log(f"warning: past {stop_s:.0f} s (of ${TIMEOUT_ENV}); {what} and the cases "
                f"after it are left out")
        return late()

    timer = Timer(torch, device)
    gmm, emulated = grouped_mm_for(torch, device)
    kern, why = triton_for(device)
    tuner = None
    if kern is None:
        log(f"{TRITON_VARIANT} skipped: {why}")
    else:
        tuner = TritonTuner(torch, kern, device, timer, late, os.environ)
        log(f"{TRITON_VARIANT}: Triton {tuner.version} on {tuner.gpu}; block configs cached "
            f"in {tuner.path}{' (ignored: ' + RESWEEP_ENV + '=1)' if tuner.resweep else ''}")
    budget = QUICK_BUDGET_S if args.quick else BUDGET_S
    tokens_list = QUICK_TOKENS if args.quick else TOKENS
    with torch.inference_mode():
        rows = run_router_permute(torch, device, args.quick, timer, budget)
        for i, preset in enumerate(presets(args.quick)):
            if out_of_time(preset[0]):
                break
            rows += run_preset(torch, device, i, preset, tokens_list, timer, gmm, emulated,
                               budget, out_of_time, tuner)
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
