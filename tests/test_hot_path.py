"""The audio hot path's shortcuts agree with the typed models they stand in for.

Twilio media and mark frames are checked by hand (`parse_frame`), outbound media and mark
frames built by concatenation (`OutboundFrames`), the append frame spliced (`append_frame`),
audio deltas recognised before the SDK's parse (`frame_object`, `delta_fields_of`), the
set-up's session events read for their type and id (`session_event_fields`), and handled
events made into the SDK's models by type (`sdk_event`). Each is held here to the typed path:
same accepted frames, same values, same refusals.
"""

from __future__ import annotations

import asyncio
import base64
import json
import re
from typing import Any

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from openai.resources.live.live import AsyncLiveConnection
from openai.resources.live.sideband import AsyncSidebandConnection
from openai.resources.realtime.realtime import AsyncRealtimeConnection
from openai.types.live import ConnectServerEvent
from openai.types.live.server_event import ServerEvent
from openai.types.realtime import (
    InputAudioBufferAppendEvent,
    RealtimeServerEvent,
    ResponseAudioDeltaEvent,
)

from telephony.audio import base64_size
from telephony.errors import MalformedFrame
from telephony.legs.twilio.events import (
    Mark,
    MarkFrame,
    Media,
    MediaFrame,
    OutboundFrames,
    hot_frame,
    mark_message,
    media_message,
    parse_frame,
    parse_inbound,
    parse_outbound,
)
from telephony.realtime_wire import (
    AudioDelta,
    append_frame,
    delta_fields_of,
    event_classes,
    frame_object,
    sdk_event,
    session_event_fields,
)
from telephony.watchdog import Watchdog
from tests.test_fuzz_parsers import _frameish, json_values

FAST = settings(
    max_examples=300,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)

_b64 = st.binary(max_size=400).map(lambda b: base64.b64encode(b).decode())
# Media frames that are nearly right: real shapes with a field or two off.
_media_values = st.one_of(
    _b64,
    st.sampled_from(["", "AA==", "AA=", "A", "!!!", "AAAA====", "\u00e9\u00e9==", " AAAA"]),
    json_values,
)
_near_media = st.fixed_dictionaries(
    {
        "event": st.sampled_from(["media", "mark"]),
        "media": st.fixed_dictionaries(
            {"payload": _media_values},
            optional={
                "track": st.sampled_from(["inbound", "outbound", "inbound_track"]) | json_values,
                "timestamp": st.sampled_from(["0", "20", "-1", " 7", "1_0", "x"]) | json_values,
                "chunk": st.sampled_from(["1"]) | json_values,
            },
        ),
        "mark": st.fixed_dictionaries({}, optional={"name": st.text(max_size=20) | json_values}),
    },
    optional={
        "streamSid": st.sampled_from(["MZ1"]) | json_values,
        "stream_sid": json_values,
        "sequenceNumber": st.sampled_from(["3"]) | json_values,
        "sequence_number": json_values,
    },
)


def _typed(raw: str) -> tuple[str, Any]:
    """What the model path makes of a frame: ("error", None) or ("ok", message)."""
    try:
        message = parse_inbound(raw)
    except MalformedFrame:
        return "error", None
    if isinstance(message, Media):
        try:
            message.media.audio()
            message.media.timestamp_ms()
        except MalformedFrame:
            return "unusable", message
    return "ok", message


def _assert_agrees(raw: str) -> None:
    verdict, typed = _typed(raw)
    # The lane's check (hot_frame, on the socket's bytes) takes only what parse_frame's
    # hand check takes, with the same fields (what it leaves, the reader parses).
    hot = hot_frame(raw.encode("utf-8", "surrogatepass"))
    # A surrogate escape: orjson refuses a lone one where json takes it.
    lone_surrogate = re.search(r"\\u[dD][89a-fA-F]", raw) is not None
    try:
        fast = parse_frame(raw)
    except MalformedFrame:
        assert verdict == "error"
        assert hot is None
        return
    if isinstance(fast, MediaFrame):
        assert hot == (fast.track, fast.payload, fast.timestamp_ms) or (
            hot is None and lone_surrogate
        )
    elif isinstance(fast, MarkFrame):
        assert hot == fast.name or (hot is None and lone_surrogate)
    else:
        assert hot is None
    assert verdict != "error", "the hot path accepted a frame the models refuse"
    if isinstance(fast, MediaFrame):
        assert verdict == "ok" and isinstance(typed, Media)
        assert fast.payload == typed.media.payload
        assert fast.track == typed.media.track
        assert fast.timestamp_ms == typed.media.timestamp_ms()
    elif isinstance(fast, MarkFrame):
        assert isinstance(typed, Mark) and fast.name == typed.mark.name
    else:
        assert fast == typed
        # Every usable media or mark frame takes the hot path.
        assert not (verdict == "ok" and isinstance(typed, Media | Mark))


@FAST
@given(_near_media)
def test_hand_checked_media_and_mark_frames_agree_with_their_models(frame: dict) -> None:
    _assert_agrees(json.dumps(frame))


@FAST
@given(_frameish() | json_values)
def test_hand_checked_frames_agree_with_the_models_on_junk(frame: Any) -> None:
    _assert_agrees(json.dumps(frame, allow_nan=True))


@pytest.mark.parametrize(
    "raw",
    [
        '{"event":"media","media":{"payload":"AA==","timestamp":"' + "9" * 5000 + '"}}',
        '{"event":"media","media":{"payload":"\\ud800","timestamp":"1"}}',
        '{"event":"mark","mark":{"name":"\\ud800"}}',
        '{"event":"media","streamSid":"MZ\\u0000","media":{"payload":"AA=="}}',
        '{"event":"media","media":{"payload":"AA=="},"event":"mark","mark":{"name":"x"}}',
        "[" * 5000,
        "not json",
    ],
)
def test_hand_checked_frames_agree_with_the_models_at_the_edges(raw: str) -> None:
    _assert_agrees(raw)


def test_a_valid_media_frame_keeps_its_base64_as_sent() -> None:
    payload = base64.b64encode(bytes(range(160))).decode()
    frame = json.dumps(
        {
            "event": "media",
            "sequenceNumber": "4",
            "media": {"track": "inbound", "chunk": "2", "timestamp": "40", "payload": payload},
            "streamSid": "MZ1",
        }
    )
    assert parse_frame(frame) == MediaFrame("inbound", payload, 40)


@FAST
@given(st.text(max_size=40), st.text(max_size=60), st.binary(max_size=300))
def test_concatenated_outbound_frames_equal_the_models(sid: str, name: str, audio: bytes) -> None:
    frames = OutboundFrames(sid)
    payload = base64.b64encode(audio).decode()
    assert parse_outbound(frames.media(payload)) == parse_outbound(media_message(sid, audio))
    assert parse_outbound(frames.mark(name)) == parse_outbound(mark_message(sid, name))
    assert json.loads(frames.media(payload)) == json.loads(media_message(sid, audio))


@FAST
@given(st.binary(max_size=2000))
def test_base64_size_is_the_decoded_length(data: bytes) -> None:
    assert base64_size(base64.b64encode(data).decode()) == len(data)


@FAST
@given(st.binary(max_size=400))
def test_the_spliced_append_frame_is_a_valid_sdk_append_event(audio: bytes) -> None:
    payload = base64.b64encode(audio).decode()
    event = InputAudioBufferAppendEvent.model_validate_json(append_frame(payload))
    assert event.type == "input_audio_buffer.append" and event.audio == payload


def _fast_delta(raw: bytes) -> AudioDelta | None:
    """What the read loop and the lane make of a frame: parsed once, then the delta's fields."""
    data = frame_object(raw)
    fields = delta_fields_of(data) if data is not None else None
    return AudioDelta(*fields) if fields is not None else None


def _sdk_parse(raw: bytes) -> Any:
    # parse_event needs no live connection; call it unbound as the SDK's own code would.
    return AsyncRealtimeConnection.parse_event(None, raw)  # type: ignore[arg-type]


@FAST
@given(st.text(max_size=30), st.text(max_size=30), st.binary(max_size=600))
def test_audio_deltas_are_recognised_with_the_sdks_fields(
    response_id: str, item_id: str, audio: bytes
) -> None:
    raw = json.dumps(
        {
            "type": "response.output_audio.delta",
            "event_id": "ev_1",
            "response_id": response_id,
            "item_id": item_id,
            "output_index": 0,
            "content_index": 0,
            "delta": base64.b64encode(audio).decode(),
        }
    ).encode()
    fast = _fast_delta(raw)
    typed = _sdk_parse(raw)
    assert isinstance(typed, ResponseAudioDeltaEvent)
    assert fast == AudioDelta(typed.response_id, typed.item_id, typed.delta)


@pytest.mark.parametrize(
    "raw",
    [
        b'{"type":"response.output_audio_transcript.delta","delta":"hi","item_id":"i",'
        b'"response_id":"r"}',
        b'{"type":"response.output_audio.delta","response_id":"r","item_id":"i","delta":5}',
        b'{"type":"response.output_audio.delta","item_id":"i","delta":"AA=="}',
        b'{"type":"error","error":{"type":"x","message":"response.output_audio.delta"}}',
        b"[1]",
        b"not json",
        b"",
    ],
)
def test_everything_but_a_well_formed_audio_delta_is_left_to_the_sdk(raw: bytes) -> None:
    assert _fast_delta(raw) is None


_session_frames = st.fixed_dictionaries(
    {"type": st.sampled_from(["session.created", "session.updated", "error", "", "session"])},
    optional={
        "event_id": json_values,
        "session": st.fixed_dictionaries(
            {},
            optional={
                "id": st.text(max_size=80) | json_values,
                "type": st.sampled_from(["realtime", "transcription"]) | json_values,
                "model": json_values,
                "audio": json_values,
            },
        )
        | json_values,
    },
)


@FAST
@given(_session_frames | json_values)
def test_session_events_are_read_with_the_sdks_type_and_session_id(frame: Any) -> None:
    raw = json.dumps(frame).encode()
    fast = session_event_fields(raw)
    typed = _sdk_parse(raw)
    kind = getattr(typed, "type", None) if not isinstance(typed, dict) else typed.get("type")
    if kind not in ("session.created", "session.updated"):
        assert fast is None
        return
    # What the bridge read from the SDK's model before: the session's id, a non-empty string.
    sid = getattr(getattr(typed, "session", None), "id", None)
    assert fast == (kind, sid if isinstance(sid, str) and sid else None)


@pytest.mark.parametrize(
    "raw",
    [
        b'{"type":"error","error":{"type":"x","message":"session.updated"}}',
        b'{"type":["session.updated"],"session":{"id":"s"}}',
        b'{"type":{"session.updated":1}}',
        b"[1]",
        b"not json",
        b"",
    ],
)
def test_everything_but_a_session_event_is_left_to_the_sdk(raw: bytes) -> None:
    assert session_event_fields(raw) is None


# Handled events as the SDK's models, each validated against its own model rather than the
# SDK's whole union (realtime_wire.sdk_event): the same model, values and failures as the
# connection's own `parse_event`, on Realtime, GPT-Live's primary socket and its sideband.

_UNIONS = [
    (event_classes(RealtimeServerEvent), AsyncRealtimeConnection),
    (event_classes(ServerEvent), AsyncLiveConnection),
    (event_classes(ConnectServerEvent), AsyncSidebandConnection),
]
_plain_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**40), max_value=2**40)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=12)
    | st.sampled_from(["", "audio", "message", "assistant", "completed", "in_progress"]),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner),
    max_leaves=8,
)


@st.composite
def _event_frames(draw: st.DrawFn) -> tuple[int, dict[str, Any]]:
    which = draw(st.integers(0, len(_UNIONS) - 1))
    classes = _UNIONS[which][0]
    kind = draw(st.sampled_from(sorted(classes)))
    names = sorted(set(classes[kind].model_fields) - {"type"})
    keys = st.sampled_from(names) | st.text(max_size=6) if names else st.text(max_size=6)
    fields = draw(st.dictionaries(keys, _plain_values, max_size=len(names) + 1))
    return which, {**fields, "type": kind}


def _outcome(read: Any) -> tuple[Any, Any]:
    try:
        return read(), None
    except Exception as exc:
        return None, type(exc)


def _assert_same_event(which: int, frame: dict[str, Any]) -> None:
    classes, connection = _UNIONS[which]
    raw = json.dumps(frame).encode()
    data = orjson.loads(raw)
    expected, expected_error = _outcome(lambda: connection.parse_event(None, raw))  # type: ignore[arg-type]
    got, error = _outcome(lambda: sdk_event(data, classes))
    kind = data.get("type")
    if error is None and got is None:  # not a type it knows: the read asks `parse_event`
        assert type(kind) is not str or kind not in classes
        return
    assert error == expected_error
    if error is None:
        assert type(got) is type(expected)
        assert got == expected
        assert got.model_dump(warnings=False) == expected.model_dump(warnings=False)


def test_each_unions_models_are_found_by_type() -> None:
    realtime, live, sideband = (classes for classes, _ in _UNIONS)
    assert realtime["response.done"].__name__ == "ResponseDoneEvent"
    assert live["session.output_transcript.delta"].__name__ == "OutputTranscriptDeltaEvent"
    assert "transport.dtmf.received" in sideband
    assert sdk_event({"type": "no.such.event"}, realtime) is None
    assert sdk_event({"type": ["response.done"]}, realtime) is None


@FAST
@given(_event_frames())
def test_a_handled_event_is_the_sdks_own_model_of_it(case: tuple[int, dict[str, Any]]) -> None:
    _assert_same_event(*case)


_ITEM = {
    "id": "item_a",
    "object": "realtime.item",
    "type": "message",
    "status": "completed",
    "role": "assistant",
    "content": [{"type": "output_audio", "transcript": "Booked."}],
}
_RESPONSE = {
    "id": "resp_1",
    "object": "realtime.response",
    "status": "completed",
    "status_details": None,
    "output": [_ITEM],
    "conversation_id": "conv_1",
    "output_modalities": ["audio"],
    "max_output_tokens": "inf",
    "audio": {"output": {"format": {"type": "audio/pcmu"}, "voice": "marin"}},
    "usage": {
        "total_tokens": 9,
        "input_tokens": 5,
        "output_tokens": 4,
        "input_token_details": {"text_tokens": 1, "audio_tokens": 4, "cached_tokens": 0},
        "output_token_details": {"text_tokens": 1, "audio_tokens": 3},
    },
    "metadata": None,
}
_IDS = {"response_id": "resp_1", "item_id": "item_a", "output_index": 0, "content_index": 0}


@pytest.mark.parametrize(
    "frame",
    [
        {"type": "input_audio_buffer.speech_started", "audio_start_ms": 1000, "item_id": "u"},
        {"type": "input_audio_buffer.speech_started", "audio_start_ms": "1000", "item_id": "u"},
        {"type": "input_audio_buffer.speech_stopped", "audio_end_ms": 2400, "item_id": "u"},
        {"type": "input_audio_buffer.committed", "previous_item_id": None, "item_id": "u"},
        {"type": "conversation.item.input_audio_transcription.completed", "item_id": "u",
         "content_index": 0, "transcript": "A table for two",
         "usage": {"type": "duration", "seconds": 1.4}},
        {"type": "response.created", "response": {**_RESPONSE, "status": "in_progress",
                                                  "output": [], "usage": None}},
        {"type": "response.output_item.added", "response_id": "resp_1", "output_index": 0,
         "item": {**_ITEM, "status": "in_progress", "content": []}},
        {"type": "response.output_audio_transcript.done", **_IDS, "transcript": "Booked."},
        {"type": "response.output_item.done", "response_id": "resp_1", "output_index": 0,
         "item": _ITEM},
        {"type": "response.done", "response": _RESPONSE},
        {"type": "response.done", "response": {"id": "r", "output": [{"type": "function_call",
         "call_id": "c", "name": "book", "arguments": "{}"}]}},
        {"type": "error", "error": {"type": "x", "code": None, "message": "m"}},
    ],
)  # fmt: skip
def test_the_realtime_apis_own_events_are_the_sdks_models(frame: dict[str, Any]) -> None:
    _assert_same_event(0, {"event_id": "event_1", **frame})


@pytest.mark.parametrize(
    "frame",
    [
        {"type": "session.input_transcript.delta", "delta": "A table "},
        {"type": "session.output_transcript.delta", "delta": "booked "},
        {"type": "session.output_transcript.delta", "delta": "booked ", "start_ms": 10,
         "end_ms": 300},
        {"type": "session.closed", "reason": "expired"},
        {"type": "transport.dtmf.received", "event": "5"},
    ],
)  # fmt: skip
def test_gpt_lives_own_events_are_the_sdks_models(frame: dict[str, Any]) -> None:
    _assert_same_event(1, {"event_id": "event_1", **frame})
    _assert_same_event(2, {"event_id": "event_1", **frame})


# The watchdog that bounds per-frame awaits.


async def test_a_watchdog_turns_an_await_past_its_limit_into_a_timeout() -> None:
    watch = Watchdog(0.05)
    with pytest.raises(TimeoutError):
        with watch:
            await asyncio.Event().wait()
    # Reusable afterwards, and an await within the limit is left alone.
    with watch:
        await asyncio.sleep(0.01)
    watch.close()


async def test_a_watchdog_measures_each_await_from_its_own_start() -> None:
    watch = Watchdog(0.2)
    for _ in range(6):  # 6 x 0.05 s: longer than the limit in total, never in one await
        with watch:
            await asyncio.sleep(0.05)
    watch.close()


async def test_cancelling_a_watched_task_from_outside_is_a_cancel_not_a_timeout() -> None:
    watch = Watchdog(5.0)
    started = asyncio.Event()

    async def body() -> None:
        with watch:
            started.set()
            await asyncio.Event().wait()

    task = asyncio.create_task(body())
    await started.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    watch.close()


async def test_a_watchdog_guards_one_await_at_a_time() -> None:
    watch = Watchdog(1.0)
    with watch, pytest.raises(RuntimeError):
        with watch:
            pass
    watch.close()


async def test_progress_keeps_a_watched_await_alive_then_it_times_out_within_a_quarter_more() -> (
    None
):
    """The leg's lane counts frames instead of touching the idle watchdog per frame: while the
    count moves the await lives on past its limit; once it stops, the timeout comes between 1
    and 1.25 limits after the last progress (the timer looks every quarter limit)."""
    loop = asyncio.get_running_loop()
    count = 0
    watch = Watchdog(0.2, progress=lambda: count)
    last_progress = 0.0

    async def feed() -> None:
        nonlocal count, last_progress
        for _ in range(30):  # 0.6 s of progress: three limits
            await asyncio.sleep(0.02)
            count += 1
            last_progress = loop.time()

    feeder = asyncio.create_task(feed())
    with pytest.raises(TimeoutError):
        with watch:
            await asyncio.Event().wait()
    timed_out = loop.time()
    await feeder
    watch.close()
    assert count == 30  # it outlived the limit three times over while progress came
    assert 0.2 <= timed_out - last_progress <= 0.25 + 0.25  # + the loop's own lateness


async def test_without_progress_a_watchdog_with_a_counter_times_out_at_its_limit() -> None:
    watch = Watchdog(0.1, progress=lambda: 0)
    loop = asyncio.get_running_loop()
    started = loop.time()
    with pytest.raises(TimeoutError):
        with watch:
            await asyncio.Event().wait()
    assert 0.1 <= loop.time() - started <= 0.1 + 0.25
    watch.close()
