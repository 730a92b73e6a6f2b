"""WebSocket text frames for the audio hot path, serialized without websockets' frame objects.

websockets builds a `Frame`, runs the extensions and, for a client, draws each frame's mask
with `secrets.token_bytes(4)`: one `getrandom` system call per frame, 50 times a second per
call toward Realtime. For a plain text frame (FIN, no extension negotiated) the bytes are a
fixed header, the mask and the masked payload (RFC 6455 section 5.2), which this builds
directly; masks come from a buffer of `os.urandom` drawn 1,024 masks at a time, so they are
as unpredictable as websockets' own (RFC 6455 section 5.3 asks for a strong source).
Everything else (control frames, compression, fragmentation) stays with websockets.
"""

from __future__ import annotations

import os
import struct

try:
    from websockets.speedups import apply_mask
except ImportError:  # pragma: no cover - the C extension is in every wheel we install
    from websockets.utils import apply_mask

_FIN_TEXT = 0x81
_FIN_PONG = 0x8A
_MASK_BIT = 0x80
_POOL_MASKS = 1024


class MaskSource:
    """Four unpredictable bytes per call, from `os.urandom` drawn in blocks."""

    __slots__ = ("_at", "_pool")

    def __init__(self) -> None:
        self._pool = b""
        self._at = 0

    def next(self) -> bytes:
        at = self._at
        if at >= len(self._pool):
            self._pool = os.urandom(4 * _POOL_MASKS)
            at = 0
        self._at = at + 4
        return self._pool[at : at + 4]


def _header(length: int, mask_bit: int, first: int = _FIN_TEXT) -> bytes:
    if length < 126:
        return bytes((first, mask_bit | length))
    if length < 65536:
        return struct.pack("!BBH", first, mask_bit | 126, length)
    return struct.pack("!BBQ", first, mask_bit | 127, length)


def server_text_frame(payload: bytes) -> bytes:
    """One unmasked, final text frame (server to client)."""
    return _header(len(payload), 0) + payload


def client_text_frame(payload: bytes, mask: bytes) -> bytes:
    """One masked, final text frame (client to server) with the 4-byte `mask`."""
    return _header(len(payload), _MASK_BIT) + mask + apply_mask(payload, mask)


def client_pong_frame(payload: bytes, mask: bytes) -> bytes:
    """The masked pong (client to server) answering a ping that carried `payload` (<= 125)."""
    return _header(len(payload), _MASK_BIT, _FIN_PONG) + mask + apply_mask(payload, mask)
