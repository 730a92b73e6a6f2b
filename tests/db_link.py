"""A TCP relay in front of PostgreSQL that a test can cut: a database outage over real sockets.

While cut, every connection through it is reset and a new one is reset as soon as it opens
(what a client sees when the server or the network goes away); restored, it relays again. The
service under test gets the relay's address as its database; the test itself, the system of
record and anything else keep talking to PostgreSQL directly.
"""

from __future__ import annotations

import asyncio
import contextlib
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

CHUNK = 65536


class DatabaseLink:
    """The service's road to PostgreSQL, with a switch."""

    def __init__(self, database_url: str) -> None:
        self.target_url = database_url
        parts = urlsplit(database_url)
        # libpq's query parameters win over the authority (the embedded PostgreSQL is
        # reached by a Unix socket directory given as `host`).
        query = dict(parse_qsl(parts.query))
        self._host = query.pop("host", None) or parts.hostname or "127.0.0.1"
        self._port = int(query.pop("port", None) or parts.port or 5432)
        self._query = urlencode(query)
        self._server: asyncio.Server | None = None
        self._pipes: set[asyncio.StreamWriter] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self.up = True
        self.refused = 0  # connections reset while cut
        self.url = ""

    async def start(self) -> DatabaseLink:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        port = self._server.sockets[0].getsockname()[1]
        parts = urlsplit(self.target_url)
        netloc = parts.netloc.rsplit("@", 1)
        host = f"127.0.0.1:{port}"
        self.url = urlunsplit(
            parts._replace(
                netloc=f"{netloc[0]}@{host}" if len(netloc) == 2 else host, query=self._query
            )
        )
        return self

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
        self.cut()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def cut(self) -> None:
        """The database goes away: every connection through the link is reset."""
        self.up = False
        for writer in list(self._pipes):
            writer.transport.abort()
        self._pipes.clear()

    def restore(self) -> None:
        self.up = True

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if not self.up:
            self.refused += 1
            writer.transport.abort()
            return
        try:
            if self._host.startswith("/"):
                up_reader, up_writer = await asyncio.open_unix_connection(
                    f"{self._host}/.s.PGSQL.{self._port}"
                )
            else:
                up_reader, up_writer = await asyncio.open_connection(self._host, self._port)
        except OSError:
            writer.transport.abort()
            return
        if not self.up:  # cut while connecting
            writer.transport.abort()
            up_writer.transport.abort()
            return
        self._pipes.update((writer, up_writer))
        for source, sink in ((reader, up_writer), (up_reader, writer)):
            task = asyncio.create_task(self._pipe(source, sink))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _pipe(self, source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
        try:
            while data := await source.read(CHUNK):
                sink.write(data)
                await sink.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            self._pipes.discard(sink)
            with contextlib.suppress(Exception):
                if self.up:
                    sink.close()  # one side ended its connection: so does the other
                else:
                    sink.transport.abort()
