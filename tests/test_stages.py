"""Uneven pipeline stages (specs/stages.py): the split rule, its validity, and how the cost model
weighs stages of unequal depth (the slowest stage sets the step, the largest the memory)."""

import numpy as np
import pytest

from berth.cost_models import memory
from berth.cost_models.step import evaluate
from berth.planner.search import predict_layouts, search
from berth.specs import stages
from berth.specs.candidates import Candidates
from berth.specs.errors import BerthError
from berth.specs.layouts import check_layout, layout_problems
from berth.specs.models import load_model
from berth.specs.tree import Layout, SearchSpec, TrainingSpec
from berth.specs.validity import REASON_CODES
from berth.topology.clusters import cluster_from_preset


def test_the_rule_by_hand():
    # Llama 3 405B on PP 16: one layer fewer on the first and the last stage (Llama 3 paper, Sec. 3.3.2)
    assert stages.stage_layers(126, 16) == [7, *[8] * 14, 7]
    assert stages.chunk_layers(126, 16, 2) == [3, *[4] * 30, 3]
    assert stages.stage_layers(126, 16, 2) == [7, *[8] * 14, 7]
    assert stages.chunk_layers(80, 4, 3) == [5, *[7] * 10, 5]
    assert stages.chunk_layers(7, 2) == [4, 3]  # an odd remainder: the last (LM head, loss) gives it up
    assert stages.chunk_layers(80, 4, 5) == [4] * 20 and stages.chunk_layers(1, 1) == [1]  # even: as before
    assert stages.chunk_offsets(7, 2, 2) == [0, 2, 4, 6, 7]
    for L, pp, vpp in [(4, 8, 1), (5, 4, 1), (126, 16, 3), (2, 2, 2)]:  # a stage would hold no layer
        assert not stages.split(L, pp, vpp)[3]
        with pytest.raises(ValueError, match="no layer|without a decoder layer"):
            stages.chunk_layers(L, pp, vpp)


def test_vectorized_split_agrees_with_the_lists():
    L, pp, vpp = np.meshgrid(np.arange(1, 41), np.arange(1, 17), np.arange(1, 5), indexing="ij")
    first, middle, last, valid = stages.split(L, pp, vpp)
    f_stage, m_stage, l_stage, _ = stages.stage_split(L, pp, vpp)
    for i in np.ndindex(L.shape):
        n, p, v = int(L[i]), int(pp[i]), int(vpp[i])
        if not valid[i]:
            assert p * v > 1
            continue
        chunks = stages.chunk_layers(n, p, v)
        ranks = stages.stage_layers(n, p, v)
        assert sum(chunks) == n and min(chunks) >= 1 and len(chunks) == p * v
        assert max(chunks) == -(-n // (p * v))  # no split gives its largest chunk fewer layers
        assert (chunks[0], chunks[-1]) == (first[i], last[i]) and set(chunks[1:-1]) <= {middle[i]}
        assert (ranks[0], ranks[-1]) == (f_stage[i], l_stage[i]) and set(ranks[1:-1]) <= {m_stage[i]}
        if n % (p * v) == 0:
            assert len(set(chunks)) == 1


def test_validity_keeps_uneven_splits_and_refuses_empty_stages():
    model, training = load_model("tiny-gpt"), TrainingSpec(seq_len=256, global_batch_size=16)
    cluster = cluster_from_preset("dgx-a100-80g", 1)
    c = Candidates.from_layouts(
        [
            Layout(pp=4, dp=2, num_microbatches=8, micro_batch_size=1),
            Layout(pp=8, num_microbatches=16, micro_batch_size=1),
            Layout(pp=2, dp=4, num_microbatches=4, micro_batch_size=1, schedule="interleaved_1f1b", virtual_stages=3),
        ]
    )
    with np.errstate(all="ignore"):
        reason = evaluate(model.model_copy(update={"num_layers": 6}), training, cluster, c).reason
    # 6 layers: pp 4 -> 1, 2, 2, 1; pp 8 > 6 layers; 2 x 3 chunks of 1 are even
    assert reason.tolist() == [0, REASON_CODES["stage_without_layers"], 0]
    with pytest.raises(BerthError, match=r"layout.pp.*8 chunks for 4 layers.*valid pp \(vpp=1\): 1, 2, 4"):
        check_layout({"pp": 8, "num_microbatches": 16}, model, training, cluster)


def _one(model, training, cluster, layout):
    with np.errstate(all="ignore"):
        return evaluate(model, training, cluster, Candidates.from_layouts([layout]))


def test_the_slowest_stage_sets_the_step():
    """7 layers on pp 2 (4, 3) against 8 (4, 4), tp 1: the 4-layer first stage is slowest in the first
    (its 3-layer last stage holds a small head), the last stage (4 layers and the head) in the second, so
    their compute differs by the head alone; the first stage's parameters are the same."""
    base = load_model("tiny-gpt")
    training = TrainingSpec(seq_len=256, global_batch_size=16, precision="fp32")
    cluster = cluster_from_preset("dgx-a100-80g", 1)
    layout = Layout(pp=2, dp=4, micro_batch_size=1, num_microbatches=4)
    seven, eight = (_one(base.model_copy(update={"num_layers": n}), training, cluster, layout) for n in (7, 8))
    c = Candidates.from_layouts([layout])
    from berth.cost_models import compute

    head = float(compute.lm_head_compute_s(base, training, cluster.device, np.array([1.0]), np.array([1.0]))[0])
    diff = eight.time_breakdown_s["compute"][0] - seven.time_breakdown_s["compute"][0]
    assert diff == pytest.approx(4 * head, rel=1e-9)
    first7 = memory.stage_params(base.model_copy(update={"num_layers": 7}), c.pp, c.tp, True, c.virtual_stages)
    first8 = memory.stage_params(base.model_copy(update={"num_layers": 8}), c.pp, c.tp, True, c.virtual_stages)
    assert first7[0] == first8[0]
    assert seven.step_time_s[0] < eight.step_time_s[0]


def test_a_middle_stage_with_more_layers_is_costed():
    """Llama 3.1 405B on PP 16 (7, 8 x14, 7): a middle stage's 8 layers outweigh the last stage's 7 and the
    LM head, so the step's compute is 8 layers a micro-batch, as the same shape with 128 layers (8 on every
    stage) has less the head; the second stage holds 15 micro-batches of 8 layers under 1F1B, more than
    the first's 16 of 7, and sets the activation memory."""
    model = load_model("llama3.1-405b")
    training = TrainingSpec(seq_len=8192, global_batch_size=2048)
    cluster = cluster_from_preset("dgx-h100", 2048)
    layout = Layout(
        tp=8,
        pp=16,
        dp=128,
        zero_stage=1,
        shard=128,
        micro_batch_size=1,
        num_microbatches=16,
        sequence_parallel=True,
        recompute="selective",
    )
    uneven = _one(model, training, cluster, layout)
    even = _one(model.model_copy(update={"num_layers": 128}), training, cluster, layout)
    from berth.cost_models import compute

    b, tp = np.array([1.0]), np.array([8.0])
    head = float(compute.lm_head_compute_s(model, training, cluster.device, b, tp)[0])
    diff = even.time_breakdown_s["compute"][0] - uneven.time_breakdown_s["compute"][0]
    assert diff == pytest.approx(16 * head, rel=1e-9)
    c = Candidates.from_layouts([layout])
    second = memory.stage_memory_breakdown(model, training, cluster.device, c, first=False, middle=True)
    first = memory.stage_memory_breakdown(model, training, cluster.device, c, first=True)
    assert second["activations"][0] > first["activations"][0]
    assert uneven.peak_memory_bytes[0] == pytest.approx(sum(v[0] for v in second.values()))
    assert uneven.memory_breakdown_bytes["activations"][0] == second["activations"][0]


def test_405b_pp16_is_searchable_and_launch_ready():
    """`berth plan llama3.1-405b --fix tp=8,pp=16` (Meta's layout): plans, each with its stage sizes."""
    model = load_model("llama3.1-405b")
    result = search(
        model,
        TrainingSpec(seq_len=8192, global_batch_size=2048),
        cluster_from_preset("dgx-h100", 2048),
        SearchSpec(top=3, fix={"tp": 8, "pp": 16}),
    )
    assert result.plans and result.feasible > 0
    for p in result.plans:
        assert (p.layout.tp, p.layout.pp) == (8, 16) and p.stage_layers == [7, *[8] * 14, 7]
    (p,) = predict_layouts(
        model,
        TrainingSpec(seq_len=8192, global_batch_size=2048),
        cluster_from_preset("dgx-h100", 2048),
        [result.plans[0].layout],
    )
    assert p.stage_layers == [7, *[8] * 14, 7] and p.prediction.step_time_s == result.plans[0].prediction.step_time_s


@pytest.mark.parametrize("layers", [1, 7, 32, 61, 96, 126])
def test_long_candidate_arrays_are_answered_as_elementwise(layers):
    """split and stage_split answer long arrays from a table over (pp, vpp): the same arrays, dtypes
    and shapes as the direct formulas, with vpp an array or a scalar."""
    rng = np.random.default_rng(layers)
    pp = rng.integers(1, 70, 3000)
    for vpp in (rng.integers(1, 9, 3000), 1, 3):
        for fast, direct in ((stages.split, stages._split), (stages.stage_split, stages._stage_split)):
            got, want = fast(layers, pp, vpp), direct(layers, pp, vpp)
            for g, w in zip(got, want, strict=True):
                assert g.dtype == w.dtype and g.shape == w.shape and np.array_equal(g, w)


# nanotron's compute-balanced split (specs/stages.py; models/base.py build_model at e24d2483), on the sweep's shapes
NANOTRON_1B = dict(num_layers=16, hidden_size=2048, num_attention_heads=32, ffn_hidden_size=8192, vocab_size=131072)
NANOTRON_8B = dict(num_layers=32, hidden_size=4096, num_attention_heads=32, ffn_hidden_size=14336, vocab_size=131072)


@pytest.mark.parametrize("shape", [NANOTRON_1B, NANOTRON_8B])
@pytest.mark.parametrize("pp", [2, 3, 4, 8, 16, 32])
def test_nanotron_split_follows_build_models_walk(shape, pp):
    """Each rank takes blocks in model order until the running cost passes (rank + 1) / pp of the total: the
    block that passes it stays, the next opens the next rank; blocks keep their order and all are placed."""
    layer, head = stages.nanotron_costs(type("M", (), shape))
    ranks = stages.balanced_blocks(shape["num_layers"], layer, head, pp)
    kinds = ["embedding", *["layer"] * shape["num_layers"], "norm", "head", "cast", "loss"]
    assert [k for r in ranks for k in r] == kinds
    cost = {"layer": layer, "head": head}
    total, running = shape["num_layers"] * layer + head, 0
    for r, blocks in enumerate(ranks):
        for i, kind in enumerate(blocks):
            running += cost.get(kind, 0)
            passed = running > total * (r + 1) / pp
            assert passed == (i == len(blocks) - 1) or (r == pp - 1 or not ranks[r + 1]), (r, i)
    first, middle, last, _ = (int(a) for a in stages.rule_stage_split(type("M", (), shape), pp, 1, "compute_balanced"))
    layers = [b.count("layer") for b in ranks]
    at_head = next(i for i, b in enumerate(ranks) if "head" in b)
    assert (first, last) == (layers[0], layers[at_head]) and middle == max(layers[1:at_head], default=0)


def test_nanotron_split_gives_rank_0_more_and_the_head_its_own_rank():
    """What the walk means for the sweep's models: rank 0 (the embedding costs nothing) holds more layers than the
    even split, and at pp 32 the 8B model's head gets a rank to itself, the cast and the loss one each after it."""
    one, eight = type("M", (), NANOTRON_1B), type("M", (), NANOTRON_8B)
    assert stages.rule_stage_layers(one, 2, 1, "compute_balanced") == [11, 5]
    assert stages.rule_stage_layers(one, 2, 1, "ends_lighter") == [8, 8] == stages.stage_layers(16, 2)
    deep = stages.balanced_blocks(32, *stages.nanotron_costs(eight), 32)
    assert [b.count("layer") for b in deep[:29]] == [2, *[1] * 13, 2, *[1] * 13, 2]
    assert deep[29:] == [["norm", "head"], ["cast"], ["loss"]]


def test_the_nanotron_engine_prices_its_own_split():
    """The same layout under the nanotron engine and the generic one: the plan's stage_layers follow each engine's
    rule, and the cost model prices the stages that rule builds: nanotron's rank 0 (11 layers and the embedding of
    the 1B at pp 2) holds more than the even split's, its last rank (5 layers and the head) less."""
    model = load_model("llama3-8b").model_copy(update=NANOTRON_1B | {"name": "nanotron-1b", "num_kv_heads": 32})
    cluster = cluster_from_preset("dgx-h100", 1)
    layout = Layout(tp=1, pp=2, dp=4, micro_batch_size=1, num_microbatches=8, zero_stage=1, shard=4)
    c = Candidates.from_layouts([layout])
    got, stage_bytes = {}, {}
    for engine in ("nanotron", "generic"):
        training = TrainingSpec(seq_len=4096, global_batch_size=32, engine=engine)
        (got[engine],) = predict_layouts(model, training, cluster, [layout])
        stage_bytes[engine] = [
            sum(float(v[0]) for v in memory.stage_memory_breakdown(model, training, cluster.device, c, first).values())
            for first in (True, False)
        ]
    assert got["nanotron"].stage_layers == [11, 5] and got["generic"].stage_layers == [8, 8]
    assert stage_bytes["nanotron"][0] > stage_bytes["generic"][0]
    assert stage_bytes["nanotron"][1] < stage_bytes["generic"][1]


def test_nanotron_split_is_chosen_row_by_row():
    """A candidate array that mixes virtual stages (the probe's enumeration, a compare of several layouts): each
    vpp = 1 row gets nanotron's split, whatever the other rows hold."""
    one = type("M", (), NANOTRON_1B)
    alone = stages.rule_stage_split(one, np.array([2]), np.array([1]), "compute_balanced")
    mixed = stages.rule_stage_split(one, np.array([2, 2]), np.array([1, 2]), "compute_balanced")
    assert [int(a[0]) for a in mixed] == [int(a[0]) for a in alone] == [11, 0, 5, 1]
    assert [int(a[1]) for a in mixed[:3]] == [int(a) for a in stages.stage_split(16, 2, 2)[:3]]
    with pytest.raises(ValueError):
        stages.rule_stage_layers(one, 32, 1, "compute_balanced")  # more ranks than layers: no valid split


@pytest.mark.parametrize(("layers", "pp"), [(28, 16), (80, 32)])
def test_which_pipelines_leave_a_stage_empty_is_the_engines_own_split(layers, pp):
    """28 layers over 16 stages or 80 over 32 leave berth's ends empty (ceil(L / pp) to every middle stage), but
    nanotron's walk gives every rank a block (a rank past the layers holds the head): the same layout is refused
    under berth's rule and runs, priced on nanotron's stages, under nanotron. More stages than layers is refused
    under berth's rule, and under nanotron's where its walk leaves a rank without a block (80 layers over 128: the
    sweep's 1B at pp 32 and 8B at pp 64 all crashed), not where every rank gets one (28 over 32: the head, the
    cast and the loss take the last ranks)."""
    shape = NANOTRON_8B | {"num_layers": layers}
    model = load_model("llama3-8b").model_copy(update=shape | {"name": "deep", "num_kv_heads": 32})
    cluster = cluster_from_preset("dgx-h100", 16)
    layout = Layout(tp=2, pp=pp, dp=64 // pp, micro_batch_size=1, num_microbatches=pp, sequence_parallel=True)
    deeper = 2 ** layers.bit_length()  # the fewest stages, a power of 2, beyond the layers
    too_deep = Layout(pp=deeper, dp=128 // deeper, micro_batch_size=1, num_microbatches=64 // (128 // deeper))
    walk = stages.balanced_blocks(layers, *stages.nanotron_costs(type("M", (), shape)), pp)
    assert all(walk) and not stages.split(layers, pp)[3]
    for engine in ("nanotron", "generic", "megatron"):
        training = TrainingSpec(seq_len=4096, global_batch_size=layout.dp * layout.num_microbatches, engine=engine)
        if engine == "nanotron":
            (p,) = predict_layouts(model, training, cluster, [layout])
            assert p.stage_layers == [b.count("layer") for b in walk] and p.prediction.step_time_s > 0
        else:
            with pytest.raises(BerthError, match=rf"layout.pp.*{layers} layers over pp x virtual_stages = {pp}"):
                check_layout(layout.model_dump(), model, training, cluster)
        deep = training.model_copy(update={"global_batch_size": 64})
        filled = stages.balanced_blocks(layers, *stages.nanotron_costs(type("M", (), shape)), deeper)
        if engine != "nanotron" or len(filled) < deeper or not all(filled):
            why = f"last of {deeper} ranks without a block" if engine == "nanotron" else f"{deeper} chunks for {layers}"
            with pytest.raises(BerthError, match=why):
                check_layout(too_deep.model_dump(), model, deep, cluster)
        else:
            assert layers == 28 and "stage_without_layers" not in {
                n for n, _ in layout_problems(too_deep, model, deep, cluster)
            }
