"""Console login and logout (the login page is the one console page open to anyone)."""

from __future__ import annotations

import secrets
from typing import Annotated

from fastapi import APIRouter, Form, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response

from app.access import login_limits, staff
from app.access.auth import ViewerPageDep, client_source, resolve_principal
from app.access.sessions import COOKIE, create_session, csrf_matches, end_session
from app.console.templating import templates
from app.deps import RuntimeDep
from app.errors import NotAuthenticated
from app.runtime import Runtime

router = APIRouter(include_in_schema=False)

LOGIN_COOKIE = "va_login"  # double-submit CSRF token of the login form
HOME = "/console/calls"


def safe_next(target: str | None) -> str:
    """Only a console path of this site (never `//elsewhere` or a full URL)."""
    if (
        not target
        or not target.startswith("/console")
        or target.startswith("//")
        or "\\" in target
        or target.startswith("/console/login")
    ):
        return HOME
    return target


def _login_page(
    request: Request,
    runtime: Runtime,
    *,
    next_path: str,
    error: str | None = None,
    status: int = 200,
    username: str = "",
    headers: dict[str, str] | None = None,
) -> Response:
    token = secrets.token_urlsafe(32)
    response = templates.TemplateResponse(
        request,
        "console/login.html",
        {"next": next_path, "error": error, "csrf_token": token, "username": username},
        status_code=status,
        headers=headers,
    )
    response.set_cookie(
        LOGIN_COOKIE,
        token,
        max_age=3600,
        path="/console/login",
        httponly=True,
        samesite="strict",
        secure=runtime.settings.cookie_secure(),
    )
    return response


@router.get("/console/login", response_class=HTMLResponse)
async def login_form(request: Request, runtime: RuntimeDep, next: str | None = None) -> Response:
    """The login page (open to anyone)."""
    try:
        principal = await resolve_principal(request, runtime)
    except NotAuthenticated:
        principal = None
    if principal is not None and principal.kind == "session":
        return RedirectResponse(safe_next(next), status_code=303)
    return _login_page(request, runtime, next_path=safe_next(next))


@router.post("/console/login")
async def login(
    request: Request,
    runtime: RuntimeDep,
    username: Annotated[str, Form(max_length=200)] = "",
    password: Annotated[str, Form(max_length=1024)] = "",
    csrf_token: Annotated[str, Form(max_length=200)] = "",
    next: Annotated[str, Form(max_length=2000)] = HOME,
) -> Response:
    """Check the name and password (rate-limited per account and source:
    app/access/login_limits.py)."""
    target = safe_next(next)
    if not csrf_matches(request.cookies.get(LOGIN_COOKIE, ""), csrf_token):
        return _login_page(
            request,
            runtime,
            next_path=target,
            error="The login form expired; please try again.",
            status=403,
            username=username,
        )
    settings = runtime.settings
    limits = login_limits.LoginLimits.from_settings(settings)
    source = client_source(request)
    # Counted before the password is checked, so concurrent guesses cannot overrun the limit.
    attempt = await login_limits.begin(runtime.engine, limits, username, source)
    if isinstance(attempt, login_limits.Throttle):
        return _login_page(
            request,
            runtime,
            next_path=target,
            error=f"Too many failed logins; try again in {attempt.retry_after_s} s.",
            status=429,
            username=username,
            headers={"Retry-After": str(attempt.retry_after_s)},
        )
    account = await staff.authenticate(runtime.engine, username, password)
    if account is None:
        await login_limits.failed(runtime.engine, limits, attempt)
        return _login_page(
            request,
            runtime,
            next_path=target,
            error="Wrong name or password.",
            status=401,
            username=username,
        )
    await login_limits.succeeded(runtime.engine, attempt)
    token, _csrf = await create_session(
        runtime.engine,
        account.id,
        max_s=settings.console_session_max_s,
        source=source,
        user_agent=request.headers.get("user-agent"),
    )
    response = RedirectResponse(target, status_code=303)
    response.set_cookie(
        COOKIE,
        token,
        max_age=int(settings.console_session_max_s),
        path="/",
        httponly=True,
        samesite="lax",
        secure=settings.cookie_secure(),
    )
    response.delete_cookie(LOGIN_COOKIE, path="/console/login")
    return response


@router.post("/console/logout")
async def logout(request: Request, runtime: RuntimeDep, _who: ViewerPageDep) -> Response:
    """End this session (CSRF-checked like every console action)."""
    token = request.cookies.get(COOKIE)
    if token:
        await end_session(runtime.engine, token)
    response = RedirectResponse("/console/login", status_code=303)
    response.delete_cookie(COOKIE, path="/", secure=runtime.settings.cookie_secure(), httponly=True)
    return response
