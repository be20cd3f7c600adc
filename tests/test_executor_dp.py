"""Every data-parallel layout is real: 2 gloo processes under torchrun reproduce the
single-process losses of the same seed (fp32 on CPU; tolerance 1e-5 relative, where reordered
floating-point sums differ by ~1e-7)."""

import json
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")

from executor.train import run_steps  # noqa: E402
from planner import __version__  # noqa: E402
from planner.models import presets  # noqa: E402
from planner.specs import Layout, Plan, TrainingSpec  # noqa: E402
from planner.topology import cluster_from_preset  # noqa: E402

STEPS = 3
MODEL = presets()["tiny-gpt"]
TRAINING = TrainingSpec(seq_len=64, global_batch_size=8, precision="fp32")
LAYOUTS = [
    Layout(dp=2, micro_batch_size=2, num_microbatches=2),
    Layout(dp=2, zero_stage=1, shard=2, micro_batch_size=4, num_microbatches=1),
    Layout(dp=2, zero_stage=2, shard=2, micro_batch_size=2, num_microbatches=2, recompute="selective"),
    Layout(dp=2, zero_stage=3, shard=2, micro_batch_size=1, num_microbatches=4, recompute="full"),
]


HYBRID = [  # 4 processes on 2 cores: oversubscribed, functional only
    Layout(dp=4, zero_stage=3, shard=2, micro_batch_size=1, num_microbatches=2),
    Layout(dp=4, zero_stage=2, shard=2, micro_batch_size=2, num_microbatches=1),
]


def launch(tmp_path, layouts, nproc):
    cluster = cluster_from_preset("dgx-a100-80g", 1)
    plans = [Plan(berth_version=__version__, model=MODEL, training=TRAINING, cluster=cluster, layout=x,
                  prediction=None).model_dump(mode="json") for x in layouts]
    (tmp_path / "plans.json").write_text(json.dumps(plans))
    out = tmp_path / "out.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "-m", "executor.worker", "--plans", str(tmp_path / "plans.json"), "--steps", str(STEPS),
           "--out", str(out)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert out.is_file(), r.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def reference():
    losses = run_steps(MODEL, TRAINING, Layout(micro_batch_size=8), STEPS).losses
    assert losses[-1] < losses[0]
    return losses


def test_hybrid_sharding_on_a_2d_mesh_matches_single_process(tmp_path, reference):
    for res in launch(tmp_path, HYBRID, 4):
        assert res["losses"] == pytest.approx(reference, rel=1e-5), res["layout"]


def test_dp_layouts_match_single_process(tmp_path, reference):
    for res in launch(tmp_path, LAYOUTS, 2):
        assert res["losses"] == pytest.approx(reference, rel=1e-5), res["layout"]
        assert all(t > 0 for t in res["step_times_s"])
