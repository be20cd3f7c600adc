"""The registry of cost terms (specs/terms.py) is the one list: every term the cost model
emits is registered, every registered term is emitted by some plan, and the plan tables, the
measured breakdown, the report colours, the placement and the API's schema all show it."""

from io import StringIO

from rich.console import Console

from berth.cli.render import breakdown_table
from berth.cost_models.breakdown import MEMORY_MEASURED, TERM_REGIONS, TERMS
from berth.cost_models.step import BOTTLENECK_TERMS
from berth.planner.placement import AXIS_TERMS
from berth.planner.search import predict_layouts
from berth.specs import terms
from berth.specs.models import load_model, presets
from berth.specs.tree import Layout, Prediction, TrainingSpec
from berth.topology.clusters import cluster_from_preset

CLUSTER = cluster_from_preset("dgx-h100", 2)


def _plans():
    """A dense plan with cp, tp, pp and dp, and a MoE plan with ep: together every kind of term."""
    dense = predict_layouts(
        load_model("llama3-8b"),
        TrainingSpec(seq_len=16384, global_batch_size=16),
        CLUSTER,
        [Layout(tp=2, cp=2, pp=2, dp=2, micro_batch_size=1, num_microbatches=8)],
    )
    moe = predict_layouts(
        presets()["mixtral-8x7b"],
        TrainingSpec(seq_len=4096, global_batch_size=64),
        CLUSTER,
        [Layout(dp=16, ep=8, zero_stage=3, shard=16, micro_batch_size=1, num_microbatches=4)],
    )
    return [*dense, *moe]


def _text(table) -> str:
    out = StringIO()
    Console(file=out, width=400, color_system=None).print(table)
    return out.getvalue()


def test_every_emitted_term_is_registered_and_every_registered_term_is_emitted():
    plans = _plans()
    assert all(p.prediction is not None for p in plans)
    emitted_time = set().union(*(p.prediction.time_breakdown_s for p in plans))
    emitted_memory = set().union(*(p.prediction.memory_breakdown_bytes for p in plans))
    assert emitted_time == set(terms.TIME_NAMES)
    assert emitted_memory == set(terms.MEMORY_NAMES)
    for p in plans:  # the cost model's own order is the registry's
        emitted = p.prediction.time_breakdown_s
        assert list(emitted) == [t for t in terms.TIME_NAMES if t in emitted]
        assert list(p.prediction.memory_breakdown_bytes) == list(terms.MEMORY_NAMES)


def test_every_term_is_rendered_in_the_breakdown_table():
    plans = _plans()
    text = _text(breakdown_table(plans, "t"))
    for t in terms.TIME:
        assert f"time: {t.label} " in text, t.name
    for m in terms.MEMORY:
        assert f"memory: {m.label} " in text, m.name
    # a term tied to an axis no plan uses, or one no breakdown holds, is left out
    dense_only = _text(
        breakdown_table(
            [plans[0].model_copy(update={"layout": plans[0].layout.model_copy(update={"cp": 1, "dp": 4})})], "t"
        )
    )
    assert "time: cp_comm" not in dense_only and "time: ep_comm" not in dense_only
    assert "time: tp_comm" in dense_only


def test_every_reader_takes_the_registry():
    from berth.cli.plots import COLORS

    assert tuple(TERM_REGIONS) == TERMS == terms.TIME_NAMES
    assert all(regions and how for regions, how in TERM_REGIONS.values())
    assert set(COLORS) >= set(terms.TIME_NAMES) and len(set(COLORS.values())) == len(COLORS)
    assert set(MEMORY_MEASURED) <= set(terms.MEMORY_NAMES)
    assert set(AXIS_TERMS.values()) <= set(terms.TIME_NAMES)
    # the bottleneck groups name registered terms, and every term, compute included, can be the bottleneck
    grouped = {t for names in BOTTLENECK_TERMS.values() for t in names}
    assert grouped == set(terms.TIME_NAMES)
    # each term's region belongs to that term only
    regions = [r for t in terms.TIME for r in t.regions]
    assert len(regions) == len(set(regions))


def test_the_api_schema_describes_every_term():
    props = Prediction.model_json_schema()["properties"]
    for t in terms.TIME:
        assert f"{t.name} (s): " in props["time_breakdown_s"]["description"]
    for m in terms.MEMORY:
        assert f"{m.name} (bytes): " in props["memory_breakdown_bytes"]["description"]
