"""The database as this process sees it: answering, or not since when.

Every loop that touches PostgreSQL (the call heartbeat, the operation and delivery sweeps, the
event writer, a job recording its provider's answer, the notification listeners, the job
queue's worker) reports a failure to reach it here instead of logging it where it happened. An
outage then logs one warning when the database stops answering and one when it answers again
(how long, how many failed tries), not a traceback per loop per interval that would page
someone for a blip. An error that is not about reaching the database (a constraint, a bug) is
not an outage: `failed` says so and the caller logs it as before.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import sqlalchemy.exc

log = logging.getLogger(__name__)


# SQLSTATEs of a server that went away or will not take connections (class 08: connection
# exceptions; 57P01-57P03: shut down by an administrator, crashed, cannot connect now).
_GONE_STATES = ("08", "57P01", "57P02", "57P03")


def is_connection_error(exc: BaseException) -> bool:
    """Whether `exc` says the database could not be reached (or the connection broke), as
    opposed to a statement it refused (a constraint, a timeout, a lock). Only the database
    drivers' own errors count: a provider's timeout or a refused socket elsewhere is not a
    database outage, and must be logged where it happened."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, sqlalchemy.exc.DBAPIError) and current.connection_invalidated:
            return True
        module = type(current).__module__
        if module.startswith("psycopg") and hasattr(current, "sqlstate"):
            # psycopg's own errors: a client-side failure (no SQLSTATE) on an operational
            # error is a broken or refused connection; a server's SQLSTATE says which.
            state = current.sqlstate
            if state is None:
                return type(current).__name__ in {"OperationalError", "InterfaceError"}
            return bool(state.startswith(_GONE_STATES))
        if module.startswith("psycopg_pool") and type(current).__name__ in {
            "PoolTimeout",
            "PoolClosed",
        }:
            return True
        current = current.__cause__ or current.__context__
    return False


class DatabaseHealth:
    """Whether the database answers, from every loop's reports; logs each change once."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self.down_since: float | None = None
        self.failures = 0  # failed tries in the current (or last) outage
        self.outages = 0  # outages this process has seen

    @property
    def down(self) -> bool:
        return self.down_since is not None

    def failed(self, where: str, exc: BaseException) -> bool:
        """A try to reach the database failed at `where`. False when `exc` is not about
        reaching it (the caller logs that itself); True when it is counted as an outage."""
        if not is_connection_error(exc):
            return False
        self.failures += 1
        if self.down_since is None:
            self.down_since = self._clock()
            self.outages += 1
            self.failures = 1
            log.warning(
                "database unreachable (%s: %s); every loop retries quietly until it answers",
                where,
                _short(exc),
            )
        return True

    def ok(self) -> None:
        """A try to reach the database succeeded."""
        if self.down_since is None:
            return
        lasted = self._clock() - self.down_since
        self.down_since = None
        log.warning(
            "database answering again after %.1f s (%d failed tries meanwhile)",
            lasted,
            self.failures,
        )


def _short(exc: BaseException) -> str:
    text = str(getattr(exc, "orig", None) or exc).strip().splitlines()
    return (text[0] if text else type(exc).__name__)[:200]


# The process's view; loops that are given no other report here.
DATABASE = DatabaseHealth()


# Libraries whose own warnings during an outage only repeat it (the pool's reconnects).
_LIBRARIES = ("psycopg", "procrastinate", "sqlalchemy")
# Their loggers that write such lines (a logger's filter sees what it logs itself).
_LIBRARY_LOGGERS = (
    "psycopg",
    "psycopg.pool",
    "procrastinate",
    "procrastinate.worker",
    "procrastinate.manager",
    "procrastinate.psycopg_connector",
    "sqlalchemy.pool",
)


class QuietOutageFilter(logging.Filter):
    """Takes a log record whose exception says the database is unreachable as an outage
    report (logged once, by `health`), and drops a library's own warnings while it lasts."""

    def __init__(self, health: DatabaseHealth = DATABASE) -> None:
        super().__init__()
        self._health = health

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if exc is not None and self._health.failed(f"{record.name}", exc):
            return False
        if self._health.down and exc is None and record.name.startswith(_LIBRARIES):
            return False
        return True


def quiet_library_outages(health: DatabaseHealth = DATABASE) -> None:
    """Put the outage filter on the libraries' own loggers (once), whatever handlers the
    process logs to: their reconnect warnings and tracebacks become `health`'s two lines."""
    for name in _LIBRARY_LOGGERS:
        logger = logging.getLogger(name)
        if not any(isinstance(f, QuietOutageFilter) for f in logger.filters):
            logger.addFilter(QuietOutageFilter(health))
