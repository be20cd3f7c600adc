"""`berth serve`: uvicorn with every connection bounded (settings in api/settings.py).

Connections (BoundedProtocol, one place for each rule):
- at most BERTH_LIMIT_CONCURRENCY connections in all and BERTH_MAX_CONNECTIONS_PER_CLIENT from one
  address. A connection that would go over either limit takes the slot of the connection that has
  been *reading* longest (idle keep-alive, a request head or body still arriving) from the same
  address, or, for the total, from anyone (a new connection that has sent nothing yet keeps its
  slot for EVICTABLE_AFTER_S). When there is none, the new connection's request is answered 503
  with `Connection: close` and `Retry-After`. Sockets that send half a request therefore cannot shut
  anyone out: the next real request takes one of their slots.
- a request's head must arrive within BERTH_HEADER_TIMEOUT_S of the connection opening (or of the
  previous response), else the connection is closed (uvicorn has no such timeout itself); the body
  has the same deadline (api/common.py BodyLimit);
- an answer the client does not read within BERTH_WRITE_TIMEOUT_S (the socket's send buffer stays
  full) is dropped with its connection: an unread answer pins no memory;
- idle keep-alive connections are closed after BERTH_TIMEOUT_KEEP_ALIVE_S;
- a request head over BERTH_MAX_HEADER_BYTES is refused 431: h11 refuses one still incomplete at that size
  (BoundedProtocol.send_400_response), api/common.py HeadLimit one that arrived complete.

Several worker processes (`--workers N`) serve one SQLite store: the protocol class is importable
(each worker process loads it), and each worker reads the same BERTH_* settings.
"""

from __future__ import annotations

import asyncio
import functools
from typing import Any

import h11
from pydantic import ValidationError
from uvicorn.protocols.http.h11_impl import H11Protocol

from berth.api.common import OVER_LIMIT
from berth.api.settings import Settings
from berth.specs.errors import BerthError

# A new connection from which the server has read nothing yet keeps its slot this long (its head may
# be waiting in the socket while the server accepts others: a burst of connections). One that has
# sent part of a request, or is idle after an answer, may give its slot at once. A connection over a
# limit with no slot to take is answered 503 with `Connection: close` once its head arrives.
EVICTABLE_AFTER_S = 1.0


@functools.cache
def limits() -> Settings:
    """The settings of this process (each uvicorn worker reads the same environment)."""
    return settings_or_error()


class BoundedProtocol(H11Protocol):
    """uvicorn's h11 protocol with the connection limits of this module's docstring."""

    _head_timer: asyncio.TimerHandle | None = None
    _write_timer: asyncio.TimerHandle | None = None
    _since = 0.0  # when this connection started waiting for (or reading) its current request
    _evicted = False
    _over = False  # came over a connection limit: holds no slot, its request is answered 503
    _served = False  # has answered a request (now idle keep-alive, or reading the next one)
    _received = 0  # bytes received since the connection opened or its last answer

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.settings = limits()

    # -- reading: the head deadline and the connection slots --------------------------------

    def _arm(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
        self._since, self._received = self.loop.time(), 0
        self._head_timer = self.loop.call_later(self.settings.header_timeout_s, self._head_late)

    def _head_late(self) -> None:
        self._head_timer = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self.transport.close()  # no complete request head in time

    def reading(self, now: float) -> bool:
        """Its slot may be taken: not answering, and either idle after an answer, or part of a
        request in (a head or a body still arriving), or nothing at all for EVICTABLE_AFTER_S
        (a new connection whose head the server has not read yet keeps its slot)."""
        state = self.conn.their_state
        if self._evicted or self.conn.our_state is h11.SEND_BODY or state not in (h11.IDLE, h11.SEND_BODY):
            return False
        return state is h11.SEND_BODY or self._received > 0 or self._served or now - self._since >= EVICTABLE_AFTER_S

    def data_received(self, data: bytes) -> None:
        self._received += len(data)
        super().data_received(data)

    def send_400_response(self, msg: str) -> None:
        """uvicorn answers 400 to every request h11 refuses. One refused because its head outgrew
        h11_max_incomplete_event_size before it was complete (h11's "Receive buffer too long", hint 431) is
        answered 431 like a complete one (api/common.py HeadLimit): which of the two sees an oversized head
        depends only on how its bytes were split into reads."""
        if len(self.conn.trailing_data[0]) <= self.settings.max_header_bytes:
            return super().send_400_response(msg)
        headers = [(b"content-type", b"text/plain; charset=utf-8"), (b"connection", b"close")]
        detail = f"request head over this server's {self.settings.max_header_bytes} bytes".encode()
        for event in (h11.Response(status_code=431, headers=headers), h11.Data(data=detail), h11.EndOfMessage()):
            self.transport.write(self.conn.send(event))
        self.transport.close()

    def _make_room(self) -> bool:
        """Keep the connection limits with this connection counted: close the longest-reading
        connection of the same client over the per-client limit, of anyone over the total.
        False when there is nothing to close (every other connection is answering or has only
        just opened). A connection that came over a limit holds no slot."""
        now = self.loop.time()
        holders = [c for c in self.connections if isinstance(c, BoundedProtocol) and not c._evicted and not c._over]
        host = self.client[0] if self.client else None
        mine = [c for c in holders if (c.client[0] if c.client else None) == host]
        limits = ((mine, self.settings.max_connections_per_client), (holders, self.settings.limit_concurrency))
        for pool, limit in limits:
            if len(pool) <= limit:
                continue
            victims = [c for c in pool if c is not self and c.reading(now)]
            if not victims:
                return False
            victim = min(victims, key=lambda c: c._since)
            victim._evict()
            holders.remove(victim)
        return True

    def _evict(self) -> None:
        self._evicted = True
        self.transport.close()

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._arm()
        if not self._make_room():  # its request is answered 503 (api/common.py HeadLimit), then it closes
            self._over = True
            self.app_state = {**self.app_state, OVER_LIMIT: True}
            over = [c for c in self.connections if isinstance(c, BoundedProtocol) and c._over and not c._evicted]
            if len(over) > self.settings.limit_concurrency:  # those waiting for their 503 are bounded too
                min((c for c in over if c is not self), key=lambda c: c._since)._evict()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._served = True
        self._arm()

    # -- writing: an answer the client does not read is dropped ------------------------------

    def pause_writing(self) -> None:
        super().pause_writing()
        if self._write_timer is None:
            self._write_timer = self.loop.call_later(self.settings.write_timeout_s, self._write_late)

    def resume_writing(self) -> None:
        super().resume_writing()
        if self._write_timer is not None:
            self._write_timer.cancel()
            self._write_timer = None

    def _write_late(self) -> None:
        self._write_timer = None
        self.transport.abort()  # the unread answer's buffer is freed with the connection

    def connection_lost(self, exc: Exception | None) -> None:
        for timer in (self._head_timer, self._write_timer):
            if timer is not None:
                timer.cancel()
        self._head_timer = self._write_timer = None
        super().connection_lost(exc)


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
        http=BoundedProtocol,
        timeout_keep_alive=max(1, round(settings.timeout_keep_alive_s)),
        # BoundedProtocol keeps the connections within limit_concurrency; uvicorn's own check (503 once
        # that many connections exist, idle ones included) only backs it up
        limit_concurrency=2 * settings.limit_concurrency,
        h11_max_incomplete_event_size=settings.max_header_bytes,
    )
