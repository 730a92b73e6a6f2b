"""Typed Twilio Media Streams messages, parsed at the edge.

Inbound (Twilio -> us): connected, start, media, mark, dtmf, stop.
Outbound (us -> Twilio): media, mark, clear.
"""

from __future__ import annotations

import base64
import json
from typing import Annotated, Literal

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


def parse_inbound(raw: str | bytes) -> InboundMessage:
    """Parse one frame from Twilio; raise MalformedFrame for anything we cannot use."""
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise MalformedFrame(f"not JSON: {exc}") from exc
    except RecursionError as exc:
        # `[[[[...` within the frame-size limit exhausts json's recursion: junk, not a crash.
        raise MalformedFrame("not JSON: nested too deeply") from exc
    if not isinstance(data, dict):
        raise MalformedFrame("frame is not a JSON object")
    try:
        return _inbound.validate_python(data)
    except ValidationError as exc:
        event = data.get("event")
        raise MalformedFrame(f"bad or unknown {event!r} frame: {exc.error_count()} errors") from exc


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


def parse_outbound(raw: str | bytes) -> OutboundMessage:
    """Parse a frame we (or a test peer) send to Twilio; used by the fake caller."""
    try:
        return _outbound.validate_json(raw)
    except ValidationError as exc:
        raise MalformedFrame(f"bad outbound frame: {exc.error_count()} errors") from exc
