"""Launch artifacts: a plan as the files that start it on the engine a team already uses.

- torchrun: one script per node running the bundled executor (`berth.executor.worker`), static
  rendezvous so that node n's local rank l is global rank n x G + l, exactly the plan's rank map
  (`Plan.placement.rank_map`: node = rank // gpus_per_node), GPUs in local order;
- slurm: an sbatch script (one task per node, node rank from SLURM_NODEID);
- kubernetes: a Kubeflow PyTorchJob (Master + Workers, torchrun reads the PET_* variables the
  training operator sets); the Master writes report.json onto a PersistentVolumeClaim (report-pvc.yaml),
  read back through report-reader.yaml;
- megatron: Megatron-LM pretrain_gpt.py arguments and a torchrun launch; deepspeed: a DeepSpeed config
  JSON, the launch notes and (more than one node) a hostfile; torchtitan: a torchtitan 0.3 configuration module
  (--module/--config) and its launch; nanotron: the YAML its run_train.py reads and its launch. Each starts
  training as written: the model's own details (rope base and scaling, norm epsilon, biases, tied embeddings,
  vocabulary padding, dropout), and the training run of EngineTraining (AdamW, steps, LR schedule,
  checkpointing; its defaults are in docs/engines.md).

Every format is one entry of LAUNCH_FORMATS (at the end of this module), which `artifacts`, the CLI's
--format and the API's `format` read. Each engine format targets one engine version (ENGINE_VERSIONS,
stated in every artifact), carries the whole model shape, and names what a user must still supply
(tokenizer, data) as placeholders that stop the launch with their description when unset. Every layout
field maps to exactly one key of a format (FIELD_SOURCES: the key and the engine file and line it was
read from). A layout a format cannot express is refused with the reason (LaunchRefused), never
approximated; every refusal is worded by _refuse (the engine, its version, the reason). Every value that reaches a
shell goes through shlex.quote. tests/test_engines.py loads the artifacts with the engines' own parsers and
tests/test_engine_start.py starts them with the engines' own code (nanotron's: its config parser).
"""

from __future__ import annotations

import json
import math
import re
import shlex
from collections.abc import Callable
from dataclasses import dataclass, fields
from types import ModuleType
from typing import Any

from pydantic import TypeAdapter, ValidationError

from berth.specs.engines import ENGINES, MEGATRON_VOCAB_DIVISOR, engine_refusal, refusal_text
from berth.specs.errors import BerthError
from berth.specs.tree import ImageName, Layout, Plan, TrainingSpec

DEFAULT_PORT = 29500
# the Dockerfile built with --build-arg WITH_TORCH=1 (CPU torch); GPU clusters need an image whose
# torch is a CUDA build (pass it with --image)
DEFAULT_IMAGE = "berth-executor:latest"
# Kubernetes: where the Master mounts the report claim, and the image of the pod that reads it back
REPORT_DIR = "/berth-report"
REPORT_READER_IMAGE = "busybox:1.36"


class LaunchRefused(BerthError):
    """The format cannot express this layout."""

    def __init__(self, fmt: str, reason: str):
        super().__init__("format", fmt, f"cannot express this layout: {reason}")


def _refuse(engine: str, reason: str) -> str:
    """A refusal of the engine's training options, worded as the engine table words a layout's
    (specs/engines.py refusal_text: the engine, its version and the reason)."""
    return refusal_text(engine, reason)


def _engine_refusal(engine: str, plan: Plan) -> str | None:
    """Why `engine` cannot run the plan's layout: the engine table's rules (specs/engines.py), the ones the
    search applies, so a plan offered for an engine is one its launch files accept."""
    return engine_refusal(plan.layout, plan.model, plan.training, engine)


@dataclass(frozen=True)
class EngineTraining:
    """The training run an engine artifact starts, beyond the plan: optimizer, length, LR schedule and
    checkpointing. Each default is the value written when the caller gives none (docs/engines.md lists them);
    the plan's batch, precision and layout come from the plan."""

    train_steps: int = 10_000  # optimizer steps (Megatron --train-iters, torchtitan training.steps)
    lr: float = 3e-4  # peak learning rate (AdamW)
    min_lr: float = 3e-5  # the LR at the end of the decay
    warmup_steps: int = 500  # linear warmup from 0 to lr
    decay: str = "cosine"  # decay from lr to min_lr over the steps after warmup: cosine or linear
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    adam_eps: float = 1e-8
    grad_clip: float = 1.0  # global gradient-norm clipping (0: none)
    checkpoint_interval: int = 1000  # steps between checkpoints
    checkpoint_dir: str = "checkpoints"  # where checkpoints are written (and resumed from)
    data_split: str = "969,30,1"  # Megatron --split: train, validation, test weights

    def __post_init__(self):
        _check_training(self)


_SAFE_PATH = re.compile(r"^[A-Za-z0-9_./-]{1,255}$")
_TRAINING_FIELDS = {f.name: type(f.default) for f in fields(EngineTraining)}


def engine_training(values: str | dict[str, Any] | None, field: str = "train") -> EngineTraining:
    """EngineTraining from the CLI's "train_steps=20000,lr=1e-4,betas=0.9/0.95" or the API's object; an unknown
    key or a bad value is refused naming `field.<key>`."""
    if values is None or values == "":
        return EngineTraining()
    if isinstance(values, str):
        pairs = [part.partition("=") for part in values.split(",") if part.strip()]
        if any(not sep for _, sep, _ in pairs):
            raise BerthError(field, values, "expected key=value pairs, e.g. train_steps=20000,lr=1e-4")
        values = {k.strip(): v.strip() for k, _, v in pairs}
    out: dict[str, Any] = {}
    for key, value in values.items():
        kind = _TRAINING_FIELDS.get(key)
        if kind is None:
            raise BerthError(f"{field}.{key}", value, f"unknown key; use {', '.join(_TRAINING_FIELDS)}")
        try:
            if kind is tuple:
                parts = value.split("/") if isinstance(value, str) else list(value)
                out[key] = tuple(float(x) for x in parts)
            elif kind is int:
                out[key] = int(value)
            elif kind is float:
                out[key] = float(value)
            else:
                out[key] = str(value)
        except (TypeError, ValueError):
            raise BerthError(f"{field}.{key}", value, f"expected {kind.__name__}") from None
    try:
        return EngineTraining(**out)
    except BerthError as err:
        raise BerthError(f"{field}.{err.field.removeprefix('training.')}", err.value, err.problem) from None


def _check_training(t: EngineTraining) -> EngineTraining:
    checks = [
        ("train_steps", t.train_steps, isinstance(t.train_steps, int) and 0 < t.train_steps <= 1 << 31),
        ("lr", t.lr, 0 < t.lr < 1),
        ("min_lr", t.min_lr, 0 <= t.min_lr <= t.lr),
        ("warmup_steps", t.warmup_steps, isinstance(t.warmup_steps, int) and 0 <= t.warmup_steps < t.train_steps),
        ("decay", t.decay, t.decay in ("cosine", "linear")),
        ("weight_decay", t.weight_decay, 0 <= t.weight_decay < 1),
        ("betas", t.betas, len(t.betas) == 2 and all(0 <= b < 1 for b in t.betas)),
        ("adam_eps", t.adam_eps, 0 < t.adam_eps < 1),
        ("grad_clip", t.grad_clip, t.grad_clip >= 0),
        (
            "checkpoint_interval",
            t.checkpoint_interval,
            isinstance(t.checkpoint_interval, int) and t.checkpoint_interval > 0,
        ),
        ("checkpoint_dir", t.checkpoint_dir, bool(_SAFE_PATH.match(t.checkpoint_dir)) and ".." not in t.checkpoint_dir),
        ("data_split", t.data_split, bool(re.fullmatch(r"\d{1,6},\d{1,6},\d{1,6}", t.data_split))),
    ]
    for name, value, ok in checks:
        if not ok:
            raise BerthError(f"training.{name}", value, "out of range (docs/engines.md gives each option's range)")
    return t


# layout field -> (the one key it becomes, where the engine defines that key), per engine format. A key in
# parentheses is not an option: the engine derives it, or the format refuses the values it cannot express.
# Megatron paths are in Megatron-LM (arguments are generated from these dataclass fields by
# megatron/training/argument_utils.py; flags with add_argument are in megatron/training/arguments.py); DeepSpeed
# paths in the deepspeed package; torchtitan paths in the torchtitan package.
FIELD_SOURCES: dict[str, dict[str, tuple[str, str]]] = {
    "megatron": {
        "tp": ("--tensor-model-parallel-size", "megatron/core/model_parallel_config.py:55"),
        "cp": (
            "--context-parallel-size (ring attention: --cp-comm-type p2p, the default)",
            "megatron/core/model_parallel_config.py:100",
        ),
        "pp": ("--pipeline-model-parallel-size", "megatron/core/model_parallel_config.py:83"),
        "dp": ("(derived by Megatron: world size / (tp x cp x pp))", "megatron/core/parallel_state.py"),
        "ep": ("--expert-model-parallel-size", "megatron/core/model_parallel_config.py:127"),
        "expert_tp": (
            "--expert-tensor-parallel-size (tp when the layout leaves expert_tp out, Megatron's own default)",
            "megatron/core/model_parallel_config.py:130; megatron/training/arguments.py validate_args",
        ),
        "shard": (
            "--num-distributed-optimizer-instances",
            "megatron/core/distributed/distributed_data_parallel_config.py:34",
        ),
        "zero_stage": (
            "--use-distributed-optimizer (1); --use-megatron-fsdp --data-parallel-sharding-strategy "
            "optim_grads (2) / optim_grads_params (3)",
            "megatron/training/arguments.py:3156,3190; validate_args 1118-1169",
        ),
        "recompute": ("--recompute-granularity", "megatron/core/transformer/transformer_config.py:532"),
        "micro_batch_size": ("--micro-batch-size", "megatron/training/config/training_config.py:11"),
        "num_microbatches": (
            "--global-batch-size (num_microbatches = global / (micro x dp))",
            "megatron/training/config/training_config.py:15; megatron/core/num_microbatches_calculator.py:388",
        ),
        "virtual_stages": (
            "--num-layers-per-virtual-pipeline-stage (vpp = layers / pp / this)",
            "megatron/training/arguments.py:3114; validate_args 953-977",
        ),
        "schedule": (
            "(1F1B; interleaved when --num-layers-per-virtual-pipeline-stage is set)",
            "megatron/core/pipeline_parallel/schedules.py",
        ),
        "sequence_parallel": ("--sequence-parallel", "megatron/core/model_parallel_config.py:94"),
        "axis_order": ("--use-tp-pp-dp-mapping", "megatron/training/config/common_config.py:105"),
    },
    "deepspeed": {
        "tp": ("tensor_parallel.autotp_size", "deepspeed/runtime/tensor_parallel/config.py:45"),
        "cp": (
            "(none: refused above 1; Ulysses sequence parallelism splits heads, not ring attention)",
            "deepspeed/runtime/config.py:468",
        ),
        "pp": (
            "(PipelineModule(num_stages=pp) in the training script: the config's pipeline section sets no stage count)",
            "deepspeed/runtime/pipe/module.py:125",
        ),
        "dp": (
            "(derived: world size / (tp x pp); the batch check divides by mpu.get_data_parallel_world_size())",
            "deepspeed/runtime/config.py:458-463",
        ),
        "ep": (
            "expert_parallel.autoep_size (AutoEP replaces the MoE layers of a Hugging Face model of its presets)",
            "deepspeed/module_inject/auto_ep_config.py parse_autoep_config; deepspeed/runtime/config.py:171",
        ),
        "expert_tp": (
            "expert_parallel.expert_tensor_parallel_size (1 only: DeepSpeed 0.19.8 reserves other values)",
            "deepspeed/module_inject/auto_ep_folding.py validate_folding_global",
        ),
        "shard": ("(none: refused below dp; MiCS was removed)", "deepspeed/runtime/config.py:119"),
        "zero_stage": ("zero_optimization.stage", "deepspeed/runtime/zero/config.py:95"),
        "recompute": (
            "pipeline.activation_checkpoint_interval (pp > 1: the pipeline engine sets the PipelineModule's); "
            "deepspeed.checkpointing.checkpoint in the model (pp 1: the activation_checkpointing section only "
            "tunes it)",
            "deepspeed/runtime/pipe/engine.py:217; deepspeed/runtime/config.py:278",
        ),
        "micro_batch_size": ("train_micro_batch_size_per_gpu", "deepspeed/runtime/constants.py:59"),
        "num_microbatches": ("gradient_accumulation_steps", "deepspeed/runtime/constants.py:71"),
        "virtual_stages": ("(none: refused above 1)", "deepspeed/runtime/pipe/schedule.py"),
        "schedule": ("(DeepSpeed's 1F1B TrainSchedule)", "deepspeed/runtime/pipe/schedule.py"),
        "sequence_parallel": ("(none: refused)", "deepspeed/runtime/config.py"),
        "axis_order": ("(pipe-data-model topology: tp-dp-pp only)", "deepspeed/runtime/pipe/topology.py"),
    },
    "torchtitan": {
        "tp": ("parallelism.tensor_parallel_degree", "torchtitan/config/configs.py:157"),
        "cp": (
            "parallelism.context_parallel_degree (FSDP then shards over dp_shard x cp)",
            "torchtitan/config/configs.py:232; torchtitan/distributed/parallel_dims.py:278",
        ),
        "pp": ("parallelism.pipeline_parallel_degree", "torchtitan/config/configs.py:174"),
        "dp": ("parallelism.data_parallel_replicate_degree", "torchtitan/config/configs.py:113"),
        "ep": (
            "(none: mixture of experts refused; parallelism.expert_parallel_degree applies to torchtitan's own "
            "MoE models, not the Llama 3 builder berth writes)",
            "torchtitan/config/configs.py:282",
        ),
        "expert_tp": (
            "(none: mixture of experts refused; torchtitan 0.3's experts take no tensor parallelism of their own: "
            "its sparse mesh is efsdp x ep with efsdp = dp_shard x cp x tp / ep)",
            "torchtitan/distributed/parallel_dims.py:279; torchtitan/config/configs.py:279",
        ),
        "shard": ("parallelism.data_parallel_shard_degree", "torchtitan/config/configs.py:124"),
        "zero_stage": ("parallelism.fsdp_reshard_after_forward", "torchtitan/config/configs.py:136"),
        "recompute": (
            "activation_checkpoint (FullAC / SelectiveAC / None)",
            "torchtitan/trainer.py:108; torchtitan/distributed/activation_checkpoint.py:332",
        ),
        "micro_batch_size": (
            "parallelism.pipeline_parallel_microbatch_size (pp > 1) / training.local_batch_size",
            "torchtitan/config/configs.py:226,37",
        ),
        "num_microbatches": (
            "training.global_batch_size (accumulation = global / (local x dp))",
            "torchtitan/config/configs.py:43; torchtitan/trainer.py:415-433",
        ),
        "virtual_stages": (
            "parallelism.pipeline_parallel_layers_per_stage",
            "torchtitan/config/configs.py:203; torchtitan/distributed/pipeline_parallel.py:199-264",
        ),
        "schedule": ("parallelism.pipeline_parallel_schedule", "torchtitan/config/configs.py:210"),
        "sequence_parallel": ("parallelism.enable_sequence_parallel", "torchtitan/config/configs.py:160"),
        "axis_order": (
            "(mesh pp, dp_replicate, dp_shard, tp: tp-dp-pp only)",
            "torchtitan/distributed/parallel_dims.py",
        ),
    },
    "nanotron": {
        "tp": ("parallelism.tp", "src/nanotron/config/parallelism_config.py:31"),
        "cp": ("(none: refused; ParallelismArgs has dp, pp, tp and expert_parallel_size)", "parallelism_config.py"),
        "pp": ("parallelism.pp", "src/nanotron/config/parallelism_config.py:30"),
        "dp": ("parallelism.dp", "src/nanotron/config/parallelism_config.py:29"),
        "ep": ("(none: mixture of experts refused; LlamaForTraining is dense)", "src/nanotron/models/llama.py"),
        "expert_tp": ("(none: mixture of experts refused)", "src/nanotron/models/llama.py"),
        "shard": ("(the whole dp group: optim/zero.py shards over dp_pg)", "src/nanotron/optim/zero.py"),
        "zero_stage": ("optimizer.zero_stage (0 or 1)", "src/nanotron/config/config.py:315"),
        "recompute": ("parallelism.recompute_layer (whole layers)", "src/nanotron/config/parallelism_config.py:35"),
        "micro_batch_size": ("tokens.micro_batch_size", "src/nanotron/config/config.py:251"),
        "num_microbatches": ("tokens.batch_accumulation_per_replica", "src/nanotron/config/config.py:252"),
        "virtual_stages": ("(none: refused above 1; one chunk per rank)", "src/nanotron/models/base.py build_model"),
        "schedule": (
            "parallelism.pp_engine (afab = gpipe, 1f1b)",
            "src/nanotron/config/parallelism_config.py:32; config/utils_config.py:94",
        ),
        "sequence_parallel": (
            "parallelism.tp_mode (REDUCE_SCATTER with tp_linear_async_communication, as scaling_benchmarks.py sets)",
            "src/nanotron/config/parallelism_config.py:33-34",
        ),
        "axis_order": ("(ranks (ep, pp, dp, tp): tp-dp-pp only)", "src/nanotron/parallel/context.py"),
    },
}
# layout field -> the one key it becomes, per engine format
FIELD_KEYS: dict[str, dict[str, str]] = {
    fmt: {f: key for f, (key, _) in keys.items()} for fmt, keys in FIELD_SOURCES.items()
}

# Pipeline split arithmetic, per engine (what the artifacts set so that each engine builds the plan's stages):
# - Megatron: vpp = (num_layers [+1 with --account-for-embedding-in-pipeline-split] [+1 with
#   --account-for-loss-in-pipeline-split]) / pp / --num-layers-per-virtual-pipeline-stage (arguments.py:953-977);
#   berth sets neither account flag, so each virtual stage holds layers / (pp x vpp) decoder layers.
# - torchtitan: stages = ceil((num_layers + first_stage_less_layers + last_stage_less_layers) / layers_per_stage)
#   (pipeline_parallel.py _get_pipeline_metadata): the embedding and the output count as layers (1 each by
#   default). berth sets both to 0 and layers_per_stage = layers / (pp x vpp), so torchtitan builds pp x vpp
#   stages of equal layers, the embedding with the first and norm + output with the last (as the plan costs them).
# - DeepSpeed: PipelineModule(num_stages=pp, partition_method="type:<decoder layer>") balances the decoder layers
#   (module.py _partition_layers; "uniform" would count the embedding, norm and head among them).
# Uneven stages (specs/stages.py: pp x vpp does not divide the layers; the middle chunks hold k, the first and
# the last fewer) as each engine takes them (STAGE_SPLIT_SOURCES):
# - Megatron, vpp = 1: --decoder-first-pipeline-num-layers / --decoder-last-pipeline-num-layers; TransformerConfig
#   ("Uneven PP") checks that the rest divide evenly among the middle stages (k each). vpp > 1: Megatron's first/last
#   counts apply to every chunk of the first/last rank, not to the first/last chunk, so the chunks are written as
#   --pipeline-model-parallel-layout ("Et*f|(t*k|)*n,t*lL": E embedding, t a decoder layer, L the loss).
# - torchtitan: layers_per_stage = k and first/last_stage_less_layers = k - first, k - last: its generator gives
#   the first chunk k - (k - first) layers, the last k - (k - last), every other k, in ceil((L + both) / k) = pp x vpp
#   chunks. Even splits keep both at 0 (the same numbers as before).
# - DeepSpeed: refused (PipelineModule takes no per-stage counts; partition_method "uniform" puts the remainder on
#   the first stages).
STAGE_SPLIT_SOURCES = {
    "megatron": (
        "--decoder-first-pipeline-num-layers, --decoder-last-pipeline-num-layers (vpp = 1); "
        "--pipeline-model-parallel-layout (vpp > 1)",
        "megatron/training/arguments.py:3095-3111; megatron/core/transformer/transformer_config.py:2241-2345; "
        "megatron/core/transformer/pipeline_parallel_layer_layout.py parse_str_to_list",
    ),
    "torchtitan": (
        "parallelism.pipeline_parallel_layers_per_stage with pipeline_parallel_first_stage_less_layers and "
        "pipeline_parallel_last_stage_less_layers",
        "torchtitan/config/configs.py (ParallelismConfig); torchtitan/distributed/pipeline_parallel.py "
        "_get_pipeline_metadata, _generate_llm_fqn_per_model_part",
    ),
    "deepspeed": (
        "(none: refused; PipelineModule partition_method has no per-stage counts)",
        "deepspeed/runtime/pipe/module.py _partition_layers; deepspeed/runtime/utils.py partition_uniform",
    ),
}


def artifacts(
    plan: Plan,
    fmt: str,
    plan_file: str = "plan.json",
    steps: int = 20,
    warmup: int = 3,
    image: str = DEFAULT_IMAGE,
    port: int = DEFAULT_PORT,
    training: EngineTraining | None = None,
) -> dict[str, str]:
    """File name -> content of the launch artifacts of `plan` in `fmt` (one of LAUNCH_FORMATS); `training`: the
    engine formats' optimizer, length, schedule and checkpointing (EngineTraining's defaults when None)."""
    spec = LAUNCH_FORMATS.get(fmt) if isinstance(fmt, str) else None
    if spec is None:
        raise BerthError("format", fmt, f"use one of {', '.join(FORMATS)}")
    if plan.prediction is None or plan.infeasible_reason:
        raise BerthError("plan", plan.layout.short(), f"not launchable: {plan.infeasible_reason or 'no prediction'}")
    if spec.runs_executor:
        try:
            _IMAGE.validate_python(image)
        except ValidationError as err:
            raise BerthError("image", image, err.errors()[0]["msg"]) from None
    return spec.build(plan, LaunchOptions(plan_file, steps, warmup, image, port, training or EngineTraining()))


_IMAGE = TypeAdapter(ImageName)


def _stages() -> ModuleType:
    """berth.specs.stages, imported at first use: it loads numpy, and the CLI reads LAUNCH_FORMATS at start-up."""
    from berth.specs import stages

    return stages


def _comment(value: object) -> str:
    """A value shown in a script comment: on one line whatever it holds (a newline would end the
    comment and start a command)."""
    return str(value).encode("unicode_escape").decode("ascii")


def _job_name(name: str) -> str:
    """A Slurm job name (read by sbatch from its #SBATCH line, not by a shell): safe characters only."""
    return re.sub(r"[^A-Za-z0-9_.-]", "-", name)[:64]


def _k8s_name(name: str) -> str:
    """An RFC 1123 label (Kubernetes object names): lower-case letters, digits and '-', at most 63
    characters with room for the '-plan' suffix, starting and ending with an alphanumeric."""
    label = re.sub(r"[^a-z0-9-]+", "-", f"berth-{name}".lower())[:50].strip("-")
    return label or "berth"


class _Run:
    """A torchrun launch of the bundled executor for this plan. Every value that reaches a shell
    is quoted with shlex.quote, whatever the spec's own validation already allowed."""

    def __init__(self, plan: Plan, plan_file: str, steps: int, warmup: int, port: int):
        self.plan, self.plan_file, self.steps, self.warmup, self.port = plan, plan_file, steps, warmup, port
        c = plan.cluster
        self.nodes = plan.layout.world_size // c.gpus_per_node if plan.layout.world_size >= c.gpus_per_node else 1
        self.per_node = min(plan.layout.world_size, c.gpus_per_node)
        self.hosts = list(c.hosts) or [f"node{n}" for n in range(self.nodes)]
        self.env = {"BERTH_COLLECTIVE_TIMEOUT_S": "600", "PYTHONUNBUFFERED": "1"}
        if c.device.kind == "cpu":
            self.env["BERTH_DEVICE"] = "cpu"

    def worker_args(self) -> list[str]:
        return [
            "-m",
            "berth.executor.worker",
            "--plans",
            self.plan_file,
            "--steps",
            str(self.steps),
            "--warmup",
            str(self.warmup),
            "--out",
            "result.json",
            "--report",
            "report.json",
        ]

    def torchrun_scripts(self) -> dict[str, str]:
        files = {}
        for n in range(self.nodes):
            args = [
                "torchrun",
                f"--nnodes={self.nodes}",
                f"--nproc-per-node={self.per_node}",
                f"--node-rank={n}",
                "--rdzv-backend=static",
            ]
            worker = " ".join(shlex.quote(a) for a in args)
            files[f"node{n}.sh"] = "\n".join(
                [
                    "#!/bin/sh",
                    f"# berth launch (torchrun): node {n} of {self.nodes}, host {_comment(self.hosts[n])}; ranks "
                    f"{n * self.per_node}..{(n + 1) * self.per_node - 1} (plan placement: rank = node x "
                    f"{self.per_node} + local GPU, axis order {_comment(self.plan.layout.axis_order)})",
                    "# run beside the plan file where berth is installed with torch (pip install -e "
                    "'.[executor]' in its checkout); node 0 writes report.json",
                    "set -e",
                    *(f"export {k}={shlex.quote(v)}" for k, v in self.env.items()),
                    f'if [ -z "${{MASTER_ADDR:-}}" ]; then MASTER_ADDR={shlex.quote(self._master())}; fi',
                    f'if [ -z "${{MASTER_PORT:-}}" ]; then MASTER_PORT={int(self.port)}; fi',
                    f'{worker} --master-addr="$MASTER_ADDR" --master-port="$MASTER_PORT" '
                    + " ".join(shlex.quote(a) for a in self.worker_args()),
                    "",
                ]
            )
        files[self.plan_file] = json.dumps([self.plan.model_dump(mode="json")])
        return files

    def _master(self) -> str:
        return "127.0.0.1" if self.nodes == 1 else self.hosts[0]

    def sbatch(self) -> dict[str, str]:
        exports = " ".join(shlex.quote(f"{k}={v}") for k, v in self.env.items())
        # the inner shell expands SLURM_NODEID (per task) and MASTER_ADDR (exported below)
        torchrun = " ".join(
            [
                "torchrun",
                f"--nnodes={self.nodes}",
                f"--nproc-per-node={self.per_node}",
                '--node-rank="$SLURM_NODEID"',
                "--rdzv-backend=static",
                '--master-addr="$MASTER_ADDR"',
                f"--master-port={int(self.port)}",
                *map(shlex.quote, self.worker_args()),
            ]
        )
        gpu = "" if self.plan.cluster.device.kind == "cpu" else f"#SBATCH --gpus-per-node={self.per_node}\n"
        script = (
            "#!/bin/bash\n"
            f"#SBATCH --job-name=berth-{_job_name(self.plan.model.name)}\n"
            f"#SBATCH --nodes={self.nodes}\n"
            "#SBATCH --ntasks-per-node=1\n"
            f"{gpu}"
            "#SBATCH --exclusive\n"
            f"# plan: {_comment(self.plan.layout.short())}; SLURM_NODEID n runs ranks n x {self.per_node} + local "
            "GPU, the plan's rank map (nodes in the allocation's sorted order)\n"
            "set -euo pipefail\n"
            'export MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)\n'
            f"srun --kill-on-bad-exit=1 env {exports} bash -c {shlex.quote(torchrun)}\n"
        )
        return {"berth.sbatch": script, self.plan_file: json.dumps([self.plan.model_dump(mode="json")])}

    def pytorchjob(self, image: str) -> dict[str, str]:
        name = _k8s_name(self.plan.model.name)
        env = [{"name": k, "value": v} for k, v in self.env.items()]
        container: dict[str, Any] = {
            "name": "pytorch",
            "image": image,
            "workingDir": "/app",
            "command": ["torchrun", *self.worker_args()],
            "env": env,
            "volumeMounts": [{"name": "plan", "mountPath": "/app/plan.json", "subPath": "plan.json"}],
        }
        if self.plan.cluster.device.kind == "gpu":
            container["resources"] = {"limits": {"nvidia.com/gpu": self.per_node}}
        pod = {
            "spec": {"containers": [container], "volumes": [{"name": "plan", "configMap": {"name": f"{name}-plan"}}]}
        }
        # rank 0 (the Master) writes the report onto a PersistentVolumeClaim that outlives the pod; only the
        # Master mounts it (a ReadWriteOnce claim attaches to one node)
        master = json.loads(json.dumps(pod))
        master_container = master["spec"]["containers"][0]
        master_container["command"] = [
            REPORT_DIR + "/report.json" if a == "report.json" else a for a in master_container["command"]
        ]
        master_container["volumeMounts"].append({"name": "report", "mountPath": REPORT_DIR})
        master["spec"]["volumes"].append({"name": "report", "persistentVolumeClaim": {"claimName": f"{name}-report"}})
        replicas = {"Master": {"replicas": 1, "restartPolicy": "OnFailure", "template": master}}
        if self.nodes > 1:
            replicas["Worker"] = {"replicas": self.nodes - 1, "restartPolicy": "OnFailure", "template": pod}
        job = {
            "apiVersion": "kubeflow.org/v1",
            "kind": "PyTorchJob",
            "metadata": {"name": name},
            "spec": {"nprocPerNode": str(self.per_node), "pytorchReplicaSpecs": replicas},
        }
        config_map = {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {"name": f"{name}-plan"},
            "data": {"plan.json": json.dumps([self.plan.model_dump(mode="json")])},
        }
        claim = {
            "apiVersion": "v1",
            "kind": "PersistentVolumeClaim",
            "metadata": {"name": f"{name}-report"},
            "spec": {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "16Mi"}}},
        }
        # a pod that mounts the claim after the job, to copy the report out: see docs/guide.md (Launch a plan)
        reader = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": f"{name}-report-reader"},
            "spec": {
                "restartPolicy": "Never",
                "containers": [
                    {
                        "name": "reader",
                        "image": REPORT_READER_IMAGE,
                        "command": ["sleep", "3600"],
                        "volumeMounts": [{"name": "report", "mountPath": REPORT_DIR}],
                    }
                ],
                "volumes": [{"name": "report", "persistentVolumeClaim": {"claimName": f"{name}-report"}}],
            },
        }
        # JSON is YAML: kubectl apply -f takes either
        return {
            "pytorchjob.yaml": json.dumps(job, indent=2) + "\n",
            "plan-configmap.yaml": json.dumps(config_map) + "\n",
            "report-pvc.yaml": json.dumps(claim, indent=2) + "\n",
            "report-reader.yaml": json.dumps(reader, indent=2) + "\n",
        }


def _header(fmt: str, plan: Plan) -> list[str]:
    name = re.sub(r"[^A-Za-z0-9._-]", "_", plan.model.name)  # a comment line in shell and Python: no quotes, no newline
    return [f"# berth plan {plan.layout.short()} for {name}: {fmt} artifact for {ENGINE_VERSIONS[fmt]}"]


# What a user must still supply, per engine: (placeholder, what it is). Artifacts reference them as ${NAME} and
# fail with the description when one is unset (never a silent default). Descriptions hold no quote characters:
# they sit inside "${NAME:?description}".
MEGATRON_INPUTS = {
    "MEGATRON_LM": "a Megatron-LM checkout at the targeted version (pretrain_gpt.py is run from it)",
    "TOKENIZER_MODEL": "the tokenizer (a Hugging Face name or directory) whose vocabulary the plan assumes",
    "DATA_PATH": "the Megatron indexed dataset prefix (tools/preprocess_data.py output, without .bin/.idx)",
}
# Megatron's Llama 3.x rope scaling takes only the factor (--rope-scaling-factor): the other three numbers are
# fixed (megatron/core/models/common/embeddings/rotary_pos_embedding.py RotaryEmbedding._apply_scaling)


def _megatron_stage_args(num_layers: int, pp: int, vpp: int) -> list[tuple[str, object]]:
    """The pipeline split as Megatron arguments (STAGE_SPLIT_SOURCES): nothing for an even split without
    virtual stages, --num-layers-per-virtual-pipeline-stage for an even interleaved one, the first and last
    stage's layers for an uneven one, the whole chunk layout for an uneven interleaved one."""
    if _stages().is_even(num_layers, pp, vpp):
        return [("--num-layers-per-virtual-pipeline-stage", num_layers // (pp * vpp))] if vpp > 1 else []
    chunks = _stages().chunk_layers(num_layers, pp, vpp)
    if vpp == 1:
        return [("--decoder-first-pipeline-num-layers", chunks[0]), ("--decoder-last-pipeline-num-layers", chunks[-1])]
    middle = f"(t*{chunks[1]}|)*{len(chunks) - 2}," if len(chunks) > 2 else ""
    return [("--pipeline-model-parallel-layout", f"Et*{chunks[0]}|{middle}t*{chunks[-1]}L")]


# Mixture-of-experts arguments (MEGATRON_MOE_SOURCES): the layout's ep, the experts' tensor parallelism
# (Layout.etp: expert_tp, tp where the layout leaves it out, Megatron's default; 1 for MoE parallel folding), the
# all-to-all token dispatcher the cost model prices, grouped GEMMs, and the model's expert shape.
MEGATRON_MOE_SOURCES = {
    "--num-experts": "megatron/training/arguments.py:3518",
    "--moe-router-topk": "megatron/core/transformer/transformer_config.py:760",
    "--moe-ffn-hidden-size": "megatron/core/transformer/transformer_config.py:740",
    "--moe-shared-expert-intermediate-size": "megatron/core/transformer/transformer_config.py:701",
    "--moe-layer-freq": "megatron/training/arguments.py:327,3520 (a Python list pattern, 0 dense, 1 MoE)",
    "--expert-model-parallel-size": "megatron/core/model_parallel_config.py:127",
    "--expert-tensor-parallel-size": "megatron/core/model_parallel_config.py:130",
    "--moe-token-dispatcher-type": "megatron/core/transformer/transformer_config.py:891",
    "--moe-grouped-gemm": "megatron/core/transformer/transformer_config.py:850",
}


def _megatron_fp8_args(t: TrainingSpec, x: Layout) -> list[tuple[str, Any]]:
    """TrainingSpec.fp8 as Megatron-LM's flags (megatron/core/transformer/transformer_config.py fp8, fp8_recipe,
    fp8_amax_*; Transformer Engine runs them): E4M3 forward and E5M2 gradients ('hybrid'), the recipe, bf16 gradient
    reduction and NeMo's amax history for delayed scaling as NeMo's FP8 performance recipes run them
    (EngineInfo.fp8_grads_bf16), and FP8 parameters where the distributed optimizer runs
    (--fp8-param-gather, EngineInfo.fp8_params_from_zero: the memory model counts no weight cache there)."""
    if t.fp8 is None:
        return []
    args: list[tuple[str, Any]] = [("--fp8-format", "hybrid"), ("--fp8-recipe", t.fp8), ("--grad-reduce-in-bf16", None)]
    if t.fp8 == "delayed":
        args += [("--fp8-amax-history-len", 1024), ("--fp8-amax-compute-algo", "max")]
    if x.zero_stage >= ENGINES["megatron"].fp8_params_from_zero:
        args.append(("--fp8-param-gather", None))
    return args


def _megatron_moe_args(m, x) -> list[tuple[str, object]]:
    if not m.is_moe:
        return []
    args: list[tuple[str, object]] = [
        ("--num-experts", m.num_experts),
        ("--moe-router-topk", m.experts_per_token),
        ("--moe-ffn-hidden-size", m.expert_ffn),
        ("--expert-model-parallel-size", x.ep),
        ("--expert-tensor-parallel-size", x.etp),
        ("--moe-token-dispatcher-type", "alltoall"),
        ("--moe-grouped-gemm", None),
    ]
    if m.num_shared_experts:
        args.append(("--moe-shared-expert-intermediate-size", m.num_shared_experts * m.shared_ffn))
    if m.first_k_dense:
        args.append(("--moe-layer-freq", f"([0]*{m.first_k_dense}+[1]*{m.num_moe_layers})"))
    return args


def _vocab_divisor(vocab: int, tp: int) -> int:
    """--make-vocab-size-divisible-by so that Megatron's padded vocabulary (a multiple of this x tp,
    megatron/training/tokenizer: _vocab_size_with_padding) is the model's own, as the plan counts it; where tp does
    not divide the vocabulary no value can (Megatron pads to the next multiple of tp)."""
    return math.gcd(vocab // tp, MEGATRON_VOCAB_DIVISOR) if vocab % tp == 0 else 1


@dataclass(frozen=True)
class _Env:
    """A placeholder the user supplies: written as "${NAME}" in a script (expanded there), never quoted away."""

    name: str


def _shell_args(args: list[tuple[str, object]]) -> list[str]:
    """Command-line arguments as shell words, one per line: every value through shlex.quote (the one place
    Megatron's values reach a shell), a placeholder as a double-quoted expansion."""
    out = []
    for flag, value in args:
        if value is None:
            out.append(flag)
        elif isinstance(value, _Env):
            out.append(f'{flag} "${{{value.name}}}"')
        else:
            out.append(f"{flag} {shlex.quote(str(value))}")
    return out


def _megatron_env(x) -> list[str]:
    """The launch's environment lines. validate_args (megatron/training/arguments.py): with tp > 1 or cp > 1 on a
    GPU before Blackwell, CUDA_DEVICE_MAX_CONNECTIONS must be 1 (communication kernels queued in order so they
    overlap), except under Megatron FSDP, which asserts it is not 1."""
    if x.tp == 1 and x.cp == 1:
        return []
    if x.zero_stage >= 2:
        return ["unset CUDA_DEVICE_MAX_CONNECTIONS  # Megatron FSDP: validate_args wants it other than 1"]
    return ["export CUDA_DEVICE_MAX_CONNECTIONS=1  # tp or cp > 1: validate_args requires it (before Blackwell)"]


def megatron_args(plan: Plan, run: EngineTraining | None = None) -> dict[str, str]:
    """Megatron-LM pretrain_gpt.py arguments for the layout, the whole model and the training run, and a torchrun
    launch.

    ZeRO-1 is the distributed optimizer; ZeRO-2/3 are Megatron FSDP with sharding strategy optim_grads /
    optim_grads_params (validate_args makes the distributed optimizer and needs --ckpt-format fsdp_dtensor).
    """
    run = run or EngineTraining()
    x, m, t = plan.layout, plan.model, plan.training
    reason = _engine_refusal("megatron", plan)
    if reason:
        raise LaunchRefused("megatron", reason)
    fsdp = x.zero_stage >= 2
    args: list[tuple[str, object]] = [
        ("--tensor-model-parallel-size", x.tp),
        ("--pipeline-model-parallel-size", x.pp),
        ("--micro-batch-size", x.micro_batch_size),
        ("--global-batch-size", t.global_batch_size),
    ]
    if x.cp > 1:
        args.append(("--context-parallel-size", x.cp))
    args += _megatron_stage_args(m.num_layers, x.pp, x.virtual_stages)
    if x.sequence_parallel:
        args.append(("--sequence-parallel", None))
    if x.recompute != "none":
        args.append(("--recompute-granularity", x.recompute))
        if x.recompute == "full":
            args += [("--recompute-method", "uniform"), ("--recompute-num-layers", 1)]
    if x.dp > 1 and not fsdp:  # the overlap the megatron entry prices (grad_reduce_exposed, param_gather_exposed 0):
        # both flags default off (arguments.py), and without them the reduce and the gather block (Megatron FSDP
        # overlaps by itself)
        args.append(("--overlap-grad-reduce", None))
        if x.zero_stage == 1:
            args.append(("--overlap-param-gather", None))
    if x.zero_stage == 1:
        args.append(("--use-distributed-optimizer", None))
        if x.shard < x.dp:
            args.append(("--num-distributed-optimizer-instances", x.dp // x.shard))
    elif fsdp:
        args += [
            ("--use-megatron-fsdp", None),
            ("--use-distributed-optimizer", None),
            ("--data-parallel-sharding-strategy", "optim_grads" if x.zero_stage == 2 else "optim_grads_params"),
            ("--ckpt-format", "fsdp_dtensor"),
        ]
    if x.axis_order == "tp-pp-dp":
        args.append(("--use-tp-pp-dp-mapping", None))
    # the whole model: berth's models are decoder-only with rotary positions and no linear biases but the qkv
    # ones a model names (the parameter count specs/tree.py uses)
    args += [
        ("--num-layers", m.num_layers),
        ("--hidden-size", m.hidden_size),
        ("--ffn-hidden-size", m.ffn_hidden_size),
        ("--num-attention-heads", m.num_attention_heads),
        ("--seq-length", t.seq_len),
        ("--max-position-embeddings", t.seq_len),
        ("--position-embedding-type", "rope"),
        ("--rotary-base", _number(m.rope_theta)),
        ("--disable-bias-linear", None),
        ("--normalization", "RMSNorm" if m.norm == "rmsnorm" else "LayerNorm"),
        ("--norm-epsilon", _number(m.norm_eps)),
        ("--make-vocab-size-divisible-by", _vocab_divisor(m.vocab_size, x.tp)),
    ]
    if m.rope_scaling is not None:
        args += [("--use-rope-scaling", None), ("--rope-scaling-factor", _number(m.rope_scaling.factor))]
    if m.qkv_bias:
        args.append(("--add-qkv-bias", None))
    if not m.dropout:  # pre-training without dropout (Megatron's default is 0.1)
        args += [("--attention-dropout", 0), ("--hidden-dropout", 0)]
    if t.precision != "fp32":
        args.append((f"--{t.precision}", None))
    args += _megatron_fp8_args(t, x)
    if m.kv_heads != m.num_attention_heads:
        args += [("--group-query-attention", None), ("--num-query-groups", m.kv_heads)]
    if m.mlp == "swiglu":
        args.append(("--swiglu", None))
    args += _megatron_moe_args(m, x)
    if not m.tied_embeddings:
        args.append(("--untie-embeddings-and-output-weights", None))
    if t.flash_attention:
        args.append(("--attention-backend", "flash"))
    b1, b2 = run.betas
    args += [  # the training run (EngineTraining)
        ("--train-iters", run.train_steps),
        ("--log-interval", 1),  # each iteration's line, which `berth calibrate --log` reads (Megatron's default: 100)
        ("--optimizer", "adam"),  # Megatron's adam is AdamW (decoupled weight decay)
        ("--lr", _number(run.lr)),
        ("--min-lr", _number(run.min_lr)),
        ("--lr-decay-style", run.decay),
        ("--lr-warmup-iters", run.warmup_steps),
        ("--lr-decay-iters", run.train_steps),
        ("--weight-decay", _number(run.weight_decay)),
        ("--adam-beta1", _number(b1)),
        ("--adam-beta2", _number(b2)),
        ("--adam-eps", _number(run.adam_eps)),
        ("--clip-grad", _number(run.grad_clip)),
        ("--save", run.checkpoint_dir),
        ("--load", run.checkpoint_dir),
        ("--save-interval", run.checkpoint_interval),
        ("--split", run.data_split),
        ("--tokenizer-type", "HuggingFaceTokenizer"),
        ("--tokenizer-model", _Env("TOKENIZER_MODEL")),
        ("--data-path", _Env("DATA_PATH")),
    ]
    lines = _shell_args(args)
    notes = [
        *_header("megatron", plan),
        f"# whole model (vocabulary {m.vocab_size}: the tokenizer's must match; rotary base {_number(m.rope_theta)}), "
        f"{run.train_steps} steps of AdamW, checkpoints every {run.checkpoint_interval} steps in "
        f"{_comment(run.checkpoint_dir)}",
        "# still to supply: " + "; ".join(f"${{{k}}}: {v}" for k, v in MEGATRON_INPUTS.items() if k != "MEGATRON_LM"),
    ]
    env = _megatron_env(x)
    c = plan.cluster
    nodes = max(1, x.world_size // c.gpus_per_node)
    per_node = min(x.world_size, c.gpus_per_node)
    script = "\n".join(
        [
            "#!/bin/bash",
            *_header("megatron", plan),
            notes[1],
            f"# run on every node with NODE_RANK set (0 .. {nodes - 1}), MASTER_ADDR the first node",
            "set -euo pipefail",
            *(f': "${{{k}:?set {k} to {v}}}"' for k, v in MEGATRON_INPUTS.items()),
            *env,
            f'torchrun --nnodes={nodes} --nproc-per-node={per_node} --node-rank="${{NODE_RANK:-0}}" '
            f'--master-addr="${{MASTER_ADDR:-127.0.0.1}}" --master-port="${{MASTER_PORT:-{DEFAULT_PORT}}}" \\',
            '    "$MEGATRON_LM/pretrain_gpt.py" \\',
            " \\\n".join("    " + line for line in lines),
            "",
        ]
    )
    return {
        "megatron-args.txt": "\n".join([*notes, *(f"# environment: {e}" for e in env), " \\\n".join(lines)]) + "\n",
        "megatron-launch.sh": script,
    }


def _number(value: float) -> str:
    """A number as an engine reads it back exactly: integers without a fraction, the rest in repr form."""
    return str(int(value)) if float(value).is_integer() and abs(value) < 1e15 else repr(float(value))


# DeepSpeed's AutoEP (deepspeed/module_inject/auto_ep_presets/registry.py): the Hugging Face MoE families whose
# expert layers it finds and replaces; the training script's model must be one of them
DEEPSPEED_AUTOEP_PRESETS = ("mixtral", "qwen3_moe", "qwen3_5_moe", "deepseek_v2", "deepseek_v3", "minimax_m3")


def _deepspeed_schedule(run: EngineTraining) -> dict[str, Any]:
    """The LR schedule as a DeepSpeed scheduler (deepspeed/runtime/lr_schedules.py): cosine is WarmupCosineLR
    (warmup from 0, cosine to min_lr / lr); linear is WarmupDecayLR, which decays to 0."""
    params: dict[str, Any]
    if run.warmup_steps < 1:  # both schedulers raise on it (lr_schedules.py: "must be a positive integer")
        raise LaunchRefused("deepspeed", _refuse("deepspeed", "warmup_steps 0: its LR schedulers need at least 1"))
    if run.decay == "cosine":
        params = {
            "total_num_steps": run.train_steps,
            "warmup_num_steps": run.warmup_steps,
            "warmup_min_ratio": 0.0,
            "cos_min_ratio": run.min_lr / run.lr,
            "warmup_type": "linear",  # its default is "log"; the run's warmup is linear, as every other format's
        }
        return {"type": "WarmupCosineLR", "params": params}
    if run.min_lr:
        raise LaunchRefused(
            "deepspeed",
            _refuse("deepspeed", f"decay linear with min_lr {run.min_lr}: WarmupDecayLR decays to 0 (use min_lr 0)"),
        )
    params = {
        "total_num_steps": run.train_steps,
        "warmup_num_steps": run.warmup_steps,
        "warmup_min_lr": 0.0,
        "warmup_max_lr": run.lr,
        "warmup_type": "linear",
    }
    return {"type": "WarmupDecayLR", "params": params}


def deepspeed_config(plan: Plan, run: EngineTraining | None = None) -> dict[str, str]:
    """A DeepSpeed config JSON for the layout and the training run, a hostfile for more than one node, and the
    launch (with the notes on what the training script must do)."""
    run = run or EngineTraining()
    x, t, m = plan.layout, plan.training, plan.model
    reason = _engine_refusal("deepspeed", plan)
    if reason:
        raise LaunchRefused("deepspeed", reason)
    b1, b2 = run.betas
    config: dict[str, Any] = {
        "train_batch_size": t.global_batch_size,
        "train_micro_batch_size_per_gpu": x.micro_batch_size,
        "gradient_accumulation_steps": x.num_microbatches,
        "zero_optimization": {"stage": x.zero_stage},
        "optimizer": {
            "type": "AdamW",
            # torch_adam: torch.optim.AdamW (engine.py get_optimizer_configuration), not FusedAdam, which DeepSpeed
            # compiles (JIT) on first use
            "params": {
                "lr": run.lr,
                "betas": [b1, b2],
                "eps": run.adam_eps,
                "weight_decay": run.weight_decay,
                "torch_adam": True,
            },
        },
        "scheduler": _deepspeed_schedule(run),
        "gradient_clipping": run.grad_clip,
    }
    if t.precision == "bf16":
        config["bf16"] = {"enabled": True}
        if x.zero_stage == 1:  # fp32 accumulation, as the recipe has it: engine.py _do_optimizer_sanity_check then
            # takes BF16_Optimizer (fp32 gradients, fp32 master and Adam state over dp); unset, it accumulates in bf16
            config["data_types"] = {"grad_accum_dtype": "fp32"}
    elif t.precision == "fp16":
        config["fp16"] = {"enabled": True}
    if x.tp > 1:
        config["tensor_parallel"] = {"autotp_size": x.tp}
    if m.is_moe:
        config["expert_parallel"] = {"enabled": True, "autoep_size": x.ep, "expert_tensor_parallel_size": 1}
    if x.recompute == "full":
        if x.pp > 1:  # the pipeline engine sets PipelineModule.activation_checkpoint_interval from it (pipe/engine.py)
            config["pipeline"] = {"activation_checkpoint_interval": 1}
        else:
            config["activation_checkpointing"] = {"partition_activations": False}
    c = plan.cluster
    nodes = max(1, x.world_size // c.gpus_per_node)
    per_node = min(x.world_size, c.gpus_per_node)
    files: dict[str, str] = {}
    hostfile = ""
    if nodes > 1:
        hosts = list(c.hosts)[:nodes] if len(c.hosts) >= nodes else [f"node{n}" for n in range(nodes)]
        placeholder = len(c.hosts) < nodes
        files["hostfile"] = "\n".join(
            [
                f"# berth: the {nodes} nodes, {per_node} GPU slots each (DeepSpeed's hostfile: 'host slots=N' a line)"
                + (
                    "; node0.. are placeholders: write your hosts' names (reachable by ssh without a password)"
                    if placeholder
                    else ""
                ),
                *(f"{_host(h)} slots={per_node}" for h in hosts),
                "",
            ]
        )
        hostfile = "--hostfile hostfile "
    notes = [
        "#!/bin/bash",
        *_header("deepspeed", plan),
        f"# ds_config.json holds the batch ({t.global_batch_size} = micro {x.micro_batch_size} x accumulation "
        f"{x.num_microbatches} x dp {x.dp}), ZeRO stage {x.zero_stage}, precision {t.precision}, AdamW (lr {run.lr}) "
        f"and its {run.decay} schedule over {run.train_steps} steps; the rest of the plan is in the training script:",
        f"# - the model: {m.num_layers} layers, hidden {m.hidden_size}, ffn {m.ffn_hidden_size}, "
        f"{m.num_attention_heads} heads ({m.kv_heads} kv), vocabulary {m.vocab_size}, sequence {t.seq_len}, rotary "
        f"base {_number(m.rope_theta)}, norm epsilon {m.norm_eps}",
        f"# - train {run.train_steps} steps (the scheduler's total_num_steps); every {run.checkpoint_interval} steps "
        f"engine.save_checkpoint({run.checkpoint_dir!r}); resume with engine.load_checkpoint({run.checkpoint_dir!r})",
    ]
    if x.pp > 1:
        notes.append(
            f"# - pp {x.pp}: build the model as deepspeed.pipe.PipelineModule(layers, num_stages={x.pp}, "
            "partition_method='type:YourDecoderLayer') (its decoder layers split evenly, as planned: 'uniform' counts "
            "the embedding, norm and head as layers too) and train with engine.train_batch() (the config's pipeline "
            "section sets "
            "no stages"
            + (
                "; its activation_checkpoint_interval 1 recomputes every layer: pass "
                "checkpointable_layers=[your decoder layer's class name] so the embedding is not recomputed"
                if x.recompute == "full"
                else ""
            )
            + ")"
        )
    if x.recompute == "full" and x.pp == 1:
        notes.append(
            "# - recompute full: wrap each decoder layer's forward in deepspeed.checkpointing.checkpoint "
            "(the activation_checkpointing section only tunes it; nothing in the config turns it on)"
        )
    if x.tp > 1:
        notes.append(
            f"# - tp {x.tp}: AutoTP shards a Hugging Face-style model (tensor_parallel.autotp_size); pass "
            "deepspeed.initialize an mpu (model parallel unit, as in the AutoTP training tutorial) whose "
            f"get_data_parallel_world_size() is {x.dp}: without one DeepSpeedConfig counts all "
            f"{x.world_size} ranks as data parallel and its batch check fails (runtime/config.py:458-471)"
        )
    if m.is_moe:
        notes.append(
            f"# - experts: AutoEP (expert_parallel, ep {x.ep}) replaces the MoE layers of a Hugging Face model of "
            f"one of its presets ({', '.join(DEEPSPEED_AUTOEP_PRESETS)})"
        )
    notes += [
        "set -euo pipefail",
        ': "${TRAIN_SCRIPT:?set TRAIN_SCRIPT to your DeepSpeed training script '
        '(it must call deepspeed.initialize with config=ds_config.json)}"',
        f'deepspeed {hostfile}--num_nodes {nodes} --num_gpus {per_node} "$TRAIN_SCRIPT" --deepspeed '
        "--deepspeed_config ds_config.json",
        "",
    ]
    return {"ds_config.json": json.dumps(config, indent=2) + "\n", "deepspeed-launch.sh": "\n".join(notes), **files}


def _host(name: str) -> str:
    """A host name in DeepSpeed's hostfile (split on spaces by its parser): safe characters only."""
    return re.sub(r"[^A-Za-z0-9_.:-]", "-", name)[:253] or "node"


TORCHTITAN_SCHEDULES = {"gpipe": "GPipe", "1f1b": "1F1B", "interleaved_1f1b": "Interleaved1F1B"}
TORCHTITAN_INPUTS = {
    "BERTH_HF_ASSETS": "the directory with the Hugging Face tokenizer files of the model (torchtitan hf_assets_path)",
    "BERTH_DATASET": "a dataset name the torchtitan HuggingFaceTextDataLoader knows (e.g. c4)",
}


def _torchtitan_split_note(num_layers: int, pp: int, vpp: int) -> str:
    chunks = _stages().chunk_layers(num_layers, pp, vpp)
    if len(set(chunks)) == 1:
        return (
            f"torchtitan counts the embedding and the output as layers\n(first/last_stage_less_layers, 1 each by "
            f"default); both are 0 here and layers_per_stage = {num_layers} / (pp {pp} x vpp {vpp}), so it builds"
            f"\nthe plan's {pp * vpp} stage(s) of equal layers."
        )
    k = max(chunks)
    return (
        f"{len(chunks)} stages of {chunks[0]}, {k} x{len(chunks) - 2}, {chunks[-1]} decoder layers\n"
        f"(layers_per_stage = {k}; first/last_stage_less_layers = {k - chunks[0]}, {k - chunks[-1]}: "
        "torchtitan's split gives those two stages that many\nlayers fewer), the embedding with the first and "
        "norm + output with the last."
    )


def torchtitan_config(plan: Plan, run: EngineTraining | None = None) -> dict[str, str]:
    """A torchtitan 0.3 configuration: a Python module whose function returns the Trainer.Config (torchtitan 0.3
    selects a job with --module/--config; TOML job files are gone), and the torchrun launch."""
    run = run or EngineTraining()
    x, t, m = plan.layout, plan.training, plan.model
    reason = _engine_refusal("torchtitan", plan)
    if reason:
        raise LaunchRefused("torchtitan", reason)
    shard = x.shard if x.zero_stage else 1
    local = x.micro_batch_size * (x.num_microbatches if x.pp > 1 else 1)
    parallelism: dict[str, Any] = {
        "data_parallel_replicate_degree": x.dp // shard,
        "data_parallel_shard_degree": shard,
        "tensor_parallel_degree": x.tp,
        "enable_sequence_parallel": x.sequence_parallel,
        "pipeline_parallel_degree": x.pp,
    }
    # DTensor on the model-parallel axes and FSDP2 over dp: the path torchtitan's dry run builds on CPU (its
    # default "spmd_types" backend stops in fully_shard there: parameters not DTensors on the full mesh)
    parallelism["spmd_backend"] = "partial_dtensor"
    if x.cp > 1:
        parallelism["context_parallel_degree"] = x.cp  # its "headtail" load balancer: berth's 2 cp chunk split
    if x.zero_stage >= 2:
        parallelism["fsdp_reshard_after_forward"] = "always" if x.zero_stage == 3 else "never"
    chunks = _stages().chunk_layers(m.num_layers, x.pp, x.virtual_stages)
    per_chunk = max(chunks)  # k: every middle chunk's layers (all of them when even)
    if x.pp > 1:
        parallelism.update(
            pipeline_parallel_schedule=TORCHTITAN_SCHEDULES[x.schedule],
            pipeline_parallel_microbatch_size=x.micro_batch_size,
            pipeline_parallel_layers_per_stage=per_chunk,
            pipeline_parallel_first_stage_less_layers=per_chunk - chunks[0],
            pipeline_parallel_last_stage_less_layers=per_chunk - chunks[-1],
        )
    ac = {"none": "None", "selective": "SelectiveAC.Config()", "full": "FullAC.Config()"}[x.recompute]
    param = "bfloat16" if t.precision == "bf16" else "float32"
    rope: dict[str, Any] = {"theta": m.rope_theta}
    if m.rope_scaling is not None:  # torchtitan's "llama" scaling (torchtitan/models/common/rope.py)
        sc = m.rope_scaling
        rope.update(
            scaling="llama",
            scaling_factor=sc.factor,
            low_freq_factor=sc.low_freq_factor,
            high_freq_factor=sc.high_freq_factor,
            original_max_position_embeddings=sc.original_max_position_embeddings,
        )
    b1, b2 = run.betas
    optimizer = dict(lr=run.lr, betas=(b1, b2), eps=run.adam_eps, weight_decay=run.weight_decay)
    schedule = dict(warmup_steps=run.warmup_steps, decay_type=run.decay, min_lr_factor=run.min_lr / run.lr)
    py = f'''{_header("torchtitan", plan)[0]}
"""torchtitan 0.3 job configuration. Run:

    PYTHONPATH=$PWD:$PYTHONPATH torchrun --nproc-per-node=G ... -m torchtitan.train --module berth_torchtitan \\
        --config berth_plan

Still to supply (read from the environment when the config is built; an unset one stops with its description):
{chr(10).join(f"    {k}: {v}" for k, v in TORCHTITAN_INPUTS.items())}
Pipeline split (berth's rule, specs/stages.py): {_torchtitan_split_note(m.num_layers, x.pp, x.virtual_stages)}
"""

import os

from torchtitan.components.checkpoint import CheckpointManager
from torchtitan.components.loss import ChunkedLossWrapper, CrossEntropyLoss
from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw
from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC  # noqa: F401
from torchtitan.distributed.pipeline_parallel import pipeline_llm
from torchtitan.hf_datasets.text_datasets import HuggingFaceTextDataLoader
from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
from torchtitan.models.common.config_utils import decoder_vocab_size
from torchtitan.models.llama3 import (_EMBEDDING_INIT, _EMBEDDING_SKIP_INIT, _NORM_INIT, _build_llama3_layers,
                                      _output_linear_init, parallelize_llama)
from torchtitan.models.llama3.model import Llama3Model
from torchtitan.models.llama3.state_dict_adapter import Llama3StateDictAdapter
from torchtitan.protocols.model_spec import ModelSpec
from torchtitan.trainer import Trainer

SHAPE = dict(n_layers={m.num_layers}, dim={m.hidden_size}, n_heads={m.num_attention_heads}, \
n_kv_heads={m.kv_heads}, hidden_dim={m.ffn_hidden_size}, vocab_size={m.vocab_size})
SEQ_LEN = {t.seq_len}
ROPE = {rope!r}  # the model's rotary base (and scaling)
NORM_EPS = {m.norm_eps!r}
TIED = {m.tied_embeddings!r}  # the output shares the input embedding
OPTIMIZER = {optimizer!r}  # AdamW
LR_SCHEDULE = {schedule!r}
INPUTS = {TORCHTITAN_INPUTS!r}
# TrainingSpec.fp8: torchao's Float8 recipe for the decoder's linears (None: bf16); the LM head stays bf16, as
# berth predicts it, and torchtitan's Float8 runs compiled (its casts fused)
FP8 = {t.fp8!r}


def _required(name):
    value = os.environ.get(name)
    if not value:
        raise SystemExit(f"berth_torchtitan: set {{name}} to {{INPUTS[name]}}")
    return value


def model_spec():
    s = SHAPE
    rope = ComplexRoPE.Config(dim=s["dim"] // s["n_heads"], max_seq_len=SEQ_LEN, **ROPE)
    layers = _build_llama3_layers(n_layers=s["n_layers"], dim=s["dim"], n_heads=s["n_heads"],
                                  n_kv_heads=s["n_kv_heads"], hidden_dim=s["hidden_dim"], rope=rope,
                                  attn_backend="flex")
    for layer in layers:  # the builder leaves RMSNorm's default epsilon
        layer.attention_norm.eps = layer.ffn_norm.eps = NORM_EPS
    model = Llama3Model.Config(
        dim=s["dim"], vocab_size=s["vocab_size"], enable_weight_tying=TIED,
        tok_embeddings=Embedding.Config(num_embeddings=s["vocab_size"], embedding_dim=s["dim"],
                                        param_init=_EMBEDDING_SKIP_INIT if TIED else _EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=s["dim"], eps=NORM_EPS, param_init=_NORM_INIT),
        lm_head=Linear.Config(in_features=s["dim"], out_features=s["vocab_size"],
                              param_init=_output_linear_init(s["dim"])),
        layers=layers)
    if FP8 is not None:  # what torchtitan's model_registry does with converters (it raises here without torchao)
        from torchtitan.components.quantization.float8 import Float8LinearConverter
        model = Float8LinearConverter.Config(recipe_name=FP8, filter_fqns=["lm_head"],
                                             model_compile_enabled=True).build().convert(model)
    return ModelSpec(name="llama3", flavor="berth", model=model, parallelize_fn=parallelize_llama,
                     pipelining_fn=pipeline_llm, post_optimizer_build_fn=None,
                     state_dict_adapter=Llama3StateDictAdapter)


def berth_plan() -> Trainer.Config:
    spec = model_spec()
    return Trainer.Config(
        model_spec=spec,
        loss=ChunkedLossWrapper.Config(loss_fn=CrossEntropyLoss.Config(global_vocab_size=decoder_vocab_size(spec))),
        hf_assets_path=_required("BERTH_HF_ASSETS"),
        dataloader=HuggingFaceTextDataLoader.Config(dataset=_required("BERTH_DATASET")),
        optimizer=default_adamw(**OPTIMIZER),
        lr_scheduler=LRSchedulersContainer.Config(**LR_SCHEDULE),
        checkpoint=CheckpointManager.Config(enable=True, folder={run.checkpoint_dir!r}, \
interval={run.checkpoint_interval}),
        training=TrainingConfig(local_batch_size={local}, global_batch_size={t.global_batch_size}, \
seq_len=SEQ_LEN, mixed_precision_param="{param}", steps={run.train_steps}, max_norm={run.grad_clip or 'float("inf")'},
                                # torchtitan 0.3 captures CUDA graphs unless told not to; they refuse pp > 1
                                disable_cuda_graphs={x.pp > 1}),
        parallelism=ParallelismConfig({", ".join(f"{k}={v!r}" for k, v in parallelism.items())}),
        activation_checkpoint={ac},
        compile=CompileConfig(enable=FP8 is not None, components=["model"]),
    )
'''
    launch = _torchrun_launch(
        "torchtitan",
        plan,
        "berth_torchtitan.py",
        TORCHTITAN_INPUTS,
        'export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"',
        "-m torchtitan.train --module berth_torchtitan --config berth_plan",
    )
    return {"berth_torchtitan.py": py, "torchtitan-launch.sh": launch}


def _torchrun_launch(fmt: str, plan: Plan, beside: str, inputs: dict[str, str], setup: str, command: str) -> str:
    """An engine's torchrun launch script, run on every node: the user inputs it stops without (each with its
    description), one setup line, then torchrun over the plan's nodes with `command` (fixed text: no user value)."""
    x, c = plan.layout, plan.cluster
    nodes = max(1, x.world_size // c.gpus_per_node)
    per_node = min(x.world_size, c.gpus_per_node)
    return "\n".join(
        [
            "#!/bin/bash",
            *_header(fmt, plan),
            f"# run on every node with NODE_RANK set, beside {beside}",
            "set -euo pipefail",
            *(f': "${{{k}:?set {k} to {v}}}"' for k, v in inputs.items()),
            setup,
            f'torchrun --nnodes={nodes} --nproc-per-node={per_node} --node-rank="${{NODE_RANK:-0}}" '
            f'--master-addr="${{MASTER_ADDR:-127.0.0.1}}" --master-port="${{MASTER_PORT:-{DEFAULT_PORT}}}" {command}',
            "",
        ]
    )


NANOTRON_SCHEDULES = {"gpipe": "afab", "1f1b": "1f1b"}  # berth's schedule -> nanotron's pp_engine
NANOTRON_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
NANOTRON_INPUTS = {"NANOTRON_DIR": "a nanotron checkout at e24d2483 (its run_train.py starts the run)"}


def nanotron_config(plan: Plan, run: EngineTraining | None = None) -> dict[str, str]:
    """A nanotron config (the YAML its run_train.py reads with config/config.py get_config_from_file) and its torchrun
    launch. The layout as scripts/scaling_benchmarks.py set the Ultra-Scale Playbook's sweep: pp_engine 1f1b (or
    afab), sequence parallelism as tp_mode REDUCE_SCATTER with tp_linear_async_communication, fp32 gradient
    accumulation; max_position_embeddings = the sequence length (trainer.py asserts it for a model it initialises);
    no dataset (run_train.py then feeds its dummy_infinite_data_generator: a trial run needs no data)."""
    import yaml  # a core dependency, imported where used: the CLI reads LAUNCH_FORMATS at start-up

    run = run or EngineTraining()
    x, t, m = plan.layout, plan.training, plan.model
    reason = _engine_refusal("nanotron", plan)
    if reason:
        raise LaunchRefused("nanotron", reason)
    sp = bool(x.sequence_parallel) and x.tp > 1
    b1, b2 = run.betas
    model_config: dict[str, Any] = {
        "is_llama_config": True,
        "hidden_act": "silu",  # SwiGLU (the engine rule refuses other MLPs)
        "hidden_size": m.hidden_size,
        "intermediate_size": m.ffn_hidden_size,
        "num_attention_heads": m.num_attention_heads,
        "num_key_value_heads": m.num_kv_heads or m.num_attention_heads,
        "num_hidden_layers": m.num_layers,
        "vocab_size": m.vocab_size,
        "max_position_embeddings": t.seq_len,
        "rms_norm_eps": m.norm_eps,
        "rope_theta": m.rope_theta,
        # carried for the record: nanotron e24d2483's models/llama.py reads rope_theta only
        "rope_scaling": None if m.rope_scaling is None else {"rope_type": "llama3", **m.rope_scaling.model_dump()},
        "tie_word_embeddings": m.tied_embeddings,
        "initializer_range": 0.02,
    }
    config: dict[str, Any] = {
        "general": {"project": "berth", "run": _job_name(f"berth-{m.name}-{x.short()}"), "seed": 42},
        "parallelism": {
            "dp": x.dp,
            "pp": x.pp,
            "tp": x.tp,
            "pp_engine": NANOTRON_SCHEDULES[x.schedule],
            "tp_mode": "REDUCE_SCATTER" if sp else "ALL_REDUCE",
            "tp_linear_async_communication": sp,
            "recompute_layer": x.recompute == "full",
            "expert_parallel_size": 1,
        },
        "model": {
            "dtype": NANOTRON_DTYPES[t.precision],
            "init_method": {"std": 0.02},
            "make_vocab_size_divisible_by": 1,
            "ddp_bucket_cap_mb": 25,
            "model_config": model_config,
        },
        "tokenizer": {"tokenizer_name_or_path": None},
        "checkpoints": {
            "checkpoints_path": run.checkpoint_dir,
            "checkpoint_interval": run.checkpoint_interval,
            "save_initial_state": False,
        },
        "logging": {"log_level": "info", "log_level_replica": "info", "iteration_step_info_interval": 1},
        "tokens": {
            "sequence_length": t.seq_len,
            "train_steps": run.train_steps,
            "micro_batch_size": x.micro_batch_size,
            "batch_accumulation_per_replica": x.num_microbatches,
            "val_check_interval": -1,
            "limit_val_batches": 0,
            "limit_test_batches": 0,
        },
        "optimizer": {
            "zero_stage": x.zero_stage,
            "weight_decay": run.weight_decay,
            "clip_grad": run.grad_clip or None,
            "accumulate_grad_in_fp32": True,
            "optimizer_factory": {
                "name": "adamW",
                "adam_beta1": b1,
                "adam_beta2": b2,
                "adam_eps": run.adam_eps,
                "torch_adam_is_fused": True,
            },
            "learning_rate_scheduler": {
                "learning_rate": run.lr,
                "lr_warmup_steps": run.warmup_steps,
                "lr_warmup_style": "linear",
                "lr_decay_style": run.decay,
                "min_decay_lr": run.min_lr,
            },
        },
        "data_stages": [
            {"name": "berth trial", "start_training_step": 1, "data": {"dataset": None, "seed": 42}},
        ],
    }
    text = "\n".join(
        [
            *_header("nanotron", plan),
            f"# world size {x.world_size} = dp {x.dp} x pp {x.pp} x tp {x.tp}; global batch {t.global_batch_size} = "
            "micro_batch_size x batch_accumulation_per_replica x dp",
            "# data_stages: no dataset, so run_train.py feeds random tokens (a trial run); name one to train",
            yaml.safe_dump(config, sort_keys=False, default_flow_style=False),
        ]
    )
    launch = _torchrun_launch(
        "nanotron",
        plan,
        "nanotron.yaml",
        NANOTRON_INPUTS,
        "export CUDA_DEVICE_MAX_CONNECTIONS=1  # nanotron's async tensor-parallel linears assert it",
        '"$NANOTRON_DIR/run_train.py" --config-file nanotron.yaml',
    )
    return {"nanotron.yaml": text, "nanotron-launch.sh": launch}


@dataclass(frozen=True)
class LaunchOptions:
    """What `berth launch` and POST /v1/launch pass beside the plan (the executor formats use them)."""

    plan_file: str = "plan.json"
    steps: int = 20
    warmup: int = 3
    image: str = DEFAULT_IMAGE
    port: int = DEFAULT_PORT
    engine: EngineTraining = EngineTraining()  # the engine formats' training run


@dataclass(frozen=True)
class LaunchFormat:
    """One launch format: the CLI's --format, the API's `format` and `artifacts` all read this table."""

    name: str
    build: Callable[[Plan, LaunchOptions], dict[str, str]]
    runs_executor: bool  # runs berth's bundled executor: takes steps, warmup and (kubernetes) the image
    # engine formats: the engine version targeted (stated in every artifact and docs/guide.md; FIELD_SOURCES were
    # read at that version) and the check that refuses a layout the engine cannot express (None: it can)
    engine_version: str | None = None
    refusal: Callable[[Plan], str | None] | None = None


def _run(plan: Plan, o: LaunchOptions) -> _Run:
    return _Run(plan, o.plan_file, o.steps, o.warmup, o.port)


LAUNCH_FORMATS: dict[str, LaunchFormat] = {
    f.name: f
    for f in (
        LaunchFormat("torchrun", lambda p, o: _run(p, o).torchrun_scripts(), runs_executor=True),
        LaunchFormat("slurm", lambda p, o: _run(p, o).sbatch(), runs_executor=True),
        LaunchFormat("kubernetes", lambda p, o: _run(p, o).pytorchjob(o.image), runs_executor=True),
        LaunchFormat(
            "megatron",
            lambda p, o: megatron_args(p, o.engine),
            runs_executor=False,
            engine_version=ENGINES["megatron"].version,
            refusal=lambda p: _engine_refusal("megatron", p),
        ),
        LaunchFormat(
            "deepspeed",
            lambda p, o: deepspeed_config(p, o.engine),
            runs_executor=False,
            engine_version=ENGINES["deepspeed"].version,
            refusal=lambda p: _engine_refusal("deepspeed", p),
        ),
        LaunchFormat(
            "torchtitan",
            lambda p, o: torchtitan_config(p, o.engine),
            runs_executor=False,
            engine_version=ENGINES["torchtitan"].version,
            refusal=lambda p: _engine_refusal("torchtitan", p),
        ),
        LaunchFormat(
            "nanotron",
            lambda p, o: nanotron_config(p, o.engine),
            runs_executor=False,
            engine_version=ENGINES["nanotron"].version,
            refusal=lambda p: _engine_refusal("nanotron", p),
        ),
    )
}
FORMATS: tuple[str, ...] = tuple(LAUNCH_FORMATS)
ENGINE_VERSIONS: dict[str, str] = {f.name: f.engine_version for f in LAUNCH_FORMATS.values() if f.engine_version}
ENGINE_REFUSALS: dict[str, Callable[[Plan], str | None]] = {
    f.name: f.refusal for f in LAUNCH_FORMATS.values() if f.refusal
}


def formats_text() -> str:
    """The formats as a person reads them: "torchrun, slurm, ... or torchtitan" (the CLI's help)."""
    return f"{', '.join(FORMATS[:-1])} or {FORMATS[-1]}"
