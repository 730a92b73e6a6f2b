"""The hot path's own text frames parse, in websockets' parser, as the frames websockets would
have sent."""

from __future__ import annotations

import pytest
from websockets.client import ClientProtocol
from websockets.frames import Opcode
from websockets.protocol import State
from websockets.server import ServerProtocol
from websockets.uri import parse_uri

from telephony.ws_frames import MaskSource, client_text_frame, server_text_frame

SIZES = [0, 1, 125, 126, 127, 300, 65535, 65536, 70000]


@pytest.mark.parametrize("size", SIZES)
def test_a_client_frame_is_read_by_a_server_as_the_same_text(size: int) -> None:
    server = ServerProtocol(state=State.OPEN, max_size=None)
    text = bytes(32 + i % 95 for i in range(size))
    masks = MaskSource()
    server.receive_data(
        client_text_frame(text, masks.next()) + client_text_frame(b"x", masks.next())
    )
    frames = server.events_received()
    assert [(f.opcode, f.fin, bytes(f.data)) for f in frames] == [
        (Opcode.TEXT, True, text),
        (Opcode.TEXT, True, b"x"),
    ]
    assert server.parser_exc is None


@pytest.mark.parametrize("size", SIZES)
def test_a_server_frame_is_read_by_a_client_as_the_same_text(size: int) -> None:
    client = ClientProtocol(parse_uri("ws://localhost/"), state=State.OPEN, max_size=None)
    text = b"a" * size
    client.receive_data(server_text_frame(text))
    frames = client.events_received()
    assert [(f.opcode, f.fin, bytes(f.data)) for f in frames] == [(Opcode.TEXT, True, text)]
    assert client.parser_exc is None


def test_a_server_refuses_an_unmasked_frame_so_the_mask_is_really_there() -> None:
    server = ServerProtocol(state=State.OPEN)
    server.receive_data(server_text_frame(b"hello"))
    assert server.parser_exc is not None  # the counter-check: masking is what it looks at


def test_masks_are_not_repeated_across_a_pool_refill() -> None:
    masks = MaskSource()
    drawn = [masks.next() for _ in range(3000)]  # three pools
    assert all(len(m) == 4 for m in drawn)
    # 3,000 draws of 32 random bits: a repeat is possible but vanishingly rare (~0.1%);
    # a pool served twice would repeat 1,024 of them.
    assert len(set(drawn)) > 2990


async def test_waiting_items_is_true_exactly_while_a_queue_holds_items() -> None:
    """The per-frame "does anything wait before this frame" test: the queue's own deque where
    the library keeps one, else a probe that asks the queue (another library version)."""
    import asyncio

    from websockets.asyncio.messages import SimpleQueue

    from telephony.ws_frames import waiting_items

    class Renamed(asyncio.Queue[int]):  # items no longer under `_queue`
        pass

    asyncio_queue: asyncio.Queue[int] = asyncio.Queue()
    websockets_queue: SimpleQueue[int] = SimpleQueue()
    renamed = Renamed()
    probes = [
        (asyncio_queue, waiting_items(asyncio_queue, "_queue"), asyncio_queue.put_nowait),
        (websockets_queue, waiting_items(websockets_queue, "queue"), websockets_queue.put),
        (renamed, waiting_items(renamed, "_items_elsewhere"), renamed.put_nowait),
    ]
    for _queue, waiting, put in probes:
        assert not waiting
        put(1)
        assert waiting
    asyncio_queue.get_nowait()
    assert not probes[0][1]
    assert await websockets_queue.get() == 1
    assert not probes[1][1]
    renamed.get_nowait()
    assert not probes[2][1]
