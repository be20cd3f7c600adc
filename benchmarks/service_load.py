"""Service load: CLIENTS concurrent clients on loopback for DURATION_S seconds, each asking
`POST /v1/plans` for llama3-70b on 8 DGX H100 nodes (seq 8192, global batch 256) as fast as the
answers come back, against a real `berth serve` (uvicorn) with its SQLite store in a temp dir.
Prints and saves requests/s, p50/p90/p99 latency and the error count to
benchmarks/results/service_load.json.

Target on the 2-core CI machine: p99 under 250 ms, no errors. The clients run in this process
(asyncio + httpx) on the same two cores as the server, so the figures include that contention.

Two runs: the server as shipped (repeated questions are answered from its plan cache; every answer
still gets its own id and stored row), and with the cache off (BERTH_PLAN_CACHE_SIZE=0: every
request runs the full search of 24,495 layouts), so the cost of a cold search is on record too.

    python -m benchmarks.service_load [--clients 32] [--duration 20] [--workers 1]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

BODY = {"model": "llama3-70b", "training": {"seq_len": 8192, "global_batch_size": 256},
        "cluster": {"preset": "dgx-h100", "nodes": 8}, "search": {"top": 5}}
OUT = Path(__file__).parent / "results" / "service_load.json"


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(workers: int, store: Path, cache: bool) -> tuple[subprocess.Popen, str]:
    port = _port()
    env = {**os.environ, "BERTH_STORE_PATH": str(store)}
    if not cache:
        env["BERTH_PLAN_CACHE_SIZE"] = "0"
    proc = subprocess.Popen([sys.executable, "-m", "planner.cli", "serve", "--port", str(port),
                             "--workers", str(workers)], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    for _ in range(150):
        try:
            if httpx.get(url + "/healthz", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            time.sleep(0.2)
    proc.kill()
    raise SystemExit("server did not start")


def _request_bytes(host: str, port: int) -> bytes:
    body = json.dumps(BODY).encode()
    head = (f"POST /v1/plans HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nConnection: keep-alive\r\n\r\n")
    return head.encode() + body


async def client(host: str, port: int, stop_at: float, latencies: list[float], errors: list[str]) -> None:
    """One keep-alive HTTP/1.1 connection sending requests back to back. Hand-rolled on asyncio
    streams: an httpx AsyncClient costs about 4 ms of client CPU per request here, enough to make
    the load generator, not the server, the bottleneck on two cores."""
    request = _request_bytes(host, port)
    reader, writer = await asyncio.open_connection(host, port)
    try:
        while time.perf_counter() < stop_at:
            t0 = time.perf_counter()
            writer.write(request)
            await writer.drain()
            head = await reader.readuntil(b"\r\n\r\n")
            status = int(head.split(b" ", 2)[1])
            length = next(int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                          if line.lower().startswith(b"content-length:"))
            body = await reader.readexactly(length)
            if status != 200:
                errors.append(f"{status}: {body[:200]!r}")
                continue
            latencies.append(time.perf_counter() - t0)
    except (OSError, asyncio.IncompleteReadError) as err:
        errors.append(repr(err))
    finally:
        writer.close()


async def load(url: str, clients: int, duration: float) -> dict:
    host, port = url.removeprefix("http://").split(":")
    async with httpx.AsyncClient(base_url=url, timeout=60) as c:
        r = await c.post("/v1/plans", json=BODY)  # warm-up: imports, first search
        assert r.status_code == 200 and json.loads(r.text)["plans"], r.text[:500]
    latencies: list[float] = []
    errors: list[str] = []
    start = time.perf_counter()
    await asyncio.gather(*(client(host, int(port), start + duration, latencies, errors) for _ in range(clients)))
    wall = time.perf_counter() - start
    q = statistics.quantiles(latencies, n=100)
    return {"requests": len(latencies), "errors": len(errors), "error_samples": errors[:5],
            "requests_per_s": len(latencies) / wall, "p50_ms": q[49] * 1e3, "p90_ms": q[89] * 1e3,
            "p99_ms": q[98] * 1e3, "max_ms": max(latencies) * 1e3, "wall_s": wall}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--duration", type=float, default=20.0)
    ap.add_argument("--workers", type=int, default=1)
    args = ap.parse_args()
    runs = {}
    for name, cache in (("as_shipped", True), ("cache_off", False)):
        with tempfile.TemporaryDirectory() as tmp:
            proc, url = start_server(args.workers, Path(tmp) / "store.sqlite", cache)
            try:
                runs[name] = asyncio.run(load(url, args.clients, args.duration))
            finally:
                proc.terminate()
                proc.wait(timeout=10)
        r = runs[name]
        print(f"{name:10s} {args.clients} clients, {args.duration:.0f} s, {args.workers} server worker(s): "
              f"{r['requests_per_s']:.1f} req/s, p50 {r['p50_ms']:.0f} ms, p90 {r['p90_ms']:.0f} ms, "
              f"p99 {r['p99_ms']:.0f} ms, errors {r['errors']}")
    result = {**runs["as_shipped"], "runs": runs, "clients": args.clients, "duration_s": args.duration,
              "server_workers": args.workers, "request": BODY,
              "machine": {"cpu_count": os.cpu_count(), "python": platform.python_version(),
                          "platform": platform.platform()},
              "target": {"p99_ms": 250, "errors": 0}}
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
