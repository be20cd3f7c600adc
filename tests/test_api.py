"""The REST service over HTTP: a real `berth serve` (uvicorn) on loopback, its SQLite store on
disk, restarts, concurrency, limits, bad input, and a schemathesis run against /openapi.json."""

import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from berth_server import Server

PLAN_BODY = {
    "model": "llama3-70b",
    "training": {"seq_len": 8192, "global_batch_size": 256},
    "cluster": {"preset": "dgx-h100", "nodes": 8},
    "search": {"top": 3},
}
TINY_LOCAL = {
    "model": "tiny-gpt",
    "training": {"seq_len": 128, "global_batch_size": 8},
    "cluster": {"preset": "local", "devices_per_node": 2},
    "search": {"top": 2, "fix": "dp=2,zero=0"},
}


@pytest.fixture
def server(tmp_path):
    s = Server(tmp_path / "store.sqlite")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def shared_server(tmp_path_factory):
    """One server for the tests whose requests are all refused (nothing they send is stored): a
    server start costs seconds on a loaded 2-core machine, and the bad-input matrix has ~20 cases."""
    s = Server(tmp_path_factory.mktemp("api") / "store.sqlite")
    yield s
    s.stop()


def test_plan_is_stored_and_survives_a_restart(tmp_path):
    store = tmp_path / "store.sqlite"
    s = Server(store)
    try:
        r = httpx.post(s.url + "/v1/plans", json=PLAN_BODY, timeout=30)
        assert r.status_code == 200, r.text
        body = r.json()
        assert len(body["plans"]) == 3 and body["searched"] > 1000
        assert all(p["prediction"]["fits"] and p["layout"]["tp"] <= 8 for p in body["plans"])
    finally:
        s.stop()
    s = Server(store)
    try:
        again = httpx.get(f"{s.url}/v1/plans/{body['id']}", timeout=10)
        assert again.status_code == 200 and again.json() == body
    finally:
        s.stop()


def test_same_json_as_the_cli(server):
    api = httpx.post(server.url + "/v1/plans", json=PLAN_BODY, timeout=30).json()
    cli = subprocess.run(
        [
            sys.executable,
            "-m",
            "berth.cli.main",
            "plan",
            "llama3-70b",
            "--cluster",
            "dgx-h100",
            "--nodes",
            "8",
            "--seq-len",
            "8192",
            "--global-batch",
            "256",
            "--top",
            "3",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert json.loads(cli.stdout)["plans"] == api["plans"]


def test_launch_files_goodput_fallback_and_fat_tree_over_http(server):
    c = httpx.Client(base_url=server.url, timeout=60)
    body = {
        **PLAN_BODY,
        "operations": {"failures_per_gpu_hour": 1e-4, "price_per_gpu_hour": 2.0},
        "search": {"top": 2, "objective": "goodput", "fallback": True},
    }
    body["cluster"] = {
        "preset": "dgx-h100",
        "nodes": 4,
        "fabric": "fat-tree",
        "nodes_per_leaf": 2,
        "oversubscription": 2,
    }
    r = c.post("/v1/plans", json=body)
    assert r.status_code == 200, r.text
    first = r.json()["plans"][0]
    assert first["prediction"]["goodput"]["cost_per_million_tokens"] > 0 and first["fallback"]["world_size"] == 24
    assert first["placement"]["rank_map"] and "leaf" not in first["cluster"]["fabric"][0]["name"]
    plan_id = r.json()["id"]
    for fmt, name in (("slurm", "berth.sbatch"), ("torchrun", "node3.sh"), ("kubernetes", "pytorchjob.yaml")):
        r = c.post("/v1/launch", json={"plan_id": plan_id, "format": fmt})
        assert r.status_code == 200 and name in r.json()["files"], r.text
    r = c.post("/v1/launch", json={"plan_id": plan_id, "format": "megatron"})
    x = first["layout"]
    if x["zero_stage"] >= 2 and x["shard"] < x["dp"]:  # Megatron FSDP over fewer ranks than dp: refused
        assert r.status_code == 422 and "cannot express" in r.text
    else:
        assert r.status_code == 200 and "--tensor-model-parallel-size" in r.json()["files"]["megatron-args.txt"]
    assert c.post("/v1/launch", json={"plan_id": plan_id, "format": "mpirun"}).status_code == 422
    assert c.post("/v1/launch", json={"plan_id": "nope", "format": "slurm"}).status_code == 404
    assert c.post("/v1/launch", json={"plan_id": plan_id, "pick": 9, "format": "slurm"}).status_code == 422


def test_catalog_compare_and_health(server):
    c = httpx.Client(base_url=server.url, timeout=30)
    assert c.get("/healthz").json()["status"] == "ok"
    assert "llama3-70b" in {m["name"] for m in c.get("/v1/models").json()}
    assert "dgx-h100" in {m["name"] for m in c.get("/v1/clusters").json()}
    assert "h100-sxm" in {m["name"] for m in c.get("/v1/hardware-profiles").json()}
    assert c.get("/v1/hardware-profiles/h100-sxm").json()["memory_bytes"] > 7e10
    assert c.get("/v1/hardware-profiles/nope").status_code == 404
    assert c.get("/v1/plans/nope").status_code == 404
    r = c.post(
        "/v1/compare",
        json={**{k: PLAN_BODY[k] for k in ("model", "training", "cluster")}, "layouts": ["tp=8,pp=2", {"tp": 1}]},
    )  # the second does not fit
    assert r.status_code == 200, r.text
    cands = r.json()["candidates"]
    assert cands[0]["prediction"] and cands[1]["infeasible_reason"]
    assert c.get(f"/v1/plans/{r.json()['id']}").json()["candidates"] == cands
    assert r.json()["memory_headroom"] == 0.05  # the executor's, none asked for
    r = c.post(
        "/v1/compare",
        json={
            **{k: PLAN_BODY[k] for k in ("model", "training", "cluster")},
            "layouts": ["tp=8,pp=2"],
            "memory_headroom": 0.2,
        },
    )
    assert r.status_code == 200 and r.json()["memory_headroom"] == 0.2, r.text
    assert c.get("/docs").status_code == 200 and "/v1/plans" in c.get("/openapi.json").json()["paths"]


def test_inline_model_hf_config_and_graph(server):
    hf = {
        "model_type": "llama",
        "num_hidden_layers": 8,
        "hidden_size": 1024,
        "num_attention_heads": 16,
        "num_key_value_heads": 4,
        "intermediate_size": 2816,
        "vocab_size": 32000,
    }
    graph = {
        "nodes": [{"id": f"g{i}", "kind": "gpu", "device": "h100-sxm", "host": "n0"} for i in range(4)]
        + [{"id": "sw", "kind": "switch"}],
        "links": [
            {"source": f"g{i}", "target": "sw", "kind": "nvswitch", "bandwidth_GBps": 450, "latency_us": 3.4}
            for i in range(4)
        ],
    }
    body = {"model": hf, "training": {"seq_len": 2048, "global_batch_size": 16}, "cluster": {"graph": graph}}
    r = httpx.post(server.url + "/v1/plans", json=body, timeout=30)
    assert r.status_code == 200, r.text
    plan = r.json()["plans"][0]
    assert plan["cluster"]["gpus_per_node"] == 4 and plan["model"]["num_kv_heads"] == 4


BAD = [
    ({"model": "nope"}, "model", "unknown preset"),
    ({"training": {"seq_len": -5, "global_batch_size": 8}}, "seq_len", ""),
    ({"training": {"seq_len": "long", "global_batch_size": 8}}, "seq_len", ""),
    ({"training": {"global_batch_size": 8}}, "seq_len", "required"),
    ({"cluster": {"preset": "dgx-h100", "nodes": 10**9}}, "nodes", ""),
    ({"cluster": {"preset": "dgx-h100", "nodes": 16384}}, "cluster", "more than this server plans for"),
    ({"cluster": {"preset": "warp-drive"}}, "preset", "dgx-h100"),  # the error lists the catalog
    (
        {
            "model": {
                "num_layers": 10**7,
                "hidden_size": 64,
                "num_attention_heads": 4,
                "ffn_hidden_size": 256,
                "vocab_size": 100,
            }
        },
        "num_layers",
        "",
    ),
    (
        {
            "model": {
                "num_layers": 2,
                "hidden_size": 100,
                "num_attention_heads": 3,
                "ffn_hidden_size": 256,
                "vocab_size": 100,
            }
        },
        "model",
        "not divisible",
    ),
    ({"model": {"model_type": "t5", "d_model": 8}}, "model", ""),
    (
        {
            "cluster": {
                "graph": {
                    "nodes": [{"id": "a", "kind": "gpu", "device": "h100-sxm", "host": "h"}],
                    "links": [{"source": "a", "target": "a", "kind": "nvlink", "bandwidth_GBps": 5}],
                }
            }
        },
        "links[0]",
        "self-loop",
    ),
    (
        {
            "cluster": {
                "graph": {
                    "nodes": [
                        {"id": "a", "kind": "gpu", "device": "h100-sxm", "host": "h"},
                        {"id": "b", "kind": "gpu", "device": "h100-sxm", "host": "h"},
                    ],
                    "links": [],
                }
            }
        },
        "graph",
        "disconnected",
    ),
    (
        {"cluster": {"graph": {"nodes": [{"id": "a", "kind": "gpu", "device": "tpu-v9", "host": "h"}], "links": []}}},
        "device",
        "unknown device",
    ),
    (
        {
            "cluster": {
                "graph": {
                    "nodes": [
                        {"id": "a", "kind": "gpu", "device": "h100-sxm", "host": "h"},
                        {"id": "a", "kind": "switch"},
                    ],
                    "links": [],
                }
            }
        },
        "id",
        "duplicate",
    ),
    (
        {
            "cluster": {
                "graph": {
                    "nodes": [
                        {"id": "a", "kind": "gpu", "device": "h100-sxm", "host": "h"},
                        {"id": "s", "kind": "switch"},
                    ],
                    "links": [{"source": "a", "target": "s", "kind": "nvlink", "bandwidth_GBps": -1}],
                }
            }
        },
        "bandwidth_GBps",
        "positive",
    ),
    ({"cluster": {"graph": "not a graph"}}, "graph", ""),
    ({"training": {"seq_len": 8192, "global_batch_size": 256, "framework": "jax"}}, "framework", "megatron"),
    ({"search": {"fix": "tp=banana"}}, "fix", ""),
    ({"search": {"top": 0}}, "top", ""),
    ({"unexpected": 1}, "unexpected", ""),
]


@pytest.mark.parametrize("patch,field,problem", BAD, ids=[b[1] + ":" + b[2] for b in BAD])
def test_bad_input_is_a_4xx_naming_the_field(shared_server, patch, field, problem):
    body = {**PLAN_BODY, **patch}
    r = httpx.post(shared_server.url + "/v1/plans", json=body, timeout=30)
    assert 400 <= r.status_code < 500, r.text
    detail = r.json()["detail"]
    assert any(field in [str(x) for x in d["loc"]] or field in str(d["loc"][-1]) for d in detail), detail
    assert problem.lower() in json.dumps(detail).lower()


def test_oversized_and_malformed_bodies(shared_server):
    server = shared_server
    r = httpx.post(
        server.url + "/v1/plans",
        content=b"{" + b" " * 2_000_000 + b"}",
        headers={"content-type": "application/json"},
        timeout=30,
    )
    assert r.status_code == 413
    r = httpx.post(server.url + "/v1/plans", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code in (400, 422)
    assert httpx.get(server.url + "/healthz").status_code == 200


def test_concurrent_requests_all_answered_and_stored(server):
    def ask(i):
        body = {**PLAN_BODY, "search": {"top": 1 + i % 3}}
        return httpx.post(server.url + "/v1/plans", json=body, timeout=60)

    with ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(ask, range(32)))
    assert all(a.status_code == 200 for a in answers)
    ids = {a.json()["id"] for a in answers}
    assert len(ids) == 32
    for a in answers[:8]:
        assert httpx.get(f"{server.url}/v1/plans/{a.json()['id']}").json() == a.json()


def test_search_over_budget_is_503_and_server_stays_responsive(tmp_path):
    s = Server(tmp_path / "store.sqlite", request_timeout_s=0.05, max_concurrent_searches=1)
    try:
        body = {
            "model": "gpt-1t",
            "training": {"seq_len": 2048, "global_batch_size": 3072},
            "cluster": {"preset": "dgx-a100-80g", "nodes": 384},
        }
        start = time.monotonic()
        r = httpx.post(s.url + "/v1/plans", json=body, timeout=30)
        assert r.status_code == 503 and "budget" in r.json()["detail"]
        assert time.monotonic() - start < 5
        assert httpx.get(s.url + "/healthz", timeout=2).status_code == 200
    finally:
        s.stop()


def test_candidate_limit_refuses_huge_searches(tmp_path):
    s = Server(tmp_path / "store.sqlite", max_candidates=1000)
    try:
        r = httpx.post(s.url + "/v1/plans", json=PLAN_BODY, timeout=30)
        assert r.status_code == 422 and "search.fix" in json.dumps(r.json())
    finally:
        s.stop()


def test_validation_disabled_by_default(server):
    plan_id = httpx.post(server.url + "/v1/plans", json=PLAN_BODY, timeout=30).json()["id"]
    r = httpx.post(server.url + "/v1/validations", json={"plan_id": plan_id})
    assert r.status_code == 403 and "disabled" in r.json()["detail"]


def test_validation_runs_in_background_with_api_key(tmp_path):
    pytest.importorskip("torch", reason="the validation runs the executor (torch: the executor extra)")
    s = Server(tmp_path / "store.sqlite", validation_enabled=1, api_key="sekret-sekret-sekret")
    try:
        c = httpx.Client(base_url=s.url, timeout=30)
        plan_id = c.post("/v1/plans", json=TINY_LOCAL).json()["id"]
        assert c.post("/v1/validations", json={"plan_id": plan_id}).status_code == 401
        assert c.post("/v1/validations", json={"plan_id": plan_id}, headers={"X-API-Key": "wrong"}).status_code == 401
        key = {"X-API-Key": "sekret-sekret-sekret"}
        assert c.post("/v1/validations", json={"plan_id": "nope"}, headers=key).status_code == 404
        r = c.post("/v1/validations", json={"plan_id": plan_id, "steps": 2, "warmup": 1}, headers=key)
        assert r.status_code == 202, r.text
        job = r.json()
        deadline = time.monotonic() + 180
        while job["status"] in ("queued", "running") and time.monotonic() < deadline:
            time.sleep(1)
            job = c.get(f"/v1/validations/{job['id']}", headers=key).json()
        assert job["status"] == "done", job
        assert job["report"]["measured"]["step_time_s"] > 0 and job["report"]["plan"]["layout"]["dp"] == 2
        breakdown = job["report"]["breakdown"]  # the measured step terms, as `berth validate` reports them
        assert breakdown["terms"]["compute"]["measured_s"] > 0 and breakdown["terms"]["dp_comm"]["measured_s"] > 0
        assert breakdown["terms"]["tp_comm"]["measured_s"] is None and breakdown["largest_error_term"]
    finally:
        s.stop()


def test_schemathesis_finds_no_server_error_or_schema_violation(server, tmp_path):
    cmd = [
        sys.executable,
        "-m",
        "schemathesis.cli",
        "run",
        server.url + "/openapi.json",
        "--max-examples",
        "30",
        "--exclude-checks",
        "positive_data_acceptance",
        "--seed",
        "1",
        "--report-dir",
        str(tmp_path),
    ]
    checked = tmp_path / "strict-json.log"
    env = {
        **os.environ,
        "SCHEMATHESIS_HOOKS": "schemathesis_hooks",  # adds the strict_json check
        "PYTHONPATH": os.pathsep.join([os.path.dirname(__file__), os.environ.get("PYTHONPATH", "")]),
        "STRICT_JSON_CHECKED": str(checked),
    }
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0, r.stdout[-5000:]
    assert len(checked.read_text().split()) > 100  # the strict JSON check ran on the responses


def test_context_parallel_layout_and_fix_over_http(server):
    """cp in a search's fix (text and object) and in a compared layout; the plan JSON carries it, its
    placement lists the cp groups, and a cp the sequence cannot split is a 422 naming the field."""
    c = httpx.Client(base_url=server.url, timeout=60)
    body = {**PLAN_BODY, "training": {"seq_len": 32768, "global_batch_size": 32}, "search": {"top": 1, "fix": "cp=4"}}
    r = c.post("/v1/plans", json=body)
    assert r.status_code == 200, r.text
    (plan,) = r.json()["plans"]
    assert plan["layout"]["cp"] == 4 and "cp" in {g["axis"] for g in plan["placement"]["groups"]}
    r = c.post(
        "/v1/compare",
        json={
            **{k: body[k] for k in ("model", "training", "cluster")},
            "layouts": ["tp=8,cp=2,pp=2", {"tp": 8, "cp": 4}],
        },
    )
    assert r.status_code == 200, r.text
    assert [x["layout"]["cp"] for x in r.json()["candidates"]] == [2, 4]
    bad = {**PLAN_BODY, "training": {"seq_len": 1000, "global_batch_size": 32}, "search": {"fix": {"cp": 16}}}
    r = c.post("/v1/plans", json=bad)
    assert r.status_code == 422 and "cp" in r.text, r.text


def test_expert_tp_in_compare_over_http(server):
    """expert_tp (text `etp=1` and object) in compared layouts: the plan JSON carries it, the ep group of
    whole experts lies inside one node, and a value that does not divide tp is a 422 naming the field."""
    c = httpx.Client(base_url=server.url, timeout=60)
    base = {
        "model": "mixtral-8x7b",
        "training": {"seq_len": 4096, "global_batch_size": 256},
        "cluster": {"preset": "dgx-h100", "nodes": 2},
    }
    folded = {"tp": 2, "ep": 8, "expert_tp": 1, "sequence_parallel": True, "zero_stage": 1, "recompute": "full"}
    r = c.post("/v1/compare", json={**base, "layouts": ["tp=2,ep=8,etp=1,sp=1,zero=1,recompute=full", folded]})
    assert r.status_code == 200, r.text
    candidates = r.json()["candidates"]
    assert [x["layout"]["expert_tp"] for x in candidates] == [1, 1]
    (ep,) = [g for g in candidates[0]["placement"]["groups"] if g["axis"] == "ep"]
    assert ep["stride"] == 1 and ep["nodes_spanned"] == 1
    r = c.post("/v1/compare", json={**base, "layouts": ["tp=4,ep=4,etp=3,sp=1", folded]})
    assert r.status_code == 200, r.text
    refused, kept = r.json()["candidates"]
    assert refused["prediction"] is None and "expert_tp" in refused["infeasible_reason"], refused["infeasible_reason"]
    assert kept == candidates[1] and r.json()["choice"] == 1


def test_fp8_plans_over_http_and_refusals_name_the_field(server):
    """`precision: fp8` plans with the engine's first FP8 recipe, the plan carries it; an engine without FP8 is
    refused with 422 naming the field training.fp8 and the engine (nothing stored)."""
    body = {**PLAN_BODY, "training": {**PLAN_BODY["training"], "precision": "fp8", "engine": "megatron"}}
    r = httpx.post(server.url + "/v1/plans", json=body, timeout=60)
    assert r.status_code == 200, r.text
    assert all(p["training"]["fp8"] == "delayed" and p["training"]["precision"] == "bf16" for p in r.json()["plans"])
    bad = {**PLAN_BODY, "training": {**PLAN_BODY["training"], "fp8": "delayed", "engine": "deepspeed"}}
    r = httpx.post(server.url + "/v1/plans", json=bad, timeout=30)
    assert r.status_code == 422, r.text
    (detail,) = r.json()["detail"]
    assert detail["loc"][-2:] == ["training", "fp8"] and "DeepSpeed 0.19.8 has no FP8" in detail["msg"], detail


def test_plan_answer_carries_the_notes_berth_plan_prints(shared_server):
    """GPT-2 XL's 50,257-word head breaks its GEMMs' alignment: the API's answer carries the note `berth plan` prints
    under #1 (planning.vocabulary_note), and the stored answer keeps it; an aligned vocabulary's notes are empty."""
    from pathlib import Path

    gpt2 = json.loads((Path(__file__).resolve().parents[1] / "examples" / "models" / "gpt2-xl.json").read_text())
    body = {**PLAN_BODY, "model": gpt2, "training": {"seq_len": 4096, "global_batch_size": 64}}
    body["cluster"], body["search"] = {"preset": "dgx-h100", "nodes": 1}, {"top": 1}
    r = httpx.post(shared_server.url + "/v1/plans", json=body, timeout=60)
    assert r.status_code == 200, r.text
    notes = r.json()["notes"]
    assert len(notes) == 1 and "50,257 vocabulary rows" in notes[0] and "padded to 50,304" in notes[0]
    stored = httpx.get(f"{shared_server.url}/v1/plans/{r.json()['id']}", timeout=10).json()
    assert stored["notes"] == notes
    aligned = httpx.post(shared_server.url + "/v1/plans", json={**body, "model": "llama3-8b"}, timeout=60)
    assert aligned.status_code == 200 and aligned.json()["notes"] == []
