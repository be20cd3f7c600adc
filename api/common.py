"""The HTTP edge shared by every router of the berth service: the error bodies and their OpenAPI
descriptions, strict JSON parsing of request bodies (StrictRoute), the body-size limit
(BodyLimit) and the exception handlers that turn a BerthError into a 422 naming the field."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

import anyio
from fastapi import HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from fastapi.routing import APIRoute
from pydantic import ValidationError
from starlette.types import Message

from berth.planner.planning import json_text
from berth.specs.errors import BerthError, from_validation_error

ERROR = {"content": {"application/json": {"schema": {"type": "object", "properties": {"detail": {}}}}}}
COMMON_ERRORS: dict[int | str, dict[str, Any]] = {
    400: {"description": "the body is not JSON", **ERROR},
    413: {"description": "request body larger than BERTH_MAX_BODY_BYTES", **ERROR},
    415: {"description": "the body is not application/json", **ERROR},
    429: {"description": "every worker busy and the queue full; retry after Retry-After seconds", **ERROR},
    503: {"description": "over the time budget; retry later", **ERROR},
}
RETRY_AFTER_S = 1
OVER_LIMIT = "berth_over_limit"  # in a connection's ASGI state: it came over a connection limit (api/server.py)


def json_response(body: dict[str, Any], status: int = 200, headers: dict[str, str] | None = None) -> Response:
    """Answer built from already-validated specs: serialized once, without a second validation
    pass through the response model (which stays in the OpenAPI schema and is checked by the
    schemathesis test). Always valid JSON: a non-finite number is null."""
    return Response(content=json_text(body), status_code=status, media_type="application/json", headers=headers)


def unprocessable(err: BerthError) -> Response:
    """A BerthError in the same shape as FastAPI's own 422 body: loc names the field."""
    value = err.to_dict()["value"]
    if isinstance(value, str) and len(value) > 200:  # an echo never carries a whole oversized input
        value = value[:197] + "..."
    first, *rest = err.field.split(".")
    loc: list[str | int] = [first, *rest]
    if m := re.fullmatch(r"layout\[(\d+)\]", first):  # the CLI's --layout N is the request's layouts[N]
        loc = ["layouts", int(m[1]), *rest]
    item = {"loc": ["body", *loc], "msg": err.problem[:1000], "type": "value_error", "input": value}
    return json_response({"detail": [item]}, 422)


def busy(status: int, detail: str) -> HTTPException:
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
            return await json_response({"detail": f"content type {shown!r}: send application/json"}, 415)(
                scope, receive, send
            )
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
            return await closing(408, f"the body did not arrive within {self.timeout_s:g} s")(scope, receive, send)
        body, sent = b"".join(chunks), False

        async def replay() -> Message:
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        return await self.app(scope, replay, send)

    async def _too_big(self, scope, receive, send) -> None:
        return await closing(413, f"request body over {self.limit} bytes")(scope, receive, send)


class HeadLimit:
    """Pure ASGI middleware, outermost: a request on a connection that came over a connection
    limit (api/server.py) gets 503, a request head (request line and headers) over `max_bytes` 431
    and a Host outside `hosts` (when given) 400, all ending the connection. h11 refuses an
    incomplete head over the limit; a complete one that arrived in one read is counted here."""

    def __init__(self, app, max_bytes: int, hosts: frozenset[str] | None = None):
        self.app, self.max_bytes, self.hosts = app, max_bytes, hosts

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if (scope.get("state") or {}).get(OVER_LIMIT):
            refusal = closing(503, "every connection of this server is busy; retry", retry=True)
            return await refusal(scope, receive, send)
        headers = scope.get("headers") or []
        size = len(scope.get("raw_path") or b"") + len(scope.get("query_string") or b"") + 16
        size += sum(len(k) + len(v) + 4 for k, v in headers)
        if size > self.max_bytes:
            return await closing(431, f"request head of {size} bytes, over this server's {self.max_bytes}")(
                scope, receive, send
            )
        if self.hosts is not None:
            host = dict(headers).get(b"host", b"").decode("latin-1")
            name = host.rsplit(":", 1)[0] if not host.endswith("]") else host
            if name.strip("[]").lower() not in self.hosts:
                return await closing(400, f"host {host[:100]!r} is not served here (BERTH_ALLOWED_HOSTS)")(
                    scope, receive, send
                )
        return await self.app(scope, receive, send)


def closing(status: int, detail: str, retry: bool = False) -> Response:
    """An error answer after which the server closes the connection: it says so."""
    headers = {"Connection": "close", **({"Retry-After": str(RETRY_AFTER_S)} if retry else {})}
    return json_response({"detail": detail}, status, headers)


async def internal_error(_: Request, err: Exception) -> Response:
    """The last resort (no input should reach it): a 500 that says the connection ends, as it does."""
    return closing(500, f"internal error ({type(err).__name__}); the server log has the details")


async def berth_error(_: Request, err: BerthError) -> Response:
    return unprocessable(err)


async def spec_error(_: Request, err: ValidationError) -> Response:
    return unprocessable(from_validation_error(err))


async def request_error(_: Request, err: RequestValidationError) -> Response:
    detail = []
    for e in err.errors():
        item = {k: v for k, v in e.items() if k in ("loc", "msg", "type")}
        if e.get("type") == "json_invalid" and isinstance(e.get("ctx"), dict):
            item["msg"] = f"{e['msg']}: {e['ctx'].get('error')}"
        detail.append(item)
    return json_response({"detail": detail}, 422)
