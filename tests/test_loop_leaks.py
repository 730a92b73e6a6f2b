"""The suite's check that a test closes its connections (tests/loop_leaks.py)."""

from __future__ import annotations

import asyncio
import gc
import socket
import warnings

import pytest


def test_a_connection_left_open_fails_as_the_loop_closes_and_is_closed() -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    loop = asyncio.new_event_loop()
    try:
        _, writer = loop.run_until_complete(asyncio.open_connection("127.0.0.1", port))
        accepted, _ = listener.accept()
    finally:
        listener.close()
    try:
        with pytest.raises(
            AssertionError,
            match=rf"-> \(.127.0.0.1., {port}\) \(asyncio.streams.StreamReaderProtocol\)",
        ):
            loop.close()
        assert loop.is_closed()
        # Closed before the error: the peer reads the end, the collector finds nothing.
        accepted.settimeout(5)
        assert accepted.recv(1) == b""
        with warnings.catch_warnings():
            warnings.simplefilter("error", ResourceWarning)
            del writer
            gc.collect()
    finally:
        accepted.close()


def test_a_loop_whose_connections_were_closed_closes_quietly() -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    loop = asyncio.new_event_loop()
    try:

        async def talk() -> None:
            _, writer = await asyncio.open_connection(*listener.getsockname()[:2])
            writer.close()
            await writer.wait_closed()

        loop.run_until_complete(talk())
    finally:
        listener.close()
        loop.close()
    assert loop.is_closed()
