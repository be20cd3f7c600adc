"""The berth REST service: thin routes over berth.planner.planning, the same JSON as the CLI.

Run it with `berth serve` (uvicorn). Nothing that can take time runs on the event loop: building
a cluster (and nvidia-smi for `local`), searches, serialization and every SQLite read and write run
in bounded pools of worker threads (`Workers`), each request inside one time budget
(BERTH_REQUEST_TIMEOUT_S) that covers all of it, the waits included. Over budget the answer is 503
and the search stops at its next chunk; with every worker busy and the queue full the answer is 429
at once, both with Retry-After. A request never names a file on the server: cluster presets come
from the package's catalog (an enum in the schema), graphs and models come inline.
Validations (running the executor on this host) are off unless BERTH_VALIDATION_ENABLED=1, which
needs BERTH_API_KEY; they run one at a time in the background, in a temp dir removed afterwards,
and are killed when the server stops.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import importlib.util
import json
import multiprocessing
import os
import queue
import shutil
import signal
import sqlite3
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Future, ProcessPoolExecutor, ThreadPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import anyio
from fastapi import FastAPI, Header, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from fastapi.routing import APIRoute
from pydantic import ValidationError

from berth.api.schemas import (
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
    PresetCluster,
    ProfileInfo,
    ValidationJob,
    ValidationRequest,
)
from berth.api.settings import Settings
from berth.hardware_profiles import (
    DeviceProfile,
    UnknownProfileError,
    device_names,
    load_device,
    load_server,
    server_names,
)
from berth.planner import __version__
from berth.planner.errors import BerthError, from_validation_error
from berth.planner.launch import artifacts
from berth.planner.models import load_model, presets
from berth.planner.planning import (
    cached_plan,
    compare,
    compare_json,
    default_precision,
    json_text,
    make_cluster,
    make_search,
    make_training,
    plan,
    plans_text,
    with_fallback,
    with_operations,
)
from berth.planner.search import SearchTimeout
from berth.planner.specs import ClusterSpec, Plan, pick_plan, plan_listing
from berth.planner.store import BUSY_TIMEOUT_S, Store
from berth.planner.topology import LOCAL, cluster_from_node_link

ERROR = {"content": {"application/json": {"schema": {"type": "object", "properties": {"detail": {}}}}}}
COMMON_ERRORS: dict[int | str, dict[str, Any]] = {
    400: {"description": "the body is not JSON", **ERROR},
    413: {"description": "request body larger than BERTH_MAX_BODY_BYTES", **ERROR},
    415: {"description": "the body is not application/json", **ERROR},
    429: {"description": "every worker busy and the queue full; retry after Retry-After seconds", **ERROR},
    503: {"description": "over the time budget; retry later", **ERROR},
}
# A preset cluster of more GPUs than this, or a graph of more elements, is built in the one
# "build" thread: a 65,536-GPU preset takes seconds of pure Python, and must not hold the threads
# that answer everyone else (a 4,096-GPU preset builds in about 0.5 s on the CI machine).
HEAVY_CLUSTER_GPUS = 4096
HEAVY_GRAPH_ELEMENTS = 5000
BUILD_QUEUE = 2  # heavy builds waiting beyond the one running: more get 429
STORE_THREADS = 2  # SQLite reads at once (each waits at most the request budget for a lock)
LIGHT_THREADS = 2  # resolving cached clusters, cache hits, launch files (CPU work: 2 cores on CI)
# The event loop waits for the interpreter lock behind every busy worker thread, up to one switch
# interval each (5 ms by default): at 1 ms a /healthz behind 4 busy threads waits ~4 ms, not 20.
SWITCH_INTERVAL_S = 0.001
RETRY_AFTER_S = 1
STORE_GRACE_S = 0.25  # how long a reply waits for its row (a WAL commit takes ~1 ms when the lock is free)
MAX_PENDING_WRITES = 2000  # answers waiting for a locked store: at most ~80 MB of distinct 37 KB answers
WRITE_BATCH = 256  # rows per transaction


def _now() -> str:
    return datetime.now(UTC).isoformat()


def _json(body: dict[str, Any], status: int = 200, headers: dict[str, str] | None = None) -> Response:
    """Answer built from already-validated specs: serialized once, without a second validation
    pass through the response model (which stays in the OpenAPI schema and is checked by the
    schemathesis test). Always valid JSON: a non-finite number is null."""
    return Response(content=json_text(body), status_code=status, media_type="application/json", headers=headers)


def _unprocessable(err: BerthError) -> Response:
    """A BerthError in the same shape as FastAPI's own 422 body: loc names the field."""
    value = err.to_dict()["value"]
    if isinstance(value, str) and len(value) > 200:  # an echo never carries a whole oversized input
        value = value[:197] + "..."
    item = {"loc": ["body", *err.field.split(".")], "msg": err.problem[:1000], "type": "value_error", "input": value}
    return _json({"detail": [item]}, 422)


def _busy(status: int, detail: str) -> HTTPException:
    return HTTPException(status, detail, headers={"Retry-After": str(RETRY_AFTER_S)})


def _finite_float(text: str) -> float:
    value = float(text)
    if value in (float("inf"), float("-inf")):
        raise json.JSONDecodeError(f"{text} is out of range for a finite number", text, 0)
    return value


def _no_constant(name: str) -> Any:
    raise json.JSONDecodeError(f"{name} is not a number JSON allows", name, 0)


class StrictJSONRequest(Request):
    """Request bodies parsed strictly: NaN, Infinity and numbers beyond a double are refused (422),
    like any other invalid JSON."""

    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            body = await self.body()
            try:
                self._json = json.loads(body, parse_constant=_no_constant, parse_float=_finite_float)
            except json.JSONDecodeError:
                raise
            except (ValueError, RecursionError) as err:  # an int of more than 4,300 digits, nesting too deep
                raise json.JSONDecodeError(str(err)[:200], "", 0) from None
        return self._json


class StrictRoute(APIRoute):
    def get_route_handler(self) -> Callable:
        handler = super().get_route_handler()

        async def strict(request: Request) -> Response:
            return await handler(StrictJSONRequest(request.scope, request.receive, request._send))

        return strict


class Workers:
    """A pool of `threads` worker threads with at most `queue` more jobs waiting; beyond that the
    request is refused at once (429). A slot is freed when its thread returns, not when the
    request gives up, so abandoned work still counts against the bound."""

    def __init__(self, name: str, threads: int, queue: int):
        self.name, self.limit = name, threads + queue
        self.pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix=f"berth-{name}")
        self.pending = 0
        self._lock = threading.Lock()

    def _done(self, _: Any) -> None:
        with self._lock:
            self.pending -= 1

    async def run(self, fn: Callable[[], Any], cancel: threading.Event | None = None) -> Any:
        with self._lock:
            if self.pending >= self.limit:
                raise _busy(429, f"the server is busy ({self.name}: {self.limit} requests running or queued); "
                            f"retry after {RETRY_AFTER_S} s")
            self.pending += 1
        future = self.pool.submit(fn)
        future.add_done_callback(self._done)
        try:
            return await asyncio.wrap_future(future)
        except asyncio.CancelledError:
            if cancel is not None:
                cancel.set()  # a search stops at its next chunk
            future.cancel()  # a job still queued never starts
            raise

    def shutdown(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)


def _kill_children() -> None:
    """End the process groups this server started (torchrun of a running validation: the executor
    starts it in its own session), SIGTERM then SIGKILL."""
    me = os.getpid()
    groups = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[1]) == me:  # fields: state, ppid, pgrp, ...
                groups.append(int(stat.parent.name))
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in groups:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, sig)
        if sig == signal.SIGTERM and groups:
            time.sleep(0.5)


class BodyLimit:
    """Pure ASGI middleware, before anything parses a body: a body with a content type other than
    JSON gets 415; one over the limit 413, whether it announces its length or streams (chunked);
    one that does not arrive within `timeout_s` 408. The body read here is handed on as it came."""

    def __init__(self, app, limit: int, timeout_s: float = 10.0):
        self.app, self.limit, self.timeout_s = app, limit, timeout_s

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] not in ("POST", "PUT", "PATCH"):
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        kind = headers.get(b"content-type", b"").split(b";")[0].strip().lower()
        has_body = headers.get(b"content-length", b"0") != b"0" or b"transfer-encoding" in headers
        if has_body and kind != b"application/json" and not kind.endswith(b"+json"):
            shown = kind.decode("latin-1")[:100] or "none"
            return await _json({"detail": f"content type {shown!r}: send application/json"}, 415)(
                scope, receive, send)
        length = headers.get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.limit):
            return await self._too_big(scope, receive, send)
        chunks, seen = [], 0
        try:
            with anyio.fail_after(self.timeout_s):
                while True:
                    message = await receive()
                    if message["type"] != "http.request":
                        return None  # the client went away
                    chunks.append(message.get("body", b""))
                    seen += len(chunks[-1])
                    if seen > self.limit:
                        return await self._too_big(scope, receive, send)
                    if not message.get("more_body", False):
                        break
        except TimeoutError:
            return await _json({"detail": f"the body did not arrive within {self.timeout_s:g} s"}, 408,
                               {"Connection": "close"})(scope, receive, send)
        body, sent = b"".join(chunks), False

        async def replay():
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        return await self.app(scope, replay, send)

    async def _too_big(self, scope, receive, send):
        return await _json({"detail": f"request body over {self.limit} bytes"}, 413, {"Connection": "close"})(
            scope, receive, send)


def _heavy(cluster_req: Any) -> bool:
    """Whether building this cluster may take seconds (see HEAVY_CLUSTER_GPUS)."""
    if isinstance(cluster_req, GraphCluster):
        g = cluster_req.graph
        return sum(len(g[k]) for k in ("nodes", "links") if isinstance(g.get(k), list)) > HEAVY_GRAPH_ELEMENTS
    if cluster_req.preset == LOCAL:
        return False
    return load_server(cluster_req.preset).gpus_per_node * cluster_req.nodes > HEAVY_CLUSTER_GPUS


def build_cluster(cluster_req: PresetCluster | GraphCluster, max_gpus: int) -> ClusterSpec:
    """The cluster of a request (a preset of the catalog, `local`, or an inline graph), refused
    when it has more than `max_gpus` GPUs, counted before the graph is built."""
    def too_big(gpus: int) -> None:
        if gpus > max_gpus:
            raise BerthError("cluster", gpus, f"{gpus:,} GPUs is more than this server plans for ({max_gpus:,})")

    if isinstance(cluster_req, GraphCluster):
        nodes = cluster_req.graph.get("nodes")
        if isinstance(nodes, list):
            too_big(sum(1 for n in nodes if isinstance(n, dict) and n.get("kind") == "gpu"))
        cluster = cluster_from_node_link(cluster_req.graph, cluster_req.name)
    else:
        if cluster_req.preset != LOCAL:
            too_big(load_server(cluster_req.preset).gpus_per_node * cluster_req.nodes)
        cluster = make_cluster(cluster_req.preset, cluster_req.nodes, cluster_req.devices_per_node,
                               fabric=cluster_req.fabric, nodes_per_leaf=cluster_req.nodes_per_leaf,
                               oversubscription=cluster_req.oversubscription, allow_files=False)
    too_big(cluster.world_size)
    return cluster


class Builds:
    """Large clusters are built in one child process: seconds of pure-Python graph work whose
    full garbage collections (about 0.4 s for 65,536 GPUs) would pause every thread of the server,
    the event loop included. The child has its own interpreter lock and collector; a build whose
    request gave up finishes there (into the child's preset cache) but holds no thread of the
    server, and the child is killed with the server. At most `queue` builds wait beyond the
    running one; more get 429."""

    def __init__(self, queue: int):
        self.limit = 1 + queue
        self.pending = 0
        self._pool: ProcessPoolExecutor | None = None
        self._lock = threading.Lock()

    def _executor(self) -> ProcessPoolExecutor:
        with self._lock:
            if self._pool is None:
                self._pool = ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn"))
            return self._pool

    def _done(self, _: Any) -> None:
        with self._lock:
            self.pending -= 1

    async def run(self, cluster_req: Any, max_gpus: int) -> ClusterSpec:
        with self._lock:
            if self.pending >= self.limit:
                raise _busy(429, f"the server is busy ({self.limit} large clusters being built or queued); retry "
                            f"after {RETRY_AFTER_S} s")
            self.pending += 1
        pool = self._executor()
        try:
            future = pool.submit(build_cluster, cluster_req, max_gpus)
        except BrokenProcessPool:
            self._done(None)
            self.kill(pool)
            raise _busy(503, "the cluster builder restarted; retry") from None
        future.add_done_callback(self._done)
        try:
            return await asyncio.wrap_future(future)
        except asyncio.CancelledError:
            future.cancel()  # a build still queued never starts; a running one finishes in the child and
            raise  # stays in its cache (the child is one process: at most one build runs at a time)
        except BrokenProcessPool:
            self.kill(pool)
            raise _busy(503, "the cluster builder stopped; retry") from None

    def kill(self, pool: ProcessPoolExecutor | None = None) -> None:
        with self._lock:
            pool = pool or self._pool
            if pool is None:
                return
            if self._pool is pool:
                self._pool = None
        for proc in list(getattr(pool, "_processes", {}).values()):  # the executor keeps its children here
            with contextlib.suppress(Exception):
                proc.kill()
        pool.shutdown(wait=False, cancel_futures=True)


class Writer:
    """The one thread that writes answers to SQLite, in order, many per transaction. A request
    waits for its own row up to STORE_GRACE_S: a commit takes milliseconds, so normally the answer
    is on disk before the reply goes out. When another process holds the write lock longer, the
    reply goes out anyway and the row is written as soon as the lock is free; until then the
    answer is served from memory (GET, launch, validate). At most `max_pending` answers wait
    (bounded memory); beyond that the request is 503 with Retry-After."""

    def __init__(self, store: Store, max_pending: int):
        self.store, self.max_pending = store, max_pending
        self.pending: dict[str, tuple[str, str, str]] = {}
        self._queue: queue.Queue = queue.Queue()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="berth-store-writer", daemon=True)
        self._thread.start()

    def submit(self, plan_id: str, created: str, kind: str, answer: str) -> Future:
        with self._lock:
            if len(self.pending) >= self.max_pending:
                raise _busy(503, f"the store is not accepting writes ({len(self.pending)} answers waiting for "
                            "it); retry later")
            self.pending[plan_id] = (created, kind, answer)
        done: Future = Future()
        self._queue.put((plan_id, created, kind, answer, done))
        return done

    def get(self, plan_id: str) -> dict[str, Any] | None:
        with self._lock:
            item = self.pending.get(plan_id)
        if item is None:
            return None
        created, kind, answer = item
        head = json.dumps({"id": plan_id, "created": created})[:-1]
        return {"kind": kind, "response": json.loads(head + "," + answer[1:])}

    def _run(self) -> None:
        while True:
            batch = [self._queue.get()]
            if batch[0] is None:
                return
            while len(batch) < WRITE_BATCH:
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
                if item is None:
                    self._queue.put(None)
                    break
                batch.append(item)
            while True:
                try:
                    self.store.add_answers([item[:4] for item in batch])
                    break
                except sqlite3.OperationalError:  # locked by someone else: wait for it, keep the rows
                    if self._stop.wait(0.05):
                        return
            with self._lock:
                for item in batch:
                    self.pending.pop(item[0], None)
            for item in batch:
                item[4].set_result(None)

    def stop(self, timeout_s: float = 5.0) -> None:
        """Write what is waiting (within `timeout_s`), then stop."""
        self._queue.put(None)
        self._thread.join(timeout_s)
        self._stop.set()


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or Settings()
    budget = settings.request_timeout_s
    store = Store(settings.store_path, busy_timeout_s=min(BUSY_TIMEOUT_S, budget), max_plans=settings.store_max_plans,
                  max_bytes=settings.store_max_bytes, retention_days=settings.store_retention_days)
    store.fail_unfinished_jobs("the server stopped before this validation finished")
    searches = Workers("search", settings.max_concurrent_searches, settings.max_queued_requests)
    light = Workers("light", LIGHT_THREADS, settings.max_queued_requests)
    builds = Builds(BUILD_QUEUE)
    io = Workers("store", STORE_THREADS, settings.max_queued_requests)
    writer = Writer(store, MAX_PENDING_WRITES)
    validations = ThreadPoolExecutor(max_workers=1, thread_name_prefix="berth-validate")
    jobs = {"open": 0}
    jobs_lock = threading.Lock()
    run_dirs: set[str] = set()  # temp dirs of running validations, removed on shutdown too
    server_names()  # the catalog, read once at startup (the names are also the schema's enum)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):
        sys.setswitchinterval(SWITCH_INTERVAL_S)
        yield
        for pool in (searches, light, io):
            pool.shutdown()
        builds.kill()
        writer.stop()
        validations.shutdown(wait=False, cancel_futures=True)
        _kill_children()  # a running validation's torchrun does not outlive the server
        for run_dir in list(run_dirs):
            shutil.rmtree(run_dir, ignore_errors=True)

    app = FastAPI(title="berth", version=__version__, lifespan=lifespan,
                  description="Parallelism-layout planner for training large transformers.")
    app.router.route_class = StrictRoute
    app.state.settings, app.state.store = settings, store
    app.add_middleware(BodyLimit, limit=settings.max_body_bytes, timeout_s=settings.header_timeout_s)

    @app.exception_handler(BerthError)
    async def berth_error(_: Request, err: BerthError) -> Response:
        return _unprocessable(err)

    @app.exception_handler(ValidationError)
    async def spec_error(_: Request, err: ValidationError) -> Response:
        return _unprocessable(from_validation_error(err))

    @app.exception_handler(RequestValidationError)
    async def request_error(_: Request, err: RequestValidationError) -> Response:
        detail = []
        for e in err.errors():
            item = {k: v for k, v in e.items() if k in ("loc", "msg", "type")}
            if e.get("type") == "json_invalid" and isinstance(e.get("ctx"), dict):
                item["msg"] = f"{e['msg']}: {e['ctx'].get('error')}"
            detail.append(item)
        return _json({"detail": detail}, 422)

    def resolve(req, cluster: ClusterSpec | None) -> tuple[Any, Any, ClusterSpec]:
        model = load_model(req.model, allow_files=False)
        if cluster is None:
            cluster = build_cluster(req.cluster, settings.max_gpus)
        ops = req.operations
        if ops is not None:
            gbps = ops.storage_write_gbps_per_gpu
            cluster = with_operations(cluster, ops.failures_per_gpu_hour, gbps * 1e9 if gbps else None,
                                      ops.price_per_gpu_hour)
        fields = req.training.model_dump()
        fields["precision"] = fields["precision"] or default_precision(cluster)
        return model, make_training(**fields), cluster

    async def resolved(req, cancel: threading.Event, then: Callable | None = None):
        """Model, training and cluster, built in a worker thread (`local` asks nvidia-smi there),
        a large cluster in the build process; never on the event loop. `then(model, training,
        cluster)` runs in the same thread and its result is returned too."""
        built = await builds.run(req.cluster, settings.max_gpus) if _heavy(req.cluster) else None

        def work():
            specs = resolve(req, built)
            return (*specs, then(*specs)) if then else specs

        return await light.run(work, cancel)

    async def within_budget(work):
        """Run `work(deadline, cancel)` under the one budget of this request: everything it awaits
        counts, the waits for a worker or for the SQLite lock included."""
        cancel = threading.Event()
        deadline = time.monotonic() + budget
        try:
            with anyio.fail_after(budget):
                return await work(deadline, cancel)
        except (TimeoutError, SearchTimeout):
            cancel.set()
            raise _busy(503, f"over this server's {budget:g} s budget for one request; narrow the search "
                        "(search.fix) or retry") from None

    async def stored(plan_id: str, cancel: threading.Event | None = None) -> dict[str, Any] | None:
        return writer.get(plan_id) or await io.run(lambda: store.get_plan(plan_id), cancel)

    async def keep(plan_id: str, created: str, kind: str, answer: str) -> None:
        """Hand the answer to the writer; wait for its row up to STORE_GRACE_S."""
        done = writer.submit(plan_id, created, kind, answer)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(done)), STORE_GRACE_S)

    @app.get("/healthz", response_model=Health, tags=["service"])
    async def healthz() -> Health:
        return Health(status="ok", version=__version__, validation_enabled=settings.validation_enabled)

    async def answered(answer: str, kind: str) -> Response:
        """The answer (a JSON object's text) kept under a new id, and sent with its id and time."""
        plan_id, created = uuid.uuid4().hex, _now()
        await keep(plan_id, created, kind, answer)
        head = json.dumps({"id": plan_id, "created": created})[:-1]
        return Response(content=head + "," + answer[1:], media_type="application/json")

    @app.post("/v1/plans", response_model=PlanResponse, tags=["plans"], responses=COMMON_ERRORS)
    async def create_plan(req: PlanRequest) -> Response:
        spec = make_search(top=req.search.top, fix=req.search.fix, objective=req.search.objective,
                           max_micro_batch_size=req.search.max_micro_batch_size,
                           memory_headroom=req.search.memory_headroom)

        def cached(model, training, cluster) -> str | None:
            """A repeated question's answer, without waiting for a search thread."""
            result = cached_plan(model, training, cluster, spec, settings.max_candidates)
            return plans_text(result) if result is not None and not req.search.fallback else None

        async def work(deadline: float, cancel: threading.Event) -> Response:
            model, training, cluster, answer = await resolved(req, cancel, cached)

            def search() -> str:
                result = plan(model, training, cluster, spec, settings.max_candidates, deadline, cancel)
                if req.search.fallback:
                    result = with_fallback(result, spec, deadline, cancel)
                return plans_text(result)

            if answer is None:
                answer = await searches.run(search, cancel)
            return await answered(answer, "plan")

        return await within_budget(work)

    @app.post("/v1/compare", response_model=CompareResponse, tags=["plans"], responses=COMMON_ERRORS)
    async def create_compare(req: CompareRequest) -> Response:
        async def work(deadline: float, cancel: threading.Event) -> Response:
            model, training, cluster = await resolved(req, cancel)

            def score() -> str:
                candidates = compare(model, training, cluster, req.layouts, req.memory_headroom)
                try:
                    best = plan(model, training, cluster, make_search(top=1, memory_headroom=req.memory_headroom),
                                settings.max_candidates, deadline, cancel)
                except BerthError:
                    best = None
                return json_text(compare_json(candidates, best))

            return await answered(await searches.run(score, cancel), "compare")

        return await within_budget(work)

    @app.post("/v1/launch", response_model=LaunchResponse, tags=["plans"],
              responses={404: {"description": "no such plan", **ERROR}, **COMMON_ERRORS})
    async def create_launch(req: LaunchRequest) -> Response:
        """The files that launch a stored plan (the same as `berth launch`)."""
        async def work(_: float, cancel: threading.Event) -> Response:
            got = await stored(req.plan_id, cancel)
            if got is None:
                raise HTTPException(404, f"no plan with id {req.plan_id!r}")
            plans = plan_listing(got["response"]) or []

            def build() -> dict[str, str]:
                chosen = pick_plan(plans, req.pick, f"plan {req.plan_id}")
                return artifacts(chosen, req.format, steps=req.steps, warmup=req.warmup, image=req.image)

            files = await light.run(build, cancel)
            return _json({"plan_id": req.plan_id, "format": req.format, "files": files})

        return await within_budget(work)

    @app.get("/v1/plans/{plan_id}", response_model=PlanResponse | CompareResponse, tags=["plans"],
             responses={404: {"description": "no such plan", **ERROR}})
    async def get_plan(plan_id: str) -> Response:
        async def work(_: float, cancel: threading.Event) -> Response:
            got = await stored(plan_id[:64], cancel)
            if got is None:
                raise HTTPException(404, f"no plan with id {plan_id[:64]!r}")
            return _json(got["response"])

        return await within_budget(work)

    @app.get("/v1/models", response_model=list[ModelInfo], tags=["catalog"])
    def models() -> list[ModelInfo]:
        return [ModelInfo(name=m.name, num_params=m.num_params, num_layers=m.num_layers, hidden_size=m.hidden_size,
                          num_attention_heads=m.num_attention_heads, num_kv_heads=m.kv_heads,
                          ffn_hidden_size=m.ffn_hidden_size, vocab_size=m.vocab_size, num_experts=m.num_experts,
                          experts_per_token=m.experts_per_token, active_params=m.active_params)
                for m in presets().values()]

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
        if name not in device_names():  # the catalog's names only: never a path
            raise HTTPException(404, f"unknown device {name[:64]!r}; known: {', '.join(device_names())}")
        try:
            return load_device(name)
        except UnknownProfileError as err:
            raise HTTPException(404, str(err)) from None

    def _check_key(key: str | None) -> None:
        if not settings.validation_enabled:
            raise HTTPException(403, "validation is disabled on this server (start it with BERTH_VALIDATION_ENABLED=1)")
        # compared as bytes: a header may carry any byte (Starlette decodes it as latin-1)
        given = key.encode("latin-1", "replace") if key else b""
        if not hmac.compare_digest(given, (settings.api_key or "").encode()):
            raise HTTPException(401, "a valid X-API-Key header is required for validations")
        if importlib.util.find_spec("torch") is None:
            raise HTTPException(403, "this server has no torch: run the executor image (docker build --build-arg "
                                "WITH_TORCH=1) to validate")

    def _run_validation(job_id: str, chosen: Plan, req: ValidationRequest) -> None:
        from berth.executor.validate import validate, validate_proxy

        try:
            store.update_job(job_id, "running")
            with tempfile.TemporaryDirectory(prefix="berth-validate-") as run_dir:  # removed afterwards
                run_dirs.add(run_dir)
                if req.proxy:
                    report = validate_proxy(chosen, layers=req.layers, steps=req.steps, warmup=req.warmup,
                                            store=store, run_dir=run_dir)
                else:
                    report = validate(chosen, steps=req.steps, warmup=req.warmup, store=store, run_dir=run_dir)
                run_dirs.discard(run_dir)
            store.update_job(job_id, "done" if report.status == "ok" else "failed", report_id=report.id,
                             message=report.message)
        except BerthError as err:
            store.update_job(job_id, "failed", message=f"refused before launch: {err}")
        except Exception as err:  # the job must end in a state, whatever happened
            with contextlib.suppress(Exception):
                store.update_job(job_id, "failed", message=f"{type(err).__name__}: {err}")
        finally:
            with jobs_lock:
                jobs["open"] -= 1

    validation_errors = {401: {"description": "missing or wrong X-API-Key", **ERROR},
                         403: {"description": "validation disabled on this server", **ERROR},
                         404: {"description": "no such plan or validation", **ERROR},
                         429: {"description": "BERTH_MAX_QUEUED_VALIDATIONS queued or running", **ERROR},
                         400: COMMON_ERRORS[400], 413: COMMON_ERRORS[413], 415: COMMON_ERRORS[415]}

    @app.post("/v1/validations", response_model=ValidationJob, status_code=202, tags=["validations"],
              responses=validation_errors)
    async def create_validation(req: ValidationRequest, x_api_key: str | None = Header(default=None)) -> ValidationJob:
        _check_key(x_api_key)

        async def work(_: float, cancel: threading.Event) -> ValidationJob:
            got = await stored(req.plan_id, cancel)
            if got is None:
                raise HTTPException(404, f"no plan with id {req.plan_id!r}")
            chosen = pick_plan(plan_listing(got["response"]) or [], req.pick, f"plan {req.plan_id}")
            with jobs_lock:
                if jobs["open"] >= settings.max_queued_validations:
                    raise _busy(429, f"{jobs['open']} validations queued or running (at most "
                                f"{settings.max_queued_validations}); retry later")
                jobs["open"] += 1
            job = ValidationJob(id=uuid.uuid4().hex, created=_now(), plan_id=req.plan_id, status="queued")
            try:
                await io.run(lambda: store.add_job(job.id, job.created, req.plan_id, req.model_dump(mode="json")),
                             cancel)
                validations.submit(_run_validation, job.id, chosen, req)
            except BaseException:
                with jobs_lock:
                    jobs["open"] -= 1
                raise
            return job

        return await within_budget(work)

    @app.get("/v1/validations/{job_id}", response_model=ValidationJob, tags=["validations"],
             responses=validation_errors)
    async def get_validation(job_id: str, x_api_key: str | None = Header(default=None)) -> ValidationJob:
        _check_key(x_api_key)

        async def work(_: float, cancel: threading.Event) -> ValidationJob:
            def read():
                job = store.get_job(job_id[:64])
                if job is None:
                    return None
                report = store.get_validation(job["report_id"]) if job["report_id"] else None
                return job, report

            got = await io.run(read, cancel)
            if got is None:
                raise HTTPException(404, f"no validation with id {job_id[:64]!r}")
            job, report = got
            return ValidationJob(id=job["id"], created=job["created"], plan_id=job["plan_id"], status=job["status"],
                                 message=job["message"], report=report)

        return await within_budget(work)

    return app


__all__ = ["create_app"]
