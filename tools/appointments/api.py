"""A stand-in for a clinic's appointment REST API (in memory), with idempotency keys.

Mutations (`POST /appointments`, `POST /appointments/{id}/cancel`) need an
`Idempotency-Key`: the key is reserved before any work, a replay returns the first answer,
the same key with another body is refused, and `GET /requests/{key}` tells applied,
rejected, in flight and never seen apart. `POST /callbacks` (a nurse call-back request) has
neither idempotency nor a lookup, like many real APIs: the tools file declares it with
`on_unknown: ask_staff`. Faults are injected per test (`POST /_faults`) and the effects it
really applied are counted (`GET /_effects`), for "exactly once" assertions.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import hashlib
import json
import logging
import os
import secrets
import signal
import socket
from collections.abc import Callable, Sequence
from typing import Any, Literal

import uvicorn
from fastapi import FastAPI, Header, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from telephony.quiet_server import QuietServer

log = logging.getLogger(__name__)

IDEMPOTENCY_HEADER = "Idempotency-Key"
MAX_KEY_CHARS = 255
SERVICES = ("checkup", "cleaning", "vaccination")
# Half-hour slots, one patient each.
SLOTS = tuple(f"{h:02d}:{m:02d}" for h in range(9, 17) for m in (0, 30))
_REF_ALPHABET = "ABCDEFGHJKLMNPQRSTUVWXYZ23456789"


def _ref(prefix: str) -> str:
    return prefix + "".join(secrets.choice(_REF_ALPHABET) for _ in range(6))


class Faults(BaseModel):
    """Failure modes for upcoming mutations; counters are consumed one per mutation."""

    latency_s: float = Field(default=0.0, ge=0.0)  # added to every request
    fail_before_commit: int = Field(default=0, ge=0)  # answer 503, nothing applied
    lose_response: int = Field(default=0, ge=0)  # apply, then never answer (until released)
    hang: int = Field(default=0, ge=0)  # stall before applying, until released
    hang_max_s: float = Field(default=60.0, gt=0.0)


class Effects(BaseModel):
    """What the API really did."""

    booked: int = 0
    cancelled: int = 0
    callbacks: int = 0
    requests: int = 0  # API requests received (test hooks under /_ not counted)
    most_concurrent: int = 0  # the most API requests it was serving at one moment


class AppointmentRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    date: dt.date
    time: Literal[SLOTS]  # type: ignore[valid-type]
    service: Literal[SERVICES]  # type: ignore[valid-type]
    name: str = Field(min_length=1, max_length=120)
    phone: str | None = Field(default=None, max_length=40)


class CallbackRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1, max_length=120)
    phone: str | None = Field(default=None, max_length=40)
    topic: str = Field(min_length=1, max_length=300)


class _Refused(Exception):
    def __init__(self, status: int, error: str) -> None:
        super().__init__(error)
        self.status = status
        self.error = error


def _error(status: int, error: str, message: str = "") -> JSONResponse:
    return JSONResponse({"error": error, "message": message}, status_code=status)


class AppointmentsApi:
    """The stand-in clinic API, served on `host:port` (0: an ephemeral port)."""

    def __init__(
        self,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        token: str | None = None,
        faults: Faults | None = None,
    ) -> None:
        self.host = host
        self.port = port
        self.token = token
        self.faults = faults or Faults()
        self.appointments: dict[str, dict[str, Any]] = {}
        self.callbacks: dict[str, dict[str, Any]] = {}
        self._keys: dict[str, dict[str, Any]] = {}
        self._effects = Effects()
        self._serving = 0  # requests being answered now
        self._lock = asyncio.Lock()
        self._release = asyncio.Event()
        self._server: QuietServer | None = None
        self._task: asyncio.Task[None] | None = None
        self.app = self._build()

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    async def start(self) -> None:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.host, self.port))
        self.port = sock.getsockname()[1]
        config = uvicorn.Config(
            self.app, log_level="warning", lifespan="off", access_log=False,
            timeout_graceful_shutdown=2,
        )  # fmt: skip
        self._server = QuietServer(config)
        self._task = asyncio.create_task(self._server.serve(sockets=[sock]))
        async with asyncio.timeout(10.0):
            while not self._server.started:
                if self._task.done():
                    await self._task
                    raise RuntimeError("the appointments API failed to start")
                await asyncio.sleep(0.01)

    async def stop(self) -> None:
        self._release.set()
        if self._server is not None and self._task is not None:
            self._server.should_exit = True
            with contextlib.suppress(Exception):
                async with asyncio.timeout(10.0):
                    await self._task

    async def __aenter__(self) -> AppointmentsApi:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    # -- test hooks ------------------------------------------------------------------

    def set_faults(self, faults: Faults) -> None:
        self.faults = faults
        self._release = asyncio.Event()

    def release(self) -> None:
        self._release.set()

    def effects(self) -> Effects:
        return self._effects.model_copy()

    # -- idempotent mutations --------------------------------------------------------

    def _take_fault(self) -> str | None:
        for name in ("fail_before_commit", "hang", "lose_response"):
            left = getattr(self.faults, name)
            if left > 0:
                setattr(self.faults, name, left - 1)
                return name
        return None

    async def _wait_released(self) -> None:
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(self.faults.hang_max_s):
                await self._release.wait()

    async def _mutate(
        self, key: str | None, path: str, body: dict[str, Any], apply: Callable[[], dict[str, Any]]
    ) -> JSONResponse:
        if not key:
            return _error(400, "missing_idempotency_key", f"{IDEMPOTENCY_HEADER} is required")
        if len(key) > MAX_KEY_CHARS:
            return _error(400, "invalid", "the idempotency key is too long")
        fingerprint = hashlib.sha256(
            json.dumps({"path": path, "body": body}, sort_keys=True, default=str).encode()
        ).hexdigest()
        existing = self._keys.get(key)
        if existing is not None:
            if existing["fingerprint"] != fingerprint:
                return _error(422, "idempotency_conflict", "key reused with another request")
            if existing["state"] == "done":
                return JSONResponse(existing["body"], status_code=existing["status"])
            return _error(409, "in_progress", "a request with this key is in flight")
        self._keys[key] = {"fingerprint": fingerprint, "state": "in_progress"}
        fault = self._take_fault()
        if fault == "fail_before_commit":
            del self._keys[key]
            return _error(503, "unavailable", "try again later; nothing was done")
        if fault == "hang":
            await self._wait_released()
        async with self._lock:
            try:
                status, answer = 200, apply()
                status = answer.pop("_status", 200)
            except _Refused as exc:
                status, answer = exc.status, {"error": exc.error}
        self._keys[key] = {
            "fingerprint": fingerprint,
            "state": "done",
            "status": status,
            "body": answer,
        }
        if fault == "lose_response":
            await self._wait_released()  # applied; the caller times out
        return JSONResponse(answer, status_code=status)

    def _book(self, req: AppointmentRequest) -> Callable[[], dict[str, Any]]:
        def apply() -> dict[str, Any]:
            taken = any(
                a["date"] == req.date.isoformat() and a["time"] == req.time
                for a in self.appointments.values()
                if a["status"] == "booked"
            )
            if taken:
                raise _Refused(409, "slot_taken")
            record = {
                "id": _ref("AP"),
                "status": "booked",
                **req.model_dump(mode="json"),
            }
            self.appointments[record["id"]] = record
            self._effects.booked += 1
            return {**record, "_status": 201}

        return apply

    def _cancel(self, appointment_id: str) -> Callable[[], dict[str, Any]]:
        def apply() -> dict[str, Any]:
            record = self.appointments.get(appointment_id)
            if record is None:
                raise _Refused(404, "not_found")
            if record["status"] != "cancelled":
                record["status"] = "cancelled"
                self._effects.cancelled += 1
            return dict(record)

        return apply

    # -- the HTTP API ----------------------------------------------------------------

    def _build(self) -> FastAPI:
        api = self
        app = FastAPI(title="Clinic appointments (stand-in)", openapi_url=None)

        @app.middleware("http")
        async def guard(request: Request, call_next: Any) -> Any:
            if request.url.path.startswith("/_"):
                return await call_next(request)
            effects = api._effects
            effects.requests += 1
            api._serving += 1
            effects.most_concurrent = max(effects.most_concurrent, api._serving)
            try:
                if api.faults.latency_s > 0:
                    await asyncio.sleep(api.faults.latency_s)
                if api.token is not None:
                    if request.headers.get("authorization") != f"Bearer {api.token}":
                        return _error(401, "unauthorized", "a valid bearer token is required")
                return await call_next(request)
            finally:
                api._serving -= 1

        async def body_of(request: Request, model: type[BaseModel]) -> BaseModel | JSONResponse:
            try:
                return model.model_validate(await request.json())
            except (ValueError, ValidationError, RecursionError) as exc:
                return _error(422, "invalid", str(exc)[:300])

        @app.get("/slots")
        async def slots(date: dt.date, service: str) -> JSONResponse:
            if service not in SERVICES:
                return _error(422, "invalid", f"service is one of {', '.join(SERVICES)}")
            taken = {
                a["time"]
                for a in api.appointments.values()
                if a["date"] == date.isoformat() and a["status"] == "booked"
            }
            free = [t for t in SLOTS if t not in taken]
            return JSONResponse({"date": date.isoformat(), "service": service, "free": free})

        @app.post("/appointments")
        async def book(
            request: Request,
            key: str | None = Header(default=None, alias=IDEMPOTENCY_HEADER),
        ) -> JSONResponse:
            req = await body_of(request, AppointmentRequest)
            if isinstance(req, JSONResponse):
                return req
            assert isinstance(req, AppointmentRequest)
            return await api._mutate(
                key, "/appointments", req.model_dump(mode="json"), api._book(req)
            )

        @app.post("/appointments/{appointment_id}/cancel")
        async def cancel(
            appointment_id: str,
            key: str | None = Header(default=None, alias=IDEMPOTENCY_HEADER),
        ) -> JSONResponse:
            return await api._mutate(
                key, f"/appointments/{appointment_id}/cancel", {}, api._cancel(appointment_id)
            )

        @app.get("/appointments/{appointment_id}")
        async def get(appointment_id: str) -> JSONResponse:
            record = api.appointments.get(appointment_id)
            if record is None:
                return _error(404, "not_found", "no such appointment")
            return JSONResponse(record)

        @app.get("/requests/{key}")
        async def request_status(key: str) -> JSONResponse:
            found = api._keys.get(key)
            if found is None:
                return _error(404, "not_found", "no request with this key")
            if found["state"] != "done":
                return JSONResponse({"key": key, "outcome": "in_progress"})
            if 200 <= found["status"] < 300:
                return JSONResponse({"key": key, "outcome": "applied", "record": found["body"]})
            return JSONResponse(
                {"key": key, "outcome": "rejected", "error": found["body"].get("error")}
            )

        @app.post("/callbacks")
        async def callback(request: Request) -> JSONResponse:
            req = await body_of(request, CallbackRequest)
            if isinstance(req, JSONResponse):
                return req
            assert isinstance(req, CallbackRequest)
            fault = api._take_fault()
            if fault == "fail_before_commit":
                return _error(503, "unavailable", "try again later; nothing was done")
            if fault == "hang":
                await api._wait_released()
            record = {"id": _ref("CB"), "status": "requested", **req.model_dump(mode="json")}
            api.callbacks[record["id"]] = record
            api._effects.callbacks += 1
            if fault == "lose_response":
                await api._wait_released()
            return JSONResponse(record, status_code=201)

        @app.post("/_faults")
        async def set_faults(faults: Faults) -> Faults:
            api.set_faults(faults)
            return api.faults

        @app.post("/_faults/release")
        async def release() -> dict[str, bool]:
            api.release()
            return {"released": True}

        @app.get("/_effects")
        async def effects() -> Effects:
            return api.effects()

        @app.get("/healthz")
        async def healthz() -> dict[str, str]:
            return {"status": "ok"}

        return app


def run_api(host: str, port: int, token: str | None) -> int:
    """Serve the stand-in until SIGINT/SIGTERM."""

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        async with AppointmentsApi(host=host, port=port, token=token) as api:
            print(f"appointments API listening on {api.url}", flush=True)
            await stop.wait()

    asyncio.run(main())
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m tools.appointments`: the stand-in clinic API."""
    parser = argparse.ArgumentParser(prog="python -m tools.appointments", description=__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8767)
    parser.add_argument(
        "--token", default=None, help="require this bearer token (APPOINTMENTS_API_TOKEN)"
    )
    args = parser.parse_args(argv)
    return run_api(args.host, args.port, args.token or os.environ.get("APPOINTMENTS_API_TOKEN"))
