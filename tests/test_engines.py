"""The engine artifacts loaded by the engines' own parsers (benchmarks/engine_check.py has the loaders and says
what stands in for GPU-only pieces). Each parsed value is compared with the plan's.

DeepSpeed and torchtitan come with the `engines` extra (pip install -e '.[engines]'); without it these tests
skip and say so. Megatron-LM runs when BERTH_MEGATRON_DIR names a checkout.
"""

import importlib.util
import json
import os

import pytest

from benchmarks import engine_check as ec
from berth.launch.writers import ENGINE_VERSIONS, LaunchRefused, artifacts
from berth.specs.stages import chunk_layers

PLANS = ec.plan_set()
IDS = [name for name, _ in PLANS]


@pytest.fixture(scope="module", autouse=True)
def _one_process_group_at_most():
    yield
    if importlib.util.find_spec("torch") is not None:  # without torch no check started a group
        ec.release()  # the DeepSpeed check's one-process gloo group ends with this module


def _files(plan, engine):
    try:
        return artifacts(plan, engine)
    except LaunchRefused as e:
        return str(e)


def _common(plan, engine):
    """What every engine must have parsed, from the plan alone."""
    x, t = plan.layout, plan.training
    return {
        "tp": x.tp,
        "dp": x.dp,
        "micro_batch": x.micro_batch_size,
        "global_batch": t.global_batch_size,
        "precision": t.precision,
    }


def _refusal_is_stated(files, engine):
    assert isinstance(files, str) and "cannot express this layout" in files and len(files) > 60, files


@pytest.mark.skipif(ec.available("deepspeed") is not None, reason=str(ec.available("deepspeed")))
@pytest.mark.parametrize("name, plan", PLANS, ids=IDS)
def test_deepspeed_config_parsed_by_deepspeed_equals_the_plan(name, plan):
    files = _files(plan, "deepspeed")
    x = plan.layout
    cannot = (
        x.cp > 1
        or x.sequence_parallel
        or x.recompute == "selective"
        or x.axis_order != "tp-dp-pp"
        or (x.zero_stage and x.shard < x.dp)  # MiCS was removed in 0.19
        or (x.pp > 1 and (x.schedule != "1f1b" or x.zero_stage >= 2 or x.tp > 1))
        or plan.model.num_layers % x.pp
    )  # uneven stages: PipelineModule takes no per-stage counts
    if cannot:
        _refusal_is_stated(files, "deepspeed")
        return
    assert not isinstance(files, str), files
    got = ec.load_deepspeed(plan, files)
    assert got == {
        **_common(plan, "deepspeed"),
        "zero": x.zero_stage,
        "accumulation": x.num_microbatches,
        "world": plan.cluster.world_size,
    }
    launch = files["deepspeed-launch.sh"]
    assert ENGINE_VERSIONS["deepspeed"] in launch and "${TRAIN_SCRIPT:?" in launch
    if x.pp > 1:
        assert f"num_stages={x.pp}" in launch
    if x.recompute == "full" and x.pp > 1:  # the pipeline engine switches it on from the config
        assert json.loads(files["ds_config.json"])["pipeline"] == {"activation_checkpoint_interval": 1}
    elif x.recompute == "full":
        assert "deepspeed.checkpointing.checkpoint" in launch


def test_deepspeed_rejects_what_berth_no_longer_writes():
    """DeepSpeed 0.19's own parser refuses MiCS: the reason the hybrid-shard layouts are refused."""
    if ec.available("deepspeed"):
        pytest.skip(ec.available("deepspeed"))
    from deepspeed.runtime.config import DeepSpeedConfig, DeepSpeedConfigError

    with pytest.raises(DeepSpeedConfigError, match="MiCS"):
        DeepSpeedConfig({"train_batch_size": 8, "zero_optimization": {"stage": 3, "mics_shard_size": 8}})


@pytest.mark.skipif(ec.available("torchtitan") is not None, reason=str(ec.available("torchtitan")))
@pytest.mark.parametrize("name, plan", PLANS, ids=IDS)
def test_torchtitan_config_parsed_by_torchtitan_equals_the_plan(name, plan, tmp_path):
    files = _files(plan, "torchtitan")
    x, t, m = plan.layout, plan.training, plan.model
    if x.zero_stage == 1 or (x.zero_stage == 0 and x.cp > 1):  # no ZeRO-1; FSDP2 over dp_shard x cp, whatever stage
        _refusal_is_stated(files, "torchtitan")
        return
    assert not isinstance(files, str), files
    got = ec.load_torchtitan(plan, files, tmp_path)
    want = {
        **_common(plan, "torchtitan"),
        "cp": x.cp,
        "pp": x.pp,
        "vpp": x.virtual_stages,
        "shard": x.shard if x.zero_stage else 1,
        "zero": x.zero_stage,
        # gradient accumulation without a pipeline: torchtitan accumulates through global_batch_size
        "accumulation": 1 if x.pp > 1 else x.num_microbatches,
        "pipeline_microbatches": x.num_microbatches if x.pp > 1 else 1,
        "schedule": {"1f1b": "Schedule1F1B", "gpipe": "ScheduleGPipe", "interleaved_1f1b": "ScheduleInterleaved1F1B"}[
            x.schedule
        ]
        if x.pp > 1
        else None,
        # the embedding and the output ride with the first and last stage; decoder layers per stage as
        # berth's split rule gives them (equal when pp x vpp divides the layers)
        "layers_per_stage": chunk_layers(m.num_layers, x.pp, x.virtual_stages) if x.pp > 1 else [],
        "recompute": x.recompute,
        "sp": x.sequence_parallel,
        "seq_len": t.seq_len,
        "world": plan.cluster.world_size,
        "num_layers": m.num_layers,
        "hidden": m.hidden_size,
        "vocab": m.vocab_size,
    }
    assert got == want


@pytest.mark.skipif(ec.available("torchtitan") is not None, reason=str(ec.available("torchtitan")))
def test_torchtitan_config_names_what_is_missing(tmp_path, monkeypatch):
    """An unset placeholder stops torchtitan's loader with its description, not a default."""
    ec._torchtitan_importable()
    from torchtitan.config import ConfigManager

    name, plan = PLANS[0]
    (tmp_path / "berth_torchtitan.py").write_text(artifacts(plan, "torchtitan")["berth_torchtitan.py"])
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delenv("BERTH_HF_ASSETS", raising=False)
    monkeypatch.delitem(__import__("sys").modules, "berth_torchtitan", raising=False)
    with pytest.raises(SystemExit, match="BERTH_HF_ASSETS to the directory with the Hugging Face tokenizer"):
        ConfigManager().parse_args(["--module", "berth_torchtitan", "--config", "berth_plan"])


def _megatron_skip():
    return ec.available("megatron")


@pytest.mark.skipif(_megatron_skip() is not None, reason=str(_megatron_skip()))
def test_megatron_arguments_pass_megatrons_parse_args_and_validate_args():
    jobs, plans = [], []
    for name, plan in PLANS:
        files = _files(plan, "megatron")
        x = plan.layout
        if x.zero_stage >= 2 and x.shard < x.dp:
            _refusal_is_stated(files, "megatron")
            continue
        assert not isinstance(files, str), (name, files)
        jobs.append(ec.megatron_job(plan, files))
        plans.append((name, plan))
    result = ec.run_megatron(jobs, os.environ["BERTH_MEGATRON_DIR"])
    if isinstance(result, str):
        pytest.skip(f"Megatron-LM at BERTH_MEGATRON_DIR cannot be imported here: {result}")
    for (name, plan), args in zip(plans, result, strict=True):
        assert "error" not in args, (name, args)
        x, t, m = plan.layout, plan.training, plan.model
        fsdp = x.zero_stage >= 2
        assert ec.megatron_values(args) == {
            **_common(plan, "megatron"),
            "cp": x.cp,
            "pp": x.pp,
            "vpp": x.virtual_stages,
            "zero": x.zero_stage,
            "shard": x.shard if x.zero_stage == 1 else (x.dp if fsdp else 1),
            "accumulation": x.num_microbatches,
            "recompute": x.recompute,
            "sp": x.sequence_parallel,
            "seq_len": t.seq_len,
            "num_layers": m.num_layers,
            "hidden": m.hidden_size,
            "ffn": m.ffn_hidden_size,
            "heads": m.num_attention_heads,
            "kv_heads": m.kv_heads,
            "rope": True,
            "bias": False,
            "swiglu": m.mlp == "swiglu",
            "norm": "RMSNorm" if m.norm == "rmsnorm" else "LayerNorm",
            "untied": not m.tied_embeddings,
            "tp_pp_dp": x.axis_order == "tp-pp-dp",
            **_moe_expected(plan),
        }, name


def _moe_expected(plan):
    """The mixture-of-experts arguments Megatron must have parsed, from the plan (none for a dense model)."""
    x, m = plan.layout, plan.model
    if not m.is_moe:
        return {}
    return {
        "experts": m.num_experts,
        "topk": m.experts_per_token,
        "expert_ffn": m.expert_ffn,
        "shared_ffn": m.num_shared_experts * m.shared_ffn,
        # every layer an MoE layer (Megatron's default 1), or the dense first layers as a 0/1 list
        "moe_layer_freq": str([0] * m.first_k_dense + [1] * m.num_moe_layers) if m.first_k_dense else 1,
        "ep": x.ep,
        "etp": x.etp,
        "dispatcher": "alltoall",
    }
