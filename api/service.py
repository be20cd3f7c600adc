"""The state behind the berth service, one `Service` per app (app.state.service, handed to every
route by the `get_service` dependency, which tests override): the settings, the SQLite store, the
bounded worker pools (`Workers`, `Builds`), the one store writer (`Writer`) and the validation
jobs, and the steps every route shares: resolving a request's specs off the event loop, the one
time budget of a request, storing and reading answers."""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import ctypes
import hmac
import importlib.util
import json
import multiprocessing
import os
import queue
import shutil
import signal
import sqlite3
import tempfile
import threading
import time
import uuid
from collections.abc import Awaitable, Callable
from concurrent.futures import Future, InvalidStateError, ProcessPoolExecutor, ThreadPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import anyio
from fastapi import HTTPException, Request
from fastapi.responses import Response

from berth.api.common import RETRY_AFTER_S, busy
from berth.api.schemas import ValidationRequest
from berth.api.settings import Settings
from berth.hardware_profiles import load_server
from berth.planner.inputs import ClusterInput, make_cluster_input, resolve
from berth.planner.search import SearchTimeout
from berth.planner.store import BUSY_TIMEOUT_S, Store
from berth.specs.errors import BerthError
from berth.specs.tree import ClusterSpec, ModelSpec, Plan, TrainingSpec
from berth.topology.clusters import LOCAL

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
MAX_PENDING_WRITES = 2000  # answers waiting for the store at once
MAX_PENDING_WRITE_BYTES = 64 << 20  # and their text, in bytes: beyond either, 503 at once
WRITE_BATCH = 256  # rows per transaction
QUEUE_CHECK_S = 0.1  # how often a queued job looks again whether it can still end within its budget
WRITER_BUSY_S = 0.1  # the writer's wait for a lock held elsewhere, between looks at its requests' deadlines
# The deadline of the request being served (set by Service.within_budget): a pool refuses at once
# a job that could not start and finish within it, and the writer drops a row whose request gave up.
DEADLINE: contextvars.ContextVar[float | None] = contextvars.ContextVar("berth_deadline", default=None)
PR_SET_PDEATHSIG = 1


def die_with_parent(sig: int = signal.SIGKILL) -> None:
    """Have the kernel send `sig` to this process when the thread that started it ends (Linux
    prctl PR_SET_PDEATHSIG): a child of the server dies with it, kill -9 of the server included.
    Run in the child (a pool's initializer, a Popen preexec_fn); a no-op elsewhere than Linux."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
    parent = multiprocessing.parent_process()
    if parent is not None and os.getppid() != parent.pid:  # it died before the prctl: nobody will signal
        os.kill(os.getpid(), sig)


def utc_now() -> str:
    return datetime.now(UTC).isoformat()


class Workers:
    """A pool of `threads` worker threads with at most `queue` more jobs waiting; beyond that the
    request is refused at once (429). A slot is freed when its thread returns, not when the
    request gives up, so abandoned work still counts against the bound. A job that would not
    start and finish before its request's deadline (the jobs ahead of it, at the pool's recent
    mean time per job) is refused (429) as soon as that is known: when it arrives, or while it
    waits in the queue (the first jobs teach the pool its mean), not after waiting out the budget."""

    def __init__(self, name: str, threads: int, queue: int):
        self.name, self.threads, self.limit = name, threads, threads + queue
        self.pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix=f"berth-{name}")
        self.pending = 0
        self.mean_s = 0.0  # moving mean of a job's time in a thread
        self.submitted = self.left = 0  # jobs handed to the queue, jobs that left it (started or cancelled)
        self._lock = threading.Lock()

    def _done(self, started: list[float]) -> Callable[[Any], None]:
        def done(_: Any) -> None:
            with self._lock:
                self.pending -= 1
                if started:  # the first job sets the mean, later ones move it
                    took = time.monotonic() - started[0]
                    self.mean_s = took if self.mean_s == 0 else self.mean_s + 0.2 * (took - self.mean_s)

        return done

    def _late(self, ahead: int, deadline: float | None) -> bool:
        """Whether a job behind `ahead` others would end past `deadline` at the pool's mean."""
        waves = ahead // self.threads + 1  # it ends with the waves of jobs ahead of it
        return deadline is not None and time.monotonic() + waves * self.mean_s > deadline

    def _late_refusal(self, ahead: int) -> HTTPException:
        return self._refuse(f"{ahead} jobs ahead at {self.mean_s:.2f} s each: this one would end past its budget")

    def _refuse(self, why: str) -> HTTPException:
        return busy(429, f"the server is busy ({self.name}: {why}); retry after {RETRY_AFTER_S} s")

    async def run(self, fn: Callable[[], Any], cancel: threading.Event | None = None) -> Any:
        deadline = DEADLINE.get()
        with self._lock:
            if self.pending >= self.limit:
                raise self._refuse(f"{self.limit} requests running or queued")
            if self._late(self.pending, deadline):
                raise self._late_refusal(self.pending)
            self.pending += 1
            self.submitted += 1
            ticket = self.submitted
        started: list[float] = []

        def timed() -> Any:
            with self._lock:
                self.left += 1
            started.append(time.monotonic())
            return fn()

        future = self.pool.submit(timed)
        future.add_done_callback(self._done(started))
        wrapped = asyncio.wrap_future(future)
        try:
            while deadline is not None and not started and not wrapped.done():
                await asyncio.wait({wrapped}, timeout=QUEUE_CHECK_S)
                with self._lock:
                    ahead = max(0, ticket - 1 - self.left)
                if not started and self._late(ahead, deadline) and future.cancel():
                    with self._lock:
                        self.left += 1
                    raise self._late_refusal(ahead)
            return await wrapped
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


def _heavy(cluster: ClusterInput) -> bool:
    """Whether building this cluster may take seconds (see HEAVY_CLUSTER_GPUS)."""
    if cluster.graph is not None:
        g = cluster.graph
        return sum(len(g[k]) for k in ("nodes", "links") if isinstance(g.get(k), list)) > HEAVY_GRAPH_ELEMENTS
    if cluster.preset == LOCAL:
        return False
    return load_server(cluster.preset).gpus_per_node * cluster.nodes > HEAVY_CLUSTER_GPUS


def build_cluster(cluster: ClusterInput, max_gpus: int) -> ClusterSpec:
    """The cluster of a request (a preset of the catalog, `local`, or an inline graph: never a
    file), refused when it has more than `max_gpus` GPUs, counted before the graph is built."""

    def too_big(gpus: int) -> None:
        if gpus > max_gpus:
            raise BerthError("cluster", gpus, f"{gpus:,} GPUs is more than this server plans for ({max_gpus:,})")

    if cluster.graph is not None:
        nodes = cluster.graph.get("nodes")
        if isinstance(nodes, list):
            too_big(sum(1 for n in nodes if isinstance(n, dict) and n.get("kind") == "gpu"))
    elif cluster.preset != LOCAL:
        too_big(load_server(cluster.preset).gpus_per_node * cluster.nodes)
    built = make_cluster_input(cluster, allow_files=False)
    too_big(built.world_size)
    return built


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
            if self._pool is None:  # the child dies with the server, kill -9 included
                self._pool = ProcessPoolExecutor(
                    max_workers=1, mp_context=multiprocessing.get_context("spawn"), initializer=die_with_parent
                )
            return self._pool

    def _done(self, _: Any) -> None:
        with self._lock:
            self.pending -= 1

    async def run(self, cluster: ClusterInput, max_gpus: int) -> ClusterSpec:
        with self._lock:
            if self.pending >= self.limit:
                raise busy(
                    429,
                    f"the server is busy ({self.limit} large clusters being built or queued); retry "
                    f"after {RETRY_AFTER_S} s",
                )
            self.pending += 1
        pool = self._executor()
        try:
            future = pool.submit(build_cluster, cluster, max_gpus)
        except BrokenProcessPool:
            self._done(None)
            self.kill(pool)
            raise busy(503, "the cluster builder restarted; retry") from None
        future.add_done_callback(self._done)
        try:
            return await asyncio.wrap_future(future)
        except asyncio.CancelledError:
            future.cancel()  # a build still queued never starts; a running one finishes in the child and
            raise  # stays in its cache (the child is one process: at most one build runs at a time)
        except BrokenProcessPool:
            self.kill(pool)
            raise busy(503, "the cluster builder stopped; retry") from None

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


def _settle(done: Future, result: BaseException | None) -> None:
    """Settle a writer's future unless its request already gave up on it."""
    with contextlib.suppress(InvalidStateError):
        if isinstance(result, BaseException):
            done.set_exception(result)
        else:
            done.set_result(None)


class Writer:
    """The one thread that writes answers to SQLite, in order, many per transaction. A request's
    id goes out only once its row is committed: the request waits for it within its deadline.
    When another process holds the write lock, the writer retries (WRITER_BUSY_S at a time) and
    drops the rows whose request has given up (that request answered 503, so no id of a row
    that is not on disk is ever handed out). At most `max_pending` answers and `max_bytes` of
    their text wait (bounded memory); beyond that the request is 503 with Retry-After."""

    def __init__(self, store: Store, max_pending: int, max_bytes: int = MAX_PENDING_WRITE_BYTES):
        self.store, self.max_pending, self.max_bytes = store, max_pending, max_bytes
        self.pending: dict[str, tuple[str, str, str]] = {}
        self.pending_bytes = 0
        self._queue: queue.Queue = queue.Queue()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="berth-store-writer", daemon=True)
        self._thread.start()

    def submit(self, plan_id: str, created: str, kind: str, answer: str, deadline: float | None = None) -> Future:
        with self._lock:
            if len(self.pending) >= self.max_pending or self.pending_bytes + len(answer) > self.max_bytes:
                raise busy(
                    503,
                    f"the store is not accepting writes ({len(self.pending)} answers, {self.pending_bytes:,} bytes "
                    "waiting for it); retry later",
                )
            self.pending[plan_id] = (created, kind, answer)
            self.pending_bytes += len(answer)
        done: Future = Future()
        self._queue.put((plan_id, created, kind, answer, done, deadline))
        return done

    def _forget(self, items: list[tuple]) -> None:
        with self._lock:
            for item in items:
                if self.pending.pop(item[0], None) is not None:
                    self.pending_bytes -= len(item[3])

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
            while batch:
                now = time.monotonic()
                late = [item for item in batch if item[5] is not None and item[5] <= now]
                if late:  # their requests answered 503: their rows are not written
                    self._forget(late)
                    for item in late:
                        _settle(item[4], TimeoutError("the store stayed locked past the request's deadline"))
                    batch = [item for item in batch if item not in late]
                    continue
                try:
                    self.store.add_answers([item[:4] for item in batch])
                    break
                except sqlite3.OperationalError:  # locked by someone else (after WRITER_BUSY_S): retry
                    if self._stop.wait(0.01):
                        return
                except Exception as err:  # the rows cannot be written (e.g. larger than the store): say so
                    self._forget(batch)
                    for item in batch:
                        _settle(item[4], err)
                    batch = []
            self._forget(batch)
            for item in batch:
                _settle(item[4], None)

    def stop(self, timeout_s: float = 5.0) -> None:
        """Write what is waiting (within `timeout_s`), then stop."""
        self._queue.put(None)
        self._thread.join(timeout_s)
        self._stop.set()


class Service:
    """Everything one berth app holds: created by create_app (the store is opened and checked
    there, as the server starts), kept on app.state.service, closed by the app's lifespan."""

    def __init__(self, settings: Settings):
        self.settings = settings
        self.budget = settings.request_timeout_s
        self.store = Store(
            settings.store_path,
            busy_timeout_s=min(BUSY_TIMEOUT_S, self.budget),
            max_plans=settings.store_max_plans,
            max_bytes=settings.store_max_bytes,
            retention_days=settings.store_retention_days,
        )
        self.store.fail_unfinished_jobs("the server stopped before this validation finished")
        self.searches = Workers("search", settings.max_concurrent_searches, settings.max_queued_requests)
        self.light = Workers("light", LIGHT_THREADS, settings.max_queued_requests)
        self.builds = Builds(BUILD_QUEUE)
        self.io = Workers("store", STORE_THREADS, settings.max_queued_requests)
        writer_store = Store(  # its own short lock wait: it looks at its requests' deadlines between tries
            settings.store_path,
            busy_timeout_s=WRITER_BUSY_S,
            max_plans=settings.store_max_plans,
            max_bytes=settings.store_max_bytes,
            retention_days=settings.store_retention_days,
        )
        self.writer = Writer(writer_store, MAX_PENDING_WRITES)
        self.validations = ThreadPoolExecutor(max_workers=1, thread_name_prefix="berth-validate")
        self.open_jobs = 0  # validations queued or running
        self.jobs_lock = threading.Lock()
        self.run_dirs: set[str] = set()  # temp dirs of running validations, removed on shutdown too

    def close(self) -> None:
        """Stop every pool, kill what this server started, remove the validations' temp dirs."""
        for pool in (self.searches, self.light, self.io):
            pool.shutdown()
        self.builds.kill()
        self.writer.stop()
        self.validations.shutdown(wait=False, cancel_futures=True)
        _kill_children()  # a running validation's torchrun does not outlive the server
        for run_dir in list(self.run_dirs):
            shutil.rmtree(run_dir, ignore_errors=True)

    def resolve(self, req: Any, cluster: ClusterInput | ClusterSpec) -> tuple[ModelSpec, TrainingSpec, ClusterSpec]:
        """A plan or compare request's specs, by the conversion the CLI uses (no file is named);
        `cluster` is the request's, or built already."""
        if isinstance(cluster, ClusterInput):
            cluster = build_cluster(cluster, self.settings.max_gpus)
        return resolve(req.model, cluster, req.training.to_input(), req.operations.to_input(), allow_files=False)

    async def resolved(self, req: Any, cancel: threading.Event, then: Callable | None = None) -> tuple:
        """Model, training and cluster, built in a worker thread (`local` asks nvidia-smi there),
        a large cluster in the build process; never on the event loop. `then(model, training,
        cluster)` runs in the same thread and its result is returned too."""
        max_gpus = self.settings.max_gpus
        cluster = req.cluster.to_input()
        built = await self.builds.run(cluster, max_gpus) if _heavy(cluster) else None

        def work() -> tuple:
            specs = self.resolve(req, cluster if built is None else built)
            return (*specs, then(*specs)) if then else specs

        return await self.light.run(work, cancel)

    async def within_budget(self, work: Callable[[float, threading.Event], Awaitable[Any]]) -> Any:
        """Run `work(deadline, cancel)` under the one budget of this request: everything it awaits
        counts, the waits for a worker or for the SQLite lock included."""
        budget = self.budget
        cancel = threading.Event()
        deadline = time.monotonic() + budget
        DEADLINE.set(deadline)
        try:
            with anyio.fail_after(budget):
                return await work(deadline, cancel)
        except (TimeoutError, SearchTimeout):
            cancel.set()
            raise busy(
                503, f"over this server's {budget:g} s budget for one request; narrow the search (search.fix) or retry"
            ) from None

    async def stored(self, plan_id: str, cancel: threading.Event | None = None) -> dict[str, Any] | None:
        return self.writer.get(plan_id) or await self.io.run(lambda: self.store.get_plan(plan_id), cancel)

    async def keep(self, plan_id: str, created: str, kind: str, answer: str) -> None:
        """Hand the answer to the writer and wait until its row is committed (within the request's
        deadline: past it, the request is 503 and the row is not written)."""
        try:
            done = self.writer.submit(plan_id, created, kind, answer, DEADLINE.get())
            await asyncio.shield(asyncio.wrap_future(done))
        except TimeoutError:
            raise busy(503, "the store stayed locked past this request's budget; retry later") from None

    def check_answer(self, field: str, value: int, plans: int, world_size: int) -> None:
        """An answer lists every rank of each of its plans: refuse (422, naming the limit) one of
        more than BERTH_MAX_ANSWER_RANKS plans x GPUs before it is searched or built."""
        limit = self.settings.max_answer_ranks
        if plans * world_size > limit:
            most = max(1, limit // max(1, world_size))
            raise BerthError(
                field,
                value,
                f"{plans} plans x {world_size:,} GPUs = {plans * world_size:,} ranks to list, over this server's "
                f"limit of {limit:,} (BERTH_MAX_ANSWER_RANKS); ask for at most {most} plan(s) on this cluster",
            )

    async def answered(self, answer: str, kind: str) -> Response:
        """The answer (a JSON object's text) kept under a new id, and sent with its id and time."""
        plan_id, created = uuid.uuid4().hex, utc_now()
        await self.keep(plan_id, created, kind, answer)
        head = json.dumps({"id": plan_id, "created": created})[:-1]
        return Response(content=head + "," + answer[1:], media_type="application/json")

    def check_key(self, key: str | None) -> None:
        """Validations are allowed: enabled on this server, the right X-API-Key, torch installed."""
        settings = self.settings
        if not settings.validation_enabled:
            raise HTTPException(403, "validation is disabled on this server (start it with BERTH_VALIDATION_ENABLED=1)")
        # compared as bytes: a header may carry any byte (Starlette decodes it as latin-1)
        given = key.encode("latin-1", "replace") if key else b""
        if not hmac.compare_digest(given, (settings.api_key or "").encode()):
            raise HTTPException(401, "a valid X-API-Key header is required for validations")
        if importlib.util.find_spec("torch") is None:
            raise HTTPException(
                403,
                "this server has no torch: run the executor image (docker build --build-arg WITH_TORCH=1) to validate",
            )

    def open_job(self) -> None:
        """Count one more validation queued or running; 429 beyond BERTH_MAX_QUEUED_VALIDATIONS."""
        limit = self.settings.max_queued_validations
        with self.jobs_lock:
            if self.open_jobs >= limit:
                raise busy(429, f"{self.open_jobs} validations queued or running (at most {limit}); retry later")
            self.open_jobs += 1

    def close_job(self) -> None:
        with self.jobs_lock:
            self.open_jobs -= 1

    def run_validation(self, job_id: str, chosen: Plan, req: ValidationRequest) -> None:
        """One validation job, in the validation thread: its state in the store from start to end."""
        from berth.executor.validate import validate, validate_proxy

        store = self.store
        try:
            store.update_job(job_id, "running")
            with tempfile.TemporaryDirectory(prefix="berth-validate-") as run_dir:  # removed afterwards
                self.run_dirs.add(run_dir)
                if req.proxy:
                    report = validate_proxy(
                        chosen, layers=req.layers, steps=req.steps, warmup=req.warmup, store=store, run_dir=run_dir
                    )
                else:
                    report = validate(chosen, steps=req.steps, warmup=req.warmup, store=store, run_dir=run_dir)
                self.run_dirs.discard(run_dir)
            store.update_job(
                job_id, "done" if report.status == "ok" else "failed", report_id=report.id, message=report.message
            )
        except BerthError as err:
            store.update_job(job_id, "failed", message=f"refused before launch: {err}")
        except Exception as err:  # the job must end in a state, whatever happened
            with contextlib.suppress(Exception):
                store.update_job(job_id, "failed", message=f"{type(err).__name__}: {err}")
        finally:
            self.close_job()


def get_service(request: Request) -> Service:
    """The app's Service (a FastAPI dependency: tests override it with app.dependency_overrides)."""
    return request.app.state.service
