"""The service wired to the SIP interconnect stand-in (OpenAI's side of an incoming SIP call)."""

from __future__ import annotations

import base64
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from sqlalchemy.ext.asyncio import AsyncEngine

from telephony.sim.fake_twilio_api import FakeTwilioApi
from telephony.sim.interconnect import SipInterconnect
from telephony.sim.scenario import Scenario
from tests.e2e_support import Service, call_row, running_service, wait_until

SECRET = "whsec_" + base64.b64encode(b"interconnect-test-secret-32bytes").decode()


@dataclass
class Interconnect:
    sim: SipInterconnect
    service: Service
    engine: AsyncEngine
    twilio: FakeTwilioApi  # SMS follow-ups go here

    async def row(self, call_id: str) -> dict[str, Any] | None:
        return await call_row(self.engine, call_id)

    async def wait_row(self, call_id: str, status: str, within: float = 15.0) -> dict[str, Any]:
        found: list[dict[str, Any]] = []

        async def reached() -> bool:
            row = await self.row(call_id)
            if row is not None:
                found[:] = [row]
            return row is not None and row["status"] == status

        await wait_until(reached, within, f"call {status}")
        return found[0]

    async def wait_over(self, call_id: str, within: float = 15.0) -> None:
        """Until the call is over in the service (row final, events flushed)."""
        registry = self.service.runtime.registry
        await wait_until(lambda: registry.get(call_id) is None, within, "call detached")
        await wait_until(
            lambda: self.service.runtime.openai_sip.live_calls() == 0, within, "call task done"
        )
        await self.service.runtime.events.flush()


@asynccontextmanager
async def interconnect(
    engine: AsyncEngine,
    scenario: Scenario | None = None,
    *,
    realtime_factor: float = 0.25,
    auto_caller: bool = False,
    **overrides: Any,
) -> AsyncIterator[Interconnect]:
    """The interconnect stand-in and the service, pointed at each other."""
    async with (
        SipInterconnect(
            scenario,
            realtime_factor=realtime_factor,
            auto_caller=auto_caller,
            webhook_secret=SECRET,
        ) as sim,
        FakeTwilioApi() as twilio,
    ):
        overrides.setdefault("openai_webhook_secret", SECRET)
        async with running_service(
            engine, openai_base_url=sim.base_url, twilio_api_base_url=twilio.base_url, **overrides
        ) as service:
            sim.webhook_url = service.url + "/openai/webhook"
            yield Interconnect(sim, service, engine, twilio)
