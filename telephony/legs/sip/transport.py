"""The asyncio shell around the SIP core: UDP and TCP on one address, and the core's timers.

Thin on purpose: it frames TCP streams into messages, hands every message to the core with
the loop's clock, sends what the core says, and wakes the core at its next deadline. Sources
outside the allow list are refused here too: no TCP connection from them is kept open. An
allowed source gets at most `max_per_source` TCP connections at once (a trusted SIP proxy's
are not counted: they carry many callers, whom the core limits per message), and a connection
that carries nothing (not even a CRLF keep-alive) for `idle_s` is closed unless a dialog of
the core lives on it.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
from collections.abc import Callable
from typing import Any

from telephony.legs.sip.message import MAX_MESSAGE_BYTES, Flow
from telephony.legs.sip.uas import SipEvent, Transmit, UserAgentServer

log = logging.getLogger(__name__)

MAX_HEADER_BYTES = 16 * 1024
MAX_TCP_CONNECTIONS = 1024
# A message that has started must arrive whole within this (slow senders hold no slot long).
MESSAGE_READ_TIMEOUT_S = 10.0
# A TCP connection with nothing at all for this long is closed (SIP_TCP_IDLE_S), unless a
# dialog lives on it: our BYE or re-INVITE needs it, and behind NAT no new one would reach
# the peer. Peers that keep a flow open send RFC 5626 CRLF keep-alives (every 95-120 s).
IDLE_TIMEOUT_S = 180.0
MAX_PER_SOURCE = 16
PING = b"\r\n\r\n"  # RFC 5626 4.4.1: a double CRLF is a ping, answered by one CRLF
PONG = b"\r\n"
CONNECT_TIMEOUT_S = 5.0
MAX_WRITE_BUFFER = 256 * 1024


def _content_length(head: bytes) -> int:
    for line in head.split(b"\r\n")[1:]:
        name, sep, value = line.partition(b":")
        if sep and name.strip().lower() in (b"content-length", b"l"):
            text = value.strip()
            return int(text) if text.isdigit() else -1
    return 0  # RFC 3261 18.3 makes it mandatory on streams; a missing one means no body


class _Udp(asyncio.DatagramProtocol):
    def __init__(self, owner: SipTransport) -> None:
        self._owner = owner

    def datagram_received(self, data: bytes, addr: tuple[Any, ...]) -> None:
        self._owner.received(data, Flow("udp", (str(addr[0]), int(addr[1]))))

    def error_received(self, exc: Exception) -> None:
        # ICMP port unreachable from a peer that went away; the transaction layer copes.
        log.debug("SIP UDP error: %r", exc)


class SipTransport:
    """UDP + TCP listener for a UserAgentServer; `on_event` gets the core's call events."""

    def __init__(
        self,
        core: UserAgentServer,
        host: str,
        port: int,
        on_event: Callable[[SipEvent], None],
        *,
        max_per_source: int = MAX_PER_SOURCE,
        idle_s: float = IDLE_TIMEOUT_S,
    ) -> None:
        self.core = core
        self.max_per_source = max_per_source
        self.idle_s = idle_s
        self.host = host
        self.port = port
        self._on_event = on_event
        self._loop: asyncio.AbstractEventLoop | None = None
        self._udp: asyncio.DatagramTransport | None = None
        self._tcp: asyncio.Server | None = None
        self._conns: dict[int, asyncio.StreamWriter] = {}
        self._per_source: dict[str, int] = {}  # accepted connections open, by source address
        self.refused_per_source = 0
        self.idle_closed = 0
        self._conn_tasks: set[asyncio.Task[None]] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self._next_conn = 0
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at: float | None = None
        self._closing = False

    # ---- lifecycle ----------------------------------------------------------------------

    async def start(self) -> tuple[str, int]:
        """Bind UDP then TCP on the same port; returns the address.

        With port 0 the OS picks the UDP port, and TCP may find that number taken (by some
        client's ephemeral port): then another UDP port is tried.
        """
        loop = self._loop = asyncio.get_running_loop()
        attempts = 20 if self.port == 0 else 1
        for attempt in range(attempts):
            udp, _ = await loop.create_datagram_endpoint(
                lambda: _Udp(self), local_addr=(self.host, self.port if attempts == 1 else 0)
            )
            port = int(udp.get_extra_info("sockname")[1])
            try:
                self._tcp = await asyncio.start_server(
                    self._on_connection, self.host, port, limit=MAX_HEADER_BYTES * 2
                )
            except OSError:
                udp.close()
                if attempt == attempts - 1:
                    raise
                continue
            self._udp = udp
            self.port = port
            break
        log.info("SIP listening on %s:%d (UDP and TCP)", self.host, self.port)
        return self.host, self.port

    async def stop(self) -> None:
        self._closing = True
        if self._timer is not None:
            self._timer.cancel()
        if self._tcp is not None:
            self._tcp.close()
        for writer in list(self._conns.values()):
            writer.close()
        for task in [*self._conn_tasks, *self._tasks]:
            task.cancel()
        await asyncio.gather(*self._conn_tasks, *self._tasks, return_exceptions=True)
        if self._tcp is not None:
            with contextlib.suppress(Exception):
                async with asyncio.timeout(2.0):
                    await self._tcp.wait_closed()
        if self._udp is not None:
            self._udp.close()

    # ---- the core's side ----------------------------------------------------------------

    def now(self) -> float:
        assert self._loop is not None
        return self._loop.time()

    def received(self, data: bytes, flow: Flow) -> None:
        self.core.receive(data, flow, self.now())
        self.flush()

    def act(self, action: Callable[[float], object]) -> Any:
        """Run one application call on the core (`lambda now: core.answer(key, local, now)`)."""
        result = action(self.now())
        self.flush()
        return result

    def flush(self) -> None:
        """Send what the core produced, hand out its events, and re-arm its timer."""
        for transmit in self.core.take_transmits():
            self._send(transmit)
        for event in self.core.take_events():
            try:
                self._on_event(event)
            except Exception:
                log.exception("SIP event handler failed on %s", type(event).__name__)
        self._arm()

    def _arm(self) -> None:
        if self._closing or self._loop is None:
            return
        deadline = self.core.next_deadline()
        if deadline == self._timer_at:
            return
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._timer_at = deadline
        if deadline is not None:
            self._timer = self._loop.call_at(deadline, self._fire)

    def _fire(self) -> None:
        self._timer = None
        self._timer_at = None
        self.core.poll(self.now())
        self.flush()

    # ---- sending ------------------------------------------------------------------------

    def _send(self, transmit: Transmit) -> None:
        flow = transmit.flow
        if flow.transport == "tcp":
            writer = self._conns.get(flow.conn_id) if flow.conn_id is not None else None
            if writer is not None and not writer.is_closing():
                self._write(flow.conn_id or 0, writer, transmit.data)
            else:
                self._spawn(self._connect_and_send(flow, transmit.data))
            return
        host, port = flow.remote
        if _is_ip(host):
            if self._udp is not None and not self._udp.is_closing():
                self._udp.sendto(transmit.data, (host, port))
        else:
            self._spawn(self._resolve_and_send(host, port, transmit.data))

    def _write(self, conn_id: int, writer: asyncio.StreamWriter, data: bytes) -> None:
        transport = writer.transport
        if transport.get_write_buffer_size() > MAX_WRITE_BUFFER:
            log.info("SIP TCP peer %s does not read; closing", conn_id)
            writer.close()
            return
        writer.write(data)

    async def _resolve_and_send(self, host: str, port: int, data: bytes) -> None:
        assert self._loop is not None
        try:
            async with asyncio.timeout(CONNECT_TIMEOUT_S):
                infos = await self._loop.getaddrinfo(host, port, type=2)  # SOCK_DGRAM
        except (OSError, TimeoutError) as exc:
            log.info("cannot resolve SIP destination %s: %r", host, exc)
            return
        if infos and self._udp is not None and not self._udp.is_closing():
            self._udp.sendto(data, infos[0][4][:2])

    async def _connect_and_send(self, flow: Flow, data: bytes) -> None:
        host, port = flow.remote
        try:
            async with asyncio.timeout(CONNECT_TIMEOUT_S):
                reader, writer = await asyncio.open_connection(host, port)
        except (OSError, TimeoutError) as exc:
            log.info("cannot reach SIP peer %s:%d over TCP: %r", host, port, exc)
            return
        conn_id = self._register(writer)
        self._write(conn_id, writer, data)
        self._serve(reader, writer, conn_id)

    def _spawn(self, coro: Any) -> None:
        if self._closing:
            coro.close()
            return
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # ---- TCP ----------------------------------------------------------------------------

    async def _on_connection(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        peer = writer.get_extra_info("peername") or ("", 0)
        source = str(peer[0])
        if not self.core.config.allow.allows(source) or len(self._conns) >= MAX_TCP_CONNECTIONS:
            self.core.stats.denied += 1
            writer.close()
            return
        # A trusted proxy's connections carry many callers' requests (who each sent them is
        # only known per message, in its Via), so they are not one source's share.
        counted = not self.core.config.trusted_proxies.allows(source)
        if counted:
            held = self._per_source.get(source, 0)
            if held >= self.max_per_source:
                # One allowed host must not hold every slot: the others' calls need them too.
                self.refused_per_source += 1
                writer.close()
                return
            self._per_source[source] = held + 1
        conn_id = self._register(writer)
        try:
            await self._read_loop(reader, writer, conn_id, (source, int(peer[1])))
        finally:
            if counted:
                left = self._per_source.get(source, 1) - 1
                if left > 0:
                    self._per_source[source] = left
                else:
                    self._per_source.pop(source, None)

    def _register(self, writer: asyncio.StreamWriter) -> int:
        self._next_conn += 1
        self._conns[self._next_conn] = writer
        return self._next_conn

    def _serve(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, conn_id: int
    ) -> None:
        peer = writer.get_extra_info("peername") or ("", 0)
        task = asyncio.create_task(
            self._read_loop(reader, writer, conn_id, (str(peer[0]), int(peer[1])))
        )
        self._conn_tasks.add(task)
        task.add_done_callback(self._conn_tasks.discard)

    async def _read_loop(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        conn_id: int,
        peer: tuple[str, int],
    ) -> None:
        flow = Flow("tcp", peer, conn_id)
        crlf = b""
        try:
            while not self._closing:
                try:
                    async with asyncio.timeout(self.idle_s):
                        first = await reader.read(1)
                except TimeoutError:
                    if self.core.has_dialog_on(conn_id):
                        continue  # the dialog's requests need this connection
                    self.idle_closed += 1
                    return
                if not first:
                    return
                if first in b"\r\n":
                    # CRLF keep-alives between messages; a double CRLF is a ping.
                    crlf = (crlf + first)[-len(PING) :]
                    if crlf == PING:
                        crlf = b""
                        self._write(conn_id, writer, PONG)
                    continue
                crlf = b""
                async with asyncio.timeout(MESSAGE_READ_TIMEOUT_S):
                    head = first + await reader.readuntil(b"\r\n\r\n")
                    if len(head) > MAX_HEADER_BYTES:
                        return
                    length = _content_length(head)
                    if length < 0 or length > MAX_MESSAGE_BYTES:
                        self.core.stats.malformed += 1
                        return  # the stream cannot be framed any more
                    body = await reader.readexactly(length) if length else b""
                self.received(head + body, flow)
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, TimeoutError,
                ConnectionError, OSError):  # fmt: skip
            return
        finally:
            self._conns.pop(conn_id, None)
            writer.close()


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True
