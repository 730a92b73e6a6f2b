"""Property-based tests of the pure parsers at every input edge: garbage in, clean error out."""

from __future__ import annotations

import base64
import json
import string
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel

from app.errors import TokenRejected
from app.legs.twilio.stream_token import StreamTokens
from telephony.errors import MalformedFrame
from telephony.legs.twilio.events import Dtmf, parse_inbound
from telephony.sim.simulator import ClientEventError, parse_client_event
from tools.errors import InvalidArguments
from tools.restaurant.catalog import restaurant_catalog

FAST = settings(
    max_examples=150,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)

# Any JSON value, with the nasty corners: huge ints, non-finite floats, unicode, nesting.
_scalars = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.integers(min_value=10**20, max_value=10**40)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text()
    | st.sampled_from(["", "0", "-1", "inbound", "1:2:x", "\x00", "\ud7ff", "🙂" * 3])
)
json_values = st.recursive(
    _scalars,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)

_EVENTS = ["connected", "start", "media", "mark", "dtmf", "stop", "clear", "teleport", ""]
_KEYS = [
    "event",
    "streamSid",
    "sequenceNumber",
    "start",
    "media",
    "mark",
    "dtmf",
    "stop",
    "callSid",
    "customParameters",
    "mediaFormat",
    "payload",
    "timestamp",
    "track",
    "name",
    "digit",
    "tracks",
    "sampleRate",
]


def _frameish() -> st.SearchStrategy[dict[str, Any]]:
    """Dicts that look like Twilio frames: a real event tag and real keys, junk values."""
    inner = st.dictionaries(st.sampled_from(_KEYS), json_values, max_size=6)
    return st.fixed_dictionaries(
        {"event": st.sampled_from(_EVENTS)},
        optional={
            "streamSid": json_values,
            "start": inner | json_values,
            "media": inner | json_values,
            "mark": inner | json_values,
            "dtmf": inner | json_values,
            "stop": inner | json_values,
        },
    )


def _dumps(value: Any) -> str:
    return json.dumps(value, allow_nan=True)


def _assert_parse_is_clean(raw: str | bytes) -> None:
    try:
        message = parse_inbound(raw)
    except MalformedFrame:
        return
    # Whatever parses must be usable: media payloads and timestamps fail only as MalformedFrame.
    media = getattr(message, "media", None)
    if media is not None:
        for use in (media.audio, media.timestamp_ms):
            try:
                use()
            except MalformedFrame:
                pass


@FAST
@given(st.text() | st.binary())
def test_parse_inbound_raises_only_malformed_frame_for_arbitrary_text_and_bytes(
    raw: str | bytes,
) -> None:
    _assert_parse_is_clean(raw)


@FAST
@given(json_values)
def test_parse_inbound_raises_only_malformed_frame_for_arbitrary_json(value: Any) -> None:
    _assert_parse_is_clean(_dumps(value))


@FAST
@given(_frameish())
def test_parse_inbound_raises_only_malformed_frame_for_frame_shaped_junk(frame: Any) -> None:
    _assert_parse_is_clean(_dumps(frame))


@pytest.mark.parametrize(
    "raw",
    [
        "[" * 50_000,
        '{"event":' * 20_000,
        '{"event":"media","media":{"payload":"AA==","timestamp":"' + "9" * 5000 + '"}}',
        '{"event":"media","media":{"payload":"AA==","timestamp":' + "9" * 5000 + "}}",
        '{"event":"media","media":{"payload":"AA==","timestamp":NaN}}',
        '{"event":"media","media":{"payload":"\u00e9\u00e9==","timestamp":"1"}}',
        '{"event":"start","start":{"streamSid":"MZ","callSid":"CA","customParameters":[]}}',
        '{"event":"start","start":{"streamSid":"MZ","callSid":"CA","customParameters":{"t":1}}}',
        b"\xff\xfe\x00garbage",
        b'{"event":"stop"}\xff',
        "",
        "null",
        "1e999999",
    ],
)
def test_parse_inbound_edge_cases_are_malformed_or_usable(raw: str | bytes) -> None:
    _assert_parse_is_clean(raw)


def test_deeply_nested_frame_is_a_malformed_frame_not_a_recursion_error() -> None:
    with pytest.raises(MalformedFrame):
        parse_inbound("[" * 50_000 + "]" * 50_000)


@pytest.mark.parametrize("digit", ["4321", "", "\u0661", "a", " 5", "5\n", "\x00", "**"])
def test_a_dtmf_frame_carries_exactly_one_key(digit: str) -> None:
    frame = json.dumps({"event": "dtmf", "dtmf": {"track": "inbound_track", "digit": digit}})
    with pytest.raises(MalformedFrame):
        parse_inbound(frame)


@pytest.mark.parametrize("digit", [*"0123456789", "*", "#"])
def test_every_keypad_key_is_a_dtmf_frame(digit: str) -> None:
    frame = json.dumps({"event": "dtmf", "dtmf": {"digit": digit}})
    message = parse_inbound(frame)
    assert isinstance(message, Dtmf) and message.dtmf.digit == digit


# Stream tokens.

_TOKENS = StreamTokens(b"fuzz-secret", ttl_s=300.0, clock=lambda: 1_000_000.0)
_GOOD = _TOKENS.issue("CA123", "call-1")


@FAST
@given(st.text(), st.text(max_size=40))
def test_stream_token_verify_never_raises_anything_but_token_rejected(
    token: str, call_sid: str
) -> None:
    with pytest.raises(TokenRejected):
        _TOKENS.verify(token, call_sid)


@FAST
@given(
    st.lists(st.text(min_size=0, max_size=60), min_size=1, max_size=5).map(".".join),
    st.sampled_from(["CA123", "", "é", "🙂"]),
)
def test_stream_token_verify_rejects_dotted_garbage(token: str, call_sid: str) -> None:
    with pytest.raises(TokenRejected):
        _TOKENS.verify(token, call_sid)


@FAST
@given(st.data())
def test_a_tampered_stream_token_is_never_accepted(data: st.DataObject) -> None:
    """Any single edit of a genuine token (replace, insert, delete a char) is rejected."""
    token = _GOOD
    pos = data.draw(st.integers(0, len(token) - 1))
    op = data.draw(st.sampled_from(["replace", "insert", "delete"]))
    char = data.draw(st.characters() | st.sampled_from(string.ascii_letters + "-_.="))
    if op == "replace":
        tampered = token[:pos] + char + token[pos + 1 :]
    elif op == "insert":
        tampered = token[:pos] + char + token[pos:]
    else:
        tampered = token[:pos] + token[pos + 1 :]
    if tampered == token:
        return
    try:
        claims = _TOKENS.verify(tampered, "CA123")
    except TokenRejected:
        return
    # Base64 padding bits can absorb a change of the last char without changing the bytes:
    # then the token is byte-for-byte the genuine one, with the genuine claims.
    genuine = _TOKENS.verify(token, "CA123")
    assert claims == genuine
    assert base64.urlsafe_b64decode(_pad(tampered.split(".")[2])) == base64.urlsafe_b64decode(
        _pad(token.split(".")[2])
    )
    assert tampered.split(".")[1] == token.split(".")[1]


def _pad(text: str) -> str:
    return text + "=" * (-len(text) % 4)


def test_genuine_token_verifies_and_non_ascii_call_sid_is_rejected_not_a_crash() -> None:
    assert _TOKENS.verify(_GOOD, "CA123").call_id == "call-1"
    for call_sid in ("CAé123", "CA\ud800", "\x00"):
        with pytest.raises(TokenRejected):
            _TOKENS.verify(_GOOD, call_sid)
    version, body, sig = _GOOD.split(".")
    with pytest.raises(TokenRejected):
        _TOKENS.verify(f"{version}.{body}.{sig[:-1]}é", "CA123")
    with pytest.raises(TokenRejected):
        _TOKENS.verify(f"{version}.{body}.{sig[:-1]}\udc80", "CA123")
    with pytest.raises(TokenRejected):
        _TOKENS.verify(f"{version}.{body}\ud800.{sig}", "CA123")


# Catalog argument parsing.

_CATALOG = restaurant_catalog()
_FIELDS = [
    "date",
    "time",
    "party_size",
    "name",
    "booking_id",
    "operation_id",
    "confirmed",
    "digits",
]
_args_dicts = st.dictionaries(
    st.sampled_from(_FIELDS) | st.text(max_size=6), json_values, max_size=6
)


def _assert_args_clean(tool: str, raw: str) -> None:
    spec = _CATALOG.get(tool)
    try:
        args = spec.parse(raw)
    except InvalidArguments as exc:
        assert str(exc)  # speakable, never empty
        return
    assert isinstance(args, spec.args_model)
    assert isinstance(args, BaseModel)
    json.dumps(spec.normalize(args))  # what the ledger stores must serialize


_TOOLS = [spec.name for spec in _CATALOG]


@pytest.mark.parametrize("tool", _TOOLS)
@FAST
@given(raw=st.text() | json_values.map(_dumps) | _args_dicts.map(_dumps))
def test_catalog_argument_parsing_is_a_valid_model_or_invalid_arguments(
    tool: str, raw: str
) -> None:
    _assert_args_clean(tool, raw)


@pytest.mark.parametrize("tool", _TOOLS)
@pytest.mark.parametrize(
    "raw",
    [
        "[" * 50_000,
        '{"party_size": ' + "9" * 5000 + "}",
        '{"party_size": 1e999}',
        '{"party_size": NaN, "date": "2026-12-05", "time": "20:00"}',
        '{"date": "2026-02-30", "time": "24:00", "party_size": 2}',
        '{"operation_id": "not-a-uuid", "confirmed": "maybe"}',
        '{"booking_id": "\\u0000\\ud800"}',
        "   ",
        "\x00",
    ],
)
def test_catalog_argument_edge_cases_are_clean(tool: str, raw: str) -> None:
    _assert_args_clean(tool, raw)


def test_deeply_nested_arguments_are_invalid_arguments_not_a_recursion_error() -> None:
    with pytest.raises(InvalidArguments):
        _CATALOG.get("book_table").parse("[" * 50_000)


def test_a_huge_integer_argument_is_invalid_arguments_not_a_value_error() -> None:
    with pytest.raises(InvalidArguments):
        _CATALOG.get("check_availability").parse('{"party_size": ' + "9" * 5000 + "}")


# The simulator's client-event parsing (a product stand-in: it must answer errors, not die).

_CLIENT_TYPES = [
    "session.update",
    "input_audio_buffer.append",
    "input_audio_buffer.commit",
    "input_audio_buffer.clear",
    "conversation.item.create",
    "conversation.item.truncate",
    "conversation.item.delete",
    "response.create",
    "response.cancel",
    "bogus",
]


@FAST
@given(
    json_values
    | st.fixed_dictionaries(
        {"type": st.sampled_from(_CLIENT_TYPES)},
        optional={
            "event_id": json_values,
            "session": json_values,
            "audio": json_values,
            "item": json_values,
            "item_id": json_values,
            "audio_end_ms": json_values,
            "content_index": json_values,
            "response": json_values,
        },
    )
)
def test_simulator_client_event_parsing_raises_only_client_event_errors(data: Any) -> None:
    try:
        parse_client_event(data)
    except ClientEventError as exc:
        assert exc.code
