"""Who is asking: the console's authentication and authorization, as FastAPI dependencies.

Three kinds of credentials, looked at in this order:
- `Authorization: Bearer va_…`: an API token (integrations);
- `Authorization: Basic …`: a staff name and password, only when CONSOLE_HTTP_BASIC is on;
- the `va_session` cookie of a console login.

Every route of the console and its JSON API depends on `ViewerDep`, `OperatorDep` or `AdminDep`
(tests walk every route to make sure). Requests carried by the session cookie that change
anything must also carry the session's CSRF token (form field `csrf_token` or header
`X-CSRF-Token`); token and Basic requests carry no ambient credentials, so they need none.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Annotated, Literal

from fastapi import Depends, Request

from app.access import api_tokens, login_limits, staff
from app.access.sessions import COOKIE, csrf_matches, load_session
from app.access.staff import Role
from app.deps import RuntimeDep
from app.errors import CsrfRejected, Forbidden, LoginRequired, NotAuthenticated, TooManyAttempts
from app.runtime import Runtime

CSRF_FIELD = "csrf_token"
CSRF_HEADER = "x-csrf-token"
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
# A verified Basic credential is trusted this long before argon2 checks it again.
BASIC_CACHE_S = 60.0


@dataclass(frozen=True, slots=True)
class Principal:
    """An authenticated caller of the console or its API."""

    kind: Literal["session", "token", "basic"]
    name: str
    role: Role
    csrf_token: str | None = None  # sessions only

    @property
    def actor(self) -> str:
        """How the operation trail names this caller (`actor` column, 64 characters)."""
        prefix = "token" if self.kind == "token" else "staff"
        return f"{prefix}:{self.name}"[:64]

    @property
    def sees_phone_numbers(self) -> bool:
        return self.role.sees_phone_numbers


def client_source(request: Request) -> str:
    """The address a request came from: uvicorn replaces the peer with the client named in
    `X-Forwarded-For` when the peer is a proxy FORWARDED_ALLOW_IPS trusts (behind an ingress
    without it, every request has the ingress's address)."""
    return request.client.host if request.client else "unknown"


async def _from_bearer(runtime: Runtime, secret: str) -> Principal:
    token = await api_tokens.authenticate_token(runtime.engine, secret)
    if token is None:
        raise NotAuthenticated("the API token is unknown or revoked")
    return Principal("token", token.name, token.role)


class _BasicCache:
    """Recently verified Basic credentials, so a script's every request is not an argon2."""

    def __init__(self) -> None:
        self._ok: dict[str, tuple[float, str, Role]] = {}

    def get(self, key: str) -> tuple[str, Role] | None:
        hit = self._ok.get(key)
        if hit is None or hit[0] < time.monotonic():
            self._ok.pop(key, None)
            return None
        return hit[1], hit[2]

    def put(self, key: str, name: str, role: Role) -> None:
        if len(self._ok) > 1000:
            self._ok.clear()
        self._ok[key] = (time.monotonic() + BASIC_CACHE_S, name, role)


_basic_cache = _BasicCache()


async def _from_basic(runtime: Runtime, request: Request, encoded: str) -> Principal:
    if not runtime.settings.console_http_basic:
        raise NotAuthenticated("HTTP Basic is off (CONSOLE_HTTP_BASIC); use an API token")
    try:
        decoded = base64.b64decode(encoded, validate=True).decode("utf-8")
        username, _, password = decoded.partition(":")
    except (binascii.Error, UnicodeDecodeError, ValueError) as exc:
        raise NotAuthenticated("malformed Basic credentials") from exc
    # Keyed by a hash, so the cache never holds a password (scoped to this database).
    key = hashlib.sha256(f"{id(runtime)}\0{username}\0{password}".encode()).hexdigest()
    cached = _basic_cache.get(key)
    if cached is not None:
        return Principal("basic", cached[0], cached[1])
    limits = login_limits.LoginLimits.from_settings(runtime.settings)
    # Counted before the password is checked, so concurrent guesses cannot overrun the limit.
    attempt = await login_limits.begin(runtime.engine, limits, username, client_source(request))
    if isinstance(attempt, login_limits.Throttle):
        raise TooManyAttempts(attempt.reason, attempt.retry_after_s)
    account = await staff.authenticate(runtime.engine, username, password)
    if account is None:
        await login_limits.failed(runtime.engine, limits, attempt)
        raise NotAuthenticated("bad credentials")
    await login_limits.succeeded(runtime.engine, attempt)
    _basic_cache.put(key, account.username, account.role)
    return Principal("basic", account.username, account.role)


async def resolve_principal(request: Request, runtime: Runtime) -> Principal | None:
    """The caller of `request`, None if anonymous; bad credentials raise NotAuthenticated."""
    cached: Principal | None = getattr(request.state, "principal", None)
    if cached is not None:
        return cached
    principal: Principal | None = None
    header = request.headers.get("authorization", "")
    scheme, _, value = header.partition(" ")
    if header and scheme.lower() == "bearer":
        principal = await _from_bearer(runtime, value.strip())
    elif header and scheme.lower() == "basic":
        principal = await _from_basic(runtime, request, value.strip())
    elif header:
        raise NotAuthenticated("unsupported Authorization scheme")
    else:
        token = request.cookies.get(COOKIE)
        if token:
            session = await load_session(
                runtime.engine, token, idle_s=runtime.settings.console_session_idle_s
            )
            if session is not None:
                principal = Principal(
                    "session", session.username, session.role, csrf_token=session.csrf_token
                )
    request.state.principal = principal
    return principal


async def _check_csrf(request: Request, principal: Principal) -> None:
    if request.method in SAFE_METHODS or principal.kind != "session":
        return
    assert principal.csrf_token is not None
    given = request.headers.get(CSRF_HEADER)
    if given is None and request.headers.get("content-type", "").startswith(
        ("application/x-www-form-urlencoded", "multipart/form-data")
    ):
        form = await request.form()  # Starlette keeps it for the route's own Form() fields
        value = form.get(CSRF_FIELD)
        given = value if isinstance(value, str) else None
    if not csrf_matches(principal.csrf_token, given):
        raise CsrfRejected("missing or wrong CSRF token")


def _requirement(role: Role, *, page: bool) -> Callable[..., Awaitable[Principal]]:
    async def dependency(request: Request, runtime: RuntimeDep) -> Principal:
        if page and request.headers.get("authorization"):
            principal = None  # pages are for browsers: a session only
        else:
            principal = await resolve_principal(request, runtime)
        if principal is None or (page and principal.kind != "session"):
            if page:
                target = request.url.path
                if request.url.query:
                    target += "?" + request.url.query
                raise LoginRequired(target)
            raise NotAuthenticated("authentication required")
        if not principal.role.allows(role):
            raise Forbidden(f"this needs the {role.value} role")
        await _check_csrf(request, principal)
        return principal

    dependency.__name__ = f"require_{role.value}{'_page' if page else ''}"
    return dependency


require_viewer = _requirement(Role.VIEWER, page=False)
require_operator = _requirement(Role.OPERATOR, page=False)
require_admin = _requirement(Role.ADMIN, page=False)
require_viewer_page = _requirement(Role.VIEWER, page=True)
require_operator_page = _requirement(Role.OPERATOR, page=True)
require_admin_page = _requirement(Role.ADMIN, page=True)

ViewerDep = Annotated[Principal, Depends(require_viewer)]
OperatorDep = Annotated[Principal, Depends(require_operator)]
AdminDep = Annotated[Principal, Depends(require_admin)]
ViewerPageDep = Annotated[Principal, Depends(require_viewer_page)]
OperatorPageDep = Annotated[Principal, Depends(require_operator_page)]
AdminPageDep = Annotated[Principal, Depends(require_admin_page)]
