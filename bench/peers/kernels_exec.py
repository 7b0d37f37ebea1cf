#!/usr/bin/env python3
"""GEMM and launch cases of the PyTorch peer of warpdrive's `kernels` suite; `kernels.py`
calls `collect` (contract: bench/peers/README.md).

Rows, with the case names and sizes warpdrive uses:
  gemm-bf16-N     torch-matmul  torch.matmul(a, b, out=c), bf16 n x n (size = n); TFLOP/s
  40xN-gemm       torch-bmm     torch.bmm(A, B, out=C), 40 f32 n x n GEMMs (size = n, TF32
                                off), inputs rotated among 4 sets as warpdrive does; TFLOP/s
  tiny-launches   torch-graph   one replay of a CUDA graph of 1000 `x.fill_(7)` on a
                                one-element int32 tensor; median = us per kernel, host clock
                                over the replay and one synchronize (size = 1000)

Sizes: n = 8192 and 256; with --quick 512 and 64 (the CPU backend; no graph there).
Method as warpdrive's: warm-up, CUDA events for the GEMMs, seeded random inputs, median and
p10/p90 by linear interpolation.
"""

import argparse
import json
import sys
import time

from peer_stats import percentile

SUITE = "kernels"
BATCH = 40
SETS = 4
LAUNCHES = 1000


def log(msg):
    print(f"kernels-exec.py: {msg}", file=sys.stderr, flush=True)


def row(case, size, variant, samples, flops=None, extra=None):
    s = sorted(samples)
    median = percentile(s, 0.5)
    return {
        "suite": SUITE,
        "case": case,
        "size": size,
        "variant": variant,
        "median": median,
        "p10": percentile(s, 0.1),
        "p90": percentile(s, 0.9),
        "unit": "us",
        "gbps": None,
        "tflops": (flops / (median * 1e6)) if flops and median > 0 else None,
        "pct_of_ceiling": None,
        "extra": extra or {},
    }


def timed(torch, cuda, fn, warmup, reps):
    """us per call of `fn` for `reps` calls after `warmup`: CUDA events back to back on a
    GPU (each sample from the end of the previous one), the host clock on the CPU."""
    for _ in range(warmup):
        fn()
    if cuda:
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


def collect(args):
    """Rows of the GEMM and launch cases (`args`: parsed --device / --quick)."""
    import torch

    torch.backends.cuda.matmul.allow_tf32 = False
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    gen = torch.Generator(device="cpu").manual_seed(0xE8EC)
    if args.quick:
        gemm_n, batch_n, gemm_reps, batch_reps = 512, 64, 10, 20
    else:
        gemm_n, batch_n, gemm_reps, batch_reps = 8192, 256, 20, 50
    rows = []

    def rand(*shape, dtype=torch.float32):
        return (torch.rand(*shape, generator=gen) * 2 - 1).to(dtype).to(device)

    log(f"gemm-bf16-{gemm_n} on {device}")
    a, b = rand(gemm_n, gemm_n, dtype=torch.bfloat16), rand(gemm_n, gemm_n, dtype=torch.bfloat16)
    c = torch.empty_like(a)
    us = timed(torch, cuda, lambda: torch.matmul(a, b, out=c), 3, gemm_reps)
    rows.append(row(f"gemm-bf16-{gemm_n}", gemm_n, "torch-matmul", us, 2.0 * gemm_n ** 3,
                    {"ceiling": "gemm_bf16_tflops", "dtype": "bf16"}))
    del a, b, c

    log(f"{BATCH}x{batch_n}-gemm")
    sets = [(rand(BATCH, batch_n, batch_n), rand(BATCH, batch_n, batch_n),
             torch.empty(BATCH, batch_n, batch_n, device=device)) for _ in range(SETS)]
    rep = [0]

    def bmm():
        rep[0] += 1
        x, y, z = sets[rep[0] % SETS]
        torch.bmm(x, y, out=z)

    us = timed(torch, cuda, bmm, 3, batch_reps)
    rows.append(row(f"{BATCH}x{batch_n}-gemm", batch_n, "torch-bmm", us, 2.0 * BATCH * batch_n ** 3,
                    {"batch": BATCH, "dtype": "f32", "tf32": False}))
    del sets

    if cuda:
        log(f"tiny-launches: a graph of {LAUNCHES} fills")
        x = torch.zeros(1, dtype=torch.int32, device=device)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                x.fill_(7)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(LAUNCHES):
                x.fill_(7)
        graph.replay()
        torch.cuda.synchronize()
        samples = []
        for _ in range(21):
            t = time.perf_counter()
            graph.replay()
            torch.cuda.synchronize()
            samples.append((time.perf_counter() - t) * 1e6 / LAUNCHES)
        rows.append(row("tiny-launches", LAUNCHES, "torch-graph", samples, None,
                        {"ceiling": "launch_us", "timer": "host clock, one synchronize per sample",
                         "op": "x.fill_(7), one int32 element"}))

    return rows
