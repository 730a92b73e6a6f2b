"""crash_between_committed_and_ack: the `voice-agent serve` process that runs the call is
killed (SIGKILL, its whole process group) after the booking is COMMITTED and before the caller
heard it: the caller was talking, so the result was held for the end of their turn. After a
restart on the same database the call is known to be over, and the outcome is told exactly
once, by SMS; nothing is booked again."""

from __future__ import annotations

import asyncio
import contextlib

import pytest
from sqlalchemy.ext.asyncio import AsyncEngine

from telephony.sim.fake_caller import FakeTwilioCaller
from telephony.sim.fake_twilio_api import FakeTwilioApi
from telephony.sim.simulator import RealtimeSimulator
from tests.domains import RESTAURANT
from tests.e2e_support import call_row
from tests.race_report import Race
from tests.races.support import quoted, steady, to_statuses
from tests.server_proc import ServerProcess
from tests.test_delivery_crash import WAIT_S, book_and_confirm, call_id_of, server_env
from tests.test_e2e_booking import (
    booking_scenario,
    delivery_trail,
    hear,
    heard_text,
    wait_for_delivery,
    wait_for_operation,
)
from tools.restaurant.sor import Faults, SystemOfRecord

pytestmark = pytest.mark.races


async def test_crash_between_committed_and_ack(
    engine: AsyncEngine, clean_db: str, sor: SystemOfRecord, race: Race
) -> None:
    sor.set_faults(Faults(hang=1))  # the booking waits at the restaurant until released
    async with (
        RealtimeSimulator(booking_scenario(RESTAURANT, requested_ms=800)) as sim,
        FakeTwilioApi(sms_step_delay_s=0.01) as api,
    ):
        first = ServerProcess(server_env(clean_db, sim, api, sor.url))
        second: ServerProcess | None = None
        talking: asyncio.Task[float] | None = None
        try:
            await first.start()
            caller = FakeTwilioCaller(first.url)
            api.attach(caller)  # Twilio knows the call; its status callback never comes
            await book_and_confirm(caller)
            call_id = await call_id_of(engine, caller)
            op = await wait_for_operation(engine, call_id, "running", within=WAIT_S)
            await hear(caller, caller.heard_ms + 800)  # "requested, not confirmed yet"
            # The caller talks on; the restaurant answers meanwhile: the result is held.
            talking = asyncio.create_task(caller.play_speech(20_000))
            await sim.sessions[0].wait_for_sent("input_audio_buffer.speech_started", within=10)
            sor.release()
            committed = await wait_for_operation(engine, call_id, "committed", within=WAIT_S)
            # Offered to the call and held there until the caller's turn ends.
            held = await wait_for_delivery(engine, op["operation_id"], "offered", within=WAIT_S)
            before_kill = held["state"]
            await first.kill()  # SIGKILL: the call's process is gone, nothing was said
            await caller.wait_closed(10)
            stranded = await call_row(engine, caller.call_sid)

            second = ServerProcess(server_env(clean_db, sim, api, sor.url))
            await second.start()
            delivery = await wait_for_delivery(engine, op["operation_id"], "texted", within=WAIT_S)
            # Nothing more comes: the sweeps run every 0.3 s; give them several rounds.
            await asyncio.sleep(2)
            messages = api.messages_to(caller.from_number)
            told = await delivery_trail(engine, op["operation_id"])
            moved = await to_statuses(engine, op["operation_id"])
            ended = await call_row(engine, caller.call_sid)
            effects = await sor.side_effects()
            spoken = await heard_text(engine, call_id)
        finally:
            if talking is not None:
                talking.cancel()
                with contextlib.suppress(BaseException):
                    await talking
            await first.stop()
            if second is not None:
                await second.stop()

    assert effects.bookings_inserted == 1
    assert moved == ["awaiting_confirmation", "admitted", "running", "committed"]
    # Killed after the commit, before anything about it was heard.
    assert before_kill == "offered" and held["channel"] == "call"
    assert stranded is not None and stranded["status"] == "in_progress"
    assert not [t for t in spoken if "confirmed" in t and "not confirmed" not in t]
    # After the restart: the call is over, told exactly once, by SMS.
    assert ended is not None and ended["status"] == "completed"
    assert ended["end_reason"].startswith("its process stopped")
    assert delivery["channel"] == "sms"
    states = [e["to_state"] for e in told if e["kind"] == "transition"]
    assert states.count("texted") == 1 and "heard" not in states
    assert len(messages) == 1 and f"Ref {committed['provider_ref']}." in messages[0].body
    race.report(
        state=f"committed, delivery {before_kill} at the kill > texted after restart",
        effects=f"{effects.bookings_inserted} booking, {len(messages)} sms",
        order="committed < held (caller talking) < SIGKILL < restart < call ended < texted once",
        heard=quoted([steady(messages[0].body)]) + " (sms; nothing in the call)",
    )
