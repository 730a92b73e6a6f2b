"""Which of the audio path's fast paths this process will use, said once at start-up.

The fast paths read into websockets, the OpenAI SDK and uvicorn (see `ws_frames`,
`realtime_wire`, `app/legs/twilio/media_ws.py`); each decides per connection whether it can act and
otherwise falls back to the library's own path, silently. A release that moves what they read
would make every call slower (or, where nothing checks, break it) without a word. So at
start-up each is probed with the same decision code a call runs, on objects built through the
libraries' public sans-I/O API with no socket, and the log says what is on and what is off.
"""

from __future__ import annotations

import logging
import types
from collections.abc import Iterable
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from typing import Any

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class FastPath:
    """One fast path: whether it is on, and with what (versions) or why not."""

    name: str
    active: bool
    note: str = ""  # why it is off, or a condition on it

    def describe(self) -> str:
        state = "on" if self.active else "off"
        return f"{self.name} {state} ({self.note})" if self.note else f"{self.name} {state}"


def package_version(name: str) -> str:
    try:
        return version(name)
    except PackageNotFoundError:
        return "not installed"


LIBRARIES = ("uvicorn", "websockets", "openai", "starlette", "fastapi", "psycopg")


def summary(paths: Iterable[FastPath]) -> str:
    """The start-up line: `fast paths (uvicorn 0.55.0, ...): media socket lane on, ...`."""
    versions = ", ".join(f"{name} {package_version(name)}" for name in LIBRARIES)
    return f"fast paths ({versions}): " + ", ".join(p.describe() for p in paths)


def open_client_protocol() -> object:
    """A websockets client protocol in state OPEN, its handshake done in memory against a
    server protocol (websockets' public sans-I/O API): what the Realtime socket's protocol is
    right after connecting."""
    from websockets.client import ClientProtocol
    from websockets.server import ServerProtocol
    from websockets.uri import parse_uri

    client = ClientProtocol(parse_uri("ws://fast-path.probe/"))
    server = ServerProtocol()
    client.send_request(client.connect())
    for data in client.data_to_send():
        server.receive_data(data)
    request = server.events_received()[0]
    server.send_response(server.accept(request))  # type: ignore[arg-type]
    for data in server.data_to_send():
        client.receive_data(data)
    return client


def realtime_fast_paths() -> list[FastPath]:
    """The Realtime socket's fast paths (telephony/realtime_wire.py), probed: must run in an
    event loop (websockets' connection binds to it)."""
    from openai.resources.realtime.realtime import AsyncRealtimeConnection

    from telephony import ws_frames
    from telephony.realtime_wire import (
        EventTexts,
        LaneConnection,
        between_frames,
        nowait_sender,
        raw_sender,
    )

    try:
        protocol = open_client_protocol()
        reader = between_frames(protocol)
        lane = LaneConnection(protocol)  # type: ignore[arg-type]
        conn = AsyncRealtimeConnection(lane)
        direct = raw_sender(conn) == lane.send
        nowait = direct and nowait_sender(conn) is not None
    except Exception as exc:  # a library that moved: the probe says so, the calls fall back
        log.debug("Realtime fast-path probe failed", exc_info=True)
        why = f"probe failed: {type(exc).__name__}"
        return [
            FastPath("realtime socket own-frame reader", False, why),
            FastPath("realtime direct send", False, why),
            FastPath("realtime nowait sender", False, why),
            _session_update_reuse(EventTexts),
            model_events_by_type(),
        ]
    # websockets' C extension masks client frames; without it a pure-Python loop does.
    c_masks = isinstance(ws_frames.apply_mask, types.BuiltinFunctionType)
    return [
        FastPath(
            "realtime socket own-frame reader",
            reader,
            ("" if c_masks else "Python masks")
            if reader
            else "websockets' parser not recognised between frames",
        ),
        FastPath(
            "realtime direct send",
            direct,
            "" if direct else "the SDK connection's reconnect queue is not where we look",
        ),
        FastPath(
            "realtime nowait sender",
            nowait,
            "" if nowait else "needs the direct send and the lane connection",
        ),
        _session_update_reuse(EventTexts),
        model_events_by_type(),
    ]


def model_events_by_type() -> FastPath:
    """realtime_wire.sdk_event: a handled model event validated against its own SDK model,
    found by type in the SDK's unions (Realtime, GPT-Live's primary socket and its sideband).
    Where a union no longer names the models we look for, those events go through the SDK's
    `parse_event` as before."""
    from telephony.bridge.live_link import SERVER_EVENTS as LIVE
    from telephony.bridge.live_link import SIDEBAND_EVENTS
    from telephony.bridge.realtime_link import SERVER_EVENTS as REALTIME

    missing = [
        name
        for name, classes, probe in (
            ("Realtime", REALTIME, "response.done"),
            ("GPT-Live", LIVE, "session.output_transcript.delta"),
            ("GPT-Live sideband", SIDEBAND_EVENTS, "session.output_transcript.delta"),
        )
        if probe not in classes
    ]
    return FastPath(
        "model events by type",
        not missing,
        f"the SDK's unions moved: {', '.join(missing)}" if missing else "",
    )


def _session_update_reuse(texts: Any) -> FastPath:
    """realtime_wire.EventTexts: the SDK's transform, run once per distinct session.update."""
    active = bool(texts.available())
    return FastPath(
        "realtime session.update reuse", active, "" if active else "the SDK's transform moved"
    )
