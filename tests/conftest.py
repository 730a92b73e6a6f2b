"""Shared fixtures: a real PostgreSQL database per test session, cleaned per test."""

from __future__ import annotations

import compileall
import os
import secrets
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import psycopg
import pytest
from hypothesis import settings
from sqlalchemy.ext.asyncio import AsyncEngine

from app.db import create_database, drop_database, make_engine, resolve_database_url, upgrade
from tests import loop_leaks

# The races' `race` fixture and their one-line summary (tests/race_report.py).
from tests.race_report import pytest_terminal_summary, race  # noqa: F401

# Hypothesis fails an example that takes over 200 ms by default: a timing assertion that a
# loaded machine trips (8 s of synthesized speech takes ~200 ms here unloaded). Speed is
# measured in bench/, not asserted in tests.
settings.register_profile("voice-agent", deadline=None)
settings.load_profile("voice-agent")

loop_leaks.install()

# No test may reach api.twilio.com (these machines have no internet, and a test must not
# depend on it): a service a test starts without a fake Twilio REST API of its own sends its
# SMS to an address where nothing listens, so a send fails at once, as when Twilio is down.
NO_TWILIO_API = "http://127.0.0.1:9"
os.environ.setdefault("TWILIO_API_BASE_URL", NO_TWILIO_API)

# Without TEST_DATABASE_URL/DATABASE_URL: an embedded PostgreSQL of this checkout (ignored
# by git), so two clones testing at once never share a server or its files.
EMBEDDED_TEST_DATA_DIR = Path(__file__).resolve().parent.parent / ".voice-agent" / "test"


def _server_url() -> str:
    url = os.environ.get("TEST_DATABASE_URL") or os.environ.get("DATABASE_URL")
    return resolve_database_url(url, EMBEDDED_TEST_DATA_DIR)


# The packages every `voice-agent` subprocess of a test imports.
SOURCE_PACKAGES = ("app", "telephony", "tools")


def pytest_configure(config: pytest.Config) -> None:
    """Under pytest-xdist with no database configured, the controller starts the embedded
    server once and hands its URL to the workers, so they never race to initdb one directory.

    The controller also byte-compiles our packages: with PYTHONDONTWRITEBYTECODE set (as on
    the CI machines) no process writes its .pyc, so every `voice-agent` a test starts compiled
    ~250 modules again (~0.6 s each time); py_compile writes them regardless, once (<1 s), and
    a changed source is recompiled by its mtime as usual."""
    if hasattr(config, "workerinput"):
        return
    root = Path(__file__).resolve().parent.parent
    for package in SOURCE_PACKAGES:
        compileall.compile_dir(root / package, quiet=2)
    if os.environ.get("TEST_DATABASE_URL") or os.environ.get("DATABASE_URL"):
        return
    if not getattr(config.option, "numprocesses", None):
        return
    os.environ["TEST_DATABASE_URL"] = _server_url()


@pytest.fixture(scope="session")
def database_url() -> Iterator[str]:
    """A fresh database, migrated to head, for this test session; dropped afterwards."""
    server = _server_url()
    name = f"va_test_{os.getpid()}_{secrets.token_hex(3)}"
    url = create_database(server, name)
    upgrade(url)
    yield url
    drop_database(server, name)


_KEEP = {"alembic_version"}


@pytest.fixture
def clean_db(database_url: str) -> str:
    """The session database with every table emptied (schema kept)."""
    with psycopg.connect(database_url, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT schemaname, tablename FROM pg_tables "
            "WHERE schemaname NOT IN ('pg_catalog', 'information_schema')"
        ).fetchall()
        tables = [f'"{s}"."{t}"' for s, t in rows if t not in _KEEP]
        if tables:
            conn.execute(f"TRUNCATE {', '.join(tables)} RESTART IDENTITY CASCADE")
    return database_url


@pytest.fixture
async def engine(clean_db: str) -> AsyncIterator[AsyncEngine]:
    """An async engine on a clean database."""
    eng = make_engine(clean_db, pool_size=5, max_overflow=5)
    yield eng
    await eng.dispose()
