"""`/metrics` over a real booking call: the engine's measures and the audio path's, as
Prometheus reads them (prometheus-client's parser), counted by the process that did the work."""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
import pytest
from sqlalchemy.ext.asyncio import AsyncEngine

from tests.domains import RESTAURANT, Backend
from tests.e2e_support import wait_until
from tests.metrics_support import samples
from tests.test_e2e_booking import (
    ask_to_book_and_confirm,
    booking_scenario,
    booking_stack,
    wait_for_delivery,
    wait_for_operation,
)

ENGINE_NAMES = (
    "voice_agent_tool_admission_seconds",
    "voice_agent_operation_commit_seconds",
    "voice_agent_commit_to_heard_seconds",
    "voice_agent_operations_unknown",
    "voice_agent_deliveries_waiting",
    "voice_agent_delivery_oldest_waiting_seconds",
    "voice_agent_duplicates_suppressed_total",
    "voice_agent_tool_timeouts_total",
    "voice_agent_tool_retries_total",
    "voice_agent_late_results_after_turn_change_total",
    "voice_agent_cancellations_requested_total",
    "voice_agent_cancellations_confirmed_total",
    "voice_agent_compensations_total",
    "voice_agent_handoffs_with_pending_operations_total",
    "voice_agent_reconciliation_failures_total",
    "voice_agent_barge_in_clear_seconds",
    "voice_agent_realtime_connect_seconds",
    "voice_agent_rtp_jitter_seconds",
    "voice_agent_rtp_packet_loss_ratio",
    "voice_agent_live_calls_by_leg",
)


@pytest.fixture
async def backend(clean_db: str) -> AsyncIterator[Backend]:
    async with RESTAURANT.start(clean_db) as running:
        yield running


async def scrape(url: str) -> tuple[str, dict[str, float]]:
    async with httpx.AsyncClient(base_url=url) as http:
        response = await http.get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain; version=0.0.4")
    return response.text, samples(response.text)


def count(found: dict[str, float], name: str, **labels: str) -> float:
    key = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    return found.get(f"{name}{{{key}}}" if key else name, 0.0)


async def test_a_booking_call_is_measured_from_admission_to_the_callers_ear(
    engine: AsyncEngine, clean_db: str, backend: Backend
) -> None:
    scenario = booking_scenario(RESTAURANT, duplicate=True)
    async with booking_stack(engine, clean_db, backend, scenario) as stack:
        url = stack.service.url
        _, before = await scrape(url)
        caller = stack.caller()
        call_id = await ask_to_book_and_confirm(stack, caller)
        _, during = await scrape(url)
        op = await wait_for_operation(engine, call_id, "committed")
        await wait_for_delivery(engine, op["operation_id"], "heard")
        await caller.hangup()
        registry = stack.service.runtime.registry
        await wait_until(lambda: registry.live_count() == 0, 10, "the call over here")
        text, after = await scrape(url)

    def grew(name: str, **labels: str) -> float:
        return count(after, name, **labels) - count(before, name, **labels)

    # Every name the observability issue lists is exported, with its HELP and TYPE.
    for name in ENGINE_NAMES:
        typed = (f"# TYPE {name} ", f"# TYPE {name.removesuffix('_total')} ")
        assert any(t in text for t in typed), name
    assert count(during, "voice_agent_live_calls_by_leg", leg="twilio") == 1
    # The reads and the booking went through admission; the model's repeated call and
    # repeated confirmation were suppressed as duplicates, not admitted twice.
    assert grew("voice_agent_tool_admission_seconds_count", tool_class="mutation") >= 2
    assert grew("voice_agent_tool_admission_seconds_count", tool_class="control") >= 2
    assert grew("voice_agent_duplicates_suppressed_total", tool_class="mutation") == 1
    assert grew("voice_agent_duplicates_suppressed_total", tool_class="control") == 1
    # One operation committed and heard: one observation each, of a plausible length.
    assert grew("voice_agent_operation_commit_seconds_count", tool_class="mutation") == 1
    committed_s = grew("voice_agent_operation_commit_seconds_sum", tool_class="mutation")
    assert 0 < committed_s < 30
    assert grew("voice_agent_commit_to_heard_seconds_count") == 1
    assert grew("voice_agent_realtime_connect_seconds_count") == 1
    assert count(after, "voice_agent_live_calls_by_leg", leg="twilio") == 0
    print(
        f"admission, commit ({committed_s:.2f} s), commit-to-heard "
        f"({grew('voice_agent_commit_to_heard_seconds_sum'):.2f} s), realtime connect measured"
    )
