"""The engine loop on a measured sweep (benchmarks/engine_sweep.py, the Ultra-Scale Playbook's nanotron runs):
the saved figures (benchmarks/results/engine_sweep.json, quoted in the README) are what the code computes now,
and calibrating on 12 probed runs of one GPU count moves the other groups' ranking and throughput the right way."""

import json
from pathlib import Path

import pytest

from benchmarks import engine_sweep

SAVED = Path(engine_sweep.__file__).resolve().parent / "results" / "engine_sweep.json"
KEYS = (
    "rho_median",
    "regret_median",
    "regret_twins_merged_median",
    "throughput_error_median",
    "memory_abs_error_median",
)


@pytest.fixture(scope="module")
def result():
    return engine_sweep.main(["--no-write"])


def test_the_saved_figures_are_what_the_code_computes(result):
    saved = json.loads(SAVED.read_text())
    assert saved["probe_gpus"] == result["probe_gpus"] and saved["probes"] == result["probes"]
    for size, r in result["models"].items():
        s = saved["models"][size]
        assert [p["layout"] for p in s["probes"]] == [p["layout"] for p in r["probes"]]
        for phase in ("before", "after"):
            for k in KEYS:
                assert r[phase][k] == pytest.approx(s[phase][k], abs=0.02), (size, phase, k)


def test_calibration_on_probes_improves_the_groups_it_never_saw(result):
    for size, r in result["models"].items():
        b, a = r["before"], r["after"]
        assert len(r["probes"]) == 12 and r["fitted"]
        assert a["rho_median"] > b["rho_median"], size
        assert a["regret_median"] < b["regret_median"], size
        assert a["throughput_error_median"] < b["throughput_error_median"], size
        assert a["refused"] == 0 and b["refused"] == 0  # the generic engine refuses no layout nanotron ran
