"""Typed Twilio Media Streams messages, parsed at the edge.

Inbound (Twilio -> us): connected, start, media, mark, dtmf, stop.
Outbound (us -> Twilio): media, mark, clear.

`media` and `mark` are the per-frame traffic (50 a second each way on a busy call), so they
have a hot path: `parse_frame` checks them field by field exactly as their models would and
hands back small typed records, and `OutboundFrames` builds them by concatenation. Every other
frame, and any media or mark frame the hand check is not sure of, goes through the models.
"""

from __future__ import annotations

import base64
import binascii
import json
from dataclasses import dataclass
from json.encoder import encode_basestring_ascii
from typing import Annotated, Any, Literal

import orjson
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

from telephony.errors import MalformedFrame


class _Wire(BaseModel):
    model_config = ConfigDict(populate_by_name=True, extra="ignore")


class Connected(_Wire):
    event: Literal["connected"]
    protocol: str = "Call"
    version: str = ""


class MediaFormat(_Wire):
    encoding: str = "audio/x-mulaw"
    sample_rate: int = Field(8000, alias="sampleRate")
    channels: int = 1


class StartInfo(_Wire):
    account_sid: str = Field("", alias="accountSid")
    stream_sid: str = Field(alias="streamSid")
    call_sid: str = Field(alias="callSid")
    tracks: list[str] = Field(default_factory=list)
    custom_parameters: dict[str, str] = Field(default_factory=dict, alias="customParameters")
    media_format: MediaFormat = Field(
        default_factory=lambda: MediaFormat.model_validate({}), alias="mediaFormat"
    )


class Start(_Wire):
    event: Literal["start"]
    sequence_number: str = Field("", alias="sequenceNumber")
    stream_sid: str = Field("", alias="streamSid")
    start: StartInfo


class MediaInfo(_Wire):
    track: str = "inbound"
    chunk: str = ""
    timestamp: str = "0"
    payload: str

    def audio(self) -> bytes:
        """The mu-law bytes of this frame."""
        try:
            return base64.b64decode(self.payload, validate=True)
        except ValueError as exc:
            raise MalformedFrame(f"media payload is not base64: {exc}") from exc

    def timestamp_ms(self) -> int:
        """Milliseconds since the stream started, as Twilio stamps it."""
        try:
            return int(self.timestamp)
        except ValueError as exc:
            raise MalformedFrame(f"media timestamp is not an integer: {self.timestamp!r}") from exc


class Media(_Wire):
    event: Literal["media"]
    sequence_number: str = Field("", alias="sequenceNumber")
    stream_sid: str = Field("", alias="streamSid")
    media: MediaInfo


class MarkInfo(_Wire):
    name: str


class Mark(_Wire):
    event: Literal["mark"]
    sequence_number: str = Field("", alias="sequenceNumber")
    stream_sid: str = Field("", alias="streamSid")
    mark: MarkInfo


class DtmfInfo(_Wire):
    track: str = "inbound_track"
    # One key per frame, as Twilio sends it: a frame carrying "4321" (or a non-ASCII digit)
    # must not feed several PIN digits at once or count as a wrong PIN attempt.
    digit: str = Field(pattern=r"^[0-9*#]$")


class Dtmf(_Wire):
    event: Literal["dtmf"]
    sequence_number: str = Field("", alias="sequenceNumber")
    stream_sid: str = Field("", alias="streamSid")
    dtmf: DtmfInfo


class StopInfo(_Wire):
    account_sid: str = Field("", alias="accountSid")
    call_sid: str = Field("", alias="callSid")


class Stop(_Wire):
    event: Literal["stop"]
    sequence_number: str = Field("", alias="sequenceNumber")
    stream_sid: str = Field("", alias="streamSid")
    stop: StopInfo = Field(default_factory=lambda: StopInfo.model_validate({}))


InboundMessage = Annotated[
    Connected | Start | Media | Mark | Dtmf | Stop, Field(discriminator="event")
]
_inbound: TypeAdapter[InboundMessage] = TypeAdapter(InboundMessage)


def _loads(raw: str | bytes) -> Any:
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError:
        pass  # orjson refuses some JSON the standard parser takes (lone surrogate escapes)
    try:
        return json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise MalformedFrame(f"not JSON: {exc}") from exc
    except RecursionError as exc:
        # `[[[[...` within the frame-size limit exhausts json's recursion: junk, not a crash.
        raise MalformedFrame("not JSON: nested too deeply") from exc


def _validate(data: Any) -> InboundMessage:
    if not isinstance(data, dict):
        raise MalformedFrame("frame is not a JSON object")
    try:
        return _inbound.validate_python(data)
    except ValidationError as exc:
        event = data.get("event")
        raise MalformedFrame(f"bad or unknown {event!r} frame: {exc.error_count()} errors") from exc


def parse_inbound(raw: str | bytes) -> InboundMessage:
    """Parse one frame from Twilio; raise MalformedFrame for anything we cannot use."""
    return _validate(_loads(raw))


# The hot path: media and mark frames checked by hand.


# Not frozen: one of these is built per frame, and a frozen dataclass costs 3x to build.
@dataclass(slots=True)
class MediaFrame:
    """An inbound `media` frame whose payload is valid base64 and timestamp an integer."""

    track: str
    payload: str  # base64 of the mu-law bytes, as Twilio sent it
    timestamp_ms: int


@dataclass(slots=True)
class MarkFrame:
    """An inbound `mark` echo."""

    name: str


_MISSING = object()
# Optional string fields as (alias, name): the models read the alias, else the field name.
_ENVELOPE_STRS = (("sequenceNumber", "sequence_number"), ("streamSid", "stream_sid"))
_MEDIA_STRS = (("track", "track"), ("chunk", "chunk"), ("timestamp", "timestamp"))


def _optional_strs(data: dict[str, Any], fields: tuple[tuple[str, str], ...]) -> bool:
    for alias, name in fields:
        value = data.get(alias, _MISSING)
        if value is _MISSING:
            value = data.get(name, _MISSING)
        if value is not _MISSING and type(value) is not str:
            return False
    return True


def _media_frame(data: dict[str, Any]) -> MediaFrame | None:
    media = data.get("media")
    if type(media) is not dict or not _optional_strs(data, _ENVELOPE_STRS):
        return None
    payload = media.get("payload")
    if type(payload) is not str or not _optional_strs(media, _MEDIA_STRS):
        return None
    try:
        # The model's check (strict base64); the bytes are not kept.
        binascii.a2b_base64(payload, strict_mode=True)
        timestamp_ms = int(media.get("timestamp", "0"))
    except ValueError:
        return None  # the model path names the fault
    return MediaFrame(media.get("track", "inbound"), payload, timestamp_ms)


def _mark_frame(data: dict[str, Any]) -> MarkFrame | None:
    mark = data.get("mark")
    if type(mark) is not dict or not _optional_strs(data, _ENVELOPE_STRS):
        return None
    name = mark.get("name")
    return MarkFrame(name) if type(name) is str else None


def parse_frame(raw: str | bytes) -> MediaFrame | MarkFrame | InboundMessage:
    """Parse one frame from Twilio: media and mark by hand, anything else (or any media or
    mark frame the hand check doubts) through the models. Raises MalformedFrame."""
    data = _loads(raw)
    if type(data) is dict:
        event = data.get("event")
        fast: MediaFrame | MarkFrame | None = None
        if event == "media":
            fast = _media_frame(data)
        elif event == "mark":
            fast = _mark_frame(data)
        if fast is not None:
            return fast
    return _validate(data)


def hot_frame(raw: str | bytes) -> tuple[str, str, int] | str | None:
    """The Twilio lane's check, without an object per frame: (track, payload, timestamp_ms)
    for a media frame, the name for a mark, None for anything else (never raises: the reader
    then hands the frame to `parse_frame`, which names the fault or the message). The same
    checks as `_media_frame` and `_mark_frame`, with the usual frame (every field present,
    as Twilio sends it) checked inline. Bytes that are not UTF-8 are not JSON: None."""
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return None
    if type(data) is not dict:
        return None
    event = data.get("event")
    if event != "media" and event != "mark":
        return None
    # The envelope's optional strings, checked inline where all are there (as Twilio sends).
    usual = type(data.get("sequenceNumber")) is str and type(data.get("streamSid")) is str
    if not usual and not _optional_strs(data, _ENVELOPE_STRS):
        return None
    if event == "mark":
        mark = data.get("mark")
        name = mark.get("name") if type(mark) is dict else None
        return name if type(name) is str else None
    media = data.get("media")
    if type(media) is not dict:
        return None
    payload = media.get("payload")
    track = media.get("track", "inbound")
    timestamp = media.get("timestamp", "0")
    if type(payload) is not str:
        return None
    if (
        type(track) is not str
        or type(timestamp) is not str
        or type(media.get("chunk", "")) is not str
    ) and not _optional_strs(media, _MEDIA_STRS):
        return None
    try:
        binascii.a2b_base64(payload, strict_mode=True)
        timestamp_ms = int(timestamp)
    except ValueError:
        return None  # the model path names the fault
    return (track, payload, timestamp_ms)


# Outbound messages.


class OutMediaPayload(_Wire):
    payload: str


class OutMedia(_Wire):
    event: Literal["media"] = "media"
    stream_sid: str = Field(alias="streamSid")
    media: OutMediaPayload


class OutMark(_Wire):
    event: Literal["mark"] = "mark"
    stream_sid: str = Field(alias="streamSid")
    mark: MarkInfo


class OutClear(_Wire):
    event: Literal["clear"] = "clear"
    stream_sid: str = Field(alias="streamSid")


OutboundMessage = Annotated[OutMedia | OutMark | OutClear, Field(discriminator="event")]
_outbound: TypeAdapter[OutboundMessage] = TypeAdapter(OutboundMessage)


def media_message(stream_sid: str, mulaw: bytes) -> str:
    """A `media` frame carrying mu-law audio to the caller."""
    payload = base64.b64encode(mulaw).decode("ascii")
    return OutMedia(streamSid=stream_sid, media=OutMediaPayload(payload=payload)).model_dump_json(
        by_alias=True
    )


def mark_message(stream_sid: str, name: str) -> str:
    """A `mark` frame; Twilio echoes it back when the audio before it has played."""
    return OutMark(streamSid=stream_sid, mark=MarkInfo(name=name)).model_dump_json(by_alias=True)


def clear_message(stream_sid: str) -> str:
    """A `clear` frame: Twilio drops all buffered audio and echoes pending marks."""
    return OutClear(streamSid=stream_sid).model_dump_json(by_alias=True)


class OutboundFrames:
    """The `media` and `mark` frames of one stream, built by concatenation (the hot path).

    The same JSON objects as `media_message` and `mark_message` produce, without a model or
    an encoder per frame: the stream's part is escaped once, and base64 needs no escaping.
    """

    def __init__(self, stream_sid: str) -> None:
        sid = json.dumps(stream_sid)
        self._media_head = '{"event":"media","streamSid":' + sid + ',"media":{"payload":"'
        self._mark_head = '{"event":"mark","streamSid":' + sid + ',"mark":{"name":'
        self.clear = clear_message(stream_sid)

    def media(self, payload: str) -> str:
        """A `media` frame carrying canonical base64 mu-law `payload` as is."""
        return self._media_head + payload + '"}}'

    def mark(self, name: str) -> str:
        """A `mark` frame named `name`."""
        return self._mark_head + encode_basestring_ascii(name) + "}}"  # as json.dumps does


def parse_outbound(raw: str | bytes) -> OutboundMessage:
    """Parse a frame we (or a test peer) send to Twilio; used by the fake caller."""
    try:
        return _outbound.validate_json(raw)
    except ValidationError as exc:
        raise MalformedFrame(f"bad outbound frame: {exc.error_count()} errors") from exc
