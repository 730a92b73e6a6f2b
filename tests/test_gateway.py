"""The tool pipeline end to end on real Postgres: policy, admission, confirmation, PINs."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import json
import uuid
from collections.abc import Mapping
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
import sqlalchemy as sa
from pydantic import BaseModel
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from telephony.tool_gateway import (
    CallContext,
    ConfirmationEvidence,
    FunctionCallRequest,
    ToolGateway,
    ToolReply,
)
from tools import ledger
from tools.gateway import ToolPipeline
from tools.identity import Account, StaticIdentityStore
from tools.ledger import OperationRecord
from tools.policy import PolicyConfig
from tools.registry import ConcurrencyLimit, OverflowPolicy, Registry, ToolSpec
from tools.restaurant.catalog import restaurant_catalog
from tools.states import OperationStatus

S = OperationStatus
START = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)
BOOK = {"date": "2026-12-05", "time": "21:00", "party_size": 4, "name": "Ada"}
KNOWN_PHONE = "+15550002"
PIN = "4321"


class Clock:
    def __init__(self) -> None:
        self.now = START

    def __call__(self) -> datetime:
        return self.now


class TableQueue:
    """Enqueue into a table on the admitting connection (what Procrastinate does)."""

    def __init__(self, fail: bool = False) -> None:
        self.fail = fail

    async def __call__(self, conn: AsyncConnection, operation_id: uuid.UUID) -> None:
        await conn.execute(
            sa.text("INSERT INTO test_jobs (operation_id) VALUES (:id)"), {"id": operation_id}
        )
        if self.fail:
            raise RuntimeError("queue refused the job")


class FakeReads:
    """A stand-in provider for reads; can hang to exercise the deadline."""

    def __init__(self) -> None:
        self.hang = asyncio.Event()
        self.broken = False
        self.calls: list[tuple[str, dict[str, Any]]] = []

    async def __call__(self, spec: ToolSpec, args: BaseModel) -> Mapping[str, Any]:
        self.calls.append((spec.name, args.model_dump(mode="json")))
        if self.hang.is_set():
            await asyncio.Event().wait()
        if self.broken:
            raise RuntimeError("provider exploded")
        if spec.name == "get_booking":
            return {"found": False}
        return {**args.model_dump(mode="json"), "available": True, "seats_left": 10}


class CallerAnswers:
    """The call's side of `CallerEvidence`: what these tests say the caller did.

    By default the caller heard every readback and answered after it (the honest flow the
    bridge observes); `heard = False` is a model that confirms on its own.
    """

    def __init__(self) -> None:
        self.heard = True
        self.asked: list[str] = []

    def confirmation_evidence(self, operation_id: str) -> ConfirmationEvidence:
        self.asked.append(operation_id)
        if not self.heard:
            return ConfirmationEvidence(False, "the caller has not answered the readback yet")
        return ConfirmationEvidence(
            True,
            "the readback was heard in full and the caller spoke after it",
            readback_item_id="item_readback",
            readback_heard_ms=2400,
            readback_audio_ms=2400,
            caller_item_id="item_caller_yes",
        )


class PendingSink:
    def __init__(self) -> None:
        self.handed: list[tuple[str, list[OperationRecord]]] = []

    async def __call__(self, ctx: CallContext, ops: list[OperationRecord]) -> None:
        self.handed.append((ctx.call_id, ops))


@pytest.fixture
async def jobs_table(engine: AsyncEngine) -> None:
    async with engine.begin() as conn:
        await conn.execute(
            sa.text("CREATE TABLE IF NOT EXISTS test_jobs (operation_id uuid NOT NULL)")
        )
        await conn.execute(sa.text("TRUNCATE test_jobs"))


class Harness:
    def __init__(
        self,
        engine: AsyncEngine,
        *,
        registry: Registry | None = None,
        policy: PolicyConfig | None = None,
        queue: TableQueue | None = None,
    ) -> None:
        self.engine = engine
        self.clock = Clock()
        self.reads = FakeReads()
        self.queue = queue or TableQueue()
        self.pending = PendingSink()
        self.caller = CallerAnswers()
        store = StaticIdentityStore(
            [Account("acc-2", "t1", frozenset({KNOWN_PHONE}), pin=PIN, name="Grace")]
        )
        self.pipe = ToolPipeline(
            engine,
            registry or restaurant_catalog(),
            enqueue=self.queue,
            read_executor=self.reads,
            identities=store,
            policy=policy,
            clock=self.clock,
            pending_results=self.pending,
        )
        self._ids = itertools.count(1)

    async def call(
        self, ctx: CallContext, name: str, args: dict[str, Any] | str, call_id: str | None = None
    ) -> ToolReply:
        n = next(self._ids)
        raw = args if isinstance(args, str) else json.dumps(args)
        req = FunctionCallRequest(
            call_id=call_id or f"fc_{n}",
            name=name,
            arguments=raw,
            item_id=f"item_{n}",
            response_id=f"resp_{n}",
            turn_id=n,
            evidence=self.caller,
        )
        return await self.pipe.handle(ctx, req)

    async def confirm(self, ctx: CallContext, reply: ToolReply, yes: bool = True) -> ToolReply:
        return await self.call(
            ctx,
            "confirm_operation",
            {"operation_id": reply.output["operation_id"], "confirmed": yes},
        )

    async def jobs(self) -> list[uuid.UUID]:
        async with self.engine.connect() as conn:
            return [r[0] for r in await conn.execute(sa.text("SELECT operation_id FROM test_jobs"))]

    async def op(self, reply_or_id: ToolReply | str) -> OperationRecord:
        oid = reply_or_id.operation_id if isinstance(reply_or_id, ToolReply) else reply_or_id
        assert oid is not None
        async with self.engine.connect() as conn:
            op = await ledger.get_operation(conn, uuid.UUID(oid))
        assert op is not None
        return op

    async def events(self, op_id: uuid.UUID) -> list[ledger.EventRecord]:
        async with self.engine.connect() as conn:
            return await ledger.get_events(conn, op_id)

    async def count(self, table: str) -> int:
        async with self.engine.connect() as conn:
            return int((await conn.execute(sa.text(f"SELECT count(*) FROM {table}"))).scalar_one())

    async def tool_call(self, ctx: CallContext, provider_call_id: str) -> ledger.ToolCallRecord:
        async with self.engine.connect() as conn:
            tc = await ledger.get_tool_call(conn, ctx.call_id, provider_call_id)
        assert tc is not None
        return tc


def ctx(call_id: str = "call-1", phone: str | None = "+15550001") -> CallContext:
    return CallContext(
        call_id=call_id,
        call_sid=f"CA{call_id}",
        tenant_id="t1",
        from_number=phone,
        to_number="+15559999",
    )


@pytest.fixture
async def h(engine: AsyncEngine, jobs_table: None) -> Harness:
    return Harness(engine)


def test_pipeline_satisfies_the_gateway_protocol(h: Harness) -> None:
    gateway: ToolGateway = h.pipe
    names = [d["name"] for d in gateway.definitions()]
    assert "book_table" in names and "confirm_operation" in names


# --- reads --------------------------------------------------------------------------------


async def test_read_answers_inline_and_is_recorded(h: Harness) -> None:
    reply = await h.call(
        ctx(),
        "check_availability",
        {"date": "2026-12-05", "time": "21:00", "party_size": 4},
        call_id="fc_r",
    )
    assert reply.output["status"] == "ok" and reply.output["available"] is True
    assert reply.wants_response and reply.operation_id is None
    tc = await h.tool_call(ctx(), "fc_r")
    assert tc.decision == "allow" and tc.output == reply.output
    assert tc.arguments == {"date": "2026-12-05", "time": "21:00", "party_size": 4}
    assert tc.turn_id is not None and tc.response_id and tc.item_id
    assert await h.count("operations") == 0


async def test_read_past_its_deadline_answers_with_a_retryable_error(
    engine: AsyncEngine, jobs_table: None
) -> None:
    base = restaurant_catalog()
    fast = Registry(
        [
            dataclasses.replace(s, deadline_s=0.05) if s.name == "check_availability" else s
            for s in base
        ]
    )
    h = Harness(engine, registry=fast)
    h.reads.hang.set()
    reply = await h.call(
        ctx(),
        "check_availability",
        {"date": "2026-12-05", "time": "21:00", "party_size": 4},
        call_id="fc_slow",
    )
    assert reply.output["status"] == "error" and reply.output["retryable"] is True
    assert (await h.tool_call(ctx(), "fc_slow")).output == reply.output


async def test_read_whose_provider_fails_answers_plainly_and_is_recorded(h: Harness) -> None:
    h.reads.broken = True
    reply = await h.call(
        ctx(),
        "check_availability",
        {"date": "2026-12-05", "time": "21:00", "party_size": 4},
        call_id="fc_err",
    )
    assert reply.output["status"] == "error" and "couldn't check" in reply.output["message"]
    assert (await h.tool_call(ctx(), "fc_err")).output == reply.output


async def test_read_denied_by_policy_never_reaches_the_provider(h: Harness) -> None:
    reply = await h.call(
        ctx(), "check_availability", {"date": "2026-12-05", "time": "03:00", "party_size": 4}
    )
    assert reply.output["status"] == "denied" and "between" in reply.output["message"]
    assert h.reads.calls == []


# --- malformed calls ----------------------------------------------------------------------


async def test_invalid_json_arguments_get_a_clean_error_and_are_recorded(h: Harness) -> None:
    reply = await h.call(ctx(), "book_table", '{"date": "2026-12-05", ', call_id="fc_bad")
    assert reply.output["status"] == "error" and "JSON" in reply.output["message"]
    tc = await h.tool_call(ctx(), "fc_bad")
    assert tc.decision == "invalid" and tc.raw_arguments == '{"date": "2026-12-05", '
    assert await h.count("operations") == 0


async def test_schema_invalid_arguments_get_a_clean_error(h: Harness) -> None:
    reply = await h.call(ctx(), "book_table", BOOK | {"time": "9pm"}, call_id="fc_s")
    assert reply.output["status"] == "error" and "time" in reply.output["message"]
    assert (await h.tool_call(ctx(), "fc_s")).decision == "invalid"


async def test_unknown_tool_gets_a_clean_error(h: Harness) -> None:
    reply = await h.call(ctx(), "order_pizza", "{}")
    assert reply.output["status"] == "error" and "order_pizza" in reply.output["message"]


async def test_schema_valid_but_disallowed_call_is_denied_without_an_operation(h: Harness) -> None:
    reply = await h.call(ctx(), "book_table", BOOK | {"party_size": 30}, call_id="fc_big")
    assert reply.output["status"] == "denied" and "at most 8" in reply.output["message"]
    assert (await h.tool_call(ctx(), "fc_big")).decision == "deny"
    assert await h.count("operations") == 0 and await h.jobs() == []


# --- confirmation -------------------------------------------------------------------------


async def test_booking_waits_for_confirmation_with_the_exact_readback(h: Harness) -> None:
    reply = await h.call(ctx(), "book_table", BOOK)
    assert reply.output["status"] == "awaiting_confirmation"
    assert reply.output["readback"] == (
        "Please confirm: a table for 4 people on Saturday 05 December 2026 at 21:00 under the "
        "name Ada. Say yes to confirm."
    )
    assert reply.output["operation_id"] == reply.operation_id
    op = await h.op(reply)
    assert op.status is S.AWAITING_CONFIRMATION
    assert op.confirm_by == START + timedelta(seconds=120)
    assert await h.jobs() == []


async def test_confirmed_booking_is_admitted_and_enqueued_with_its_true_state(h: Harness) -> None:
    asked = await h.call(ctx(), "book_table", BOOK)
    reply = await h.confirm(ctx(), asked)
    assert reply.output["status"] == "admitted"
    assert "not confirmed yet" in reply.output["message"]
    assert "booked" not in reply.output["message"].lower()
    op = await h.op(asked)
    assert op.status is S.ADMITTED and op.expires_at is not None
    assert await h.jobs() == [op.operation_id]
    trail = [(e.from_status, e.to_status, e.actor) for e in await h.events(op.operation_id)]
    assert trail == [
        (None, S.AWAITING_CONFIRMATION, "policy"),
        (S.AWAITING_CONFIRMATION, S.ADMITTED, "policy"),
    ]


async def test_the_models_yes_without_the_callers_answer_admits_nothing(h: Harness) -> None:
    asked = await h.call(ctx(), "book_table", BOOK)
    assert asked.awaiting_confirmation  # the bridge takes what follows as the readback
    h.caller.heard = False
    reply = await h.confirm(ctx(), asked)
    assert reply.output["status"] == "awaiting_confirmation"
    assert "wait until they answer" in reply.output["message"]
    assert reply.awaiting_confirmation
    op = await h.op(asked)
    assert op.status is S.AWAITING_CONFIRMATION and op.confirmed_by is None
    assert await h.jobs() == []
    tc = await h.tool_call(ctx(), "fc_2")
    assert tc.decision == "needs_caller"
    [refused] = [e for e in await h.events(op.operation_id) if e.kind == "decision"]
    assert refused.data["rule"] == "caller_evidence"
    assert refused.data["requested_by"] == "model"
    # Once the call observed the caller's answer, the same request is admitted.
    h.caller.heard = True
    admitted = await h.confirm(ctx(), asked)
    assert admitted.output["status"] == "admitted"
    op = await h.op(asked)
    assert op.confirmed_by == "caller"
    assert op.confirmation is not None
    assert op.confirmation["caller_item_id"] == "item_caller_yes"
    assert op.confirmation["readback_heard_ms"] == 2400
    moved = [e for e in await h.events(op.operation_id) if e.to_status is S.ADMITTED]
    assert moved[0].data["confirmed_by"] == "caller"
    assert moved[0].data["evidence"] == op.confirmation


async def test_a_request_from_a_leg_that_cannot_attest_the_caller_is_never_confirmed(
    h: Harness,
) -> None:
    asked = await h.call(ctx(), "book_table", BOOK)
    req = FunctionCallRequest(
        call_id="fc_no_port",
        name="confirm_operation",
        arguments=json.dumps({"operation_id": asked.output["operation_id"], "confirmed": True}),
        item_id="item_x",
        response_id="resp_x",
        turn_id=9,
    )
    reply = await h.pipe.handle(ctx(), req)
    assert reply.output["status"] == "awaiting_confirmation"
    assert (await h.op(asked)).status is S.AWAITING_CONFIRMATION
    assert await h.jobs() == []


async def test_confirmation_whose_enqueue_fails_leaves_neither_admission_nor_job(
    engine: AsyncEngine, jobs_table: None
) -> None:
    h = Harness(engine, queue=TableQueue(fail=True))
    asked = await h.call(ctx(), "book_table", BOOK)
    reply = await h.confirm(ctx(), asked)
    assert reply.output["status"] == "error"
    assert (await h.op(asked)).status is S.AWAITING_CONFIRMATION
    assert await h.jobs() == []
    assert len(await h.events((await h.op(asked)).operation_id)) == 1


async def test_expired_confirmation_cancels_and_says_so(h: Harness) -> None:
    asked = await h.call(ctx(), "book_table", BOOK)
    h.clock.now += timedelta(seconds=121)
    reply = await h.confirm(ctx(), asked)
    assert reply.output["status"] == "cancelled" and "too late" in reply.output["message"]
    op = await h.op(asked)
    assert op.status is S.CANCELLED
    assert (await h.events(op.operation_id))[-1].reason == "confirmation expired"
    assert await h.jobs() == []


async def test_confirmation_from_another_call_is_refused(h: Harness) -> None:
    asked = await h.call(ctx("call-1"), "book_table", BOOK)
    reply = await h.confirm(ctx("call-2"), asked)
    assert reply.output["status"] == "denied" and "different call" in reply.output["message"]
    assert reply.operation_id is None
    op = await h.op(asked)
    assert op.status is S.AWAITING_CONFIRMATION and await h.jobs() == []
    assert (await h.events(op.operation_id))[-1].reason == "confirmation from another call refused"


async def test_declined_confirmation_cancels(h: Harness) -> None:
    asked = await h.call(ctx(), "book_table", BOOK)
    reply = await h.confirm(ctx(), asked, yes=False)
    assert reply.output["status"] == "cancelled"
    assert (await h.op(asked)).status is S.CANCELLED and await h.jobs() == []


async def test_confirming_twice_admits_once(h: Harness) -> None:
    asked = await h.call(ctx(), "book_table", BOOK)
    first = await h.confirm(ctx(), asked)
    second = await h.confirm(ctx(), asked)
    assert first.output["status"] == second.output["status"] == "admitted"
    assert len(await h.jobs()) == 1


# --- duplicates ---------------------------------------------------------------------------


async def test_same_intent_twice_maps_to_one_operation(h: Harness) -> None:
    a = await h.call(ctx(), "book_table", BOOK)
    b = await h.call(ctx(), "book_table", BOOK)
    assert a.operation_id == b.operation_id
    assert b.output["readback"] == a.output["readback"]
    await h.confirm(ctx(), a)
    c = await h.call(ctx(), "book_table", BOOK)
    assert c.operation_id == a.operation_id and c.output["status"] == "admitted"
    assert await h.count("operations") == 1 and len(await h.jobs()) == 1
    assert (await h.tool_call(ctx(), "fc_2")).decision == "duplicate"


async def test_same_provider_call_delivered_twice_returns_the_same_operation(h: Harness) -> None:
    a = await h.call(ctx(), "book_table", BOOK, call_id="fc_same")
    b = await h.call(ctx(), "book_table", BOOK, call_id="fc_same")
    assert a.operation_id == b.operation_id and a.output == b.output
    assert await h.count("tool_calls") == 1 and await h.count("operations") == 1


async def test_concurrent_duplicate_calls_create_one_operation_and_one_job(h: Harness) -> None:
    asked = await asyncio.gather(*(h.call(ctx(), "book_table", BOOK) for _ in range(5)))
    assert len({r.operation_id for r in asked}) == 1
    confirms = await asyncio.gather(*(h.confirm(ctx(), asked[0]) for _ in range(3)))
    assert {r.output["status"] for r in confirms} == {"admitted"}
    assert await h.count("operations") == 1 and len(await h.jobs()) == 1


async def test_asking_again_after_a_decline_is_a_new_operation(h: Harness) -> None:
    first = await h.call(ctx(), "book_table", BOOK)
    await h.confirm(ctx(), first, yes=False)
    again = await h.call(ctx(), "book_table", BOOK)
    assert again.output["status"] == "awaiting_confirmation"
    assert again.operation_id != first.operation_id


async def test_the_same_intent_in_another_call_is_another_operation(h: Harness) -> None:
    a = await h.call(ctx("call-1"), "book_table", BOOK)
    b = await h.call(ctx("call-2"), "book_table", BOOK)
    assert a.operation_id != b.operation_id


# --- identity -----------------------------------------------------------------------------


async def test_withheld_caller_is_denied_a_booking_with_a_speakable_reason(h: Harness) -> None:
    reply = await h.call(ctx(phone="anonymous"), "book_table", BOOK)
    assert reply.output["status"] == "denied"
    assert "withheld" in reply.output["message"] and await h.count("operations") == 0


async def test_unknown_caller_cannot_cancel_someone_elses_booking(h: Harness) -> None:
    reply = await h.call(ctx(), "cancel_booking", {"booking_id": "BK1"})
    assert reply.output["status"] == "denied" and "PIN" in reply.output["message"]
    assert await h.count("operations") == 0


async def test_pin_via_dtmf_unlocks_a_tool_that_needs_verification(h: Harness) -> None:
    caller = ctx(phone=KNOWN_PHONE)
    first = await h.call(caller, "cancel_booking", {"booking_id": "BK1"})
    assert first.output["status"] == "needs_verification" and "keypad" in first.output["message"]
    for digit in PIN:
        await h.pipe.on_dtmf(caller, digit)
    second = await h.call(caller, "cancel_booking", {"booking_id": "BK1"})
    assert second.output["status"] == "admitted"
    assert await h.jobs() == [(await h.op(second)).operation_id]


async def test_spoken_pin_unlocks_and_is_never_stored(h: Harness) -> None:
    caller = ctx(phone=KNOWN_PHONE)
    reply = await h.call(caller, "verify_pin", {"digits": "four three two one"}, call_id="fc_pin")
    assert reply.output["status"] == "verified"
    tc = await h.tool_call(caller, "fc_pin")
    assert PIN not in tc.raw_arguments and "four" not in tc.raw_arguments
    assert tc.arguments is None or PIN not in json.dumps(tc.arguments)
    after = await h.call(caller, "cancel_booking", {"booking_id": "BK1"})
    assert after.output["status"] == "admitted"


async def test_wrong_pins_lock_verification_for_the_call(h: Harness) -> None:
    caller = ctx(phone=KNOWN_PHONE)
    outcomes = [
        (await h.call(caller, "verify_pin", {"digits": "0000"})).output["status"] for _ in range(3)
    ]
    assert outcomes == ["wrong", "wrong", "locked"]
    assert (await h.call(caller, "verify_pin", {"digits": PIN})).output["status"] == "locked"
    reply = await h.call(caller, "cancel_booking", {"booking_id": "BK1"})
    assert reply.output["status"] == "denied" and "Too many wrong PINs" in reply.output["message"]


async def test_the_booker_may_cancel_their_own_booking_without_a_pin(h: Harness) -> None:
    async with h.engine.begin() as conn:
        adm = await ledger.admit_operation(
            conn,
            tenant_id="t1",
            tool="book_table",
            args=BOOK,
            idempotency_key="earlier",
            caller="+15550001",
            enqueue=h.queue,
        )
        oid = adm.operation.operation_id
        await ledger.claim_for_execution(conn, oid, worker_id="w", attempt_deadline_s=5)
        await ledger.transition(
            conn, oid, S.RUNNING, S.COMMITTED, actor="worker:w", reason="ok", provider_ref="BK1"
        )
    reply = await h.call(ctx(phone="+15550001"), "cancel_booking", {"booking_id": "bk1"})
    assert reply.output["status"] == "admitted"
    other = await h.call(ctx("call-9", phone="+15550003"), "cancel_booking", {"booking_id": "BK1"})
    assert other.output["status"] == "denied"


# --- limits and overflow ------------------------------------------------------------------


async def _book_confirmed(h: Harness, c: CallContext, time: str) -> ToolReply:
    asked = await h.call(c, "book_table", BOOK | {"time": time})
    if asked.output["status"] != "awaiting_confirmation":
        return asked
    return await h.confirm(c, asked)


async def test_caller_frequency_limit_denies_further_mutations(
    engine: AsyncEngine, jobs_table: None
) -> None:
    h = Harness(engine, policy=PolicyConfig(max_mutations_per_caller=1))
    first = await _book_confirmed(h, ctx(), "19:00")
    assert first.output["status"] == "admitted"
    second = await h.call(ctx(), "book_table", BOOK | {"time": "20:00"})
    assert second.output["status"] == "denied" and second.output["rule"] == "frequency"


def _limited(limit: ConcurrencyLimit) -> Registry:
    return restaurant_catalog(booking_concurrency=limit)


async def test_overflow_reject_denies_beyond_the_concurrency_limit(
    engine: AsyncEngine, jobs_table: None
) -> None:
    h = Harness(engine, registry=_limited(ConcurrencyLimit(1, OverflowPolicy.REJECT)))
    assert (await _book_confirmed(h, ctx("a"), "19:00")).output["status"] == "admitted"
    second = await h.call(ctx("b", "+15550005"), "book_table", BOOK | {"time": "20:00"})
    assert second.output["status"] == "denied" and second.output["rule"] == "concurrency"
    # Another day is another resource.
    other_day = await h.call(ctx("b", "+15550005"), "book_table", BOOK | {"date": "2026-12-06"})
    assert other_day.output["status"] == "awaiting_confirmation"


async def test_overflow_queue_admits_up_to_the_queue_and_says_so(
    engine: AsyncEngine, jobs_table: None
) -> None:
    h = Harness(engine, registry=_limited(ConcurrencyLimit(1, OverflowPolicy.QUEUE, max_queued=1)))
    assert (await _book_confirmed(h, ctx("a"), "19:00")).output["status"] == "admitted"
    queued = await _book_confirmed(h, ctx("b", "+15550005"), "20:00")
    assert queued.output["status"] == "admitted" and queued.output["overflow"] == "queue"
    assert "queued" in queued.output["message"]
    full = await h.call(ctx("c", "+15550006"), "book_table", BOOK | {"time": "21:00"})
    assert full.output["status"] == "denied"
    assert len(await h.jobs()) == 2


async def test_overflow_degrade_admits_and_promises_a_text_message(
    engine: AsyncEngine, jobs_table: None
) -> None:
    h = Harness(engine, registry=_limited(ConcurrencyLimit(1, OverflowPolicy.DEGRADE)))
    assert (await _book_confirmed(h, ctx("a"), "19:00")).output["status"] == "admitted"
    degraded = await _book_confirmed(h, ctx("b", "+15550005"), "20:00")
    assert degraded.output["status"] == "admitted" and degraded.output["overflow"] == "degrade"
    assert "text message" in degraded.output["message"]
    assert (await h.op(degraded)).overflow == "degrade"


async def test_limits_are_checked_again_at_confirmation(
    engine: AsyncEngine, jobs_table: None
) -> None:
    h = Harness(engine, registry=_limited(ConcurrencyLimit(1, OverflowPolicy.REJECT)))
    waiting = await h.call(ctx("b", "+15550005"), "book_table", BOOK | {"time": "20:00"})
    assert (await _book_confirmed(h, ctx("a"), "19:00")).output["status"] == "admitted"
    late = await h.confirm(ctx("b", "+15550005"), waiting)
    assert late.output["status"] == "denied"
    assert (await h.op(waiting)).status is S.CANCELLED
    assert len(await h.jobs()) == 1


# --- call end -----------------------------------------------------------------------------


async def test_call_end_cancels_pending_confirmations_and_hands_over_in_flight_work(
    h: Harness,
) -> None:
    waiting = await h.call(ctx(), "book_table", BOOK | {"time": "19:00"})
    admitted = await _book_confirmed(h, ctx(), "20:00")
    await h.pipe.on_call_end(ctx())
    op = await h.op(waiting)
    assert op.status is S.CANCELLED
    assert (await h.events(op.operation_id))[-1].reason == "call ended before confirmation"
    assert [(c, [o.operation_id for o in ops]) for c, ops in h.pending.handed] == [
        ("call-1", [(await h.op(admitted)).operation_id])
    ]
    assert (await h.op(admitted)).status is S.ADMITTED
