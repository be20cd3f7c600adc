"""The engine artifacts started by the engines themselves, not string-matched:

- torchtitan: the Trainer built from berth_torchtitan.py in torchtitan's own dry-run mode (--comm.mode
  fake_backend) at the plan's world size (up to 32 ranks here), model made small (layers, heads and layout kept):
  mesh, model, pipeline split, FSDP, optimizer over every trainable parameter, LR schedule, checkpointing;
- Megatron-LM: megatron-launch.sh checked by `bash -n` (always) and shellcheck (when installed), then executed by
  bash with a stand-in torchrun on PATH that records its argv and environment: the argv is the argument file's and
  the environment holds what validate_args needs.
"""

import json
import os
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

from benchmarks import engine_check as ec
from berth.planner.launch import LaunchRefused, artifacts

PLANS = ec.plan_set()


def _files(plan, engine):
    try:
        return artifacts(plan, engine)
    except LaunchRefused:
        return None


@pytest.mark.skipif(ec.available("torchtitan") is not None, reason=str(ec.available("torchtitan")))
def test_torchtitan_trainer_builds_at_the_plans_world_size(tmp_path):
    picked = [(n, ec.small_model_plan(p)) for n, p in PLANS]
    picked = [(n, p, f) for n, p in picked if (f := _files(p, "torchtitan"))]
    # a spread: FSDP only, tp + pp interleaved, tp + cp, uneven stages, full recompute (one subprocess)
    chosen = picked[:: max(1, len(picked) // 6)][:6]
    results = ec.build_torchtitan_trainers([(p, f) for _, p, f in chosen], tmp_path)
    for (name, plan, _), got in zip(chosen, results, strict=True):
        assert "error" not in got, (name, got)
        x, m = plan.layout, plan.model
        shard = x.shard if x.zero_stage else 1
        assert (got["world"], got["tp"], got["pp"], got["cp"], got["dp_shard"], got["dp_replicate"]) == (
            plan.cluster.world_size,
            x.tp,
            x.pp,
            x.cp,
            shard,
            x.dp // shard,
        ), name
        assert got["model_parts"] == (x.virtual_stages if x.pp > 1 else 1), name
        assert got["optimizer_params"] == got["model_params"] > 0, name  # AdamW holds every trainable parameter
        assert (got["lr"], got["steps"], got["warmup"], got["decay"]) == (3e-4, 10_000, 500, "cosine"), name
        assert got["checkpoint"] and got["checkpoint_interval"] == 1000, name
        assert (got["rope_theta"], got["norm_eps"], got["tied"]) == (m.rope_theta, m.norm_eps, m.tied_embeddings)


def _megatron_plans():
    return [(n, p, f) for n, p in PLANS if (f := _files(p, "megatron"))]


STAND_IN = """#!/usr/bin/env python3
import json, os, sys
with open(os.environ["BERTH_RECORD"], "w") as f:
    json.dump({"argv": sys.argv[1:], "env": dict(os.environ)}, f)
"""


@pytest.mark.parametrize("name, plan, files", _megatron_plans(), ids=[n for n, _, _ in _megatron_plans()])
def test_megatron_launch_script_runs_as_written(name, plan, files, tmp_path):
    script = tmp_path / "megatron-launch.sh"
    script.write_text(files["megatron-launch.sh"])
    subprocess.run(["bash", "-n", str(script)], check=True)
    if shutil.which("shellcheck"):
        subprocess.run(["shellcheck", "-S", "warning", str(script)], check=True)
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "torchrun").write_text(STAND_IN)
    (bindir / "torchrun").chmod(0o755)
    record = tmp_path / "record.json"
    env = {
        "PATH": f"{bindir}{os.pathsep}{os.environ['PATH']}",
        "BERTH_RECORD": str(record),
        "MEGATRON_LM": "/opt/Megatron-LM",
        "TOKENIZER_MODEL": "meta-llama/Llama-3.1-8B",
        "DATA_PATH": "/data/tokens_text_document",
        "CUDA_DEVICE_MAX_CONNECTIONS": "8",
    }
    subprocess.run(["bash", str(script)], check=True, env=env, cwd=tmp_path)
    got = json.loads(record.read_text())
    argv = got["argv"]
    i = argv.index("/opt/Megatron-LM/pretrain_gpt.py")
    text = "\n".join(line for line in files["megatron-args.txt"].splitlines() if not line.startswith("#"))
    text = text.replace("${TOKENIZER_MODEL}", env["TOKENIZER_MODEL"]).replace("${DATA_PATH}", env["DATA_PATH"])
    assert argv[i + 1 :] == shlex.split(text.replace("\\\n", " ")), name
    x = plan.layout
    cuda = got["env"].get("CUDA_DEVICE_MAX_CONNECTIONS")
    # validate_args: tp or cp > 1 needs 1 (Megatron FSDP: not 1, so unset); otherwise the caller's is kept
    want = ("1" if x.zero_stage < 2 else None) if x.tp > 1 or x.cp > 1 else "8"
    assert cuda == want, (name, cuda)
    m = plan.model
    args = dict(zip(argv[i + 1 :], argv[i + 2 :], strict=False))
    assert float(args["--rotary-base"]) == m.rope_theta and float(args["--norm-epsilon"]) == m.norm_eps
    assert args["--attention-dropout"] == args["--hidden-dropout"] == "0"
    assert int(args["--train-iters"]) == 10_000 and "--lr" in args and "--split" in args
    padded = int(args["--make-vocab-size-divisible-by"]) * x.tp
    assert m.vocab_size % padded == 0  # Megatron's padded vocabulary is the model's own
