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

Layout: this module only assembles the app. `service.py` holds the state (`Service`: settings,
store, pools, writer, validation jobs) and the `get_service` dependency every route takes (tests
override it: tests/test_api_inprocess.py); `common.py` the HTTP edge (error bodies, strict JSON,
body limit, exception handlers); one router per resource: `routes_service.py` (/healthz),
`routes_plans.py` (/v1/plans, /v1/compare, /v1/launch), `routes_catalog.py` (/v1/models,
/v1/clusters, /v1/hardware-profiles) and `routes_validations.py` (/v1/validations).
"""

from __future__ import annotations

import contextlib
import multiprocessing
import signal
import sys
from collections.abc import AsyncIterator

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError

from berth.api import routes_catalog, routes_plans, routes_service, routes_validations
from berth.api.common import BodyLimit, HeadLimit, StrictRoute, berth_error, internal_error, request_error, spec_error
from berth.api.service import SWITCH_INTERVAL_S, Service, build_cluster, die_with_parent, get_service
from berth.api.settings import Settings
from berth.hardware_profiles import server_names
from berth.specs import __version__
from berth.specs.errors import BerthError


def create_app(settings: Settings | None = None) -> FastAPI:
    """The app: one Service (store, pools, writer) on app.state.service, handed to the routes by
    the `get_service` dependency, and the routers by resource (api/routes_*.py)."""
    settings = settings or Settings()
    if multiprocessing.parent_process() is not None:  # a worker of `berth serve --workers N`
        die_with_parent(signal.SIGTERM)  # ends (and stops its children) when the supervisor dies, kill -9 too
    service = Service(settings)
    server_names()  # the catalog, read once at startup (the names are also the schema's enum)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        sys.setswitchinterval(SWITCH_INTERVAL_S)
        yield
        service.close()

    app = FastAPI(
        title="berth",
        version=__version__,
        lifespan=lifespan,
        description="Parallelism-layout planner for training large transformers.",
    )
    app.router.route_class = StrictRoute
    app.state.settings, app.state.store, app.state.service = settings, service.store, service
    app.add_middleware(BodyLimit, limit=settings.max_body_bytes, timeout_s=settings.header_timeout_s)
    app.add_middleware(HeadLimit, max_bytes=settings.max_header_bytes, hosts=settings.hosts())  # outermost
    # Starlette types a handler as taking any Exception; each of these takes the class it is registered for
    app.add_exception_handler(BerthError, berth_error)  # type: ignore[arg-type]
    app.add_exception_handler(ValidationError, spec_error)  # type: ignore[arg-type]
    app.add_exception_handler(RequestValidationError, request_error)  # type: ignore[arg-type]
    app.add_exception_handler(Exception, internal_error)  # a 500 that says `Connection: close`
    for module in (routes_service, routes_plans, routes_catalog, routes_validations):
        app.include_router(module.router)
    return app


__all__ = ["Service", "build_cluster", "create_app", "get_service"]
