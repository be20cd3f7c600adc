"""The berth REST service: thin routes over planner.planning, the same JSON as the CLI.

Run it with `berth serve` (uvicorn). Searches are CPU-bound: they run in worker threads, at most
BERTH_MAX_CONCURRENT_SEARCHES at once, each inside a time budget (BERTH_REQUEST_TIMEOUT_S) that
covers the wait for a free slot; over budget the answer is 503 and the search stops at its next
chunk, so the event loop keeps serving everyone else. Validations (running the executor on this
host) are off unless BERTH_VALIDATION_ENABLED=1, run one at a time in the background, and need
the X-API-Key header when BERTH_API_KEY is set.
"""

from __future__ import annotations

import hmac
import importlib.util
import json
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from typing import Any

import anyio
from fastapi import FastAPI, Header, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError

from api.schemas import (
    ClusterInfo,
    CompareRequest,
    CompareResponse,
    GraphCluster,
    Health,
    LaunchRequest,
    LaunchResponse,
    ModelInfo,
    PlanRequest,
    PlanResponse,
    ProfileInfo,
    ValidationJob,
    ValidationRequest,
)
from api.settings import Settings
from hardware_profiles import DeviceProfile, UnknownProfileError, device_names, load_device, load_server, server_names
from planner import __version__
from planner.errors import BerthError, from_validation_error
from planner.launch import artifacts
from planner.models import load_model, presets
from planner.planning import (
    cached_plan,
    compare,
    compare_json,
    default_precision,
    make_cluster,
    make_search,
    make_training,
    plan,
    plans_text,
    with_fallback,
    with_operations,
)
from planner.search import SearchTimeout
from planner.specs import ClusterSpec, Plan
from planner.store import Store
from planner.topology import cluster_from_node_link

ERROR = {"content": {"application/json": {"schema": {"type": "object", "properties": {"detail": {}}}}}}
COMMON_ERRORS: dict[int | str, dict[str, Any]] = {
    400: {"description": "the body is not JSON", **ERROR},
    413: {"description": "request body larger than BERTH_MAX_BODY_BYTES", **ERROR},
    503: {"description": "over the time budget or the server is busy; retry later", **ERROR},
}


def _now() -> str:
    return datetime.now(UTC).isoformat()


def _json(body: dict[str, Any]) -> Response:
    """Answer built from already-validated specs: serialized once, without a second validation
    pass through the response model (which stays in the OpenAPI schema and is checked by the
    schemathesis test)."""
    return Response(content=json.dumps(body, separators=(",", ":")), media_type="application/json")


def _unprocessable(err: BerthError) -> JSONResponse:
    """A BerthError in the same shape as FastAPI's own 422 body: loc names the field."""
    item = {"loc": ["body", *err.field.split(".")], "msg": err.problem, "type": "value_error"}
    item["input"] = err.to_dict()["value"]
    return JSONResponse(status_code=422, content={"detail": [item]})


class BodyLimit:
    """Pure ASGI middleware: a body over the limit gets 413 before anything parses it, whether it
    announces its length or streams."""

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        length = headers.get(b"content-length")
        too_big = JSONResponse(status_code=413, content={"detail": f"request body over {self.limit} bytes"})
        if length is not None and (not length.isdigit() or int(length) > self.limit):
            return await too_big(scope, receive, send)
        seen = 0

        async def limited():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.limit:
                    raise _TooLarge
            return message

        try:
            return await self.app(scope, limited, send)
        except _TooLarge:
            return await too_big(scope, receive, send)


class _TooLarge(Exception):
    pass


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or Settings()
    store = Store(settings.store_path)
    store.fail_unfinished_jobs("the server stopped before this validation finished")
    limiter = anyio.CapacityLimiter(settings.max_concurrent_searches)
    validations = ThreadPoolExecutor(max_workers=1, thread_name_prefix="berth-validate")

    app = FastAPI(title="berth", version=__version__,
                  description="Parallelism-layout planner for training large transformers.")
    app.state.settings, app.state.store = settings, store
    app.add_middleware(BodyLimit, limit=settings.max_body_bytes)

    @app.exception_handler(BerthError)
    async def berth_error(_: Request, err: BerthError) -> JSONResponse:
        return _unprocessable(err)

    @app.exception_handler(RequestValidationError)
    async def request_error(_: Request, err: RequestValidationError) -> JSONResponse:
        detail = [{k: v for k, v in e.items() if k in ("loc", "msg", "type")} for e in err.errors()]
        return JSONResponse(status_code=422, content={"detail": detail})

    def resolve(model_ref, training_req, cluster_req, ops=None) -> tuple[Any, Any, ClusterSpec]:
        model = load_model(model_ref, allow_files=False)
        def too_big(gpus: int) -> None:
            if gpus > settings.max_gpus:
                raise BerthError("cluster", gpus, f"{gpus:,} GPUs is more than this server plans for "
                                 f"({settings.max_gpus:,})")

        if isinstance(cluster_req, GraphCluster):
            nodes = cluster_req.graph.get("nodes")
            if isinstance(nodes, list):  # counted before the graph is built
                too_big(sum(1 for n in nodes if isinstance(n, dict) and n.get("kind") == "gpu"))
            cluster = cluster_from_node_link(cluster_req.graph, cluster_req.name)
        else:
            if cluster_req.preset in server_names():  # checked before the graph is built
                too_big(load_server(cluster_req.preset).gpus_per_node * cluster_req.nodes)
            cluster = make_cluster(cluster_req.preset, cluster_req.nodes, cluster_req.devices_per_node,
                                   fabric=cluster_req.fabric, nodes_per_leaf=cluster_req.nodes_per_leaf,
                                   oversubscription=cluster_req.oversubscription)
        too_big(cluster.world_size)
        if ops is not None:
            gbps = ops.storage_write_gbps_per_gpu
            cluster = with_operations(cluster, ops.failures_per_gpu_hour, gbps * 1e9 if gbps else None,
                                      ops.price_per_gpu_hour)
        fields = training_req.model_dump()
        fields["precision"] = fields["precision"] or default_precision(cluster)
        return model, make_training(**fields), cluster

    async def resolve_off_loop(req):
        """Presets resolve in microseconds (cached); a topology graph is derived in a worker thread
        within the request budget (up to seconds for 10^5 links), never on the event loop."""
        if isinstance(req.cluster, GraphCluster):
            return await bounded(lambda _: resolve(req.model, req.training, req.cluster, req.operations))
        return resolve(req.model, req.training, req.cluster, req.operations)

    async def bounded(fn):
        """Run fn(deadline) in a worker thread within the request's time budget."""
        budget = settings.request_timeout_s
        deadline = time.monotonic() + budget
        try:
            with anyio.fail_after(budget):
                return await anyio.to_thread.run_sync(lambda: fn(deadline), limiter=limiter, abandon_on_cancel=True)
        except (TimeoutError, SearchTimeout):
            raise HTTPException(503, f"over this server's {budget:g} s budget for one request; narrow the search "
                                "(search.fix) or retry", headers={"Retry-After": "1"}) from None

    @app.get("/healthz", response_model=Health, tags=["service"])
    def healthz() -> Health:
        return Health(status="ok", version=__version__, validation_enabled=settings.validation_enabled)

    @app.post("/v1/plans", response_model=PlanResponse, tags=["plans"], responses=COMMON_ERRORS)
    async def create_plan(req: PlanRequest) -> Response:
        model, training, cluster = await resolve_off_loop(req)
        spec = make_search(top=req.search.top, fix=req.search.fix, objective=req.search.objective,
                           max_micro_batch_size=req.search.max_micro_batch_size,
                           memory_headroom=req.search.memory_headroom)
        result = cached_plan(model, training, cluster, spec, settings.max_candidates)
        if result is None:  # a cold search: off the event loop, within the budget
            result = await bounded(lambda dl: plan(model, training, cluster, spec, settings.max_candidates, dl))
        if req.search.fallback:
            searched = result
            result = await bounded(lambda _: with_fallback(searched, spec))
        plan_id, created = uuid.uuid4().hex, _now()
        # the plans' JSON is serialized once per cached answer; id and created are spliced in front
        body = f'{{"id":"{plan_id}","created":"{created}",' + plans_text(result)[1:]
        store.add_plan(plan_id, created, '{"kind":"plan","request":' + req.model_dump_json() + ',"response":' + body
                       + "}")
        return Response(content=body, media_type="application/json")

    @app.post("/v1/compare", response_model=CompareResponse, tags=["plans"], responses=COMMON_ERRORS)
    async def create_compare(req: CompareRequest) -> Response:
        model, training, cluster = await resolve_off_loop(req)

        def work(deadline: float):
            candidates = compare(model, training, cluster, req.layouts, req.memory_headroom)
            try:
                best = plan(model, training, cluster, make_search(top=1, memory_headroom=req.memory_headroom),
                            settings.max_candidates, deadline)
            except BerthError:
                best = None
            return compare_json(candidates, best)

        body = {"id": uuid.uuid4().hex, "created": _now(), **(await bounded(work))}
        store.add_plan(body["id"], body["created"], {"kind": "compare", "request": req.model_dump(mode="json"),
                                                     "response": body})
        return _json(body)

    @app.post("/v1/launch", response_model=LaunchResponse, tags=["plans"],
              responses={404: {"description": "no such plan", **ERROR}, **COMMON_ERRORS})
    def create_launch(req: LaunchRequest) -> Response:
        """The files that launch a stored plan (the same as `berth launch`)."""
        stored = store.get_plan(req.plan_id)
        if stored is None:
            raise HTTPException(404, f"no plan with id {req.plan_id!r}")
        plans = stored["response"].get("plans") or stored["response"].get("candidates") or []
        if not 1 <= req.pick <= len(plans):
            raise BerthError("pick", req.pick, f"the stored answer holds {len(plans)} plans")
        chosen = Plan.model_validate(plans[req.pick - 1])
        files = artifacts(chosen, req.format, steps=req.steps, warmup=req.warmup, image=req.image)
        return _json({"plan_id": req.plan_id, "format": req.format, "files": files})

    @app.get("/v1/plans/{plan_id}", response_model=PlanResponse | CompareResponse, tags=["plans"],
             responses={404: {"description": "no such plan", **ERROR}})
    def get_plan(plan_id: str) -> Response:
        stored = store.get_plan(plan_id)
        if stored is None:
            raise HTTPException(404, f"no plan with id {plan_id!r}")
        return _json(stored["response"])

    @app.get("/v1/models", response_model=list[ModelInfo], tags=["catalog"])
    def models() -> list[ModelInfo]:
        return [ModelInfo(name=m.name, num_params=m.num_params, num_layers=m.num_layers, hidden_size=m.hidden_size,
                          num_attention_heads=m.num_attention_heads, num_kv_heads=m.kv_heads,
                          ffn_hidden_size=m.ffn_hidden_size, vocab_size=m.vocab_size) for m in presets().values()]

    @app.get("/v1/clusters", response_model=list[ClusterInfo], tags=["catalog"])
    def clusters() -> list[ClusterInfo]:
        return [ClusterInfo(**load_server(n).model_dump(include={"name", "display_name", "device", "gpus_per_node",
                                                                 "intra_node", "inter_node"}))
                for n in server_names()]

    @app.get("/v1/hardware-profiles", response_model=list[ProfileInfo], tags=["catalog"])
    def profiles() -> list[ProfileInfo]:
        return [ProfileInfo(**load_device(n).model_dump(include={"name", "display_name", "kind", "memory_bytes",
                                                                 "peak_flops_per_s"}))
                for n in device_names()]

    @app.get("/v1/hardware-profiles/{name}", response_model=DeviceProfile, tags=["catalog"],
             responses={404: {"description": "no such profile", **ERROR}})
    def profile(name: str) -> DeviceProfile:
        try:
            return load_device(name)
        except UnknownProfileError as err:
            raise HTTPException(404, str(err)) from None

    def _check_key(key: str | None) -> None:
        if not settings.validation_enabled:
            raise HTTPException(403, "validation is disabled on this server (start it with BERTH_VALIDATION_ENABLED=1)")
        if settings.api_key and not (key and hmac.compare_digest(key, settings.api_key)):
            raise HTTPException(401, "a valid X-API-Key header is required for validations")
        if importlib.util.find_spec("torch") is None:
            raise HTTPException(403, "this server has no torch: run the executor image (docker build --build-arg "
                                "WITH_TORCH=1) to validate")

    def _run_validation(job_id: str, chosen: Plan, req: ValidationRequest) -> None:
        from executor.validate import validate, validate_proxy

        store.update_job(job_id, "running")
        try:
            if req.proxy:
                report = validate_proxy(chosen, layers=req.layers, steps=req.steps, warmup=req.warmup, store=store)
            else:
                report = validate(chosen, steps=req.steps, warmup=req.warmup, store=store)
        except BerthError as err:
            store.update_job(job_id, "failed", message=f"refused before launch: {err}")
            return
        except Exception as err:  # the job must end in a state, whatever happened
            store.update_job(job_id, "failed", message=f"{type(err).__name__}: {err}")
            return
        store.update_job(job_id, "done" if report.status == "ok" else "failed", report_id=report.id,
                         message=report.message)

    validation_errors = {401: {"description": "missing or wrong X-API-Key", **ERROR},
                         403: {"description": "validation disabled on this server", **ERROR},
                         404: {"description": "no such plan or validation", **ERROR},
                         400: COMMON_ERRORS[400], 413: COMMON_ERRORS[413]}

    @app.post("/v1/validations", response_model=ValidationJob, status_code=202, tags=["validations"],
              responses=validation_errors)
    def create_validation(req: ValidationRequest, x_api_key: str | None = Header(default=None)) -> ValidationJob:
        _check_key(x_api_key)
        stored = store.get_plan(req.plan_id)
        if stored is None:
            raise HTTPException(404, f"no plan with id {req.plan_id!r}")
        listed = stored["response"].get("plans", stored["response"].get("candidates", []))
        if req.pick > len(listed):
            raise BerthError("pick", req.pick, f"plan {req.plan_id} holds {len(listed)} plans")
        try:
            chosen = Plan.model_validate(listed[req.pick - 1])
        except ValidationError as err:
            raise from_validation_error(err, "plan") from None
        job = ValidationJob(id=uuid.uuid4().hex, created=_now(), plan_id=req.plan_id, status="queued")
        store.add_job(job.id, job.created, req.plan_id, req.model_dump(mode="json"))
        validations.submit(_run_validation, job.id, chosen, req)
        return job

    @app.get("/v1/validations/{job_id}", response_model=ValidationJob, tags=["validations"],
             responses=validation_errors)
    def get_validation(job_id: str, x_api_key: str | None = Header(default=None)) -> ValidationJob:
        _check_key(x_api_key)
        job = store.get_job(job_id)
        if job is None:
            raise HTTPException(404, f"no validation with id {job_id!r}")
        report = store.get_validation(job["report_id"]) if job["report_id"] else None
        return ValidationJob(id=job["id"], created=job["created"], plan_id=job["plan_id"], status=job["status"],
                             message=job["message"], report=report)

    return app


__all__ = ["create_app"]
