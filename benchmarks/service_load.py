"""Service load: CLIENTS concurrent clients on loopback for DURATION_S seconds, each asking
`POST /v1/plans` for llama3-70b on 8 DGX H100 nodes (seq 8192, global batch 256) as fast as the
answers come back, against a real `berth serve` (uvicorn) with its SQLite store in a temp dir.
Prints and saves requests/s, p50/p90/p99 latency and the error count to
benchmarks/results/service_load.json.

Target on the 2-core CI machine: p99 under 250 ms, no errors. The clients run in this process
(asyncio + httpx) on the same two cores as the server, so the figures include that contention.

Three runs, each against a fresh server:

- cache_hit: the server as shipped; repeated questions are answered from its plan cache (every
  answer still gets its own id; its JSON is stored once, each id is a pointer to it);
- cache_miss: the cache off (BERTH_PLAN_CACHE_SIZE=0): every request runs the full search of
  47,253 layouts, so the cost of a cold search is on record (32 clients on 2 search threads: the
  queue is full most of the time, and the excess is answered 429 at once, counted apart);
- abuse: the cache_hit traffic beside an attacker: ABUSERS clients sending 8,191-node dgx-h100
  requests back to back, and another process holding the SQLite write lock (BEGIN EXCLUSIVE) for
  LOCK_HOLD_S of every LOCK_PERIOD_S; a poller asks /healthz every 20 ms. Printed: /healthz p99
  and the normal requests' p99 (targets 100 ms and 500 ms), and how the abusive requests ended.
  While the lock is held no answer can be stored: normal requests then end in 503 within the
  budget (BERTH_REQUEST_TIMEOUT_S, 2 s here), counted as errors, and their latency is left out.

Load only ever targets 127.0.0.1, a bounded number of clients for a bounded time.

    python -m benchmarks.service_load [--clients 32] [--duration 20] [--workers 1]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import socket
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

BODY = {
    "model": "llama3-70b",
    "training": {"seq_len": 8192, "global_batch_size": 256},
    "cluster": {"preset": "dgx-h100", "nodes": 8},
    "search": {"top": 5},
}
HUGE = {**BODY, "cluster": {"preset": "dgx-h100", "nodes": 8191}}
OUT = Path(__file__).parent / "results" / "service_load.json"
ABUSERS = 4  # clients sending 8,191-node requests during the abuse run
LOCK_HOLD_S, LOCK_PERIOD_S = 1.0, 4.0  # the SQLite write lock is held this long of every period
ABUSE_BUDGET_S = 2.0  # BERTH_REQUEST_TIMEOUT_S of the abuse run


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(workers: int, store: Path, cache: bool, **settings) -> tuple[subprocess.Popen, str]:
    port = _port()
    env = {**os.environ, "BERTH_STORE_PATH": str(store), **{f"BERTH_{k.upper()}": str(v) for k, v in settings.items()}}
    if not cache:
        env["BERTH_PLAN_CACHE_SIZE"] = "0"
    proc = subprocess.Popen(
        [sys.executable, "-m", "berth.planner.cli", "serve", "--port", str(port), "--workers", str(workers)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    for _ in range(150):
        try:
            if httpx.get(url + "/healthz", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            time.sleep(0.2)
    proc.kill()
    raise SystemExit("server did not start")


def _request_bytes(host: str, port: int, payload: dict | None = None) -> bytes:
    body = json.dumps(payload or BODY).encode()
    head = (
        f"POST /v1/plans HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nConnection: keep-alive\r\n\r\n"
    )
    return head.encode() + body


async def client(
    host: str,
    port: int,
    stop_at: float,
    latencies: list[float],
    errors: list[str],
    payload: dict | None = None,
    statuses: dict[int, int] | None = None,
    path: str = "/v1/plans",
) -> None:
    """One keep-alive HTTP/1.1 connection sending requests back to back. Hand-rolled on asyncio
    streams: an httpx AsyncClient costs about 4 ms of client CPU per request here, enough to make
    the load generator, not the server, the bottleneck on two cores. A 429 (queue full) is counted
    in `statuses` and retried after a short pause, as a client honouring Retry-After would."""
    request = _request_bytes(host, port, payload)
    if path != "/v1/plans":
        request = f"GET {path} HTTP/1.1\r\nHost: {host}:{port}\r\nConnection: keep-alive\r\n\r\n".encode()
    reader, writer = await asyncio.open_connection(host, port)
    try:
        while time.perf_counter() < stop_at:
            t0 = time.perf_counter()
            writer.write(request)
            await writer.drain()
            head = await reader.readuntil(b"\r\n\r\n")
            status = int(head.split(b" ", 2)[1])
            length = next(
                int(line.split(b":", 1)[1])
                for line in head.split(b"\r\n")
                if line.lower().startswith(b"content-length:")
            )
            body = await reader.readexactly(length)
            if statuses is not None:
                statuses[status] = statuses.get(status, 0) + 1
            if status == 429:
                await asyncio.sleep(0.05)
                continue
            if status != 200:
                errors.append(f"{status}: {body[:200]!r}")
                continue
            latencies.append(time.perf_counter() - t0)
            if path != "/v1/plans":
                await asyncio.sleep(0.02)
    except (OSError, asyncio.IncompleteReadError) as err:
        errors.append(repr(err))
    finally:
        writer.close()


def _summary(latencies: list[float], errors: list[str], wall: float) -> dict:
    if len(latencies) > 1:
        q = statistics.quantiles(latencies, n=100, method="inclusive")
    else:
        q = [latencies[0] if latencies else 0.0] * 99
    return {
        "requests": len(latencies),
        "errors": len(errors),
        "error_samples": errors[:5],
        "requests_per_s": len(latencies) / wall,
        "p50_ms": q[49] * 1e3,
        "p90_ms": q[89] * 1e3,
        "p99_ms": q[98] * 1e3,
        "max_ms": max(latencies, default=0.0) * 1e3,
        "wall_s": wall,
    }


async def load(url: str, clients: int, duration: float) -> dict:
    host, port = url.removeprefix("http://").split(":")
    async with httpx.AsyncClient(base_url=url, timeout=60) as c:
        r = await c.post("/v1/plans", json=BODY)  # warm-up: imports, first search
        assert r.status_code == 200 and json.loads(r.text)["plans"], r.text[:500]
    latencies: list[float] = []
    errors: list[str] = []
    statuses: dict[int, int] = {}
    start = time.perf_counter()
    await asyncio.gather(
        *(client(host, int(port), start + duration, latencies, errors, statuses=statuses) for _ in range(clients))
    )
    return {**_summary(latencies, errors, time.perf_counter() - start), "statuses": statuses}


def hold_lock(store: Path, stop: threading.Event, held: list[float]) -> None:
    """Another process's view of the store: take the write lock for LOCK_HOLD_S of every
    LOCK_PERIOD_S until stopped."""
    db = sqlite3.connect(store, timeout=30, isolation_level=None)
    try:
        while not stop.is_set():
            db.execute("BEGIN EXCLUSIVE")
            t0 = time.perf_counter()
            stop.wait(LOCK_HOLD_S)
            db.execute("COMMIT")
            held.append(time.perf_counter() - t0)
            stop.wait(LOCK_PERIOD_S - LOCK_HOLD_S)
    finally:
        db.close()


async def abuse(url: str, store: Path, clients: int, duration: float) -> dict:
    host, port = url.removeprefix("http://").split(":")
    async with httpx.AsyncClient(base_url=url, timeout=60) as c:
        r = await c.post("/v1/plans", json=BODY)
        assert r.status_code == 200, r.text[:500]
    normal: list[float] = []
    normal_errors: list[str] = []
    normal_status: dict[int, int] = {}
    health: list[float] = []
    health_errors: list[str] = []
    huge_lat: list[float] = []
    huge_errors: list[str] = []
    huge_status: dict[int, int] = {}
    stop, held = threading.Event(), []
    locker = threading.Thread(target=hold_lock, args=(store, stop, held))
    locker.start()
    start = time.perf_counter()
    try:
        await asyncio.gather(
            *(
                client(host, int(port), start + duration, normal, normal_errors, statuses=normal_status)
                for _ in range(clients)
            ),
            *(
                client(host, int(port), start + duration, huge_lat, huge_errors, HUGE, huge_status)
                for _ in range(ABUSERS)
            ),
            client(host, int(port), start + duration, health, health_errors, path="/healthz"),
        )
    finally:
        stop.set()
        locker.join()
    wall = time.perf_counter() - start
    return {
        "normal": {**_summary(normal, normal_errors, wall), "statuses": normal_status},
        "healthz": _summary(health, health_errors, wall),
        "huge_requests": {"statuses": huge_status, "errors": len(huge_errors), "samples": huge_errors[:3]},
        "lock_held_s": sum(held),
        "abusers": ABUSERS,
        "budget_s": ABUSE_BUDGET_S,
        "targets": {"healthz_p99_ms": 100, "normal_p99_ms": 500},
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--duration", type=float, default=20.0)
    ap.add_argument("--workers", type=int, default=1)
    args = ap.parse_args()
    if not 1 <= args.clients <= 256 or not 0 < args.duration <= 120:
        raise SystemExit("--clients in 1..256, --duration in (0, 120] s: a bounded load on loopback")
    runs = {}
    for name, cache in (("cache_hit", True), ("cache_miss", False), ("abuse", True)):
        with tempfile.TemporaryDirectory() as tmp:
            store = Path(tmp) / "store.sqlite"
            extra = {"request_timeout_s": ABUSE_BUDGET_S} if name == "abuse" else {}
            proc, url = start_server(args.workers, store, cache, **extra)
            try:
                if name == "abuse":
                    runs[name] = asyncio.run(abuse(url, store, args.clients, args.duration))
                else:
                    runs[name] = asyncio.run(load(url, args.clients, args.duration))
            finally:
                proc.terminate()
                proc.wait(timeout=15)
        r = runs[name]
        if name == "abuse":
            n, h = r["normal"], r["healthz"]
            print(
                f"{name:10s} {args.clients} clients + {ABUSERS} sending 8,191-node requests + the SQLite lock "
                f"held {r['lock_held_s']:.0f} s: /healthz p99 {h['p99_ms']:.0f} ms (max {h['max_ms']:.0f}); "
                f"normal p99 {n['p99_ms']:.0f} ms, {n['requests_per_s']:.1f} req/s, statuses {n['statuses']}; "
                f"8,191-node requests: {r['huge_requests']['statuses']}"
            )
        else:
            print(
                f"{name:10s} {args.clients} clients, {args.duration:.0f} s, {args.workers} server worker(s): "
                f"{r['requests_per_s']:.1f} req/s, p50 {r['p50_ms']:.0f} ms, p90 {r['p90_ms']:.0f} ms, "
                f"p99 {r['p99_ms']:.0f} ms, errors {r['errors']}, statuses {r['statuses']}"
            )
    result = {
        **runs["cache_hit"],
        "runs": runs,
        "clients": args.clients,
        "duration_s": args.duration,
        "server_workers": args.workers,
        "request": BODY,
        "machine": {
            "cpu_count": os.cpu_count(),
            "python": platform.python_version(),
            "platform": platform.platform(),
            "load_average": os.getloadavg(),
            "note": "shared with other engineers' jobs: timings are noisy",
        },
        "target": {"p99_ms": 250, "errors": 0, "abuse_healthz_p99_ms": 100, "abuse_normal_p99_ms": 500},
    }
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
