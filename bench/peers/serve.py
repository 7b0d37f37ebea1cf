#!/usr/bin/env python3
"""PyTorch peer of warpdrive's `serve` suite (issue 37; contract: bench/peers/README.md).

A plain-asyncio HTTP/1.1 service (no aiohttp: the standard library alone, so it runs
wherever PyTorch does) with ONE batcher worker around PyTorch's grouped-GEMM MoE layer
(moe.py's torch-grouped-mm forward: torch._grouped_mm, or its loop-of-matmuls emulation on
the CPU), with the batching rule of warpdrive's service: a batch closes at MAX_ROWS rows or
as soon as the worker is free (it takes what is queued then), or, given a MAX_DELAY, when
its first job has waited that long; the forward runs in a thread so the event loop
keeps accepting and parsing while the device works; each job gets its own rows back.
Clients are coroutines of the same process (as warpdrive's are threads of its process),
each with one keep-alive connection, sending jobs back to back (a closed loop): one-row jobs
as JSON `{"rows": R, "data": [...]}`, 256-row jobs as warpdrive's binary tensor body
(`application/x-warpdrive-tensor`: the 16-byte `WDT1` header, then little-endian f32), as
warpdrive's suite sends them, so both services parse the same bodies. Replies come in the
request's format. Rows travel as bytes of little-endian f32 inside the service (a binary
body is used as it came; a JSON one is packed once).

Model: qwen3-30b-a3b's layer (hidden 2048, intermediate 768, 128 experts, top-8) in bf16,
weights N(0,1)/sqrt(fan_in), seeded; with --quick (warpdrive ran on its CPU backend, where
its suite serves the `tiny` scale) hidden and intermediate / 16 (128, 48), as warpdrive's.

Rows (case, size as warpdrive's suite names them):
  load-1row    size = clients 1 / 8 / 32, one-row jobs
  load-256row  size = clients 1 / 8, 256-row jobs
variants torch-asyncio-batch-1 (MAX_ROWS 1) and torch-asyncio-dynamic (256 rows or when the
worker is free, as warpdrive-dynamic); µs per job as its client saw it (median, p10, p90), extra jobs_per_s, p99_us,
p999_us, mean_batch_rows, failed, workers (1), load_s. Each run lasts 0.5 s (--quick) or
2 s, after a short warm-up.

`python3 serve.py --self-test` runs the service and the clients on a pure-Python model
(no torch) and checks that every job gets its own rows back, batches form, bad requests get
a 400 and the rest are served; it ends with 'N passed, N failed'.
"""

import argparse
import asyncio
import json
import math
import os
import struct
import sys
import time
from array import array

from peer_stats import percentile, timed_row

SUITE = "serve"
PRESET = ("qwen3-30b-a3b", 2048, 768, 128, 8)
SEED = 37
WAIT_S = 30.0  # the longest any one wait may take
MAX_BODY = 64 << 20
# (name, MAX_ROWS, MAX_DELAY: None closes a batch as soon as the worker is free)
VARIANTS = [("torch-asyncio-batch-1", 1, None), ("torch-asyncio-dynamic", 256, None)]
CLIENTS, CLIENTS_256 = [1, 8, 32], [1, 8]
TENSOR_TYPE = "application/x-warpdrive-tensor"
MAGIC = b"WDT1"


def log(msg):
    print(f"serve.py: {msg}", file=sys.stderr, flush=True)


# ---- the service ----


class Job:
    __slots__ = ("rows", "data", "arrived", "future")

    def __init__(self, rows, data, arrived, future):
        self.rows, self.data, self.arrived, self.future = rows, data, arrived, future


class Batcher:
    """One worker: a batch closes at max_rows rows, or as soon as the worker is free (what
    is queued then) when max_delay is None, else when its first job has waited max_delay;
    the model runs in a thread; each job is answered with its own rows."""

    def __init__(self, model, width, max_rows, max_delay, queue_jobs=4096):
        self.model, self.width = model, width
        self.max_rows, self.max_delay = max_rows, max_delay
        self.queue = asyncio.Queue(maxsize=queue_jobs)
        self.carried = None

    def submit(self, job):
        self.queue.put_nowait(job)  # raises asyncio.QueueFull: the caller answers 503

    async def run(self):
        loop = asyncio.get_running_loop()
        while True:
            first, self.carried = self.carried, None
            if first is None:
                first = await self.queue.get()
            due = loop.time() if self.max_delay is None else first.arrived + self.max_delay
            batch, rows = [first], first.rows
            while rows < self.max_rows:
                left = due - loop.time()
                try:
                    job = (self.queue.get_nowait() if left <= 0
                           else await asyncio.wait_for(self.queue.get(), left))
                except (asyncio.QueueEmpty, asyncio.TimeoutError):
                    break
                if rows + job.rows > self.max_rows:
                    self.carried = job
                    break
                batch.append(job)
                rows += job.rows
            batch = [j for j in batch if not j.future.done()]  # clients that left
            if not batch:
                continue
            flat = b"".join(j.data for j in batch)
            try:
                out = await loop.run_in_executor(None, self.model, flat, rows)
            except Exception as e:  # the model failed: every job of the batch says so
                for j in batch:
                    if not j.future.done():
                        j.future.set_exception(e)
                continue
            at = 0
            for j in batch:
                n = j.rows * self.width * 4
                if not j.future.done():
                    j.future.set_result((out[at:at + n], rows))
                at += n


async def read_request(reader):
    """(method, path, headers, body) of one request, or None at the end of the connection."""
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), WAIT_S)
    lines = head.decode("latin-1").split("\r\n")
    parts = lines[0].split(" ")
    if len(parts) != 3:
        raise ValueError(f"request line {lines[0]!r}")
    headers = {}
    for line in lines[1:]:
        if ":" in line:
            k, v = line.split(":", 1)
            headers[k.strip().lower()] = v.strip()
    n = int(headers.get("content-length", "0"))
    if n < 0 or n > MAX_BODY:
        raise ValueError(f"a body of {n} bytes")
    body = await asyncio.wait_for(reader.readexactly(n), WAIT_S) if n else b""
    return parts[0], parts[1], headers, body


def response(status, body, content_type="text/plain", batch_rows=None):
    reason = {200: "OK", 400: "Bad Request", 404: "Not Found", 503: "Service Unavailable",
              500: "Internal Server Error"}.get(status, "Error")
    extra = "" if batch_rows is None else f"x-warpdrive-batch-rows: {batch_rows}\r\n"
    return (f"HTTP/1.1 {status} {reason}\r\nContent-Type: {content_type}\r\n{extra}"
            f"Content-Length: {len(body)}\r\n\r\n").encode("latin-1") + body


def decode_json(body, width):
    """(rows, the rows as little-endian f32 bytes) of a JSON job."""
    job = json.loads(body)
    rows, data = int(job["rows"]), [float(v) for v in job["data"]]
    if rows < 1 or len(data) != rows * width:
        raise ValueError(f"{len(data)} values are not {rows} rows of {width}")
    if not all(math.isfinite(v) for v in data):
        raise ValueError("a value is not finite")
    return rows, array("f", data).tobytes()


def decode_tensor(body, width):
    """(rows, the rows as little-endian f32 bytes) of a binary tensor job (f32 only)."""
    if len(body) < 16 or body[:4] != MAGIC or body[4] != 1:
        raise ValueError("not an f32 WDT1 tensor")
    rows, w = struct.unpack_from("<II", body, 8)
    if rows < 1 or w != width or len(body) != 16 + rows * w * 4:
        raise ValueError(f"a {rows} x {w} tensor in {len(body)} bytes for rows of {width}")
    data = body[16:]
    if not all(math.isfinite(v) for v in memoryview(data).cast("f")):
        raise ValueError("a value is not finite")
    return rows, data


def tensor_body(rows, width, data):
    return MAGIC + bytes([1, 0, 0, 0]) + struct.pack("<II", rows, width) + data


async def handle(batcher, reader, writer):
    loop = asyncio.get_running_loop()
    try:
        while True:
            try:
                req = await read_request(reader)
            except (asyncio.IncompleteReadError, ConnectionError, asyncio.TimeoutError):
                return
            except (ValueError, asyncio.LimitOverrunError) as e:
                writer.write(response(400, f"{e}\n".encode()))
                await writer.drain()
                return
            method, path, headers, body = req
            binary = headers.get("content-type", "").split(";")[0].strip() == TENSOR_TYPE
            if method != "POST" or path != "/v1/jobs":
                writer.write(response(404, b"no such endpoint: POST /v1/jobs\n"))
                await writer.drain()
                continue
            try:
                rows, data = (decode_tensor if binary else decode_json)(body, batcher.width)
            except (ValueError, KeyError, TypeError, struct.error) as e:
                writer.write(response(400, f"not a job: {e}\n".encode()))
                await writer.drain()
                continue
            fut = loop.create_future()
            try:
                batcher.submit(Job(rows, data, loop.time(), fut))
            except asyncio.QueueFull:
                writer.write(response(503, b"the queue is full\n"))
                await writer.drain()
                continue
            try:
                out, batch_rows = await asyncio.wait_for(fut, WAIT_S)
                if binary:
                    reply = tensor_body(rows, batcher.width, out)
                    writer.write(response(200, reply, TENSOR_TYPE, batch_rows))
                else:
                    values = array("f", out).tolist()
                    reply = json.dumps({"rows": rows, "data": values, "batch_rows": batch_rows})
                    writer.write(response(200, reply.encode(), "application/json"))
            except asyncio.TimeoutError:
                writer.write(response(503, b"the job did not finish in time\n"))
            except Exception as e:  # the model's error
                writer.write(response(500, f"{e}\n".encode()))
            await writer.drain()
    finally:
        writer.close()


async def start_service(model, width, max_rows, max_delay):
    """(server, port, batcher task) on a free loopback port."""
    batcher = Batcher(model, width, max_rows, max_delay)
    task = asyncio.create_task(batcher.run())
    server = await asyncio.start_server(lambda r, w: handle(batcher, r, w), "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1], task


# ---- the clients ----


async def post(reader, writer, body):
    """(status, reply body, its batch rows) of one POST /v1/jobs on a kept-alive
    connection; a body that starts with the tensor magic goes as a tensor."""
    ctype = TENSOR_TYPE if body[:4] == MAGIC else "application/json"
    writer.write(f"POST /v1/jobs HTTP/1.1\r\nHost: x\r\nContent-Type: {ctype}\r\n"
                 f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    await writer.drain()
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), WAIT_S)
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split(" ")[1])
    n, batch_rows = 0, None
    for line in lines[1:]:
        k, _, v = line.partition(":")
        if k.lower() == "content-length":
            n = int(v)
        elif k.lower() == "x-warpdrive-batch-rows":
            batch_rows = int(v)
    reply = await asyncio.wait_for(reader.readexactly(n), WAIT_S)
    if status == 200 and batch_rows is None:
        batch_rows = json.loads(reply)["batch_rows"]
    return status, reply, batch_rows


async def closed_loop(port, clients, body, seconds):
    """`clients` coroutines posting `body` back to back for `seconds`: (µs per job, the
    sum of the batch sizes, failures by status)."""
    stop = time.perf_counter() + seconds
    lat, rows, failed = [], [0], {}

    async def one():
        reader, writer = await asyncio.wait_for(
            asyncio.open_connection("127.0.0.1", port), WAIT_S)
        try:
            while time.perf_counter() < stop:
                t = time.perf_counter()
                status, _, batch_rows = await post(reader, writer, body)
                if status != 200:
                    failed[str(status)] = failed.get(str(status), 0) + 1
                    continue
                lat.append((time.perf_counter() - t) * 1e6)
                rows[0] += batch_rows
        finally:
            writer.close()

    t0 = time.perf_counter()
    done = await asyncio.gather(*(one() for _ in range(clients)), return_exceptions=True)
    elapsed = time.perf_counter() - t0
    for d in done:
        if isinstance(d, BaseException):
            failed["io"] = failed.get("io", 0) + 1
    return lat, rows[0], failed, elapsed


def job_body(rows, width, seed, binary=False):
    # Seeded values in [-1, 1); the model's work does not depend on them.
    vals = [((i * 2654435761 + seed) % 1000) / 500.0 - 1.0 for i in range(rows * width)]
    if binary:
        return tensor_body(rows, width, array("f", vals).tobytes())
    return json.dumps({"rows": rows, "data": vals}).encode()


# ---- the model ----


def torch_model(device_name, quick):
    """(forward(rows as little-endian f32 bytes, rows) -> the same, width) of the
    grouped-GEMM MoE layer."""
    import torch
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from moe import grouped_forward, grouped_mm_for
    _, hidden, inter, n_exp, k = PRESET
    if quick:
        hidden, inter = hidden // 16, inter // 16
    device = torch.device(device_name)
    gmm, emulated = grouped_mm_for(torch, device)
    if gmm is None:
        raise RuntimeError("no grouped GEMM on this device")
    gen = torch.Generator(device="cpu").manual_seed(SEED)

    def normal(shape, fan_in):
        return (torch.randn(shape, generator=gen) / math.sqrt(fan_in)).bfloat16().to(device)

    gate = normal((n_exp, hidden), hidden)
    w1, w3 = normal((n_exp, hidden, inter), hidden), normal((n_exp, hidden, inter), hidden)
    w2 = normal((n_exp, inter, hidden), inter)

    def forward(flat, rows):
        with torch.inference_mode():
            x = torch.frombuffer(bytearray(flat), dtype=torch.float32).view(rows, hidden)
            x = x.to(device=device, dtype=torch.bfloat16, non_blocking=False)
            y = grouped_forward(torch, gmm, x, gate, w1, w3, w2, k)
            return y.float().cpu().contiguous().numpy().tobytes()

    return forward, hidden, emulated


# ---- the run ----


async def run_variant(model, width, variant, max_rows, max_delay, seconds, extra):
    server, port, task = await start_service(model, width, max_rows, max_delay)
    rows_out = []
    try:
        await closed_loop(port, 1, job_body(1, width, 0), min(seconds, 0.3))  # warm-up
        for case, job_rows, clients_list in (("load-1row", 1, CLIENTS),
                                             ("load-256row", 256, CLIENTS_256)):
            body = job_body(job_rows, width, 1, binary=job_rows > 1)
            for clients in clients_list:
                lat, batch_rows, failed, elapsed = await closed_loop(port, clients, body, seconds)
                if not lat:
                    log(f"{variant} {case} {clients}: no job answered ({failed})")
                    continue
                s = sorted(lat)
                r = timed_row(SUITE, case, clients, variant, lat, dict(extra))
                r["gbps"] = None
                r["extra"].update({
                    "jobs_per_s": len(lat) / elapsed,
                    "p99_us": percentile(s, 0.99),
                    "p999_us": percentile(s, 0.999),
                    "mean_batch_rows": batch_rows / len(lat),
                    "failed": sum(failed.values()),
                    "workers": 1,
                    "load_s": seconds,
                    "body": "tensor" if job_rows > 1 else "json",
                })
                rows_out.append(r)
                log(f"{variant} {case} clients {clients}: {len(lat) / elapsed:.0f} jobs/s, "
                    f"p50 {percentile(s, 0.5):.0f} us, p99 {percentile(s, 0.99):.0f} us")
    finally:
        server.close()
        task.cancel()
        try:
            await asyncio.wait_for(server.wait_closed(), WAIT_S)
        except (asyncio.TimeoutError, asyncio.CancelledError):
            pass
    return rows_out


async def run_all(device, quick):
    model, width, emulated = torch_model(device, quick)
    seconds = 0.5 if quick else 2.0
    extra = {"model": f"{PRESET[0]}{'/16' if quick else ''}", "emulated": emulated}
    rows = []
    for variant, max_rows, max_delay in VARIANTS:
        rows += await run_variant(model, width, variant, max_rows, max_delay, seconds, extra)
    return rows


# ---- the self-test (no torch) ----


async def self_test():
    passed, failed = 0, 0

    def check(ok, what):
        nonlocal passed, failed
        passed, failed = passed + bool(ok), failed + (not ok)
        if not ok:
            log(f"FAILED: {what}")

    def double(flat, rows):
        time.sleep(0.002)
        return array("f", [2.0 * v for v in array("f", flat)]).tobytes()

    server, port, task = await start_service(double, 2, 256, 0.01)

    async def one(k, port=port):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        data = [float(k), -float(k)]
        status, reply, _ = await post(reader, writer, json.dumps({"rows": 1, "data": data}).encode())
        writer.close()
        return status, json.loads(reply) if status == 200 else reply, data

    results = await asyncio.gather(*(one(k) for k in range(16)))
    check(all(s == 200 for s, _, _ in results), "every job answered")
    check(all(r["data"] == [2 * v for v in d] for s, r, d in results if s == 200),
          "each job gets its own rows")
    check(any(r["batch_rows"] > 1 for s, r, _ in results if s == 200), "batches form")
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    for bad in [b"{not json", b'{"rows": 2, "data": [1, 2, 3]}', b'{"rows": 1, "data": [1e999, 1]}']:
        status, _, _ = await post(reader, writer, bad)
        check(status == 400, f"400 for {bad!r}")
    status, _, _ = await post(reader, writer, b'{"rows": 1, "data": [1, 2]}')
    check(status == 200, "served after bad requests on the same connection")
    status, reply, _ = await post(reader, writer, job_body(2, 2, 0, binary=True))
    got = list(memoryview(reply[16:]).cast("f")) if status == 200 else None
    want = [2 * v for v in memoryview(job_body(2, 2, 0, binary=True)[16:]).cast("f")]
    check(got == want and reply[:4] == MAGIC, "a tensor job gets its rows back as a tensor")
    bad = tensor_body(2, 2, array("f", [1.0, 2.0, 3.0]).tobytes())
    status, _, _ = await post(reader, writer, bad)
    check(status == 400, "400 for a tensor of the wrong size")
    writer.close()
    lat, rows, fails, _ = await closed_loop(port, 4, job_body(1, 2, 0), 0.3)
    check(lat and not fails and rows >= len(lat), f"a closed loop: {len(lat)} jobs, {fails}")
    server.close()
    task.cancel()
    # When the worker is free it takes what is queued: jobs that came while a batch ran
    # leave together.
    server, idle_port, task = await start_service(double, 2, 256, None)
    results = await asyncio.gather(*(one(k, idle_port) for k in range(16)))
    check(all(s == 200 for s, _, _ in results), "every job answered (when idle)")
    check(any(r["batch_rows"] > 1 for s, r, _ in results if s == 200), "batches form (when idle)")
    server.close()
    task.cancel()
    print(f"{passed} passed, {failed} failed")
    return failed == 0


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", action="store_true")
    p.add_argument("--device", default="cpu")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--self-test", action="store_true")
    args = p.parse_args()
    if args.self_test:
        sys.exit(0 if asyncio.run(self_test()) else 1)
    rows = asyncio.run(run_all(args.device, args.quick))
    if args.json:
        print(json.dumps(rows))
    else:
        for r in rows:
            e = r["extra"]
            print(f"{r['case']:>12} {r['size']:>3} {r['variant']:>22} median {r['median']:9.0f} us"
                  f"  p99 {e['p99_us']:9.0f} us  {e['jobs_per_s']:8.0f} jobs/s"
                  f"  {e['mean_batch_rows']:6.1f} rows a batch")


if __name__ == "__main__":
    main()
