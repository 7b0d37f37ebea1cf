#!/usr/bin/env python3
"""torch.distributed peer of warpdrive's `dist` suite (contract: bench/peers/README.md).

Cases (same names and sizes as warpdrive's NCCL rows), over every GPU of the host, one
process a GPU started as torchrun starts them (MASTER_ADDR / MASTER_PORT, NCCL backend,
NCCL_NVLS_ENABLE=0), variant `torch-distributed`:
- nccl-all-reduce (size = bytes of float32 per rank): in-place sum, µs per call from CUDA
  events around a run of calls, the slowest rank's, each round; extra.bus_gbps in the
  nccl-tests convention (none for one rank).
- nccl-call (size 8 B): host µs per `dist.all_reduce` of a run of 8-byte calls enqueued back
  to back.
- peer-copy (size = bytes; two GPUs or more), variant `torch-copy`: `Tensor.copy_` from
  cuda:0 into a tensor on cuda:1, µs per copy from events on cuda:1's stream around a run of
  copies (PyTorch turns peer access on where the GPUs have it).
Without a GPU the script prints no rows and says why on stderr.
"""

import argparse
import json
import os
import socket
import sys
import time

from peer_stats import percentile, timed_row

SUITE = "dist"
KIB, MIB, GIB = 1 << 10, 1 << 20, 1 << 30
SIZES = [8, KIB, 64 * KIB, MIB, 16 * MIB, 64 * MIB, 256 * MIB, GIB]
QUICK_SIZES = [8, 64 * KIB, 16 * MIB]
ROUNDS, QUICK_ROUNDS = 10, 3
CALLS_8B = 1000


def log(msg):
    print(f"dist.py: {msg}", file=sys.stderr, flush=True)


def row(case, size, samples, extra):
    return timed_row(SUITE, case, size, "torch-distributed", samples, extra)


def rank_main(rank, world, port, sizes, rounds, out_path):
    import torch
    import torch.distributed as dist

    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        NCCL_NVLS_ENABLE="0",
    )
    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=dev)

    def slowest(us):
        t = torch.tensor([us], dtype=torch.float64, device=dev)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t.item())

    rows = []
    # Host cost of a call: 8-byte all-reduces back to back.
    x = torch.randn(2, device=dev)
    samples = []
    for r in range(rounds + 1):
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(CALLS_8B):
            dist.all_reduce(x)
        us = (time.perf_counter() - t0) * 1e6 / CALLS_8B
        torch.cuda.synchronize(dev)
        us = slowest(us)
        if r > 0:
            samples.append(us)
    rows.append(row("nccl-call", 8, samples, {"ranks": world}))
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for size in sizes:
        calls = max(1, min(20, (64 * MIB) // size))
        buf = torch.randn(size // 4, device=dev)
        samples = []
        for r in range(rounds + 1):
            dist.barrier()
            start.record()
            for _ in range(calls):
                dist.all_reduce(buf)
            end.record()
            end.synchronize()
            us = slowest(start.elapsed_time(end) * 1e3 / calls)
            if r > 0:
                samples.append(us)
        extra = {"ranks": world}
        med = percentile(sorted(samples), 0.5)
        if world > 1 and med > 0:
            extra["bus_gbps"] = size / (med * 1e3) * 2 * (world - 1) / world
        rows.append(row("nccl-all-reduce", size, samples, extra))
        del buf
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(rows, f)
    dist.destroy_process_group()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--json", action="store_true")
    p.add_argument("--device", default="cuda:0")
    p.add_argument("--quick", action="store_true")
    args = p.parse_args()
    rows = []
    if not args.device.startswith("cuda"):
        log("no GPU: no torch.distributed rows")
    else:
        import tempfile

        import torch
        import torch.multiprocessing as mp

        world = max(1, torch.cuda.device_count())
        sizes = QUICK_SIZES if args.quick else SIZES
        rounds = QUICK_ROUNDS if args.quick else ROUNDS
        with tempfile.TemporaryDirectory() as d:
            out = os.path.join(d, "rows.json")
            log(f"torch.distributed (NCCL) over {world} GPU(s)")
            mp.spawn(
                rank_main,
                args=(world, free_port(), sizes, rounds, out),
                nprocs=world,
                join=True,
            )
            with open(out) as f:
                rows = json.load(f)
        if world >= 2:
            rows += peer_copy_rows(torch, args.quick)
    print(json.dumps(rows))


def peer_copy_rows(torch, quick):
    sizes = [MIB, 64 * MIB] if quick else [MIB, 64 * MIB, 256 * MIB, GIB]
    rounds = QUICK_ROUNDS if quick else ROUNDS
    rows = []
    for size in sizes:
        src = torch.rand(size // 4, device="cuda:0")
        dst = torch.empty(size // 4, device="cuda:1")
        calls = max(1, min(20, 256 * MIB // size))
        with torch.cuda.device(1):
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            us = []
            for r in range(rounds + 1):
                start.record()
                for _ in range(calls):
                    dst.copy_(src, non_blocking=True)
                end.record()
                end.synchronize()
                if r > 0:
                    us.append(start.elapsed_time(end) * 1e3 / calls)
        if not torch.equal(dst.cpu(), src.cpu()):
            raise SystemExit("peer-copy: torch's copy differs from its source")
        rows.append(timed_row(SUITE, "peer-copy", size, "torch-copy", us, {}))
    return rows


if __name__ == "__main__":
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    main()
