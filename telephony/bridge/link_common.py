"""What the model links share, whichever API is on the line (Realtime, GPT-Live): opening a
session within the reconnect budget (backoff, a refusal that retrying cannot help), each client
event bounded by the send timeout (a dead or stuck socket is closed so the reader reconnects),
closing a socket we give up on, and the server's `error` on the call's timeline.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import Any, Protocol, TypeVar

from websockets.exceptions import ConnectionClosed

from telephony.bridge.port import Port
from telephony.call_events import CallEventKind
from telephony.errors import TelephonyError
from telephony.session_config import BridgeConfig
from telephony.watchdog import Watchdog

log = logging.getLogger(__name__)

FIRST_DELAY_S = 0.1
MAX_DELAY_S = 2.0


class Closable(Protocol):
    async def close(self) -> None: ...


C = TypeVar("C", bound=Closable)
T = TypeVar("T")


class SessionRefused(TelephonyError):
    """The server refused the session (its configuration, or the call is gone): retrying
    within the budget cannot help. `call_over`: the call itself ended on the server's side."""

    call_over = False


async def close_quietly(conn: Closable) -> None:
    """Close a socket we are giving up on, within a second, whatever state it is in."""
    with contextlib.suppress(Exception):
        async with asyncio.timeout(1.0):
            await conn.close()


async def bounded_send(
    send: Awaitable[None],
    conn: Closable,
    *,
    call_id: str,
    api: str,
    timeout_s: float,
    watch: Watchdog | None = None,
) -> bool:
    """Run one send, bounded by `watch` (the audio path's one timer) or by `timeout_s`; a
    dead or stuck socket is closed so the reader reconnects. False: it did not go."""
    try:
        if watch is not None:
            with watch:
                await send
        else:
            async with asyncio.timeout(timeout_s):
                await send
    except (ConnectionClosed, TimeoutError, OSError) as exc:
        log.info("call %s: send to %s failed: %r", call_id, api, exc)
        await close_quietly(conn)
        return False
    except Exception as exc:  # the SDK wraps some socket errors in its own
        log.info("call %s: send to %s failed: %r", call_id, api, exc)
        return False
    return True


async def open_within_budget(
    config: BridgeConfig,
    call_id: str,
    api: str,
    dial: Callable[[], Awaitable[C]],
    start: Callable[[C], Awaitable[T]],
) -> tuple[tuple[C, T] | None, int, str | None, SessionRefused | None]:
    """Dial and start a session, retrying with backoff until the reconnect budget is spent:
    ((socket, what `start` returned) or None, attempts, the last error, the refusal that
    stopped the retries). A socket that is not handed back is closed, on cancellation too."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + config.reconnect_budget_s
    delay = FIRST_DELAY_S
    attempts = 0
    error: str | None = None
    while True:
        remaining = deadline - loop.time()
        if remaining <= 0:
            return None, attempts, error, None
        attempts += 1
        conn: C | None = None
        try:
            async with asyncio.timeout(min(config.connect_timeout_s, remaining)):
                conn = await dial()
                started = await start(conn)
        except asyncio.CancelledError:
            # The call ended while the session was being set up: the socket is nobody's yet.
            if conn is not None:
                await close_quietly(conn)
            raise
        except SessionRefused as exc:
            drop_tracebacks(exc)
            if conn is not None:
                await close_quietly(conn)
            return None, attempts, str(exc), exc
        except Exception as exc:
            drop_tracebacks(exc)
            error = f"{type(exc).__name__}: {exc}"[:200]
            log.info("call %s: %s connect attempt %d failed: %s", call_id, api, attempts, error)
            if conn is not None:
                await close_quietly(conn)
        else:
            return (conn, started), attempts, None, None
        await asyncio.sleep(max(0.0, min(delay, deadline - loop.time())))
        delay = min(delay * 2, MAX_DELAY_S)


def drop_tracebacks(exc: BaseException) -> None:
    """A failed attempt is told by its type and message: its traceback and its causes' go.
    websockets keeps a refused handshake's error in reference cycles (on its protocol, on the
    response it refused, in a local of its connect's frame); through the traceback's frames
    they would hold this link, and the call, until a full collection."""
    pending: list[BaseException | None] = [exc]
    seen: set[int] = set()
    while pending:
        error = pending.pop()
        if error is None or id(error) in seen:
            continue
        seen.add(id(error))
        error.__traceback__ = None
        pending += (error.__cause__, error.__context__)


def emit_server_error(port: Port, error: Any, client_event_id: str | None) -> None:
    """The server's `error` event on the call's timeline."""
    port.emit(
        CallEventKind.REALTIME_ERROR,
        code=error.code,
        type=error.type,
        message=error.message[:200],
        param=error.param,
        event_id=client_event_id,
    )
