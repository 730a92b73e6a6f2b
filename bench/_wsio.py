"""Lean WebSocket endpoints for the load side of the echo harness.

websockets' sans-I/O protocol on a bare asyncio Protocol: no task, future or coroutine per
message, so the load generator and the echo Realtime fake spend as little of their core as
possible and what the harness measures is the server under test. (The bare relay, the baseline
under test, uses websockets' ordinary asyncio API.)

Once the handshake is done and no extension was negotiated, an endpoint frames and reads its
messages itself (RFC 6455 section 5: final text frames, pings, pongs, close), which costs a
fraction of websockets' frame objects per message: at 100 calls and more, the load side must
not run out of its core before the server under test does. With permessage-deflate
negotiated, websockets keeps doing all of it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping

from websockets.client import ClientProtocol
from websockets.extensions.permessage_deflate import (
    enable_client_permessage_deflate,
    enable_server_permessage_deflate,
)
from websockets.frames import Frame, Opcode
from websockets.http11 import Request, Response
from websockets.protocol import OPEN, Protocol
from websockets.server import ServerProtocol
from websockets.uri import parse_uri

from telephony.realtime_wire import between_frames
from telephony.ws_frames import MaskSource, apply_mask

_TEXT, _CLOSE, _PING, _PONG = 0x1, 0x8, 0x9, 0xA


class Endpoint(asyncio.Protocol):
    """One WebSocket; `on_text` is called for every text message, synchronously."""

    def __init__(self, proto: Protocol) -> None:
        self.proto = proto
        self.transport: asyncio.Transport | None = None
        self.on_text: Callable[[str], None] = lambda text: None
        self.on_open: Callable[[], None] = lambda: None
        self.opened: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.closed: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._parts: list[bytes] = []
        # Reading and framing here (see the module docstring), once the handshake is done.
        self._own = False
        self._rest = b""
        self._masks: MaskSource | None = MaskSource() if isinstance(proto, ClientProtocol) else None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's is not a subclass

    def data_received(self, data: bytes) -> None:
        if self._own:
            self._read_own(data)
            return
        self.proto.receive_data(data)
        for event in self.proto.events_received():
            if isinstance(event, Frame):
                self._frame(event)
            elif isinstance(event, Request):  # server side: accept every handshake
                assert isinstance(self.proto, ServerProtocol)
                self.proto.send_response(self.proto.accept(event))
                self._opened()
            elif isinstance(event, Response):  # client side
                if self.proto.state is OPEN:
                    self._opened()
                elif not self.opened.done():
                    self.opened.set_exception(ConnectionError(f"HTTP {event.status_code}"))
        self._flush()
        if (
            self.proto.state is OPEN
            and not self.proto.extensions
            and self.transport is not None
            and between_frames(self.proto)
        ):
            self._own = True

    def _read_own(self, data: bytes) -> None:
        buf = self._rest + data if self._rest else data
        size = len(buf)
        pos = 0
        while size - pos >= 2:
            first, second = buf[pos], buf[pos + 1]
            length = second & 0x7F
            at = pos + 2
            if length == 126:
                if size - at < 2:
                    break
                length = int.from_bytes(buf[at : at + 2], "big")
                at += 2
            elif length == 127:
                if size - at < 8:
                    break
                length = int.from_bytes(buf[at : at + 8], "big")
                at += 8
            mask = b""
            if second & 0x80:
                if size - at < 4:
                    break
                mask = buf[at : at + 4]
                at += 4
            if size - at < length:
                break
            payload = buf[at : at + length]
            if mask:
                payload = apply_mask(payload, mask)
            pos = at + length
            opcode = first & 0x0F
            if opcode == _TEXT and first & 0x80:
                self.on_text(payload.decode())
            elif opcode == _PING:
                self._write_frame(_PONG, payload)
            elif opcode == _CLOSE:
                self._own = False
                if self.transport is not None:
                    self._write_frame(_CLOSE, payload[:2])
                    self.transport.close()
                return
            elif opcode != _PONG:
                raise ConnectionError(f"unexpected frame (opcode {opcode}) on the load side")
        self._rest = buf[pos:]

    def _write_frame(self, opcode: int, payload: bytes) -> None:
        length = len(payload)
        mask_bit = 0x80 if self._masks is not None else 0
        if length < 126:
            head = bytes((0x80 | opcode, mask_bit | length))
        elif length < 65536:
            head = bytes((0x80 | opcode, mask_bit | 126)) + length.to_bytes(2, "big")
        else:
            head = bytes((0x80 | opcode, mask_bit | 127)) + length.to_bytes(8, "big")
        assert self.transport is not None
        if self.transport.is_closing():
            return  # hung up (--churn) with a mark echo still due: dropped
        if self._masks is not None:
            mask = self._masks.next()
            self.transport.write(head + mask + apply_mask(payload, mask))
        else:
            self.transport.write(head + payload)

    def _opened(self) -> None:
        if not self.opened.done():
            self.opened.set_result(None)
        self.on_open()

    def _frame(self, frame: Frame) -> None:
        if frame.opcode is Opcode.TEXT or (frame.opcode is Opcode.CONT and self._parts):
            if frame.fin and not self._parts:
                self.on_text(frame.data.decode())
                return
            self._parts.append(frame.data)
            if frame.fin:
                data, self._parts = b"".join(self._parts), []
                self.on_text(data.decode())

    def send_text(self, text: str) -> None:
        if self._own:
            self._write_frame(_TEXT, text.encode())
        elif self.proto.state is OPEN:
            self.proto.send_text(text.encode())
            self._flush()

    def close(self) -> None:
        if self._own:
            self._own = False
            self._write_frame(_CLOSE, (1000).to_bytes(2, "big") + b"done")
        elif self.proto.state is OPEN:
            self.proto.send_close(1000, "done")
            self._flush()
        if self.transport is not None:
            asyncio.get_running_loop().call_later(1.0, self.transport.close)

    def _flush(self) -> None:
        transport = self.transport
        if transport is None:
            return
        for data in self.proto.data_to_send():
            if data:
                transport.write(data)
            elif transport.can_write_eof():
                transport.write_eof()
            else:
                transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.proto.receive_eof()
        if not self.opened.done():
            self.opened.set_exception(ConnectionError("closed during the handshake"))
        if not self.closed.done():
            self.closed.set_result(None)


async def connect(url: str, headers: Mapping[str, str], *, deflate: bool) -> Endpoint:
    """Open a client WebSocket (offering permessage-deflate when `deflate`)."""
    uri = parse_uri(url)
    proto = ClientProtocol(
        uri, extensions=enable_client_permessage_deflate(None) if deflate else None
    )
    request = proto.connect()
    for name, value in headers.items():
        request.headers[name] = value
    loop = asyncio.get_running_loop()
    endpoint = Endpoint(proto)
    await loop.create_connection(lambda: endpoint, uri.host, uri.port)
    proto.send_request(request)
    endpoint._flush()
    async with asyncio.timeout(30):
        await endpoint.opened
    return endpoint


def server_endpoint(*, deflate: bool) -> Endpoint:
    """A server-side endpoint for `loop.create_server` (accepts deflate when `deflate`)."""
    return Endpoint(
        ServerProtocol(extensions=enable_server_permessage_deflate(None) if deflate else None)
    )
