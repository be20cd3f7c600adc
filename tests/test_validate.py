"""`berth validate` end to end on this machine: real torchrun, gloo CPU workers, the report file
and the SQLite store; plans refused before launch; a killed or hung rank ends the run with a
failure report well inside its timeout."""

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from berth.executor.validate import _failure, load_plan, validate
from berth.planner.store import Store
from berth.specs.errors import BerthError

BERTH = [sys.executable, "-m", "berth.cli.main"]
TORCH_REASON = "runs the plan with torch.distributed (torch: the executor extra)"
TINY = ["tiny-gpt", "--seq-len", "128", "--global-batch", "8"]


def berth(*args, timeout=300, tmpdir=None):
    env = {**os.environ, "TMPDIR": str(tmpdir)} if tmpdir else None
    return subprocess.run([*BERTH, *args], capture_output=True, text=True, timeout=timeout, env=env)


def own_temp(tmp_path):
    """A TMPDIR of the test's own, to see that a run leaves nothing behind in it."""
    (tmp_path / "tmp").mkdir()
    return tmp_path / "tmp"


def left_behind(tmpdir):
    """What runs left in `tmpdir`, less torch's one compile cache per user (torchinductor_<user>)."""
    return [p.name for p in tmpdir.iterdir() if not p.name.startswith("torchinductor_")]


def plan_file(tmp_path, *extra, devices="2"):
    r = berth("plan", *TINY, "--cluster", "local", "--devices-per-node", devices, "--json", *extra)
    assert r.returncode == 0, r.stderr
    path = tmp_path / "plans.json"
    path.write_text(r.stdout)
    return path


def test_validate_two_cpu_processes_writes_report_and_stores_it(tmp_path):
    pytest.importorskip("torch", reason=TORCH_REASON)
    plans = plan_file(tmp_path)
    store, out = tmp_path / "store.sqlite", tmp_path / "report.json"
    r = berth(
        "validate",
        str(plans),
        "--steps",
        "3",
        "--warmup",
        "2",
        "--store",
        str(store),
        "--out",
        str(out),
        "--trace",
        str(tmp_path / "traces"),
        "--json",
        tmpdir=own_temp(tmp_path),
    )
    assert r.returncode == 0, r.stderr
    assert left_behind(tmp_path / "tmp") == []  # the run's working directory (and torchrun's) removed afterwards
    report = json.loads(r.stdout)
    # --trace: one Chrome trace per rank, listed in the report; the measured terms beside the predicted
    assert sorted(report["traces"]) == [str(tmp_path / "traces" / f"rank{i}.trace.json") for i in (0, 1)]
    assert all(json.loads(Path(t).read_text())["traceEvents"] for t in report["traces"])
    assert report["breakdown"]["terms"]["compute"]["measured_s"] > 0 and report["breakdown"]["largest_error_term"]
    assert report["status"] == "ok" and json.loads(out.read_text())["id"] == report["id"]
    for key in ("step_time_s", "tokens_per_s", "peak_memory_bytes", "loss"):
        assert report["measured"][key] > 0 and report["predicted"][key] > 0
        assert key in report["relative_error"]
    assert len(report["step_times_s"]) == 3 and len(report["losses"]) == 5
    assert report["losses"][-1] < report["losses"][0]
    assert len(report["per_rank"]) == 2 and report["machine"]["backend"] == "gloo"
    stored = Store(store).get_validation(report["id"])
    assert stored is not None and stored.measured.step_time_s == report["measured"]["step_time_s"]


def test_bad_plans_are_refused_before_launch(tmp_path):
    big = plan_file(tmp_path, devices="64")  # a 64-worker plan on this machine
    r = berth("validate", str(big), "--store", str(tmp_path / "s.sqlite"), timeout=60)
    assert r.returncode == 2 and "plan.layout" in r.stderr and "rank-slice" in r.stderr
    gpu = tmp_path / "gpu.json"
    r = berth("plan", *TINY, "--cluster", "dgx-h100", "--json")
    gpu.write_text(r.stdout)
    if not os.environ.get("CUDA_VISIBLE_DEVICES"):
        r = berth("validate", str(gpu), "--store", str(tmp_path / "s.sqlite"), timeout=60)
        assert r.returncode == 2 and "plan.cluster.device" in r.stderr
    data = json.loads(plan_file(tmp_path).read_text())
    data["plans"][0]["layout"]["tp"] = 3
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(data))
    r = berth("validate", str(bad), "--store", str(tmp_path / "s.sqlite"), timeout=60)
    assert r.returncode == 2 and "plan.layout" in r.stderr and "tp=3" in r.stderr
    r = berth("validate", str(bad), "--pick", "99", timeout=60)
    assert r.returncode == 2 and "pick=99" in r.stderr
    r = berth("validate", str(big), "--proxy", "rank-slice", "--trace", str(tmp_path / "t"), timeout=60)
    assert r.returncode == 2 and "trace" in r.stderr and not (tmp_path / "t").exists()
    assert not (tmp_path / "s.sqlite").exists() or Store(tmp_path / "s.sqlite").validations() == []


def test_load_plan_errors_name_the_problem(tmp_path):
    (tmp_path / "x.json").write_text("{not json")
    with pytest.raises(BerthError, match="not JSON"):
        load_plan(tmp_path / "x.json")
    with pytest.raises(BerthError, match="cannot read"):
        load_plan(tmp_path / "missing.json")


def _run_with_fault(tmp_path, sig, **kwargs):
    plan = load_plan(plan_file(tmp_path, "--fix", "dp=2,zero=0"))
    run_dir = tmp_path / "run"
    sent = []

    def on_progress(p):
        if p["step"] == 2 and not sent:
            pid = int((run_dir / "rank1.pid").read_text())
            os.kill(pid, sig)
            sent.append(time.perf_counter())

    start = time.perf_counter()
    report = validate(
        plan,
        steps=500,
        warmup=1,
        store=Store(tmp_path / "s.sqlite"),
        run_dir=run_dir,
        on_progress=on_progress,
        **kwargs,
    )
    return report, sent, time.perf_counter() - start


def test_killed_rank_ends_run_with_failure_report(tmp_path):
    pytest.importorskip("torch", reason=TORCH_REASON)
    report, sent, _ = _run_with_fault(tmp_path, signal.SIGKILL, timeout_s=240)
    assert sent, "the fault was never injected"
    assert time.perf_counter() - sent[0] < 60
    assert report.status == "failed" and "exit" in report.message.lower()
    assert Store(tmp_path / "s.sqlite").get_validation(report.id).status == "failed"


def test_hung_rank_ends_run_within_the_collective_timeout(tmp_path):
    pytest.importorskip("torch", reason=TORCH_REASON)
    report, sent, _ = _run_with_fault(tmp_path, signal.SIGSTOP, timeout_s=120, collective_timeout_s=5)
    assert sent
    with contextlib.suppress(ProcessLookupError):
        os.kill(int((tmp_path / "run" / "rank1.pid").read_text()), signal.SIGKILL)
    assert time.perf_counter() - sent[0] < 60  # 5 s collective timeout + WORKER_SHUTDOWN_GRACE_S, loaded
    assert report.status == "failed"


def test_out_of_memory_is_reported_as_did_not_fit(tmp_path):
    plan = load_plan(plan_file(tmp_path))
    out = tmp_path / "result.json"
    Path(f"{out}.rank1.error.json").write_text(
        json.dumps(
            {
                "type": "OutOfMemoryError",
                "message": "CUDA out of memory. Tried to allocate 2.00 GiB",
                "out_of_memory": True,
                "available_memory_bytes": 80 * 2**30,
            }
        )
    )
    status, message = _failure(out, tmp_path / "none.stderr", 1, False, 100.0, plan)
    assert status == "did_not_fit" and "rank 1" in message and "available 80.00 GiB" in message
    assert "predicted peak" in message


def wide_vocab_plan(tmp_path, tied: bool, devices: int, fix: str):
    """The plan file of a 2-layer model whose 32,000 x 256 embedding outweighs the rest (tp = pp = 1, no recompute)."""
    model = tmp_path / f"wide-{tied}.json"
    shape = {"num_layers": 2, "hidden_size": 256, "num_attention_heads": 4, "num_kv_heads": 1, "ffn_hidden_size": 896}
    model.write_text(
        json.dumps(
            {
                "name": "wide-vocab",
                **shape,
                "vocab_size": 32000,
                "mlp": "swiglu",
                "norm": "rmsnorm",
                "tied_embeddings": tied,
            }
        )
    )
    r = berth(
        "plan", str(model), "--cluster", "local", "--devices-per-node", str(devices), "--seq-len", "256",
        "--global-batch", "16", "--fix", f"tp=1,pp=1,{fix},mbs=1,recompute=none", "--top", "1", "--json",
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    plans = tmp_path / f"plans-{tied}-{fix}.json"
    plans.write_text(r.stdout)
    return plans


def validated(plans, *extra) -> dict:
    r = berth("validate", str(plans), *extra, "--steps", "2", "--warmup", "1", "--json")
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def test_executor_zero1_shards_whole_tensors_and_its_prediction_says_so(tmp_path):
    """The executor's ZeRO-1 under DDP is torch's ZeroRedundancyOptimizer, which hands out whole tensors: with a tied
    32,000 x 256 embedding (8.2 M of 9.9 M parameters) over 2 ranks, rank 0 keeps the embedding's Adam state and rank
    1 the layers'. Measured on 2 gloo processes: ZeRO-1 lowers the larger rank's peak from ZeRO-0's by 13.0 MiB and
    the ranks differ by 49.5 MiB; an even share predicted 37.7 MiB lower (cost_models/memory.py whole_tensor_share).

    Measured twice at most: in one CI run ZeRO-0's peak came out exactly one gradient buffer (37.75 MiB)
    higher, the size of the bucket DDP frees when it rebuilds its buckets in the second step. The CPU profiler
    sees no free made on a gloo thread, so a buffer whose last reference dies there stays counted (a thread race,
    not reproduced here in 18 runs under load): a local run's events less that one free replay to CI's figure to
    the byte (333.85 MiB). executor/train.py peak_allocated now releases such a block at the first allocation that
    overlaps it (the rebuilt bucket is mapped into the old one's range: 296.10 MiB, as measured); the second
    measurement covers a bucket freed after its successor was mapped elsewhere."""
    pytest.importorskip("torch", reason=TORCH_REASON)
    mib = 2.0**20
    rest = 2 * (2 * 256 * 256 + 2 * 256 * 64 + 3 * 256 * 896 + 2 * 256) + 256  # two layers and the final norm
    adam = 8 * (32000 * 256 - rest) / mib  # fp32 AdamW: the embedding's state less the rest's

    def peak(rep, key):
        return rep[key]["peak_memory_bytes"] / mib

    for attempt in range(2):
        (tmp_path / str(attempt)).mkdir()
        zero0, zero1 = (
            validated(wide_vocab_plan(tmp_path / str(attempt), tied=True, devices=2, fix=fix))
            for fix in ("dp=2,zero=0", "dp=2,zero=1,shard=2")
        )
        ranks = sorted(x["peak_memory_bytes"] / mib for x in zero1["per_rank"])
        measured, predicted = (
            peak(zero1, "measured") - peak(zero0, "measured"),
            peak(zero1, "predicted") - peak(zero0, "predicted"),
        )
        assert predicted == pytest.approx(-13.0, abs=0.5)
        # the race above can count that buffer on one ZeRO-1 rank too (once in a full local run: 87.2 MiB apart)
        if ranks[1] - ranks[0] == pytest.approx(adam, abs=3.0) and measured == pytest.approx(predicted, abs=3.0):
            return
    pytest.fail(
        f"twice: the ZeRO-1 ranks {ranks[1] - ranks[0]:.1f} MiB apart (the embedding's Adam state: {adam:.1f}), "
        f"ZeRO-1 lowered the peak by {-measured:.1f} MiB (predicted {-predicted:.1f})"
    )


def test_rank_slice_proxy_memory_is_what_it_holds_when_the_embedding_outweighs_a_zero1_share(tmp_path):
    """A wide vocabulary (32,000 x 256, untied) over ZeRO-1 on 8: rank 0's whole-tensor share of the optimizer is
    the embedding (8.2 M of 18.1 M parameters, not 1/8), and its loss is the executor's cross-entropy. Before
    both (an even share predicted, a squared-output loss run) the measured peak was 28 % above the prediction;
    now within 5 % (1.4 % here)."""
    pytest.importorskip("torch", reason=TORCH_REASON)
    plans = wide_vocab_plan(tmp_path, tied=False, devices=8, fix="dp=8,zero=1,shard=8")
    rep = validated(plans, "--proxy", "rank-slice", "--layers", "2")
    rank = rep["per_rank"][0]
    assert rank["optimizer_parameters"] == 32000 * 256  # the embedding alone
    assert rank["predicted_breakdown"]["memory.optimizer_state"] == 8 * 32000 * 256  # fp32 AdamW: 2 x 4 bytes
    assert abs(rep["measured"]["peak_memory_bytes"] / rep["predicted"]["peak_memory_bytes"] - 1) < 0.05


def test_rank_slice_proxy_runs_one_rank_of_a_plan_larger_than_the_machine(tmp_path):
    """An 8-worker tp x pp x dp plan with sequence parallelism and ZeRO-1, on one process."""
    pytest.importorskip("torch", reason=TORCH_REASON)
    plans = plan_file(tmp_path, "--fix", "tp=2,pp=2,dp=2,sp=1,zero=1,mbs=2,vpp=1", devices="8")
    store = tmp_path / "s.sqlite"
    reports = []
    tmpdir = own_temp(tmp_path)
    for layers in ("2", "1"):
        r = berth(
            "validate",
            str(plans),
            "--proxy",
            "rank-slice",
            "--layers",
            layers,
            "--steps",
            "2",
            "--warmup",
            "1",
            "--store",
            str(store),
            "--json",
            tmpdir=tmpdir,
        )
        assert r.returncode == 0, r.stderr
        assert left_behind(tmpdir) == []  # the proxy's working directory is removed afterwards
        reports.append(json.loads(r.stdout))
    full, shallow = reports
    for rep in reports:
        assert rep["status"] == "ok" and rep["mode"] == "rank-slice"
        assert rep["measured"]["step_time_s"] > 0 and rep["measured"]["peak_memory_bytes"] > 0
        assert rep["checks"]["checked"] and any("across nodes" in c for c in rep["checks"]["not_checked"])
        rank = rep["per_rank"][0]
        assert rank["stage"] in (0, 1) and rank["forward_per_microbatch_s"] > 0
        # the optimizer holds half the parameters (ZeRO-1 over shard=2), within one tensor's size
        assert 0.3 < rank["optimizer_parameters"] / rank["parameters"] < 0.7
    assert shallow["per_rank"][0]["parameters"] < full["per_rank"][0]["parameters"]
    assert shallow["predicted"]["peak_memory_bytes"] < full["predicted"]["peak_memory_bytes"]
    r = berth("validate", str(plans), "--proxy", "rank-slice", "--layers", "9", "--store", str(store))
    assert r.returncode == 2 and "layers=9" in r.stderr
    r = berth("validate", str(plans), "--layers", "1", "--store", str(store))
    assert r.returncode == 2 and "rank-slice" in r.stderr
