"""The CLI and the REST API turn the same input into the same specs, through the one conversion
in berth.planner.inputs: the same question asked as `berth plan/compare ... --json` (in-process,
through the CLI's own `main`) and as POST /v1/plans or /v1/compare (in-process, the ASGI client
with `get_service` overridden by a real Service on a tmp SQLite file) gives the same model,
training and cluster specs and the same plans; the same bad value is refused on both edges
naming the same field (CLI: exit 2, one line; API: 422 whose loc names it)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from berth.api.app import create_app
from berth.api.service import Service, get_service
from berth.api.settings import Settings
from berth.cli.main import main

# A small Hugging Face config: a file for the CLI, the same object inline for the API.
HF_CONFIG = {
    "model_type": "llama",
    "_name_or_path": "tiny-hf",
    "num_hidden_layers": 4,
    "hidden_size": 256,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "intermediate_size": 688,
    "vocab_size": 1024,
    "max_position_embeddings": 2048,
}


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("inputs")
    service = Service(Settings(store_path=str(tmp / "override.sqlite")))
    app = create_app(Settings(store_path=str(tmp / "app.sqlite")))
    app.dependency_overrides[get_service] = lambda: service
    with TestClient(app) as c:
        yield c
    service.close()


@pytest.fixture(scope="module")
def hf_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("hf") / "config.json"
    path.write_text(json.dumps(HF_CONFIG))
    return path


def cli(capsys, args: list[str]) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as ex:
        main([str(a) for a in args])
    out, err = capsys.readouterr()
    return ex.value.code, out, err


BASE = ["--seq-len", "256", "--global-batch", "8"]
BODY = {"training": {"seq_len": 256, "global_batch_size": 8}, "cluster": {"preset": "dgx-h100"}}

# (CLI arguments after the model, the API body's changes to BODY): the same question
SAME = {
    "defaults": ([], {}),
    "fat-tree, fp16, megatron, no flash": (
        [
            *("--nodes", "2", "--fabric", "fat-tree", "--nodes-per-leaf", "1", "--oversubscription", "2"),
            *("--precision", "fp16", "--framework", "megatron", "--no-flash-attention"),
        ],
        {
            "cluster": {
                "preset": "dgx-h100",
                "nodes": 2,
                "fabric": "fat-tree",
                "nodes_per_leaf": 1,
                "oversubscription": 2.0,
            },
            "training": {
                "seq_len": 256,
                "global_batch_size": 8,
                "precision": "fp16",
                "framework": "megatron",
                "flash_attention": False,
            },
        },
    ),
    "operations and token budget": (
        [
            *("--cluster", "dgx-a100-80g", "--failures-per-gpu-hour", "1e-4"),
            *("--storage-gbps-per-gpu", "0.5", "--price-per-gpu-hour", "2.5", "--token-budget", "1e9"),
        ],
        {
            "cluster": {"preset": "dgx-a100-80g"},
            "training": {"seq_len": 256, "global_batch_size": 8, "token_budget": 1e9},
            "operations": {"failures_per_gpu_hour": 1e-4, "storage_write_gbps_per_gpu": 0.5, "price_per_gpu_hour": 2.5},
        },
    ),
    "local CPU workers (default precision)": (
        ["--cluster", "local", "--devices-per-node", "2"],
        {"cluster": {"preset": "local", "devices_per_node": 2}},
    ),
}
SEARCH = (
    ["--top", "3", "--fix", "tp=2", "--max-mbs", "2", "--objective", "cost", "--memory-headroom", "0.1"],
    {"top": 3, "fix": "tp=2", "max_micro_batch_size": 2, "objective": "cost", "memory_headroom": 0.1},
)


def _merge(patch: dict) -> dict:
    return {**BODY, **patch}


def _specs(plan: dict) -> dict:
    return {k: plan[k] for k in ("model", "training", "cluster")}


@pytest.mark.parametrize("case", list(SAME))
@pytest.mark.parametrize("model", ["preset", "hf-config"])
def test_plan_same_specs_and_plans_on_both_edges(client, capsys, hf_file, case, model):
    args, patch = SAME[case]
    cli_model, api_model = ("tiny-gpt", "tiny-gpt") if model == "preset" else (hf_file, HF_CONFIG)
    search_args, search = SEARCH if case == "operations and token budget" else (["--top", "2"], {"top": 2})
    code, out, err = cli(capsys, ["plan", cli_model, *BASE, *args, *search_args, "--json"])
    assert code == 0, err
    by_cli = json.loads(out)
    r = client.post("/v1/plans", json={**_merge(patch), "model": api_model, "search": search})
    assert r.status_code == 200, r.text
    by_api = r.json()
    assert by_cli["plans"], "a question with an answer"
    assert [_specs(p) for p in by_api["plans"]] == [_specs(p) for p in by_cli["plans"]]
    assert by_api["plans"] == by_cli["plans"]
    assert {k: by_api[k] for k in ("searched", "feasible", "rejected")} == {
        k: by_cli[k] for k in ("searched", "feasible", "rejected")
    }


def test_compare_same_specs_on_both_edges(client, capsys):
    args, patch = SAME["operations and token budget"]
    layouts = ["tp=2,zero=1", "tp=4"]
    code, out, err = cli(
        capsys,
        ["compare", "tiny-gpt", *BASE, *args, *[x for lay in layouts for x in ("--layout", lay)], "--json"],
    )
    assert code == 0, err
    by_cli = json.loads(out)
    r = client.post("/v1/compare", json={**_merge(patch), "model": "tiny-gpt", "layouts": layouts})
    assert r.status_code == 200, r.text
    by_api = r.json()
    assert [_specs(p) for p in by_api["candidates"]] == [_specs(p) for p in by_cli["candidates"]]
    assert by_cli["candidates"][0]["cluster"]["price_per_gpu_hour"] == 2.5
    assert by_api["candidates"] == by_cli["candidates"] and by_api["best_searched"] == by_cli["best_searched"]


# (CLI arguments after the model, the API body's changes, the field both must name)
BAD = [
    (["--seq-len", "0"], {"training": {"seq_len": 0, "global_batch_size": 8}}, "training.seq_len"),
    (["--global-batch", "-8"], {"training": {"seq_len": 256, "global_batch_size": -8}}, "training.global_batch_size"),
    (["--precision", "fp7"], {"training": {**BODY["training"], "precision": "fp7"}}, "training.precision"),
    (["--engine", "jax"], {"training": {**BODY["training"], "engine": "jax"}}, "training.engine"),
    (["--token-budget", "-5"], {"training": {**BODY["training"], "token_budget": -5.0}}, "training.token_budget"),
    (["--nodes", "0"], {"cluster": {"preset": "dgx-h100", "nodes": 0}}, "cluster.nodes"),
    (["--fabric", "torus"], {"cluster": {"preset": "dgx-h100", "fabric": "torus"}}, "cluster.fabric"),
    (
        ["--nodes", "2", "--fabric", "fat-tree", "--oversubscription", "100"],
        {"cluster": {"preset": "dgx-h100", "nodes": 2, "fabric": "fat-tree", "oversubscription": 100.0}},
        "cluster.oversubscription",
    ),
    (
        ["--nodes", "2", "--fabric", "fat-tree", "--nodes-per-leaf", "5"],
        {"cluster": {"preset": "dgx-h100", "nodes": 2, "fabric": "fat-tree", "nodes_per_leaf": 5}},
        "cluster.nodes_per_leaf",
    ),
    (
        ["--devices-per-node", "2"],
        {"cluster": {"preset": "dgx-h100", "devices_per_node": 2}},
        "cluster.devices_per_node",
    ),
    (["--cluster", "local", "--nodes", "2"], {"cluster": {"preset": "local", "nodes": 2}}, "cluster.nodes"),
    (
        ["--failures-per-gpu-hour", "-1"],
        {"operations": {"failures_per_gpu_hour": -1.0}},
        "operations.failures_per_gpu_hour",
    ),
    (
        ["--storage-gbps-per-gpu", "0"],
        {"operations": {"storage_write_gbps_per_gpu": 0.0}},
        "operations.storage_write_gbps_per_gpu",
    ),
    (["--price-per-gpu-hour", "-1"], {"operations": {"price_per_gpu_hour": -1.0}}, "operations.price_per_gpu_hour"),
    (["--top", "0"], {"search": {"top": 0}}, "search.top"),
    (["--max-mbs", "-3"], {"search": {"max_micro_batch_size": -3}}, "search.max_micro_batch_size"),
    (["--objective", "speed"], {"search": {"objective": "speed"}}, "search.objective"),
    (["--memory-headroom", "0.9"], {"search": {"memory_headroom": 0.9}}, "search.memory_headroom"),
    (["--fix", "tp=banana"], {"search": {"fix": "tp=banana"}}, "fix.tp"),
]


def _api_field(loc: list) -> str:
    """FastAPI's loc as a dotted field: without "body" and the cluster union's tag."""
    parts = [str(p) for p in loc[1:]]
    if parts[:1] == ["cluster"] and len(parts) > 2 and parts[1] in ("preset", "graph"):
        del parts[1]
    return ".".join(parts)


@pytest.mark.parametrize("args,patch,field", BAD, ids=[b[2] + ":" + " ".join(b[0]) for b in BAD])
def test_bad_value_names_the_same_field_on_both_edges(client, capsys, args, patch, field):
    code, out, err = cli(capsys, ["plan", "tiny-gpt", *BASE, *args])
    assert code == 2, (out, err)
    line = err.strip()
    assert len(line.splitlines()) == 1 and line.startswith("error: "), err
    assert line.removeprefix("error: ").split("=", 1)[0] == field, line
    r = client.post("/v1/plans", json={**_merge(patch), "model": "tiny-gpt"})
    assert r.status_code == 422, r.text
    assert field in [_api_field(d["loc"]) for d in r.json()["detail"]], r.text


def test_a_file_is_read_by_the_cli_only(client, capsys, hf_file):
    """The CLI reads a model or graph file (the user's own disk); the same name in a request is
    refused naming the field, and the shared conversion is told so by its required allow_files."""
    from berth.planner.inputs import ClusterInput, TrainingInput, resolve
    from berth.specs.errors import BerthError

    training = TrainingInput(256, 8)
    assert resolve(str(hf_file), ClusterInput(), training, allow_files=True)[0].name == "tiny-hf"
    with pytest.raises(BerthError) as err:
        resolve(str(hf_file), ClusterInput(), training, allow_files=False)
    assert err.value.field == "model"
    with pytest.raises(BerthError) as err:
        resolve("tiny-gpt", ClusterInput(str(hf_file)), training, allow_files=False)
    assert err.value.field == "cluster.preset"
    with pytest.raises(BerthError) as err:
        resolve("tiny-gpt", ClusterInput(profile=str(hf_file)), training, allow_files=False)
    assert err.value.field == "profile"
    r = client.post("/v1/plans", json={**BODY, "model": str(hf_file)})
    assert r.status_code == 422 and ["body", "model"] in [d["loc"] for d in r.json()["detail"]], r.text
