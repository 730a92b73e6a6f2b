"""Staff actions on operations: each allowed only where the engine allows it, each recorded in
the operation's history with who and why, safe when two people act at once."""

from __future__ import annotations

import asyncio
import dataclasses
import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from app.ops.operation_actions import (
    Action,
    ActionDone,
    ActionRefused,
    ManualOutcome,
    OperationActions,
    available_actions,
)
from app.ops.sms_resend import ResendResult, SmsInfo
from tests.console_support import age_operation, seed_operation
from tools import ledger
from tools.ledger_models import operations_table as ops_t
from tools.provider import Finding
from tools.reconcile import Reconciler
from tools.registry import Registry, RetryPolicy, ToolKind, ToolSpec
from tools.restaurant.catalog import BookTableArgs, restaurant_catalog
from tools.states import OperationStatus

S = OperationStatus


def registry() -> Registry:
    """The restaurant, plus a tool no lookup can settle and one that may not be retried."""
    reg = restaurant_catalog()
    reg.register(
        ToolSpec(
            name="manual_tool",
            description="books by fax",
            args_model=BookTableArgs,
            kind=ToolKind.MUTATION,
            provider_action="fax.book",
            needs_confirmation=False,
            reconcile=None,  # no lookup: an unknown outcome waits for a person
        )
    )
    reg.register(
        ToolSpec(
            name="one_shot",
            description="not idempotent at the provider",
            args_model=BookTableArgs,
            kind=ToolKind.MUTATION,
            provider_action="x.once",
            needs_confirmation=False,
            provider_idempotent=False,
            retry=RetryPolicy(max_attempts=1),
            reconcile="x.lookup",
        )
    )
    return reg


class FakeProvider:
    """Answers lookups with a scripted finding and counts them."""

    def __init__(self, finding: Finding) -> None:
        self.finding = finding
        self.lookups: list[str] = []

    async def perform(self, *args: Any, **kwargs: Any) -> Any:
        raise AssertionError("actions never perform; workers do")

    async def lookup(self, op: Any, spec: Any) -> Finding:
        self.lookups.append(op.idempotency_key)
        return self.finding


class FakeSms:
    def __init__(self, info: SmsInfo | None) -> None:
        self.info = info
        self.resent: list[tuple[uuid.UUID, str, str]] = []

    async def latest_for_operation(self, operation_id: uuid.UUID) -> SmsInfo | None:
        return self.info

    async def resend(self, operation_id: uuid.UUID, *, actor: str, reason: str) -> ResendResult:
        self.resent.append((operation_id, actor, reason))
        return ResendResult("sms-2", "queued")


@dataclasses.dataclass
class Rig:
    actions: OperationActions
    provider: FakeProvider
    enqueued: list[tuple[uuid.UUID, datetime | None]]


def rig(engine: AsyncEngine, finding: Finding | None = None, sms: FakeSms | None = None) -> Rig:
    reg = registry()
    provider = FakeProvider(finding or Finding("applied", reference="BK42"))
    enqueued: list[tuple[uuid.UUID, datetime | None]] = []

    async def enqueue(conn: AsyncConnection, op_id: uuid.UUID) -> None:
        enqueued.append((op_id, None))

    async def enqueue_at(conn: AsyncConnection, op_id: uuid.UUID, at: datetime | None) -> None:
        enqueued.append((op_id, at))

    def reconciler(actor: str) -> Reconciler:
        return Reconciler(
            engine=engine, registry=reg, provider=provider, enqueue=enqueue_at, actor=actor
        )

    actions = OperationActions(
        engine, reg, enqueue=enqueue, reconciler=reconciler, sms=sms, stuck_after_s=600
    )
    return Rig(actions, provider, enqueued)


async def trail(engine: AsyncEngine, op_id: uuid.UUID) -> list[ledger.EventRecord]:
    async with engine.connect() as conn:
        return await ledger.get_events(conn, op_id)


async def op(engine: AsyncEngine, op_id: uuid.UUID) -> ledger.OperationRecord:
    async with engine.connect() as conn:
        record = await ledger.get_operation(conn, op_id)
    assert record is not None
    return record


async def test_reconcile_records_who_and_why_then_asks_the_system_of_record(
    engine: AsyncEngine,
) -> None:
    r = rig(engine, Finding("applied", reference="BK42", result={"id": "BK42"}))
    op_id = await seed_operation(engine, None, S.UNKNOWN, key="k-reconcile")
    done = await r.actions.reconcile(op_id, actor="staff:ana", why="  caller asked\n again ")
    events = await trail(engine, op_id)
    after = await op(engine, op_id)

    assert done == ActionDone("Reconciled: committed.", "committed")
    assert r.provider.lookups == ["k-reconcile"]  # by idempotency key, never a replay
    assert after.status is S.COMMITTED and after.provider_ref == "BK42"
    decision, transition = events[-2], events[-1]
    assert (decision.kind, decision.actor) == ("decision", "staff:ana")
    assert decision.reason == "reconcile now: caller asked again"
    assert decision.data == {"action": "reconcile", "why": "caller asked again"}
    assert (transition.from_status, transition.to_status) == (S.UNKNOWN, S.COMMITTED)
    assert transition.actor == "staff:ana"


@pytest.mark.parametrize("status", [S.COMMITTED, S.RUNNING, S.FAILED_RETRYABLE, S.ADMITTED])
async def test_reconcile_is_refused_unless_the_outcome_is_unknown(
    engine: AsyncEngine, status: S
) -> None:
    r = rig(engine)
    op_id = await seed_operation(engine, None, status)
    before = len(await trail(engine, op_id))
    with pytest.raises(ActionRefused, match="only an unknown outcome is reconciled"):
        await r.actions.reconcile(op_id, actor="staff:ana", why="just in case")
    assert r.provider.lookups == []
    assert len(await trail(engine, op_id)) == before  # a refusal records nothing


async def test_reconcile_is_refused_for_a_tool_no_lookup_can_settle(engine: AsyncEngine) -> None:
    r = rig(engine)
    op_id = await seed_operation(engine, None, S.UNKNOWN, tool="manual_tool")
    with pytest.raises(ActionRefused, match="no automatic lookup"):
        await r.actions.reconcile(op_id, actor="staff:ana", why="try")


async def test_retry_runs_the_next_attempt_now_only_where_the_tool_allows_automatic_retries(
    engine: AsyncEngine,
) -> None:
    r = rig(engine)
    retryable = await seed_operation(engine, None, S.FAILED_RETRYABLE)
    done = await r.actions.retry(retryable, actor="staff:bo", why="the restaurant is back")
    once = await seed_operation(engine, None, S.FAILED_RETRYABLE, tool="one_shot")
    with pytest.raises(ActionRefused, match="does not allow automatic retries"):
        await r.actions.retry(once, actor="staff:bo", why="again")
    spent = await seed_operation(engine, None, S.FAILED_RETRYABLE)
    async with engine.begin() as conn:
        await conn.execute(ops_t.update().where(ops_t.c.operation_id == spent).values(attempts=4))
    with pytest.raises(ActionRefused, match="no attempts left"):
        await r.actions.retry(spent, actor="staff:bo", why="again")
    with pytest.raises(ActionRefused, match="only a retryable failure"):
        await r.actions.retry(await seed_operation(engine, None, S.UNKNOWN), actor="s", why="x")
    record = await op(engine, retryable)
    events = await trail(engine, retryable)

    assert done.status == "failed_retryable"  # the worker's claim moves it on
    assert r.enqueued == [(retryable, None)]  # one job, now; none for the refused ones
    assert record.next_attempt_at is not None
    assert abs((record.next_attempt_at - datetime.now(UTC)).total_seconds()) < 60
    assert events[-1].reason == "retry now: the restaurant is back"
    assert events[-1].actor == "staff:bo"


async def test_an_outcome_checked_by_hand_settles_what_only_a_person_can(
    engine: AsyncEngine,
) -> None:
    r = rig(engine)
    manual = await seed_operation(engine, None, S.UNKNOWN, tool="manual_tool")
    done = await r.actions.record_outcome(
        manual, ManualOutcome.COMMITTED, actor="staff:cy", why="fax confirmed", reference="FX-9"
    )
    record = await op(engine, manual)
    last = (await trail(engine, manual))[-1]

    assert done.status == "committed"
    assert record.status is S.COMMITTED and record.provider_ref == "FX-9"
    assert (last.actor, last.to_status) == ("staff:cy", S.COMMITTED)
    assert last.reason == "checked by hand at the system of record: fax confirmed"
    assert last.data["reference"] == "FX-9"


async def test_a_stuck_operation_can_be_settled_by_hand_but_not_one_the_engine_is_settling(
    engine: AsyncEngine,
) -> None:
    r = rig(engine)
    fresh = await seed_operation(engine, None, S.UNKNOWN)
    with pytest.raises(ActionRefused, match="still settling"):
        await r.actions.record_outcome(fresh, ManualOutcome.FAILED_FINAL, actor="s:a", why="no")
    await age_operation(engine, fresh, 3600)  # an hour without any change: stuck
    done = await r.actions.record_outcome(
        fresh, ManualOutcome.FAILED_FINAL, actor="staff:di", why="restaurant has no such booking"
    )
    running = await seed_operation(engine, None, S.RUNNING)  # its attempt deadline has passed
    overdue = await r.actions.record_outcome(
        running, ManualOutcome.FAILED_FINAL, actor="staff:di", why="worker died"
    )
    alive = await seed_operation(engine, None, S.RUNNING)
    async with engine.begin() as conn:
        await conn.execute(
            ops_t.update()
            .where(ops_t.c.operation_id == alive)
            .values(deadline=datetime.now(UTC) + timedelta(minutes=5))
        )
    with pytest.raises(ActionRefused, match="still settling"):
        await r.actions.record_outcome(alive, ManualOutcome.COMMITTED, actor="s:a", why="yes")
    failed = await op(engine, fresh)

    assert done.status == overdue.status == "failed_final"
    # What a caller may be told; the staff's own words stay in the trail.
    assert failed.error == "it did not go through (checked by our staff)"
    assert "restaurant has no such booking" in (await trail(engine, fresh))[-1].reason


async def test_a_compensation_is_admitted_once_for_a_committed_operation(
    engine: AsyncEngine,
) -> None:
    r = rig(engine)
    booked = await seed_operation(engine, None, S.COMMITTED, reference="BK77")
    done = await r.actions.compensate(booked, actor="staff:ed", why="caller cancelled by email")
    with pytest.raises(ActionRefused, match="already started"):
        await r.actions.compensate(booked, actor="staff:ed", why="again")
    with pytest.raises(ActionRefused, match="declares no compensating tool"):
        await r.actions.compensate(
            await seed_operation(engine, None, S.COMMITTED, tool="one_shot"), actor="s", why="x"
        )
    with pytest.raises(ActionRefused, match="only a committed operation"):
        await r.actions.compensate(
            await seed_operation(engine, None, S.UNKNOWN), actor="s", why="x"
        )
    assert done.new_operation_id is not None
    comp = await op(engine, uuid.UUID(done.new_operation_id))
    original = await trail(engine, booked)

    assert comp.tool == "cancel_booking" and comp.args == {"booking_id": "BK77"}
    assert comp.compensates_operation_id == booked and comp.status is S.ADMITTED
    assert r.enqueued == [(comp.operation_id, None)]  # enqueued with its admission
    reasons = [e.reason for e in original if e.kind == "decision"]
    assert reasons[-2:] == [
        "start a compensation: caller cancelled by email",
        "compensation admitted: started by staff: caller cancelled by email",
    ]


async def test_resending_an_sms_is_refused_cleanly_while_no_sms_delivery_exists(
    engine: AsyncEngine,
) -> None:
    booked = await seed_operation(engine, None, S.COMMITTED)
    with pytest.raises(ActionRefused, match="no SMS delivery exists for this operation"):
        await rig(engine).actions.resend_sms(booked, actor="staff:fi", why="caller lost it")
    sms = FakeSms(SmsInfo("sms-1", "undelivered", "+15551230000", resendable=True))
    done = await rig(engine, sms=sms).actions.resend_sms(
        booked, actor="staff:fi", why="caller lost it"
    )
    refused = FakeSms(SmsInfo("sms-1", "delivered", None, resendable=False, why_not="delivered"))
    with pytest.raises(ActionRefused, match="delivered"):
        await rig(engine, sms=refused).actions.resend_sms(booked, actor="staff:fi", why="again")

    assert done.message == "SMS sms-2 is queued."
    assert sms.resent == [(booked, "staff:fi", "caller lost it")]
    assert refused.resent == []
    assert (await trail(engine, booked))[-1].reason == "resend the sms: caller lost it"


async def test_two_people_settling_one_operation_at_once_cannot_both_win(
    engine: AsyncEngine,
) -> None:
    r = rig(engine)
    op_id = await seed_operation(engine, None, S.UNKNOWN, tool="manual_tool")
    results = await asyncio.gather(
        r.actions.record_outcome(op_id, ManualOutcome.COMMITTED, actor="staff:a", why="yes"),
        r.actions.record_outcome(op_id, ManualOutcome.FAILED_FINAL, actor="staff:b", why="no"),
        return_exceptions=True,
    )
    async with engine.connect() as conn:
        finals = (
            await conn.execute(
                sa.text(
                    "SELECT count(*) FROM operation_events WHERE operation_id = :o "
                    "AND to_status IN ('committed', 'failed_final')"
                ),
                {"o": op_id},
            )
        ).scalar()

    assert sorted(type(x).__name__ for x in results) == ["ActionDone", "ActionRefused"]
    assert finals == 1


async def test_a_reason_is_required(engine: AsyncEngine) -> None:
    op_id = await seed_operation(engine, None, S.UNKNOWN)
    with pytest.raises(ActionRefused, match="say why"):
        await rig(engine).actions.reconcile(op_id, actor="staff:a", why="   ")


def test_availability_says_why_each_action_is_or_is_not_possible() -> None:
    now = datetime.now(UTC)
    reg = registry()
    base = dict(
        operation_id=uuid.uuid4(), tenant_id="t", idempotency_key="k", key_source="derived",
        call_id=None, caller=None, turn_id=None, tool="book_table", args={}, args_hash="h",
        resource=None, cancel_requested=False, attempts=1, deadline=None, expires_at=None,
        next_attempt_at=None, result=None, error=None, provider_ref="BK1",
        compensates_operation_id=None, readback=None, confirm_by=None, overflow=None,
        created_at=now, updated_at=now, committed_at=None, finished_at=None,
    )  # fmt: skip
    committed = ledger.OperationRecord(**{**base, "status": S.COMMITTED})  # type: ignore[arg-type]
    found = available_actions(
        committed,
        reg.get("book_table"),
        now=now,
        stuck_after_s=600,
        has_compensation=False,
        sms=None,
        can_reconcile=True,
    )
    assert {a: v.allowed for a, v in found.items()} == {
        Action.RECONCILE: False,
        Action.RETRY: False,
        Action.RECORD_OUTCOME: False,
        Action.COMPENSATE: True,
        Action.RESEND_SMS: False,
    }
    assert found[Action.COMPENSATE].why == "admit cancel_booking for BK1"
    assert found[Action.RESEND_SMS].why == "no SMS delivery exists for this operation"
