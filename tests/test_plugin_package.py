"""A deployment's own tools, in a package outside the repository, loaded by `TOOLS`.

The test writes a small package (loyalty points: a read and a confirmed, idempotent
mutation against the company's own REST API) into a temporary directory, starts
`voice-agent serve` in a subprocess with `TOOLS=acme_loyalty:catalog` and that directory on
its PYTHONPATH, and places a call: the balance is read inline, the redemption is read back,
confirmed, executed by the in-process worker at the company's API with the idempotency key,
and announced.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import textwrap
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import sqlalchemy as sa
from fastapi import FastAPI, Header
from fastapi.responses import JSONResponse
from sqlalchemy.ext.asyncio import AsyncEngine

from telephony.sim.fake_caller import FakeTwilioCaller
from telephony.sim.fake_twilio_api import FakeTwilioApi
from telephony.sim.scenario import Scenario
from telephony.sim.simulator import RealtimeSimulator
from tests.e2e_support import AUTH_TOKEN, wait_until
from tests.server_proc import free_port
from tests.sor_support import AppServer
from tests.test_e2e_booking import heard_text, operations_of, tool_calls_of

ROOT = Path(__file__).resolve().parent.parent

PLUGIN = '''
"""Acme loyalty points: a deployment's own tools, written against the voice-agent engine."""

from collections.abc import Mapping
from typing import Any

import httpx
from pydantic import BaseModel, ConfigDict, Field

from tools.catalog import Catalog, CatalogContext
from tools.errors import ProviderError
from tools.provider import ActionResult, Finding, Outcome
from tools.registry import RetryPolicy, ToolKind, ToolSpec


class BalanceArgs(BaseModel):
    model_config = ConfigDict(extra="forbid", str_strip_whitespace=True)
    member_id: str = Field(min_length=4, max_length=12, description="The member number.")


class RedeemArgs(BalanceArgs):
    points: int = Field(ge=1, le=100000, description="How many points to redeem.")


class AcmeRewards:
    """The provider: Acme's REST API, with its idempotency keys and key lookup."""

    def __init__(self, base_url: str) -> None:
        self.http = httpx.AsyncClient(base_url=base_url, timeout=5.0)

    async def aclose(self) -> None:
        await self.http.aclose()

    async def read(self, spec: ToolSpec, args: BaseModel) -> Mapping[str, Any]:
        resp = await self.http.get(f"/members/{args.member_id}")
        if resp.status_code == 404:
            return {"found": False}
        resp.raise_for_status()
        return resp.json()

    async def perform(self, op, spec, *, timeout_s, callback_url=None) -> ActionResult:
        try:
            resp = await self.http.post(
                f"/members/{op.args['member_id']}/redemptions",
                json={"points": op.args["points"]},
                headers={"Idempotency-Key": op.idempotency_key},
                timeout=timeout_s,
            )
        except httpx.ConnectError:
            return ActionResult(Outcome.failed_retryable, error="not sent")
        except httpx.HTTPError:
            return ActionResult(Outcome.unknown, error="no answer")
        if resp.status_code == 201:
            body = resp.json()
            return ActionResult(Outcome.committed, result=body, reference=body["id"])
        if resp.status_code in (400, 404, 409, 422):
            return ActionResult(Outcome.failed_final, error=resp.json().get("error"))
        return ActionResult(Outcome.unknown, error=f"http_{resp.status_code}")

    async def lookup(self, op, spec) -> Finding:
        try:
            resp = await self.http.get(f"/redemptions/{op.idempotency_key}")
        except httpx.HTTPError as exc:
            raise ProviderError("lookup failed", retryable=True) from exc
        if resp.status_code == 404:
            return Finding("not_found")
        body = resp.json()
        return Finding("applied", result=body, reference=body["id"])


def _balance(r: Mapping[str, Any]) -> dict[str, Any]:
    if r.get("found") is False:
        return {"status": "not_found", "message": "No member with that number."}
    return {"status": "ok", "message": f"The balance is {r['balance']} points."}


def catalog(ctx: CatalogContext) -> Catalog:
    label = "Acme Rewards"
    tools = [
        ToolSpec(
            name="points_balance",
            description="Tell a member their points balance. Call when they ask for it.",
            args_model=BalanceArgs,
            kind=ToolKind.READ,
            provider_action="acme.balance",
            deadline_s=3.0,
            shape_result=_balance,
            provider_label=label,
        ),
        ToolSpec(
            name="redeem_points",
            description="Redeem points for a member. Call only after they asked to redeem.",
            args_model=RedeemArgs,
            kind=ToolKind.MUTATION,
            provider_action="acme.redeem",
            provider_idempotent=True,
            needs_confirmation=True,
            retry=RetryPolicy(max_attempts=3, base_backoff_s=0.2),
            reconcile="acme.lookup_by_key",
            describe=lambda a: f"redeeming {a.points} points for member {a.member_id}",
            provider_label=label,
        ),
    ]
    return Catalog(
        tools,
        {"acme": AcmeRewards(ctx.environ["ACME_API_URL"])},
        name="acme",
        instructions=f"You are the phone assistant of {label} (tenant {ctx.tenant_id}).",
    )
'''


def acme_api() -> tuple[FastAPI, dict[str, Any]]:
    """Acme's own REST API (what the plugin talks to), recording what it did."""
    state: dict[str, Any] = {"balance": {"M1234": 5000}, "by_key": {}, "posts": []}
    app = FastAPI()

    @app.get("/members/{member_id}")
    async def member(member_id: str) -> JSONResponse:
        if member_id not in state["balance"]:
            return JSONResponse({"error": "not_found"}, status_code=404)
        return JSONResponse({"member_id": member_id, "balance": state["balance"][member_id]})

    @app.post("/members/{member_id}/redemptions")
    async def redeem(
        member_id: str, body: dict[str, Any], key: str = Header(alias="Idempotency-Key")
    ) -> JSONResponse:
        state["posts"].append(key)
        if key in state["by_key"]:
            return JSONResponse(state["by_key"][key], status_code=201)
        state["balance"][member_id] -= int(body["points"])
        done = {"id": f"RD{len(state['by_key']) + 1:04d}", "points": body["points"]}
        state["by_key"][key] = done
        return JSONResponse(done, status_code=201)

    @app.get("/redemptions/{key}")
    async def by_key(key: str) -> JSONResponse:
        if key not in state["by_key"]:
            return JSONResponse({"error": "not_found"}, status_code=404)
        return JSONResponse(state["by_key"][key])

    return app, state


SCENARIO = {
    "name": "acme",
    "greeting": {"text": "Acme Rewards, how can I help?", "audio_ms": 800},
    "steps": [
        {
            "caller_transcript": "What is my balance? Member M1234.",
            "function_call": {"name": "points_balance", "arguments": {"member_id": "M1234"}},
        },
        {"reply": {"text": "{output[message]}", "audio_ms": 1200}},
        {
            "caller_transcript": "Redeem 1500 points please.",
            "function_call": {
                "name": "redeem_points",
                "arguments": {"member_id": "M1234", "points": 1500},
            },
        },
        {"reply": {"text": "{output[readback]}", "audio_ms": 1500}},
        {
            "caller_transcript": "Yes.",
            "function_call": {
                "name": "confirm_operation",
                "arguments": {"operation_id": "{output[operation_id]}", "confirmed": True},
            },
        },
        {"reply": {"text": "Requested; not confirmed yet.", "audio_ms": 1000}},
        {"reply": {"text": "Acme has confirmed the redemption.", "audio_ms": 1000}},
    ],
    "fallback": {"text": "Anything else?", "audio_ms": 800},
}


@pytest.fixture
def plugin_dir(tmp_path: Path) -> Path:
    """The package, outside the repository (nothing of it is importable from here)."""
    root = tmp_path / "site"
    (root / "acme_loyalty").mkdir(parents=True)
    (root / "acme_loyalty" / "__init__.py").write_text(textwrap.dedent(PLUGIN))
    return root


@pytest.fixture
async def acme() -> AsyncIterator[tuple[AppServer, dict[str, Any]]]:
    app, state = acme_api()
    async with AppServer(app) as server:
        yield server, state


async def test_a_plugin_installed_outside_the_repo_is_loaded_by_import_path_and_runs_end_to_end(
    engine: AsyncEngine,
    clean_db: str,
    tmp_path: Path,
    plugin_dir: Path,
    acme: tuple[AppServer, dict[str, Any]],
) -> None:
    server, state = acme
    with pytest.raises(ImportError):
        __import__("acme_loyalty")  # not importable from the test process: only by TOOLS
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    async with RealtimeSimulator(Scenario.model_validate(SCENARIO)) as sim, FakeTwilioApi() as api:
        env = {
            **{
                k: v
                for k, v in os.environ.items()
                if not k.startswith(("OPENAI_", "TWILIO_", "TOOLS", "SOR_"))
            },
            "PYTHONPATH": os.pathsep.join([str(plugin_dir), str(ROOT)]),
            "TOOLS": "acme_loyalty:catalog",
            "ACME_API_URL": server.url,
            "TENANT_ID": "acme",
            "DATABASE_URL": clean_db,
            "OPENAI_API_KEY": "sk-test",
            "OPENAI_BASE_URL": sim.base_url,
            "TWILIO_AUTH_TOKEN": AUTH_TOKEN,
            "TWILIO_API_BASE_URL": api.base_url,
            "PORT": str(port),
            "PUBLIC_BASE_URL": base,
            "CONSOLE_PASSWORD": "plugin-test-password",
            "SWEEP_INTERVAL_S": "1",
            "LOG_LEVEL": "WARNING",
        }
        log = (tmp_path / "serve.log").open("wb")
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "app.cli", "serve",
            env=env, cwd=tmp_path, stdout=log, stderr=log,
        )  # fmt: skip
        try:
            async with httpx.AsyncClient(base_url=base) as http:

                async def ready() -> bool:
                    if proc.returncode is not None:
                        log.flush()
                        output = (tmp_path / "serve.log").read_text(errors="replace")
                        raise AssertionError(f"serve exited early:\n{output[-3000:]}")
                    try:
                        return (await http.get("/readyz")).status_code == 200
                    except httpx.TransportError:
                        return False

                await wait_until(ready, 60, "service ready")
            caller = FakeTwilioCaller(base, auth_token=AUTH_TOKEN)
            api.attach(caller)
            await caller.dial()
            await caller.wait_for(lambda c: c.heard_ms >= 760 and c.buffered_ms == 0, 15)
            await caller.play_speech(700)  # balance?

            async def call_id() -> str | None:
                async with engine.connect() as conn:
                    row = (
                        await conn.execute(
                            sa.text("SELECT id FROM calls WHERE call_sid = :s"),
                            {"s": caller.call_sid},
                        )
                    ).first()
                return str(row[0]) if row else None

            await wait_until(call_id, 15, "call recorded")
            cid = await call_id()
            assert cid is not None

            async def said(text: str) -> bool:
                return any(text in t for t in await heard_text(engine, cid))

            await wait_until(lambda: said("5000 points"), 20, "balance spoken")
            await caller.play_speech(700)  # redeem
            await wait_until(lambda: said("Please confirm: redeeming 1500"), 20, "readback")
            await caller.play_speech(500)  # yes

            async def committed() -> bool:
                ops = await operations_of(engine, cid)
                return bool(ops) and ops[0]["status"] == "committed"

            await wait_until(committed, 30, "redemption committed")
            await wait_until(lambda: said("Acme has confirmed"), 30, "confirmation announced")
            await caller.hangup()
            await caller.aclose()
            ops = await operations_of(engine, cid)
            calls = await tool_calls_of(engine, cid)
            session_update = next(
                e for _, e in sim.sessions[0].received if e.get("type") == "session.update"
            )
        finally:
            try:
                if proc.returncode is None:
                    proc.send_signal(signal.SIGINT)
                async with asyncio.timeout(30):
                    await proc.wait()
            finally:
                log.close()
    output = (tmp_path / "serve.log").read_text(errors="replace")
    assert proc.returncode == 0, output[-3000:]
    assert "Traceback" not in output, output[-3000:]
    # The plugin's tools were what the model was offered, with its persona.
    offered = {t["name"] for t in session_update["session"]["tools"]}
    assert offered == {"points_balance", "redeem_points", "confirm_operation"}
    assert "Acme Rewards (tenant acme)" in session_update["session"]["instructions"]
    # Read inline, then requested, confirmed and executed once with the operation's key.
    assert [(c["tool"], c["decision"]) for c in calls] == [
        ("points_balance", "allow"),
        ("redeem_points", "needs_confirmation"),
        ("confirm_operation", "allow"),
    ]
    assert calls[0]["output"]["message"] == "The balance is 5000 points."
    assert len(ops) == 1 and ops[0]["tool"] == "redeem_points"
    assert ops[0]["status"] == "committed" and ops[0]["provider_ref"] == "RD0001"
    assert ops[0]["tenant_id"] == "acme"
    assert state["posts"] == [ops[0]["idempotency_key"]]
    assert state["balance"]["M1234"] == 3500
