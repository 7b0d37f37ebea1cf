#!/usr/bin/env python3
"""PyTorch peer of warpdrive's `transfer` suite (contract: bench/peers/README.md).

Cases `h2d` and `d2h` (size = bytes, 4 KiB to 1 GiB in x4 steps; up to 16 MiB with
--quick), host clock around each copy including its synchronisation:
- `torch-pageable`: copy_ between a CUDA tensor and an ordinary (pageable) CPU tensor.
- `torch-pinned-nonblocking`: copy_(non_blocking=True) from/to a pinned CPU tensor, then
  synchronize.
- `torch-cpu` (d2h only): `tensor.cpu()`, a freshly allocated CPU tensor each time.
CUDA only (on --device cpu there is no transfer to time; no rows).
"""

import argparse
import json
import sys
import time

from peer_stats import percentile

SUITE = "transfer"
KIB, MIB = 1 << 10, 1 << 20


def sizes(quick):
    top = 16 * MIB if quick else 1 << 30
    out, s = [], 4 * KIB
    while s <= top:
        out.append(s)
        s *= 4
    return out


def reps(n):
    return 9 if n >= 256 * MIB else 10 if n >= 16 * MIB else 30


def row(case, size, variant, samples, ceiling):
    s = sorted(samples)
    med = percentile(s, 0.5)
    return {
        "suite": SUITE, "case": case, "size": int(size), "variant": variant,
        "median": med, "p10": percentile(s, 0.1), "p90": percentile(s, 0.9), "unit": "us",
        "gbps": size / (med * 1e3), "tflops": None, "pct_of_ceiling": None,
        "extra": {"ceiling": ceiling},
    }


def timed(torch, n, fn):
    fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        out.append((time.perf_counter() - t) * 1e6)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--quick", action="store_true")
    a = ap.parse_args()
    import torch

    rows = []
    if a.device.startswith("cuda") and torch.cuda.is_available():
        dev = torch.device(a.device)
        torch.manual_seed(0x7a)
        for n in sizes(a.quick):
            print(f"transfer.py: {n} bytes", file=sys.stderr, flush=True)
            r = reps(n)
            host = torch.randint(0, 256, (n,), dtype=torch.uint8)
            pinned = host.pin_memory()
            gpu = torch.empty(n, dtype=torch.uint8, device=dev)
            h2d, d2h = "h2d_pinned_gbps", "d2h_pinned_gbps"
            rows.append(row("h2d", n, "torch-pageable", timed(torch, r, lambda: gpu.copy_(host)), h2d))
            rows.append(row("h2d", n, "torch-pinned-nonblocking",
                            timed(torch, r, lambda: gpu.copy_(pinned, non_blocking=True)), h2d))
            rows.append(row("d2h", n, "torch-pageable", timed(torch, r, lambda: host.copy_(gpu)), d2h))
            rows.append(row("d2h", n, "torch-pinned-nonblocking",
                            timed(torch, r, lambda: pinned.copy_(gpu, non_blocking=True)), d2h))
            rows.append(row("d2h", n, "torch-cpu", timed(torch, r, lambda: gpu.cpu()), d2h))
            del host, pinned, gpu
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
