"""Logging setup with redaction: secrets never reach logs, phone numbers are masked."""

from __future__ import annotations

import json
import logging
import re
from datetime import UTC, datetime
from typing import Any

from tools import log_context
from tools.outage import QuietOutageFilter

# E.164 numbers (+ and 7-15 digits, maybe spaced) and bare runs of 10-15 digits; dates,
# times and ids with fewer digits are left readable.
# Over-long runs are masked whole: a 104-digit `To` must not leave 85 digits in clear.
_PHONE = re.compile(r"\+\d[\d\-\s]{5,}\d|(?<![\w-])\d{10,}(?![\w-])")
_SECRET = re.compile(
    r"(?i)(authorization|auth_token|api_key|password|secret|token|signature)"
    r"([\"']?\s*[:=]\s*[\"']?)([^\s\"'&,]+)"
)
_BEARER = re.compile(r"(?i)bearer\s+[A-Za-z0-9._\-]+")


def redact(text: str) -> str:
    """Mask phone numbers and anything that looks like a credential."""
    text = _BEARER.sub("Bearer [redacted]", text)
    text = _SECRET.sub(lambda m: f"{m.group(1)}{m.group(2)}[redacted]", text)
    return _PHONE.sub(lambda m: "[phone …" + re.sub(r"\D", "", m.group(0))[-2:] + "]", text)


class RedactingFilter(logging.Filter):
    """Rewrites every record's message through `redact`."""

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:
            return True
        record.msg = redact(message)
        record.args = None
        return True


class RedactingFormatter(logging.Formatter):
    """Redacts the whole formatted record: the message, the traceback (`exc_text`), the stack
    and whatever an exception carries in its text (a database error's bound parameters).

    A filter sees the record before the traceback is formatted, so it cannot do this.
    """

    def format(self, record: logging.LogRecord) -> str:
        try:
            text = super().format(record)
        except Exception:
            text = f"{record.levelname} {record.name}: (unformattable record {record.msg!r})"
        # The cached traceback is raw: a second handler formatting this record must not
        # pick it up unredacted.
        record.exc_text = None
        return redact(text)

    def formatException(self, ei: Any) -> str:
        return redact(super().formatException(ei))


class RateLimitedLog:
    """At most one line per `every_s` for a flood of the same event (the rest are counted)."""

    def __init__(self, logger: logging.Logger, every_s: float = 10.0) -> None:
        self._log = logger
        self._every_s = every_s
        self._last = -every_s
        self.count = 0
        self._suppressed = 0

    def warning(self, message: str, *args: object) -> None:
        import time

        self.count += 1
        now = time.monotonic()
        if now - self._last < self._every_s:
            self._suppressed += 1
            return
        self._last = now
        suppressed, self._suppressed = self._suppressed, 0
        if suppressed:
            message += " (and %d more like it since the last such line)"
            args = (*args, suppressed)
        self._log.warning(message, *args)


LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"

# Libraries whose INFO lines say nothing an operator needs (alembic lists its plugins,
# procrastinate says it registers our task blueprints when tools are first imported).
_QUIET = ("alembic.runtime.plugins", "procrastinate.blueprints")


class JsonFormatter(RedactingFormatter):
    """`LOG_FORMAT=json`: one JSON object a line, redacted as the text format is, with the
    ids the line is about (`call_id`, `operation_id`) and the trace it belongs to (`trace_id`,
    `span_id`) when there is one."""

    def format(self, record: logging.LogRecord) -> str:
        try:
            message = record.getMessage()
        except Exception:
            message = f"(unformattable record {record.msg!r})"
        out: dict[str, Any] = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": redact(message),
        }
        for name, var in (
            ("call_id", log_context.call_id),
            ("operation_id", log_context.operation_id),
        ):
            value = getattr(record, name, None) or var.get()
            if value:
                out[name] = str(value)
        out.update(_trace_ids())
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
            record.exc_text = None
        if record.stack_info:
            out["stack"] = redact(self.formatStack(record.stack_info))
        return json.dumps(out, ensure_ascii=False, default=str)


def _trace_ids() -> dict[str, str]:
    """The current span's ids (W3C hex), if OpenTelemetry is recording one."""
    try:
        from opentelemetry import trace
    except ImportError:  # pragma: no cover - the API ships with the SDK we depend on
        return {}
    context = trace.get_current_span().get_span_context()
    if not context.is_valid:
        return {}
    return {"trace_id": f"{context.trace_id:032x}", "span_id": f"{context.span_id:016x}"}


def configure_logging(level: str = "INFO", fmt: str = "text") -> None:
    """Root logging to stderr with redaction on every handler (`fmt`: text or json)."""
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter() if fmt == "json" else RedactingFormatter(LOG_FORMAT))
    handler.addFilter(RedactingFilter())
    # A database outage is logged once when it starts and once when it ends (tools.outage),
    # not as a traceback or a warning from every library loop that noticed it.
    handler.addFilter(QuietOutageFilter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    for name in _QUIET:
        logging.getLogger(name).setLevel(max(logging.WARNING, root.level))
    # uvicorn's own loggers ("Exception in ASGI application" and its traceback) go through
    # the same handler, whatever configured them before.
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access", "uvicorn.asgi"):
        logger = logging.getLogger(name)
        logger.handlers[:] = []
        logger.propagate = True
