"""benchmarks/gpu_validation.py, the evidence run a person with one GPU makes, rehearsed on CPU
(`--cpu-smoke`: tiny-gpt on `--cluster local --devices-per-node 2`): every berth command and flag
of the GPU sequence runs for real (profile, plan, validate, rank-slice proxy, calibrate on the
SQLite store, compare with the calibrated profile). Slow by CI standards: about a minute on an idle
2-core machine (real torchrun launches), marked `slow`."""

import json
import subprocess
import sys

import pytest

pytest.importorskip("torch", reason="the rehearsal profiles and validates with torch (the executor extra)")


@pytest.mark.slow
def test_gpu_validation_runs_end_to_end_in_cpu_mode(tmp_path):
    out = tmp_path / "gpu-cpu"
    r = subprocess.run(
        [sys.executable, "-m", "benchmarks.gpu_validation", "--cpu-smoke", "--out-dir", str(out), "--top", "2"],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    commands = [" ".join(c["command"]) for c in summary["commands"]]
    assert all(c["exit_code"] == 0 for c in summary["commands"]), commands
    assert commands[0].startswith("berth profile") and "--quick" in commands[0]
    assert any(
        c.startswith("berth plan tiny-gpt --cluster local --devices-per-node 2") and "--profile" in c for c in commands
    )
    assert sum(c.startswith("berth validate") and "--pick" in c for c in commands) == 2
    assert any("--proxy rank-slice --layers" in c for c in commands)
    assert any(c.startswith("berth calibrate --store") for c in commands)
    assert any(c.startswith("berth compare") and "calibrated.json" in c for c in commands)
    runs = summary["runs"]
    assert [x["mode"] for x in runs] == ["full", "full", "rank-slice"] and summary["statuses"] == {"ok": 3}
    assert all(x["measured_step_time_s"] > 0 and x["measured_peak_memory_bytes"] > 0 for x in runs)
    assert all(x["after_step_time_s"] > 0 for x in runs if x["mode"] == "full")
    calibration = json.loads((out / "calibrated.json").read_text())["calibration"]
    assert "compute_scale" in calibration["fitted"] and calibration["uncertainty"]["compute_scale"]["ci95"]
    assert (out / "profile.json").is_file() and (out / "results.sqlite").is_file()
    assert "errors are (measured - predicted) / predicted" in r.stdout
