#!/usr/bin/env python3
"""PyTorch peer of warpdrive's `kernels` suite (contract: bench/peers/README.md).

Rows, with the case names and sizes warpdrive uses:
  scale-<size>  torch-mul            y = x * 1.5 into a preallocated y (bytes read + written)
  sum-<size>    torch-sum            torch.sum of the same f32 buffer into a preallocated scalar
                                     (bytes read)
  gemm-bf16-N, 40xN-gemm, tiny-launches  torch-matmul, torch-bmm, torch-graph
                                     (from kernels_exec.py)
  router-E<E>-k<k>  torch-softmax-topk  topk(softmax(x.float(), -1), k), then w / w.sum(-1)
                                     on bf16 logits; size = tokens

Sizes: 1 GiB and tokens 1, 64, 1024, 16384; with --quick 16 MiB and tokens 1, 64, 1024.
Method as warpdrive's: warm-up, CUDA events, seeded random inputs, router inputs rotated
among enough sets to exceed twice the L2 (at most 128), 20 routes per timed sample, median
and p10/p90 by linear interpolation.
"""

import argparse
import json
import os
import sys
import time

from peer_stats import percentile

ROUTES = [(8, 2), (64, 8), (128, 8), (256, 8)]
MAX_SETS = 128


def log(msg):
    print(f"kernels.py: {msg}", file=sys.stderr, flush=True)


def size_label(n):
    if n >= 1 << 30 and n % (1 << 30) == 0:
        return f"{n >> 30}GiB"
    if n >= 1 << 20 and n % (1 << 20) == 0:
        return f"{n >> 20}MiB"
    return f"{n}B"


class Timer:
    """Times `reps` samples of `fn` (after `warmup` calls), each sample `batch` calls; returns
    microseconds per call. CUDA events on a GPU, the host clock on the CPU."""

    def __init__(self, torch, device):
        self.torch = torch
        self.cuda = device.type == "cuda"

    def sync(self):
        if self.cuda:
            self.torch.cuda.synchronize()

    def __call__(self, fn, warmup, reps, batch=1):
        for _ in range(warmup):
            fn()
        self.sync()
        out = []
        if self.cuda:
            ev = [self.torch.cuda.Event(enable_timing=True) for _ in range(reps + 1)]
            ev[0].record()
            for i in range(reps):
                for _ in range(batch):
                    fn()
                ev[i + 1].record()
            ev[-1].synchronize()
            out = [ev[i].elapsed_time(ev[i + 1]) * 1e3 / batch for i in range(reps)]
        else:
            for _ in range(reps):
                t = time.perf_counter()
                for _ in range(batch):
                    fn()
                out.append((time.perf_counter() - t) * 1e6 / batch)
        return out


def row(case, size, variant, samples, gbytes=None, extra=None):
    s = sorted(samples)
    median = percentile(s, 0.5)
    r = {
        "suite": "kernels",
        "case": case,
        "size": size,
        "variant": variant,
        "median": median,
        "p10": percentile(s, 0.1),
        "p90": percentile(s, 0.9),
        "unit": "us",
        "gbps": (gbytes / (median * 1e3)) if gbytes and median > 0 else None,
        "tflops": None,
        "pct_of_ceiling": None,
        "extra": extra or {},
    }
    return r


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()

    import torch

    device = torch.device(args.device)
    timer = Timer(torch, device)
    gen = torch.Generator(device="cpu").manual_seed(0x5CA1E)
    if args.quick:
        stream_bytes, tokens_list, warmup, reps, batch = 16 << 20, [1, 64, 1024], 1, 5, 2
    else:
        stream_bytes, tokens_list, warmup, reps, batch = 1 << 30, [1, 64, 1024, 16384], 5, 30, 20
    rows = []

    # scale / sum over f32
    n = stream_bytes // 4
    log(f"streaming cases over {size_label(stream_bytes)} on {device}")
    x = (torch.rand(n, generator=gen) * 2 - 1).to(device)
    y = torch.empty_like(x)
    total = torch.empty((), dtype=torch.float32, device=device)
    us = timer(lambda: torch.mul(x, 1.5, out=y), warmup, reps)
    rows.append(row(f"scale-{size_label(stream_bytes)}", stream_bytes, "torch-mul", us,
                    2 * stream_bytes,
                    {"ceiling": "d2d_copy_gbps", "dtype": "f32", "op": "y = x * 1.5",
                     "bytes_counted": "read+write"}))
    us = timer(lambda: torch.sum(x, 0, out=total), warmup, reps)
    rows.append(row(f"sum-{size_label(stream_bytes)}", stream_bytes, "torch-sum", us,
                    stream_bytes,
                    {"ceiling": "d2d_copy_gbps", "dtype": "f32", "bytes_counted": "read"}))
    del x, y, total

    # router
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        l2 = getattr(props, "L2_cache_size", 50 << 20)
    else:
        l2 = 0
    for experts, k in ROUTES:
        case = f"router-E{experts}-k{k}"
        for tokens in tokens_list:
            set_bytes = tokens * experts * 2 + tokens * k * 8
            sets = min(MAX_SETS, max(1, -(-2 * l2 // set_bytes))) if l2 else 1
            inputs = [
                (torch.rand(tokens, experts, 4, generator=gen) * 3 - 1.5)
                .sum(-1)
                .to(torch.bfloat16)
                .to(device)
                for _ in range(sets)
            ]
            state = {"next": 0}

            def route():
                j = state["next"] % sets
                state["next"] += 1
                p = torch.softmax(inputs[j].float(), -1)
                w, i = torch.topk(p, k)
                return w / w.sum(-1, keepdim=True), i

            log(f"{case} at {tokens} tokens ({sets} sets)")
            us = timer(route, warmup, reps, batch)
            rows.append(row(case, tokens, "torch-softmax-topk", us, None,
                            {"experts": experts, "k": k, "tokens": tokens, "dtype": "bf16",
                             "renormalize": True, "rotation_sets": sets,
                             "routes_per_sample": batch}))
            del inputs

    # GEMM and launch cases (gemm-bf16-N, 40xN-gemm, tiny-launches) live beside this file.
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import kernels_exec

    rows += kernels_exec.collect(args)

    if args.json:
        json.dump(rows, sys.stdout)
        sys.stdout.write("\n")
    else:
        for r in rows:
            print(f"{r['case']:>20} {r['size']:>12} {r['variant']:>20} {r['median']:10.2f} us")


if __name__ == "__main__":
    main()
