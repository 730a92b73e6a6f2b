"""ToolPipeline.handle fed random argument strings: a clean error, a recorded row, never a raise."""

from __future__ import annotations

import json
import random
import uuid
from collections.abc import Mapping
from typing import Any

import pytest
import sqlalchemy as sa
from pydantic import BaseModel
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from telephony.tool_gateway import CallContext, FunctionCallRequest, ToolReply
from tools import ledger
from tools.errors import InvalidArguments
from tools.gateway import ToolPipeline
from tools.identity import Account, StaticIdentityStore
from tools.registry import ToolSpec
from tools.restaurant.catalog import restaurant_catalog

CATALOG = restaurant_catalog()
TOOLS = [spec.name for spec in CATALOG]
CTX = CallContext(
    call_id="fuzz-call",
    call_sid="CAfuzz",
    tenant_id="t1",
    from_number="+15550001",
    to_number="+15559999",
)

_FRAGMENTS = [
    "{",
    "}",
    "[",
    "]",
    ",",
    ":",
    '"',
    '"date"',
    '"time"',
    '"party_size"',
    '"name"',
    '"booking_id"',
    '"operation_id"',
    '"confirmed"',
    '"digits"',
    '"2026-12-05"',
    '"2026-02-30"',
    '"21:00"',
    '"25:99"',
    "4",
    "-1",
    "0",
    "1e309",
    "NaN",
    "Infinity",
    "9" * 5000,
    "true",
    "null",
    '"\\u0000"',
    '"\\ud800"',
    '"🙂"',
    '"' + "x" * 500 + '"',
    "\x00",
    " ",
]


def garbage_arguments(rng: random.Random) -> str:
    """A random argument string: fragment soup, or a JSON object with junk values."""
    shape = rng.randrange(4)
    if shape == 0:
        return "".join(rng.choice(_FRAGMENTS) for _ in range(rng.randrange(0, 12)))
    if shape == 1:
        keys = ["date", "time", "party_size", "name", "booking_id", "operation_id", "confirmed"]
        values: list[Any] = [None, True, -5, 10**30, 1.5, "", "\x00", "🙂" * 20, [], {}, "x" * 200]
        obj = {rng.choice(keys): rng.choice(values) for _ in range(rng.randrange(0, 5))}
        return json.dumps(obj)
    if shape == 2:
        return "[" * rng.randrange(1, 20_000)
    return "".join(chr(rng.randrange(0, 0x3000)) for _ in range(rng.randrange(0, 40)))


class NoQueue:
    """Admission must never get this far for invalid input."""

    def __init__(self) -> None:
        self.enqueued: list[uuid.UUID] = []

    async def __call__(self, conn: AsyncConnection, operation_id: uuid.UUID) -> None:
        self.enqueued.append(operation_id)


class NoReads:
    def __init__(self) -> None:
        self.calls = 0

    async def __call__(self, spec: ToolSpec, args: BaseModel) -> Mapping[str, Any]:
        self.calls += 1
        return {"found": False}


def _pipeline(engine: AsyncEngine, queue: NoQueue, reads: NoReads) -> ToolPipeline:
    store = StaticIdentityStore([Account("acc-1", "t1", frozenset({"+15550001"}), pin="4321")])
    return ToolPipeline(
        engine, CATALOG, enqueue=queue, read_executor=reads, identities=store, handle_timeout_s=10
    )


async def _count(engine: AsyncEngine, table: str) -> int:
    async with engine.connect() as conn:
        return int((await conn.execute(sa.text(f"SELECT count(*) FROM {table}"))).scalar_one())


def _invalid(tool: str, raw: str) -> bool:
    try:
        CATALOG.get(tool).parse(raw)
    except InvalidArguments:
        return True
    return False


async def _handle(pipe: ToolPipeline, n: int, name: str, raw: str) -> ToolReply:
    request = FunctionCallRequest(
        call_id=f"fc_{n}",
        name=name,
        arguments=raw,
        item_id=f"item_{n}",
        response_id=f"resp_{n}",
        turn_id=n,
    )
    return await pipe.handle(CTX, request)


@pytest.mark.parametrize("tool", TOOLS)
async def test_random_arguments_get_a_clean_error_and_a_recorded_tool_call(
    engine: AsyncEngine, tool: str
) -> None:
    rng = random.Random(f"fuzz-pipeline-{tool}")
    queue, reads = NoQueue(), NoReads()
    pipe = _pipeline(engine, queue, reads)
    checked = 0
    for n in range(25):
        raw = garbage_arguments(rng)
        if not _invalid(tool, raw):
            continue  # valid arguments are other tests' business
        checked += 1
        reply = await _handle(pipe, n, tool, raw)
        assert reply.output["status"] == "error", (raw, reply.output)
        assert reply.operation_id is None
        async with engine.connect() as conn:
            tc = await ledger.get_tool_call(conn, CTX.call_id, f"fc_{n}")
        assert tc is not None, raw
        assert tc.decision == "invalid", (raw, tc.decision, tc.decision_reason)
        assert tc.operation_id is None
        assert tc.output == reply.output
    assert checked >= 15
    assert await _count(engine, "operations") == 0
    assert queue.enqueued == [] and reads.calls == 0


@pytest.mark.parametrize(
    ("name", "raw", "provider_call_id"),
    [
        ("book_table", '{"name": "A\\u0000", "date": "2026-12-05"}', "fc_nul_escape"),
        ("book_table", "\x00", "fc_nul_raw"),
        ("get_booking", '{"booking_id": "\\ud800"}', "fc_surrogate"),
        ("x" * 300, "{}", "fc_long_name"),
        ("no_such_tool\x00", "{}", "fc_nul_name"),
        ("book_table", "{}", "fc_" + "9" * 300),
        ("book_table", "{" * 100_000, "fc_deep"),
        ("book_table", '{"\\u0000": 1}', "fc_nul_key"),
        ("book_table", '{"\\ud800": 1}', "fc_surrogate_key"),
        ("get_booking", "\ud800", "fc_raw_surrogate"),
        ("get_booking\udc00", "{}", "fc_surrogate_name"),
    ],
)
async def test_hostile_function_calls_are_answered_and_recorded(
    engine: AsyncEngine, name: str, raw: str, provider_call_id: str
) -> None:
    queue, reads = NoQueue(), NoReads()
    pipe = _pipeline(engine, queue, reads)
    request = FunctionCallRequest(
        call_id=provider_call_id,
        name=name,
        arguments=raw,
        item_id="item_1",
        response_id="resp_1",
        turn_id=1,
    )
    reply = await pipe.handle(CTX, request)
    assert reply.output["status"] == "error", reply.output
    assert reply.operation_id is None
    async with engine.connect() as conn:
        rows = (
            await conn.execute(
                sa.text("SELECT decision FROM tool_calls WHERE call_id = :c"), {"c": CTX.call_id}
            )
        ).all()
    assert len(rows) == 1, "the function call left no tool_calls row"
    assert rows[0][0] in ("invalid", "error")
    assert await _count(engine, "operations") == 0
    assert queue.enqueued == []


async def test_the_same_garbage_twice_is_one_row_and_the_same_answer(engine: AsyncEngine) -> None:
    queue, reads = NoQueue(), NoReads()
    pipe = _pipeline(engine, queue, reads)
    first, second = [await _handle(pipe, 7, "book_table", '{"party_size": "lots"}') for _ in "ab"]
    assert first.output == second.output
    assert first.output["status"] == "error"
    assert await _count(engine, "tool_calls") == 1


@pytest.mark.parametrize("bad", ["A\\u0000B", "\\ud800", "Ada \\udfff"])
async def test_schema_valid_arguments_with_unstorable_text_are_invalid_not_an_internal_error(
    engine: AsyncEngine, bad: str
) -> None:
    queue, reads = NoQueue(), NoReads()
    pipe = _pipeline(engine, queue, reads)
    raw = '{"date": "2026-12-05", "time": "21:00", "party_size": 2, "name": "' + bad + '"}'
    reply = await _handle(pipe, 1, "book_table", raw)
    assert reply.output["status"] == "error"
    assert reply.output["retryable"] is False  # retrying the same text can never work
    async with engine.connect() as conn:
        tc = await ledger.get_tool_call(conn, CTX.call_id, "fc_1")
    assert tc is not None and tc.decision == "invalid"
    assert await _count(engine, "operations") == 0
