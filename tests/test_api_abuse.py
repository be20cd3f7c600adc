"""Issue 28 replayed: the service under abuse. Each test failed on 52a3e65. A real `berth serve`
(uvicorn) over HTTP on 127.0.0.1, a real SQLite file, real processes; every attack is bounded in
count and time and targets loopback only."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from berth_server import ROOT, Server, free_port

PLAN = {
    "model": "tiny-gpt",
    "training": {"seq_len": 128, "global_batch_size": 16},
    "cluster": {"preset": "dgx-h100", "nodes": 1},
    "search": {"top": 1},
}


def _plan(i: int) -> dict:
    """A distinct question (a cache miss) per i."""
    return {**PLAN, "training": {"seq_len": 128 + 8 * i, "global_batch_size": 16}}


def _children(pid: int) -> list[int]:
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[1]) == pid:
            out.append(int(stat.parent.name))
    return out


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _gone(pids: list[int], within_s: float) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if not any(_alive(p) for p in pids):
            return True
        time.sleep(0.1)
    return False


# --- connections ---------------------------------------------------------------------------------


def test_half_sent_requests_cannot_shut_anyone_out(tmp_path):
    """More half-sent requests than the server has slots, held past the head deadline they would
    otherwise be given: /healthz and plans still answer at once (they take the oldest slots)."""
    s = Server(tmp_path / "s.sqlite", limit_concurrency=32, max_connections_per_client=16, header_timeout_s=30)
    socks = []
    try:
        for _ in range(40):
            c = socket.create_connection(("127.0.0.1", s.port), timeout=5)
            c.sendall(b"POST /v1/plans HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n")
            socks.append(c)
        time.sleep(0.5)
        times, codes = [], []
        for i in range(20):
            t0 = time.perf_counter()
            r = httpx.get(s.url + "/healthz", timeout=5)
            times.append(time.perf_counter() - t0)
            codes.append(r.status_code)
            if i % 5 == 0:
                codes.append(httpx.post(s.url + "/v1/plans", json=PLAN, timeout=10).status_code)
        assert set(codes) == {200}, codes
        assert max(times) < 1.0, times
    finally:
        for c in socks:
            c.close()
        s.stop()


def _get_raw(port: int, path: str = "/healthz") -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as c:
        c.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
        return c.recv(65536).split(b"\r\n\r\n")[0].lower()


def test_over_the_per_client_cap_a_new_connection_gets_a_clean_503_or_an_old_slot(tmp_path):
    """Connections that have only just opened are not closed to make room: the newcomer gets 503
    with Connection: close and Retry-After. Once they have idled past EVICTABLE_AFTER_S, the
    newcomer takes the oldest one's slot and is answered."""
    from berth.api.server import EVICTABLE_AFTER_S

    s = Server(tmp_path / "s.sqlite", max_connections_per_client=4, header_timeout_s=30)
    idle = []
    try:
        idle = [socket.create_connection(("127.0.0.1", s.port), timeout=5) for _ in range(4)]
        head = _get_raw(s.port)
        assert head.startswith(b"http/1.1 503") and b"connection: close" in head and b"retry-after" in head, head
        time.sleep(EVICTABLE_AFTER_S + 0.3)
        head = _get_raw(s.port)
        assert head.startswith(b"http/1.1 200"), head
        closed = 0
        for c in idle:  # one of the idle connections gave its slot
            c.settimeout(0.5)
            with contextlib.suppress(TimeoutError):
                closed += c.recv(10) == b""
        assert closed == 1, closed
    finally:
        for c in idle:
            c.close()
        s.stop()


def test_header_limit_is_kept_when_the_head_arrives_in_pieces(tmp_path):
    """A head that outgrows the limit before it is complete is refused by h11 (uvicorn's 400), one read at once
    by HeadLimit (431): either way the answer is 431."""
    s = Server(tmp_path / "s.sqlite")
    try:
        with socket.create_connection(("127.0.0.1", s.port), timeout=10) as c:
            c.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 40_000)
            time.sleep(0.3)  # the server reads this much before the rest exists
            with contextlib.suppress(OSError):  # refused and closed before the rest was sent
                c.sendall(b"a" * 60_000 + b"\r\n\r\n")
            head = c.recv(65536).split(b"\r\n\r\n")[0].lower()
        assert head.startswith(b"http/1.1 431"), head
        assert b"connection: close" in head
    finally:
        s.stop()


def test_header_limit_is_kept_when_the_head_arrives_at_once(tmp_path):
    s = Server(tmp_path / "s.sqlite")
    try:
        with socket.create_connection(("127.0.0.1", s.port), timeout=10) as c:
            c.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 100_000 + b"\r\n\r\n")
            head = c.recv(65536).split(b"\r\n\r\n")[0].lower()
        assert head.startswith(b"http/1.1 431"), head
        assert b"connection: close" in head
        r = httpx.get(s.url + "/healthz", headers={"X-Ok": "a" * 8000}, timeout=5)
        assert r.status_code == 200
    finally:
        s.stop()


def test_unread_answer_is_dropped_after_the_write_deadline(tmp_path):
    """A client that asks for a large answer and never reads it: the server drops the connection
    (and the answer's buffer) after BERTH_WRITE_TIMEOUT_S instead of holding it."""
    s = Server(tmp_path / "s.sqlite", write_timeout_s=1, max_answer_ranks=1 << 24)
    body = {**PLAN, "training": {"seq_len": 128, "global_batch_size": 65536}}
    body |= {"cluster": {"preset": "local-cpu", "nodes": 32768}, "search": {"top": 100}}
    try:
        size = len(httpx.post(s.url + "/v1/plans", json=body, timeout=60).content)
        assert size > 20_000_000, size  # far larger than the socket buffers on both sides
        c = socket.socket()
        c.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        c.connect(("127.0.0.1", s.port))
        text = json.dumps(body).encode()
        c.sendall(
            b"POST /v1/plans HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(text)}\r\n\r\n".encode()
            + text
        )
        time.sleep(4)  # the answer is built (cache hit) and the write deadline passes, unread
        got = 0
        c.settimeout(5)
        try:
            while chunk := c.recv(65536):
                got += len(chunk)
        except (ConnectionResetError, TimeoutError):
            pass
        c.close()
        assert got < size, (got, size)
        assert httpx.get(s.url + "/healthz", timeout=5).status_code == 200
    finally:
        s.stop()


# --- answers -------------------------------------------------------------------------------------


def test_huge_answers_are_422_naming_the_limit(tmp_path):
    s = Server(tmp_path / "s.sqlite")
    try:
        body = {**PLAN, "cluster": {"preset": "local-cpu", "nodes": 32768}, "search": {"top": 100}}
        t0 = time.perf_counter()
        r = httpx.post(s.url + "/v1/plans", json=body, timeout=60)
        assert r.status_code == 422, r.text[:300]
        item = r.json()["detail"][0]
        assert item["loc"] == ["body", "search", "top"] and "BERTH_MAX_ANSWER_RANKS" in item["msg"], item
        assert len(r.content) < 2000 and time.perf_counter() - t0 < 30
        compare = {k: v for k, v in body.items() if k != "search"} | {"layouts": ["tp=1"] * 64}
        r = httpx.post(s.url + "/v1/compare", json=compare, timeout=60)
        assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body", "layouts"], r.text[:300]
    finally:
        s.stop()


@pytest.mark.parametrize(
    "field,value",
    [
        ("fix", {"tp": 2**63}),
        ("fix", "tp=99999999999999999999"),
        ("fix", {"micro_batch_size": 2**64}),
        ("layouts", [{"pp": 2**63}]),
        ("layouts", ["dp=18446744073709551616"]),
    ],
)
def test_integers_beyond_int64_are_422(server_once, field, value):
    base = {k: v for k, v in PLAN.items() if k != "search"}
    body = {**base, "search": {"fix": value}} if field == "fix" else {**base, "layouts": value}
    path = "/v1/plans" if field == "fix" else "/v1/compare"
    r = httpx.post(server_once.url + path, json=body, timeout=30)
    assert r.status_code == 422, r.text
    assert "at most" in r.json()["detail"][0]["msg"], r.text


@pytest.mark.parametrize("value", [5, "LlamaForCausalLM", {"a": 1}, True])
def test_hf_architectures_not_a_list_is_422(server_once, value):
    cfg = {
        "model_type": "llama",
        "architectures": value,
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "intermediate_size": 128,
        "vocab_size": 1000,
    }
    r = httpx.post(server_once.url + "/v1/plans", json={**PLAN, "model": cfg}, timeout=30)
    assert r.status_code == 422, r.text
    assert r.json()["detail"][0]["loc"][-1] == "architectures", r.text


@pytest.fixture(scope="module")
def server_once(tmp_path_factory):
    s = Server(tmp_path_factory.mktemp("once") / "s.sqlite")
    yield s
    s.stop()


def test_an_unexpected_error_is_500_with_connection_close(tmp_path):
    """No input should reach it, but the last resort says the connection ends, as it does."""
    import uvicorn

    from berth.api.app import create_app
    from berth.api.settings import Settings

    app = create_app(Settings(store_path=str(tmp_path / "s.sqlite")))

    @app.get("/boom")
    async def boom() -> None:
        raise RuntimeError("boom")

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="critical"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 20
        while not server.started and time.monotonic() < deadline:
            time.sleep(0.05)
        r = httpx.get(f"http://127.0.0.1:{port}/boom", timeout=10)
        assert r.status_code == 500 and r.headers["connection"] == "close", r.headers
        assert "RuntimeError" in r.json()["detail"]
    finally:
        server.should_exit = True
        thread.join(timeout=10)


# --- the store -----------------------------------------------------------------------------------


def _hold_lock(path: Path, seconds: float) -> subprocess.Popen:
    """Another process holding the store's write lock for `seconds`."""
    code = (
        "import sqlite3, sys, time; db = sqlite3.connect(sys.argv[1], isolation_level=None); "
        "db.execute('BEGIN IMMEDIATE'); print('held', flush=True); time.sleep(float(sys.argv[2])); db.execute('COMMIT')"
    )
    proc = subprocess.Popen([sys.executable, "-c", code, str(path), str(seconds)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
    return proc


def test_no_acknowledged_id_is_lost_to_kill9_while_the_lock_is_held(tmp_path):
    store = tmp_path / "s.sqlite"
    acked: list[str] = []
    for round_ in range(2):
        s = Server(store, request_timeout_s=3)
        try:
            holder = _hold_lock(store, 1.0)  # shorter than the budget: the requests wait, then commit
            with httpx.Client(base_url=s.url, timeout=30) as c:
                codes = []
                for i in range(4):
                    r = c.post("/v1/plans", json=_plan(10 * round_ + i))
                    codes.append(r.status_code)
                    if r.status_code == 200:
                        acked.append(r.json()["id"])
            holder.wait()
            assert 200 in codes, codes
            holder = _hold_lock(store, 5.0)  # longer than the budget: 503, no id
            t0 = time.perf_counter()
            r = httpx.post(s.url + "/v1/plans", json=_plan(100 + round_), timeout=30)
            assert r.status_code == 503 and r.headers["retry-after"], r.text
            assert time.perf_counter() - t0 < 4.5
        finally:
            s.kill9()  # with the lock held by the other process
        holder.wait()
    db = sqlite3.connect(store)
    found = {row[0] for row in db.execute("SELECT id FROM plan_refs")}
    db.close()
    assert acked and set(acked) <= found, set(acked) - found


def test_store_stays_within_its_bytes_at_every_insert(tmp_path):
    from berth.planner.store import Store

    store = Store(tmp_path / "s.sqlite", max_bytes=10_000)
    for i in range(20):
        store.add_answer(f"id{i}", f"2026-01-01T00:00:{i:02d}", "plan", json.dumps({"x": str(i) * 2990}))
        assert store.stored_bytes() <= 10_000, i
    assert store.get_plan("id19") is not None and store.get_plan("id0") is None
    db = sqlite3.connect(tmp_path / "s.sqlite")
    (real,) = db.execute("SELECT SUM(size) FROM answers").fetchone()
    assert real == store.stored_bytes()  # the totals the triggers keep are the rows' own


def test_pool_refuses_at_once_what_would_end_past_the_budget():
    """A job behind more work than its deadline leaves is 429 at once, not a 503 after the budget."""
    import asyncio

    from fastapi import HTTPException

    from berth.api.service import DEADLINE, Workers

    pool = Workers("search", 1, 64)

    async def main() -> tuple[int, float]:
        await pool.run(lambda: time.sleep(0.5))  # the pool learns a job takes ~0.5 s
        DEADLINE.set(time.monotonic() + 1.6)  # three jobs fit, a fourth would end at ~2 s
        jobs = [asyncio.ensure_future(pool.run(lambda: time.sleep(0.5))) for _ in range(3)]
        await asyncio.sleep(0.05)
        t0 = time.monotonic()
        try:
            await pool.run(lambda: None)
        except HTTPException as err:
            status, waited = err.status_code, time.monotonic() - t0
        else:
            status, waited = 200, time.monotonic() - t0
        await asyncio.gather(*jobs)
        return status, waited

    status, waited = asyncio.run(main())
    pool.shutdown()
    assert status == 429 and waited < 0.1, (status, waited)


# --- settings ------------------------------------------------------------------------------------


@pytest.mark.parametrize("key", [" ", "short", "x" * 15, " " + "x" * 20])
def test_short_or_padded_api_key_refuses_to_start(tmp_path, key):
    env = {**os.environ, "BERTH_STORE_PATH": str(tmp_path / "s.sqlite"), "BERTH_API_KEY": key}
    env["BERTH_VALIDATION_ENABLED"] = "1"
    proc = subprocess.run(
        [sys.executable, "-m", "berth.cli.main", "serve", "--port", str(free_port())],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2 and "BERTH_API_KEY" in proc.stderr and "16" in proc.stderr, proc.stderr


def test_allowed_hosts(tmp_path):
    s = Server(tmp_path / "s.sqlite", allowed_hosts="berth.example.com,127.0.0.1")
    try:
        assert httpx.get(s.url + "/healthz", timeout=5).status_code == 200  # Host: 127.0.0.1:port
        r = httpx.get(s.url + "/healthz", headers={"Host": "evil.example"}, timeout=5)
        assert r.status_code == 400 and r.headers["connection"] == "close", r.text
        r = httpx.get(s.url + "/healthz", headers={"Host": "berth.example.com"}, timeout=5)
        assert r.status_code == 200
    finally:
        s.stop()


# --- processes -----------------------------------------------------------------------------------


def test_two_workers_serve_one_store_and_die_with_the_server(tmp_path):
    s = Server(tmp_path / "s.sqlite", workers=2)
    try:
        deadline = time.monotonic() + 60
        while len(_children(s.proc.pid)) < 2 and time.monotonic() < deadline:
            time.sleep(0.2)
        children = _children(s.proc.pid)  # the workers, and multiprocessing's resource tracker
        workers = [p for p in children if b"spawn_main" in Path(f"/proc/{p}/cmdline").read_bytes()]
        assert len(workers) == 2, workers
        ids = []
        for i in range(8):  # a new connection each: the kernel hands them to either worker
            r = httpx.post(s.url + "/v1/plans", json=_plan(i), timeout=60, headers={"Connection": "close"})
            assert r.status_code == 200, r.text
            ids.append(r.json()["id"])
        for plan_id in ids:  # each id read back, by whichever worker takes the connection
            assert httpx.get(f"{s.url}/v1/plans/{plan_id}", timeout=30).status_code == 200
    finally:
        s.kill9()
    assert _gone(children, 10), "a worker outlived kill -9 of the server"


def test_cluster_builder_dies_with_the_server_on_kill9(tmp_path):
    s = Server(tmp_path / "s.sqlite")
    try:
        body = {**PLAN, "cluster": {"preset": "dgx-h100", "nodes": 520}}  # 4,160 GPUs: built in the child
        httpx.post(s.url + "/v1/plans", json=body, timeout=60)
        builders = _children(s.proc.pid)
        assert builders, "no build child"
    finally:
        s.kill9()
    assert _gone(builders, 10), "the cluster-build child outlived kill -9 of the server"


def test_torchrun_group_dies_when_its_launcher_is_killed(tmp_path):
    """executor.validate's launch guard: kill -9 of the process that launched a group ends it."""
    code = (
        "import sys, time; from berth.executor import validate as v; from pathlib import Path; "
        "v._launch([sys.executable, '-c', 'import subprocess, sys, time; "
        'subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"]); time.sleep(120)\'], '
        "{}, 300, None, Path(sys.argv[1]))"
    )
    launcher = subprocess.Popen([sys.executable, "-c", code, str(tmp_path / "err.txt")], cwd=ROOT)
    try:
        deadline, group = time.monotonic() + 30, []
        while time.monotonic() < deadline:
            group = [
                int(p.parent.name)
                for p in Path("/proc").glob("[0-9]*/cmdline")
                if b"time.sleep(120)" in p.read_bytes() and int(p.parent.name) != launcher.pid
            ]
            if len(group) >= 2:
                break
            time.sleep(0.2)
        assert len(group) >= 2, group
    finally:
        launcher.send_signal(signal.SIGKILL)
        launcher.wait()
    assert _gone(group, 15), "the launched group outlived kill -9 of its launcher"


def test_queued_jobs_are_refused_once_the_pool_knows_they_cannot_finish():
    """No mean known yet: every job is queued; once the first one teaches the pool a job takes
    ~0.5 s, those that could not end within their deadline leave the queue with a 429 at once
    instead of waiting for a 503 at the end of the budget."""
    import asyncio

    from fastapi import HTTPException

    from berth.api.service import DEADLINE, Workers

    pool = Workers("search", 1, 64)

    async def one() -> tuple[int, float]:
        t0 = time.monotonic()
        DEADLINE.set(t0 + 2.0)
        try:
            await pool.run(lambda: time.sleep(0.5))
        except HTTPException as err:
            return err.status_code, time.monotonic() - t0
        return 200, time.monotonic() - t0

    async def main() -> list[tuple[int, float]]:
        return await asyncio.gather(*(one() for _ in range(8)))

    ended = asyncio.run(main())
    pool.shutdown()
    refused = [t for status, t in ended if status == 429]
    assert sum(status == 200 for status, _ in ended) >= 3, ended
    assert refused and max(refused) < 1.0, ended  # refused right after the first job ended, not at 2 s
