"""The demo system of record: a small restaurant-booking service with idempotency keys.

It is a separate service (`voice-agent sor`) with its own tables in the Postgres schema
`sor`. Mutations require an `Idempotency-Key`; the key is reserved in its own committed
transaction before any work, so "what happened to key K" (GET /idempotency/{key}) can
always tell applied, in flight and never-seen apart. Faults can be injected per test
(POST /_faults) to exercise every failure mode the executor must survive.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import hashlib
import hmac
import json
import logging
import os
import secrets
import signal
import socket
import sys
from collections.abc import Awaitable, Callable, Sequence
from datetime import date as Date
from typing import Any

import httpx
import uvicorn
from fastapi import Depends, FastAPI, Header, HTTPException, Request
from fastapi.responses import JSONResponse
from psycopg import AsyncConnection, DataError
from psycopg.rows import dict_row
from psycopg.types.json import Jsonb
from psycopg_pool import AsyncConnectionPool
from pydantic import BaseModel, Field, ValidationError

from telephony.quiet_server import QuietServer
from tools.callback import CallbackReport, signed_headers
from tools.restaurant.protocol import (
    CALLBACK_URL_HEADER,
    IDEMPOTENCY_HEADER,
    REPLAYED_HEADER,
    Availability,
    Booking,
    BookingRequest,
    ErrorBody,
    KeyStatus,
    PendingBody,
)

log = logging.getLogger(__name__)

SEATS_PER_SLOT = 40
# Booking references are read out on the phone: upper case, no look-alike characters.
_REF_ALPHABET = "ABCDEFGHJKLMNPQRSTUVWXYZ23456789"


# Idempotency keys are short ids (ours are ~50 chars); the primary-key index caps entries.
MAX_IDEMPOTENCY_KEY_CHARS = 255


def new_booking_id() -> str:
    """A fresh, speakable booking reference such as `BK7QX2MHN4`."""
    return "BK" + "".join(secrets.choice(_REF_ALPHABET) for _ in range(8))


_SCHEMA_SQL = """
CREATE SCHEMA IF NOT EXISTS sor;
CREATE TABLE IF NOT EXISTS sor.bookings (
    id text PRIMARY KEY,
    date date NOT NULL,
    time text NOT NULL,
    party_size int NOT NULL,
    name text NOT NULL,
    status text NOT NULL DEFAULT 'confirmed',
    created_at timestamptz NOT NULL DEFAULT now()
);
CREATE TABLE IF NOT EXISTS sor.idempotency (
    key text PRIMARY KEY,
    fingerprint text NOT NULL,
    state text NOT NULL,
    status_code int,
    response jsonb,
    callback_url text,
    created_at timestamptz NOT NULL DEFAULT now(),
    updated_at timestamptz NOT NULL DEFAULT now()
);
CREATE TABLE IF NOT EXISTS sor.effects (
    id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    kind text NOT NULL,
    booking_id text NOT NULL,
    idempotency_key text NOT NULL,
    at timestamptz NOT NULL DEFAULT now()
);
"""


class Faults(BaseModel):
    """Failure modes for upcoming mutations. Counters are consumed one per mutation."""

    latency_s: float = Field(default=0.0, ge=0.0)  # added to every request
    fail_before_commit: int = Field(default=0, ge=0)  # answer 500, nothing applied
    lose_response: int = Field(default=0, ge=0)  # apply and commit, then never answer
    hang: int = Field(default=0, ge=0)  # stall before applying, until released
    async_mode: bool = False  # answer 202, apply later, report through the callback URL
    async_delay_s: float = Field(default=0.05, ge=0.0)
    # With async_mode: apply (and report) only once released, not after the delay.
    async_hold: bool = False
    # Send every callback report this many extra times (a provider that retries blindly).
    duplicate_callbacks: int = Field(default=0, ge=0)
    # Upper bound of a hang, so a forgotten release cannot wedge the service.
    hang_max_s: float = Field(default=60.0, gt=0.0)


class SideEffects(BaseModel):
    """What the SOR actually did, for "exactly one" assertions."""

    bookings_inserted: int
    cancellations: int


class _DomainError(Exception):
    def __init__(self, status: int, body: ErrorBody) -> None:
        super().__init__(body.message)
        self.status = status
        self.body = body


def _error(status: int, code: Any, message: str = "") -> JSONResponse:
    return JSONResponse(ErrorBody(code=code, message=message).model_dump(), status_code=status)


def _fingerprint(path: str, body: dict[str, Any]) -> str:
    canonical = json.dumps({"path": path, "body": body}, sort_keys=True, default=str)
    return hashlib.sha256(canonical.encode()).hexdigest()


def _booking_from_row(row: dict[str, Any]) -> Booking:
    return Booking(
        id=row["id"],
        date=row["date"],
        time=row["time"],
        party_size=row["party_size"],
        name=row["name"],
        status=row["status"],
    )


_Apply = Callable[[AsyncConnection[Any], str], Awaitable[tuple[int, Booking]]]


class SystemOfRecord:
    """The SOR HTTP service, runnable in-process (tests) or as `voice-agent sor`."""

    def __init__(
        self,
        database_url: str,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        faults: Faults | None = None,
        callback_secret: str | None = None,
        seats_per_slot: int = SEATS_PER_SLOT,
        control_token: str | None = None,
    ) -> None:
        self.database_url = database_url
        self.host = host
        self.port = port
        self.faults = faults or Faults()
        self.callback_secret = callback_secret
        # The control endpoints (fault modes, stats) answer only to this bearer token: with
        # them anyone could make the SOR POST a validly signed "committed" report.
        self.control_token = control_token or secrets.token_urlsafe(24)
        self.seats_per_slot = seats_per_slot
        self._pool: AsyncConnectionPool | None = None
        self._server: QuietServer | None = None
        self._serve_task: asyncio.Task[None] | None = None
        self._background: set[asyncio.Task[None]] = set()
        self._release = asyncio.Event()
        self._http: httpx.AsyncClient | None = None
        # The W3C traceparent each booking request carried, by idempotency key.
        self.traceparents: dict[str, str] = {}
        self.app = self._build_app()

    # -- lifecycle -----------------------------------------------------------------

    @property
    def url(self) -> str:
        """Base URL of the running service."""
        return f"http://{self.host}:{self.port}"

    async def start(self) -> None:
        """Create the schema, open the pool and start serving."""
        # The port first: a taken one fails before anything is opened. proto=IPPROTO_TCP:
        # asyncio only sets TCP_NODELAY on accepted sockets whose proto says TCP; without
        # it, Nagle + delayed ACK add ~40 ms to every response.
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((self.host, self.port))
        except OSError:
            sock.close()
            raise
        self.port = sock.getsockname()[1]
        self._pool = AsyncConnectionPool(
            self.database_url, min_size=1, max_size=10, open=False, timeout=10.0
        )
        await self._pool.open(wait=True, timeout=10.0)
        async with self._pool.connection() as conn:
            # Two SOR processes starting at once must not race on CREATE ... IF NOT EXISTS.
            await conn.execute("SELECT pg_advisory_xact_lock(hashtext('sor.schema'))")
            await conn.execute(_SCHEMA_SQL)
        self._http = httpx.AsyncClient(timeout=httpx.Timeout(5.0))
        config = uvicorn.Config(
            self.app,
            log_level="warning",
            lifespan="off",
            access_log=False,
            timeout_graceful_shutdown=2,
        )
        self._server = QuietServer(config)
        self._serve_task = asyncio.create_task(self._server.serve(sockets=[sock]))
        async with asyncio.timeout(10.0):
            while not self._server.started:
                if self._serve_task.done():
                    await self._serve_task
                    raise RuntimeError("system of record failed to start")
                await asyncio.sleep(0.01)
        log.info("system of record listening on %s", self.url)

    async def stop(self) -> None:
        """Release hung requests, stop serving, finish background work, close the pool."""
        self._release.set()
        if self._server is not None and self._serve_task is not None:
            self._server.should_exit = True
            with contextlib.suppress(Exception):
                async with asyncio.timeout(10.0):
                    await self._serve_task
        for task in list(self._background):
            task.cancel()
        if self._background:
            await asyncio.gather(*self._background, return_exceptions=True)
        if self._http is not None:
            await self._http.aclose()
        if self._pool is not None:
            await self._pool.close()

    async def __aenter__(self) -> SystemOfRecord:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    # -- test hooks ------------------------------------------------------------------

    def set_faults(self, faults: Faults) -> None:
        """Replace the fault plan (also reachable as POST /_faults)."""
        self.faults = faults
        self._release = asyncio.Event()

    def release(self) -> None:
        """Let every hung request continue (also POST /_faults/release)."""
        self._release.set()

    async def side_effects(self, idempotency_keys: Sequence[str] | None = None) -> SideEffects:
        """Bookings actually inserted and cancellations actually applied (only those of
        `idempotency_keys`, when given)."""
        query = (
            "SELECT count(*) FILTER (WHERE kind = 'insert'), "
            "count(*) FILTER (WHERE kind = 'cancel') FROM sor.effects"
        )
        async with self._conn() as conn:
            if idempotency_keys is None:
                cur = await conn.execute(query)
            else:
                keys = list(idempotency_keys)
                cur = await conn.execute(query + " WHERE idempotency_key = ANY(%s)", (keys,))
            row = await cur.fetchone()
        assert row is not None
        return SideEffects(bookings_inserted=row[0], cancellations=row[1])

    # -- internals -------------------------------------------------------------------

    def _conn(self) -> contextlib.AbstractAsyncContextManager[AsyncConnection[Any]]:
        if self._pool is None:
            raise RuntimeError("system of record is not started")
        return self._pool.connection()

    def _take_fault(self) -> str | None:
        """Consume one mutation fault, in a fixed order of precedence."""
        f = self.faults
        for name in ("fail_before_commit", "hang", "lose_response"):
            left = getattr(f, name)
            if left > 0:
                setattr(f, name, left - 1)
                return name
        return "async" if f.async_mode else None

    async def _wait_released(self) -> None:
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(self.faults.hang_max_s):
                await self._release.wait()

    async def _mutate(
        self,
        key: str | None,
        path: str,
        body: dict[str, Any],
        callback_url: str | None,
        apply: _Apply,
    ) -> JSONResponse:
        if not key:
            return _error(400, "missing_idempotency_key", f"{IDEMPOTENCY_HEADER} is required")
        if len(key) > MAX_IDEMPOTENCY_KEY_CHARS:
            # A key past the primary-key index's row limit failed the insert with a 500.
            return _error(400, "invalid", f"{IDEMPOTENCY_HEADER} is too long")
        fingerprint = _fingerprint(path, body)
        async with self._conn() as conn:
            cur = await conn.execute(
                "INSERT INTO sor.idempotency (key, fingerprint, state) "
                "VALUES (%s, %s, 'in_progress') ON CONFLICT (key) DO NOTHING RETURNING key",
                (key, fingerprint),
            )
            reserved = await cur.fetchone() is not None
            if not reserved:
                cur = conn.cursor(row_factory=dict_row)
                await cur.execute("SELECT * FROM sor.idempotency WHERE key = %s", (key,))
                existing = await cur.fetchone()
        if not reserved:
            assert existing is not None
            if existing["fingerprint"] != fingerprint:
                return _error(409, "idempotency_conflict", "key reused with a different body")
            if existing["state"] == "completed":
                return JSONResponse(
                    existing["response"],
                    status_code=existing["status_code"],
                    headers={REPLAYED_HEADER: "true"},
                )
            if existing["state"] == "pending":
                return JSONResponse(PendingBody(idempotency_key=key).model_dump(), status_code=202)
            return _error(409, "in_progress", "a request with this key is still in flight")

        fault = self._take_fault()
        if fault == "fail_before_commit":
            async with self._conn() as conn:
                await conn.execute("DELETE FROM sor.idempotency WHERE key = %s", (key,))
            return _error(500, "injected_failure", "failed before commit; nothing applied")
        if fault == "hang":
            await self._wait_released()
        if fault == "async":
            async with self._conn() as conn:
                await conn.execute(
                    "UPDATE sor.idempotency SET state = 'pending', callback_url = %s, "
                    "updated_at = now() WHERE key = %s",
                    (callback_url, key),
                )
            task = asyncio.create_task(self._complete_later(key, callback_url, apply))
            self._background.add(task)
            task.add_done_callback(self._background.discard)
            return JSONResponse(PendingBody(idempotency_key=key).model_dump(), status_code=202)

        status, payload = await self._apply_and_record(key, apply)
        if fault == "lose_response":
            # Committed; the caller never hears about it (it times out).
            await self._wait_released()
        return JSONResponse(payload, status_code=status)

    async def _apply_and_record(self, key: str, apply: _Apply) -> tuple[int, dict[str, Any]]:
        """Apply the mutation and complete its key in one transaction."""
        async with self._conn() as conn:
            try:
                async with conn.transaction():
                    status, booking = await apply(conn, key)
                    payload: dict[str, Any] = booking.model_dump(mode="json")
                    await self._complete_key(conn, key, status, payload)
            except _DomainError as exc:
                status, payload = exc.status, exc.body.model_dump()
                await self._complete_key(conn, key, status, payload)
            except DataError as exc:
                # Input Postgres cannot store (a NUL byte): a final 422 for this key. Raising
                # instead answered 500 and left the key `in_progress` for good.
                status = 422
                payload = ErrorBody(code="invalid", message=str(exc)[:300]).model_dump()
                await self._complete_key(conn, key, status, payload)
        return status, payload

    @staticmethod
    async def _complete_key(
        conn: AsyncConnection[Any], key: str, status: int, payload: dict[str, Any]
    ) -> None:
        await conn.execute(
            "UPDATE sor.idempotency SET state = 'completed', status_code = %s, response = %s, "
            "updated_at = now() WHERE key = %s",
            (status, Jsonb(payload), key),
        )

    async def _complete_later(self, key: str, callback_url: str | None, apply: _Apply) -> None:
        if self.faults.async_hold:
            await self._wait_released()
        else:
            await asyncio.sleep(self.faults.async_delay_s)
        status, payload = await self._apply_and_record(key, apply)
        if not callback_url:
            return
        ok = 200 <= status < 300
        report = CallbackReport(
            idempotency_key=key,
            status="committed" if ok else "failed",
            sequence=1,
            result=Booking.model_validate(payload).model_dump(mode="json") if ok else None,
            reference=str(payload.get("id")) if ok else None,
            error=None if ok else str(payload.get("code")),
        )
        for _ in range(1 + self.faults.duplicate_callbacks):
            await self.send_callback(callback_url, report)

    async def send_callback(self, url: str, report: CallbackReport) -> int | None:
        """POST a signed report; a few attempts, each with a timeout. Returns the status."""
        assert self._http is not None
        body = report.model_dump_json().encode()
        headers = {"content-type": "application/json"}
        for attempt in range(3):
            if self.callback_secret:
                # Standard Webhooks: one id for every retry of this report, a fresh timestamp.
                headers |= signed_headers(self.callback_secret, body, report.message_id())
            try:
                resp = await self._http.post(url, content=body, headers=headers)
            except httpx.HTTPError as exc:
                log.warning("callback to %s failed (attempt %d): %s", url, attempt + 1, exc)
            else:
                if resp.status_code < 500:
                    return resp.status_code
            await asyncio.sleep(0.2 * 2**attempt)
        return None

    # -- domain ----------------------------------------------------------------------

    async def _seats_taken(self, conn: AsyncConnection[Any], day: Date, time: str) -> int:
        cur = await conn.execute(
            "SELECT coalesce(sum(party_size), 0) FROM sor.bookings "
            "WHERE date = %s AND time = %s AND status = 'confirmed'",
            (day, time),
        )
        row = await cur.fetchone()
        assert row is not None
        return int(row[0])

    def _insert_booking(self, req: BookingRequest) -> _Apply:
        async def apply(conn: AsyncConnection[Any], key: str) -> tuple[int, Booking]:
            # One slot at a time, so two bookings cannot both take the last seats.
            await conn.execute(
                "SELECT pg_advisory_xact_lock(hashtext(%s))", (f"{req.date}|{req.time}",)
            )
            taken = await self._seats_taken(conn, req.date, req.time)
            if taken + req.party_size > self.seats_per_slot:
                raise _DomainError(
                    422, ErrorBody(code="no_availability", message="no table for that slot")
                )
            booking = Booking(id=new_booking_id(), status="confirmed", **req.model_dump())
            await conn.execute(
                "INSERT INTO sor.bookings (id, date, time, party_size, name, status) "
                "VALUES (%s, %s, %s, %s, %s, 'confirmed')",
                (booking.id, booking.date, booking.time, booking.party_size, booking.name),
            )
            await conn.execute(
                "INSERT INTO sor.effects (kind, booking_id, idempotency_key) "
                "VALUES ('insert', %s, %s)",
                (booking.id, key),
            )
            return 201, booking

        return apply

    @staticmethod
    def _cancel_booking(booking_id: str) -> _Apply:
        async def apply(conn: AsyncConnection[Any], key: str) -> tuple[int, Booking]:
            cur = conn.cursor(row_factory=dict_row)
            await cur.execute("SELECT * FROM sor.bookings WHERE id = %s FOR UPDATE", (booking_id,))
            row = await cur.fetchone()
            if row is None:
                raise _DomainError(404, ErrorBody(code="not_found", message="no such booking"))
            if row["status"] != "cancelled":
                await conn.execute(
                    "UPDATE sor.bookings SET status = 'cancelled' WHERE id = %s", (booking_id,)
                )
                await conn.execute(
                    "INSERT INTO sor.effects (kind, booking_id, idempotency_key) "
                    "VALUES ('cancel', %s, %s)",
                    (booking_id, key),
                )
                row["status"] = "cancelled"
            return 200, _booking_from_row(row)

        return apply

    def _build_app(self) -> FastAPI:
        app = FastAPI(title="Demo system of record", openapi_url=None)
        sor = self

        @app.exception_handler(DataError)
        async def unstorable(request: Request, exc: DataError) -> JSONResponse:
            # A path or query value Postgres refuses (a NUL byte) is bad input, not a 500.
            return _error(422, "invalid", str(exc)[:300])

        async def latency() -> None:
            if sor.faults.latency_s > 0:
                await asyncio.sleep(sor.faults.latency_s)

        @app.post("/bookings")
        async def create_booking(
            request: Request,
            idempotency_key: str | None = Header(default=None, alias=IDEMPOTENCY_HEADER),
            callback_url: str | None = Header(default=None, alias=CALLBACK_URL_HEADER),
        ) -> JSONResponse:
            await latency()
            if idempotency_key and (parent := request.headers.get("traceparent")):
                # As a real system's access log would: which trace each request belonged to.
                sor.traceparents[idempotency_key[:200]] = parent[:128]
            try:
                raw = await request.json()
                req = BookingRequest.model_validate(raw)
            except (ValueError, ValidationError, RecursionError) as exc:  # deep `[[[`: junk
                return _error(422, "invalid", str(exc)[:300])
            return await sor._mutate(
                idempotency_key,
                "/bookings",
                req.model_dump(mode="json"),
                callback_url,
                sor._insert_booking(req),
            )

        @app.post("/bookings/{booking_id}/cancel")
        async def cancel_booking(
            booking_id: str,
            idempotency_key: str | None = Header(default=None, alias=IDEMPOTENCY_HEADER),
            callback_url: str | None = Header(default=None, alias=CALLBACK_URL_HEADER),
        ) -> JSONResponse:
            await latency()
            return await sor._mutate(
                idempotency_key,
                f"/bookings/{booking_id}/cancel",
                {},
                callback_url,
                sor._cancel_booking(booking_id),
            )

        @app.get("/bookings/{booking_id}")
        async def get_booking(booking_id: str) -> JSONResponse:
            await latency()
            async with sor._conn() as conn:
                cur = conn.cursor(row_factory=dict_row)
                await cur.execute("SELECT * FROM sor.bookings WHERE id = %s", (booking_id,))
                row = await cur.fetchone()
            if row is None:
                return _error(404, "not_found", "no such booking")
            return JSONResponse(_booking_from_row(row).model_dump(mode="json"))

        @app.get("/availability")
        async def availability(date: Date, time: str, party_size: int) -> JSONResponse:
            await latency()
            async with sor._conn() as conn:
                taken = await sor._seats_taken(conn, date, time)
            left = max(sor.seats_per_slot - taken, 0)
            answer = Availability(
                date=date,
                time=time,
                party_size=party_size,
                available=party_size <= left,
                seats_left=left,
            )
            return JSONResponse(answer.model_dump(mode="json"))

        @app.get("/idempotency/{key}")
        async def key_status(key: str) -> JSONResponse:
            await latency()
            async with sor._conn() as conn:
                cur = conn.cursor(row_factory=dict_row)
                await cur.execute("SELECT * FROM sor.idempotency WHERE key = %s", (key,))
                row = await cur.fetchone()
            if row is None:
                status = KeyStatus(key=key, state="not_found")
            elif row["state"] != "completed":
                status = KeyStatus(key=key, state="in_progress")
            elif 200 <= row["status_code"] < 300:
                status = KeyStatus(
                    key=key,
                    state="completed",
                    status_code=row["status_code"],
                    result=Booking.model_validate(row["response"]),
                )
            else:
                status = KeyStatus(
                    key=key,
                    state="completed",
                    status_code=row["status_code"],
                    error=ErrorBody.model_validate(row["response"]),
                )
            return JSONResponse(status.model_dump(mode="json"))

        def control(authorization: str | None = Header(default=None)) -> None:
            expected = f"Bearer {sor.control_token}".encode()
            given = (authorization or "").encode("utf-8", "surrogatepass")
            if not hmac.compare_digest(expected, given):
                raise HTTPException(401, "control endpoints need the SOR control token")

        guarded = [Depends(control)]

        @app.get("/_faults", dependencies=guarded)
        async def get_faults() -> Faults:
            return sor.faults

        @app.post("/_faults", dependencies=guarded)
        async def set_faults(faults: Faults) -> Faults:
            sor.set_faults(faults)
            return sor.faults

        @app.post("/_faults/release", dependencies=guarded)
        async def release() -> dict[str, bool]:
            sor.release()
            return {"released": True}

        @app.get("/_stats", dependencies=guarded)
        async def stats() -> SideEffects:
            return await sor.side_effects()

        @app.get("/healthz")
        async def healthz() -> dict[str, str]:
            return {"status": "ok"}

        return app


def run_sor(
    host: str, port: int, database_url: str | None, callback_secret: str | None = None
) -> int:
    """`voice-agent sor`: serve the system of record until SIGINT/SIGTERM."""
    url = database_url or os.environ.get("SOR_DATABASE_URL") or os.environ.get("DATABASE_URL")
    if not url:
        log.error("the system of record needs a database: pass --database-url")
        return 2
    secret = callback_secret or os.environ.get("SOR_CALLBACK_SECRET")
    token = os.environ.get("SOR_CONTROL_TOKEN") or secrets.token_urlsafe(24)

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        sor = SystemOfRecord(url, host=host, port=port, callback_secret=secret, control_token=token)
        async with sor:
            print(f"system of record listening on {sor.url}", flush=True)
            if not os.environ.get("SOR_CONTROL_TOKEN"):
                # To the terminal only, never into the log stream.
                print(f"control token (Authorization: Bearer ...): {token}", flush=True)
            await stop.wait()

    try:
        asyncio.run(main())
    except OSError as exc:
        if exc.errno != errno.EADDRINUSE:
            raise
        print(
            f"voice-agent sor: port {port} on {host} is already in use (another system of "
            "record?): stop that process or choose another port with --port",
            file=sys.stderr,
        )
        return 2
    return 0
