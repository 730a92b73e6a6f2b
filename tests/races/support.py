"""What the race scenarios share: a booking call script whose late result is said with the
engine's own words (`{note}`), the stack around the demo system of record, and the way a
scenario reads back what happened (durable state, effects, order, what was heard)."""

from __future__ import annotations

import re
import uuid
from typing import Any

from sqlalchemy.ext.asyncio import AsyncEngine

from telephony.sim.fake_caller import FakeTwilioCaller
from telephony.sim.scenario import Scenario
from tests.e2e_support import Stack, call_stack
from tests.sor_support import CALLBACK_SECRET
from tests.test_e2e_booking import (
    GREETING_MS,
    PREAMBLE_MS,
    READBACK_MS,
    REQUESTED,
    hear,
    heard_text,
    operations_of,
    trail,
)
from tests.test_e2e_delivery import BOOK, NOTE_MS, scenario
from tools.restaurant.sor import SystemOfRecord

__all__ = ["BOOK", "NOTE_MS", "REQUESTED"]


def booking(
    *after_requested: dict[str, Any], requested_ms: int = 1200, book: dict[str, Any] | None = None
) -> Scenario:
    """Greeting; "book it" -> readback; "yes" -> "requested, not confirmed yet"; (more); and
    the late result, said as the engine worded it (`{note}`): the delivery tests' script."""
    return scenario(*after_requested, book=book, requested_ms=requested_ms, name="race")


def stack_for(
    engine: AsyncEngine, db: str, sor: SystemOfRecord, scenario: Scenario, **kw: Any
) -> Any:
    """The service (in-process worker, sweeper) on the demo SOR, the simulator, fake Twilio."""
    return call_stack(
        engine,
        scenario,
        with_worker=True,
        database_url=db,
        sor_base_url=sor.url,
        sor_callback_secret=CALLBACK_SECRET,
        sweep_interval_s=0.5,
        **kw,
    )


async def ask_and_confirm(stack: Stack, caller: FakeTwilioCaller) -> str:
    """Greeting, "book it", the readback, "yes" (the confirmation is on its way). Call id."""
    await caller.dial()
    await hear(caller, GREETING_MS)
    before = caller.heard_ms
    await caller.play_speech(700)
    await hear(caller, before + PREAMBLE_MS + READBACK_MS)
    await caller.play_speech(500)
    return await stack.call_id(caller)


_REFERENCE = re.compile(r"\b(BK|AP)-?[A-Z0-9]{4,}\b")
_DATE = re.compile(r"\b(\d{4}-\d{2}-\d{2}|\w+day \d{2} \w+ \d{4})\b")
# How the bridge asks the model to say an update; the update itself is what the caller hears.
_ASK = re.compile(r"^An update arrived for the caller\. Tell them briefly, in your own words: ")


def steady(text: str) -> str:
    """`text` without what differs run to run (references, dates), for the printed line."""
    return _DATE.sub("<date>", _REFERENCE.sub(r"\1-<ref>", _ASK.sub("", text)))


def cut(text: str, whole: str) -> str:
    """A cut utterance, printed the same however much of it was heard."""
    assert whole.startswith(text) and text != whole, (text, whole)
    return f"{whole[:12]}... (cut)"


async def heard(engine: AsyncEngine, call_id: str) -> list[str]:
    """What the agent said and the caller heard, in order, steadied for printing."""
    return [steady(t) for t in await heard_text(engine, call_id)]


def quoted(texts: list[str]) -> str:
    return " / ".join(f'"{t}"' for t in texts)


async def statuses(engine: AsyncEngine, call_id: str) -> list[str]:
    return [o["status"] for o in await operations_of(engine, call_id)]


async def to_statuses(engine: AsyncEngine, operation_id: uuid.UUID) -> list[str]:
    return [e["to_status"] for e in await trail(engine, operation_id) if e["kind"] == "transition"]
