"""Logging setup with redaction: secrets never reach logs, phone numbers are masked."""

from __future__ import annotations

import logging
import re

# E.164 numbers (+ and 7-15 digits, maybe spaced) and bare runs of 10-15 digits; dates,
# times and ids with fewer digits are left readable.
_PHONE = re.compile(r"\+\d[\d\-\s]{5,17}\d|(?<![\w-])\d{10,15}(?![\w-])")
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


# Libraries whose INFO lines say nothing an operator needs (alembic lists its plugins).
_QUIET = ("alembic.runtime.plugins",)


def configure_logging(level: str = "INFO") -> None:
    """Root logging to stderr with redaction on every handler."""
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    handler.addFilter(RedactingFilter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    for name in _QUIET:
        logging.getLogger(name).setLevel(max(logging.WARNING, root.level))
