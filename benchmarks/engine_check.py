"""Load berth's launch artifacts with the engines' own parsers and report what each accepted.

    python -m benchmarks.engine_check [--megatron-dir PATH] [--json]

For a representative plan set (the README's launch cases, searched, and hand-picked layouts covering pp,
interleaved vpp, ZeRO 0-3, hybrid sharding, sequence parallelism, recompute, gradient accumulation, context
parallelism, uneven stages, and mixture of experts with ep and expert_tp = tp, 1 or 2 of 4 for Megatron), every
engine format is generated and loaded by the engine itself:

- DeepSpeed (the `engines` extra): `deepspeed.runtime.config.DeepSpeedConfig` with a one-process gloo group and
  an mpu whose data-parallel size comes from DeepSpeed's own `PipeModelDataParallelTopology` (as its
  PipelineParallelGrid computes it), so the batch check `train_batch = micro x accumulation x dp` runs for real;
- torchtitan (the `engines` extra): `ConfigManager().parse_args(["--module", ..., "--config", ...])` on the
  generated configuration module, `ParallelDims.from_config` for the world size, and the pipeline split
  functions `_get_pipeline_metadata` / `_generate_llm_fqn_per_model_part`;
- Megatron-LM (a checkout named by --megatron-dir or BERTH_MEGATRON_DIR): `parse_args` and `validate_args`
  in a subprocess, with WORLD_SIZE set to the plan's and the CUDA_DEVICE_MAX_CONNECTIONS its launch sets.

Stand-ins, each for a GPU-only piece the parsers never call: torchtitan 0.3.0's Triton kernels module for MoE
expert-parallel dispatch (`torchtitan.distributed.minimal_async_ep.kernels`, imported at module level, needs
triton, which CPU torch lacks) when triton is absent; DeepSpeed's shared-memory allreduce op, which its CPU
accelerator JIT-compiles (minutes) on every process-group set-up; Megatron's `get_device_arch_version`
(a torch.cuda query), answered 9 (Hopper, where tp > 1 needs CUDA_DEVICE_MAX_CONNECTIONS=1), and its
`torch.cuda.get_device_capability` check for --moe-grouped-gemm, answered (9, 0).

Beyond the parsers, the engines' own start-up (tests/test_engine_start.py calls these runners, each in a subprocess):
`build_torchtitan_trainers` builds torchtitan's Trainer in its dry-run mode (--comm.mode fake_backend) at the plan's
world size; `check_megatron_core` puts the launch's recorded argv through megatron-core's config classes, process
groups, microbatch calculator, LR scheduler and rotary embedding (CI has no Megatron-LM checkout; megatron-core's
wheel has no argument parser); `initialise_deepspeed` runs deepspeed.initialize from ds_config.json on CPU processes
over gloo and takes one optimizer step. Their stand-ins are named where each runner is defined.

Nothing is fetched: the engines are the installed packages and the checkout given. Each loader returns the
parsed values in one vocabulary (tp, pp, vpp, dp, shard, zero, micro/global batch, accumulation, recompute,
sp, precision, seq_len; Megatron's experts, top-k, expert ffn, shared-expert ffn, MoE layer pattern, ep, etp and
dispatcher) for tests/test_engines.py to compare with the plan.

Last run against Megatron-LM (this machine's Python 3.11 + triton 3.9, no GPU): fc61ce5a60 (2026-03, the last
commit before the checkout requires Python 3.12): all 16 plans parse and validate, the four MoE plans included.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import types
from pathlib import Path
from typing import Any

from berth.launch.writers import ENGINE_VERSIONS, LaunchRefused, artifacts
from berth.planner.search import predict_layouts, search
from berth.specs.models import load_model
from berth.specs.tree import Layout, Plan, SearchSpec, TrainingSpec
from berth.topology.clusters import cluster_from_preset

ENGINES = ("megatron", "deepspeed", "torchtitan")
# (model, dgx-h100 nodes, seq_len, global batch): the README's launch example and its other llama cases
README_CASES = [
    ("llama3-70b", 4, 4096, 64),
    ("llama3-70b", 8, 8192, 256),
    ("llama3-8b", 1, 4096, 64),
    ("llama3-8b", 4, 4096, 64),
]
# (model, nodes, global batch, layout): what the searched plans may not cover
LAYOUT_CASES = [
    (
        "llama3-8b",
        4,
        64,
        Layout(pp=4, dp=8, zero_stage=1, shard=8, micro_batch_size=1, num_microbatches=8, recompute="full"),
    ),
    (
        "llama3-70b",
        4,
        64,
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
        ),
    ),
    (
        "llama3-70b",
        4,
        64,
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
    ),
    (
        "llama3-70b",
        4,
        64,
        Layout(
            tp=4,
            pp=4,
            dp=2,
            zero_stage=1,
            shard=2,
            micro_batch_size=1,
            num_microbatches=32,
            axis_order="tp-pp-dp",
            recompute="full",
        ),
    ),
    ("llama3-8b", 4, 64, Layout(tp=4, dp=8, micro_batch_size=1, num_microbatches=8)),
    # context parallelism: Megatron --context-parallel-size, torchtitan context_parallel_degree, DeepSpeed refused
    ("llama3-8b", 4, 64, Layout(tp=4, cp=2, dp=4, micro_batch_size=1, num_microbatches=16, sequence_parallel=True)),
    # torchtitan shards over dp_shard x cp whatever the stage (ZeRO-0 with cp refused): cp with ZeRO-3 it runs
    (
        "llama3-8b",
        4,
        64,
        Layout(
            tp=4, cp=2, dp=4, zero_stage=3, shard=4, micro_batch_size=1, num_microbatches=16, sequence_parallel=True
        ),
    ),
    (
        "llama3-8b",
        4,
        64,
        Layout(tp=4, dp=8, zero_stage=2, shard=8, micro_batch_size=2, num_microbatches=4, sequence_parallel=True),
    ),
    # ZeRO over dp alone: stage 2 (the executor's ZeRO-1 of an 8B model, DDP + a sharded optimizer over fp32
    # weights and gradients and the autocast copy, needs ~116 GiB: predicted not to fit, so not launchable)
    (
        "llama3-8b",
        4,
        64,
        Layout(dp=32, zero_stage=2, shard=32, micro_batch_size=1, num_microbatches=2, recompute="full"),
    ),
    ("llama3-8b", 4, 64, Layout(dp=32, zero_stage=3, shard=8, micro_batch_size=2)),
    ("llama3-8b", 1, 64, Layout(dp=8, zero_stage=3, shard=8, micro_batch_size=2, num_microbatches=4, recompute="full")),
    # uneven pipeline stages (specs/stages.py): 32 layers on pp 3 (11, 11, 10), and 80 in 12 chunks (5, 7 x10, 5)
    (
        "llama3-8b",
        3,
        64,
        Layout(
            tp=8, pp=3, dp=1, micro_batch_size=1, num_microbatches=64, sequence_parallel=True, recompute="selective"
        ),
    ),
    (
        "llama3-70b",
        4,
        64,
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
        ),
    ),
]


# Mixture of experts, planned for Megatron-LM (the engine that runs berth's MoE layouts; DeepSpeed and torchtitan
# refuse them with their reason): experts split as the dense layers (expert_tp = tp), MoE parallel folding
# (expert_tp = 1, the ep group across tp x dp), expert_tp 2 of tp 4, and a DeepSeek-V3-style model with a shared
# expert, dense first layers (--moe-layer-freq) and 61 layers on 16 uneven stages.
_MIXTRAL = dict(tp=2, pp=2, dp=8, zero_stage=1, shard=8, micro_batch_size=2, num_microbatches=4, sequence_parallel=True)
MOE_CASES = [
    ("mixtral-8x7b", 4, 64, Layout(ep=4, **_MIXTRAL)),
    ("mixtral-8x7b", 4, 64, Layout(ep=8, expert_tp=1, **_MIXTRAL)),
    (
        "mixtral-8x7b",
        4,
        64,
        Layout(**{**_MIXTRAL, "tp": 4, "dp": 4, "shard": 4, "num_microbatches": 8}, ep=4, expert_tp=2),
    ),
    (
        "deepseek-v3-style",
        64,
        1024,
        Layout(
            tp=4, pp=16, dp=8, ep=8, expert_tp=1, zero_stage=1, shard=8, num_microbatches=128, sequence_parallel=True
        ),
    ),
]


def plan_set() -> list[tuple[str, Plan]]:
    """(name, plan): the top plan of each README case (framework pytorch and megatron) and the layout cases."""
    out = []
    for model, nodes, seq, batch in README_CASES:
        for framework in ("pytorch", "megatron"):
            training = TrainingSpec(seq_len=seq, global_batch_size=batch, framework=framework)
            (p,) = search(load_model(model), training, cluster_from_preset("dgx-h100", nodes), SearchSpec(top=1)).plans
            out.append((f"{model}-{nodes}n-{framework}-top1", p))
    for model, nodes, batch, layout in LAYOUT_CASES:
        (p,) = predict_layouts(
            load_model(model),
            TrainingSpec(seq_len=4096, global_batch_size=batch),
            cluster_from_preset("dgx-h100", nodes),
            [layout],
        )
        out.append((f"{model}-{nodes}n-{layout.short()}", p))
    for model, nodes, batch, layout in MOE_CASES:
        training = TrainingSpec(seq_len=4096, global_batch_size=batch, framework="megatron")
        (p,) = predict_layouts(load_model(model), training, cluster_from_preset("dgx-h100", nodes), [layout])
        out.append((f"{model}-{nodes}n-megatron-{layout.short()}", p))
    return out


def available(engine: str) -> str | None:
    """None when the engine can be checked here, else why not."""
    if engine == "megatron":
        d = os.environ.get("BERTH_MEGATRON_DIR")
        if not d:
            return "BERTH_MEGATRON_DIR is not set (a Megatron-LM checkout to run its parse_args/validate_args)"
        if not (Path(d) / "megatron" / "training" / "arguments.py").is_file():
            return f"BERTH_MEGATRON_DIR={d} has no megatron/training/arguments.py"
        return None
    if engine == "megatron-core":
        if importlib.util.find_spec("megatron") is None or importlib.util.find_spec("megatron.core") is None:
            return (
                f"megatron-core is not installed (pip install -e '.[engines]': megatron-core=={MEGATRON_CORE_VERSION})"
            )
        return None
    if importlib.util.find_spec(engine) is None:
        return f"{engine} is not installed (pip install -e '.[engines]')"
    return None


# --- DeepSpeed ----------------------------------------------------------------------------------------------


def _deepspeed_comm():
    """A one-process gloo group for deepspeed.comm, without the shared-memory allreduce op its CPU accelerator
    would JIT-compile (the config parser never calls it)."""
    import deepspeed.comm as dist
    import deepspeed.comm.torch  # noqa: F401  (deepspeed.comm.torch as an attribute is torch itself)

    if dist.is_initialized():
        return dist
    # stand-in: TorchBackend checks for None and skips the op
    sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:  # the variables are read here only: the caller's environment is left as it was
        dist.init_distributed(dist_backend="gloo", auto_mpi_discovery=False, verbose=False)
    finally:
        _restore(saved)
    return dist


def _restore(saved: dict[str, str | None]) -> None:
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def release() -> None:
    """End the one-process group the DeepSpeed check started (tests call it when done)."""
    import torch.distributed

    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def load_deepspeed(plan: Plan, files: dict[str, str]) -> dict[str, Any]:
    """ds_config.json through DeepSpeedConfig; dp from DeepSpeed's topology for the plan's world size."""
    from deepspeed.runtime.config import DeepSpeedConfig
    from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

    _deepspeed_comm()
    x = plan.layout
    world = plan.cluster.world_size
    topo = PipeModelDataParallelTopology(num_pp=x.pp, num_mp=x.tp, num_dp=world // (x.pp * x.tp))

    class Mpu:  # what PipelineParallelGrid (pp) or deepspeed.utils.groups (AutoTP) answers
        @staticmethod
        def get_data_parallel_world_size():
            return topo.get_dim("data")

    c = DeepSpeedConfig(json.loads(files["ds_config.json"]), mpu=Mpu())
    precision = "bf16" if c.bfloat16_config.enabled else "fp16" if c.float16_config.enabled else "fp32"
    return {
        "tp": max(1, c.tensor_parallel_config.autotp_size),
        "dp": int(c.world_size),
        "zero": int(c.zero_optimization_stage),
        "micro_batch": c.train_micro_batch_size_per_gpu,
        "global_batch": c.train_batch_size,
        "accumulation": c.gradient_accumulation_steps,
        "precision": precision,
        "world": topo.world_size(),
    }


# DeepSpeed's engine initialised from ds_config.json as written, on CPU processes over gloo (python -m
# torch.distributed.run, one process per rank of the plan), with a small model of the plan's shape (its layers,
# hidden size, vocabulary; a PipelineModule of pp stages when pp > 1), trained for one optimizer step. Stand-in: the
# shared-memory allreduce op DeepSpeed's CPU accelerator JIT-compiles at process-group set-up (the engine falls back
# to torch.distributed's when it is absent).
_DEEPSPEED_RUNNER = r"""
import json, os, sys
import torch
import deepspeed
import deepspeed.comm.torch
sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None
deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False, verbose=False)
from deepspeed.pipe import LayerSpec, PipelineModule

class Block(torch.nn.Module):
    def __init__(self, h):
        super().__init__()
        self.norm, self.up, self.down = torch.nn.LayerNorm(h), torch.nn.Linear(h, 4 * h), torch.nn.Linear(4 * h, h)
    def forward(self, x):
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))

class Embed(torch.nn.Embedding):
    pass

class Head(torch.nn.Linear):
    pass

def loss_fn(logits, labels):
    return torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1))

class Model(torch.nn.Sequential):
    def forward(self, x, y):
        return loss_fn(super().forward(x), y)

rank = int(os.environ["RANK"])
out = []
for job in json.load(open(sys.argv[1])):
    m, config = job["model"], job["config"]
    torch.manual_seed(0)
    h, v, s = m["hidden"], m["vocab"], job["seq_len"]
    layers = [LayerSpec(Embed, v, h)] + [LayerSpec(Block, h) for _ in range(m["layers"])] + [LayerSpec(Head, h, v)]
    mb = config["train_micro_batch_size_per_gpu"]
    batch = lambda: (torch.randint(0, v, (mb, s)), torch.randint(0, v, (mb, s)))
    if job["pp"] > 1:
        # only the decoder layers are recomputed (the embedding's integer input carries no gradient)
        model = PipelineModule(layers=layers, num_stages=job["pp"], partition_method="uniform", loss_fn=loss_fn,
                               checkpointable_layers=["Block"])
        params = [p for p in model.parameters()]
        engine, optimizer, _, scheduler = deepspeed.initialize(model=model, model_parameters=params, config=config)
        loss = engine.train_batch(data_iter=iter([batch() for _ in range(engine.gradient_accumulation_steps())]))
        checkpoint_interval = engine.module.activation_checkpoint_interval
    else:
        model = Model(*(spec.build() for spec in layers))
        params = list(model.parameters())
        engine, optimizer, _, scheduler = deepspeed.initialize(model=model, model_parameters=params, config=config)
        for _ in range(engine.gradient_accumulation_steps()):
            loss = engine(*batch())
            engine.backward(loss)
            engine.step()
        checkpoint_interval = None
    out.append({
        "world": engine.world_size, "dp": engine.dp_world_size, "zero": engine.zero_optimization_stage(),
        "accumulation": engine.gradient_accumulation_steps(), "micro_batch": engine.train_micro_batch_size_per_gpu(),
        "global_batch": engine.train_batch_size(), "steps": engine.global_steps, "loss": float(loss),
        "optimizer": type(engine.basic_optimizer if hasattr(engine, "basic_optimizer") else optimizer).__name__,
        "scheduler": type(scheduler).__name__, "lr": scheduler.get_last_lr()[0] if scheduler else None,
        "bf16": engine.bfloat16_enabled(), "activation_checkpoint_interval": checkpoint_interval,
    })
    engine.destroy() if hasattr(engine, "destroy") else None
if rank == 0:
    print("BERTH_RESULT " + json.dumps(out), flush=True)
# every rank leaves the group together: a rank that exits while another's gloo threads still talk to it
# aborts that one at exit ("terminate called without an active exception", seen under load)
torch.distributed.barrier()
torch.distributed.destroy_process_group()
"""


def initialise_deepspeed(world: int, jobs: list[dict[str, Any]], workdir: Path) -> list[dict[str, Any]]:
    """DeepSpeed's engine initialised on `world` CPU processes over gloo for each job ({"config": ds_config,
    "pp": stages, "model": {"layers", "hidden", "vocab"}, "seq_len"}), one optimizer step each; what rank 0's
    engine holds."""
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "jobs.json").write_text(json.dumps(jobs))
    (workdir / "runner.py").write_text(_DEEPSPEED_RUNNER)
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            f"--nproc-per-node={world}",
            "--standalone",  # its own free port on 127.0.0.1 (no port picked here and raced for)
            str(workdir / "runner.py"),
            str(workdir / "jobs.json"),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=workdir,
        env={**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"},
    )
    lines = [line for line in r.stdout.splitlines() if line.startswith("BERTH_RESULT ")]
    if r.returncode or not lines:
        raise RuntimeError(f"the DeepSpeed runner failed (rc {r.returncode}): {r.stdout[-1500:]} {r.stderr[-3000:]}")
    return json.loads(lines[-1].removeprefix("BERTH_RESULT "))


# --- torchtitan ---------------------------------------------------------------------------------------------

TRITON_KERNELS = "torchtitan.distributed.minimal_async_ep.kernels"


def _torchtitan_importable():
    """torchtitan 0.3.0 imports Triton kernels (MoE expert-parallel dispatch) at module level; CPU torch has no
    triton, so that one module is replaced by kernels that raise if ever launched."""
    if importlib.util.find_spec("triton") is not None or TRITON_KERNELS in sys.modules:
        return
    stand_in = types.ModuleType(TRITON_KERNELS)

    def __getattr__(name):
        if name.startswith("__"):
            raise AttributeError(name)

        def kernel(*args, **kwargs):
            raise RuntimeError(f"{TRITON_KERNELS}.{name}: a Triton GPU kernel, not available on this machine")

        return kernel

    stand_in.__getattr__ = __getattr__
    sys.modules[TRITON_KERNELS] = stand_in


def load_torchtitan(plan: Plan, files: dict[str, str], workdir: Path) -> dict[str, Any]:
    """berth_torchtitan.py through torchtitan's ConfigManager (--module/--config), ParallelDims and its stage
    split."""
    _torchtitan_importable()
    from torch.distributed.pipelining.schedules import get_schedule_class
    from torchtitan.config import ConfigManager
    from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC
    from torchtitan.distributed.parallel_dims import ParallelDims
    from torchtitan.distributed.pipeline_parallel import _generate_llm_fqn_per_model_part, _get_pipeline_metadata

    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "berth_torchtitan.py").write_text(files["berth_torchtitan.py"])
    env = {"BERTH_HF_ASSETS": str(workdir), "BERTH_DATASET": "c4_test"}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    sys.path.insert(0, str(workdir))
    sys.modules.pop("berth_torchtitan", None)
    try:
        c = ConfigManager().parse_args(["--module", "berth_torchtitan", "--config", "berth_plan"])
    finally:
        sys.path.remove(str(workdir))
        sys.modules.pop("berth_torchtitan", None)
        _restore(saved)
    p, t = c.parallelism, c.training
    dims = ParallelDims.from_config(p, plan.cluster.world_size)
    stages, layers_in = 1, []
    if p.pipeline_parallel_degree > 1:
        n, layers, first, last = _get_pipeline_metadata(dims, p, c.model_spec.model)
        parts = _generate_llm_fqn_per_model_part(n, layers, first, last)
        stages = len(parts)
        layers_in = [sum(m.startswith("layers.") for m in part) for part in parts]
        assert parts[0][0] == "tok_embeddings" and parts[-1][-2:] == ["norm", "lm_head"], parts
    dp = dims.dp_replicate * dims.dp_shard
    zero = {"always": 3, "never": 2, "default": 0}[p.fsdp_reshard_after_forward] if dims.dp_shard > 1 else 0
    recompute = {FullAC.Config: "full", SelectiveAC.Config: "selective", type(None): "none"}[
        type(c.activation_checkpoint)
    ]
    model = c.model_spec.model
    return {
        "tp": dims.tp,
        "cp": dims.cp,
        "pp": dims.pp,
        "vpp": stages // dims.pp,
        "dp": dp,
        "shard": dims.dp_shard,
        "zero": zero,
        "micro_batch": p.pipeline_parallel_microbatch_size if dims.pp > 1 else t.local_batch_size,
        "global_batch": t.global_batch_size,
        # torchtitan/trainer.py:430: accumulation = global / (local batch x data-parallel degree)
        "accumulation": t.global_batch_size // (t.local_batch_size * dp),
        "pipeline_microbatches": t.local_batch_size // p.pipeline_parallel_microbatch_size if dims.pp > 1 else 1,
        "schedule": get_schedule_class(p.pipeline_parallel_schedule).__name__ if dims.pp > 1 else None,
        "layers_per_stage": layers_in,
        "recompute": recompute,
        "sp": dims.tp > 1 and p.enable_sequence_parallel,
        "precision": "bf16" if t.mixed_precision_param == "bfloat16" else "fp32",
        "seq_len": t.seq_len,
        "world": dims.world_size,
        "num_layers": len(model.layers),
        "hidden": model.dim,
        "vocab": model.vocab_size,
    }


# torchtitan's trainer built in its own dry-run mode (--comm.mode fake_backend: a fake process group of the plan's
# world size, this process rank 0), in a subprocess per batch of plans. Stand-ins, each for a GPU-only piece: the
# device type answered "cpu" (torchtitan falls back to "cuda" when no accelerator is found, and torch.cuda.set_device
# fails without CUDA) and the GPU memory monitor (torch.cpu has no memory statistics).
_TORCHTITAN_TRAINER_RUNNER = r"""
import json, os, sys
import torch, torch._utils
torch._utils._get_available_device_type = lambda: "cpu"
from benchmarks import engine_check as ec
ec._torchtitan_importable()
try:  # Float8: the converter asks the local GPU for SM 8.9+; the plan's H100 answers yes (stand-in)
    import torchtitan.components.quantization.float8 as F8
    F8.has_cuda_capability = lambda *a: True
except ImportError:  # torchao absent: FP8 files stop in the converter, with torchtitan's own message
    pass
import torchtitan.components.metrics as M
class Monitor:
    device_name = "cpu (stand-in for the GPU)"
    device_capacity = 80 << 30
    def __init__(self, *a): pass
    def reset_peak_stats(self): pass
    def get_peak_stats(self): return M.DeviceMemStats(0, 0, 0, 0, 0, 0)
M.build_device_memory_monitor = lambda: Monitor()
from torchtitan.config import ConfigManager
from torchtitan.models.common.rope import RoPE
from tokenizers import Tokenizer, models, pre_tokenizers
jobs = json.loads(sys.stdin.read())
out = []
for job in jobs:
    workdir = job["workdir"]
    with open(os.path.join(workdir, "berth_torchtitan.py"), "w") as f:
        f.write(job["module"])
    # what the user supplies, made small here: a word-level tokenizer and a one-file text dataset (torchtitan's
    # c4_test entry reads tests/assets/c4_test under the working directory)
    words = ["<unk>", "<s>", "</s>"] + [f"w{i}" for i in range(40)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(os.path.join(workdir, "tokenizer.json"))
    os.makedirs(os.path.join(workdir, "tests/assets/c4_test"), exist_ok=True)
    with open(os.path.join(workdir, "tests/assets/c4_test/data.json"), "w") as f:
        f.writelines(json.dumps({"text": " ".join(words[3:])}) + "\n" for _ in range(8))
    os.chdir(workdir)
    os.environ.update(NGPU=str(job["world"]), RANK="0", LOCAL_RANK="0", BERTH_HF_ASSETS=workdir,
                      BERTH_DATASET="c4_test")
    sys.path.insert(0, workdir)
    sys.modules.pop("berth_torchtitan", None)
    try:
        c = ConfigManager().parse_args(["--module", "berth_torchtitan", "--config", "berth_plan",
                                        "--comm.mode", "fake_backend", "--dump_folder", workdir + "/out"])
        trainer = c.build()
        d = trainer.parallel_dims
        opt_params = sum(len(g["params"]) for o in trainer.optimizers.optimizers for g in o.param_groups)
        model_params = sum(1 for m in trainer.model_parts for p in m.parameters() if p.requires_grad)
        lrs = trainer.lr_schedulers.schedulers[0]
        rope = next(r for r in next(iter(trainer.model_config.traverse(RoPE.Config))) if isinstance(r, RoPE.Config))
        norm = trainer.model_config.layers[0].attention_norm
        out.append({
            "world": d.world_size, "dp_replicate": d.dp_replicate, "dp_shard": d.dp_shard, "tp": d.tp, "cp": d.cp,
            "pp": d.pp, "model_parts": len(trainer.model_parts), "optimizer_params": opt_params,
            "model_params": model_params, "lr": trainer.optimizers.optimizers[0].param_groups[0]["initial_lr"],
            "steps": c.training.steps, "warmup": c.lr_scheduler.warmup_steps, "decay": c.lr_scheduler.decay_type,
            "max_norm": c.training.max_norm,
            "checkpoint": c.checkpoint.enable, "checkpoint_interval": c.checkpoint.interval,
            "rope_theta": rope.theta, "rope_scaling": rope.scaling, "norm_eps": norm.eps,
            "tied": trainer.model_config.enable_weight_tying,
            "accumulation": trainer.gradient_accumulation_steps, "lr_scheduler": type(lrs).__name__,
            "float8_linears": sum(type(x).__name__ == "Float8Linear" for m in trainer.model_parts for x in m.modules()),
            "compiled": c.compile.enable,
        })
        trainer.close()
    except BaseException as e:
        out.append({"error": f"{type(e).__name__}: {e}"})
    finally:
        sys.path.remove(workdir)
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
print("BERTH_RESULT " + json.dumps(out))
"""


def small_model_plan(plan: Plan) -> Plan:
    """The plan with its model made small (head dimension 4, ffn 64, vocabulary 64 per tp rank) and every count
    the layout depends on kept: layers, heads, kv heads, world size, layout. The trainer then allocates rank 0's
    shard on CPU in seconds."""
    m = plan.model
    small = m.model_copy(
        update={"hidden_size": m.num_attention_heads * 4, "ffn_hidden_size": 64, "vocab_size": 64 * plan.layout.tp}
    )
    return plan.model_copy(update={"model": small})


def build_torchtitan_trainers(plans: list[tuple[Plan, dict[str, str]]], workdir: Path) -> list[dict[str, Any]]:
    """torchtitan's Trainer built from each plan's berth_torchtitan.py in its dry-run mode at the plan's world
    size (one subprocess for all); each result is what the built trainer holds, or {"error": ...}."""
    jobs = []
    for i, (plan, files) in enumerate(plans):
        d = workdir / f"tt{i}"
        d.mkdir(parents=True, exist_ok=True)
        jobs.append({"workdir": str(d), "module": files["berth_torchtitan.py"], "world": plan.cluster.world_size})
    root = str(Path(__file__).resolve().parent.parent)
    env = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return _run_runner(_TORCHTITAN_TRAINER_RUNNER, jobs, "the torchtitan trainer runner", cwd=root, env=env)


def _run_runner(source: str, jobs: list[dict[str, Any]], name: str, **kw: Any) -> Any:
    """Run a runner script (`python -c source`) on `jobs` (JSON on its stdin) and return what it printed after
    BERTH_RESULT; a runner that printed none failed, and its stderr says why."""
    r = subprocess.run(
        [sys.executable, "-c", source], input=json.dumps(jobs), capture_output=True, text=True, timeout=900, **kw
    )
    lines = [line for line in r.stdout.splitlines() if line.startswith("BERTH_RESULT ")]
    if not lines:
        raise RuntimeError(f"{name} failed (rc {r.returncode}): {r.stderr[-3000:]}")
    return json.loads(lines[-1].removeprefix("BERTH_RESULT "))


# --- megatron-core (PyPI) -----------------------------------------------------------------------------------
# CI has no Megatron-LM checkout, and megatron-core's wheel ships megatron/core only (no megatron/training, so no
# parse_args / validate_args). What it does ship checks the recorded argv of megatron-launch.sh: the arguments are
# read into megatron-core's own config classes as Megatron-LM's core_transformer_config_from_args does (every
# argument named like a TransformerConfig field is passed as it is; the renames below are that function's), and
# their __post_init__ checks run (TransformerConfig, ModelParallelConfig, DistributedDataParallelConfig,
# OptimizerConfig); the process groups are initialised by parallel_state.initialize_model_parallel on a fake process
# group of the plan's world size; the microbatch calculator, the LR schedule (OptimizerParamScheduler) and the rotary
# embedding (RotaryEmbedding: base and Llama 3 scaling) are built. Stand-in: torch.cuda.get_device_capability
# answered (9, 0) for --moe-grouped-gemm's check.
MEGATRON_CORE_VERSION = "0.16.1"  # the newest megatron-core for Python 3.11 (0.17+ need Python 3.12)
_MEGATRON_CORE_RUNNER = r"""
import dataclasses, json, re, sys
import torch, torch.nn.functional as F
torch.cuda.get_device_capability = lambda *a: (9, 0)
from torch.testing._internal.distributed.fake_pg import FakeStore
import megatron.core
from megatron.core import parallel_state as ps
from megatron.core.distributed import DistributedDataParallelConfig
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.num_microbatches_calculator import (destroy_num_microbatches_calculator, get_num_microbatches,
                                                       init_num_microbatches_calculator)
from megatron.core.optimizer import OptimizerConfig
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.transformer.enums import AttnBackend
from megatron.core.transformer.pipeline_parallel_layer_layout import PipelineParallelLayerLayout
from megatron.core.transformer.transformer_config import TransformerConfig

RENAMES = {"norm_epsilon": "layernorm_epsilon", "num_experts": "num_moe_experts",
           "decoder_first_pipeline_num_layers": "num_layers_in_first_pipeline_stage",
           "decoder_last_pipeline_num_layers": "num_layers_in_last_pipeline_stage",
           "fp8_format": "fp8", "fp8_param_gather": "fp8_param"}


def value(text):
    if re.fullmatch(r"-?\d+", text):
        return int(text)
    try:
        return float(text)
    except ValueError:
        return text


def parse(argv):
    out, i = {}, 0
    while i < len(argv):
        assert argv[i].startswith("--"), argv[i]
        key = argv[i][2:].replace("-", "_")
        if i + 1 < len(argv) and not argv[i + 1].startswith("--"):
            out[key], i = value(argv[i + 1]), i + 2
        else:
            out[key], i = True, i + 1
    return out


def check(job):
    a = parse(job["argv"])
    fields = {f.name for f in dataclasses.fields(TransformerConfig)}
    kw = {RENAMES.get(k, k): v for k, v in a.items() if RENAMES.get(k, k) in fields}
    kw.pop("attention_backend", None)
    if a.get("attention_backend"):
        kw["attention_backend"] = AttnBackend[a["attention_backend"]]
    if a.get("swiglu"):
        kw.update(gated_linear_unit=True, activation_func=F.silu, bias_activation_fusion=False)
    if a.get("disable_bias_linear"):
        kw["add_bias_linear"] = False
    if not a.get("group_query_attention"):
        kw.pop("num_query_groups", None)
    kw["params_dtype"] = torch.bfloat16 if a.get("bf16") else torch.float16 if a.get("fp16") else torch.float32
    kw["pipeline_dtype"] = kw["params_dtype"]  # core_transformer_config_from_args: pipeline_dtype = params_dtype
    if isinstance(kw.get("moe_layer_freq"), str):  # Megatron-LM evaluates the pattern (arguments.py moe_freq_type)
        kw["moe_layer_freq"] = eval(kw["moe_layer_freq"], {"__builtins__": {}})
    pp = a["pipeline_model_parallel_size"]
    vpp = None
    if a.get("num_layers_per_virtual_pipeline_stage"):
        vpp = a["num_layers"] // pp // a["num_layers_per_virtual_pipeline_stage"]
    if a.get("pipeline_model_parallel_layout"):
        vpp = PipelineParallelLayerLayout.get_num_stages_from_str(a["pipeline_model_parallel_layout"]) // pp
        vpp = vpp if vpp > 1 else None
    kw["virtual_pipeline_model_parallel_size"] = vpp
    config = TransformerConfig(**kw)
    world, tp, cp = job["world"], a["tensor_model_parallel_size"], a.get("context_parallel_size", 1)
    torch.distributed.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        ps.initialize_model_parallel(
            tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=vpp,
            context_parallel_size=cp, expert_model_parallel_size=a.get("expert_model_parallel_size", 1),
            expert_tensor_parallel_size=a.get("expert_tensor_parallel_size"),
            num_distributed_optimizer_instances=a.get("num_distributed_optimizer_instances", 1),
            order="tp-cp-ep-pp-dp" if a.get("use_tp_pp_dp_mapping") else "tp-cp-ep-dp-pp",
            create_gloo_process_groups=False)
        dp = ps.get_data_parallel_world_size()
        ps.destroy_model_parallel()
    finally:
        torch.distributed.destroy_process_group()
    ddp = DistributedDataParallelConfig(
        use_distributed_optimizer=bool(a.get("use_distributed_optimizer")),
        num_distributed_optimizer_instances=a.get("num_distributed_optimizer_instances", 1),
        data_parallel_sharding_strategy=a.get("data_parallel_sharding_strategy", "no_shard"),
        use_megatron_fsdp=bool(a.get("use_megatron_fsdp")), overlap_grad_reduce=bool(a.get("overlap_grad_reduce")),
        overlap_param_gather=bool(a.get("overlap_param_gather")))
    opt = OptimizerConfig(optimizer=a["optimizer"], lr=a["lr"], min_lr=a["min_lr"], weight_decay=a["weight_decay"],
                          adam_beta1=a["adam_beta1"], adam_beta2=a["adam_beta2"], adam_eps=a["adam_eps"],
                          clip_grad=a["clip_grad"], bf16=bool(a.get("bf16")), fp16=bool(a.get("fp16")),
                          params_dtype=kw.get("params_dtype", torch.float32),
                          use_distributed_optimizer=ddp.use_distributed_optimizer)
    init_num_microbatches_calculator(0, None, a["global_batch_size"], a["micro_batch_size"], dp)
    microbatches = get_num_microbatches()
    destroy_num_microbatches_calculator()
    # Megatron-LM counts the schedule in samples (training.py get_optimizer_param_scheduler: iterations x global batch)
    gbs = a["global_batch_size"]
    torch_opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=opt.lr)
    sched = OptimizerParamScheduler(torch_opt, init_lr=0.0, max_lr=opt.lr, min_lr=opt.min_lr,
                                    lr_warmup_steps=a["lr_warmup_iters"] * gbs,
                                    lr_decay_steps=a["lr_decay_iters"] * gbs, lr_decay_style=a["lr_decay_style"],
                                    start_wd=opt.weight_decay, end_wd=opt.weight_decay, wd_incr_steps=1,
                                    wd_incr_style="constant")
    sched.num_steps = a["lr_warmup_iters"] * gbs
    lr_after_warmup = sched.get_lr(torch_opt.param_groups[0])
    sched.num_steps = a["train_iters"] * gbs
    lr_at_end = sched.get_lr(torch_opt.param_groups[0])
    rope = RotaryEmbedding(config.kv_channels, rotary_percent=1.0, rotary_base=a["rotary_base"],
                           rope_scaling=bool(a.get("use_rope_scaling")),
                           rope_scaling_factor=a.get("rope_scaling_factor", 8.0), use_cpu_initialization=True)
    return {
        "tp": config.tensor_model_parallel_size, "pp": config.pipeline_model_parallel_size,
        "vpp": config.virtual_pipeline_model_parallel_size or 1, "cp": config.context_parallel_size,
        "dp": dp, "ep": config.expert_model_parallel_size, "etp": config.expert_tensor_parallel_size,
        "sp": config.sequence_parallel, "microbatches": microbatches, "num_layers": config.num_layers,
        "hidden": config.hidden_size, "heads": config.num_attention_heads, "kv_heads": config.num_query_groups,
        "ffn": config.ffn_hidden_size, "norm_eps": config.layernorm_epsilon, "swiglu": config.gated_linear_unit,
        "bias": config.add_bias_linear, "qkv_bias": config.add_qkv_bias, "dropout": [config.attention_dropout,
        config.hidden_dropout], "recompute": config.recompute_granularity or "none",
        "distributed_optimizer": ddp.use_distributed_optimizer, "lr": opt.lr,
        "overlap": [ddp.overlap_grad_reduce, ddp.overlap_param_gather],
        "lr_after_warmup": lr_after_warmup, "lr_at_end": lr_at_end,
        "inv_freq": [float(rope.inv_freq[1]), float(rope.inv_freq[-1])],
        "experts": config.num_moe_experts or 0,
        "fp8": config.fp8, "fp8_recipe": config.fp8_recipe if config.fp8 else None, "fp8_param": config.fp8_param,
        "fp8_amax": [config.fp8_amax_history_len, config.fp8_amax_compute_algo],
    }


out = []
for job in json.loads(sys.stdin.read()):
    try:
        out.append(check(job))
    except BaseException as e:
        out.append({"error": f"{type(e).__name__}: {e}"})
print("BERTH_RESULT " + json.dumps({"version": megatron.core.__version__, "results": out}))
"""


def check_megatron_core(jobs: list[dict[str, Any]]) -> dict[str, Any]:
    """Each job ({"argv": pretrain_gpt.py's arguments, "world": ranks}) through megatron-core's own classes (one
    subprocess); {"version": megatron-core's, "results": [values or {"error": ...}]}."""
    return _run_runner(_MEGATRON_CORE_RUNNER, jobs, "the megatron-core runner")


# --- Megatron-LM --------------------------------------------------------------------------------------------

_MEGATRON_RUNNER = r"""
import json, os, shlex, sys
jobs = json.loads(sys.stdin.read())
sys.path.insert(0, os.environ["BERTH_MEGATRON_DIR"])
try:
    import megatron.training.arguments as A
except Exception as e:  # an import the checkout needs and this machine lacks
    print(json.dumps({"import_error": f"{type(e).__name__}: {e}"}))
    sys.exit(0)
A.get_device_arch_version = lambda: 9  # stand-in for the torch.cuda query: Hopper
A.torch.cuda.get_device_capability = lambda *a: (9, 0)  # the same for --moe-grouped-gemm's check
out = []
for job in jobs:
    os.environ.update(WORLD_SIZE=str(job["world"]), RANK="0", LOCAL_RANK="0")
    os.environ.pop("CUDA_DEVICE_MAX_CONNECTIONS", None)
    os.environ.update(job["env"])
    sys.argv = ["pretrain_gpt.py", *job["argv"]]
    try:
        args = A.parse_args()
        A.validate_args(args, {})
    except BaseException as e:
        out.append({"error": f"{type(e).__name__}: {e}"})
        continue
    out.append({k: (v if isinstance(v, (int, float, str, bool, type(None))) else str(v))
                for k, v in vars(args).items()})
print(json.dumps(out))
"""

PLACEHOLDER_VALUES = {"${TOKENIZER_MODEL}": "meta-llama/Llama-3.1-8B", "${DATA_PATH}": "/data/tokens_text_document"}


def megatron_job(plan: Plan, files: dict[str, str]) -> dict[str, Any]:
    """The argv (placeholders filled) and environment megatron-launch.sh gives pretrain_gpt.py."""
    import shlex

    text = "\n".join(line for line in files["megatron-args.txt"].splitlines() if not line.startswith("#"))
    for k, v in PLACEHOLDER_VALUES.items():
        text = text.replace(k, v)
    env = {}
    for line in files["megatron-launch.sh"].splitlines():
        if line.startswith("export "):
            k, v = line.split()[1].split("=", 1)
            env[k] = v
    return {"argv": shlex.split(text.replace("\\\n", " ")), "env": env, "world": plan.cluster.world_size}


def run_megatron(jobs: list[dict[str, Any]], megatron_dir: str) -> list[dict[str, Any]] | str:
    """Megatron's parse_args + validate_args on each job, in one subprocess; or why it could not run."""
    r = subprocess.run(
        [sys.executable, "-c", _MEGATRON_RUNNER],
        input=json.dumps(jobs),
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "BERTH_MEGATRON_DIR": megatron_dir},
    )
    lines = [line for line in r.stdout.splitlines() if line.startswith(("[", "{"))]
    if r.returncode or not lines:
        return f"the Megatron runner failed (rc {r.returncode}): {r.stderr[-2000:]}"
    result = json.loads(lines[-1])
    if isinstance(result, dict):
        return result["import_error"]
    return result


def megatron_values(args: dict[str, Any]) -> dict[str, Any]:
    """Megatron's parsed arguments in the common vocabulary."""
    dp = args["data_parallel_size"]
    fsdp = args.get("use_megatron_fsdp")
    zero = (
        {"optim_grads": 2, "optim_grads_params": 3}[args["data_parallel_sharding_strategy"]]
        if fsdp
        else 1
        if args["use_distributed_optimizer"]
        else 0
    )
    precision = "bf16" if args["bf16"] else "fp16" if args["fp16"] else "fp32"
    return {
        "tp": args["tensor_model_parallel_size"],
        "cp": args["context_parallel_size"],
        "pp": args["pipeline_model_parallel_size"],
        "vpp": args["virtual_pipeline_model_parallel_size"] or 1,
        "dp": dp,
        "zero": zero,
        "shard": dp // args["num_distributed_optimizer_instances"] if zero else 1,
        "micro_batch": args["micro_batch_size"],
        "global_batch": args["global_batch_size"],
        "accumulation": args["global_batch_size"] // (args["micro_batch_size"] * dp),
        "recompute": args["recompute_granularity"] or "none",
        "sp": args["sequence_parallel"],
        "precision": precision,
        "seq_len": args["seq_length"],
        "num_layers": args["num_layers"],
        "hidden": args["hidden_size"],
        "ffn": args["ffn_hidden_size"],
        "heads": args["num_attention_heads"],
        "kv_heads": args["num_query_groups"] if args["group_query_attention"] else args["num_attention_heads"],
        "rope": args["position_embedding_type"] == "rope",
        "bias": args["add_bias_linear"],
        "swiglu": args["swiglu"],
        "norm": args["normalization"],
        "untied": args["untie_embeddings_and_output_weights"],
        "tp_pp_dp": args["use_tp_pp_dp_mapping"],
        **_megatron_moe_values(args),
    }


def _megatron_moe_values(args: dict[str, Any]) -> dict[str, Any]:
    """The mixture-of-experts arguments Megatron parsed (none for a dense model)."""
    if not args.get("num_experts"):
        return {}
    return {
        "experts": args["num_experts"],
        "topk": args["moe_router_topk"],
        "expert_ffn": args["moe_ffn_hidden_size"],
        "shared_ffn": args["moe_shared_expert_intermediate_size"] or 0,
        "moe_layer_freq": args["moe_layer_freq"],
        "ep": args["expert_model_parallel_size"],
        "etp": args["expert_tensor_parallel_size"],
        "dispatcher": args["moe_token_dispatcher_type"],
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--megatron-dir", help="a Megatron-LM checkout (default: $BERTH_MEGATRON_DIR)")
    ap.add_argument("--json", action="store_true", help="print the results as JSON")
    a = ap.parse_args(argv)
    if a.megatron_dir:
        os.environ["BERTH_MEGATRON_DIR"] = a.megatron_dir
    plans = plan_set()
    rows: list[dict[str, Any]] = []
    skipped = {e: available(e) for e in ENGINES}
    core = skipped["megatron"] is not None and available("megatron-core") is None  # no checkout: megatron-core
    if core:
        skipped["megatron"] = None
    jobs, job_rows = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for i, (name, plan) in enumerate(plans):
            for engine in ENGINES:
                row = {"plan": name, "engine": engine, "version": ENGINE_VERSIONS[engine]}
                rows.append(row)
                try:
                    files = artifacts(plan, engine)
                except LaunchRefused as e:
                    row.update(status="refused", detail=str(e))
                    continue
                if skipped[engine]:
                    row.update(status="not checked", detail=skipped[engine])
                    continue
                try:
                    if engine == "deepspeed":
                        row.update(status="accepted", parsed=load_deepspeed(plan, files))
                    elif engine == "torchtitan":
                        row.update(status="accepted", parsed=load_torchtitan(plan, files, Path(tmp) / str(i)))
                    else:
                        jobs.append(megatron_job(plan, files))
                        job_rows.append(row)
                except Exception as e:  # the engine rejected the artifact: that is the finding
                    row.update(status="rejected", detail=f"{type(e).__name__}: {e}")
    release()
    if jobs and core:
        checked = check_megatron_core([{"argv": j["argv"], "world": j["world"]} for j in jobs])
        for row, r in zip(job_rows, checked["results"], strict=True):
            row["version"] += f" (checked with megatron-core {checked['version']}'s classes)"
            if "error" in r:
                row.update(status="rejected", detail=r["error"])
            else:
                row.update(status="accepted", parsed=r)
    elif jobs:
        result = run_megatron(jobs, os.environ["BERTH_MEGATRON_DIR"])
        for row, r in zip(job_rows, result if isinstance(result, list) else [None] * len(jobs), strict=True):
            if r is None:
                row.update(status="not checked", detail=result)
            elif "error" in r:
                row.update(status="rejected", detail=r["error"])
            else:
                row.update(status="accepted", parsed=megatron_values(r))
    if a.json:
        print(json.dumps(rows, indent=1))
    else:
        for r in rows:
            print(f"{r['plan']:<70} {r['engine']:<10} {r['status']:<11} {r.get('detail', '')[:110]}")
        counts = {s: sum(r["status"] == s for r in rows) for s in ("accepted", "refused", "rejected", "not checked")}
        print(f"{len(plans)} plans x {len(ENGINES)} engines: {counts}; versions: {ENGINE_VERSIONS}")
    return 1 if any(r["status"] == "rejected" for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
