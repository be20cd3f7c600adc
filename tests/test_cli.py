"""The `berth` CLI as a user runs it: a real subprocess, JSON contract, exit codes."""

import json
import subprocess
import sys

import pytest

BERTH = [sys.executable, "-m", "planner.cli"]
PREDICTION_KEYS = {"step_time_s", "tokens_per_s", "mfu", "peak_memory_bytes", "fits", "bottleneck",
                   "time_breakdown_s", "memory_breakdown_bytes"}


def berth(*args):
    return subprocess.run([*BERTH, *args], capture_output=True, text=True, timeout=120)


def test_plan_json_contract_and_tp_inside_node():
    r = berth("plan", "llama3-70b", "--cluster", "dgx-h100", "--nodes", "8", "--seq-len", "8192",
              "--global-batch", "256", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["searched"] > 1000 and sum(out["rejected"].values()) + out["feasible"] == out["searched"]
    assert len(out["plans"]) == 5
    for p in out["plans"]:
        assert set(p["prediction"]) >= PREDICTION_KEYS
        assert p["infeasible_reason"] is None and p["prediction"]["fits"]
        assert p["layout"]["tp"] <= 8
        lay = p["layout"]
        assert lay["tp"] * lay["pp"] * lay["dp"] == 64
        assert lay["dp"] * lay["micro_batch_size"] * lay["num_microbatches"] == 256
    times = [p["prediction"]["step_time_s"] for p in out["plans"]]
    assert times == sorted(times)


def test_plan_fix_restricts_the_search():
    r = berth("plan", "llama3-70b", "--cluster", "dgx-h100", "--nodes", "8", "--seq-len", "4096",
              "--global-batch", "128", "--fix", "tp=8,pp=2", "--json", "--top", "3")
    assert r.returncode == 0, r.stderr
    plans = json.loads(r.stdout)["plans"]
    assert plans and all(p["layout"]["tp"] == 8 and p["layout"]["pp"] == 2 for p in plans)


def test_framework_changes_sequence_parallel_memory_only():
    """DTensor sp (pytorch) keeps gathered activations Megatron-LM re-gathers: more memory, same time.
    Without sp the step time is the same too; memory follows each stack's precision recipe (the
    executor's fp32 parameters under autocast, with its bf16 weight cache; Megatron's 16-bit ones)."""
    def one(framework, layout):
        r = berth("compare", "llama3-8b", "--cluster", "dgx-h100", "--seq-len", "4096", "--global-batch", "32",
                  "--layout", layout, "--framework", framework, "--json")
        assert r.returncode == 0, r.stderr
        return json.loads(r.stdout)["candidates"][0]["prediction"]

    pt, mg = one("pytorch", "tp=8,sp=1,mbs=1"), one("megatron", "tp=8,sp=1,mbs=1")
    assert pt["memory_breakdown_bytes"]["activations"] > mg["memory_breakdown_bytes"]["activations"]
    assert pt["step_time_s"] == mg["step_time_s"]
    pt, mg = one("pytorch", "tp=8,mbs=1"), one("megatron", "tp=8,mbs=1")
    assert pt["step_time_s"] == mg["step_time_s"]
    assert pt["memory_breakdown_bytes"]["autocast_copies"] > 0 == mg["memory_breakdown_bytes"]["autocast_copies"]


def test_compare_keeps_misfits_with_reasons():
    # Megatron bf16 holds 18 bytes per parameter without its distributed optimizer (16-bit weights,
    # fp32 grad buffer, fp32 main weights + Adam), 6 + 12/dp with it (zero=1)
    r = berth("compare", "llama3-70b", "--cluster", "dgx-h100", "--nodes", "4", "--seq-len", "8192",
              "--global-batch", "64", "--layout", "tp=8,pp=2,zero=1,recompute=full,mbs=1",
              "--layout", "tp=8,zero=3", "--layout", "tp=16", "--layout", "tp=3",
              "--framework", "megatron", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    cands = out["candidates"]
    assert len(cands) == 4
    assert cands[0]["infeasible_reason"] is None and cands[0]["prediction"]["fits"]
    assert cands[1]["infeasible_reason"].startswith("out_of_memory")
    assert cands[1]["prediction"]["fits"] is False
    assert cands[2]["infeasible_reason"].startswith("tp_not_divide_kv_heads")
    assert cands[3]["infeasible_reason"].startswith("world_size_mismatch")
    assert out["gap_to_best"][0] <= 0.0 and out["gap_to_best"][1] is None
    assert out["best_searched"]["prediction"]["tokens_per_s"] >= cands[0]["prediction"]["tokens_per_s"]


def test_plan_table_output():
    r = berth("plan", "llama3-8b", "--cluster", "dgx-a100-80g", "--nodes", "1", "--seq-len", "4096",
              "--global-batch", "64", "--top", "2")
    assert r.returncode == 0, r.stderr
    assert "tokens/s" in r.stdout and "searched" in r.stdout and "bottleneck" in r.stdout


@pytest.mark.parametrize("args,field", [
    (["plan", "llama3-70b", "--cluster", "dgx-h999", "--nodes", "1"], "cluster.preset"),
    (["plan", "llama3-70b", "--cluster", "dgx-h100", "--nodes", "0"], "cluster.nodes"),
    (["plan", "nope-model"], "model"),
    (["plan", "tiny-gpt", "--cluster", "dgx-h100", "--nodes", "4", "--global-batch", "7"],
     "training.global_batch_size"),
    (["plan", "llama3-8b", "--seq-len", "-5"], "training.seq_len"),
    (["plan", "llama3-8b", "--fix", "tq=2"], "fix"),
    (["plan", "llama3-8b", "--precision", "fp7"], "training.precision"),
    (["compare", "llama3-8b", "--layout", "tp=two"], "layout[0].tp"),
])
def test_bad_input_exits_2_with_one_clear_line(args, field):
    r = berth(*args)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert "Traceback" not in r.stderr
    assert field in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_heads_not_divisible_model_file(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps({"num_layers": 2, "hidden_size": 1000, "num_attention_heads": 3,
                                "ffn_hidden_size": 4000, "vocab_size": 100}))
    r = berth("plan", str(path))
    assert r.returncode == 2 and "num_attention_heads" in r.stderr and "Traceback" not in r.stderr


def test_topology_graph_file_plan_shows_crossings_and_fallback(tmp_path):
    graph = tmp_path / "fat.json"
    r = berth("topology", "dgx-h100:4", "--fabric", "fat-tree", "--nodes-per-leaf", "2", "--oversubscription", "4",
              "--out", str(graph))
    assert r.returncode == 0, r.stderr
    assert "shared" in r.stdout and "infiniband" in r.stdout and graph.is_file()
    r = berth("plan", "llama3-70b", "--cluster", str(graph), "--seq-len", "4096", "--global-batch", "64",
              "--top", "2", "--fallback", "--price-per-gpu-hour", "2")
    assert r.returncode == 0, r.stderr
    assert "placement of #1" in r.stdout and "cross" in r.stdout and "per step" in r.stdout
    assert "fallback with 1 node lost" in r.stdout and "goodput" in r.stdout
    r = berth("plan", "llama3-70b", "--cluster", str(graph), "--nodes", "2", "--seq-len", "4096",
              "--global-batch", "64")
    assert r.returncode == 2 and "graph file gives its own nodes" in r.stderr
    r = berth("plan", "llama3-70b", "--cluster", "dgx-h100", "--nodes", "2", "--seq-len", "4096",
              "--global-batch", "64", "--objective", "fastest")
    assert r.returncode == 2 and "objective" in r.stderr
