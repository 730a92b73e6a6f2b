"""RFC 4733 telephone-event decoding (pure): RTP payloads in, one digit per key press out."""

from __future__ import annotations

from collections import deque

KEYS = "0123456789*#ABCD"
RECENT = 16  # events remembered (a few seconds of fast typing)


class DtmfDecoder:
    """Turns the packets of RFC 4733 events into digits, once each.

    An event is named by its RTP timestamp: every update and the (usually three) end packets
    of one key press share it. A digit is reported at its first end packet; if every end
    packet was lost, it is reported when the next event starts. The timestamps of recent
    events are remembered, so a late or reordered packet of one never reports it again.
    """

    def __init__(self) -> None:
        self._reported: deque[int] = deque(maxlen=RECENT)
        self._pending: tuple[int, str] | None = None  # an event seen without its end yet

    def feed(self, payload: bytes, timestamp: int) -> list[str]:
        """Digits completed by this packet (usually none, sometimes one; two if an end got lost)."""
        if len(payload) < 4:
            return []
        event, flags = payload[0], payload[1]
        if event >= len(KEYS):
            return []  # flash hook and tones we do not use
        if timestamp in self._reported:
            return []  # an update or a retransmitted end of an event already reported
        digits: list[str] = []
        if self._pending is not None and self._pending[0] != timestamp:
            digits.append(self._pending[1])  # its end packets never came
            self._reported.append(self._pending[0])
            self._pending = None
        if flags & 0x80:
            digits.append(KEYS[event])
            self._reported.append(timestamp)
            self._pending = None
        else:
            self._pending = (timestamp, KEYS[event])
        return digits
