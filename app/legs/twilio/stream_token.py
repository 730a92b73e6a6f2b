"""Media stream tokens: signed, short-lived, bound to one CallSid, usable once.

The token rides in the TwiML `<Parameter>` and comes back in the stream's `start` message,
so only the party that received our TwiML (Twilio) can open the media socket for that call.
Single use is enforced twice: in memory here (fast, per process) and by the caller of
`consume`, which moves the call row out of `ringing` with a conditional update (across
processes).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass

from app.errors import TokenRejected

_VERSION = "v1"


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def _utf8(text: str) -> bytes:
    # surrogatepass: a lone surrogate (legal in JSON text) must be rejected, not raise.
    return text.encode("utf-8", "surrogatepass")


@dataclass(frozen=True, slots=True)
class StreamClaims:
    """What a verified token says."""

    call_sid: str
    call_id: str
    expires_at: float
    nonce: str
    resume: bool = False  # a resume token: it takes over a call whose stream was lost


class StreamTokens:
    """Issues and verifies stream tokens with an HMAC key."""

    def __init__(self, secret: bytes, ttl_s: float, clock: Callable[[], float] = time.time) -> None:
        self._secret = secret
        self._ttl_s = ttl_s
        self._clock = clock
        self._used: dict[str, float] = {}  # nonce -> expiry, purged as they expire

    def issue(self, call_sid: str, call_id: str) -> str:
        """A token for the stream of `call_sid` (our row `call_id`)."""
        return self._issue(call_sid, call_id, secrets.token_urlsafe(12), resume=False)

    def issue_resume(self, call_sid: str, call_id: str) -> tuple[str, str]:
        """A resume token for a new stream of `call_sid`, and its nonce (which the row keeps:
        only the token carrying it takes the call over, once)."""
        nonce = secrets.token_urlsafe(12)
        return self._issue(call_sid, call_id, nonce, resume=True), nonce

    def _issue(self, call_sid: str, call_id: str, nonce: str, *, resume: bool) -> str:
        payload: dict[str, object] = {
            "sid": call_sid,
            "cid": call_id,
            "exp": round(self._clock() + self._ttl_s, 3),
            "n": nonce,
        }
        if resume:
            payload["r"] = 1
        body = _b64(json.dumps(payload, separators=(",", ":")).encode())
        return f"{_VERSION}.{body}.{self._sign(body)}"

    def _sign(self, body: str) -> str:
        mac = hmac.new(self._secret, _utf8(f"{_VERSION}.{body}"), hashlib.sha256).digest()
        return _b64(mac)

    def verify(self, token: str | None, call_sid: str) -> StreamClaims:
        """The token's claims if it is genuine, unexpired and for `call_sid`; else raise."""
        if not token:
            raise TokenRejected("missing")
        parts = token.split(".")
        if len(parts) != 3 or parts[0] != _VERSION:
            raise TokenRejected("malformed")
        body, sig = parts[1], parts[2]
        # Compared as bytes: compare_digest raises TypeError on non-ASCII str, and both the
        # token and the CallSid come from the (untrusted) start frame.
        if not hmac.compare_digest(_utf8(sig), _utf8(self._sign(body))):
            raise TokenRejected("bad_signature")
        try:
            payload = json.loads(_unb64(body))
            claims = StreamClaims(
                call_sid=str(payload["sid"]),
                call_id=str(payload["cid"]),
                expires_at=float(payload["exp"]),
                nonce=str(payload["n"]),
                resume=payload.get("r") == 1,
            )
        except (ValueError, KeyError, TypeError) as exc:
            raise TokenRejected("malformed") from exc
        if claims.expires_at < self._clock():
            raise TokenRejected("expired")
        if not hmac.compare_digest(_utf8(claims.call_sid), _utf8(call_sid)):
            raise TokenRejected("wrong_call")
        return claims

    def consume(self, claims: StreamClaims) -> None:
        """Mark the token used in this process; raise if it already was."""
        now = self._clock()
        for nonce in [n for n, exp in self._used.items() if exp < now]:
            del self._used[nonce]
        if claims.nonce in self._used:
            raise TokenRejected("reused")
        self._used[claims.nonce] = claims.expires_at
