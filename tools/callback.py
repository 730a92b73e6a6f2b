"""The provider's own report of an outcome: `POST /operations/{id}/callback`.

A system of record that answers a mutation with "accepted, I will tell you" (`pending`) later
POSTs a `CallbackReport` to the callback URL the executor gave it, signed with the shared
secret. The report names the idempotency key it is about; `sequence` increases per key.
"""

from __future__ import annotations

import hashlib
import hmac
from typing import Any, Literal

from pydantic import BaseModel, Field

SIGNATURE_HEADER = "X-Signature"


class CallbackReport(BaseModel):
    """What a provider POSTs to a callback URL when an asynchronous request completes."""

    idempotency_key: str
    status: Literal["committed", "failed", "pending"]
    # Per-key, increasing: lets the receiver ignore reports older than one it applied.
    sequence: int = Field(ge=0)
    result: dict[str, Any] | None = None  # the provider's record of what it did
    reference: str | None = None  # the provider's id for it (a booking id)
    error: str | None = None


def sign(secret: str | bytes, body: bytes) -> str:
    """The X-Signature header value for `body`: `sha256=<hex HMAC>`."""
    key = secret.encode() if isinstance(secret, str) else secret
    return "sha256=" + hmac.new(key, body, hashlib.sha256).hexdigest()


def verify(secret: str | bytes, body: bytes, header: str | None) -> bool:
    """Whether `header` is a valid signature of `body` (constant-time compare)."""
    if not header:
        return False
    # Bytes, not str: compare_digest raises TypeError for a non-ASCII str, and the header is
    # whatever the sender put there (a 500 instead of a clean 403).
    return hmac.compare_digest(
        sign(secret, body).encode(), header.strip().encode("utf-8", "surrogatepass")
    )
