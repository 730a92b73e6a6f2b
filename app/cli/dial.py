"""`voice-agent dial NUMBER --purpose TEXT`: ask the service to place an outbound call.

It calls `POST /api/calls` on the service at `--server` (default: the local one, from HOST and
PORT) with an API token (`--token`, else VOICE_AGENT_API_TOKEN; an operator's, made with
`voice-agent token add NAME --role operator`), and prints the call's id and the operation that
places it. What happens next (who answered, the message left, busy) is on the call's timeline.
"""

from __future__ import annotations

import os

import httpx

from app.errors import StartupError
from app.settings import Settings

TOKEN_ENV = "VOICE_AGENT_API_TOKEN"
TIMEOUT_S = 15.0


def default_server(settings: Settings) -> str:
    """The local service, as `serve` with these settings listens."""
    host = settings.host if settings.host not in ("0.0.0.0", "::", "") else "127.0.0.1"
    if ":" in host:
        host = f"[{host}]"
    return f"http://{host}:{settings.port}"


def run_dial_command(
    number: str,
    purpose: str,
    operation_id: str | None,
    server: str | None,
    token: str | None,
    settings: Settings,
) -> int:
    """Place the call through the API; 0 once it was accepted (202), else StartupError."""
    token = token or os.environ.get(TOKEN_ENV)
    if not token:
        raise StartupError(
            f"no API token: pass --token or set {TOKEN_ENV} "
            "(make one with `voice-agent token add NAME --role operator`)"
        )
    base = (server or default_server(settings)).rstrip("/")
    body: dict[str, str] = {"to": number, "purpose": purpose}
    if operation_id:
        body["operation_id"] = operation_id
    try:
        response = httpx.post(
            f"{base}/api/calls",
            json=body,
            headers={"Authorization": f"Bearer {token}"},
            timeout=TIMEOUT_S,
        )
    except httpx.HTTPError as exc:
        raise StartupError(f"cannot reach the service at {base}: {exc}: is it running?") from None
    if response.status_code != 202:
        try:
            detail = response.json().get("detail")
        except ValueError:
            detail = response.text[:200]
        raise StartupError(f"the service refused the call (HTTP {response.status_code}): {detail}")
    placed = response.json()
    print(f"call {placed['call_id']} requested (placing operation {placed['operation_id']})")
    print(f"its timeline: {base}/console/calls/{placed['call_id']}")
    return 0
