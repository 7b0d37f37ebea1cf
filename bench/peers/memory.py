#!/usr/bin/env python3
"""PyTorch peer of warpdrive's `memory` suite (contract: bench/peers/README.md).

Cases (same names and sizes as warpdrive's):
- alloc-free (size = bytes): µs per allocate+free pair, host clock over many pairs, median
  over repeats. `torch-empty` (torch.empty + release from Python) and
  `torch-caching-allocator` (torch.cuda.caching_allocator_alloc / _delete).
- fragmentation-trace (size = allocations): replays the trace file warpdrive wrote (path in
  $WARPDRIVE_MEMORY_TRACE, or --trace PATH) through the caching allocator; median = µs per
  allocation (its free included); extra.reserved_over_peak = peak reserved / peak live
  requested bytes of the trace. Variant `torch-caching-allocator`.
- pinned-alloc-free (size = bytes): `torch-pinned-empty` (torch.empty(pin_memory=True), the
  caching host allocator) + release.
On --device cpu only alloc-free/torch-empty runs (the other cases need CUDA).
"""

import argparse
import json
import os
import sys
import time

from peer_stats import percentile

SUITE = "memory"
KIB, MIB = 1 << 10, 1 << 20
SIZES = [512, 64 * KIB, MIB, 16 * MIB, 256 * MIB]
QUICK_SIZES = SIZES[:4]
TRACE_ENV = "WARPDRIVE_MEMORY_TRACE"


def row(case, size, variant, samples, extra=None):
    s = sorted(samples)
    return {
        "suite": SUITE,
        "case": case,
        "size": int(size),
        "variant": variant,
        "median": percentile(s, 0.5),
        "p10": percentile(s, 0.1),
        "p90": percentile(s, 0.9),
        "unit": "us",
        "gbps": None,
        "tflops": None,
        "pct_of_ceiling": None,
        "extra": extra or {},
    }


def per_pair(pairs, fn):
    t = time.perf_counter()
    for _ in range(pairs):
        fn()
    return (time.perf_counter() - t) * 1e6 / pairs


def samples(repeats, pairs, fn, sync=None):
    fn()  # warm-up: the first pair may reach the driver
    out = []
    for _ in range(repeats):
        out.append(per_pair(pairs, fn))
        if sync:
            sync()
    return out


def log(msg):
    print(f"memory.py: {msg}", file=sys.stderr, flush=True)


def alloc_free(torch, dev, sizes, repeats, pairs):
    rows = []
    cuda = dev.type == "cuda"
    sync = torch.cuda.synchronize if cuda else None
    for size in sizes:
        log(f"alloc-free {size} B")
        t = samples(repeats, pairs, lambda: torch.empty(size, dtype=torch.uint8, device=dev), sync)
        rows.append(row("alloc-free", size, "torch-empty", t,
                        {"timer": "host clock", "pairs_per_sample": pairs}))
        if cuda:
            stream = torch.cuda.current_stream(dev)
            index = dev.index or 0

            def pair():
                p = torch.cuda.caching_allocator_alloc(size, index, stream)
                torch.cuda.caching_allocator_delete(p)

            t = samples(repeats, pairs, pair, sync)
            rows.append(row("alloc-free", size, "torch-caching-allocator", t,
                            {"timer": "host clock", "pairs_per_sample": pairs}))
    return rows


def load_trace(path):
    with open(path) as f:
        trace = json.load(f)
    if trace.get("format") != "warpdrive-alloc-trace/1":
        raise SystemExit(f"memory.py: {path}: not a warpdrive-alloc-trace/1 file")
    ops = trace["ops"]
    live, peak, sizes = 0, 0, {}
    for op in ops:
        if op[0] == "a":
            sizes[op[1]] = op[2]
            live += op[2]
            peak = max(peak, live)
        else:
            live -= sizes[op[1]]
    allocations = sum(1 for op in ops if op[0] == "a")
    return trace, ops, allocations, max(peak, 1)


def fragmentation(torch, dev, path, repeats):
    trace, ops, allocations, peak_live = load_trace(path)
    log(f"fragmentation-trace: {allocations} allocations from {path}")
    index = dev.index or 0
    stream = torch.cuda.current_stream(dev)
    alloc, delete = torch.cuda.caching_allocator_alloc, torch.cuda.caching_allocator_delete
    times, stats = [], None
    for _ in range(repeats):
        torch.cuda.synchronize(dev)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(dev)
        base = torch.cuda.memory_reserved(dev)
        live = {}
        t = time.perf_counter()
        for op in ops:
            if op[0] == "a":
                live[op[1]] = alloc(op[2], index, stream)
            else:
                delete(live.pop(op[1]))
        torch.cuda.synchronize(dev)
        times.append((time.perf_counter() - t) * 1e6 / allocations)
        s = torch.cuda.memory_stats(dev)
        stats = {
            "peak_reserved_bytes": s["reserved_bytes.all.peak"] - base,
            "peak_in_use_bytes": s["allocated_bytes.all.peak"],
            "driver_allocs": s.get("segment.all.allocated", None),
            "driver_frees": s.get("segment.all.freed", None),
        }
    torch.cuda.empty_cache()
    extra = dict(stats)
    extra["reserved_over_peak"] = stats["peak_reserved_bytes"] / peak_live
    extra["peak_live_bytes"] = peak_live
    extra["trace_seed"] = trace.get("seed")
    extra["timer"] = "host clock, µs per allocation incl. its free"
    return [row("fragmentation-trace", allocations, "torch-caching-allocator", times, extra)]


def pinned(torch, sizes, repeats, pairs):
    rows = []
    for size in sizes:
        log(f"pinned-alloc-free {size} B")
        t = samples(repeats, pairs,
                    lambda: torch.empty(size, dtype=torch.uint8, pin_memory=True))
        rows.append(row("pinned-alloc-free", size, "torch-pinned-empty", t,
                        {"timer": "host clock", "pairs_per_sample": pairs}))
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="print rows as JSON on stdout")
    ap.add_argument("--device", default="cuda:0", help="cpu or cuda:N")
    ap.add_argument("--quick", action="store_true", help="warpdrive's smaller sizes")
    ap.add_argument("--trace", help=f"trace file (default: ${TRACE_ENV})")
    args = ap.parse_args()

    import torch

    dev = torch.device(args.device)
    sizes = QUICK_SIZES if args.quick else SIZES
    repeats, pairs = (7, 2000) if args.quick else (9, 20000)
    rows = alloc_free(torch, dev, sizes, repeats, pairs)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
        path = args.trace or os.environ.get(TRACE_ENV)
        if path:
            rows += fragmentation(torch, dev, path, 3)
        else:
            log(f"no trace (set ${TRACE_ENV} or --trace): fragmentation-trace skipped")
        rows += pinned(torch, sizes, repeats, pairs)
    if args.json:
        print(json.dumps(rows))
    else:
        for r in rows:
            print(f"{r['case']:<22}{r['size']:>12}  {r['variant']:<26}{r['median']:>10.3f} us  "
                  f"{json.dumps(r['extra'])}")


if __name__ == "__main__":
    main()
