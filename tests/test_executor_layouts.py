"""Every layout is real: gloo processes under torchrun reproduce the single-process losses of the
same seed (fp32 on CPU). Tolerance: 1e-5 relative, where reordered floating-point sums differ by
about 1e-7 (measured: every layout below matches to 1e-7).

Launches are grouped because each torchrun costs seconds (reference: 4-10 s to start): one for every
two-process layout of every model here (`two`), one for the four-process ones (`four`); the memory
comparison runs apart, so that no other plan's tensors sit in the peaks it compares. Four and
eight processes on this 2-core machine are oversubscribed: functional checks only. Three parallel
axes of size >= 2 need eight processes (4 = 2 x 2 holds two), so the 3-D layouts run on eight.
"""

import json
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")

from berth.executor.train import run_steps  # noqa: E402
from berth.specs import __version__  # noqa: E402
from berth.specs.models import presets  # noqa: E402
from berth.specs.tree import Layout, ModelSpec, Plan, TrainingSpec  # noqa: E402
from berth.topology.clusters import cluster_from_preset  # noqa: E402
from tests.conftest import rerun_if_aborted  # noqa: E402

STEPS = 3
MODEL = presets()["tiny-gpt"]
TRAINING = TrainingSpec(seq_len=64, global_batch_size=8, precision="fp32")

TWO = [
    Layout(dp=2, micro_batch_size=2, num_microbatches=2),
    Layout(dp=2, zero_stage=1, shard=2, micro_batch_size=4, num_microbatches=1),
    Layout(dp=2, zero_stage=2, shard=2, micro_batch_size=2, num_microbatches=2, recompute="selective"),
    Layout(dp=2, zero_stage=3, shard=2, micro_batch_size=1, num_microbatches=4, recompute="full"),
    Layout(dp=2, zero_stage=3, shard=2, micro_batch_size=4, num_microbatches=1),
    Layout(tp=2, micro_batch_size=4, num_microbatches=2),
    Layout(tp=2, sequence_parallel=True, micro_batch_size=8, recompute="selective"),
    Layout(pp=2, micro_batch_size=2, num_microbatches=4, schedule="gpipe"),
    Layout(pp=2, micro_batch_size=2, num_microbatches=4, schedule="1f1b", recompute="full"),
    Layout(pp=2, micro_batch_size=2, num_microbatches=4, schedule="interleaved_1f1b", virtual_stages=2),
]
FOUR = [
    Layout(dp=4, zero_stage=3, shard=2, micro_batch_size=1, num_microbatches=2),  # hybrid: 2-D mesh
    Layout(dp=4, zero_stage=2, shard=2, micro_batch_size=2, num_microbatches=1),
    Layout(tp=2, dp=2, micro_batch_size=2, num_microbatches=2),
    Layout(tp=2, dp=2, zero_stage=3, shard=2, sequence_parallel=True, micro_batch_size=4, recompute="full"),
    Layout(pp=2, tp=2, sequence_parallel=True, micro_batch_size=2, num_microbatches=4),
    Layout(
        pp=2,
        dp=2,
        zero_stage=2,
        shard=2,
        micro_batch_size=1,
        num_microbatches=4,
        schedule="interleaved_1f1b",
        virtual_stages=2,
    ),
    # axis orders other than tp-dp-pp: the mesh is built from each rank's coordinates
    Layout(tp=2, dp=2, zero_stage=3, shard=2, micro_batch_size=2, num_microbatches=2, axis_order="dp-tp-pp"),
    Layout(pp=2, dp=2, micro_batch_size=1, num_microbatches=4, axis_order="pp-dp-tp"),
]
EIGHT = [
    Layout(pp=2, tp=2, dp=2, zero_stage=3, shard=2, sequence_parallel=True, micro_batch_size=2, num_microbatches=2),
    Layout(pp=2, tp=2, dp=2, micro_batch_size=1, num_microbatches=4, schedule="interleaved_1f1b", virtual_stages=2),
]


def launch(tmp_path, layouts, nproc, model=MODEL, training=TRAINING):
    return launch_groups(tmp_path, {"": (model, layouts)}, nproc, training)[""]


def launch_groups(tmp_path, groups, nproc, training=TRAINING):
    """One torchrun for several models' layouts ({name: (model, layouts)}): each name's results."""
    cluster = cluster_from_preset("dgx-a100-80g", 1)
    wanted = [(m, x) for m, xs in groups.values() for x in xs]
    plans = [
        Plan(
            berth_version=__version__, model=m, training=training, cluster=cluster, layout=x, prediction=None
        ).model_dump(mode="json")
        for m, x in wanted
    ]
    (tmp_path / "plans.json").write_text(json.dumps(plans))
    out = tmp_path / "out.json"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        "-m",
        "berth.executor.worker",
        "--plans",
        str(tmp_path / "plans.json"),
        "--steps",
        str(STEPS),
        "--out",
        str(out),
    ]
    r = rerun_if_aborted(lambda: subprocess.run(cmd, capture_output=True, text=True, timeout=400))
    assert out.is_file(), r.stderr[-3000:]
    results = json.loads(out.read_text())["results"]
    assert [Layout(**r["layout"]) for r in results] == [x for _, x in wanted]
    by_name, start = {}, 0
    for name, (_, xs) in groups.items():
        by_name[name] = results[start : start + len(xs)]
        start += len(xs)
    return by_name


@pytest.fixture(scope="module")
def reference():
    losses = run_steps(MODEL, TRAINING, Layout(micro_batch_size=8), STEPS).losses
    assert losses[-1] < losses[0]
    return losses


def check(results, reference, nproc):
    for res in results:
        assert res["losses"] == pytest.approx(reference, rel=1e-5), res["layout"]
        assert len(res["ranks"]) == nproc
        for rank in res["ranks"]:
            assert all(t > 0 for t in rank["step_times_s"])
            assert rank["peak_memory_bytes"] > 0


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    """Every two-process layout of this module, in one torchrun."""
    groups = {
        "tiny-gpt": (MODEL, TWO),
        "cp": (MODEL, CP_TWO),
        "uneven": (SEVEN_LAYERS, UNEVEN),
        "odd_vocab": (ODD_VOCAB, ODD_VOCAB_LAYOUTS),
    }
    groups.update({m.name: (m, MOE_TWO) for m in (MOE, MOE_SHARED)})
    return launch_groups(tmp_path_factory.mktemp("two"), groups, 2)


@pytest.fixture(scope="module")
def four(tmp_path_factory):
    """Every four-process layout of this module, in one torchrun."""
    groups = {"tiny-gpt": (MODEL, FOUR), "cp": (MODEL, CP_FOUR)}
    groups.update({m.name: (m, MOE_FOUR) for m in (MOE, MOE_SHARED)})
    return launch_groups(tmp_path_factory.mktemp("four"), groups, 4)


def test_dp_tp_pp_layouts_on_two_processes_match_single_process(two, reference):
    check(two["tiny-gpt"], reference, 2)


def test_sharding_lowers_measured_memory(tmp_path):
    """On 2 ranks ZeRO-3 (parameters, gradients and optimizer state sharded) holds clearly less than
    ZeRO-1 (optimizer state only), which holds less than DDP, with the same micro-batch (CPU
    profiler). A 12-layer variant of tiny-gpt with short sequences, so that model state dominates
    and FSDP2's one unsharded layer and unsharded root (embeddings) are a small part of it. The peak
    of a sharded run varies with collective timing (up to ~15 MiB, reference "Measuring memory on
    CPU"), so each layout runs twice, interleaved, and the lower peak counts.
    Measured (min of two, 4 runs): ZeRO-1 / DDP 0.77; ZeRO-3 / ZeRO-1 0.74-0.84 (single runs up to 0.91);
    the ideal ratio of model state alone is 8/12."""
    model = MODEL.model_copy(update={"num_layers": 12})
    training = TrainingSpec(seq_len=32, global_batch_size=4, precision="fp32")
    layouts = [
        Layout(dp=2, micro_batch_size=2),
        Layout(dp=2, zero_stage=1, shard=2, micro_batch_size=2),
        Layout(dp=2, zero_stage=3, shard=2, micro_batch_size=2),
    ]
    results = launch(tmp_path, layouts * 2, 2, model=model, training=training)
    ddp, zero1, zero3 = (
        min(max(r["peak_memory_bytes"] for r in results[i + k]["ranks"]) for k in (0, 3)) for i in range(3)
    )
    assert zero1 < 0.95 * ddp
    assert zero3 < 0.95 * zero1


def test_2d_layouts_on_four_processes_match_single_process(four, reference):
    check(four["tiny-gpt"], reference, 4)


def test_3d_layouts_on_eight_processes_match_single_process(tmp_path, reference):
    check(launch(tmp_path, EIGHT, 8), reference, 8)


SEVEN_LAYERS = MODEL.model_copy(update={"name": "tiny-gpt-7-layers", "num_layers": 7})
UNEVEN = [
    Layout(pp=2, micro_batch_size=2, num_microbatches=4, schedule="1f1b"),
    Layout(pp=2, micro_batch_size=2, num_microbatches=4, schedule="gpipe", recompute="full"),
    Layout(pp=2, micro_batch_size=2, num_microbatches=4, schedule="interleaved_1f1b", virtual_stages=2),
]


def test_uneven_pipeline_stages_match_single_process(two):
    """Stages of unequal depth (specs/stages.py): a 7-layer tiny-gpt on pp = 2 holds 4 and 3 layers
    (1F1B and GPipe), and with 2 virtual stages chunks of 2, 2, 2 and 1; each reproduces the
    single-process losses of the same 7-layer model."""
    from berth.executor.model import build_model
    from berth.executor.parallel import pipeline_chunk

    whole = build_model(SEVEN_LAYERS, 0)
    held = [sorted(int(k) for k in pipeline_chunk(whole, i, 2, 2).layers) for i in range(4)]
    assert held == [[0, 1], [2, 3], [4, 5], [6]]
    assert [len(pipeline_chunk(whole, i, 2).layers) for i in range(2)] == [4, 3]
    reference = run_steps(SEVEN_LAYERS, TRAINING, Layout(micro_batch_size=8), STEPS).losses
    check(two["uneven"], reference, 2)


CP_TWO = [
    Layout(cp=2, micro_batch_size=4, num_microbatches=2),
    Layout(cp=2, micro_batch_size=8, recompute="selective"),
]
CP_FOUR = [
    Layout(cp=4, micro_batch_size=4, num_microbatches=2),
    Layout(cp=2, tp=2, sequence_parallel=True, micro_batch_size=4, num_microbatches=2),
    Layout(cp=2, dp=2, zero_stage=3, shard=2, micro_batch_size=2, num_microbatches=2),
    Layout(cp=2, pp=2, micro_batch_size=2, num_microbatches=4, schedule="1f1b"),
]


def test_cp_layouts_match_single_process(two, reference):
    """Context parallelism on PyTorch's context-parallel API (executor/context_parallel.py: the head-tail
    load balancer's chunks r and 2cp-1-r of every sequence, rotary at global positions, the API's ring
    attention with the CPU stand-in for the fused flash kernel): cp = 2 alone (DDP over dp x cp) and with
    selective recompute (the ring re-run in backward) reproduce the single-process losses."""
    results = two["cp"]
    check(results, reference, 2)
    assert all("CPU stand-in" in " ".join(r["executed_as"]) for r in results)


def test_cp_with_tp_and_dp_match_single_process(four, reference):
    """cp = 4 alone (the ring's four steps, each rank's two chunks meeting three other ranks'); cp = 2 with
    tp = 2 (sequence parallel inside the cp chunk), with dp = 2 (ZeRO-3: FSDP2 over dp, the gradients then
    averaged over cp) and with pp = 2 (1F1B: stages send the s/cp-token chunks), on four processes."""
    check(four["cp"], reference, 4)


# A small mixture of experts: 4 experts top-2 (one shared expert in the second case), 2 layers, h 64.
MOE = MODEL.model_copy(
    update={
        "name": "tiny-moe",
        "num_layers": 2,
        "hidden_size": 64,
        "num_attention_heads": 4,
        "ffn_hidden_size": 128,
        "vocab_size": 256,
        "mlp": "swiglu",
        "norm": "rmsnorm",
        "num_experts": 4,
        "experts_per_token": 2,
        "moe_ffn_hidden_size": 96,
    }
)
MOE_SHARED = MOE.model_copy(update={"name": "tiny-moe-shared", "num_shared_experts": 1, "first_k_dense": 1})
# validators run on the copies
MOE, MOE_SHARED = (ModelSpec.model_validate(m.model_dump()) for m in (MOE, MOE_SHARED))
MOE_TWO = [
    Layout(dp=2, ep=2, micro_batch_size=2, num_microbatches=2),
    Layout(dp=2, micro_batch_size=4, num_microbatches=1),
]
MOE_FOUR = [Layout(dp=4, ep=2, micro_batch_size=2, num_microbatches=1)]


@pytest.mark.parametrize("model", [MOE, MOE_SHARED], ids=["moe", "moe_shared_first_dense"])
def test_moe_expert_parallel_matches_single_process(two, four, model):
    """Expert parallelism (executor/model.py MoE, executor/parallel.py apply_ep): ep = 2 on 2 and on 4
    gloo ranks (2 ep groups, expert gradients reduced over the expert-data-parallel pairs) and ep = 1
    with dp = 2 reproduce the single-process losses of the same seed. The router has no capacity limit
    (no token dropped), so only summation order differs. The executor's parameters equal
    ModelSpec.num_params."""
    from berth.executor.model import build_model

    assert sum(p.numel() for p in build_model(model).parameters()) == model.num_params
    reference = run_steps(model, TRAINING, Layout(micro_batch_size=8), STEPS).losses
    assert reference[-1] < reference[0]
    check(two[model.name], reference, 2)
    check(four[model.name], reference, 4)


# An odd vocabulary (1,001 tokens; GPT-2's 50,257 is odd too): tp = 2 does not divide it.
ODD_VOCAB = ModelSpec.model_validate(
    MODEL.model_copy(update={"name": "tiny-gpt-v1001", "vocab_size": 1001}).model_dump()
)
ODD_VOCAB_LAYOUTS = [
    Layout(tp=2, micro_batch_size=4, num_microbatches=2),
    Layout(tp=2, sequence_parallel=True, micro_batch_size=8, recompute="selective"),
    Layout(tp=2, micro_batch_size=2, num_microbatches=4, recompute="full"),
]


def test_odd_vocabulary_at_tp2_pads_and_matches_single_process(two):
    """The executor pads the vocabulary to a multiple of tp (executor/model.py padded_vocab, as Megatron-LM
    and torchtitan run any vocabulary) and masks the padded logits out of the softmax: tp = 2 on 2 gloo
    ranks (with sequence parallelism, selective and full recomputation) runs a 1,001-token vocabulary and reproduces the
    single-process, unpadded losses of the same seed. The pre-flight check and `berth validate`'s rules
    no longer refuse it, and the cost model counts the padded rows a rank holds (ceil(V / tp))."""
    from berth.cost_models import memory
    from berth.executor.model import build_model, padded_vocab
    from berth.specs.validity import EXECUTOR, Facts, violations

    model = ODD_VOCAB
    assert padded_vocab(model, 2) == 1002 and padded_vocab(model, 1) == 1001
    assert float(memory.vocab_rows(model, 2)) == 501
    # the cost model's embedding, head and logits count the padded vocabulary: as if it had 1,002 tokens
    even = model.model_copy(update={"vocab_size": 1002})
    assert float(memory.stage_params(model, 1, 2, True)) == float(memory.stage_params(even, 1, 2, True))
    assert float(memory.logits_bytes(model, TRAINING, 1, 2)) == float(memory.logits_bytes(even, TRAINING, 1, 2))
    padded = build_model(model, tp=2)
    assert padded.output.weight.shape[0] == 1002 and padded.output.bias[-1].item() == float("-inf")
    # the real rows are the unpadded model's (the same draws), the padded row zeros
    assert torch.equal(padded.tok_embeddings.weight[:1001], build_model(model).tok_embeddings.weight)
    layouts = ODD_VOCAB_LAYOUTS
    facts = Facts(model, TRAINING, 2)
    assert all(not violations(x, facts, who=EXECUTOR) for x in layouts)
    reference = run_steps(model, TRAINING, Layout(micro_batch_size=8), STEPS).losses
    assert reference[-1] < reference[0]
    check(two["odd_vocab"], reference, 2)
