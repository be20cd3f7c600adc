"""The `berth` CLI as a user runs it: a real subprocess, JSON contract, exit codes."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

BERTH = [sys.executable, "-m", "berth.cli.main"]
EXAMPLES = Path(__file__).resolve().parents[1] / "examples" / "clusters"
PREDICTION_KEYS = {
    "step_time_s",
    "tokens_per_s",
    "mfu",
    "peak_memory_bytes",
    "fits",
    "bottleneck",
    "time_breakdown_s",
    "memory_breakdown_bytes",
}


def berth(*args):
    return subprocess.run([*BERTH, *args], capture_output=True, text=True, timeout=120)


def test_plan_json_contract_and_tp_inside_node():
    r = berth(
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
        "--json",
    )
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["searched"] > 1000 and sum(out["rejected"].values()) + out["feasible"] == out["searched"]
    assert len(out["plans"]) == 5
    for p in out["plans"]:
        assert set(p["prediction"]) >= PREDICTION_KEYS
        assert p["infeasible_reason"] is None and p["prediction"]["fits"]
        assert p["layout"]["tp"] <= 8
        lay = p["layout"]
        assert lay["tp"] * lay["cp"] * lay["pp"] * lay["dp"] == 64  # world = tp x cp x pp x dp
        assert lay["dp"] * lay["micro_batch_size"] * lay["num_microbatches"] == 256
    times = [p["prediction"]["step_time_s"] for p in out["plans"]]
    assert times == sorted(times)
    assert out["memory_headroom"] == 0.05  # the executor's: the plans leave it free
    assert all(
        p["prediction"]["peak_memory_bytes"] <= 0.95 * p["prediction"]["memory_capacity_bytes"] for p in out["plans"]
    )


# `berth plan` starts in well under a second (benchmarks/search_speed.py times it): these never load
# on its path, whatever the cluster (berth's own packages by their two-part names, berth.api)
NOT_ON_PLAN_PATH = {"torch", "fastapi", "starlette", "uvicorn", "scipy", "yaml", "berth.api", "berth.executor"}


def test_plan_path_imports_no_graph_library_service_stack_or_torch():
    code = f"""
import sys
from berth.cli.main import main
for argv in (["plan", "llama3-8b", "--cluster", "dgx-h100", "--nodes", "2", "--fallback"],
             ["plan", "llama3-8b", "--cluster", {str(EXAMPLES / "pcie-h100-bridged-pairs-2nodes.json")!r}, "--json"],
             ["compare", "llama3-8b", "--layout", "tp=8,pp=1,dp=1"]):
    try:
        main(argv)
    except SystemExit as done:
        assert done.code == 0, (argv, done.code)
sys.stderr.write("\\nloaded: " + " ".join(sorted(sys.modules)))
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    loaded = {
        ".".join(name.split(".")[:2]) if name.startswith("berth.") else name.split(".")[0]
        for name in r.stderr.rsplit("loaded: ", 1)[1].split()
    }
    assert "berth.planner" in loaded and "numpy" in loaded
    assert not loaded & NOT_ON_PLAN_PATH


def test_plan_fix_restricts_the_search():
    r = berth(
        "plan",
        "llama3-70b",
        "--cluster",
        "dgx-h100",
        "--nodes",
        "8",
        "--seq-len",
        "4096",
        "--global-batch",
        "128",
        "--fix",
        "tp=8,pp=2",
        "--json",
        "--top",
        "3",
    )
    assert r.returncode == 0, r.stderr
    plans = json.loads(r.stdout)["plans"]
    assert plans and all(p["layout"]["tp"] == 8 and p["layout"]["pp"] == 2 for p in plans)


def test_moe_plan_carries_ep_in_json_and_tables():
    args = (
        "plan",
        "mixtral-8x7b",
        "--cluster",
        "dgx-h100",
        "--nodes",
        "2",
        "--seq-len",
        "4096",
        "--global-batch",
        "256",
        "--fix",
        "ep=8",
        "--top",
        "2",
    )
    r = berth(*args, "--json")
    assert r.returncode == 0, r.stderr
    plans = json.loads(r.stdout)["plans"]
    # ep x expert_tp divides tp x dp (expert_tp null: tp, ep carved out of dp; 1: whole experts, ep over tp x dp)
    etp = [p["layout"]["expert_tp"] or p["layout"]["tp"] for p in plans]
    assert plans and all(
        p["layout"]["ep"] == 8 and (p["layout"]["tp"] * p["layout"]["dp"]) % (8 * e) == 0
        for p, e in zip(plans, etp, strict=True)
    )
    assert all("ep_comm" in p["prediction"]["time_breakdown_s"] for p in plans)
    table = subprocess.run(
        [*BERTH, *args], capture_output=True, text=True, timeout=120, env={**os.environ, "COLUMNS": "100"}
    )
    assert table.returncode == 0 and "ep8" in table.stdout and "time: ep_comm" in table.stdout, table.stdout


def test_framework_changes_sequence_parallel_memory_and_kernel_time():
    """DTensor sp (pytorch) keeps gathered activations Megatron-LM re-gathers: more memory, and Megatron's
    backward gathers them again (two all-gathers more a layer: more tensor-parallel traffic). The
    framework's kernels (device profile `frameworks`) set the non-GEMM layer time: Megatron's fused
    kernels are faster than eager PyTorch, with the same GEMMs. Memory follows each
    stack's precision recipe (the executor's fp32 parameters under autocast, with its bf16 weight
    cache; Megatron's 16-bit ones)."""

    def one(framework, layout):
        r = berth(
            "compare",
            "llama3-8b",
            "--cluster",
            "dgx-h100",
            "--seq-len",
            "4096",
            "--global-batch",
            "32",
            "--layout",
            layout,
            "--framework",
            framework,
            "--json",
        )
        assert r.returncode == 0, r.stderr
        return json.loads(r.stdout)["candidates"][0]["prediction"]

    pt, mg = one("pytorch", "tp=8,sp=1,mbs=1"), one("megatron", "tp=8,sp=1,mbs=1")
    assert pt["memory_breakdown_bytes"]["activations"] > mg["memory_breakdown_bytes"]["activations"]
    assert mg["step_time_s"] < pt["step_time_s"]
    tp_comm = pt["time_breakdown_s"]["tp_comm"]
    assert tp_comm < mg["time_breakdown_s"]["tp_comm"] < 1.5 * tp_comm
    pt, mg = one("pytorch", "tp=8,mbs=1"), one("megatron", "tp=8,mbs=1")
    assert pt["time_breakdown_s"]["tp_comm"] == mg["time_breakdown_s"]["tp_comm"]  # without sp: the same collectives
    assert mg["step_time_s"] < pt["step_time_s"]
    assert pt["memory_breakdown_bytes"]["autocast_copies"] > 0 == mg["memory_breakdown_bytes"]["autocast_copies"]


def test_compare_keeps_misfits_and_impossible_layouts_with_reasons():
    # Megatron bf16 holds 18 bytes per parameter without its distributed optimizer (16-bit weights,
    # fp32 grad buffer, fp32 main weights + Adam), 6 + 12/dp with it (zero=1)
    args = (
        "compare",
        "llama3-70b",
        "--cluster",
        "dgx-h100",
        "--nodes",
        "4",
        "--seq-len",
        "8192",
        "--global-batch",
        "64",
        "--layout",
        "tp=8,pp=2,zero=1,recompute=full,mbs=1",
        "--layout",
        "tp=8,zero=3",
        "--framework",
        "megatron",
    )
    r = berth(*args, "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    cands = out["candidates"]
    assert len(cands) == 2
    assert cands[0]["infeasible_reason"] is None and cands[0]["prediction"]["fits"]
    assert cands[1]["infeasible_reason"].startswith("out_of_memory")
    assert cands[1]["prediction"]["fits"] is False
    assert out["gap_to_best"][0] <= 0.0 and out["gap_to_best"][1] is None
    assert out["memory_headroom"] == 0.05  # megatron's
    # a layout no cluster of 32 GPUs can run, or Megatron cannot, is a row with its rule, in its numbers; the
    # others are predicted as before; a value that is no layout value is bad input (exit 2, one line)
    for bad, why in (
        ("tp=16", "tp_not_divide_kv_heads: tp must divide the 64 attention heads and 8 kv heads"),
        ("tp=3", "valid: 1, 2, 4, 8"),
        ("tp=8,pp=2,dp=4", "world_size_mismatch: tp x cp x pp x dp = 64 must equal the 32 GPUs"),
        ("tp=8,pp=2,zero=1,schedule=gpipe,mbs=1", "megatron_no_gpipe: Megatron-LM main @ d98e8a6"),
    ):
        r = berth(*args, "--layout", bad, "--json")
        assert r.returncode == 0, r.stderr
        got = json.loads(r.stdout)
        assert got["candidates"][:2] == cands and got["choice"] == out["choice"]
        assert got["candidates"][2]["prediction"] is None and why in got["candidates"][2]["infeasible_reason"]
        assert got["gap_to_best"][2] is None
    r = berth(*args, "--layout", "tp=0", "--json")
    assert r.returncode == 2 and "layout[2].tp" in r.stderr and "positive integer" in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and not r.stdout
    assert out["best_searched"]["prediction"]["tokens_per_s"] >= cands[0]["prediction"]["tokens_per_s"]
    # the table names the headroom its pick used: the engine's (megatron's 5 %) or the one asked for
    r = berth(*args)
    text = " ".join(r.stdout.split())  # the terminal's width wraps it
    assert (
        r.returncode == 0 and "pick among these: #1, the fastest predicted to fit with the memory headroom (5%)" in text
    )
    r = berth(*args, "--memory-headroom", "0.2")
    assert r.returncode == 0 and "memory headroom (20%)" in " ".join(r.stdout.split()), r.stdout


def test_plan_table_output():
    r = berth(
        "plan",
        "llama3-8b",
        "--cluster",
        "dgx-a100-80g",
        "--nodes",
        "1",
        "--seq-len",
        "4096",
        "--global-batch",
        "64",
        "--top",
        "2",
    )
    assert r.returncode == 0, r.stderr
    assert "tokens/s" in r.stdout and "searched" in r.stdout and "bottleneck" in r.stdout


@pytest.mark.parametrize(
    "args,field",
    [
        (["plan", "llama3-70b", "--cluster", "dgx-h999", "--nodes", "1"], "cluster.preset"),
        (["plan", "llama3-70b", "--cluster", "dgx-h100", "--nodes", "0"], "cluster.nodes"),
        (["plan", "nope-model"], "model"),
        # seq 1024: no context parallelism searched, which could otherwise take the GPUs dp = 1 leaves
        (
            ["plan", "tiny-gpt", "--cluster", "dgx-h100", "--nodes", "4", "--global-batch", "7", "--seq-len", "1024"],
            "training.global_batch_size",
        ),
        (["plan", "llama3-8b", "--seq-len", "-5"], "training.seq_len"),
        (["plan", "llama3-8b", "--fix", "tq=2"], "fix"),
        (["plan", "llama3-8b", "--precision", "fp7"], "training.precision"),
        (["compare", "llama3-8b", "--layout", "tp=two"], "layout[0].tp"),
        (["plan", "llama3-8b", "--fix", "ep=2"], "fix.ep"),  # a dense model has no experts
        (["compare", "mixtral-8x7b", "--nodes", "2", "--layout", "ep=0"], "layout[0].ep"),  # ep=3: a row, its rule
    ],
)
def test_bad_input_exits_2_with_one_clear_line(args, field):
    r = berth(*args)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert "Traceback" not in r.stderr
    assert field in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_heads_not_divisible_model_file(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text(
        json.dumps(
            {"num_layers": 2, "hidden_size": 1000, "num_attention_heads": 3, "ffn_hidden_size": 4000, "vocab_size": 100}
        )
    )
    r = berth("plan", str(path))
    assert r.returncode == 2 and "num_attention_heads" in r.stderr and "Traceback" not in r.stderr


def test_topology_graph_file_plan_shows_crossings_and_fallback(tmp_path):
    graph = tmp_path / "fat.json"
    r = berth(
        "topology",
        "dgx-h100:4",
        "--fabric",
        "fat-tree",
        "--nodes-per-leaf",
        "2",
        "--oversubscription",
        "4",
        "--out",
        str(graph),
    )
    assert r.returncode == 0, r.stderr
    assert "shared" in r.stdout and "infiniband" in r.stdout and graph.is_file()
    r = berth(
        "plan",
        "llama3-70b",
        "--cluster",
        str(graph),
        "--seq-len",
        "4096",
        "--global-batch",
        "64",
        "--top",
        "2",
        "--fallback",
        "--price-per-gpu-hour",
        "2",
    )
    assert r.returncode == 0, r.stderr
    assert "placement of #1" in r.stdout and "cross" in r.stdout and "per step" in r.stdout
    assert "fallback with 1 node lost" in r.stdout and "goodput" in r.stdout
    r = berth(
        "plan", "llama3-70b", "--cluster", str(graph), "--nodes", "2", "--seq-len", "4096", "--global-batch", "64"
    )
    assert r.returncode == 2 and "graph file gives its own nodes" in r.stderr
    r = berth(
        "plan",
        "llama3-70b",
        "--cluster",
        "dgx-h100",
        "--nodes",
        "2",
        "--seq-len",
        "4096",
        "--global-batch",
        "64",
        "--objective",
        "fastest",
    )
    assert r.returncode == 2 and "objective" in r.stderr


def test_gpipe_at_one_stage_holds_one_microbatch():
    """pp = 1 is no pipeline: GPipe there runs like gradient accumulation, one micro-batch's
    activations at a time (it predicted 1,060 GiB against 164 GiB for the same layout)."""
    import numpy as np

    from berth.cost_models.pipeline import layers_in_flight
    from berth.cost_models.step import evaluate
    from berth.planner.planning import make_cluster, make_training
    from berth.planner.search import Candidates
    from berth.specs.candidates import SCHEDULE_1F1B, SCHEDULE_GPIPE
    from berth.specs.models import load_model
    from berth.specs.tree import Layout

    pp, vpp, nmb = np.array([1, 1, 4]), np.array([1, 1, 1]), np.array([32, 32, 32])
    held = layers_in_flight(80, pp, vpp, nmb, np.array([SCHEDULE_GPIPE, SCHEDULE_1F1B, SCHEDULE_GPIPE]), 0)
    assert held[0] == held[1] == 80 and held[2] == 32 * 20  # GPipe over 4 stages still keeps all 32
    model, cluster = load_model("llama3-70b"), make_cluster("dgx-h100", 2)
    training = make_training(seq_len=4096, global_batch_size=64)
    lays = [Layout(tp=8, dp=2, num_microbatches=32, schedule=s) for s in ("gpipe", "1f1b")]
    ev = evaluate(model, training, cluster, Candidates.from_layouts(lays))
    assert ev.peak_memory_bytes[0] == ev.peak_memory_bytes[1]
    r = berth(
        "compare",
        "llama3-70b",
        "--nodes",
        "2",
        "--seq-len",
        "4096",
        "--global-batch",
        "64",
        "--layout",
        "tp=8,schedule=gpipe",
        "--layout",
        "tp=8",
        "--json",
    )
    a, b = (c["prediction"]["peak_memory_bytes"] for c in json.loads(r.stdout)["candidates"])
    assert a == b


def test_bottleneck_memory_only_for_misfits():
    """A fitting plan's bottleneck is the term that takes most of its step (compute included); "memory"
    is kept for layouts that do not fit."""
    from berth.cost_models.step import BOTTLENECK_NAMES, BOTTLENECK_TERMS, evaluate
    from berth.planner.planning import make_cluster, make_training
    from berth.planner.search import enumerate_candidates
    from berth.specs.models import load_model
    from berth.specs.tree import SearchSpec
    from berth.specs.validity import OUT_OF_MEMORY

    model, cluster = load_model("llama3-70b"), make_cluster("dgx-h100", 2)
    training = make_training(seq_len=4096, global_batch_size=64)
    c = enumerate_candidates(model, training, cluster, SearchSpec(fix={"tp": 8}))
    ev = evaluate(model, training, cluster, c)
    names = [BOTTLENECK_NAMES[i] for i in ev.bottleneck]
    fits = ev.feasible
    assert not any(n == "memory" for n, f in zip(names, fits, strict=True) if f)
    oom = ev.reason == OUT_OF_MEMORY
    assert oom.any() and all(n == "memory" for n, o in zip(names, oom, strict=True) if o)
    fitting = [i for i, f in enumerate(fits) if f]
    assert fitting and {names[i] for i in fitting} >= {"compute"}
    for i in fitting:
        groups = {
            k: sum(float(ev.time_breakdown_s.get(t, [0.0] * len(c))[i]) for t in v) for k, v in BOTTLENECK_TERMS.items()
        }
        assert names[i] == max(groups, key=groups.get)
        assert groups[names[i]] >= max(float(v[i]) for v in ev.time_breakdown_s.values()) - 1e-12


def test_version_completion_and_csv():
    r = berth("--version")
    assert r.returncode == 0 and r.stdout.startswith("berth ")
    import os

    # the shell named, not detected from the process tree (CI runs no interactive shell)
    r = subprocess.run(
        [*BERTH, "--show-completion", "bash"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "_TYPER_COMPLETE_TEST_DISABLE_SHELL_DETECTION": "1"},
    )
    assert r.returncode == 0 and "complete" in r.stdout and "_BERTH_COMPLETE" in r.stdout, r.stderr
    r = berth("plan", "llama3-8b", "--seq-len", "4096", "--global-batch", "64", "--top", "3", "--csv")
    assert r.returncode == 0, r.stderr
    import csv
    import io

    rows = list(csv.DictReader(io.StringIO(r.stdout)))
    assert len(rows) == 3 and all(int(x["tp"]) * int(x.get("cp", 1)) * int(x["pp"]) * int(x["dp"]) == 8 for x in rows)
    assert float(rows[0]["tokens_per_s"]) >= float(rows[2]["tokens_per_s"]) > 0
    r = berth(
        "compare",
        "llama3-8b",
        "--seq-len",
        "4096",
        "--global-batch",
        "64",
        "--layout",
        "tp=8",
        "--layout",
        "tp=2,zero=1",
        "--csv",
    )
    rows = list(csv.DictReader(io.StringIO(r.stdout)))
    assert r.returncode == 0 and [x["tp"] for x in rows] == ["8", "2"] and rows[0]["vs_best"]


def test_tables_fit_80_columns_and_read_in_human_units():
    import os

    env = {**os.environ, "COLUMNS": "80"}
    r = subprocess.run(
        [
            *BERTH,
            "plan",
            "llama3-8b",
            "--cluster",
            "dgx-h100",
            "--nodes",
            "2",
            "--seq-len",
            "4096",
            "--global-batch",
            "64",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert max(len(x) for x in lines) <= 80, max(lines, key=len)
    assert "(8.0B params)" in r.stdout and "tp" in r.stdout
    r = subprocess.run(
        [
            *BERTH,
            "compare",
            "llama3-70b",
            "--nodes",
            "2",
            "--seq-len",
            "8192",
            "--global-batch",
            "64",
            "--layout",
            "tp=8,pp=2,recompute=full,sp=1",
            "--layout",
            "tp=4,pp=4,vpp=5,sp=1",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    # every line fits 80 columns but a layout printed whole, on its own line, to paste into --layout
    import re

    whole = re.compile(r"^(#\d+ |  )?tp=\d+(,[a-z_]+=[0-9a-z_-]+)+$")
    assert r.returncode == 0 and max(len(x) for x in r.stdout.splitlines() if not whole.match(x)) <= 80, r.stdout
    assert "memory" in r.stdout and "tp4 pp4" in r.stdout
    from berth.cli.render import _seconds, count

    assert (_seconds(26793.74), _seconds(0.0123), _seconds(3.5), _seconds(600)) == (
        "7.4 h",
        "12.3 ms",
        "3.50 s",
        "10.0 min",
    )
    assert count(7.6e6) == "7.6M" and count(70.6e9) == "70.6B" and count(1.0e12) == "1.0T"
    r = berth("presets")
    assert "tiny-gpt (" in r.stdout and "M)" in r.stdout


def test_executor_commands_without_torch_say_so_in_one_line(tmp_path):
    """Without torch (no executor extra) `berth validate` (full and rank-slice) and `berth profile`
    refuse in one line naming the extra: exit 2, no traceback, no run stored. torch is hidden from
    the process (sys.modules['torch'] = None: find_spec answers None, import raises) whether
    installed or not."""
    from berth.planner.store import Store

    plans = tmp_path / "plans.json"
    r = subprocess.run(
        [
            *BERTH,
            "plan",
            "tiny-gpt",
            "--cluster",
            "local",
            "--devices-per-node",
            "2",
            "--seq-len",
            "128",
            "--global-batch",
            "8",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    plans.write_text(r.stdout)
    hide = "import sys; sys.modules['torch'] = None; from berth.cli.main import main; main(sys.argv[1:])"
    store = str(tmp_path / "s.sqlite")
    for args, what in (
        (["validate", str(plans), "--store", store], "a validation"),
        (["validate", str(plans), "--proxy", "rank-slice", "--store", store], "a validation"),
        (["profile", "--quick", "--out", str(tmp_path / "p.json")], "`berth profile`"),
    ):
        r = subprocess.run([sys.executable, "-c", hide, *args], capture_output=True, text=True, timeout=60)
        assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
        assert f"{what} needs torch: pip install 'berth[executor]'" in r.stderr and "Traceback" not in r.stderr
    assert Store(store).validations() == [] and not (tmp_path / "p.json").exists()


def test_plan_says_what_padding_an_odd_vocabulary_would_gain():
    """GPT-2's 50,257-word head breaks the 16-byte alignment its GEMMs need (6.2x slower on an H100, measured on the
    H200: benchmarks/results/gpu-h200/head-gemms-alignment.json): `berth plan` says so under #1 and what padding to
    a multiple of 128 x tp gains, predicted, and its JSON (the API's answer) carries the same note; an aligned
    vocabulary gets none."""
    from berth.planner.inputs import make_search
    from berth.planner.planning import plan, plans_json, vocabulary_note
    from berth.specs.models import load_model, presets
    from berth.specs.tree import TrainingSpec
    from berth.topology.clusters import cluster_from_preset

    gpt2 = str(EXAMPLES.parent / "models" / "gpt2-xl.json")
    r = berth("plan", gpt2, "--cluster", "dgx-h100", "--seq-len", "4096", "--global-batch", "64", "--top", "1")
    assert r.returncode == 0, r.stderr
    text = " ".join(r.stdout.split())
    assert "50,257 vocabulary rows per tensor-parallel rank" in text and "padded to 50,304" in text

    cluster, training = cluster_from_preset("dgx-h100", 1), TrainingSpec(seq_len=4096, global_batch_size=64)
    spec = load_model(gpt2)
    result = plan(spec, training, cluster, make_search(top=1))
    note = vocabulary_note(spec, training, cluster, result.plans[0])
    assert plans_json(result, cluster)["notes"] == [note] and note.split(": ")[0] in text
    gain = float(note.rsplit("(", 1)[1].split("%")[0]) / 100
    assert 0.03 < gain < 0.5  # the head is a tenth of the step: a real gain, not the 6x of the head alone
    llama = presets()["llama3-8b"]
    aligned = plan(llama, training, cluster, make_search(top=1))
    assert vocabulary_note(llama, training, cluster, aligned.plans[0]) is None and plans_json(aligned)["notes"] == []
