"""The console's security headers, on every response under /console (pages, fragments,
redirects, errors and static files alike).

The Content-Security-Policy is what the pages actually need and no more: scripts, styles,
media, fetches and the live stream from this origin only; no inline script and no inline
`<style>` (the lanes' positions are `style` attributes, hence `style-src-attr`); no plugins,
no `<base>`, forms post only here, and no framing (with X-Frame-Options for old browsers).
Trusted Types (Chromium) hold scripts to it: HTML strings reach the DOM only through the
`console-fragment` policy in console.js, which parses a fetched fragment into an inert document
and takes the server's `<template>` from it; `innerHTML` with a string throws.
"""

from __future__ import annotations

from starlette.datastructures import MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

CONTENT_SECURITY_POLICY = "; ".join(
    [
        "default-src 'self'",
        "script-src 'self'",
        "style-src 'self'",
        "style-src-attr 'unsafe-inline'",
        "img-src 'self' data:",
        "media-src 'self'",
        "connect-src 'self'",
        "object-src 'none'",
        "base-uri 'none'",
        "form-action 'self'",
        "frame-ancestors 'none'",
        "require-trusted-types-for 'script'",
        "trusted-types console-fragment",
    ]
)
HEADERS = {
    "Content-Security-Policy": CONTENT_SECURITY_POLICY,
    "X-Frame-Options": "DENY",
    "X-Content-Type-Options": "nosniff",
    # Console URLs carry searches (a phone number): they never leave the site as a Referer.
    "Referrer-Policy": "same-origin",
}


def is_console_path(path: str) -> bool:
    return path == "/console" or path.startswith("/console/")


class ConsoleSecurityHeaders:
    """Pure ASGI middleware: adds HEADERS to /console responses (other paths pass untouched)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not is_console_path(scope["path"]):
            await self.app(scope, receive, send)
            return

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = MutableHeaders(scope=message)
                for name, value in HEADERS.items():
                    if name not in headers:
                        headers.append(name, value)
            await send(message)

        await self.app(scope, receive, send_with_headers)
