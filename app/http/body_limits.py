"""A request body limit for every route, enforced while the body is read (issue 22, item 2).

Starlette's `request.body()` and FastAPI's body parameters buffer a body of any size before
anything looks at it, and FastAPI reads a JSON body before it checks who is asking: two
anonymous 64 MiB posts to `/openai/webhook` took 181 MB. `BodyLimit` wraps the application at
the ASGI layer, so no route or dependency can read past the limit:

- a declared `Content-Length` over the limit is refused with 413 before the app runs;
- otherwise the `http.request` messages the app receives are counted, and the first one that
  passes the limit is not handed over: the client gets 413 at once and the app a disconnect
  (the server has read at most the limit plus its read buffer);
- a response sent before the request's body has been read to its end closes the connection,
  so the server does not go on reading (and dropping) the rest of a body nobody wants.

Webhooks (Twilio's, OpenAI's, a provider's callbacks) carry a few hundred bytes and are
reachable by anyone, so they get a small limit of their own (`WEBHOOK_MAX_BODY_BYTES`); every
other route has `HTTP_MAX_BODY_BYTES`. Signature headers are checked by each webhook route
before it reads the body.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from app.logging import RateLimitedLog

log = logging.getLogger(__name__)

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

# Routes anyone on the internet may post to, each authenticated by a signature over a small body.
WEBHOOK_PATHS = re.compile(
    r"^/(?:twilio/(?:voice|status|sms|sms-status|stream-ended|transfer-answered|transfer-ended"
    r"|outbound-answer|amd)"
    r"|openai/webhook|operations/[^/]+/callback)/?$"
)

REFUSED = RateLimitedLog(log)
_CLOSE = (b"connection", b"close")


def _declared_length(headers: list[tuple[bytes, bytes]]) -> tuple[int | None, bool]:
    """(Content-Length or None, whether the request carries a body at all)."""
    length: int | None = None
    chunked = False
    for name, value in headers:
        if name == b"content-length":
            # The server's parser has checked it is a number; a repeated one counts at its largest.
            text = value.strip()
            if text.isdigit():
                length = max(length or 0, int(text))
        elif name == b"transfer-encoding":
            chunked = True
    return length, chunked or bool(length)


async def _refuse(send: Send, limit: int) -> None:
    body = b"PayloadTooLarge: the request body is over %d bytes" % limit
    await send(
        {
            "type": "http.response.start",
            "status": 413,
            "headers": [
                (b"content-type", b"text/plain; charset=utf-8"),
                (b"content-length", str(len(body)).encode()),
                _CLOSE,
            ],
        }
    )
    await send({"type": "http.response.body", "body": body, "more_body": False})


class BodyLimit:
    """ASGI middleware: request bodies over their route's limit are refused while read."""

    def __init__(self, app: ASGIApp, *, max_bytes: int, webhook_max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.webhook_max_bytes = webhook_max_bytes

    def limit_for(self, path: str) -> int:
        return self.webhook_max_bytes if WEBHOOK_PATHS.match(path) else self.max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        limit = self.limit_for(path)
        length, has_body = _declared_length(scope.get("headers", []))
        if length is not None and length > limit:
            REFUSED.warning("refused a %d-byte request body for %s (limit %d)", length, path, limit)
            await _refuse(send, limit)
            return
        read = 0
        complete = not has_body  # the request's body has been read to its end
        refused = False  # we answered 413: the app's own answer goes nowhere
        started = False

        async def limited_receive() -> Message:
            nonlocal read, complete, refused
            if refused:
                return {"type": "http.disconnect"}
            message = await receive()
            if message["type"] != "http.request":
                return message
            read += len(message.get("body", b""))
            if read > limit:
                REFUSED.warning("refused a request body over %d bytes for %s", limit, path)
                refused = True
                if not started:
                    await _refuse(send, limit)
                return {"type": "http.disconnect"}
            if not message.get("more_body", False):
                complete = True
            return message

        async def guarded_send(message: Message) -> None:
            nonlocal started
            if refused and message["type"].startswith("http.response"):
                return
            if message["type"] == "http.response.start":
                started = True
                if not complete:
                    # Answered before the body was read (a missing signature, a 401): closing
                    # is cheaper than reading and dropping the rest of it.
                    message = {**message, "headers": [*message.get("headers", []), _CLOSE]}
            await send(message)

        await self.app(scope, limited_receive, guarded_send)
