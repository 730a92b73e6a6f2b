"""A fake Twilio REST API: a real HTTP server answering the endpoints the twilio library
calls, at the same paths, with Twilio's auth, JSON shapes, errors and signed callbacks.

- `POST /2010-04-01/Accounts/{AccountSid}/Calls/{CallSid}.json`: `Status=completed` ends
  the call (an attached `FakeTwilioCaller` sends `stop` and closes its stream, as Twilio
  would); `Twiml=...` replaces the call's instructions, which ends the media stream.
- `GET  .../Calls/{CallSid}.json`
- `POST /2010-04-01/Accounts/{AccountSid}/Calls.json`: an outbound call (`To`, `From`, `Url`,
  `MachineDetection`, `AsyncAmd`, `AsyncAmdStatusCallback`, `StatusCallback`; every param kept
  on the `FakeCall`). As on Twilio it then rings (`ring_s`) and, per `call_outcomes[To]`
  (default `call_outcome`): `busy` / `no-answer` / `failed` POST the status callback; anything
  else is an `AnsweredBy` value (`human`, `machine_end_beep`, `machine_end_silence`, `fax`,
  `unknown`): a `FakeTwilioCaller` plays the callee (`outbound_callers`): it requests `Url`,
  follows the TwiML (opens the stream), a machine plays its greeting (`machine_greeting_ms`),
  and after `amd_delay_s` the signed AsyncAmd callback says who answered.
- A created call with `Twiml` instead of `Url` (a warm transfer's person): it rings, then per
  `call_outcomes[To]`: `busy` / `no-answer` / `failed` as above; `hangs-up` answers and hangs up
  during the first `<Say>`; anything else answers and runs the TwiML (with `MachineDetection`,
  each `<Redirect>` carries `AnsweredBy`: the outcome where it is one, else `human`): each
  `<Say>` is kept
  (`FakeCall.said`) and takes `say_s`, a `<Redirect>` POSTs the signed call params to its URL
  and runs the answer, `<Dial><Conference>` joins the room. `StatusCallbackEvent` (repeated or
  space separated, as Twilio takes it) picks which of `ringing` / `answered` are reported;
  the final status always is (`duplicate_callbacks` repeats it, `drop_callbacks` loses it).
- Conferences (`<Dial><Conference>` from a created call's TwiML or a live call's update): the
  room is made when the first participant enters; `conferences[name]` lists who is in it with
  the noun's attributes (`startConferenceOnEnter`, `endConferenceOnExit`, `beep`, `waitUrl`).
  `hang_up(call_sid)` ends a participant's call; one with `endConferenceOnExit="true"` ends
  the conference and every other participant's call, as Twilio does.
- `GET  .../Calls.json`: the list, newest first, filtered by `To`, `From`, `Status`,
  `StartTime`, `StartTime>` (and `>=`), `StartTime<`.
- `POST /2010-04-01/Accounts/{AccountSid}/Messages.json`: 201 with a queued message (from
  `From`, or from a number of the Messaging Service named by `MessagingServiceSid`), then
  signed status callbacks to its `StatusCallback` as Twilio sends them (`sent`, then
  `delivered`; or `undelivered` / `failed` with an `ErrorCode`). A recipient who texted
  STOP (`send_inbound_sms`) gets error 21610, as on Twilio.
- `GET  .../Messages.json`: the list, newest first, with Twilio's filters (`To`, `From`,
  `DateSent`, `DateSent<`, `DateSent>`; a queued message has no `date_sent`, so a date
  filter skips it) and paging (`PageSize`, `Page`, `PageToken`, `next_page_uri`).
- `GET  .../Messages/{MessageSid}.json`

Faults, for the tests of what our side must survive: `lose_message_answers(n)` and
`lose_call_answers(n)` (the next n creates are accepted, and their answer never comes: the
client times out), `drop_callbacks`
(status callbacks are lost), `hold_queued` (messages stay queued until `release_messages`),
`callback_order="late_sent"` (`delivered` arrives before `sent`), `duplicate_callbacks`,
`reject_next_message(code)` (a Twilio error on create), and `fail_next` (5xx / 429).

Every request is recorded. Runs in-process on an ephemeral port (uvicorn, this loop).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import secrets
import socket
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from datetime import UTC, datetime
from email.utils import format_datetime
from typing import TYPE_CHECKING, Any, Literal, TypeAlias
from urllib.parse import urlencode, urlsplit, urlunsplit

import httpx
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route
from starlette.types import ASGIApp
from twilio.request_validator import RequestValidator

from telephony.quiet_server import QuietServer
from telephony.sim.fake_caller import DEFAULT_ACCOUNT_SID, DEFAULT_AUTH_TOKEN, parse_twiml

if TYPE_CHECKING:
    from telephony.sim.fake_caller import FakeTwilioCaller

API_VERSION = "2010-04-01"
SmsOutcome: TypeAlias = Literal["delivered", "undelivered", "failed"]
CallbackOrder: TypeAlias = Literal["normal", "late_sent"]
# The number a Messaging Service sends from in this fake.
SERVICE_NUMBER = "+15005550006"
STOP_WORDS = frozenset({"STOP", "STOPALL", "UNSUBSCRIBE", "CANCEL", "END", "QUIT"})
START_WORDS = frozenset({"START", "UNSTOP", "YES"})
# Twilio's error texts for the create refusals tests inject.
_CREATE_ERRORS: dict[int, tuple[int, str]] = {
    21610: (400, "Attempt to send to unsubscribed recipient"),
    21211: (400, "Invalid 'To' Phone Number"),
    21614: (400, "'To' number is not a valid mobile number"),
    21612: (400, "The 'To' phone number is not currently reachable via SMS"),
    21606: (400, "The 'From' phone number provided is not a valid message-capable number"),
}

# Twilio's error codes for the failures this fake produces.
_SMS_ERROR_CODES: dict[str, int] = {"undelivered": 30003, "failed": 30008}


class InProcessServer:
    """An ASGI app served by uvicorn inside the running event loop, on its own port."""

    def __init__(self, app: ASGIApp, host: str = "127.0.0.1", port: int = 0) -> None:
        self.app = app
        self.host = host
        self.port = port
        self._server: QuietServer | None = None
        self._task: asyncio.Task[None] | None = None
        self._socket: socket.socket | None = None

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    async def start(self, timeout: float = 10.0) -> str:  # noqa: ASYNC109
        """Bind, serve, and return the base URL once the server accepts connections."""
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.host, self.port))
        self.port = sock.getsockname()[1]
        self._socket = sock
        config = uvicorn.Config(
            self.app,
            log_level="warning",
            lifespan="off",
            ws="websockets-sansio",
            access_log=False,
        )
        self._server = QuietServer(config)
        self._task = asyncio.create_task(
            self._server.serve(sockets=[sock]), name=f"uvicorn-{self.port}"
        )
        deadline = time.monotonic() + timeout
        while not self._server.started:
            if self._task.done():
                self._task.result()  # raises what stopped it
                raise RuntimeError("server stopped before it started")
            if time.monotonic() > deadline:
                await self.stop()
                raise TimeoutError(f"server on port {self.port} did not start in {timeout} s")
            await asyncio.sleep(0.01)
        return self.base_url

    async def stop(self, timeout: float = 5.0) -> None:  # noqa: ASYNC109
        """Stop serving; force-close connections if a graceful stop takes too long."""
        server, task = self._server, self._task
        if server is None or task is None:
            return
        server.should_exit = True
        try:
            await asyncio.wait_for(asyncio.shield(task), timeout)
        except TimeoutError:
            server.force_exit = True
            with contextlib.suppress(asyncio.CancelledError):
                await task
        finally:
            self._server = None
            self._task = None
            if self._socket is not None:
                self._socket.close()
                self._socket = None


def _rfc2822(moment: datetime) -> str:
    return format_datetime(moment, usegmt=True)


def _now() -> datetime:
    return datetime.now(UTC)


@dataclass(frozen=True)
class RecordedRequest:
    """One request the fake API received, and how it answered."""

    t: float
    method: str
    path: str
    form: dict[str, str]
    headers: dict[str, str]
    authorized: bool
    status: int


@dataclass(frozen=True)
class CallbackRecord:
    """A signed status callback the fake API sent."""

    t: float
    url: str
    delivered_to: str
    params: dict[str, str]
    signature: str
    status_code: int | None
    error: str | None


# Twilio's AnsweredBy values (a created call's outcome may name one).
AMD_ANSWERS = frozenset(
    {"human", "machine_start", "machine_end_beep", "machine_end_silence", "machine_end_other",
     "fax", "unknown"}
)  # fmt: skip


@dataclass
class FakeCall:
    """A call known to the fake API."""

    sid: str
    account_sid: str
    from_number: str
    to_number: str
    status: str = "in-progress"
    direction: str = "inbound"
    created: datetime = field(default_factory=_now)
    ended: datetime | None = None
    twiml: list[str] = field(default_factory=list)
    params: dict[str, str] = field(default_factory=dict)  # a created call's create params
    answered_by: str | None = None
    said: list[str] = field(default_factory=list)  # the `<Say>`s a created call's TwiML played
    conference: str | None = None  # the room it is in

    def resource(self) -> dict[str, Any]:
        uri = f"/{API_VERSION}/Accounts/{self.account_sid}/Calls/{self.sid}.json"
        base = uri.removesuffix(".json")
        duration = None
        if self.ended is not None:
            duration = str(int((self.ended - self.created).total_seconds()))
        return {
            "sid": self.sid,
            "date_created": _rfc2822(self.created),
            "date_updated": _rfc2822(self.ended or self.created),
            "parent_call_sid": None,
            "account_sid": self.account_sid,
            "to": self.to_number,
            "to_formatted": self.to_number,
            "from": self.from_number,
            "from_formatted": self.from_number,
            "phone_number_sid": "PN" + "0" * 32,
            "status": self.status,
            "start_time": _rfc2822(self.created),
            "end_time": _rfc2822(self.ended) if self.ended else None,
            "duration": duration,
            "price": None,
            "price_unit": "USD",
            "direction": self.direction,
            "answered_by": self.answered_by,
            "api_version": API_VERSION,
            "forwarded_from": None,
            "group_sid": None,
            "caller_name": None,
            "queue_time": "0",
            "trunk_sid": None,
            "uri": uri,
            "subresource_uris": {
                "notifications": f"{base}/Notifications.json",
                "recordings": f"{base}/Recordings.json",
                "streams": f"{base}/Streams.json",
                "payments": f"{base}/Payments.json",
                "events": f"{base}/Events.json",
            },
        }


@dataclass
class FakeConference:
    """A conference room: who entered, in order, with their `<Conference>` attributes."""

    name: str
    participants: list[tuple[str, dict[str, str]]] = field(default_factory=list)
    ended: bool = False

    @property
    def call_sids(self) -> list[str]:
        return [sid for sid, _ in self.participants]


@dataclass
class FakeMessage:
    """An SMS sent through the fake API, with every status it went through."""

    sid: str
    account_sid: str
    to_number: str
    from_number: str
    body: str
    status_callback: str | None
    messaging_service_sid: str | None = None
    status: str = "queued"
    statuses: list[str] = field(default_factory=lambda: ["queued"])
    error_code: int | None = None
    created: datetime = field(default_factory=_now)
    sent: datetime | None = None

    def resource(self) -> dict[str, Any]:
        uri = f"/{API_VERSION}/Accounts/{self.account_sid}/Messages/{self.sid}.json"
        base = uri.removesuffix(".json")
        return {
            "body": self.body,
            "num_segments": str(max(1, -(-len(self.body) // 160))),
            "direction": "outbound-api",
            "from": self.from_number,
            "to": self.to_number,
            "date_updated": _rfc2822(self.sent or self.created),
            "price": None,
            "error_message": None,
            "uri": uri,
            "account_sid": self.account_sid,
            "num_media": "0",
            "status": self.status,
            "messaging_service_sid": self.messaging_service_sid,
            "sid": self.sid,
            "date_sent": _rfc2822(self.sent) if self.sent else None,
            "date_created": _rfc2822(self.created),
            "error_code": self.error_code,
            "price_unit": "USD",
            "api_version": API_VERSION,
            "subresource_uris": {
                "media": f"{base}/Media.json",
                "feedback": f"{base}/Feedback.json",
            },
        }


def _error(status: int, code: int, message: str) -> JSONResponse:
    return JSONResponse(
        {
            "code": code,
            "message": message,
            "more_info": f"https://www.twilio.com/docs/errors/{code}",
            "status": status,
        },
        status_code=status,
    )


class FakeTwilioApi:
    """Twilio's REST API for one account, served locally (see the module docstring).

    `callback_base_url`, when set, replaces scheme and host of status callback URLs for
    delivery (the signature still covers the URL as given, like behind a proxy).
    """

    def __init__(
        self,
        *,
        account_sid: str = DEFAULT_ACCOUNT_SID,
        auth_token: str = DEFAULT_AUTH_TOKEN,
        sms_outcome: SmsOutcome = "delivered",
        sms_step_delay_s: float = 0.05,
        callback_base_url: str | None = None,
        call_status_callback_url: str | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
        timeout: float = 10.0,
    ) -> None:
        self.account_sid = account_sid
        self.auth_token = auth_token
        self.sms_outcome: SmsOutcome = sms_outcome
        self.sms_outcomes_by_to: dict[str, SmsOutcome] = {}
        # The ErrorCode a failed message to this number carries (30006: a landline).
        self.sms_error_codes_by_to: dict[str, int] = {}
        self.sms_step_delay_s = sms_step_delay_s
        # Faults and behaviours of the Messages API (see the module docstring).
        self.drop_callbacks = False
        self.hold_queued = False
        self.callback_order: CallbackOrder = "normal"
        self.duplicate_callbacks = 0
        self.hold_max_s = 30.0
        self.unsubscribed: set[str] = set()
        # `<Dial>` (transfers): the outcome per destination (answered, busy, no-answer,
        # failed; default answered), how long it rings and how long the person talks.
        self.dial_outcomes: dict[str, str] = {}
        self.dial_ring_s = 0.3
        self.dial_talk_s = 0.5
        self.dials: list[tuple[str, str, str]] = []  # (call sid, destination, result)
        # Outbound calls (Calls.json): who or what answers (or busy, no-answer, failed), per
        # number and by default; how long it rings, a machine's greeting, the AMD delay.
        self.call_outcome = "human"
        self.call_outcomes: dict[str, str] = {}
        self.ring_s = 0.2
        self.machine_greeting_ms = 1200.0
        self.amd_delay_s = 0.3
        self.outbound_callers: dict[str, FakeTwilioCaller] = {}
        # Created calls that run TwiML (warm transfers): how long each `<Say>` plays.
        self.say_s = 0.2
        self.conferences: dict[str, FakeConference] = {}
        self._lose_call_answers = 0
        self._lose_answers = 0
        self._reject_codes: list[int] = []
        self._released = asyncio.Event()
        self._answers_released = asyncio.Event()
        self.callback_base_url = callback_base_url
        self.call_status_callback_url = call_status_callback_url
        self.timeout = timeout
        self.requests: list[RecordedRequest] = []
        self.callbacks: list[CallbackRecord] = []
        self.calls: dict[str, FakeCall] = {}
        self.messages: dict[str, FakeMessage] = {}
        self._callers: dict[str, FakeTwilioCaller] = {}
        self._failures: list[tuple[int, int, str]] = []
        self._tasks: set[asyncio.Task[None]] = set()
        self._changed = asyncio.Event()
        self._http: httpx.AsyncClient | None = None
        self._validator = RequestValidator(auth_token)
        prefix = f"/{API_VERSION}/Accounts/{{account_sid}}"
        app = Starlette(
            routes=[
                Route(f"{prefix}/Calls.json", self._calls, methods=["GET", "POST"]),
                Route(f"{prefix}/Calls/{{call_sid}}.json", self._call, methods=["GET", "POST"]),
                Route(f"{prefix}/Messages.json", self._messages, methods=["GET", "POST"]),
                Route(f"{prefix}/Messages/{{message_sid}}.json", self._get_message),
            ]
        )
        self._server = InProcessServer(app, host, port)

    # Lifecycle.

    @property
    def base_url(self) -> str:
        """Where the API listens: give this to `make_twilio_client(api_base_url=...)`."""
        return self._server.base_url

    async def start(self) -> str:
        """Start serving; return the base URL."""
        self._http = httpx.AsyncClient(timeout=self.timeout)
        return await self._server.start()

    async def stop(self) -> None:
        """Let pending callbacks and hangups finish (briefly), then stop serving."""
        tasks = list(self._tasks)
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=self.timeout)
            for task in pending:
                task.cancel()
            for task in pending:
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        await self._server.stop()
        if self._http is not None:
            await self._http.aclose()
            self._http = None

    async def __aenter__(self) -> FakeTwilioApi:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    # Scenario control.

    def attach(self, caller: FakeTwilioCaller) -> FakeCall:
        """Know `caller`'s call: REST updates to its CallSid act on that caller."""
        call = self.add_call(caller.call_sid, caller.from_number, caller.to_number)
        self._callers[caller.call_sid] = caller
        return call

    def add_call(self, call_sid: str, from_number: str, to_number: str) -> FakeCall:
        """Know a live call without a fake caller behind it."""
        call = FakeCall(call_sid, self.account_sid, from_number, to_number)
        self.calls[call_sid] = call
        return call

    def fail_next(self, count: int = 1, status: int = 503, code: int = 20503) -> None:
        """Answer the next `count` API requests with an error (after auth succeeds)."""
        message = "Service Unavailable" if status >= 500 else "Too Many Requests"
        self._failures.extend([(status, code, message)] * count)

    def lose_message_answers(self, count: int = 1) -> None:
        """The next `count` creates are accepted (the message exists and goes on to be
        sent) but their HTTP answer never comes, until `release_answers` or `hold_max_s`."""
        self._lose_answers += count
        self._answers_released = asyncio.Event()

    def lose_call_answers(self, count: int = 1) -> None:
        """The next `count` call creates are accepted (the call is placed and goes on) but
        their HTTP answer never comes, until `release_answers` or `hold_max_s`."""
        self._lose_call_answers += count
        self._answers_released = asyncio.Event()

    def created_calls(self, to: str | None = None) -> list[FakeCall]:
        """Calls placed through `POST Calls.json` (to `to`), in the order they were made."""
        made = [c for c in self.calls.values() if c.direction == "outbound-api"]
        return sorted((c for c in made if to is None or c.to_number == to), key=lambda c: c.created)

    def release_answers(self) -> None:
        self._answers_released.set()

    def reject_next_message(self, code: int) -> None:
        """The next create is refused with Twilio error `code` (e.g. 21610, 21614)."""
        self._reject_codes.append(code)

    def release_messages(self) -> None:
        """Let messages held in `queued` (hold_queued) go on."""
        self.hold_queued = False
        self._released.set()

    def created_messages(self) -> list[FakeMessage]:
        """Messages in the order they were created."""
        return sorted(self.messages.values(), key=lambda m: m.created)

    def messages_to(self, number: str) -> list[FakeMessage]:
        return [m for m in self.created_messages() if m.to_number == number]

    async def send_inbound_sms(
        self, url: str, from_number: str, to_number: str, body: str
    ) -> int | None:
        """An SMS from a caller to our number, POSTed (signed) to the messaging webhook
        `url` as Twilio does; STOP / START also update Twilio's own opt-out list."""
        word = body.strip().upper()
        params = {
            "MessageSid": "SM" + secrets.token_hex(16),
            "SmsSid": "",
            "AccountSid": self.account_sid,
            "From": from_number,
            "To": to_number,
            "Body": body,
            "NumMedia": "0",
            "ApiVersion": API_VERSION,
        }
        params["SmsSid"] = params["MessageSid"]
        if word in STOP_WORDS:
            self.unsubscribed.add(from_number)
            params["OptOutType"] = "STOP"
        elif word in START_WORDS:
            self.unsubscribed.discard(from_number)
            params["OptOutType"] = "START"
        return await self._callback(url, params)

    def requests_to(self, path_suffix: str, method: str = "POST") -> list[RecordedRequest]:
        """Recorded requests whose path ends with `path_suffix`."""
        return [r for r in self.requests if r.method == method and r.path.endswith(path_suffix)]

    async def wait_for(
        self,
        predicate: Callable[[FakeTwilioApi], bool],
        timeout: float = 10.0,  # noqa: ASYNC109
    ) -> None:
        """Wait until `predicate(api)` holds; TimeoutError after `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while True:
            self._changed.clear()
            if predicate(self):
                return
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"fake Twilio API condition not met within {timeout} s")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), remaining)

    # HTTP handlers.

    def _spawn(self, coro: Coroutine[Any, Any, Any], name: str) -> None:
        task = asyncio.create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _authorized(self, request: Request) -> bool:
        header = request.headers.get("authorization", "")
        scheme, _, encoded = header.partition(" ")
        if scheme.lower() != "basic":
            return False
        try:
            user, _, password = base64.b64decode(encoded).decode().partition(":")
        except ValueError:
            return False
        return (
            secrets.compare_digest(user, self.account_sid)
            and secrets.compare_digest(password, self.auth_token)
            and request.path_params.get("account_sid") == self.account_sid
        )

    async def _admit(self, request: Request) -> tuple[dict[str, str], JSONResponse | None]:
        """Read the form, check auth and injected failures; an error response or None."""
        form_data = await request.form()
        form = {k: v for k, v in form_data.items() if isinstance(v, str)}
        if not self._authorized(request):
            return form, JSONResponse(
                {
                    "code": 20003,
                    "detail": "Your AccountSid or AuthToken was incorrect.",
                    "message": "Authenticate",
                    "more_info": "https://www.twilio.com/docs/errors/20003",
                    "status": 401,
                },
                status_code=401,
                headers={"WWW-Authenticate": 'Basic realm="Twilio API"'},
            )
        if self._failures:
            status, code, message = self._failures.pop(0)
            return form, _error(status, code, message)
        return form, None

    def _record(
        self, request: Request, form: dict[str, str], response: JSONResponse
    ) -> JSONResponse:
        headers = {k: v for k, v in request.headers.items() if k.lower() != "authorization"}
        self.requests.append(
            RecordedRequest(
                time.monotonic(),
                request.method,
                request.url.path,
                form,
                headers,
                response.status_code != 401,
                response.status_code,
            )
        )
        self._changed.set()
        return response

    def _not_found(self, request: Request) -> JSONResponse:
        return _error(404, 20404, f"The requested resource {request.url.path} was not found")

    async def _call(self, request: Request) -> JSONResponse:
        form, refused = await self._admit(request)
        if refused is not None:
            return self._record(request, form, refused)
        call = self.calls.get(request.path_params["call_sid"])
        if call is None:
            return self._record(request, form, self._not_found(request))
        caller = self._callers.get(call.sid)
        if caller is not None and caller.closed and call.status == "in-progress":
            # The caller hung up, or the stream ended with nothing after it: the call is over.
            call.status = "completed"
            call.ended = _now()
        if request.method == "POST":
            response = self._update_call(call, form)
            if response is not None:
                return self._record(request, form, response)
        return self._record(request, form, JSONResponse(call.resource()))

    def _update_call(self, call: FakeCall, form: dict[str, str]) -> JSONResponse | None:
        status = form.get("Status")
        twiml = form.get("Twiml")
        if status is None and twiml is None and form.get("Url") is None:
            return None
        if status == "canceled":
            # Twilio cancels a call not yet answered; an answered one it leaves alone.
            if call.status in ("queued", "ringing"):
                call.status = "canceled"
                call.ended = _now()
                self._changed.set()
                url = call.params.get("StatusCallback")
                if url:
                    self._spawn(
                        self._send_status(url, self._status_params(call)),
                        f"fake-twilio-cancel-{call.sid}",
                    )
            return None
        if call.status != "in-progress":
            return _error(400, 21220, "Call is not in-progress. Cannot redirect.")
        caller = self._callers.get(call.sid)
        if status == "completed":
            self._complete(call, caller, "call completed through the REST API")
        elif twiml is not None:
            call.twiml.append(twiml)
            if caller is not None:
                caller.twiml_updates.append(twiml)
            parsed = parse_twiml(twiml)
            if parsed.conference is not None:
                # The stream stops; the caller enters the room.
                self._enter(call, parsed.conference, parsed.conference_attrs)
                if caller is not None:
                    self._spawn(
                        caller.join_conference_by_twilio(parsed.conference),
                        f"fake-twilio-conference-{call.sid}",
                    )
                return None
            if parsed.dial is not None:
                # A transfer: the stream stops, the destination rings (see transfer_by_twilio).
                result = self.dial_outcomes.get(parsed.dial.destination, "answered")
                self.dials.append((call.sid, parsed.dial.destination, result))
                if caller is not None:
                    self._spawn(
                        caller.transfer_by_twilio(
                            parsed.dial, result, self.dial_ring_s, self.dial_talk_s
                        ),
                        f"fake-twilio-dial-{call.sid}",
                    )
                return None
            # New instructions replace <Connect><Stream>: the stream stops. Without a new
            # stream the call ends once the instructions have run.
            if parse_twiml(twiml).kind != "stream":
                self._complete(call, caller, "call updated with TwiML that ends it")
        return None

    def _complete(self, call: FakeCall, caller: FakeTwilioCaller | None, reason: str) -> None:
        call.status = "completed"
        call.ended = _now()
        if caller is not None:
            self._spawn(caller.end_by_twilio(reason), f"fake-twilio-hangup-{call.sid}")
        status_url = call.params.get("StatusCallback") or self.call_status_callback_url
        if status_url:
            params = {
                "CallSid": call.sid,
                "AccountSid": call.account_sid,
                "From": call.from_number,
                "To": call.to_number,
                "CallStatus": "completed",
                "Direction": call.direction,
                "ApiVersion": API_VERSION,
                "CallDuration": str(int((call.ended - call.created).total_seconds())),
            }
            self._spawn(
                self._send_status(status_url, params), f"fake-twilio-call-status-{call.sid}"
            )
        self._changed.set()

    # Conferences.

    def _enter(self, call: FakeCall, name: str, attrs: dict[str, str]) -> FakeConference:
        room = self.conferences.get(name)
        if room is None or room.ended:
            room = self.conferences[name] = FakeConference(name)
        room.participants.append((call.sid, dict(attrs)))
        call.conference = name
        self._changed.set()
        return room

    async def hang_up(self, call_sid: str) -> None:
        """The party of `call_sid` hangs up (see the module docstring: conferences)."""
        call = self.calls[call_sid]
        if call.status in ("completed", "busy", "no-answer", "failed", "canceled"):
            return
        caller = self._callers.get(call_sid)
        room = self.conferences.get(call.conference or "")
        self._complete(call, caller, "hung up")
        if room is None or room.ended:
            return
        attrs = dict(room.participants).get(call_sid, {})
        if attrs.get("endConferenceOnExit") == "true":
            room.ended = True
            for sid in room.call_sids:
                other = self.calls.get(sid)
                if sid == call_sid or other is None or other.status != "in-progress":
                    continue
                other_caller = self._callers.get(sid)
                if other_caller is not None:
                    other_caller.conference_ended()
                self._complete(other, None, "the conference ended")

    # Outbound calls.

    async def _calls(self, request: Request) -> JSONResponse:
        if request.method == "GET":
            return await self._list_calls(request)
        return await self._create_call(request)

    async def _create_call(self, request: Request) -> JSONResponse:
        form, refused = await self._admit(request)
        if refused is not None:
            return self._record(request, form, refused)
        to, sender, url = form.get("To"), form.get("From"), form.get("Url")
        if not to:
            return self._record(request, form, _error(400, 21201, "No 'To' number is specified"))
        if not sender:
            return self._record(request, form, _error(400, 21213, "No 'From' number is specified"))
        if not url and not form.get("Twiml"):
            return self._record(request, form, _error(400, 21205, "Url parameter is required."))
        events = (await request.form()).getlist("StatusCallbackEvent")
        if events:
            form["StatusCallbackEvent"] = " ".join(str(e) for e in events)
        call = FakeCall(
            "CA" + secrets.token_hex(16),
            self.account_sid,
            sender,
            to,
            status="queued",
            direction="outbound-api",
            params=form,
        )
        self.calls[call.sid] = call
        self._spawn(self._place(call), f"fake-twilio-place-{call.sid}")
        response = self._record(request, form, JSONResponse(call.resource(), status_code=201))
        if self._lose_call_answers > 0:
            # Placed, and the answer is lost: hold it until the client has given up.
            self._lose_call_answers -= 1
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.hold_max_s):
                    await self._answers_released.wait()
        return response

    async def _place(self, call: FakeCall) -> None:
        """Ring the number; then what `call_outcomes` says happens (see the module docstring)."""
        from telephony.sim.fake_caller import FakeTwilioCaller

        outcome = self.call_outcomes.get(call.to_number, self.call_outcome)
        if "Url" not in call.params:
            await self._run_created(call, outcome)
            return
        call.status = "ringing"
        await asyncio.sleep(self.ring_s)
        if outcome in ("busy", "no-answer", "failed"):
            call.status = outcome
            call.ended = _now()
            self._changed.set()
            if call.params.get("StatusCallback"):
                await self._callback(call.params["StatusCallback"], self._status_params(call))
            return
        call.status = "in-progress"
        call.answered_by = outcome
        url = call.params["Url"]
        public = urlsplit(url)
        deliver = urlsplit(self.delivery_url(url))
        callee = FakeTwilioCaller(
            f"{deliver.scheme}://{deliver.netloc}",
            public_url=f"{public.scheme}://{public.netloc}",
            voice_path=public.path + (f"?{public.query}" if public.query else ""),
            auth_token=self.auth_token,
            account_sid=self.account_sid,
            from_number=call.from_number,
            to_number=call.to_number,
            call_sid=call.sid,
            direction="outbound-api",
            timeout=self.timeout,
        )
        self._callers[call.sid] = callee
        self.outbound_callers[call.sid] = callee
        self._changed.set()
        await callee.dial()
        if outcome.startswith("machine") and callee.state.value == "streaming":
            await callee.play_speech(self.machine_greeting_ms)  # "leave a message…", the beep
        await asyncio.sleep(self.amd_delay_s)
        amd_url = call.params.get("AsyncAmdStatusCallback")
        if amd_url and call.params.get("MachineDetection"):
            params = {
                "CallSid": call.sid,
                "AccountSid": self.account_sid,
                "AnsweredBy": outcome,
                "MachineDetectionDuration": str(int(self.amd_delay_s * 1000)),
            }
            await self._callback(amd_url, params)

    async def _run_created(self, call: FakeCall, outcome: str) -> None:
        """A created call with inline `Twiml` (see the module docstring)."""
        url = call.params.get("StatusCallback")
        wanted = call.params.get("StatusCallbackEvent", "").replace(",", " ").split()

        async def report(final: bool = False) -> None:
            if not url:
                return
            if final:
                await self._send_status(url, self._status_params(call))
            elif call.status == "ringing" and "ringing" in wanted:
                await self._callback(url, self._status_params(call))
            elif call.status == "in-progress" and "answered" in wanted:
                await self._callback(url, self._status_params(call))

        call.status = "ringing"
        await report()
        await asyncio.sleep(self.ring_s)
        if call.status != "ringing":
            return  # cancelled while it rang
        if outcome in ("busy", "no-answer", "failed"):
            call.status = outcome
            call.ended = _now()
            self._changed.set()
            await report(final=True)
            return
        call.status = "in-progress"
        self._changed.set()
        await report()
        body = call.params["Twiml"]
        for _ in range(10):  # a redirect loop ends here, as Twilio's would
            parsed = parse_twiml(body)
            for text in parsed.says:
                call.said.append(text)
                self._changed.set()
                await asyncio.sleep(self.say_s)
                if outcome == "hangs-up":
                    break
            if outcome == "hangs-up" or call.status != "in-progress":
                break
            if parsed.kind == "conference" and parsed.conference is not None:
                self._enter(call, parsed.conference, parsed.conference_attrs)
                return  # in the room until someone hangs up
            if parsed.kind != "redirect" or parsed.redirect_url is None:
                break
            params = {**self._status_params(call), "CallStatus": "in-progress"}
            if call.params.get("MachineDetection"):
                # Its detector has answered before the TwiML runs: who picked up.
                params["AnsweredBy"] = outcome if outcome in AMD_ANSWERS else "human"
            response = await self._fetch(parsed.redirect_url, params)
            if response is None:
                break
            body = response
        if call.status == "in-progress":
            call.status = "completed"
            call.ended = _now()
            self._changed.set()
            await report(final=True)

    async def _fetch(self, url: str, params: dict[str, str]) -> str | None:
        """POST a signed TwiML request (a `<Redirect>`) and return the answer's body."""
        assert self._http is not None, "start() the fake API first"
        signature = self._validator.compute_signature(url, params)
        try:
            response = await self._http.post(
                self.delivery_url(url),
                data=params,
                headers={
                    "X-Twilio-Signature": signature,
                    "User-Agent": "TwilioProxy/1.1",
                    "Content-Type": "application/x-www-form-urlencoded; charset=UTF-8",
                },
            )
        except httpx.HTTPError:
            return None
        self.callbacks.append(
            CallbackRecord(
                time.monotonic(), url, self.delivery_url(url), params, signature,
                response.status_code, None,
            )
        )  # fmt: skip
        return response.text if response.status_code == 200 else None

    def _status_params(self, call: FakeCall) -> dict[str, str]:
        return {
            "CallSid": call.sid,
            "AccountSid": call.account_sid,
            "From": call.from_number,
            "To": call.to_number,
            "CallStatus": call.status,
            "Direction": call.direction,
            "ApiVersion": API_VERSION,
        }

    async def _list_calls(self, request: Request) -> JSONResponse:
        _, refused = await self._admit(request)
        query = dict(request.query_params)
        if refused is not None:
            return self._record(request, query, refused)
        selected = [c for c in self.calls.values() if _call_matches(c, query)]
        selected.sort(key=lambda c: c.created, reverse=True)
        path = f"/{API_VERSION}/Accounts/{self.account_sid}/Calls.json"
        size = max(1, min(1000, int(query.get("PageSize", "50") or 50)))
        uri = f"{path}?{urlencode({**query, 'PageSize': str(size), 'Page': '0'})}"
        payload = {
            "calls": [c.resource() for c in selected[:size]],
            "end": max(0, min(size, len(selected)) - 1),
            "first_page_uri": uri,
            "next_page_uri": None,
            "page": 0,
            "page_size": size,
            "previous_page_uri": None,
            "start": 0,
            "uri": uri,
        }
        return self._record(request, query, JSONResponse(payload))

    async def _messages(self, request: Request) -> JSONResponse:
        if request.method == "GET":
            return await self._list_messages(request)
        return await self._create_message(request)

    async def _create_message(self, request: Request) -> JSONResponse:
        form, refused = await self._admit(request)
        if refused is not None:
            return self._record(request, form, refused)
        to = form.get("To")
        service = form.get("MessagingServiceSid")
        sender = form.get("From") or (SERVICE_NUMBER if service else None)
        body = form.get("Body")
        if not to:
            return self._record(
                request, form, _error(400, 21604, "A 'To' phone number is required.")
            )
        if not sender:
            return self._record(
                request, form, _error(400, 21603, "A 'From' phone number is required.")
            )
        if not body and not form.get("MediaUrl"):
            return self._record(request, form, _error(400, 21602, "Message body is required."))
        code = self._reject_codes.pop(0) if self._reject_codes else None
        if code is None and to in self.unsubscribed:
            code = 21610
        if code is not None:
            status, text = _CREATE_ERRORS.get(code, (400, "Refused"))
            return self._record(request, form, _error(status, code, text))
        message = FakeMessage(
            sid="SM" + secrets.token_hex(16),
            account_sid=self.account_sid,
            to_number=to,
            from_number=sender,
            body=body or "",
            status_callback=form.get("StatusCallback"),
            messaging_service_sid=service,
        )
        self.messages[message.sid] = message
        outcome = self.sms_outcomes_by_to.get(to, self.sms_outcome)
        self._spawn(self._deliver(message, outcome), f"fake-twilio-sms-{message.sid}")
        response = self._record(request, form, JSONResponse(message.resource(), status_code=201))
        if self._lose_answers > 0:
            # Accepted, and the answer is lost: hold it until the client has given up.
            self._lose_answers -= 1
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.hold_max_s):
                    await self._answers_released.wait()
        return response

    async def _list_messages(self, request: Request) -> JSONResponse:
        _, refused = await self._admit(request)
        query = dict(request.query_params)
        if refused is not None:
            return self._record(request, query, refused)
        selected = [m for m in self.messages.values() if _matches(m, query)]
        # Newest first; messages not sent yet (no date_sent) are newest of all.
        selected.sort(key=lambda m: (m.sent or _FAR_FUTURE, m.created), reverse=True)
        try:
            size = max(1, min(1000, int(query.get("PageSize", "50"))))
            page = max(0, int(query.get("Page", "0")))
        except ValueError:
            return self._record(request, query, _error(400, 20001, "Invalid paging value"))
        chunk = selected[page * size : (page + 1) * size]
        path = f"/{API_VERSION}/Accounts/{self.account_sid}/Messages.json"
        base = {k: v for k, v in query.items() if k not in ("Page", "PageToken", "PageSize")}

        def uri(n: int) -> str:
            params = {**base, "PageSize": str(size), "Page": str(n), "PageToken": f"PA{n}"}
            return f"{path}?{urlencode(params)}"

        more = (page + 1) * size < len(selected)
        payload = {
            "messages": [m.resource() for m in chunk],
            "end": page * size + max(0, len(chunk) - 1),
            "first_page_uri": uri(0),
            "next_page_uri": uri(page + 1) if more else None,
            "page": page,
            "page_size": size,
            "previous_page_uri": uri(page - 1) if page > 0 else None,
            "start": page * size,
            "uri": uri(page),
        }
        return self._record(request, query, JSONResponse(payload))

    async def _get_message(self, request: Request) -> JSONResponse:
        form, refused = await self._admit(request)
        if refused is not None:
            return self._record(request, form, refused)
        message = self.messages.get(request.path_params["message_sid"])
        if message is None:
            return self._record(request, form, self._not_found(request))
        return self._record(request, form, JSONResponse(message.resource()))

    # Message lifecycle and callbacks.

    async def _deliver(self, message: FakeMessage, outcome: SmsOutcome) -> None:
        steps = ["failed"] if outcome == "failed" else ["sent", outcome]
        if self.hold_queued:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.hold_max_s):
                    await self._released.wait()
        callbacks: list[dict[str, str]] = []
        for status in steps:
            await asyncio.sleep(self.sms_step_delay_s)
            message.status = status
            message.statuses.append(status)
            if status == "sent":
                message.sent = _now()
            if status in _SMS_ERROR_CODES:
                code = self.sms_error_codes_by_to.get(message.to_number)
                message.error_code = code or _SMS_ERROR_CODES[status]
            self._changed.set()
            if message.status_callback:
                params = {
                    "SmsSid": message.sid,
                    "SmsStatus": status,
                    "MessageStatus": status,
                    "MessageSid": message.sid,
                    "AccountSid": message.account_sid,
                    "From": message.from_number,
                    "To": message.to_number,
                    "ApiVersion": API_VERSION,
                }
                if message.error_code is not None:
                    params["ErrorCode"] = str(message.error_code)
                if message.messaging_service_sid:
                    params["MessagingServiceSid"] = message.messaging_service_sid
                callbacks.append(params)
                if self.callback_order == "normal":
                    await self._send_status(message.status_callback, params)
        if self.callback_order == "late_sent" and message.status_callback:
            for params in reversed(callbacks):
                await self._send_status(message.status_callback, params)

    async def _send_status(self, url: str, params: dict[str, str]) -> None:
        if self.drop_callbacks:
            return
        for _ in range(1 + self.duplicate_callbacks):
            await self._callback(url, params)

    def delivery_url(self, url: str) -> str:
        """Where a callback for `url` is actually sent."""
        if not self.callback_base_url:
            return url
        base = urlsplit(self.callback_base_url)
        parts = urlsplit(url)
        return urlunsplit((base.scheme, base.netloc, parts.path, parts.query, parts.fragment))

    async def _callback(self, url: str, params: dict[str, str]) -> int | None:
        signature = self._validator.compute_signature(url, params)
        target = self.delivery_url(url)
        status_code: int | None = None
        error: str | None = None
        assert self._http is not None, "start() the fake API first"
        try:
            response = await self._http.post(
                target,
                data=params,
                headers={
                    "X-Twilio-Signature": signature,
                    "User-Agent": "TwilioProxy/1.1",
                    "Content-Type": "application/x-www-form-urlencoded; charset=UTF-8",
                },
            )
            status_code = response.status_code
        except httpx.HTTPError as exc:
            error = repr(exc)
        self.callbacks.append(
            CallbackRecord(time.monotonic(), url, target, params, signature, status_code, error)
        )
        self._changed.set()
        return status_code


_FAR_FUTURE = datetime.max.replace(tzinfo=UTC)


def _call_matches(call: FakeCall, query: dict[str, str]) -> bool:
    """Twilio's call list filters (`StartTime>=` taken as `StartTime>`, as Twilio does)."""
    for key, value in (("To", call.to_number), ("From", call.from_number)):
        if key in query and query[key] != value:
            return False
    if "Status" in query and query["Status"] != call.status:
        return False
    for key, test in (
        ("StartTime", lambda start, when: start.date() == when.date()),
        ("StartTime<", lambda start, when: start <= when),
        ("StartTime>", lambda start, when: start >= when),
        ("StartTime>=", lambda start, when: start >= when),
    ):
        if key not in query:
            continue
        when = _parse_when(query[key])
        if when is None or not test(call.created, when):
            return False
    return True


def _parse_when(value: str) -> datetime | None:
    try:
        moment = datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        return None
    return moment if moment.tzinfo else moment.replace(tzinfo=UTC)


def _matches(message: FakeMessage, query: dict[str, str]) -> bool:
    """Twilio's list filters; a date filter only matches messages that have a date_sent."""
    if "To" in query and message.to_number != query["To"]:
        return False
    if "From" in query and message.from_number != query["From"]:
        return False
    for key, test in (
        ("DateSent", lambda sent, when: sent.date() == when.date()),
        ("DateSent<", lambda sent, when: sent <= when),
        ("DateSent>", lambda sent, when: sent >= when),
    ):
        if key not in query:
            continue
        when = _parse_when(query[key])
        if when is None or message.sent is None or not test(message.sent, when):
            return False
    return True


__all__ = [
    "CallbackRecord",
    "FakeCall",
    "FakeMessage",
    "FakeTwilioApi",
    "InProcessServer",
    "RecordedRequest",
]
