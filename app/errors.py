"""Domain errors of the service, and the one place they become HTTP statuses / WS close codes."""

from __future__ import annotations

import logging
from urllib.parse import quote

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, RedirectResponse, Response
from starlette.requests import ClientDisconnect

from telephony.errors import MalformedFrame, StreamRejected, TelephonyError

log = logging.getLogger(__name__)

# RFC 6455 close codes.
WS_NORMAL = 1000
WS_GOING_AWAY = 1001
WS_POLICY_VIOLATION = 1008
WS_TOO_BIG = 1009
WS_INTERNAL_ERROR = 1011
WS_TRY_AGAIN_LATER = 1013


class AppError(Exception):
    """Root of every error of the service layer."""

    retryable: bool = False


class BadSignature(AppError):
    """A Twilio webhook whose X-Twilio-Signature does not verify."""


class PayloadTooLarge(AppError):
    """A request body over the limit."""


class BadRequest(AppError):
    """A request missing what we need (e.g. no CallSid)."""


class InvalidRequest(BadRequest):
    """A request the API refuses for a reason it says (safe to show: no internals)."""


class NotFound(AppError):
    """The thing asked for does not exist."""


class Conflict(AppError):
    """The request conflicts with the current state (the message says why)."""


class DatabaseUnavailable(AppError):
    """The database could not be reached in time."""

    retryable = True


class StartupError(AppError):
    """A cause that keeps a command from running, which the user can fix.

    Its message is one line that names the cause and the fix; the command line prints it
    (no traceback) and exits with `exit_status`.
    """

    exit_status: int = 2


class TokenRejected(AppError):
    """A media stream token that is missing, forged, expired, for another call, or reused."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class NotAuthenticated(AppError):
    """No valid credentials on an API request (no token, session or allowed Basic)."""


class LoginRequired(AppError):
    """A console page asked for without a session: go to the login page, then come back."""

    def __init__(self, next_path: str) -> None:
        super().__init__(next_path)
        self.next_path = next_path


class Forbidden(AppError):
    """Authenticated, but the role does not allow this."""


class CsrfRejected(AppError):
    """A state-changing console request without the session's CSRF token."""


class TooManyAttempts(AppError):
    """Login rate limit: too many failures for the account or the source address."""

    def __init__(self, reason: str, retry_after_s: int) -> None:
        super().__init__(reason)
        self.retry_after_s = retry_after_s


class TooManyStreams(AppError):
    """A console live stream beyond its staff member's (or the server's) bound."""

    retryable = True


_HTTP: list[tuple[type[Exception], int]] = [
    (NotAuthenticated, 401),
    (LoginRequired, 303),
    (Forbidden, 403),
    (CsrfRejected, 403),
    (TooManyAttempts, 429),
    (TooManyStreams, 429),
    (Conflict, 409),
    (BadSignature, 403),
    (PayloadTooLarge, 413),
    (BadRequest, 400),
    (NotFound, 404),
    (DatabaseUnavailable, 503),
    (TokenRejected, 403),
]

_WS: list[tuple[type[Exception], int]] = [
    (TokenRejected, WS_POLICY_VIOLATION),
    (StreamRejected, WS_POLICY_VIOLATION),
    (MalformedFrame, WS_POLICY_VIOLATION),
    (DatabaseUnavailable, WS_TRY_AGAIN_LATER),
    (TelephonyError, WS_INTERNAL_ERROR),
]


# Errors whose message is written for the API's user (the others answer with their name).
_SPEAKS = (
    NotAuthenticated,
    Forbidden,
    CsrfRejected,
    TooManyAttempts,
    TooManyStreams,
    Conflict,
    NotFound,
    InvalidRequest,
)


def http_status(exc: BaseException) -> int:
    """The HTTP status for a domain error (500 for anything unexpected)."""
    for cls, status in _HTTP:
        if isinstance(exc, cls):
            return status
    return 500


def ws_close_code(exc: BaseException) -> int:
    """The WebSocket close code for a domain error (1011 for anything unexpected)."""
    for cls, code in _WS:
        if isinstance(exc, cls):
            return code
    return WS_INTERNAL_ERROR


def install_error_handlers(app: FastAPI) -> None:
    """Map AppError to its status with a short plain-text body (no internals leak)."""

    async def handle(request: Request, exc: Exception) -> Response:
        status = http_status(exc)
        log.info("%s %s -> %d (%s)", request.method, request.url.path, status, type(exc).__name__)
        if isinstance(exc, LoginRequired):
            return RedirectResponse(
                "/console/login?next=" + quote(exc.next_path, safe="/"), status_code=303
            )
        headers: dict[str, str] = {}
        if getattr(exc, "retryable", False):
            headers["Retry-After"] = "1"
        if isinstance(exc, TooManyAttempts):
            headers["Retry-After"] = str(exc.retry_after_s)
        if isinstance(exc, NotAuthenticated):
            headers["WWW-Authenticate"] = 'Bearer realm="voice-agent"'
        if request.url.path.startswith("/api/"):
            # The JSON API answers JSON; what the message says is safe to show (no internals).
            detail = str(exc) if isinstance(exc, _SPEAKS) else type(exc).__name__
            return JSONResponse({"detail": detail}, status_code=status, headers=headers)
        return PlainTextResponse(type(exc).__name__, status_code=status, headers=headers)

    app.add_exception_handler(AppError, handle)

    async def gone(request: Request, exc: Exception) -> Response:
        # The client went away mid-body: nobody reads the answer, and it is no server error
        # (it was a 60-line traceback per attempt).
        log.info("%s %s: client disconnected mid-request", request.method, request.url.path)
        return PlainTextResponse("ClientDisconnect", status_code=400)

    app.add_exception_handler(ClientDisconnect, gone)
