"""What `voice-agent serve` tells the user once it listens, in one short block: where it
listens, the webhook URLs to paste into the Twilio console, the database and Realtime
endpoint it uses, the console login, and how it stops.

Printed on stdout (not logged: it may carry a generated console password).
"""

from __future__ import annotations

import ipaddress
import sys
from dataclasses import dataclass
from typing import TextIO

from app import embedded_db
from app.settings import Settings


@dataclass(frozen=True, slots=True)
class StartInfo:
    """What the block shows; built by `app.server.serve` once everything has started."""

    settings: Settings
    listen_url: str
    database: str
    realtime: str
    demo_sor: bool
    with_worker: bool


def url_host(host: str) -> str:
    """A host as it appears in a URL (IPv6 literals in brackets)."""
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def database_of(settings: Settings, embedded: bool) -> str:
    """The database, named without its password."""
    if embedded:
        pgdata = embedded_db.pgdata_of(settings.data_dir)
        return (
            f"embedded PostgreSQL in {pgdata} (its log: {embedded_db.log_path(settings.data_dir)})"
        )
    return f"DATABASE_URL {_without_password(settings.database_url or '')}"


def _without_password(url: str) -> str:
    import psycopg

    from app.db import plain_url

    try:
        info = psycopg.conninfo.conninfo_to_dict(plain_url(url))
    except psycopg.ProgrammingError:
        return "(unparsable URL)"
    user = str(info.get("user") or "")
    host = str(info.get("host") or "localhost")
    port = info.get("port") or "5432"
    dbname = info.get("dbname") or user
    where = f"{host}:{port}" if not host.startswith("/") else f"socket {host}"
    return f"postgresql://{user + '@' if user else ''}{where}/{dbname}"


def realtime_of(
    settings: Settings,
    *,
    in_process_simulator: bool = False,
    voice: str = "synthetic voice",
    reason: str = "",
) -> str:
    """Which Realtime endpoint calls talk to, and why (`reason`: why a simulator)."""
    model = settings.openai_realtime_model
    if in_process_simulator:
        return (
            f"local simulator at {settings.openai_base_url}: scripted, {voice} "
            f"({reason or 'OPENAI_API_KEY unset'})"
        )
    if settings.openai_api_key is None or settings.realtime_simulator:
        why = reason or "no OPENAI_API_KEY"
        return f"{settings.openai_base_url} (OPENAI_BASE_URL; {why}), model {model}"
    if settings.openai_base_url:
        return f"{settings.openai_base_url} (OPENAI_BASE_URL), model {model}"
    return f"the OpenAI Realtime API, model {model}"


def _is_local(url: str) -> bool:
    host = url.split("://", 1)[-1].split("/", 1)[0].rsplit(":", 1)[0].strip("[]")
    if host == "localhost":
        return True
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return False
    return address.is_loopback or address.is_private or address.is_unspecified


def lines(info: StartInfo) -> list[str]:
    """The block, line by line."""
    s = info.settings
    public = s.public_base_url.rstrip("/")
    out = [
        f"voice-agent is ready on {info.listen_url}",
        "  Twilio console, the number's webhooks (HTTP POST):",
        f"    A call comes in      {public}/twilio/voice",
        f"    Call status changes  {public}/twilio/status",
    ]
    if _is_local(public):
        out.append(
            "    (a local address: Twilio calls only a public https URL; set PUBLIC_BASE_URL)"
        )
    out.append(f"  database        {info.database}")
    out.append(f"  Realtime        {info.realtime}")
    if info.demo_sor:
        out.append(
            f"  bookings        demo system of record at {s.sor_base_url} (SOR_BASE_URL unset)"
        )
    if not info.with_worker:
        out.append("  operations      no worker here (--no-worker): run `voice-agent worker`")
        if s.sip_bind:
            out.append("                  (SIP outbound calls need a worker here: no --no-worker)")
    console = f"{s.public_base_url.rstrip('/')}/console"
    if s.console_password is not None:
        out.append(f"  console         {console}  (first admin {s.console_user}: CONSOLE_PASSWORD)")
    else:
        # A first admin made now had its generated password printed once, above.
        out.append(f"  console         {console}  (accounts: voice-agent staff add NAME)")
    out.append(
        "  stop            Ctrl+C or SIGTERM: new calls hear busy, live calls get "
        f"{s.drain_timeout_s:g} s (DRAIN_TIMEOUT_S)"
    )
    return out


def show(info: StartInfo, stream: TextIO | None = None) -> None:
    """Print the block (stdout by default) and flush it, so a pipe sees it at once."""
    target = stream or sys.stdout
    print("\n".join(lines(info)), file=target, flush=True)
