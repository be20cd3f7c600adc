"""`berth serve`: uvicorn with every connection bounded (settings in api/settings.py).

- timeout_keep_alive: an idle keep-alive connection is closed after BERTH_TIMEOUT_KEEP_ALIVE_S;
- a request's head must arrive within BERTH_HEADER_TIMEOUT_S of the connection opening (or of the
  previous response): slow-header connections are closed (uvicorn has no such timeout itself);
- limit_concurrency: beyond BERTH_LIMIT_CONCURRENCY connections and tasks uvicorn answers 503;
- h11_max_incomplete_event_size: a request head over BERTH_MAX_HEADER_BYTES is refused.
"""

from __future__ import annotations

import asyncio

import h11
from pydantic import ValidationError
from uvicorn.protocols.http.h11_impl import H11Protocol

from berth.api.settings import Settings
from berth.planner.errors import BerthError


def header_timeout_protocol(timeout_s: float) -> type[H11Protocol]:
    """uvicorn's h11 protocol, closing a connection whose request head is not complete within
    `timeout_s`."""

    class HeaderTimeoutProtocol(H11Protocol):
        _head_timer: asyncio.TimerHandle | None = None

        def _arm(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
            self._head_timer = self.loop.call_later(timeout_s, self._head_late)

        def _head_late(self) -> None:
            self._head_timer = None
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                self.transport.close()  # no complete request head in time

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._arm()

        def connection_lost(self, exc: Exception | None) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
            super().connection_lost(exc)

    return HeaderTimeoutProtocol


def settings_or_error() -> Settings:
    """The settings, or a BerthError naming what is wrong (the CLI prints one line, exit 2)."""
    try:
        return Settings()
    except ValidationError as err:
        first = err.errors()[0]
        field = "BERTH_" + "_".join(str(x) for x in first.get("loc", ())).upper() if first.get("loc") else "BERTH_*"
        raise BerthError(
            field.rstrip("_"),
            first.get("input") if first.get("loc") else None,
            first.get("msg", "invalid").removeprefix("Value error, "),
        ) from None


def serve(host: str, port: int, workers: int) -> None:
    import uvicorn

    settings = settings_or_error()
    uvicorn.run(
        "berth.api.app:create_app",
        factory=True,
        host=host,
        port=port,
        workers=workers,
        log_level="info",
        http=header_timeout_protocol(settings.header_timeout_s),
        timeout_keep_alive=max(1, round(settings.timeout_keep_alive_s)),
        limit_concurrency=settings.limit_concurrency,
        h11_max_incomplete_event_size=settings.max_header_bytes,
    )
