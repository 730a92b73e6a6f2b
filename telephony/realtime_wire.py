"""The Realtime audio hot path on the wire, beside the SDK's typed events.

Per 20 ms of a call the bridge sends one `input_audio_buffer.append` and receives about one
`response.output_audio.delta`; everything else is rare. So those two are handled here at the
wire: the append frame is built by concatenation around the leg's base64 payload (no JSON
encoder, no SDK transform, no decode and re-encode), and an audio delta is recognised from
the raw frame before the SDK's pydantic parse (about 57 us per delta on our machines, 21% of
the server's CPU at 40 calls). Every other server event still goes through the SDK's models
(`AsyncRealtimeConnection.parse_event`).
"""

from __future__ import annotations

from dataclasses import dataclass

import orjson

AUDIO_DELTA = "response.output_audio.delta"
_APPEND_HEAD = '{"type":"input_audio_buffer.append","audio":"'
_APPEND_TAIL = '"}'


def append_frame(payload: str) -> str:
    """The `input_audio_buffer.append` frame for canonical base64 `payload` (no escaping
    needed: the base64 alphabet has nothing JSON must escape)."""
    return _APPEND_HEAD + payload + _APPEND_TAIL


@dataclass(slots=True)  # not frozen: built per delta, and frozen costs 3x
class AudioDelta:
    """The fields of a `response.output_audio.delta` the bridge uses."""

    response_id: str
    item_id: str
    delta: str  # base64 G.711 in the session's output format


def audio_delta(raw: bytes | str) -> AudioDelta | None:
    """The audio delta `raw` carries; None for any other frame (the SDK parses those)."""
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return None  # the SDK's parse reports it
    if type(data) is not dict or data.get("type") != AUDIO_DELTA:
        return None
    response_id = data.get("response_id")
    item_id = data.get("item_id")
    delta = data.get("delta")
    if type(response_id) is not str or type(item_id) is not str or type(delta) is not str:
        return None  # odd shape: let the typed path deal with it
    return AudioDelta(response_id, item_id, delta)
