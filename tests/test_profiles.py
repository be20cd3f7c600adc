"""Hardware profiles are data with sources; `berth profile` measures this machine into a profile
the planner accepts; `berth calibrate` fits the named parameters and recovers known ones."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from berth.hardware_profiles import device_names, load_device, load_profile_file, load_server, server_names
from berth.planner.calibrate import PARAMETERS, apply, calibrate, current_values
from berth.planner.planning import make_cluster, make_search, plan
from berth.planner.search import predict_layouts
from berth.specs.models import presets
from berth.specs.tree import Layout, Metrics, TrainingSpec, ValidationReport

BERTH = [sys.executable, "-m", "berth.cli.main"]
DEVICES = ("a100-40g", "a100-80g", "h100-sxm", "h100-pcie", "h200", "b200", "mi300x", "l40s", "l4")

ROOT = Path(__file__).resolve().parents[1]


def test_every_gpu_device_lists_its_nvidia_smi_names_and_each_resolves_to_it():
    """The nvidia-smi names live with the device (its file's `nvidia_smi` section): every NVIDIA GPU
    profile lists some, each name resolves to that device and its server preset (whose device it is),
    no name belongs to two devices, and an unknown GPU is refused naming the known ones."""
    from berth.hardware_profiles import UnknownProfileError, nvidia_smi_device, nvidia_smi_names

    seen: dict[str, str] = {}
    for device in device_names():
        entry, profile = nvidia_smi_names(device), load_device(device)
        if profile.kind != "gpu" or not profile.display_name.startswith("NVIDIA"):
            assert entry is None, device
            continue
        assert entry is not None and entry.source, device
        for name in entry.names:
            assert name.lower() not in seen, (name, device, seen.get(name.lower()))
            seen[name.lower()] = device
            assert nvidia_smi_device(f"  {name.lower()} ") == (device, entry.server)
        assert load_server(entry.server).device == device
    assert "h100-sxm" in seen.values() and nvidia_smi_device("NVIDIA H100 80GB HBM3") == ("h100-sxm", "dgx-h100")
    with pytest.raises(UnknownProfileError) as err:
        nvidia_smi_device("NVIDIA H100")  # a prefix of a known name is not that GPU
    assert "NVIDIA H100 80GB HBM3" in err.value.known and len(err.value.known) == len(seen)


def test_every_device_and_server_loads_with_sources():
    assert set(DEVICES) <= set(device_names())
    for name in device_names():
        d = load_device(name)
        assert d.sources, name
        assert any(k.startswith("peak_flops_per_s") for k in d.sources), name
        assert d.gemm.peak_fraction == sorted(d.gemm.peak_fraction), name  # larger shapes never slower
        if d.kind == "gpu":  # every GPU carries the measured compute model, with where its numbers come from
            assert d.gemm_shape and d.attention_shape and {"pytorch", "megatron", "torchtitan"} <= set(d.frameworks)
            for key in ("gemm_shape", "attention_shape", "frameworks.pytorch"):
                assert key in d.sources or key in d.assumptions, (name, key)
            # the typical projection GEMM is below the best-shape (MAMF) figure the profile quotes
            assert d.gemm_shape.max_fraction < max(d.gemm.peak_fraction), name
    for name in server_names():
        s = load_server(name)
        assert s.sources and load_device(s.device)


@pytest.mark.parametrize("preset", [s for s in server_names() if s != "local-cpu"])
def test_every_cluster_preset_plans_llama3_8b(preset):
    training = TrainingSpec(seq_len=4096, global_batch_size=64)
    result = plan(presets()["llama3-8b"], training, make_cluster(preset, 2), make_search(top=1))
    best = result.plans[0]
    assert best.prediction.fits and 0.05 < best.prediction.mfu < 0.9, (preset, best.layout.short())


def test_faster_devices_are_predicted_faster():
    training = TrainingSpec(seq_len=4096, global_batch_size=64)
    model = presets()["llama3-8b"]

    def best(preset):
        return plan(model, training, make_cluster(preset, 1), make_search(top=1)).plans[0].prediction.step_time_s

    assert best("dgx-b200") < best("dgx-h100") < best("dgx-a100-80g") < best("pcie-l40s") < best("pcie-l4")


@pytest.fixture(scope="module")
def quick_profile(tmp_path_factory):
    pytest.importorskip("torch", reason="`berth profile` measures with torch (the executor extra)")
    out = tmp_path_factory.mktemp("profile") / "profile.json"
    r = subprocess.run([*BERTH, "profile", "--quick", "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    (out.parent / "stdout.txt").write_text(r.stdout)
    return out


def test_profile_measures_this_machine(quick_profile):
    device, server = load_profile_file(quick_profile)
    assert device.kind == "cpu" and device.name.endswith("-profiled")
    assert 1e9 < device.peak_flops("fp32") < 1e13  # a CPU core: GFLOP/s to a few TFLOP/s
    assert max(device.gemm.peak_fraction) == pytest.approx(1.0)
    assert 0 < device.attention_peak_fraction <= 1 and device.memory_bandwidth_bytes_per_s > 1e8
    assert set(server.intra_node.op_time_scale) == {"all_gather", "reduce_scatter", "p2p"}
    raw = json.loads(quick_profile.read_text())["measurements"]
    assert len(raw["gemm"]) >= 4 and raw["collectives"]["2"]["backend"] == "gloo"
    assert {a["backend"] for a in raw["attention"]} <= {"flash_attention", "efficient_attention", "math"}
    assert raw["attention"][0]["backend"] in device.sources["attention_peak_fraction"]  # the profile names its kernel
    printed = " ".join((quick_profile.parent / "stdout.txt").read_text().split())
    assert f"of peak ({raw['attention'][0]['backend']})" in printed  # and so does its summary


def test_attention_is_timed_as_the_executors_layer_calls_it(monkeypatch):
    """`berth profile` times the SDPA kernel the executor's layer runs: q, k, v contiguous as a grouped-query
    layer passes them (`rotary`, `repeat_interleave`), causal, no backend forced (every SDPA backend still
    enabled inside the call, `sdpa_kernel` never entered), and it records the backend torch selects. Forcing
    flash on a GPU timed another kernel than the layers run (benchmarks/results/gpu-h200/README.md).
    A recording stand-in checks the call; the real SDPA runs under it."""
    import torch
    import torch.nn.attention
    import torch.nn.functional as F

    from berth.executor import profile as prof
    from berth.executor.model import Attention
    from berth.specs.tree import ModelSpec

    real, calls = F.scaled_dot_product_attention, []

    def recording(q, k, v, **kw):
        calls.append(
            {
                "contiguous": (q.is_contiguous(), k.is_contiguous(), v.is_contiguous()),
                "causal": kw.get("is_causal"),
                "enabled": (torch._C._get_math_sdp_enabled(), torch._C._get_mem_efficient_sdp_enabled()),
            }
        )
        return real(q, k, v, **kw)

    def forced(*args, **kwargs):
        raise AssertionError("a backend was forced")

    monkeypatch.setattr(F, "scaled_dot_product_attention", recording)
    monkeypatch.setattr(torch.nn.attention, "sdpa_kernel", forced)
    cpu = torch.device("cpu")
    fwd_s, bwd_s, backend = prof._time_attention(cpu, prof.timer(cpu), 2, 4, 64, 16, 2)
    assert fwd_s > 0 and bwd_s > 0 and backend == "flash_attention"  # torch's CPU pick for these inputs
    expected = {"contiguous": (True, True, True), "causal": True, "enabled": (True, True)}
    assert calls and all(c == expected for c in calls)
    # the layer itself (one rank, 4 query heads over 2 key/value heads) calls SDPA with the same layout
    shape = {"num_layers": 1, "hidden_size": 64, "num_attention_heads": 4, "vocab_size": 32, "ffn_hidden_size": 128}
    calls.clear()
    Attention(ModelSpec(name="t", num_kv_heads=2, **shape), 1)(torch.randn(2, 8, 64))
    assert [c["contiguous"] for c in calls] == [(True, True, True)]


def test_plan_accepts_the_profile(quick_profile):
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
            "--profile",
            str(quick_profile),
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    cluster = json.loads(r.stdout)["plans"][0]["cluster"]
    assert cluster["device"]["name"].endswith("-profiled") and cluster["intra_node"]["op_time_scale"]
    r = subprocess.run([*BERTH, "plan", "tiny-gpt", "--profile", "/nonexistent.json"], capture_output=True, text=True)
    assert r.returncode == 2 and "profile" in r.stderr


def test_a_gpu_profile_read_without_a_gpu_keeps_its_device_memory(monkeypatch):
    """`--cluster local --profile` with the H200 profile of benchmarks/results/gpu-h200 on a machine without a GPU
    (re-predicting the GPU's runs, as that folder's README does): the plan is the profiled machine's, with the H200's
    memory (the profile's 140 GiB), not this host's RAM shared by CPU workers, which capped it at a few GiB before."""
    from berth.topology import clusters

    monkeypatch.setattr(clusters, "local_gpus", lambda: [])
    path = ROOT / "benchmarks" / "results" / "gpu-h200" / "profile.json"
    profile = load_profile_file(path)
    device = profile[0]
    cluster = clusters.local_cluster(1, profile)
    assert cluster.device.kind == "gpu" and cluster.device.memory_bytes == device.memory_bytes > 140 * 2**30
    cpu = clusters.local_cluster(2)  # without a profile: this host's CPU workers and its RAM
    assert cpu.device.kind == "cpu" and cpu.device.memory_bytes < device.memory_bytes


def test_calibration_on_the_h200_runs_predicts_the_runs_it_did_not_see_better(tmp_path):
    """Real GPU measurements (benchmarks/results/gpu-h200/2026-11-26: whole steps of the executor on one H200): `berth
    calibrate` on the five reports the evidence run fitted, then `berth compare --profile` of the four runs it
    did not see, as that folder's README re-predicts them on a machine without a GPU. The fit moves and the
    held-out step-time error falls (9.2 % -> 5.7 % when it was measured); memory stays within 3 %."""
    folder = ROOT / "benchmarks" / "results" / "gpu-h200" / "2026-11-26"
    fitted = [
        folder / f"report-{n}.json"
        for n in (
            "llama-3.2-1b-1",
            "gpt2-xl-1",
            "llama-3.2-3b-1",
            "llama3-8b-dgx-h100-rank-slice",
            "llama3-70b-8x-dgx-h100-rank-slice",
        )
    ]
    out = tmp_path / "calibrated.json"
    env = {**os.environ, "BERTH_DEVICE": "cpu"}  # the GPU's runs re-predicted as on a machine without one
    r = subprocess.run(
        [*BERTH, "calibrate", *map(str, fitted), "--holdout", "0", "--out", str(out)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-2000:]

    def predicted(example: str, layouts: list[str], profile: Path) -> list[dict]:
        r = subprocess.run(
            [
                *BERTH,
                "compare",
                str(ROOT / "examples" / "models" / f"{example}.json"),
                *("--cluster", "local", "--devices-per-node", "1", "--seq-len", "4096", "--global-batch", "16"),
                *("--profile", str(profile), *layouts, "--json"),
            ],
            capture_output=True,
            text=True,
            env=env,
            timeout=300,
        )
        assert r.returncode == 0, r.stderr[-2000:]
        return [c["prediction"] for c in json.loads(r.stdout)["candidates"]]

    before, after = [], []  # both predicted here and now: the measured profile, then the calibrated one
    for example in ("llama-3.2-1b", "gpt2-xl"):
        reports = [json.loads((folder / f"report-{example}-{k}.json").read_text()) for k in (2, 3)]
        layouts = [a for x in reports for a in ("--layout", Layout.model_validate(x["plan"]["layout"]).short())]
        first, then = predicted(example, layouts, folder / "profile.json"), predicted(example, layouts, out)
        for report, p0, p1 in zip(reports, first, then, strict=True):
            measured = report["measured"]
            before.append(abs(measured["step_time_s"] / p0["step_time_s"] - 1))
            after.append(abs(measured["step_time_s"] / p1["step_time_s"] - 1))
            memory = measured["peak_memory_bytes"] / p1["peak_memory_bytes"] - 1
            assert abs(memory) < 0.03, (example, memory)
    assert np.mean(after) < 0.8 * np.mean(before), (before, after)


def _synthetic_reports(truth: dict[str, float], n_noise: float = 0.0):
    """Reports whose 'measurements' are the cost model's predictions on a cluster with known
    parameter values, so a correct fit must find values that reproduce them."""
    model = presets()["tiny-gpt"]
    training = TrainingSpec(seq_len=256, global_batch_size=8, precision="fp32")
    base = make_cluster("local", 1, 2)
    layouts = [
        Layout(dp=2, zero_stage=z, shard=2 if z else 1, micro_batch_size=m, num_microbatches=4 // m, recompute=r)
        for z in (0, 1, 2, 3)
        for m in (1, 2, 4)
        for r in ("none", "full")
    ]
    layouts += [Layout(tp=2, micro_batch_size=m, num_microbatches=8 // m) for m in (1, 2, 4)]
    layouts += [Layout(pp=2, micro_batch_size=1, num_microbatches=8, schedule=s) for s in ("gpipe", "1f1b")]
    planned = predict_layouts(model, training, base, layouts)
    true = predict_layouts(model, training, apply(base, truth), layouts)
    rng = np.random.default_rng(0)
    reports = []
    for i, (p, t) in enumerate(zip(planned, true, strict=True)):
        noise = 1 + n_noise * rng.standard_normal(2)
        reports.append(
            ValidationReport(
                id=f"r{i:03d}",
                created="2026-01-01",
                berth_version="test",
                status="ok",
                plan=p,
                steps=3,
                warmup=1,
                predicted=Metrics(),
                measured=Metrics(
                    step_time_s=t.prediction.step_time_s * noise[0],
                    peak_memory_bytes=t.prediction.peak_memory_bytes * noise[1],
                ),
            )
        )
    return reports, base


def test_calibrate_recovers_known_parameters():
    base = make_cluster("local", 1, 2)
    truth = {**current_values(base), "compute_scale": 0.6, "comm_scale": 3.0, "framework_overhead_bytes": 20 * 2**20}
    reports, _ = _synthetic_reports(truth)
    fit = calibrate(reports, holdout=0.3, seed=1)
    assert fit.errors["held_out_before"]["step_time_mape"] > 0.2  # the base profile is far off
    assert fit.errors["held_out_after"]["step_time_mape"] < 0.02  # held-out layouts predicted after the fit
    assert fit.errors["held_out_after"]["memory_mape"] < 0.02
    assert set(fit.values) == set(PARAMETERS) and len(fit.held_out_ids) >= 3


def test_calibrate_cli_writes_a_usable_profile(tmp_path):
    truth = {**current_values(make_cluster("local", 1, 2)), "compute_scale": 0.7}
    reports, _ = _synthetic_reports(truth, n_noise=0.02)
    paths = []
    for r in reports:
        path = tmp_path / f"{r.id}.json"
        path.write_text(r.model_dump_json())
        paths.append(str(path))
    out = tmp_path / "calibrated.json"
    r = subprocess.run([*BERTH, "calibrate", *paths, "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "held out" in r.stdout and "compute_scale" in r.stdout
    device, server = load_profile_file(out)
    assert device.name.endswith("-calibrated")
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
            "256",
            "--global-batch",
            "8",
            "--profile",
            str(out),
            "--json",
        ],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stderr
    r = subprocess.run([*BERTH, "calibrate", str(tmp_path / "missing.json")], capture_output=True, text=True)
    assert r.returncode == 2 and "reports" in r.stderr


def test_the_h200_steps_error_sat_in_the_measured_profiles_attention_and_the_remeasured_profile_has_none():
    """benchmarks/gpu_repredict.py on the two H200 evidence runs (benchmarks/results/gpu-h200, its README). The
    first (2026-11-26/): the seven whole steps predicted with the profile measured there ran ~10 % slow; swapping
    in the bundled profile's attention terms, and nothing else, took most of that away. The second (this
    folder), after `berth profile` timed SDPA as the layer calls it (no backend forced; the profile names the kernel
    torch picked, cuDNN's): its attention terms predict the same seven steps as the bundled ones do (the swap moves
    the mean error by under a point) and the steps come within 7 % at the mean. What the README and
    executor/profile.py say."""
    from benchmarks import gpu_repredict

    names = ["profile.json as measured", "profile.json, attention terms of the bundled profile", "bundled h200 profile"]
    v = gpu_repredict.run(gpu_repredict.FOLDER / "2026-11-26")["variants"]
    assert [len(x["runs"]) for x in v.values()] == [7, 7, 7, 7] and list(v)[:3] == names
    measured, swapped, bundled = (v[n]["mean_abs_error"] for n in names)
    assert v[names[0]]["bias"] > 0.05 and swapped < 0.7 * measured and bundled < 0.7 * measured

    v = gpu_repredict.run()["variants"]
    assert [len(x["runs"]) for x in v.values()] == [7, 7, 7, 7]
    measured, swapped, bundled = (v[n]["mean_abs_error"] for n in names)
    assert measured < 0.07 and abs(v[names[0]]["bias"]) < 0.05 and abs(swapped - measured) < 0.01
    # the GEMM alignment terms, measured after the run: GPT-2 XL's odd vocabulary (its three plans are the first
    # three rows, 7.5-12 % predicted fast without them) comes within 4 %, the whole seven within 3.5 % at the mean
    aligned = v[gpu_repredict.ALIGNED]
    assert aligned["mean_abs_error"] < 0.035 and bundled < 0.035
    assert all(abs(r["error"]) < 0.04 for r in aligned["runs"][:3])
    assert all(r["error"] < -0.07 for r in v[names[0]]["runs"][:3])
    profile = json.loads((gpu_repredict.FOLDER / "profile.json").read_text())
    assert {a["backend"] for a in profile["measurements"]["attention"]} == {"cudnn_attention"}


def test_the_h200_run_made_with_the_alignment_terms_in_the_code_predicts_its_steps_within_five_percent():
    """The third H200 run (benchmarks/results/gpu-h200/2026-11-28, its README), the first predicted with the GEMM
    alignment terms that the isolated GEMMs gave: its five whole steps (GPT-2 XL's three plans, 8-14 % slower than
    predicted before the terms, and the two Llama models' first-ranked plans) re-predicted by the current code from
    that run's own profile come within 3 % at the mean and 5 % each, and the profile timed the two factors there."""
    from benchmarks import gpu_repredict

    folder = gpu_repredict.FOLDER / "2026-11-28"
    as_run = gpu_repredict.run(folder)["variants"]["profile.json as measured"]
    assert len(as_run["runs"]) == 5 and as_run["mean_abs_error"] < 0.03
    assert all(abs(r["error"]) < 0.05 for r in as_run["runs"])
    shape = json.loads((folder / "profile.json").read_text())["device"]["gemm_shape"]
    assert 2.0 < shape["misaligned_slowdown"] < 3.5 and 4.5 < shape["odd_slowdown"] < 7.0
