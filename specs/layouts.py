"""The layout SPEC grammar shared by `--layout` and `--fix`: comma-separated key=value pairs,
e.g. "tp=8,pp=4,dp=2,zero=1,recompute=selective,mbs=1,vpp=5,sp=1" (MoE: "ep=8,etp=1")."""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from berth.specs.errors import BerthError, from_validation_error
from berth.specs.tree import (
    AXIS_ORDER_CHOICES,
    LAYOUT_FIELDS,
    MAX_GPUS_PER_NODE,
    MAX_NODES,
    RECOMPUTE_CHOICES,
    SCHEDULE_CHOICES,
    ClusterSpec,
    Layout,
    ModelSpec,
    TrainingSpec,
)
from berth.specs.validity import RULE, Facts, listing, violations

ALIASES = {
    "zero": "zero_stage",
    "mbs": "micro_batch_size",
    "nmb": "num_microbatches",
    "gas": "num_microbatches",
    "vpp": "virtual_stages",
    "sp": "sequence_parallel",
    "order": "axis_order",
    "etp": "expert_tp",
}
# the largest degree or batch count a layout may name: the most GPUs a cluster may have (nodes x GPUs
# per node), above the largest global batch; keeps every product of the rules within int64
MAX_LAYOUT_VALUE = MAX_NODES * MAX_GPUS_PER_NODE
_BOOL = {"1": True, "true": True, "yes": True, "on": True, "0": False, "false": False, "no": False, "off": False}


def parse_spec(text: str, field: str = "layout") -> dict[str, Any]:
    """Parse "k=v,k=v" into layout field values (aliases resolved, integers and booleans typed)."""
    out: dict[str, Any] = {}
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        key, sep, value = part.partition("=")
        key, value = key.strip(), value.strip()
        name = ALIASES.get(key, key)
        if not sep or not value:
            raise BerthError(field, part, "expected key=value")
        if name not in LAYOUT_FIELDS:
            raise BerthError(field, key, f"unknown key; use {', '.join(sorted({*LAYOUT_FIELDS, *ALIASES}))}")
        if name in out:
            raise BerthError(f"{field}.{name}", text, "given twice")
        out[name] = _typed(name, value, field)
    return out


def _typed(name: str, value: str, field: str) -> Any:
    if name == "sequence_parallel":
        if value.lower() not in _BOOL:
            raise BerthError(f"{field}.{name}", value, "expected 0 or 1")
        return _BOOL[value.lower()]
    if name in ("recompute", "schedule", "axis_order"):
        return value
    try:
        return int(value)
    except ValueError:
        raise BerthError(f"{field}.{name}", value, "expected an integer") from None


def complete_layout(values: dict[str, Any], training: TrainingSpec, world_size: int, field: str = "layout") -> Layout:
    """Fill what a user left out: dp from the world size, num_microbatches from the global batch, shard = dp under ZeRO,
    the interleaved schedule when vpp > 1. What cannot be derived exactly is left for the validity rules to report."""
    v = dict(values)
    tp, pp, cp = v.get("tp", 1), v.get("pp", 1), v.get("cp", 1)
    if "dp" not in v and tp > 0 and pp > 0 and cp > 0:
        v["dp"] = max(1, world_size // (tp * cp * pp))
    dp, nmb = v.get("dp", 1), v.get("num_microbatches")
    if "micro_batch_size" not in v and nmb and dp > 0 and nmb > 0:
        v["micro_batch_size"] = max(1, training.global_batch_size // (dp * nmb))
    mbs = v.get("micro_batch_size", 1)
    if "num_microbatches" not in v and dp > 0 and mbs > 0:
        v["num_microbatches"] = max(1, training.global_batch_size // (dp * mbs))
    if "shard" not in v and v.get("zero_stage", 0) > 0:
        v["shard"] = dp
    if "schedule" not in v and v.get("virtual_stages", 1) > 1:
        v["schedule"] = "interleaved_1f1b"
    if v.get("pp", 1) == 1 and v.get("schedule") in ("gpipe", "1f1b"):
        v["schedule"] = "1f1b"  # one stage is no pipeline: every schedule runs the same way
    check_values(v, field)
    try:
        return Layout.model_validate(v)
    except ValidationError as err:
        raise from_validation_error(err, field) from None


_CHOICES = {
    "recompute": RECOMPUTE_CHOICES,
    "schedule": SCHEDULE_CHOICES,
    "axis_order": AXIS_ORDER_CHOICES,
    "zero_stage": (0, 1, 2, 3),
    "sequence_parallel": (False, True),
}


def check_values(values: dict[str, Any], field: str = "layout") -> None:
    """Each value on its own: a known field, the right type, in range (Layout's own constraints)."""
    for key, value in values.items():
        if key not in LAYOUT_FIELDS:
            raise BerthError(f"{field}.{key}", value, f"unknown layout field; known: {', '.join(LAYOUT_FIELDS)}")
        if value is None and Layout.model_fields[key].default is None:
            continue  # an optional field left to its derived value (expert_tp: tp)
        choices = _CHOICES.get(key)
        if choices is not None and value not in choices:
            shown = "0 or 1" if key == "sequence_parallel" else ", ".join(map(str, choices))
            raise BerthError(f"{field}.{key}", value, f"valid: {shown}")
        if choices is None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise BerthError(f"{field}.{key}", value, "must be a positive integer")
        if choices is None and value > MAX_LAYOUT_VALUE:
            raise BerthError(f"{field}.{key}", value, f"at most {MAX_LAYOUT_VALUE:,} (the most GPUs or sequences)")


def layout_problems(
    layout: Layout, model: ModelSpec, training: TrainingSpec, cluster: ClusterSpec, given: set[str] | None = None
) -> list[tuple[str, str]]:
    """(rule name, why) of every PLAN rule of berth.specs.validity.RULES the layout breaks (the search's own
    vectorized predicates on a one-row Candidates), in the user's numbers; with `given`, only the rules that read a
    given field (a rule broken only through fields a user left free is no refusal of what the user gave)."""
    given = set(LAYOUT_FIELDS) if given is None else given
    facts = Facts.of(model, training, cluster, given=frozenset(given))
    return [(rule.name, why) for rule, why in violations(layout, facts) if given & set(rule.reads)]


def _reads(name: str) -> tuple[str, ...]:
    return RULE[name].reads


def _blame(name: str, given: set[str], values: dict[str, Any]) -> tuple[str, Any]:
    keys = [k for k in _reads(name) if k in given] or list(_reads(name)) or sorted(given)
    if len(keys) == 1:
        return keys[0], values.get(keys[0])
    return ",".join(keys), ",".join(f"{k}={values.get(k)}" for k in keys)


def check_layout(
    values: dict[str, Any], model: ModelSpec, training: TrainingSpec, cluster: ClusterSpec, field: str = "layout"
) -> Layout:
    """The completed layout of `values` (`--layout`, the API's `layouts`), or a BerthError naming the
    field, the value and the rule it breaks on this cluster."""
    check_values(values, field)
    layout = complete_layout(values, training, cluster.world_size, field)
    given = set(values)
    problems = layout_problems(layout, model, training, cluster)  # derived values too: it is one layout
    if problems:
        key, value = _blame(problems[0][0], given, layout.model_dump())
        raise BerthError(f"{field}.{key}", value, "; ".join(dict.fromkeys(why for _, why in problems[:3])))
    return layout


def refuse_fix(
    fix: dict[str, Any], key: str, valid: list, model: ModelSpec, training: TrainingSpec, cluster: ClusterSpec
) -> BerthError:
    """Why no layout the search covers has `fix[key]` (with the fix's earlier keys): the rules the
    fix's completed layout breaks through a fixed field, and the values that would do."""
    why = ""
    try:
        layout = complete_layout(fix, training, cluster.world_size, "fix")
        problems = layout_problems(layout, model, training, cluster, set(fix))
        # a rule that reads only given fields is broken whatever the search picks for the rest
        fields = {n: _reads(n) for n, _ in problems}
        whole = [w for n, w in problems if key in fields[n] and set(fields[n]) <= set(fix)]
        partial = [w for n, w in problems if key in fields[n]]
        why = "; ".join(dict.fromkeys(whole)) or (partial[0] if partial else "")
    except BerthError:
        pass
    order = list(fix)
    earlier = [f"{k}={fix[k]}" for k in order[: order.index(key)]]
    if (
        not why
        and key in ("shard", "zero_stage")
        and fix.get("shard") == 1
        and fix.get("zero_stage", 0) > 0
        and fix.get("cp", 1) == 1
    ):
        why = "ZeRO shards over shard x cp > 1 ranks (shard = 1 under ZeRO is zero = 0 unless cp > 1)"
    if not why:
        why = f"no layout of {cluster.world_size} GPUs the search covers has it" + (
            f" with {','.join(earlier)}" if earlier else ""
        )
    if valid and "valid:" not in why:
        why += f"; valid{' with ' + ','.join(earlier) if earlier else ''}: {listing(valid)}"
    elif not valid:
        why += f"; no value works with {','.join(earlier)}" if earlier else ""
    return BerthError(f"fix.{key}", fix[key], why)
