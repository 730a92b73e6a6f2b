"""The media path's fast paths say at start-up whether they are on, and say the truth.

They read into uvicorn, websockets and the OpenAI SDK (`telephony/fast_paths.py`). On the
releases `pyproject.toml` admits every one is on; `.ci/run` runs this file on the newest
releases too, where a test here failing is the early word that a bound may not be raised.
The off cases take a library apart (never our code) and check the report and the fallback.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from openai.resources.realtime.realtime import AsyncRealtimeConnection
from uvicorn.protocols.websockets.websockets_sansio_impl import WebSocketsSansIOProtocol

from app.legs.twilio.media_ws import MediaWebSocketProtocol, missing_hooks
from app.server import fast_paths, uvicorn_config
from app.settings import Settings
from telephony.fast_paths import open_client_protocol, summary
from telephony.realtime_wire import LaneConnection, between_frames, nowait_sender
from tests.server_proc import ServerProcess

NAMES = [
    "media socket lane",
    "media socket own-frame reader",
    "uvicorn nowait sender",
    "realtime socket own-frame reader",
    "realtime direct send",
    "realtime nowait sender",
    "realtime session.update reuse",
    "model events by type",
    "listener long wait",
]


def _config(**values: Any) -> Any:
    return uvicorn_config(lambda *a: None, Settings(**values))


async def test_every_fast_path_is_on_with_the_releases_we_admit() -> None:
    paths = fast_paths(_config())
    assert [p.name for p in paths] == NAMES
    assert [p.name for p in paths if not p.active] == []
    line = summary(paths)
    assert line.startswith("fast paths (uvicorn ") and "websockets " in line
    assert " off" not in line


async def test_the_realtime_probe_is_the_decision_a_call_makes() -> None:
    # The probe's protocol is as the Realtime socket's is after its handshake: between frames.
    protocol: Any = open_client_protocol()
    assert between_frames(protocol)
    # Half a frame in: websockets' parser is inside it, so the connection must not read.
    protocol.receive_data(b"\x81\x7e\x01")
    assert not between_frames(protocol)


async def test_an_sdk_that_reconnects_by_itself_turns_the_direct_send_off(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # As if a release gave every connection a reconnect handler: frames must then go through
    # the SDK's queue (send_raw), and the report says the direct sends are off.
    original = AsyncRealtimeConnection.__init__

    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        self._on_reconnecting = lambda event: None

    monkeypatch.setattr(AsyncRealtimeConnection, "__init__", init)
    conn = AsyncRealtimeConnection(LaneConnection(open_client_protocol()))  # type: ignore[arg-type]
    assert nowait_sender(conn) is None
    report = {p.name: p for p in fast_paths(_config())}
    assert report["realtime socket own-frame reader"].active
    assert not report["realtime direct send"].active
    assert not report["realtime nowait sender"].active
    assert "realtime direct send off (" in summary(report.values())


async def test_a_uvicorn_without_a_hook_of_the_lane_gets_its_own_protocol(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert _config().ws is MediaWebSocketProtocol
    monkeypatch.delattr(WebSocketsSansIOProtocol, "send_receive_event_to_app")
    assert missing_hooks() == ["send_receive_event_to_app"]
    config = _config()
    # No lane and no crash: uvicorn's protocol as it is (routes_twilio finds no lane in the
    # scope and the leg takes the ASGI path).
    assert config.ws == "websockets-sansio"
    media = fast_paths(config)[0]
    assert media.name == "media socket lane" and not media.active
    assert "send_receive_event_to_app" in media.note


async def test_serve_says_which_fast_paths_are_on(clean_db: str, tmp_path: Path) -> None:
    stderr = tmp_path / "serve.log"
    server = ServerProcess({"DATABASE_URL": clean_db, "LOG_LEVEL": "INFO"}, stderr_path=stderr)
    await server.start()
    await server.stop()
    lines = [x for x in stderr.read_text("utf-8", "replace").splitlines() if "fast paths (" in x]
    assert len(lines) == 1, lines
    for name in NAMES:
        assert f"{name} on" in lines[0]


class _Written:
    """The websocket under an SDK Realtime connection: keeps what is written."""

    def __init__(self) -> None:
        self.frames: list[str] = []

    async def send(self, data: str) -> None:
        self.frames.append(data)


async def test_a_session_update_goes_out_as_the_sdks_send_writes_it_and_its_text_is_reused() -> (
    None
):
    from openai.resources.realtime.realtime import AsyncRealtimeConnection

    from telephony.realtime_wire import EventTexts
    from telephony.session_config import BridgeConfig, session_update
    from tools.restaurant.catalog import restaurant_catalog

    session = session_update(BridgeConfig(), "audio/pcmu", restaurant_catalog().definitions())
    by_sdk, by_us = _Written(), _Written()
    await AsyncRealtimeConnection(by_sdk).session.update(event_id="e1", session=session)  # type: ignore[arg-type]
    sdk_conn = AsyncRealtimeConnection(by_sdk)  # type: ignore[arg-type]
    await sdk_conn.session.update(session=session)
    await sdk_conn.response.create(event_id="r1")
    await sdk_conn.response.create(event_id="r2", response={"instructions": 'Say "hi".'})
    await sdk_conn.response.create(event_id="r3")
    texts = EventTexts(size=1)
    conn = AsyncRealtimeConnection(by_us)  # type: ignore[arg-type]
    event = {"type": "session.update", "session": session, "event_id": "e1"}
    await texts.send(conn, event)
    await texts.send(conn, event)
    # The same event under another id: the kept text, the id written into it.
    await texts.send(conn, {**event, "event_id": "e2"})
    await texts.send(conn, {k: v for k, v in event.items() if k != "event_id"})
    # Other events: their own texts (size 1: the one before forgotten).
    await texts.send(conn, {"type": "response.create", "event_id": "r1"})
    await texts.send(
        conn,
        {"type": "response.create", "event_id": "r2", "response": {"instructions": 'Say "hi".'}},
    )
    await texts.send(conn, {"type": "response.create", "event_id": "r3"})
    assert EventTexts.available()
    assert by_us.frames[:2] == [by_sdk.frames[0]] * 2
    assert json.loads(by_us.frames[2]) == {**json.loads(by_sdk.frames[0]), "event_id": "e2"}
    assert by_us.frames[3] == by_sdk.frames[1]
    assert [json.loads(f) for f in by_us.frames[4:]] == [json.loads(f) for f in by_sdk.frames[2:]]
    assert texts.reused == 3


@pytest.mark.parametrize(
    ("base_url", "websocket_base_url", "env", "expected"),
    [
        ("http://10.9.0.1:8081/v1", None, {"HTTP_PROXY": "http://proxy.local:3128"}, "http"),
        ("https://api.example.test/v1", None, {"HTTPS_PROXY": "http://p.local:8080"}, "https"),
        (
            "https://api.example.test/v1",
            None,
            {"HTTPS_PROXY": "http://p.local:8080", "NO_PROXY": "api.example.test"},
            None,
        ),
        (
            "https://api.example.test/v1",
            "ws://10.9.0.2:9000/v1",
            {"HTTPS_PROXY": "http://p.local:8080", "HTTP_PROXY": "http://q.local:3128"},
            "https",  # websockets favours an https proxy over an http one, even for ws://
        ),
        ("https://api.example.test/v1", None, {}, None),
    ],
)
def test_the_realtime_socket_takes_the_proxy_websockets_would_look_up_for_the_sdks_url(
    monkeypatch: pytest.MonkeyPatch,
    base_url: str,
    websocket_base_url: str | None,
    env: dict[str, str],
    expected: str | None,
) -> None:
    import uuid

    from openai import AsyncOpenAI

    # Where websockets' client finds them, in each release it has had them.
    from websockets.asyncio.client import get_proxy, parse_uri

    from telephony.realtime_wire import proxy_resolved

    for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "NO_PROXY", "WS_PROXY", "WSS_PROXY"):
        monkeypatch.delenv(name, raising=False)
        monkeypatch.delenv(name.lower(), raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    # A path of its own: the lookup is kept per server URL and options.
    base_url += f"/{uuid.uuid4().hex}"
    client = AsyncOpenAI(
        api_key="sk-test", base_url=base_url, websocket_base_url=websocket_base_url
    )
    options = {"compression": None}
    resolved = proxy_resolved(options, client)
    # The SDK's own URL for the socket, and websockets' own lookup for it.
    url = str(client.realtime.connect(model="gpt-realtime")._prepare_url())
    looked_up = get_proxy(parse_uri(url))
    assert resolved == {"compression": None, "proxy": looked_up}
    assert looked_up == (env.get(f"{expected.upper()}_PROXY") if expected else None)
    assert proxy_resolved(options, client) is resolved  # kept, not looked up again
    assert options == {"compression": None}  # the caller's options as they were
    named = {"compression": None, "proxy": None}
    assert proxy_resolved(named, client) is named  # a proxy stated is not overridden


async def test_an_sdk_whose_unions_moved_turns_the_events_by_type_off(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # As if a release no longer named GPT-Live's transcript model in its union: such events
    # go through parse_event (sdk_event finds no model), and the report says so.
    from telephony.bridge import live_link

    monkeypatch.setattr(live_link, "SERVER_EVENTS", {})
    report = {p.name: p for p in fast_paths(_config())}
    assert not report["model events by type"].active
    assert "model events by type off (the SDK's unions moved: GPT-Live)" in summary(report.values())
