"""Plans: search (/v1/plans), score given layouts (/v1/compare), read a stored answer
(/v1/plans/{id}) and the files that launch one of its plans (/v1/launch)."""

from __future__ import annotations

import threading
from typing import Annotated

from fastapi import APIRouter, Depends, HTTPException
from fastapi.responses import Response

from berth.api.common import COMMON_ERRORS, ERROR, StrictRoute, json_response
from berth.api.schemas import CompareRequest, CompareResponse, LaunchRequest, LaunchResponse, PlanRequest, PlanResponse
from berth.api.service import Service, get_service
from berth.launch.writers import artifacts, engine_training
from berth.planner.inputs import make_search
from berth.planner.planning import (
    cached_plan,
    compare_json,
    compare_with_best,
    json_text,
    plan,
    plan_for_format,
    plans_text,
    with_fallback,
)
from berth.specs.tree import pick_plan, plan_listing

router = APIRouter(route_class=StrictRoute)
ServiceDep = Annotated[Service, Depends(get_service)]


@router.post("/v1/plans", response_model=PlanResponse, tags=["plans"], responses=COMMON_ERRORS)
async def create_plan(req: PlanRequest, service: ServiceDep) -> Response:
    settings = service.settings
    spec = make_search(
        top=req.search.top,
        fix=req.search.fix,
        objective=req.search.objective,
        max_micro_batch_size=req.search.max_micro_batch_size,
        memory_headroom=req.search.memory_headroom,
    )

    def cached(model, training, cluster) -> str | None:
        """A repeated question's answer, without waiting for a search thread."""
        result = cached_plan(model, training, cluster, spec, settings.max_candidates)
        return plans_text(result, cluster) if result is not None and not req.search.fallback else None

    async def work(deadline: float, cancel: threading.Event) -> Response:
        model, training, cluster, answer = await service.resolved(req, cancel, cached)
        plans = req.search.top + (1 if req.search.fallback else 0)
        service.check_answer("search.top", req.search.top, plans, cluster.world_size)

        def search() -> str:
            result = plan(model, training, cluster, spec, settings.max_candidates, deadline, cancel)
            if req.search.fallback:
                result = with_fallback(result, spec, deadline, cancel)
            return plans_text(result, cluster)

        if answer is None:
            answer = await service.searches.run(search, cancel)
        return await service.answered(answer, "plan")

    return await service.within_budget(work)


@router.post("/v1/compare", response_model=CompareResponse, tags=["plans"], responses=COMMON_ERRORS)
async def create_compare(req: CompareRequest, service: ServiceDep) -> Response:
    async def work(deadline: float, cancel: threading.Event) -> Response:
        model, training, cluster = await service.resolved(req, cancel)
        service.check_answer("layouts", len(req.layouts), len(req.layouts) + 1, cluster.world_size)

        def score() -> str:
            candidates, best = compare_with_best(
                model,
                training,
                cluster,
                req.layouts,
                req.memory_headroom,
                service.settings.max_candidates,
                deadline,
                cancel,
            )
            return json_text(compare_json(candidates, best, req.memory_headroom))

        return await service.answered(await service.searches.run(score, cancel), "compare")

    return await service.within_budget(work)


@router.post(
    "/v1/launch",
    response_model=LaunchResponse,
    tags=["plans"],
    responses={404: {"description": "no such plan", **ERROR}, **COMMON_ERRORS},
)
async def create_launch(req: LaunchRequest, service: ServiceDep) -> Response:
    """The files that launch a stored plan (the same as `berth launch`)."""

    async def work(_: float, cancel: threading.Event) -> Response:
        got = await service.stored(req.plan_id, cancel)
        if got is None:
            raise HTTPException(404, f"no plan with id {req.plan_id!r}")
        plans = plan_listing(got["response"]) or []

        def build() -> tuple[dict[str, str], str, str | None]:
            chosen, fmt, note = plan_for_format(pick_plan(plans, req.pick, f"plan {req.plan_id}"), req.format)
            run = engine_training(req.train, "train")
            return (
                artifacts(chosen, fmt, steps=req.steps, warmup=req.warmup, image=req.image, training=run),
                fmt,
                note,
            )

        files, fmt, note = await service.light.run(build, cancel)
        return json_response({"plan_id": req.plan_id, "format": fmt, "files": files, "note": note})

    return await service.within_budget(work)


@router.get(
    "/v1/plans/{plan_id}",
    response_model=PlanResponse | CompareResponse,
    tags=["plans"],
    responses={404: {"description": "no such plan", **ERROR}},
)
async def get_plan(plan_id: str, service: ServiceDep) -> Response:
    async def work(_: float, cancel: threading.Event) -> Response:
        got = await service.stored(plan_id[:64], cancel)
        if got is None:
            raise HTTPException(404, f"no plan with id {plan_id[:64]!r}")
        return json_response(got["response"])

    return await service.within_budget(work)
