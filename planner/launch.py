"""Launch artifacts: a plan as the files that start it on the engine a team already uses.

- torchrun: one script per node running the bundled executor (`executor.worker`), static
  rendezvous so that node n's local rank l is global rank n x G + l, exactly the plan's rank map
  (`Plan.placement.rank_map`: node = rank // gpus_per_node), GPUs in local order;
- slurm: an sbatch script (one task per node, node rank from SLURM_NODEID);
- kubernetes: a Kubeflow PyTorchJob (Master + Workers, torchrun reads the PET_* variables the
  training operator sets);
- megatron: Megatron-LM `pretrain_gpt.py` arguments; deepspeed: a DeepSpeed config JSON;
  torchtitan: a torchtitan job TOML.

Every layout field maps to exactly one key of a format (FIELD_KEYS lists them, the tests check
each against the engine's own names). A layout a format cannot express is refused with the
reason (LaunchRefused), never approximated. Names were read from the engines' sources:
Megatron-LM megatron/training/arguments.py (_add_distributed_args, _add_training_args),
DeepSpeed deepspeed/runtime/constants.py, zero/config.py and pipe config, torchtitan
torchtitan/config/job_config.py (Training, Parallelism, ActivationCheckpoint).
"""

from __future__ import annotations

import json
import re
import shlex
from typing import Any

from pydantic import TypeAdapter, ValidationError

from planner.errors import BerthError
from planner.specs import ImageName, Plan

FORMATS = ("torchrun", "slurm", "kubernetes", "megatron", "deepspeed", "torchtitan")
DEFAULT_PORT = 29500
# the Dockerfile built with --build-arg WITH_TORCH=1 (CPU torch); GPU clusters need an image whose
# torch is a CUDA build (pass it with --image)
DEFAULT_IMAGE = "berth-executor:latest"


class LaunchRefused(BerthError):
    """The format cannot express this layout."""

    def __init__(self, fmt: str, reason: str):
        super().__init__("format", fmt, f"cannot express this layout: {reason}")


# layout field -> the one key it becomes, per engine format
FIELD_KEYS: dict[str, dict[str, str]] = {
    "megatron": {
        "tp": "--tensor-model-parallel-size", "pp": "--pipeline-model-parallel-size",
        "dp": "(derived by Megatron: world size / (tp x pp))", "shard": "--num-distributed-optimizer-instances",
        "zero_stage": "--use-distributed-optimizer", "recompute": "--recompute-granularity",
        "micro_batch_size": "--micro-batch-size", "num_microbatches": "--global-batch-size",
        "virtual_stages": "--num-layers-per-virtual-pipeline-stage", "schedule": "(1F1B; interleaved when "
        "--num-layers-per-virtual-pipeline-stage is set)", "sequence_parallel": "--sequence-parallel",
        "axis_order": "--use-tp-pp-dp-mapping",
    },
    "deepspeed": {
        "tp": "tensor_parallel.autotp_size", "pp": "pipeline.stages", "dp": "(derived: world size / (tp x pp))",
        "shard": "zero_optimization.mics_shard_size", "zero_stage": "zero_optimization.stage",
        "recompute": "activation_checkpointing.number_checkpoints",
        "micro_batch_size": "train_micro_batch_size_per_gpu", "num_microbatches": "gradient_accumulation_steps",
        "virtual_stages": "(none: refused above 1)", "schedule": "(DeepSpeed's 1F1B TrainSchedule)",
        "sequence_parallel": "(none: refused)", "axis_order": "(pipe-data-model topology: tp-dp-pp only)",
    },
    "torchtitan": {
        "tp": "parallelism.tensor_parallel_degree", "pp": "parallelism.pipeline_parallel_degree",
        "dp": "parallelism.data_parallel_replicate_degree", "shard": "parallelism.data_parallel_shard_degree",
        "zero_stage": "parallelism.fsdp_reshard_after_forward", "recompute": "activation_checkpoint.mode",
        "micro_batch_size": "parallelism.pipeline_parallel_microbatch_size",
        "num_microbatches": "training.batch_size", "virtual_stages": "parallelism.pipeline_parallel_layers_per_stage",
        "schedule": "parallelism.pipeline_parallel_schedule", "sequence_parallel": "(always on with tp)",
        "axis_order": "(mesh pp, dp_replicate, dp_shard, tp: tp-dp-pp only)",
    },
}


def artifacts(plan: Plan, fmt: str, plan_file: str = "plan.json", steps: int = 20, warmup: int = 3,
              image: str = DEFAULT_IMAGE, port: int = DEFAULT_PORT) -> dict[str, str]:
    """File name -> content of the launch artifacts of `plan` in `fmt`."""
    if fmt not in FORMATS:
        raise BerthError("format", fmt, f"use one of {', '.join(FORMATS)}")
    if plan.prediction is None or plan.infeasible_reason:
        raise BerthError("plan", plan.layout.short(), f"not launchable: {plan.infeasible_reason or 'no prediction'}")
    if fmt in ("torchrun", "slurm", "kubernetes"):
        try:
            _IMAGE.validate_python(image)
        except ValidationError as err:
            raise BerthError("image", image, err.errors()[0]["msg"]) from None
        run = _Run(plan, plan_file, steps, warmup, port)
        return {"torchrun": run.torchrun_scripts, "slurm": run.sbatch, "kubernetes": lambda: run.pytorchjob(image)}[
            fmt]()
    return {"megatron": megatron_args, "deepspeed": deepspeed_config, "torchtitan": torchtitan_toml}[fmt](plan)


_IMAGE = TypeAdapter(ImageName)


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
        return ["-m", "executor.worker", "--plans", self.plan_file, "--steps", str(self.steps), "--warmup",
                str(self.warmup), "--out", "result.json", "--report", "report.json"]

    def torchrun_scripts(self) -> dict[str, str]:
        files = {}
        for n in range(self.nodes):
            args = ["torchrun", f"--nnodes={self.nodes}", f"--nproc-per-node={self.per_node}", f"--node-rank={n}",
                    "--rdzv-backend=static"]
            worker = " ".join(shlex.quote(a) for a in args)
            files[f"node{n}.sh"] = "\n".join([
                "#!/bin/sh",
                f"# berth launch (torchrun): node {n} of {self.nodes}, host {_comment(self.hosts[n])}; ranks "
                f"{n * self.per_node}..{(n + 1) * self.per_node - 1} (plan placement: rank = node x "
                f"{self.per_node} + local GPU, axis order {_comment(self.plan.layout.axis_order)})",
                "# run from a checkout of berth with the plan file beside it; node 0 writes report.json",
                "set -e",
                *(f"export {k}={shlex.quote(v)}" for k, v in self.env.items()),
                f'if [ -z "${{MASTER_ADDR:-}}" ]; then MASTER_ADDR={shlex.quote(self._master())}; fi',
                f'if [ -z "${{MASTER_PORT:-}}" ]; then MASTER_PORT={int(self.port)}; fi',
                f'{worker} --master-addr="$MASTER_ADDR" --master-port="$MASTER_PORT" '
                + " ".join(shlex.quote(a) for a in self.worker_args()), ""])
        files[self.plan_file] = json.dumps([self.plan.model_dump(mode="json")])
        return files

    def _master(self) -> str:
        return "127.0.0.1" if self.nodes == 1 else self.hosts[0]

    def sbatch(self) -> dict[str, str]:
        exports = " ".join(shlex.quote(f"{k}={v}") for k, v in self.env.items())
        # the inner shell expands SLURM_NODEID (per task) and MASTER_ADDR (exported below)
        torchrun = " ".join(["torchrun", f"--nnodes={self.nodes}", f"--nproc-per-node={self.per_node}",
                             '--node-rank="$SLURM_NODEID"', "--rdzv-backend=static", '--master-addr="$MASTER_ADDR"',
                             f"--master-port={int(self.port)}", *map(shlex.quote, self.worker_args())])
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
            "export MASTER_ADDR=$(scontrol show hostnames \"$SLURM_JOB_NODELIST\" | head -n 1)\n"
            f"srun --kill-on-bad-exit=1 env {exports} bash -c {shlex.quote(torchrun)}\n")
        return {"berth.sbatch": script, self.plan_file: json.dumps([self.plan.model_dump(mode="json")])}

    def pytorchjob(self, image: str) -> dict[str, str]:
        name = _k8s_name(self.plan.model.name)
        env = [{"name": k, "value": v} for k, v in self.env.items()]
        container = {
            "name": "pytorch", "image": image, "workingDir": "/app",
            "command": ["torchrun", *self.worker_args()], "env": env,
            "volumeMounts": [{"name": "plan", "mountPath": "/app/plan.json", "subPath": "plan.json"}],
        }
        if self.plan.cluster.device.kind == "gpu":
            container["resources"] = {"limits": {"nvidia.com/gpu": self.per_node}}
        pod = {"spec": {"containers": [container],
                        "volumes": [{"name": "plan", "configMap": {"name": f"{name}-plan"}}]}}
        replicas = {"Master": {"replicas": 1, "restartPolicy": "OnFailure", "template": pod}}
        if self.nodes > 1:
            replicas["Worker"] = {"replicas": self.nodes - 1, "restartPolicy": "OnFailure", "template": pod}
        job = {"apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob", "metadata": {"name": name},
               "spec": {"nprocPerNode": str(self.per_node), "pytorchReplicaSpecs": replicas}}
        config_map = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": f"{name}-plan"},
                      "data": {"plan.json": json.dumps([self.plan.model_dump(mode="json")])}}
        # JSON is YAML: kubectl apply -f takes either
        return {"pytorchjob.yaml": json.dumps(job, indent=2) + "\n",
                "plan-configmap.yaml": json.dumps(config_map) + "\n"}


def megatron_args(plan: Plan) -> dict[str, str]:
    """Megatron-LM pretrain_gpt.py arguments for the layout (and the model shape it needs)."""
    x, m, t = plan.layout, plan.model, plan.training
    if x.zero_stage >= 2:
        raise LaunchRefused("megatron", f"zero_stage {x.zero_stage}: Megatron's distributed optimizer shards "
                            "optimizer state only (ZeRO-1)")
    if x.pp > 1 and x.schedule == "gpipe":
        raise LaunchRefused("megatron", "schedule gpipe: Megatron runs 1F1B or interleaved 1F1B")
    if x.axis_order not in ("tp-dp-pp", "tp-pp-dp"):
        raise LaunchRefused("megatron", f"axis_order {x.axis_order}: Megatron orders tp-dp-pp or "
                            "(--use-tp-pp-dp-mapping) tp-pp-dp")
    args: list[tuple[str, object]] = [
        ("--tensor-model-parallel-size", x.tp), ("--pipeline-model-parallel-size", x.pp),
        ("--micro-batch-size", x.micro_batch_size), ("--global-batch-size", t.global_batch_size)]
    if x.virtual_stages > 1:
        args.append(("--num-layers-per-virtual-pipeline-stage", m.num_layers // (x.pp * x.virtual_stages)))
    if x.sequence_parallel:
        args.append(("--sequence-parallel", None))
    if x.recompute != "none":
        args.append(("--recompute-granularity", x.recompute))
        if x.recompute == "full":
            args += [("--recompute-method", "uniform"), ("--recompute-num-layers", 1)]
    if x.zero_stage == 1:
        args.append(("--use-distributed-optimizer", None))
        if x.shard < x.dp:
            args.append(("--num-distributed-optimizer-instances", x.dp // x.shard))
    if x.axis_order == "tp-pp-dp":
        args.append(("--use-tp-pp-dp-mapping", None))
    args += [("--num-layers", m.num_layers), ("--hidden-size", m.hidden_size), ("--ffn-hidden-size", m.ffn_hidden_size),
             ("--num-attention-heads", m.num_attention_heads), ("--seq-length", t.seq_len),
             ("--max-position-embeddings", t.seq_len)]
    if t.precision != "fp32":
        args.append((f"--{t.precision}", None))
    if m.kv_heads != m.num_attention_heads:
        args += [("--group-query-attention", None), ("--num-query-groups", m.kv_heads)]
    if m.mlp == "swiglu":
        args.append(("--swiglu", None))
    if m.norm == "rmsnorm":
        args.append(("--normalization", "RMSNorm"))
    if not m.tied_embeddings:
        args.append(("--untie-embeddings-and-output-weights", None))
    if t.flash_attention:
        args.append(("--use-flash-attn", None))
    text = " \\\n".join(flag if value is None else f"{flag} {value}" for flag, value in args)
    return {"megatron-args.txt": f"# berth plan {x.short()}: arguments for Megatron-LM pretrain_gpt.py\n{text}\n"}


def deepspeed_config(plan: Plan) -> dict[str, str]:
    """A DeepSpeed config JSON for the layout."""
    x, t, m = plan.layout, plan.training, plan.model
    if x.sequence_parallel:
        raise LaunchRefused("deepspeed", "sequence_parallel: DeepSpeed's config has no Megatron-style sequence "
                            "parallelism (Ulysses is a different scheme)")
    if x.pp > 1 and x.schedule != "1f1b":
        raise LaunchRefused("deepspeed", f"schedule {x.schedule}: DeepSpeed's pipeline engine runs 1F1B only")
    if x.recompute == "selective":
        raise LaunchRefused("deepspeed", "recompute selective: DeepSpeed checkpoints whole layers")
    if x.axis_order != "tp-dp-pp":
        raise LaunchRefused("deepspeed", f"axis_order {x.axis_order}: DeepSpeed's topology is pipe-data-model "
                            "(tp-dp-pp)")
    if x.pp > 1 and x.zero_stage >= 2:
        raise LaunchRefused("deepspeed", f"zero_stage {x.zero_stage} with pp > 1: DeepSpeed's pipeline engine "
                            "supports ZeRO-1 only")
    if 0 < x.shard < x.dp and x.zero_stage != 3:
        raise LaunchRefused("deepspeed", f"shard {x.shard} < dp {x.dp} with zero {x.zero_stage}: DeepSpeed "
                            "shards over a sub-group (MiCS) with ZeRO-3 only")
    config: dict[str, Any] = {
        "train_batch_size": t.global_batch_size,
        "train_micro_batch_size_per_gpu": x.micro_batch_size,
        "gradient_accumulation_steps": x.num_microbatches,
        "zero_optimization": {"stage": x.zero_stage},
    }
    if x.zero_stage == 3 and x.shard < x.dp:
        config["zero_optimization"]["mics_shard_size"] = x.shard
    if t.precision == "bf16":
        config["bf16"] = {"enabled": True}
    elif t.precision == "fp16":
        config["fp16"] = {"enabled": True}
    if x.pp > 1:
        config["pipeline"] = {"stages": x.pp, "partition": "uniform"}
    if x.tp > 1:
        config["tensor_parallel"] = {"autotp_size": x.tp}
    if x.recompute == "full":
        config["activation_checkpointing"] = {"partition_activations": False,
                                              "number_checkpoints": m.num_layers // x.pp}
    return {"ds_config.json": json.dumps(config, indent=2) + "\n"}


TORCHTITAN_SCHEDULES = {"gpipe": "GPipe", "1f1b": "1F1B", "interleaved_1f1b": "Interleaved1F1B"}


def torchtitan_toml(plan: Plan) -> dict[str, str]:
    """A torchtitan job config TOML for the layout."""
    x, t, m = plan.layout, plan.training, plan.model
    if x.tp > 1 and not x.sequence_parallel:
        raise LaunchRefused("torchtitan", "tp without sequence_parallel: torchtitan's tensor parallelism always "
                            "shards the norms over the sequence")
    if x.zero_stage == 1:
        raise LaunchRefused("torchtitan", "zero_stage 1: FSDP2 shards gradients with optimizer state (use 2)")
    if x.pp == 1 and x.num_microbatches > 1:
        raise LaunchRefused("torchtitan", f"num_microbatches {x.num_microbatches} without pp: this torchtitan "
                            "config has no gradient accumulation outside the pipeline")
    if x.axis_order != "tp-dp-pp":
        raise LaunchRefused("torchtitan", f"axis_order {x.axis_order}: torchtitan's mesh is pp, dp, tp (tp-dp-pp)")
    if t.precision == "fp16":
        raise LaunchRefused("torchtitan", "precision fp16: torchtitan trains in bfloat16 or float32")
    shard = x.shard if x.zero_stage else 1
    param = "bfloat16" if t.precision == "bf16" else "float32"
    lines = ["# berth plan " + x.short(), "[training]", f"batch_size = {x.micro_batch_size * x.num_microbatches}",
             f"seq_len = {t.seq_len}", f'mixed_precision_param = "{param}"',
             "", "[parallelism]", f"data_parallel_replicate_degree = {x.dp // shard}",
             f"data_parallel_shard_degree = {shard}", f"tensor_parallel_degree = {x.tp}",
             f"pipeline_parallel_degree = {x.pp}"]
    if x.zero_stage >= 2:
        lines.append(f'fsdp_reshard_after_forward = "{"always" if x.zero_stage == 3 else "never"}"')
    if x.pp > 1:
        lines += [f'pipeline_parallel_schedule = "{TORCHTITAN_SCHEDULES[x.schedule]}"',
                  f"pipeline_parallel_microbatch_size = {x.micro_batch_size}"]
        if x.virtual_stages > 1:
            lines.append(f"pipeline_parallel_layers_per_stage = {m.num_layers // (x.pp * x.virtual_stages)}")
    lines += ["", "[activation_checkpoint]", f'mode = "{x.recompute}"']
    if x.recompute == "selective":
        lines.append('selective_ac_option = "op"')
    return {"torchtitan.toml": "\n".join(lines) + "\n"}
