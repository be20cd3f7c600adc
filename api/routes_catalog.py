"""The catalog: preset models, engines, cluster presets and device profiles (read from the package's data,
never from a path a request names)."""

from __future__ import annotations

from fastapi import APIRouter, HTTPException

from berth.api.common import ERROR, StrictRoute
from berth.api.schemas import ClusterInfo, EngineDoc, ModelInfo, ProfileInfo
from berth.hardware_profiles import (
    DeviceProfile,
    UnknownProfileError,
    device_names,
    load_device,
    load_server,
    server_names,
)
from berth.specs.engines import engine_table
from berth.specs.models import presets

router = APIRouter(route_class=StrictRoute)


@router.get("/v1/models", response_model=list[ModelInfo], tags=["catalog"])
def models() -> list[ModelInfo]:
    return [
        ModelInfo(
            name=m.name,
            num_params=m.num_params,
            num_layers=m.num_layers,
            hidden_size=m.hidden_size,
            num_attention_heads=m.num_attention_heads,
            num_kv_heads=m.kv_heads,
            ffn_hidden_size=m.ffn_hidden_size,
            vocab_size=m.vocab_size,
            num_experts=m.num_experts,
            experts_per_token=m.experts_per_token,
            active_params=m.active_params,
        )
        for m in presets().values()
    ]


@router.get("/v1/engines", response_model=list[EngineDoc], tags=["catalog"])
def engines() -> list[EngineDoc]:
    """The engines training.engine takes: what each runs, its memory recipe and its launch formats."""
    return [EngineDoc.model_validate(e) for e in engine_table()]


@router.get("/v1/clusters", response_model=list[ClusterInfo], tags=["catalog"])
def clusters() -> list[ClusterInfo]:
    return [
        ClusterInfo(
            **load_server(n).model_dump(
                include={"name", "display_name", "device", "gpus_per_node", "intra_node", "inter_node"}
            )
        )
        for n in server_names()
    ]


@router.get("/v1/hardware-profiles", response_model=list[ProfileInfo], tags=["catalog"])
def profiles() -> list[ProfileInfo]:
    return [
        ProfileInfo(
            **load_device(n).model_dump(include={"name", "display_name", "kind", "memory_bytes", "peak_flops_per_s"})
        )
        for n in device_names()
    ]


@router.get(
    "/v1/hardware-profiles/{name}",
    response_model=DeviceProfile,
    tags=["catalog"],
    responses={404: {"description": "no such profile", **ERROR}},
)
def profile(name: str) -> DeviceProfile:
    if name not in device_names():  # the catalog's names only: never a path
        raise HTTPException(404, f"unknown device {name[:64]!r}; known: {', '.join(device_names())}")
    try:
        return load_device(name)
    except UnknownProfileError as err:
        raise HTTPException(404, str(err)) from None
