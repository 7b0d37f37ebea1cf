#!/usr/bin/env python3
"""KvikIO peer of warpdrive's `tier` suite (contract: bench/peers/README.md).

Case (same name and sizes as warpdrive's):
- migrate-disk-gpu (size = bytes): a block from a file on disk into GPU memory, the file's
  pages dropped from the page cache before every read (posix_fadvise DONTNEED), host clock
  from the read's start to the device holding the bytes. Variant `kvikio` (`CuFile.read`
  into a CuPy array: cuFile where the host has GPUDirect Storage, else KvikIO's POSIX
  compatibility mode; extra.compat_mode says which). The file lives in the same temporary
  folder as warpdrive's store, so both read the same file system.

KvikIO is not part of the GPU hosts' image: its wheels travel with the call (the device
README) and sit on PYTHONPATH. Without it, or without a GPU, the script prints no rows and
says why on stderr.
"""

import argparse
import json
import os
import random
import sys
import tempfile
import time

from peer_stats import timed_row

SUITE = "tier"
KIB, MIB = 1 << 10, 1 << 20
SIZES = [64 * KIB, 4 * MIB, 64 * MIB]
QUICK_SIZES = SIZES[:2]
REPS, QUICK_REPS = 30, 10


def log(msg):
    print(f"tier.py: {msg}", file=sys.stderr, flush=True)


def row(size, samples, extra):
    return timed_row(SUITE, "migrate-disk-gpu", size, "kvikio", samples, extra)


def drop_pages(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--json", action="store_true")
    p.add_argument("--device", default="cuda:0")
    p.add_argument("--quick", action="store_true")
    args = p.parse_args()
    rows = []
    if not args.device.startswith("cuda"):
        log("no GPU: no KvikIO rows")
    else:
        try:
            import cupy
            import kvikio
            import kvikio.defaults
        except Exception as e:  # an absent wheel is a note, not a failure
            log(f"KvikIO is not importable ({e}): no rows")
        else:
            index = int(args.device.split(":")[1]) if ":" in args.device else 0
            cupy.cuda.Device(index).use()
            compat = str(getattr(kvikio.defaults, "compat_mode", lambda: "unknown")())
            sizes, reps = (QUICK_SIZES, QUICK_REPS) if args.quick else (SIZES, REPS)
            rng = random.Random(0x7133)
            with tempfile.TemporaryDirectory(prefix="warpdrive-kvikio-") as d:
                for size in sizes:
                    log(f"migrate-disk-gpu {size} B")
                    path = os.path.join(d, f"block-{size}")
                    with open(path, "wb") as f:
                        f.write(rng.randbytes(size))
                    buf = cupy.empty(size, dtype=cupy.uint8)
                    t = []
                    with kvikio.CuFile(path, "r") as f:
                        for i in range(reps + 1):
                            drop_pages(path)
                            start = time.perf_counter()
                            n = f.read(buf)
                            cupy.cuda.runtime.deviceSynchronize()
                            if n != size:
                                raise SystemExit(f"tier.py: read {n} of {size} bytes")
                            if i > 0:
                                t.append((time.perf_counter() - start) * 1e6)
                    rows.append(row(size, t, {"timer": "host clock", "compat_mode": compat,
                                              "page_cache": "dropped (posix_fadvise)"}))
    print(json.dumps({"rows": rows}))


if __name__ == "__main__":
    main()
