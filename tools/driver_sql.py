"""A call's hot statements run straight on the pooled connection's psycopg connection.

SQLAlchemy's async engine costs, per execution, more CPU than the driver does: a greenlet
switch in and out, the compiled cache's key and lookup, an execution context, its result's
metadata (psycopg rebuilds `cursor.description`, one object a column, each time SQLAlchemy
reads it, several times a statement) and the rows adapted. For the statements every call runs
(its row inserted, moved and ended, its events written) that was about 40% of the statement's
CPU (bench/driver_statements.py: 0.38-0.44 -> 0.24-0.25 ms a row statement). Here a
statement is compiled once, by SQLAlchemy for the engine's dialect (the same SQL text and
parameter names SQLAlchemy sends), and run with psycopg on the connection SQLAlchemy checked
out: in its transaction, or its autocommit, as the caller opened it.

SQLAlchemy's `before_cursor_execute` / `after_cursor_execute` listeners, when there are any,
see these statements too (with no execution context). Errors go through SQLAlchemy's own
handling of a failed execution (`Connection._handle_dbapi_exception`): a `DBAPIError` subclass
is raised as before (IntegrityError, DataError, OperationalError...), a dropped connection
invalidates it and the pool, a cancelled statement invalidates its connection.
"""

from __future__ import annotations

import json
import traceback
import uuid
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy.engine import Dialect
from sqlalchemy.ext.asyncio import AsyncConnection
from sqlalchemy.util.concurrency import greenlet_spawn


@dataclass(frozen=True, slots=True)
class DriverStatement:
    """One statement compiled for the driver: its SQL, the parameters it always takes (a
    literal IN list, a column's scalar default), the type adaptations of the others, and the
    names of its result columns (None: from the result)."""

    sql: str
    fixed: dict[str, Any]
    processors: tuple[tuple[str, Any], ...]
    names: tuple[str, ...] | None

    def params(self, given: Mapping[str, Any]) -> dict[str, Any]:
        params = {**self.fixed, **given}
        for name, process in self.processors:
            if name in params:
                params[name] = process(params[name])
        return params


_COMPILED: dict[tuple[int, str], DriverStatement] = {}
MAX_COMPILED = 512  # statement shapes kept compiled (the hot ones are a few dozen)


def compile_for(statement: Any, dialect: Dialect) -> DriverStatement:
    """`statement` (a Core statement or `text()`) compiled once for `dialect`'s driver."""
    key = (id(statement), dialect.name + dialect.driver)
    found = _COMPILED.get(key)
    if found is not None:
        return found
    compiled = statement.compile(dialect=dialect)
    # The parameters as SQLAlchemy sends them: a literal IN list expanded (one parameter a
    # value, its SQL rendered once here), a literal None included (`.values(x=None)`), the
    # caller's own values left to the call.
    required = {b.key for b in compiled.binds.values() if b.required}
    expanded = compiled._process_parameters_for_postcompile(compiled.construct_params(_check=False))
    fixed = {name: value for name, value in expanded.parameters.items() if name not in required}
    for column in [*compiled.insert_prefetch, *compiled.update_prefetch]:
        default = column.default if compiled.isinsert else column.onupdate
        if default is None or not default.is_scalar:
            raise ValueError(f"{column}: only scalar Python defaults run on the driver")
        fixed[column.key] = default.arg
    processors = tuple(
        (name, process)
        for name, process in compiled._bind_processors.items()
        if process is not None and not isinstance(name, tuple)
    )
    result_columns = compiled._result_columns
    for column in result_columns:
        if column[3].result_processor(dialect, None) is not None:
            raise ValueError(f"{column[0]}: results needing SQLAlchemy's processing")
    names = tuple(c[0] for c in result_columns) if result_columns else None
    found = DriverStatement(expanded.statement, fixed, processors, names)
    if len(_COMPILED) >= MAX_COMPILED:
        # Statements built per call would otherwise be kept for ever: start again (both
        # together, so no id outlives its statement here).
        _COMPILED.clear()
        _KEEP.clear()
    _COMPILED[key] = found
    # The statement object stays referenced by the caller's module (built once).
    _KEEP.append(statement)
    return found


_KEEP: list[Any] = []  # the compiled statements' objects: their ids stay theirs


async def fetch(
    conn: AsyncConnection, statement: Any, params: Mapping[str, Any] | None = None
) -> list[dict[str, Any]]:
    """Run `statement` on `conn`'s driver connection; its rows as dicts by column name."""
    rows, names = await _run(conn, statement, params or {})
    return [dict(zip(names, row, strict=True)) for row in rows]


class Row(dict[str, Any]):
    """A row by column name whose columns are also its attributes (`row.id`), as
    SQLAlchemy's rows: for callers written against those."""

    __slots__ = ()

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


async def fetch_rows(
    conn: AsyncConnection, statement: Any, params: Mapping[str, Any] | None = None
) -> list[Row]:
    """`fetch`'s rows as `Row`s."""
    rows, names = await _run(conn, statement, params or {})
    return [Row(zip(names, row, strict=True)) for row in rows]


def json_rows(rows: Iterable[Mapping[str, Any]]) -> str:
    """Rows as one JSON document, for a statement that reads them with
    `jsonb_to_recordset` / `jsonb_populate_recordset` (one parameter whatever the batch, made
    by the json module's C encoder: an array parameter a column had every element dumped by
    psycopg in Python). UUIDs go as text, times in ISO 8601 with their offset (which
    PostgreSQL reads whatever the session's DateStyle)."""
    return json.dumps(list(rows), default=_json_value, separators=(",", ":"))


def _json_value(value: Any) -> Any:
    if isinstance(value, uuid.UUID):
        return str(value)
    if isinstance(value, datetime):
        return value.isoformat()
    raise TypeError(f"{type(value).__name__} is not a column value")


async def fetch_tuples(
    conn: AsyncConnection, statement: Any, params: Mapping[str, Any] | None = None
) -> list[tuple[Any, ...]]:
    """`fetch`'s rows as tuples, in the statement's column order."""
    rows, _ = await _run(conn, statement, params or {})
    return rows


async def execute(
    conn: AsyncConnection, statement: Any, params: Mapping[str, Any] | None = None
) -> None:
    """Run `statement` on `conn`'s driver connection, its rows (if any) read and dropped."""
    await _run(conn, statement, params or {})


async def _run(
    conn: AsyncConnection, statement: Any, given: Mapping[str, Any]
) -> tuple[list[tuple[Any, ...]], Sequence[str]]:
    sync = conn.sync_connection
    assert sync is not None  # an open AsyncConnection
    prepared = compile_for(statement, sync.dialect)
    params = prepared.params(given)
    if sync.invalidated:
        # Reconnect as SQLAlchemy would before its next statement.
        await conn.get_raw_connection()
    driver = sync.connection.driver_connection
    assert driver is not None
    events = sync._has_events or sync.engine._has_events
    try:
        cursor = driver.cursor()
        try:
            if events:  # listeners see the statement as from SQLAlchemy (no context)
                for fn in sync.dispatch.before_cursor_execute:
                    fn(sync, cursor, prepared.sql, params, None, False)
            await cursor.execute(prepared.sql, params)
            if events:
                for fn in sync.dispatch.after_cursor_execute:
                    fn(sync, cursor, prepared.sql, params, None, False)
            description = cursor.pgresult
            rows: list[tuple[Any, ...]] = (
                await cursor.fetchall() if description is not None and description.nfields else []
            )
            names: Sequence[str] = prepared.names or (
                [c.name for c in cursor.description] if cursor.description else []
            )
        finally:
            await cursor.close()
    except BaseException as exc:
        # SQLAlchemy's handling of a failed execution: always raises.
        try:
            await greenlet_spawn(_handle, sync, exc, prepared.sql, params)
        except BaseException as raised:
            # Its frame keeps the exception it raises as a local, and the exception's traceback
            # keeps the frame: a reference cycle holding the failed statement's frames, rows
            # and exceptions until a full collection. The frames' locals are not needed for the
            # traceback's text.
            traceback.clear_frames(raised.__traceback__)
            raise
        raise  # pragma: no cover  (not reached)
    return rows, names


def _handle(sync: Any, exc: BaseException, sql: str, params: dict[str, Any]) -> None:
    """SQLAlchemy's handling of `exc` from an execution on `sync`, as if from its own (it
    reads the exception being handled: raised again here, in its greenlet)."""
    try:
        raise exc
    except BaseException as again:
        sync._handle_dbapi_exception(again, sql, params, None, None)
