"""retry_with_and_without_provider_idempotency: the same transient failures on a restaurant
that honours idempotency keys and on one declared not to. With keys, the failed attempt is
retried and books once. Without, nothing is sent twice: a failure the restaurant says applied
nothing fails for good (the caller hears nothing changed), and a lost answer is reconciled by
asking the restaurant about the key, never by sending again."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from sqlalchemy.ext.asyncio import AsyncEngine

from telephony.sim.fake_caller import FakeTwilioCaller
from tests.domains import restaurant_catalog
from tests.e2e_support import Stack, wait_until
from tests.race_report import Race
from tests.races.support import ask_and_confirm, booking, heard, quoted, stack_for
from tests.test_e2e_booking import WAIT_S, hear, operations_of, trail, wait_for_delivery
from tests.test_e2e_delivery import kinds
from tools.catalog import Catalog
from tools.registry import RetryPolicy
from tools.restaurant.sor import Faults, SystemOfRecord

pytestmark = pytest.mark.races

SETTLED = ("committed", "failed_final")


def without_keys(catalog: Catalog) -> Catalog:
    """The same restaurant, its booking declared not to honour idempotency keys (and so, as
    the catalog check demands, with no automatic retry)."""
    once = RetryPolicy(max_attempts=1)
    tools = [
        dataclasses.replace(t, provider_idempotent=False, retry=once)
        if t.name == "book_table"
        else t
        for t in catalog.tools
    ]
    return Catalog(
        tools, catalog.providers, name=catalog.name, instructions=catalog.instructions
    ).checked()


async def test_retry_with_and_without_provider_idempotency(
    engine: AsyncEngine, clean_db: str, sor: SystemOfRecord, race: Race
) -> None:
    # With keys: the first attempt is refused before commit (a 500 that applied nothing).
    keyed = restaurant_catalog(sor.url, deadline_s=1.0)
    try:
        sor.set_faults(Faults(fail_before_commit=1))
        async with stack_for(engine, clean_db, sor, booking(), catalog=keyed) as stack:
            retried = await settle(stack, stack.caller(from_number="+15550000001"))
        with_keys = (await sor.side_effects()).bookings_inserted
    finally:
        await keyed.aclose()

    # Without keys: the same refusal, then (another caller) an answer lost after the booking.
    unkeyed = without_keys(restaurant_catalog(sor.url, deadline_s=1.0))
    try:
        async with stack_for(engine, clean_db, sor, booking(), catalog=unkeyed) as stack:
            sor.set_faults(Faults(fail_before_commit=1))
            refused = await settle(stack, stack.caller(from_number="+15550000002"))
            sor.set_faults(Faults(lose_response=1))
            lost = await settle(stack, stack.caller(from_number="+15550000003"))
            sor.release()  # the late answer now arrives, to no one
        without = (await sor.side_effects()).bookings_inserted - with_keys
    finally:
        await unkeyed.aclose()

    # With keys: retried once, one booking, told once.
    assert retried["moves"] == [
        "awaiting_confirmation",
        "admitted",
        "running",
        "failed_retryable",
        "running",
        "committed",
    ]
    assert retried["attempts"] == 2 and with_keys == 1
    assert retried["announced"] == 1
    assert "Done and confirmed by the restaurant" in retried["heard"][-1]
    # Without keys, refused before commit: one attempt, failed for good, nothing booked.
    assert refused["moves"][-2:] == ["running", "failed_final"] and refused["attempts"] == 1
    assert "no automatic retry" in refused["reason"]
    assert refused["announced"] == 1
    assert "could not be done" in refused["heard"][-1]
    assert all("confirmed by" not in t for t in refused["heard"])
    # Without keys, answer lost: unknown, reconciled on the key, never sent again.
    assert lost["moves"][-3:] == ["running", "unknown", "committed"] and lost["attempts"] == 1
    assert lost["actor"] == "reconciler"
    assert lost["announced"] == 1
    assert "Done and confirmed by the restaurant" in lost["heard"][-1]
    assert without == 1  # the lost answer's booking; the refused one applied nothing
    race.report(
        state=(
            "keys: failed_retryable > committed; no keys: failed_final (refused), "
            "unknown > committed (reconciled)"
        ),
        effects=(
            f"keys {with_keys} booking in {retried['attempts']} attempts; no keys "
            f"{without} booking, {refused['attempts']} attempt per call"
        ),
        order="refused < retried after backoff (keys) | never re-sent, lookup by key (no keys)",
        heard=(
            f"keys {quoted(retried['heard'][-1:])}; no keys, refused "
            f"{quoted(refused['heard'][-1:])}; no keys, lost {quoted(lost['heard'][-1:])}"
        ),
    )


async def settle(stack: Stack, caller: FakeTwilioCaller) -> dict[str, Any]:
    """One booking call to its outcome, heard, then hung up: what the ledger and caller show."""
    engine = stack.engine
    call_id = await ask_and_confirm(stack, caller)

    async def settled() -> bool:
        ops = await operations_of(engine, call_id)
        return bool(ops) and ops[0]["status"] in SETTLED

    await wait_until(settled, WAIT_S, "settled")
    op = (await operations_of(engine, call_id))[0]
    await wait_for_delivery(engine, op["operation_id"], "heard")
    await hear(caller, caller.heard_ms)
    await caller.hangup()
    events = await stack.events(caller)
    rows = [e for e in await trail(engine, op["operation_id"]) if e["kind"] == "transition"]
    return {
        "moves": [e["to_status"] for e in rows],
        "reason": rows[-1]["reason"] or "",
        "actor": rows[-1]["actor"],
        "attempts": op["attempts"],
        "announced": kinds(events).count("result_announced"),
        "heard": await heard(engine, call_id),
    }
