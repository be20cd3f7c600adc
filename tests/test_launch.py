"""Launch artifacts, goodput, cost and fallback plans."""

import ast
import json
import math
import os
import shlex
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from berth.cost_models.goodput import daly_interval_s, useful_fraction
from berth.launch.writers import (
    ENGINE_REFUSALS,
    ENGINE_VERSIONS,
    FIELD_KEYS,
    FIELD_SOURCES,
    FORMATS,
    LaunchRefused,
    artifacts,
)
from berth.planner.planning import fallback, make_search, plan, with_operations
from berth.planner.search import predict_layouts, search
from berth.specs.models import load_model
from berth.specs.tree import LAYOUT_FIELDS, Layout, SearchSpec, TrainingSpec
from berth.topology.clusters import cluster_from_preset
from tests.conftest import rerun_if_aborted

BERTH = [sys.executable, "-m", "berth.cli.main"]

# Argument names read from Megatron-LM (main @ d98e8a6): megatron/training/arguments.py and the config
# dataclasses its arguments are generated from; DeepSpeed 0.19.8's deepspeed/runtime/constants.py,
# zero/config.py, tensor_parallel/config.py (the engines' own sources; see launch/writers.py FIELD_SOURCES).
# tests/test_engines.py loads the artifacts with the engines' parsers themselves.
MEGATRON_ARGS = {
    # data-parallel overlap, both store_true and off by default (arguments.py _add_distributed_args)
    *["--overlap-grad-reduce", "--overlap-param-gather"],
    # the model's details and the training run (megatron/training/arguments.py)
    *[
        "--rotary-base",
        "--norm-epsilon",
        "--make-vocab-size-divisible-by",
        "--use-rope-scaling",
        "--rope-scaling-factor",
    ],
    *["--add-qkv-bias", "--attention-dropout", "--hidden-dropout", "--train-iters", "--optimizer", "--lr", "--min-lr"],
    *["--lr-decay-style", "--lr-warmup-iters", "--lr-decay-iters", "--weight-decay", "--adam-beta1", "--adam-beta2"],
    *["--adam-eps", "--clip-grad", "--save", "--load", "--save-interval", "--split", "--log-interval"],
    "--tensor-model-parallel-size",
    "--pipeline-model-parallel-size",
    "--num-layers-per-virtual-pipeline-stage",
    "--sequence-parallel",
    "--recompute-granularity",
    "--recompute-method",
    "--recompute-num-layers",
    "--micro-batch-size",
    "--global-batch-size",
    "--use-distributed-optimizer",
    "--num-distributed-optimizer-instances",
    "--use-megatron-fsdp",
    "--data-parallel-sharding-strategy",
    "--ckpt-format",
    "--use-tp-pp-dp-mapping",
    "--num-layers",
    "--hidden-size",
    "--ffn-hidden-size",
    "--num-attention-heads",
    "--seq-length",
    "--max-position-embeddings",
    "--bf16",
    "--fp16",
    "--group-query-attention",
    "--num-query-groups",
    "--swiglu",
    "--normalization",
    "--position-embedding-type",
    "--disable-bias-linear",
    "--untie-embeddings-and-output-weights",
    "--attention-backend",
    "--tokenizer-type",
    "--tokenizer-model",
    "--data-path",
    "--decoder-first-pipeline-num-layers",
    "--decoder-last-pipeline-num-layers",
    "--pipeline-model-parallel-layout",
    "--context-parallel-size",
}
DEEPSPEED_KEYS = {
    "train_batch_size",
    "train_micro_batch_size_per_gpu",
    "gradient_accumulation_steps",
    "zero_optimization",
    "zero_optimization.stage",
    "bf16",
    "bf16.enabled",
    "fp16",
    "fp16.enabled",
    "tensor_parallel",
    "tensor_parallel.autotp_size",
    "activation_checkpointing",
    "activation_checkpointing.partition_activations",
    # the training run and the pipeline's recompute (deepspeed/runtime/config.py, lr_schedules.py)
    *["optimizer", "optimizer.type", "optimizer.params", "optimizer.params.lr", "optimizer.params.betas"],
    *[
        "optimizer.params.eps",
        "optimizer.params.weight_decay",
        "optimizer.params.torch_adam",
        "scheduler",
        "scheduler.type",
        "scheduler.params",
    ],
    *["scheduler.params.total_num_steps", "scheduler.params.warmup_num_steps", "scheduler.params.warmup_min_ratio"],
    *["scheduler.params.cos_min_ratio", "gradient_clipping", "pipeline", "pipeline.activation_checkpoint_interval"],
    "scheduler.params.warmup_type",  # lr_schedules.py WarmupCosineLR(warmup_type="log" | "linear")
    *["data_types", "data_types.grad_accum_dtype"],  # runtime/config.py get_data_types
}


def plan_for(layout: Layout, model="llama3-70b", nodes=4, batch=64):
    # no memory headroom: tp=4,pp=4,dp=2 (18 bytes per parameter of llama3-70b / 16) fits but is tight,
    # and these tests are about the launch formats
    (p,) = predict_layouts(
        load_model(model),
        TrainingSpec(seq_len=4096, global_batch_size=batch),
        cluster_from_preset("dgx-h100", nodes),
        [layout],
        memory_headroom=0.0,
    )
    return p


LAYOUTS = [
    Layout(
        tp=8,
        pp=2,
        dp=2,
        zero_stage=1,
        shard=2,
        micro_batch_size=1,
        num_microbatches=32,
        sequence_parallel=True,
        recompute="selective",
    ),
    Layout(
        tp=8,
        pp=4,
        dp=1,
        micro_batch_size=1,
        num_microbatches=64,
        schedule="interleaved_1f1b",
        virtual_stages=5,
        sequence_parallel=True,
        recompute="full",
    ),
    Layout(
        tp=4,
        pp=4,
        dp=2,
        zero_stage=1,
        shard=1,
        micro_batch_size=1,
        num_microbatches=32,
        axis_order="tp-pp-dp",
        recompute="full",
    ),
]


def _flat(d, prefix=""):
    for k, v in d.items():
        yield f"{prefix}{k}"
        if isinstance(v, dict):
            yield from _flat(v, f"{prefix}{k}.")


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda x: x.short())
def test_megatron_arguments_are_megatrons_own(layout):
    files = artifacts(plan_for(layout), "megatron")
    text = files["megatron-args.txt"]
    args = "\n".join(line for line in text.splitlines() if not line.startswith("#"))
    flags = [w for w in args.split() if w.startswith("--")]
    assert set(flags) <= MEGATRON_ARGS and len(flags) == len(set(flags))
    assert f"--tensor-model-parallel-size {layout.tp}" in text
    assert f"--micro-batch-size {layout.micro_batch_size}" in text
    assert ("--sequence-parallel" in flags) == layout.sequence_parallel
    assert ("--use-tp-pp-dp-mapping" in flags) == (layout.axis_order == "tp-pp-dp")
    assert ("--num-distributed-optimizer-instances" in flags) == (layout.zero_stage == 1 and layout.shard < layout.dp)
    if layout.virtual_stages > 1:
        assert f"--num-layers-per-virtual-pipeline-stage {80 // (layout.pp * layout.virtual_stages)}" in text
    # tp > 1 without Megatron FSDP: the launch sets what validate_args asserts
    assert "export CUDA_DEVICE_MAX_CONNECTIONS=1" in files["megatron-launch.sh"]
    assert ENGINE_VERSIONS["megatron"] in text and ENGINE_VERSIONS["megatron"] in files["megatron-launch.sh"]


def _megatron_flags(files):
    text = "\n".join(line for line in files["megatron-args.txt"].splitlines() if not line.startswith("#"))
    words = shlex.split(text.replace("\\\n", " "))
    return {
        w: (words[i + 1] if i + 1 < len(words) and not words[i + 1].startswith("--") else None)
        for i, w in enumerate(words)
        if w.startswith("--")
    }


def test_uneven_stages_in_each_engines_terms():
    """32 layers on pp 3 (11, 11, 10) and 80 layers in 4 x 3 chunks (5, 7 x10, 5): Megatron's first/last stage
    counts (its "Uneven PP" check: the rest divide evenly among the middle stages) or its chunk layout,
    torchtitan's layers_per_stage with first/last_stage_less_layers, DeepSpeed refused."""
    p = plan_for(
        Layout(
            tp=8, pp=3, dp=1, micro_batch_size=1, num_microbatches=64, sequence_parallel=True, recompute="selective"
        ),
        "llama3-8b",
        nodes=3,
    )
    assert p.stage_layers == [11, 11, 10] and p.prediction.fits
    flags = _megatron_flags(artifacts(p, "megatron"))
    assert set(flags) <= MEGATRON_ARGS
    first, last = int(flags["--decoder-first-pipeline-num-layers"]), int(flags["--decoder-last-pipeline-num-layers"])
    assert (first, last) == (11, 10) and first > 0 and last > 0 and (32 - first - last) % (3 - 2) == 0
    assert "--num-layers-per-virtual-pipeline-stage" not in flags
    module = ast.parse(artifacts(p, "torchtitan")["berth_torchtitan.py"])
    (par,) = [
        {k.arg: ast.literal_eval(k.value) for k in n.keywords}
        for n in ast.walk(module)
        if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "ParallelismConfig"
    ]
    assert (
        par["pipeline_parallel_layers_per_stage"],
        par["pipeline_parallel_first_stage_less_layers"],
        par["pipeline_parallel_last_stage_less_layers"],
    ) == (11, 0, 1)
    ds = plan_for(
        Layout(pp=3, dp=8, zero_stage=1, shard=8, micro_batch_size=1, num_microbatches=8, recompute="full"),
        "llama3-8b",
        nodes=3,
    )
    with pytest.raises(LaunchRefused, match="uneven pipeline stages .* 11, 11, 10"):
        artifacts(ds, "deepspeed")

    chunked = plan_for(
        Layout(
            tp=8,
            pp=4,
            dp=1,
            micro_batch_size=1,
            num_microbatches=64,
            schedule="interleaved_1f1b",
            virtual_stages=3,
            sequence_parallel=True,
            recompute="full",
        )
    )
    assert chunked.stage_layers == [19, 21, 21, 19]
    flags = _megatron_flags(artifacts(chunked, "megatron"))
    # E embedding, t a decoder layer, L the loss; "|" ends a chunk (megatron/core/transformer/
    # pipeline_parallel_layer_layout.py); the first/last counts would shorten every chunk of a rank
    assert flags["--pipeline-model-parallel-layout"] == "Et*5|(t*7|)*10,t*5L"
    assert not {"--num-layers-per-virtual-pipeline-stage", "--decoder-first-pipeline-num-layers"} & set(flags)
    module = ast.parse(artifacts(chunked, "torchtitan")["berth_torchtitan.py"])
    (par,) = [
        {k.arg: ast.literal_eval(k.value) for k in n.keywords}
        for n in ast.walk(module)
        if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "ParallelismConfig"
    ]
    assert (
        par["pipeline_parallel_layers_per_stage"],
        par["pipeline_parallel_first_stage_less_layers"],
        par["pipeline_parallel_last_stage_less_layers"],
    ) == (7, 2, 2)


def test_engine_artifacts_stop_on_a_missing_placeholder(tmp_path):
    """What the user must supply stops the launch with its description when unset (run by bash itself)."""
    p = plan_for(Layout(dp=8, zero_stage=3, shard=8, micro_batch_size=2, num_microbatches=4), "llama3-8b", 1)
    for fmt, script, var in [
        ("megatron", "megatron-launch.sh", "TOKENIZER_MODEL"),
        ("deepspeed", "deepspeed-launch.sh", "TRAIN_SCRIPT"),
        ("torchtitan", "torchtitan-launch.sh", "BERTH_DATASET"),
    ]:
        (tmp_path / script).write_text(artifacts(p, fmt)[script])
        env = {"PATH": os.environ["PATH"], "MEGATRON_LM": str(tmp_path), "DATA_PATH": "d", "BERTH_HF_ASSETS": "a"}
        r = subprocess.run(["bash", str(tmp_path / script)], env=env, capture_output=True, text=True, timeout=30)
        assert r.returncode != 0 and f"{var}: set {var} to " in r.stderr, (fmt, r.stderr)


def test_deepspeed_config_and_torchtitan_module_use_their_schema_names():
    ds = json.loads(
        artifacts(
            plan_for(
                Layout(pp=2, dp=16, zero_stage=1, shard=16, micro_batch_size=1, num_microbatches=4, recompute="full"),
                "llama3-8b",
            ),
            "deepspeed",
        )["ds_config.json"]
    )
    assert set(_flat(ds)) <= DEEPSPEED_KEYS
    assert ds["train_batch_size"] == 64 and ds["gradient_accumulation_steps"] == 4
    files = artifacts(
        plan_for(
            Layout(
                tp=8,
                pp=2,
                dp=2,
                zero_stage=3,
                shard=2,
                micro_batch_size=1,
                num_microbatches=32,
                schedule="interleaved_1f1b",
                virtual_stages=2,
                sequence_parallel=True,
                recompute="selective",
            )
        ),
        "torchtitan",
    )
    module = ast.parse(files["berth_torchtitan.py"])
    calls = {
        n.func.id: {k.arg: ast.literal_eval(k.value) for k in n.keywords if isinstance(k.value, ast.Constant)}
        for n in ast.walk(module)
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)
    }
    p = calls["ParallelismConfig"]
    assert (
        p["tensor_parallel_degree"],
        p["pipeline_parallel_degree"],
        p["data_parallel_shard_degree"],
        p["data_parallel_replicate_degree"],
    ) == (8, 2, 2, 1)
    # torchtitan counts embedding and output as layers unless told not to: 80 / (2 x 2) = 20 per stage, 4 stages
    assert p["pipeline_parallel_schedule"] == "Interleaved1F1B" and p["pipeline_parallel_layers_per_stage"] == 20
    assert p["pipeline_parallel_first_stage_less_layers"] == p["pipeline_parallel_last_stage_less_layers"] == 0
    assert calls["TrainingConfig"]["local_batch_size"] == 32 and calls["TrainingConfig"]["global_batch_size"] == 64


def test_every_layout_field_maps_to_exactly_one_key_with_its_source():
    for fmt, keys in FIELD_KEYS.items():
        assert set(keys) == set(LAYOUT_FIELDS), fmt
        real = [k for k in keys.values() if not k.startswith("(")]
        assert len(real) == len(set(real)), fmt
        assert all(src for _, src in FIELD_SOURCES[fmt].values()), fmt


@pytest.mark.parametrize(
    "fmt, layout, words",
    [
        ("megatron", Layout(dp=32, zero_stage=3, shard=8, micro_batch_size=2), "shard 8 < dp 32"),
        ("megatron", Layout(tp=8, pp=4, num_microbatches=64, schedule="gpipe", recompute="full"), "gpipe"),
        ("megatron", Layout(tp=8, dp=4, num_microbatches=16, axis_order="dp-tp-pp"), "axis_order"),
        ("deepspeed", Layout(tp=8, dp=4, num_microbatches=16, sequence_parallel=True), "sequence_parallel"),
        ("deepspeed", Layout(tp=8, pp=4, num_microbatches=64, schedule="interleaved_1f1b", virtual_stages=2), "1F1B"),
        ("deepspeed", Layout(dp=32, zero_stage=3, shard=8, micro_batch_size=2), "removed MiCS"),
        ("deepspeed", Layout(tp=4, cp=2, dp=4, micro_batch_size=1, num_microbatches=16), "cp 2: DeepSpeed has no ring"),
        # pp=2: under the executor's DDP + ZeroRedundancyOptimizer (dp alone) fp32 weights, gradients and the
        # autocast copy of an 8B model alone overflow 80 GB; with pp it runs under FSDP2 and fits
        (
            "torchtitan",
            Layout(pp=2, dp=16, zero_stage=1, shard=16, micro_batch_size=2, num_microbatches=2, recompute="full"),
            "zero_stage 1",
        ),
    ],
)
def test_a_layout_a_format_cannot_express_is_refused_with_the_reason(fmt, layout, words):
    plan = plan_for(layout, "llama3-8b")
    assert plan.prediction.fits, plan.infeasible_reason
    with pytest.raises(LaunchRefused, match=words):
        artifacts(plan, fmt)


@pytest.mark.parametrize(
    "fmt, layout",
    [
        ("megatron", Layout(dp=32, zero_stage=3, shard=32, micro_batch_size=2)),  # Megatron FSDP
        ("megatron", Layout(dp=32, zero_stage=2, shard=32, micro_batch_size=2)),
        ("deepspeed", Layout(tp=4, dp=8, micro_batch_size=1, num_microbatches=8)),  # ZeRO-0 with dp > 1
        ("torchtitan", Layout(tp=4, dp=8, micro_batch_size=1, num_microbatches=8)),  # tp without sp
        ("torchtitan", Layout(dp=32, zero_stage=2, shard=32, micro_batch_size=1, num_microbatches=2)),  # accumulation
    ],
)
def test_layouts_the_engine_version_can_express_are_not_refused(fmt, layout):
    plan = plan_for(layout, "llama3-8b")
    assert plan.prediction.fits, plan.infeasible_reason
    assert artifacts(plan, fmt)


def test_torchtitan_refuses_attention_without_flash():
    (p,) = predict_layouts(
        load_model("llama3-8b"),
        TrainingSpec(seq_len=4096, global_batch_size=64, flash_attention=False),
        cluster_from_preset("dgx-h100", 1),
        [Layout(dp=8, zero_stage=3, shard=8, micro_batch_size=1, num_microbatches=8)],
    )
    with pytest.raises(LaunchRefused, match="sdpa removed"):
        artifacts(p, "torchtitan")


def test_framework_megatron_search_rejects_exactly_what_the_megatron_launch_refuses():
    model, cluster = load_model("llama3-8b"), cluster_from_preset("dgx-h100", 4)
    layouts = [Layout(dp=32, zero_stage=z, shard=s, micro_batch_size=2) for z in (1, 2, 3) for s in (8, 32)]
    layouts += [
        Layout(tp=4, pp=2, dp=4, num_microbatches=16, schedule=sch, axis_order=order)
        for sch in ("gpipe", "1f1b")
        for order in ("tp-dp-pp", "tp-pp-dp", "dp-tp-pp", "pp-tp-dp")
    ]
    for framework in ("megatron", "pytorch"):
        training = TrainingSpec(seq_len=4096, global_batch_size=64, framework=framework)
        for p in predict_layouts(model, training, cluster, layouts):
            searched_out = (p.infeasible_reason or "").startswith("megatron_")
            refused = ENGINE_REFUSALS["megatron"](p) is not None
            assert searched_out == (refused and framework == "megatron"), (framework, p.layout.short())
    # Megatron's validate_args: mixture of experts with tp needs sequence parallelism
    moe_layouts = [
        Layout(tp=2, dp=16, ep=2, zero_stage=1, shard=16, micro_batch_size=1, num_microbatches=4, sequence_parallel=sp)
        for sp in (False, True)
    ]
    training = TrainingSpec(seq_len=4096, global_batch_size=64, framework="megatron")
    moe = predict_layouts(load_model("mixtral-8x7b"), training, cluster, moe_layouts)
    assert [ENGINE_REFUSALS["megatron"](p) is not None for p in moe] == [True, False]
    assert [(p.infeasible_reason or "").startswith("megatron_") for p in moe] == [True, False]


def test_kubernetes_report_lands_on_a_volume_that_outlives_the_pod():
    p = plan_for(
        Layout(
            tp=8,
            pp=2,
            dp=2,
            zero_stage=1,
            shard=2,
            micro_batch_size=1,
            num_microbatches=32,
            sequence_parallel=True,
            recompute="full",
        )
    )
    files = artifacts(p, "kubernetes")
    job, claim = json.loads(files["pytorchjob.yaml"]), json.loads(files["report-pvc.yaml"])
    reader = json.loads(files["report-reader.yaml"])
    master = job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]
    c = master["containers"][0]
    report = c["command"][c["command"].index("--report") + 1]
    mount = next(m for m in c["volumeMounts"] if m["name"] == "report")
    assert report == mount["mountPath"] + "/report.json"
    volume = next(v for v in master["volumes"] if v["name"] == "report")
    assert volume["persistentVolumeClaim"]["claimName"] == claim["metadata"]["name"]
    assert claim["kind"] == "PersistentVolumeClaim"
    assert reader["spec"]["volumes"][0]["persistentVolumeClaim"]["claimName"] == claim["metadata"]["name"]
    # workers never mount the (ReadWriteOnce) claim
    worker = job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]
    assert all(v["name"] != "report" for v in worker["volumes"])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_torchrun_artifact_run_as_written_completes_a_validation(tmp_path):
    pytest.importorskip("torch", reason="the artifact runs the executor (torch: the executor extra)")
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
            "--fix",
            "dp=2,zero=2",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    (tmp_path / "plans.json").write_text(r.stdout)
    r = subprocess.run(
        [
            *BERTH,
            "launch",
            str(tmp_path / "plans.json"),
            "--format",
            "torchrun",
            "--out",
            str(tmp_path / "run"),
            "--steps",
            "3",
            "--warmup",
            "1",
        ],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stderr
    script = tmp_path / "run" / "node0.sh"
    assert "--node-rank=0" in script.read_text() and "--nproc-per-node=2" in script.read_text()
    env = {
        **os.environ,
        "MASTER_PORT": str(_free_port()),
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
    }
    assert shutil.which("torchrun", path=env["PATH"])
    done = rerun_if_aborted(
        lambda: subprocess.run(
            ["sh", str(script)],
            cwd=tmp_path / "run",
            env={**env, "MASTER_PORT": str(_free_port())},
            capture_output=True,
            text=True,
            timeout=300,
        )
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    assert report["status"] == "ok" and report["measured"]["step_time_s"] > 0 and len(report["per_rank"]) == 2
    assert report["plan"]["layout"]["zero_stage"] == 2


def test_cluster_launchers_cover_every_node():
    p = plan_for(
        Layout(
            tp=8,
            pp=2,
            dp=2,
            zero_stage=1,
            shard=2,
            micro_batch_size=1,
            num_microbatches=32,
            sequence_parallel=True,
            recompute="full",
        )
    )
    scripts = artifacts(p, "torchrun")
    assert sorted(k for k in scripts if k.endswith(".sh")) == ["node0.sh", "node1.sh", "node2.sh", "node3.sh"]
    assert "--node-rank=3" in scripts["node3.sh"] and "MASTER_ADDR=n0;" in scripts["node3.sh"]
    sbatch = artifacts(p, "slurm")["berth.sbatch"]
    assert "#SBATCH --nodes=4" in sbatch and '--node-rank="$SLURM_NODEID"' in sbatch and "--gpus-per-node=8" in sbatch
    job = json.loads(artifacts(p, "kubernetes")["pytorchjob.yaml"])
    replicas = job["spec"]["pytorchReplicaSpecs"]
    assert job["kind"] == "PyTorchJob" and replicas["Master"]["replicas"] == 1 and replicas["Worker"]["replicas"] == 3
    assert job["spec"]["nprocPerNode"] == "8"
    with pytest.raises(Exception, match="use one of"):
        artifacts(p, "mpirun")
    assert set(FORMATS) == {"torchrun", "slurm", "kubernetes", "megatron", "deepspeed", "torchtitan", "nanotron"}


def test_young_daly_interval_and_useful_fraction_by_hand():
    delta, mtbf = 100.0, 1e5
    young = math.sqrt(2 * delta * mtbf)  # 4472.1 s
    x = delta / (2 * mtbf)
    assert float(daly_interval_s(delta, mtbf)) == pytest.approx(young * (1 + math.sqrt(x) / 3 + x / 9) - delta)
    assert float(daly_interval_s(3e5, mtbf)) == mtbf  # checkpoints slower than failures: once per MTBF
    # 4400 s of work, 100 s checkpoint, 600 s restart, MTBF 1e5 s:
    # 4400/4500 x (1 - (600 + 2250) / 1e5) = 0.97778 x 0.9715 = 0.94991
    assert float(useful_fraction(4400.0, 100.0, 600.0, 1e5)) == pytest.approx(0.949911, rel=1e-5)


def test_goodput_changes_the_ranking_with_frequent_failures_and_a_slow_filesystem():
    model, training = load_model("llama3-8b"), TrainingSpec(seq_len=4096, global_batch_size=512)
    calm = cluster_from_preset("dgx-h100", 64)
    rough = with_operations(calm, failures_per_gpu_hour=2e-4, storage_write_bytes_per_s_per_gpu=2e6)
    rough = rough.model_copy(update={"storage_client_write_bytes_per_s": 2e7})
    # replicated optimizer states: the checkpoint writers are then the tp x pp shards of the model
    # (the fastest layout with ZeRO already writes from every rank, leaving goodput nothing to gain)
    replicated = {"zero_stage": 0}
    fast = search(model, training, rough, SearchSpec(top=1, fix=replicated)).plans[0]
    good = search(model, training, rough, SearchSpec(top=1, objective="goodput", fix=replicated)).plans[0]
    assert good.layout != fast.layout
    assert good.prediction.goodput.goodput_tokens_per_s > fast.prediction.goodput.goodput_tokens_per_s
    assert good.prediction.goodput.checkpoint_writers > fast.prediction.goodput.checkpoint_writers
    # on a calm cluster with fast storage the two objectives agree
    assert (
        search(model, training, calm, SearchSpec(top=1, objective="goodput", fix=replicated)).plans[0].layout
        == search(model, training, calm, SearchSpec(top=1, fix=replicated)).plans[0].layout
    )
    g = fast.prediction.goodput
    assert g.mtbf_s == pytest.approx(3600 / (2e-4 * 512))
    assert g.checkpoint_bytes_total == pytest.approx(model.num_params * 14)  # bf16 weights + 12 B of AdamW state


def test_cost_per_token_and_budget():
    cluster = with_operations(cluster_from_preset("dgx-h100", 8), price_per_gpu_hour=2.0)
    training = TrainingSpec(seq_len=8192, global_batch_size=256, token_budget=1e12)
    p = plan(load_model("llama3-70b"), training, cluster, make_search(top=1)).plans[0]
    g = p.prediction.goodput
    assert g.cost_per_step == pytest.approx(p.prediction.step_time_s * 64 * 2.0 / 3600)
    assert g.cost_for_token_budget == pytest.approx(1e12 / g.goodput_tokens_per_s * 64 * 2.0 / 3600)
    assert g.energy_kwh_per_million_tokens == pytest.approx(64 * 700 / g.goodput_tokens_per_s * 1e6 / 3.6e6)


def test_fallback_with_one_node_lost_keeps_the_batch_or_says_what_changes():
    model, spec = load_model("llama3-70b"), make_search(top=1)
    keep = plan(model, TrainingSpec(seq_len=4096, global_batch_size=96), cluster_from_preset("dgx-h100", 4), spec)
    fb = fallback(keep.plans[0], spec)
    assert fb.world_size == 24 and fb.global_batch_size == 96 and fb.layout.world_size == 24
    # 56 GPUs = 7 x 8: with uneven pipeline stages (specs/stages.py) pp = 7 splits 70B's 80 layers (10, 12 x5,
    # 10), so the batch of 256 is kept; a 4-layer model has no pp of 7 and no dp of 7 divides 256
    kept = plan(model, TrainingSpec(seq_len=8192, global_batch_size=256), cluster_from_preset("dgx-h100", 8), spec)
    fb = fallback(kept.plans[0], spec)
    assert fb.world_size == 56 and fb.global_batch_size == 256 and fb.layout.pp % 7 == 0
    change = plan(
        load_model("tiny-gpt"),
        TrainingSpec(seq_len=8192, global_batch_size=256),
        cluster_from_preset("dgx-h100", 8),
        spec,
    )
    fb = fallback(change.plans[0], spec)
    assert fb.world_size == 56 and fb.global_batch_size != 256
    assert any("global batch" in c and "256" in c for c in fb.changes)


def test_context_parallel_reaches_megatron_and_torchtitan():
    """cp becomes Megatron's --context-parallel-size and torchtitan's parallelism.context_parallel_degree
    (its dp degrees stay berth's dp: world = dp x cp x tp x pp in both engines)."""
    p = plan_for(Layout(tp=4, cp=2, dp=4, zero_stage=3, shard=4, micro_batch_size=1, num_microbatches=16), "llama3-8b")
    assert p.prediction.fits, p.infeasible_reason
    flags = _megatron_flags(artifacts(p, "megatron"))
    assert flags["--context-parallel-size"] == "2" and flags["--tensor-model-parallel-size"] == "4"
    module = ast.parse(artifacts(p, "torchtitan")["berth_torchtitan.py"])
    (par,) = [
        {k.arg: ast.literal_eval(k.value) for k in n.keywords}
        for n in ast.walk(module)
        if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "ParallelismConfig"
    ]
    assert (
        par["context_parallel_degree"],
        par["tensor_parallel_degree"],
        par["data_parallel_shard_degree"],
        par["data_parallel_replicate_degree"],
    ) == (2, 4, 4, 1)


def test_mixture_of_experts_launch_megatron_and_refusals():
    # Mixtral 8x7B on 2 nodes: ep 4 of dp 16, fully sharded
    plan = plan_for(
        Layout(dp=16, ep=4, zero_stage=3, shard=16, micro_batch_size=1, num_microbatches=4, recompute="full"),
        "mixtral-8x7b",
        nodes=2,
    )
    assert plan.prediction.fits, plan.infeasible_reason
    text = artifacts(plan, "megatron")["megatron-args.txt"]
    for flag in (
        "--num-experts 8",
        "--moe-router-topk 2",
        "--moe-ffn-hidden-size 14336",
        "--expert-model-parallel-size 4",
        "--expert-tensor-parallel-size 1",
        "--moe-token-dispatcher-type alltoall",
    ):
        assert flag in text, flag
    assert "--moe-layer-freq" not in text and "--moe-shared-expert-intermediate-size" not in text
    with pytest.raises(LaunchRefused, match="torchtitan 0.3.0 cannot run it: mixture of experts"):
        artifacts(plan, "torchtitan")
    # DeepSpeed 0.19.8 runs experts with AutoEP (its expert_parallel section), expert_tp 1 only
    ds_config = json.loads(artifacts(plan, "deepspeed")["ds_config.json"])
    assert ds_config["expert_parallel"] == {"enabled": True, "autoep_size": 4, "expert_tensor_parallel_size": 1}
    # DeepSeek-style: 3 dense layers first, one shared expert
    ds = plan_for(
        Layout(
            tp=8,
            pp=16,
            dp=8,
            ep=8,
            zero_stage=1,
            shard=8,
            micro_batch_size=1,
            num_microbatches=16,
            recompute="full",
            sequence_parallel=True,
        ),
        "deepseek-v3-style",
        nodes=128,
        batch=128,
    )
    assert ds.prediction is not None and ds.layout.ep == 8
    text = artifacts(ds, "megatron")["megatron-args.txt"]
    assert (
        "--moe-layer-freq '([0]*3+[1]*58)'" in text
    )  # shell-quoted: the parentheses and "--moe-shared-expert-intermediate-size 2048" in text


def test_every_registered_format_is_offered_by_the_cli_and_the_api_and_builds():
    """One table of formats (LAUNCH_FORMATS): the CLI's --format help and the API's enum list it,
    every entry builds its files, and only the engine formats carry a version and a refusal check."""
    import typer

    from berth.api.schemas import LaunchRequest
    from berth.cli.main import app
    from berth.launch.writers import LAUNCH_FORMATS

    launch = typer.main.get_command(app).commands["launch"]
    (fmt_option,) = [p for p in launch.params if p.name == "fmt"]
    assert all(name in fmt_option.help for name in LAUNCH_FORMATS)
    fmt_schema = LaunchRequest.model_json_schema()["properties"]["format"]  # optional: the plan's engine's own
    enums = [a["enum"] for a in fmt_schema["anyOf"] if "enum" in a]
    assert enums == [list(LAUNCH_FORMATS)] and list(LAUNCH_FORMATS) == list(FORMATS)
    p = plan_for(Layout(tp=1, pp=4, dp=8, micro_batch_size=1, num_microbatches=8), model="llama3-8b")
    for name, spec in LAUNCH_FORMATS.items():
        assert spec.refusal is None or spec.refusal(p) is None, (name, spec.refusal(p))
        files = artifacts(p, name)
        assert files and all(isinstance(v, str) and v for v in files.values()), name
        assert (spec.engine_version is None) == (spec.refusal is None) == spec.runs_executor, name
        if spec.engine_version:
            assert spec.engine_version in "".join(files.values()) and name in FIELD_SOURCES, name
    assert set(FIELD_SOURCES) == set(ENGINE_VERSIONS) == set(ENGINE_REFUSALS)


def test_a_torchrun_is_rerun_once_where_a_rank_was_aborted_and_only_then():
    """tests.conftest.rerun_if_aborted: one more run after a SIGABRT (the warning says so), none after any other
    failure, and a second abort is returned for the test to fail on."""
    aborted = subprocess.CompletedProcess([], -6, "", "traceback : Signal 6 (SIGABRT) received by PID 7")
    failed = subprocess.CompletedProcess([], 1, "", "AssertionError: losses differ")
    ok = subprocess.CompletedProcess([], 0, "", "")
    for outcomes, calls, code in (([aborted, ok], 2, 0), ([failed, ok], 1, 1), ([aborted, aborted, ok], 2, -6)):
        seen = iter(outcomes)
        runs = []

        def run(seen=seen, runs=runs):
            runs.append(1)
            return next(seen)

        if outcomes[0] is aborted:
            with pytest.warns(UserWarning, match="SIGABRT"):
                r = rerun_if_aborted(run)
        else:
            r = rerun_if_aborted(run)
        assert (len(runs), r.returncode) == (calls, code)
