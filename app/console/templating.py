"""The console's Jinja2 templates (package data under app/console/templates), with their filters."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from fastapi.templating import Jinja2Templates

from app.console.swimlanes import seconds

TEMPLATES_DIR = Path(__file__).parent / "templates"


def _when(value: Any) -> str:
    """ISO time (or datetime) -> `2026-05-01 10:02:03 UTC`."""
    if value is None or value == "":
        return "-"
    at = value if isinstance(value, datetime) else datetime.fromisoformat(str(value))
    return at.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def _short_id(value: Any) -> str:
    return str(value)[:8] if value else ""


templates = Jinja2Templates(directory=str(TEMPLATES_DIR))
templates.env.filters["when"] = _when
templates.env.filters["seconds"] = seconds
templates.env.filters["short_id"] = _short_id
templates.env.globals["app_name"] = "voice-agent"
