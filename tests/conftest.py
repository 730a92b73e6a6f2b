"""Shared fixtures: a real PostgreSQL database per test session, cleaned per test."""

from __future__ import annotations

import os
import secrets
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import psycopg
import pytest
from sqlalchemy.ext.asyncio import AsyncEngine

from app.db import make_engine, plain_url, start_embedded_postgres, upgrade


def _server_url() -> str:
    url = os.environ.get("TEST_DATABASE_URL") or os.environ.get("DATABASE_URL")
    if url:
        return plain_url(url)
    data_dir = Path(tempfile.gettempdir()) / "voice-agent-test-pg"
    return start_embedded_postgres(data_dir)


def _with_dbname(url: str, dbname: str) -> str:
    # Works for both host/port URLs and socket URLs (`...@/postgres?host=/path`).
    info = psycopg.conninfo.conninfo_to_dict(url)
    info["dbname"] = dbname
    return psycopg.conninfo.make_conninfo(**{k: str(v) for k, v in info.items()})


def _as_url(conninfo: str) -> str:
    info = psycopg.conninfo.conninfo_to_dict(conninfo)
    user = info.get("user", "postgres")
    password = info.get("password")
    auth = f"{user}:{password}@" if password else f"{user}@"
    host = str(info.get("host", "127.0.0.1"))
    port = info.get("port", "5432")
    dbname = info["dbname"]
    if host.startswith("/"):
        return f"postgresql://{auth}/{dbname}?host={host}&port={port}"
    return f"postgresql://{auth}{host}:{port}/{dbname}"


@pytest.fixture(scope="session")
def database_url() -> Iterator[str]:
    """A fresh database, migrated to head, for this test session; dropped afterwards."""
    server = _server_url()
    name = f"va_test_{os.getpid()}_{secrets.token_hex(3)}"
    admin = _with_dbname(server, "postgres")
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    url = _as_url(_with_dbname(server, name))
    upgrade(url)
    yield url
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


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
