"""The engine artifacts started by the engines themselves, not string-matched (benchmarks/engine_check.py has the
runners and names each stand-in for a GPU-only piece):

- torchtitan 0.3.0: the Trainer built from berth_torchtitan.py in torchtitan's own dry-run mode (--comm.mode
  fake_backend) at the plan's world size (8 to 32 ranks), the model made small (layers, heads and layout kept):
  mesh, model, pipeline split, FSDP, AdamW over every trainable parameter, LR schedule, checkpointing, rope, norm;
- Megatron-LM: megatron-launch.sh checked by `bash -n` (always) and shellcheck (where installed), executed by bash
  with a stand-in torchrun on PATH that records argv and environment; the recorded argv then goes through
  megatron-core's own config classes, process groups (fake backend, the plan's world size), microbatch calculator,
  LR scheduler and rotary embedding (CI has no Megatron-LM checkout; tests/test_engines.py runs Megatron-LM's
  parse_args / validate_args where BERTH_MEGATRON_DIR names one);
- DeepSpeed 0.19.8: deepspeed-launch.sh executed with a stand-in deepspeed launcher, its argv and hostfile read by
  DeepSpeed's own launcher (runner.parse_args, fetch_hostfile, the node and GPU filters); and the engine initialised
  from ds_config.json on 2 CPU processes over gloo (ZeRO-1, ZeRO-3, a 2-stage pipeline with recompute), one step each;
- nanotron e24d2483: nanotron.yaml read by nanotron's own get_config_from_file (its source at that commit,
  tests/vendor/nanotron_e24d2483: dataclasses, dacite, __post_init__ checks), and nanotron-launch.sh run with a
  stand-in torchrun. nanotron's ParallelContext takes NCCL only, so its trainer cannot start on CPU.
"""

import importlib.util
import json
import math
import os
import shlex
import shutil
import subprocess
import sys

import pytest
import yaml

from benchmarks import engine_check as ec
from berth.launch.writers import ENGINE_VERSIONS, LaunchRefused, artifacts
from berth.planner.planning import compare
from berth.planner.search import predict_layouts
from berth.specs.models import load_model
from berth.specs.tree import Layout, TrainingSpec
from berth.topology.clusters import cluster_from_preset

PLANS = ec.plan_set()
SCRIPTS = {
    "megatron": "megatron-launch.sh",
    "deepspeed": "deepspeed-launch.sh",
    "torchtitan": "torchtitan-launch.sh",
    "nanotron": "nanotron-launch.sh",
}
USER_INPUTS = {
    "MEGATRON_LM": "/opt/Megatron-LM",
    "TOKENIZER_MODEL": "meta-llama/Llama-3.1-8B",
    "DATA_PATH": "/data/tokens_text_document",
    "TRAIN_SCRIPT": "train.py",
    "BERTH_HF_ASSETS": "/assets",
    "BERTH_DATASET": "c4",
    "NANOTRON_DIR": "/opt/nanotron",
}
STAND_IN = """#!/usr/bin/env python3
import json, os, sys
with open(os.environ["BERTH_RECORD"], "w") as f:
    json.dump({"argv": sys.argv[1:], "env": dict(os.environ)}, f)
"""


def _files(plan, engine):
    try:
        return artifacts(plan, engine)
    except LaunchRefused:
        return None


def _launched(plans, engine):
    return [(n, p, f) for n, p in plans if (f := _files(p, engine))]


def _run_script(files, engine, launcher, tmp_path, env=None):
    """The engine's launch script written beside its files and run by bash, `launcher` a stand-in on PATH that
    records its argv and environment; what it recorded."""
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    bindir = tmp_path / "bin"
    bindir.mkdir(exist_ok=True)
    (bindir / launcher).write_text(STAND_IN)
    (bindir / launcher).chmod(0o755)
    record = tmp_path / "record.json"
    full = {"PATH": f"{bindir}{os.pathsep}{os.environ['PATH']}", "BERTH_RECORD": str(record), **USER_INPUTS}
    subprocess.run(["bash", SCRIPTS[engine]], check=True, env={**full, **(env or {})}, cwd=tmp_path, timeout=60)
    return json.loads(record.read_text())


@pytest.mark.parametrize("engine", SCRIPTS)
def test_every_launch_script_passes_bash_n_and_shellcheck(engine, tmp_path):
    scripts = [f[SCRIPTS[engine]] for _, _, f in _launched(PLANS, engine)]
    assert scripts
    for i, text in enumerate(scripts):
        (tmp_path / f"{i}.sh").write_text(text)
        subprocess.run(["bash", "-n", str(tmp_path / f"{i}.sh")], check=True)
    if shutil.which("shellcheck") is None:
        pytest.skip("shellcheck is not installed (apt-get install shellcheck); bash -n passed")
    subprocess.run(["shellcheck", "-S", "style", *(str(tmp_path / f"{i}.sh") for i in range(len(scripts)))], check=True)


MEGATRON = _launched(PLANS, "megatron")


@pytest.mark.parametrize("name, plan, files", MEGATRON, ids=[n for n, _, _ in MEGATRON])
def test_megatron_launch_script_runs_as_written(name, plan, files, tmp_path):
    got = _run_script(files, "megatron", "torchrun", tmp_path, env={"CUDA_DEVICE_MAX_CONNECTIONS": "8"})
    argv = got["argv"]
    i = argv.index("/opt/Megatron-LM/pretrain_gpt.py")
    assert argv[i + 1 :] == ec.megatron_job(plan, files)["argv"], name  # the argument file is what runs
    x = plan.layout
    # validate_args: tp or cp > 1 needs 1 (Megatron FSDP: anything but 1, so unset); otherwise the caller's is kept
    want = ("1" if x.zero_stage < 2 else None) if x.tp > 1 or x.cp > 1 else "8"
    assert got["env"].get("CUDA_DEVICE_MAX_CONNECTIONS") == want, name


@pytest.mark.skipif(ec.available("megatron-core") is not None, reason=str(ec.available("megatron-core")))
def test_megatron_arguments_pass_megatron_cores_own_checks(tmp_path):
    jobs = []
    for k, (_, plan, files) in enumerate(MEGATRON):
        (tmp_path / str(k)).mkdir()
        argv = _run_script(files, "megatron", "torchrun", tmp_path / str(k))["argv"]
        jobs.append(
            {"argv": argv[argv.index("/opt/Megatron-LM/pretrain_gpt.py") + 1 :], "world": plan.cluster.world_size}
        )
    got = ec.check_megatron_core(jobs)
    assert got["version"] == ec.MEGATRON_CORE_VERSION
    for (name, plan, _), r in zip(MEGATRON, got["results"], strict=True):
        assert "error" not in r, (name, r)
        x, m, t = plan.layout, plan.model, plan.training
        assert (r["tp"], r["pp"], r["vpp"], r["cp"], r["dp"], r["sp"]) == (
            x.tp,
            x.pp,
            x.virtual_stages,
            x.cp,
            x.dp,
            x.sequence_parallel and x.tp > 1,
        ), name
        assert r["microbatches"] == x.num_microbatches and r["distributed_optimizer"] == (x.zero_stage > 0), name
        # the data-parallel overlap the Megatron entry prices, in megatron-core's DistributedDataParallelConfig
        dp_overlap = x.dp > 1 and x.zero_stage < 2
        assert r["overlap"] == [dp_overlap, dp_overlap and x.zero_stage == 1], name
        assert (r["num_layers"], r["hidden"], r["heads"], r["kv_heads"], r["ffn"]) == (
            m.num_layers,
            m.hidden_size,
            m.num_attention_heads,
            m.kv_heads,
            m.ffn_hidden_size,
        ), name
        assert (r["norm_eps"], r["swiglu"], r["bias"], r["qkv_bias"]) == (
            m.norm_eps,
            m.mlp == "swiglu",
            False,
            m.qkv_bias,
        )
        assert r["dropout"] == [0.0, 0.0] and r["recompute"] == x.recompute, name
        if m.is_moe:
            assert (r["experts"], r["ep"], r["etp"]) == (m.num_experts, x.ep, x.etp), name
        # the LR schedule as Megatron's scheduler runs it: the peak after warmup, min_lr at the end
        assert math.isclose(r["lr_after_warmup"], 3e-4) and math.isclose(r["lr_at_end"], 3e-5), name
        # the rotary frequencies Megatron builds: base theta, head dimension d -> inv_freq[1] = theta^(-2/d)
        d = m.hidden_size // m.num_attention_heads
        assert math.isclose(r["inv_freq"][0], m.rope_theta ** (-2 / d), rel_tol=1e-5), name
        assert t.seq_len > 0


def test_megatron_rope_scaling_and_qkv_bias_reach_megatron_core(tmp_path):
    """Llama 3.1's rope scaling and Qwen2.5's base, epsilon and qkv biases, through megatron-core."""
    if ec.available("megatron-core"):
        pytest.skip(ec.available("megatron-core"))
    # Llama 3.1's rope (its head dimension 128 kept, the model made small) and Qwen2.5 7B, on one node
    llama = load_model("llama3.1-405b").model_copy(
        update={
            "num_layers": 4,
            "hidden_size": 1024,
            "num_attention_heads": 8,
            "num_kv_heads": 8,
            "ffn_hidden_size": 2048,
        }
    )
    cases = [
        (llama, Layout(tp=8, micro_batch_size=1, num_microbatches=8, sequence_parallel=True)),
        (load_model("qwen2.5-7b"), Layout(tp=4, dp=2, micro_batch_size=1, num_microbatches=4, sequence_parallel=True)),
    ]
    jobs = []
    for k, (model, layout) in enumerate(cases):
        training = TrainingSpec(seq_len=4096, global_batch_size=8, framework="megatron")
        (plan,) = predict_layouts(model, training, cluster_from_preset("dgx-h100", 1), [layout])
        (tmp_path / str(k)).mkdir()
        argv = _run_script(artifacts(plan, "megatron"), "megatron", "torchrun", tmp_path / str(k))["argv"]
        jobs.append({"argv": argv[argv.index("/opt/Megatron-LM/pretrain_gpt.py") + 1 :], "world": 8})
    (llama, qwen) = ec.check_megatron_core(jobs)["results"]
    assert "error" not in llama and "error" not in qwen, (llama, qwen)
    d = 16384 // 128
    plain = 500000.0 ** (-2 * (d // 2 - 1) / d)  # the lowest frequency, scaled down by the factor 8 in Llama 3.1
    assert math.isclose(llama["inv_freq"][1], plain / 8, rel_tol=1e-5)
    assert (qwen["norm_eps"], qwen["qkv_bias"]) == (1e-6, True)
    assert math.isclose(qwen["inv_freq"][0], 1e6 ** (-2 / (3584 // 28)), rel_tol=1e-5)


DEEPSPEED = _launched(PLANS, "deepspeed")


@pytest.mark.skipif(ec.available("deepspeed") is not None, reason=str(ec.available("deepspeed")))
@pytest.mark.parametrize("name, plan, files", DEEPSPEED, ids=[n for n, _, _ in DEEPSPEED])
def test_deepspeed_launch_and_hostfile_read_by_deepspeeds_launcher(name, plan, files, tmp_path):
    from deepspeed.launcher import runner

    got = _run_script(files, "deepspeed", "deepspeed", tmp_path)
    args = runner.parse_args(got["argv"])
    c, x = plan.cluster, plan.layout
    nodes, per_node = max(1, x.world_size // c.gpus_per_node), min(x.world_size, c.gpus_per_node)
    assert (args.num_nodes, args.num_gpus, args.user_script) == (nodes, per_node, "train.py")
    assert args.user_args[-2:] == ["--deepspeed_config", "ds_config.json"]
    if nodes == 1:
        assert "hostfile" not in files
        return
    pool = runner.fetch_hostfile(str(tmp_path / args.hostfile))
    active = runner.apply_num_nodes_and_gpus(
        runner.parse_inclusion_exclusion(pool, args.include, args.exclude), args.num_nodes, args.num_gpus
    )
    assert len(active) == nodes and all(len(slots) == per_node for slots in active.values()), active


def _small_plans():
    cluster = cluster_from_preset("local-cpu", 1)
    layouts = [
        Layout(dp=2, zero_stage=1, shard=2, micro_batch_size=1, num_microbatches=2),
        Layout(dp=2, zero_stage=3, shard=2, micro_batch_size=2),
        Layout(pp=2, micro_batch_size=1, num_microbatches=4, recompute="full"),  # last: it sets DeepSpeed's mpu
    ]
    model = load_model("tiny-gpt")
    # bf16 ZeRO-1 first: its config asks fp32 accumulation, which takes DeepSpeed's BF16_Optimizer
    bf16 = TrainingSpec(seq_len=64, global_batch_size=4, precision="bf16")
    return predict_layouts(model, bf16, cluster, layouts[:1]) + predict_layouts(
        model, TrainingSpec(seq_len=64, global_batch_size=4), cluster, layouts
    )


@pytest.mark.skipif(ec.available("deepspeed") is not None, reason=str(ec.available("deepspeed")))
def test_deepspeed_engine_initialises_and_steps_from_the_config_as_written(tmp_path):
    plans = _small_plans()
    jobs = []
    for p in plans:
        m = p.model
        config = json.loads(artifacts(p, "deepspeed")["ds_config.json"])
        model = {"layers": m.num_layers, "hidden": m.hidden_size, "vocab": m.vocab_size}
        jobs.append({"config": config, "pp": p.layout.pp, "model": model, "seq_len": p.training.seq_len})
    results = ec.initialise_deepspeed(2, jobs, tmp_path)
    for p, r in zip(plans, results, strict=True):
        x = p.layout
        assert (r["world"], r["dp"], r["zero"], r["accumulation"], r["micro_batch"], r["global_batch"]) == (
            2,
            x.dp,
            x.zero_stage,
            x.num_microbatches,
            x.micro_batch_size,
            p.training.global_batch_size,
        ), x.short()
        assert r["steps"] == 1 and math.isfinite(r["loss"]) and r["bf16"] == (p.training.precision == "bf16")
        assert (r["optimizer"], r["scheduler"]) == ("AdamW", "WarmupCosineLR")
        # recompute switched on by the config's pipeline section (PipelineModule built without it)
        assert r["activation_checkpoint_interval"] == (1 if x.pp > 1 and x.recompute == "full" else None)


@pytest.mark.skipif(ec.available("torchtitan") is not None, reason=str(ec.available("torchtitan")))
def test_torchtitan_trainer_builds_at_the_plans_world_size(tmp_path):
    from berth.launch.writers import EngineTraining

    picked_all = [(n, ec.small_model_plan(p)) for n, p in PLANS]
    picked = _launched(picked_all, "torchtitan")
    # a spread (one subprocess): FSDP, tp + pp interleaved, tp + cp, uneven stages, recompute
    chosen = picked[:: max(1, len(picked) // 6)][:6]
    # and Llama 3.1 405B at 2,048 ranks: 126 layers in 16 uneven chunks, its rope scaling, tp 8 x pp 8 x FSDP 32
    big = Layout(
        tp=8,
        pp=8,
        dp=32,
        zero_stage=3,
        shard=32,
        micro_batch_size=1,
        num_microbatches=16,
        schedule="interleaved_1f1b",
        virtual_stages=2,
        sequence_parallel=True,
        recompute="full",
    )
    training = TrainingSpec(seq_len=8192, global_batch_size=512)
    (plan,) = predict_layouts(load_model("llama3.1-405b"), training, cluster_from_preset("dgx-h100", 256), [big])
    plan = ec.small_model_plan(plan)
    chosen.append(("llama3.1-405b-256n", plan, artifacts(plan, "torchtitan")))
    results = ec.build_torchtitan_trainers([(p, f) for _, p, f in chosen], tmp_path)
    # context parallelism with ZeRO-3 (torchtitan shards over dp_shard x cp; ZeRO-0 with cp is refused), written with
    # grad_clip 0: no clipping, max_norm inf (0 would zero every gradient). A process of its own: built in one with
    # the others, the fake process groups one trainer's context parallelism registers are gone for the next
    cp = next(p for n, p in picked_all if p.layout.cp > 1 and p.layout.zero_stage == 3)
    chosen.append(("cp-zero3-no-clip", cp, artifacts(cp, "torchtitan", training=EngineTraining(grad_clip=0))))
    results += ec.build_torchtitan_trainers([chosen[-1][1:]], tmp_path / "cp")
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
        assert got["max_norm"] == (math.inf if name == "cp-zero3-no-clip" else 1.0), name
        assert got["checkpoint"] and got["checkpoint_interval"] == 1000, name
        assert (got["rope_theta"], got["norm_eps"], got["tied"]) == (m.rope_theta, m.norm_eps, m.tied_embeddings)
        assert got["rope_scaling"] == ("llama" if m.rope_scaling else "none"), name


def test_every_refusal_names_the_engine_its_version_and_the_reason():
    for name, plan in PLANS:
        for engine in SCRIPTS:
            try:
                artifacts(plan, engine)
            except LaunchRefused as e:
                assert f"{ENGINE_VERSIONS[engine]} cannot run it: " in str(e) and len(str(e)) > 80, (name, str(e))


def test_megatron_values_reaching_the_shell_are_quoted():
    """An uneven interleaved split writes --pipeline-model-parallel-layout, whose | and parentheses bash would
    read as a pipe and a subshell unquoted (the script was a syntax error)."""
    (name, plan, files) = next(t for t in MEGATRON if "--pipeline-model-parallel-layout" in t[2]["megatron-args.txt"])
    words = ec.megatron_job(plan, files)["argv"]
    layout = words[words.index("--pipeline-model-parallel-layout") + 1]
    assert "|" in layout and shlex.quote(layout) in files["megatron-launch.sh"], name


@pytest.mark.skipif(ec.available("deepspeed") is not None, reason=str(ec.available("deepspeed")))
def test_deepspeed_experts_refused_exactly_where_autoep_refuses():
    """Mixtral layouts: what berth writes passes DeepSpeed's own AutoEP validation (expert_parallel section), and a
    layout berth refuses (expert_tp 2) is one DeepSpeed's validator rejects too."""
    from deepspeed.module_inject.auto_ep_config import parse_autoep_config, validate_autoep_config
    from deepspeed.runtime.config import get_expert_parallel_config

    cluster = cluster_from_preset("dgx-h100", 2)
    training = TrainingSpec(seq_len=4096, global_batch_size=64)
    layouts = [
        Layout(dp=16, ep=4, zero_stage=3, shard=16, micro_batch_size=1, num_microbatches=4, recompute="full"),
        Layout(dp=16, ep=8, zero_stage=3, shard=16, micro_batch_size=1, num_microbatches=4, recompute="full"),
        Layout(tp=2, dp=8, ep=4, expert_tp=2, zero_stage=3, shard=8, micro_batch_size=1, num_microbatches=8),
    ]
    for plan in predict_layouts(load_model("mixtral-8x7b"), training, cluster, layouts):
        x = plan.layout
        section = {"enabled": True, "autoep_size": x.ep, "expert_tensor_parallel_size": x.etp}
        try:
            config = json.loads(artifacts(plan, "deepspeed")["ds_config.json"])
        except LaunchRefused as e:
            assert "DeepSpeed 0.19.8 cannot run it: expert_tp" in str(e)
            with pytest.raises(ValueError, match="expert_tensor_parallel_size"):
                validate_autoep_config(
                    parse_autoep_config(section), x.world_size, x.pp, x.tp, 1, zero_stage=x.zero_stage
                )
            continue
        assert config["expert_parallel"] == section
        parsed = get_expert_parallel_config(config)  # DeepSpeedConfig's reader of the section
        validate_autoep_config(parsed, x.world_size, x.pp, x.tp, 1, zero_stage=x.zero_stage)
        assert (parsed.enabled, parsed.autoep_size) == (True, x.ep)


def test_training_run_options_reach_every_engine_and_bad_values_name_the_field():
    from berth.launch.writers import EngineTraining
    from berth.specs.errors import BerthError

    run = EngineTraining(train_steps=2000, lr=1e-4, min_lr=1e-5, warmup_steps=100, checkpoint_interval=250)
    plan = next(p for _, p in PLANS if all(_files(p, e) for e in ("torchtitan", "deepspeed", "megatron", "nanotron")))
    words = ec.megatron_job(plan, artifacts(plan, "megatron", training=run))["argv"]
    args = dict(zip(words, words[1:], strict=False))
    assert (args["--train-iters"], args["--lr"], args["--lr-warmup-iters"], args["--save-interval"]) == (
        "2000",
        "0.0001",
        "100",
        "250",
    )
    ds = json.loads(artifacts(plan, "deepspeed", training=run)["ds_config.json"])
    assert ds["scheduler"]["params"]["total_num_steps"] == 2000 and ds["optimizer"]["params"]["lr"] == 1e-4
    module = artifacts(plan, "torchtitan", training=run)["berth_torchtitan.py"]
    assert "steps=2000" in module and "interval=250" in module and "'lr': 0.0001" in module
    nt = yaml.safe_load(artifacts(plan, "nanotron", training=run)["nanotron.yaml"])
    schedule = nt["optimizer"]["learning_rate_scheduler"]
    assert (nt["tokens"]["train_steps"], nt["checkpoints"]["checkpoint_interval"]) == (2000, 250)
    assert (schedule["learning_rate"], schedule["min_decay_lr"], schedule["lr_warmup_steps"]) == (1e-4, 1e-5, 100)
    for bad, field in (
        (dict(warmup_steps=20_000), "training.warmup_steps"),
        (dict(checkpoint_dir="../x; rm -rf /"), "training.checkpoint_dir"),
        (dict(decay="step"), "training.decay"),
        (dict(min_lr=1.0), "training.min_lr"),
    ):
        with pytest.raises(BerthError, match=field):
            EngineTraining(**bad)


# --- nanotron -----------------------------------------------------------------------------------------------------

NANOTRON_SOURCE = os.path.join(os.path.dirname(__file__), "vendor", "nanotron_e24d2483")
NANOTRON_READER = r"""
import json, sys
from nanotron.config import Config, get_config_from_file
out = []
for path in sys.argv[1:]:
    c = get_config_from_file(path, config_class=Config)
    c.save_as_yaml(path + ".saved")  # what the trainer writes beside its checkpoints, read back by nanotron itself
    p, k, m, o = c.parallelism, c.tokens, c.model.model_config, c.optimizer
    out.append({
        "model_config": type(m).__name__, "dp": p.dp, "pp": p.pp, "tp": p.tp,
        "pp_engine": type(p.pp_engine).__name__, "tp_mode": p.tp_mode.name,
        "async": p.tp_linear_async_communication, "recompute_layer": p.recompute_layer,
        "mbs": k.micro_batch_size, "accumulation": k.batch_accumulation_per_replica, "seq": k.sequence_length,
        "global_batch": c.global_batch_size, "dtype": str(c.model.dtype), "zero": o.zero_stage,
        "fp32_accumulation": o.accumulate_grad_in_fp32, "lr": o.learning_rate_scheduler.learning_rate,
        "decay_steps": o.learning_rate_scheduler.lr_decay_steps, "steps": k.train_steps,
        "shape": [m.num_hidden_layers, m.hidden_size, m.num_attention_heads, m.num_key_value_heads,
                  m.intermediate_size, m.vocab_size, m.max_position_embeddings],
        "tied": m.tie_word_embeddings, "rope_theta": m.rope_theta, "eps": m.rms_norm_eps,
        "dataset": [s.data.dataset for s in c.data_stages],
    })
print(json.dumps(out))
"""


def _nanotron_plans():
    out = []
    for model, engine_layouts in (
        ("llama3-8b", ["tp=2,pp=2,dp=4,zero=1,shard=4,mbs=2,sp=1", "tp=8,dp=2,mbs=1", "pp=4,dp=4,mbs=1"]),
        ("llama3-70b", ["tp=8,pp=4,mbs=1,sp=1"]),
    ):
        for fix in engine_layouts:
            training = TrainingSpec(seq_len=4096, global_batch_size=64, engine="nanotron")
            cluster = cluster_from_preset("aws-p5", 2 if model == "llama3-8b" else 4)
            (p,) = compare(load_model(model), training, cluster, [fix])
            out.append((f"{model}-{fix}", p))
    (p,) = predict_layouts(
        load_model("llama3-8b"),
        TrainingSpec(seq_len=2048, global_batch_size=32, engine="nanotron"),
        cluster_from_preset("aws-p5", 1),
        [Layout(pp=4, dp=2, micro_batch_size=1, num_microbatches=16, schedule="gpipe", recompute="full")],
    )
    return [*out, ("llama3-8b-gpipe-full", p)]


@pytest.mark.skipif(importlib.util.find_spec("dacite") is None, reason="dacite is not installed (the engines extra)")
def test_nanotron_reads_the_config_berth_writes_with_its_own_parser(tmp_path):
    plans = _nanotron_plans()
    paths = []
    for i, (_, plan) in enumerate(plans):
        (tmp_path / f"{i}.yaml").write_text(artifacts(plan, "nanotron")["nanotron.yaml"])
        paths.append(str(tmp_path / f"{i}.yaml"))
    env = {**os.environ, "PYTHONPATH": NANOTRON_SOURCE}
    proc = subprocess.run(
        [sys.executable, "-c", NANOTRON_READER, *paths], env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    for (name, plan), got in zip(plans, json.loads(proc.stdout), strict=True):
        x, t, m = plan.layout, plan.training, plan.model
        assert got["model_config"] == "LlamaConfig", name  # trainer.py CONFIG_TO_MODEL_CLASS's key
        assert (got["dp"], got["pp"], got["tp"]) == (x.dp, x.pp, x.tp), name
        assert got["dp"] * got["pp"] * got["tp"] == plan.cluster.world_size, name  # parallel/context.py's check
        engine = "AllForwardAllBackward" if x.schedule == "gpipe" else "OneForwardOneBackward"
        assert got["pp_engine"] == f"{engine}PipelineEngine", name
        sp = bool(x.sequence_parallel and x.tp > 1)
        assert (got["tp_mode"], got["async"]) == (("REDUCE_SCATTER", True) if sp else ("ALL_REDUCE", False)), name
        assert got["recompute_layer"] == (x.recompute == "full"), name
        assert (got["mbs"], got["accumulation"]) == (x.micro_batch_size, x.num_microbatches), name
        assert got["global_batch"] == t.global_batch_size, name  # Config.global_batch_size: mbs x accumulation x dp
        assert got["seq"] == t.seq_len == got["shape"][-1], name  # trainer.py asserts them equal for a new model
        kv = m.num_kv_heads or m.num_attention_heads
        shape = [m.num_layers, m.hidden_size, m.num_attention_heads, kv, m.ffn_hidden_size, m.vocab_size]
        assert got["shape"][:-1] == shape, name
        assert (got["tied"], got["rope_theta"], got["eps"]) == (m.tied_embeddings, m.rope_theta, m.norm_eps), name
        assert (got["dtype"], got["zero"], got["fp32_accumulation"]) == ("torch.bfloat16", x.zero_stage, True), name
        assert (got["lr"], got["steps"], got["decay_steps"]) == (3e-4, 10_000, 10_000 - 500), name
        assert got["dataset"] == [None], name  # run_train.py's dummy_infinite_data_generator: a trial run


def test_nanotron_launch_script_runs_as_written_and_stops_without_its_checkout(tmp_path):
    name, plan = _nanotron_plans()[3]  # the 70B on 4 nodes
    files = artifacts(plan, "nanotron")
    got = _run_script(files, "nanotron", "torchrun", tmp_path)
    argv = got["argv"]
    assert argv[-3:] == ["/opt/nanotron/run_train.py", "--config-file", "nanotron.yaml"], argv
    assert "--nnodes=4" in argv and "--nproc-per-node=8" in argv, argv
    assert got["env"]["CUDA_DEVICE_MAX_CONNECTIONS"] == "1"  # parallel/utils.py asserts it with async tp linears
    env = {k: v for k, v in os.environ.items() if k != "NANOTRON_DIR"}
    proc = subprocess.run(["bash", "nanotron-launch.sh"], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert proc.returncode != 0 and "NANOTRON_DIR" in proc.stderr and "e24d2483" in proc.stderr


def test_nanotron_refuses_what_its_trainer_cannot_build():
    cluster = cluster_from_preset("aws-p5", 1)
    training = TrainingSpec(seq_len=2048, global_batch_size=32, engine="megatron")  # planned for another engine
    cases = [
        ("tiny-gpt", Layout(tp=2, dp=4, micro_batch_size=1, num_microbatches=8), "LlamaForTraining"),
        ("qwen2.5-7b", Layout(tp=4, dp=2, micro_batch_size=1, num_microbatches=16), "qkv bias True"),
        ("llama3-8b", Layout(tp=2, pp=4, micro_batch_size=16, num_microbatches=2, recompute="full"), "pp - 1"),
        ("llama3-8b", Layout(tp=8, micro_batch_size=1, num_microbatches=32, recompute="selective"), "whole decoder"),
    ]
    for model, layout, words in cases:
        (p,) = predict_layouts(load_model(model), training, cluster, [layout])
        with pytest.raises(LaunchRefused, match=words):
            artifacts(p, "nanotron")


NANOTRON_LOGGER = r"""
import logging, os, sys, tempfile
import torch.distributed as torch_dist
from nanotron.logging import LoggerWriter, LogItem, get_logger
torch_dist.init_process_group("gloo", init_method="file://" + tempfile.mktemp(), rank=0, world_size=1)
handler = logging.StreamHandler(sys.stdout)
# the prefix nanotron's logging.py set_logger_verbosity_format gives each line (a logger rank: the loss's stage)
handler.setFormatter(logging.Formatter("%(asctime)s [%(levelname)s|DP=0|PP=1|TP=0]: %(message)s"))
logger = get_logger("nanotron.logging")
logger.addHandler(handler)
logger.setLevel(logging.INFO)
# trainer.py __init__ logs its Config (pprint: the ParallelismArgs dataclass inside), train() its first line
from pprint import pformat
from nanotron.config import ParallelismArgs
dp, pp, tp, accum = map(int, sys.argv[1:5])
args = ParallelismArgs(dp=dp, pp=pp, tp=tp, pp_engine="1f1b", tp_mode="REDUCE_SCATTER",
                       tp_linear_async_communication=True)
evaluation = ParallelismArgs(dp=1, pp=1, tp=1)  # Config.lighteval's own sizes, printed after the run's
logger.info("Config:\n" + pformat({"general": "x" * 80, "parallelism": args, "zz_lighteval": evaluation}))
logger.info(f"[Start training] datetime: 2026-01-01 00:00:00 | mbs: 1 | grad_accum: {accum} | global_batch_size: 64 | "
            "sequence_length: 2048 | train_steps: 10 | start_iteration_step: 0 | consumed_train_samples: 0")
writer = LoggerWriter(global_step=10)
for step, ms, reserved in ((1, 9100.0, 31.2e9), (2, 2431.7, 39.71e9), (3, 2460.2, 39.74e9), (4, 2449.9, None)):
    items = [LogItem("consumed_tokens", step * 64 * 2048, "human_format"),
             LogItem("elapsed_time_per_iteration_ms", ms, "human_format"),
             LogItem("tokens_per_sec", 64 * 2048 / ms * 1e3, "human_format"),
             LogItem("global_batch_size", 64, "human_format"), LogItem("lm_loss", 11.83, "human_format"),
             LogItem("lr", 0.0003, "human_format")]
    if reserved:  # trainer.py logs memory in the first steps only
        items += [LogItem("cuda_memory_allocated", reserved / 2, "human_format"),
                  LogItem("cuda_max_memory_reserved", reserved, "human_format")]
    writer.add_scalars_from_list(items, step)
torch_dist.destroy_process_group()
"""


@pytest.mark.skipif(importlib.util.find_spec("dacite") is None, reason="dacite is not installed (the engines extra)")
def test_a_nanotron_log_written_by_nanotrons_own_logger_becomes_a_run(tmp_path):
    from berth.cost_models.step import evaluate
    from berth.planner.engine_fit import predict_runs
    from berth.planner.run_logs import read_log
    from berth.specs.candidates import Candidates
    from berth.specs.errors import BerthError
    from berth.specs.tree import EngineTuning

    env = {**os.environ, "PYTHONPATH": NANOTRON_SOURCE}
    training = TrainingSpec(seq_len=2048, global_batch_size=64, engine="nanotron")
    cluster = cluster_from_preset("aws-p5", 1)
    for fix, sizes in (("tp=2,dp=4,mbs=1", "4 1 2 16"), ("tp=2,pp=2,dp=2,mbs=1", "2 2 2 32")):
        cmd = [sys.executable, "-c", NANOTRON_LOGGER, *sizes.split()]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert "elapsed_time_per_iteration_ms: 2.43K" in proc.stdout  # logging.py human_format: 3 significant digits
        assert f"ParallelismArgs(dp={sizes[0]},\n" in proc.stdout and "[Start training]" in proc.stdout
        (tmp_path / "train.log").write_text(proc.stdout)
        (plan,) = compare(load_model("llama3-8b"), training, cluster, [fix])
        run = read_log(str(tmp_path / "train.log"), plan)
        assert run.training.engine == "nanotron" and run.status == "ok"
        assert run.step_time_s == pytest.approx(2.45)  # median of 2.43, 2.46, 2.45 s: the first step left out
        # the largest reserved peak, as logged to 3 digits (decimal G), of the stage with the loss
        assert run.peak_memory_bytes == pytest.approx(39.7e9) and run.memory_kind == "reserved"
        assert run.memory_rank == "last"
        (predicted,) = predict_runs([run], EngineTuning()).seen  # compared with the last stage's prediction
        ev = evaluate(plan.model, run.training, plan.cluster, Candidates.from_layouts([plan.layout]))
        assert predicted == ev.last_stage_memory_bytes[0] and (plan.layout.pp > 1) == (
            ev.last_stage_memory_bytes[0] != ev.first_stage_memory_bytes[0]
        )
    # the last log's run printed dp 2, pp 2, tp 2, a micro-batch of 1 and 32 of them: a plan of another layout is
    # refused, naming the first size that differs
    for fix, field in (("tp=2,dp=4,mbs=1", "dp"), ("tp=2,pp=2,dp=2,mbs=2", "mbs"), ("tp=4,pp=2,dp=1,mbs=1", "dp")):
        (other,) = compare(load_model("llama3-8b"), training, cluster, [fix])
        with pytest.raises(BerthError, match="give the plan that ran") as err:
            read_log(str(tmp_path / "train.log"), other)
        assert err.value.field.endswith(f": {field}"), err.value.field


def test_the_run_as_each_engine_reads_it_overlap_warmup_and_no_clipping():
    """What a written file asks of its engine, read with that engine's own code: Megatron's data-parallel overlap
    flags where the Megatron entry prices the reduce and the gather as hidden (both default off); DeepSpeed's
    WarmupCosineLR warming up linearly, as every other format does (its default is a log curve), and a warmup of 0
    refused (its schedulers raise on it); torchtitan's clipping off at grad_clip 0 (it always clips, and max_norm 0
    would zero every gradient)."""
    import ast

    import torch
    from deepspeed.runtime.lr_schedules import WarmupCosineLR

    from berth.launch.writers import EngineTraining

    cl = cluster_from_preset("dgx-h100", 4)
    model, training = load_model("llama3-8b"), TrainingSpec(seq_len=4096, global_batch_size=64, engine="megatron")

    def megatron_flags(layout):
        p = predict_layouts(model, training, cl, [layout])[0]
        return set(ec.megatron_job(p, artifacts(p, "megatron"))["argv"])

    zero1 = megatron_flags(Layout(tp=8, dp=4, zero_stage=1, shard=4, micro_batch_size=1, num_microbatches=16))
    assert {"--overlap-grad-reduce", "--overlap-param-gather", "--use-distributed-optimizer"} <= zero1
    zero0 = megatron_flags(Layout(tp=8, dp=4, micro_batch_size=1, num_microbatches=16))
    assert "--overlap-grad-reduce" in zero0 and "--overlap-param-gather" not in zero0
    assert not {"--overlap-grad-reduce", "--overlap-param-gather"} & megatron_flags(
        Layout(tp=8, pp=4, micro_batch_size=1, num_microbatches=64)
    )
    plan = next(p for _, p in PLANS if _files(p, "deepspeed") and _files(p, "torchtitan"))
    run = EngineTraining(train_steps=1000, lr=1e-3, min_lr=1e-4, warmup_steps=100)
    params = json.loads(artifacts(plan, "deepspeed", training=run)["ds_config.json"])["scheduler"]["params"]
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1e-3)
    schedule = WarmupCosineLR(opt, **params)
    for _ in range(10):
        opt.step()
        schedule.step()
    # ten steps in: iteration 9 of 100, linear (a log warmup would be at 1e-3 x log(10) / log(100) = 5e-4)
    assert schedule.get_last_lr()[0] == pytest.approx(1e-3 * 9 / 100, rel=0.02)
    with pytest.raises(LaunchRefused, match="warmup_steps 0"):
        artifacts(plan, "deepspeed", training=EngineTraining(warmup_steps=0))
    module = ast.parse(artifacts(plan, "torchtitan", training=EngineTraining(grad_clip=0))["berth_torchtitan.py"])
    norm = next(
        k.value for node in ast.walk(module) if isinstance(node, ast.Call) for k in node.keywords if k.arg == "max_norm"
    )
    assert eval(compile(ast.Expression(norm), "max_norm", "eval")) == math.inf
    grads = [torch.ones(3)]
    torch.nn.utils.clip_grads_with_norm_(grads, math.inf, torch.nn.utils.get_total_norm(grads))
    assert grads[0].tolist() == [1.0, 1.0, 1.0]  # torchtitan's clip at that max_norm leaves them as they are
