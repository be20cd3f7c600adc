"""The GPU-only code paths, run on this CPU machine: `--cluster local` behind a fake `nvidia-smi` on
PATH, the executor's CUDA set-up with `torch.cuda` replaced by recording stand-ins, and `berth
profile`'s CUDA timing and arithmetic on synthetic timings. Nothing here skips for lack of a GPU."""

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

torch = pytest.importorskip(
    "torch", reason="the executor's CUDA set-up and `berth profile` run on torch (the executor extra)"
)

from berth.executor import device as executor_device  # noqa: E402 (`berth` is this module's CLI helper below)
from berth.executor import profile as prof  # noqa: E402
from berth.hardware_profiles import DeviceProfile, load_device, load_server  # noqa: E402

BERTH = [sys.executable, "-m", "berth.cli.main"]
H100_LINE = "NVIDIA H100 80GB HBM3, 81559"
H100_BYTES = 81559 * 2**20
QUERY = "--query-gpu=name,memory.total --format=csv,noheader,nounits"  # what topology/clusters.py asks


def fake_nvidia_smi(directory: Path, line: str = H100_LINE) -> Path:
    """An `nvidia-smi` that answers local_gpus()'s exact query (any other query fails loudly) and
    logs every call."""
    directory.mkdir(parents=True, exist_ok=True)
    script = directory / "nvidia-smi"
    script.write_text(
        f'#!/bin/sh\necho "$*" >> "{directory}/calls.log"\n'
        f'if [ "$*" = "{QUERY}" ]; then echo "{line}"; exit 0; fi\n'
        'echo "fake nvidia-smi: unexpected arguments: $*" >&2; exit 9\n'
    )
    script.chmod(0o755)
    return directory


@pytest.fixture
def gpu_path(tmp_path, monkeypatch):
    """PATH with the fake nvidia-smi first (in this process and its children)."""
    bin_dir = fake_nvidia_smi(tmp_path / "bin")
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.delenv("BERTH_DEVICE", raising=False)
    return bin_dir


def berth(*args, env=None, timeout=180):
    return subprocess.run([*BERTH, *args], capture_output=True, text=True, timeout=timeout, env=env)


MODEL_1B = str(Path(__file__).resolve().parents[1] / "examples" / "models" / "llama-3.2-1b.json")


def test_local_cluster_on_an_h100_plans_compares_and_validates(gpu_path, tmp_path):
    r = berth("plan", MODEL_1B, "--cluster", "local", "--seq-len", "4096", "--global-batch", "16", "--json")
    assert r.returncode == 0, r.stderr
    plans = json.loads(r.stdout)["plans"]
    assert plans and (gpu_path / "calls.log").read_text().strip().splitlines()[0] == QUERY
    cluster = plans[0]["cluster"]
    assert cluster["name"] == "local" and cluster["gpus_per_node"] == 1
    assert cluster["device"]["name"] == "h100-sxm" and cluster["device"]["memory_bytes"] == H100_BYTES
    assert cluster["intra_node"] == load_server("dgx-h100").intra_node.model_dump(mode="json")
    assert all(p["prediction"]["peak_memory_bytes"] <= H100_BYTES for p in plans if p["prediction"]["fits"])
    plans_file = tmp_path / "plans.json"
    plans_file.write_text(r.stdout)

    r = berth(
        "compare",
        MODEL_1B,
        "--cluster",
        "local",
        "--seq-len",
        "4096",
        "--global-batch",
        "16",
        "--layout",
        "mbs=1,recompute=full",
        "--layout",
        "mbs=16",
        "--json",
    )
    assert r.returncode == 0, r.stderr
    candidates = json.loads(r.stdout)["candidates"]
    assert candidates[0]["prediction"]["fits"] and not candidates[1]["prediction"]["fits"]  # 16 x 4096 in 80 GB

    # the validation is built for the GPU (1 rank, NCCL side) and launched; torch here has no CUDA,
    # so the worker refuses to measure a GPU plan on the CPU, and says why
    store = tmp_path / "results.sqlite"
    r = berth("validate", str(plans_file), "--steps", "1", "--warmup", "0", "--store", str(store), "--timeout", "120")
    assert r.returncode == 1, r.stdout + r.stderr
    assert "torch sees no CUDA device" in r.stderr
    r = berth("launch", str(plans_file), "--format", "torchrun", "--out", str(tmp_path / "run"))
    assert r.returncode == 0, r.stderr
    assert "--nproc-per-node=1" in (tmp_path / "run" / "node0.sh").read_text()


def test_unknown_gpu_is_an_error_naming_the_known_ones(tmp_path):
    bin_dir = fake_nvidia_smi(tmp_path / "bin", "NVIDIA Imaginary X1, 24000")
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
    env.pop("BERTH_DEVICE", None)
    r = berth("plan", "tiny-gpt", "--cluster", "local", "--seq-len", "128", "--global-batch", "8", env=env)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "NVIDIA Imaginary X1" in r.stderr and "NVIDIA H100 80GB HBM3" in r.stderr and "Traceback" not in r.stderr


def test_api_local_preset_on_an_h100(gpu_path, tmp_path):
    from fastapi.testclient import TestClient

    from berth.api.app import create_app
    from berth.api.settings import Settings

    with TestClient(create_app(Settings(store_path=str(tmp_path / "api.sqlite")))) as client:
        body = {
            "model": "tiny-gpt",
            "training": {"seq_len": 512, "global_batch_size": 8},
            "cluster": {"preset": "local"},
            "search": {"top": 2},
        }
        r = client.post("/v1/plans", json=body)
        assert r.status_code == 200, r.text
        cluster = r.json()["plans"][0]["cluster"]
        assert cluster["device"]["name"] == "h100-sxm" and cluster["device"]["memory_bytes"] == H100_BYTES
        compare = {k: v for k, v in body.items() if k != "search"}
        r = client.post("/v1/compare", json={**compare, "layouts": ["mbs=8", "mbs=1,recompute=full"]})
        assert r.status_code == 200, r.text
        r = client.post("/v1/plans", json={**body, "cluster": {"preset": "local", "devices_per_node": 4}})
        assert r.status_code == 422 and "devices_per_node" in r.text  # this machine has one GPU


# --- CUDA set-up order in every executor entry point -------------------------------------------


class CudaRecorder:
    """torch.cuda stand-ins that record each call; memory calls made before set_device and
    init on the device fail as the real allocator does ("Invalid device argument")."""

    def __init__(self):
        self.calls: list[str] = []
        self.ready = False

    def install(self, monkeypatch):
        executor_device._READY.clear()
        monkeypatch.setattr(executor_device, "_READY", set())
        rec = self

        def record(name, result=None, needs_init=False):
            def fn(*args, **kwargs):
                rec.calls.append(name)
                if needs_init and not rec.ready:
                    raise RuntimeError(f"{name} before CUDA initialisation: Invalid device argument")
                return result() if callable(result) else result

            return fn

        def init(*args, **kwargs):
            rec.calls.append("init")
            if "set_device" in rec.calls:
                rec.ready = True

        monkeypatch.setattr(torch.cuda, "is_available", record("is_available", True))
        monkeypatch.setattr(torch.cuda, "set_device", record("set_device"))
        monkeypatch.setattr(torch.cuda, "init", init)
        monkeypatch.setattr(torch.cuda, "synchronize", record("synchronize"))
        monkeypatch.setattr(torch.cuda, "device_count", record("device_count", 1))
        monkeypatch.setattr(torch.cuda, "get_device_name", record("get_device_name", "NVIDIA H100 80GB HBM3"))
        monkeypatch.setattr(
            torch.cuda,
            "get_device_properties",
            record("get_device_properties", SimpleNamespace(total_memory=H100_BYTES)),
        )
        for name in ("reset_peak_memory_stats", "max_memory_reserved", "memory_allocated", "max_memory_allocated"):
            monkeypatch.setattr(torch.cuda, name, record(name, 0, needs_init=True))
        monkeypatch.setattr(torch.cuda, "mem_get_info", record("mem_get_info", (0, H100_BYTES), needs_init=True))
        return self

    def assert_initialised_before_memory_calls(self):
        memory = [
            i
            for i, c in enumerate(self.calls)
            if c in ("reset_peak_memory_stats", "max_memory_reserved", "memory_allocated", "mem_get_info")
        ]
        assert "set_device" in self.calls and "init" in self.calls, self.calls
        first_init = max(self.calls.index("set_device"), self.calls.index("init"))
        assert all(i > first_init for i in memory), self.calls


@pytest.fixture(autouse=True)
def _keep_torch_threads():
    """The entry points set this process's torch thread count (one per rank): put it back."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def _gpu_plan(tmp_path) -> Path:
    """A one-rank tiny-gpt plan for an H100 (what `--cluster local` gives on a one-GPU machine)."""
    from berth.planner.search import predict_layouts
    from berth.specs.models import presets
    from berth.specs.tree import Layout, TrainingSpec
    from berth.topology.clusters import cluster_from_preset

    plan = predict_layouts(
        presets()["tiny-gpt"],
        TrainingSpec(seq_len=128, global_batch_size=8),
        cluster_from_preset("dgx-h100", 1),
        [Layout(micro_batch_size=4, num_microbatches=2)],
    )[0]
    assert plan.cluster.device.kind == "gpu" and plan.layout.world_size == 1
    path = tmp_path / "plan.json"
    path.write_text(plan.model_dump_json())
    return path


def test_worker_initialises_cuda_before_the_peak_counters(tmp_path, monkeypatch):
    from berth.executor import worker

    rec = CudaRecorder().install(monkeypatch)
    (tmp_path / "plans.json").write_text("[" + _gpu_plan(tmp_path).read_text() + "]")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setattr(
        sys,
        "argv",
        ["worker", "--plans", str(tmp_path / "plans.json"), "--out", str(tmp_path / "out.json"), "--steps", "1"],
    )
    with pytest.raises((AssertionError, RuntimeError)):  # the model cannot move to a GPU this torch lacks
        worker.main()
    assert "reset_peak_memory_stats" in rec.calls  # the run got as far as the memory tracker
    rec.assert_initialised_before_memory_calls()


def test_proxy_initialises_cuda_before_the_peak_counters(tmp_path, monkeypatch):
    from berth.executor import proxy

    rec = CudaRecorder().install(monkeypatch)
    monkeypatch.setattr(
        sys,
        "argv",
        [
            "proxy",
            "--plan",
            str(_gpu_plan(tmp_path)),
            "--layers",
            "1",
            "--in-flight",
            "1",
            "--steps",
            "1",
            "--warmup",
            "0",
            "--out",
            str(tmp_path / "r.json"),
        ],
    )
    with pytest.raises((AssertionError, RuntimeError)):
        proxy.main()
    assert rec.calls.index("reset_peak_memory_stats") > rec.calls.index("init")
    rec.assert_initialised_before_memory_calls()


def test_profile_initialises_cuda_first_and_names_the_gpu(monkeypatch):
    rec = CudaRecorder().install(monkeypatch)
    with pytest.raises((AssertionError, RuntimeError)):  # the first GEMM needs a real GPU
        prof.run_profile(quick=True)
    assert rec.calls.index("set_device") < rec.calls.index("get_device_name")
    assert rec.calls.index("init") < rec.calls.index("get_device_name")
    assert prof.gpu_base("NVIDIA H100 80GB HBM3") == ("h100-sxm", "dgx-h100")
    from berth.specs.errors import BerthError

    with pytest.raises(BerthError, match="NVIDIA H100 80GB HBM3"):  # an unknown GPU names the known ones
        prof.gpu_base("NVIDIA Imaginary X1")


def test_peak_memory_tracker_alone_initialises_cuda(monkeypatch):
    from berth.executor.train import PeakMemory

    rec = CudaRecorder().install(monkeypatch)
    tracker = PeakMemory(torch.device("cuda", 0))
    tracker.start()
    tracker.mark()
    tracker.stop()
    assert rec.calls[:3] == ["set_device", "init", "synchronize"]
    rec.assert_initialised_before_memory_calls()
    assert tracker.peak == 0.0


def test_the_recorder_catches_the_old_order(monkeypatch):
    """Without the init, the stand-in fails as the H100 did: the check above can fail."""
    rec = CudaRecorder().install(monkeypatch)
    with pytest.raises(RuntimeError, match="Invalid device argument"):
        torch.cuda.reset_peak_memory_stats(torch.device("cuda", 0))
    assert rec.calls == ["reset_peak_memory_stats"]


# --- berth profile on CUDA: timing and arithmetic on synthetic timings ------------------------------


class FakeEvent:
    """torch.cuda.Event on a fake GPU clock advanced by the timed function."""

    clock = 0.0

    def __init__(self, enable_timing=False):
        assert enable_timing
        self.t = None

    def record(self):
        self.t = FakeEvent.clock

    def elapsed_time(self, end):
        return (end.t - self.t) * 1e3  # milliseconds, as CUDA events report


def test_cuda_event_timer_takes_the_median_after_warmup(monkeypatch):
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    durations = iter([9.0, 9.0, 9.0] + [0.010, 0.012, 0.011, 0.050, 0.011])  # 3 slow warm-ups, then one outlier
    calls = []

    def fn():
        calls.append(1)
        FakeEvent.clock += next(durations)

    assert prof.cuda_event_median(fn, reps=5, warmup=3) == pytest.approx(0.011)
    assert len(calls) == 8
    assert prof.repetitions(1e-5, 0.2) == prof.MAX_REPS and prof.repetitions(0.05, 0.2) == prof.MIN_REPS
    assert prof.repetitions(0.002, 0.2) == 100


def test_gpu_gemm_shapes_are_the_layers_berth_predicts():
    shapes = prof.layer_gemm_shapes()
    assert (16384, 16384, 53248) in shapes  # 405B down projection, tp 1, 16k tokens
    assert (8192, 8192, 8192) in shapes  # the square reference
    assert all(m * n * k <= 16384 * 16384 * 53248 for m, n, k in shapes)
    assert (32768, 2048, 2048) in shapes and (2048, 2048, 256) in shapes  # 1B output proj; its tp=8 slice
    assert min(min(s) for s in shapes) <= 256 and len(shapes) > 100
    quick = prof.layer_gemm_shapes(prof.QUICK_GPU_HIDDEN, prof.QUICK_GPU_TP, prof.QUICK_GPU_TOKENS)
    assert (8192, 8192, 8192) in quick and len(quick) < 20
    att = prof.attention_shapes("cuda", False)
    assert {s for _, _, s, _ in att} == {2048, 4096, 8192} and {d for *_, d in att} == {128, 64}
    assert len([1 for *_, d in att if d == 64]) == 3 * len(prof.SMALL_HEAD_HEADS)  # GPT-2 XL's head dim, each seq
    quick_att = prof.attention_shapes("cuda", True)
    assert [d for *_, d in quick_att].count(64) == 1 and [d for *_, d in quick_att].count(128) == 2


def _synthetic_measurements(efficiency, attention_flops_per_s, bandwidth, rng, noise=0.02, peak=989e12):
    """Timings a GPU with GEMM efficiency `efficiency(m, n, k)` of `peak` would give."""
    gemm = []
    for m, n, k in prof.layer_gemm_shapes():
        flops = 2.0 * m * n * k
        achieved = peak * efficiency(m, n, k) * (1 + noise * rng.standard_normal())
        gemm.append(
            {
                "m": m,
                "n": n,
                "k": k,
                "rows": m,
                "min_dim": min(m, n, k),
                "seconds": flops / achieved,
                "flops_per_s": achieved,
            }
        )
    attention = []
    for b, h, s, d in prof.attention_shapes("cuda", False):
        f, bw = prof.attention_flops(b, h, s, d)
        rate = attention_flops_per_s * (1 + noise * rng.standard_normal())
        attention.append(
            {
                "batch": b,
                "heads": h,
                "seq": s,
                "head_dim": d,
                "forward_s": f / rate,
                "backward_s": bw / rate,
                "flops_per_s": rate,
            }
        )
    return {"gemm": gemm, "attention": attention, "memory_bandwidth_bytes_per_s": bandwidth, "op_overhead_s": 5e-6}


def test_profile_fields_recover_a_known_gpu_from_its_timings():
    rng = np.random.default_rng(3)
    h100 = load_device("h100-sxm")

    def eff(m, n, k):
        d = min(m, n, k)
        return 0.80 * d / (d + 120.0)

    meas = _synthetic_measurements(eff, 0.55 * 989e12, 2.97e12, rng)
    fields, sources, checks = prof.profile_fields(meas, h100, "bf16")
    assert fields["peak_flops_per_s"]["bf16"] == 989e12  # the datasheet stays the MFU reference
    curve = fields["gemm"]
    assert curve.peak_fraction == sorted(curve.peak_fraction)
    for d, f in zip(curve.min_dim, curve.peak_fraction, strict=True):
        assert f == pytest.approx(0.80 * d / (d + 120.0), rel=0.05), d
    assert fields["attention_peak_fraction"] == pytest.approx(0.55, rel=0.02)
    assert fields["memory_bandwidth_bytes_per_s"] == h100.memory_bandwidth_bytes_per_s
    assert fields["memory_bandwidth_fraction"] == pytest.approx(2.97 / 3.35)
    assert checks["peak_agrees"] and abs(checks["curve_top_vs_square"]) <= prof.PEAK_AGREEMENT
    assert "datasheet" in sources["peak_flops_per_s.bf16"]


def test_a_bad_gemm_sweep_does_not_cap_attention_and_is_flagged():
    """The H100 run of issue 19: GEMMs measured at 320 TFLOP/s (launch-bound), attention at 500.
    Attention is a fraction of the datasheet (0.51), not 100 % of the bad GEMM figure; a square
    matmul at 790 beside a curve topping at 320 is flagged."""
    rng = np.random.default_rng(4)
    meas = _synthetic_measurements(lambda m, n, k: 320 / 989, 500e12, 3.0e12, rng, noise=0.0)
    square = next(g for g in meas["gemm"] if g["m"] == g["n"] == g["k"] == 8192)
    square["flops_per_s"] = 790e12
    fields, _, checks = prof.profile_fields(meas, load_device("h100-sxm"), "bf16")
    assert fields["attention_peak_fraction"] == pytest.approx(500 / 989)
    assert not checks["peak_agrees"]


def test_isotonic_fit_is_the_least_squares_monotone_curve():
    assert prof.isotonic([0.2, 0.5, 0.4, 0.7]) == pytest.approx([0.2, 0.45, 0.45, 0.7])
    assert prof.isotonic([0.3, 0.1], [3, 1]) == pytest.approx([0.25, 0.25])
    assert prof.isotonic([0.1, 0.2, 0.3]) == [0.1, 0.2, 0.3]


def test_gpu_profile_document_builds_with_measurements_kept(monkeypatch):
    rng = np.random.default_rng(5)
    meas = _synthetic_measurements(lambda m, n, k: 0.75, 0.5 * 989e12, 3.0e12, rng)
    machine = {
        "hostname": "gpu-box",
        "profile_base": "h100-sxm",
        "server_base": "dgx-h100",
        "gpu_memory_bytes": float(H100_BYTES),
        "gpus": 1,
    }
    doc = prof.build_profile("cuda", meas, {}, machine)
    base = load_device("h100-sxm")
    assert doc["device"]["name"] == "h100-sxm-profiled"
    assert doc["device"]["memory_bytes"] == H100_BYTES + base.driver_reserved_bytes  # torch's total + the driver's
    assert doc["measurements"]["gemm"] == meas["gemm"] and doc["measurements"]["attention"] == meas["attention"]
    assert doc["checks"]["peak_agrees"]
    path_doc = json.dumps(doc)
    from berth.hardware_profiles import DeviceProfile

    assert DeviceProfile.model_validate(json.loads(path_doc)["device"]).peak_flops("bf16") == 989e12


def test_gpu_profile_keeps_the_base_models_at_the_measured_level():
    """A profiled GPU keeps what the sweep does not measure (the frameworks' layer work, the
    allocator/driver memory, the shape models' knees) and moves the GEMM and attention asymptotes to
    the level it measured: timings 0.9x the base model's efficiency give 0.9x its asymptotes, each
    attention asymptote by the shapes at its head dim (0.8x at 128, 0.6x at 64)."""
    from berth.cost_models.compute import attention_efficiency, gemm_efficiency

    base = load_device("h100-sxm")
    rng = np.random.default_rng(6)
    meas = _synthetic_measurements(
        lambda m, n, k: 0.9 * float(gemm_efficiency(base, m, n, k)), 1.0, 3.0e12, rng, noise=0.0
    )
    for a in meas["attention"]:
        f, bw = prof.attention_flops(a["batch"], a["heads"], a["seq"], a["head_dim"])
        rows = a["batch"] * a["heads"] * a["seq"]
        fwd, bwd = base.attention_shape.forward, base.attention_shape.backward
        level = 0.8 if a["head_dim"] == 128 else 0.6
        a["forward_s"] = f / (level * 989e12 * float(attention_efficiency(fwd, a["head_dim"], a["seq"], rows)))
        a["backward_s"] = bw / (level * 989e12 * float(attention_efficiency(bwd, a["head_dim"], a["seq"], rows)))
    machine = {
        "hostname": "gpu-box",
        "profile_base": "h100-sxm",
        "server_base": "dgx-h100",
        "gpu_memory_bytes": float(H100_BYTES),
        "gpus": 1,
    }
    dev = DeviceProfile.model_validate(prof.build_profile("cuda", meas, {}, machine)["device"])
    assert dev.gemm_shape.max_fraction == pytest.approx(0.9 * base.gemm_shape.max_fraction, rel=1e-6)
    assert dev.gemm_shape.k_knee == base.gemm_shape.k_knee
    for name in ("forward", "backward"):
        measured, was = getattr(dev.attention_shape, name), getattr(base.attention_shape, name)
        assert measured.max_fraction == pytest.approx(0.8 * was.max_fraction, rel=1e-6)
        assert measured.max_fraction_small_head == pytest.approx(0.6 * was.max_fraction_small_head, rel=1e-6)
    assert "12 at head dim 128, 6 at head dim 64" in dev.sources["attention_shape"]
    older = {**meas, "attention": [a for a in meas["attention"] if a["head_dim"] == 128]}  # a profile before 64
    old_dev = DeviceProfile.model_validate(prof.build_profile("cuda", older, {}, machine)["device"])
    assert old_dev.attention_shape.forward.max_fraction_small_head == pytest.approx(
        0.8 * base.attention_shape.forward.max_fraction_small_head, rel=1e-6
    )  # moved with head dim 128, as every profile did before
    assert "none at 64 (moved with the other)" in old_dev.sources["attention_shape"]
    assert dev.frameworks == base.frameworks and dev.driver_reserved_bytes == base.driver_reserved_bytes
    assert dev.allocator_transient_blocks == base.allocator_transient_blocks
    for name in ("gemm_shape", "attention_shape"):  # the moved models say how they were measured
        assert "measured / modelled" in dev.sources[name]


def test_what_a_gpu_profile_measured_is_not_left_among_its_assumptions():
    """The H200's device file assumes its shape models ("Not measured on this device": the H100's fit, scaled);
    a profile measured on an H200 moved them to what it measured, so it lists them under `sources`, not
    `assumptions` (benchmarks/results/gpu-h200/2026-11-26/profile.json, made before this, still carried the base's
    text; the profile the next H200 run measured, benchmarks/results/gpu-h200/profile.json, does not)."""
    base = load_device("h200")
    assert {"gemm_shape", "attention_shape"} <= set(base.assumptions)
    meas = _synthetic_measurements(lambda m, n, k: 0.7, 0.4 * 989e12, 4.0e12, np.random.default_rng(7))
    machine = {"hostname": "gpu-box", "profile_base": "h200", "server_base": "dgx-h200", "gpus": 1}
    dev = DeviceProfile.model_validate(prof.build_profile("cuda", meas, {}, machine)["device"])
    for name in ("gemm_shape", "attention_shape", "attention_peak_fraction", "memory_bandwidth_fraction"):
        assert name not in dev.assumptions and "berth profile" in dev.sources[name], name
    assert "gemm.min_dim" not in dev.assumptions and "berth profile" in dev.sources["gemm"]
    assert dev.assumptions["allocator_transient_blocks"] == base.assumptions["allocator_transient_blocks"]
    root = Path(__file__).resolve().parents[1] / "benchmarks" / "results" / "gpu-h200"
    measured_there = json.loads((root / "profile.json").read_text())["device"]
    assert not {"gemm_shape", "attention_shape"} & set(measured_there["assumptions"])
    assert {"gemm_shape", "attention_shape"} <= set(measured_there["sources"])


def test_layer_variants_times_every_variant_and_head_gemm_on_cpu(tmp_path):
    """benchmarks/layer_variants.py's GPU timing (--measure, --measure-gemms) run on CPU at tiny shapes (the wall
    clock for CUDA events): a row per variant and micro-batch, per head shape, per head GEMM pass and vocabulary, and
    the scoring reads what it wrote."""
    from benchmarks import layer_variants as lv
    from berth.specs.models import load_model

    base = load_model(str(lv.BASE)).model_copy(
        update={"hidden_size": 64, "num_attention_heads": 1, "ffn_hidden_size": 256, "vocab_size": 1001}
    )
    data = lv.measure(base, seq=16, batches=(1,), head_batches=(1,), device="cpu", reps=1)
    assert [r["variant"] for r in data["layers"]] == list(lv.variants(base))
    assert all(r["fwd_s"] > 0 and r["fwd_bwd_s"] > 0 for r in data["layers"])
    assert [(h["hidden"], h["vocab"]) for h in data["heads"]] == [(64, 1001), (64, 1024), (2048, 1001)]
    gemms = lv.measure_head_gemms(base.model_copy(update={"hidden_size": 32}), tokens=(8,), device="cpu", reps=1)
    assert [g["vocab"] for g in lv.measure_head_gemms(base, (8,), "cpu", 1, [(32, 1002)])] == [1002] * 3
    assert {(g["vocab"], g["gemm"]) for g in gemms} >= {(v, p) for v in (1001, 1008) for p in ("fwd", "dgrad", "wgrad")}
    path = tmp_path / "layer-variants.json"
    path.write_text(json.dumps(data))
    assert lv.main([str(path), "--device", "h100-sxm"]) == 0
    scored = json.loads((tmp_path / "layer-variants-predicted.json").read_text())
    assert len(scored["layers"]) == len(data["layers"]) and all(h["predicted_s"] > 0 for h in scored["heads"])


def test_gpu_profile_measures_the_gemm_alignment_slowdowns(monkeypatch):
    """`berth profile` on a GPU times an LM head's three GEMMs at an aligned, a 4-byte-only and an odd width
    (measure_gemm_alignment; here on CPU at tiny shapes, the logic the GPU runs) and sets the GEMM shape model's two
    slowdowns from them per FLOP (synthetic timings: 3x and 6x); a profile without them keeps the base's."""
    rows = prof.measure_gemm_alignment(torch.device("cpu"), quick=True, tokens=64, hidden=32)
    assert [r["kind"] for r in rows] == ["aligned", "misaligned", "odd"] and all(r["seconds"] > 0 for r in rows)
    assert [r["n"] for r in rows] == list(prof.ALIGNMENT_WIDTHS.values())

    per_flop = {"aligned": 1.0, "misaligned": 3.0, "odd": 6.0}
    timed = [{**r, "m": 16384, "k": 2048, "seconds": per_flop[r["kind"]] * 16384 * r["n"] * 2048e-15} for r in rows]
    rng = np.random.default_rng(5)
    h100 = load_device("h100-sxm")
    meas = _synthetic_measurements(lambda m, n, k: 0.7, 0.55 * 989e12, 2.97e12, rng) | {"gemm_alignment": timed}
    fields, sources, _ = prof.profile_fields(meas, h100, "bf16")
    assert fields["gemm_shape"].misaligned_slowdown == pytest.approx(3.0)
    assert fields["gemm_shape"].odd_slowdown == pytest.approx(6.0)
    assert "32,001" in sources["gemm_shape"]
    meas.pop("gemm_alignment")
    fields, sources, _ = prof.profile_fields(meas, h100, "bf16")
    assert fields["gemm_shape"].odd_slowdown == h100.gemm_shape.odd_slowdown and "not timed" in sources["gemm_shape"]


H200 = Path("benchmarks") / "results" / "gpu-h200"


def test_the_h200_profile_s_alignment_slowdowns_are_its_own_timings():
    """benchmarks/results/gpu-h200/profile-alignment.json, `berth profile` on an H200: the two factors it wrote are
    what alignment_slowdowns makes of the timings it recorded, and both are well above 1 (the GPU's real effect)."""
    saved = json.loads((Path(__file__).resolve().parents[1] / H200 / "profile-alignment.json").read_text())
    got = prof.alignment_slowdowns(saved["measurements"]["gemm_alignment"])
    shape = saved["device"]["gemm_shape"]
    assert got == {"misaligned_slowdown": shape["misaligned_slowdown"], "odd_slowdown": shape["odd_slowdown"]}
    assert 2.0 < got["misaligned_slowdown"] < got["odd_slowdown"] < 8.0
