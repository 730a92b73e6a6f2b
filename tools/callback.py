"""The provider's own report of an outcome: `POST /operations/{id}/callback`.

A system of record that answers a mutation with "accepted, I will tell you" (`pending`) later
POSTs a `CallbackReport` to the callback URL the executor gave it, signed with the shared
secret. The report names the idempotency key it is about; `sequence` increases per key.

Signed the Standard Webhooks way, as our own outbound webhooks (`tools.webhooks`) and
OpenAI's are: `webhook-id`, `webhook-timestamp` and `webhook-signature: v1,<base64
HMAC-SHA256 of "id.timestamp.body">`, refused outside a 300 s tolerance. The id is the
same on every retry of one report, so a replay is recognised by it. The old `X-Signature`
(body only: no timestamp, no id) is accepted only while
`SOR_CALLBACK_ACCEPT_LEGACY_SIGNATURE` is set, for a deprecation period.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import time
from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, Field

# Deprecated: the body-only signature header.
SIGNATURE_HEADER = "X-Signature"
ID_HEADER = "webhook-id"
TIMESTAMP_HEADER = "webhook-timestamp"
STANDARD_SIGNATURE_HEADER = "webhook-signature"
TOLERANCE_S = 300
_WHSEC = "whsec_"


class CallbackReport(BaseModel):
    """What a provider POSTs to a callback URL when an asynchronous request completes."""

    idempotency_key: str
    status: Literal["committed", "failed", "pending"]
    # Per-key, increasing: lets the receiver ignore reports older than one it applied.
    sequence: int = Field(ge=0)
    result: dict[str, Any] | None = None  # the provider's record of what it did
    reference: str | None = None  # the provider's id for it (a booking id)
    error: str | None = None

    def message_id(self) -> str:
        """A `webhook-id` for this report: the same on every retry of it."""
        digest = hashlib.sha256(f"{self.idempotency_key}|{self.sequence}".encode()).hexdigest()
        return f"cb_{digest[:32]}_{self.sequence}"


def _key(secret: str | bytes) -> bytes:
    if isinstance(secret, bytes):
        return secret
    if secret.startswith(_WHSEC):
        try:
            return base64.b64decode(secret.removeprefix(_WHSEC), validate=True)
        except ValueError:
            pass
    return secret.encode()


def sign_standard(secret: str | bytes, msg_id: str, timestamp: int, body: bytes) -> str:
    """The `webhook-signature` value: `v1,<base64 HMAC-SHA256 of id.timestamp.body>`."""
    content = f"{msg_id}.{timestamp}.".encode() + body
    return (
        "v1," + base64.b64encode(hmac.new(_key(secret), content, hashlib.sha256).digest()).decode()
    )


def signed_headers(
    secret: str | bytes, body: bytes, msg_id: str, timestamp: int | None = None
) -> dict[str, str]:
    """The Standard Webhooks headers for one report."""
    stamp = int(time.time()) if timestamp is None else timestamp
    return {
        ID_HEADER: msg_id,
        TIMESTAMP_HEADER: str(stamp),
        STANDARD_SIGNATURE_HEADER: sign_standard(secret, msg_id, stamp, body),
    }


def verify_standard(
    secret: str | bytes,
    headers: Mapping[str, str],
    body: bytes,
    *,
    tolerance_s: int = TOLERANCE_S,
    now: float | None = None,
) -> str | None:
    """The message id if the headers sign `body` validly and freshly, else None."""
    msg_id = headers.get(ID_HEADER, "")
    stamp = headers.get(TIMESTAMP_HEADER, "")
    if not msg_id or len(msg_id) > 255 or not stamp.isascii() or not stamp.isdigit():
        return None
    if len(stamp) > 12 or abs((time.time() if now is None else now) - int(stamp)) > tolerance_s:
        return None
    expected = sign_standard(secret, msg_id, int(stamp), body).encode()
    given = headers.get(STANDARD_SIGNATURE_HEADER, "").encode("utf-8", "surrogatepass")
    # Several space-separated signatures are allowed (key rotation).
    return msg_id if any(hmac.compare_digest(expected, part) for part in given.split()) else None


def sign(secret: str | bytes, body: bytes) -> str:
    """Deprecated X-Signature value for `body`: `sha256=<hex HMAC>` (no id, no timestamp)."""
    key = secret.encode() if isinstance(secret, str) else secret
    return "sha256=" + hmac.new(key, body, hashlib.sha256).hexdigest()


def verify(secret: str | bytes, body: bytes, header: str | None) -> bool:
    """Whether `header` is a valid legacy signature of `body` (constant-time compare)."""
    if not header:
        return False
    # Bytes, not str: compare_digest raises TypeError for a non-ASCII str, and the header is
    # whatever the sender put there (a 500 instead of a clean 403).
    return hmac.compare_digest(
        sign(secret, body).encode(), header.strip().encode("utf-8", "surrogatepass")
    )
