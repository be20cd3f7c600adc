"""Validations: run the executor on this host for a stored plan (off unless
BERTH_VALIDATION_ENABLED=1, which needs BERTH_API_KEY), and read a job's state."""

from __future__ import annotations

import threading
import uuid
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Header, HTTPException

from berth.api.common import COMMON_ERRORS, ERROR, StrictRoute
from berth.api.schemas import ValidationJob, ValidationRequest
from berth.api.service import Service, get_service, utc_now
from berth.specs.tree import ValidationReport, pick_plan, plan_listing

router = APIRouter(route_class=StrictRoute)
ServiceDep = Annotated[Service, Depends(get_service)]
VALIDATION_ERRORS: dict[int | str, dict[str, Any]] = {
    401: {"description": "missing or wrong X-API-Key", **ERROR},
    403: {"description": "validation disabled on this server", **ERROR},
    404: {"description": "no such plan or validation", **ERROR},
    429: {"description": "BERTH_MAX_QUEUED_VALIDATIONS queued or running", **ERROR},
    400: COMMON_ERRORS[400],
    413: COMMON_ERRORS[413],
    415: COMMON_ERRORS[415],
}


@router.post(
    "/v1/validations", response_model=ValidationJob, status_code=202, tags=["validations"], responses=VALIDATION_ERRORS
)
async def create_validation(
    req: ValidationRequest, service: ServiceDep, x_api_key: str | None = Header(default=None)
) -> ValidationJob:
    service.check_key(x_api_key)
    store = service.store

    async def work(_: float, cancel: threading.Event) -> ValidationJob:
        got = await service.stored(req.plan_id, cancel)
        if got is None:
            raise HTTPException(404, f"no plan with id {req.plan_id!r}")
        chosen = pick_plan(plan_listing(got["response"]) or [], req.pick, f"plan {req.plan_id}")
        service.open_job()
        job = ValidationJob(id=uuid.uuid4().hex, created=utc_now(), plan_id=req.plan_id, status="queued")
        try:
            await service.io.run(
                lambda: store.add_job(job.id, job.created, req.plan_id, req.model_dump(mode="json")), cancel
            )
            service.validations.submit(service.run_validation, job.id, chosen, req)
        except BaseException:
            service.close_job()
            raise
        return job

    return await service.within_budget(work)


@router.get("/v1/validations/{job_id}", response_model=ValidationJob, tags=["validations"], responses=VALIDATION_ERRORS)
async def get_validation(
    job_id: str, service: ServiceDep, x_api_key: str | None = Header(default=None)
) -> ValidationJob:
    service.check_key(x_api_key)
    store = service.store

    async def work(_: float, cancel: threading.Event) -> ValidationJob:
        def read() -> tuple[dict[str, Any], ValidationReport | None] | None:
            job = store.get_job(job_id[:64])
            if job is None:
                return None
            report = store.get_validation(job["report_id"]) if job["report_id"] else None
            return job, report

        got = await service.io.run(read, cancel)
        if got is None:
            raise HTTPException(404, f"no validation with id {job_id[:64]!r}")
        job, report = got
        return ValidationJob(
            id=job["id"],
            created=job["created"],
            plan_id=job["plan_id"],
            status=job["status"],
            message=job["message"],
            report=report,
        )

    return await service.within_budget(work)
