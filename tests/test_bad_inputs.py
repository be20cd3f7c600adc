"""Bad input through every command: exit 2, one line on stderr naming the argument, no traceback.

Most cases fail before any real work, so they run in-process through the CLI's own `main` (the
same entry point as the `berth` script); a few run as real subprocesses to check the script end
to end."""

import json
import subprocess
import sys

import pytest

from berth.cli.main import main

BINARY = bytes(range(256)) * 4  # not UTF-8, not JSON, not SQLite


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """A binary file, a text file that is no JSON, a directory and a valid plan file."""
    tmp_path = tmp_path_factory.mktemp("bad")
    binary = tmp_path / "blob.bin"
    binary.write_bytes(BINARY)
    (tmp_path / "blob.json").write_bytes(BINARY)
    (tmp_path / "notjson.json").write_text("{not json")
    (tmp_path / "list.json").write_text("[1, 2]")
    (tmp_path / "adir").mkdir()
    (tmp_path / "existing.txt").write_text("x")
    shape = "hidden_size: 256\nnum_attention_heads: 4\nffn_hidden_size: 1024\nvocab_size: 1000\n"
    (tmp_path / "typo.yaml").write_text("name: m\nnum_layer: 4\n" + shape)  # num_layers misspelt
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "berth.cli.main",
            "plan",
            "tiny-gpt",
            "--cluster",
            "dgx-h100",
            "--seq-len",
            "256",
            "--global-batch",
            "8",
            "--top",
            "1",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    (tmp_path / "plans.json").write_text(r.stdout)
    one = json.loads(r.stdout)["plans"][0]
    (tmp_path / "two-plans.json").write_text(json.dumps({"plans": [one, one]}))
    return tmp_path


def run(capsys, *args):
    with pytest.raises(SystemExit) as ex:
        main([str(a) for a in args])
    out, err = capsys.readouterr()
    return ex.value.code, out, err


T = "{tmp}"
GPT = ("tiny-gpt", "--seq-len", "256", "--global-batch", "8")
CASES = [
    # (command line with {tmp} for the temporary directory, what the error line must name)
    (["plan", f"{T}/blob.bin"], "model"),
    (["plan", f"{T}/blob.json"], "model"),
    (["plan", f"{T}/notjson.json"], "model"),
    (["plan", f"{T}/list.json"], "model"),
    (["plan", f"{T}/adir"], "model"),
    (["plan", *GPT, "--nodes", "-1"], "cluster.nodes"),
    (["plan", *GPT, "--top", "0"], "search.top"),
    (["plan", *GPT, "--max-mbs", "-3"], "search.max_micro_batch_size"),
    (["plan", *GPT, "--spare-nodes", "-1"], "spare_nodes"),
    (["plan", *GPT, "--spare-nodes", "1"], "spare_nodes=1: needs 2+ nodes (of 1: one must stay to train)"),
    # a misspelt key is named, with the field it should have been
    (["plan", f"{T}/typo.yaml"], "model.num_layer=4: Extra inputs are not permitted (missing: num_layers)"),
    (["report", f"{T}/plans.json"], "a plan, not a report: `berth validate` it first"),
    (["plan", *GPT, "--global-batch", "-8"], "training.global_batch_size"),
    (["plan", *GPT, "--nodes", "abc"], "--nodes"),
    (["plan", *GPT, "--bogus"], "--bogus"),
    (["plan"], "model"),
    (["plan", *GPT, "--cluster", f"{T}/blob.json"], "cluster"),
    (["plan", *GPT, "--cluster", f"{T}/missing.json"], "cluster"),
    (["plan", *GPT, "--profile", f"{T}/blob.bin"], "profile"),
    (["plan", *GPT, "--profile", f"{T}/missing.json"], "profile"),
    (["plan", *GPT, "--failures-per-gpu-hour", "-1"], "failures_per_gpu_hour"),
    (["plan", *GPT, "--json", "--csv"], "csv"),
    (["plan", *GPT, "--fabric", "torus"], "cluster.fabric"),
    (["compare", *GPT], "--layout"),
    (["compare", *GPT, "--layout", "tp=0"], "layout[0].tp"),
    (["compare", *GPT, "--layout", "zero=9"], "layout[0].zero_stage"),
    (["compare", *GPT, "--layout", "tp"], "layout"),
    (["compare", *GPT, "--layout", "tp=1,tp=2"], "layout[0].tp"),
    (["compare", *GPT, "--layout", "recompute=most"], "layout[0].recompute"),
    (["plan", *GPT, "--fix", "zero=1,zero_stage=2"], "fix.zero_stage"),
    (["compare", f"{T}/blob.bin", "--layout", "tp=1"], "model"),
    (["launch", f"{T}/blob.bin"], "plan"),
    (["launch", f"{T}/blob.json"], "plan"),
    (["launch", f"{T}/notjson.json"], "plan"),
    (["launch", f"{T}/missing.json"], "plan"),
    (["launch", f"{T}/adir"], "plan"),
    (["launch", f"{T}/plans.json", "--out", f"{T}/existing.txt"], "out"),
    (["launch", f"{T}/plans.json", "--steps", "-5"], "steps"),
    (["launch", f"{T}/plans.json", "--warmup", "-1"], "warmup"),
    (["launch", f"{T}/plans.json", "--pick", "9"], "pick"),
    (["launch", f"{T}/plans.json", "--format", "mpi"], "format"),
    (["validate", f"{T}/blob.bin"], "plan"),
    (["validate", f"{T}/missing.json"], "plan"),
    (["validate", f"{T}/plans.json", "--steps", "0"], "steps"),
    (["validate", f"{T}/plans.json", "--warmup", "-2"], "warmup"),
    (["validate", f"{T}/plans.json", "--timeout", "-1"], "timeout"),
    (["validate", f"{T}/plans.json", "--out", f"{T}/nodir/report.json"], "out"),
    (["validate", f"{T}/plans.json", "--out", f"{T}/adir"], "out"),
    (["validate", f"{T}/plans.json", "--store", f"{T}/blob.bin"], "store"),
    (["validate", f"{T}/plans.json", "--store", f"{T}/nodir/s.sqlite"], "store"),
    (["validate", f"{T}/plans.json", "--proxy", "whole"], "proxy"),
    (["validate", f"{T}/plans.json", "--layers", "0", "--proxy", "rank-slice"], "layers"),
    (["topology", "dgx-h100:2", "--out", f"{T}/nodir/g.json"], "out"),
    (["topology", "dgx-h100:0"], "cluster.nodes"),
    (["topology", "nope:2"], "cluster.preset"),
    (["topology", f"{T}/blob.json"], "cluster"),
    (["profile", "--out", f"{T}/nodir/p.json"], "out"),
    (["profile", "--out", f"{T}/adir"], "out"),
    (["profile", "--max-procs", "0", "--out", f"{T}/p.json"], "max_procs"),
    (["calibrate", f"{T}/blob.bin"], "reports"),
    (["calibrate", f"{T}/missing.json"], "reports"),
    (["calibrate", "--holdout", "2"], "holdout"),
    (
        ["calibrate", "--log", f"{T}/existing.txt", "--log", f"{T}/existing.txt", *["--plan", f"{T}/plans.json"] * 3],
        "one --plan for every log, or one per --log (2)",
    ),
    (["calibrate", "--log", f"{T}/existing.txt", "--plan", f"{T}/two-plans.json"], "lists 2 plans, and a log ran one"),
    (["calibrate", f"{T}/blob.bin", "--out", f"{T}/nodir/c.json"], "out"),
    (["serve", "--port", "0"], "port"),
    (["serve", "--workers", "0"], "workers"),
    (["serve", "--port", "http"], "--port"),
    (["presets", "--json", "extra"], "extra"),
    (["nonsense"], "nonsense"),
    # issue 28: an integer beyond int64 was an OverflowError traceback
    (["plan", *GPT, "--cluster", "dgx-h100", "--fix", "tp=9223372036854775808"], "fix.tp"),
    (["compare", *GPT, "--cluster", "dgx-h100", "--layout", "tp=99999999999999999999"], "tp"),
    (["compare", *GPT, "--cluster", "dgx-h100", "--layout", "tp=1,mbs=9223372036854775808"], "micro_batch_size"),
    (["serve", "--workers", "99999999999999999999"], "workers"),  # was: spawned workers without end
    (["serve", "--workers", "65"], "workers"),
]


@pytest.mark.parametrize("args,names", CASES, ids=[" ".join(a)[:60] for a, _ in CASES])
def test_bad_input_is_one_line_exit_2(files, capsys, args, names):
    code, out, err = run(capsys, *[a.replace(T, str(files)) for a in args])
    assert code == 2, (out, err)
    assert "Traceback" not in err + out
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:"), err
    assert names in lines[0], err


FIX_CASES = [
    # --fix on llama3-70b (64 heads, 8 kv heads, 80 layers), 2 x DGX H100 (16 GPUs), global batch 64
    ("tp=3", "fix.tp=3: tp must divide the 64 attention heads and 8 kv heads; valid: 1, 2, 4, 8"),
    ("tp=0", "fix.tp=0: must be a positive integer"),
    ("zero=4", "fix.zero_stage=4: valid: 0, 1, 2, 3"),
    ("tp=8,pp=2,dp=2", "tp x pp x dp = 32 must equal the 16 GPUs"),
    ("pp=1,vpp=4", "need pp > 1"),
    ("shard=3", "fix.shard=3: shard must divide dp"),
    ("nmb=7", "fix.num_microbatches=7"),
    ("zero=3,shard=1", "fix.shard=1"),
    ("tp=1,sp=1", "fix.sequence_parallel"),
    ("pp=3", "fix.pp=3"),
    ("tp=16", "fix.tp=16"),
    ("mbs=128", "fix.micro_batch_size=128"),
    ("recompute=some", "fix.recompute='some': valid: none, selective, full"),
    ("schedule=zb", "fix.schedule='zb'"),
    ("vpp=0", "fix.virtual_stages=0"),
]


@pytest.mark.parametrize("fix,expect", FIX_CASES, ids=[f for f, _ in FIX_CASES])
def test_impossible_fix_is_refused_before_searching(capsys, fix, expect):
    code, out, err = run(
        capsys,
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
        "--fix",
        fix,
    )
    assert code == 2 and not out, (out, err)
    assert len(err.strip().splitlines()) == 1 and expect in err, err


def test_possible_fix_values_still_search(capsys):
    """The check refuses only what no searched layout has: a schedule or vpp the search picks
    for itself, or a value that needs another field the search is free to choose, still plans."""
    for fix in ("schedule=interleaved_1f1b", "vpp=2", "shard=2", "nmb=16", "tp=4,pp=2", "sp=1"):
        code, out, err = run(
            capsys,
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
            "--fix",
            fix,
            "--top",
            "1",
            "--json",
        )
        assert code == 0, (fix, err)
        assert json.loads(out)["plans"], fix


def test_no_layout_fits_exits_1_naming_the_smallest_peak(capsys):
    code, out, err = run(
        capsys, "plan", "llama3-70b", "--cluster", "dgx-h100", "--seq-len", "8192", "--global-batch", "64", "--json"
    )
    assert code == 1
    assert json.loads(out)["plans"] == []
    assert "no layout fits: the smallest predicted peak is" in err and " GiB per GPU (tp=" in err
    # against what the allocator can use (79.6 GiB less the driver's, the CUDA context's and NCCL's), as compare says
    assert "where the allocator can use 77.9 GiB and a plan keeps 5% of it spare" in err
    assert "more GPUs" in err


def test_scripts_end_to_end(tmp_path):
    """The installed entry point as a user runs it: a binary model file and a layout value that is none, both refused
    with one line and exit 2."""
    blob = tmp_path / "m.json"
    blob.write_bytes(BINARY)
    for args in (["plan", str(blob)], ["compare", "tiny-gpt", "--layout", "tp=0"]):
        r = subprocess.run([sys.executable, "-m", "berth.cli.main", *args], capture_output=True, text=True, timeout=60)
        assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
        assert len(r.stderr.strip().splitlines()) == 1


def test_api_refuses_impossible_fix_and_layouts_with_422(tmp_path):
    """The service shares the one validation: a real `berth serve` answers 422 naming the field (an impossible fix,
    a layout value that is none); a compared layout that breaks a rule is a row saying which."""
    import os
    import socket
    import time

    import httpx

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "BERTH_STORE_PATH": str(tmp_path / "store.sqlite")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "berth.cli.main", "serve", "--port", str(port)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if httpx.get(url + "/healthz", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        base = {
            "model": "llama3-70b",
            "training": {"seq_len": 4096, "global_batch_size": 64},
            "cluster": {"preset": "dgx-h100", "nodes": 2},
        }
        for fix in ({"tp": 3}, "tp=3", {"zero_stage": 4}, "tp=8,pp=2,dp=2"):
            r = httpx.post(url + "/v1/plans", json={**base, "search": {"fix": fix}}, timeout=60)
            assert r.status_code == 422, (fix, r.text)
            assert "fix" in r.json()["detail"][0]["loc"], r.text
        r = httpx.post(url + "/v1/plans", json={**base, "search": {"fix": "tp=3"}}, timeout=60)
        assert "valid: 1, 2, 4, 8" in r.text
        r = httpx.post(url + "/v1/compare", json={**base, "layouts": ["tp=8", {"tp": 0}]}, timeout=60)
        assert r.status_code == 422, r.text
        loc = r.json()["detail"][0]["loc"]
        assert loc[:4] == ["body", "layouts", 1, "tp"], r.text  # the request's field, its index, the value's
        # a layout that breaks a rule is a row with it (compare's answer), the others predicted
        r = httpx.post(url + "/v1/compare", json={**base, "layouts": ["tp=8", {"tp": 3}]}, timeout=60)
        assert r.status_code == 200, r.text
        kept, refused = r.json()["candidates"]
        assert kept["prediction"] is not None and refused["prediction"] is None
        assert refused["infeasible_reason"].startswith("world_size_mismatch: ") and "valid: 1, 2, 4, 8" in r.text
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_one_layout_check_agrees_with_the_search():
    """The per-layout check and the search mask are the same rules: every layout the search
    enumerates and its rules keep passes the check, and random layouts are refused exactly when the search's rules
    reject them."""
    import numpy as np

    from berth.planner.planning import make_cluster, make_training
    from berth.planner.search import enumerate_candidates
    from berth.specs.candidates import Candidates
    from berth.specs.errors import BerthError
    from berth.specs.layouts import check_layout
    from berth.specs.models import load_model
    from berth.specs.tree import Layout, SearchSpec
    from berth.specs.validity import structural_reasons

    model, cluster = load_model("llama3-8b"), make_cluster("dgx-h100", 2)
    training = make_training(seq_len=2048, global_batch_size=32)
    c = enumerate_candidates(model, training, cluster, SearchSpec())
    valid = np.flatnonzero(structural_reasons(c, model, training, cluster) == 0)
    for i in np.random.default_rng(0).choice(valid, 200, replace=False):
        check_layout(c.layout(int(i)).model_dump(), model, training, cluster)
    rng = np.random.default_rng(1)
    refused = 0
    for _ in range(300):
        values = {
            "tp": int(rng.choice([1, 2, 3, 4, 8, 16])),
            "pp": int(rng.choice([1, 2, 4, 5])),
            "dp": int(rng.choice([1, 2, 4, 8])),
            "micro_batch_size": int(rng.choice([1, 2, 3])),
            "num_microbatches": int(rng.choice([1, 2, 4, 16])),
            "zero_stage": int(rng.integers(0, 4)),
            "shard": int(rng.choice([1, 2, 3])),
            "virtual_stages": int(rng.choice([1, 2])),
            "sequence_parallel": bool(rng.integers(0, 2)),
            "schedule": str(rng.choice(["gpipe", "1f1b", "interleaved_1f1b"])),
        }
        layout = Layout(**values)
        rule = int(structural_reasons(Candidates.from_layouts([layout]), model, training, cluster)[0])
        try:
            check_layout(values, model, training, cluster)
            ok = True
        except BerthError:
            ok, refused = False, refused + 1
        # pp = 1 runs every schedule alike, so gpipe there is checked as 1f1b
        if not (values["pp"] == 1 and values["schedule"] == "gpipe"):
            assert ok == (rule == 0), (values, rule)
    assert 0 < refused < 300
