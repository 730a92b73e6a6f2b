"""Database plumbing: URL resolution, the embedded PostgreSQL, engines and migrations."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

from sqlalchemy import event
from sqlalchemy.exc import DisconnectionError
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

from app import embedded_db
from app.errors import StartupError
from tools.autocommit import PING_AFTER_IDLE_S
from tools.pg_url import plain_url

log = logging.getLogger(__name__)

_MIGRATIONS = Path(__file__).parent / "migrations"


def start_embedded_postgres(data_dir: Path) -> str:
    """Start (or join) the embedded PostgreSQL in `data_dir/pg` and return its URL."""
    return embedded_db.start(data_dir)


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
    """An async SQLAlchemy engine over psycopg 3.

    Connections are pinged at checkout only once idle for `PING_AFTER_IDLE_S` (a stale one is
    replaced, as `pool_pre_ping` would): a connection back in the pool a moment ago is as
    alive as it was then, and pinging it cost a round trip on every checkout (a call's
    set-up and end take a dozen). A server that went away meanwhile fails the first
    statement instead; SQLAlchemy then sees the disconnect and invalidates the whole pool,
    and our writers retry (the event writer, the worker, the sweeps)."""
    kwargs.setdefault("pool_size", 10)
    kwargs.setdefault("max_overflow", 20)
    ping_after_idle_s = kwargs.pop("ping_after_idle_s", PING_AFTER_IDLE_S)
    if kwargs.get("pool_pre_ping") or ping_after_idle_s is None:
        return create_async_engine(sqlalchemy_url(url), **kwargs)
    engine = create_async_engine(sqlalchemy_url(url), **kwargs)
    _ping_when_idle(engine, ping_after_idle_s)
    return engine


def _ping_when_idle(engine: AsyncEngine, idle_s: float) -> None:
    dialect = engine.sync_engine.dialect
    pool = engine.sync_engine.pool

    @event.listens_for(pool, "checkin")
    def _returned(dbapi_connection: Any, record: Any) -> None:
        record.info["idle_since"] = time.monotonic()

    @event.listens_for(pool, "checkout")
    def _maybe_ping(dbapi_connection: Any, record: Any, proxy: Any) -> None:
        since = record.info.get("idle_since")
        if since is None or time.monotonic() - since < idle_s:
            return  # new, or back in the pool a moment ago
        try:
            dialect.do_ping(dbapi_connection)
        except dialect.loaded_dbapi.Error as exc:
            # The pool discards this connection and checks out another (a new one).
            raise DisconnectionError(f"stale pooled connection: {exc}") from exc


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
    import sqlalchemy as sa
    from alembic import command

    try:
        command.upgrade(alembic_config(url), revision)
    except sa.exc.OperationalError as exc:
        raise StartupError(f"cannot reach the database: {_first_line(exc.orig or exc)}") from exc


def head_revision() -> str:
    """The newest migration this code knows."""
    from alembic.script import ScriptDirectory

    head = ScriptDirectory.from_config(alembic_config("postgresql://unused/x")).get_current_head()
    assert head is not None
    return head


def database_revision(url: str) -> str | None:
    """The migration the database is at (None: never migrated). Blocking."""
    import sqlalchemy as sa
    from alembic.runtime.migration import MigrationContext

    engine = sa.create_engine(sqlalchemy_url(url), poolclass=sa.pool.NullPool)
    try:
        with engine.connect() as conn:
            return MigrationContext.configure(conn).get_current_revision()
    except sa.exc.OperationalError as exc:
        raise StartupError(f"cannot reach the database: {_first_line(exc.orig or exc)}") from exc
    finally:
        engine.dispose()


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


def _resolve(revision: str) -> str | None:
    """A revision name (`head`, `base`, `0002`, a unique prefix) as a revision id."""
    from alembic.script import ScriptDirectory
    from alembic.util import CommandError

    if revision == "base":
        return None
    script = ScriptDirectory.from_config(alembic_config("postgresql://unused/x"))
    try:
        found = script.get_revision(revision)
    except CommandError:
        found = None
    if found is None:
        known = ", ".join(r.revision for r in reversed(list(script.walk_revisions())))
        raise StartupError(f"no migration {revision!r}; known: {known} (or head, base)")
    return str(found.revision)


def _order(revision: str | None) -> int:
    """Position of a revision in the (linear) migration chain; base is 0."""
    from alembic.script import ScriptDirectory

    if revision is None:
        return 0
    script = ScriptDirectory.from_config(alembic_config("postgresql://unused/x"))
    chain = [r.revision for r in reversed(list(script.walk_revisions()))]
    if revision not in chain:
        raise StartupError(
            f"the database is at migration {revision}, which this version does not know "
            "(it was migrated by a newer version)"
        )
    return chain.index(revision) + 1


def upgrade_to(url: str, revision: str = "head") -> tuple[str | None, str | None]:
    """Upgrade to `revision`; refuses to go backwards. Returns (before, after). Blocking."""
    target = _resolve(revision)
    before = database_revision(url)
    if _order(before) > _order(target):
        raise StartupError(
            f"the database is at {before}, newer than {target or 'base'}: upgrade never goes "
            f"back; to drop the newer migrations, run `voice-agent db downgrade {revision} --yes`"
        )
    upgrade(url, target or "base")
    return before, database_revision(url)


def downgrade_to(url: str, revision: str) -> tuple[str | None, str | None]:
    """Undo migrations down to `revision` (drops their tables). Returns (before, after)."""
    from alembic import command

    target = _resolve(revision)
    before = database_revision(url)
    if _order(before) < _order(target):
        raise StartupError(
            f"the database is at {before or 'base'}, older than {target}: "
            f"run `voice-agent db upgrade {revision}`"
        )
    command.downgrade(alembic_config(url), target or "base")
    return before, database_revision(url)


def require_migrated(url: str) -> str:
    """The database's revision, if it is this code's head; else a StartupError saying what
    to run. Blocking."""
    current = database_revision(url)
    head = head_revision()
    if current == head:
        return head
    if current is None:
        raise StartupError("the database has no tables yet: run `voice-agent db upgrade` first")
    if _order(current) < _order(head):
        raise StartupError(
            f"the database is at migration {current}, this version needs {head}: "
            "run `voice-agent db upgrade` first"
        )
    raise StartupError(f"the database is at migration {current}, newer than this version ({head})")
