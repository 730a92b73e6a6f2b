"""Digits the agent sends to the far side (an IVR): in-band DTMF tones, and a detector.

`tones` renders digits as ITU-T Q.23 dual tones in G.711 (100 ms of tone, 80 ms of silence
each; `,` or `w` is a 500 ms pause), for a leg that carries audio only (a Twilio media
stream) or a SIP peer that did not offer RFC 4733 events. `detect` finds the digits back in
such audio with the Goertzel algorithm (tests, and the simulator's caller side).
"""

from __future__ import annotations

import math
import re
from array import array

from telephony.audio import decode, pcm16_to_alaw, pcm16_to_mulaw

RATE = 8000
TONE_MS = 100
GAP_MS = 80
PAUSE_MS = 500
DIGITS = re.compile(r"^[0-9*#A-Dw,]{1,32}$")
# Q.23: row and column frequencies of each key.
_ROWS = (697, 770, 852, 941)
_COLS = (1209, 1336, 1477, 1633)
_KEYS = ("123A", "456B", "789C", "*0#D")
FREQS: dict[str, tuple[int, int]] = {
    key: (_ROWS[r], _COLS[c]) for r, row in enumerate(_KEYS) for c, key in enumerate(row)
}
# RFC 4733 event codes of the keys.
EVENT_CODES: dict[str, int] = {
    **{str(d): d for d in range(10)}, "*": 10, "#": 11, "A": 12, "B": 13, "C": 14, "D": 15,
}  # fmt: skip
AMPLITUDE = 7000  # per tone, of 32767: about -13 dBm0 each, well inside G.711's range


def valid(digits: str) -> bool:
    return bool(DIGITS.match(digits))


def duration_ms(digits: str) -> int:
    """How long `tones(digits)` plays."""
    return sum(PAUSE_MS if d in ",w" else TONE_MS + GAP_MS for d in digits)


def _pcm(digits: str) -> bytes:
    samples = array("h")
    for digit in digits:
        if digit in ",w":
            samples.extend([0] * (RATE * PAUSE_MS // 1000))
            continue
        low, high = FREQS[digit]
        n = RATE * TONE_MS // 1000
        for i in range(n):
            t = i / RATE
            value = AMPLITUDE * (math.sin(2 * math.pi * low * t) + math.sin(2 * math.pi * high * t))
            samples.append(int(value))
        samples.extend([0] * (RATE * GAP_MS // 1000))
    if array("h", [1]).tobytes() != b"\x01\x00":
        samples.byteswap()  # little-endian on the wire
    return samples.tobytes()


def tones(digits: str, encoding: str = "audio/pcmu") -> bytes:
    """`digits` as in-band tones in G.711 (`audio/pcmu` or `audio/pcma`)."""
    pcm = _pcm(digits)
    return pcm16_to_alaw(pcm) if encoding == "audio/pcma" else pcm16_to_mulaw(pcm)


def _power(block: array[int], freq: float) -> float:
    k = 2 * math.cos(2 * math.pi * freq / RATE)
    s1 = s2 = 0.0
    for x in block:
        s0 = x + k * s1 - s2
        s2, s1 = s1, s0
    return s1 * s1 + s2 * s2 - k * s1 * s2


def detect(audio: bytes, encoding: str = "audio/pcmu", block_ms: int = 20) -> str:
    """The DTMF digits in G.711 `audio` (a key held over several blocks counts once)."""
    raw = decode(audio, "pcma" if encoding == "audio/pcma" else "pcmu")
    pcm = array("h")
    pcm.frombytes(raw)
    if array("h", [1]).tobytes() != b"\x01\x00":
        pcm.byteswap()
    n = RATE * block_ms // 1000
    found: list[str] = []
    last: str | None = None
    for start in range(0, len(pcm) - n + 1, n):
        block = pcm[start : start + n]
        energy = sum(x * x for x in block) / n
        key: str | None = None
        if energy > 1e5:
            rows = [_power(block, f) for f in _ROWS]
            cols = [_power(block, f) for f in _COLS]
            r, c = max(range(4), key=rows.__getitem__), max(range(4), key=cols.__getitem__)
            total = sum(rows) + sum(cols)
            if total > 0 and (rows[r] + cols[c]) / total > 0.8:
                key = _KEYS[r][c]
        if key is not None and key != last:
            found.append(key)
        last = key
    return "".join(found)
