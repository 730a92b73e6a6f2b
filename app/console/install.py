"""The console in the app: its pages, JSON API, login, static files, security headers and
the OpenAPI schema (behind authentication), added in one place (`create_app` calls it)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from fastapi.staticfiles import StaticFiles

from app.access.security_headers import ConsoleSecurityHeaders
from app.console import api as routes_console_api
from app.console import login as routes_auth
from app.console import pages as routes_console

STATIC_DIR = Path(__file__).parent / "static"


def install_console(app: FastAPI) -> None:
    """Add the console's routes to `app` (created with `openapi_url=None`)."""
    app.include_router(routes_auth.router)
    app.include_router(routes_console_api.router)
    app.include_router(routes_console.router)
    app.mount("/console/static", StaticFiles(directory=STATIC_DIR), name="console-static")
    app.add_middleware(ConsoleSecurityHeaders)

    def schema() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = get_openapi(
                title="voice-agent",
                version="1",
                description=routes_console_api.API_DESCRIPTION,
                routes=app.routes,
            )
        return app.openapi_schema

    app.openapi = schema  # type: ignore[method-assign]
    routes_console_api.add_schema_route(app)
