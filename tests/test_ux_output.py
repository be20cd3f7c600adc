"""Answers that say what they mean (issue 29), through the real CLI (a subprocess at COLUMNS=80) and
the API in-process: tables that fit 80 columns with layouts printed whole, a gap to the best only for
a layout that fits, a CSV with a stable header, a defined bottleneck, hidden traffic beside the exposed
part, the reason when nothing fits, and a closed pipe that is no failure."""

from __future__ import annotations

import csv
import io
import json
import os
import re
import subprocess
import sys

import pytest

BERTH = [sys.executable, "-m", "berth.cli.main"]
GPT3 = ("plan", "gpt3-175b", "--cluster", "dgx-a100-80g", "--nodes", "128", "--seq-len", "2048")
GPT3 = (*GPT3, "--global-batch", "1536")
LAYOUT_LINE = re.compile(r"^(#\d+ |  )?(tp=\d+(,[a-z_]+=[0-9a-z_-]+)+)$")


def berth(*args: str, columns: int = 80) -> subprocess.CompletedProcess:
    env = {**os.environ, "COLUMNS": str(columns)}
    return subprocess.run([*BERTH, *args], capture_output=True, text=True, timeout=180, env=env)


def _table_lines_fit(text: str) -> list[str]:
    """The lines that are not a layout printed whole: each must fit 80 columns."""
    return [x for x in text.splitlines() if len(x) > 80 and not LAYOUT_LINE.match(x)]


# a tight row (memory_tight at 6 % headroom), a misfit, and the vs best column: the case that overflowed
COMPARE_TIGHT = (
    "compare",
    "llama3-70b",
    "--nodes",
    "2",
    "--seq-len",
    "8192",
    "--global-batch",
    "64",
    "--layout",
    "tp=8,pp=2,recompute=full,sp=1,zero=1,dp=1",
    "--layout",
    "tp=4,cp=2,pp=2,dp=1,zero=3,shard=1,mbs=1,nmb=64,recompute=full,schedule=interleaved_1f1b,vpp=2,sp=1",
    "--layout",
    "tp=8,pp=2,sp=1,recompute=selective",
    "--memory-headroom",
    "0.06",
)


def test_compare_with_a_tight_row_fits_80_columns_and_prints_layouts_whole():
    r = berth(*COMPARE_TIGHT)
    assert r.returncode == 0, r.stderr
    assert not _table_lines_fit(r.stdout), _table_lines_fit(r.stdout)
    assert "vs best" in r.stdout and "vs b " not in r.stdout and "…" not in r.stdout
    out = json.loads(berth(*COMPARE_TIGHT, "--json").stdout)
    lines = r.stdout.splitlines()
    for cand in out["candidates"]:
        # each layout on one line, whole, and it parses back to the same layout
        from berth.specs.tree import Layout

        short = Layout(**cand["layout"]).short()
        assert any(line.endswith(" " + short) or line == short for line in lines), short
    best = Layout(**out["best_searched"]["layout"]).short()
    assert any(line.strip() == best for line in lines), best


def test_a_layout_that_does_not_fit_gets_no_gap_to_the_best():
    """218 GiB on an 80 GB GPU: no "+54.2 %" beside it; its reason instead (table, CSV, JSON alike)."""
    args = ("compare", "llama3-70b", "--nodes", "2", "--seq-len", "8192", "--global-batch", "64")
    args = (*args, "--layout", "tp=8,pp=2,recompute=full,sp=1,zero=1,dp=1", "--layout", "tp=4,pp=4,vpp=5,sp=1")
    r = berth(*args)
    assert r.returncode == 0, r.stderr
    rows = [x for x in r.stdout.splitlines() if re.match(r"^ \d+ ", x)]
    assert len(rows) == 2 and all("out_of_memory" in x for x in rows)
    assert all(not re.search(r"[+-]\d+\.\d%\s*$", x) for x in rows), rows
    assert "218.1" in r.stdout and "#2: out_of_memory: needs 218.1 GiB" in r.stdout
    table = csv.DictReader(io.StringIO(berth(*args, "--csv").stdout))
    assert [x["vs_best"] for x in table] == ["", ""]
    assert json.loads(berth(*args, "--json").stdout)["gap_to_best"] == [None, None]


@pytest.mark.parametrize("command", ["plan", "compare"])
def test_help_at_80_columns_never_truncates_an_option_name(command):
    r = berth(command, "--help")
    assert r.returncode == 0 and "…" not in r.stdout, r.stdout
    assert max(len(x) for x in r.stdout.splitlines()) <= 80
    for name in ("--failures-per-gpu-hour", "--storage-gbps-per-gpu", "--price-per-gpu-hour", "--memory-headroom"):
        assert name in r.stdout
    assert "--no-flash-attention" in r.stdout


def test_presets_print_every_name_whole():
    from berth.hardware_profiles import server_names

    r = berth("presets")
    assert r.returncode == 0 and "…" not in r.stdout
    assert max(len(x) for x in r.stdout.splitlines()) <= 80
    for name in server_names():
        assert re.search(rf"│ {re.escape(name)}\s+│", r.stdout), name


def test_engines_print_every_rule_whole_at_80_columns_and_as_a_table_when_wide():
    from berth.specs.engines import ENGINES

    narrow, wide = berth("engines"), berth("engines", columns=200)
    assert narrow.returncode == wide.returncode == 0
    assert max(len(x) for x in narrow.stdout.splitlines()) <= 80 and "┃" not in narrow.stdout
    words = set(re.findall(r"[A-Za-z0-9_]+", narrow.stdout))
    for name, e in ENGINES.items():
        assert re.search(rf"^{name}\s*$", narrow.stdout, re.M), name
        assert {r.name.removeprefix(f"{name}_") for r in e.rules} <= words, name  # none cut in two
        assert re.search(rf"│ {name}\s+│ {re.escape(e.version)}", wide.stdout), name


def test_csv_header_is_stable_and_carries_every_layout_field_and_the_breakdown():
    from berth.specs import terms
    from berth.specs.tree import LAYOUT_FIELDS

    dense = berth("plan", "llama3-8b", "--seq-len", "4096", "--global-batch", "64", "--top", "2", "--csv")
    moe = berth("plan", "mixtral-8x7b", "--nodes", "8", "--seq-len", "4096", "--global-batch", "256", "--csv")
    cmp = berth("compare", "llama3-8b", "--layout", "tp=8", "--layout", "tp=2,cp=2,zero=1", "--csv")
    heads = {r.stdout.splitlines()[0] for r in (dense, moe, cmp)}
    assert len(heads) == 1, heads
    header = next(iter(heads)).split(",")
    assert set(LAYOUT_FIELDS) <= set(header) and {"expert_tp", "cp"} <= set(header)
    assert {f"time_{t.name}_s" for t in terms.TIME} <= set(header)
    assert {f"memory_{m.name}_bytes" for m in terms.MEMORY} <= set(header)
    assert "comm_total_dp_comm_s" in header
    rows = list(csv.DictReader(io.StringIO(moe.stdout)))
    assert rows and all(x["expert_tp"] for x in rows)
    first = json.loads(
        berth("plan", "mixtral-8x7b", "--nodes", "8", "--seq-len", "4096", "--global-batch", "256", "--json").stdout
    )["plans"][0]
    assert int(rows[0]["expert_tp"]) == (first["layout"]["expert_tp"] or first["layout"]["tp"])
    # the breakdown columns add up to the step time (the terms are the step's)
    step = sum(float(rows[0][f"time_{t.name}_s"]) for t in terms.TIME)
    assert step == pytest.approx(float(rows[0]["step_time_s"]), rel=1e-6)
    assert json.loads(berth("plan", "llama3-8b", "--json").stdout)["plans"]


def test_bottleneck_is_the_term_that_takes_most_of_the_step_and_is_defined():
    """GPT-3 175B's top plan spends most of its step computing: its bottleneck is compute (it said
    dp_comm), and the table, --help-visible legend and JSON schema define the word."""
    out = json.loads(berth(*GPT3, "--top", "3", "--json").stdout)
    top = out["plans"][0]["prediction"]
    assert top["time_breakdown_s"]["compute"] / top["step_time_s"] > 0.7 and top["bottleneck"] == "compute"
    from berth.cost_models.step import BOTTLENECK_TERMS
    from berth.specs.terms import BOTTLENECK_DEFINITION
    from berth.specs.tree import Prediction

    for p in out["plans"]:
        pr = p["prediction"]
        groups = {k: sum(pr["time_breakdown_s"].get(t, 0.0) for t in v) for k, v in BOTTLENECK_TERMS.items()}
        assert pr["bottleneck"] == max(groups, key=groups.get)
    assert BOTTLENECK_DEFINITION in Prediction.model_json_schema()["properties"]["bottleneck"]["description"]
    r = berth(*GPT3, "--top", "1")
    assert "bottleneck: the time term that takes the largest share of the step" in r.stdout


def test_hidden_traffic_is_shown_beside_the_exposed_part():
    """ZeRO-3 on 1,024 A100s: the data-parallel traffic is several seconds, almost all of it hidden
    behind compute; the JSON gives the total beside the exposed part, and the table a row for it."""
    out = json.loads(berth(*GPT3, "--top", "1", "--json").stdout)
    pr = out["plans"][0]["prediction"]
    exposed, total = pr["time_breakdown_s"]["dp_comm"], pr["comm_total_s"]["dp_comm"]
    assert total > 4 * exposed > 0, (exposed, total)
    for term, seconds in pr["comm_total_s"].items():
        assert seconds >= pr["time_breakdown_s"].get(term, 0.0) - 1e-12
    r = berth(*GPT3, "--top", "1")
    row = next(x for x in r.stdout.splitlines() if "dp_comm traffic, hidden or not" in x)
    assert f"{total:.2f} s" in row


def test_the_step_time_does_not_move_when_the_hidden_traffic_is_reported():
    """comm_total_s is reported, never charged: the step is the sum of the breakdown, as before."""
    from berth.cost_models.step import evaluate
    from berth.planner.planning import make_cluster, make_training
    from berth.planner.search import enumerate_candidates
    from berth.specs.models import load_model
    from berth.specs.tree import SearchSpec

    model, cluster = load_model("llama3-70b"), make_cluster("dgx-h100", 4)
    training = make_training(seq_len=4096, global_batch_size=128)
    ev = evaluate(model, training, cluster, enumerate_candidates(model, training, cluster, SearchSpec()))
    assert sum(ev.time_breakdown_s.values()) == pytest.approx(ev.step_time_s, rel=1e-9)
    hidden = ev.comm_total_s["dp_comm"] - ev.time_breakdown_s["dp_comm"]
    assert (hidden >= -1e-12).all() and (hidden > 0).any()


def test_a_closed_pipe_exits_quietly_with_0_and_nothing_fits_keeps_1():
    for extra in ((), ("--json",), ("--csv",)):
        cmd = [*BERTH, *GPT3, *extra]
        p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={**os.environ, "COLUMNS": "80"})
        assert p.stdout is not None and p.stderr is not None
        p.stdout.read(5)  # `| head -c 5`
        p.stdout.close()
        err = p.stderr.read().decode()
        assert p.wait(timeout=180) == 0 and not err.strip(), (extra, err)
    r = berth("plan", "llama3-405b", "--nodes", "1")
    assert r.returncode == 1 and "no layout fits" in r.stderr and "GiB" in r.stderr


def test_nothing_fits_gives_the_reason_in_json():
    r = berth("plan", "llama3-405b", "--nodes", "1", "--json")
    assert r.returncode == 1
    out = json.loads(r.stdout)
    assert out["plans"] == [] and "smallest predicted peak" in out["why_none"] and "out_of_memory" in out["why_none"]
    assert out["why_none"] in r.stderr
    ok = json.loads(berth("plan", "tiny-gpt", "--seq-len", "128", "--global-batch", "16", "--json").stdout)
    assert ok["plans"] and ok["why_none"] is None


def test_the_api_gives_the_reason_when_nothing_fits(tmp_path):
    from fastapi.testclient import TestClient

    from berth.api.app import create_app
    from berth.api.schemas import PlanResponse
    from berth.api.settings import Settings

    body = {
        "model": "llama3-405b",
        "training": {"seq_len": 4096, "global_batch_size": 256},
        "cluster": {"preset": "dgx-h100", "nodes": 1},
    }
    with TestClient(create_app(Settings(store_path=str(tmp_path / "s.sqlite")))) as client:
        r = client.post("/v1/plans", json=body)
        assert r.status_code == 200, r.text
        out = r.json()
        assert out["plans"] == [] and "smallest predicted peak" in out["why_none"]
        cli = berth("plan", "llama3-405b", "--nodes", "1", "--json")
        assert out["why_none"] == json.loads(cli.stdout)["why_none"]  # the text the CLI prints
        again = client.post("/v1/plans", json=body).json()  # answered from the plan cache
        assert again["why_none"] == out["why_none"]
    assert "why_none" in PlanResponse.model_json_schema()["properties"]


def test_an_out_of_memory_reason_gives_the_peak_the_table_shows_beside_what_must_fit(capsys):
    """The GiB column is the reserved peak, cached blocks included; what must fit leaves out the blocks the allocator
    hands back when it fills (cost_models/memory.py peak_memory). Where the two differ the reason says both, so a
    user does not read two figures for one layout (nanotron's 8B at tp 2 on 16 H100: 90.3 GiB, 89.8 must fit)."""
    args = ["compare", "llama3-8b", "--cluster", "dgx-h100", "--nodes", "2", "--seq-len", "4096"]
    from berth.cli.main import main

    with pytest.raises(SystemExit):
        main([*args, "--global-batch", "128", "--engine", "nanotron", "--layout", "tp=2", "--json"])
    plan = json.loads(capsys.readouterr().out)["candidates"][0]
    peak = plan["prediction"]["peak_memory_bytes"] / 2**30
    reason = plan["infeasible_reason"]
    assert reason.startswith("out_of_memory: needs ") and f"(its {peak:.1f} GiB peak less cached blocks" in reason
    need = float(reason.split("needs ")[1].split(" GiB")[0])
    assert 77.9 < need < peak - 0.05, (need, peak)
