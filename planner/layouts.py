"""The layout SPEC grammar shared by `--layout` and `--fix`: comma-separated key=value pairs,
e.g. "tp=8,pp=4,dp=2,zero=1,recompute=selective,mbs=1,vpp=5,sp=1"."""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from planner.errors import BerthError, from_validation_error
from planner.specs import LAYOUT_FIELDS, Layout, TrainingSpec

ALIASES = {
    "zero": "zero_stage",
    "mbs": "micro_batch_size",
    "nmb": "num_microbatches",
    "gas": "num_microbatches",
    "vpp": "virtual_stages",
    "sp": "sequence_parallel",
    "order": "axis_order",
}
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


def complete_layout(values: dict[str, Any], training: TrainingSpec, world_size: int,
                    field: str = "layout") -> Layout:
    """Fill what a user left out: dp from the world size, num_microbatches from the global batch,
    shard = dp under ZeRO, the interleaved schedule when vpp > 1. What cannot be derived exactly
    is left for the validity rules to report."""
    v = dict(values)
    tp, pp = v.get("tp", 1), v.get("pp", 1)
    if "dp" not in v and tp > 0 and pp > 0:
        v["dp"] = max(1, world_size // (tp * pp))
    dp, mbs = v.get("dp", 1), v.get("micro_batch_size", 1)
    if "num_microbatches" not in v and dp > 0 and mbs > 0:
        v["num_microbatches"] = max(1, training.global_batch_size // (dp * mbs))
    if "shard" not in v and v.get("zero_stage", 0) > 0:
        v["shard"] = dp
    if "schedule" not in v and v.get("virtual_stages", 1) > 1:
        v["schedule"] = "interleaved_1f1b"
    try:
        return Layout.model_validate(v)
    except ValidationError as err:
        raise from_validation_error(err, field) from None
