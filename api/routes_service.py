"""The service's own routes: /healthz."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends

from berth.api.common import StrictRoute
from berth.api.schemas import Health
from berth.api.service import Service, get_service
from berth.specs import __version__

router = APIRouter(route_class=StrictRoute)


@router.get("/healthz", response_model=Health, tags=["service"])
async def healthz(service: Annotated[Service, Depends(get_service)]) -> Health:
    return Health(status="ok", version=__version__, validation_enabled=service.settings.validation_enabled)
