"""Read deadlines and a per-source connection bound for uvicorn's HTTP protocol.

uvicorn only times out a keep-alive connection after a response: a connection that sends
nothing, half its headers or half its body stays open for ever (finding 4 of issue 13).
`guarded_protocol` subclasses the HTTP protocol uvicorn would use and adds, per connection:

- a header deadline: a request's headers must be in within `header_timeout_s` of the
  connection opening or of the previous response;
- a body deadline: its body within `body_timeout_s` of its headers being complete (a request
  that stops mid-body gets 408 and the connection closes);
- a bound on the bytes sent before a request's headers are complete;
- a bound on open connections per source address (more are closed at once).

The application's own work is not timed: once a request is fully read the clock stops until
its response is complete. A WebSocket upgrade leaves the guard (media streams have their
own idle watchdog and a bound of their own on sockets waiting for `start`), so Twilio's
many streams from few addresses are not counted. A response that holds its connection for
long under caps of its own (a console event stream) leaves the per-source count too, until
it ends (`leave_source_count`): held streams cannot lock their address out.
"""

from __future__ import annotations

import asyncio
import logging
import time
import weakref
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)

# The key, in an HTTP scope's extensions, of the hook `leave_source_count` calls.
GUARD_EXTENSION = "voice-agent.http-guard"
_TIMED_OUT = (
    b"HTTP/1.1 408 Request Timeout\r\ncontent-type: text/plain; charset=utf-8\r\n"
    b"content-length: 15\r\nconnection: close\r\n\r\nRequest Timeout"
)


class _CycleTransport:
    """The transport as one request's cycle sees it: its `close` goes through the guard,
    which lingers when the request's body is still coming (see `_guard_close`).

    The cycle holds this as its transport, so the guard and the cycle are held weakly here:
    strongly, they would make a reference cycle (protocol -> cycle -> this -> protocol) that
    only a full collection frees, once per request. Without either, it closes at once."""

    __slots__ = ("_close", "_cycle", "_transport")

    def __init__(self, transport: asyncio.Transport, close: Any, cycle: Any) -> None:
        self._transport = transport
        self._close = weakref.WeakMethod(close)
        self._cycle = weakref.ref(cycle)

    def close(self) -> None:
        close, cycle = self._close(), self._cycle()
        if close is None or cycle is None:
            self._transport.close()
        else:
            close(cycle)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


def leave_source_count(scope: Any) -> None:
    """The connection of this request stops counting against its source address until its
    response is complete (for a long-held response bounded by caps of its own)."""
    ref = scope.get("extensions", {}).get(GUARD_EXTENSION)
    hook = ref() if ref is not None else None  # a weak reference to the guard's method
    if hook is not None:
        hook()


@dataclass(frozen=True, slots=True)
class HttpLimits:
    """What one connection may take before it is closed."""

    header_timeout_s: float = 10.0
    body_timeout_s: float = 10.0
    max_connections_per_source: int = 256
    # Bytes a connection may send while its request's headers are not complete.
    max_header_bytes: int = 256 * 1024
    # A response sent before its request's body was read (a 413, a refused webhook) closes the
    # connection; the client, still sending, would get a reset and lose the answer in its
    # buffers. So the connection is half-closed, and what the client sends is read and dropped
    # (never parsed or kept) until it stops for `linger_idle_s`, for at most `body_timeout_s`
    # and `linger_bytes` in all, as nginx's lingering close does.
    linger_idle_s: float = 2.0
    linger_bytes: int = 128 * 1024 * 1024


class _Counters:
    """Open guarded connections per source and refusals, per server (not per process)."""

    def __init__(self) -> None:
        self.open: defaultdict[str, int] = defaultdict(int)
        self.timed_out = 0
        self.refused = 0
        self._last_log = 0.0

    def note(self, message: str, *args: Any) -> None:
        # Rate-limited: a flood of slow connections must not become a flood of log lines.
        now = time.monotonic()
        if now - self._last_log >= 10.0:
            self._last_log = now
            log.warning(
                message + " (so far: %d timed out, %d refused)",
                *args,
                self.timed_out,
                self.refused,
            )


def guarded_protocol(base: type[asyncio.Protocol], limits: HttpLimits) -> type[asyncio.Protocol]:
    """`base` (uvicorn's h11 or httptools protocol) with read deadlines and the source bound."""
    counters = _Counters()

    class GuardedHttpProtocol(base):  # type: ignore[valid-type,misc]
        guard_counters = counters

        def connection_made(self, transport: asyncio.Transport) -> None:
            super().connection_made(transport)
            self._guard_timer: asyncio.TimerHandle | None = None
            self._guard_body_phase = False
            self._guard_header_bytes = 0
            self._guard_exempt: str | None = None  # the source of a connection not counted
            self._guard_linger: int | None = None  # bytes still to drop while lingering
            self._guard_linger_until = 0.0
            client = self.client
            self._guard_source: str | None = client[0] if client else None
            if self._guard_source is not None:
                counters.open[self._guard_source] += 1
                if counters.open[self._guard_source] > limits.max_connections_per_source:
                    counters.refused += 1
                    counters.note(
                        "too many connections from one source (limit %d)",
                        limits.max_connections_per_source,
                    )
                    transport.abort()
                    return
            self._guard_arm(limits.header_timeout_s)

        def connection_lost(self, exc: Exception | None) -> None:
            self._guard_release()
            super().connection_lost(exc)

        def _guard_release(self) -> None:
            timer = getattr(self, "_guard_timer", None)
            if timer is not None:
                timer.cancel()
                self._guard_timer = None
            self._guard_exempt = None
            self._guard_release_source()

        def _guard_release_source(self) -> None:
            source = getattr(self, "_guard_source", None)
            if source is not None:
                self._guard_source = None
                left = counters.open[source] - 1
                if left > 0:
                    counters.open[source] = left
                else:
                    counters.open.pop(source, None)

        def _guard_arm(self, delay: float) -> None:
            if self._guard_timer is not None:
                self._guard_timer.cancel()
            self._guard_timer = self.loop.call_later(delay, self._guard_check)

        def _guard_check(self) -> None:
            self._guard_timer = None
            transport = self.transport
            if transport.is_closing() or transport.get_protocol() is not self:
                return
            if self._guard_linger is not None:
                transport.close()  # the linger is over
                return
            cycle = self.cycle
            if self._guard_body_phase:
                if cycle is not None and not cycle.response_complete and cycle.more_body:
                    self._guard_expire("body")
                    return
                # Read in time: the application is working; the clock restarts at the response.
                self._guard_body_phase = False
                return
            if cycle is None or cycle.response_complete:
                # Includes a request whose headers never completed: no cycle exists yet.
                self._guard_expire("headers")
                return
            if cycle.more_body:
                # A pipelined request, whose headers came while the one before was answered.
                self._guard_body_phase = True
                self._guard_arm(limits.body_timeout_s)

        def _guard_new_request(self, cycle: Any) -> None:
            """A request's headers are in (its app has not run yet): it gets the hook of
            `leave_source_count`, and closes through the guard."""
            scope = cycle.scope
            # Weakly: the scope is the cycle's, which the protocol holds (see _CycleTransport).
            hook = weakref.WeakMethod(self._guard_leave_count)
            scope.setdefault("extensions", {})[GUARD_EXTENSION] = hook
            cycle.transport = _CycleTransport(self.transport, self._guard_close, cycle)

        def _guard_headers_complete(self, cycle: Any) -> None:
            """The request now served has its headers in: its body (if any) has
            `body_timeout_s` from now."""
            if cycle.more_body:
                self._guard_body_phase = True
                self._guard_arm(limits.body_timeout_s)
            elif self._guard_timer is not None:
                # Fully read: the application's work is not timed.
                self._guard_timer.cancel()
                self._guard_timer = None

        def _guard_expire(self, what: str) -> None:
            counters.timed_out += 1
            counters.note("closed a connection whose request %s did not arrive in time", what)
            cycle = self.cycle
            if what == "body" and cycle is not None and not cycle.response_started:
                # The application waits for the rest of the body and, once the connection is
                # lost, gets a disconnect (logged as such, no traceback); the client is told.
                self.transport.write(_TIMED_OUT)
            self.transport.close()

        def _guard_close(self, cycle: Any) -> None:
            """The cycle closes the connection after its response: at once, or, when the
            request's body is still coming, after a linger that lets the client read it."""
            transport = self.transport
            if transport.is_closing() or self._guard_linger is not None:
                return
            if not (cycle.response_complete and cycle.more_body) or not transport.can_write_eof():
                transport.close()
                return
            transport.write_eof()
            self._guard_linger = limits.linger_bytes
            self._guard_linger_until = self.loop.time() + limits.body_timeout_s
            self._guard_arm(limits.linger_idle_s)
            self.flow.resume_reading()  # what comes is dropped (data_received)

        def _guard_leave_count(self) -> None:
            source = self._guard_source
            if source is None:
                return
            self._guard_release_source()
            self._guard_exempt = source

        def data_received(self, data: bytes) -> None:
            if self._guard_linger is not None:
                # Answered and half-closed: the rest of the body is dropped, never parsed.
                self._guard_linger -= len(data)
                left = self._guard_linger_until - self.loop.time()
                if self._guard_linger < 0 or left <= 0:
                    self.transport.close()
                else:
                    self._guard_arm(min(limits.linger_idle_s, left))
                return
            before = self.cycle
            super().data_received(data)
            if self.transport.is_closing() or self.transport.get_protocol() is not self:
                return  # closed, or upgraded to a WebSocket
            cycle = self.cycle
            if cycle is not None and cycle is not before and not cycle.response_complete:
                self._guard_new_request(cycle)
                if before is None or before.response_complete:
                    # The headers of the request now being served completed in this read. (A
                    # pipelined one waits; its clock starts when the one before is answered.)
                    self._guard_headers_complete(cycle)
            # Still waiting for a request's headers after this read (not the rest of a body
            # answered early, as a 413 is): a header block has a size, not only a time.
            waiting = cycle is None or (
                cycle is before and cycle.response_complete and not cycle.more_body
            )
            if not waiting:
                self._guard_header_bytes = 0
                return
            self._guard_header_bytes += len(data)
            if self._guard_header_bytes > limits.max_header_bytes:
                counters.timed_out += 1
                counters.note("closed a connection whose request headers were too large")
                self.transport.close()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            exempt = self._guard_exempt
            if exempt is not None and not self.transport.is_closing():
                # The long response is over: the connection counts against its source again.
                self._guard_exempt = None
                self._guard_source = exempt
                counters.open[exempt] += 1
            if not self.transport.is_closing() and self._guard_linger is None:
                self._guard_body_phase = False
                self._guard_header_bytes = 0
                self._guard_arm(limits.header_timeout_s)

        def handle_websocket_upgrade(self, *args: Any) -> None:
            super().handle_websocket_upgrade(*args)
            if self.transport.get_protocol() is not self:
                self._guard_release()
                # The WebSocket protocol has the connection now, and this one never hears of
                # its end: its parser (which holds its methods) goes as at a connection's end,
                # or the two stay in a reference cycle that only a full collection frees.
                if getattr(self, "parser", None) is not None:
                    self.parser = None

    return GuardedHttpProtocol


def base_protocol(choice: str) -> type[asyncio.Protocol]:
    """The protocol class uvicorn's `http` setting names ("auto" as uvicorn resolves it)."""
    if choice in ("auto", "httptools"):
        try:
            from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

            return HttpToolsProtocol
        except ImportError:
            if choice == "httptools":
                raise
    from uvicorn.protocols.http.h11_impl import H11Protocol

    return H11Protocol
