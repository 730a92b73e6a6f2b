"""Integrator webhooks over real sockets: every operation status change is written to an
outbox with the change, POSTed signed the Standard Webhooks way (checked with the openai
SDK's own verifier), retried with backoff, logged, and sent once per attempt."""

from __future__ import annotations

import asyncio
import json
import random
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
import sqlalchemy as sa
from openai import OpenAI
from sqlalchemy.ext.asyncio import AsyncEngine
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from telephony.sim.fake_twilio_api import InProcessServer
from tests.delivery_support import admitted, finish, make_call
from tests.e2e_support import CONSOLE, running_service
from tools import webhooks
from tools.states import OperationStatus

S = OperationStatus


@dataclass
class Receiver:
    """An integrator's endpoint: answers with the scripted statuses, records each POST."""

    statuses: list[int] = field(default_factory=list)
    received: list[tuple[dict[str, str], bytes]] = field(default_factory=list)
    queries: list[str] = field(default_factory=list)
    gate: asyncio.Event | None = None

    def app(self) -> Starlette:
        async def hook(request: Request) -> Response:
            body = await request.body()
            self.received.append(({k.lower(): v for k, v in request.headers.items()}, body))
            self.queries.append(request.url.query)
            if self.gate is not None:
                await self.gate.wait()
            status = self.statuses.pop(0) if self.statuses else 200
            return Response(status_code=status)

        return Starlette(routes=[Route("/hooks/ops", hook, methods=["POST"])])


@pytest.fixture
async def receiver() -> AsyncIterator[tuple[Receiver, str]]:
    rx = Receiver()
    server = InProcessServer(rx.app())
    base = await server.start()
    try:
        yield rx, base + "/hooks/ops"
    finally:
        if rx.gate is not None:
            rx.gate.set()
        await server.stop()


async def _subscribe(engine: AsyncEngine, url: str) -> webhooks.Subscription:
    async with engine.begin() as conn:
        return await webhooks.subscribe(conn, tenant_id="default", url=url)


async def _outbox(engine: AsyncEngine) -> list[Any]:
    async with engine.connect() as conn:
        return list(
            await conn.execute(
                sa.text("SELECT * FROM webhook_deliveries ORDER BY operation_event_id")
            )
        )


def _verify(secret: str, headers: dict[str, str], body: bytes) -> None:
    """The openai SDK verifies Standard Webhooks signatures: an outside judge of ours."""
    OpenAI(api_key="unused").webhooks.verify_signature(body, headers, secret=secret)


async def test_every_status_change_is_posted_signed_in_order(
    engine: AsyncEngine, receiver: tuple[Receiver, str]
) -> None:
    rx, url = receiver
    sub = await _subscribe(engine, url)
    call_id = await make_call(engine)
    op_id = await admitted(engine, call_id)
    await finish(engine, op_id)
    rows = await _outbox(engine)
    assert [r.payload["data"]["status"] for r in rows] == ["admitted", "running", "committed"]
    seqs = [r.payload["data"]["sequence"] for r in rows]
    assert seqs == sorted(seqs) and len(set(seqs)) == 3
    async with httpx.AsyncClient() as http:
        for row in rows:
            result = await webhooks.send(engine, row.id, http)
            assert result is not None and result.state == "delivered"
    assert len(rx.received) == 3
    for (headers, body), row in zip(rx.received, rows, strict=True):
        _verify(sub.secret, headers, body)
        assert headers["webhook-id"] == f"msg_{row.id.hex}"
        event = json.loads(body)
        assert event["type"] == "operation.status_changed"
        assert event["data"]["operation_id"] == str(op_id)
    committed = json.loads(rx.received[-1][1])["data"]
    assert committed["previous_status"] == "running" and committed["reference"] == "BK7QX2MHN4"
    with pytest.raises(Exception, match="signature"):
        _verify(webhooks.new_secret(), rx.received[0][0], rx.received[0][1])


async def test_the_outbox_row_rolls_back_with_the_change(
    engine: AsyncEngine, receiver: tuple[Receiver, str]
) -> None:
    _, url = receiver
    await _subscribe(engine, url)
    call_id = await make_call(engine)
    op_id = await admitted(engine, call_id)
    from tools import ledger

    class Abort(Exception):
        pass

    with pytest.raises(Abort):
        async with engine.begin() as conn:
            await ledger.transition(conn, op_id, S.ADMITTED, S.RUNNING, actor="w", reason="go")
            raise Abort
    assert [r.payload["data"]["status"] for r in await _outbox(engine)] == ["admitted"]


async def test_a_failing_endpoint_is_retried_with_backoff_with_the_same_id_and_logged(
    engine: AsyncEngine, receiver: tuple[Receiver, str]
) -> None:
    rx, url = receiver
    rx.statuses = [500, 503]
    sub = await _subscribe(engine, url)
    await admitted(engine, await make_call(engine))
    (row,) = await _outbox(engine)
    policy = webhooks.RetryPolicy(max_attempts=5, base_s=1.0, jitter=0.0)
    results = []
    async with httpx.AsyncClient() as http:
        for _ in range(3):
            results.append(await webhooks.send(engine, row.id, http, policy, random.Random(1)))
    assert [(r.state, r.status_code) for r in results if r] == [
        ("pending", 500),
        ("pending", 503),
        ("delivered", 200),
    ]
    first, second = results[0], results[1]
    assert first is not None and second is not None
    assert first.retry_at is not None and second.retry_at is not None
    # Exponential: 1 s after the first failure, 2 s after the second (no jitter here).
    assert (second.retry_at - first.retry_at).total_seconds() >= 0.9
    async with engine.connect() as conn:
        scheduled = await conn.scalar(
            sa.text(
                "SELECT count(*) FROM procrastinate_jobs "
                "WHERE task_name = 'send_webhook' AND scheduled_at IS NOT NULL"
            )
        )
    assert scheduled == 2  # each retry is a job scheduled for its time
    assert {h["webhook-id"] for h, _ in rx.received} == {f"msg_{row.id.hex}"}
    async with engine.connect() as conn:
        log = await webhooks.delivery_log(conn, sub.id)
    assert [(a["attempt"], a["status_code"]) for a in log[0]["attempts"]] == [
        (1, 500),
        (2, 503),
        (3, 200),
    ]
    assert log[0]["state"] == "delivered"


async def test_gone_stops_the_subscription_and_attempts_run_out(
    engine: AsyncEngine, receiver: tuple[Receiver, str]
) -> None:
    rx, url = receiver
    rx.statuses = [410]
    sub = await _subscribe(engine, url)
    await admitted(engine, await make_call(engine))
    (row,) = await _outbox(engine)
    async with httpx.AsyncClient() as http:
        result = await webhooks.send(engine, row.id, http)
    assert result is not None and result.state == "failed"
    async with engine.connect() as conn:
        again = await webhooks.get_subscription(conn, sub.id)
    assert again is not None and not again.active
    await admitted(engine, await make_call(engine))
    assert len(await _outbox(engine)) == 1  # nothing more for a disabled subscription


async def test_two_workers_never_post_the_same_change_at_once(
    engine: AsyncEngine, receiver: tuple[Receiver, str]
) -> None:
    rx, url = receiver
    rx.gate = asyncio.Event()
    await _subscribe(engine, url)
    await admitted(engine, await make_call(engine))
    (row,) = await _outbox(engine)
    async with httpx.AsyncClient() as http:
        first = asyncio.create_task(webhooks.send(engine, row.id, http))
        while not rx.received:  # noqa: ASYNC110 - the receiver has no event of its own
            await asyncio.sleep(0.01)
        second = await webhooks.send(engine, row.id, http)
        rx.gate.set()
        done = await first
    assert second is None  # the row was being sent: nothing to do
    assert done is not None and done.state == "delivered"
    assert len(rx.received) == 1


async def test_subscriptions_through_the_api_and_the_configuration(
    engine: AsyncEngine, receiver: tuple[Receiver, str]
) -> None:
    rx, url = receiver
    configured = json.dumps([{"url": url + "?from=config", "secret": webhooks.new_secret()}])
    async with (
        running_service(engine, webhooks=configured, with_worker=True) as service,
        httpx.AsyncClient(base_url=service.url, auth=CONSOLE) as http,
    ):
        bad = await http.post("/api/webhooks", json={"url": "ftp://example.com/x"})
        assert bad.status_code == 400
        made = await http.post("/api/webhooks", json={"url": url, "description": "crm"})
        assert made.status_code == 201
        secret = made.json()["secret"]
        assert secret.startswith("whsec_")
        listed = (await http.get("/api/webhooks")).json()["webhooks"]
        assert sorted(w["source"] for w in listed) == ["api", "config"]
        assert all("secret" not in w for w in listed)
        op_id = await admitted(engine, await make_call(engine))
        # The in-process worker sends both (the job was queued with the change).
        while len(rx.received) < 2:  # noqa: ASYNC110 - the receiver has no event of its own
            await asyncio.sleep(0.02)
        sub_id = made.json()["id"]
        # The receiver answers before the worker records the answer: wait for the record.
        for _ in range(500):
            log = (await http.get(f"/api/webhooks/{sub_id}/deliveries")).json()["deliveries"]
            if log and all(d["state"] != "sending" for d in log):
                break
            await asyncio.sleep(0.02)
        assert [(d["operation_id"], d["status"], d["state"]) for d in log] == [
            (str(op_id), "admitted", "delivered")
        ]
        gone = await http.delete(f"/api/webhooks/{sub_id}")
        assert gone.status_code == 200 and gone.json()["active"] is False
        missing = await http.get(f"/api/webhooks/{uuid.uuid4()}/deliveries")
        assert missing.status_code == 404
    config_secret = json.loads(configured)[0]["secret"]
    assert sorted(rx.queries) == ["", "from=config"]
    for (headers, body), query in zip(rx.received, rx.queries, strict=True):
        _verify(config_secret if query == "from=config" else secret, headers, body)
