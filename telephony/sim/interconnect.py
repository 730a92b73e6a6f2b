"""OpenAI's side of the SIP interconnect, offline: the webhook, the call-control REST API and
the sideband WebSocket, on one real HTTP port, so production code runs against it unchanged
(only `OPENAI_BASE_URL` differs)::

    async with SipInterconnect(webhook_url=".../openai/webhook", webhook_secret=secret) as sim:
        call = await sim.place_call(from_number="+15551230000", to_number="+15557654321")
        await sim.wait_for_state(call.call_id, "accepted")

What it plays, per call: `realtime.call.incoming` signed as a Standard Webhook (`webhook-id`,
`webhook-timestamp`, `webhook-signature: v1,<base64 HMAC-SHA256 of id.timestamp.body>`, the
same scheme as `tools.webhooks.sign` and the SDK's `webhooks.verify_signature`);
`POST /v1/realtime/calls/{id}/accept|reject|refer|hangup`, the accept body validated as a GA
session; the sideband `GET /v1/realtime?call_id=...` (refused with 404 once the call is over,
as the real one is) running the scripted conversation of `SimulatedSession` with no audio on the
socket: `output_audio_buffer.started` / `stopped` / `cleared` say what the caller heard, at real
time scaled by `realtime_factor`. With `auto_caller`, the simulated caller speaks each scripted
caller turn once the agent has finished talking, and hangs up when the script is done.

The GPT-Live flavour (`place_call(live=True)`): the same pending call is announced with a signed
`live.transport.incoming` (its `live_...` session id, `sip_media_security: srtp`), and
`realtime.call.incoming` can be delivered for it too; the first accept that succeeds, on either
API, takes the call (the other answers 409). `POST /v1/live/sessions/{id}/accept|reject|refer|
hangup` (the accept's `session` checked against the SDK's accept params: type `live`, a model,
no unknown field and no `audio.format`, since SIP negotiates the media), and the Live sideband
`GET /v1/live/sessions/{id}/attach` running `LiveSidebandSession` (every client event checked
against the SDK's sideband union).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import hmac
import json
import logging
import secrets
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

import httpx
from aiohttp import WSMsgType, web
from openai.types.live import session_accept_params
from openai.types.live.session_config import SessionConfig as LiveSessionConfig
from openai.types.realtime import InputAudioBufferDtmfEventReceivedEvent
from openai.types.realtime.realtime_server_event import (
    OutputAudioBufferCleared,
    OutputAudioBufferStarted,
    OutputAudioBufferStopped,
)
from pydantic import ValidationError
from websockets.exceptions import ConnectionClosed

from telephony.sim.live_sideband import LiveSidebandSession
from telephony.sim.scenario import Scenario, load_scenario
from telephony.sim.simulator import (
    DEFAULT_MODEL,
    EffectiveConfig,
    SessionConfig,
    SimulatedSession,
    _ActiveResponse,
    default_session,
    merge_session,
    new_id,
)
from telephony.sim.vad import SpeechStarted, SpeechStopped

log = logging.getLogger(__name__)

CALLER_PAUSE_S = 0.4  # between the agent's last word and the caller's next turn
CALLER_SPEECH_MS = 900  # how long each simulated caller utterance lasts


def sign_webhook(secret: str, msg_id: str, timestamp: int, body: bytes) -> str:
    """`webhook-signature` of a Standard Webhook (what OpenAI sends): `v1,<base64 HMAC>`."""
    key = (
        base64.b64decode(secret.removeprefix("whsec_"))
        if secret.startswith("whsec_")
        else secret.encode()
    )
    digest = hmac.new(key, f"{msg_id}.{timestamp}.".encode() + body, hashlib.sha256).digest()
    return "v1," + base64.b64encode(digest).decode()


@dataclass(eq=False)
class SimCall:
    """One incoming SIP call as OpenAI sees it."""

    call_id: str
    from_number: str
    to_number: str
    sip_headers: list[dict[str, str]]
    webhook_id: str
    state: str = "ringing"  # ringing | accepted | rejected | ended
    accept_body: dict[str, Any] | None = None
    reject_status: int | None = None
    refers: list[str] = field(default_factory=list)
    hangups: int = 0
    ended_by: str | None = None  # "caller" (remote hang-up) | "api" (hangup/refer)
    webhook_sent_at: float | None = None
    webhook_statuses: list[int] = field(default_factory=list)
    accepted_at: float | None = None
    config: SessionConfig | None = None
    sessions: list[Any] = field(default_factory=list)  # SidebandSession | LiveSidebandSession
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    # GPT-Live: the same pending call as a Live session (`live.transport.incoming`).
    session_id: str = ""
    live_webhook_id: str = ""
    runtime: str | None = None  # "realtime" | "live": which API's accept took the call
    live_config: LiveSessionConfig | None = None

    def notify(self) -> None:
        changed, self.changed = self.changed, asyncio.Event()
        changed.set()


class _AiohttpSocket:
    """An aiohttp WebSocket seen the way `SimulatedSession` uses a websockets connection."""

    def __init__(self, ws: web.WebSocketResponse, request: web.Request) -> None:
        self._ws = ws
        self.transport = request.transport

    async def send(self, text: str) -> None:
        if self._ws.closed:
            raise ConnectionClosed(None, None)
        try:
            await self._ws.send_str(text)
        except (ConnectionError, RuntimeError) as exc:
            raise ConnectionClosed(None, None) from exc

    async def close(self, code: int = 1000) -> None:
        with contextlib.suppress(Exception):
            await self._ws.close(code=code)

    def __aiter__(self) -> AsyncIterator[str | bytes]:
        return self._messages()

    async def _messages(self) -> AsyncIterator[str | bytes]:
        async for message in self._ws:
            if message.type in (WSMsgType.TEXT, WSMsgType.BINARY):
                yield message.data
            else:
                return


class SidebandSession(SimulatedSession):
    """The sideband of one accepted call: the scripted model, no audio on the socket."""

    def __init__(
        self,
        socket: _AiohttpSocket,
        scenario: Scenario,
        call: SimCall,
        config: SessionConfig,
        *,
        authorization: str | None,
        realtime_factor: float,
        chunk_ms: int,
        record: bool,
        auto_caller: bool,
        on_script_done: Callable[[], Any] | None = None,
    ) -> None:
        super().__init__(
            socket,  # type: ignore[arg-type]  # duck-typed: send, iteration, transport
            scenario,
            model=config.model or DEFAULT_MODEL,
            call_id=call.call_id,
            authorization=authorization,
            realtime_factor=realtime_factor,
            chunk_ms=chunk_ms,
            record=record,
        )
        self.socket = socket
        self.call = call
        self.config = config
        self._effective = EffectiveConfig.of(config)
        self._vad = None  # no caller audio here: the caller's turns are scripted
        self._auto_caller = auto_caller
        self._on_script_done = on_script_done
        self._playout: asyncio.Task[None] | None = None  # the last one queued
        self._playouts: list[asyncio.Task[None]] = []
        self._playout_response: str | None = None
        self._caller_task: asyncio.Task[None] | None = None
        # The conversation continues from the call's earlier sidebands (a re-attach).
        previous = [s for s in call.sessions if s is not self]
        if previous:
            last = previous[-1]
            self._next_step = last._next_step
            self._greeting_pending = last._greeting_pending
            self.items = last.items
            self._order = last._order
            self._latest_output = last._latest_output

    async def run(self) -> None:
        try:
            await super().run()
        finally:
            for task in (*self._playouts, self._caller_task):
                if task is not None and task is not asyncio.current_task():
                    task.cancel()

    # ---- what the caller hears ----------------------------------------------------------

    @property
    def playing(self) -> bool:
        return self._playout is not None and not self._playout.done()

    async def _send_audio_chunk(
        self, response: _ActiveResponse, ids: dict[str, Any], chunk: bytes, total_ms: int,
        *, first: bool,
    ) -> None:  # fmt: skip
        if not first:
            return
        # One output buffer: a response's audio plays after what is still playing.
        before = self._playout if self.playing else None
        self._playout = asyncio.create_task(self._play_out(response.id, total_ms / 1000, before))
        self._playouts = [t for t in self._playouts if not t.done()] + [self._playout]

    async def _play_out(
        self, response_id: str, seconds: float, before: asyncio.Task[None] | None
    ) -> None:
        if before is not None:
            await asyncio.wait([before])
        self._playout_response = response_id
        with contextlib.suppress(ConnectionClosed):
            await self._send(
                OutputAudioBufferStarted(
                    type="output_audio_buffer.started", event_id="", response_id=response_id
                )
            )
        await asyncio.sleep(seconds * self._factor)
        if self._playout is asyncio.current_task():
            self._playout = None
        with contextlib.suppress(ConnectionClosed):
            await self._send(
                OutputAudioBufferStopped(
                    type="output_audio_buffer.stopped", event_id="", response_id=response_id
                )
            )
        if self._auto_caller and self._caller_task is None and self._playout is None:
            self._caller_task = asyncio.create_task(self._next_caller_turn())

    async def _stop_playout(self) -> bool:
        """Clear the output buffer: what plays and whatever was queued behind it."""
        tasks = [t for t in self._playouts if not t.done()]
        self._playouts.clear()
        self._playout = None
        if not tasks:
            return False
        for task in tasks:
            task.cancel()
        await self._send(
            OutputAudioBufferCleared(
                type="output_audio_buffer.cleared",
                event_id="",
                response_id=self._playout_response or "",
            )
        )
        return True

    async def _on_output_clear(self) -> None:
        await self._stop_playout()

    async def _on_speech_started(self, event: SpeechStarted) -> None:
        await super()._on_speech_started(event)
        detection = self._effective.turn_detection
        if detection is not None and detection.interrupt_response:
            await self._stop_playout()  # SIP: the server cuts its own playout on barge-in

    # ---- the simulated caller -----------------------------------------------------------

    async def caller_says(self, speech_ms: int = CALLER_SPEECH_MS) -> None:
        """The caller speaks one turn (the scenario's next `caller_transcript`)."""
        start = int(self._stream_ms)
        await self._on_speech_started(SpeechStarted(audio_start_ms=start))
        await asyncio.sleep(speech_ms / 1000 * self._factor)
        self._stream_ms += speech_ms
        end = int(self._stream_ms)
        await self._on_speech_stopped(SpeechStopped(audio_end_ms=end, speech_end_ms=end))

    async def press(self, digit: str) -> None:
        """The caller presses a key (RFC 4733 on OpenAI's SIP leg)."""
        await self._send(
            InputAudioBufferDtmfEventReceivedEvent(
                type="input_audio_buffer.dtmf_event_received",
                event=digit,
                received_at=int(time.time()),
            )
        )

    async def _next_caller_turn(self) -> None:
        try:
            await asyncio.sleep(CALLER_PAUSE_S * self._factor)
            if self._active is not None or self.playing:
                return  # the agent is still talking: its stop will bring us back
            steps = self._scenario.steps
            if self._next_step < len(steps):
                if steps[self._next_step].caller_transcript:
                    await self.caller_says()
                return  # the next step answers a function output or a late result
            if self._on_script_done is not None:
                result = self._on_script_done()
                if asyncio.iscoroutine(result):
                    await result
        except ConnectionClosed:
            pass
        finally:
            self._caller_task = None


class SipInterconnect:
    """OpenAI's SIP interconnect on a real port; see the module docstring."""

    def __init__(
        self,
        scenario: Scenario | None = None,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        webhook_url: str | None = None,
        webhook_secret: str | None = None,
        realtime_factor: float = 1.0,
        chunk_ms: int = 150,
        auto_caller: bool = True,
        record: bool = True,
    ) -> None:
        self.scenario = scenario if scenario is not None else load_scenario()
        self.host = host
        self.webhook_url = webhook_url
        self.webhook_secret = webhook_secret
        self.realtime_factor = realtime_factor
        self.chunk_ms = chunk_ms
        self.auto_caller = auto_caller
        self.record = record
        self.calls: dict[str, SimCall] = {}
        # (monotonic, method, path, json body) of every REST request, in order.
        self.requests: list[tuple[float, str, str, Any]] = []
        self.sideband_refusals = 0
        self._fail_sidebands = 0
        self._requested_port = port
        self._port: int | None = None
        self._runner: web.AppRunner | None = None
        self._http: httpx.AsyncClient | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self._live_ids: dict[str, str] = {}  # Live session id -> call id

    @property
    def port(self) -> int:
        if self._port is None:
            raise RuntimeError("the interconnect is not started")
        return self._port

    @property
    def base_url(self) -> str:
        """`OPENAI_BASE_URL` for this stand-in (REST and the sideband share it)."""
        return f"http://{self.host}:{self.port}/v1"

    async def start(self) -> int:
        app = web.Application(client_max_size=4 * 1024 * 1024)
        app.router.add_post("/v1/realtime/calls/{call_id}/{verb}", self._rest)
        app.router.add_get("/v1/realtime", self._sideband)
        app.router.add_post("/v1/live/sessions/{session_id}/{verb}", self._live_rest)
        app.router.add_get("/v1/live/sessions/{session_id}/attach", self._live_sideband)
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self._requested_port)
        await site.start()
        server = site._server
        assert server is not None and getattr(server, "sockets", None)
        self._port = int(server.sockets[0].getsockname()[1])  # type: ignore[attr-defined]
        self._http = httpx.AsyncClient(timeout=10.0)
        log.info("SIP interconnect stand-in at %s", self.base_url)
        return self._port

    async def stop(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        for call in self.calls.values():
            for session in call.sessions:
                await session.socket.close(1001)
        if self._http is not None:
            await self._http.aclose()
            self._http = None
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def __aenter__(self) -> SipInterconnect:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.stop()

    # ---- playing an incoming call --------------------------------------------------------

    def new_call(
        self,
        from_number: str = "+15551230000",
        to_number: str = "+15557654321",
        *,
        extra_headers: list[dict[str, str]] | None = None,
    ) -> SimCall:
        """A ringing call (not announced yet; `deliver` sends its webhook)."""
        call_id = new_id("rtc")
        headers = [
            {"name": "From", "value": f'"Caller" <sip:{from_number}@trunk.example.com>;tag=1'},
            {"name": "To", "value": f"<sip:{to_number}@sip.api.openai.com>"},
            {"name": "Call-ID", "value": f"{secrets.token_hex(8)}@trunk.example.com"},
            *(extra_headers or []),
        ]
        call = SimCall(
            call_id,
            from_number,
            to_number,
            headers,
            webhook_id=new_id("wh"),
            session_id=new_id("live"),
            live_webhook_id=new_id("wh"),
        )
        self.calls[call_id] = call
        self._live_ids[call.session_id] = call_id
        return call

    def webhook_body(self, call: SimCall) -> bytes:
        return json.dumps(
            {
                "object": "event",
                "id": call.webhook_id.replace("wh_", "evt_"),
                "type": "realtime.call.incoming",
                "created_at": int(time.time()),
                "data": {"call_id": call.call_id, "sip_headers": call.sip_headers},
            },
            separators=(",", ":"),
        ).encode()

    def live_webhook_body(self, call: SimCall, media_security: str | None = "srtp") -> bytes:
        data: dict[str, Any] = {
            "session_id": call.session_id,
            "sip_headers": call.sip_headers,
            "type": "sip",
        }
        if media_security is not None:
            data["sip_media_security"] = media_security
        return json.dumps(
            {
                "object": "event",
                "id": call.live_webhook_id.replace("wh_", "evt_"),
                "type": "live.transport.incoming",
                "created_at": int(time.time()),
                "data": data,
            },
            separators=(",", ":"),
        ).encode()

    async def deliver(
        self,
        call: SimCall,
        *,
        body: bytes | None = None,
        timestamp: int | None = None,
        secret: str | None = None,
        signature: str | None = None,
        live: bool = False,
    ) -> int:
        """POST the call's webhook (again, for a retry; `live`: its `live.transport.incoming`);
        returns the HTTP status."""
        assert self._http is not None and self.webhook_url is not None
        default = self.live_webhook_body(call) if live else self.webhook_body(call)
        payload = body if body is not None else default
        webhook_id = call.live_webhook_id if live else call.webhook_id
        stamp = int(time.time()) if timestamp is None else timestamp
        key = secret or self.webhook_secret
        if signature is None:
            assert key is not None, "webhook_secret is needed to sign"
            signature = sign_webhook(key, webhook_id, stamp, payload)
        headers = {
            "content-type": "application/json",
            "webhook-id": webhook_id,
            "webhook-timestamp": str(stamp),
            "webhook-signature": signature,
        }
        call.webhook_sent_at = time.monotonic()
        response = await self._http.post(self.webhook_url, content=payload, headers=headers)
        call.webhook_statuses.append(response.status_code)
        call.notify()
        return response.status_code

    async def place_call(
        self,
        from_number: str = "+15551230000",
        to_number: str = "+15557654321",
        *,
        live: bool = False,
        **kw: Any,
    ) -> SimCall:
        """A new call, announced with a signed `realtime.call.incoming` (`live`: with
        `live.transport.incoming`)."""
        call = self.new_call(from_number, to_number, **kw)
        await self.deliver(call, live=live)
        return call

    async def remote_hangup(self, call_id: str) -> None:
        """The caller hangs up on OpenAI's side: the sideband closes and stays refused."""
        call = self.calls[call_id]
        await self._end(call, "caller")

    async def drop_sideband(self, call_id: str) -> None:
        """A network drop: the sideband's TCP connection dies; the call itself goes on."""
        for session in self.calls[call_id].sessions:
            transport = session.socket.transport
            if transport is not None and not session.closed.is_set():
                transport.abort()

    def fail_sideband(self, n: int) -> None:
        """Answer the next `n` sideband handshakes with 503 (a network or edge failure)."""
        self._fail_sidebands = n

    async def wait_for_state(self, call_id: str, state: str, *, within: float = 10.0) -> SimCall:
        async with asyncio.timeout(within):
            while True:
                call = self.calls.get(call_id)
                if call is not None and call.state == state:
                    return call
                if call is None:
                    await asyncio.sleep(0.02)
                else:
                    await call.changed.wait()

    async def wait_for_session(
        self, call_id: str, index: int = 0, *, within: float = 10.0
    ) -> SidebandSession:
        async with asyncio.timeout(within):
            while True:
                call = self.calls[call_id]
                if len(call.sessions) > index:
                    return call.sessions[index]
                await call.changed.wait()

    def requests_for(self, call_id: str, verb: str | None = None) -> list[Any]:
        """JSON bodies of the REST requests for a call (optionally one verb), in order."""
        return self._requests(f"/v1/realtime/calls/{call_id}/", verb)

    def live_requests_for(self, call_id: str, verb: str | None = None) -> list[Any]:
        """The same, of the call's Live session (`/v1/live/sessions/{session_id}/...`)."""
        return self._requests(f"/v1/live/sessions/{self.calls[call_id].session_id}/", verb)

    def _requests(self, prefix: str, verb: str | None) -> list[Any]:
        return [
            body
            for _, _, path, body in self.requests
            if path.startswith(prefix) and (verb is None or path == prefix + verb)
        ]

    async def _end(self, call: SimCall, by: str) -> None:
        if call.state == "ended":
            return
        call.state = "ended"
        call.ended_by = by
        call.notify()
        for session in call.sessions:
            if isinstance(session, LiveSidebandSession):
                await session.end("remote_hangup" if by == "caller" else "close_requested")
            else:
                await session.socket.close(1000)

    # ---- HTTP ------------------------------------------------------------------------------

    @staticmethod
    def _error(status: int, message: str, param: str | None = None) -> web.Response:
        body = {"error": {"message": message, "type": "invalid_request_error", "param": param}}
        return web.json_response(body, status=status)

    async def _rest(self, request: web.Request) -> web.StreamResponse:
        call_id = request.match_info["call_id"]
        verb = request.match_info["verb"]
        raw = await request.read()
        try:
            body: Any = json.loads(raw) if raw else {}
        except ValueError:
            return self._error(400, "We could not parse the JSON body of your request.")
        self.requests.append((time.monotonic(), "POST", request.path, body))
        auth = request.headers.get("Authorization", "")
        if not auth.startswith("Bearer ") or not auth.removeprefix("Bearer ").strip():
            return self._error(401, "Missing bearer authentication")
        call = self.calls.get(call_id)
        if call is None:
            return self._error(404, f"Call '{call_id}' not found.")
        if verb == "accept":
            if call.state != "ringing":
                return self._error(409, f"Call '{call_id}' is {call.state}.")
            try:
                update = SessionConfig.model_validate(body)
                config = merge_session(default_session(update.model or DEFAULT_MODEL), update)
            except ValidationError as exc:
                first = exc.errors()[0]
                param = ".".join(str(p) for p in first.get("loc", ()))
                return self._error(400, f"Invalid session: {first.get('msg')}", param)
            call.accept_body = body
            call.accepted_at = time.monotonic()
            call.state = "accepted"
            call.runtime = "realtime"
            call.config = config
        elif verb == "reject":
            if call.state != "ringing":
                return self._error(409, f"Call '{call_id}' is {call.state}.")
            call.reject_status = int(body.get("status_code") or 603)
            call.state = "rejected"
        elif verb == "refer":
            target = str(body.get("target_uri") or "")
            if call.state != "accepted":
                return self._error(409, f"Call '{call_id}' is {call.state}.")
            if not target.startswith(("tel:", "sip:", "sips:")):
                return self._error(400, "target_uri must be a tel: or sip: URI", "target_uri")
            call.refers.append(target)
            # The trunk takes the call elsewhere: OpenAI's leg (and its sideband) ends.
            self._spawn(self._end(call, "api"))
        elif verb == "hangup":
            if call.state == "ended":
                return self._error(404, f"Call '{call_id}' has ended.")
            call.hangups += 1
            await self._end(call, "api")
        else:
            return self._error(404, f"Unknown call action '{verb}'.")
        call.notify()
        return web.Response(status=200)

    def _spawn(self, coro: Any) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _sideband(self, request: web.Request) -> web.StreamResponse:
        call = self.calls.get(request.query.get("call_id", ""))
        auth = request.headers.get("Authorization", "")
        if not auth.startswith("Bearer "):
            return self._error(401, "Missing bearer authentication")
        if self._fail_sidebands > 0:
            self._fail_sidebands -= 1
            return self._error(503, "Service Unavailable")
        if (
            call is None
            or call.state != "accepted"
            or call.config is None
            or call.runtime != "realtime"
        ):
            self.sideband_refusals += 1
            return self._error(404, "Call not found or no longer active.")
        ws = web.WebSocketResponse(max_msg_size=16 * 1024 * 1024, compress=False)
        await ws.prepare(request)
        socket = _AiohttpSocket(ws, request)
        session = SidebandSession(
            socket,
            self.scenario,
            call,
            call.config,
            authorization=auth,
            realtime_factor=self.realtime_factor,
            chunk_ms=self.chunk_ms,
            record=self.record,
            auto_caller=self.auto_caller,
            on_script_done=lambda: self._end(call, "caller"),
        )
        call.sessions.append(session)
        call.notify()
        try:
            await session.run()
        except Exception:
            log.exception("sideband of %s failed", call.call_id)
        return ws

    # ---- GPT-Live ------------------------------------------------------------------------

    def _live_call(self, session_id: str) -> SimCall | None:
        call_id = self._live_ids.get(session_id)
        return self.calls.get(call_id) if call_id is not None else None

    async def _live_rest(self, request: web.Request) -> web.StreamResponse:
        session_id = request.match_info["session_id"]
        verb = request.match_info["verb"]
        raw = await request.read()
        try:
            body: Any = json.loads(raw) if raw else {}
        except ValueError:
            return self._error(400, "We could not parse the JSON body of your request.")
        self.requests.append((time.monotonic(), "POST", request.path, body))
        auth = request.headers.get("Authorization", "")
        if not auth.startswith("Bearer ") or not auth.removeprefix("Bearer ").strip():
            return self._error(401, "Missing bearer authentication")
        call = self._live_call(session_id)
        if call is None or not isinstance(body, dict):
            return self._error(404, f"Session '{session_id}' not found.")
        if verb == "accept":
            if call.state != "ringing":
                return self._error(409, f"Session '{session_id}' is {call.state}.")
            problem = _live_accept_problem(body.get("session"))
            if problem is not None:
                return self._error(400, *problem)
            call.accept_body = body
            call.accepted_at = time.monotonic()
            call.state = "accepted"
            call.runtime = "live"
            call.live_config = LiveSessionConfig.model_validate(body["session"])
        elif verb == "reject":
            status = body.get("status_code")
            if not isinstance(status, int) or not 300 <= status <= 699:
                return self._error(400, "status_code must be 300-699", "status_code")
            if call.state != "ringing":
                return self._error(409, f"Session '{session_id}' is {call.state}.")
            call.reject_status = status
            call.state = "rejected"
        elif verb == "refer":
            target = str(body.get("target_uri") or "")
            if call.state != "accepted" or call.runtime != "live":
                return self._error(409, f"Session '{session_id}' is {call.state}.")
            if not target.strip():
                return self._error(400, "target_uri must not be blank", "target_uri")
            call.refers.append(target)
            self._spawn(self._end(call, "api"))
        elif verb == "hangup":
            if call.state == "ended":
                return self._error(404, f"Session '{session_id}' has ended.")
            call.hangups += 1
            await self._end(call, "api")
        else:
            return self._error(404, f"Unknown session action '{verb}'.")
        call.notify()
        return web.Response(status=200)

    async def _live_sideband(self, request: web.Request) -> web.StreamResponse:
        call = self._live_call(request.match_info["session_id"])
        auth = request.headers.get("Authorization", "")
        if not auth.startswith("Bearer "):
            return self._error(401, "Missing bearer authentication")
        if self._fail_sidebands > 0:
            self._fail_sidebands -= 1
            return self._error(503, "Service Unavailable")
        if (
            call is None
            or call.state != "accepted"
            or call.runtime != "live"
            or call.live_config is None
            or call.accepted_at is None
        ):
            self.sideband_refusals += 1
            return self._error(404, "Session not found or no longer active.")
        ws = web.WebSocketResponse(max_msg_size=16 * 1024 * 1024, compress=False)
        await ws.prepare(request)
        previous = [s for s in call.sessions if isinstance(s, LiveSidebandSession)]
        session = LiveSidebandSession(
            _AiohttpSocket(ws, request),
            self.scenario,
            session_id=call.session_id,
            config=call.live_config,
            started_at=call.accepted_at,
            previous=previous[-1] if previous else None,
            authorization=auth,
            realtime_factor=self.realtime_factor,
            record=self.record,
            auto_caller=self.auto_caller,
            on_script_done=lambda: self._end(call, "caller"),
        )
        call.sessions.append(session)
        call.notify()
        try:
            await session.run()
        except Exception:
            log.exception("Live sideband of %s failed", call.session_id)
        return ws


_LIVE_ACCEPT_FIELDS = frozenset(
    session_accept_params.Session.__required_keys__
    | session_accept_params.Session.__optional_keys__
)


def _live_accept_problem(session: Any) -> tuple[str, str] | None:
    """Why a Live accept's `session` is refused (message, param), or None: it must fit the
    SDK's accept params (a strict object), be `type: live` with a model, and name no audio
    format (SIP negotiates it)."""
    if not isinstance(session, dict):
        return "Missing required parameter: 'session'.", "session"
    unknown = sorted(set(session) - _LIVE_ACCEPT_FIELDS)
    if unknown:
        return f"Unknown parameter: 'session.{unknown[0]}'.", f"session.{unknown[0]}"
    if session.get("type") != "live":
        return "session.type must be 'live'.", "session.type"
    audio = session.get("audio")
    if isinstance(audio, dict) and "format" in audio:
        return "SIP negotiates the media format; omit audio.format.", "session.audio.format"
    if isinstance(audio, dict) and set(audio) - {"output"}:
        return "Unknown parameter in 'session.audio'.", "session.audio"
    try:
        LiveSessionConfig.model_validate(session)
    except ValidationError as exc:
        first = exc.errors()[0]
        param = "session." + ".".join(str(p) for p in first.get("loc", ()))
        return f"Invalid session: {first.get('msg')}", param
    return None
