"""Digest authentication of INVITEs (RFC 3261 section 22, RFC 7616 qop=auth) with a nonce store.

aiosipua parses the Authorization header and computes digests; this module issues nonces,
remembers them until they expire, refuses replayed nonce counts and answers `stale=true` for
an expired nonce, so a client with the right password retries without asking its user.

Guessing is slowed per (user, source address): a failed response burns its nonce (a guess
needs a new challenge), and after `failures_allowed` failures in a row every further attempt
from that pair is refused unchecked for a back-off that doubles with each failure (1 s, 2 s,
4 s ... up to `backoff_max_s`). Attempts refused unchecked do not count, so the back-off ends
on schedule; a success clears the count.
"""

from __future__ import annotations

import hmac
import math
import secrets
from dataclasses import dataclass
from enum import StrEnum

from aiosipua import SipDigestAuth, build_credentials
from aiosipua.headers import AuthChallenge, parse_auth, parse_uri

NONCE_TTL_S = 300.0
MAX_NONCES = 10_000
FAILURES_ALLOWED = 3
BACKOFF_BASE_S = 1.0
BACKOFF_MAX_S = 300.0
MAX_FAILURE_RECORDS = 10_000  # (user, source) pairs remembered; the oldest go first
MAX_USERNAME = 64
ALGORITHMS = ("MD5", "SHA-256")


class AuthResult(StrEnum):
    OK = "ok"
    MISSING = "missing"  # no credentials: challenge
    STALE = "stale"  # right password, expired or unknown nonce: challenge with stale=true
    BAD = "bad"  # wrong user, password or replay: 403
    BLOCKED = "blocked"  # this (user, source) failed too often: 403 until its back-off ends


@dataclass(slots=True)
class _Nonce:
    expires: float
    last_nc: int = 0
    used: bool = False


@dataclass(slots=True)
class _Failures:
    count: int
    last: float
    blocked_until: float = 0.0


def _same_target(digest_uri: str, request_uri: str) -> bool:
    """The credentials' uri names this request's target (RFC 2617 3.2.2.5).

    Most clients repeat the Request-URI; some (sipp among them) send only its host and port,
    which still binds the response to this server, so scheme, host and port must agree.
    """
    if digest_uri.strip() == request_uri.strip():
        return True
    try:
        a, b = parse_uri(digest_uri), parse_uri(request_uri)
    except Exception:
        return False
    return bool(a.host) and (a.scheme, a.host.lower(), a.port) == (b.scheme, b.host.lower(), b.port)


def parse_users(spec: str) -> dict[str, str]:
    """`alice:secret,bob:pw` -> {"alice": "secret", "bob": "pw"}; ValueError without the pairs."""
    users: dict[str, str] = {}
    for entry in spec.split(","):
        entry = entry.strip()
        if not entry:
            continue
        user, sep, password = entry.partition(":")
        if not sep or not user or not password:
            raise ValueError("SIP_DIGEST_USERS must be user:password pairs separated by commas")
        users[user] = password
    return users


class DigestAuth:
    """Challenges and verifies INVITE credentials against a fixed set of users."""

    def __init__(
        self,
        users: dict[str, str],
        realm: str = "voice-agent",
        *,
        nonce_ttl_s: float = NONCE_TTL_S,
        max_nonces: int = MAX_NONCES,
        failures_allowed: int = FAILURES_ALLOWED,
        backoff_max_s: float = BACKOFF_MAX_S,
    ) -> None:
        self._users = users
        self.realm = realm
        self._ttl = nonce_ttl_s
        self._max = max_nonces
        self._nonces: dict[str, _Nonce] = {}
        self._opaque = secrets.token_hex(8)
        self.failures_allowed = failures_allowed
        self.backoff_max_s = backoff_max_s
        self._failures: dict[tuple[str, str], _Failures] = {}

    def challenge(self, now: float, *, stale: bool = False) -> str:
        """A WWW-Authenticate value with a fresh nonce."""
        self._prune(now)
        nonce = secrets.token_hex(16)
        self._nonces[nonce] = _Nonce(now + self._ttl)
        value = (
            f'Digest realm="{self.realm}", nonce="{nonce}", opaque="{self._opaque}", '
            f'algorithm=MD5, qop="auth"'
        )
        if stale:
            value += ", stale=true"
        return value

    def verify(
        self,
        authorization: str | None,
        method: str,
        request_uri: str,
        now: float,
        source: str = "",
    ) -> AuthResult:
        """Check the credentials of a request from `source` (its address): OK, or why not."""
        if not authorization:
            return AuthResult.MISSING
        try:
            creds = parse_auth(authorization, credentials=True)
        except Exception:
            return AuthResult.BAD
        if creds.scheme.lower() != "digest":
            return AuthResult.MISSING
        key = (str(creds.params.get("username", ""))[:MAX_USERNAME], source)
        record = self._failures.get(key)
        if record is not None and now < record.blocked_until:
            # Refused unchecked: even the right password waits, or the back-off would let a
            # guesser learn that a guess was right.
            return AuthResult.BLOCKED
        result = self._check(creds.params, method, request_uri, now)
        if result is AuthResult.BAD:
            # The nonce is burnt: another guess needs another challenge (a round trip), and
            # a response seen on the wire cannot be tried again with other values.
            self._nonces.pop(str(creds.params.get("nonce", "")), None)
            self._failed(key, now)
        elif result is AuthResult.OK:
            self._failures.pop(key, None)
        return result

    def retry_after(self, username: str, source: str, now: float) -> int:
        """Whole seconds until (username, source) may try again (0: now)."""
        record = self._failures.get((username[:MAX_USERNAME], source))
        if record is None or now >= record.blocked_until:
            return 0
        return max(1, math.ceil(record.blocked_until - now))

    def _failed(self, key: tuple[str, str], now: float) -> None:
        record = self._failures.pop(key, None)
        if record is None:
            if len(self._failures) >= MAX_FAILURE_RECORDS:
                del self._failures[next(iter(self._failures))]  # the longest untouched
            record = _Failures(0, now)
        record.count += 1
        record.last = now
        over = record.count - self.failures_allowed
        if over > 0:
            delay = min(self.backoff_max_s, BACKOFF_BASE_S * 2 ** min(over - 1, 30))
            record.blocked_until = now + delay
        self._failures[key] = record  # re-inserted: the dict stays in least-recent order

    def _check(self, p: dict[str, str], method: str, request_uri: str, now: float) -> AuthResult:
        username, nonce, uri, given = (
            p.get("username", ""),
            p.get("nonce", ""),
            p.get("uri", ""),
            p.get("response", ""),
        )
        password = self._users.get(username)
        algorithm = p.get("algorithm", "MD5").upper()
        if (
            password is None
            or p.get("realm") != self.realm
            or algorithm not in ALGORITHMS
            or not _same_target(uri, request_uri)
            or not given
        ):
            return AuthResult.BAD
        qop = p.get("qop")
        nc_text, cnonce = p.get("nc", ""), p.get("cnonce", "")
        nc = 0
        if qop is not None:
            if qop.lower() != "auth" or not cnonce:
                return AuthResult.BAD
            try:
                nc = int(nc_text, 16)
            except ValueError:
                return AuthResult.BAD
        challenge = AuthChallenge(
            "Digest",
            {"realm": self.realm, "nonce": nonce, "algorithm": algorithm}
            | ({"qop": "auth"} if qop is not None else {}),
        )
        expected = build_credentials(
            SipDigestAuth(username, password),
            challenge,
            method,
            uri,
            nonce_count=max(nc, 1),
            cnonce=cnonce or None,
        )
        if expected is None or not hmac.compare_digest(
            expected.params["response"].lower(), given.lower()
        ):
            return AuthResult.BAD
        record = self._nonces.get(nonce)
        if record is None or record.expires <= now:
            self._nonces.pop(nonce, None)
            return AuthResult.STALE  # the password was right; the nonce is not ours (any more)
        if qop is None:
            if record.used:
                return AuthResult.STALE
            record.used = True
        elif nc <= record.last_nc:
            return AuthResult.BAD  # a replayed request
        else:
            record.last_nc = nc
        return AuthResult.OK

    def _prune(self, now: float) -> None:
        if len(self._nonces) < self._max // 2:
            return
        for nonce in [n for n, r in self._nonces.items() if r.expires <= now]:
            del self._nonces[nonce]
        while len(self._nonces) >= self._max:
            del self._nonces[next(iter(self._nonces))]  # the oldest

    def expire(self, now: float) -> None:
        """Forget every expired nonce, and failures older than the longest back-off (the
        core calls this from its housekeeping)."""
        for nonce in [n for n, r in self._nonces.items() if r.expires <= now]:
            del self._nonces[nonce]
        forget_before = now - 2 * self.backoff_max_s
        for key in [k for k, r in self._failures.items() if r.last < forget_before]:
            del self._failures[key]

    def held(self) -> int:
        """Nonces and failure records in memory (housekeeping runs while there are any)."""
        return len(self._nonces) + len(self._failures)

    def __len__(self) -> int:
        return len(self._nonces)
