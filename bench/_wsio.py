"""Lean WebSocket endpoints for the load side of the echo harness.

websockets' sans-I/O protocol on a bare asyncio Protocol: no task, future or coroutine per
message, so the load generator and the echo Realtime fake spend as little of their core as
possible and what the harness measures is the server under test. (The bare relay, the baseline
under test, uses websockets' ordinary asyncio API.)
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

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's is not a subclass

    def data_received(self, data: bytes) -> None:
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
        if self.proto.state is OPEN:
            self.proto.send_text(text.encode())
            self._flush()

    def close(self) -> None:
        if self.proto.state is OPEN:
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
