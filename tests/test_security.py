"""Issue 14 replayed: each finding of the attack on `berth serve` as a test (they all failed on
707bf11). A real uvicorn over HTTP on 127.0.0.1 and a real SQLite file throughout; generated
scripts are run by a real sh/bash with stub torchrun/srun/scontrol on PATH."""

from __future__ import annotations

import builtins
import gc
import io
import json
import os
import socket
import sqlite3
import stat
import subprocess
import sys
import threading
import time
import tracemalloc
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from berth_server import Server, free_port

ROOT = Path(__file__).resolve().parents[1]
PLAN_BODY = {
    "model": "llama3-70b",
    "training": {"seq_len": 8192, "global_batch_size": 256},
    "cluster": {"preset": "dgx-h100", "nodes": 8},
    "search": {"top": 3},
}
# ~460,000 layouts: about 2 s of search on the CI machine
SLOW_BODY = {
    "model": "gpt-1t",
    "training": {"seq_len": 2048, "global_batch_size": 3072},
    "cluster": {"preset": "dgx-a100-80g", "nodes": 384},
    "search": {"top": 1},
}
HOSTILE = [
    "$(touch {m})",
    "`touch {m}`",
    "x;touch {m}",
    "a\ntouch {m}\n",
    "'; touch {m}; '",
    '"; touch {m}; "',
    "$(touch${{IFS}}{m})",
]


def strict_json(text: str):
    """RFC 8259 JSON only: NaN and Infinity are not JSON."""

    def refuse(name):
        raise ValueError(f"{name} in a response")

    return json.loads(text, parse_constant=refuse)


class InProcessServer:
    """uvicorn serving create_app in a thread of this process, so that a test sees every file
    the service opens."""

    def __init__(self, store):
        import uvicorn

        from berth.api.app import create_app
        from berth.api.settings import Settings

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        app = create_app(Settings(store_path=str(store)))
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started and time.monotonic() < deadline:
            time.sleep(0.05)

    def stop(self):
        self.server.should_exit = True
        self.thread.join(timeout=10)


@pytest.fixture
def server(tmp_path):
    s = Server(tmp_path / "store.sqlite")
    yield s
    s.stop()


# --- 1. a request never opens a file on the server ------------------------------------------


def test_request_never_opens_a_server_file(tmp_path, monkeypatch):
    secret = tmp_path / "secret.json"
    secret.write_text('{"nodes": [], "links": [], "token": "TOP-SECRET-7731"}')
    fifo = tmp_path / "pipe.json"
    os.mkfifo(fifo)
    srv = InProcessServer(tmp_path / "store.sqlite")
    # the service's own data: its hardware profiles and model presets (read at the first request that needs them
    # when no earlier test in this process has), and the interpreter's
    presets = ROOT / "specs" / "model_presets.json"
    allowed = [ROOT / "hardware_profiles", ROOT / "planner", presets, Path(sys.prefix), Path(sys.base_prefix)]
    opened: list[str] = []

    def check(path):
        if isinstance(path, int):
            return
        p = Path(os.fsdecode(path)).absolute()
        if not any(p.is_relative_to(a) for a in allowed):
            opened.append(str(p))
            raise PermissionError(f"test: the service opened {p}")

    real_open, real_read_text, real_path_open = builtins.open, Path.read_text, Path.open
    monkeypatch.setattr(builtins, "open", lambda f, *a, **k: (check(f), real_open(f, *a, **k))[1])
    monkeypatch.setattr(io, "open", builtins.open)
    monkeypatch.setattr(Path, "read_text", lambda self, *a, **k: (check(self), real_read_text(self, *a, **k))[1])
    monkeypatch.setattr(Path, "open", lambda self, *a, **k: (check(self), real_path_open(self, *a, **k))[1])
    names = [
        str(secret),
        str(fifo),
        str(tmp_path / "nope.json"),
        "../../../../etc/passwd",
        "/etc/passwd",
        "../servers/dgx-h100",
        "../../hardware_profiles/servers/dgx-h100.json",
        "/dev/zero",
        "x.json",
        "../devices/h100-sxm",
    ]
    try:
        c = httpx.Client(base_url=srv.url, timeout=30)
        answers = []
        for name in names:
            gpu = {"id": "g", "kind": "gpu", "device": "h100-sxm", "host": "h"}
            graph = {"nodes": [gpu], "links": []}
            bodies = [
                {**PLAN_BODY, "model": name},
                {**PLAN_BODY, "cluster": {"preset": name}},
                {**PLAN_BODY, "cluster": {"graph": graph, "name": name}},
                {**PLAN_BODY, "cluster": {"graph": {**graph, "nodes": [{**gpu, "device": name}]}}},
                {**PLAN_BODY, "cluster": {"graph": {**graph, "nodes": [{**gpu, "host": name}]}}},
                {**PLAN_BODY, "model": {"model_type": name, "num_hidden_layers": 2}},
            ]
            answers += [c.post("/v1/plans", json=b) for b in bodies]
            answers += [c.post("/v1/compare", json={**bodies[1], "layouts": ["tp=8"]}, params={"search": None})]
            answers += [
                c.post("/v1/launch", json={"plan_id": name, "format": "slurm"}),
                c.post("/v1/launch", json={"plan_id": "a", "format": "slurm", "image": name}),
                c.get("/v1/hardware-profiles/" + name.replace("/", "%2F")),
                c.get("/v1/plans/" + name.replace("/", "%2F")),
            ]
        for r in answers:
            assert r.status_code < 500, r.text
            assert "TOP-SECRET" not in r.text and "root:" not in r.text
            strict_json(r.text)
        assert not opened, opened
    finally:
        monkeypatch.undo()
        srv.stop()


# --- 2. no command injection in generated scripts -----------------------------------------------


def _plan(nodes=2):
    from berth.planner.planning import make_cluster, make_search, make_training, plan
    from berth.specs.models import presets

    cluster = make_cluster("dgx-h100", nodes)
    return plan(
        presets()["tiny-gpt"],
        make_training(seq_len=128, global_batch_size=16 * nodes),
        cluster,
        make_search(top=1, fix={"dp": 8 * nodes, "zero_stage": 0}),
    ).plans[0]


@pytest.mark.parametrize("payload", HOSTILE)
def test_hostile_names_are_refused_by_the_spec_tree(payload):
    from pydantic import ValidationError

    from berth.launch.writers import artifacts
    from berth.specs.errors import BerthError
    from berth.specs.tree import ClusterSpec, ModelSpec

    bad = payload.format(m="/tmp/pwned")
    shape = dict(num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=256, vocab_size=128)
    with pytest.raises(ValidationError):
        ModelSpec(name=bad, **shape)
    cluster = _plan().cluster
    with pytest.raises(ValidationError):
        ClusterSpec.model_validate({**cluster.model_dump(), "hosts": (bad, "n1")})
    with pytest.raises(BerthError):
        artifacts(_plan(), "kubernetes", image=bad)


def _stubs(bin_dir: Path, log: Path) -> dict[str, str]:
    bin_dir.mkdir()
    scripts = {
        # torchrun: record each argument on its own line, exactly as received
        "torchrun": f'#!/bin/sh\nfor a in "$@"; do printf "%s\\n" "$a" >> {log}; done\n',
        # srun OPTIONS... CMD...: run the command as the one task of node 0
        "srun": '#!/bin/sh\nwhile [ "${1#-}" != "$1" ]; do shift; done\nSLURM_NODEID=0 exec "$@"\n',
        "scontrol": "#!/bin/sh\necho node-a\n",
    }
    for name, text in scripts.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    return {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "SLURM_JOB_NODELIST": "node-a"}


@pytest.mark.parametrize("payload", HOSTILE)
def test_generated_scripts_run_no_injected_command(tmp_path, payload):
    """The quoting layer alone: specs built without validation (model_copy) carry hostile names
    into every format; the torchrun and sbatch scripts are run with stubs on PATH."""
    import re

    from berth.launch.writers import FORMATS, artifacts

    marker = tmp_path / "pwned"
    bad = payload.format(m=marker)
    good = _plan()
    hostile = good.model_copy(
        update={
            "model": good.model.model_copy(update={"name": bad}),
            "cluster": good.cluster.model_copy(update={"hosts": (bad, "n1")}),
        }
    )
    for fmt in FORMATS:
        try:
            files = artifacts(hostile, fmt)
        except ValueError:  # a format that refuses this layout
            continue
        if fmt == "kubernetes":
            for name in files:
                doc = json.loads(files[name])
                assert re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", doc["metadata"]["name"]), doc["metadata"]
    log = tmp_path / "torchrun.log"
    env = _stubs(tmp_path / "bin", log)
    run = tmp_path / "run"
    run.mkdir()
    for name, text in {**artifacts(hostile, "torchrun"), **artifacts(hostile, "slurm")}.items():
        (run / name).write_text(text)
    env.pop("MASTER_ADDR", None)
    r = subprocess.run(["sh", "node1.sh"], cwd=run, env=env, capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    assert f"--master-addr={bad}" in log.read_text()  # the host arrives whole, as one argument
    r = subprocess.run(["bash", "berth.sbatch"], cwd=run, env=env, capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    assert "--master-addr=node-a" in log.read_text() and "--node-rank=0" in log.read_text()
    assert not marker.exists(), "an injected command ran"
    head = (run / "berth.sbatch").read_text().split("set -euo pipefail")[0].splitlines()
    assert all(line.startswith("#") for line in head), head  # the #SBATCH block holds no command
    assert sum(line.startswith("#SBATCH ") for line in head) == 5


def test_hostile_host_through_the_api_is_422(server):
    graph = {"nodes": [{"id": "g", "kind": "gpu", "device": "h100-sxm", "host": "$(reboot)"}], "links": []}
    r = httpx.post(server.url + "/v1/plans", json={**PLAN_BODY, "cluster": {"graph": graph}}, timeout=30)
    assert r.status_code == 422 and "host" in json.dumps(r.json()["detail"][0]["loc"]), r.text
    r = httpx.post(
        server.url + "/v1/plans",
        json={
            **PLAN_BODY,
            "model": {
                "name": "x\n#SBATCH --wrap=id",
                "num_layers": 2,
                "hidden_size": 64,
                "num_attention_heads": 4,
                "ffn_hidden_size": 256,
                "vocab_size": 128,
            },
        },
        timeout=30,
    )
    assert r.status_code == 422 and "name" in json.dumps(r.json()["detail"][0]["loc"]), r.text


# --- 3. the event loop never stalls ------------------------------------------------------------


def test_healthz_stays_fast_under_a_held_lock_and_a_huge_cluster(tmp_path):
    budget = 2.0
    s = Server(tmp_path / "store.sqlite", request_timeout_s=budget)
    lock = sqlite3.connect(tmp_path / "store.sqlite", timeout=1, isolation_level=None)
    try:
        warm = httpx.post(s.url + "/v1/plans", json=PLAN_BODY, timeout=60)  # normal traffic: a known question
        assert warm.status_code == 200
        lock.execute("BEGIN EXCLUSIVE")  # another process holds the write lock
        huge = {**PLAN_BODY, "cluster": {"preset": "dgx-h100", "nodes": 8191}}
        stop = threading.Event()
        health: list[float] = []

        def poll():
            with httpx.Client(base_url=s.url, timeout=5) as c:
                while not stop.is_set():
                    t0 = time.perf_counter()
                    assert c.get("/healthz").status_code == 200
                    health.append(time.perf_counter() - t0)
                    time.sleep(0.05)

        def ask(body):
            t0 = time.perf_counter()
            r = httpx.post(s.url + "/v1/plans", json=body, timeout=60)
            return r, time.perf_counter() - t0

        # The poll times the server's event loop, so this process's own collector is held off while it runs: late
        # in a full run this pytest process holds millions of objects (torch, DeepSpeed, torchtitan, Megatron
        # imported), and one full collection here (0.18 s for the imports alone, measured) once stalled the poller
        # 0.35 s with the server answering in 3-27 ms.
        gc.collect()
        gc.disable()
        try:
            poller = threading.Thread(target=poll)
            poller.start()
            time.sleep(0.3)
            with ThreadPoolExecutor(4) as pool:
                answers = list(pool.map(ask, [huge, PLAN_BODY, huge, PLAN_BODY]))
            time.sleep(0.5)
            stop.set()
            poller.join()
        finally:
            gc.enable()
        (huge1, t1), (normal1, t2), (huge2, t3), (normal2, t4) = answers
        for r, took in ((huge1, t1), (huge2, t3)):  # a clear answer within the budget, never a stall
            assert took < budget + 1.5, (r.status_code, took)
            # presets on rails are derived from a 2-node graph (topology/clusters.py), so the 65,528-GPU
            # cluster may be built in time and its search refused (this batch does not split): 422
            assert r.status_code in (422, 429, 503), r.text[:300]
            if r.status_code != 422:
                assert r.headers.get("retry-after")
                assert "budget" in r.json()["detail"] or "busy" in r.json()["detail"]
        for r, took in ((normal1, t2), (normal2, t4)):  # no id before its row is committed (issue 28): 503
            assert r.status_code == 503 and took < budget + 1.5, (r.status_code, took, r.text[:300])
            assert r.headers.get("retry-after") and ("budget" in r.text or "locked" in r.text), r.text
        assert len(health) > 20 and max(health) < 0.2, sorted(health)[-5:]
        lock.execute("ROLLBACK")  # the lock is free: answered, and the id's row is on disk
        r = httpx.post(s.url + "/v1/plans", json=PLAN_BODY, timeout=60)
        assert r.status_code == 200, r.text[:300]
        with sqlite3.connect(tmp_path / "store.sqlite", timeout=5) as db:
            assert db.execute("SELECT id FROM plan_refs WHERE id = ?", (r.json()["id"],)).fetchone()
    finally:
        lock.close()
        s.stop()


def test_nvidia_smi_runs_off_the_event_loop(tmp_path):
    """`local` asks nvidia-smi (here a fake one on PATH that takes 1.5 s, as a busy driver does, and
    names a GPU without a profile: the answer is a 422 naming it, after the call)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    smi = bin_dir / "nvidia-smi"
    smi.write_text('#!/bin/sh\nsleep 1.5\necho "NVIDIA Quasar QX9, 81559"\n')
    smi.chmod(0o755)
    env = {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "BERTH_DEVICE": "gpu"}
    s = Server(tmp_path / "store.sqlite", extra_env=env)
    try:
        body = {
            "model": "tiny-gpt",
            "training": {"seq_len": 128, "global_batch_size": 8},
            "cluster": {"preset": "local"},
            "search": {"top": 1},
        }
        with ThreadPoolExecutor(1) as pool, httpx.Client(base_url=s.url, timeout=5) as c:
            c.get("/healthz")
            asked = pool.submit(httpx.post, s.url + "/v1/plans", json=body, timeout=60)
            health = []
            while not asked.done():
                t0 = time.perf_counter()
                assert c.get("/healthz").status_code == 200
                health.append(time.perf_counter() - t0)
                time.sleep(0.05)
            r = asked.result()
        assert r.status_code == 422 and "Quasar QX9" in r.text, r.text[:300]
        # on the loop, nvidia-smi held /healthz for its whole 1.5 s
        assert len(health) > 5 and max(health) < 0.5, sorted(health)[-3:]
    finally:
        s.stop()


# --- 4. bounded work and storage -----------------------------------------------------------------


def _gpt_1t():
    from berth.planner.planning import make_cluster, make_training
    from berth.specs.models import presets

    return presets()["gpt-1t"], make_training(seq_len=2048, global_batch_size=3072), make_cluster("dgx-a100-80g", 384)


def test_over_the_limit_search_is_refused_without_enumerating():
    from berth.planner.planning import make_search
    from berth.planner.search import count_candidates, search
    from berth.specs.errors import BerthError

    model, training, cluster = _gpt_1t()
    count = count_candidates(model, training, cluster, make_search(top=1))
    assert count > 100_000
    tracemalloc.start()
    t0 = time.perf_counter()
    with pytest.raises(BerthError, match=f"{count:,} layouts"):
        search(model, training, cluster, make_search(top=1), max_candidates=1000)
    took = time.perf_counter() - t0
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 4e6 and took < 0.5, (peak, took)  # enumerating them holds 37 MB of columns


def test_compared_layouts_at_the_largest_values_are_rows_in_bounded_time():
    """compare keeps a layout that breaks a rule as a row (its prediction none): the API's 64 layouts at the largest
    values a layout field takes, for every engine, answer in bounded time and memory (nanotron's compute-balanced
    split once built a list per pipeline stage: 94 s at pp = 2^26)."""
    from berth.planner.planning import compare
    from berth.specs.engines import ENGINES
    from berth.specs.layouts import MAX_LAYOUT_VALUE as M
    from berth.specs.models import presets
    from berth.specs.tree import TrainingSpec
    from berth.topology.clusters import cluster_from_preset

    fields = ("pp", "tp", "cp", "dp", "ep", "mbs", "nmb", "vpp", "shard")
    layouts = [f"{f}={M}" for f in fields] + [f"pp={M},vpp={M},nmb={M},mbs={M}", f"dp={M},shard={M},zero=3"]
    layouts = (layouts * 6)[:64]
    model, cluster = presets()["llama3-8b"], cluster_from_preset("dgx-h100", 2)
    tracemalloc.start()
    t0 = time.perf_counter()
    for engine in ENGINES:
        plans = compare(model, TrainingSpec(seq_len=4096, global_batch_size=256, engine=engine), cluster, layouts)
        assert all(p.prediction is None and p.infeasible_reason for p in plans), engine
    took = time.perf_counter() - t0
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert took < 30 and peak < 200e6, (took, peak)


def test_candidate_count_matches_the_enumeration():
    from berth.planner.planning import make_cluster, make_search, make_training
    from berth.planner.search import count_candidates, enumerate_candidates, iter_candidates
    from berth.specs.models import presets

    model, training = presets()["llama3-70b"], make_training(seq_len=8192, global_batch_size=256)
    cluster = make_cluster("dgx-h100", 8)
    for fix in ({}, {"tp": 8}, {"recompute": "full", "pp": 2}, {"zero_stage": 3, "sequence_parallel": True}):
        spec = make_search(fix=fix)
        every = enumerate_candidates(model, training, cluster, spec)
        assert count_candidates(model, training, cluster, spec) == len(every)
        from berth.planner.search import _groups

        chunks = list(iter_candidates(_groups(model, training, cluster, spec), chunk=1000))
        assert all(len(c) == 1000 for c in chunks[:-1]) and sum(map(len, chunks)) == len(every)
        assert (chunks[0].tp == every.tp[:1000]).all()
        assert (chunks[-1].zero_stage == every.zero_stage[-len(chunks[-1]) :]).all()


def test_search_memory_is_bounded_by_its_chunk(monkeypatch):
    import berth.planner.search as search_module
    from berth.planner.planning import make_search

    model, training, cluster = _gpt_1t()
    count = search_module.count_candidates(model, training, cluster, make_search(top=3))
    chunk = 20_000
    monkeypatch.setattr(search_module, "CHUNK", chunk)
    tracemalloc.start()
    result = search_module.search(model, training, cluster, make_search(top=3))
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert result.searched == count > 10 * chunk and len(result.plans) == 3
    # about 800 bytes a candidate in one chunk, two chunks' columns pending, the plans
    assert peak < 3 * chunk * 800 + 8e6, peak / 1e6


def test_cancel_stops_the_search_thread():
    from berth.planner.planning import make_search
    from berth.planner.search import SearchTimeout, search

    model, training, cluster = _gpt_1t()
    cancel = threading.Event()
    outcome: list[object] = []

    def run():
        try:
            outcome.append(search(model, training, cluster, make_search(top=1), cancel=cancel))
        except SearchTimeout as err:
            outcome.append(err)

    t0 = time.perf_counter()
    worker = threading.Thread(target=run)
    worker.start()
    time.sleep(0.2)
    cancel.set()
    worker.join(timeout=30)
    assert isinstance(outcome[0], SearchTimeout) and "cancelled" in str(outcome[0])
    assert time.perf_counter() - t0 < 1.5  # one chunk at most after the cancel


def test_full_queue_is_a_fast_429_with_retry_after(tmp_path):
    s = Server(
        tmp_path / "store.sqlite",
        max_concurrent_searches=1,
        max_queued_requests=0,
        request_timeout_s=20,
        extra_env={"BERTH_PLAN_CACHE_SIZE": "0"},
    )
    try:
        quick = {**SLOW_BODY, "search": {"top": 1, "fix": "tp=8,pp=16,zero=1,mbs=1,recompute=full"}}
        assert httpx.post(s.url + "/v1/plans", json=quick, timeout=60).status_code == 200  # the cluster is built
        with ThreadPoolExecutor(1) as pool:
            slow = pool.submit(httpx.post, s.url + "/v1/plans", json=SLOW_BODY, timeout=60)
            time.sleep(0.5)  # the slow search holds the one worker
            t0 = time.perf_counter()
            r = httpx.post(s.url + "/v1/plans", json={**SLOW_BODY, "search": {"top": 2}}, timeout=60)
            took = time.perf_counter() - t0
            # at once, not after the 20 s budget
            assert r.status_code == 429 and r.headers["retry-after"] and took < 1.0, (r.status_code, took)
            assert slow.result().status_code == 200
    finally:
        s.stop()


def test_repeated_answers_are_stored_once(server, tmp_path):
    ids = [httpx.post(server.url + "/v1/plans", json=PLAN_BODY, timeout=60).json()["id"] for _ in range(30)]
    assert len(set(ids)) == 30
    first = httpx.get(f"{server.url}/v1/plans/{ids[0]}").json()
    last = httpx.get(f"{server.url}/v1/plans/{ids[-1]}").json()
    assert first["id"] == ids[0] and {k: v for k, v in first.items() if k not in ("id", "created")} == {
        k: v for k, v in last.items() if k not in ("id", "created")
    }
    one = len(json.dumps(first))
    db = sqlite3.connect(tmp_path / "store.sqlite", timeout=10)
    db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    db.close()
    size = (tmp_path / "store.sqlite").stat().st_size
    assert size < 3 * one + 60_000, (size, one)  # 30 copies would be 30 x one


def test_store_retention_and_size_limits(tmp_path):
    from berth.planner.store import Store

    store = Store(tmp_path / "s.sqlite", max_plans=5, max_bytes=2000)
    for i in range(20):
        store.add_answer(f"id{i}", f"2026-01-01T00:00:{i:02d}", "plan", json.dumps({"n": i, "pad": "x" * 300}))
    store.prune()
    kept = [i for i in range(20) if store.get_plan(f"id{i}")]
    assert kept == list(range(15, 20)) and store.stored_bytes() <= 2000
    store = Store(tmp_path / "t.sqlite", max_bytes=1000)
    for i in range(10):
        store.add_answer(f"id{i}", f"2026-01-01T00:00:{i:02d}", "plan", json.dumps({"n": i, "pad": "x" * 300}))
    store.prune()
    assert store.stored_bytes() <= 1000 and store.get_plan("id9") and not store.get_plan("id0")


def test_oversized_strings_are_refused_not_stored(server):
    model = {
        "name": "a" * 500_000,
        "num_layers": 2,
        "hidden_size": 64,
        "num_attention_heads": 4,
        "ffn_hidden_size": 256,
        "vocab_size": 128,
    }
    r = httpx.post(server.url + "/v1/plans", json={**PLAN_BODY, "model": model}, timeout=30)
    assert r.status_code == 422 and len(r.content) < 5000, (r.status_code, len(r.content))
    for field in ({"search": {"fix": "tp=8," * 10_000}}, {"cluster": {"graph": {}, "name": "g" * 1000}}):
        r = httpx.post(server.url + "/v1/plans", json={**PLAN_BODY, **field}, timeout=30)
        assert r.status_code == 422 and len(r.content) < 5000, (r.status_code, len(r.content))


def test_slow_header_connections_are_closed(tmp_path):
    s = Server(tmp_path / "store.sqlite", header_timeout_s=1)
    try:
        conn = socket.create_connection(("127.0.0.1", s.port), timeout=10)
        conn.sendall(b"POST /v1/plans HTTP/1.1\r\nHost: x\r\n")
        t0 = time.perf_counter()
        closed = False
        while time.perf_counter() - t0 < 6:
            try:
                conn.sendall(b"X-Slow: 1\r\n")
            except OSError:
                closed = True
                break
            conn.settimeout(0.3)
            try:
                if conn.recv(1024) == b"":
                    closed = True
                    break
            except TimeoutError:
                pass
        assert closed and time.perf_counter() - t0 < 4
        conn.close()
        assert httpx.get(s.url + "/healthz", timeout=2).status_code == 200
    finally:
        s.stop()


# --- 5. validations -----------------------------------------------------------------------------


def test_validation_without_a_key_refuses_to_start(tmp_path):
    env = {**os.environ, "BERTH_STORE_PATH": str(tmp_path / "s.sqlite"), "BERTH_VALIDATION_ENABLED": "1"}
    env.pop("BERTH_API_KEY", None)
    proc = subprocess.Popen(
        [sys.executable, "-m", "berth.cli.main", "serve", "--port", str(free_port())],
        env=env,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        out, err = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        pytest.fail("the server started with validations on and no API key")
    assert proc.returncode == 2 and "BERTH_API_KEY" in err and len(err.strip().splitlines()) == 1, err


def test_non_ascii_key_is_401_not_500(tmp_path):
    s = Server(tmp_path / "s.sqlite", validation_enabled=1, api_key="sekret-sekret-sekret")
    try:
        for key in ("ключ".encode(), "é".encode("latin-1"), b"sekret-sekret-sekret\xff"):
            r = httpx.post(s.url + "/v1/validations", json={"plan_id": "abc"}, headers={"X-API-Key": key})
            assert r.status_code == 401, (key, r.status_code, r.text)
            r = httpx.get(s.url + "/v1/validations/abc", headers={"X-API-Key": key})
            assert r.status_code == 401
    finally:
        s.stop()


def _children_running(marker: str) -> list[int]:
    pids = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if marker.encode() in cmdline.read_bytes():
                pids.append(int(cmdline.parent.name))
        except OSError:
            continue
    return pids


def test_validation_queue_bounded_and_jobs_end_with_the_server(tmp_path):
    pytest.importorskip("torch")
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    s = Server(
        tmp_path / "s.sqlite",
        validation_enabled=1,
        api_key="k" * 16,
        max_queued_validations=1,
        extra_env={"TMPDIR": str(tmp)},
    )
    try:
        c = httpx.Client(base_url=s.url, timeout=60, headers={"X-API-Key": "k" * 16})
        body = {
            "model": "tiny-gpt",
            "training": {"seq_len": 128, "global_batch_size": 8},
            "cluster": {"preset": "local", "devices_per_node": 2},
            "search": {"top": 1, "fix": "dp=2,zero=0"},
        }
        plan_id = c.post("/v1/plans", json=body).json()["id"]
        first = c.post("/v1/validations", json={"plan_id": plan_id, "steps": 200, "warmup": 1})
        assert first.status_code == 202, first.text
        second = c.post("/v1/validations", json={"plan_id": plan_id, "steps": 2, "warmup": 1})
        assert second.status_code == 429 and second.headers["retry-after"], second.text
        deadline = time.monotonic() + 60
        while not _children_running(str(tmp)) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert _children_running(str(tmp)), "the validation never started"
    finally:
        s.stop()
    deadline = time.monotonic() + 10
    while _children_running(str(tmp)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _children_running(str(tmp)), "torchrun outlived the server"
    assert not list(tmp.glob("berth-validate-*")), "the validation's temp dir was left behind"


# --- 6. strict input and output ---------------------------------------------------------------


def _post_raw(url: str, text: str, content_type: str = "application/json") -> httpx.Response:
    return httpx.post(url + "/v1/plans", content=text.encode(), headers={"content-type": content_type}, timeout=30)


@pytest.mark.parametrize("literal", ["NaN", "Infinity", "-Infinity", "1e999"])
def test_non_finite_numbers_are_422(server, literal):
    link = '{"source": "g0", "target": "sw", "kind": "nvswitch", "bandwidth_GBps": @, "latency_us": 1}'
    graph = (
        '{"nodes": [{"id": "g0", "kind": "gpu", "device": "h100-sxm", "host": "h"}, {"id": "sw", "kind": '
        '"switch"}], "links": [LINK]}'
    ).replace("LINK", link)
    bodies = [
        '{"model": "llama3-8b", "training": {"seq_len": 2048, "global_batch_size": 8}, '
        '"cluster": {"graph": G}}'.replace("G", graph),
        '{"model": "llama3-8b", "training": {"seq_len": 2048, "global_batch_size": 8, "token_budget": @}, '
        '"cluster": {"preset": "dgx-h100"}}',
        '{"model": "llama3-8b", "training": {"seq_len": 2048, "global_batch_size": 8}, "cluster": {"preset": '
        '"dgx-h100", "nodes": 2, "fabric": "fat-tree", "oversubscription": @}}',
    ]
    bodies = [b.replace("@", literal) for b in bodies]
    for text in bodies:
        r = _post_raw(server.url, text)
        assert r.status_code == 422, (text, r.status_code, r.text)
        strict_json(r.text)


def test_booleans_are_not_numbers(server):
    for patch in (
        {"cluster": {"preset": "dgx-h100", "nodes": True}},
        {"training": {"seq_len": 2048, "global_batch_size": True}},
        {"search": {"top": True}},
        # an engine profile's fitted parameters (a spec-tree model inside the strict request; schemathesis found it)
        {"training": {"seq_len": 2048, "global_batch_size": 8, "engine": "megatron", "tuning": {"overlap": False}}},
        {"training": {"seq_len": 2048, "global_batch_size": 8, "engine": "megatron", "tuning": {"overlap": "0.5"}}},
        {
            "model": {
                "name": "m",
                "num_layers": True,
                "hidden_size": 64,
                "num_attention_heads": 4,
                "ffn_hidden_size": 256,
                "vocab_size": 128,
            }
        },
    ):
        r = httpx.post(server.url + "/v1/plans", json={**PLAN_BODY, **patch}, timeout=30)
        assert r.status_code == 422, (patch, r.text[:300])


@pytest.mark.parametrize(
    "key,value",
    [
        ("attention_dropout", "abc"),
        ("num_hidden_layers", "8"),
        ("tie_word_embeddings", "yes"),
        ("hidden_act", 3),
        ("num_key_value_heads", 2.5),
        ("_name_or_path", "a b"),
    ],
)
def test_hf_fields_of_the_wrong_type_are_422_naming_the_hf_key(server, key, value):
    hf = {
        "model_type": "llama",
        "num_hidden_layers": 8,
        "hidden_size": 1024,
        "num_attention_heads": 16,
        "num_key_value_heads": 4,
        "intermediate_size": 2816,
        "vocab_size": 32000,
        key: value,
    }
    r = httpx.post(server.url + "/v1/plans", json={**PLAN_BODY, "model": hf}, timeout=30)
    assert r.status_code == 422, r.text
    assert key in r.json()["detail"][0]["loc"], r.json()


def test_responses_are_strict_json_with_null_for_undefined_costs(server):
    body = {
        **PLAN_BODY,
        "cluster": {"preset": "dgx-h100", "nodes": 64},
        "operations": {"failures_per_gpu_hour": 1.0, "price_per_gpu_hour": 2.0},
        "search": {"top": 2, "objective": "goodput"},
    }
    r = httpx.post(server.url + "/v1/plans", json=body, timeout=60)
    assert r.status_code == 200, r.text[:300]
    goodput = strict_json(r.text)["plans"][0]["prediction"]["goodput"]
    assert goodput["goodput_tokens_per_s"] == 0 and goodput["cost_per_million_tokens"] is None
    again = httpx.get(f"{server.url}/v1/plans/{r.json()['id']}")
    strict_json(again.text)


def test_chunked_body_over_the_limit_is_413(server):
    def chunks():
        yield b'{"model": "'
        for _ in range(40):
            yield b"a" * 65536
        yield b'"}'

    r = httpx.post(server.url + "/v1/plans", content=chunks(), headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == 413, r.text
    assert httpx.get(server.url + "/healthz").status_code == 200


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded", "application/xml", ""])
def test_non_json_content_type_is_415(server, content_type):
    r = _post_raw(server.url, json.dumps(PLAN_BODY), content_type)
    assert r.status_code == 415, (content_type, r.status_code)
    strict_json(r.text)


def test_fifo_is_never_opened_by_the_cli_edge_of_the_api(tmp_path):
    """The service refuses a path before touching it: the catalog is an enum in the schema."""
    from berth.api.schemas import PRESETS, PresetCluster

    assert "local" in PRESETS and all(
        stat.S_ISREG(os.stat(ROOT / "hardware_profiles" / "servers" / f"{p}.json").st_mode)
        for p in PRESETS
        if p != "local"
    )
    schema = PresetCluster.model_json_schema()["properties"]["preset"]
    assert schema.get("enum") and set(schema["enum"]) == set(PRESETS)
