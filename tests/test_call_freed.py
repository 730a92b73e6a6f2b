"""An ended call is freed by reference counting, with no collection needed.

Left in reference cycles, an ended call's objects (bridge, legs, model connection, tasks,
the HTTP and WebSocket protocols that carried it) wait for the collector's full pass, which at
200 live calls stops every call on the process for 20-50 ms (README, "Garbage collection and
the event loop"). Here each kind of call runs with the collector off and set to keep what it
finds (`gc.DEBUG_SAVEALL`); once the call has ended, one collection must find none of our
objects unreachable, and the call's bridge must be gone already. Nor may the call leave an
async generator of ours unfinished for the event loop's finalizer hook to close (each one a
wake-up of the loop from its own thread-safe handle, and a task).
"""

from __future__ import annotations

import asyncio
import gc
import sys
import types
import weakref
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from sqlalchemy.ext.asyncio import AsyncEngine

from app.access.staff import Role
from telephony.sim.fake_caller import CallerState
from telephony.sim.scenario import Scenario
from telephony.sim.simulator import synthesize_speech
from tests.console_support import bearer, seed_operation
from tests.domains import RESTAURANT, RestaurantBackend
from tests.e2e_support import call_stack, wait_until
from tests.handoff_support import AGENTS, hand_off_while_booking, handoff_stack
from tests.openai_sip_support import interconnect
from tests.sip_support import Uac, sdp_offer
from tests.sipp_support import sip_stack
from tests.test_e2e_booking import (
    ask_to_book_and_confirm,
    booking_scenario,
    booking_stack,
    heard_text,
    wait_for_delivery,
    wait_for_operation,
    wait_spoken,
)
from tests.test_e2e_call import hear_greeting, scenario
from tests.test_openai_sip import LONG_GREETING, chat
from tests.test_outbound import CALLEE, PURPOSE, outbound_stack, place
from tests.test_sip_barge_in import SILENCE, _response, _rtp_sender, _socket
from tests.test_transfer import DESK, TARGETS, ask_for_a_person, transfer_scenario
from tests.test_transfer_warm import JOIN, the_person, warm_scenario
from tests.test_transfer_warm import ask_for_a_person as warm_ask
from tools.states import OperationStatus as S

ROOT = Path(__file__).resolve().parent.parent
OURS = tuple(str(ROOT / part) for part in ("app", "telephony", "tools"))
SIMULATED = str(ROOT / "telephony" / "sim")


def _source(obj: Any) -> str:
    """The file that defines what `obj` is (for functions, methods, coroutines and frames:
    their code; else its type's module)."""
    if isinstance(obj, types.MethodType):
        obj = obj.__func__
    if isinstance(obj, types.FunctionType):
        return obj.__code__.co_filename
    if isinstance(obj, types.CoroutineType):
        return obj.cr_code.co_filename
    if isinstance(obj, types.FrameType):
        return obj.f_code.co_filename
    module = __import__("sys").modules.get(type(obj).__module__)
    return getattr(module, "__file__", None) or ""


def ours(obj: Any) -> bool:
    """Something of the service's (not of the test's callers and simulators)."""
    source = _source(obj)
    return source.startswith(OURS) and not source.startswith(SIMULATED)


def describe(obj: Any) -> str:
    if isinstance(obj, types.MethodType):
        return f"method {obj.__func__.__qualname__}"
    if isinstance(obj, types.FunctionType | types.CoroutineType):
        return f"{type(obj).__name__} {obj.__qualname__}"
    if isinstance(obj, types.FrameType):
        return f"frame {obj.f_code.co_qualname}"
    return f"{type(obj).__module__}.{type(obj).__qualname__}"


@contextmanager
def unreachable() -> Iterator[Counter[str]]:
    """Collector off for the block; at its end, one collection: what it found of ours. Also
    counted: each async generator of ours started in the block and dropped unfinished, so
    the event loop's finalizer hook had to close it (a thread-safe wake-up of the loop and
    a task of its own, per generator, where closing it where it was left costs neither)."""
    gc.collect()
    debug = gc.get_debug()
    gc.disable()
    gc.set_debug(debug | gc.DEBUG_SAVEALL)
    found: Counter[str] = Counter()
    firstiter, finalizer = sys.get_asyncgen_hooks()

    def finalize(agen: Any) -> None:
        source = agen.ag_code.co_filename
        if source.startswith(OURS) and not source.startswith(SIMULATED):
            found[f"async generator {agen.__qualname__} left to the loop to close"] += 1
        if finalizer is not None:
            finalizer(agen)

    sys.set_asyncgen_hooks(firstiter=firstiter, finalizer=finalize)
    try:
        yield found
        gc.collect()
        found.update(describe(o) for o in gc.garbage if ours(o))
    finally:
        sys.set_asyncgen_hooks(firstiter=firstiter, finalizer=finalizer)
        gc.garbage.clear()
        gc.set_debug(debug)
        gc.enable()


def the_bridge(stack: Any) -> weakref.ref[Any]:
    """The one live call's bridge (of a `Stack` or an `Interconnect`), weakly."""
    (entry,) = stack.service.runtime.registry.live_entries()
    assert entry.live is not None
    return weakref.ref(entry.live)


async def settled(stack: Any) -> None:
    """No call live, and what follows an end (the row, the recording) done."""
    await wait_until(lambda: stack.service.runtime.registry.live_count() == 0, 15, "no call")
    await asyncio.sleep(0.5)


async def test_a_call_transferred_to_a_person_leaves_nothing_in_cycles(
    engine: AsyncEngine,
) -> None:
    async with call_stack(engine, transfer_scenario(), transfer_targets=TARGETS) as stack:
        with unreachable() as found:
            caller, _ = await ask_for_a_person(stack)
            bridge = the_bridge(stack)
            await caller.wait_for(lambda c: c.state is CallerState.ENDED, 30)
            await settled(stack)
        dials = list(stack.api.dials)
    assert dials == [(caller.call_sid, DESK, "answered")]
    assert not found, found
    assert bridge() is None


async def test_a_busy_transfer_back_to_the_agent_leaves_nothing_of_either_stream(
    engine: AsyncEngine,
) -> None:
    async with call_stack(engine, transfer_scenario(), transfer_targets=TARGETS) as stack:
        stack.api.dial_outcomes[DESK] = "busy"
        with unreachable() as found:
            caller, _ = await ask_for_a_person(stack)
            first = the_bridge(stack)
            await caller.wait_for(lambda c: len(c.stream_sids) == 2, 30)
            await wait_until(lambda: len(stack.sim.sessions) == 2, 30, "a new session")
            await wait_until(
                lambda: (
                    [e.live for e in stack.service.runtime.registry.live_entries()]
                    not in ([], [None], [first()])
                ),
                30,
                "the second stream's bridge",
            )
            second = the_bridge(stack)
            await asyncio.sleep(1.0)
            await caller.hangup()
            await settled(stack)
    assert not found, found
    assert first() is None and second() is None


async def test_a_warm_transfer_joined_to_the_person_leaves_nothing_in_cycles(
    engine: AsyncEngine,
) -> None:
    async with call_stack(engine, warm_scenario(JOIN), transfer_targets=TARGETS) as stack:
        with unreachable() as found:
            caller, _ = await warm_ask(stack, open_operation=True)
            bridge = the_bridge(stack)
            person = await the_person(stack)
            await caller.wait_for(lambda c: c.state is CallerState.IN_CONFERENCE, 30)
            await stack.api.hang_up(person.sid)  # the person hangs up: the conference ends
            await caller.wait_for(lambda c: c.state is CallerState.ENDED, 30)
            await settled(stack)
    assert not found, found
    assert bridge() is None


async def test_a_handoff_to_another_agent_leaves_nothing_in_cycles(
    engine: AsyncEngine, clean_db: str
) -> None:
    async with RESTAURANT.start(clean_db) as backend:
        assert isinstance(backend, RestaurantBackend)
        async with handoff_stack(engine, clean_db, backend.sor, AGENTS) as stack:
            with unreachable() as found:
                caller, call_id = await hand_off_while_booking(stack, backend)
                bridge = the_bridge(stack)
                backend.release()
                op = await wait_for_operation(engine, call_id, "committed")
                await wait_for_delivery(engine, op["operation_id"], "heard")
                await caller.hangup()
                await settled(stack)
            kinds = [e["kind"] for e in await stack.events(caller)]
    assert "agent_handoff" in kinds
    assert not found, found
    assert bridge() is None


async def test_an_outbound_call_answered_by_a_person_leaves_nothing_in_cycles(
    engine: AsyncEngine, clean_db: str
) -> None:
    booking = await seed_operation(engine, None, S.COMMITTED, reference="BK4242")
    async with outbound_stack(engine, clean_db) as stack:
        headers = await bearer(engine, Role.OPERATOR)
        with unreachable() as found:
            body = {"to": CALLEE, "purpose": PURPOSE, "operation_id": str(booking)}
            answer = await place(stack, body, headers)
            assert answer.status_code == 202, answer.text
            call_id = answer.json()["call_id"]

            async def first_words() -> bool:
                return bool(await heard_text(engine, call_id))

            await wait_until(first_words, 20, "the agent's first words")
            bridge = the_bridge(stack)
            [placed] = stack.api.created_calls(CALLEE)
            await stack.api.outbound_callers[placed.sid].hangup()
            await settled(stack)
    assert not found, found
    assert bridge() is None


async def test_a_twilio_call_with_barge_in_ends_with_nothing_left_in_cycles(
    engine: AsyncEngine,
) -> None:
    async with call_stack(engine, scenario(reply_ms=3000)) as stack:
        with unreachable() as found:
            caller = stack.caller()
            await caller.dial()
            await hear_greeting(caller)
            await caller.play_speech(600)
            await caller.wait_for(lambda c: c.media_received_ms >= 1000 + 600, 10)
            await caller.play_speech(600)  # over the reply: a barge-in
            await asyncio.sleep(0.3)
            bridge = the_bridge(stack)
            await caller.hangup()
            await settled(stack)
        events = [e["kind"] for e in await stack.events(caller)]
    assert "barge_in" in events, events
    assert not found, found
    assert bridge() is None


async def test_a_booking_call_with_its_late_result_heard_leaves_nothing_in_cycles(
    engine: AsyncEngine, clean_db: str
) -> None:
    domain = RESTAURANT
    async with domain.start(clean_db) as backend:
        backend.set_faults(latency_s=0.3)
        await _booking(engine, clean_db, backend, domain)


async def _booking(engine: AsyncEngine, clean_db: str, backend: Any, domain: Any) -> None:
    async with booking_stack(engine, clean_db, backend, booking_scenario(domain)) as stack:
        with unreachable() as found:
            caller = stack.caller()
            call_id = await ask_to_book_and_confirm(stack, caller)
            bridge = the_bridge(stack)
            op = await wait_for_operation(engine, call_id, "committed")
            await wait_for_delivery(engine, op["operation_id"], "heard")
            await wait_spoken(engine, call_id, domain.confirmed_text)
            await caller.hangup()
            await settled(stack)
    assert not found, found
    assert bridge() is None


async def _sip_call_cut_in(
    stack: Any,
    opened: Callable[[], Awaitable[Any]],
    stopped: Callable[[Any], Awaitable[None]],
) -> weakref.ref[Any]:
    """A call on our SIP user agent over RTP: the caller hears 600 ms of the greeting, talks
    over it (`stopped(session)` waits for the model to stop), hangs up; the bridge, weakly."""
    loop = asyncio.get_running_loop()
    sip_t, sip_in, my_sip = await _socket(loop)
    rtp_t, rtp_in, my_rtp = await _socket(loop)
    uac = Uac(port=my_sip)
    server = ("127.0.0.1", stack.service.runtime.sip.port)
    try:
        sip_t.sendto(uac.invite(sdp_offer(port=my_rtp, formats="0 101")), server)
        ok = await _response(sip_in, 200)
        uac.learn(ok)
        sip_t.sendto(uac.ack(), server)
        session = await opened()
        send = _rtp_sender(rtp_t, ok)
        while sum(data[12:] != SILENCE for _, data in rtp_in.got) < 30:
            await send(SILENCE)
        speech = synthesize_speech(1000, 3, "pcmu")
        for offset in range(0, len(speech), 160):  # over the greeting: a barge-in
            await send(speech[offset : offset + 160])
        await stopped(session)
        bridge = the_bridge(stack)
        sip_t.sendto(uac.bye(), server)
        await _response(sip_in, 200, start=len(sip_in.got))
    finally:
        sip_t.close()
        rtp_t.close()
    return bridge


async def test_a_call_on_our_sip_user_agent_with_barge_in_leaves_nothing_in_cycles(
    engine: AsyncEngine,
) -> None:
    async with sip_stack(engine) as stack:

        async def truncated(session: Any) -> None:
            await session.wait_for_received("conversation.item.truncate", within=10)

        with unreachable() as found:
            bridge = await _sip_call_cut_in(stack, lambda: stack.sim.wait_for_session(0), truncated)
            await settled(stack)
    assert not found, found
    assert bridge() is None


async def test_a_gpt_live_call_on_our_sip_user_agent_with_barge_in_leaves_nothing_in_cycles(
    engine: AsyncEngine,
) -> None:
    async with sip_stack(engine, _long_live_greeting(), model_api="live") as stack:

        async def interrupted(live: Any) -> None:
            await wait_until(lambda: live.interruptions == 1, 10, "the model stopped")

        with unreachable() as found:
            bridge = await _sip_call_cut_in(stack, stack.sim.wait_for_live_session, interrupted)
            await settled(stack)
    assert not found, found
    assert bridge() is None


async def test_a_call_on_openais_sip_interconnect_with_barge_in_leaves_nothing_in_cycles(
    engine: AsyncEngine,
) -> None:
    async with interconnect(engine, chat(LONG_GREETING)) as ic:
        with unreachable() as found:
            call = await ic.sim.place_call()
            session = await ic.sim.wait_for_session(call.call_id)
            await session.wait_for_sent("output_audio_buffer.started", within=10)
            await asyncio.sleep(0.15)
            await session.caller_says(speech_ms=400)  # over the greeting: a barge-in
            await session.wait_for_received("output_audio_buffer.clear")
            bridge = the_bridge(ic)
            await ic.sim.remote_hangup(call.call_id)
            await ic.wait_over(call.call_id)
            await settled(ic)
    assert not found, found
    assert bridge() is None


def _long_live_greeting() -> Scenario:
    return Scenario.model_validate(
        {
            "greeting": {"text": "Welcome to a long list of tonight's specials.", "audio_ms": 8000},
            "steps": [{"caller_transcript": "Just a table, please.", "reply": "Sure."}],
        }
    )


async def test_a_twilio_call_on_gpt_live_with_barge_in_leaves_nothing_in_cycles(
    engine: AsyncEngine,
) -> None:
    async with call_stack(engine, _long_live_greeting(), model_api="live") as stack:
        with unreachable() as found:
            caller = stack.caller()
            await caller.dial()
            await caller.wait_for(lambda c: c.heard_ms >= 1000, 10)
            await caller.play_speech(600)  # the model stops talking over the caller
            await caller.wait_for(lambda c: len(c.clears) == 1, 10)
            bridge = the_bridge(stack)
            await caller.hangup()
            await settled(stack)
    assert not found, found
    assert bridge() is None


async def test_a_gpt_live_call_on_openais_sip_interconnect_with_barge_in_leaves_nothing_in_cycles(
    engine: AsyncEngine,
) -> None:
    async with interconnect(engine, _long_live_greeting(), model_api="live") as ic:
        with unreachable() as found:
            call = await ic.sim.place_call(live=True)
            session = await ic.sim.wait_for_session(call.call_id)
            await session.wait_for_sent("session.output_transcript.delta", within=10)
            await asyncio.sleep(0.3)
            await session.caller_says(speech_ms=400)  # over the greeting: the model stops
            await session.press("5")
            bridge = the_bridge(ic)
            await ic.sim.remote_hangup(call.call_id)
            await ic.wait_over(call.session_id)
            await settled(ic)
    assert session.interruptions == 1
    assert not found, found
    assert bridge() is None
