#!/usr/bin/env python3
"""PyTorch peer of warpdrive's `fuse` suite (contract: bench/peers/README.md).

The same chains over the same inputs (two tensors x, y of `size` bytes each, seeded random
in [-2, 2), one output), with the case names and sizes warpdrive uses:

  chain2-<t>     1.5 (x y) + 0.25
  chain5-<t>     leaky(1.5 max(x y + x, y) + 0.25), leaky(v) = where(v > 0, v, 0.1 v)
  chain10-<t>    (0.5 (min(chain5, y) - x) - 1) y + x
  gelu-silu-<t>  gelu_tanh(x) silu(y)       (two transcendental activations)
  filter-<p>pct-f32  (1.5 x + 0.25)[x < t] over uniform f32 x, t keeping 1 % or 50 %
                 (boolean-mask indexing: PyTorch learns the count on the host; GB/s: input
                 read + kept values written; torch.compile with dynamic shapes, if it can)
  gemm-bias-gelu-bf16, gemm-bias-gelu-residual-bf16  gelu_tanh(a b + bias) [+ r], bf16,
                 m = n = k = size (4096; --quick 256): torch-eager, torch-compile, and
                 torch-addmm-activation (torch._addmm_activation: cuBLASLt's own bias-GELU
                 epilogue; + r as a second kernel). TFLOP/s of the GEMM's 2 m n k.
  gemm-bf16      the bare product a @ b (torch-eager), what the epilogues add to.
  softmax-xent-bf16  cross_entropy(x, labels, reduction="none") of bf16 logits
                 [size / 2 / 32768, 32768] (GB/s: logits + labels + losses once; the
                 compiled function upcasts to f32 inside, as warpdrive computes in f32)

t = f32 or bf16. Variants: `torch-eager` (one kernel per op, intermediates in memory) and
`torch-compile` (`torch.compile(fullgraph=True)`, inductor: the chain as generated Triton on
the GPU). GB/s counts 2 inputs read + 1 output written once (as warpdrive's rows), so rows
pair with warpdrive's and cite `d2d_copy_gbps`. `compile-first` / `torch-compile`: the
first call after `torch._dynamo.reset()` of the chain5 bf16 function (host time; inductor's
on-disk caches may serve repeats, as warpdrive's kernel cache does for `compile-cached`).

Sizes: 256 MiB per input; with --quick 4 MiB (and a vocabulary of 4096 for softmax-xent). Method as warpdrive's: warm-up (which
includes inductor's compile), CUDA events, median and p10/p90 by linear interpolation.
A variant that fails (e.g. inductor without a C++ compiler on the CPU) is logged on stderr
and left out.
"""

import argparse
import json
import sys
import time

from peer_stats import percentile

SUITE = "fuse"


def log(msg):
    print(f"fuse.py: {msg}", file=sys.stderr, flush=True)


class Timer:
    """Times `reps` samples of `fn` after `warmup` calls; microseconds per call. CUDA events on
    a GPU, the host clock on the CPU."""

    def __init__(self, torch, device):
        self.torch = torch
        self.cuda = device.type == "cuda"

    def sync(self):
        if self.cuda:
            self.torch.cuda.synchronize()

    def __call__(self, fn, warmup, reps):
        for _ in range(warmup):
            fn()
        self.sync()
        if self.cuda:
            ev = [self.torch.cuda.Event(enable_timing=True) for _ in range(reps + 1)]
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


def row(case, size, variant, samples, moved, extra):
    s = sorted(samples)
    median = percentile(s, 0.5)
    return {
        "suite": SUITE,
        "case": case,
        "size": int(size),
        "variant": variant,
        "median": median,
        "p10": percentile(s, 0.1),
        "p90": percentile(s, 0.9),
        "unit": "us",
        "gbps": (moved / (median * 1e3)) if moved and median > 0 else None,
        "tflops": None,
        "pct_of_ceiling": None,
        "extra": extra,
    }


def chains(torch):
    F = torch.nn.functional

    def leaky(v):
        return torch.where(v > 0, v, v * 0.1)

    def chain2(x, y):
        return x * y * 1.5 + 0.25

    def chain5(x, y):
        return leaky(torch.maximum(x * y + x, y) * 1.5 + 0.25)

    def chain10(x, y):
        return ((torch.minimum(chain5(x, y), y) - x) * 0.5 - 1.0) * y + x

    def gelu_silu(x, y):
        return F.gelu(x, approximate="tanh") * F.silu(y)

    return [
        ("chain2", chain2, 2, "memory"),
        ("chain5", chain5, 5, "memory"),
        ("chain10", chain10, 10, "memory"),
        ("gelu-silu", gelu_silu, 3, "compute"),
    ]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()

    import torch

    device = torch.device(args.device)
    timer = Timer(torch, device)
    if args.quick:
        size, warmup, reps = 4 << 20, 2, 5
    else:
        size, warmup, reps = 256 << 20, 5, 30
    rows = []
    for tname, dtype in [("f32", torch.float32), ("bf16", torch.bfloat16)]:
        n = size // (4 if dtype == torch.float32 else 2)
        gen = torch.Generator(device="cpu").manual_seed(0xF05E)
        x = (torch.rand(n, generator=gen) * 4 - 2).to(dtype).to(device)
        y = (torch.rand(n, generator=gen) * 4 - 2).to(dtype).to(device)
        moved = 3 * size
        for name, fn, ops, bound in chains(torch):
            case = f"{name}-{tname}"
            extra = {"ceiling": "d2d_copy_gbps", "dtype": tname, "ops": ops, "bound": bound,
                     "bytes_counted": "2 inputs read + 1 output written"}
            log(f"{case} eager on {device}")
            try:
                us = timer(lambda: fn(x, y), warmup, reps)
                rows.append(row(case, size, "torch-eager", us, moved, dict(extra)))
            except Exception as e:  # noqa: BLE001 - a peer never fails the run
                log(f"{case} eager failed: {e}")
            log(f"{case} torch.compile on {device}")
            try:
                compiled = torch.compile(fn, fullgraph=True)
                us = timer(lambda: compiled(x, y), warmup, reps)
                rows.append(row(case, size, "torch-compile", us, moved,
                                dict(extra, backend="inductor")))
            except Exception as e:  # noqa: BLE001
                log(f"{case} torch.compile failed: {e}")
        del x, y

    # Filters (stream compaction) of a map.
    n = size // 4
    gen = torch.Generator(device="cpu").manual_seed(0xF11)
    x = (torch.rand(n, generator=gen) * 4 - 2).to(device)

    def filt(x, t):
        return (x * 1.5 + 0.25)[x < t]

    for pct, t in [(1, -1.96), (50, 0.0)]:
        case = f"filter-{pct}pct-f32"
        kept = int((x < t).sum().item())
        moved = size + 4 * kept + 4
        extra = {"ceiling": "d2d_copy_gbps", "dtype": "f32", "kept": kept,
                 "selectivity_pct": pct}
        log(f"{case} eager on {device}")
        try:
            rows.append(row(case, size, "torch-eager", timer(lambda: filt(x, t), warmup, reps),
                            moved, dict(extra)))
        except Exception as e:  # noqa: BLE001
            log(f"{case} eager failed: {e}")
        log(f"{case} torch.compile on {device}")
        try:
            compiled = torch.compile(filt, dynamic=True)
            rows.append(row(case, size, "torch-compile",
                            timer(lambda: compiled(x, t), warmup, reps), moved,
                            dict(extra, backend="inductor", dynamic=True)))
        except Exception as e:  # noqa: BLE001
            log(f"{case} torch.compile failed: {e}")
    del x

    # Softmax cross-entropy per row.
    vocab = 4096 if args.quick else 32768
    rows_n = max(1, size // 2 // vocab)
    case = "softmax-xent-bf16"
    logits_bytes = rows_n * vocab * 2
    moved = logits_bytes + 8 * rows_n
    gen = torch.Generator(device="cpu").manual_seed(0x5E7)
    x = (torch.rand(rows_n, vocab, generator=gen) * 4 - 2).to(torch.bfloat16).to(device)
    labels = torch.randint(0, vocab, (rows_n,), generator=gen).to(device)
    F = torch.nn.functional
    extra = {"ceiling": "d2d_copy_gbps", "dtype": "bf16", "rows": rows_n, "cols": vocab,
             "bytes_counted": "logits + labels + losses once"}

    def xent_eager():
        return F.cross_entropy(x, labels, reduction="none")

    def xent_fn(x, labels):
        return F.cross_entropy(x.float(), labels, reduction="none")

    log(f"{case} eager on {device}")
    try:
        rows.append(row(case, logits_bytes, "torch-eager", timer(xent_eager, warmup, reps),
                        moved, dict(extra)))
    except Exception as e:  # noqa: BLE001
        log(f"{case} eager failed: {e}")
    log(f"{case} torch.compile on {device}")
    try:
        compiled = torch.compile(xent_fn, fullgraph=True)
        rows.append(row(case, logits_bytes, "torch-compile",
                        timer(lambda: compiled(x, labels), warmup, reps), moved,
                        dict(extra, backend="inductor")))
    except Exception as e:  # noqa: BLE001
        log(f"{case} torch.compile failed: {e}")
    del x, labels

    # GEMM + bias + GELU (+ residual).
    d = 256 if args.quick else 4096
    gen = torch.Generator(device="cpu").manual_seed(0x6E1)
    a = (torch.rand(d, d, generator=gen) * 2 - 1).to(torch.bfloat16).to(device)
    b = ((torch.rand(d, d, generator=gen) * 2 - 1) / d ** 0.5).to(torch.bfloat16).to(device)
    bias = (torch.rand(d, generator=gen) * 2 - 1).to(torch.bfloat16).to(device)
    res = (torch.rand(d, d, generator=gen) * 2 - 1).to(torch.bfloat16).to(device)
    flops = 2.0 * d ** 3

    def gemm_row(case, variant, samples, extra):
        r = row(case, d, variant, samples, None, extra)
        r["tflops"] = flops / (r["median"] * 1e6) if r["median"] > 0 else None
        return r

    def bias_gelu(a, b, bias):
        return F.gelu(a @ b + bias, approximate="tanh")

    def bias_gelu_res(a, b, bias, r):
        return F.gelu(a @ b + bias, approximate="tanh") + r

    log(f"gemm-bf16 torch-eager on {device}")
    try:
        rows.append(gemm_row("gemm-bf16", "torch-eager", timer(lambda: a @ b, warmup, reps),
                             {"ceiling": "gemm_bf16_tflops", "dtype": "bf16", "m": d, "n": d,
                              "k": d, "what": "the bare product a @ b"}))
    except Exception as e:  # noqa: BLE001
        log(f"gemm-bf16 torch-eager failed: {e}")
    for case, fn, fn_args, lt in [
        ("gemm-bias-gelu-bf16", bias_gelu, (a, b, bias),
         lambda: torch._addmm_activation(bias, a, b, use_gelu=True)),
        ("gemm-bias-gelu-residual-bf16", bias_gelu_res, (a, b, bias, res),
         lambda: torch._addmm_activation(bias, a, b, use_gelu=True) + res),
    ]:
        extra = {"ceiling": "gemm_bf16_tflops", "dtype": "bf16", "m": d, "n": d, "k": d}
        for variant, call, note in [
            ("torch-eager", lambda: fn(*fn_args), {}),
            ("torch-addmm-activation", lt, {"epilogue": "cuBLASLt GELU_BIAS (tanh GELU)"}),
        ]:
            log(f"{case} {variant} on {device}")
            try:
                rows.append(gemm_row(case, variant, timer(call, warmup, reps), dict(extra, **note)))
            except Exception as e:  # noqa: BLE001
                log(f"{case} {variant} failed: {e}")
        log(f"{case} torch.compile on {device}")
        try:
            compiled = torch.compile(fn, fullgraph=True)
            rows.append(gemm_row(case, "torch-compile",
                                 timer(lambda: compiled(*fn_args), warmup, reps),
                                 dict(extra, backend="inductor")))
        except Exception as e:  # noqa: BLE001
            log(f"{case} torch.compile failed: {e}")
    del a, b, bias, res

    # First compile of the chain5 bf16 function (host time of the first call after a reset).
    try:
        gen = torch.Generator(device="cpu").manual_seed(1)
        x = (torch.rand(16, generator=gen) * 4 - 2).to(torch.bfloat16).to(device)
        y = (torch.rand(16, generator=gen) * 4 - 2).to(torch.bfloat16).to(device)
        fn = chains(torch)[1][1]
        samples = []
        for _ in range(3):
            torch._dynamo.reset()
            compiled = torch.compile(fn, fullgraph=True)
            timer.sync()
            t = time.perf_counter()
            compiled(x, y)
            timer.sync()
            samples.append((time.perf_counter() - t) * 1e6)
        rows.append(row("compile-first", 1, "torch-compile", samples, None,
                        {"kernel": "chain5-bf16", "backend": "inductor",
                         "what": "first call after torch._dynamo.reset() (compile + run)"}))
    except Exception as e:  # noqa: BLE001
        log(f"compile-first failed: {e}")

    if args.json:
        json.dump(rows, sys.stdout)
        sys.stdout.write("\n")
    else:
        for r in rows:
            print(f"{r['case']:>16} {r['size']:>12} {r['variant']:>14} {r['median']:12.2f} us")


if __name__ == "__main__":
    main()
